"""The hierarchical task's validation metrics on hand-built logits: per level top-1 (``acc_<level>``)
and top-3 (``acc3_<level>``) over the samples labelled there, ``chain_acc`` and
``partial_chain_acc``; the sums behind them add up over batches and processes, rows outside
``real`` (even-batch repeats) count nowhere, and no value is read back to the host per batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from helpers.configs import DEFAULT_CONFIG
from helpers.host_sync import ReadBackRecorder
from torch import Tensor, nn

from linnaeus_accel.config import load_config
from linnaeus_accel.schedule import resolve_plan
from linnaeus_accel.tasks import STANDARD_PASS, TaskContext, ValidationPass
from linnaeus_accel.tasks.hierarchical import HierarchicalTask

LEVELS = ("order", "family", "genus")  # coarse to fine: 2, 4 and 5 classes
N = None  # a level the sample is not labelled at: it counts in neither numerator nor denominator
MASKED = ValidationPass(STANDARD_PASS.stage, "val_mask_meta", ())  # every metadata component masked


@dataclass(frozen=True)
class Ranks:
    """A training dataset as far as the task's ``bind`` reads one."""

    levels: tuple[str, ...]

    def __len__(self) -> int:
        return 8


class Readout(nn.Module):
    """A model whose logits are the batch's own: the metrics are checked on chosen predictions."""

    def forward(self, batch: dict[str, Any]) -> list[Tensor]:
        return list(batch["logits"])


@dataclass(frozen=True)
class Row:
    labels: tuple[int, ...]  # per level, coarse to fine; -1: null
    logits: tuple[list[float], ...]  # per level
    top1: tuple[int | None, ...]  # per level: 1 right, 0 wrong, N unlabelled
    top3: tuple[int | None, ...]
    chain: int  # counts as right in chain_acc
    partial: int | None  # in partial_chain_acc: 1 right, 0 wrong, N left out


def bound(levels: tuple[str, ...] = LEVELS) -> HierarchicalTask:
    config = load_config(DEFAULT_CONFIG, ["LOSS.TASK_WEIGHTS", "null"])
    dataset = Ranks(levels)
    task = HierarchicalTask()
    task.bind(
        TaskContext(config, resolve_plan(config, 1, 1, len(dataset)), dataset, 0, 1, torch.device("cpu"))
    )
    return task


def batch_of(rows: list[Row]) -> dict[str, Any]:
    return {
        "index": torch.arange(len(rows)),
        "meta": {},
        "labels": torch.tensor([r.labels for r in rows]),
        "logits": [
            torch.tensor([r.logits[i] for r in rows], dtype=torch.float) for i in range(len(rows[0].logits))
        ],
    }


def metrics_of(
    task: HierarchicalTask,
    batch: dict[str, Any],
    real: Tensor | None = None,
    vpass: ValidationPass = STANDARD_PASS,
) -> dict[str, float]:
    return task.validation_metrics(task.validation_step(Readout(), batch, real, vpass).tolist(), vpass)


ROWS = [
    # every level labelled and right
    Row((0, 1, 2), ([2, 0], [0, 3, 1, 0], [0, 0, 4, 1, 0]), (1, 1, 1), (1, 1, 1), 1, 1),
    # the genus second-highest: a top-3 hit, a top-1 miss, so both chains miss
    Row((1, 2, 3), ([0, 1], [0, 0, 5, 1], [0, 0, 0, 2, 3]), (1, 1, 0), (1, 1, 1), 0, 0),
    # null at the finest level, the ranks above right: the partial chain runs from the family up
    Row((0, 3, -1), ([1, 0], [0, 0, 0, 2], [9, 0, 0, 0, 0]), (1, 1, N), (1, 1, N), 1, 1),
    # null at the finest level, the family third-highest: wrong from the family up
    Row((1, 0, -1), ([0, 2], [1, 3, 2, 0], [0, 0, 0, 0, 9]), (1, 0, N), (1, 1, N), 0, 0),
    # the family null in between: skipped; the order wrong, but with 2 classes still a top-3 hit
    Row((0, -1, 4), ([0, 1], [5, 0, 0, 0], [0, 0, 0, 0, 5]), (0, N, 1), (1, N, 1), 0, 0),
    # the genus lowest of 5: outside the top 3
    Row((1, 2, 0), ([0, 1], [0, 0, 1, 0], [0, 1, 2, 3, 4]), (1, 1, 0), (1, 1, 0), 0, 0),
    # no level labelled: right by chain_acc (nothing is wrong), left out of partial_chain_acc
    Row((-1, -1, -1), ([0, 1], [0, 0, 1, 0], [0, 1, 2, 3, 4]), (N, N, N), (N, N, N), 1, N),
]


def expected(rows: list[Row]) -> dict[str, float]:
    """The metrics by their definitions, from the rows' flags (a mean over no sample reads 0)."""

    def mean(flags: list[int | None]) -> float:
        counted = [f for f in flags if f is not None]
        return sum(counted) / len(counted) if counted else 0.0

    out = {
        "val/chain_acc": mean([r.chain for r in rows]),
        "val/partial_chain_acc": mean([r.partial for r in rows]),
    }
    for i, level in enumerate(LEVELS):
        out[f"val/acc_{level}"] = mean([r.top1[i] for r in rows])
        out[f"val/acc3_{level}"] = mean([r.top3[i] for r in rows])
    return out


