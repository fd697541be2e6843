"""Streaming data: the same batches as map-style data under Accelerate, on any factorisation, and an
exact resume. Processes are emulated by building one shard per rank (no Accelerator needed)."""

from __future__ import annotations

import json
import multiprocessing
import traceback
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, IterableDataset, SequentialSampler

from linnaeus_accel.data.sampling import real_in_batch
from linnaeus_accel.data.streams import streaming
from linnaeus_accel.data.streams.reader import StreamError
from linnaeus_accel.data.streams.streaming import StreamShard, stream_loader
from linnaeus_accel.schedule.steps import batches_per_process

# torchdata 0.11 calls a torch function that torch 2.13 deprecates; nothing to act on here.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


class RangeStream(IterableDataset[int]):
    """Items 0..n-1, or a permutation of them seeded by the epoch. Counts every item it produces in
    shared memory, so a test sees how much was read also inside DataLoader worker processes."""

    def __init__(self, n: int, *, length: int | None = None, shuffle: bool = False) -> None:
        self.n = n
        self.length = n if length is None else length
        self.shuffle = shuffle
        self.epoch = 0
        self.produced: Any = multiprocessing.Value("l", 0)

    def __len__(self) -> int:
        return self.length

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist()

    def _count(self) -> None:
        with self.produced.get_lock():
            self.produced.value += 1

    def __iter__(self) -> Iterator[int]:
        for item in self.order():
            self._count()
            yield item


class ResumableStream(RangeStream):
    """A stream that saves its own position, as a sharded file reader or a Hugging Face streaming
    dataset would: resuming it must not read the pass again."""

    def __init__(self, n: int, **kwargs: Any) -> None:
        super().__init__(n, **kwargs)
        self.position = 0
        self.resume_at = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume_at = state["position"]

    def __iter__(self) -> Iterator[int]:
        start, self.resume_at = self.resume_at, 0
        order = self.order()
        for i in range(start, self.n):
            self.position = i + 1
            self._count()
            yield order[i]


