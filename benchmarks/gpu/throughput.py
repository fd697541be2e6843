"""Part ``throughput``: a GPT-2-small-sized model (124M parameters, 1024 target tokens a sample,
bf16, ``torch.compile``) reading a token file from disk with DataLoader workers; tokens/s and MFU of
``linnaeus-accel`` against a hand-written Accelerate loop and a plain PyTorch loop (``sides``).

The three loops take turns on the one GPU, a block of ``BLOCK`` optimizer steps each, strictly in
turn (ours, accelerate, plain, ours, ...): the i-th blocks of all three are timed back to back, only
one runs at a time, so drift of the machine (clocks, other tenants) moves all three together. Each
runs in a process of its own: Accelerate's state is one per process, and ``Trainer.fit`` is the real
loop, which cannot hand over control mid-run except from a process of its own. The first
``WARMUP`` blocks after the first (which holds compilation) are not counted. A row's ratio is the
median of the paired per-block ratios (ours' tokens/s over the other's); the target is >= 0.98.

MFU is 6 x parameters x tokens/s over the device's dense bf16 peak (what ``perf/mfu`` reports; the
attention's own FLOPs are not counted). ``perf/data_time_share`` is read from our run's metrics.
"""

from __future__ import annotations

import os
import pickle
import socket
import statistics
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from .common import REPO, Context, Part, run_env, tail

NAME, TITLE = "throughput", "124M GPT-2, bf16, compiled, token files: ours vs hand-written loops"
SIDES = ("ours", "accelerate", "plain")
TARGET = 0.98
BLOCK, WARMUP = 10, 2
FULL = {"vocab": 50304, "seq_len": 1025, "embd": 768, "layers": 12, "heads": 12, "batch": 12, "rounds": 12}
TINY = {"vocab": 512, "seq_len": 65, "embd": 64, "layers": 2, "heads": 2, "batch": 4, "rounds": 3}


def write_tokens(path: Path, count: int, vocab: int) -> None:
    """Random token ids (uint16, nanoGPT's ``.bin``): what the loops read does not change their cost."""
    rng = np.random.default_rng(0)
    rng.integers(0, min(vocab, 50257), size=count, dtype=np.uint16).tofile(path)


