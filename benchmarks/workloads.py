"""The workloads ``step_overhead`` and ``hf_trainer`` train, our side and the hand-written
Accelerate loop they are compared with (each a side of ``lockstep``).

Our trainer gets its per-step baton without touching its hot path: the trainer module imports
``fault_point`` (the named fault points the kill tests use) and calls
``fault_point("optimizer_step")`` once after every optimizer step; ``run_ours`` replaces that name
in ``linnaeus_accel.training.trainer`` with the baton for the run (other points still reach the
real function). The call was there before, so our side does no work a normal run would not; the
hand loop calls its baton at the same place (after the optimizer step, before logging).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .lockstep import REPO, Baton

OURS = "benchmarks.workloads:run_ours"
HAND = "benchmarks.workloads:run_hand"
SEED = 0  # model initialisation: the same weights on every side


def windows(loader: Any, size: int) -> Iterator[list[Any]]:
    """The loader's batches in windows of ``size`` (an epoch's last window may be shorter)."""
    window: list[Any] = []
    for batch in loader:
        window.append(batch)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


# Each workload: its config file and the overrides that make it a fair comparison. The hierarchical
# task's schedule-driven transforms (metadata masking, mixup) are turned off: they are data
# augmentation a hand loop would call as well, not loop overhead; its loss (a cross-entropy per
# level over the labelled samples) and its metric window stay.
OFF = "false"
MLP_OPTS = [
    *("SCHEDULE.META_MASKING.ENABLED", OFF, "SCHEDULE.META_MASKING.PARTIAL.ENABLED", OFF),
    *("SCHEDULE.MIXUP.PROB.ENABLED", OFF, "SCHEDULE.VALIDATION.MASK_META_INTERVAL_EPOCHS", "null"),
    *("SCHEDULE.VALIDATION.PARTIAL_MASK_META.ENABLED", OFF),
    *("SCHEDULE.VALIDATION.FINAL_EPOCH.EXHAUSTIVE_PARTIAL_META_VALIDATION", OFF),
]
WORKLOADS = {
    "mlp": ("default.yaml", MLP_OPTS),
    "convnet": ("digits_classification.yaml", []),
    "lm": ("lm_tiny.yaml", []),
}


# -- one side's run (in a worker) ------------------------------------------------------------------
def build_run(spec: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(config, train dataset, validation dataset or None) of ``spec``: ``workload``, ``epochs``
    or ``steps`` (the least optimizer steps to train: whole epochs, or exactly that many target
    tokens),
    ``accumulation``, ``validate`` (validation and a checkpoint every epoch), ``out``, ``name``."""
    from linnaeus_accel.config import load_config
    from linnaeus_accel.data import build_dataset

    file, opts = WORKLOADS[spec["workload"]]
    accumulation = spec.get("accumulation", 1)
    common = [
        *opts,
        *("ENV.OUTPUT.BASE_DIR", spec["out"], "EXPERIMENT.NAME", spec["name"]),
        *("TRAIN.ACCUMULATION_STEPS", str(accumulation), "TRAIN.AUTO_RESUME", "false"),
    ]
    config = load_config(REPO / "configs" / file, common)
    train = build_dataset(config, "train")
    val = build_dataset(config, "val") if spec.get("validate") else None
    if "epochs" in spec:
        length = ["TRAIN.EPOCHS", str(spec["epochs"])]
    elif config.TRAIN.TARGET_TOKENS is not None:  # exactly ``steps`` steps of fixed-length samples
        tokens = spec["steps"] * config.DATA.BATCH_SIZE * accumulation * train.tokens_per_sample
        length = ["TRAIN.TARGET_TOKENS", str(tokens)]
    else:
        length = ["TRAIN.EPOCHS", str(math.ceil(spec["steps"] / _steps_per_epoch(config, train)))]
    # Validation and a checkpoint every epoch, or no validation and only the final checkpoint.
    every = "1" if spec.get("validate") else "1000000"
    schedule = ["SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", every, "SCHEDULE.VALIDATION.INTERVAL_EPOCHS", "1"]
    schedule += ["SCHEDULE.CHECKPOINT.KEEP_LAST_N", "2", "SCHEDULE.CHECKPOINT.KEEP_TOP_N", "0"]
    return load_config(REPO / "configs" / file, [*common, *length, *schedule]), train, val


