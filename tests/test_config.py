"""Config loading and validation as a user meets it (docs/semantics.md §2 and the rules in ``linnaeus_accel.config``).

Every rule has a table row: the config given, and the keys the error must name (with their full
dotted path). Then: every problem of a config is reported in one ``ConfigError``; YAML files with
``BASE`` inheritance and ``--opts`` overrides; the ``plan`` command's exit status and messages on a
bad config; and the sanity warnings, which never make a run fail.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers.in_process import reset_accelerate

from linnaeus_accel.cli import EXIT_CONFIG_ERROR, main
from linnaeus_accel.config import Config, ConfigError, apply_opts, load_config, read_yaml, validate_config
from linnaeus_accel.schedule import resolve_plan

# ---------------------------------------------------------------------------------------------
# helpers


def nested(*pairs: Any) -> dict[str, Any]:
    """``nested("A.B", 1, "A.C", 2)`` -> ``{"A": {"B": 1, "C": 2}}``."""
    assert len(pairs) % 2 == 0, "nested() takes KEY VALUE pairs"
    out: dict[str, Any] = {}
    for dotted, value in zip(pairs[::2], pairs[1::2], strict=True):
        *parents, leaf = dotted.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def under(prefix: str, **fields: Any) -> dict[str, Any]:
    """``under("A.B", X=1, Y=2)`` -> ``{"A": {"B": {"X": 1, "Y": 2}}}``."""
    return nested(*(item for key, value in fields.items() for item in (f"{prefix}.{key}", value)))


LR = "LR_SCHEDULER"
GROUPS = "LR_SCHEDULER.PARAMETER_GROUPS"
PARTIAL = "SCHEDULE.META_MASKING.PARTIAL"
PVAL = "SCHEDULE.VALIDATION.PARTIAL_MASK_META"
FINAL = "SCHEDULE.VALIDATION.FINAL_EPOCH"
MIXUP = "SCHEDULE.MIXUP"
VALIDATION = "SCHEDULE.VALIDATION"
GRADNORM = "LOSS.GRAD_WEIGHTING.TASK"


def group(label: str = "head", **fields: Any) -> dict[str, Any]:
    """One LR_SCHEDULER.PARAMETER_GROUPS entry."""
    return {"LABEL": label, "MATCH": [f"{label}.*"], **fields}


def groups(*entries: dict[str, Any]) -> dict[str, Any]:
    return nested(GROUPS, list(entries))


def config_error(data: dict[str, Any]) -> ConfigError:
    """The ConfigError ``data`` raises (the test fails if it validates)."""
    with pytest.raises(ConfigError) as info:
        validate_config(data)
    return info.value


def problems_of(data: dict[str, Any]) -> str:
    """The text of the error ``data`` raises, as the user reads it."""
    return str(config_error(data))


def names(text: str, key: str) -> bool:
    """Whether ``text`` names ``key`` as a whole dotted key (``A.B`` is not found in ``X.A.B_C``)."""
    return re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", text) is not None


def assert_names_all(text: str, keys: Sequence[str]) -> None:
    missing = [k for k in keys if not names(text, k)]
    assert not missing, f"the error does not name {missing}:\n{text}"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``linnaeus-accel ARGS`` in-process: (exit status, stdout, stderr)."""
    rc = main(list(args))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def out_dir_opts(out_dir: Path) -> list[str]:
    """``--opts`` that send a run's output under ``out_dir``."""
    return ["--opts", "ENV.OUTPUT.BASE_DIR", str(out_dir)]


UNIT_VALUE = {"STEPS": 10, "FRACTION": 0.1, "EPOCHS": 1, "INTERVAL": 10}


def two_units(stem: str, unit_a: str, unit_b: str) -> tuple[dict[str, Any], list[str]]:
    """A config setting ``<stem>_<unit_a>`` and ``<stem>_<unit_b>``, and those two full keys."""
    keys = [f"{stem}_{unit_a}", f"{stem}_{unit_b}"]
    return nested(keys[0], UNIT_VALUE[unit_a], keys[1], UNIT_VALUE[unit_b]), keys


# ---------------------------------------------------------------------------------------------
# exactly one unit per timed parameter (docs/semantics.md §2): the error names both keys


@pytest.mark.parametrize(
    ("stem", "unit_a", "unit_b"),
    [
        (
            "LR_SCHEDULER.WARMUP",
            "STEPS",
            "FRACTION",
        ),  # two units of one parameter: WARMUP_STEPS 30 + WARMUP_FRACTION
        ("LR_SCHEDULER.WARMUP", "FRACTION", "EPOCHS"),  # warmup: fraction and epochs
        ("LR_SCHEDULER.DECAY", "STEPS", "EPOCHS"),  # step-decay period in two units
        ("LR_SCHEDULER.DECAY", "FRACTION", "STEPS"),  # step-decay period, fraction and steps
        ("SCHEDULE.VALIDATION.INTERVAL", "EPOCHS", "STEPS"),  # standard validation interval
        ("SCHEDULE.VALIDATION.INTERVAL", "EPOCHS", "FRACTION"),  # ... epochs and fraction
        ("SCHEDULE.VALIDATION.MASK_META_INTERVAL", "STEPS", "FRACTION"),  # mask-meta validation
        ("SCHEDULE.VALIDATION.MASK_META_INTERVAL", "EPOCHS", "STEPS"),  # ... epochs and steps
        ("SCHEDULE.VALIDATION.PARTIAL_MASK_META.INTERVAL", "EPOCHS", "STEPS"),  # partial-mask validation
        ("SCHEDULE.VALIDATION.PARTIAL_MASK_META.INTERVAL", "FRACTION", "EPOCHS"),  # ... fraction, epochs
        ("SCHEDULE.CHECKPOINT.INTERVAL", "EPOCHS", "FRACTION"),  # checkpoint interval
        ("SCHEDULE.CHECKPOINT.INTERVAL", "STEPS", "EPOCHS"),  # ... steps and epochs
        ("SCHEDULE.META_MASKING.END", "STEPS", "FRACTION"),  # full-mask ramp end
        ("SCHEDULE.META_MASKING.END", "EPOCHS", "STEPS"),  # ... epochs and steps
        ("SCHEDULE.META_MASKING.PARTIAL.START", "STEPS", "EPOCHS"),  # partial-mask window start
        ("SCHEDULE.META_MASKING.PARTIAL.END", "FRACTION", "EPOCHS"),  # partial-mask window end
        ("SCHEDULE.META_MASKING.PARTIAL.PROB_END", "STEPS", "FRACTION"),  # partial-mask ramp end
        ("SCHEDULE.MIXUP.PROB.END", "STEPS", "EPOCHS"),  # mixup ramp end
        ("SCHEDULE.MIXUP.MIX.END", "STEPS", "FRACTION"),  # mixup ramp end, spelt MIX
        ("SCHEDULE.METRICS.STEP", "INTERVAL", "FRACTION"),  # logging interval: steps and fraction
    ],
)
def test_two_units_for_one_parameter_is_an_error_naming_both_keys(
    stem: str, unit_a: str, unit_b: str
) -> None:
    data, keys = two_units(stem, unit_a, unit_b)
    error = config_error(data)
    assert len(error.problems) == 1, error
    assert_names_all(str(error), keys)


def test_two_units_in_a_parameter_group_name_the_group_keys() -> None:
    group = {"LABEL": "head", "MATCH": ["head.*"], "WARMUP_STEPS": 5, "WARMUP_EPOCHS": 1}
    text = problems_of(nested("LR_SCHEDULER.PARAMETER_GROUPS", [group]))
    assert_names_all(
        text,
        ["LR_SCHEDULER.PARAMETER_GROUPS.0.WARMUP_STEPS", "LR_SCHEDULER.PARAMETER_GROUPS.0.WARMUP_EPOCHS"],
    )


def test_three_units_for_one_parameter_name_all_three() -> None:
    data = nested(
        "LR_SCHEDULER.WARMUP_STEPS", 30, "LR_SCHEDULER.WARMUP_FRACTION", 0.1, "LR_SCHEDULER.WARMUP_EPOCHS", 2
    )
    assert_names_all(
        problems_of(data),
        ["LR_SCHEDULER.WARMUP_STEPS", "LR_SCHEDULER.WARMUP_FRACTION", "LR_SCHEDULER.WARMUP_EPOCHS"],
    )


@pytest.mark.parametrize(
    "data",
    [
        nested("LR_SCHEDULER.WARMUP_FRACTION", 0.1),  # warmup as a fraction only
        nested("LR_SCHEDULER.WARMUP_EPOCHS", 2.5),  # fractional warmup epochs are allowed
        nested("SCHEDULE.VALIDATION.INTERVAL_STEPS", 350),  # one unit per interval
        under(VALIDATION, INTERVAL_EPOCHS=1, MASK_META_INTERVAL_STEPS=100),  # two parameters, two units
        nested("SCHEDULE.METRICS.STEP_FRACTION", 0.01),  # logging by fraction
        {},  # nothing set: every timed parameter unset is fine
    ],
)
def test_one_unit_per_parameter_is_accepted(data: dict[str, Any]) -> None:
    assert isinstance(validate_config(data), Config)


