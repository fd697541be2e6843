"""``TrainingProgress``: the single source of truth for where a run is (docs/semantics.md §6).

``epoch`` counts *completed* epochs (docs/semantics.md §5 numbers boundaries 1..EPOCHS by completed epochs);
the epoch being trained is ``epoch + 1``. ``global_step`` counts optimizer updates, never
micro-batches nor processes; ``samples_seen`` counts samples over all processes, each once (not
even-batch repeats); ``tokens_seen`` counts target tokens the same way (docs/semantics.md §1).

Its state is versioned plain data (JSON) so that a checkpoint never needs unpickling; its format
is ``ProgressState``, which a checkpoint's ``trainer_state.json`` is verified against before a
resume believes it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from pydantic import Field

from .schedule.steps import batches_per_process, optimizer_steps_per_epoch
from .state_fields import Count, Int, Ints, Number, OptCount, StateModel, Text

if TYPE_CHECKING:
    from .schedule.resolved import ResolvedPlan

logger = logging.getLogger(__name__)

STATE_VERSION = 1


class TrainingStage(str, Enum):
    TRAINING = "TRAINING"
    VALIDATION_NORMAL = "VALIDATION_NORMAL"
    VALIDATION_MASK_META = "VALIDATION_MASK_META"
    VALIDATION_PARTIAL_MASK_META = "VALIDATION_PARTIAL_MASK_META"


VALIDATION_ORDER = (
    TrainingStage.VALIDATION_NORMAL,
    TrainingStage.VALIDATION_MASK_META,
    TrainingStage.VALIDATION_PARTIAL_MASK_META,
)

# A stage is stored by its name (lax: JSON holds the string, not the enum).
_Stage = Annotated[TrainingStage, Field(strict=False)]
_STAGE_NAMES = sorted(stage.value for stage in TrainingStage)
_Stages = Annotated[list[_Stage], Field(description="must be a list of stages")]


class BestMetric(StateModel):
    name: Text
    value: Number
    step: Int


class ProgressState(StateModel):
    """The format of ``TrainingProgress.state_dict()``. A checkpoint must say where the run is
    (``epoch``, ``global_step``, ``batches_seen_in_epoch``); the rest may be missing (checkpoints
    of earlier versions) and then keeps its fresh-start value on load."""

    version: Int = STATE_VERSION
    total_epochs: OptCount = None
    expected_total_steps: OptCount = None
    current_stage: Annotated[_Stage, Field(description=f"must be one of {_STAGE_NAMES}")] = (
        TrainingStage.TRAINING
    )
    epoch: Count
    global_step: Count
    epoch_start_step: OptCount = None
    batches_seen_in_epoch: Count
    samples_seen: OptCount = None
    tokens_seen: OptCount = None
    pending_validations: _Stages = Field(default_factory=list)
    completed_validations: _Stages = Field(default_factory=list)
    partial_validation_indices: Ints = Field(default_factory=list)
    completed_partial_indices: Ints = Field(default_factory=list)
    best_metric: Annotated[BestMetric | None, Field(description="must be null or {name, value, step}")] = None


# Null in a checkpoint for these means "none"; for the other counts, "not recorded" (kept as built).
_NULLABLE = {"expected_total_steps", "best_metric"}


@dataclass
class TrainingProgress:
    STATE_SCHEMA: ClassVar[type[ProgressState]] = ProgressState

    total_epochs: int
    expected_total_steps: int | None = None
    current_stage: TrainingStage = TrainingStage.TRAINING
    epoch: int = 0
    global_step: int = 0
    epoch_start_step: int = 0  # global_step when the epoch being trained began (its previous boundary)
    batches_seen_in_epoch: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    pending_validations: list[TrainingStage] = field(default_factory=list)
    completed_validations: list[TrainingStage] = field(default_factory=list)
    partial_validation_indices: list[int] = field(default_factory=list)
    completed_partial_indices: list[int] = field(default_factory=list)
    best_metric: dict[str, Any] | None = None  # {"name", "value", "step"}
    # The tokens trained on are added up on the device each step (the meter) and counted here only
    # when something reads them (a record, a checkpoint, a rollback, the end): no step waits for them.
    _pending_tokens: Callable[[], int] | None = field(default=None, repr=False, compare=False)

    # -- training ------------------------------------------------------------------------------
    @property
    def current_epoch(self) -> int:
        """1-based number of the epoch being trained."""
        return self.epoch + 1

    def start_training_epoch(self, epoch: int | None = None) -> None:
        """Begin epoch ``epoch`` (1-based; default: the next one) from its first batch."""
        if epoch is not None:
            self.epoch = epoch - 1
        self.current_stage = TrainingStage.TRAINING
        self.batches_seen_in_epoch = 0
        self.epoch_start_step = self.global_step
        self.clear_validations()

    def update_step(self, batch_size: int, is_accumulation_step: bool = False) -> bool:
        """Record one micro-batch of ``batch_size`` samples (over all processes); returns whether it
        completed an optimizer step."""
        self.batches_seen_in_epoch += 1
        self.samples_seen += batch_size
        if not is_accumulation_step:
            self.global_step += 1
        return not is_accumulation_step

    def complete_step(self, micro_batches: int, samples: int) -> None:
        """Record one optimizer step made of ``micro_batches`` batches per process holding
        ``samples`` real samples over all processes."""
        self.batches_seen_in_epoch += micro_batches
        self.samples_seen += samples
        self.global_step += 1

    def count_tokens_from(self, pending: Callable[[], int]) -> None:
        """``pending()``: the tokens trained on since it was last asked (a read from the device)."""
        self._pending_tokens = pending

    def settle_tokens(self) -> int:
        """``tokens_seen`` with the tokens still pending counted (one read from the device)."""
        if self._pending_tokens is not None:
            self.tokens_seen += self._pending_tokens()
        return self.tokens_seen

    def end_epoch(self) -> None:
        self.epoch += 1
        self.batches_seen_in_epoch = 0

    # -- validation bookkeeping ----------------------------------------------------------------
    def schedule_validation(self, validation_type: TrainingStage, partial_index: int | None = None) -> None:
        if validation_type not in self.pending_validations:
            self.pending_validations.append(validation_type)
            self.pending_validations.sort(key=VALIDATION_ORDER.index)
        if partial_index is not None and partial_index not in self.partial_validation_indices:
            self.partial_validation_indices.append(partial_index)

    def start_validation(self, validation_type: TrainingStage) -> None:
        self.current_stage = validation_type

    def complete_validation(self, validation_type: TrainingStage, partial_index: int | None = None) -> None:
        if partial_index is not None:
            if partial_index in self.partial_validation_indices:
                self.partial_validation_indices.remove(partial_index)
                self.completed_partial_indices.append(partial_index)
            if self.partial_validation_indices:
                return  # the partial stage stays pending until every combination has run
        if validation_type in self.pending_validations:
            self.pending_validations.remove(validation_type)
        if validation_type not in self.completed_validations:
            self.completed_validations.append(validation_type)
        if not self.pending_validations:
            self.current_stage = TrainingStage.TRAINING

    def has_pending_validations(self) -> bool:
        return bool(self.pending_validations)

    def clear_validations(self) -> None:
        """Forget the passes of the previous event point (a new one begins)."""
        self.pending_validations.clear()
        self.completed_validations.clear()
        self.partial_validation_indices.clear()
        self.completed_partial_indices.clear()

    def update_best(self, name: str, value: float, mode: str = "min") -> bool:
        """Keep the best value of the checkpoint-ranking metric; True when ``value`` is a new best."""
        if not math.isfinite(value):
            return False
        best = self.best_metric
        better = (
            best is None
            or best["name"] != name
            or (value < best["value"] if mode == "min" else value > best["value"])
        )
        if better:
            self.best_metric = {"name": name, "value": value, "step": self.global_step}
        return better

    # -- fractions -------------------------------------------------------------------------------
    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return ProgressState(
            version=STATE_VERSION,
            total_epochs=self.total_epochs,
            expected_total_steps=self.expected_total_steps,
            current_stage=self.current_stage,
            epoch=self.epoch,
            global_step=self.global_step,
            epoch_start_step=self.epoch_start_step,
            batches_seen_in_epoch=self.batches_seen_in_epoch,
            samples_seen=self.samples_seen,
            tokens_seen=self.tokens_seen,
            pending_validations=list(self.pending_validations),
            completed_validations=list(self.completed_validations),
            partial_validation_indices=list(self.partial_validation_indices),
            completed_partial_indices=list(self.completed_partial_indices),
            best_metric=BestMetric(**self.best_metric) if self.best_metric else None,
        ).as_data()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Tolerant: unknown keys are ignored and missing ones keep their current value, so that
        checkpoints of other versions still load (the values it has are read as ``ProgressState``
        says, leniently: a checkpoint was verified strictly before it is loaded)."""
        version = state.get("version", STATE_VERSION)
        if version > STATE_VERSION:
            logger.warning(
                "progress state version %s is newer than this code (%s); loading what is known",
                version,
                STATE_VERSION,
            )
        given = {k: v for k, v in state.items() if v is not None or k in _NULLABLE}
        loaded = ProgressState.model_validate({**self.state_dict(), **given}, strict=False).as_data()
        del loaded["version"]
        loaded["current_stage"] = TrainingStage(loaded["current_stage"])
        for name in ("pending_validations", "completed_validations"):
            loaded[name] = [TrainingStage(s) for s in loaded[name]]
        for name, value in loaded.items():
            setattr(self, name, value)


