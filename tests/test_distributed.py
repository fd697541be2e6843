"""Multi-process training on the CPU (gloo), as real subprocesses: `accelerate launch` and `torchrun`.

- Factorisation equivalence: 2 processes x accumulation 2 and 1 process x accumulation 4
  (same per-process batch, same effective batch, the default data that neither divides evenly,
  masking and mixup on) log the same global steps, LRs, losses and validation epochs and end with
  the same weights (within 1e-5; measured 2.4e-7).
- Step and sample accounting under 2 processes (docs/semantics.md §1): the final ``global_step`` is `plan`'s
  ``total_steps``, each sample is counted once (Accelerate's even-batch padding is not), and only
  the main process writes metrics.jsonl.
- `torchrun` works when Accelerate is told to stay on the CPU (``ACCELERATE_USE_CPU``).
- A config error under 2 processes exits non-zero, says so once, and shows none of our tracebacks.

Every launch gets a free rendezvous port, an isolated HF_HOME (no user accelerate config leaks in),
one OpenMP thread per process (2 cores), and writes its output to files under ``tmp_path``. The
1-process runs that are neither killed nor launched (references, resumes, refusals) train in this
process (``single_process_here``), whose torch is imported already: that import is most of a short
run's cost in a process of its own.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.configs import CFG, REPO
from helpers.in_process import plan_json, train_in_process
from helpers.launches import Launch, accelerate_launch, torchrun
from helpers.processes import LAUNCHER_VARIABLES, OWN_PREFIXES, after_commits, lines_through_our_code

from linnaeus_accel.cli import plan_for
from linnaeus_accel.config import load_config
from linnaeus_accel.schedule import OpsSchedule

CPU_2_PROCESSES = str(REPO / "accelerate_configs" / "cpu_2_processes.yaml")
DIGITS_TRAIN = 1438  # training split of the default config (1797 images, VAL_FRACTION 0.2)
DIGITS_VAL = 359

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def train_lines(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "train/loss" in r]


def val_lines(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "val/loss" in r]


def single_process_here(
    name: str, opts: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> Launch:
    """``helpers.launches.single_process`` in this process: the same command line and environment
    (``launch_env``'s: the launchers' and our own variables dropped, Accelerate on the CPU), its
    stdout and stderr in ``tmp_path/<name>.stdout`` and ``.stderr``, read back as a ``Launch``."""
    base = tmp_path / "outputs"
    capsys.readouterr()  # what the test printed before is not the run's
    # A process configures no logging, so its warnings reach stderr through logging's last resort;
    # here pytest's handler on the root logger would take them.
    warnings = logging.StreamHandler(sys.stderr)  # capsys's, while the test runs
    warnings.setLevel(logging.WARNING)
    with pytest.MonkeyPatch.context() as mp:
        for variable in [k for k in os.environ if k in LAUNCHER_VARIABLES or k.startswith(OWN_PREFIXES)]:
            mp.delenv(variable)
        mp.setenv("ACCELERATE_USE_CPU", "true")
        logging.getLogger().addHandler(warnings)
        try:
            rc = train_in_process(["ENV.OUTPUT.BASE_DIR", str(base), "EXPERIMENT.NAME", name, *opts])
        finally:
            logging.getLogger().removeHandler(warnings)
    captured = capsys.readouterr()
    stdout, stderr = tmp_path / f"{name}.stdout", tmp_path / f"{name}.stderr"
    stdout.write_text(captured.out, encoding="utf-8")
    stderr.write_text(captured.err, encoding="utf-8")
    return Launch(rc, stdout, stderr, base / name)


def max_weight_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].shape == b[k].shape, k
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# ---------------------------------------------------------------------------------------------
# 1. 2 processes x accumulation 2 == 1 process x accumulation 4
# ---------------------------------------------------------------------------------------------

# The default data and batch (1,438 samples, 32 per process, no DROP_LAST), which neither
# factorisation divides: on 1 process x accumulation 4 each epoch is 45 micro-batches, the last
# holding 30 samples, alone in the 12th step; on 2 x 2 it is 23 micro-batches per process, and
# Accelerate fills the last global batch (30 real samples) with 34 repeats. The repeats must weigh
# nothing and each step's loss must be the mean over its real samples, not over its micro-batches,
# for both runs to learn the same thing (before: weights apart by up to 0.037). Masking and mixup
# stay on as in the default config. Logging every step compares the whole LR and loss history.
# Measured: final weights within 2.4e-7, train/loss within 2.4e-7.
EQUIVALENCE_OPTS = [
    "TRAIN.EPOCHS",
    "3",
    "EXPERIMENT.SEED",
    "7",
    "SCHEDULE.METRICS.STEP_INTERVAL",
    "1",
]
EQUIVALENCE_STEPS = 36  # 12 steps per epoch x 3 epochs


def test_two_processes_accumulating_2_match_one_process_accumulating_4(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    two_opts = [*EQUIVALENCE_OPTS, "TRAIN.ACCUMULATION_STEPS", "2"]
    one_opts = [*EQUIVALENCE_OPTS, "TRAIN.ACCUMULATION_STEPS", "4"]
    plan2, plan1 = (
        plan_json("--world-size", "2", "--no-series", "--opts", *two_opts),
        plan_json("--world-size", "1", "--no-series", "--opts", *one_opts),
    )
    assert plan2["total_steps"] == plan1["total_steps"] == EQUIVALENCE_STEPS
    assert plan2["effective_batch_size"] == plan1["effective_batch_size"] == 128
    assert plan2["lr_scale"] == plan1["lr_scale"]

    two = accelerate_launch("two_procs_accum2", two_opts, tmp_path, processes=2).check_ok()
    one = single_process_here("one_proc_accum4", one_opts, tmp_path, capsys).check_ok()

    # The 2-process run really ran on 2 processes (the schedule summary says what it resolved).
    assert "x 2 processes" in two.stdout + two.stderr, two.tail()
    assert "x 1 process" in one.stdout + one.stderr, one.tail()

    s2, s1 = two.summary(), one.summary()
    assert s2["global_step"] == s1["global_step"] == EQUIVALENCE_STEPS
    assert s2["samples_seen"] == s1["samples_seen"] == 3 * DIGITS_TRAIN  # repeats are not counted
    assert s2["status"] == s1["status"] == "completed"

    m2, m1 = two.metrics(), one.metrics()
    t2, t1 = train_lines(m2), train_lines(m1)
    assert (
        [r["global_step"] for r in t2]
        == [r["global_step"] for r in t1]
        == list(range(1, EQUIVALENCE_STEPS + 1))
    )
    assert [r["global_step"] for r in m2] == [r["global_step"] for r in m1]
    assert [r["lr/default"] for r in t2] == [r["lr/default"] for r in t1]
    assert [r["samples_seen"] for r in t2] == [r["samples_seen"] for r in t1]
    loss_diff = max(abs(a["train/loss"] - b["train/loss"]) for a, b in zip(t2, t1, strict=True))
    assert loss_diff <= 1e-5, f"train/loss differs by up to {loss_diff:.3g}"

    v2, v1 = val_lines(m2), val_lines(m1)
    assert [r["epoch"] for r in v2] == [r["epoch"] for r in v1] == [1.0, 2.0, 3.0]
    assert [r["global_step"] for r in v2] == [r["global_step"] for r in v1] == [12, 24, 36]
    for a, b in zip(v2, v1, strict=True):
        assert sorted(a) == sorted(b)
        for key in a:
            if key.endswith("/loss"):
                assert math.isclose(a[key], b[key], abs_tol=1e-5), (key, a[key], b[key])
            elif "acc" in key:  # at most one of the 359 validation images may flip on a near-tie
                assert abs(a[key] - b[key]) <= 1.5 / DIGITS_VAL, (key, a[key], b[key])

    diff = max_weight_diff(two.weights(), one.weights())
    assert diff <= 1e-5, f"final weights differ by up to {diff:.3g} (max abs)"


# ---------------------------------------------------------------------------------------------
# 2. Step and sample accounting under 2 processes
# ---------------------------------------------------------------------------------------------


def expected_samples_by_step(batches: int, accum: int, epochs: int, per_step: int) -> dict[int, int]:
    """samples_seen after each optimizer step: micro-batch i of an epoch holds
    min(per_step, N - i * per_step) real samples (the rest of the last one is padding), and an
    epoch's trailing partial accumulation window is one step."""
    seen, step, out = 0, 0, {}
    for _ in range(epochs):
        for i in range(batches):
            seen += max(0, min(per_step, DIGITS_TRAIN - i * per_step))
            if (i + 1) % accum == 0 or i == batches - 1:
                step += 1
                out[step] = seen
    return out


