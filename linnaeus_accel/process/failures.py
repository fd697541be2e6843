"""Why a run stopped before its end, in words a user can act on.

``RunFailed``: the run cannot go on and every process knows it (a non-finite loss, a checkpoint
that could not be written); ``summary.json`` says ``status: failed`` and the command exits 1.
``OutputWriteError``: a file only the main process writes (metrics.jsonl, summary.json, the assets,
a checkpoint's journal) could not be written; the run ends the same way, in one sentence naming the
path and the cause.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

_DISK_ERRORS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT)
_PROBE_BYTES = 1 << 20
_COLLECTIVE_TIMEOUTS = ("timed out waiting", "collective operation timeout")


class RunFailed(RuntimeError):
    """Every process stops; the message says why, what was kept and what to do."""


class OutputWriteError(Exception):
    """The main process could not write a file of the run (``path``; ``words``: the cause, naming
    ENOSPC, EROFS or EDQUOT when the disk is the cause). Not a ``RunFailed``: the other processes
    do not know of it, so none waits for them; ``RunEnd.record_exception`` ends the run with it."""

    def __init__(self, what: str, path: Path, exc: BaseException) -> None:
        self.path, self.words = path, describe_write(exc, path)
        super().__init__(f"could not {what}: {self.words}")


def collective_timeout(exc: BaseException, timeout_s: float | None) -> str | None:
    """The message for a collective operation that timed out (another process stopped
    answering), or None when ``exc`` is something else."""
    text = str(exc)
    # What torch's process groups raise (RuntimeError, or its DistBackendError subclass): gloo's
    # "Timed out waiting ...ms for recv", NCCL's watchdog "collective operation timeout". A user's
    # own TimeoutError (an OSError) is not one of them.
    if not isinstance(exc, RuntimeError) or not any(p in text.lower() for p in _COLLECTIVE_TIMEOUTS):
        return None
    waited = f" for {timeout_s:g} s (ENV.DIST_TIMEOUT_S)" if timeout_s and math.isfinite(timeout_s) else ""
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return (
        f"waited{waited} for another process that stopped answering or died; this process stops too. "
        f"torch: {first}"
    )


def attempt_write(action: Callable[[], Any], staging: Path) -> tuple[str, BaseException] | None:
    """Run ``action``; None if it worked, else what went wrong in words (naming ENOSPC, EROFS or
    EDQUOT when the disk is the cause) and the exception."""
    try:
        action()
    except Exception as exc:
        return describe_write(exc, staging), exc
    return None


def describe_write(exc: BaseException, staging: Path) -> str:
    """``exc``, raised writing under ``staging``, in words. torch's zip writer reports a full disk as
    ``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos`` and safetensors as
    an ``I/O error``, without an errno: the filesystem is then asked."""
    code = exc.errno if isinstance(exc, OSError) and exc.errno in _DISK_ERRORS else _diagnose(staging)
    where = exc.filename if isinstance(exc, OSError) and exc.filename else staging
    if code is not None:
        return f"{errno.errorcode[code]} ({os.strerror(code)}) writing {where}"
    return f"{type(exc).__name__}: {str(exc).strip() or '(no message)'} (writing {where})"


def disk_failure(exc: BaseException, where: Path) -> str | None:
    """A full or read-only disk (or a quota) as the cause of ``exc``, an error raised by code that
    did not say what it wrote (a callback's file, a tracker's), in words naming the path (its
    own, else ``where``); None when the disk is not the cause."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _DISK_ERRORS:
            return describe_write(error, where)
        error = error.__cause__ or error.__context__
    # Native writers (safetensors, torch) say it only in their message.
    if any(os.strerror(code) in str(exc) for code in _DISK_ERRORS):
        return describe_write(exc, where)
    return None


def _diagnose(staging: Path) -> int | None:
    """ENOSPC, EROFS or EDQUOT if the filesystem of ``staging`` cannot take more data, else None:
    ``statvfs``, then a probe write (a quota or root's reserved blocks do not show in statvfs)."""
    where = staging
    while not where.is_dir() and where != where.parent:
        where = where.parent
    try:
        info = os.statvfs(where)
    except OSError:
        return None
    if info.f_flag & os.ST_RDONLY:
        return errno.EROFS
    probe = where / f".probe-{os.getpid()}"
    try:
        with probe.open("wb") as f:
            f.write(b"\0" * _PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return exc.errno if exc.errno in _DISK_ERRORS else None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None
