"""Which file (or ``--opts``) set each key of a config, for the messages of rules between keys: a
key inherited through ``BASE`` that collides with one a config sets itself is named with its file,
and the way out (``KEY: null``) is said, instead of leaving the user to find it."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml


def _leaves(data: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out += _leaves(value, dotted + ".")
        else:
            out.append(dotted)
    return out


def sources(cfg: str | Path | Mapping[str, Any] | None, opts: Sequence[str]) -> dict[str, str]:
    """dotted key -> where its value came from: a file's path, "the config given" (a mapping), or
    "--opts". Best effort: a file that cannot be read is left out (its own error is reported)."""
    out: dict[str, str] = {}

    def visit(data: Any, where: str, directory: Path, seen: tuple[Path, ...]) -> None:
        if not isinstance(data, Mapping):
            return
        bases = data.get("BASE") or []
        for base in [bases] if isinstance(bases, (str, Path)) else bases if isinstance(bases, list) else []:
            path = (directory / str(base)).expanduser().resolve()
            if path in seen:
                continue
            try:
                loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, yaml.YAMLError):
                continue
            visit(loaded, str(path), path.parent, (*seen, path))
        for key in _leaves({k: v for k, v in data.items() if k != "BASE"}):
            out[key] = where

    if isinstance(cfg, Mapping):
        visit(cfg, "the config given", Path.cwd(), ())
    elif cfg is not None:
        path = Path(cfg).expanduser().resolve()
        with contextlib.suppress(OSError, UnicodeDecodeError, yaml.YAMLError):
            visit(yaml.safe_load(path.read_text(encoding="utf-8")), str(path), path.parent, (path,))
    for key in opts[::2]:
        out[key] = "--opts"
    return out


def collision_hint(keys: Sequence[str], origin: Mapping[str, str], top: str) -> str:
    """For keys set together where one is allowed: where the older of them was set, and how to
    unset it (``top``: the file given). The newer keys are those of ``--opts`` if any, else those
    the file given sets itself: what the user just wrote."""
    newest = "--opts" if any(origin.get(k) == "--opts" for k in keys) else top
    older = [k for k in keys if origin.get(k) not in (None, newest)]
    if not older:
        return ""
    newer = [k for k in keys if k not in older]
    parts = [f"{k} comes from {origin[k]}" + (" (through BASE)" if origin[k] != top else "") for k in older]
    keep = f" to keep {', '.join(newer)}" if newer else ""
    opts = " ".join(f"{k} null" for k in older)
    if newest == "--opts":
        return f" ({'; '.join(parts)}: pass --opts {opts} as well{keep})"
    fixes = " and ".join(f"{k}: null" for k in older)
    return f" ({'; '.join(parts)}: write {fixes} in {top}{keep}, or pass --opts {opts})"
