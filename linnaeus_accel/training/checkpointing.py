"""Checkpoints of a run: saved through ``accelerator.save_state`` (collective: every process calls
it, SPEC §9), committed atomically by the main process, found again on resume.

Our own state (progress, early stopping, GradNorm, metric windows, retention bookkeeping, tracker
run id) is one versioned JSON file inside the checkpoint: nothing of ours is ever unpickled. The
validation passes that follow a boundary checkpoint are recorded, one line each, in that
checkpoint's journal, so that a run killed mid-validation runs only the passes still missing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from ..checkpoint import CheckpointStore, Mode
from ..config import Config, ConfigError
from .faults import fault_point

STATE_FILE = "trainer_state.json"
JOURNAL_FILE = "validation_journal.jsonl"
STATE_VERSION = 1


class Checkpointer:
    def __init__(self, accelerator: Accelerator, config: Config) -> None:
        self.accelerator = accelerator
        self.config = config
        self.store = CheckpointStore(config.output_dir / "checkpoints")
        self.ranking_metric = config.SCHEDULE.CHECKPOINT.METRIC or config.TRAIN.EARLY_STOP.METRIC
        self.mode: Mode = "min" if "loss" in self.ranking_metric else "max"
        self.metric_at: dict[int, float | None] = {}  # ranking metric of each checkpoint, for retention
        self.resumed_from: int | None = None
        self.current: Path | None = None  # the newest committed checkpoint of this run

    @property
    def current_step(self) -> int | None:
        return self.store.step_of(self.current) if self.current is not None else None

    # -- saving ------------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any]) -> Path:
        acc = self.accelerator
        if acc.is_main_process:
            self.store.staging_dir(step)
        acc.wait_for_everyone()
        staging = self.store.staging_path(step)
        acc.save_state(str(staging))
        if acc.is_main_process:
            state = {"version": STATE_VERSION, **state, "checkpoint_metrics": _json_metrics(self.metric_at)}
            (staging / STATE_FILE).write_text(json.dumps(state), encoding="utf-8")
        acc.wait_for_everyone()
        fault_point("checkpoint_staged")
        final = self.store.final_path(step)
        if acc.is_main_process:
            self.store.commit(step, {"global_step": step})
            fault_point("checkpoint_committed")
            self.metric_at.setdefault(step, None)
            self._apply_retention()
        acc.wait_for_everyone()
        self.current = final
        return final

    def record_validation(self, checkpoint: Path | None, entry: dict[str, Any]) -> None:
        """Append one completed pass to the journal of the checkpoint it follows (main process)."""
        if checkpoint is None or not self.accelerator.is_main_process:
            return
        with (checkpoint / JOURNAL_FILE).open("a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()

    def record_metric(self, step: int, metrics: dict[str, float]) -> None:
        """The ranking metric of the checkpoint at ``step`` (known only after its validation)."""
        if step in self.metric_at and self.ranking_metric in metrics:
            self.metric_at[step] = metrics[self.ranking_metric]
            if self.accelerator.is_main_process:
                self._apply_retention()

    def _apply_retention(self) -> None:
        ck = self.config.SCHEDULE.CHECKPOINT
        protect = {self.resumed_from} if self.resumed_from is not None else set()
        deleted = self.store.apply_retention(
            self.metric_at, ck.KEEP_TOP_N, ck.KEEP_LAST_N, self.mode, protect
        )
        for step in deleted:
            self.metric_at.pop(step, None)

    # -- resuming ----------------------------------------------------------------------------------
    def find(self, explicit: str | Path | None) -> tuple[Path | None, list[str]]:
        """The checkpoint to resume from and what was skipped on the way (main-process view)."""
        if explicit is not None:
            path = Path(explicit)
            problem = self.store.verify(path, deep=True)
            if problem is not None:
                raise ConfigError(
                    [("--resume", f"{path} is not a usable checkpoint: {problem}")], source="arguments"
                )
            return path, []
        if not self.config.TRAIN.AUTO_RESUME:
            return None, []
        return self.store.newest_valid(deep=True)

    def load(self, path: Path) -> dict[str, Any]:
        """Restore model, optimizer, RNG states (Accelerate) and return our JSON state."""
        self.accelerator.load_state(str(path))
        state: dict[str, Any] = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
        self.metric_at = {int(k): v for k, v in state.get("checkpoint_metrics", {}).items()}
        self.resumed_from = int(state.get("progress", {}).get("global_step", 0))
        self.current = path
        return state

    def journal(self, path: Path) -> list[dict[str, Any]]:
        journal = path / JOURNAL_FILE
        if not journal.exists():
            return []
        entries = []
        for line in journal.read_text(encoding="utf-8").splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut by a kill: that pass did not complete
        return entries


def _json_metrics(metric_at: dict[int, float | None]) -> dict[str, float | None]:
    return {str(k): (v if v is None or math.isfinite(v) else None) for k, v in metric_at.items()}