# ---------------------------------------------------------------------------------------------
# fractions and probabilities must lie in [0, 1]; 0 is a valid fraction (disabled)

FRACTION_KEYS = [
    "LR_SCHEDULER.WARMUP_FRACTION",
    "LR_SCHEDULER.DECAY_FRACTION",
    "LR_SCHEDULER.STABLE_DURATION_FRACTION",  # wsd
    "LR_SCHEDULER.DECAY_DURATION_FRACTION",  # wsd
    "SCHEDULE.VALIDATION.INTERVAL_FRACTION",
    "SCHEDULE.VALIDATION.MASK_META_INTERVAL_FRACTION",
    "SCHEDULE.VALIDATION.PARTIAL_MASK_META.INTERVAL_FRACTION",
    "SCHEDULE.CHECKPOINT.INTERVAL_FRACTION",
    "SCHEDULE.META_MASKING.END_FRACTION",
    "SCHEDULE.META_MASKING.PARTIAL.START_FRACTION",
    "SCHEDULE.META_MASKING.PARTIAL.END_FRACTION",
    "SCHEDULE.META_MASKING.PARTIAL.PROB_END_FRACTION",
    "SCHEDULE.MIXUP.PROB.END_FRACTION",
    "SCHEDULE.METRICS.STEP_FRACTION",
    "DATA.DATASET.VAL_FRACTION",
]

PROBABILITY_KEYS = [
    "SCHEDULE.META_MASKING.START_PROB",
    "SCHEDULE.META_MASKING.END_PROB",
    "SCHEDULE.META_MASKING.PARTIAL.START_PROB",
    "SCHEDULE.META_MASKING.PARTIAL.END_PROB",
    "SCHEDULE.MIXUP.PROB.START_PROB",
    "SCHEDULE.MIXUP.PROB.END_PROB",
]


@pytest.mark.parametrize("key", FRACTION_KEYS + PROBABILITY_KEYS)
@pytest.mark.parametrize(
    "value",
    [
        1.5,  # a fraction above 1
        -0.1,  # below 0
        1.0001,  # just above 1
        float("nan"),  # YAML .nan
        float("inf"),  # YAML .inf
    ],
)
def test_value_outside_0_1_is_an_error_naming_the_key(key: str, value: float) -> None:
    error = config_error(nested(key, value))
    assert len(error.problems) == 1, error
    assert_names_all(str(error), [key])


@pytest.mark.parametrize(
    ("data", "key"),
    [
        (under(MIXUP, MIX={"START_PROB": 1.5}), f"{MIXUP}.MIX.START_PROB"),  # MIX is checked like PROB
        (groups(group(WARMUP_FRACTION=1.5)), f"{GROUPS}.0.WARMUP_FRACTION"),  # a group's own fraction
        (groups(group(STABLE_DURATION_FRACTION=-0.1)), f"{GROUPS}.0.STABLE_DURATION_FRACTION"),  # group wsd
    ],
)
def test_nested_fraction_or_probability_outside_0_1_names_the_key(data: dict[str, Any], key: str) -> None:
    assert_names_all(problems_of(data), [key])


@pytest.mark.parametrize("value", [0, 0.0, 1, 1.0, 0.5])  # the bounds are inside: 0 (disabled) and 1
@pytest.mark.parametrize(
    "key",  # (holding out the whole dataset, VAL_FRACTION 1, is for the data checks to judge)
    [k for k in FRACTION_KEYS if k != "DATA.DATASET.VAL_FRACTION"] + PROBABILITY_KEYS,
)
def test_fraction_and_probability_bounds_are_accepted(key: str, value: float) -> None:
    assert isinstance(validate_config(nested(key, value)), Config)


def test_fraction_zero_means_disabled_not_every_step() -> None:
    config = validate_config(
        nested(
            "SCHEDULE.VALIDATION.INTERVAL_FRACTION",
            0,
            "SCHEDULE.CHECKPOINT.INTERVAL_FRACTION",
            0.1,
            "LR_SCHEDULER.WARMUP_FRACTION",
            0,
        )
    )
    plan = resolve_plan(config, batches_per_epoch=100)
    assert plan.validation is None  # linnaeus resolved 0 to "every step"; we disable
    assert plan.warmup_steps == 0
    assert plan.checkpoint is not None
    assert plan.checkpoint.every == plan.total_steps // 10


# ---------------------------------------------------------------------------------------------
# intervals: 0 is an error that says to use null


@pytest.mark.parametrize(
    "key",
    [
        "SCHEDULE.VALIDATION.INTERVAL_EPOCHS",  # standard validation
        "SCHEDULE.VALIDATION.INTERVAL_STEPS",
        "SCHEDULE.VALIDATION.MASK_META_INTERVAL_EPOCHS",  # mask-meta validation
        "SCHEDULE.VALIDATION.MASK_META_INTERVAL_STEPS",
        "SCHEDULE.VALIDATION.PARTIAL_MASK_META.INTERVAL_EPOCHS",  # partial-mask validation
        "SCHEDULE.VALIDATION.PARTIAL_MASK_META.INTERVAL_STEPS",
        "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS",  # checkpoints
        "SCHEDULE.CHECKPOINT.INTERVAL_STEPS",
        "SCHEDULE.METRICS.STEP_INTERVAL",  # logging
        "SCHEDULE.METRICS.CONSOLE_INTERVAL",
        "SCHEDULE.METRICS.WANDB_INTERVAL",
        "SCHEDULE.METRICS.LR_INTERVAL",
        "SCHEDULE.METRICS.PIPELINE_INTERVAL",
        "TRAIN.EARLY_STOP.PATIENCE_STEPS",  # "off" is null here too
        "TRAIN.EARLY_STOP.MAX_STEPS",
    ],
)
def test_interval_zero_is_an_error_that_says_to_use_null(key: str) -> None:
    text = problems_of(nested(key, 0))
    assert_names_all(text, [key])
    assert "null" in text


@pytest.mark.parametrize(
    "key",
    [
        "SCHEDULE.VALIDATION.INTERVAL_EPOCHS",  # negative interval
        "SCHEDULE.CHECKPOINT.INTERVAL_STEPS",
    ],
)
def test_negative_interval_is_an_error(key: str) -> None:
    assert_names_all(problems_of(nested(key, -1)), [key])


# ---------------------------------------------------------------------------------------------
# rules that involve several fields of one section


