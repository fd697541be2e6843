"""A ``linnaeus-accel train`` subprocess (``TrainRun``), killed or not, and reading and comparing
what it leaves: metrics.jsonl, summary.json, the committed checkpoints and their journals.

Every run writes its console to a file under its root; a resumed run must end exactly where an
uninterrupted one ends (``assert_same_run``).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from helpers.configs import CFG
from helpers.processes import accelerate_launch_command, kill_group, kill_tree, launch_env, read_log

NAME = "run"
RUN_TIMEOUT_S = 300
KILLED = -signal.SIGKILL


def ckpt(step: int) -> str:
    return f"step_{step:08d}"


@dataclass
class Result:
    """One finished (or killed) process: exit status, console output, the run's output directory."""

    returncode: int
    output: str
    dir: Path
    seconds: float
    active_seconds: float = 0.0  # from the creation of metrics.jsonl (start-up done) to the exit

    def tail(self, n: int = 4000) -> str:
        return f"exit status {self.returncode}; console (tail):\n{self.output[-n:]}"

    def check_ok(self) -> Result:
        assert self.returncode == 0, self.tail()
        return self

    def check_killed(self) -> Result:
        assert self.returncode == KILLED, f"expected a SIGKILL at the fault point\n{self.tail()}"
        return self


@dataclass
class Started:
    proc: subprocess.Popen[bytes]
    log: Path
    dir: Path
    t0: float

    def finish(self, timeout: float = RUN_TIMEOUT_S) -> Result:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(self.proc)
            raise
        return Result(rc, read_log(self.log), self.dir, time.monotonic() - self.t0)


