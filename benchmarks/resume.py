"""Time to the first optimizer step of a resumed run, at 0%, 50% and 95% of an epoch.

The data is a user's own map-style dataset, registered by name as users register theirs
(``register_dataset``), whose ``__getitem__`` costs real time: it inflates a zlib-compressed
3x96x96 image, converts it to float, resizes it to 32x32 and normalises it (~60-80 us a sample
here, what decoding a small PNG costs). A resumed run skips the epoch's batches already trained
without loading them (Accelerate's ``skip_first_batches`` skips the sampler's indices, not the
samples), so the time to the first step should not depend on where in the epoch the run resumes;
loading the skipped batches instead would cost up to 95% of an epoch's loading (~14 s here, 25-50x
the ~0.3 s a resume takes).

Set-up, not timed: one run of 2 epochs with checkpoints at the end of epoch 1 (0% of epoch 2) and
at 50% and 95% of epoch 2 (``SCHEDULE.CHECKPOINT.INTERVAL_STEPS`` at their greatest common divisor
with ``MID_EPOCH: true``, all kept), trained with the decoding turned off so that it takes seconds.

Timed: a fresh process per sample (as a rerun after a crash starts), pinned to one core with one
torch thread, builds the Trainer and calls ``fit(resume_from=<checkpoint>)``; the time runs from
``fit()`` (the imports and the Trainer's construction do not know the position) to the end of the
first optimizer step after the resume: verifying and loading the checkpoint, the skip, the first
batch, the step. The step is seen through the ``fault_point`` name the trainer module imports and
calls after every optimizer step: the worker replaces that name for its run (no code is added to
the trainer) and ends the run there. The positions are timed in turn within a round (the first
one rotating), each round's 50% and 95% are divided by its 0%, and the rows are the medians of
those paired ratios; an A/A row times 0% against a second 0% in the same rounds, the noise floor.
The smoke run does it all in the calling process (a process start costs seconds of imports).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from functools import reduce
from pathlib import Path
from typing import Any

from .common import Row, paired, pin_to_one_core, row

BENCHMARK = "resume"
REFERENCE = "resume at 0% of the epoch"
REPO = Path(__file__).resolve().parents[1]
POSITIONS = {"0%": 0.0, "50%": 0.5, "95%": 0.95}
AA = "0% again"  # A/A control: a second 0% sample in each round
# Flat in the position, within the +-10% this machine's noise leaves on paired medians of a ~0.3 s
# resume (the A/A row shows the floor); loading the skipped batches would be 25-50x at full size.
TARGET_RATIO = 1.10

# (samples, batch size, rounds): 400 optimizer steps per epoch at full size.
FULL = (200_000, 500, 7)
SMOKE = (2_000, 50, 1)

SIDE, OUT_SIDE, CLASSES = 96, 32, 10
DATASET_NAME, MODEL_NAME = "bench_decoded_images", "bench_linear"


# -- the user's data and model -------------------------------------------------------------------
def _dataset_class() -> Any:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import Dataset

    class DecodedImages(Dataset[dict[str, Any]]):
        """``samples`` images of CLASSES classes, each decoded at ``__getitem__`` as an image file
        would be. ``decode=False`` (the set-up run) returns the first decode's result instead."""

        def __init__(self, samples: int, decode: bool = True) -> None:
            self.samples, self.decode = samples, decode
            pixels = bytes((i * 7 + (i >> 5)) % 251 for i in range(3 * SIDE * SIDE))
            self.compressed = zlib.compress(pixels, 6)
            self.mean = torch.full((3, 1, 1), 0.5)
            self.decoded = self._decode()

        def _decode(self) -> Any:
            raw = bytearray(zlib.decompress(self.compressed))
            image = torch.frombuffer(raw, dtype=torch.uint8).view(1, 3, SIDE, SIDE).float().div_(255)
            small = F.interpolate(image, size=(OUT_SIDE, OUT_SIDE), mode="bilinear", align_corners=False)
            return small[0].sub_(self.mean)

        def __len__(self) -> int:
            return self.samples

        def __getitem__(self, index: int) -> dict[str, Any]:
            image = self._decode() if self.decode else self.decoded
            return {"image": image, "labels": index % CLASSES}

    return DecodedImages


