"""Our ``Trainer.fit`` against ``transformers.Trainer`` on the same workload, with validation and a
checkpoint every epoch.

Both train the same model from the same weights on the same data (each shuffles it its own way)
with the same batch size, optimizer (AdamW), clipping, LR function (ours is the resolved plan's;
transformers' is a ``LambdaLR`` over the same function), logging interval and loss (the hand
loop's, in a ``compute_loss``); after every epoch both validate on the validation split and write
a checkpoint (model, optimizer, RNG; keeping the last 2). transformers' defaults stay as a user gets them
(its NaN filter reads the loss back every step, its progress bar, its ``trainer_state.json``);
its validation computes the loss only, ours also the accuracies.

Lock-step as in ``step_overhead`` (``lockstep`` says how): transformers' side hands the baton
over from a ``TrainerCallback``'s ``on_step_end``, which it calls after the optimizer and LR
steps and before logging, evaluation and saving, the place where ours calls its fault point.
Rows: the median paired difference and ratio per optimizer step (epoch boundaries are 1 interval
in 45 and barely move a median); per whole epoch: the intervals of one epoch's steps plus the
boundary before them (validation and checkpoint), paired epoch by epoch; and the boundary alone
(the interval holding validation, checkpoint and the next epoch's first step). The first epoch is
not counted. transformers missing: one row saying how to install it.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

from .common import Row, paired, row
from .lockstep import Baton, Case, Segment, pooled, run_segments
from .workloads import OURS, build_run, hand_loss, loss_weights, seeded_model

BENCHMARK = "hf_trainer"
REFERENCE = "transformers.Trainer"
INSTALL = "skipped: pip install -e '.[bench]'"
SIDE = "benchmarks.hf_trainer:run_hf"
# (workload, epochs in each of the full run's 4 lock-step runs); the smoke run: the mlp, 2 epochs.
CASES = [("mlp", 10), ("convnet", 6)]
SMOKE_EPOCHS = 2
WORKER_PAIRS = 2  # each runs every case twice, roles swapped (see lockstep.run_segments)


def run_hf(spec: dict[str, Any], baton: Baton) -> dict[str, Any]:
    """transformers' side (in a worker): ``Trainer.train`` on the workload of ``spec``."""
    import torch
    from torch.utils.data import default_collate
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from linnaeus_accel.schedule import resolve_plan

    config, train, val = build_run(spec)
    model = seeded_model(config, train)
    batch_size, accumulation = config.DATA.BATCH_SIZE, config.TRAIN.accumulation
    plan = resolve_plan(config, math.ceil(len(train) / batch_size), 1, len(train))
    weights = loss_weights(config, "cpu")
    workload = spec["workload"]

    class LockStep(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            baton()

    class WorkloadTrainer(Trainer):
        def compute_loss(
            self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
        ) -> Any:
            loss, _ = hand_loss(workload, model, inputs, weights)
            return (loss, {}) if return_outputs else loss  # evaluation asks for outputs too: none

    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0, weight_decay=0.0)
    lr = torch.optim.lr_scheduler.LambdaLR(optimizer, plan.lr)  # 1.0 x the plan's LR at each step
    args = TrainingArguments(
        output_dir=f"{spec['out']}/{spec['name']}",
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=config.DATA.BATCH_SIZE_VAL or batch_size,
        gradient_accumulation_steps=accumulation,
        num_train_epochs=plan.epochs,
        max_grad_norm=config.TRAIN.CLIP_GRAD or 0.0,
        logging_steps=plan.metrics_interval,
        eval_strategy="epoch",
        save_strategy="epoch",
        save_total_limit=2,
        seed=config.EXPERIMENT.SEED,
        use_cpu=True,
        report_to="none",
        label_names=["labels"],  # the model takes one batch argument: tell evaluation where labels are
        remove_unused_columns=False,  # else dropped: the batch is not the model's keyword arguments
        prediction_loss_only=True,
        dataloader_pin_memory=False,  # nothing to pin on the CPU
    )
    trainer = WorkloadTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=val,
        data_collator=default_collate,  # ours batches with torch's default too
        optimizers=(optimizer, lr),
        callbacks=[LockStep()],
    )
    trainer.train()
    state = trainer.state
    losses = {h["step"]: h["loss"] for h in state.log_history if "loss" in h}
    return {"losses": losses, "steps_per_epoch": state.max_steps // plan.epochs}


def run(smoke: bool) -> list[Row]:
    if importlib.util.find_spec("transformers") is None:
        return [row(BENCHMARK, "mlp", "s per optimizer step", REFERENCE, note=INSTALL, ok=None)]
    cases = [(w, SMOKE_EPOCHS if smoke else e) for w, e in CASES[: 1 if smoke else None]]
    jobs: list[Case] = []
    for workload, epochs in cases:  # both sides run to their end: whole epochs
        spec = {"workload": workload, "validate": True, "epochs": epochs}
        jobs.append((workload, {**spec, "side": OURS}, {**spec, "side": SIDE}, None))
    results = run_segments(jobs, 1 if smoke else WORKER_PAIRS, swap=not smoke)
    rows: list[Row] = []
    for workload, epochs in cases:
        segments = results[workload]
        taken = {side["steps_per_epoch"] for segment in segments for side in segment}
        if len(taken) != 1:
            raise AssertionError(f"{workload}: the sides took {sorted(taken)} steps per epoch, not the same")
        s = taken.pop()
        first = 1 if epochs > 2 else 0  # epochs not counted: start-up, first allocations
        note = f"{len(segments)} runs of {epochs} epochs of {s} steps, validation and a checkpoint after each"
        steps = paired(*pooled(segments, skip=first * s))
        rows.append(row(BENCHMARK, workload, "s per optimizer step", REFERENCE, **steps, note=note))
        whole = paired(*pooled([_epochs(segment, s, s) for segment in segments], skip=first))
        unit = "s per epoch (steps, validation, checkpoint)"
        rows.append(row(BENCHMARK, f"{workload}, whole epoch", unit, REFERENCE, **whole, note=note))
        boundary = paired(*pooled([_epochs(segment, s, 1) for segment in segments], skip=first))
        unit = "s per epoch boundary (validation, checkpoint, next step)"
        rows.append(row(BENCHMARK, f"{workload}, epoch boundary", unit, REFERENCE, **boundary, note=note))
    return rows


def _epochs(segment: Segment, s: int, length: int) -> Segment:
    """Per-epoch times from a segment's step intervals (``s`` steps per epoch): the first
    ``length`` intervals of each epoch, the boundary before it included. Interval i ends at step
    i + 2 (1-based: the first step is not timed), so the intervals ending at steps k*s + 1 ...
    (k+1)*s, epoch k+1's steps after epoch k's boundary (validation, checkpoint), are
    i = k*s - 1 ... (k+1)*s - 2; the boundary is in the first of them."""

    def epochs(times: list[float]) -> list[float]:
        return [sum(times[k * s - 1 : k * s - 1 + length]) for k in range(1, (len(times) + 1) // s)]

    first, second = segment
    return {"times": epochs(first["times"])}, {"times": epochs(second["times"])}
