"""The three loops part ``throughput`` compares, each run in a worker process of its own
(``python -m benchmarks.gpu.sides FD``): ours (``Trainer.fit``), a hand-written Accelerate loop,
and a plain PyTorch loop in nanoGPT's style.

All three train the same transformers GPT-2 (built by ``AutoModelForCausalLM.from_config`` from the
same fields) on windows of the same token file on disk, read by DataLoader workers into pinned
memory, in bf16 autocast with ``torch.compile`` (inductor) on a GPU, with AdamW (torch's default
implementation), clipping at 1.0 and a cosine LR set before every step; each reads its loss back
once per block of ``block`` steps, as a logging interval would. The loss is the same computation
on every side (the logits of a window's first ``seq_len - 1`` tokens against the next tokens, in
fp32), so a side's time is its loop's.

After every optimizer step a side calls its ``BlockBaton``; at the end of each block it waits for
the GPU (``torch.cuda.synchronize``), notes the block's time, tells the referee and blocks until it
is told to go on. Inside a block nothing waits: the host runs ahead of the GPU as in a real run.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np


class LockstepOver(Exception):
    """Raised from our trainer's step hook once the referee has ended the lock-step."""


class BlockBaton:
    """Called after every optimizer step; every ``block`` steps it syncs the GPU, times the block
    since it last got the baton, hands it to the referee and waits. False once the referee has
    ended the lock-step.

    Also noted for each block: ``host`` (seconds until the host had queued the whole block, before
    the sync: near the block's time when the host, not the GPU, sets the pace, e.g. when something
    waits for the GPU every step). Told ``p`` instead of ``g``, the side runs its next block (not
    timed) under ``torch.profiler`` and ``torch.cuda.set_sync_debug_mode("warn")``: the GPU kernels
    that took the most time, and every call that made the host wait, with where it came from.

    ``release``: after each block the side hands its cached GPU memory back (not timed), so that
    sides too large to sit on the GPU together can take turns on it (part ``recipe``)."""

    def __init__(self, conn: Connection, block: int, cuda: bool, release: bool = False) -> None:
        self.conn, self.block, self.cuda, self.release = conn, block, cuda, release
        self.steps = 0
        self.times: list[float] = []
        self.host: list[float] = []
        self.start: float | None = None
        self.free = False
        self.profiler: Any = None
        self.diagnosis: dict[str, Any] = {}
        self.syncs: list[str] = []

    def __call__(self) -> bool:
        if self.free:
            return False
        self.steps += 1
        if self.steps % self.block:
            return True
        queued = time.perf_counter()
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        now = time.perf_counter()
        if self.profiler is not None:
            self._end_profile(now)
        elif self.start is not None:
            self.times.append(now - self.start)
            self.host.append(queued - self.start)
        if self.release and self.cuda:
            import torch

            torch.cuda.empty_cache()
        self.conn.send_bytes(b"d")
        message = self.conn.recv_bytes()
        if message == b"e":
            self.free = True
            return False
        if message == b"p":
            self._start_profile()
        self.start = time.perf_counter()
        return True

    def _start_profile(self) -> None:
        import warnings

        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.set_sync_debug_mode("warn")
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._sync_seen
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.__enter__()

    def _sync_seen(self, message: Any, *args: Any) -> None:
        if "synchronizing" in str(message):
            from .host_sync import where

            self.syncs.append(where(traceback.extract_stack()[:-1]))

    def _end_profile(self, now: float) -> None:
        import collections

        import torch

        self.profiler.__exit__(None, None, None)
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
        self._warnings.__exit__(None, None, None)
        assert self.start is not None
        events = self.profiler.key_averages()
        key = (
            "self_device_time_total"
            if not events or hasattr(events[0], "self_device_time_total")  # none: a side's empty turn
            else "self_cuda_time_total"
        )
        device_us = sum(getattr(e, key, 0) for e in events)
        top = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:15]
        self.diagnosis = {
            "profiled_block_s": round(now - self.start, 4),
            "device_time_s (sum of kernels)": round(device_us / 1e6, 4),
            "top_kernels_ms": {e.key[:90]: round(getattr(e, key, 0) / 1e3, 2) for e in top},
            "calls_per_step": round(sum(e.count for e in events) / self.block),
            "host_syncs": dict(collections.Counter(self.syncs)),
        }
        if self.cuda:
            stats = torch.cuda.memory_stats()
            self.diagnosis["memory"] = {
                "max_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 2),
                "alloc_retries": stats.get("num_alloc_retries", 0),
                "device_allocs": stats.get("num_device_alloc", None),
            }
        self.profiler = None


