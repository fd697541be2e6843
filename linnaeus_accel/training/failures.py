"""Why a run stopped before its end, in words a user can act on.

``RunFailed``: the run cannot go on and every process knows it (a non-finite loss, a checkpoint
that could not be written); ``summary.json`` says ``status: failed`` and the command exits 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line imports this module; torch loads only when training
    import torch


class RunFailed(RuntimeError):
    """Every process stops; the message says why, what was kept and what to do."""


def parameters_finite(parameters: Iterable[torch.Tensor]) -> bool:
    """Whether every parameter value is finite (a read of all of them: for checkpoint time)."""
    import torch

    checks = [torch.isfinite(p).all() for p in parameters]
    return bool(torch.stack(checks).all()) if checks else True


def collective_timeout(exc: BaseException, timeout_s: float | None) -> str | None:
    """The message for a collective operation that timed out (another process stopped
    answering), or None when ``exc`` is something else."""
    text = str(exc)
    if "timed out" not in text.lower() and "timeout" not in text.lower():
        return None
    waited = f" for {timeout_s:g} s (ENV.DIST_TIMEOUT_S)" if timeout_s and math.isfinite(timeout_s) else ""
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return (
        f"waited{waited} for another process that stopped answering or died; this process stops too. "
        f"torch: {first}"
    )
