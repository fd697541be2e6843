"""What a run ran on, recorded once at start in ``assets/run_info.json`` and in ``summary.json``:
precision, processes and machines, Accelerate's distributed type, library versions, the git
commit of the working directory, and the model (its parameter counts; the pretrained directory it
started from and the digest of its weights), so that a result can be traced to the code, weights
and setup behind it.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from torch import nn

from ..models.pretrained import weight_files, weights_digest


def model_info(model: nn.Module, init_from: dict[str, Any] | None = None) -> dict[str, Any]:
    """Parameter counts, and where a transformers model was loaded from (a local directory: its
    path and ``weights_digest``), or what MODEL.INIT_FROM loaded into it (``init_from``)."""
    parameters = list(model.parameters())
    info: dict[str, Any] = {
        "class": type(model).__name__,
        "parameters": sum(p.numel() for p in parameters),
        "trainable_parameters": sum(p.numel() for p in parameters if p.requires_grad),
    }
    loaded_from = str(getattr(model, "name_or_path", "") or "")  # "" for a model built from a config
    if loaded_from and Path(loaded_from).is_dir() and weight_files(Path(loaded_from)):
        info["pretrained"] = loaded_from
        info["pretrained_weights_xxh3"] = weights_digest(Path(loaded_from))
    if init_from is not None:
        info["init_from"] = init_from
    return info


def run_info(
    accelerator: Accelerator,
    cwd: Path | None = None,
    model: nn.Module | None = None,
    init_from: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``init_from``: what MODEL.INIT_FROM loaded into the model (``InitFrom.info()``), if anything."""
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
        **({"model": model_info(model, init_from)} if model is not None else {}),
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


def model_line(info: dict[str, Any]) -> str:
    """The model in one line of the start-up summary: what it is, where its weights come from, how
    much of it trains (a LoRA run's adapter is a small share)."""
    model = info.get("model")
    if not model:
        return ""
    total, trained = model["parameters"], model["trainable_parameters"]
    share = f" ({trained / total:.2%})" if total and trained != total else ""
    source = f" from {model['pretrained']}" if "pretrained" in model else ""
    line = f"Model:    {model['class']}{source}: {total:,} parameters, {trained:,} trained{share}"
    return line + (f"\n{init_line(model['init_from'])}" if "init_from" in model else "")


def init_line(info: dict[str, Any]) -> str:
    """The start-up summary's line for ``InitFrom.info()``."""
    left = info["left_as_built"]
    kept = f", {left:,} left as built (MODEL.INIT_IGNORE)" if left else ""
    return f"Weights:  {info['tensors_loaded']:,} tensors from {info['path']} (MODEL.INIT_FROM){kept}"
