"""Step accounting (docs/semantics.md §1) and resolving steps / fractions / epochs into global steps (docs/semantics.md §2)."""

from __future__ import annotations

import time
from fractions import Fraction
from typing import Any

import pytest
from helpers.configs import make_config
from hypothesis import given, settings
from hypothesis import strategies as st

from linnaeus_accel.config import ConfigError
from linnaeus_accel.schedule import (
    Interval,
    batches_per_process,
    optimizer_steps_per_epoch,
    resolve_plan,
    steps_from_epochs,
    steps_from_fraction,
)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# docs/semantics.md §1: step accounting
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dataset_size", "batch_size", "world_size", "drop_last", "expected"),
    [
        (1000, 10, 1, False, 100),  # divides evenly
        (1001, 10, 1, False, 101),  # one leftover sample is one more (short) batch
        (1001, 10, 1, True, 100),  # DROP_LAST drops the short batch
        (1000, 32, 4, False, 8),  # 1000 / 128 = 7.8 -> ceil
        (1000, 32, 4, True, 7),  # 1000 / 128 = 7.8 -> floor with DROP_LAST
        (1024, 32, 4, True, 8),  # exact multiple: DROP_LAST drops nothing
        (1438, 32, 1, False, 45),  # the digits training split, one process
        (1438, 32, 2, False, 23),  # the digits training split sharded over 2 processes
        (100, 64, 2, False, 1),  # fewer samples than one global batch: one padded batch each
        (100, 64, 2, True, 0),  # ... and none at all with DROP_LAST
        (1, 1, 8, False, 1),  # fewer samples than processes
        (0, 16, 1, False, 0),  # empty dataset
    ],
)
def test_batches_per_process(
    dataset_size: int, batch_size: int, world_size: int, drop_last: bool, expected: int
) -> None:
    assert batches_per_process(dataset_size, batch_size, world_size, drop_last) == expected


@pytest.mark.parametrize(
    ("batches", "accumulation", "expected"),
    [
        (1001, 4, 251),  # EXAMPLES: 250 full windows + 1 leftover batch that still syncs
        (1000, 4, 250),  # divides evenly
        (1001, 1, 1001),  # no accumulation: one step per batch
        (1001, 0, 1001),  # accumulation 0 is read as 1
        (3, 4, 1),  # a single partial window is one step
        (4, 4, 1),  # exactly one full window
        (5, 4, 2),  # one full window + one leftover batch
        (1, 100, 1),  # accumulation much larger than the epoch
    ],
)
def test_optimizer_steps_per_epoch(batches: int, accumulation: int, expected: int) -> None:
    assert optimizer_steps_per_epoch(batches, accumulation) == expected


@pytest.mark.parametrize(
    ("batches", "accumulation", "epochs", "world_size", "ope", "total"),
    [
        (1001, 4, 10, 1, 251, 2510),  # EXAMPLES: 251 steps per epoch, T = 2510
        (1001, 0, 10, 1, 1001, 10010),  # accumulation 0 is read as 1
        (1001, 4, 10, 2, 251, 2510),  # batches are already per process: world size does not divide again
        (100, 1, 10, 1, 100, 1000),  # the T = 1000 of the LR examples
        (7, 3, 3, 4, 3, 9),  # 2 full windows + 1 leftover per epoch
        (1, 8, 5, 1, 1, 5),  # one (partial) window per epoch
    ],
)
def test_total_steps_in_plan(
    batches: int, accumulation: int, epochs: int, world_size: int, ope: int, total: int
) -> None:
    plan = resolve_plan(make_config(accumulation=accumulation, epochs=epochs), batches, world_size)
    assert plan.accumulation == max(1, accumulation)
    assert plan.optimizer_steps_per_epoch == ope
    assert plan.total_steps == total
    assert plan.boundary_step(epochs) == total


