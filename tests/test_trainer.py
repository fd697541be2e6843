"""The Trainer end to end, on real Accelerate in this process (world size 1, CPU).

Each run is tiny (a few epochs of the built-in digits data: 1438 training / 359 validation images)
and is checked against what ``linnaeus-accel plan`` says for the same config: the final
``global_step``, the logging steps, the LR of every logged step, the validation passes of every
epoch boundary and the early-stopping step. The outputs are read back as a user would: summary.json,
metrics.jsonl, final/model.safetensors, assets/ (the trackers: tests/test_trackers.py).

Accelerate keeps process-wide singletons (``AcceleratorState``, ``GradientState``) between
``Accelerator`` instances: every run here starts from a reset state, or a run with another
accumulation value would inherit the previous one.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import accelerate
import pytest
import torch
import torch.nn.functional as F
import yaml
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import set_seed
from helpers.configs import CFG
from helpers.in_process import plan_json, plan_text, reset_accelerate, train_in_process
from helpers.runs import read_metrics, read_summary
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from linnaeus_accel.cli import main, plan_for
from linnaeus_accel.config import load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.models import build_model
from linnaeus_accel.schedule.report.settings import report_settings
from linnaeus_accel.schedule.report.summary import summary_text
from linnaeus_accel.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

NAME = "digits_default"  # EXPERIMENT.NAME of the default config
N_TRAIN, N_VAL = 1438, 359
LEVELS = ("shape", "digit")
VAL_METRICS = ("loss", "acc_shape", "acc_digit", "chain_acc", "partial_chain_acc", "acc3_shape", "acc3_digit")
EXHAUSTIVE = (
    "val_mask_ROWS",
    "val_mask_COLS",
    "val_mask_MOMENTS",
    "val_mask_ROWS_COLS",
    "val_mask_ROWS_MOMENTS",
    "val_mask_COLS_MOMENTS",
)
WHITELIST = ("val_mask_ROWS", "val_mask_COLS_MOMENTS")  # the default VALIDATION.PARTIAL_MASK_META


# -- helpers -------------------------------------------------------------------------------------


def train_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "train/loss" in r]


def val_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "val/loss" in r]


def batches_per_epoch(n: int, batch: int, drop_last: bool = False) -> int:
    return n // batch if drop_last else math.ceil(n / batch)


def samples_per_epoch(n: int, batch: int, drop_last: bool = False) -> int:
    return batches_per_epoch(n, batch, drop_last) * batch if drop_last else n


def expected_samples_seen(step: int, n: int, batch: int, accum: int, drop_last: bool = False) -> int:
    """Samples (each counted once) consumed when ``step`` optimizer steps are done, world size 1."""
    batches = batches_per_epoch(n, batch, drop_last)
    epoch_samples = samples_per_epoch(n, batch, drop_last)
    per_epoch = math.ceil(batches / accum)
    epochs_done, steps_in_epoch = divmod(step, per_epoch)
    micro_batches = min(steps_in_epoch * accum, batches)
    return epochs_done * epoch_samples + min(micro_batches * batch, epoch_samples)


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def pass_prefixes(record: dict[str, Any]) -> set[str]:
    return {key.split("/")[0] for key in record if "/" in key}


def expected_passes(events: dict[str, list[int]], epoch: int, whitelist: tuple[str, ...]) -> set[str]:
    passes = set()
    if epoch in events["validation"]:
        passes.add("val")
    if epoch in events["mask_meta_validation"]:
        passes.add("val_mask_meta")
    if epoch in events["partial_mask_meta_validation"]:
        passes.update(whitelist)
    if epoch in events["exhaustive_validation"]:
        passes.update(EXHAUSTIVE)
    return passes


def masked_components(prefix: str) -> tuple[str, ...] | None:
    """None: nothing masked; ('*',): every component."""
    if prefix == "val":
        return None
    if prefix == "val_mask_meta":
        return ("*",)
    return tuple(prefix.removeprefix("val_mask_").split("_"))


@torch.no_grad()
def evaluate(model: torch.nn.Module, val_dataset: Any, masked: tuple[str, ...] | None) -> dict[str, float]:
    """Validation metrics computed here, independently of the trainer (masking zeroes a component)."""
    model.eval()
    loss_sum, chain, n = 0.0, 0, 0
    correct, top3 = [0, 0], [0, 0]
    for batch in DataLoader(val_dataset, batch_size=128, shuffle=False):
        meta = {
            c: torch.zeros_like(x) if masked is not None and ("*" in masked or c in masked) else x
            for c, x in batch["meta"].items()
        }
        logits = model({**batch, "meta": meta})
        labels = batch["labels"]
        assert bool((labels >= 0).all())  # no null label: partial_chain_acc is chain_acc
        per_level = torch.stack(
            [F.cross_entropy(lg.float(), labels[:, i], reduction="none") for i, lg in enumerate(logits)], 1
        )
        hits = torch.stack([lg.argmax(1) for lg in logits], 1) == labels
        loss_sum += float(per_level.sum(1).sum())  # TASK_WEIGHTS [1.0, 1.0]
        chain += int(hits.all(1).sum())
        for i in range(2):
            correct[i] += int(hits[:, i].sum())
            # the label among the 3 highest logits (the 3 shapes: every one)
            top3[i] += int((logits[i].argsort(1, descending=True)[:, :3] == labels[:, i, None]).any(1).sum())
        n += labels.shape[0]
    assert n == N_VAL
    return {
        "loss": loss_sum / n,
        "acc_shape": correct[0] / n,
        "acc_digit": correct[1] / n,
        "chain_acc": chain / n,
        "partial_chain_acc": chain / n,
        "acc3_shape": top3[0] / n,
        "acc3_digit": top3[1] / n,
    }


# -- final global_step equals the plan's total steps, and metrics.jsonl --------------------------
STEP_ROWS = [
    # 45 micro-batches per epoch, the last one holds 30 samples; 45 steps per epoch
    pytest.param((1, 32, False), id="accum1-bs32"),
    # 45 / 3 = 15 full accumulation windows per epoch
    pytest.param((3, 32, False), id="accum3-bs32"),
    # ceil(45 / 4) = 12: the trailing window of 1 micro-batch is an optimizer step
    pytest.param((4, 32, False), id="accum4-bs32"),
    # 1438 / 50 does not divide: 29 micro-batches, the last holds 38 samples
    pytest.param((1, 50, False), id="accum1-bs50"),
    # ceil(29 / 3) = 10: a trailing window of 2 micro-batches
    pytest.param((3, 50, False), id="accum3-bs50"),
    # ceil(29 / 4) = 8: a trailing window of 1 micro-batch
    pytest.param((4, 50, False), id="accum4-bs50"),
    # DATA.DROP_LAST: 28 full micro-batches (the 38 samples left over are dropped), ceil(28 / 3) = 10
    pytest.param((3, 50, True), id="accum3-bs50-droplast"),
]
STEP_EPOCHS = 2
STEP_LOG_INTERVAL = 7  # no row's total steps is a multiple of 7: the last step is logged on its own


def step_opts(base: Path, accum: int, batch: int, drop_last: bool) -> list[str]:
    return [
        "ENV.OUTPUT.BASE_DIR",
        str(base / "out"),
        "TRAIN.EPOCHS",
        str(STEP_EPOCHS),
        "TRAIN.ACCUMULATION_STEPS",
        str(accum),
        "DATA.BATCH_SIZE",
        str(batch),
        "SCHEDULE.METRICS.STEP_INTERVAL",
        str(STEP_LOG_INTERVAL),
        "DATA.DROP_LAST",
        "true" if drop_last else "false",
    ]


@pytest.fixture(scope="module", params=STEP_ROWS)
def step_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One training run per row, from inside a fresh directory (so that a stray relative write
    would show up in it)."""
    accum, batch, drop_last = request.param
    base = tmp_path_factory.mktemp(f"run-accum{accum}-bs{batch}")
    opts = step_opts(base, accum, batch, drop_last)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(base)
        rc = train_in_process(opts)
    return {
        "accum": accum,
        "batch": batch,
        "drop_last": drop_last,
        "epoch_samples": samples_per_epoch(N_TRAIN, batch, drop_last),
        "base": base,
        "out": base / "out" / NAME,
        "opts": opts,
        "rc": rc,
    }


