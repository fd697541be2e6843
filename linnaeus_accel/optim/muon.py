"""``OPTIMIZER.NAME: muon``: Muon for the hidden layers' 2-D weights, AdamW for the rest, as nanochat
and modded-nanogpt train.

Muon (``torch.optim.Muon``) replaces each update of a weight matrix by its nearest semi-orthogonal
matrix (a Newton-Schulz iteration on the momentum). That suits the matrices inside the network and
not its ends: an embedding's rows are looked up one token at a time, a head's output is read class by
class, and a vector has no orthogonal form. ``muon_split`` sends those to AdamW:

- every parameter that is not 2-D (biases, norm gains, convolution kernels);
- embeddings: parameters of a module whose class name contains ``Embedding``, tied or not (a tied
  output head is the embedding itself);
- the output head: the model's ``get_output_embeddings()`` (transformers), a module named ``lm_head``,
  ``head``, ``heads``, ``classifier`` or ``score`` at any depth, or ``output`` at the top;
- what ``OPTIMIZER.MUON.ADAMW_MATCH`` names; ``MUON_MATCH`` sends 2-D parameters the other way.

``MuonWithAdamW`` is one ``torch.optim.Optimizer`` over both sides: it steps a ``torch.optim.Muon``
and a ``torch.optim.AdamW`` that share its parameter groups and its state, so its ``state_dict`` is
torch's plain format (each group says its ``algorithm``) and checkpoints, rollbacks and resumes treat
it as any optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Any

import torch
from torch import nn

from ..config import Config, ConfigError
from ..config.optimizer import MuonConfig
from .registry import register_optimizer

MUON_KEY = "OPTIMIZER.MUON"
# Names of an output head's module: at any depth (a model's task head, a multi-head classifier's
# list) or, for ``output``, only at the top (torchtitan's Llama), where a hidden layer cannot be.
HEAD_NAMES = frozenset({"lm_head", "head", "heads", "classifier", "score"})
TOP_HEAD_NAMES = frozenset({"output"})


@dataclass
class MuonSplit:
    """Which trained parameters each side trains, by name in ``model.named_parameters()`` order:
    ``muon``, and ``adamw`` with why each goes there (``not 2-D``, ``embedding``, ``head``,
    ``ADAMW_MATCH``)."""

    muon: list[str] = field(default_factory=list)
    adamw: dict[str, str] = field(default_factory=dict)
    numel: dict[str, int] = field(default_factory=dict)

    def count(self, side: str) -> tuple[int, int]:
        """(tensors, parameters) of ``side`` (``muon`` or ``adamw``)."""
        names = self.muon if side == "muon" else list(self.adamw)
        return len(names), sum(self.numel[n] for n in names)

    def lines(self, muon_lr: float, adamw_lr: float, most: int = 12) -> list[str]:
        """What ``plan`` and train's start-up print: each side's size and peak LR, and the names
        sent to AdamW (the first ``most`` of each reason, with how many more)."""
        mt, mp = self.count("muon")
        at, ap = self.count("adamw")
        out = [
            f"Muon:  {mt} tensors, {mp:,} parameters (2-D hidden weights), peak LR {muon_lr:.4g}",
            f"AdamW: {at} tensors, {ap:,} parameters, peak LR {adamw_lr:.4g}:",
        ]
        by_reason: dict[str, list[str]] = {}
        for name, reason in self.adamw.items():
            by_reason.setdefault(reason, []).append(name)
        for reason, names in by_reason.items():
            shown = ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
            out.append(f"  {reason}: {shown}")
        return out


def _modules_of(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """id(parameter) -> every (module path, module) that holds it (a tied weight has several)."""
    holders: dict[int, list[tuple[str, nn.Module]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append((path, module))
    return holders


def _output_head(model: nn.Module) -> set[int]:
    """ids of the parameters of the module transformers names the output embeddings, if any."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()


def _is_head(path: str) -> bool:
    parts = path.split(".")
    return bool(HEAD_NAMES.intersection(parts)) or (bool(parts) and parts[0] in TOP_HEAD_NAMES)


def _reason(param: nn.Parameter, holders: list[tuple[str, nn.Module]], head: set[int]) -> str | None:
    """Why ``param`` goes to AdamW by the automatic rule, or None (Muon)."""
    if param.ndim != 2:
        return "not 2-D"
    if any("Embedding" in type(module).__name__ for _, module in holders):
        return "embedding"
    if id(param) in head or any(_is_head(path) for path, _ in holders):
        return "head"
    return None


