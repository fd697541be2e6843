"""Packing a token stream into fixed-length training sequences.

The Hugging Face convention: ``labels`` equal ``input_ids`` and the loss shifts them, position ``t``
predicting ``labels[t + 1]``. So a window of ``L`` tokens trains on ``L - 1`` targets, and windows
that overlap by one token (window ``k`` starts at ``k * (L - 1)``) make every token after the first
a target exactly once: no token is lost at a window boundary and none is counted twice.

``PackedTokens`` cuts an in-memory 1-D tensor (map-style); with ``windows=WindowDraws("random",
seed)`` its windows start at random offsets instead, drawn with replacement (``token_windows``).
``PackedTokenStream`` cuts the aligned windows lazily from documents joined by an end-of-document
token, in order or shuffled per epoch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from ..keyed_random import python_keyed_bits
from ..sampling import EpochOrderSampler
from .windows import ALIGNED, RandomOffsets, WindowDraws, window_sampler

BYTE_VOCAB_SIZE = 257  # the 256 byte values and BYTE_EOS
BYTE_EOS = 256


def encode_bytes(text: str) -> list[int]:
    """Byte-level tokens: the UTF-8 bytes of ``text`` (no end-of-document token)."""
    return list(text.encode("utf-8"))


def decode_bytes(ids: Iterable[int] | torch.Tensor) -> str:
    """Text from byte-level tokens; ``BYTE_EOS`` (and anything not a byte) is dropped.

    Invalid UTF-8 becomes U+FFFD rather than an error, since a model's samples need not be valid.
    """
    values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    return bytes(int(i) for i in values if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def _check_lengths(n_tokens: int, seq_len: int) -> None:
    if seq_len < 2:
        raise ValueError(
            f"seq_len must be at least 2 (one input and one target token per sample), got {seq_len}"
        )
    if n_tokens < seq_len:
        raise ValueError(
            f"{n_tokens} tokens are fewer than seq_len {seq_len}: not one full sample; "
            "use a shorter seq_len or more data"
        )


def _sample(window: torch.Tensor) -> dict[str, torch.Tensor]:
    # Copies: a view would keep the whole token tensor alive in every batch a DataLoader worker
    # sends, and an in-place edit of input_ids (masking) must not change labels or the data.
    return {"input_ids": window.clone(), "labels": window.clone()}


def window_sample(
    tokens: torch.Tensor | np.ndarray[Any, Any], start: int, seq_len: int
) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``labels`` of the ``seq_len`` tokens from ``start``, as int64: only this
    window is converted, so the tokens stay in their own (small, possibly memory-mapped) dtype."""
    window = tokens[start : start + seq_len]
    if isinstance(window, np.ndarray):
        ids = torch.from_numpy(window.astype(np.int64))  # a copy: nothing refers to the mapping
    else:
        ids = window.to(torch.int64, copy=True)
    return {"input_ids": ids, "labels": ids.clone()}


class PackedTokens(Dataset[dict[str, torch.Tensor]]):
    """Item ``k``: the ``seq_len`` tokens from ``k * (seq_len - 1)``, as ``input_ids`` and ``labels``.

    ``tokens``: a 1-D integer tensor or NumPy array (a ``np.memmap`` too), kept as it is given:
    each window is converted to int64 when it is read, so a ``uint16`` corpus costs 2 bytes a token,
    not 8. For corpora on disk see ``TokenFiles``.

    ``windows`` random: item ``g`` (any int >= 0, the run's draw number ``epoch_sampler`` yields)
    is the ``seq_len`` tokens from a random offset in ``[0, len(tokens) - seq_len]``, keyed by
    ``(windows.seed, g)``; ``len()`` is unchanged (an epoch draws as many windows as it cuts).
    """

    windows: WindowDraws = ALIGNED  # (class defaults: a subclass that sets its own fields is aligned)
    _random: RandomOffsets | None = None

    def __init__(
        self, tokens: torch.Tensor | np.ndarray[Any, Any], seq_len: int, *, windows: WindowDraws = ALIGNED
    ) -> None:
        integer = (
            tokens.dtype.kind in "iu"
            if isinstance(tokens, np.ndarray)
            else not (tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool)
        )
        if tokens.ndim != 1 or not integer:
            raise ValueError(
                f"tokens must be a 1-D integer tensor or array, got {tokens.dtype} of shape {tuple(tokens.shape)}"
            )
        _check_lengths(len(tokens), seq_len)
        self.tokens = tokens
        self.seq_len = seq_len
        self.tokens_per_sample = seq_len - 1  # targets per sample: what a tokens/s meter counts
        self.windows = windows
        starts = [(0, len(tokens) - seq_len + 1)]
        self._random = RandomOffsets(starts, windows) if windows.random else None

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.tokens_per_sample

    def epoch_sampler(self, seed: int, shuffle: bool) -> EpochOrderSampler:
        """The Trainer's order (``sampling.epoch_sampler``): random windows' draw numbers, else shuffled."""
        return window_sampler(self, self.windows, seed, shuffle)

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        if self._random is not None:
            return window_sample(self.tokens, self._random.locate(int(k))[1], self.seq_len)
        n = len(self)
        if not -n <= k < n:
            raise IndexError(f"sample {k} out of range for {n} samples")
        return window_sample(self.tokens, (k % n) * self.tokens_per_sample, self.seq_len)


