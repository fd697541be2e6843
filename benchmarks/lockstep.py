"""The lock-step: two training loops timed one optimizer step at a time, side by side.

Each side trains in its own worker process (a fresh interpreter: Accelerate's state is per
process, and a side's import and set-up cost stays out of the other's way); both workers are
pinned to the same core with one torch thread. After every optimizer step a side calls its
``Baton``: it notes the time since it last got the baton, tells the referee (the benchmark's
process, over a socket pair) that its step is done and blocks until told to go on. The referee
lets the two sides take one step each, strictly alternately (A B A B ...), so the i-th steps of
both sides are taken back to back, only one side runs at a time, and every step starts right after
a step of the other side: never twice in a row, whose warm caches made a step ~10% faster when the
order alternated. Each interval runs from the moment a side gets the baton to the next time it
hands it back: everything the loop does between two optimizer steps (loading the batch, the loss,
the step, the metric window, logging, the progress bar, an epoch boundary) falls in exactly one
interval, and the hand-over itself (two context switches through the referee) falls in none.

Why processes and not one process driving both loops as generators: ``Trainer.fit`` is the real
loop, and it cannot yield without being rewritten (a thread would hand the GIL back and forth at
each step, a worse clock than a socket); two processes also keep two Accelerator states apart.

A side is a function ``side(spec, baton) -> dict`` named ``"module:function"`` in its spec; see
``workloads`` for ours, the hand-written loop's and how our trainer gets its baton.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from importlib import import_module
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from .common import pin_to_one_core

REPO = Path(__file__).resolve().parents[1]
# Set by launchers, fault tests and Accelerate's launcher: a worker is one plain process.
LAUNCH_VARIABLES = ("LINNAEUS_ACCEL_", "ACCELERATE_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


# -- the lock-step: worker side ----------------------------------------------------------------------
class Baton:
    """Called after every optimizer step: times the interval since the baton came, hands it to the
    referee and waits for it. False once the referee has ended the lock-step (the side may stop).
    The first call pins the process to one core: set-up (imports, model, trainer) runs before,
    on every core, both sides at once."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.times: list[float] = []
        self.start: float | None = None
        self.free = False

    def __call__(self) -> bool:
        if self.free:
            return False
        now = time.perf_counter()
        if self.start is not None:
            self.times.append(now - self.start)
        else:
            pin_to_one_core()
        self.conn.send_bytes(b"d")
        if self.conn.recv_bytes() == b"e":
            self.free = True
            return False
        self.start = time.perf_counter()
        return True


def worker(fd: int) -> None:
    """A worker process: runs the sides it is sent, one at a time, until told to quit."""
    from accelerate.state import AcceleratorState, GradientState

    conn = Connection(fd)
    cores = os.sched_getaffinity(0)
    while (message := conn.recv())[0] == "run":
        os.sched_setaffinity(0, cores)  # set-up on every core; the baton pins the lock-step
        spec = message[1]
        AcceleratorState._reset_state(True)  # a fresh Accelerator for every run
        GradientState._reset_state()
        baton = Baton(conn)
        try:
            module, _, name = spec["side"].partition(":")
            side = getattr(import_module(module), name)
            result = side(spec, baton)
            conn.send(("result", {**result, "times": baton.times}))
        except Exception:
            conn.send(("error", traceback.format_exc()))
    # Seconds saved per worker: nothing left to tear down that the next run or the OS would need.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- the lock-step: referee side -------------------------------------------------------------------
