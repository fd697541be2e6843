"""Every config that ships (configs/*.yaml, examples/*.yaml) resolves its plan without a warning:
the README's first command must not greet a newcomer with what reads as a misconfigured default.
``train`` prints the same warnings as ``plan`` (both are the plan's), so the plan is what is checked,
in process, on the data each config names (configs/pretrain.yaml's and gpt2_124m.yaml's token files,
species.yaml's photos and labels, made here, small)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.configs import REPO

from linnaeus_accel.cli import plan_for
from linnaeus_accel.config import load_config
from linnaeus_accel.data.species.synthetic import write_synthetic_species
from linnaeus_accel.data.tokens.format import TokenSidecar, sidecar_path

SHIPPED = sorted(
    p.relative_to(REPO).as_posix() for p in (*REPO.glob("configs/*.yaml"), *REPO.glob("examples/*.yaml"))
)


def byte_token_file(path: Path, count: int) -> None:
    """A byte-level token file with its sidecar, as ``linnaeus-accel tokenize`` writes one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    (np.arange(count) % 256).astype("<u2").tofile(path)
    sidecar = TokenSidecar("uint16", count, 1, 257, 256, 255, {"type": "bytes"})
    sidecar_path(path).write_text(sidecar.to_json(), encoding="utf-8")


def test_the_shipped_configs_are_the_ones_checked() -> None:
    assert {"configs/default.yaml", "configs/pretrain.yaml", "examples/nanogpt.yaml"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_config_plans_without_warnings(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # configs/pretrain.yaml reads data/*.bin from where it is run
    byte_token_file(tmp_path / "data" / "reference.bin", 400_000)
    byte_token_file(tmp_path / "data" / "keywords.bin", 60_000)
    byte_token_file(
        tmp_path / "data" / "train.bin", 600_000
    )  # configs/gpt2_124m.yaml: 8 x 64 windows of 1,025
    write_synthetic_species(tmp_path / "data" / "species")  # configs/species.yaml: examples/species.py's
    plan = plan_for(load_config(REPO / name), world_size=1, dataset_size=None)
    assert plan.warnings == (), plan.warnings
