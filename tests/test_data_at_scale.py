"""Data at scale, end to end, as a user runs it (``linnaeus-accel train`` command lines; docs/semantics.md §7):

- a weighted mixture of two ``token_files`` corpora: the share of each source in the trained steps
  follows the weights (far inside a binomial tolerance: the interleave is deterministic) and is the
  same on 1 process x accumulation 2 and 2 processes x 1; killed -9 at random steps and rerun, it
  ends byte-identical to the uninterrupted run;
- mid-epoch validation (``SCHEDULE.VALIDATION.MID_EPOCH``): killed inside a mid-epoch pass, the
  rerun runs only the passes still missing and ends byte-identical;
- bad input exits 2 naming the key, with nothing written.

The runs that are killed or launched on two processes are processes of their own; the references,
the resumes and the refusals of one process run in this process, whose torch is imported already
(that import is most of a short run's cost in a process of its own), through the same command line
(``run_here``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.configs import CFG, LM_CFG
from helpers.in_process import run_here
from helpers.processes import after_commits
from helpers.runs import (
    Result,
    TrainRun,
    assert_resumed_from,
    assert_same_run,
    committed,
    journal,
    read_metrics,
    read_summary,
)

from linnaeus_accel.data.text import load_topics
from linnaeus_accel.data.tokenize.command import tokenize_files

pytestmark = pytest.mark.slow

SEQ_LEN = 65
TINY_MODEL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "max_position_embeddings": SEQ_LEN,
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Two token-file corpora made with ``tokenize`` from the standard library's help topics: "docs"
    (three files) and "keywords" (one small file, drawn past its size and cycled)."""
    root = tmp_path_factory.mktemp("corpus")
    topics = load_topics()
    files: dict[str, list[str]] = {"docs": [], "keywords": []}
    for i in range(3):
        text = root / f"docs{i}.jsonl"
        chosen = topics[20 + 10 * i : 28 + 10 * i]
        text.write_text("".join(json.dumps({"text": t.decode()}) + "\n" for _, t in chosen))
        tokenize_files([str(text)], str(root / f"docs{i}.bin"), progress=False)
        files["docs"].append(str(root / f"docs{i}.bin"))
    small = root / "keywords.jsonl"
    small.write_text("".join(json.dumps({"text": t.decode()}) + "\n" for _, t in topics[:3]))
    tokenize_files([str(small)], str(root / "keywords.bin"), progress=False)
    files["keywords"].append(str(root / "keywords.bin"))
    return files


def lm_config(path: Path, dataset: dict[str, Any], **train: Any) -> str:
    """The shipped LM config with a tiny model, ``dataset`` as DATA.DATASET and the run's length."""
    config = yaml.safe_load(Path(LM_CFG).read_text())
    config["DATA"].update({"BATCH_SIZE": 4, "DROP_LAST": False, "DATASET": {"VAL_FRACTION": 0.1, **dataset}})
    config["MODEL"]["OPTIONS"].update(TINY_MODEL)
    config["TRAIN"] = {"STEPS": 60, "CLIP_GRAD": 1.0, **train}
    config["SCHEDULE"] = {
        "VALIDATION": {"INTERVAL_STEPS": 30, "MID_EPOCH": True},
        "CHECKPOINT": {"INTERVAL_STEPS": 10, "MID_EPOCH": True, "KEEP_LAST_N": 2},
        "METRICS": {"STEP_INTERVAL": 5},
    }
    path.write_text(yaml.safe_dump(config))
    return str(path)


def mixture(corpus: dict[str, list[str]]) -> dict[str, Any]:
    return {
        "NAME": "mixture",
        "OPTIONS": {
            "sources": [
                {
                    "name": "token_files",
                    "label": "docs",
                    "weight": 0.7,
                    "options": {"paths": corpus["docs"], "seq_len": SEQ_LEN},
                },
                {
                    "name": "token_files",
                    "label": "keywords",
                    "weight": 0.3,
                    "options": {"paths": corpus["keywords"], "seq_len": SEQ_LEN},
                },
            ]
        },
    }


