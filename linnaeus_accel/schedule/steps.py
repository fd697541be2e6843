"""Step accounting (SPEC §1) and turning steps / fractions / epochs into global steps (SPEC §2).

All arithmetic on user-given fractions goes through ``Decimal(str(x))`` so that ``0.15 * 1010``
is 151.5 as written, and rounds half up to 152, instead of the binary float 151.4999...
"""

from __future__ import annotations

import math
from decimal import ROUND_FLOOR, ROUND_HALF_UP, Decimal


def batches_per_process(dataset_size: int, batch_size: int, world_size: int, drop_last: bool = False) -> int:
    """Length of the per-process dataloader once Accelerate has sharded it across processes."""
    per_step = batch_size * world_size
    return dataset_size // per_step if drop_last else math.ceil(dataset_size / per_step)


def optimizer_steps_per_epoch(batches_per_epoch: int, accumulation: int) -> int:
    # Accelerate syncs on the dataloader's last batch, so a trailing partial window is one step.
    return math.ceil(batches_per_epoch / max(1, accumulation))


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` in integers: exact for token counts beyond a float's 53 bits."""
    return -(-a // b)


def decimal_of(x: float) -> Decimal:
    return Decimal(str(x))


def round_half_up(x: Decimal) -> int:
    return int(x.to_integral_value(rounding=ROUND_HALF_UP))


def floor_fraction_of(fraction: float, steps: int) -> int:
    """``floor(fraction * steps)`` on the fraction as written (used by WSD's phase lengths)."""
    return int((decimal_of(fraction) * steps).to_integral_value(rounding=ROUND_FLOOR))


def steps_from_fraction(fraction: float, total_steps: int) -> int:
    """SPEC §2: ``f`` in (0, 1] resolves to ``max(1, round(f * T))``; 0 resolves to 0 steps."""
    if fraction <= 0:
        return 0
    return max(1, round_half_up(decimal_of(fraction) * total_steps))


def steps_from_epochs(epochs: float, steps_per_epoch: int) -> int:
    """SPEC §2: ``round(e * optimizer_steps_per_epoch)`` (epochs may be fractional)."""
    return round_half_up(decimal_of(epochs) * steps_per_epoch)


def resolve_steps(
    *, steps: int | None, fraction: float | None, epochs: float | None, total_steps: int, steps_per_epoch: int
) -> int | None:
    """The one unit that is set, in global steps; None when none is (config validation
    guarantees at most one)."""
    if steps is not None:
        return steps
    if fraction is not None:
        return steps_from_fraction(fraction, total_steps)
    if epochs is not None:
        return steps_from_epochs(epochs, steps_per_epoch)
    return None