@pytest.mark.slow
def test_final_global_step_equals_plan_total_steps(step_run: dict[str, Any]) -> None:
    assert step_run["rc"] == 0
    plan = plan_json("--no-series", "--opts", *step_run["opts"])
    accum, batch = step_run["accum"], step_run["batch"]
    batches = batches_per_epoch(N_TRAIN, batch, step_run["drop_last"])
    assert plan["world_size"] == 1
    assert plan["batches_per_epoch"] == batches
    assert plan["total_steps"] == math.ceil(batches / accum) * STEP_EPOCHS
    summary = read_summary(step_run["out"])
    assert summary["global_step"] == plan["total_steps"]
    assert summary["expected_total_steps"] == plan["total_steps"]
    assert summary["epoch"] == STEP_EPOCHS
    assert summary["samples_seen"] == STEP_EPOCHS * step_run["epoch_samples"]
    assert summary["status"] == "completed"
    assert summary["stop_reason"] is None
    # The best of the ranking metric (val/loss by default: lower is better) over the validations.
    vals = val_records(read_metrics(step_run["out"]))
    best = min(vals, key=lambda r: r["val/loss"])
    assert summary["best_metric"]["name"] == "val/loss"
    assert summary["best_metric"]["value"] == pytest.approx(best["val/loss"], rel=1e-12)
    assert summary["best_metric"]["step"] == best["global_step"]
    assert summary["last_validation"]["val/loss"] == pytest.approx(vals[-1]["val/loss"], rel=1e-12)


