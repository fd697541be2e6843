"""``Trainer``: the training loop on ``accelerate.Accelerator``.

Accelerate owns devices, mixed precision, gradient accumulation, all-reduce and process control;
the trainer owns *when* things happen, and asks the resolved plan (``OpsSchedule``) every time.
The LR is set from the global step before each optimizer step; no LR scheduler is prepared
(Accelerate would step it once per process, SPEC §1).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, set_seed
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..config import Config, ConfigError
from ..data.sampling import samples_in_global_batch
from ..progress import TrainingProgress
from ..schedule import EarlyStopping, OpsSchedule, ResolvedPlan, StopDecision, resolve_plan
from ..schedule.summary import summary_text
from .batches import BatchTransforms
from .checkpointing import Checkpointer
from .faults import fault_point
from .loss import GradNorm, HierarchicalLoss
from .meter import TrainMeter
from .outputs import clear_run, output_problem, run_outputs
from .preemption import PreemptionWatch
from .setup import OptimizerFactory, as_dataloader, build_optimizer, default_optimizer, shared_parameters
from .validation import ValidationPass, passes_at_boundary, run_pass, validation_line


class Trainer:
    """Train ``model`` on ``train_dataset`` as ``config`` says; ``fit()`` runs the whole run.

    ``model(batch)`` returns one logits tensor per label level (coarse to fine); datasets yield
    dicts with ``index``, ``image``, ``meta`` and ``labels`` (see ``linnaeus_accel.data``).
    """

    def __init__(
        self,
        config: Config,
        model: nn.Module,
        train_data: Dataset[Any] | DataLoader[Any],
        val_data: Dataset[Any] | DataLoader[Any] | None = None,
        *,
        optimizer: OptimizerFactory | torch.optim.Optimizer = default_optimizer,
        loss: nn.Module | None = None,
        accelerator: Accelerator | None = None,
        remote: Any = None,
        flops_per_sample: float | None = None,
    ) -> None:
        """``train_data``/``val_data``: datasets (batched with DATA.BATCH_SIZE by a sampler seeded
        by (seed, epoch)) or ready DataLoaders. ``optimizer``: a factory taking the parameter
        groups of LR_SCHEDULER.PARAMETER_GROUPS (group 0 first), or a built optimizer with that
        many groups. ``loss(logits, labels)`` returns (total, per-level losses); default: the
        hierarchical loss weighted by LOSS.TASK_WEIGHTS. ``flops_per_sample`` enables MFU. ``remote``:
        a ``linnaeus_accel.checkpoint.remote.RemoteCheckpoints`` (default: ENV.OUTPUT.BUCKET)."""
        self.config = config
        accum = config.TRAIN.accumulation
        wandb = config.EXPERIMENT.WANDB
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        self.accelerator = accelerator or Accelerator(
            # Under torchrun on a machine without CUDA, Accelerate needs cpu=True to form the gloo group.
            cpu=launched > 1 and not torch.cuda.is_available(),
            gradient_accumulation_steps=accum,
            log_with="wandb" if wandb.ENABLED else None,
            project_dir=str(config.output_dir),
            step_scheduler_with_optimizer=False,
        )
        if self.accelerator.num_processes != launched:
            raise RuntimeError(
                f"{launched} processes were launched but Accelerate joined {self.accelerator.num_processes}: "
                "each would train alone; check the launcher and accelerate config"
            )
        if self.accelerator.gradient_accumulation_steps != accum:
            raise ConfigError(
                [
                    (
                        "TRAIN.ACCUMULATION_STEPS",
                        f"is {accum} but the Accelerator given accumulates {self.accelerator.gradient_accumulation_steps}",
                    )
                ]
            )
        set_seed(config.EXPERIMENT.SEED)
        train_loader, val_loader = (
            as_dataloader(config, train_data, True),
            as_dataloader(config, val_data, False),
        )
        train_dataset = train_loader.dataset
        self.levels: tuple[str, ...] = tuple(getattr(train_dataset, "levels", ()))
        self.train_size = len(train_dataset)
        opt = build_optimizer(optimizer, model, config)
        self.model, self.optimizer, self.train_loader = self.accelerator.prepare(model, opt, train_loader)
        self.val_loader = self.accelerator.prepare(val_loader) if val_loader is not None else None
        self.plan: ResolvedPlan = resolve_plan(
            config, len(self.train_loader), self.accelerator.num_processes, self.train_size
        )
        self.ops = OpsSchedule(self.plan)
        self.progress = TrainingProgress(
            total_epochs=self.plan.epochs, expected_total_steps=self.plan.total_steps
        )
        self.early_stopping = EarlyStopping(config.TRAIN.EARLY_STOP, self.plan.warmup_steps)
        self.level_weights = list(config.LOSS.TASK_WEIGHTS or [1.0] * len(self.levels))
        self.loss = (loss or HierarchicalLoss(len(self.levels), config.LOSS.TASK_WEIGHTS)).to(
            self.accelerator.device
        )
        gradnorm = config.LOSS.GRAD_WEIGHTING.TASK
        self.gradnorm = (
            GradNorm(len(self.levels), alpha=gradnorm.ALPHA, initial_weights=config.LOSS.TASK_WEIGHTS)
            if gradnorm.GRADNORM_ENABLED
            else None
        )
        if self.gradnorm is not None and not hasattr(self.loss, "task_weights"):
            raise ConfigError(
                [
                    (
                        "LOSS.GRAD_WEIGHTING.TASK.GRADNORM_ENABLED",
                        "GradNorm needs a loss with task_weights (the default HierarchicalLoss)",
                    )
                ]
            )
        self.shared_parameters = shared_parameters(self.accelerator.unwrap_model(self.model))
        self.transforms = BatchTransforms(config, self.plan, train_dataset, self.accelerator)
        self.meter = TrainMeter(self.accelerator, self.levels, flops_per_sample)
        self.last_validation: dict[str, float] = {}
        self.checkpointer = Checkpointer(self.accelerator, config, remote)
        self.preemption = PreemptionWatch(self.accelerator)
        self.resumed_boundary: dict[str, Any] | None = None
        self.resumed_wandb_id: str | None = None
        self.final_boundary_done = False

    # -- the run ---------------------------------------------------------------------------------
    def fit(self, resume_from: str | Path | None = None, overwrite: bool = False) -> dict[str, Any]:
        """Run to the end; resumes from ``resume_from`` or, with TRAIN.AUTO_RESUME, from the newest
        complete checkpoint in the output directory."""
        out = self._start(resume_from, overwrite)
        with self.preemption:  # from here on, SIGTERM/SIGUSR1 ask for a clean stop
            stop = self._finish_interrupted_boundary()
            for epoch in range(self.progress.current_epoch, self.plan.epochs + 1):
                if stop is not None or self.final_boundary_done:
                    break
                stop = self._train_epoch(epoch)
                if stop is not None and stop.reason == "preempted":
                    break
                if stop is None:  # a MAX_STEPS cut-off leaves the epoch incomplete
                    self.progress.end_epoch()
                stop = (
                    self._epoch_boundary(epoch, final=stop is not None or epoch == self.plan.epochs) or stop
                )
        if stop is not None:
            out.say(f"stopping early: {stop.message}")
        return self._finish(stop)

    def _train_epoch(self, epoch: int) -> StopDecision | None:
        acc, model, progress = self.accelerator, self.model, self.progress
        self.train_loader.set_epoch(epoch)
        done = progress.batches_seen_in_epoch  # > 0 when resuming mid-epoch
        if done == 0:
            progress.start_training_epoch(epoch)
        # Resuming skips the batches already seen through the batch sampler: nothing is loaded.
        loader = acc.skip_first_batches(self.train_loader, done) if done else self.train_loader
        for batch_index, batch in enumerate(self.meter.timed(loader), start=done):
            k = progress.global_step
            batch = self.transforms.train(batch, k, epoch, batch_index)
            with acc.accumulate(model):
                loss, level_losses = self.loss(model(batch), batch["labels"])
                if self.gradnorm is not None and acc.sync_gradients and self.ops.should_update_gradnorm(k):
                    loss = self._gradnorm_update(level_losses)
                acc.backward(loss)
                if acc.sync_gradients:
                    self.meter.grad_norm = self._optimizer_step(k)
            self.meter.add(loss.detach(), level_losses.detach())
            samples = samples_in_global_batch(
                self.train_size,
                self.plan.batch_size,
                self.plan.world_size,
                batch_index,
                self.config.DATA.DROP_LAST,
            )
            stepped = progress.update_step(samples, is_accumulation_step=not acc.sync_gradients)
            if stepped and (stop := self._after_optimizer_step(epoch)):
                return stop
        return None

    def _gradnorm_update(self, level_losses: torch.Tensor) -> torch.Tensor:
        """SPEC §8: new task weights from this micro-batch's per-level losses (every process joins
        the averaging), then the same losses re-weighted: its gradient is the one applied."""
        assert self.gradnorm is not None
        metrics = self.gradnorm.update(
            level_losses, self.shared_parameters, lambda t: self.accelerator.reduce(t, "mean")
        )
        self.loss.task_weights = self.gradnorm.weights
        self.meter.gradnorm_weights = metrics["weights"]
        return (self.loss.task_weights * level_losses).sum()

    def _optimizer_step(self, k: int) -> torch.Tensor | None:
        for i, group in enumerate(self.optimizer.param_groups):
            group["lr"] = self.plan.lr(k, i)
        clip = self.config.TRAIN.CLIP_GRAD
        norm = self.accelerator.clip_grad_norm_(self.model.parameters(), clip if clip else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm  # type: ignore[no-any-return]

    def _after_optimizer_step(self, epoch: int) -> StopDecision | None:
        """Everything that may follow an optimizer step: logging, a MAX_STEPS cut-off, a
        preemption, a mid-epoch checkpoint."""
        step = self.progress.global_step
        fault_point("optimizer_step")
        stop = self.early_stopping.reached_max_steps(step)
        self._log_train_metrics(epoch, last=stop is not None)
        if stop is None and self.preemption.should_stop(step):
            self._save_checkpoint(boundary=None)
            stop = StopDecision("preempted", f"preempted by a signal: checkpointed step {step}")
        elif stop is None and self.ops.should_save_mid_epoch_checkpoint(step):
            self._save_checkpoint(boundary=None)
        return stop

    def _log_train_metrics(self, epoch: int, last: bool) -> None:
        step = self.progress.global_step
        if not (last or self.ops.should_log_metrics(step)):
            self.out.advance(1, epoch)
            return
        lrs = {c.label: self.plan.lr(step - 1, i) for i, c in enumerate(self.plan.lr_curves)}
        metrics = self.meter.flush(self.progress.samples_seen, lrs)
        self.out.log(metrics, step)
        shown = {"loss": f"{metrics['train/loss']:.4f}", "lr": f"{metrics['lr/default']:.2e}"}
        self.out.advance(1, epoch, {**shown, "samples/s": f"{metrics['perf/samples_per_s']:.0f}"})

    def _epoch_boundary(self, epoch: int, final: bool) -> StopDecision | None:
        """SPEC §5 order: checkpoint (recording the passes still due), then the standard, mask-meta
        and partial passes, then early stopping."""
        passes = passes_at_boundary(self.ops, epoch, final) if self.val_loader is not None else []
        for vpass in passes:
            self.progress.schedule_validation(vpass.stage, vpass.partial_index)
        if self.ops.should_save_checkpoint(epoch, final):
            self._save_checkpoint(boundary={"epoch": epoch, "final": final})
        self.final_boundary_done = final
        return self._validate({"epoch": epoch, "final": final}, passes, done={})

    def _finish_interrupted_boundary(self) -> StopDecision | None:
        """After resuming from a boundary checkpoint: run exactly the passes its journal does not
        record as complete (SPEC §6), then carry on."""
        boundary = self.resumed_boundary
        if boundary is None:
            return None
        self.final_boundary_done = bool(boundary["final"])
        if not self.progress.has_pending_validations():
            return None
        passes = passes_at_boundary(self.ops, int(boundary["epoch"]), bool(boundary["final"]))
        assert self.checkpointer.current is not None
        done = {e["prefix"]: e["metrics"] for e in self.checkpointer.journal(self.checkpointer.current)}
        return self._validate(boundary, passes, done)

    def _validate(
        self, boundary: dict[str, Any], passes: list[ValidationPass], done: dict[str, dict[str, float]]
    ) -> StopDecision | None:
        epoch, step = int(boundary["epoch"]), self.progress.global_step
        journal = self.checkpointer.current if self.checkpointer.current_step == step else None
        results: dict[str, float] = {}
        for vpass in passes:
            if self.preemption.should_stop(step, now=True):
                return self._preempt_boundary(boundary, journal, done)
            metrics = done.get(vpass.prefix)
            if metrics is None:
                self.progress.start_validation(vpass.stage)
                metrics = run_pass(
                    self.accelerator,
                    self.model,
                    self.val_loader,
                    vpass,
                    self.levels,
                    self.level_weights,
                    self.transforms.validation_mask,
                )
                self.checkpointer.record_validation(journal, {"prefix": vpass.prefix, "metrics": metrics})
                done[vpass.prefix] = metrics
                fault_point("validation_pass")
            self.progress.complete_validation(vpass.stage, vpass.partial_index)
            results.update(metrics)
        if not results:
            return None
        results["epoch"] = float(epoch)
        self.out.log(results, step)
        self.out.say(validation_line(epoch, results))
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
            self.progress.update_best(ranking, results[ranking], "min" if "loss" in ranking else "max")
        step = self.progress.global_step
        decision = es.check(
            step, metric, lr=self.plan.lr(max(0, step - 1)), grad_norm=self.meter.last_grad_norm()
        )
        # Taken on the main process, applied on all: no process keeps training alone (SPEC §7).
        shared = broadcast_object_list([decision], from_process=0)
        return shared[0]  # type: ignore[no-any-return]

    # -- checkpoints ---------------------------------------------------------------------------------
    def _save_checkpoint(self, boundary: dict[str, Any] | None) -> None:
        tracker = self._wandb_run_id()
        state = {
            "progress": self.progress.state_dict(),
            "early_stopping": self.early_stopping.state_dict(),
            "gradnorm": self.gradnorm.state_dict() if self.gradnorm is not None else None,
            "meter": self.meter.state_dict(),
            "boundary": boundary,
            "wandb_run_id": tracker,
            "plan": self._plan_identity(),
        }
        self.checkpointer.save(self.progress.global_step, state)

    def _resume(self, resume_from: str | Path | None) -> None:
        acc = self.accelerator
        found = self.checkpointer.find(resume_from) if acc.is_main_process else (None, [])
        path, skipped = broadcast_object_list([found], from_process=0)[0]
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
        batches_seen = self._compatible_position(self.checkpointer.read_state(Path(path)))
        state = self.checkpointer.load(Path(path))
        self.progress.load_state_dict(state["progress"])
        self.progress.batches_seen_in_epoch = batches_seen
        self.early_stopping.load_state_dict(state.get("early_stopping") or {})
        if self.gradnorm is not None and state.get("gradnorm"):
            self.gradnorm.load_state_dict(state["gradnorm"])
            self.loss.task_weights = self.gradnorm.weights
        self.meter.load_state_dict(state.get("meter") or {})
        self.resumed_boundary = state.get("boundary")
        self.resumed_wandb_id = state.get("wandb_run_id")
        step = self.progress.global_step
        self.out.truncate_metrics(after_step=step)
        self.out.say(f"resumed from {path} (global step {step}, epoch {self.progress.current_epoch})")

    def _plan_identity(self) -> dict[str, int]:
        p = self.plan
        return {
            "total_steps": p.total_steps,
            "world_size": p.world_size,
            "accumulation": p.accumulation,
            "batch_size": p.batch_size,
        }

    def _compatible_position(self, state: dict[str, Any]) -> int:
        """This run's batches already seen in the epoch, checking that the checkpoint's schedule is
        this run's. Another (processes x accumulation) factorisation of the same effective batch is
        fine (elastic resume): the global batch order is the same, so the count is converted."""
        saved, now = state.get("plan") or self._plan_identity(), self._plan_identity()
        effective = {
            k: v["batch_size"] * v["world_size"] * v["accumulation"]
            for k, v in (("saved", saved), ("now", now))
        }
        if saved["total_steps"] != now["total_steps"] or effective["saved"] != effective["now"]:
            raise ConfigError(
                [
                    (
                        "TRAIN.AUTO_RESUME",
                        (
                            f"the checkpoint's schedule ({saved['total_steps']} steps, effective batch {effective['saved']}) is not this "
                            f"run's ({now['total_steps']} steps, effective batch {effective['now']}): resume with the same config, or "
                            "start fresh with --overwrite"
                        ),
                    )
                ],
                source="resume",
            )
        # Positions in the epoch's global sample order: Accelerate deals global batches round-robin.
        samples = (
            int(state["progress"].get("batches_seen_in_epoch", 0)) * saved["world_size"] * saved["batch_size"]
        )
        per_batch = now["world_size"] * now["batch_size"]
        if samples % per_batch:
            raise ConfigError(
                [
                    (
                        "DATA.BATCH_SIZE",
                        (
                            f"the checkpoint stopped {samples} samples into its epoch, which is not a whole number of this "
                            f"run's {per_batch}-sample global batches: resume with the checkpoint's batch size "
                            f"({saved['batch_size']} per process)"
                        ),
                    )
                ],
                source="resume",
            )
        return samples // per_batch

    def _wandb_run_id(self) -> str | None:
        if not self.config.EXPERIMENT.WANDB.ENABLED or not self.accelerator.is_main_process:
            return None
        run = getattr(self.accelerator.get_tracker("wandb", unwrap=True), "id", None)
        return str(run) if run else None

    # -- start and end ---------------------------------------------------------------------------
    def _start(self, resume_from: str | Path | None, overwrite: bool) -> Any:
        config, acc = self.config, self.accelerator
        # Decided on the main process and shared, so that every process stops with the same error
        # instead of waiting at a barrier for a process that has exited.
        if overwrite and acc.is_main_process:
            clear_run(config.output_dir)
        acc.wait_for_everyone()
        problem = output_problem(config, resume_from) if acc.is_main_process else None
        problem = broadcast_object_list([problem], from_process=0)[0]
        if problem is not None:
            raise ConfigError([problem])
        if acc.is_main_process:
            self.checkpointer.store.remove_stale_staging()
        self.out = run_outputs(acc, config, self.plan.total_steps)
        self._resume(resume_from)
        self.out.advance(self.progress.global_step, self.progress.current_epoch)
        text = summary_text(config, self.plan)
        self.out.write_assets(config, text)
        self.out.say(text)
        wandb = config.EXPERIMENT.WANDB
        if wandb.ENABLED:
            run = {
                "name": config.EXPERIMENT.NAME,
                "dir": str(config.output_dir),
                "tags": wandb.TAGS or None,
                "entity": wandb.ENTITY,
            }
            if self.resumed_wandb_id:
                run.update(id=self.resumed_wandb_id, resume="allow")
            acc.init_trackers(
                wandb.PROJECT or "linnaeus-accel",
                config=config.model_dump(mode="json"),
                init_kwargs={"wandb": run},
            )
        self.model.train()
        return self.out

    def _finish(self, stop: StopDecision | None) -> dict[str, Any]:
        acc, progress = self.accelerator, self.progress
        preempted = stop is not None and stop.reason == "preempted"
        acc.wait_for_everyone()
        if not preempted:  # a preempted run's weights are in its last checkpoint
            acc.save_model(
                self.model, self.config.output_dir / "final", safe_serialization=True
            )  # collective
        status = "preempted" if preempted else ("early_stopped" if stop is not None else "completed")
        summary = {
            "global_step": progress.global_step,
            "epoch": progress.epoch,
            "samples_seen": progress.samples_seen,
            "status": status,
            "stop_reason": stop.reason if stop else None,
            "best_metric": progress.best_metric,
            "expected_total_steps": self.plan.total_steps,
            "last_validation": self.last_validation,
        }
        summary["remote_sync_errors"] = self.checkpointer.close()
        self.out.write_json("summary.json", summary)
        acc.end_training()
        self.out.close()
        return summary
