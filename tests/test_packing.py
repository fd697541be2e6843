"""Token packing: every token after the first is a target exactly once, in memory or streamed."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linnaeus_accel.data.tokens.packing import (
    BYTE_EOS,
    BYTE_VOCAB_SIZE,
    PackedTokens,
    PackedTokenStream,
    decode_bytes,
    encode_bytes,
)

EOS = 1000


def target_positions(samples: Sequence[dict[str, torch.Tensor]]) -> list[int]:
    """With tokens = arange(n), the token positions each sample predicts (labels shifted by one)."""
    return [int(p) for s in samples for p in s["labels"][1:]]


def concatenation(documents: Sequence[Sequence[int]], order: Sequence[int]) -> torch.Tensor:
    return torch.tensor([t for i in order for t in [*documents[i], EOS]], dtype=torch.int64)


def as_lists(samples: Sequence[dict[str, torch.Tensor]]) -> list[tuple[list[int], list[int]]]:
    return [(s["input_ids"].tolist(), s["labels"].tolist()) for s in samples]


documents_strategy = st.lists(st.lists(st.integers(0, 999), max_size=30), min_size=1, max_size=12)


# -- PackedTokens ------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 300), seq_len=st.integers(2, 40))
def test_every_token_after_the_first_is_a_target_exactly_once(n: int, seq_len: int) -> None:
    if n < seq_len:
        return
    data = PackedTokens(torch.arange(n), seq_len)
    samples = [data[k] for k in range(len(data))]
    targets = target_positions(samples)
    assert targets == list(range(1, len(targets) + 1))  # in order, no gap, no repeat
    assert n - 1 - len(targets) < seq_len - 1  # only a tail shorter than one sample's targets is left
    assert len(targets) == len(data) * data.tokens_per_sample
    assert all(len(s["input_ids"]) == seq_len for s in samples)


def test_items_are_overlapping_windows_with_labels_equal_to_inputs() -> None:
    data = PackedTokens(torch.arange(10), seq_len=4)
    assert len(data) == 3  # (10 - 1) // 3
    assert data.tokens_per_sample == 3
    assert [data[k]["input_ids"].tolist() for k in range(3)] == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    item = data[1]
    assert torch.equal(item["labels"], item["input_ids"])
    assert item["input_ids"].dtype == torch.int64
    item["input_ids"][0] = -1  # masking the inputs in place touches neither the labels nor the data
    assert item["labels"][0] == 3
    assert data[1]["input_ids"][0] == 3
    assert data[-1]["input_ids"].tolist() == [6, 7, 8, 9]
    with pytest.raises(IndexError):
        data[3]


def test_packed_tokens_errors() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        PackedTokens(torch.arange(10), seq_len=1)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        PackedTokens(torch.arange(5), seq_len=6)
    with pytest.raises(ValueError, match="1-D integer"):
        PackedTokens(torch.zeros(3, 4, dtype=torch.int64), seq_len=2)
    with pytest.raises(ValueError, match="1-D integer"):
        PackedTokens(torch.rand(10), seq_len=2)
    assert len(PackedTokens(torch.arange(6), seq_len=6)) == 1  # exactly one sample's worth


# -- PackedTokenStream -------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(documents=documents_strategy, seq_len=st.integers(2, 25))
def test_stream_gives_the_samples_packed_tokens_cuts_from_the_concatenation(
    documents: list[list[int]], seq_len: int
) -> None:
    tokens = concatenation(documents, range(len(documents)))
    if len(tokens) < seq_len:
        with pytest.raises(ValueError, match="fewer than seq_len"):
            PackedTokenStream(documents, seq_len, eos_id=EOS)
        return
    stream = PackedTokenStream(documents, seq_len, eos_id=EOS)
    packed = PackedTokens(tokens, seq_len)
    streamed = list(stream)
    assert as_lists(streamed) == as_lists([packed[k] for k in range(len(packed))])
    assert len(stream) == len(streamed) == len(packed)
    assert stream.tokens_per_sample == seq_len - 1


def test_shuffled_stream_follows_its_epoch_order_and_len_is_exact() -> None:
    documents = [[100 * d + i for i in range(d + 3)] for d in range(9)]  # distinct lengths and tokens
    stream = PackedTokenStream(documents, seq_len=5, eos_id=EOS, seed=7)
    orders = []
    for epoch in range(3):
        stream.set_epoch(epoch)
        order = stream.document_order()
        samples = list(stream)
        packed = PackedTokens(concatenation(documents, order), seq_len=5)
        assert as_lists(samples) == as_lists([packed[k] for k in range(len(packed))])
        assert len(samples) == len(stream)  # the same every epoch: it depends only on the total
        orders.append(order)
    assert sorted(orders[0]) == list(range(9))
    assert len({tuple(o) for o in orders}) == 3  # a different order each epoch


def test_shuffle_is_a_function_of_seed_and_epoch() -> None:
    documents = [[d] * 4 for d in range(20)]

    def epoch_samples(seed: int, epoch: int) -> list[tuple[list[int], list[int]]]:
        stream = PackedTokenStream(documents, seq_len=8, eos_id=EOS, seed=seed)
        stream.set_epoch(epoch)
        return as_lists(list(stream))

    assert epoch_samples(3, 2) == epoch_samples(3, 2)  # another process, or a resumed run
    assert epoch_samples(3, 2) != epoch_samples(4, 2)
    unshuffled = PackedTokenStream(documents, seq_len=8, eos_id=EOS)
    unshuffled.set_epoch(5)
    assert unshuffled.document_order() == list(range(20))


class CountingDocuments(Sequence[list[int]]):
    """Documents that record which ones were read."""

    def __init__(self, n: int, length: int) -> None:
        self.n, self.length = n, length
        self.read: set[int] = set()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> list[int]:  # type: ignore[override]
        if not 0 <= i < self.n:
            raise IndexError(i)  # ends Sequence.__iter__
        self.read.add(i)
        return [i % 256] * self.length


def test_stream_reads_documents_lazily() -> None:
    documents = CountingDocuments(n=10_000, length=50)
    stream = PackedTokenStream(documents, seq_len=64, eos_id=EOS)  # reads every length, once
    documents.read.clear()
    first = next(iter(stream))
    assert first["input_ids"].tolist()[:51] == [0] * 50 + [EOS]
    assert len(documents.read) <= 2  # the first sample needs two documents, not all 10,000


def test_stream_accepts_bytes_and_tensors_as_documents() -> None:
    as_bytes = PackedTokenStream([b"abc", b"de"], seq_len=3, eos_id=BYTE_EOS)
    as_tensors = PackedTokenStream([torch.tensor([97, 98, 99]), torch.tensor([100, 101])], 3, BYTE_EOS)
    assert as_lists(list(as_bytes)) == as_lists(list(as_tensors))
    assert [s["input_ids"].tolist() for s in as_bytes] == [[97, 98, 99], [99, 256, 100], [100, 101, 256]]


def test_stream_errors() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        PackedTokenStream([[1, 2, 3]], seq_len=1, eos_id=EOS)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        PackedTokenStream([[1, 2], [3]], seq_len=6, eos_id=EOS)  # 5 tokens with the EOS tokens


# -- byte tokens -------------------------------------------------------------------------------------


def test_byte_tokens_round_trip_and_eos_is_dropped() -> None:
    text = "Ünïcode: naïve café, λ → ok"
    ids = encode_bytes(text)
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert decode_bytes(ids) == text
    assert decode_bytes([*ids, BYTE_EOS]) == text
    assert decode_bytes(torch.tensor(ids)) == text
    assert decode_bytes([0xC3]) == "\ufffd"  # a model's invalid UTF-8 does not raise
    assert BYTE_VOCAB_SIZE == BYTE_EOS + 1 == 257
