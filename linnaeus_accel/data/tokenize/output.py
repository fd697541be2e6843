"""Writing ``tokenize``'s output safely: the token file and its sidecar appear whole or not at all,
and never replace what they must not.

- Both are written to hidden temporary names and moved into place at the end, the token file
  first; an interrupted run leaves neither, and the next run for the same output removes what a
  killed one left (``remove_stale_temporaries``). Temporary names are unique per writer, so two runs
  (or two threads of one process) never write the same temporary file.
- A writer holds an ``flock`` on each of its temporary files until it is done with them: the kernel
  releases it however the writer ends (``kill -9`` too), so a temporary file nobody holds is a killed
  run's. Not the pid in its name: a pid says nothing about a run in another pid namespace (a
  container, whose first process is pid 1 here too) or on another machine sharing the directory,
  nor about a killed run that its parent has not reaped yet; a leftover looked alive forever, and
  a live run elsewhere could have its file removed while it wrote it.
- Without ``overwrite`` the move itself refuses an existing file (a hard link, which fails
  atomically where the name is taken): of two runs writing the same output at once, the later one
  to finish fails and removes its files, whatever the other left in place.
- An output that cannot be written is a ``ConfigError`` naming it and why, not a traceback: checked
  before tokenizing where the nearest existing directory tells (``output_problems``), and any
  ``OSError`` while writing is converted (``writing``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from types import TracebackType
from typing import IO, Any, BinaryIO, TextIO

import numpy as np
from numpy.typing import NDArray

from ...config import ConfigError
from ...durable_files import fsync_directory
from ..tokens.format import TOKEN_SUFFIXES, TokenSidecar, sidecar_path
from .inputs import argument_error

NPY_HEADER_BYTES = 128  # room for any token count, so the header is rewritten in place at the end


def output_problems(output: Path, overwrite: bool) -> list[tuple[str, str]]:
    """Why ``output`` cannot be written (keyed ``--output``), found before anything is tokenized."""
    if output.suffix not in TOKEN_SUFFIXES:
        return [("--output", f"{output}: name a token file ending in .bin (raw tokens) or .npy")]
    if output.is_dir():
        return [("--output", f"{output} is a directory: name the token file to write in it")]
    if (unwritable := _unwritable(output)) is not None:
        return [("--output", unwritable)]
    existing = [str(path) for path in (output, sidecar_path(output)) if path.exists()]
    if existing and not overwrite:
        return [("--output", f"{' and '.join(existing)} already exist: pass --overwrite to replace them")]
    return []


def _unwritable(output: Path) -> str | None:
    """Why ``output`` cannot be created, as far as its nearest existing directory tells: a file
    where a directory must be, or a directory this process may not write (root may write any)."""
    existing = output.parent
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot write {output}: {existing} is not a directory: choose another output"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot write {output}: {existing} is not writable (permission denied): choose an output you can write"
    return None


@contextmanager
def writing(output: Path) -> Iterator[None]:
    """An ``OSError`` while writing ``output`` (a directory that cannot be written, a full disk)
    as a ``ConfigError`` naming the output and the reason."""
    try:
        yield
    except OSError as exc:
        failed = "" if exc.filename is None or str(exc.filename) == str(output) else f" ({exc.filename})"
        reason = exc.strerror or str(exc)
        raise argument_error(
            "--output", f"cannot write {output}: {reason}{failed}: choose an output you can write"
        ) from None


def prepare_output_directory(output: Path) -> None:
    """The directory of ``output`` created, and the temporary files that killed runs for
    ``output`` left there removed; an ``OSError`` as ``writing`` reports it."""
    with writing(output):
        output.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(output)


def _temporary_name(path: Path) -> Path:
    # Hidden, and ending in neither .bin nor .npy: no glob of token files matches it. The pid only
    # tells a reader whose it is; the random tag keeps two runs of one process (threads) apart.
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def _create_temporary(path: Path) -> tuple[Path, int]:
    """A new temporary file for ``path``, and its descriptor, which holds the file's lock."""
    while True:
        temporary = _temporary_name(path)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # a cleanup found it before the lock: it may be gone; take another name
        except OSError:
            return temporary, fd  # a file system without locks: nothing is then removed as stale
        else:
            # A cleanup may have locked and removed it in the instant before the lock was taken.
            with suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(fd), os.stat(temporary)):
                    return temporary, fd
        os.close(fd)


def remove_stale_temporaries(output: Path) -> None:
    """Remove the temporary files that killed runs for ``output`` left: those whose lock nobody
    holds. A live writer's (in this process or another) is kept."""
    for final in (output, sidecar_path(output)):
        prefix = f".{final.name}.tmp-"
        for entry in os.scandir(final.parent):
            if not entry.name.startswith(prefix):
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue  # its writer finished meanwhile, or another user's that cannot be told
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held by a live writer, or a lock that cannot be told here: kept
            else:
                Path(entry.path).unlink(missing_ok=True)
            finally:
                os.close(fd)


