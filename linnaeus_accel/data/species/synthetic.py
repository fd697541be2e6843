"""A small synthetic species dataset in linnaeus' layout, written in well under a second: real
JPEG photos in a folder, ``labels.h5`` (``write_labels_h5``) and, on request, the same observations
as a CSV table for ``image_table`` and the photos' decoded pixels in linnaeus' ``images.h5``
(``write_images_h5``). For examples, tests and first runs without linnaeus' files.

The taxonomy (``TAXA``): 2 orders > 3 families > 6 genera > 12 species, each rank with its own
uint32 ids (species 1001-1012, genera 2001-2006, families 3001-3003, orders 4001-4002; 0 is null).
A few rows (``GENUS_ONLY_SHARE``) are identified to genus only: no species.

What tells the classes apart is built so that the photo and the metadata each carry part of it:

- the photo shows its genus: a base colour and a stripe texture per genus (random phase, tilt,
  background, brightness and noise per photo), the same for both species of a genus;
- the two species of a genus look IDENTICAL: one (``borealis``) is seen in the north (latitude 30 to
  60) in spring (April to June), mostly low down; the other (``australis``) in the south (latitude
  -60 to -30) in autumn (October to December), mostly higher up. Only the metadata separates them.

So a model that reads the metadata reaches the genus' accuracy at the species rank, and one whose
metadata is masked about half of it. A few rows lack a location, a date or an elevation (the
component is then missing, zeros), as real observations do.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import numpy.typing as npt
from PIL import Image

from .images import load_image
from .labels import import_h5py, write_labels_h5
from .metadata import encode_elevation, encode_spatial, encode_temporal
from .pixels import PIXELS_DATASET

ORDERS = ("Asterales", "Fagales")
FAMILIES = ("Asteraceae", "Campanulaceae", "Betulaceae")
FAMILY_ORDER = (0, 0, 1)
GENERA = ("Aster", "Bellis", "Campanula", "Lobelia", "Betula", "Carpinus")
GENUS_FAMILY = (0, 0, 1, 1, 2, 2)
EPITHETS = ("borealis", "australis")  # the two species of every genus, by where and when they are seen
N_SPECIES = len(GENERA) * len(EPITHETS)
TASK_KEYS = ("taxa_L10", "taxa_L20", "taxa_L30", "taxa_L40")  # finest first, as linnaeus' TASK_KEYS_H5
RANK_COLUMNS = ("species", "genus", "family", "order")  # the table's rank columns, finest first
# The image_table options that read the table this module writes (the paths aside).
TABLE_OPTIONS: dict[str, object] = {
    "image_column": "image",
    "rank_columns": list(RANK_COLUMNS),
    "latitude_column": "latitude",
    "longitude_column": "longitude",
    "date_column": "date",
    "elevation_column": "elevation",
}
ELEVATION_SOURCE = "elevation_broadrange_2"  # linnaeus' default ELEVATION.SOURCE (10 columns)
GENUS_ONLY_SHARE = 0.05
MISSING_SHARE = {"location": 0.04, "date": 0.04, "elevation": 0.08}
JPEG_QUALITY = 90
_FULL_SCALE = 1 << 16  # a model side no photo reaches: load_image decodes a JPEG at full scale for it

# One colour per genus (RGB): far apart, so a photo's genus survives noise, crops and flips.
_COLOURS = np.array(
    [[220, 40, 40], [40, 160, 60], [50, 80, 220], [230, 200, 30], [180, 60, 200], [30, 200, 210]],
    dtype=np.float32,
)
_STRIPES = (2.0, 3.0, 4.0, 2.5, 3.5, 5.0)  # cycles per photo, per genus
_TILTS = (0.0, 30.0, 60.0, 90.0, 120.0, 150.0)  # degrees, per genus
_LATITUDES = ((30.0, 60.0), (-60.0, -30.0))  # per epithet
_MONTHS = ((4, 5, 6), (10, 11, 12))
_ELEVATIONS = ((20.0, 900.0), (500.0, 2500.0))  # metres, overlapping: a weaker cue than the other two


def taxon_ids(species: int) -> tuple[int, int, int, int]:
    """The ids (species, genus, family, order) of species ``species`` (0 to 11)."""
    genus = species // len(EPITHETS)
    family = GENUS_FAMILY[genus]
    return 1001 + species, 2001 + genus, 3001 + family, 4001 + FAMILY_ORDER[family]


def taxon_names(species: int) -> tuple[str, str, str, str]:
    """The names (species, genus, family, order) of species ``species`` (0 to 11)."""
    genus = species // len(EPITHETS)
    family = GENUS_FAMILY[genus]
    binomial = f"{GENERA[genus]} {EPITHETS[species % len(EPITHETS)]}"
    return binomial, GENERA[genus], FAMILIES[family], ORDERS[FAMILY_ORDER[family]]


def _photo(genus: int, size: int, rng: np.random.Generator) -> npt.NDArray[np.uint8]:
    """A ``size`` x ``size`` RGB photo of genus ``genus``: its colour in stripes over a random background."""
    coords = (np.arange(size, dtype=np.float32) + 0.5) / size
    x, y = np.meshgrid(coords, coords)
    tilt = math.radians(_TILTS[genus] + rng.normal(0.0, 8.0))
    wave = 2.0 * math.pi * _STRIPES[genus] * (x * math.cos(tilt) + y * math.sin(tilt))
    stripes = 0.5 + 0.5 * np.sin(wave + rng.uniform(0.0, 2.0 * math.pi))
    weight = np.clip(1.4 * stripes - 0.2, 0.0, 1.0)[..., None]
    background = rng.uniform(60.0, 190.0) + rng.normal(0.0, 15.0, size=3).astype(np.float32)
    pixels = weight * _COLOURS[genus] + (1.0 - weight) * background
    pixels = pixels * rng.uniform(0.8, 1.15) + rng.normal(0.0, 10.0, size=pixels.shape)
    photo: npt.NDArray[np.uint8] = np.clip(pixels, 0.0, 255.0).astype(np.uint8)
    return photo


def write_synthetic_species(
    root: Path, rows: int = 240, seed: int = 0, *, size: int = 48, table: bool = False, pixels: bool = False
) -> dict[str, Path]:
    """Write ``rows`` observations under ``root`` (created if needed): ``root/images/obs_NNNNN.jpg``
    (``size`` x ``size`` JPEGs), ``root/labels.h5`` (linnaeus' layout: ``img_identifiers``,
    ``taxa_L10`` to ``taxa_L40``, ``spatial``, ``temporal`` and ``elevation_broadrange_2``) and, with
    ``table``, ``root/observations.csv`` (the same rows, taxa by name; ``TABLE_OPTIONS`` reads it)
    and, with ``pixels``, ``root/images.h5`` (the JPEGs decoded, ``write_images_h5``).

    The same ``seed`` writes the same files. Species are balanced (``rows`` // 12 each, the rest
    to the first ones). Returns the paths written: ``images``, ``labels`` and, with ``table`` and
    ``pixels``, ``table`` and ``pixels``.
    """
    if rows < 1:
        raise ValueError(f"rows must be at least 1, not {rows}")
    if size < 8:
        raise ValueError(f"size must be at least 8 pixels, not {size}")
    root = Path(root)
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    species = rng.permutation(np.arange(rows) % N_SPECIES)
    epithet = species % len(EPITHETS)
    names = [f"obs_{i:05d}.jpg" for i in range(rows)]
    for name, s in zip(names, species.tolist(), strict=True):
        Image.fromarray(_photo(s // len(EPITHETS), size, rng)).save(images / name, quality=JPEG_QUALITY)

    low, high = np.array(_LATITUDES).T
    latitude = rng.uniform(low[epithet], high[epithet])
    longitude = rng.uniform(-180.0, 180.0, size=rows)
    month = np.array(_MONTHS)[epithet, rng.integers(0, 3, size=rows)]
    year = rng.integers(2015, 2024, size=rows)
    day = rng.integers(1, 29, size=rows)
    dates = np.array(
        [f"{y:04d}-{m:02d}-{d:02d}" for y, m, d in zip(year, month, day, strict=True)], dtype=object
    )
    low, high = np.array(_ELEVATIONS).T
    elevation = rng.uniform(low[epithet], high[epithet])

    # What observations lack: a location, a date, an elevation, the species (to genus only).
    no_location = rng.random(rows) < MISSING_SHARE["location"]
    latitude[no_location] = longitude[no_location] = np.nan
    dates[rng.random(rows) < MISSING_SHARE["date"]] = None
    elevation[rng.random(rows) < MISSING_SHARE["elevation"]] = np.nan
    genus_only = rng.random(rows) < GENUS_ONLY_SHARE

    ids = np.array([taxon_ids(s) for s in species.tolist()], dtype=np.uint32).reshape(rows, len(TASK_KEYS))
    ids[genus_only, 0] = 0
    spatial, _ = encode_spatial(latitude, longitude)
    temporal, _ = encode_temporal(dates, "month")
    heights, _ = encode_elevation(elevation)
    labels = write_labels_h5(
        root / "labels.h5",
        names,
        {key: ids[:, r] for r, key in enumerate(TASK_KEYS)},
        {"spatial": spatial, "temporal": temporal, ELEVATION_SOURCE: heights},
    )
    written = {"images": images, "labels": labels}
    if table:
        written["table"] = _write_table(
            root / "observations.csv", names, species, genus_only, latitude, longitude, dates, elevation
        )
    if pixels:
        written["pixels"] = write_images_h5(root / "images.h5", [images / name for name in names])
    return written


def write_images_h5(path: Path, photos: list[Path]) -> Path:
    """Write ``photos`` (image files, all of one size) decoded, in linnaeus' ``images.h5`` layout:
    one dataset ``images``, uint8 of shape (photos, height, width, 3), row i the pixels of
    ``photos[i]`` as training decodes them from the file (EXIF orientation applied), one chunk a
    row so that a row is read alone."""
    first = np.asarray(load_image(photos[0], _FULL_SCALE))
    with import_h5py().File(path, "w") as f:
        dataset = f.create_dataset(
            PIXELS_DATASET, shape=(len(photos), *first.shape), dtype=np.uint8, chunks=(1, *first.shape)
        )
        for i, photo in enumerate(photos):
            pixels = first if i == 0 else np.asarray(load_image(photo, _FULL_SCALE))
            if pixels.shape != first.shape:
                raise ValueError(
                    f"{photo} is {pixels.shape}, not {first.shape} as {photos[0]}: one size for all"
                )
            dataset[i] = pixels
    return path


def _write_table(
    path: Path,
    names: list[str],
    species: npt.NDArray[np.int64],
    genus_only: npt.NDArray[np.bool_],
    latitude: npt.NDArray[np.float64],
    longitude: npt.NDArray[np.float64],
    dates: npt.NDArray[np.object_],
    elevation: npt.NDArray[np.float64],
) -> Path:
    def cell(value: float) -> str:
        return "" if math.isnan(value) else f"{value:.5f}"

    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(
            [TABLE_OPTIONS["image_column"], *RANK_COLUMNS, "latitude", "longitude", "date", "elevation"]
        )
        for i, name in enumerate(names):
            taxa = list(taxon_names(int(species[i])))
            if genus_only[i]:
                taxa[0] = ""
            date = dates[i] if dates[i] is not None else ""
            writer.writerow([name, *taxa, cell(latitude[i]), cell(longitude[i]), date, cell(elevation[i])])
    return path
