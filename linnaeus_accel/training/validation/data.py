"""The validation data a pass reads: the whole split, or with ``SCHEDULE.VALIDATION.MAX_BATCHES``
a fixed budget of batches per process.

- Map-style data read through the Trainer's own loader: a fixed subset of ``MAX_BATCHES x batch x
  processes`` samples (``sampling.SubsetSampler``: the first of a permutation keyed by
  ``EXPERIMENT.SEED`` alone, read in ascending order), the same at every validation and in every
  run with that seed and layout; with more processes the subset grows to include the smaller one.
  Each process reads exactly ``MAX_BATCHES`` batches. A split no larger than that is read whole.
- A stream (``IterableDataset``), or a DataLoader given for validation (read as given: its sampler
  is its own): the first ``MAX_BATCHES`` batches of each process, the same at every pass (a stream
  has no random access; validation reads it in its listed order).

The validation at the run's last boundary reads the whole split when
``SCHEDULE.VALIDATION.FINAL_EPOCH.WHOLE_SPLIT`` (the default): ``BoundaryWork`` says which point the
passes belong to (``select``). Outside the run's own validations (``evaluate``, which measures a
checkpoint with the final boundary's passes) the final validation's data is read.

A pass always starts from its first batch, so a run killed during one reruns it on the same data:
the validation journal (``checkpoint.state.journal``) works as for the whole split.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from accelerate import Accelerator

from ...config.schedule import ValidationSchedule
from ...data.sampling import EpochOrderSampler, subset_dataloader
from ..step.batches import BatchSource
from ..step.loader import Loader
from ..step.micro_batch import MicroBatch


class ValidationBatches(BatchSource):
    """A validation BatchSource that reads its budget (``limit`` batches per process, or the
    subset it was built over) except, when ``whole`` is set, at the final validation."""

    def __init__(
        self,
        accelerator: Accelerator,
        loader: Any,
        size: int | None,
        batch_size: int,
        *,
        stream: bool,
        seed: int,
        limit: int | None,
        whole: BatchSource | None,
        final_whole: bool,
    ) -> None:
        """``limit``: batches per process a budgeted pass reads (a stream, a given DataLoader; None:
        ``loader`` already reads the subset); ``whole``: the whole split, when ``loader`` reads a
        subset; ``final_whole``: the final validation reads the whole split."""
        super().__init__(accelerator, loader, size, batch_size, stream=stream, seed=seed)
        self.limit, self.whole, self.final_whole = limit, whole, final_whole
        self.final = True  # whose passes run now (``select``): the final validation's by default

    def select(self, final: bool) -> None:
        """The passes about to run are the final validation's (``final``) or another's."""
        self.final = final

    @property
    def reads_whole(self) -> bool:
        return self.final and self.final_whole

    def set_epoch(self, epoch: int) -> None:
        if self.reads_whole and self.whole is not None:
            self.whole.set_epoch(epoch)
        else:
            super().set_epoch(epoch)

    def micro_batches(self, start: int = 0) -> Iterator[MicroBatch]:
        if self.reads_whole and self.whole is not None:
            return self.whole.micro_batches(start)
        batches = super().micro_batches(start)
        if self.reads_whole:
            return batches
        # Every process stops after the same count: a stream's agreement collectives stay in step.
        return batches if self.limit is None else itertools.islice(batches, self.limit)


def validation_batches(acc: Accelerator, settings: ValidationSchedule, seed: int, val: Loader) -> BatchSource:
    """The validation data's BatchSource, within ``SCHEDULE.VALIDATION.MAX_BATCHES`` (``settings``:
    SCHEDULE.VALIDATION; ``seed``: EXPERIMENT.SEED; see the module docstring); a plain BatchSource
    over the whole split when there is no budget."""
    budget = settings.MAX_BATCHES
    final_whole = settings.FINAL_EPOCH.WHOLE_SPLIT
    loader = val.loader if val.stream else acc.prepare(val.loader)
    whole = BatchSource(acc, loader, val.size, val.batch_size, stream=val.stream, seed=seed)
    if budget is None:
        return whole
    count = budget * val.batch_size * acc.num_processes
    if isinstance(val.sampler, EpochOrderSampler) and not val.stream:
        assert val.size is not None
        if count >= val.size:
            return whole  # the budget holds the whole split
        subset = acc.prepare(subset_dataloader(val.loader, count, seed))
        return ValidationBatches(
            acc, subset, count, val.batch_size, stream=False, seed=seed,
            limit=None, whole=whole, final_whole=final_whole,
        )  # fmt: skip
    return ValidationBatches(
        acc, loader, val.size, val.batch_size, stream=val.stream, seed=seed,
        limit=budget, whole=None, final_whole=final_whole,
    )  # fmt: skip