class TrainingConsistencyChecker:
    """Checks that epochs advance by the number of optimizer steps the plan expects.

    The Trainer builds one ``for_plan`` and asks ``epoch_problem`` once, after the first epoch it
    trains from its first batch: the schedules are resolved from the training data's length, so a
    loader that yields fewer batches than its ``__len__`` says shifts every boundary after it.
    """

    def __init__(
        self,
        total_epochs: int,
        batch_size: int,
        world_size: int,
        accumulation_steps: int,
        drop_last: bool = False,
    ) -> None:
        self.total_epochs = total_epochs
        self.batch_size = batch_size
        self.world_size = world_size
        self.accumulation_steps = max(1, accumulation_steps)
        self.drop_last = drop_last
        self.expected_steps_per_epoch: int | None = None
        self.expected_total_steps: int | None = None
        self._batches_per_epoch: int | None = None
        self._last_epoch_steps: int | None = None
        self._checked = False

    @classmethod
    def for_plan(cls, plan: ResolvedPlan, drop_last: bool = False) -> TrainingConsistencyChecker:
        """Expect what the resolved plan says (its steps per epoch, a partial last epoch of a
        TRAIN.TARGET_TOKENS run included), not a recount from the dataset size: a sampler of the
        user's may legitimately draw another number of samples than the dataset holds."""
        checker = cls(plan.epochs or 0, plan.batch_size, plan.world_size, plan.accumulation, drop_last)
        checker.expected_total_steps = plan.total_steps
        if plan.known_epochs:  # a stream without __len__ has no expected epoch length to check
            checker.expected_steps_per_epoch = plan.optimizer_steps_per_epoch
            checker._batches_per_epoch = plan.batches_per_epoch
            checker._last_epoch_steps = plan.last_epoch_steps
        return checker

    def epoch_problem(self, epoch: int, actual_steps: int) -> str | None:
        """What is wrong when whole epoch ``epoch`` took ``actual_steps`` optimizer steps, or None.
        Answers once per run (later calls return None): one warning, not one per epoch."""
        if self._checked or self.expected_steps_per_epoch is None:
            return None
        self._checked = True
        expected = self.expected_steps_per_epoch
        if epoch == self.total_epochs and self._last_epoch_steps is not None:
            expected = self._last_epoch_steps
        if actual_steps == expected:
            return None
        batches = (
            f"{self._batches_per_epoch} batches per process" if self._batches_per_epoch else "its length"
        )
        return (
            f"epoch {epoch} took {actual_steps} optimizer steps but the plan expects {expected}: the training "
            f"data yielded {'fewer' if actual_steps < expected else 'more'} batches than its length says "
            f"({batches}, accumulation {self.accumulation_steps}); the LR, masking, validation and "
            "checkpoint schedules were resolved from that length and no longer line up with epochs. "
            "Check the __len__ of the dataset or sampler given."
        )

    def expected_steps_for(self, dataset_size: int) -> int:
        batches = batches_per_process(dataset_size, self.batch_size, self.world_size, self.drop_last)
        return optimizer_steps_per_epoch(batches, self.accumulation_steps)

    def initialize_with_first_epoch(self, actual_steps: int, dataset_size: int) -> bool:
        expected = self.expected_steps_for(dataset_size)
        self.expected_steps_per_epoch = expected
        self.expected_total_steps = expected * self.total_epochs
        if actual_steps != expected:
            logger.warning(
                "first epoch took %d optimizer steps but %d samples at batch %d x %d processes, accumulation %d "
                "should take %d: check the sampler and the accumulation setting",
                actual_steps,
                dataset_size,
                self.batch_size,
                self.world_size,
                self.accumulation_steps,
                expected,
            )
            return False
        return True
