"""``TRAIN``, ``DATA``, ``MODEL``, ``LOSS``, ``ENV`` and ``EXPERIMENT`` sections."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from .base import (
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Problem,
    Section,
    StepsOrOff,
    canonical_metric_name,
)


class EarlyStopConfig(Section):
    """Stopping rules checked at validation points (SPEC §7); MAX_STEPS is checked every step."""

    ACTIVE: bool = False
    METRIC: str = Field("val/loss", description="Monitored metric; 'val_loss' is read as 'val/loss'.")
    MODE: Literal["min", "max"] | None = Field(
        None, description="Default: min if METRIC contains 'loss', else max."
    )
    PATIENCE_STEPS: StepsOrOff | None = Field(
        None, description="Stop when this many global steps pass without improvement."
    )
    MIN_DELTA: NonNegativeFloat = Field(
        0.0, description="An improvement must beat the best by more than this."
    )
    MAX_STEPS: StepsOrOff | None = Field(None, description="Hard cut-off after this many optimizer steps.")
    MAX_LOSS: float | None = Field(None, description="Stop when the monitored metric exceeds this.")
    MIN_LR: NonNegativeFloat | None = Field(
        None, description="Stop when the LR (group 0) falls below this after warmup."
    )
    MAX_GRAD_NORM: PositiveFloat | None = Field(None, description="Stop when the gradient norm exceeds this.")

    @field_validator("METRIC")
    @classmethod
    def _canonical_metric(cls, value: str) -> str:
        return canonical_metric_name(value)

    def problems(self) -> list[Problem]:
        conditions = ("PATIENCE_STEPS", "MAX_STEPS", "MAX_LOSS", "MIN_LR", "MAX_GRAD_NORM")
        if self.ACTIVE and all(getattr(self, c) is None for c in conditions):
            return [
                Problem(
                    ("ACTIVE",),
                    "{0} is true but no stopping condition is set: set PATIENCE_STEPS (or MAX_STEPS, MAX_LOSS, MIN_LR, MAX_GRAD_NORM)",
                )
            ]
        return []

    @property
    def mode(self) -> Literal["min", "max"]:
        return self.MODE or ("min" if "loss" in self.METRIC else "max")


class TrainConfig(Section):
    EPOCHS: PositiveInt = Field(
        10, description="Training epochs; total steps = EPOCHS x optimizer steps per epoch."
    )
    ACCUMULATION_STEPS: NonNegativeInt = Field(
        1, description="Micro-batches per optimizer step (0 is read as 1)."
    )
    CLIP_GRAD: PositiveFloat | None = Field(5.0, description="Max gradient norm (null: no clipping).")
    AUTO_RESUME: bool = Field(
        True, description="Resume from the newest complete checkpoint in the output directory."
    )
    EARLY_STOP: EarlyStopConfig = Field(default_factory=EarlyStopConfig)

    @property
    def accumulation(self) -> int:
        return max(1, self.ACCUMULATION_STEPS)


class DatasetConfig(Section):
    NAME: str = Field("digits", description="A registered dataset (see linnaeus_accel.data.registry).")
    VAL_FRACTION: Fraction = Field(
        0.2, description="Share held out for validation when the dataset has no split."
    )
    OPTIONS: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for the dataset builder."
    )


class DataConfig(Section):
    BATCH_SIZE: PositiveInt = Field(64, description="Per-process training batch size.")
    BATCH_SIZE_VAL: PositiveInt | None = Field(
        None, description="Per-process validation batch size; default BATCH_SIZE."
    )
    DROP_LAST: bool = Field(False, description="Drop the last incomplete batch of each epoch.")
    NUM_WORKERS: NonNegativeInt = Field(0, description="DataLoader worker processes.")
    DATASET: DatasetConfig = Field(default_factory=DatasetConfig)


class ModelConfig(Section):
    TYPE: str = Field("digits_mlp", description="A registered model (see linnaeus_accel.models.registry).")
    OPTIONS: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for the model builder."
    )


class GradNormConfig(Section):
    GRADNORM_ENABLED: bool = False
    GRADNORM_WARMUP_STEPS: NonNegativeInt = Field(0, description="No weight update before this global step.")
    UPDATE_INTERVAL: PositiveInt = Field(1, description="Update task weights every N global steps.")
    ALPHA: NonNegativeFloat = Field(1.5, description="GradNorm asymmetry.")


class GradWeightingConfig(Section):
    TASK: GradNormConfig = Field(default_factory=GradNormConfig)


class LossConfig(Section):
    TASK_WEIGHTS: list[NonNegativeFloat] | None = Field(
        None, description="Per-level loss weights; default equal."
    )
    GRAD_WEIGHTING: GradWeightingConfig = Field(default_factory=GradWeightingConfig)


class BucketConfig(Section):
    ENABLED: bool = False
    BUCKET: str | None = Field(
        None, description="Backblaze B2 bucket name (credentials come from the environment)."
    )
    PREFIX: str = Field("", description="Key prefix inside the bucket.")

    def problems(self) -> list[Problem]:
        if self.ENABLED and not self.BUCKET:
            return [Problem(("BUCKET",), "{0} is required when ENABLED is true")]
        return []


class OutputConfig(Section):
    BASE_DIR: str = Field("outputs", description="Runs are written to <BASE_DIR>/<EXPERIMENT.NAME>.")
    BUCKET: BucketConfig = Field(default_factory=BucketConfig)


class EnvConfig(Section):
    OUTPUT: OutputConfig = Field(default_factory=OutputConfig)


class WandbConfig(Section):
    ENABLED: bool = False
    PROJECT: str | None = Field(None, description="Default: linnaeus-accel.")
    ENTITY: str | None = None
    TAGS: list[str] = Field(default_factory=list)


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class ExperimentConfig(Section):
    NAME: str = Field("default", description="Run directory name under ENV.OUTPUT.BASE_DIR.")
    SEED: NonNegativeInt = Field(
        0, description="Seeds data order, masking and mixup draws (keyed by sample)."
    )
    TAGS: list[str] = Field(default_factory=list)
    NOTES: str = ""
    WANDB: WandbConfig = Field(default_factory=WandbConfig)

    @field_validator("NAME")
    @classmethod
    def _directory_name(cls, value: str) -> str:
        if not _NAME_RE.match(value):
            raise ValueError(
                f"{value!r} is not a usable directory name: use letters, digits, '.', '_' and '-'"
            )
        return value
