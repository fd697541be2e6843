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
number of workers. The files appear whole or not at all: both are written to hidden temporary names
and moved into place at the end, the token file first; an interrupted run leaves neither, and the
next run for the same output removes its temporary files. Without ``overwrite`` the move itself
refuses an existing file (a hard link, which fails atomically where the name is taken): of two runs
writing the same output at once, the later one to finish fails and removes its files, whatever the
other left in place. An output that cannot be written is a ``ConfigError``, not a traceback.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import secrets
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, BinaryIO, NamedTuple

import numpy as np
import xxhash
from numpy.typing import NDArray
from tqdm import tqdm

from ..config import ConfigError
from ..durable_files import fsync_directory
from .token_format import TOKEN_SUFFIXES, TokenSidecar, sidecar_path, smallest_dtype
from .tokenize_inputs import (
    DATA_EXTRA,
    Chunk,
    TextUnit,
    argument_error,
    parquet_problems,
    read_chunks,
    resolve_inputs,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# packing.BYTE_EOS and BYTE_VOCAB_SIZE (a test checks): importing packing would load torch, two
# seconds of a command that never needs it.
BYTE_EOS = 256
BYTE_VOCAB_SIZE = 257
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
CHUNK_CHARS = 4 * 2**20  # text a worker encodes at a time
NPY_HEADER_BYTES = 128  # room for any token count, so the header is rewritten in place at the end


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


def _npy_header(dtype: np.dtype[Any], num_tokens: int) -> bytes:
    """A .npy (version 1.0) header of ``NPY_HEADER_BYTES`` whatever ``num_tokens``."""
    text = f"{{'descr': '{dtype.str}', 'fortran_order': False, 'shape': ({num_tokens},), }}"
    text = text.ljust(NPY_HEADER_BYTES - 11) + "\n"  # 10 bytes of magic, version and length before it
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode("latin1")


def _temporary(path: Path, tag: str) -> Path:
    # Hidden, and ending in neither .bin nor .npy: no glob of token files matches it. The pid says
    # whether its run is alive; the tag tells apart two runs of one process (threads).
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{tag}")


def remove_stale_temporaries(output: Path) -> None:
    """Remove the temporary files that killed runs for ``output`` left; a live run keeps its own."""
    for final in (output, sidecar_path(output)):
        prefix = f".{final.name}.tmp-"
        for entry in os.scandir(final.parent):
            pid = entry.name[len(prefix) :].split("-", 1)[0]
            if entry.name.startswith(prefix) and pid.isdecimal() and not _alive(int(pid)):
                Path(entry.path).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


@contextmanager
def writing(output: Path) -> Iterator[None]:
    """An ``OSError`` while writing ``output`` (a directory that cannot be written, a full disk)
    as a ``ConfigError`` naming the output and the reason."""
    try:
        yield
    except OSError as exc:
        failed = "" if exc.filename is None or str(exc.filename) == str(output) else f" ({exc.filename})"
        reason = exc.strerror or str(exc)
        raise argument_error(
            "--output", f"cannot write {output}: {reason}{failed}: choose an output you can write"
        ) from None


class TokenFileWriter:
    """Writes ``output`` and its sidecar to temporary files, and moves both into place on
    ``commit``; leaving the ``with`` block without a commit removes them. Without ``overwrite``,
    ``commit`` refuses (``ConfigError``) an output that another run put in place meanwhile."""

    def __init__(self, output: Path, dtype: np.dtype[Any], overwrite: bool = False) -> None:
        self.output, self.dtype, self.num_tokens, self.overwrite = output, dtype, 0, overwrite
        tag = secrets.token_hex(4)
        self.temporary = _temporary(output, tag)
        self.sidecar_temporary = _temporary(sidecar_path(output), tag)
        self.npy = output.suffix == ".npy"
        self.file: BinaryIO | None = None

    def __enter__(self) -> TokenFileWriter:
        try:
            with writing(self.output):
                self.file = open(self.temporary, "wb")
                if self.npy:
                    self.file.write(_npy_header(self.dtype, 0))  # the count is known only at the end
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def write(self, tokens: NDArray[Any]) -> None:
        assert self.file is not None, "write outside the with block"
        with writing(self.output):
            self.file.write(tokens.data)
        self.num_tokens += len(tokens)

    def commit(self, sidecar: TokenSidecar) -> None:
        """Both files whole on disk, then in place: the token file first, after the old sidecar is
        gone, so that no sidecar ever describes another file."""
        assert self.file is not None, "commit outside the with block"
        with writing(self.output):
            if self.npy:
                self.file.seek(0)
                self.file.write(_npy_header(self.dtype, self.num_tokens))
            _sync(self.file)
            self.file.close()
            with open(self.sidecar_temporary, "w", encoding="utf-8") as handle:
                handle.write(sidecar.to_json())
                _sync(handle)
            if self.overwrite:
                sidecar_path(self.output).unlink(missing_ok=True)
                fsync_directory(self.output.parent)
                os.replace(self.temporary, self.output)
                os.replace(self.sidecar_temporary, sidecar_path(self.output))
            else:
                self._publish_new()
            fsync_directory(self.output.parent)

    def _publish_new(self) -> None:
        """Both files in place under names that must still be free: another run that put either
        in place since this one started wins, and this one fails having replaced nothing."""
        sidecar = sidecar_path(self.output)
        try:
            _link_new(self.temporary, self.output)
        except FileExistsError:
            raise self._taken(self.output) from None
        try:
            _link_new(self.sidecar_temporary, sidecar)
        except FileExistsError:
            # Only a run with overwrite puts a sidecar beside a token file it did not write: the
            # token file is then most likely its own too, and left alone unless still this one's.
            if _same_file(self.temporary, self.output):
                self.output.unlink(missing_ok=True)
            raise self._taken(sidecar) from None

    def _taken(self, path: Path) -> ConfigError:
        return argument_error(
            "--output",
            f"{path} was written by another run while this one tokenized: it is left as it is and "
            f"nothing of this run is kept; pass --overwrite to replace {self.output}",
        )

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.file is not None:
            self.file.close()
        self.temporary.unlink(missing_ok=True)  # after a commit, neither exists any more
        self.sidecar_temporary.unlink(missing_ok=True)


def _sync(handle: IO[Any]) -> None:
    handle.flush()
    os.fsync(handle.fileno())


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


# link() errors of a file system without hard links (FAT, some network and FUSE file systems).
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS}


