"""``DATA.SHUFFLE``: the training order is seeded and shuffled by default, the dataset's own with
``false``; either resumes exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.configs import DEFAULT_CONFIG
from helpers.in_process import reset_accelerate
from helpers.runs import TrainRun, assert_same_run

from linnaeus_accel import Callback, Trainer
from linnaeus_accel.config import load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.models import build_model


def training_order(tmp_path: Path, *opts: str) -> list[list[int]]:
    """The sample indices each epoch of a 2-epoch default run read, in order."""
    config = load_config(
        DEFAULT_CONFIG,
        ["ENV.OUTPUT.BASE_DIR", str(tmp_path), "TRAIN.EPOCHS", "2", "DATA.BATCH_SIZE", "256", *opts],
    )
    train_data = build_dataset(config, "train")
    read: list[int] = []

    class Recorded(torch.utils.data.Dataset[Any]):
        def __getattr__(self, name: str) -> Any:  # what the dataset declares (levels, ...)
            return getattr(train_data, name)

        def __len__(self) -> int:
            return len(train_data)

        def __getitem__(self, index: int) -> Any:
            read.append(index)
            return train_data[index]

    class FromTheFirstStep(Callback):  # the trainer reads a sample batch at construction
        def on_fit_start(self, trainer: Any) -> None:
            read.clear()

    reset_accelerate()
    try:
        trainer = Trainer(config, build_model(config, train_data), Recorded(), callbacks=[FromTheFirstStep()])
        trainer.fit()
    finally:
        reset_accelerate()
    size = len(train_data)
    return [read[:size], read[size : 2 * size]]


def test_shuffle_false_reads_the_dataset_in_its_order_every_epoch(tmp_path: Path) -> None:
    first, second = training_order(tmp_path / "ordered", "DATA.SHUFFLE", "false")
    assert first == second == list(range(len(first)))
    shuffled = training_order(tmp_path / "shuffled")
    assert sorted(shuffled[0]) == first  # every sample once ...
    assert shuffled[0] != first  # ... in a seeded order ...
    assert shuffled[0] != shuffled[1]  # ... drawn again each epoch


@pytest.mark.slow
def test_shuffle_false_resumes_exactly(tmp_path: Path) -> None:
    opts = ["TRAIN.EPOCHS", "2", "DATA.SHUFFLE", "false", "SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "4"]
    opts += ["SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null", "SCHEDULE.CHECKPOINT.MID_EPOCH", "true"]
    for name in ("ref", "killed"):
        (tmp_path / name).mkdir()
    reference = TrainRun(tmp_path / "ref", opts).run().check_ok()
    run = TrainRun(tmp_path / "killed", opts)
    assert run.run(kill_at="checkpoint_committed:2").returncode != 0  # mid-epoch, at step 8
    assert_same_run(run.run(), reference)
