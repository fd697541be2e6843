"""Muon against AdamW on nanoGPT's character-level recipe: the validation loss after the same tokens,
the steps each needs to reach AdamW's final loss, and the optimizer's time per step.

The two recipes are ``examples/nanogpt.yaml`` (AdamW: peak LR 1e-3, betas 0.9/0.99, weight decay 0.1
on 2-D weights) and ``examples/nanogpt_muon.yaml`` (Muon at LR 0.02 on the hidden matrices, AdamW at
3e-3, betas 0.8/0.95, on the embeddings and gains), each trained as written by ``linnaeus-accel
train`` (``Trainer.fit`` in this process) except for the size: the GPT of
``examples/nanogpt_model.py`` with 2 layers of width 64 (block 64, batch 16 windows: 1,024 target
tokens a step) for ``STEPS`` steps, with the recipes' warmup and cosine shortened to a tenth of the
run (and Muon's momentum warmup, 300 of the recipe's 1,000 steps, to the same share), and
validation on the recipes' fixed 20-batch subset every ``EVERY`` steps (the last too). Same data,
same windows (``EXPERIMENT.SEED`` draws both the weights and the windows) for both recipes at a seed;
several seeds.

Rows, each the median over the seeds of the paired values (Muon, AdamW):

- the final validation loss after the same tokens (ratio < 1: Muon lower), against each recipe and
  against AdamW alone at the Muon recipe's AdamW LR (3e-3, a control: Muon's lead is not its
  higher LR);
- the steps to reach AdamW's final validation loss (the first validation at or under it; Muon
  that never reaches it counts the run's steps, and the row says so);
- the time of one optimizer step (``step()`` alone, over the same gradients, in strict turn on one
  core with one torch thread): Muon's Newton-Schulz iterations are 5 x 3 matrix products per
  hidden matrix, work AdamW does not do.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from .common import Row, paired, pin_to_one_core, row

BENCHMARK = "muon"
REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "nanogpt_model.py"
RECIPES = {"muon": REPO / "examples" / "nanogpt_muon.yaml", "adamw": REPO / "examples" / "nanogpt.yaml"}
# A control: AdamW alone at the peak LR the Muon recipe gives its AdamW side (3x AdamW's recipe), so
# that Muon's lead is not just a higher LR. Minimum LR and warmup start scale with it.
CONTROL = ["LR_SCHEDULER.BASE_LR", "3e-3", "LR_SCHEDULER.MIN_LR", "3e-4"]
STEPS, EVERY, SEEDS = 300, 25, (0, 1, 2)
SMOKE_STEPS, SMOKE_EVERY, SMOKE_SEEDS = 4, 2, (0,)
SIZE = [
    "MODEL.OPTIONS.n_layer", "2",
    "MODEL.OPTIONS.n_embd", "64",
    "MODEL.OPTIONS.n_head", "2",
    "DATA.BATCH_SIZE", "16",
]  # fmt: skip


def load_example() -> ModuleType:
    """examples/nanogpt_model.py, imported once (it registers MODEL.TYPE nanogpt)."""
    if "nanogpt_model" in sys.modules:
        return sys.modules["nanogpt_model"]
    spec = importlib.util.spec_from_file_location("nanogpt_model", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["nanogpt_model"] = module
    spec.loader.exec_module(module)
    return module


def train(
    recipe: str, seed: int, steps: int, every: int, root: Path, smoke: bool, extra: tuple[str, ...] = ()
) -> list[tuple[int, float]]:
    """(step, val/loss) of every validation of one run of ``recipe``, in order: all on the
    recipes' fixed subset (the last too), so that every point compares."""
    from linnaeus_accel.cli import main

    load_example()
    warmup = max(1, steps // 10)
    opts = [
        *SIZE,
        "TRAIN.STEPS", str(steps),
        "LR_SCHEDULER.WARMUP_STEPS", str(warmup),
        "SCHEDULE.VALIDATION.INTERVAL_STEPS", str(every),
        "SCHEDULE.CHECKPOINT.INTERVAL_STEPS", str(steps),
        "SCHEDULE.METRICS.STEP_INTERVAL", str(every),
        "EXPERIMENT.SEED", str(seed),
        "EXPERIMENT.NAME", f"{recipe}_{seed}{'_control' if extra else ''}",  # read back below
        "ENV.OUTPUT.BASE_DIR", str(root),
        "ENV.PROGRESS_BAR", "false",
        "SCHEDULE.VALIDATION.FINAL_EPOCH.WHOLE_SPLIT", "false",
        *extra,
    ]  # fmt: skip
    if smoke:
        opts += ["SCHEDULE.VALIDATION.MAX_BATCHES", "2"]
    # The recipes' warmup start (an absolute LR) is their peak / (WARMUP_STEPS + 1), as nanoGPT's.
    from linnaeus_accel.config import load_config

    config = load_config(RECIPES[recipe], opts)
    peak = config.LR_SCHEDULER.BASE_LR
    if config.OPTIMIZER.MUON.MOMENTUM_WARMUP_STEPS:  # the recipe's 300 of its 1,000 steps, in proportion
        opts += ["OPTIMIZER.MUON.MOMENTUM_WARMUP_STEPS", str(max(1, 3 * steps // 10))]
    opts += ["LR_SCHEDULER.WARMUP_LR", repr(peak / (warmup + 1))]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(["train", "--cfg", str(RECIPES[recipe]), "--opts", *opts])
    if code != 0:
        raise RuntimeError(f"{recipe} seed {seed} exited {code}: {err.getvalue()[-2000:]}")
    name = f"{recipe}_{seed}{'_control' if extra else ''}"
    records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    return [(r["global_step"], r["val/loss"]) for r in records if "val/loss" in r]


def steps_to_reach(curve: list[tuple[int, float]], target: float, steps: int) -> tuple[int, bool]:
    """The first validated step at or under ``target``, and whether it was reached at all."""
    reached = next((step for step, loss in curve if loss <= target), None)
    return (reached, True) if reached is not None else (steps, False)


def step_times(repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of one ``step()`` of each recipe's optimizer over the benchmark's model, in turn."""
    import torch

    from linnaeus_accel.config import load_config
    from linnaeus_accel.models import build_model
    from linnaeus_accel.optim import build_from_config
    from linnaeus_accel.training.start.setup import parameter_groups

    load_example()
    times: dict[str, list[float]] = {"muon": [], "adamw": []}
    sides = {}
    for recipe in times:
        config = load_config(RECIPES[recipe], [*SIZE, "MODEL.OPTIONS.vocab_size", "257"])

        class Data:  # the model reads its vocabulary from the options given above
            tokens_per_sample = 64

        torch.manual_seed(0)
        model = build_model(config, Data())
        optimizer = build_from_config(parameter_groups(model, config.OPTIMIZER, config.LR_SCHEDULER), config)
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 * group.get("lr_scale", 1.0)
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
        optimizer.step()  # the state exists from here on, as after a run's first step
        sides[recipe] = optimizer
    for _ in range(repeats):
        for recipe, optimizer in sides.items():
            started = time.perf_counter()
            optimizer.step()
            times[recipe].append(time.perf_counter() - started)
    return times["muon"], times["adamw"]


def run(smoke: bool) -> list[Row]:
    pin_to_one_core()
    steps, every, seeds = (SMOKE_STEPS, SMOKE_EVERY, SMOKE_SEEDS) if smoke else (STEPS, EVERY, SEEDS)
    finals: dict[str, list[float]] = {"muon": [], "adamw": [], "control": []}
    reach: dict[str, list[float]] = {"muon": [], "adamw": []}
    missed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            curves = {recipe: train(recipe, seed, steps, every, Path(tmp), smoke) for recipe in RECIPES}
            target = curves["adamw"][-1][1]
            finals["control"].append(
                train("adamw", seed, steps, every, Path(tmp), smoke, tuple(CONTROL))[-1][1]
            )
            for recipe, curve in curves.items():
                finals[recipe].append(curve[-1][1])
                at, reached = steps_to_reach(curve, target, steps)
                reach[recipe].append(float(at))
                missed += not reached
    size = f"{len(seeds)} seeds, {steps} steps of 1,024 tokens, 2 layers x 64"
    muon_times, adamw_times = step_times(5 if smoke else 200)
    return [
        row(
            BENCHMARK,
            "validation loss after the same tokens",
            "val/loss (nats)",
            "AdamW (examples/nanogpt.yaml)",
            **paired(finals["muon"], finals["adamw"]),
            note=f"{size}; Muon per seed {[round(v, 4) for v in finals['muon']]}, AdamW "
            f"{[round(v, 4) for v in finals['adamw']]}",
        ),
        row(
            BENCHMARK,
            "validation loss after the same tokens, AdamW at 3e-3",
            "val/loss (nats)",
            "AdamW alone at the Muon recipe's AdamW peak LR (3e-3)",
            **paired(finals["muon"], finals["control"]),
            note=f"{size}; the control per seed {[round(v, 4) for v in finals['control']]}",
        ),
        row(
            BENCHMARK,
            "steps to reach AdamW's final validation loss",
            "optimizer steps",
            "AdamW (examples/nanogpt.yaml)",
            **paired(reach["muon"], reach["adamw"]),
            note=f"{size}; validated every {every} steps"
            + (f"; {missed} run(s) never reached it (counted as {steps})" if missed else ""),
        ),
        row(
            BENCHMARK,
            "time of one optimizer step",
            "s per step() (one core, one torch thread)",
            "AdamW (examples/nanogpt.yaml)",
            **paired(muon_times, adamw_times),
            note=f"{len(muon_times)} steps each in strict turn; median Muon {statistics.median(muon_times):.2e} s",
        ),
    ]
