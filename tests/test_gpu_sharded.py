"""FSDP2 and DeepSpeed ZeRO-3 end to end on 2 GPUs, through the shipped accelerate config files.

Accelerate selects FSDP and DeepSpeed only on accelerators (``AcceleratorState`` switches the
distributed type to FSDP or DEEPSPEED only from MULTI_GPU and its kin, never from MULTI_CPU), so
this module runs on a machine with 2 CUDA GPUs and skips everywhere else, this project's CI machines
included (they have none). It is not the evidence that sharding works here: that is the CPU tests
(``test_sharded_checkpoints`` for sharded checkpoints through our store on torch's FSDP2 with 2 gloo
processes, ``test_backends`` and ``test_accelerate_configs`` for what Accelerate is handed) and a
review of every sharding-specific line.

Each run: a tiny causal LM (``configs/lm_tiny.yaml`` shrunk) trains on 2 GPUs under the config
file; a second run is killed (SIGKILL) right after a checkpoint commits and resumed, and must end at
the same step with the same weights as the uninterrupted run (within bf16 tolerance: GPU kernels
need not be bitwise deterministic). The sharded checkpoint's files (every rank's) are in its
manifest, and ``final/model.safetensors`` holds the full weights under the model's own names.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.configs import LM_CFG, REPO
from helpers.processes import free_port

CONFIGS = REPO / "accelerate_configs"

# Accelerate selects FSDP and DeepSpeed only on accelerators; on CPU the sharded checkpoints are
# tested with torch's FSDP2 on gloo (test_sharded_checkpoints.py).
pytestmark = [pytest.mark.slow, pytest.mark.gpu(count=2)]

TINY = [
    "DATA.BATCH_SIZE", "8",
    "MODEL.OPTIONS.hidden_size", "64",
    "MODEL.OPTIONS.intermediate_size", "128",
    "MODEL.OPTIONS.num_hidden_layers", "2",
    "MODEL.OPTIONS.num_attention_heads", "2",
    "TRAIN.TARGET_TOKENS", str(60 * 2 * 8 * 128),  # 60 optimizer steps on 2 processes
    "SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "20",
    "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null",
    "SCHEDULE.CHECKPOINT.MID_EPOCH", "true",
    "SCHEDULE.CHECKPOINT.KEEP_LAST_N", "3",
    "SCHEDULE.METRICS.STEP_INTERVAL", "5",
    "TRAIN.CLIP_GRAD", "1.0",
]  # fmt: skip


def launch(
    config_file: str, out: Path, kill_at: str | None = None, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LINNAEUS_ACCEL_"))}
    env.update(HF_HOME=str(out.parent / "hf_home"), WANDB_MODE="offline", CUDA_VISIBLE_DEVICES="0,1")
    if kill_at:
        env["LINNAEUS_ACCEL_KILL_AT"] = kill_at
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(CONFIGS / config_file), "--num_processes", "2",
        "--main_process_port", str(free_port()),
        "-m", "linnaeus_accel", "train", "--cfg", str(LM_CFG),
        "--opts", "ENV.OUTPUT.BASE_DIR", str(out), "EXPERIMENT.NAME", "run", *TINY, *extra,
    ]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "final" / "model.safetensors")


def model_names() -> dict[str, torch.Size]:
    """The unwrapped model's own parameter names and full shapes (built on the CPU from the config)."""
    from linnaeus_accel.config import load_config
    from linnaeus_accel.data import build_dataset
    from linnaeus_accel.models import build_model

    config = load_config(LM_CFG, TINY)
    model = build_model(config, build_dataset(config, "train"))
    return {name: tensor.shape for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize(
    ("config_file", "sharded_dir"),
    [
        ("fsdp2_full_shard.yaml", "pytorch_model_fsdp_0"),  # DCP: one .distcp file per rank
        ("deepspeed_zero3.yaml", "pytorch_model"),  # DeepSpeed's own: one optimizer shard per rank
    ],
)
def test_sharded_run_resumes_and_gathers_full_weights(
    tmp_path: Path, config_file: str, sharded_dir: str
) -> None:
    if config_file.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs the deepspeed package (pip install deepspeed)")
    reference = launch(config_file, tmp_path / "ref")
    assert reference.returncode == 0, reference.stderr[-4000:]
    ref_dir = tmp_path / "ref" / "run"
    summary = json.loads((ref_dir / "summary.json").read_text(encoding="utf-8"))
    assert (summary["status"], summary["global_step"]) == ("completed", 60), summary
    assert summary["run_info"]["distributed_type"] == ("FSDP" if "fsdp" in config_file else "DEEPSPEED")
    assert summary["run_info"]["world_size"] == 2

    # Every rank's shard of the newest checkpoint is in its manifest.
    checkpoint = sorted((ref_dir / "checkpoints").glob("step_*"))[-1]
    listed = {entry["path"] for entry in json.loads((checkpoint / "COMMITTED.json").read_text())["files"]}
    shards = {
        p.relative_to(checkpoint).as_posix() for p in (checkpoint / sharded_dir).rglob("*") if p.is_file()
    }
    assert shards, f"no {sharded_dir}/ in {checkpoint}"
    assert shards <= listed
    assert {"rank_00000.json", "rank_00001.json"} <= listed

    # Full weights under the model's own names: no "module.", "_orig_mod." or FSDP prefixes.
    weights, names = final_weights(ref_dir), model_names()
    assert {n: w.shape for n, w in weights.items()} == {n: s for n, s in names.items() if n in weights}
    assert set(names) - set(weights) <= {"lm_head.weight"}  # tied to the embedding: saved once
    # ... in the layout transformers loads: every tensor, the tied one tied back.
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(ref_dir / "final", output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info

    # Killed right after the step-40 checkpoint commits, then resumed: the same run.
    killed = launch(config_file, tmp_path / "kill", kill_at="checkpoint_committed:2")
    assert killed.returncode != 0
    resumed = launch(config_file, tmp_path / "kill")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    run_dir = tmp_path / "kill" / "run"
    assert json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))["global_step"] == 60
    got = final_weights(run_dir)
    for name, want in weights.items():
        torch.testing.assert_close(got[name].float(), want.float(), rtol=2e-2, atol=2e-3, msg=name)