def _npy_header(dtype: np.dtype[Any], num_tokens: int) -> bytes:
    """A .npy (version 1.0) header of ``NPY_HEADER_BYTES`` whatever ``num_tokens``."""
    text = f"{{'descr': '{dtype.str}', 'fortran_order': False, 'shape': ({num_tokens},), }}"
    text = text.ljust(NPY_HEADER_BYTES - 11) + "\n"  # 10 bytes of magic, version and length before it
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode("latin1")


class TokenFileWriter:
    """Writes ``output`` and its sidecar to temporary files, and moves both into place on
    ``commit``; leaving the ``with`` block without a commit removes them. Without ``overwrite``,
    ``commit`` refuses (``ConfigError``) an output that another run put in place meanwhile."""

    def __init__(self, output: Path, dtype: np.dtype[Any], overwrite: bool = False) -> None:
        self.output, self.dtype, self.num_tokens, self.overwrite = output, dtype, 0, overwrite
        self.temporary: Path | None = None
        self.sidecar_temporary: Path | None = None
        self.npy = output.suffix == ".npy"
        self.file: BinaryIO | None = None
        self.sidecar_file: TextIO | None = None

    def __enter__(self) -> TokenFileWriter:
        try:
            with writing(self.output):
                self.temporary, fd = _create_temporary(self.output)
                self.file = os.fdopen(fd, "wb")
                if self.npy:
                    self.file.write(_npy_header(self.dtype, 0))  # the count is known only at the end
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def write(self, tokens: NDArray[Any]) -> None:
        assert self.file is not None, "write outside the with block"
        with writing(self.output):
            self.file.write(tokens.data)
        self.num_tokens += len(tokens)

    def commit(self, sidecar: TokenSidecar) -> None:
        """Both files whole on disk, then in place: the token file first, after the old sidecar is
        gone, so that no sidecar ever describes another file."""
        assert self.file is not None, "commit outside the with block"
        assert self.temporary is not None
        with writing(self.output):
            if self.npy:
                self.file.seek(0)
                self.file.write(_npy_header(self.dtype, self.num_tokens))
            _sync(self.file)  # kept open, and so locked, until both files are in place
            # Not durable_files.write_durably: that renames over the target at once, and without
            # overwrite the sidecar must go in place by a link that refuses a taken name.
            self.sidecar_temporary, fd = _create_temporary(sidecar_path(self.output))
            self.sidecar_file = os.fdopen(fd, "w", encoding="utf-8")
            self.sidecar_file.write(sidecar.to_json())
            _sync(self.sidecar_file)
            if self.overwrite:
                sidecar_path(self.output).unlink(missing_ok=True)
                fsync_directory(self.output.parent)
                os.replace(self.temporary, self.output)
                os.replace(self.sidecar_temporary, sidecar_path(self.output))
            else:
                self._publish_new(self.temporary, self.sidecar_temporary)
            fsync_directory(self.output.parent)

    def _publish_new(self, temporary: Path, sidecar_temporary: Path) -> None:
        """Both files in place under names that must still be free: another run that put either
        in place since this one started wins, and this one fails having replaced nothing."""
        sidecar = sidecar_path(self.output)
        try:
            _link_new(temporary, self.output)
        except FileExistsError:
            raise self._taken(self.output) from None
        try:
            _link_new(sidecar_temporary, sidecar)
        except FileExistsError:
            # Only a run with overwrite puts a sidecar beside a token file it did not write: the
            # token file is then most likely its own too, and left alone unless still this one's.
            if _same_file(temporary, self.output):
                self.output.unlink(missing_ok=True)
            raise self._taken(sidecar) from None

    def _taken(self, path: Path) -> ConfigError:
        return argument_error(
            "--output",
            f"{path} was written by another run while this one tokenized: it is left as it is and "
            f"nothing of this run is kept; pass --overwrite to replace {self.output}",
        )

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Removed before they are closed (which releases their locks): no cleanup sees them unheld.
        for temporary, handle in ((self.temporary, self.file), (self.sidecar_temporary, self.sidecar_file)):
            if temporary is not None:
                temporary.unlink(missing_ok=True)  # after a commit with overwrite, already gone
            if handle is not None:
                handle.close()


def _sync(handle: IO[Any]) -> None:
    handle.flush()
    os.fsync(handle.fileno())


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


# link() errors of a file system without hard links (FAT, some network and FUSE file systems).
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS}


def _link_new(source: Path, target: Path) -> None:
    """``source`` also named ``target``, which must not exist (``FileExistsError``): a hard link
    fails atomically where the name is taken. Without hard links, the name is claimed by creating
    it exclusively, then replaced by ``source``."""
    try:
        os.link(source, target)
        return
    except OSError as exc:
        if isinstance(exc, FileExistsError) or exc.errno not in _NO_HARD_LINKS:
            raise
    os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    os.replace(source, target)
