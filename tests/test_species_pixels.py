"""linnaeus' pixels in images.h5 (DATA.H5.IMAGES_PATH): a sample read from the pixels is the sample
read from the JPEG folder when they are the decoded JPEGs, a malformed file is refused before
training naming the key, a run trains from it, and no DataLoader worker is handed pixels."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
import yaml
from helpers.in_process import run_cli
from helpers.runs import read_summary
from helpers.species import TINY_CONVNEXT, species_files
from safetensors.torch import load_file

from linnaeus_accel.config import ConfigError, validate_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.data.species.dataset import SpeciesDataset
from linnaeus_accel.data.species.pixels import PixelsFile
from linnaeus_accel.data.species.synthetic import write_images_h5, write_synthetic_species

KEY = "DATA.H5.IMAGES_PATH"


def data_section(labels: Path, images: Path | None = None, pixels: Path | None = None) -> dict[str, Any]:
    """linnaeus' DATA keys: the photos from the folder ``images`` or the pixels of ``pixels``."""
    return {
        "TASK_KEYS_H5": ["taxa_L10", "taxa_L20", "taxa_L30"],
        "PARTIAL": {"LEVELS": True},
        "IMG_SIZE": 32,
        "H5": {
            "LABELS_PATH": str(labels),
            "TRAIN_VAL_SPLIT_RATIO": 0.75,
            "IMAGES_PATH": pixels and str(pixels),
        },
        "HYBRID": {"USE_HYBRID": images is not None, "IMAGES_DIR": str(images or "")},
        "DATASET": {"OPTIONS": {"augment": "randaugment", "erasing": 0.5}},
    }


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path, Path]:
    """labels.h5, the folder of JPEGs and images.h5 holding them decoded (12 rows of 40 x 56)."""
    labels, images = species_files(tmp_path)
    pixels = write_images_h5(tmp_path / "images.h5", sorted(images.iterdir(), key=lambda p: int(p.stem[4:])))
    return labels, images, pixels


def build(data: dict[str, Any], split: str) -> SpeciesDataset:
    dataset = build_dataset(validate_config({"DATA": data}), split)
    assert isinstance(dataset, SpeciesDataset)
    return dataset


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_sample_from_the_pixels_is_the_sample_from_the_folder(
    files: tuple[Path, Path, Path], split: str
) -> None:
    labels, images, pixels = files
    folder, stored = (
        build(data_section(labels, images=images), split),
        build(data_section(labels, pixels=pixels), split),
    )
    assert isinstance(stored.images, PixelsFile)
    assert np.array_equal(folder.rows, stored.rows)
    keys = [(epoch, i) for epoch in (0, 3) for i in range(len(folder))]
    # A batch out of order, one sample twice: read together, sorted for h5py, then put back in order.
    together = stored.__getitems__([(3, 2), (3, 0), (3, 2), (0, 1)])
    for key in keys:
        a, b = folder[key], stored[key]
        assert torch.equal(a["image"], b["image"]), key  # the same keyed crop, flip, RandAugment, erasing
        assert torch.equal(a["labels"], b["labels"])
    for key, sample in zip([(3, 2), (3, 0), (3, 2), (0, 1)], together, strict=True):
        assert torch.equal(sample["image"], folder[key]["image"])
    assert folder.run_records() == stored.run_records()  # preprocessing.json: the same evaluation transform


def test_grayscale_pixels_are_read_as_rgb(tmp_path: Path) -> None:
    gray = np.arange(2 * 6 * 5, dtype=np.uint8).reshape(2, 6, 5)
    for name, data in (("hw.h5", gray), ("hw1.h5", gray[..., None])):
        with h5py.File(tmp_path / name, "w") as f:
            f["images"] = data
        (photo,) = PixelsFile(tmp_path / name, n_rows=2).read([1], ["b"], 32)
        assert not isinstance(photo, Exception)
        assert photo.mode == "RGB"
        assert np.array_equal(np.asarray(photo), np.repeat(gray[1][..., None], 3, axis=2))


def _write(path: Path, **datasets: Any) -> Path:
    with h5py.File(path, "w") as f:
        for name, data in datasets.items():
            f[name] = data
    return path


PIXELS = np.zeros((12, 4, 4, 3), dtype=np.uint8)


@pytest.mark.parametrize(
    ("pixels", "words"),
    [
        # no such file.
        (lambda d: d / "nowhere.h5", "does not exist"),
        # an HDF5 file without linnaeus' images dataset: the ones it has are named.
        (lambda d: _write(d / "p.h5", pixels=PIXELS), "has no images dataset (it has pixels)"),
        # float pixels: the dtype and shape found, and those expected.
        (
            lambda d: _write(d / "p.h5", images=PIXELS.astype(np.float32)),
            "holds float32 of shape (12, 4, 4, 3), not uint8",
        ),
        # four channels (RGBA).
        (
            lambda d: _write(d / "p.h5", images=np.zeros((12, 4, 4, 4), np.uint8)),
            "of shape (12, 4, 4, 4), not uint8",
        ),
        # one flat row per photo: no height and width.
        (
            lambda d: _write(d / "p.h5", images=np.zeros((12, 48), np.uint8)),
            "of shape (12, 48), not uint8 of shape (rows",
        ),
        # a row fewer than labels.h5: row i would be another photo.
        (lambda d: _write(d / "p.h5", images=PIXELS[:11]), "holds 11 photos but"),
    ],
)
def test_a_malformed_images_h5_is_refused_before_training(tmp_path: Path, pixels: Any, words: str) -> None:
    labels, _ = species_files(tmp_path)
    path = pixels(tmp_path)
    with pytest.raises(ConfigError) as caught:
        build(data_section(labels, pixels=path), "train")
    ((key, message),) = caught.value.problems
    assert key == KEY
    assert words in message, message
    assert str(path) in message
    assert "\n" not in message
    assert f"point {KEY} at" in message or "write" in message