def _link_new(source: Path, target: Path) -> None:
    """``source`` also named ``target``, which must not exist (``FileExistsError``): a hard link
    fails atomically where the name is taken. Without hard links, the name is claimed by creating
    it exclusively, then replaced by ``source``."""
    try:
        os.link(source, target)
        return
    except OSError as exc:
        if isinstance(exc, FileExistsError) or exc.errno not in _NO_HARD_LINKS:
            raise
    os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    os.replace(source, target)


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
    problems += _output_problems(path, overwrite)
    if text_unit not in ("file", "line"):
        problems.append(("--text-unit", f"must be 'file' or 'line' (got {text_unit!r})"))
    if workers < 1:
        problems.append(("--workers", f"must be >= 1 (got {workers})"))
    if problems:
        raise ConfigError(problems, source="arguments")
    spec = tokenizer_spec(tokenizer, eos_token)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path)
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


def _output_problems(output: Path, overwrite: bool) -> list[tuple[str, str]]:
    if output.suffix not in TOKEN_SUFFIXES:
        return [("--output", f"{output}: name a token file ending in .bin (raw tokens) or .npy")]
    if output.is_dir():
        return [("--output", f"{output} is a directory: name the token file to write in it")]
    if (unwritable := _unwritable(output)) is not None:
        return [("--output", unwritable)]
    existing = [str(path) for path in (output, sidecar_path(output)) if path.exists()]
    if existing and not overwrite:
        return [("--output", f"{' and '.join(existing)} already exist: pass --overwrite to replace them")]
    return []


def _unwritable(output: Path) -> str | None:
    """Why ``output`` cannot be created, as far as its nearest existing directory tells: a file
    where a directory must be, or a directory this process may not write (root may write any)."""
    existing = output.parent
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot write {output}: {existing} is not a directory: choose another output"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot write {output}: {existing} is not writable (permission denied): choose an output you can write"
    return None
