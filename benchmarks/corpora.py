"""Data the data benchmarks write and read: token files with their sidecars, JSON Lines shards of
text, and the memory fields of ``/proc/<pid>/status`` (Linux). Not a benchmark itself."""

from __future__ import annotations

import json
import random
import shutil
import string
from pathlib import Path

MB = 2**20
MEMORY_FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")


def make_token_corpus(path: Path, num_tokens: int, vocab_size: int = 50_257, chunk: int = 2**25) -> Path:
    """``num_tokens`` random uint16 ids below ``vocab_size`` written a chunk at a time (constant
    memory) with ``tofile``, and the sidecar ``tokenize`` would write (``<file>.json``)."""
    import numpy as np

    from linnaeus_accel.data.tokens.format import TokenSidecar, sidecar_path

    rng = np.random.default_rng(0)
    top = -1
    with path.open("wb") as handle:
        for start in range(0, num_tokens, chunk):
            ids = rng.integers(0, vocab_size, min(chunk, num_tokens - start), dtype=np.uint16)
            top = max(top, int(ids.max()))
            ids.tofile(handle)
    tokenizer = {"type": "bytes"} if vocab_size == 257 else {"type": "random", "vocab_size": vocab_size}
    sidecar = TokenSidecar("uint16", num_tokens, 1, vocab_size, vocab_size - 1, top, tokenizer)
    sidecar_path(path).write_text(sidecar.to_json())
    return path


def remove_corpus(path: Path) -> None:
    path.unlink(missing_ok=True)
    Path(f"{path}.json").unlink(missing_ok=True)


def room_mb(directory: Path, keep_free_mb: int = 2048) -> int:
    """MiB that can be written to ``directory`` leaving ``keep_free_mb`` free."""
    return max(0, (shutil.disk_usage(directory).free // MB) - keep_free_mb)


def make_jsonl_shards(
    directory: Path, files: int, documents: int, characters: int, prefix: str = "shard"
) -> list[str]:
    """``files`` JSON Lines files of ``documents`` lines ``{"text": ...}`` each, every text
    ``characters`` ASCII characters of random words (so every file holds the same number of tokens
    under byte-level encoding). Returns the paths, in order."""
    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(4096)]
    paths = []
    directory.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        path = directory / f"{prefix}-{f:03d}.jsonl"
        with path.open("w", encoding="utf-8") as handle:
            for _ in range(documents):
                text = " ".join(rng.choices(words, k=characters // 4))
                text = (text + " " + text)[:characters]
                handle.write(json.dumps({"text": text}) + "\n")
        paths.append(str(path))
    return paths


def memory(pid: int | str = "self") -> dict[str, float]:
    """``VmHWM`` (peak resident), ``VmRSS``, ``RssAnon`` and ``RssFile`` of a process, in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in MEMORY_FIELDS:
            out[name] = int(value.split()[0]) / 1024
    return out
