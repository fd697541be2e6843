"""What the distributed backend Accelerate runs (DDP, FSDP, DeepSpeed) asks of the config, checked
once at start-up, before anything is prepared: a mismatch found after hours of training (the final
weights cannot be gathered) or never found at all (DeepSpeed silently replacing our accumulation or
clipping) is a ``ConfigError`` naming both sides here.

DeepSpeed (read from accelerate's ``_prepare_deepspeed`` and ``DeepSpeedEngineWrapper``):
- it replaces the Accelerator's ``gradient_accumulation_steps`` with its own at ``prepare`` when
  they differ (a DeepSpeed JSON without the key counts as 1);
- it clips inside ``engine.step()`` at its own ``gradient_clipping`` (Accelerate fills 1.0 for
  "auto"), and ``clip_grad_norm_`` only reports the norm of the step just taken;
- a DeepSpeed ``scheduler`` block would set the LR our schedule sets, an ``optimizer`` block would
  replace ours; ZeRO-3 can gather full weights for ``final/`` only with
  ``stage3_gather_16bit_weights_on_model_save``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from ...config import ConfigError
from ...config.schedule import ScheduleConfig
from ...config.sections import DataConfig, LossConfig, TrainConfig

Problem = tuple[str, str]
DS = "the DeepSpeed config"  # how messages name the other side (an accelerate config or a JSON)


# Backends whose save_state is a collective of every process (or of the XLA graph).
_COLLECTIVE_SAVES = (
    DistributedType.FSDP,
    DistributedType.DEEPSPEED,
    DistributedType.MEGATRON_LM,
    DistributedType.XLA,
)


def check_backend(
    accelerator: Accelerator, data: DataConfig, loss: LossConfig, train: TrainConfig, schedule: ScheduleConfig
) -> None:
    """Raise one ``ConfigError`` listing every problem (the same on every process: no collective)
    with the config's DATA, LOSS, TRAIN and SCHEDULE sections. Fills DeepSpeed's "auto" clipping with
    TRAIN.CLIP_GRAD, so that "auto" means ours, not 1.0."""
    kind = accelerator.distributed_type
    ds = accelerator.state.deepspeed_plugin.deepspeed_config if kind == DistributedType.DEEPSPEED else None
    problems = backend_problems(kind, ds, data, loss, train, schedule)
    device = accelerator.device.type
    if schedule.CHECKPOINT.ASYNC and device not in ("cpu", "cuda"):
        problems.append(
            (
                "SCHEDULE.CHECKPOINT.ASYNC",
                f"the copy to host memory saves the RNG states of the CPU and CUDA only, not of "
                f"'{device}': set it to false on this machine",
            )
        )
    if problems:
        raise ConfigError(problems)
    if ds is not None:
        fill_deepspeed_auto(ds, data, train)


def check_optimizer_backend(accelerator: Accelerator, optimizer: Any) -> None:
    """Refuse, before the first step, a Muon optimizer (OPTIMIZER.NAME muon, or a torch.optim.Muon
    given) under FSDP or DeepSpeed: Muon orthogonalises each weight matrix whole, and there every
    process holds only its shard of each matrix and its gradient, so each would orthogonalise a
    slice instead (a different, wrong update) unless the matrices were gathered first."""
    kind = accelerator.distributed_type
    sides = getattr(optimizer, "sides", {}).values()
    if kind not in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        return
    muon = getattr(torch.optim, "Muon", ())  # () where this torch has none: nothing is one
    if not any(isinstance(o, muon) for o in (optimizer, *sides)):
        return
    backend = "FSDP" if kind == DistributedType.FSDP else "DeepSpeed"
    raise ConfigError(
        [
            (
                "OPTIMIZER.NAME",
                f"Muon orthogonalises each weight matrix whole, but {backend} gives every process only a "
                "shard of it: train Muon with DDP (accelerate_configs/multi_gpu.yaml), or set NAME: adamw "
                f"under {backend}",
            )
        ]
    )


def backend_problems(
    kind: DistributedType,
    ds: Mapping[str, Any] | None,
    data: DataConfig,
    loss: LossConfig,
    train: TrainConfig,
    schedule: ScheduleConfig,
) -> list[Problem]:
    """What in the config's DATA, LOSS, TRAIN and SCHEDULE sections the backend ``kind`` cannot run
    (``ds``: DeepSpeed's config dict)."""
    problems: list[Problem] = []
    if (
        kind in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        and loss.GRAD_WEIGHTING.TASK.GRADNORM_ENABLED
    ):
        problems.append(
            (
                "LOSS.GRAD_WEIGHTING.TASK.GRADNORM_ENABLED",
                f"GradNorm differentiates each task's loss with respect to the shared parameters "
                f"itself, which {'FSDP' if kind == DistributedType.FSDP else 'DeepSpeed'}'s sharded "
                "parameters and gradients do not support: disable it, or train with DDP "
                "(accelerate_configs/multi_gpu.yaml)",
            )
        )
    if schedule.CHECKPOINT.ASYNC and kind in _COLLECTIVE_SAVES:
        problems.append(
            (
                "SCHEDULE.CHECKPOINT.ASYNC",
                f"{kind.value} saves its checkpoints collectively, from every process at once, which "
                "cannot run in the background: set it to false (the commit still runs in the "
                "background), or train with DDP (accelerate_configs/multi_gpu.yaml)",
            )
        )
    if ds is not None:
        problems += deepspeed_problems(ds, data, train)
    return problems


def deepspeed_problems(ds: Mapping[str, Any], data: DataConfig, train: TrainConfig) -> list[Problem]:
    """What in the DeepSpeed config ``ds`` (the plugin's dict, "auto" values still unfilled)
    contradicts the config's DATA and TRAIN sections."""
    problems: list[Problem] = []
    accumulation = train.accumulation
    gas = ds.get("gradient_accumulation_steps", "auto")
    if gas != "auto" and gas != accumulation:
        problems.append(
            (
                "TRAIN.ACCUMULATION_STEPS",
                f"is {accumulation} but {DS} has gradient_accumulation_steps {gas}, which Accelerate "
                f'would use instead (a different effective batch than the plan): set it to "auto" or '
                f"{accumulation} there (or leave it out of an accelerate config file)",
            )
        )
    clip = train.CLIP_GRAD or 0.0
    theirs = ds.get("gradient_clipping", "auto")
    if theirs != "auto" and float(theirs) != clip:
        problems.append(
            (
                "TRAIN.CLIP_GRAD",
                f"is {train.CLIP_GRAD} but DeepSpeed clips gradients itself at gradient_clipping "
                f"{theirs} ({DS}): set gradient_clipping to {clip} there, or TRAIN.CLIP_GRAD to {theirs}",
            )
        )
    micro = ds.get("train_micro_batch_size_per_gpu", "auto")
    if micro != "auto" and micro != data.BATCH_SIZE:
        problems.append(
            (
                "DATA.BATCH_SIZE",
                f"is {data.BATCH_SIZE} but {DS} has train_micro_batch_size_per_gpu {micro}: "
                f'set it to "auto" there',
            )
        )
    for block, what in (("optimizer", "replaces the trainer's optimizer"), ("scheduler", "sets the LR")):
        if ds.get(block):
            problems.append(
                (
                    "LR_SCHEDULER",
                    f"{DS} has a {block!r} block, which {what}: remove it; LR_SCHEDULER drives the "
                    "learning rate of the trainer's optimizer every step",
                )
            )
    zero = ds.get("zero_optimization") or {}
    if zero.get("stage") == 3 and zero.get("stage3_gather_16bit_weights_on_model_save") is not True:
        problems.append(
            (
                "",
                f"{DS} uses ZeRO stage 3 without stage3_gather_16bit_weights_on_model_save "
                "(zero3_save_16bit_model: true in an accelerate config file): the run could not "
                "gather its final weights into final/model.safetensors at the end",
            )
        )
    if train.NONFINITE == "skip":
        problems.append(
            (
                "TRAIN.NONFINITE",
                "skip needs the gradient norm before the optimizer step, but DeepSpeed steps inside "
                "backward (its fp16 loss scaler skips overflowing steps itself): use stop",
            )
        )
    return problems


def fill_deepspeed_auto(ds: dict[str, Any], data: DataConfig, train: TrainConfig) -> None:
    """DeepSpeed's "auto" clipping becomes TRAIN.CLIP_GRAD (Accelerate would fill 1.0), its "auto"
    micro-batch DATA.BATCH_SIZE (Accelerate reads it from a prepared DataLoader, which a stream,
    sharded by us, is not)."""
    if ds.get("gradient_clipping", "auto") == "auto":
        ds["gradient_clipping"] = train.CLIP_GRAD or 0.0
    if ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        ds["train_micro_batch_size_per_gpu"] = data.BATCH_SIZE


def scaler_skips_steps(accelerator: Accelerator) -> bool:
    """Whether a loss scaler may skip optimizer steps (fp16: Accelerate's GradScaler, DeepSpeed's
    own scaler); ``optimizer.step_was_skipped`` then says after each step whether it did."""
    if accelerator.scaler is not None:
        return True
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        fp16 = accelerator.state.deepspeed_plugin.deepspeed_config.get("fp16") or {}
        return fp16.get("enabled") is True
    return False
