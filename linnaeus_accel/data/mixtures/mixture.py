"""``Mixture``: several map-style datasets drawn from in fixed proportions, deterministically.

Which source global sample ``i`` of mixture epoch ``e`` comes from, and which of that source's
samples it is, is a pure function of ``(seed, e, i)`` and the weights: every process and DataLoader
worker, and a resumed run, computes it on its own, so any split of an epoch draws the same samples.

- The source of position ``i`` comes from a deterministic interleave (``interleave.Interleave``), not
  from coin flips: over any ``n`` consecutive samples, source ``s`` is drawn ``weight_s x n`` times
  to within less than 2 for up to 4 sources, less than ``ceil(log2 sources)`` in general
  (``Interleave.window_bounds`` has each source's bound). Every epoch deals its positions alike.
- A source's draws are numbered across the whole run (``D = e x draws_per_epoch_s + d``, the ``d``-th
  draw of ``s`` in epoch ``e``), and draw ``D`` reads position ``D mod len_s`` of the source's cycle
  ``D // len_s``. A source that runs out is cycled: its own epoch advances and the mixture's epoch
  goes on. Shuffled, each cycle is a new keyed permutation of the source (``KeyedPermutation``,
  seeded by the run's seed, the cycle and the source's place in the list), so every sample of a
  source is drawn once per cycle and cycles continue across mixture epochs instead of restarting.

The index space of a ``Mixture`` is its sources one after another (source ``s``'s sample ``k`` is
index ``offset_s + k``); the mixing is the sampler's (``Mixture.epoch_sampler``, which
``sampling.epoch_sampler`` uses), so read a mixture through the Trainer's DataLoader, not with a
sampler of your own.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any

import numpy as np
from torch.utils.data import Dataset, IterableDataset

from ...config import Config, ConfigError
from ..options import DatasetOptions
from ..permutation import KeyedPermutation, growing_chunks
from ..registry import Split, get_dataset_builder, register_dataset
from ..sampling import EpochOrderSampler
from .interleave import IntArray, Interleave, parse_weight
from .overlap import dataset_reads, overlap_warnings
from .sources import OPTIONS_KEY, MixtureSource, SourceEntry, parse_sources

# The permutation stream of source s is _SOURCE_STREAM + s: apart from the stream 0 of a plain
# dataset's shuffle, so a source is not shuffled like the same data trained on its own.
_SOURCE_STREAM = 0x6D69_7800


def source_problem(dataset: Any) -> str | None:
    """Why ``dataset`` cannot be a mixture's source, or None when it can."""
    if isinstance(dataset, IterableDataset):
        return (
            "is a stream (an IterableDataset): a mixture draws its samples by index, from map-style datasets"
        )
    if not isinstance(dataset, Sized) or not hasattr(dataset, "__getitem__"):
        return f"is a {type(dataset).__name__}, not a map-style dataset (len() and indexing)"
    if len(dataset) == 0:
        return "is empty"
    if getattr(getattr(dataset, "windows", None), "random", False):
        # A mixture reads a source by index cycle after cycle: its random windows would be the same
        # set every cycle, not fresh draws, while the option promises draws with replacement.
        return "draws random windows (windows: random), which a mixture cannot keep fresh: use aligned"
    return None


def _declared(sources: Sequence[MixtureSource], name: str) -> Any:
    """The value of attribute ``name`` that every source declares; None unless all declare one."""
    declared = [(s.label, v) for s in sources if (v := getattr(s.dataset, name, None)) is not None]
    for label, value in declared[1:]:
        if value != declared[0][1]:
            raise ValueError(
                f"sources {declared[0][0]!r} and {label!r} declare different {name} "
                f"({declared[0][1]!r} and {value!r}): a mixture trains one model on one vocabulary"
            )
    return declared[0][1] if declared and len(declared) == len(sources) else None


_MISSING = object()


