"""The "Precision, compile and accumulation" table of docs/guides/precision.md, each row run as written: Accelerate's
environment variables for one process on the command line, an ``Accelerator`` handed to the
``Trainer`` in a notebook, and config keys; ``run_info`` records what the run used."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.configs import DEFAULT_CONFIG, LM_CFG, SMALL_LM
from helpers.in_process import reset_accelerate, run_cli

from linnaeus_accel import Trainer
from linnaeus_accel.config import load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.models import build_model

SHORT = ["TRAIN.EPOCHS", "1", "DATA.BATCH_SIZE", "256"]  # 6 steps of the default run
# Compiling is what costs: the one-level classifier (one graph), 2 steps, no validation (whose eval
# mode would compile again).
COMPILED_CFG = DEFAULT_CONFIG.parent / "digits_classification.yaml"
TRAIN_ONLY = ["TRAIN.STEPS", "2", "TRAIN.EPOCHS", "null", "SCHEDULE.VALIDATION.INTERVAL_EPOCHS", "null"]


def cli_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    *opts: str,
    cfg: Path = DEFAULT_CONFIG,
) -> dict[str, Any]:
    """``<env> linnaeus-accel train --cfg <cfg> --opts ...``; its summary.json."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    reset_accelerate()
    try:
        rc, out, err = run_cli(
            "train",
            "--cfg",
            str(cfg),
            "--opts",
            "ENV.OUTPUT.BASE_DIR",
            str(tmp_path),
            *SHORT,
            *opts,
        )
    finally:
        reset_accelerate()
    assert rc == 0, out + err
    (summary_file,) = tmp_path.glob("*/summary.json")
    summary: dict[str, Any] = json.loads(summary_file.read_text())
    return summary


def notebook_run(tmp_path: Path, *opts: str, cfg: Path = DEFAULT_CONFIG, **accelerator: Any) -> Trainer:
    """``Trainer(config, model, data, accelerator=Accelerator(**accelerator)).fit()``."""
    from accelerate import Accelerator

    reset_accelerate()
    config = load_config(cfg, ["ENV.OUTPUT.BASE_DIR", str(tmp_path), *SHORT, *opts])
    train, val = build_dataset(config, "train"), build_dataset(config, "val")
    trainer = Trainer(config, build_model(config, train), train, val, accelerator=Accelerator(**accelerator))
    try:
        trainer.fit()
    finally:
        reset_accelerate()
    return trainer


def run_info(trainer: Trainer) -> dict[str, Any]:
    return json.loads((trainer.config.output_dir / "assets" / "run_info.json").read_text())  # type: ignore[no-any-return]


def test_bf16_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert (
        cli_run(tmp_path, monkeypatch, {"ACCELERATE_MIXED_PRECISION": "bf16"})["run_info"]["mixed_precision"]
        == "bf16"
    )


@pytest.mark.slow
def test_bf16_and_torch_compile_from_an_accelerator(tmp_path: Path) -> None:
    """The notebook column's bf16 and torch.compile rows in one run (inductor compiles for ~15 s on
    a CPU, so once). ACCELERATE_DYNAMO_BACKEND on the command line: test_reliability's compiled
    run, killed and resumed."""
    trainer = notebook_run(
        tmp_path, *TRAIN_ONLY, cfg=COMPILED_CFG, mixed_precision="bf16", dynamo_backend="inductor"
    )
    info = run_info(trainer)
    assert (info["mixed_precision"], info["dynamo_backend"]) == ("bf16", "INDUCTOR")
    assert type(trainer.model).__name__ == "OptimizedModule"


def test_fp16_from_the_environment_and_from_an_accelerator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    summary = cli_run(tmp_path / "cli", monkeypatch, {"ACCELERATE_MIXED_PRECISION": "fp16"})
    assert summary["run_info"]["mixed_precision"] == "fp16"
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    assert run_info(notebook_run(tmp_path / "notebook", mixed_precision="fp16"))["mixed_precision"] == "fp16"


def test_accumulation_from_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = cli_run(tmp_path, monkeypatch, {}, "TRAIN.ACCUMULATION_STEPS", "2")
    assert summary["global_step"] == 3  # 6 micro-batches, 2 per optimizer step


def test_activation_checkpointing_from_the_command_line_trains_the_same_weights(tmp_path: Path) -> None:
    """``--opts MODEL.OPTIONS.gradient_checkpointing true``: the forward is recomputed in the
    backward, so the trained weights are those of the run without it."""

    finals = []
    for checkpointing in ("false", "true"):
        out = tmp_path / checkpointing
        opts = [*SMALL_LM, "TRAIN.TARGET_TOKENS", str(5 * 8 * 128), "ENV.OUTPUT.BASE_DIR", str(out)]
        reset_accelerate()
        try:
            rc, stdout, err = run_cli(
                "train",
                "--cfg",
                LM_CFG,
                "--opts",
                *opts,
                "MODEL.OPTIONS.gradient_checkpointing",
                checkpointing,
            )
        finally:
            reset_accelerate()
        assert rc == 0, stdout + err
        finals.append((out / "lm_tiny" / "final" / "model.safetensors").read_bytes())
    assert finals[0] == finals[1]
