"""``OpsSchedule``: the questions the training loop asks, answered from the resolved plan.

Step-keyed questions take ``k``, the index of the optimizer update being made (0-based, equal to
``global_step`` before it is incremented). Boundary questions take the number of completed epochs
``epoch`` (1-based) and ``final``, true at the last boundary of the run (the last epoch, or an
early stop / MAX_STEPS cut-off). The boundary after epoch ``e`` is at ``plan.boundary_step(e)``; a
TARGET_TOKENS run's last epoch may be partial and ends at ``total_steps``, mid-epoch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from .events import Interval, mask_pass_name
from .plan import ResolvedPlan


class OpsSchedule:
    def __init__(self, plan: ResolvedPlan) -> None:
        self.plan = plan

    # -- epoch boundaries (SPEC §5) ------------------------------------------------------------
    def is_final_epoch(self, epoch: int) -> bool:
        return epoch >= self.plan.epochs

    def should_end_epoch(self, epoch: int, global_step: int) -> bool:
        """Whether ``epoch`` is over after ``global_step`` completed optimizer steps: its dataloader
        is exhausted then, except in the partial last epoch of a TARGET_TOKENS run, which ends at
        ``total_steps`` with batches left."""
        return global_step >= self.plan.boundary_step(epoch)

    def _is_boundary_step(self, global_step: int) -> bool:
        return global_step % self.plan.optimizer_steps_per_epoch == 0 or global_step >= self.plan.total_steps

    def _fires(self, interval: Interval | None, epoch: int) -> bool:
        if interval is None:
            return False
        step = self.plan.boundary_step(epoch)
        return interval.fires(epoch, step, self.plan.boundary_step(epoch - 1))

    def should_save_checkpoint(self, epoch: int, final: bool = False) -> bool:
        if self.plan.mid_epoch_checkpoints and self.plan.checkpoint is not None:
            # Steps fire where they fall; one that falls on this boundary is this boundary's checkpoint.
            on_boundary = self.plan.boundary_step(epoch) % self.plan.checkpoint.every == 0
            return final or self.is_final_epoch(epoch) or on_boundary
        return final or self.is_final_epoch(epoch) or self._fires(self.plan.checkpoint, epoch)

    def should_save_mid_epoch_checkpoint(self, global_step: int) -> bool:
        """``CHECKPOINT.MID_EPOCH``: at each multiple of the step interval, unless that step ends an
        epoch or the run (the boundary checkpoint covers it, with its validations)."""
        interval, plan = self.plan.checkpoint, self.plan
        if not plan.mid_epoch_checkpoints or interval is None or interval.unit != "steps":
            return False
        return global_step % interval.every == 0 and not self._is_boundary_step(global_step)

    def should_validate(self, epoch: int, final: bool = False) -> bool:
        if self.plan.validation is None:
            return False
        return final or self.is_final_epoch(epoch) or self._fires(self.plan.validation, epoch)

    def should_validate_mask_meta(self, epoch: int, final: bool = False) -> bool:
        return self._fires(self.plan.mask_meta_validation, epoch)

    def should_run_exhaustive_validation(self, epoch: int, final: bool = False) -> bool:
        return bool(self.plan.exhaustive_combinations) and (final or self.is_final_epoch(epoch))

    def should_validate_partial_mask_meta(self, epoch: int, final: bool = False) -> bool:
        # The exhaustive passes replace the whitelist passes at the final boundary.
        if self.should_run_exhaustive_validation(epoch, final):
            return False
        return self._fires(self.plan.partial_mask_meta_validation, epoch)

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

    # -- per step (SPEC §3, §4, §8) -------------------------------------------------------------
    def get_lr(self, k: int, group: int = 0) -> float:
        return self.plan.lr(k, group)

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

    def should_stop_at_max_steps(self, global_step: int) -> bool:
        return self.plan.max_steps is not None and global_step >= self.plan.max_steps

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
        mid = plan.mid_epoch_checkpoints and plan.checkpoint is not None
        return {
            "validation": EventEpochs(plan, plan.validation, self.should_validate(last)),
            "mask_meta_validation": EventEpochs(
                plan, plan.mask_meta_validation, self.should_validate_mask_meta(last)
            ),
            "partial_mask_meta_validation": EventEpochs(
                plan, plan.partial_mask_meta_validation, self.should_validate_partial_mask_meta(last)
            ),
            "checkpoint": EventEpochs(plan, plan.checkpoint, self.should_save_checkpoint(last), on_step=mid),
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
        # Fires every N epochs; or, ``on_step`` (MID_EPOCH checkpoints: a boundary has one when it
        # falls on a multiple of S steps), every S / gcd(S, ope) epochs, where e * ope is one.
        self.every_epochs: int | None = None
        if interval is not None and interval.unit == "epochs":
            self.every_epochs = interval.every
        elif interval is not None and on_step:
            self.every_epochs = interval.every // math.gcd(interval.every, plan.optimizer_steps_per_epoch)

    def _next_before_last(self, epoch: int) -> int | None:
        """The first epoch ``>= epoch`` (>= 1) and before the last at which the interval fires."""
        iv, ope, last = self.interval, self.plan.optimizer_steps_per_epoch, self.plan.epochs
        if iv is None:
            return None
        if self.every_epochs is not None:
            found = -(-epoch // self.every_epochs) * self.every_epochs
        else:  # the boundary that reaches the first multiple of S after the previous boundary
            found = -(-((epoch - 1) * ope // iv.every + 1) * iv.every // ope)
        return found if found < last else None

    def _previous_before_last(self, epoch: int) -> int | None:
        """The last epoch ``<= epoch`` (< the last epoch) at which the interval fires."""
        iv, ope = self.interval, self.plan.optimizer_steps_per_epoch
        if iv is None or epoch < 1:
            return None
        if self.every_epochs is not None:
            return epoch // self.every_epochs * self.every_epochs or None
        multiple = epoch * ope // iv.every * iv.every  # the last multiple of S this boundary reached
        return -(-multiple // ope) if multiple > 0 else None

    def after(self, epoch: int) -> int | None:
        """The first event epoch at or after ``epoch`` (None: no more)."""
        last = self.plan.epochs
        found = self._next_before_last(max(epoch, 1)) if epoch < last else None
        if found is not None:
            return found
        return last if self.at_last and epoch <= last else None

    def before(self, epoch: int) -> int | None:
        """The last event epoch at or before ``epoch`` (None: none)."""
        last = self.plan.epochs
        if epoch >= last and self.at_last:
            return last
        return self._previous_before_last(min(epoch, last - 1))

    def all(self) -> list[int]:
        """Every event epoch, in order."""
        iv, ope, last = self.interval, self.plan.optimizer_steps_per_epoch, self.plan.epochs
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
        epoch = self.before(self.plan.epochs)
        while epoch is not None and len(out) < n:
            out.append(epoch)
            epoch = self.before(epoch - 1)
        return out[::-1]
