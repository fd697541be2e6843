"""What the trainer refuses at start-up for the distributed backend Accelerate runs
(``linnaeus_accel.training.start.backends``), as a table of DeepSpeed config dicts (the shape
``DeepSpeedPlugin.deepspeed_config`` has; ``test_accelerate_configs`` checks the shipped files give
none of these problems) and backends.

Accelerate selects FSDP and DeepSpeed only on accelerators, so on this CPU-only machine the checks
are called with the backend's kind and config; on 1 CPU process the whole Trainer is checked too.
"""

from __future__ import annotations

from typing import Any

import pytest
from accelerate.utils import DistributedType
from helpers.configs import DEFAULT_CONFIG

from linnaeus_accel.config import load_config
from linnaeus_accel.config.loading import read_yaml
from linnaeus_accel.training.start.backends import backend_problems, fill_deepspeed_auto

ZERO2: dict[str, Any] = {  # as deepspeed_zero2.yaml, with gradient_clipping at TRAIN.CLIP_GRAD's default
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": 5.0,
    "zero_optimization": {"stage": 2},
}
ZERO3 = {**ZERO2, "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
DS = DistributedType.DEEPSPEED


def config(*opts: str) -> Any:
    """The default config with ``KEY VALUE`` overrides; ``TRAIN.CLIP_GRAD none``: no clipping
    (``--opts KEY null`` means the key's default)."""
    if list(opts[:2]) == ["TRAIN.CLIP_GRAD", "none"]:
        data = read_yaml(DEFAULT_CONFIG)
        data.setdefault("TRAIN", {})["CLIP_GRAD"] = None
        return load_config(data, list(opts[2:]))
    return load_config(DEFAULT_CONFIG, list(opts))


def keys(problems: list[tuple[str, str]]) -> list[str]:
    return [key for key, _ in problems]


@pytest.mark.parametrize(
    ("kind", "ds", "opts", "expected"),
    [
        # The shipped ZeRO-2 and ZeRO-3 files with the default config: nothing to refuse.
        (DS, ZERO2, [], []),
        (DS, ZERO3, [], []),
        # A DeepSpeed JSON's own accumulation would replace ours at prepare: refused...
        (
            DS,
            {**ZERO2, "gradient_accumulation_steps": 1},
            ["TRAIN.ACCUMULATION_STEPS", "4"],
            ["TRAIN.ACCUMULATION_STEPS"],
        ),
        # ...unless it is the same value.
        (DS, {**ZERO2, "gradient_accumulation_steps": 4}, ["TRAIN.ACCUMULATION_STEPS", "4"], []),
        # DeepSpeed clips at its own value: it must be TRAIN.CLIP_GRAD's.
        (DS, {**ZERO2, "gradient_clipping": 1.0}, [], ["TRAIN.CLIP_GRAD"]),
        # No clipping on our side is 0.0 on DeepSpeed's.
        (DS, {**ZERO2, "gradient_clipping": 0.0}, ["TRAIN.CLIP_GRAD", "none"], []),
        # "auto" clipping is filled with ours (fill_deepspeed_auto), never refused.
        (DS, {**ZERO2, "gradient_clipping": "auto"}, ["TRAIN.CLIP_GRAD", "2.0"], []),
        # A micro-batch other than DATA.BATCH_SIZE (32 by default) would be DeepSpeed's wrong bookkeeping.
        (DS, {**ZERO2, "train_micro_batch_size_per_gpu": 8}, [], ["DATA.BATCH_SIZE"]),
        # Optimizer and scheduler blocks would replace our optimizer and fight our LR schedule.
        (
            DS,
            {**ZERO2, "optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"}},
            [],
            ["LR_SCHEDULER", "LR_SCHEDULER"],
        ),
        # ZeRO-3 without the 16-bit gather cannot write final/model.safetensors at the end.
        (DS, {**ZERO2, "zero_optimization": {"stage": 3}}, [], [""]),
        # TRAIN.NONFINITE skip needs the norm before the step; DeepSpeed steps inside backward.
        (DS, ZERO2, ["TRAIN.NONFINITE", "skip"], ["TRAIN.NONFINITE"]),
        # GradNorm's own autograd over shared parameters: refused under sharding...
        (
            DS,
            ZERO2,
            ["LOSS.GRAD_WEIGHTING.TASK.GRADNORM_ENABLED", "true"],
            ["LOSS.GRAD_WEIGHTING.TASK.GRADNORM_ENABLED"],
        ),
        (
            DistributedType.FSDP,
            None,
            ["LOSS.GRAD_WEIGHTING.TASK.GRADNORM_ENABLED", "true"],
            ["LOSS.GRAD_WEIGHTING.TASK.GRADNORM_ENABLED"],
        ),
        # ...and allowed with DDP, where every process holds every parameter.
        (DistributedType.MULTI_GPU, None, ["LOSS.GRAD_WEIGHTING.TASK.GRADNORM_ENABLED", "true"], []),
        # FSDP itself asks nothing else of the config.
        (DistributedType.FSDP, None, ["TRAIN.NONFINITE", "skip"], []),
        # ASYNC checkpoints: FSDP and DeepSpeed save collectively, which a background thread cannot...
        (DistributedType.FSDP, None, ["SCHEDULE.CHECKPOINT.ASYNC", "true"], ["SCHEDULE.CHECKPOINT.ASYNC"]),
        (DS, ZERO2, ["SCHEDULE.CHECKPOINT.ASYNC", "true"], ["SCHEDULE.CHECKPOINT.ASYNC"]),
        # ...DDP and a single process can: only process 0 writes the model and optimizer.
        (DistributedType.MULTI_GPU, None, ["SCHEDULE.CHECKPOINT.ASYNC", "true"], []),
        (DistributedType.NO, None, ["SCHEDULE.CHECKPOINT.ASYNC", "true"], []),
    ],
)
def test_backend_problems(
    kind: DistributedType, ds: dict[str, Any] | None, opts: list[str], expected: list[str]
) -> None:
    cfg = config(*opts)
    assert keys(backend_problems(kind, ds, cfg.DATA, cfg.LOSS, cfg.TRAIN, cfg.SCHEDULE)) == expected