class Mixture(Dataset[Any]):
    """The sources' samples, mixed by weight (see the module docstring). ``len()`` is
    ``samples_per_epoch`` (default: the sources' lengths summed); items are the sources' own."""

    def __init__(self, sources: Sequence[MixtureSource], samples_per_epoch: int | None = None) -> None:
        self.sources = tuple(sources)
        if not self.sources:
            raise ValueError("a mixture needs at least one source")
        labels = [s.label for s in self.sources]
        if len(set(labels)) < len(labels):
            raise ValueError(f"mixture sources need distinct labels, got {labels}")
        for source in self.sources:
            problem = source_problem(source.dataset)
            if problem is not None:
                raise ValueError(f"mixture source {source.label!r} {problem}")
            try:
                parse_weight(source.weight)
            except ValueError as exc:
                raise ValueError(f"mixture source {source.label!r}: {exc}") from None
        self.interleave = Interleave([s.weight for s in self.sources])
        self._sizes = [len(s.dataset) for s in self.sources]
        self._offsets = [0, *itertools.accumulate(self._sizes)][:-1]
        self._total = sum(self._sizes)
        if samples_per_epoch is not None and samples_per_epoch < 1:
            raise ValueError(f"samples_per_epoch must be at least 1, got {samples_per_epoch}")
        self.samples_per_epoch = self._total if samples_per_epoch is None else samples_per_epoch
        self._draws = self.interleave.counts(self.samples_per_epoch)
        per_sample = {getattr(s.dataset, "tokens_per_sample", None) for s in self.sources}
        self.tokens_per_sample: int | None = per_sample.pop() if len(per_sample) == 1 else None
        self.vocab_size: int | None = _declared(self.sources, "vocab_size")
        self.eos_id: int | None = _declared(self.sources, "eos_id")
        self.warnings = overlap_warnings(self.sources)  # by label

    def __len__(self) -> int:
        return self.samples_per_epoch

    def __getattr__(self, name: str) -> Any:
        """What every source says alike (a classification dataset's ``levels`` and ``num_classes``,
        which the built-in models read): a model built for the mixture sees one dataset. Called
        only for names the mixture lacks; private names (pickling's) are never forwarded."""
        sources = self.__dict__.get("sources")
        if name.startswith("_") or not sources:
            raise AttributeError(name)
        values = [getattr(s.dataset, name, _MISSING) for s in sources]
        if any(v is _MISSING for v in values) or any(v != values[0] for v in values[1:]):
            raise AttributeError(
                f"{name!r}: the mixture's sources do not all have it with one value, so a model cannot "
                "read it from the mixture"
            )
        return values[0]

    def __getitem__(self, index: int) -> Any:
        """Sample ``index`` of the concatenated sources, as the source returns it."""
        index = int(index)
        if not 0 <= index < self._total:
            raise IndexError(f"index {index} out of range for a mixture of {self._total} source samples")
        source = bisect.bisect_right(self._offsets, index) - 1
        return self.sources[source].dataset[index - self._offsets[source]]

    def epoch_sampler(self, seed: int, shuffle: bool) -> MixtureSampler:
        """The order the Trainer reads an epoch in (``sampling.epoch_sampler`` calls this)."""
        return MixtureSampler(self, seed, shuffle)

    def indices(self, epoch: int, positions: IntArray, seed: int, shuffle: bool) -> IntArray:
        """The concatenated indices (int64) at ``positions`` (in ``[0, len)``) of epoch ``epoch``."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and not (0 <= int(positions.min()) and int(positions.max()) < len(self)):
            raise IndexError(f"positions must be in [0, {len(self)})")
        sources, draws = self.interleave.locate(positions)
        draws = draws.astype(np.int64, copy=False)
        out = np.empty(positions.shape, dtype=np.int64)
        for source, (offset, per_epoch) in enumerate(zip(self._offsets, self._draws, strict=True)):
            chosen = np.flatnonzero(sources == source)
            if chosen.size:
                run_draws = epoch * per_epoch + draws[chosen]
                out[chosen] = offset + self._local(source, run_draws, seed, shuffle)
        return out

    def _local(self, source: int, run_draws: IntArray, seed: int, shuffle: bool) -> IntArray:
        """The source's own indices of its draws numbered from the run's start."""
        size = self._sizes[source]
        cycles, positions = np.divmod(run_draws, size)
        if not shuffle:
            return positions
        local = np.empty_like(positions)
        # A chunk spans one or two cycles of a large source; a source smaller than a chunk, more.
        for cycle in np.unique(cycles).tolist():
            at = cycles == cycle
            order = KeyedPermutation(size, seed, cycle, stream=_SOURCE_STREAM + source)
            local[at] = order.take(positions[at]).astype(np.int64)
        return local

    def draws_per_epoch(self) -> dict[str, int]:
        """Samples drawn from each source in one mixture epoch (by label; they sum to ``len()``)."""
        return {s.label: draws for s, draws in zip(self.sources, self._draws, strict=True)}

    def seen_by_source(self, epochs_done: int, position: int) -> dict[str, int]:
        """Samples drawn from each source over ``epochs_done`` whole epochs and the first
        ``position`` samples of the next one (by label). Closed form: O(sources x tree depth)."""
        if not 0 <= position <= len(self):
            raise ValueError(f"position must be in [0, {len(self)}], got {position}")
        return {
            s.label: epochs_done * draws + self.interleave.count(i, position)
            for i, (s, draws) in enumerate(zip(self.sources, self._draws, strict=True))
        }

    def describe(self) -> list[dict[str, Any]]:
        """Per source, in order: its label, normalised weight, size, samples drawn per mixture
        epoch, target tokens per mixture epoch (None unless the source declares
        ``tokens_per_sample``), and how many passes over the source one mixture epoch makes; and
        ``warnings`` (which ``plan`` and ``train`` show) when it reads what an earlier source reads."""
        rows = []
        for source, share, size, draws in zip(
            self.sources, self.interleave.shares, self._sizes, self._draws, strict=True
        ):
            per_sample = getattr(source.dataset, "tokens_per_sample", None)
            rows.append(
                {
                    "label": source.label,
                    "weight": float(share),
                    "size": size,
                    "draws_per_epoch": draws,
                    "tokens_per_epoch": None if per_sample is None else draws * per_sample,
                    "source_epochs_per_epoch": draws / size,
                }
            )
            if source.label in self.warnings:
                rows[-1]["warnings"] = list(self.warnings[source.label])
        return rows

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{s.label}: {float(w):.3g}" for s, w in zip(self.sources, self.interleave.shares, strict=True)
        )
        return f"Mixture({parts}; {len(self)} samples per epoch)"


class MixtureSampler(EpochOrderSampler):
    """A mixture's epoch order (``Mixture.indices`` of positions 0, 1, ...), listed a chunk at a time."""

    def __init__(self, mixture: Mixture, seed: int, shuffle: bool) -> None:
        super().__init__(len(mixture), seed)
        self.mixture = mixture
        self.shuffle = shuffle

    def _order(self, start: int) -> Iterator[int]:
        return itertools.chain.from_iterable(self._chunks(self.epoch, start))

    def _chunks(self, epoch: int, start: int) -> Iterator[list[int]]:
        for begin, end in growing_chunks(start, self.size):
            positions = np.arange(begin, end, dtype=np.int64)
            yield self.mixture.indices(epoch, positions, self.seed, self.shuffle).tolist()


