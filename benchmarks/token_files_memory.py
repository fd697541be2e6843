"""Resident memory and start-up time of ``TokenFiles``: ``python -m benchmarks.token_files_memory``
from the repository root (not part of ``python -m benchmarks``: it measures memory, not time
against a reference, and writes a corpus of several GB).

Each case runs in a fresh interpreter, so that its peak is its own: it builds ``TokenFiles`` over
one uint16 ``.bin`` with its sidecar (random ids, as ``tokenize`` would write them), then reads
10,000 random windows of 1025 tokens through a DataLoader (batches of 16) with 0 or 2 workers. It
reports ``RssAnon``, ``RssFile`` and ``VmHWM`` (MiB, from ``/proc/<pid>/status``) of the main
process after the imports, after construction and after the reads, and of each worker after the
reads. The corpora (20 MB and 4 GB, less when the disk has less room: the output says so) are
written in chunks to ``$TMPDIR`` (default ``/tmp``) and removed at the end. Linux only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SEQ_LEN = 1025
WINDOWS = 10_000
FIELDS = ("RssAnon", "RssFile", "VmHWM")
MODULE = __spec__.name if __spec__ is not None else __name__  # what a fresh interpreter imports
MB = 2**20


def status(pid: int | str = "self") -> dict[str, float]:
    """The memory fields of ``/proc/<pid>/status``, in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in FIELDS:
            out[name] = int(value.split()[0]) / 1024
    return out


def make_corpus(path: Path, num_tokens: int, chunk: int = 2**26) -> None:
    """Random uint16 ids written a chunk at a time (constant memory), and their sidecar."""
    import numpy as np

    from linnaeus_accel.data.token_format import TokenSidecar, sidecar_path

    rng = np.random.default_rng(0)
    with path.open("wb") as handle:
        for start in range(0, num_tokens, chunk):
            rng.integers(0, 50_257, min(chunk, num_tokens - start), dtype=np.uint16).tofile(handle)
    sidecar = TokenSidecar("uint16", num_tokens, 1, 50_257, 50_256, 50_256, {"type": "bytes"})
    sidecar_path(path).write_text(sidecar.to_json())


def measure(path: str, workers: int) -> dict[str, Any]:
    """One case, in this process (see the module docstring)."""
    import numpy as np
    import psutil  # type: ignore[import-untyped]  # an Accelerate dependency
    from torch.utils.data import DataLoader

    from linnaeus_accel.data.token_files import TokenFiles

    imported = status()
    started = time.perf_counter()
    dataset = TokenFiles.from_paths([path], SEQ_LEN)
    construct_s = time.perf_counter() - started
    built = status()
    order = np.random.default_rng(1).integers(0, len(dataset), WINDOWS).tolist()
    # Persistent workers outlive the epoch, so that their memory can be read after it.
    loader = DataLoader(
        dataset, batch_size=16, sampler=order, num_workers=workers, persistent_workers=workers > 0
    )
    started = time.perf_counter()
    tokens = sum(int(batch["input_ids"].numel()) for batch in loader)
    read_s = time.perf_counter() - started
    return {
        "windows": len(dataset),
        "construct_s": construct_s,
        "read_s": read_s,
        "tokens_read": tokens,
        "main": {"imported": imported, "built": built, "read": status()},
        "workers": [status(child.pid) for child in psutil.Process().children()],
    }


def run(sizes_mb: dict[str, int], directory: Path) -> dict[str, Any]:
    """Every corpus size with 0 and 2 workers, each case in a fresh interpreter. A size is cut to
    the room ``directory`` has (keeping 1 GB free); ``"cut"`` lists the sizes that were."""
    results: dict[str, Any] = {"cut": []}
    for name, megabytes in sizes_mb.items():
        room = (shutil.disk_usage(directory).free - 1024 * MB) // MB
        if megabytes > room:
            results["cut"].append(f"{name}: {room} MB, what {directory} has room for")
            megabytes = room
        path = directory / f"token_files_memory-{os.getpid()}.bin"
        try:
            make_corpus(path, megabytes * MB // 2)
            for workers in (0, 2):
                code = f"import json, sys; from {MODULE} import measure; print(json.dumps(measure(sys.argv[1], {workers})))"
                done = subprocess.run(
                    [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True
                )
                results[f"{name}, {workers} workers"] = {"megabytes": megabytes, **json.loads(done.stdout)}
        finally:
            path.unlink(missing_ok=True)
            Path(f"{path}.json").unlink(missing_ok=True)
    return results


if __name__ == "__main__":
    print(json.dumps(run({"20 MB": 20, "4 GB": 4096}, Path(os.environ.get("TMPDIR", "/tmp"))), indent=1))
