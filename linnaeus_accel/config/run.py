"""``ENV`` and ``EXPERIMENT``: where a run writes (output directory, bucket), how processes wait
for each other, and what the run is called and reports to (trackers, W&B)."""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator

from ..object_store import SCHEMES, split_url
from .base import (
    PositiveFloat,
    PositiveInt,
    Problem,
    Section,
    at_most,
)
from .sections import MAX_DIST_TIMEOUT_S, Seed


class BucketConfig(Section):
    """A copy of the run's checkpoints in an object store (S3-compatible, Google Cloud Storage,
    Backblaze B2) or a shared directory, named by URL."""

    # The URL schemes a bucket may have; each backend is in linnaeus_accel/object_store.py.
    SCHEMES: ClassVar[tuple[str, ...]] = SCHEMES

    URL: str | None = Field(
        None,
        description="Where checkpoints are copied: s3://bucket/prefix (any S3-compatible store: AWS, "
        "Cloudflare R2, MinIO, B2's S3 endpoint; needs the s3 extra), gs://bucket/prefix (the gcs extra), "
        "file:///abs/path (a mounted shared directory, e.g. NFS; it must exist) or b2://bucket/prefix "
        "(b2sdk, the b2 extra). Each committed checkpoint is uploaded in the background to "
        "<URL>/<EXPERIMENT.NAME>/checkpoints/ (remote retention follows local retention; a run with an "
        "empty output directory resumes from the bucket). Credentials and endpoints come only from each "
        "library's standard environment: for s3, AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
        "AWS_PROFILE and ~/.aws files; for gs, Google's application default credentials; for b2, "
        "B2_APPLICATION_KEY_ID and B2_APPLICATION_KEY. Setting it turns the bucket on.",
    )
    ENABLED: bool | None = Field(
        None,
        description="null: the bucket is on when URL is set. true with BUCKET (and PREFIX): the older "
        "spelling of URL b2://<BUCKET>/<PREFIX>. false: no bucket, even with URL set.",
    )
    BUCKET: str | None = Field(
        None,
        description="With ENABLED true: a Backblaze B2 bucket name, the same as URL b2://<BUCKET>/<PREFIX> "
        "(credentials from B2_APPLICATION_KEY_ID and B2_APPLICATION_KEY).",
    )
    PREFIX: str = Field("", description="With BUCKET: the key prefix inside it (the path of a b2:// URL).")
    WAIT_S: PositiveFloat = Field(
        60.0,
        description="How long the end of a run, a preempted run (SIGTERM) and a rerun of a finished run "
        "wait for uploads still running, in seconds. Past it the run ends anyway, with exit status 3 and "
        "summary.json's remote_sync_errors naming each checkpoint the bucket lacks (a rerun of the same "
        "command uploads them). Keep it inside your scheduler's grace after SIGTERM, less the time a "
        "checkpoint takes to write.",
    )
    TIMEOUT_S: PositiveFloat = Field(
        30.0,
        description="s3:// only: seconds a single request may wait to connect, or wait for the store's "
        "next bytes, before it fails and is retried; an endpoint that accepts connections and never "
        "answers fails each transfer after this long instead of hanging (gs:// and b2:// keep their "
        "libraries' own timeouts; WAIT_S bounds the end of a run for every store).",
    )

    @field_validator("URL")
    @classmethod
    def _usable_url(cls, value: str | None) -> str | None:
        if value is not None:
            cls.split_url(value)
        return value

    @classmethod
    def split_url(cls, url: str) -> tuple[str, str, str]:
        """(scheme, bucket, prefix) of a bucket URL (``object_store.split_url``)."""
        return split_url(url)

    @property
    def target_url(self) -> str | None:
        """The URL checkpoints are copied to, or None when the bucket is off."""
        if self.ENABLED is False:
            return None
        if self.URL is not None:
            return self.URL
        if self.ENABLED and self.BUCKET:
            return "/".join(p for p in ("b2:/", self.BUCKET, self.PREFIX.strip("/")) if p)
        return None

    def problems(self) -> list[Problem]:
        if self.URL is not None and (self.BUCKET or self.PREFIX):
            given = ("BUCKET",) if self.BUCKET else ("PREFIX",)
            return [
                Problem(
                    ("URL", *given),
                    "{0} and {1} name the bucket twice: keep only URL (BUCKET and PREFIX are the older "
                    "spelling of b2://<BUCKET>/<PREFIX>)",
                )
            ]
        if self.ENABLED and self.URL is None and not self.BUCKET:
            return [Problem(("BUCKET",), "{0} (or URL) is required when ENABLED is true")]
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
