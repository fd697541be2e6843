"""A validation pass: every validation sample counted exactly once across processes.

The task adds up what its metrics need over each batch's real rows (the rows Accelerate repeats to
even out the last batch are left out); the sums are added over processes with one collective at
the end of the pass, and the task turns them into metrics.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch import nn

from ..tasks import Task, ValidationPass
from .batches import BatchSource


@torch.no_grad()
def run_pass(
    accelerator: Accelerator, model: nn.Module, batches: BatchSource, task: Task, vpass: ValidationPass
) -> dict[str, float]:
    model.eval()
    try:
        total: torch.Tensor | None = None
        batches.set_epoch(0)  # every pass reads the same batches, with the same worker seeds
        for micro_batch in batches.micro_batches():
            part = task.validation_step(model, micro_batch.data, micro_batch.real, vpass)
            total = part if total is None else total + part
    finally:
        model.train()
    if total is None:
        raise RuntimeError("the validation data yielded no batch")
    if accelerator.num_processes > 1:
        total = accelerator.reduce(total, reduction="sum")
    return task.validation_metrics(total.tolist(), vpass)


def validation_line(epoch: int, results: dict[str, float]) -> str:
    shown = [f"{k} {v:.4f}" for k, v in results.items() if k.startswith("val/")]
    return f"epoch {epoch}: " + ", ".join(shown)
