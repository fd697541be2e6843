"""Training under ``accelerate launch`` or ``torchrun`` on CPU processes (gloo), as real
subprocesses: each launch gets a free rendezvous port and the environment of
``helpers.processes.launch_env``, and writes its stdout and stderr to files under the test's
directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from helpers.processes import accelerate_launch_command, launch_env, torchrun_command, train_arguments

LAUNCH_TIMEOUT_S = 300


class Launch:
    """One finished launch: exit status, captured output, and the run's output directory."""

    def __init__(self, returncode: int, stdout: Path, stderr: Path, output_dir: Path) -> None:
        self.returncode = returncode
        self.stdout = stdout.read_text(encoding="utf-8", errors="replace")
        self.stderr = stderr.read_text(encoding="utf-8", errors="replace")
        self.dir = output_dir

    def tail(self, n: int = 4000) -> str:
        return f"--- stdout (tail) ---\n{self.stdout[-n:]}\n--- stderr (tail) ---\n{self.stderr[-n:]}"

    def check_ok(self) -> Launch:
        assert self.returncode == 0, f"launch failed with {self.returncode}\n{self.tail()}"
        return self

    def metrics(self) -> list[dict[str, Any]]:
        lines = (self.dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def summary(self) -> dict[str, Any]:
        summary: dict[str, Any] = json.loads((self.dir / "summary.json").read_text(encoding="utf-8"))
        return summary

    def weights(self) -> dict[str, Any]:
        return load_file(str(self.dir / "final" / "model.safetensors"))


def launch_logged(
    command: list[str],
    tmp: Path,
    log: str,
    output_dir: Path,
    extra_env: dict[str, str] | None = None,
    timeout: float = LAUNCH_TIMEOUT_S,
) -> Launch:
    """Run ``command`` in ``tmp`` to its end, its output in ``tmp/<log>.stdout`` and ``.stderr``."""
    stdout, stderr = tmp / f"{log}.stdout", tmp / f"{log}.stderr"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        proc = subprocess.run(
            command,
            cwd=tmp,
            env=launch_env(tmp, extra=extra_env),
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
            check=False,
        )
    return Launch(proc.returncode, stdout, stderr, output_dir)


def run_command(
    prefix: list[str], name: str, opts: list[str], tmp_path: Path, extra_env: dict[str, str] | None = None
) -> Launch:
    """``prefix -m linnaeus_accel train --cfg default.yaml --opts ...`` with output in tmp_path/name."""
    base = tmp_path / "outputs"
    command = [*prefix, *train_arguments("ENV.OUTPUT.BASE_DIR", str(base), "EXPERIMENT.NAME", name, *opts)]
    return launch_logged(command, tmp_path, name, base / name, extra_env)


def accelerate_launch(
    name: str,
    opts: list[str],
    tmp_path: Path,
    processes: int = 2,
    config_file: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> Launch:
    return run_command(accelerate_launch_command(processes, config_file), name, opts, tmp_path, extra_env)


def single_process(name: str, opts: list[str], tmp_path: Path) -> Launch:
    return run_command([sys.executable], name, opts, tmp_path)


def torchrun(name: str, opts: list[str], tmp_path: Path, processes: int = 2) -> Launch:
    return run_command(torchrun_command(processes), name, opts, tmp_path)
