"""The examples the README points to run as documented."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import psutil  # type: ignore[import-untyped]  # an Accelerate dependency
import pytest
from helpers.configs import DEFAULT_CONFIG, REPO
from helpers.in_process import run_cli
from helpers.processes import accelerate_launch_command, launch_env

from linnaeus_accel.config import load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.models import build_model


@pytest.mark.slow
def test_custom_model_example_trains_the_registered_model(tmp_path: Path) -> None:
    """The README's command (plus a shorter run) trains the registered model into the example's
    own run directory, beside a default run's, not into it."""
    cmd = [
        sys.executable,
        str(REPO / "examples" / "custom_model.py"),
        "--cfg",
        str(DEFAULT_CONFIG),
        "--opts",
        "TRAIN.EPOCHS",
        "1",
        "ENV.OUTPUT.BASE_DIR",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (tmp_path / "digits_default").exists()  # the default run's directory stays the default run's
    run = tmp_path / "custom_model"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["global_step"] == 45  # ceil(1438 / 32) steps in the one epoch
    assert "completed at step 45" in done.stdout
    assert "TYPE: tiny_linear" in (run / "assets" / "config.yaml").read_text(encoding="utf-8")
    # The user's --opts come after the example's defaults, so they win.
    example = load_example("custom_model")
    arguments = example.train_arguments(
        ["--cfg", "c.yaml", "--opts", "EXPERIMENT.NAME", "mine", "--overwrite"]
    )
    assert arguments[:3] == ["train", "--cfg", "c.yaml"]
    assert arguments[-1] == "--overwrite"
    opts = arguments[arguments.index("--opts") + 1 : -1]
    assert opts.index("mine") > opts.index("custom_model")
    assert example.train_arguments(["--cfg", "c.yaml"])[-4:] == example.EXAMPLE_OPTS


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass of the example looks its module up there
    spec.loader.exec_module(module)
    return module


def run_to_end(command: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run a launch to its end; past ``timeout``, kill it with every worker it started (a launcher
    killed alone leaves its workers running) and fail showing what it printed."""
    proc = subprocess.Popen(
        command, cwd=cwd, env=launch_env(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(
            f"{command[:4]} ran past {timeout} s\n--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-3000:]}"
        )
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def train_lm_example(tmp_path: Path, out: str, processes: int, accumulation: int) -> dict[str, Any]:
    args = [str(REPO / "examples" / "train_lm.py"), "--output", str(tmp_path / out), "--epochs", "2"]
    args += ["--batch-size", "8", "--accumulation", str(accumulation), "--limit", "96", "--log-every", "1"]
    launcher = accelerate_launch_command(processes) if processes > 1 else [sys.executable]
    done = run_to_end([*launcher, *args], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / out / "train_lm_example"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {
        "summary": json.loads((run / "summary.json").read_text()),
        "metrics": [json.loads(x) for x in lines],
    }


@pytest.mark.slow
def test_train_lm_example_on_two_processes_matches_one_process_accumulating_two(tmp_path: Path) -> None:
    """The user's own script under `accelerate launch` (2 CPU processes, accumulation 1) and alone
    (accumulation 2): each step holds the same 16 padded paragraphs, so the same target tokens,
    the same loss per step (a mean over tokens, not over micro-batches) and the same count."""
    two = train_lm_example(tmp_path, "two", processes=2, accumulation=1)
    one = train_lm_example(tmp_path, "one", processes=1, accumulation=2)
    paragraphs = load_example("train_lm").Paragraphs("train", limit=96)
    # Counted here: every byte after a paragraph's first is a target, in each of the 2 epochs.
    expected_tokens = 2 * sum(len(p) - 1 for p in paragraphs.items)
    assert two["summary"]["tokens_seen"] == one["summary"]["tokens_seen"] == expected_tokens
    train2 = [r for r in two["metrics"] if "train/loss" in r]
    train1 = [r for r in one["metrics"] if "train/loss" in r]
    assert [r["global_step"] for r in train2] == [r["global_step"] for r in train1] == list(range(1, 13))
    assert [r["tokens_seen"] for r in train2] == [r["tokens_seen"] for r in train1]
    for a, b in zip(train2, train1, strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5, abs=1e-6), a["global_step"]
    val2 = [r["val/loss"] for r in two["metrics"] if "val/loss" in r]
    val1 = [r["val/loss"] for r in one["metrics"] if "val/loss" in r]
    assert val2 == pytest.approx(val1, rel=1e-5)
    assert val2[-1] < val2[0]  # it learns


NANOGPT_CONFIG = REPO / "examples" / "nanogpt.yaml"


def nanogpt_lr(it: int, learning_rate: float, warmup_iters: int, lr_decay_iters: int, min_lr: float) -> float:
    """nanoGPT's ``get_lr`` (train.py), as it is written there."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def test_nanogpt_recipe_has_nanogpts_lr_at_every_step() -> None:
    """The recipe that says it is nanoGPT's warms up as nanoGPT does: its first update is not at LR 0."""
    args = ["plan", "--cfg", str(NANOGPT_CONFIG), "--dataset-size", "6292", "--tokens-per-sample", "64"]
    rc, out, err = run_cli(*args)
    assert rc == 0, err
    assert "warmup 100 steps (10.0%) from 9.9e-06; cosine decay 900 steps from step 100 to 999." in out
    rc, out, err = run_cli(*args, "--json")
    assert rc == 0, err
    lrs = json.loads(out)["series"]["lr"]
    lr = load_config(NANOGPT_CONFIG).LR_SCHEDULER
    assert lr.REFERENCE_BS is None  # learning_rate as written
    assert lrs[0] == pytest.approx(1e-3 / 101, rel=1e-12)
    expected = [nanogpt_lr(it, lr.BASE_LR, 100, 1000, lr.MIN_LR) for it in range(1000)]
    assert lrs == pytest.approx(expected, rel=1e-12)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_nanogpt_example_refuses_token_files_that_do_not_say_their_vocabulary(tmp_path: Path) -> None:
    """nanoGPT's own .bin (uint16, no sidecar) says nothing of its vocabulary: the example names the
    key instead of building a 257-row model for 65 characters."""
    load_example("nanogpt_model")  # registers MODEL.TYPE nanogpt
    tokens = tmp_path / "train.bin"
    (np.arange(20_000) % 65).astype("<u2").tofile(tokens)  # shakespeare_char's 65 characters
    out = tmp_path / "out"
    opts = ["ENV.OUTPUT.BASE_DIR", str(out), "TRAIN.STEPS", "1", "DATA.DATASET.NAME", "token_files"]
    opts += ["DATA.DATASET.OPTIONS", f"{{paths: ['{tokens}'], seq_len: 65, dtype: uint16}}"]
    rc, _, err = run_cli("train", "--cfg", str(NANOGPT_CONFIG), "--opts", *opts)
    assert rc == 2, err[-2000:]
    assert "MODEL.OPTIONS.vocab_size: nanogpt: the data does not say its vocabulary size" in err
    assert "DATA.DATASET.OPTIONS.vocab_size" in err
    assert not (out / "nanogpt").exists()  # refused before anything is written
    # Given either way, the model has the vocabulary given.
    for key in ("MODEL.OPTIONS.vocab_size", "DATA.DATASET.OPTIONS.vocab_size"):
        config = load_config(NANOGPT_CONFIG, [*opts, key, "65"])
        model = build_model(config, build_dataset(config, "train"))
        assert model.state_dict()["token_embedding.weight"].shape[0] == 65, key  # one row per id
