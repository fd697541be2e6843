"""linnaeus' ``labels.h5``, read a few rows at a time.

The file holds one row per image: ``img_identifiers`` (the image file names), one ``taxa_LXX``
dataset of uint32 taxon ids per rank (0 = no label at that rank) and one float dataset per
metadata component, named by the component's ``SOURCE`` (an all-zero row = no data for that image).

A labels file of a real dataset has millions of rows, and every DataLoader worker of every process
opens it: ``LabelsFile`` reads only shapes and dtypes when it is made, and rows when they are asked
for, so its memory does not grow with the file. The taxa columns alone are read whole
(``taxa_columns``), once, to build the taxonomy: 4 bytes a row per rank.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ...config import ConfigError
from ...config.duration import decimal_of
from ..paths import resolved
from .metadata import validity_from_rows

SPECIES_EXTRA = "pip install 'linnaeus-accel[species]'"
IDENTIFIERS = "img_identifiers"
LABELS_KEY = "DATA.H5.LABELS_PATH"
TASKS_KEY = "DATA.TASK_KEYS_H5"
SPLIT_KEY = "DATA.H5.TRAIN_VAL_SPLIT_RATIO"
COMPONENTS_KEY = "DATA.META.COMPONENTS"
Found = Mapping[str, tuple[tuple[int, ...], np.dtype[Any]]]


def import_h5py(key: str = LABELS_KEY) -> Any:
    """h5py, an optional extra (the rest of the package imports without it); missing, a
    ConfigError under ``key``, the config key that names the file to read."""
    try:
        import h5py  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigError([(key, f"reading an HDF5 file needs h5py: {SPECIES_EXTRA}")]) from None
    return h5py


class ProcessLocalH5:
    """An HDF5 file at ``path`` read through one h5py handle per process, opened on first use: a
    handle survives neither fork (DataLoader workers) nor pickling, so a copy is handed the path.
    ``key``: the config key that names the file, in the message of a missing h5py."""

    def __init__(self, path: str | Path, key: str = LABELS_KEY) -> None:
        self.path, self.key = Path(path), key
        self._handle: Any = None
        self._pid: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handle"] = None
        state["_pid"] = None
        return state

    def close(self) -> None:
        """Close this process's handle; the next read opens it again."""
        if self._handle is not None and self._pid == os.getpid():
            self._handle.close()
        self._handle = None
        self._pid = None

    def _file(self) -> Any:
        pid = os.getpid()
        if self._handle is None or self._pid != pid:
            self._handle = import_h5py(self.key).File(self.path, "r")
            self._pid = pid
        return self._handle


@dataclass(frozen=True)
class ComponentSpec:
    """One metadata component of ``DATA.META.COMPONENTS``.

    ``name`` is its key there (``SPATIAL``), ``source`` the dataset of the labels file that holds
    it, ``dim`` its width, ``idx`` its place in the concatenated metadata vector (ascending), and
    ``allow_missing`` whether a row may lack it (an all-zero row).
    """

    name: str
    source: str
    dim: int
    idx: int
    allow_missing: bool = True


@dataclass(frozen=True, eq=False)
class LabelRow:
    """One row: ``taxa`` maps each task key to its taxon id (0 = null); ``meta`` is the components
    concatenated in IDX order (float32, zeros where missing); ``valid`` has one flag per component,
    in the same order."""

    index: int
    identifier: str
    taxa: dict[str, int]
    meta: npt.NDArray[np.float32]
    valid: npt.NDArray[np.bool_]


@dataclass(frozen=True, eq=False)
class LabelRows:
    """Rows in the order asked for: ``taxa`` (n,) uint32 per task key, ``meta`` (n, meta_dim)
    float32, ``valid`` (n, components) bool."""

    indices: npt.NDArray[np.int64]
    identifiers: list[str]
    taxa: dict[str, npt.NDArray[np.uint32]]
    meta: npt.NDArray[np.float32]
    valid: npt.NDArray[np.bool_]

    def __len__(self) -> int:
        return len(self.identifiers)

    def __getitem__(self, i: int) -> LabelRow:
        return LabelRow(
            index=int(self.indices[i]),
            identifier=self.identifiers[i],
            taxa={key: int(ids[i]) for key, ids in self.taxa.items()},
            meta=self.meta[i],
            valid=self.valid[i],
        )


