"""What ``plan`` says of rollbacks (TRAIN.NONFINITE: rollback, TRAIN.LOSS_SPIKE): how far one goes
back, what it skips, and how it moves the run's end (it does not: docs/semantics.md §8)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config.sections import TrainConfig

if TYPE_CHECKING:
    from .resolved import ResolvedPlan


def rolls_back(train: TrainConfig) -> bool:
    return train.NONFINITE == "rollback" or train.LOSS_SPIKE.ACTION == "rollback"


def checkpoint_every(plan: ResolvedPlan) -> int | None:
    """Steps between two checkpoints (the first comes at or after this step), when known."""
    interval = plan.checkpoint
    if interval is None or interval.every <= 0:
        return None
    if interval.unit == "epochs":
        ope = plan.optimizer_steps_per_epoch
        return interval.every * ope if ope is not None else None
    return int(interval.every)


def rollback_lines(train: TrainConfig, plan: ResolvedPlan) -> list[str]:
    """The plan's lines on loss spikes and rollbacks (none when neither is on)."""
    spike, rollback = train.LOSS_SPIKE, train.ROLLBACK
    lines = []
    if spike.ACTION != "off":
        lines.append(
            f"Loss spikes:     a record's loss over {spike.FACTOR:g}x the mean of the {spike.WINDOW} records "
            f"before it, {spike.CONSECUTIVE} in a row (records every {plan.metrics_interval} steps): {spike.ACTION}"
        )
    if not rolls_back(train):
        return lines
    on = " and ".join(
        what
        for what, active in (
            ("a NaN or infinite loss or gradient norm", train.NONFINITE == "rollback"),
            ("a loss spike", spike.ACTION == "rollback"),
        )
        if active
    )
    every = checkpoint_every(plan)
    back = (
        f"checkpoints every {every} steps, records every {plan.metrics_interval}: up to about "
        f"{every + plan.metrics_interval * spike.CONSECUTIVE} steps redone"
        if every is not None
        else "checkpoints at epoch ends"
    )
    lines += [
        f"Rollback:        on {on}: back to the newest checkpoint before the window ({back}), that data "
        f"skipped plus {rollback.SKIP_STEPS} more steps' worth; at most {rollback.MAX} rollbacks, then the run stops",
        f"                 the run still ends at step {plan.total_steps} on the data the plan says; the steps "
        "rolled back or skipped make no update (each rollback costs its span of optimizer updates)",
    ]
    return lines


def rollback_warnings(train: TrainConfig, plan: ResolvedPlan) -> list[str]:
    """A rule that can never act in this run, a rollback that cannot happen, or only far back."""
    total, out = plan.total_steps, []
    spike = train.LOSS_SPIKE
    if spike.ACTION != "off":
        # The rule compares a record with the WINDOW records before it, CONSECUTIVE times in a row.
        first = (spike.WINDOW + spike.CONSECUTIVE) * plan.metrics_interval
        if first > total:
            out.append(
                f"TRAIN.LOSS_SPIKE.WINDOW: the spike rule needs {spike.WINDOW} records before it can find "
                f"a spike ({spike.CONSECUTIVE} more in a row), a record every {plan.metrics_interval} steps: "
                f"step {first} at the earliest, past this run's {total} steps, so it never acts; lower "
                "TRAIN.LOSS_SPIKE.WINDOW or SCHEDULE.METRICS.STEP_INTERVAL"
            )
    if not rolls_back(train):
        return out
    if train.ROLLBACK.SKIP_STEPS >= total:
        out.append(
            f"TRAIN.ROLLBACK.SKIP_STEPS: {train.ROLLBACK.SKIP_STEPS} steps skipped after a rollback is at "
            f"least this run's {total} steps: a rollback would leave no step of the run to train; lower it"
        )
    key = "TRAIN.NONFINITE" if train.NONFINITE == "rollback" else "TRAIN.LOSS_SPIKE.ACTION"
    every = checkpoint_every(plan)
    if every is not None and every >= total:
        out.append(
            f"{key}: rollback needs a checkpoint to go back to, and the first one comes at the run's end "
            f"(every {every} steps in a {total}-step run): set SCHEDULE.CHECKPOINT.INTERVAL_STEPS lower"
        )
    elif every is not None and every * 4 > total:
        out.append(
            f"{key}: checkpoints every {every} steps of {total}: a window that goes wrong before step "
            f"{every} cannot be rolled back (the run stops), and a rollback redoes up to {every} steps"
        )
    elif plan.checkpoint is not None and plan.checkpoint.unit == "epochs":
        at = f"step {every}" if every is not None else f"the end of epoch {plan.checkpoint.every:g}"
        out.append(
            f"{key}: checkpoints only at epoch ends: a NaN or spike before the first one ({at}) cannot be "
            "rolled back (the run stops there); set SCHEDULE.CHECKPOINT.INTERVAL_STEPS with MID_EPOCH true "
            "for checkpoints inside the first epochs"
        )
    return out
