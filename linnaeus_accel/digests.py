"""Digests of checkpoint files, and sealing them (hash and fsync, in one read) on a few threads.

XXH3-128 detects damage (a flipped bit, a truncated or swapped file) as surely as SHA-256 (no
accidental collision in 2**128) at ~10x the speed, and the commit runs it over every byte of every
checkpoint; neither proves who wrote a file (anyone can recompute either). Markers written before
it carry SHA-256 digests and still verify.

A few threads: one file's fsync (waiting on the disk) overlaps another's hashing. ``EarlySeal``
starts on files as soon as they are complete, while the next ones are still being written.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

DIGEST = "xxh3_128"  # the digest new markers carry
DIGESTS: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
FileEntry = dict[str, Any]  # {"path": posix path relative to the checkpoint, "size": int, DIGEST: hex}
_CHUNK = 4 << 20
_THREADS = 4


def file_digest(data: bytes, algorithm: str = DIGEST) -> tuple[str, str]:
    """``(manifest key, hex digest)`` of ``data``, as a marker's file entry carries it."""
    digest = DIGESTS[algorithm]()
    digest.update(data)
    return algorithm, str(digest.hexdigest())


def hash_file(file: Path, *, sync: bool, algorithm: str = DIGEST) -> tuple[int, str]:
    """Size and digest of ``file``, streamed through one buffer; with ``sync`` also fsync it, on
    a thread of its own while the hashing reads the file from the page cache (the fsync waits on
    the disk, the hashing on the CPU: together they take the longer of the two, not the sum)."""
    digest, size = DIGESTS[algorithm](), 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with file.open("rb", buffering=0) as f:
        syncing = _fsync_in_background(f.fileno()) if sync else None
        try:
            while n := f.readinto(buffer):
                digest.update(view[:n])
                size += n
        finally:
            if syncing is not None:
                syncing.result()  # raises the fsync's error, if any
    return size, str(digest.hexdigest())


def _fsync_in_background(fd: int) -> Future[None]:
    done: Future[None] = Future()

    def run() -> None:
        try:
            os.fsync(fd)
        except BaseException as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)

    threading.Thread(target=run, name="linnaeus-accel fsync", daemon=True).start()
    return done


def seal_file(file: Path) -> tuple[int, str]:
    """Size and digest of ``file``, which we have just written, fsynced meanwhile. Hashed straight
    from the page cache through a read-only mapping: no copy into a buffer (~3x faster than
    ``hash_file``; the commit waits for it). Only for our own staged files: a file truncated while
    mapped would kill the process (SIGBUS), so checkpoints read back use ``hash_file``."""
    with file.open("rb", buffering=0) as f:
        syncing = _fsync_in_background(f.fileno())
        try:
            size = os.fstat(f.fileno()).st_size
            digest = DIGESTS[DIGEST]()
            if size:  # an empty file cannot be mapped
                with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mapped:
                    digest.update(mapped)
        finally:
            syncing.result()  # raises the fsync's error, if any
    return size, str(digest.hexdigest())


def _entry(root: Path, file: Path) -> FileEntry:
    size, digest = seal_file(file)
    return {"path": file.relative_to(root).as_posix(), "size": size, DIGEST: digest}


def hash_files(root: Path, files: Iterable[Path]) -> list[FileEntry]:
    """Hash and fsync ``files`` (under ``root``) on a few threads; their manifest entries."""
    files = list(files)
    if not files:
        return []
    with ThreadPoolExecutor(min(_THREADS, len(files))) as pool:
        return list(pool.map(lambda file: _entry(root, file), files))


class EarlySeal:
    """Seals the files of a staging directory as they are completed (``add``), while later ones
    are still being written; ``entries`` waits for them, for ``CheckpointStore.commit(sealed=)``.
    A file must not change after it is added (the commit checks its size)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="linnaeus-accel seal")
        self._futures: list[Future[FileEntry]] = []

    def add(self, files: Iterable[Path]) -> None:
        self._futures.extend([self._pool.submit(_entry, self.root, file) for file in files])

    def entries(self) -> dict[str, FileEntry]:
        """The entries by relative path (raises what sealing a file raised)."""
        try:
            return {entry["path"]: entry for entry in (f.result() for f in self._futures)}
        finally:
            self._pool.shutdown(wait=True)


class EarlyWriteback:
    """While files are being written into ``root`` (by code we do not own: ``torch.save``,
    safetensors), push their dirty pages to the disk every few milliseconds from a thread of its
    own, so that the fsync of the commit finds little left to write: the disk works while the
    writer still fills the page cache, instead of after it. A context manager; errors here are
    ignored (the commit's own fsync reports them)."""

    _PERIOD_S = 0.01

    def __init__(self, root: Path) -> None:
        self.root = root
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="linnaeus-accel writeback", daemon=True)

    def __enter__(self) -> EarlyWriteback:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        fds: dict[Path, int] = {}
        try:
            while not self._stop.wait(self._PERIOD_S):
                for file in self.root.iterdir():
                    try:
                        if file not in fds and file.is_file():
                            fds[file] = os.open(file, os.O_RDONLY)
                        if file in fds:
                            os.fdatasync(fds[file])
                    except OSError:
                        continue
        finally:
            for fd in fds.values():
                os.close(fd)
