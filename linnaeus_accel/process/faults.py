"""Named fault points, for tests that must hit a run at an exact moment (a training step, inside
a validation pass, inside a checkpoint write) rather than at a random time.

``LINNAEUS_ACCEL_KILL_AT=validation_pass:3`` makes the process SIGKILL itself the third time it
reaches the point ``validation_pass``; ``LINNAEUS_ACCEL_TERM_AT`` sends it SIGTERM instead (a
preemption notice arriving at that instant) and ``LINNAEUS_ACCEL_HANG_AT`` makes it stop answering
(sleep forever), ``LINNAEUS_ACCEL_RAISE_AT`` makes it raise a ``RuntimeError`` (a bug in a user's
code on that process). ``LINNAEUS_ACCEL_FAULT_RANK=1`` limits them to the process of that rank. Unset
(always, outside tests), a point costs one comparison.

``LINNAEUS_ACCEL_FAULT_AFTER=checkpoint_committed:1``: a fault, once its point is reached, waits
there until this process has reached that other point so many times. Checkpoints commit on a
background thread, so "killed at step 11, after the checkpoint of step 8" needs it: on a loaded
machine the commit can come after step 11, and the step then waits for it (on the main process,
which commits; the others fire at once, as without it).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _term() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def _raise() -> None:
    raise RuntimeError("fault point reached (LINNAEUS_ACCEL_RAISE_AT)")


def _hang() -> None:
    # The launcher's SIGTERM still ends it (default action): a process stuck in native code would
    # ignore it and be SIGKILLed after torchelastic's 30 s grace, which tests need not wait for.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        time.sleep(3600)


_ACTIONS: dict[str, Callable[[], None]] = {
    "LINNAEUS_ACCEL_KILL_AT": _kill,
    "LINNAEUS_ACCEL_TERM_AT": _term,
    "LINNAEUS_ACCEL_HANG_AT": _hang,
    "LINNAEUS_ACCEL_RAISE_AT": _raise,
}


def _armed() -> dict[str, tuple[int, Callable[[], None]]]:
    """point name -> (the n-th time it is reached, what happens then), for this process."""
    rank = os.environ.get("LINNAEUS_ACCEL_FAULT_RANK")
    if rank is not None and rank != os.environ.get("RANK", "0"):
        return {}
    armed = {}
    for variable, action in _ACTIONS.items():
        name, _, count = os.environ.get(variable, "").partition(":")
        if name:
            armed[name] = (int(count or 1), action)
    return armed


def _gate() -> tuple[str, int] | None:
    """Only the main process waits: it is the one that commits (another process would wait for
    commits it never makes, and outlive its launcher's SIGTERM)."""
    name, _, count = os.environ.get("LINNAEUS_ACCEL_FAULT_AFTER", "").partition(":")
    return (name, int(count or 1)) if name and os.environ.get("RANK", "0") == "0" else None


def _never() -> None:
    raise AssertionError("a gate point only counts")


_ARMED = _armed()
_GATE = _gate() if _ARMED else None
if _GATE is not None:  # counted as an armed point is (so an unarmed one still costs one lookup)
    _ARMED.setdefault(_GATE[0], (sys.maxsize, _never))
_seen: Counter[str] = Counter()

POINTS = (
    "optimizer_step",
    "validation_batch",
    "validation_pass",
    "checkpoint_staged",
    "checkpoint_committed",
    "rollback",
)


def fault_point(name: str) -> None:
    if name in _ARMED:
        _reached(name)


def _reached(name: str) -> None:
    _seen[name] += 1
    at, action = _ARMED[name]
    if _seen[name] != at:
        return
    if _GATE is not None:
        _wait_for(*_GATE)
    action()


def _wait_for(point: str, count: int, timeout_s: float = 120.0) -> None:
    """Hold this thread (the loop) until another (the checkpoint writer's) has reached ``point``
    ``count`` times; past ``timeout_s`` the fault fires anyway, and the test sees where it landed."""
    deadline = time.monotonic() + timeout_s
    while _seen[point] < count and time.monotonic() < deadline:
        time.sleep(0.005)
