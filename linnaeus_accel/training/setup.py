"""Turning what the user hands the Trainer into what Accelerate prepares: parameter groups of the
LR schedule, the optimizer, the dataloaders, and the parameters GradNorm balances on."""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatch
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..config import Config, ConfigError
from ..data.sampling import make_dataloader

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


def default_optimizer(param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups, lr=0.0, weight_decay=0.0)


def parameter_groups(model: nn.Module, config: Config) -> list[dict[str, Any]]:
    """Group 0 takes the parameters no LR_SCHEDULER.PARAMETER_GROUPS entry matches (SPEC §3)."""
    groups = config.LR_SCHEDULER.PARAMETER_GROUPS
    members: list[list[nn.Parameter]] = [[] for _ in range(len(groups) + 1)]
    for name, param in model.named_parameters():
        if param.requires_grad:
            index = next((i + 1 for i, g in enumerate(groups) if any(fnmatch(name, p) for p in g.MATCH)), 0)
            members[index].append(param)
    empty = [g.LABEL for g, params in zip(groups, members[1:], strict=True) if not params]
    if empty:
        raise ConfigError(
            [("LR_SCHEDULER.PARAMETER_GROUPS", f"no parameter matches group(s) {', '.join(empty)}")]
        )
    labels = ["default", *(g.LABEL for g in groups)]
    return [{"params": params, "name": label} for label, params in zip(labels, members, strict=True)]


def build_optimizer(
    optimizer: OptimizerFactory | torch.optim.Optimizer, model: nn.Module, config: Config
) -> torch.optim.Optimizer:
    expected = 1 + len(config.LR_SCHEDULER.PARAMETER_GROUPS)
    if isinstance(optimizer, torch.optim.Optimizer):
        if len(optimizer.param_groups) != expected:
            raise ConfigError(
                [
                    (
                        "LR_SCHEDULER.PARAMETER_GROUPS",
                        f"the optimizer given has {len(optimizer.param_groups)} parameter groups but the LR schedule has {expected} (default + PARAMETER_GROUPS): pass an optimizer factory instead",
                    )
                ]
            )
        return optimizer
    return optimizer(parameter_groups(model, config))


def as_dataloader(config: Config, data: Dataset[Any] | DataLoader[Any] | None, train: bool) -> Any:
    if data is None or not isinstance(data, DataLoader):
        return make_dataloader(config, data, train) if data is not None else None
    expected = config.DATA.BATCH_SIZE if train else (config.DATA.BATCH_SIZE_VAL or config.DATA.BATCH_SIZE)
    if data.batch_size != expected:
        key = "DATA.BATCH_SIZE" if train else "DATA.BATCH_SIZE_VAL"
        raise ConfigError(
            [
                (
                    key,
                    f"is {expected} but the DataLoader given batches {data.batch_size}: the schedule is resolved from {key}",
                )
            ]
        )
    return data


def shared_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters every task head depends on, for GradNorm: ``model.shared_parameters()``
    when the model defines it, else every parameter outside modules named ``head*``."""
    own = getattr(model, "shared_parameters", None)
    if callable(own):
        return list(own())
    return [
        p
        for name, p in model.named_parameters()
        if p.requires_grad and not name.split(".")[0].startswith("head")
    ]
