"""A timed parameter's value in its unit, and how it becomes global steps (docs/semantics.md,
section 2). Arithmetic on user-given numbers goes through ``Decimal(str(x))`` so that ``0.15 * 1010``
is 151.5 as written, and rounds half up to 152, instead of the binary float 151.4999..."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from typing import Literal, get_args

Unit = Literal["steps", "fraction", "epochs"]
UNITS: tuple[Unit, ...] = get_args(Unit)


def decimal_of(x: float) -> Decimal:
    return Decimal(str(x))


def round_half_up(x: Decimal) -> int:
    return int(x.to_integral_value(rounding=ROUND_HALF_UP))


def steps_from_fraction(fraction: float, total_steps: int) -> int:
    """``f`` in (0, 1] resolves to ``max(1, round(f * T))``; 0 resolves to 0 steps."""
    if fraction <= 0:
        return 0
    return max(1, round_half_up(decimal_of(fraction) * total_steps))


def steps_from_epochs(epochs: float, steps_per_epoch: int) -> int:
    """``round(e * optimizer_steps_per_epoch)`` (epochs may be fractional; no ``max(1, ...)``)."""
    return round_half_up(decimal_of(epochs) * steps_per_epoch)


@dataclass(frozen=True)
class Duration:
    """A value in one unit: whole global steps, a fraction of the run's total steps, or epochs."""

    value: float
    unit: Unit

    def steps(self, total_steps: int, steps_per_epoch: int | None) -> int:
        """Global steps in a run of ``total_steps`` with ``steps_per_epoch`` optimizer steps an
        epoch (None: epochs of unknown length, which only a duration in epochs needs)."""
        if self.unit == "steps":
            return int(self.value)
        if self.unit == "fraction":
            return steps_from_fraction(self.value, total_steps)
        if steps_per_epoch is None:
            raise ValueError(f"a duration of {self.value:g} epochs needs epochs of known length")
        return steps_from_epochs(self.value, steps_per_epoch)
