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

import itertools
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..config import Config
from .keyed_random import python_keyed_bits
from .permutation import KeyedPermutation

RANDPERM_MAX = 2**16  # up to here an epoch's order is torch.randperm's; above, a KeyedPermutation


class EpochOrderSampler(Sampler[int]):
    """Base of the samplers the Trainer makes: an epoch's order of sample indices, a pure function
    of ``(seed, epoch)`` (``set_epoch``), read from any position (``_order(start)``).

    ``resume_at`` makes a resumed epoch O(1) in its position: Accelerate's ``skip_first_batches``
    would read and drop every index before it.
    """

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.seed = seed
        self.epoch = 0
        self._resume: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume_at(self, position: int, first_round: int) -> None:
        """The next iteration yields the epoch's first ``first_round`` indices, then the indices from
        ``position`` on. ``first_round`` is one global batch round (batch size x processes): what
        Accelerate's ``BatchSamplerShard`` keeps to fill the epoch's last batches, which must be
        the epoch's own first samples, as in the uninterrupted run; each process then drops the one
        batch it got from that round, and is at ``position``."""
        self._resume = (position, min(first_round, position))

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        resume, self._resume = self._resume, None
        if resume is None:
            return self._order(0)
        position, first = resume
        return itertools.chain(itertools.islice(self._order(0), first), self._order(position))

    def _order(self, start: int) -> Iterator[int]:
        """The epoch's indices from position ``start`` on."""
        raise NotImplementedError


class EpochSeededSampler(EpochOrderSampler):
    """A shuffled (or, with ``shuffle=False``, sequential) order of every sample.

    Up to ``RANDPERM_MAX`` samples the order is ``torch.randperm``'s (as it always was: runs and
    checkpoints of small datasets keep their order). Above, it is a ``KeyedPermutation``, computed
    in chunks as it is read: memory stays flat however many samples the dataset has (a token corpus
    has hundreds of millions of windows; a listed ``randperm`` of them would take GBs per process).
    """

    def __init__(self, data: Sized, seed: int, shuffle: bool = True) -> None:
        super().__init__(len(data), seed)
        self.shuffle = shuffle

    def _order(self, start: int) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(start, self.size))
        if self.size <= RANDPERM_MAX:
            seed = python_keyed_bits(self.seed, self.epoch, 0, stream=0) & 0x7FFF_FFFF_FFFF_FFFF
            generator = torch.Generator().manual_seed(seed)
            return iter(torch.randperm(self.size, generator=generator)[start:].tolist())
        permutation = KeyedPermutation(self.size, self.seed, self.epoch)
        return itertools.chain.from_iterable(permutation.chunks(start))


def epoch_sampler(dataset: Sized, seed: int, shuffle: bool) -> EpochOrderSampler:
    """The sampler of a map-style dataset: the dataset's own when it defines
    ``epoch_sampler(seed, shuffle)`` (a mixture orders its samples itself), else ``EpochSeededSampler``."""
    own = getattr(dataset, "epoch_sampler", None)
    if callable(own):
        sampler: EpochOrderSampler = own(seed, shuffle)
        return sampler
    return EpochSeededSampler(dataset, seed, shuffle=shuffle)


def make_dataloader(
    config: Config,
    dataset: Dataset[Any],
    train: bool,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    pin_memory: bool = False,
) -> DataLoader[Any]:
    data = config.DATA
    return DataLoader(
        dataset,
        collate_fn=collate_fn,
        batch_size=data.BATCH_SIZE if train else (data.BATCH_SIZE_VAL or data.BATCH_SIZE),
        sampler=epoch_sampler(dataset, config.EXPERIMENT.SEED, shuffle=train and data.SHUFFLE),  # type: ignore[arg-type]
        drop_last=data.DROP_LAST if train else False,
        num_workers=data.NUM_WORKERS,
        persistent_workers=data.NUM_WORKERS > 0,
        pin_memory=pin_memory,
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
