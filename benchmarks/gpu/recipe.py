"""Part ``recipe``: ``configs/gpt2_124m.yaml`` as it ships (124M GPT-2, micro-batch 64 x 1,024
tokens, accumulation 8, document masking, the chunked loss, fused AdamW, bf16, ``torch.compile``)
on a token file with end-of-document ids; its tokens/s and MFU, and a hand-written Accelerate loop
given the same settings beside it. The issue's goal: 40% MFU or more on an H100.

Ours is ``Trainer.fit`` on the recipe file itself, with only what a measurement must change given
as opts (the token file, the steps, the output directory; at tiny size the sizes too). The
hand-written loop builds the same transformers GPT-2, reads the same windows, gives the model the
positions of ``document_positions`` (``use_cache=False``), computes its loss with
``causal_lm_chunked_loss`` at the recipe's chunk size, steps fused AdamW (the recipe's betas and
weight decay) and accumulates the recipe's micro-batches with ``accelerator.accumulate``.

The two take turns on the GPU as in part ``throughput`` (its ``Referee``, the loops' processes of
``sides``), a block of ``BLOCK`` optimizer steps (0.5M tokens each) at a time, except that each
side's set-up, compilation and first block run alone and each side hands back its cached GPU
memory after every block: two sides at 64 x 1,024 do not fit on one 80 GB GPU at once. Its figures:
the median tokens/s and MFU of each (6 x parameters x tokens/s over the device's bf16 peak), the
median of the paired per-block ratios; the check: ours >= 0.98x the hand-written loop. MFU against
the 40% goal is a figure, not a check.

A third side, ours on ``configs/gpt2_124m_muon.yaml`` (``OPTIMIZER.NAME: muon``: torch's Muon on the
hidden 2-D weights, fused AdamW on the rest), takes its turns on the same data with the same opts:
its tokens/s, its step time over ours' (the median of paired per-block ratios) and the check that it
trains, read from its logged losses alone (the lock-step ends the run before it writes ``final/``).
Once the sides are done, ``optimizer.step()`` alone of each recipe's optimizer over the model's
parameters with random gradients, timed over blocks of steps. The Muon side and that timing run only
when the part may take ``MUON_MIN_LIMIT_S`` or more (``--budget-s`` can leave it less), so that a
short budget keeps the recipe's own comparison.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from .common import CONFIGS, Context, Part, tail
from .sides import BlockBaton, TokenWindows, cosine_lr, run_ours, worker
from .throughput import Referee, record_rates

NAME = "recipe"
TITLE = (
    "configs/gpt2_124m.yaml (124M GPT-2, masking, chunked loss, fused AdamW, bf16, compiled): ours vs "
    "hand-written, and ours with Muon (configs/gpt2_124m_muon.yaml)"
)
RECIPE, MUON_RECIPE = CONFIGS / "gpt2_124m.yaml", CONFIGS / "gpt2_124m_muon.yaml"
MUON = "ours, muon"
SIDES = ("ours", "accelerate", MUON)
# The part's time limit below which the Muon side and the optimizer-step timing are left out: the
# limit the part had without them (they were allowed about 60 s more on an H100).
MUON_MIN_LIMIT_S = 420
# optimizer.step() alone: untimed steps first (its state allocated), then blocks of steps.
OPTIMIZER_STEPS = {"full": (3, 20, 3), "tiny": (1, 2, 1)}  # (untimed, steps a block, blocks)
TARGET, GOAL_MFU = 0.98, 0.40
BLOCK, WARMUP, ROUNDS = 2, 1, 6  # a block: BLOCK optimizer steps of 0.5M tokens, about 2 s on an H100
# Tiny (CPU): every path at the smallest sizes.
TINY = {
    "batch": 2, "accumulation": 2, "seq_len": 17, "chunk": 8, "workers": 0,
    "model": {"vocab_size": 128, "n_positions": 17, "n_embd": 16, "n_layer": 1, "n_head": 2},
}  # fmt: skip


def sizes_of(full: bool) -> dict[str, Any]:
    """The recipe's sizes, read from its file (at tiny size, TINY's in their place)."""
    from linnaeus_accel.config.loading import read_yaml

    recipe = read_yaml(RECIPE)
    model = dict(recipe["MODEL"]["OPTIONS"])
    sizes = {
        "batch": recipe["DATA"]["BATCH_SIZE"],
        "accumulation": recipe["TRAIN"]["ACCUMULATION_STEPS"],
        "seq_len": recipe["DATA"]["DATASET"]["OPTIONS"]["seq_len"],
        "chunk": recipe["TASK"]["LOSS_CHUNK_TOKENS"],
        "workers": recipe["DATA"]["NUM_WORKERS"],
        "betas": recipe["OPTIMIZER"]["BETAS"],
        "weight_decay": recipe["OPTIMIZER"]["WEIGHT_DECAY"],
        "model": model,
    }
    if not full:
        sizes.update({**TINY, "model": {**model, **TINY["model"]}})
    return sizes


def write_documents(path: Path, count: int, vocab: int, longest: int) -> int:
    """Random token ids (uint16) in documents of 1 to ``longest`` tokens, each ended by the
    end-of-document id (``vocab - 1``, declared in the sidecar ``tokenize`` would write); the
    number of documents."""
    from linnaeus_accel.data.tokens.format import TokenSidecar, sidecar_path

    rng = np.random.default_rng(0)
    eos = vocab - 1
    tokens = rng.integers(0, eos, size=count, dtype=np.uint16)
    ends = np.cumsum(rng.integers(1, longest + 1, size=count // max(1, longest // 2) + 1))
    ends = ends[ends < count]
    tokens[ends] = eos
    tokens.tofile(path)
    sidecar = TokenSidecar(dtype="uint16", num_tokens=count, num_documents=len(ends), vocab_size=vocab,
                           eos_id=eos, max_token_id=eos, tokenizer={"type": "bytes"})  # fmt: skip
    sidecar_path(path).write_text(sidecar.to_json(), encoding="utf-8")
    return len(ends)


def recipe_opts(spec: dict[str, Any]) -> list[str]:
    """What ours changes of the recipe: its data, its length, where it writes (and at tiny size,
    its sizes); the rest is the file's."""
    opts = {
        "EXPERIMENT.NAME": spec.get("name", NAME),
        "ENV.OUTPUT.BASE_DIR": spec["out"],
        "ENV.PROGRESS_BAR": False,
        "DATA.DATASET.OPTIONS.paths": [spec["tokens"]],
        "DATA.DATASET.OPTIONS.seq_len": spec["seq_len"],
        "DATA.BATCH_SIZE": spec["batch"],
        "DATA.NUM_WORKERS": spec["workers"],
        "TASK.LOSS_CHUNK_TOKENS": spec["chunk"],
        "TRAIN.STEPS": spec["steps"],
        "TRAIN.ACCUMULATION_STEPS": spec["accumulation"],
        "TRAIN.AUTO_RESUME": False,
        "LR_SCHEDULER.WARMUP_STEPS": 2,  # the recipe's 700 are longer than the run
        "SCHEDULE.METRICS.STEP_INTERVAL": spec["block"],
        **{f"MODEL.OPTIONS.{k}": v for k, v in spec["model"].items()},
    }
    if not spec["cuda"]:
        opts["OPTIMIZER.IMPLEMENTATION"] = "auto"  # fused is the GPU's
    return [item for key, value in opts.items() for item in (key, json.dumps(value))]


