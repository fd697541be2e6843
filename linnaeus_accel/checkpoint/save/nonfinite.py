"""``TRAIN.NONFINITE``: a NaN or infinite training state is never committed.

Each step's loss stays on the device (``TrainMeter``), read at the logging interval and, with the
parameters, before every checkpoint and the final weights. Found, the run fails naming the step, and
the last good checkpoint stays the resume point (``TRAIN.NONFINITE: skip`` drops the steps whose
gradient norm is not finite in ``OptimizerStep`` instead).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...process.failures import RunFailed


def parameters_finite(parameters: Iterable[torch.Tensor]) -> bool:
    """Whether every parameter value is finite (a read of all of them: for checkpoint time)."""

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
    from torch.distributed.tensor import DTensor  # here: importing it costs ~0.5 s at every start

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
        elif self.policy == "rollback":  # every loss and norm of the window was finite: the weights are not
            why = "TRAIN.NONFINITE: rollback acts on non-finite losses and gradient norms, and these were finite"
            fix = "Look for code that writes to the weights outside the optimizer step (a callback)"
        else:
            why = "TRAIN.NONFINITE is stop"
            fix = (
                "Lower the learning rate, set TRAIN.CLIP_GRAD, set TRAIN.NONFINITE: skip to drop such steps, "
                "or TRAIN.NONFINITE: rollback to go back to the last good checkpoint and skip that data"
            )
        return RunFailed(f"{what}; {why}, so the run stops without saving that state: {kept}. {fix}")
