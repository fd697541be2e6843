"""Rolling back past a run's own instabilities (TRAIN.NONFINITE: rollback, TRAIN.LOSS_SPIKE): the
rule and the choice of checkpoint as tables, then real runs of the digits classifier whose data
holds a poisoned sample (NaN pixels: its window's loss is NaN) or whose weights a callback blows up
(the loss spikes), on one and two processes, killed with SIGKILL before, during and after a
rollback and rerun."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers.configs import CFG
from helpers.in_process import plan_text, reset_accelerate, run_cli, run_here
from helpers.launches import launch_logged
from helpers.processes import AFTER_FIRST_COMMIT, accelerate_launch_command
from helpers.rollback import NAN_RUN, RUN_SCRIPT, SCRIPT  # registers poisoned_digits and blow_up here too
from helpers.runs import TrainRun, assert_same_run, read_metrics, read_summary
from safetensors.torch import load_file

from linnaeus_accel.config import ConfigError, load_config
from linnaeus_accel.training.recovery import rollback_target, spikes

# -- the rule and the target, as tables ---------------------------------------------------------


@pytest.mark.parametrize(
    ("history", "loss", "factor", "window", "expected"),
    [
        ([2.0, 2.0, 2.0], 4.1, 2.0, 3, True),  # over twice the mean of the last 3
        ([2.0, 2.0, 2.0], 4.0, 2.0, 3, False),  # at the threshold is not over it
        ([2.0, 2.0], 9.0, 2.0, 3, False),  # fewer records than the window: not armed yet
        ([9.0, 1.0, 1.0, 1.0], 2.1, 2.0, 3, True),  # only the last 3 make the mean (1.0)
        ([9.0, 1.0, 1.0, 1.0], 2.1, 2.0, 4, False),  # all 4 do (3.0): 2.1 is below it
        ([-1.0, -1.0], 5.0, 2.0, 2, False),  # a mean at or below 0 gives no threshold
        ([1.0, 1.0], math.inf, 2.0, 2, True),  # an infinite loss spikes
    ],
)
def test_a_record_spikes_over_factor_times_the_running_mean(
    history: list[float], loss: float, factor: float, window: int, expected: bool
) -> None:
    assert spikes(history, loss, factor, window) is expected


@pytest.mark.parametrize(
    ("steps", "anchor", "spans", "expected"),
    [
        ([4, 8, 12], 10, [], 8),  # the newest at or before the last good record
        ([4, 8, 12], 12, [], 12),  # a checkpoint at the record itself is good
        ([4, 8, 12], 3, [], None),  # none before it: nothing to go back to
        ([4, 8, 12, 16], 20, [(4, 13)], 16),  # a checkpoint after a rolled-back span is good again
        ([4, 8, 12], 20, [(4, 13)], 4),  # 8 and 12 were trained through the bad window: never
        ([4, 8], 20, [(0, 9)], None),  # every one inside a span
        ([], 20, [], None),
    ],
)
def test_a_rollback_goes_to_the_newest_checkpoint_before_the_window_outside_rolled_back_spans(
    steps: list[int], anchor: int, spans: list[tuple[int, int]], expected: int | None
) -> None:
    assert rollback_target(steps, anchor, spans) == expected


def test_a_rollback_without_checkpoints_to_go_back_to_is_refused_naming_the_keys() -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(CFG, ["TRAIN.NONFINITE", "rollback", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null"])
    assert "TRAIN.NONFINITE is rollback, but no checkpoint is written before the run's end" in str(
        refused.value
    )
    assert "set SCHEDULE.CHECKPOINT.INTERVAL_STEPS" in str(refused.value)
    with pytest.raises(ConfigError, match=r"TRAIN.LOSS_SPIKE.FACTOR is 1: a loss at or below its own mean"):
        load_config(CFG, ["TRAIN.LOSS_SPIKE.FACTOR", "1.0"])


def test_plan_says_how_far_a_rollback_goes_and_that_the_run_still_ends_at_its_step() -> None:
    text = plan_text(
        "--opts", *NAN_RUN[: NAN_RUN.index("DATA.DATASET.NAME")], "TRAIN.NONFINITE", "rollback",
        "TRAIN.ROLLBACK.SKIP_STEPS", "1", "TRAIN.LOSS_SPIKE.ACTION", "rollback",
    )  # fmt: skip
    assert (
        "Loss spikes:     a record's loss over 2x the mean of the 10 records before it, 1 in a row "
        "(records every 2 steps): rollback"
    ) in text
    assert (
        "Rollback:        on a NaN or infinite loss or gradient norm and a loss spike: back to the newest "
        "checkpoint before the window (checkpoints every 4 steps, records every 2: up to about 6 steps redone), "
        "that data skipped plus 1 more steps' worth; at most 3 rollbacks, then the run stops"
    ) in text
    assert "the run still ends at step 24 on the data the plan says" in text
    far = plan_text("--opts", "TRAIN.NONFINITE", "rollback", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "30")
    assert (
        "TRAIN.NONFINITE: rollback needs a checkpoint to go back to, and the first one comes at the run's end"
        in far
    )


def test_plan_warns_of_a_spike_rule_that_never_arms_and_a_skip_longer_than_the_run() -> None:
    base = NAN_RUN[: NAN_RUN.index("DATA.DATASET.NAME")]  # 24 steps, records every 2
    never = plan_text("--opts", *base, "TRAIN.LOSS_SPIKE.ACTION", "stop", "TRAIN.LOSS_SPIKE.WINDOW", "12")
    assert (
        "TRAIN.LOSS_SPIKE.WINDOW: the spike rule needs 12 records before it can find a spike (1 more in a "
        "row), a record every 2 steps: step 26 at the earliest, past this run's 24 steps, so it never acts"
    ) in never
    armed = plan_text("--opts", *base, "TRAIN.LOSS_SPIKE.ACTION", "stop", "TRAIN.LOSS_SPIKE.WINDOW", "11")
    assert "TRAIN.LOSS_SPIKE.WINDOW:" not in armed  # step 24: the run's last record can still find one
    skip = plan_text("--opts", *base, "TRAIN.NONFINITE", "rollback", "TRAIN.ROLLBACK.SKIP_STEPS", "24")
    assert (
        "TRAIN.ROLLBACK.SKIP_STEPS: 24 steps skipped after a rollback is at least this run's 24 steps"
    ) in skip
    fits = plan_text("--opts", *base, "TRAIN.NONFINITE", "rollback", "TRAIN.ROLLBACK.SKIP_STEPS", "23")
    assert "TRAIN.ROLLBACK.SKIP_STEPS:" not in fits


def test_plan_warns_that_checkpoints_only_at_epoch_ends_leave_the_first_epochs_unprotected() -> None:
    epochs = plan_text("--opts", "TRAIN.NONFINITE", "rollback")  # the default: every 5 epochs of 45 steps
    assert (
        "TRAIN.NONFINITE: checkpoints only at epoch ends: a NaN or spike before the first one (step 225) "
        "cannot be rolled back (the run stops there)"
    ) in epochs
    steps = plan_text("--opts", *NAN_RUN[: NAN_RUN.index("DATA.DATASET.NAME")], "TRAIN.NONFINITE", "rollback")
    assert "checkpoints only at epoch ends" not in steps  # mid-epoch checkpoints every 4 steps


# -- real runs -----------------------------------------------------------------------------------

# What each rollback of NAN_RUN is: step 7 is NaN, found at the record of step 8; the last good
# record is step 6, the newest checkpoint at or before it step 4; steps 5..9 make no update.
EXPECTED_ROLLBACKS = [
    {
        "detected_at": 8, "rule": "nonfinite", "loss": None, "back_to": 4, "checkpoint": "step_00000004",
        "skip_until": 9, "skipped_steps": 5, "samples_at_checkpoint": 512, "tokens_at_checkpoint": 0,
        "samples_skipped": 5 * 128, "tokens_skipped": 0,
    },
    {
        "detected_at": 20, "rule": "nonfinite", "loss": None, "back_to": 16, "checkpoint": "step_00000016",
        # epoch 1 holds 1,438 samples (its last batch 30); steps 17..21 are 5 whole batches of epoch 2
        "skip_until": 21, "skipped_steps": 5, "samples_at_checkpoint": 1438 + 4 * 128,
        "tokens_at_checkpoint": 0, "samples_skipped": 5 * 128, "tokens_skipped": 0,
    },
]  # fmt: skip


def mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def in_process(root: Path, opts: list[str]) -> tuple[int, str, Path]:
    """The CLI in this process (helpers.rollback, imported above, registered the dataset and callback)."""
    reset_accelerate()
    try:
        rc, _, err = run_cli(
            "train", "--cfg", CFG, "--opts", "ENV.OUTPUT.BASE_DIR", str(root / "outputs"), "EXPERIMENT.NAME", "run",
            *opts,
        )  # fmt: skip
    finally:
        reset_accelerate()
    return rc, err, root / "outputs" / "run"


@pytest.mark.slow
def test_a_poisoned_sample_is_rolled_back_exactly_and_a_kill_anywhere_resumes_to_the_same_bytes(
    tmp_path: Path,
) -> None:
    # The uninterrupted run, in a subprocess as a user runs it (the reference the others match).
    reference = TrainRun(tmp_path, NAN_RUN).run(python_code=RUN_SCRIPT).check_ok()
    summary = read_summary(reference.dir)
    assert (summary["status"], summary["global_step"]) == ("completed", 24), summary
    assert summary["rollbacks"] == EXPECTED_ROLLBACKS
    weights = load_file(str(reference.dir / "final" / "model.safetensors"))
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())
    assert (
        "rolled back: a non-finite loss at step 8; reloaded step_00000004 and skipping the data of steps "
        "5..9 (5 steps without an update); rollback 1 of at most 3"
    ) in reference.output
    records = read_metrics(reference.dir)
    assert {"global_step": 8, "train/rollbacks": 1.0} in records
    # The record of steps 9-10 averages step 10 alone (9 made no update); none reads NaN.
    assert all(math.isfinite(r["train/loss"]) for r in records if "train/loss" in r)
    assert [r["train/rollbacks"] for r in records if r["global_step"] == 24 and "train/loss" in r] == [2.0]

    # The same config again, in this process: the same bytes.
    rc, err, again = in_process(tmp_path / "again", NAN_RUN)
    assert rc == 0, err
    assert (again / "final" / "model.safetensors").read_bytes() == (
        reference.dir / "final" / "model.safetensors"
    ).read_bytes()

    # Killed inside the first rollback (its checkpoint loaded, nothing recorded), then again at step
    # 13 (after it, the newest checkpoint step 12's), then left to finish: the reference's bytes,
    # metrics and summary.
    run = TrainRun(mkdir(tmp_path / "killed"), NAN_RUN)
    run.run(kill_at="rollback:1", python_code=RUN_SCRIPT).check_killed()
    # the kill waits for step 12's commit, the first of this process (in the background)
    first = run.run(
        kill_at="optimizer_step:9", python_code=RUN_SCRIPT, extra_env=AFTER_FIRST_COMMIT
    ).check_killed()
    assert "resumed from" in first.output
    assert "rolled back: a non-finite loss at step 8" in first.output
    resumed = run_here(run)  # the rerun needs no process of its own (helpers.rollback is imported)
    assert "resumed from" in resumed.output, resumed.tail()
    assert "step_00000012" in resumed.output, resumed.tail()
    assert_same_run(resumed, reference)
    assert read_summary(run.dir)["rollbacks"] == EXPECTED_ROLLBACKS


@pytest.mark.slow
def test_two_processes_agree_on_each_rollback(tmp_path: Path) -> None:
    """Batches of 64 on each of 2 processes are NAN_RUN's global batches of 128: the same rollbacks,
    decided alike on both processes, and the same weights to float tolerance (without mixup, which
    pairs samples inside each process's batch)."""
    no_mixup = [*NAN_RUN, "SCHEDULE.MIXUP.PROB.ENABLED", "false"]
    reference = run_here(TrainRun(tmp_path, no_mixup)).check_ok()
    base = tmp_path / "two" / "outputs"
    opts = [*no_mixup, "DATA.BATCH_SIZE", "64", "ENV.OUTPUT.BASE_DIR", str(base), "EXPERIMENT.NAME", "run"]
    command = [*accelerate_launch_command(2), str(SCRIPT), "train", "--cfg", CFG, "--opts", *opts]
    two = launch_logged(command, tmp_path, "two", base / "run").check_ok()
    assert two.summary()["status"] == "completed"
    assert two.summary()["rollbacks"] == EXPECTED_ROLLBACKS
    ours, want = two.weights(), load_file(str(reference.dir / "final" / "model.safetensors"))
    for name, tensor in want.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_nan_found_before_a_checkpoint_is_rolled_back_before_it_is_written(tmp_path: Path) -> None:
    """Records every 6 steps, checkpoints every 4: the NaN of step 7 is found before the checkpoint
    of step 8 is written (not at a record), rolled back to the same checkpoint as above, and step 8's
    checkpoint then holds the good weights."""
    rc, err, run = in_process(tmp_path, [*NAN_RUN, "SCHEDULE.METRICS.STEP_INTERVAL", "6"])
    assert rc == 0, err
    assert read_summary(run)["rollbacks"] == EXPECTED_ROLLBACKS
    assert not any("train/loss" in r and not math.isfinite(r["train/loss"]) for r in read_metrics(run))


@pytest.mark.slow
def test_one_rollback_more_than_the_limit_fails_the_run_with_the_reason(tmp_path: Path) -> None:
    rc, err, run = in_process(tmp_path, [*NAN_RUN, "TRAIN.ROLLBACK.MAX", "1"])
    assert rc == 1
    assert (
        "the training loss or gradient norm became NaN or infinite by step 20; the run has rolled back once "
        "already (TRAIN.ROLLBACK.MAX), so the run stops without saving that state"
    ) in err
    summary = read_summary(run)
    assert summary["status"] == "failed"
    assert summary["rollbacks"] == EXPECTED_ROLLBACKS[:1]


# A callback multiplies every weight by 30 after steps 13 and 14 (a huge LR for two steps): the
# records from step 14 on spike over 3x the mean of the 4 before; 3 records in a row (14, 16, 18)
# make a spike. Between them the checkpoint of step 16 holds the blown-up weights and is the newest:
# retention (the newest one kept; validated at the end only, so none is kept as the best) must keep
# step 12's, which the rollback needs.
SPIKE_RUN = [
    "SCHEDULE.VALIDATION.INTERVAL_EPOCHS", "2",
    *NAN_RUN[: NAN_RUN.index("DATA.DATASET.NAME")],
    "TRAIN.LOSS_SPIKE.ACTION", "rollback", "TRAIN.LOSS_SPIKE.FACTOR", "3", "TRAIN.LOSS_SPIKE.WINDOW", "4",
    "TRAIN.LOSS_SPIKE.CONSECUTIVE", "3",
    "CALLBACKS", "[{NAME: blow_up, OPTIONS: {steps: [13, 14], factor: 30}}]",
]  # fmt: skip


@pytest.mark.slow
def test_a_loss_spike_is_rolled_back_and_the_run_recovers(tmp_path: Path) -> None:
    rc, err, spiked = in_process(tmp_path / "off", [*SPIKE_RUN, "TRAIN.LOSS_SPIKE.ACTION", "off"])
    assert rc == 0, err
    rc, err, rolled = in_process(tmp_path / "on", SPIKE_RUN)
    assert rc == 0, err
    summary = read_summary(rolled)
    (rollback,) = summary["rollbacks"]
    # The blow-up after step 13 makes the records of steps 14, 16 and 18 spike: found at the third,
    # back to the checkpoint of step 12 (the last good record's), the data of steps 13..18 skipped.
    assert (rollback["rule"], rollback["detected_at"], rollback["back_to"]) == ("spike", 18, 12), rollback
    assert rollback["skipped_steps"] == 6
    assert rollback["loss"] > 3 * 1.0, rollback
    assert summary["status"] == "completed"
    assert summary["global_step"] == 24

    def losses(run: Path) -> dict[int, float]:
        return {r["global_step"]: r["train/loss"] for r in read_metrics(run) if "train/loss" in r}

    before = losses(rolled)[12]
    # Left alone, the blown-up model ends far worse than before the blow-up; rolled back, it goes on
    # learning from step 12's weights, as the run would have without the blow-up.
    assert losses(spiked)[24] > 3 * before, losses(spiked)
    assert losses(rolled)[24] < before, losses(rolled)
    stop = in_process(tmp_path / "stop", [*SPIKE_RUN, "TRAIN.LOSS_SPIKE.ACTION", "stop"])
    assert stop[0] == 1
    assert "the training loss spiked to" in stop[1], stop[1]
    assert "TRAIN.LOSS_SPIKE.ACTION is stop" in stop[1], stop[1]