# -- the built-in dataset ``mixture`` (its sources' entries: ``mixture_sources``) ------------------
def _rekeyed(text: str, index: int) -> str:
    """A source builder's key or message, its dataset keys moved under the source's entry."""
    prefix = f"{OPTIONS_KEY}.sources.{index}"
    text = re.sub(r"\bDATA\.DATASET\.OPTIONS\b", f"{prefix}.options", text)
    return re.sub(r"\bDATA\.DATASET\.NAME\b", f"{prefix}.name", text)


def _build_source(
    build: Callable[[], Any], split: Split, entry: SourceEntry, problems: list[tuple[str, str]]
) -> Any:
    """The source's dataset for ``split`` (``build()``), or None after recording why it cannot be one:
    the builder's config errors under the source's own keys, or a dataset a mixture cannot draw from."""
    try:
        dataset = build()
    except ConfigError as exc:
        problems += [
            (_rekeyed(key, entry.index), _rekeyed(message, entry.index)) for key, message in exc.problems
        ]
        return None
    problem = source_problem(dataset)
    if problem is not None:
        where = f"{OPTIONS_KEY}.sources.{entry.index}.name"
        problems.append((where, f"mixture: the {split} split of {entry.label!r} ({entry.name}) {problem}"))
        return None
    return dataset


