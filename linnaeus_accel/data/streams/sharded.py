"""Streams that split themselves: every shard is read by exactly one reader per pass.

A stream made of shards (files, a Hugging Face dataset's shards) need not be read by everyone:
with ``P`` processes and ``W`` DataLoader workers each, there are ``R = P x max(1, W)`` readers,
reader ``r = rank x max(1, W) + worker``, and each reads only its own shards. A stream says it can
split by having two methods (``ShardedStream``)::

    class MyShards(torch.utils.data.IterableDataset):
        def shards(self) -> list[str]:                 # the same list on every process
            return sorted(glob.glob("data/*.jsonl"))
        def open_shard(self, shard: str) -> Iterable:  # one shard's items, in order
            return read_jsonl(shard)
        def __iter__(self):                            # reading it whole, e.g. for a first look
            for shard in self.shards():
                yield from self.open_shard(shard)

A Hugging Face ``datasets.IterableDataset`` with ``n_shards > 1`` splits the same way (``HFShards``:
shard ``i`` is ``dataset.shard(n_shards, i)``).

The order of a pass: its shards permuted by ``(seed, epoch)`` (``KeyedPermutation``; in their listed
order for validation), reader ``r`` taking positions ``r, r + R, r + 2R, ...`` of that order and
reading its shards one after the other, cut into batches of ``B`` items (a batch may span two
shards). A reader's last batch may be short: it is filled with repeats of its own items, which
``BatchInfo.real`` marks as not real. Each process's DataLoader deals its workers' batches round
robin. So the samples of a pass, and their order, are a pure function of ``(seed, epoch)``, the
shards, and the readers' layout (processes x workers); processes hold different numbers of batches
at the end of a pass, and the trainer agrees batch by batch on where the pass ends
(``training/start/stream_agreement.py``).

Resume: each reader's position is its place in its shard list and the items read from the
current shard. If ``open_shard`` returns an object with ``state_dict``/``load_state_dict`` (a
Hugging Face dataset does; a file reader of yours can keep a byte offset), that state is saved
and restored, and the resume costs what the shard's own resume costs (O(1) for a byte offset;
``datasets`` 5 re-reads a JSON or text shard's rows up to its saved row, without training on them);
otherwise the reader reopens the shard and skips the items it had read. Either way only the
current shard is read again, never the pass. A checkpoint taken inside a pass resumes only with
the same layout (the trainer refuses another, naming it); one taken at an epoch boundary resumes
with any layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from ..permutation import KeyedPermutation

STATE_VERSION = 1
_ORDER_STREAM = 0x5348_4152  # keyed-permutation stream of the shard order ("SHAR")


@runtime_checkable
class ShardedStream(Protocol):
    def shards(self) -> Sequence[Any]: ...

    def open_shard(self, shard: Any) -> Iterable[Any]: ...


class BatchInfo(NamedTuple):
    """What the trainer needs to know of a stream's batch besides its rows (a named tuple: the
    DataLoader passes it through as it is)."""

    real: int  # the leading rows that are not repeats
    # Real rows of that micro-batch over all processes, when the reader can know it; None for a
    # sharded stream, whose processes agree on it as they go.
    global_real: int | None


class HFShards:
    """A Hugging Face ``datasets.IterableDataset`` as a ``ShardedStream``: shard ``i`` is
    ``dataset.shard(num_shards=n_shards, index=i)``, read through ``HFShard`` (whose
    ``state_dict`` is the dataset's own: it resumes at its saved row, re-reading the shard's file
    up to there)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.epoch = 0

    def shards(self) -> list[int]:
        return list(range(self.dataset.n_shards))

    def open_shard(self, shard: int) -> HFShard:
        part = self.dataset.shard(num_shards=self.dataset.n_shards, index=shard, contiguous=True)
        part.set_epoch(self.epoch)  # a shuffle buffer of the dataset's own draws anew each epoch
        return HFShard(part)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class HFShard:
    """One shard of a Hugging Face ``IterableDataset``, row by row. Read with ``.iter()``, not
    ``iter()``: inside a DataLoader worker, a ``datasets.IterableDataset``'s ``__iter__`` splits its
    shards among the workers again, leaving a one-shard part to worker 0 and nothing to the others.
    (A ``shuffle(buffer_size=...)`` buffer's contents are lost on resume: datasets says so.)"""

    def __init__(self, part: Any) -> None:
        self.part = part

    def state_dict(self) -> Any:
        return self.part.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.part.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        for rows in self.part.iter(batch_size=1):  # one row, as a batch of one: unbatched here
            yield {key: value[0] for key, value in rows.items()}


def is_hf_iterable(stream: Any) -> bool:
    return type(stream).__module__.startswith("datasets.") and hasattr(stream, "n_shards")


def sharded_source(stream: Any) -> ShardedStream | None:
    """The stream as a ``ShardedStream`` if it can split itself, else None."""
    if callable(getattr(stream, "shards", None)) and callable(getattr(stream, "open_shard", None)):
        return stream  # type: ignore[no-any-return]
    if is_hf_iterable(stream):
        return HFShards(stream)
    return None


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (1, 0) if info is None else (info.num_workers, info.id)