def _as_tokens(document: Sequence[int] | torch.Tensor) -> torch.Tensor:
    if isinstance(document, bytes | bytearray | memoryview):
        return torch.from_numpy(np.frombuffer(document, dtype=np.uint8).astype(np.int64))
    if isinstance(document, torch.Tensor):
        return document.reshape(-1).to(torch.int64)
    return torch.as_tensor(document, dtype=torch.int64).reshape(-1)


class PackedTokenStream(IterableDataset[dict[str, torch.Tensor]]):
    """The documents joined, each followed by ``eos_id``, cut into ``PackedTokens``' windows, lazily.

    For the same document order it yields exactly the samples ``PackedTokens`` would cut from the
    concatenation, holding at most one document plus ``seq_len`` tokens at a time. With ``seed``,
    the documents are shuffled by ``(seed, epoch)`` (``set_epoch``), so any process or a resumed
    run reproduces an epoch's order without replaying earlier ones.

    It does not split itself across DataLoader workers or processes: every iterator reads the whole
    stream (``StreamShard`` shards it), so ``len`` is the whole epoch's sample count.

    A document is any sequence of ints: a list, ``bytes`` (byte-level text, read without a copy
    into Python ints) or a 1-D integer tensor.
    """

    def __init__(
        self,
        documents: Sequence[Sequence[int] | torch.Tensor],
        seq_len: int,
        eos_id: int,
        seed: int | None = None,
    ) -> None:
        self.documents = documents
        self.seq_len = seq_len
        self.eos_id = eos_id
        self.seed = seed
        self.epoch = 0
        # The total, and so the sample count, does not depend on the order: len is exact every epoch.
        self.total_tokens = sum(len(doc) + 1 for doc in documents)
        _check_lengths(self.total_tokens, seq_len)
        self.tokens_per_sample = seq_len - 1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return (self.total_tokens - 1) // self.tokens_per_sample

    def document_order(self) -> list[int]:
        """This epoch's order of document indices."""
        if self.seed is None:
            return list(range(len(self.documents)))
        # Keyed like EpochSeededSampler: a pure function of (seed, epoch).
        seed = python_keyed_bits(self.seed, self.epoch, 0, stream=0) & 0x7FFF_FFFF_FFFF_FFFF
        generator = torch.Generator().manual_seed(seed)
        return torch.randperm(len(self.documents), generator=generator).tolist()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        step = self.tokens_per_sample
        eos = torch.tensor([self.eos_id], dtype=torch.int64)
        buffer = torch.empty(0, dtype=torch.int64)
        for i in self.document_order():
            buffer = torch.cat([buffer, _as_tokens(self.documents[i]), eos])
            start = 0
            while len(buffer) - start >= self.seq_len:
                yield _sample(buffer[start : start + self.seq_len])
                start += step
            buffer = buffer[start:]  # the overlap token and the unfinished tail (< seq_len tokens)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({len(self.documents)} documents, {self.total_tokens} tokens, "
            f"seq_len={self.seq_len}, seed={self.seed}, epoch={self.epoch})"
        )
