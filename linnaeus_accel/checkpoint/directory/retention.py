"""Which checkpoints retention keeps (docs/semantics.md §6): a pure function, so the rule is testable on its own.

The union of the ``keep_top`` best (by the ranking metric) and the ``keep_last`` most recent; the
newest checkpoint, the best one and every protected one (the checkpoint a run resumed from) are
always kept; ``keep_top == keep_last == 0`` keeps everything. linnaeus' defaults deleted every epoch
checkpoint; deleting the only good copy is the one mistake retention must never make.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Literal

Mode = Literal["min", "max"]


def retained(
    checkpoints: Sequence[tuple[int, float | None]],
    keep_top: int,
    keep_last: int,
    mode: Mode,
    protect: Collection[int] = (),
) -> set[int]:
    """The steps to keep among ``checkpoints`` = ``(step, metric)`` pairs (any order).

    ``metric`` is the ranking metric of the validation that followed the checkpoint, ``None`` while
    it is not known yet. ``None`` and non-finite values never count as best: a NaN loss is no
    reason to keep a checkpoint, and ``-inf`` would otherwise be "best" under ``min``.
    Ties in the metric go to the newer step (it carries more training for the same score).
    Steps in ``protect`` that are not among ``checkpoints`` are ignored.
    """
    if keep_top < 0 or keep_last < 0:
        raise ValueError(f"keep_top and keep_last must be >= 0, got {keep_top} and {keep_last}")
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    steps = [step for step, _ in checkpoints]
    if len(set(steps)) != len(steps):
        raise ValueError(f"duplicate steps in {sorted(steps)}")
    if not steps:
        return set()
    if keep_top == 0 and keep_last == 0:
        return set(steps)

    newest_first = sorted(steps, reverse=True)
    keep = set(newest_first[:keep_last])
    keep.add(newest_first[0])

    sign = 1.0 if mode == "min" else -1.0
    ranked = sorted(
        (
            (sign * metric, -step, step)
            for step, metric in checkpoints
            if metric is not None and math.isfinite(metric)
        ),
    )
    # The single best is kept even with keep_top == 0: docs/semantics.md §6 never deletes the best.
    keep.update(step for _, _, step in ranked[: max(1, keep_top)])

    keep.update(set(protect) & set(steps))
    return keep
