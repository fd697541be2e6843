"""TrainingProgress (docs/semantics.md §6) and TrainingConsistencyChecker (docs/semantics.md §1)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import pytest

from linnaeus_accel.config import validate_config
from linnaeus_accel.progress import TrainingConsistencyChecker, TrainingProgress, TrainingStage
from linnaeus_accel.schedule import batches_per_process, resolve_plan

NORMAL = TrainingStage.VALIDATION_NORMAL
MASK_META = TrainingStage.VALIDATION_MASK_META
PARTIAL = TrainingStage.VALIDATION_PARTIAL_MASK_META
TRAINING = TrainingStage.TRAINING


def json_round_trip(progress: TrainingProgress) -> TrainingProgress:
    """A fresh object (other constructor values) loaded from the JSON text of ``progress``."""
    fresh = TrainingProgress(total_epochs=99)
    fresh.load_state_dict(json.loads(json.dumps(progress.state_dict())))
    return fresh


def assert_plain_json(value: Any) -> None:
    """Only JSON's own types: no str-Enum, tuple, numpy scalar or other subclass."""
    if isinstance(value, dict):
        for key, item in value.items():
            assert type(key) is str, key
            assert_plain_json(item)
    elif isinstance(value, list):
        for item in value:
            assert_plain_json(item)
    else:
        assert type(value) in (str, int, float, bool, type(None)), (value, type(value))


# ---------------------------------------------------------------------------------------------
# Validation bookkeeping: the EXAMPLES sequence, with a JSON round trip at every point
# ---------------------------------------------------------------------------------------------


def _schedule(p: TrainingProgress) -> None:
    p.schedule_validation(NORMAL)
    p.schedule_validation(PARTIAL, partial_index=0)
    p.schedule_validation(PARTIAL, partial_index=1)


def _run_standard(p: TrainingProgress) -> None:
    p.start_validation(NORMAL)
    p.complete_validation(NORMAL)


def _run_partial(index: int) -> Callable[[TrainingProgress], None]:
    def run(p: TrainingProgress) -> None:
        p.start_validation(PARTIAL)
        p.complete_validation(PARTIAL, partial_index=index)

    return run


# (action, pending validations after it, completed validations after it)
SEQUENCE: list[tuple[Callable[[TrainingProgress], None], list[TrainingStage], list[TrainingStage]]] = [
    (_schedule, [NORMAL, PARTIAL], []),
    (_run_standard, [PARTIAL], [NORMAL]),
    (_run_partial(0), [PARTIAL], [NORMAL]),  # the partial stage waits for every index
    (_run_partial(1), [], [NORMAL, PARTIAL]),
]


def _fresh_progress() -> TrainingProgress:
    p = TrainingProgress(total_epochs=10, expected_total_steps=1000)
    p.start_training_epoch(1)
    for _ in range(100):
        p.update_step(batch_size=32)
    p.end_epoch()
    return p


def test_validation_sequence_from_examples() -> None:
    p = _fresh_progress()
    for action, pending, completed in SEQUENCE:
        action(p)
        assert p.pending_validations == pending
        assert p.completed_validations == completed
        assert p.has_pending_validations() is bool(pending)
    assert p.current_stage is TRAINING
    assert p.partial_validation_indices == []
    assert p.completed_partial_indices == [0, 1]


def test_partial_indices_during_sequence() -> None:
    p = _fresh_progress()
    _schedule(p)
    assert p.partial_validation_indices == [0, 1]
    _run_standard(p)
    _run_partial(0)(p)
    assert p.partial_validation_indices == [1]
    assert p.completed_partial_indices == [0]
    assert p.current_stage is PARTIAL  # still validating


def test_scheduling_keeps_validation_order_and_no_duplicates() -> None:
    p = TrainingProgress(total_epochs=1)
    p.schedule_validation(PARTIAL, partial_index=2)
    p.schedule_validation(NORMAL)
    p.schedule_validation(MASK_META)
    p.schedule_validation(NORMAL)
    p.schedule_validation(PARTIAL, partial_index=2)
    assert p.pending_validations == [NORMAL, MASK_META, PARTIAL]
    assert p.partial_validation_indices == [2]


