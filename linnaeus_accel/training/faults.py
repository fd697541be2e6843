"""Named fault points, for tests that must kill a run at an exact moment (a training step, inside
a validation pass, inside a checkpoint write) rather than at a random time.

``LINNAEUS_ACCEL_KILL_AT=validation_pass:3`` makes the process SIGKILL itself the third time it
reaches the point ``validation_pass``. Unset (always, outside tests), a point costs one comparison.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

_SPEC = os.environ.get("LINNAEUS_ACCEL_KILL_AT", "")
_NAME, _, _COUNT = _SPEC.partition(":")
_AT = int(_COUNT or 1) if _NAME else 0
_seen: Counter[str] = Counter()

POINTS = ("optimizer_step", "validation_pass", "checkpoint_staged", "checkpoint_committed")


def fault_point(name: str) -> None:
    if name != _NAME:
        return
    _seen[name] += 1
    if _seen[name] == _AT:
        os.kill(os.getpid(), signal.SIGKILL)
