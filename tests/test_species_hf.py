"""Species photos from a Hugging Face datasets image dataset (image_table's hf_dataset): a sample is
the sample of the same table and folder of JPEGs, a DataLoader worker is handed a path, every
mistake is refused before training in one sentence naming the key, and a run trains from it."""

from __future__ import annotations

import csv
import json
import pickle
import sys
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
import yaml
from helpers.in_process import run_cli
from helpers.species import TINY_CONVNEXT
from PIL import Image

from linnaeus_accel.config import ConfigError, validate_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.data.species.dataset import SpeciesDataset
from linnaeus_accel.data.species.errors import UnreadablePhoto
from linnaeus_accel.data.species.hf_images import HF_KEY, HFImages
from linnaeus_accel.data.species.images import load_image
from linnaeus_accel.data.species.synthetic import FAMILIES, TABLE_OPTIONS, write_synthetic_species
from linnaeus_accel.data.species.table import IMAGE_KEY, RANKS_KEY

OPTIONS = "DATA.DATASET.OPTIONS"
ROWS, PHOTO, SIZE = 16, 72, 16  # a 72-pixel JPEG decoded for a 16-pixel input is decoded at half scale
NUMBERS = ("latitude", "longitude", "elevation")
# Its class numbers in another order than its names sorted: the names are read, not the numbers.
FAMILY = datasets.ClassLabel(names=list(reversed(FAMILIES)))


def as_hf_dataset(table: Path, images: Path, out: Path) -> Path:
    """The synthetic table and its photos as a DatasetDict saved to ``out``: ``train`` all of them,
    ``test`` two (a split that is not read)."""
    with table.open(encoding="utf-8", newline="") as f:
        records = list(csv.DictReader(f))
    columns: dict[str, list[Any]] = {name: [r[name] or None for r in records] for name in records[0]}
    columns["image"] = [str(images / name) for name in columns["image"]]
    for name in NUMBERS:
        columns[name] = [None if v is None else float(v) for v in columns[name]]
    columns["family"] = [FAMILY.str2int(name) for name in columns["family"]]
    features = datasets.Features(
        {
            **{name: datasets.Value("string") for name in columns},
            **{name: datasets.Value("float64") for name in NUMBERS},
            "image": datasets.Image(),
            "family": FAMILY,
        }
    )
    train = datasets.Dataset.from_dict(columns, features=features)
    datasets.DatasetDict({"train": train, "test": train.select([0, 1])}).save_to_disk(str(out))
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("species")
    written = write_synthetic_species(root, rows=ROWS, size=PHOTO, table=True)
    written["hf"] = as_hf_dataset(written["table"], written["images"], root / "hf")
    return written


def data_section(**options: Any) -> dict[str, Any]:
    return {
        "IMG_SIZE": SIZE,
        "PARTIAL": {"LEVELS": True},
        "DATASET": {
            "NAME": "image_table",
            "VAL_FRACTION": 0.25,
            "OPTIONS": {**TABLE_OPTIONS, "erasing": 0.5, **options},
        },
    }


def build(split: str = "train", **options: Any) -> SpeciesDataset:
    dataset = build_dataset(validate_config({"DATA": data_section(**options)}), split)
    assert isinstance(dataset, SpeciesDataset)
    return dataset


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_sample_from_the_dataset_is_the_sample_from_the_table_and_folder(
    data: dict[str, Path], split: str
) -> None:
    folder = build(split, table=str(data["table"]), images_dir=str(data["images"]))
    hf = build(split, hf_dataset=str(data["hf"]))
    assert isinstance(hf.images, HFImages)
    assert load_image(data["images"] / "obs_00000.jpg", SIZE).size == (36, 36)  # the reduced-scale decoding
    assert len(hf) == len(folder) == {"train": 12, "val": 4}[split]  # the train split's 16 rows, not test's 2
    keys = [(epoch, i) for epoch in (0, 2) for i in range(len(folder))]
    for key, a, b in zip(keys, folder.__getitems__(keys), hf.__getitems__(keys), strict=True):
        assert torch.equal(a["image"], b["image"]), key  # the same keyed crop, flip, RandAugment, erasing
        assert torch.equal(a["labels"], b["labels"]), key
        assert a["meta"].keys() == b["meta"].keys() == {"SPATIAL", "TEMPORAL", "ELEVATION"}
        assert all(torch.equal(a["meta"][c], b["meta"][c]) for c in a["meta"]), key
    # taxonomy.json (the ClassLabel family by its names) and preprocessing.json.
    assert folder.run_records() == hf.run_records()


