"""``DistributedContext``: the seeds' distributed helpers, as a thin facade over Accelerate.

linnaeus kept rank and world size in a ``DistributedContext`` singleton that user code asked
(``is_master``, ``@master_only``, ``all_gather``, ``reduce``). Here Accelerate's ``PartialState``
already is that single place (it is shared by every instance, and by the ``Accelerator`` a
``Trainer`` builds), so this class holds no state of its own: it reads ``PartialState`` and calls
``accelerate.utils``' collectives, which also work on one process (they return the input).

    from linnaeus_accel import DistributedContext

    dist = DistributedContext()
    if dist.is_master:
        ...

    @dist.master_only
    def save_report(path): ...

    per_rank = dist.all_gather(torch.tensor([my_count]))  # one tensor per process, rank order
    mean_loss = dist.reduce(loss)  # mean over processes, on every process
    log = dist.get_logger(__name__)
    log.info("main process only, prefixed with [RANK 0]")
    log.info("every process", main_process_only=False)

Collectives must be called by every process, in the same order, or the callers wait for the rest
(at most ``ENV.DIST_TIMEOUT_S`` inside a ``Trainer``'s run).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, Literal, ParamSpec, TypeVar

import torch
from accelerate import PartialState
from accelerate.logging import MultiProcessAdapter, get_logger
from accelerate.utils import (
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    parse_flag_from_env,
    reduce,
)

P = ParamSpec("P")
R = TypeVar("R")


class DistributedContext:
    """Rank, world size and collectives of the current run, read from Accelerate's state.

    Every instance sees the same state (there is nothing to pass around); the first use starts
    Accelerate's ``PartialState`` if neither it nor an ``Accelerator`` has been created yet
    (which, under ``accelerate launch`` or ``torchrun``, joins the process group)."""

    def __init__(self, cpu: bool | None = None) -> None:
        """``cpu``: start the state on the CPU (gloo) when it is not started yet, as
        ``Accelerator(cpu=True)``; default: as a ``Trainer`` does, with ``ACCELERATE_USE_CPU=true``
        or when several processes were launched on a machine without CUDA (Accelerate's state would
        otherwise not join them)."""
        if cpu is None:
            launched = int(os.environ.get("WORLD_SIZE", "1"))
            cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or (
                launched > 1 and not torch.cuda.is_available()
            )
        self._cpu = cpu

    @property
    def state(self) -> PartialState:
        return PartialState(cpu=self._cpu)

    def _start(self) -> None:
        """Start Accelerate's state before a first collective (a no-op once started)."""
        PartialState(cpu=self._cpu)

    def initialize(
        self, is_distributed: bool | None = None, world_size: int | None = None, rank: int | None = None
    ) -> DistributedContext:
        """The seeds' set-up call. Accelerate already knows the answers, so the values given are
        only checked against them: a mismatch means the processes were not launched as the caller
        thinks, and is a ``ValueError`` rather than a silently wrong rank."""
        given = {"is_distributed": is_distributed, "world_size": world_size, "rank": rank}
        actual = {"is_distributed": self.is_distributed, "world_size": self.world_size, "rank": self.rank}
        wrong = [
            f"{k}={v!r} (Accelerate: {actual[k]!r})"
            for k, v in given.items()
            if v is not None and v != actual[k]
        ]
        if wrong:
            raise ValueError(
                f"DistributedContext.initialize: {', '.join(wrong)}; launch with `accelerate launch` or "
                "`torchrun`, or leave the arguments out (they are read from Accelerate)"
            )
        return self

    # -- where this process is ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return int(self.state.process_index)

    @property
    def local_rank(self) -> int:
        return int(self.state.local_process_index)

    @property
    def world_size(self) -> int:
        return int(self.state.num_processes)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_master(self) -> bool:
        """The main process (rank 0), the one a ``Trainer`` writes files and logs from."""
        return bool(self.state.is_main_process)

    @property
    def is_local_master(self) -> bool:
        """The first process of this machine (e.g. to download or unpack data once per machine)."""
        return bool(self.state.is_local_main_process)

    @property
    def device(self) -> torch.device:
        device: torch.device = self.state.device
        return device

    # -- rank-specific code --------------------------------------------------------------------------
    def master_only(self, function: Callable[P, R]) -> Callable[P, R | None]:
        """Run ``function`` on the main process only; elsewhere the call does nothing and returns
        None. No barrier: a function that other processes must wait for needs ``barrier()``."""

        @functools.wraps(function)
        def on_master(*args: P.args, **kwargs: P.kwargs) -> R | None:
            return function(*args, **kwargs) if self.is_master else None

        return on_master

    def local_master_only(self, function: Callable[P, R]) -> Callable[P, R | None]:
        """As ``master_only``, on the first process of each machine."""

        @functools.wraps(function)
        def on_local_master(*args: P.args, **kwargs: P.kwargs) -> R | None:
            return function(*args, **kwargs) if self.is_local_master else None

        return on_local_master

    # -- collectives (every process calls them) ------------------------------------------------------
    def barrier(self) -> None:
        self.state.wait_for_everyone()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every process's ``tensor`` (the same shape on each), in rank order, on every process,
        as ``torch.distributed.all_gather`` gives them; on one process, ``[tensor]``."""
        self._start()
        stacked = gather(tensor.unsqueeze(0))  # concatenated along a new first dimension
        return list(stacked.unbind(0))

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's picklable ``obj``, in rank order, on every process."""
        self._start()
        return list(gather_object([obj]))

    def reduce(self, tensor: torch.Tensor, op: Literal["mean", "sum", "max"] = "mean") -> torch.Tensor:
        """``tensor`` reduced over processes (a new tensor, on every process: an all-reduce).
        ``mean`` needs a floating-point tensor."""
        self._start()
        if op == "mean" and not tensor.is_floating_point():
            raise TypeError(
                f"reduce(op='mean') needs a floating-point tensor, got {tensor.dtype}: use op='sum'"
            )
        result: torch.Tensor = reduce(tensor, reduction=op)
        return result

    def broadcast(self, tensor: torch.Tensor, from_rank: int = 0) -> torch.Tensor:
        """``from_rank``'s ``tensor`` on every process."""
        self._start()
        result: torch.Tensor = broadcast(tensor, from_process=from_rank)
        return result

    def broadcast_object(self, obj: Any, from_rank: int = 0) -> Any:
        """``from_rank``'s picklable ``obj`` on every process."""
        self._start()
        return broadcast_object_list([obj], from_process=from_rank)[0]

    # -- logging -------------------------------------------------------------------------------------
    def get_logger(self, name: str, level: str | None = None) -> MultiProcessAdapter:
        """A logger whose records are prefixed with ``[RANK r]`` and emitted on the main process
        only, unless a call passes ``main_process_only=False`` (every process) or ``in_order=True``
        (every process, one after the other): Accelerate's ``get_logger``. ``level``: a level
        name ("INFO"); default: ``ACCELERATE_LOG_LEVEL``, else the logger's own."""
        self._start()  # Accelerate's adapter refuses to log before the state exists
        return get_logger(name, log_level=level)

    def __repr__(self) -> str:
        return f"DistributedContext(rank={self.rank}, world_size={self.world_size}, device={self.device})"
