"""Crash and resume, end to end (docs/semantics.md §5-6): real ``python -m linnaeus_accel train``
subprocesses are killed at chosen moments and rerun with the same command line; the resumed run must
end exactly where an uninterrupted run ends.

- Kill -9 at a training step (with mid-epoch step checkpoints, and with epoch checkpoints only),
  inside a validation pass, inside a checkpoint write (after every process staged it and before the
  commit, and right after the commit), and at seeded random wall-clock moments: the rerun's
  ``final/model.safetensors`` is byte-identical to the uninterrupted run's, ``metrics.jsonl`` reads
  as the same history (same train and validation global steps, none twice, none missing, the same
  floats), and ``summary.json`` says completed with the same step and sample counts.
- A corrupt newest checkpoint (a truncated file, a deleted commit marker) is skipped with a message
  naming it, and the run resumes from the previous one (and says so).
- Planted pickles in a checkpoint (extra files, and a listed file replaced under a forged manifest)
  are never executed.
- A run killed mid-validation runs only the passes still missing: the journal lists each pass of
  that boundary once, and metrics.jsonl has one validation record with every pass's metrics.
- SIGTERM preemption with 1 and 2 CPU processes: exit 0 everywhere, ``status: preempted``, a
  checkpoint at the step it stopped; the rerun completes byte-identical.
- ``TRAIN.AUTO_RESUME false`` refuses a used directory (exit 2, naming the key); ``--resume`` an
  older checkpoint resumes from that one.

Fault points (``LINNAEUS_ACCEL_KILL_AT=<point>:<n>``, ``linnaeus_accel.process.faults``) make the
kills land deterministically. Each configuration's uninterrupted reference run is computed once per
module. A run is a subprocess where the behaviour needs a process of its own (a SIGKILL, a SIGTERM,
a launcher of 2 processes); the others (the 1-process references, the reruns, the refusals) run in
this process (``run_here``), whose torch is imported already: that import is most of a
subprocess's cost, and a rerun only reads what the killed process left on disk. Every subprocess
writes its console to a file under the test's directory.
"""

from __future__ import annotations

import json
import pickle
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]  # an Accelerate dependency
import pytest
from helpers.in_process import run_here
from helpers.processes import after_commits, kill_group
from helpers.runs import (
    KILLED,
    Result,
    TrainRun,
    assert_preempted,
    assert_resumed_from,
    assert_same_run,
    ckpt,
    committed,
    is_val,
    journal,
    read_metrics,
    read_summary,
    wait_for_file,
    wait_for_record,
)

from linnaeus_accel.checkpoint.directory import file_digest

pytestmark = pytest.mark.slow