@pytest.mark.parametrize("split", range(len(SEQUENCE) + 1))  # round trip before/after each action
def test_state_round_trips_through_json_at_every_point(split: int) -> None:
    p = _fresh_progress()
    for action, _, _ in SEQUENCE[:split]:
        action(p)
    state = p.state_dict()
    assert_plain_json(state)
    loaded = json_round_trip(p)
    assert loaded.state_dict() == state
    # the reloaded object continues exactly like the original
    for action, pending, completed in SEQUENCE[split:]:
        action(p)
        action(loaded)
        assert loaded.pending_validations == pending
        assert loaded.completed_validations == completed
        assert loaded.state_dict() == p.state_dict()
    assert loaded.current_stage is TRAINING


def test_round_trip_mid_validation_and_with_best_metric() -> None:
    p = _fresh_progress()
    p.schedule_validation(NORMAL)
    p.schedule_validation(MASK_META)
    p.start_validation(MASK_META)
    p.update_best("val/loss", 0.42)
    loaded = json_round_trip(p)
    assert loaded.state_dict() == p.state_dict()
    assert loaded.current_stage is MASK_META
    assert loaded.best_metric == {"name": "val/loss", "value": 0.42, "step": 100}
    assert loaded.epoch == 1
    assert loaded.global_step == 100
    assert loaded.samples_seen == 3200
    assert loaded.total_epochs == 10
    assert loaded.expected_total_steps == 1000


# ---------------------------------------------------------------------------------------------
# Step counting
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batches", "accum", "batch_size", "steps"),
    [
        (10, 1, 8, 10),  # no accumulation: one step per batch
        (10, 4, 8, 3),  # 4 + 4 + trailing 2: the last partial window is one step
        (12, 4, 8, 3),  # divides evenly
        (1, 4, 5, 1),  # a single batch is a step
        (7, 2, 3, 4),  # ceil(7 / 2)
    ],
)
def test_update_step_counts_optimizer_steps(batches: int, accum: int, batch_size: int, steps: int) -> None:
    p = TrainingProgress(total_epochs=2)
    p.start_training_epoch()
    completed = []
    for i in range(batches):
        syncs = (i + 1) % accum == 0 or i == batches - 1  # Accelerate syncs on the last batch
        completed.append(p.update_step(batch_size, is_accumulation_step=not syncs))
        assert p.batches_seen_in_epoch == i + 1
        assert p.samples_seen == (i + 1) * batch_size
        assert p.global_step == sum(completed)
    assert sum(completed) == steps
    assert p.global_step == steps
    assert p.epoch == 0  # nothing completed yet


def test_accumulation_steps_do_not_count_as_optimizer_steps() -> None:
    p = TrainingProgress(total_epochs=1)
    assert p.update_step(16, is_accumulation_step=True) is False
    assert p.global_step == 0
    assert p.samples_seen == 16
    assert p.update_step(16) is True
    assert p.global_step == 1
    assert p.samples_seen == 32


def test_epochs_count_completed_epochs() -> None:
    p = TrainingProgress(total_epochs=3)
    assert (p.epoch, p.current_epoch) == (0, 1)
    p.start_training_epoch()
    assert (p.epoch, p.current_epoch) == (0, 1)
    for _ in range(5):
        p.update_step(4)
    p.end_epoch()
    assert (p.epoch, p.current_epoch) == (1, 2)
    assert p.batches_seen_in_epoch == 0
    assert p.global_step == 5
    assert p.samples_seen == 20
    p.start_training_epoch()
    assert (p.epoch, p.current_epoch) == (1, 2)
    p.update_step(4)
    p.end_epoch()
    assert (p.epoch, p.current_epoch) == (2, 3)
    assert p.global_step == 6  # global counters carry over epochs
    assert p.samples_seen == 24


def test_start_training_epoch_with_explicit_epoch_resets_epoch_state() -> None:
    p = TrainingProgress(total_epochs=5)
    p.update_step(4)
    p.schedule_validation(NORMAL)
    p.schedule_validation(PARTIAL, partial_index=0)
    p.start_validation(NORMAL)
    p.start_training_epoch(3)
    assert p.epoch == 2
    assert p.current_epoch == 3
    assert p.batches_seen_in_epoch == 0
    assert p.current_stage is TRAINING
    assert p.pending_validations == []
    assert p.completed_validations == []
    assert p.partial_validation_indices == []
    assert p.global_step == 1  # not an epoch counter
    assert p.samples_seen == 4


