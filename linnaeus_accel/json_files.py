"""The run's JSON files: one policy for the numbers JSON cannot hold, one atomic writer, one way to
flatten nested keys. Plain Python (layer 0): every package may use it.

- ``finite``: JSON has no NaN or Infinity. ``json.dumps`` would write them as ``NaN``, which no
  strict reader parses, so they are written as the strings ``"nan"``, ``"inf"``, ``"-inf"``: the
  information stays (a diverged loss is worth seeing) and the file stays JSON. ``metrics.jsonl``,
  ``summary.json``, ``eval/*.json`` and the assets all go through it.
- ``write_json``: whole or not at all: a temporary file beside the target, renamed over it, so a
  reader (or a run killed mid-write) never sees half a file.
- ``flatten``: ``{"TRAIN": {"EPOCHS": 20}}`` -> ``{"TRAIN.EPOCHS": 20}``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (also inside dicts and lists) as its string."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(data: Any, indent: int | None = None) -> str:
    """Strict JSON of ``data`` (``finite`` first; ``allow_nan=False`` guards the policy)."""
    return json.dumps(finite(data), indent=indent, allow_nan=False)


def write_json(target: Path, data: Any) -> Path:
    """``data`` to ``target`` (indented, finite), atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(dumps(data, indent=2) + "\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys; other values as they are."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
