"""``TRAIN.TARGET_TOKENS`` (docs/semantics.md §1): a run measured in target tokens, resolved once to
``T = ceil(TARGET_TOKENS / tokens per global step)``; its last epoch may be partial, and its last
boundary (final checkpoint and validation) is at ``T``. Then: every configuration that would make
global steps hold different numbers of tokens is a config error naming the key; the events, the
``plan`` summary, timeline and JSON agree on the partial last epoch; EPOCHS runs are unchanged.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from helpers.configs import CFG, make_config
from helpers.in_process import plan_json, plan_text, run_cli, timeline_rows
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from linnaeus_accel.cli import plan_for
from linnaeus_accel.config import Config, ConfigError, validate_config
from linnaeus_accel.data import register_dataset
from linnaeus_accel.schedule import OpsSchedule, ResolvedPlan, batches_per_process, resolve_plan

KEY = "TRAIN.TARGET_TOKENS"


def plan_of(
    config: Config, dataset_size: int | None, tokens_per_sample: int | None, world: int = 1
) -> ResolvedPlan:
    """What ``plan`` and the trainer resolve: the per-process batch count as Accelerate shards it."""
    size = 3200 if dataset_size is None else dataset_size  # a stand-in when the size is not known
    batches = batches_per_process(size, config.DATA.BATCH_SIZE, world, config.DATA.DROP_LAST)
    return resolve_plan(config, batches, world, dataset_size, tokens_per_sample)


# ---------------------------------------------------------------------------------------------
# resolution: T = ceil(target / tokens per step), epochs = ceil(T / steps per epoch)


@pytest.mark.parametrize(
    ("target", "tps", "batch", "world", "accum", "size", "drop_last", "ope", "total", "epochs", "last"),
    [
        # 32 x 128 = 4096 tokens per step; 1e6 / 4096 = 244.1 -> 245 steps: 2 epochs of 100 + 45
        (1_000_000, 128, 32, 1, 1, 3200, False, 100, 245, 3, 45),
        # exactly 100 steps of 4096: one whole epoch, nothing partial
        (409_600, 128, 32, 1, 1, 3200, False, 100, 100, 1, 100),
        # exactly 3 epochs ...
        (1_228_800, 128, 32, 1, 1, 3200, False, 100, 300, 3, 100),
        # ... and one token more is one more step, opening a fourth epoch of 1 step
        (1_228_801, 128, 32, 1, 1, 3200, False, 100, 301, 4, 1),
        # a target below one step's tokens still trains one step
        (1, 128, 32, 1, 1, 3200, False, 100, 1, 1, 1),
        # 2 processes x 16 x accumulation 2 = 64 samples x 256 = 16384 tokens per step; 3200 / 32 =
        # 100 batches per process -> 50 steps per epoch; 2e6 / 16384 = 122.07 -> 123 = 50 + 50 + 23
        (2_000_000, 256, 16, 2, 2, 3200, False, 50, 123, 3, 23),
        # 4 processes x 8 x accumulation 4 = 128 samples x 1024 = 131072 tokens per step; 25 steps
        # per epoch; 1e7 / 131072 = 76.3 -> 77 = 3 x 25 + 2
        (10_000_000, 1024, 8, 4, 4, 3200, False, 25, 77, 4, 2),
        # DROP_LAST: 3210 samples -> 100 full batches of 32 (10 dropped), so every step is whole
        (1_000_000, 128, 32, 1, 1, 3210, True, 100, 245, 3, 45),
        # DROP_LAST without a known dataset size: every batch is full by construction
        (1_000_000, 128, 32, 1, 1, None, True, 100, 245, 3, 45),
    ],
)
def test_target_tokens_resolution(
    target: int,
    tps: int,
    batch: int,
    world: int,
    accum: int,
    size: int | None,
    drop_last: bool,
    ope: int,
    total: int,
    epochs: int,
    last: int,
) -> None:
    plan = plan_of(
        make_config(target_tokens=target, batch_size=batch, accumulation=accum, drop_last=drop_last),
        size,
        tps,
        world,
    )
    tokens_per_step = batch * world * accum * tps
    assert plan.tokens_per_step == tokens_per_step
    assert plan.total_steps == total == math.ceil(target / tokens_per_step)
    assert plan.optimizer_steps_per_epoch == ope
    assert plan.epochs == epochs
    assert plan.last_epoch_steps == last
    assert plan.boundary_step(epochs) == total  # the final boundary is at T, even mid-epoch
    assert plan.boundary_step(epochs - 1) == (epochs - 1) * ope  # earlier epochs are whole
    assert plan.target_tokens == target
    assert plan.total_tokens == total * tokens_per_step >= target


@settings(max_examples=150, deadline=None)
@given(
    target=st.integers(1, 10**12),
    tps=st.integers(1, 8192),
    batch=st.integers(1, 64),
    world=st.integers(1, 8),
    accum=st.integers(0, 8),
    size=st.integers(1, 10**6),
)
def test_target_tokens_property(target: int, tps: int, batch: int, world: int, accum: int, size: int) -> None:
    # DROP_LAST keeps every batch full; then only the accumulation windows can be uneven
    config = make_config(target_tokens=target, batch_size=batch, accumulation=accum, drop_last=True)
    batches = size // (batch * world)
    assume(batches > 0)
    a = max(1, accum)
    if batches % a:
        with pytest.raises(ConfigError, match=r"TRAIN\.TARGET_TOKENS"):
            plan_of(config, size, tps, world)
        return
    plan = plan_of(config, size, tps, world)
    per_step = batch * world * a * tps
    assert plan.total_steps == -(-target // per_step)  # exact integer ceil, no float rounding
    assert plan.optimizer_steps_per_epoch == batches // a
    assert (plan.epochs - 1) * plan.optimizer_steps_per_epoch < plan.total_steps
    assert plan.total_steps <= plan.epochs * plan.optimizer_steps_per_epoch
    assert plan.boundary_step(plan.epochs) == plan.total_steps
    assert 1 <= plan.last_epoch_steps <= plan.optimizer_steps_per_epoch
    assert plan.total_tokens is not None
    assert target <= plan.total_tokens < target + per_step


def test_schedule_fractions_are_of_the_token_run() -> None:
    # 245 steps: WARMUP_FRACTION 0.1 -> round(24.5) = 25, a fraction of T, not of whole epochs
    config = validate_config(
        {
            "DATA": {"BATCH_SIZE": 32},
            "TRAIN": {"TARGET_TOKENS": 1_000_000},
            "LR_SCHEDULER": {"WARMUP_FRACTION": 0.1},
        }
    )
    plan = plan_of(config, 3200, 128)
    assert plan.total_steps == 245
    assert plan.warmup_steps == 25
    assert plan.lr_curves[0].total_steps == 245


# ---------------------------------------------------------------------------------------------
# errors: every global step must hold the same number of target tokens


@pytest.mark.parametrize(
    ("config", "size", "tps", "world", "says"),
    [
        # the dataset declares no fixed token count: use EPOCHS
        (
            make_config(target_tokens=10**6),
            3200,
            None,
            1,
            ["tokens_per_sample", "TRAIN.EPOCHS", "--tokens-per-sample"],
        ),
        # a declared count of 0 tokens is no count at all
        (make_config(target_tokens=10**6), 3200, 0, 1, ["tokens_per_sample = 0"]),
        # 3201 samples: the last global batch holds 1 of 32 samples
        (make_config(target_tokens=10**6), 3201, 128, 1, ["3201", "1 of 32", "DATA.DROP_LAST: true"]),
        # 3232 samples over 2 processes of 32: the last global batch holds 32 of 64
        (
            make_config(target_tokens=10**6),
            3232,
            128,
            2,
            ["3232", "32 of 64", "2 processes", "DATA.DROP_LAST: true"],
        ),
        # 100 batches per process with accumulation 3: a last window of 1 batch is a smaller step
        (
            make_config(target_tokens=10**6, accumulation=3),
            3200,
            128,
            1,
            ["100 batches", "ACCUMULATION_STEPS", "e.g. 2 or 4"],
        ),
        # ... also with DROP_LAST, which drops batches, not windows: 3210 -> 100 batches
        (
            make_config(target_tokens=10**6, accumulation=3, drop_last=True),
            3210,
            128,
            1,
            ["last window of 1", "e.g. 2 or 4"],
        ),
        # accumulation larger than the epoch: 3 batches per process, accumulation 4
        (make_config(target_tokens=10**6, accumulation=4), 96, 128, 1, ["3 batches", "e.g. 3"]),
        # without DROP_LAST, an unknown dataset size cannot be checked
        (
            make_config(target_tokens=10**6),
            None,
            128,
            1,
            ["dataset size", "--dataset-size", "DATA.DROP_LAST: true"],
        ),
    ],
)
def test_uneven_steps_are_config_errors_naming_target_tokens(
    config: Config, size: int | None, tps: int | None, world: int, says: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        plan_of(config, size, tps, world)
    assert [key for key, _ in info.value.problems] == [KEY]
    text = str(info.value)
    for fragment in says:
        assert fragment in text, text


def test_every_target_tokens_problem_is_reported_at_once() -> None:
    # no token count, an uneven last global batch and a partial accumulation window: 3201 samples
    # -> 101 batches, accumulation 2
    with pytest.raises(ConfigError) as info:
        plan_of(make_config(target_tokens=10**6, accumulation=2), 3201, None)
    assert [key for key, _ in info.value.problems] == [KEY, KEY, KEY]
    text = str(info.value)
    assert "tokens_per_sample" in text
    assert "1 of 32" in text
    assert "101 batches" in text


def test_both_epochs_and_target_tokens_is_an_error_naming_both() -> None:
    with pytest.raises(ConfigError) as info:
        validate_config({"TRAIN": {"EPOCHS": 3, "TARGET_TOKENS": 1000}})
    assert len(info.value.problems) == 1
    text = str(info.value)
    assert "TRAIN.EPOCHS" in text
    assert KEY in text
    assert "null" in text  # the fix: unset one


# ---------------------------------------------------------------------------------------------
# events with a partial last epoch: 3,050,000 / 4096 = 744.6 -> T = 745 = 7 x 100 + 45, 8 epochs

LONG_TARGET = 3_050_000


def long_ops(schedule: dict[str, Any]) -> OpsSchedule:
    plan = plan_of(make_config(target_tokens=LONG_TARGET, schedule=schedule), 3200, 128)
    assert (plan.total_steps, plan.epochs, plan.last_epoch_steps) == (745, 8, 45)
    return OpsSchedule(plan)


@pytest.mark.parametrize(
    ("validation", "expected"),
    [
        ({"INTERVAL_EPOCHS": 1}, [1, 2, 3, 4, 5, 6, 7, 8]),  # every epoch, the partial one too
        ({"INTERVAL_EPOCHS": 3}, [3, 6, 8]),  # multiples of 3, and the final (partial) epoch
        ({"INTERVAL_STEPS": 350}, [4, 7, 8]),  # 400 crosses 350, 700 crosses 700, final at 745
        ({"INTERVAL_STEPS": 1000}, [8]),  # longer than the run: the final boundary only
        ({"INTERVAL_FRACTION": 0.5}, [4, 8]),  # round(372.5) = 373 steps: 400 crosses it
    ],
)
def test_validation_with_partial_last_epoch(validation: dict[str, Any], expected: list[int]) -> None:
    ops = long_ops({"VALIDATION": validation})
    assert ops.event_epochs()["validation"] == expected
    assert ops.should_validate(8)  # the final boundary is always validated


@pytest.mark.parametrize(
    ("interval", "expected"),
    [
        (260, [3, 6]),  # 300 crosses 260, 600 crosses 520; the boundary at 745 crosses nothing (780 > 745)
        (370, [4, 8]),  # 400 crosses 370; 745 crosses 740
        (750, []),  # never reached: the run ends at 745, not at the 800 of a whole 8th epoch
    ],
)
def test_step_intervals_see_the_last_boundary_at_t(interval: int, expected: list[int]) -> None:
    ops = long_ops({"VALIDATION": {"INTERVAL_EPOCHS": 1, "MASK_META_INTERVAL_STEPS": interval}})
    assert ops.event_epochs()["mask_meta_validation"] == expected  # mask-meta is never forced


def test_final_checkpoint_at_t() -> None:
    ops = long_ops({"CHECKPOINT": {"INTERVAL_EPOCHS": 3}})
    assert ops.event_epochs()["checkpoint"] == [3, 6, 8]
    assert ops.plan.boundary_step(8) == 745
    assert [e for e in range(1, 9) if ops.is_final_epoch(e)] == [8]


def test_mid_epoch_checkpoints_leave_the_last_step_to_the_final_boundary() -> None:
    # every 149 steps (745 = 5 x 149): 149..596 fall mid-epoch; 745 ends the run, so the final
    # boundary checkpoint (with its validations) covers it, once
    ops = long_ops({"CHECKPOINT": {"INTERVAL_STEPS": 149, "MID_EPOCH": True}})
    assert [k for k in range(1, 746) if ops.should_save_mid_epoch_checkpoint(k)] == [149, 298, 447, 596]
    assert ops.event_epochs()["checkpoint"] == [8]


@pytest.mark.parametrize(
    ("epoch", "global_step", "ends"),
    [
        (1, 99, False),  # one step before the first boundary
        (1, 100, True),  # a whole epoch
        (7, 700, True),  # the last whole epoch
        (8, 744, False),  # the partial last epoch runs on ...
        (8, 745, True),  # ... to T, with batches left in its dataloader
    ],
)
def test_should_end_epoch(epoch: int, global_step: int, ends: bool) -> None:
    assert long_ops({}).should_end_epoch(epoch, global_step) is ends


def test_last_step_is_logged() -> None:
    ops = long_ops({"METRICS": {"STEP_INTERVAL": 100}})
    assert [s for s in range(1, 746) if ops.should_log_metrics(s)] == [*range(100, 701, 100), 745]


# ---------------------------------------------------------------------------------------------
# plan: --tokens-per-sample, the summary, timeline and JSON

TOKEN_OPTS = ["--opts", "TRAIN.EPOCHS", "null", "TRAIN.TARGET_TOKENS", str(LONG_TARGET)]


def test_plan_json_with_tokens_per_sample() -> None:
    d = plan_json("--no-series", "--dataset-size", "3200", "--tokens-per-sample", "128", *TOKEN_OPTS)
    assert d["target_tokens"] == LONG_TARGET
    assert d["tokens_per_step"] == 4096
    assert d["total_steps"] == 745
    assert d["total_tokens"] == 745 * 4096
    assert d["epochs"] == 8
    assert d["events"]["checkpoint"][-1] == 8
    assert d["events"]["validation"][-1] == 8


def test_plan_text_with_tokens_per_sample() -> None:
    text = plan_text("--dataset-size", "3200", "--tokens-per-sample", "128", *TOKEN_OPTS)
    tokens = next(line for line in text.splitlines() if line.startswith("Tokens:"))
    assert "4096 target tokens per step" in tokens
    assert f"target {LONG_TARGET}" in tokens
    assert "745 steps" in tokens
    assert "8 epochs" in tokens
    assert "45 of 100 steps" in tokens  # the partial last epoch
    assert f"{745 * 4096} tokens in the whole run" in tokens
    assert "745 total steps" in text
    assert "Timeline: 745 steps" in text
    rows = timeline_rows(text)
    assert rows["epochs"].count("|") == 8
    assert rows["epochs"][-1] == "|"  # the last boundary is the run's last step
    assert rows["checkpoint"][-1] == "C"
    assert rows["validation"][-1] == "V"


@pytest.mark.parametrize(
    ("args", "opts", "key"),
    [
        (["--dataset-size", "3200", "--tokens-per-sample", "0"], [], "--tokens-per-sample"),  # zero
        (["--dataset-size", "3200", "--tokens-per-sample", "-5"], [], "--tokens-per-sample"),  # negative
        (["--tokens-per-sample", "-5"], [], "--tokens-per-sample"),  # checked before building the dataset
        (["--dataset-size", "3200"], [], "--tokens-per-sample"),  # no count given, no dataset built
        ([], ["DATA.DROP_LAST", "true"], "tokens_per_sample"),  # the digits dataset declares no count
        (["--dataset-size", "3200", "--tokens-per-sample", "128"], ["DATA.BATCH_SIZE", "30"], "20 of 30"),
    ],
)
def test_plan_errors_exit_2(args: list[str], opts: list[str], key: str) -> None:
    opts = ["--opts", "TRAIN.EPOCHS", "null", "TRAIN.TARGET_TOKENS", "1000000", *opts]
    rc, out, err = run_cli("plan", "--cfg", CFG, *args, *opts)
    assert rc == 2
    assert out == ""
    assert key in err
    assert "Traceback" not in err


def test_plan_without_target_tokens_is_unchanged() -> None:
    # the T = 1000 run of the plan tests: no Tokens line, null token fields
    args = ["--dataset-size", "3200", "--opts", "TRAIN.EPOCHS", "10"]
    rc, out, _ = run_cli("plan", "--cfg", CFG, "--json", "--no-series", *args)
    assert rc == 0
    d = json.loads(out)
    assert (d["target_tokens"], d["tokens_per_step"], d["total_tokens"]) == (None, None, None)
    assert (d["epochs"], d["total_steps"]) == (10, 1000)
    rc, text, _ = run_cli("plan", "--cfg", CFG, *args)
    assert "Tokens:" not in text
    assert "100 optimizer steps per epoch (accumulation 1) x 10 epochs = 1000 total steps" in text


def test_epochs_run_counts_tokens_when_known() -> None:
    # 3201 samples: 101 batches, the last holding 1 sample; the run sees each sample once per epoch
    args = ["--dataset-size", "3201", "--tokens-per-sample", "100", "--opts", "TRAIN.EPOCHS", "10"]
    rc, out, err = run_cli("plan", "--cfg", CFG, "--json", "--no-series", *args)
    assert rc == 0, err
    d = json.loads(out)
    assert d["total_steps"] == 1010
    assert d["tokens_per_step"] == 3200
    assert d["target_tokens"] is None
    assert d["total_tokens"] == 10 * 3201 * 100  # not 1010 x 3200: the short step holds 100 tokens
    rc, text, _ = run_cli("plan", "--cfg", CFG, *args)
    assert "Tokens:   3200 target tokens per step; 3201000 tokens in the whole run" in text


# ---------------------------------------------------------------------------------------------
# plan builds the dataset: its declared tokens_per_sample resolves TARGET_TOKENS


class FixedTokens:
    """A stand-in for packed fixed-length sequences: 3200 samples of 128 target tokens each."""

    tokens_per_sample = 128

    def __len__(self) -> int:
        return 3200


register_dataset("fixed_tokens_for_plan_tests")(lambda config, split: FixedTokens())


def token_dataset_config() -> Config:
    data: dict[str, Any] = {
        "DATA": {"DATASET": {"NAME": "fixed_tokens_for_plan_tests"}},
        "TRAIN": {"TARGET_TOKENS": LONG_TARGET},
    }
    return validate_config(data)


def test_plan_for_reads_the_datasets_tokens_per_sample() -> None:
    # batch 64 x 128 = 8192 tokens per step; 3,050,000 / 8192 = 372.3 -> 373 = 7 x 50 + 23
    plan = plan_for(token_dataset_config(), world_size=1, dataset_size=None)
    assert (plan.dataset_size, plan.tokens_per_step, plan.total_steps, plan.epochs) == (3200, 8192, 373, 8)


def test_plan_for_tokens_per_sample_given_wins() -> None:
    # --tokens-per-sample overrides what the dataset declares
    plan = plan_for(token_dataset_config(), world_size=1, dataset_size=None, tokens_per_sample=128 * 2)
    assert plan.tokens_per_step == 64 * 256
