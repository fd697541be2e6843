"""``OPTIMIZER``: which optimizer trains the model, its hyperparameters, and which parameters decay.

The LR is not here: the LR schedule (``LR_SCHEDULER``) sets every parameter group's LR before each
step. The defaults are what linnaeus-accel has always trained with (torch's AdamW at weight decay 0,
betas (0.9, 0.999), eps 1e-8), so that a checkpoint written before this section existed resumes
unchanged.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from .base import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Problem, Section, accepts

# The optimizers built in (linnaeus_accel.optim); others are registered from the user's script.
BUILTIN_OPTIMIZERS = ("adamw", "sgd", "muon")
DEFAULT_BETAS = (0.9, 0.999)
DEFAULT_EPS = 1e-8
Implementation = Literal["auto", "foreach", "fused", "for-loop"]
NoDecayKind = Literal["bias", "norm", "embedding", "ndim<2"]

# OPTIONS keys the built-in optimizers take from elsewhere: the key to set instead.
_RESERVED_OPTIONS = {
    "params": "the parameters come from the model (LR_SCHEDULER.PARAMETER_GROUPS, OPTIMIZER.NO_DECAY)",
    "lr": "the LR schedule sets it every step: use LR_SCHEDULER.BASE_LR",
    "weight_decay": "use OPTIMIZER.WEIGHT_DECAY",
    "betas": "use OPTIMIZER.BETAS",
    "eps": "use OPTIMIZER.EPS",
    "momentum": "use OPTIMIZER.MOMENTUM",
    "foreach": "use OPTIMIZER.IMPLEMENTATION",
    "fused": "use OPTIMIZER.IMPLEMENTATION",
}


@accepts("two numbers in [0, 1)")
def _check_betas(value: list[float]) -> list[float]:
    if len(value) != 2 or not all(math.isfinite(b) and 0.0 <= b < 1.0 for b in value):
        raise ValueError(
            f"must be two numbers in [0, 1), AdamW's (beta1, beta2), e.g. [0.9, 0.95] (got {value})"
        )
    return value


@accepts("number in [0, 1)")
def _check_momentum(value: float) -> float:
    if not math.isfinite(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"must be in [0, 1): 0 is plain SGD, 0.9 is usual (got {value})")
    return value


Betas = Annotated[list[float], AfterValidator(_check_betas)]
Momentum = Annotated[float, AfterValidator(_check_momentum)]
AdjustLR = Literal["original", "match_rms_adamw"]


class MuonConfig(Section):
    """``NAME: muon``'s own settings: Muon trains every 2-D weight of the hidden layers, AdamW (the
    section's BETAS, EPS, WEIGHT_DECAY, at LR_SCHEDULER's LR) the rest: embeddings (input and output,
    tied or not), the output head and every parameter that is not 2-D (docs/guides/optimizers.md).
    The defaults are Keller Jordan's reference Muon, which nanochat and modded-nanogpt train with:
    LR 0.02, momentum 0.95 with Nesterov, 5 Newton-Schulz steps, no weight decay."""

    LR: PositiveFloat = Field(
        0.02,
        description="The Muon side's peak LR, where LR_SCHEDULER.BASE_LR is the AdamW side's: at every step "
        "a Muon parameter's LR is its LR group's scheduled LR times LR / BASE_LR (the same warmup, decay "
        "and batch-size scaling). Default 0.02 (Keller Jordan's Muon, nanochat's matrix_lr).",
    )
    MOMENTUM: Momentum = Field(0.95, description="Momentum of the gradient's running average, in [0, 1).")
    MOMENTUM_WARMUP_STEPS: NonNegativeInt = Field(
        0,
        description="Optimizer steps over which the momentum rises in a line from MOMENTUM_START to MOMENTUM, "
        "as nanochat and modded-nanogpt warm it (0.85 to 0.95 over 300 steps); 0 (default): MOMENTUM from "
        "the first step. A pure function of the global step, set before each step.",
    )
    MOMENTUM_START: Momentum = Field(
        0.85, description="The momentum of step 0 when MOMENTUM_WARMUP_STEPS is above 0."
    )
    NESTEROV: bool = Field(True, description="Nesterov momentum (the reference's, torch's default).")
    NS_STEPS: PositiveInt = Field(
        5, description="Newton-Schulz iterations that orthogonalise each update (torch requires < 100)."
    )
    WEIGHT_DECAY: NonNegativeFloat = Field(
        0.0,
        description="Decoupled weight decay of the Muon side (the AdamW side's is OPTIMIZER.WEIGHT_DECAY). "
        "Default 0, as the reference and nanochat; a parameter that OPTIMIZER.NO_DECAY names never decays.",
    )
    ADJUST_LR: AdjustLR = Field(
        "original",
        description="How torch.optim.Muon scales the LR by a matrix's shape (rows A, columns B): original "
        "(Keller Jordan's: x sqrt(max(1, A/B))) or match_rms_adamw (Moonshot's: x 0.2 sqrt(max(A, B)), "
        "so that Muon can reuse AdamW's LR and weight decay).",
    )
    ADAMW_MATCH: list[str] = Field(
        default_factory=list,
        description="fnmatch patterns on parameter names (model.named_parameters()) sent to AdamW whatever "
        "their shape: for what the automatic split sends to Muon wrongly (e.g. a head it does not "
        "recognise). `plan` and train's start-up print which names go to AdamW.",
    )
    MUON_MATCH: list[str] = Field(
        default_factory=list,
        description="fnmatch patterns of 2-D parameters sent to Muon although the split would send them to "
        "AdamW (an embedding or head you want orthogonalised); a pattern matching a parameter that is "
        "not 2-D is an error (torch.optim.Muon takes matrices only). ADAMW_MATCH wins where both match.",
    )

    def problems(self) -> list[Problem]:
        problems = []
        if self.NS_STEPS >= 100:
            problems.append(
                Problem(("NS_STEPS",), "{0} must be below 100 (torch.optim.Muon's bound); 5 is usual")
            )
        if (
            self.MOMENTUM_WARMUP_STEPS == 0
            and self.MOMENTUM_START != type(self).model_fields["MOMENTUM_START"].default
        ):
            problems.append(
                Problem(
                    ("MOMENTUM_START", "MOMENTUM_WARMUP_STEPS"),
                    "{0} is read only with a warmup: set {1} (e.g. 300), or remove {0}",
                )
            )
        return problems


class OptimizerConfig(Section):
    """The optimizer ``train`` builds (a Python ``optimizer=`` factory given to the Trainer builds its
    own, from the parameter groups: docs/guides/optimizers.md, "Build the optimizer in Python")."""

    NAME: str = Field(
        "adamw",
        description="adamw (torch.optim.AdamW: decoupled weight decay), sgd (torch.optim.SGD, with "
        "MOMENTUM; its weight decay is an L2 term of the gradient), or an optimizer registered with "
        '@linnaeus_accel.register_optimizer("name") in your script.',
    )
    WEIGHT_DECAY: NonNegativeFloat = Field(
        0.0,
        description="Weight decay of every trained parameter that NO_DECAY does not exclude. 0 (default, "
        "as linnaeus-accel has always trained; transformers' default too); nanoGPT and torchtitan use "
        "0.1. A Python optimizer factory given to the Trainer keeps its own weight_decay while this is 0.",
    )
    BETAS: Betas = Field(
        [*DEFAULT_BETAS],
        description="adamw: (beta1, beta2), the decay rates of the gradient's running mean and "
        "square; default torch's [0.9, 0.999] (transformers' adam_beta1/2); nanoGPT and torchtitan "
        "use [0.9, 0.95].",
    )
    EPS: PositiveFloat = Field(
        DEFAULT_EPS, description="adamw: added to the denominator; default torch's 1e-8 (adam_epsilon)."
    )
    MOMENTUM: Momentum = Field(0.0, description="sgd: momentum factor in [0, 1); 0 is plain SGD.")
    MUON: MuonConfig = Field(
        default_factory=MuonConfig,
        description="muon: the Muon side's settings, and which parameters it trains (MuonConfig).",
    )
    IMPLEMENTATION: Implementation = Field(
        "auto",
        description="torch's kernels for adamw and sgd: auto (torch's choice: foreach on a GPU), "
        "foreach (a few multi-tensor kernels per group), fused (one fused kernel: fastest on a GPU), "
        "for-loop (one parameter at a time). The result is the same up to float rounding.",
    )
    NO_DECAY: list[NoDecayKind] = Field(
        default_factory=list,
        description="Parameters that do not decay, by kind: bias (named bias, or *_bias as "
        "in_proj_bias), norm (of a normalization module: one whose class name contains 'Norm', as "
        "LayerNorm, RMSNorm, BatchNorm2d, GroupNorm), embedding (of a module whose class name "
        "contains 'Embedding', as nn.Embedding or a ViT's position embeddings), ndim<2 (every parameter with fewer than 2 dimensions: nanoGPT's rule, "
        "biases and norm weights). They form groups of their own at weight decay 0, each following "
        "its LR_SCHEDULER group's LR; [bias, norm, embedding] is the usual choice. Empty: all decay.",
    )
    OPTIONS: dict[str, Any] = Field(
        default_factory=dict,
        description="Further keyword arguments of the optimizer: torch's for adamw and sgd (e.g. "
        "amsgrad: true, nesterov: true), checked against its signature (a flag takes only true or false, "
        "a number only a number; unknown keys are errors) and tried in one step on the run's device at "
        "start; a registered optimizer's own.",
    )

    def problems(self) -> list[Problem]:
        problems: list[Problem] = []
        if self.NAME == "sgd":
            if tuple(self.BETAS) != DEFAULT_BETAS:
                problems.append(
                    Problem(("BETAS",), "{0} are AdamW's; SGD has MOMENTUM: remove {0}, or set NAME: adamw")
                )
            if self.EPS != DEFAULT_EPS:
                problems.append(
                    Problem(("EPS",), "{0} is AdamW's; SGD has none: remove {0}, or set NAME: adamw")
                )
        if self.NAME != "muon" and self.MUON != MuonConfig():
            problems.append(
                Problem(("MUON",), "{0} is read only with NAME: muon: set NAME: muon, or remove {0}")
            )
        if self.NAME == "muon":
            if self.MOMENTUM != 0.0:
                problems.append(
                    Problem(
                        ("MOMENTUM",), "{0} is SGD's; Muon's is MUON.MOMENTUM: remove {0}, or set it there"
                    )
                )
            if self.OPTIONS:
                problems.append(
                    Problem(
                        ("OPTIONS",),
                        "{0} is not read with NAME: muon (two optimizers): set the Muon side in MUON, the AdamW "
                        "side in BETAS, EPS, WEIGHT_DECAY and IMPLEMENTATION",
                    )
                )
        if self.NAME == "adamw" and self.MOMENTUM != 0.0:
            problems.append(
                Problem(
                    ("MOMENTUM",),
                    "{0} is SGD's; AdamW's momentum is BETAS' beta1: remove {0}, or set NAME: sgd",
                )
            )
        seen: set[str] = set()
        for kind in self.NO_DECAY:
            if kind in seen:
                problems.append(Problem(("NO_DECAY",), f"{{0}} lists {kind!r} twice: list each kind once"))
            seen.add(kind)
        for key in self.OPTIONS:
            reserved = _RESERVED_OPTIONS.get(key)
            if reserved is not None and (self.NAME in BUILTIN_OPTIMIZERS or key in ("params", "lr")):
                problems.append(Problem((f"OPTIONS.{key}",), f"{{0}} cannot be set here: {reserved}"))
        return problems
