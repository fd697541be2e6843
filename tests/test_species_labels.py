"""linnaeus' labels.h5 read back as a user sees it: rows by index, malformed files refused before
training with one sentence each, the train/val split fixed by its seed, the reader usable from
forked DataLoader workers, and memory that does not grow with the file."""

from __future__ import annotations

import multiprocessing
import pickle
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from linnaeus_accel.config import ConfigError
from linnaeus_accel.data.species.labels import (
    ComponentSpec,
    LabelsFile,
    split_indices,
    write_labels_h5,
)

TASKS = ["taxa_L10", "taxa_L20", "taxa_L30"]
TEMPORAL = ComponentSpec("TEMPORAL", "temporal", dim=2, idx=0)
SPATIAL = ComponentSpec("SPATIAL", "spatial", dim=3, idx=1)
ELEVATION = ComponentSpec("ELEVATION", "elevation", dim=4, idx=2)
# Listed out of IDX order on purpose: the metadata vector follows IDX, not the list.
COMPONENTS = [ELEVATION, SPATIAL, TEMPORAL]

IDS = ["101_0.jpg", "102_0.jpg", "103_0.jpg", "104_0.jpg"]
TAXA = {
    "taxa_L10": [5, 6, 0, 5],
    "taxa_L20": [50, 50, 60, 50],
    "taxa_L30": [500, 500, 500, 500],
    "taxa_L40": [9000, 9000, 9000, 9000],  # in the file, not a task: never read
}
META: dict[str, list[list[float]]] = {
    "temporal": [[0.5, 0.8], [0, 0], [0.1, 0.2], [0.3, 0.4]],
    "spatial": [[1, 2, 3], [4, 5, 6], [0, 0, 0], [7, 8, 9]],
    # The last row: no elevation, marked as linnaeus' data generator marks it (sin and cos of 0 m).
    "elevation": [[0.1, 0.9, 0.2, 0.8], [0.3, 0.7, 0.4, 0.6], [0.5, 0.5, 0.6, 0.4], [0, 1, 0, 1]],
}


@pytest.fixture
def labels_path(tmp_path: Path) -> Path:
    return write_labels_h5(tmp_path / "labels.h5", IDS, TAXA, META)


# (row, identifier, taxon ids per task, metadata vector in IDX order, validity per component).
ROWS: list[tuple[int, str, list[int], list[float], list[bool]]] = [
    # Everything present.
    (0, "101_0.jpg", [5, 50, 500], [0.5, 0.8, 1, 2, 3, 0.1, 0.9, 0.2, 0.8], [True, True, True]),
    # No date: the temporal slot is zeros and flagged missing; the rest stays valid.
    (1, "102_0.jpg", [6, 50, 500], [0, 0, 4, 5, 6, 0.3, 0.7, 0.4, 0.6], [False, True, True]),
    # Species unknown (id 0 = null at that rank), and no coordinates.
    (2, "103_0.jpg", [0, 60, 500], [0.1, 0.2, 0, 0, 0, 0.5, 0.5, 0.6, 0.4], [True, False, True]),
    # No elevation (sin/cos of 0 m in the file): the last slot is zeros and flagged missing.
    (3, "104_0.jpg", [5, 50, 500], [0.3, 0.4, 7, 8, 9, 0, 0, 0, 0], [True, True, False]),
]


@pytest.mark.parametrize(("index", "identifier", "ids", "meta", "valid"), ROWS)
def test_rows_read_back(
    labels_path: Path, index: int, identifier: str, ids: list[int], meta: list[float], valid: list[bool]
) -> None:
    labels = LabelsFile(labels_path, TASKS, COMPONENTS)
    row = labels.row(index)
    assert (row.index, row.identifier) == (index, identifier)
    assert row.taxa == dict(zip(TASKS, ids, strict=True))
    np.testing.assert_allclose(row.meta, meta, rtol=1e-6)
    assert row.meta.dtype == np.float32
    assert row.valid.tolist() == valid


