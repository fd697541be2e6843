"""Streaming data (an ``IterableDataset``) cut into exactly the batches map-style data would give.

The stream's items, in iteration order, form global batches of ``B`` consecutive items; global batch
``g`` is process ``g % W``'s batch ``g // W``, as Accelerate's ``BatchSamplerShard`` does over a
sequential sampler. Without DROP_LAST the last global batches are filled, after every real item, with
repeats of the batch's own real items (of the pass's last item when it has none), so
``real_in_batch`` says how many leading items are real, as for map-style data. The repeats are
always the same, however the pass was resumed: they weigh nothing in the loss, but a model whose
rows interact (batch normalisation) still sees them, and a resumed run must compute what the
uninterrupted one computed.

Every process and every DataLoader worker reads the whole stream and skips the items that are not its
own; only collation, transfer and compute are sharded. Reading is cheap next to those, and it buys
two things: the order is exact and does not depend on how the run is factorised (processes x workers),
because nothing splits the stream by a rule of its own; and each reader knows from positions alone
which batches are its own and which items pad the last one, with no communication.

Resume: torchdata's ``StatefulDataLoader`` calls ``state_dict()`` inside each worker right after it
produces a batch, and ``load_state_dict()`` on each worker's copy before it iterates again. The state
is the reader's next batch and stream position, plus the stream's own state if it has one: then the
stream continues where it was (O(1)); otherwise the reader replays the stream from its start. For an
elastic resume (another world size or worker count) ``start_at`` replays to a process batch.

A stream without ``__len__`` is read the same way, its end found where it ends: a reader reads each
global batch round whole (its own items and the other processes'), so it knows how many of the
round's items are real on every process and every process yields the same number of batches.

A stream that can split itself (``sharded.ShardedStream``, a Hugging Face ``IterableDataset`` with
enough shards) is not read whole by every reader: ``stream_loader`` gives it ``sharded.ShardReaders``.

Every batch comes as ``(collated batch, BatchInfo)``: how many leading rows are real, and how many
real rows that micro-batch holds over all processes.

``stream_loader`` returns a ``StreamLoader``: already per process, so it must not go through
``accelerator.prepare`` (which would shard it again). ``loader.shard`` reaches the ``StreamShard``
(or ``ShardReaders``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import ValidationError
from torch.utils.data import IterableDataset, default_collate, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from ...schedule.steps import batches_per_process
from ...state_fields import Count, Int, StateModel
from ..sampling import real_in_batch, samples_in_global_batch
from .reader import END, StreamError, StreamReader
from .sharded import BatchInfo, ShardedStream, ShardReaders, sharded_source

STATE_VERSION = 1


class StreamShardState(StateModel):
    """The format of ``StreamShard.state_dict()``: one reader's next batch of the epoch and
    stream position, and the stream's own state there (free-form; None: replay from the start)."""

    version: Int
    epoch: Count
    next_batch: Count
    items_read: Count
    stream: Any


