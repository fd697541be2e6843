"""Token files on disk and the JSON sidecar that describes them.

A token file is a flat array of token ids: raw little-endian ``.bin`` (``uint16`` or ``uint32``, the
layout of nanoGPT's ``train.bin``) or a 1-D NumPy ``.npy`` of any integer type. Its token count comes
from its length (and, for ``.npy``, its header): nothing reads the tokens to size a corpus.

``linnaeus-accel tokenize`` writes ``<file>.json`` beside each token file (``train.bin`` ->
``train.bin.json``): the dtype, the vocabulary, the end-of-document id, the token and document
counts and the largest token id written. ``token_files`` and ``plan`` read it instead of the tokens;
the largest id is what lets a run refuse a model whose vocabulary is too small before it starts.

This module reads and writes the sidecar and finds where a file's tokens are (its dtype, header
length and token count); it needs NumPy only.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SIDECAR_FORMAT = "linnaeus-accel token file"
SIDECAR_VERSION = 1
BIN_DTYPES = ("uint16", "uint32")  # what a raw .bin may hold (its bytes do not say which)
TOKEN_SUFFIXES = (".bin", ".npy")


class TokenFileError(ValueError):
    """A token file, or its sidecar, that cannot be read as the options say."""


class TokenOutOfVocab(TokenFileError):
    """A window holding a token id outside the vocabulary (``token_vocab``): the message names the
    file, the token's offset in it, the id and the vocabulary. The Trainer stops the run on it
    (``RunFailed``), keeping the last checkpoint."""

    def __init__(self, message: str) -> None:
        # Raised in a DataLoader worker, it is rebuilt in the training process from its class and
        # the worker's whole traceback ("Caught TokenOutOfVocab in DataLoader worker process 0.
        # Original Traceback ... token_format.TokenOutOfVocab: <message>"): the message alone is kept.
        marker = f"{__name__}.TokenOutOfVocab: "
        if message.startswith("Caught ") and marker in message:
            message = message.rsplit(marker, 1)[1].strip()
        super().__init__(message)


def sidecar_path(token_file: str | os.PathLike[str]) -> Path:
    path = Path(token_file)
    return path.with_name(path.name + ".json")


def smallest_dtype(vocab_size: int) -> str:
    """The smallest ``.bin`` dtype that holds every id below ``vocab_size``."""
    if vocab_size <= 2**16:
        return "uint16"
    if vocab_size <= 2**32:
        return "uint32"
    raise TokenFileError(f"a vocabulary of {vocab_size} ids does not fit in uint32 token files")


@dataclass(frozen=True)
class TokenSidecar:
    """What ``tokenize`` knows about the token file it wrote (``<file>.json``)."""

    dtype: str
    num_tokens: int
    num_documents: int
    vocab_size: int
    eos_id: int
    max_token_id: int  # -1 for an empty file
    tokenizer: dict[str, Any] = field(
        default_factory=dict
    )  # {"type": "bytes"} or {"type": "tokenizers", ...}
    sources: list[str] = field(default_factory=list)
    format: str = SIDECAR_FORMAT
    version: int = SIDECAR_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def _count(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def parse_sidecar(data: Any, where: str) -> TokenSidecar:
    """A sidecar's JSON, validated: every problem found is named with the file."""
    if not isinstance(data, dict) or data.get("format") != SIDECAR_FORMAT:
        raise TokenFileError(
            f"{where} is not a linnaeus-accel token-file sidecar (no format {SIDECAR_FORMAT!r})"
        )
    if not _count(data.get("version"), 1) or data["version"] > SIDECAR_VERSION:
        raise TokenFileError(
            f"{where} has sidecar version {data.get('version')!r}; this linnaeus-accel reads up to "
            f"version {SIDECAR_VERSION}: upgrade linnaeus-accel or tokenize again"
        )
    problems = []
    if data.get("dtype") not in BIN_DTYPES:
        problems.append(f"dtype {data.get('dtype')!r} (expected one of {', '.join(BIN_DTYPES)})")
    for name in ("num_tokens", "num_documents"):
        if not _count(data.get(name)):
            problems.append(f"{name} {data.get(name)!r} (expected an int >= 0)")
    if not _count(data.get("vocab_size"), 1):
        problems.append(f"vocab_size {data.get('vocab_size')!r} (expected an int >= 1)")
    for name in ("eos_id", "max_token_id"):
        if not _count(data.get(name), -1):
            problems.append(f"{name} {data.get(name)!r} (expected an int)")
    if problems:
        raise TokenFileError(f"{where} is damaged: {'; '.join(problems)}")
    known = set(TokenSidecar.__dataclass_fields__)
    return TokenSidecar(**{k: v for k, v in data.items() if k in known})


def read_sidecar(token_file: str | os.PathLike[str]) -> TokenSidecar | None:
    """The sidecar of ``token_file``; None when it has none."""
    path = sidecar_path(token_file)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokenFileError(f"{path} is not valid JSON ({exc})") from None
    return parse_sidecar(data, str(path))


@dataclass(frozen=True)
class TokenFileLayout:
    """Where the tokens of one file are: enough to memory-map it, found from its header and length."""

    path: str
    dtype: str  # NumPy dtype name, e.g. "uint16"
    offset: int  # bytes before the first token (the .npy header)
    num_tokens: int


def npy_layout(path: Path) -> TokenFileLayout:
    """A ``.npy`` file's dtype, header length and token count, from its header alone."""
    with open(path, "rb") as handle:
        try:
            version = np.lib.format.read_magic(handle)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read_header(handle)  # the order flag does not matter in 1-D
        except ValueError as exc:
            raise TokenFileError(f"{path} is not a NumPy .npy file: {exc}") from None
        offset = handle.tell()
    if len(shape) != 1 or dtype.kind not in "iu" or dtype.hasobject:
        raise TokenFileError(
            f"{path} holds a {dtype} array of shape {shape}: a token file is a 1-D array of integers"
        )
    if dtype.byteorder == ">":
        raise TokenFileError(
            f"{path} is big-endian ({dtype}): save it little-endian (e.g. arr.astype('<u2'))"
        )
    expected = offset + shape[0] * dtype.itemsize
    actual = path.stat().st_size
    if actual != expected:
        raise TokenFileError(
            f"{path} is {actual} bytes but its header says {shape[0]} tokens of {dtype} ({expected} bytes): "
            "the file is truncated or damaged"
        )
    return TokenFileLayout(str(path), dtype.newbyteorder("<").name, offset, int(shape[0]))


def bin_layout(path: Path, dtype: str, from_sidecar: bool = False) -> TokenFileLayout:
    """A raw ``.bin`` file of ``dtype`` tokens (``from_sidecar``: as its sidecar says): its count is
    its length over the dtype's size."""
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size % itemsize:
        said = f"; its sidecar, {sidecar_path(path)}, says {dtype}" if from_sidecar else ""
        raise TokenFileError(
            f"{path} is {size} bytes, not a multiple of {itemsize} ({dtype} tokens{said}): the file is truncated, "
            f"or its dtype is not {dtype} (a uint16 file is read as uint32 only when its length happens to be even)"
        )
    return TokenFileLayout(str(path), dtype, 0, size // itemsize)
