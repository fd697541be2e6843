"""``CALLBACKS``: code of the user's own (or a built-in callback) run during training.

Each entry names a registered callback (``@register_callback("name")``, see
``linnaeus_accel.callbacks``) and its options; an interval in the config's own units says at which
steps its ``on_step_end`` runs (resolved once with the plan and drawn in ``plan``'s timeline).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from .base import Section, Timed, interval


class CallbackConfig(Section):
    """One callback of ``CALLBACKS``."""

    NAME: str = Field(
        description='A registered callback (@linnaeus_accel.register_callback("name") in your script).'
    )
    OPTIONS: dict[str, Any] = Field(
        default_factory=dict,
        description="The callback's options: keyword arguments of its class, checked against its Options model when it has one (unknown keys are errors).",
    )
    INTERVAL: ClassVar[Timed] = interval(
        steps="Call on_step_end at every multiple of N global steps.",
        fraction="Call on_step_end at every multiple of this fraction of the total steps (0: never).",
        epochs="Call on_step_end at the last step of every N-th epoch. With no INTERVAL_*: after every optimizer step.",
    )


# -- the options of the built-in callbacks (their classes: linnaeus_accel.callbacks.<name>) -----------
class EmaOptions(BaseModel):
    """``CALLBACKS: [{NAME: ema, OPTIONS: {...}}]``."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    decay: float = Field(
        0.999, gt=0.0, lt=1.0, description="Weight of the average at each update (0 < decay < 1)."
    )
    warmup: bool = Field(False, description="Use min(decay, (1 + n) / (10 + n)) after n updates.")
    validate_: bool = Field(
        False,
        alias="validate",
        description="Also run the standard validation pass on the average (val_ema/).",
    )


class LmSamplesOptions(BaseModel):
    """``CALLBACKS: [{NAME: lm_samples, OPTIONS: {...}}]``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prompts: list[str] = Field(min_length=1, description="The texts to continue.")
    max_new_tokens: int = Field(32, ge=1, description="Tokens generated per prompt.")
    temperature: float = Field(0.0, ge=0.0, description="0: greedy; else sample from softmax(logits / T).")
    seed: int = Field(0, description="Seeds the sampling, with the step and the prompt's index.")
    tokenizer: str | None = Field(None, description="A tokenizer.json; default: UTF-8 bytes (257 ids).")
    context: int | None = Field(None, ge=1, description="Tokens the model sees (default: the data's window).")
    name: str = Field(
        "samples",
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Metric prefix (<name>/<i>) and W&B table (<name>/table); one per lm_samples callback.",
    )


class ProfileOptions(BaseModel):
    """``CALLBACKS: [{NAME: profile, OPTIONS: {...}}]``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    start_step: int = Field(
        10, ge=1, description="The first global step traced (skip the first steps' warm-up)."
    )
    steps: int = Field(5, ge=1, description="How many steps are traced.")
    record_shapes: bool = Field(False, description="Record operators' input shapes.")
    with_stack: bool = Field(False, description="Record Python stacks (larger traces).")
    row_limit: int = Field(15, ge=1, description="Rows of the printed summary.")


BUILTIN_OPTIONS: dict[str, type[BaseModel]] = {
    "ema": EmaOptions,
    "lm_samples": LmSamplesOptions,
    "profile": ProfileOptions,
}
