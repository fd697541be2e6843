"""Why a run stopped before its end, in words a user can act on.

``RunFailed``: the run cannot go on and every process knows it (a non-finite loss, a checkpoint
that could not be written); ``summary.json`` says ``status: failed`` and the command exits 1.
``OutputWriteError``: a file only the main process writes (metrics.jsonl, summary.json, the assets,
a checkpoint's journal) could not be written; the run ends the same way, in one sentence naming the
path and the cause.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the command line imports this module; torch loads only when training
    import torch
    from torch import nn


_DISK_ERRORS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT)
_PROBE_BYTES = 1 << 20
_COLLECTIVE_TIMEOUTS = ("timed out waiting", "collective operation timeout")


class RunFailed(RuntimeError):
    """Every process stops; the message says why, what was kept and what to do."""


class OutputWriteError(Exception):
    """The main process could not write a file of the run (``path``; ``words``: the cause, naming
    ENOSPC, EROFS or EDQUOT when the disk is the cause). Not a ``RunFailed``: the other processes
    do not know of it, so none waits for them; ``RunEnd.record_exception`` ends the run with it."""

    def __init__(self, what: str, path: Path, exc: BaseException) -> None:
        self.path, self.words = path, describe_write(exc, path)
        super().__init__(f"could not {what}: {self.words}")


def parameters_finite(parameters: Iterable[torch.Tensor]) -> bool:
    """Whether every parameter value is finite (a read of all of them: for checkpoint time)."""
    import torch

    # The extremes of each tensor decide it (min and max propagate NaN, and are +-inf if any value
    # is): one read of the values, no tensor of flags; isfinite(p).all() is ~15x slower on a CPU
    # and made up most of a checkpoint's blocked time for a 50 MB model.
    extremes = [
        torch.stack(torch.aminmax(part.detach())) for p in parameters if (part := _local_part(p)).numel()
    ]
    return bool(torch.isfinite(torch.cat(extremes)).all()) if extremes else True


def _local_part(parameter: torch.Tensor) -> torch.Tensor:
    """What this process holds of a parameter: its shard under FSDP2 (a DTensor), its partition
    under DeepSpeed ZeRO-3 (whose parameter itself is an empty placeholder), else all of it. The
    caller combines processes' answers, so every value is checked once."""
    from torch.distributed.tensor import DTensor

    if isinstance(parameter, DTensor):
        return parameter.to_local()
    return getattr(parameter, "ds_tensor", parameter)


class NonFiniteGuard:
    """A NaN or infinite training state is never committed (``TRAIN.NONFINITE``): each step's loss
    stays on the device (``TrainMeter``), read at the logging interval and, with the parameters,
    before every checkpoint and the final weights. Found, the run fails naming the step, and the
    last good checkpoint stays the resume point."""

    def __init__(self, accelerator: Any, meter: Any, model: nn.Module, policy: str) -> None:
        self.accelerator, self.meter, self.model, self.policy = accelerator, meter, model, policy

    def trained(self) -> list[nn.Parameter]:
        """The parameters training changes: a frozen one (a LoRA run's base) cannot become NaN, and
        reading it would make each check cost the whole model again."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def start_parameters_check(self) -> Callable[[], bool]:
        """This process's read of its parameters, begun on a thread so that it overlaps the
        checkpoint's own read of them (``save_state`` is I/O; the check is one pass over memory);
        the returned function waits for the answer, to pass to ``check``."""
        answer: Future[bool] = Future()

        def run() -> None:
            try:
                answer.set_result(parameters_finite(self.trained()))
            except BaseException as exc:
                answer.set_exception(exc)

        threading.Thread(target=run, name="linnaeus-accel finite check", daemon=True).start()
        return answer.result

    def check(
        self, step: int, what: str, resume_point: Path | None, parameters: Callable[[], bool] | None = None
    ) -> None:
        """Before ``what`` is written (a collective, so that every process stops or none).
        ``parameters``: this process's answer from ``start_parameters_check``, else read now."""
        import torch

        acc = self.accelerator
        parameters = parameters or (lambda: parameters_finite(self.trained()))
        finite = parameters() and self.meter.window_is_finite()
        bad = acc.reduce(torch.tensor([0.0 if finite else 1.0], device=acc.device), reduction="sum")
        if bad.item() > 0:
            raise self.failure(
                f"the training loss or the model's parameters became NaN or infinite by step {step} "
                f"(found before writing {what})",
                resume_point,
            )

    def failure(self, what: str, resume_point: Path | None) -> RunFailed:
        kept = (
            f"the last good checkpoint, {resume_point}, stays the resume point"
            if resume_point is not None
            else "no checkpoint was written before it"
        )
        if self.policy == "skip":  # only a non-finite gradient norm is skipped
            why = "TRAIN.NONFINITE: skip drops steps whose gradient norm is not finite, and this was not one"
            fix = "Look for a loss that is infinite while its gradient is not"
        else:
            why = "TRAIN.NONFINITE is stop"
            fix = "Lower the learning rate, set TRAIN.CLIP_GRAD, or set TRAIN.NONFINITE: skip to drop such steps"
        return RunFailed(f"{what}; {why}, so the run stops without saving that state: {kept}. {fix}")


