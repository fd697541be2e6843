"""linnaeus' DATA keys read unchanged: DATA.H5.LABELS_PATH selects its species data, the split is
fixed by TRAIN_VAL_SPLIT_SEED, and what this version does not read yet is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from helpers.in_process import run_cli
from helpers.species import ROWS, species_files
from safetensors.torch import load_file
from transformers import ConvNextConfig, ConvNextModel

from linnaeus_accel.config import ConfigError, validate_config
from linnaeus_accel.data import build_dataset


def linnaeus_data(labels: Path, images: Path, **more: Any) -> dict[str, Any]:
    """A DATA section as linnaeus writes it (its key names and nesting)."""
    return {
        "TASK_KEYS_H5": ["taxa_L10", "taxa_L20", "taxa_L30"],
        "PARTIAL": {"LEVELS": True},
        "IMG_SIZE": 32,
        "H5": {"LABELS_PATH": str(labels), "TRAIN_VAL_SPLIT_RATIO": 0.75, "TRAIN_VAL_SPLIT_SEED": 42},
        "HYBRID": {"USE_HYBRID": True, "IMAGES_DIR": str(images), "FILE_EXTENSION": ".jpg"},
        "META": {"ACTIVE": True, "COMPONENTS": {"TEMPORAL": {"ALLOW_MISSING": True}}},
        **more,
    }


def test_a_linnaeus_data_section_builds_both_splits(tmp_path: Path) -> None:
    labels, images = species_files(tmp_path)
    config = validate_config({"DATA": linnaeus_data(labels, images)})
    train, val = build_dataset(config, "train"), build_dataset(config, "val")
    assert (len(train), len(val)) == (9, 3)  # 0.75 of the 12 rows train
    assert set(train.rows.tolist()).isdisjoint(val.rows.tolist())
    assert sorted([*train.rows.tolist(), *val.rows.tolist()]) == list(range(ROWS))
    assert train.num_classes == val.num_classes == (2, 3, 5)  # one taxonomy, from every row
    # linnaeus' TEMPORAL and SPATIAL are on by default (the config set one field of TEMPORAL only).
    assert train.meta_components == ("TEMPORAL", "SPATIAL")
    assert train[(0, 0)]["image"].shape == (3, 32, 32)
    again = build_dataset(config, "val")
    assert np.array_equal(again.rows, val.rows)  # the split is the seed's, every time


@pytest.mark.parametrize(
    ("changes", "key", "words"),
    [
        # linnaeus' own architectures: one sentence saying what to use instead.
        ({"MODEL": {"NAME": "mFormerV1_sm"}}, "MODEL.NAME", "set MODEL.TYPE to hf_vision"),
        # separate train and validation pixel files: not read yet, said by name rather than ignored.
        ({"DATA": {"H5": {"TRAIN_IMAGES_PATH": "train.h5"}}}, "DATA.H5.TRAIN_IMAGES_PATH", "is not read yet"),
        # the photos' side given twice, differently.
        ({"MODEL": {"IMG_SIZE": 384}}, "MODEL.IMG_SIZE", "(384) and DATA.IMG_SIZE (32) differ"),
        # no photos at all: neither a folder nor images.h5.
        ({"DATA": {"HYBRID": {"USE_HYBRID": False}}}, "DATA.HYBRID.USE_HYBRID", "are read from a folder"),
        # two components at one place of the metadata vector.
        ({"DATA": {"META": {"COMPONENTS": {"SPATIAL": {"IDX": 0}}}}}, "DATA.META.COMPONENTS", "are both 0"),
    ],
)
def test_what_is_not_read_yet_is_refused_by_name(
    tmp_path: Path, changes: dict[str, Any], key: str, words: str
) -> None:
    labels, images = species_files(tmp_path)
    data = linnaeus_data(labels, images)
    for name, value in changes.get("DATA", {}).items():
        data[name] = {**data.get(name, {}), **value} if isinstance(value, dict) else value
    with pytest.raises(ConfigError) as caught:
        validate_config({"DATA": data, **{k: v for k, v in changes.items() if k != "DATA"}})
    assert any(k.startswith(key) and words in message for k, message in caught.value.problems), (
        caught.value.problems
    )


def test_a_missing_photo_stops_the_build_naming_it(tmp_path: Path) -> None:
    labels, images = species_files(tmp_path)
    config = validate_config({"DATA": linnaeus_data(labels, images)})
    row = int(build_dataset(config, "train").rows[0])
    (images / f"obs_{row}.jpg").unlink()
    with pytest.raises(ConfigError, match=rf"obs_{row}\.jpg \(row {row}\)"):
        build_dataset(config, "train")


def test_a_frozen_pretrained_backbone_comes_out_of_final_unchanged(tmp_path: Path) -> None:
    """MODEL.OPTIONS.freeze_backbone with a save_pretrained directory: after a run, final/'s
    backbone tensors are the directory's, bit for bit; the heads trained."""
    pretrained = tmp_path / "convnext"
    ConvNextModel(
        ConvNextConfig(num_channels=3, depths=[1], hidden_sizes=[8], num_stages=1, image_size=32)
    ).save_pretrained(pretrained)
    labels, images = species_files(tmp_path / "data")
    config = {
        "EXPERIMENT": {"NAME": "frozen"},
        "ENV": {"OUTPUT": {"BASE_DIR": str(tmp_path / "out")}},
        "DATA": {**linnaeus_data(labels, images), "BATCH_SIZE": 4},
        "MODEL": {"TYPE": "hf_vision", "OPTIONS": {"pretrained": str(pretrained), "freeze_backbone": True}},
        "TASK": {"NAME": "hierarchical"},
        "TRAIN": {"EPOCHS": 1},
        "LR_SCHEDULER": {"REFERENCE_BS": None},
    }
    cfg = tmp_path / "frozen.yaml"
    cfg.write_text(yaml.safe_dump(config), encoding="utf-8")
    rc, _, err = run_cli("train", "--cfg", str(cfg))
    assert rc == 0, err
    trained = load_file(tmp_path / "out" / "frozen" / "final" / "model.safetensors")
    original = load_file(pretrained / "model.safetensors")
    backbone = {k.removeprefix("backbone."): v for k, v in trained.items() if k.startswith("backbone.")}
    assert backbone.keys() == original.keys()
    assert all(torch.equal(backbone[k], original[k]) for k in original)
    heads = [k for k in trained if k.startswith("heads.")]
    assert heads  # the heads are saved beside it
