"""The built-in optimizers: torch's AdamW and SGD, with OPTIMIZER's hyperparameters and kernels."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..config import Config, ConfigError
from ..config.optimizer import OptimizerConfig
from .checks import option_problems
from .registry import register_optimizer

# OPTIMIZER.IMPLEMENTATION -> torch's keyword arguments (auto: torch's own choice, as before).
_KERNELS: dict[str, dict[str, bool]] = {
    "auto": {},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "for-loop": {"foreach": False, "fused": False},
}


def _construct(
    cls: Callable[..., torch.optim.Optimizer], groups: list[dict[str, Any]], o: OptimizerConfig, **own: Any
) -> torch.optim.Optimizer:
    """``cls`` over ``groups`` at lr 0 (the LR schedule sets each group's LR before every step);
    what torch refuses, and OPTIONS it would misread, are ConfigErrors naming the key."""
    given = {"lr", "weight_decay", *own, "foreach", "fused"}
    if o.OPTIONS and (problems := option_problems(cls, o.OPTIONS, given)):
        raise ConfigError(problems)
    try:
        return cls(
            groups, lr=0.0, weight_decay=o.WEIGHT_DECAY, **own, **_KERNELS[o.IMPLEMENTATION], **o.OPTIONS
        )
    except (TypeError, ValueError, RuntimeError) as exc:
        text = str(exc)
        if "fused" in text or "foreach" in text:
            key = "OPTIMIZER.IMPLEMENTATION"
        elif o.OPTIONS:
            key = "OPTIMIZER.OPTIONS"
        else:
            raise
        raise ConfigError(
            [(key, f"torch.optim.{getattr(cls, '__name__', cls)} refused it: {text}")]
        ) from None


@register_optimizer("adamw")
def adamw(groups: list[dict[str, Any]], config: Config) -> torch.optim.Optimizer:
    o = config.OPTIMIZER
    betas = (o.BETAS[0], o.BETAS[1])
    return _construct(torch.optim.AdamW, groups, o, betas=betas, eps=o.EPS)


@register_optimizer("sgd")
def sgd(groups: list[dict[str, Any]], config: Config) -> torch.optim.Optimizer:
    o = config.OPTIMIZER
    return _construct(torch.optim.SGD, groups, o, momentum=o.MOMENTUM)
