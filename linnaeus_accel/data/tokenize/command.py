"""``linnaeus-accel tokenize``: text corpora to a token file that training memory-maps.

``tokenize_files(["corpus/*.jsonl"], "data/train.bin")`` reads the inputs in order (see
``tokenize_inputs`` for the formats), encodes each document and writes its tokens followed by an
end-of-document token (doc EOS doc EOS ...) to ``train.bin`` (raw little-endian ``uint16``, or
``uint32`` for a vocabulary over 65536) or ``train.npy`` (the same tokens as a 1-D ``.npy``), and
the sidecar ``train.bin.json`` that says what it holds (``token_format.TokenSidecar``).

Tokens are UTF-8 bytes by default (ids 0-255, end of document 256, a vocabulary of 257: that of
the ``python_docs`` dataset), or those of a Hugging Face ``tokenizer.json`` (needs ``tokenizers``,
the ``data`` extra). Two things differ from encoding each document in one call:

- a ``.txt`` document is read in pieces of about 1 MiB, cut after a newline, and each piece is
  encoded alone; a BPE merge across a cut can therefore differ (a different but equally valid
  tokenization), while the decoded text is identical;
- as ``tokenizers`` does, text that spells one of the tokenizer's added tokens (e.g. a literal
  ``<|endoftext|>``) is encoded as that token.

Memory stays constant however large the input: ``workers`` processes encode chunks of about
``CHUNK_CHARS`` characters, at most two chunks each in flight, and the output is the same for any
number of workers. The files appear whole or not at all, an existing output is replaced only with
``overwrite`` (also one that another run puts in place meanwhile), and an output that cannot be
written is a ``ConfigError``, not a traceback: ``tokenize_output`` writes them.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import xxhash
from numpy.typing import NDArray
from tqdm import tqdm

from ...config import ConfigError
from ..tokens.format import TokenSidecar, smallest_dtype
from .inputs import (
    DATA_EXTRA,
    Chunk,
    TextUnit,
    argument_error,
    parquet_problems,
    read_chunks,
    resolve_inputs,
)
from .output import TokenFileWriter, output_problems, prepare_output_directory

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# packing.BYTE_EOS and BYTE_VOCAB_SIZE (a test checks): importing packing would load torch, two
# seconds of a command that never needs it.
BYTE_EOS = 256
BYTE_VOCAB_SIZE = 257
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
CHUNK_CHARS = 4 * 2**20  # text a worker encodes at a time


@dataclass(frozen=True)
class TokenizerSpec:
    """What encodes the text; small and picklable, so each worker process loads the tokenizer itself."""

    path: str | None  # an absolute tokenizer.json path; None: UTF-8 bytes
    digest: str | None  # xxh3_128 of the tokenizer.json
    eos_id: int
    vocab_size: int

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(smallest_dtype(self.vocab_size)).newbyteorder("<")

    def describe(self) -> dict[str, Any]:
        """The sidecar's ``tokenizer`` entry."""
        if self.path is None:
            return {"type": "bytes"}
        return {"type": "tokenizers", "path": self.path, "xxh3_128": self.digest}


def tokenizer_spec(path: str | os.PathLike[str] | None, eos_token: str | None) -> TokenizerSpec:
    """UTF-8 bytes when ``path`` is None, else the tokenizer.json at ``path``, its end-of-document
    token ``eos_token`` or else the first of ``EOS_CANDIDATES`` it has."""
    if path is None:
        if eos_token is not None:
            raise argument_error(
                "--eos-token", f"applies with --tokenizer only: bytes end a document with {BYTE_EOS}"
            )
        return TokenizerSpec(None, None, BYTE_EOS, BYTE_VOCAB_SIZE)
    file = Path(path).absolute()
    tokenizer = load_tokenizer(file)
    eos_id = _eos_id(tokenizer, eos_token, file)
    # Ids need not be dense (an added token may leave a gap): the vocabulary holds the largest.
    vocab_size = max(
        tokenizer.get_vocab_size(with_added_tokens=True), max(tokenizer.get_vocab().values()) + 1
    )
    return TokenizerSpec(str(file), xxhash.xxh3_128_hexdigest(file.read_bytes()), eos_id, vocab_size)


def load_tokenizer(path: Path) -> Tokenizer:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise argument_error(
            "--tokenizer", f"a tokenizer.json needs the tokenizers package: {DATA_EXTRA}"
        ) from None
    if not path.is_file():
        raise argument_error("--tokenizer", f"{path} does not exist")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for any file it cannot parse
        raise argument_error("--tokenizer", f"{path} is not a Hugging Face tokenizer.json ({exc})") from None


def _eos_id(tokenizer: Tokenizer, eos_token: str | None, path: Path) -> int:
    for token in (eos_token,) if eos_token is not None else EOS_CANDIDATES:
        if (eos_id := tokenizer.token_to_id(token)) is not None:
            return eos_id
    if eos_token is not None:
        raise argument_error(
            "--eos-token", f"{eos_token!r} is not a token of {path}: name its end-of-document token"
        )
    tried = ", ".join(EOS_CANDIDATES)
    raise argument_error(
        "--eos-token", f"{path} has none of {tried}: name its end-of-document token with --eos-token"
    )


class Encoded(NamedTuple):
    """A chunk's tokens, end-of-document tokens included, and what the sidecar and progress count."""

    tokens: NDArray[Any]
    documents: int
    max_token_id: int  # -1 when there are no tokens
    input_bytes: int