def _steps_per_epoch(config: Any, train: Any) -> int:
    per_batch, accumulation = int(config.DATA.BATCH_SIZE), int(config.TRAIN.accumulation)
    batches = len(train) // per_batch if config.DATA.DROP_LAST else math.ceil(len(train) / per_batch)
    return math.ceil(batches / accumulation)


def seeded_model(config: Any, train: Any) -> Any:
    import torch

    from linnaeus_accel.models import build_model

    torch.manual_seed(SEED)
    return build_model(config, train)


def not_due_callback() -> Any:
    """A callback whose on_step_end is never due in the run (every 10^9 steps): what the loop pays
    for a callback that waits for its interval."""
    from linnaeus_accel import Callback

    class _NotDue(Callback):
        interval = MappingProxyType({"INTERVAL_STEPS": 10**9})

        def on_step_end(self, trainer: Any, step: int) -> None:
            raise AssertionError("not due")

    return _NotDue()


def fit_timed(make_trainer: Callable[[], Any], baton: Baton) -> tuple[Any, dict[int, float]]:
    """``make_trainer()``'s ``fit``, handing the core over (``baton``) after every optimizer step,
    where Trainer calls ``fault_point("optimizer_step")``; the trainer and its logged losses by step."""
    from linnaeus_accel.training import trainer as trainer_module

    names = vars(trainer_module)  # the module's globals: where Trainer looks ``fault_point`` up
    real_fault_point = names["fault_point"]

    def fault_point(name: str) -> None:
        if name == "optimizer_step":
            baton()
        else:
            real_fault_point(name)

    names["fault_point"] = fault_point
    try:
        trainer = make_trainer()
        trainer.fit()
    finally:
        names["fault_point"] = real_fault_point
    if baton.start is None:
        raise RuntimeError(
            "Trainer.fit never called fault_point('optimizer_step') in linnaeus_accel/training/trainer.py: "
            "the benchmark times each step from there (see benchmarks/workloads.py)"
        )
    lines = (trainer.config.output_dir / "metrics.jsonl").read_text().splitlines()
    return trainer, {r["global_step"]: r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r}


def run_ours(spec: dict[str, Any], baton: Baton) -> dict[str, Any]:
    """Our ``Trainer.fit``, as ``linnaeus-accel train`` runs it."""
    from linnaeus_accel import Trainer

    config, train, val = build_run(spec)
    model = seeded_model(config, train)
    callbacks = [not_due_callback()] if spec.get("callback") else []
    trainer, losses = fit_timed(lambda: Trainer(config, model, train, val, callbacks=callbacks), baton)
    return {"losses": losses, "steps_per_epoch": trainer.plan.optimizer_steps_per_epoch}


def loss_weights(config: Any, device: Any) -> Any:
    """The hierarchical levels' weights (LOSS.TASK_WEIGHTS), None when all are 1."""
    import torch

    weights = config.LOSS.TASK_WEIGHTS or [1.0, 1.0]
    return None if set(weights) == {1.0} else torch.tensor(weights, device=device)


def hand_loss(workload: str, model: Any, batch: Any, weights: Any) -> tuple[Any, Any]:
    """(loss, per-level losses or None): what a hand-written loop computes, missing labels masked
    the usual way (``ignore_index``: -1 for linnaeus' null label, -100 for the others); the
    levels' losses weighted by ``weights`` (None: all 1, a plain sum)."""
    import torch
    import torch.nn.functional as F

    if workload == "mlp":
        labels = batch["labels"]
        logits = model(batch)
        levels = torch.stack(
            [F.cross_entropy(lg, labels[:, i], ignore_index=-1) for i, lg in enumerate(logits)]
        )
        return (levels.sum() if weights is None else (weights * levels).sum()), levels
    if workload == "convnet":
        return F.cross_entropy(model(batch["image"]), batch["labels"]), None
    logits = model(batch["input_ids"]).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1)), None


