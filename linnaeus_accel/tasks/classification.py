"""``classification``: one integer label per sample, cross-entropy (optional label smoothing).

Batches are dicts holding the model's input under ``TASK.INPUT_KEY`` (default ``image``) and
``labels`` ``[batch]``, or ``(input, labels)`` pairs such as a ``TensorDataset`` gives. The model
is called as ``model(input)`` and returns logits ``[batch, classes]`` (or an object with
``.logits``). A label of -100 carries no target. Validation: loss (plain cross-entropy: label
smoothing shapes training, not what the metric measures), top-1 accuracy (``acc``) and, with more
than 5 classes, top-5 accuracy (``acc_top5``), over every validation sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Config
from .base import (
    IGNORE_INDEX,
    Direction,
    Task,
    TaskContext,
    ValidationPass,
    describe_keys,
    drop_targets,
    linnaeus_only_problems,
    logits_of,
    output_logits_problem,
)

TOP_K = 5


class ClassificationTask(Task):
    name = "classification"
    metric_directions: Mapping[str, Direction] = {"loss": "min", "acc": "max", "acc_top5": "max"}

    def __init__(self, input_key: str = "image", label_smoothing: float = 0.0) -> None:
        self.input_key = input_key
        self.label_smoothing = label_smoothing
        self.num_classes: int | None = None

    def bind(self, context: TaskContext) -> None:
        super().bind(context)
        self.input_key = context.config.TASK.INPUT_KEY
        self.label_smoothing = context.config.TASK.LABEL_SMOOTHING

    def config_problems(self, config: Config) -> list[tuple[str, str]]:
        return linnaeus_only_problems(config.SCHEDULE, self.name)

    def _split(self, batch: Any) -> tuple[Any, Tensor]:
        if isinstance(batch, Mapping):
            return batch[self.input_key], batch["labels"]
        inputs, labels = batch
        return inputs, labels

    def _join(self, batch: Any, labels: Tensor) -> Any:
        if isinstance(batch, Mapping):
            return {**batch, "labels": labels}
        return (batch[0], labels)

    def batch_problem(self, batch: Any) -> str | None:
        if isinstance(batch, Mapping):
            missing = [k for k in (self.input_key, "labels") if k not in batch]
            if missing:
                return (
                    f"the classification task needs batches with keys {self.input_key!r} (TASK.INPUT_KEY) and "
                    f"'labels', or (input, label) pairs; the training data gives {describe_keys(batch)}"
                )
        elif not (isinstance(batch, Sequence) and len(batch) == 2):
            return f"the classification task needs dict batches or (input, label) pairs; the training data gives {describe_keys(batch)}"
        labels = self._split(batch)[1]
        if not isinstance(labels, Tensor) or labels.dim() != 1 or labels.dtype.is_floating_point:
            shape = (
                f"{labels.dtype} {tuple(labels.shape)}"
                if isinstance(labels, Tensor)
                else type(labels).__name__
            )
            return f"the classification task needs one integer label per sample (labels [batch]), got {shape}"
        return None

    def output_problem(self, output: Any, batch: Any) -> str | None:
        problem = output_logits_problem(output)
        if problem is None and logits_of(output).dim() != 2:
            problem = (
                f"the classification task needs logits [batch, classes], got {tuple(logits_of(output).shape)}"
            )
        return problem

    def forward(self, model: nn.Module, batch: Any) -> Any:
        return model(self._split(batch)[0])

    def prepare(self, batch: Any, step: int, epoch: int, batch_index: int, real: Tensor | None) -> Any:
        if real is None:
            return batch
        return self._join(batch, drop_targets(self._split(batch)[1], real))

    def units(self, batch: Any) -> Tensor:
        return (self._split(batch)[1] != IGNORE_INDEX).sum().reshape(1)

    def loss_sums(self, model: nn.Module, batch: Any) -> Tensor:
        logits = logits_of(self.forward(model, batch))
        labels = self._split(batch)[1]
        loss = F.cross_entropy(
            logits.float(),
            labels,
            ignore_index=IGNORE_INDEX,
            reduction="sum",
            label_smoothing=self.label_smoothing,
        )
        return loss.reshape(1)

    def validation_step(
        self, model: nn.Module, batch: Any, real: Tensor | None, vpass: ValidationPass
    ) -> Tensor:
        """[summed loss, samples, top-1 hits, top-5 hits] over the real, labelled samples."""
        labels = drop_targets(self._split(batch)[1], real)
        logits = logits_of(self.forward(model, batch)).float()
        self.num_classes = logits.shape[-1]
        known = labels != IGNORE_INDEX
        loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        top = logits.topk(min(TOP_K, logits.shape[-1]), dim=-1).indices
        hits = (top == labels[:, None]) & known[:, None]
        return torch.stack(
            [loss.double(), known.sum().double(), hits[:, 0].sum().double(), hits.any(dim=1).sum().double()]
        )

    def validation_metrics(self, sums: list[float], vpass: ValidationPass) -> dict[str, float]:
        loss, n, top1, top5 = sums
        n = max(1.0, n)
        out = {f"{vpass.prefix}/loss": loss / n, f"{vpass.prefix}/acc": top1 / n}
        if self.num_classes is not None and self.num_classes > TOP_K:
            out[f"{vpass.prefix}/acc_top5"] = top5 / n
        return out
