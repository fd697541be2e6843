"""Probability schedules of the global step (docs/semantics.md §4): full meta-masking, partial masking, mixup."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ramp:
    """``START + (END - START) * min(1, k / E)``; 0 everywhere when disabled."""

    enabled: bool
    start_prob: float
    end_prob: float
    end_step: int  # E; 0 means END_PROB from the first step

    def __call__(self, k: int) -> float:
        if not self.enabled:
            return 0.0
        progress = 1.0 if self.end_step <= 0 else min(1.0, k / self.end_step)
        return self.start_prob + (self.end_prob - self.start_prob) * progress


DISABLED = Ramp(enabled=False, start_prob=0.0, end_prob=0.0, end_step=0)


@dataclass(frozen=True)
class PartialMasking:
    """Partial meta-masking: active on ``start_step <= k < end_step``, with its own ramp (from step
    0, not from the window start) that applies to samples not already fully masked."""

    enabled: bool
    start_step: int
    end_step: int
    prob: Ramp
    whitelist: tuple[tuple[str, ...], ...]
    weights: tuple[float, ...]

    def active(self, k: int) -> bool:
        return self.enabled and self.start_step <= k < self.end_step

    def __call__(self, k: int) -> float:
        return self.prob(k) if self.active(k) else 0.0
