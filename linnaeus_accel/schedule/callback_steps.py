"""When each callback of ``CALLBACKS`` runs its ``on_step_end``: resolved once from its INTERVAL_*
into a ``CallbackTiming``, a pure function of the global step.

- no INTERVAL_*: after every optimizer step;
- INTERVAL_STEPS S (or INTERVAL_FRACTION f, S = max(1, round(f x T)); 0 resolves to never): at every
  multiple of S, inside epochs too (as MID_EPOCH events do);
- INTERVAL_EPOCHS N: at the last step of every N-th epoch (``epoch % N == 0``, the run's last epoch
  counted at its last step even when partial); refused for epochs of unknown length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from ..config.callbacks import CallbackConfig


@dataclass(frozen=True)
class CallbackTiming:
    label: str  # the callback's NAME, with #<n> from the second of a name on
    unit: Literal["step", "steps", "epochs", "never"]
    every: int = 1

    def describe(self) -> str:
        if self.unit == "step":
            return "after every optimizer step"
        if self.unit == "never":
            return "never (its interval resolved to 0 steps)"
        return (
            f"every {self.every} {self.unit}"
            if self.unit == "steps"
            else f"at the end of every {self.every} epochs"
        )


def resolve_callbacks(entries: list[CallbackConfig], total_steps: int) -> tuple[CallbackTiming, ...]:
    out: list[CallbackTiming] = []
    seen: dict[str, int] = {}
    for entry in entries:
        seen[entry.NAME] = seen.get(entry.NAME, 0) + 1
        label = entry.NAME if seen[entry.NAME] == 1 else f"{entry.NAME}#{seen[entry.NAME]}"
        interval = entry.INTERVAL
        if interval is None:
            out.append(CallbackTiming(label, "step"))
        elif interval.unit == "epochs":
            out.append(CallbackTiming(label, "epochs", int(interval.value)))
        else:
            every = interval.steps(total_steps, None)  # in steps or a fraction: no epoch length needed
            out.append(CallbackTiming(label, "steps", every) if every else CallbackTiming(label, "never", 0))
    return tuple(out)


def next_call(timing: CallbackTiming, step: int, total_steps: int, steps_per_epoch: int | None) -> int | None:
    """The first global step after ``step`` at which ``timing`` calls ``on_step_end`` in a run of
    ``total_steps`` (``steps_per_epoch``: optimizer steps an epoch, None when unknown); None when
    there is none left in the run. The loop compares one int per step against it."""
    t = total_steps
    if step >= t or timing.unit == "never":
        return None
    if timing.unit == "step":
        return step + 1
    if timing.unit == "steps":
        due = (step // timing.every + 1) * timing.every
        return due if due <= t else None
    ope = steps_per_epoch
    if ope is None:
        raise ValueError("INTERVAL_EPOCHS needs epochs of known length")
    n = timing.every
    epoch = (step // ope + 1 + n - 1) // n * n  # the first multiple of N whose boundary is after step
    if (epoch - 1) * ope >= t:
        return None  # that epoch is past the run's end
    return min(epoch * ope, t)  # the run's last epoch ends at T, partial or not


def callback_steps(
    timing: CallbackTiming, columns: int, total_steps: int, steps_per_epoch: int | None
) -> list[int]:
    """The steps at which ``timing`` fires, at most the first of each of ``columns`` equal spans of
    the run (for ``plan``'s timeline and plot)."""
    t, found, step = total_steps, [], 0
    while (due := next_call(timing, step, total_steps, steps_per_epoch)) is not None:
        found.append(due)
        column = min(columns - 1, (due - 1) * columns // t)
        step = max(due, -(-((column + 1) * t) // columns))  # the next call in a later column
    return found
