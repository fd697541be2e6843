"""`linnaeus-accel tokenize` on real files: every input format round-trips, the sidecar describes
what was written, a tokenizer.json tokenizes as ``tokenizers`` does, the output is the same for any
number of workers, an interrupted run leaves nothing that training could read, refused arguments
write nothing, and memory stays flat on a large document."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash
from helpers.configs import REPO
from helpers.in_process import run_cli
from helpers.tokens import SENTENCES, train_tokenizer
from tokenizers import Tokenizer

from linnaeus_accel.data.tokenize import command as tokenize_module
from linnaeus_accel.data.tokenize.command import tokenize_files
from linnaeus_accel.data.tokenize.inputs import text_pieces
from linnaeus_accel.data.tokens import packing
from linnaeus_accel.data.tokens.format import npy_layout, read_sidecar, sidecar_path

EOS = 256


def tokenize(*args: str | Path) -> tuple[int, str, str]:
    return run_cli("tokenize", *map(str, args))


def byte_stream(documents: list[str]) -> np.ndarray[Any, Any]:
    """What byte-level tokenizing ``documents`` must write: each one's UTF-8 bytes, then EOS."""
    parts = [
        np.append(np.frombuffer(doc.encode("utf-8"), dtype=np.uint8).astype(np.uint16), EOS)
        for doc in documents
    ]
    return np.concatenate(parts)


def read_bin(path: Path) -> np.ndarray[Any, Any]:
    sidecar = read_sidecar(path)
    assert sidecar is not None
    return np.fromfile(path, dtype=np.dtype(sidecar.dtype).newbyteorder("<"))


def write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode("utf-8"))
    return path


def jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    return write(path, "".join(json.dumps(record) + "\n" for record in records))


def assert_byte_output(output: Path, documents: list[str]) -> None:
    expected = byte_stream(documents)
    np.testing.assert_array_equal(read_bin(output), expected)
    sidecar = read_sidecar(output)
    assert sidecar is not None
    assert (sidecar.dtype, sidecar.vocab_size, sidecar.eos_id) == ("uint16", 257, EOS)
    assert (sidecar.num_tokens, sidecar.num_documents) == (len(expected), len(documents))
    assert sidecar.max_token_id == int(expected.max())
    assert sidecar.tokenizer == {"type": "bytes"}


def test_txt_files_are_documents(tmp_path: Path) -> None:
    texts = ["line one\r\nline two\n\nno newline at the end: ✓", "naïve café\n"]
    first, second = write(tmp_path / "a.txt", texts[0]), write(tmp_path / "b.txt", texts[1])
    write(tmp_path / "empty.txt", "")  # an empty text is no document
    rc, out, err = tokenize(first, second, tmp_path / "empty.txt", "--output", tmp_path / "out.bin")
    assert rc == 0, err
    assert_byte_output(tmp_path / "out.bin", texts)
    sidecar = read_sidecar(tmp_path / "out.bin")
    assert sidecar is not None
    assert sidecar.sources == [str(first), str(second), str(tmp_path / "empty.txt")]
    assert out == f"2 documents, {sidecar.num_tokens} tokens (uint16) written to {tmp_path / 'out.bin'}\n"


def test_txt_lines_are_documents(tmp_path: Path) -> None:
    # The long line spans pieces of 1 MiB, cut between characters (never inside one, nor in \r\n).
    long_line = "é✓a" * 200_000 + "\r"
    text = f"first\r\n\n  indented\n{long_line}\nlast without newline"
    source = write(tmp_path / "lines.txt", text)
    rc, _, err = tokenize(source, "--text-unit", "line", "--output", tmp_path / "out.bin")
    assert rc == 0, err
    assert_byte_output(tmp_path / "out.bin", ["first", "  indented", long_line[:-1], "last without newline"])


