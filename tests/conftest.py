"""Fixtures and hooks of the whole suite. The helpers several test modules share are in
``helpers/`` (its ``__init__`` lists them by topic)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

# One torch thread per test process, and for every process a test starts: pytest-xdist runs as many
# test processes as there are cores, and the tests launch training processes of their own, so torch's
# default of a thread per core oversubscribes the cores. OpenMP threads that spin waiting for each
# other on a busy core made in-process training ~8x slower under `-n 2` (test_default_config_...
# 11 s alone, 107 s in the suite). Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

# Test modules import these from helpers; they are here too for one that imports them from conftest.
from helpers.configs import DEFAULT_CONFIG, REPO  # noqa: F401
from helpers.in_process import reset_accelerate, run_cli  # noqa: F401


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` (``gpu(count=N)``: N devices) are skipped, here and only here, on a
    machine without that many CUDA devices."""
    needed = {item: marker for item in items if (marker := item.get_closest_marker("gpu")) is not None}
    if not needed:
        return
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item, marker in needed.items():
        count = int(marker.kwargs.get("count", 1))
        if found == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        elif found < count:
            item.add_marker(pytest.mark.skip(reason=f"needs {count} CUDA devices (found {found})"))


@pytest.fixture
def default_config_path() -> Path:
    return DEFAULT_CONFIG


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    """Use with ``pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")`` in modules that
    build Accelerators in-process."""
    reset_accelerate()
    yield
    reset_accelerate()


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """W&B offline, with every directory it writes to under tmp_path; its service process
    (wandb-core, kept alive for the next run of the process) is shut down afterwards."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var, sub in (
        ("WANDB_DIR", "dir"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_DATA_DIR", "data"),
        ("WANDB_ARTIFACT_DIR", "artifacts"),
    ):
        monkeypatch.setenv(var, str(tmp_path / "wandb_env" / sub))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield
    wandb.teardown()
