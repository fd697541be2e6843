"""Species photos and their rows from a Hugging Face ``datasets`` dataset (``image_table``'s
``hf_dataset``): a directory written by ``save_to_disk``, read offline by ``load_from_disk``.

A ``DatasetDict`` is read through its ``train`` split, a ``Dataset`` whole; training and validation
are then split from its rows by ``DATA.DATASET.VAL_FRACTION``, as a table's are. The image column
holds ``datasets.Image()`` values; the other columns are read as a table's columns are
(``table.ObservationTable``: ranks of ids or names, raw latitude, longitude, date and elevation), a
``ClassLabel`` rank by its names (its class 0 is a taxon, not a null). The rows are read once, when
the dataset is built: every column but the image's, and of the image column only each row's file
name (its identifier in messages; the row number where the dataset keeps none) and whether it has
an image at all. No photo is decoded then.

A photo is read with its batch: the row's encoded bytes, decoded as ``images.load_image`` decodes a
file (a large JPEG at a reduced scale, turned upright by its EXIF orientation, RGB), so that a
sample is the sample of the same JPEG in a folder. The dataset is memory-mapped Arrow: ``HFImages``
keeps it open in the process that built it, opens it once in any other on first use, and pickles
to a DataLoader worker as its path.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from ...config import ConfigError
from ..paths import resolved
from .images import ImageProblem, load_image
from .metadata import TemporalKind
from .pixels import Photo
from .table import DATA_EXTRA, IMAGE_KEY, OPTIONS_KEY, ObservationTable

HF_KEY = f"{OPTIONS_KEY}.hf_dataset"
SPLIT = "train"  # the split of a DatasetDict that is read
_SAVED = "a directory written by save_to_disk"
_TRUNCATED = "it is truncated (Pillow could not decode all of it)"


def import_datasets() -> ModuleType:
    """The ``datasets`` package, an optional extra: the rest of the package imports without it."""
    try:
        return importlib.import_module("datasets")
    except ImportError:
        raise ConfigError(
            [(HF_KEY, f"reading a Hugging Face dataset needs the datasets package: {DATA_EXTRA}")]
        ) from None


def load_dataset(path: Path) -> Any:
    """The ``Dataset`` saved at ``path``, or the ``train`` split of the ``DatasetDict`` saved there,
    memory-mapped (never copied into memory, whatever the dataset's size)."""
    datasets = import_datasets()
    label = str(path)
    if not path.is_dir():
        state = "is a file" if path.exists() else f"does not exist{resolved(label)}"
        raise ConfigError([(HF_KEY, f"{label} {state}: point {HF_KEY} at {_SAVED}")])
    try:
        loaded = datasets.load_from_disk(str(path), keep_in_memory=False)
    except (OSError, ValueError) as exc:
        message = f"{label} cannot be read as a Hugging Face dataset ({exc}): point {HF_KEY} at {_SAVED}"
        raise ConfigError([(HF_KEY, message)]) from None
    if isinstance(loaded, datasets.DatasetDict):
        if SPLIT not in loaded:
            splits = ", ".join(loaded) or "none"
            fix = f"save the rows to train on as its {SPLIT!r} split"
            raise ConfigError([(HF_KEY, f"{label} has no {SPLIT!r} split (its splits: {splits}): {fix}")])
        loaded = loaded[SPLIT]
    return loaded


def hf_observations(
    path: str | Path,
    *,
    image_column: str,
    rank_columns: Sequence[str],
    latitude_column: str | None = None,
    longitude_column: str | None = None,
    date_column: str | None = None,
    elevation_column: str | None = None,
    temporal: TemporalKind = "month",
) -> tuple[ObservationTable, HFImages]:
    """The rows (``ObservationTable``'s options) and the photos of the dataset saved at ``path``;
    every problem found is raised at once, as one ``ConfigError``, as a table's are."""
    path = Path(path)
    dataset = load_dataset(path)
    datasets = import_datasets()
    import pyarrow as pa  # type: ignore[import-untyped]  # datasets' own dependency

    label = str(path)
    if len(dataset) == 0:
        raise ConfigError([(HF_KEY, f"{label} has no rows: save one row per photo into it")])
    # Zero-copy slices of the memory-mapped file: the image column's bytes are never read here.
    table = dataset.with_format("arrow")[:]
    problems: list[tuple[str, str]] = []
    feature = dataset.features.get(image_column)
    if feature is not None:
        identifiers, problem = _image_column(pa, datasets, table.column(image_column), feature)
        if problem is not None:
            problems.append((IMAGE_KEY, f"{label}: column {image_column!r} {problem}"))
        # The table reads identifiers where it reads file names.
        table = table.set_column(table.column_names.index(image_column), image_column, identifiers)
    for rank in dict.fromkeys(rank_columns):
        feature = dataset.features.get(rank)
        if isinstance(feature, datasets.ClassLabel) and rank != image_column:
            index = table.column_names.index(rank)
            table = table.set_column(index, rank, _class_names(pa, table.column(index), feature.names))
    try:
        source = ObservationTable(
            path,
            image_column=image_column,
            rank_columns=rank_columns,
            latitude_column=latitude_column,
            longitude_column=longitude_column,
            date_column=date_column,
            elevation_column=elevation_column,
            temporal=temporal,
            arrow=table,
        )
    except ConfigError as exc:
        problems = [*exc.problems, *problems]
    if problems:
        raise ConfigError(problems)
    return source, HFImages(path, image_column, dataset)


def _image_column(pa: Any, datasets: ModuleType, column: Any, feature: Any) -> tuple[Any, str | None]:
    """The rows' identifiers, and what is wrong with the column, if anything."""
    if not isinstance(feature, datasets.Image):
        fix = f"set {IMAGE_KEY} to the column of images, or read photo files with table and images_dir"
        return _row_numbers(pa, len(column)), f"holds {feature}, not images (datasets.Image()): {fix}"
    identifiers, missing = _identifiers(pa, column)
    if not missing.size:
        return identifiers, None
    others = {1: "", 2: " (and 1 other row)"}.get(missing.size, f" (and {missing.size - 1} other rows)")
    return (
        identifiers,
        f"has no image at row {missing[0]}{others}: give every row its photo or drop the rows without one",
    )


def _row_numbers(pa: Any, count: int) -> Any:
    return pa.compute.cast(pa.array(np.arange(count, dtype=np.int64)), pa.string())


def _identifiers(pa: Any, images: Any) -> tuple[Any, npt.NDArray[np.int64]]:
    """Each row's file name as the dataset keeps it (the row number where it keeps none), and the
    rows with no image (None, or neither bytes nor a file)."""
    pc = pa.compute
    paths = pc.struct_field(images, "path")
    absent = pc.or_(images.is_null(), pc.and_(pc.struct_field(images, "bytes").is_null(), paths.is_null()))
    named = pc.fill_null(pc.greater(pc.utf8_length(paths), 0), False)
    identifiers = pc.if_else(named, paths, _row_numbers(pa, len(images)))
    missing: npt.NDArray[np.int64] = np.flatnonzero(absent.to_numpy()).astype(np.int64)
    return identifiers, missing


def _class_names(pa: Any, column: Any, names: Sequence[str]) -> Any:
    """A ``ClassLabel`` column as its names; its missing label, -1, as null."""
    pc = pa.compute
    known = pc.if_else(pc.less(column, 0), pa.scalar(None, column.type), column)
    return pc.take(pa.array(list(names), pa.string()), known)


class HFImages:
    """The photos of a Hugging Face dataset (``load_dataset(path)``): row i's value of
    ``image_column``. ``dataset``: that dataset, already open in this process (else opened on
    first use)."""

    def __init__(self, path: str | Path, image_column: str, dataset: Any = None) -> None:
        self.path, self.image_column = Path(path), image_column
        # Only the image column, as stored: datasets' own decoding is left out (see read).
        self._images: Any = None if dataset is None else self._view(dataset)

    def __repr__(self) -> str:
        return f"HFImages({str(self.path)!r}, {self.image_column!r})"

    def __getstate__(self) -> dict[str, Any]:
        # A worker is handed the path, never the table, whatever datasets' own pickling keeps.
        state = self.__dict__.copy()
        state["_images"] = None
        return state

    def _view(self, dataset: Any) -> Any:
        return dataset.with_format("arrow", columns=[self.image_column])

    def where(self, row: int) -> Path:
        """How a row's photo is named in messages: the dataset, indexed."""
        return Path(f"{self.path}[{row}]")

    def check(self, rows: npt.NDArray[np.int64], identifier: Callable[[int], str]) -> None:
        """Nothing more to look for: a row without an image was refused when the rows were read."""

    def read(self, rows: Sequence[int], identifiers: Sequence[str], size: int) -> list[Photo]:
        if not len(rows):
            return []
        if self._images is None:
            self._images = self._view(load_dataset(self.path))
        values = self._images[[int(row) for row in rows]].column(0).to_pylist()
        photos: list[Photo] = []
        for row, value in zip(rows, values, strict=True):
            data, file = (None, None) if value is None else (value["bytes"], value["path"])
            if data is not None:
                # Decoded as a file of these bytes would be (reduced-scale JPEG, orientation, RGB):
                # the same pixels as from a folder; datasets' own decoding reads a JPEG at full size.
                try:
                    photos.append(load_image(self.where(int(row)), size, data))
                except ImageProblem as problem:
                    photos.append(problem)
            elif file is not None:
                # An image stored as a path to its file, not embedded: read where it points.
                try:
                    photos.append(load_image(Path(file), size))
                except ImageProblem as problem:
                    photos.append(problem)
            else:
                photos.append(ImageProblem(self.where(int(row)), "the row has no image"))
        return photos
