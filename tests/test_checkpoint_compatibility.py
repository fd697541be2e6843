"""A checkpoint written before the package was reorganised (tests/fixtures/checkpoint_before_redesign,
written by the code of commit 341fc31) resumes bitwise: the run resumed from its step 4 ends with the
final weights the uninterrupted run of that code wrote (their SHA-256, recorded when the fixture was
made), so no state file, name or format a checkpoint holds has changed meaning."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from helpers.configs import DEFAULT_CONFIG
from helpers.in_process import reset_accelerate, run_cli

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoint_before_redesign" / "step_00000004"
OPTS = [
    *("DATA.BATCH_SIZE", "256", "TRAIN.EPOCHS", "2", "MODEL.OPTIONS.dropout", "0.1", "MODEL.OPTIONS.hidden", "32"),
    *("SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "4", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null"),
    *("SCHEDULE.CHECKPOINT.MID_EPOCH", "true", "SCHEDULE.CHECKPOINT.KEEP_LAST_N", "0"),
    *("SCHEDULE.CHECKPOINT.KEEP_TOP_N", "0", "SCHEDULE.METRICS.STEP_INTERVAL", "2"),
]  # fmt: skip
# final/model.safetensors of that code's uninterrupted run
FINAL_SHA256 = "f43782ac112896fc6f5eae41e74e149c8339088b467aeee84fde5951965eb50e"


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_checkpoint_of_the_previous_layout_resumes_bitwise(tmp_path: Path) -> None:
    checkpoint = tmp_path / "given" / FIXTURE.name
    shutil.copytree(FIXTURE, checkpoint)  # a resume may not write into the repository
    reset_accelerate()
    opts = ["ENV.OUTPUT.BASE_DIR", str(tmp_path / "outputs"), "EXPERIMENT.NAME", "resumed", *OPTS]
    rc, out, err = run_cli(
        "train", "--cfg", str(DEFAULT_CONFIG), "--resume", str(checkpoint), "--opts", *opts
    )
    assert rc == 0, err[-3000:]
    run = tmp_path / "outputs" / "resumed"
    assert f"resumed from {checkpoint} (global step 4, epoch 1)" in out + err
    assert json.loads((run / "summary.json").read_text())["global_step"] == 12
    assert hashlib.sha256((run / "final" / "model.safetensors").read_bytes()).hexdigest() == FINAL_SHA256
