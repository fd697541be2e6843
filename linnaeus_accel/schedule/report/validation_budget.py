"""What a validation pass reads (``SCHEDULE.VALIDATION.MAX_BATCHES``), as ``plan`` states it.

The plan knows the training data only: the validation split's size is not known here, so the
budget is given in batches and samples per pass, at most (a smaller split is read whole).
"""

from __future__ import annotations

from typing import Any

from ...config.schedule import ValidationSchedule
from ..resolved import ResolvedPlan


def validation_budget(
    validation: ValidationSchedule, batch: int, plan: ResolvedPlan
) -> dict[str, Any] | None:
    """The budget of a validation pass (``SCHEDULE.VALIDATION``, in batches of ``batch`` samples per
    process: ``DATA.BATCH_SIZE_VAL or DATA.BATCH_SIZE``), or None when every pass reads the whole split."""
    if validation.MAX_BATCHES is None:
        return None
    return {
        "max_batches_per_process": validation.MAX_BATCHES,
        "batch_size": batch,
        "max_samples": validation.MAX_BATCHES * batch * plan.world_size,
        "final_whole_split": validation.FINAL_EPOCH.WHOLE_SPLIT,
    }


def validation_budget_line(validation: ValidationSchedule, batch: int, plan: ResolvedPlan) -> list[str]:
    """The summary's line on it: none when every pass reads the whole split."""
    budget = validation_budget(validation, batch, plan)
    if budget is None:
        return []
    procs = f"{plan.world_size} process{'es' if plan.world_size > 1 else ''}"
    final = "final validation on the whole split" if budget["final_whole_split"] else "the final one too"
    return [
        f"Validation data:       {budget['max_batches_per_process']} batches per process per pass "
        f"(at most {budget['max_samples']:,} samples: batch {budget['batch_size']} x {procs}), "
        f"a fixed seeded subset; {final}"
    ]
