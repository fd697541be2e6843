"""A run across machines refuses an output directory the machines do not share.

Two real "nodes" on this one machine: two ``torchrun --nnodes 2 --nproc_per_node 1`` launches (one
per node rank; LOCAL_RANK is 0 on both, so each is its node's local main process) with a relative
ENV.OUTPUT.BASE_DIR. Started in different working directories, each node resolves it to a different
place, as two machines without a shared mount would: both stop with the config error (exit 2),
naming the directory and the rank that cannot see it, before any step or checkpoint, and no probe
file is left behind. Started in the same working directory, the same launch trains and commits its
checkpoint from both ranks' files.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from accelerate import Accelerator
from helpers.processes import free_port, launch_env, lines_through_our_code, torchrun_command, train_arguments

from linnaeus_accel.run_directory.shared_storage import (
    PROBE_PREFIX,
    _message,
    _write_probe,
    check_shared_output,
)

NODE_TIMEOUT_S = 180
# 1 epoch of 3 steps (1,438 samples, 256 per process, 2 processes) and its final checkpoint.
OPTS = [
    "ENV.OUTPUT.BASE_DIR",
    "outputs",
    "EXPERIMENT.NAME",
    "run",
    "TRAIN.EPOCHS",
    "1",
    "DATA.BATCH_SIZE",
    "256",
]


def two_nodes(cwds: tuple[Path, Path], tmp_path: Path) -> list[tuple[int, str]]:
    """Launch node ranks 0 and 1 at once, each from its working directory; (exit status, output)."""
    port, env = free_port(), launch_env(tmp_path)
    procs = []
    for rank, cwd in enumerate(cwds):
        cwd.mkdir(parents=True, exist_ok=True)
        log = (tmp_path / f"node{rank}.log").open("wb")
        command = [*torchrun_command(1, nodes=2, node_rank=rank, port=port), *train_arguments(*OPTS)]
        proc = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # on a timeout, the launcher and its worker are killed together
        )  # fmt: skip
        procs.append((proc, log))
    results = []
    try:
        for rank, (proc, log) in enumerate(procs):
            proc.wait(timeout=NODE_TIMEOUT_S)
            log.close()
            results.append((proc.returncode, (tmp_path / f"node{rank}.log").read_text(errors="replace")))
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
    return results


@pytest.mark.slow
def test_nodes_that_do_not_share_the_output_directory_stop_with_a_config_error(tmp_path: Path) -> None:
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    results = two_nodes((node0, node1), tmp_path)
    host = re.escape(socket.gethostname())
    message = re.compile(
        rf"ENV\.OUTPUT\.BASE_DIR: outputs/run \({re.escape(str(node0.resolve() / 'outputs' / 'run'))} on rank 0\) "
        rf"is not shared between the run's machines: the process of rank 1 on host {host} cannot see a file "
        rf"written there by rank 0 on host {host}\. Checkpoints and final weights are committed by rank 0"
    )
    for node, (status, output) in enumerate(results):
        assert status != 0, output[-4000:]
        # torchrun reports its worker's own exit status: 2, a config error, on both nodes.
        assert re.search(rf"rank\s*: {node} \(local_rank: 0\)\s*\n\s*exitcode\s*: 2\b", output), output[
            -4000:
        ]
        assert len(message.findall(output)) == 1, output[-4000:]  # said once, by the node's local main
        assert "ConfigError" not in output, output[-4000:]
        assert not lines_through_our_code(output), output[-4000:]
    # Stopped before anything was trained or written; the probe is gone.
    assert sorted(p.name for p in (node0 / "outputs" / "run").iterdir()) == [".lock"]
    assert not list(node1.rglob("*.json*")), list(node1.rglob("*"))


@pytest.mark.slow
def test_nodes_that_share_the_output_directory_train(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    results = two_nodes((shared, shared), tmp_path)
    for status, output in results:
        assert status == 0, output[-4000:]
    out = shared / "outputs" / "run"
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["global_step"]) == ("completed", 3), summary
    assert (summary["run_info"]["machines"], summary["run_info"]["world_size"]) == (2, 2), summary
    committed = out / "checkpoints" / "step_00000003"
    assert (committed / "COMMITTED.json").is_file()
    assert (committed / "rank_00001.json").is_file()  # the other node's file, committed by rank 0
    assert not [p for p in out.rglob("*") if p.name.startswith(PROBE_PREFIX)]


# -- without processes ---------------------------------------------------------------------------


def test_one_process_checks_nothing_and_writes_nothing(tmp_path: Path) -> None:
    check_shared_output(Accelerator(cpu=True), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_probe_left_by_a_killed_run_is_removed(tmp_path: Path) -> None:
    stale = tmp_path / f"{PROBE_PREFIX}0123"
    stale.write_text("0123")
    token, error, where = _write_probe(tmp_path)
    assert (error, where) == (None, str(tmp_path.resolve()))
    assert [p.name for p in tmp_path.iterdir()] == [f"{PROBE_PREFIX}{token}"]
    assert (tmp_path / f"{PROBE_PREFIX}{token}").read_text() == token


def test_message_names_every_machine_that_cannot_see_the_directory() -> None:
    text = _message(Path("/data/run"), "/data/run", [(2, "b"), (4, "c")], main_host="a")
    assert text.startswith(
        "/data/run is not shared between the run's machines: the processes of rank 2 on host b, "
        "rank 4 on host c cannot see a file written there by rank 0 on host a."
    )