def test_long_text_is_read_in_pieces_and_kept_whole(tmp_path: Path) -> None:
    text = ("ab✓\r\n" * 150_000) + "é" * 700_000 + "\r\n" + "x" * 5
    source = write(tmp_path / "one.txt", text)
    rc, _, err = tokenize(source, "--output", tmp_path / "out.bin")
    assert rc == 0, err
    assert_byte_output(tmp_path / "out.bin", [text])


@pytest.mark.parametrize("piece_bytes", [1, 2, 3, 5, 8])
def test_text_pieces_end_at_newlines_or_between_characters(tmp_path: Path, piece_bytes: int) -> None:
    text = "a\r\nb✓é\r\n\n" + "東京✓" * 3 + "\r\nend"
    handle = io.BytesIO(text.encode("utf-8"))
    pieces = [piece for piece, _ in text_pieces(handle, handle, tmp_path / "a.txt", piece_bytes)]
    assert "".join(pieces) == text
    assert not any(piece.endswith("\r") for piece in pieces)  # a \r\n is never split


def test_jsonl_field_and_json_suffix(tmp_path: Path) -> None:
    records = [
        {"text": "héllo", "body": "first body"},
        {"text": "", "body": "x"},
        {"text": "wörld", "body": ""},
    ]
    source = jsonl(tmp_path / "a.jsonl", records[:2])
    # Blank lines are skipped; .json is read as JSON Lines too.
    write(tmp_path / "b.json", "\n" + json.dumps(records[2]) + "\n\n")
    rc, _, err = tokenize(source, tmp_path / "b.json", "--output", tmp_path / "text.bin")
    assert rc == 0, err
    assert_byte_output(tmp_path / "text.bin", ["héllo", "wörld"])
    rc, _, err = tokenize(source, tmp_path / "b.json", "--field", "body", "--output", tmp_path / "body.bin")
    assert rc == 0, err
    assert_byte_output(tmp_path / "body.bin", ["first body", "x"])


def test_gzip_inputs_read_as_their_contents(tmp_path: Path) -> None:
    text = "gzipped text\nwith two lines ✓"
    records = [{"text": sentence} for sentence in SENTENCES]
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(text.encode("utf-8")))
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(jsonl(tmp_path / "b.jsonl", records).read_bytes()))
    rc, _, err = tokenize(tmp_path / "a.txt.gz", tmp_path / "b.jsonl.gz", "--output", tmp_path / "out.bin")
    assert rc == 0, err
    assert_byte_output(tmp_path / "out.bin", [text, *SENTENCES])


def test_parquet_column(tmp_path: Path) -> None:
    documents = [f"{sentence} ({i})" for i, sentence in enumerate(SENTENCES * 3)]
    table = pa.table({"id": list(range(len(documents))), "content": documents})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=4)  # several row groups
    rc, _, err = tokenize(tmp_path / "a.parquet", "--field", "content", "--output", tmp_path / "out.bin")
    assert rc == 0, err
    assert_byte_output(tmp_path / "out.bin", documents)


def test_glob_is_sorted(tmp_path: Path) -> None:
    (tmp_path / "corpus").mkdir()
    for name in ("c", "a", "b"):
        write(tmp_path / "corpus" / f"{name}.txt", name)
    rc, _, err = tokenize(tmp_path / "corpus" / "*.txt", "--output", tmp_path / "out.bin")
    assert rc == 0, err
    assert_byte_output(tmp_path / "out.bin", ["a", "b", "c"])


def test_npy_output_equals_bin(tmp_path: Path) -> None:
    source = write(tmp_path / "a.txt", "\n".join(SENTENCES))
    assert tokenize(source, "--text-unit", "line", "--output", tmp_path / "out.bin")[0] == 0
    rc, _, err = tokenize(source, "--text-unit", "line", "--output", tmp_path / "sub" / "out.npy")
    assert rc == 0, err
    loaded = np.load(tmp_path / "sub" / "out.npy", mmap_mode="r")
    assert loaded.dtype == np.dtype("<u2")
    np.testing.assert_array_equal(loaded, read_bin(tmp_path / "out.bin"))
    assert npy_layout(tmp_path / "sub" / "out.npy").num_tokens == len(loaded)
    assert read_sidecar(tmp_path / "sub" / "out.npy") == read_sidecar(tmp_path / "out.bin")