# ---------------------------------------------------------------------------------------------
# Fractions
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Best metric
# ---------------------------------------------------------------------------------------------


def test_update_best_min_and_max_modes() -> None:
    p = TrainingProgress(total_epochs=1)
    p.global_step = 10
    assert p.update_best("val/loss", 0.5)
    p.global_step = 20
    assert not p.update_best("val/loss", 0.6)
    assert not p.update_best("val/loss", 0.5)  # ties are not new bests
    p.global_step = 30
    assert p.update_best("val/loss", 0.4)
    assert p.best_metric == {"name": "val/loss", "value": 0.4, "step": 30}
    assert not p.update_best("val/loss", float("nan"))
    assert not p.update_best("val/loss", float("-inf"))
    assert p.best_metric == {"name": "val/loss", "value": 0.4, "step": 30}

    q = TrainingProgress(total_epochs=1)
    assert q.update_best("val/acc1", 0.5, mode="max")
    assert not q.update_best("val/acc1", 0.4, mode="max")
    assert q.update_best("val/acc1", 0.6, mode="max")
    assert q.best_metric is not None
    assert q.best_metric["value"] == 0.6


def test_update_best_with_another_metric_restarts() -> None:
    p = TrainingProgress(total_epochs=1)
    p.update_best("val/loss", 0.1)
    assert p.update_best("val/acc1", 0.2, mode="max")
    assert p.best_metric is not None
    assert p.best_metric["name"] == "val/acc1"


# ---------------------------------------------------------------------------------------------
# Tolerant loading
# ---------------------------------------------------------------------------------------------


def test_load_ignores_unknown_keys() -> None:
    p = _fresh_progress()
    state = {**p.state_dict(), "future_field": {"x": 1}, "another": [1, 2]}
    loaded = TrainingProgress(total_epochs=1)
    loaded.load_state_dict(state)
    assert loaded.state_dict() == p.state_dict()
    assert not hasattr(loaded, "future_field")


def test_load_missing_keys_keep_defaults() -> None:
    loaded = TrainingProgress(total_epochs=7, expected_total_steps=700)
    loaded.load_state_dict({"global_step": 42, "epoch": 3})
    default = TrainingProgress(total_epochs=7, expected_total_steps=700)
    expected = {**default.state_dict(), "global_step": 42, "epoch": 3}
    assert loaded.state_dict() == expected
    assert loaded.current_stage is TRAINING
    assert loaded.pending_validations == []
    assert loaded.best_metric is None


def test_load_empty_state_changes_nothing() -> None:
    p = _fresh_progress()
    before = p.state_dict()
    p.load_state_dict({})
    assert p.state_dict() == before


@pytest.mark.parametrize("version", [0, 1, 2, 99])  # older, current, newer
def test_load_other_versions(version: int, caplog: pytest.LogCaptureFixture) -> None:
    p = _fresh_progress()
    _schedule(p)
    state = json.loads(json.dumps({**p.state_dict(), "version": version}))
    loaded = TrainingProgress(total_epochs=1)
    with caplog.at_level(logging.WARNING, logger="linnaeus_accel.progress"):
        loaded.load_state_dict(state)
    assert {k: v for k, v in loaded.state_dict().items() if k != "version"} == {
        k: v for k, v in p.state_dict().items() if k != "version"
    }
    assert loaded.pending_validations == [NORMAL, PARTIAL]


def test_load_newer_version_warns(caplog: pytest.LogCaptureFixture) -> None:
    loaded = TrainingProgress(total_epochs=1)
    with caplog.at_level(logging.WARNING, logger="linnaeus_accel.progress"):
        loaded.load_state_dict({"version": 99, "global_step": 5})
    assert loaded.global_step == 5
    assert any("newer" in r.getMessage() for r in caplog.records)


