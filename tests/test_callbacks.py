"""Callbacks (``linnaeus_accel.Callback``): when ``on_step_end`` runs (a pure function of the step,
resolved with the plan and drawn in ``plan``), config errors naming their key, the events a run
calls in order, and a callback's state after ``kill -9`` and a rerun equal to an uninterrupted run's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.configs import LM_CFG, REPO, SMALL_LM
from helpers.in_process import reset_accelerate, run_cli
from helpers.processes import AFTER_FIRST_COMMIT
from helpers.runs import TrainRun, assert_resumed_from, committed
from helpers.trackers import wandb_history, wandb_records, wandb_run_files
from pydantic import BaseModel, ConfigDict

from linnaeus_accel import Callback, register_callback
from linnaeus_accel.callbacks import build_callbacks
from linnaeus_accel.config import ConfigError, validate_config
from linnaeus_accel.schedule import resolve_plan
from linnaeus_accel.schedule.callback_steps import CallbackTiming, next_call
from linnaeus_accel.schedule.run_length import epoch_unit_keys

SCRIPT = REPO / "tests" / "callback_script.py"


def plan_of(train: dict[str, Any], batches_per_epoch: int = 10) -> Any:
    config = validate_config(
        {"TRAIN": train, "DATA": {"BATCH_SIZE": 10}, "LR_SCHEDULER": {"REFERENCE_BS": None}}
    )
    return resolve_plan(config, batches_per_epoch, 1, batches_per_epoch * 10)


EPOCHS_3 = plan_of({"EPOCHS": 3})  # 10 steps an epoch, T = 30
STEPS_25 = plan_of({"EPOCHS": None, "STEPS": 25})  # 10 steps an epoch, the third partial: T = 25


@pytest.mark.parametrize(
    ("plan", "timing", "after", "due"),
    [
        (EPOCHS_3, CallbackTiming("a", "step"), 0, 1),  # every step: the next one
        (EPOCHS_3, CallbackTiming("a", "step"), 29, 30),  # ... up to the last
        (EPOCHS_3, CallbackTiming("a", "step"), 30, None),  # none after the run's end
        (EPOCHS_3, CallbackTiming("a", "steps", 7), 0, 7),  # every 7 steps: the first multiple
        (EPOCHS_3, CallbackTiming("a", "steps", 7), 7, 14),  # after a call, the next multiple
        (EPOCHS_3, CallbackTiming("a", "steps", 7), 12, 14),  # resumed between two: the next multiple
        (EPOCHS_3, CallbackTiming("a", "steps", 7), 28, None),  # 35 > T: none left
        (EPOCHS_3, CallbackTiming("a", "steps", 10), 20, 30),  # a multiple at T itself is called
        (EPOCHS_3, CallbackTiming("a", "epochs", 1), 0, 10),  # every epoch: at its last step
        (EPOCHS_3, CallbackTiming("a", "epochs", 2), 0, 20),  # every 2 epochs: epoch 2's last step
        (EPOCHS_3, CallbackTiming("a", "epochs", 2), 20, None),  # epoch 4 is not in the run
        (STEPS_25, CallbackTiming("a", "epochs", 1), 20, 25),  # the partial last epoch ends at T
        (STEPS_25, CallbackTiming("a", "epochs", 2), 0, 20),  # ... epoch 3 is not a multiple of 2
        (EPOCHS_3, CallbackTiming("a", "never", 0), 0, None),  # a fraction that resolved to 0 steps
    ],
)
def test_next_call(plan: Any, timing: CallbackTiming, after: int, due: int | None) -> None:
    assert next_call(timing, after, plan.total_steps, plan.optimizer_steps_per_epoch) == due


def test_intervals_resolve_once_with_the_plan() -> None:
    config = validate_config(
        {
            "TRAIN": {"EPOCHS": 3},
            "DATA": {"BATCH_SIZE": 10},
            "CALLBACKS": [
                {"NAME": "x"},
                {"NAME": "x", "INTERVAL_FRACTION": 0.25},  # 0.25 x 30 = 7.5 -> 8 steps
                {"NAME": "y", "INTERVAL_FRACTION": 0.0},
                {"NAME": "y", "INTERVAL_EPOCHS": 2},
            ],
        }
    )
    plan = resolve_plan(config, 10, 1, 100)
    assert plan.callbacks == (
        CallbackTiming("x", "step"),
        CallbackTiming("x#2", "steps", 8),
        CallbackTiming("y", "never", 0),
        CallbackTiming("y#2", "epochs", 2),
    )
    # For a stream without __len__, an interval in epochs is one of the keys it cannot resolve.
    assert "CALLBACKS.3.INTERVAL_EPOCHS" in epoch_unit_keys(
        config.TRAIN, config.SCHEDULE, config.LR_SCHEDULER, config.CALLBACKS
    )


def test_plan_lists_callbacks_and_draws_them_on_the_timeline(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"BASE: [{REPO / 'configs' / 'default.yaml'}]\n"
        "CALLBACKS:\n  - NAME: samples\n    INTERVAL_STEPS: 300\n"
    )
    rc, out, err = run_cli("plan", "--cfg", str(cfg))
    assert rc == 0, err
    assert "Callback samples: on_step_end every 300 steps" in out
    row = next(line for line in out.splitlines() if line.startswith("  samples    |"))
    assert row.count("*") == 3  # steps 300, 600, 900 of 900
    rc, out, err = run_cli("plan", "--cfg", str(cfg), "--json", "--no-series")
    assert json.loads(out)["callbacks"] == [{"label": "samples", "unit": "steps", "every": 300}]


class StrictOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    every: int = 1


@register_callback("test_strict")
class Strict(Callback):
    Options = StrictOptions

    def __init__(self, every: int = 1) -> None:
        self.every = every


@register_callback("test_plain")
class Plain(Callback):
    def __init__(self, text: str = "") -> None:
        self.text = text


def test_config_errors_name_their_key() -> None:
    config = validate_config(
        {
            "CALLBACKS": [
                {"NAME": "no_such_callback"},
                {"NAME": "test_strict", "OPTIONS": {"every": "often", "evry": 3}},
                {"NAME": "test_plain", "OPTIONS": {"txt": "a"}},
                {"NAME": "test_plain", "OPTIONS": {"text": "fine"}, "INTERVAL_STEPS": 5},
            ]
        }
    )
    with pytest.raises(ConfigError) as caught:
        build_callbacks(config.CALLBACKS)
    keys = [key for key, _ in caught.value.problems]
    assert keys == [
        "CALLBACKS.0.NAME",
        "CALLBACKS.1.OPTIONS.every",
        "CALLBACKS.1.OPTIONS.evry",
        "CALLBACKS.2.OPTIONS.txt",
    ]
    text = str(caught.value)
    assert "no callback named 'no_such_callback'" in text
    assert "register_callback" in text
    assert "Plain takes no option 'txt' (it takes: text)" in text
    with pytest.raises(
        ConfigError, match=r"INTERVAL_STEPS and CALLBACKS\.0\.INTERVAL_EPOCHS are set together"
    ):
        validate_config({"CALLBACKS": [{"NAME": "x", "INTERVAL_STEPS": 5, "INTERVAL_EPOCHS": 1}]})
    built = build_callbacks(
        validate_config({"CALLBACKS": [{"NAME": "test_plain", "INTERVAL_STEPS": 5}]}).CALLBACKS
    )
    assert isinstance(built[0], Plain)
    assert built[0].interval == {"INTERVAL_STEPS": 5}


# -- end to end: the events of a run, and a callback's state across kill -9 -------------------------
CALLBACK_OPTS = [
    "TRAIN.EPOCHS", "2", "DATA.BATCH_SIZE", "64",  # 2 epochs of 23 steps (T = 46)
    "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1",  # checkpoints at steps 23 and 46
    "CALLBACKS", "[{NAME: counter}, {NAME: counter, OPTIONS: {label: sparse}, INTERVAL_STEPS: 10}]",
]  # fmt: skip


def counted(run: TrainRun, label: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run.dir / f"callback_{label}.json").read_text())
    return data


@pytest.mark.slow
def test_callback_state_after_kill_and_rerun_counts_each_event_once(tmp_path: Path) -> None:
    """Killed -9 after the checkpoint of step 23 and rerun: the callbacks' state (restored from that
    checkpoint) ends as an uninterrupted run's would, each step, validation and commit counted once."""
    code = SCRIPT.read_text()
    run = TrainRun(tmp_path, CALLBACK_OPTS)
    killed = run.run(kill_at="optimizer_step:35", python_code=code, extra_env=AFTER_FIRST_COMMIT)
    assert killed.returncode != 0, killed.tail()
    assert committed(run.dir) == ["step_00000023"]
    resumed = run.run(python_code=code).check_ok()
    assert_resumed_from(resumed.output, 23)
    records = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in records if "val/loss" in r] == [23, 46]
    assert counted(run, "counter") == {
        "steps": list(range(1, 47)),
        "validations": [23, 46],
        "checkpoints": [23, 46],  # main process, once each is committed (23 again after the resume)
        "starts": 1,  # not state: this launch's
        "status": "completed",
    }
    assert counted(run, "sparse")["steps"] == [10, 20, 30, 40]
    assert "Callback counter: on_step_end after every optimizer step" in resumed.output
    assert "Callback counter#2: on_step_end every 10 steps" in resumed.output  # labels: registered names


