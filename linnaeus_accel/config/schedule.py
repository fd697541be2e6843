"""``SCHEDULE``: validation and checkpoint intervals, masking and mixup ramps, logging intervals.

Every timed field comes in units ``_STEPS`` (global optimizer steps), ``_FRACTION`` (of total
steps) or ``_EPOCHS``; exactly one may be set (SPEC §2). Intervals given in epochs fire on
``epoch % N == 0``; in steps or fractions they fire at the first epoch boundary at or after each
multiple (SPEC §5).
"""

from __future__ import annotations

from itertools import chain
from typing import Any

from pydantic import AliasChoices, Field

from .base import (
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Probability,
    Problem,
    Section,
    StepsOrOff,
    merge_problems,
    one_unit_problems,
)

INTERVAL_UNITS = ("EPOCHS", "STEPS", "FRACTION")
POSITION_UNITS = ("STEPS", "FRACTION", "EPOCHS")


def _combination_problems(key: str, combos: list[list[str]]) -> list[Problem]:
    problems = []
    for i, combo in enumerate(combos):
        if not combo:
            problems.append(
                Problem((f"{key}.{i}",), "{0} is an empty combination: list at least one component")
            )
        elif len(set(combo)) != len(combo):
            problems.append(Problem((f"{key}.{i}",), "{0} names a component twice"))
    return problems


class PartialMaskMetaValidation(Section):
    """Validation passes with one WHITELIST combination of metadata components masked each."""

    ENABLED: bool = False
    INTERVAL_EPOCHS: StepsOrOff | None = None
    INTERVAL_STEPS: StepsOrOff | None = None
    INTERVAL_FRACTION: Fraction | None = None
    WHITELIST: list[list[str]] = Field(
        default_factory=list, description="Component combinations, one pass each."
    )

    def problems(self) -> list[Problem]:
        problems = one_unit_problems(self, "INTERVAL", units=INTERVAL_UNITS)
        if self.ENABLED and not self.WHITELIST:
            problems.append(
                Problem(("WHITELIST",), "{0} is empty while ENABLED is true: list the combinations to mask")
            )
        problems += _combination_problems("WHITELIST", self.WHITELIST)
        return problems


class FinalEpochValidation(Section):
    EXHAUSTIVE_PARTIAL_META_VALIDATION: bool = Field(
        False, description="At the final epoch, one pass per non-empty proper subset of the components."
    )
    EXHAUSTIVE_META_COMPONENTS: list[str] = Field(default_factory=list)

    def problems(self) -> list[Problem]:
        problems = []
        comps = self.EXHAUSTIVE_META_COMPONENTS
        if self.EXHAUSTIVE_PARTIAL_META_VALIDATION and len(comps) < 2:
            problems.append(
                Problem(
                    ("EXHAUSTIVE_META_COMPONENTS",),
                    "{0} needs at least 2 components for exhaustive validation",
                )
            )
        if len(set(comps)) != len(comps):
            problems.append(Problem(("EXHAUSTIVE_META_COMPONENTS",), "{0} names a component twice"))
        return problems


class ValidationSchedule(Section):
    INTERVAL_EPOCHS: StepsOrOff | None = Field(None, description="Standard validation every N epochs.")
    INTERVAL_STEPS: StepsOrOff | None = None
    INTERVAL_FRACTION: Fraction | None = None
    MASK_META_INTERVAL_EPOCHS: StepsOrOff | None = Field(None, description="Pass with all metadata masked.")
    MASK_META_INTERVAL_STEPS: StepsOrOff | None = None
    MASK_META_INTERVAL_FRACTION: Fraction | None = None
    PARTIAL_MASK_META: PartialMaskMetaValidation = Field(default_factory=PartialMaskMetaValidation)
    FINAL_EPOCH: FinalEpochValidation = Field(default_factory=FinalEpochValidation)

    def problems(self) -> list[Problem]:
        return merge_problems(
            one_unit_problems(self, "INTERVAL", units=INTERVAL_UNITS),
            one_unit_problems(self, "MASK_META_INTERVAL", units=INTERVAL_UNITS),
        )


