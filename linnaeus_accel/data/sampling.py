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
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..config.sections import DataConfig
from .keyed_random import python_keyed_bits
from .permutation import KeyedPermutation

RANDPERM_MAX = 2**16  # up to here an epoch's order is torch.randperm's; above, a KeyedPermutation
# The keyed-permutation stream of the validation subset (SCHEDULE.VALIDATION.MAX_BATCHES): apart
# from stream 0 of the training shuffle, so validating on the training data draws other samples.
_VALIDATION_SUBSET_STREAM = 0x7661_6C73  # "vals"


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

    def indices_at(self, positions: Sequence[int]) -> list[int]:
        """The indices at ``positions`` (ascending) of the current epoch's order. Here by reading
        the order up to the last of them, once; a sampler with random access does better."""
        wanted, out = iter(positions), []
        target = next(wanted, None)
        for position, index in enumerate(self._order(0)):
            if target is None:
                break
            if position == target:
                out.append(index)
                target = next(wanted, None)
        return out


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

    def indices_at(self, positions: Sequence[int]) -> list[int]:
        if not self.shuffle:  # validation's order: position p is sample p
            return list(positions)
        return super().indices_at(positions)


class SubsetSampler(EpochOrderSampler):
    """A validation pass's fixed subset (SCHEDULE.VALIDATION.MAX_BATCHES): ``count`` positions of
    ``base``'s epoch-0 order, the first ``count`` of a permutation keyed by ``seed`` alone, read in
    ascending position order. The same at every pass (``set_epoch`` changes nothing) and in every
    run with the seed; the subset of ``n`` samples is part of that of any ``m > n``, so runs on
    other numbers of processes validate on nested subsets."""

    def __init__(self, base: EpochOrderSampler, count: int, seed: int) -> None:
        count = min(count, base.size)
        super().__init__(count, seed)
        base.set_epoch(0)
        permutation = KeyedPermutation(base.size, seed, 0, stream=_VALIDATION_SUBSET_STREAM)
        positions = np.sort(permutation.take(np.arange(count, dtype=np.uint64))).tolist()
        self.positions: list[int] = positions
        self.indices = base.indices_at(positions)

    def _order(self, start: int) -> Iterator[int]:
        return iter(self.indices[start:])


def subset_dataloader(loader: DataLoader[Any], count: int, seed: int) -> DataLoader[Any]:
    """``loader`` (one ``make_dataloader`` made) reading only a ``SubsetSampler`` of ``count``
    samples of its order, with its batch size, collation, workers (and their init) and memory pinning."""
    base = loader.sampler
    assert isinstance(base, EpochOrderSampler), "a subset of the Trainer's own loaders only"
    return DataLoader(
        loader.dataset,
        collate_fn=loader.collate_fn,
        batch_size=loader.batch_size,
        sampler=SubsetSampler(base, count, seed),
        drop_last=False,
        num_workers=loader.num_workers,
        worker_init_fn=loader.worker_init_fn,
        persistent_workers=loader.persistent_workers,
        pin_memory=loader.pin_memory,
        generator=torch.Generator(),
    )


def epoch_sampler(dataset: Sized, seed: int, shuffle: bool) -> EpochOrderSampler:
    """The sampler of a map-style dataset: the dataset's own when it defines
    ``epoch_sampler(seed, shuffle)`` (a mixture orders its samples itself), else ``EpochSeededSampler``."""
    own = getattr(dataset, "epoch_sampler", None)
    if callable(own):
        sampler: EpochOrderSampler = own(seed, shuffle)
        return sampler
    return EpochSeededSampler(dataset, seed, shuffle=shuffle)


def make_dataloader(
    data: DataConfig,
    seed: int,
    dataset: Dataset[Any],
    train: bool,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    pin_memory: bool = False,
) -> DataLoader[Any]:
    """``seed``: EXPERIMENT.SEED, which keys the training shuffle."""
    return DataLoader(
        dataset,
        collate_fn=collate_fn,
        batch_size=data.BATCH_SIZE if train else (data.BATCH_SIZE_VAL or data.BATCH_SIZE),
        sampler=epoch_sampler(dataset, seed, shuffle=train and data.SHUFFLE),  # type: ignore[arg-type]
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
