"""The examples the README points to run as documented."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEFAULT_CONFIG, REPO


@pytest.mark.slow
def test_custom_model_example_trains_the_registered_model(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(REPO / "examples" / "custom_model.py"),
        "--cfg",
        str(DEFAULT_CONFIG),
        "--opts",
        "MODEL.TYPE",
        "tiny_linear",
        "TRAIN.EPOCHS",
        "1",
        "ENV.OUTPUT.BASE_DIR",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "digits_default" / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["global_step"] == 45  # ceil(1438 / 32) steps in the one epoch
    assert "completed at step 45" in done.stdout