@pytest.mark.parametrize(
    ("data", "keys", "says"),
    [
        (  # WEIGHTS must have one entry per WHITELIST combination
            under(PARTIAL, WHITELIST=[["A"], ["B"]], WEIGHTS=[1.0]),
            [f"{PARTIAL}.WEIGHTS", f"{PARTIAL}.WHITELIST"],
            "",
        ),
        (  # more weights than combinations
            under(PARTIAL, WHITELIST=[["A"]], WEIGHTS=[1, 2]),
            [f"{PARTIAL}.WEIGHTS", f"{PARTIAL}.WHITELIST"],
            "",
        ),
        (under(PARTIAL, WHITELIST=[["A"]], WEIGHTS=[0]), [f"{PARTIAL}.WEIGHTS"], ""),  # weights sum to 0
        (under(PARTIAL, WHITELIST=[["A"]], WEIGHTS=[-1]), [f"{PARTIAL}.WEIGHTS.0"], ""),  # negative weight
        (under(PARTIAL, WHITELIST=[[]]), [f"{PARTIAL}.WHITELIST.0"], "empty"),  # empty combination
        (under(PVAL, WHITELIST=[["A"], ["B", "B"]]), [f"{PVAL}.WHITELIST.1"], "twice"),  # component twice
        (  # partial window START >= END is empty
            under(PARTIAL, START_FRACTION=0.5, END_FRACTION=0.5),
            [f"{PARTIAL}.START_FRACTION", f"{PARTIAL}.END_FRACTION"],
            "",
        ),
        (  # partial masking enabled with nothing to mask
            under(PARTIAL, ENABLED=True, PROB_END_STEPS=10),
            [f"{PARTIAL}.WHITELIST"],
            "ENABLED",
        ),
        (under(PVAL, ENABLED=True), [f"{PVAL}.WHITELIST"], "ENABLED"),  # validation with nothing to mask
        (  # exhaustive final validation needs at least two components
            under(FINAL, EXHAUSTIVE_PARTIAL_META_VALIDATION=True, EXHAUSTIVE_META_COMPONENTS=["A"]),
            [f"{FINAL}.EXHAUSTIVE_META_COMPONENTS"],
            "2",
        ),
        (  # exhaustive components listed twice
            under(FINAL, EXHAUSTIVE_META_COMPONENTS=["A", "A"]),
            [f"{FINAL}.EXHAUSTIVE_META_COMPONENTS"],
            "twice",
        ),
        (  # mixup group-level switching is not supported (steps) ...
            under(MIXUP, LEVEL_SWITCH_STEPS=[100]),
            [f"{MIXUP}.LEVEL_SWITCH_STEPS"],
            "empty",
        ),
        (  # ... nor by epochs
            under(MIXUP, LEVEL_SWITCH_EPOCHS=[2]),
            [f"{MIXUP}.LEVEL_SWITCH_EPOCHS"],
            "empty",
        ),
        (  # mixup enabled without a level to group by
            under(MIXUP, PROB={"ENABLED": True, "END_STEPS": 10}),
            [f"{MIXUP}.GROUP_LEVELS"],
            "",
        ),
        (  # an enabled full-mask ramp needs an END_*
            under("SCHEDULE.META_MASKING", ENABLED=True),
            ["SCHEDULE.META_MASKING.END_STEPS"],
            "ENABLED",
        ),
        (  # an enabled mixup ramp needs an END_*
            under(MIXUP, GROUP_LEVELS=["digit"], PROB={"ENABLED": True}),
            [f"{MIXUP}.PROB.END_STEPS"],
            "ENABLED",
        ),
        (  # an enabled partial-mask ramp needs a PROB_END_*
            under(PARTIAL, ENABLED=True, WHITELIST=[["A"]]),
            [f"{PARTIAL}.PROB_END_STEPS"],
            "ENABLED",
        ),
        (under(LR, NAME="step"), [f"{LR}.DECAY_STEPS"], "step"),  # NAME step needs a decay period
        (groups(group(NAME="step")), [f"{GROUPS}.0.DECAY_STEPS"], "step"),  # ... so does a 'step' group
        (groups(group("default")), [f"{GROUPS}.0.LABEL"], "default"),  # reserved label
        (groups(group(MATCH=[])), [f"{GROUPS}.0.MATCH"], "empty"),  # a group must select something
        (groups(group("head"), group("head")), [f"{GROUPS}.1.LABEL"], "head"),  # labels are unique
        (  # early stopping switched on with no condition to stop on
            under("TRAIN.EARLY_STOP", ACTIVE=True),
            ["TRAIN.EARLY_STOP.ACTIVE"],
            "PATIENCE_STEPS",
        ),
        (  # bucket upload without a bucket
            under("ENV.OUTPUT.BUCKET", ENABLED=True),
            ["ENV.OUTPUT.BUCKET.BUCKET"],
            "ENABLED",
        ),
        (  # a run is measured in epochs or in tokens, not both; the fix is to unset one
            under("TRAIN", EPOCHS=3, TARGET_TOKENS=10**6),
            ["TRAIN.EPOCHS", "TRAIN.TARGET_TOKENS"],
            "null",
        ),
        (  # MFU is counted from FLOPs per token or per sample, not both
            under("TASK", FLOPS_PER_TOKEN=1e9, FLOPS_PER_SAMPLE=5e11),
            ["TASK.FLOPS_PER_TOKEN", "TASK.FLOPS_PER_SAMPLE"],
            "keep",
        ),
    ],
)
def test_section_rule_is_an_error_naming_its_keys(data: dict[str, Any], keys: list[str], says: str) -> None:
    error = config_error(data)
    assert len(error.problems) == 1, error
    assert_names_all(str(error), keys)
    assert says in str(error)


@pytest.mark.parametrize(
    "data",
    [
        under(LR, NAME="step", DECAY_STEPS=30),  # step with steps
        under(LR, NAME="step", DECAY_FRACTION=0.3),  # step with a fraction
        under(LR, NAME="step", DECAY_EPOCHS=1.5),  # step with epochs
        {LR: {"DECAY_STEPS": 30, "PARAMETER_GROUPS": [group(NAME="step")]}},  # step group, global period
        under(MIXUP, LEVEL_SWITCH_STEPS=[], LEVEL_SWITCH_EPOCHS=[]),  # empty switch lists are fine
        under(PARTIAL, WHITELIST=[["A"], ["B"]], WEIGHTS=[1, 3]),  # WEIGHTS of the right length
        under("SCHEDULE.META_MASKING", ENABLED=True, END_FRACTION=0.3),  # enabled ramp with an END
        under("SCHEDULE.META_MASKING", END_FRACTION=0.3),  # a disabled ramp may still carry an END
        under("TRAIN.EARLY_STOP", ACTIVE=True, MAX_STEPS=100),  # any stopping condition will do
        groups(group("a"), group("b")),  # distinct labels
        under("TRAIN", TARGET_TOKENS=10**6),  # tokens instead of epochs
        under("TRAIN", EPOCHS=3, TARGET_TOKENS=None),  # epochs, tokens explicitly unset
        under("TASK", FLOPS_PER_TOKEN=1e9),  # one FLOPs figure
        under("TASK", FLOPS_PER_SAMPLE=5e11),  # ... or the other
    ],
)
def test_section_rule_satisfied_is_accepted(data: dict[str, Any]) -> None:
    assert isinstance(validate_config(data), Config)


# ---------------------------------------------------------------------------------------------
# GradNorm: UPDATE_INTERVAL < accumulation is an error, only when GradNorm is on (docs/design.md §5)


@pytest.mark.parametrize(
    ("enabled", "interval", "accumulation", "is_error"),
    [
        (True, 2, 4, True),  # an update interval below the accumulation: interval 2, accumulation 4
        (True, 1, 2, True),  # interval 1 is too short as soon as accumulation > 1
        (False, 2, 4, False),  # GradNorm off: the interval does not matter
        (True, 4, 4, False),  # equal is fine
        (True, 5, 4, False),  # longer is fine
        (True, 1, 1, False),  # no accumulation
        (True, 1, 0, False),  # accumulation 0 counts as 1
    ],
)
def test_gradnorm_interval_against_accumulation(
    enabled: bool, interval: int, accumulation: int, is_error: bool
) -> None:
    data = nested(
        f"{GRADNORM}.GRADNORM_ENABLED",
        enabled,
        f"{GRADNORM}.UPDATE_INTERVAL",
        interval,
        "TRAIN.ACCUMULATION_STEPS",
        accumulation,
    )
    if is_error:
        assert_names_all(problems_of(data), [f"{GRADNORM}.UPDATE_INTERVAL", "TRAIN.ACCUMULATION_STEPS"])
    else:
        assert isinstance(validate_config(data), Config)


def test_accumulation_zero_counts_as_one() -> None:
    config = validate_config(nested("TRAIN.ACCUMULATION_STEPS", 0, "DATA.BATCH_SIZE", 8))
    assert config.TRAIN.accumulation == 1
    plan = resolve_plan(config, batches_per_epoch=37, world_size=2)
    assert (plan.accumulation, plan.optimizer_steps_per_epoch, plan.effective_batch_size) == (1, 37, 16)


# ---------------------------------------------------------------------------------------------
# how long to train (TRAIN.EPOCHS or TRAIN.TARGET_TOKENS), the TASK section, ENV.PEAK_FLOPS


@pytest.mark.parametrize(
    ("train", "epochs", "target"),
    [
        ({}, 10, None),  # neither: 10 epochs, linnaeus-accel's default
        ({"EPOCHS": 3}, 3, None),  # epochs
        ({"TARGET_TOKENS": 10**6}, None, 10**6),  # tokens: the epoch count comes from the data
        ({"TARGET_TOKENS": 2.5e9}, None, 2_500_000_000),  # written with an exponent, YAML gives a float
        ({"EPOCHS": None, "TARGET_TOKENS": None}, 10, None),  # both null is neither
    ],
)
def test_epochs_or_target_tokens(train: dict[str, Any], epochs: int | None, target: int | None) -> None:
    config = validate_config({"TRAIN": train})
    assert (config.TRAIN.epochs, config.TRAIN.TARGET_TOKENS) == (epochs, target)
    assert isinstance(config.TRAIN.TARGET_TOKENS, int | None)


def test_target_tokens_on_top_of_the_default_config(default_config_path: Path) -> None:
    # the default config sets EPOCHS: 20, so TARGET_TOKENS alone conflicts with it ...
    with pytest.raises(ConfigError) as info:
        load_config(default_config_path, ["TRAIN.TARGET_TOKENS", "1000000"])
    assert_names_all(str(info.value), ["TRAIN.EPOCHS", "TRAIN.TARGET_TOKENS"])
    # ... and unsetting EPOCHS makes it a token run
    config = load_config(default_config_path, ["TRAIN.EPOCHS", "null", "TRAIN.TARGET_TOKENS", "1000000"])
    assert (config.TRAIN.EPOCHS, config.TRAIN.TARGET_TOKENS, config.TRAIN.epochs) == (None, 10**6, None)


