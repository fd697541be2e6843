"""The whole config and the rules that span sections."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from .base import Problem, Section
from .callbacks import CallbackConfig
from .lr import LRSchedulerConfig
from .optimizer import OptimizerConfig
from .run import EnvConfig, ExperimentConfig
from .schedule import CheckpointSchedule, ScheduleConfig
from .sections import (
    DataConfig,
    LossConfig,
    ModelConfig,
    TaskConfig,
    TrainConfig,
)


def _gradnorm_vs_accumulation(s: Mapping[str, Any]) -> list[Problem]:
    gradnorm = s["LOSS"].GRAD_WEIGHTING.TASK
    accum = s["TRAIN"].accumulation
    if gradnorm.GRADNORM_ENABLED and accum > gradnorm.UPDATE_INTERVAL:
        return [
            Problem(
                ("LOSS.GRAD_WEIGHTING.TASK.UPDATE_INTERVAL", "TRAIN.ACCUMULATION_STEPS"),
                f"{{0}} ({gradnorm.UPDATE_INTERVAL}) is smaller than {{1}} ({accum}): GradNorm updates happen at "
                "optimizer steps, so raise the interval to at least the accumulation",
            )
        ]
    return []


def _rollback_needs_checkpoints(s: Mapping[str, Any]) -> list[Problem]:
    """A rollback goes back to a checkpoint: without an interval only the final one is written."""
    train = s["TRAIN"]
    key = (
        "TRAIN.NONFINITE"
        if train.NONFINITE == "rollback"
        else "TRAIN.LOSS_SPIKE.ACTION"
        if train.LOSS_SPIKE.ACTION == "rollback"
        else None
    )
    checkpoint = s["SCHEDULE"].CHECKPOINT
    values = CheckpointSchedule.INTERVAL.values(checkpoint)  # INTERVAL_FRACTION 0 is never
    # A key reported invalid already (pruned) counts as set: this rule does not guess at it.
    if (
        key is None
        or len(CheckpointSchedule.INTERVAL.given(checkpoint)) > len(values)
        or any(values.values())
    ):
        return []
    return [
        Problem(
            (key, "SCHEDULE.CHECKPOINT.INTERVAL_STEPS"),
            "{0} is rollback, but no checkpoint is written before the run's end, so there is nothing "
            "to roll back to: set {1} (or INTERVAL_EPOCHS) as often as you can afford to redo training",
        )
    ]


def _image_sizes_agree(s: Mapping[str, Any]) -> list[Problem]:
    """linnaeus gives the input side twice (the data's and the model's): they must be one number."""
    model, data = s["MODEL"].IMG_SIZE, s["DATA"].IMG_SIZE
    if model is None or model == data:
        return []
    return [
        Problem(
            ("MODEL.IMG_SIZE", "DATA.IMG_SIZE"),
            f"{{0}} ({model}) and {{1}} ({data}) differ: the photos are cropped to {{1}} and the model sees "
            "them so; set both to one size, or unset {0}",
        )
    ]


# (sections a rule reads, the rule). The loader runs a rule whenever those sections are valid, even
# if others are not, so that one run reports every problem of a config together.
CROSS_SECTION_RULES: list[tuple[tuple[str, ...], Callable[[Mapping[str, Any]], list[Problem]]]] = [
    (("LOSS", "TRAIN"), _gradnorm_vs_accumulation),
    (("TRAIN", "SCHEDULE"), _rollback_needs_checkpoints),
    (("MODEL", "DATA"), _image_sizes_agree),
]


def cross_section_problems(sections: Mapping[str, Any]) -> list[Problem]:
    problems: list[Problem] = []
    for needs, rule in CROSS_SECTION_RULES:
        if all(isinstance(sections.get(name), BaseModel) for name in needs):
            problems += rule(sections)
    return problems


class Config(Section):
    """A validated linnaeus-accel config (linnaeus' UPPERCASE YAML keys)."""

    EXPERIMENT: ExperimentConfig = Field(default_factory=ExperimentConfig)
    ENV: EnvConfig = Field(default_factory=EnvConfig)
    DATA: DataConfig = Field(default_factory=DataConfig)
    MODEL: ModelConfig = Field(default_factory=ModelConfig)
    TASK: TaskConfig = Field(default_factory=TaskConfig)
    LOSS: LossConfig = Field(default_factory=LossConfig)
    TRAIN: TrainConfig = Field(default_factory=TrainConfig)
    OPTIMIZER: OptimizerConfig = Field(default_factory=OptimizerConfig)
    LR_SCHEDULER: LRSchedulerConfig = Field(default_factory=LRSchedulerConfig)
    SCHEDULE: ScheduleConfig = Field(default_factory=ScheduleConfig)
    CALLBACKS: list[CallbackConfig] = Field(
        default_factory=list,
        description="Callbacks run during training, in this order: [{NAME, OPTIONS, INTERVAL_*}] "
        "(linnaeus_accel.callbacks).",
    )

    def problems(self) -> list[Problem]:
        return cross_section_problems({name: getattr(self, name) for name in type(self).model_fields})

    @property
    def ranking_metric(self) -> str:
        """The metric that ranks checkpoints (KEEP_TOP_N, the best metric): SCHEDULE.CHECKPOINT.METRIC,
        by default TRAIN.EARLY_STOP.METRIC. Resolved here only."""
        return self.SCHEDULE.CHECKPOINT.METRIC or self.TRAIN.EARLY_STOP.METRIC

    @property
    def output_dir(self) -> Path:
        return Path(self.ENV.OUTPUT.BASE_DIR) / self.EXPERIMENT.NAME


def output_dir_problem(out: Path) -> tuple[str, str] | None:
    """Why the run directory ``out`` (``Config.output_dir``: ``<ENV.OUTPUT.BASE_DIR>/<EXPERIMENT.NAME>``)
    cannot be created or written, or None. Checked before anything is built, so that a BASE_DIR that is
    a file (or lies under one) is a config error, not a traceback from the first write after minutes of
    set-up."""
    # The nearest path that exists (or is a dangling link): the run directory is created below it.
    existing = next(p for p in (out, *out.parents) if os.path.lexists(p))
    key = "EXPERIMENT.NAME" if existing == out else "ENV.OUTPUT.BASE_DIR"
    if not existing.exists():
        return (
            key,
            f"{existing} is a broken symbolic link, so {out} cannot be created: fix the link or choose another {key}",
        )
    if not existing.is_dir():
        return key, f"{existing} is a file, not a directory, so {out} cannot be created: choose another {key}"
    if not os.access(existing, os.W_OK | os.X_OK):
        return (
            key,
            f"{existing} is not writable by this user, so {out} cannot be created there: choose another {key}",
        )
    return None
