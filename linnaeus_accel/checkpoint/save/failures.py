"""A checkpoint write that fails on any process fails on every process, together.

Each process catches its own failure to write (a full disk, a read-only filesystem, the main
process's background commit) and they agree at each stage of a save, so that none is left waiting
at a barrier for a process that gave up: on any failure the main process removes the partial
checkpoint and every process raises ``CheckpointWriteError`` naming the step, the cause and the
resume point that remains. The final weights are agreed on the same way (``agree_on_output``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import gather_object

from ...process.failures import RunFailed
from ..directory import MARKER, CheckpointStore

Failure = tuple[int, str, BaseException]  # (checkpoint step, the error in words, the exception)


class StepFailed(Exception):
    """A background write or commit of checkpoint ``step`` failed (``description``: in words)."""

    def __init__(self, step: int, description: str, cause: BaseException) -> None:
        super().__init__(description)
        self.step, self.description = step, description
        self.__cause__ = cause


class CheckpointWriteError(RunFailed):
    """A checkpoint could not be written (no space left, a read-only filesystem, ...). Raised on
    every process together; the partial checkpoint is gone and the previous one is still the
    resume point. The message names the path and the cause (ENOSPC, EROFS, ...)."""


def background_failure(worker: Any, current_step: int) -> Failure | None:
    """The failure of this process's background work (a ``SerialWorker``) since the last agreement,
    if any; one not tied to a step is charged to ``current_step``."""
    failure = worker.take_failure()
    if failure is None:
        return None
    cause = failure.__cause__
    if isinstance(cause, StepFailed):
        return cause.step, cause.description, cause.__cause__ or cause
    return current_step, f"{failure.what}: {type(cause).__name__}: {cause}", failure


def agree_on_failure(
    accelerator: Accelerator, store: CheckpointStore, committed: Path | None, failure: Failure | None
) -> None:
    """Collective: every process learns whether any failed (``failure``: this one's); if one did,
    the main process removes what was written and every process raises ``CheckpointWriteError``.
    ``committed``: the newest committed checkpoint, known to the main process (which commits)."""
    mine = failure[:2] if failure is not None else None
    # Only the main process knows the resume point: it travels with its answer.
    resume = str(committed) if accelerator.is_main_process and committed is not None else None
    answers: list[tuple[tuple[int, str] | None, str | None]] = gather_object([(mine, resume)])
    everyone = [answer for answer, _ in answers]
    if not any(everyone):
        return
    resume_point = answers[0][1]
    if accelerator.is_main_process:
        for step in {entry[0] for entry in everyone if entry}:
            remove_partial(store, step)
    kept = resume_clause(resume_point)
    if mine is not None:
        step, what = mine
        message = f"could not write checkpoint step {step}: {what}; removed the partial checkpoint; {kept}"
    else:
        rank, (step, theirs) = next((r, m) for r, m in enumerate(everyone) if m)
        message = (
            f"another process (rank {rank}) failed to write its part of checkpoint step {step} ({theirs}); "
            f"{kept}"
        )
    raise CheckpointWriteError(message) from (failure[2] if failure is not None else None)


def abandon(worker: Any, store: CheckpointStore, current_step: int, timeout: float) -> str | None:
    """Main process, not collective: wait (bounded) for the background work of this process (a
    ``SerialWorker``); a checkpoint it failed to write or commit is removed; what was lost, in
    words, else None."""
    worker.wait(timeout)
    failure = background_failure(worker, current_step)
    if failure is None:
        return None
    step, what, _ = failure
    remove_partial(store, step)
    return f"checkpoint step {step} was not written either ({what}): removed the partial checkpoint"


def remove_partial(store: CheckpointStore, step: int) -> None:
    """Main process: what a failed write or commit of checkpoint ``step`` left (its staging
    directory, or a commit cut before its marker), so that its space is free again."""
    shutil.rmtree(store.staging_path(step), ignore_errors=True)
    final = store.final_path(step)
    if final.is_dir() and not (final / MARKER).exists():
        shutil.rmtree(final, ignore_errors=True)


def resume_clause(resume_point: str | Path | None) -> str:
    """What a failed run leaves to resume from, in words."""
    if resume_point is None:
        return "there is no earlier checkpoint to resume from"
    return f"the resume point is still {resume_point}"


def agree_on_output(
    accelerator: Accelerator,
    what: str,
    failure: tuple[str, BaseException] | None,
    removed: str,
    committed: Path | None,
) -> None:
    """Collective, for files every process waits for (``final/``): if writing them failed on any
    process (``failure``: this one's, from ``attempt_write``), every process raises ``RunFailed``
    naming the cause, what was removed and the resume point (``committed``, known to the main
    process)."""
    mine = failure[0] if failure is not None else None
    resume = str(committed) if accelerator.is_main_process and committed is not None else None
    answers: list[tuple[str | None, str | None]] = gather_object([(mine, resume)])
    if not any(answer for answer, _ in answers):
        return
    kept = resume_clause(answers[0][1])
    if mine is not None:
        message = f"could not write {what}: {mine}; {removed}; {kept}"
    else:
        rank, theirs = next((r, m) for r, (m, _) in enumerate(answers) if m)
        message = f"another process (rank {rank}) could not write {what} ({theirs}); {removed}; {kept}"
    raise RunFailed(message) from (failure[1] if failure is not None else None)
