"""Two "machines" on this one machine: ``torchrun --nnodes 2 --nproc_per_node 1`` launched once per
node rank, each from its own working directory, so that a relative ``ENV.OUTPUT.BASE_DIR`` is a
different directory on each, as two machines' local disks are."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from .processes import free_port, launch_env, torchrun_command, train_arguments

NODE_TIMEOUT_S = 180


def two_nodes(
    cwds: tuple[Path, Path],
    tmp_path: Path,
    opts: Sequence[str],
    env: Mapping[str, str] | None = None,
    node_env: Sequence[Mapping[str, str]] = ({}, {}),
    log_name: str = "node",
    script: Sequence[str] = (),
) -> list[tuple[int, str]]:
    """Launch node ranks 0 and 1 at once, each from its working directory, training with ``opts``
    (or running ``script``: a script and its arguments); their (exit status, output).
    ``node_env``: variables for one node only (a fault point)."""
    port = free_port()
    procs = []
    for rank, cwd in enumerate(cwds):
        cwd.mkdir(parents=True, exist_ok=True)
        log_path = tmp_path / f"{log_name}{rank}.log"
        what = list(script) if script else train_arguments(*opts)
        command = [*torchrun_command(1, nodes=2, node_rank=rank, port=port), *what]
        extra = {**(env or {}), **node_env[rank]}
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                command, cwd=cwd, env=launch_env(tmp_path, extra=extra), stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,  # on a timeout, the launcher and its worker are killed together
            )  # fmt: skip
        procs.append((proc, log_path))
    results = []
    try:
        for proc, log_path in procs:
            proc.wait(timeout=NODE_TIMEOUT_S)
            results.append((proc.returncode, log_path.read_text(errors="replace")))
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results