def test_messages_name_both_sides_and_the_fix() -> None:
    cfg = config()
    ((key, message),) = backend_problems(
        DS, {**ZERO2, "gradient_clipping": 1.0}, cfg.DATA, cfg.LOSS, cfg.TRAIN, cfg.SCHEDULE
    )
    assert key == "TRAIN.CLIP_GRAD"
    assert "gradient_clipping 1.0" in message
    assert "set gradient_clipping to 5.0" in message
    cfg = config("TRAIN.ACCUMULATION_STEPS", "4")
    ((key, message),) = backend_problems(
        DS, {**ZERO2, "gradient_accumulation_steps": 1}, cfg.DATA, cfg.LOSS, cfg.TRAIN, cfg.SCHEDULE
    )
    assert "is 4" in message
    assert "gradient_accumulation_steps 1" in message
    assert '"auto"' in message


def test_auto_values_become_the_configs() -> None:
    """Accelerate would fill "auto" clipping with 1.0 at prepare, and the micro-batch from a prepared
    DataLoader (a stream is not one); ours go in first."""
    ds = {**ZERO2, "gradient_clipping": "auto"}
    cfg = config("TRAIN.CLIP_GRAD", "2.0", "DATA.BATCH_SIZE", "12")
    fill_deepspeed_auto(ds, cfg.DATA, cfg.TRAIN)
    assert ds["gradient_clipping"] == 2.0
    assert ds["train_micro_batch_size_per_gpu"] == 12
    assert ds["train_batch_size"] == "auto"  # Accelerate's: micro-batch x accumulation x processes
    ds = {**ZERO2, "gradient_clipping": "auto"}
    cfg = config("TRAIN.CLIP_GRAD", "none")
    fill_deepspeed_auto(ds, cfg.DATA, cfg.TRAIN)
    assert ds["gradient_clipping"] == 0.0


def test_a_zero_checkpoint_resumes_only_with_its_own_number_of_processes() -> None:
    """Checked before DeepSpeed's load_checkpoint would fail deep inside (or a DDP/FSDP2 resume,
    which reshards, would be refused for nothing). On the CPU, with Accelerate's state as the
    launched run would have it for the distributed type."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from linnaeus_accel.checkpoint.resume.elastic import check_resume
    from linnaeus_accel.config import ConfigError

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(cpu=True)
        check_resume(accelerator, {"world_size": 8})  # not DeepSpeed: any number resumes
        check_resume(accelerator, None)  # a checkpoint from before plans were stored
        accelerator.state.distributed_type = DistributedType.DEEPSPEED  # what a DeepSpeed launch sets
        check_resume(accelerator, {"world_size": 1})
        with pytest.raises(ConfigError, match="written by 8 DeepSpeed processes and this run has 1"):
            check_resume(accelerator, {"world_size": 8})
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