def test_state_is_versioned_plain_json_data() -> None:
    p = _fresh_progress()
    _schedule(p)
    p.start_validation(NORMAL)
    p.update_best("val/loss", 0.3)
    state = p.state_dict()
    assert isinstance(state["version"], int)
    assert_plain_json(state)
    assert json.loads(json.dumps(state)) == state
    assert state["current_stage"] == "VALIDATION_NORMAL"
    assert state["pending_validations"] == ["VALIDATION_NORMAL", "VALIDATION_PARTIAL_MASK_META"]


def test_state_dict_is_a_copy() -> None:
    p = _fresh_progress()
    _schedule(p)
    state = p.state_dict()
    state["pending_validations"].clear()
    state["partial_validation_indices"].clear()
    assert p.pending_validations == [NORMAL, PARTIAL]
    assert p.partial_validation_indices == [0, 1]


# ---------------------------------------------------------------------------------------------
# TrainingConsistencyChecker
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dataset", "batch", "world", "accum", "drop_last", "steps"),
    [
        (1000, 10, 1, 1, False, 100),  # even split
        (1001, 10, 1, 1, False, 101),  # leftover sample: one more batch
        (1001, 10, 1, 4, False, 26),  # ceil(101 / 4)
        (1001, 8, 2, 4, False, 16),  # ceil(ceil(1001 / 16) / 4) = ceil(63 / 4)
        (1009, 8, 2, 1, False, 64),  # ceil(1009 / 16)
        (1009, 8, 2, 1, True, 63),  # DROP_LAST: floor(1009 / 16)
        (1001, 10, 1, 0, False, 101),  # accumulation 0 is read as 1
        (5, 8, 2, 1, False, 1),  # fewer samples than one batch
    ],
)
def test_consistency_checker_expected_steps(
    dataset: int, batch: int, world: int, accum: int, drop_last: bool, steps: int
) -> None:
    checker = TrainingConsistencyChecker(
        total_epochs=3, batch_size=batch, world_size=world, accumulation_steps=accum, drop_last=drop_last
    )
    assert checker.initialize_with_first_epoch(steps, dataset) is True
    assert checker.expected_steps_per_epoch == steps
    assert checker.expected_total_steps == 3 * steps


@pytest.mark.parametrize(
    ("dataset", "batch", "world", "accum", "drop_last"),
    [
        (1001, 8, 2, 4, False),  # uneven everything
        (1009, 8, 2, 1, True),  # DROP_LAST
        (977, 16, 1, 3, False),  # single process
    ],
)
def test_consistency_checker_agrees_with_plan(
    dataset: int, batch: int, world: int, accum: int, drop_last: bool
) -> None:
    config = validate_config(
        {
            "TRAIN": {"EPOCHS": 4, "ACCUMULATION_STEPS": accum},
            "DATA": {"BATCH_SIZE": batch, "DROP_LAST": drop_last},
        }
    )
    plan = resolve_plan(config, batches_per_process(dataset, batch, world, drop_last), world)
    checker = TrainingConsistencyChecker(4, batch, world, accum, drop_last)
    assert checker.initialize_with_first_epoch(plan.optimizer_steps_per_epoch, dataset)
    assert checker.expected_total_steps == plan.total_steps


@pytest.mark.parametrize("actual", [15, 17, 0, 63])  # off by one, nothing, counting micro-batches
def test_consistency_checker_mismatch_warns(actual: int, caplog: pytest.LogCaptureFixture) -> None:
    checker = TrainingConsistencyChecker(total_epochs=2, batch_size=8, world_size=2, accumulation_steps=4)
    with caplog.at_level(logging.WARNING, logger="linnaeus_accel.progress"):
        assert checker.initialize_with_first_epoch(actual, 1001) is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert str(actual) in warnings[0].getMessage()
    assert "16" in warnings[0].getMessage()
    # the expectation is still recorded from the dataset, not from the wrong count
    assert checker.expected_steps_per_epoch == 16
    assert checker.expected_total_steps == 32


def test_consistency_checker_match_does_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    checker = TrainingConsistencyChecker(total_epochs=2, batch_size=8, world_size=2, accumulation_steps=4)
    with caplog.at_level(logging.WARNING, logger="linnaeus_accel.progress"):
        assert checker.initialize_with_first_epoch(16, 1001)
        assert checker.epoch_problem(1, 16) is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
