"""The format of a checkpoint's JSON state, part by part: what ``files.check_state`` verifies.

Each stateful part keeps its format beside its ``state_dict`` as a pydantic model
(``progress.ProgressState``, ``schedule.early_stopping.EarlyStoppingState``); those of the parts
that live above this layer (GradNorm, the train meter, the data position, the callbacks) are here,
where verification reaches them, and their classes point at them (``STATE_SCHEMA``). A checkpoint is
verified before any trainer exists (``CheckpointStore(check=...)``, ``linnaeus-accel evaluate``), so
the files' formats are tables by top-level key (``TrainerStateFile``, ``RankStateFile``), importable
without building a run. Keys they do not name (what ``Trainer.register_state`` registers, the
layout marker) are free-form. A part that breaks its format is named in one line
(``state_fields.error_line``).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, RootModel

from ...progress import ProgressState
from ...schedule.early_stopping import EarlyStoppingState
from ...state_fields import (
    Count,
    Flag,
    Int,
    Number,
    OptCount,
    OptNumber,
    OptNumbers,
    OptObject,
    OptPositive,
    OptText,
    Positive,
    StateModel,
    Text,
    absent,
    model_in,
)

STATE_VERSION = 1  # of trainer_state.json and the rank files, as a whole


# -- the parts above this layer ------------------------------------------------------------------


class GradNormState(StateModel):
    """``training.step.gradnorm.GradNorm``'s: the task weights and their Adam state. Missing keys mean a
    fresh start (L(0) recorded again, Adam's moments zero)."""

    version: Int = 1
    num_tasks: Positive = absent()
    weights: OptNumbers = None
    initial_losses: OptNumbers = None
    step: Count = 0
    exp_avg: OptNumbers = None
    exp_avg_sq: OptNumbers = None


class MeterState(StateModel):
    """``training.metrics.meter.TrainMeter``'s, per process: its open log window (``sums``: [loss,
    *components]) and the run's counters."""

    sums: OptNumbers = None
    steps: Count = 0
    nonfinite_skipped: Count = 0
    skipped_steps: Count = 0
    samples_at_last_flush: Count = 0
    tokens_at_last_flush: Count = 0


class BatchSourceState(StateModel):
    """``training.step.batches.BatchSource``'s, per process, inside an epoch over a stream: the layout it
    was read with and the loader's own state (torchdata's, free-form). Checkpoints written before
    the layout was recorded lack it."""

    version: Int = 1
    world_size: Positive = absent()
    batch_size: Positive = absent()
    num_workers: Count = absent()
    sharded: Flag = False
    loader: Any = None


class RollbackRecord(StateModel):
    """One rollback (``training.recovery``): found at ``detected_at`` by ``rule`` (``nonfinite`` or
    ``spike``; ``loss``: the spiking window's, null when not finite), back to the checkpoint of step ``back_to``; the data of the
    steps ``back_to`` + 1 .. ``skip_until`` never trains the model. ``samples_skipped`` and
    ``tokens_skipped`` are filled once the skip is over."""

    detected_at: Count
    rule: Text
    loss: OptNumber = None
    back_to: Count
    checkpoint: Text
    skip_until: Count
    skipped_steps: Count
    samples_at_checkpoint: Count = 0
    tokens_at_checkpoint: Count = 0
    samples_skipped: OptCount = None
    tokens_skipped: OptCount = None


class RecoveryState(StateModel):
    """``training.recovery.Recovery``'s: the spike rule's records (``history``: the running mean's;
    ``streak``: the spiking records in a row since ``anchor``, the newest record known good: a
    rollback goes back to a checkpoint at or before it), the rollbacks so far and the step the
    current skip ends at."""

    version: Int = 1
    history: Annotated[list[Number], Field(description="must be a list of numbers")] = Field(
        default_factory=list
    )
    streak: Annotated[list[Number], Field(description="must be a list of numbers")] = Field(
        default_factory=list
    )
    anchor: Count = 0
    skip_until: Count = 0
    rollbacks: list[RollbackRecord] = Field(default_factory=list)


class CallbacksState(RootModel[dict[str, Any]]):
    """``training.callback_list.CallbackList``'s: each callback's own state by its label."""


class BoundaryRecord(StateModel):
    """The event point a checkpoint was taken at (``step``, ``previous_step``, ``mid``: written since
    events may happen mid-epoch)."""

    epoch: Count
    final: Flag
    step: Count = absent()
    previous_step: Count = absent()
    mid: Flag = False


class PlanIdentity(StateModel):
    """``checkpoint.resume.elastic.plan_identity``: the schedule a checkpoint belongs to (``batches_per_epoch``:
    written since configs are stored in checkpoints; null for a stream without ``__len__``)."""

    total_steps: Count
    world_size: Positive
    accumulation: Positive
    batch_size: Positive
    batches_per_epoch: OptPositive = None


# -- the files -----------------------------------------------------------------------------------

_StepKey = Annotated[str, Field(pattern=r"^[0-9]+$")]


class TrainerStateFile(StateModel):
    """``trainer_state.json``: the run's parts by the key each registers under."""

    model_config = ConfigDict(extra="allow")  # registered parts: free-form

    version: Int
    progress: ProgressState = Field(default=None, validate_default=True, description="must be an object")
    early_stopping: EarlyStoppingState | None = Field(default=None, description="must be an object or null")
    gradnorm: GradNormState | None = Field(default=None, description="must be an object or null")
    boundary: BoundaryRecord | None = Field(default=None, description="must be an object or null")
    plan: PlanIdentity | None = Field(default=None, description="must be an object or null")
    config: OptObject = None  # the resolved config it was trained with (reviewed on resume)
    callbacks: CallbacksState | None = Field(default=None, description="must be an object or null")
    recovery: RecoveryState | None = Field(default=None, description="must be an object or null")
    wandb_run_id: OptText = None
    checkpoint_metrics: dict[_StepKey, Number | None] = Field(
        default_factory=dict, description="must map steps to numbers or nulls"
    )


class RankStateFile(StateModel):
    """``rank_XXXXX.json``: one process's own parts."""

    model_config = ConfigDict(extra="allow")

    version: Int
    meter: MeterState | None = Field(default=None, description="must be an object or null")
    data: BatchSourceState | None = Field(default=None, description="must be an object or null")


def _parts(file: type[StateModel]) -> dict[str, type[BaseModel]]:
    return {name: model for name, field in file.model_fields.items() if (model := model_in(field))}


RUN_PARTS = _parts(TrainerStateFile)  # key -> the format of that part of trainer_state.json
RANK_PARTS = _parts(RankStateFile)  # key -> the format of that part of a rank file
