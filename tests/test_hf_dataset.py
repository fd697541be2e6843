"""``hf_dataset``: local JSON Lines, text and Parquet files read with Hugging Face ``datasets``,
tokenized on the fly and packed into windows, as a user meets them.

- Map-style: the windows ``PackedTokens`` cuts from every document's ids and end-of-document id
  joined (UTF-8 bytes and a ``tokenizer.json``), whether a window lies in one document, spans two or
  many; validation is ``val_files``, or the last ``VAL_FRACTION`` of the documents; it pickles as
  the paths of ``datasets``' cache files, not as tokens.
- Streaming: one shard per file, each shard's windows those ``PackedTokenStream`` cuts from that
  file's documents alone; a shard resumed from its state after any window continues with exactly
  the windows that followed (json, text, parquet; shuffled too); a shuffle buffer draws another
  order each epoch, the same every time; a shard reads whole in any DataLoader worker.
- Random windows (map-style): draw ``g`` is ``seq_len`` tokens of the joined documents from an
  offset keyed by ``(EXPERIMENT.SEED, g)`` (training's stream, or validation's with
  ``val_windows``), whatever start fits; the sampler yields the run's draw numbers; aligned windows
  and their order are as before.
- Refusals: every bad option is a ``ConfigError`` keyed by the option to change (random windows
  with streaming too).
"""

from __future__ import annotations

import json
import pickle
import random
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest
import torch
from helpers.tokens import train_tokenizer
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from linnaeus_accel.config import Config, ConfigError, validate_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.data.hf.dataset import HFPackedDocuments
from linnaeus_accel.data.hf.stream import HFPackedStream
from linnaeus_accel.data.sampling import EpochSeededSampler, epoch_sampler
from linnaeus_accel.data.tokens.packing import (
    BYTE_EOS,
    BYTE_VOCAB_SIZE,
    PackedTokens,
    PackedTokenStream,
    encode_bytes,
)
from linnaeus_accel.data.tokens.windows import (
    TRAIN_STREAM,
    VAL_STREAM,
    DrawSampler,
    RandomOffsets,
    WindowDraws,
)

OPTIONS = "DATA.DATASET.OPTIONS"
SUFFIXES = {"json": "jsonl", "text": "txt", "parquet": "parquet"}
WORDS = ["the", "fox", "jumps", "over", "a", "lazy", "dog", "Zwölf", "Boxkämpfer", "東京", "✓", "quer"]
Encode = Callable[[str], list[int]]


@pytest.fixture(scope="module", autouse=True)
def offline_datasets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No network, and ``datasets``' cache in a temporary directory rather than the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        import datasets

        patch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_cache")))
        yield


def documents(seed: int, count: int) -> list[str]:
    """``count`` texts of 0 to 40 words (an empty one is no document), multi-byte characters too."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(0, 40))) for _ in range(count)]


def write(path: Path, fmt: str, texts: Sequence[str]) -> str:
    """``texts`` as a ``fmt`` file at ``path`` (its suffix added): a document per row (per line)."""
    path = path.with_suffix(f".{SUFFIXES[fmt]}")
    if fmt == "json":
        path.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(texts)))
    elif fmt == "text":
        path.write_text("".join(f"{t}\n" for t in texts), encoding="utf-8")
    else:
        pq.write_table(pa.table({"text": list(texts)}), path, row_group_size=4)
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Three JSON Lines training files and a validation file, by path."""
    root = tmp_path_factory.mktemp("corpus")
    files = {write(root / f"train-{i}", "json", documents(i, 25)): documents(i, 25) for i in range(3)}
    files[write(root / "val", "json", documents(9, 10))] = documents(9, 10)
    return files


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_tokenizer(path, "<|endoftext|>")
    return str(path)


def config_of(options: dict[str, Any], val_fraction: float = 0.2, seed: int = 0) -> Config:
    dataset = {"NAME": "hf_dataset", "VAL_FRACTION": val_fraction, "OPTIONS": options}
    return validate_config({"DATA": {"DATASET": dataset}, "EXPERIMENT": {"SEED": seed}})


