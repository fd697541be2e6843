"""``HFPackedStream``: a Hugging Face ``datasets.IterableDataset`` of text documents, tokenized as it
is read and packed into ``PackedTokens``' windows, shard by shard, resumable inside a shard.

It is a sharded stream (``sharded.py``): ``shards()`` lists the dataset's shards (one per data
file), ``open_shard(i)`` gives shard ``i``'s windows as a ``ShardWindows``, whose ``state_dict``
lets the trainer resume the shard where it stopped. Use it for your own streaming datasets too::

    documents = datasets.load_dataset("json", data_files="corpus/*.jsonl", split="train", streaming=True)
    stream = HFPackedStream(documents, seq_len=1024, eos_id=BYTE_EOS, encode=encode_bytes)
    Trainer(config, model, stream).train()
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch.utils.data import IterableDataset

from ..tokens.packing import window_sample

Encode = Callable[[str], Sequence[int] | NDArray[Any]]


class DocumentError(ValueError):
    """A row whose document text cannot be read (a null, a number, a missing field)."""


def document_text(value: Any, field: str) -> str:
    """A row's ``field`` value as a document's text; an empty string is a row without a document."""
    if not isinstance(value, str):
        raise DocumentError(
            f"a row's {field!r} is {value!r:.80}, not a string: every document needs its text"
        )
    return value


@dataclass
class ShardPosition:
    """Where a shard's next window starts: before the shard's document number ``documents`` (rows
    read, empty ones included), after ``carry`` (the tokens that the previous documents left over,
    fewer than ``seq_len``), ``windows`` windows into what that document and the carry make.
    ``source`` is the Hugging Face shard's own state at that document (None: replay ``documents``
    rows from the shard's start instead)."""

    source: dict[str, Any] | None = None
    documents: int = 0
    carry: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    windows: int = 0


