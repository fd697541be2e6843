"""``SCHEDULE``: validation and checkpoint intervals and logging intervals; the masking and mixup
ramps are in ``augmentation.py``.

Every timed field comes in units ``_STEPS`` (global optimizer steps), ``_FRACTION`` (of total
steps) or ``_EPOCHS``; exactly one may be set (docs/semantics.md §2). Intervals given in epochs fire on
``epoch % N == 0``; in steps or fractions they fire at the first epoch boundary at or after each
multiple (docs/semantics.md §5).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import AliasChoices, Field

from .augmentation import MetaMasking, Mixup, combination_problems
from .base import (
    NonNegativeInt,
    PositiveInt,
    Problem,
    Section,
    StepsOrOff,
    Timed,
    interval,
)


class PartialMaskMetaValidation(Section):
    """Validation passes with one WHITELIST combination of metadata components masked each."""

    ENABLED: bool = Field(
        False,
        description="Run the WHITELIST passes (metric prefix val_mask_<A>_<B>) at the boundaries of "
        "INTERVAL_*; with no INTERVAL_* they never run.",
    )
    INTERVAL: ClassVar[Timed] = interval(
        epochs="Partial-mask passes every N epochs.",
        steps="Partial-mask passes at the first epoch boundary at or after every N global steps.",
        fraction="Partial-mask passes at the first epoch boundary at or after every fraction of total steps (0: never).",
    )
    WHITELIST: list[list[str]] = Field(
        default_factory=list,
        description="Metadata component combinations, one validation pass each with that combination masked.",
    )

    def problems(self) -> list[Problem]:
        problems: list[Problem] = []
        if self.ENABLED and not self.WHITELIST:
            problems.append(
                Problem(("WHITELIST",), "{0} is empty while ENABLED is true: list the combinations to mask")
            )
        problems += combination_problems("WHITELIST", self.WHITELIST)
        return problems


class FinalEpochValidation(Section):
    """The validation at the run's last epoch boundary: what data it reads, and extra passes."""

    WHOLE_SPLIT: bool = Field(
        True,
        description="With MAX_BATCHES: the final validation (every pass at the run's last boundary, "
        "and evaluate's) reads the whole validation split, so the run's last val/ metrics are exact "
        "and comparable with other frameworks' full evaluations; false: it reads the same subset as "
        "the others. The final checkpoint is then ranked (KEEP_TOP_N, the best metric) by its "
        "whole-split metric against the earlier checkpoints' subset metrics.",
    )
    EXHAUSTIVE_PARTIAL_META_VALIDATION: bool = Field(
        False, description="At the final epoch, one pass per non-empty proper subset of the components."
    )
    EXHAUSTIVE_META_COMPONENTS: list[str] = Field(
        default_factory=list,
        description="The metadata components (at least 2) whose subsets the exhaustive passes mask "
        "(3 components: 6 passes); they replace that boundary's PARTIAL_MASK_META passes.",
    )

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
    """Validation passes, run at epoch boundaries (and, with MID_EPOCH, at steps inside epochs)."""

    INTERVAL: ClassVar[Timed] = interval(
        epochs="Standard validation (metric prefix val) every N epochs. With any INTERVAL_* set the final epoch always validates; with none, validation never runs.",
        steps="Standard validation at the first epoch boundary at or after every N global steps.",
        fraction="Standard validation at the first epoch boundary at or after every fraction of total steps (0: never).",
    )
    MASK_META_INTERVAL: ClassVar[Timed] = interval(
        epochs="A pass with all metadata masked (metric prefix val_mask_meta) every N epochs; not forced at the final epoch.",
        steps="The all-masked pass at the first epoch boundary at or after every N global steps.",
        fraction="The all-masked pass at the first epoch boundary at or after every fraction of total steps (0: never).",
    )
    PARTIAL_MASK_META: PartialMaskMetaValidation = Field(default_factory=PartialMaskMetaValidation)
    FINAL_EPOCH: FinalEpochValidation = Field(default_factory=FinalEpochValidation)
    MAX_BATCHES: PositiveInt | None = Field(
        None,
        description="Each validation pass reads this many batches per process (DATA.BATCH_SIZE_VAL) "
        "instead of the whole split (null, the default): a fixed subset of MAX_BATCHES x batch x "
        "processes samples drawn once from EXPERIMENT.SEED, the same at every validation and in "
        "every run with that seed and number of processes (with more processes it grows to include "
        "the smaller one's), read in index order; a split no larger is read whole. A stream "
        "(IterableDataset), or a DataLoader given for validation, has no random access: its first "
        "MAX_BATCHES batches per process. Early stopping and the checkpoints' ranking then use the "
        "subset's metrics. The final validation reads the whole split unless "
        "FINAL_EPOCH.WHOLE_SPLIT is false. nanoGPT's eval_iters, Lightning's limit_val_batches.",
    )
    MID_EPOCH: bool = Field(
        False,
        description="Validation intervals given in steps or fractions (INTERVAL_*, MASK_META_INTERVAL_*, "
        "PARTIAL_MASK_META.INTERVAL_*) fire at the step itself, mid-epoch, instead of at the first "
        "epoch boundary after it: for long epochs and streams. A checkpoint due at the same step is "
        "written first, so a run killed during those passes resumes with the passes still due.",
    )

    def step_intervals(self) -> list[str]:
        """The validation intervals set in steps or as a fraction (what MID_EPOCH applies to)."""
        blocks: tuple[tuple[str, Section, Timed], ...] = (
            ("", self, ValidationSchedule.INTERVAL),
            ("", self, ValidationSchedule.MASK_META_INTERVAL),
            ("PARTIAL_MASK_META.", self.PARTIAL_MASK_META, PartialMaskMetaValidation.INTERVAL),
        )
        return [
            f"{prefix}{spec.keys[unit]}"
            for prefix, block, spec in blocks
            for unit in ("steps", "fraction")
            if unit in spec.values(block)
        ]

    def problems(self) -> list[Problem]:
        problems: list[Problem] = []
        if self.MID_EPOCH and not self.step_intervals():
            problems.append(
                Problem(
                    ("MID_EPOCH",),
                    "{0} needs a validation interval in steps or as a fraction (INTERVAL_STEPS, INTERVAL_FRACTION, "
                    "MASK_META_INTERVAL_STEPS, ...): the steps at which to validate",
                )
            )
        return problems


