"""Part ``host_sync``: no synchronising CUDA call on the steps between metric records.

``configs/lm_tiny.yaml`` trains in bf16 on the GPU in this process with metrics every
``INTERVAL`` steps, under ``torch.cuda.set_sync_debug_mode("warn")`` from ``on_fit_start`` to
``on_fit_end`` (a callback): every call that makes the host wait for the GPU (a read-back such as
``.item()``, a blocking copy, a stream synchronisation) raises a warning, recorded here with its
Python stack and the global step. A call is expected where a value is meant to reach the host:
reading the metric window at a logging step (``flush``), validation, an epoch boundary, a
checkpoint and the end of the run (the stack says which). Every other one is a sync on a quiet step
and fails the part, listed by where it comes from (the innermost frame of ours, else the innermost).

On a machine without CUDA the part is not run (``set_sync_debug_mode`` needs it); the CPU suite's
``tests/test_host_sync.py`` checks the same loop for read-back ops. The training and the recorder
still run a few steps there, so that this code cannot rot.
"""

from __future__ import annotations

import collections
import os
import traceback
import warnings
from types import MappingProxyType
from typing import Any

from linnaeus_accel import Callback

from .common import CONFIGS, Context, Part

NAME, TITLE = "host_sync", "no host sync on quiet steps, on CUDA (torch.cuda.set_sync_debug_mode)"
CFG = CONFIGS / "lm_tiny.yaml"
INTERVAL = 10
SYNC_MESSAGE = "called a synchronizing CUDA operation"
# Where the loop reads values back on purpose (functions on the stack of an expected sync).
EXPECTED = {
    "flush": "metric window read at a logging step",
    "run_pass": "validation",
    "epoch_boundary": "epoch boundary",
    "save": "checkpoint",
    # Before a checkpoint, on a thread of its own (its stack does not hold the save that started it).
    "parameters_finite": "checkpoint",
    "finish": "end of the run",
    "tear_down": "end of the run",
    "on_fit_end": "end of the run",
}
OURS = os.sep + "linnaeus_accel" + os.sep


class SyncRecorder(Callback):
    """A callback that turns the sync debug mode on for the training loop and records each warning."""

    interval = MappingProxyType({"INTERVAL_STEPS": 10**9})  # its on_step_end is never due

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.trainer: Any = None
        self.events: list[tuple[int, list[traceback.FrameSummary]]] = []

    def on_fit_start(self, trainer: Any) -> None:
        import torch

        self.trainer = trainer
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")

    def on_fit_end(self, trainer: Any, summary: Any) -> None:
        import torch

        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")

    def showwarning(self, message: Any, category: Any, filename: str, lineno: int, *args: Any) -> None:
        if SYNC_MESSAGE in str(message) and self.trainer is not None:
            self.events.append((self.trainer.progress.global_step, traceback.extract_stack()[:-1]))


def where(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of ours (else the innermost), as ``file:line function``."""
    frames = [f for f in stack if OURS in f.filename] or stack
    frame = frames[-1]
    path = frame.filename.split(OURS, 1)[-1] if OURS in frame.filename else frame.filename
    return f"{path}:{frame.lineno} {frame.name}"


def reason(stack: list[traceback.FrameSummary]) -> str | None:
    """Why a sync is expected there, or None: a sync on a quiet step."""
    for frame in reversed(stack):
        if frame.name in EXPECTED and OURS in frame.filename:
            return EXPECTED[frame.name]
    return None


def run_part(ctx: Context) -> Part:
    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16" if ctx.cuda else "no"
    import torch

    from linnaeus_accel import Trainer
    from linnaeus_accel.config import load_config
    from linnaeus_accel.data import build_dataset
    from linnaeus_accel.models import build_model

    steps = 60 if ctx.cuda else 6
    batch = 16 if ctx.cuda else 4
    config = load_config(
        CFG,
        [
            *(
                "ENV.OUTPUT.BASE_DIR",
                str(ctx.work / NAME),
                "EXPERIMENT.NAME",
                "run",
                "ENV.PROGRESS_BAR",
                "false",
            ),
            *("DATA.BATCH_SIZE", str(batch), "TRAIN.TARGET_TOKENS", str(steps * batch * 128)),
            *("SCHEDULE.METRICS.STEP_INTERVAL", str(INTERVAL if ctx.cuda else 2)),
        ],
    )
    recorder = SyncRecorder(ctx.cuda)
    train, val = build_dataset(config, "train"), build_dataset(config, "val")
    torch.manual_seed(0)
    trainer = Trainer(config, build_model(config, train), train, val, callbacks=[recorder])
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = recorder.showwarning
        summary = trainer.fit()
    part = Part(NAME, TITLE)
    expected: collections.Counter[str] = collections.Counter()
    quiet: dict[str, list[int]] = collections.defaultdict(list)
    for step, stack in recorder.events:
        why = reason(stack)
        if why is not None:
            expected[why] += 1
        else:
            quiet[where(stack)].append(step)
    part.figures["steps"] = summary["global_step"]
    part.figures["metrics interval"] = config.SCHEDULE.METRICS.STEP_INTERVAL
    part.figures["synchronising calls, expected"] = dict(expected)
    part.figures["synchronising calls on quiet steps"] = {
        place: {"count": len(at), "at steps": sorted(set(at))[:20]} for place, at in quiet.items()
    }
    if not ctx.cuda:
        part.status, part.reason = (
            "not run",
            "no CUDA: torch.cuda.set_sync_debug_mode needs it (dry run on the CPU only)",
        )
        return part
    part.check("the run completed", summary["status"] == "completed", summary["status"])
    part.check("the debug mode saw the expected reads", sum(expected.values()) > 0, dict(expected))
    part.check(
        "no synchronising call on quiet steps",
        not quiet,
        "; ".join(f"{p}: {len(s)} calls" for p, s in quiet.items()) or "none",
    )
    return part
