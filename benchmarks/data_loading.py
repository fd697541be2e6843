"""Tokens per second of a token-file corpus read through our loader vs a bare PyTorch DataLoader.

The corpus: ~400 MB of random uint16 ids (written a chunk at a time with ``tofile``, with the
sidecar ``tokenize`` writes), cut into windows of 1025 tokens (1024 targets), batches of 16.

Sides, each with its own long-lived iterator over the same file:
- ``ours``: ``TokenFiles`` (one ``pread`` per window) through ``sampling.make_dataloader``, the
  DataLoader the Trainer builds (its epoch-seeded sampler: a keyed Feistel permutation above 65,536
  windows, its own generator, persistent workers);
- ``bare``: ``torch.utils.data.DataLoader(shuffle=True)`` over a minimal map-style dataset that
  slices a ``np.memmap`` of the file and converts the window to int64 ``input_ids``/``labels``;
- ``bare again``: a second such DataLoader, the A/A control (its ratio to ``bare`` is the noise);
- ``ours, prepared`` and ``bare, prepared``: the same two after ``accelerator.prepare`` (what the
  Trainer iterates, and what a hand-written Accelerate loop would: Accelerate's ``DataLoaderShard``,
  one batch fetched ahead and moved to the device).

Lock-step: a round gives each side K batches in turn (the first side rotating), timed from the
first to the K-th ``next()``; the rows are the medians of the per-round paired ratios and
differences, per batch. With DataLoader workers a side's workers keep working after its turn until
their queue is full (``prefetch_factor x workers`` batches); so after each turn the benchmark
waits until that work is done (a short sleep, untimed: no side's workers run during another side's
turn), and each turn first takes those ready batches untimed, then times K batches produced while
it is timed. With 0 workers the process is pinned to one core with one torch thread; with 2 the
workers get both cores (what workers are for), and the main process one torch thread.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .common import Row, paired, pin_to_one_core, row
from .corpora import MB, make_token_corpus, remove_corpus

BENCHMARK = "data_loading"
SEQ_LEN, BATCH = 1025, 16
TARGET = 1 / 0.95  # ours >= 0.95x the bare loader's tokens/s
# (corpus MB, rounds, batches per turn, worker counts)
FULL = (400, 50, 96, (0, 2))
SMOKE = (2, 3, 4, (0, 2))
SETTLE_S = 0.03  # after a turn with workers: their queued batches are done well within it
PAIRS = (("ours", "bare"), ("ours, prepared", "bare, prepared"), ("bare again", "bare"))


def bare_dataset(path: Path, seq_len: int) -> Any:
    """A minimal map-style dataset over a ``np.memmap`` of the file, as one would write it."""
    import numpy as np
    import torch
    from torch.utils.data import Dataset

    class MemmapWindows(Dataset[dict[str, Any]]):
        def __init__(self) -> None:
            self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
            self.count = (len(self.tokens) - 1) // (seq_len - 1)

        def __len__(self) -> int:
            return self.count

        def __getitem__(self, k: int) -> dict[str, Any]:
            start = k * (seq_len - 1)
            ids = torch.from_numpy(self.tokens[start : start + seq_len].astype(np.int64))
            return {"input_ids": ids, "labels": ids.clone()}

    return MemmapWindows()


class Endless:
    """A loader's batches, a new iterator (untimed) when one runs out."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.it: Iterator[Any] = iter(loader)

    def __next__(self) -> Any:
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)