@pytest.mark.slow
def test_outputs_final_weights_and_assets(step_run: dict[str, Any]) -> None:
    assert step_run["rc"] == 0
    out = step_run["out"]
    config = load_config(CFG, step_run["opts"])
    train_data = build_dataset(config, "train")
    weights = load_file(str(out / "final" / "model.safetensors"))
    reference = build_model(config, train_data).state_dict()
    assert set(weights) == set(reference)
    for key, tensor in reference.items():
        assert weights[key].shape == tensor.shape, key
        assert torch.isfinite(weights[key]).all(), key
    model = build_model(config, train_data)
    model.load_state_dict(weights)  # strict: the unwrapped model's own keys
    # The schedule summary is the plan's human text for the same config.
    written = (out / "assets" / "schedule_summary.txt").read_text(encoding="utf-8")
    assert written == summary_text(report_settings(config), plan_for(config, 1, None))
    assert written == plan_text("--opts", *step_run["opts"])
    # The resolved config reads back as the same config.
    resolved = out / "assets" / "config.yaml"
    assert (
        yaml.safe_load(resolved.read_text(encoding="utf-8"))["TRAIN"]["ACCUMULATION_STEPS"]
        == (step_run["accum"])
    )
    assert load_config(resolved) == config


@pytest.mark.slow
def test_metrics_jsonl_steps_lr_samples_and_loss(step_run: dict[str, Any]) -> None:
    assert step_run["rc"] == 0
    plan = plan_json("--opts", *step_run["opts"])
    total = plan["total_steps"]
    lr_of_step = dict(zip(plan["series"]["step"], plan["series"]["lr"], strict=True))
    records = read_metrics(step_run["out"])
    trains = train_records(records)
    # At every multiple of STEP_INTERVAL and at the last step, once each, in order.
    expected_steps = [s for s in range(1, total + 1) if s % STEP_LOG_INTERVAL == 0 or s == total]
    assert [r["global_step"] for r in trains] == expected_steps
    for r in trains:
        step = r["global_step"]
        # the LR of the optimizer step that completed global_step (step index global_step - 1)
        assert r["lr/default"] == pytest.approx(lr_of_step[step - 1], rel=1e-12, abs=0.0), step
        assert r["samples_seen"] == expected_samples_seen(
            step, N_TRAIN, step_run["batch"], step_run["accum"], step_run["drop_last"]
        ), step
        for level in LEVELS:
            assert math.isfinite(r[f"train/loss_{level}"])
        assert r["train/loss"] == pytest.approx(sum(r[f"train/loss_{lv}"] for lv in LEVELS), rel=1e-5)
        assert r["perf/samples_per_s"] > 0
        assert 0.0 <= r["perf/data_time_share"] <= 1.0
        assert r["train/grad_norm"] >= 0.0
    assert trains[-1]["samples_seen"] == STEP_EPOCHS * step_run["epoch_samples"]
    assert trains[-1]["train/loss"] < trains[0]["train/loss"]
    # Validation at each completed epoch of the plan, at that epoch's last step.
    per_epoch = plan["optimizer_steps_per_epoch"]
    vals = val_records(records)
    assert [r["epoch"] for r in vals] == [float(e) for e in plan["events"]["validation"]]
    assert [r["global_step"] for r in vals] == [e * per_epoch for e in plan["events"]["validation"]]
    assert records[-1]["global_step"] == total


