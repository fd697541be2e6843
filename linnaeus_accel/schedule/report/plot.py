"""The schedule as a picture (``linnaeus-accel plan --plot FILE``, ``assets/schedule.png``).

Every value drawn is read from the resolved plan, the same calls ``plan --json`` makes: the LR of
each parameter group, the meta-mask, partial-mask and mixup probabilities, the epoch boundaries and
the validation and checkpoint events; only what the run uses (``timeline.drawn``): a causal LM's
plot has no masking or mixup panel and no mask-meta rows. Long runs are drawn from a sample of their
steps (plus the steps either side of every kink: phase edges, ramp ends), so a plot of 10**9 steps
costs what one of a thousand does, and its shape is still exact where it bends.

matplotlib is the ``plot`` extra and is imported only here, on first use, on its Agg canvas (no
pyplot state: a notebook's own backend is left alone).
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ...config import ConfigError
from ..resolved import ResolvedPlan
from .boundary_steps import event_steps
from .settings import ReportSettings
from .timeline import drawn, drawn_ramps

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PLOT_EXTRA = "pip install 'linnaeus-accel[plot]'"
# Steps drawn: every step up to this many, else this many evenly spaced plus the kinks. The
# figure is ~1300 pixels wide, so more points would only cost time.
MAX_POINTS = 4000
# At most one event marker per this many columns of the step axis (long runs: 10**7 epochs).
MARKER_COLUMNS = 2000
DPI = 110
# Legend entries and event-row labels are wrapped to this many characters, at most LABEL_LINES
# lines: constrained layout gives the axes the width the labels beside them leave, so one long
# label (a group matching many patterns) squeezed them to nothing and matplotlib dropped the layout
# with a warning. The text summary lists every pattern.
LEGEND_CHARS = 48
ROW_CHARS = 24
LABEL_LINES = 3

PHASE_COLORS = {
    "warmup": "#f4a259",
    "stable": "#8cb369",
    "decay": "#5b8ec7",
    "cosine": "#5b8ec7",
    "linear": "#5b8ec7",
    "step": "#5b8ec7",
    "min": "#bbbbbb",
}
PHASE_NAMES = {"min": "held at MIN_LR"}
# (events key, row label, marker, colour); the partial row also shows the final exhaustive passes.
EVENT_ROWS = (
    ("validation", "validation", "v", "#2a7f3f"),
    ("mask_meta_validation", "mask-meta val.", "D", "#8e44ad"),
    ("partial_mask_meta_validation", "partial-mask val.", "s", "#c0392b"),
    ("checkpoint", "checkpoint", "o", "#1f4e79"),
)
PROBABILITIES = (
    ("meta_mask", "meta-mask", "#8e44ad"),
    ("partial_mask", "partial-mask", "#c0392b"),
    ("mixup", "mixup", "#d68910"),
)


def matplotlib_problem() -> str | None:
    """Why the plot cannot be drawn here (matplotlib is not installed), else None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"needs matplotlib, the 'plot' extra: {PLOT_EXTRA}"
    return None


def plot_steps(plan: ResolvedPlan, max_points: int = MAX_POINTS) -> list[int]:
    """The steps ``k`` (0-based optimizer updates) drawn: all of them for a short run, else
    ``max_points`` evenly spaced ones plus each kink of the curves and ramps and the step before it."""
    t = plan.total_steps
    if t <= max_points:
        return list(range(t))
    steps = {round(i * (t - 1) / (max_points - 1)) for i in range(max_points)}
    for kink in _kinks(plan, max_points):
        steps.update(k for k in (kink - 1, kink) if 0 <= k < t)
    return sorted(steps)


def _kinks(plan: ResolvedPlan, limit: int) -> set[int]:
    out: set[int] = set()
    for curve in plan.lr_curves:
        for first, last in curve.phases().values():
            out.update((first, last + 1))
        if curve.kind == "step" and curve.decay_every:
            drops = range(curve.warmup_steps + curve.decay_every, plan.total_steps, curve.decay_every)
            if len(drops) <= limit:  # more drops than points: the sample shows them as a slope
                out.update(drops)
    for ramp in (plan.meta_mask, plan.mixup, plan.partial_mask.prob):
        out.add(ramp.end_step)
    out.update((plan.partial_mask.start_step, plan.partial_mask.end_step))
    return out


