"""Learning rate as a pure function of the global optimizer step (docs/semantics.md §3).

``k`` is the index of the optimizer update about to be applied (0 for the first), ``W`` the warmup
length, ``P = max(1, T - W)`` the post-warmup length and ``p = k - W``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

ScheduleKind = Literal["cosine", "linear", "step", "wsd"]


@dataclass(frozen=True)
class LRCurve:
    """One parameter group's curve, every duration already resolved to steps."""

    label: str
    kind: ScheduleKind
    base_lr: float  # B: BASE_LR x batch-size scale x group multiplier (or the group's override)
    min_lr: float
    warmup_lr: float
    warmup_steps: int
    total_steps: int
    decay_every: int | None = None  # step schedule
    decay_rate: float = 0.1
    stable_steps: int = 0  # wsd: S
    decay_steps: int = 0  # wsd: D
    decay_type: Literal["cosine", "linear"] = "cosine"

    @property
    def post_warmup_steps(self) -> int:
        return max(1, self.total_steps - self.warmup_steps)

    def __call__(self, k: int) -> float:
        w = self.warmup_steps
        if k < w:
            return self.warmup_lr + (self.base_lr - self.warmup_lr) * k / w
        p, span = k - w, self.post_warmup_steps
        if self.kind == "cosine":
            return self._cosine(min(1.0, p / span))
        if self.kind == "linear":
            return self._linear(min(1.0, p / span))
        if self.kind == "step":
            if self.decay_every is None:
                return self.base_lr
            # MIN_LR is the floor of every schedule, the step schedule included.
            return max(self.min_lr, self.base_lr * self.decay_rate ** (p // self.decay_every))
        return self._wsd(p)

    # Both decays are written from MIN_LR up so that they end exactly on MIN_LR (progress 1),
    # and start exactly on the peak (progress 0), with no float residue either side.
    def _cosine(self, progress: float) -> float:
        if progress <= 0.0:
            return self.base_lr
        return self.min_lr + 0.5 * (self.base_lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))

    def _linear(self, progress: float) -> float:
        if progress <= 0.0:
            return self.base_lr
        return self.min_lr + (self.base_lr - self.min_lr) * (1.0 - progress)

    def _wsd(self, p: int) -> float:
        s, d = self.stable_steps, self.decay_steps
        if p < s:
            return self.base_lr
        if p >= s + d:
            return self.min_lr
        q = (p - s + 1) / d
        return self._cosine(q) if self.decay_type == "cosine" else self._linear(q)

    def phases(self) -> dict[str, tuple[int, int]]:
        """Inclusive [first, last] step of each non-empty phase, for summaries."""
        t, w = self.total_steps, min(self.warmup_steps, self.total_steps)
        out: dict[str, tuple[int, int]] = {}
        if w > 0:
            out["warmup"] = (0, w - 1)
        if self.kind != "wsd":
            if w < t:
                out[self.kind] = (w, t - 1)
            return out
        bounds = [
            ("stable", w, w + self.stable_steps),
            ("decay", w + self.stable_steps, w + self.stable_steps + self.decay_steps),
        ]
        end = w + self.stable_steps + self.decay_steps
        bounds.append(("min", end, t))
        for name, start, stop in bounds:
            stop = min(stop, t)
            if start < stop:
                out[name] = (start, stop - 1)
        return out