class TrainRun:
    """One output directory (``<root>/outputs/run``) and the command line that trains into it."""

    def __init__(self, root: Path, opts: Sequence[str], processes: int = 1, cfg: str = CFG) -> None:
        self.cfg = cfg
        self.root = root
        self.base = root / "outputs"
        self.dir = self.base / NAME
        self.opts = list(opts)
        self.processes = processes
        self._launches = 0

    def command(self, args: Sequence[str], python_code: str | None) -> list[str]:
        if self.processes > 1:
            prefix = [*accelerate_launch_command(self.processes), "-m", "linnaeus_accel"]
        elif python_code is not None:
            prefix = [sys.executable, "-c", python_code]
        else:
            prefix = [sys.executable, "-m", "linnaeus_accel"]
        return [
            *prefix, "train", "--cfg", self.cfg, *args,
            "--opts", "ENV.OUTPUT.BASE_DIR", str(self.base), "EXPERIMENT.NAME", NAME, *self.opts,
        ]  # fmt: skip

    def env(self, kill_at: str | None, extra_env: dict[str, str] | None = None) -> dict[str, str]:
        extra = {"LINNAEUS_ACCEL_KILL_AT": kill_at} if kill_at is not None else {}
        # other fault points, settings of Accelerate's own
        return launch_env(self.root, cpu=self.processes > 1, extra={**extra, **(extra_env or {})})

    def start(
        self,
        kill_at: str | None = None,
        args: Sequence[str] = (),
        python_code: str | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> Started:
        self._launches += 1
        log = self.root / f"launch{self._launches}{'-' + kill_at.replace(':', '') if kill_at else ''}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                self.command(args, python_code),
                cwd=self.root,
                env=self.env(kill_at, extra_env),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: nothing of it outlives a failed test
            )
        return Started(proc, log, self.dir, time.monotonic())

    def run(
        self,
        kill_at: str | None = None,
        args: Sequence[str] = (),
        python_code: str | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> Result:
        return self.start(kill_at, args, python_code, extra_env).finish()

    def clone(self, root: Path) -> TrainRun:
        """A copy of this output directory (e.g. of a killed run) to resume or damage separately."""
        other = TrainRun(root, self.opts, self.processes, self.cfg)
        shutil.copytree(self.base, other.base, symlinks=True)
        return other


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def read_summary(run_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    return data


def is_train(record: dict[str, Any]) -> bool:
    return "train/loss" in record


def is_val(record: dict[str, Any]) -> bool:
    return any(k.startswith("val") for k in record)


def deterministic(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics record without its wall-clock measurements (throughput, data-time share)."""
    return {k: v for k, v in record.items() if not k.startswith("perf/")}


def journal(checkpoint: Path) -> list[str]:
    path = checkpoint / "validation_journal.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["prefix"] for line in path.read_text(encoding="utf-8").splitlines()]


def committed(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.glob("step_*") if (p / "COMMITTED.json").is_file())


def assert_same_run(result: Result, reference: Result) -> None:
    """The resumed run ended exactly where the uninterrupted one did (docs/semantics.md §6 and docs/design.md §4)."""
    result.check_ok()
    final, ref_final = (
        result.dir / "final" / "model.safetensors",
        reference.dir / "final" / "model.safetensors",
    )
    assert final.is_file(), f"no final weights\n{result.tail()}"
    assert final.read_bytes() == ref_final.read_bytes(), (
        f"final weights differ from the uninterrupted run\n{result.tail()}"
    )
    ema, ref_ema = (r.dir / "final" / "ema" / "model.safetensors" for r in (result, reference))
    assert ema.is_file() == ref_ema.is_file()
    if ref_ema.is_file():  # the ema callback's average
        assert ema.read_bytes() == ref_ema.read_bytes(), "the ema callback's average differs"

    got, want = read_summary(result.dir), read_summary(reference.dir)
    assert got["status"] == "completed", got
    for key in ("global_step", "epoch", "samples_seen", "tokens_seen"):
        assert got[key] == want[key], (key, got[key], want[key])

    records, ref_records = read_metrics(result.dir), read_metrics(reference.dir)
    for kind, select in (("train", is_train), ("validation", is_val)):
        steps = [r["global_step"] for r in records if select(r)]
        ref_steps = [r["global_step"] for r in ref_records if select(r)]
        duplicates = sorted({s for s in steps if steps.count(s) > 1})
        assert not duplicates, f"{kind} steps logged twice: {duplicates}"
        missing = sorted(set(ref_steps) - set(steps))
        assert not missing, f"{kind} steps missing after the resume: {missing}"
        assert steps == ref_steps, f"{kind} steps {steps} != {ref_steps}"
    # Same values too: losses, LRs, sample counts, validation metrics, as the same floats.
    assert [deterministic(r) for r in records] == [deterministic(r) for r in ref_records]


def wait_until(started: Started, done: Callable[[], bool], what: str, timeout: float = RUN_TIMEOUT_S) -> None:
    """Poll ``done`` until it holds. The test fails saying what it waited for if the run ends first,
    or if ``timeout`` passes (the run and every process it started are killed then)."""
    deadline = time.monotonic() + timeout
    while not done():
        if started.proc.poll() is not None:
            pytest.fail(f"the run ended before {what}\n{read_log(started.log)[-3000:]}")
        if time.monotonic() > deadline:
            kill_tree(started.proc.pid)  # workers in sessions of their own too
            kill_group(started.proc)
            pytest.fail(f"timed out waiting until {what}")
        time.sleep(0.01)


def wait_for_file(started: Started, path: Path, timeout: float = RUN_TIMEOUT_S) -> float:
    """Poll until ``path`` exists; when it appeared (``time.monotonic()``)."""
    wait_until(started, path.exists, f"{path} appeared", timeout)
    return time.monotonic()


def wait_for_output(started: Started, text: str, timeout: float = RUN_TIMEOUT_S) -> None:
    """Poll until the run's console holds ``text``."""
    wait_until(started, lambda: text in read_log(started.log), f"it printed {text!r}", timeout)


def logged_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records metrics.jsonl holds so far (none before it exists); a line being written, or cut
    short by a kill, is left out."""
    path = run_dir / "metrics.jsonl"
    records = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


def wait_for_record(
    started: Started, predicate: Callable[[dict[str, Any]], bool], timeout: float = RUN_TIMEOUT_S
) -> None:
    """Poll metrics.jsonl until a record satisfies ``predicate`` (the run is then mid-training)."""

    def done() -> bool:
        return any(predicate(record) for record in logged_records(started.dir))

    wait_until(started, done, "metrics.jsonl held the awaited record", timeout)


def resume_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("resumed from ")]
    assert len(lines) == 1, f"expected one 'resumed from' line, got {lines}\n{output[-3000:]}"
    return lines[0]


def assert_resumed_from(output: str, step: int) -> None:
    line = resume_line(output)
    assert re.match(rf"resumed from \S*{ckpt(step)}\b", line), line


def assert_preempted(result: Result, total_steps: int, checked_every: int = 1, epoch_steps: int = 1) -> int:
    """The run stopped at a step where the processes agree on the flag: every ``checked_every``
    steps and at every epoch's last step."""
    result.check_ok()
    data = read_summary(result.dir)
    assert data["status"] == "preempted", data
    step = data["global_step"]
    assert 0 < step < total_steps, data
    assert step % checked_every == 0 or step % epoch_steps == 0, data
    assert ckpt(step) in committed(result.dir), committed(result.dir)
    assert not (result.dir / "final").exists()  # a preempted run's weights are in its checkpoint
    return int(step)
