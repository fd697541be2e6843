"""Language-model runs killed and resumed, as real ``linnaeus-accel train`` subprocesses on
``configs/lm_tiny.yaml`` with a smaller model (docs/semantics.md §6, §1):

- on 2 CPU processes, killed with SIGKILL at seeded random moments (first the launcher's process
  group alone, as a user's ``kill -9`` or a job script does: the workers, in sessions of their own,
  must follow it within 10 s; then the launcher and its workers at the same instant) and rerun at once until
  it completes: final weights byte-identical to the uninterrupted run's, the same
  ``tokens_seen`` and the same metrics history;
- a streaming ``IterableDataset`` read by 2 DataLoader workers, killed mid-epoch: the rerun resumes
  each worker's position from the checkpoint and ends byte-identical.

The kills and the 2-process runs are processes of their own; the streaming run's reference and its
rerun after the kill train in the test's process, through the same command line
(``run_here_ending_workers``: a process of their own is mostly torch's import).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import psutil  # type: ignore[import-untyped]  # an Accelerate dependency
import pytest
from helpers.configs import LM_CFG, SMALL_LM
from helpers.hf import load_final
from helpers.in_process import run_here_ending_workers
from helpers.processes import after_commits, kill_tree
from helpers.runs import (
    KILLED,
    Result,
    TrainRun,
    assert_resumed_from,
    assert_same_run,
    committed,
    read_metrics,
    read_summary,
    wait_for_file,
    wait_for_output,
)

pytestmark = pytest.mark.slow

TWO_PROCESSES = [*SMALL_LM, "TRAIN.TARGET_TOKENS", str(260 * 2 * 8 * 128)]  # 260 steps, past one boundary
STREAM = [
    *SMALL_LM,
    "DATA.DATASET.OPTIONS.streaming", "true",
    "DATA.NUM_WORKERS", "2",
    "TRAIN.TARGET_TOKENS", str(90 * 8 * 128),  # 90 steps, all in the first epoch
]  # fmt: skip


@pytest.fixture(scope="module")
def ref_two(tmp_path_factory: pytest.TempPathFactory) -> Result:
    run = TrainRun(tmp_path_factory.mktemp("lm_ref_two"), TWO_PROCESSES, processes=2, cfg=LM_CFG)
    started = run.start()
    active_from = wait_for_file(started, run.dir / "metrics.jsonl")
    result = started.finish().check_ok()
    result.active_seconds = time.monotonic() - active_from
    data = read_summary(result.dir)
    assert (data["global_step"], data["epoch"]) == (260, 2), data
    assert data["tokens_seen"] == 260 * 2 * 8 * 128
    losses = [r["val/loss"] for r in read_metrics(result.dir) if "val/loss" in r]
    assert len(losses) == 2
    assert losses[1] < losses[0] < 5.55  # it learns (ln 257 = 5.55 at random)
    assert_final_loads_with_transformers(result.dir)
    return result


def assert_final_loads_with_transformers(run_dir: Path) -> None:
    """final/, written by 2 processes, is the model transformers loads, with our weights."""
    import torch

    from linnaeus_accel.config import load_config
    from linnaeus_accel.evaluate import load_weights
    from linnaeus_accel.models import build_model

    loaded = load_final(run_dir / "final")
    ours = build_model(load_config(LM_CFG, [*SMALL_LM, "MODEL.OPTIONS.vocab_size", "257"]), None).eval()
    load_weights(ours, run_dir / "final")
    windows = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(windows).logits, ours(windows).logits)


def test_two_processes_killed_at_random_moments_resume_byte_identical(
    ref_two: Result, tmp_path: Path
) -> None:
    run = TrainRun(tmp_path, TWO_PROCESSES, processes=2, cfg=LM_CFG)
    delays = random.Random(20261123)
    kills = 0
    # Measured from each launch's start of training (after a resume, if any), in the share of the
    # uninterrupted run's training time: past the first checkpoint, then somewhere later.
    for fraction, kill in ((delays.uniform(0.3, 0.6), kill_launcher), (delays.uniform(0.3, 0.9), kill_tree)):
        started = run.start()
        wait_for_output(started, "Schedule summary")
        try:
            started.proc.wait(timeout=fraction * ref_two.active_seconds)
        except subprocess.TimeoutExpired:
            kill(started.proc.pid)
        killed = started.finish()
        if killed.returncode == 0 or (run.dir / "summary.json").exists():
            break  # a busy machine: the run finished before the kill
        assert killed.returncode == KILLED, killed.tail()
        kills += 1
    if (run.dir / "summary.json").exists():  # the run finished before a kill landed (a busy machine)
        assert_same_run(Result(0, "", run.dir, 0.0), ref_two)
        return
    resumed = run.run()
    assert kills > 0
    assert "resumed from " in resumed.output, resumed.tail()
    assert_same_run(resumed, ref_two)


def kill_launcher(pid: int) -> None:
    """SIGKILL the launcher's process group only; its workers (in sessions of their own) must
    notice and stop within 10 s, so that a rerun at once finds the output directory free."""
    workers = psutil.Process(pid).children(recursive=True)
    os.killpg(pid, signal.SIGKILL)
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"still running 10 s after their launcher was killed: {alive}"


@pytest.fixture(scope="module")
def ref_stream(tmp_path_factory: pytest.TempPathFactory) -> Result:
    run = TrainRun(tmp_path_factory.mktemp("lm_ref_stream"), STREAM, cfg=LM_CFG)
    result = run_here_ending_workers(run).check_ok()
    assert read_summary(result.dir)["global_step"] == 90
    return result


def test_stream_with_two_workers_killed_mid_epoch_resumes_byte_identical(
    ref_stream: Result, tmp_path: Path
) -> None:
    run = TrainRun(tmp_path, STREAM, cfg=LM_CFG)
    run.run(kill_at="optimizer_step:55", extra_env=after_commits(2)).check_killed()  # after step 40's commit
    assert committed(run.dir) == ["step_00000020", "step_00000040"]
    resumed = run_here_ending_workers(run)
    # 40 steps into the epoch: each worker continues from its own saved position in the stream.
    assert_resumed_from(resumed.output, 40)
    assert_same_run(resumed, ref_stream)
