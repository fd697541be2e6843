"""What the parts of the GPU check share: where they write, how a part reports, how a run of
``linnaeus-accel`` is started and its weights compared.

A part returns a ``Part``: its checks (each a named yes/no with what was seen), its figures and a
status. ``passed`` needs at least one check and every check true; ``not run`` says why (no CUDA,
no DeepSpeed) and is never counted as passed; ``failed`` is a check that did not hold or an error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..lockstep import LAUNCH_VARIABLES

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
ACCELERATE_CONFIGS = REPO / "accelerate_configs"
# bf16 final weights of a run resumed with non-deterministic GPU kernels agree with an uninterrupted
# run's to about this (the tolerance tests/test_gpu_sharded.py uses).
RTOL, ATOL = 2e-2, 2e-3


@dataclasses.dataclass
class Context:
    """Where a part works and how big it runs. ``size``: ``full`` (the GPU figures) or ``tiny``
    (CPU, in CI: every code path, figures meaningless); ``limit_s``: the seconds the part may take
    before it is killed (None: not known), which ``--budget-s`` can make shorter than its own."""

    work: Path
    size: str
    cuda: bool
    limit_s: float | None = None

    @property
    def full(self) -> bool:
        return self.size == "full"

    def say(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


@dataclasses.dataclass
class Part:
    """One part's outcome, as it goes into results.json."""

    name: str
    title: str
    status: str = "passed"  # passed | failed | not run
    reason: str | None = None  # why not run, or the error that failed it
    checks: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    not_run: list[str] = dataclasses.field(default_factory=list)  # sub-cases not run, and why

    def check(self, name: str, ok: bool, detail: Any = "") -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": str(detail)})
        print(f"  {'ok  ' if ok else 'FAIL'} {name}{': ' + str(detail) if detail != '' else ''}", flush=True)
        return bool(ok)

    def finish(self) -> Part:
        if self.status == "not run":
            return self
        if self.reason is not None or not self.checks or not all(c["ok"] for c in self.checks):
            self.status = "failed"
            if self.reason is None:
                failed = [c["name"] for c in self.checks if not c["ok"]]
                self.reason = f"checks failed: {', '.join(failed)}" if failed else "no check ran"
        return self

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def not_run(name: str, title: str, reason: str) -> Part:
    return Part(name, title, status="not run", reason=reason)


# -- runs of linnaeus-accel ------------------------------------------------------------------------
def run_env(cuda: bool, **extra: str) -> dict[str, str]:
    """The environment of a run: the caller's, less launcher, fault-point and Accelerate variables
    (each run gets exactly what its part sets), offline, this checkout first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARIABLES)}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_MODE="offline",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if not cuda:
        # Runs share the CPU's cores: torch's threads, one per core in each process, would spin
        # against each other (5-7x slower on 2 cores).
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


@dataclasses.dataclass
class Done:
    """A finished command: exit status, seconds, its output (stdout and stderr together)."""

    returncode: int
    seconds: float
    output: str
    log: Path

    @property
    def killed(self) -> bool:
        return self.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)


def run(command: Sequence[str], env: dict[str, str], log: Path, timeout: float) -> Done:
    """Run ``command`` from the repository root, its output into ``log``; a command past
    ``timeout`` is killed with its process group (launchers start workers)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with log.open("w", encoding="utf-8") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        proc = subprocess.Popen(
            list(command), cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = 124
            out.write(f"\n[timed out after {timeout:.0f} s: killed]\n")
    return Done(code, time.perf_counter() - started, log.read_text(encoding="utf-8", errors="replace"), log)


def train_command(cfg: Path, opts: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "linnaeus_accel", "train", "--cfg", str(cfg), "--opts", *opts]


def launch_command(config_file: Path, processes: int, cfg: Path, opts: Sequence[str]) -> list[str]:
    """``accelerate launch --config_file ... -m linnaeus_accel train``, on a free port."""
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(config_file), "--num_processes", str(processes),
        "--main_process_port", str(free_port()),
        "-m", "linnaeus_accel", "train", "--cfg", str(cfg), "--opts", *opts,
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


# -- weights ----------------------------------------------------------------------------------------
def weight_files(final: Path) -> dict[str, Path]:
    """Every safetensors file under a run's ``final/`` (the model, ema/, an adapter, merged/)."""
    return {p.relative_to(final).as_posix(): p for p in sorted(final.rglob("*.safetensors"))}


def compare_weights(a: Path, b: Path) -> dict[str, Any]:
    """Two runs' ``final/`` directories: the same files and tensor names, whether every tensor is
    bitwise equal, the largest absolute difference, and whether they agree within bf16 tolerance."""
    import torch
    from safetensors.torch import load_file

    files_a, files_b = weight_files(a), weight_files(b)
    result: dict[str, Any] = {"files": sorted(files_a), "same_files": sorted(files_a) == sorted(files_b)}
    bitwise, close, worst, worst_name = bool(files_a) and result["same_files"], True, 0.0, ""
    for rel in sorted(set(files_a) & set(files_b)):
        ta, tb = load_file(files_a[rel]), load_file(files_b[rel])
        if set(ta) != set(tb):
            result["same_files"] = bitwise = close = False
            continue
        for name, x in ta.items():
            y = tb[name]
            if x.shape != y.shape or x.dtype != y.dtype:
                bitwise = close = False
                continue
            if not torch.equal(x, y):
                bitwise = False
                diff = (x.float() - y.float()).abs().max().item()
                if diff > worst:
                    worst, worst_name = diff, f"{rel}:{name}"
                close = close and torch.allclose(x.float(), y.float(), rtol=RTOL, atol=ATOL)
    result.update(bitwise=bitwise, close=close and result["same_files"], max_abs_diff=worst)
    if worst_name:
        result["worst_tensor"] = worst_name
    return result


def cuda_device() -> dict[str, Any]:
    """The GPU the parts run on, or {} on a machine without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {}
    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "multiprocessors": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
        "cuda": torch.version.cuda,
        "count": torch.cuda.device_count(),
    }
