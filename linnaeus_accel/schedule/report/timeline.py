"""``plan``'s text timeline, and which rows a plan draws (there and in ``--plot``).

A row is drawn when this run has something in it: validation and checkpoints always (the final
boundary has a checkpoint, and no validation is worth seeing); the mask-meta and partial-mask
validation passes when they happen at all; a probability ramp (metadata masking, partial masking,
mixup) when it is enabled. A causal LM's timeline is then its LR, epochs, validation and
checkpoints; a classification run with mixup still shows mixup.
"""

from __future__ import annotations

from collections.abc import Callable

from ..resolved import ResolvedPlan
from .boundary_steps import event_steps

TIMELINE_WIDTH = 64
BARS = " ▁▂▃▄▅▆▇█"
ALWAYS_DRAWN = ("validation", "checkpoint")


def drawn(plan: ResolvedPlan, kind: str) -> bool:
    """Whether the events of ``kind`` (``event_steps``'s kinds) get a row: they happen in this run."""
    return kind in ALWAYS_DRAWN or bool(event_steps(plan, kind, 1))


def drawn_ramps(plan: ResolvedPlan) -> list[tuple[str, Callable[[int], float]]]:
    """The probability ramps this run uses, by ``plan_json`` series stem (``meta_mask``, ...)."""
    ramps = (("meta_mask", plan.meta_mask), ("partial_mask", plan.partial_mask), ("mixup", plan.mixup))
    return [(key, ramp) for key, ramp in ramps if ramp.enabled]


def _spark(values: list[float], lo: float, hi: float, bars: str = BARS) -> str:
    top = len(bars) - 1

    def level(v: float) -> int:
        return top if hi <= lo else round((v - lo) / (hi - lo) * top)

    return "".join(bars[level(v)] for v in values)


def timeline(plan: ResolvedPlan) -> list[str]:
    """A text timeline, one column per ``T / width`` steps."""
    t = plan.total_steps
    width = min(TIMELINE_WIDTH, t)
    starts = [c * t // width for c in range(width)]
    mids = [min(t - 1, (c * t + (c + 1) * t) // (2 * width)) for c in range(width)]
    curve = plan.lr_curves[0]
    phase_char = {
        "warmup": "w",
        "stable": "S",
        "decay": "d",
        "min": "_",
        "cosine": "c",
        "linear": "l",
        "step": "s",
    }

    def column(step: int) -> int:
        return min(width - 1, step * width // t)

    phases = ["?"] * width
    for name, (a, b) in curve.phases().items():
        for c in range(column(a), column(b) + 1):
            if starts[c] >= a or phases[c] == "?":
                phases[c] = phase_char[name]
    lrs = [curve(k) for k in mids]
    # The range in the header is the curve's own: each phase is monotone, so its extremes are at
    # phase ends (column midpoints miss a warmup's first value, or a decay's last).
    ends = {0, t - 1} | {k for a, b in curve.phases().values() for k in (a, b) if 0 <= k < t}
    lr_range = [curve(k) for k in ends]

    def marks(steps: list[int], char: str) -> str:
        row = [" "] * width
        for step in steps:
            row[column(step - 1)] = char
        return "".join(row)

    if plan.known_epochs:
        ope = plan.optimizer_steps_per_epoch
        assert ope is not None
        # In each column, the first boundary (every ope steps, the last at T) it holds, if any.
        epochs = marks([min(t, -(-(start + 1) // ope) * ope) for start in starts], "|")
    else:
        epochs = "?" * width  # where a stream's passes end is found as it ends
    rows = [
        f"Timeline: {t} steps, one column = {t / width:.4g} steps; lr {min(lr_range):.3g}..{max(lr_range):.3g}",
        f"  LR phase   |{''.join(phases)}|  w=warmup S=stable d=decay _=MIN_LR c/l/s=cosine/linear/step",
        f"  LR         |{_spark(lrs, min(lrs), max(lrs), BARS[1:])}|",
        f"  epochs     |{epochs}|",
    ]
    events = (
        ("validation", "validation", "V"),
        ("mask_meta_validation", "mask-meta", "M"),
        ("partial_mask_meta_validation", "partial", "P"),
        ("checkpoint", "checkpoint", "C"),
    )
    rows += [
        f"  {label:<11}|{marks(event_steps(plan, k, width), char)}|"
        for k, label, char in events
        if drawn(plan, k)
    ]
    for timing in plan.callbacks:
        rows.append(
            f"  {timing.label[:10]:<10} |{marks(event_steps(plan, f'callback:{timing.label}', width), '*')}|"
        )
    labels = {"meta_mask": "meta mask", "partial_mask": "partial", "mixup": "mixup"}
    for key, fn in drawn_ramps(plan):
        rows.append(f"  {labels[key]:<11}|{_spark([fn(k) for k in mids], 0.0, 1.0)}|  probability 0..1")
    return rows