@pytest.mark.parametrize("accum", [1, 3])
def test_two_process_run_reaches_plan_and_counts_each_sample_once(tmp_path: Path, accum: int) -> None:
    epochs = 2
    # Default batch 32 without DROP_LAST: 45 batches, the last one of 30 samples; 2 processes get 23
    # micro-batches each, process 1's last one padded by Accelerate (even_batches).
    opts = [
        "TRAIN.EPOCHS",
        str(epochs),
        "TRAIN.ACCUMULATION_STEPS",
        str(accum),
        "SCHEDULE.METRICS.STEP_INTERVAL",
        "5",
    ]
    plan = plan_json("--world-size", "2", "--no-series", "--opts", *opts)
    assert plan["batches_per_epoch"] == 23
    assert plan["total_steps"] == math.ceil(23 / accum) * epochs

    # The shipped accelerate config for 2 CPU processes.
    run = accelerate_launch(f"accum{accum}", opts, tmp_path, config_file=CPU_2_PROCESSES).check_ok()

    summary = run.summary()
    assert summary["global_step"] == plan["total_steps"]
    assert summary["expected_total_steps"] == plan["total_steps"]
    assert summary["epoch"] == epochs
    assert summary["status"] == "completed"
    assert summary["samples_seen"] == epochs * DIGITS_TRAIN
    # What it ran on, for whoever reads the result later.
    info = summary["run_info"]
    assert (info["world_size"], info["machines"], info["distributed_type"]) == (2, 1, "MULTI_CPU"), info

    records = run.metrics()
    assert all("global_step" in r for r in records)
    trains, vals = train_lines(records), val_lines(records)
    assert len(trains) + len(vals) == len(records), "a metrics line that is neither train nor validation"

    # One line per logging step and one per validation: rank 1 wrote nothing.
    config = load_config(CFG, opts)
    resolved = plan_for(config, 2, None)
    ops = OpsSchedule(resolved)
    logged = [s for s in range(1, resolved.total_steps + 1) if ops.should_log_metrics(s)]
    assert len(logged) >= 3
    assert [r["global_step"] for r in trains] == logged
    assert [r["epoch"] for r in vals] == [float(e) for e in range(1, epochs + 1)]
    assert [r["global_step"] for r in vals] == [resolved.boundary_step(e) for e in range(1, epochs + 1)]

    expected = expected_samples_by_step(23, accum, epochs, per_step=64)
    assert expected[plan["total_steps"]] == epochs * DIGITS_TRAIN
    assert [r["samples_seen"] for r in trains] == [float(expected[s]) for s in logged]
    # The LR logged at step s is the one the optimizer used for update s (step index s - 1).
    assert [r["lr/default"] for r in trains] == [resolved.lr(s - 1) for s in logged]