@pytest.mark.slow
def test_nothing_written_outside_the_output_dir(step_run: dict[str, Any]) -> None:
    assert step_run["rc"] == 0
    out = step_run["out"]
    outside = [p for p in files_under(step_run["base"]) if out not in p.parents]
    assert outside == []
    names = {p.relative_to(out).as_posix() for p in files_under(out)}
    assert {
        "summary.json",
        "metrics.jsonl",
        "final/model.safetensors",
        "assets/schedule_summary.txt",
        "assets/config.yaml",
    } <= names
    assert not any(name.endswith(".tmp") for name in names)


# -- validation passes (Python API) --------------------------------------------------------------
class RecordingAdamW(torch.optim.AdamW):
    """AdamW that records the LR of every update it makes."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        super().__init__(groups, lr=0.0, weight_decay=0.0)
        self.lrs: list[float] = []

    def step(self, closure: Any = None) -> Any:
        self.lrs.append(self.param_groups[0]["lr"])
        return super().step(closure)


VALIDATION_EPOCHS = 4


@pytest.mark.slow
def test_validation_passes_follow_ops_schedule_python_api(tmp_path: Path) -> None:
    opts = [
        "ENV.OUTPUT.BASE_DIR",
        str(tmp_path / "out"),
        "TRAIN.EPOCHS",
        str(VALIDATION_EPOCHS),
        "DATA.BATCH_SIZE",
        "64",
        "TRAIN.ACCUMULATION_STEPS",
        "2",  # 23 micro-batches: 12 optimizer steps per epoch, the last one a window of 1
        "SCHEDULE.VALIDATION.MASK_META_INTERVAL_EPOCHS",
        "2",
        "SCHEDULE.VALIDATION.PARTIAL_MASK_META.INTERVAL_EPOCHS",
        "2",
        # No metadata masking in training: the model leans on the metadata, so masking it at
        # validation changes the predictions.
        "SCHEDULE.META_MASKING.ENABLED",
        "false",
    ]
    plan = plan_json("--no-series", "--opts", *opts)
    events = plan["events"]
    assert events["validation"] == [1, 2, 3, 4]
    assert events["mask_meta_validation"] == [2, 4]
    assert events["partial_mask_meta_validation"] == [2]  # epoch 4: replaced by the exhaustive passes
    assert events["exhaustive_validation"] == [4]
    total = plan["total_steps"]
    assert plan["optimizer_steps_per_epoch"] == 12

    config = load_config(CFG, opts)
    train_data, val_data = build_dataset(config, "train"), build_dataset(config, "val")
    set_seed(config.EXPERIMENT.SEED)
    model = build_model(config, train_data)
    optimizers: list[RecordingAdamW] = []

    def optimizer(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        optimizers.append(RecordingAdamW(groups))
        return optimizers[-1]

    trainer = Trainer(config, model, train_data, val_data, optimizer=optimizer)
    result = trainer.fit()
    out = tmp_path / "out" / NAME
    assert result == read_summary(out)
    assert result["global_step"] == total
    assert result["status"] == "completed"
    # One optimizer update per global step, each with the plan's LR of that step: lr(0) first,
    # no lag, scaled by the effective batch, ending on MIN_LR (no LR scheduler drives it).
    (recorded,) = optimizers
    assert len(recorded.lrs) == total
    assert recorded.lrs == pytest.approx([trainer.plan.lr(k) for k in range(total)], rel=1e-12)
    assert recorded.lrs[-1] == pytest.approx(config.LR_SCHEDULER.MIN_LR)
    series = plan_json("--opts", *opts)["series"]
    assert recorded.lrs == pytest.approx(series["lr"], rel=1e-12)

    vals = val_records(read_metrics(out))
    assert [r["epoch"] for r in vals] == [1.0, 2.0, 3.0, 4.0]
    per_epoch = plan["optimizer_steps_per_epoch"]
    assert [r["global_step"] for r in vals] == [e * per_epoch for e in range(1, 5)]
    literal = {
        1: {"val"},
        2: {"val", "val_mask_meta", *WHITELIST},
        3: {"val"},
        4: {"val", "val_mask_meta", *EXHAUSTIVE},
    }
    for record in vals:
        epoch = int(record["epoch"])
        passes = pass_prefixes(record)
        assert passes == expected_passes(events, epoch, WHITELIST) == literal[epoch], epoch
        assert set(record) == {"global_step", "epoch"} | {f"{p}/{m}" for p in passes for m in VAL_METRICS}
        for p in passes:
            assert math.isfinite(record[f"{p}/loss"])
            assert record[f"{p}/loss"] > 0
            for m in VAL_METRICS[1:]:
                assert 0.0 <= record[f"{p}/{m}"] <= 1.0
        # Each masked pass sees other inputs than the standard pass: its loss differs.
        losses = {p: record[f"{p}/loss"] for p in passes}
        for p in passes - {"val"}:
            assert abs(losses[p] - losses["val"]) > 1e-9, (epoch, p, losses)
        assert len({round(v, 9) for v in losses.values()}) == len(losses), losses

    # The final weights are the trained model's, unwrapped.
    saved = load_file(str(out / "final" / "model.safetensors"))
    live = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    assert set(saved) == set(live)
    for key, tensor in live.items():
        assert torch.equal(saved[key], tensor.detach().cpu()), key

    # The final epoch's metrics, recomputed here from the saved weights, each sample once.
    fresh = build_model(config, train_data)
    fresh.load_state_dict(saved)
    final = vals[-1]
    for p in pass_prefixes(final):
        mine = evaluate(fresh, val_data, masked_components(p))
        for m in VAL_METRICS:
            assert final[f"{p}/{m}"] == pytest.approx(mine[m], rel=1e-5, abs=1e-6), (p, m)


# -- early stopping ------------------------------------------------------------------------------
def test_max_steps_stops_exactly_with_final_validation(tmp_path: Path) -> None:
    max_steps = 17  # batch 128: 12 steps per epoch, so step 17 is in the middle of epoch 2
    opts = [
        "ENV.OUTPUT.BASE_DIR",
        str(tmp_path / "out"),
        "TRAIN.EPOCHS",
        "3",
        "DATA.BATCH_SIZE",
        "128",
        "SCHEDULE.METRICS.STEP_INTERVAL",
        "5",
        "TRAIN.EARLY_STOP.ACTIVE",
        "true",
        "TRAIN.EARLY_STOP.MAX_STEPS",
        str(max_steps),
        "TRAIN.EARLY_STOP.PATIENCE_STEPS",
        "null",
    ]
    plan = plan_json("--no-series", "--opts", *opts)
    per_epoch = plan["optimizer_steps_per_epoch"]
    assert per_epoch == 12
    assert max_steps % per_epoch != 0
    assert plan["total_steps"] == 36  # a cut-off, not a shorter run
    assert train_in_process(opts) == 0
    out = tmp_path / "out" / NAME
    summary = read_summary(out)
    stop_epoch = max_steps // per_epoch + 1
    assert summary["global_step"] == max_steps
    assert summary["status"] == "early_stopped"
    assert summary["stop_reason"] == "max_steps"
    assert summary["epoch"] == stop_epoch - 1  # completed epochs: the cut-off leaves epoch 2 incomplete
    assert summary["samples_seen"] == expected_samples_seen(max_steps, N_TRAIN, 128, 1)
    assert summary["expected_total_steps"] == 36
    assert (out / "final" / "model.safetensors").is_file()
    records = read_metrics(out)
    assert max(r["global_step"] for r in records) == max_steps
    trains = train_records(records)
    # the window cut short by MAX_STEPS is logged too, at the last step
    assert [r["global_step"] for r in trains] == [5, 10, 15, max_steps]
    vals = val_records(records)
    assert [(r["global_step"], r["epoch"]) for r in vals] == [(12, 1.0), (max_steps, float(stop_epoch))]
    # The cut-off boundary is the final one: standard validation and the exhaustive passes.
    assert {"val", *EXHAUSTIVE} <= pass_prefixes(vals[-1])
    assert summary["last_validation"]["val/loss"] == pytest.approx(vals[-1]["val/loss"], rel=1e-12)


@pytest.mark.parametrize(
    "patience",
    [
        15,  # global steps, not a multiple of the 12 steps per epoch: stops at 36 (36 - 12 >= 15)
        24,  # exactly two epochs after the best: stops at 36 too (waited >= PATIENCE_STEPS)
    ],
)
def test_patience_stops_at_first_validation_past_patience(tmp_path: Path, patience: int) -> None:
    opts = [
        "ENV.OUTPUT.BASE_DIR",
        str(tmp_path / "out"),
        "TRAIN.EPOCHS",
        "6",
        "DATA.BATCH_SIZE",
        "128",
        "TRAIN.EARLY_STOP.ACTIVE",
        "true",
        "TRAIN.EARLY_STOP.METRIC",
        "val/loss",
        "TRAIN.EARLY_STOP.PATIENCE_STEPS",
        str(patience),
        "TRAIN.EARLY_STOP.MIN_DELTA",
        "10.0",  # only the first validation is ever an improvement
    ]
    plan = plan_json("--no-series", "--opts", *opts)
    per_epoch = plan["optimizer_steps_per_epoch"]
    assert plan["events"]["validation"] == [1, 2, 3, 4, 5, 6]
    step_of_best = per_epoch  # the first validation, after epoch 1
    stop_step = next(e * per_epoch for e in range(1, 7) if e * per_epoch >= step_of_best + patience)
    assert stop_step < plan["total_steps"]
    assert train_in_process(opts) == 0
    out = tmp_path / "out" / NAME
    summary = read_summary(out)
    assert summary["global_step"] == stop_step
    assert summary["epoch"] == stop_step // per_epoch
    assert summary["samples_seen"] == (stop_step // per_epoch) * N_TRAIN
    assert summary["status"] == "early_stopped"
    assert summary["stop_reason"] == "patience"
    records = read_metrics(out)
    assert max(r["global_step"] for r in records) == stop_step
    assert [r["global_step"] for r in val_records(records)] == list(
        range(per_epoch, stop_step + 1, per_epoch)
    )
    assert (out / "final" / "model.safetensors").is_file()


# -- the default config trains ---------------------------------------------------------------------
@pytest.mark.slow
def test_default_config_trains_to_stated_accuracy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    opts = ["ENV.OUTPUT.BASE_DIR", str(tmp_path / "out")]
    plan = plan_json("--no-series", "--opts", *opts)
    capsys.readouterr()
    assert train_in_process(opts) == 0
    captured = capsys.readouterr()
    shown = captured.out + captured.err
    out = tmp_path / "out" / NAME
    summary = read_summary(out)
    assert summary["global_step"] == plan["total_steps"] == 900
    assert summary["status"] == "completed"
    assert summary["samples_seen"] == 20 * N_TRAIN
    # The README states about 95% of digits, and about 87% with all metadata masked: the metadata
    # carries what the hidden bottom half of each image would show.
    assert summary["last_validation"]["val/acc_digit"] >= 0.93
    assert (
        summary["last_validation"]["val_mask_meta/acc_digit"]
        <= summary["last_validation"]["val/acc_digit"] - 0.03
    )
    last_val = val_records(read_metrics(out))[-1]
    assert last_val["global_step"] == 900
    assert last_val["val/acc_digit"] >= 0.93
    # What the user sees: the schedule summary, a progress bar, validation results, the accuracy.
    assert (out / "assets" / "schedule_summary.txt").read_text(encoding="utf-8") in shown
    assert "900/900" in shown
    assert "epoch 20: val/loss" in shown
    assert "completed at step 900 (epoch 20): " in captured.out
    assert f"val/acc_digit {summary['last_validation']['val/acc_digit']:.4f}" in captured.out


# -- Weights & Biases and TensorBoard: tests/test_trackers.py ---------------------------------


# -- refusals ------------------------------------------------------------------------------------
def test_config_error_exits_2_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    rc = train_in_process(["ENV.OUTPUT.BASE_DIR", str(tmp_path / "out"), "TRAIN.EPOCHS", "0"])
    assert rc == 2
    assert "TRAIN.EPOCHS" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []


def test_rerunning_a_finished_run_does_nothing_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Schedulers requeue jobs: the command of a completed run, run again, changes nothing."""
    opts = ["ENV.OUTPUT.BASE_DIR", str(tmp_path / "out"), "TRAIN.EPOCHS", "1", "DATA.BATCH_SIZE", "256"]
    assert train_in_process(opts) == 0
    out = tmp_path / "out" / NAME
    assert read_summary(out)["status"] == "completed"
    before = {p: p.read_bytes() for p in files_under(tmp_path)}
    capsys.readouterr()
    assert train_in_process(opts) == 0
    said = capsys.readouterr().out
    assert f"{out} already holds a run completed at step" in said, said
    assert "nothing to do" in said, said
    assert {p: p.read_bytes() for p in files_under(tmp_path)} == before  # untouched
    # In Python (a notebook) too: fit() says so, and returns the finished run's summary.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    config = load_config(CFG, opts)
    data = build_dataset(config, "train")
    summary = Trainer(config, build_model(config, data), data).fit()
    assert summary["already_finished"]
    assert summary["status"] == "completed"
    assert f"{out} already holds a run completed at step" in capsys.readouterr().out


