"""``HFPackedDocuments``: ``hf_dataset``'s map-style windows, read from the tokenized documents'
Arrow table without joining them. A module of its own so that ``hf`` (options, files, tokenizing)
stays readable; ``hf`` re-exports the class, so ``linnaeus_accel.data.hf.dataset.HFPackedDocuments`` still
names it.

Windows are ``PackedTokens``' windows of every document joined, each followed by the
end-of-document id: ``aligned`` (window ``k`` from token ``k * (seq_len - 1)``) or ``random`` (draw
``g`` from a uniform offset keyed by ``(seed, g)``, ``token_windows``). Either may span documents.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch.utils.data import Dataset

from ..sampling import EpochOrderSampler
from ..tokens.packing import window_sample
from ..tokens.windows import ALIGNED, RandomOffsets, WindowDraws, window_sampler

INPUT_IDS = "input_ids"  # the tokenized documents' column


class HFPackedDocuments(Dataset[dict[str, torch.Tensor]]):
    """Map-style windows of tokenized documents: rows ``rows`` of ``documents`` (a ``datasets.Dataset``
    as ``hf.TokenizeRows`` makes it, in table order), joined, cut as ``PackedTokens`` cuts them.

    The join is never made: the cumulative token counts (8 bytes a document) locate a window's
    documents by binary search, and only those are read from the memory-mapped Arrow table. It
    pickles as ``datasets`` pickles a dataset on disk (its files' paths), for DataLoader workers.

    ``windows`` random: item ``g`` (any int >= 0, the run's draw number ``epoch_sampler`` yields)
    is the ``seq_len`` tokens from a random offset in ``[0, total_tokens - seq_len]``, keyed by
    ``(windows.seed, windows.stream, g)``; ``len()`` is unchanged (an epoch draws as many windows
    as aligned windows cut).
    """

    tokenizer_file: str | None = None  # the tokenizer.json of the tokens (None: bytes)

    def __init__(
        self,
        documents: Any,
        seq_len: int,
        *,
        vocab_size: int,
        eos_id: int,
        rows: range | None = None,
        windows: WindowDraws = ALIGNED,
    ) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2 (one input and one target token), got {seq_len}")
        self.documents = documents
        self.rows = range(len(documents)) if rows is None else rows
        self.seq_len, self.tokens_per_sample = seq_len, seq_len - 1
        self.vocab_size, self.eos_id = vocab_size, eos_id
        chunks = self._column(0, len(self.rows)).chunks
        lengths = np.concatenate(
            [np.zeros(0, dtype=np.int64), *(c.value_lengths().to_numpy() for c in chunks)]
        )
        self._ends: NDArray[np.int64] = np.cumsum(lengths, dtype=np.int64)
        self.windows = windows
        starts = [(0, max(0, self.total_tokens - seq_len + 1))]
        self._random = RandomOffsets(starts, windows) if windows.random else None

    @property
    def num_documents(self) -> int:
        return len(self.rows)

    @property
    def total_tokens(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __len__(self) -> int:
        return max(0, (self.total_tokens - 1) // self.tokens_per_sample)

    def epoch_sampler(self, seed: int, shuffle: bool) -> EpochOrderSampler:
        """The Trainer's order (``sampling.epoch_sampler``): random windows' draw numbers, else shuffled."""
        return window_sampler(self, self.windows, seed, shuffle)

    def _column(self, first: int, count: int) -> Any:
        """Documents ``first .. first + count - 1`` of this dataset's rows, as an Arrow list column."""
        return self.documents.data.column(INPUT_IDS).slice(self.rows.start + first, count)

    def window(self, start: int) -> dict[str, torch.Tensor]:
        """The ``seq_len`` tokens of the joined documents from token ``start``."""
        if not 0 <= start <= self.total_tokens - self.seq_len:
            raise IndexError(f"no window of {self.seq_len} tokens from {start} of {self.total_tokens}")
        first = int(np.searchsorted(self._ends, start, side="right"))
        last = int(np.searchsorted(self._ends, start + self.seq_len - 1, side="right"))
        tokens = np.concatenate(
            [chunk.flatten().to_numpy() for chunk in self._column(first, last - first + 1).chunks]
        )
        offset = start - (int(self._ends[first - 1]) if first else 0)
        return window_sample(tokens, offset, self.seq_len)

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        if self._random is not None:
            return self.window(self._random.locate(int(k))[1])
        n = len(self)
        if not 0 <= k < n:
            raise IndexError(f"sample {k} out of range for {n} samples")
        return self.window(int(k) * self.tokens_per_sample)

    def __repr__(self) -> str:
        return (
            f"HFPackedDocuments({self.num_documents} documents, {self.total_tokens} tokens, "
            f"{len(self)} {self.windows.mode} windows of {self.seq_len})"
        )
