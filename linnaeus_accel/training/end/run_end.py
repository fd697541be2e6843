"""How a run ends: its last checkpoint committed, the final weights written (``final/``), and
``summary.json``: completed, stopped early or preempted; or, when it cannot go on, ``failed``
with the reason (written when it still can be: the disk may be full, and the reason then says so).

A full or read-only disk ends the run in one sentence naming the file and the cause, whatever file
it hits (a checkpoint, metrics.jsonl, ``final/``, ``summary.json``): what the background thread
left of a checkpoint is removed, and the sentence names the checkpoint to resume from."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from torch import nn

from ... import json_files
from ...checkpoint.manager import CheckpointManager
from ...checkpoint.save.failures import agree_on_output, resume_clause
from ...checkpoint.save.nonfinite import NonFiniteGuard
from ...data.species.errors import UnreadablePhoto
from ...data.tokens.format import TokenOutOfVocab
from ...process.failures import (
    OutputWriteError,
    RunFailed,
    attempt_write,
    collective_timeout,
    disk_failure,
)
from ...process.first_failure import first_failure, is_peer_lost, lost_peer
from ...process.launcher import stop_if_launcher_gone
from ...progress import TrainingProgress
from ...run_directory.outputs import RunOutputs
from ...schedule import ResolvedPlan, StopDecision, StopReason
from .final_weights import data_records, run_tokenizer, save_final


class RunEnd:
    def __init__(
        self,
        accelerator: Accelerator,
        output_dir: Path,
        dist_timeout_s: float,
        plan: ResolvedPlan,
        model: nn.Module,
        progress: TrainingProgress,
        checkpoints: CheckpointManager,
        nonfinite: NonFiniteGuard,
        out: RunOutputs,
        train_data: Any = None,
        last_validation: Callable[[], dict[str, float]] = dict,
        rollbacks: Callable[[], list[dict[str, Any]]] = list,
        interrupted: Callable[[], bool] = lambda: False,
    ) -> None:
        self.accelerator, self.plan, self.model = accelerator, plan, model
        self.output_dir, self.dist_timeout_s = output_dir, dist_timeout_s  # ENV.DIST_TIMEOUT_S
        self.progress, self.checkpoints, self.nonfinite = progress, checkpoints, nonfinite
        self.out = out
        self.run_info: dict[str, Any] = {}  # what the run ran on (main process)
        self.last_validation = last_validation  # the latest validation's metrics, for summary.json
        self.rollbacks = rollbacks  # each rollback the run took (``recovery``), for summary.json
        self.interrupted = interrupted  # a preemption asked for by Ctrl-C: status interrupted
        self.tokenizer = run_tokenizer(train_data)  # the run's, shipped in final/
        self.records = data_records(train_data)  # a taxonomy, the preprocessing: beside the weights

    def summary(
        self, status: str, stop: StopDecision | None = None, error: str | None = None
    ) -> dict[str, Any]:
        progress = self.progress
        return {
            "global_step": progress.global_step,
            "epoch": progress.epoch,
            "samples_seen": progress.samples_seen,
            "tokens_seen": progress.tokens_seen,
            "status": status,
            "stop_reason": stop.reason.value if stop else None,
            "error": error,
            "best_metric": progress.best_metric,
            "expected_total_steps": self.plan.total_steps,
            "last_validation": self.last_validation(),
            "rollbacks": self.rollbacks(),
            "warnings": list(self.plan.warnings),  # the plan's, as printed at the start
            "run_info": self.run_info,
        }

    def finish(self, stop: StopDecision | None, before_summary: Callable[[], None]) -> dict[str, Any]:
        """Every process: the last checkpoint committed (``before_summary`` then runs: callbacks
        hear of it), ``final/`` written (collective), ``summary.json``."""
        progress = self.progress
        preempted = stop is not None and stop.reason is StopReason.PREEMPTED
        progress.settle_tokens()
        self.checkpoints.settle()  # the last checkpoint is committed, or every process stops here
        before_summary()
        if not preempted:  # a preempted run's weights are in its last checkpoint
            self.nonfinite.check(progress.global_step, "the final weights", self.checkpoints.newest)
            self._save_final()
        status = (
            ("interrupted" if self.interrupted() else "preempted")
            if preempted
            else ("early_stopped" if stop is not None else "completed")
        )
        summary = self.summary(status, stop)
        summary["remote_sync_errors"] = self.checkpoints.close()
        summary.update(self.checkpoints.totals())
        self.out.write_json("summary.json", summary)
        return summary

    def _save_final(self) -> None:
        """``final/`` (collective); one that could not be written whole is removed, and every
        process stops together."""
        acc, final = self.accelerator, self.output_dir / "final"
        failure = attempt_write(lambda: self._write_final(final), final)
        if failure is not None and acc.is_main_process:
            shutil.rmtree(final, ignore_errors=True)
        removed = f"removed {final} (not written whole)"
        agree_on_output(acc, "the final weights", failure, removed, self.checkpoints.resume_point)
        if self.checkpoints.node_local and acc.is_local_main_process and not acc.is_main_process:
            # Accelerate makes the directory on every process: on another machine's own disk it
            # stays empty (final/ is the main machine's), so it goes, if empty.
            with contextlib.suppress(OSError):
                final.rmdir()

    def _write_final(self, final: Path) -> None:
        """The weights (collective), then the dataset's records beside them (main process)."""
        save_final(self.accelerator, self.model, final, self.tokenizer)
        if self.accelerator.is_main_process:
            for name, data in self.records.items():
                json_files.write_json(final / name, data)

    def tear_down(self) -> None:
        """Every process tears the process group down together (PyTorch's advice for
        destroy_process_group): one destroying it while process 0 still writes, and hosts the
        rendezvous store, was seen to hang at exit with 2 gloo processes; one never destroying it
        was seen to abort at exit (gloo's threads outliving the interpreter)."""
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()

    def already_finished(self, finished: dict[str, Any]) -> dict[str, Any]:
        """``fit()`` on a finished run's directory: nothing to train, said on the main process (in a
        notebook as on the command line), and the finished run's summary returned. With a bucket,
        the checkpoints it lacks are uploaded first (an outage ended the run) and ``summary.json``
        says what the bucket holds now: its ``remote_sync_errors`` are not a stale error."""
        errors = self._catch_up(finished)
        if errors is not None:
            finished = {**finished, "remote_sync_errors": errors}
        self.tear_down()
        if self.accelerator.is_local_main_process:
            status = str(finished["status"]).replace("_", " ")
            print(
                f"{self.output_dir} already holds a run {status} at step {finished['global_step']}: "
                "nothing to do (pass overwrite=True / --overwrite to train it again from scratch, or choose "
                "another EXPERIMENT.NAME)",
                flush=True,
            )
        return {**finished, "already_finished": True}

    def _catch_up(self, finished: dict[str, Any]) -> list[str] | None:
        """Collective: the main process uploads what the bucket lacks of the finished run (bounded
        by ``ENV.OUTPUT.BUCKET.WAIT_S``) and rewrites ``summary.json``; every process gets what the
        bucket still lacks (None: no bucket)."""
        if not self.checkpoints.bucket_on:
            return None
        errors: list[str] | None = None
        if self.accelerator.is_main_process:
            before = list(finished.get("remote_sync_errors") or [])
            errors = self.checkpoints.catch_up_finished()
            if errors != before:
                with contextlib.suppress(OutputWriteError):  # the summary is not worth a failure
                    self.out.write_json("summary.json", {**finished, "remote_sync_errors": errors})
                if before and not errors:
                    print(f"the bucket holds every checkpoint of {self.output_dir} now", flush=True)
        shared: list[str] | None = broadcast_object_list([errors], from_process=0)[0]
        return shared

    def record_failure(self, message: str, agreed: bool) -> str:
        """``summary.json`` says ``status: failed``. ``agreed``: every process is here, so the
        process group is torn down together. Returns ``message`` with what the end found: a
        checkpoint the background thread could not write (removed), a ``summary.json`` that could
        not be written (what the trainer then raises says)."""
        if not self.out.opened:  # refused before the run started: nothing to record
            return message
        with contextlib.suppress(Exception):
            if lost := self.checkpoints.abandon(timeout=60.0):
                message = f"{message}; {lost}"
        with contextlib.suppress(Exception):
            self.checkpoints.close(timeout=60.0, failing=True)
        try:
            self.out.write_json("summary.json", self.summary("failed", error=message))
        except OutputWriteError as exc:
            why = f": {exc.words}" if exc.words not in message else " either"
            message = f"{message}; summary.json does not record the failure{why}"
        if agreed:
            with contextlib.suppress(Exception):
                self.tear_down()
        with contextlib.suppress(OSError):
            self.out.close()
        return message

    def record_exception(self, exc: Exception) -> RunFailed | None:
        """An exception only this process may have seen: ``summary.json`` records its first cause
        (another process's error when this one only lost that process). Returns the ``RunFailed``
        to raise instead (a sentence, no traceback) when the cause is not this process's own, when a
        collective timed out, when a full or read-only disk is the cause, or when the data is at
        fault and the error says it all; else None (the exception itself goes on: a bug's
        traceback is what its author needs)."""
        stop_if_launcher_gone()  # a peer's error once the launcher was killed: a kill, not a failure
        timed_out = collective_timeout(exc, self.dist_timeout_s)
        written = self._write_failure(exc)
        # Rebuilt from a DataLoader worker's traceback, they keep their class (torch calls it with
        # the text; each keeps its own message of it): a sentence that names the file and the fix.
        said_in_full = isinstance(exc, (TokenOutOfVocab, UnreadablePhoto))
        own = timed_out or written or (str(exc) if said_in_full else f"{type(exc).__name__}: {exc}")
        cause = first_failure(exc, own)
        # A peer gone without a word (its machine killed): one sentence, not gloo's traceback.
        lost = cause == own and not (timed_out or written) and is_peer_lost(exc)
        if lost:
            cause = own = lost_peer(exc)
        ended = self.record_failure(cause, agreed=False)
        if cause != own:
            return RunFailed(f"another process failed first ({ended}); this process stops too")
        return RunFailed(ended) if timed_out or written or said_in_full or lost else None

    def _write_failure(self, exc: Exception) -> str | None:
        """``exc`` as the one sentence a full or read-only disk ends the run with (None when the
        disk is not its cause), with the checkpoint to resume from (the main process's: it
        commits), once the background thread's write is finished or removed."""
        if isinstance(exc, OutputWriteError):
            words = str(exc)
        elif (cause := disk_failure(exc, self.output_dir)) is not None:
            words = f"could not write a file: {cause}"
        else:
            return None
        if not self.accelerator.is_main_process:
            return words
        with contextlib.suppress(Exception):
            if lost := self.checkpoints.abandon(timeout=60.0):
                words = f"{words}; {lost}"
        return f"{words}; {resume_clause(self.checkpoints.resume_point)}"
