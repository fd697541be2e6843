"""Recording the reads of tensor values back to the host (``.item()``, ``float(t)``, ``bool(t)``,
``.tolist()``) and where they were made: the per-step path of the training loop must make none
outside the steps that read the device anyway."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READ_BACK_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default"}
# Where reading a value back is expected: logging steps, validation, epoch and run boundaries.
ALLOWED = {"flush", "run_pass", "epoch_boundary", "_start", "_finish", "__iter__", "__init__"}
# torch.optim reads its own step counters, which live on the host even when the model is on a GPU
# (non-capturable optimizers), so those reads are not device syncs.
OPTIMIZER_DIR = str(Path(torch.optim.__file__).parent)


class ReadBackRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if str(func) in READ_BACK_OPS:
            frame, names, files = sys._getframe(1), [], []
            while frame is not None:
                names.append(frame.f_code.co_name)
                files.append(frame.f_code.co_filename)
                frame = frame.f_back  # type: ignore[assignment]
            if not any(f.startswith(OPTIMIZER_DIR) for f in files):
                self.calls.append(names)
        return func(*args, **(kwargs or {}))


def in_steps(calls: list[list[str]]) -> list[list[str]]:
    """The read-backs made in the per-step path of ``_train_epoch``, outside ``ALLOWED``."""
    return [stack for stack in calls if "_train_epoch" in stack and not ALLOWED.intersection(stack)]
