"""``CALLBACKS``: code of the user's own (or a built-in callback) run during training.

Each entry names a registered callback (``@register_callback("name")``, see
``linnaeus_accel.callbacks``) and its options; an interval in the config's own units says at which
steps its ``on_step_end`` runs (resolved once with the plan and drawn in ``plan``'s timeline).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from .base import Fraction, Problem, Section, StepsOrOff, one_unit_problems

INTERVAL_UNITS = ("STEPS", "FRACTION", "EPOCHS")


class CallbackConfig(Section):
    """One callback of ``CALLBACKS``."""

    NAME: str = Field(
        description='A registered callback (@linnaeus_accel.register_callback("name") in your script).'
    )
    OPTIONS: dict[str, Any] = Field(
        default_factory=dict,
        description="The callback's options: keyword arguments of its class, checked against its Options model when it has one (unknown keys are errors).",
    )
    INTERVAL_STEPS: StepsOrOff | None = Field(
        None, description="Call on_step_end at every multiple of N global steps."
    )
    INTERVAL_FRACTION: Fraction | None = Field(
        None, description="Call on_step_end at every multiple of this fraction of the total steps (0: never)."
    )
    INTERVAL_EPOCHS: StepsOrOff | None = Field(
        None,
        description="Call on_step_end at the last step of every N-th epoch. With no INTERVAL_*: after every "
        "optimizer step.",
    )

    def problems(self) -> list[Problem]:
        return one_unit_problems(self, "INTERVAL", units=INTERVAL_UNITS)