class CheckpointSchedule(Section):
    INTERVAL_EPOCHS: StepsOrOff | None = Field(
        None, description="Checkpoint every N epochs (final epoch always)."
    )
    INTERVAL_STEPS: StepsOrOff | None = None
    INTERVAL_FRACTION: Fraction | None = None
    KEEP_TOP_N: NonNegativeInt = Field(
        1, description="Keep the N best by METRIC (0 with KEEP_LAST_N 0: keep all)."
    )
    KEEP_LAST_N: NonNegativeInt = Field(2, description="Keep the N most recent.")
    METRIC: str | None = Field(
        None, description="Ranking metric; default: TRAIN.EARLY_STOP.METRIC, else val/loss."
    )
    MID_EPOCH: bool = Field(
        False,
        description="With INTERVAL_STEPS/_FRACTION: checkpoint at the step itself, mid-epoch, "
        "for very long epochs (otherwise at the first epoch boundary after it).",
    )
    ASYNC: bool = Field(
        False,
        description="Training waits only while the state is copied to host memory (pinned on "
        "CUDA); the files are written, hashed and committed in the background. Costs one more copy "
        "of the model and optimizer state in host memory; DDP or one process only (FSDP and "
        "DeepSpeed save collectively). Off: training waits for Accelerate's save_state, and only "
        "the commit (hashing, fsync, retention, upload) runs in the background.",
    )

    def problems(self) -> list[Problem]:
        problems = one_unit_problems(self, "INTERVAL", units=INTERVAL_UNITS)
        if self.MID_EPOCH and self.INTERVAL_STEPS is None and self.INTERVAL_FRACTION is None:
            problems.append(
                Problem(
                    ("MID_EPOCH",),
                    "{0} needs INTERVAL_STEPS or INTERVAL_FRACTION: the steps at which to checkpoint",
                )
            )
        return problems


class ProbabilityRamp(Section):
    """A probability moving linearly from START_PROB at step 0 to END_PROB at the END step."""

    ENABLED: bool = False
    START_PROB: Probability = 1.0
    END_PROB: Probability = 0.0
    END_STEPS: NonNegativeInt | None = None
    END_FRACTION: Fraction | None = None
    END_EPOCHS: NonNegativeFloat | None = None

    def problems(self) -> list[Problem]:
        required = "when ENABLED is true (the step at which END_PROB is reached)" if self.ENABLED else None
        return one_unit_problems(self, "END", units=POSITION_UNITS, required_because=required)


class PartialMetaMasking(Section):
    """Masking one WHITELIST combination of components, within the [START, END) window."""

    ENABLED: bool = False
    START_STEPS: NonNegativeInt | None = Field(None, description="Window start; unset: step 0.")
    START_FRACTION: Fraction | None = None
    START_EPOCHS: NonNegativeFloat | None = None
    END_STEPS: NonNegativeInt | None = Field(
        None, description="Window end (exclusive); unset: end of training."
    )
    END_FRACTION: Fraction | None = None
    END_EPOCHS: NonNegativeFloat | None = None
    START_PROB: Probability = 0.0
    END_PROB: Probability = 0.0
    PROB_END_STEPS: NonNegativeInt | None = Field(None, description="Step at which END_PROB is reached.")
    PROB_END_FRACTION: Fraction | None = None
    PROB_END_EPOCHS: NonNegativeFloat | None = None
    WHITELIST: list[list[str]] = Field(
        default_factory=list, description="Component combinations to draw from."
    )
    WEIGHTS: list[NonNegativeFloat] | None = Field(None, description="Draw weights, one per WHITELIST entry.")

    def problems(self) -> list[Problem]:
        problems = merge_problems(
            one_unit_problems(self, "START", units=POSITION_UNITS),
            one_unit_problems(self, "END", units=POSITION_UNITS),
            one_unit_problems(
                self,
                "PROB_END",
                units=POSITION_UNITS,
                required_because="when ENABLED is true (the step at which END_PROB is reached)"
                if self.ENABLED
                else None,
            ),
            _combination_problems("WHITELIST", self.WHITELIST),
        )
        if self.ENABLED and not self.WHITELIST:
            problems.append(
                Problem(("WHITELIST",), "{0} is empty while ENABLED is true: list the combinations to mask")
            )
        if self.WEIGHTS is not None:
            if len(self.WEIGHTS) != len(self.WHITELIST):
                problems.append(
                    Problem(
                        ("WEIGHTS", "WHITELIST"),
                        f"{{0}} has {len(self.WEIGHTS)} entries but {{1}} has {len(self.WHITELIST)}: give one weight per combination",
                    )
                )
            elif self.WEIGHTS and sum(self.WEIGHTS) <= 0:
                problems.append(Problem(("WEIGHTS",), "{0} sum to 0: at least one weight must be positive"))
        if (
            self.START_FRACTION is not None
            and self.END_FRACTION is not None
            and self.START_FRACTION >= self.END_FRACTION
        ):
            problems.append(
                Problem(
                    ("START_FRACTION", "END_FRACTION"),
                    "{0} must be smaller than {1}: the window would be empty",
                )
            )
        return problems


