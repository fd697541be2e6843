"""What the Trainer checks about its task, data and model before the first step, so that a
mismatch is one clear error naming what is missing, not a traceback from inside a step.

The last check runs the model once (evaluation mode, no gradients) on a batch of the first two
training samples, as Lightning's sanity check does: a model that cannot take the task's batches
or returns the wrong thing is found at construction.
"""

from __future__ import annotations

from itertools import islice
from typing import Any, Literal

import torch
from accelerate.utils import send_to_device
from torch import nn
from torch.utils.data import IterableDataset, default_collate

from ...config import ConfigError
from ...config.schedule import ScheduleConfig
from ...config.sections import LossConfig, TaskConfig, TrainConfig
from ...data.species.errors import UnreadablePhoto
from ...data.tokens.format import TokenOutOfVocab
from ...schedule import OpsSchedule, ResolvedPlan
from ...schedule.boundaries import Boundary
from ...tasks import Task

Problem = tuple[str, str]
Mode = Literal["min", "max"]


def check_task(
    task: Task,
    plan: ResolvedPlan,
    model: nn.Module,
    batch: Any,
    device: torch.device,
    ops: OpsSchedule | None = None,
    *,
    config_problems: list[Problem],
    task_config: TaskConfig,
    loss: LossConfig,
    train: TrainConfig,
    schedule: ScheduleConfig,
) -> tuple[Mode, Mode]:
    """Every problem at once as one ConfigError; else whether the early-stopping metric and the
    checkpoint-ranking metric are better lower or higher. ``ops``: the run's (default: one of ``plan``).
    ``config_problems``: what the task's own ``Task.config_problems`` found in the whole config;
    ``task_config``, ``loss``, ``train``, ``schedule``: the config's TASK, LOSS, TRAIN and SCHEDULE."""
    early = train.EARLY_STOP
    ranking = schedule.CHECKPOINT.METRIC
    problems = task_problems(
        task, plan, config_problems=config_problems, task_config=task_config, loss=loss, train=train
    )
    passes = validation_prefixes(task, plan, ops)
    mode, problem = metric_mode(task, early.METRIC, "TRAIN.EARLY_STOP.METRIC", early.MODE, passes)
    # A metric matters when it stops the run or ranks the checkpoints (by default, the early-stop one).
    if problem is not None and (early.ACTIVE or ranking is None):
        problems.append(problem)
    ranking_mode = mode
    if ranking is not None:
        configured = early.MODE if ranking == early.METRIC else None
        ranking_mode, problem = metric_mode(task, ranking, "SCHEDULE.CHECKPOINT.METRIC", configured, passes)
        problems += [problem] if problem is not None else []
    if not problems:  # the model runs only on a config that is otherwise right
        probe = probe_problem(task, model, batch, device)
        problems += [("TASK.NAME", probe)] if probe is not None else []
    if problems:
        raise ConfigError(problems)
    return mode, ranking_mode


def validation_prefixes(task: Task, plan: ResolvedPlan, ops: OpsSchedule | None = None) -> set[str]:
    """The metric prefixes (``val``, ``val_mask_meta``, ...) of every validation pass this run makes:
    the passes due at the first epoch of each boundary event and at the final boundary (an early
    stop's included) cover every kind the schedule has."""
    ops = ops if ops is not None else OpsSchedule(plan)
    final = ops.final_point()
    prefixes = {p.prefix for p in task.validation_passes(ops.at(final), final.epoch, True)}
    if plan.epochs is not None and plan.known_epochs:
        epochs = {e for events in ops.events().values() if (e := events.after(1)) is not None}
        for epoch in epochs:
            prefixes |= {p.prefix for p in task.validation_passes(ops, epoch, epoch == plan.epochs)}
    else:  # epochs of unknown length: the first multiple of each step interval that falls in the run
        for interval in (plan.validation, plan.mask_meta_validation, plan.partial_mask_meta_validation):
            if interval is not None and interval.every < plan.total_steps:
                point = Boundary(1, interval.every, interval.every - 1, mid=plan.mid_epoch_validation)
                prefixes |= {p.prefix for p in task.validation_passes(ops.at(point), 1, False)}
    return prefixes


def task_problems(
    task: Task,
    plan: ResolvedPlan,
    *,
    config_problems: list[Problem],
    task_config: TaskConfig,
    loss: LossConfig,
    train: TrainConfig,
) -> list[Problem]:
    """``config_problems`` (the task's own, see ``check_task``), then what the task, its data and
    the config's TASK, LOSS and TRAIN sections ask of each other."""
    problems = list(config_problems)
    dataset = task.dataset_problem()
    if dataset is not None:
        problems.append(("TASK.NAME", dataset))
    n = len(task.components)
    weights = loss.TASK_WEIGHTS
    if weights is not None and len(weights) != n:
        problems.append(
            (
                "LOSS.TASK_WEIGHTS",
                f"has {len(weights)} entries but the {task.name} task has {n} loss component(s) "
                f"({', '.join(task.components)})",
            )
        )
    if loss.GRAD_WEIGHTING.TASK.GRADNORM_ENABLED and n < 2:
        problems.append(
            (
                "LOSS.GRAD_WEIGHTING.TASK.GRADNORM_ENABLED",
                f"GradNorm balances several loss components; the {task.name} task has one: turn it off",
            )
        )
    if train.TARGET_TOKENS is not None and not task.counts_tokens:
        problems.append(
            ("TRAIN.TARGET_TOKENS", f"the {task.name} task does not count tokens: use TRAIN.EPOCHS")
        )
    if task_config.FLOPS_PER_TOKEN is not None and not task.counts_tokens:
        problems.append(
            ("TASK.FLOPS_PER_TOKEN", f"the {task.name} task does not count tokens: use TASK.FLOPS_PER_SAMPLE")
        )
    return problems


