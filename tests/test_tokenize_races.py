"""`linnaeus-accel tokenize` against another run and an output it cannot write: a run that finishes
after another put the same output in place fails (exit 2) and keeps the other's files, unless
``--overwrite``; an output that cannot be written is one line on stderr, not a traceback."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.configs import REPO
from helpers.in_process import run_cli

from linnaeus_accel.config import ConfigError
from linnaeus_accel.data.tokenize import command as tokenize_module
from linnaeus_accel.data.tokenize.command import tokenize_files
from linnaeus_accel.data.tokenize.output import TokenFileWriter
from linnaeus_accel.data.tokens.format import TokenSidecar, read_sidecar, sidecar_path


def tokenize(*args: str | Path) -> tuple[int, str, str]:
    return run_cli("tokenize", *map(str, args))


def text_file(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def holds(output: Path, text: str) -> None:
    """``output`` is the byte tokens of the single document ``text``, and its sidecar says so."""
    sidecar = read_sidecar(output)
    assert sidecar is not None
    expected = [*text.encode("utf-8"), 256]
    assert np.fromfile(output, dtype="<u2").tolist() == expected
    assert (sidecar.num_tokens, sidecar.num_documents) == (len(expected), 1)


def race(monkeypatch: pytest.MonkeyPatch, *winner: str | Path) -> None:
    """Have the next tokenize run another, ``linnaeus-accel tokenize *winner`` in a process of its
    own, to completion after it tokenized and before it puts its files in place: the window that
    the start's 'exists' check cannot see."""
    encode = tokenize_module.encode_chunks

    def then_the_other_run(*args: Any) -> Iterator[Any]:
        yield from encode(*args)
        command = [sys.executable, "-m", "linnaeus_accel", "tokenize", *map(str, winner)]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr

    monkeypatch.setattr(tokenize_module, "encode_chunks", then_the_other_run)


def test_a_run_finishing_second_keeps_the_first_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    output = tmp_path / "out" / "train.bin"
    race(monkeypatch, text_file(tmp_path / "winner.txt", "winner"), "--output", output)
    rc, out, err = tokenize(text_file(tmp_path / "loser.txt", "loser"), "--output", output)
    assert rc == 2, out + err
    assert f"--output: {output} was written by another run while this one tokenized" in err
    assert f"pass --overwrite to replace {output}" in err
    assert "Traceback" not in err
    holds(output, "winner")
    # Neither the loser's temporary files nor any of its tokens are left.
    assert sorted(p.name for p in output.parent.iterdir()) == ["train.bin", "train.bin.json"]


def test_with_overwrite_the_run_finishing_second_replaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    output = tmp_path / "train.npy"
    race(monkeypatch, text_file(tmp_path / "first.txt", "first"), "--output", output)
    rc, _, err = tokenize(text_file(tmp_path / "second.txt", "second"), "--output", output, "--overwrite")
    assert rc == 0, err
    assert np.load(output).tolist() == [*b"second", 256]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("train", ".train"))) == [
        "train.npy",
        "train.npy.json",
    ]


SIDECAR = TokenSidecar(
    dtype="uint16",
    num_tokens=3,
    num_documents=1,
    vocab_size=257,
    eos_id=256,
    max_token_id=256,
    tokenizer={"type": "bytes"},
    sources=[],
)


def test_a_sidecar_put_in_place_meanwhile_withdraws_the_token_file(tmp_path: Path) -> None:
    """The token file is published first: if the sidecar's name is then taken (by a run with
    --overwrite), this run's token file is taken back and the other's sidecar left alone."""
    output = tmp_path / "train.bin"
    with TokenFileWriter(output, np.dtype("<u2")) as writer:
        writer.write(np.array([1, 2, 256], dtype="<u2"))
        sidecar_path(output).write_text("{}", encoding="utf-8")
        with pytest.raises(ConfigError, match="pass --overwrite") as refused:
            writer.commit(SIDECAR)
    assert f"{sidecar_path(output)} was written by another run" in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.bin.json"]
    assert sidecar_path(output).read_text(encoding="utf-8") == "{}"


def test_two_runs_in_threads_never_both_succeed(tmp_path: Path) -> None:
    """Library callers in threads of one process: distinct temporary files, one winner."""
    from concurrent.futures import ThreadPoolExecutor

    output = tmp_path / "train.bin"
    inputs = [text_file(tmp_path / f"{name}.txt", name * 20_000) for name in ("a", "b", "c", "d")]

    def run(path: Path) -> str:
        try:
            tokenize_files(path, output, progress=False, chunk_chars=4096)
        except ConfigError as exc:
            return str(exc)
        return "ok"

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, inputs))
    assert results.count("ok") == 1, results
    assert all("already exist" in r or "was written by another run" in r for r in results if r != "ok")
    holds(output, inputs[results.index("ok")].read_text(encoding="utf-8"))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".txt")) == [
        "train.bin",
        "train.bin.json",
    ]


def test_output_under_a_file_is_refused_without_a_traceback(tmp_path: Path) -> None:
    source = text_file(tmp_path / "a.txt", "text")
    blocker = text_file(tmp_path / "blocker", "a file, not a directory")
    for output in (blocker / "train.bin", blocker / "sub" / "train.bin"):
        rc, _, err = tokenize(source, "--output", output)
        assert rc == 2, err
        assert f"--output: cannot write {output}: {blocker} is not a directory" in err
        assert "Traceback" not in err
    assert blocker.read_text(encoding="utf-8") == "a file, not a directory"


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs Linux's /sys")
def test_a_directory_that_refuses_writes_is_one_line_naming_it(tmp_path: Path) -> None:
    """/sys refuses new files even to root (whom no mode bits stop): the failure comes from the
    write itself for root, from the start's check for anyone else."""
    output = Path("/sys/linnaeus-tokenize-test.bin")
    rc, _, err = tokenize(text_file(tmp_path / "a.txt", "text"), "--output", output)
    assert rc == 2, err
    assert f"--output: cannot write {output}: " in err
    assert "permission denied" in err.lower()
    assert "Traceback" not in err
    assert not list(Path("/sys").glob(".linnaeus-tokenize-test*"))