# -- lm_samples ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.usefixtures("wandb_offline")
def test_lm_samples_writes_what_the_trained_model_generates(tmp_path: Path) -> None:
    """Greedy text at steps 10 and 20 in metrics.jsonl and the console; the last one equals greedy
    decoding of the final weights, computed here with transformers; sampled text is seeded. The
    same text is in TensorBoard and in W&B's table, each read back by its own library."""
    from safetensors.torch import load_file

    from linnaeus_accel.config import load_config
    from linnaeus_accel.data.tokens.packing import decode_bytes, encode_bytes
    from linnaeus_accel.models import build_model

    callbacks = (
        "[{NAME: lm_samples, INTERVAL_STEPS: 10, OPTIONS: {prompts: ['def ', 'The '], max_new_tokens: 8}},"
        " {NAME: lm_samples, INTERVAL_STEPS: 20, OPTIONS: {prompts: ['x'], temperature: 1.0, seed: 3, name: sampled}}]"
    )
    opts = [
        *SMALL_LM,
        "TRAIN.TARGET_TOKENS",
        str(20 * 8 * 128),
        "ENV.OUTPUT.BASE_DIR",
        str(tmp_path),
        "CALLBACKS",
        callbacks,
        "EXPERIMENT.TRACKERS",
        "[tensorboard, wandb]",
    ]
    reset_accelerate()
    try:
        rc, out, err = run_cli("train", "--cfg", LM_CFG, "--opts", *opts)
    finally:
        reset_accelerate()
    assert rc == 0, out + err
    run = tmp_path / "lm_tiny"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    greedy = [r for r in records if "samples/1" in r]
    assert [r["global_step"] for r in greedy] == [10, 20]
    assert all(r["samples/0"].startswith("def ") and r["samples/1"].startswith("The ") for r in greedy)
    assert f"step 20 sample: 'def ' -> {greedy[-1]['samples/0'][4:]!r}" in out

    config = load_config(LM_CFG, [*SMALL_LM, "MODEL.OPTIONS.vocab_size", "257"])
    model = build_model(config, None).eval()
    model.load_state_dict(load_file(run / "final" / "model.safetensors"), strict=False)
    model.tie_weights()
    with torch.no_grad():
        ids = torch.tensor([encode_bytes("def ")])
        for _ in range(8):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert greedy[-1]["samples/0"] == "def " + decode_bytes(ids[0, 4:])
    sampled = [r for r in records if "sampled/0" in r]
    assert [r["global_step"] for r in sampled] == [20]
    assert sampled[0]["sampled/0"].startswith("x")
    # TensorBoard holds the same text (read back by TensorBoard itself).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((run / "tensorboard").rglob("events.out.*")).parent))
    events.Reload()
    tags = [t for t in events.Tags()["tensors"] if t.startswith("samples/1")]
    assert tags, events.Tags()
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors(tags[0])}
    assert texts == {r["global_step"]: r["samples/1"] for r in greedy}
    # W&B: the history of the offline run (read by wandb itself) refers at each step to a table
    # file holding [step, prompt, continuation] rows.
    (wandb_file,) = wandb_run_files(run)
    history = wandb_history(wandb_records(wandb_file))

    def table_rows(key: str) -> dict[int, list[list[Any]]]:
        rows = {}
        for step, row in history.items():
            if f"{key}.path" in row:  # the history row refers to the table's file
                table = json.loads((wandb_file.parent / "files" / row[f"{key}.path"]).read_text())
                assert table["columns"] == ["step", "prompt", "continuation"]
                rows[step] = table["data"]
        return rows

    assert table_rows("samples/table") == {
        r["global_step"]: [
            [r["global_step"], "def ", r["samples/0"][4:]],
            [r["global_step"], "The ", r["samples/1"][4:]],
        ]
        for r in greedy
    }
    assert table_rows("sampled/table") == {20: [[20, "x", sampled[0]["sampled/0"][1:]]]}


