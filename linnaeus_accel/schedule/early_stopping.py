"""Early stopping (docs/semantics.md §5): a small state machine checked at validation points. The
run's hard cut-off, ``TRAIN.EARLY_STOP.MAX_STEPS``, is the plan's (``OpsSchedule.max_steps_stop``)."""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from ..config.sections import EarlyStopConfig
from ..state_fields import Int, OptInt, OptNumber, StateModel, Text, absent
from .stops import StopDecision, StopReason

STATE_VERSION = 1


class EarlyStoppingState(StateModel):
    """The format of ``EarlyStopping.state_dict()``: the value of ``metric`` that the next improvement
    must beat, and its step (saved as ``best`` and ``step_of_best``, version 1's names)."""

    version: Int = STATE_VERSION
    metric: Text = absent()  # a checkpoint without it: taken as this run's metric
    best: OptNumber = None
    step_of_best: OptInt = None


class EarlyStopping:
    """Decides whether to stop at a validation point (PATIENCE_STEPS, MAX_LOSS, MIN_LR, ...).

    ``reference`` is the monitored metric's value that the next improvement must beat by more
    than MIN_DELTA, taken at ``reference_step``: not the run's best metric, which ranks checkpoints
    and is ``TrainingProgress.best_metric`` (SCHEDULE.CHECKPOINT's ranking metric, with no MIN_DELTA).

    ``check`` is called at validation points with the metrics of that point; the decision is meant
    to be taken on one process and broadcast (the trainer does that).
    """

    STATE_SCHEMA: ClassVar[type[EarlyStoppingState]] = EarlyStoppingState

    def __init__(
        self, config: EarlyStopConfig, warmup_steps: int = 0, mode: Literal["min", "max"] | None = None
    ) -> None:
        """``mode``: whether the metric is better lower or higher, as the task reports it; MODE in
        the config wins, and without either the metric's name decides."""
        self.config = config
        self.warmup_steps = warmup_steps
        self.metric = config.METRIC
        self.mode = config.MODE or mode or config.mode
        self.reference: float | None = None
        self.reference_step: int | None = None

    def is_improvement(self, value: float) -> bool:
        if not math.isfinite(value):
            return False  # never an improvement: it would also not survive the JSON checkpoint state
        if self.reference is None:
            return True
        delta = self.reference - value if self.mode == "min" else value - self.reference
        return delta > self.config.MIN_DELTA

    def update(self, value: float, global_step: int) -> bool:
        """Record a new value of the metric; True when it is an improvement (the new reference)."""
        if self.is_improvement(value):
            self.reference, self.reference_step = value, global_step
            return True
        return False

    def check(
        self, global_step: int, metric: float | None, lr: float | None = None, grad_norm: float | None = None
    ) -> StopDecision | None:
        """Update with this validation point's values and say whether training should stop."""
        cfg = self.config
        if not cfg.ACTIVE:
            if metric is not None:
                self.update(metric, global_step)
            return None
        if metric is not None:
            if not math.isfinite(metric):
                return StopDecision(StopReason.NOT_FINITE, f"{self.metric} is {metric} at step {global_step}")
            self.update(metric, global_step)
            if cfg.MAX_LOSS is not None and metric > cfg.MAX_LOSS:
                return StopDecision(
                    StopReason.MAX_LOSS, f"{self.metric} = {metric:.6g} exceeds MAX_LOSS {cfg.MAX_LOSS:g}"
                )
            if cfg.PATIENCE_STEPS is not None and self.reference_step is not None:
                waited = global_step - self.reference_step
                if waited >= cfg.PATIENCE_STEPS:
                    return StopDecision(
                        StopReason.PATIENCE,
                        f"no improvement of {self.metric} by more than {cfg.MIN_DELTA:g} for {waited} steps "
                        f"(best {self.reference:.6g} at step {self.reference_step}; PATIENCE_STEPS {cfg.PATIENCE_STEPS})",
                    )
        if cfg.MIN_LR is not None and lr is not None and global_step >= self.warmup_steps and lr < cfg.MIN_LR:
            return StopDecision(
                StopReason.MIN_LR,
                f"learning rate {lr:.3g} fell below MIN_LR {cfg.MIN_LR:g} at step {global_step}",
            )
        if cfg.MAX_GRAD_NORM is not None and grad_norm is not None and grad_norm > cfg.MAX_GRAD_NORM:
            return StopDecision(
                StopReason.MAX_GRAD_NORM,
                f"gradient norm {grad_norm:.4g} exceeds MAX_GRAD_NORM {cfg.MAX_GRAD_NORM:g}",
            )
        return None

    def state_dict(self) -> dict[str, Any]:
        return EarlyStoppingState(
            version=STATE_VERSION, metric=self.metric, best=self.reference, step_of_best=self.reference_step
        ).as_data()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Tolerant: a checkpoint that monitored another metric restarts from no reference.
        if state.get("metric", self.metric) != self.metric:
            self.reference, self.reference_step = None, None
            return
        best = state.get("best")
        self.reference = float(best) if best is not None else None
        step = state.get("step_of_best")
        self.reference_step = int(step) if step is not None else None
