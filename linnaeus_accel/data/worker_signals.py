"""DataLoader workers outlive a job-wide SIGTERM, SIGUSR1 or SIGINT; the main process ends them.

Batch schedulers (Slurm's preemption and scancel, most job runners) and a terminal's Ctrl-C signal
every process of the job, DataLoader workers included. torch's worker installs a C handler that
dies of SIGTERM, and its death makes the main process raise "DataLoader worker is killed" in
whatever it is running: a preempted run would fail before it could finish its step and checkpoint.
The main process decides when its workers end: it shuts them down (a ``None`` on their queue, then
``terminate()`` for one that does not exit), and they exit by themselves once it dies (torch's
watchdog). So in a worker:

- SIGINT and SIGUSR1 are ignored: the main process alone acts on them.
- SIGTERM is blocked and taken by a thread: one from the main process (``terminate()``, by torch's
  shutdown or by multiprocessing's at exit) ends the worker at once, as torch's handler does; any
  other is dropped. Ignoring it outright would leave a worker that ``terminate()`` cannot end, and
  an exiting main process joining it forever. Where the sender cannot be told (no
  ``sigwaitinfo``: macOS), SIGTERM keeps torch's handler.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

WorkerInit = Callable[[int], None]


def _end_on_parents_sigterm(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent:
            os._exit(0)  # as torch's handler does: the worker holds nothing to flush


def shield_this_worker() -> None:
    """Called first in a worker: see the module docstring. Threads the worker starts later inherit
    the blocked SIGTERM, so the waiting thread is the only one it can reach."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    parent = os.getppid()  # the DataLoader's process, as torch's watchdog takes it
    threading.Thread(target=_end_on_parents_sigterm, args=(parent,), name="sigterm", daemon=True).start()


class ShieldedInit:
    """A ``worker_init_fn`` that shields the worker, then runs the loader's own (picklable, for
    the ``spawn`` start method, when that one is)."""

    def __init__(self, inner: WorkerInit | None) -> None:
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        shield_this_worker()
        if self.inner is not None:
            self.inner(worker_id)


def shield_workers(loader: Any) -> None:
    """Make ``loader``'s workers shielded, keeping its ``worker_init_fn``; idempotent. Accelerate's
    ``prepare`` keeps the attribute when it re-creates the loader."""
    if getattr(loader, "num_workers", 0) > 0 and not isinstance(loader.worker_init_fn, ShieldedInit):
        loader.worker_init_fn = ShieldedInit(loader.worker_init_fn)
