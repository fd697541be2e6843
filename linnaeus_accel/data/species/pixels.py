"""Where a species dataset finds its photos: a folder of image files (``PhotoFolder``, linnaeus'
``DATA.HYBRID``) or the decoded pixels in linnaeus' ``images.h5`` (``PixelsFile``,
``DATA.H5.IMAGES_PATH``).

``images.h5`` holds one dataset, ``images``: uint8 of shape (rows, height, width, 3), RGB, row i
the photo of row i of ``labels.h5``. A row becomes a Pillow image and then takes the same
``ImageTransforms`` as a decoded file, so a sample is the same tensor whichever source holds the
photo, given the same pixels. Grayscale rows, (rows, height, width) or (rows, height, width, 1),
are read as RGB.

A real ``images.h5`` holds hundreds of gigabytes and every DataLoader worker reads it:
``PixelsFile`` reads only the dataset's shape and dtype when it is made, rows when they are asked
for, and opens the file once per process on first use (an h5py handle survives neither fork nor
pickling), so a worker is handed a path, never pixels.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from PIL import Image

from ...config import ConfigError
from ..paths import resolved
from .images import ImageProblem, load_image
from .labels import ProcessLocalH5, import_h5py, row_indices

IMAGES_KEY = "DATA.HYBRID.IMAGES_DIR"
PIXELS_KEY = "DATA.H5.IMAGES_PATH"
PIXELS_DATASET = "images"
EXPECTED = "uint8 of shape (rows, height, width, 3), RGB"

Photo = Image.Image | ImageProblem  # a photo, or why its file cannot be decoded


class ImageSource(Protocol):
    """What ``SpeciesDataset`` reads its photos from: ``PhotoFolder``, ``PixelsFile`` or a Hugging
    Face dataset's image column (``hf_images.HFImages``)."""

    def check(self, rows: npt.NDArray[np.int64], identifier: Callable[[int], str]) -> None:
        """Before training: every photo of the split (``rows`` of the labels, ``identifier`` giving
        a row's image identifier) can be found, or a ``ConfigError`` naming the first that cannot."""
        ...

    def read(self, rows: Sequence[int], identifiers: Sequence[str], size: int) -> list[Photo]:
        """The photos of ``rows`` (rows of the labels, repeats allowed) in that order; ``size`` is
        the model's input side (a large JPEG is decoded at a reduced scale)."""
        ...


class PhotoFolder:
    """Photos at ``directory / identifier``, ``extension`` appended to an identifier that has none
    (linnaeus' ``FILE_EXTENSION``). ``key``: the config key that names the folder, in messages."""

    def __init__(self, directory: str | Path, extension: str = "", key: str = IMAGES_KEY) -> None:
        self.directory, self.extension, self.key = Path(directory), extension, key

    def __repr__(self) -> str:
        return f"PhotoFolder({str(self.directory)!r})"

    def path(self, identifier: str) -> Path:
        name = identifier if Path(identifier).suffix or not self.extension else identifier + self.extension
        return self.directory / name

    def missing(
        self, rows: npt.NDArray[np.int64], identifier: Callable[[int], str], most: int = 5
    ) -> list[tuple[int, Path]]:
        """Up to ``most`` (row, path) whose photo is not in the folder: one listing of each folder the
        identifiers name, not one stat per photo (a split holds millions)."""
        listed: dict[Path, set[str]] = {}
        missing: list[tuple[int, Path]] = []
        for row in rows.tolist():
            path = self.path(identifier(row))
            names = listed.get(path.parent)
            if names is None:
                names = listed[path.parent] = set(os.listdir(path.parent)) if path.parent.is_dir() else set()
            if path.name not in names:
                missing.append((row, path))
                if len(missing) >= most:
                    break
        return missing

    def check(self, rows: npt.NDArray[np.int64], identifier: Callable[[int], str]) -> None:
        missing = self.missing(rows, identifier)
        if missing:
            first = ", ".join(f"{path} (row {row})" for row, path in missing)
            raise ConfigError(
                [
                    (
                        self.key,
                        f"{len(missing)}{'+' if len(missing) >= 5 else ''} photo(s) of the labels are not in "
                        f"{self.directory}: {first}; put them there, or point {self.key} at the folder "
                        "that holds them",
                    )
                ]
            )

    def read(self, rows: Sequence[int], identifiers: Sequence[str], size: int) -> list[Photo]:
        photos: list[Photo] = []
        for identifier in identifiers:
            try:
                photos.append(load_image(self.path(identifier), size))
            except ImageProblem as problem:
                photos.append(problem)
        return photos


