"""A sharded stream read shard by shard (each shard by one reader) vs read whole by every reader.

The stream: the built-in ``hf_dataset`` with ``streaming: true`` over 8 JSON Lines files of equal
size (random words, ~2,000 characters a document), byte-level tokens packed into windows of 1025
within each file (``HFPackedStream``: Hugging Face ``datasets`` reads the rows, each document is
encoded and cut into windows: ~60 us a window here, a realistic per-item cost). Batches of 16.

Two real processes (``torch.multiprocessing``, a gloo group), each with 2 DataLoader workers and its
own ``stream_loader`` over its own copy of the stream, as the Trainer builds it (no Trainer):
- ``sharded``: the stream as it is (it has ``shards()``/``open_shard()``): ``ShardReaders``, each
  of the 4 readers (process x worker) reads its own 2 files;
- ``whole``: the same stream behind a wrapper that hides ``shards``/``open_shard``, so that
  ``stream_loader`` falls back to ``StreamShard``, today's reading for other streams: every reader
  reads (and decodes) the whole stream and keeps its own batches;
- ``sharded again``: a second ``sharded`` loader, the A/A control.

Counted, not assumed: every window a reader takes from a shard adds one to its slot (process,
worker) of a counter in shared memory (a torch tensor shared with the processes, inherited by the
workers they fork); each process also adds up the real rows of the batches it receives.

Timed: one pass of a side per turn, from a barrier before it to a barrier after it (the slower
process decides), workers started anew each pass as the Trainer's stream loaders do. Rounds of the
three sides, the first one rotating; rows: the medians of the per-round paired ratios.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .common import Row, paired, row
from .corpora import make_jsonl_shards

BENCHMARK = "sharded_streams"
PROCESSES, WORKERS, SHARDS = 2, 2, 8
SEQ_LEN, BATCH = 1025, 16
SIDES = ("sharded", "whole", "sharded again")
# (documents per file, characters per document, rounds)
FULL = (500, 2000, 8)
SMOKE = (8, 2000, 1)


class CountedShard:
    """A shard's windows, each counted in the reader's slot; its state is the shard's own."""

    def __init__(self, windows: Any, counter: Any, rank: int) -> None:
        self.windows, self.counter, self.rank = windows, counter, rank

    def state_dict(self) -> Any:
        return self.windows.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.windows.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        slots = self.counter.numpy()
        slot = self.rank * WORKERS + (0 if info is None else info.id)
        for window in self.windows:
            slots[slot] += 1
            yield window


def counted_stream(stream: Any, counter: Any, rank: int) -> Any:
    """``stream`` (a sharded ``HFPackedStream``) with every window a reader takes counted."""
    from torch.utils.data import IterableDataset

    class Counted(IterableDataset[Any]):
        def shards(self) -> list[Any]:
            return list(stream.shards())

        def open_shard(self, shard: Any) -> CountedShard:
            return CountedShard(stream.open_shard(shard), counter, rank)

        def set_epoch(self, epoch: int) -> None:
            stream.set_epoch(epoch)

        def __iter__(self) -> Iterator[Any]:
            for shard in self.shards():
                yield from self.open_shard(shard)

    return Counted()


def whole(stream: Any) -> Any:
    """``stream`` without ``shards``/``open_shard``: every reader reads all of it (``StreamShard``)."""
    from torch.utils.data import IterableDataset

    class Whole(IterableDataset[Any]):
        def set_epoch(self, epoch: int) -> None:
            stream.set_epoch(epoch)

        def __iter__(self) -> Iterator[Any]:
            return iter(stream)

    return Whole()


