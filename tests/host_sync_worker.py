"""Run under ``torchrun --standalone --nproc_per_node 2`` (CPU, gloo) by tests/test_host_sync.py: trains
the default config for two epochs and writes, one JSON file per process (``readbacks_<rank>.json``),
the read-backs of tensor values to the host (``.item()`` and the like) made in the per-step path,
outside the steps that read the device anyway (metric records, validation, boundaries)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from helpers.host_sync import ReadBackRecorder, in_steps

from linnaeus_accel.config import load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.models import build_model
from linnaeus_accel.training.trainer import Trainer


def main() -> None:
    config_path, output = sys.argv[1], sys.argv[2]
    opts = ["ENV.OUTPUT.BASE_DIR", output, "TRAIN.EPOCHS", "2", "DATA.BATCH_SIZE", "32"]
    config = load_config(config_path, [*opts, "SCHEDULE.METRICS.STEP_INTERVAL", "10"])
    train, val = build_dataset(config, "train"), build_dataset(config, "val")
    torch.manual_seed(0)
    trainer = Trainer(config, build_model(config, train), train, val)
    recorder = ReadBackRecorder()
    with recorder:
        trainer.fit()
    found = in_steps(recorder.calls)
    report = {
        "rank": int(os.environ.get("RANK", "0")),
        "in_steps": len(found),
        "example": found[0][:8] if found else None,
        "allowed": sum("flush" in s for s in recorder.calls),
    }
    # A file per process: their console lines interleave on the launcher's output.
    (Path(output) / f"readbacks_{report['rank']}.json").write_text(json.dumps(report), encoding="utf-8")


if __name__ == "__main__":
    main()