def run_hand(spec: dict[str, Any], baton: Baton) -> dict[str, Any]:
    """A hand-written Accelerate loop over the same model, data (the same sampler, so the same
    batches), optimizer, accumulation, clipping, LR function and logging interval: the LR set
    before each step, losses added up on the device and read back once per logging interval (with
    the gradient norm), a JSON line and a progress bar, as Accelerate's and transformers' examples
    write them. Stops when the referee ends the lock-step.

    The leanest such loop, which is the hardest to match, in the trainer's shape: a window's
    micro-batches are loaded first, then each goes forward and backward (``no_sync`` on all but the
    last), as ours and transformers' Trainer do (interleaving loads and passes cost ~80 µs more a
    micro-batch in the lock-step: colder caches); not Accelerate's ``accumulate`` helper (~15 µs a
    micro-batch); the optimizer stepped once a window (``AcceleratedOptimizer.step`` where it does
    nothing still asks importlib twice whether an optional package is installed: ~100 µs); the
    parameters listed once for clipping; weights of 1 not multiplied."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    from linnaeus_accel.data.sampling import make_dataloader
    from linnaeus_accel.schedule import resolve_plan

    config, train, _ = build_run(spec)
    workload, accumulation = spec["workload"], config.TRAIN.accumulation
    accelerator = Accelerator(gradient_accumulation_steps=accumulation)
    set_seed(config.EXPERIMENT.SEED)
    model = seeded_model(config, train)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    loader = make_dataloader(config.DATA, config.EXPERIMENT.SEED, train, True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    parameters = list(model.parameters())
    plan = resolve_plan(config, len(loader), 1, len(train), getattr(train, "tokens_per_sample", None))
    weights = loss_weights(config, accelerator.device)
    interval, clip = plan.metrics_interval, config.TRAIN.CLIP_GRAD
    loss_sum = torch.zeros((), device=accelerator.device)
    level_sums = torch.zeros(len(config.LOSS.TASK_WEIGHTS or [1, 1]), device=accelerator.device)
    tokens = torch.zeros((), dtype=torch.int64, device=accelerator.device)
    logged: dict[int, float] = {}  # step -> logged train/loss
    step, micro_batches, samples, since, norm = 0, 0, 0, time.perf_counter(), None
    out = Path(spec["out"]) / spec["name"]
    out.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=plan.total_steps, desc="train", unit="step", dynamic_ncols=True)
    model.train()
    with (out / "metrics.jsonl").open("w") as metrics:
        for epoch in range(1, plan.epochs + 1):  # 1-based, as the trainer counts (the sampler is keyed by it)
            loader.set_epoch(epoch)
            for window in windows(loader, accumulation):
                for i, batch in enumerate(window):
                    last = i == len(window) - 1
                    with contextlib.nullcontext() if last else accelerator.no_sync(model):
                        loss, levels = hand_loss(workload, model, batch, weights)
                        accelerator.backward(loss)  # divided by the accumulation steps
                    loss_sum += loss.detach()
                    if levels is not None:
                        level_sums += levels.detach()
                    if workload == "lm":  # target tokens, counted on the device as any padded data needs
                        tokens += (batch["labels"][:, 1:] != -100).sum()
                    samples += len(batch["labels"])
                for group in optimizer.param_groups:
                    group["lr"] = plan.lr(step)
                norm = accelerator.clip_grad_norm_(parameters, clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                micro_batches += len(window)
                step += 1
                if not baton():
                    bar.close()
                    return {"losses": logged, "steps_per_epoch": plan.optimizer_steps_per_epoch}
                if step % interval == 0:
                    assert norm is not None
                    n, micro_batches = micro_batches, 0  # the window's mean over its micro-batches
                    values = torch.cat([loss_sum[None], level_sums, norm[None], tokens[None]]).tolist()
                    loss_sum.zero_(), level_sums.zero_(), tokens.zero_()
                    now = time.perf_counter()
                    record = {
                        "global_step": step,
                        "train/loss": values[0] / n,
                        "lr/default": plan.lr(step - 1),
                    }
                    if levels is not None:
                        record.update({f"train/loss_{k}": v / n for k, v in enumerate(values[1:-2])})
                    record.update(
                        {"train/grad_norm": values[-2], "perf/samples_per_s": samples / (now - since)}
                    )
                    if workload == "lm":
                        record["perf/tokens_per_s"] = values[-1] / (now - since)
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                    logged[step], samples, since = record["train/loss"], 0, now
                    bar.set_postfix({"loss": f"{record['train/loss']:.4f}"}, refresh=False)
                bar.update(1)
    bar.close()
    return {"losses": logged, "steps_per_epoch": plan.optimizer_steps_per_epoch}