def test_a_worker_is_handed_the_path(data: dict[str, Path]) -> None:
    dataset = build(hf_dataset=str(data["hf"]))
    first = dataset[(1, 3)]["image"]
    images = pickle.dumps(dataset.images)
    assert len(images) < 400  # the path and the column's name: no table, no photo
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy.images._images is None  # opened again where it is read
    assert torch.equal(copy[(1, 3)]["image"], first)


def save(directory: Path, rows: list[dict[str, Any]], splits: tuple[str, ...] = ("train",)) -> Path:
    """A tiny DatasetDict of ``rows`` saved to ``directory``: images (PIL, encoded bytes or None), or
    file names as text."""
    features = datasets.Features({"image": datasets.Image(), "genus": datasets.Value("string")})
    columns = {name: [row.get(name) for row in rows] for name in rows[0]}
    if isinstance(columns["image"][0], str):
        features["image"] = datasets.Value("string")
    train = datasets.Dataset.from_dict(columns, features=features)
    datasets.DatasetDict(dict.fromkeys(splits, train)).save_to_disk(str(directory))
    return directory


# The tiny datasets below have a genus and no metadata.
TINY = {
    "rank_columns": ["genus"],
    **{f"{name}_column": None for name in ("latitude", "longitude", "date", "elevation")},
}
PHOTO_OF = Image.new("RGB", (8, 8), (200, 30, 30))
GOOD = [{"image": PHOTO_OF, "genus": "Aster"}, {"image": PHOTO_OF, "genus": "Bellis"}]
BOTH = "image_table: reads its photos and rows from one source: set DATA.DATASET.OPTIONS.hf_dataset (a Hugging Face "
FOLDER = "DATA.DATASET.OPTIONS.table and DATA.DATASET.OPTIONS.images_dir"
NAMES = "give every row its photo or drop the rows without one"
# (the dataset's rows, or None for no dataset there; its splits; options; the problems: PATH its path).
REFUSALS: list[tuple[Any, tuple[str, ...], dict[str, Any], list[tuple[str, str]]]] = [
    # Both sources, and a table beside the dataset.
    (GOOD, ("train",), {"table": "obs.csv", "images_dir": "photos"},
     [(HF_KEY, f"{BOTH}dataset) or {FOLDER} (a table and a folder of photos), not both")]),
    (GOOD, ("train",), {"table": "obs.csv"},
     [(HF_KEY, f"{BOTH}dataset) or {FOLDER} (a table and a folder of photos), not both")]),
    # An image column that is not there: the columns present are named.
    (GOOD, ("train",), {"image_column": "photo"},
     [(IMAGE_KEY, f"PATH has no column 'photo' (its columns: image, genus): set {IMAGE_KEY} to one of them")]),
    # A rank column that is not there.
    (GOOD, ("train",), {"rank_columns": ["species", "genus"]},
     [(RANKS_KEY, f"PATH has no column 'species' (its columns: image, genus): remove it from {RANKS_KEY}")]),
    # A row without its image: the first row is named, the others counted.
    ([*GOOD, {"image": None, "genus": "Aster"}, {"image": None, "genus": "Aster"}], ("train",), {},
     [(IMAGE_KEY, f"PATH: column 'image' has no image at row 2 (and 1 other row): {NAMES}")]),
    # File names, not images; and a missing rank column beside it: every problem at once.
    ([{"image": "a.jpg", "genus": "Aster"}], ("train",), {"rank_columns": ["family"]},
     [(RANKS_KEY, f"PATH has no column 'family' (its columns: image, genus): remove it from {RANKS_KEY}"),
      (IMAGE_KEY, "PATH: column 'image' holds Value('string'), not images (datasets.Image()): set "
                  f"{IMAGE_KEY} to the column of images, or read photo files with table and images_dir")]),
    # A DatasetDict without a train split.
    (GOOD, ("test", "validation"), {},
     [(HF_KEY, "PATH has no 'train' split (its splits: test, validation): save the rows to train on as its "
               "'train' split")]),
    # No dataset there.
    (None, (), {}, [(HF_KEY, f"PATH does not exist: point {HF_KEY} at a directory written by save_to_disk")]),
]  # fmt: skip
REFUSED = [
    "both sources", "table and dataset", "no image column", "no rank column", "rows without images",
    "file names and all at once", "no train split", "no dataset",
]  # fmt: skip


