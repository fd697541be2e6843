"""``Trainer``: the training loop on ``accelerate.Accelerator``.

Accelerate owns devices, mixed precision, all-reduce and process control; the task (``tasks/``)
owns everything that depends on what is trained; the trainer owns *when* things happen, and asks
the resolved plan (``OpsSchedule``) every time. The LR is set from the global step before each
optimizer step; no LR scheduler is prepared (Accelerate would step it once per process, SPEC §1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DataLoaderConfiguration,
    InitProcessGroupKwargs,
    broadcast_object_list,
    is_compiled_module,
    set_seed,
)
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..callbacks import Callback, build_callbacks, callback_entries, callback_name
from ..config import Config, ConfigError
from ..progress import TrainingConsistencyChecker, TrainingProgress
from ..run_directory.failures import NonFiniteGuard, RunFailed, collective_timeout
from ..run_directory.faults import fault_point
from ..run_directory.outputs import claim_output_dir, run_outputs
from ..run_directory.preemption import PreemptionWatch
from ..run_directory.run_info import run_info
from ..run_directory.run_lock import RunLock
from ..run_directory.shared_storage import check_shared_output
from ..run_directory.trackers import check_log_with, init_trackers, log_with
from ..run_state.config_changes import review_changes
from ..run_state.elastic import compatible_position, own_rank_state, plan_identity
from ..run_state.saver import Checkpointer
from ..schedule import EarlyStopping, OpsSchedule, ResolvedPlan, StopDecision, resolve_plan
from ..schedule.events import EventPoint
from ..schedule.summary import summary_text
from ..tasks import Task, TaskContext, ValidationPass, build_task
from .backends import check_backend, check_resume, scaler_skips_steps
from .batches import BatchSource
from .callback_list import CallbackList
from .gradnorm import GradNorm
from .meter import NonFiniteLoss, TrainMeter
from .setup import OptimizerFactory, as_loader, build_optimizer, default_optimizer, shared_parameters
from .source_metrics import source_metrics
from .step import OptimizerStep
from .task_checks import check_task, first_batch
from .validation import run_pass, validation_line


class Trainer:
    """Train ``model`` on ``train_data`` as ``config`` says; ``fit()`` runs the whole run.

    What a batch holds and how the model is called depend on the task: ``TASK.NAME`` (default
    ``hierarchical``) or the ``task`` given (see ``linnaeus_accel.tasks``).
    """

    def __init__(
        self,
        config: Config,
        model: nn.Module,
        train_data: Dataset[Any] | DataLoader[Any],
        val_data: Dataset[Any] | DataLoader[Any] | None = None,
        *,
        task: Task | None = None,
        optimizer: OptimizerFactory | torch.optim.Optimizer = default_optimizer,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        accelerator: Accelerator | None = None,
        remote: Any = None,
        callbacks: Sequence[Callback] = (),
    ) -> None:
        """``train_data``/``val_data``: map-style datasets (batched with DATA.BATCH_SIZE by a
        sampler seeded by (seed, epoch)), ``IterableDataset`` streams with ``__len__`` (sharded
        across processes and DataLoader workers), or ready DataLoaders. ``task``: a ``Task``
        (default: built from TASK.NAME). ``optimizer``: a factory taking the parameter groups of
        LR_SCHEDULER.PARAMETER_GROUPS (group 0 first), or a built optimizer with that many groups.
        ``collate_fn``: how samples of the datasets given become a batch (e.g. padding sequences
        of different lengths; default: torch's ``default_collate``).
        ``remote``: a ``linnaeus_accel.checkpoint.remote.RemoteCheckpoints`` (default:
        ENV.OUTPUT.BUCKET). ``callbacks``: ``linnaeus_accel.Callback``s run after CALLBACKS' (see
        ``linnaeus_accel.callbacks``; the plan draws when they run). Every mismatch between config, task, data and model found here is one
        ``ConfigError``."""
        self.config = config
        accum = config.TRAIN.accumulation
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        self.accelerator = acc = accelerator or Accelerator(
            # Under torchrun on a machine without CUDA, Accelerate needs cpu=True to form the gloo group.
            cpu=launched > 1 and not torch.cuda.is_available(),
            gradient_accumulation_steps=accum,
            log_with=log_with(config),  # a tracker whose package is missing: a ConfigError
            project_dir=str(config.output_dir),
            step_scheduler_with_optimizer=False,
            # A DataLoader given with shuffle=True gets a sampler seeded by (seed, epoch), so a resumed
            # run draws the epoch's order again instead of a new one (our own sampler already does).
            dataloader_config=DataLoaderConfiguration(
                use_seedable_sampler=True, data_seed=config.EXPERIMENT.SEED
            ),
            # A process that stops answering must not hold the others for torch's 30 minutes.
            kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=config.ENV.DIST_TIMEOUT_S))],
        )
        if acc.num_processes != launched:
            raise RuntimeError(
                f"{launched} processes were launched but Accelerate joined {acc.num_processes}: "
                "each would train alone; check the launcher and accelerate config"
            )
        if acc.gradient_accumulation_steps != accum:
            raise ConfigError(
                [
                    (
                        "TRAIN.ACCUMULATION_STEPS",
                        f"is {accum} but the Accelerator given accumulates {acc.gradient_accumulation_steps}",
                    )
                ]
            )
        check_log_with(acc, config)
        check_backend(acc, config)  # before prepare: DeepSpeed reads its config there
        set_seed(config.EXPERIMENT.SEED)
        rank, world = acc.process_index, acc.num_processes
        train = as_loader(config, train_data, True, rank, world, collate_fn)
        val = as_loader(config, val_data, False, rank, world, collate_fn) if val_data is not None else None
        self.train_size = train.size
        opt = build_optimizer(optimizer, model, config)
        if train.stream:  # a stream loader shards itself: Accelerate must not shard it again
            self.model, self.optimizer = acc.prepare(model, opt)
            train_loader = train.loader
        else:
            self.model, self.optimizer, train_loader = acc.prepare(model, opt, train.loader)
        seed = config.EXPERIMENT.SEED
        self.train_batches = BatchSource(
            acc,
            train_loader,
            train.size,
            train.batch_size,
            stream=train.stream,
            seed=seed,
            sampler=train.sampler,
            drop_last=config.DATA.DROP_LAST,
        )
        self.val_batches = (
            None
            if val is None
            else BatchSource(
                acc,
                val.loader if val.stream else acc.prepare(val.loader),
                val.size,
                val.batch_size,
                stream=val.stream,
                seed=seed,
            )
        )
        # The plan says when every callback runs: the config's and those given here, in that order.
        all_callbacks = [*build_callbacks(config), *callbacks]
        names = [entry.NAME for entry in config.CALLBACKS] + [callback_name(c) for c in callbacks]
        timed = config.model_copy(update={"CALLBACKS": callback_entries(all_callbacks, names)})
        self.plan: ResolvedPlan = resolve_plan(
            timed,
            train.batches_per_epoch if train.stream else len(train_loader),
            world,
            train.size,
            tokens_per_sample=getattr(train.dataset, "tokens_per_sample", None),
            sources=describe() if callable(describe := getattr(train.dataset, "describe", None)) else (),
        )
        self.ops = OpsSchedule(self.plan)
        self.callbacks = CallbackList(all_callbacks, self.plan, acc.is_main_process)
        self.task = task if task is not None else build_task(config)
        self.task.bind(TaskContext(config, self.plan, train.dataset, rank, world, acc.device))
        self.progress = TrainingProgress(
            total_epochs=self.plan.epochs or 0, expected_total_steps=self.plan.total_steps
        )
        batch = first_batch(train.dataset, train.collate)
        for source in (self.train_batches, self.val_batches):
            if source is not None and source.unsized is not None:
                source.unsized.template = batch  # what a process out of batches trains on, at zero weight
        mode, self.ranking_mode = check_task(config, self.task, self.plan, self.model, batch, acc.device)
        self.early_stopping = EarlyStopping(config.TRAIN.EARLY_STOP, self.plan.warmup_steps, mode)
        gradnorm = config.LOSS.GRAD_WEIGHTING.TASK
        self.gradnorm = (
            GradNorm(
                len(self.task.components), alpha=gradnorm.ALPHA, initial_weights=config.LOSS.TASK_WEIGHTS
            )
            if gradnorm.GRADNORM_ENABLED
            else None
        )
        self.meter = self._meter()
        self.step = OptimizerStep(
            acc,
            self.model,
            self.optimizer,
            self.task,
            self.plan,
            self.meter,
            weights=list(config.LOSS.TASK_WEIGHTS or [1.0] * len(self.task.components)),
            clip_grad=config.TRAIN.CLIP_GRAD,
            gradnorm=self.gradnorm,
            shared_parameters=shared_parameters(acc.unwrap_model(self.model)) if self.gradnorm else None,
            skip_nonfinite=config.TRAIN.NONFINITE == "skip",
        )
        self.last_validation: dict[str, float] = {}
        self.validation_passes_done: dict[str, dict[str, float]] = {}  # by prefix, at the latest boundary
        self.consistency = TrainingConsistencyChecker.for_plan(self.plan, config.DATA.DROP_LAST)
        self.checkpointer = Checkpointer(acc, config, remote, mode=self.ranking_mode)
        self.checkpointer.on_commit = self.callbacks.committed
        self.nonfinite = NonFiniteGuard(acc, self.meter, self.model, config.TRAIN.NONFINITE)
        self.preemption = PreemptionWatch(acc)
        self.lock = RunLock(config.output_dir)  # taken by the main process in fit()
        self.allow_config_change = False
        self.run_info: dict[str, Any] = {}  # what the run ran on (main process)
        self.out: Any = None
        self.resumed_boundary: dict[str, Any] | None = None
        self.resumed_wandb_id: str | None = None
        self.resumed_data_state: dict[str, Any] | None = None
        self.resumed_from: Path | None = None  # the checkpoint resumed from
        self.final_boundary_done = False
        self.callbacks.setup(self)  # before any checkpoint is loaded (they may register state)

    def dump_metrics_state(self) -> dict[str, Any]:
        """For debugging validation metrics (linnaeus' ``MetricsTracker.dump_metrics_state``): a
        plain, JSON-serialisable snapshot of what the run has measured. ``stage`` and the passes
        ``pending``/``completed`` at the current boundary, ``passes`` (each finished pass's metrics
        by prefix, at the latest boundary, filled as they finish), ``last`` (the latest boundary's
        metrics, as logged), ``best_metric``, ``early_stopping``'s state, and ``train_window``:
        this process's open training-loss window (read from the device: not for every step)."""
        progress = self.progress.state_dict()
        return {
            "global_step": progress["global_step"],
            "epoch": progress["epoch"],
            "stage": progress["current_stage"],
            "validation": {
                "pending": progress["pending_validations"],
                "completed": progress["completed_validations"],
                "passes": {prefix: dict(m) for prefix, m in self.validation_passes_done.items()},
                "last": dict(self.last_validation),
            },
            "best_metric": progress["best_metric"],
            "early_stopping": self.early_stopping.state_dict(),
            "train_window": self.meter.state_dict(),
        }

    # -- for callbacks: rank-specific side effects in one place ---------------------------------
    @property
    def is_main_process(self) -> bool:
        return bool(self.accelerator.is_main_process)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Append ``metrics`` at ``step`` to metrics.jsonl and the trackers (main process only)."""
        self.out.log(metrics, step)

    def say(self, text: str) -> None:
        """Print a line above the progress bar (main process only)."""
        self.out.say(text)

    def _meter(self) -> TrainMeter:
        task, cfg = self.task, self.config.TASK
        if cfg.FLOPS_PER_TOKEN is not None or cfg.FLOPS_PER_SAMPLE is not None:
            flops, per_token = cfg.FLOPS_PER_TOKEN or cfg.FLOPS_PER_SAMPLE, cfg.FLOPS_PER_TOKEN is not None
        else:
            flops = task.default_flops_per_unit(self.accelerator.unwrap_model(self.model))
            per_token = task.counts_tokens
        return TrainMeter(
            self.accelerator,
            task.components,
            counts_tokens=task.counts_tokens,
            flops_per_unit=flops,
            mfu_per_token=per_token,
            peak=self.config.ENV.PEAK_FLOPS,
            window=self.plan.metrics_interval,
            counts_skipped_steps=scaler_skips_steps(self.accelerator),
        )

    # -- the run ---------------------------------------------------------------------------------
    def fit(
        self,
        resume_from: str | Path | None = None,
        overwrite: bool = False,
        allow_config_change: bool = False,
    ) -> dict[str, Any]:
        """Run to the end; resumes from ``resume_from`` or, with TRAIN.AUTO_RESUME, from the newest
        complete checkpoint in the output directory (refusing config changes that would rewrite
        the steps already trained unless ``allow_config_change``). Raises ``RunFailed`` when the
        run cannot go on (``summary.json`` then says ``status: failed``)."""
        self.allow_config_change = allow_config_change
        try:
            finished = self._start(resume_from, overwrite)
            if finished is not None:
                self._tear_down()  # every process got the same answer: all are here
                return {**finished, "already_finished": True}
            self.callbacks.start(self, self.progress.global_step, self.resumed_from)
            with self.preemption:  # from here on, SIGTERM/SIGUSR1 ask for a clean stop
                stop = self._run()
            if stop is not None:
                self.out.say(f"stopping early: {stop.message}")
            return self._finish(stop)
        except ConfigError:
            raise  # found before anything ran: nothing to record
        except RunFailed as failure:
            self._record_failure(str(failure), agreed=True)
            raise
        except Exception as exc:
            timed_out = collective_timeout(exc, self.config.ENV.DIST_TIMEOUT_S)
            self._record_failure(timed_out or f"{type(exc).__name__}: {exc}", agreed=False)
            if timed_out is not None:
                raise RunFailed(timed_out) from exc
            raise
        finally:
            self.lock.release()

    def _run(self) -> StopDecision | None:
        stop = self._finish_interrupted_boundary()
        epoch = self.progress.current_epoch
        while stop is None and not self.final_boundary_done:
            stop, over = self._train_epoch(epoch)
            if stop is not None and stop.reason not in ("preempted", "max_steps"):
                break  # decided by a mid-epoch validation, which has run: the run ends there
            preempted = stop is not None and stop.reason == "preempted"
            if preempted and not over:
                break  # its checkpoint is taken: the rerun continues inside the epoch
            if stop is None or preempted:  # a MAX_STEPS cut-off leaves the epoch incomplete
                self.progress.end_epoch()
            final = (stop is not None and not preempted) or self._reached_end(epoch)
            # Preempted on the epoch's last step: its checkpoint is this boundary's, taken with the
            # validation passes still due (the flag is still up), so a rerun runs them and goes on.
            stop = self._epoch_boundary(epoch, final=final, preempted=preempted) or stop
            epoch += 1
        return stop

    def _reached_end(self, epoch: int) -> bool:
        plan = self.plan
        return self.progress.global_step >= plan.total_steps or (
            plan.epochs is not None and epoch >= plan.epochs
        )

    def _train_epoch(self, epoch: int) -> tuple[StopDecision | None, bool]:
        """Train epoch ``epoch`` from where it stands; ``(stop, over)``: why the run stops, if it
        does, and whether the epoch is over (its data ended, or the run's last step came)."""
        progress, plan, batches, callbacks = self.progress, self.plan, self.train_batches, self.callbacks
        batches.set_epoch(epoch)
        done = progress.batches_seen_in_epoch  # > 0 when resuming mid-epoch
        first_step = progress.global_step
        if done == 0:
            progress.start_training_epoch(epoch)
        else:  # nothing is loaded for the skipped batches (a stream continues from its saved position)
            batches.resume(self.resumed_data_state, done)
        for window in batches.windows(done, plan.accumulation):
            self.step.run(window, progress.global_step, epoch)
            progress.complete_step(len(window), batches.samples_in(window))
            if progress.global_step >= callbacks.next_due:  # one int compared when none is due
                callbacks.step_end(self, progress.global_step)
            # A stream of unknown length knows its pass ends once it looked for the next batch.
            epoch_ends = self.ops.should_end_epoch(epoch, progress.global_step) or batches.pass_ended
            if stop := self._after_optimizer_step(epoch, epoch_ends):
                return stop, epoch_ends
            if epoch_ends:
                break  # STEPS, TARGET_TOKENS: the last epoch ends where the run does
        steps = progress.global_step - first_step
        if done == 0 and steps == 0:
            raise RunFailed(f"epoch {epoch} yielded no training batch: the training data is empty")
        # Once, after the first epoch trained whole: a loader shorter than its length shifts every boundary.
        if done == 0 and (problem := self.consistency.epoch_problem(epoch, steps)):
            self.out.say(f"warning: {problem}")
        return None, True

    def _after_optimizer_step(self, epoch: int, epoch_ends: bool) -> StopDecision | None:
        """Everything that may follow an optimizer step: logging, a MAX_STEPS cut-off, a
        preemption, a mid-epoch checkpoint or validation."""
        step = self.progress.global_step
        fault_point("optimizer_step")
        stop = self.early_stopping.reached_max_steps(step)
        self._log_train_metrics(epoch, last=stop is not None)
        # At an epoch's last step every process agrees at once: the boundary comes next.
        if stop is None and self.preemption.should_stop(step, now=epoch_ends):
            if not epoch_ends:  # else the boundary checkpoints it, with the passes still due
                self._save_checkpoint(boundary=None)
            stop = StopDecision("preempted", f"preempted by a signal: checkpointed step {step}")
        elif stop is None and not epoch_ends:
            stop = self._mid_epoch_events(epoch, step)
        return stop

    def _mid_epoch_events(self, epoch: int, step: int) -> StopDecision | None:
        """SCHEDULE.CHECKPOINT.MID_EPOCH / SCHEDULE.VALIDATION.MID_EPOCH at step multiples: in
        SPEC §5's boundary order (checkpoint with the passes recorded, then the passes)."""
        ops = self.ops
        validate = self.val_batches is not None and ops.should_validate_mid_epoch(step)
        checkpoint = ops.should_save_mid_epoch_checkpoint(step)
        if not (validate or checkpoint):
            return None
        point = ops.after_step(epoch, step)
        passes = self.task.validation_passes(ops.at(point), epoch, False) if validate else []
        return self._event(point, passes, checkpoint)

    def _log_train_metrics(self, epoch: int, last: bool) -> None:
        step, ops = self.progress.global_step, self.ops
        if not (last or ops.should_log_metrics(step)):
            if ops.should_log_lr(step):  # the LR is known on the host: no device read
                self.out.log({f"lr/{label}": lr for label, lr in self._lrs(step).items()}, step)
            self.out.advance(1, epoch)
            return
        lrs = self._lrs(step) if last or ops.should_log_lr(step) else {}
        wait = self.train_batches.take_data_wait()
        try:
            metrics = self.meter.flush(self.progress.samples_seen, self.progress.tokens_seen, lrs, wait)
        except NonFiniteLoss as bad:
            what = f"the training loss was {bad.value} at step {step - bad.steps_ago}"
            raise self.nonfinite.failure(what, self.checkpointer.current) from None
        self.progress.tokens_seen = int(metrics.get("tokens_seen", self.progress.tokens_seen))
        metrics.update(
            source_metrics(
                self.train_batches.dataset, self.progress, self.plan.batch_size, self.plan.world_size
            )
        )
        metrics.update(self.checkpointer.take_timings())
        # SCHEDULE.METRICS.TRACKER_INTERVAL: the other records send the trackers their LR alone.
        to_trackers = last or ops.should_log_to_trackers(step)
        tracked = metrics if to_trackers else {f"lr/{label}": lr for label, lr in lrs.items()}
        self.out.log(metrics, step, tracked)
        if not (last or ops.should_log_console(step)):
            self.out.advance(1, epoch)
            return
        shown = {"loss": f"{metrics['train/loss']:.4f}", "lr": f"{self.plan.lr(step - 1):.2e}"}
        self.out.advance(1, epoch, {**shown, "samples/s": f"{metrics['perf/samples_per_s']:.0f}"})

    def _lrs(self, step: int) -> dict[str, float]:
        """The LR of every parameter group at the optimizer step that made ``step``, by label."""
        return {c.label: self.plan.lr(step - 1, i) for i, c in enumerate(self.plan.lr_curves)}

    def _epoch_boundary(self, epoch: int, final: bool, preempted: bool = False) -> StopDecision | None:
        """SPEC §5 order: checkpoint (recording the passes still due), then the standard, mask-meta
        and partial passes, then early stopping. ``preempted``: checkpoint whatever the schedule
        says; the first pass then sees the flag and stops."""
        if self.plan.known_epochs:
            point = self.ops.boundary(epoch, final)
        else:  # the pass ended where the stream did: the loop knows the steps, not the plan
            point = EventPoint(epoch, self.progress.global_step, self.progress.epoch_start_step, final)
        ops = self.ops.at(point)
        passes = self.task.validation_passes(ops, epoch, final) if self.val_batches is not None else []
        self.final_boundary_done = final
        return self._event(point, passes, preempted or ops.should_save_checkpoint(epoch, final))

    def _event(
        self, point: EventPoint, passes: list[ValidationPass], checkpoint: bool
    ) -> StopDecision | None:
        """The passes due at ``point``, after its checkpoint (which records them as pending)."""
        if point.mid:
            self.progress.clear_validations()  # the previous mid-epoch point's are done
        for vpass in passes:
            self.progress.schedule_validation(vpass.stage, vpass.partial_index)
        if checkpoint:
            self._save_checkpoint(boundary=dataclasses.asdict(point))
        return self._validate(point, passes, done={})

    def _finish_interrupted_boundary(self) -> StopDecision | None:
        """After resuming from a checkpoint taken at a boundary or a mid-epoch validation point: run
        exactly the passes its journal does not record as complete (SPEC §6), then carry on."""
        record = self.resumed_boundary
        if record is None:
            return None
        point = self._resumed_point(record)
        self.final_boundary_done = point.final
        if not self.progress.has_pending_validations():
            return None
        assert self.val_batches is not None
        passes = self.task.validation_passes(self.ops.at(point), point.epoch, point.final)
        assert self.checkpointer.current is not None
        done = {e["prefix"]: e["metrics"] for e in self.checkpointer.journal(self.checkpointer.current)}
        return self._validate(point, passes, done)

    def _resumed_point(self, record: dict[str, Any]) -> EventPoint:
        """The event point a checkpoint recorded (before mid-epoch events, only epoch and final)."""
        epoch, final = int(record["epoch"]), bool(record["final"])
        if "step" in record:
            return EventPoint(
                epoch,
                int(record["step"]),
                int(record["previous_step"]),
                final,
                bool(record.get("mid", False)),
            )
        return self.ops.boundary(epoch, final)

    def _validate(
        self, point: EventPoint, passes: list[ValidationPass], done: dict[str, dict[str, float]]
    ) -> StopDecision | None:
        step = self.progress.global_step
        boundary = dataclasses.asdict(point)
        journal = self.checkpointer.current if self.checkpointer.current_step == step else None
        self.validation_passes_done = done  # filled pass by pass: dump_metrics_state() shows it
        results: dict[str, float] = {}
        for vpass in passes:
            if self.preemption.should_stop(step, now=True):
                return self._preempt_boundary(boundary, journal, done)
            metrics = done.get(vpass.prefix)
            if metrics is None:
                self.progress.start_validation(vpass.stage)
                assert self.val_batches is not None
                metrics = run_pass(self.accelerator, self.model, self.val_batches, self.task, vpass)
                self.checkpointer.record_validation(journal, {"prefix": vpass.prefix, "metrics": metrics})
                done[vpass.prefix] = metrics
                fault_point("validation_pass")
            self.progress.complete_validation(vpass.stage, vpass.partial_index)
            results.update(metrics)
        if not results:
            return None
        self.callbacks.validation_end(self, step, results)  # may add metrics of its own (val_ema/)
        results["epoch"] = float(point.epoch)
        self.out.log(results, step)
        label = f"step {step} (epoch {point.epoch})" if point.mid else f"epoch {point.epoch}"
        self.out.say(validation_line(label, results, self.task.metric_directions))
        self.last_validation = results
        self.checkpointer.record_metric(step, results)
        return self._check_early_stop(results)

    def _preempt_boundary(
        self, boundary: dict[str, Any], journal: Path | None, done: dict[str, dict[str, float]]
    ) -> StopDecision:
        """Preempted between validation passes: the passes done so far are journalled in this
        boundary's checkpoint (taken now if the schedule did not ask for one), so the resumed run
        runs only the rest."""
        if journal is None:
            self._save_checkpoint(boundary=boundary)
            for prefix, metrics in done.items():
                self.checkpointer.record_validation(
                    self.checkpointer.current, {"prefix": prefix, "metrics": metrics}
                )
        return StopDecision(
            "preempted", f"preempted by a signal during validation at step {self.progress.global_step}"
        )

    def _check_early_stop(self, results: dict[str, float]) -> StopDecision | None:
        es = self.early_stopping
        metric = results.get(es.metric)
        ranking = self.config.SCHEDULE.CHECKPOINT.METRIC or es.metric
        if ranking in results:
            self.progress.update_best(ranking, results[ranking], self.ranking_mode)
        step = self.progress.global_step
        decision = es.check(
            step, metric, lr=self.plan.lr(max(0, step - 1)), grad_norm=self.meter.last_grad_norm()
        )
        # Taken on the main process, applied on all: no process keeps training alone (SPEC §7).
        shared = broadcast_object_list([decision], from_process=0)
        return shared[0]  # type: ignore[no-any-return]

    # -- checkpoints ---------------------------------------------------------------------------------
    def _save_checkpoint(self, boundary: dict[str, Any] | None) -> None:
        step = self.progress.global_step
        parameters_finite = self.nonfinite.start_parameters_check()  # read while the state is saved
        resume_point = self.checkpointer.current
        self.progress.tokens_seen += self.meter.take_tokens()
        state = {
            "progress": self.progress.state_dict(),
            "early_stopping": self.early_stopping.state_dict(),
            "gradnorm": self.gradnorm.state_dict() if self.gradnorm is not None else None,
            "boundary": boundary,
            "callbacks": self.callbacks.state_dict(),
            "wandb_run_id": self._wandb_run_id(),
            "plan": plan_identity(self.plan),
            "config": self.config.model_dump(mode="json"),
        }
        mid_epoch = self.progress.batches_seen_in_epoch > 0
        rank_state = {
            "meter": self.meter.state_dict(),
            "data": self.train_batches.state_dict() if mid_epoch else None,
        }
        self.checkpointer.save(
            step,
            state,
            rank_state,
            before_commit=lambda: self.nonfinite.check(
                step, f"the checkpoint of step {step}", resume_point, parameters_finite
            ),
        )
        self.callbacks.checkpoint_saved(step)

    def _resume(self, resume_from: str | Path | None) -> None:
        acc = self.accelerator
        path, skipped = self.checkpointer.find_everywhere(resume_from)  # a refusal stops every process
        for message in skipped:
            self.out.say(f"skipping checkpoint {message}")
        resume_step = self.checkpointer.store.step_of(path) if path is not None else 0
        if acc.is_main_process:
            dropped = self.checkpointer.discard_after(resume_step or 0)
            if dropped:
                self.out.say(f"removed checkpoints after the resume point: steps {dropped}")
        acc.wait_for_everyone()
        if path is None:
            self.out.truncate_metrics(after_step=0)  # killed before its first checkpoint: start over
            return
        saved = self.checkpointer.read_state(Path(path))
        check_resume(acc, saved.get("plan"))
        batches_seen = compatible_position(  # first: another effective batch cannot resume at all
            saved.get("plan"),
            plan_identity(self.plan),
            int(saved["progress"].get("batches_seen_in_epoch", 0)),
            same_length=saved.get("config") is None,
        )
        done = int(saved["progress"]["global_step"])
        changes = review_changes(
            saved.get("config"), saved.get("plan"), self.config, self.plan, done, self.allow_config_change
        )
        state = self.checkpointer.load(Path(path))
        self.progress.load_state_dict(state["progress"])
        self.progress.batches_seen_in_epoch = batches_seen
        self.early_stopping.load_state_dict(state.get("early_stopping") or {})
        if self.gradnorm is not None and state.get("gradnorm"):
            self.gradnorm.load_state_dict(state["gradnorm"])
            self.step.set_weights(self.gradnorm.weights)
        own = own_rank_state(self.checkpointer.rank_states(Path(path)), acc.process_index, acc.num_processes)
        self.meter.load_state_dict(own.get("meter") or {})
        self.resumed_data_state = own.get("data")
        problem = self.train_batches.resume_problem(self.resumed_data_state, batches_seen)
        if problem is not None:  # before any pass or step of the resumed run
            raise ConfigError([problem], source="resume")
        self.resumed_boundary = state.get("boundary")
        self.resumed_from = Path(path)
        callback_notes = self.callbacks.load_state_dict(state.get("callbacks") or {})
        self.resumed_wandb_id = state.get("wandb_run_id")
        # The run's length is this config's (more epochs may have been asked for).
        self.progress.total_epochs, self.progress.expected_total_steps = (
            self.plan.epochs or 0,
            self.plan.total_steps,
        )
        step = self.progress.global_step
        self.out.truncate_metrics(after_step=step)
        self.out.say(f"resumed from {path} (global step {step}, epoch {self.progress.current_epoch})")
        for line in changes:
            self.out.say(f"config changed since the checkpoint, applied: {line}")
        for line in callback_notes:
            self.out.say(line)

    def _wandb_run_id(self) -> str | None:
        if not self.accelerator.is_main_process:
            return None
        wandb = next((t.tracker for t in self.accelerator.trackers if t.name == "wandb"), None)
        run = getattr(wandb, "id", None)
        return str(run) if run else None

    # -- start and end ---------------------------------------------------------------------------
    def _start(self, resume_from: str | Path | None, overwrite: bool) -> dict[str, Any] | None:
        """Claim the output directory, resume, write the assets; the summary of the finished run
        already there instead (rerunning a finished run's command does nothing: schedulers
        requeue jobs)."""
        config, acc = self.config, self.accelerator
        # Decided on the main process and shared, so that every process stops with the same error
        # instead of waiting at a barrier for a process that has exited.
        claim = claim_output_dir(config, self.lock, resume_from, overwrite) if acc.is_main_process else None
        problem, finished = broadcast_object_list([claim or (None, None)], from_process=0)[0]
        if problem is not None:
            raise ConfigError([problem])
        if finished is not None:
            return finished  # type: ignore[no-any-return]
        check_shared_output(acc, config.output_dir)  # every machine sees the directory, or all stop
        if acc.is_main_process:
            self.checkpointer.store.remove_stale_staging()
        self.out = run_outputs(acc, config, self.plan.total_steps)
        if acc.is_main_process:
            self.run_info = run_info(acc)
            self.out.write_json("assets/run_info.json", self.run_info)
        self._resume(resume_from)
        text = summary_text(config, self.plan)
        self.out.write_assets(config, text, self.plan)
        self.out.say(text)
        init_trackers(acc, config, self.resumed_wandb_id, self.progress.global_step)
        self.out.start_progress(self.progress.global_step, self.progress.current_epoch)  # after the summary
        self.model.train()
        return None

    def _summary(
        self, status: str, stop: StopDecision | None = None, error: str | None = None
    ) -> dict[str, Any]:
        progress = self.progress
        return {
            "global_step": progress.global_step,
            "epoch": progress.epoch,
            "samples_seen": progress.samples_seen,
            "tokens_seen": progress.tokens_seen,
            "status": status,
            "stop_reason": stop.reason if stop else None,
            "error": error,
            "best_metric": progress.best_metric,
            "expected_total_steps": self.plan.total_steps,
            "last_validation": self.last_validation,
            "run_info": self.run_info,
        }

    def _finish(self, stop: StopDecision | None) -> dict[str, Any]:
        acc, progress = self.accelerator, self.progress
        preempted = stop is not None and stop.reason == "preempted"
        progress.tokens_seen += self.meter.take_tokens()
        self.checkpointer.settle()  # the last checkpoint is committed, or every process stops here
        self.callbacks.announce_commits(self)  # settled: every checkpoint is committed
        if not preempted:  # a preempted run's weights are in its last checkpoint
            self.nonfinite.check(progress.global_step, "the final weights", self.checkpointer.current)
            # A compiled model's weights under the model's own names (no "_orig_mod." prefix);
            # Accelerate still gathers them from whatever wraps it (DDP, FSDP, DeepSpeed).
            model = self.model._orig_mod if is_compiled_module(self.model) else self.model
            acc.save_model(model, self.config.output_dir / "final", safe_serialization=True)  # collective
        status = "preempted" if preempted else ("early_stopped" if stop is not None else "completed")
        summary = self._summary(status, stop)
        summary["remote_sync_errors"] = self.checkpointer.close()
        summary["checkpoint_blocked_s"] = round(self.checkpointer.total_blocked_s, 3)
        summary["checkpoint_wait_s"] = round(self.checkpointer.total_waited_s, 3)
        self.out.write_json("summary.json", summary)
        self.callbacks.fit_end(self, summary)
        self._tear_down()
        self.out.close()
        return summary

    def _tear_down(self) -> None:
        """Every process tears the process group down together (PyTorch's advice for
        destroy_process_group): one destroying it while process 0 still writes, and hosts the
        rendezvous store, was seen to hang at exit with 2 gloo processes; one never destroying it
        was seen to abort at exit (gloo's threads outliving the interpreter)."""
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()

    def _record_failure(self, message: str, agreed: bool) -> None:
        """``summary.json`` says ``status: failed`` (when it can still be written: the disk may be
        full). ``agreed``: every process is here, so the process group is torn down together."""
        if self.out is None:
            return
        with contextlib.suppress(Exception):
            self.checkpointer.close(timeout=60.0)
        with contextlib.suppress(OSError):
            self.out.write_json("summary.json", self._summary("failed", error=message))
        if agreed:
            with contextlib.suppress(Exception):
                self.accelerator.wait_for_everyone()
                self.accelerator.end_training()
        self.out.close()
