"""What our ``Trainer.fit`` costs per optimizer step over a hand-written Accelerate loop.

Both train the same model from the same weights on the same batches (same sampler) with the same
optimizer (AdamW), accumulation, clipping, LR function (the resolved plan's) and logging interval,
and compute the same loss (missing labels masked) into the same metric window (losses added up on
the device, read back once per logging interval); the hand loop is the leanest one in the
trainer's shape (``workloads.run_hand`` says what that means). They run in lock-step, one optimizer
step each, alternately, on one core with one torch thread (``lockstep`` says how), in 4 runs: 2
fresh pairs of worker processes, each with the roles swapped once. Each row gives the median of
the pooled paired differences (ours - hand, seconds per optimizer step) and ratios, and each
run's median difference in its note. Our side is the real loop: data loading, the task's loss, the
meter, the step, logging, the progress bar. The first 10% of each run is not counted (start-up).

Rows: ``mlp`` is linnaeus' hierarchical task on the digits (configs/default.yaml without its data
augmentation), once with one micro-batch per optimizer step and once with 4; the issue's target
(at most 25 µs per micro-batch over the hand loop) is checked on both. ``convnet``
(configs/digits_classification.yaml) and ``lm`` (configs/lm_tiny.yaml, a 0.9M-parameter Llama built
from its config) report the ratio. ``A/A`` runs the hand loop against itself: its difference and
ratio are the noise floor of this machine at that moment (0 and 1 in a quiet world). ``mlp: ours with
a callback not due`` runs our loop with a callback whose ``on_step_end`` waits for an interval the
run never reaches, against our loop without callbacks: what a callback costs when it is not due. The note of
each row also says whether both sides logged the same first training loss (they must, within the
first epoch).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from .common import Row, paired, row
from .lockstep import Case, Segment, pooled, run_segments
from .workloads import HAND as HAND_SIDE
from .workloads import OURS

BENCHMARK = "step_overhead"
TARGET_PER_MICRO_BATCH = 25e-6  # seconds over the hand loop
HAND = "hand-written Accelerate loop"
LM_INSTALL = "skipped: pip install -e '.[bench]' (the LM is a transformers model)"

# (case name, workload, micro-batches per optimizer step, rounds in the full run)
CASES = [
    ("mlp (hierarchical)", "mlp", 1, 2400),
    ("mlp (hierarchical), 4 micro-batches per step", "mlp", 4, 480),
    ("convnet", "convnet", 1, 640),
    ("lm", "lm", 1, 80),
]
AA_CASE = "A/A control: mlp, hand loop vs hand loop"
# Ours with a callback whose on_step_end is not due, against ours without (nil per step).
CALLBACK_CASE = "mlp: ours with a callback not due vs ours without"
CALLBACK_REFERENCE = "ours without callbacks"
SMOKE_ROUNDS = {"mlp": 24, "convnet": 6}  # mlp: past one logging interval (20 steps)
WORKER_PAIRS = 2  # each runs every case twice (roles swapped): the rounds are split in 4 segments


def check_same_loss(ours: dict[str, Any], hand: dict[str, Any]) -> str:
    """Both sides start from the same weights and see the same batches, so their first logged
    training loss agrees if the hand loop computes what the trainer does: a note for the row, or
    an error. Only within the first epoch: at its end, a window shorter than the accumulation
    steps is divided by its own samples in ours but by the accumulation steps in the hand loop
    (Accelerate's ``backward`` does that), and the two runs part ways by a hair."""
    common = sorted(set(ours["losses"]) & set(hand["losses"]))
    if not common:
        return "losses not compared (no logging step in the lock-step)"
    first = common[0]
    a, b = float(ours["losses"][first]), float(hand["losses"][first])
    same = abs(a - b) <= 1e-5 * max(abs(a), abs(b))
    if not same and first <= ours["steps_per_epoch"]:
        raise AssertionError(
            f"the hand loop's loss at step {first} is {b}, ours {a}: not the same computation"
        )
    return f"train/loss at step {first}: " + (
        f"{a:.6f} both sides" if same else f"{a:.6f} ours, {b:.6f} hand"
    )


def per_run(segments: list[Segment]) -> str:
    """The median difference of each lock-step run (µs): how far apart runs on fresh workers land."""
    medians = [paired(*pooled([segment]))["diff"] * 1e6 for segment in segments]
    return "per run " + ", ".join(f"{m:+.0f}" for m in medians) + " µs"


def run(smoke: bool) -> list[Row]:
    # The smoke run leaves out what only repeats code: a longer window, and transformers' import
    # (seconds) for the LM case.
    cases = [c for c in CASES if not smoke or (c[2] == 1 and c[1] in SMOKE_ROUNDS)]
    skipped: list[Row] = []
    if any(c[1] == "lm" for c in cases) and importlib.util.find_spec("transformers") is None:
        cases = [c for c in cases if c[1] != "lm"]
        skipped.append(row(BENCHMARK, "lm", "s per optimizer step", HAND, note=LM_INSTALL))
    pairs, segments = (1, 1) if smoke else (WORKER_PAIRS, 2 * WORKER_PAIRS)
    jobs: list[Case] = []
    for case, workload, accumulation, full_rounds in [*cases, (AA_CASE, "mlp", 1, CASES[0][3])]:
        rounds = SMOKE_ROUNDS[workload] if smoke else full_rounds // segments
        spec = {"workload": workload, "accumulation": accumulation, "steps": rounds + 1}
        ours = HAND_SIDE if case == AA_CASE else OURS
        jobs.append((case, {**spec, "side": ours}, {**spec, "side": HAND_SIDE}, rounds))
    rounds = SMOKE_ROUNDS["mlp"] if smoke else CASES[0][3] // segments
    spec = {"workload": "mlp", "accumulation": 1, "steps": rounds + 1, "side": OURS}
    jobs.append((CALLBACK_CASE, {**spec, "callback": True}, spec, rounds))
    results = run_segments(jobs, pairs, swap=not smoke)
    rows: list[Row] = []
    for case, workload, accumulation, _ in cases:
        stats = paired(*pooled(results[case]))
        notes = [check_same_loss(*results[case][0]), per_run(results[case])]
        fields: dict[str, Any] = {}
        if workload == "mlp":
            per_micro_batch = stats["diff"] / accumulation
            fields = {
                "target": f"diff per micro-batch <= {TARGET_PER_MICRO_BATCH * 1e6:.0f} µs",
                # A smoke run's handful of pairs cannot judge a difference of microseconds.
                "ok": None if smoke else per_micro_batch <= TARGET_PER_MICRO_BATCH,
            }
            notes.append(f"{per_micro_batch * 1e6:.1f} µs per micro-batch")
        rows.append(
            row(BENCHMARK, case, "s per optimizer step", HAND, **stats, **fields, note="; ".join(notes))
        )
    rows += skipped
    stats = paired(*pooled(results[CALLBACK_CASE]))
    note = f"{check_same_loss(*results[CALLBACK_CASE][0])}; {per_run(results[CALLBACK_CASE])}"
    rows.append(row(BENCHMARK, CALLBACK_CASE, "s per optimizer step", CALLBACK_REFERENCE, **stats, note=note))
    stats = paired(*pooled(results[AA_CASE]))
    note = f"the noise floor: both sides run the same hand loop; {per_run(results[AA_CASE])}"
    rows.append(row(BENCHMARK, AA_CASE, "s per optimizer step", HAND, **stats, note=note))
    return rows