def loaders(path: Path, workers: int) -> tuple[dict[str, Any], Any]:
    """The five sides' DataLoaders (see the module docstring), and the Accelerator."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from linnaeus_accel.config import load_config
    from linnaeus_accel.data.sampling import make_dataloader
    from linnaeus_accel.data.tokens.files import TokenFiles

    config = load_config({"DATA": {"BATCH_SIZE": BATCH, "NUM_WORKERS": workers}})
    ours = TokenFiles.from_paths([path], SEQ_LEN)
    bare = bare_dataset(path, SEQ_LEN)
    assert len(bare) == len(ours), (len(bare), len(ours))
    accelerator = Accelerator(cpu=True)

    def plain() -> DataLoader[Any]:
        return DataLoader(bare, batch_size=BATCH, shuffle=True, num_workers=workers)

    return {
        "ours": make_dataloader(config.DATA, config.EXPERIMENT.SEED, ours, train=True),
        "bare": plain(),
        "bare again": plain(),
        "ours, prepared": accelerator.prepare_data_loader(
            make_dataloader(config.DATA, config.EXPERIMENT.SEED, ours, train=True)
        ),
        "bare, prepared": accelerator.prepare_data_loader(plain()),
    }, accelerator


def lockstep(
    sides: dict[str, Endless], rounds: int, per_turn: int, prime: int, settle: float
) -> dict[str, list[float]]:
    """Seconds per batch of each side, per round (see the module docstring)."""
    names = list(sides)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            it = sides[name]
            for _ in range(prime):  # ready since the side's last turn
                next(it)
            started = time.perf_counter()
            rows = 0
            for _ in range(per_turn):
                rows += next(it)["input_ids"].shape[0]
            seconds[name].append((time.perf_counter() - started) / per_turn)
            if rows != per_turn * BATCH:
                raise RuntimeError(f"{name}: {rows} rows in {per_turn} batches of {BATCH}")
            if settle:
                time.sleep(settle)
    return seconds


def measure(path: Path, workers: int, rounds: int, per_turn: int) -> dict[str, list[float]]:
    import torch
    from accelerate.state import AcceleratorState, GradientState

    affinity = os.sched_getaffinity(0)
    if workers == 0:
        pin_to_one_core()
    torch.set_num_threads(1)
    built, accelerator = loaders(path, workers)
    try:
        sides = {name: Endless(loader) for name, loader in built.items()}
        prime = 2 * workers  # DataLoader's prefetch_factor (2) x workers
        lockstep(sides, 1, per_turn, prime, SETTLE_S if workers else 0.0)  # warm-up: workers started
        return lockstep(sides, rounds, per_turn, prime, SETTLE_S if workers else 0.0)
    finally:
        del built
        accelerator.free_memory()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        os.sched_setaffinity(0, affinity)


def run(smoke: bool) -> list[Row]:
    megabytes, rounds, per_turn, worker_counts = SMOKE if smoke else FULL
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(
        prefix="bench-data-loading-", dir=os.environ.get("TMPDIR", "/tmp")
    ) as tmp:
        path = Path(tmp) / "corpus.bin"
        make_token_corpus(path, megabytes * MB // 2)
        try:
            for workers in worker_counts:
                started = time.perf_counter()
                seconds = measure(path, workers, rounds, per_turn)
                elapsed = time.perf_counter() - started
                tokens = BATCH * (SEQ_LEN - 1)
                rate = {name: tokens / sorted(s)[len(s) // 2] for name, s in seconds.items()}
                note = (
                    f"{megabytes} MB corpus (random uint16 ids, just written), windows of {SEQ_LEN}, "
                    f"batch {BATCH}; {rounds} rounds of {per_turn} batches per side, {workers} workers; "
                    f"median tokens/s (targets): "
                    + ", ".join(f"{name} {value / 1e6:.2f}M" for name, value in rate.items())
                    + f"; {elapsed:.0f} s"
                )
                for name, reference in PAIRS:
                    stats = paired(seconds[name], seconds[reference])
                    control = name == "bare again"
                    rows.append(
                        row(
                            BENCHMARK,
                            f"{'A/A: bare vs bare' if control else name}, {workers} workers",
                            f"s per batch of {BATCH} x {SEQ_LEN} tokens",
                            f"{reference}: DataLoader(shuffle=True) over np.memmap windows",
                            **stats,
                            target=None if control else f"ratio <= {TARGET:.3f} (>= 0.95x tokens/s)",
                            ok=None if control or smoke else stats["ratio"] <= TARGET,
                            note=note,
                        )
                    )
        finally:
            remove_corpus(path)
    return rows