def run_recipe_ours(spec: dict[str, Any], baton: BlockBaton) -> dict[str, Any]:
    from linnaeus_accel.config import load_config

    config = load_config(Path(spec.get("recipe", RECIPE)), recipe_opts(spec))
    return run_ours(spec, baton, config)


def run_recipe_muon(spec: dict[str, Any], baton: BlockBaton) -> dict[str, Any]:
    """Ours on the Muon recipe; should it fail, the side goes on taking (empty) turns, so that the
    others' comparison stands, and its result says the error."""
    try:
        return run_recipe_ours(spec, baton)
    except Exception:
        error = traceback.format_exc()
        print(error, flush=True)
        while baton():
            pass
        return {"error": error}


def run_recipe_accelerate(spec: dict[str, Any], baton: BlockBaton) -> dict[str, Any]:
    """The hand-written Accelerate loop with the recipe's settings, as its user would write it."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader
    from transformers import AutoConfig, AutoModelForCausalLM

    from linnaeus_accel.tasks.chunked_loss import causal_lm_chunked_loss
    from linnaeus_accel.tasks.document_masking import document_positions

    accelerator = Accelerator(
        mixed_precision="bf16" if spec["cuda"] else "no",
        dynamo_backend="inductor" if spec["compile"] else "no",
        gradient_accumulation_steps=spec["accumulation"],
        dataloader_config=DataLoaderConfiguration(non_blocking=True),
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec["model"]))
    loader = DataLoader(
        TokenWindows(spec["tokens"], spec["seq_len"]), batch_size=spec["batch"], shuffle=True,
        drop_last=True, num_workers=spec["workers"], persistent_workers=spec["workers"] > 0,
        pin_memory=spec["cuda"], generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    decay = [p for p in model.parameters() if p.dim() >= 2]  # no decay on biases and norms
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": spec["weight_decay"]}, {"params": rest, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=0.0, betas=tuple(spec["betas"]), fused=spec["cuda"])
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    eos, targets = spec["vocab"] - 1, spec["batch"] * (spec["seq_len"] - 1)
    loss_sum = torch.zeros((), device=accelerator.device)
    logged: list[float] = []
    step = 0
    while step < spec["steps"]:
        for window in loader:
            with accelerator.accumulate(model):
                extra = {"position_ids": document_positions(window, eos), "use_cache": False}
                batch = {"input_ids": window, "labels": window}
                loss = causal_lm_chunked_loss(model, batch, spec["chunk"], -100, extra) / targets
                accelerator.backward(loss)  # divided by the accumulation steps there
                if accelerator.sync_gradients:
                    for group in optimizer.param_groups:
                        group["lr"] = cosine_lr(step, spec["steps"])
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()  # a no-op until the last micro-batch of the step
                optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
            if not accelerator.sync_gradients:
                continue
            step += 1
            if not baton():
                return {"logged": logged}
            if step % spec["block"] == 0:
                logged.append(loss_sum.item() / (spec["block"] * spec["accumulation"]))
                loss_sum.zero_()
    return {"logged": logged}


LOOPS = {"ours": run_recipe_ours, "accelerate": run_recipe_accelerate, MUON: run_recipe_muon}


def optimizer_step_ms(spec: dict[str, Any], size: str) -> dict[str, Any]:
    """Milliseconds per ``optimizer.step()`` of each recipe's optimizer, built as the Trainer builds
    it (``parameter_groups``, the registry), over the model's parameters on the device, each with a
    random gradient, every group at its peak LR; the device synchronised around each block of
    steps, the median block. ``size``: ``full`` or ``tiny`` (how many steps)."""
    import torch

    from linnaeus_accel.config import load_config
    from linnaeus_accel.models import build_model
    from linnaeus_accel.optim import build_from_config
    from linnaeus_accel.training.start.setup import parameter_groups

    device = torch.device("cuda" if spec["cuda"] else "cpu")
    untimed, steps, blocks = OPTIMIZER_STEPS[size]
    out: dict[str, Any] = {}
    for label, recipe in (("adamw", RECIPE), ("muon", MUON_RECIPE)):
        config = load_config(recipe, recipe_opts(spec))
        torch.manual_seed(0)
        model = build_model(config, None).to(device)
        optimizer = build_from_config(parameter_groups(model, config.OPTIMIZER, config.LR_SCHEDULER), config)
        for group in optimizer.param_groups:
            group["lr"] = config.LR_SCHEDULER.BASE_LR * group.get("lr_scale", 1.0)
        for param in model.parameters():
            param.grad = torch.randn_like(param) * 1e-4  # about a clipped gradient's scale
        for _ in range(untimed):
            optimizer.step()
        times = []
        for _ in range(blocks):
            if spec["cuda"]:
                torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(steps):
                optimizer.step()
            if spec["cuda"]:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - started) / steps)
        out[f"{label} ms"] = round(statistics.median(times) * 1e3, 3)
        if label == "muon":
            muon = [p for g in optimizer.param_groups if g.get("algorithm") == "muon" for p in g["params"]]
            out["muon side: tensors, parameters"] = [len(muon), sum(p.numel() for p in muon)]
        del model, optimizer
        if spec["cuda"]:
            torch.cuda.empty_cache()
    out["muon / adamw"] = round(out["muon ms"] / out["adamw ms"], 3)
    out["adamw"] = "fused" if spec["cuda"] else "torch's default"
    return out


def check_muon(part: Part, full: bool, result: dict[str, Any], rates: dict[str, list[float]]) -> None:
    """The Muon side's check and figures: it trains (its logged losses finite and, at full size,
    lower at the last block than at the first), its step time over ours'."""
    if "error" in result:
        part.check(f"{MUON}: trains", False, tail(result["error"], 5))
        return
    logged = result["logged"]
    losses = [r["train/loss"] for r in logged if r.get("train/loss") is not None]
    finite = len(losses) >= 2 and all(map(math.isfinite, losses))
    # At tiny size a block is a few dozen random tokens: its loss is noise, so only finite is asked.
    name = f"{MUON}: loss finite and falling" if full else f"{MUON}: loss logged and finite"
    part.check(name, finite and (losses[-1] < losses[0] or not full), [round(x, 4) for x in losses])
    part.figures.setdefault("losses (first logged)", {})[MUON] = losses[0] if losses else None
    part.figures[f"{MUON} / ours step time"] = round(
        statistics.median(a / b for a, b in zip(rates["ours"], rates[MUON], strict=True)), 4
    )