def ids(sample: dict[str, torch.Tensor]) -> list[int]:
    assert torch.equal(sample["input_ids"], sample["labels"])
    values: list[int] = sample["input_ids"].tolist()
    return values


def packed(
    texts: Sequence[str], seq_len: int, encode: Encode = encode_bytes, eos: int = BYTE_EOS
) -> list[list[int]]:
    """``PackedTokens``' windows of the documents joined, each followed by ``eos``."""
    return windows(PackedTokens(torch.tensor(joined(texts, encode, eos)), seq_len))


def joined(texts: Sequence[str], encode: Encode = encode_bytes, eos: int = BYTE_EOS) -> list[int]:
    """The documents' tokens, each followed by ``eos``, one after the other."""
    return [token for text in texts if text for token in (*encode(text), eos)]


def streamed(texts: Sequence[str], seq_len: int) -> list[list[int]]:
    """``PackedTokenStream``'s windows of the documents (byte-level) in order."""
    return [ids(w) for w in PackedTokenStream([encode_bytes(t) for t in texts if t], seq_len, BYTE_EOS)]


def windows(dataset: Any) -> list[list[int]]:
    return [ids(dataset[k]) for k in range(len(dataset))]


def tokenizer_json(path: str) -> tuple[Encode, int, int]:
    """``(encode, eos_id, vocab_size)`` of a tokenizer.json, read as ``tokenize`` reads it."""
    tokenizer = Tokenizer.from_file(path)
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert eos is not None

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    return encode, eos, tokenizer.get_vocab_size()


# -- map-style ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_windows_are_packed_tokens_of_the_joined_documents(
    corpus: dict[str, list[str]], bpe: str, tokenizer: str
) -> None:
    *train_files, val_file = corpus
    options = {"format": "json", "data_files": train_files, "val_files": val_file, "seq_len": 33}
    encode: Encode = encode_bytes
    eos, vocab = BYTE_EOS, BYTE_VOCAB_SIZE
    if tokenizer == "bpe":
        options["tokenizer"] = bpe
        encode, eos, vocab = tokenizer_json(bpe)
    train = build_dataset(config_of(options), "train")
    assert isinstance(train, HFPackedDocuments)
    assert (train.vocab_size, train.eos_id, train.tokens_per_sample) == (vocab, eos, 32)
    texts = [text for path in train_files for text in corpus[path]]
    assert windows(train) == packed(texts, 33, encode, eos)
    assert windows(build_dataset(config_of(options), "val")) == packed(corpus[val_file], 33, encode, eos)


def test_a_window_is_read_from_the_documents_it_spans(tmp_path: Path) -> None:
    texts = ["a" * 30, "b" * 20, *"cdefghijklmnopqrstuv"]  # 31 and 21 tokens, then 20 of 2 tokens
    path = write(tmp_path / "docs", "json", texts)
    dataset = build_dataset(
        config_of({"format": "json", "data_files": path, "val_files": path, "seq_len": 9}), "train"
    )
    expected = packed(texts, 9)
    assert windows(dataset) == expected
    ends_of_documents = [window.count(BYTE_EOS) for window in expected]
    assert ends_of_documents[0] == 0  # window 0: tokens 0-8, inside the first document
    assert ends_of_documents[3] == 1  # tokens 24-32: the first document's end, the second's start
    assert max(ends_of_documents) >= 4  # short documents: one window holds several
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_validation_is_val_files_or_the_last_share_of_the_documents(
    corpus: dict[str, list[str]], tmp_path: Path
) -> None:
    texts = ["alpha " * (i + 3) for i in range(10)]
    path = write(tmp_path / "docs", "json", texts)
    options = {"format": "json", "data_files": path, "seq_len": 5}
    # 25% of 10 documents, rounded half up: the last 3.
    held = {
        split: windows(build_dataset(config_of(options, val_fraction=0.25), split))
        for split in ("train", "val")
    }
    assert held == {"train": packed(texts[:7], 5), "val": packed(texts[7:], 5)}
    val_file = list(corpus)[-1]
    given = build_dataset(config_of({**options, "val_files": val_file}), "val")
    assert windows(given) == packed(corpus[val_file], 5)
    assert windows(build_dataset(config_of({**options, "val_files": val_file}), "train")) == packed(texts, 5)