def _process(rank: int, spec: dict[str, Any], counter: Any) -> None:
    """One process: its loaders, then ``spec["rounds"]`` rounds of one pass per side."""
    import torch
    import torch.distributed as dist

    from linnaeus_accel.config import load_config
    from linnaeus_accel.data import build_dataset
    from linnaeus_accel.data.streams.streaming import stream_loader

    # As in a process torchrun starts (mp.spawn's children would start DataLoader workers by spawn).
    multiprocessing.set_start_method("fork", force=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=spec["address"], rank=rank, world_size=PROCESSES)
    files = spec["files"]
    options = {"format": "json", "data_files": files[:-1], "val_files": files[-1]}
    options.update(streaming=True, seq_len=SEQ_LEN)
    config = load_config(
        {"DATA": {"BATCH_SIZE": BATCH, "DATASET": {"NAME": "hf_dataset", "OPTIONS": options}}}
    )
    streams = {side: counted_stream(build_dataset(config, "train"), counter, rank) for side in SIDES}
    streams["whole"] = whole(streams["whole"])
    common: dict[str, Any] = {
        "batch_size": BATCH,
        "world_size": PROCESSES,
        "rank": rank,
        "num_workers": WORKERS,
    }
    loaders = {side: stream_loader(stream, **common, shuffle=True) for side, stream in streams.items()}
    if loaders["whole"].sharded or not loaders["sharded"].sharded:
        raise RuntimeError("the whole-stream loader reads shards, or the sharded one does not")
    passes: list[dict[str, Any]] = []
    mine = counter.numpy()[rank * WORKERS : (rank + 1) * WORKERS]
    for r in range(spec["rounds"]):
        for side in SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]:
            mine[:] = 0
            real = 0
            dist.barrier()
            started = time.perf_counter()
            for _, info in loaders[side]:
                real += info.real
            dist.barrier()
            seconds = time.perf_counter() - started
            passes.append(
                {"round": r, "side": side, "seconds": seconds, "read": int(mine.sum()), "real": real}
            )
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(passes))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def run(smoke: bool) -> list[Row]:
    import torch
    import torch.multiprocessing as mp

    documents, characters, rounds = SMOKE if smoke else FULL
    with tempfile.TemporaryDirectory(prefix="bench-sharded-") as tmp:
        files = make_jsonl_shards(Path(tmp) / "data", SHARDS + 1, documents, characters)
        counter = torch.zeros(PROCESSES * WORKERS, dtype=torch.int64)
        counter.share_memory_()  # type: ignore[no-untyped-call]
        spec = {"files": files, "rounds": rounds, "out": tmp, "address": f"tcp://127.0.0.1:{_free_port()}"}
        env = {
            k: os.environ.pop(k) for k in list(os.environ) if k.startswith(("LINNAEUS_ACCEL_", "ACCELERATE_"))
        }
        started = time.perf_counter()
        try:
            mp.spawn(_process, args=(spec, counter), nprocs=PROCESSES, join=True)  # type: ignore[attr-defined,no-untyped-call]
        finally:
            os.environ.update(env)
        elapsed = time.perf_counter() - started
        results = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(PROCESSES)]
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    read: dict[str, list[list[int]]] = {side: [] for side in SIDES}  # per pass, per process
    real: dict[str, list[int]] = {side: [] for side in SIDES}  # per pass, all processes
    for passes in zip(*results, strict=True):
        side = passes[0]["side"]
        seconds[side].append(passes[0]["seconds"])
        read[side].append([p["read"] for p in passes])
        real[side].append(sum(p["real"] for p in passes))
    total = real["sharded"][0]  # windows in the stream: every window trained once per pass
    once = all(value == total for values in real.values() for value in values)
    tokens = total * (SEQ_LEN - 1)
    rate = {side: tokens / sorted(s)[len(s) // 2] for side, s in seconds.items()}
    note = (
        f"{SHARDS} files x {documents} documents of {characters} characters, {total} windows of {SEQ_LEN} per pass; "
        f"{PROCESSES} processes x {WORKERS} workers, batch {BATCH}; {rounds} rounds; median tokens/s: "
        + ", ".join(f"{side} {value / 1e3:.0f}k" for side, value in rate.items())
        + f"; rows trained per pass = the stream's windows on every pass: {once}; {elapsed:.0f} s"
    )
    rows: list[Row] = []
    for side, reference in (("sharded", "whole"), ("sharded again", "sharded")):
        stats = paired(seconds[side], seconds[reference])
        control = side == "sharded again"
        case = "A/A: sharded vs sharded" if control else "sharded vs whole-stream reading"
        rows.append(
            row(
                BENCHMARK,
                f"{case}, {PROCESSES} processes x {WORKERS} workers",
                "s per pass",
                reference,
                **stats,
                target=None if control else "ratio < 1 (faster than every reader reading the whole stream)",
                ok=None if control or smoke else stats["ratio"] < 1,
                note=note,
            )
        )
    for side in ("sharded", "whole"):
        fractions = [count / total for counts in read[side] for count in counts]
        exact = all(count * PROCESSES == total for counts in read[side] for count in counts)
        per_pass = "; ".join("/".join(str(c) for c in counts) for counts in read[side][:3])
        rows.append(
            row(
                BENCHMARK,
                f"windows read per process in one pass, {side} ({PROCESSES} processes x {WORKERS} workers)",
                "fraction of the stream's windows (counted)",
                "1 / processes",
                ours=max(fractions),
                reference=1 / PROCESSES,
                diff=max(fractions) - 1 / PROCESSES,
                ratio=max(fractions) * PROCESSES,
                n=len(fractions),
                target=f"= 1/{PROCESSES} in every process and pass" if side == "sharded" else None,
                ok=(exact and once) if side == "sharded" else None,
                note=f"windows read by process 0/1 in the first passes: {per_pass} of {total}; {note}",
            )
        )
    return rows
