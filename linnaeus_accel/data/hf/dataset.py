"""``hf_dataset``: text documents in local JSON Lines, text or Parquet files, read with Hugging Face
``datasets``, tokenized on the fly and packed into training windows.

Every document is encoded (UTF-8 bytes by default, or a ``tokenizer.json``), followed by the
end-of-document id, and the documents are cut into windows of ``seq_len`` tokens overlapping by one
token (``PackedTokens``' windows: ``tokens_per_sample = seq_len - 1``, every token after the first
a target exactly once). An empty text is no document.

- Map-style (default): the documents are tokenized once with ``Dataset.map`` (cached by
  ``datasets`` in its cache directory, so the next run starts in seconds) and sample ``k`` is window
  ``k`` of all documents joined, in file order (``HFPackedDocuments``, in ``hf_packed``); no token
  is held in memory but the window being read. ``windows: random`` starts the windows at random
  offsets instead, drawn with replacement (nanoGPT's, ``token_windows``).
- Streaming (``streaming: true``): documents are read and tokenized as training goes, and packed
  within each file (``HFPackedStream``); the trainer splits the files among its processes and
  DataLoader workers and resumes a file where it stopped. A file's last tokens that fill no window
  are dropped, at most ``seq_len - 1`` per file and pass. Malformed data is met while reading.

``DATA.DATASET.OPTIONS`` (needs ``pip install 'linnaeus-accel[data]'``)::

    DATA:
      DATASET:
        NAME: hf_dataset
        VAL_FRACTION: 0.01          # without val_files: documents (or files, streaming) held out
        OPTIONS:
          format: json              # json (JSON Lines), text (a document per line) or parquet
          data_files: corpus/train-*.jsonl   # a path, a glob pattern, or a list of them
          val_files: corpus/val.jsonl        # optional
          field: text               # the column holding each document's text
          tokenizer: tokenizer.json # optional: default UTF-8 bytes (257 ids, end of document 256)
          eos_token: "<|endoftext|>" # optional, with tokenizer: default the first it has of
                                    # <|endoftext|>, </s>, <eos>, <|end_of_text|>
          seq_len: 1024             # tokens a sample (default 1024)
          streaming: false          # true: read as training goes
          shuffle_buffer: 10000     # streaming only, optional: documents shuffled within a file
                                    # through a buffer this large, per epoch (EXPERIMENT.SEED)
          windows: aligned          # or random (map-style only): offsets drawn with replacement,
                                    # keyed by EXPERIMENT.SEED and the draw (token_windows)
          val_windows: aligned      # validation's windows: aligned or random, as windows

Validation without ``val_files``: map-style holds out the last ``VAL_FRACTION`` of the documents (in
file order, the same for every seed); streaming holds out the last ``VAL_FRACTION`` of the files.
Each rounds half up, and keeps at least one document (file) on each side.
"""

from __future__ import annotations

import glob
import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from ...config import Config, ConfigError
from ...schedule.steps import decimal_of, round_half_up
from ..options import DatasetOptions
from ..paths import resolved
from ..registry import Split, register_dataset
from ..tokenize.command import TokenizerSpec, load_tokenizer, tokenizer_spec
from ..tokenize.inputs import DATA_EXTRA
from ..tokens.windows import WindowDraws, window_option
from .packed import INPUT_IDS
from .packed import HFPackedDocuments as HFPackedDocuments  # re-exported: its old home
from .stream import DocumentError, HFPackedStream, document_text

if TYPE_CHECKING:
    from tokenizers import Tokenizer

OPTIONS_KEY = "DATA.DATASET.OPTIONS"
FORMATS = ("json", "text", "parquet")
DEFAULT_SEQ_LEN = 1024
DOCUMENTS_PER_PROCESS = 20_000  # fewer rows than this a process would tokenize in less than it starts
_ARGUMENT_OPTIONS = {"--tokenizer": "tokenizer", "--eos-token": "eos_token"}


