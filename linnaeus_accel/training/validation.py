"""Validation passes at epoch boundaries: standard, all metadata masked, and one per combination
of masked components (SPEC §5). Each sample counts exactly once across processes
(``gather_for_metrics`` drops the duplicates Accelerate adds to even out the last batch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

from ..progress import TrainingStage
from ..schedule import OpsSchedule

MetaMask = Callable[[dict[str, Any], "tuple[str, ...] | None"], dict[str, Any]]


@dataclass(frozen=True)
class ValidationPass:
    stage: TrainingStage
    prefix: str  # metric names are <prefix>/loss, <prefix>/acc_<level>, <prefix>/chain_acc
    masked: tuple[str, ...] | None  # None: nothing masked; () : every component
    partial_index: int | None = None


def passes_at_boundary(ops: OpsSchedule, epoch: int, final: bool) -> list[ValidationPass]:
    """The passes due at this boundary, in SPEC order: standard, mask-meta, partial."""
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


@torch.no_grad()
def run_pass(
    accelerator: Accelerator,
    model: nn.Module,
    loader: Any,
    vpass: ValidationPass,
    levels: Sequence[str],
    level_weights: Sequence[float],
    mask: MetaMask,
) -> dict[str, float]:
    """Loss (the training loss's level weights), accuracy per level and chain accuracy (every
    level right), each averaged over the samples that have a label at that level."""
    model.eval()
    n_levels = len(levels)
    weights = torch.tensor(level_weights, device=accelerator.device)
    loss_sum = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    correct = torch.zeros(n_levels, device=accelerator.device, dtype=torch.float64)
    labelled = torch.zeros(n_levels, device=accelerator.device, dtype=torch.float64)
    chain = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    count = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    for batch in loader:
        batch = {**batch, "meta": mask(batch["meta"], vpass.masked)}
        logits = model(batch)
        labels = batch["labels"]
        per_level = torch.stack(
            [
                F.cross_entropy(lg.float(), labels[:, i].clamp_min(-100), reduction="none", ignore_index=-100)
                for i, lg in enumerate(logits)
            ],
            dim=1,
        )
        preds = torch.stack([lg.argmax(dim=1) for lg in logits], dim=1)
        per_level, preds, labels = accelerator.gather_for_metrics((per_level, preds, labels))
        known = labels >= 0
        hit = (preds == labels) & known
        loss_sum += (per_level * weights).sum()
        correct += hit.sum(0)
        labelled += known.sum(0)
        chain += (hit | ~known).all(dim=1).sum()
        count += labels.shape[0]
    model.train()
    n = max(1.0, count.item())
    out = {f"{vpass.prefix}/loss": loss_sum.item() / n, f"{vpass.prefix}/chain_acc": chain.item() / n}
    for i, level in enumerate(levels):
        out[f"{vpass.prefix}/acc_{level}"] = correct[i].item() / max(1.0, labelled[i].item())
    return out


def validation_line(epoch: int, results: dict[str, float]) -> str:
    shown = [f"{k} {v:.4f}" for k, v in results.items() if k.startswith("val/")]
    return f"epoch {epoch}: " + ", ".join(shown)