class PixelsFile(ProcessLocalH5):
    """linnaeus' ``images.h5`` at ``path`` (``DATA.H5.IMAGES_PATH``), checked when made against the
    labels it goes with: ``labels`` (their file, named in messages) of ``n_rows`` rows."""

    def __init__(self, path: str | Path, n_rows: int, labels: str | Path = "labels.h5") -> None:
        super().__init__(path, PIXELS_KEY)
        self.labels = Path(labels)
        self.shape = self._check(n_rows)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"PixelsFile({str(self.path)!r}, {self.shape[0]} rows)"

    def _dataset(self) -> Any:
        return self._file()[PIXELS_DATASET]

    def _check(self, n_rows: int) -> tuple[int, ...]:
        """The ``images`` dataset's shape, once it holds one uint8 photo for each row of the labels."""
        h5py = import_h5py(PIXELS_KEY)
        name = str(self.path)
        if not self.path.is_file():
            raise ConfigError(
                [
                    (
                        PIXELS_KEY,
                        f"{name} {'is a folder' if self.path.is_dir() else 'does not exist'}{resolved(name)}: "
                        f"point {PIXELS_KEY} at linnaeus' images.h5, "
                        "or read the photos from a folder (DATA.HYBRID.USE_HYBRID true and DATA.HYBRID.IMAGES_DIR)",
                    )
                ]
            )
        try:
            f = h5py.File(self.path, "r")
        except OSError as exc:
            raise ConfigError(
                [(PIXELS_KEY, f"{name} cannot be read as HDF5 ({exc}): point {PIXELS_KEY} at an images.h5")]
            ) from None
        with f:
            # Shape and dtype only: no pixel is read here.
            found = {key: f[key] for key in f if isinstance(f[key], h5py.Dataset)}
            if PIXELS_DATASET not in found:
                has = f"it has {', '.join(sorted(found))}" if found else "it holds no dataset"
                raise ConfigError(
                    [
                        (
                            PIXELS_KEY,
                            f"{name} has no {PIXELS_DATASET} dataset ({has}): write the photos' pixels there "
                            f"as {EXPECTED}, one row per row of the labels",
                        )
                    ]
                )
            shape, dtype = tuple(found[PIXELS_DATASET].shape), found[PIXELS_DATASET].dtype
        photos = len(shape) == 3 or (len(shape) == 4 and shape[3] in (1, 3))
        if dtype != np.uint8 or not photos:
            raise ConfigError(
                [
                    (
                        PIXELS_KEY,
                        f"{name}: {PIXELS_DATASET} holds {dtype} of shape {shape}, not {EXPECTED}: write the "
                        "decoded photos as such (grayscale as (rows, height, width) is read too)",
                    )
                ]
            )
        if shape[0] != n_rows:
            raise ConfigError(
                [
                    (
                        PIXELS_KEY,
                        f"{name} holds {shape[0]} photos but {self.labels} holds {n_rows} rows, and photo i "
                        f"must be that of row i: point {PIXELS_KEY} at the images.h5 written with those labels",
                    )
                ]
            )
        return shape

    def check(self, rows: npt.NDArray[np.int64], identifier: Callable[[int], str]) -> None:
        """Nothing more to look for: every row has its pixels, checked when the file was opened."""

    def read(self, rows: Sequence[int], identifiers: Sequence[str], size: int) -> list[Photo]:
        return [Image.fromarray(pixels).convert("RGB") for pixels in self.pixels(rows)]

    def pixels(self, rows: Sequence[int] | npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.uint8]:
        """The pixels of ``rows``, in that order (repeats allowed): (n, height, width, 3), or
        (n, height, width) for a grayscale file; read together, each row once."""
        wanted = row_indices(rows, self.shape[0], str(self.path))
        if not wanted.size:
            return np.empty((0, *self.shape[1:]), dtype=np.uint8)
        # h5py's point selection takes increasing, unique indices: read them so, then reorder.
        unique, inverse = np.unique(wanted, return_inverse=True)
        images = self._dataset()
        first, last = int(unique[0]), int(unique[-1])
        # A contiguous run is one hyperslab, cheaper than a point selection.
        contiguous = last - first + 1 == unique.size
        data = np.asarray(images[first : last + 1] if contiguous else images[unique], dtype=np.uint8)
        if data.ndim == 4 and data.shape[3] == 1:
            data = data[..., 0]
        out: npt.NDArray[np.uint8] = data[inverse]
        return out
