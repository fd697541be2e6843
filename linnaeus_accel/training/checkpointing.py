"""Checkpoints of a run: saved through ``accelerator.save_state`` (collective: every process calls
it, SPEC §9), committed atomically by the main process, found again on resume.

Our own state (progress, early stopping, GradNorm, retention bookkeeping, tracker run id) is one
versioned JSON file inside the checkpoint, and what differs between processes (each one's share of
the open metric window, a stream's position in each DataLoader worker) one small JSON file per
process: nothing of ours is ever unpickled. The
validation passes that follow a boundary checkpoint are recorded, one line each, in that
checkpoint's journal, so that a run killed mid-validation runs only the passes still missing.

Everything a resume reads is verified first (``checkpoint_state``): the files the marker lists, no
file it does not list but the journal, our JSON state, and each journal line (a line that fails is
ignored with everything after it). A checkpoint that fails is moved to ``checkpoints/rejected/``,
never deleted; a run whose checkpoints all fail refuses to start over (``ResumeRefused``). A
checkpoint that cannot be written (a full or read-only disk) stops every process together with
``CheckpointWriteError``, the partial checkpoint removed and the previous one still the resume point.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object

from ..checkpoint import MARKER, CheckpointStore, MarkerError, Mode, read_marker
from ..config import Config, ConfigError
from .checkpoint_state import (
    JOURNAL_FILE,
    RANK_FILE,
    STATE_FILE,
    STATE_VERSION,
    decode_journal,
    encode_journal_entry,
    rank_state_problem,
    state_problem,
)
from .failures import RunFailed, attempt_write
from .faults import fault_point

__all__ = [
    "JOURNAL_FILE",
    "RANK_FILE",
    "STATE_FILE",
    "STATE_VERSION",
    "CheckpointWriteError",
    "Checkpointer",
    "ResumeRefused",
    "check_state",
    "checkpoint_store",
]

log = logging.getLogger(__name__)

# Errors that mean "the disk (or the quota) cannot take this checkpoint", named in messages.


class CheckpointWriteError(RunFailed):
    """A checkpoint could not be written (no space left, a read-only filesystem, ...). Raised on
    every process together; the partial checkpoint is gone and the previous one is still the
    resume point. The message names the path and the cause (ENOSPC, EROFS, ...)."""


class ResumeRefused(ConfigError):
    """No checkpoint to resume from although the run has some (every one failed verification), or
    ``--resume`` names one that does not verify. Picklable, so that every process can raise it."""

    def __init__(self, problems: Sequence[tuple[str, str]], source: str = "resume") -> None:
        super().__init__(problems, source)
        self.source = source

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.problems, self.source))


def checkpoint_store(root: Path) -> CheckpointStore:
    """The store of a run's checkpoints, verifying our own files too (``check_state``)."""
    return CheckpointStore(root, journal=JOURNAL_FILE, check=check_state)


def check_state(path: Path) -> str | None:
    """What is wrong with our JSON state in the checkpoint at ``path`` (None: nothing): the state
    the trainer reads must be what this version wrote, for the checkpoint's own step."""
    try:
        step = int(read_marker(path)["step"])
    except MarkerError as exc:
        return str(exc)
    state, problem = _read_json(path / STATE_FILE)
    if problem is not None:
        return problem
    problem = state_problem(state, step)
    if problem is not None:
        return problem
    rank = 0
    while (file := path / RANK_FILE.format(rank)).is_file():
        rank_state, problem = _read_json(file)
        problem = problem or rank_state_problem(rank_state, rank)
        if problem is not None:
            return problem
        rank += 1
    names = sorted(p.name for p in path.glob("rank_*.json"))
    if len(names) != rank:
        return f"the per-process files are not numbered from 0 without gaps: {names}"
    return None


def _read_json(file: Path) -> tuple[Any, str | None]:
    try:
        return json.loads(file.read_bytes().decode("utf-8")), None
    except FileNotFoundError:
        return None, f"{file.name} missing"
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        return None, f"{file.name} unreadable ({type(exc).__name__}: {str(exc)[:100]})"


