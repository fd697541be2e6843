"""The optimizer's settings in the schedule summary: ``plan`` (no model) describes the one OPTIMIZER
would build; ``train`` describes the one given to the Trainer (``optimizer=``, a factory or built)
from the optimizer itself, since it does not read OPTIMIZER. ``train``'s start-up summary adds how
many parameters decay, once the model is built."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, Protocol

from ...config.optimizer import BUILTIN_OPTIMIZERS, OptimizerConfig
from ...registry import is_registered


class Optimizer(Protocol):
    """What the summary reads of a torch optimizer (this layer does not import torch)."""

    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]


# Hyperparameters that say how torch computes the update, not which update: kernels are said
# apart, and AdamW's decoupled decay is what AdamW is.
_NOT_SETTINGS = {"params", "lr", "initial_lr", "foreach", "fused", "capturable", "differentiable"}
_NOT_SETTINGS |= {"decoupled_weight_decay", "weight_decay"}


def optimizer_lines(optimizer: OptimizerConfig) -> list[str]:
    """E.g. 'Optimizer: adamw, betas (0.9, 0.95), eps 1e-08, fused kernels; weight decay 0.1, none on
    bias, norm, embedding parameters (groups of their own, at their LR group's LR)'."""
    o = optimizer
    if o.NAME in BUILTIN_OPTIMIZERS:
        parts = [o.NAME]
    elif is_registered("optimizer", o.NAME):
        parts = [f"{o.NAME} (registered)"]
    else:
        parts = [
            f"{o.NAME} (no optimizer of that name is registered here: train fails unless the script that "
            f"runs it registers one with @register_optimizer; built in: {', '.join(BUILTIN_OPTIMIZERS)})"
        ]
    if o.NAME == "muon":
        m = o.MUON
        nesterov = " (Nesterov)" if m.NESTEROV else ""
        momentum = f"{m.MOMENTUM:g}"
        if m.MOMENTUM_WARMUP_STEPS:
            momentum = f"{m.MOMENTUM_START:g} rising to {m.MOMENTUM:g} over {m.MOMENTUM_WARMUP_STEPS} steps"
        parts.append(
            f"Muon on the 2-D hidden weights: momentum {momentum}{nesterov}, {m.NS_STEPS} Newton-Schulz "
            f"steps, LR adjustment {m.ADJUST_LR}, weight decay {m.WEIGHT_DECAY:g}; AdamW on the rest"
        )
    if o.NAME in ("adamw", "muon"):
        parts.append(f"betas ({o.BETAS[0]:g}, {o.BETAS[1]:g}), eps {o.EPS:g}")
    elif o.NAME == "sgd":
        parts.append(f"momentum {o.MOMENTUM:g}")
    if o.NAME in BUILTIN_OPTIMIZERS:
        parts.append(
            "torch's default kernels" if o.IMPLEMENTATION == "auto" else f"{o.IMPLEMENTATION} kernels"
        )
    parts += [f"{key} {value!r}" for key, value in o.OPTIONS.items()]
    decay = f"weight decay {o.WEIGHT_DECAY:g}"
    if o.NO_DECAY:
        decay += f", none on {', '.join(o.NO_DECAY)} parameters (groups of their own, at their LR group's LR)"
    return [f"Optimizer: {', '.join(parts)}; {decay}"]


def muon_lr_lines(optimizer: OptimizerConfig, base_lr: float, curves: Sequence[Any]) -> list[str]:
    """Each LR group's Muon-side peak: its curve times MUON.LR / BASE_LR (``base_lr``), which
    ``train`` prints again with the split of the model's parameters."""
    ratio = optimizer.MUON.LR / base_lr
    peaks = ", ".join(f"'{c.label}' {c.base_lr * ratio:.4g} (min {c.min_lr * ratio:.4g})" for c in curves)
    return [f"Muon LR:  each LR group's curve x {ratio:.4g} (MUON.LR / BASE_LR): peak {peaks}"]


def built_optimizer_lines(optimizer: Optimizer) -> list[str]:
    """The optimizer given to the Trainer, as built: e.g. 'Optimizer: AdamW (the Trainer's
    optimizer=, as built), betas (0.9, 0.99), eps 1e-08, torch's default kernels; weight decay 0.1'.
    A setting that differs between parameter groups lists each value, in group order."""
    groups, defaults = optimizer.param_groups, optimizer.defaults
    parts = [f"{type(optimizer).__name__} (the Trainer's optimizer=, as built)"]
    for key in defaults:
        if key in _NOT_SETTINGS:
            continue
        values = _distinct([group.get(key, defaults[key]) for group in groups])
        if values == [True]:
            parts.append(key)  # a switch that is on: amsgrad, nesterov, maximize
        elif all(isinstance(v, float | tuple) for v in values) and values != [0.0]:
            parts.append(f"{key} {_by_group(values)}")  # off (0: SGD's dampening) says nothing
    kernel = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else None
    parts.append(f"{kernel} kernels" if kernel else "torch's default kernels")
    decay = _distinct([group.get("weight_decay", defaults.get("weight_decay", 0.0)) for group in groups])
    rates = [v for v in decay if isinstance(v, float)] or [0.0]
    return [f"Optimizer: {', '.join(parts)}; weight decay {_by_group(rates)}"]


def _distinct(values: list[Any]) -> list[Any]:
    """The values shown, in first-seen order: numbers (one-element tensors too) and tuples of
    them, as floats; switches as bools; anything else as None (not shown)."""
    shown = []
    for value in values:
        value = _shown(value)
        if value not in shown:
            shown.append(value)
    return shown


def _shown(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, tuple | list):
        items = [_shown(v) for v in value]
        return tuple(items) if all(isinstance(v, float) for v in items) else None
    numel = getattr(value, "numel", None)  # a tensor: torch takes tensor lr and betas
    if callable(numel) and numel() == 1:
        return float(value.item())
    return None


def _text(value: Any) -> str:
    return f"({', '.join(f'{v:g}' for v in value)})" if isinstance(value, tuple) else f"{value:g}"


def _by_group(values: list[Any]) -> str:
    if len(values) == 1:
        return _text(values[0])
    return " or ".join(_text(v) for v in values) + " (by parameter group)"
