"""GradNorm task weighting of a task's loss components (docs/design.md §5).

``GradNorm`` (Chen et al. 2018) moves the per-component weights so that each component's weighted
gradient norm on the shared parameters tracks the mean norm scaled by that component's relative
training rate. Nothing here reads a tensor on the host in the per-step path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from ...checkpoint.state.schemas import GradNormState
from ...config.sections import LossConfig

_STATE_VERSION = 1


def _check_weights(values: Sequence[float], n: int, name: str) -> list[float]:
    out = [float(v) for v in values]
    if len(out) != n:
        raise ValueError(f"{name} has {len(out)} entries but there are {n} task levels")
    if any(not math.isfinite(v) or v < 0 for v in out):
        raise ValueError(f"{name} must be finite and non-negative, got {out}")
    return out


class GradNorm:
    """GradNorm task weights with their own Adam optimizer and JSON-able state.

    Weights stay positive and sum to the number of tasks. Adam (not SGD) is used because it is
    invariant to the scale of the gradient norms, so one default ``lr`` suits any model.
    """

    STATE_SCHEMA: ClassVar[type[GradNormState]] = GradNormState  # defined where verification reaches it

    def __init__(
        self,
        num_tasks: int,
        alpha: float = 1.5,
        lr: float = 0.025,
        *,
        initial_weights: Sequence[float] | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        min_weight: float = 1e-3,
    ) -> None:
        if num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
        if alpha < 0 or lr <= 0 or min_weight <= 0:
            raise ValueError(f"need alpha >= 0, lr > 0, min_weight > 0; got {alpha}, {lr}, {min_weight}")
        self.num_tasks = num_tasks
        self.alpha = float(alpha)
        self.lr = float(lr)
        self.betas = betas
        self.eps = eps
        self.min_weight = min_weight
        w = (
            [1.0] * num_tasks
            if initial_weights is None
            else _check_weights(initial_weights, num_tasks, "initial_weights")
        )
        if any(v <= 0 for v in w):
            raise ValueError(f"GradNorm weights must be positive, got {w}")
        self.weights = self._renormalise(torch.tensor(w, dtype=torch.float32))
        self.initial_losses: Tensor | None = None
        self.step = 0  # a host int: Adam's bias correction then needs no device read
        self.exp_avg = torch.zeros(num_tasks)
        self.exp_avg_sq = torch.zeros(num_tasks)

    def _renormalise(self, w: Tensor) -> Tensor:
        w = w.clamp_min(self.min_weight)
        return w * (self.num_tasks / w.sum())

    def _to(self, device: torch.device) -> None:
        if self.weights.device != device:
            self.weights = self.weights.to(device)
            self.exp_avg = self.exp_avg.to(device)
            self.exp_avg_sq = self.exp_avg_sq.to(device)
            if self.initial_losses is not None:
                self.initial_losses = self.initial_losses.to(device)

    def update(
        self,
        task_losses: Tensor,
        shared_parameters: Sequence[Tensor],
        reduce_mean: Callable[[Tensor], Tensor] | None = None,
    ) -> dict[str, Tensor]:
        """One GradNorm step. ``task_losses`` are the unweighted per-level losses with their graph;
        the graph is retained so the caller can still backward a loss built from them."""
        if task_losses.shape != (self.num_tasks,):
            raise ValueError(
                f"task_losses must have shape ({self.num_tasks},), got {tuple(task_losses.shape)}"
            )
        if not task_losses.requires_grad:
            raise ValueError("task_losses carry no graph; GradNorm needs the losses of a forward with grad")
        params = [p for p in shared_parameters if p.requires_grad]
        if not params:
            raise ValueError("GradNorm needs at least one shared parameter that requires grad")
        self._to(task_losses.device)

        # autograd.grad, not backward: nothing accumulates into .grad and no DDP hook fires.
        norms = []
        for i in range(self.num_tasks):
            grads = torch.autograd.grad(task_losses[i], params, retain_graph=True, allow_unused=True)
            sq = [g.detach().float().pow(2).sum() for g in grads if g is not None]
            norms.append(
                torch.stack(sq).sum().sqrt() if sq else task_losses.new_zeros((), dtype=torch.float32)
            )
        unweighted = torch.stack(norms)
        losses = task_losses.detach().float()

        if self.initial_losses is None:
            # Averaged across processes so every rank, and the checkpoint, holds the same L(0).
            self.initial_losses = (reduce_mean(losses) if reduce_mean is not None else losses).clone()
        l0 = self.initial_losses
        # A level with no usable reference loss (no labelled sample at the first update, or an
        # overflow) is treated as on-pace rather than poisoning every weight with inf/NaN.
        known = (l0 > 0) & torch.isfinite(l0)
        ratio = torch.where(known, losses / l0.clamp_min(1e-12), torch.ones_like(losses))
        rate = ratio / ratio.mean().clamp_min(1e-12)

        norms_w = self.weights * unweighted  # G_i = ||d(w_i L_i)/dW|| = w_i ||dL_i/dW||, w_i > 0
        target = norms_w.mean() * rate.pow(self.alpha)  # a constant in the paper: no gradient
        diff = norms_w - target
        gn_loss = diff.abs().sum()
        # d/dw_i sum_j |w_j g_j - T_j| with T constant is g_i sign(w_i g_i - T_i): closed form, so no
        # second-order graph through the model is needed.
        grad = unweighted * torch.sign(diff)
        # An overflowed norm or loss (e.g. fp16 without loss scaling) must not make the weights NaN
        # forever: this rank then contributes a zero gradient, and still joins the collective.
        finite = torch.isfinite(unweighted).all() & torch.isfinite(losses).all()
        grad = torch.where(finite, grad, torch.zeros_like(grad))
        if reduce_mean is not None:
            grad = reduce_mean(grad)

        self.step += 1
        b1, b2 = self.betas
        self.exp_avg = self.exp_avg * b1 + grad * (1 - b1)
        self.exp_avg_sq = self.exp_avg_sq * b2 + grad * grad * (1 - b2)
        m_hat = self.exp_avg / (1 - b1**self.step)
        v_hat = self.exp_avg_sq / (1 - b2**self.step)
        self.weights = self._renormalise(self.weights - self.lr * m_hat / (v_hat.sqrt() + self.eps))
        return {
            "weights": self.weights,
            "grad_norms": norms_w,
            "targets": target,
            "inverse_rates": rate,
            "gradnorm_loss": gn_loss,
            "weight_grad": grad,
        }

    # -- checkpoint: plain JSON data (checkpoint time only, so .tolist() is fine here) -------------
    def state_dict(self) -> dict[str, Any]:
        return GradNormState(
            version=_STATE_VERSION,
            num_tasks=self.num_tasks,
            weights=self.weights.tolist(),
            initial_losses=None if self.initial_losses is None else self.initial_losses.tolist(),
            step=self.step,
            exp_avg=self.exp_avg.tolist(),
            exp_avg_sq=self.exp_avg_sq.tolist(),
        ).as_data()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Missing keys keep their fresh-start meaning (L(0) re-recorded, Adam state zero)."""
        version = int(state.get("version", _STATE_VERSION))
        if version > _STATE_VERSION:
            raise ValueError(f"GradNorm state version {version} is newer than supported {_STATE_VERSION}")
        n = self.num_tasks
        if int(state.get("num_tasks", n)) != n:
            raise ValueError(f"GradNorm state has {state['num_tasks']} tasks, this run has {n}")
        device = self.weights.device

        def vec(key: str) -> Tensor | None:
            value = state.get(key)
            if value is None:
                return None
            out = [float(v) for v in value]
            if len(out) != n or not all(map(math.isfinite, out)):
                raise ValueError(f"GradNorm state {key!r} must be {n} finite numbers, got {value!r}")
            if key == "weights" and min(out) <= 0:
                raise ValueError(f"GradNorm state weights must be positive, got {value!r}")
            return torch.tensor(out, dtype=torch.float32, device=device)

        # Loaded as saved (not renormalised again) so a resumed run repeats the next update exactly.
        weights = vec("weights")
        if weights is not None:
            self.weights = weights
        self.initial_losses = vec("initial_losses")
        self.step = int(state.get("step", 0))
        # Adam moments without a step count (or vice versa) would mis-scale the bias correction.
        m, v = vec("exp_avg"), vec("exp_avg_sq")
        if m is None or v is None:
            self.step = 0
        self.exp_avg = m if m is not None and self.step else torch.zeros(n, device=device)
        self.exp_avg_sq = v if v is not None and self.step else torch.zeros(n, device=device)


def gradnorm_for(loss: LossConfig, components: int) -> GradNorm | None:
    """LOSS.GRAD_WEIGHTING.TASK's GradNorm (``loss``: the LOSS section) over the task's loss
    components, if enabled."""
    balance = loss.GRAD_WEIGHTING.TASK
    if not balance.GRADNORM_ENABLED:
        return None
    return GradNorm(components, alpha=balance.ALPHA, initial_weights=loss.TASK_WEIGHTS)
