"""``python -m benchmarks.gpu OUT_DIR [--only PART ...] [--size full|tiny] [--budget-s S]``.

Runs each part of the GPU check (``benchmarks.gpu.PARTS``) in a process of its own, with a time
limit, and writes to ``OUT_DIR``: ``results.json`` (every part's status, checks and figures, the
device, the versions; rewritten as each part ends, so a check cut short keeps what it measured),
``log.txt`` (what ran, the GPU, each part's outcome), ``<part>.log`` (each part's output, written
as it runs) and ``run_logs.tar.gz`` (the output of every training run the parts started). Run
directories and checkpoints stay in ``--work``. ``--size`` defaults to ``full`` where
CUDA is available and ``tiny`` elsewhere (the CPU run CI makes: every code path at toy sizes, its
CUDA-only parts reported as not run). Exit status 1 when a part failed, else 0.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from . import CONCURRENT, PARTS
from .common import REPO, Context, Part, cuda_device

# Seconds each part may take at full size (a guard against a hang, well above what it needs).
LIMITS = {
    "e2e": 300,
    "sharded": 360,
    "throughput": 360,
    "recipe": 480,
    "species": 240,
    "host_sync": 180,
    "checkpoint": 240,
}
TINY_LIMIT = 300


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="where results.json and log.txt are written")
    parser.add_argument(
        "--only", nargs="+", choices=list(PARTS), metavar="PART", help=f"of {', '.join(PARTS)}"
    )
    parser.add_argument("--size", choices=("full", "tiny"), default=None)
    parser.add_argument(
        "--work", type=Path, default=None,
        help="run directories and checkpoints, GBs at full size (default: linnaeus-gpu-work in the temp "
        "directory, emptied first)",
    )  # fmt: skip
    parser.add_argument(
        "--budget-s", type=float, default=None, help="stop starting parts once this many seconds have passed"
    )
    parser.add_argument("--part", help=argparse.SUPPRESS)  # internal: run one part in this process
    parser.add_argument("--limit-s", type=float, help=argparse.SUPPRESS)  # internal: that part's time limit
    return parser.parse_args(argv)


def run_one(name: str, ctx: Context, result_file: Path) -> int:
    """In the part's own process: run it, write its Part as JSON."""
    module = importlib.import_module(PARTS[name])
    started = time.perf_counter()
    try:
        part: Part = module.run_part(ctx)
    except Exception as exc:
        traceback.print_exc()
        part = Part(name, module.TITLE, reason=f"{type(exc).__name__}: {exc}")
    result = {**part.finish().as_json(), "seconds": round(time.perf_counter() - started, 1)}
    print(f"{name}: {result['status']}" + (f" ({result['reason']})" if result["reason"] else ""))
    for key, value in result["figures"].items():
        print(f"  {key}: {json.dumps(value, default=str)}")
    result_file.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    return 0


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for package in ("linnaeus-accel", "torch", "accelerate", "transformers", "peft", "deepspeed", "pydantic"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def git_commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def nvidia_smi() -> str:
    try:
        return subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "(no nvidia-smi)"


def pack_run_logs(work: Path, target: Path) -> None:
    """The output of every run the parts started (``log*.txt``, the lock-step sides' logs): small
    text, whereas the run directories beside them hold GBs of checkpoints."""
    with tarfile.open(target, "w:gz") as tar:
        for path in sorted(work.rglob("*")):
            if path.is_file() and path.suffix in (".txt", ".log") and path.stat().st_size < 20_000_000:
                tar.add(path, arcname=path.relative_to(work).as_posix())


class Runner:
    """Starts parts as processes, each with its log and time limit, and gathers their results."""

    def __init__(self, args: argparse.Namespace, size: str, cuda: bool) -> None:
        self.args, self.size, self.cuda = args, size, cuda
        self.started = time.perf_counter()
        self.work = (args.work or Path(tempfile.gettempdir()) / "linnaeus-gpu-work").resolve()
        self.log = args.out / "log.txt"

    def limit(self, name: str) -> float | None:
        """The part's time limit; None when the budget has no time left for it."""
        limit = float(LIMITS[name] if self.size == "full" else TINY_LIMIT)
        if self.args.budget_s is not None:
            left = self.args.budget_s - (time.perf_counter() - self.started)
            if left < 30:
                return None
            limit = min(limit, left)
        return limit

    def say(self, text: str) -> None:
        print(text, flush=True)
        with self.log.open("a", encoding="utf-8") as out:
            out.write(text + "\n")

    def start(self, name: str) -> tuple[subprocess.Popen[bytes], Path, float] | None:
        limit = self.limit(name)
        if limit is None:
            return None
        result, log = self.work / f"{name}.json", self.args.out / f"{name}.log"
        result.unlink(missing_ok=True)
        command = [sys.executable, "-m", "benchmarks.gpu", str(self.args.out), "--part", name]
        command += ["--size", self.size, "--work", str(self.work), "--limit-s", f"{limit:.0f}"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        if not self.cuda:
            # Parts that train in their own process share the CPU's cores with the others: torch's
            # threads, one per core in each, would spin against each other (host_sync: 5x the CPU time).
            env["OMP_NUM_THREADS"] = "1"
        with log.open("wb") as out:
            proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
        self.say(f"-- {name}: started (limit {limit:.0f} s)")
        return proc, result, limit

    def finish(self, name: str, started: tuple[subprocess.Popen[bytes], Path, float] | None,
               begun: float) -> dict[str, Any]:  # fmt: skip
        module = importlib.import_module(PARTS[name])
        if started is None:
            return {**Part(name, module.TITLE, status="not run", reason="out of time (--budget-s)").as_json()}
        proc, result_file, limit = started
        try:
            proc.wait(timeout=max(1.0, limit - (time.perf_counter() - begun)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        seconds = round(time.perf_counter() - begun, 1)
        if result_file.exists():
            result: dict[str, Any] = json.loads(result_file.read_text(encoding="utf-8"))
        else:
            reason = (
                f"timed out after {limit:.0f} s" if proc.returncode == -9 else f"exited {proc.returncode}"
            )
            result = Part(name, module.TITLE, status="failed", reason=reason + ", no result").as_json()
        result["seconds"] = seconds
        self.say(
            f"-- {name}: {result['status']} in {seconds} s"
            + (f" ({result['reason']})" if result.get("reason") else "")
        )
        return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    size = args.size or ("full" if cuda else "tiny")
    if args.part is not None:  # one part, in this process
        work = args.work.resolve()
        work.mkdir(parents=True, exist_ok=True)
        return run_one(args.part, Context(work, size, cuda, args.limit_s), work / f"{args.part}.json")
    args.out.mkdir(parents=True, exist_ok=True)
    runner = Runner(args, size, cuda)
    shutil.rmtree(runner.work, ignore_errors=True)  # a previous check's runs would be resumed
    runner.work.mkdir(parents=True)
    command = "python -m benchmarks.gpu " + " ".join(sys.argv[1:] if argv is None else argv)
    runner.log.write_text(f"{command}\n{nvidia_smi()}\n", encoding="utf-8")
    names = [n for n in PARTS if args.only is None or n in args.only]
    results: dict[str, dict[str, Any]] = {}
    head = {
        "command": command,
        "size": size,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": cuda_device() or {"name": "cpu", "cores": os.cpu_count()},
        "python": platform.python_version(),
        "versions": versions(),
        # A copy of the tree sent to a lent machine names its commit in the environment (the .git
        # there, if any, is not the tree's: it said the session's first commit).
        "git_commit": os.environ.get("LINNAEUS_GPU_COMMIT") or git_commit(),
    }

    def write_results() -> dict[str, Any]:
        out = {**head, "seconds": round(time.perf_counter() - runner.started, 1)}
        out["parts"] = [results[n] for n in names if n in results]
        (args.out / "results.json").write_text(
            json.dumps(out, indent=1, default=str) + "\n", encoding="utf-8"
        )
        return out

    if size == "tiny":  # nothing is timed: every part at once (one torch thread each on a CPU)
        waves = [names]
    else:  # the parts that check correctness together, then each timed part alone
        waves = [[n for n in names if n in CONCURRENT], *([n] for n in names if n not in CONCURRENT)]
    for wave in waves:
        begun = time.perf_counter()
        running = {name: runner.start(name) for name in wave}
        for name in wave:
            results[name] = runner.finish(name, running[name], begun)
            write_results()
    out = write_results()
    pack_run_logs(runner.work, args.out / "run_logs.tar.gz")
    failed = [n for n in names if results[n]["status"] == "failed"]
    print(f"\n{len(names)} parts in {out['seconds']} s: "
          + ", ".join(f"{n} {results[n]['status']}" for n in names)
          + f"; written to {args.out / 'results.json'}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
