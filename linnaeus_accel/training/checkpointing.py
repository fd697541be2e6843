"""Checkpoints of a run: saved through ``accelerator.save_state`` (collective: every process calls
it, SPEC §9), committed atomically by the main process, found again on resume.

Our own state (progress, early stopping, GradNorm, retention bookkeeping, tracker run id) is one
versioned JSON file inside the checkpoint, and what differs between processes (each one's share of
the open metric window, a stream's position in each DataLoader worker) one small JSON file per
process: nothing of ours is ever unpickled. The
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
RANK_FILE = "rank_{:05d}.json"  # one per process
JOURNAL_FILE = "validation_journal.jsonl"
STATE_VERSION = 1


class Checkpointer:
    def __init__(
        self, accelerator: Accelerator, config: Config, remote: Any = None, mode: Mode | None = None
    ) -> None:
        """``remote``: a ``RemoteCheckpoints`` to sync with (default: from ENV.OUTPUT.BUCKET and the
        B2 credentials in the environment when the bucket is enabled). ``mode``: whether the
        ranking metric is better lower or higher (the task says; default: by its name)."""
        self.accelerator = accelerator
        self.config = config
        self.store = CheckpointStore(config.output_dir / "checkpoints")
        self.remote: Any = None  # RemoteCheckpoints and its BackgroundUploader (b2sdk is optional)
        self.uploader: Any = None
        if accelerator.is_main_process:
            self.remote, self.uploader = self._remote(remote)
        self.ranking_metric = config.SCHEDULE.CHECKPOINT.METRIC or config.TRAIN.EARLY_STOP.METRIC
        self.mode: Mode = mode or ("min" if "loss" in self.ranking_metric else "max")
        self.metric_at: dict[int, float | None] = {}  # ranking metric of each checkpoint, for retention
        self.resumed_from: int | None = None
        self.current: Path | None = None  # the newest committed checkpoint of this run

    def _remote(self, remote: Any) -> tuple[Any, Any]:
        bucket = self.config.ENV.OUTPUT.BUCKET
        if remote is None and not bucket.ENABLED:
            return None, None
        from ..checkpoint.remote import BackgroundUploader, RemoteCheckpoints, RemoteSyncError

        if remote is None:
            try:
                remote = RemoteCheckpoints.from_environment(
                    bucket.BUCKET or "", bucket.PREFIX, self.config.EXPERIMENT.NAME
                )
            except RemoteSyncError as exc:
                raise ConfigError([("ENV.OUTPUT.BUCKET", str(exc))]) from None
        return remote, BackgroundUploader(remote)

    def close(self, timeout: float = 600.0) -> list[str]:
        """Wait (bounded) for the uploads still queued; the errors of those that failed."""
        if self.uploader is None:
            return []
        self.uploader.close(timeout)
        return list(self.uploader.errors)

    @property
    def current_step(self) -> int | None:
        return self.store.step_of(self.current) if self.current is not None else None

    # -- saving ------------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], rank_state: dict[str, Any]) -> Path:
        """``state``: the run's (written once); ``rank_state``: this process's own."""
        acc = self.accelerator
        if acc.is_main_process:
            self.store.staging_dir(step)
        acc.wait_for_everyone()
        staging = self.store.staging_path(step)
        acc.save_state(str(staging))
        rank_file = staging / RANK_FILE.format(acc.process_index)
        rank_file.write_text(json.dumps({"version": STATE_VERSION, **rank_state}), encoding="utf-8")
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
            if self.uploader is not None:  # in the background: training does not wait on the network
                self.uploader.submit(final)
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
        if self.uploader is not None and self.current is not None and self.current_step == step:
            self.uploader.submit(self.current)  # again, now with its validation journal

    def _apply_retention(self) -> None:
        ck = self.config.SCHEDULE.CHECKPOINT
        protect = {self.resumed_from} if self.resumed_from is not None else set()
        deleted = self.store.apply_retention(
            self.metric_at, ck.KEEP_TOP_N, ck.KEEP_LAST_N, self.mode, protect
        )
        for step in deleted:
            self.metric_at.pop(step, None)
        if deleted and self.uploader is not None:
            self.uploader.retention(set(self.store.complete_steps()))

    # -- resuming ----------------------------------------------------------------------------------
    def find(self, explicit: str | Path | None) -> tuple[Path | None, list[str]]:
        """The checkpoint to resume from and what was skipped on the way (main-process view)."""
        if explicit is not None:
            given = Path(explicit)
            problem = self.store.verify(given, deep=True)
            if problem is not None:
                raise ConfigError(
                    [("--resume", f"{given} is not a usable checkpoint: {problem}")], source="arguments"
                )
            return given, []
        if not self.config.TRAIN.AUTO_RESUME:
            return None, []
        path, skipped = self.store.newest_valid(deep=True)
        if path is None and self.remote is not None:
            # A fresh node after preemption: the bucket has what the local disk lost.
            for step in reversed(self.remote.complete_steps()):
                downloaded = self.remote.download(step, self.store.root)
                if self.store.verify(downloaded, deep=True) is None:
                    return downloaded, [*skipped, f"none locally; downloaded step {step} from the bucket"]
                skipped.append(f"{downloaded.name} from the bucket does not verify")
        return path, skipped

    def discard_after(self, step: int) -> list[int]:
        """Before resuming at ``step`` (main process): drop incomplete checkpoints and any newer than
        ``step``, whose futures the resumed run recomputes (and would otherwise collide with)."""
        self.store.remove_incomplete()
        newer = [s for s in self.store.complete_steps() if s > step]
        for s in newer:
            self.store.delete(s)
        return newer

    def read_state(self, path: Path) -> dict[str, Any]:
        state: dict[str, Any] = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
        return state

    def load(self, path: Path) -> dict[str, Any]:
        """Restore model, optimizer, RNG states (Accelerate) and return our JSON state."""
        self.accelerator.load_state(str(path))
        # Checkpoints are taken between optimizer steps, where the micro-batch counter is a multiple
        # of the accumulation; the restored count is another run's when resuming elastically.
        self.accelerator.step = 0
        state = self.read_state(path)
        self.metric_at = {int(k): v for k, v in state.get("checkpoint_metrics", {}).items()}
        self.resumed_from = int(state.get("progress", {}).get("global_step", 0))
        self.current = path
        return state

    def rank_states(self, path: Path) -> list[dict[str, Any]]:
        """Every process's own state saved in the checkpoint at ``path``, by rank (none in a
        checkpoint written before they existed)."""
        states: list[dict[str, Any]] = []
        while (file := path / RANK_FILE.format(len(states))).is_file():
            state = json.loads(file.read_text(encoding="utf-8"))
            states.append(state if isinstance(state, dict) else {})
        return states

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
