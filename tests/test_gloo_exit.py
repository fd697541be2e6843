"""The exit of a multi-process run waits while a gloo thread still runs (it may be about to drop a
work object, which takes the GIL: at interpreter shutdown that aborted a finished run with -6)."""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import pytest

from linnaeus_accel.process.gloo_exit import wait_for_gloo_threads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _name_this_thread(name: str) -> None:
    """Set the kernel's name of the calling thread (what /proc shows), as gloo names its threads."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_name = 15
    assert libc.prctl(pr_set_name, name.encode(), 0, 0, 0) == 0


def _busy_gloo_thread(busy_s: float, done: threading.Event) -> threading.Thread:
    """A thread named as gloo's runloop that keeps a core busy for ``busy_s``, then sleeps until
    ``done`` (which also ends the busy part)."""

    def run() -> None:
        _name_this_thread("pt_gloo_runloop")
        end = time.monotonic() + busy_s
        while time.monotonic() < end and not done.is_set():
            pass
        done.wait()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_exit_waits_until_a_running_gloo_thread_is_idle() -> None:
    done = threading.Event()
    thread = _busy_gloo_thread(0.3, done)
    try:
        start = time.monotonic()
        assert wait_for_gloo_threads(limit_s=5.0)
        assert time.monotonic() - start >= 0.25  # it waited for the busy thread to go to sleep
    finally:
        done.set()
        thread.join()


def test_the_exit_is_not_held_longer_than_its_limit() -> None:
    done = threading.Event()
    thread = _busy_gloo_thread(30.0, done)
    try:
        start = time.monotonic()
        assert not wait_for_gloo_threads(limit_s=0.2)
        assert time.monotonic() - start < 2.0
    finally:
        done.set()
        thread.join()


def test_without_gloo_threads_the_exit_costs_milliseconds() -> None:
    start = time.monotonic()
    assert wait_for_gloo_threads()
    assert time.monotonic() - start < 0.5
