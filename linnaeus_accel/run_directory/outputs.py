"""Everything a run writes or shows, in one place: only the main process writes files, logs to
trackers or draws the progress bar; the other processes get a silent stand-in (docs/design.md §4).

A file that cannot be written (a full or read-only disk) raises ``OutputWriteError`` naming it and
the cause; the run ends with it (``RunEnd.record_exception``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from accelerate import Accelerator

from .. import json_files
from ..config import output_dir_problem
from ..config.sections import TrainConfig
from ..process.failures import OutputWriteError
from ..schedule.report.plot import write_schedule_plot
from ..schedule.report.settings import ReportSettings
from ..schedule.report.summary import write_schedule_summary
from ..schedule.resolved import ResolvedPlan
from .console import BarMode, Console
from .run_lock import RunLock, RunLocked
from .trackers import TENSORBOARD_DIR

log = logging.getLogger(__name__)

SUMMARY_FILE = "schedule_summary.txt"  # written by write_schedule_summary
CONFIG_FILE = "config.yaml"


class RunOutputs:
    """The main process's view of ``<output dir>``: metrics.jsonl, summary.json, trackers, console."""

    def __init__(
        self, accelerator: Accelerator, output_dir: Path, total_steps: int, progress_bar: BarMode
    ) -> None:
        """Built with the run, handed to every part that writes; nothing is written until ``open``
        (once the output directory is claimed). ``progress_bar``: ENV.PROGRESS_BAR."""
        self.accelerator = accelerator
        self.dir = output_dir
        self._metrics_path = self.dir / "metrics.jsonl"
        self._total_steps, self._bar = total_steps, progress_bar
        self._plotting: threading.Thread | None = None
        self.opened = False

    def open(self) -> None:
        """Start writing: the directory, metrics.jsonl (appended to), the console."""
        self.opened = True
        self.dir.mkdir(parents=True, exist_ok=True)
        self._metrics = self._metrics_path.open("a", encoding="utf-8")
        self.console = Console(self._total_steps, self._bar)

    def truncate_metrics(self, after_step: int, keep_validation: bool = False) -> None:
        """Forget what a killed run logged after its checkpoint at ``after_step`` (and that
        checkpoint's validation, which the resumed run logs again, unless ``keep_validation``: a
        finished run trained longer keeps its last validation), so metrics.jsonl reads as one
        uninterrupted history with no step logged twice. Lines that are not a metrics record (a
        line cut by a kill, or damage) are dropped."""
        self._metrics.close()
        kept: list[str] = []
        dropped: list[int] = []
        lines = self._metrics_path.read_bytes().splitlines() if self._metrics_path.exists() else []
        for number, raw in enumerate(lines, 1):
            record = _metrics_record(raw)
            if record is None:
                if raw.strip():
                    dropped.append(number)
                continue
            step = record["global_step"]
            at_end = step == after_step and (keep_validation or not any(k.startswith("val") for k in record))
            if step < after_step or at_end:
                kept.append(raw.decode("utf-8") + "\n")
        if dropped and dropped != [len(lines)]:  # the last line alone: one a kill cut, as expected
            log.warning(
                "%s: dropped line(s) %s: not metrics records",
                self._metrics_path,
                ", ".join(map(str, dropped)),
            )
        tmp = self._metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        tmp.replace(self._metrics_path)
        self._metrics = self._metrics_path.open("a", encoding="utf-8")

    def write_assets(
        self, resolved: dict[str, Any], summary_text: str, plan: ResolvedPlan, settings: ReportSettings
    ) -> None:
        """The schedule summary, the resolved config (``resolved``: ``Config.model_dump(mode="json")``)
        and the schedule plot. The plot (~0.5 s: importing matplotlib and drawing) is drawn on a
        thread of its own, so the run does not wait for it, and not again when a resumed run's
        summary and config are unchanged."""
        assets = self.dir / "assets"
        config_text = yaml.safe_dump(resolved, sort_keys=False)
        plot = assets / "schedule.png"
        unchanged = plot.is_file() and [_read(assets / SUMMARY_FILE), _read(assets / CONFIG_FILE)] == [
            summary_text,
            config_text,
        ]
        try:
            write_schedule_summary(self.dir, summary_text)
        except OSError as exc:
            raise OutputWriteError("write the schedule summary", assets / SUMMARY_FILE, exc) from exc
        try:
            (assets / CONFIG_FILE).write_text(config_text, encoding="utf-8")
        except OSError as exc:
            raise OutputWriteError("write the resolved config", assets / CONFIG_FILE, exc) from exc
        if not unchanged:
            self._plotting = threading.Thread(
                target=_draw_schedule,
                args=(plot, settings, plan),
                name="linnaeus-accel schedule plot",
                daemon=True,
            )
            self._plotting.start()

    def log(self, metrics: dict[str, Any], step: int, tracked: dict[str, Any] | None = None) -> None:
        """One logging event: a line of metrics.jsonl, and ``tracked`` (default: all of ``metrics``;
        nothing when empty) to the trackers, at the global step."""
        try:  # free until it raises: no syscall beyond the append's own
            self._metrics.write(json_files.dumps({"global_step": step, **metrics}) + "\n")
            self._metrics.flush()
        except OSError as exc:
            raise self._metrics_failed(step, exc) from exc
        tracked = metrics if tracked is None else tracked
        if tracked:
            self.accelerator.log(tracked, step=step)

    def _metrics_failed(self, step: int, exc: OSError) -> OutputWriteError:
        """The failed append's line stays in the file's buffer, and closing it would raise again
        (the run's end closes it): the file is closed now, the line dropped. What part of it
        reached the disk is a cut last line, which a resumed run drops as it does a kill's."""
        with contextlib.suppress(OSError):
            self._metrics.close()
        return OutputWriteError(f"log the metrics of step {step}", self._metrics_path, exc)

    def start_progress(self, step: int, epoch: int) -> None:
        """Training starts (or resumes) at ``step``: the progress bar starts there."""
        self.console.start(step, epoch)

    def advance(self, steps: int, epoch: int, postfix: dict[str, str] | None = None) -> None:
        self.console.advance(steps, epoch, postfix)

    def say(self, message: str) -> None:
        self.console.say(message)

    def write_json(self, relative: str, data: dict[str, Any]) -> Path:
        """``summary.json`` and the assets: strict JSON, whole or not at all (``json_files``)."""
        try:
            return json_files.write_json(self.dir / relative, data)
        except OSError as exc:
            raise OutputWriteError(f"write {relative}", self.dir / relative, exc) from exc

    def close(self) -> None:
        if not self.opened:
            return
        if self._plotting is not None:
            self._plotting.join()  # a run that ends has its plot
        self.console.close()
        self._metrics.close()


