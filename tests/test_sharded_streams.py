"""Streams that split themselves (``data/streams/sharded.py``, docs/semantics.md §7): every shard read by exactly one
reader (process x DataLoader worker) per pass, counted rather than assumed; the order a pure
function of (seed, epoch, shards, layout); a resume continuing each reader where it was (in O(1)
through the shard's own state, else by skipping inside one shard); another layout refused inside a
pass. Processes are emulated by building each rank's loader in turn (the DataLoader workers are
real processes); the trainer's agreement across real processes is in ``test_data_at_scale.py``.
"""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset

from linnaeus_accel.data.streams.sharded import ShardReaders, shard_order
from linnaeus_accel.data.streams.streaming import StreamShard, stream_loader

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


class Cursor:
    """A shard reader that keeps its own position, as a file reader keeping a byte offset would."""

    def __init__(self, items: list[int]) -> None:
        self.items, self.position = items, 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]

    def __iter__(self) -> Iterator[int]:
        while self.position < len(self.items):
            self.position += 1
            yield self.items[self.position - 1]


class CountingShards(IterableDataset[int]):
    """Shards of different sizes (item ``1000 * shard + i``); counts every open and every item read
    in shared memory, so DataLoader worker processes are counted too."""

    def __init__(self, sizes: list[int], stateful: bool = False) -> None:
        self.sizes, self.stateful = sizes, stateful
        self.opens: Any = multiprocessing.Array("l", len(sizes))
        self.reads: Any = multiprocessing.Value("l", 0)

    def shards(self) -> list[int]:
        return list(range(len(self.sizes)))

    def items(self, shard: int) -> list[int]:
        return [1000 * shard + i for i in range(self.sizes[shard])]

    def open_shard(self, shard: int) -> Any:
        with self.opens.get_lock():
            self.opens[shard] += 1
        items = self.items(shard)
        if self.stateful:
            return _Counted(Cursor(items), self.reads)
        return _counted(iter(items), self.reads)

    def __iter__(self) -> Iterator[int]:
        for shard in self.shards():
            yield from self.items(shard)


class _Counted(Cursor):
    def __init__(self, cursor: Cursor, reads: Any) -> None:
        super().__init__(cursor.items)
        self.reads = reads

    def __iter__(self) -> Iterator[int]:
        for item in super().__iter__():
            with self.reads.get_lock():
                self.reads.value += 1
            yield item


def _counted(items: Iterator[int], reads: Any) -> Iterator[int]:
    for item in items:
        with reads.get_lock():
            reads.value += 1
        yield item


SIZES = [7, 3, 11, 0, 5, 9, 4, 6]  # an empty shard too


def read_pass(stream: CountingShards, world: int, workers: int, *, epoch: int = 0) -> list[list[list[int]]]:
    """Every process's batches of one pass (``[rank][batch] -> items``), the real items only."""
    out = []
    for rank in range(world):
        loader = stream_loader(
            stream, batch_size=4, world_size=world, rank=rank, num_workers=workers, seed=3, shuffle=True
        )
        assert isinstance(loader.shard, ShardReaders)
        loader.shard.set_epoch(epoch)
        out.append([batch[: info.real].tolist() for batch, info in loader])
    return out


@pytest.mark.parametrize(("world", "workers"), [(1, 0), (1, 2), (2, 0), (2, 2), (4, 0)])
def test_every_shard_is_read_once_per_pass_by_one_reader(world: int, workers: int) -> None:
    stream = CountingShards(SIZES)
    batches = read_pass(stream, world, workers)
    items = sorted(x for rank in batches for batch in rank for x in batch)
    assert items == sorted(
        x for shard in stream.shards() for x in stream.items(shard)
    )  # none twice, none lost
    assert list(stream.opens) == [1] * len(SIZES)  # each shard opened once, across every reader
    assert stream.reads.value == sum(SIZES)  # and read once: no reader reads what is not its own


def test_the_order_is_keyed_by_seed_and_epoch_and_the_same_when_read_again() -> None:
    first = read_pass(CountingShards(SIZES), 2, 2, epoch=0)
    assert read_pass(CountingShards(SIZES), 2, 2, epoch=0) == first
    assert read_pass(CountingShards(SIZES), 2, 2, epoch=1) != first
    assert sorted(shard_order(8, 3, 1, True)) == list(range(8))
    assert shard_order(8, 3, 1, False) == list(range(8))  # validation: the listed order


