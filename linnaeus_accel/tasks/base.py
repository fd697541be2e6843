"""The task interface: the one place where the Trainer asks about what is being trained.

A task turns a micro-batch into **summed** losses, one per loss component (a hierarchical model's
label levels; one ``loss`` otherwise), and counts the target units each sum runs over (labelled
samples, or target tokens for a language model). The Trainer divides every component's sum by that
component's units over the whole optimizer step (all micro-batches, all processes), so the step's
loss is the mean over every unit it holds, however the step is split into micro-batches and
processes, and whatever padding the batches carry (docs/semantics.md §1).

Padding: Accelerate repeats samples to even out the last global batch of an epoch. The Trainer
knows which rows are repeats and hands ``prepare`` a mask of the real rows (None when all are
real); a task gives the others no label, so they count nowhere: not in the loss, the gradient, the
units, the tokens or the metrics.

Everything called per micro-batch (``prepare``, ``units``, ``loss_sums``, ``validation_step``)
works on device tensors and never reads a value back to the host.

Writing your own: subclass ``Task``, set ``name`` and ``metric_directions``, implement ``units``,
``loss_sums``, ``validation_step`` and ``validation_metrics``; pass an instance to
``Trainer(..., task=MyTask())`` or register it with ``@register_task("name")`` for ``TASK.NAME``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..config import Config
from ..config.schedule import ScheduleConfig
from ..progress import TrainingStage
from ..schedule import OpsSchedule, ResolvedPlan

Direction = Literal["min", "max"]
IGNORE_INDEX = -100  # labels with this value carry no target (PyTorch's and Hugging Face's convention)


@dataclass(frozen=True)
class ValidationPass:
    stage: TrainingStage
    prefix: str  # metric names are <prefix>/<metric>
    masked: tuple[str, ...] | None = None  # hierarchical: metadata masked (None: nothing; (): everything)
    partial_index: int | None = None


STANDARD_PASS = ValidationPass(TrainingStage.VALIDATION_NORMAL, "val")


@dataclass(frozen=True)
class TaskContext:
    """What a task may need to know about the run it is part of (given once, at start-up)."""

    config: Config
    plan: ResolvedPlan
    dataset: Any  # the training dataset
    rank: int
    world_size: int
    device: torch.device
    ops: OpsSchedule | None = None  # the run's questions to the plan (None: the task asks the plan itself)

    @property
    def schedule(self) -> OpsSchedule:
        """The run's ``OpsSchedule`` (one per run, not one per component that asks)."""
        return self.ops if self.ops is not None else OpsSchedule(self.plan)


class Task:
    name = "custom"
    # Loss components, in the order of ``units`` and ``loss_sums``; LOSS.TASK_WEIGHTS and GradNorm
    # weight them. One component unless the task has several heads.
    components: tuple[str, ...] = ("loss",)
    # True when ``units(batch)[0]`` counts target tokens: they are added up as ``tokens_seen``.
    counts_tokens = False
    # Whether each validation metric (the part after ``<prefix>/``) is better lower or higher:
    # early stopping and checkpoint ranking read this, never the metric's name.
    metric_directions: Mapping[str, Direction] = {"loss": "min"}

    def bind(self, context: TaskContext) -> None:
        """Called once by the Trainer before training: the config, the resolved plan, the data."""
        self.context = context

    # -- checks at construction: one clear error instead of a traceback from inside a step -------
    def config_problems(self, config: Config) -> list[tuple[str, str]]:
        """Config keys this task cannot honour, each with the fix."""
        return linnaeus_only_problems(config.SCHEDULE, self.name)

    def dataset_problem(self) -> str | None:
        """What the training dataset lacks for this task (after ``bind``), or None."""
        return None

    def batch_problem(self, batch: Any) -> str | None:
        """What a (collated) training batch lacks for this task, or None."""
        return None

    def output_problem(self, output: Any, batch: Any) -> str | None:
        """What the model's output on ``batch`` lacks for this task, or None."""
        return None

    def default_flops_per_unit(self, model: nn.Module) -> float | None:
        """FLOPs (forward + backward) per token for token tasks, else per sample; None: no MFU."""
        return None

    # -- training, per micro-batch ---------------------------------------------------------------
    def prepare(self, batch: Any, step: int, epoch: int, batch_index: int, real: Tensor | None) -> Any:
        """The micro-batch as trained at global step ``step``: rows outside ``real`` lose their
        targets; schedule-driven transforms (masking, mixup) go here too."""
        return batch

    def units(self, batch: Any) -> Tensor:
        """Target units per component in this micro-batch (int64, shape ``[len(components)]``)."""
        raise NotImplementedError

    def forward(self, model: nn.Module, batch: Any) -> Any:
        """How this task calls the model on a batch (the model's raw output). Optional: with it,
        the Trainer checks the model's output (``output_problem``) before training."""
        raise NotImplementedError

    def loss_sums(self, model: nn.Module, batch: Any) -> Tensor:
        """Per-component losses summed over the batch's target units (shape ``[len(components)]``,
        with graph). Returning a mean instead would weigh a short micro-batch like a full one."""
        raise NotImplementedError

    # -- validation --------------------------------------------------------------------------------
    def validation_passes(self, ops: OpsSchedule, epoch: int, final: bool) -> list[ValidationPass]:
        """The passes due at this epoch boundary, in order."""
        return [STANDARD_PASS] if ops.should_validate(epoch, final) else []

    def validation_step(
        self, model: nn.Module, batch: Any, real: Tensor | None, vpass: ValidationPass
    ) -> Tensor:
        """Sums over this batch's real rows (float64, one fixed-size vector per pass); the Trainer
        adds them up over the pass and over processes, then calls ``validation_metrics``."""
        raise NotImplementedError

    def validation_metrics(self, sums: list[float], vpass: ValidationPass) -> dict[str, float]:
        raise NotImplementedError

    def direction(self, metric: str) -> Direction | None:
        """``min``/``max`` for a metric this task reports (by the part after its last ``/``)."""
        return self.metric_directions.get(metric.rsplit("/", 1)[-1])


