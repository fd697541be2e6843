"""Building a run: what ``Trainer(...)`` turns the config, the model and the data into, once and in
this order (docs/design.md §2): the Accelerator, the loaders, warm-start weights, the optimizer,
``accelerator.prepare``, the plan, the task and its checks, and the parts the loop asks. The run's
stateful parts are registered here, in one place, in the ``StateRegistry`` under the names their
checkpoints have always used (a LoRA base by the ``CheckpointManager``; a callback's by the user)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..callbacks import Callback, RunActions, RunContext, build_callbacks, callback_entries, callback_name
from ..checkpoint.init_from import InitFrom, load_init_from
from ..checkpoint.manager import CheckpointManager
from ..checkpoint.save.nonfinite import NonFiniteGuard
from ..checkpoint.state.registry import StateRegistry
from ..config import Config
from ..optim.groups import optimizer_line
from ..optim.muon import momentum_warmup
from ..optim.registry import build_from_config
from ..process.gloo_exit import settle_gloo_threads_at_exit
from ..process.preemption import PreemptionWatch
from ..progress import TrainingConsistencyChecker, TrainingProgress
from ..run_directory.outputs import RunOutputs, run_outputs
from ..run_directory.run_lock import RunLock
from ..schedule import EarlyStopping, OpsSchedule, ResolvedPlan, resolve_plan
from ..tasks import STANDARD_PASS, Task, TaskContext, build_task
from .boundary_work import BoundaryWork
from .callback_list import CallbackList
from .end.final_weights import save_final
from .end.run_end import RunEnd
from .metrics.meter import TrainMeter, meter_for
from .metrics.train_log import TrainLog
from .recovery import Recovery
from .start.backends import check_optimizer_backend
from .start.setup import (
    OptimizerFactory,
    as_loader,
    build_optimizer,
    data_facts,
    default_optimizer,
    make_accelerator,
    prepare_run,
    shared_parameters,
)
from .start.task_checks import check_task, first_batch
from .step.batches import BatchSource
from .step.gradnorm import gradnorm_for
from .step.optimizer_step import OptimizerStep
from .validation.passes import run_pass


class DataPosition:
    """Where the training data stands inside an epoch, in every checkpoint (per process): a
    boundary starts the next epoch afresh, so nothing is saved there; resumed, the epoch continues
    from ``resumed``."""

    def __init__(self, progress: TrainingProgress, batches: BatchSource) -> None:
        self.progress, self.batches = progress, batches
        self.resumed: dict[str, Any] | None = None

    def save(self) -> dict[str, Any] | None:
        return self.batches.state_dict() if self.progress.batches_seen_in_epoch else None

    def load(self, state: dict[str, Any]) -> None:
        self.resumed = state


@dataclass
class RunParts:
    """The built run: what the loop asks and what a Trainer exposes (``trainer.model``, ...)."""

    config: Config
    accelerator: Accelerator
    model: nn.Module
    optimizer: torch.optim.Optimizer
    train_batches: BatchSource
    val_batches: BatchSource | None
    plan: ResolvedPlan
    ops: OpsSchedule
    task: Task
    progress: TrainingProgress
    early_stopping: EarlyStopping
    meter: TrainMeter
    step: OptimizerStep
    consistency: TrainingConsistencyChecker
    nonfinite: NonFiniteGuard
    recovery: Recovery
    preemption: PreemptionWatch
    state: StateRegistry
    data: DataPosition
    checkpoints: CheckpointManager
    callbacks: CallbackList
    boundary_work: BoundaryWork
    train_log: TrainLog
    end: RunEnd
    out: RunOutputs
    lock: RunLock
    init_from: InitFrom | None
    optimizer_line: str
    optimizer_given: torch.optim.Optimizer | None  # one given to the Trainer: the summary describes it
    train_size: int | None


def build_run(
    config: Config,
    model: nn.Module,
    train_data: Dataset[Any] | DataLoader[Any],
    val_data: Dataset[Any] | DataLoader[Any] | None,
    *,
    task: Task | None,
    optimizer: OptimizerFactory | torch.optim.Optimizer,
    collate_fn: Callable[[list[Any]], Any] | None,
    accelerator: Accelerator | None,
    remote: Any,
    callbacks: Sequence[Callback],
) -> RunParts:
    """See the module docstring and ``Trainer``; every mismatch between config, task, data and
    model found here is one ``ConfigError``."""
    acc = make_accelerator(
        accelerator,
        experiment=config.EXPERIMENT,
        env=config.ENV,
        data=config.DATA,
        loss=config.LOSS,
        train=config.TRAIN,
        schedule=config.SCHEDULE,
        output_dir=config.output_dir,
    )
    set_seed(config.EXPERIMENT.SEED)
    rank, world = acc.process_index, acc.num_processes
    pin = acc.device.type == "cuda"
    train = as_loader(config.DATA, config.EXPERIMENT.SEED, train_data, True, rank, world, collate_fn, pin)
    val = (
        as_loader(config.DATA, config.EXPERIMENT.SEED, val_data, False, rank, world, collate_fn, pin)
        if val_data is not None
        else None
    )
    init_from = load_init_from(  # MODEL.INIT_FROM: before the optimizer and prepare
        config.MODEL, config.TRAIN, config.output_dir, model
    )
    from_config = partial(build_from_config, config=config)  # a registered builder reads any section
    built = build_optimizer(
        optimizer, model, config.OPTIMIZER, config.LR_SCHEDULER, acc.device, from_config=from_config
    )
    check_optimizer_backend(acc, built)
    line = optimizer_line(built)  # before prepare: whole parameters, as built
    prepared = prepare_run(
        acc,
        model,
        built,
        train,
        val,
        seed=config.EXPERIMENT.SEED,
        data=config.DATA,
        model_config=config.MODEL,
        schedule=config.SCHEDULE,
    )
    model, opt, train_batches, val_batches = prepared[:4]
    # The config's callbacks, then those given here; the plan says when each one runs.
    all_callbacks = [*build_callbacks(config.CALLBACKS), *callbacks]
    names = [entry.NAME for entry in config.CALLBACKS] + [callback_name(c) for c in callbacks]
    timed = config.model_copy(update={"CALLBACKS": callback_entries(all_callbacks, names)})
    plan = resolve_plan(timed, prepared.batches_per_epoch, world, train.size, **data_facts(train.dataset))
    ops = OpsSchedule(plan)
    task = task if task is not None else build_task(config.TASK)
    task.bind(TaskContext(config, plan, train.dataset, rank, world, acc.device, ops))
    progress = TrainingProgress(total_epochs=plan.epochs or 0, expected_total_steps=plan.total_steps)
    batch = first_batch(train.dataset, train.collate)
    for source in (train_batches, val_batches):
        if source is not None and source.unsized is not None:
            source.unsized.template = batch  # what a process out of batches trains on, at zero weight
    mode, ranking_mode = check_task(
        task,
        plan,
        model,
        batch,
        acc.device,
        ops,
        config_problems=task.config_problems(config),
        task_config=config.TASK,
        loss=config.LOSS,
        train=config.TRAIN,
        schedule=config.SCHEDULE,
    )
    early_stopping = EarlyStopping(config.TRAIN.EARLY_STOP, plan.warmup_steps, mode)
    gradnorm = gradnorm_for(config.LOSS, len(task.components))
    meter = meter_for(acc, config.TASK, config.ENV.PEAK_FLOPS, task, model, plan.metrics_interval)
    progress.count_tokens_from(meter.take_tokens)  # tokens_seen: counted on the device, read when needed
    step = OptimizerStep(
        acc, model, opt, task, ops, meter,
        weights=list(config.LOSS.TASK_WEIGHTS or [1.0] * len(task.components)),
        clip_grad=config.TRAIN.CLIP_GRAD, gradnorm=gradnorm,
        shared_parameters=shared_parameters(acc.unwrap_model(model)) if gradnorm else None,
        skip_nonfinite=config.TRAIN.NONFINITE == "skip",
        momentum_warmup=momentum_warmup(config.OPTIMIZER.MUON, config.OPTIMIZER.NAME),
    )  # fmt: skip
    nonfinite = NonFiniteGuard(acc, meter, model, config.TRAIN.NONFINITE)
    callback_list = CallbackList(all_callbacks, plan, acc.is_main_process)
    # Every stateful part of the run, under the names its checkpoints have always used.
    state, data = StateRegistry(), DataPosition(progress, train_batches)
    state.register("progress", progress)
    state.register("early_stopping", early_stopping)
    if gradnorm is not None:
        state.register("gradnorm", save=gradnorm.state_dict, load=step.load_gradnorm)
    state.register("callbacks", callback_list)
    state.register("meter", meter, per_rank=True)
    state.register("data", save=data.save, load=data.load, per_rank=True)
    checkpoints = CheckpointManager(
        acc,
        config.model_dump(mode="json"),
        plan,
        state,
        progress,
        nonfinite,
        opt,
        env=config.ENV,
        experiment=config.EXPERIMENT,
        model_config=config.MODEL,
        train=config.TRAIN,
        schedule=config.SCHEDULE,
        ranking_metric=config.ranking_metric,
        output_dir=config.output_dir,
        remote=remote,
        mode=ranking_mode,
    )
    checkpoints.after_save.append(callback_list.checkpoint_saved)
    checkpoints.tell_commits(callback_list.committed)
    # Writes nothing before the run is claimed.
    out = run_outputs(acc, config.output_dir, plan.total_steps, config.ENV.PROGRESS_BAR)
    recovery = Recovery(acc, config.TRAIN, checkpoints, meter, progress, out)
    state.register("recovery", recovery)
    checkpoints.before_save.append(recovery.before_checkpoint)
    checkpoints.keep_also(recovery.protected)
    preemption = PreemptionWatch(acc, timeout_s=config.ENV.DIST_TIMEOUT_S)
    if acc.num_processes > 1:
        settle_gloo_threads_at_exit()  # a user's script that ends after fit() exits 0, not -6
    boundary_work = BoundaryWork(
        acc, config.ranking_metric, model, task, ops, progress, val_batches, checkpoints, preemption, early_stopping, meter,
        ranking_mode, on_validation_end=callback_list.validation_end, out=out,
    )  # fmt: skip
    end = RunEnd(
        acc, config.output_dir, config.ENV.DIST_TIMEOUT_S, plan, model, progress, checkpoints, nonfinite, out,
        train_data=train.dataset, last_validation=lambda: boundary_work.last_validation, rollbacks=recovery.summary,
        interrupted=lambda: preemption.interrupted,
    )  # fmt: skip
    return RunParts(
        config, acc, model, opt, train_batches, val_batches, plan, ops, task, progress, early_stopping,
        meter, step, TrainingConsistencyChecker.for_plan(plan, config.DATA.DROP_LAST), nonfinite, recovery,
        preemption, state, data, checkpoints, callback_list, boundary_work,
        TrainLog(ops, progress, meter, train_batches, checkpoints, nonfinite, recovery, out), end, out,
        RunLock(config.output_dir), init_from, line, None if optimizer is default_optimizer else built, train.size,
    )  # fmt: skip


def run_context(parts: RunParts, trainer: Any = None) -> RunContext:
    """What the run's callbacks are handed (``callbacks.context``); ``trainer``: reached through it
    by callbacks written for the Trainer, with a deprecation warning."""
    acc, val, task = parts.accelerator, parts.val_batches, parts.task

    def validate(model: nn.Module, prefix: str) -> dict[str, float]:
        assert val is not None
        return run_pass(acc, model, val, task, replace(STANDARD_PASS, prefix=prefix))

    def final(model: nn.Module, name: str) -> Path:
        directory = parts.config.output_dir / "final" / name
        save_final(acc, model, directory, parts.end.tokenizer)
        return directory

    actions = RunActions(
        log=parts.out.log,
        say=parts.out.say,
        register_state=parts.state.register_user,
        registered_names=parts.state.user_names,
        validate=validate if val is not None else None,
        save_final=final,
    )
    return RunContext(
        parts.config, parts.plan, acc, parts.model, parts.optimizer, parts.progress, parts.callbacks.callbacks,
        parts.train_batches.dataset,
        parts.end.tokenizer, actions, trainer,
    )  # fmt: skip