@pytest.mark.parametrize(
    ("batch_size", "world_size", "accumulation", "reference_bs", "effective", "scale"),
    [
        (96, 4, 4, 512, 1536, 3.0),  # EXAMPLES: effective batch 1536, LR scale 3.0
        (96, 4, 4, None, 1536, 1.0),  # REFERENCE_BS null disables scaling
        (256, 2, 2, 512, 1024, 2.0),  # scale 2
        (32, 1, 1, 512, 32, 0.0625),  # small batch scales down
        (64, 2, 0, 512, 128, 0.25),  # accumulation 0 counts as 1 in the effective batch
        (100, 1, 1, 100, 100, 1.0),  # effective batch == REFERENCE_BS
    ],
)
def test_effective_batch_and_lr_scale(
    batch_size: int,
    world_size: int,
    accumulation: int,
    reference_bs: int | None,
    effective: int,
    scale: float,
) -> None:
    config = make_config(
        batch_size=batch_size,
        accumulation=accumulation,
        epochs=10,
        lr={"BASE_LR": 0.001, "REFERENCE_BS": reference_bs},
    )
    plan = resolve_plan(config, 50, world_size)
    assert plan.effective_batch_size == effective
    assert plan.lr_scale == pytest.approx(scale, rel=1e-12)
    assert plan.lr_curves[0].base_lr == pytest.approx(0.001 * scale, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# docs/semantics.md §2: resolution of fractions and epochs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fraction", "total", "expected"),
    [
        (0.05, 1000, 50),  # EXAMPLES
        (0.0004, 1000, 1),  # max(1, round(0.4)): a positive fraction is at least one step
        (0.0005, 1000, 1),  # 0.5 rounds half up
        (0.0015, 1000, 2),  # 1.5 rounds half up
        (0.0025, 1000, 3),  # 2.5 rounds half up (round-half-even would give 2)
        (0.15, 1010, 152),  # 151.5 as written rounds half up to 152
        (0.009, 1500, 14),  # 13.5 as written; the binary product 0.009 * 1500 is 13.4999... -> 13
        (0.043, 2500, 108),  # 107.5 as written; the binary product is 107.4999... -> 107
        (1.0, 1000, 1000),  # the whole run
        (1.0, 1, 1),  # the whole of a one-step run
        (1e-9, 1, 1),  # tiny positive fraction of a tiny run
        (0.5, 10**7, 5 * 10**6),  # large T
        (0, 1000, 0),  # 0 means disabled, not "1 step" as in linnaeus
        (0.0, 1, 0),  # disabled also when T is tiny
    ],
)
def test_steps_from_fraction(fraction: float, total: int, expected: int) -> None:
    assert steps_from_fraction(fraction, total) == expected


@pytest.mark.parametrize(
    ("epochs", "steps_per_epoch", "expected"),
    [
        (2.5, 100, 250),  # EXAMPLES: WARMUP_EPOCHS 2.5 with 100 steps per epoch
        (1, 251, 251),  # whole epochs
        (0.5, 5, 3),  # 2.5 rounds half up
        (0.1, 5, 1),  # 0.5 rounds half up
        (0.05, 5, 0),  # 0.25 rounds to 0 (no max(1, ...) for epochs)
        (0, 100, 0),  # zero epochs
        (3.3, 10, 33),  # 3.3 * 10 as written (binary: 32.99999...)
    ],
)
def test_steps_from_epochs(epochs: float, steps_per_epoch: int, expected: int) -> None:
    assert steps_from_epochs(epochs, steps_per_epoch) == expected


@pytest.mark.parametrize(
    ("lr_keys", "batches", "accumulation", "expected_warmup"),
    [
        ({"WARMUP_FRACTION": 0.05}, 100, 1, 50),  # EXAMPLES: 0.05 of T = 1000
        ({"WARMUP_FRACTION": 0.0004}, 100, 1, 1),  # EXAMPLES: max(1, round(0.4))
        ({"WARMUP_FRACTION": 0}, 100, 1, 0),  # EXAMPLES: fraction 0 disables warmup
        ({"WARMUP_EPOCHS": 2.5}, 100, 1, 250),  # EXAMPLES: 2.5 epochs of 100 steps
        ({"WARMUP_EPOCHS": 2.5}, 400, 4, 250),  # epochs count optimizer steps, not batches
        ({"WARMUP_STEPS": 30}, 100, 1, 30),  # steps are taken as given
        ({"WARMUP_FRACTION": 0.15}, 101, 1, 152),  # 0.15 of T = 1010 is 151.5 as written -> half up
        ({}, 100, 1, 0),  # unset means no warmup (not linnaeus' WARMUP_EPOCHS: 5 default)
    ],
)
def test_warmup_resolution_in_plan(
    lr_keys: dict[str, Any], batches: int, accumulation: int, expected_warmup: int
) -> None:
    config = make_config(accumulation=accumulation, epochs=10, lr={"REFERENCE_BS": None, **lr_keys})
    plan = resolve_plan(config, batches, 1)
    assert plan.warmup_steps == expected_warmup
    assert all(c.warmup_steps == expected_warmup for c in plan.lr_curves)