# The default config (1,438 training images) with batch 64: 23 optimizer steps per epoch on one
# process, 92 in 4 epochs; epoch boundaries at steps 23, 46, 69, 92. Validation passes: epoch 1:
# standard (pass 1); epoch 2: standard, mask-meta, partial ROWS, partial COLS+MOMENTS (passes 2-5);
# epoch 3: standard (6); epoch 4 (final): standard, mask-meta and the 6 exhaustive partial passes
# (7-14). Metrics are logged every 20 steps and at the last step.
BASE_OPTS = [
    "TRAIN.EPOCHS", "4",
    "DATA.BATCH_SIZE", "64",
    "SCHEDULE.VALIDATION.MASK_META_INTERVAL_EPOCHS", "2",
    "SCHEDULE.VALIDATION.PARTIAL_MASK_META.INTERVAL_EPOCHS", "2",
]  # fmt: skip
# Checkpoints at the boundaries of epochs 2 and 4 (steps 46 and 92).
EPOCH_CKPT = [*BASE_OPTS, "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "2"]
# Mid-epoch checkpoints at steps 15, 30, 45, 60, 75, 90 (none on a boundary; most between logging
# steps, with the metric windows part full), and the final one at 92. With dropout: a resumed run
# continues the restored global RNG exactly (creating the DataLoader iterator must not draw from it).
MID_CKPT = [
    *BASE_OPTS,
    "MODEL.OPTIONS.dropout", "0.1",
    "SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "15",
    "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null",
    "SCHEDULE.CHECKPOINT.MID_EPOCH", "true",
]  # fmt: skip
EPOCH2_PASSES = ["val", "val_mask_meta", "val_mask_ROWS", "val_mask_COLS_MOMENTS"]

# The same run under 2 processes: 12 steps per epoch, 48 in all, boundaries at 12, 24, 36, 48;
# checkpoints at 24 and 48. The preemption flag is agreed on every 10 steps.
# With the ema callback (validated as val_ema/): its average, saved through Accelerate with the
# run's state, must resume byte-identical on 2 processes too (final/ema/, the val_ema/ metrics).
TWO_PROC_OPTS = [*EPOCH_CKPT, "CALLBACKS", "[{NAME: ema, OPTIONS: {decay: 0.9, validate: true}}]"]
# The state copied to host memory in the loop, written and committed in the background: the same
# run (the references are shared), killed at the same points.
ASYNC = ["SCHEDULE.CHECKPOINT.ASYNC", "true"]
CONFIGS = {
    "epoch": EPOCH_CKPT,
    "mid": MID_CKPT,
    "epoch-async": [*EPOCH_CKPT, *ASYNC],
    "mid-async": [*MID_CKPT, *ASYNC],
}


# ---------------------------------------------------------------------------------------------
# Reference runs (one per configuration) and a shared killed run
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ref_epoch(tmp_path_factory: pytest.TempPathFactory) -> Result:
    result = run_here(TrainRun(tmp_path_factory.mktemp("ref_epoch"), EPOCH_CKPT)).check_ok()
    assert read_summary(result.dir)["global_step"] == 92
    assert committed(result.dir) == [ckpt(46), ckpt(92)]
    return result


@pytest.fixture(scope="module")
def ref_mid(tmp_path_factory: pytest.TempPathFactory) -> Result:
    result = run_here(TrainRun(tmp_path_factory.mktemp("ref_mid"), MID_CKPT)).check_ok()
    assert read_summary(result.dir)["global_step"] == 92
    assert committed(result.dir)[-2:] == [ckpt(90), ckpt(92)]  # the last two (KEEP_LAST_N 2)
    return result


@pytest.fixture(scope="module")
def ref_two(tmp_path_factory: pytest.TempPathFactory) -> Result:
    result = TrainRun(tmp_path_factory.mktemp("ref_two"), TWO_PROC_OPTS, processes=2).run().check_ok()
    assert read_summary(result.dir)["global_step"] == 48
    return result


@pytest.fixture(scope="module")
def final_commit_kill(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainRun, float]:
    """Killed right after committing the final checkpoint (step 92), before any of its validation
    passes: step 46 (journal complete) and step 92 (no journal) are both committed. With the
    seconds it spent after its start-up (from the creation of metrics.jsonl to the kill): all of an
    uninterrupted subprocess's but its final passes (a tenth of a second), which the references,
    trained in this process, do not measure."""
    run = TrainRun(tmp_path_factory.mktemp("killed_final_commit"), EPOCH_CKPT)
    started = run.start(kill_at="checkpoint_committed:2")
    active_from = wait_for_file(started, run.dir / "metrics.jsonl")
    started.finish().check_killed()
    active_seconds = time.monotonic() - active_from
    assert committed(run.dir) == [ckpt(46), ckpt(92)]
    assert journal(run.dir / "checkpoints" / ckpt(46)) == EPOCH2_PASSES
    assert journal(run.dir / "checkpoints" / ckpt(92)) == []
    return run, active_seconds


@pytest.fixture(scope="module")
def killed_after_final_commit(final_commit_kill: tuple[TrainRun, float]) -> TrainRun:
    """That killed run (clone it)."""
    return final_commit_kill[0]


@pytest.fixture(scope="module")
def active_seconds(final_commit_kill: tuple[TrainRun, float]) -> float:
    """How long a subprocess of EPOCH_CKPT trains: the killed run's seconds after its start-up."""
    return final_commit_kill[1]


# ---------------------------------------------------------------------------------------------
# 1. Kill -9 at named fault points and at random moments
# ---------------------------------------------------------------------------------------------

# (configuration, fault point, checkpoint the rerun must resume from; None: starts over)
KILLS = [
    pytest.param("epoch", "optimizer_step:70", 46, id="train-step-epoch-ckpts"),
    pytest.param("mid", "optimizer_step:50", 45, id="train-step-mid-epoch-ckpts"),
    pytest.param("epoch", "validation_pass:9", 92, id="final-validation-pass-3-of-8"),
    pytest.param("epoch", "checkpoint_staged:1", None, id="first-ckpt-staged-not-committed"),
    pytest.param("epoch", "checkpoint_committed:1", 46, id="ckpt-committed-before-validation"),
    pytest.param("mid", "checkpoint_staged:3", 30, id="mid-epoch-ckpt-staged-not-committed"),
    # ASYNC: "staged" is the background thread's instant between writing the files and the commit
    pytest.param("epoch-async", "checkpoint_staged:1", None, id="async-first-ckpt-written-not-committed"),
    pytest.param("epoch-async", "checkpoint_committed:1", 46, id="async-ckpt-committed-before-validation"),
    pytest.param("mid-async", "optimizer_step:50", 45, id="async-train-step-mid-epoch-ckpts"),
    pytest.param("mid-async", "checkpoint_staged:3", 30, id="async-mid-epoch-ckpt-written-not-committed"),
]


# A kill at a training step waits for the commits before it (they run in the background): the
# checkpoint it resumes from is that many commits in (46: the first of "epoch"; 45: "mid"'s third).
COMMITS_BEFORE = {46: 1, 45: 3}


@pytest.mark.parametrize(("config", "kill_at", "resume_step"), KILLS)
def test_kill_at_fault_point_then_rerun_ends_identically(
    config: str,
    kill_at: str,
    resume_step: int | None,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    reference: Result = request.getfixturevalue(f"ref_{config.split('-')[0]}")
    run = TrainRun(tmp_path, CONFIGS[config])
    gate = after_commits(COMMITS_BEFORE[resume_step]) if kill_at.startswith("optimizer_step") else None
    killed = run.run(kill_at=kill_at, extra_env=gate).check_killed()
    assert not (run.dir / "summary.json").exists(), killed.tail()

    resumed = run_here(run)
    if resume_step is None:
        assert not any(line.startswith("resumed from") for line in resumed.output.splitlines())
    else:
        assert_resumed_from(resumed.output, resume_step)
    assert_same_run(resumed, reference)
    # Nothing half-written is left behind: no staging or half-deleted directory.
    leftovers = [p.name for p in (run.dir / "checkpoints").iterdir() if p.name.startswith(".")]
    assert not leftovers, leftovers


def test_a_fault_held_by_a_commit_waits_at_its_step_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step kills above rest on it: a commit arriving late (a loaded machine; it runs on the
    writer's thread) holds the step the fault is armed at until it lands; the fault fires once."""
    import importlib
    import threading

    import linnaeus_accel.process.faults as faults

    monkeypatch.setenv("LINNAEUS_ACCEL_RAISE_AT", "optimizer_step:2")
    monkeypatch.setenv("LINNAEUS_ACCEL_FAULT_AFTER", "checkpoint_committed:1")
    monkeypatch.delenv("LINNAEUS_ACCEL_FAULT_RANK", raising=False)
    armed = importlib.reload(faults)
    committed = threading.Event()

    def commit() -> None:
        committed.set()
        armed.fault_point("checkpoint_committed")

    writer = threading.Timer(0.3, commit)
    try:
        armed.fault_point("optimizer_step")  # step 1: not armed there
        writer.start()
        with pytest.raises(RuntimeError, match="RAISE_AT"):
            armed.fault_point("optimizer_step")  # step 2: waits for the commit, then fires
        assert committed.is_set()
        armed.fault_point("optimizer_step")  # fired once only
    finally:
        writer.cancel()
        monkeypatch.undo()
        importlib.reload(faults)


def test_kill_right_after_final_commit_then_rerun_ends_identically(
    killed_after_final_commit: TrainRun, ref_epoch: Result, tmp_path: Path
) -> None:
    run = killed_after_final_commit.clone(tmp_path)
    resumed = run_here(run)
    assert_resumed_from(resumed.output, 92)
    assert_same_run(resumed, ref_epoch)
    assert journal(run.dir / "checkpoints" / ckpt(92)) == journal(ref_epoch.dir / "checkpoints" / ckpt(92))


RANDOM_KILLS = 3
_delays = random.Random(20260401)
# Fractions of the time a run spends after its start-up (imports, dataset; measured from the
# creation of metrics.jsonl: ``active_seconds``), one drawn in each third of [0, 0.75) (later ones
# often miss on a busy machine, where the run ends first): a kill lands in a training step, a
# validation pass or a checkpoint write, wherever the time goes.
KILL_FRACTIONS = [0.75 * (i + _delays.random()) / RANDOM_KILLS for i in range(RANDOM_KILLS)]


@pytest.mark.parametrize(
    ("fraction", "config"),
    [
        *[pytest.param(f, "epoch", id=f"at-{f:.2f}-of-run") for f in KILL_FRACTIONS],
        pytest.param(KILL_FRACTIONS[-1], "epoch-async", id=f"async-at-{KILL_FRACTIONS[-1]:.2f}-of-run"),
    ],
)
def test_kill_at_random_moment_then_rerun_ends_identically(
    fraction: float, config: str, ref_epoch: Result, active_seconds: float, tmp_path: Path
) -> None:
    run = TrainRun(tmp_path, CONFIGS[config])
    started = run.start()
    wait_for_file(started, run.dir / "metrics.jsonl")
    try:
        started.proc.wait(timeout=fraction * active_seconds)
    except subprocess.TimeoutExpired:
        started.proc.send_signal(signal.SIGKILL)
    killed = started.finish()
    if killed.returncode == 0:  # a slow kill on a busy machine: the run finished first
        assert_same_run(killed, ref_epoch)
        return
    assert killed.returncode == KILLED, killed.tail()
    if (run.dir / "summary.json").exists():  # killed between summary.json and the exit
        assert_same_run(Result(0, killed.output, run.dir, killed.seconds), ref_epoch)
        return
    assert_same_run(run_here(run), ref_epoch)


# ---------------------------------------------------------------------------------------------
# 2. A corrupt newest checkpoint is skipped, and said so
# ---------------------------------------------------------------------------------------------


def truncate_weights(checkpoint: Path) -> None:
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def delete_marker(checkpoint: Path) -> None:
    (checkpoint / "COMMITTED.json").unlink()


@pytest.mark.parametrize("damage", [truncate_weights, delete_marker], ids=["truncated-file", "no-marker"])
def test_corrupt_newest_checkpoint_falls_back_to_previous(
    damage: Any, killed_after_final_commit: TrainRun, ref_epoch: Result, tmp_path: Path
) -> None:
    run = killed_after_final_commit.clone(tmp_path)
    damage(run.dir / "checkpoints" / ckpt(92))
    resumed = run_here(run)
    skipped = [line for line in resumed.output.splitlines() if "skipping checkpoint" in line]
    assert len(skipped) == 1, resumed.tail()
    assert ckpt(92) in skipped[0], skipped
    assert f"using {ckpt(46)}" in skipped[0], skipped
    reason = "model.safetensors" if damage is truncate_weights else "COMMITTED.json missing"
    assert reason in skipped[0], skipped
    assert_resumed_from(resumed.output, 46)
    assert_same_run(resumed, ref_epoch)


# ---------------------------------------------------------------------------------------------
# 3. Planted pickles are never executed
# ---------------------------------------------------------------------------------------------


class _Planted:
    """Unpickling this creates ``path``: proof that someone unpickled it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))


def forge_manifest(checkpoint: Path, relative: str) -> None:
    """Update COMMITTED.json for a replaced file, as an attacker who controls the directory would."""
    marker_path = checkpoint / "COMMITTED.json"
    marker = json.loads(marker_path.read_text(encoding="utf-8"))
    data = (checkpoint / relative).read_bytes()
    for entry in marker["files"]:
        if entry["path"] == relative:
            entry.update(dict([file_digest(data)]), size=len(data))
    marker_path.write_text(json.dumps(marker), encoding="utf-8")


def test_planted_pickles_are_never_executed(killed_after_final_commit: TrainRun, tmp_path: Path) -> None:
    run = killed_after_final_commit.clone(tmp_path)
    flag = tmp_path / "PWNED"
    payload = pickle.dumps(_Planted(str(flag)), protocol=2)
    pickle.loads(payload)  # the payload works ...
    assert flag.exists()
    flag.unlink()  # ... and is disarmed again

    newest = run.dir / "checkpoints" / ckpt(92)
    # Files the checkpoint does not list, under names Accelerate and we might look for ...
    for name in (
        "evil.pkl", "sampler.bin", "scheduler.bin", "scaler.pt",
        "dl_state_dict.bin", "pytorch_model.bin", "trainer_state.pkl", "random_states_1.pkl",
    ):  # fmt: skip
        (newest / name).write_bytes(payload)
    # (a checkpoint holding files its manifest does not list is moved aside, unread) ... and, in the
    # older checkpoint, a listed file replaced under a manifest forged to match (a checkpoint from
    # an untrusted bucket): opened as data before anything is loaded, it is refused too (Accelerate
    # would have swallowed the failure and resumed with other random states).
    older = run.dir / "checkpoints" / ckpt(46)
    (older / "random_states_0.pkl").write_bytes(payload)
    forge_manifest(older, "random_states_0.pkl")

    refused = run_here(run)
    assert not flag.exists(), f"a planted pickle was executed during resume\n{refused.tail()}"
    assert refused.returncode == 2, refused.tail()
    assert "not in COMMITTED.json" in refused.output, refused.tail()
    assert "random_states_0.pkl: not loadable as data" in refused.output, refused.tail()
    assert "resumed from" not in refused.output
    assert sorted(p.name for p in (run.dir / "checkpoints" / "rejected").iterdir()) == [ckpt(46), ckpt(92)]


# ---------------------------------------------------------------------------------------------
# 4. Mid-validation resume runs only the remaining passes
# ---------------------------------------------------------------------------------------------


def test_mid_validation_resume_runs_only_remaining_passes(ref_epoch: Result, tmp_path: Path) -> None:
    run = TrainRun(tmp_path, EPOCH_CKPT)
    # The 3rd pass overall: the 2nd of the 4 at the epoch-2 boundary, just after its journal entry.
    run.run(kill_at="validation_pass:3").check_killed()
    boundary = run.dir / "checkpoints" / ckpt(46)
    assert journal(boundary) == EPOCH2_PASSES[:2]
    assert not [r for r in read_metrics(run.dir) if r["global_step"] == 46 and is_val(r)]

    resumed = run_here(run)
    assert_resumed_from(resumed.output, 46)
    # Each pass of that boundary exactly once: the two done before the kill were not run again.
    assert journal(boundary) == EPOCH2_PASSES
    records = [r for r in read_metrics(run.dir) if r["global_step"] == 46 and is_val(r)]
    assert len(records) == 1, records
    (ref_record,) = [r for r in read_metrics(ref_epoch.dir) if r["global_step"] == 46 and is_val(r)]
    assert records[0] == ref_record  # every pass's metrics, the same floats
    for prefix in EPOCH2_PASSES:
        assert f"{prefix}/loss" in records[0]
    # The console reports the epoch-2 validation once, in the resumed run.
    assert len([line for line in resumed.output.splitlines() if line.startswith("epoch 2: val/loss")]) == 1
    assert_same_run(resumed, ref_epoch)


# ---------------------------------------------------------------------------------------------
# 5. SIGTERM preemption
# ---------------------------------------------------------------------------------------------


def test_sigterm_preempts_one_process_then_rerun_ends_identically(ref_epoch: Result, tmp_path: Path) -> None:
    run = TrainRun(tmp_path, EPOCH_CKPT)
    started = run.start()
    # The epoch-1 validation record (step 23): the run is now training epoch 2 (steps 24..46).
    wait_for_record(started, lambda r: r["global_step"] == 23 and is_val(r))
    started.proc.send_signal(signal.SIGTERM)
    preempted = started.finish()
    step = assert_preempted(preempted, total_steps=92)
    assert "preempted" in preempted.output

    resumed = run_here(run)
    assert_resumed_from(resumed.output, step)
    assert_same_run(resumed, ref_epoch)


# Sends SIGTERM to its own process while the n-th validation pass runs: a scheduler's preemption
# notice that arrives during validation rather than during a training step.
SIGTERM_IN_PASS = """
import os, signal, sys
import linnaeus_accel.training.boundary_work as events
from linnaeus_accel.cli import main
original, seen = events.run_pass, [0]
def run_pass(*args, **kwargs):
    seen[0] += 1
    if seen[0] == {n}:
        os.kill(os.getpid(), signal.SIGTERM)
    return original(*args, **kwargs)
events.run_pass = run_pass
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_during_validation_is_a_clean_preemption(ref_epoch: Result, tmp_path: Path) -> None:
    """On SIGTERM, checkpoint, write ``status: preempted`` and exit 0, wherever
    the signal lands; here, inside the 3rd validation pass (2nd of the epoch-2 boundary)."""
    run = TrainRun(tmp_path, EPOCH_CKPT)
    preempted = run.run(python_code=SIGTERM_IN_PASS.replace("{n}", "3"))
    assert preempted.returncode == 0, (
        f"SIGTERM during a validation pass killed the process instead of preempting it\n{preempted.tail()}"
    )
    assert read_summary(run.dir)["status"] == "preempted", read_summary(run.dir)
    assert committed(run.dir), "no checkpoint to resume from"
    assert_same_run(run_here(run), ref_epoch)


def worker_processes(launcher: subprocess.Popen[bytes]) -> list[psutil.Process]:
    children = psutil.Process(launcher.pid).children(recursive=True)
    return [p for p in children if "linnaeus_accel" in " ".join(p.cmdline())]


def test_sigterm_preempts_two_processes_then_rerun_ends_identically(ref_two: Result, tmp_path: Path) -> None:
    """SIGTERM to both workers (as SLURM and spot-instance agents deliver it); every process exits
    0, the launcher too. (Signalling the launcher itself makes torchelastic raise SignalException
    and exit 1 whatever the workers do, so it is not signalled here.)"""
    run = TrainRun(tmp_path, TWO_PROC_OPTS, processes=2)
    started = run.start()
    try:
        # The epoch-1 validation record (step 12): stops at the next agreed check (step 20, 24 or 30).
        wait_for_record(started, lambda r: r["global_step"] == 12 and is_val(r))
        workers = worker_processes(started.proc)
        assert len(workers) == 2, workers
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        preempted = started.finish()
    finally:
        if started.proc.poll() is None:
            kill_group(started.proc)
    step = assert_preempted(preempted, total_steps=48, checked_every=10, epoch_steps=12)

    resumed = run.run()
    assert_resumed_from(resumed.output, step)
    assert_same_run(resumed, ref_two)


@pytest.mark.parametrize(
    ("step", "config"),
    [
        (46, "epoch"),  # the last step of epoch 2, whose boundary takes a checkpoint and four passes
        (92, "epoch"),  # the run's last step: the final boundary (checkpoint, the final passes)
        # the preempted run exits only once its background-written checkpoint is committed
        (92, "epoch-async"),
    ],
)
def test_sigterm_at_an_epochs_last_step_then_rerun_ends_identically(
    ref_epoch: Result, tmp_path: Path, step: int, config: str
) -> None:
    """The preemption checkpoint of an epoch's last step is that boundary's checkpoint, with its
    validation passes still due: the rerun runs them and goes on (it once committed the boundary
    checkpoint a second time: FileExistsError on every rerun)."""
    run = TrainRun(tmp_path, CONFIGS[config])
    preempted = run.run(extra_env={"LINNAEUS_ACCEL_TERM_AT": f"optimizer_step:{step}"})
    preempted.check_ok()
    assert read_summary(run.dir)["status"] == "preempted", read_summary(run.dir)
    assert read_summary(run.dir)["global_step"] == step
    assert committed(run.dir)[-1] == ckpt(step)
    assert journal(run.dir / "checkpoints" / ckpt(step)) == []  # no pass ran before the stop

    resumed = run_here(run)
    assert_resumed_from(resumed.output, step)
    assert_same_run(resumed, ref_epoch)
    assert journal(run.dir / "checkpoints" / ckpt(step))[0] == "val"


@pytest.mark.parametrize("config", ["epoch", "epoch-async"])
def test_sigterm_before_a_boundary_with_two_processes_then_rerun_ends_identically(
    ref_two: Result, tmp_path: Path, config: str
) -> None:
    """Both workers get SIGTERM at step 21; the flag is agreed every 10 steps and at every epoch's
    last step, so both stop at the boundary of step 24 and checkpoint it with its passes due. The
    rerun's first ``train/loss`` (step 40) averages steps 21-40, three of them from before the
    stop: each process's share of that window comes back from its own file (assert_same_run
    compares every logged float; it differed in 6 of 7 two-process resumes when one process's
    share was loaded by both). ASYNC: process 1 writes its part in the loop, process 0 in the
    background, and the commit still follows both. With the ema callback: its average is saved
    (in the background with ASYNC) and resumed byte-identical."""
    run = TrainRun(tmp_path, [*TWO_PROC_OPTS, *(ASYNC if config == "epoch-async" else [])], processes=2)
    preempted = run.run(extra_env={"LINNAEUS_ACCEL_TERM_AT": "optimizer_step:21"})
    assert preempted.returncode == 0, preempted.tail()
    assert read_summary(run.dir)["status"] == "preempted", read_summary(run.dir)
    assert read_summary(run.dir)["global_step"] == 24
    assert committed(run.dir) == [ckpt(24)]

    resumed = run.run()
    assert_resumed_from(resumed.output, 24)
    assert_same_run(resumed, ref_two)


# ---------------------------------------------------------------------------------------------
# 6. AUTO_RESUME false, and --resume an older checkpoint
# ---------------------------------------------------------------------------------------------


def test_auto_resume_false_refuses_a_used_directory(
    killed_after_final_commit: TrainRun, tmp_path: Path
) -> None:
    run = killed_after_final_commit.clone(tmp_path)
    before = committed(run.dir)
    run.opts += ["TRAIN.AUTO_RESUME", "false"]
    refused = run_here(run)
    assert refused.returncode == 2, refused.tail()
    assert "TRAIN.AUTO_RESUME" in refused.output
    assert "Traceback" not in refused.output
    assert committed(run.dir) == before  # nothing was touched


def test_resume_from_an_older_checkpoint(
    killed_after_final_commit: TrainRun, ref_epoch: Result, tmp_path: Path
) -> None:
    run = killed_after_final_commit.clone(tmp_path)
    older = run.dir / "checkpoints" / ckpt(46)
    resumed = run_here(run, args=["--resume", str(older)])
    assert_resumed_from(resumed.output, 46)
    assert_same_run(resumed, ref_epoch)


@pytest.fixture(autouse=True)
def _no_stray_processes() -> Iterator[None]:
    """Every test waits for what it started; a leftover trainer would skew the others' timings."""
    yield
    ours = psutil.Process().children(recursive=True)
    assert not [p for p in ours if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], ours
