"""How long a run is (docs/semantics.md §7): exactly one of ``TRAIN.EPOCHS``, ``TRAIN.STEPS`` and
``TRAIN.TARGET_TOKENS``; with STEPS, ``T = STEPS`` and epochs end where the data ends, the last one
possibly partial; a stream without ``__len__`` has epochs of unknown length (its ``*_EPOCHS`` keys
are errors naming them, fractions resolve against ``T``, and ``plan`` says what it cannot know).
Mid-epoch validation (``SCHEDULE.VALIDATION.MID_EPOCH``) fires at the step multiples themselves.
"""

from __future__ import annotations

import json

import pytest
from helpers.configs import make_config
from helpers.in_process import run_cli

from linnaeus_accel.config import Config, ConfigError, validate_config
from linnaeus_accel.schedule import OpsSchedule, ResolvedPlan, batches_per_process, resolve_plan
from linnaeus_accel.schedule.boundaries import Boundary, Interval
from linnaeus_accel.schedule.report.settings import report_settings
from linnaeus_accel.schedule.report.summary import plan_json, summary_text


def plan_of(
    config: Config, size: int | None, world: int = 1, tokens_per_sample: int | None = None
) -> ResolvedPlan:
    """None: a stream without __len__."""
    batches = None if size is None else batches_per_process(size, 32, world, config.DATA.DROP_LAST)
    return resolve_plan(config, batches, world, size, tokens_per_sample)


# ---------------------------------------------------------------------------------------------
# TRAIN.STEPS


@pytest.mark.parametrize(
    ("steps", "size", "accum", "ope", "epochs", "last"),
    [
        (250, 3200, 1, 100, 3, 50),  # 100 steps an epoch: two whole epochs and 50 steps of a third
        (300, 3200, 1, 100, 3, 100),  # exactly three epochs: nothing partial
        (301, 3200, 1, 100, 4, 1),  # one step more opens a fourth epoch of one step
        (7, 3200, 1, 100, 1, 7),  # fewer steps than an epoch: one partial epoch
        (130, 3200, 4, 25, 6, 5),  # accumulation 4: 25 steps an epoch, 5 x 25 + 5
        (10, 3210, 1, 101, 1, 10),  # 3210 samples: 101 batches, the last padded
    ],
)
def test_steps_is_the_run_length_and_epochs_end_where_the_data_ends(
    steps: int, size: int, accum: int, ope: int, epochs: int, last: int
) -> None:
    plan = plan_of(make_config(steps=steps, accumulation=accum), size)
    assert (plan.total_steps, plan.optimizer_steps_per_epoch, plan.epochs) == (steps, ope, epochs)
    assert plan.last_epoch_steps == last
    assert plan.boundary_step(epochs) == steps  # the final boundary is at T, even mid-epoch
    assert plan.length_key == "TRAIN.STEPS"
    ops = OpsSchedule(plan)
    assert ops.should_end_epoch(epochs, steps)
    assert not ops.should_end_epoch(epochs, steps - 1)


def test_steps_counts_the_run_tokens_exactly() -> None:
    # 3210 samples, 32 a batch: 100 full batches and one of 10, 101 steps an epoch. 250 steps = 2
    # epochs (3210 samples each) + 48 full steps of the third: (2 x 3210 + 48 x 32) x 127 tokens.
    plan = plan_of(make_config(steps=250), 3210, tokens_per_sample=127)
    assert plan.tokens_per_step == 32 * 127
    assert plan.total_tokens == (2 * 3210 + 48 * 32) * 127


def test_fractions_resolve_against_steps() -> None:
    config = make_config(
        steps=1000,
        schedule={"VALIDATION": {"INTERVAL_FRACTION": 0.25}},
    )
    plan = plan_of(config, None)
    assert plan.validation == Interval("steps", 250)


