"""What the loop reports after an optimizer step: ``metrics.jsonl`` and the trackers at their
intervals (SCHEDULE.METRICS), the LR of every parameter group (known on the host: no device read),
the console's progress bar, and for a mixture ``samples_seen/<source>`` and ``tokens_seen/<source>``.

Only a logging step reads the device (the metric window's one host sync); a non-finite training
loss or gradient norm found there stops the run, naming the step it came from, or, with
TRAIN.NONFINITE: rollback, makes a rollback due; each finite record goes to the loss-spike rule
(``recovery``).
"""

from __future__ import annotations

from ...checkpoint.manager import CheckpointManager
from ...checkpoint.save.nonfinite import NonFiniteGuard
from ...progress import TrainingProgress
from ...run_directory.outputs import RunOutputs
from ...schedule import OpsSchedule
from ..recovery import Recovery
from ..step.batches import BatchSource
from .meter import NonFiniteLoss, TrainMeter


class TrainLog:
    def __init__(
        self,
        ops: OpsSchedule,
        progress: TrainingProgress,
        meter: TrainMeter,
        batches: BatchSource,
        checkpoints: CheckpointManager,
        nonfinite: NonFiniteGuard,
        recovery: Recovery,
        out: RunOutputs,
    ) -> None:
        self.ops, self.plan, self.progress, self.meter = ops, ops.plan, progress, meter
        self.batches, self.checkpoints, self.nonfinite, self.out = batches, checkpoints, nonfinite, out
        self.recovery = recovery

    def after_step(self, epoch: int, last: bool) -> None:
        step, ops, out = self.progress.global_step, self.ops, self.out
        if not (last or ops.should_log_metrics(step)):
            if ops.should_log_lr(step):
                out.log({f"lr/{label}": lr for label, lr in self.lrs(step).items()}, step)
            out.advance(1, epoch)
            return
        lrs = self.lrs(step) if last or ops.should_log_lr(step) else {}
        wait = self.batches.take_data_wait()
        try:
            metrics = self.meter.flush(self.progress.samples_seen, self.progress.settle_tokens(), lrs, wait)
        except NonFiniteLoss as bad:
            if self.recovery.nonfinite(step, bad):
                out.advance(1, epoch)
                return
            what = f"the {bad.what} was {bad.value} at step {step - bad.steps_ago}"
            raise self.nonfinite.failure(what, self.checkpoints.newest) from None
        # May make a rollback due, or stop; a window that trained no step has no loss to judge.
        self.recovery.record(step, metrics["train/loss"] if self.meter.trained_in_last_window else None)
        if rollbacks := len(self.recovery.state.rollbacks):
            metrics["train/rollbacks"] = int(rollbacks)
        metrics.update(self.source_metrics())
        metrics.update(self.checkpoints.take_timings())
        # SCHEDULE.METRICS.TRACKER_INTERVAL: the other records send the trackers their LR alone.
        to_trackers = last or ops.should_log_to_trackers(step)
        out.log(metrics, step, metrics if to_trackers else {f"lr/{label}": lr for label, lr in lrs.items()})
        if not (last or ops.should_log_console(step)):
            out.advance(1, epoch)
            return
        shown = {"loss": f"{metrics['train/loss']:.4f}" if "train/loss" in metrics else "skipped"}
        shown["lr"] = f"{self.plan.lr(step - 1):.2e}"
        # Token tasks are read in tokens/s (what LM papers and dashboards quote), others in samples/s.
        if "perf/tokens_per_s" in metrics:
            shown["tokens/s"] = f"{metrics['perf/tokens_per_s']:,.0f}"
        else:
            shown["samples/s"] = f"{metrics['perf/samples_per_s']:.0f}"
        if "perf/mfu" in metrics:
            shown["mfu"] = f"{100 * metrics['perf/mfu']:.3g}%"  # 0.036%, not 0.0%, on a CPU
        out.advance(1, epoch, shown)

    def lrs(self, step: int) -> dict[str, float]:
        """The LR of every parameter group at the optimizer step that made ``step``, by label."""
        return {c.label: self.plan.lr(step - 1, i) for i, c in enumerate(self.plan.lr_curves)}

    def source_metrics(self) -> dict[str, float]:
        """A mixture's per-source counts (empty for other datasets). The mixture knows in closed
        form how many samples of each source the first ``p`` positions of an epoch hold
        (``Mixture.seen_by_source``); the position is the progress's, on the host: no device work,
        exact after a resume and under any processes x accumulation."""
        dataset = self.batches.dataset
        seen_by_source = getattr(dataset, "seen_by_source", None)
        if not callable(seen_by_source):
            return {}
        # Samples of the current epoch in its global order: whole global batches (its last one may
        # be short, and DROP_LAST leaves the tail unread).
        global_batch = self.plan.batch_size * self.plan.world_size
        position = min(len(dataset), self.progress.batches_seen_in_epoch * global_batch)
        counts: dict[str, int] = seen_by_source(self.progress.epoch, position)
        per_sample = getattr(dataset, "tokens_per_sample", None)
        metrics = {f"samples_seen/{label}": float(n) for label, n in counts.items()}
        if per_sample is not None:
            metrics.update({f"tokens_seen/{label}": float(n * per_sample) for label, n in counts.items()})
        return metrics
