"""A copy of the run's checkpoints in a bucket (``ENV.OUTPUT.BUCKET``; docs/semantics.md §6 and docs/design.md §4).

The bucket mirrors the local layout: ``<URL>/<EXPERIMENT.NAME>/checkpoints/step_00001234/<files>``,
in any store ``object_store`` opens (s3://, gs://, file://, b2://). No store has an atomic
multi-file commit, so the rule of the local store is kept by ordering: the commit marker is
uploaded after every other file and deleted before any other, hence a remote checkpoint that has
its marker is complete, whatever moment the upload or deletion was interrupted at.

Credentials never pass through this module: each store's library reads them from its own chain.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from tenacity import (
    RetryCallState,
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_when_event_set,
    wait_exponential,
)

from ...object_store import KEY_ID_VAR, KEY_VAR, B2Store, ObjectStore, RemoteSyncError, open_store
from ..directory.layout import JOURNAL_FILE
from ..directory.marker import MARKER
from ..directory.store import step_name

__all__ = [
    "KEY_ID_VAR",
    "KEY_VAR",
    "HostileKey",
    "RemoteCheckpoints",
    "RemoteSyncError",
    "RetryPolicy",
]

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_T = TypeVar("_T")


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff around each single-file operation: after the n-th failure,
    wait ``min(max_delay, base_delay * 2 ** (n - 1))`` seconds; give up after ``attempts`` tries.

    The stores' libraries already retry transient errors a few times without waiting long; this
    outer loop waits, so a network outage of tens of seconds (a node's NIC flapping, a store
    returning 503s) is ridden out too. Only errors the store calls retryable are retried: a local
    file that vanished, a refused key or a missing bucket fail at once.
    """

    attempts: int = 5
    base_delay: float = 1.0
    max_delay: float = 30.0

    def retrying(
        self, what: str, worth_retrying: Callable[[BaseException], bool], abort: threading.Event | None = None
    ) -> Retrying:
        """Tenacity's loop for one operation described by ``what`` (named in the warnings); once
        ``abort`` is set (the run stopped waiting for the bucket), no further attempt is made."""
        stop = stop_after_attempt(self.attempts)
        return Retrying(
            retry=retry_if_exception(worth_retrying),
            stop=stop | stop_when_event_set(abort) if abort is not None else stop,
            wait=wait_exponential(multiplier=self.base_delay, exp_base=2, max=self.max_delay),
            before_sleep=partial(_warn_retry, what),
        )


