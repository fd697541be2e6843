"""Species training on 2 processes (gloo, CPU) sees every row of the training split once per epoch.

Accelerate hands process ``p`` of ``W`` the global batches ``p, p + W, ...`` of the epoch's order and,
its even batches on, fills the last global round by repeating the epoch's own first samples. So,
per epoch, with the batches put back in global order: the first N samples (N, the rows of the
split) are the epoch's order, every index once; the rest are the repeats, which
``sampling.real_in_batch`` counts as not real and the ``hierarchical`` task gives no target (no loss,
gradient or metric counts them). "Exactly once" means that: once among the samples that count.

Run as a script (``python tests/test_species_processes.py train ...``), this module is
linnaeus-accel's command line with ``recorded_species`` registered: ``image_table``, recording each
training sample read as ``<epoch> <index>`` lines in ``$SPECIES_SEEN_DIR/rank<RANK>.txt``.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import yaml
from helpers.processes import accelerate_launch_command
from helpers.runs import TrainRun, read_summary
from helpers.species import TINY_CONVNEXT, species_files
from torch.utils.data import Dataset

from linnaeus_accel.data.sampling import EpochSeededSampler, real_in_batch
from linnaeus_accel.data.species.labels import LabelsFile

SCRIPT = Path(__file__).resolve()
SEEN_ENV = "SPECIES_SEEN_DIR"
RANKS = {"taxa_L10": "species", "taxa_L20": "genus", "taxa_L30": "family"}  # finest first
TRAIN_ROWS = 9  # of the tiny data's 12 rows, at VAL_FRACTION 0.25
BATCH, PROCESSES, EPOCHS, SEED = 2, 2, 2, 5


class Recorded(Dataset[dict[str, Any]]):
    """``inner`` as the Trainer sees it (its levels, sampler, records), each training read recorded."""

    def __init__(self, inner: Any, out: Path) -> None:
        self.inner, self.out = inner, out

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "out") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __getitem__(self, key: Any) -> dict[str, Any]:
        if isinstance(key, tuple):  # (epoch, index): the training sampler's; a bare index is a check's
            with self.out.open("a", encoding="utf-8") as seen:
                seen.write(f"{key[0]} {key[1]}\n")
        item: dict[str, Any] = self.inner[key]
        return item


def build_recorded(config: Any, split: Any) -> Any:
    from linnaeus_accel.data.species.build import build_image_table

    dataset = build_image_table(config, split)
    if split != "train":
        return dataset
    return Recorded(dataset, Path(os.environ[SEEN_ENV]) / f"rank{os.environ.get('RANK', '0')}.txt")


class ScriptRun(TrainRun):
    """``accelerate launch`` of this module as the training script."""

    def command(self, args: Any, python_code: str | None) -> list[str]:
        line = super().command(args, python_code)
        return [*accelerate_launch_command(self.processes), str(SCRIPT), *line[line.index("train") :]]


def species_table(root: Path) -> tuple[Path, Path]:
    """The tiny species data (``helpers.species``) as a CSV table of observations and its photos."""
    labels, images = species_files(root / "data")
    source = LabelsFile(labels, list(RANKS), [])
    table = root / "data" / "observations.csv"
    with table.open("w", encoding="utf-8", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["image", *RANKS.values()])
        for i in range(len(source)):
            row = source.row(i)
            writer.writerow([row.identifier, *(int(row.taxa[key]) for key in RANKS)])
    return table, images


def species_config(root: Path) -> str:
    table, images = species_table(root)
    options = {
        "table": str(table),
        "images_dir": str(images),
        "rank_columns": list(RANKS.values()),
        "augment": "none",
        "erasing": 0.0,
    }
    config = {
        "EXPERIMENT": {"SEED": SEED},
        "DATA": {
            "BATCH_SIZE": BATCH,
            "NUM_WORKERS": 0,
            "PARTIAL": {"LEVELS": True},
            "IMG_SIZE": 32,
            "DATASET": {"NAME": "recorded_species", "VAL_FRACTION": 0.25, "OPTIONS": options},
        },
        "MODEL": {"TYPE": "hf_vision", "OPTIONS": {"config": TINY_CONVNEXT}},
        "TASK": {"NAME": "hierarchical"},
        "TRAIN": {"EPOCHS": EPOCHS},
        "LR_SCHEDULER": {"REFERENCE_BS": None},
        "SCHEDULE": {"VALIDATION": {"INTERVAL_EPOCHS": EPOCHS}},
    }
    path = root / "species.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return str(path)


def global_order(seen: list[list[tuple[int, int]]], epoch: int) -> list[int]:
    """The epoch's samples as the processes read them, put back in global order: process ``p``'s
    ``j``-th batch is global batch ``j * W + p``."""
    batches: dict[int, list[int]] = {}
    for rank, reads in enumerate(seen):
        indices = [index for e, index in reads if e == epoch]
        assert len(indices) % BATCH == 0, f"process {rank} read a short batch in epoch {epoch}: {indices}"
        for j in range(len(indices) // BATCH):
            batches[j * PROCESSES + rank] = indices[j * BATCH : (j + 1) * BATCH]
    assert sorted(batches) == list(range(len(batches))), f"a global batch is missing: {sorted(batches)}"
    return [index for b in sorted(batches) for index in batches[b]]


def test_two_processes_read_each_training_row_once_per_epoch(tmp_path: Path) -> None:
    run = ScriptRun(tmp_path, [], processes=PROCESSES, cfg=species_config(tmp_path))
    result = run.run(extra_env={SEEN_ENV: str(tmp_path)}).check_ok()
    assert read_summary(result.dir)["status"] == "completed"
    lines = [(tmp_path / f"rank{rank}.txt").read_text(encoding="utf-8").split() for rank in range(PROCESSES)]
    seen = [list(zip(map(int, words[0::2]), map(int, words[1::2]), strict=True)) for words in lines]
    epochs = sorted({e for reads in seen for e, _ in reads})
    assert len(epochs) == EPOCHS, epochs
    rounds = -(-TRAIN_ROWS // (BATCH * PROCESSES))  # global batch rounds per epoch, the last padded
    orders = []
    for epoch in epochs:
        got = global_order(seen, epoch)
        sampler = EpochSeededSampler(range(TRAIN_ROWS), SEED)
        sampler.set_epoch(epoch)
        order = list(sampler)
        orders.append(order)
        padding = rounds * BATCH * PROCESSES - TRAIN_ROWS
        # Every row once, in the epoch's order; then the repeats: the epoch's own first samples.
        assert got == order + order[:padding], (epoch, got, order)
        assert sorted(order) == list(range(TRAIN_ROWS))
        # The reads that count (real_in_batch's leading samples of each batch): each row once.
        counted = []
        for rank, reads in enumerate(seen):
            indices = [index for e, index in reads if e == epoch]
            for j in range(rounds):
                real = real_in_batch(TRAIN_ROWS, BATCH, PROCESSES, j, rank)
                counted += indices[j * BATCH : j * BATCH + real]
        assert sorted(counted) == list(range(TRAIN_ROWS)), (epoch, counted)
    assert orders[0] != orders[1]  # each epoch shuffles anew


if __name__ == "__main__":
    from linnaeus_accel.cli import console
    from linnaeus_accel.data.registry import register_dataset

    register_dataset("recorded_species")(build_recorded)
    console()