def record_perf(part: Part, side: str, logged: list[dict[str, Any]]) -> None:
    """What ``side`` (one of ours) logged as ``perf/``: the median of each."""
    for key in ("perf/data_time_share", "perf/mfu"):
        values = [r[key] for r in logged if r.get(key) is not None]
        if values:  # its clock runs through the other sides' turns too
            part.figures[f"{side} {key} as logged, lock-stepped (median)"] = round(
                statistics.median(values), 4
            )


def with_muon(part: Part, ctx: Context) -> bool:
    """Whether the Muon side runs; if not, why is noted in ``part.not_run``."""
    import torch

    if not hasattr(torch.optim, "Muon"):
        part.not_run.append(f"{MUON}: torch {torch.__version__} has no torch.optim.Muon (2.9 or newer)")
        return False
    if ctx.full and ctx.limit_s is not None and ctx.limit_s < MUON_MIN_LIMIT_S:  # tiny: seconds
        part.not_run.append(
            f"{MUON}: the part may take {ctx.limit_s:.0f} s, under {MUON_MIN_LIMIT_S} (--budget-s)"
        )
        return False
    return True


def run_part(ctx: Context) -> Part:
    part = Part(NAME, TITLE)
    sizes = sizes_of(ctx.full)
    block, warmup, rounds = (BLOCK, WARMUP, ROUNDS) if ctx.full else (1, 1, 2)
    steps = (2 + warmup + rounds) * block  # the first block, the rounds, the profiled block
    root = ctx.work / NAME
    root.mkdir(parents=True, exist_ok=True)
    tokens = root / "tokens.bin"
    vocab, seq_len = sizes["model"]["vocab_size"], sizes["seq_len"]
    windows = (steps + 2) * sizes["accumulation"] * sizes["batch"] * 2  # every side, the held-out share
    documents = write_documents(tokens, windows * (seq_len - 1) + 1, vocab, longest=(seq_len - 1) // 2)
    spec = {
        **sizes, "vocab": vocab, "tokens": str(tokens), "block": block, "steps": steps, "cuda": ctx.cuda,
        "compile": ctx.cuda, "alone": True, "out": str(root / "runs"),
    }  # fmt: skip
    sides = SIDES if with_muon(part, ctx) else SIDES[:2]
    specs = {side: {**spec, "side": side} for side in sides}
    if MUON in specs:  # a run directory of its own
        specs[MUON].update(recipe=str(MUON_RECIPE), name=f"{NAME}_muon")
    ctx.say(f"recipe: {steps} steps a side, blocks of {block}, {rounds} timed rounds, {documents} documents")
    started = time.perf_counter()
    referee = Referee(specs, root, ctx.cuda, module="benchmarks.gpu.recipe")
    results = referee.play(warmup + rounds, first_timeout=900 if ctx.full else 300, alone=True)
    part.figures["seconds_to_first_block"] = round(time.perf_counter() - started, 1)
    tokens_per_block = block * sizes["accumulation"] * sizes["batch"] * (seq_len - 1)
    timed = [side for side in sides if "error" not in results[side]]
    rates = {side: [tokens_per_block / t for t in results[side]["times"][warmup:]] for side in timed}
    for side in timed:
        part.check(f"{side}: every block timed", len(rates[side]) == rounds, f"{len(rates[side])} blocks")
        part.figures[f"{side} profile"] = results[side]["diagnosis"]
    parameters = results["ours"]["parameters"]
    record_rates(part, rates, parameters)
    ratio = statistics.median(a / b for a, b in zip(rates["ours"], rates["accelerate"], strict=True))
    part.figures["ours / accelerate"] = round(ratio, 4)
    # A tiny CPU run checks that the comparison runs, not its figures.
    name = f"ours >= {TARGET} x accelerate" if ctx.full else "ours / accelerate measured"
    part.check(name, ratio >= TARGET if ctx.full else ratio > 0, f"median of paired ratios {ratio:.4f}")
    part.figures["MFU goal (H100)"] = GOAL_MFU
    part.figures["ours MFU >= goal"] = (
        part.figures["ours MFU"] >= GOAL_MFU if "ours MFU" in part.figures else None
    )
    logged = results["ours"]["logged"]
    losses = [r["train/loss"] for r in logged if r.get("train/loss") is not None]
    part.check("ours: loss logged and finite", bool(losses) and all(np.isfinite(losses)), losses[:3])
    part.figures["losses (first logged)"] = {
        "ours": losses[0] if losses else None,
        "accelerate": (results["accelerate"]["logged"] or [None])[0],
    }
    record_perf(part, "ours", logged)
    if MUON in results:
        check_muon(part, ctx.full, results[MUON], rates)
        record_perf(part, MUON, results[MUON].get("logged", []))
        try:
            part.figures["optimizer.step() alone"] = optimizer_step_ms(spec, ctx.size)
        except Exception as exc:
            traceback.print_exc()
            part.check("optimizer.step() alone timed", False, f"{type(exc).__name__}: {exc}")
    part.figures["parameters"] = parameters
    part.figures["tokens per step"] = sizes["accumulation"] * sizes["batch"] * (seq_len - 1)
    part.figures["documents in the token file"] = documents
    part.figures["run_info"] = {
        k: results["ours"]["run_info"].get(k) for k in ("mixed_precision", "dynamo_backend", "device")
    }
    os.sync()
    return part


if __name__ == "__main__":  # one side's process, started by the Referee
    worker(int(sys.argv[1]), LOOPS)
