"""What torch's built-in optimizers would make of OPTIMIZER's settings, found before the run trains.

torch takes an option's value as it is (``amsgrad: 'no'`` is a true string, so amsgrad goes on),
and some settings it accepts when it builds the optimizer fail only at the first step
(``differentiable: true`` steps with autograd on and fails on the in-place update of a leaf;
``capturable`` wants the parameters on an accelerator). So OPTIONS are checked against the
optimizer's signature, and settings that ask for something are tried in one step over a tiny
parameter on the device the run trains on: a trial on the CPU would refuse what works on a GPU.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from accelerate import PartialState

from ..config import ConfigError
from ..config.optimizer import BUILTIN_OPTIMIZERS, OptimizerConfig

OPTIONS_KEY = "OPTIMIZER.OPTIONS"
_KEYWORDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _taken(cls: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """The keyword arguments of ``cls``'s constructor, by name."""
    return {name: p for name, p in inspect.signature(cls).parameters.items() if p.kind in _KEYWORDS}


def option_problems(
    cls: Callable[..., Any], options: Mapping[str, Any], given: Collection[str]
) -> list[tuple[str, str]]:
    """Each of ``options`` that ``cls`` does not take, or not of the type its default has (a flag
    takes only true or false, a number only a number); ``given``: the arguments set from other keys."""
    name = f"torch.optim.{getattr(cls, '__name__', cls)}"
    takes = {k: p for k, p in _taken(cls).items() if k != "params" and k not in given}
    problems = []
    for key, value in options.items():
        parameter = takes.get(key)
        where = f"{OPTIONS_KEY}.{key}"
        if parameter is None:
            problems.append(
                (where, f"{name} has no option {key!r} (given {value!r}): OPTIONS takes {', '.join(takes)}")
            )
        elif isinstance(parameter.default, bool):
            if not isinstance(value, bool):
                problems.append(
                    (
                        where,
                        f"must be true or false ({name}'s {key} is a flag, and torch would read {value!r} as "
                        f"{str(bool(value)).lower()}), got {value!r}",
                    )
                )
        elif isinstance(parameter.default, int | float) and (
            isinstance(value, bool) or not isinstance(value, int | float)
        ):
            problems.append((where, f"must be a number ({name}'s {key}), got {value!r}"))
    return problems


def check_first_step(
    optimizer: torch.optim.Optimizer, optimizer_config: OptimizerConfig, device: torch.device | None
) -> None:
    """Refuse, as a ConfigError naming the key, settings of a built-in optimizer (built from the
    OPTIMIZER section ``optimizer_config``) that fail its first step on ``device`` (None:
    Accelerate's device for this process, the Accelerator's once it exists): one step of
    ``type(optimizer)`` with the same settings over a tiny parameter. Nothing is tried unless
    OPTIONS or IMPLEMENTATION ask for something (defaults cost nothing)."""
    o = optimizer_config
    if o.NAME not in BUILTIN_OPTIMIZERS or not (o.OPTIONS or o.IMPLEMENTATION != "auto"):
        return
    if device is None:
        device = PartialState().device
    # Muon's side takes no kernels: IMPLEMENTATION is its AdamW side's (optim.muon).
    optimizer = getattr(optimizer, "sides", {}).get("adamw", optimizer)
    cls = type(optimizer)
    takes = _taken(cls)
    settings = {k: v for k, v in optimizer.defaults.items() if k in takes}  # AdamW's defaults hold more
    first = next((p for g in optimizer.param_groups for p in g["params"]), None)
    dtype = first.dtype if first is not None and first.is_floating_point() else torch.float32
    parameter = torch.zeros(2, dtype=dtype, device=device, requires_grad=True)
    parameter.grad = torch.ones_like(parameter)
    try:
        cls([parameter], **settings).step()
    except Exception as exc:  # whatever the step raises, the settings asked for it
        reason = " ".join(str(exc).split()).rstrip(".") or type(exc).__name__
        kernels = "fused" in reason or "foreach" in reason or not o.OPTIONS
        if o.IMPLEMENTATION != "auto" and kernels:
            key, fix = "OPTIMIZER.IMPLEMENTATION", "choose other kernels (auto: torch's choice)"
        else:
            key, fix = OPTIONS_KEY, "remove or change the option that asks for it"
        raise ConfigError(
            [
                (
                    key,
                    f"torch.optim.{cls.__name__} accepts these settings but fails at its first step on "
                    f"{device}: {reason}: {fix}",
                )
            ]
        ) from None