def metric_mode(
    task: Task, metric: str, key: str, configured: Mode | None, prefixes: set[str] | None = None
) -> tuple[Mode, Problem | None]:
    """Whether ``metric`` is better lower or higher: the config's MODE, else what the task says.

    A metric is ``<pass>/<name>``: a name the task does not declare, or a pass this run never makes
    (``prefixes``; None: not checked), is a problem, since nothing would ever report it: the run
    would not stop early and its checkpoints would not be ranked. A run without any validation
    pass reports no metric at all; its sanity warnings say so, so its names are not judged here.
    """
    direction = task.direction(metric)
    prefix = metric.rsplit("/", 1)[0] if "/" in metric else ""
    if prefixes is not None and not prefixes:
        return configured or direction or "min", None
    if direction is not None and (prefixes is None or prefix in prefixes):
        return configured or direction, None
    names = ", ".join(task.metric_directions)
    ordered = sorted(prefixes or {"val"}, key=lambda p: (p != "val", p))
    if direction is None:
        why = (
            f"the {task.name} task reports no metric named {metric.rsplit('/', 1)[-1]!r} (it reports {names})"
        )
    else:
        why = f"this run makes no validation pass {prefix!r} (its passes: {', '.join(ordered)})"
    # The example is one the run reports: the name asked for in a pass made, or the pass asked for
    # with a name the task reports (never the metric refused, as 'e.g. val/loss' was for val/loss).
    name = metric.rsplit("/", 1)[-1] if direction is not None else next(iter(task.metric_directions), None)
    example = f", e.g. {prefix if prefix in ordered else ordered[0]}/{name}" if name is not None else ""
    return configured or direction or "min", (
        key,
        f"{metric} is never reported: {why}; name one as <pass>/<metric>{example} "
        "(a task of your own declares its metrics in metric_directions)",
    )


# Errors of the data itself, each said in one sentence by its own message.
DATA_ERRORS = (UnreadablePhoto, TokenOutOfVocab)


def first_batch(dataset: Any, collate: Any, rows: int = 2) -> Any:
    """A batch of the first ``rows`` training samples, collated as training collates them. A sample
    the data cannot give (an unreadable photo, a token out of the vocabulary) is a ``ConfigError``
    in the data's own sentence: found before training, it is the data to fix, not a bug."""
    try:
        if isinstance(dataset, IterableDataset):
            items = list(islice(iter(dataset), rows))
        else:
            items = [dataset[i] for i in range(min(rows, len(dataset)))]
    except DATA_ERRORS as exc:
        raise ConfigError([("DATA", str(exc))], source="data") from None
    if not items:
        return None
    return (collate or default_collate)(items)


def probe_problem(task: Task, model: nn.Module, batch: Any, device: torch.device) -> str | None:
    """The task's view of a first batch and of the model's output on it (no gradients)."""
    if batch is None:
        return "the training data is empty"
    problem = task.batch_problem(batch)
    if problem is not None:
        return problem
    batch = send_to_device(batch, device)
    # A compiled model is probed through its own module, eagerly: a compiled probe of this small
    # batch made the first training batch a second shape, so torch.compile made the batch size
    # dynamic in the training graph (found on an H100: a GPT-2's attention forward 1.5x slower,
    # the run 4-5% slower than a hand-written loop), besides one more compilation to wait for.
    model = eager_module(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if type(task).forward is not Task.forward:
                problem = task.output_problem(task.forward(model, batch), batch)
                if problem is not None:
                    return problem
            task.loss_sums(model, task.prepare(batch, 0, 1, 0, None))  # what a training step does
    except Exception as exc:  # the user's model or task: any error it raises is the finding
        return f"the model failed on a batch of the first training samples: {type(exc).__name__}: {exc}"
    finally:
        model.train(was_training)
        reshard(model)
    return None


def eager_module(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile``d model wraps (the same parameters, and Accelerate's autocast
    on its forward), else the model."""
    original = getattr(model, "_orig_mod", None)
    return original if isinstance(original, nn.Module) else model


def reshard(model: nn.Module) -> None:
    """FSDP2 keeps a root module's parameters gathered after a forward that no backward follows
    (the probe's): shard them again, so that the model's parameters are the sharded ones the
    optimizer holds when the step lists them (else the first clip mixes gathered tensors with
    DTensors, and fails)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch before 2.6: no FSDP2 there to reshard
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
