"""A process that ran gloo collectives exits cleanly, not with SIGABRT after a finished run.

gloo runs each collective on a thread of its own (``pt_gloo_runloop``), which drops its reference to
the collective's work object just after marking it complete. A work started during ``backward()``
(DDP's gradient all-reduce) holds a Python object (the context torch stashes for the backward), so
dropping the last reference takes the GIL. The main thread, woken by the completion, can reach the
interpreter's shutdown before that thread ran again (seen on a loaded machine, ~1 exit in 50 with 2
processes of a plain DDP script): the thread then asks for the GIL of an interpreter that is
finalizing, Python 3.11 ends it with ``pthread_exit``, and the unwinding through torch's ``noexcept``
destructor calls ``std::terminate`` ("terminate called without an active exception", exit -6), which
makes the launcher report the whole run as failed. ``destroy_process_group`` does not end those
threads: DDP keeps the process group alive until the process ends.

The fix is to wait, at exit while the interpreter is whole, until no gloo thread is runnable: the
main thread sleeps (releasing the GIL) in short polls of the threads' scheduler states. A finished
run pays a few milliseconds at exit, once.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path

GLOO_THREADS = ("pt_gloo_runloop",)  # the threads that run collectives
POLL_S = 0.002
QUIET_POLLS = 3  # consecutive polls with every gloo thread asleep
LIMIT_S = 2.0  # never hold an exit longer than this

_registered = False


def settle_gloo_threads_at_exit() -> None:
    """Register, once per process, the wait described in the module docstring (Linux: it reads
    ``/proc``; a no-op elsewhere)."""
    global _registered
    if _registered or not sys.platform.startswith("linux"):
        return
    _registered = True
    atexit.register(wait_for_gloo_threads)


def wait_for_gloo_threads(limit_s: float = LIMIT_S) -> bool:
    """Sleep in short polls until every gloo thread of this process has been asleep (waiting for
    work) for ``QUIET_POLLS`` polls in a row, or ``limit_s`` passed. Whether they settled."""
    deadline = time.monotonic() + limit_s
    quiet = 0
    while quiet < QUIET_POLLS:
        time.sleep(POLL_S)  # releases the GIL: a thread waiting for it to drop a work object goes on
        quiet = quiet + 1 if not _gloo_thread_runnable() else 0
        if time.monotonic() > deadline:
            return False
    return True


def _gloo_thread_runnable() -> bool:
    for task in _tasks():
        try:
            name = (task / "comm").read_text().strip()
            if name not in GLOO_THREADS:
                continue
            # /proc/<pid>/task/<tid>/stat: "tid (comm) state ..."; comm may hold spaces, not ")".
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        if state == "R":
            return True
    return False


def _tasks() -> list[Path]:
    try:
        return list(Path(f"/proc/{os.getpid()}/task").iterdir())
    except OSError:
        return []
