"""The optimizer's settings in ``plan``'s summary (no model here: ``train``'s start-up summary adds
how many parameters decay, once the model is built)."""

from __future__ import annotations

from ..config import Config
from ..config.optimizer import BUILTIN_OPTIMIZERS


def optimizer_lines(config: Config) -> list[str]:
    """E.g. 'Optimizer: adamw, betas (0.9, 0.95), eps 1e-08, fused kernels; weight decay 0.1, none on
    bias, norm, embedding parameters (groups of their own, at their LR group's LR)'."""
    o = config.OPTIMIZER
    parts = [o.NAME if o.NAME in BUILTIN_OPTIMIZERS else f"{o.NAME} (registered)"]
    if o.NAME == "adamw":
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