def test_it_pickles_as_its_cache_files_not_its_tokens(corpus: dict[str, list[str]]) -> None:
    *train_files, val_file = corpus
    options = {"format": "json", "data_files": train_files, "val_files": val_file, "seq_len": 17}
    dataset = build_dataset(config_of(options), "train")
    blob = pickle.dumps(dataset)
    assert len(blob) < dataset.total_tokens  # under a byte a token: the tokens stay on disk
    restored = pickle.loads(blob)
    assert restored.documents.cache_files == dataset.documents.cache_files
    assert windows(restored) == windows(dataset)


# -- random windows ----------------------------------------------------------------------------------


def map_style(options: dict[str, Any], split: str = "train", seed: int = 0) -> HFPackedDocuments:
    dataset = build_dataset(config_of(options, seed=seed), split)  # type: ignore[arg-type]
    assert isinstance(dataset, HFPackedDocuments)
    return dataset


def drawn_offsets(total: int, seq_len: int, seed: int, stream: int, draws: range) -> list[int]:
    """The offsets ``token_windows`` draws over every start of ``total`` tokens: the reference."""
    offsets = RandomOffsets([(0, total - seq_len + 1)], WindowDraws("random", seed, stream))
    return [offsets.locate(g)[1] for g in draws]


def test_random_windows_read_the_joined_documents_at_keyed_offsets(tmp_path: Path) -> None:
    texts = ["a" * 30, "b" * 20, *"cdefghijklmnopqrstuv"]  # 31, 21, then 20 x 2 tokens: 92
    path = write(tmp_path / "docs", "json", texts)
    options = {"format": "json", "data_files": path, "val_files": path, "seq_len": 9}
    tokens = joined(texts)
    aligned = map_style(options)
    dataset = map_style({**options, "windows": "random"}, seed=3)
    assert (dataset.windows.mode, dataset.windows.seed, dataset.windows.stream) == ("random", 3, TRAIN_STREAM)
    assert len(dataset) == len(aligned) == 11  # an epoch draws as many windows as aligned cuts
    draws = range(2000)
    starts = drawn_offsets(len(tokens), 9, 3, TRAIN_STREAM, draws)
    read = [ids(dataset[g]) for g in draws]
    assert read == [tokens[s : s + 9] for s in starts]
    # Every start at which 9 tokens fit: unaligned ones, across documents, and the last (83: the
    # tokens after the last aligned window, which ends at token 88).
    assert set(starts) == set(range(len(tokens) - 9 + 1))
    assert any(window[:-1].count(BYTE_EOS) for window in read)  # a window crossing a document's end
    [far] = drawn_offsets(len(tokens), 9, 3, TRAIN_STREAM, range(10**12, 10**12 + 1))
    assert ids(dataset[10**12]) == tokens[far : far + 9]  # any draw >= 0: a draw of a late epoch
    with pytest.raises(IndexError):
        dataset[-1]


def test_random_offsets_are_a_function_of_the_seed_and_the_draw(corpus: dict[str, list[str]]) -> None:
    *train_files, val_file = corpus
    options = {"format": "json", "data_files": train_files, "val_files": val_file, "seq_len": 17}
    random_windows = {**options, "windows": "random"}
    first, again = map_style(random_windows, seed=5), map_style(random_windows, seed=5)
    other_seed = map_style(random_windows, seed=6)
    copy = pickle.loads(pickle.dumps(first))  # as a DataLoader worker started by spawn has it
    draws = [0, 1, 2, 17, 500, 10**6, 10**12]
    read = [ids(first[g]) for g in draws]
    assert [ids(again[g]) for g in draws] == read == [ids(copy[g]) for g in draws]
    assert [ids(other_seed[g]) for g in draws] != read
    tokens = joined([text for path in train_files for text in corpus[path]])
    starts = drawn_offsets(len(tokens), 17, 5, TRAIN_STREAM, range(200))
    assert [ids(first[g]) for g in range(200)] == [tokens[s : s + 17] for s in starts]
    assert any(s % 16 for s in starts)  # not only the aligned starts
    assert len(first) == len(map_style(options)) == (len(tokens) - 1) // 16


