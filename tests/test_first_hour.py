"""What a new user meets in the first hour: a finished run given another config or another model is
refused in one sentence instead of answering "nothing to do" with the old run's results; Ctrl-C
finishes the step, checkpoints it and exits 130 with no traceback, and the same command resumes."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from helpers.configs import CFG, REPO
from helpers.in_process import reset_accelerate, run_cli, run_here
from helpers.runs import (
    TrainRun,
    assert_resumed_from,
    ckpt,
    committed,
    read_summary,
    wait_for_output,
    wait_for_record,
)
from torch.utils.data import TensorDataset

from linnaeus_accel import Trainer, load_config
from linnaeus_accel.config import ConfigError

# Two epochs of 12 steps of 128 digits: a finished run in a few seconds.
SHORT = ["TRAIN.EPOCHS", "2", "DATA.BATCH_SIZE", "128"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> TrainRun:
    run = TrainRun(tmp_path_factory.mktemp("finished"), SHORT)
    run_here(run).check_ok()
    return run


def test_a_finished_run_given_another_learning_rate_exits_2_naming_the_key(finished: TrainRun) -> None:
    same = run_here(finished).check_ok()
    assert "nothing to do" in same.output
    changed = run_here(TrainRun(finished.root, [*SHORT, "LR_SCHEDULER.BASE_LR", "0.01"]))
    assert changed.returncode == 2, changed.tail()
    line = next(line for line in changed.output.splitlines() if "LR_SCHEDULER.BASE_LR: 0.002 -> 0.01" in line)
    for way in ("--overwrite", "another EXPERIMENT.NAME", "--allow-config-change"):
        assert way in line, line
    assert "Traceback" not in changed.output
    assert read_summary(finished.dir)["status"] == "completed"  # the finished run is as it was
    # Where it writes and how it waits are not the run's: a rerun with other ones has nothing to do.
    elsewhere = run_here(
        TrainRun(finished.root, [*SHORT, "ENV.DIST_TIMEOUT_S", "120", "DATA.NUM_WORKERS", "0"])
    )
    assert "nothing to do" in elsewhere.check_ok().output


def test_a_notebook_rerun_with_another_model_raises_instead_of_returning_the_old_summary(
    tmp_path: Path,
) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = torch.tensor(digits.data, dtype=torch.float32) / 16, torch.tensor(digits.target)
    config = load_config(
        {
            "EXPERIMENT": {"NAME": "cell"},
            "ENV": {"OUTPUT": {"BASE_DIR": str(tmp_path)}},
            "TASK": {"NAME": "classification"},
            "TRAIN": {"EPOCHS": 1},
            "DATA": {"BATCH_SIZE": 256},
            "LR_SCHEDULER": {"BASE_LR": 1e-2, "REFERENCE_BS": None},
        }
    )
    data = TensorDataset(x[:1500], y[:1500]), TensorDataset(x[1500:], y[1500:])

    def fit(hidden: int) -> dict[str, object]:
        reset_accelerate()
        model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
        try:
            return Trainer(config, model, *data).fit()
        finally:
            reset_accelerate()

    assert fit(64)["status"] == "completed"
    assert fit(64)["already_finished"]  # the same cell again: nothing to do
    with pytest.raises(ConfigError, match=r"the model given has weights of shapes the finished run's final/"):
        fit(32)


# A user's script with a callback whose steps take 0.3 s each up to step ``until``: a signal sent
# after a record lands inside a step, at a known point of the run.
SLOW_STEPS = """
import time
from linnaeus_accel import Callback, register_callback
from linnaeus_accel.cli import console

@register_callback("slow_steps")
class SlowSteps(Callback):
    def __init__(self, until):
        self.until = until

    def on_step_end(self, run, step):
        if step <= self.until:
            time.sleep(0.3)