class DocumentEncoder:
    """A document's text to its ids (without the end-of-document id), by a ``TokenizerSpec``. It
    pickles as the spec alone: each process (and ``datasets``' fingerprint of a map) sees the
    tokenizer's path and digest, and the tokenizer is loaded where it is first used."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        self._tokenizer: Tokenizer | None = None

    def __call__(self, text: str) -> NDArray[Any]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[NDArray[Any]]:
        dtype = self.spec.dtype
        if self.spec.path is None:
            return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype) for text in texts]
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(Path(self.spec.path))
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.array(encoding.ids, dtype=dtype) for encoding in encodings]

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self.spec, "_tokenizer": None}


class TokenizeRows:
    """``Dataset.map``'s function: a batch of rows to their documents' ids, each followed by the
    end-of-document id (an empty text makes no row)."""

    def __init__(self, encoder: DocumentEncoder, field: str) -> None:
        self.encoder, self.field = encoder, field

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[NDArray[Any]]]:
        texts = [text for value in batch[self.field] if (text := document_text(value, self.field))]
        eos = np.array([self.encoder.spec.eos_id], dtype=self.encoder.spec.dtype)
        return {INPUT_IDS: [np.concatenate([ids, eos]) for ids in self.encoder.encode_batch(texts)]}


@dataclass(frozen=True)
class HFOptions:
    format: str
    data_files: list[str]
    val_files: list[str] | None
    field: str
    tokenizer: str | None
    eos_token: str | None
    seq_len: int
    streaming: bool
    shuffle_buffer: int | None
    windows: WindowDraws  # the split's (windows for training, val_windows for validation)


def parse_options(raw: dict[str, Any], split: Split = "train", seed: int = 0) -> HFOptions:
    """The options of ``split``, every problem reported at once (one ``ConfigError``); ``seed``
    (``EXPERIMENT.SEED``) keys random windows."""
    options = DatasetOptions("hf_dataset", raw, OPTIONS_KEY)
    parsed = HFOptions(
        format=options.text("format", None, FORMATS),
        data_files=options.strings("data_files", required=True) or [],
        val_files=options.strings("val_files"),
        field=options.text("field", "text"),
        tokenizer=options.text("tokenizer"),
        eos_token=options.text("eos_token"),
        seq_len=options.integer("seq_len", DEFAULT_SEQ_LEN, minimum=2),
        streaming=options.boolean("streaming", False),
        shuffle_buffer=options.integer("shuffle_buffer", None, minimum=1),
        windows=window_option(options, split, seed),
    )
    if raw.get("format") is None:
        options.problem("format", f"is required: one of {', '.join(FORMATS)}")
    if parsed.shuffle_buffer is not None and not parsed.streaming:
        options.problem(
            "shuffle_buffer", "applies with streaming: true only (map-style samples are shuffled whole)"
        )
    for key in ("windows", "val_windows"):
        if parsed.streaming and raw.get(key) == "random":
            options.problem(
                key,
                "random windows need random access, and a stream is read in order: it cannot draw "
                "random offsets; leave streaming out, or use aligned",
            )
    options.finish()
    return parsed


def import_datasets() -> ModuleType:
    try:
        return importlib.import_module("datasets")
    except ImportError:
        raise ConfigError(
            [("DATA.DATASET.NAME", f"hf_dataset reads files with Hugging Face datasets: {DATA_EXTRA}")]
        ) from None


def tokenizer_of(options: HFOptions) -> TokenizerSpec:
    """``tokenize``'s tokenizer, its problems keyed by the options that name them."""
    try:
        return tokenizer_spec(options.tokenizer, options.eos_token)
    except ConfigError as exc:
        problems = []
        for argument, message in exc.problems:
            for flag, name in _ARGUMENT_OPTIONS.items():
                message = message.replace(flag, name)
            problems.append(
                (f"{OPTIONS_KEY}.{_ARGUMENT_OPTIONS.get(argument, argument)}", f"hf_dataset: {message}")
            )
        raise ConfigError(problems) from None


def expand(pattern: str) -> list[str]:
    """The local files a path or glob pattern names, sorted."""
    expanded = os.path.expanduser(pattern)
    if glob.has_magic(expanded):
        return sorted(m for m in glob.glob(expanded, recursive=True) if os.path.isfile(m))
    return [expanded] if os.path.isfile(expanded) else []


def resolve_files(options: HFOptions) -> dict[str, list[str]]:
    """The files of ``data_files`` and ``val_files``, all checked before a split's are read (a
    missing validation file is reported before the training files are tokenized, not after)."""
    files: dict[str, list[str]] = {}
    problems: list[tuple[str, str]] = []
    for key, patterns in (("data_files", options.data_files), ("val_files", options.val_files or [])):
        files[key] = []
        for pattern in patterns:
            matches = expand(pattern)
            if not matches:
                missing = "matches no file" if glob.has_magic(pattern) else "is not a file"
                problems.append(
                    (f"{OPTIONS_KEY}.{key}", f"hf_dataset: {pattern!r} {missing}{resolved(pattern)}")
                )
            files[key] += matches
    if problems:
        raise ConfigError(problems)
    return files


def load_documents(datasets: ModuleType, options: HFOptions, files: list[str], key: str) -> Any:
    """``files`` (option ``key``) as a ``datasets.Dataset`` (``IterableDataset`` when streaming)."""
    try:
        return datasets.load_dataset(
            options.format, data_files=files, split="train", streaming=options.streaming
        )
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as exc:
        cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""
        message = f"hf_dataset: datasets cannot read these {options.format} files: {exc}{cause}"
        raise ConfigError([(f"{OPTIONS_KEY}.{key}", message)]) from None


def check_field(documents: Any, options: HFOptions, key: str) -> None:
    # A streamed text dataset does not list its one column; its rows are {"text": line}.
    columns = documents.column_names or (["text"] if options.format == "text" else None)
    if columns is None:
        return  # unknown until read: a row without it stops the stream, naming it (DocumentError)
    feature = documents.features.get(options.field) if documents.features else None
    if options.field not in columns:
        problem = f"the {key} have no column {options.field!r} (their columns: {', '.join(columns)})"
    elif feature is not None and getattr(feature, "dtype", None) not in ("string", "large_string"):
        problem = f"column {options.field!r} of {key} holds {feature}, not text"
    else:
        return
    raise ConfigError([(f"{OPTIONS_KEY}.field", f"hf_dataset: {problem}")])


