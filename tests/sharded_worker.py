"""Worker for ``test_sharded_checkpoints``: a tiny deterministic training under torch-level FSDP2
(``fully_shard``) on gloo, checkpointed through linnaeus-accel's ``CheckpointWriter`` and read back by its ``CheckpointReader``.

Launched by ``python -m torch.distributed.run --nproc_per_node 2 tests/sharded_worker.py``. The
Accelerator (``cpu=True``) only joins the gloo group: the sharded model is not ``prepare``d
(Accelerate on MULTI_CPU would wrap it in DDP). The sharded state is written the way Accelerate's
FSDP2 ``save_state`` writes it (``save_fsdp_model`` / ``save_fsdp_optimizer`` with
SHARDED_STATE_DICT): a ``torch.distributed.checkpoint`` directory ``pytorch_model_fsdp_0/``
(``{"model": ...}``) and one ``optimizer_0/`` (``{"optimizer": ...}``), from every process,
through Accelerate's documented save/load pre-hooks, so that it happens inside
``CheckpointWriter.save``'s collective protocol and ``CheckpointReader.load``.

Fault injection: with ``SHARDED_WORKER_KILL_AT_STEP=<step>`` (and ``SHARDED_WORKER_KILL_RANK``,
default 1), that process SIGKILLs itself right after writing its own shard of the model in the
checkpoint of that step, before the coordinator (rank 0) gathered the write results and wrote
``.metadata``: the checkpoint is cut mid-write, and rank 0 is left waiting in DCP's gather.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from linnaeus_accel.checkpoint.bucket.from_bucket import complete_from_bucket
from linnaeus_accel.checkpoint.resume.reader import CheckpointReader
from linnaeus_accel.checkpoint.save.nonfinite import parameters_finite
from linnaeus_accel.checkpoint.save.writer import CheckpointWriter
from linnaeus_accel.config import load_config
from linnaeus_accel.run_directory.shared_storage import check_shared_output

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = "pytorch_model_fsdp_0"  # Accelerate's names (FSDP_MODEL_NAME, OPTIMIZER_NAME), model 0
OPTIMIZER_DIR = "optimizer_0"
WIDTH, IN, OUT, BATCH = 16, 8, 4, 8


class KillingWriter(FileSystemWriter):
    """A ``FileSystemWriter`` that, once armed, lets this process write its shard file(s) and then
    SIGKILLs it: no exception, no cleanup, like a preempted node or the OOM killer."""

    def __init__(self, path: Path, kill: bool) -> None:
        super().__init__(path)
        self.kill = kill

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        if self.kill:
            written.wait()  # the shard file is complete (and fsynced) on disk
            print(f"rank {dist.get_rank()}: wrote my shard, killing myself mid-checkpoint", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return written


def build_model(mesh: Any) -> nn.Sequential:
    torch.manual_seed(0)  # the same full weights on every process before sharding
    model = nn.Sequential(
        nn.Linear(IN, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, OUT)
    )
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, IN, generator=generator), torch.randn(BATCH, OUT, generator=generator)


def all_finite(model: nn.Module) -> tuple[bool, bool]:
    """(this process's shards finite, every process's shards finite)."""
    mine = parameters_finite(model.parameters())
    bad = torch.tensor([0.0 if mine else 1.0])
    dist.all_reduce(bad, op=dist.ReduceOp.SUM)
    return mine, bad.item() == 0


def nan_is_detected(model: nn.Sequential, rank: int) -> None:
    """A NaN in one process's shard only: found by that process alone, by all once combined."""
    weight = model[0].weight
    assert isinstance(weight, DTensor), type(weight)
    local = weight.to_local()
    with torch.no_grad():
        kept = local.reshape(-1)[0].clone()
        if rank == 1:
            local.reshape(-1)[0] = float("nan")
        mine, everyone = all_finite(model)
        local.reshape(-1)[0] = kept
    assert mine == (rank != 1), (rank, mine)
    assert not everyone, "a NaN in rank 1's shard went unnoticed"
    assert all_finite(model) == (True, True)
    print(f"rank {rank}: NaN in rank 1's shard detected (local answer {mine}, combined False)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-dir", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--final", required=True, help="where rank 0 writes the full final weights")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument(
        "--bucket", help="ENV.OUTPUT.BUCKET.URL: machines without a shared directory meet there"
    )
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)  # joins torchrun's gloo group; nothing is prepared
    rank, world = accelerator.process_index, accelerator.num_processes
    assert world == 2, world
    assert dist.get_backend() == "gloo", dist.get_backend()
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    kill_step = int(os.environ.get("SHARDED_WORKER_KILL_AT_STEP", "-1"))
    kill_rank = int(os.environ.get("SHARDED_WORKER_KILL_RANK", "1"))
    saving_step = {"step": -1}  # the checkpoint being written, for the fault

    def save_hook(models: list[nn.Module], weights: list[Any], output_dir: str) -> None:
        out = Path(output_dir)
        for sub in (MODEL_DIR, OPTIMIZER_DIR):
            (out / sub).mkdir(parents=True, exist_ok=True)
        kill = saving_step["step"] == kill_step and rank == kill_rank
        dcp_save({"model": get_model_state_dict(model)}, storage_writer=KillingWriter(out / MODEL_DIR, kill))
        optim = get_optimizer_state_dict(model, optimizer)
        dcp_save({"optimizer": optim}, storage_writer=FileSystemWriter(out / OPTIMIZER_DIR))

    def load_hook(models: list[nn.Module], input_dir: str) -> None:
        path = Path(input_dir)
        state = {"model": get_model_state_dict(model)}
        dcp_load(state, storage_reader=FileSystemReader(path / MODEL_DIR))
        set_model_state_dict(model, state["model"])
        optim = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp_load(optim, storage_reader=FileSystemReader(path / OPTIMIZER_DIR))
        set_optimizer_state_dict(model, optimizer, optim["optimizer"])

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)

    bucket = ["ENV.OUTPUT.BUCKET.URL", args.bucket] if args.bucket else []
    config = load_config(
        REPO / "configs" / "default.yaml",
        opts=["ENV.OUTPUT.BASE_DIR", args.base_dir, "EXPERIMENT.NAME", args.name, *bucket],
    )
    writer = CheckpointWriter(
        accelerator, config.ENV, config.EXPERIMENT, config.SCHEDULE, config.ranking_metric, config.output_dir
    )
    reader = CheckpointReader(accelerator, config.TRAIN, config.output_dir, writer.store)

    # Resume as the trainer does: the machines' layout (node-local with a bucket), stale staging
    # removed, the bucket's newest checkpoint made whole on each machine, the newest that verifies.
    config.output_dir.mkdir(parents=True, exist_ok=True)
    writer.layout = check_shared_output(accelerator, config.output_dir, bucket=writer.remote is not None)
    writer.attempt = writer.layout.attempt
    if writer.commits_here:
        writer.store.remove_stale_staging()
    if writer.layout.node_local:
        complete_from_bucket(accelerator, writer.store, writer.remote)
    path, skipped = reader.find_everywhere(None)
    if accelerator.is_main_process:
        for message in skipped:
            print(f"skipping checkpoint {message}", flush=True)
        resume_step = reader.store.step_of(path) if path is not None else None
        reader.discard_after(resume_step or 0)
    accelerator.wait_for_everyone()
    start = 0
    if path is not None:
        state = reader.load(path)
        writer.resumed_at(path, state)
        start = int(state["progress"]["global_step"])
        if accelerator.is_main_process:
            print(f"resumed from {path.name} (global step {start})", flush=True)
    elif accelerator.is_main_process:
        print("no checkpoint: starting from step 0", flush=True)

    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        torch.autograd.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.every == 0:
            mine, everyone = all_finite(model)
            assert mine, f"rank {rank}: non-finite parameters in its shards at step {step}"
            assert everyone, f"non-finite parameters in another process's shards at step {step}"
            saving_step["step"] = step
            state = {
                "progress": {"global_step": step, "epoch": 0, "batches_seen_in_epoch": step},
                "plan": {
                    "total_steps": args.steps,
                    "world_size": world,
                    "accumulation": 1,
                    "batch_size": BATCH,
                },
            }
            final = writer.save(step, state, {"data": {"batches_seen": step}})
            writer.settle()  # its commit runs in the background: committed from here on
            if accelerator.is_main_process:
                print(f"committed {final.name}", flush=True)

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if accelerator.is_main_process:  # with cpu_offload, only rank 0 holds the gathered tensors
        tensors = {k: v.contiguous() for k, v in full.items() if isinstance(v, torch.Tensor)}
        assert len(tensors) == len(full) > 0, sorted(full)
        assert not any(isinstance(v, DTensor) for v in tensors.values())
        save_file(tensors, args.final)
        print(f"final weights ({len(tensors)} tensors) written to {args.final}", flush=True)
    nan_is_detected(model, rank)
    errors = writer.close()  # every machine's uploads done (node-local mode: the last checkpoint sealed)
    assert not errors, errors
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group, on every process together
    return 0


if __name__ == "__main__":
    status = main()
    # Leave without finalizing the interpreter: gloo's worker threads may still be dropping the last
    # collectives' work objects, and one that frees a Python-owned tensor while the interpreter
    # finalizes takes the GIL from a dying thread -> std::terminate -> SIGABRT (seen in ~1 exit in 15
    # on a loaded 2-core machine, after every process had finished: a torch teardown race, not ours).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
