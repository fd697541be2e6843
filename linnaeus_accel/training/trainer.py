"""``Trainer``: the training loop on ``accelerate.Accelerator``.

Accelerate owns devices, mixed precision, all-reduce and process control; the task (``tasks/``)
owns everything that depends on what is trained; the trainer owns *when* things happen, and asks
the resolved plan (``OpsSchedule``) every time. The LR is set from the global step before each
optimizer step; no LR scheduler is prepared (Accelerate would step it once per process, docs/semantics.md §1).

The loop asks components: ``Boundaries`` (checkpoints and validation at boundaries and mid-epoch
points), ``TrainLog`` (metrics and the console), ``CallbackList``, ``CheckpointManager`` (what a
checkpoint holds: every part registered in the ``StateRegistry``; resuming from one).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, set_seed
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..callbacks import Callback, build_callbacks, callback_name
from ..config import Config, ConfigError
from ..models.init_from import check_overwrite, load_init_from
from ..optim.groups import optimizer_line
from ..process.failures import RunFailed
from ..process.faults import fault_point
from ..process.preemption import PreemptionWatch
from ..progress import TrainingConsistencyChecker, TrainingProgress
from ..run_directory.outputs import claim_output_dir, run_outputs
from ..run_directory.run_info import model_line, run_info
from ..run_directory.run_lock import RunLock
from ..run_directory.shared_storage import check_shared_output
from ..run_directory.trackers import init_trackers
from ..schedule import EarlyStopping, OpsSchedule, StopDecision
from ..schedule.report.summary import summary_text
from ..state import tensor_state
from ..state.registry import REGISTERED, Stateful, StateRegistry
from ..tasks import Task, TaskContext, build_task
from .boundaries import Boundaries
from .callback_list import CallbackList
from .checkpoints import CheckpointManager
from .gradnorm import gradnorm_for
from .meter import meter_for
from .nonfinite import NonFiniteGuard
from .run_end import RunEnd
from .setup import (
    OptimizerFactory,
    as_loader,
    build_optimizer,
    default_optimizer,
    make_accelerator,
    prepare_run,
    resolve_run_plan,
    shared_parameters,
)
from .step import OptimizerStep
from .task_checks import check_task, first_batch
from .train_log import TrainLog

_STATE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


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
        sampler seeded by (seed, epoch)), ``IterableDataset`` streams (sharded across processes
        and DataLoader workers), or ready DataLoaders. ``task``: a ``Task`` (default: built from
        TASK.NAME). ``optimizer``: default: built from OPTIMIZER; a factory taking the parameter
        groups (``setup.parameter_groups`` says their keys), or a built one with a group per LR group.
        ``collate_fn``: how samples of the datasets given become a batch (e.g. padding sequences
        of different lengths; default: torch's ``default_collate``).
        ``remote``: a ``linnaeus_accel.checkpoint.remote.RemoteCheckpoints`` (default:
        ENV.OUTPUT.BUCKET). ``callbacks``: ``linnaeus_accel.Callback``s run after CALLBACKS' (see
        ``linnaeus_accel.callbacks``; the plan draws when they run). Every mismatch between
        config, task, data and model found here is one ``ConfigError``."""
        self.config = config
        self.accelerator = acc = make_accelerator(config, accelerator)
        set_seed(config.EXPERIMENT.SEED)
        rank, world = acc.process_index, acc.num_processes
        pin = acc.device.type == "cuda"
        train = as_loader(config, train_data, True, rank, world, collate_fn, pin)
        val = (
            as_loader(config, val_data, False, rank, world, collate_fn, pin) if val_data is not None else None
        )
        self.train_size = train.size
        self.init_from = load_init_from(config, model)  # MODEL.INIT_FROM: before the optimizer and prepare
        built = build_optimizer(optimizer, model, config, acc.device)
        self.optimizer_line = optimizer_line(built)  # before prepare: whole parameters, as built
        # One given to the Trainer does not read OPTIMIZER's settings: the summary describes it instead.
        self.optimizer_given = None if optimizer is default_optimizer else built
        prepared = prepare_run(acc, config, model, built, train, val)
        self.model, self.optimizer, self.train_batches, self.val_batches = prepared[:4]
        # The config's callbacks, then those given here; the plan says when each one runs.
        all_callbacks = [*build_callbacks(config), *callbacks]
        names = [entry.NAME for entry in config.CALLBACKS] + [callback_name(c) for c in callbacks]
        self.plan = resolve_run_plan(config, all_callbacks, names, train, prepared.batches_per_epoch, world)
        self.ops = ops = OpsSchedule(self.plan)
        self.callbacks = CallbackList(all_callbacks, self.plan, acc.is_main_process)
        self.task = task if task is not None else build_task(config)
        self.task.bind(TaskContext(config, self.plan, train.dataset, rank, world, acc.device, ops))
        self.progress = TrainingProgress(total_epochs=self.plan.epochs or 0, expected_total_steps=self.plan.total_steps)  # fmt: skip
        batch = first_batch(train.dataset, train.collate)
        for source in (self.train_batches, self.val_batches):
            if source is not None and source.unsized is not None:
                source.unsized.template = batch  # what a process out of batches trains on, at zero weight
        mode, ranking_mode = check_task(config, self.task, self.plan, self.model, batch, acc.device)
        self.early_stopping = EarlyStopping(config.TRAIN.EARLY_STOP, self.plan.warmup_steps, mode)
        gradnorm = gradnorm_for(config, len(self.task.components))
        self.meter = meter_for(acc, config, self.task, self.model, self.plan.metrics_interval)
        self.step = OptimizerStep(
            acc, self.model, self.optimizer, self.task, ops, self.meter,
            weights=list(config.LOSS.TASK_WEIGHTS or [1.0] * len(self.task.components)),
            clip_grad=config.TRAIN.CLIP_GRAD, gradnorm=gradnorm,
            shared_parameters=shared_parameters(acc.unwrap_model(self.model)) if gradnorm else None,
            skip_nonfinite=config.TRAIN.NONFINITE == "skip",
        )  # fmt: skip
        self.consistency = TrainingConsistencyChecker.for_plan(self.plan, config.DATA.DROP_LAST)
        self.nonfinite = NonFiniteGuard(acc, self.meter, self.model, config.TRAIN.NONFINITE)
        self.preemption = PreemptionWatch(acc, timeout_s=config.ENV.DIST_TIMEOUT_S)
        # Every stateful part of the run, under the names its checkpoints have always used.
        self.state = state = StateRegistry()
        state.register("progress", self.progress)
        state.register("early_stopping", self.early_stopping)
        if gradnorm is not None:
            state.register("gradnorm", save=gradnorm.state_dict, load=self.step.load_gradnorm)
        state.register("callbacks", self.callbacks)
        state.register("meter", self.meter, per_rank=True)
        self.resumed_data_state: dict[str, Any] | None = None  # where the resumed epoch's data stands
        state.register("data", save=self._data_state, load=self._hold_data_state, per_rank=True)
        self.checkpoints = CheckpointManager(
            acc, config, self.plan, state, self.progress, self.nonfinite, self.meter.take_tokens,
            self.optimizer, remote=remote, mode=ranking_mode,
        )  # fmt: skip
        self.checkpoints.after_save.append(self.callbacks.checkpoint_saved)
        self.checkpoints.writer.on_commit = self.callbacks.committed
        self.boundaries = Boundaries(
            acc, config, self.model, self.task, ops, self.progress, self.val_batches, self.checkpoints,
            self.preemption, self.early_stopping, self.meter, ranking_mode,
            on_validation_end=lambda step, metrics: self.callbacks.validation_end(self, step, metrics),
        )  # fmt: skip
        self.train_log = TrainLog(ops, self.progress, self.meter, self.train_batches, self.checkpoints.writer, self.nonfinite)  # fmt: skip
        self.end = RunEnd(
            acc, config, self.plan, self.model, self.progress, self.checkpoints.writer, self.nonfinite, self.meter.take_tokens,
            train_data=train.dataset, last_validation=lambda: self.boundaries.last_validation,
        )  # fmt: skip
        self.lock = RunLock(config.output_dir)  # taken by the main process in fit()
        self.allow_config_change = False
        self.out: Any = None
        self.callbacks.setup(self)  # before any checkpoint is loaded (they may register state)

    def _data_state(self) -> dict[str, Any] | None:  # only inside an epoch: a boundary starts afresh
        return self.train_batches.state_dict() if self.progress.batches_seen_in_epoch else None

    def _hold_data_state(self, state: dict[str, Any]) -> None:
        self.resumed_data_state = state  # the resumed epoch continues from it (``_train_epoch``)

    def register_state(self, name: str, part: Stateful) -> None:
        """Save ``part.state_dict()`` in every checkpoint under ``name`` and hand it back to
        ``part.load_state_dict`` on resume. The state may hold tensors (on any device) and plain
        values (``state.tensor_state`` says which): tensors go to a safetensors file, the rest
        to JSON, nothing is pickled. The main process's state is saved (under DDP every process
        holds the same); every process loads it. Register before ``fit`` (a callback's ``on_setup``);
        a checkpoint without ``name`` (a part new since) leaves the part as it is."""
        if not _STATE_NAME.fullmatch(name):
            raise ValueError(f"register_state: {name!r} is not a name: use letters, digits, '_', '-' and '.'")
        if REGISTERED + name in self.state.names(per_rank=False):
            raise ValueError(f"register_state: {name!r} is registered already")
        self.state.register(REGISTERED + name, part)

    def registered_names(self) -> list[str]:
        """What ``register_state`` holds, in the order it was registered."""
        return [
            n.removeprefix(REGISTERED) for n in self.state.names(per_rank=False) if n.startswith(REGISTERED)
        ]

    def _adopt_accelerate_state(self) -> None:
        """Objects registered with ``accelerator.register_for_checkpointing`` (Accelerate would
        pickle them and unpickle them with code execution on load) are saved as ours instead."""
        custom = self.accelerator._custom_objects
        for i, obj in enumerate(custom):
            self.register_state(f"accelerate_custom_{i}", obj)
        custom.clear()

    def _check_state_is_data(self) -> None:
        """Before the first step, not at the first checkpoint: every registered part's state must
        be what a checkpoint can hold, or the steps before that checkpoint would be lost."""
        if (bad := tensor_state.unsavable(self.state.state(per_rank=False))) is not None:
            name, why = bad
            key = "CALLBACKS" if name == "callbacks" else f"register_state({name.removeprefix(REGISTERED)!r})"
            raise ConfigError([(key, f"its state_dict() cannot be saved in a checkpoint: {why}")])

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
                "passes": {prefix: dict(m) for prefix, m in self.boundaries.passes_done.items()},
                "last": dict(self.boundaries.last_validation),
            },
            "best_metric": progress["best_metric"],
            "early_stopping": self.early_stopping.state_dict(),
            "train_window": self.meter.state_dict(),
        }

    # -- the run ---------------------------------------------------------------------------------
    def fit(
        self,
        resume_from: str | Path | None = None,
        overwrite: bool = False,
        allow_config_change: bool = False,
        unsafe_load_pickles: bool = False,
    ) -> dict[str, Any]:
        """Run to the end; resumes from ``resume_from`` or, with TRAIN.AUTO_RESUME, from the newest
        complete checkpoint in the output directory (refusing config changes that would rewrite
        the steps already trained unless ``allow_config_change``). ``unsafe_load_pickles``: resume a
        checkpoint of an earlier layout whose registered state is pickled (loading it can run any
        code its writer put in it; refused otherwise). Raises ``RunFailed`` when the run cannot go on
        (``summary.json`` then says ``status: failed``)."""
        self.allow_config_change = allow_config_change
        self.checkpoints.reader.allow_pickles = unsafe_load_pickles
        self._adopt_accelerate_state()
        check_overwrite(self.config, self.init_from, overwrite)  # its source gone, and no resume left
        self._check_state_is_data()  # before the output directory is claimed: nothing is written
        try:
            finished = self._start(resume_from, overwrite)
            if finished is not None:  # every process got the same answer: all are here
                return self.end.already_finished(finished)
            self.callbacks.start(self, self.progress.global_step, self.checkpoints.resumed_from)
            with self.preemption:  # from here on, SIGTERM/SIGUSR1 ask for a clean stop
                stop = self._run()
            if stop is not None:
                self.out.say(f"stopping early: {stop.message}")
            summary = self.end.finish(stop, before_summary=lambda: self.callbacks.announce_commits(self))
            self.callbacks.fit_end(self, summary)
            self.end.tear_down()
            self.out.close()
            return summary
        except ConfigError:
            raise  # found before anything ran: nothing to record
        except RunFailed as failure:
            ended = self.end.record_failure(str(failure), agreed=True)
            if ended == str(failure):
                raise
            raise type(failure)(ended) from failure  # what the end found too (a full disk's summary)
        except Exception as exc:
            failed = self.end.record_exception(exc)
            if failed is not None:
                raise failed from exc
            raise
        finally:
            self.lock.release()

    def _run(self) -> StopDecision | None:
        stop = self.boundaries.finish_interrupted()
        epoch = self.progress.current_epoch
        while stop is None and not self.boundaries.final_done:
            stop, over = self._train_epoch(epoch)
            if stop is not None and stop.reason not in ("preempted", "max_steps"):
                break  # decided by a mid-epoch validation, which has run: the run ends there
            preempted = stop is not None and stop.reason == "preempted"
            if preempted and not over:
                break  # its checkpoint is taken: the rerun continues inside the epoch
            # The run's end cut the epoch short (TRAIN.STEPS, TARGET_TOKENS): the boundary's checkpoint
            # keeps the epoch's data position, so that the run trained longer continues the epoch.
            cut = (stop is None or preempted) and self._cut_short(epoch)
            if (stop is None or preempted) and not cut:  # a MAX_STEPS cut-off leaves the epoch incomplete
                self.progress.end_epoch()
            final = (stop is not None and not preempted) or self._reached_end(epoch)
            # Preempted on the epoch's last step: its checkpoint is this boundary's, taken with the
            # validation passes still due (the flag is still up), so a rerun runs them and goes on.
            stop = self.boundaries.epoch_boundary(epoch, final=final, preempted=preempted) or stop
            if cut:
                self.progress.end_epoch()  # trained, as far as this run goes
            epoch += 1
        return stop

    def _reached_end(self, epoch: int) -> bool:
        plan = self.plan
        return self.progress.global_step >= plan.total_steps or (
            plan.epochs is not None and epoch >= plan.epochs
        )

    def _cut_short(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` ended at the run's last step with batches left in it."""
        progress, per_epoch = self.progress, self.plan.optimizer_steps_per_epoch
        if progress.global_step < self.plan.total_steps:
            return False
        if per_epoch is None:
            return not self.train_batches.pass_ended
        return progress.global_step - progress.epoch_start_step < per_epoch

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
        self.train_log.after_step(epoch, last=stop is not None)
        # At an epoch's last step every process agrees at once: the boundary comes next.
        if stop is None and self.preemption.should_stop(step, now=epoch_ends):
            if not epoch_ends:  # else the boundary checkpoints it, with the passes still due
                self.checkpoints.save(boundary=None)
            stop = StopDecision("preempted", f"preempted by a signal: checkpointed step {step}")
        elif stop is None and not epoch_ends:
            stop = self.boundaries.mid_epoch(epoch, step)
        return stop

    # -- start and end ---------------------------------------------------------------------------
    def _start(self, resume_from: str | Path | None, overwrite: bool) -> dict[str, Any] | None:
        """Claim the output directory, resume, write the assets; the summary of the finished run
        already there instead (rerunning a finished run's command does nothing: schedulers
        requeue jobs)."""
        config, acc = self.config, self.accelerator
        # Decided on the main process and shared, so that every process stops with the same error
        # instead of waiting at a barrier for a process that has exited.
        main, total = acc.is_main_process, self.plan.total_steps  # a finished run asked for more trains on
        claim = claim_output_dir(config, self.lock, resume_from, overwrite, total) if main else None
        problem, finished = broadcast_object_list([claim or (None, None)], from_process=0)[0]
        if problem is not None:
            raise ConfigError([problem])
        if finished is not None:
            return finished  # type: ignore[no-any-return]
        check_shared_output(acc, config.output_dir)  # every machine sees the directory, or all stop
        self.checkpoints.verify_explicit(resume_from)  # a refusal writes nothing
        if acc.is_main_process:
            self.checkpoints.writer.store.remove_stale_staging()
        self.out = self.boundaries.out = self.train_log.out = self.end.out = run_outputs(
            acc, config, self.plan.total_steps
        )
        if acc.is_main_process:
            init = self.init_from.info() if self.init_from is not None else None
            self.end.run_info = run_info(acc, model=acc.unwrap_model(self.model), init_from=init)
            self.out.write_json("assets/run_info.json", self.end.run_info)
        self.checkpoints.resume(
            resume_from,
            self.out,
            lambda seen: self.train_batches.resume_problem(self.resumed_data_state, seen),
            self.allow_config_change,
        )
        text = summary_text(config, self.plan, self.optimizer_given)
        self.out.write_assets(config, text, self.plan)
        trains = [model_line(self.end.run_info), self.optimizer_line]  # what trains, and how
        self.out.say("\n".join(filter(None, [text, *trains])))
        init_trackers(acc, config, self.checkpoints.wandb_run_id, self.progress.global_step)
        self.out.start_progress(self.progress.global_step, self.progress.current_epoch)  # after the summary
        self.model.train()
        return None