class LabelsFile(ProcessLocalH5):
    """A linnaeus ``labels.h5``, checked against the config when made, read on demand.

    ``path`` is ``DATA.H5.LABELS_PATH``; ``task_keys`` is ``DATA.TASK_KEYS_H5``; ``components`` are
    the enabled ``DATA.META.COMPONENTS`` (in any order: they are concatenated by IDX). Every problem
    found is raised at once, as one ``ConfigError``.
    """

    def __init__(
        self, path: str | Path, task_keys: Sequence[str], components: Iterable[ComponentSpec]
    ) -> None:
        super().__init__(path)
        self.task_keys = list(task_keys)
        self.components = tuple(sorted(components, key=lambda c: c.idx))
        self.n_rows = self._check()
        self.component_slices: dict[str, slice] = {}
        start = 0
        for c in self.components:
            self.component_slices[c.name] = slice(start, start + c.dim)
            start += c.dim
        self.meta_dim = start

    def __len__(self) -> int:
        return self.n_rows

    def __repr__(self) -> str:
        return f"LabelsFile({str(self.path)!r}, {self.n_rows} rows)"

    def _check(self) -> int:
        """The number of rows, once every dataset the config names is there with the right shape."""
        h5py = import_h5py()
        name = str(self.path)
        try:
            f = h5py.File(self.path, "r")
        except FileNotFoundError:
            raise ConfigError(
                [(LABELS_KEY, f"{name} does not exist{resolved(name)}: point {LABELS_KEY} at a labels.h5")]
            ) from None
        except OSError as exc:
            raise ConfigError(
                [(LABELS_KEY, f"{name} cannot be read as HDF5 ({exc}): point {LABELS_KEY} at a labels.h5")]
            ) from None
        with f:
            # Shapes and dtypes only: no dataset is read here.
            found = {key: (f[key].shape, f[key].dtype) for key in f if isinstance(f[key], h5py.Dataset)}
            strings = IDENTIFIERS in found and h5py.check_string_dtype(found[IDENTIFIERS][1]) is not None
        problems = self._identifier_problems(found, strings)
        problems += self._taxa_problems(found)
        problems += self._component_problems(found)
        problems += self._length_problems(found)
        if problems:
            raise ConfigError(problems)
        return int(found[IDENTIFIERS][0][0])

    def _identifier_problems(self, found: Found, strings: bool) -> list[tuple[str, str]]:
        if IDENTIFIERS not in found:
            return [
                (
                    LABELS_KEY,
                    f"{self.path} has no {IDENTIFIERS} dataset (the image file name of each row): "
                    "add it to the file, one string per row",
                )
            ]
        shape, dtype = found[IDENTIFIERS]
        if strings and len(shape) == 1:
            return []
        return [
            (
                LABELS_KEY,
                f"{self.path}: {IDENTIFIERS} holds {dtype} of shape {shape}, not one string per row: "
                "write the image file names as strings",
            )
        ]

    def _taxa_problems(self, found: Found) -> list[tuple[str, str]]:
        present = sorted(key for key in found if key.startswith("taxa_L"))
        has = f"it has {', '.join(present)}" if present else "it has no taxa_LXX dataset"
        problems: list[tuple[str, str]] = []
        for key in self.task_keys:
            if key not in found:
                problems.append(
                    (
                        TASKS_KEY,
                        f"{self.path} has no {key} dataset ({has}): "
                        f"remove {key} from {TASKS_KEY} or use a file with that rank",
                    )
                )
            elif found[key][1].kind not in "ui" or len(found[key][0]) != 1:
                shape, dtype = found[key]
                problems.append(
                    (
                        TASKS_KEY,
                        f"{self.path}: {key} holds {dtype} of shape {shape}, not one integer taxon id per row: "
                        "write it as uint32 of shape (rows,)",
                    )
                )
        return problems

    def _component_problems(self, found: Found) -> list[tuple[str, str]]:
        problems: list[tuple[str, str]] = []
        by_idx: dict[int, str] = {}
        others = (
            ", ".join(sorted(k for k in found if k != IDENTIFIERS and not k.startswith("taxa_L"))) or "none"
        )
        for c in self.components:
            key = f"{COMPONENTS_KEY}.{c.name}"
            if c.idx in by_idx:
                problems.append(
                    (
                        f"{key}.IDX",
                        f"{by_idx[c.idx]} and {c.name} share IDX {c.idx}, so their order in the metadata "
                        "vector is undefined: give each component its own IDX",
                    )
                )
            by_idx.setdefault(c.idx, c.name)
            if c.source not in found:
                problems.append(
                    (
                        f"{key}.SOURCE",
                        f"{self.path} has no {c.source} dataset for {c.name} (its other datasets: {others}): "
                        f"set SOURCE to the dataset that holds {c.name} or disable the component",
                    )
                )
                continue
            shape, dtype = found[c.source]
            if dtype.kind not in "fiu" or len(shape) not in (1, 2):
                problems.append(
                    (
                        f"{key}.SOURCE",
                        f"{self.path}: {c.source} holds {dtype} of shape {shape}, not a row of numbers per "
                        f"image: point SOURCE at a float dataset of shape (rows, {c.dim})",
                    )
                )
                continue
            width = shape[1] if len(shape) == 2 else 1
            if width != c.dim:
                problems.append(
                    (
                        f"{key}.DIM",
                        f"{self.path}: {c.source} is {width} wide but {c.name}.DIM is {c.dim}: "
                        f"set DIM to {width} or point SOURCE at a {c.dim}-wide dataset",
                    )
                )
        return problems

    def _length_problems(self, found: Found) -> list[tuple[str, str]]:
        used = [IDENTIFIERS, *self.task_keys, *(c.source for c in self.components)]
        lengths = {key: found[key][0][0] for key in dict.fromkeys(used) if key in found and found[key][0]}
        if len(set(lengths.values())) <= 1:
            return []
        counts = ", ".join(f"{key} {n}" for key, n in lengths.items())
        return [
            (
                LABELS_KEY,
                f"{self.path}: its datasets have different numbers of rows ({counts}): "
                "rewrite the file with one row per image in every dataset",
            )
        ]

    def taxa_columns(self) -> dict[str, npt.NDArray[np.uint32]]:
        """Every row's taxon id, per task key: the whole columns (4 bytes a row per rank)."""
        # A handle of its own, closed at once: the process that builds the taxonomy then holds none
        # when it forks its DataLoader workers.
        with import_h5py().File(self.path, "r") as f:
            return {key: np.asarray(f[key][()], dtype=np.uint32) for key in self.task_keys}

    def row(self, index: int) -> LabelRow:
        """Row ``index`` (0 <= index < n_rows)."""
        return self.rows([index])[0]

    def rows(self, indices: Sequence[int] | npt.NDArray[np.integer[Any]]) -> LabelRows:
        """The rows at ``indices``, in that order (repeats allowed)."""
        wanted = row_indices(indices, self.n_rows, str(self.path))
        unique, inverse = np.unique(wanted, return_inverse=True)
        f = self._file() if unique.size else None

        def read(dataset: str) -> npt.NDArray[Any]:
            if f is None:
                return np.empty((0,), dtype=np.float32)
            if int(unique[-1]) - int(unique[0]) + 1 == unique.size:
                # A contiguous run: one hyperslab, cheaper than a point selection.
                data = f[dataset][int(unique[0]) : int(unique[-1]) + 1]
            else:
                data = f[dataset][unique]
            return np.asarray(data)[inverse]

        identifiers = [_text(value) for value in read(IDENTIFIERS)]
        taxa = {key: read(key).astype(np.uint32, copy=False) for key in self.task_keys}
        n = wanted.size
        parts: list[npt.NDArray[np.float32]] = []
        valid = np.zeros((n, len(self.components)), dtype=bool)
        for j, c in enumerate(self.components):
            values = read(c.source).reshape(n, c.dim).astype(np.float32, copy=False)
            # linnaeus' elevation files mark a missing value as sin/cos of 0 m, not as zeros.
            valid[:, j] = validity_from_rows(values, elevation_pattern=c.source.startswith("elevation"))
            values = np.where(valid[:, j, None], values, np.float32(0.0))  # a missing value is never fed
            if not c.allow_missing and not valid[:, j].all():
                first = int(np.argmin(valid[:, j]))
                raise ConfigError(
                    [
                        (
                            f"{COMPONENTS_KEY}.{c.name}.ALLOW_MISSING",
                            f"{self.path}: row {int(wanted[first])} ({identifiers[first]}) has no "
                            f"{c.source} data (an all-zero row) and {c.name}.ALLOW_MISSING is false: "
                            "set ALLOW_MISSING to true or drop the rows without it from the file",
                        )
                    ]
                )
            parts.append(values)
        meta = np.concatenate(parts, axis=1) if parts else np.zeros((n, 0), dtype=np.float32)
        return LabelRows(indices=wanted, identifiers=identifiers, taxa=taxa, meta=meta, valid=valid)


