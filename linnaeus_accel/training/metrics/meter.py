"""Training metrics kept on the device between logging steps.

The per-step path adds no tensor op and no host sync: the meter keeps a reference to each
optimizer step's (detached) loss and component losses, and stacks and adds them up when a logging
step reads them (``flush``: a host read, and one collective with several processes), keeping each
step's loss so that it can also say at which step a loss first became NaN or infinite.
"""

from __future__ import annotations

import math
import time
from typing import Any, ClassVar

import numpy as np
import torch
from accelerate import Accelerator
from torch import nn

from ...checkpoint.state.schemas import MeterState
from ...config.sections import TaskConfig
from ...tasks import Task
from ..start.backends import scaler_skips_steps

_MAX_PENDING = 1024  # steps whose loss tensors are held separately before they are stacked

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


class NonFiniteLoss(ArithmeticError):
    """A step's training loss (or, ``what``, its gradient norm) was NaN or infinite: the
    ``steps_ago``-th optimizer step before the last one of the window (0: the last one)."""

    def __init__(self, steps_ago: int, value: float, what: str = "training loss") -> None:
        super().__init__(f"{what} {value} {steps_ago} steps before the last one")
        self.steps_ago, self.value, self.what = steps_ago, value, what


class TrainMeter:
    """The open log window: this process's share of each step's loss (a step's loss is split over
    processes, so the shares add up), gradient norm and GradNorm weights, throughput."""

    STATE_SCHEMA: ClassVar[type[MeterState]] = MeterState  # defined where verification reaches it

    def __init__(
        self,
        accelerator: Accelerator,
        components: tuple[str, ...],
        *,
        counts_tokens: bool = False,
        flops_per_unit: float | None = None,
        mfu_per_token: bool = False,
        peak: float | None = None,
        window: int = 1,
        counts_skipped_steps: bool = False,
    ) -> None:
        """``flops_per_unit``: FLOPs per token when ``mfu_per_token``, else per sample (MFU);
        ``peak``: one device's peak FLOP/s (default: looked up by GPU name); ``window``: the most
        optimizer steps between two flushes (the logging interval); ``counts_skipped_steps``: an
        fp16 loss scaler may skip steps (``train/skipped_steps`` is logged, 0 included)."""
        self.accelerator = accelerator
        self.components = components
        self.per_token = counts_tokens
        self.mfu_per_token = mfu_per_token
        self.flops_per_unit = flops_per_unit
        self.peak = (peak or peak_flops(accelerator)) if flops_per_unit else None
        # The open window: [loss, *components] a resumed window carried over, the steps since
        # stacked into rows [steps, 1 + components] (a skipped step's row is zero) with their
        # gradient norms beside them (only looked at for being finite), and the steps still held as
        # the step's own tensors (None for a skipped step).
        columns = 1 + len(components)
        self._carried = torch.zeros(columns, device=accelerator.device)
        self._rows = torch.zeros(0, columns, device=accelerator.device)
        self._norms = torch.zeros(0, device=accelerator.device)
        self._pending: list[tuple[torch.Tensor, torch.Tensor, Any] | None] = []
        # Held tensors are stacked once this many pile up (a long logging interval), so that a
        # window holds a bounded number of small tensors.
        self._stack_every = max(1, min(window, _MAX_PENDING))
        self._steps = 0
        self._passed = 0  # steps of the window whose data a rollback skipped
        self.trained_in_last_window = 0  # optimizer steps the last flushed window trained
        self.nonfinite_skipped = 0  # optimizer steps dropped by TRAIN.NONFINITE: skip, in the run
        self.counts_skipped_steps = counts_skipped_steps
        self.skipped_steps = 0  # optimizer steps the fp16 loss scaler skipped (overflow), in the run
        self.grad_norm: torch.Tensor | float | None = None  # a float from DeepSpeed's engine
        self.gradnorm_weights: torch.Tensor | None = None  # GradNorm task weights, when enabled
        self._since = time.perf_counter()
        self._samples_at_last_flush = 0
        self._tokens_at_last_flush = 0
        # Target tokens counted since they were last read on the host (added up on the device).
        self.tokens_pending = torch.zeros((), dtype=torch.int64, device=accelerator.device)

    def add_step(self, loss: torch.Tensor, losses: torch.Tensor, norm: Any = None) -> None:
        """This process's share of one optimizer step's loss and component losses, and the step's
        gradient norm (detached, and not written to afterwards: they are kept as they are until the
        window is read; ``norm``: a tensor, DeepSpeed's float, or None)."""
        self._pending.append((loss, losses, norm))
        self._steps += 1
        if len(self._pending) >= self._stack_every:
            self._stack_pending()

    def skip_step(self, nonfinite: bool = True) -> None:
        """An optimizer step dropped by TRAIN.NONFINITE: skip (``nonfinite``), or one whose data a
        rollback skips: an empty row, so rows still map to steps, and not in the window's average."""
        self._pending.append(None)
        self.nonfinite_skipped += int(nonfinite)
        self._passed += int(not nonfinite)
        if len(self._pending) >= self._stack_every:
            self._stack_pending()

    def _stack_pending(self) -> torch.Tensor:
        """Every step of the window as rows ``[steps, 1 + components]`` (a few ops for all of them)."""
        if self._pending:
            zero = (self._carried.new_zeros(()), self._carried.new_zeros(len(self.components)), None)
            steps = [zero if step is None else step for step in self._pending]
            loss = torch.stack([step_loss for step_loss, _, _ in steps])[:, None]
            if len(self.components) > 1:
                rows = torch.cat([loss, torch.stack([losses for _, losses, _ in steps])], dim=1)
            else:  # one component: the loss itself, not logged twice
                rows = torch.cat([loss, torch.zeros_like(loss)], dim=1)
            self._rows = torch.cat([self._rows, rows]) if len(self._rows) else rows
            norms = torch.stack([self._norm_of(norm) for _, _, norm in steps])
            self._norms = torch.cat([self._norms, norms]) if len(self._norms) else norms
            self._pending = []
        return self._rows

    def _norm_of(self, norm: Any) -> torch.Tensor:
        """A step's gradient norm as a float32 scalar on the device (stacking time, not per step;
        every process stacks at the same steps)."""
        if isinstance(norm, torch.Tensor):
            # FSDP2's norm is a DTensor whose local value is a partial one: reduced on the device
            # (a collective every process makes here), never read back.
            full = getattr(norm, "full_tensor", None)
            value = full() if callable(full) else norm
            return value.detach().reshape(()).to(self._norms.dtype)
        return self._carried.new_tensor(0.0 if norm is None else float(norm))  # DeepSpeed's float

    def _window(self) -> list[list[float]]:
        """This process's window on the host (one read): its sums ``[loss, *components]``, then one
        row per step."""
        return self._read()[0]

    def _read(self) -> tuple[list[list[float]], list[float]]:
        """This process's window on the host (one read), and each step's gradient norm. The sums are
        added in step order in float32 from what a resumed window carried over, as a running sum on
        the device would: a window split by a resume adds up to exactly the uninterrupted window's
        sums."""
        rows = torch.cat([self._carried[None], self._stack_pending()])
        norms = torch.cat([self._norms.new_zeros(1), self._norms]).to(rows.dtype)
        table: list[list[float]] = torch.cat([rows, norms[:, None]], dim=1).tolist()
        values = [row[:-1] for row in table]
        sums = np.add.accumulate(np.asarray(values, dtype=np.float32), axis=0)[-1]  # sequential
        return [sums.tolist(), *values[1:]], [row[-1] for row in table[1:]]

    def window_is_finite(self) -> bool:
        """Whether every loss and gradient norm of this process's open window is finite (a host read)."""
        window, norms = self._read()
        return all(math.isfinite(value) for row in window for value in row) and all(map(math.isfinite, norms))

    def _reset_window(self) -> None:
        self._carried.zero_()
        self._rows = self._rows[:0]
        self._norms = self._norms[:0]
        self._pending = []
        self._steps = 0
        self._passed = 0

    def restart(self, samples_seen: int, tokens_seen: int) -> None:
        """After a rollback: the open window (the steps rolled back) is dropped, and the next record
        measures from here."""
        self._reset_window()
        self.grad_norm = None
        self._since = time.perf_counter()
        self._samples_at_last_flush, self._tokens_at_last_flush = samples_seen, tokens_seen

    def state_dict(self) -> dict[str, Any]:
        """The open log window, so that a resumed run's first logged average covers the same
        steps as the uninterrupted run's (checkpoint time: reading back is fine here)."""
        return MeterState(
            sums=self._window()[0],
            steps=self._steps,
            nonfinite_skipped=self.nonfinite_skipped,
            skipped_steps=self.skipped_steps,
            samples_at_last_flush=self._samples_at_last_flush,
            tokens_at_last_flush=self._tokens_at_last_flush,
        ).as_data()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A missing key is a fresh window's value (``MeterState``'s default)."""
        saved = MeterState.model_validate(state, strict=False)
        self._reset_window()
        if saved.sums is not None and len(saved.sums) == len(self._carried):
            self._carried = torch.tensor(saved.sums, dtype=self._carried.dtype, device=self._carried.device)
        self._steps = saved.steps
        self.nonfinite_skipped = saved.nonfinite_skipped
        self.skipped_steps = saved.skipped_steps
        self._samples_at_last_flush = saved.samples_at_last_flush
        self._tokens_at_last_flush = saved.tokens_at_last_flush

    def last_grad_norm(self) -> float | None:
        return None if self.grad_norm is None else float(self.grad_norm)

    def take_tokens(self) -> int:
        """The target tokens counted since the last call (a host read: not for every step)."""
        if not self.per_token:
            return 0
        tokens = int(self.tokens_pending.item())
        self.tokens_pending.zero_()
        return tokens

    def flush(
        self, samples_seen: int, tokens_seen: int, lrs: dict[str, float], data_wait: float = 0.0
    ) -> dict[str, float]:
        """Averages over the window's steps, shares added over processes (one collective; the
        window read on the host). ``data_wait``: seconds spent waiting for batches in the window.
        ``tokens_seen``: the run's count, this window's tokens included; returned as ``tokens_seen``
        when the task counts tokens. Raises ``NonFiniteLoss`` (on every process
        alike: the rows are added over processes first) naming the window's first bad step."""
        window, norms = self._read()
        if self.accelerator.num_processes > 1:
            # The norms ride along in the same collective (as a last column), so every process
            # finds the same step at fault.
            table = [[*row, norm] for row, norm in zip(window, [0.0, *norms], strict=True)]
            local = torch.tensor(table, dtype=self._carried.dtype, device=self._carried.device)
            reduced = self.accelerator.reduce(local, reduction="sum").tolist()
            window, norms = [row[:-1] for row in reduced], [row[-1] for row in reduced[1:]]
        totals, *rows = window
        for offset, (row, norm) in enumerate(zip(rows, norms, strict=True)):
            if not math.isfinite(row[0]):
                raise NonFiniteLoss(len(rows) - 1 - offset, row[0])
            if not math.isfinite(norm):
                raise NonFiniteLoss(len(rows) - 1 - offset, norm, "gradient norm")
        steps = max(1, self._steps)
        now = time.perf_counter()
        elapsed = max(1e-9, now - self._since)
        samples = samples_seen - self._samples_at_last_flush
        tokens = tokens_seen - self._tokens_at_last_flush
        metrics: dict[str, float] = {}
        self.trained_in_last_window = self._steps
        # A window of steps a rollback skipped trained nothing: no loss to average. (A window whose
        # every step TRAIN.NONFINITE: skip dropped has always logged 0.)
        if self._steps or not self._passed:
            metrics["train/loss"] = totals[0] / steps
            if len(self.components) > 1:
                metrics.update(
                    {f"train/loss_{c}": totals[1 + i] / steps for i, c in enumerate(self.components)}
                )
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
        metrics["perf/data_time_share"] = min(1.0, data_wait / elapsed)
        if self.flops_per_unit and self.peak:
            units = tokens if self.mfu_per_token else samples
            metrics["perf/mfu"] = (
                units / elapsed * self.flops_per_unit / (self.peak * self.accelerator.num_processes)
            )
        # Counts are written as the integers they are (metrics.jsonl, trackers).
        metrics["samples_seen"] = int(samples_seen)
        if self.per_token:
            metrics["tokens_seen"] = int(tokens_seen)
        if self.nonfinite_skipped:
            metrics["train/nonfinite_skipped"] = int(self.nonfinite_skipped)
        if self.counts_skipped_steps:
            metrics["train/skipped_steps"] = int(self.skipped_steps)
        self._reset_window()
        self._since = now
        self._samples_at_last_flush = samples_seen
        self._tokens_at_last_flush = tokens_seen
        return metrics


def meter_for(
    accelerator: Accelerator,
    task_config: TaskConfig,
    peak_flops: float | None,
    task: Task,
    model: nn.Module,
    metrics_interval: int,
) -> TrainMeter:
    """The run's meter: MFU from TASK.FLOPS_PER_TOKEN / FLOPS_PER_SAMPLE (of the TASK section
    ``task_config``), else the task's estimate; ``peak_flops``: ENV.PEAK_FLOPS."""
    cfg = task_config
    if cfg.FLOPS_PER_TOKEN is not None or cfg.FLOPS_PER_SAMPLE is not None:
        flops, per_token = cfg.FLOPS_PER_TOKEN or cfg.FLOPS_PER_SAMPLE, cfg.FLOPS_PER_TOKEN is not None
    else:
        flops, per_token = task.default_flops_per_unit(accelerator.unwrap_model(model)), task.counts_tokens
    return TrainMeter(
        accelerator,
        task.components,
        counts_tokens=task.counts_tokens,
        flops_per_unit=flops,
        mfu_per_token=per_token,
        peak=peak_flops,
        window=metrics_interval,
        counts_skipped_steps=scaler_skips_steps(accelerator),
    )