def test_zero_warmup_fraction_starts_at_base_lr() -> None:
    # Disabled warmup: step 0 already runs at the base LR (linnaeus made it a 1-step warmup).
    config = make_config(
        epochs=10, lr={"REFERENCE_BS": None, "BASE_LR": 0.5, "WARMUP_LR": 0.01, "WARMUP_FRACTION": 0}
    )
    plan = resolve_plan(config, 100, 1)
    assert plan.lr(0) == 0.5


@pytest.mark.parametrize(
    ("schedule", "expected_validation", "expected_checkpoint"),
    [
        ({"VALIDATION": {"INTERVAL_FRACTION": 0}}, None, None),  # fraction 0 disables the interval
        ({"VALIDATION": {"INTERVAL_FRACTION": 0.1}}, Interval("steps", 100), None),  # 0.1 of T = 1000
        ({"VALIDATION": {"INTERVAL_FRACTION": 0.0004}}, Interval("steps", 1), None),  # at least one step
        ({"CHECKPOINT": {"INTERVAL_FRACTION": 0}}, None, None),  # checkpoint interval disabled too
        ({"CHECKPOINT": {"INTERVAL_FRACTION": 0.25}}, None, Interval("steps", 250)),  # 0.25 of T = 1000
        ({"VALIDATION": {"INTERVAL_EPOCHS": 2}}, Interval("epochs", 2), None),  # epochs stay epochs
        ({"VALIDATION": {"INTERVAL_STEPS": 350}}, Interval("steps", 350), None),  # steps stay steps
    ],
)
def test_interval_resolution(
    schedule: dict[str, Any], expected_validation: Interval | None, expected_checkpoint: Interval | None
) -> None:
    plan = resolve_plan(make_config(epochs=10, schedule=schedule), 100, 1)
    assert plan.total_steps == 1000
    assert plan.validation == expected_validation
    assert plan.checkpoint == expected_checkpoint


