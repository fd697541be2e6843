"""``SCHEDULE.META_MASKING`` and ``SCHEDULE.MIXUP``: linnaeus' training-time augmentation, as
probability ramps over the run (a start and an end probability, reached at a position in any unit)
and the partial masking of metadata components."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import AliasChoices, Field

from .base import (
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Probability,
    Problem,
    Section,
    Timed,
    timed,
)


def combination_problems(key: str, combos: list[list[str]]) -> list[Problem]:
    problems = []
    for i, combo in enumerate(combos):
        if not combo:
            problems.append(
                Problem((f"{key}.{i}",), "{0} is an empty combination: list at least one component")
            )
        elif len(set(combo)) != len(combo):
            problems.append(Problem((f"{key}.{i}",), "{0} names a component twice"))
    return problems


class ProbabilityRamp(Section):
    """A probability moving linearly from START_PROB at step 0 to END_PROB at the END step."""

    ENABLED: bool = Field(False, description="Turns the ramp on; off, the probability is 0 at every step.")
    START_PROB: Probability = Field(1.0, description="Probability at global step 0.")
    END_PROB: Probability = Field(0.0, description="Probability from the END step on.")
    END: ClassVar[Timed] = timed(
        steps="Global step at which END_PROB is reached (0: END_PROB from the start); one of END_* is required when ENABLED.",
        fraction="The END step as a fraction of total steps (0: END_PROB from the start).",
        epochs="The END step in epochs (may be fractional).",
    )

    def problems(self) -> list[Problem]:
        because = "when ENABLED is true (the step at which END_PROB is reached)"
        return ProbabilityRamp.END.required(self, because) if self.ENABLED else []


class PartialMetaMasking(Section):
    """Masking one WHITELIST combination of components, within the [START, END) window."""

    ENABLED: bool = Field(
        False,
        description="Turns partial masking on: within the window, a sample not fully masked has one "
        "WHITELIST combination masked with the ramp's probability.",
    )
    START: ClassVar[Timed] = timed(
        steps="Window start in global steps (inclusive); unset: step 0.",
        fraction="Window start as a fraction of total steps; unset: step 0.",
        epochs="Window start in epochs (may be fractional); unset: step 0.",
    )
    END: ClassVar[Timed] = timed(
        steps="Window end in global steps (exclusive); unset: end of training.",
        fraction="Window end as a fraction of total steps (exclusive); unset: end of training.",
        epochs="Window end in epochs (exclusive, may be fractional); unset: end of training.",
    )
    START_PROB: Probability = Field(
        0.0,
        description="Probability at global step 0 (the ramp counts from step 0, not from the window start).",
    )
    END_PROB: Probability = Field(0.0, description="Probability from the PROB_END step on.")
    PROB_END: ClassVar[Timed] = timed(
        steps="Global step at which END_PROB is reached; one of PROB_END_* is required when ENABLED.",
        fraction="The PROB_END step as a fraction of total steps.",
        epochs="The PROB_END step in epochs (may be fractional).",
    )
    WHITELIST: list[list[str]] = Field(
        default_factory=list, description="Component combinations to draw from."
    )
    WEIGHTS: list[NonNegativeFloat] | None = Field(None, description="Draw weights, one per WHITELIST entry.")

    def problems(self) -> list[Problem]:
        problems = combination_problems("WHITELIST", self.WHITELIST)
        if self.ENABLED:
            because = "when ENABLED is true (the step at which END_PROB is reached)"
            problems[:0] = PartialMetaMasking.PROB_END.required(self, because)
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
        start = PartialMetaMasking.START.values(self).get("fraction")
        end = PartialMetaMasking.END.values(self).get("fraction")
        if start is not None and end is not None and start >= end:
            problems.append(
                Problem(
                    ("START_FRACTION", "END_FRACTION"),
                    "{0} must be smaller than {1}: the window would be empty",
                )
            )
        return problems


class MetaMasking(ProbabilityRamp):
    """Probability that all of a training sample's metadata is masked (drawn per sample), moving
    linearly from START_PROB at step 0 to END_PROB at the END step."""

    START_PROB: Probability = Field(1.0, description="Probability at global step 0.")
    END_PROB: Probability = Field(0.05, description="Probability from the END step on.")
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
