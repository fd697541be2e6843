"""What every benchmark shares: one core and one torch thread, paired statistics, the row format.

These machines drift by +-30% between minutes, so a benchmark never compares two absolute times
taken at different moments: it alternates the two sides (one optimizer step, one checkpoint, ...)
and reports the median of the paired differences and of the paired ratios.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict


class Row(TypedDict, total=False):
    """One line of the results table (and of the JSON file)."""

    benchmark: str  # the module that measured it: "step_overhead", "checkpoint", ...
    case: str  # what was measured: "mlp", "blocked, default mode", ...
    unit: str  # what one sample is: "s per optimizer step", "s to first step", ...
    ours: float  # median of our samples (seconds)
    reference: float | None  # median of the reference's samples (seconds), None without one
    reference_name: str  # "hand-written Accelerate loop", "bare save_state", ...
    diff: float | None  # median of the paired differences ours - reference (seconds)
    ratio: float | None  # median of the paired ratios ours / reference
    n: int  # number of pairs (or of samples without a reference)
    target: str | None  # the target this row checks, in words ("ratio <= 1.10"), None if none
    ok: bool | None  # whether the target is met (None: no target)
    note: str  # anything a reader needs (skipped and why, sizes, ...)


def pin_to_one_core() -> int:
    """Run this process on one core with one torch thread (the last core: the first one takes
    most interrupts). Returns the core."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    core = cores[-1]
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    return core


def paired(ours: Sequence[float], reference: Sequence[float]) -> dict[str, Any]:
    """Medians of paired samples: ``ours[i]`` and ``reference[i]`` were taken back to back."""
    if len(ours) != len(reference) or not ours:
        raise ValueError(f"paired samples differ in number: {len(ours)} vs {len(reference)}")
    return {
        "ours": statistics.median(ours),
        "reference": statistics.median(reference),
        "diff": statistics.median(a - b for a, b in zip(ours, reference, strict=True)),
        "ratio": statistics.median(a / b for a, b in zip(ours, reference, strict=True)),
        "n": len(ours),
    }


def row(benchmark: str, case: str, unit: str, reference_name: str = "", **fields: Any) -> Row:
    """A row with the common fields filled (``fields``: the rest, e.g. ``**paired(a, b)``)."""
    out: Row = {"benchmark": benchmark, "case": case, "unit": unit, "reference_name": reference_name}
    out.update(fields)  # type: ignore[typeddict-item]
    out.setdefault("target", None)
    out.setdefault("ok", None)
    return out


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), or "" where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
