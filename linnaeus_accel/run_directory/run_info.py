"""What a run ran on, recorded once at start in ``assets/run_info.json`` and in ``summary.json``:
precision, processes and machines, Accelerate's distributed type, library versions and the git
commit of the working directory, so that a result can be traced to the code and setup behind it.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from accelerate import Accelerator


def run_info(accelerator: Accelerator, cwd: Path | None = None) -> dict[str, Any]:
    state = accelerator.state
    local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    backend = getattr(getattr(state, "dynamo_plugin", None), "backend", None)
    return {
        "mixed_precision": str(accelerator.mixed_precision),
        "world_size": accelerator.num_processes,
        "machines": max(1, accelerator.num_processes // max(1, local)),
        "distributed_type": str(accelerator.distributed_type.value),
        "device": accelerator.device.type,
        "dynamo_backend": str(getattr(backend, "value", backend or "NO")),
        "versions": {
            name: _version(name) for name in ("linnaeus-accel", "torch", "accelerate", "transformers")
        },
        "python": platform.python_version(),
        "git": git_state(cwd or Path.cwd()),
    }


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def git_state(directory: Path) -> dict[str, Any] | None:
    """The commit checked out in ``directory`` and whether the tree has uncommitted changes; None
    outside a repository or without git."""
    try:
        commit = _git(directory, "rev-parse", "HEAD")
        dirty = bool(_git(directory, "status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def _git(directory: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(directory), *args],
        capture_output=True,
        text=True,
        timeout=10,  # a network filesystem may be slow; a run must not wait on it for long
        check=True,
        stdin=subprocess.DEVNULL,
    )
    return done.stdout.strip()
