"""``OpsSchedule``: the questions the training loop asks, answered from the resolved plan.

Step-keyed questions take ``k``, the index of the optimizer update being made (0-based, equal to
``global_step`` before it is incremented). Boundary questions take the number of completed epochs
``epoch`` (1-based) and ``final``, true at the last boundary of the run (the last epoch, or an
early stop / MAX_STEPS cut-off). The boundary after epoch ``e`` is at ``plan.boundary_step(e)``; a
STEPS or TARGET_TOKENS run's last epoch may be partial and ends at ``total_steps``, mid-epoch.

Where the loop itself knows the point better than the plan (an epoch of a stream of unknown
length ends where the stream ends; a mid-epoch validation or checkpoint after a step), it asks a
view bound to that ``Boundary``: ``ops.at(point)``."""

from __future__ import annotations

import math
from collections.abc import Iterator

from .boundaries import Boundary, Interval, mask_pass_name
from .resolved import ResolvedPlan
from .stops import StopDecision, StopReason


class OpsSchedule:
    def __init__(self, plan: ResolvedPlan, point: Boundary | None = None) -> None:
        self.plan = plan
        self._point = point

    def at(self, point: Boundary) -> OpsSchedule:
        """This schedule with its boundary questions answered at ``point``, whatever ``(epoch,
        final)`` they are asked with: a mid-epoch point, or a boundary whose steps the loop found
        itself (a stream of unknown length ends where it ends). A task's ``validation_passes(ops,
        epoch, final)`` is handed such a view, so a task of one's own needs no change for them."""
        return OpsSchedule(self.plan, point)

    # -- events (docs/semantics.md §5, §7) ---------------------------------------------------------------------
    def boundary(self, epoch: int, final: bool = False) -> Boundary:
        """The boundary after ``epoch`` completed epochs (the point this view is bound to, if any)."""
        if self._point is not None:
            return self._point
        plan = self.plan
        last = plan.epochs is not None and epoch >= plan.epochs
        return Boundary(epoch, plan.boundary_step(epoch), plan.boundary_step(epoch - 1), final or last)

    def final_point(self) -> Boundary:
        """The run's last boundary, at ``total_steps``. Epochs of unknown length: where the last
        pass began is found as the run goes; taken as step 0, every step interval counts as crossed."""
        plan = self.plan
        if plan.epochs is not None and plan.known_epochs:
            return self.boundary(plan.epochs, True)
        return Boundary(0, plan.total_steps, 0, final=True)

    def after_step(self, epoch: int, global_step: int) -> Boundary:
        """The point after optimizer step ``global_step - 1`` inside epoch ``epoch`` (1-based)."""
        return Boundary(epoch, global_step, global_step - 1, mid=True)

    def max_steps_stop(self, global_step: int) -> StopDecision | None:
        """The stop at ``TRAIN.EARLY_STOP.MAX_STEPS`` once ``global_step`` steps are done (None before,
        and without it)."""
        max_steps = self.plan.max_steps
        if max_steps is not None and global_step >= max_steps:
            return StopDecision(StopReason.MAX_STEPS, f"reached MAX_STEPS ({max_steps})")
        return None

    def is_final_epoch(self, epoch: int) -> bool:
        return self.boundary(epoch).final

    def should_end_epoch(self, epoch: int, global_step: int) -> bool:
        """Whether ``epoch`` is over after ``global_step`` completed optimizer steps: its dataloader
        is exhausted then, except in the partial last epoch of a STEPS or TARGET_TOKENS run, which
        ends at ``total_steps`` with batches left. (Epochs of unknown length end where the stream
        does; only ``total_steps`` ends one early.)"""
        if self.plan.optimizer_steps_per_epoch is None:
            return global_step >= self.plan.total_steps
        return global_step >= self.plan.boundary_step(epoch)

    def _is_boundary_step(self, global_step: int) -> bool:
        ope = self.plan.optimizer_steps_per_epoch
        return global_step >= self.plan.total_steps or (ope is not None and global_step % ope == 0)

    @staticmethod
    def _fires(interval: Interval | None, point: Boundary, at_step: bool) -> bool:
        return interval is not None and interval.fires_at(point, at_step)

    def should_save_checkpoint(self, epoch: int, final: bool = False) -> bool:
        point, plan = self.boundary(epoch, final), self.plan
        return point.final or self._fires(plan.checkpoint, point, plan.mid_epoch_checkpoints)

    def should_save_mid_epoch_checkpoint(self, global_step: int) -> bool:
        """``CHECKPOINT.MID_EPOCH``: at each multiple of the step interval, unless that step ends an
        epoch or the run (the boundary checkpoint covers it, with its validations)."""
        interval = self.plan.checkpoint
        if not self.plan.mid_epoch_checkpoints or interval is None or interval.unit != "steps":
            return False  # asked after every step: nothing built for the common answer
        return global_step % interval.every == 0 and not self._is_boundary_step(global_step)

    def should_validate(self, epoch: int, final: bool = False) -> bool:
        point, plan = self.boundary(epoch, final), self.plan
        if plan.validation is None:
            return False
        return point.final or self._fires(plan.validation, point, plan.mid_epoch_validation)

    def should_validate_mask_meta(self, epoch: int, final: bool = False) -> bool:
        point = self.boundary(epoch, final)
        return self._fires(self.plan.mask_meta_validation, point, self.plan.mid_epoch_validation)

    def should_run_exhaustive_validation(self, epoch: int, final: bool = False) -> bool:
        return bool(self.plan.exhaustive_combinations) and self.boundary(epoch, final).final

    def should_validate_partial_mask_meta(self, epoch: int, final: bool = False) -> bool:
        # The exhaustive passes replace the whitelist passes at the final boundary.
        if self.should_run_exhaustive_validation(epoch, final):
            return False
        point = self.boundary(epoch, final)
        return self._fires(self.plan.partial_mask_meta_validation, point, self.plan.mid_epoch_validation)

    def should_validate_mid_epoch(self, global_step: int) -> bool:
        """Whether any validation pass is due after step ``global_step - 1`` inside an epoch
        (``SCHEDULE.VALIDATION.MID_EPOCH``); the task then says which."""
        plan = self.plan
        if not plan.mid_epoch_validation:
            return False
        intervals = (plan.validation, plan.mask_meta_validation, plan.partial_mask_meta_validation)
        due = any(iv is not None and iv.unit == "steps" and global_step % iv.every == 0 for iv in intervals)
        return due and not self._is_boundary_step(global_step)

    def partial_mask_combinations(self, epoch: int, final: bool = False) -> tuple[tuple[str, ...], ...]:
        """The component combinations to mask at this boundary, one validation pass each."""
        if self.should_run_exhaustive_validation(epoch, final):
            return self.plan.exhaustive_combinations
        if self.should_validate_partial_mask_meta(epoch, final):
            return self.plan.partial_validation_whitelist
        return ()

    @staticmethod
    def partial_pass_name(combination: tuple[str, ...]) -> str:
        return mask_pass_name(combination)

    # -- per step (docs/semantics.md §3, §4 and docs/design.md §5) -------------------------------------------------------------
    def get_meta_mask_prob(self, k: int) -> float:
        return self.plan.meta_mask(k)

    def get_partial_mask_enabled(self, k: int) -> bool:
        return self.plan.partial_mask.active(k)

    def get_partial_mask_prob(self, k: int) -> float:
        return self.plan.partial_mask(k)

    def get_mixup_prob(self, k: int) -> float:
        return self.plan.mixup(k)

    def get_mixup_group_level(self, k: int) -> str | None:
        # Level switching is not supported: GROUP_LEVELS[0] all run.
        return self.plan.mixup_group_level

    def should_update_gradnorm(self, k: int) -> bool:
        p = self.plan
        return p.gradnorm_enabled and k >= p.gradnorm_warmup_steps and k % p.gradnorm_interval == 0

    # -- logging: ``global_step`` counts completed optimizer steps --------------------------------
    def _every(self, interval: int, global_step: int) -> bool:
        return global_step > 0 and (global_step % interval == 0 or global_step == self.plan.total_steps)

    def should_log_metrics(self, global_step: int) -> bool:
        return self._every(self.plan.metrics_interval, global_step)

    def should_log_console(self, global_step: int) -> bool:
        """Whether the progress bar shows this step's metrics record (a metrics step)."""
        return self._every(self.plan.console_interval, global_step)

    def should_log_to_trackers(self, global_step: int) -> bool:
        """Whether this step's metrics record also goes to the trackers (a metrics step)."""
        return self._every(self.plan.tracker_interval, global_step)

    def should_log_lr(self, global_step: int) -> bool:
        return self._every(self.plan.lr_interval, global_step)

    # -- whole-run views, for ``plan`` -----------------------------------------------------------
    def events(self) -> dict[str, EventEpochs]:
        """The epochs of every boundary event, computed from their intervals (see ``EventEpochs``)."""
        plan = self.plan
        last = plan.epochs
        assert last is not None, "epochs of unknown length have no event epochs"
        ckpt, val = plan.mid_epoch_checkpoints, plan.mid_epoch_validation
        return {
            "validation": EventEpochs(plan, plan.validation, self.should_validate(last), on_step=val),
            "mask_meta_validation": EventEpochs(
                plan, plan.mask_meta_validation, self.should_validate_mask_meta(last), on_step=val
            ),
            "partial_mask_meta_validation": EventEpochs(
                plan,
                plan.partial_mask_meta_validation,
                self.should_validate_partial_mask_meta(last),
                on_step=val,
            ),
            "checkpoint": EventEpochs(plan, plan.checkpoint, self.should_save_checkpoint(last), on_step=ckpt),
            "exhaustive_validation": EventEpochs(plan, None, self.should_run_exhaustive_validation(last)),
        }

    def event_epochs(self) -> dict[str, list[int]]:
        return {name: epochs.all() for name, epochs in self.events().items()}