def source_counts(run_dir: Path) -> list[tuple[int, int, int]]:
    """(step, docs samples, keywords samples) of every training record."""
    return [
        (r["global_step"], int(r["samples_seen/docs"]), int(r["samples_seen/keywords"]))
        for r in read_metrics(run_dir)
        if "samples_seen/docs" in r
    ]


@pytest.fixture(scope="module")
def mixture_ref(tmp_path_factory: pytest.TempPathFactory, corpus: dict[str, list[str]]) -> Result:
    root = tmp_path_factory.mktemp("mixture_ref")
    cfg = lm_config(root / "mixture.yaml", mixture(corpus), ACCUMULATION_STEPS=2)
    return run_here(TrainRun(root, [], cfg=cfg)).check_ok()


def test_mixture_weights_hold_in_every_window_and_on_any_layout(
    mixture_ref: Result, corpus: dict[str, list[str]], tmp_path: Path
) -> None:
    counts = source_counts(mixture_ref.dir)
    assert counts[-1][0] == 60
    for step, docs, keywords in counts:
        seen = docs + keywords
        assert seen == step * 8  # every sample of every step counted once, in one source
        # A deterministic interleave: within 2 samples of the weights at every logging step (a
        # binomial draw would be off by ~sqrt(0.21 n) = 10 samples at the end).
        assert abs(docs - 0.7 * seen) < 2
        assert abs(keywords - 0.3 * seen) < 2
    assert read_summary(mixture_ref.dir)["tokens_seen"] == 60 * 8 * (SEQ_LEN - 1)
    plan = (mixture_ref.dir / "assets" / "schedule_summary.txt").read_text()
    assert "keywords: weight 0.3" in plan  # plan shows what each source gives an epoch
    # Two processes accumulating 1: the same global batches, so the same samples of each source.
    cfg = lm_config(tmp_path / "mixture2.yaml", mixture(corpus), ACCUMULATION_STEPS=1)
    two = TrainRun(tmp_path, [], processes=2, cfg=cfg).run().check_ok()
    assert source_counts(two.dir) == counts


def test_mixture_killed_at_random_steps_resumes_byte_identical(
    mixture_ref: Result, corpus: dict[str, list[str]], tmp_path: Path
) -> None:
    cfg = lm_config(tmp_path / "mixture.yaml", mixture(corpus), ACCUMULATION_STEPS=2)
    run = TrainRun(tmp_path, [], cfg=cfg)
    steps = random.Random(20261125)
    first = steps.randint(12, 35)  # past a checkpoint, inside the first stretch
    run.run(kill_at=f"optimizer_step:{first}").check_killed()
    run.run(kill_at=f"optimizer_step:{steps.randint(5, 60 - first - 5)}").check_killed()
    assert_same_run(run_here(run), mixture_ref)


# ---------------------------------------------------------------------------------------------
# A sharded Hugging Face stream without __len__ (hf_dataset, streaming), 2 processes x 2 workers