def row_indices(
    indices: Sequence[int] | npt.NDArray[np.integer[Any]], n_rows: int, where: str
) -> npt.NDArray[np.int64]:
    """``indices`` as int64, each a row of ``where`` (``n_rows`` rows), or an IndexError naming it."""
    wanted = np.asarray(indices, dtype=np.int64).reshape(-1)
    outside = wanted[(wanted < 0) | (wanted >= n_rows)]
    if outside.size:
        raise IndexError(f"row {int(outside[0])} is outside {where} ({n_rows} rows, 0 to {n_rows - 1})")
    return wanted


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def split_indices(
    n_rows: int, ratio: float, seed: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(train, val)`` row indices, each ascending: a permutation by ``seed`` whose first
    ``floor(ratio * n_rows)`` rows train. ``ratio`` is the training share (``DATA.H5.TRAIN_VAL_SPLIT_RATIO``).

    The same seed gives the same split in every process and every run, so no rank and no resumed
    run validates on rows another trained on.
    """
    if not 0 <= ratio <= 1:  # NaN too
        raise ConfigError(
            [
                (
                    SPLIT_KEY,
                    f"{SPLIT_KEY} is the training share of the rows, between 0 and 1, not {ratio}: "
                    "set it to e.g. 0.9",
                )
            ]
        )
    # Exact decimal arithmetic: 0.29 of 100 rows is 29 rows, not the float 28.999...
    n_train = int((decimal_of(ratio) * n_rows).to_integral_value(rounding=ROUND_FLOOR))
    if not 0 < n_train < n_rows:
        empty = "training" if n_train == 0 else "validation"
        rows = "row" if n_rows == 1 else "rows"
        if n_rows < 2:
            fix = "use a labels file with at least 2 rows"
        else:
            # 4 decimals, rounded inwards so that both ends leave a row on each side.
            step = Decimal("0.0001")
            low = (Decimal(1) / n_rows).quantize(step, rounding=ROUND_CEILING)
            high = (Decimal(n_rows - 1) / n_rows).quantize(step, rounding=ROUND_FLOOR)
            fix = f"set it between {low.normalize():f} and {high.normalize():f}"
        raise ConfigError(
            [(SPLIT_KEY, f"{SPLIT_KEY} {ratio} of {n_rows} {rows} leaves the {empty} split empty: {fix}")]
        )
    order = np.random.default_rng(seed).permutation(n_rows)
    return np.sort(order[:n_train]).astype(np.int64), np.sort(order[n_train:]).astype(np.int64)


def write_labels_h5(
    path: str | Path,
    identifiers: Sequence[str],
    taxa: Mapping[str, npt.ArrayLike],
    metadata: Mapping[str, npt.ArrayLike],
) -> Path:
    """Write a labels file as linnaeus lays it out, uncompressed: ``identifiers`` as UTF-8 strings,
    ``taxa`` (``taxa_LXX`` -> ids) as uint32, ``metadata`` (SOURCE -> rows × width) as float32.

    Nothing is checked, so a malformed file can be written on purpose; ``LabelsFile`` checks it.
    """
    h5py = import_h5py()
    path = Path(path)
    with h5py.File(path, "w") as f:
        f.create_dataset(
            IDENTIFIERS, data=np.array(list(identifiers), dtype=object), dtype=h5py.string_dtype()
        )
        for key, ids in taxa.items():
            f.create_dataset(key, data=np.asarray(ids, dtype=np.uint32))
        for source, values in metadata.items():
            f.create_dataset(source, data=np.asarray(values, dtype=np.float32))
    return path
