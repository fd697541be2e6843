"""Streaming: an ``IterableDataset`` without a length, its shards split across DataLoader workers.

    python examples/by_feature/streaming.py

``DigitShards`` stands for a corpus of files: 4 shards of the digits, each read in order, and no
``__len__``. Because it lists its shards (``shards()``) and opens one (``open_shard``), each pass
gives every shard to exactly one reader (here 2 DataLoader workers; with N processes, N x workers
readers) in an order drawn from the seed and the epoch, and a resume continues inside a shard. A
stream without a length has no epochs to count by: the run's length and intervals are in steps, and
a pass ends where the data does. (A stream without ``shards()`` is read whole by every reader, each
keeping its own batches.) The script logs which worker opened which shard and checks that no shard
was read twice in a pass. Each run writes to a new directory under ``$EXAMPLES_OUT`` (default: the temp dir).
"""

import collections
import os
import tempfile
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset, get_worker_info

from linnaeus_accel import Trainer, load_config


class DigitShards(IterableDataset):
    def __init__(self, x, y, log: Path):
        self.x, self.y, self.log, self.epoch = x, y, log, 0

    def set_epoch(self, epoch):  # optional: called before each pass
        self.epoch = epoch

    def shards(self):  # the same list on every process: file names, URLs, ...
        return [0, 1, 2, 3]

    def open_shard(self, shard):  # one shard's items, in order
        worker = get_worker_info()
        with self.log.open("a") as log:
            log.write(f"{self.epoch} {worker.id if worker else 'main'} {shard}\n")
        for i in range(shard, len(self.x), 4):
            yield self.x[i], self.y[i]

    def __iter__(self):  # the whole stream
        for shard in self.shards():
            yield from self.open_shard(shard)


if __name__ == "__main__":  # DataLoader workers may import this file
    out = tempfile.mkdtemp(prefix="streaming_", dir=os.environ.get("EXAMPLES_OUT"))
    digits = load_digits()
    x, y = torch.tensor(digits.data, dtype=torch.float32) / 16, torch.tensor(digits.target)
    every_50 = {"INTERVAL_STEPS": 50, "MID_EPOCH": True}
    config = load_config(
        {
            "EXPERIMENT": {"NAME": "streaming", "SEED": 0},
            "ENV": {"OUTPUT": {"BASE_DIR": out}},
            "TASK": {"NAME": "classification"},
            "DATA": {"BATCH_SIZE": 32, "NUM_WORKERS": 2},
            "TRAIN": {"EPOCHS": None, "STEPS": 100},
            "LR_SCHEDULER": {"NAME": "cosine", "BASE_LR": 3e-3, "REFERENCE_BS": None, "WARMUP_STEPS": 10},
            "SCHEDULE": {"VALIDATION": every_50, "CHECKPOINT": every_50},
        }
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    log = Path(out, "shards_opened.txt")
    Trainer(config, model, DigitShards(x[:1500], y[:1500], log), TensorDataset(x[1500:], y[1500:])).fit()

    reads = collections.defaultdict(list)  # pass -> (worker, shard)
    for epoch, worker, shard in (line.split() for line in log.read_text().splitlines()):
        if worker != "main":  # the main process opens the first shard once, to check a batch
            reads[epoch].append((worker, shard))
    for epoch, opened in reads.items():
        assert len({shard for _, shard in opened}) == len(opened), (
            f"pass {epoch} read a shard twice: {opened}"
        )
        assert {worker for worker, _ in opened} == {"0", "1"}, opened  # both workers read
    print(f"(worker, shard) by pass: {dict(reads)}")