class Workers:
    """Two worker processes (both pinned to one core by themselves), reused from run to run.
    Their output goes to ``log`` (the progress bars, the trainer's messages)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="linnaeus-bench-"))
        self.log = self.dir / "workers.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARIABLES)}
        # The CPU, as on the machines the targets are for; nothing to download, ever.
        env.update({"CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self.conns: list[Connection] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        with self.log.open("ab") as log:
            for _ in range(2):
                referee_end, worker_end = socket.socketpair()
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "benchmarks.lockstep", str(worker_end.fileno())],
                        pass_fds=[worker_end.fileno()],
                        cwd=REPO,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
                worker_end.close()
                self.conns.append(Connection(referee_end.detach()))

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, failed: type[BaseException] | None, *exc: object) -> None:
        """Workers told to quit (killed after a failure: they may be waiting mid-run); their files
        removed after a success, kept with their log after a failure."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("quit",))
                conn.close()
        for proc in self.procs:
            if failed is not None:
                proc.kill()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if failed is None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _next(self, conn: Connection, timeout: float) -> Any:
        """None when the side has taken a step, else its last message: its result, or its error."""
        if not conn.poll(timeout):
            raise TimeoutError(f"a benchmark side took over {timeout:.0f} s for one step; see {self.log}")
        data = conn.recv_bytes()
        if data == b"d":
            return None
        message = pickle.loads(data)
        if message[0] != "result":
            raise RuntimeError(f"a benchmark side failed (output in {self.log}):\n{message[1]}")
        return message[1]

    def lockstep(
        self, a: dict[str, Any], b: dict[str, Any], rounds: int | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Run side ``a`` on the first worker and ``b`` on the second, alternately, one optimizer
        step each after a first untimed one: ``rounds`` steps each (the sides are then told to stop
        timing and finish as they like), or with None until both have finished their runs. Each
        result holds ``times``, one interval per step taken after the first."""
        run_dir = Path(tempfile.mkdtemp(dir=self.dir))
        for conn, spec, name in zip(self.conns, (a, b), ("a", "b"), strict=True):
            conn.send(("run", {**spec, "out": str(run_dir), "name": name}))
        results: dict[int, Any] = {}
        for i, conn in enumerate(self.conns):  # set-up and the first step (imports included)
            if (result := self._next(conn, timeout=600)) is not None:
                results[i] = result
        cores = os.sched_getaffinity(0)
        # On the sides' core: a hand-over is then two context switches on one core, not a wake-up
        # of this process on a core other work may be holding.
        os.sched_setaffinity(0, {max(cores)})
        try:
            done = 0
            while len(results) < 2 and (rounds is None or done < rounds):
                for i, conn in enumerate(self.conns):
                    if i not in results:
                        conn.send_bytes(b"g")
                        if (result := self._next(conn, timeout=120)) is not None:
                            results[i] = result
                done += 1
        finally:
            os.sched_setaffinity(0, cores)
        for i, conn in enumerate(self.conns):
            if i not in results:
                conn.send_bytes(b"e")
                results[i] = self._next(conn, timeout=600)
                if results[i] is None:
                    raise RuntimeError(
                        f"a benchmark side went on stepping after the lock-step ended; see {self.log}"
                    )
        if rounds is not None and any(len(r["times"]) != rounds for r in results.values()):
            raise RuntimeError(f"a benchmark side ended its run before {rounds} steps; see {self.log}")
        return results[0], results[1]


Case = tuple[str, dict[str, Any], dict[str, Any], int | None]  # name, side a, side b, rounds
Segment = tuple[dict[str, Any], dict[str, Any]]  # the results of sides a and b of one lock-step run


_shared: list[Workers | None] = []  # inside ``shared_pair``: its one pair once started, else None


@contextlib.contextmanager
def shared_pair() -> Iterator[None]:
    """Within it, every ``run_segments`` of one pair without swaps (a smoke run's) uses the same
    pair of workers, started at the first: the benchmarks of one ``python -m benchmarks --smoke``
    pay the workers' imports (torch, Accelerate, transformers: seconds each) once instead of once
    each. A pair that failed is not reused."""
    _shared.append(None)
    try:
        yield
    finally:
        if (workers := _shared.pop()) is not None:
            workers.__exit__(None)


def _run_on(workers: Workers, cases: list[Case], swap: bool, results: dict[str, list[Segment]]) -> None:
    for name, a, b, rounds in cases:
        results[name].append(workers.lockstep(a, b, rounds))
        if swap:
            second, first = workers.lockstep(b, a, rounds)
            results[name].append((first, second))


def run_segments(cases: list[Case], worker_pairs: int, swap: bool) -> dict[str, list[Segment]]:
    """Each case ``(name, side a, side b, rounds)`` run in lock-step (``Workers.lockstep``) on ``worker_pairs`` fresh
    pairs of workers, and with ``swap`` a second time on each pair with the workers' roles swapped.
    Why: the same loop runs up to ~3% (80 µs a step) faster in one of two workers than in the
    other, steadily, for the life of the pair, in either order (seen in A/A runs; code placement
    in each process is the likely cause); swapping the roles and taking fresh pairs cancels it.
    One pair without swaps inside ``shared_pair`` is that context's pair, not a fresh one."""
    results: dict[str, list[Segment]] = {name: [] for name, *_ in cases}
    if _shared and worker_pairs == 1 and not swap:
        workers = _shared[-1] or Workers()
        _shared[-1] = None  # until the cases are done: a failure below leaves no broken pair to reuse
        try:
            _run_on(workers, cases, swap, results)
        except BaseException as exc:
            workers.__exit__(type(exc))
            raise
        _shared[-1] = workers
        return results
    for _ in range(worker_pairs):
        with Workers() as workers:
            _run_on(workers, cases, swap, results)
    return results


def pooled(segments: list[Segment], skip: int | None = None) -> tuple[list[float], list[float]]:
    """Both sides' step times of every segment, less the first ``skip`` of each (default: 10%, at
    least 1: start-up, first allocations)."""
    a: list[float] = []
    b: list[float] = []
    for first, second in segments:
        n = len(first["times"])
        drop = max(1, n // 10) if skip is None else skip
        a += first["times"][drop:]
        b += second["times"][drop:]
    return a, b


if __name__ == "__main__":
    worker(int(sys.argv[1]))
