"""A launched process never outlives its launcher, and never waits past ``ENV.DIST_TIMEOUT_S`` to
join the others.

torchelastic (``accelerate launch``, ``torchrun``) starts each worker in a session of its own, so
``kill -9`` of the launcher's process group (what a user, a job script or a scheduler without
cgroups does) leaves the workers training on to the end, holding the output directory's lock and,
on rank 0, possibly the rendezvous port: a rerun then either found the directory in use or hung
joining the process group (seen: 15 minutes in gloo's ``connectFullMesh``). So a launched process
watches its parent and stops, as the launcher did, the moment it is gone: its last checkpoint stays
the resume point, as after any ``kill -9``.

Why a poll of the parent pid rather than ``prctl(PR_SET_PDEATHSIG)``: the kernel sends that signal
when the *thread* that forked the process ends, not the process; a launcher that starts workers
from a thread it later ends would kill healthy workers. A poll each second costs nothing measurable
(one ``getppid`` on a thread that is asleep otherwise) and reacts well within the 10 s a user
waits.

A refusal (exit 2, nothing done) is met by every process alike and said once, by the local main
process (``report_refusal``). torchelastic then reports the failed workers in a ``ChildFailedError``
traceback and exits 1 (``accelerate launch`` re-raises it; no worker's exit status changes either);
its root cause shows that worker's error file, or else a pointer to a page on recording tracebacks.
So the main process's error file says that it refused and where the reason is, without repeating
the reason: the user reads that once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ..json_files import write_json

POLL_S = 1.0
EXIT_FAILED = 1
# How long a process that does not say a refusal (or a failure) waits for the one that does: the
# launcher stops every process the moment one exits, and a silent one leaving first had the one
# that reports killed before it printed (seen under load).
REPORT_GRACE_S = 3.0
# What torchelastic's failure report shows for a refusal, in place of a traceback.
REFUSED = (
    "linnaeus-accel refused to start (exit status 2): the reason is on this process's stderr, in the "
    "message that begins 'linnaeus-accel'; nothing was trained"
)

_launcher: int | None = None  # the parent followed, once follow_launcher has started


def launched_by_torchelastic() -> bool:
    """torchelastic's agent sets this for every worker it starts (``accelerate launch``, ``torchrun``,
    ``notebook_launcher``); a process started by a shell or by SLURM's ``srun`` directly has none,
    and must outlive a shell that exits (``nohup``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def follow_launcher() -> None:
    """Under torchelastic, end this process when its launcher ends (at most ``POLL_S`` later).
    Idempotent; a no-op in a process that was not launched by torchelastic."""
    global _launcher
    if _launcher is not None or not launched_by_torchelastic():
        return
    _launcher = parent = os.getppid()
    if parent == 1:  # reparented to init already: the launcher died while this process started
        _stop("its launcher ended before this process started")
    threading.Thread(target=_watch, args=(parent,), name="linnaeus-accel launcher watch", daemon=True).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    _stop(f"its launcher (process {parent}) is gone")


def stop_if_launcher_gone() -> None:
    """Stop now if the launcher followed is gone: an error this process got in the meantime (a
    peer, stopped by the same watch, left the process group first) is the kill's echo, not a
    failure to record or print before the watch notices."""
    if _launcher is not None and os.getppid() != _launcher:
        _stop(f"its launcher (process {_launcher}) is gone")


def _stop(why: str) -> None:
    rank = os.environ.get("RANK", "?")
    with contextlib.suppress(OSError, ValueError):  # the launcher's pipe may be gone with it
        print(
            f"linnaeus-accel: process {rank} stops: {why}; the last checkpoint stays the resume point "
            "(rerun the same command to continue)",
            file=sys.stderr,
            flush=True,
        )
    # SIGKILL, as the launcher got: nothing half-written is committed (checkpoints commit atomically),
    # the output directory's lock is released by the kernel, and DataLoader workers follow their
    # parent out. A clean stop would need the other processes, whose rendezvous store died with the
    # launcher.
    os.kill(os.getpid(), signal.SIGKILL)


def report_refusal(message: str, usage: str = "") -> None:
    """Say ``message`` (after ``usage``) on stderr once: by the local main process, the others
    waiting ``REPORT_GRACE_S`` for it; under torchelastic, the error file says where it is."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(usage + message, file=sys.stderr, flush=True)
        if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
            # The layout torch's ErrorHandler writes for an exception, REFUSED where the traceback
            # goes (the report shows it); whole, as the launcher parses it.
            cause = {
                "message": REFUSED,
                "extraInfo": {"py_callstack": REFUSED, "timestamp": str(int(time.time()))},
            }
            with contextlib.suppress(OSError):
                write_json(Path(error_file), {"message": cause})
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(REPORT_GRACE_S)


@contextlib.contextmanager
def startup_deadline(seconds: float, what: str) -> Iterator[None]:
    """Stop this process (exit 1, one sentence) if ``what`` has not finished within ``seconds``:
    torch's own timeouts do not cover every wait of a process group's creation (a rerun whose
    rendezvous met a previous run's leftovers waited in gloo's ``connectFullMesh`` past the
    configured timeout). The wait releases the GIL, so this thread's timer fires."""

    def expire() -> None:
        rank = os.environ.get("RANK", "?")
        with contextlib.suppress(OSError, ValueError):
            print(
                f"linnaeus-accel: process {rank}: {what} did not finish within {seconds:g} s "
                "(ENV.DIST_TIMEOUT_S); this process stops. Check that every process was started, that "
                "no process of an earlier run still lives (ps), and that MASTER_ADDR/MASTER_PORT are free",
                file=sys.stderr,
                flush=True,
            )
        os._exit(EXIT_FAILED)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.name = "linnaeus-accel startup deadline"
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
