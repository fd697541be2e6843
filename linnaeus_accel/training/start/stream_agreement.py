"""Micro-batches of a stream without ``__len__``, on which every process agrees.

Where such a stream's pass ends is found when it ends, and every process must make the same
optimizer steps (gradients are all-reduced; a process that stops early would hang the others). A
stream read whole by every process (``StreamShard``) gives every process the same number of
batches by construction. A sharded stream (``ShardReaders``) does not: each process reads its own
shards, and they run out at different batches. For it, processes agree after each micro-batch
fetch, with one all-reduce of three ints on a CPU (gloo) group, so no device is synchronised:
whether each has a batch, how many real rows, whether it is full. The pass goes on while any
process has a batch (with DATA.DROP_LAST, while every process has a full one); a process that has
none trains a zero-weight batch (its last batch, every row marked not real) so that the collectives
stay in step, and contributes nothing to the loss or the gradient.

Windows of micro-batches look ahead (one micro-batch, or with DROP_LAST one window), so that the
loop knows a window is the pass's last when it yields it (``pass_ended``): the epoch boundary then
follows that very step, as it does for data of known length. What a checkpoint saves is the
loader's state before the first micro-batch looked at but not trained.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import find_batch_size, send_to_device

from ..step.micro_batch import MicroBatch


class Fetched(NamedTuple):
    state: Any  # the loader's state before this micro-batch: what a checkpoint saves to resume here
    batch: MicroBatch


class UnsizedStream:
    """One process's micro-batches of a stream without ``__len__`` (see the module docstring)."""

    def __init__(
        self, accelerator: Accelerator, loader: Any, batch_size: int, *, agree: bool, drop_last: bool
    ) -> None:
        """``agree``: processes may hold different numbers of batches (a sharded stream), so they
        agree after every fetch; ``drop_last``: a pass ends at its last full micro-batch (and
        window)."""
        self.accelerator, self.loader, self.batch_size = accelerator, loader, batch_size
        self.world = accelerator.num_processes
        self.drop_last = drop_last
        # Created on every process in the same order (new_group is collective): at construction.
        self.group = dist.new_group(backend="gloo") if agree and self.world > 1 else None
        self.template: Any = None  # a batch of the right structure, for a process that has had none
        self.pass_ended = False
        self.data_wait = 0.0
        self._resume_state: Any = None

    def micro_batches(self, start: int, need_full: bool = False) -> Iterator[Fetched]:
        """The pass's micro-batches from ``start``, as every process agrees them."""
        device, iterator = self.accelerator.device, iter(self.loader)
        last: Any = None
        index = start
        exhausted_at: Any = None  # the state before the fetch that found this process's end
        while True:
            began = time.perf_counter()
            # Once exhausted, the loader's own state says "pass over", which a resume would read as
            # "start the next pass": the state from before the end is what resumes here.
            state = self.loader.state_dict() if exhausted_at is None else exhausted_at
            item = next(iterator, None)
            if item is None:
                exhausted_at = state
            self.data_wait += time.perf_counter() - began
            real = item[1].real if item is not None else 0
            total, more = self._agree(item, real, need_full)
            if not more:
                return
            mask: torch.Tensor | None
            if item is None:  # others still have batches: a zero-weight one keeps the steps in step
                data = last if last is not None else send_to_device(self.template, device)
                mask = torch.zeros(find_batch_size(data) or 0, dtype=torch.bool, device=device)
            else:
                data = last = send_to_device(item[0], device, non_blocking=True)
                rows = find_batch_size(data)
                mask = None if rows is None or real >= rows else torch.arange(rows, device=device) < real
            yield Fetched(state, _micro_batch(index, data, mask, total))
            index += 1

    def _agree(self, item: Any, real: int, need_full: bool) -> tuple[int, bool]:
        """(real rows of this micro-batch over all processes, whether the pass goes on)."""
        full = item is not None and real == self.batch_size
        if self.group is None:  # every process has the same batches (or there is one process)
            total = 0 if item is None else item[1].global_real
            if total is None:  # one process reading its own shards: it is everyone
                total = real
            return total, item is not None and (full or not need_full)
        counts = torch.tensor([int(item is not None), real, int(full)], dtype=torch.int64)
        dist.all_reduce(counts, group=self.group)
        has, total, fulls = counts.tolist()
        return total, (fulls == self.world) if need_full else has > 0

    def windows(self, start: int, accumulation: int) -> Iterator[list[MicroBatch]]:
        """The training micro-batches from ``start``, grouped into optimizer steps. The pass's last
        window may be shorter; with DROP_LAST a short last window is dropped instead."""
        fetched = self.micro_batches(start, need_full=self.drop_last)
        ahead = accumulation if self.drop_last else 1  # what must be seen to know a window is the last
        buffer: deque[Fetched] = deque()
        exhausted = False
        self.pass_ended = False
        while True:
            while not exhausted and len(buffer) < accumulation + ahead:
                nxt = next(fetched, None)
                exhausted = nxt is None
                if nxt is not None:
                    buffer.append(nxt)
            if not buffer or (self.drop_last and len(buffer) < accumulation):
                break
            window = [buffer.popleft().batch for _ in range(min(accumulation, len(buffer)))]
            self.pass_ended = exhausted and len(buffer) < ahead
            self._resume_state = buffer[0].state if buffer else None
            yield window
        self._resume_state = None

    def state_dict(self) -> Any:
        """The loader's state at the first micro-batch not yet trained."""
        return self._resume_state if self._resume_state is not None else self.loader.state_dict()


def _micro_batch(index: int, data: Any, real: torch.Tensor | None, samples: int) -> MicroBatch:
    return MicroBatch(index, data, real, samples)
