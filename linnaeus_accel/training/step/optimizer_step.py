"""One optimizer step from a window of micro-batches (docs/semantics.md §1).

Before any forward, the window's target units (labelled samples, target tokens) are counted per
loss component and, with several processes, added up by one all-reduce that stays on the device.
Each micro-batch then backpropagates its summed losses divided by those totals, so the step's
gradient is the one of the mean over every unit of the step: a short or padded micro-batch weighs
what its units weigh, whatever the (processes x accumulation) split, also in an epoch's trailing
partial window (the torchtitan way; Accelerate's ``accumulate`` would weigh micro-batch means).

Synchronisation is ours: the window is known in advance, so every micro-batch but the last runs
under ``no_sync``, and Accelerate's scaling of the loss by ``1 / gradient_accumulation_steps`` (and
DDP's averaging over processes) is undone by one constant factor.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch import Tensor, nn

from ...optim.muon import MomentumWarmup
from ...schedule import OpsSchedule
from ...tasks import Task
from ..metrics.meter import TrainMeter
from ..start.backends import scaler_skips_steps
from .gradnorm import GradNorm
from .micro_batch import MicroBatch


def direct_optimizer(
    optimizer: torch.optim.Optimizer, accelerator: Accelerator
) -> torch.optim.Optimizer | None:
    """The optimizer inside Accelerate's plain wrapper when stepping and zeroing it directly is all
    the wrapper would do: no loss scaler (fp16), no XLA, not DeepSpeed's wrapper (a subclass), not a
    LOMO optimizer (which steps inside backward); gradients are always synchronised when the loop
    steps (it never uses ``accumulate``). The wrapper costs ~0.2 ms per step on a CPU: each ``step``
    looks for the ``lomo_optim`` package on disk twice and each ``zero_grad`` reads the wrapped
    method's signature. None when the wrapper is needed."""
    if not isinstance(optimizer, AcceleratedOptimizer) or type(optimizer) is not AcceleratedOptimizer:
        return None  # not Accelerate's plain wrapper (DeepSpeed's is a subclass)
    if optimizer.scaler is not None or accelerator.distributed_type == DistributedType.XLA:
        return None
    inner: torch.optim.Optimizer = optimizer.optimizer
    return None if type(inner).__module__.startswith("lomo_optim") else inner