class ShardWindows:
    """One shard's windows, in order, resumable: ``state_dict()`` after any window, given to
    ``load_state_dict`` of a fresh ``open_shard`` of the same shard and epoch, continues with
    exactly the windows that followed.

    The state is ``{"epoch", "source", "documents", "carry", "windows"}`` (``ShardPosition``, with
    ``carry`` as a list of ints). It is taken at a document boundary, so the carry stays below
    ``seq_len`` tokens however long the documents: a resume re-reads and re-tokenizes at most the
    one document the last window was cut from. With a shuffle buffer, Hugging Face cannot save the
    buffer's content (its state would skip the documents the buffer held), so ``source`` is None and
    a resume re-reads the shard's first ``documents`` rows, without tokenizing them: exact, in
    O(rows).
    """

    def __init__(self, documents: Any, stream: HFPackedStream, replay: bool) -> None:
        self.documents = documents  # this shard: a datasets.IterableDataset
        self.stream = stream
        self.epoch = stream.epoch
        self.replay = replay
        self._start = ShardPosition()
        self._position = self._start

    def state_dict(self) -> dict[str, Any]:
        position = self._position
        return {
            "epoch": self.epoch,
            "source": position.source,
            "documents": position.documents,
            "carry": position.carry.tolist(),
            "windows": position.windows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        keys = {"epoch", "source", "documents", "carry", "windows"}
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError(f"not a ShardWindows state ({', '.join(sorted(keys))}): {state!r:.200}")
        if state["epoch"] != self.epoch:
            # datasets would ignore a state of another epoch and start the shard over, silently.
            raise ValueError(f"this shard state was saved in epoch {state['epoch']}, not {self.epoch}")
        carry = np.asarray(state["carry"], dtype=np.int64).reshape(-1)
        self._start = self._position = ShardPosition(
            state["source"], int(state["documents"]), carry, int(state["windows"])
        )

    def _texts(self, start: ShardPosition) -> Iterator[str]:
        """The shard's documents' texts, from ``start``'s document on."""
        if start.source is not None:
            self.documents.load_state_dict(start.source)
            return self._read()
        return islice(self._read(), start.documents, None)

    def _read(self) -> Iterator[str]:
        field = self.stream.field
        # .iter, not iter(): in a DataLoader worker, a datasets.IterableDataset's __iter__ splits its
        # shards among the workers again, leaving one shard to one worker and none to the others.
        for batch in self.documents.iter(batch_size=1):
            if field not in batch:
                raise DocumentError(f"a row has no field {field!r} (its fields: {', '.join(sorted(batch))})")
            yield document_text(batch[field][0], field)

    def _after_document(self, documents: int, carry: NDArray[np.int64]) -> ShardPosition:
        # Asked for after every document (a deep copy, small beside tokenizing one), not when a
        # checkpoint asks: by then datasets' state is past the document the next window comes from.
        source = None if self.replay else self.documents.state_dict()
        return ShardPosition(source, documents, carry, 0)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        stream, start = self.stream, self._start
        step, seq_len = stream.tokens_per_sample, stream.seq_len
        eos = np.array([stream.eos_id], dtype=np.int64)
        before, carry, documents = start, start.carry, start.documents
        for text in self._texts(start):
            documents += 1
            if text:
                ids = np.asarray(stream.encode(text), dtype=np.int64)
                tokens = np.concatenate([carry, ids, eos])
                count = (len(tokens) - 1) // step  # windows ending within these tokens
                for k in range(before.windows, count):
                    self._position = ShardPosition(before.source, before.documents, before.carry, k + 1)
                    yield window_sample(tokens, k * step, seq_len)
                carry = tokens[count * step :]  # the overlap token and what no window filled yet
            before = self._position = self._after_document(documents, carry)


class HFPackedStream(IterableDataset[dict[str, torch.Tensor]]):
    """The documents of a ``datasets.IterableDataset`` (its column ``field``), each encoded by
    ``encode`` (text to ids, without the end-of-document id) and followed by ``eos_id``, cut into
    windows of ``seq_len`` tokens overlapping by one (``PackedTokens``' windows, ``tokens_per_sample
    = seq_len - 1``).

    Documents are packed within a shard: a shard's windows are those ``PackedTokenStream`` cuts from
    its documents alone, and its last tokens that fill no window are dropped (at most ``seq_len - 1``
    per shard and pass), so that any shard can be read, or resumed, without the others.

    ``shards``: the shard indices to read (default all; a split keeps some files for validation).
    ``shuffle_buffer``: documents of a shard are shuffled through a buffer of that many
    (``datasets``' ``shuffle``), keyed by ``seed`` and the epoch (``set_epoch``).

    ``iter()`` reads the shards in order, for a first look; the trainer splits the shards among its
    processes and workers itself. It has no ``len``: a stream's size is unknown until it is read.
    """

    tokenizer_file: str | None = None  # the tokenizer.json of the tokens (None: bytes)

    def __init__(
        self,
        documents: Any,
        seq_len: int,
        eos_id: int,
        *,
        encode: Encode,
        field: str = "text",
        vocab_size: int | None = None,
        shards: Sequence[int] | None = None,
        shuffle_buffer: int | None = None,
        seed: int = 0,
    ) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2 (one input and one target token), got {seq_len}")
        self.documents = documents
        self.seq_len, self.tokens_per_sample = seq_len, seq_len - 1
        self.eos_id, self.vocab_size = eos_id, vocab_size
        self.encode, self.field = encode, field
        self.shard_indices = list(range(documents.n_shards) if shards is None else shards)
        self.shuffle_buffer, self.seed = shuffle_buffer, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def shards(self) -> list[int]:
        return self.shard_indices

    def open_shard(self, shard: int) -> ShardWindows:
        part = self.documents.shard(num_shards=self.documents.n_shards, index=shard, contiguous=True)
        if self.shuffle_buffer is not None:
            part = part.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer)
        part.set_epoch(self.epoch)
        return ShardWindows(part, self, replay=self.shuffle_buffer is not None)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for shard in self.shards():
            yield from self.open_shard(shard)

    def __repr__(self) -> str:
        return (
            f"HFPackedStream({len(self.shard_indices)} of {self.documents.n_shards} shards, "
            f"windows of {self.seq_len} tokens, shuffle_buffer={self.shuffle_buffer}, epoch={self.epoch})"
        )
