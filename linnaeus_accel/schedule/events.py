"""Epoch-boundary events (SPEC §5): validation passes and checkpoints.

Epochs are counted 1-based as completed epochs. An epoch interval fires when ``e % N == 0``; a step
interval fires at the first boundary at or after each multiple of ``S``, i.e. whenever the boundary
crosses one: ``floor(previous_boundary_step / S) != floor(boundary_step / S)``. The last boundary of
a TARGET_TOKENS run is at its total step count, possibly inside its (partial) last epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Literal


@dataclass(frozen=True)
class Interval:
    unit: Literal["epochs", "steps"]
    every: int

    def fires(self, epoch: int, step: int, previous_step: int) -> bool:
        if self.unit == "epochs":
            return epoch % self.every == 0
        return previous_step // self.every != step // self.every

    def describe(self) -> str:
        return (
            f"every {self.every} {'epoch' if self.every == 1 else 'epochs'}"
            if self.unit == "epochs"
            else (f"at the first epoch boundary after every {self.every} steps")
        )


def interval_from(*, epochs: int | None, steps: int | None, fraction_steps: int | None) -> Interval | None:
    """The interval of whichever unit is set; a fraction that resolved to 0 steps disables it."""
    if epochs is not None:
        return Interval("epochs", epochs)
    if steps is not None:
        return Interval("steps", steps)
    if fraction_steps:
        return Interval("steps", fraction_steps)
    return None


def exhaustive_combinations(components: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """Every non-empty proper subset, smallest first, in the components' order."""
    return tuple(c for size in range(1, len(components)) for c in combinations(components, size))


def mask_pass_name(combination: tuple[str, ...]) -> str:
    """Metric prefix of a partial-mask pass: ``val_mask_TEMPORAL_SPATIAL``."""
    return "val_mask_" + "_".join(combination)
