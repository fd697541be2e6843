"""Why a run stops before its end: early stopping's rules, ``MAX_STEPS``, a preemption."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class StopReason(str, Enum):
    """Why a run stops before its end; the value is what summary.json's ``stop_reason`` says."""

    PATIENCE = "patience"
    MAX_LOSS = "max_loss"
    NOT_FINITE = "not_finite"
    MIN_LR = "min_lr"
    MAX_GRAD_NORM = "max_grad_norm"
    MAX_STEPS = "max_steps"
    PREEMPTED = "preempted"  # a signal: the run goes on when rerun


@dataclass(frozen=True)
class StopDecision:
    reason: StopReason
    message: str
