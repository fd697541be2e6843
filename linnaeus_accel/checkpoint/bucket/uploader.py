"""The bucket's work on one background thread (``BackgroundUploader``), and what it knows of each
checkpoint: queued, uploading, in the bucket, failed or skipped (docs/guides/checkpoints.md).

Training never waits on the network: uploads, retention in the bucket and the catch-up of a rerun
run here, in the order they were asked for. The run's end asks two things of it: ``close`` (a
bounded wait: ``ENV.OUTPUT.BUCKET.WAIT_S``; what is still running then is abandoned, and its
retries stop at their next attempt) and ``missing`` (each checkpoint the run keeps that the bucket
does not hold, once, with why). Local retention asks ``in_flight``: the checkpoint being uploaded is
never deleted under the upload, so that on a link slower than the checkpoint interval every upload
that starts finishes; one still queued when retention removes it is skipped, said in one line.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ..directory.marker import MARKER
from ..directory.store import step_name
from .remote import _STEP_DIR, RemoteCheckpoints

__all__ = ["BackgroundUploader"]

log = logging.getLogger(__name__)

QUEUED, UPLOADING, IN_BUCKET, FAILED, SKIPPED = "queued", "uploading", "in the bucket", "failed", "skipped"
_PART = (
    "this machine holds only its part of it (node-local mode): the bucket puts a checkpoint together "
    "only while every machine of the run runs"
)


@dataclass
class _Task:
    what: str  # in words, for the errors
    work: Callable[[], bool | None]  # False: there was nothing to do (the checkpoint is gone)
    step: int | None = None  # the checkpoint whose being in the bucket this decides


class BackgroundUploader:
    """Runs bucket work on one daemon thread, in submission order (a retention queued after an
    upload sees it finished). Nothing raised here reaches the training loop: each failure is
    logged, kept in ``errors``, and, for a checkpoint's upload, in that step's record."""

    def __init__(self, remote: RemoteCheckpoints) -> None:
        # A copy of its own: abandoning the work at ``close`` stops this copy's retries only.
        self.remote = copy.copy(remote)
        self._abort = self.remote.abort = threading.Event()
        self._queue: queue.Queue[_Task | None] = queue.Queue()
        self._errors: list[str] = []
        self._status: dict[int, tuple[str, str | None]] = {}  # step -> (status, why)
        self._current: int | None = None  # the step being uploaded
        self._lock = threading.Lock()
        self._closed = False
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._thread = threading.Thread(target=self._work, name="checkpoint-sync", daemon=True)
        self._thread.start()

    @property
    def errors(self) -> list[str]:
        """Every failure so far, in words (uploads, retention, other work)."""
        with self._lock:
            return list(self._errors)

    # -- asking for work -------------------------------------------------------------------------
    def submit(self, checkpoint_dir: Path) -> None:
        """Queue the upload of a just-committed checkpoint; returns at once."""
        path = Path(checkpoint_dir)
        step = _step_of(path)
        self._put(_Task(f"upload of {path.name}", lambda: self._upload(path), step))

    def run(self, what: str, task: Callable[[], bool | None], step: int | None = None) -> None:
        """Queue ``task`` (``what``: it in words, for the errors) after the work queued before it.
        ``step``: the checkpoint it puts in the bucket (a machine's part, in node-local mode), whose
        record it decides; ``task`` returns False when it found that checkpoint gone locally."""
        self._put(_Task(what, task, step))

    def retention(self, keep: set[int]) -> None:
        """Queue the deletion of remote checkpoints not in ``keep`` (after the uploads queued before)."""
        frozen = frozenset(keep)  # the caller's set may change before the worker gets to it
        self._put(_Task("remote retention", lambda: self._retain(set(frozen))))

    def catch_up(self, local: Callable[[], list[tuple[int, Path | None]]]) -> None:
        """Queue a rerun's catch-up: every checkpoint ``local()`` lists (committed on this disk; a
        path of None: a node-local machine's part, which cannot be uploaded as a checkpoint) that is
        not complete in the bucket is uploaded, the newest first, or recorded as missing; those
        complete there are recorded as in the bucket."""
        self._put(_Task("catch-up with the bucket", lambda: self._catch_up(local)))

    # -- what it knows -----------------------------------------------------------------------------
    def in_flight(self) -> set[int]:
        """The step being uploaded now (empty: none): local retention keeps it until it is in the
        bucket, so that a slow link still gets every upload it starts."""
        with self._lock:
            return set() if self._current is None else {self._current}

    def in_bucket(self, step: int) -> bool:
        with self._lock:
            return self._status.get(step, ("", None))[0] == IN_BUCKET

    def missing(self, steps: Iterable[int]) -> list[str]:
        """One sentence for each of ``steps`` (the checkpoints the run keeps) that this uploader did
        not put in the bucket nor found there: why it is not there. Steps it never heard of are not
        its to judge (a node-local run's older parts)."""
        where = self.remote.url
        out = []
        with self._lock:
            for step in sorted(set(steps)):
                status, why = self._status.get(step, ("", None))
                if status in ("", IN_BUCKET):
                    continue
                if status == FAILED:
                    reason = why or "its upload failed"
                elif status == UPLOADING:
                    reason = (
                        "its upload was still running when the run stopped waiting (ENV.OUTPUT.BUCKET.WAIT_S)"
                    )
                elif status == QUEUED:
                    reason = (
                        "its upload had not started when the run stopped waiting (ENV.OUTPUT.BUCKET.WAIT_S)"
                    )
                else:
                    reason = why or "its upload was skipped"
                out.append(f"{step_name(step)} is not in {where}: {reason}")
        return out

    # -- the end -------------------------------------------------------------------------------------
    def drain(self, timeout: float | None = None) -> bool:
        """Wait (up to ``timeout`` seconds) until every queued task has run; whether they all did."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Finish the queued work (end of run); False if it did not finish within ``timeout``
        seconds: then it is abandoned (the transfer in progress ends at its own timeout, no retry
        follows, nothing queued starts) and ``missing`` says what the bucket lacks."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abort.set()
            return False
        return True

    # -- the thread ----------------------------------------------------------------------------------
    def _put(self, task: _Task) -> None:
        with self._lock:
            if not self._closed:
                self._pending += 1
                if task.step is not None:
                    self._status[task.step] = (QUEUED, None)
                self._queue.put(task)
                return
            message = f"{task.what}: uploader already closed"
            self._errors.append(message)
            if task.step is not None:
                self._status[task.step] = (FAILED, "the uploader was already closed")
        log.error("%s skipped: uploader already closed", task.what)

    def _set(self, step: int | None, status: str, why: str | None = None) -> None:
        if step is not None:
            with self._lock:
                self._status[step] = (status, why)

    def _upload(self, path: Path) -> bool:
        """One committed checkpoint, whole; False when local retention removed it first."""
        if not (path / MARKER).is_file():
            return False
        try:
            self.remote.upload(path)
        except Exception:
            # Stores report a file that vanished in their own words (b2sdk: InvalidUploadSource,
            # wrapped by the retries): whatever the words, only a checkpoint still committed is an error.
            if (path / MARKER).is_file():
                raise
            log.warning("stopped the upload of %s: it was removed locally meanwhile", path)
            return False
        return True

    def _retain(self, keep: set[int]) -> None:
        deleted = self.remote.retain(keep)
        if deleted:
            log.info("deleted remote checkpoints %s", deleted)

    def _catch_up(self, local: Callable[[], list[tuple[int, Path | None]]]) -> None:
        here = local()
        try:
            complete = set(self.remote.complete_steps())
        except Exception as e:
            for step, _ in here:
                self._set(
                    step, FAILED, f"the bucket could not be listed to catch up: {type(e).__name__}: {e}"
                )
            raise
        todo = []
        for step, path in here:
            if step in complete:
                self._set(step, IN_BUCKET)
            elif path is None:
                self._set(step, FAILED, _PART)
            else:
                self._set(step, QUEUED)
                todo.append((step, path))
        todo.sort(reverse=True)  # the newest first: the bucket's resume point moves on soonest
        if todo:
            names = ", ".join(step_name(s) for s, _ in todo)
            log.warning(
                "catching up with %s: uploading %s (committed here, not complete there)",
                self.remote.url,
                names,
            )
        for step, path in todo:
            self._run(_Task(f"upload of {path.name}", partial(self._upload, path), step))

    def _run(self, task: _Task) -> None:
        if self._abort.is_set():
            self._set(task.step, FAILED, "abandoned when the run stopped waiting (ENV.OUTPUT.BUCKET.WAIT_S)")
            return
        with self._lock:
            self._current = task.step
            if task.step is not None:
                self._status[task.step] = (UPLOADING, None)
        try:
            done = task.work()
        except Exception as e:  # a thread that died would silently stop every later upload
            message = f"{type(e).__name__}: {e}"
            with self._lock:
                self._errors.append(message)
                if task.step is not None:
                    self._status[task.step] = (FAILED, message)
            log.error("checkpoint sync failed: %s", message)
        else:
            if done is False:
                # Removed locally before or while its turn came: a newer checkpoint supersedes it.
                self._set(task.step, SKIPPED, "removed locally (retention) before it was uploaded")
                if task.step is not None:
                    log.warning(
                        "the bucket is falling behind: skipped the upload of %s (local retention removed it "
                        "while an earlier upload ran; a newer checkpoint is queued)",
                        step_name(task.step),
                    )
            else:
                self._set(task.step, IN_BUCKET)
        finally:
            with self._lock:
                self._current = None

    def _work(self) -> None:
        while (task := self._queue.get()) is not None:
            try:
                self._run(task)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()


def _step_of(path: Path) -> int | None:
    match = _STEP_DIR.match(path.name)  # the bucket's own reading of a checkpoint directory's name
    return int(match.group(1)) if match else None