def test_random_windows_are_sampled_by_draw_number(corpus: dict[str, list[str]]) -> None:
    *train_files, val_file = corpus
    options = {"format": "json", "data_files": train_files, "val_files": val_file, "seq_len": 33}
    dataset = map_style({**options, "windows": "random"})
    sampler = epoch_sampler(dataset, seed=0, shuffle=True)
    assert isinstance(sampler, DrawSampler)
    n = len(dataset)
    for epoch in (0, 2):
        sampler.set_epoch(epoch)
        assert list(sampler) == list(range(epoch * n, (epoch + 1) * n))  # the run's draw numbers
    assert sampler.indices_at([0, 3, n - 1]) == [2 * n, 2 * n + 3, 3 * n - 1]


def test_aligned_windows_and_their_order_are_as_before(corpus: dict[str, list[str]]) -> None:
    *train_files, val_file = corpus
    options = {"format": "json", "data_files": train_files, "val_files": val_file, "seq_len": 33}
    default, aligned = map_style(options), map_style({**options, "windows": "aligned"})
    texts = [text for path in train_files for text in corpus[path]]
    assert default.windows.mode == aligned.windows.mode == "aligned"
    assert windows(default) == windows(aligned) == packed(texts, 33)
    sampler = epoch_sampler(default, seed=4, shuffle=True)
    assert type(sampler) is EpochSeededSampler
    assert list(sampler) == list(EpochSeededSampler(default, 4, shuffle=True))
    assert list(sampler) != list(range(len(default)))  # shuffled, as before
    with pytest.raises(IndexError):
        default[len(default)]
    with pytest.raises(IndexError):
        default[-1]


def test_validation_is_aligned_unless_val_windows_is_random(corpus: dict[str, list[str]]) -> None:
    *train_files, val_file = corpus
    options = {"format": "json", "data_files": train_files, "val_files": val_file, "seq_len": 9}
    tokens = joined(corpus[val_file])
    val = map_style({**options, "windows": "random"}, "val", seed=2)
    assert val.windows.mode == "aligned"
    assert windows(val) == packed(corpus[val_file], 9)
    assert type(epoch_sampler(val, seed=2, shuffle=False)) is EpochSeededSampler
    random_val = map_style({**options, "val_windows": "random"}, "val", seed=2)
    assert (random_val.windows.mode, random_val.windows.stream) == ("random", VAL_STREAM)
    assert map_style({**options, "val_windows": "random"}, seed=2).windows.mode == "aligned"  # training
    assert len(random_val) == len(val)
    draws = range(len(random_val))  # a pass: epoch 0 of validation's own stream
    starts = drawn_offsets(len(tokens), 9, 2, VAL_STREAM, draws)
    assert [ids(random_val[g]) for g in draws] == [tokens[s : s + 9] for s in starts]
    assert starts != drawn_offsets(len(tokens), 9, 2, TRAIN_STREAM, draws)  # not training's draws
    assert isinstance(epoch_sampler(random_val, seed=2, shuffle=False), DrawSampler)


def test_random_windows_with_streaming_are_refused_naming_the_key(corpus: dict[str, list[str]]) -> None:
    *train_files, val_file = corpus
    options = {"format": "json", "data_files": train_files, "val_files": val_file, "streaming": True}
    for key in ("windows", "val_windows"):
        for split in ("train", "val"):
            with pytest.raises(ConfigError) as refused:
                build_dataset(config_of({**options, key: "random"}), split)  # type: ignore[arg-type]
            [(named, message)] = refused.value.problems
            assert named == f"{OPTIONS}.{key}"
            assert "a stream is read in order: it cannot draw random offsets" in message
    assert isinstance(build_dataset(config_of({**options, "windows": "aligned"}), "train"), HFPackedStream)


