"""A finished run trained longer (issue 29): raising TRAIN.EPOCHS of a completed run continues it to
the new end, on the new plan's LR, and a kill -9 during the extension resumes byte-identical.

The run: digits, 6 steps an epoch, a checkpoint at every epoch; 2 epochs (12 steps), then 3.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import reset_accelerate, run_cli
from test_resume import CFG, TrainRun, assert_resumed_from, assert_same_run, metrics, summary

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
    assert (summary(run.dir)["status"], summary(run.dir)["global_step"]) == ("completed", 12)
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
    done = summary(extended.dir)
    assert (done["status"], done["global_step"], done["epoch"]) == ("completed", 18, 3)

    # Steps 13..18 at the LR of a fresh 3-epoch run's plan (the 2-epoch plan had decayed to MIN_LR).
    plan = plan_for(load_config(CFG, [*OPTS, *LONGER]), 1, None)
    logged = {r["global_step"]: r["lr/default"] for r in metrics(extended.dir) if "lr/default" in r}
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
