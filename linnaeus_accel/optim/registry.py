"""The registry of ``OPTIMIZER.NAME``; importing it needs no torch (``plan`` does not load it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..registry import Registry

if TYPE_CHECKING:
    import torch

    from ..config import Config

# (the parameter groups, the whole config) -> the optimizer, built with lr=0.0
OptimizerBuilder = Callable[[list[dict[str, Any]], "Config"], "torch.optim.Optimizer"]

OPTIMIZERS: Registry[OptimizerBuilder] = Registry(
    "optimizer",
    "OPTIMIZER.NAME",
    "linnaeus_accel.register_optimizer",
    {
        "adamw": "linnaeus_accel.optim.builtin",
        "sgd": "linnaeus_accel.optim.builtin",
        "muon": "linnaeus_accel.optim.muon",
    },
)
register_optimizer = OPTIMIZERS.register


def build_from_config(param_groups: list[dict[str, Any]], config: Config) -> torch.optim.Optimizer:
    """The optimizer OPTIMIZER.NAME names, over ``param_groups``."""
    return OPTIMIZERS.get(config.OPTIMIZER.NAME)(param_groups, config)