class Encoder:
    """Encodes chunks with the tokenizer of a ``TokenizerSpec``."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.dtype = spec.dtype
        self.eos = np.array([spec.eos_id], dtype=self.dtype)
        self.tokenizer = None if spec.path is None else load_tokenizer(Path(spec.path))

    def _ids(self, texts: list[str]) -> list[NDArray[Any]]:
        if self.tokenizer is None:
            return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(self.dtype) for text in texts]
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.array(encoding.ids, dtype=self.dtype) for encoding in encodings]

    def __call__(self, chunk: Chunk) -> Encoded:
        parts = []
        for ids, ends in zip(self._ids(chunk.texts), chunk.ends, strict=True):
            parts.append(ids)
            if ends:
                parts.append(self.eos)
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)
        max_id = int(tokens.max()) if len(tokens) else -1
        return Encoded(tokens, sum(chunk.ends), max_id, chunk.input_bytes)


_worker_encoder: Encoder | None = None


def _start_worker(spec: TokenizerSpec) -> None:
    global _worker_encoder
    # Ctrl-C reaches the whole process group: the main process alone handles it, stopping the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # N processes already keep N cores busy: tokenizers' own threads in each would only contend.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # A worker whose parent was killed (kill -9) would otherwise wait for work forever.
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    _worker_encoder = Encoder(spec)


def _exit_with(parent: multiprocessing.process.BaseProcess) -> None:
    parent.join()
    os._exit(1)


def _encode_in_worker(chunk: Chunk) -> Encoded:
    assert _worker_encoder is not None, "started without _start_worker"
    return _worker_encoder(chunk)


def encode_chunks(chunks: Iterator[Chunk], spec: TokenizerSpec, workers: int) -> Iterator[Encoded]:
    """The chunks encoded, in order, by ``workers`` processes (by this one for 1)."""
    if workers == 1:
        yield from map(Encoder(spec), chunks)
        return
    # Spawned, not forked: a fork would copy this process's threads' locks (tqdm's monitor, the
    # tokenizer's thread pool) in whatever state they are.
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=(spec,))
    # Submitted as the results are written, at most two a worker ahead: Executor.map (like
    # Pool.imap) would read every chunk of the input first.
    pending: deque[Future[Encoded]] = deque()
    # On Ctrl-C (which workers leave to this process) the chunks the workers hold are finished
    # first: an executor cannot stop them; with a few MiB each, that is a second or two.
    try:
        for chunk in chunks:
            pending.append(pool.submit(_encode_in_worker, chunk))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(cancel_futures=True)


def tokenize_files(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    eos_token: str | None = None,
    field: str = "text",
    text_unit: TextUnit = "file",
    workers: int = 1,
    overwrite: bool = False,
    progress: bool = True,
    chunk_chars: int = CHUNK_CHARS,
) -> TokenSidecar:
    """Tokenize ``inputs`` (files or glob patterns) into the token file ``output`` (``.bin`` or
    ``.npy``) and its sidecar, and return the sidecar.

    ``tokenizer``: a tokenizer.json (default: UTF-8 bytes); ``eos_token``: its end-of-document
    token (default: the first of ``EOS_CANDIDATES`` it has); ``field``: the text of a JSON Lines
    object or the Parquet column; ``text_unit``: a ``.txt`` document is a whole file or a line;
    ``workers``: processes that encode; ``chunk_chars``: text sent to one at a time (neither
    changes the output); ``progress``: a progress bar on stderr when it is a terminal. An
    existing ``output`` is replaced only with ``overwrite``: without it, an output that another
    run puts in place while this one tokenizes is kept, and this run fails.

    Raises ``ConfigError`` (keyed by the command-line argument) for inputs or options that cannot
    be used, before anything is written; and for malformed inputs met while tokenizing, an output
    that cannot be written or was taken meanwhile, leaving no file behind.
    """
    patterns = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    path = Path(output)
    sources, problems = resolve_inputs(patterns)
    problems += parquet_problems(sources, field)
    problems += output_problems(path, overwrite)
    if text_unit not in ("file", "line"):
        problems.append(("--text-unit", f"must be 'file' or 'line' (got {text_unit!r})"))
    if workers < 1:
        problems.append(("--workers", f"must be >= 1 (got {workers})"))
    if problems:
        raise ConfigError(problems, source="arguments")
    spec = tokenizer_spec(tokenizer, eos_token)
    prepare_output_directory(path)
    shown = progress and sys.stderr.isatty()
    bar = tqdm(
        total=sum(s.size for s in sources),
        desc="tokenize",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not shown,
        file=sys.stderr,
    )
    with bar, TokenFileWriter(path, spec.dtype, overwrite) as writer:
        documents, max_id, started = 0, -1, time.monotonic()
        for encoded in encode_chunks(read_chunks(sources, field, text_unit, chunk_chars), spec, workers):
            writer.write(encoded.tokens)
            documents += encoded.documents
            max_id = max(max_id, encoded.max_token_id)
            rate = writer.num_tokens / max(time.monotonic() - started, 1e-6)
            bar.set_postfix_str(f"{rate:,.0f} tokens/s", refresh=False)
            bar.update(encoded.input_bytes)
        if not documents:
            raise argument_error(
                "INPUT", "the inputs hold no document: every file, line or text field is empty"
            )
        sidecar = TokenSidecar(
            dtype=spec.dtype.name,
            num_tokens=writer.num_tokens,
            num_documents=documents,
            vocab_size=spec.vocab_size,
            eos_id=spec.eos_id,
            max_token_id=max_id,
            tokenizer=spec.describe(),
            sources=[str(source.path.absolute()) for source in sources],
        )
        writer.commit(sidecar)
    return sidecar
