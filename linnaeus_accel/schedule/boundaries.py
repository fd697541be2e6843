"""Epoch-boundary events (docs/semantics.md §5): validation passes and checkpoints.

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
class Boundary:
    """A point where the loop asks which events are due: an epoch boundary, or (``mid``) the end of
    an optimizer step inside an epoch (docs/semantics.md §7: mid-epoch validation and checkpoints).

    ``epoch``: completed epochs at a boundary (1-based, as docs/semantics.md §5 numbers them), the epoch being
    trained mid-epoch; ``step``: global steps completed; ``previous_step``: the previous boundary's
    step (mid-epoch: ``step - 1``); ``final``: the run's last boundary (never mid-epoch)."""

    epoch: int
    step: int
    previous_step: int
    final: bool = False
    mid: bool = False


@dataclass(frozen=True)
class Interval:
    unit: Literal["epochs", "steps"]
    every: int

    def fires(self, epoch: int, step: int, previous_step: int) -> bool:
        if self.unit == "epochs":
            return epoch % self.every == 0
        return previous_step // self.every != step // self.every

    def fires_at(self, point: Boundary, at_step: bool) -> bool:
        """Whether the interval fires at ``point``. ``at_step`` (MID_EPOCH): a step interval fires at
        each multiple itself, so at a boundary only when the boundary's step is one; otherwise at
        the first boundary that crosses a multiple, never mid-epoch. An epoch interval fires at
        boundaries only."""
        if self.unit == "epochs":
            return not point.mid and point.epoch % self.every == 0
        if at_step:
            return point.step % self.every == 0
        return not point.mid and self.fires(point.epoch, point.step, point.previous_step)


def exhaustive_combinations(components: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """Every non-empty proper subset, smallest first, in the components' order."""
    return tuple(c for size in range(1, len(components)) for c in combinations(components, size))


def mask_pass_name(combination: tuple[str, ...]) -> str:
    """Metric prefix of a partial-mask pass: ``val_mask_TEMPORAL_SPATIAL``."""
    return "val_mask_" + "_".join(combination)