def test_interrupted_output_dir_is_refused_without_auto_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run directory that holds only metrics.jsonl (a run killed before its first checkpoint) is
    left alone when TRAIN.AUTO_RESUME is false."""
    out = tmp_path / "out" / NAME
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"global_step": 5, "train/loss": 1.0}\n', encoding="utf-8")
    before = {p: p.read_bytes() for p in files_under(tmp_path)}
    opts = ["ENV.OUTPUT.BASE_DIR", str(tmp_path / "out"), "TRAIN.EPOCHS", "1", "DATA.BATCH_SIZE", "256"]
    rc = train_in_process([*opts, "TRAIN.AUTO_RESUME", "false"])
    assert rc == 2
    assert "TRAIN.AUTO_RESUME" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in files_under(tmp_path) if p.name != ".lock"} == before
    assert sorted(p.name for p in out.iterdir()) == [".lock", "metrics.jsonl"]  # the lock's (empty) file


def test_run_killed_before_its_first_checkpoint_starts_over(tmp_path: Path) -> None:
    """With TRAIN.AUTO_RESUME (the default) and no checkpoint to resume from, the run starts over and
    what the killed run logged is dropped, so metrics.jsonl has no step twice."""
    out = tmp_path / "out" / NAME
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"global_step": 5, "train/loss": 123.0}\n', encoding="utf-8")
    rc = train_in_process(
        ["ENV.OUTPUT.BASE_DIR", str(tmp_path / "out"), "TRAIN.EPOCHS", "1", "DATA.BATCH_SIZE", "256"]
    )
    assert rc == 0
    records = read_metrics(out)
    assert all(r.get("train/loss") != 123.0 for r in records)
    steps = [r["global_step"] for r in train_records(records)]
    assert len(steps) == len(set(steps))


def test_overwrite_starts_a_finished_run_again_from_scratch(tmp_path: Path) -> None:
    """``--overwrite`` is the explicit way to reuse a directory: the old run's files are removed,
    so metrics.jsonl and the checkpoints are the new run's alone."""
    opts = ["ENV.OUTPUT.BASE_DIR", str(tmp_path / "out"), "TRAIN.EPOCHS", "1", "DATA.BATCH_SIZE", "256"]
    assert train_in_process(opts) == 0
    out = tmp_path / "out" / NAME
    (out / "checkpoints" / "step_00009999").mkdir()  # something only the old run could have left
    reset_accelerate()
    try:
        rc = main(["train", "--cfg", CFG, "--overwrite", "--opts", *opts])
    finally:
        reset_accelerate()
    assert rc == 0
    assert not (out / "checkpoints" / "step_00009999").exists()
    steps = [r["global_step"] for r in train_records(read_metrics(out))]
    assert len(steps) == len(set(steps))
    assert read_summary(out)["status"] == "completed"