class SilentRunOutputs(RunOutputs):
    """What the other processes get: the same calls, doing nothing."""

    def __init__(
        self, accelerator: Accelerator, output_dir: Path, total_steps: int, progress_bar: BarMode
    ) -> None:
        self.accelerator = accelerator
        self.dir = output_dir
        self.opened = False

    def open(self) -> None:
        self.opened = True

    def truncate_metrics(self, after_step: int, keep_validation: bool = False) -> None:
        pass

    def write_assets(
        self, resolved: dict[str, Any], summary_text: str, plan: ResolvedPlan, settings: ReportSettings
    ) -> None:
        pass

    def log(self, metrics: dict[str, Any], step: int, tracked: dict[str, Any] | None = None) -> None:
        tracked = metrics if tracked is None else tracked
        if tracked:  # a no-op off the main process, but collective-safe
            self.accelerator.log(tracked, step=step)

    def start_progress(self, step: int, epoch: int) -> None:
        pass

    def advance(self, steps: int, epoch: int, postfix: dict[str, str] | None = None) -> None:
        pass

    def say(self, message: str) -> None:
        pass

    def write_json(self, relative: str, data: dict[str, Any]) -> Path:
        return self.dir / relative

    def close(self) -> None:
        pass


def run_outputs(
    accelerator: Accelerator, output_dir: Path, total_steps: int, progress_bar: BarMode
) -> RunOutputs:
    cls = RunOutputs if accelerator.is_main_process else SilentRunOutputs
    return cls(accelerator, output_dir, total_steps, progress_bar)


