"""What a resumed run may change in its config (``linnaeus_accel.checkpoint.resume.config_changes``): table
tests on real resolved plans of the default digits run (23 optimizer steps per epoch), resumed at
step 46. The end-to-end refusal and the listed changes are in test_reliability.py."""

from __future__ import annotations

from typing import Any

import pytest

from linnaeus_accel.checkpoint.resume.config_changes import differing_keys, review_changes
from linnaeus_accel.checkpoint.resume.elastic import plan_identity
from linnaeus_accel.config import Config, ConfigError, load_config, validate_config
from linnaeus_accel.schedule import resolve_plan
from tests.conftest import DEFAULT_CONFIG

BASE = {"TRAIN.EPOCHS": 3, "DATA.BATCH_SIZE": 64}
# The default run's masking and mixup ramps end at fractions of the run: more epochs stretch them.
NO_RAMPS = {
    "SCHEDULE.META_MASKING.ENABLED": "false",
    "SCHEDULE.META_MASKING.PARTIAL.ENABLED": "false",
    "SCHEDULE.MIXUP.PROB.ENABLED": "false",
}
STEP_LR = {
    **NO_RAMPS,
    "LR_SCHEDULER.NAME": "step",
    "LR_SCHEDULER.WARMUP_FRACTION": None,
    "LR_SCHEDULER.WARMUP_STEPS": 5,
    "LR_SCHEDULER.DECAY_STEPS": 30,
}
WSD_WARMUP_IN_STEPS = {**NO_RAMPS, "LR_SCHEDULER.WARMUP_FRACTION": None, "LR_SCHEDULER.WARMUP_STEPS": 5}


def config(**changes: Any) -> Any:
    opts = {**BASE, **{k.replace("__", "."): v for k, v in changes.items()}}
    flat = [str(x) for kv in opts.items() for x in (kv[0], "null" if kv[1] is None else kv[1])]
    return load_config(DEFAULT_CONFIG, flat)


def review(saved: Any, now: Any, done: int = 46, allow: bool = False) -> list[str]:
    saved_plan = resolve_plan(saved, 23, 1, 1438)
    plan = resolve_plan(now, 23, 1, 1438)
    saved_config, run_config = saved.model_dump(mode="json"), now.model_dump(mode="json")
    return review_changes(saved_config, plan_identity(saved_plan), run_config, plan, done, allow)


@pytest.mark.parametrize(
    ("saved", "now", "applied"),
    [
        # Nothing changed: nothing to say.
        ({}, {}, []),
        # Logging and validation intervals act on the steps to come.
        ({}, {"SCHEDULE.METRICS.STEP_INTERVAL": 10}, ["SCHEDULE.METRICS.STEP_INTERVAL: 20 -> 10"]),
        # More epochs under a step LR in steps: the first 46 steps' LRs are the same.
        (STEP_LR, {**STEP_LR, "TRAIN.EPOCHS": 4}, ["TRAIN.EPOCHS: 3 -> 4"]),
        # More epochs after a warmup-stable-decay run's warmup, still in its stable phase, with the
        # warmup given in steps: same past.
        (WSD_WARMUP_IN_STEPS, {**WSD_WARMUP_IN_STEPS, "TRAIN.EPOCHS": 4}, ["TRAIN.EPOCHS: 3 -> 4"]),
    ],
)
def test_changes_that_leave_the_past_alone_are_applied(
    saved: dict[str, Any], now: dict[str, Any], applied: list[str]
) -> None:
    assert review(config(**_kw(saved)), config(**_kw(now))) == applied


@pytest.mark.parametrize(
    ("now", "named", "says"),
    [
        # The seed draws the data order and the masks of every step already trained.
        ({"EXPERIMENT.SEED": 7}, "EXPERIMENT.SEED", "was 42"),
        # The default warmup is a fraction of the run: more epochs stretch it over the past.
        ({"TRAIN.EPOCHS": 4}, "TRAIN.EPOCHS", "the LR of group default at step 1"),
        # So is the default meta-mask ramp, with the LR's warmup in steps.
        (
            {"LR_SCHEDULER.WARMUP_FRACTION": None, "LR_SCHEDULER.WARMUP_STEPS": 5, "TRAIN.EPOCHS": 4},
            "TRAIN.EPOCHS",
            "the meta-mask probability at step 1",
        ),
        # The model is what was trained.
        ({"MODEL.OPTIONS.dropout": 0.1}, "MODEL.OPTIONS.dropout", "in the checkpoint"),
    ],
)
def test_changes_that_rewrite_the_past_are_refused_naming_the_key(
    now: dict[str, Any], named: str, says: str
) -> None:
    saved = {k: v for k, v in now.items() if k.startswith("LR_SCHEDULER.")}
    with pytest.raises(ConfigError) as refused:
        review(config(**_kw(saved)), config(**_kw(now)))
    message = str(refused.value)
    assert named in message, message
    assert says in message, message
    assert "--allow-config-change" in message, message


def test_allow_config_change_applies_and_lists_them() -> None:
    assert review(config(), config(**_kw({"EXPERIMENT.SEED": 7})), allow=True) == ["EXPERIMENT.SEED: 42 -> 7"]


def test_a_checkpoint_without_a_stored_config_is_not_reviewed() -> None:
    now = config(**_kw({"EXPERIMENT.SEED": 7}))
    plan = resolve_plan(now, 23, 1, 1438)
    assert review_changes(None, None, now.model_dump(mode="json"), plan, 46, allow=False) == []


def _kw(opts: dict[str, Any]) -> dict[str, Any]:
    return {k.replace(".", "__"): v for k, v in opts.items()}


def test_a_longer_run_in_steps_is_applied_when_the_past_is_unchanged() -> None:
    # TRAIN.STEPS only sets where the run ends: with warmup in steps and a WSD decay that has not
    # started, 100 -> 200 steps changes none of the 20 trained; a stream of unknown length too.
    def config(steps: int) -> Config:
        return validate_config(
            {
                "TRAIN": {"EPOCHS": None, "STEPS": steps},
                "LR_SCHEDULER": {"NAME": "wsd", "WARMUP_STEPS": 10, "STABLE_DURATION_FRACTION": 0.8},
            }
        )

    for batches in (50, None):
        before, after = config(100), config(200)
        old, new = resolve_plan(before, batches), resolve_plan(after, batches)
        saved_plan = {
            "total_steps": 100,
            "world_size": 1,
            "accumulation": 1,
            "batch_size": 64,
            "batches_per_epoch": batches,
        }
        lines = review_changes(
            before.model_dump(mode="json"), saved_plan, after.model_dump(mode="json"), new, 20, allow=False
        )
        assert lines == ["TRAIN.STEPS: 100 -> 200"], (batches, lines)
        assert old.total_steps == 100


def test_a_key_added_since_the_checkpoint_differs_only_when_set() -> None:
    """A checkpoint written before CALLBACKS existed has no such key: this run's default ([]) is
    no change, a callback listed is one (forward-only, applied and listed)."""
    saved = Config().model_dump(mode="json")
    del saved["CALLBACKS"]
    assert differing_keys(saved, Config().model_dump(mode="json")) == {}
    now = validate_config({"CALLBACKS": [{"NAME": "ema"}]}).model_dump(mode="json")
    assert list(differing_keys(saved, now)) == ["CALLBACKS"]
