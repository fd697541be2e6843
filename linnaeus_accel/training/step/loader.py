"""``Loader``: what ``setup.as_loader`` makes of the data a Trainer is given, before Accelerate
prepares it (``setup.prepare_run``; validation's budget: ``validation_data``)."""

from __future__ import annotations

from typing import Any, NamedTuple


class Loader(NamedTuple):
    loader: Any  # a DataLoader for Accelerate to prepare, or a ready stream loader
    dataset: Any  # the user's dataset
    collate: Any  # how its samples become a batch
    size: int | None  # samples per pass, all processes together (None: a stream without __len__)
    batch_size: int  # per process
    batches_per_epoch: int | None  # per process, for a stream (None: unknown); map-style: set after prepare
    stream: bool
    sampler: Any = None  # our EpochSeededSampler, when the loader is ours (it resumes in O(1))