def shard_order(count: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The positions of a pass's shards, in reading order (dealt round robin to the readers)."""
    if not shuffle or count < 2:
        return list(range(count))
    order: list[int] = (
        KeyedPermutation(count, seed, epoch, stream=_ORDER_STREAM).take(np.arange(count)).tolist()
    )
    return order


@dataclass
class ReaderPosition:
    """Where a reader is in its pass: its ``shard_index``-th shard, ``items_read`` items into it, and
    that shard's own state when its iterable keeps one."""

    shard_index: int = 0
    items_read: int = 0
    source_state: Any = None


class ShardReaders(IterableDataset[Any]):
    """One process's readers of a ``ShardedStream`` (one per DataLoader worker), yielding
    ``(collated batch, BatchInfo)``; see the module docstring."""

    def __init__(
        self,
        stream: ShardedStream,
        *,
        batch_size: int,
        world_size: int,
        rank: int,
        seed: int,
        shuffle: bool,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        self.stream = stream
        self.shard_list = list(stream.shards())
        self.batch_size, self.world_size, self.rank = batch_size, world_size, rank
        self.seed, self.shuffle = seed, shuffle
        self.collate_fn: Callable[[list[Any]], Any] = collate_fn or default_collate
        self.epoch = 0
        self._pending: dict[str, Any] | None = None  # a loaded state, for the next iteration only
        self._live: ReaderPosition | None = None
        self._source: Any = None  # the shard being read, when its iterable keeps a state
        self._workers = 1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        forward = getattr(self.stream, "set_epoch", None)
        if callable(forward):
            forward(epoch)

    def readers(self, workers: int) -> int:
        return self.world_size * max(1, workers)

    def my_shards(self, workers: int, worker: int) -> list[Any]:
        readers = self.readers(workers)
        reader = self.rank * max(1, workers) + worker
        order = shard_order(len(self.shard_list), self.seed, self.epoch, self.shuffle)
        return [self.shard_list[i] for i in order[reader::readers]]

    # -- state (StatefulDataLoader calls these in each worker) ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        workers, worker = _worker()
        position = self._live or ReaderPosition()
        source = self._source
        source_state = source.state_dict() if source is not None else position.source_state
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "readers": self.readers(workers),
            "reader": self.rank * max(1, workers) + worker,
            "shard_index": position.shard_index,
            "items_read": position.items_read,
            "source": source_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        keys = ("version", "epoch", "readers", "reader", "shard_index", "items_read", "source")
        if (
            not isinstance(state, dict)
            or any(k not in state for k in keys)
            or state["version"] != STATE_VERSION
        ):
            raise ValueError(f"not a sharded-stream reader state (version {STATE_VERSION}): {state!r:.200}")
        self.set_epoch(int(state["epoch"]))
        self._pending = state

    def _start(self, workers: int, worker: int) -> ReaderPosition:
        pending, self._pending = self._pending, None
        if pending is None:
            return ReaderPosition()
        readers, reader = self.readers(workers), self.rank * max(1, workers) + worker
        if (pending["readers"], pending["reader"]) != (readers, reader):
            raise ValueError(
                f"this reader state is reader {pending['reader']} of {pending['readers']}, not {reader} of {readers}: "
                "a sharded stream resumes inside a pass only with the processes and workers it was saved with"
            )
        return ReaderPosition(int(pending["shard_index"]), int(pending["items_read"]), pending["source"])

    # -- reading ---------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        workers, worker = _worker()
        self._workers = workers
        self._live = self._start(workers, worker)
        return self._batches(self.my_shards(workers, worker), self._live)

    def _items(self, shards: list[Any], position: ReaderPosition) -> Iterator[Any]:
        """The reader's items from ``position`` on, keeping ``position`` current as they are read."""
        while position.shard_index < len(shards):
            source: Any = self.stream.open_shard(shards[position.shard_index])
            stateful = callable(getattr(source, "state_dict", None)) and callable(
                getattr(source, "load_state_dict", None)
            )
            items: Iterator[Any]
            if stateful and position.source_state is not None:
                source.load_state_dict(position.source_state)
                items = iter(source)
            else:  # reopened: skip what was read (within this one shard, never the pass)
                items = islice(iter(source), position.items_read, None)
            self._source = source if stateful else None
            position.source_state = None
            for item in items:
                position.items_read += 1
                yield item
            self._source = None
            position.shard_index, position.items_read = position.shard_index + 1, 0

    def _batches(self, shards: list[Any], position: ReaderPosition) -> Iterator[Any]:
        items = self._items(shards, position)
        size = self.batch_size
        while batch := list(islice(items, size)):
            real = len(batch)
            if real < size:  # the reader's last batch: repeats of its own items, not real
                batch += [batch[i % real] for i in range(size - real)]
            yield self.collate_fn(batch), BatchInfo(real, None)
