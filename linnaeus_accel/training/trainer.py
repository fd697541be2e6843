"""``Trainer``: the training loop on ``accelerate.Accelerator``, read top to bottom (docs/design.md).

Accelerate owns devices, mixed precision, all-reduce and process control; the task (``tasks/``)
owns everything that depends on what is trained; the trainer owns *when* things happen. Time was
resolved into steps once (``schedule.resolve_plan``); each component answers "is it my step?"
itself, from ints. ``build.build_run`` makes the parts once. The loop, every hook and decision in
the order it runs (``k``: ``progress.global_step``)::

    fit(resume_from)
      _start()
        claim the run directory (the main process decides, every process hears)
            a finished run: return its summary; another config on it: ConfigError
        checkpoints.open(...)        the directory's layout, stale staging, the bucket's catch-up
        checkpoints.resume(...)      the newest usable checkpoint; each registered part its state
        the assets, the start-up summary, trackers
      callbacks.start(k)
      with preemption:               SIGTERM/SIGUSR1/Ctrl-C ask for a clean stop from here
        stop = boundary_work.finish_interrupted()     the passes a checkpoint at a boundary left
        for each epoch until a stop or boundary_work.final_done:
          for window in train_batches.windows():      TRAIN.ACCUMULATION_STEPS micro-batches
            recovery.should_skip(k)? step.skip(window) : step.run(window)
                                     LR(k) set, forward/backward, clip, optimizer.step
            progress.complete_step(...)               global_step, samples_seen
            k >= callbacks.next_due? callbacks.step_end(k)
            epoch_ends = ops.should_end_epoch(epoch, k) or train_batches.pass_ended
            _after_optimizer_step:
              stop = ops.max_steps_stop(k)            TRAIN.EARLY_STOP.MAX_STEPS
              train_log.after_step(epoch)             a record at METRICS.STEP_INTERVAL; NaN/spike
              recovery.due? recovery.roll_back(k)     back to a checkpoint, skip the bad data
              preemption.should_stop(k)? checkpoints.save(); stop = PREEMPTED
              else not epoch_ends? stop = boundary_work.mid_epoch(epoch, k)
            stop or epoch_ends? leave the epoch
          _epoch_boundary: boundary_work.epoch_boundary(epoch, final)
                                     checkpoint, validation passes, early stopping
      end.finish(stop)               last checkpoint committed, final/, summary.json
      callbacks.fit_end(summary)

Nothing in a step reads the device except a record (``train_log``) and a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..callbacks import Callback
from ..checkpoint.init_from import check_overwrite
from ..checkpoint.resume.finished import finished_problem
from ..checkpoint.state.registry import Stateful
from ..config import Config, ConfigError
from ..process.failures import RunFailed
from ..process.faults import fault_point
from ..run_directory.outputs import claim_output_dir
from ..run_directory.run_info import model_line, run_info
from ..run_directory.trackers import init_trackers
from ..schedule import StopDecision, StopReason
from ..schedule.report.settings import report_settings
from ..schedule.report.summary import summary_text
from ..tasks import Task
from .build import RunParts, build_run, run_context
from .end.final_weights import data_records
from .start.setup import OptimizerFactory, default_optimizer


class Trainer:
    """Train ``model`` on ``train_data`` as ``config`` says; ``fit()`` runs the whole run.

    What a batch holds and how the model is called depend on the task: ``TASK.NAME`` (default
    ``hierarchical``) or the ``task`` given (see ``linnaeus_accel.tasks``). The run's parts are its
    attributes (``trainer.model``, ``trainer.plan``, ``trainer.accelerator``, ...: ``build.RunParts``).
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
        ``remote``: a ``linnaeus_accel.checkpoint.bucket.remote.RemoteCheckpoints`` (default:
        ENV.OUTPUT.BUCKET). ``callbacks``: ``linnaeus_accel.Callback``s run after CALLBACKS' (see
        ``linnaeus_accel.callbacks``; the plan draws when they run). Every mismatch between
        config, task, data and model found here is one ``ConfigError``."""
        self.parts: RunParts = build_run(
            config, model, train_data, val_data, task=task, optimizer=optimizer, collate_fn=collate_fn,
            accelerator=accelerator, remote=remote, callbacks=callbacks,
        )  # fmt: skip
        self.allow_config_change = self.unsafe_load_pickles = False
        self.parts.callbacks.setup(
            run_context(self.parts, self)
        )  # before a checkpoint loads: they may register state

    def __getattr__(self, name: str) -> Any:
        """The run's parts (``build.RunParts``): ``trainer.model``, ``trainer.plan``, ..."""
        parts = self.__dict__.get("parts")
        if parts is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(parts, name)

    # -- for your own code and callbacks ---------------------------------------------------------
    def register_state(self, name: str, part: Stateful) -> None:
        """Save ``part.state_dict()`` in every checkpoint under ``name`` and hand it back to
        ``part.load_state_dict`` on resume. The state may hold tensors (on any device) and plain
        values (``checkpoint.state.tensor_state`` says which): tensors go to a safetensors file, the rest
        to JSON, nothing is pickled. The main process's state is saved (under DDP every process
        holds the same); every process loads it. Register before ``fit`` (a callback's ``on_setup``);
        a checkpoint without ``name`` (a part new since) leaves the part as it is."""
        self.parts.state.register_user(name, part)

    def registered_names(self) -> list[str]:
        """What ``register_state`` holds, in the order it was registered."""
        return self.parts.state.user_names()

    @property
    def is_main_process(self) -> bool:
        return bool(self.parts.accelerator.is_main_process)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Append ``metrics`` at ``step`` to metrics.jsonl and the trackers (main process only)."""
        self.parts.out.log(metrics, step)

    def say(self, text: str) -> None:
        """Print a line above the progress bar (main process only)."""
        self.parts.out.say(text)

    def dump_metrics_state(self) -> dict[str, Any]:
        """For debugging validation metrics (linnaeus' ``MetricsTracker.dump_metrics_state``): a
        plain, JSON-serialisable snapshot of what the run has measured. ``stage`` and the passes
        ``pending``/``completed`` at the current boundary, ``passes`` (each finished pass's metrics
        by prefix, at the latest boundary, filled as they finish), ``last`` (the latest boundary's
        metrics, as logged), ``best_metric``, ``early_stopping``'s state, and ``train_window``:
        this process's open training-loss window (read from the device: not for every step)."""
        return self.parts.boundary_work.metrics_state()

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
        run = self.parts
        self.allow_config_change = allow_config_change
        self.unsafe_load_pickles = unsafe_load_pickles
        # Accelerate would pickle what was registered with register_for_checkpointing: saved as ours.
        for i, obj in enumerate(run.accelerator._custom_objects):
            self.register_state(f"accelerate_custom_{i}", obj)
        run.accelerator._custom_objects.clear()
        check_overwrite(run.config.MODEL, run.init_from, overwrite)  # its source gone, and no resume left
        run.state.check_savable()  # before the output directory is claimed: nothing is written
        try:
            finished = self._start(resume_from, overwrite)
            if finished is not None:  # every process got the same answer: all are here
                return run.end.already_finished(finished)
            run.callbacks.start(run.progress.global_step, run.checkpoints.resumed_from)
            with run.preemption:  # from here on, SIGTERM/SIGUSR1 ask for a clean stop
                stop = self._run()
            if stop is not None:
                run.out.say(f"stopping early: {stop.message}")
            summary = run.end.finish(stop, before_summary=run.callbacks.announce_commits)
            run.callbacks.fit_end(summary)
            run.end.tear_down()
            run.out.close()
            return summary
        except ConfigError:
            raise  # found before anything ran: nothing to record
        except RunFailed as failure:
            ended = run.end.record_failure(str(failure), agreed=True)
            if ended == str(failure):
                raise
            raise type(failure)(ended) from failure  # what the end found too (a full disk's summary)
        except Exception as exc:
            failed = run.end.record_exception(exc)
            if failed is not None:
                raise failed from exc
            raise
        finally:
            run.lock.release()

    def _run(self) -> StopDecision | None:
        """Epoch after epoch until the run's last boundary, or a stop inside an epoch."""
        stop = self.parts.boundary_work.finish_interrupted()
        epoch = self.parts.progress.current_epoch
        while stop is None and not self.parts.boundary_work.final_done:
            stop, at_boundary = self._train_epoch(epoch)
            if not at_boundary:
                return stop  # inside the epoch: preempted (checkpointed), or a mid-epoch validation's stop
            stop = self._epoch_boundary(epoch, stop)
            epoch += 1
        return stop

    def _train_epoch(self, epoch: int) -> tuple[StopDecision | None, bool]:
        """Train epoch ``epoch`` from where it stands; why the run stops, if it does, and whether the
        epoch's boundary comes next (its data ended, the run's last step came, or ``MAX_STEPS``)."""
        run = self.parts
        progress, batches, callbacks = run.progress, run.train_batches, run.callbacks
        batches.set_epoch(epoch)
        done = progress.batches_seen_in_epoch  # > 0 when resuming mid-epoch
        first_step = progress.global_step
        if done == 0:
            progress.start_training_epoch(epoch)
        else:  # nothing is loaded for the skipped batches (a stream continues from its saved position)
            batches.resume(run.data.resumed, done)
        for window in batches.windows(done, run.plan.accumulation):
            if run.recovery.should_skip(progress.global_step):  # its data a rollback skips
                run.step.skip(window, progress.global_step, epoch)
            else:
                run.step.run(window, progress.global_step, epoch)
            progress.complete_step(len(window), batches.samples_in(window))
            if progress.global_step >= callbacks.next_due:  # one int compared when none is due
                callbacks.step_end(progress.global_step)
            # A stream of unknown length knows its pass ends once it looked for the next batch.
            epoch_ends = run.ops.should_end_epoch(epoch, progress.global_step) or batches.pass_ended
            if stop := self._after_optimizer_step(epoch, epoch_ends):
                return stop, epoch_ends or stop.reason is StopReason.MAX_STEPS
            if epoch_ends:
                break  # STEPS, TARGET_TOKENS: the last epoch ends where the run does
        steps = progress.global_step - first_step
        if done == 0 and steps == 0:
            raise RunFailed(f"epoch {epoch} yielded no training batch: the training data is empty")
        # Once, after the first epoch trained whole: a loader shorter than its length shifts every boundary.
        if done == 0 and (problem := run.consistency.epoch_problem(epoch, steps)):
            run.out.say(f"warning: {problem}")
        return None, True

    def _after_optimizer_step(self, epoch: int, epoch_ends: bool) -> StopDecision | None:
        """Everything that may follow an optimizer step, in order: logging, a MAX_STEPS cut-off, a
        preemption, a mid-epoch checkpoint or validation."""
        run = self.parts
        step = run.progress.global_step
        fault_point("optimizer_step")
        stop = run.ops.max_steps_stop(step)
        run.train_log.after_step(epoch, last=stop is not None)
        if run.recovery.due is not None:  # the record found the window NaN or spiking
            run.recovery.roll_back(step)
        # At an epoch's last step every process agrees at once: the boundary comes next.
        if stop is None and run.preemption.should_stop(step, now=epoch_ends):
            if not epoch_ends:  # else the boundary checkpoints it, with the passes still due
                run.checkpoints.save(boundary=None)
            stop = StopDecision(StopReason.PREEMPTED, f"{run.preemption.reason}: checkpointed step {step}")
        elif stop is None and not epoch_ends:
            stop = run.boundary_work.mid_epoch(epoch, step)
        return stop

    def _epoch_boundary(self, epoch: int, stop: StopDecision | None) -> StopDecision | None:
        """The boundary after epoch ``epoch`` (``stop``: MAX_STEPS, or a preemption at its last step)."""
        progress, plan = self.parts.progress, self.parts.plan
        preempted = stop is not None and stop.reason is StopReason.PREEMPTED
        trained = stop is None or preempted  # a MAX_STEPS cut-off leaves the epoch incomplete
        # The run's end cut the epoch short (TRAIN.STEPS, TARGET_TOKENS): the boundary's checkpoint
        # keeps the epoch's data position, so that the run trained longer continues the epoch.
        cut = trained and self._cut_short(epoch)
        if trained and not cut:
            progress.end_epoch()
        reached_end = progress.global_step >= plan.total_steps or (
            plan.epochs is not None and epoch >= plan.epochs
        )
        final = (stop is not None and not preempted) or reached_end
        # Preempted on the epoch's last step: its checkpoint is this boundary's, taken with the
        # validation passes still due (the flag is still up), so a rerun runs them and goes on.
        stop = self.parts.boundary_work.epoch_boundary(epoch, final=final, preempted=preempted) or stop
        if cut:
            progress.end_epoch()  # trained, as far as this run goes
        return stop

    def _cut_short(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` ended at the run's last step with batches left in it."""
        progress, plan = self.parts.progress, self.parts.plan
        if progress.global_step < plan.total_steps:
            return False
        if plan.optimizer_steps_per_epoch is None:
            return not self.parts.train_batches.pass_ended
        return progress.global_step - progress.epoch_start_step < plan.optimizer_steps_per_epoch

    # -- start -----------------------------------------------------------------------------------
    def _start(self, resume_from: str | Path | None, overwrite: bool) -> dict[str, Any] | None:
        """Claim the output directory, resume, write the assets; the summary of the finished run
        already there instead (rerunning a finished run's command does nothing: schedulers
        requeue jobs)."""
        run = self.parts
        config, acc, out = run.config, run.accelerator, run.out
        # Decided on the main process and shared, so that every process stops with the same error
        # instead of waiting at a barrier for a process that has exited.
        main, total = acc.is_main_process, run.plan.total_steps  # a finished run asked for more trains on
        committed = run.checkpoints.is_committed
        claim = (
            claim_output_dir(
                config.output_dir, config.TRAIN, run.lock, resume_from, overwrite, total, committed
            )
            if main
            else None
        )
        if claim is not None and claim[1] is not None:  # finished: unless this config trains another run
            refused = finished_problem(
                config.output_dir, config.model_dump(mode="json"), claim[1], acc.unwrap_model(run.model)
            )
            claim = (refused, None) if refused is not None else claim
        problem, finished = broadcast_object_list([claim or (None, None)], from_process=0)[0]
        if problem is not None:
            raise ConfigError([problem])
        if finished is not None:
            return finished  # type: ignore[no-any-return]
        # Every machine sees the directory, or each keeps its own and the bucket joins them, or all stop.
        refuse = run.recovery.node_local_problem() if run.recovery.rolls_back else None
        run.checkpoints.open(resume_from, allow_pickles=self.unsafe_load_pickles, refuse_node_local=refuse)
        out.open()
        if acc.is_main_process:
            init = run.init_from.info() if run.init_from is not None else None
            run.end.run_info = run_info(acc, model=acc.unwrap_model(run.model), init_from=init)
            out.write_json("assets/run_info.json", run.end.run_info)
        data_problem = lambda seen: run.train_batches.resume_problem(run.data.resumed, seen)  # noqa: E731
        run.checkpoints.resume(resume_from, out, data_problem, self.allow_config_change)
        settings = report_settings(config)  # what the summary, plan.json and the plot read of the config
        text = summary_text(settings, run.plan, run.optimizer_given)
        out.write_assets(config.model_dump(mode="json"), text, run.plan, settings)
        for name, data in data_records(run.train_batches.dataset).items():  # a taxonomy, the preprocessing
            out.write_json(f"assets/{name}", data)
        trains = [model_line(run.end.run_info), run.optimizer_line]  # what trains, and how
        out.say("\n".join(filter(None, [text, *trains])))
        init_trackers(
            acc,
            config.EXPERIMENT,
            config.output_dir,
            config.model_dump(mode="json"),
            run.checkpoints.wandb_run_id,
            run.progress.global_step,
        )
        out.start_progress(run.progress.global_step, run.progress.current_epoch)  # after the summary
        run.model.train()
        return None
