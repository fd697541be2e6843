"""The built-in datasets: scikit-learn's 1,797 handwritten digits (8x8, 0..16), read from the copy
that ships inside the scikit-learn package, so nothing is downloaded.

It is shaped like linnaeus' data so that every schedule has something real to act on:

- two label levels: ``shape`` (coarse: loops 0/6/8/9, strokes 1/4/7, curves 2/3/5) above ``digit``;
- the model sees only the top ``VISIBLE_ROWS`` rows of each image (the rest is zero), while three
  metadata components are measured on the whole image: ``ROWS`` (ink per row, 8 values), ``COLS``
  (ink per column, 8) and ``MOMENTS`` (ink total, centroid and spread, 5). So the metadata carries
  information the pixels do not, as location and date do for a partial photo of a species, and
  masking it costs accuracy (about 95% of digits right with it, 87% with all of it masked).

``digits_images`` is the plain variant: the same images and split, whole, with the digit as the
only label, for models that take pixels alone (``digits_convnet``).

The train/val split is fixed (a permutation seeded by 0, independent of ``EXPERIMENT.SEED``), so
that runs with different seeds are validated on the same images.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..config import Config, ConfigError
from ..config.sections import DatasetConfig
from ..schedule.steps import decimal_of, round_half_up
from .registry import Split, register_dataset

LEVELS = ("shape", "digit")
SHAPE_OF_DIGIT = (0, 1, 2, 2, 1, 2, 0, 1, 0, 0)  # 0 loops, 1 strokes, 2 curves
SHAPE_NAMES = ("loops", "strokes", "curves")
META_COMPONENTS = ("ROWS", "COLS", "MOMENTS")
NUM_CLASSES = {"shape": 3, "digit": 10}
VISIBLE_ROWS = 4


@lru_cache(maxsize=1)
def load_digits_array() -> tuple[np.ndarray, np.ndarray]:
    """Pixels (N, 64) as float32 in [0, 16] and labels (N,) as int64."""
    spec = importlib.util.find_spec("sklearn")
    csv = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if csv is not None and csv.exists():
        raw = np.loadtxt(csv, delimiter=",", dtype=np.float32)
        return raw[:, :-1], raw[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # the file moved: let scikit-learn find it

    bunch = load_digits()
    return bunch.data.astype(np.float32), bunch.target.astype(np.int64)


def metadata(pixels: np.ndarray) -> dict[str, np.ndarray]:
    images = pixels.reshape(-1, 8, 8) / 16.0
    ink = images.sum(axis=(1, 2)) + 1e-6
    coords = np.arange(8, dtype=np.float32)
    rows, cols = images.sum(axis=2), images.sum(axis=1)
    cy, cx = (rows * coords).sum(1) / ink, (cols * coords).sum(1) / ink
    sy = np.sqrt((rows * (coords - cy[:, None]) ** 2).sum(1) / ink)
    sx = np.sqrt((cols * (coords - cx[:, None]) ** 2).sum(1) / ink)
    moments = np.stack([ink / 32.0, cy / 7.0, cx / 7.0, sy / 3.5, sx / 3.5], axis=1)
    return {"ROWS": rows / 8.0, "COLS": cols / 8.0, "MOMENTS": moments.astype(np.float32)}


def split_indices(n: int, val_fraction: float) -> dict[str, np.ndarray]:
    order = np.random.default_rng(0).permutation(n)
    n_val = round_half_up(decimal_of(val_fraction) * n)
    return {"val": np.sort(order[:n_val]), "train": np.sort(order[n_val:])}


class DigitsDataset(Dataset[dict[str, Any]]):
    levels = LEVELS
    num_classes = NUM_CLASSES
    meta_components = META_COMPONENTS

    def __init__(self, split: Split, val_fraction: float = 0.2) -> None:
        pixels, digits = load_digits_array()
        idx = split_indices(len(pixels), val_fraction)[split]
        meta = metadata(pixels[idx])
        images = pixels[idx].reshape(-1, 1, 8, 8) / 16.0
        images[:, :, VISIBLE_ROWS:, :] = 0.0
        self.images = torch.from_numpy(images)
        self.meta = {k: torch.from_numpy(v.astype(np.float32)) for k, v in meta.items()}
        digit = torch.from_numpy(digits[idx])
        shape = torch.tensor(SHAPE_OF_DIGIT)[digit]
        self.labels = torch.stack([shape, digit], dim=1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "index": i,
            "image": self.images[i],
            "meta": {k: v[i] for k, v in self.meta.items()},
            "labels": self.labels[i],
        }


class DigitsImages(Dataset[dict[str, torch.Tensor]]):
    """The same images and split as ``DigitsDataset``, whole (no hidden rows), with one label: the
    digit. A plain image-classification task, for models that take only pixels."""

    num_classes = 10

    def __init__(self, split: Split, val_fraction: float = 0.2) -> None:
        pixels, digits = load_digits_array()
        idx = split_indices(len(pixels), val_fraction)[split]
        self.images = torch.from_numpy(pixels[idx].reshape(-1, 1, 8, 8) / 16.0)
        self.labels = torch.from_numpy(digits[idx])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": self.images[i], "labels": self.labels[i]}


def _check_no_options(dataset: DatasetConfig, name: str) -> None:
    if dataset.OPTIONS:
        raise ConfigError(
            [
                (
                    "DATA.DATASET.OPTIONS",
                    f"the {name} dataset takes no options (got {sorted(dataset.OPTIONS)})",
                )
            ]
        )


@register_dataset("digits")
def build_digits(config: Config, split: Split) -> DigitsDataset:
    _check_no_options(config.DATA.DATASET, "digits")
    return DigitsDataset(split, val_fraction=config.DATA.DATASET.VAL_FRACTION)


@register_dataset("digits_images")
def build_digits_images(config: Config, split: Split) -> DigitsImages:
    _check_no_options(config.DATA.DATASET, "digits_images")
    return DigitsImages(split, val_fraction=config.DATA.DATASET.VAL_FRACTION)
