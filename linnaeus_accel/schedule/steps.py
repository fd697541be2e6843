"""Step accounting (docs/semantics.md §1). Turning steps / fractions / epochs into global steps is
``linnaeus_accel.config.duration``'s (a ``Duration`` resolves itself); its rounding is re-exported
here for the data and schedule modules."""

from __future__ import annotations

import math
from decimal import ROUND_FLOOR

from ..config.duration import decimal_of as decimal_of
from ..config.duration import round_half_up as round_half_up
from ..config.duration import steps_from_epochs as steps_from_epochs
from ..config.duration import steps_from_fraction as steps_from_fraction


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


def floor_fraction_of(fraction: float, steps: int) -> int:
    """``floor(fraction * steps)`` on the fraction as written (used by WSD's phase lengths)."""
    return int((decimal_of(fraction) * steps).to_integral_value(rounding=ROUND_FLOOR))
