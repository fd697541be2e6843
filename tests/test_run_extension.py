"""A finished run trained longer: raising TRAIN.EPOCHS of a completed run continues it to
the new end, on the new plan's LR, and a kill -9 during the extension resumes byte-identical.

The run: digits, 6 steps an epoch, a checkpoint at every epoch; 2 epochs (12 steps), then 3.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers.configs import CFG
from helpers.in_process import reset_accelerate, run_cli
from helpers.runs import (
    TrainRun,
    assert_resumed_from,
    assert_same_run,
    deterministic,
    read_metrics,
    read_summary,
)

from linnaeus_accel.cli import plan_for
from linnaeus_accel.config import load_config

OPTS = [
    *("DATA.BATCH_SIZE", "256", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1", "SCHEDULE.METRICS.STEP_INTERVAL", "1"),
    *("SCHEDULE.CHECKPOINT.KEEP_LAST_N", "3", "SCHEDULE.CHECKPOINT.KEEP_TOP_N", "0"),
]  # fmt: skip
LONGER = ["TRAIN.EPOCHS", "3"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> TrainRun:
    run = TrainRun(tmp_path_factory.mktemp("finished"), [*OPTS, "TRAIN.EPOCHS", "2"])
    run.run().check_ok()
    assert (read_summary(run.dir)["status"], read_summary(run.dir)["global_step"]) == ("completed", 12)
    return run


def longer(run: TrainRun, root: Path) -> TrainRun:
    """A copy of ``run`` whose command asks for 3 epochs."""
    copy = run.clone(root)
    return TrainRun(copy.root, [*OPTS, *LONGER], cfg=copy.cfg)


@pytest.mark.slow
def test_a_finished_run_trained_longer_follows_the_new_plan_and_survives_a_kill(
    finished: TrainRun, tmp_path: Path
) -> None:
    extended = longer(finished, tmp_path / "extended").run(args=["--allow-config-change"]).check_ok()
    assert_resumed_from(extended.output, 12)
    assert "the run now ends at step 18 (TRAIN.EPOCHS), not 12" in extended.output
    done = read_summary(extended.dir)
    assert (done["status"], done["global_step"], done["epoch"]) == ("completed", 18, 3)

    # Steps 13..18 at the LR of a fresh 3-epoch run's plan (the 2-epoch plan had decayed to MIN_LR).
    plan = plan_for(load_config(CFG, [*OPTS, *LONGER]), 1, None)
    logged = {r["global_step"]: r["lr/default"] for r in read_metrics(extended.dir) if "lr/default" in r}
    assert [logged[s] for s in range(13, 19)] == pytest.approx(
        [plan.lr(s - 1) for s in range(13, 19)], rel=1e-12
    )
    assert logged[12] != pytest.approx(plan.lr(11))  # the first 12 steps were the 2-epoch plan's

    killed = longer(finished, tmp_path / "killed")
    killed.run(kill_at="optimizer_step:3", args=["--allow-config-change"]).check_killed()  # at step 15
    resumed = killed.run(args=["--allow-config-change"])
    assert_resumed_from(resumed.output, 12)
    assert_same_run(resumed, extended)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_without_the_flag_it_says_how_and_a_shorter_run_is_refused(
    finished: TrainRun, tmp_path: Path
) -> None:
    run = finished.clone(tmp_path / "run")
    common = ["ENV.OUTPUT.BASE_DIR", str(run.base), "EXPERIMENT.NAME", run.dir.name, *OPTS]
    rc, _, err = run_cli("train", "--cfg", CFG, "--opts", *common, *LONGER)
    assert rc == 2, err
    assert "to train this run on to step 18 (it was to end at step 12), pass --allow-config-change" in err
    reset_accelerate()
    rc, _, err = run_cli(
        "train", "--cfg", CFG, "--allow-config-change", "--opts", *common, "TRAIN.EPOCHS", "1"
    )
    assert rc == 2, err
    assert "TRAIN.EPOCHS: this config ends the run at step 6" in err
    assert "has trained 12 steps already" in err
    reset_accelerate()
    rc, out, _ = run_cli("plan", "--cfg", CFG, "--opts", *common, *LONGER)
    assert rc == 0
    assert "Resume:   resumes at step 12 from " in out
    assert "the run now ends at step 18 (TRAIN.EPOCHS), not 12" in out
    assert "next validation at step 18, checkpoint at step 18" in out


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_finished_run_without_its_last_checkpoint_is_not_started_over(
    finished: TrainRun, tmp_path: Path
) -> None:
    """Trained longer, a run with no checkpoint of its last step would start from step 0 over
    its finished outputs: refused, pointing to a warm start from its final/."""
    run = finished.clone(tmp_path / "run")
    shutil.rmtree(run.dir / "checkpoints" / "step_00000012")
    before = (run.dir / "metrics.jsonl").read_bytes()
    common = ["ENV.OUTPUT.BASE_DIR", str(run.base), "EXPERIMENT.NAME", run.dir.name, *OPTS, *LONGER]
    rc, _, err = run_cli("train", "--cfg", CFG, "--allow-config-change", "--opts", *common)
    assert rc == 2, err
    assert "which has no checkpoint of step 12 to continue from" in err
    assert "MODEL.INIT_FROM" in err
    assert (run.dir / "metrics.jsonl").read_bytes() == before


# A run whose length is in steps ends inside an epoch (digits at batch 256: 6 steps an epoch). Every
# schedule is in steps (a step LR schedule, no masking or mixup ramps over a fraction of the run), so
# nothing depends on the run's length: trained longer, it must be the longer run, bit for bit.
IN_STEPS = [
    *("DATA.BATCH_SIZE", "256", "TRAIN.EPOCHS", "null", "MODEL.OPTIONS.dropout", "0.1"),
    *("LR_SCHEDULER.NAME", "step", "LR_SCHEDULER.WARMUP_FRACTION", "null", "LR_SCHEDULER.WARMUP_STEPS", "2"),
    *("LR_SCHEDULER.DECAY_STEPS", "3", "SCHEDULE.META_MASKING.ENABLED", "false"),
    *("SCHEDULE.META_MASKING.PARTIAL.ENABLED", "false", "SCHEDULE.MIXUP.PROB.ENABLED", "false"),
    *("SCHEDULE.METRICS.STEP_INTERVAL", "1", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1"),
]  # fmt: skip


def train_steps(base: Path, name: str, steps: int, *args: str) -> Path:
    reset_accelerate()
    opts = ["ENV.OUTPUT.BASE_DIR", str(base), "EXPERIMENT.NAME", name, *IN_STEPS, "TRAIN.STEPS", str(steps)]
    rc, _, err = run_cli("train", "--cfg", CFG, *args, "--opts", *opts)
    assert rc == 0, err[-3000:]
    return base / name


def train_rows(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["global_step"], r["train/loss"]) for r in read_metrics(run_dir) if "train/loss" in r]


@pytest.fixture(scope="module")
def fresh_9(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reset_accelerate()
    return train_steps(tmp_path_factory.mktemp("fresh"), "fresh", 9)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_run_ended_inside_an_epoch_trained_longer_is_the_longer_run(fresh_9: Path, tmp_path: Path) -> None:
    """4 steps (inside epoch 1) extended to 9, and 4 -> 7 -> 9 (7: inside epoch 2), equal a fresh
    9-step run: the old end kept the epoch's data position, so the extension continues epoch 1
    (it used to start epoch 2 at step 5). Each old end's last validation stays in the history."""
    fresh = fresh_9
    once = train_steps(tmp_path, "once", 4)
    reset_accelerate()
    common = ["ENV.OUTPUT.BASE_DIR", str(tmp_path), "EXPERIMENT.NAME", "once", *IN_STEPS, "TRAIN.STEPS", "9"]
    rc, out, err = run_cli("plan", "--cfg", CFG, "--opts", *common)
    assert rc == 0, err
    assert (
        "the 4 steps trained are what a fresh run of 9 steps trains: trained on, this run is that run" in out
    )
    train_steps(tmp_path, "once", 9, "--allow-config-change")
    twice = train_steps(tmp_path, "twice", 4)
    train_steps(tmp_path, "twice", 7, "--allow-config-change")
    train_steps(tmp_path, "twice", 9, "--allow-config-change")
    weights = (fresh / "final" / "model.safetensors").read_bytes()
    for run in (once, twice):
        assert (run / "final" / "model.safetensors").read_bytes() == weights, run.name
        assert train_rows(run) == train_rows(fresh), run.name
        assert (read_summary(run)["global_step"], read_summary(run)["epoch"]) == (9, 2)
    validated = {
        run: [r["global_step"] for r in read_metrics(run) if "val/loss" in r] for run in (fresh, once, twice)
    }
    assert validated == {fresh: [6, 9], once: [4, 6, 9], twice: [4, 6, 7, 9]}


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_killed_in_its_final_validation_inside_an_epoch_it_finishes_then_extends(
    fresh_9: Path, tmp_path: Path
) -> None:
    """Killed during the final validation of a run that ends inside an epoch: the rerun runs the
    passes left and counts the cut epoch as trained (as the uninterrupted run does); trained on to
    9 steps afterwards, it is the fresh 9-step run."""
    killed = TrainRun(tmp_path, [*IN_STEPS, "TRAIN.STEPS", "4"])
    killed.run(kill_at="validation_pass:1").check_killed()
    run = train_steps(killed.base, killed.dir.name, 4)
    done = read_summary(run)
    assert (done["status"], done["global_step"], done["epoch"]) == ("completed", 4, 1)
    assert [r["global_step"] for r in read_metrics(run) if "val/loss" in r] == [4]
    train_steps(killed.base, killed.dir.name, 9, "--allow-config-change")
    assert (run / "final" / "model.safetensors").read_bytes() == (
        fresh_9 / "final" / "model.safetensors"
    ).read_bytes()
    assert train_rows(run) == train_rows(fresh_9)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_preemption_during_the_final_validation_stops_inside_the_pass(tmp_path: Path) -> None:
    """SIGTERM after the first batch of the final validation's first pass: the run stops there
    (it used to finish the pass, the whole split at the end of a run, before stopping), the pass is
    not journalled, and the rerun runs it again and ends as the uninterrupted run."""
    reference = train_steps(tmp_path / "reference", "run", 4)
    (tmp_path / "preempted").mkdir()
    run = TrainRun(tmp_path / "preempted", [*IN_STEPS, "TRAIN.STEPS", "4"])
    preempted = run.run(extra_env={"LINNAEUS_ACCEL_TERM_AT": "validation_batch:1"}).check_ok()
    assert read_summary(run.dir)["status"] == "preempted", preempted.tail()
    assert "preempted by a signal during validation at step 4" in preempted.output
    journal = run.dir / "checkpoints" / "step_00000004" / "validation_journal.jsonl"
    assert not journal.exists() or not journal.read_text(), "the stopped pass was journalled"
    train_steps(run.base, run.dir.name, 4)
    assert read_summary(run.dir)["status"] == "completed"
    final = (run.dir / "final" / "model.safetensors").read_bytes()
    assert final == (reference / "final" / "model.safetensors").read_bytes()
    assert [deterministic(r) for r in read_metrics(run.dir)] == [
        deterministic(r) for r in read_metrics(reference)
    ]
