"""Files that survive a power cut or a ``kill -9`` whole or not at all. Plain Python (layer 0).

Renaming a file into place is atomic, but durable only once the directory holding the new entry is
fsynced too; checkpoints' markers and ``tokenize``'s outputs rely on both.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path


def fsync_directory(path: Path) -> None:
    """Make the entries of directory ``path`` durable; filesystems that cannot fsync a directory
    are skipped."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def write_durably(target: Path, tmp: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` through ``tmp`` so that a reader sees nothing or all of it,
    and the result is on disk when this returns."""
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_directory(target.parent)
