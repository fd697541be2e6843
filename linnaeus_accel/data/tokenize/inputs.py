"""The corpora ``linnaeus-accel tokenize`` reads, streamed as documents in constant memory.

- ``.txt`` (and ``.txt.gz``): UTF-8 text; each file is one document, or with ``text_unit="line"``
  each non-empty line (without its ``\\n`` or ``\\r\\n``);
- ``.jsonl`` / ``.json`` (and ``.gz``): JSON Lines, one object a line, the document its ``field``
  (blank lines are skipped);
- ``.parquet``: the ``field`` column, one string a row (needs pyarrow, the ``data`` extra).

An empty text is not a document: it would add nothing but an end-of-document token.

Text is never held whole: a ``.txt`` document comes in pieces of about ``PIECE_BYTES``, each cut
after a newline (or, in a line longer than a piece, between two characters). A JSON line or a
Parquet value is one piece, as it is one value in its file. ``read_chunks`` groups the pieces of
every input, in order, into the chunks that a worker encodes at a time.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from ...config import ConfigError

PIECE_BYTES = 2**20
PARQUET_BATCH_ROWS = 1024  # rows a read: documents can be long, so not pyarrow's 65536
DATA_EXTRA = "pip install 'linnaeus-accel[data]'"
TextUnit = Literal["file", "line"]
Kind = Literal["text", "jsonl", "parquet"]
KINDS: dict[str, Kind] = {
    ".txt": "text",
    ".txt.gz": "text",
    ".jsonl": "jsonl",
    ".jsonl.gz": "jsonl",
    ".json": "jsonl",
    ".json.gz": "jsonl",
    ".parquet": "parquet",
}


def argument_error(key: str, message: str) -> ConfigError:
    """A refused command-line argument: printed once, exit status 2."""
    return ConfigError([(key, message)], source="arguments")


@dataclass(frozen=True)
class Source:
    """One input file: how to read it, and its size on disk (what progress counts)."""

    path: Path
    kind: Kind
    compressed: bool
    size: int


@dataclass
class Chunk:
    """Pieces of documents that one worker encodes, and the input bytes read for them."""

    texts: list[str]
    ends: list[bool]  # ends[i]: an end-of-document token follows texts[i]
    input_bytes: int


class Piece(NamedTuple):
    """Text of one document; the document ends with the piece whose ``ends_document`` is set."""

    text: str
    ends_document: bool
    offset: int  # bytes of the file on disk read so far: where progress stands


def resolve_inputs(patterns: Sequence[str | os.PathLike[str]]) -> tuple[list[Source], list[tuple[str, str]]]:
    """The files that ``patterns`` name (a glob pattern expands to its matches, sorted), and the
    problems found: a missing file, an unknown suffix, a pattern that matches nothing."""
    if not patterns:
        return [], [("INPUT", "no input given: name at least one file or glob pattern")]
    sources: list[Source] = []
    problems: list[tuple[str, str]] = []
    for pattern in [os.fspath(pattern) for pattern in patterns]:
        # A pattern, unless a file has that very name (brackets are allowed in file names).
        if any(char in pattern for char in "*?[") and not os.path.lexists(pattern):
            paths = [Path(match) for match in sorted(glob.glob(pattern, recursive=True))]
            if not paths:
                problems.append(("INPUT", f"the pattern {pattern!r} matches no file"))
        else:
            paths = [Path(pattern)]
        for path in paths:
            found = _source(path)
            if isinstance(found, str):
                problems.append(("INPUT", found))
            else:
                sources.append(found)
    return sources, problems


def _source(path: Path) -> Source | str:
    """The file as a ``Source``, or why it cannot be read."""
    if not path.is_file():
        return f"{path} is not a file" if path.exists() else f"{path} does not exist"
    name = path.name.lower()
    # Longest first: .json.gz, not .gz alone.
    suffix = next((s for s in sorted(KINDS, key=len, reverse=True) if name.endswith(s)), None)
    if suffix is None:
        return f"{path} is not an input tokenize reads: name a file ending in {', '.join(KINDS)}"
    return Source(path, KINDS[suffix], suffix.endswith(".gz"), path.stat().st_size)


def parquet_problems(sources: Iterable[Source], field: str) -> list[tuple[str, str]]:
    """Problems with the Parquet inputs, found from their schemas alone: pyarrow missing, no
    string column ``field``, not a Parquet file."""
    parquet = [source for source in sources if source.kind == "parquet"]
    if not parquet:
        return []
    try:
        import pyarrow as pa  # type: ignore[import-untyped]
        import pyarrow.parquet as pq  # type: ignore[import-untyped]
    except ImportError:
        return [("INPUT", f"reading .parquet needs pyarrow: {DATA_EXTRA}")]
    problems = []
    for source in parquet:
        try:
            schema = pq.read_schema(source.path)
        except (OSError, pa.ArrowException) as exc:
            problems.append(("INPUT", f"{source.path} cannot be read as Parquet: {exc}"))
            continue
        if field not in schema.names:
            columns = ", ".join(schema.names)
            problems.append(("--field", f"{source.path} has no column {field!r} (its columns: {columns})"))
            continue
        column = schema.field(field).type
        if not (pa.types.is_string(column) or pa.types.is_large_string(column)):
            problems.append(("--field", f"{source.path}: column {field!r} holds {column}, not strings"))
    return problems


def read_chunks(
    sources: Iterable[Source], field: str, text_unit: TextUnit, chunk_chars: int
) -> Iterator[Chunk]:
    """The documents of every source, in order, in chunks of about ``chunk_chars`` characters."""
    chunk, chars = Chunk([], [], 0), 0
    for source in sources:
        offset = 0  # of the source on disk, counted in chunk.input_bytes
        for piece in read_pieces(source, field, text_unit):
            chunk.texts.append(piece.text)
            chunk.ends.append(piece.ends_document)
            chunk.input_bytes += piece.offset - offset
            offset = piece.offset
            chars += len(piece.text)
            if chars >= chunk_chars:
                yield chunk
                chunk, chars = Chunk([], [], 0), 0
        chunk.input_bytes += source.size - offset  # what followed the last document (blank lines)
    yield chunk


def read_pieces(source: Source, field: str, text_unit: TextUnit) -> Iterator[Piece]:
    """The documents of ``source``, in file order, as pieces of text.

    A malformed input (text not UTF-8, a JSON line without a string ``field``, a damaged file)
    raises a ``ConfigError`` naming the file, and the line where there is one."""
    if source.kind == "parquet":
        yield from _parquet_pieces(source, field)
        return
    with open(source.path, "rb") as raw:
        handle: io.BufferedIOBase = gzip.GzipFile(fileobj=raw, mode="rb") if source.compressed else raw
        try:
            if source.kind == "jsonl":
                yield from _jsonl_pieces(handle, raw, source.path, field)
            elif text_unit == "line":
                yield from _line_pieces(text_pieces(handle, raw, source.path))
            else:
                yield from _file_pieces(text_pieces(handle, raw, source.path))
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise argument_error("INPUT", f"{source.path} is not a whole gzip file ({exc})") from None


def text_pieces(
    handle: io.BufferedIOBase, raw: io.BufferedIOBase, path: Path, piece_bytes: int = PIECE_BYTES
) -> Iterator[tuple[str, int]]:
    """The text of ``handle`` as (piece, offset of ``raw``), pieces of about ``piece_bytes`` that
    each end after their last newline, or where there is none, between two characters (never
    inside a ``\\r\\n``). Joined, the pieces are the whole text."""
    carry = b""
    decoded = 0  # bytes before `carry`: where a decoding error is
    while data := handle.read(piece_bytes):
        buffer = carry + data
        cut = _cut(buffer)
        if cut:
            yield _decode(buffer[:cut], path, decoded), raw.tell()
            decoded += cut
        carry = buffer[cut:]
    if carry:
        yield _decode(carry, path, decoded), raw.tell()


def _cut(buffer: bytes) -> int:
    """Where a piece of ``buffer`` ends: after the last newline (a newline byte is never inside a
    multi-byte character), else before the first byte of the last character, which may be incomplete."""
    newline = buffer.rfind(b"\n")
    if newline >= 0:
        return newline + 1
    cut = len(buffer) - 1
    while cut > 0 and buffer[cut] & 0xC0 == 0x80:  # 10xxxxxx: a continuation byte
        cut -= 1
    # A \r may be half of a \r\n that the next read completes: line mode strips \r\n as one.
    return cut - 1 if cut > 0 and buffer[cut - 1] == ord("\r") else cut


def _decode(data: bytes, path: Path, start: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        message = f"{path} is not UTF-8 text (byte {start + exc.start}): convert it to UTF-8"
        raise argument_error("INPUT", message) from None


def _file_pieces(blocks: Iterator[tuple[str, int]]) -> Iterator[Piece]:
    """The whole text as one document: its last piece ends it."""
    previous: tuple[str, int] | None = None
    for block in blocks:
        if previous is not None:
            yield Piece(previous[0], False, previous[1])
        previous = block
    if previous is not None:
        yield Piece(previous[0], True, previous[1])


def _line_pieces(blocks: Iterator[tuple[str, int]]) -> Iterator[Piece]:
    """Each non-empty line a document; a line longer than a block comes in several pieces."""
    continued = False  # the line under way began in an earlier block
    offset = 0
    for block, offset in blocks:
        *lines, rest = block.split("\n")
        for line in lines:
            text = line.removesuffix("\r")
            if text or continued:
                yield Piece(text, True, offset)
            continued = False
        if rest:
            yield Piece(rest, False, offset)
            continued = True
    if continued:  # the last line has no newline
        yield Piece("", True, offset)


def _jsonl_pieces(
    handle: io.BufferedIOBase, raw: io.BufferedIOBase, path: Path, field: str
) -> Iterator[Piece]:
    for number, line in enumerate(handle, 1):
        if line.strip() and (text := _json_text(line, field, f"{path}:{number}")):
            yield Piece(text, True, raw.tell())


def _json_text(line: bytes, field: str, where: str) -> str:
    try:
        record: Any = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        message = f"{where} is not JSON ({exc}): .json and .jsonl inputs are JSON Lines, one object a line"
        raise argument_error("INPUT", message) from None
    if not isinstance(record, dict):
        raise argument_error("INPUT", f"{where} is a JSON {type(record).__name__}, not an object")
    if field not in record:
        keys = ", ".join(map(str, record)) or "none"
        raise argument_error(
            "--field", f"{where} has no field {field!r} (its fields: {keys}): name it with --field"
        )
    text = record[field]
    if not isinstance(text, str):
        raise argument_error(
            "--field", f"{where}: field {field!r} holds a {type(text).__name__}, not a string"
        )
    return text


def _parquet_pieces(source: Source, field: str) -> Iterator[Piece]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(source.path)
        rows, done = max(parquet.metadata.num_rows, 1), 0
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
            values = batch.column(0)
            if values.null_count:
                row = done + values.is_null().to_pylist().index(True)
                raise argument_error(
                    "--field", f"{source.path}: row {row} of column {field!r} is null, not a string"
                )
            done += len(values)
            yield from (Piece(text, True, source.size * done // rows) for text in values.to_pylist() if text)
    except (OSError, pa.ArrowException) as exc:
        raise argument_error("INPUT", f"{source.path} cannot be read as Parquet: {exc}") from None