def schedule_figure(settings: ReportSettings, plan: ResolvedPlan) -> Figure:
    """The schedule of ``plan`` as a matplotlib Figure (not yet drawn to a file).

    Artists carry a ``gid`` for whoever reads the figure back: ``lr:<group label>``,
    ``prob:meta_mask`` / ``prob:partial_mask`` / ``prob:mixup``, ``event:<events key>`` (x = the
    global step at which the event happens), ``phase:<LR phase>`` (spans of group 0's phases);
    the axes are labelled ``lr``, ``probabilities`` (only when a ramp is enabled: only those are
    drawn), ``events`` and ``epochs`` (the top axis, ticks at epoch boundaries)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    t = plan.total_steps
    steps = plot_steps(plan)
    rows = [row for row in EVENT_ROWS if drawn(plan, row[0])]
    rows += [
        (f"callback:{c.label}", _wrapped(f"callback {c.label}", ROW_CHARS), "*", "#7f6000")
        for c in plan.callbacks
    ]
    ramps = drawn_ramps(plan)
    fig = Figure(figsize=(12, 7.5), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    heights = [3, *([2] if ramps else []), 0.35 * len(rows) + 0.3]
    lr_ax, *prob_axes, event_ax = fig.subplots(len(heights), 1, sharex=True, height_ratios=heights)
    for ax, label in ((lr_ax, "lr"), *((ax, "probabilities") for ax in prob_axes), (event_ax, "events")):
        ax.set_label(label)
    below = (*prob_axes, event_ax)
    phase_handles = _draw_phases(plan, (lr_ax, *below))
    _draw_lr(lr_ax, plan, steps, phase_handles)
    for prob_ax in prob_axes:
        _draw_probabilities(prob_ax, steps, ramps)
    _draw_events(event_ax, plan, rows)
    if plan.max_steps is not None and plan.max_steps < t:
        for ax in (lr_ax, *below):
            ax.axvline(plan.max_steps, color="black", linestyle="--", linewidth=1, gid="max_steps")
        lr_ax.annotate(
            "MAX_STEPS",
            (plan.max_steps, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -12),
            textcoords="offset points",
            fontsize=8,
        )
    # A little room either side, so that the markers of the first and last boundaries show whole.
    lr_ax.set_xlim(-0.01 * t, 1.015 * t)
    event_ax.set_xlabel("global step (optimizer updates)")
    event_ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
    # matplotlib's default ticks, whole steps only: a short run's axis read 0, 0, 0, 1, 1, 1, 2.
    event_ax.xaxis.set_major_locator(MaxNLocator(nbins="auto", steps=[1, 2, 2.5, 5, 10], integer=True))
    _epoch_axis(lr_ax, below, plan)
    fig.suptitle(_title(settings, plan), fontsize=10)
    return fig


def _draw_phases(plan: ResolvedPlan, axes: tuple[Axes, ...]) -> list[Artist]:
    """Shade group 0's LR phases on every axes; the legend entries that name them."""
    from matplotlib.patches import Patch

    handles: list[Artist] = []
    for name, (first, last) in plan.lr_curves[0].phases().items():
        color = PHASE_COLORS.get(name, "#dddddd")
        for ax in axes:
            ax.axvspan(first, last + 1, color=color, alpha=0.18, linewidth=0, gid=f"phase:{name}")
        where = f"step {first:,}" if first == last else f"steps {first:,}-{last:,}"
        handles.append(Patch(color=color, alpha=0.35, label=f"{PHASE_NAMES.get(name, name)}: {where}"))
    return handles


def _draw_lr(ax: Axes, plan: ResolvedPlan, steps: list[int], phase_handles: list[Artist]) -> None:
    from matplotlib.ticker import FuncFormatter

    for i, curve in enumerate(plan.lr_curves):
        label = f"group {i} '{curve.label}': {curve.kind}, peak {curve.base_lr:.3g}"
        if i:
            label += f"\n  (params matching {', '.join(plan.group_patterns[i - 1])})"
        ax.plot(
            steps,
            [curve(k) for k in steps],
            gid=f"lr:{curve.label}",
            label=_wrapped(label, LEGEND_CHARS),
            linewidth=1.8 if i == 0 else 1.4,
        )
    ax.set_ylabel("learning rate")
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:.3g}"))
    lines, _ = ax.get_legend_handles_labels()
    title = "LR phases shaded: group 0's" if len(plan.lr_curves) > 1 else None
    ax.legend(
        handles=[*lines, *phase_handles],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        title=title,
        title_fontsize=8,
    )


def _draw_probabilities(ax: Axes, steps: list[int], ramps: list[tuple[str, Callable[[int], float]]]) -> None:
    """The enabled ramps (``timeline.drawn_ramps``): a ramp that is off has no line."""
    styles = {key: (label, color) for key, label, color in PROBABILITIES}
    for key, fn in ramps:
        label, color = styles[key]
        ax.plot(steps, [fn(k) for k in steps], color=color, gid=f"prob:{key}", label=label)
    ax.set_ylim(-0.03, 1.03)
    ax.set_ylabel("probability")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)


