"""What a resumed run takes from a checkpoint that another layout of processes wrote.

A checkpoint records the identity of its schedule (total steps, processes, accumulation, batch
size). The same effective batch on another (processes x accumulation) factorisation resumes
exactly (elastic resume): the epoch's global sample order is the same, so the position in the
epoch is converted through it; each process's share of the open metric window is added up.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType

from ...config import ConfigError
from ...schedule import ResolvedPlan


def plan_identity(plan: ResolvedPlan) -> dict[str, int | None]:
    return {
        "total_steps": plan.total_steps,
        "world_size": plan.world_size,
        "accumulation": plan.accumulation,
        "batch_size": plan.batch_size,
        "batches_per_epoch": plan.batches_per_epoch,
    }


def compatible_position(
    saved: dict[str, Any] | None, now: dict[str, Any], batches_seen: int, same_length: bool = True
) -> int:
    """This run's batches already seen in the epoch, checking that the checkpoint's effective
    batch is this run's (and, with ``same_length``, its total steps: for checkpoints that do not
    store their config, whose changes ``config_changes`` reviews otherwise)."""
    saved = saved or now
    effective = {
        k: v["batch_size"] * v["world_size"] * v["accumulation"] for k, v in (("saved", saved), ("now", now))
    }
    if (same_length and saved["total_steps"] != now["total_steps"]) or effective["saved"] != effective["now"]:
        raise ConfigError(
            [
                (
                    "TRAIN.AUTO_RESUME",
                    f"the checkpoint's schedule ({saved['total_steps']} steps, effective batch {effective['saved']}) is not this "
                    f"run's ({now['total_steps']} steps, effective batch {effective['now']}): resume with the same config, or "
                    "start fresh with --overwrite",
                )
            ],
            source="resume",
        )
    # Positions in the epoch's global sample order: Accelerate deals global batches round-robin.
    samples = batches_seen * saved["world_size"] * saved["batch_size"]
    per_batch = now["world_size"] * now["batch_size"]
    if samples % per_batch:
        raise ConfigError(
            [
                (
                    "DATA.BATCH_SIZE",
                    f"the checkpoint stopped {samples} samples into its epoch, which is not a whole number of this "
                    f"run's {per_batch}-sample global batches: resume with the checkpoint's batch size "
                    f"({saved['batch_size']} per process)",
                )
            ],
            source="resume",
        )
    return int(samples // per_batch)


def own_rank_state(states: list[dict[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
    """This process's part of the checkpoint. Written by another number of processes, the metric
    window shares are added up on process 0 (they are additive) and a stream's per-worker
    position is dropped (the stream is replayed to the converted position instead)."""
    if len(states) == world_size:
        return states[rank]
    meters = [s["meter"] for s in states if isinstance(s.get("meter"), dict)]
    if not meters:
        return {}
    merged = dict(meters[0])
    sums = [m.get("sums") for m in meters]
    if rank == 0 and all(isinstance(s, list) and len(s) == len(sums[0]) for s in sums):
        merged["sums"] = [sum(values) for values in zip(*sums, strict=True)]
    else:
        merged["sums"] = [0.0] * len(sums[0] or [])
    return {"meter": merged}


def check_resume(accelerator: Accelerator, saved_plan: Mapping[str, Any] | None) -> None:
    """DeepSpeed's ZeRO checkpoints hold one optimizer partition per process and load only with
    the same number of processes (DeepSpeed's universal checkpoints are another format); FSDP2's
    sharded checkpoints are resharded on load, DDP's are whole."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED or not saved_plan:
        return
    saved = saved_plan.get("world_size")
    if saved is not None and saved != accelerator.num_processes:
        raise ConfigError(
            [
                (
                    "--num_processes",
                    f"the checkpoint was written by {saved} DeepSpeed processes and this run has "
                    f"{accelerator.num_processes}: a ZeRO checkpoint loads only with the same number; "
                    f"launch {saved} processes (or convert it with DeepSpeed's universal checkpoint tools)",
                )
            ]
        )
