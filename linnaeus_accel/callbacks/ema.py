"""``ema``: an exponential moving average of the weights (Polyak averaging), the usual companion of
long runs and the weights many papers report.

After each optimizer step at its interval (default: every step), on every process and on the
device, with no host sync: ``ema = decay_t * ema + (1 - decay_t) * weights`` (one fused
``torch._foreach_lerp_`` over the parameters; buffers such as BatchNorm statistics are copied).
``decay_t`` is ``decay``, or with ``warmup`` ``min(decay, (1 + n) / (10 + n))`` after ``n`` updates
(as timm's and torch-ema's warm-up), so early averages are not dominated by the random start.

- Checkpoints: the averaged weights are registered state (``RunContext.register_state("ema", ...)``:
  a safetensors file, verified with the rest; nothing pickled), and ``n`` in the callback's JSON
  state; a resumed run's average is byte-identical to an uninterrupted one's. A second ``ema``
  callback registers as ``ema_1``, and so on.
- ``final/ema/``: the averaged weights in the format of ``final/`` (``model.safetensors``), which
  ``linnaeus-accel evaluate --checkpoint <run>/final/ema`` reads like ``final/``.
- ``validate: true``: after each standard validation pass (``val/``), the same pass on the averaged
  weights, logged with the prefix ``val_ema/`` in the same record (``SCHEDULE.CHECKPOINT.METRIC``
  and early stopping may rank by ``val_ema/loss``).
- Memory: one more copy of the model's weights (in their own dtype) on each process.
- FSDP and DeepSpeed shard the weights across processes; this callback keeps a whole copy and is
  refused there (a ConfigError naming it) rather than averaging shards it cannot save as a model.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from accelerate.utils import DistributedType

from ..config import ConfigError
from ..config.callbacks import EmaOptions
from . import Callback, RunContext, register_callback


class _AveragedWeights:
    """What the checkpoints hold of the average: its tensors, by name."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.loaded = False  # from a checkpoint

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)
        self.loaded = True


@register_callback("ema")
class EMA(Callback):
    Options = EmaOptions

    def __init__(self, decay: float = 0.999, warmup: bool = False, validate: bool = False) -> None:
        options = EmaOptions.model_validate({"decay": decay, "warmup": warmup, "validate": validate})
        self.decay, self.warmup, self.validate = options.decay, options.warmup, options.validate_
        self.updates = 0
        self.model: torch.nn.Module | None = None

    def on_setup(self, run: RunContext) -> None:
        acc = run.accelerator
        if acc.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            raise ConfigError(
                [
                    (
                        "CALLBACKS",
                        f"ema keeps a whole copy of the weights, which {acc.distributed_type.value} shards across "
                        "processes: remove the ema callback, or train with DDP",
                    )
                ]
            )
        live = acc.unwrap_model(run.model, keep_torch_compile=False)
        self.model = copy.deepcopy(live).requires_grad_(False).eval()
        self._live = list(live.parameters())
        self._average = list(self.model.parameters())
        self._live_buffers = [b for b in live.buffers() if b.is_floating_point()]
        self._buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        taken = set(run.registered_names())
        name = next(n for i in range(len(taken) + 1) if (n := "ema" if i == 0 else f"ema_{i}") not in taken)
        self._state = _AveragedWeights(self.model)
        run.register_state(name, self._state)

    @torch.no_grad()
    def on_fit_start(self, run: RunContext) -> None:
        if run.global_step > 0 and not self._state.loaded:
            # New since the checkpoint resumed: the average starts from the weights trained so
            # far, not from the initial ones it was copied from before they were loaded.
            torch._foreach_copy_(self._average, self._live)
            if self._buffers:
                torch._foreach_copy_(self._buffers, self._live_buffers)

    def decay_at(self, updates: int) -> float:
        return min(self.decay, (1 + updates) / (10 + updates)) if self.warmup else self.decay

    @torch.no_grad()
    def on_step_end(self, run: RunContext, step: int) -> None:
        weight = 1.0 - self.decay_at(self.updates)  # a host float: nothing is read from the device
        torch._foreach_lerp_(self._average, self._live, weight)
        if self._buffers:
            torch._foreach_copy_(self._buffers, self._live_buffers)
        self.updates += 1

    def on_validation_end(self, run: RunContext, step: int, metrics: dict[str, float]) -> None:
        if not self.validate or not any(k.startswith("val/") for k in metrics):
            return
        assert self.model is not None
        averaged = run.validate(self.model, "val_ema")  # the standard pass, on the average
        if averaged is not None:
            metrics.update(averaged)

    def on_fit_end(self, run: RunContext, summary: dict[str, Any]) -> None:
        if summary["status"] in ("preempted", "interrupted") or self.model is None:
            return  # a preempted run's average is in its last checkpoint
        run.save_final(self.model, "ema")

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = int(state["updates"])
