"""Data order and which samples of a batch are real.

A sampler seeded by ``(seed, epoch)`` gives the same order on every process: Accelerate shards
each global batch order across processes, so the order must not depend on the rank, and resuming
at any epoch must reproduce it without replaying earlier epochs.

Process ``p`` of ``W`` receives global batches ``p, p + W, p + 2W, ...`` (``BatchSamplerShard``;
our ``StreamShard`` does the same for streams), so in the epoch's global sample order its ``j``-th
batch starts at ``(j * W + p) * B``. Accelerate's even batches fill the last global batch by
repeating samples from the start of the epoch; those repeats sit after every real sample, so how
many samples of a batch are real is a pure function of host ints: no communication, no device read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..config import Config
from .keyed_random import python_keyed_bits


class EpochSeededSampler(Sampler[int]):
    def __init__(self, data: Sized, seed: int, shuffle: bool = True) -> None:
        self.size = len(data)
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.size))
        seed = python_keyed_bits(self.seed, self.epoch, 0, stream=0) & 0x7FFF_FFFF_FFFF_FFFF
        generator = torch.Generator().manual_seed(seed)
        return iter(torch.randperm(self.size, generator=generator).tolist())


def make_dataloader(
    config: Config, dataset: Dataset[Any], train: bool, collate_fn: Callable[[list[Any]], Any] | None = None
) -> DataLoader[Any]:
    data = config.DATA
    return DataLoader(
        dataset,
        collate_fn=collate_fn,
        batch_size=data.BATCH_SIZE if train else (data.BATCH_SIZE_VAL or data.BATCH_SIZE),
        sampler=EpochSeededSampler(dataset, config.EXPERIMENT.SEED, shuffle=train),  # type: ignore[arg-type]
        drop_last=data.DROP_LAST if train else False,
        num_workers=data.NUM_WORKERS,
        persistent_workers=data.NUM_WORKERS > 0,
        # Its own generator: creating an iterator then draws the workers' base seed from it, not
        # from the global RNG, whose restored state a resumed run's dropout must continue from.
        generator=torch.Generator(),
    )


def samples_in_global_batch(
    dataset_size: int, batch_size: int, world_size: int, batch_index: int, drop_last: bool
) -> int:
    """Real samples in the ``batch_index``-th micro-batch summed over processes."""
    per_step = batch_size * world_size
    if drop_last:
        return per_step
    return max(0, min(per_step, dataset_size - batch_index * per_step))


def real_in_batch(dataset_size: int, batch_size: int, world_size: int, batch_index: int, rank: int) -> int:
    """How many leading samples of process ``rank``'s ``batch_index``-th batch are real (the rest
    are even-batch repeats). With DROP_LAST every batch is full, and this gives ``batch_size``."""
    start = (batch_index * world_size + rank) * batch_size
    return max(0, min(batch_size, dataset_size - start))