def test_layout_and_batches(labels_path: Path) -> None:
    labels = LabelsFile(labels_path, TASKS, COMPONENTS)
    assert len(labels) == 4
    assert [c.name for c in labels.components] == ["TEMPORAL", "SPATIAL", "ELEVATION"]
    assert labels.component_slices == {
        "TEMPORAL": slice(0, 2),
        "SPATIAL": slice(2, 5),
        "ELEVATION": slice(5, 9),
    }
    assert labels.meta_dim == 9
    # Rows come back in the order asked, repeats included, through either read path.
    for indices in ([3, 0, 3, 1], [1, 2], [2]):
        batch = labels.rows(indices)
        assert len(batch) == len(indices)
        for i, index in enumerate(indices):
            one = labels.row(index)
            assert batch[i].identifier == one.identifier
            assert batch[i].taxa == one.taxa
            np.testing.assert_array_equal(batch[i].meta, one.meta)
            np.testing.assert_array_equal(batch[i].valid, one.valid)
    empty = labels.rows([])
    assert (len(empty), empty.meta.shape, empty.valid.shape) == (0, (0, 9), (0, 3))
    with pytest.raises(IndexError, match="row 4 is outside"):
        labels.row(4)
    # The whole taxa columns, for the tasks only, as uint32; the open handle keeps working after.
    columns = labels.taxa_columns()
    assert list(columns) == TASKS
    assert all(c.dtype == np.uint32 for c in columns.values())
    assert columns["taxa_L10"].tolist() == TAXA["taxa_L10"]
    assert labels.row(1).identifier == "102_0.jpg"


def test_missing_component_refused_when_not_allowed(labels_path: Path) -> None:
    required = ComponentSpec("SPATIAL", "spatial", dim=3, idx=1, allow_missing=False)
    labels = LabelsFile(labels_path, TASKS, [TEMPORAL, required, ELEVATION])
    assert labels.row(0).valid.tolist() == [True, True, True]
    with pytest.raises(ConfigError) as caught:
        labels.rows([0, 3, 2])
    assert caught.value.problems == [
        (
            "DATA.META.COMPONENTS.SPATIAL.ALLOW_MISSING",
            f"{labels_path}: row 2 (103_0.jpg) has no spatial data (an all-zero row) and "
            "SPATIAL.ALLOW_MISSING is false: set ALLOW_MISSING to true or drop the rows without it from the file",
        )
    ]


def _drop(*names: str) -> Callable[[Any], None]:
    def edit(f: Any) -> None:
        for name in names:
            del f[name]

    return edit


def _replace(name: str, data: Any) -> Callable[[Any], None]:
    def edit(f: Any) -> None:
        del f[name]
        f.create_dataset(name, data=data)

    return edit