class OptimizerStep:
    def __init__(
        self,
        accelerator: Accelerator,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        task: Task,
        ops: OpsSchedule,
        meter: TrainMeter,
        *,
        weights: list[float],
        clip_grad: float | None,
        gradnorm: GradNorm | None = None,
        shared_parameters: list[nn.Parameter] | None = None,
        skip_nonfinite: bool = False,
        momentum_warmup: MomentumWarmup | None = None,
    ) -> None:
        """``skip_nonfinite`` (TRAIN.NONFINITE: skip): a step whose gradient norm is NaN or
        infinite is dropped (one host read per step, as a gradient scaler does).
        ``momentum_warmup``: Muon's (MUON.MOMENTUM_WARMUP_STEPS), set with the LR before each step."""
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer
        self.task, self.ops, self.plan, self.meter = task, ops, ops.plan, meter
        self.weights = torch.tensor(weights, dtype=torch.float32, device=accelerator.device)
        # Weights of 1 (the default, without GradNorm) multiply nothing: x * 1 is x, so the step's
        # loss is the plain sum of its components, bit for bit, one op and one backward node less.
        self.unit_weights = gradnorm is None and all(w == 1.0 for w in weights)
        self.clip = clip_grad if clip_grad else float("inf")
        self.gradnorm = gradnorm
        self.momentum_warmup = momentum_warmup
        self.shared_parameters = shared_parameters or []
        self.world = accelerator.num_processes
        self.parameters = list(model.parameters())  # listed once, not by walking the modules every step
        # What is stepped and zeroed: the optimizer inside Accelerate's wrapper when the wrapper
        # would only pass the calls on (see ``direct_optimizer``), else the wrapper.
        self.stepped = direct_optimizer(optimizer, accelerator) or optimizer
        # Under fp16 the gradient scaler skips non-finite steps itself, and must see them to lower
        # its scale: dropping them first would leave the scale too high for every later step.
        self.count_scaler_skips = scaler_skips_steps(accelerator)
        self.skip_nonfinite = skip_nonfinite and not self.count_scaler_skips
        # DeepSpeed steps its engine inside the backward Accelerate marks as syncing: only the
        # window's last micro-batch may be marked (a short last window included).
        self.deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
        # DDP averages gradients over processes and Accelerate divides each loss by the accumulation
        # steps; the totals already divide by every unit of the step, so both are undone here.
        self.scale = float(accelerator.gradient_accumulation_steps * self.world)

    def load_gradnorm(self, state: dict[str, Any]) -> None:
        """GradNorm's state from a checkpoint, and the loss weights it had reached."""
        assert self.gradnorm is not None
        self.gradnorm.load_state_dict(state)
        self.set_weights(self.gradnorm.weights)

    def set_weights(self, weights: Tensor) -> None:
        self.weights = weights.detach().to(device=self.accelerator.device, dtype=torch.float32).clone()
        self.unit_weights = False

    def run(self, window: list[MicroBatch], k: int, epoch: int) -> None:
        """Global step ``k`` (0-based): prepare, count, forward/backward, clip, step."""
        task, acc = self.task, self.accelerator
        # Before any backward: under DeepSpeed the optimizer steps inside the last one.
        # A group's LR curve is its lr_group's (parameter_groups; OPTIMIZER.NO_DECAY's groups follow
        # the N+1 LR groups); an optimizer given built, or restored from an older checkpoint, has
        # exactly the N+1 LR groups, in order. Muon's groups scale their LR group's curve (lr_scale:
        # MUON.LR / BASE_LR); x 1.0 leaves every other group's LR the curve's, bit for bit.
        for i, group in enumerate(self.stepped.param_groups):
            group["lr"] = self.plan.lr(k, group.get("lr_group", i)) * group.get("lr_scale", 1.0)
        if self.momentum_warmup is not None:
            self.momentum_warmup.apply(self.stepped.param_groups, k)
        batches, units = [], []
        for mb in window:
            batch = task.prepare(mb.data, k, epoch, mb.position, mb.real)
            batches.append(batch)
            units.append(task.units(batch))
        totals = units[0] if len(units) == 1 else torch.stack(units).sum(0)
        if self.world > 1:
            totals = acc.reduce(totals, reduction="sum")  # a collective on the device: no host sync
        if task.counts_tokens:
            self.meter.tokens_pending += totals[0]
        denominators = totals.clamp_min(1)
        step_loss, step_losses = None, None
        for batch in batches[:-1]:  # gradients stay on this process until the last micro-batch
            with acc.no_sync(self.model):
                loss, losses = self._backward(batch, denominators, sync=False)
            step_loss = loss if step_loss is None else step_loss + loss
            step_losses = losses if step_losses is None else step_losses + losses
        update_gradnorm = self.gradnorm is not None and self.ops.should_update_gradnorm(k)
        loss, losses = self._backward(
            batches[-1], denominators, sync=True, gradnorm_units=units[-1] if update_gradnorm else None
        )
        if step_loss is not None and step_losses is not None:
            loss, losses = step_loss + loss, step_losses + losses
        # The norm before clipping; under DeepSpeed, the engine's norm of the step it just took.
        norm = acc.clip_grad_norm_(self.parameters, self.clip)
        if self.skip_nonfinite and norm is not None and not bool(torch.isfinite(norm)):
            # The norm is the same on every process (gradients are all-reduced before it), so all
            # drop the same step; the step still counts: the schedule follows the data.
            self.stepped.zero_grad(set_to_none=True)
            self.meter.skip_step()
            return
        # Under fp16 an infinite norm is the loss scaler's to handle (it skips the step itself).
        self.meter.add_step(loss, losses, None if self.count_scaler_skips else norm)
        self.meter.grad_norm = norm
        self.stepped.step()
        if self.count_scaler_skips and self.optimizer.step_was_skipped:  # type: ignore[attr-defined]
            self.meter.skipped_steps += 1  # fp16 overflow: Accelerate has read the scale already
        self.stepped.zero_grad(set_to_none=True)

    def skip(self, window: list[MicroBatch], k: int, epoch: int) -> None:
        """Global step ``k``'s data is skipped (after a rollback, ``training.recovery``): nothing is
        forwarded, the model is not updated; its target tokens still count as seen, so the run's
        token counts stay the plan's."""
        task = self.task
        if task.counts_tokens:
            units = [task.units(task.prepare(mb.data, k, epoch, mb.position, mb.real)) for mb in window]
            totals = units[0] if len(units) == 1 else torch.stack(units).sum(0)
            if self.world > 1:
                totals = self.accelerator.reduce(totals, reduction="sum")
            self.meter.tokens_pending += totals[0]
        self.meter.skip_step(nonfinite=False)

    def _backward(
        self, batch: Any, denominators: Tensor, *, sync: bool, gradnorm_units: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Forward and backward of one micro-batch (``sync``: the window's last, whose backward
        all-reduces); its loss and component losses, detached. ``gradnorm_units``: this
        micro-batch's units, when GradNorm updates its weights on it first."""
        if self.deepspeed:
            self.accelerator.sync_gradients = sync
        sums = self.task.loss_sums(self.model, batch)
        losses = sums / denominators
        if gradnorm_units is not None:
            self._update_gradnorm(sums / gradnorm_units.clamp_min(1))
        loss = losses.sum() if self.unit_weights else (self.weights * losses).sum()
        self.accelerator.backward(loss * self.scale if self.scale != 1.0 else loss)
        return loss.detach(), losses.detach()

    def _update_gradnorm(self, means: Tensor) -> None:
        """docs/design.md §5: new weights from this micro-batch's per-component mean losses (every process
        joins the averaging); the loss backpropagated just after uses them."""
        assert self.gradnorm is not None
        metrics = self.gradnorm.update(means, self.shared_parameters, self._mean_over_processes)
        self.weights = self.gradnorm.weights
        self.meter.gradnorm_weights = metrics["weights"]

    def _mean_over_processes(self, t: Tensor) -> Tensor:
        return self.accelerator.reduce(t, reduction="mean")  # type: ignore[no-any-return]
