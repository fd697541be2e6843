"""What W&B wrote, read back by wandb itself (the ``wandb_offline`` fixture of conftest keeps
every directory it writes to under the test's ``tmp_path``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def wandb_records(path: Path, finished: bool = True) -> list[dict[str, Any]]:
    """The records of a ``.wandb`` file, read by wandb itself. ``finished``: wait for the run's exit
    record (``wandb.finish()`` returns before wandb-core has closed the file; ``--follow`` reads until
    the run exits)."""
    follow = ["--follow", "--idle-timeout", "60s"] if finished else []
    command = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", *follow, str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    if finished:
        assert records, done.stderr
        assert records[-1]["type"] == "exit", done.stdout[-2000:]
    return records


def wandb_history(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Global step -> the keys logged at it."""
    history: dict[int, dict[str, Any]] = {}
    for record in records:
        if record["type"] == "history":
            row = record["history"]["item"]
            history.setdefault(int(row["_step"]), {}).update(row)
    return history


def wandb_run_files(out: Path) -> list[Path]:
    """The ``.wandb`` file of every W&B process of the run, oldest first."""
    return [f for d in sorted((out / "wandb").glob("offline-run-*")) for f in d.glob("*.wandb")]