def _register(decode: bool) -> None:
    """Registers the dataset and the model by name, as a user's training script does; ``decode``
    is not in the config, so that the set-up run's checkpoints resume without a config change."""
    from torch import nn

    from linnaeus_accel.data import register_dataset
    from linnaeus_accel.models import register_model

    images = _dataset_class()

    @register_dataset(DATASET_NAME)
    def build_images(config: Any, split: str) -> Any:
        return images(**config.DATA.DATASET.OPTIONS, decode=decode)

    @register_model(MODEL_NAME)
    def build_linear(config: Any, dataset: Any) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * OUT_SIDE * OUT_SIDE, CLASSES))


def checkpoint_steps(samples: int, batch: int) -> dict[str, int]:
    """The global step of each position's checkpoint: epoch 2 at 0%, 50% and 95%."""
    per_epoch = math.ceil(samples / batch)
    return {name: per_epoch + round(fraction * per_epoch) for name, fraction in POSITIONS.items()}


def config_dict(root: Path, name: str, samples: int, batch: int) -> dict[str, Any]:
    every = reduce(math.gcd, checkpoint_steps(samples, batch).values())
    return {
        "EXPERIMENT": {"NAME": name, "SEED": 0},
        "ENV": {"OUTPUT": {"BASE_DIR": str(root)}},
        "DATA": {
            "BATCH_SIZE": batch,
            "DATASET": {"NAME": DATASET_NAME, "OPTIONS": {"samples": samples}},
        },
        "MODEL": {"TYPE": MODEL_NAME},
        "TASK": {"NAME": "classification"},
        "TRAIN": {"EPOCHS": 2},
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


# -- one process: the set-up run and/or timed resumes --------------------------------------------
class FirstStepTaken(BaseException):
    """Ends a timed run at its first optimizer step; a BaseException, so that the trainer's
    failure handling (``except Exception``) does not record it as a failed run."""


def seconds_to_first_step(
    trainer_module: Any,
    resumes: list[tuple[str, str]],
    make_trainer: Callable[[str], Any],
    before_each: Callable[[], None] = lambda: None,
) -> list[float]:
    """For each (run directory name, checkpoint) of ``resumes``: the seconds from ``fit()`` to the
    end of the resumed run's first optimizer step. The trainer module's ``fault_point`` (called
    after every optimizer step) ends each run there; ``before_each`` runs untimed before each."""
    real_fault_point = getattr(trainer_module, "fault_point")  # noqa: B009
    started = 0.0
    seconds: list[float] = []

    def first_step(name: str) -> None:
        if name != "optimizer_step":
            real_fault_point(name)
            return
        seconds.append(time.perf_counter() - started)
        raise FirstStepTaken

    setattr(trainer_module, "fault_point", first_step)  # noqa: B010
    try:
        for name, checkpoint in resumes:
            timed = make_trainer(name)
            before_each()
            started = time.perf_counter()
            try:
                timed.fit(resume_from=checkpoint)
            except FirstStepTaken:
                continue
            raise RuntimeError(f"the run resumed from {checkpoint} ended without an optimizer step")
    finally:
        setattr(trainer_module, "fault_point", real_fault_point)  # noqa: B010
    return seconds


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """The set-up run if ``spec["setup"]`` (and the cost of one ``__getitem__``), then one timed
    resume per ``spec["resumes"]`` entry (run directory name, checkpoint), in this order:
    ``{"getitem_s": ..., "seconds": [...]}``."""
    pin_to_one_core()
    from accelerate.state import AcceleratorState, GradientState

    import linnaeus_accel.training.trainer as trainer_module
    from linnaeus_accel.config import load_config
    from linnaeus_accel.data import build_dataset
    from linnaeus_accel.models import build_model

    def trainer(name: str, decode: bool) -> Any:
        AcceleratorState._reset_state(True)  # one Trainer after another in this process
        GradientState._reset_state()
        _register(decode=decode)
        config = load_config(config_dict(Path(spec["root"]), name, spec["samples"], spec["batch"]))
        train = build_dataset(config, "train")
        return trainer_module.Trainer(config, build_model(config, train), train)

    out: dict[str, Any] = {}
    if spec["setup"]:  # to the end: every checkpoint committed
        trainer("setup", decode=False).fit()
        images = _dataset_class()(200)
        tic = time.perf_counter()
        for i in range(len(images)):
            images[i]
        out["getitem_s"] = (time.perf_counter() - tic) / len(images)
    seconds = seconds_to_first_step(trainer_module, spec["resumes"], lambda name: trainer(name, decode=True))
    return {**out, "seconds": seconds}


def worker(spec: dict[str, Any]) -> None:
    """``measure`` in a fresh interpreter (``python -m benchmarks.resume SPEC``): prints its result
    as one JSON line and leaves the process."""
    print(json.dumps(measure(spec)), flush=True)
    # Nothing after the first steps is timed or needed: no interpreter shutdown for the runs left open.
    os._exit(0)


def _in_worker(spec: dict[str, Any]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LINNAEUS_ACCEL_", "ACCELERATE_"))}
    env.update(PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.resume", json.dumps(spec)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{") and '"seconds"' in line]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"resume worker {spec} failed (exit {done.returncode}): {done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def run(smoke: bool) -> list[Row]:
    samples, batch, rounds = SMOKE if smoke else FULL
    steps = checkpoint_steps(samples, batch)
    names = [*POSITIONS, AA]
    times: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        checkpoints = Path(tmp) / "setup" / "checkpoints"
        spec = {"root": tmp, "samples": samples, "batch": batch}
        plan = []  # (position, run directory name, checkpoint), in the order they are timed
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # who goes first rotates
                step = steps["0%" if name == AA else name]
                # A run directory of its own: the set-up run's has finished and is not resumed.
                plan.append((name, f"round{r}-{names.index(name)}", str(checkpoints / f"step_{step:08d}")))
        started = time.perf_counter()
        if smoke:  # all in this process: a process start costs seconds of imports
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                setup = measure({**spec, "setup": True, "resumes": [p[1:] for p in plan]})
            seconds = setup["seconds"]
        else:  # the set-up run, then a fresh process per timed resume, as a user's rerun starts
            setup = _in_worker({**spec, "setup": True, "resumes": []})
            seconds = [_in_worker({**spec, "setup": False, "resumes": [p[1:]]})["seconds"][0] for p in plan]
        elapsed = time.perf_counter() - started
        for (name, _, _), s in zip(plan, seconds, strict=True):
            times[name].append(s)
    per_item = setup["getitem_s"]
    per_epoch = math.ceil(samples / batch)
    note = (
        f"{samples} samples, batch {batch}, {per_epoch} steps per epoch, __getitem__ {per_item * 1e6:.0f} us "
        f"(one epoch's loading: {per_item * samples:.1f} s); {rounds} round{'s' if rounds > 1 else ''}, "
        f"{'in one process' if smoke else 'a fresh process each'}; {elapsed:.0f} s in all"
    )
    rows: list[Row] = []
    for name in names[1:]:
        stats = paired(times[name], times["0%"])
        control = name == AA
        rows.append(
            row(
                BENCHMARK,
                "A/A: 0% vs 0% (noise floor)" if control else f"resume at {name} of the epoch",
                "s from fit() to the end of the first optimizer step",
                REFERENCE,
                **stats,
                target=None if control else f"ratio <= {TARGET_RATIO:.2f}",
                ok=None if control else stats["ratio"] <= TARGET_RATIO,
                note=note,
            )
        )
    return rows


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