@pytest.mark.parametrize(
    "given",
    [
        {"EPOCHS": 2, "STEPS": 10},
        {"STEPS": 10, "TARGET_TOKENS": 1000},
        {"EPOCHS": 2, "STEPS": 10, "TARGET_TOKENS": 1000},
    ],
)
def test_two_run_lengths_are_an_error_naming_each(given: dict[str, int]) -> None:
    with pytest.raises(ConfigError) as info:
        validate_config({"TRAIN": given})
    text = str(info.value)
    for key in given:
        assert f"TRAIN.{key}" in text
    assert "exactly one" in text


def test_steps_written_as_a_float_is_read_as_whole() -> None:
    assert make_config(steps=1e5).TRAIN.STEPS == 100_000
    with pytest.raises(ConfigError, match=r"TRAIN\.STEPS"):
        make_config(steps=2.5)


def test_plan_cli_with_steps_says_the_partial_epoch() -> None:
    rc, out, err = run_cli(
        "plan",
        "--cfg",
        "configs/default.yaml",
        "--opts",
        "TRAIN.EPOCHS",
        "null",
        "TRAIN.STEPS",
        "50",
        "DATA.BATCH_SIZE",
        "64",
    )
    assert rc == 0, err
    # 1438 training digits in batches of 64: 23 steps an epoch; 50 = 23 + 23 + 4
    assert "50 total steps from TRAIN.STEPS = 3 epochs, the last partial (4 of 23 steps)" in out


# ---------------------------------------------------------------------------------------------
# A stream without __len__: epochs of unknown length


