"""The run's callbacks as the loop sees them: when each ``on_step_end`` is due (one int compared per
step: ``step >= callbacks.next_due``), the events dispatched in order, the commits of checkpoints
handed to ``on_checkpoint`` on the main process, and their state by label in every checkpoint."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..callbacks import Callback, RunContext
from ..checkpoint.state.schemas import CallbacksState
from ..schedule.callback_steps import next_call

if TYPE_CHECKING:
    from ..schedule import ResolvedPlan

NEVER = 1 << 62  # no call due: the loop's comparison stays false


class CallbackList:
    # Each callback's own state is free-form (and may hold tensors): returned as built, not dumped.
    STATE_SCHEMA: ClassVar[type[CallbacksState]] = CallbacksState

    def __init__(self, callbacks: list[Callback], plan: ResolvedPlan, main_process: bool) -> None:
        self.callbacks = callbacks
        self.plan = plan
        self._length = (plan.total_steps, plan.optimizer_steps_per_epoch)  # what next_call reads of it
        self.labels = [timing.label for timing in plan.callbacks]
        self._next = [NEVER] * len(callbacks)
        self.next_due = NEVER
        # (step, path) of checkpoints committed and not yet announced (filled by the commit, which
        # may run on a background thread; main process only).
        self._committed: list[tuple[int, Path]] = []
        self._lock = threading.Lock()
        # Only the main process commits, so only it announces commits.
        self.wants_commits = main_process and any(_overrides(c, "on_checkpoint") for c in callbacks)
        self._pending = 0  # checkpoints saved and not yet announced
        self.run: RunContext | None = None  # what every event is handed (``setup``)

    @property
    def context(self) -> RunContext:
        assert self.run is not None, "CallbackList.setup comes first"
        return self.run

    def setup(self, run: RunContext) -> None:
        """``on_setup``; from here on every event is handed ``run``."""
        self.run = run
        for callback in self.callbacks:
            callback.on_setup(run)

    def start(self, step: int, resumed_from: Path | None = None) -> None:
        """From ``step`` (0, or the resumed step): the first call of each; ``on_fit_start``. A
        checkpoint's callback state is taken before its commit, so on the main process the
        checkpoint resumed from (``resumed_from``) is announced again to ``on_checkpoint``: the
        state then is what it was after that commit in an uninterrupted run."""
        if resumed_from is not None:
            self.checkpoint_saved(step)
            self.committed(step, resumed_from)
        for callback in self.callbacks:
            callback.on_fit_start(self.context)
        for i, (timing, callback) in enumerate(zip(self.plan.callbacks, self.callbacks, strict=True)):
            asks = _overrides(callback, "on_step_end") and not callback.finished
            due = next_call(timing, step, *self._length) if asks else None
            self._next[i] = NEVER if due is None else due
        self.next_due = min(self._next, default=NEVER)
        self.announce_commits()  # the checkpoint resumed from, at once

    def step_end(self, step: int) -> None:
        """The loop calls this once ``step >= next_due``."""
        for i, callback in enumerate(self.callbacks):
            if self._next[i] <= step:
                callback.on_step_end(self.context, step)
                due = None if callback.finished else next_call(self.plan.callbacks[i], step, *self._length)
                self._next[i] = NEVER if due is None else due
        self.announce_commits()
        self.next_due = min(self._next, default=NEVER)
        if self._pending:
            self.next_due = min(self.next_due, step + 1)  # look again after the next step

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoint_saved(self, step: int) -> None:
        """A checkpoint of ``step`` is on its way to its commit: look for it after each step."""
        if self.wants_commits:
            self._pending += 1
            self.next_due = min(self.next_due, step + 1)

    def committed(self, step: int, path: Path) -> None:
        """Called by the commit (main process, maybe on a background thread)."""
        if self.wants_commits:
            with self._lock:
                self._committed.append((step, path))

    def announce_commits(self) -> None:
        """``on_checkpoint`` for every commit since the last look, in order."""
        if not self._pending:
            return
        with self._lock:
            done, self._committed = self._committed, []
        self._pending -= len(done)
        for step, path in done:
            for callback in self.callbacks:
                callback.on_checkpoint(self.context, step, path)

    # -- the other events ----------------------------------------------------------------------
    def validation_end(self, step: int, metrics: dict[str, float]) -> None:
        for callback in self.callbacks:
            callback.on_validation_end(self.context, step, metrics)

    def fit_end(self, summary: dict[str, Any]) -> None:
        for callback in self.callbacks:
            callback.on_fit_end(self.context, summary)

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            label: callback.state_dict() for label, callback in zip(self.labels, self.callbacks, strict=True)
        }

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Each callback's state by its label; what a user should know (a callback new since the
        checkpoint starts fresh, one no longer listed is dropped)."""
        notes = []
        for label, callback in zip(self.labels, self.callbacks, strict=True):
            if label in state:
                callback.load_state_dict(state[label])
            else:
                notes.append(f"callback {label} has no state in the checkpoint: it starts fresh")
        notes += [
            f"callback {label} of the checkpoint is not in this run: its state is dropped"
            for label in state
            if label not in self.labels
        ]
        return notes


def _overrides(callback: Callback, method: str) -> bool:
    return getattr(type(callback), method) is not getattr(Callback, method)
