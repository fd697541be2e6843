"""Processes a test starts: a free port, an environment of their own, the launchers' command
lines, and ending what was started."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import psutil  # type: ignore[import-untyped]  # an Accelerate dependency

from helpers.configs import CFG, REPO

# What an outer launcher, test or shell sets must not reach the processes a test starts: the
# launchers' rendezvous, and the settings of Accelerate, of the trainer (fault points), of the
# bucket and of the sharded worker. A test hands its own through ``extra``.
LAUNCHER_VARIABLES = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
)
OWN_PREFIXES = ("ACCELERATE_", "LINNAEUS_ACCEL_", "B2_", "SHARDED_WORKER_")


def after_commits(count: int) -> dict[str, str]:
    """Environment making a fault wait at its point until the main process has committed ``count``
    checkpoints: commits run in the background, so "killed after the checkpoint of step N" must."""
    return {"LINNAEUS_ACCEL_FAULT_AFTER": f"checkpoint_committed:{count}"}


AFTER_FIRST_COMMIT = after_commits(1)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_env(tmp: Path, *, cpu: bool = True, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a started process: this one's without the variables above, one OpenMP
    thread (the cores are shared), an HF_HOME of its own under ``tmp`` (no user's accelerate config
    leaks in), W&B offline, the repository importable; ``cpu``: Accelerate on the CPU."""
    env = {
        k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith(OWN_PREFIXES)
    }
    env.update(
        OMP_NUM_THREADS="1",
        HF_HOME=str(tmp / "hf_home"),
        WANDB_MODE="offline",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
    )
    if cpu:
        env["ACCELERATE_USE_CPU"] = "true"
    env.update(extra or {})
    return env


def accelerate_launch_command(processes: int = 2, config_file: str | None = None) -> list[str]:
    """``accelerate launch`` of ``processes`` processes on this machine without precision or
    compilation (or as ``config_file`` says), on a free port; the script or ``-m module`` follows."""
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    if config_file is not None:
        command += ["--config_file", config_file]
    else:
        command += ["--multi_gpu", "--num_processes", str(processes), "--num_machines", "1"]
        command += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    return [*command, "--main_process_port", str(free_port())]


def torchrun_command(
    processes: int = 2, *, nodes: int = 1, node_rank: int = 0, port: int | None = None
) -> list[str]:
    """``torchrun`` of ``processes`` processes per node, meeting on this machine (at ``port``, a free
    one if not given: the nodes of one run share theirs); the script or ``-m module`` follows."""
    command = [sys.executable, "-m", "torch.distributed.run"]
    if nodes > 1:
        command += ["--nnodes", str(nodes)]
    command += ["--nproc_per_node", str(processes)]
    if nodes > 1:
        command += ["--node_rank", str(node_rank)]
    return [*command, "--master_addr", "127.0.0.1", "--master_port", str(port or free_port())]


def train_arguments(*opts: str, cfg: str = CFG) -> list[str]:
    """``-m linnaeus_accel train --cfg CFG --opts OPTS``: what follows ``python`` or a launcher."""
    return ["-m", "linnaeus_accel", "train", "--cfg", cfg, "--opts", *opts]


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill a process started in a session of its own (``start_new_session``) and what it started
    in that session."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and its workers at the same instant (torchelastic puts the workers in
    sessions of their own, so the launcher's process group does not hold them)."""
    processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)


def read_log(path: Path) -> str:
    # tqdm redraws with carriage returns; one line per redraw reads better in an assertion message.
    return path.read_text(encoding="utf-8", errors="replace").replace("\r", "\n")


def lines_through_our_code(output: str) -> list[str]:
    """Traceback lines naming a file of the package (the launcher's own report names none)."""
    return [line for line in output.splitlines() if re.search(r"linnaeus_accel[/\\]", line)]
