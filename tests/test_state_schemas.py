"""Each stateful part's checkpoint state has one format, a pydantic model beside its ``state_dict``
(``TrainingProgress.STATE_SCHEMA``, ...); a checkpoint's ``trainer_state.json`` and rank files are
verified against those models before anything loads, and a state that breaks one is rejected in
one line naming the part, the field, the rule and the value found.

- A table of malformed states (one row each: a float step, a negative count, an unknown stage, a
  missing version, a wrong rank file, ...) and the exact line each is rejected with; states that
  older checkpoints or registered parts legitimately hold pass.
- The parts write what their models read: each real part's state validates strictly against its
  own model, survives a JSON round trip unchanged, and the progress' JSON is the format checkpoints
  have always held (so checkpoints written before the models existed still verify).
- The registry of a real ``Trainer`` knows each part's model, the same the checkpoint files are
  verified with; a part registered under a known key with another format is refused.

Pure functions and one Trainer built (not run) on the digits config: a few seconds in all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import DEFAULT_CONFIG

from linnaeus_accel.checkpoint.state.files import rank_state_problem, state_problem
from linnaeus_accel.checkpoint.state.registry import StateRegistry
from linnaeus_accel.checkpoint.state.schemas import RANK_PARTS, RUN_PARTS, GradNormState
from linnaeus_accel.config import load_config, validate_config
from linnaeus_accel.progress import ProgressState, TrainingProgress, TrainingStage
from linnaeus_accel.schedule.early_stopping import EarlyStopping, EarlyStoppingState
from linnaeus_accel.training.step.gradnorm import GradNorm

STATE = "trainer_state.json"


def good_state() -> dict[str, Any]:
    """A state of step 24 as the trainer writes it."""
    return {
        "version": 1,
        "progress": {
            "version": 1, "total_epochs": 2, "expected_total_steps": 24, "current_stage": "TRAINING",
            "epoch": 2, "global_step": 24, "batches_seen_in_epoch": 0, "samples_seen": 2876, "tokens_seen": 0,
            "pending_validations": ["VALIDATION_NORMAL"], "completed_validations": [],
            "partial_validation_indices": [0, 1], "completed_partial_indices": [],
            "best_metric": {"name": "val/loss", "value": 1.2, "step": 12},
        },
        "early_stopping": {"version": 1, "metric": "val/loss", "best": 1.2, "step_of_best": 12},
        "gradnorm": None,
        "boundary": {"epoch": 2, "final": True, "step": 24, "previous_step": 12, "mid": False},
        "wandb_run_id": None,
        "plan": {"total_steps": 24, "world_size": 1, "accumulation": 1, "batch_size": 128, "batches_per_epoch": 12},
        "checkpoint_metrics": {"12": 1.2, "24": None},
    }  # fmt: skip


def changed(path: str, value: Any) -> dict[str, Any]:
    """``good_state()`` with the key at the dotted ``path`` set to ``value`` (removed: KeyError)."""
    state = good_state()
    *parents, last = path.split(".")
    target = state
    for key in parents:
        target = target[key]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return state


def without(path: str) -> dict[str, Any]:
    return changed(path, KeyError)


STATE_ROWS = [
    # A step count is an int: a float (even a whole one) is not, nor a bool.
    ("float step", changed("progress.global_step", 24.0), f"{STATE}: progress.global_step must be an integer >= 0, got 24.0"),
    ("bool epoch", changed("progress.epoch", True), f"{STATE}: progress.epoch must be an integer >= 0, got true"),
    # Counts are never negative; those older checkpoints may lack may be null.
    ("negative count", changed("progress.samples_seen", -5), f"{STATE}: progress.samples_seen must be an integer >= 0 or null, got -5"),
    ("null count", changed("progress.samples_seen", None), None),
    # Stages are the names TrainingStage knows, alone or in lists.
    ("unknown stage", changed("progress.current_stage", "NAPPING"), f"{STATE}: progress.current_stage must be one of ['TRAINING', 'VALIDATION_MASK_META', 'VALIDATION_NORMAL', 'VALIDATION_PARTIAL_MASK_META'], got \"NAPPING\""),
    ("unknown stage in a list", changed("progress.completed_validations", ["VALIDATION_NORMAL", "X"]), f'{STATE}: progress.completed_validations must be a list of stages, got ["VALIDATION_NORMAL", "X"]'),
    ("float partial index", changed("progress.partial_validation_indices", [0, 1.5]), f"{STATE}: progress.partial_validation_indices must be a list of integers, got [0, 1.5]"),
    # The file's own version decides how it is read; a part's version is an int.
    ("missing version", without("version"), f"{STATE} has version null; this linnaeus-accel reads version 1"),
    ("part version a string", changed("progress.version", "1"), f'{STATE}: progress.version must be an integer, got "1"'),
    # What a checkpoint must say: where the run is.
    ("no progress", without("progress"), f"{STATE}: progress must be an object, got null"),
    ("no batches seen", without("progress.batches_seen_in_epoch"), f"{STATE}: progress.batches_seen_in_epoch is missing"),
    ("step of another checkpoint", changed("progress.global_step", 12), f"{STATE}: progress.global_step is 12 but the checkpoint is for step 24"),
    # A nested record is named at its field, whose rule covers it.
    ("best metric without step", changed("progress.best_metric", {"name": "val/loss", "value": 1.2}), f'{STATE}: progress.best_metric must be null or {{name, value, step}}, got {{"name": "val/loss", "value": 1.2}}'),
    ("early stopping metric null", changed("early_stopping.metric", None), f"{STATE}: early_stopping.metric must be a string, got null"),
    ("early stopping float step", changed("early_stopping.step_of_best", 12.0), f"{STATE}: early_stopping.step_of_best must be an integer or null, got 12.0"),
    ("early stopping NaN best", changed("early_stopping.best", float("nan")), None),  # a number all the same
    ("gradnorm no tasks", changed("gradnorm", {"num_tasks": 0}), f"{STATE}: gradnorm.num_tasks must be an integer >= 1, got 0"),
    ("gradnorm bool moment", changed("gradnorm", {"exp_avg": [0.1, False]}), f"{STATE}: gradnorm.exp_avg must be a list of numbers or null, got [0.1, false]"),
    ("boundary mid a string", changed("boundary.mid", "yes"), f'{STATE}: boundary.mid must be true or false, got "yes"'),
    ("boundary negative step", changed("boundary", {"epoch": 2, "final": True, "step": -1}), f"{STATE}: boundary.step must be an integer >= 0, got -1"),
    ("plan without steps", without("plan.total_steps"), f"{STATE}: plan.total_steps is missing"),
    ("callbacks a list", changed("callbacks", []), f"{STATE}: callbacks must be an object or null, got []"),
    ("metrics null", changed("checkpoint_metrics", None), f"{STATE}: checkpoint_metrics must map steps to numbers or nulls, got null"),
    # Of a mapping, the entry at fault is shown.
    ("metrics entry", changed("checkpoint_metrics", {"12": 1.0, "24": "low"}), f'{STATE}: checkpoint_metrics must map steps to numbers or nulls, got {{"24": "low"}}'),
    # What older checkpoints lack, and what registered parts and callbacks hold, passes.
    ("before mid-epoch events", changed("boundary", {"epoch": 2, "final": True}), None),
    ("before gradnorm and plans", {k: v for k, v in good_state().items() if k not in ("gradnorm", "plan", "boundary")}, None),
    ("registered parts free-form", {**good_state(), "registered.ema": [1, "x"], "callbacks": {"logger": 3}}, None),
]  # fmt: skip


@pytest.mark.parametrize(("state", "problem"), [r[1:] for r in STATE_ROWS], ids=[r[0] for r in STATE_ROWS])
def test_a_malformed_state_is_rejected_naming_what_is_wrong(state: Any, problem: str | None) -> None:
    assert state_problem(state, 24) == problem


RANK_ROWS = [
    # The meter's window: a bool is no number, a step count no float.
    ("meter sums with a bool", 0, {"version": 1, "meter": {"sums": [1.0, True]}}, "rank_00000.json: meter.sums must be a list of numbers or null, got [1.0, true]"),
    ("meter float steps", 0, {"version": 1, "meter": {"steps": 2.5}}, "rank_00000.json: meter.steps must be an integer >= 0, got 2.5"),
    # The data position's layout decides how a stream resumes: it must be one.
    ("data position of 0 processes", 1, {"version": 1, "data": {"version": 1, "world_size": 0}}, "rank_00001.json: data.world_size must be an integer >= 1, got 0"),
    ("data position negative workers", 0, {"version": 1, "data": {"num_workers": -1}}, "rank_00000.json: data.num_workers must be an integer >= 0, got -1"),
    ("data position sharded a string", 0, {"version": 1, "data": {"sharded": "no"}}, 'rank_00000.json: data.sharded must be true or false, got "no"'),
    # Not a rank file at all: the run's state, or another version.
    ("a run state as rank file", 2, ["progress"], "rank_00002.json is not a JSON object"),
    ("rank file of another version", 0, {"version": 2}, "rank_00000.json has version 2; this linnaeus-accel reads version 1"),
    ("meter a number", 0, {"version": 1, "meter": 5}, "rank_00000.json: meter must be an object or null, got 5"),
    # The loader's own state is torchdata's: free-form.
    ("a stream's position", 0, {"version": 1, "data": {"version": 1, "world_size": 2, "batch_size": 8, "num_workers": 0, "sharded": False, "loader": {"any": [1]}}}, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("rank", "state", "problem"), [r[1:] for r in RANK_ROWS], ids=[r[0] for r in RANK_ROWS]
)
def test_a_malformed_rank_file_is_rejected_naming_what_is_wrong(
    rank: int, state: Any, problem: str | None
) -> None:
    assert rank_state_problem(state, rank) == problem


def test_each_part_writes_what_its_schema_reads() -> None:
    progress = TrainingProgress(total_epochs=2, expected_total_steps=24)
    progress.complete_step(micro_batches=1, samples=128)
    progress.schedule_validation(TrainingStage.VALIDATION_PARTIAL_MASK_META, partial_index=1)
    progress.schedule_validation(TrainingStage.VALIDATION_NORMAL)
    progress.update_best("val/loss", 0.5)
    early = EarlyStopping(validate_config({}).TRAIN.EARLY_STOP)
    early.update(0.5, 1)
    gradnorm = GradNorm(2, initial_weights=[0.5, 1.5])
    for part, state in ((progress, progress.state_dict()), (early, early.state_dict()), (gradnorm, gradnorm.state_dict())):  # fmt: skip
        schema = type(part).STATE_SCHEMA  # type: ignore[attr-defined]
        assert schema.model_validate(json.loads(json.dumps(state))).as_data() == state
    # The JSON checkpoints have always held: key for key, in this order.
    assert json.dumps(progress.state_dict()) == json.dumps({
        "version": 1, "total_epochs": 2, "expected_total_steps": 24, "current_stage": "TRAINING", "epoch": 0,
        "global_step": 1, "epoch_start_step": 0, "batches_seen_in_epoch": 1, "samples_seen": 128, "tokens_seen": 0,
        "pending_validations": ["VALIDATION_NORMAL", "VALIDATION_PARTIAL_MASK_META"], "completed_validations": [],
        "partial_validation_indices": [1], "completed_partial_indices": [],
        "best_metric": {"name": "val/loss", "value": 0.5, "step": 1},
    })  # fmt: skip
    state = {"version": 1, "progress": progress.state_dict(), "early_stopping": early.state_dict()}
    assert state_problem({**state, "gradnorm": gradnorm.state_dict()}, 1) is None


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_the_registry_knows_each_parts_schema(tmp_path: Path) -> None:
    from linnaeus_accel.data import build_dataset
    from linnaeus_accel.models import build_model
    from linnaeus_accel.training.trainer import Trainer

    opts = ["ENV.OUTPUT.BASE_DIR", str(tmp_path), "LOSS.GRAD_WEIGHTING.TASK.GRADNORM_ENABLED", "true"]
    config = load_config(DEFAULT_CONFIG, opts)
    train = build_dataset(config, "train")
    registry = Trainer(config, build_model(config, train), train).state
    # Built by the trainer, which names no schema: each part's own, the one checkpoints verify.
    assert registry.schemas(per_rank=False) == {k: RUN_PARTS[k] for k in ("progress", "early_stopping", "gradnorm", "callbacks", "recovery")}  # fmt: skip
    assert registry.schemas(per_rank=True) == RANK_PARTS
    assert RUN_PARTS["gradnorm"] is GradNormState
    assert (RUN_PARTS["progress"], RUN_PARTS["early_stopping"]) == (ProgressState, EarlyStoppingState)
    with pytest.raises(ValueError, match="'progress' has the format EarlyStoppingState but checkpoints verify it as ProgressState"):  # fmt: skip
        StateRegistry().register("progress", EarlyStopping(validate_config({}).TRAIN.EARLY_STOP))
