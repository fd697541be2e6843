"""The schedule summary ``train`` prints at start describes the optimizer that trains: one given to
the Trainer (``optimizer=``, a factory or built) as it is built, not OPTIMIZER's settings, which it
does not read; ``plan`` (no model) keeps describing OPTIMIZER's (``test_optimizer_config``)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.configs import DEFAULT_CONFIG

from linnaeus_accel import Trainer, load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.models import build_model
from linnaeus_accel.schedule.report.optimizer import built_optimizer_lines

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def test_train_prints_the_factorys_optimizer_not_the_configs(tmp_path: Path) -> None:
    opts = ["ENV.OUTPUT.BASE_DIR", str(tmp_path), "TRAIN.STEPS", "1", "TRAIN.EPOCHS", "null"]
    opts += ["ENV.PROGRESS_BAR", "false"]
    config = load_config(DEFAULT_CONFIG, opts)
    train = build_dataset(config, "train")
    model = build_model(config, train)

    def factory(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups, betas=(0.9, 0.99), weight_decay=0.1)

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = Trainer(config, model, train, optimizer=factory).fit()
    assert result["status"] == "completed"
    line = (
        "Optimizer: AdamW (the Trainer's optimizer=, as built), betas (0.9, 0.99), eps 1e-08, "
        "torch's default kernels; weight decay 0.1\n"
    )
    assert line in printed.getvalue()
    assert "betas (0.9, 0.999)" not in printed.getvalue()  # OPTIMIZER's default, which it does not read
    written = (tmp_path / "digits_default" / "assets" / "schedule_summary.txt").read_text(encoding="utf-8")
    assert line in written


def test_settings_that_differ_between_groups_show_each_value() -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    groups: list[dict[str, Any]] = [{"params": [a]}, {"params": [b], "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, weight_decay=0.1)
    assert built_optimizer_lines(adamw) == [
        "Optimizer: AdamW (the Trainer's optimizer=, as built), betas (0.9, 0.999), eps 1e-08, "
        "torch's default kernels; weight decay 0.1 or 0 (by parameter group)"
    ]
    sgd = torch.optim.SGD([a, b], lr=0.1, momentum=0.9, nesterov=True)
    assert built_optimizer_lines(sgd) == [
        "Optimizer: SGD (the Trainer's optimizer=, as built), momentum 0.9, nesterov, torch's default "
        "kernels; weight decay 0"
    ]
