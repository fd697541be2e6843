"""Time to the first optimizer step of a resumed run at 0%, 50% and 95% of an epoch, for the
built-in data at scale: ``token_files``, a ``mixture`` of two ``token_files`` sources, and a
sharded stream (``hf_dataset`` with ``streaming: true`` over JSON Lines files).

The method is ``resume.py``'s: a set-up run (not timed, on every core) trains into epoch 2 with a
checkpoint at the end of epoch 1 (0% of epoch 2) and at 50% and 95% of epoch 2; then a fresh
process per sample, pinned to one core with one torch thread, builds the Trainer and calls
``fit(resume_from=<checkpoint>)``, timed from ``fit()`` to the end of the first optimizer step
(seen through the trainer module's ``fault_point`` name, replaced in that process). Rounds of 0%,
50%, 95% and 0% again (the A/A control), the first rotating; rows: the medians of each round's
ratios to its 0%. Target: ratio <= 1.10. Two sources of noise that have nothing to do with the
data are taken out of the timed runs: before the timer starts, ``gc.collect()`` and ``gc.freeze()``
(a full collection of the millions of objects torch's imports leave, ~0.15 s here, otherwise falls
inside some timed runs and not others, at the same place for the same position); and the run's
schedule plot is not drawn (``outputs._draw_schedule`` replaced in the worker: ~0.5 s of CPU on a
thread that would share the run's one core for a varying part of its ~0.15 s).

The model is a registered tiny causal LM (an embedding of 16 and a linear head over 257 byte-level
ids), task ``causal_lm``, so that a step costs little beside the data; windows of 5 tokens and 240
steps an epoch (the batch size chosen to give them: ~1,000 windows), so that an epoch holds
~250,000 windows and the set-up runs take seconds. A resume that loaded the skipped windows would
add ~1.5 s at 95% here; one that listed their indices through a sampler, ~0.05-0.1 s.

- ``token_files``: one 2 MB file (2^20 random ids), 0 DataLoader workers: the epoch-seeded sampler
  (a keyed permutation above 65,536 windows) resumes at the position (``resume_at``).
- ``mixture``: two such files of 1.5 and 0.5 MB, weights 0.7 and 0.3, 0 workers: the mixture's own
  sampler resumes at the position.
- ``stream``: 4 JSON Lines files of 125 documents of 1,000 characters (byte-level tokens, packed
  within each file: ~125,000 windows a pass), 2 DataLoader workers (2 readers, 2 files each): each
  reader's position is restored from its shard's state (the Hugging Face shard's own state and the
  packing carry). A stream without ``__len__`` trains by ``TRAIN.STEPS``; its steps per pass are
  computed from the files (and the checkpoint at 0% is the pass boundary's: no loader state).

The smoke run does it all in the calling process, tiny, ``token_files`` and ``mixture`` only (a
stream's ``datasets`` start-up costs seconds).
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from functools import reduce
from pathlib import Path
from typing import Any, NamedTuple

from .common import Row, paired, pin_to_one_core, row
from .corpora import make_jsonl_shards, make_token_corpus
from .resume import AA, POSITIONS, TARGET_RATIO, seconds_to_first_step

BENCHMARK = "resume_data"
REPO = Path(__file__).resolve().parents[1]
MODEL_NAME = "bench_tiny_lm"
SEQ_LEN, VOCAB, WIDTH = 5, 257, 16


class Sizes(NamedTuple):
    tokens: tuple[int, int, int]  # ids in the files of token_files, mixture source a, source b
    stream: tuple[int, int, int]  # the stream's files, documents per file, characters per document
    steps: int  # optimizer steps per epoch (the batch size is chosen to give them)
    rounds: int


FULL = Sizes(tokens=(2**20, 3 * 2**18, 2**18), stream=(4, 125, 1000), steps=240, rounds=7)
SMOKE = Sizes(tokens=(2**13, 3 * 2**11, 2**11), stream=(4, 20, 200), steps=20, rounds=1)
CASES = ("token_files", "mixture", "stream")
READERS = 2  # the stream's: 1 process x 2 DataLoader workers


def _register() -> None:
    from torch import nn

    from linnaeus_accel.models import register_model

    @register_model(MODEL_NAME)
    def build_tiny_lm(config: Any, dataset: Any) -> nn.Module:
        return nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB))


def dataset_config(case: str, data: dict[str, Any]) -> dict[str, Any]:
    """``DATA.DATASET`` of a case; ``data``: the files the parent wrote."""
    if case == "token_files":
        options = {"paths": [data["token_files"]], "seq_len": SEQ_LEN}
        return {"NAME": "token_files", "VAL_FRACTION": 0.01, "OPTIONS": options}
    if case == "mixture":
        sources = [
            {
                "name": "token_files",
                "label": label,
                "weight": weight,
                "options": {"paths": [path], "seq_len": SEQ_LEN},
            }
            for label, weight, path in (("a", 0.7, data["mixture"][0]), ("b", 0.3, data["mixture"][1]))
        ]
        return {"NAME": "mixture", "VAL_FRACTION": 0.01, "OPTIONS": {"sources": sources}}
    options = {"format": "json", "data_files": data["stream"][:-1], "val_files": data["stream"][-1]}
    return {"NAME": "hf_dataset", "OPTIONS": {**options, "streaming": True, "seq_len": SEQ_LEN}}


def config_dict(spec: dict[str, Any], name: str) -> dict[str, Any]:
    case, steps = spec["case"], spec["steps"]
    every = reduce(math.gcd, steps.values())
    # Past the last checkpoint: a stream without __len__ trains by steps.
    length = {"STEPS": 2 * steps["0%"]} if case == "stream" else {"EPOCHS": 2}
    return {
        "EXPERIMENT": {"NAME": name, "SEED": 0},
        "ENV": {"OUTPUT": {"BASE_DIR": spec["root"]}},
        "DATA": {
            "BATCH_SIZE": spec["batch"],
            "NUM_WORKERS": 2 if case == "stream" else 0,
            "DATASET": dataset_config(case, spec["data"]),
        },
        "MODEL": {"TYPE": MODEL_NAME},
        "TASK": {"NAME": "causal_lm"},
        "TRAIN": {**length, "AUTO_RESUME": False},
        "LR_SCHEDULER": {"NAME": "cosine", "BASE_LR": 0.01, "WARMUP_FRACTION": 0.05},
        "SCHEDULE": {
            "VALIDATION": {"INTERVAL_EPOCHS": None},
            "CHECKPOINT": {
                "INTERVAL_EPOCHS": None,
                "INTERVAL_STEPS": every,
                "MID_EPOCH": True,
                "KEEP_TOP_N": 0,
                "KEEP_LAST_N": 0,
            },
            "METRICS": {"STEP_INTERVAL": 50},
        },
    }


def epoch_size(case: str, data: dict[str, Any], stream: tuple[int, int, int]) -> int:
    """Samples per epoch of a map-style case; windows per reader and pass of the stream (1 process
    x 2 workers, each reading half the files), computed from the files."""
    if case == "stream":
        files, documents, characters = stream
        tokens = documents * (characters + 1)  # every document and its end-of-document id
        return files // READERS * ((tokens - 1) // (SEQ_LEN - 1))  # windows are packed within a file
    from linnaeus_accel.config import load_config
    from linnaeus_accel.data import build_dataset

    config = load_config({"DATA": {"DATASET": dataset_config(case, data)}})
    return len(build_dataset(config, "train"))


def epoch_plan(case: str, size: int, per_epoch: int) -> tuple[int, dict[str, int]]:
    """The batch size that makes ``per_epoch`` steps an epoch, and each position's checkpoint step."""
    per_reader = per_epoch // READERS if case == "stream" else per_epoch
    batch = math.ceil(size / per_reader)
    if math.ceil(size / batch) != per_reader:
        raise ValueError(f"{case}: {size} samples give no batch size of {per_reader} steps an epoch")
    return batch, {name: per_epoch + round(f * per_epoch) for name, f in POSITIONS.items()}