@pytest.mark.parametrize("row", ROWS)
def test_each_row_alone(row: Row) -> None:
    got = metrics_of(bound(), batch_of([row]))
    assert {k: v for k, v in got.items() if k != "val/loss"} == pytest.approx(expected([row]))


def test_the_rows_together() -> None:
    got = metrics_of(bound(), batch_of(ROWS))
    assert got == {"val/loss": got["val/loss"], **expected(ROWS)}  # no other metric
    # by hand: 3 of 7 chains (the last one vacuously), 2 of the 6 samples with a label
    assert got["val/chain_acc"] == pytest.approx(3 / 7)
    assert got["val/partial_chain_acc"] == pytest.approx(2 / 6)
    assert (got["val/acc_genus"], got["val/acc3_genus"]) == pytest.approx((2 / 4, 3 / 4))
    assert list(got)[:3] == ["val/loss", "val/chain_acc", "val/partial_chain_acc"]


def test_metric_names_and_directions() -> None:
    task = bound()
    names = {k.removeprefix("val_mask_meta/") for k in metrics_of(task, batch_of(ROWS), vpass=MASKED)}
    assert names == set(task.metric_directions)
    assert {task.direction(f"val/{name}") for name in names - {"loss"}} == {"max"}
    # the first higher-is-better metric is the headline of a masked pass on the console
    assert next(n for n, d in task.metric_directions.items() if d == "max") == "chain_acc"


# (labels, logits of the one level, acc, acc3)
TOP3_CASES = [
    ([0, 1], [[1.0, 2.0], [3.0, 4.0]], 0.5, 1.0),  # 2 classes: top-2 holds every class
    ([0, 0], [[5.0], [5.0]], 1.0, 1.0),  # 1 class: always right
    ([2, 1, 0], [[3.0, 2.0, 1.0]] * 3, 1 / 3, 1.0),  # 3 classes: top-3 holds every class
    ([3, 0], [[4.0, 3.0, 2.0, 1.0]] * 2, 0.5, 0.5),  # 4 classes: the 4th is out
    ([0], [[1.0, 1.0, 1.0, 1.0, 1.0]], 1.0, 1.0),  # all tied: argmax's pick is a top-3 hit too
    ([-1, 1], [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]], 0.0, 1.0),  # a null label counts in neither
    ([-1], [[0.0, 1.0, 2.0]], 0.0, 0.0),  # nobody labelled: 0, as acc_<level> reads
]


@pytest.mark.parametrize(("labels", "logits", "acc", "acc3"), TOP3_CASES)
def test_top3_edge_cases(labels: list[int], logits: list[list[float]], acc: float, acc3: float) -> None:
    task = bound(("species",))
    batch = {"meta": {}, "labels": torch.tensor(labels)[:, None], "logits": [torch.tensor(logits)]}
    got = metrics_of(task, batch)
    assert (got["val/acc_species"], got["val/acc3_species"]) == pytest.approx((acc, acc3))


# Even-batch repeats: Accelerate repeats the first samples to fill the last batch; the rows outside
# ``real`` must change nothing. (batch rows as indices into ROWS, real flags)
PADDING_CASES = [
    ([0, 1, 2, 0, 1], [True, True, True, False, False]),  # two repeats of a right and a wrong row
    ([6, 3, 6], [True, True, False]),  # a repeated all-null row: no vacuous chain hit from it
    ([4, 5, 4, 5, 4], [True, True, False, False, False]),  # more repeats than real rows
]


@pytest.mark.parametrize(("indices", "real"), PADDING_CASES)
def test_rows_outside_real_count_nowhere(indices: list[int], real: list[bool]) -> None:
    task = bound()
    padded = metrics_of(task, batch_of([ROWS[i] for i in indices]), torch.tensor(real))
    alone = metrics_of(task, batch_of([ROWS[i] for i, keep in zip(indices, real, strict=True) if keep]))
    assert padded == pytest.approx(alone)


# Two processes: each sums its share, the all-reduce adds the sums, then the metrics are taken.
# (rows of process 0, rows of process 1 with its last-batch repeats marked)
SHARD_CASES = [
    ([0, 1, 2, 3], [4, 5, 6]),  # an even split but for one row
    ([0, 2, 4, 6], [1, 3, 5]),  # interleaved, as a distributed sampler hands them out
    ([6], [0, 1, 2, 3, 4, 5]),  # one process with the all-null row alone
]


@pytest.mark.parametrize(("first", "second"), SHARD_CASES)
def test_sums_add_up_over_processes(first: list[int], second: list[int]) -> None:
    task = bound()
    parts = []
    for shard in (first, second):
        pad = max(len(first), len(second)) - len(shard)  # the shorter process repeats rows
        rows = [ROWS[i] for i in shard] + [ROWS[shard[0]]] * pad
        real = torch.arange(len(rows)) < len(shard)
        parts.append(task.validation_step(Readout(), batch_of(rows), real, STANDARD_PASS))
    reduced = task.validation_metrics((parts[0] + parts[1]).tolist(), STANDARD_PASS)
    assert reduced == pytest.approx(metrics_of(task, batch_of(ROWS)))


def test_validation_step_reads_nothing_back_to_the_host() -> None:
    task, batch = bound(), batch_of(ROWS)
    real = torch.tensor([True] * 6 + [False])
    with ReadBackRecorder() as recorder:
        task.validation_step(Readout(), batch, real, STANDARD_PASS)
    assert recorder.calls == []
