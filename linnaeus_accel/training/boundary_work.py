"""The events at a point of the run (docs/semantics.md §5, §7): an epoch boundary, or a step inside an epoch
where a mid-epoch checkpoint or validation is due. In docs/semantics.md §5's order: the checkpoint first (it
records the validation passes still due, so a run killed during them reruns exactly the missing
ones), then the passes, then early stopping. A run resumed from a checkpoint taken at such a point
finishes its passes first (``finish_interrupted``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from torch import nn

from ..checkpoint.manager import CheckpointManager
from ..process.faults import fault_point
from ..process.preemption import PreemptionWatch
from ..progress import TrainingProgress
from ..run_directory.outputs import RunOutputs
from ..schedule import EarlyStopping, OpsSchedule, StopDecision, StopReason
from ..schedule.boundaries import Boundary
from ..tasks import Task, ValidationPass
from .metrics.meter import TrainMeter
from .step.batches import BatchSource
from .validation.data import ValidationBatches
from .validation.passes import PassStopped, run_pass, validation_line


class BoundaryWork:
    def __init__(
        self,
        accelerator: Accelerator,
        ranking_metric: str,
        model: nn.Module,
        task: Task,
        ops: OpsSchedule,
        progress: TrainingProgress,
        val_batches: BatchSource | None,
        checkpoints: CheckpointManager,
        preemption: PreemptionWatch,
        early_stopping: EarlyStopping,
        meter: TrainMeter,
        ranking_mode: str,
        on_validation_end: Callable[[int, dict[str, float]], None],
        out: RunOutputs,
    ) -> None:
        self.accelerator, self.model, self.task, self.ops = accelerator, model, task, ops
        self.ranking_metric = ranking_metric  # what ranks checkpoints and is the best metric
        self.progress, self.val_batches, self.checkpoints = progress, val_batches, checkpoints
        self.preemption, self.early_stopping, self.meter = preemption, early_stopping, meter
        self.ranking_mode, self.on_validation_end = ranking_mode, on_validation_end
        self.out = out
        self.final_done = False  # the run's last boundary has run
        self.last_validation: dict[str, float] = {}
        self.passes_done: dict[str, dict[str, float]] = {}  # by prefix, at the latest point

    def metrics_state(self) -> dict[str, Any]:
        """What ``Trainer.dump_metrics_state`` returns (see there)."""
        progress = self.progress.state_dict()
        return {
            "global_step": progress["global_step"],
            "epoch": progress["epoch"],
            "stage": progress["current_stage"],
            "validation": {
                "pending": progress["pending_validations"],
                "completed": progress["completed_validations"],
                "passes": {prefix: dict(m) for prefix, m in self.passes_done.items()},
                "last": dict(self.last_validation),
            },
            "best_metric": progress["best_metric"],
            "early_stopping": self.early_stopping.state_dict(),
            "train_window": self.meter.state_dict(),
        }

    # -- the points --------------------------------------------------------------------------------
    def mid_epoch(self, epoch: int, step: int) -> StopDecision | None:
        """SCHEDULE.CHECKPOINT.MID_EPOCH / SCHEDULE.VALIDATION.MID_EPOCH at step multiples."""
        ops = self.ops
        validate = self.val_batches is not None and ops.should_validate_mid_epoch(step)
        checkpoint = ops.should_save_mid_epoch_checkpoint(step)
        if not (validate or checkpoint):
            return None
        point = ops.after_step(epoch, step)
        passes = self.task.validation_passes(ops.at(point), epoch, False) if validate else []
        return self._run(point, passes, checkpoint)

    def epoch_boundary(self, epoch: int, final: bool, preempted: bool = False) -> StopDecision | None:
        """``preempted``: checkpoint whatever the schedule says; the first pass then sees the flag
        and stops."""
        if self.ops.plan.known_epochs:
            point = self.ops.boundary(epoch, final)
        else:  # the pass ended where the stream did: the loop knows the steps, not the plan
            point = Boundary(epoch, self.progress.global_step, self.progress.epoch_start_step, final)
        ops = self.ops.at(point)
        passes = self.task.validation_passes(ops, epoch, final) if self.val_batches is not None else []
        self.final_done = final
        return self._run(point, passes, preempted or ops.should_save_checkpoint(epoch, final))

    def finish_interrupted(self) -> StopDecision | None:
        """After resuming from a checkpoint taken at a boundary or a mid-epoch validation point: run
        exactly the passes its journal does not record as complete, then carry on. A finished run
        trained longer goes on from its old end as this run's plan says (``_extend_from``)."""
        record = self.checkpoints.boundary
        if record is None:
            return None
        point, total = self._recorded_point(record), self.ops.plan.total_steps
        max_steps = self.ops.max_steps_stop(point.step) if point.final else None
        if point.final and point.step < total and max_steps is None:
            return self._extend_from(point)
        self.final_done = point.final
        if point.final and point.step >= total and self.progress.batches_seen_in_epoch:
            self.progress.end_epoch()  # the cut last epoch counts as trained (see Trainer._run)
        stop = None
        if self.progress.has_pending_validations():
            assert self.val_batches is not None
            passes = self.task.validation_passes(self.ops.at(point), point.epoch, point.final)
            stop = self._validate(point, passes, self._journal())
        return stop or max_steps

    def _journal(self) -> dict[str, dict[str, float]]:
        """The passes the resumed checkpoint's journal records as complete, by prefix."""
        return self.checkpoints.journal()

    def _extend_from(self, old_end: Boundary) -> StopDecision | None:
        """A finished run trained longer, from the checkpoint of its last boundary. What the old run
        validated there is its history (kept in metrics.jsonl); from here on the run does what a
        fresh run of the new length does at that step: if the old end cut an epoch short (its data
        position was kept), the epoch goes on and only a mid-epoch validation due at that step runs;
        else the boundary's passes under the new plan run (the journal's, when they read the same
        data: the old end's whole-split passes under MAX_BATCHES do not)."""
        progress, step = self.progress, old_end.step
        if progress.batches_seen_in_epoch:
            point = self.ops.after_step(progress.current_epoch, step)
            due = self.ops.should_validate_mid_epoch(step)
        else:
            point = dataclasses.replace(old_end, final=False)
            due = True
        progress.clear_validations()  # the old end's passes: done, or no longer due
        if self.val_batches is None or not due:
            return None
        passes = self.task.validation_passes(self.ops.at(point), point.epoch, False)
        if not passes:
            return None
        self.out.truncate_metrics(after_step=step)  # this point's validation replaces the old end's
        for vpass in passes:
            progress.schedule_validation(vpass.stage, vpass.partial_index)
        whole_at_end = isinstance(self.val_batches, ValidationBatches) and self.val_batches.final_whole
        return self._validate(point, passes, self._journal() if not point.mid and not whole_at_end else {})

    def _recorded_point(self, record: dict[str, Any]) -> Boundary:
        """The event point a checkpoint recorded (before mid-epoch events, only epoch and final)."""
        epoch, final = int(record["epoch"]), bool(record["final"])
        if "step" in record:
            return Boundary(
                epoch,
                int(record["step"]),
                int(record["previous_step"]),
                final,
                bool(record.get("mid", False)),
            )
        return self.ops.boundary(epoch, final)

    # -- what happens there --------------------------------------------------------------------
    def _run(self, point: Boundary, passes: list[ValidationPass], checkpoint: bool) -> StopDecision | None:
        """The passes due at ``point``, after its checkpoint (which records them as pending)."""
        if point.mid:
            self.progress.clear_validations()  # the previous mid-epoch point's are done
        for vpass in passes:
            self.progress.schedule_validation(vpass.stage, vpass.partial_index)
        if checkpoint:
            self.checkpoints.save(boundary=dataclasses.asdict(point))
        return self._validate(point, passes, done={})

    def _validate(
        self, point: Boundary, passes: list[ValidationPass], done: dict[str, dict[str, float]]
    ) -> StopDecision | None:
        step = self.progress.global_step
        journal = self.checkpoints.journal_at(step)
        self.passes_done = done  # filled pass by pass: Trainer.dump_metrics_state() shows it
        if isinstance(self.val_batches, ValidationBatches):  # SCHEDULE.VALIDATION.MAX_BATCHES
            self.val_batches.select(final=point.final)
        results: dict[str, float] = {}
        for vpass in passes:
            if self.preemption.should_stop(step, now=True):
                return self._preempt(dataclasses.asdict(point), journal, done)
            metrics = done.get(vpass.prefix)
            if metrics is None:
                self.progress.start_validation(vpass.stage)
                assert self.val_batches is not None
                try:  # agreed every few batches, as between optimizer steps
                    metrics = run_pass(
                        self.accelerator, self.model, self.val_batches, self.task, vpass,
                        stop=self.preemption.should_stop,
                    )  # fmt: skip
                except PassStopped:
                    return self._preempt(dataclasses.asdict(point), journal, done)
                self.checkpoints.record_validation(journal, {"prefix": vpass.prefix, "metrics": metrics})
                done[vpass.prefix] = metrics
                fault_point("validation_pass")
            self.progress.complete_validation(vpass.stage, vpass.partial_index)
            results.update(metrics)
        if not results:
            return None
        self.on_validation_end(step, results)  # callbacks may add metrics of their own (val_ema/)
        results["epoch"] = float(point.epoch)
        self.out.log(results, step)
        label = f"step {step} (epoch {point.epoch})" if point.mid else f"epoch {point.epoch}"
        self.out.say(validation_line(label, results, self.task.metric_directions))
        self.last_validation = results
        self.checkpoints.record_metric(step, results)
        return self._early_stop(results)

    def _preempt(
        self, boundary: dict[str, Any], journal: Path | None, done: dict[str, dict[str, float]]
    ) -> StopDecision:
        """Preempted between validation passes: the passes done so far are journalled in this
        point's checkpoint (taken now if the schedule did not ask for one), so the resumed run runs
        only the rest."""
        if journal is None:
            self.checkpoints.save(boundary=boundary)
            for prefix, metrics in done.items():
                self.checkpoints.record_validation(
                    self.checkpoints.newest, {"prefix": prefix, "metrics": metrics}
                )
        return StopDecision(
            StopReason.PREEMPTED,
            f"{self.preemption.reason} during validation at step {self.progress.global_step}",
        )

    def _early_stop(self, results: dict[str, float]) -> StopDecision | None:
        es = self.early_stopping
        ranking = self.ranking_metric
        if ranking in results:
            self.progress.update_best(ranking, results[ranking], self.ranking_mode)
        step = self.progress.global_step
        decision = es.check(
            step,
            results.get(es.metric),
            lr=self.ops.plan.lr(max(0, step - 1)),
            grad_norm=self.meter.last_grad_norm(),
        )
        # Taken on the main process, applied on all: no process keeps training alone (docs/semantics.md §5).
        shared = broadcast_object_list([decision], from_process=0)
        return shared[0]  # type: ignore[no-any-return]
