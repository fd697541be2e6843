"""The per-step path of the training loop never waits on the device: tensor values are read back
to the host (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``) only on logging steps and at
epoch boundaries. On CPU the read-back op still runs, so this test catches a stray ``.item()``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from helpers.host_sync import ReadBackRecorder, in_steps

from linnaeus_accel.config import load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.models import build_model
from linnaeus_accel.training.trainer import Trainer


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.slow  # every tensor op goes through the recorder: ~15 s a run
@pytest.mark.parametrize(
    "opts",
    [
        [],  # default schedule: masking, partial masking and mixup all active
        ["TRAIN.ACCUMULATION_STEPS", "3"],  # micro-batches between optimizer steps
        [
            "LOSS.GRAD_WEIGHTING.TASK.GRADNORM_ENABLED",
            "true",
            "LOSS.GRAD_WEIGHTING.TASK.GRADNORM_WARMUP_STEPS",
            "0",
        ],
    ],
)
def test_training_steps_do_not_read_tensors_back_to_the_host(
    tmp_path: Path, opts: list[str], default_config_path: Path
) -> None:
    config = load_config(
        default_config_path,
        [
            "ENV.OUTPUT.BASE_DIR",
            str(tmp_path),
            "TRAIN.EPOCHS",
            "2",
            "SCHEDULE.METRICS.STEP_INTERVAL",
            "10",
            *opts,
        ],
    )
    train, val = build_dataset(config, "train"), build_dataset(config, "val")
    torch.manual_seed(0)
    trainer = Trainer(config, build_model(config, train), train, val)
    recorder = ReadBackRecorder()
    with recorder:
        trainer.fit()
    found = in_steps(recorder.calls)
    assert not found, f"{len(found)} host read-backs in the per-step path, e.g. from {found[0][:8]}"
    # The recorder does see the read-backs that are allowed (logging steps), so it cannot pass vacuously.
    assert any("flush" in stack for stack in recorder.calls)


@pytest.mark.slow
def test_two_processes_agree_on_preemption_without_reading_the_device_between_records(
    tmp_path: Path, default_config_path: Path
) -> None:
    """Two gloo processes under torchrun: no read-back of a tensor in the per-step path, so no
    step between metric records waits for the device (the preemption flag used to be all-reduced
    on the device and read with .item() every 10 steps)."""
    worker = Path(__file__).resolve().parent / "host_sync_worker.py"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))
    }
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(worker.parent.parent), env.get("PYTHONPATH")])),
    )
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(worker), str(default_config_path), str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("readbacks_*.json"))]
    assert sorted(r["rank"] for r in reports) == [0, 1], done.stdout[-2000:]
    for report in reports:
        assert report["in_steps"] == 0, report
        assert report["allowed"] > 0, report  # the recorder sees the metric records' reads
