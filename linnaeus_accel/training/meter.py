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
    """The open log window: this process's share of each step's loss (a step's loss is split over
    processes, so the shares add up), gradient norm and GradNorm weights, throughput."""

    def __init__(
        self,
        accelerator: Accelerator,
        components: tuple[str, ...],
        *,
        counts_tokens: bool = False,
        flops_per_unit: float | None = None,
        mfu_per_token: bool = False,
        peak: float | None = None,
    ) -> None:
        """``flops_per_unit``: FLOPs per token when ``mfu_per_token``, else per sample (MFU);
        ``peak``: one device's peak FLOP/s (default: looked up by GPU name)."""
        self.accelerator = accelerator
        self.components = components
        self.per_token = counts_tokens
        self.mfu_per_token = mfu_per_token
        self.flops_per_unit = flops_per_unit
        self.peak = (peak or peak_flops(accelerator)) if flops_per_unit else None
        self._sums = torch.zeros(
            len(components) + 1, device=accelerator.device
        )  # step loss, then each component
        self._steps = 0
        self.grad_norm: torch.Tensor | None = None
        self.gradnorm_weights: torch.Tensor | None = None  # GradNorm task weights, when enabled
        self._wait = 0.0
        self._since = time.perf_counter()
        self._samples_at_last_flush = 0
        self._tokens_at_last_flush = 0
        # Target tokens counted since they were last read on the host (added up on the device).
        self.tokens_pending = torch.zeros((), dtype=torch.int64, device=accelerator.device)

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

    def add_step(self, loss: torch.Tensor, losses: torch.Tensor) -> None:
        """This process's share of one optimizer step's loss and component losses (detached)."""
        self._sums[0] += loss
        if len(self.components) > 1:
            self._sums[1:] += losses
        self._steps += 1

    def state_dict(self) -> dict[str, Any]:
        """The open log window, so that a resumed run's first logged average covers the same
        steps as the uninterrupted run's (checkpoint time: reading back is fine here)."""
        return {
            "sums": self._sums.tolist(),
            "steps": self._steps,
            "samples_at_last_flush": self._samples_at_last_flush,
            "tokens_at_last_flush": self._tokens_at_last_flush,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sums = state.get("sums")
        if sums is not None and len(sums) == self._sums.numel():
            self._sums = torch.tensor(sums, dtype=self._sums.dtype, device=self._sums.device)
        self._steps = int(state.get("steps", 0))
        self._samples_at_last_flush = int(state.get("samples_at_last_flush", 0))
        self._tokens_at_last_flush = int(state.get("tokens_at_last_flush", 0))

    def last_grad_norm(self) -> float | None:
        return None if self.grad_norm is None else float(self.grad_norm)

    def take_tokens(self) -> int:
        """The target tokens counted since the last call (a host read: not for every step)."""
        if not self.per_token:
            return 0
        tokens = int(self.tokens_pending.item())
        self.tokens_pending.zero_()
        return tokens

    def flush(self, samples_seen: int, tokens_seen: int, lrs: dict[str, float]) -> dict[str, float]:
        """Averages over the window's steps, shares added over processes (one collective, one host
        sync). ``tokens_seen``: before the tokens still pending here; the total is returned as
        ``tokens_seen`` when the task counts tokens."""
        tokens_seen += self.take_tokens()
        totals = self.accelerator.reduce(self._sums, reduction="sum").tolist()
        steps = max(1, self._steps)
        now = time.perf_counter()
        elapsed = max(1e-9, now - self._since)
        samples = samples_seen - self._samples_at_last_flush
        tokens = tokens_seen - self._tokens_at_last_flush
        metrics = {"train/loss": totals[0] / steps}
        if len(self.components) > 1:
            metrics.update({f"train/loss_{c}": totals[1 + i] / steps for i, c in enumerate(self.components)})
        metrics.update({f"lr/{label}": lr for label, lr in lrs.items()})
        if self.grad_norm is not None:
            metrics["train/grad_norm"] = float(self.grad_norm)
        if self.gradnorm_weights is not None:
            weights = self.gradnorm_weights.tolist()
            metrics.update(
                {f"gradnorm/weight_{c}": w for c, w in zip(self.components, weights, strict=False)}
            )
        metrics["perf/samples_per_s"] = samples / elapsed
        if self.per_token:
            metrics["perf/tokens_per_s"] = tokens / elapsed
        metrics["perf/data_time_share"] = min(1.0, self._wait / elapsed)
        if self.flops_per_unit and self.peak:
            units = tokens if self.mfu_per_token else samples
            metrics["perf/mfu"] = (
                units / elapsed * self.flops_per_unit / (self.peak * self.accelerator.num_processes)
            )
        metrics["samples_seen"] = float(samples_seen)
        if self.per_token:
            metrics["tokens_seen"] = float(tokens_seen)
        self._sums.zero_()
        self._steps = 0
        self._wait = 0.0
        self._since = now
        self._samples_at_last_flush = samples_seen
        self._tokens_at_last_flush = tokens_seen
        return metrics
