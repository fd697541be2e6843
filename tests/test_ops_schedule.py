"""OpsSchedule: epoch-boundary events (docs/semantics.md §5), probability ramps (docs/semantics.md §4), GradNorm (docs/design.md §5)
and logging intervals, answered from a resolved plan."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from linnaeus_accel.config import ConfigError, validate_config
from linnaeus_accel.schedule import OpsSchedule, resolve_plan

COMPONENTS = ["TEMPORAL", "SPATIAL", "ELEVATION"]


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def make_ops(
    overrides: dict[str, Any] | None = None, *, epochs: int = 10, batches: int = 100, world: int = 1
) -> OpsSchedule:
    data = _merge({"TRAIN": {"EPOCHS": epochs}}, overrides or {})
    return OpsSchedule(resolve_plan(validate_config(data), batches, world))


def validation(**keys: Any) -> dict[str, Any]:
    return {"SCHEDULE": {"VALIDATION": keys}}


def checkpoint(**keys: Any) -> dict[str, Any]:
    return {"SCHEDULE": {"CHECKPOINT": keys}}


# ---------------------------------------------------------------------------------------------
# Events at epoch boundaries (docs/semantics.md §5)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "epochs", "batches", "accum", "expected"),
    [
        ({"INTERVAL_EPOCHS": 1}, 5, 100, 1, [1, 2, 3, 4, 5]),  # every epoch
        ({"INTERVAL_EPOCHS": 4}, 10, 100, 1, [4, 8, 10]),  # e % 4 == 0, plus the final epoch
        ({"INTERVAL_EPOCHS": 5}, 10, 100, 1, [5, 10]),  # final epoch is also a multiple: listed once
        ({"INTERVAL_EPOCHS": 20}, 10, 100, 1, [10]),  # interval longer than the run: final only
        ({"INTERVAL_STEPS": 350}, 10, 100, 1, [4, 7, 10]),  # 400 crosses 350, 700 crosses 700, final
        ({"INTERVAL_STEPS": 100}, 5, 100, 1, [1, 2, 3, 4, 5]),  # boundaries land exactly on multiples
        ({"INTERVAL_STEPS": 30}, 4, 100, 1, [1, 2, 3, 4]),  # interval shorter than an epoch
        ({"INTERVAL_STEPS": 250}, 10, 100, 1, [3, 5, 8, 10]),  # 300 crosses 250, 500, 800 crosses 750
        ({"INTERVAL_STEPS": 50}, 5, 101, 4, [2, 4, 5]),  # ceil(101/4) = 26 steps/epoch: 52, 104, final
        ({"INTERVAL_FRACTION": 0.35}, 10, 100, 1, [4, 7, 10]),  # 0.35 * 1000 = 350 steps
        ({"INTERVAL_FRACTION": 0.4}, 10, 100, 1, [4, 8, 10]),  # 400 steps
        ({"INTERVAL_FRACTION": 0.1}, 5, 100, 1, [1, 2, 3, 4, 5]),  # 50 steps < one epoch
        ({"INTERVAL_FRACTION": 0.0004}, 3, 100, 1, [1, 2, 3]),  # max(1, round(0.12)) = 1 step
        ({"INTERVAL_FRACTION": 0.35}, 10, 101, 4, [4, 7, 10]),  # T = 260, 91 steps: 104, 182, final
        ({"INTERVAL_FRACTION": 0}, 10, 100, 1, []),  # fraction 0 disables validation, even the final one
        ({}, 10, 100, 1, []),  # no interval: validation disabled, not forced at the final epoch
    ],
)
def test_validation_epochs(
    keys: dict[str, Any], epochs: int, batches: int, accum: int, expected: list[int]
) -> None:
    ops = make_ops(
        _merge(validation(**keys), {"TRAIN": {"ACCUMULATION_STEPS": accum}}), epochs=epochs, batches=batches
    )
    assert ops.event_epochs()["validation"] == expected
    assert [e for e in range(1, epochs + 1) if ops.should_validate(e)] == expected


@pytest.mark.parametrize(
    ("keys", "epochs", "expected"),
    [
        ({"INTERVAL_EPOCHS": 1}, 5, [1, 2, 3, 4, 5]),  # every epoch
        ({"INTERVAL_EPOCHS": 4}, 10, [4, 8, 10]),  # multiples of 4, plus the final epoch
        ({"INTERVAL_STEPS": 350}, 10, [4, 7, 10]),  # first boundary at or after each multiple
        ({"INTERVAL_FRACTION": 0.35}, 10, [4, 7, 10]),  # the same as a fraction of T = 1000
        ({"INTERVAL_FRACTION": 0}, 10, [10]),  # disabled interval: still the final checkpoint
        ({}, 10, [10]),  # no interval: the final epoch is always checkpointed
        ({}, 1, [1]),  # a one-epoch run: its only epoch is final
    ],
)
def test_checkpoint_epochs(keys: dict[str, Any], epochs: int, expected: list[int]) -> None:
    ops = make_ops(checkpoint(**keys), epochs=epochs)
    assert ops.event_epochs()["checkpoint"] == expected
    assert [e for e in range(1, epochs + 1) if ops.should_save_checkpoint(e)] == expected


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({"MASK_META_INTERVAL_EPOCHS": 4}, [4, 8]),  # not forced at the final epoch 10
        ({"MASK_META_INTERVAL_EPOCHS": 5}, [5, 10]),  # 10 only because 10 % 5 == 0
        ({"MASK_META_INTERVAL_STEPS": 350}, [4, 7]),  # step interval, not forced at 10
        ({"MASK_META_INTERVAL_FRACTION": 0.35}, [4, 7]),  # fraction equivalent
        ({}, []),  # disabled
    ],
)
def test_mask_meta_validation_epochs(keys: dict[str, Any], expected: list[int]) -> None:
    ops = make_ops(validation(INTERVAL_EPOCHS=1, **keys))
    assert ops.event_epochs()["mask_meta_validation"] == expected
    assert [e for e in range(1, 11) if ops.should_validate_mask_meta(e)] == expected
    # mask-meta passes are not forced at the last boundary, even when it is flagged final
    assert ops.should_validate_mask_meta(10, final=True) == (10 in expected)


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({"INTERVAL_EPOCHS": 3}, [3, 6, 9]),  # not forced at the final epoch 10
        ({"INTERVAL_STEPS": 350}, [4, 7]),  # step interval
        ({"INTERVAL_FRACTION": 0.4}, [4, 8]),  # fraction equivalent (400 steps)
    ],
)
def test_partial_mask_meta_validation_epochs(keys: dict[str, Any], expected: list[int]) -> None:
    partial = {"ENABLED": True, "WHITELIST": [["TEMPORAL"], ["SPATIAL", "ELEVATION"]], **keys}
    ops = make_ops(validation(INTERVAL_EPOCHS=1, PARTIAL_MASK_META=partial))
    assert ops.event_epochs()["partial_mask_meta_validation"] == expected
    whitelist = (("TEMPORAL",), ("SPATIAL", "ELEVATION"))
    for epoch in range(1, 11):
        assert ops.partial_mask_combinations(epoch) == (whitelist if epoch in expected else ())


def test_partial_mask_meta_disabled_never_fires() -> None:
    partial = {"ENABLED": False, "INTERVAL_EPOCHS": 1, "WHITELIST": [["TEMPORAL"]]}
    ops = make_ops(validation(INTERVAL_EPOCHS=1, PARTIAL_MASK_META=partial))
    assert ops.event_epochs()["partial_mask_meta_validation"] == []
    assert all(ops.partial_mask_combinations(e) == () for e in range(1, 11))


@pytest.mark.parametrize(
    ("overrides", "validate", "save"),
    [
        (_merge(validation(INTERVAL_EPOCHS=4), checkpoint(INTERVAL_EPOCHS=4)), True, True),  # interval 4
        (checkpoint(INTERVAL_EPOCHS=4), False, True),  # validation disabled: checkpoint only
        (validation(INTERVAL_STEPS=350), True, True),  # step interval
        (validation(INTERVAL_FRACTION=0.35), True, True),  # fraction interval
    ],
)
def test_early_final_boundary_forces_checkpoint_and_validation(
    overrides: dict[str, Any], validate: bool, save: bool
) -> None:
    ops = make_ops(_merge(overrides, validation(MASK_META_INTERVAL_EPOCHS=4)))
    # epoch 3 fires nothing by itself
    assert not ops.should_validate(3)
    assert not ops.should_save_checkpoint(3)
    assert not ops.is_final_epoch(3)
    # an early stop there makes it the last boundary of the run
    assert ops.should_validate(3, final=True) is validate
    assert ops.should_save_checkpoint(3, final=True) is save
    assert not ops.should_validate_mask_meta(3, final=True)  # mask-meta is never forced


def test_is_final_epoch() -> None:
    ops = make_ops(epochs=7)
    assert [e for e in range(1, 9) if ops.is_final_epoch(e)] == [7, 8]


# ---------------------------------------------------------------------------------------------
# Exhaustive partial-mask validation at the final epoch
# ---------------------------------------------------------------------------------------------

EXHAUSTIVE = validation(
    INTERVAL_EPOCHS=1,
    PARTIAL_MASK_META={"ENABLED": True, "INTERVAL_EPOCHS": 2, "WHITELIST": [["TEMPORAL"], ["SPATIAL"]]},
    FINAL_EPOCH={"EXHAUSTIVE_PARTIAL_META_VALIDATION": True, "EXHAUSTIVE_META_COMPONENTS": COMPONENTS},
)
ALL_SUBSETS = (
    ("TEMPORAL",),
    ("SPATIAL",),
    ("ELEVATION",),
    ("TEMPORAL", "SPATIAL"),
    ("TEMPORAL", "ELEVATION"),
    ("SPATIAL", "ELEVATION"),
)


def test_exhaustive_validation_at_final_epoch() -> None:
    ops = make_ops(EXHAUSTIVE)
    assert ops.partial_mask_combinations(10) == ALL_SUBSETS
    assert ops.should_run_exhaustive_validation(10)
    assert not ops.should_validate_partial_mask_meta(10)  # no whitelist passes that epoch
    events = ops.event_epochs()
    assert events["exhaustive_validation"] == [10]
    assert events["partial_mask_meta_validation"] == [2, 4, 6, 8]


@pytest.mark.parametrize(
    ("epoch", "expected"),
    [
        (1, ()),  # 1 % 2 != 0: no partial passes
        (2, (("TEMPORAL",), ("SPATIAL",))),  # whitelist passes
        (8, (("TEMPORAL",), ("SPATIAL",))),  # whitelist passes
        (9, ()),  # nothing
        (10, ALL_SUBSETS),  # final: the 6 exhaustive passes replace the whitelist
    ],
)
def test_partial_combinations_by_epoch(epoch: int, expected: tuple[tuple[str, ...], ...]) -> None:
    ops = make_ops(EXHAUSTIVE)
    assert ops.partial_mask_combinations(epoch) == expected
    assert ops.should_run_exhaustive_validation(epoch) is (epoch == 10)


def test_exhaustive_with_two_components() -> None:
    ops = make_ops(
        validation(
            FINAL_EPOCH={
                "EXHAUSTIVE_PARTIAL_META_VALIDATION": True,
                "EXHAUSTIVE_META_COMPONENTS": ["SPATIAL", "TEMPORAL"],
            }
        )
    )
    assert ops.partial_mask_combinations(10) == (("SPATIAL",), ("TEMPORAL",))  # config order kept


def test_exhaustive_disabled_keeps_whitelist_at_final_epoch() -> None:
    overrides = _merge(EXHAUSTIVE, validation(FINAL_EPOCH={"EXHAUSTIVE_PARTIAL_META_VALIDATION": False}))
    ops = make_ops(overrides)
    assert not ops.should_run_exhaustive_validation(10)
    assert ops.partial_mask_combinations(10) == (("TEMPORAL",), ("SPATIAL",))
    assert ops.event_epochs()["exhaustive_validation"] == []


@pytest.mark.parametrize(
    ("combination", "name"),
    [
        (("TEMPORAL",), "val_mask_TEMPORAL"),  # single component
        (("TEMPORAL", "SPATIAL"), "val_mask_TEMPORAL_SPATIAL"),  # joined by '_' in order
        (("SPATIAL", "ELEVATION"), "val_mask_SPATIAL_ELEVATION"),  # another pair
    ],
)
def test_partial_pass_name(combination: tuple[str, ...], name: str) -> None:
    assert OpsSchedule.partial_pass_name(combination) == name


def test_pass_names_of_exhaustive_validation_are_distinct() -> None:
    names = [OpsSchedule.partial_pass_name(c) for c in make_ops(EXHAUSTIVE).partial_mask_combinations(10)]
    assert len(set(names)) == 6
    assert "val_mask_TEMPORAL_SPATIAL" in names


# ---------------------------------------------------------------------------------------------
# Probability ramps (docs/semantics.md §4), T = 100 batches x 10 epochs = 1000
# ---------------------------------------------------------------------------------------------

META_MASK = {
    "SCHEDULE": {"META_MASKING": {"ENABLED": True, "START_PROB": 1.0, "END_PROB": 0.05, "END_FRACTION": 0.3}}
}
MIXUP = {
    "SCHEDULE": {
        "MIXUP": {
            "GROUP_LEVELS": ["taxa_L10", "taxa_L20"],
            "PROB": {"ENABLED": True, "START_PROB": 1.0, "END_PROB": 0.2, "END_FRACTION": 0.4},
        }
    }
}
PARTIAL = {
    "SCHEDULE": {
        "META_MASKING": {
            "PARTIAL": {
                "ENABLED": True,
                "START_FRACTION": 0.1,
                "END_FRACTION": 0.9,
                "START_PROB": 0.01,
                "END_PROB": 0.7,
                "PROB_END_FRACTION": 0.5,
                "WHITELIST": [["TEMPORAL"], ["SPATIAL", "ELEVATION"]],
            }
        }
    }
}


@pytest.mark.parametrize(
    ("k", "prob"),
    [
        (0, 1.0),  # START_PROB at step 0
        (150, 0.525),  # halfway to E = 300
        (299, 1.0 - 0.95 * 299 / 300),  # last step of the ramp
        (300, 0.05),  # END_PROB reached at E
        (999, 0.05),  # held until the end
    ],
)
def test_meta_mask_ramp(k: int, prob: float) -> None:
    assert make_ops(META_MASK).get_meta_mask_prob(k) == pytest.approx(prob)


@pytest.mark.parametrize(
    ("k", "prob"),
    [
        (0, 1.0),  # START_PROB
        (200, 0.6),  # halfway to E = 400
        (400, 0.2),  # END_PROB at E
        (401, 0.2),  # held after E
        (999, 0.2),  # last step
    ],
)
def test_mixup_ramp(k: int, prob: float) -> None:
    assert make_ops(MIXUP).get_mixup_prob(k) == pytest.approx(prob)


def test_mixup_accepts_linnaeus_mix_spelling() -> None:
    mix = copy.deepcopy(MIXUP)
    mix["SCHEDULE"]["MIXUP"]["MIX"] = mix["SCHEDULE"]["MIXUP"].pop("PROB")
    ops = make_ops(mix)
    assert ops.get_mixup_prob(200) == pytest.approx(0.6)
    assert ops.get_mixup_prob(400) == pytest.approx(0.2)


@pytest.mark.parametrize("k", [0, 1, 399, 400, 999])  # every step, before and after the ramp ends
def test_mixup_group_level_is_first_level_at_every_step(k: int) -> None:
    assert make_ops(MIXUP).get_mixup_group_level(k) == "taxa_L10"


@pytest.mark.parametrize(
    ("k", "active", "prob"),
    [
        (0, False, 0.0),  # before the window
        (99, False, 0.0),  # last step before START = 100
        (100, True, 0.148),  # window opens; ramp runs from step 0: 0.01 + 0.69 * 100 / 500
        (300, True, 0.424),  # 0.01 + 0.69 * 300 / 500
        (500, True, 0.7),  # END_PROB at PROB_END = 500
        (899, True, 0.7),  # last step of the window
        (900, False, 0.0),  # END is exclusive
        (999, False, 0.0),  # after the window
    ],
)
def test_partial_mask_window(k: int, active: bool, prob: float) -> None:
    ops = make_ops(PARTIAL)
    assert ops.get_partial_mask_enabled(k) is active
    assert ops.get_partial_mask_prob(k) == pytest.approx(prob)


def test_partial_mask_whitelist_and_default_weights() -> None:
    partial = make_ops(PARTIAL).plan.partial_mask
    assert partial.whitelist == (("TEMPORAL",), ("SPATIAL", "ELEVATION"))
    assert partial.weights == (1.0, 1.0)


def test_partial_mask_window_defaults_to_whole_run() -> None:
    data = copy.deepcopy(PARTIAL)
    block = data["SCHEDULE"]["META_MASKING"]["PARTIAL"]
    del block["START_FRACTION"], block["END_FRACTION"]
    ops = make_ops(data)
    assert ops.get_partial_mask_enabled(0)
    assert ops.get_partial_mask_enabled(999)
    assert ops.get_partial_mask_prob(0) == pytest.approx(0.01)


@pytest.mark.parametrize("k", [0, 1, 150, 500, 999])  # all steps
def test_disabled_schedules_give_zero(k: int) -> None:
    ops = make_ops()
    assert ops.get_meta_mask_prob(k) == 0.0
    assert ops.get_mixup_prob(k) == 0.0
    assert ops.get_partial_mask_prob(k) == 0.0
    assert ops.get_partial_mask_enabled(k) is False
    assert ops.get_mixup_group_level(k) is None


@pytest.mark.parametrize(
    ("block", "getter"),
    [
        (lambda d: d["SCHEDULE"]["META_MASKING"], "get_meta_mask_prob"),  # meta-mask ENABLED false
        (lambda d: d["SCHEDULE"]["MIXUP"]["PROB"], "get_mixup_prob"),  # mixup ENABLED false
        (lambda d: d["SCHEDULE"]["META_MASKING"]["PARTIAL"], "get_partial_mask_prob"),  # partial off
    ],
)
def test_configured_but_disabled_schedule_gives_zero(block: Any, getter: str) -> None:
    data = _merge(_merge(META_MASK, MIXUP), PARTIAL)
    block(data)["ENABLED"] = False
    ops = make_ops(data)
    assert all(getattr(ops, getter)(k) == 0.0 for k in (0, 100, 150, 500, 999))


@pytest.mark.parametrize(
    ("data", "getter"),
    [
        (
            {
                "SCHEDULE": {
                    "META_MASKING": {"ENABLED": True, "START_PROB": 0.9, "END_PROB": 0.3, "END_STEPS": 0}
                }
            },
            "get_meta_mask_prob",
        ),  # meta-mask: END_PROB from step 0
        (
            {
                "SCHEDULE": {
                    "MIXUP": {
                        "GROUP_LEVELS": ["x"],
                        "PROB": {"ENABLED": True, "START_PROB": 0.9, "END_PROB": 0.3, "END_STEPS": 0},
                    }
                }
            },
            "get_mixup_prob",
        ),  # mixup: END_PROB from step 0
    ],
)
def test_end_steps_zero_gives_end_prob_from_step_zero(data: dict[str, Any], getter: str) -> None:
    ops = make_ops(data)
    assert [getattr(ops, getter)(k) for k in (0, 1, 500, 999)] == pytest.approx([0.3] * 4)


@pytest.mark.parametrize(
    ("end", "k", "prob"),
    [
        ({"END_STEPS": 250}, 125, 0.5),  # steps: halfway
        ({"END_STEPS": 250}, 250, 0.0),  # steps: reached
        ({"END_EPOCHS": 2.5}, 125, 0.5),  # 2.5 epochs x 100 steps = 250
        ({"END_EPOCHS": 2.5}, 250, 0.0),  # reached
        ({"END_FRACTION": 0.25}, 125, 0.5),  # 0.25 x 1000 = 250
    ],
)
def test_ramp_end_units(end: dict[str, Any], k: int, prob: float) -> None:
    ops = make_ops(
        {"SCHEDULE": {"META_MASKING": {"ENABLED": True, "START_PROB": 1.0, "END_PROB": 0.0, **end}}}
    )
    assert ops.get_meta_mask_prob(k) == pytest.approx(prob)


@pytest.mark.parametrize(
    ("world", "accum", "k", "prob"),
    [
        (1, 1, 150, 0.525),  # T = 1000
        (1, 4, 38, 1.0 - 0.95 * 38 / 75),  # 25 steps/epoch, T = 250, E = round(0.3 * 250) = 75
        (1, 3, 50, 1.0 - 0.95 * 50 / 102),  # ceil(100/3) = 34 steps/epoch, T = 340, E = 102
    ],
)
def test_ramp_is_in_optimizer_steps(world: int, accum: int, k: int, prob: float) -> None:
    ops = make_ops(_merge(META_MASK, {"TRAIN": {"ACCUMULATION_STEPS": accum}}), world=world)
    assert ops.get_meta_mask_prob(k) == pytest.approx(prob)


# ---------------------------------------------------------------------------------------------
# GradNorm (docs/design.md §5)
# ---------------------------------------------------------------------------------------------

GRADNORM = {
    "LOSS": {
        "GRAD_WEIGHTING": {
            "TASK": {"GRADNORM_ENABLED": True, "GRADNORM_WARMUP_STEPS": 150, "UPDATE_INTERVAL": 100}
        }
    }
}


@pytest.mark.parametrize(
    ("k", "expected"),
    [
        (0, False),  # multiple of 100 but in warmup
        (100, False),  # multiple of 100 but in warmup
        (150, False),  # warmup over, not a multiple
        (199, False),  # not a multiple
        (200, True),  # first update
        (201, False),  # not a multiple
        (300, True),  # next update
        (900, True),  # later
    ],
)
def test_gradnorm_updates(k: int, expected: bool) -> None:
    assert make_ops(GRADNORM).should_update_gradnorm(k) is expected


def test_gradnorm_disabled_never_updates() -> None:
    disabled = _merge(GRADNORM, {"LOSS": {"GRAD_WEIGHTING": {"TASK": {"GRADNORM_ENABLED": False}}}})
    ops = make_ops(disabled)
    assert not any(ops.should_update_gradnorm(k) for k in range(1000))


def test_gradnorm_without_warmup_updates_from_step_zero() -> None:
    ops = make_ops(
        {"LOSS": {"GRAD_WEIGHTING": {"TASK": {"GRADNORM_ENABLED": True, "UPDATE_INTERVAL": 4}}}},
        epochs=1,
        batches=13,
    )
    assert [k for k in range(13) if ops.should_update_gradnorm(k)] == [0, 4, 8, 12]


def test_gradnorm_interval_below_accumulation_is_config_error() -> None:
    data = _merge(GRADNORM, {"TRAIN": {"ACCUMULATION_STEPS": 4}})
    data["LOSS"]["GRAD_WEIGHTING"]["TASK"]["UPDATE_INTERVAL"] = 2
    with pytest.raises(ConfigError) as info:
        validate_config(data)
    text = str(info.value)
    assert "LOSS.GRAD_WEIGHTING.TASK.UPDATE_INTERVAL" in text
    assert "TRAIN.ACCUMULATION_STEPS" in text


# ---------------------------------------------------------------------------------------------
# Logging intervals (global_step = completed optimizer steps)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metrics", "epochs", "batches", "expected"),
    [
        ({"STEP_INTERVAL": 30}, 10, 100, [*range(30, 1000, 30), 1000]),  # multiples of 30, and the last step
        ({"STEP_INTERVAL": 100}, 10, 100, list(range(100, 1001, 100))),  # last step is a multiple
        ({"STEP_INTERVAL": 7}, 1, 20, [7, 14, 20]),  # short run
        ({"STEP_FRACTION": 0.1}, 10, 100, list(range(100, 1001, 100))),  # 0.1 x 1000 = 100 steps
        ({}, 2, 120, [50, 100, 150, 200, 240]),  # default 50 steps
    ],
)
def test_should_log_metrics(metrics: dict[str, Any], epochs: int, batches: int, expected: list[int]) -> None:
    ops = make_ops({"SCHEDULE": {"METRICS": metrics}}, epochs=epochs, batches=batches)
    total = ops.plan.total_steps
    assert [s for s in range(total + 1) if ops.should_log_metrics(s)] == expected


def test_other_log_intervals_default_to_step_interval_and_can_be_overridden() -> None:
    ops = make_ops({"SCHEDULE": {"METRICS": {"STEP_INTERVAL": 30, "CONSOLE_INTERVAL": 200}}})
    steps = range(1001)
    # The console shows metrics records: 200 is rounded up to 210, a multiple of 30.
    assert ops.plan.console_interval == 210
    assert [s for s in steps if ops.should_log_console(s)] == [210, 420, 630, 840, 1000]
    metrics = [s for s in steps if ops.should_log_metrics(s)]
    assert [s for s in steps if ops.should_log_to_trackers(s)] == metrics
    assert [s for s in steps if ops.should_log_lr(s)] == metrics
    lr_every_7 = make_ops({"SCHEDULE": {"METRICS": {"STEP_INTERVAL": 30, "LR_INTERVAL": 7}}})
    assert [s for s in steps if lr_every_7.should_log_lr(s)] == [*range(7, 1001, 7), 1000]  # any step


# ---------------------------------------------------------------------------------------------
# Every probability stays a probability (hypothesis)
# ---------------------------------------------------------------------------------------------

probs = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@st.composite
def ramp_configs(draw: st.DrawFn) -> tuple[dict[str, Any], int, int]:
    epochs = draw(st.integers(1, 6))
    batches = draw(st.integers(1, 60))

    def end_unit(prefix: str = "END") -> dict[str, Any]:
        unit = draw(st.sampled_from(["STEPS", "FRACTION", "EPOCHS"]))
        if unit == "STEPS":
            return {f"{prefix}_STEPS": draw(st.integers(0, 2 * epochs * batches))}
        if unit == "FRACTION":
            return {f"{prefix}_FRACTION": draw(probs)}
        return {f"{prefix}_EPOCHS": draw(st.floats(0.0, 2.0 * epochs, allow_nan=False))}

    total = epochs * batches
    window_start = draw(st.integers(0, total - 1))
    window_end = draw(st.integers(window_start + 1, total))
    data = {
        "SCHEDULE": {
            "META_MASKING": {
                "ENABLED": True,
                "START_PROB": draw(probs),
                "END_PROB": draw(probs),
                **end_unit(),
                "PARTIAL": {
                    "ENABLED": True,
                    "START_STEPS": window_start,
                    "END_STEPS": window_end,
                    "START_PROB": draw(probs),
                    "END_PROB": draw(probs),
                    **end_unit("PROB_END"),
                    "WHITELIST": [["TEMPORAL"]],
                },
            },
            "MIXUP": {
                "GROUP_LEVELS": ["taxa_L10"],
                "PROB": {"ENABLED": True, "START_PROB": draw(probs), "END_PROB": draw(probs), **end_unit()},
            },
        }
    }
    return data, epochs, batches


@settings(max_examples=100, deadline=None)
@given(ramp_configs())
def test_probabilities_stay_in_unit_interval(case: tuple[dict[str, Any], int, int]) -> None:
    data, epochs, batches = case
    ops = make_ops(data, epochs=epochs, batches=batches)
    meta, partial = data["SCHEDULE"]["META_MASKING"], data["SCHEDULE"]["META_MASKING"]["PARTIAL"]
    low, high = sorted((meta["START_PROB"], meta["END_PROB"]))
    for k in range(ops.plan.total_steps):
        for p in (ops.get_meta_mask_prob(k), ops.get_mixup_prob(k), ops.get_partial_mask_prob(k)):
            assert 0.0 <= p <= 1.0, (k, p)
        # a linear ramp never leaves the range between its end points
        assert low - 1e-12 <= ops.get_meta_mask_prob(k) <= high + 1e-12
        assert ops.get_partial_mask_enabled(k) is (partial["START_STEPS"] <= k < partial["END_STEPS"])


@pytest.mark.parametrize(
    ("checkpoint", "expected_steps", "expected_epochs"),
    [
        # MID_EPOCH with 250-step interval, 100 steps/epoch: mid-epoch at 250, 750; 500 and 1000 end epochs 5, 10
        ({"INTERVAL_STEPS": 250, "MID_EPOCH": True}, [250, 750], [5, 10]),
        # without MID_EPOCH the same interval fires at the next epoch boundary instead
        ({"INTERVAL_STEPS": 250}, [], [3, 5, 8, 10]),
        # a fraction works like steps: 0.35 of 1000 = 350 mid-epoch; 700 ends epoch 7
        ({"INTERVAL_FRACTION": 0.35, "MID_EPOCH": True}, [350], [7, 10]),
    ],
)
def test_mid_epoch_checkpoints_fire_at_the_step_itself(
    checkpoint: dict[str, Any], expected_steps: list[int], expected_epochs: list[int]
) -> None:
    config = validate_config({"TRAIN": {"EPOCHS": 10}, "SCHEDULE": {"CHECKPOINT": checkpoint}})
    ops = OpsSchedule(resolve_plan(config, 100, 1))
    assert [k for k in range(1, 1001) if ops.should_save_mid_epoch_checkpoint(k)] == expected_steps
    assert ops.event_epochs()["checkpoint"] == expected_epochs


def test_mid_epoch_needs_a_step_interval() -> None:
    with pytest.raises(ConfigError, match=r"SCHEDULE\.CHECKPOINT\.MID_EPOCH"):
        validate_config({"SCHEDULE": {"CHECKPOINT": {"INTERVAL_EPOCHS": 2, "MID_EPOCH": True}}})