def _warn_retry(what: str, state: RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome is not None else None
    delay = state.next_action.sleep if state.next_action is not None else 0.0
    log.warning(
        "%s failed (%s: %s); retry %d in %.1fs",
        what,
        type(error).__name__,
        error,
        state.attempt_number,
        delay,
    )


class HostileKey(RemoteSyncError):
    """A key under a checkpoint's prefix that names a file outside the checkpoint's directory
    (``..``, an absolute path): anyone who can write the bucket can add one, so the checkpoint is
    rejected, like a damaged file, and nothing of it is downloaded."""


def _safe_rel(rel: str) -> PurePosixPath:
    """A file's path inside a checkpoint; a bucket (or a caller) is not trusted to stay inside it."""
    path = PurePosixPath(rel)
    if not rel or path.is_absolute() or ".." in path.parts or "\\" in rel:
        raise HostileKey(f"refusing remote file name {rel!r} outside the checkpoint")
    return path


def _unreachable(url: str, error: BaseException) -> str:
    """The one sentence for a bucket that cannot be listed at start."""
    detail = f"{type(error).__name__}: {error}"
    if isinstance(error, NotADirectoryError):
        return f"{url} is a file, not a directory ({detail}): name the directory that holds the checkpoints"
    if isinstance(error, FileNotFoundError):
        return f"{url} does not exist ({detail}): create the bucket (or directory) or correct the URL"
    if isinstance(error, PermissionError):
        return f"{url} refused access ({detail}): check the credentials in the environment"
    return f"{url} is not reachable ({detail}): check the endpoint, the network and the credentials"


class RemoteCheckpoints:
    """The checkpoints of one experiment in one object store (keys ``<experiment>/checkpoints/...``)."""

    def __init__(self, store: ObjectStore, experiment: str, *, retry: RetryPolicy | None = None) -> None:
        self.store = store
        self.retry = retry or RetryPolicy()
        self.abort: threading.Event | None = None  # set: no further attempt (``BackgroundUploader.close``)
        self._journals: dict[int, int] = {}  # step -> size of the journal this run sent there
        self.root = f"{experiment}/checkpoints"
        self.url = f"{store.describe}/{self.root}"  # for messages

    @classmethod
    def from_url(
        cls,
        url: str,
        experiment: str,
        *,
        retry: RetryPolicy | None = None,
        store: ObjectStore | None = None,
        timeout_s: float | None = None,
    ) -> RemoteCheckpoints:
        """The checkpoints of ``experiment`` under a bucket URL (``ENV.OUTPUT.BUCKET.URL``), checked
        with one listing: a missing bucket, refused credentials or an unreachable endpoint is a
        ``RemoteSyncError`` of one sentence here, not an upload failing later in the background.

        ``store``: the ``ObjectStore`` to use instead of opening ``url`` (tests wrap one to inject
        faults); ``timeout_s``: each s3:// request's (``ENV.OUTPUT.BUCKET.TIMEOUT_S``).
        """
        try:
            store = store if store is not None else open_store(url, timeout_s)
        except ValueError as e:  # BucketConfig.split_url's words
            raise RemoteSyncError(str(e)) from None
        remote = cls(store, experiment, retry=retry)
        try:
            # No outer retries: the store's library has retried transient errors; a run should
            # not wait a minute at start to be told its endpoint is mistyped.
            store.list(experiment)
        except Exception as e:
            raise RemoteSyncError(_unreachable(store.describe, e)) from None
        return remote

    @classmethod
    def from_environment(
        cls, bucket: str, prefix: str, experiment: str, *, api: Any = None, retry: RetryPolicy | None = None
    ) -> RemoteCheckpoints:
        """A B2 bucket (``b2://<bucket>/<prefix>``), authorized with ``B2_APPLICATION_KEY_ID`` /
        ``B2_APPLICATION_KEY`` from the environment; ``api``: an unauthorized B2Api to use instead of
        a new one (tests pass a simulator-backed one)."""
        return cls(B2Store.from_environment(bucket, prefix, api=api), experiment, retry=retry)

    def __repr__(self) -> str:
        return f"RemoteCheckpoints({self.url!r})"

    # -- listing -----------------------------------------------------------------------------------
    def _files(self, step: int | None = None) -> list[tuple[int, str, int]]:
        """(step, path inside the checkpoint, size) for every file under the checkpoints root."""
        base = self.root if step is None else f"{self.root}/{step_name(step)}"
        listing = self._retry(f"list {self.store.describe}/{base}", lambda: self.store.list(base))
        out = []
        for key, size in listing.items():
            step_dir, _, rel = key[len(self.root) + 1 :].partition("/")
            match = _STEP_DIR.match(step_dir)
            if key.startswith(self.root + "/") and match and rel:
                out.append((int(match.group(1)), rel, size))
        return out

    def remote_steps(self) -> list[int]:
        """Every step with any file in the bucket, complete or not."""
        return sorted({step for step, _, _ in self._files()})

    def complete_steps(self) -> list[int]:
        """Steps whose remote copy is complete (its marker exists), oldest first."""
        return sorted({step for step, rel, _ in self._files() if rel == MARKER})

    def list_files(self, step: int) -> dict[str, int]:
        """Every file of a step's remote checkpoint, complete or not: path inside the step -> size."""
        return {rel: size for s, rel, size in self._files(step) if s == step}

    # -- whole checkpoints -------------------------------------------------------------------------
    def upload(self, local_checkpoint_dir: Path) -> bool:
        """Make the bucket hold one committed local checkpoint whole, its marker last, each file sent
        once; False when it held it already (its marker is the local one: nothing is sent).

        The bucket keeps only the checkpoint's own files: any other object under its prefix (a stray,
        or a file of an earlier version of the step) is removed before the marker goes up. A step the
        bucket holds another version of (a run resumed before it saved it again) loses its marker
        first, so that no marker ever vouches for a mix of old and new files."""
        local = Path(local_checkpoint_dir)
        match = _STEP_DIR.match(local.name)
        if match is None or not (local / MARKER).is_file():
            raise RemoteSyncError(f"{local} is not a committed checkpoint directory (no {MARKER})")
        step = int(match.group(1))
        marker = (local / MARKER).read_bytes()
        files = sorted(
            p for p in local.rglob("*") if p.is_file() and p.relative_to(local).as_posix() != MARKER
        )
        own = {p.relative_to(local).as_posix() for p in files}
        there = self.list_files(step)
        whole = MARKER in there and self.get_bytes(step, MARKER) == marker
        # Its journal (outside the manifest) goes up on its own once it grows: kept when whole.
        strays = sorted(
            r for r in there if r != MARKER and r not in own and not (whole and r == JOURNAL_FILE)
        )
        if whole:
            self._delete_keys(step, strays)
            return False
        if MARKER in there:
            self.delete_files(step, [MARKER])
        for path in files:
            rel, size = path.relative_to(local).as_posix(), None
            if rel == JOURNAL_FILE:  # its size as sent (it may grow meanwhile)
                with contextlib.suppress(OSError):
                    size = path.stat().st_size
            self.upload_file(step, rel, path)
            if size is not None:
                self._journals[step] = size
        self._delete_keys(step, strays)
        self.upload_file(step, MARKER, local / MARKER)
        log.info("uploaded checkpoint step %d to %s", step, self.url)
        return True

    def upload_journal(self, step: int, path: Path) -> bool:
        """The validation journal of a checkpoint the bucket holds, on its own object beside it (it is
        outside the manifest: the marker stays); sent only when it grew since this run last sent it."""
        size = Path(path).stat().st_size
        if self._journals.get(step) == size:
            return False
        self.upload_file(step, JOURNAL_FILE, Path(path))
        self._journals[step] = size
        return True

    def download(self, step: int, dest_dir: Path) -> Path:
        """Download a complete remote checkpoint to ``dest_dir/step_XXXXXXXX`` (``dest_dir`` is the
        local ``checkpoints/`` directory) and return that path.

        Files land in a hidden temporary directory next to it (marker last), which is renamed into
        place only when complete: an interrupted download never looks like a checkpoint locally.
        """
        files = self.list_files(step)
        if MARKER not in files:
            raise RemoteSyncError(f"no complete checkpoint for step {step} in {self.url}")
        for rel in files:  # before anything is written: a hostile name rejects the checkpoint
            _safe_rel(rel)
        dest_dir = Path(dest_dir)
        final = dest_dir / step_name(step)
        if (final / MARKER).is_file():
            return final
        dest_dir.mkdir(parents=True, exist_ok=True)
        for stale in dest_dir.glob(".download-*"):  # left by a download killed earlier
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".download-{final.name}-", dir=dest_dir))
        try:
            for rel in [*sorted(r for r in files if r != MARKER), MARKER]:
                target = tmp.joinpath(*_safe_rel(rel).parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                key = self._key(step, rel)
                self._retry(
                    f"download {self.store.describe}/{key}", partial(self.store.get_file, key, target)
                )
            if final.exists():  # an incomplete local copy of the same step (no marker)
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("downloaded checkpoint step %d from %s", step, self.url)
        return final

    def delete(self, step: int) -> None:
        """Delete every file of a remote checkpoint (every version, in B2), the marker first."""
        self._delete_keys(step, sorted(self.list_files(step), key=lambda rel: rel != MARKER))

    def retain(self, keep: set[int]) -> list[int]:
        """Delete remote checkpoints not in ``keep``; return the deleted steps.

        The newest complete remote checkpoint always survives: if the upload of a kept step failed,
        the bucket still holds something to resume from. So does every step after the newest kept
        one: a checkpoint still being put together (on a run whose machines upload their own parts,
        another machine may be sending its files of a step this process has not committed yet).
        """
        complete = self.complete_steps()
        protected = set(keep) | set(complete[-1:])
        newest = max(keep, default=None)
        doomed = [s for s in self.remote_steps() if s not in protected and (newest is None or s < newest)]
        for step in doomed:
            self.delete(step)
        return doomed

    # -- single files of a step (each retried; ``rel`` is the '/'-separated path inside the step) ---
    def upload_file(self, step: int, rel: str, path: Path) -> None:
        """Upload the local file ``path`` as ``rel`` of step ``step`` (replacing any object there)."""
        key = self._key(step, rel)
        self._retry(f"upload {self.store.describe}/{key}", partial(self.store.put_file, Path(path), key))

    def put_bytes(self, step: int, rel: str, data: bytes) -> None:
        """Write ``data`` as ``rel`` of step ``step`` (replacing any object there)."""
        key = self._key(step, rel)
        self._retry(f"upload {self.store.describe}/{key}", partial(self.store.put_bytes, key, data))

    def get_bytes(self, step: int, rel: str) -> bytes | None:
        """The content of ``rel`` of step ``step``, or None when there is no such object."""
        key = self._key(step, rel)
        try:
            return self._retry(f"download {self.store.describe}/{key}", partial(self.store.get_bytes, key))
        except RemoteSyncError as e:
            if isinstance(e.__cause__, FileNotFoundError):
                return None
            raise

    def download_files(self, step: int, rels: list[str], dest: Path) -> None:
        """Download each ``rel`` of step ``step`` to ``dest/rel``, each written under a temporary
        name and renamed into place: a file is either absent or whole. A ``rel`` with ``..`` or an
        absolute path is refused before anything is downloaded."""
        targets = [(rel, Path(dest).joinpath(*_safe_rel(rel).parts)) for rel in rels]
        for rel, target in targets:
            key = self._key(step, rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
            os.close(fd)
            tmp = Path(name)
            try:
                self._retry(f"download {self.store.describe}/{key}", partial(self.store.get_file, key, tmp))
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)

    def delete_files(self, step: int, rels: list[str]) -> None:
        """Delete each ``rel`` of step ``step`` in the order given (every version, in B2); a missing
        one is no error."""
        for rel in rels:
            key = self._key(step, rel)
            self._retry(f"delete {self.store.describe}/{key}", partial(self.store.delete, key))

    # -- internals ---------------------------------------------------------------------------------
    def _key(self, step: int, rel: str) -> str:
        return f"{self.root}/{step_name(step)}/{_safe_rel(rel).as_posix()}"

    def _delete_keys(self, step: int, rels: list[str]) -> None:
        """Delete objects of a step as the listing named them, a hostile name included (the key is
        the bucket's own: nothing is resolved against a local directory)."""
        for rel in rels:
            key = f"{self.root}/{step_name(step)}/{rel}"
            self._retry(f"delete {self.store.describe}/{key}", partial(self.store.delete, key))

    def _retry(self, what: str, operation: Callable[[], _T]) -> _T:
        try:
            return self.retry.retrying(what, self.store.retryable, self.abort)(operation)
        except RetryError as gave_up:
            last = gave_up.last_attempt
            error = last.exception()
            raise RemoteSyncError(
                f"{what} failed after {last.attempt_number} attempts: {type(error).__name__}: {error}"
            ) from error
        except Exception as e:  # one that retrying cannot fix (the store's ``retryable``)
            raise RemoteSyncError(f"{what} failed (not retried): {type(e).__name__}: {e}") from e
