"""``linnaeus-accel plan`` for T = 10^3 ... 10^7 total steps, laid out two ways: few epochs of many
steps (10 epochs of T / 10 steps) and many epochs of one step (T epochs).

Each sample is one call of the command's entry point in this process (``cli.main``, output to a
buffer): the config is read and validated, the plan resolved and the summary printed, as a user's
``linnaeus-accel plan --cfg configs/default.yaml --dataset-size N`` does after the interpreter has
started (the dataset size is given, so no dataset is built). ``plan`` is a pure function of its
input, with no reference to pair it with: the rows are medians of repeated runs, and the target
sits 10x above them, far outside the machine's +-30% drift.

Target for the summary: under 0.1 s at every T in both layouts, what answers at once to a person at
a terminal. Reading the YAML config takes most of the ~6 ms; the plan itself takes < 1 ms at any T,
where one operation per epoch (``plan`` as first written: ~0.5 s at 10^5 epochs, ~45 s at 10^7) would
miss the target by 400x at 10^7 epochs. The JSON output (``--json --no-series``) lists every event
epoch, so its time follows its size (11 MB at 10^6 epochs): its rows have no target and stop at
10^6 epochs. (The per-step series ``--json`` adds is bounded: every step up to 10^5 steps, 10^4
samples beyond, up to ~0.5 s.)
"""

from __future__ import annotations

import contextlib
import io
import statistics
import time
from pathlib import Path

from .common import Row, pin_to_one_core, row

BENCHMARK = "plan"
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
BATCH = 32  # the default config's DATA.BATCH_SIZE: one batch per epoch for BATCH samples
TARGET_S = 0.1
EPOCHS_OF_FEW = 10


def plan_args(total_steps: int, layout: str) -> list[str]:
    """``plan`` arguments of a run of ``total_steps``: ``epochs`` (one step each) or ``steps`` (few
    epochs of many steps)."""
    if layout == "epochs":
        return ["--dataset-size", str(BATCH), "--opts", "TRAIN.EPOCHS", str(total_steps)]
    per_epoch = total_steps // EPOCHS_OF_FEW
    return ["--dataset-size", str(per_epoch * BATCH), "--opts", "TRAIN.EPOCHS", str(EPOCHS_OF_FEW)]


def time_plan(args: list[str]) -> tuple[float, int]:
    """Seconds one ``plan`` takes, and the length of what it printed."""
    from linnaeus_accel.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()) as err:
        started = time.perf_counter()
        code = main(["plan", "--cfg", str(CONFIG), *args])
        seconds = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"plan {' '.join(args)} exited {code}: {err.getvalue()}")
    return seconds, len(out.getvalue())


def _case(total_steps: int, layout: str) -> str:
    shape = (
        f"{total_steps:.0e} epochs x 1 step"
        if layout == "epochs"
        else f"{EPOCHS_OF_FEW} epochs x {total_steps // EPOCHS_OF_FEW:.0e} steps"
    )
    return f"T = {total_steps:.0e}: {shape}".replace("e+0", "e")


def run(smoke: bool) -> list[Row]:
    pin_to_one_core()
    repeats = 1 if smoke else 7
    rows: list[Row] = []
    for output, layouts in (("summary", ("steps", "epochs")), ("json", ("epochs",))):
        largest = 10**7 if output == "summary" else (10**3 if smoke else 10**6)
        for layout in layouts:
            exponent = 3
            while 10**exponent <= largest:
                total = 10**exponent
                args = plan_args(total, layout) + (["--json", "--no-series"] if output == "json" else [])
                time_plan(args)  # warm-up: imports, the YAML parser
                samples = [time_plan(args) for _ in range(repeats)]
                seconds = statistics.median(s for s, _ in samples)
                size = samples[0][1]
                limited = output == "summary"
                rows.append(
                    row(
                        BENCHMARK,
                        f"{output}, {_case(total, layout)}",
                        "s per plan command (in process)",
                        ours=seconds,
                        reference=None,
                        diff=None,
                        ratio=None,
                        n=repeats,
                        target=f"< {TARGET_S:g} s" if limited else None,
                        ok=seconds < TARGET_S if limited else None,
                        note=f"{size / 1e6:.2f} MB printed" if size >= 1e5 else f"{size} characters printed",
                    )
                )
                exponent += 1
    return rows
