"""Reliability end to end, with real ``linnaeus-accel train`` runs (issue: no crash loops, one
writer per run, no silent NaN, no hangs, idempotent reruns):

- two ``train`` commands on one output directory: the second exits 2 at once naming the directory
  and the process holding it; the first completes with every metrics row;
- a loss that becomes NaN at step 50 under ``TRAIN.NONFINITE: stop`` (status failed naming the
  step, exit 1, no NaN checkpoint, the last good checkpoint stays the resume point) and ``skip``
  (the bad steps are dropped and counted, the run completes with finite weights);
- a process that stops answering with ``ENV.DIST_TIMEOUT_S 20``: every process exits non-zero
  within the timeout (plus the launcher's grace for the hung one), and the message says so;
- rerunning a completed run is a no-op that says so and exits 0;
- a config changed between a kill and the rerun: refused when it rewrites the steps already
  trained (naming the key), applied and listed when it does not, or with --allow-config-change;
- a model compiled through Accelerate's dynamo setting, killed and resumed: byte-identical, and
  ``final/`` under the model's own parameter names.

A ``kill -9`` leaves no stale lock (the kernel drops it): every kill-and-rerun test of
test_resume.py reruns in the same directory at once.

The runs that are killed, frozen, launched on several processes or time a hang are processes of
their own; the runs that refuse, fail on a NaN, resume or serve as the reference run in this
process, whose torch is imported already (that import is most of a short run's cost in a process
of its own), through the same command line (``run_here``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.configs import REPO
from helpers.in_process import run_here
from helpers.processes import AFTER_FIRST_COMMIT, free_port
from helpers.runs import TrainRun, ckpt, committed, is_train, read_metrics, read_summary, wait_for_file
from safetensors.torch import load_file

from linnaeus_accel.models import register_model
from linnaeus_accel.models.digits import build_digits_mlp

pytestmark = pytest.mark.slow

SHORT = ["TRAIN.EPOCHS", "3", "DATA.BATCH_SIZE", "64"]  # 23 steps per epoch, 69 in all

# A user's model, registered as their own script does (the README) before it calls the command line,
# whose forward returns NaN logits from its 50th training forward on: one per optimizer step here
# (no accumulation, 1 process). Registered by this module, so the runs train in this process.


class NanAfter(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, after: int) -> None:
        super().__init__()
        self.inner, self.after, self.calls = inner, after, 0

    def forward(self, batch: Any) -> Any:
        out = self.inner(batch)
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls >= self.after:
                out = [o * float("nan") for o in out]
        return out


@register_model("nan_from_50")
def build_nan_from_50(config: Any, dataset: Any) -> NanAfter:
    return NanAfter(build_digits_mlp(config, dataset), 50)


NAN_OPTS = [
    *SHORT,
    "MODEL.TYPE", "nan_from_50",
    "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1",  # checkpoints at steps 23 and 46, both before the NaN
]  # fmt: skip


def test_a_second_train_on_a_live_directory_exits_2_naming_the_holder(tmp_path: Path) -> None:
    first = TrainRun(tmp_path, SHORT)
    started = first.start()
    wait_for_file(started, first.dir / "metrics.jsonl")  # past start-up: the lock is held
    os.killpg(started.proc.pid, signal.SIGSTOP)  # frozen mid-run, so the second surely meets it live
    try:
        before = (first.dir / "metrics.jsonl").read_bytes()
        second = run_here(first)  # the holder is another process, as for a second job
    finally:
        os.killpg(started.proc.pid, signal.SIGCONT)
    assert second.returncode == 2, second.tail()
    assert "in use by another run" in second.output, second.tail()
    assert str(first.dir) in second.output, second.tail()
    assert f"process {started.proc.pid} " in second.output, second.tail()
    assert "Traceback" not in second.output
    assert (first.dir / "metrics.jsonl").read_bytes()[: len(before)] == before  # the second touched nothing

    done = started.finish().check_ok()
    assert read_summary(done.dir)["status"] == "completed"
    train_steps = [r["global_step"] for r in read_metrics(done.dir) if is_train(r)]
    assert train_steps == [20, 40, 60, 69], train_steps  # not one row lost

    # Rerunning a completed run (a scheduler requeueing the job) changes nothing and exits 0.
    weights = (done.dir / "final" / "model.safetensors").read_bytes()
    again = run_here(first)
    assert again.returncode == 0, again.tail()
    assert "already holds a run completed at step 69: nothing to do" in again.output, again.tail()
    assert (done.dir / "final" / "model.safetensors").read_bytes() == weights
    assert read_summary(done.dir)["status"] == "completed"
    assert [r["global_step"] for r in read_metrics(done.dir) if is_train(r)] == train_steps


def test_nan_loss_stops_the_run_keeping_the_last_good_checkpoint(tmp_path: Path) -> None:
    run = TrainRun(tmp_path, NAN_OPTS)
    failed = run_here(run)
    assert failed.returncode == 1, failed.tail()
    assert "Traceback" not in failed.output, failed.tail()
    assert "nan at step 50" in failed.output, failed.tail()  # the logging step 60 names the step
    data = read_summary(run.dir)
    assert data["status"] == "failed", data
    assert "step 50" in data["error"], data
    assert committed(run.dir) == [ckpt(23), ckpt(46)], committed(run.dir)  # nothing after the NaN
    assert not (run.dir / "final").exists()
    assert not any(r for r in read_metrics(run.dir) if r["global_step"] > 46 and is_train(r))

    # The rerun resumes from the last good checkpoint (the model's call count starts again at 0,
    # so its 50th call is past the run's end: this time it completes).
    rerun = run_here(run)
    assert f"resumed from {run.dir / 'checkpoints' / ckpt(46)}" in rerun.output, rerun.tail()
    assert rerun.returncode == 0, rerun.tail()
    assert read_summary(run.dir)["status"] == "completed"


def test_nan_loss_under_skip_drops_and_counts_the_steps(tmp_path: Path) -> None:
    run = TrainRun(tmp_path, [*NAN_OPTS, "TRAIN.NONFINITE", "skip"])
    done = run_here(run).check_ok()
    assert read_summary(done.dir)["status"] == "completed"
    last = [r for r in read_metrics(done.dir) if is_train(r)][-1]
    assert last["global_step"] == 69
    assert last["train/nonfinite_skipped"] == 20, last  # steps 50..69
    weights = load_file(done.dir / "final" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_a_process_that_stops_answering_ends_the_run_within_the_timeout(tmp_path: Path) -> None:
    """Rank 1 sleeps forever at its 5th optimizer step; rank 0 waits in the next collective for
    ENV.DIST_TIMEOUT_S (5 s, not torch's 30 minutes), then exits 1 saying why; the launcher
    then ends rank 1 (the hang point leaves SIGTERM's default action, so this test does not wait
    for torchelastic's 30 s grace before its SIGKILL of a process that ignores SIGTERM)."""
    run = TrainRun(tmp_path, [*SHORT, "ENV.DIST_TIMEOUT_S", "5"], processes=2)
    started = run.start(
        extra_env={"LINNAEUS_ACCEL_HANG_AT": "optimizer_step:5", "LINNAEUS_ACCEL_FAULT_RANK": "1"}
    )
    result = started.finish(timeout=120)
    assert result.returncode != 0, result.tail()
    assert "ENV.DIST_TIMEOUT_S" in result.output, result.tail()
    assert "stopped answering" in result.output, result.tail()
    data = json.loads((run.dir / "summary.json").read_text(encoding="utf-8"))
    assert data["status"] == "failed", data
    # The configured timeout ended it, not torch's 30 minutes (finish() above allows 120 s at most):
    # said in the words of the run, not inferred from this machine's speed.
    assert (
        "waited for 5 s (ENV.DIST_TIMEOUT_S) for another process that stopped answering" in data["error"]
    ), data


def test_an_error_on_rank_1_is_recorded_as_the_cause_not_rank_0s_lost_connection(tmp_path: Path) -> None:
    """Rank 1 raises at its 3rd optimizer step; rank 0 then fails in its next collective with a
    lost connection. summary.json (written by rank 0) records rank 1's error, naming its rank."""
    run = TrainRun(tmp_path, [*SHORT, "ENV.DIST_TIMEOUT_S", "20"], processes=2)
    result = run.run(
        extra_env={"LINNAEUS_ACCEL_RAISE_AT": "optimizer_step:3", "LINNAEUS_ACCEL_FAULT_RANK": "1"}
    )
    assert result.returncode != 0, result.tail()
    data = json.loads((run.dir / "summary.json").read_text(encoding="utf-8"))
    assert data["status"] == "failed", data
    assert data["error"] == "process 1: RuntimeError: fault point reached (LINNAEUS_ACCEL_RAISE_AT)", data


def test_a_config_change_that_rewrites_the_past_is_refused_and_one_that_does_not_is_applied(
    tmp_path: Path,
) -> None:
    """Killed at step 30 (checkpoint at 23), rerun with a changed config: more epochs stretch the
    default run's warmup (a fraction of the run) over steps already trained, so they are refused,
    naming the key, with nothing touched; a logging interval is applied and listed; with
    --allow-config-change the first change is applied too."""
    run = TrainRun(tmp_path, [*SHORT, "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1"])
    run.run(kill_at="optimizer_step:30", extra_env=AFTER_FIRST_COMMIT).check_killed()
    before = committed(run.dir)
    forced = run.clone(tmp_path / "forced")  # the same killed run, for --allow-config-change below

    run.opts += ["TRAIN.EPOCHS", "4"]
    refused = run_here(run)
    assert refused.returncode == 2, refused.tail()
    assert "TRAIN.EPOCHS: changes the 23 steps already trained" in refused.output, refused.tail()
    assert "--allow-config-change" in refused.output
    assert committed(run.dir) == before

    run.opts[-1] = "3"
    run.opts += ["SCHEDULE.METRICS.STEP_INTERVAL", "10"]
    applied = run_here(run).check_ok()
    assert (
        "config changed since the checkpoint, applied: SCHEDULE.METRICS.STEP_INTERVAL: 20 -> 10"
        in applied.output
    )
    assert [r["global_step"] for r in read_metrics(run.dir) if is_train(r)] == [20, 30, 40, 50, 60, 69]

    forced.opts += ["TRAIN.EPOCHS", "4"]
    done = run_here(forced, args=["--allow-config-change"]).check_ok()
    assert "applied: TRAIN.EPOCHS: 3 -> 4" in done.output, done.tail()
    assert read_summary(forced.dir)["global_step"] == 92


def test_a_compiled_model_through_save_resume_and_final(tmp_path: Path) -> None:
    """torch.compile the Accelerate way (``accelerate launch --dynamo_backend`` sets this variable;
    aot_eager runs on the CPU without a C compiler): killed after its first checkpoint, rerun, it
    ends byte-identical to an uninterrupted compiled run, and ``final/model.safetensors`` holds the
    model's own parameter names (no ``_orig_mod.`` prefix)."""
    compiled = {"ACCELERATE_DYNAMO_BACKEND": "aot_eager"}
    opts = [*SHORT, "TRAIN.EPOCHS", "2", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1"]
    (tmp_path / "ref").mkdir()
    reference = TrainRun(tmp_path / "ref", opts)
    run = TrainRun(tmp_path, opts)
    try:
        run_here(reference, extra_env=compiled).check_ok()
        run.run(kill_at="optimizer_step:30", extra_env={**compiled, **AFTER_FIRST_COMMIT}).check_killed()
        resumed = run_here(run, extra_env=compiled).check_ok()
    finally:
        # What dynamo compiled here stays cached on the model's code; a later test of this process
        # compiling the same model must start fresh, as in a process of its own.
        torch._dynamo.reset()
    assert f"resumed from {run.dir / 'checkpoints' / ckpt(23)}" in resumed.output, resumed.tail()
    assert json.loads((run.dir / "assets" / "run_info.json").read_text())["dynamo_backend"] == "AOT_EAGER"
    final = run.dir / "final" / "model.safetensors"
    assert final.read_bytes() == (reference.dir / "final" / "model.safetensors").read_bytes()
    names = list(load_file(final))
    assert names, names
    assert not [n for n in names if n.startswith("_orig_mod.")], names


def test_joining_the_process_group_never_waits_past_the_deadline(tmp_path: Path) -> None:
    """A process whose peers never come (torch's own wait is longer, as it was in gloo's mesh set-up
    when a killed run's workers lived on) stops at ENV.DIST_TIMEOUT_S with one sentence."""
    code = (
        "from datetime import timedelta\n"
        "import torch.distributed as dist\n"
        "from linnaeus_accel.process.launcher import startup_deadline\n"
        "with startup_deadline(2, 'joining the other processes'):\n"
        "    dist.init_process_group('gloo', rank=0, world_size=2, timeout=timedelta(seconds=120))\n"
    )
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0"}
    env["PYTHONPATH"] = str(REPO)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 1, proc.stderr
    assert "joining the other processes did not finish within 2 s (ENV.DIST_TIMEOUT_S)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - started < 30