# -- one process: the set-up run and/or timed resumes --------------------------------------------
def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """The set-up run if ``spec["setup"]``, then one timed resume per ``spec["resumes"]`` entry (run
    directory name, checkpoint): ``{"seconds": [...]}``. The timed resumes run on one core with one
    torch thread (their DataLoader workers too); the set-up run on every core."""
    from accelerate.state import AcceleratorState, GradientState

    import linnaeus_accel.run_directory.outputs as outputs_module
    import linnaeus_accel.training.trainer as trainer_module
    from linnaeus_accel.config import load_config
    from linnaeus_accel.data import build_dataset
    from linnaeus_accel.models import build_model

    _register()
    # Each run's schedule plot (~0.5 s of CPU on a thread: matplotlib) would share the timed run's
    # one core for a varying part of its ~0.15 s: not drawn here (it does not depend on the data).
    setattr(outputs_module, "_draw_schedule", lambda *args: None)  # noqa: B010

    def trainer(name: str) -> Any:
        AcceleratorState._reset_state(True)  # one Trainer after another in this process
        GradientState._reset_state()
        config = load_config(config_dict(spec, name))
        train = build_dataset(config, "train")
        return trainer_module.Trainer(config, build_model(config, train), train)

    if spec["setup"]:
        trainer("setup").fit()
    affinity = os.sched_getaffinity(0)
    pin_to_one_core()

    def untimed() -> None:
        # A full collection of the millions of objects the imports left (~0.15 s here) would fall
        # into some timed runs and not others, at the same place for the same position: frozen.
        gc.collect()
        gc.freeze()

    try:
        seconds = seconds_to_first_step(trainer_module, spec["resumes"], trainer, before_each=untimed)
    finally:
        os.sched_setaffinity(0, affinity)
    return {"seconds": seconds}