def model_fields(spec: dict[str, Any]) -> dict[str, Any]:
    """GPT-2's config fields (transformers' names)."""
    return {
        "model_type": "gpt2",
        "vocab_size": spec["vocab"],
        "n_positions": spec["seq_len"],
        "n_embd": spec["embd"],
        "n_layer": spec["layers"],
        "n_head": spec["heads"],
    }


def cosine_lr(step: int, total: int, peak: float = 6e-4, warmup: int = 10) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 * peak + 0.45 * peak * (1 + math.cos(math.pi * min(1.0, progress)))


# -- ours ---------------------------------------------------------------------------------------------
def ours_config(spec: dict[str, Any], name: str = "ours", **sections: Any) -> Any:
    """Our config of ``spec``'s run: token_files, hf_causal_lm (GPT-2), causal_lm; ``sections``
    replace whole sections (e.g. ``SCHEDULE``)."""
    from linnaeus_accel.config import load_config

    fields = model_fields(spec)
    vocab = fields.pop("vocab_size")
    batch, tokens_per_sample = spec["batch"], spec["seq_len"] - 1
    return load_config(
        {
            "EXPERIMENT": {"NAME": name, "SEED": 0},
            "ENV": {"OUTPUT": {"BASE_DIR": spec["out"]}, "PROGRESS_BAR": False},
            "DATA": {
                "BATCH_SIZE": batch,
                "DROP_LAST": True,
                "NUM_WORKERS": spec["workers"],
                "DATASET": {
                    "NAME": "token_files",
                    "OPTIONS": {
                        "paths": [spec["tokens"]],
                        "seq_len": spec["seq_len"],
                        "dtype": "uint16",
                        "vocab_size": vocab,
                    },
                },
            },
            "MODEL": {"TYPE": "hf_causal_lm", "OPTIONS": {**fields, "vocab_size": vocab}},
            "TASK": {"NAME": "causal_lm"},
            "TRAIN": {
                "TARGET_TOKENS": spec["steps"] * batch * tokens_per_sample,
                "CLIP_GRAD": 1.0,
                "AUTO_RESUME": False,
            },
            "LR_SCHEDULER": {
                "NAME": "cosine",
                "BASE_LR": 6e-4,
                "REFERENCE_BS": None,
                "WARMUP_STEPS": 10,
                "MIN_LR": 6e-5,
            },
            "SCHEDULE": {"METRICS": {"STEP_INTERVAL": spec["block"]}},
            **sections,
        }
    )


def run_ours(spec: dict[str, Any], baton: BlockBaton, config: Any = None) -> dict[str, Any]:
    """``Trainer.fit`` on a config of ours (``config``, else ``ours_config(spec)``). Compile and
    bf16 come from Accelerate's environment variables, as ``linnaeus-accel train`` takes them."""
    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16" if spec["cuda"] else "no"
    os.environ["ACCELERATE_DYNAMO_BACKEND"] = "INDUCTOR" if spec["compile"] else "NO"
    import torch

    from linnaeus_accel.data import build_dataset
    from linnaeus_accel.models import build_model
    from linnaeus_accel.run_directory import outputs
    from linnaeus_accel.training import trainer as trainer_module

    # The schedule plot (matplotlib, on a thread at start-up) is not drawn: set-up, not the loop,
    # and a second of CPU a side (as in benchmarks/species.py).
    setattr(outputs, "_draw_schedule", lambda *args: None)  # noqa: B010
    config = ours_config(spec) if config is None else config
    train = build_dataset(config, "train")
    torch.manual_seed(0)
    model = build_model(config, train)
    names = vars(trainer_module)  # where Trainer looks ``fault_point`` up (see benchmarks/workloads.py)
    real_fault_point = names["fault_point"]

    def fault_point(name: str) -> None:
        if name == "optimizer_step":
            if not baton():
                raise LockstepOver
        else:
            real_fault_point(name)

    names["fault_point"] = fault_point
    try:
        trainer = trainer_module.Trainer(config, model, train)
        with contextlib.suppress(LockstepOver):
            trainer.fit()
    finally:
        names["fault_point"] = real_fault_point
    records = [r for r in _records(config.output_dir / "metrics.jsonl") if "perf/tokens_per_s" in r]
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "logged": [
            {
                k: r.get(k)
                for k in (
                    "global_step",
                    "train/loss",
                    "perf/tokens_per_s",
                    "perf/mfu",
                    "perf/data_time_share",
                )
            }
            for r in records
        ],
        "run_info": trainer.end.run_info,
    }


def _records(path: Path) -> list[dict[str, Any]]:
    import json

    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# -- what a user writes instead ---------------------------------------------------------------------------
