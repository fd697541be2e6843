"""The global steps at which each event of a plan happens, for drawing them (``plan``'s text
timeline and ``--plot``): boundary events at their epochs' boundary steps, mid-epoch ones
(``MID_EPOCH``) at the multiples of their step interval, at most one per drawn column so that a
run of 10**7 epochs costs what its width does.

Epochs of unknown length (a stream without ``__len__``) have boundaries no one can list before the
run: only the final step and the mid-epoch multiples are known, and those are what is returned.
"""

from __future__ import annotations

from collections.abc import Callable

from ..boundaries import Interval
from ..callback_steps import callback_steps
from ..ops import EventEpochs, OpsSchedule
from ..resolved import ResolvedPlan

EVENT_KINDS = ("validation", "mask_meta_validation", "partial_mask_meta_validation", "checkpoint")


def interval_of(plan: ResolvedPlan, kind: str) -> tuple[Interval | None, bool]:
    """The interval of an event kind and whether it fires at the step itself (MID_EPOCH)."""
    if kind == "checkpoint":
        return plan.checkpoint, plan.mid_epoch_checkpoints
    interval = {
        "validation": plan.validation,
        "mask_meta_validation": plan.mask_meta_validation,
        "partial_mask_meta_validation": plan.partial_mask_meta_validation,
    }[kind]
    return interval, plan.mid_epoch_validation


def forced_at_end(plan: ResolvedPlan, kind: str) -> bool:
    """Whether the run's last boundary always has this event (docs/semantics.md §5)."""
    if kind == "checkpoint":
        return True
    if kind == "validation":
        return plan.validation is not None
    return kind == "partial_mask_meta_validation" and bool(plan.exhaustive_combinations)


def mid_epoch_multiples(plan: ResolvedPlan, kind: str) -> int | None:
    """The step interval of an event that fires at the step itself, else None."""
    interval, at_step = interval_of(plan, kind)
    return interval.every if at_step and interval is not None and interval.unit == "steps" else None


def event_steps(plan: ResolvedPlan, kind: str, columns: int) -> list[int]:
    """The steps of ``kind``'s events (``EVENT_KINDS``, or ``callback:<label>`` for a callback's
    on_step_end), the first of each of ``columns`` equal spans of the run, in order."""
    if kind.startswith("callback:"):
        label = kind.removeprefix("callback:")
        timing = next(c for c in plan.callbacks if c.label == label)
        return callback_steps(timing, columns, plan.total_steps, plan.optimizer_steps_per_epoch)
    t = plan.total_steps
    found = _boundary_steps(plan, kind, columns) if plan.known_epochs else []
    if not plan.known_epochs and forced_at_end(plan, kind):
        found.append(t)
    every = mid_epoch_multiples(plan, kind)
    if every is not None:
        if (t - 1) // every <= columns:
            found += range(every, t, every)
        else:  # one per column at most: the first multiple at or after each column's start
            found += sorted(
                {max(every, -(-(c * t // columns) // every) * every) for c in range(columns)} - {t}
            )
    by_column: dict[int, int] = {}
    for step in sorted(set(found)):
        by_column.setdefault(min(columns - 1, (step - 1) * columns // t), step)
    return list(by_column.values())


def _boundary_steps(plan: ResolvedPlan, kind: str, columns: int) -> list[int]:
    events = OpsSchedule(plan).events()
    own, exhaustive = events[kind], events["exhaustive_validation"]
    after: Callable[[int], int | None] = own.after
    if kind == "partial_mask_meta_validation":
        after = _either(own, exhaustive)
    t, ope = plan.total_steps, plan.optimizer_steps_per_epoch
    assert ope is not None
    out: list[int] = []
    epoch = after(1)
    while epoch is not None:
        step = plan.boundary_step(epoch)
        out.append(step)
        # The first epoch whose boundary falls in a later column.
        next_column_step = -(-(step * columns // t + 1) * t // columns)
        epoch = after(max(epoch + 1, -(-next_column_step // ope)))
    return out


def _either(a: EventEpochs, b: EventEpochs) -> Callable[[int], int | None]:
    return lambda e: min((x for x in (a.after(e), b.after(e)) if x is not None), default=None)


def next_event_step(plan: ResolvedPlan, kind: str, done: int) -> int | None:
    """The first step after ``done`` at which ``kind``'s event happens (``EVENT_KINDS``), or None:
    what a run resumed at step ``done`` does next (its last boundary counts when it is forced)."""
    t = plan.total_steps
    found: list[int] = []
    if plan.known_epochs and (ope := plan.optimizer_steps_per_epoch):
        events = OpsSchedule(plan).events()
        after: Callable[[int], int | None] = events[kind].after
        if kind == "partial_mask_meta_validation":
            after = _either(events[kind], events["exhaustive_validation"])
        epoch = after(done // ope + 1)
        if epoch is not None:
            found.append(plan.boundary_step(epoch))
    if forced_at_end(plan, kind):
        found.append(t)
    every = mid_epoch_multiples(plan, kind)
    if every is not None:
        found.append((done // every + 1) * every)
    return min((step for step in found if done < step <= t), default=None)