# (id, edit of the good file, expected (key, message) problems; {path} is the file).
BAD_FILES: list[tuple[str, Callable[[Any], None], list[tuple[str, str]]]] = [
    # A rank named in DATA.TASK_KEYS_H5 that the file lacks: the ranks it has are listed.
    (
        "missing-rank",
        _drop("taxa_L30"),
        [
            (
                "DATA.TASK_KEYS_H5",
                "{path} has no taxa_L30 dataset (it has taxa_L10, taxa_L20, taxa_L40): "
                "remove taxa_L30 from DATA.TASK_KEYS_H5 or use a file with that rank",
            )
        ],
    ),
    # A component whose SOURCE is not in the file: the candidates are listed.
    (
        "missing-source",
        _drop("spatial"),
        [
            (
                "DATA.META.COMPONENTS.SPATIAL.SOURCE",
                "{path} has no spatial dataset for SPATIAL (its other datasets: elevation, temporal): "
                "set SOURCE to the dataset that holds SPATIAL or disable the component",
            )
        ],
    ),
    # Elevation encoded at 3 scales (6 wide) where the config expects 2 (DIM 4).
    (
        "width-not-dim",
        _replace("elevation", np.zeros((4, 6), np.float32)),
        [
            (
                "DATA.META.COMPONENTS.ELEVATION.DIM",
                "{path}: elevation is 6 wide but ELEVATION.DIM is 4: "
                "set DIM to 6 or point SOURCE at a 4-wide dataset",
            )
        ],
    ),
    # One rank written for 3 images of 4.
    (
        "lengths-differ",
        _replace("taxa_L20", np.zeros(3, np.uint32)),
        [
            (
                "DATA.H5.LABELS_PATH",
                "{path}: its datasets have different numbers of rows (img_identifiers 4, taxa_L10 4, "
                "taxa_L20 3, taxa_L30 4, temporal 4, spatial 4, elevation 4): "
                "rewrite the file with one row per image in every dataset",
            )
        ],
    ),
    # No image names: nothing links a row to its photo.
    (
        "no-identifiers",
        _drop("img_identifiers"),
        [
            (
                "DATA.H5.LABELS_PATH",
                "{path} has no img_identifiers dataset (the image file name of each row): "
                "add it to the file, one string per row",
            )
        ],
    ),
    # Taxon ids written as floats.
    (
        "float-taxa",
        _replace("taxa_L10", np.zeros(4, np.float64)),
        [
            (
                "DATA.TASK_KEYS_H5",
                "{path}: taxa_L10 holds float64 of shape (4,), not one integer taxon id per row: "
                "write it as uint32 of shape (rows,)",
            )
        ],
    ),
    # Every problem of a file at once, not the first one per attempt.
    (
        "two-problems",
        _drop("taxa_L10", "temporal"),
        [
            (
                "DATA.TASK_KEYS_H5",
                "{path} has no taxa_L10 dataset (it has taxa_L20, taxa_L30, taxa_L40): "
                "remove taxa_L10 from DATA.TASK_KEYS_H5 or use a file with that rank",
            ),
            (
                "DATA.META.COMPONENTS.TEMPORAL.SOURCE",
                "{path} has no temporal dataset for TEMPORAL (its other datasets: elevation, spatial): "
                "set SOURCE to the dataset that holds TEMPORAL or disable the component",
            ),
        ],
    ),
]


@pytest.mark.parametrize(
    ("edit", "expected"), [row[1:] for row in BAD_FILES], ids=[row[0] for row in BAD_FILES]
)
def test_malformed_file_refused(
    labels_path: Path, edit: Callable[[Any], None], expected: list[tuple[str, str]]
) -> None:
    with h5py.File(labels_path, "a") as f:
        edit(f)
    with pytest.raises(ConfigError) as caught:
        LabelsFile(labels_path, TASKS, COMPONENTS)
    assert caught.value.problems == [(key, message.format(path=labels_path)) for key, message in expected]