def test_task_and_peak_flops_defaults() -> None:
    config = Config()
    assert config.TASK.NAME == "hierarchical"  # linnaeus' task
    assert config.TASK.LABEL_SMOOTHING == 0.0
    assert config.TASK.INPUT_KEY == "image"
    assert (config.TASK.FLOPS_PER_TOKEN, config.TASK.FLOPS_PER_SAMPLE) == (None, None)
    assert config.ENV.PEAK_FLOPS is None  # looked up by GPU name at run time
    assert list(type(config).model_fields).index("TASK") == list(type(config).model_fields).index("MODEL") + 1


@pytest.mark.parametrize(
    ("data", "read"),
    [
        (nested("TASK.NAME", "causal_lm"), lambda c: c.TASK.NAME == "causal_lm"),  # built-in task
        (nested("TASK.NAME", "my_task"), lambda c: c.TASK.NAME == "my_task"),  # the registry judges names
        (nested("TASK.LABEL_SMOOTHING", 0.1), lambda c: c.TASK.LABEL_SMOOTHING == 0.1),
        (nested("TASK.LABEL_SMOOTHING", 0.999), lambda c: c.TASK.LABEL_SMOOTHING == 0.999),  # below 1
        (nested("TASK.INPUT_KEY", "pixels"), lambda c: c.TASK.INPUT_KEY == "pixels"),
        (nested("TASK.FLOPS_PER_TOKEN", 6 * 124e6), lambda c: c.TASK.FLOPS_PER_TOKEN == 744e6),
        (nested("TASK.FLOPS_PER_SAMPLE", 3), lambda c: c.TASK.FLOPS_PER_SAMPLE == 3.0),  # an int is a float
        (nested("ENV.PEAK_FLOPS", 989e12), lambda c: c.ENV.PEAK_FLOPS == 989e12),  # an H100, dense bf16
    ],
)
def test_task_and_peak_flops_values_are_accepted(data: dict[str, Any], read: Any) -> None:
    assert read(validate_config(data))


def test_task_and_peak_flops_from_yaml(tmp_path: Path) -> None:
    config = load_config(
        write(
            tmp_path / "lm.yaml",
            "TASK:\n  NAME: causal_lm\n  FLOPS_PER_TOKEN: 7.4e8\nENV:\n  PEAK_FLOPS: 989e12\n"
            "TRAIN:\n  TARGET_TOKENS: 1e9\n",
        )
    )
    assert (config.TASK.NAME, config.TASK.FLOPS_PER_TOKEN, config.ENV.PEAK_FLOPS) == (
        "causal_lm",
        7.4e8,
        989e12,
    )
    assert config.TRAIN.TARGET_TOKENS == 10**9


# ---------------------------------------------------------------------------------------------
# unknown keys, MIX/PROB, EXPERIMENT.NAME, EARLY_STOP.METRIC


@pytest.mark.parametrize(
    ("data", "key", "hint"),
    [
        ({"TRIAN": {}}, "TRIAN", "TRAIN"),  # misspelt section
        (nested("TRAIN.EPCHS", 3), "TRAIN.EPCHS", "EPOCHS"),  # misspelt field
        (nested("SCHEDULE.VALIDATON.INTERVAL_EPOCHS", 1), "SCHEDULE.VALIDATON", "VALIDATION"),  # subsection
        (under(LR, WARMUP_FRACTON=0.1), f"{LR}.WARMUP_FRACTON", "WARMUP_FRACTION"),  # a timed key
        (nested("SCHEDULE.MIXUP.PROB.ENABLD", True), "SCHEDULE.MIXUP.PROB.ENABLD", "ENABLED"),  # deep
        (  # three levels down
            nested("SCHEDULE.META_MASKING.PARTIAL.WHITELST", [["A"]]),
            "SCHEDULE.META_MASKING.PARTIAL.WHITELST",
            "WHITELIST",
        ),
        (under(MIXUP, MIX={"ENABLD": True}), f"{MIXUP}.MIX.ENABLD", "ENABLED"),  # in the MIX spelling
        (  # inside a list item (a parameter group)
            groups(group(LR_MULTIPLER=2.0)),
            f"{GROUPS}.0.LR_MULTIPLER",
            "LR_MULTIPLIER",
        ),
        (nested("TRAIN.TARGET_TOKEN", 10**6), "TRAIN.TARGET_TOKEN", "TARGET_TOKENS"),  # the new TRAIN key
        (nested("TASK.NAMES", "causal_lm"), "TASK.NAMES", "NAME"),  # the TASK section
        (nested("TASK.LABEL_SMOTHING", 0.1), "TASK.LABEL_SMOTHING", "LABEL_SMOOTHING"),
        (nested("TASK.FLOPS_PER_TOKENS", 1e9), "TASK.FLOPS_PER_TOKENS", "FLOPS_PER_TOKEN"),
        ({"TASKS": {"NAME": "causal_lm"}}, "TASKS", "TASK"),  # the section itself misspelt
        (nested("ENV.PEAK_FLOP", 1e15), "ENV.PEAK_FLOP", "PEAK_FLOPS"),
    ],
)
def test_unknown_key_is_an_error_with_a_did_you_mean_hint(data: dict[str, Any], key: str, hint: str) -> None:
    text = problems_of(data)
    assert_names_all(text, [key])
    assert f"did you mean {hint}" in text


def test_mix_is_accepted_as_a_spelling_of_prob() -> None:
    ramp = {"ENABLED": True, "START_PROB": 1.0, "END_PROB": 0.2, "END_FRACTION": 0.4}
    spelt_mix = validate_config(under(MIXUP, GROUP_LEVELS=["digit"], MIX=ramp))
    spelt_prob = validate_config(under(MIXUP, GROUP_LEVELS=["digit"], PROB=ramp))
    assert spelt_mix.SCHEDULE.MIXUP.PROB == spelt_prob.SCHEDULE.MIXUP.PROB
    assert spelt_mix.SCHEDULE.MIXUP.PROB.END_FRACTION == 0.4
    mixup = resolve_plan(spelt_mix, batches_per_epoch=100).mixup  # T = 1000 (10 epochs)
    assert (mixup(200), mixup(400)) == pytest.approx((0.6, 0.2))  # EXAMPLES.md


def test_mix_and_prob_together_is_an_error() -> None:
    text = problems_of(under(MIXUP, MIX={"ENABLED": False}, PROB={"ENABLED": False}))
    assert names(text, MIXUP) or names(text, f"{MIXUP}.MIX")
    assert "MIX" in text
    assert "PROB" in text
    assert "unknown key" not in text  # MIX is a known spelling: the error is about having both


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("digits_default", True),  # the default
        ("run-1.v2_b", True),  # letters, digits, '.', '_', '-'
        ("A", True),  # a single character
        ("", False),  # empty: would write into BASE_DIR itself
        (".", False),  # BASE_DIR itself
        ("..", False),  # the parent of BASE_DIR
        ("a/b", False),  # a path, not a name
        ("../escape", False),  # escapes BASE_DIR
        ("/abs", False),  # absolute path
        ("a\x00b", False),  # NUL cannot be in a file name
    ],
)
def test_experiment_name_must_be_a_usable_directory_name(name: str, ok: bool) -> None:
    data = nested("EXPERIMENT.NAME", name)
    if ok:
        assert validate_config(data).output_dir == Path("outputs") / name
    else:
        assert_names_all(problems_of(data), ["EXPERIMENT.NAME"])


@pytest.mark.parametrize(
    ("metric", "canonical", "mode"),
    [
        ("val_loss", "val/loss", "min"),  # linnaeus' spelling is canonicalised
        ("val/loss", "val/loss", "min"),  # already canonical
        ("val/acc1", "val/acc1", "max"),  # not a loss: higher is better
    ],
)
def test_early_stop_metric_is_canonicalised(metric: str, canonical: str, mode: str) -> None:
    early = validate_config(nested("TRAIN.EARLY_STOP.METRIC", metric)).TRAIN.EARLY_STOP
    assert (early.METRIC, early.mode) == (canonical, mode)