def muon_split(model: nn.Module, muon: MuonConfig, trained: Iterable[str] | None = None) -> MuonSplit:
    """The split of ``model``'s trained parameters (``trained``: their names; default every one that
    requires a gradient) between Muon and AdamW, with ``muon``'s overrides. A pattern that matches no
    trained parameter, or ``MUON_MATCH`` naming one that is not 2-D, is a ConfigError."""
    named = dict(model.named_parameters())
    names = list(trained) if trained is not None else [n for n, p in named.items() if p.requires_grad]
    holders, head = _modules_of(model), _output_head(model)
    problems: list[tuple[str, str]] = []
    for key, patterns in (("ADAMW_MATCH", muon.ADAMW_MATCH), ("MUON_MATCH", muon.MUON_MATCH)):
        unmatched = [p for p in patterns if not any(fnmatch(n, p) for n in names)]
        if unmatched:
            problems.append(
                (f"{MUON_KEY}.{key}", f"{', '.join(map(repr, unmatched))} matches no trained parameter name")
            )
    split = MuonSplit()
    for name in names:
        param = named[name]
        split.numel[name] = param.numel()
        if any(fnmatch(name, p) for p in muon.ADAMW_MATCH):
            split.adamw[name] = "ADAMW_MATCH"
            continue
        reason = _reason(param, holders.get(id(param), []), head)
        if reason is not None and any(fnmatch(name, p) for p in muon.MUON_MATCH):
            if param.ndim != 2:
                problems.append(
                    (
                        f"{MUON_KEY}.MUON_MATCH",
                        f"matches {name} of shape {list(param.shape)}: torch.optim.Muon trains 2-D matrices "
                        "only; narrow the pattern",
                    )
                )
                continue
            reason = None
        if reason is None:
            split.muon.append(name)
        else:
            split.adamw[name] = reason
    if problems:
        raise ConfigError(problems)
    if not split.muon:
        raise ConfigError(
            [
                (
                    "OPTIMIZER.NAME",
                    "is muon but the model has no 2-D hidden weight for Muon to train (every trained "
                    "parameter is an embedding, a head or not 2-D): use adamw, or name weights in "
                    f"{MUON_KEY}.MUON_MATCH",
                )
            ]
        )
    return split


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over parameter groups of both sides: each group's ``algorithm`` (``muon`` or
    ``adamw``) says which steps it. ``muon`` and ``adamw``: the keyword arguments of
    ``torch.optim.Muon`` and ``torch.optim.AdamW`` (a group's own values win, as in torch)."""

    def __init__(self, groups: list[dict[str, Any]], *, muon: dict[str, Any], adamw: dict[str, Any]) -> None:
        unknown = {g.get("algorithm") for g in groups} - {"muon", "adamw"}
        if unknown:
            raise ValueError(f"every parameter group needs algorithm 'muon' or 'adamw', not {unknown}")
        # Each side's torch optimizer fills its groups with its defaults; the groups themselves
        # (the same dicts) then become this optimizer's, in the order given.
        sides = {
            "muon": (torch.optim.Muon, muon, [g for g in groups if g["algorithm"] == "muon"]),
            "adamw": (torch.optim.AdamW, adamw, [g for g in groups if g["algorithm"] == "adamw"]),
        }
        placeholder = [torch.zeros(1, 1)]  # torch refuses an optimizer without parameters
        self.sides: dict[str, torch.optim.Optimizer] = {}
        for name, (cls, kwargs, own) in sides.items():
            self.sides[name] = cls(own or [{"params": placeholder}], **kwargs)
            if not own:
                self.sides[name].param_groups = []
        super().__init__(groups, defaults={})
        self._link()

    def _link(self) -> None:
        """Point each side at this optimizer's state and its own groups (after a load, too)."""
        for name, side in self.sides.items():
            own = [g for g in self.param_groups if g["algorithm"] == name]
            side.__setstate__({"state": self.state, "param_groups": own})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for side in self.sides.values():
            if side.param_groups:
                side.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()


def warmed_momentum(step: int, start: float, end: float, warmup: int) -> float:
    """Muon's momentum at global step ``step`` (0-based): ``start`` at step 0 rising in a line to
    ``end`` at step ``warmup`` and held there (nanochat's and modded-nanogpt's warmup)."""
    if step >= warmup:
        return end
    return start + (end - start) * step / warmup


@dataclass(frozen=True)
class MomentumWarmup:
    """MUON.MOMENTUM_WARMUP_STEPS: the loop sets every Muon group's momentum before each step."""

    start: float
    end: float
    steps: int

    def apply(self, groups: list[dict[str, Any]], step: int) -> None:
        momentum = warmed_momentum(step, self.start, self.end, self.steps)
        for group in groups:
            if group.get("algorithm") == "muon":
                group["momentum"] = momentum


def momentum_warmup(muon: MuonConfig, name: str) -> MomentumWarmup | None:
    """The warmup the loop applies, for OPTIMIZER.NAME ``name``; None without one."""
    if name != "muon" or muon.MOMENTUM_WARMUP_STEPS == 0:
        return None
    return MomentumWarmup(muon.MOMENTUM_START, muon.MOMENTUM, muon.MOMENTUM_WARMUP_STEPS)


@register_optimizer("muon")
def muon(groups: list[dict[str, Any]], config: Config) -> torch.optim.Optimizer:
    """Over ``groups`` as ``training.start.setup.parameter_groups`` splits them (``algorithm`` and
    ``lr_scale`` on each); the AdamW side takes the section's BETAS, EPS and IMPLEMENTATION."""
    o = config.OPTIMIZER
    if not hasattr(torch.optim, "Muon"):
        raise ConfigError(
            [
                (
                    "OPTIMIZER.NAME",
                    f"muon needs torch.optim.Muon (torch 2.9 or newer); this torch is {torch.__version__}",
                )
            ]
        )
    if not any("algorithm" in g for g in groups):
        raise ConfigError(
            [
                (
                    "OPTIMIZER.NAME",
                    "muon needs its parameter groups split by parameter_groups (each with an algorithm): "
                    "build it through the Trainer, or pass groups that say muon or adamw",
                )
            ]
        )
    m = o.MUON
    muon_kwargs = {
        "lr": 0.0,
        "weight_decay": m.WEIGHT_DECAY,
        "momentum": m.MOMENTUM,
        "nesterov": m.NESTEROV,
        "ns_steps": m.NS_STEPS,
        "adjust_lr_fn": m.ADJUST_LR,
    }
    kernels = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}
    adamw_kwargs = {
        "lr": 0.0,
        "betas": (o.BETAS[0], o.BETAS[1]),
        "eps": o.EPS,
        "weight_decay": o.WEIGHT_DECAY,
        **kernels.get(o.IMPLEMENTATION, {}),
    }
    return MuonWithAdamW(groups, muon=muon_kwargs, adamw=adamw_kwargs)
