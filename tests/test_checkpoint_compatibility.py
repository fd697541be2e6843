"""A checkpoint written before the package was reorganised (tests/fixtures/checkpoint_before_redesign,
written by the code of commit 341fc31) resumes with the same meaning: the run resumed from its step 4
ends with the final weights of the uninterrupted run, so no state file, name or format a checkpoint
holds has changed meaning.

The uninterrupted run is trained here, by this code on this machine, and the weights are compared to
1e-5: the fixture's four steps were computed on another machine's CPU kernels, whose float results
differ from this one's in the last bits (seen: 1e-7 at most; the SHA-256 of that machine's final
weights, f43782ac..., recorded when the fixture was made, does not match on a machine whose kernels
differ), while a state read with another meaning (a data position, an LR step, an RNG state, a moment
of the optimizer) moves the weights by far more."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.configs import DEFAULT_CONFIG
from helpers.in_process import reset_accelerate, run_cli
from safetensors.torch import load_file

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoint_before_redesign" / "step_00000004"
OPTS = [
    *("DATA.BATCH_SIZE", "256", "TRAIN.EPOCHS", "2", "MODEL.OPTIONS.dropout", "0.1", "MODEL.OPTIONS.hidden", "32"),
    *("SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "4", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null"),
    *("SCHEDULE.CHECKPOINT.MID_EPOCH", "true", "SCHEDULE.CHECKPOINT.KEEP_LAST_N", "0"),
    *("SCHEDULE.CHECKPOINT.KEEP_TOP_N", "0", "SCHEDULE.METRICS.STEP_INTERVAL", "2"),
]  # fmt: skip


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_checkpoint_of_the_previous_layout_resumes_with_the_same_meaning(tmp_path: Path) -> None:
    checkpoint = tmp_path / "given" / FIXTURE.name
    shutil.copytree(FIXTURE, checkpoint)  # a resume may not write into the repository
    out_dir = ["ENV.OUTPUT.BASE_DIR", str(tmp_path / "outputs")]
    reset_accelerate()
    rc, out, err = run_cli(
        "train", "--cfg", str(DEFAULT_CONFIG), "--resume", str(checkpoint),
        "--opts", *out_dir, "EXPERIMENT.NAME", "resumed", *OPTS,
    )  # fmt: skip
    assert rc == 0, err[-3000:]
    run = tmp_path / "outputs" / "resumed"
    assert f"resumed from {checkpoint} (global step 4, epoch 1)" in out + err
    assert json.loads((run / "summary.json").read_text())["global_step"] == 12
    reset_accelerate()
    rc, _, err = run_cli(
        "train", "--cfg", str(DEFAULT_CONFIG), "--opts", *out_dir, "EXPERIMENT.NAME", "whole", *OPTS
    )
    assert rc == 0, err[-3000:]
    resumed = load_file(run / "final" / "model.safetensors")
    whole = load_file(tmp_path / "outputs" / "whole" / "final" / "model.safetensors")
    assert resumed.keys() == whole.keys()
    for name, weight in whole.items():
        gap = float((resumed[name] - weight).abs().max())
        assert torch.allclose(resumed[name], weight, rtol=0, atol=1e-5), (name, gap)
    # The check has teeth: the eight steps resumed moved the weights by far more than that.
    given = load_file(checkpoint / "model.safetensors")
    assert max(float((whole[k] - given[k]).abs().max()) for k in whole) > 1e-3