def test_unknown_length_needs_steps_or_tokens_and_names_every_epoch_key() -> None:
    config = make_config(
        epochs=3,
        schedule={
            "VALIDATION": {"INTERVAL_EPOCHS": 1},
            "CHECKPOINT": {"INTERVAL_EPOCHS": 2},
        },
    )
    with pytest.raises(ConfigError) as info:
        plan_of(config, None)
    text = str(info.value)
    for key in ("TRAIN.EPOCHS", "SCHEDULE.VALIDATION.INTERVAL_EPOCHS", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS"):
        assert key in text
    assert "TRAIN.STEPS" in text
    assert "INTERVAL_STEPS" in text  # the fix for an interval


def test_unknown_length_with_steps_resolves_without_epochs() -> None:
    config = make_config(
        steps=1000,
        schedule={
            "VALIDATION": {"INTERVAL_STEPS": 300, "MID_EPOCH": True},
            "CHECKPOINT": {"INTERVAL_FRACTION": 0.5},
        },
    )
    plan = plan_of(config, None)
    assert (plan.total_steps, plan.epochs, plan.optimizer_steps_per_epoch, plan.batches_per_epoch) == (
        1000,
        None,
        None,
        None,
    )
    assert not plan.known_epochs
    ops = OpsSchedule(plan)
    assert [k for k in range(1, 1001) if ops.should_validate_mid_epoch(k)] == [300, 600, 900]
    assert not ops.should_end_epoch(1, 999)  # the stream ends the epoch, not the plan
    assert ops.should_end_epoch(1, 1000)  # but the run's last step does
    text = summary_text(report_settings(config), plan)
    assert "a stream without __len__" in text
    assert "1000 total steps from TRAIN.STEPS; optimizer steps per epoch unknown" in text
    assert (
        "Validation:            every 300 steps (at the step itself, mid-epoch), and at the last step (1000)"
        in text
    )
    assert "at the first end of a pass after every 500 steps (where passes end is unknown)" in text
    # The checkpoint interval waits for pass ends: the plan warns and names the fix.
    assert any("SCHEDULE.CHECKPOINT.MID_EPOCH" in w for w in plan.warnings)
    data = plan_json(report_settings(config), plan, with_series=False)
    assert data["events"] is None
    assert data["event_steps"]["validation"] == [300, 600, 900, 1000]
    assert data["event_steps"]["checkpoint"] == [1000]


def test_target_tokens_of_a_stream_needs_drop_last() -> None:
    config = make_config(target_tokens=10**6)
    with pytest.raises(ConfigError, match=r"TRAIN\.TARGET_TOKENS.*DROP_LAST"):
        plan_of(config, None, tokens_per_sample=127)
    plan = plan_of(make_config(target_tokens=10**6, drop_last=True), None, tokens_per_sample=127)
    assert plan.total_steps == -(-(10**6) // (32 * 127))
    assert plan.epochs is None


# ---------------------------------------------------------------------------------------------
# Event points: boundaries and mid-epoch


@pytest.mark.parametrize(
    ("interval", "point", "at_step", "fires"),
    [
        (Interval("steps", 100), Boundary(2, 230, 115), False, True),  # the boundary crossed 200
        (Interval("steps", 100), Boundary(3, 300, 230), False, True),  # ... and 300 (on it)
        (Interval("steps", 100), Boundary(2, 199, 115), False, False),  # no multiple crossed
        (Interval("steps", 100), Boundary(2, 200, 199, mid=True), False, False),  # never mid-epoch
        (Interval("steps", 100), Boundary(2, 200, 199, mid=True), True, True),  # MID_EPOCH: at 200
        (Interval("steps", 100), Boundary(2, 230, 115), True, False),  # MID_EPOCH: 200 fired mid-epoch
        (Interval("steps", 100), Boundary(3, 300, 230), True, True),  # MID_EPOCH: a boundary on a multiple
        (Interval("epochs", 2), Boundary(4, 460, 345), False, True),  # every second epoch
        (Interval("epochs", 2), Boundary(4, 400, 399, mid=True), True, False),  # epochs: boundaries only
    ],
)
def test_intervals_fire_at_points(interval: Interval, point: Boundary, at_step: bool, fires: bool) -> None:
    assert interval.fires_at(point, at_step) is fires


def test_mid_epoch_validation_with_known_epochs() -> None:
    config = make_config(
        epochs=3,
        schedule={"VALIDATION": {"INTERVAL_STEPS": 40, "MID_EPOCH": True}},
    )
    plan = plan_of(config, 3200)  # 100 steps an epoch, 300 in all
    ops = OpsSchedule(plan)
    mid = [k for k in range(1, 301) if ops.should_validate_mid_epoch(k)]
    assert mid == [40, 80, 120, 160, 240, 280]  # 200 is a boundary: its own validation covers it
    assert [e for e in (1, 2, 3) if ops.should_validate(e)] == [2, 3]  # 200 is a multiple; 3 is final
    text = summary_text(report_settings(config), plan)
    assert "Validation:            every 40 steps (at the step itself, mid-epoch); after epochs 2, 3" in text


def test_mid_epoch_validation_needs_a_step_interval() -> None:
    with pytest.raises(ConfigError, match=r"SCHEDULE\.VALIDATION\.MID_EPOCH"):
        make_config(epochs=3, schedule={"VALIDATION": {"INTERVAL_EPOCHS": 1, "MID_EPOCH": True}})


def test_plan_json_lists_mid_epoch_steps() -> None:
    rc, out, err = run_cli(
        "plan",
        "--cfg",
        "configs/default.yaml",
        "--json",
        "--no-series",
        "--opts",
        "TRAIN.EPOCHS",
        "2",
        "DATA.BATCH_SIZE",
        "64",
        "SCHEDULE.VALIDATION.INTERVAL_EPOCHS",
        "null",
        "SCHEDULE.VALIDATION.INTERVAL_STEPS",
        "10",
        "SCHEDULE.VALIDATION.MID_EPOCH",
        "true",
    )
    assert rc == 0, err
    data = json.loads(out)
    # 23 steps an epoch: multiples 10, 20, 30, 40 inside epochs (the boundary at 23 is none), and
    # the final boundary at 46
    assert data["event_steps"]["validation"] == [10, 20, 30, 40, 46]
    assert data["events"]["validation"] == [2]