console()
"""
exec(SLOW_STEPS.replace("console()", ""))  # the same callback in this process, for the in-process rerun
# Three epochs of 12 steps, a record every 2 steps, the first 12 steps slow; checkpoints only at the end.
SLOW_RUN = [
    "TRAIN.EPOCHS", "3", "DATA.BATCH_SIZE", "128", "SCHEDULE.METRICS.STEP_INTERVAL", "2",
    "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "3", "CALLBACKS", "[{NAME: slow_steps, OPTIONS: {until: 12}}]",
]  # fmt: skip


def test_ctrl_c_checkpoints_the_step_exits_130_and_the_same_command_resumes(tmp_path: Path) -> None:
    run = TrainRun(tmp_path, SLOW_RUN)
    started = run.start(python_code=SLOW_STEPS)
    wait_for_record(started, lambda r: r.get("global_step", 0) >= 4 and "train/loss" in r)
    started.proc.send_signal(signal.SIGINT)
    stopped = started.finish()
    assert stopped.returncode == 130, stopped.tail()
    assert "Traceback" not in stopped.output
    assert "Ctrl-C: finishing this step and checkpointing it" in stopped.output
    summary = read_summary(run.dir)
    assert summary["status"] == "interrupted", summary
    step = summary["global_step"]
    assert 4 <= step < 12, summary
    assert committed(run.dir) == [ckpt(step)]  # the only checkpoint: the schedule's first is at step 36
    # Its last lines: where it stopped (no validation yet: no dangling colon), and how to go on.
    assert f"\ninterrupted at step {step} (epoch 0)\ncheckpointed: the same command resumes" in stopped.output
    resumed = run_here(run).check_ok()
    assert_resumed_from(resumed.output, step)
    assert read_summary(run.dir)["status"] == "completed"


def test_a_second_ctrl_c_stops_at_once_in_one_sentence(tmp_path: Path) -> None:
    run = TrainRun(tmp_path, SLOW_RUN)
    started = run.start(python_code=SLOW_STEPS)
    wait_for_record(started, lambda r: r.get("global_step", 0) >= 4 and "train/loss" in r)
    started.proc.send_signal(signal.SIGINT)
    wait_for_output(started, "Ctrl-C: finishing this step")
    started.proc.send_signal(signal.SIGINT)
    stopped = started.finish()
    assert stopped.returncode == 130, stopped.tail()
    assert "Traceback" not in stopped.output
    assert "stopped at once by Ctrl-C: the work since the last checkpoint is lost" in stopped.output, (
        stopped.tail()
    )


# -- messages that point the way ------------------------------------------------------------------


def plan_error(*opts: str, cfg: str = CFG) -> str:
    rc, _, err = run_cli("plan", "--cfg", cfg, *(["--opts", *opts] if opts else []))
    assert rc == 2, err
    return err


def test_plan_says_when_no_optimizer_of_that_name_is_registered() -> None:
    rc, out, _ = run_cli("plan", "--cfg", CFG, "--opts", "OPTIMIZER.NAME", "adamq")
    assert rc == 0
    line = next(line for line in out.splitlines() if line.startswith("Optimizer:"))
    assert "adamq (no optimizer of that name is registered here: train fails unless" in line, line
    assert "(registered)" not in line


@pytest.mark.parametrize(
    ("opts", "says"),
    [
        # a fraction of an epoch: counted in steps
        (["TRAIN.EPOCHS", "2.5"], "set TRAIN.STEPS (and TRAIN.EPOCHS: null)"),
        # another trainer's name for the learning rate: where it is here
        (["TRAIN.LEARNING_RATE", "0.1"], "TRAIN.LEARNING_RATE: unknown key: this is LR_SCHEDULER.BASE_LR"),
        # KEY=VALUE: a space, not =
        (["TRAIN.EPOCHS=5"], "write TRAIN.EPOCHS 5 (KEY and VALUE separated by a space, not =)"),
    ],
)
def test_a_mistake_from_another_trainer_says_what_to_write(opts: list[str], says: str) -> None:
    assert says in plan_error(*opts)


def test_an_inherited_unit_colliding_with_a_new_one_names_its_file_and_the_null_to_write(
    tmp_path: Path,
) -> None:
    shutil.copy(CFG, tmp_path / "default.yaml")
    mine = tmp_path / "mine.yaml"
    mine.write_text("BASE: [default.yaml]\nLR_SCHEDULER:\n  WARMUP_STEPS: 10\n", encoding="utf-8")
    err = plan_error("EXPERIMENT.NAME", "mine", cfg=str(mine))
    assert f"LR_SCHEDULER.WARMUP_FRACTION comes from {tmp_path / 'default.yaml'} (through BASE)" in err, err
    assert f"write LR_SCHEDULER.WARMUP_FRACTION: null in {mine}" in err, err
    mine.write_text(
        "BASE: [default.yaml]\nLR_SCHEDULER:\n  WARMUP_STEPS: 10\n  WARMUP_FRACTION: null\n", encoding="utf-8"
    )
    rc, _, err = run_cli("plan", "--cfg", str(mine))
    assert rc == 0, err


def test_a_missing_data_file_names_where_it_was_looked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    err = plan_error(cfg=str(REPO / "configs" / "pretrain.yaml"))
    assert (
        f"'data/reference.bin' is not a file (a relative path is read from the working directory, {tmp_path}: "
        f"this is {tmp_path / 'data' / 'reference.bin'}"
    ) in err, err


def test_counts_are_written_as_integers(finished: TrainRun) -> None:
    records = [json.loads(line) for line in (finished.dir / "metrics.jsonl").read_text().splitlines()]
    trains = [r for r in records if "samples_seen" in r]
    assert trains
    assert all(type(r["samples_seen"]) is int for r in trains), trains[0]