@pytest.fixture(scope="module")
def text_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Five JSON Lines files of short help topics, of uneven sizes (14 to 59 windows of 65 tokens:
    the 4 readers run out at different steps, and a pass is about 20 steps) and a validation file."""
    root = tmp_path_factory.mktemp("text")
    topics = load_topics()
    files = []
    for i, (a, b) in enumerate([(6, 8), (8, 10), (10, 12), (12, 15), (15, 17)]):
        path = root / f"part{i}.jsonl"
        path.write_text("".join(json.dumps({"text": t.decode()}) + "\n" for _, t in topics[a:b]))
        files.append(str(path))
    val = root / "val.jsonl"
    val.write_text("".join(json.dumps({"text": t.decode()}) + "\n" for _, t in topics[0:1]))
    return {
        "format": "json",
        "data_files": files,
        "val_files": str(val),
        "seq_len": SEQ_LEN,
        "streaming": True,
    }


@pytest.fixture(scope="module")
def hf_stream_ref(tmp_path_factory: pytest.TempPathFactory, text_files: dict[str, Any]) -> Result:
    root = tmp_path_factory.mktemp("hf_stream_ref")
    cfg = lm_config(root / "stream.yaml", {"NAME": "hf_dataset", "OPTIONS": text_files}, STEPS=50)
    return TrainRun(root, ["DATA.NUM_WORKERS", "2"], processes=2, cfg=cfg).run().check_ok()


def test_sharded_hf_stream_on_two_processes_and_two_workers_resumes_byte_identical(
    hf_stream_ref: Result, text_files: dict[str, Any], tmp_path: Path
) -> None:
    plan = (hf_stream_ref.dir / "assets" / "schedule_summary.txt").read_text()
    assert "a stream without __len__" in plan
    done = read_summary(hf_stream_ref.dir)
    assert done["epoch"] >= 2  # passes ended where the readers ran out, every process agreeing
    assert done["samples_seen"] < 50 * 8  # the passes' last steps held fewer real samples
    # Steps 16-30 are the first pass's tail: some readers have run out (their processes train
    # zero-weight batches) while others still read; the checkpoints at 20 and 30 fall in it.
    seen = {
        r["global_step"]: r["samples_seen"] for r in read_metrics(hf_stream_ref.dir) if "samples_seen" in r
    }
    assert all(seen[s] - seen[s - 5] < 5 * 8 for s in (20, 25, 30)), seen
    cfg = lm_config(tmp_path / "stream.yaml", {"NAME": "hf_dataset", "OPTIONS": text_files}, STEPS=50)
    run = TrainRun(tmp_path, ["DATA.NUM_WORKERS", "2"], processes=2, cfg=cfg)
    killed = run.run(
        kill_at="optimizer_step:24", extra_env=after_commits(2)
    )  # in the first pass's tail, after 20's commit
    assert killed.returncode != 0, killed.tail()
    assert not (run.dir / "summary.json").exists(), killed.tail()
    # Inside a pass, each reader owns its shards' positions: another layout is refused, named.
    other = TrainRun(tmp_path, ["DATA.NUM_WORKERS", "0"], processes=2, cfg=cfg).run()
    assert other.returncode != 0, other.tail()  # 2 from each process; the launcher reports 1
    assert "DATA.NUM_WORKERS 2 -> 0" in other.output, other.tail()
    assert "val/loss" not in other.output  # refused before any pass or step ran
    resumed = run.run()
    assert_resumed_from(resumed.output, 20)  # the checkpoint of step 20, also in the tail
    assert_same_run(resumed, hf_stream_ref)


def test_a_stream_without_len_cannot_count_epochs(text_files: dict[str, Any], tmp_path: Path) -> None:
    cfg = lm_config(tmp_path / "stream.yaml", {"NAME": "hf_dataset", "OPTIONS": text_files})
    result = run_here(TrainRun(tmp_path, ["TRAIN.STEPS", "null", "TRAIN.EPOCHS", "2"], cfg=cfg))
    assert result.returncode == 2, result.tail()
    assert "TRAIN.EPOCHS" in result.output
    assert "stream without __len__" in result.output
    assert "TRAIN.STEPS or TRAIN.TARGET_TOKENS" in result.output


# ---------------------------------------------------------------------------------------------
# Mid-epoch validation, on the default digits config

# 1,438 training digits in batches of 64: 23 steps an epoch, 46 in 2 epochs. Standard validation at
# steps 10, 20, 30, 40 (mid-epoch) and the final boundary; the all-masked pass at 20 and 40; a
# checkpoint at every multiple of 10, before the passes of that step.
MID_VAL = [
    "TRAIN.EPOCHS", "2",
    "DATA.BATCH_SIZE", "64",
    "SCHEDULE.VALIDATION.INTERVAL_EPOCHS", "null",
    "SCHEDULE.VALIDATION.INTERVAL_STEPS", "10",
    "SCHEDULE.VALIDATION.MASK_META_INTERVAL_EPOCHS", "null",
    "SCHEDULE.VALIDATION.MASK_META_INTERVAL_STEPS", "20",
    "SCHEDULE.VALIDATION.PARTIAL_MASK_META.ENABLED", "false",
    "SCHEDULE.VALIDATION.MID_EPOCH", "true",
    "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null",
    "SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "10",
    "SCHEDULE.CHECKPOINT.MID_EPOCH", "true",
    "SCHEDULE.CHECKPOINT.KEEP_LAST_N", "0",
    "SCHEDULE.CHECKPOINT.KEEP_TOP_N", "0",
]  # fmt: skip


@pytest.fixture(scope="module")
def mid_val_ref(tmp_path_factory: pytest.TempPathFactory) -> Result:
    return run_here(TrainRun(tmp_path_factory.mktemp("mid_val_ref"), MID_VAL)).check_ok()


def test_mid_epoch_validation_happens_at_its_steps(mid_val_ref: Result) -> None:
    validations = [r for r in read_metrics(mid_val_ref.dir) if "val/loss" in r]
    assert [r["global_step"] for r in validations] == [10, 20, 30, 40, 46]
    assert ["val_mask_meta/loss" in r for r in validations] == [False, True, False, True, False]
    assert [r["epoch"] for r in validations] == [1, 1, 2, 2, 2]  # the epoch they happened in
    assert "step 20 (epoch 1): val/loss" in mid_val_ref.output
    assert journal(mid_val_ref.dir / "checkpoints" / "step_00000020") == ["val", "val_mask_meta"]


def test_killed_inside_a_mid_epoch_pass_reruns_only_the_missing_passes(
    mid_val_ref: Result, tmp_path: Path
) -> None:
    run = TrainRun(tmp_path, MID_VAL)
    # Passes: step 10: val (1); step 20: val (2), val_mask_meta (3). Killed after the third's start.
    run.run(kill_at="validation_pass:2").check_killed()
    assert journal(run.dir / "checkpoints" / "step_00000020") == ["val"]
    resumed = run_here(run)
    assert "resumed from" in resumed.output
    assert "step_00000020" in resumed.output
    assert journal(run.dir / "checkpoints" / "step_00000020") == ["val", "val_mask_meta"]
    assert_same_run(resumed, mid_val_ref)
    assert committed(run.dir) == committed(mid_val_ref.dir)


# ---------------------------------------------------------------------------------------------
# Bad input: exit 2, the key named, nothing written


def bad_inputs(corpus: dict[str, list[str]], tmp: Path) -> list[tuple[list[str], str, str]]:
    odd = tmp / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")  # 3 bytes: not whole uint16 tokens
    tf = ["DATA.DATASET.NAME", "token_files", "DATA.DATASET.OPTIONS.seq_len", "65"]
    return [
        (["TRAIN.STEPS", "10"], "TRAIN.EPOCHS", "exactly one"),  # default config sets EPOCHS 20
        ([*tf, "DATA.DATASET.OPTIONS.paths", json.dumps([str(odd)]), "DATA.DATASET.OPTIONS.dtype", "uint16"],
         "DATA.DATASET.OPTIONS.paths", "not a multiple of 2"),
        ([*tf, "DATA.DATASET.OPTIONS.paths", json.dumps([str(tmp / "none*.bin")])],
         "DATA.DATASET.OPTIONS.paths", "matches no .bin or .npy file"),
        (["DATA.DATASET.NAME", "mixture", "DATA.DATASET.OPTIONS.sources",
          json.dumps([{"name": "token_files", "weight": 0, "options": {"paths": corpus["docs"]}}])],
         "DATA.DATASET.OPTIONS.sources.0.weight", "weight"),
    ]  # fmt: skip


def test_bad_input_exits_2_naming_the_key_and_writes_nothing(
    corpus: dict[str, list[str]], tmp_path: Path
) -> None:
    for i, (opts, key, text) in enumerate(bad_inputs(corpus, tmp_path)):
        run = TrainRun(tmp_path / f"bad{i}", opts, cfg=LM_CFG if opts[0] != "TRAIN.STEPS" else CFG)
        (tmp_path / f"bad{i}").mkdir()
        result = run_here(run)
        assert result.returncode == 2, result.tail()
        assert key in result.output, result.tail()
        assert text in result.output, result.tail()
        assert not run.dir.exists(), f"{opts}: wrote {run.dir}"
