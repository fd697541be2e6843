"""Which parameters decay (``OPTIMIZER.NO_DECAY``), what a given optimizer leaves of the config unused,
and the start-up line that counts the parameters that decay."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..config.optimizer import OptimizerConfig

# The settings a Python optimizer factory makes its own (it still gets WEIGHT_DECAY and NO_DECAY
# through the groups); a built optimizer makes every setting its own.
FACTORY_OWNS = ("NAME", "BETAS", "EPS", "MOMENTUM", "IMPLEMENTATION", "OPTIONS")


def parameter_kinds(model: nn.Module) -> dict[int, set[str]]:
    """id(parameter) -> the NO_DECAY kinds it is of: ``bias`` (its name is ``bias`` or ends in
    ``_bias``, as ``in_proj_bias``), ``norm`` (a module whose class name contains 'Norm' holds it),
    ``embedding`` (one whose class name contains 'Embedding' does), ``ndim<2``. A parameter held
    by several modules (tied weights) is of every kind of each."""
    kinds: dict[int, set[str]] = {}
    for module in model.modules():
        cls = type(module).__name__
        held = {kind for kind, word in (("norm", "Norm"), ("embedding", "Embedding")) if word in cls}
        for name, param in module.named_parameters(recurse=False):
            found = kinds.setdefault(id(param), set())
            found |= held
            if name == "bias" or name.endswith("_bias"):
                found.add("bias")
            if param.ndim < 2:
                found.add("ndim<2")
    return kinds


def unused_settings(given: OptimizerConfig, built: bool) -> list[tuple[str, str]]:
    """(key, problem) for each setting of ``given`` (the OPTIMIZER section) that the optimizer the
    Trainer was given would ignore: a factory builds its own (it is handed WEIGHT_DECAY and NO_DECAY
    through the groups), a built optimizer has every setting of its own already."""
    default = OptimizerConfig()
    what = "an optimizer already built" if built else "an optimizer factory"
    fix = "drop optimizer= to build the optimizer from the config"
    return [
        (
            f"OPTIMIZER.{key}",
            f"is {getattr(given, key)!r} but the Trainer was given {what} (optimizer=), which does not "
            f"read it: remove the key, or {fix}",
        )
        for key in type(given).model_fields
        if (built or key in FACTORY_OWNS) and getattr(given, key) != getattr(default, key)
    ]


def _numel(params: Iterable[Any]) -> int:
    # A lazy module's parameter has no size until its first forward: counted as 0 here.
    return sum(0 if isinstance(p, torch.nn.parameter.UninitializedParameter) else p.numel() for p in params)


def optimizer_line(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer as built (before ``prepare``: whole parameters) in one line of train's start-up
    summary: its class and kernels, its groups, how many trained parameters decay."""
    groups = optimizer.param_groups
    defaults = optimizer.defaults
    kernel = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else None
    what = type(optimizer).__name__ + (f" ({kernel})" if kernel else "")
    total = sum(_numel(g["params"]) for g in groups)
    rates = [float(g.get("weight_decay") or 0.0) for g in groups]
    decaying = sum(_numel(g["params"]) for g, rate in zip(groups, rates, strict=True) if rate > 0)
    shown = sorted({rate for rate in rates if rate > 0})
    plural = "s" if len(groups) != 1 else ""
    if any(g.get("algorithm") == "muon" for g in groups):  # NAME muon: how much each side trains
        tensors = {"muon": 0, "adamw": 0}
        numel = {"muon": 0, "adamw": 0}
        for g in groups:
            tensors[g["algorithm"]] += len(g["params"])
            numel[g["algorithm"]] += _numel(g["params"])
        what += (
            f" (Muon {tensors['muon']} tensors, {numel['muon']:,} parameters; "
            f"AdamW {tensors['adamw']} tensors, {numel['adamw']:,} parameters)"
        )
    if not decaying:
        decay = f"no weight decay on its {total:,} trained parameters"
    else:
        share = f"{decaying / total:.1%}" if total else "-"
        values = ", ".join(f"{rate:g}" for rate in shown)
        decay = f"weight decay {values} on {decaying:,} of {total:,} trained parameters ({share})"
    return f"Optimizer built: {what}, {len(groups)} parameter group{plural}; {decay}"
