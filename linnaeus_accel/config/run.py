"""``ENV`` and ``EXPERIMENT``: where a run writes (output directory, bucket), how processes wait
for each other, and what the run is called and reports to (trackers, W&B)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator

from .base import (
    PositiveFloat,
    PositiveInt,
    Problem,
    Section,
    at_most,
)
from .sections import MAX_DIST_TIMEOUT_S, Seed


class BucketConfig(Section):
    """A Backblaze B2 copy of the run's checkpoints."""

    ENABLED: bool = Field(
        False,
        description="Upload each committed checkpoint to <BUCKET>/<PREFIX>/<EXPERIMENT.NAME>/checkpoints/ "
        "in the background (remote retention follows local retention; a run with an empty output "
        "directory resumes from the bucket). Needs the b2 extra and B2_APPLICATION_KEY_ID and "
        "B2_APPLICATION_KEY in the environment.",
    )
    BUCKET: str | None = Field(
        None, description="Backblaze B2 bucket name (credentials come from the environment)."
    )
    PREFIX: str = Field("", description="Key prefix inside the bucket.")

    def problems(self) -> list[Problem]:
        if self.ENABLED and not self.BUCKET:
            return [Problem(("BUCKET",), "{0} is required when ENABLED is true")]
        return []


class OutputConfig(Section):
    """Where a run writes."""

    BASE_DIR: str = Field("outputs", description="Runs are written to <BASE_DIR>/<EXPERIMENT.NAME>.")
    BUCKET: BucketConfig = Field(default_factory=BucketConfig)


class EnvConfig(Section):
    """The machine: output location, device peak FLOP/s, collective timeout, deterministic kernels."""

    OUTPUT: OutputConfig = Field(default_factory=OutputConfig)
    PEAK_FLOPS: PositiveFloat | None = Field(
        None,
        description="Peak FLOP/s of one device, for MFU; default: looked up by GPU name (dense bf16). "
        "On a CPU, MFU is reported only when this is set.",
    )
    DIST_TIMEOUT_S: Annotated[
        PositiveInt,
        at_most(
            MAX_DIST_TIMEOUT_S,
            "that is a week, and a collective waiting longer means a process is gone: the run should "
            "fail and free its devices",
        ),
    ] = Field(
        600,
        description="Seconds a collective operation (all-reduce, barrier) waits for the other processes "
        "before every process exits with an error (torch's default is 30 minutes).",
    )
    DETERMINISTIC: bool = Field(
        False,
        description="Deterministic kernels: torch.use_deterministic_algorithms (an op without a deterministic "
        "implementation warns) and cuBLAS's fixed workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set), so "
        "that a GPU run repeats bitwise, on a rerun and across a kill and resume. Off, GPU kernels such as "
        "an embedding's backward add in a varying order and runs agree only to rounding. Costs some speed.",
    )
    PROGRESS_BAR: bool | Literal["auto"] = Field(
        "auto",
        description="The console's progress bar: auto draws it when stdout is a terminal; otherwise "
        "(a log file, a batch job, a notebook) the run prints one plain line per console interval "
        "(step, loss, LR, samples/s or tokens/s, time left). true: always the bar; false: always plain lines.",
    )


# The trackers Accelerate supports (``accelerate.tracking.LOGGER_TYPE_TO_CLASS``; tests/test_trackers.py
# keeps this list in step with it). Spelt here because the config layer does not import accelerate.
TRACKER_NAMES = (
    "wandb",
    "tensorboard",
    "comet_ml",
    "aim",
    "mlflow",
    "clearml",
    "dvclive",
    "swanlab",
    "trackio",
)
DEFAULT_PROJECT = "linnaeus-accel"


class WandbConfig(Section):
    """Weights & Biases: linnaeus' switch for the wandb tracker, and the W&B run's project, entity, tags."""

    ENABLED: bool = Field(
        False,
        description="Log to Weights & Biases: the same as listing wandb in EXPERIMENT.TRACKERS (either "
        "turns it on; false does not remove a wandb listed there).",
    )
    PROJECT: str | None = Field(
        None,
        description=f"The tracker project (default {DEFAULT_PROJECT}): the W&B project, and the project "
        "name Accelerate gives every other tracker too (comet_ml, mlflow's experiment, ...); TensorBoard "
        "writes to <run dir>/tensorboard whatever it is.",
    )
    ENTITY: str | None = Field(None, description="W&B entity (user or team); default: the logged-in user's.")
    TAGS: list[str] = Field(
        default_factory=list, description="Tags of the W&B run, added to EXPERIMENT.TAGS."
    )


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class ExperimentConfig(Section):
    NAME: str = Field(
        "default",
        description="Run directory name under ENV.OUTPUT.BASE_DIR; also the W&B run's display name.",
    )
    SEED: Seed = Field(0, description="Seeds data order, masking and mixup draws (keyed by sample).")
    TAGS: list[str] = Field(default_factory=list, description="Tags of the W&B run (with WANDB.TAGS).")
    NOTES: str = Field("", description="Notes of the W&B run.")
    TRACKERS: list[str] = Field(
        default_factory=list,
        description="Experiment trackers, through Accelerate's tracker API: any of "
        + ", ".join(TRACKER_NAMES)
        + ". Each gets the step metrics (every SCHEDULE.METRICS.TRACKER_INTERVAL steps) and every "
        "validation result, at the global step, and the resolved config. wandb: a resumed run continues "
        "the same W&B run; tensorboard: event files in <run dir>/tensorboard, which a resumed run appends "
        "to. A tracker whose package is not installed is an error at start (install its extra, e.g. "
        "linnaeus-accel[tensorboard]). WANDB.ENABLED: true adds wandb to this list.",
    )
    WANDB: WandbConfig = Field(default_factory=WandbConfig)

    @field_validator("TRACKERS")
    @classmethod
    def _known_trackers(cls, value: list[str]) -> list[str]:
        unknown = [name for name in value if name not in TRACKER_NAMES]
        if unknown:
            raise ValueError(
                f"{', '.join(map(repr, unknown))} {'is not a tracker' if len(unknown) == 1 else 'are not trackers'} "
                f"Accelerate supports: choose from {', '.join(TRACKER_NAMES)}"
            )
        return value

    @property
    def trackers(self) -> tuple[str, ...]:
        """The trackers to log to: TRACKERS (each once), and wandb when WANDB.ENABLED."""
        names = dict.fromkeys(self.TRACKERS)
        if self.WANDB.ENABLED:
            names.setdefault("wandb")
        return tuple(names)

    @field_validator("NAME")
    @classmethod
    def _directory_name(cls, value: str) -> str:
        if not _NAME_RE.match(value):
            raise ValueError(
                f"{value!r} is not a usable directory name: use letters, digits, '.', '_' and '-'"
            )
        return value