class MetaMasking(ProbabilityRamp):
    """Probability that all of a training sample's metadata is masked."""

    START_PROB: Probability = 1.0
    END_PROB: Probability = 0.05
    PARTIAL: PartialMetaMasking = Field(default_factory=PartialMetaMasking)


class Mixup(Section):
    """In-group mixup: only samples sharing the GROUP_LEVELS[0] label are mixed."""

    GROUP_LEVELS: list[str] = Field(
        default_factory=list, description="Label level(s) defining mix groups; [0] used."
    )
    LEVEL_SWITCH_STEPS: list[Any] = Field(default_factory=list, description="Not supported: must stay empty.")
    LEVEL_SWITCH_EPOCHS: list[Any] = Field(
        default_factory=list, description="Not supported: must stay empty."
    )
    # linnaeus' code reads MIX while its docs say PROB: accept either spelling (both together is
    # reported by the loader as a duplicate).
    PROB: ProbabilityRamp = Field(
        default_factory=ProbabilityRamp,
        validation_alias=AliasChoices("PROB", "MIX"),
        description="Probability that a batch is mixed.",
    )
    ALPHA: PositiveFloat = Field(1.0, description="Beta(ALPHA, ALPHA) mixing coefficient.")
    USE_GPU: bool = Field(True, description="Mix on the accelerator (after device placement).")
    MIN_GROUP_SIZE: PositiveInt = Field(4, description="Groups smaller than this in a batch stay unmixed.")
    EXCLUDE_NULL_SAMPLES: bool = Field(True, description="Samples with a null group label are never mixed.")

    def problems(self) -> list[Problem]:
        problems = []
        for key in ("LEVEL_SWITCH_STEPS", "LEVEL_SWITCH_EPOCHS"):
            if getattr(self, key):
                problems.append(
                    Problem(
                        (key,),
                        "{0} must be empty: mixup group-level switching is not supported (GROUP_LEVELS[0] is used all run)",
                    )
                )
        if self.PROB.ENABLED and not self.GROUP_LEVELS:
            problems.append(
                Problem(
                    ("GROUP_LEVELS",),
                    "{0} is empty while PROB.ENABLED is true: name the label level to group by",
                )
            )
        return problems


class MetricsSchedule(Section):
    """How often step metrics are logged (global steps)."""

    STEP_INTERVAL: StepsOrOff | None = Field(None, description="Training metrics every N steps.")
    STEP_FRACTION: Fraction | None = Field(None, description="...or every fraction of training.")
    CONSOLE_INTERVAL: StepsOrOff | None = Field(
        None, description="Console line every N steps; default STEP interval."
    )
    WANDB_INTERVAL: StepsOrOff | None = Field(
        None, description="W&B logging every N steps; default STEP interval."
    )
    LR_INTERVAL: StepsOrOff | None = Field(
        None, description="Per-group LR every N steps; default STEP interval."
    )
    PIPELINE_INTERVAL: StepsOrOff | None = Field(None, description="Data-pipeline stats every N steps.")

    def problems(self) -> list[Problem]:
        return one_unit_problems(self, "STEP", units=("INTERVAL", "FRACTION"))


class ScheduleConfig(Section):
    VALIDATION: ValidationSchedule = Field(default_factory=ValidationSchedule)
    CHECKPOINT: CheckpointSchedule = Field(default_factory=CheckpointSchedule)
    META_MASKING: MetaMasking = Field(default_factory=MetaMasking)
    MIXUP: Mixup = Field(default_factory=Mixup)
    METRICS: MetricsSchedule = Field(default_factory=MetricsSchedule)

    def partial_whitelists(self) -> dict[str, list[list[str]]]:
        """Every component combination the config names, keyed by where it comes from."""
        return {
            "VALIDATION.PARTIAL_MASK_META.WHITELIST": self.VALIDATION.PARTIAL_MASK_META.WHITELIST,
            "META_MASKING.PARTIAL.WHITELIST": self.META_MASKING.PARTIAL.WHITELIST,
            "VALIDATION.FINAL_EPOCH.EXHAUSTIVE_META_COMPONENTS": [
                self.VALIDATION.FINAL_EPOCH.EXHAUSTIVE_META_COMPONENTS
            ],
        }

    def meta_components_used(self) -> set[str]:
        return set(chain.from_iterable(chain.from_iterable(self.partial_whitelists().values())))