class Checkpointer:
    def __init__(
        self, accelerator: Accelerator, config: Config, remote: Any = None, mode: Mode | None = None
    ) -> None:
        """``remote``: a ``RemoteCheckpoints`` to sync with (default: from ENV.OUTPUT.BUCKET and the
        B2 credentials in the environment when the bucket is enabled). ``mode``: whether the
        ranking metric is better lower or higher (the task says; default: by its name)."""
        self.accelerator = accelerator
        self.config = config
        self.store = checkpoint_store(config.output_dir / "checkpoints")
        self.remote: Any = None  # RemoteCheckpoints and its BackgroundUploader (b2sdk is optional)
        self.uploader: Any = None
        if accelerator.is_main_process:
            self.remote, self.uploader = self._remote(remote)
        self.ranking_metric = config.SCHEDULE.CHECKPOINT.METRIC or config.TRAIN.EARLY_STOP.METRIC
        self.mode: Mode = mode or ("min" if "loss" in self.ranking_metric else "max")
        self.metric_at: dict[int, float | None] = {}  # ranking metric of each checkpoint, for retention
        self.resumed_from: int | None = None
        self.current: Path | None = None  # the newest committed checkpoint of this run
        self._bindings: dict[Path, str] = {}  # checkpoint -> sha256 of its marker (journal lines)

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
        """``state``: the run's (written once); ``rank_state``: this process's own.

        Collective. Every process catches its own failure to write and they agree at each stage,
        so none is left waiting at a barrier: on any failure the main process removes the staging
        directory and every process raises ``CheckpointWriteError``."""
        acc = self.accelerator
        staging = self.store.staging_path(step)
        error = attempt_write(lambda: self.store.staging_dir(step), staging) if acc.is_main_process else None
        self._agree(step, staging, error)

        def write() -> None:
            acc.save_state(str(staging))
            rank_file = staging / RANK_FILE.format(acc.process_index)
            rank_file.write_text(json.dumps({"version": STATE_VERSION, **rank_state}), encoding="utf-8")
            if acc.is_main_process:
                saved = {
                    "version": STATE_VERSION,
                    **state,
                    "checkpoint_metrics": _json_metrics(self.metric_at),
                }
                (staging / STATE_FILE).write_text(json.dumps(saved), encoding="utf-8")

        self._agree(step, staging, attempt_write(write, staging))
        fault_point("checkpoint_staged")
        final = self.store.final_path(step)
        error = None
        if acc.is_main_process:
            error = attempt_write(lambda: self.store.commit(step, {"global_step": step}), staging)
        self._agree(step, staging, error)
        if acc.is_main_process:
            fault_point("checkpoint_committed")
            self.metric_at.setdefault(step, None)
            self._apply_retention()
            if self.uploader is not None:  # in the background: training does not wait on the network
                self.uploader.submit(final)
        acc.wait_for_everyone()
        self.current = final
        return final

    def _agree(self, step: int, staging: Path, error: tuple[str, BaseException] | None) -> None:
        """Collective: every process learns whether any failed; if one did, the main process removes
        what was written and every process raises ``CheckpointWriteError``."""
        mine = error[0] if error is not None else None
        everyone: list[str | None] = gather_object([mine])
        if not any(everyone):
            return
        acc = self.accelerator
        if acc.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
            final = self.store.final_path(step)
            if final.is_dir() and not (final / MARKER).exists():  # a commit cut before its marker
                shutil.rmtree(final, ignore_errors=True)
        previous = self.current  # the newest committed checkpoint of this run (same on every process)
        kept = (
            f"the resume point is still {previous}"
            if previous is not None
            else "there is no earlier checkpoint to resume from"
        )
        if mine is not None:
            message = (
                f"could not write checkpoint step {step}: {mine}; removed the partial checkpoint; {kept}"
            )
        else:
            rank, theirs = next((r, m) for r, m in enumerate(everyone) if m)
            message = (
                f"another process (rank {rank}) failed to write its part of checkpoint step {step} ({theirs}); "
                f"{kept}"
            )
        raise CheckpointWriteError(message) from (error[1] if error is not None else None)

    def record_validation(self, checkpoint: Path | None, entry: dict[str, Any]) -> None:
        """Append one completed pass to the journal of the checkpoint it follows (main process)."""
        if checkpoint is None or not self.accelerator.is_main_process:
            return
        line = encode_journal_entry(entry["prefix"], entry["metrics"], self._binding(checkpoint))
        with (checkpoint / JOURNAL_FILE).open("a", encoding="utf-8") as f:
            f.write(line)
            f.flush()

    def _binding(self, checkpoint: Path) -> str:
        """What a journal line is bound to: the sha256 of its checkpoint's marker."""
        if checkpoint not in self._bindings:
            try:
                self._bindings[checkpoint] = hashlib.sha256((checkpoint / MARKER).read_bytes()).hexdigest()
            except OSError:
                return ""  # no marker: no line verifies
        return self._bindings[checkpoint]

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
        rejected: list[str] = []
        try:
            deleted = self.store.apply_retention(
                self.metric_at, ck.KEEP_TOP_N, ck.KEEP_LAST_N, self.mode, protect, rejected
            )
        except OSError as exc:  # not fatal: the new checkpoint is committed; retention runs again
            log.warning("checkpoint retention could not remove an old checkpoint: %s", exc)
            return
        for message in rejected:
            log.warning("%s", message)
        for step in deleted:
            self.metric_at.pop(step, None)
        if deleted and self.uploader is not None:
            # The bucket keeps the steps rejected here too: its copy may be the intact one.
            rejected_steps = {self.store.step_of(p) for p in self.store.rejected_checkpoints()}
            keep = set(self.store.complete_steps()) | {s for s in rejected_steps if s is not None}
            self.uploader.retention(keep)

    # -- resuming ----------------------------------------------------------------------------------
    def find_everywhere(self, explicit: str | Path | None) -> tuple[Path | None, list[str]]:
        """``find`` on the main process, its answer (or refusal) on every process (collective)."""
        found: Any = (None, [])
        if self.accelerator.is_main_process:
            try:
                found = self.find(explicit)
            except ResumeRefused as exc:  # every process stops with it: none waits at a barrier
                found = exc
        found = broadcast_object_list([found], from_process=0)[0]
        if isinstance(found, ResumeRefused):
            raise found
        path, skipped = found
        return path, skipped

    def find(self, explicit: str | Path | None) -> tuple[Path | None, list[str]]:
        """The checkpoint to resume from and what was skipped on the way (main process).

        Checkpoints that fail verification are moved to ``rejected/`` (never deleted: one of them
        may hold the only copy of the weights). If the run has checkpoints but none verifies, this
        raises ``ResumeRefused`` rather than start over from step 0 by surprise."""
        if explicit is not None:
            given = Path(explicit)
            problem = self.store.verify(given, deep=True)
            if problem is not None:  # the user's own path: reported, never moved
                raise ResumeRefused(
                    [("--resume", f"{given} is not a usable checkpoint: {problem}")], "arguments"
                )
            return given, []
        if not self.config.TRAIN.AUTO_RESUME:
            return None, []
        path, failed = self.store.newest_verified(deep=True)
        using = f"using {path.name}" if path is not None else "no older valid checkpoint"
        skipped: list[str] = []
        refused: list[str] = []  # committed checkpoints that failed: not a kill's leftovers
        for bad, problem in failed:
            committed = (bad / MARKER).is_file()
            moved = self.store.reject(bad, problem)
            skipped.append(f"{bad.name}: {problem}; {using}; moved to {moved}")
            if committed:
                refused.append(f"{bad.name}: {problem}")
        if path is None and self.remote is not None:
            # A fresh node after preemption: the bucket has what the local disk lost.
            for step in reversed(self.remote.complete_steps()):
                downloaded = self.remote.download(step, self.store.root)
                problem = self.store.verify(downloaded, deep=True)
                if problem is None:
                    return downloaded, [*skipped, f"none locally; downloaded step {step} from the bucket"]
                moved = self.store.reject(downloaded, problem)
                skipped.append(
                    f"{downloaded.name} from the bucket does not verify: {problem}; moved to {moved}"
                )
                refused.append(f"{downloaded.name} (from the bucket): {problem}")
        if path is None:
            earlier = [
                p for p in self.store.rejected_checkpoints() if p.name not in {n.name for n, _ in failed}
            ]
            if refused or earlier:
                raise ResumeRefused([("", self._refusal(refused, earlier))])
        return path, skipped

    def _refusal(self, refused: list[str], earlier: list[Path]) -> str:
        root, rejected = self.store.root, self.store.rejected_root
        if refused:
            noun = "checkpoint" if len(refused) == 1 else f"{len(refused)} checkpoints"
            what = (
                f"none of the {noun} in {root} verifies: {'; '.join(refused)}; they were moved to {rejected}"
            )
        else:
            names = ", ".join(p.name for p in earlier)
            what = (
                f"no checkpoint in {root} verifies; {rejected} holds the run's checkpoints that failed "
                f"verification before ({names}; REJECTED.txt in each says why)"
            )
        return (
            f"{what}. Nothing was deleted and training did not start over from step 0: pass --overwrite to "
            "start over (deleting them), or --resume PATH to resume from a checkpoint you trust"
        )

    def discard_after(self, step: int) -> list[int]:
        """Before resuming at ``step`` (main process): drop checkpoints newer than ``step``, whose
        futures the resumed run recomputes (and would otherwise collide with), and what an
        interrupted delete left. Newer ones that fail verification are moved to ``rejected/``."""
        self.store.remove_incomplete(before=step)  # deletes cut short: their markers were already gone
        deleted = []
        for s, path in self.store.step_dirs():
            if s <= step:
                continue
            problem = self.store.verify(path, deep=True)
            if problem is None:
                self.store.delete(s)
                deleted.append(s)
            else:
                moved = self.store.reject(path, problem)
                log.warning("%s: %s; moved to %s", path.name, problem, moved)
        return deleted

    def read_state(self, path: Path) -> dict[str, Any]:
        """Our JSON state of the checkpoint at ``path`` (``check_state`` has passed for it)."""
        state, problem = _read_json(path / STATE_FILE)
        if problem is None and not isinstance(state, dict):
            problem = f"{STATE_FILE} is not a JSON object"
        if problem is not None:
            raise ResumeRefused([("", f"{path}: {problem}")])
        return state  # type: ignore[no-any-return]

    def load(self, path: Path) -> dict[str, Any]:
        """Restore model, optimizer, RNG states (Accelerate) and return our JSON state."""
        self.accelerator.load_state(str(path))
        # Checkpoints are taken between optimizer steps, where the micro-batch counter is a multiple
        # of the accumulation; the restored count is another run's when resuming elastically.
        self.accelerator.step = 0
        state = self.read_state(path)
        self.metric_at = {int(k): v for k, v in state.get("checkpoint_metrics", {}).items()}
        self.resumed_from = int(state["progress"]["global_step"])
        self.current = path
        return state

    def rank_states(self, path: Path) -> list[dict[str, Any]]:
        """Every process's own state saved in the checkpoint at ``path``, by rank (none in a
        checkpoint written before they existed)."""
        states: list[dict[str, Any]] = []
        while (file := path / RANK_FILE.format(len(states))).is_file():
            state, _ = _read_json(file)
            states.append(state if isinstance(state, dict) else {})
        return states

    def journal(self, path: Path) -> list[dict[str, Any]]:
        """The passes the journal of the checkpoint at ``path`` records as complete, each
        ``{"prefix", "metrics"}``, up to its first line that does not verify: that line and the
        ones after it are ignored (their passes run again) and, on the main process, cut off, so
        that the passes journalled next follow a valid line."""
        journal = path / JOURNAL_FILE
        try:
            data = journal.read_bytes()
        except FileNotFoundError:
            return []
        entries, valid, problem = decode_journal(data, self._binding(path))
        if problem is None:
            return entries
        dropped = data[valid:]
        lines = dropped.count(b"\n") + (not dropped.endswith(b"\n"))
        if self.accelerator.is_main_process:
            log.warning(
                "validation journal of %s: %s; ignoring it%s: those passes run again",
                path.name,
                problem,
                f" and the {lines - 1} line(s) after it" if lines > 1 else "",
            )
            self._cut_journal(path, journal, valid, dropped, cut_by_kill="incomplete" in problem)
        return entries

    def _cut_journal(self, path: Path, journal: Path, valid: int, dropped: bytes, cut_by_kill: bool) -> None:
        if not cut_by_kill:  # not a kill's half line: kept for whoever investigates
            keep = self.store.rejected_root / f"{path.name}.{JOURNAL_FILE}.dropped"
            try:
                keep.parent.mkdir(parents=True, exist_ok=True)
                with keep.open("ab") as f:
                    f.write(dropped)
            except OSError as exc:
                log.warning("could not keep the dropped journal lines in %s: %s", keep, exc)
        os.truncate(journal, valid)


def _json_metrics(metric_at: dict[int, float | None]) -> dict[str, float | None]:
    return {str(k): (v if v is None or math.isfinite(v) else None) for k, v in metric_at.items()}
