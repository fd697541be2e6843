"""Everything a run writes or shows, in one place: only the main process writes files, logs to
trackers or draws the progress bar; the other processes get a silent stand-in (SPEC §9).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import yaml
from accelerate import Accelerator
from tqdm.auto import tqdm

from ..config import Config, output_dir_problem
from ..schedule.summary import write_schedule_summary
from .run_lock import RunLock, RunLocked

log = logging.getLogger(__name__)


class RunOutputs:
    """The main process's view of ``<output dir>``: metrics.jsonl, summary.json, trackers, console."""

    def __init__(self, accelerator: Accelerator, config: Config, total_steps: int) -> None:
        self.accelerator = accelerator
        self.dir = config.output_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self._metrics_path = self.dir / "metrics.jsonl"
        self._metrics = self._metrics_path.open("a", encoding="utf-8")
        self._bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True)
        self._epoch = 0

    def truncate_metrics(self, after_step: int) -> None:
        """Forget what a killed run logged after its checkpoint at ``after_step`` (and that
        checkpoint's validation, which the resumed run logs again), so metrics.jsonl reads as one
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
            if step < after_step or (step == after_step and not any(k.startswith("val") for k in record)):
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

    def write_assets(self, config: Config, summary_text: str) -> None:
        write_schedule_summary(self.dir, summary_text)
        resolved = config.model_dump(mode="json")
        (self.dir / "assets" / "config.yaml").write_text(
            yaml.safe_dump(resolved, sort_keys=False), encoding="utf-8"
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        """One logging event: a line of metrics.jsonl and, if configured, the trackers (step axis =
        global step)."""
        record = {"global_step": step, **{k: _json_number(v) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        self.accelerator.log(metrics, step=step)

    def advance(self, steps: int, epoch: int, postfix: dict[str, str] | None = None) -> None:
        if epoch != self._epoch:  # not every step: set_description redraws the bar
            self._epoch = epoch
            self._bar.set_description(f"epoch {epoch}", refresh=False)
        self._bar.update(steps)
        if postfix is not None:
            self._bar.set_postfix(postfix, refresh=False)

    def say(self, message: str) -> None:
        self._bar.write(message)

    def write_json(self, relative: str, data: dict[str, Any]) -> Path:
        path = self.dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        tmp.replace(path)  # readers never see half a file
        return path

    def close(self) -> None:
        self._bar.close()
        self._metrics.close()


class SilentRunOutputs(RunOutputs):
    """What the other processes get: the same calls, doing nothing."""

    def __init__(self, accelerator: Accelerator, config: Config, total_steps: int) -> None:
        self.accelerator = accelerator
        self.dir = config.output_dir

    def truncate_metrics(self, after_step: int) -> None:
        pass

    def write_assets(self, config: Config, summary_text: str) -> None:
        pass

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.accelerator.log(metrics, step=step)  # a no-op off the main process, but collective-safe

    def advance(self, steps: int, epoch: int, postfix: dict[str, str] | None = None) -> None:
        pass

    def say(self, message: str) -> None:
        pass

    def write_json(self, relative: str, data: dict[str, Any]) -> Path:
        return self.dir / relative

    def close(self) -> None:
        pass


def run_outputs(accelerator: Accelerator, config: Config, total_steps: int) -> RunOutputs:
    cls = RunOutputs if accelerator.is_main_process else SilentRunOutputs
    return cls(accelerator, config, total_steps)


def _metrics_record(raw: bytes) -> dict[str, Any] | None:
    """A line of metrics.jsonl as a record (an object with an integer ``global_step``), else None."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or type(record.get("global_step")) is not int:
        return None
    return record


def _json_number(value: float) -> float | str | None:
    # JSON has no NaN/Infinity; keep the information as a string rather than writing invalid JSON.
    return value if math.isfinite(value) else str(value)


def clear_run(out: Path) -> None:
    """``--overwrite``: remove what a previous run wrote here (and nothing else)."""
    for name in ("checkpoints", "final", "assets", "wandb"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("metrics.jsonl", "metrics.jsonl.tmp", "summary.json", "summary.json.tmp"):
        (out / name).unlink(missing_ok=True)
    for corrupt in out.glob("summary.json.corrupt*"):
        corrupt.unlink(missing_ok=True)


FINISHED = ("completed", "early_stopped")


def output_problem(config: Config, resume_from: str | Path | None) -> tuple[str, str] | None:
    """A finished run is never overwritten; an unfinished one is resumed only when asked to."""
    if (unusable := output_dir_problem(config)) is not None:  # a file in the way, not writable
        return unusable
    out = config.output_dir
    summary = _read_summary(out / "summary.json")
    if (
        summary is not None and summary["status"] in FINISHED
    ):  # preempted or failed (e.g. a full disk): resumable
        return (
            "EXPERIMENT.NAME",
            f"{out} already holds a finished run: choose another EXPERIMENT.NAME or ENV.OUTPUT.BASE_DIR",
        )
    started = (out / "metrics.jsonl").exists() or (out / "checkpoints").exists()
    if started and not config.TRAIN.AUTO_RESUME and resume_from is None:
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


def claim_output_dir(
    config: Config, lock: RunLock, resume_from: str | Path | None, overwrite: bool
) -> tuple[tuple[str, str] | None, dict[str, Any] | None]:
    """Main process: take the directory's lock (held until the run ends), then clear it for
    ``overwrite``, or find a finished run there, or check that it may be resumed. Returns (the
    problem, the finished run's summary); never raises: the other processes wait for the answer."""
    try:
        lock.acquire()
        if overwrite:
            clear_run(config.output_dir)
        elif resume_from is None and (finished := finished_run(config.output_dir)) is not None:
            return None, finished
        return output_problem(config, resume_from), None
    except RunLocked as locked:
        return ("EXPERIMENT.NAME", str(locked)), None
    except OSError as e:
        return ("ENV.OUTPUT.BASE_DIR", f"cannot use the run directory {config.output_dir}: {e}"), None


def init_trackers(accelerator: Accelerator, config: Config, resumed_run_id: str | None) -> None:
    """Start the configured trackers (W&B); a resumed run continues its W&B run."""
    wandb = config.EXPERIMENT.WANDB
    if not wandb.ENABLED:
        return
    run: dict[str, Any] = {
        "name": config.EXPERIMENT.NAME,
        "dir": str(config.output_dir),
        "tags": wandb.TAGS or None,
        "entity": wandb.ENTITY,
    }
    if resumed_run_id:
        run.update(id=resumed_run_id, resume="allow")
    accelerator.init_trackers(
        wandb.PROJECT or "linnaeus-accel", config=config.model_dump(mode="json"), init_kwargs={"wandb": run}
    )