def test_byte_vocabulary_is_python_docs_one() -> None:
    assert (tokenize_module.BYTE_EOS, tokenize_module.BYTE_VOCAB_SIZE) == (
        packing.BYTE_EOS,
        packing.BYTE_VOCAB_SIZE,
    )


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_tokenizer(path, "<|endoftext|>")
    return path


def documents_of(tokens: np.ndarray[Any, Any], eos_id: int) -> list[list[int]]:
    assert tokens[-1] == eos_id
    ends = np.flatnonzero(tokens == eos_id)
    return [tokens[start + 1 : end].tolist() for start, end in zip([-1, *ends[:-1]], ends, strict=True)]


def test_tokenizer_json(tmp_path: Path, bpe: Path) -> None:
    documents = [*SENTENCES, "unseen words: Ångström 東京 ✓"]
    source = jsonl(tmp_path / "a.jsonl", [{"text": doc} for doc in documents])
    rc, _, err = tokenize(source, "--tokenizer", bpe, "--output", tmp_path / "out.bin")
    assert rc == 0, err
    tokenizer = Tokenizer.from_file(str(bpe))
    sidecar = read_sidecar(tmp_path / "out.bin")
    assert sidecar is not None
    assert sidecar.eos_id == tokenizer.token_to_id("<|endoftext|>")
    assert sidecar.vocab_size == tokenizer.get_vocab_size(with_added_tokens=True)
    assert sidecar.tokenizer == {
        "type": "tokenizers",
        "path": str(bpe),
        "xxh3_128": xxhash.xxh3_128_hexdigest(bpe.read_bytes()),
    }
    tokens = read_bin(tmp_path / "out.bin")
    assert sidecar.num_tokens == len(tokens)
    assert sidecar.num_documents == len(documents)
    assert sidecar.max_token_id == int(tokens.max())
    ids = documents_of(tokens, sidecar.eos_id)
    assert [tokenizer.decode(doc) for doc in ids] == documents
    assert ids == [tokenizer.encode(doc, add_special_tokens=False).ids for doc in documents]


def test_eos_token(tmp_path: Path, bpe: Path) -> None:
    source = write(tmp_path / "a.txt", SENTENCES[0])
    own = train_tokenizer(tmp_path / "own.json", "[DOC]")
    rc, _, err = tokenize(source, "--tokenizer", tmp_path / "own.json", "--output", tmp_path / "out.bin")
    assert rc == 2
    assert "--eos-token: " in err
    assert "<|endoftext|>" in err
    rc, _, err = tokenize(
        source, "--tokenizer", bpe, "--eos-token", "[DOC]", "--output", tmp_path / "out.bin"
    )
    assert rc == 2
    assert "--eos-token: '[DOC]' is not a token of" in err
    assert not (tmp_path / "out.bin").exists()
    rc, _, err = tokenize(
        source, "--tokenizer", tmp_path / "own.json", "--eos-token", "[DOC]", "--output", tmp_path / "out.bin"
    )
    assert rc == 0, err
    assert read_bin(tmp_path / "out.bin")[-1] == own.token_to_id("[DOC]")


def test_workers_write_the_same_bytes(tmp_path: Path, bpe: Path) -> None:
    records = [{"text": f"{SENTENCES[i % 3]} #{i}\n" * (1 + i % 7)} for i in range(1500)]
    source = jsonl(tmp_path / "a.jsonl", records)
    one = tokenize_files(source, tmp_path / "one.bin", tokenizer=bpe, chunk_chars=2000)
    two = tokenize_files(source, tmp_path / "two.bin", tokenizer=bpe, workers=2, chunk_chars=2000)
    assert one == two
    assert one.num_documents == 1500
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "two.bin").read_bytes()
    # Nor does the chunk size change the output (the default makes this input a single chunk).
    assert tokenize(source, "--tokenizer", bpe, "--output", tmp_path / "default.bin")[0] == 0
    assert (tmp_path / "default.bin").read_bytes() == (tmp_path / "one.bin").read_bytes()


