"""What the schedule does to a training batch at global step ``k``: in-group mixup, then metadata
masking (full, then partial for the samples left unmasked), with the probabilities of ``k``."""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator

from ..config import Config
from ..schedule import OpsSchedule, ResolvedPlan
from .transforms import InGroupMixup, MetaMasker


class BatchTransforms:
    def __init__(self, config: Config, plan: ResolvedPlan, dataset: Any, accelerator: Accelerator) -> None:
        self.ops = OpsSchedule(plan)
        self.plan = plan
        seed = config.EXPERIMENT.SEED
        components = tuple(getattr(dataset, "meta_components", ()))
        self.masker = MetaMasker(components, seed) if components else None
        self.mask_training = self.masker is not None and (plan.meta_mask.enabled or plan.partial_mask.enabled)
        levels = tuple(getattr(dataset, "levels", ()))
        mix = config.SCHEDULE.MIXUP
        self.mixup = (
            InGroupMixup(
                levels.index(plan.mixup_group_level),
                mix.ALPHA,
                mix.MIN_GROUP_SIZE,
                mix.EXCLUDE_NULL_SAMPLES,
                seed,
            )
            if plan.mixup.enabled and plan.mixup_group_level in levels
            else None
        )
        self.rank, self.world = accelerator.process_index, accelerator.num_processes

    def train(self, batch: dict[str, Any], k: int, epoch: int, batch_index: int) -> dict[str, Any]:
        if self.mixup is not None:
            # Accelerate hands process p the global micro-batches p, p + W, ...: keyed by that global
            # index, the same samples get the same decision under any (world size, accumulation).
            key = batch_index * self.world + self.rank
            batch = self.mixup.apply(batch, epoch, key, self.ops.get_mixup_prob(k))
        if self.mask_training and self.masker is not None:
            partial = self.plan.partial_mask
            meta = self.masker.train(
                batch["meta"],
                batch["index"],
                epoch,
                self.ops.get_meta_mask_prob(k),
                self.ops.get_partial_mask_prob(k),
                partial.whitelist,
                partial.weights,
            )
            batch = {**batch, "meta": meta}
        return batch

    def validation_mask(self, meta: dict[str, Any], masked: tuple[str, ...] | None) -> dict[str, Any]:
        """Validation masking: None keeps everything, () masks every component."""
        if masked is None or self.masker is None:
            return meta
        return self.masker.mask_all(meta) if not masked else self.masker.mask_components(meta, masked)
