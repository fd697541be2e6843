"""A validation pass: every validation sample counted exactly once across processes.

The task adds up what its metrics need over each batch's real rows (the rows Accelerate repeats to
even out the last batch are left out); the sums are added over processes with one collective at
the end of the pass, and the task turns them into metrics. A pass asked to stop (preemption) stops
between batches and is run whole again after the resume.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from accelerate import Accelerator
from torch import nn

from ...process.faults import fault_point
from ...tasks import Task, ValidationPass
from ..step.batches import BatchSource


class PassStopped(Exception):
    """``run_pass`` stopped between batches because ``stop`` said so; nothing of the pass counts."""


@torch.no_grad()
def run_pass(
    accelerator: Accelerator,
    model: nn.Module,
    batches: BatchSource,
    task: Task,
    vpass: ValidationPass,
    stop: Callable[[int], bool] | None = None,
) -> dict[str, float]:
    """The pass's metrics. ``stop(n)``, asked after the ``n``-th batch (1-based) on every process,
    ends the pass with ``PassStopped`` when true: a preemption need not wait for a long pass (the
    whole split at the end of a run) to finish."""
    model.eval()
    try:
        total: torch.Tensor | None = None
        batches.set_epoch(0)  # every pass reads the same batches, with the same worker seeds
        for n, micro_batch in enumerate(batches.micro_batches(), 1):
            part = task.validation_step(model, micro_batch.data, micro_batch.real, vpass)
            total = part if total is None else total + part
            fault_point("validation_batch")
            if stop is not None and stop(n):
                raise PassStopped(vpass.prefix)
    finally:
        model.train()
    if total is None:
        raise RuntimeError("the validation data yielded no batch")
    if accelerator.num_processes > 1:
        total = accelerator.reduce(total, reduction="sum")
    return task.validation_metrics(total.tolist(), vpass)


CONSOLE_WIDTH = 100  # a validation line wraps before this many characters


def validation_line(
    when: int | str, results: dict[str, float], directions: Mapping[str, str] | None = None
) -> str:
    """The console's report of a boundary's validation passes: every metric of the standard pass
    (``val/``), then the headline metric of each other pass (e.g. ``val_mask_meta/chain_acc``),
    wrapped onto indented lines of at most ``CONSOLE_WIDTH`` characters. A pass's headline is its
    first metric that ``directions`` (the task's ``metric_directions``) says is better higher (an
    accuracy), else its first metric."""
    passes: dict[str, list[str]] = {}
    for key in results:
        prefix, _, name = key.partition("/")
        if name and prefix.startswith("val"):
            passes.setdefault(prefix, []).append(name)
    higher = [name for name, direction in (directions or {}).items() if direction == "max"]
    shown: list[str] = []
    for prefix, names in passes.items():
        if prefix != "val":
            names = [next((n for n in higher if n in names), names[0])]
        shown += [f"{prefix}/{name} {results[f'{prefix}/{name}']:.4f}" for name in names]
    # ``when``: an epoch number, or what to print instead (a mid-epoch point: "step 500 (epoch 2)").
    lines, line = [], f"epoch {when}:" if isinstance(when, int) else f"{when}:"
    for i, item in enumerate(shown):
        separator = "," if i else ""
        # ", " before the item and the "," a wrap puts after it: all within the width.
        if i and len(line) + len(item) + 3 > CONSOLE_WIDTH:
            lines.append(line + ",")
            line, separator = " ", ""
        line += f"{separator} {item}"
    lines.append(line)
    return "\n".join(lines)