def collective_timeout(exc: BaseException, timeout_s: float | None) -> str | None:
    """The message for a collective operation that timed out (another process stopped
    answering), or None when ``exc`` is something else."""
    text = str(exc)
    # What torch's process groups raise (RuntimeError, or its DistBackendError subclass): gloo's
    # "Timed out waiting ...ms for recv", NCCL's watchdog "collective operation timeout". A user's
    # own TimeoutError (an OSError) is not one of them.
    if not isinstance(exc, RuntimeError) or not any(p in text.lower() for p in _COLLECTIVE_TIMEOUTS):
        return None
    waited = f" for {timeout_s:g} s (ENV.DIST_TIMEOUT_S)" if timeout_s and math.isfinite(timeout_s) else ""
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return (
        f"waited{waited} for another process that stopped answering or died; this process stops too. "
        f"torch: {first}"
    )


def attempt_write(action: Callable[[], Any], staging: Path) -> tuple[str, BaseException] | None:
    """Run ``action``; None if it worked, else what went wrong in words (naming ENOSPC, EROFS or
    EDQUOT when the disk is the cause) and the exception."""
    try:
        action()
    except Exception as exc:
        return describe_write(exc, staging), exc
    return None


def describe_write(exc: BaseException, staging: Path) -> str:
    """``exc``, raised writing under ``staging``, in words. torch's zip writer reports a full disk as
    ``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos`` and safetensors as
    an ``I/O error``, without an errno: the filesystem is then asked."""
    code = exc.errno if isinstance(exc, OSError) and exc.errno in _DISK_ERRORS else _diagnose(staging)
    where = exc.filename if isinstance(exc, OSError) and exc.filename else staging
    if code is not None:
        return f"{errno.errorcode[code]} ({os.strerror(code)}) writing {where}"
    return f"{type(exc).__name__}: {str(exc).strip() or '(no message)'} (writing {where})"


def disk_failure(exc: BaseException, where: Path) -> str | None:
    """A full or read-only disk (or a quota) as the cause of ``exc``, an error raised by code that
    did not say what it wrote (a callback's file, a tracker's), in words naming the path (its
    own, else ``where``); None when the disk is not the cause."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _DISK_ERRORS:
            return describe_write(error, where)
        error = error.__cause__ or error.__context__
    # Native writers (safetensors, torch) say it only in their message.
    if any(os.strerror(code) in str(exc) for code in _DISK_ERRORS):
        return describe_write(exc, where)
    return None


def _diagnose(staging: Path) -> int | None:
    """ENOSPC, EROFS or EDQUOT if the filesystem of ``staging`` cannot take more data, else None:
    ``statvfs``, then a probe write (a quota or root's reserved blocks do not show in statvfs)."""
    where = staging
    while not where.is_dir() and where != where.parent:
        where = where.parent
    try:
        info = os.statvfs(where)
    except OSError:
        return None
    if info.f_flag & os.ST_RDONLY:
        return errno.EROFS
    probe = where / f".probe-{os.getpid()}"
    try:
        with probe.open("wb") as f:
            f.write(b"\0" * _PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return exc.errno if exc.errno in _DISK_ERRORS else None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None
