"""nanoGPT's recipe per optimizer step: our ``Trainer.fit`` against a plain PyTorch loop.

The recipe is ``examples/nanogpt.yaml`` with the GPT of ``examples/nanogpt_model.py`` (a model that
computes its own loss, ``TASK.MODEL_LOSS: true``), made small for a benchmark: 2 layers instead of
4 (n_embd 128, 4 heads, block 64, batch 32 as written), runs of 101 steps (51 for the A/A) with the
warmup a tenth of each, and validation (the recipe's 20 batches) and the checkpoint at the run's
last step instead of every 250 steps: after the lock-step has ended, so that no timed step holds
them.

The reference is the loop of nanoGPT's ``train.py``, without Accelerate or anything of ours:
``get_batch``'s random windows read from the training split's token array (``uint16``, as
nanoGPT's ``np.memmap``) and stacked as int64, the next batch fetched right after the forward,
``model(X, Y) -> (logits, loss)``, ``loss / accumulation``, backward, ``clip_grad_norm_(1.0)``,
AdamW with nanoGPT's parameter groups (weight decay 0.1 on the parameters of 2 or more dimensions,
none on the others; betas 0.9/0.99; torch's default kernels, as nanoGPT on a CPU), the LR set on
every group before each step, ``zero_grad(set_to_none=True)``, and a printed line every
``log_interval`` steps (one ``.item()``). Same weights (the same seed), same windows: the offsets
are ours' draws, computed before the loop (nanoGPT draws them with ``torch.randint``, a few µs a
step), so both sides train on the same batches and must log the same first loss. The one addition
to nanoGPT's loop: the loss is added up on the device every step so that the printed loss is the
interval's mean, as ours logs it (nanoGPT prints the last step's), which makes the two comparable.
The LR is ours' formula (warmup from ``WARMUP_LR``, then cosine to ``MIN_LR``; nanoGPT's warmup
differs by one step, see docs/coming-from-nanogpt.md), checked against the resolved plan's at
set-up.

Ours is the real loop (``linnaeus-accel train``'s ``Trainer.fit``): the random-window sampler and
DataLoader, the task's split of each window and its weighting of the model's loss, the step
(``training/step/optimizer_step.py``), the metric window, ``metrics.jsonl`` and the progress bar. Not the
schedule plot, which a run draws once at start-up on a thread (seconds of matplotlib here, sharing
the core with the first timed steps): ``outputs._draw_schedule`` is replaced for the run, as in
``resume_data``.

Lock-step as in ``step_overhead`` (``lockstep`` says how): one optimizer step of each side in
strict turn on one core with one torch thread, 6 runs (3 fresh pairs of workers, roles swapped
once on each), the first 10% of each run not counted. Rows: the median paired ratio ours / plain
per optimizer step (target: <= 1.0) and difference, and an A/A control (the plain loop
against itself: the noise floor). Every run stays inside the first epoch (196 steps of 32 windows).
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from types import ModuleType
from typing import Any

from .common import Row, paired, row
from .lockstep import REPO, Baton, Case, Segment, pooled, run_segments
from .workloads import fit_timed

BENCHMARK = "nanogpt_step"
OURS = "benchmarks.nanogpt_step:run_ours"
PLAIN = "benchmarks.nanogpt_step:run_plain"
PLAIN_NAME = "plain PyTorch loop (nanoGPT's train.py)"
EXAMPLE = REPO / "examples" / "nanogpt_model.py"
RECIPE = REPO / "examples" / "nanogpt.yaml"
SEED = 0  # model initialisation: the same weights on both sides
TARGET = 1.0  # ratio ours / plain: no slower than the plain loop

# The model and batch of each size (MODEL.OPTIONS and DATA.BATCH_SIZE over the recipe's), and the
# rounds of the full run, split over its 6 lock-step runs (each must stay inside the first epoch).
FULL = {"options": {"n_layer": 2}, "batch": None}
SMOKE = {"options": {"n_layer": 1, "n_embd": 32, "n_head": 2}, "batch": 8}
CASE = "nanogpt recipe (2 layers, n_embd 128, batch 32 x block 64)"
SMOKE_CASE = "nanogpt recipe, smoke size (1 layer, n_embd 32, batch 8 x block 64)"
AA_CASE = "A/A control: plain loop vs plain loop"
ROUNDS = 600
AA_ROUNDS = 300
SMOKE_ROUNDS = 12  # past one logging interval (10 steps): the losses are compared
WORKER_PAIRS = 3  # the rounds split over 6 runs: each pair of workers has its own bias (A/A ~1%)


# -- what both sides share (in a worker) -------------------------------------------------------------
def load_example() -> ModuleType:
    """examples/nanogpt_model.py, imported as the example and its test import it (registered in
    sys.modules: its dataclass looks its module up there), which registers MODEL.TYPE nanogpt. Once
    per process: a worker runs several sides."""
    module = sys.modules.get("nanogpt_model")
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location("nanogpt_model", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module


def build_run(spec: dict[str, Any]) -> tuple[Any, Any]:
    """(config, training dataset): the recipe at ``spec``'s size, for ``spec["steps"]`` steps, with
    validation and its checkpoint at the last step only."""
    from linnaeus_accel.config import load_config
    from linnaeus_accel.data import build_dataset

    size, steps = spec["size"], spec["steps"]
    opts = [x for key, value in size["options"].items() for x in (f"MODEL.OPTIONS.{key}", str(value))]
    if size["batch"] is not None:
        opts += ["DATA.BATCH_SIZE", str(size["batch"])]
    opts += [
        *("TRAIN.STEPS", str(steps), "LR_SCHEDULER.WARMUP_STEPS", str(max(1, steps // 10))),
        *("SCHEDULE.VALIDATION.INTERVAL_STEPS", str(steps), "SCHEDULE.CHECKPOINT.INTERVAL_STEPS", str(steps)),
        *("ENV.OUTPUT.BASE_DIR", spec["out"], "EXPERIMENT.NAME", spec["name"], "TRAIN.AUTO_RESUME", "false"),
    ]
    config = load_config(RECIPE, opts)
    train = build_dataset(config, "train")
    per_epoch = len(train) // config.DATA.BATCH_SIZE
    if steps > per_epoch:
        raise ValueError(f"{steps} steps do not fit in the first epoch ({per_epoch} steps)")
    return config, train


# -- ours ----------------------------------------------------------------------------------------------
def run_ours(spec: dict[str, Any], baton: Baton) -> dict[str, Any]:
    """Our ``Trainer.fit`` on the recipe, timed from the ``fault_point("optimizer_step")`` it calls
    after every optimizer step (``workloads.fit_timed``)."""
    import torch

    from linnaeus_accel import Trainer
    from linnaeus_accel.models import build_model
    from linnaeus_accel.run_directory import outputs as outputs_module

    load_example()
    config, train = build_run(spec)
    torch.manual_seed(SEED)
    model = build_model(config, train)
    # The schedule plot, drawn once at start-up on a thread (matplotlib: seconds of CPU on these
    # machines), would share the core with the first timed steps: not drawn (as in resume_data).
    real_draw = outputs_module._draw_schedule
    setattr(outputs_module, "_draw_schedule", lambda *args: None)  # noqa: B010
    try:
        _, losses = fit_timed(lambda: Trainer(config, model, train, None), baton)
    finally:
        setattr(outputs_module, "_draw_schedule", real_draw)  # noqa: B010
    return {"losses": losses}


# -- the plain loop ------------------------------------------------------------------------------------
def lr_function(config: Any, total_steps: int) -> Any:
    """The LR at update ``k`` (0-based): linear warmup from WARMUP_LR, then cosine to MIN_LR at the
    run's end, written out as a loop of one's own would (nanoGPT's ``get_lr``, ours' formula)."""
    s = config.LR_SCHEDULER
    base, floor, warmup_lr, warmup = s.BASE_LR, s.MIN_LR, s.WARMUP_LR, s.WARMUP_STEPS

    def get_lr(k: int) -> float:
        if k < warmup:
            return float(warmup_lr + (base - warmup_lr) * k / warmup)
        progress = min(1.0, (k - warmup) / max(1, total_steps - warmup))
        return float(floor + 0.5 * (base - floor) * (1.0 + math.cos(math.pi * progress)))

    return get_lr


def run_plain(spec: dict[str, Any], baton: Baton) -> dict[str, Any]:
    """nanoGPT's training loop in plain PyTorch (see the module's docstring). Stops when the referee
    ends the lock-step."""
    import numpy as np
    import torch

    from linnaeus_accel.schedule import resolve_plan

    # Set-up (not timed): the same config, data, weights, windows and LR as ours.
    example = load_example()
    config, train = build_run(spec)
    steps, batch_size = spec["steps"], config.DATA.BATCH_SIZE
    block_size = train.seq_len - 1
    grad_clip, log_interval = config.TRAIN.CLIP_GRAD, config.SCHEDULE.METRICS.STEP_INTERVAL
    accumulation = config.TRAIN.accumulation
    data: np.ndarray[Any, Any] = train.tokens  # the training split, uint16
    sampler = train.epoch_sampler(config.EXPERIMENT.SEED, True)
    sampler.set_epoch(1)  # the trainer's first epoch (epochs count from 1)
    draws = iter(sampler)
    offsets = torch.tensor(
        [
            [train._random.locate(next(draws))[1] for _ in range(batch_size)]
            for _ in range(steps * accumulation + 1)
        ]
    )
    get_lr = lr_function(config, steps)
    plan = resolve_plan(config, len(train) // batch_size, 1, len(train), train.tokens_per_sample)
    if any(abs(get_lr(k) - plan.lr(k)) > 1e-12 for k in range(steps)):
        raise AssertionError("the plain loop's LR function is not the plan's")
    torch.manual_seed(SEED)
    options = {"vocab_size": train.vocab_size, **dict(config.MODEL.OPTIONS)}
    model = example.GPT(example.GPTConfig(**options))
    parameters = list(model.parameters())
    decay = [p for p in parameters if p.dim() >= 2]
    no_decay = [p for p in parameters if p.dim() < 2]
    o = config.OPTIMIZER
    groups = [{"params": decay, "weight_decay": o.WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=0.0, betas=(o.BETAS[0], o.BETAS[1]), eps=o.EPS)

    def get_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ix = offsets[step]
        x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix])
        return x, y

    logged: dict[int, float] = {}
    loss_sum = torch.zeros(())
    model.train()
    X, Y = get_batch(0)
    t0 = time.time()
    for iter_num in range(steps):
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        for micro_step in range(accumulation):
            _, loss = model(X, Y)
            loss = loss / accumulation
            X, Y = get_batch(iter_num * accumulation + micro_step + 1)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        if not baton():
            break
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        if (iter_num + 1) % log_interval == 0:
            lossf = loss_sum.item() * accumulation / log_interval
            loss_sum.zero_()
            logged[iter_num + 1] = lossf
            print(f"iter {iter_num + 1}: loss {lossf:.4f}, time {dt * 1000:.2f}ms")
    return {"losses": logged}


# -- the rows ------------------------------------------------------------------------------------------
def check_same_loss(ours: dict[str, Any], plain: dict[str, Any]) -> str:
    """Same weights, same windows: the first loss both logged agrees (a note), or the plain loop does
    not compute what ours does (an error)."""
    common = sorted(set(ours["losses"]) & set(plain["losses"]))
    if not common:
        return "losses not compared (no logging step in the lock-step)"
    step = common[0]
    a, b = float(ours["losses"][step]), float(plain["losses"][step])
    if abs(a - b) > 1e-5 * max(abs(a), abs(b)):
        raise AssertionError(
            f"the plain loop's loss at step {step} is {b}, ours {a}: not the same computation"
        )
    return f"train/loss at step {step}: " + (
        f"{a:.6f} both sides" if a == b else f"{a:.6f} ours, {b:.6f} plain"
    )


def per_run(segments: list[Segment]) -> str:
    """The median difference of each lock-step run (ms)."""
    medians = [paired(*pooled([segment]))["diff"] * 1e3 for segment in segments]
    return "per run " + ", ".join(f"{m:+.2f}" for m in medians) + " ms"


def run(smoke: bool) -> list[Row]:
    size, case = (SMOKE, SMOKE_CASE) if smoke else (FULL, CASE)
    pairs, segments = (1, 1) if smoke else (WORKER_PAIRS, 2 * WORKER_PAIRS)
    jobs: list[Case] = []
    for name, side, rounds in [(case, OURS, ROUNDS), (AA_CASE, PLAIN, AA_ROUNDS)]:
        rounds = SMOKE_ROUNDS if smoke else rounds // segments
        spec = {"size": size, "steps": rounds + 1}
        jobs.append((name, {**spec, "side": side}, {**spec, "side": PLAIN}, rounds))
    results = run_segments(jobs, pairs, swap=not smoke)
    stats = paired(*pooled(results[case]))
    note = f"{check_same_loss(*results[case][0])}; {per_run(results[case])}"
    rows = [
        row(
            BENCHMARK,
            case,
            "s per optimizer step",
            PLAIN_NAME,
            **stats,
            target=f"ratio <= {TARGET:.1f}",
            # A smoke run's handful of pairs at toy size judges nothing.
            ok=None if smoke else stats["ratio"] <= TARGET,
            note=note,
        )
    ]
    stats = paired(*pooled(results[AA_CASE]))
    note = f"the noise floor: both sides run the plain loop; {per_run(results[AA_CASE])}"
    rows.append(row(BENCHMARK, AA_CASE, "s per optimizer step", PLAIN_NAME, **stats, note=note))
    return rows