def test_bf16_autocast_through_accelerate_on_cpu_and_run_info(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mixed precision the Accelerate way (``accelerate launch --mixed_precision bf16`` sets this
    variable): the run trains under bf16 autocast on the CPU, its losses stay finite, and
    ``assets/run_info.json`` and ``summary.json`` record the precision, processes, versions and
    the git commit of the working directory."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    opts = ["ENV.OUTPUT.BASE_DIR", str(tmp_path / "out"), "TRAIN.EPOCHS", "2", "DATA.BATCH_SIZE", "128"]
    assert train_in_process(opts) == 0
    out = tmp_path / "out" / NAME
    summary = read_summary(out)
    assert summary["status"] == "completed"
    assert all(math.isfinite(r["train/loss"]) for r in train_records(read_metrics(out)))
    info = json.loads((out / "assets" / "run_info.json").read_text(encoding="utf-8"))
    assert summary["run_info"] == info
    assert (info["mixed_precision"], info["world_size"], info["distributed_type"]) == ("bf16", 1, "NO")
    assert info["versions"]["torch"] == torch.__version__
    assert info["versions"]["accelerate"] == accelerate.__version__
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    assert info["git"] == (
        None if head.returncode else {"commit": head.stdout.strip(), "dirty": info["git"]["dirty"]}
    )


def test_fp16_steps_the_gradient_scaler_skips_are_counted_and_still_advance_the_schedule(
    tmp_path: Path,
) -> None:
    """fp16 the Accelerate way, emulated where Accelerate does not go: ``Accelerator(
    mixed_precision="fp16")`` on a CPU keeps the precision but creates no GradScaler and no
    autocast (accelerator.py: fp16 AMP only when ``device.type != "cpu"``). The two attributes it
    sets on a GPU are set here, to torch's real CPU GradScaler; everything else is Accelerate's own
    fp16 path: the float16 autocast around forward, ``backward`` scaling the loss,
    ``clip_grad_norm_`` unscaling, ``AcceleratedOptimizer.step`` through the scaler and its
    ``step_was_skipped``. An initial scale of 2^24 overflows the float16 backward until the scaler
    has halved it enough: those steps are skipped, counted in ``train/skipped_steps``, and still
    advance the global step (the LR schedule and the plan go on as if they had been taken)."""
    from accelerate import Accelerator

    config = load_config(
        CFG,
        [
            "ENV.OUTPUT.BASE_DIR",
            str(tmp_path / "out"),
            "TRAIN.EPOCHS",
            "1",
            "SCHEDULE.METRICS.STEP_INTERVAL",
            "5",
        ],
    )
    init_scale = 2.0**24
    accelerator = Accelerator(mixed_precision="fp16", gradient_accumulation_steps=config.TRAIN.accumulation)
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    train_data, val_data = build_dataset(config, "train"), build_dataset(config, "val")
    torch.manual_seed(0)
    trainer = Trainer(config, build_model(config, train_data), train_data, val_data, accelerator=accelerator)
    summary = trainer.fit()
    out = tmp_path / "out" / NAME
    records = train_records(read_metrics(out))
    skipped = math.log2(init_scale / accelerator.scaler.get_scale())  # each skip halves the scale
    assert skipped >= 3, skipped
    assert records[-1]["train/skipped_steps"] == skipped
    assert [r["train/skipped_steps"] for r in records] == sorted(r["train/skipped_steps"] for r in records)
    assert records[0]["train/skipped_steps"] == min(skipped, 5)  # the first window: steps 1-5
    plan = plan_for(config, 1, N_TRAIN)
    assert summary["global_step"] == plan.total_steps  # skipped steps count: the schedule follows the data
    assert all(r["lr/default"] == pytest.approx(plan.lr(r["global_step"] - 1, 0)) for r in records)
    assert summary["run_info"]["mixed_precision"] == "fp16"
