"""Getting past a run's own instabilities (``TRAIN.NONFINITE: rollback``, ``TRAIN.LOSS_SPIKE``,
``TRAIN.ROLLBACK``): what PaLM's team did by hand around each loss spike, done by the loop.

Detection costs nothing on quiet steps: it reads what a metric record reads anyway (the window's
mean loss, every step's loss and gradient norm, added up over processes, so every process decides
alike), and before each checkpoint the open window is checked for a NaN (a host read at checkpoint
time). A rollback then reloads the newest committed checkpoint from before the window that went
wrong (the model, optimizer, RNG, GradNorm and callbacks' state; not the run's position), and the
loop skips the data of every step from there through the window plus ``SKIP_STEPS``: those steps
load their batches and count them, but make no update. The global step, the data position, the
LR, validation and checkpoint points and token counts stay the plan's, so the run still ends
where its plan says, with fewer optimizer updates (docs/semantics.md §8).

Exact: the decision is a pure function of what was trained, the state (spike history, rollbacks,
the skip) is in every checkpoint, and a checkpoint from inside a rolled-back span resumes into the
same rollback; retention never removes the checkpoint a rollback may need (``protected``).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from accelerate import Accelerator

from ..checkpoint.manager import CheckpointManager
from ..checkpoint.state.schemas import RecoveryState, RollbackRecord
from ..config.sections import TrainConfig
from ..process.failures import RunFailed
from ..process.faults import fault_point
from ..progress import TrainingProgress
from ..run_directory.outputs import RunOutputs
from .metrics.meter import NonFiniteLoss, TrainMeter

# What a rollback does not take back from the checkpoint: where the run is (its step, data
# position, counts and validation history), early stopping's view of those validations, and this.
KEPT = ("progress", "early_stopping", "recovery")


def spikes(history: list[float], loss: float, factor: float, window: int) -> bool:
    """Whether ``loss`` spikes over the running mean of the last ``window`` records of ``history``
    (armed once there are that many; a mean at or below 0 gives no threshold)."""
    if len(history) < window:
        return False
    mean = math.fsum(history[-window:]) / window
    return mean > 0 and loss > factor * mean


def rollback_target(steps: list[int], anchor: int, spans: list[tuple[int, int]]) -> int | None:
    """Among committed checkpoint ``steps``, the one a rollback goes back to: the newest at or
    before ``anchor`` (the last record known good) that no earlier rollback's span ``(back_to,
    detected_at]`` holds (those were trained through a window that went wrong)."""
    usable = [s for s in steps if s <= anchor and not any(lo < s <= hi for lo, hi in spans)]
    return max(usable) if usable else None


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


class Recovery:
    """The run's loss-spike rule and rollbacks (see the module docstring); ``due`` is set at a
    record that calls for a rollback, which the loop then asks for (``roll_back``)."""

    STATE_SCHEMA: ClassVar[type[RecoveryState]] = RecoveryState

    def __init__(
        self,
        accelerator: Accelerator,
        train: TrainConfig,
        checkpoints: CheckpointManager,
        meter: TrainMeter,
        progress: TrainingProgress,
        out: RunOutputs,
    ) -> None:
        self.accelerator, self.checkpoints, self.meter, self.progress, self.out = (
            accelerator, checkpoints, meter, progress, out,
        )  # fmt: skip
        self.on_nonfinite = train.NONFINITE == "rollback"
        self.spike, self.rollback = train.LOSS_SPIKE, train.ROLLBACK
        self.watches_spikes = self.spike.ACTION != "off"
        self.rolls_back = self.on_nonfinite or self.spike.ACTION == "rollback"
        self.state = RecoveryState()
        self.due: tuple[str, float] | None = None  # (rule, loss) of a rollback the loop must take
        self._skip_open = False  # the last rollback's skip has not been counted yet

    # -- the loop's questions ------------------------------------------------------------------------
    def should_skip(self, step: int) -> bool:
        """Whether global step ``step`` (0-based) is one whose data a rollback skips (an int
        compared, and one flag, on every step)."""
        if step < self.state.skip_until:
            return True
        if self._skip_open:  # the first step after a skip: what it skipped is counted, once
            self._count_skipped()
        return False

    def record(self, step: int, loss: float | None) -> None:
        """A metric record at ``step`` whose window was finite; ``loss``: its mean training loss
        (None: no step of it trained, the window was skipped data)."""
        state = self.state
        if loss is None:  # nothing trained since the record before: as good as it (or as a streak)
            state.anchor = state.anchor if state.streak else step
            return
        if not self.watches_spikes:
            state.anchor = step
            return
        if spikes(state.history, loss, self.spike.FACTOR, self.spike.WINDOW):
            state.streak.append(loss)  # anchor stays at the last record before the streak
            if len(state.streak) >= self.spike.CONSECUTIVE:
                if self.spike.ACTION == "stop":
                    raise self._stop(step, loss)
                self.due = ("spike", loss)
            return
        state.history = [*state.history, *state.streak, loss][-self.spike.WINDOW :]
        state.streak = []
        state.anchor = step

    def nonfinite(self, step: int, bad: NonFiniteLoss) -> bool:
        """A record found a NaN or infinite loss or gradient norm: True when a rollback is due
        (TRAIN.NONFINITE: rollback), False when the caller stops the run as before."""
        if not self.on_nonfinite:
            return False
        self.due = ("nonfinite", bad.value)
        return True

    def before_checkpoint(self, step: int) -> None:
        """Before a checkpoint of ``step`` is written: a NaN in the open window (a step since the
        last record) is rolled back first, so that the checkpoint holds the good state
        (collective; nothing to do unless TRAIN.NONFINITE is rollback)."""
        if not self.on_nonfinite:
            return
        acc = self.accelerator
        bad = acc.reduce(torch.tensor([0.0 if self.meter.window_is_finite() else 1.0], device=acc.device))
        if bad.item() > 0:
            self.due = ("nonfinite", math.nan)
            self.roll_back(step)

    # -- the rollback ------------------------------------------------------------------------------
    def roll_back(self, step: int) -> None:
        """Take the rollback that is due at ``step`` (every process): the newest committed
        checkpoint at or before the last good record, outside any span rolled back before, is
        reloaded, and the data through ``step + SKIP_STEPS`` is skipped. One more than
        TRAIN.ROLLBACK.MAX, or no checkpoint to go back to, fails the run."""
        assert self.due is not None
        rule, loss = self.due
        self.due = None
        state = self.state
        if len(state.rollbacks) >= self.rollback.MAX:
            raise self._failure(
                step, rule, loss,
                f"the run has rolled back {_times(len(state.rollbacks))} already (TRAIN.ROLLBACK.MAX)",
                "raise TRAIN.ROLLBACK.MAX or TRAIN.ROLLBACK.SKIP_STEPS, or lower the learning rate",
            )  # fmt: skip
        self.checkpoints.settle()  # the newest checkpoint's commit is done (every process)
        path = self.checkpoints.rollback_target(
            lambda steps: rollback_target(steps, state.anchor, self._spans()), self.out.say
        )
        if path is None:
            raise self._failure(
                step, rule, loss,
                f"no committed checkpoint at or before step {state.anchor} is left to roll back to",
                "checkpoint more often (SCHEDULE.CHECKPOINT.INTERVAL_STEPS)",
            )  # fmt: skip
        self.progress.settle_tokens()
        saved = self.checkpoints.restore_training(path, keep=KEPT)
        fault_point("rollback")  # loaded, nothing of the rollback recorded yet
        back_to = int(saved["global_step"])
        self.meter.restart(self.progress.samples_seen, self.progress.tokens_seen)
        # The run ends where its plan says: a skip cannot reach past it.
        end = self.progress.expected_total_steps
        skip_until = step + self.rollback.SKIP_STEPS
        skip_until = skip_until if end is None else max(step, min(skip_until, end))
        state.rollbacks.append(
            RollbackRecord(
                detected_at=step, rule=rule, loss=loss if math.isfinite(loss) else None, back_to=back_to, checkpoint=path.name,
                skip_until=skip_until, skipped_steps=skip_until - back_to,
                samples_at_checkpoint=int(saved.get("samples_seen") or 0),
                tokens_at_checkpoint=int(saved.get("tokens_seen") or 0),
            )
        )  # fmt: skip
        state.skip_until, state.streak, state.anchor = skip_until, [], step
        self._skip_open = True
        what = "a non-finite loss" if rule == "nonfinite" else f"a loss spike ({loss:.4g})"
        self.out.say(
            f"rolled back: {what} at step {step}; reloaded {path.name} and skipping the data of steps "
            f"{back_to + 1}..{skip_until} ({skip_until - back_to} steps without an update); rollback "
            f"{len(state.rollbacks)} of at most {self.rollback.MAX}"
        )
        self.out.log({"train/rollbacks": float(len(state.rollbacks))}, step)

    def protected(self, steps: list[int]) -> set[int]:
        """Among the committed checkpoints ``steps``, the one a rollback would go back to now:
        retention keeps it."""
        target = rollback_target(steps, self.state.anchor, self._spans())
        return set() if target is None else {target}

    def _spans(self) -> list[tuple[int, int]]:
        return [(r.back_to, r.detected_at) for r in self.state.rollbacks]

    def _count_skipped(self) -> None:
        """Once the skip is over (or the run), the last rollback's record gets the samples and
        tokens it never trained on: from its checkpoint to here (one host read of the tokens
        counted on the device, once per rollback)."""
        self._skip_open = False
        last = self.state.rollbacks[-1]
        self.progress.settle_tokens()
        last.samples_skipped = self.progress.samples_seen - last.samples_at_checkpoint
        last.tokens_skipped = self.progress.tokens_seen - last.tokens_at_checkpoint

    def node_local_problem(self) -> tuple[str, str]:
        key = "TRAIN.NONFINITE" if self.on_nonfinite else "TRAIN.LOSS_SPIKE.ACTION"
        return (
            key,
            "rollback reloads a checkpoint on every machine, but these machines do not share the output "
            "directory (node-local mode: each keeps its own part of each checkpoint): use a shared "
            "filesystem for ENV.OUTPUT.BASE_DIR, or stop (resume from the bucket by rerunning)",
        )

    # -- how it ends ---------------------------------------------------------------------------------
    def _stop(self, step: int, loss: float) -> RunFailed:
        return self._failure(
            step, "spike", loss, "TRAIN.LOSS_SPIKE.ACTION is stop",
            "set TRAIN.LOSS_SPIKE.ACTION: rollback to go back and skip the data, or lower the learning rate",
        )  # fmt: skip

    def _failure(self, step: int, rule: str, loss: float, why: str, fix: str) -> RunFailed:
        what = (
            f"the training loss or gradient norm became NaN or infinite by step {step}"
            if rule == "nonfinite"
            else f"the training loss spiked to {loss:.4g} at step {step} (over {self.spike.FACTOR:g}x the mean of "
            f"the {self.spike.WINDOW} records before, {self.spike.CONSECUTIVE} record(s) in a row)"
        )
        kept = self.checkpoints.newest
        where = (
            f"the last good checkpoint, {kept}, stays the resume point"
            if kept
            else "no checkpoint was written"
        )
        return RunFailed(f"{what}; {why}, so the run stops without saving that state: {where}. Fix: {fix}")

    def summary(self) -> list[dict[str, Any]]:
        """``summary.json``'s ``rollbacks``: one entry per rollback, in order."""
        if self._skip_open:  # the run ended inside the skip
            self._count_skipped()
        return [r.as_data() for r in self.state.rollbacks]

    def state_dict(self) -> dict[str, Any]:
        return self.state.as_data()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = RecoveryState.model_validate(state, strict=False)
        self._skip_open = bool(self.state.rollbacks) and self.state.rollbacks[-1].samples_skipped is None