@pytest.mark.parametrize(("rows", "splits", "options", "expected"), REFUSALS, ids=REFUSED)
def test_every_refusal_in_one_sentence(
    tmp_path: Path,
    rows: Any,
    splits: tuple[str, ...],
    options: dict[str, Any],
    expected: list[tuple[str, str]],
) -> None:
    path = tmp_path / "hf"
    if rows is not None:
        save(path, rows, splits)
    with pytest.raises(ConfigError) as caught:
        build(hf_dataset=str(path), **{**TINY, **options})
    assert caught.value.problems == [(key, message.replace("PATH", str(path))) for key, message in expected]


def test_neither_source_is_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        build(**TINY)
    fix = f"image_table: is required: set {FOLDER}, or {HF_KEY} instead"
    assert caught.value.problems == [(f"{OPTIONS}.table", fix), (f"{OPTIONS}.images_dir", fix)]


def test_without_datasets_the_extra_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = save(tmp_path / "hf", GOOD)
    monkeypatch.setitem(sys.modules, "datasets", None)  # what an install without the extra sees
    with pytest.raises(ConfigError) as caught:
        build(hf_dataset=str(path), **TINY)
    assert caught.value.problems == [
        (
            HF_KEY,
            "reading a Hugging Face dataset needs the datasets package: pip install 'linnaeus-accel[data]'",
        )
    ]


def test_an_image_that_cannot_be_decoded_is_named_when_read(tmp_path: Path) -> None:
    broken = {"image": {"bytes": b"not a photo", "path": "broken.jpg"}, "genus": "Bellis"}
    path = save(tmp_path / "hf", [*GOOD, broken])
    # Row 2 is in one split or the other.
    splits = [build(split, hf_dataset=str(path), **TINY) for split in ("train", "val")]
    dataset = next(d for d in splits if 2 in d.rows)
    with pytest.raises(UnreadablePhoto) as caught:
        dataset[int(dataset.rows.tolist().index(2))]
    assert str(caught.value).startswith(
        f"photo {path}[2] (row 2 of {path}, identifier 'broken.jpg') cannot be read: it is not an image Pillow "
        "can read;"
    )


def test_a_run_trains_from_the_dataset(data: dict[str, Path], tmp_path: Path) -> None:
    config = {
        "EXPERIMENT": {"NAME": "hf"},
        "ENV": {"OUTPUT": {"BASE_DIR": str(tmp_path / "out")}},
        "DATA": {**data_section(hf_dataset=str(data["hf"])), "BATCH_SIZE": 4, "NUM_WORKERS": 0},
        "MODEL": {"TYPE": "hf_vision", "OPTIONS": {"config": TINY_CONVNEXT}},
        "TASK": {"NAME": "hierarchical"},
        "TRAIN": {"EPOCHS": 1},
        "LR_SCHEDULER": {"REFERENCE_BS": None},
    }
    cfg = tmp_path / "hf.yaml"
    cfg.write_text(yaml.safe_dump(config), encoding="utf-8")
    rc, _, err = run_cli("train", "--cfg", str(cfg))
    assert rc == 0, err
    final = tmp_path / "out" / "hf" / "final"
    summary = json.loads((final.parent / "summary.json").read_text(encoding="utf-8"))
    assert (summary["status"], summary["global_step"]) == ("completed", 3)  # 12 training rows, 4 a batch
    assert (final / "model.safetensors").is_file()
    names = json.loads((final / "taxonomy.json").read_text(encoding="utf-8"))["names"]
    assert set(names["family"].values()) == set(FAMILIES)