class Referee:
    """One worker process per side (``module``'s, ``python -m MODULE FD``: ``sides.worker`` with
    its loops); ``play`` runs the lock-step."""

    def __init__(
        self, specs: dict[str, dict[str, Any]], logs: Path, cuda: bool, module: str = "benchmarks.gpu.sides"
    ) -> None:
        self.logs = logs
        self.conns: dict[str, Connection] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        env = run_env(cuda)
        for side, spec in specs.items():
            ours, theirs = socket.socketpair()
            with (logs / f"{side}.log").open("wb") as log:
                self.procs[side] = subprocess.Popen(
                    [sys.executable, "-m", module, str(theirs.fileno())],
                    pass_fds=[theirs.fileno()], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
            theirs.close()
            self.conns[side] = Connection(ours.detach())
            self.conns[side].send(spec)

    def _next(self, side: str, timeout: float) -> Any:
        """None when the side finished a block, else its result; raises with its error."""
        conn = self.conns[side]
        if not conn.poll(timeout):
            raise TimeoutError(f"{side} took over {timeout:.0f} s for a block\n{self.log_tail(side)}")
        data = conn.recv_bytes()
        if data == b"d":
            return None
        kind, payload = pickle.loads(data)
        if kind != "result":
            raise RuntimeError(f"{side} failed:\n{payload}")
        return payload

    def log_tail(self, side: str) -> str:
        return tail((self.logs / f"{side}.log").read_text(encoding="utf-8", errors="replace"), 20)

    def play(self, rounds: int, first_timeout: float, alone: bool = False) -> dict[str, dict[str, Any]]:
        """``alone``: the sides' specs say ``alone``, and their set-up, compilation and first block
        run one side after the other, not all at once."""
        try:
            for side, conn in self.conns.items():  # set-up, compilation and the first block
                if alone:
                    conn.send_bytes(b"g")
                if self._next(side, first_timeout) is not None:
                    raise RuntimeError(f"{side} ended before its first block\n{self.log_tail(side)}")
            for _ in range(rounds):
                for side, conn in self.conns.items():
                    conn.send_bytes(b"g")
                    if self._next(side, 300) is not None:
                        raise RuntimeError(f"{side} ended before the lock-step did\n{self.log_tail(side)}")
            for side, conn in self.conns.items():  # one more block each, profiled (not timed)
                conn.send_bytes(b"p")
                if self._next(side, 300) is not None:
                    raise RuntimeError(f"{side} ended before the lock-step did\n{self.log_tail(side)}")
            results = {}
            for side, conn in self.conns.items():
                conn.send_bytes(b"e")
                results[side] = self._next(side, 300)
            return results
        finally:
            for proc in self.procs.values():
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def peak_flops() -> float | None:
    import torch

    from linnaeus_accel.training.metrics.meter import PEAK_FLOPS

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


def record_rates(part: Part, rates: dict[str, list[float]], parameters: int) -> None:
    """Each side's median tokens/s and, with a known peak, its MFU (6 x parameters per token)."""
    peak = peak_flops()
    for side, side_rates in rates.items():
        median = statistics.median(side_rates)
        part.figures[f"{side} tokens/s"] = round(median)
        if peak:
            part.figures[f"{side} MFU"] = round(6 * parameters * median / peak, 4)


def run_part(ctx: Context) -> Part:
    part = Part(NAME, TITLE)
    sizes = FULL if ctx.full else TINY
    block = BLOCK if ctx.full else 2
    warmup = WARMUP if ctx.full else 1
    rounds = warmup + sizes["rounds"]
    steps = (2 + rounds) * block  # the first block, the rounds, the profiled block
    root = ctx.work / NAME
    root.mkdir(parents=True, exist_ok=True)
    tokens = root / "tokens.bin"
    windows = (steps + 2) * sizes["batch"] * 2  # room for every side, with margin
    write_tokens(tokens, windows * (sizes["seq_len"] - 1) + 1, sizes["vocab"])
    spec = {
        **{k: v for k, v in sizes.items() if k != "rounds"},
        "tokens": str(tokens), "block": block, "steps": steps, "cuda": ctx.cuda,
        "compile": ctx.cuda, "workers": 2, "out": str(root / "runs"),
    }  # fmt: skip
    specs = {side: {**spec, "side": side} for side in SIDES}
    ctx.say(f"throughput: {steps} steps a side, blocks of {block}, {sizes['rounds']} timed rounds")
    started = time.perf_counter()
    results = Referee(specs, root, ctx.cuda).play(rounds, first_timeout=900 if ctx.full else 300)
    part.figures["seconds_to_first_block"] = round(time.perf_counter() - started, 1)
    tokens_per_block = block * sizes["batch"] * (sizes["seq_len"] - 1)
    rates = {side: [tokens_per_block / t for t in results[side]["times"][warmup:]] for side in SIDES}
    for side in SIDES:
        part.check(
            f"{side}: every block timed", len(rates[side]) == sizes["rounds"], f"{len(rates[side])} blocks"
        )
    for side in SIDES:  # why a side is slower: the host's share of each block, its profile
        host = results[side]["host"][warmup:]
        part.figures[f"{side} host queued / block (median)"] = round(
            statistics.median(h / t for h, t in zip(host, results[side]["times"][warmup:], strict=True)), 3
        )
        part.figures[f"{side} profile"] = results[side]["diagnosis"]
    parameters = results["ours"]["parameters"]
    record_rates(part, rates, parameters)
    for other in ("accelerate", "plain"):
        ratios = [a / b for a, b in zip(rates["ours"], rates[other], strict=True)]
        ratio = statistics.median(ratios)
        part.figures[f"ours / {other}"] = round(ratio, 4)
        target = f"ours >= {TARGET} x {other}"
        # A tiny CPU run checks that the comparison runs, not its figures.
        ok = ratio >= TARGET if ctx.full else ratio > 0
        part.check(
            target if ctx.full else f"ours / {other} measured", ok, f"median of paired ratios {ratio:.4f}"
        )
    logged = results["ours"]["logged"]
    shares = [r["perf/data_time_share"] for r in logged if r.get("perf/data_time_share") is not None]
    if shares:
        part.figures["ours perf/data_time_share (median)"] = round(statistics.median(shares), 4)
    mfus = [r["perf/mfu"] for r in logged if r.get("perf/mfu") is not None]
    if mfus:
        # Its clock runs through the other sides' turns too: about a third of the MFU above.
        part.figures["ours perf/mfu as logged, lock-stepped (median)"] = round(statistics.median(mfus), 4)
    part.figures["parameters"] = parameters
    part.figures["tokens per step"] = sizes["batch"] * (sizes["seq_len"] - 1)
    part.figures["run_info"] = {
        k: results["ours"]["run_info"].get(k) for k in ("mixed_precision", "dynamo_backend", "device")
    }
    part.figures["losses (first logged)"] = {
        "ours": logged[0].get("train/loss") if logged else None,
        "accelerate": (results["accelerate"]["logged"] or [None])[0],
        "plain": (results["plain"]["logged"] or [None])[0],
    }
    os.sync()
    return part