@dataclass
class _Position:
    """Where a reader is, or where its next iteration starts."""

    next_batch: int
    items_read: int = 0
    stream_state: Any = None  # the stream's own state at items_read; None: read from the start
    per_worker: bool = False  # start_at: next_batch is the process's batch, each worker adds its id
    started: bool = False  # the reader has opened the stream (its state is live from then on)
    finished: bool = False


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (1, 0) if info is None else (info.num_workers, info.id)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class StreamShard(IterableDataset[Any]):
    """Process ``rank``'s collated batches of a stream, in ``BatchSamplerShard`` order, each as
    ``(batch, BatchInfo)``.

    ``len(self)`` is the number of batches every process yields per epoch, each of ``batch_size``
    items (a stream without ``__len__`` has none: ``size`` is None). With DataLoader workers, worker
    ``w`` of ``n`` yields the batches ``j`` with ``(j - start) % n == w``, so a ``batch_size=None``
    DataLoader returns them in order.
    """

    STATE_SCHEMA: ClassVar[type[StreamShardState]] = StreamShardState

    def __init__(
        self,
        stream: Iterable[Any],
        *,
        batch_size: int,
        world_size: int,
        rank: int,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        size = len(stream) if isinstance(stream, Sized) else None
        if size is not None and not _is_count(size):
            raise StreamError(
                f"len() of {type(stream).__name__} is {size!r}: it must be the number of items per pass"
            )
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise StreamError(
                f"StreamShard needs batch_size >= 1, world_size >= 1 and 0 <= rank < world_size, got batch_size={batch_size}, world_size={world_size}, rank={rank}"
            )
        self.stream = stream
        self.size = size
        self.batch_size, self.world_size, self.rank, self.drop_last = batch_size, world_size, rank, drop_last
        self.collate_fn: Callable[[list[Any]], Any] = collate_fn or default_collate
        self.batches_per_epoch = (
            None if size is None else batches_per_process(size, batch_size, world_size, drop_last)
        )
        self.epoch = 0
        self._pending: _Position | None = None  # applies to the next iteration only
        self._live: _Position | None = None

    def __len__(self) -> int:
        if self.batches_per_epoch is None:
            raise TypeError(f"{type(self.stream).__name__} has no __len__: its passes end where it ends")
        return self.batches_per_epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        forward = getattr(self.stream, "set_epoch", None)
        if callable(forward):
            forward(epoch)

    def start_at(self, batch_index: int) -> None:
        """Start the next iteration at this process's batch ``batch_index`` (elastic resume: any
        world size or worker count; every worker replays the stream from its start)."""
        if not _is_count(batch_index):
            raise StreamError(f"start_at() needs a batch index >= 0, got {batch_index!r}")
        self._pending = _Position(next_batch=batch_index, per_worker=True)

    def _resolve(self, pending: _Position | None, worker: int) -> _Position:
        if pending is None or pending.per_worker:
            return _Position(next_batch=(pending.next_batch if pending else 0) + worker)
        if pending.stream_state is None or not callable(getattr(self.stream, "load_state_dict", None)):
            return _Position(next_batch=pending.next_batch)  # replay: the reader skips to its batch
        return _Position(pending.next_batch, pending.items_read, pending.stream_state)

    def state_dict(self) -> dict[str, Any]:
        live = self._live
        pos = live if live is not None and not live.finished else self._resolve(self._pending, _worker()[1])
        stream_state = pos.stream_state
        saver = getattr(self.stream, "state_dict", None)
        if pos.started:
            # A pass that has read nothing restarts from the stream's start; no state needed.
            stream_state = saver() if callable(saver) and pos.items_read > 0 else None
        # StreamShardState's keys, built by hand: torchdata asks for this after every batch.
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "next_batch": pos.next_batch,
            "items_read": pos.items_read,
            "stream": stream_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the next iteration where ``state`` (from ``state_dict``) was saved."""
        keys = list(StreamShardState.model_fields)
        if not isinstance(state, dict) or any(key not in state for key in keys):
            raise StreamError(
                f"a stream state must be the dict StreamShard.state_dict() returns, with keys {keys}; got {state!r:.200}"
            )
        if state["version"] != STATE_VERSION:
            raise StreamError(
                f"stream state version {state['version']!r} is not supported (this linnaeus-accel reads version {STATE_VERSION}); resume elastically with start_at() instead"
            )
        try:
            StreamShardState.model_validate(state)
        except ValidationError as exc:
            key = str(exc.errors()[0]["loc"][0])
            raise StreamError(
                f"stream state {key!r} must be an int >= 0, got {state[key]!r}: the checkpoint is damaged or not a StreamShard state"
            ) from None
        next_batch, items_read = state["next_batch"], state["items_read"]
        if (
            self.size is not None
            and self.batches_per_epoch is not None
            and next_batch < self.batches_per_epoch
        ):
            first = self._first_item(next_batch)
            if items_read > min(first, self.size - 1):
                raise StreamError(
                    f"stream state has read {items_read} items but its next batch {next_batch} starts at item {first} of {self.size}: it was saved with another batch size, world size, rank or stream length; resume elastically with start_at() instead"
                )
        self.set_epoch(state["epoch"])
        self._pending = _Position(next_batch, items_read, state["stream"])

    def _first_item(self, batch: int) -> int:
        return (batch * self.world_size + self.rank) * self.batch_size

    def _real(self, batch: int) -> int:
        assert self.size is not None
        if self.drop_last:
            return self.batch_size
        return real_in_batch(self.size, self.batch_size, self.world_size, batch, self.rank)

    def _pad_sources(self, batch: int) -> set[int]:
        """Stream positions kept to pad ``batch``: the pass's last item, for a batch with no real item."""
        assert self.size is not None
        return set() if self._real(batch) == self.batch_size else {self.size - 1}

    def __iter__(self) -> Iterator[Any]:
        workers, worker = _worker()
        # The pending start is taken now, not at the first batch: StatefulDataLoader asks for
        # state_dict() between iter() and the first next().
        self._live = self._resolve(self._pending, worker)
        self._pending = None
        if self.size is None:
            return self._unsized_batches(self._live, workers)
        return self._batches(self._live, workers)

    def _open(self, pos: _Position, size: int | None, keep: set[int]) -> StreamReader:
        if pos.stream_state is not None:
            self.stream.load_state_dict(pos.stream_state)  # type: ignore[attr-defined]
        reader = StreamReader(iter(self.stream), pos.items_read, size, keep)
        pos.started, pos.stream_state = True, None
        return reader

    def _batches(self, pos: _Position, step: int) -> Iterator[Any]:
        assert self.size is not None
        assert self.batches_per_epoch is not None
        mine = range(pos.next_batch, self.batches_per_epoch, step)
        if mine:
            reader = self._open(pos, self.size, self._pad_sources(mine[-1]))
            for batch in mine:
                items, real = self._read(batch, reader, last=batch == mine[-1])
                pos.next_batch, pos.items_read = batch + step, reader.pos
                in_round = samples_in_global_batch(
                    self.size, self.batch_size, self.world_size, batch, self.drop_last
                )
                yield self.collate_fn(items), BatchInfo(real, in_round)
        pos.finished = True

    def _read(self, batch: int, reader: StreamReader, *, last: bool) -> tuple[list[Any], int]:
        assert self.size is not None
        first, real = self._first_item(batch), self._real(batch)
        reader.skip_to(min(first, self.size))
        items = reader.take(real)
        if last and not self.drop_last:
            reader.drain()
        return self._padded(items, reader.kept.get(self.size - 1, END)), real

    def _padded(self, items: list[Any], pass_last: Any) -> list[Any]:
        """A short batch filled with repeats of items every reader of this batch has read, resumed
        or not (not the pass's start, which an O(1) resume does not read again): its own, or the
        pass's last item when it has none."""
        if len(items) < self.batch_size:
            source = items or [pass_last]
            items = items + [source[i % len(source)] for i in range(self.batch_size - len(items))]
        return items

    def _unsized_batches(self, pos: _Position, step: int) -> Iterator[Any]:
        """A stream without ``__len__``: each global round read whole, so that every reader knows
        whether the round exists and how many of its items are real (the last round's)."""
        reader = self._open(pos, None, set())
        per_round = self.batch_size * self.world_size
        batch = pos.next_batch
        while True:
            round_start = batch * per_round
            reader.skip_to(self._first_item(batch))
            items = reader.take(self.batch_size)
            reader.skip_to(round_start + per_round)
            in_round = reader.pos - round_start
            if in_round <= 0 or (self.drop_last and in_round < per_round):
                break  # the pass ended before this round (or, DROP_LAST, inside it)
            real = len(items)
            pos.next_batch, pos.items_read = batch + step, reader.pos
            yield self.collate_fn(self._padded(items, reader.last)), BatchInfo(real, in_round)
            batch += step
        pos.finished = True


class StreamLoader(StatefulDataLoader):  # type: ignore[misc]
    """A ``StatefulDataLoader`` over a ``StreamShard`` or ``ShardReaders``; ``shard`` reaches it
    (``set_epoch``, ``start_at``)."""

    @property
    def shard(self) -> StreamShard | ShardReaders:
        shard: StreamShard | ShardReaders = self.dataset
        return shard

    @property
    def sharded(self) -> bool:
        """Whether each reader reads its own shards (else every reader reads the whole stream)."""
        return isinstance(self.dataset, ShardReaders)

    def __iter__(self) -> Iterator[Any]:
        iterator: Iterator[Any] = super().__iter__()
        if self.num_workers > 0:
            # The workers started with their own copies of the shard, pending start included; the
            # main copy never iterates, so it must drop that start or the next epoch would reuse it.
            self.shard._pending = None
        return iterator


def shard_reading(stream: Any, world_size: int, num_workers: int) -> ShardedStream | None:
    """The stream as shards its readers split, when it can split itself into at least as many shards
    as there are readers (processes x workers); None when every reader must read it whole."""
    sharded = sharded_source(stream)
    if sharded is None or len(sharded.shards()) < world_size * max(1, num_workers):
        return None
    return sharded


def stream_loader(
    stream: Iterable[Any],
    *,
    batch_size: int,
    world_size: int,
    rank: int,
    num_workers: int,
    drop_last: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    pin_memory: bool = False,
    seed: int = 0,
    shuffle: bool = False,
) -> StreamLoader:
    """Process ``rank``'s loader of a stream; see the module docstring. A stream that splits itself
    into at least as many shards as there are readers (processes x workers) is read shard by shard
    (``shuffle``: in an order keyed by ``(seed, epoch)``); any other is read whole by every reader."""
    shard: StreamShard | ShardReaders
    sharded = shard_reading(stream, world_size, num_workers)
    if sharded is not None:
        shard = ShardReaders(
            sharded,
            batch_size=batch_size,
            world_size=world_size,
            rank=rank,
            seed=seed,
            shuffle=shuffle,
            collate_fn=collate_fn,
        )
    else:
        shard = StreamShard(
            stream,
            batch_size=batch_size,
            world_size=world_size,
            rank=rank,
            drop_last=drop_last,
            collate_fn=collate_fn,
        )
    # batch_size=None: the shard yields collated batches. Workers are not persistent, so each epoch
    # starts new ones from the main copy, and set_epoch / start_at reach them.
    # Its own generator: creating an iterator draws the workers' base seed from it, not from the
    # global RNG, whose restored state a resumed run's dropout must continue from.
    return StreamLoader(
        shard,
        batch_size=None,
        num_workers=num_workers,
        persistent_workers=False,
        pin_memory=pin_memory,
        generator=torch.Generator(),
    )
