"""Shared test helpers."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path

# One torch thread per test process, and for every process a test starts: pytest-xdist runs as many
# test processes as there are cores, and the tests launch training processes of their own, so torch's
# default of a thread per core oversubscribes the cores. OpenMP threads that spin waiting for each
# other on a busy core made in-process training ~8x slower under `-n 2` (test_default_config_...
# 11 s alone, 107 s in the suite). Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO / "configs" / "default.yaml"


@pytest.fixture
def default_config_path() -> Path:
    return DEFAULT_CONFIG


def run_cli(*args: str) -> tuple[int, str, str]:
    """Run ``linnaeus-accel ARGS`` in-process; (exit status, stdout, stderr).

    Works inside hypothesis tests too (no function-scoped fixture needed)."""
    from linnaeus_accel.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as exc:  # argparse usage errors
            rc = exc.code if isinstance(exc.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


def reset_accelerate() -> None:
    """Forget Accelerate's process-wide state, so that the next Accelerator starts fresh."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    """Use with ``pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")`` in modules that
    build Accelerators in-process."""
    reset_accelerate()
    yield
    reset_accelerate()