# -- streaming ---------------------------------------------------------------------------------------


def stream_files(root: Path, fmt: str, count: int = 3) -> dict[str, list[str]]:
    """``count`` files of ``fmt``, one with documents of several windows each."""
    files = {write(root / f"part-{i}", fmt, documents(i, 12)): documents(i, 12) for i in range(count - 1)}
    long = ["long document " * 20, "", "x", "another long one " * 12, "tail"]
    files[write(root / f"part-{count - 1}", fmt, long)] = long
    return files


def streaming(
    files: Sequence[str], fmt: str = "json", split: str = "train", **options: Any
) -> HFPackedStream:
    settings = {"format": fmt, "data_files": list(files), "seq_len": 9, "streaming": True, **options}
    stream = build_dataset(config_of(settings), split)  # type: ignore[arg-type]
    assert isinstance(stream, HFPackedStream)
    return stream


@pytest.mark.parametrize("fmt", ["json", "text", "parquet"])
def test_a_shard_is_a_file_packed_alone(tmp_path: Path, fmt: str) -> None:
    files = stream_files(tmp_path, fmt)
    paths = list(files)
    stream = streaming(paths, fmt, val_files=paths[0])
    assert stream.shards() == [0, 1, 2]
    assert (stream.tokens_per_sample, stream.eos_id, stream.vocab_size) == (8, BYTE_EOS, BYTE_VOCAB_SIZE)
    assert not hasattr(stream, "__len__")
    for shard, texts in enumerate(files.values()):
        assert [ids(w) for w in stream.open_shard(shard)] == streamed(texts, 9)
    assert [ids(w) for w in stream] == [w for texts in files.values() for w in streamed(texts, 9)]


def read_and_resume(stream: HFPackedStream, shard: int, after: int) -> tuple[dict[str, Any], list[list[int]]]:
    """The shard's state after ``after`` windows, and what a fresh shard given that state reads."""
    source = stream.open_shard(shard)
    windows = iter(source)
    for _ in range(after):
        next(windows)
    state = json.loads(json.dumps(source.state_dict()))  # as a checkpoint would keep it
    resumed = stream.open_shard(shard)
    resumed.load_state_dict(state)
    return state, [ids(w) for w in resumed]


