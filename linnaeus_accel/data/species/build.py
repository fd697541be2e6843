"""The species datasets by name: ``linnaeus_h5`` (linnaeus' ``labels.h5``, selected by
``DATA.H5.LABELS_PATH``, and a folder of photos, ``DATA.HYBRID``, or their pixels in linnaeus'
``images.h5``, ``DATA.H5.IMAGES_PATH``) and ``image_table`` (a table of observations and a folder of
photos). Both give the ``hierarchical`` task one head per rank.

The taxonomy is built from every row of the file or table, before the split, as linnaeus builds
its class indices: training and validation share them, and so does every process. The photos'
transforms are ``DATA.IMG_SIZE`` and these ``DATA.DATASET.OPTIONS`` (both datasets):

- ``augment``: ``randaugment`` (default: a light RandAugment, N=2, M=9) or ``none``;
- ``erasing``: random erasing's probability (default 0.25, linnaeus' ``AUG.RANDOM_ERASE.PROB``);
- ``hflip``: a horizontal flip's probability (default 0.5);
- ``crop_scale``: the random resized crop's area range (default ``[0.08, 1.0]``);
- ``skip_unreadable``: ``true`` trains on past a photo that cannot be decoded (truncated, not an
  image) instead of stopping the run (default ``false``: the run stops with one sentence naming the
  file, its row and its identifier). Its sample is then an image of zeros with every rank null, the
  same in every epoch and after a resume: no training loss, gradient or per-rank accuracy counts
  it. A validation sample counts as any sample with no labelled rank does: in the sample count
  that ``val/loss`` and ``val/chain_acc`` divide by, and as right in ``val/chain_acc`` (it has no rank
  to get wrong); ``val/partial_chain_acc`` leaves it out. Each process (each DataLoader worker is
  one) warns once per file it skips, through the ``logging`` logger
  ``linnaeus_accel.data.species.dataset`` (on stderr when nothing configures logging), with how
  many distinct photos that process has skipped so far; the count is not summed over processes.

``image_table`` also takes ``table``, ``images_dir``, ``image_column``, ``rank_columns`` (finest
first), ``latitude_column``, ``longitude_column``, ``date_column``, ``elevation_column`` and
``temporal`` (``table.ObservationTable``); its split holds out ``DATA.DATASET.VAL_FRACTION`` of the
rows, fixed by ``split_seed`` (default 0), whatever EXPERIMENT.SEED a run has. Instead of ``table``
and ``images_dir``, ``hf_dataset`` names a Hugging Face ``datasets`` dataset saved by
``save_to_disk`` (a ``Dataset``, or a ``DatasetDict``'s ``train`` split) whose ``image_column``
holds the photos and whose other columns are the table's (``hf_images``); the same options read it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ...config import Config, ConfigError
from ...config.sections import DataConfig
from ..options import DatasetOptions
from ..registry import Split, register_dataset
from .dataset import RowSource, SpeciesDataset
from .hf_images import hf_observations
from .images import POLICIES, ImageTransforms
from .labels import ComponentSpec, LabelsFile, split_indices
from .pixels import ImageSource, PhotoFolder, PixelsFile
from .table import ObservationTable
from .taxonomy import Taxonomy

OPTIONS_KEY = "DATA.DATASET.OPTIONS"
AUGMENT = ("randaugment", "none")


def _transforms(options: DatasetOptions, size: int, split: Split) -> ImageTransforms:
    augment = options.text("augment", "randaugment", AUGMENT)
    erasing = options.raw("erasing")
    hflip = options.raw("hflip")
    scale = options.raw("crop_scale")
    kwargs: dict[str, Any] = {"policy": None if augment == "none" else augment}
    for name, value in (("erasing", erasing), ("hflip", hflip)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                options.problem(name, f"must be a probability from 0 to 1, got {value!r}")
            else:
                kwargs[name] = float(value)
    kwargs.setdefault("erasing", 0.25)
    if scale is not None:
        if not (isinstance(scale, list) and len(scale) == 2 and 0 < scale[0] <= scale[1] <= 1):
            options.problem("crop_scale", f"must be [low, high] with 0 < low <= high <= 1, got {scale!r}")
        else:
            kwargs["scale"] = (float(scale[0]), float(scale[1]))
    assert kwargs["policy"] is None or kwargs["policy"] in POLICIES
    return ImageTransforms(size=size, train=split == "train", **kwargs)


def _dataset(
    data: DataConfig,
    seed: int,
    split: Split,
    source: RowSource,
    options: DatasetOptions,
    train_share: float,
    split_seed: int,
    images: ImageSource,
) -> SpeciesDataset:
    columns = source.taxa_columns()
    ids = [columns[key] for key in source.task_keys]
    taxonomy = Taxonomy(ids, source.task_keys, partial_levels=data.PARTIAL.LEVELS)
    kept: npt.NDArray[np.int64] = np.flatnonzero(taxonomy.keep_rows(ids)).astype(np.int64)
    train, val = split_indices(kept.size, train_share, split_seed)
    transforms = _transforms(options, data.IMG_SIZE, split)
    skip_unreadable = options.boolean("skip_unreadable", False)
    options.finish()
    rows = kept[train if split == "train" else val]
    dataset = SpeciesDataset(
        source,
        rows,
        taxonomy,
        images,
        transforms,
        seed=seed,
        skip_unreadable=skip_unreadable,
    )
    dataset.check_images()
    return dataset


@register_dataset("linnaeus_h5")
def build_linnaeus_h5(config: Config, split: Split) -> SpeciesDataset:
    """linnaeus' files as its DATA section names them (``config/species.py``): the photos from
    ``DATA.HYBRID.IMAGES_DIR`` with ``USE_HYBRID``, else the pixels of ``DATA.H5.IMAGES_PATH``."""
    data = config.DATA
    if data.H5.LABELS_PATH is None:
        raise ConfigError(
            [("DATA.H5.LABELS_PATH", "linnaeus_h5 reads labels.h5: set DATA.H5.LABELS_PATH to it")]
        )
    meta = data.META
    components = [
        ComponentSpec(name, c.SOURCE, c.DIM, c.IDX, c.ALLOW_MISSING)
        for name, c in meta.COMPONENTS.items()
        if meta.ACTIVE and c.ENABLED
    ]
    source = LabelsFile(Path(data.H5.LABELS_PATH).expanduser(), data.TASK_KEYS_H5, components)
    images: ImageSource
    # The config allows one source: pixels only with USE_HYBRID false, as linnaeus reads them.
    if data.H5.IMAGES_PATH is not None and not data.HYBRID.USE_HYBRID:
        images = PixelsFile(Path(data.H5.IMAGES_PATH).expanduser(), len(source), source.path)
    else:
        images = PhotoFolder(Path(data.HYBRID.IMAGES_DIR).expanduser(), data.HYBRID.FILE_EXTENSION)
    options = DatasetOptions("linnaeus_h5", data.DATASET.OPTIONS, OPTIONS_KEY)
    return _dataset(
        data,
        config.EXPERIMENT.SEED,
        split,
        source,
        options,
        data.H5.TRAIN_VAL_SPLIT_RATIO,
        data.H5.TRAIN_VAL_SPLIT_SEED,
        images,
    )


@register_dataset("image_table")
def build_image_table(config: Config, split: Split) -> SpeciesDataset:
    """A table of observations (CSV, JSON Lines or Parquet) and a folder of photos, or a Hugging Face
    dataset holding both."""
    data = config.DATA
    options = DatasetOptions("image_table", data.DATASET.OPTIONS, OPTIONS_KEY)
    table = options.text("table")
    images_dir = options.text("images_dir")
    hf_dataset = options.text("hf_dataset")
    image_column = options.text("image_column", "image")
    ranks = options.strings("rank_columns", required=True)
    columns = {
        name: options.text(name)
        for name in ("latitude_column", "longitude_column", "date_column", "elevation_column")
    }
    temporal = options.text("temporal", "month", ("month", "day_of_year"))
    split_seed = options.integer("split_seed", 0, minimum=0)
    folder = f"{OPTIONS_KEY}.table and {OPTIONS_KEY}.images_dir"
    if hf_dataset is not None and (table is not None or images_dir is not None):
        options.problem(
            "hf_dataset",
            f"reads its photos and rows from one source: set {OPTIONS_KEY}.hf_dataset (a Hugging Face "
            f"dataset) or {folder} (a table and a folder of photos), not both",
        )
    elif hf_dataset is None:
        for name, value in (("table", table), ("images_dir", images_dir)):
            if value is None:
                options.problem(name, f"is required: set {folder}, or {OPTIONS_KEY}.hf_dataset instead")
    if options.problems:
        # The photos' options are read too, as _dataset reads them: checked, and not taken for unknown.
        _transforms(options, data.IMG_SIZE, split)
        options.boolean("skip_unreadable", False)
        options.finish()  # raises them all, with any unknown option
    images: ImageSource
    if hf_dataset is not None:
        source, images = hf_observations(
            Path(hf_dataset).expanduser(),
            image_column=image_column,
            rank_columns=ranks or [],
            temporal=temporal,
            **columns,
        )
    else:
        source = ObservationTable(
            Path(table).expanduser(),
            image_column=image_column,
            rank_columns=ranks or [],
            temporal=temporal,
            **columns,
        )
        images = PhotoFolder(Path(images_dir).expanduser(), key=f"{OPTIONS_KEY}.images_dir")
    return _dataset(
        data,
        config.EXPERIMENT.SEED,
        split,
        source,
        options,
        1.0 - data.DATASET.VAL_FRACTION,
        split_seed,
        images,
    )
