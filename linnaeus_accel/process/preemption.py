"""Preemption (SLURM, spot instances): on SIGTERM or SIGUSR1 the run finishes the optimizer step in
progress, checkpoints it, records ``status: preempted`` and exits 0 on every process. Ctrl-C (SIGINT)
does the same, recorded as ``status: interrupted`` (exit 130, the shell's status for Ctrl-C): no work
since the last checkpoint is lost; a second Ctrl-C stops at once.

Every process must stop at the same step (saving is collective), so with several processes the
flag is agreed on, without ever waiting for the device: the flags are summed by an all-reduce of a
host tensor over a gloo group of their own, started every ``check_every`` optimizer steps and read
at the next such step (by then it has long finished; reading it waits for nothing but the slowest
process, which the step's own all-reduce waits for anyway). A signal is so acted on within
``2 x check_every`` steps. At an epoch's last step and between validation passes (``now``), where one
more wait costs nothing, the flag is agreed on at once.

Send the signal to every training process (SLURM's ``--signal``, ``scancel`` and schedulers'
preemption notices do); signalling ``accelerate launch`` itself makes torchelastic exit non-zero
whatever its processes do. A signal that reaches the whole job reaches DataLoader workers too: they
ignore it (``data.worker_signals``) and are shut down by their process after it has checkpointed.
Grace periods (tens of seconds) cover the few steps until the next check.
"""

from __future__ import annotations

import signal
import threading
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class PreemptionWatch:
    def __init__(self, accelerator: Accelerator, check_every: int = 10, timeout_s: float = 600.0) -> None:
        """Collective with several processes (it creates their gloo group): every process builds
        it at the same point. ``timeout_s``: how long an agreement waits for the other processes."""
        self.accelerator = accelerator
        self.processes = accelerator.num_processes
        self.check_every = 1 if self.processes == 1 else check_every
        self.requested = False
        self.interrupted = False  # the stop was asked for by Ctrl-C (SIGINT), not a scheduler
        self._previous: dict[int, Any] = {}
        self._group: Any = None
        self._pending: tuple[Any, torch.Tensor] | None = None  # the started all-reduce and its flag
        if self.processes > 1:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is threading.main_thread():  # signals only reach the main thread
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._pending is not None and exc[0] is None:  # every process started it: all finish it
            self._pending[0].wait()
        self._pending = None
        if self._group is not None and exc[0] is None:
            # Its threads must not outlive the run (gloo's, left at exit, can abort the interpreter).
            dist.destroy_process_group(self._group)
            self._group = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            if self.interrupted:  # the second Ctrl-C: the user will not wait for the checkpoint
                raise KeyboardInterrupt
            self.interrupted = True
            if self.accelerator.is_local_main_process:
                print(
                    "\nCtrl-C: finishing this step and checkpointing it (press Ctrl-C again to stop at once, "
                    "losing the work since the last checkpoint)",
                    flush=True,
                )
        self.requested = True

    @property
    def reason(self) -> str:
        """Why the run stops, in words (for its last line)."""
        return "interrupted by Ctrl-C" if self.interrupted else "preempted by a signal"

    def should_stop(self, global_step: int, now: bool = False) -> bool:
        """Whether every process agrees to stop after this optimizer step (``now``: agree at once,
        e.g. between validation passes, where one more wait costs nothing). Every process asks at
        the same steps."""
        if self.processes == 1:
            return self.requested
        if now:
            agreed = self._collect()
            flag = self._flag()
            dist.all_reduce(flag, group=self._group)
            return agreed or _raised(flag)
        if global_step % self.check_every:
            return False
        agreed = self._collect()
        flag = self._flag()
        self._pending = (dist.all_reduce(flag, group=self._group, async_op=True), flag)
        return agreed

    def _flag(self) -> torch.Tensor:
        return torch.tensor([1.0 if self.requested else 0.0])  # on the host: no device is involved

    def _collect(self) -> bool:
        """The answer of the all-reduce started at the previous check (none: no stop)."""
        if self._pending is None:
            return False
        work, flag = self._pending
        self._pending = None
        work.wait()
        return _raised(flag)


def _raised(flag: torch.Tensor) -> bool:
    # Read through NumPy: the value is on the host already, and no tensor op runs for it.
    return bool(flag.numpy()[0] > 0)
