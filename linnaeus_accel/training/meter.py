"""Training metrics kept on the device between logging steps.

The per-step path only adds tensors (no ``.item()``, no host sync); ``flush`` reduces over the
log window and all processes once, on logging steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from accelerate import Accelerator

# Dense bf16 peak FLOP/s by device name, for MFU; unknown devices (the CPU) report no MFU.
PEAK_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "RTX 4090": 165e12,
}


def peak_flops(accelerator: Accelerator) -> float | None:
    if accelerator.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(accelerator.device)
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


class TrainMeter:
    def __init__(
        self, accelerator: Accelerator, levels: tuple[str, ...], flops_per_sample: float | None = None
    ) -> None:
        self.accelerator = accelerator
        self.levels = levels
        self.flops_per_sample = flops_per_sample
        self.peak = peak_flops(accelerator) if flops_per_sample else None
        device = accelerator.device
        self._sums = torch.zeros(len(levels) + 1, device=device)  # total loss, then each level
        self._micro_batches = 0
        self.grad_norm: torch.Tensor | None = None
        self.gradnorm_weights: torch.Tensor | None = None  # GradNorm task weights, when enabled
        self._wait = 0.0
        self._since = time.perf_counter()
        self._samples_at_last_flush = 0

    def timed(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Iterate ``loader``, adding the time spent waiting for each batch to the data-time share."""
        iterator = iter(loader)
        while True:
            start = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self._wait += time.perf_counter() - start
            yield batch

    def add(self, loss: torch.Tensor, level_losses: torch.Tensor) -> None:
        self._sums[0] += loss
        self._sums[1:] += level_losses[: len(self.levels)]
        self._micro_batches += 1

    def state_dict(self) -> dict[str, Any]:
        """The open log window, so that a resumed run's first logged average covers the same
        micro-batches as the uninterrupted run's (checkpoint time: reading back is fine here)."""
        return {
            "sums": self._sums.tolist(),
            "micro_batches": self._micro_batches,
            "samples_at_last_flush": self._samples_at_last_flush,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sums = state.get("sums")
        if sums is not None and len(sums) == self._sums.numel():
            self._sums = torch.tensor(sums, dtype=self._sums.dtype, device=self._sums.device)
        self._micro_batches = int(state.get("micro_batches", 0))
        self._samples_at_last_flush = int(state.get("samples_at_last_flush", 0))

    def last_grad_norm(self) -> float | None:
        return None if self.grad_norm is None else float(self.grad_norm)

    def flush(self, samples_seen: int, lrs: dict[str, float]) -> dict[str, float]:
        """Averages over the window and every process (one collective, one host sync)."""
        window = torch.cat([self._sums, torch.tensor([float(self._micro_batches)], device=self._sums.device)])
        totals = self.accelerator.reduce(window, reduction="sum").tolist()
        count = max(1.0, totals[-1])
        now = time.perf_counter()
        elapsed = max(1e-9, now - self._since)
        samples = samples_seen - self._samples_at_last_flush
        metrics = {"train/loss": totals[0] / count}
        metrics.update({f"train/loss_{level}": totals[1 + i] / count for i, level in enumerate(self.levels)})
        metrics.update({f"lr/{label}": lr for label, lr in lrs.items()})
        if self.grad_norm is not None:
            metrics["train/grad_norm"] = float(self.grad_norm)
        if self.gradnorm_weights is not None:
            weights = self.gradnorm_weights.tolist()
            metrics.update(
                {f"gradnorm/weight_{level}": w for level, w in zip(self.levels, weights, strict=False)}
            )
        metrics["perf/samples_per_s"] = samples / elapsed
        metrics["perf/data_time_share"] = min(1.0, self._wait / elapsed)
        if self.flops_per_sample and self.peak:
            metrics["perf/mfu"] = (
                samples / elapsed * self.flops_per_sample / (self.peak * self.accelerator.num_processes)
            )
        metrics["samples_seen"] = float(samples_seen)
        self._sums.zero_()
        self._micro_batches = 0
        self._wait = 0.0
        self._since = now
        self._samples_at_last_flush = samples_seen
        return metrics
