"""Learning-rate curves as pure functions of the global step (docs/semantics.md §3), via resolve_plan."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from linnaeus_accel.config import ConfigError, validate_config
from linnaeus_accel.schedule import ResolvedPlan, resolve_plan
from linnaeus_accel.schedule.report.settings import report_settings
from linnaeus_accel.schedule.report.summary import describe_lr, summary_text

KINDS = ("cosine", "linear", "step", "wsd")
WSD_LINEAR = {"STABLE_DURATION_FRACTION": 0.8, "DECAY_DURATION_FRACTION": 0.2, "DECAY_TYPE": "linear"}
WSD_COSINE = {"STABLE_DURATION_FRACTION": 0.8, "DECAY_DURATION_FRACTION": 0.2, "DECAY_TYPE": "cosine"}
STEP_30 = {"DECAY_STEPS": 30, "DECAY_RATE": 0.1}
# Extra keys that make each kind a complete, non-trivial schedule.
KIND_KEYS: dict[str, dict[str, Any]] = {"cosine": {}, "linear": {}, "step": STEP_30, "wsd": WSD_LINEAR}


def example_config(kind: str, groups: list[dict[str, Any]] | None = None, **lr: Any) -> Any:
    """EXAMPLES.md's setting: B = 1.0 (no scaling), WARMUP_LR 0, MIN_LR 0.1, W = 20; with
    10 batches per epoch x 10 epochs, T = 100."""
    section = {
        "NAME": kind,
        "BASE_LR": 1.0,
        "REFERENCE_BS": None,
        "WARMUP_LR": 0.0,
        "MIN_LR": 0.1,
        "WARMUP_STEPS": 20,
        **lr,
    }
    if groups is not None:
        section["PARAMETER_GROUPS"] = groups
    return validate_config({"TRAIN": {"EPOCHS": 10}, "LR_SCHEDULER": section})


def example_plan(kind: str, groups: list[dict[str, Any]] | None = None, **lr: Any) -> ResolvedPlan:
    plan = resolve_plan(example_config(kind, groups, **lr), 10, 1)
    assert plan.total_steps == 100
    return plan


# ---------------------------------------------------------------------------------------------
# EXAMPLES.md tables
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "keys", "k", "expected"),
    [
        ("wsd", WSD_LINEAR, 0, 0.0),  # warmup starts at WARMUP_LR
        ("wsd", WSD_LINEAR, 10, 0.5),  # halfway through warmup
        ("wsd", WSD_LINEAR, 19, 0.95),  # last warmup step
        ("wsd", WSD_LINEAR, 20, 1.0),  # first stable step: B
        ("wsd", WSD_LINEAR, 83, 1.0),  # last stable step (S = floor(80 * 0.8) = 64)
        ("wsd", WSD_LINEAR, 84, 0.94375),  # first decay step: q = 1/16
        ("wsd", WSD_LINEAR, 91, 0.55),  # q = 8/16
        ("wsd", WSD_LINEAR, 99, 0.1),  # last step reaches MIN_LR exactly
        ("wsd", WSD_COSINE, 84, 0.1 + 0.45 * (1 + math.cos(math.pi / 16))),  # EXAMPLES: 0.991353
        ("wsd", WSD_COSINE, 91, 0.55),  # cosine midpoint
        ("wsd", WSD_COSINE, 99, 0.1),  # MIN_LR
        ("linear", {}, 20, 1.0),  # end of warmup is B
        ("linear", {}, 60, 0.55),  # halfway through P = 80
        ("linear", {}, 99, 1.0 - 0.9 * 79 / 80),  # last step, one step short of MIN_LR
        ("cosine", {}, 0, 0.0),  # warmup start
        ("cosine", {}, 10, 0.5),  # warmup midpoint
        ("cosine", {}, 20, 1.0),  # warmup reaches B exactly at W
        ("cosine", {}, 60, 0.55),  # cos(pi / 2): halfway between B and MIN_LR
        ("cosine", {}, 99, 0.1 + 0.45 * (1 + math.cos(math.pi * 79 / 80))),  # last step
        ("step", {**STEP_30, "MIN_LR": 0.0}, 19, 0.95),  # warmup as for every kind
        ("step", {**STEP_30, "MIN_LR": 0.0}, 20, 1.0),  # p = 0
        ("step", {**STEP_30, "MIN_LR": 0.0}, 49, 1.0),  # p = 29: still the first period
        ("step", {**STEP_30, "MIN_LR": 0.0}, 50, 0.1),  # p = 30: one decay
        ("step", {**STEP_30, "MIN_LR": 0.0}, 80, 0.01),  # EXAMPLES: p = 60, two decays (MIN_LR 0 here)
        ("step", {**STEP_30, "MIN_LR": 0.0}, 99, 0.01),  # p = 79: still two decays
        # MIN_LR is the floor of the step schedule too (keeps lr within [MIN_LR, B]):
        ("step", STEP_30, 50, 0.1),  # 1.0 * 0.1 == MIN_LR 0.1
        ("step", STEP_30, 80, 0.1),  # 0.01 floored at MIN_LR 0.1
        ("step", {**STEP_30, "MIN_LR": 0.05}, 80, 0.05),  # 0.01 floored at MIN_LR 0.05
        ("step", {**STEP_30, "MIN_LR": 0.005}, 80, 0.01),  # floor below 0.01: not applied
        ("step", {"DECAY_FRACTION": 0.3, "DECAY_RATE": 0.5, "MIN_LR": 0.0}, 50, 0.5),  # DECAY 0.3 * 100 = 30
    ],
)
def test_lr_examples(kind: str, keys: dict[str, Any], k: int, expected: float) -> None:
    plan = example_plan(kind, **keys)
    assert plan.lr(k) == pytest.approx(expected, abs=1e-12)
    assert plan.lr_curves[0](k) == plan.lr(k)


def test_wsd_cosine_example_value_as_printed() -> None:
    plan = example_plan("wsd", **WSD_COSINE)
    assert plan.lr(84) == pytest.approx(0.991353, abs=1e-6)


@pytest.mark.parametrize("keys", [WSD_LINEAR, WSD_COSINE])
def test_wsd_stable_phase_is_exactly_base_lr(keys: dict[str, Any]) -> None:
    # The seed's example: stable 20..83 (linnaeus shifted it to 20..63), then decay 84..99.
    plan = example_plan("wsd", **keys)
    assert [plan.lr(k) for k in range(20, 84)] == [1.0] * 64
    assert plan.lr(84) < 1.0
    decay = [plan.lr(k) for k in range(84, 100)]
    assert all(a > b for a, b in itertools.pairwise(decay))


@pytest.mark.parametrize(
    ("base_lr", "min_lr"),
    [
        (1.0, 0.1),  # EXAMPLES: lr(99) = MIN_LR
        (0.002, 1e-5),  # the default config's scaled peak and MIN_LR
        (0.1, 0.01),  # round numbers
    ],
)
@pytest.mark.parametrize("decay_type", ["linear", "cosine"])
def test_wsd_decay_ends_exactly_at_min_lr(decay_type: str, base_lr: float, min_lr: float) -> None:
    # docs/semantics.md §3: the last decay step (q = 1) is MIN_LR, exactly: not an ulp below the floor
    # (which would also trip TRAIN.EARLY_STOP.MIN_LR set to the same value).
    plan = example_plan(
        "wsd", **{**WSD_LINEAR, "DECAY_TYPE": decay_type, "BASE_LR": base_lr, "MIN_LR": min_lr}
    )
    assert plan.lr(99) == min_lr
    assert plan.lr(99) >= plan.lr_curves[0].min_lr


@pytest.mark.parametrize("kind", KINDS)
def test_warmup_has_no_lag(kind: str) -> None:
    # Optimizer step 0 uses lr(0) = WARMUP_LR; step k of warmup is k / W of the way to B.
    plan = example_plan(kind, **{**KIND_KEYS[kind], "WARMUP_LR": 0.2})
    assert plan.lr(0) == 0.2
    assert plan.lr(1) == pytest.approx(0.2 + 0.8 / 20, abs=1e-12)
    assert plan.lr(19) == pytest.approx(0.2 + 0.8 * 19 / 20, abs=1e-12)
    assert plan.lr(20) == 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_no_warmup_starts_at_base_lr(kind: str) -> None:
    plan = example_plan(kind, **{**KIND_KEYS[kind], "WARMUP_STEPS": 0, "WARMUP_LR": 0.2})
    assert plan.warmup_steps == 0
    assert plan.lr(0) == 1.0


# ---------------------------------------------------------------------------------------------
# Summary line
# ---------------------------------------------------------------------------------------------

SUMMARY_PARTS = (
    "warmup 50 steps (5.0%)",
    "stable 760 steps (80.0% of post-warmup) from step 50 to 809",
    "decay 190 steps (20.0%) from step 810 to 999",
)


def test_wsd_phases_summary() -> None:
    # T = 1000 (100 steps per epoch x 10 epochs), WARMUP_FRACTION 0.05, wsd 0.8 / 0.2.
    config = validate_config(
        {
            "TRAIN": {"EPOCHS": 10},
            "LR_SCHEDULER": {
                "NAME": "wsd",
                "WARMUP_FRACTION": 0.05,
                "STABLE_DURATION_FRACTION": 0.8,
                "DECAY_DURATION_FRACTION": 0.2,
            },
        }
    )
    plan = resolve_plan(config, 100, 1)
    assert plan.total_steps == 1000
    line = describe_lr(plan.lr_curves[0])
    text = summary_text(report_settings(config), plan)
    for part in SUMMARY_PARTS:
        assert part in line
        assert part in text
    assert plan.lr_curves[0].phases() == {"warmup": (0, 49), "stable": (50, 809), "decay": (810, 999)}


# ---------------------------------------------------------------------------------------------
# LR scaling before the schedule
# ---------------------------------------------------------------------------------------------


def scaled_config(kind: str, base_lr: float, reference_bs: int | None) -> Any:
    # Effective batch 256 x 2 processes x accumulation 2 = 1024; 10 batches -> 5 steps x 20 epochs.
    return validate_config(
        {
            "DATA": {"BATCH_SIZE": 256},
            "TRAIN": {"EPOCHS": 20, "ACCUMULATION_STEPS": 2},
            "LR_SCHEDULER": {
                "NAME": kind,
                **KIND_KEYS[kind],
                "BASE_LR": base_lr,
                "REFERENCE_BS": reference_bs,
                "WARMUP_LR": 0.0005,
                "MIN_LR": 0.001,
                "WARMUP_STEPS": 20,
            },
        }
    )


@pytest.mark.parametrize("kind", KINDS)
def test_lr_scaling_applies_before_the_schedule(kind: str) -> None:
    plan = resolve_plan(scaled_config(kind, 0.01, 512), 10, 2)
    assert plan.total_steps == 100
    assert plan.effective_batch_size == 1024
    assert plan.lr_scale == 2.0
    assert plan.lr(20) == pytest.approx(0.02, rel=1e-12)  # end of warmup: 2 x BASE_LR
    assert plan.lr(0) == 0.0005  # WARMUP_LR is absolute, not scaled
    # Every later step equals the curve built from the pre-scaled BASE_LR (linnaeus lost the
    # scale after step 0).
    unscaled = resolve_plan(scaled_config(kind, 0.02, None), 10, 2)
    assert unscaled.lr_scale == 1.0
    for k in range(100):
        assert plan.lr(k) == pytest.approx(unscaled.lr(k), rel=1e-12, abs=1e-15)
    assert plan.lr_curves[0].min_lr == 0.001  # MIN_LR is absolute, not scaled


@pytest.mark.parametrize(
    ("kind", "k", "expected"),
    [
        ("wsd", 50, 0.02),  # stable phase stays at the scaled B
        ("wsd", 99, 0.001),  # ends at the unscaled MIN_LR
        ("linear", 60, 0.02 - 0.019 * 0.5),  # halfway between scaled B and MIN_LR
        ("cosine", 60, 0.001 + 0.5 * 0.019),  # cos(pi / 2)
        ("step", 50, 0.002),  # 0.02 * 0.1 after one period
        ("step", 80, 0.001),  # 0.0002 floored at the unscaled MIN_LR
    ],
)
def test_scaled_lr_at_later_steps(kind: str, k: int, expected: float) -> None:
    plan = resolve_plan(scaled_config(kind, 0.01, 512), 10, 2)
    assert plan.lr(k) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("lr_keys", "key"),
    [
        ({"MIN_LR": 5e-4}, "LR_SCHEDULER.MIN_LR"),  # above the scaled B = 1e-3 * 64 / 512 = 1.25e-4
        ({"WARMUP_LR": 5e-4}, "LR_SCHEDULER.WARMUP_LR"),  # warmup would go down
    ],
)
def test_lr_above_scaled_base_is_a_config_error(lr_keys: dict[str, Any], key: str) -> None:
    # Both are below BASE_LR but above the scaled peak: checked after scaling.
    config = validate_config(
        {"DATA": {"BATCH_SIZE": 64}, "LR_SCHEDULER": {"BASE_LR": 1e-3, "REFERENCE_BS": 512, **lr_keys}}
    )
    with pytest.raises(ConfigError) as info:
        resolve_plan(config, 10, 1)
    assert [k for k, _ in info.value.problems] == [key]


def test_lr_equal_to_scaled_base_is_allowed() -> None:
    config = validate_config(
        {
            "DATA": {"BATCH_SIZE": 64},
            "LR_SCHEDULER": {"BASE_LR": 1e-3, "REFERENCE_BS": 512, "MIN_LR": 1.25e-4, "WARMUP_LR": 1.25e-4},
        }
    )
    plan = resolve_plan(config, 10, 1)
    assert plan.lr_curves[0].base_lr == 1.25e-4


# ---------------------------------------------------------------------------------------------
# Parameter groups
# ---------------------------------------------------------------------------------------------

HEAD = {"LABEL": "head", "MATCH": ["head.*"], "LR_MULTIPLIER": 0.5}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reference_bs", [None, 512])
def test_group_without_overrides_is_default_times_multiplier(kind: str, reference_bs: int | None) -> None:
    plan = example_plan(
        kind,
        groups=[HEAD, {"LABEL": "emb", "MATCH": ["emb.*", "pos.*"], "LR_MULTIPLIER": 3.0}],
        **{**KIND_KEYS[kind], "WARMUP_LR": 0.05, "REFERENCE_BS": reference_bs},
    )
    assert [c.label for c in plan.lr_curves] == ["default", "head", "emb"]
    assert plan.group_patterns == (("head.*",), ("emb.*", "pos.*"))
    assert all(c.kind == kind for c in plan.lr_curves)
    for k in range(plan.total_steps):
        assert plan.lr(k, 1) == pytest.approx(0.5 * plan.lr(k, 0), rel=1e-12, abs=1e-15)
        assert plan.lr(k, 2) == pytest.approx(3.0 * plan.lr(k, 0), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(
    ("kind", "overrides", "k", "expected"),
    [
        ("wsd", {"MIN_LR": 0.02}, 99, 0.02),  # MIN_LR replaces the scaled 0.1 x 0.5 = 0.05
        ("wsd", {"WARMUP_LR": 0.01}, 0, 0.01),  # WARMUP_LR replaces the scaled 0 x 0.5
        ("wsd", {"WARMUP_STEPS": 10}, 10, 0.5),  # own warmup ends at step 10 at B x 0.5
        ("wsd", {"WARMUP_STEPS": 10}, 5, 0.25),  # halfway through its own warmup
        ("wsd", {"WARMUP_STEPS": 0}, 0, 0.5),  # an explicit 0 also replaces the global 20
        ("wsd", {"WARMUP_FRACTION": 0.3}, 15, 0.25),  # own warmup of 0.3 x 100 = 30 steps
        ("cosine", {"NAME": "linear"}, 40, 0.5 - 0.45 * 20 / 80),  # own schedule shape
        ("linear", {"NAME": "wsd"}, 60, 0.5),  # wsd (global 0.8 / 0.1 fractions) holds B x 0.5
        ("step", {"DECAY_STEPS": 10}, 30, 0.05),  # own decay period: p = 10 is one decay
        ("step", {"DECAY_RATE": 0.5}, 50, 0.25),  # own rate: 0.5 x 0.5
        ("wsd", {"STABLE_DURATION_FRACTION": 0.5}, 60, 0.5 - 0.45 * 1 / 16),  # own S = 40 -> decays at 60
        ("wsd", {"DECAY_TYPE": "cosine"}, 84, 0.05 + 0.225 * (1 + math.cos(math.pi / 16))),  # own shape
    ],
)
def test_group_override_replaces_global(
    kind: str, overrides: dict[str, Any], k: int, expected: float
) -> None:
    keys = KIND_KEYS[kind] if kind != "wsd" else WSD_LINEAR
    plan = example_plan(kind, groups=[{**HEAD, **overrides}], **keys)
    assert plan.lr(k, 1) == pytest.approx(expected, abs=1e-12)
    # ... and the default group is untouched by the group's overrides.
    assert plan.lr_curves[0] == example_plan(kind, **keys).lr_curves[0]


def test_group_override_does_not_leak_to_other_groups() -> None:
    plan = example_plan(
        "wsd",
        groups=[{**HEAD, "MIN_LR": 0.02, "WARMUP_STEPS": 10}, {"LABEL": "emb", "MATCH": ["emb.*"]}],
        **WSD_LINEAR,
    )
    assert plan.lr_curves[2].min_lr == 0.1
    assert plan.lr_curves[2].warmup_steps == 20
    assert plan.lr(99, 2) == pytest.approx(0.1, abs=1e-12)


def test_group_min_lr_above_its_peak_is_a_config_error() -> None:
    config = example_config("cosine", groups=[{**HEAD, "MIN_LR": 0.6}])  # group peak is 0.5
    with pytest.raises(ConfigError) as info:
        resolve_plan(config, 10, 1)
    assert [k for k, _ in info.value.problems] == ["LR_SCHEDULER.PARAMETER_GROUPS.0.MIN_LR"]


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------


@st.composite
def lr_setups(draw: st.DrawFn, max_ratio: float = 1.0) -> dict[str, Any]:
    kind = draw(st.sampled_from(KINDS))
    batches = draw(st.integers(min_value=1, max_value=40))
    epochs = draw(st.integers(min_value=1, max_value=5))
    total = batches * epochs  # accumulation 1
    batch_size = draw(st.integers(min_value=1, max_value=256))
    world_size = draw(st.integers(min_value=1, max_value=4))
    reference_bs = draw(st.one_of(st.none(), st.integers(min_value=1, max_value=2048)))
    base_lr = draw(st.floats(min_value=1e-6, max_value=10.0))
    scale = batch_size * world_size / reference_bs if reference_bs else 1.0
    peak = base_lr * scale * 1.0  # the same float operations as resolve_plan
    ratios = st.floats(min_value=0.0, max_value=max_ratio)
    min_lr, warmup_lr = draw(ratios) * peak, draw(ratios) * peak
    warmup = draw(
        st.one_of(
            st.just({}),
            st.integers(min_value=0, max_value=total + 5).map(lambda w: {"WARMUP_STEPS": w}),
            st.floats(min_value=0.0, max_value=1.0).map(lambda f: {"WARMUP_FRACTION": f}),
            st.floats(min_value=0.0, max_value=3.0).map(lambda e: {"WARMUP_EPOCHS": e}),
        )
    )
    extra: dict[str, Any] = {}
    if kind == "wsd":
        extra = {
            "STABLE_DURATION_FRACTION": draw(st.floats(min_value=0.0, max_value=1.0)),
            "DECAY_DURATION_FRACTION": draw(st.floats(min_value=0.0, max_value=1.0)),
            "DECAY_TYPE": draw(st.sampled_from(["cosine", "linear"])),
        }
    elif kind == "step":
        extra = {
            "DECAY_RATE": draw(st.floats(min_value=1e-3, max_value=1.0)),
            **draw(
                st.one_of(
                    st.integers(min_value=1, max_value=total + 5).map(lambda d: {"DECAY_STEPS": d}),
                    st.floats(min_value=0.0, max_value=1.0).map(lambda f: {"DECAY_FRACTION": f}),
                )
            ),
        }
    config = {
        "DATA": {"BATCH_SIZE": batch_size},
        "TRAIN": {"EPOCHS": epochs},
        "LR_SCHEDULER": {
            "NAME": kind,
            "BASE_LR": base_lr,
            "REFERENCE_BS": reference_bs,
            "MIN_LR": min_lr,
            "WARMUP_LR": warmup_lr,
            **warmup,
            **extra,
        },
    }
    return {"config": config, "batches": batches, "world_size": world_size, "peak": peak}


@settings(max_examples=150, deadline=None)
@given(setup=lr_setups())
def test_lr_stays_within_bounds(setup: dict[str, Any]) -> None:
    config = validate_config(setup["config"])
    plan = resolve_plan(config, setup["batches"], setup["world_size"])
    curve = plan.lr_curves[0]
    peak = setup["peak"]
    assert curve.base_lr == peak
    lrc = config.LR_SCHEDULER
    low = min(lrc.WARMUP_LR, lrc.MIN_LR)
    for k in range(plan.total_steps):
        lr = plan.lr(k)
        assert low - 1e-12 <= lr <= peak + 1e-12, (k, lr)
    w = plan.warmup_steps
    if w > 0:
        assert plan.lr(0) == lrc.WARMUP_LR  # no one-step lag
    if w < plan.total_steps and (lrc.NAME != "wsd" or curve.stable_steps > 0):
        # Warmup reaches B at step W (wsd: when it has a stable phase; otherwise it decays from W).
        assert plan.lr(w) == pytest.approx(peak, rel=1e-12)


@settings(max_examples=100, deadline=None)
@given(setup=lr_setups(max_ratio=2.0))
def test_min_or_warmup_lr_above_scaled_base_is_rejected(setup: dict[str, Any]) -> None:
    config = validate_config(setup["config"])
    lrc, peak = config.LR_SCHEDULER, setup["peak"]
    expected = {
        key
        for key, value in (("LR_SCHEDULER.MIN_LR", lrc.MIN_LR), ("LR_SCHEDULER.WARMUP_LR", lrc.WARMUP_LR))
        if value > peak
    }
    if not expected:
        resolve_plan(config, setup["batches"], setup["world_size"])
        return
    with pytest.raises(ConfigError) as info:
        resolve_plan(config, setup["batches"], setup["world_size"])
    assert {k for k, _ in info.value.problems} == expected


def test_step_schedule_lr_is_finite_or_config_is_rejected() -> None:
    # DECAY_RATE is only required to be > 0. A config that validates and resolves must give a
    # finite LR at every step of the run (not an OverflowError mid-training, nor inf).
    try:
        plan = example_plan("step", DECAY_STEPS=10, DECAY_RATE=1e200, MIN_LR=0.0)
    except ConfigError:
        return
    lrs = [plan.lr(k) for k in range(plan.total_steps)]
    assert all(math.isfinite(lr) for lr in lrs)


@pytest.mark.parametrize(
    ("lr", "key", "expected"),
    [
        # scaled (batch 32 at REFERENCE_BS 512): every factor of the peak is printed with its value
        (
            {"REFERENCE_BS": 512, "MIN_LR": 0.5},
            "LR_SCHEDULER.MIN_LR",
            "LR_SCHEDULER.MIN_LR: 0.5 is above the peak LR 0.0625 = BASE_LR 1 x batch-size scale 0.0625 "
            "(effective batch 32 / REFERENCE_BS 512): lower MIN_LR or raise the peak",
        ),
        # scaling off, a group's own MIN_LR above its peak: scale 1, said why, and the multiplier
        (
            {
                "REFERENCE_BS": None,
                "PARAMETER_GROUPS": [
                    {"LABEL": "head", "MATCH": ["head.*"], "LR_MULTIPLIER": 0.1, "MIN_LR": 0.5}
                ],
            },
            "LR_SCHEDULER.PARAMETER_GROUPS.0.MIN_LR",
            "LR_SCHEDULER.PARAMETER_GROUPS.0.MIN_LR: 0.5 is above the peak LR 0.1 = BASE_LR 1 x batch-size "
            "scale 1 (REFERENCE_BS null: no scaling) x LR_MULTIPLIER 0.1: lower MIN_LR or raise the peak",
        ),
    ],
)
def test_min_lr_above_the_peak_names_every_factor_of_the_peak(
    lr: dict[str, Any], key: str, expected: str
) -> None:
    config = validate_config(
        {"TRAIN": {"EPOCHS": 10}, "DATA": {"BATCH_SIZE": 32}, "LR_SCHEDULER": {"BASE_LR": 1.0, **lr}}
    )
    with pytest.raises(ConfigError) as info:
        resolve_plan(config, 10, 1)
    assert [k for k, _ in info.value.problems] == [key]
    assert expected in str(info.value)
