"""Where a process's micro-batches come from, which of their rows are real, and how they group into
optimizer steps.

Map-style data goes through Accelerate's prepared DataLoader (our epoch-seeded sampler, sharded
by ``BatchSamplerShard``; resuming skips batches through the batch sampler, loading nothing).
Streams (``IterableDataset``) go through ``StreamShard`` and torchdata's ``StatefulDataLoader``,
whose per-worker position is saved in each process's part of the checkpoint. Either way process
``p``'s ``j``-th batch holds the same samples of the epoch's global order, so one helper
(``real_in_batch``) tells which rows are even-batch repeats.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from accelerate import Accelerator
from accelerate.utils import find_batch_size, send_to_device
from torch import Tensor

from ...checkpoint.state.schemas import BatchSourceState
from ...config import ConfigError
from ...data.keyed_random import python_keyed_bits
from ...data.sampling import real_in_batch
from ..start.stream_agreement import UnsizedStream
from .micro_batch import MicroBatch

STATE_VERSION = 1
_WORKER_SEED_STREAM = 7  # keyed-draw stream of the DataLoader workers' base seed


class BatchSource:
    """One process's view of a training or validation DataLoader."""

    STATE_SCHEMA: ClassVar[type[BatchSourceState]] = BatchSourceState  # defined where verification reaches it

    def __init__(
        self,
        accelerator: Accelerator,
        loader: Any,
        size: int | None,
        batch_size: int,
        *,
        stream: bool,
        seed: int,
        sampler: Any = None,
        drop_last: bool = False,
    ) -> None:
        """``size``: samples per pass over all processes (None: a stream without ``__len__``);
        ``stream``: ``loader`` is a ``stream_loader`` (not prepared by Accelerate, so batches are
        moved to the device here; each comes as ``(batch, BatchInfo)``); ``sampler``: the map-style
        loader's ``EpochSeededSampler`` (None for a DataLoader given with a sampler of its own);
        ``drop_last``: DATA.DROP_LAST (the training data)."""
        self.accelerator = accelerator
        self.loader = loader
        self.sampler = sampler
        self.size = size
        self.batch_size = batch_size
        self.stream = stream
        self.seed = seed
        # The loader's own generator (a DataLoader given without one gets one): DataLoader workers'
        # base seed is drawn from it, keyed by (seed, epoch), never from the global RNG.
        self.generator: torch.Generator | None = getattr(loader, "generator", None)
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self._data_wait = 0.0  # seconds spent waiting for training batches (see ``windows``)
        self.drop_last = drop_last
        # A stream without __len__: its processes agree on where each pass ends.
        self.unsized = (
            UnsizedStream(accelerator, loader, batch_size, agree=loader.sharded, drop_last=drop_last)
            if stream and size is None
            else None
        )

    @property
    def pass_ended(self) -> bool:
        """Whether the window just yielded is the pass's last: known ahead only for a stream without
        ``__len__``; every other pass ends where the plan says."""
        return self.unsized is not None and self.unsized.pass_ended

    @property
    def data_wait(self) -> float:
        return self._data_wait + (self.unsized.data_wait if self.unsized is not None else 0.0)

    @property
    def dataset(self) -> Any:
        """The dataset the loader reads (the user's, or for a stream the shard reading it)."""
        shard = self.loader.dataset
        return getattr(shard, "stream", shard) if self.stream else shard

    def set_epoch(self, epoch: int) -> None:
        """Training: the epoch's data order. Validation passes call it with 0 before each pass."""
        target = self.loader.dataset if self.stream else self.loader
        target.set_epoch(epoch)
        if self.generator is not None:
            self.generator.manual_seed(python_keyed_bits(self.seed, epoch, 0, _WORKER_SEED_STREAM) >> 1)

    def micro_batches(self, start: int = 0) -> Iterator[MicroBatch]:
        """The epoch's batches from batch ``start`` on (a stream must have been positioned there by
        ``resume``)."""
        if self.unsized is not None:
            yield from (fetched.batch for fetched in self.unsized.micro_batches(start))
            return
        device = self.accelerator.device
        for index, batch in enumerate(self._loader_from(start), start):
            if self.stream:
                batch, info = batch
                batch = send_to_device(batch, device, non_blocking=True)
                yield MicroBatch(index, batch, self.real_mask(info.real, batch), info.global_real)
            else:
                yield MicroBatch(index, batch, self.real_rows(index, batch))

    def windows(self, start: int, accumulation: int) -> Iterator[list[MicroBatch]]:
        """The training batches from batch ``start`` on, grouped into optimizer steps; the epoch's
        last group may be shorter (docs/semantics.md §1: a trailing partial window is one optimizer step). The
        time spent waiting for batches is added up in ``data_wait``. One generator, the real rows
        looked up only where repeats can be: this runs once per micro-batch."""
        if self.unsized is not None:
            yield from self.unsized.windows(start, accumulation)
            return
        device, stream, clock = self.accelerator.device, self.stream, time.perf_counter
        batches = iter(self._loader_from(start))
        assert self.size is not None
        full = full_batches(self.size, self.batch_size, int(self.world), int(self.rank))
        window: list[MicroBatch] = []
        index = start
        while True:
            began = clock()
            try:
                batch = next(batches)
            except StopIteration:
                break
            if stream:  # (batch, BatchInfo): the real rows are known from the size, as for map-style data
                batch = send_to_device(batch[0], device, non_blocking=True)
            self._data_wait += clock() - began
            window.append(MicroBatch(index, batch, None if index < full else self.real_rows(index, batch)))
            index += 1
            if len(window) == accumulation:
                yield window
                window = []
        if window:
            yield window

    def samples_in(self, window: list[MicroBatch]) -> int:
        """Real samples in ``window``'s micro-batches over all processes (``samples_in_window``)."""
        if self.size is None:  # counted as the processes agreed them
            return sum(b.samples or 0 for b in window)
        return samples_in_window(window, self.size, self.batch_size, self.world, self.drop_last)

    def take_data_wait(self) -> float:
        """Seconds spent waiting for training batches since the last call."""
        wait = self.data_wait
        self._data_wait = 0.0
        if self.unsized is not None:
            self.unsized.data_wait = 0.0
        return wait

    def _loader_from(self, start: int) -> Any:
        if not start or self.stream:
            return self.loader
        # Skipped through the batch sampler: nothing is loaded. Our sampler also skips the indices
        # themselves (resume_at): the first global round, then the epoch from batch ``start`` on, so
        # each process drops one batch whatever the position.
        resume_at = getattr(self.sampler, "resume_at", None)
        if callable(resume_at):
            per_round = self.batch_size * self.world
            resume_at(start * per_round, per_round)
            return self.accelerator.skip_first_batches(self.loader, 1)
        return self.accelerator.skip_first_batches(self.loader, start)

    def real_rows(self, index: int, batch: Any) -> Tensor | None:
        assert self.size is not None
        return self.real_mask(real_in_batch(self.size, self.batch_size, self.world, index, self.rank), batch)

    def real_mask(self, real: int, batch: Any) -> Tensor | None:
        """Which rows of ``batch`` are real, its first ``real``; None when all are."""
        if real >= self.batch_size:
            return None  # the common case: host ints only, nothing allocated
        rows = find_batch_size(batch)
        if rows is None or real >= rows:
            return None  # one process's short last batch: nothing was repeated
        return torch.arange(rows, device=self.accelerator.device) < real

    # -- a stream's position, per process ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any] | None:
        """The position inside the epoch of a stream (each worker's); map-style data needs none."""
        if not self.stream:
            return None
        return BatchSourceState(
            version=STATE_VERSION,
            **self._layout(),
            loader=self.unsized.state_dict() if self.unsized is not None else self.loader.state_dict(),
        ).as_data()

    def _layout(self) -> dict[str, Any]:
        return {
            "world_size": self.world,
            "batch_size": self.batch_size,
            "num_workers": self.loader.num_workers,
            "sharded": self.loader.sharded,
        }

    def resume(self, state: dict[str, Any] | None, start: int) -> None:
        """Position a stream at batch ``start`` of the current epoch: from the saved loader state
        when it was this layout (O(1) when the stream has ``state_dict``), else by replaying the
        stream up to there (another number of processes or workers: elastic resume). A sharded
        stream's readers own their positions: another layout inside a pass is refused."""
        if not self.stream or start == 0:
            return
        problem = self.resume_problem(state, start)
        if problem is not None:
            raise ConfigError([problem], source="resume")
        if state and state.get("version") == STATE_VERSION and self._saved_layout(state) == self._layout():
            self.loader.load_state_dict(state["loader"])
        else:
            self.loader.dataset.start_at(start)

    def _saved_layout(self, state: dict[str, Any] | None) -> dict[str, Any]:
        return {k: (state or {}).get(k, False if k == "sharded" else None) for k in self._layout()}

    def resume_problem(self, state: dict[str, Any] | None, start: int) -> tuple[str, str] | None:
        """Why the saved position cannot be resumed here (asked at resume, before anything runs):
        a sharded stream's readers own their positions, so inside a pass only its own layout does."""
        if not self.stream or start == 0:
            return None
        saved, now = self._saved_layout(state), self._layout()
        if saved != now and (self.loader.sharded or saved["sharded"]):
            return layout_change(saved, now)
        return None


