"""Writing a run's checkpoints: saved through ``accelerator.save_state`` (collective: every process
calls it), committed atomically by the main process (``checkpoint.directory.CheckpointStore``), retained and
uploaded; ``checkpoint.resume.reader`` finds and loads them again.

Training waits only for what the next step needs. The loop is blocked while every process saves
its state into the staging directory (or, with ``SCHEDULE.CHECKPOINT.ASYNC``, while the main
process copies its state to host memory: ``host_snapshot``); hashing, fsync, the marker, retention
and the upload run on the main process's background thread (``SerialWorker``), one checkpoint at a
time. The next checkpoint, a journal append and the end of the run wait for it (the wait is logged
as ``perf/checkpoint_wait_s``). A kill at any instant leaves the newest committed checkpoint as the
resume point: an uncommitted one has no marker and is ignored.

Our own state (progress, early stopping, GradNorm, retention bookkeeping, tracker run id, callbacks'
and registered state) is one versioned JSON file inside the checkpoint, its tensors (an EMA) one
safetensors file, and what differs between processes (each one's share of the open metric window, a
stream's position in each DataLoader worker) one small JSON file per process: nothing of ours is
pickled, and Accelerate's pickles are opened as data before they are loaded
(``checkpoint_content``). The
validation passes that follow a boundary checkpoint are recorded, one line each, in that
checkpoint's journal, so that a run killed mid-validation runs only the passes still missing.

A checkpoint that cannot be written (a full or read-only disk) stops every process together with
``CheckpointWriteError``, the partial checkpoint removed and the previous one still the resume point.
A run that fails elsewhere (a full disk under metrics.jsonl while the background thread writes)
removes what that thread left unfinished too (``abandon``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from safetensors.torch import save_file

from ...config import ConfigError
from ...config.run import EnvConfig, ExperimentConfig
from ...config.schedule import ScheduleConfig
from ...process.failures import OutputWriteError, attempt_write
from ...process.faults import fault_point
from ...run_directory.shared_storage import SHARED
from ..bucket.node_parts import seal, upload_part
from ..directory import MARKER, EarlySeal, EarlyWriteback, MarkerError, Mode, read_marker
from ..directory.background import SerialWorker
from ..directory.store import node_part
from ..state.content import TENSORS_FILE
from ..state.files import (
    JOURNAL_FILE,
    RANK_FILE,
    STATE_FILE,
    STATE_VERSION,
    checkpoint_store,
)
from ..state.journal import ValidationJournals
from .failures import CheckpointWriteError, StepFailed, abandon, agree_on_failure, background_failure
from .host_snapshot import HostSnapshot

__all__ = ["CheckpointWriteError", "CheckpointWriter"]

log = logging.getLogger(__name__)


class CheckpointWriter:
    """Writes a run's checkpoints (see the module docstring); ``checkpoint.resume.reader.CheckpointReader`` reads
    them back."""

    def __init__(
        self,
        accelerator: Accelerator,
        env: EnvConfig,
        experiment: ExperimentConfig,
        schedule: ScheduleConfig,
        ranking_metric: str,
        output_dir: Path,
        remote: Any = None,
        mode: Mode | None = None,
    ) -> None:
        """``env``, ``experiment``, ``schedule``: the run's ENV (the bucket, the timeouts), EXPERIMENT
        (its NAME: the run's place in the bucket) and SCHEDULE (CHECKPOINT: retention, ASYNC)
        sections; ``ranking_metric``: the metric that ranks checkpoints (``Config.ranking_metric``);
        ``output_dir``: the run directory, whose ``checkpoints/`` it writes. ``remote``: a
        ``RemoteCheckpoints`` to sync with (default: from ENV.OUTPUT.BUCKET and the B2 credentials in
        the environment when the bucket is enabled). ``mode``: whether the ranking metric is better
        lower or higher (the task says; default: by its name)."""
        self.accelerator = accelerator
        self.env, self.experiment, self.schedule = env, experiment, schedule
        self.store = checkpoint_store(output_dir / "checkpoints")
        self.remote: Any = None  # RemoteCheckpoints and its BackgroundUploader (b2sdk is optional)
        self.uploader: Any = None
        # Where this machine stands (set at start, ``check_shared_output``): in node-local mode its
        # local main process commits and uploads its machine's part of every checkpoint.
        self.layout = SHARED
        self.giving_up = threading.Event()  # the run failed: stop waiting for other machines' parts
        self.attempt = ""  # this start, as every process agreed on it (node_parts)
        # Whether the run has a bucket (the same on every process; only local main processes reach it).
        self.bucket_on = remote is not None or env.OUTPUT.BUCKET.target_url is not None
        if accelerator.is_local_main_process:  # every machine reaches the bucket, or the run stops
            self.remote, self.uploader = self._remote(remote)
        self.ranking_metric = ranking_metric
        self.mode: Mode = mode or ("min" if "loss" in self.ranking_metric else "max")
        # Ranking metric of each checkpoint, for retention; read and changed by the background
        # commit too, hence the lock.
        self.metric_at: dict[int, float | None] = {}
        self._metrics_lock = threading.Lock()
        self.resumed_from: int | None = None
        self.current: Path | None = None  # the newest checkpoint of this run (its commit may be running)
        self._committed: Path | None = None  # the newest committed one: the resume point
        self.on_commit: Callable[[int, Path], None] | None = None  # told each commit (main process)
        # Among the committed steps, those a rollback may still need (``training.recovery``).
        self.keep_for_rollback: Callable[[list[int]], set[int]] = lambda steps: set()
        self.journals = ValidationJournals(self.store.rejected_root)
        # The main process writes (ASYNC) and commits in the background, one checkpoint at a time.
        self.worker = SerialWorker("linnaeus-accel checkpoint")
        asynchronous = schedule.CHECKPOINT.ASYNC and accelerator.is_main_process
        self.snapshot = HostSnapshot(accelerator) if asynchronous else None
        self.blocked_s = 0.0  # the loop's time in the last save, waiting for the previous one excluded
        self.waited_s = 0.0  # the last save's wait for the previous one's background work
        self.total_blocked_s = 0.0
        self.total_waited_s = 0.0
        self._untaken: tuple[float, float] | None = None  # (blocked, waited) since take_timings
        self.committed_at = 0.0

    def _remote(self, remote: Any) -> tuple[Any, Any]:
        bucket = self.env.OUTPUT.BUCKET
        url = bucket.target_url  # URL, or b2://BUCKET/PREFIX from the older keys; None: no bucket
        if remote is None and url is None:
            return None, None
        from ..bucket.remote import RemoteCheckpoints, RemoteSyncError
        from ..bucket.uploader import BackgroundUploader

        if remote is None:
            try:
                # One listing at start: a missing bucket or a refused key stops the run here, in
                # one sentence, instead of failing every upload in the background.
                remote = RemoteCheckpoints.from_url(
                    url or "", self.experiment.NAME, timeout_s=bucket.TIMEOUT_S
                )
            except RemoteSyncError as exc:
                key = "ENV.OUTPUT.BUCKET.URL" if bucket.URL is not None else "ENV.OUTPUT.BUCKET"
                raise ConfigError([(key, str(exc))]) from None
        return remote, BackgroundUploader(remote)

    def close(self, timeout: float = 600.0, failing: bool = False) -> list[str]:
        """Wait (bounded by ``timeout``) for the background commit, then, at most
        ``ENV.OUTPUT.BUCKET.WAIT_S``, for the bucket's work; each checkpoint the run keeps that is not
        in the bucket, once, in a sentence saying why. Not collective: for the end of a run that
        failed too (``failing``: a checkpoint waiting for another machine's part in the bucket waits
        no more)."""
        if failing:
            self.giving_up.set()
        self.worker.wait(timeout)
        if self.uploader is None:
            return []
        wait_s = min(timeout, float(self.env.OUTPUT.BUCKET.WAIT_S))
        deadline = time.monotonic() + wait_s
        if self.uploader.drain(wait_s) and not failing and self.commits_here and self.worker.idle:
            # What local retention kept for an upload in flight is in the bucket now (the background
            # thread is idle: the checkpoint directory keeps one writer).
            self._apply_retention()
        if not self.uploader.close(max(0.0, deadline - time.monotonic())):
            log.warning(
                "stopped waiting for the bucket after %g s (ENV.OUTPUT.BUCKET.WAIT_S): its uploads still "
                "running are abandoned; a rerun of the same command uploads what it lacks",
                wait_s,
            )
        missing: list[str] = self.uploader.missing(self.store.complete_steps())
        return missing

    def catch_up(self) -> None:
        """Main process, at the start of a rerun: queue the upload of every whole checkpoint on this
        disk that the bucket does not hold complete (an outage ended the run before), the newest
        first. A machine's part (node-local mode) is not a whole checkpoint: the bucket puts parts
        together only while every machine runs, so one missing there is only recorded as missing."""
        if self.uploader is None or not self.accelerator.is_main_process:
            return
        store = self.store

        def committed() -> list[tuple[int, Path | None]]:
            out: list[tuple[int, Path | None]] = []
            for step in store.complete_steps():
                path = store.final_path(step)
                with contextlib.suppress(MarkerError, OSError):
                    out.append((step, path if node_part(read_marker(path)) is None else None))
            return out

        self.uploader.catch_up(committed)

    def abandon(self, timeout: float = 60.0) -> str | None:
        """Not collective, main process: the end of a run that failed outside an agreement (a full
        disk under metrics.jsonl while the background thread writes a checkpoint). Waits (bounded)
        for the background work; a write or commit that failed is removed, as an agreement would
        have; what was lost, in words, else None."""
        return abandon(self.worker, self.store, self.current_step or 0, timeout)

    @property
    def resume_point(self) -> Path | None:
        """The newest committed checkpoint (main process; a commit may still be running)."""
        return self._committed

    def settle(self) -> None:
        """Collective: wait until the last checkpoint is committed (preemption, the end of a run);
        if its background work failed, every process raises ``CheckpointWriteError``."""
        self.total_waited_s += self.worker.wait()
        self._agree(self._background_failure())

    def take_timings(self) -> dict[str, float]:
        """``perf/checkpoint_blocked_s`` and ``perf/checkpoint_wait_s`` of the checkpoints since the
        last call (none: empty), for the next logged metrics."""
        if self._untaken is None:
            return {}
        blocked, waited = self._untaken
        self._untaken = None
        return {"perf/checkpoint_blocked_s": blocked, "perf/checkpoint_wait_s": waited}

    @property
    def current_step(self) -> int | None:
        return self.store.step_of(self.current) if self.current is not None else None

    # -- saving ------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: dict[str, Any],
        rank_state: dict[str, Any],
        before_commit: Callable[[], None] | None = None,
        tensors: dict[str, Any] | None = None,
    ) -> Path:
        """``state``: the run's (written once); ``rank_state``: this process's own; ``tensors``:
        the tensors ``state`` refers to (``tensor_state.split``), written once to a safetensors file.
        ``before_commit``: a collective check run once every process has saved; what it raises
        removes the staged checkpoint and is raised as is (the non-finite guard).

        Collective. The loop waits only until every process has saved (default: Accelerate's
        ``save_state``) or captured (ASYNC: a copy in host memory) its state; the main process
        commits in the background. Every process catches its own failure to write and they agree at
        each stage, so none is left waiting at a barrier: on any failure, including the previous
        checkpoint's background commit, the partial checkpoint is removed and every process raises
        ``CheckpointWriteError``."""
        acc = self.accelerator
        self.waited_s = self.worker.wait()  # one background save at a time
        started = time.perf_counter()
        staging = self.store.staging_path(step)
        failure = self._background_failure()
        if failure is None and self.commits_here:
            error = attempt_write(lambda: self.store.staging_dir(step), staging)
            failure = (step, *error) if error is not None else None
        self._agree(failure)
        rank_json = json.dumps({"version": STATE_VERSION, **rank_state})
        state_json = None
        if acc.is_main_process:
            with self._metrics_lock:
                metrics = _rankable(self.metric_at)
            state_json = json.dumps({"version": STATE_VERSION, **state, "checkpoint_metrics": metrics})
        tensors = (tensors or {}) if acc.is_main_process else {}
        if self.snapshot is not None:
            captured: list[Any] = []
            error = attempt_write(lambda: captured.append(self.snapshot.capture(staging, tensors)), staging)  # type: ignore[union-attr]
        else:
            error = attempt_write(lambda: self._write(staging, rank_json, state_json, tensors), staging)
        self._agree((step, *error) if error is not None else None)
        try:
            if before_commit is not None:
                before_commit()
        except BaseException:
            if acc.is_main_process:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        if self.snapshot is None or not acc.is_main_process:
            fault_point("checkpoint_staged")
        if self.commits_here:
            sealed: dict[str, Any] = {}  # files the ASYNC write sealed already
            if self.snapshot is not None:
                write = partial(self._write_captured, step, captured[0], rank_json, state_json, sealed)
                self.worker.submit(f"writing checkpoint step {step}", write)
            self.worker.submit(f"committing checkpoint step {step}", lambda: self._commit(step, sealed))
        self.current = self.store.final_path(step)
        self.blocked_s = time.perf_counter() - started
        self.total_blocked_s += self.blocked_s
        self.total_waited_s += self.waited_s
        blocked, waited = self._untaken or (0.0, 0.0)
        self._untaken = (blocked + self.blocked_s, waited + self.waited_s)
        return self.current

    def _write(
        self, staging: Path, rank_json: str, state_json: str | None, tensors: dict[str, Any] | None = None
    ) -> None:
        """This process's files: Accelerate's (unless ASYNC captured them), its own state's, and on
        the main process the run's (its tensors too, unless ASYNC wrote them)."""
        acc = self.accelerator
        if self.snapshot is None:
            acc.save_state(str(staging))
        if tensors:
            save_file(tensors, str(staging / TENSORS_FILE))
        (staging / RANK_FILE.format(acc.process_index)).write_text(rank_json, encoding="utf-8")
        if state_json is not None:
            (staging / STATE_FILE).write_text(state_json, encoding="utf-8")

    def _write_captured(
        self, step: int, captured: Any, rank_json: str, state_json: str | None, sealed: dict[str, Any]
    ) -> None:
        """Background, main process, ASYNC: write the captured state, sealing the optimizer's files
        while the weights are written (``sealed``: their manifest entries, for the commit)."""
        assert self.snapshot is not None
        snapshot, staging = self.snapshot, self.store.staging_path(step)
        early = EarlySeal(staging)
        with EarlyWriteback(staging):
            error = attempt_write(lambda: snapshot.write(captured, staging, early.add), staging)
        error = error or attempt_write(lambda: self._write(staging, rank_json, state_json), staging)
        sealing = attempt_write(lambda: sealed.update(early.entries()), staging)  # ends its threads too
        error = error or sealing
        if error is not None:
            raise StepFailed(step, *error)
        fault_point("checkpoint_staged")

    def _commit(self, step: int, sealed: dict[str, Any]) -> None:
        """Background, main process: seal and publish the staged checkpoint, then retention and the
        upload. A failure removes what was written and is raised on every process by the loop's
        next agreement (the next checkpoint, or the end of the run)."""
        staging, final = self.store.staging_path(step), self.store.final_path(step)
        info: dict[str, Any] = {"global_step": step}
        if self.layout.node_local:  # this machine's part: never a resume point by itself
            info.update(node=self.layout.node, nodes=self.layout.nodes)
        error = attempt_write(lambda: self.store.commit(step, info, sealed=sealed), staging)
        if error is not None:
            raise StepFailed(step, *error)
        self._committed = final
        if self.on_commit is not None and self.accelerator.is_main_process:
            self.on_commit(step, final)
        self.committed_at = time.perf_counter()  # for benchmarks: a save's start to its commit
        fault_point("checkpoint_committed")
        with self._metrics_lock:
            self.metric_at.setdefault(step, None)
        self._apply_retention()
        self._upload(final)  # queued again: training does not wait on the network either

    @property
    def commits_here(self) -> bool:
        """Whether this process commits checkpoints: the main process, and in node-local mode each
        machine's local main process (its machine's part)."""
        acc = self.accelerator
        return acc.is_main_process or (self.layout.node_local and acc.is_local_main_process)

    def _upload(self, final: Path, journal: bool = False) -> None:
        """Queue the upload of a committed checkpoint (node-local mode: this machine's part, and on
        the main process the marker of the whole once every machine's part is there). ``journal``:
        only its validation journal grew (main process): it goes up on its own, beside the
        checkpoint, whose marker stays (the journal is outside the manifest)."""
        uploader = self.uploader
        if uploader is None:
            return
        remote, step = uploader.remote, self.store.step_of(final)
        if journal:
            file = final / JOURNAL_FILE

            def upload_journal() -> None:
                if not uploader.in_bucket(step):  # not uploaded (yet): it goes up with the checkpoint
                    return
                try:
                    remote.upload_journal(step, file)
                except Exception:
                    if (final / MARKER).is_file():
                        raise
                    # Retention removed the checkpoint while the upload waited: nothing is lost.

            if step is not None and file.is_file():
                uploader.run(f"upload of {file}", upload_journal)
            return
        if not self.layout.node_local:
            if self.accelerator.is_main_process:
                uploader.submit(final)
            return
        node, nodes, attempt = self.layout.node, self.layout.nodes, self.attempt
        timeout = float(self.env.DIST_TIMEOUT_S)

        def part() -> bool:
            if not (final / MARKER).is_file():  # removed by retention while it waited
                return False
            if not upload_part(remote, final, node, attempt):
                return False
            if self.accelerator.is_main_process and step is not None:
                return seal(remote, step, nodes, attempt, timeout, stop=self.giving_up.is_set)
            return True

        uploader.run(f"upload of {final.name} (machine {node})", part, step=step)

    def _background_failure(self) -> tuple[int, str, BaseException] | None:
        current_step = self.store.step_of(self.current) if self.current is not None else 0
        return background_failure(self.worker, current_step or 0)

    def _agree(self, failure: tuple[int, str, BaseException] | None) -> None:
        agree_on_failure(self.accelerator, self.store, self._committed, failure)

    def record_validation(self, checkpoint: Path | None, entry: dict[str, Any]) -> None:
        """Append one completed pass to the journal of the checkpoint it follows (main process),
        once that checkpoint is committed (a failed commit leaves nothing to append to: the next
        agreement reports it)."""
        if checkpoint is None or not self.accelerator.is_main_process:
            return
        self.total_waited_s += self.worker.wait()
        if not (checkpoint / MARKER).is_file():
            return
        try:
            self.journals.append(checkpoint, entry)
        except OSError as exc:  # a cut line is ignored on resume: the pass runs again
            what = f"journal validation pass {entry['prefix']} of {checkpoint.name}"
            raise OutputWriteError(what, checkpoint / JOURNAL_FILE, exc) from exc

    def record_metric(self, step: int, metrics: dict[str, float]) -> None:
        """The ranking metric of the checkpoint at ``step`` (known only after its validation);
        retention and the upload with its journal follow in the background."""
        if not self.accelerator.is_main_process:
            return
        with self._metrics_lock:
            known = step in self.metric_at and self.ranking_metric in metrics
            if known:
                self.metric_at[step] = metrics[self.ranking_metric]
        if known:
            self.worker.submit("checkpoint retention", self._apply_retention)
        current = self.current
        if self.uploader is not None and current is not None and self.current_step == step:
            self.worker.submit(f"uploading {current.name}", lambda: self._upload(current, journal=True))

    def _apply_retention(self) -> None:
        """Background, main process (the one writer of the checkpoint directory); in node-local mode
        the other machines keep as many of their parts as the main process keeps checkpoints, the
        newest (the bucket holds every checkpoint retention keeps, whole)."""
        ck = self.schedule.CHECKPOINT
        # The checkpoint being uploaded stays until it is in the bucket (a link slower than the
        # checkpoint interval would otherwise never get one there).
        uploading = self.uploader.in_flight() if self.uploader is not None else set()
        if not self.accelerator.is_main_process:
            parts = ck.KEEP_TOP_N + ck.KEEP_LAST_N  # 0: keep all
            for step in self.store.complete_steps()[:-parts] if parts else []:
                if step in uploading:
                    continue
                try:
                    self.store.delete(step)
                except OSError as exc:
                    log.warning("could not remove this machine's part of checkpoint step %d: %s", step, exc)
            return
        protect = {self.resumed_from} if self.resumed_from is not None else set()
        protect |= self.keep_for_rollback(self.store.complete_steps()) | uploading
        rejected: list[str] = []
        with self._metrics_lock:
            metrics = dict(self.metric_at)
        try:
            deleted = self.store.apply_retention(
                metrics, ck.KEEP_TOP_N, ck.KEEP_LAST_N, self.mode, protect, rejected
            )
        except OSError as exc:  # not fatal: the new checkpoint is committed; retention runs again
            log.warning("checkpoint retention could not remove an old checkpoint: %s", exc)
            return
        for message in rejected:
            log.warning("%s", message)
        with self._metrics_lock:
            for step in deleted:
                self.metric_at.pop(step, None)
        if deleted and self.uploader is not None:
            # The bucket keeps the steps rejected here too: its copy may be the intact one.
            rejected_steps = {self.store.step_of(p) for p in self.store.rejected_checkpoints()}
            keep = set(self.store.complete_steps()) | {s for s in rejected_steps if s is not None}
            self.uploader.retention(keep)

    def resumed_at(self, path: Path, state: dict[str, Any]) -> None:
        """The run resumed from the checkpoint at ``path`` (``state``: its state, as loaded): it is
        the resume point, retention protects it and keeps ranking the checkpoints it ranked."""
        self.metric_at = {int(k): v for k, v in state.get("checkpoint_metrics", {}).items()}
        self.resumed_from = int(state["progress"]["global_step"])
        # Saved before its own commit, the state does not rank the checkpoint it is in: its
        # validation, finished after the resume, still does (record_metric).
        self.metric_at.setdefault(self.resumed_from, None)
        self.current = self._committed = path


def _rankable(metric_at: dict[int, float | None]) -> dict[str, float | None]:
    """The ranking metric by step, as saved for retention: a NaN or infinite value (a diverged
    run) cannot rank a checkpoint, so it is saved as null, which ranks last (unlike metrics.jsonl,
    where ``json_files`` keeps such a value as its string for the reader)."""
    return {str(k): (v if v is None or math.isfinite(v) else None) for k, v in metric_at.items()}
