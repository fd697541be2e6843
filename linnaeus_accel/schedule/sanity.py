"""Sanity checks: configurations that are legal but probably not what the user meant.

They are printed as warnings, never fatal (unlike the rules in ``config``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config.lr import LRSchedulerConfig
from ..config.schedule import ScheduleConfig
from ..config.sections import EarlyStopConfig, TrainConfig
from .boundaries import Interval

if TYPE_CHECKING:
    from .resolved import ResolvedPlan

LR_SCALE_WARNING = 4.0  # a scale beyond 4x either way is warned about
# TRAIN.EARLY_STOP's stopping conditions (the rule that ACTIVE needs one is config's)
EARLY_STOP_CONDITIONS = ("PATIENCE_STEPS", "MAX_STEPS", "MAX_LOSS", "MIN_LR", "MAX_GRAD_NORM")


def sanity_warnings(
    schedule: ScheduleConfig, lr_scheduler: LRSchedulerConfig, train: TrainConfig, plan: ResolvedPlan
) -> list[str]:
    out: list[str] = []
    lrc = lr_scheduler
    intervals: dict[str, Interval | None] = {
        "SCHEDULE.VALIDATION.INTERVAL_*": plan.validation,
        "SCHEDULE.VALIDATION.MASK_META_INTERVAL_*": plan.mask_meta_validation,
        "SCHEDULE.VALIDATION.PARTIAL_MASK_META.INTERVAL_*": plan.partial_mask_meta_validation,
        "SCHEDULE.CHECKPOINT.INTERVAL_*": plan.checkpoint,
    }
    for key, interval in intervals.items():
        if interval is None or (interval.unit == "epochs" and interval.every == 1):
            continue  # every epoch is as often as a boundary event can be: nothing to warn about
        ope = plan.optimizer_steps_per_epoch
        length = interval.every * (ope if interval.unit == "epochs" and ope is not None else 1)
        if length * 4 > plan.total_steps:
            before_final = (plan.total_steps - 1) // length
            out.append(
                f"{key}: an interval of {_count(interval.every, interval.unit[:-1])} is longer than a quarter of the "
                f"run ({plan.total_steps} steps), so it fires {_count(before_final, 'time')} before the final epoch"
            )
    # Mid-epoch events happen at their steps, not at boundaries: their unit does not mix.
    at_boundaries = {
        k: i
        for k, i in intervals.items()
        if not (
            plan.mid_epoch_checkpoints if k.startswith("SCHEDULE.CHECKPOINT") else plan.mid_epoch_validation
        )
    }
    if not plan.known_epochs:
        for key, interval in at_boundaries.items():
            if interval is not None:
                section = key.split(".")[1]
                out.append(
                    f"{key}: the training data is a stream without __len__, so a step interval fires only "
                    f"when a pass over it ends (where is unknown) and at the last step; set "
                    f"SCHEDULE.{section}.MID_EPOCH: true to act at the steps themselves"
                )
    units = {i.unit for i in at_boundaries.values() if i is not None}
    if len(units) > 1:
        out.append(
            "SCHEDULE: validation and checkpoint intervals mix epochs and steps; events still happen only at "
            "epoch boundaries, so consider one unit for all"
        )
    if plan.validation is None:
        out.append("SCHEDULE.VALIDATION: no INTERVAL_* is set, so the model is never validated")
    if plan.checkpoint is None:
        out.append("SCHEDULE.CHECKPOINT: no INTERVAL_* is set, so only the final epoch is checkpointed")
    # linnaeus' rule scales BASE_LR by the effective batch; far from REFERENCE_BS that is a different
    # LR than the config says (transformers' learning_rate is never scaled): say so, with the way out.
    # A REFERENCE_BS other than linnaeus' 512 is a choice, not a mistake (the shipped digits configs
    # write their BASE_LR at their own batch of 32): the plan's Batch line shows the scale anyway.
    if lrc.REFERENCE_BS is not None and not 1 / LR_SCALE_WARNING <= plan.lr_scale <= LR_SCALE_WARNING:
        peak = lrc.BASE_LR * plan.lr_scale
        out.append(
            f"LR_SCHEDULER.REFERENCE_BS: the peak LR is {peak:.3g}, not BASE_LR {lrc.BASE_LR:g}: BASE_LR is scaled by "
            f"effective batch {plan.effective_batch_size} / REFERENCE_BS {lrc.REFERENCE_BS} = {plan.lr_scale:g}; "
            "set LR_SCHEDULER.REFERENCE_BS: null to train at BASE_LR as written"
        )
    if lrc.NAME == "wsd" and lrc.STABLE_DURATION_FRACTION + lrc.DECAY_DURATION_FRACTION > 1:
        out.append(
            "LR_SCHEDULER: STABLE_DURATION_FRACTION + DECAY_DURATION_FRACTION > 1, so the decay is cut off "
            "before the LR reaches MIN_LR"
        )
    pm = plan.partial_mask
    if pm.enabled and pm.start_step >= pm.end_step:
        out.append(
            f"SCHEDULE.META_MASKING.PARTIAL: the window resolves to steps [{pm.start_step}, {pm.end_step}), "
            f"which is empty in a {plan.total_steps}-step run, so partial masking never applies"
        )
    if plan.warmup_steps >= plan.total_steps:
        out.append(
            f"LR_SCHEDULER.WARMUP_*: warmup ({plan.warmup_steps} steps) covers the whole run ({plan.total_steps} steps)"
        )
    ranking = schedule.CHECKPOINT.METRIC
    early = train.EARLY_STOP
    out += _inactive_early_stop(early)
    if early.ACTIVE and early.PATIENCE_STEPS is not None and plan.validation is None:
        out.append(
            "TRAIN.EARLY_STOP.PATIENCE_STEPS is set but validation never runs, so patience is never checked"
        )
    if ranking is not None and (schedule.CHECKPOINT.KEEP_TOP_N > 0) and plan.validation is None:
        out.append("SCHEDULE.CHECKPOINT.KEEP_TOP_N ranks by a validation metric but validation never runs")
    return out


def _inactive_early_stop(early: EarlyStopConfig) -> list[str]:
    """A stopping condition set while early stopping (``TRAIN.EARLY_STOP``) is off is never checked
    (MAX_STEPS included): silently ignored, it would read as a run that should have stopped and did not."""
    keys = [f"TRAIN.EARLY_STOP.{c}" for c in EARLY_STOP_CONDITIONS if getattr(early, c) is not None]
    if early.ACTIVE or not keys:
        return []
    one = len(keys) == 1
    return [
        f"{' and '.join(keys)} {'is' if one else 'are'} set but TRAIN.EARLY_STOP.ACTIVE is false, so "
        f"{'it is' if one else 'they are'} never checked: set TRAIN.EARLY_STOP.ACTIVE: true to stop on "
        f"{'it' if one else 'them'}, or leave {'it' if one else 'them'} out"
    ]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
