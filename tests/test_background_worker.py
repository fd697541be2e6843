"""The background thread that commits checkpoints: jobs run in order, one at a time; a failure
stops the queue (the jobs after it belonged to the failed checkpoint) and is handed over once; no
thread outlives its work (none lingers into the interpreter's shutdown)."""

from __future__ import annotations

import threading
import time

from linnaeus_accel.checkpoint.directory.background import JobFailed, SerialWorker


def test_jobs_run_in_order_one_at_a_time_and_wait_blocks_until_done() -> None:
    worker = SerialWorker("test")
    ran: list[int] = []
    running = threading.Semaphore(1)

    def job(i: int) -> None:
        assert running.acquire(blocking=False), "two jobs ran at once"
        time.sleep(0.01)
        ran.append(i)
        running.release()

    for i in range(5):
        worker.submit(f"job {i}", lambda i=i: job(i))
    waited = worker.wait()
    assert ran == [0, 1, 2, 3, 4]
    assert waited >= 0.03  # it did wait for the queue (5 x 10 ms, the first perhaps already done)
    assert worker.idle
    assert worker.take_failure() is None


def test_a_failure_stops_the_queue_and_is_handed_over_once() -> None:
    worker = SerialWorker("test")
    ran: list[str] = []

    def fail() -> None:
        raise OSError(28, "No space left on device")

    worker.submit("commit 1", lambda: ran.append("commit 1"))
    worker.submit("commit 2", fail)
    worker.submit("retention after 2", lambda: ran.append("retention after 2"))
    worker.wait()
    assert ran == ["commit 1"]  # what followed the failure was dropped
    assert worker.failed()
    worker.submit("queued while failed", lambda: ran.append("queued while failed"))
    worker.wait()
    assert ran == ["commit 1"]

    failure = worker.take_failure()
    assert isinstance(failure, JobFailed)
    assert failure.what == "commit 2"
    assert isinstance(failure.__cause__, OSError)
    assert failure.__cause__.errno == 28
    assert worker.take_failure() is None  # once

    worker.submit("commit 3", lambda: ran.append("commit 3"))  # the queue runs again
    worker.wait()
    assert ran == ["commit 1", "commit 3"]


def test_the_thread_ends_when_the_queue_is_empty() -> None:
    worker = SerialWorker("linnaeus-test-worker")
    worker.submit("a", lambda: time.sleep(0.01))
    worker.wait()
    deadline = time.monotonic() + 5
    while any(t.name == "linnaeus-test-worker" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the worker thread outlived its work"
        time.sleep(0.01)
    worker.submit("b", lambda: None)  # and starts again when needed
    worker.wait()
    assert worker.idle


def test_wait_with_a_timeout_returns_while_a_job_still_runs() -> None:
    worker = SerialWorker("test")
    release = threading.Event()
    worker.submit("slow", release.wait)
    started = time.perf_counter()
    worker.wait(timeout=0.05)
    assert time.perf_counter() - started < 1.0
    assert not worker.idle
    release.set()
    worker.wait()
    assert worker.idle
