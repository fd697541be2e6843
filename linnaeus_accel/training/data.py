"""Data order: a sampler seeded by ``(seed, epoch)``, identical on every process.

Accelerate shards each global batch order across processes, so the order must not depend on the
rank; and resuming at any epoch must reproduce it without replaying earlier epochs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
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


def make_dataloader(config: Config, dataset: Dataset[Any], train: bool) -> DataLoader[Any]:
    data = config.DATA
    return DataLoader(
        dataset,
        batch_size=data.BATCH_SIZE if train else (data.BATCH_SIZE_VAL or data.BATCH_SIZE),
        sampler=EpochSeededSampler(dataset, config.EXPERIMENT.SEED, shuffle=train),  # type: ignore[arg-type]
        drop_last=data.DROP_LAST if train else False,
        num_workers=data.NUM_WORKERS,
        persistent_workers=data.NUM_WORKERS > 0,
    )


def samples_in_global_batch(
    dataset_size: int, batch_size: int, world_size: int, batch_index: int, drop_last: bool
) -> int:
    """Real samples in the ``batch_index``-th micro-batch summed over processes.

    Accelerate pads the last one (``even_batches``) by repeating samples; those are not counted,
    and no communication is needed to know it.
    """
    per_step = batch_size * world_size
    if drop_last:
        return per_step
    return max(0, min(per_step, dataset_size - batch_index * per_step))