class EventEpochs:
    """The epochs at which one boundary event happens, in order.

    Before the last epoch, every boundary question of ``OpsSchedule`` comes down to whether the
    event's interval fires there; only the last epoch forces (validation, checkpoints) or suppresses
    (whitelist passes under the exhaustive ones) events, and ``at_last`` holds that answer.
    (test_plan_cli checks both against asking every epoch.) So the next or previous event is a few
    integer operations away, and listing them all is a range or one comprehension over the
    events: ``plan`` for 10**7 epochs costs what it does for 10, and ``plan --json`` its output.
    """

    def __init__(
        self, plan: ResolvedPlan, interval: Interval | None, at_last: bool, on_step: bool = False
    ) -> None:
        self.plan, self.interval, self.at_last = plan, interval, at_last
        if plan.optimizer_steps_per_epoch is None or plan.epochs is None:
            raise ValueError("epochs of unknown length (a stream without __len__) have no event epochs")
        self.ope, self.last_epoch = plan.optimizer_steps_per_epoch, plan.epochs
        # Fires every N epochs; or, ``on_step`` (MID_EPOCH checkpoints: a boundary has one when it
        # falls on a multiple of S steps), every S / gcd(S, ope) epochs, where e * ope is one.
        self.every_epochs: int | None = None
        if interval is not None and interval.unit == "epochs":
            self.every_epochs = interval.every
        elif interval is not None and on_step:
            self.every_epochs = interval.every // math.gcd(interval.every, self.ope)

    def _next_before_last(self, epoch: int) -> int | None:
        """The first epoch ``>= epoch`` (>= 1) and before the last at which the interval fires."""
        iv, ope, last = self.interval, self.ope, self.last_epoch
        if iv is None:
            return None
        if self.every_epochs is not None:
            found = -(-epoch // self.every_epochs) * self.every_epochs
        else:  # the boundary that reaches the first multiple of S after the previous boundary
            found = -(-((epoch - 1) * ope // iv.every + 1) * iv.every // ope)
        return found if found < last else None

    def _previous_before_last(self, epoch: int) -> int | None:
        """The last epoch ``<= epoch`` (< the last epoch) at which the interval fires."""
        iv, ope = self.interval, self.ope
        if iv is None or epoch < 1:
            return None
        if self.every_epochs is not None:
            return epoch // self.every_epochs * self.every_epochs or None
        multiple = epoch * ope // iv.every * iv.every  # the last multiple of S this boundary reached
        return -(-multiple // ope) if multiple > 0 else None

    def after(self, epoch: int) -> int | None:
        """The first event epoch at or after ``epoch`` (None: no more)."""
        last = self.last_epoch
        found = self._next_before_last(max(epoch, 1)) if epoch < last else None
        if found is not None:
            return found
        return last if self.at_last and epoch <= last else None

    def before(self, epoch: int) -> int | None:
        """The last event epoch at or before ``epoch`` (None: none)."""
        last = self.last_epoch
        if epoch >= last and self.at_last:
            return last
        return self._previous_before_last(min(epoch, last - 1))

    def all(self) -> list[int]:
        """Every event epoch, in order."""
        iv, ope, last = self.interval, self.ope, self.last_epoch
        out: list[int]
        if iv is None:
            out = []
        elif self.every_epochs is not None:
            out = list(range(self.every_epochs, last, self.every_epochs))
        elif iv.every <= ope:  # every epoch spans at least one multiple of S
            out = list(range(1, last))
        else:  # multiples of S more than an epoch apart: each reached at its own boundary
            s = iv.every
            out = [-(-m * s // ope) for m in range(1, (last - 1) * ope // s + 1)]
        if self.at_last:
            out.append(last)
        return out

    def __iter__(self) -> Iterator[int]:
        return iter(self.all())

    def first(self, n: int) -> list[int]:
        out: list[int] = []
        epoch = self.after(1)
        while epoch is not None and len(out) < n:
            out.append(epoch)
            epoch = self.after(epoch + 1)
        return out

    def last(self, n: int) -> list[int]:
        out: list[int] = []
        epoch = self.before(self.last_epoch)
        while epoch is not None and len(out) < n:
            out.append(epoch)
            epoch = self.before(epoch - 1)
        return out[::-1]
