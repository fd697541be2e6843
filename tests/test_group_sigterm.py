"""A job-wide SIGTERM, and which errors get causal_lm's length hint.

- SIGTERM to the whole process group of ``linnaeus-accel train`` with two DataLoader workers (as
  Slurm's scancel and preemption deliver it, workers included) mid-run: the run is preempted (exit
  0, ``status: preempted``), not failed by a worker's death; no worker outlives it; the rerun ends
  byte-identical to an uninterrupted run.
- causal_lm's hint of what seq_len counts follows a model refusing the length it was given (its
  message names it, or a table of positions read past its end), and no other error: a DataLoader
  worker's death raised by torch's SIGCHLD handler lands in whatever runs, a validation forward
  included.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]  # an Accelerate dependency
import pytest
import torch
from helpers.processes import kill_group
from helpers.runs import TrainRun, assert_preempted, assert_same_run, wait_for_record
from torch import Tensor, nn

from linnaeus_accel.tasks.causal_lm import CausalLMTask

# The default config (1,438 training images) with batch 64: 23 optimizer steps, one epoch; a metrics
# record every 5 steps; the final validation without its exhaustive partial passes (time).
WORKERS_OPTS = [
    "TRAIN.EPOCHS", "1",
    "DATA.BATCH_SIZE", "64",
    "DATA.NUM_WORKERS", "2",
    "SCHEDULE.METRICS.STEP_INTERVAL", "5",
    "SCHEDULE.VALIDATION.FINAL_EPOCH.EXHAUSTIVE_PARTIAL_META_VALIDATION", "false",
]  # fmt: skip


@pytest.mark.slow
def test_sigterm_to_the_process_group_preempts_then_rerun_ends_identically(tmp_path: Path) -> None:
    for name in ("ref", "run"):
        (tmp_path / name).mkdir()
    run = TrainRun(tmp_path / "run", WORKERS_OPTS)
    # The uninterrupted reference runs alongside (each run is mostly start-up).
    ref_started, started = TrainRun(tmp_path / "ref", WORKERS_OPTS).start(), run.start()
    try:
        wait_for_record(started, lambda r: r["global_step"] == 5)  # mid-epoch, the workers busy
        workers = psutil.Process(started.proc.pid).children(recursive=True)
        assert len(workers) >= 2, workers  # the signal reaches them too
        # The whole process group (each run has its own session): the trainer and its workers.
        os.killpg(started.proc.pid, signal.SIGTERM)
        preempted = started.finish()
        reference = ref_started.finish().check_ok()
    finally:
        for proc in (started.proc, ref_started.proc):
            if proc.poll() is None:
                kill_group(proc)
    assert "killed by signal" not in preempted.output, preempted.tail()
    assert_preempted(preempted, total_steps=23)
    # Shut down by the trainer before it exited, not left to notice its death.
    _, alive = psutil.wait_procs(workers, timeout=1)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive

    assert_same_run(run.run(), reference)


class Refusing(nn.Module):
    """A model that raises ``error`` from its forward."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def forward(self, *inputs: Tensor) -> Tensor:
        raise self.error


class Positions(nn.Module):
    """Token and position embeddings, as GPT-2's: a window longer than ``block`` reads the
    position table past its end (an IndexError), and so does a token id past ``vocab``."""

    def __init__(self, vocab: int, block: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, 4), nn.Embedding(block, 4)

    def forward(self, ids: Tensor) -> Tensor:
        embedded: Tensor = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        return embedded


def forward_error(task: CausalLMTask, model: nn.Module, ids: Tensor) -> str:
    batch: dict[str, Any] = {"input_ids": ids, "labels": ids}
    with (
        torch.no_grad(),
        pytest.raises((RuntimeError, AssertionError, IndexError)) as raised,
    ):  # the first-batch probe, validation
        task.forward(model, batch)
    return str(raised.value)


WINDOW = torch.ones(2, 65, dtype=torch.long)  # seq_len 65
HINT = "seq_len (65) counts the shifted target"


def test_length_hint_follows_only_a_refused_length() -> None:
    task = CausalLMTask()
    worker_death = "DataLoader worker (pid 65) is killed by signal: Terminated. "
    assert forward_error(task, Refusing(RuntimeError(worker_death)), WINDOW) == worker_death
    other = "mat1 and mat2 shapes cannot be multiplied (130x4 and 8x2)"
    assert forward_error(task, Refusing(RuntimeError(other)), WINDOW) == other
    # A token id past the vocabulary (the positions fit): not a length problem.
    assert HINT not in forward_error(task, Positions(vocab=100, block=65), WINDOW * 100)

    refusal = "Cannot forward sequence of length 65, block size is only 64"  # nanoGPT's
    message = forward_error(task, Refusing(AssertionError(refusal)), WINDOW)
    assert message.startswith(refusal), message
    assert HINT in message, message
    mismatch = "The size of tensor a (65) must match the size of tensor b (64) at non-singleton dimension 3"
    assert HINT in forward_error(task, Refusing(RuntimeError(mismatch)), WINDOW)
    assert HINT in forward_error(task, Positions(vocab=100, block=64), WINDOW)  # positions 0..64 of 64
    # With its own loss the model is given seq_len - 1 tokens: the number its refusal names.
    own_loss = CausalLMTask(model_loss=True)
    refusal = "Cannot forward sequence of length 64, block size is only 63"
    assert "inputs are seq_len - 1 tokens" in forward_error(
        own_loss, Refusing(AssertionError(refusal)), WINDOW
    )
