"""``hierarchical``: linnaeus' task. One logits tensor per label level (coarse to fine), a
cross-entropy per level over the samples labelled at that level (a negative label is null), the
schedule's metadata masking and in-group mixup, and validation passes with metadata masked.

Batches are dicts with ``index`` (the sample's index in the dataset: it keys the random draws),
``image``, ``meta`` (a dict of component tensors) and ``labels`` ``[B, levels]``; the training
dataset declares ``levels`` (and ``meta_components`` when it has metadata).

Each validation pass reports ``<prefix>/loss``, ``chain_acc``, ``partial_chain_acc``, and per level
``acc_<level>`` (top-1) and ``acc3_<level>`` (top-3); ``validation_hit_sums`` says what each counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Config
from ..progress import TrainingStage
from ..schedule import OpsSchedule
from .base import Direction, Task, TaskContext, ValidationPass, describe_keys, drop_targets
from .transforms import InGroupMixup, MetaMasker

NULL_LABEL = -1
TOP_K = 3  # acc3_<level>: the label among the level's 3 highest logits (all of them with fewer classes)


def passes_at_boundary(ops: OpsSchedule, epoch: int, final: bool) -> list[ValidationPass]:
    """The passes due at this boundary, in the order of docs/semantics.md §5: standard, mask-meta, partial."""
    passes = []
    if ops.should_validate(epoch, final):
        passes.append(ValidationPass(TrainingStage.VALIDATION_NORMAL, "val", None))
    if ops.should_validate_mask_meta(epoch, final):
        passes.append(ValidationPass(TrainingStage.VALIDATION_MASK_META, "val_mask_meta", ()))
    for i, combination in enumerate(ops.partial_mask_combinations(epoch, final)):
        passes.append(
            ValidationPass(
                TrainingStage.VALIDATION_PARTIAL_MASK_META, ops.partial_pass_name(combination), combination, i
            )
        )
    return passes


def level_loss_sums(logits: Sequence[Tensor], labels: Tensor) -> Tensor:
    """Cross-entropy per level summed over the samples labelled at that level (``[levels]``)."""
    # Every negative (null) label becomes NULL_LABEL, which the cross-entropies ignore (-100 or -7
    # would be out of range): one clamp for all levels instead of a comparison and a fill per level.
    targets = labels.clamp_min(NULL_LABEL)
    return torch.stack(
        [
            F.cross_entropy(lg.float(), targets[:, i], ignore_index=NULL_LABEL, reduction="sum")
            for i, lg in enumerate(logits)
        ]
    )


def validation_hit_sums(logits: Sequence[Tensor], labels: Tensor, real: Tensor | None) -> Tensor:
    """What the accuracies of one validation batch add up (float64, ``3 * levels + 4`` values):

    - ``[0:L]`` top-1 hits and ``[L:2L]`` samples labelled, per level: ``acc_<level>``;
    - ``[2L:3L]`` top-3 hits per level (k = min(3, the level's classes)): ``acc3_<level>``;
    - ``[3L]`` chain hits and ``[3L+1]`` samples: ``chain_acc``, the samples whose every labelled level
      is right, over every sample; a sample with no labelled level has nothing wrong and counts as right;
    - ``[3L+2]`` partial-chain hits and ``[3L+3]`` samples with a label: ``partial_chain_acc``. A sample
      is right when, from its finest labelled level up to the coarsest, every labelled level is (a null
      level in between is skipped). Every labelled level lies at or above the finest labelled one, so
      this is chain_acc's test of a sample; the one difference is the samples with no labelled level,
      which chain_acc counts as right (numerator and denominator) and partial_chain_acc leaves out of
      both. The two are equal when every sample has a label, and partial_chain_acc is the lower
      otherwise. linnaeus (where null is class 0, a class the model predicts) computes it from the
      finest rank, null or not, up to the coarsest labelled one; here a null level has no target.

    ``labels``: ``[B, levels]`` class indices, coarse to fine, negative for null; ``real``: the rows
    that count (None: all), the others (even-batch repeats) count nowhere.
    """
    labels = drop_targets(labels, real, NULL_LABEL)
    known = labels >= 0
    hit = torch.stack([lg.argmax(dim=1) for lg in logits], dim=1) == labels
    # Top-3 as top-1 or among the top k: argmax and topk may pick different indices among tied logits,
    # and a top-3 accuracy below the top-1 accuracy would read as a bug.
    top = torch.stack(
        [
            (lg.topk(min(TOP_K, lg.shape[1]), dim=1).indices == labels[:, i, None]).any(dim=1)
            for i, lg in enumerate(logits)
        ],
        dim=1,
    )
    hit, top = hit & known, (top | hit) & known
    chain = (hit | ~known).all(dim=1)
    labelled = known.any(dim=1)
    count = labels.new_tensor(labels.shape[0]) if real is None else real.sum()
    return torch.cat(
        [
            hit.sum(0).double(),
            known.sum(0).double(),
            top.sum(0).double(),
            (chain if real is None else chain & real).sum().double().reshape(1),
            count.double().reshape(1),
            (chain & labelled).sum().double().reshape(1),
            labelled.sum().double().reshape(1),
        ]
    )


class HierarchicalTask(Task):
    name = "hierarchical"
    # chain_acc first among the accuracies: it is the headline of a masked pass on the console.
    metric_directions: Mapping[str, Direction] = {
        "loss": "min",
        "chain_acc": "max",
        "partial_chain_acc": "max",
    }

    def __init__(self) -> None:
        self.levels: tuple[str, ...] = ()

    def bind(self, context: TaskContext) -> None:
        super().bind(context)
        dataset, config, plan = context.dataset, context.config, context.plan
        self.levels = tuple(getattr(dataset, "levels", ()))
        self.components = self.levels
        self.metric_directions = {
            "loss": "min",
            "chain_acc": "max",
            "partial_chain_acc": "max",
            **{f"acc_{level}": "max" for level in self.levels},
            **{f"acc3_{level}": "max" for level in self.levels},
        }
        self.ops = context.schedule
        self.plan = plan
        seed = config.EXPERIMENT.SEED
        meta = tuple(getattr(dataset, "meta_components", ()))
        self.masker = MetaMasker(meta, seed) if meta else None
        self.mask_training = self.masker is not None and (plan.meta_mask.enabled or plan.partial_mask.enabled)
        mix = config.SCHEDULE.MIXUP
        self.mixup = (
            InGroupMixup(
                self.levels.index(plan.mixup_group_level),
                mix.ALPHA,
                mix.MIN_GROUP_SIZE,
                mix.EXCLUDE_NULL_SAMPLES,
                seed,
            )
            if plan.mixup.enabled and plan.mixup_group_level in self.levels
            else None
        )
        self.rank, self.world = context.rank, context.world_size
        self.level_weights = torch.tensor(
            config.LOSS.TASK_WEIGHTS or [1.0] * len(self.levels), device=context.device
        )

    def config_problems(self, config: Config) -> list[tuple[str, str]]:
        return []  # every schedule applies; the dataset's levels and components are checked in bind

    def dataset_problem(self) -> str | None:
        if not self.levels:
            return (
                "the hierarchical task needs a training dataset that declares `levels` (the names of its label "
                "levels, coarse to fine), with items holding index, image, meta and labels [levels]; for one "
                "label per sample set TASK.NAME to classification"
            )
        return None

    def batch_problem(self, batch: Any) -> str | None:
        need = ("index", "image", "meta", "labels")
        if not isinstance(batch, Mapping) or any(k not in batch for k in need):
            return f"the hierarchical task needs batches with keys {', '.join(need)}; the training data gives {describe_keys(batch)}"
        labels = batch["labels"]
        if not isinstance(labels, Tensor) or labels.dim() != 2 or labels.shape[1] != len(self.levels):
            shape = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
            return f"batch['labels'] must be [batch, {len(self.levels)}] (one column per level {self.levels}), got {shape}"
        return None

    def output_problem(self, output: Any, batch: Any) -> str | None:
        if not isinstance(output, (list, tuple)) or len(output) != len(self.levels):
            n = len(output) if isinstance(output, (list, tuple)) else type(output).__name__
            return f"the hierarchical task needs the model to return one logits tensor per level {self.levels}, got {n}"
        return None

    # -- training ------------------------------------------------------------------------------
    def prepare(self, batch: Any, step: int, epoch: int, batch_index: int, real: Tensor | None) -> Any:
        ops = self.ops
        if self.mixup is not None:
            # Accelerate hands process p the global micro-batches p, p + W, ...: keyed by that global
            # index, the same samples get the same decision under any (world size, accumulation).
            key = batch_index * self.world + self.rank
            batch = self.mixup.apply(batch, epoch, key, ops.get_mixup_prob(step), real)
        if self.mask_training and self.masker is not None:
            partial = self.plan.partial_mask
            meta = self.masker.train(
                batch["meta"],
                batch["index"],
                epoch,
                ops.get_meta_mask_prob(step),
                ops.get_partial_mask_prob(step),
                partial.whitelist,
                partial.weights,
            )
            batch = {**batch, "meta": meta}
        if real is not None:
            batch = {**batch, "labels": drop_targets(batch["labels"], real, NULL_LABEL)}
        return batch

    def forward(self, model: nn.Module, batch: Any) -> Any:
        return model(batch)

    def units(self, batch: Any) -> Tensor:
        labels: Tensor = batch["labels"]
        return (labels >= 0).sum(0)

    def loss_sums(self, model: nn.Module, batch: Any) -> Tensor:
        return level_loss_sums(self.forward(model, batch), batch["labels"])

    # -- validation ------------------------------------------------------------------------------
    def validation_passes(self, ops: OpsSchedule, epoch: int, final: bool) -> list[ValidationPass]:
        return passes_at_boundary(ops, epoch, final)

    def _masked_meta(self, meta: dict[str, Any], masked: tuple[str, ...] | None) -> dict[str, Any]:
        if masked is None or self.masker is None:
            return meta
        return self.masker.mask_all(meta) if not masked else self.masker.mask_components(meta, masked)

    def validation_step(
        self, model: nn.Module, batch: Any, real: Tensor | None, vpass: ValidationPass
    ) -> Tensor:
        """[weighted loss, then ``validation_hit_sums``]: the loss with the training loss's level
        weights, summed over the samples labelled at each level."""
        batch = {**batch, "meta": self._masked_meta(batch["meta"], vpass.masked)}
        logits = self.forward(model, batch)
        labels = drop_targets(batch["labels"], real, NULL_LABEL)
        targets = labels.clamp_min(NULL_LABEL)  # every null label as the one the losses ignore
        per_level = torch.stack(
            [
                F.cross_entropy(lg.float(), targets[:, i], reduction="none", ignore_index=NULL_LABEL)
                for i, lg in enumerate(logits)
            ],
            dim=1,
        )
        loss = (per_level * self.level_weights).sum().double().reshape(1)
        return torch.cat([loss, validation_hit_sums(logits, labels, real)])

    def validation_metrics(self, sums: list[float], vpass: ValidationPass) -> dict[str, float]:
        n = len(self.levels)
        correct, labelled, top = (sums[1 + k * n : 1 + (k + 1) * n] for k in range(3))
        loss, (chain, count, partial, partial_count) = sums[0], sums[1 + 3 * n :]
        count = max(1.0, count)
        p = vpass.prefix
        out = {
            f"{p}/loss": loss / count,
            f"{p}/chain_acc": chain / count,
            f"{p}/partial_chain_acc": partial / max(1.0, partial_count),
        }
        for i, level in enumerate(self.levels):
            out[f"{p}/acc_{level}"] = correct[i] / max(1.0, labelled[i])
        for i, level in enumerate(self.levels):
            out[f"{p}/acc3_{level}"] = top[i] / max(1.0, labelled[i])
        return out
