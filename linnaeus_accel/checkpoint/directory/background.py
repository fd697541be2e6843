"""One background thread that runs a process's checkpoint work in the order it was asked for.

Training waits only for what the next optimizer step needs; committing a checkpoint (hashing and
fsyncing its files, the marker), retention deletes and handing it to the uploader run here. One job
runs at a time, so the checkpoint directory has one writer: the loop waits for the queue to drain
(``wait``) before it starts the next checkpoint or touches a checkpoint directory itself.

The thread is a daemon: a process that dies (or is killed) mid-job leaves at worst an uncommitted
checkpoint, which a resume ignores, exactly as a kill inside a synchronous commit would.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)


class JobFailed(Exception):
    """A background job raised; ``what`` says which job, in words, ``__cause__`` is the error."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class SerialWorker:
    """Runs submitted jobs one after another on a single thread, started when a job is queued and
    ended when the queue is empty.

    A job that raises stops the queue: the jobs after it belong to the checkpoint that failed or
    would act on a directory in an unknown state, so they are dropped, and the failure is kept for
    ``take_failure`` (the loop raises it on every process at its next agreement point)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: deque[tuple[str, Callable[[], None]]] = deque()
        self._busy = False
        self._failure: JobFailed | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, what: str, job: Callable[[], None]) -> None:
        """Queue ``job`` (``what``: it in words, for the error message)."""
        with self._cond:
            if self._failure is not None:
                return  # the queue stopped at a failure: this job belonged after it
            self._jobs.append((what, job))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> float:
        """Block until every queued job has run (or ``timeout`` seconds passed); the seconds waited."""
        started = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout)
        return time.perf_counter() - started

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._jobs and not self._busy

    def failed(self) -> bool:
        with self._cond:
            return self._failure is not None

    def take_failure(self) -> JobFailed | None:
        """The failure that stopped the queue (once), None if none did; the queue runs again."""
        with self._cond:
            failure, self._failure = self._failure, None
            return failure

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._jobs:  # idle: the thread ends (none lingers into interpreter shutdown)
                    self._thread = None
                    return
                what, job = self._jobs.popleft()
                self._busy = True
            try:
                job()
            except BaseException as exc:  # kept for the loop: a thread's exception is otherwise lost
                log.error("%s failed: %s", what, exc)
                failure = JobFailed(what)
                failure.__cause__ = exc
                with self._cond:
                    self._failure = failure
                    self._jobs.clear()
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
