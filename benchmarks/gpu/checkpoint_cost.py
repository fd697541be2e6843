"""Part ``checkpoint``: how long a checkpoint of the 124M GPT-2 with AdamW blocks the loop on the
GPU, in the default mode and with ``SCHEDULE.CHECKPOINT.ASYNC``, against a bare
``accelerator.save_state`` of the same state (what a hand-written loop does).

Two trainers (default and ASYNC) of part ``throughput``'s model in bf16, one AdamW step taken so
the optimizer holds its moments; then each round saves three ways back to back, as
``benchmarks/checkpoint.py`` does on the CPU: the bare ``save_state``, ours in the default mode,
ours with ASYNC. "blocked" is the time until our call returns and training may go on (default:
``save_state`` into the staging directory; ASYNC: the copy of the state to pinned host memory);
"commit" the time until the checkpoint is committed in the background (written, hashed, fsynced,
sealed). Ratios are each round's, against that round's bare save; the first round is a warm-up.
"""

from __future__ import annotations

import statistics
from typing import Any

from .common import Context, Part
from .throughput import FULL, TINY, write_tokens

NAME, TITLE = (
    "checkpoint",
    "checkpoint cost on the GPU, 124M GPT-2 + AdamW: default and ASYNC vs bare save_state",
)
ROUNDS_FULL, ROUNDS_TINY = 4, 2


def trainers(ctx: Context) -> dict[str, Any]:
    import os

    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16" if ctx.cuda else "no"
    import torch

    from linnaeus_accel.data import build_dataset
    from linnaeus_accel.models import build_model
    from linnaeus_accel.training.trainer import Trainer

    from .sides import ours_config

    sizes = FULL if ctx.full else TINY
    root = ctx.work / NAME
    root.mkdir(parents=True, exist_ok=True)
    tokens = root / "tokens.bin"
    write_tokens(tokens, 64 * sizes["batch"] * sizes["seq_len"], sizes["vocab"])
    spec = {**sizes, "tokens": str(tokens), "steps": 10, "block": 10, "workers": 0, "out": str(root)}
    out = {}
    for mode in ("default", "async"):
        checkpoint = {"ASYNC": mode == "async", "KEEP_LAST_N": 2, "KEEP_TOP_N": 0}
        config = ours_config(spec, name=mode, SCHEDULE={"CHECKPOINT": checkpoint})
        train = build_dataset(config, "train")
        torch.manual_seed(0)
        out[mode] = Trainer(config, build_model(config, train), train)
    return out


def run_part(ctx: Context) -> Part:
    from benchmarks.checkpoint import save_bare, save_ours, with_optimizer_state

    part = Part(NAME, TITLE)
    ours = trainers(ctx)
    for trainer in ours.values():
        with_optimizer_state(trainer)
    model = ours["default"].model
    part.figures["state"] = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "weights_mb": round(sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6),
        "parameter_dtype": str(next(model.parameters()).dtype),
        "device": str(next(model.parameters()).device),
    }
    rounds = ROUNDS_FULL if ctx.full else ROUNDS_TINY
    samples: dict[str, list[float]] = {k: [] for k in ("bare", "default blocked", "default commit",
                                                       "async blocked", "async commit")}  # fmt: skip
    root = ctx.work / NAME
    for step in range(1, rounds + 2):
        bare, _ = save_bare(ours["default"], root)
        timings = {mode: save_ours(trainer, step) for mode, trainer in ours.items()}
        ctx.say(f"round {step}: bare {bare:.3f} s, " + ", ".join(
            f"{m} blocked {b:.3f} s commit {c:.3f} s" for m, (b, c) in timings.items()))  # fmt: skip
        if step == 1:
            continue
        samples["bare"].append(bare)
        for mode, (blocked, committed) in timings.items():
            samples[f"{mode} blocked"].append(blocked)
            samples[f"{mode} commit"].append(committed)
    part.figures["bare save_state s"] = round(statistics.median(samples["bare"]), 3)
    for key in ("default blocked", "default commit", "async blocked", "async commit"):
        ratios = [a / b for a, b in zip(samples[key], samples["bare"], strict=True)]
        part.figures[f"{key} s"] = round(statistics.median(samples[key]), 3)
        part.figures[f"{key} / bare"] = round(statistics.median(ratios), 3)
    part.figures["rounds"] = rounds
    for trainer in ours.values():
        trainer.checkpoints.writer.worker.wait()
    part.check(
        "every checkpoint committed", all(len(v) == rounds for v in samples.values()), f"{rounds} rounds"
    )
    # ASYNC exists to block less than a save; in the default mode the loop waits for save_state.
    if ctx.full:
        ratio = part.figures["async blocked / bare"]
        part.check("ASYNC blocks less than a bare save_state", ratio < 1.0, f"ratio {ratio}")
    return part