def _start(spec: dict[str, Any]) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LINNAEUS_ACCEL_", "ACCELERATE_"))}
    env.update(PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    command = [sys.executable, "-m", "benchmarks.resume_data", json.dumps(spec)]
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _result(process: subprocess.Popen[str], spec: dict[str, Any]) -> dict[str, Any]:
    stdout, stderr = process.communicate()
    lines = [line for line in stdout.splitlines() if line.startswith('{"seconds"')]
    if process.returncode != 0 or not lines:
        raise RuntimeError(f"worker {spec['case']} failed (exit {process.returncode}): {stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def write_data(root: Path, sizes: Sizes) -> dict[str, Any]:
    token_tokens, mixture_a, mixture_b = sizes.tokens
    files, documents, characters = sizes.stream
    paths = {name: root / f"{name}.bin" for name in ("token_files", "mixture_a", "mixture_b")}
    for path, tokens in zip(paths.values(), (token_tokens, mixture_a, mixture_b), strict=True):
        make_token_corpus(path, tokens, vocab_size=VOCAB)
    return {
        "token_files": str(paths["token_files"]),
        "mixture": [str(paths["mixture_a"]), str(paths["mixture_b"])],
        # The last file is the validation file (hf_dataset's val_files), not trained on.
        "stream": make_jsonl_shards(root / "stream", files + 1, documents, characters),
    }


def run(smoke: bool) -> list[Row]:
    sizes = SMOKE if smoke else FULL
    rounds = sizes.rounds
    cases = CASES[:2] if smoke else CASES
    names = [*POSITIONS, AA]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-resume-data-") as tmp:
        data = write_data(Path(tmp), sizes)
        specs: dict[str, dict[str, Any]] = {}
        for case in cases:
            size = epoch_size(case, data, sizes.stream)
            batch, steps = epoch_plan(case, size, sizes.steps)
            root = str(Path(tmp) / case)
            specs[case] = {"case": case, "root": root, "data": data, "batch": batch, "steps": steps}
        started = time.perf_counter()
        plans: dict[str, list[tuple[str, str, str]]] = {}
        for case, spec in specs.items():
            checkpoints = Path(spec["root"]) / "setup" / "checkpoints"
            plans[case] = []  # (position, run directory name, checkpoint), in the order they are timed
            for r in range(rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    step = spec["steps"]["0%" if name == AA else name]
                    plans[case].append(
                        (name, f"round{r}-{names.index(name)}", str(checkpoints / f"step_{step:08d}"))
                    )
        seconds: dict[str, list[float]] = {}
        if smoke:  # all in this process: a process start costs seconds of imports
            for case, spec in specs.items():
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    seconds[case] = measure({**spec, "setup": True, "resumes": [p[1:] for p in plans[case]]})[
                        "seconds"
                    ]
        else:  # the set-up runs side by side (not timed), then a fresh process per timed resume
            setups = {case: _start({**spec, "setup": True, "resumes": []}) for case, spec in specs.items()}
            for case, process in setups.items():
                _result(process, specs[case])
            setup_s = time.perf_counter() - started
            for case, spec in specs.items():
                seconds[case] = []
                for plan in plans[case]:
                    one = {**spec, "setup": False, "resumes": [plan[1:]]}
                    seconds[case] += _result(_start(one), one)["seconds"]
        elapsed = time.perf_counter() - started
        for case, spec in specs.items():
            times: dict[str, list[float]] = {name: [] for name in names}
            for (name, _, _), s in zip(plans[case], seconds[case], strict=True):
                times[name].append(s)
            per_epoch, batch = spec["steps"]["0%"], spec["batch"]
            note = (
                f"{per_epoch} steps of {batch} windows of {SEQ_LEN} tokens per epoch; {rounds} round"
                f"{'s' if rounds > 1 else ''}, {'in one process' if smoke else 'a fresh process each'}; "
                + ("" if smoke else f"set-up runs {setup_s:.0f} s, ")
                + f"{elapsed:.0f} s in all"
            )
            for name in names[1:]:
                stats = paired(times[name], times["0%"])
                control = name == AA
                rows.append(
                    row(
                        BENCHMARK,
                        f"{case}: {'A/A: 0% vs 0%' if control else f'resume at {name} of the epoch'}",
                        "s from fit() to the end of the first optimizer step",
                        "resume at 0% of the epoch",
                        **stats,
                        target=None if control else f"ratio <= {TARGET_RATIO:.2f}",
                        ok=None if control or smoke else stats["ratio"] <= TARGET_RATIO,
                        note=note,
                    )
                )
    return rows


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]))), flush=True)
    os._exit(0)