@pytest.mark.parametrize("fmt", ["json", "text", "parquet"])
def test_a_shard_resumes_after_any_window(tmp_path: Path, fmt: str) -> None:
    paths = list(stream_files(tmp_path, fmt))
    stream = streaming(paths, fmt, val_files=paths[0])
    for shard in (0, 2):  # short documents; long ones, several windows each
        whole = [ids(w) for w in stream.open_shard(shard)]
        for after in sorted({0, 1, 2, 5, 6, len(whole) // 2, len(whole) - 1, len(whole)}):
            state, rest = read_and_resume(stream, shard, after)
            assert rest == whole[after:], (shard, after)
            assert len(state["carry"]) < stream.seq_len


def test_a_shuffle_buffer_draws_another_order_each_epoch_and_resumes_exactly(tmp_path: Path) -> None:
    files = list(stream_files(tmp_path, "json"))
    stream = streaming(files, val_files=files[0], shuffle_buffer=4)
    first = [ids(w) for w in stream.open_shard(0)]
    assert [ids(w) for w in streaming(files, val_files=files[0], shuffle_buffer=4).open_shard(0)] == first
    assert first != streamed(documents(0, 12), 9)
    stream.set_epoch(1)
    second = [ids(w) for w in stream.open_shard(0)]
    assert second != first
    state, rest = read_and_resume(stream, 0, 7)
    assert state["source"] is None  # replayed: datasets keeps no buffer's content
    assert rest == second[7:]
    stream.set_epoch(2)
    with pytest.raises(ValueError, match="epoch 1, not 2"):
        stream.open_shard(0).load_state_dict(state)


def test_validation_holds_out_the_last_files(tmp_path: Path) -> None:
    files = list(stream_files(tmp_path, "json"))
    assert streaming(files).shards() == [0, 1]  # 20% of 3 files: at least one
    assert streaming(files, split="val").shards() == [2]
    assert streaming(files, split="val", val_files=files[1]).shards() == [0]


class EachWorkerReadsItsShard(IterableDataset[int]):
    def __init__(self, stream: HFPackedStream) -> None:
        self.stream = stream

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        assert info is not None
        for _ in self.stream.open_shard(info.id):
            yield info.id


def test_a_shard_reads_whole_in_any_dataloader_worker(tmp_path: Path) -> None:
    files = stream_files(tmp_path, "json", count=2)
    paths = list(files)
    stream = streaming(paths, val_files=paths[0])
    counts = [len(streamed(texts, 9)) for texts in files.values()]
    read = list(DataLoader(EachWorkerReadsItsShard(stream), num_workers=2, batch_size=None))
    assert [read.count(worker) for worker in (0, 1)] == counts


# -- refusals ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def refusable(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("refusable")
    numbers = root / "numbers.jsonl"
    numbers.write_text('{"text": 3}\n')
    nulls = root / "nulls.jsonl"
    nulls.write_text('{"text": "a"}\n{"other": "b"}\n')
    broken = root / "broken.jsonl"
    broken.write_text('{"text": "a"}\n{"text": \n')
    return {
        "good": write(root / "good", "json", documents(0, 4)),
        "numbers": str(numbers),
        "nulls": str(nulls),
        "broken": str(broken),
    }


REFUSALS: list[tuple[dict[str, Any], list[str]]] = [
    ({"format": "csv"}, [f"{OPTIONS}.format"]),
    ({"format": None}, [f"{OPTIONS}.format"]),
    ({"data_files": None}, [f"{OPTIONS}.data_files"]),
    ({"data_files": "missing.jsonl"}, [f"{OPTIONS}.data_files"]),
    ({"data_files": "missing-*.jsonl"}, [f"{OPTIONS}.data_files"]),
    ({"val_files": "missing.jsonl"}, [f"{OPTIONS}.val_files"]),
    ({"data_files": "broken"}, [f"{OPTIONS}.data_files"]),
    ({"field": "body"}, [f"{OPTIONS}.field"]),
    ({"data_files": "numbers"}, [f"{OPTIONS}.field"]),
    ({"data_files": "nulls"}, [f"{OPTIONS}.field"]),
    ({"tokenizer": "missing/tokenizer.json"}, [f"{OPTIONS}.tokenizer"]),
    ({"eos_token": "</s>"}, [f"{OPTIONS}.eos_token"]),
    ({"shuffle_buffer": 10}, [f"{OPTIONS}.shuffle_buffer"]),
    ({"windows": "shuffled", "val_windows": 1}, [f"{OPTIONS}.windows", f"{OPTIONS}.val_windows"]),
    ({"streaming": True, "windows": "random"}, [f"{OPTIONS}.windows"]),
    ({"streaming": True, "val_windows": "random"}, [f"{OPTIONS}.val_windows"]),
    ({"streaming": True, "val_files": None}, [f"{OPTIONS}.data_files"]),
    ({"seq_len": 1, "colour": "red"}, [f"{OPTIONS}.seq_len", OPTIONS]),
    ({"seq_len": 10_000}, [f"{OPTIONS}.data_files"]),
]


@pytest.mark.parametrize(("change", "keys"), REFUSALS)
def test_a_bad_option_is_refused_naming_it(
    refusable: dict[str, str], change: dict[str, Any], keys: list[str]
) -> None:
    options: dict[str, Any] = {"format": "json", "data_files": "good", "val_files": "good", "seq_len": 5}
    options.update(change)
    named = {k: refusable.get(v, v) if isinstance(v, str) else v for k, v in options.items() if v is not None}
    with pytest.raises(ConfigError) as refused:
        build_dataset(config_of(named), "train")
    assert [key for key, _ in refused.value.problems] == keys


def test_without_datasets_the_error_names_the_data_extra(
    refusable: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    with pytest.raises(ConfigError, match=r"linnaeus-accel\[data\]"):
        build_dataset(config_of({"format": "json", "data_files": refusable["good"]}), "train")
