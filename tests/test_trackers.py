"""Experiment trackers (EXPERIMENT.TRACKERS) and the SCHEDULE.METRICS intervals, end to end.

Runs are real ``linnaeus-accel train`` runs on the digits (2 epochs of 12 steps); what the trackers
hold is read back with the libraries' own readers: wandb's ``wandb leet inspect`` for the offline
``.wandb`` file, TensorBoard's ``EventAccumulator`` for the event files.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from accelerate import Accelerator
from accelerate.tracking import LOGGER_TYPE_TO_CLASS
from helpers.configs import CFG
from helpers.in_process import reset_accelerate, run_cli, train_in_process
from helpers.processes import AFTER_FIRST_COMMIT
from helpers.runs import read_metrics
from helpers.trackers import wandb_history, wandb_records, wandb_run_files

from linnaeus_accel.config import ConfigError, load_config, validate_config
from linnaeus_accel.config.run import TRACKER_NAMES
from linnaeus_accel.data import build_dataset
from linnaeus_accel.models import build_model
from linnaeus_accel.run_directory.trackers import TRACKER_INSTALL, log_with
from linnaeus_accel.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

NAME = "digits_default"
TOTAL = 24  # 2 epochs of 12 steps of 128 samples
SMALL = ["TRAIN.EPOCHS", "2", "DATA.BATCH_SIZE", "128"]
# Every interval at work: metrics every 5 steps, the LR every 2, trackers every 10, the console
# every 7 (rounded up to 10).
INTERVALS = [
    "SCHEDULE.METRICS.STEP_INTERVAL",
    "5",
    "SCHEDULE.METRICS.LR_INTERVAL",
    "2",
    "SCHEDULE.METRICS.WANDB_INTERVAL",  # linnaeus' spelling of TRACKER_INTERVAL
    "10",
    "SCHEDULE.METRICS.CONSOLE_INTERVAL",
    "7",
]


def steps_with(records: list[dict[str, Any]], key: str) -> list[int]:
    return [r["global_step"] for r in records if key in r]


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of the event files in ``directory``, read by TensorBoard itself (which
    discards what a killed run logged past its restart point)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


# -- the names -----------------------------------------------------------------------------------
def test_tracker_names_are_those_accelerate_supports() -> None:
    assert set(TRACKER_NAMES) == set(LOGGER_TYPE_TO_CLASS)
    assert set(TRACKER_INSTALL) == set(TRACKER_NAMES)
    assert TRACKER_INSTALL["tensorboard"] == "pip install 'linnaeus-accel[tensorboard]'"


def test_unknown_tracker_is_a_config_error_listing_the_valid_names() -> None:
    with pytest.raises(ConfigError) as info:
        validate_config({"EXPERIMENT": {"TRACKERS": ["tensorbord"]}})
    text = str(info.value)
    assert "EXPERIMENT.TRACKERS" in text
    assert "'tensorbord'" in text
    assert all(name in text for name in TRACKER_NAMES)


def test_wandb_enabled_adds_wandb_to_the_trackers_once() -> None:
    both = validate_config({"EXPERIMENT": {"TRACKERS": ["tensorboard", "wandb"], "WANDB": {"ENABLED": True}}})
    assert both.EXPERIMENT.trackers == ("tensorboard", "wandb")
    assert validate_config({"EXPERIMENT": {"WANDB": {"ENABLED": True}}}).EXPERIMENT.trackers == ("wandb",)
    listed = validate_config({"EXPERIMENT": {"TRACKERS": ["wandb"], "WANDB": {"ENABLED": False}}})
    assert listed.EXPERIMENT.trackers == ("wandb",)


def test_pipeline_interval_is_a_migration_error() -> None:
    with pytest.raises(ConfigError) as info:
        validate_config({"SCHEDULE": {"METRICS": {"PIPELINE_INTERVAL": 100}}})
    text = str(info.value)
    assert "SCHEDULE.METRICS.PIPELINE_INTERVAL was removed" in text
    assert "perf/data_time_share" in text
    assert "STEP_INTERVAL" in text


def test_missing_tracker_package_is_a_config_error_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    absent = next(n for n in ("mlflow", "comet_ml", "clearml", "aim") if importlib.util.find_spec(n) is None)
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli(
        "train",
        "--cfg",
        CFG,
        "--opts",
        "ENV.OUTPUT.BASE_DIR",
        str(tmp_path / "out"),
        "EXPERIMENT.TRACKERS",
        f"[tensorboard, {absent}]",
    )
    assert rc == 2, (out, err)
    assert "EXPERIMENT.TRACKERS" in err
    assert f"logs to {absent}, whose package is not installed: {TRACKER_INSTALL[absent]}" in err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_an_accelerator_given_without_the_configured_tracker_is_a_config_error(tmp_path: Path) -> None:
    opts = ["ENV.OUTPUT.BASE_DIR", str(tmp_path / "out"), *SMALL, "EXPERIMENT.TRACKERS", "[tensorboard]"]
    config = load_config(CFG, opts)
    train_data = build_dataset(config, "train")
    with pytest.raises(ConfigError) as info:
        Trainer(config, build_model(config, train_data), train_data, accelerator=Accelerator())
    assert "EXPERIMENT.TRACKERS: lists tensorboard but the Accelerator given does not log to it" in str(
        info.value
    )
    reset_accelerate()
    # What the message tells the user to do.
    given = Accelerator(log_with=log_with(config.EXPERIMENT, config.output_dir))
    trainer = Trainer(config, build_model(config, train_data), train_data, accelerator=given)
    assert trainer.accelerator is given


# -- trackers and intervals, end to end ----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.usefixtures("wandb_offline")
def test_trackers_hold_what_each_interval_says_at_global_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    opts = ["ENV.OUTPUT.BASE_DIR", str(tmp_path / "out"), *SMALL, *INTERVALS]
    opts += ["EXPERIMENT.TRACKERS", "[tensorboard]", "EXPERIMENT.WANDB.ENABLED", "true"]
    assert train_in_process(opts) == 0
    shown = capsys.readouterr().out
    out = tmp_path / "out" / NAME

    # metrics.jsonl: every metrics record (every 5 steps and the last), the LR every 2 steps.
    metrics = read_metrics(out)
    assert steps_with(metrics, "train/loss") == [5, 10, 15, 20, TOTAL]
    lr_steps = list(range(2, TOTAL + 1, 2))
    assert steps_with(metrics, "lr/default") == lr_steps
    assert steps_with(metrics, "val/loss") == [12, TOTAL]
    train_at = {r["global_step"]: r for r in metrics if "train/loss" in r}
    val_at = {r["global_step"]: r for r in metrics if "val/loss" in r}
    lr_at = {r["global_step"]: r["lr/default"] for r in metrics if "lr/default" in r}

    # The trackers: training records every 10 steps (and the last), the LR and validation as logged.
    tracked_train = [10, 20, TOTAL]
    records = wandb_records(wandb_run_files(out)[0])
    assert {r["run"]["display_name"] for r in records if r["type"] == "run"} == {NAME}
    history = wandb_history(records)
    scalars = tensorboard_scalars(out / "tensorboard")
    assert sorted(s for s, row in history.items() if "train/loss" in row) == tracked_train
    assert [s for s, _ in scalars["train/loss"]] == tracked_train
    for step in tracked_train:
        for key, value in train_at[step].items():
            if key != "global_step":
                assert history[step][key] == pytest.approx(value, rel=1e-9), (step, key)
        assert dict(scalars["train/loss"])[step] == pytest.approx(train_at[step]["train/loss"], rel=1e-6)
    assert sorted(s for s, row in history.items() if "lr/default" in row) == lr_steps
    assert [s for s, _ in scalars["lr/default"]] == lr_steps
    assert all(history[s]["lr/default"] == pytest.approx(lr, rel=1e-9) for s, lr in lr_at.items())
    assert dict(scalars["lr/default"]) == pytest.approx(lr_at, rel=1e-6)
    assert sorted(s for s, row in history.items() if "val/loss" in row) == [12, TOTAL]
    for step, record in val_at.items():
        for key, value in record.items():
            if key != "global_step":
                assert history[step][key] == pytest.approx(value, rel=1e-9), (step, key)
    assert dict(scalars["val/loss"]) == pytest.approx({s: r["val/loss"] for s, r in val_at.items()}, rel=1e-6)

    # The console: the bar's loss/lr/samples-s every 10 steps (7 rounded up) and at the last step.
    assert "console every 10 steps (CONSOLE_INTERVAL 7 rounded up to a multiple of 5)" in shown
    assert "trackers (tensorboard, wandb) every 10 steps" in shown
    assert re.findall(r"step (\d+)/24: loss", shown) == ["10", "20", "24"], shown


@pytest.mark.slow
@pytest.mark.usefixtures("wandb_offline")
def test_killed_run_resumes_the_same_wandb_run_and_tensorboard_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed (SIGKILL) after its step-8 checkpoint, at step 11; rerun: W&B continues the run with
    the id the checkpoint holds, TensorBoard appends to the same directory and its reader shows
    each step once, as metrics.jsonl does."""
    monkeypatch.chdir(tmp_path)
    opts = ["ENV.OUTPUT.BASE_DIR", str(tmp_path / "out"), *SMALL, "SCHEDULE.METRICS.STEP_INTERVAL", "5"]
    opts += ["EXPERIMENT.TRACKERS", "[tensorboard, wandb]"]
    opts += ["SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null", "SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "8"]
    opts += ["SCHEDULE.CHECKPOINT.MID_EPOCH", "true"]
    # step 10 is logged first; the kill waits for the step-8 commit (in the background)
    env = {**os.environ, "LINNAEUS_ACCEL_KILL_AT": "optimizer_step:11", **AFTER_FIRST_COMMIT}
    # A requeued job starts its own wandb service; inheriting this process's (WANDB_SERVICE, set by an
    # earlier test's run) would leave the killed run's stream open in it ("run ID ... is in use").
    env.pop("WANDB_SERVICE", None)
    command = [sys.executable, "-m", "linnaeus_accel", "train", "--cfg", CFG, "--opts", *opts]
    killed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    out = tmp_path / "out" / NAME
    assert [s for s, _ in tensorboard_scalars(out / "tensorboard")["train/loss"]] == [5, 10]

    assert train_in_process(opts) == 0
    metrics = read_metrics(out)
    assert steps_with(metrics, "train/loss") == [5, 10, 15, 20, TOTAL]

    # W&B: the rerun continues the same run (two processes' files, one run id).
    files = wandb_run_files(out)
    assert len(files) == 2
    first, resumed = wandb_records(files[0], finished=False), wandb_records(files[1])
    run_ids = {r["run"]["run_id"] for r in first + resumed if r["type"] == "run"}
    assert len(run_ids) == 1
    assert sorted(s for s, row in wandb_history(resumed).items() if "train/loss" in row) == [10, 15, 20, 24]

    # TensorBoard: one directory, written by both processes; the killed run's step 10 (after the
    # checkpoint) is discarded, the rerun's kept: each step once, the values of metrics.jsonl.
    event_files = sorted((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(event_files) == 2
    scalars = tensorboard_scalars(out / "tensorboard")
    loss = {r["global_step"]: r["train/loss"] for r in metrics if "train/loss" in r}
    assert [s for s, _ in scalars["train/loss"]] == list(loss)
    assert dict(scalars["train/loss"]) == pytest.approx(loss, rel=1e-6)
    assert [s for s, _ in scalars["val/loss"]] == [12, TOTAL]