@pytest.mark.parametrize(
    ("data", "key"),
    [
        (nested("TRAIN.ACCUMULATION_STEPS", "four"), "TRAIN.ACCUMULATION_STEPS"),  # not a number
        (nested("TRAIN.EPOCHS", 0), "TRAIN.EPOCHS"),  # no training
        (under(VALIDATION, INTERVAL_EPOCHS=1.5), f"{VALIDATION}.INTERVAL_EPOCHS"),  # whole epochs only
        (nested("LR_SCHEDULER.NAME", "cosin"), "LR_SCHEDULER.NAME"),  # not a schedule
        (nested("LR_SCHEDULER.BASE_LR", 0), "LR_SCHEDULER.BASE_LR"),  # LR must be positive
        ({"TRAIN": 5}, "TRAIN"),  # a section given as a scalar
        (nested("TRAIN.TARGET_TOKENS", 0), "TRAIN.TARGET_TOKENS"),  # no tokens
        (nested("TRAIN.TARGET_TOKENS", -5), "TRAIN.TARGET_TOKENS"),  # negative
        (nested("TRAIN.TARGET_TOKENS", 2.5), "TRAIN.TARGET_TOKENS"),  # a token count is whole
        (nested("TRAIN.TARGET_TOKENS", "1M"), "TRAIN.TARGET_TOKENS"),  # not a number
        (nested("TASK.NAME", 5), "TASK.NAME"),  # a name is a string
        (nested("TASK.LABEL_SMOOTHING", 1.0), "TASK.LABEL_SMOOTHING"),  # 1 would make every target uniform
        (nested("TASK.LABEL_SMOOTHING", -0.1), "TASK.LABEL_SMOOTHING"),  # below 0
        (nested("TASK.LABEL_SMOOTHING", float("nan")), "TASK.LABEL_SMOOTHING"),  # YAML .nan
        (nested("TASK.FLOPS_PER_TOKEN", 0), "TASK.FLOPS_PER_TOKEN"),  # FLOPs are positive
        (nested("TASK.FLOPS_PER_SAMPLE", -1e9), "TASK.FLOPS_PER_SAMPLE"),
        (nested("TASK.INPUT_KEY", ["image"]), "TASK.INPUT_KEY"),  # one key, not a list
        (nested("ENV.PEAK_FLOPS", 0), "ENV.PEAK_FLOPS"),  # a device with no FLOP/s
        (nested("ENV.PEAK_FLOPS", -989e12), "ENV.PEAK_FLOPS"),  # negative
        (nested("ENV.PEAK_FLOPS", float("inf")), "ENV.PEAK_FLOPS"),  # YAML .inf
        (nested("ENV.PEAK_FLOPS", "989e12"), "ENV.PEAK_FLOPS"),  # a quoted number is a string
    ],
)
def test_bad_field_value_names_the_key(data: dict[str, Any], key: str) -> None:
    error = config_error(data)
    assert len(error.problems) == 1, error
    assert_names_all(str(error), [key])


# ---------------------------------------------------------------------------------------------
# every problem of a config is reported together, in one ConfigError

MANY_PROBLEMS: dict[str, Any] = {
    "EXPERIMENT": {"NAME": "a/b"},  # bad directory name
    "DATA": {"BATCH_SZE": 32},  # typo
    "TRAIN": {"EPOCHS": 0, "ACCUMULATION_STEPS": 4},  # bad field in TRAIN ...
    "LOSS": {"GRAD_WEIGHTING": {"TASK": {"GRADNORM_ENABLED": True, "UPDATE_INTERVAL": 2}}},  # ... + GradNorm
    "LR_SCHEDULER": {"WARMUP_STEPS": 30, "WARMUP_FRACTION": 0.1, "BASE_LR": -1},  # rule + bad field
    "SCHEDULE": {
        "VALIDATION": {"INTERVAL_EPOCHS": 0},  # interval 0
        "CHECKPOINT": {"INTERVAL_FRACTION": 1.5},  # fraction > 1
        "MIXUP": {"LEVEL_SWITCH_STEPS": [5], "ALPHA": 0},  # rule + bad field
    },
}
MANY_PROBLEM_KEYS = [
    "EXPERIMENT.NAME",
    "DATA.BATCH_SZE",
    "TRAIN.EPOCHS",
    "LOSS.GRAD_WEIGHTING.TASK.UPDATE_INTERVAL",
    "TRAIN.ACCUMULATION_STEPS",
    "LR_SCHEDULER.WARMUP_STEPS",
    "LR_SCHEDULER.WARMUP_FRACTION",
    "LR_SCHEDULER.BASE_LR",
    "SCHEDULE.VALIDATION.INTERVAL_EPOCHS",
    "SCHEDULE.CHECKPOINT.INTERVAL_FRACTION",
    "SCHEDULE.MIXUP.LEVEL_SWITCH_STEPS",
    "SCHEDULE.MIXUP.ALPHA",
]


def test_every_problem_is_reported_in_one_error() -> None:
    error = config_error(MANY_PROBLEMS)
    text = str(error)
    assert_names_all(text, MANY_PROBLEM_KEYS)
    problem_keys = " | ".join(key for key, _ in error.problems)
    assert_names_all(problem_keys, MANY_PROBLEM_KEYS)
    # one entry per problem, none repeated: 10 (GradNorm and WARMUP_* each concern two keys)
    assert len(error.problems) == 10, text
    assert text.startswith("invalid config (10 problems)")


@pytest.mark.parametrize(
    ("data", "keys"),
    [
        pytest.param(  # an out-of-range fraction does not hide that a second unit is set too
            under(LR, WARMUP_STEPS=30, WARMUP_FRACTION=1.5),
            [f"{LR}.WARMUP_STEPS", f"{LR}.WARMUP_FRACTION"],
            id="fraction-hides-unit-conflict",
        ),
        pytest.param(  # MIX + PROB does not hide the other problems of SCHEDULE.MIXUP
            under(MIXUP, MIX={"ENABLED": False}, PROB={}, ALPHA=-1),
            [MIXUP, f"{MIXUP}.ALPHA"],
            id="mix-prob-hides-mixup-field",
        ),
        pytest.param(  # a bad parameter group does not hide a rule of LR_SCHEDULER itself
            under(LR, NAME="step", PARAMETER_GROUPS=[group("default")]),
            [f"{GROUPS}.0.LABEL", f"{LR}.DECAY_STEPS"],
            id="group-rule-hides-lr-rule",
        ),
        pytest.param(  # a bad parameter group does not hide the duplicate labels of two other groups
            groups(group("a", MATCH=[]), group("x"), group("x")),
            [f"{GROUPS}.0.MATCH", f"{GROUPS}.2.LABEL"],
            id="group-rule-hides-duplicate-label",
        ),
        pytest.param(  # a bad field does not hide a rule of the same section
            under("TRAIN.EARLY_STOP", ACTIVE=True, MIN_DELTA=-1),
            ["TRAIN.EARLY_STOP.ACTIVE", "TRAIN.EARLY_STOP.MIN_DELTA"],
            id="field-hides-early-stop-rule",
        ),
        pytest.param(  # a bad probability does not hide the missing END_* of the same ramp
            under("SCHEDULE.META_MASKING", ENABLED=True, START_PROB=2),
            ["SCHEDULE.META_MASKING.START_PROB", "SCHEDULE.META_MASKING.END_STEPS"],
            id="probability-hides-missing-end",
        ),
        pytest.param(  # a bad field in LOSS does not hide the GradNorm rule
            nested(
                f"{GRADNORM}.GRADNORM_ENABLED",
                True,
                f"{GRADNORM}.UPDATE_INTERVAL",
                2,
                "LOSS.TASK_WEIGHTS",
                [-1.0],
                "TRAIN.ACCUMULATION_STEPS",
                4,
            ),
            ["LOSS.TASK_WEIGHTS.0", f"{GRADNORM}.UPDATE_INTERVAL", "TRAIN.ACCUMULATION_STEPS"],
            id="list-item-hides-gradnorm-rule",
        ),
        pytest.param(  # a bad field does not hide that EPOCHS and TARGET_TOKENS are both set
            under("TRAIN", EPOCHS=3, TARGET_TOKENS=10**6, CLIP_GRAD=-1.0),
            ["TRAIN.CLIP_GRAD", "TRAIN.EPOCHS", "TRAIN.TARGET_TOKENS"],
            id="field-hides-epochs-or-tokens",
        ),
        pytest.param(  # a bad LABEL_SMOOTHING does not hide the FLOPs rule of TASK
            under("TASK", LABEL_SMOOTHING=2.0, FLOPS_PER_TOKEN=1e9, FLOPS_PER_SAMPLE=1e9),
            ["TASK.LABEL_SMOOTHING", "TASK.FLOPS_PER_TOKEN", "TASK.FLOPS_PER_SAMPLE"],
            id="field-hides-flops-rule",
        ),
    ],
)
def test_one_problem_does_not_hide_another(data: dict[str, Any], keys: list[str]) -> None:
    assert_names_all(problems_of(data), keys)


# ---------------------------------------------------------------------------------------------
# loading YAML files: BASE inheritance, --opts, errors


def test_default_config_loads(default_config_path: Path) -> None:
    config = load_config(default_config_path)
    assert config.output_dir == Path("outputs/digits_default")
    assert config.TRAIN.EPOCHS == 20
    assert config.LR_SCHEDULER.NAME == "wsd"