def layout_change(saved: dict[str, Any], now: dict[str, Any]) -> tuple[str, str]:
    """The refusal of a mid-pass resume of a sharded stream under another layout, naming it."""
    keys = {"num_workers": "DATA.NUM_WORKERS", "batch_size": "DATA.BATCH_SIZE", "world_size": "processes"}
    changed = [k for k in keys if saved.get(k) != now[k]] or ["sharded"]
    what = ", ".join(f"{keys.get(k, k)} {saved.get(k)} -> {now[k]}" for k in changed)
    return (
        keys.get(changed[0], "DATA"),
        f"the checkpoint was taken inside a pass over a sharded stream, whose readers (processes x "
        f"DataLoader workers) each own their shards and positions; this run reads it otherwise ({what}): "
        "resume with the processes, DATA.NUM_WORKERS and DATA.BATCH_SIZE it was saved with, or from a "
        "checkpoint at an epoch boundary, which resumes under any layout",
    )


def full_batches(dataset_size: int, batch_size: int, world_size: int, rank: int) -> int:
    """How many leading batches of process ``rank`` hold only real rows: ``real_in_batch`` is
    ``batch_size`` exactly for the indices below it."""
    return max(0, (dataset_size // batch_size - 1 - rank) // world_size + 1)


def samples_in_window(
    window: list[MicroBatch], dataset_size: int, batch_size: int, world_size: int, drop_last: bool
) -> int:
    """Real samples in a window's micro-batches over all processes: ``samples_in_global_batch``
    added up over its (consecutive) batches, in closed form, as the loop counts them every step."""
    per_step = batch_size * world_size
    if drop_last:
        return per_step * len(window)
    first, last = window[0].position, window[-1].position
    return min(dataset_size, (last + 1) * per_step) - min(dataset_size, first * per_step)