# ---------------------------------------------------------------------------------------------
# 3. torchrun
# ---------------------------------------------------------------------------------------------


def test_torchrun_two_cpu_processes(tmp_path: Path) -> None:
    """`torchrun` needs Accelerate kept on the CPU (``ACCELERATE_USE_CPU``, which is
    ``Accelerator(cpu=True)``); then the trainer runs as one 2-process job."""
    opts = ["TRAIN.EPOCHS", "1", "SCHEDULE.METRICS.STEP_INTERVAL", "5"]
    plan = plan_json("--world-size", "2", "--no-series", "--opts", *opts)
    run = torchrun("torchrun", opts, tmp_path).check_ok()
    assert "x 2 processes" in run.stdout + run.stderr, run.tail()
    summary = run.summary()
    assert summary["global_step"] == plan["total_steps"] == 23
    assert summary["samples_seen"] == DIGITS_TRAIN
    steps = [r["global_step"] for r in train_lines(run.metrics())]
    assert steps == sorted(set(steps)), "duplicate metrics lines: more than one process wrote"


# ---------------------------------------------------------------------------------------------
# 4. Config errors under 2 processes
# ---------------------------------------------------------------------------------------------


def test_config_error_under_two_processes_is_reported_once(tmp_path: Path) -> None:
    """Every process finds the bad value; the local main process alone reports it."""
    run = accelerate_launch("bad_epochs", ["TRAIN.EPOCHS", "-1"], tmp_path)
    assert run.returncode != 0, run.tail()
    output = run.stdout + run.stderr
    assert output.count("invalid config") == 1, run.tail()
    assert output.count("TRAIN.EPOCHS: must be an integer >= 1 (got -1)") == 1, run.tail()
    # The launcher (accelerate / torch elastic) prints its own ChildFailedError report; none of the
    # tracebacks may come from our code.
    assert not lines_through_our_code(output), run.tail()
    assert "ConfigError" not in output, run.tail()
    assert not run.dir.exists(), "a config error must not create the output directory"