def test_absent_file_refused(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.h5"
    with pytest.raises(ConfigError) as caught:
        LabelsFile(path, TASKS, COMPONENTS)
    assert caught.value.problems == [
        ("DATA.H5.LABELS_PATH", f"{path} does not exist: point DATA.H5.LABELS_PATH at a labels.h5")
    ]


# (rows, training share, seed, training rows).
SPLITS: list[tuple[int, float, int, int]] = [
    (10, 0.9, 42, 9),  # linnaeus' default share
    (100, 0.29, 0, 29),  # 0.29 * 100 is 28.999... as a float: the share is read as written
    (7, 0.5, 1, 3),  # rounded down, as linnaeus' int(n * ratio)
    (2, 0.5, 3, 1),  # the smallest file that splits
]


@pytest.mark.parametrize(("n_rows", "ratio", "seed", "n_train"), SPLITS)
def test_split_fixed_disjoint_covering(n_rows: int, ratio: float, seed: int, n_train: int) -> None:
    train, val = split_indices(n_rows, ratio, seed)
    again_train, again_val = split_indices(n_rows, ratio, seed)
    np.testing.assert_array_equal(train, again_train)
    np.testing.assert_array_equal(val, again_val)
    assert len(train) == n_train
    assert not set(train.tolist()) & set(val.tolist())
    assert sorted([*train.tolist(), *val.tolist()]) == list(range(n_rows))
    assert train.tolist() == sorted(train.tolist())


def test_split_same_in_every_run() -> None:
    # Pinned: a change of generator would move rows between train and val of existing runs.
    train, val = split_indices(10, 0.5, 0)
    assert (train.tolist(), val.tolist()) == ([2, 3, 4, 6, 7], [0, 1, 5, 8, 9])
    assert split_indices(100, 0.5, 1)[0].tolist() != split_indices(100, 0.5, 2)[0].tolist()


# (rows, training share, the message).
EMPTY_SPLITS: list[tuple[int, float, str]] = [
    # Nothing trains.
    (10, 0.0, "0.0 of 10 rows leaves the training split empty: set it between 0.1 and 0.9"),
    (10, 0.05, "0.05 of 10 rows leaves the training split empty: set it between 0.1 and 0.9"),
    # Nothing validates; the bounds are rounded inwards, so both still split 3 rows.
    (3, 1.0, "1.0 of 3 rows leaves the validation split empty: set it between 0.3334 and 0.6666"),
    # Too few rows for any share.
    (1, 0.9, "0.9 of 1 row leaves the training split empty: use a labels file with at least 2 rows"),
    # Not a share at all.
    (10, 1.5, "is the training share of the rows, between 0 and 1, not 1.5: set it to e.g. 0.9"),
]


@pytest.mark.parametrize(("n_rows", "ratio", "message"), EMPTY_SPLITS)
def test_empty_split_refused(n_rows: int, ratio: float, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        split_indices(n_rows, ratio, seed=0)
    key = "DATA.H5.TRAIN_VAL_SPLIT_RATIO"
    assert caught.value.problems == [(key, f"{key} {message}")]


def _read_in_child(labels: LabelsFile, blob: bytes, queue: Any) -> None:
    # The inherited object (its parent's handle included) and a pickled copy, as DataLoader
    # workers get them under fork and under spawn.
    queue.put((labels.row(2).identifier, pickle.loads(blob).rows([3, 1]).identifiers))


def test_pickled_and_read_in_forked_child(labels_path: Path) -> None:
    labels = LabelsFile(labels_path, TASKS, COMPONENTS)
    assert labels.row(0).identifier == "101_0.jpg"  # the parent now holds an open handle
    blob = pickle.dumps(labels)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_read_in_child, args=(labels, blob, queue))
    child.start()
    result = queue.get(timeout=30)
    child.join(timeout=30)
    assert child.exitcode == 0
    assert result == ("103_0.jpg", ["104_0.jpg", "102_0.jpg"])
    # The parent's handle still reads after the child closed its copy.
    assert labels.row(3).identifier == "104_0.jpg"


def test_memory_flat_in_rows(tmp_path: Path) -> None:
    n = 200_000
    rng = np.random.default_rng(0)
    path = write_labels_h5(
        tmp_path / "big.h5",
        [f"{i}_0.jpg" for i in range(n)],
        {key: rng.integers(1, 1000, n) for key in TASKS},
        {"temporal": np.ones((n, 2)), "spatial": np.ones((n, 3)), "elevation": np.ones((n, 4))},
    )
    smallest_column = n * 2 * 4  # temporal, float32: 1.6 MB
    budget = smallest_column // 4
    picks = np.sort(rng.choice(n, 50, replace=False))

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        labels = LabelsFile(path, TASKS, COMPONENTS)
        for i in picks[:25]:
            assert labels.row(int(i)).valid.all()
        assert len(labels.rows(picks[25:])) == 25
        reading = tracemalloc.get_traced_memory()[1] - before

        # The control: the same measure sees one metadata column read whole.
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        with h5py.File(path, "r") as f:
            f["temporal"][:]
        whole = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert whole >= smallest_column
    assert reading < budget, f"reading 50 rows peaked at {reading} bytes (budget {budget})"