def split_key(options: HFOptions, split: Split) -> str:
    """The option that names the files of ``split``."""
    return "val_files" if split == "val" and options.val_files is not None else "data_files"


def held_out(count: int, fraction: float) -> int:
    """Of ``count`` documents (or files), those held out for validation: the share ``fraction``,
    rounded half up, at least one and leaving one."""
    return min(max(round_half_up(decimal_of(fraction) * count), 1), count - 1)


def too_few(what: str, why: str = "") -> ConfigError:
    message = (
        f"hf_dataset: {what} cannot be split into training and validation (DATA.DATASET.VAL_FRACTION)"
        f"{why}: give the validation data as {OPTIONS_KEY}.val_files"
    )
    return ConfigError([(f"{OPTIONS_KEY}.data_files", message)])


def tokenize_documents(datasets: ModuleType, documents: Any, options: HFOptions, spec: TokenizerSpec) -> Any:
    """Every document's ids and end-of-document id, one row each, computed once and cached."""
    processes = min(os.cpu_count() or 1, len(documents) // DOCUMENTS_PER_PROCESS)
    features = datasets.Features({INPUT_IDS: datasets.Sequence(datasets.Value(spec.dtype.name))})
    try:
        return documents.map(
            TokenizeRows(DocumentEncoder(spec), options.field),
            batched=True,
            remove_columns=documents.column_names,
            features=features,
            num_proc=processes if processes > 1 else None,
            desc="hf_dataset: tokenize",
        )
    except DocumentError as exc:
        raise ConfigError([(f"{OPTIONS_KEY}.field", f"hf_dataset: {exc}")]) from None


def packed_documents(
    tokenized: Any, options: HFOptions, spec: TokenizerSpec, split: Split, fraction: float
) -> HFPackedDocuments:
    rows = range(len(tokenized))
    if options.val_files is None:
        if len(rows) < 2:
            raise too_few(f"{len(rows)} document{'' if len(rows) == 1 else 's'}")
        cut = len(rows) - held_out(len(rows), fraction)
        rows = rows[cut:] if split == "val" else rows[:cut]
    dataset = HFPackedDocuments(
        tokenized,
        options.seq_len,
        vocab_size=spec.vocab_size,
        eos_id=spec.eos_id,
        rows=rows,
        windows=options.windows,
    )
    if len(dataset) == 0:
        held = split == "val" and options.val_files is None
        key = "DATA.DATASET.VAL_FRACTION" if held else f"{OPTIONS_KEY}.{split_key(options, split)}"
        remedy = f"raise it, or give {OPTIONS_KEY}.val_files" if held else "add data or lower seq_len"
        message = (
            f"hf_dataset: the {split} documents hold {dataset.total_tokens} tokens, "
            f"not one window of seq_len {options.seq_len}: {remedy}"
        )
        raise ConfigError([(key, message)])
    return dataset


def packed_stream(
    documents: Any, options: HFOptions, spec: TokenizerSpec, split: Split, fraction: float, seed: int
) -> HFPackedStream:
    """``fraction``: DATA.DATASET.VAL_FRACTION, the share of files held out without val_files;
    ``seed``: EXPERIMENT.SEED, which keys the shuffle buffer."""
    shards = None
    if options.val_files is None:
        count = documents.n_shards
        if count < 2:
            raise too_few("1 file", ", as streaming holds out whole files")
        cut = count - held_out(count, fraction)
        shards = range(cut, count) if split == "val" else range(cut)
    return HFPackedStream(
        documents,
        options.seq_len,
        spec.eos_id,
        encode=DocumentEncoder(spec),
        field=options.field,
        vocab_size=spec.vocab_size,
        shards=shards,
        shuffle_buffer=options.shuffle_buffer if split == "train" else None,
        seed=seed,
    )


@register_dataset("hf_dataset")
def build_hf_dataset(config: Config, split: Split) -> HFPackedDocuments | HFPackedStream:
    """Windows of tokenized documents from local files (see the module docstring for the options)."""
    options = parse_options(dict(config.DATA.DATASET.OPTIONS), split, config.EXPERIMENT.SEED)
    datasets = import_datasets()
    spec = tokenizer_of(options)
    files = resolve_files(options)
    key = split_key(options, split)
    documents = load_documents(datasets, options, files[key], key)
    check_field(documents, options, key)
    if options.streaming:
        dataset: HFPackedDocuments | HFPackedStream = packed_stream(
            documents, options, spec, split, config.DATA.DATASET.VAL_FRACTION, config.EXPERIMENT.SEED
        )
    else:
        tokenized = tokenize_documents(datasets, documents, options, spec)
        dataset = packed_documents(tokenized, options, spec, split, config.DATA.DATASET.VAL_FRACTION)
    dataset.tokenizer_file = spec.path  # final/ ships it with the model
    return dataset
