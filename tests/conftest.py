"""Shared test helpers."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO / "configs" / "default.yaml"


@pytest.fixture
def default_config_path() -> Path:
    return DEFAULT_CONFIG