def test_base_is_relative_to_the_file_and_merged_deeply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(
        tmp_path / "bases" / "base.yaml",
        "TRAIN:\n  EPOCHS: 5\n  ACCUMULATION_STEPS: 2\n"
        "LR_SCHEDULER:\n  NAME: wsd\n  BASE_LR: 0.5\n"
        "SCHEDULE:\n  VALIDATION:\n    INTERVAL_EPOCHS: 2\n    MASK_META_INTERVAL_EPOCHS: 3\n",
    )
    child = write(
        tmp_path / "exp" / "child.yaml",
        "BASE: [../bases/base.yaml]\n"
        "TRAIN:\n  EPOCHS: 7\n"  # nested override wins ...
        "SCHEDULE:\n  VALIDATION:\n    INTERVAL_EPOCHS: 1\n",
    )
    monkeypatch.chdir(tmp_path)  # BASE is read relative to the file, not to the working directory
    config = load_config(child)
    assert config.TRAIN.EPOCHS == 7
    assert config.TRAIN.ACCUMULATION_STEPS == 2  # ... and its siblings stay (deep merge)
    assert (config.LR_SCHEDULER.NAME, config.LR_SCHEDULER.BASE_LR) == ("wsd", 0.5)
    assert config.SCHEDULE.VALIDATION.INTERVAL_EPOCHS == 1
    assert config.SCHEDULE.VALIDATION.MASK_META_INTERVAL_EPOCHS == 3


def test_base_chain_and_several_bases(tmp_path: Path, default_config_path: Path) -> None:
    write(tmp_path / "a.yaml", f"BASE: {default_config_path}\nTRAIN:\n  EPOCHS: 3\nDATA:\n  BATCH_SIZE: 8\n")
    write(tmp_path / "b.yaml", "TRAIN:\n  EPOCHS: 4\n")
    child = write(tmp_path / "child.yaml", "BASE: [a.yaml, b.yaml]\nEXPERIMENT:\n  NAME: child\n")
    config = load_config(child)
    assert config.TRAIN.EPOCHS == 4  # a later base overrides an earlier one
    assert config.DATA.BATCH_SIZE == 8  # from a.yaml
    assert config.LR_SCHEDULER.BASE_LR == 0.002  # from the default config, two levels down
    assert config.output_dir == Path("outputs/child")


def test_base_cycle_is_a_config_error(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", "BASE: [b.yaml]\n")
    write(tmp_path / "b.yaml", "BASE: [a.yaml]\n")
    with pytest.raises(ConfigError, match="BASE"):
        load_config(tmp_path / "a.yaml")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (None, "cannot read"),  # the file does not exist
        ("TRAIN: [unclosed\n", "not valid YAML"),  # broken YAML
        ("TRAIN:\n  EPOCHS: 3\n    BATCH: 2\n", "not valid YAML"),  # bad indentation
        ("- TRAIN\n- DATA\n", "mapping"),  # a list, not sections
        ("BASE: [missing.yaml]\n", "missing.yaml"),  # a BASE that does not exist
        ("BASE: 5\n", "must be a file path or a list of them"),  # a BASE that is not a path
        ("BASE: [5]\n", "must be a file path or a list of them"),  # a list holding a non-path
    ],
)
def test_unreadable_config_is_a_config_error(tmp_path: Path, text: str | None, says: str) -> None:
    path = tmp_path / "cfg.yaml"
    if text is not None:
        write(path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert says in str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        "",  # an empty file
        "# only a comment\n",  # nothing but comments
        "null\n",  # an explicit null document
        "{}\n",  # an empty mapping
        "BASE: []\n",  # inherits nothing and sets nothing
    ],
)
def test_a_file_that_sets_nothing_is_a_config_error(tmp_path: Path, text: str) -> None:
    # Every default on its own is never a real run: most likely the wrong or a truncated file.
    with pytest.raises(ConfigError, match="sets nothing"):
        load_config(write(tmp_path / "empty.yaml", text))


def test_no_config_at_all_is_the_built_in_defaults() -> None:
    # The Python API may still start from the built-in defaults, explicitly.
    assert load_config() == Config()
    assert load_config({}) == Config()


@pytest.mark.parametrize(
    ("opts", "read"),
    [
        (["TRAIN.EPOCHS", "3"], lambda c: c.TRAIN.EPOCHS == 3),  # an int
        (["LR_SCHEDULER.BASE_LR", "1e-3"], lambda c: c.LR_SCHEDULER.BASE_LR == 0.001),  # 1e-3 is a number
        (["LR_SCHEDULER.MIN_LR", "2.5e-6"], lambda c: c.LR_SCHEDULER.MIN_LR == 2.5e-6),  # float with exponent
        (["LR_SCHEDULER.WARMUP_LR", "0.0001"], lambda c: c.LR_SCHEDULER.WARMUP_LR == 0.0001),  # plain float
        (  # a list of lists
            ["SCHEDULE.VALIDATION.PARTIAL_MASK_META.WHITELIST", "[[ROWS],[COLS, MOMENTS]]"],
            lambda c: c.SCHEDULE.VALIDATION.PARTIAL_MASK_META.WHITELIST == [["ROWS"], ["COLS", "MOMENTS"]],
        ),
        (["SCHEDULE.MIXUP.PROB.ENABLED", "false"], lambda c: c.SCHEDULE.MIXUP.PROB.ENABLED is False),  # bool
        (  # a bool (early stopping needs a condition too)
            ["TRAIN.EARLY_STOP.ACTIVE", "true", "TRAIN.EARLY_STOP.PATIENCE_STEPS", "300"],
            lambda c: c.TRAIN.EARLY_STOP.ACTIVE is True,
        ),
        (["LR_SCHEDULER.NAME", "cosine"], lambda c: c.LR_SCHEDULER.NAME == "cosine"),  # a string
        (["EXPERIMENT.NAME", "run2"], lambda c: c.output_dir == Path("outputs/run2")),  # moves the output
        (  # several pairs, the last one of a key wins
            ["TRAIN.EPOCHS", "3", "TRAIN.EPOCHS", "4", "DATA.BATCH_SIZE", "16"],
            lambda c: (c.TRAIN.EPOCHS, c.DATA.BATCH_SIZE) == (4, 16),
        ),
        (  # a section the file does not have
            [f"{GRADNORM}.GRADNORM_ENABLED", "true"],
            lambda c: c.LOSS.GRAD_WEIGHTING.TASK.GRADNORM_ENABLED is True,
        ),
        (  # null: the built-in default of 10 epochs, not 20
            ["TRAIN.EPOCHS", "null"],
            lambda c: (c.TRAIN.EPOCHS, c.TRAIN.epochs) == (None, 10),
        ),
        (  # null unsets EPOCHS, so the run can be measured in tokens instead
            ["TRAIN.EPOCHS", "null", "TRAIN.TARGET_TOKENS", "1000000"],
            lambda c: (c.TRAIN.EPOCHS, c.TRAIN.TARGET_TOKENS, c.TRAIN.epochs) == (None, 1_000_000, None),
        ),
        (  # null unsets a unit, so another one can be used
            ["LR_SCHEDULER.WARMUP_FRACTION", "null", "LR_SCHEDULER.WARMUP_STEPS", "10"],
            lambda c: (c.LR_SCHEDULER.WARMUP_FRACTION, c.LR_SCHEDULER.WARMUP_STEPS) == (None, 10),
        ),
        (  # null on a key that is not set is harmless
            ["LR_SCHEDULER.DECAY_STEPS", "null"],
            lambda c: c.LR_SCHEDULER.DECAY_STEPS is None,
        ),
    ],
)
def test_opts_override_the_file(default_config_path: Path, opts: list[str], read: Any) -> None:
    assert read(load_config(default_config_path, opts))


def test_opts_are_validated_like_the_file(default_config_path: Path) -> None:
    # the default config sets WARMUP_FRACTION; adding WARMUP_STEPS without unsetting it conflicts
    with pytest.raises(ConfigError) as info:
        load_config(default_config_path, ["LR_SCHEDULER.WARMUP_STEPS", "10", "TRAIN.EPOCS", "3"])
    assert_names_all(
        str(info.value), ["LR_SCHEDULER.WARMUP_STEPS", "LR_SCHEDULER.WARMUP_FRACTION", "TRAIN.EPOCS"]
    )


@pytest.mark.parametrize(
    "opts",
    [
        ["TRAIN.EPOCHS"],  # a key without a value
        ["TRAIN.EPOCHS", "3", "DATA.BATCH_SIZE"],  # the last key has no value
    ],
)
def test_odd_number_of_opts_is_an_error(default_config_path: Path, opts: list[str]) -> None:
    with pytest.raises(ConfigError, match=re.escape(opts[-1])):
        load_config(default_config_path, opts)


def test_opts_through_a_value_is_an_error() -> None:
    with pytest.raises(ConfigError, match=re.escape("TRAIN.EPOCHS.X")):
        apply_opts({"TRAIN": {"EPOCHS": 3}}, ["TRAIN.EPOCHS.X", "1"])


def test_apply_opts_leaves_its_input_alone() -> None:
    data = {"TRAIN": {"EPOCHS": 3}}
    assert apply_opts(data, ["TRAIN.EPOCHS", "null", "DATA.BATCH_SIZE", "4"]) == {
        "TRAIN": {"EPOCHS": None},  # null is YAML null, as in a file (tests/test_opts_null.py)
        "DATA": {"BATCH_SIZE": 4},
    }
    assert data == {"TRAIN": {"EPOCHS": 3}}