def _draw_events(ax: Axes, plan: ResolvedPlan, rows: list[tuple[str, str, str, str]]) -> None:
    """One row of markers per event kind, at the global steps where they happen (every one while
    they fit in MARKER_COLUMNS, else the first of each column)."""
    labels = []
    for y, (key, label, marker, color) in enumerate(reversed(rows)):
        at = event_steps(plan, key, MARKER_COLUMNS)
        ax.plot(
            at, [y] * len(at), linestyle="none", marker=marker, color=color, markersize=6, gid=f"event:{key}"
        )
        if key == "partial_mask_meta_validation" and plan.exhaustive_combinations:
            label = "partial-mask val.\n(last: exhaustive)"
        labels.append(label)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylim(-0.6, len(rows) - 0.4)


def _wrapped(text: str, width: int) -> str:
    """``text`` in lines of at most ``width`` characters, each of its own lines in at most
    LABEL_LINES (cut with '...'); continuation lines indented."""
    return "\n".join(
        textwrap.fill(part, width, subsequent_indent="  ", max_lines=LABEL_LINES, placeholder=" ...")
        for part in text.split("\n")
    )


def _title(settings: ReportSettings, plan: ResolvedPlan) -> str:
    ope, epochs = plan.optimizer_steps_per_epoch, plan.epochs
    if ope is None or epochs is None:
        per_epoch = "epochs of unknown length: a stream without __len__"
    else:
        per_epoch = f"{ope:,} per epoch; {epochs:,} epoch{'s' if epochs > 1 else ''}"
        if plan.last_epoch_steps < ope:
            per_epoch += f", the last of {plan.last_epoch_steps:,} steps"
    scale = (
        f"LR scale {plan.lr_scale:g} (= {plan.effective_batch_size} / {settings.reference_bs})"
        if settings.reference_bs
        else "LR scaling off"
    )
    tokens = f"; {plan.tokens_per_step:,} tokens per step" if plan.tokens_per_step else ""
    return (
        f"{settings.experiment}: {plan.total_steps:,} optimizer steps ({per_epoch})\n"
        f"effective batch {plan.effective_batch_size:,}{tokens}; {scale}"
    )


def save_schedule_figure(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` (the format from its suffix: .png, .svg, .pdf)."""
    path = Path(path)
    fig.savefig(path, dpi=DPI)
    return path


def write_schedule_plot(path: str | Path, settings: ReportSettings, plan: ResolvedPlan) -> Path | None:
    """Draw and save the plot; None, writing nothing, when matplotlib is not installed (the
    run's ``assets/schedule.png`` is optional)."""
    if matplotlib_problem() is not None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_schedule_figure(schedule_figure(settings, plan), path)


def plot_for_cli(path: str, settings: ReportSettings, plan: ResolvedPlan) -> Path:
    """``plan --plot FILE``: a file that cannot be written is an error naming the argument."""
    try:
        return save_schedule_figure(schedule_figure(settings, plan), path)
    except (OSError, ValueError) as exc:  # ValueError: a suffix matplotlib has no format for
        raise ConfigError([("--plot", f"cannot write {path}: {exc}")], source="arguments") from None


def _epoch_axis(lr_ax: Axes, others: tuple[Axes, ...], plan: ResolvedPlan) -> None:
    """Epoch numbers along the top, at the boundary steps; a light line at every boundary when
    there are few enough to see."""
    epochs = plan.epochs
    if epochs is None:  # boundaries of a stream without __len__ are found as it ends
        return
    every = _label_every(epochs, 20 if epochs < 1000 else 10)
    labelled = [0, *range(every, epochs + 1, every)]
    top = lr_ax.secondary_xaxis("top")
    top.set_label("epochs")
    top.set_xticks([plan.boundary_step(e) for e in labelled], [_compact(e) for e in labelled], fontsize=8)
    top.set_xlabel("epoch (completed)", fontsize=9)
    if epochs <= 60:
        boundaries = [plan.boundary_step(e) for e in range(1, epochs + 1)]
        top.set_xticks(boundaries, minor=True)
        for ax in (lr_ax, *others):
            ax.vlines(
                boundaries,
                0,
                1,
                transform=ax.get_xaxis_transform(),
                color="#999999",
                linewidth=0.5,
                alpha=0.5,
                zorder=0,
                gid="epoch_boundaries",
            )


def _label_every(count: int, most: int) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... that leaves at most ``most`` labels of ``count``."""
    every, magnitude = 1, 1
    while True:
        for m in (1, 2, 5):
            every = m * magnitude
            if count / every <= most:
                return every
        magnitude *= 10


def _compact(n: int) -> str:
    """12, 1,500, 25k, 2.5M: epoch numbers short enough to sit side by side."""
    if n >= 1_000_000:
        return f"{n / 1_000_000:g}M"
    if n >= 10_000:
        return f"{n / 1000:g}k"
    return f"{n:,}"
