"""A resumed run whose OPTIMIZER changed since its checkpoint (``--allow-config-change``).

torch's ``Optimizer.load_state_dict`` takes every parameter group's hyperparameters from the
checkpoint. Loaded as is, a resumed run would train on with the checkpoint's weight decay, betas or
eps while saying it applied the new ones. So the group keys that a changed setting decides are put
back after loading, from the groups as this run built them. Nothing is put back when OPTIMIZER did
not change: an optimizer that keeps learned values in its groups (schedule-free's, D-Adaptation's)
resumes them exactly.

A change that regroups the parameters (OPTIMIZER.NAME, OPTIMIZER.NO_DECAY, which parameters
LR_SCHEDULER.PARAMETER_GROUPS match) cannot resume at all, flag or not: the saved state is per
group and per parameter, in order. torch refuses it where the group sizes differ; where they
happen to agree, it would give one parameter's moments to another.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...json_files import flatten

# OPTIMIZER setting -> the parameter-group keys it decides (OPTIONS.<key>: the group key <key>).
GROUP_KEYS = {
    "OPTIMIZER.WEIGHT_DECAY": ("weight_decay",),
    "OPTIMIZER.BETAS": ("betas",),
    "OPTIMIZER.EPS": ("eps",),
    "OPTIMIZER.MOMENTUM": ("momentum",),
    "OPTIMIZER.IMPLEMENTATION": ("foreach", "fused"),
}
_OPTIONS = "OPTIMIZER.OPTIONS."
_NOT_SETTINGS = ("params", "lr", "initial_lr")  # the parameters; the LR schedule's values


def regrouping_problems(
    saved_config: Mapping[str, Any] | None, run_config: Mapping[str, Any]
) -> list[tuple[str, str]]:
    """(key, problem) for each change since the checkpoint that regroups the parameters
    (``run_config``: this run's config as JSON data, ``Config.model_dump(mode="json")``)."""
    if saved_config is None:
        return []
    old, new = flatten(saved_config), flatten(run_config)
    fix = (
        "the checkpoint's optimizer state is kept per parameter group, in order, and cannot follow; "
        "resume with the checkpoint's value, or start a new run (EXPERIMENT.NAME or --overwrite)"
    )
    found: list[tuple[str, str]] = []
    for key in ("OPTIMIZER.NAME", "OPTIMIZER.NO_DECAY"):
        if key in old and old[key] != new.get(key):
            found.append((key, f"was {old[key]!r} in the checkpoint, is {new.get(key)!r} now: {fix}"))
    key = "LR_SCHEDULER.PARAMETER_GROUPS"
    before = [g.get("MATCH") for g in old.get(key) or []]
    after = [g.get("MATCH") for g in new.get(key) or []]
    if before != after:
        found.append(
            (key, f"its groups match other parameters than in the checkpoint ({before} -> {after}): {fix}")
        )
    return found


def changed_group_keys(saved_config: Mapping[str, Any] | None, run_config: Mapping[str, Any]) -> list[str]:
    """The parameter-group keys that the OPTIMIZER settings changed since the checkpoint decide
    (``run_config``: this run's config as JSON data, ``Config.model_dump(mode="json")``)."""
    if saved_config is None:
        return []
    old, new = flatten(saved_config), flatten(run_config)
    keys: list[str] = []
    for key in sorted(k for k in old.keys() | new.keys() if k.startswith("OPTIMIZER.")):
        if old.get(key) != new.get(key):
            keys += GROUP_KEYS.get(key, (key[len(_OPTIONS) :],) if key.startswith(_OPTIONS) else ())
    return keys


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's hyperparameters as built (before any checkpoint is loaded)."""
    return [{k: v for k, v in g.items() if k not in _NOT_SETTINGS} for g in optimizer.param_groups]


def put_back(
    optimizer: torch.optim.Optimizer, built: Sequence[Mapping[str, Any]], keys: Sequence[str]
) -> None:
    """After loading: the ``keys`` of each group as this run built it, not as the checkpoint had."""
    for group, own in zip(optimizer.param_groups, built, strict=True):
        # A built group holds every key its optimizer reads (torch fills in the defaults): a key
        # it lacks (an OPTIONS key this optimizer does not take) is left alone.
        group.update({key: own[key] for key in keys if key in own})
        if group.get("fused") or group.get("capturable"):
            # torch loaded the step counts where the checkpoint's kernels keep them (on the host);
            # fused and capturable kernels read them on the parameter's device.
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].to(param.device, torch.float32)
