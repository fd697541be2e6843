"""A mixture that is legal but probably not what was meant is warned about, in ``plan`` and in
``train`` (its summary and summary.json), never refused: two sources that read the same file (or
the same dataset and options), and a source whose weight leaves it less than one expected sample
in the whole run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.configs import REPO, mixture_config
from helpers.in_process import reset_accelerate, run_cli

from linnaeus_accel.data.digits import DigitsDataset
from linnaeus_accel.data.mixtures.mixture import Mixture, MixtureSource

SAME_FILE = "both read"
TOO_LIGHT = "less than one"


def token_file(path: Path, count: int) -> Path:
    (np.arange(count) % 300).astype("<u2").tofile(path)
    return path


def source(label: str, weight: float, *paths: Path | str) -> dict[str, Any]:
    options = {"paths": [str(p) for p in paths], "seq_len": 9, "dtype": "uint16", "vocab_size": 300}
    return {"name": "token_files", "label": label, "weight": weight, "options": options}


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    return token_file(tmp_path / "web.bin", 2000), token_file(tmp_path / "code.bin", 1200)


def plan(config: Path) -> tuple[str, str]:
    rc, out, err = run_cli("plan", "--cfg", str(config))
    assert rc == 0, out + err  # warned, never refused
    return out, err


def test_plan_warns_of_a_file_that_two_sources_read(tmp_path: Path, files: tuple[Path, Path]) -> None:
    web, code = files
    (tmp_path / "sub").mkdir()
    spelled_otherwise = tmp_path / "sub" / ".." / "web.bin"  # the same file once resolved
    config = mixture_config(tmp_path, source("web", 0.7, web), source("mixed", 0.3, code, spelled_otherwise))
    out, err = plan(config)
    warning = (
        f"mixture sources 'web' and 'mixed' both read {web.resolve()}: its samples are drawn for both, more "
        "often than either weight says; list each file or dataset in one source only"
    )
    assert f"warning: {warning}" in err
    assert f"  - {warning}" in out  # the summary's Warnings
    # Different files: no word.
    _, err = plan(mixture_config(tmp_path, source("web", 0.7, web), source("code", 0.3, code)))
    assert SAME_FILE not in err
    assert TOO_LIGHT not in err


def test_plan_warns_of_a_source_too_light_to_be_drawn(tmp_path: Path, files: tuple[Path, Path]) -> None:
    web, code = files
    out, err = plan(mixture_config(tmp_path, source("web", 1, web), source("rare", 1e-300, code)))
    # 10 steps of 4 samples: 40 samples, of which 'rare' should give 1e-300 x 40.
    warning = (
        "mixture source 'rare': its weight is 1e-300 of the sources' total, so of the run's 40 samples it is "
        "expected to give 4e-299, less than one, and its share cannot be kept (any draw of it is rounding): "
        "raise its weight to at least 0.025 of the total, or remove the source"
    )
    assert f"warning: {warning}" in err
    assert f"  - {warning}" in out
    # A small weight that still gives samples (0.05 x 40 = 2): no word.
    _, err = plan(mixture_config(tmp_path, source("web", 0.95, web), source("rare", 0.05, code)))
    assert TOO_LIGHT not in err


def test_plan_warns_of_a_dataset_that_two_sources_name_alike() -> None:
    sources = "{sources: [{name: digits, label: a, weight: 1}, {name: digits, label: b, weight: 2}]}"
    opts = ["DATA.DATASET.NAME", "mixture", "DATA.DATASET.OPTIONS", sources]
    rc, _, err = run_cli("plan", "--cfg", str(REPO / "configs" / "default.yaml"), "--opts", *opts)
    assert rc == 0, err
    assert (
        "warning: mixture sources 'a' and 'b' both read the dataset digits with the same options ({})" in err
    )


def test_a_dataset_object_listed_twice_is_described_with_a_warning() -> None:
    digits = DigitsDataset("train", val_fraction=0.2)
    rows = Mixture([MixtureSource("a", digits, 1), MixtureSource("b", digits, 1)]).describe()
    assert "warnings" not in rows[0]
    assert rows[1]["warnings"] == [
        "mixture sources 'a' and 'b' both read the same dataset object: its samples are drawn for both, more "
        "often than either weight says; list each file or dataset in one source only (its weight sets its share)"
    ]
    other = DigitsDataset("val", val_fraction=0.2)
    assert all(
        "warnings" not in row
        for row in Mixture([MixtureSource("a", digits, 1), MixtureSource("b", other, 1)]).describe()
    )


def test_train_shows_and_records_the_warnings(tmp_path: Path, files: tuple[Path, Path]) -> None:
    web, code = files
    config = mixture_config(tmp_path, source("web", 1, web), source("rare", 1e-300, code, web), steps=2)
    reset_accelerate()
    try:
        rc, out, err = run_cli("train", "--cfg", str(config))
    finally:
        reset_accelerate()
    assert rc == 0, out + err
    warnings = json.loads((tmp_path / "runs" / "pretrain" / "summary.json").read_text())["warnings"]
    for expected in (
        f"mixture sources 'web' and 'rare' both read {web.resolve()}",
        "mixture source 'rare': its weight is 1e-300 of the sources' total, so of the run's 8 samples",
    ):
        assert f"  - {expected}" in out  # the summary printed at the start
        assert any(w.startswith(expected) for w in warnings), warnings