def test_a_readers_last_batch_is_filled_with_its_own_items_marked_not_real() -> None:
    loader = stream_loader(CountingShards([6]), batch_size=4, world_size=1, rank=0, num_workers=0)
    (_first, info1), (second, info2) = list(loader)
    assert (info1.real, info2.real) == (4, 2)
    assert second.tolist() == [4, 5, 4, 5]
    assert info2.global_real is None  # a sharded reader cannot know the other processes' rows


@pytest.mark.parametrize("stateful", [True, False])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_inside_a_pass_continues_each_reader_where_it_was(stateful: bool, workers: int) -> None:
    kwargs: dict[str, Any] = {"batch_size": 4, "world_size": 2, "rank": 1, "seed": 3, "shuffle": True}
    full, reals = [], []
    for batch, info in stream_loader(CountingShards(SIZES, stateful), num_workers=workers, **kwargs):
        full.append(batch.tolist())
        reals.append(info.real)
    taken = 3
    loader = stream_loader(CountingShards(SIZES, stateful), num_workers=workers, **kwargs)
    iterator = iter(loader)
    head = [next(iterator)[0].tolist() for _ in range(taken)]
    state = json.loads(json.dumps(loader.state_dict()))  # checkpoints hold it as JSON
    del iterator
    stream = CountingShards(SIZES, stateful)
    resumed = stream_loader(stream, num_workers=workers, **kwargs)
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b, _ in resumed] == full
    still_to_read = sum(reals) - sum(reals[:taken])
    if stateful:  # each reader's current shard continued from its own state: nothing read twice
        assert stream.reads.value == still_to_read
    else:  # reopened and skipped inside its current shard only
        assert still_to_read < stream.reads.value < sum(reals)
    # Never the pass again: the shards already finished are not opened.
    assert sum(stream.opens) < 4


def test_another_layout_inside_a_pass_is_refused_naming_it() -> None:
    kwargs: dict[str, Any] = {"batch_size": 4, "world_size": 2, "rank": 0, "seed": 3, "shuffle": True}
    loader = stream_loader(CountingShards(SIZES), num_workers=0, **kwargs)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    del iterator
    other = stream_loader(CountingShards(SIZES), num_workers=0, **{**kwargs, "world_size": 1})
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="reader 0 of 2, not 0 of 1"):
        list(other)


def test_fewer_shards_than_readers_fall_back_to_reading_the_whole_stream() -> None:
    stream = CountingShards([5, 5, 5])
    loader = stream_loader(stream, batch_size=2, world_size=2, rank=0, num_workers=2)
    assert isinstance(loader.shard, StreamShard)  # 3 shards for 4 readers
    assert not loader.sharded


def test_hugging_face_streaming_datasets_split_by_their_shards(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    files = []
    for shard in range(4):
        path = tmp_path / f"part{shard}.jsonl"
        path.write_text("".join(json.dumps({"x": 100 * shard + i}) + "\n" for i in range(3 + shard)))
        files.append(str(path))
    stream = datasets.load_dataset("json", data_files=files, split="train", streaming=True).with_format(
        "torch"
    )
    for workers in (0, 2):  # real worker processes: datasets must not split a shard among them again
        got = []
        for rank in range(2):
            loader = stream_loader(
                stream, batch_size=2, world_size=2, rank=rank, num_workers=workers, seed=0, shuffle=True
            )
            assert loader.sharded
            got += [x for batch, info in loader for x in batch["x"][: info.real].tolist()]
        assert sorted(got) == sorted(100 * s + i for s in range(4) for i in range(3 + s)), workers


def test_a_reader_state_is_plain_json() -> None:
    loader = stream_loader(CountingShards(SIZES, True), batch_size=4, world_size=1, rank=0, num_workers=0)
    iterator = iter(loader)
    next(iterator)
    assert json.loads(json.dumps(loader.state_dict())) == loader.state_dict()
    assert torch.is_tensor(next(iterator)[0])
