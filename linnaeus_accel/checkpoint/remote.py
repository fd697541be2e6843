"""A Backblaze B2 copy of the run's checkpoints (``ENV.OUTPUT.BUCKET``; docs/semantics.md §6 and docs/design.md §4).

The bucket mirrors the local layout: ``<PREFIX>/<EXPERIMENT.NAME>/checkpoints/step_00001234/<files>``.
B2 has no atomic multi-file commit, so the rule of the local store is kept by ordering: the commit
marker is uploaded after every other file and deleted before any other, hence a remote checkpoint
that has its marker is complete, whatever moment the upload or deletion was interrupted at.

Credentials come only from the environment and are handed straight to b2sdk's in-memory account
info: this module never stores, logs or formats them.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from b2sdk.v2 import B2Api, InMemoryAccountInfo
from b2sdk.v2.exception import B2Error, InvalidUploadSource
from tenacity import (
    RetryCallState,
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from .marker import MARKER
from .store import step_name

log = logging.getLogger(__name__)

KEY_ID_VAR = "B2_APPLICATION_KEY_ID"
KEY_VAR = "B2_APPLICATION_KEY"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_T = TypeVar("_T")


class RemoteSyncError(RuntimeError):
    """A bucket operation failed for good (after retries), or the bucket cannot be used."""


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff around each single-file operation: after the n-th failure,
    wait ``min(max_delay, base_delay * 2 ** (n - 1))`` seconds; give up after ``attempts`` tries.

    b2sdk already retries transient errors a few times without waiting; this outer loop waits, so a
    network outage of tens of seconds (a node's NIC flapping, B2 returning 503s) is ridden out too.
    """

    attempts: int = 5
    base_delay: float = 1.0
    max_delay: float = 30.0

    def retrying(self, what: str) -> Retrying:
        """Tenacity's loop for one operation described by ``what`` (named in the warnings)."""
        return Retrying(
            retry=retry_if_exception(_worth_retrying),
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential(multiplier=self.base_delay, exp_base=2, max=self.max_delay),
            before_sleep=partial(_warn_retry, what),
        )


def _worth_retrying(error: BaseException) -> bool:
    """Every B2 error but one that waiting cannot fix: a local file that vanished or cannot be read
    (local retention deleting a checkpoint mid-upload). Retried, it held the uploader, and every
    checkpoint queued after it, for 15 s of backoff with the default policy."""
    return isinstance(error, B2Error) and not isinstance(error, InvalidUploadSource)


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