@pytest.mark.parametrize(
    ("lr_keys", "named_keys"),
    [
        ({"WARMUP_FRACTION": 1.5}, ["LR_SCHEDULER.WARMUP_FRACTION"]),  # EXAMPLES: fraction above 1
        ({"WARMUP_FRACTION": -0.1}, ["LR_SCHEDULER.WARMUP_FRACTION"]),  # negative fraction
        (
            {"WARMUP_STEPS": 30, "WARMUP_FRACTION": 0.1},
            ["LR_SCHEDULER.WARMUP_STEPS", "LR_SCHEDULER.WARMUP_FRACTION"],
        ),  # EXAMPLES: two units for one parameter name both keys
        (
            {"WARMUP_EPOCHS": 1, "WARMUP_FRACTION": 0.1},
            ["LR_SCHEDULER.WARMUP_EPOCHS", "LR_SCHEDULER.WARMUP_FRACTION"],
        ),  # epochs and fraction together
    ],
)
def test_resolution_config_errors_name_the_keys(lr_keys: dict[str, Any], named_keys: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        make_config(epochs=10, lr=lr_keys)
    text = str(info.value)
    for key in named_keys:
        assert key in text


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------

fractions_01 = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
totals = st.integers(min_value=1, max_value=10**9)


@settings(max_examples=300, deadline=None)
@given(a=fractions_01, b=fractions_01, total=totals)
def test_fraction_resolution_is_monotone(a: float, b: float, total: int) -> None:
    lo, hi = sorted((a, b))
    assert steps_from_fraction(lo, total) <= steps_from_fraction(hi, total)


@settings(max_examples=300, deadline=None)
@given(
    fraction=st.floats(min_value=0.0, max_value=1.0, exclude_min=True, allow_nan=False),
    total=totals,
)
def test_positive_fraction_resolves_within_run(fraction: float, total: int) -> None:
    steps = steps_from_fraction(fraction, total)
    assert 1 <= steps <= total
    # Independent oracle: exact rational arithmetic on the decimal as written, half up.
    exact = Fraction(str(fraction)) * total
    assert steps == max(1, int(exact + Fraction(1, 2)))


@settings(max_examples=150, deadline=None)
@given(
    dataset_size=st.integers(min_value=1, max_value=10**7),
    batch_size=st.integers(min_value=1, max_value=512),
    world_size=st.integers(min_value=1, max_value=16),
    accumulation=st.integers(min_value=0, max_value=16),
    epochs=st.integers(min_value=1, max_value=50),
)
def test_total_steps_property(
    dataset_size: int, batch_size: int, world_size: int, accumulation: int, epochs: int
) -> None:
    config = make_config(batch_size=batch_size, accumulation=accumulation, epochs=epochs)
    # Exactly as the CLI (linnaeus_accel.cli.plan_for) does it.
    batches = batches_per_process(dataset_size, config.DATA.BATCH_SIZE, world_size, config.DATA.DROP_LAST)
    plan = resolve_plan(config, batches, world_size, dataset_size)
    accum = max(1, accumulation)
    expected = epochs * ceil_div(ceil_div(dataset_size, batch_size * world_size), accum)
    assert plan.total_steps == expected
    assert plan.effective_batch_size == batch_size * world_size * accum


@settings(max_examples=100, deadline=None)
@given(
    dataset_size=st.integers(min_value=1, max_value=10**6),
    batch_size=st.integers(min_value=1, max_value=512),
    world_size=st.integers(min_value=1, max_value=16),
    accumulation=st.integers(min_value=0, max_value=16),
    epochs=st.integers(min_value=1, max_value=50),
)
def test_total_steps_property_drop_last(
    dataset_size: int, batch_size: int, world_size: int, accumulation: int, epochs: int
) -> None:
    config = make_config(batch_size=batch_size, accumulation=accumulation, epochs=epochs, drop_last=True)
    batches = batches_per_process(dataset_size, config.DATA.BATCH_SIZE, world_size, config.DATA.DROP_LAST)
    full_batches = dataset_size // (batch_size * world_size)
    assert batches == full_batches
    if full_batches == 0:
        # No batch per process: a config error naming the batch size, never a 0-step plan.
        with pytest.raises(ConfigError, match=r"DATA\.BATCH_SIZE"):
            resolve_plan(config, batches, world_size, dataset_size)
        return
    plan = resolve_plan(config, batches, world_size, dataset_size)
    assert plan.total_steps == epochs * ceil_div(full_batches, max(1, accumulation))


def test_ten_million_step_plan_resolves_fast() -> None:
    # T = 10**7 with every timed parameter given as a fraction: resolution is O(1) in T.
    config = make_config(
        batch_size=1,
        epochs=10,
        lr={
            "NAME": "wsd",
            "WARMUP_FRACTION": 0.05,
            "STABLE_DURATION_FRACTION": 0.8,
            "DECAY_DURATION_FRACTION": 0.2,
        },
        schedule={
            "VALIDATION": {"INTERVAL_FRACTION": 0.1, "MASK_META_INTERVAL_FRACTION": 0.2},
            "CHECKPOINT": {"INTERVAL_FRACTION": 0.25},
            "META_MASKING": {
                "ENABLED": True,
                "END_FRACTION": 0.3,
                "PARTIAL": {
                    "ENABLED": True,
                    "START_FRACTION": 0.1,
                    "END_FRACTION": 0.9,
                    "PROB_END_FRACTION": 0.5,
                    "START_PROB": 0.01,
                    "END_PROB": 0.7,
                    "WHITELIST": [["ROWS"], ["COLS"]],
                },
            },
            "MIXUP": {"GROUP_LEVELS": ["digit"], "PROB": {"ENABLED": True, "END_FRACTION": 0.4}},
            "METRICS": {"STEP_FRACTION": 0.0001},
        },
    )
    start = time.process_time()  # this process's CPU: parallel test workers do not change it
    plan = resolve_plan(config, 1_000_000, 1)
    elapsed = time.process_time() - start
    assert elapsed < 0.5
    assert plan.total_steps == 10**7
    assert plan.warmup_steps == 500_000
    assert plan.validation == Interval("steps", 1_000_000)
    assert plan.checkpoint == Interval("steps", 2_500_000)
    assert plan.meta_mask.end_step == 3_000_000
    assert plan.mixup.end_step == 4_000_000
    assert (plan.partial_mask.start_step, plan.partial_mask.end_step) == (1_000_000, 9_000_000)
    assert plan.metrics_interval == 1000
