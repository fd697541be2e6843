"""The duration type: a timed parameter read back as one ``Duration`` and resolved into global steps
(docs/semantics.md, section 2), and each section's timed parameters declared once."""

from __future__ import annotations

from typing import Any

import pytest

from linnaeus_accel.config import load_config
from linnaeus_accel.config.duration import Duration, Unit
from linnaeus_accel.config.lr import LRSchedulerConfig
from linnaeus_accel.config.schedule import MetricsSchedule, ValidationSchedule

# (value, unit, total steps T, optimizer steps per epoch (None: unknown), global steps)
RESOLVES = [
    (5, "steps", 1000, 100, 5),  # steps are steps, whatever the run's length
    (0, "steps", 1000, None, 0),  # step 0 (a position), and no epoch length needed
    (0.05, "fraction", 1000, 100, 50),  # 0.05 of T
    (0.15, "fraction", 1010, None, 152),  # 151.5 as written, half up (the binary product is 151.4999...)
    (0.0025, "fraction", 1000, None, 3),  # 2.5 rounds half up, not half to even
    (0.0004, "fraction", 1000, None, 1),  # max(1, round(0.4)): a positive fraction is at least one step
    (0.0, "fraction", 1000, None, 0),  # a fraction of 0 resolves to 0 steps (an interval: never)
    (1.0, "fraction", 7, None, 7),  # the whole run
    (2.5, "epochs", 1000, 100, 250),  # fractional epochs
    (2, "epochs", 1000, 45, 90),  # whole epochs
    (0.1, "epochs", 1000, 5, 1),  # 0.5 rounds half up
    (0.05, "epochs", 1000, 5, 0),  # 0.25 rounds to 0: no max(1, ...) for epochs
    (3.3, "epochs", 1000, 10, 33),  # 3.3 x 10 as written (binary: 32.999...)
]


@pytest.mark.parametrize(("value", "unit", "total", "per_epoch", "expected"), RESOLVES)
def test_a_duration_resolves_into_global_steps(
    value: float, unit: Unit, total: int, per_epoch: int | None, expected: int
) -> None:
    assert Duration(value, unit).steps(total, per_epoch) == expected


def test_epochs_of_unknown_length_cannot_be_resolved() -> None:
    # A stream without __len__: `plan` refuses every *_EPOCHS key before resolving anything.
    with pytest.raises(ValueError, match="epochs of known length"):
        Duration(1.5, "epochs").steps(1000, None)


# (--opts, section of the loaded config, stem, the Duration it reads back as)
READS = [
    (["LR_SCHEDULER.WARMUP_FRACTION", "0.05"], "LR_SCHEDULER", "WARMUP", Duration(0.05, "fraction")),
    (["LR_SCHEDULER.WARMUP_STEPS", "30"], "LR_SCHEDULER", "WARMUP", Duration(30, "steps")),
    (["LR_SCHEDULER.DECAY_EPOCHS", "2.5"], "LR_SCHEDULER", "DECAY", Duration(2.5, "epochs")),
    ([], "LR_SCHEDULER", "WARMUP", None),  # no unit set: no warmup
    (["SCHEDULE.VALIDATION.INTERVAL_EPOCHS", "2"], "SCHEDULE.VALIDATION", "INTERVAL", Duration(2, "epochs")),
    # STEP_INTERVAL is this parameter's unit in steps
    (["SCHEDULE.METRICS.STEP_INTERVAL", "7"], "SCHEDULE.METRICS", "STEP", Duration(7, "steps")),
    (["SCHEDULE.METRICS.STEP_FRACTION", "0.1"], "SCHEDULE.METRICS", "STEP", Duration(0.1, "fraction")),
    (
        ["CALLBACKS", "[{NAME: ema, INTERVAL_FRACTION: 0.0}]"],
        "CALLBACKS.0",
        "INTERVAL",
        Duration(0.0, "fraction"),  # 0 is a value (never), not "unset"
    ),
]


@pytest.mark.parametrize(("opts", "section", "stem", "expected"), READS)
def test_a_timed_parameter_reads_back_as_one_duration(
    opts: list[str], section: str, stem: str, expected: Duration | None
) -> None:
    node: Any = load_config(None, opts)
    for part in section.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    assert getattr(node, stem) == expected


def test_each_timed_parameter_is_declared_once_with_its_keys_in_order() -> None:
    # The declaration's unit order is the keys' order in the section (and in docs/config.md).
    assert list(LRSchedulerConfig.WARMUP.keys.values()) == [
        "WARMUP_STEPS",
        "WARMUP_FRACTION",
        "WARMUP_EPOCHS",
    ]
    assert list(ValidationSchedule.INTERVAL.keys.values()) == [
        "INTERVAL_EPOCHS",
        "INTERVAL_STEPS",
        "INTERVAL_FRACTION",
    ]
    assert list(MetricsSchedule.STEP.keys.values()) == ["STEP_INTERVAL", "STEP_FRACTION"]
    fields = list(ValidationSchedule.model_fields)
    assert fields[: fields.index("PARTIAL_MASK_META")] == [
        "INTERVAL_EPOCHS",
        "INTERVAL_STEPS",
        "INTERVAL_FRACTION",
        "MASK_META_INTERVAL_EPOCHS",
        "MASK_META_INTERVAL_STEPS",
        "MASK_META_INTERVAL_FRACTION",
    ]