class NoLength(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


def accelerate_order(n: int, batch_size: int, world_size: int, drop_last: bool) -> list[list[int]]:
    """What map-style data gives under Accelerate: every process's batches, interleaved round-robin."""
    per_rank = [
        list(
            BatchSamplerShard(
                BatchSampler(SequentialSampler(range(n)), batch_size, drop_last), world_size, rank
            )
        )
        for rank in range(world_size)
    ]
    return [per_rank[rank][j] for j in range(len(per_rank[0])) for rank in range(world_size)]


def emulated_worker_batches(
    monkeypatch: pytest.MonkeyPatch, shard: StreamShard, workers: int
) -> list[list[int]]:
    """A ``batch_size=None`` DataLoader's output without starting processes: each worker's batches,
    taken round-robin from worker 0 (what the DataLoader does with the workers' results)."""
    if workers == 0:
        return [batch.tolist() for batch, _ in shard]
    per_worker = []
    for worker in range(workers):
        info = SimpleNamespace(id=worker, num_workers=workers)
        monkeypatch.setattr(streaming, "get_worker_info", lambda info=info: info)
        per_worker.append([batch.tolist() for batch, _ in shard])
    monkeypatch.undo()
    rounds = max(map(len, per_worker))
    return [w[i] for i in range(rounds) for w in per_worker if i < len(w)]


@pytest.mark.parametrize("workers", [0, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_batches_match_accelerate_map_style_order_for_any_workers(
    monkeypatch: pytest.MonkeyPatch, world_size: int, drop_last: bool, workers: int
) -> None:
    batch_size = 4
    # An empty pass, sizes below one global batch, uneven ones, and ones that divide B * W evenly.
    for n in (0, 1, 5, 13, 24, 25, 37):
        shards = [
            StreamShard(
                RangeStream(n), batch_size=batch_size, world_size=world_size, rank=rank, drop_last=drop_last
            )
            for rank in range(world_size)
        ]
        per_rank = [emulated_worker_batches(monkeypatch, shard, workers) for shard in shards]
        expected_batches = batches_per_process(n, batch_size, world_size, drop_last)
        assert all(len(batches) == expected_batches for batches in per_rank), n
        got = [per_rank[rank][j] for j in range(expected_batches) for rank in range(world_size)]
        # The real items sit where Accelerate puts them for map-style data (its repeats differ).
        want = accelerate_order(n, batch_size, world_size, drop_last)
        assert len(got) == len(want), n
        for g, (ours, theirs) in enumerate(zip(got, want, strict=True)):
            real = batch_size if drop_last else max(0, min(batch_size, n - g * batch_size))
            assert ours[:real] == theirs[:real], (n, g)
        # The trainer weights the leading real_in_batch items: they must be the pass's real items
        # at this batch's place in the global order.
        for rank, batches in enumerate(per_rank):
            for j, batch in enumerate(batches):
                real = batch_size if drop_last else real_in_batch(n, batch_size, world_size, j, rank)
                first = (j * world_size + rank) * batch_size
                assert batch[:real] == list(range(first, first + real))


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_process_gets_batches_per_process_full_batches(drop_last: bool) -> None:
    n, batch_size, world_size = 23, 4, 3
    for rank in range(world_size):
        loader = stream_loader(
            RangeStream(n),
            batch_size=batch_size,
            world_size=world_size,
            rank=rank,
            num_workers=0,
            drop_last=drop_last,
        )
        batches = [batch for batch, _ in loader]
        # Equal counts keep the processes' collectives in step; len() is what the schedule uses.
        assert len(batches) == len(loader) == batches_per_process(n, batch_size, world_size, drop_last)
        assert all(batch.shape == (batch_size,) for batch in batches)


def test_drop_last_stops_reading_after_the_last_full_batch() -> None:
    stream = RangeStream(23)
    batches = [
        b for b, _ in stream_loader(stream, batch_size=4, world_size=1, rank=0, num_workers=0, drop_last=True)
    ]
    # An expensive or endless remainder of the pass is never read.
    assert len(batches) == 5
    assert stream.produced.value == 20


def test_dataloader_workers_give_the_same_batches_as_one_process() -> None:
    # Real worker processes (the splitting itself is covered with emulated workers above).
    for rank in range(2):
        batches = [
            b.tolist()
            for b, _ in stream_loader(RangeStream(29), batch_size=4, world_size=2, rank=rank, num_workers=2)
        ]
        single = [
            b.tolist()
            for b, _ in stream_loader(RangeStream(29), batch_size=4, world_size=2, rank=rank, num_workers=0)
        ]
        assert batches == single
        assert len(batches) == batches_per_process(29, 4, 2)


def reads_after_resume(n: int, batch_size: int, world_size: int, rank: int, workers: int, taken: int) -> int:
    """Items an O(1) resume reads: each reader continues after the last batch it had yielded."""
    total = 0
    for worker in range(max(1, workers)):
        yielded = [j for j in range(taken) if j % max(1, workers) == worker]
        position = ((yielded[-1] * world_size + rank) + 1) * batch_size if yielded else 0
        total += n - position
    return total


@pytest.mark.parametrize("stream_type", [ResumableStream, RangeStream])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_continues_exactly(workers: int, stream_type: type[RangeStream]) -> None:
    n, batch_size, world_size, rank, taken = 37, 4, 2, 1, 3
    kwargs: dict[str, Any] = {"batch_size": batch_size, "world_size": world_size, "rank": rank}
    full = [b.tolist() for b, _ in stream_loader(stream_type(n, shuffle=True), num_workers=0, **kwargs)]

    loader = stream_loader(stream_type(n, shuffle=True), num_workers=workers, **kwargs)
    iterator = iter(loader)
    head = [next(iterator)[0].tolist() for _ in range(taken)]
    # Checkpoints store the loader state as JSON.
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator

    stream = stream_type(n, shuffle=True)
    resumed = stream_loader(stream, num_workers=workers, **kwargs)
    resumed.load_state_dict(state)
    rest = [b.tolist() for b, _ in resumed]

    assert head == full[:taken]
    assert len(rest) == len(full) - taken
    assert all(len(batch) == batch_size for batch in rest)
    for j, (got, want) in enumerate(zip(rest, full[taken:], strict=True), start=taken):
        real = real_in_batch(n, batch_size, world_size, j, rank)
        assert got[:real] == want[:real]
        # The repeats too: a model whose rows interact (batch norm) sees exactly the same batch.
        assert got == want
    if stream_type is ResumableStream:
        # The stream continued from its own saved position: the pass was not read again.
        assert stream.produced.value == reads_after_resume(n, batch_size, world_size, rank, workers, taken)
    else:
        # Without stream state, every reader replays the pass from the start and skips to its batch.
        assert stream.produced.value == max(1, workers) * n
    # The resume applied to that pass only: the next one starts at its first batch.
    assert [b.tolist() for b, _ in resumed][:2] == full[:2]


@pytest.mark.parametrize("workers", [0, 2])
def test_start_at_gives_the_tail_of_a_full_pass_then_full_passes(workers: int) -> None:
    kwargs: dict[str, Any] = {"batch_size": 3, "world_size": 2, "rank": 0}
    full = [b.tolist() for b, _ in stream_loader(RangeStream(31), num_workers=0, **kwargs)]
    loader = stream_loader(RangeStream(31), num_workers=workers, **kwargs)
    # Elastic resume: the checkpoint came from another world size or worker count.
    loader.shard.start_at(3)
    assert [b.tolist() for b, _ in loader] == full[3:]
    assert [b.tolist() for b, _ in loader] == full


def test_a_stream_shorter_than_its_len_is_an_error() -> None:
    shard = StreamShard(RangeStream(10, length=13), batch_size=4, world_size=1, rank=0)
    with pytest.raises(StreamError, match=r"yielded 10 items but len\(\) says 13: __len__ must be the exact"):
        list(shard)


def test_a_stream_longer_than_its_len_is_an_error() -> None:
    shard = StreamShard(RangeStream(13, length=10), batch_size=4, world_size=2, rank=1)
    with pytest.raises(StreamError, match=r"more than 10 items .* len\(\) says 10"):
        list(shard)


def test_a_length_error_in_a_worker_reaches_the_main_process_as_stream_error() -> None:
    loader = stream_loader(RangeStream(10, length=13), batch_size=4, world_size=1, rank=0, num_workers=2)
    with pytest.raises(StreamError, match="yielded") as excinfo:
        list(loader)
    # The error's traceback holds the DataLoader iterator in reference cycles (through its frames,
    # and through this frame's excinfo); freed later by the cycle collector, the iterator's queues
    # may close before it stops the workers, and each worker join then waits 5 s.
    traceback.clear_frames(excinfo.tb)
    del excinfo


class Unsized(IterableDataset[int]):
    """``RangeStream`` without ``__len__``: where a pass ends is found when it ends."""

    def __init__(self, stream: RangeStream) -> None:
        self.stream = stream

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(self.stream)


@pytest.mark.parametrize("workers", [0, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_stream_without_len_gives_the_batches_it_would_with_its_len(
    monkeypatch: pytest.MonkeyPatch, world_size: int, drop_last: bool, workers: int
) -> None:
    batch_size = 4
    for n in (0, 1, 5, 13, 24, 25, 37):
        for rank in range(world_size):
            kwargs: dict[str, Any] = {"batch_size": batch_size, "world_size": world_size, "rank": rank}
            sized = StreamShard(RangeStream(n), drop_last=drop_last, **kwargs)
            unsized = StreamShard(Unsized(RangeStream(n)), drop_last=drop_last, **kwargs)
            # Same items, same repeats, same number of batches on every process: nothing needed the length.
            assert emulated_worker_batches(monkeypatch, unsized, workers) == emulated_worker_batches(
                monkeypatch, sized, workers
            ), (n, rank)
            infos = [info for _, info in unsized]
            for j, info in enumerate(infos):
                assert info.real == (
                    batch_size if drop_last else real_in_batch(n, batch_size, world_size, j, rank)
                )
                # Every process's real rows of that micro-batch, without asking the others.
                assert info.global_real == min(batch_size * world_size, n - j * batch_size * world_size)
        with pytest.raises(TypeError, match="no __len__"):
            len(StreamShard(Unsized(RangeStream(n)), batch_size=batch_size, world_size=world_size, rank=0))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_without_len_resumes_mid_pass_exactly(workers: int) -> None:
    n, taken = 37, 3
    kwargs: dict[str, Any] = {"batch_size": 4, "world_size": 2, "rank": 1}
    full = [
        b.tolist()
        for b, _ in stream_loader(Unsized(ResumableStream(n, shuffle=True)), num_workers=0, **kwargs)
    ]
    loader = stream_loader(Unsized(ResumableStream(n, shuffle=True)), num_workers=workers, **kwargs)
    iterator = iter(loader)
    head = [next(iterator)[0].tolist() for _ in range(taken)]
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator
    resumed = stream_loader(Unsized(ResumableStream(n, shuffle=True)), num_workers=workers, **kwargs)
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b, _ in resumed] == full
    # Elastic: the tail from a process batch, every reader replaying to it.
    replayed = stream_loader(Unsized(RangeStream(n, shuffle=True)), num_workers=workers, **kwargs)
    replayed.shard.start_at(taken)
    assert [b.tolist() for b, _ in replayed] == full[taken:]


GOOD_STATE = {"version": 1, "epoch": 0, "next_batch": 2, "items_read": 8, "stream": None}


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ([1, 2], "must be the dict"),
        ({k: v for k, v in GOOD_STATE.items() if k != "items_read"}, "must be the dict"),
        ({**GOOD_STATE, "version": 2}, "version 2 is not supported"),
        ({**GOOD_STATE, "next_batch": -1}, "'next_batch' must be an int >= 0"),
        ({**GOOD_STATE, "epoch": "1"}, "'epoch' must be an int >= 0"),
        ({**GOOD_STATE, "items_read": True}, "'items_read' must be an int >= 0"),
        # Batch 2 of rank 0 of 1 starts at item 8: reading 9 means another batch size or world size.
        ({**GOOD_STATE, "items_read": 9}, "saved with another batch size"),
    ],
)
def test_a_bad_state_is_rejected_before_iterating(state: Any, message: str) -> None:
    shard = StreamShard(RangeStream(20), batch_size=4, world_size=1, rank=0)
    shard.load_state_dict(GOOD_STATE)
    with pytest.raises(StreamError, match=message):
        shard.load_state_dict(state)


@pytest.mark.parametrize("workers", [0, 2])
def test_set_epoch_reaches_the_stream_also_in_workers(workers: int) -> None:
    n, batch_size = 12, 4
    loader = stream_loader(
        RangeStream(n, shuffle=True), batch_size=batch_size, world_size=1, rank=0, num_workers=workers
    )
    first = [x for b, _ in loader for x in b.tolist()]
    loader.shard.set_epoch(1)
    second = [x for b, _ in loader for x in b.tolist()]
    # Workers are re-created each epoch from the main copy, so they shuffle for epoch 1 too.
    reference = RangeStream(n, shuffle=True)
    reference.set_epoch(1)
    assert second == reference.order()
    assert first != second
