"""One writer per output directory: an OS-level lock that the main process holds for the whole run.

A POSIX record lock (``lockf``) on ``<output dir>/.lock``: the kernel releases it when the process
ends however it ends (``kill -9`` included), so a lock is never stale, and unlike ``flock`` it is
not inherited by forked children (DataLoader workers of a killed run must not keep holding it).
POSIX locks do not exclude the process that holds them, so this process's own locks are tracked
too (a second Trainer on the same directory in a notebook). The file only says who holds it. Two
runs on one directory would otherwise interleave checkpoints and truncate each other's
``metrics.jsonl``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".lock"


_HELD_HERE: set[Path] = set()  # lock files this process holds


class RunLocked(RuntimeError):
    """Another live process holds the output directory; the message names it."""


class RunLock:
    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise ``RunLocked`` at once (never waits)."""
        if self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.resolve() in _HELD_HERE:
            raise RunLocked(
                f"{self.path.parent} is in use by another run of this process ({os.getpid()}): let it "
                "finish, or choose another EXPERIMENT.NAME or ENV.OUTPUT.BASE_DIR"
            )
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(fd)
                raise
            holder = _holder(fd)
            os.close(fd)
            raise RunLocked(
                f"{self.path.parent} is in use by another run ({holder}): wait for it to end, or choose "
                "another EXPERIMENT.NAME or ENV.OUTPUT.BASE_DIR"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode("utf-8"), 0)
        self._fd = fd
        _HELD_HERE.add(self.path.resolve())

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None
            _HELD_HERE.discard(self.path.resolve())

    @property
    def held(self) -> bool:
        return self._fd is not None


def _holder(fd: int) -> str:
    """Who holds the lock, as its file says (written right after it was taken)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        return f"process {int(info['pid'])} on {info['host']}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has just started"
