"""Preemption (SLURM, spot instances): on SIGTERM or SIGUSR1 the run finishes the optimizer step in
progress, checkpoints it, records ``status: preempted`` and exits 0 on every process.

Every process must stop at the same step (saving is collective), so with several processes the
flag is agreed on by an all-reduce every ``check_every`` optimizer steps (a host sync, kept off
most steps) and between validation passes. Send the signal to every training process (SLURM's
``--signal``, ``scancel`` and schedulers' preemption notices do); signalling ``accelerate launch``
itself makes torchelastic exit non-zero whatever its processes do. A signal that reaches the whole
job reaches DataLoader workers too: they ignore it (``data.worker_signals``) and are shut down by
their process after it has checkpointed. Grace periods (tens of seconds) cover the few steps until
the next check.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
from accelerate import Accelerator

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatch:
    def __init__(self, accelerator: Accelerator, check_every: int = 10) -> None:
        self.accelerator = accelerator
        self.check_every = 1 if accelerator.num_processes == 1 else check_every
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is threading.main_thread():  # signals only reach the main thread
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def should_stop(self, global_step: int, now: bool = False) -> bool:
        """Whether every process agrees to stop after this optimizer step (``now``: agree at once,
        e.g. between validation passes, where one more collective costs nothing)."""
        if self.accelerator.num_processes == 1:
            return self.requested
        if global_step % self.check_every and not now:
            return False
        flag = torch.tensor([1.0 if self.requested else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, reduction="sum").item() > 0)