def test_existing_output_under_two_processes_is_reported_once_without_traceback(tmp_path: Path) -> None:
    """A finished run in the output directory: only the main process checks it, and every process
    ends with nothing to do (exit 0), saying so once."""
    name = "taken"
    taken = tmp_path / "outputs" / name
    taken.mkdir(parents=True)
    previous = '{"global_step": 1, "train/loss": 1.0}\n'
    finished = '{"global_step": 1, "status": "completed"}\n'
    (taken / "metrics.jsonl").write_text(previous, encoding="utf-8")
    (taken / "summary.json").write_text(finished, encoding="utf-8")  # a finished run is never overwritten
    run = accelerate_launch(name, ["TRAIN.EPOCHS", "null", "TRAIN.STEPS", "1"], tmp_path)  # no longer
    assert run.returncode == 0, run.tail()
    output = run.stdout + run.stderr
    assert output.count("already holds a run completed at step 1: nothing to do") == 1, run.tail()
    assert (taken / "metrics.jsonl").read_text(encoding="utf-8") == previous
    assert (taken / "summary.json").read_text(encoding="utf-8") == finished
    ours = lines_through_our_code(output)
    assert not ours, "a traceback through our code:\n" + "\n".join(ours) + "\n" + run.tail()


@pytest.mark.slow
def test_elastic_resume_from_two_processes_onto_one_with_accumulation_doubled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run preempted on 2 processes x accumulation 2 resumes on 1 process x accumulation 4: same
    schedule, same samples per step, and it ends where an uninterrupted 1-process run ends."""
    opts = [
        "TRAIN.EPOCHS",
        "3",
        "DATA.BATCH_SIZE",
        "17",
        "DATA.DROP_LAST",
        "true",
        "SCHEDULE.CHECKPOINT.INTERVAL_STEPS",
        "10",
        "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS",
        "null",
        "SCHEDULE.CHECKPOINT.MID_EPOCH",
        "true",
    ]  # 84 batches of 17: 21 steps of 68 samples per epoch
    # mid-epoch 2, after the step-30 checkpoint (the third; the kill waits for its commit)
    kill_at = {"LINNAEUS_ACCEL_KILL_AT": "optimizer_step:35", **after_commits(3)}
    killed = accelerate_launch(
        "elastic", [*opts, "TRAIN.ACCUMULATION_STEPS", "2"], tmp_path, extra_env=kill_at
    )
    assert killed.returncode != 0, killed.tail()
    resumed = single_process_here(
        "elastic", [*opts, "TRAIN.ACCUMULATION_STEPS", "4"], tmp_path, capsys
    ).check_ok()
    reference = single_process_here(
        "reference", [*opts, "TRAIN.ACCUMULATION_STEPS", "4"], tmp_path, capsys
    ).check_ok()
    assert "resumed from" in resumed.stdout, resumed.tail()
    assert "step_00000030" in resumed.stdout, resumed.tail()
    assert resumed.summary()["global_step"] == reference.summary()["global_step"] == 63
    assert resumed.summary()["samples_seen"] == reference.summary()["samples_seen"]
    assert [r["global_step"] for r in train_lines(resumed.metrics())] == [
        r["global_step"] for r in train_lines(reference.metrics())
    ]
    assert max_weight_diff(resumed.weights(), reference.weights()) < 1e-5


@pytest.mark.slow
def test_resume_with_another_effective_batch_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    opts = ["TRAIN.EPOCHS", "2", "DATA.BATCH_SIZE", "64", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1"]
    single_process_here("changed", opts, tmp_path, capsys).check_ok()
    (tmp_path / "outputs" / "changed" / "summary.json").unlink()  # as if it had been preempted
    again = single_process_here("changed", [*opts, "TRAIN.ACCUMULATION_STEPS", "2"], tmp_path, capsys)
    assert again.returncode == 2, again.tail()
    assert "not this run's" in again.stderr, again.tail()