@pytest.fixture(scope="module")
def big_document(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ~60 MB line of text with multi-byte characters and no newline: read in pieces cut
    between characters."""
    path = tmp_path_factory.mktemp("big") / "big.txt"
    block = ("naïve café – Zürich ✓ " * 2000).encode("utf-8")
    with open(path, "wb") as handle:
        for _ in range(60_000_000 // len(block)):
            handle.write(block)
    return path


def command(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "linnaeus_accel", "tokenize", *map(str, args)]


def test_killed_run_leaves_no_output(tmp_path: Path, big_document: Path) -> None:
    output = tmp_path / "out.bin"
    run = subprocess.Popen(command(big_document, "--output", output), cwd=REPO, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (temporaries := [p for p in tmp_path.glob(".out.bin.tmp-*") if p.stat().st_size > 0]):
        assert run.poll() is None, f"finished before it could be killed: {run.communicate()[1]!r}"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    run.kill()
    run.wait()
    assert not output.exists()
    assert not sidecar_path(output).exists()
    assert temporaries[0].exists()
    assert list(tmp_path.glob("*.bin")) == []  # the temporary file is hidden from globs of token files
    rc, _, err = tokenize(big_document, "--output", output)
    assert rc == 0, err
    tokens = np.memmap(output, dtype="<u2", mode="r")
    assert tokens[-1] == EOS
    assert np.array_equal(tokens[:-1], np.memmap(big_document, dtype=np.uint8, mode="r"))
    # The killed run's temporary file is gone.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin", "out.bin.json"]


def test_rerun_removes_what_a_killed_run_left_though_its_pid_still_exists(
    tmp_path: Path, big_document: Path
) -> None:
    """A killed run's pid can outlive it: here a zombie its parent has not reaped yet; as well a
    run in a container (pid 1 there and here) or on another machine. Its temporary file, which no
    live run holds, is still removed by the next run for the same output."""
    output = tmp_path / "out.bin"
    run = subprocess.Popen(command(big_document, "--output", output), cwd=REPO, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".out.bin.tmp-*")):
            assert run.poll() is None, f"finished before it could be killed: {run.communicate()[1]!r}"
            assert time.monotonic() < deadline
            time.sleep(0.005)
        run.kill()
        os.waitid(os.P_PID, run.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: the pid still exists
        small = write(tmp_path / "small.txt", "small")
        rc, _, err = tokenize(small, "--output", output)
        assert rc == 0, err
        assert_byte_output(output, ["small"])
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin", "out.bin.json", "small.txt"]
    finally:
        run.kill()
        run.communicate()


def test_existing_output_is_replaced_only_with_overwrite(tmp_path: Path) -> None:
    first, second = write(tmp_path / "a.txt", "first"), write(tmp_path / "b.txt", "second")
    output = tmp_path / "out.bin"
    assert tokenize(first, "--output", output)[0] == 0
    rc, _, err = tokenize(second, "--output", output)
    assert rc == 2
    assert f"--output: {output} and {sidecar_path(output)} already exist: pass --overwrite" in err
    assert_byte_output(output, ["first"])
    rc, _, err = tokenize(second, "--output", output, "--overwrite")
    assert rc == 0, err
    assert_byte_output(output, ["second"])


BAD_INPUTS = (
    "missing file",
    "unknown suffix",
    "empty glob",
    "jsonl line without field",
    "parquet without column",
    "not UTF-8",
    "no document",
    "truncated gzip",
    "output suffix",
    "eos token without tokenizer",
    "missing tokenizer",
)


def bad_inputs(root: Path) -> dict[str, tuple[list[str | Path], str]]:
    """Arguments, and what the error must say, for each way of refusing them."""
    good = write(root / "good.txt", "text")
    out = root / "out" / "tokens.bin"
    jsonl(root / "no_field.jsonl", [{"text": "a"}, {"body": "b"}])
    (root / "latin1.txt").write_bytes("café".encode("latin-1"))
    write(root / "empty.txt", "")
    whole = gzip.compress(" ".join(map(str, range(5000))).encode("utf-8"))
    (root / "cut.txt.gz").write_bytes(whole[: len(whole) // 2])
    write(root / "table.csv", "text\na\n")
    pq.write_table(pa.table({"body": ["a"]}), root / "a.parquet")
    return {
        "missing file": (
            [root / "missing.txt", "--output", out],
            f"INPUT: {root / 'missing.txt'} does not exist",
        ),
        "unknown suffix": (
            [root / "table.csv", "--output", out],
            f"INPUT: {root / 'table.csv'} is not an input tokenize reads: name a file ending in .txt",
        ),
        "empty glob": (
            [root / "nothing*.txt", "--output", out],
            f"INPUT: the pattern '{root / 'nothing*.txt'}' matches no file",
        ),
        "jsonl line without field": (
            [root / "no_field.jsonl", "--output", out],
            f"--field: {root / 'no_field.jsonl'}:2 has no field 'text'",
        ),
        "parquet without column": (
            [root / "a.parquet", "--output", out],
            f"--field: {root / 'a.parquet'} has no column 'text' (its columns: body)",
        ),
        "not UTF-8": (
            [root / "latin1.txt", "--output", out],
            f"INPUT: {root / 'latin1.txt'} is not UTF-8 text (byte 3): convert it to UTF-8",
        ),
        "no document": ([root / "empty.txt", "--output", out], "INPUT: the inputs hold no document"),
        "truncated gzip": (
            [root / "cut.txt.gz", "--output", out],
            f"INPUT: {root / 'cut.txt.gz'} is not a whole gzip file",
        ),
        "output suffix": (
            [good, "--output", root / "out" / "tokens.txt"],
            f"--output: {root / 'out' / 'tokens.txt'}: name a token file ending in .bin (raw tokens) or .npy",
        ),
        "eos token without tokenizer": (
            [good, "--eos-token", "</s>", "--output", out],
            "--eos-token: applies with --tokenizer only",
        ),
        "missing tokenizer": (
            [good, "--tokenizer", root / "tok.json", "--output", out],
            f"--tokenizer: {root / 'tok.json'} does not exist",
        ),
    }


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_exits_2_writing_nothing(tmp_path: Path, case: str) -> None:
    args, message = bad_inputs(tmp_path)[case]
    rc, out, err = tokenize(*args)
    assert rc == 2
    assert message in err
    assert err.count("invalid arguments") == 1
    assert out == ""
    written = list((tmp_path / "out").iterdir()) if (tmp_path / "out").exists() else []
    assert written == []


def peak_rss_kib(*args: str | Path) -> int:
    """The peak resident memory of one `tokenize` process, measured in a fresh parent whose
    RUSAGE_CHILDREN holds that process alone."""
    measure = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    result = subprocess.run(
        [sys.executable, "-c", measure, *command(*args)], cwd=REPO, capture_output=True, text=True, check=True
    )
    return int(result.stdout)


def test_memory_stays_flat_on_a_large_document(tmp_path: Path, big_document: Path) -> None:
    baseline = peak_rss_kib(write(tmp_path / "tiny.txt", "tiny"), "--output", tmp_path / "tiny.bin")
    peak = peak_rss_kib(big_document, "--output", tmp_path / "big.bin")
    assert os.path.getsize(tmp_path / "big.bin") == 2 * (big_document.stat().st_size + 1)
    # Holding the document whole would take over 4x its 60 MB (bytes, text, bytes again, uint16).
    assert peak - baseline < 100 * 1024, f"{(peak - baseline) / 1024:.0f} MiB above the baseline"