def test_two_lm_samples_under_one_name_exit_2_naming_the_option(tmp_path: Path) -> None:
    """Their texts would replace each other at shared steps in TensorBoard and W&B."""

    two = "[{NAME: lm_samples, OPTIONS: {prompts: [a]}}, {NAME: lm_samples, OPTIONS: {prompts: [b]}}]"
    opts = [*SMALL_LM, "ENV.OUTPUT.BASE_DIR", str(tmp_path), "CALLBACKS", two]
    rc, out, err = run_cli("train", "--cfg", LM_CFG, "--opts", *opts)
    assert rc == 2, out + err
    assert "two lm_samples callbacks log under the same name 'samples': give each its own OPTIONS.name" in err


def test_profile_traces_its_steps_and_prints_a_summary(tmp_path: Path) -> None:
    from linnaeus_accel.callbacks.profile import Profile

    calls: list[int] = []

    class Seen(Profile):
        def on_step_end(self, trainer: Any, step: int) -> None:
            calls.append(step)
            super().on_step_end(trainer, step)

    register_callback("test_profile_seen")(Seen)
    opts = [
        "ENV.OUTPUT.BASE_DIR", str(tmp_path), "TRAIN.EPOCHS", "2", "DATA.BATCH_SIZE", "256",
        "CALLBACKS", "[{NAME: test_profile_seen, OPTIONS: {start_step: 3, steps: 2}}]",
    ]  # fmt: skip
    reset_accelerate()
    try:
        rc, out, err = run_cli("train", "--cfg", str(REPO / "configs" / "default.yaml"), "--opts", *opts)
    finally:
        reset_accelerate()
    assert rc == 0, out + err
    trace = tmp_path / "digits_default" / "profile" / "steps_3-4.rank0.json"
    assert json.loads(trace.read_text())["traceEvents"]
    assert "profile of steps 3-4" in out
    assert "Self CPU" in out
    assert calls == [1, 2, 3, 4]  # nothing asked after its range (12 steps in the run)