# ---------------------------------------------------------------------------------------------
# the CLI on a bad config: exit 2, one message naming every bad key, no traceback, nothing written

BAD_CONFIG_KEYS = [
    "TRAIN.EPCHS",
    "LR_SCHEDULER.WARMUP_STEPS",
    "LR_SCHEDULER.WARMUP_FRACTION",
    "SCHEDULE.VALIDATION.INTERVAL_EPOCHS",
    "LOSS.GRAD_WEIGHTING.TASK.UPDATE_INTERVAL",
    "TRAIN.ACCUMULATION_STEPS",
]


@pytest.fixture
def bad_config(tmp_path: Path, default_config_path: Path) -> Path:
    return write(
        tmp_path / "bad.yaml",
        f"BASE: [{default_config_path}]\n"
        "TRAIN:\n  EPCHS: 3\n  ACCUMULATION_STEPS: 4\n"
        "LOSS:\n  GRAD_WEIGHTING:\n    TASK:\n      GRADNORM_ENABLED: true\n      UPDATE_INTERVAL: 2\n"
        "LR_SCHEDULER:\n  WARMUP_STEPS: 30\n"  # the default config sets WARMUP_FRACTION
        "SCHEDULE:\n  VALIDATION:\n    INTERVAL_EPOCHS: 0\n",
    )


def test_cli_bad_config_exits_2_with_one_message(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, bad_config: Path
) -> None:
    out_dir = tmp_path / "runs"
    rc, out, err = run_cli(capsys, "plan", "--cfg", str(bad_config), *out_dir_opts(out_dir))
    assert rc == EXIT_CONFIG_ERROR == 2
    assert_names_all(err, BAD_CONFIG_KEYS)
    assert err.count("linnaeus-accel:") == 1  # one message ...
    assert err.count("invalid config") == 1
    assert "Traceback" not in err
    assert out == ""
    assert not out_dir.exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--cfg", "does/not/exist.yaml"], "cannot read"),  # missing file
        (["--cfg", "{config}", "--opts", "TRAIN.EPOCHS"], "TRAIN.EPOCHS"),  # odd number of opts
        (["--cfg", "{config}", "--opts", "TRAIN.EPOCHS", "0"], "TRAIN.EPOCHS"),  # bad value given by --opts
        (["--cfg", "{broken}"], "not valid YAML"),  # invalid YAML
    ],
)
def test_cli_unusable_config_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, default_config_path: Path, args: list[str], says: str
) -> None:
    broken = write(tmp_path / "broken.yaml", "TRAIN: [unclosed\n")
    argv = [a.format(config=default_config_path, broken=broken) for a in args]
    rc, out, err = run_cli(capsys, "plan", *argv, "--dataset-size", "100")
    assert rc == 2, err
    assert says in err
    assert "Traceback" not in err
    assert out == ""