@pytest.mark.parametrize("config_file", ["fsdp2_full_shard.yaml", "deepspeed_zero3.yaml"])
def test_ema_is_refused_where_the_weights_are_sharded(tmp_path: Path, config_file: str) -> None:
    """ema keeps a whole copy of the weights: under FSDP or ZeRO-3 it exits 2 naming CALLBACKS
    before the first step, instead of averaging shards it could not save as a model."""
    if config_file.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs the deepspeed package (pip install deepspeed)")
    done = launch(config_file, tmp_path, extra=("CALLBACKS", "[{NAME: ema}]"))
    assert done.returncode != 0  # each process exits 2; accelerate launch reports 1
    assert "ema keeps a whole copy of the weights" in done.stderr, done.stderr[-4000:]
    assert "CALLBACKS" in done.stderr
    assert not list((tmp_path / "run").glob("checkpoints/step_*"))


@pytest.mark.parametrize("config_file", ["fsdp2_full_shard.yaml", "deepspeed_zero3.yaml"])
def test_lora_is_refused_where_the_weights_are_sharded(tmp_path: Path, config_file: str) -> None:
    """A LoRA adapter's frozen/trainable split is not supported under FSDP or ZeRO-3 yet: exit
    before the first step naming MODEL.OPTIONS.lora."""
    if config_file.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs the deepspeed package (pip install deepspeed)")
    done = launch(config_file, tmp_path, extra=("MODEL.OPTIONS.lora", "{r: 4}"))
    assert done.returncode != 0  # each process exits 2; accelerate launch reports 1
    assert "MODEL.OPTIONS.lora: LoRA is not supported under" in done.stderr, done.stderr[-4000:]