# Each loop is written out whole, as its user would write it, though the two share their last lines:
# what is timed is the loop itself, so neither calls code the other runs.
class TokenWindows:
    """A user's own dataset of token windows (nanoGPT reads ``train.bin`` through ``np.memmap``):
    window ``i`` is tokens ``i * (seq_len - 1)`` to ``i * (seq_len - 1) + seq_len``."""

    def __init__(self, path: str, seq_len: int) -> None:
        self.path, self.seq_len = path, seq_len
        self.count = (os.path.getsize(path) // 2 - 1) // (seq_len - 1)
        self.tokens: Any = None

    def __len__(self) -> int:
        return int(self.count)

    def __getitem__(self, i: int) -> Any:
        import torch

        if self.tokens is None:  # opened in each worker
            self.tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        start = i * (self.seq_len - 1)
        return torch.from_numpy(self.tokens[start : start + self.seq_len].astype(np.int64))


def _user_model_and_data(spec: dict[str, Any]) -> tuple[Any, Any]:
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = model_fields(spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields))
    loader = DataLoader(
        TokenWindows(spec["tokens"], spec["seq_len"]),
        batch_size=spec["batch"],
        shuffle=True,
        drop_last=True,
        num_workers=spec["workers"],
        persistent_workers=spec["workers"] > 0,
        pin_memory=spec["cuda"],
        generator=torch.Generator().manual_seed(0),
    )
    return model, loader


def _loss(model: Any, window: Any) -> Any:
    import torch.nn.functional as F

    logits = model(window).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), window[:, 1:].reshape(-1))


def run_accelerate(spec: dict[str, Any], baton: BlockBaton) -> dict[str, Any]:
    """A hand-written Accelerate loop, written as Accelerate's examples write one, with the
    best-practice data settings (pinned memory, non-blocking copies)."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    accelerator = Accelerator(
        mixed_precision="bf16" if spec["cuda"] else "no",
        dynamo_backend="inductor" if spec["compile"] else "no",
        dataloader_config=DataLoaderConfiguration(non_blocking=True),
    )
    model, loader = _user_model_and_data(spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    loss_sum = torch.zeros((), device=accelerator.device)
    logged: list[float] = []
    step = 0
    while step < spec["steps"]:
        for window in loader:
            loss = _loss(model, window)
            accelerator.backward(loss)
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(step, spec["steps"])
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
            step += 1
            if not baton():
                return {"logged": logged}
            if step % spec["block"] == 0:
                logged.append(loss_sum.item() / spec["block"])
                loss_sum.zero_()
    return {"logged": logged}


def run_plain(spec: dict[str, Any], baton: BlockBaton) -> dict[str, Any]:
    """A plain PyTorch loop, nanoGPT's shape: the model on the device, compiled, bf16 autocast
    around the forward, the batch copied without blocking, no Accelerate."""
    import torch

    device = torch.device("cuda" if spec["cuda"] else "cpu")
    model, loader = _user_model_and_data(spec)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    forward = torch.compile(model) if spec["compile"] else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec["cuda"])
    model.train()
    loss_sum = torch.zeros((), device=device)
    logged: list[float] = []
    step = 0
    while step < spec["steps"]:
        for batch in loader:
            window = batch.to(device, non_blocking=True)
            with autocast:
                logits = forward(window).logits
            logits = logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), window[:, 1:].reshape(-1)
            )
            loss.backward()
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(step, spec["steps"])
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
            step += 1
            if not baton():
                return {"logged": logged}
            if step % spec["block"] == 0:
                logged.append(loss_sum.item() / spec["block"])
                loss_sum.zero_()
    return {"logged": logged}


SIDES = {"ours": run_ours, "accelerate": run_accelerate, "plain": run_plain}


def worker(fd: int, sides: dict[str, Any] = SIDES) -> None:
    """One side's process: receives its spec, runs it, sends its result (or its traceback). With
    ``alone`` in its spec it starts only when the referee says go, and hands back its cached GPU
    memory after each block (see ``BlockBaton``) unless ``release`` in its spec is false."""
    conn = Connection(fd)
    spec = conn.recv()
    release = spec.get("release", spec.get("alone", False))
    baton = BlockBaton(conn, spec["block"], spec["cuda"], release=release)
    try:
        if spec.get("alone"):
            conn.recv_bytes()
        result = sides[spec["side"]](spec, baton)
        conn.send(("result", {**result, "times": baton.times, "host": baton.host, "steps": baton.steps,
                               "diagnosis": baton.diagnosis}))  # fmt: skip
    except Exception:
        conn.send(("error", traceback.format_exc()))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # nothing to tear down that the OS would not (DataLoader workers die with us)


if __name__ == "__main__":
    worker(int(sys.argv[1]))