class RemoteCheckpoints:
    """The checkpoints of one experiment in one bucket. ``api`` is an authorized ``b2sdk.v2.B2Api``."""

    def __init__(
        self, api: Any, bucket: str, prefix: str, experiment: str, *, retry: RetryPolicy | None = None
    ) -> None:
        self.retry = retry or RetryPolicy()
        self.bucket_name = bucket
        self.root = "/".join(p for p in (prefix.strip("/"), experiment, "checkpoints") if p)
        try:
            self._bucket = api.get_bucket_by_name(bucket)
        except B2Error as e:
            raise RemoteSyncError(f"B2 bucket {bucket!r} is not usable: {type(e).__name__}: {e}") from None

    @classmethod
    def from_environment(
        cls, bucket: str, prefix: str, experiment: str, *, api: Any = None, retry: RetryPolicy | None = None
    ) -> RemoteCheckpoints:
        """Authorize with ``B2_APPLICATION_KEY_ID`` / ``B2_APPLICATION_KEY`` from the environment.

        ``api`` is an unauthorized B2Api to use instead of a new one (tests pass a simulator-backed one).
        """
        key_id, key = os.environ.get(KEY_ID_VAR), os.environ.get(KEY_VAR)
        if not key_id or not key:
            missing = [name for name, value in ((KEY_ID_VAR, key_id), (KEY_VAR, key)) if not value]
            raise RemoteSyncError(
                f"ENV.OUTPUT.BUCKET.ENABLED needs B2 credentials in the environment: set {' and '.join(missing)}"
            )
        # In-memory account info: b2sdk's default (SqliteAccountInfo) would write the key to ~/.b2_account_info.
        api = api if api is not None else B2Api(InMemoryAccountInfo())
        try:
            api.authorize_account(realm="production", application_key_id=key_id, application_key=key)
        except B2Error as e:
            # `from None`: the chained exception carries nothing we need and we vouch for no third-party text.
            raise RemoteSyncError(
                f"B2 authorization with {KEY_ID_VAR}/{KEY_VAR} failed ({type(e).__name__})"
            ) from None
        return cls(api, bucket, prefix, experiment, retry=retry)

    def __repr__(self) -> str:
        return f"RemoteCheckpoints(bucket={self.bucket_name!r}, root={self.root!r})"

    # -- listing -----------------------------------------------------------------------------------
    def _files(self, step: int | None = None, *, all_versions: bool = False) -> list[tuple[int, str, Any]]:
        """(step, path inside the checkpoint, FileVersion) for every file under the checkpoints root."""
        base = self.root + "/" + (step_name(step) + "/" if step is not None else "")
        out = []
        listing: Iterable[tuple[Any, Any]] = self._retry(
            f"list {base}", lambda: list(self._bucket.ls(base, latest_only=not all_versions, recursive=True))
        )
        for version, _ in listing:
            step_dir, _, rel = str(version.file_name)[len(self.root) + 1 :].partition("/")
            match = _STEP_DIR.match(step_dir)
            if match and rel:
                out.append((int(match.group(1)), rel, version))
        return out

    def remote_steps(self) -> list[int]:
        """Every step with any file in the bucket, complete or not."""
        return sorted({step for step, _, _ in self._files()})

    def complete_steps(self) -> list[int]:
        """Steps whose remote copy is complete (its marker exists), oldest first."""
        return sorted({step for step, rel, _ in self._files() if rel == MARKER})

    # -- upload / download / delete ----------------------------------------------------------------
    def upload(self, local_checkpoint_dir: Path) -> None:
        """Upload one committed local checkpoint, its marker last."""
        local = Path(local_checkpoint_dir)
        match = _STEP_DIR.match(local.name)
        if match is None or not (local / MARKER).is_file():
            raise RemoteSyncError(f"{local} is not a committed checkpoint directory (no {MARKER})")
        step = int(match.group(1))
        # A re-upload of a step (e.g. after its validation journal grew) must not leave an old marker
        # vouching for a mix of old and new files, so the marker goes first.
        self._delete_versions(v for _, rel, v in self._files(step, all_versions=True) if rel == MARKER)
        files = sorted(
            p for p in local.rglob("*") if p.is_file() and p.relative_to(local).as_posix() != MARKER
        )
        for path in [*files, local / MARKER]:
            name = f"{self.root}/{step_name(step)}/{path.relative_to(local).as_posix()}"
            self._retry(f"upload {name}", partial(self._bucket.upload_local_file, str(path), name))
        log.info("uploaded checkpoint step %d to b2://%s/%s", step, self.bucket_name, self.root)

    def download(self, step: int, dest_dir: Path) -> Path:
        """Download a complete remote checkpoint to ``dest_dir/step_XXXXXXXX`` (``dest_dir`` is the
        local ``checkpoints/`` directory) and return that path.

        Files land in a hidden temporary directory next to it (marker last), which is renamed into
        place only when complete: an interrupted download never looks like a checkpoint locally.
        """
        files = {rel: v for s, rel, v in self._files(step) if s == step}
        if MARKER not in files:
            raise RemoteSyncError(
                f"no complete checkpoint for step {step} in b2://{self.bucket_name}/{self.root}"
            )
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
                parts = PurePosixPath(rel).parts
                if ".." in parts or PurePosixPath(rel).is_absolute():  # a bucket is not trusted input
                    raise RemoteSyncError(f"refusing remote file name {rel!r} outside the checkpoint")
                target = tmp.joinpath(*parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                name = str(files[rel].file_name)
                self._retry(f"download {name}", partial(self._download_file, name, target))
            if final.exists():  # an incomplete local copy of the same step (no marker)
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("downloaded checkpoint step %d from b2://%s/%s", step, self.bucket_name, self.root)
        return final

    def delete(self, step: int) -> None:
        """Delete every version of every file of a remote checkpoint, the marker first."""
        versions = self._files(step, all_versions=True)
        self._delete_versions(v for _, rel, v in sorted(versions, key=lambda f: f[1] != MARKER))

    def retain(self, keep: set[int]) -> list[int]:
        """Delete remote checkpoints not in ``keep``; return the deleted steps.

        The newest complete remote checkpoint always survives: if the upload of a kept step failed,
        the bucket still holds something to resume from.
        """
        complete = self.complete_steps()
        protected = set(keep) | set(complete[-1:])
        doomed = [s for s in self.remote_steps() if s not in protected]
        for step in doomed:
            self.delete(step)
        return doomed

    # -- internals ---------------------------------------------------------------------------------
    def _delete_versions(self, versions: Iterable[Any]) -> None:
        for v in versions:
            self._retry(
                f"delete {v.file_name}", partial(self._bucket.delete_file_version, v.id_, v.file_name)
            )

    def _download_file(self, name: str, target: Path) -> None:
        self._bucket.download_file_by_name(name).save_to(str(target))

    def _retry(self, what: str, operation: Callable[[], _T]) -> _T:
        try:
            return self.retry.retrying(what)(operation)
        except RetryError as gave_up:
            last = gave_up.last_attempt
            error = last.exception()
            raise RemoteSyncError(
                f"{what} failed after {last.attempt_number} attempts: {type(error).__name__}: {error}"
            ) from error
        except B2Error as e:  # one that retrying cannot fix (see _worth_retrying)
            raise RemoteSyncError(f"{what} failed (not retried): {type(e).__name__}: {e}") from e


class BackgroundUploader:
    """Runs bucket work on one daemon thread so that training never waits on the network.

    Tasks run in submission order, so a retention queued after an upload sees that upload finished.
    Nothing raised here reaches the training loop: failures are logged and collected in ``errors``.
    """

    def __init__(self, remote: RemoteCheckpoints) -> None:
        self.remote = remote
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._errors: list[str] = []
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="b2-checkpoint-sync", daemon=True)
        self._thread.start()

    @property
    def errors(self) -> list[str]:
        with self._lock:
            return list(self._errors)

    def submit(self, checkpoint_dir: Path) -> None:
        """Queue the upload of a just-committed checkpoint; returns at once."""
        path = Path(checkpoint_dir)
        self._put(f"upload of {path}", lambda: self._upload(path))

    def retention(self, keep: set[int]) -> None:
        """Queue the deletion of remote checkpoints not in ``keep`` (after the uploads queued before)."""
        frozen = frozenset(keep)  # the caller's set may change before the worker gets to it
        self._put("remote retention", lambda: self._retain(set(frozen)))

    def close(self, timeout: float | None = None) -> bool:
        """Finish the queued work (end of run); False if it did not finish within ``timeout`` seconds."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("checkpoint upload still running after %ss; the bucket may lag behind", timeout)
            return False
        return True

    def _put(self, what: str, task: Callable[[], None]) -> None:
        with self._lock:
            if not self._closed:
                self._queue.put(task)
                return
            self._errors.append(f"{what}: uploader already closed")
        log.error("%s skipped: uploader already closed", what)

    def _upload(self, path: Path) -> None:
        if not (path / MARKER).is_file():
            # Local retention removed it while it waited in the queue: a newer one is queued.
            log.warning("skipped upload of %s: no longer a committed local checkpoint", path)
            return
        try:
            self.remote.upload(path)
        except (FileNotFoundError, RemoteSyncError):
            # b2sdk reports a file that vanished as InvalidUploadSource (wrapped by the retries),
            # not as FileNotFoundError: either way, only a checkpoint still committed is an error.
            if (path / MARKER).is_file():
                raise
            # Local retention deleted it mid-upload: a newer checkpoint supersedes it, and the
            # unmarked remote copy is never picked for resume (remote retention removes it).
            log.warning("stopped upload of %s: local retention deleted it meanwhile", path)

    def _retain(self, keep: set[int]) -> None:
        deleted = self.remote.retain(keep)
        if deleted:
            log.info("deleted remote checkpoints %s", deleted)

    def _work(self) -> None:
        while (task := self._queue.get()) is not None:
            try:
                task()
            except Exception as e:  # a thread that died would silently stop every later upload
                message = f"{type(e).__name__}: {e}"
                with self._lock:
                    self._errors.append(message)
                log.error("checkpoint sync failed: %s", message)
