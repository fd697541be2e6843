"""Retention ranks checkpoints by their validation metric: a run resumed from a checkpoint taken at
a boundary, whose validation finished after the resume, still ranks that checkpoint (its state was
saved before its own validation, so it did not rank it; the resumed run dropped the rank, and
KEEP_TOP_N could then delete the best checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.configs import DEFAULT_CONFIG
from helpers.in_process import reset_accelerate, run_cli

from linnaeus_accel.process import faults

OPTS = [
    *("DATA.BATCH_SIZE", "256", "TRAIN.EPOCHS", "3", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1"),
    *("SCHEDULE.CHECKPOINT.KEEP_LAST_N", "0", "SCHEDULE.CHECKPOINT.KEEP_TOP_N", "0"),
]  # fmt: skip


def train(base: Path, name: str) -> int:
    reset_accelerate()
    rc, _, err = run_cli(
        "train",
        "--cfg",
        str(DEFAULT_CONFIG),
        "--opts",
        "ENV.OUTPUT.BASE_DIR",
        str(base),
        "EXPERIMENT.NAME",
        name,
        *OPTS,
    )
    assert rc == 0, err[-2000:]
    return rc


def ranks(run_dir: Path, step: int) -> dict[str, float | None]:
    state = json.loads((run_dir / "checkpoints" / f"step_{step:08d}" / "trainer_state.json").read_text())
    return dict(state["checkpoint_metrics"])


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_checkpoint_validated_after_the_resume_keeps_its_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    train(tmp_path, "reference")
    # Killed in the second validation pass: epoch 2's (step 12) checkpoint is taken, not ranked.
    monkeypatch.setattr(faults, "_ARMED", {"validation_pass": (2, faults._raise)})
    monkeypatch.setattr(faults, "_seen", faults.Counter())
    reset_accelerate()
    with pytest.raises(RuntimeError, match="fault point"):
        run_cli(
            "train",
            "--cfg",
            str(DEFAULT_CONFIG),
            "--opts",
            "ENV.OUTPUT.BASE_DIR",
            str(tmp_path),
            "EXPERIMENT.NAME",
            "resumed",
            *OPTS,
        )
    monkeypatch.setattr(faults, "_ARMED", {})
    train(tmp_path, "resumed")
    expected = ranks(tmp_path / "reference", 18)
    assert set(expected) == {"6", "12"}
    assert ranks(tmp_path / "resumed", 18) == expected