@pytest.mark.parametrize(
    ("hybrid", "h5", "keys", "words"),
    [
        # both a folder and images.h5: linnaeus would silently read the folder.
        (
            {"USE_HYBRID": True, "IMAGES_DIR": "photos"},
            {"IMAGES_PATH": "images.h5"},
            "DATA.HYBRID.USE_HYBRID, " + KEY,
            "keep one",
        ),
        # neither: nowhere to read the photos from.
        (
            {"USE_HYBRID": False},
            {},
            f"DATA.HYBRID.USE_HYBRID, DATA.HYBRID.IMAGES_DIR, {KEY}",
            f"or {KEY} to images.h5",
        ),
        # a folder asked for but not named.
        (
            {"USE_HYBRID": True, "IMAGES_DIR": ""},
            {},
            "DATA.HYBRID.USE_HYBRID, DATA.HYBRID.IMAGES_DIR",
            "is empty",
        ),
        # pixels without the labels they are the photos of.
        (
            {"USE_HYBRID": False},
            {"IMAGES_PATH": "images.h5", "LABELS_PATH": None},
            f"{KEY}, DATA.H5.LABELS_PATH",
            "is not set",
        ),
    ],
)
def test_exactly_one_image_source(hybrid: dict[str, Any], h5: dict[str, Any], keys: str, words: str) -> None:
    data = {"H5": {"LABELS_PATH": "labels.h5", **h5}, "HYBRID": hybrid}
    with pytest.raises(ConfigError) as caught:
        validate_config({"DATA": data})
    assert any(k == keys and words in message for k, message in caught.value.problems), caught.value.problems


def test_a_dataset_pickles_without_pixels(tmp_path: Path) -> None:
    """What a DataLoader worker is sent: paths and row indices, never pixels, however many rows."""
    sizes = []
    for rows in (24, 240):
        written = write_synthetic_species(tmp_path / str(rows), rows=rows, size=48, pixels=True)
        data = data_section(written["labels"], pixels=written["pixels"])
        data["TASK_KEYS_H5"] = ["taxa_L10", "taxa_L20", "taxa_L30", "taxa_L40"]
        dataset = build(data, "train")
        before = len(pickle.dumps(dataset))
        dataset.__getitems__([0, 5, 3])  # opens this process's handle
        assert len(pickle.dumps(dataset)) == before  # nothing read is kept
        assert pickle.loads(pickle.dumps(dataset)).images._handle is None
        sizes.append(before)
    # 216 more rows (of 6,912 bytes of pixels each) add their row index and little else.
    assert sizes[1] - sizes[0] < 216 * 32, sizes


@pytest.mark.parametrize("workers", [0, 2])
def test_a_run_trains_from_images_h5_as_from_the_folder(files: tuple[Path, Path, Path], workers: int) -> None:
    """The same run from the folder and from the pixels ends with the same weights in final/."""
    labels, images, pixels = files
    root = labels.parent
    finals = []
    for name, data in (
        ("folder", data_section(labels, images=images)),
        ("pixels", data_section(labels, pixels=pixels)),
    ):
        config = {
            "EXPERIMENT": {"NAME": name},
            "ENV": {"OUTPUT": {"BASE_DIR": str(root / f"out{workers}")}},
            "DATA": {**data, "BATCH_SIZE": 4, "NUM_WORKERS": workers},
            "MODEL": {"TYPE": "hf_vision", "OPTIONS": {"config": TINY_CONVNEXT}},
            "TASK": {"NAME": "hierarchical"},
            "TRAIN": {"EPOCHS": 1},
            "LR_SCHEDULER": {"REFERENCE_BS": None},
        }
        cfg = root / f"{name}{workers}.yaml"
        cfg.write_text(yaml.safe_dump(config), encoding="utf-8")
        rc, _, err = run_cli("train", "--cfg", str(cfg))
        assert rc == 0, err
        final = root / f"out{workers}" / name / "final"
        assert read_summary(final.parent)["global_step"] == 3  # 9 training rows, 4 a batch
        assert (final / "preprocessing.json").is_file()
        assert (final / "taxonomy.json").is_file()
        finals.append(load_file(final / "model.safetensors"))
    folder, stored = finals
    assert folder.keys() == stored.keys()
    assert all(torch.equal(folder[k], stored[k]) for k in folder)
