"""Checkpoints off the critical path. The kill tests of both modes are in
test_resume.py; here: ASYNC writes exactly the files ``save_state`` writes, the time the loop was
blocked and waited is logged, and a slow commit makes the next checkpoint wait (one at a time)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from helpers.configs import CFG
from helpers.in_process import reset_accelerate

from linnaeus_accel.checkpoint.directory import MARKER, CheckpointStore
from linnaeus_accel.checkpoint.save.writer import CheckpointWriter
from linnaeus_accel.cli import main
from linnaeus_accel.config import load_config

# 12 steps per epoch, 2 epochs: checkpoints mid-epoch at 5, 10, 15, 20 and at the end (24); all kept.
OPTS = [
    "TRAIN.EPOCHS", "2",
    "DATA.BATCH_SIZE", "128",
    "SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "5",
    "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null",
    "SCHEDULE.CHECKPOINT.MID_EPOCH", "true",
    "SCHEDULE.CHECKPOINT.KEEP_LAST_N", "0",
    "SCHEDULE.CHECKPOINT.KEEP_TOP_N", "0",
    "SCHEDULE.METRICS.STEP_INTERVAL", "3",
]  # fmt: skip


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def train(base: Path, *opts: str) -> Path:
    reset_accelerate()
    assert main(["train", "--cfg", CFG, "--opts", "ENV.OUTPUT.BASE_DIR", str(base), *OPTS, *opts]) == 0
    return base / "digits_default"


def digests(checkpoint: Path) -> dict[str, str]:
    marker = json.loads((checkpoint / MARKER).read_text(encoding="utf-8"))
    return {entry["path"]: entry["xxh3_128"] for entry in marker["files"]}


@pytest.mark.slow
def test_async_writes_the_files_save_state_writes_and_logs_the_time_blocked(tmp_path: Path) -> None:
    default = train(tmp_path / "default")
    asynchronous = train(tmp_path / "async", "SCHEDULE.CHECKPOINT.ASYNC", "true")

    steps = CheckpointStore(default / "checkpoints").complete_steps()
    assert steps == [5, 10, 15, 20, 24]
    assert CheckpointStore(asynchronous / "checkpoints").complete_steps() == steps
    for step in steps:
        name = f"checkpoints/step_{step:08d}"
        ours, theirs = digests(asynchronous / name), digests(default / name)
        # Model, optimizer and RNG files byte for byte; only our own state (its config) differs.
        assert sorted(ours) == sorted(theirs)
        assert {p for p in ours if ours[p] != theirs[p]} == {"trainer_state.json"}, step
    weights = "final/model.safetensors"
    assert (asynchronous / weights).read_bytes() == (default / weights).read_bytes()

    for run in (default, asynchronous):
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        train_records = [r for r in records if "train/loss" in r]
        timed = [r["global_step"] for r in train_records if "perf/checkpoint_blocked_s" in r]
        # The first train record after each checkpoint carries its timings (a step's metrics are
        # logged before its checkpoint; 24 is the last step).
        assert timed == [6, 12, 18, 21], timed
        for record in train_records:
            if "perf/checkpoint_blocked_s" in record:
                assert 0 < record["perf/checkpoint_blocked_s"] < 30
                assert 0 <= record["perf/checkpoint_wait_s"] < 30
        summary = json.loads((run / "summary.json").read_text())
        assert summary["checkpoint_blocked_s"] > 0
        assert summary["checkpoint_wait_s"] >= 0


def test_the_next_checkpoint_waits_for_a_slow_commit_and_says_how_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_config(CFG, ["ENV.OUTPUT.BASE_DIR", str(tmp_path), "EXPERIMENT.NAME", "run"])
    acc = Accelerator(cpu=True)
    acc.prepare(torch.nn.Linear(4, 4), torch.optim.AdamW(torch.nn.Linear(4, 4).parameters()))
    writer = CheckpointWriter(
        acc, config.ENV, config.EXPERIMENT, config.SCHEDULE, config.ranking_metric, config.output_dir
    )
    commit = CheckpointStore.commit

    def slow_commit(store: CheckpointStore, *args: Any, **kwargs: Any) -> Path:
        time.sleep(0.5)  # a slow disk
        return commit(store, *args, **kwargs)

    monkeypatch.setattr(CheckpointStore, "commit", slow_commit)

    def state(step: int) -> dict[str, Any]:
        return {"progress": {"global_step": step, "epoch": 0, "batches_seen_in_epoch": step}}

    started = time.perf_counter()
    first = writer.save(1, state(1), {"meter": None, "data": None})
    assert time.perf_counter() - started < 0.5  # the loop did not wait for the commit
    assert not (first / MARKER).exists()  # still committing
    writer.save(2, state(2), {"meter": None, "data": None})
    assert writer.waited_s >= 0.3  # the second waited for the first
    assert (first / MARKER).is_file()
    timings = writer.take_timings()
    assert timings["perf/checkpoint_wait_s"] >= 0.3
    assert timings["perf/checkpoint_blocked_s"] < timings["perf/checkpoint_wait_s"]
    assert writer.take_timings() == {}  # once
    writer.settle()
    assert CheckpointStore(tmp_path / "run" / "checkpoints").complete_steps() == [1, 2]


def test_a_failure_writing_the_weights_half_is_raised_after_the_other_half_ends(tmp_path: Path) -> None:
    """ASYNC writes the weights and the optimizer's state on two threads at once: an error in the
    weights' thread reaches the caller (the commit reports it), and not before the optimizer's
    half has finished with the directory."""
    from linnaeus_accel.checkpoint.save.host_snapshot import HostSnapshot

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(256, 256)
    acc.prepare(model, torch.optim.AdamW(model.parameters()))
    snapshot = HostSnapshot(acc)
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "model.safetensors").mkdir()  # the weights cannot be written there
    captured = snapshot.capture(staging)
    announced: list[str] = []
    with pytest.raises(Exception, match="Is a directory"):
        snapshot.write(captured, staging, lambda files: announced.extend(p.name for p in files))
    assert announced == ["optimizer.bin"]
    assert torch.load(staging / "optimizer.bin", weights_only=True)["param_groups"][0]["params"] == [0, 1]


def test_each_half_announces_only_its_own_finished_files(tmp_path: Path) -> None:
    """The two halves write into one directory at once, and safetensors writes the weights through
    a temporary ``.tmpXXXXXX`` file it then renames: a half must not announce (have sealed) a file
    the other is still writing, which vanishes under the sealing thread and failed the checkpoint.
    Here the weights' half ends first (tiny) and leaves such a file behind as it announces; the
    optimizer's half (large: AdamW moments of other parameters) ends after it."""
    from linnaeus_accel.checkpoint.save.host_snapshot import HostSnapshot

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    others = [torch.nn.Parameter(torch.zeros(4096, 2048))]
    optimizer = torch.optim.AdamW(others)
    others[0].grad = torch.ones_like(others[0])
    optimizer.step()  # 64 MB of moments
    acc.prepare(model, optimizer)
    snapshot = HostSnapshot(acc)
    staging = tmp_path / "staging"
    staging.mkdir()
    announced: list[list[str]] = []

    def written(files: list[Path]) -> None:
        announced.append([p.name for p in files])
        (staging / ".tmpAbCdEf").write_bytes(b"another writer's file in progress")

    snapshot.write(snapshot.capture(staging), staging, written)
    assert announced == [["model.safetensors"], ["optimizer.bin"]]