def _check_lengths(entries: list[SourceEntry], datasets: list[Any], options: DatasetOptions) -> None:
    """Record a source whose windows are not as long as the first's: the batches stack the samples
    of all sources, so one length must hold for all. Only sources that declare a ``seq_len`` (token
    files, packed datasets) are compared; a source without one sets no length."""
    declared = [(e, n) for e, d in zip(entries, datasets, strict=True) if (n := getattr(d, "seq_len", None))]
    for entry, length in declared[1:]:
        first, first_length = declared[0]
        if length != first_length:
            options.problem(
                f"sources.{entry.index}.options.seq_len",
                f"sources {first.label!r} (seq_len {first_length}) and {entry.label!r} (seq_len {length}) cut "
                "windows of different lengths, which cannot be stacked into one batch: give every source "
                f"the same seq_len (e.g. {first_length})",
            )
            return


@register_dataset("mixture")
def build_mixture(config: Config, split: Split) -> Mixture:
    """Several datasets trained on together, each in a fixed share of the samples::

        DATA:
          DATASET:
            NAME: mixture
            OPTIONS:
              samples_per_epoch: 1000000      # optional; default: the sources' sizes summed
              sources:
                - {name: token_files, label: web, weight: 0.7, options: {paths: web/*.bin, seq_len: 1024}}
                - {name: token_files, label: code, weight: 0.3, options: {paths: code/*.bin, seq_len: 1024}}

    Each source is ``name`` (any registered map-style dataset), its ``options`` (that dataset's
    ``OPTIONS``, default none), a ``weight`` > 0 (shares are the weights over their sum, read as
    written: 0.7 and 0.3 are exactly 7:3) and a ``label`` (default: ``name``; where sources share a
    name, the stem of the first path, ``train_a`` for ``data/train_a.bin``: ``mixture_sources``;
    labels given alike are an error).

    Every ``samples_per_epoch`` samples, source ``s`` is drawn ``weight_s / sum of weights`` of the
    time, evenly spread: in any run of ``n`` consecutive samples, less than 2 from its share of
    ``n`` for up to 4 sources (less than ``ceil(log2 sources)`` in general). A source with fewer samples than its
    draws per epoch is repeated in whole passes, each pass in a new shuffled order; one with more is
    continued where it stopped in the next epoch, so over the run every sample of a source is drawn
    before any is drawn again. Which samples are drawn depends on ``EXPERIMENT.SEED`` and the
    epoch only: not on the number of processes or DataLoader workers, nor on a resume.

    Validation mixes the sources' validation splits with the same weights, its epoch as long as
    those splits together (``samples_per_epoch`` is for training). Sources that cut windows
    (``seq_len``) must all cut them alike: one batch stacks samples of every source.
    ``vocab_size`` and ``eos_id`` are the sources' when they all declare the same (different ones
    are an error), and ``tokens_per_sample`` when they all have the same. A stream (iterable
    dataset) cannot be a source: a mixture draws samples by index. ``plan`` shows each source's
    draws and passes per epoch, and ``plan`` and ``train`` warn of two sources that read the same
    file (or the same dataset and options) and of a source whose weight leaves it less than one
    expected sample in the whole run.
    """
    options = DatasetOptions("mixture", config.DATA.DATASET.OPTIONS, OPTIONS_KEY)
    samples_per_epoch = options.integer("samples_per_epoch", None, minimum=1)
    entries = parse_sources(options)

    def builder(entry: SourceEntry) -> Callable[[], Any]:
        # Any registered builder may build a source, and a builder is handed a whole Config, free to
        # read any section: this one, with the source's dataset in place of the mixture.
        dataset = config.DATA.DATASET.model_copy(update={"NAME": entry.name, "OPTIONS": entry.options})
        own = config.model_copy(update={"DATA": config.DATA.model_copy(update={"DATASET": dataset})})
        return lambda: get_dataset_builder(entry.name)(own, split)

    datasets = [_build_source(builder(entry), split, entry, options.problems) for entry in entries]
    _check_lengths(entries, datasets, options)
    options.finish()
    sources = [
        MixtureSource(e.label, d, e.weight, dataset_reads(e.name, e.options))
        for e, d in zip(entries, datasets, strict=True)
    ]
    try:
        return Mixture(sources, samples_per_epoch if split == "train" else None)
    except ValueError as exc:  # the sources disagree on their vocabulary
        raise ConfigError([(f"{OPTIONS_KEY}.sources", f"mixture: {exc}")]) from None
