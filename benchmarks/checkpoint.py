"""Checkpoint cost: how long training is blocked, and how long until the checkpoint is committed,
in both modes, against a bare ``accelerator.save_state`` of the same state.

The state is the default task's MLP widened to ~50 MB of fp32 weights, with AdamW's two moments
(~150 MB in all). One round saves it three ways back to back on the same Accelerator: a bare
``save_state`` into a fresh directory (the reference, as a hand-written loop would checkpoint), the
trainer's own checkpoint (``CheckpointManager.save``: the non-finite check, the state, the
commit) with ``SCHEDULE.CHECKPOINT.ASYNC`` false, then true. For ours, "blocked" is the time until
the call returns (the loop goes on), "commit" the time until the background commit has finished
(hashes and fsync, marker; retention follows it). Each round's ratios are taken against that
round's bare save: the machine's drift between rounds cancels. The commit is also compared with a
bare save whose files are then fsynced: the part of the commit that is durability itself.

Not pinned to one core (unlike the step benchmarks): a checkpoint's copy and writes use what torch
and the kernel use in a real run, and the background commit runs on its own threads.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import Row, paired, row

BENCHMARK = "checkpoint"
REFERENCE = "bare accelerator.save_state"
TARGETS = {  # (ours / bare save_state) medians
    ("default", "blocked"): 1.10,
    ("async", "blocked"): 0.30,
    ("async", "commit"): 1.5,
}


def _trainer(root: Path, hidden: int, asynchronous: bool) -> Any:
    from linnaeus_accel.config import load_config
    from linnaeus_accel.data import build_dataset
    from linnaeus_accel.models import build_model
    from linnaeus_accel.training.trainer import Trainer

    config = load_config(
        Path(__file__).resolve().parent.parent / "configs" / "default.yaml",
        [
            "ENV.OUTPUT.BASE_DIR", str(root),
            "EXPERIMENT.NAME", "async" if asynchronous else "default",
            "MODEL.OPTIONS.hidden", str(hidden),
            "SCHEDULE.CHECKPOINT.ASYNC", str(asynchronous).lower(),
            "SCHEDULE.CHECKPOINT.KEEP_LAST_N", "2",
        ],
    )  # fmt: skip
    train, val = build_dataset(config, "train"), build_dataset(config, "val")
    return Trainer(config, build_model(config, train), train, val)


def with_optimizer_state(trainer: Any) -> None:
    """One AdamW step, so the optimizer holds its two moments as in any checkpoint after step 1."""
    for p in trainer.model.parameters():
        p.grad = p.detach().mul(1e-3)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def save_ours(trainer: Any, step: int) -> tuple[float, float]:
    """Our checkpoint of ``step``: (seconds until the loop may go on, until it is committed)."""
    trainer.checkpoints.writer.worker.wait()  # the previous round's work is not this round's cost
    trainer.progress.global_step = step
    started = time.perf_counter()
    trainer.checkpoints.save(boundary=None)
    blocked = time.perf_counter() - started
    trainer.checkpoints.writer.worker.wait()  # retention follows the commit: not part of it
    committed = trainer.checkpoints.writer.committed_at - started
    failure = trainer.checkpoints.writer.worker.take_failure()
    if failure is not None:
        raise RuntimeError(f"checkpoint of step {step} failed: {failure.__cause__}")
    return blocked, committed


def save_bare(trainer: Any, root: Path) -> tuple[float, float]:
    """A bare ``save_state``: (seconds it took, seconds until its files were also fsynced)."""
    target = root / "bare"
    shutil.rmtree(target, ignore_errors=True)
    started = time.perf_counter()
    trainer.accelerator.save_state(str(target))
    saved = time.perf_counter() - started
    for file in sorted(target.rglob("*")):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return saved, time.perf_counter() - started


def run(smoke: bool) -> list[Row]:
    from accelerate.state import AcceleratorState, GradientState

    hidden, rounds = (256, 3) if smoke else (2900, 15)
    samples: dict[str, list[float]] = {
        k: []
        for k in ("bare", "durable", "default blocked", "default commit", "async blocked", "async commit")
    }
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as tmp:
        root = Path(tmp)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        ours = {mode: _trainer(root, hidden, mode == "async") for mode in ("default", "async")}
        for trainer in ours.values():
            with_optimizer_state(trainer)
        size = sum(p.numel() * p.element_size() for p in ours["default"].model.parameters())
        for step in range(1, rounds + 2):  # the first round warms up (buffers, page cache): dropped
            bare, durable = save_bare(ours["default"], root)
            timings = {mode: save_ours(trainer, step) for mode, trainer in ours.items()}
            if step == 1:
                continue
            samples["bare"].append(bare)
            samples["durable"].append(durable)
            for mode, (blocked, committed) in timings.items():
                samples[f"{mode} blocked"].append(blocked)
                samples[f"{mode} commit"].append(committed)
    rows: list[Row] = []
    note = f"model {size / 1e6:.0f} MB fp32 + AdamW moments; {rounds} rounds after 1 warm-up"
    for mode in ("default", "async"):
        for kind in ("blocked", "commit"):
            stats = paired(samples[f"{mode} {kind}"], samples["bare"])
            limit = TARGETS.get((mode, kind))
            rows.append(
                row(
                    BENCHMARK,
                    f"{kind}, {'ASYNC' if mode == 'async' else 'default'} mode",
                    "s per checkpoint",
                    REFERENCE,
                    **stats,
                    target=f"ratio <= {limit:.2f}" if limit is not None else None,
                    ok=(stats["ratio"] <= limit) if limit is not None else None,
                    note=note,
                )
            )
    # A committed checkpoint is on disk (fsynced); a bare save_state is only in the page cache. The
    # commit against a bare save_state whose files are fsynced too: what durability itself costs.
    for mode in ("default", "async"):
        rows.append(
            row(
                BENCHMARK,
                f"commit, {'ASYNC' if mode == 'async' else 'default'} mode, vs a durable bare save",
                "s per checkpoint",
                f"{REFERENCE} + fsync of its files",
                **paired(samples[f"{mode} commit"], samples["durable"]),
                note=note,
            )
        )
    return rows