def logits_of(output: Any) -> Tensor:
    """The logits of a model's output: a tensor, or an object with ``.logits`` (a transformers
    ``ModelOutput``), or a mapping with ``"logits"``."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("logits"), Tensor):
        logits: Tensor = output["logits"]
        return logits
    attribute = getattr(output, "logits", None)
    if isinstance(attribute, Tensor):
        return attribute
    raise TypeError(
        f"the model returned {type(output).__name__}: expected a logits tensor or an object with .logits"
    )


def output_logits_problem(output: Any) -> str | None:
    try:
        logits_of(output)
    except TypeError as exc:
        return str(exc)
    return None


def drop_targets(labels: Tensor, real: Tensor | None, ignore: int = IGNORE_INDEX) -> Tensor:
    """``labels`` with the rows outside ``real`` (even-batch repeats) set to ``ignore``."""
    if real is None:
        return labels
    keep = real.reshape(real.shape[0], *([1] * (labels.dim() - 1)))
    return labels.masked_fill(~keep, ignore)


def describe_keys(batch: Any) -> str:
    if isinstance(batch, Mapping):
        return "a dict with keys " + ", ".join(map(str, batch)) if batch else "an empty dict"
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return f"a {type(batch).__name__} of {len(batch)} items"
    return f"a {type(batch).__name__}"


def linnaeus_only_problems(schedule: ScheduleConfig, task: str) -> list[tuple[str, str]]:
    """Schedules that act on a hierarchical dataset's metadata and label groups."""
    sched, val = schedule, schedule.VALIDATION
    used = {
        "SCHEDULE.META_MASKING.ENABLED": sched.META_MASKING.ENABLED,
        "SCHEDULE.META_MASKING.PARTIAL.ENABLED": sched.META_MASKING.PARTIAL.ENABLED,
        "SCHEDULE.MIXUP.PROB.ENABLED": sched.MIXUP.PROB.ENABLED,
        "SCHEDULE.VALIDATION.MASK_META_INTERVAL_*": any(
            getattr(val, f"MASK_META_INTERVAL_{u}") is not None for u in ("EPOCHS", "STEPS", "FRACTION")
        ),
        "SCHEDULE.VALIDATION.PARTIAL_MASK_META.ENABLED": val.PARTIAL_MASK_META.ENABLED,
        "SCHEDULE.VALIDATION.FINAL_EPOCH.EXHAUSTIVE_PARTIAL_META_VALIDATION": (
            val.FINAL_EPOCH.EXHAUSTIVE_PARTIAL_META_VALIDATION
        ),
    }
    return [
        (
            key,
            f"acts on metadata and label groups, which only the hierarchical task has (TASK.NAME is {task}): turn it off",
        )
        for key, on in used.items()
        if on
    ]