class CheckpointSchedule(Section):
    """When checkpoints are written and which are kept."""

    INTERVAL: ClassVar[Timed] = interval(
        epochs="Checkpoint every N epochs (the final epoch always checkpoints, even with no INTERVAL_*).",
        steps="Checkpoint at the first epoch boundary at or after every N global steps (at the step itself with MID_EPOCH).",
        fraction="Checkpoint at the first epoch boundary at or after every fraction of total steps (at the step itself with MID_EPOCH; 0: never).",
    )
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
        problems: list[Problem] = []
        if self.MID_EPOCH and not {"steps", "fraction"} & CheckpointSchedule.INTERVAL.values(self).keys():
            problems.append(
                Problem(
                    ("MID_EPOCH",),
                    "{0} needs INTERVAL_STEPS or INTERVAL_FRACTION: the steps at which to checkpoint",
                )
            )
        return problems


class MetricsSchedule(Section):
    """How often step metrics are logged, in global steps. The training metrics are read from the
    device only every STEP_INTERVAL steps (the window's one host sync): the console and tracker
    intervals pick among those records, so they are rounded up to a multiple of it."""

    STEP: ClassVar[Timed] = interval(
        steps="Every N global steps (and at the last step), the training metrics of the steps since (loss, per-group LR, gradient norm, throughput, data-loading time share) are read from the device and written to metrics.jsonl; default 50 when STEP_FRACTION is not set either.",
        fraction="Instead of STEP_INTERVAL: every this fraction of the run's total steps.",
        steps_suffix="INTERVAL",
    )
    CONSOLE_INTERVAL: StepsOrOff | None = Field(
        None,
        description="The progress bar's loss, lr and samples/s (tokens/s for token tasks) are updated every N global steps; default: "
        "at every metrics record. Rounded up to a multiple of the metrics interval (the values exist only "
        "there); `plan` prints what it resolves to.",
    )
    # linnaeus spells it WANDB_INTERVAL; it applies to every tracker (both together: a duplicate key).
    TRACKER_INTERVAL: StepsOrOff | None = Field(
        None,
        validation_alias=AliasChoices("TRACKER_INTERVAL", "WANDB_INTERVAL"),
        description="The training metrics go to the trackers (EXPERIMENT.TRACKERS) every N global steps; "
        "default: every metrics record (metrics.jsonl keeps every record either way; validation results "
        "always go). Rounded up to a multiple of the metrics interval. WANDB_INTERVAL is linnaeus' "
        "spelling of this key.",
    )
    LR_INTERVAL: StepsOrOff | None = Field(
        None,
        description="lr/<group label> of every parameter group is logged (metrics.jsonl and trackers) "
        "every N global steps; default: with every metrics record. Any N works, 1 included: the LR is a "
        "function of the step, known without reading the device. Training records on other steps leave "
        "it out.",
    )
    PIPELINE_INTERVAL: Any = Field(
        None,
        description="Removed: the data-pipeline statistics (perf/data_time_share: the share of time the "
        "loop waited for batches; perf/samples_per_s, perf/tokens_per_s) are in every training metrics "
        "record, every STEP_INTERVAL steps. Must be left unset (null).",
    )

    def problems(self) -> list[Problem]:
        problems: list[Problem] = []
        if self.PIPELINE_INTERVAL is not None:
            problems.append(
                Problem(
                    ("PIPELINE_INTERVAL",),
                    "{0} was removed: the data-pipeline statistics (perf/data_time_share, the share of "
                    "time the loop waited for batches, and perf/samples_per_s) are in every training "
                    "metrics record, every SCHEDULE.METRICS.STEP_INTERVAL steps; delete the key (or set "
                    "it to null)",
                )
            )
        return problems


class ScheduleConfig(Section):
    """Everything timed during training, besides the LR."""

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
