"""Early stopping (docs/semantics.md §5): improvement by MIN_DELTA, patience in global steps, hard limits, state."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from helpers.configs import DEFAULT_CONFIG

from linnaeus_accel.cli import plan_for
from linnaeus_accel.config import ConfigError, load_config, validate_config
from linnaeus_accel.config.sections import EarlyStopConfig
from linnaeus_accel.data import build_dataset
from linnaeus_accel.schedule import EarlyStopping, OpsSchedule, StopDecision, resolve_plan
from linnaeus_accel.tasks import TaskContext, build_task
from linnaeus_accel.training.start.task_checks import check_task, validation_prefixes

STEPS = [100, 200, 300, 400, 500, 600]
VALUES = [1.0, 0.995, 0.98, 0.979, 0.975, 0.972]
EXAMPLE = {"ACTIVE": True, "METRIC": "val/loss", "MIN_DELTA": 0.01, "PATIENCE_STEPS": 300}


def early_stop_config(**keys: Any) -> EarlyStopConfig:
    return validate_config({"TRAIN": {"EARLY_STOP": keys}}).TRAIN.EARLY_STOP


def make(warmup_steps: int = 0, **keys: Any) -> EarlyStopping:
    return EarlyStopping(early_stop_config(**keys), warmup_steps=warmup_steps)


def reason(decision: StopDecision | None) -> str | None:
    return None if decision is None else decision.reason


# ---------------------------------------------------------------------------------------------
# The EXAMPLES sequence
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("upto", "best", "step_of_best", "stop"),
    [
        (1, 1.0, 100, None),  # first value is the best
        (2, 1.0, 100, None),  # 0.995 beats 1.0 by 0.005 <= MIN_DELTA: no improvement
        (3, 0.98, 300, None),  # 0.98 beats 1.0 by 0.02: new best
        (4, 0.98, 300, None),  # 0.979: by 0.001, no
        (5, 0.98, 300, None),  # 0.975: no; waited 200 < 300
        (6, 0.98, 300, "patience"),  # 0.972: no; 600 - 300 >= 300 -> stop
    ],
)
def test_examples_sequence(upto: int, best: float, step_of_best: int, stop: str | None) -> None:
    es = make(**EXAMPLE)
    decisions = [es.check(s, v) for s, v in zip(STEPS[:upto], VALUES[:upto], strict=True)]
    assert es.reference == best
    assert es.reference_step == step_of_best
    assert [reason(d) for d in decisions[:-1]] == [None] * (upto - 1)  # no stop before
    assert reason(decisions[-1]) == stop


def test_examples_improvements() -> None:
    es = make(**EXAMPLE)
    improvements = [es.update(v, s) for s, v in zip(STEPS, VALUES, strict=True)]
    assert improvements == [True, False, True, False, False, False]


@pytest.mark.parametrize(
    ("patience", "stop_step"),
    [
        (100, 200),  # stops at the first check without improvement
        (200, 500),  # 500 - 300 = 200
        (300, 600),  # the EXAMPLES value
        (301, None),  # 600 - 300 = 300 < 301: never within the sequence
    ],
)
def test_patience_is_counted_in_global_steps(patience: int, stop_step: int | None) -> None:
    es = make(**{**EXAMPLE, "PATIENCE_STEPS": patience})
    stopped_at = None
    for s, v in zip(STEPS, VALUES, strict=True):
        if es.check(s, v) is not None:
            stopped_at = s
            break
    assert stopped_at == stop_step


def test_patience_does_not_depend_on_the_number_of_checks() -> None:
    # a check every 10 steps: 29 checks without improvement still wait 290 < 300 steps
    es = make(**EXAMPLE)
    assert es.check(10, 1.0) is None
    for s in range(20, 310, 10):
        assert es.check(s, 1.0) is None, s
    decision = es.check(310, 1.0)
    assert reason(decision) == "patience"


def test_patience_decision_message_names_the_best() -> None:
    es = make(**EXAMPLE)
    decision = None
    for s, v in zip(STEPS, VALUES, strict=True):
        decision = es.check(s, v)
    assert decision is not None
    assert "0.98" in decision.message
    assert "300" in decision.message


@pytest.mark.parametrize(
    ("min_delta", "best", "value", "improves"),
    [
        (0.0, 1.0, 0.999, True),  # any strict improvement
        (0.0, 1.0, 1.0, False),  # a tie is not
        (0.5, 1.0, 0.5, False),  # exactly MIN_DELTA is not "more than"
        (0.5, 1.0, 0.49, True),  # more than MIN_DELTA
        (0.01, 1.0, 1.5, False),  # worse
    ],
)
def test_min_delta(min_delta: float, best: float, value: float, improves: bool) -> None:
    es = make(**{**EXAMPLE, "MIN_DELTA": min_delta})
    es.update(best, 1)
    assert es.update(value, 2) is improves
    assert es.reference == (value if improves else best)


# ---------------------------------------------------------------------------------------------
# Mode
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "metric", "mode"),
    [
        ({"METRIC": "val/loss"}, "val/loss", "min"),  # loss: lower is better
        ({"METRIC": "val_loss"}, "val/loss", "min"),  # linnaeus' spelling is accepted
        ({"METRIC": "val/acc1"}, "val/acc1", "max"),  # accuracy: higher is better
        ({"METRIC": "val_acc1"}, "val/acc1", "max"),  # linnaeus' spelling
        ({"METRIC": "val/chain_accuracy"}, "val/chain_accuracy", "max"),  # no "loss" in the name
        ({"METRIC": "val/loss", "MODE": "max"}, "val/loss", "max"),  # MODE overrides
        ({"METRIC": "val/acc1", "MODE": "min"}, "val/acc1", "min"),  # MODE overrides
    ],
)
def test_mode_inference(keys: dict[str, Any], metric: str, mode: str) -> None:
    es = make(ACTIVE=True, PATIENCE_STEPS=100, **keys)
    assert es.metric == metric
    assert es.mode == mode


@pytest.mark.parametrize(
    ("keys", "values", "best"),
    [
        ({"METRIC": "val/loss"}, [0.5, 0.3, 0.4], 0.3),  # min
        ({"METRIC": "val/acc1"}, [0.5, 0.3, 0.7], 0.7),  # max
        ({"METRIC": "val/acc1", "MODE": "min"}, [0.5, 0.3, 0.7], 0.3),  # overridden to min
        ({"METRIC": "val/loss", "MODE": "max"}, [0.5, 0.3, 0.7], 0.7),  # overridden to max
    ],
)
def test_mode_decides_best(keys: dict[str, Any], values: list[float], best: float) -> None:
    es = make(ACTIVE=True, PATIENCE_STEPS=10_000, **keys)
    for i, v in enumerate(values):
        assert es.check(100 * (i + 1), v) is None
    assert es.reference == best


def test_max_mode_patience() -> None:
    es = make(ACTIVE=True, METRIC="val/acc1", MIN_DELTA=0.01, PATIENCE_STEPS=200)
    assert es.check(100, 0.50) is None
    assert es.check(200, 0.505) is None  # not by more than 0.01
    assert es.check(300, 0.60) is None  # best 0.60 @300
    assert es.check(400, 0.40) is None  # worse
    assert reason(es.check(500, 0.605)) == "patience"
    assert (es.reference, es.reference_step) == (0.60, 300)


# ---------------------------------------------------------------------------------------------
# Hard limits
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "stop"),
    [
        (4.9, None),  # below
        (5.0, None),  # equal is not above
        (5.01, "max_loss"),  # above
        (1e9, "max_loss"),  # far above
    ],
)
def test_max_loss(value: float, stop: str | None) -> None:
    es = make(ACTIVE=True, MAX_LOSS=5.0)
    assert reason(es.check(100, value)) == stop


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), float("-inf")],  # every non-finite value
)
def test_non_finite_metric_stops(value: float) -> None:
    es = make(**EXAMPLE)
    assert es.check(100, 1.0) is None
    assert reason(es.check(200, value)) == "not_finite"
    assert (es.reference, es.reference_step) == (1.0, 100)  # never a best


@pytest.mark.parametrize("value", [float("nan"), float("inf")])  # at the first check
def test_non_finite_first_metric_stops_without_best(value: float) -> None:
    es = make(ACTIVE=True, MAX_GRAD_NORM=10.0)  # no patience or MAX_LOSS needed
    assert reason(es.check(100, value)) == "not_finite"
    assert es.reference is None
    assert es.reference_step is None


@pytest.mark.parametrize(
    ("warmup", "step", "lr", "stop"),
    [
        (100, 50, 1e-9, None),  # in warmup: a small LR is expected
        (100, 99, 1e-9, None),  # last warmup step
        (100, 100, 1e-9, "min_lr"),  # first step after warmup
        (100, 500, 1e-9, "min_lr"),  # later
        (100, 500, 1e-6, None),  # equal to MIN_LR is not below
        (100, 500, 1e-3, None),  # above
        (0, 0, 1e-9, "min_lr"),  # no warmup
    ],
)
def test_min_lr_only_after_warmup(warmup: int, step: int, lr: float, stop: str | None) -> None:
    es = make(warmup_steps=warmup, ACTIVE=True, MIN_LR=1e-6)
    assert reason(es.check(step, None, lr=lr)) == stop


def test_min_lr_with_warmup_from_plan() -> None:
    config = validate_config(
        {
            "TRAIN": {"EPOCHS": 10, "EARLY_STOP": {"ACTIVE": True, "MIN_LR": 1e-6}},
            "LR_SCHEDULER": {"WARMUP_EPOCHS": 1.5, "REFERENCE_BS": None},
        }
    )
    plan = resolve_plan(config, 100, 1)
    assert plan.warmup_steps == 150
    es = EarlyStopping(config.TRAIN.EARLY_STOP, warmup_steps=plan.warmup_steps)
    assert es.check(0, None, lr=plan.lr(0)) is None  # warmup starts at WARMUP_LR = 0
    assert es.check(149, None, lr=1e-9) is None
    assert reason(es.check(150, None, lr=1e-9)) == "min_lr"


@pytest.mark.parametrize(
    ("grad_norm", "stop"),
    [
        (9.99, None),  # below
        (10.0, None),  # equal is not above
        (10.5, "max_grad_norm"),  # above
        (None, None),  # not measured
    ],
)
def test_max_grad_norm(grad_norm: float | None, stop: str | None) -> None:
    es = make(ACTIVE=True, MAX_GRAD_NORM=10.0)
    assert reason(es.check(100, 0.5, grad_norm=grad_norm)) == stop


def test_lr_and_grad_norm_are_checked_without_a_metric() -> None:
    es = make(ACTIVE=True, MIN_LR=1e-6, MAX_GRAD_NORM=10.0)
    assert reason(es.check(10, None, lr=1e-3, grad_norm=11.0)) == "max_grad_norm"
    assert reason(es.check(10, None, lr=1e-9, grad_norm=1.0)) == "min_lr"
    assert es.reference is None


@pytest.mark.parametrize(
    ("step", "stop"),
    [
        (0, None),  # start
        (249, None),  # one short
        (250, "max_steps"),  # exactly MAX_STEPS
        (251, "max_steps"),  # past it (e.g. resumed with a lower limit)
    ],
)
def test_max_steps_stop_exact(step: int, stop: str | None) -> None:
    config = validate_config({"TRAIN": {"EPOCHS": 10, "EARLY_STOP": {"ACTIVE": True, "MAX_STEPS": 250}}})
    assert reason(OpsSchedule(resolve_plan(config, 100, 1)).max_steps_stop(step)) == stop


def test_max_steps_in_plan() -> None:
    config = validate_config({"TRAIN": {"EPOCHS": 10, "EARLY_STOP": {"ACTIVE": True, "MAX_STEPS": 250}}})
    plan = resolve_plan(config, 100, 1)
    assert plan.max_steps == 250
    assert plan.total_steps == 1000  # a cut-off, the schedule is not re-resolved


def test_max_steps_ignored_when_inactive() -> None:
    config = validate_config({"TRAIN": {"EPOCHS": 10, "EARLY_STOP": {"ACTIVE": False, "MAX_STEPS": 250}}})
    plan = resolve_plan(config, 100, 1)
    assert plan.max_steps is None
    assert OpsSchedule(plan).max_steps_stop(250) is None
    assert OpsSchedule(plan).max_steps_stop(10_000) is None


def test_active_without_any_condition_is_config_error() -> None:
    with pytest.raises(ConfigError, match=r"TRAIN\.EARLY_STOP\.ACTIVE"):
        validate_config({"TRAIN": {"EARLY_STOP": {"ACTIVE": True}}})


# ---------------------------------------------------------------------------------------------
# Inactive early stopping
# ---------------------------------------------------------------------------------------------


def test_inactive_never_stops_but_tracks_best() -> None:
    es = make(
        ACTIVE=False,
        METRIC="val/loss",
        MIN_DELTA=0.01,
        PATIENCE_STEPS=100,
        MAX_LOSS=0.5,
        MIN_LR=1e-3,
        MAX_GRAD_NORM=1.0,
    )
    for s, v in zip(STEPS, VALUES, strict=True):
        assert es.check(s, v, lr=1e-9, grad_norm=100.0) is None
    assert (es.reference, es.reference_step) == (0.98, 300)
    assert es.check(700, float("nan")) is None
    assert es.check(800, float("inf")) is None


@pytest.mark.parametrize(
    ("metric", "value"),
    [
        ("val/loss", float("nan")),  # min mode, nan
        ("val/loss", float("inf")),  # min mode, worse than anything
        ("val/loss", float("-inf")),  # min mode, "better" than anything
        ("val/acc1", float("nan")),  # max mode, nan
        ("val/acc1", float("inf")),  # max mode, "better" than anything
        ("val/acc1", float("-inf")),  # max mode, worse than anything
    ],
)
def test_inactive_never_takes_a_non_finite_best(metric: str, value: float) -> None:
    es = make(ACTIVE=False, METRIC=metric, MIN_DELTA=0.01)
    assert es.check(100, 0.5) is None
    assert es.check(200, value) is None
    assert (es.reference, es.reference_step) == (0.5, 100)
    # the state goes into checkpoints as strict JSON (no Infinity / NaN tokens)
    json.dumps(es.state_dict(), allow_nan=False)


# ---------------------------------------------------------------------------------------------
# State
# ---------------------------------------------------------------------------------------------


def _full_run(es: EarlyStopping) -> list[str | None]:
    return [reason(es.check(s, v)) for s, v in zip(STEPS, VALUES, strict=True)]


@pytest.mark.parametrize("split", range(len(STEPS) + 1))  # reload before/after every check
def test_state_round_trip_continues_same_decisions(split: int) -> None:
    expected = _full_run(make(**EXAMPLE))
    assert expected == [None] * 5 + ["patience"]

    first = make(**EXAMPLE)
    decisions = [reason(first.check(s, v)) for s, v in zip(STEPS[:split], VALUES[:split], strict=True)]
    text = json.dumps(first.state_dict())
    resumed = make(**EXAMPLE)
    resumed.load_state_dict(json.loads(text))
    assert resumed.state_dict() == first.state_dict()
    decisions += [reason(resumed.check(s, v)) for s, v in zip(STEPS[split:], VALUES[split:], strict=True)]
    assert decisions == expected
    assert (resumed.reference, resumed.reference_step) == (0.98, 300)


def test_state_is_plain_versioned_data() -> None:
    es = make(**EXAMPLE)
    es.check(100, 1.0)
    state = es.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert isinstance(state["version"], int)
    assert state["metric"] == "val/loss"
    assert state["best"] == 1.0
    assert state["step_of_best"] == 100


def test_empty_state_round_trips() -> None:
    es = make(**EXAMPLE)
    resumed = make(**EXAMPLE)
    resumed.load_state_dict(json.loads(json.dumps(es.state_dict())))
    assert (resumed.reference, resumed.reference_step) == (None, None)
    assert _full_run(resumed) == [None] * 5 + ["patience"]


def test_loading_state_of_another_metric_resets_best() -> None:
    acc = make(ACTIVE=True, METRIC="val/acc1", PATIENCE_STEPS=300)
    acc.check(100, 0.9)
    loss = make(**EXAMPLE)
    loss.check(50, 2.0)  # a best of its own, replaced by nothing
    loss.load_state_dict(json.loads(json.dumps(acc.state_dict())))
    assert (loss.reference, loss.reference_step) == (None, None)
    assert loss.metric == "val/loss"
    # the search for a best restarts: 1.0 @100 is the first best, as in a fresh run
    assert _full_run(loss) == [None] * 5 + ["patience"]
    assert (loss.reference, loss.reference_step) == (0.98, 300)


def test_loading_tolerates_unknown_and_missing_keys() -> None:
    es = make(**EXAMPLE)
    es.load_state_dict({"version": 99, "metric": "val/loss", "best": 0.5, "step_of_best": 40, "extra": [1]})
    assert (es.reference, es.reference_step) == (0.5, 40)
    other = make(**EXAMPLE)
    other.load_state_dict({"best": 0.7, "step_of_best": 10})  # no metric recorded: taken as ours
    assert (other.reference, other.reference_step) == (0.7, 10)
    assert reason(other.check(310, 0.695)) == "patience"  # 310 - 10 >= 300, 0.695 is no improvement


# ---------------------------------------------------------------------------------------------
# A metric no validation pass reports
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("opts", "refused", "suggested"),
    [
        # No standard pass: val/loss is the metric missing, so it is not the example.
        (["SCHEDULE.VALIDATION.INTERVAL_EPOCHS", "null"], "val/loss", "val_mask_COLS/loss"),
        (["TRAIN.EARLY_STOP.METRIC", "val/los"], "val/los", "val/loss"),  # a name the task lacks
    ],
)
def test_a_metric_never_reported_is_refused_suggesting_one_the_run_reports(
    opts: list[str], refused: str, suggested: str
) -> None:
    config = load_config(DEFAULT_CONFIG, opts)
    dataset = build_dataset(config, "train")
    plan, task, cpu = plan_for(config, 1, len(dataset)), build_task(config.TASK), torch.device("cpu")
    task.bind(TaskContext(config, plan, dataset, 0, 1, cpu))
    with pytest.raises(ConfigError) as refusal:  # before the model is run: none is needed
        check_task(
            task,
            plan,
            torch.nn.Identity(),
            None,
            cpu,
            config_problems=task.config_problems(config),
            task_config=config.TASK,
            loss=config.LOSS,
            train=config.TRAIN,
            schedule=config.SCHEDULE,
        )
    message = str(refusal.value)
    assert "(1 problem)" in message
    assert f"TRAIN.EARLY_STOP.METRIC: {refused} is never reported" in message
    assert f"name one as <pass>/<metric>, e.g. {suggested} (" in message
    prefix, name = suggested.rsplit("/", 1)
    assert prefix in validation_prefixes(task, plan)
    assert name in task.metric_directions
