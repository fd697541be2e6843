"""What a run prints: the progress bar (from the resumed step after a resume), plain lines where
stdout is not a terminal, every validation pass's headline metric, and the warning when an epoch
takes other than the planned number of steps. Runs are the default digits config at batch 128
(12 optimizer steps per epoch), in this process.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.configs import DEFAULT_CONFIG, REPO
from helpers.in_process import reset_accelerate
from torch.utils.data import DataLoader, Sampler

from linnaeus_accel.config import load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.models import build_model
from linnaeus_accel.progress import TrainingConsistencyChecker
from linnaeus_accel.run_directory.console import Console
from linnaeus_accel.schedule import resolve_plan
from linnaeus_accel.training import boundary_work as events_module
from linnaeus_accel.training.trainer import Trainer
from linnaeus_accel.training.validation.passes import validation_line

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

STEPS_PER_EPOCH = 12  # 1438 digits at batch 128
FAST = [
    "DATA.BATCH_SIZE",
    "128",
    "SCHEDULE.VALIDATION.FINAL_EPOCH.EXHAUSTIVE_PARTIAL_META_VALIDATION",
    "false",
]


def trainer(tmp_path: Path, *opts: str, train_data: Any = None) -> Trainer:
    reset_accelerate()
    config = load_config(DEFAULT_CONFIG, [*FAST, "ENV.OUTPUT.BASE_DIR", str(tmp_path), *opts])
    train, val = build_dataset(config, "train"), build_dataset(config, "val")
    return Trainer(config, build_model(config, train), train if train_data is None else train_data, val)


def test_plain_lines_when_stdout_is_not_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = trainer(tmp_path, "TRAIN.EPOCHS", "1", "SCHEDULE.METRICS.STEP_INTERVAL", "5").fit()
    assert summary["status"] == "completed"
    out = capsys.readouterr().out
    assert "\r" not in out  # no bar redrawn in place
    assert "step/s" not in out
    # One line per console update, with the step, loss, LR, throughput and (before the end) time left.
    progress = re.findall(r"^epoch 1 step (\d+)/12: loss [\d.]+, lr [\d.e+-]+, samples/s \d+(.*)$", out, re.M)
    assert [int(step) for step, _ in progress] == [5, 10, 12]
    assert all(re.fullmatch(r", \d\d:\d\d left", rest) for _, rest in progress[:-1]), progress
    assert progress[-1][1] == ""


def test_validation_line_shows_every_pass_headline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Epoch 1 runs the standard, mask-meta and the two whitelisted partial passes.
    trainer(
        tmp_path,
        "TRAIN.EPOCHS",
        "1",
        "SCHEDULE.VALIDATION.MASK_META_INTERVAL_EPOCHS",
        "1",
        "SCHEDULE.VALIDATION.PARTIAL_MASK_META.INTERVAL_EPOCHS",
        "1",
    ).fit()
    out = capsys.readouterr().out
    start = out.index("epoch 1: val/loss")
    report = out[start : out.index("\n", out.index("val_mask_COLS_MOMENTS", start))]
    lines = report.splitlines()
    assert all(len(line) <= 100 for line in lines), lines
    assert all(line.startswith("  ") for line in lines[1:]), lines
    # The standard pass in full, then each other pass's headline: its chain accuracy.
    shown = dict(re.findall(r"(\S+/\S+) (\d\.\d{4})", report))
    assert list(shown) == [
        "val/loss",
        "val/chain_acc",
        "val/partial_chain_acc",
        "val/acc_shape",
        "val/acc_digit",
        "val/acc3_shape",
        "val/acc3_digit",
        "val_mask_meta/chain_acc",
        "val_mask_ROWS/chain_acc",
        "val_mask_COLS_MOMENTS/chain_acc",
    ]
    summary = (tmp_path / "digits_default" / "summary.json").read_text(encoding="utf-8")
    assert f'"val_mask_meta/chain_acc": {shown["val_mask_meta/chain_acc"][:5]}' in summary


def test_validation_line_headline_is_first_higher_is_better_metric() -> None:
    results = {"val/loss": 2.0, "val/perplexity": 7.389, "other/loss": 1.0, "val_b/loss": 3.0, "epoch": 1.0}
    assert validation_line(3, results, {"loss": "min", "perplexity": "min"}) == (
        "epoch 3: val/loss 2.0000, val/perplexity 7.3890, val_b/loss 3.0000"
    )
    results = {"val/loss": 1.0, "val/acc": 0.5, "val/acc_top5": 0.9, "val_x/loss": 1.5, "val_x/acc": 0.25}
    directions = {"loss": "min", "acc": "max", "acc_top5": "max"}
    assert validation_line(1, results, directions).endswith("val/acc_top5 0.9000, val_x/acc 0.2500")


@pytest.mark.slow
def test_resumed_bar_starts_at_the_resumed_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    opts = ("TRAIN.EPOCHS", "2", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1", "ENV.PROGRESS_BAR", "true")
    first = trainer(tmp_path, *opts)
    first.fit()
    bar = first.out.console.bar
    assert (bar.initial, bar.n) == (0, 2 * STEPS_PER_EPOCH)
    # As if killed during epoch 2: its checkpoint and the run's end never happened.
    run = tmp_path / "digits_default"
    shutil.rmtree(run / "checkpoints" / "step_00000024")
    shutil.rmtree(run / "final")
    (run / "summary.json").unlink()
    capsys.readouterr()

    resumed = trainer(tmp_path, *opts)
    resumed.fit()
    out = capsys.readouterr().out
    assert "resumed from" in out
    bar = resumed.out.console.bar
    # The bar counts from step 12: its rate and time left cover the 12 steps trained now.
    assert (bar.initial, bar.n) == (STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH)
    assert bar.format_dict["initial"] == STEPS_PER_EPOCH
    drawn = re.findall(r"(\d+)/24 \[", out)
    assert drawn[0] == "12", drawn[:5]
    assert drawn[-1] == "24"


def test_console_plain_rate_counts_from_the_start_step(capsys: pytest.CaptureFixture[str]) -> None:
    console = Console(total_steps=1000, mode=False)
    console.start(step=900, epoch=5)
    console._started -= 10.0  # 10 s ago
    console.advance(50, 5, {"loss": "0.1"})
    # 50 steps in 10 s since the resume: 50 steps left take 10 s (not 950 steps' pace in 10 s).
    assert capsys.readouterr().out == "epoch 5 step 950/1000: loss 0.1, 00:10 left\n"
    assert console.bar is None


class OverstatedSampler(Sampler[int]):
    """Says it draws every sample but stops 3 batches short (a sampler with a wrong ``__len__``)."""

    def __init__(self, size: int, batch: int) -> None:
        self.size, self.batch = size, batch

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.size - 3 * self.batch))


def test_an_epoch_shorter_than_planned_is_warned_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reset_accelerate()
    config = load_config(DEFAULT_CONFIG, [*FAST, "ENV.OUTPUT.BASE_DIR", str(tmp_path), "TRAIN.EPOCHS", "2"])
    train = build_dataset(config, "train")
    loader = DataLoader(train, batch_size=128, sampler=OverstatedSampler(len(train), 128))
    summary = trainer(tmp_path, "TRAIN.EPOCHS", "2", train_data=loader).fit()
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("warning: epoch")]
    assert warnings == [
        "warning: epoch 1 took 9 optimizer steps but the plan expects 12: the training data yielded fewer "
        "batches than its length says (12 batches per process, accumulation 1); the LR, masking, validation "
        "and checkpoint schedules were resolved from that length and no longer line up with epochs. Check "
        "the __len__ of the dataset or sampler given."
    ]
    assert summary["global_step"] == 18


def test_an_epoch_as_planned_is_not_warned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trainer(tmp_path, "TRAIN.EPOCHS", "1").fit()
    assert "warning: epoch" not in capsys.readouterr().out


def test_epoch_check_expects_a_partial_last_epoch_of_a_token_target() -> None:
    # 100,000 target tokens at 16 x 128 tokens per step: 49 steps, 40 per epoch, the last epoch 9.
    config = load_config(
        REPO / "configs" / "lm_tiny.yaml",
        ["TRAIN.EPOCHS", "null", "TRAIN.TARGET_TOKENS", "100000", "DATA.DROP_LAST", "true"],
    )
    plan = resolve_plan(config, 40, 1, 40 * 16, tokens_per_sample=128)
    assert (plan.epochs, plan.optimizer_steps_per_epoch, plan.last_epoch_steps) == (2, 40, 9)
    assert TrainingConsistencyChecker.for_plan(plan, True).epoch_problem(2, 9) is None
    checker = TrainingConsistencyChecker.for_plan(plan, True)
    assert "epoch 1 took 39 optimizer steps but the plan expects 40" in str(checker.epoch_problem(1, 39))
    assert checker.epoch_problem(2, 1) is None  # said once


def test_dump_metrics_state_during_and_after_validation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = trainer(
        tmp_path,
        "TRAIN.EPOCHS",
        "1",
        "SCHEDULE.VALIDATION.MASK_META_INTERVAL_EPOCHS",
        "1",
        "SCHEDULE.VALIDATION.PARTIAL_MASK_META.ENABLED",
        "false",
    )
    dumps: list[str] = []
    real_pass = events_module.run_pass

    def dumping_pass(*args: Any, **kwargs: Any) -> dict[str, float]:  # a debugger's view before each pass
        dumps.append(json.dumps(run.dump_metrics_state(), allow_nan=False))
        return real_pass(*args, **kwargs)

    monkeypatch.setattr(events_module, "run_pass", dumping_pass)
    summary = run.fit()
    before_first, before_second = (json.loads(d) for d in dumps)
    assert before_first["stage"] == "VALIDATION_NORMAL"
    assert before_first["validation"]["pending"] == ["VALIDATION_NORMAL", "VALIDATION_MASK_META"]
    assert before_first["validation"]["passes"] == {}
    assert before_second["stage"] == "VALIDATION_MASK_META"
    assert before_second["validation"]["completed"] == ["VALIDATION_NORMAL"]
    assert list(before_second["validation"]["passes"]) == ["val"]

    after = json.loads(json.dumps(run.dump_metrics_state(), allow_nan=False))
    assert after["global_step"] == STEPS_PER_EPOCH
    assert after["validation"]["pending"] == []
    assert after["validation"]["last"] == summary["last_validation"]
    passes = after["validation"]["passes"]
    assert passes["val"] == before_second["validation"]["passes"]["val"]
    assert (
        passes["val_mask_meta"]["val_mask_meta/chain_acc"]
        == summary["last_validation"]["val_mask_meta/chain_acc"]
    )
    assert set(after["train_window"]) >= {"sums", "steps"}
    assert after["early_stopping"] == run.early_stopping.state_dict()