def _metrics_record(raw: bytes) -> dict[str, Any] | None:
    """A line of metrics.jsonl as a record (an object with an integer ``global_step``), else None."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or type(record.get("global_step")) is not int:
        return None
    return record


def _read(path: Path) -> str | None:
    return path.read_text(encoding="utf-8") if path.is_file() else None


def _draw_schedule(path: Path, settings: ReportSettings, plan: ResolvedPlan) -> None:
    """``assets/schedule.png``, written whole or not at all (a killed run leaves no half image);
    skipped without matplotlib. A failure is a warning: the plot is not worth a run."""
    # A name of its own: two drawings of one run directory (a run resumed in the same process while
    # the previous run's drawing thread still runs) must not move or remove each other's file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp.png")
    try:
        if write_schedule_plot(tmp, settings, plan) is not None:
            tmp.replace(path)
    except Exception as exc:
        log.warning("could not draw %s: %s: %s", path, type(exc).__name__, exc)
    finally:
        tmp.unlink(missing_ok=True)


def clear_run(out: Path) -> None:
    """``--overwrite``: remove what a previous run wrote here (and nothing else)."""
    for name in ("checkpoints", "final", "assets", "eval", "wandb", TENSORBOARD_DIR):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("metrics.jsonl", "metrics.jsonl.tmp", "summary.json"):
        (out / name).unlink(missing_ok=True)
    for leftover in out.glob(".summary.json-*.tmp"):  # a write a kill interrupted
        leftover.unlink(missing_ok=True)
    for corrupt in out.glob("summary.json.corrupt*"):
        corrupt.unlink(missing_ok=True)


FINISHED = ("completed", "early_stopped")


def output_problem(
    out: Path, train: TrainConfig, resume_from: str | Path | None, total_steps: int | None = None
) -> tuple[str, str] | None:
    """A finished run in the run directory ``out`` is never overwritten, but trained on when
    ``total_steps`` (this config's) lies beyond its end; an unfinished one is resumed only when
    asked to (TRAIN.AUTO_RESUME, ``resume_from``)."""
    if (unusable := output_dir_problem(out)) is not None:  # a file in the way, not writable
        return unusable
    summary = _read_summary(out / "summary.json")
    if (
        summary is not None  # preempted or failed (e.g. a full disk): resumable
        and summary["status"] in FINISHED
        and not (extends(summary, total_steps))
    ):
        return (
            "EXPERIMENT.NAME",
            f"{out} already holds a finished run: choose another EXPERIMENT.NAME or ENV.OUTPUT.BASE_DIR",
        )
    started = (out / "metrics.jsonl").exists() or (out / "checkpoints").exists()
    if started and not train.AUTO_RESUME and resume_from is None:
        return (
            "TRAIN.AUTO_RESUME",
            f"is false but {out} already holds a run: set it true to resume, pass --resume or --overwrite, "
            "or choose another EXPERIMENT.NAME",
        )
    return None


def _read_summary(path: Path) -> dict[str, Any] | None:
    """``summary.json`` (an object with a string status), or None: no file. One that cannot be read
    is moved aside to ``summary.json.corrupt`` (kept for whoever investigates) and counts as absent:
    it must not stop every rerun with a traceback."""
    try:
        summary = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        problem = f"unreadable ({type(exc).__name__}: {str(exc)[:100]})"
    else:
        if isinstance(summary, dict) and isinstance(summary.get("status"), str):
            return summary
        problem = "not an object with a status"
    aside = path.with_name(path.name + ".corrupt")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.corrupt.{n}")
    os.replace(path, aside)
    log.warning(
        "%s is %s: moved it to %s (%s) and treat the run as unfinished",
        path,
        problem,
        aside.name,
        time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    return None


def finished_run(out: Path) -> dict[str, Any] | None:
    """The summary of the finished run in ``out`` (status completed or early_stopped), else None
    (no run, an unfinished one, or a summary that cannot be read)."""
    summary = _read_summary(out / "summary.json")
    return summary if summary is not None and summary["status"] in FINISHED else None


def extends(summary: dict[str, Any], total_steps: int | None) -> bool:
    """Whether a finished run's summary ends before ``total_steps``: a completed run trained longer
    (one that stopped early would stop again)."""
    done = summary.get("global_step")
    return (
        summary["status"] == "completed"
        and isinstance(done, int)  # a summary without it (edited by hand) is left as it is
        and total_steps is not None
        and total_steps > done
    )


def no_last_checkpoint(out: Path, train: TrainConfig, done: int) -> tuple[str, str]:
    """The problem of training on the finished run in ``out`` that kept no checkpoint of its last step."""
    return (
        train.length_key,
        f"asks for more steps than the {done} of the run completed in {out}, which has no "
        f"checkpoint of step {done} to continue from: start a new run from its final/ (MODEL.INIT_FROM) "
        "under another EXPERIMENT.NAME",
    )


def shorter_than_trained(out: Path, train: TrainConfig, done: int, total_steps: int) -> tuple[str, str]:
    """The problem of a config that ends before the steps its run (in ``out``) has trained."""
    return (
        train.length_key,
        f"this config ends the run at step {total_steps}, but {out} has trained {done} steps "
        "already: a run cannot be shortened (ask for at least as many steps, or start a new run: another "
        "EXPERIMENT.NAME or --overwrite)",
    )


def claim_output_dir(
    out: Path,
    train: TrainConfig,
    lock: RunLock,
    resume_from: str | Path | None,
    overwrite: bool,
    total_steps: int,
    committed: Callable[[int], bool],
) -> tuple[tuple[str, str] | None, dict[str, Any] | None]:
    """Main process: take the directory's lock (held until the run ends), then clear it for
    ``overwrite``, or find a finished run there, or check that it may be resumed. A run completed
    before the ``total_steps`` this config asks for is not finished: it resumes and trains on to
    the new end. Returns (the problem, the finished run's summary); never raises: the other
    processes wait for the answer. ``out``: the run directory; ``committed(step)``: whether it holds
    a committed checkpoint of that step (the checkpoint room knows what one is)."""
    try:
        lock.acquire()
        if overwrite:
            clear_run(out)
        elif resume_from is None and (finished := finished_run(out)) is not None:
            if extends(finished, total_steps):
                if not committed(int(finished["global_step"])):
                    return no_last_checkpoint(out, train, int(finished["global_step"])), None
                return output_problem(out, train, resume_from, total_steps), None  # trained on: resumes
            if isinstance(finished.get("global_step"), int) and total_steps < finished["global_step"]:
                return shorter_than_trained(out, train, int(finished["global_step"]), total_steps), None
            return None, finished
        return output_problem(out, train, resume_from, total_steps), None
    except RunLocked as locked:
        return ("EXPERIMENT.NAME", str(locked)), None
    except OSError as e:
        return ("ENV.OUTPUT.BASE_DIR", f"cannot use the run directory {out}: {e}"), None
