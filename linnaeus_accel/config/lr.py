"""``LR_SCHEDULER``: learning-rate schedule, batch-size scaling and per-parameter-group overrides."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from .base import (
    DecayRate,
    Fraction,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Problem,
    Section,
    Timed,
    period,
    timed,
)

ScheduleName = Literal["cosine", "linear", "step", "wsd"]
DecayType = Literal["cosine", "linear"]


class ParameterGroup(Section):
    """A set of parameters, selected by name pattern, with its own LR curve.

    Unset fields follow the global curve times ``LR_MULTIPLIER``; a set field replaces the
    scaled global value (docs/semantics.md §3).
    """

    LABEL: str = Field("", description="Name shown in logs and metrics (lr/<LABEL>); 'default' is reserved.")
    MATCH: list[str] = Field(
        default_factory=list,
        description="fnmatch patterns on parameter names (model.named_parameters()); "
        "a parameter joins the first group that matches, else the default group.",
    )
    LR_MULTIPLIER: NonNegativeFloat = Field(1.0, description="Multiplies the scaled global curve.")
    NAME: ScheduleName | None = Field(None, description="Schedule shape for this group; default: global.")
    MIN_LR: NonNegativeFloat | None = Field(
        None, description="Absolute floor; default: global MIN_LR x multiplier."
    )
    WARMUP_LR: NonNegativeFloat | None = Field(
        None, description="Absolute warmup start; default: global x multiplier."
    )
    WARMUP: ClassVar[Timed] = timed(
        steps="This group's warmup length in optimizer steps; default: the global warmup.",
        fraction="This group's warmup length as a fraction of total steps; default: the global warmup.",
        epochs="This group's warmup length in epochs (may be fractional); default: the global warmup.",
    )
    DECAY: ClassVar[Timed] = period(
        steps="step schedule: this group's decay period in optimizer steps; default: the global one.",
        fraction="step schedule: this group's decay period as a fraction of total steps; default: the global one.",
        epochs="step schedule: this group's decay period in epochs; default: the global one.",
    )
    DECAY_RATE: DecayRate | None = Field(
        None,
        description="step schedule: this group's multiplier per decay period; default: the global DECAY_RATE.",
    )
    STABLE_DURATION_FRACTION: Fraction | None = Field(
        None,
        description="wsd: this group's share of post-warmup steps held at its peak LR; default: the global one.",
    )
    DECAY_DURATION_FRACTION: Fraction | None = Field(
        None,
        description="wsd: this group's share of post-warmup steps spent decaying; default: the global one.",
    )
    DECAY_TYPE: DecayType | None = Field(
        None, description="wsd: shape of this group's decay phase (cosine | linear); default: the global one."
    )

    def problems(self) -> list[Problem]:
        problems: list[Problem] = []
        if not self.LABEL:
            problems.append(Problem(("LABEL",), "{0} is required: name the group, e.g. 'head'"))
        if self.LABEL == "default":
            problems.append(
                Problem(
                    ("LABEL",), "{0}: 'default' names the group of unmatched parameters; pick another label"
                )
            )
        if not self.MATCH:
            problems.append(
                Problem(("MATCH",), "{0} is empty: give at least one parameter-name pattern, e.g. ['head.*']")
            )
        return problems


class LRSchedulerConfig(Section):
    """The learning-rate curve, a pure function of the global optimizer step (docs/semantics.md §3)."""

    NAME: ScheduleName = Field(
        "cosine",
        description="Shape of the curve after warmup: cosine or linear decay from the scaled BASE_LR towards "
        "MIN_LR, reached at step TOTAL, one past the last update (whose LR is a little above it; "
        "docs/semantics.md gives each formula); step (x DECAY_RATE every DECAY_* period); wsd (warmup-stable-decay: held "
        "for STABLE_DURATION_FRACTION, then DECAY_TYPE decay to MIN_LR over DECAY_DURATION_FRACTION).",
    )
    BASE_LR: PositiveFloat = Field(
        1e-3,
        description="Peak LR at REFERENCE_BS; multiplied by effective batch / REFERENCE_BS (effective batch "
        "= DATA.BATCH_SIZE x processes x TRAIN.ACCUMULATION_STEPS) before any schedule is built.",
    )
    REFERENCE_BS: PositiveInt | None = Field(
        512,
        description="Effective batch size at which BASE_LR applies unscaled; null turns scaling off "
        "(scale 1, BASE_LR as written).",
    )
    MIN_LR: NonNegativeFloat = Field(
        0.0, description="Absolute LR at the end of decay (not scaled); must not exceed the scaled BASE_LR."
    )
    WARMUP_LR: NonNegativeFloat = Field(
        0.0,
        description="Absolute LR at step 0 of warmup (not scaled); must not exceed the scaled BASE_LR. Warmup "
        "is the line WARMUP_LR + (B - WARMUP_LR) x k / W at step k < W (B the scaled peak, W the warmup "
        "steps): with the default 0 the first update has LR 0. nanoGPT and torchtitan start at B / (W + 1): "
        "set WARMUP_LR to that to match them.",
    )
    WARMUP: ClassVar[Timed] = timed(
        steps="Warmup length in optimizer steps (none of WARMUP_*: no warmup).",
        fraction="Warmup length as a fraction of total steps.",
        epochs="Warmup length in epochs (may be fractional).",
    )
    DECAY: ClassVar[Timed] = period(
        steps="step schedule: optimizer steps between decays (NAME step needs one of DECAY_*).",
        fraction="step schedule: decay period as a fraction of total.",
        epochs="step schedule: decay period in epochs.",
    )
    DECAY_RATE: DecayRate = Field(0.1, description="step schedule: multiplier applied every decay period.")
    STABLE_DURATION_FRACTION: Fraction = Field(
        0.8, description="wsd: share of post-warmup steps held at BASE_LR."
    )
    DECAY_DURATION_FRACTION: Fraction = Field(
        0.1, description="wsd: share of post-warmup steps spent decaying."
    )
    DECAY_TYPE: DecayType = Field("cosine", description="wsd: shape of the decay phase.")
    PARAMETER_GROUPS: list[ParameterGroup] = Field(
        default_factory=list,
        description="Per-group overrides; unmatched parameters form group 0 ('default').",
    )

    def problems(self) -> list[Problem]:
        problems: list[Problem] = []
        has_global_decay = self.DECAY is not None
        if self.NAME == "step" and not has_global_decay:
            problems.append(
                Problem(
                    ("DECAY_STEPS",), "{0} (or DECAY_FRACTION / DECAY_EPOCHS) is required when NAME is 'step'"
                )
            )
        seen: set[str] = set()
        for i, group in enumerate(self.PARAMETER_GROUPS):
            key = f"PARAMETER_GROUPS.{i}.LABEL"
            if group.LABEL in seen:
                problems.append(
                    Problem((key,), f"{{0}}: label '{group.LABEL}' is used twice; labels must be unique")
                )
            seen.add(group.LABEL)
            if (group.NAME or self.NAME) == "step" and not (group.DECAY is not None or has_global_decay):
                problems.append(
                    Problem(
                        (f"PARAMETER_GROUPS.{i}.DECAY_STEPS",),
                        "{0} (or a global DECAY_*) is required for a 'step' group",
                    )
                )
        return problems
