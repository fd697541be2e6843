"""The schedule plot (``linnaeus-accel plan --plot FILE``, ``assets/schedule.png``): the file is a
real image, and the figure drawn holds the plan's values (read back from the Figure's artists
before it is saved): the LR of every parameter group, the three probabilities, the LR phases,
the epoch boundaries and the validation and checkpoint steps."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from helpers.configs import CFG, REPO
from helpers.in_process import reset_accelerate, run_cli
from matplotlib.figure import Figure
from matplotlib.image import imread

from linnaeus_accel.cli import main, plan_for
from linnaeus_accel.config import load_config
from linnaeus_accel.schedule import OpsSchedule, ResolvedPlan
from linnaeus_accel.schedule.report.plot import MARKER_COLUMNS, MAX_POINTS, PLOT_EXTRA, schedule_figure
from linnaeus_accel.schedule.report.settings import report_settings

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
WIDTH, HEIGHT = 1320, 825  # 12 x 7.5 inches at 110 dpi


def figure_for(opts: list[str], dataset_size: int = 1438) -> tuple[Figure, ResolvedPlan]:
    config = load_config(CFG, opts)
    plan = plan_for(config, 1, dataset_size)
    return schedule_figure(report_settings(config), plan), plan


def axes(fig: Figure, label: str) -> Any:
    (found,) = [ax for ax in fig.axes if ax.get_label() == label]
    return found


def line(fig: Figure, gid: str) -> Any:
    (found,) = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_gid() == gid]
    return found


def xs(artist: Any) -> list[int]:
    return [int(x) for x in artist.get_xdata()]


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 30_000, "a plot of the schedule, not an empty canvas"
    pixels = imread(path)
    assert pixels.shape[:2] == (HEIGHT, WIDTH)
    assert pixels[..., :3].std() > 0.05  # lines and shading drawn, not one flat colour


def test_plan_plot_writes_a_png_and_still_prints_the_summary(tmp_path: Path) -> None:
    png = tmp_path / "schedule.png"
    rc, out, err = run_cli("plan", "--cfg", CFG, "--dataset-size", "1438", "--plot", str(png))
    assert rc == 0, err
    assert out.startswith("Schedule summary")
    assert f"schedule plot written to {png}" in err
    assert_png(png)
    # With --json, stdout stays one JSON object; the plot's message goes to stderr.
    svg = tmp_path / "schedule.svg"
    rc, out, err = run_cli(
        "plan", "--cfg", CFG, "--dataset-size", "1438", "--json", "--no-series", "--plot", str(svg)
    )
    assert rc == 0, err
    assert out.startswith("{")
    assert out.count("\n") == 1
    assert svg.read_text(encoding="utf-8").lstrip().startswith("<?xml")


def test_unwritable_plot_path_is_an_argument_error(tmp_path: Path) -> None:
    rc, _out, err = run_cli(
        "plan", "--cfg", CFG, "--dataset-size", "1", "--plot", str(tmp_path / "no_dir" / "s.png")
    )
    assert rc == 2
    assert "--plot: cannot write" in err
    assert "no_dir" in err
    rc, _, err = run_cli(
        "plan", "--cfg", CFG, "--dataset-size", "1", "--plot", str(tmp_path / "s.nosuchformat")
    )
    assert rc == 2
    assert "--plot: cannot write" in err


def test_figure_holds_the_default_plan() -> None:
    # Default config: 1438 samples / batch 32 -> 45 steps per epoch x 20 epochs = 900 steps; WSD
    # with 5% warmup (45 steps), stable 80% and decay 20% of the 855 steps after it.
    fig, plan = figure_for([])
    assert plan.total_steps == 900
    steps = list(range(900))
    lr = line(fig, "lr:default")
    assert xs(lr) == steps
    assert list(lr.get_ydata()) == [plan.lr(k) for k in steps]
    assert lr.get_ydata()[0] == pytest.approx(1e-5)
    assert max(lr.get_ydata()) == pytest.approx(0.002 * 32 / 32)
    for gid, ramp in (
        ("prob:meta_mask", plan.meta_mask),
        ("prob:partial_mask", plan.partial_mask),
        ("prob:mixup", plan.mixup),
    ):
        drawn = line(fig, gid)
        assert xs(drawn) == steps
        assert list(drawn.get_ydata()) == [ramp(k) for k in steps]
    # Meta-masking 1.0 -> 0.05 by 30% of the run; partial masking only from step 90 to step 809.
    assert line(fig, "prob:meta_mask").get_ydata()[270] == pytest.approx(0.05)
    partial = line(fig, "prob:partial_mask").get_ydata()
    assert partial[89] == 0
    assert partial[90] > 0
    assert partial[809] > 0
    assert partial[810] == 0

    spans = {p.get_gid(): p for p in axes(fig, "lr").patches}
    assert set(spans) == {"phase:warmup", "phase:stable", "phase:decay"}
    extents = {gid: (p.get_x(), p.get_x() + p.get_width()) for gid, p in spans.items()}
    assert extents == {"phase:warmup": (0, 45), "phase:stable": (45, 729), "phase:decay": (729, 900)}

    (top,) = [a for a in axes(fig, "lr").child_axes if a.get_label() == "epochs"]
    assert list(top.get_xticks()) == [45 * e for e in range(21)]  # epochs 0..20, every boundary
    assert [t.get_text() for t in top.get_xticklabels()] == [str(e) for e in range(21)]

    # Events at the boundary steps: validation every epoch, the mask passes and checkpoints every
    # 5 epochs (the final epoch's partial-mask passes are the exhaustive ones).
    assert xs(line(fig, "event:validation")) == [45 * e for e in range(1, 21)]
    for key in ("checkpoint", "mask_meta_validation", "partial_mask_meta_validation"):
        assert xs(line(fig, f"event:{key}")) == [225, 450, 675, 900], key
    events = OpsSchedule(plan).event_epochs()
    assert xs(line(fig, "event:checkpoint")) == [plan.boundary_step(e) for e in events["checkpoint"]]
    assert "digits_default: 900 optimizer steps" in fig.get_suptitle()


def test_one_lr_line_per_parameter_group_with_its_own_curve() -> None:
    group = "[{LABEL: heads, MATCH: ['heads.*'], LR_MULTIPLIER: 0.5, WARMUP_FRACTION: 0.2}]"
    fig, plan = figure_for(["LR_SCHEDULER.NAME", "cosine", "LR_SCHEDULER.PARAMETER_GROUPS", group])
    lines = [ln for ln in axes(fig, "lr").get_lines() if str(ln.get_gid()).startswith("lr:")]
    assert [ln.get_gid() for ln in lines] == ["lr:default", "lr:heads"]
    steps = list(range(plan.total_steps))
    assert list(lines[1].get_ydata()) == [plan.lr(k, 1) for k in steps]
    assert lines[1].get_ydata()[180] == pytest.approx(plan.lr_curves[1].base_lr)  # its own warmup ends at 180
    assert lines[0].get_ydata()[45] == pytest.approx(2 * lines[1].get_ydata()[180])
    spans = {p.get_gid() for p in axes(fig, "lr").patches}
    assert spans == {"phase:warmup", "phase:cosine"}  # group 0's phases


def row_labels(fig: Figure) -> tuple[list[str], list[str]]:
    """The event rows, top to bottom, and the probability lines (none without their axes)."""
    events = [t.get_text() for t in axes(fig, "events").get_yticklabels()][::-1]
    probabilities = [ax for ax in fig.axes if ax.get_label() == "probabilities"]
    return events, [ln.get_gid() for ax in probabilities for ln in ax.get_lines()]


def test_a_causal_lm_plot_draws_no_masking_or_mixup_rows() -> None:
    config = load_config(REPO / "configs" / "lm_tiny.yaml")
    fig = schedule_figure(report_settings(config), plan_for(config, 1, 3146, 128))
    assert row_labels(fig) == (["validation", "checkpoint"], [])  # no probabilities panel at all
    assert not any(str(ln.get_gid()).startswith("prob:") for ax in fig.axes for ln in ax.get_lines())


def test_a_plot_draws_the_ramps_the_run_enables_and_only_those() -> None:
    mixup_only = ["SCHEDULE.META_MASKING.ENABLED", "false", "SCHEDULE.META_MASKING.PARTIAL.ENABLED", "false"]
    assert row_labels(figure_for(mixup_only)[0])[1] == ["prob:mixup"]
    events, ramps = row_labels(figure_for([])[0])
    assert ramps == ["prob:meta_mask", "prob:partial_mask", "prob:mixup"]
    assert events == ["validation", "mask-meta val.", "partial-mask val.\n(last: exhaustive)", "checkpoint"]


def test_long_run_is_drawn_from_a_sample_that_keeps_every_kink() -> None:
    # 10**7 steps in one epoch: the plot draws about MAX_POINTS steps, exact where curves bend.
    fig, plan = figure_for(["DATA.BATCH_SIZE", "1", "TRAIN.EPOCHS", "1"], dataset_size=10**7)
    t = plan.total_steps
    lr = line(fig, "lr:default")
    steps = xs(lr)
    assert MAX_POINTS <= len(steps) <= MAX_POINTS + 40
    assert steps[0] == 0
    assert steps[-1] == t - 1
    assert steps == sorted(set(steps))
    assert list(lr.get_ydata()) == [plan.lr(k) for k in steps]
    warmup_end = plan.warmup_steps
    assert {warmup_end - 1, warmup_end} <= set(steps)
    for first, last in plan.lr_curves[0].phases().values():
        assert {first, last} <= set(steps)
    partial = plan.partial_mask
    assert {partial.start_step - 1, partial.start_step, partial.end_step - 1, partial.end_step} <= set(
        xs(line(fig, "prob:partial_mask"))
    )


def test_many_epochs_give_one_marker_per_column_and_readable_epoch_ticks() -> None:
    # 10**7 epochs of one step: validation every epoch would be 10**7 markers.
    fig, _plan = figure_for(["TRAIN.EPOCHS", "10000000"], dataset_size=32)
    validation = xs(line(fig, "event:validation"))
    assert len(validation) <= MARKER_COLUMNS + 1
    assert validation[0] == 1
    assert validation[-1] == 10**7
    assert validation == sorted(validation)
    (top,) = [a for a in axes(fig, "lr").child_axes if a.get_label() == "epochs"]
    labels = [t.get_text() for t in top.get_xticklabels()]
    assert len(labels) <= 21
    assert labels[0] == "0"
    assert labels[-1] == "10M"


def test_mid_epoch_checkpoints_are_marked_at_their_steps() -> None:
    # 3200 samples / batch 32 = 100 steps per epoch; a checkpoint every 150 steps, mid-epoch.
    opts = [
        "TRAIN.EPOCHS",
        "5",
        "SCHEDULE.CHECKPOINT.MID_EPOCH",
        "true",
        "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS",
        "null",
        "SCHEDULE.CHECKPOINT.INTERVAL_STEPS",
        "150",
    ]
    fig, _plan = figure_for(opts, dataset_size=3200)
    # 150 and 450 inside epochs 2 and 5; 300 ends epoch 3, and the run's end at 500 always has one.
    assert xs(line(fig, "event:checkpoint")) == [150, 300, 450, 500]


def test_missing_matplotlib_is_an_error_naming_the_extra(tmp_path: Path) -> None:
    # matplotlib really unimportable (sys.modules entry None), in a fresh interpreter.
    png = tmp_path / "schedule.png"
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from linnaeus_accel.cli import main\n"
        f"sys.exit(main(['plan', '--cfg', {CFG!r}, '--dataset-size', '1', '--plot', {str(png)!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--plot" in done.stderr
    assert PLOT_EXTRA in done.stderr
    assert done.stdout == ""
    assert not png.exists()


@pytest.mark.slow
def test_training_without_matplotlib_goes_on_without_the_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (A run with matplotlib writes assets/schedule.png: test_notebook's Trainer run checks it.)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed: imports of it fail
    opts = ["ENV.OUTPUT.BASE_DIR", str(tmp_path), "TRAIN.EPOCHS", "1", "DATA.BATCH_SIZE", "256"]
    opts += ["SCHEDULE.VALIDATION.FINAL_EPOCH.EXHAUSTIVE_PARTIAL_META_VALIDATION", "false"]
    reset_accelerate()
    try:
        assert main(["train", "--cfg", CFG, "--opts", *opts]) == 0
    finally:
        reset_accelerate()
    assets = tmp_path / "digits_default" / "assets"
    assert (assets / "schedule_summary.txt").exists()
    assert not (assets / "schedule.png").exists()


def test_long_legend_labels_keep_the_layout_and_the_axes_wide(tmp_path: Path) -> None:
    """A group matching many patterns made a legend wider than the figure: matplotlib dropped the
    layout with 'constrained_layout not applied' at every plot and squeezed the axes. Its label is
    wrapped: the layout applies, the LR axes keep most of the width, the legend stays in the figure."""
    patterns = ", ".join(f"'block{i}.attention.query_key_value.*'" for i in range(8))
    group = f"[{{LABEL: attention, MATCH: [{patterns}], LR_MULTIPLIER: 0.5}}]"
    fig, _plan = figure_for(["LR_SCHEDULER.PARAMETER_GROUPS", group])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig.savefig(tmp_path / "schedule.png")
    assert [str(w.message) for w in caught] == []
    assert_png(tmp_path / "schedule.png")
    width = fig.get_figwidth() * fig.dpi
    lr_box = axes(fig, "lr").get_window_extent()
    assert lr_box.width > 0.6 * width
    legend = axes(fig, "lr").get_legend().get_window_extent()
    assert legend.x1 <= width
    labels = [t.get_text() for t in axes(fig, "lr").get_legend().get_texts()]
    assert labels[1].startswith("group 1 'attention': wsd, peak 0.001\n  (params matching")


def test_a_short_run_has_whole_step_ticks() -> None:
    fig, _plan = figure_for(["TRAIN.STEPS", "2", "TRAIN.EPOCHS", "null"])
    fig.canvas.draw()
    events = axes(fig, "events")
    lo, hi = events.get_xlim()
    shown = [t.get_text() for t in events.get_xticklabels() if lo <= t.get_position()[0] <= hi]
    assert shown == ["0", "1", "2"]  # not 0, 0, 0, 1, 1, 1, 2: fractional steps rounded


def test_two_drawings_of_one_run_directory_do_not_remove_each_others_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run resumed in the same process while the previous run's drawing thread still runs draws
    the same assets/schedule.png twice at once: both finish, the image is whole, nothing is left."""
    import threading

    from linnaeus_accel.run_directory.outputs import _draw_schedule

    config = load_config(CFG)
    plan = plan_for(config, 1, 1438)
    target = tmp_path / "schedule.png"
    drawings = [
        threading.Thread(target=_draw_schedule, args=(target, report_settings(config), plan))
        for _ in range(2)
    ]
    for drawing in drawings:
        drawing.start()
    for drawing in drawings:
        drawing.join()
    assert "could not draw" not in caplog.text
    assert imread(target).shape[0] > 100
    assert [p.name for p in tmp_path.iterdir()] == ["schedule.png"]