def test_cli_bad_config_in_a_real_process(tmp_path: Path, bad_config: Path) -> None:
    out_dir = tmp_path / "runs"
    proc = subprocess.run(
        [sys.executable, "-m", "linnaeus_accel", "plan", "--cfg", str(bad_config), *out_dir_opts(out_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert_names_all(proc.stderr, BAD_CONFIG_KEYS)
    assert not out_dir.exists()


# ---------------------------------------------------------------------------------------------
# sanity warnings: legal but probably unintended; printed, never fatal

# T = 1000 (10 epochs x 100 optimizer steps); validation and checkpoint every epoch: no warning.
WARNING_BASE: dict[str, Any] = nested(
    "TRAIN.EPOCHS", 10, f"{VALIDATION}.INTERVAL_EPOCHS", 1, "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", 1,
    "DATA.BATCH_SIZE", 128,  # the LR scaled by 128 / 512 = 1/4: the most that is not warned about
)  # fmt: skip
BATCHES = 100

VAL, CKPT = VALIDATION, "SCHEDULE.CHECKPOINT"
STEPS_CKPT = [f"{CKPT}.INTERVAL_EPOCHS", "null", f"{CKPT}.INTERVAL_STEPS", "100"]
NO_VAL_EPOCHS = [f"{VAL}.INTERVAL_EPOCHS", "null"]
PARTIAL_VAL_ON = [f"{VAL}.PARTIAL_MASK_META.ENABLED", "true", f"{VAL}.PARTIAL_MASK_META.WHITELIST", "[[A]]"]


def lr_phases(name: str, stable: str, decay: str) -> list[str]:
    return [
        "LR_SCHEDULER.NAME",
        name,
        "LR_SCHEDULER.STABLE_DURATION_FRACTION",
        stable,
        "LR_SCHEDULER.DECAY_DURATION_FRACTION",
        decay,
    ]


# what each kind of warning looks like
WARNING_KINDS = {
    "long validation": lambda w: f"{VAL}.INTERVAL_" in w and "quarter" in w,
    "long mask-meta": lambda w: f"{VAL}.MASK_META_INTERVAL_" in w and "quarter" in w,
    "long partial": lambda w: f"{VAL}.PARTIAL_MASK_META.INTERVAL_" in w and "quarter" in w,
    "long checkpoint": lambda w: f"{CKPT}.INTERVAL_" in w and "quarter" in w,
    "mixed units": lambda w: "mix" in w and "epochs" in w and "steps" in w and "quarter" not in w,
    "no validation": lambda w: w.startswith(VAL) and "never validated" in w,
    "no checkpoint": lambda w: w.startswith(CKPT) and "final epoch" in w and "quarter" not in w,
    "lr scale": lambda w: w.startswith("LR_SCHEDULER.REFERENCE_BS: the peak LR is"),
    "wsd over 1": lambda w: "STABLE_DURATION_FRACTION" in w and "DECAY_DURATION_FRACTION" in w,
    "early stop off": lambda w: w.startswith("TRAIN.EARLY_STOP.") and "ACTIVE is false, so" in w,
}
EARLY = "TRAIN.EARLY_STOP"


@pytest.mark.parametrize(
    ("opts", "expected"),
    [
        ([], set()),  # the base: nothing to warn about
        ([f"{VAL}.INTERVAL_EPOCHS", "3"], {"long validation"}),  # 300 steps > 1000 / 4
        ([f"{VAL}.INTERVAL_EPOCHS", "2"], set()),  # 200 steps: fine
        (["TRAIN.EPOCHS", "3"], set()),  # every epoch of a 3-epoch run: as often as boundaries come
        ([*NO_VAL_EPOCHS, f"{VAL}.INTERVAL_STEPS", "250", *STEPS_CKPT], set()),  # exactly a quarter
        ([*NO_VAL_EPOCHS, f"{VAL}.INTERVAL_STEPS", "251", *STEPS_CKPT], {"long validation"}),  # just over
        (  # a fraction is measured in steps too: 0.3 -> 300 steps
            [*NO_VAL_EPOCHS, f"{VAL}.INTERVAL_FRACTION", "0.3", *STEPS_CKPT],
            {"long validation"},
        ),
        ([f"{VAL}.MASK_META_INTERVAL_EPOCHS", "4"], {"long mask-meta"}),  # mask-meta validation
        (  # partial-mask validation
            [*PARTIAL_VAL_ON, f"{VAL}.PARTIAL_MASK_META.INTERVAL_EPOCHS", "3"],
            {"long partial"},
        ),
        ([f"{VAL}.PARTIAL_MASK_META.INTERVAL_EPOCHS", "3"], set()),  # ... not when it is disabled
        ([f"{CKPT}.INTERVAL_EPOCHS", "5"], {"long checkpoint"}),  # checkpoints
        (STEPS_CKPT, {"mixed units"}),  # validation in epochs, checkpoints in steps
        ([f"{VAL}.MASK_META_INTERVAL_STEPS", "100"], {"mixed units"}),  # one step interval among epochs
        ([*NO_VAL_EPOCHS, f"{VAL}.INTERVAL_FRACTION", "0.1", *STEPS_CKPT], set()),  # fraction counts as steps
        (NO_VAL_EPOCHS, {"no validation"}),  # validation never runs
        ([*NO_VAL_EPOCHS, f"{VAL}.INTERVAL_FRACTION", "0"], {"no validation"}),  # fraction 0 disables it
        ([f"{CKPT}.INTERVAL_EPOCHS", "null"], {"no checkpoint"}),  # only the final checkpoint
        ([*NO_VAL_EPOCHS, f"{CKPT}.INTERVAL_EPOCHS", "null"], {"no validation", "no checkpoint"}),  # both
        (["LR_SCHEDULER.REFERENCE_BS", "256"], set()),  # not linnaeus' 512: a choice, scale 1/2
        (["LR_SCHEDULER.REFERENCE_BS", "128"], set()),  # BASE_LR written at the run's batch: scale 1
        (["LR_SCHEDULER.REFERENCE_BS", "512"], set()),  # 512 given explicitly
        (["LR_SCHEDULER.REFERENCE_BS", "null"], set()),  # scaling off
        (["DATA.BATCH_SIZE", "127"], {"lr scale"}),  # the LR scaled by just under 1/4
        (["DATA.BATCH_SIZE", "2048"], set()),  # 4x
        (["DATA.BATCH_SIZE", "2049"], {"lr scale"}),  # just over 4x
        (["DATA.BATCH_SIZE", "8", "LR_SCHEDULER.REFERENCE_BS", "null"], set()),  # scaling off: nothing
        (["LR_SCHEDULER.REFERENCE_BS", "8192"], {"lr scale"}),  # 1/64 of BASE_LR: one warning says both
        (lr_phases("wsd", "0.8", "0.3"), {"wsd over 1"}),  # wsd stable + decay > 1: decay cut off
        (lr_phases("wsd", "0.8", "0.2"), set()),  # exactly 1
        (lr_phases("cosine", "0.8", "0.3"), set()),  # the wsd fractions do not matter for cosine
        ([f"{EARLY}.MAX_STEPS", "500"], {"early stop off"}),  # a condition while ACTIVE is false
        ([f"{EARLY}.MAX_LOSS", "9", f"{EARLY}.MIN_LR", "0"], {"early stop off"}),  # one warning for both
        ([f"{EARLY}.ACTIVE", "true", f"{EARLY}.MAX_STEPS", "500"], set()),  # checked: nothing to say
        ([f"{EARLY}.METRIC", "val/acc", f"{EARLY}.MIN_DELTA", "0.1"], set()),  # not conditions
    ],
)
def test_sanity_warnings(opts: list[str], expected: set[str]) -> None:
    config = validate_config(apply_opts(WARNING_BASE, opts))
    warnings = resolve_plan(config, BATCHES, world_size=1).warnings
    found = {kind for kind, matches in WARNING_KINDS.items() if any(matches(w) for w in warnings)}
    assert found == expected, warnings
    assert len(warnings) == len(expected), warnings  # nothing else, nothing twice


def test_a_condition_set_while_early_stopping_is_off_is_warned_of_naming_both_keys() -> None:
    def warnings(*opts: str) -> tuple[str, ...]:
        config = validate_config(apply_opts(WARNING_BASE, list(opts)))
        return resolve_plan(config, BATCHES, world_size=1).warnings

    assert warnings(f"{EARLY}.MAX_STEPS", "500") == (
        "TRAIN.EARLY_STOP.MAX_STEPS is set but TRAIN.EARLY_STOP.ACTIVE is false, so it is never checked: set "
        "TRAIN.EARLY_STOP.ACTIVE: true to stop on it, or leave it out",
    )
    assert warnings(f"{EARLY}.PATIENCE_STEPS", "300", f"{EARLY}.MAX_GRAD_NORM", "10") == (
        "TRAIN.EARLY_STOP.PATIENCE_STEPS and TRAIN.EARLY_STOP.MAX_GRAD_NORM are set but TRAIN.EARLY_STOP.ACTIVE "
        "is false, so they are never checked: set TRAIN.EARLY_STOP.ACTIVE: true to stop on them, or leave them out",
    )


def test_train_prints_the_lr_scale_warning_and_records_it_in_summary_json(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, default_config_path: Path
) -> None:
    """A transformers user's BASE_LR 1e-3 at an effective batch of 8 trains at 1.56e-5 (under the
    default REFERENCE_BS 512): said at the start of the run, and kept in summary.json's warnings; as
    is a MAX_STEPS that early stopping, off, never checks."""
    import json

    opts = [
        "ENV.OUTPUT.BASE_DIR",
        str(tmp_path),
        "TRAIN.EPOCHS",
        "1",
        "DATA.BATCH_SIZE",
        "8",
        "LR_SCHEDULER.BASE_LR",
        "1e-3",
        "LR_SCHEDULER.REFERENCE_BS",
        "512",  # the default: the config file's 32 is its own BASE_LR's
        "TRAIN.EARLY_STOP.MAX_STEPS",
        "10",
    ]
    reset_accelerate()
    try:
        rc, out, err = run_cli(capsys, "train", "--cfg", str(default_config_path), "--opts", *opts)
    finally:
        reset_accelerate()
    assert rc == 0, err
    warning = (
        "LR_SCHEDULER.REFERENCE_BS: the peak LR is 1.56e-05, not BASE_LR 0.001: BASE_LR is scaled by effective batch "
        "8 / REFERENCE_BS 512 = 0.015625; set LR_SCHEDULER.REFERENCE_BS: null to train at BASE_LR as written"
    )
    assert (
        out.index("Warnings:") < out.index(f"  - {warning}\n") < out.index("epoch 1 step")
    )  # before training
    summary = json.loads((tmp_path / "digits_default" / "summary.json").read_text())
    assert warning in summary["warnings"]
    ignored = "TRAIN.EARLY_STOP.MAX_STEPS is set but TRAIN.EARLY_STOP.ACTIVE is false, so it is never checked"
    assert out.index("Warnings:") < out.index(f"  - {ignored}") < out.index("epoch 1 step")
    assert any(w.startswith(ignored) for w in summary["warnings"])
    assert summary["global_step"] > 10  # never checked, indeed


def test_cli_prints_warnings_and_still_succeeds(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, default_config_path: Path
) -> None:
    out_dir = tmp_path / "runs"
    rc, out, err = run_cli(
        capsys,
        "plan",
        "--cfg",
        str(default_config_path),
        "--dataset-size",
        "3200",
        "--opts",
        "ENV.OUTPUT.BASE_DIR",
        str(out_dir),
        "LR_SCHEDULER.REFERENCE_BS",
        "256",
        "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS",
        "null",
        "SCHEDULE.VALIDATION.INTERVAL_EPOCHS",
        "null",
    )
    assert rc == 0, err
    warning_lines = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warning_lines) == 3, err
    assert any("REFERENCE_BS" in line for line in warning_lines)
    assert "Schedule summary" in out
    assert not out_dir.exists()


@pytest.mark.parametrize(
    ("yaml_text", "expected_base_lr"),
    [
        ("LR_SCHEDULER:\n  BASE_LR: 1e-3\n", 0.001),  # YAML 1.1 would read 1e-3 as a string
        ("LR_SCHEDULER:\n  BASE_LR: 2.5E-4\n", 0.00025),  # upper-case exponent with a dot
        ("LR_SCHEDULER:\n  BASE_LR: 3\n", 3.0),  # an int is a fine float
    ],
)
def test_yaml_numbers_with_exponents_are_floats(
    tmp_path: Path, yaml_text: str, expected_base_lr: float
) -> None:
    config = load_config(write(tmp_path / "c.yaml", yaml_text))
    assert config.LR_SCHEDULER.BASE_LR == expected_base_lr


@pytest.mark.parametrize(
    ("data", "key"),
    [
        (under(VALIDATION, INTERVAL_EPOCHS=True), f"{VALIDATION}.INTERVAL_EPOCHS"),  # a bool is not a count
        (under("DATA", BATCH_SIZE="32"), "DATA.BATCH_SIZE"),  # a quoted number is a string, not a size
        (under("TRAIN", AUTO_RESUME="yes please"), "TRAIN.AUTO_RESUME"),  # not a bool
    ],
)
def test_values_of_the_wrong_type_are_errors(data: dict[str, Any], key: str) -> None:
    assert_names_all(problems_of(data), [key])


def test_options_belong_to_the_dataset_or_model_they_were_given_for(tmp_path: Path) -> None:
    # A base config's token_files options do not leak into a mixture built over it (BASE), nor
    # into another dataset named with --opts; the same dataset's options still merge.
    base = tmp_path / "base.yaml"
    base.write_text(
        "DATA:\n  DATASET:\n    NAME: python_docs\n    OPTIONS: {seq_len: 65}\n"
        "MODEL:\n  TYPE: digits_mlp\n  OPTIONS: {hidden: 16}\n"
    )
    child = tmp_path / "child.yaml"
    child.write_text("BASE: [base.yaml]\nDATA:\n  DATASET:\n    NAME: mixture\n    OPTIONS: {sources: []}\n")
    data = read_yaml(child)
    assert data["DATA"]["DATASET"] == {"NAME": "mixture", "OPTIONS": {"sources": []}}
    assert data["MODEL"]["OPTIONS"] == {"hidden": 16}  # the model was not renamed
    same = apply_opts(read_yaml(base), ["DATA.DATASET.OPTIONS", "{streaming: true}"])
    assert same["DATA"]["DATASET"]["OPTIONS"] == {"seq_len": 65, "streaming": True}
    renamed = apply_opts(
        read_yaml(base), ["DATA.DATASET.NAME", "token_files", "DATA.DATASET.OPTIONS.paths", "x.bin"]
    )
    assert renamed["DATA"]["DATASET"] == {"NAME": "token_files", "OPTIONS": {"paths": "x.bin"}}
    assert apply_opts(read_yaml(base), ["MODEL.TYPE", "digits_mlp"])["MODEL"]["OPTIONS"] == {"hidden": 16}
