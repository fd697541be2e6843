"""The ``sources`` of the built-in dataset ``mixture``, read from its ``OPTIONS``: each entry's
``name``, ``options``, ``weight`` and ``label``, every problem recorded with its key.

A source's ``label`` names it in logs (``samples_seen/<label>``) and ``plan``. Left out, it is the
source's ``name``; where several sources would then share one label (two ``token_files``, the
commonest mixture), each unlabelled one is told apart by the stem of its first path (``train_a``
for ``data/train_a.bin``; for a pattern, what precedes its first wildcard, or its directory:
``web`` for ``web/*.bin``), and by ``_<index>`` (its place in the list) where that still leaves two
alike. Labels given alike are an error: that is a clash only the config can settle.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import PurePath
from typing import Any

from ..options import DatasetOptions

OPTIONS_KEY = "DATA.DATASET.OPTIONS"
_ENTRY_KEYS = ("name", "options", "weight", "label")
_WEIGHT_FIX = (
    "the source's share of the samples relative to the others' weights (e.g. 0.7 and 0.3, or 7 and 3)"
)


@dataclass(frozen=True)
class SourceEntry:
    """One parsed ``sources`` item; ``index`` is its place in the list, for error keys;
    ``labelled``: the label was given (not defaulted)."""

    index: int
    name: str
    options: dict[str, Any]
    weight: float
    label: str
    labelled: bool = True


@dataclass(frozen=True)
class MixtureSource:
    """A dataset of a mixture: ``label`` names it in logs and ``plan``; ``weight`` is its share of
    the samples, relative to the other sources' weights."""

    label: str
    dataset: Any
    weight: float
    # What the source reads, equal for two sources reading the same data (the builder gives its
    # dataset's name and options); None: the dataset object. Token files are compared by file
    # (``mixture_overlap``).
    reads: str | None = None


def _parse_entry(options: DatasetOptions, index: int, entry: Any) -> SourceEntry | None:
    """The ``index``-th source, or None after recording its problems in ``options``."""
    key = f"sources.{index}"
    if not isinstance(entry, dict):
        options.problem(key, f"a source is a mapping of {', '.join(_ENTRY_KEYS)}, got {entry!r}")
        return None
    found = len(options.problems)
    unknown = sorted(set(entry) - set(_ENTRY_KEYS))
    if unknown:
        options.problem(key, f"a source takes {', '.join(_ENTRY_KEYS)}; not {', '.join(map(str, unknown))}")
    name: Any = entry.get("name")
    if not isinstance(name, str) or not name:
        options.problem(f"{key}.name", f"must name a registered dataset (e.g. token_files), got {name!r}")
    source_options: Any = {} if entry.get("options") is None else entry["options"]
    if not isinstance(source_options, dict):
        options.problem(f"{key}.options", f"must be a mapping (the source's OPTIONS), got {source_options!r}")
    weight: Any = entry.get("weight")
    if weight is None:
        options.problem(f"{key}.weight", f"is required: a number > 0, {_WEIGHT_FIX}")
    elif (
        isinstance(weight, bool)
        or not isinstance(weight, int | float)
        or not math.isfinite(weight)
        or weight <= 0
    ):
        options.problem(f"{key}.weight", f"must be a number > 0, {_WEIGHT_FIX}; got {weight!r}")
    label: Any = entry.get("label", name)
    if "label" in entry and (not isinstance(label, str) or not label):
        options.problem(f"{key}.label", f"must be a non-empty string, got {label!r}")
    if len(options.problems) > found:
        return None
    return SourceEntry(index, name, dict(source_options), weight, label, labelled="label" in entry)


def path_stem(options: dict[str, Any]) -> str | None:
    """The stem of a source's first path (``paths``, a string or a list), None without one: what
    precedes the first wildcard of a pattern, or else its directory's name."""
    paths = options.get("paths")
    first = paths[0] if isinstance(paths, list) and paths else paths
    if not isinstance(first, str) or not first:
        return None
    *directories, name = PurePath(first).parts
    for part in (PurePath(name).stem, *reversed(directories)):
        if stem := re.split(r"[*?\[]", part)[0].strip("_-./ "):
            return stem
    return None


def _told_apart(entries: list[SourceEntry]) -> list[SourceEntry]:
    """Each unlabelled entry whose default label (its name) another source shares, labelled by its
    first path's stem, then by ``_<index>`` where that is still shared (see the module docstring)."""

    def by_stem(entry: SourceEntry) -> str:
        return path_stem(entry.options) or entry.label

    def by_index(entry: SourceEntry) -> str:
        return f"{entry.label}_{entry.index}"

    for tell in (by_stem, by_index):
        count = Counter(e.label for e in entries)
        entries = [e if e.labelled or count[e.label] == 1 else replace(e, label=tell(e)) for e in entries]
    return entries


def parse_sources(options: DatasetOptions) -> list[SourceEntry]:
    """The well-formed ``sources``; the problems of the others (and duplicate labels) go to ``options``."""
    raw = options.raw("sources", required=True)
    if raw is None:
        return []
    if not isinstance(raw, list) or not raw:
        options.problem(
            "sources", f"must be a non-empty list of sources (name, weight, options, label), got {raw!r}"
        )
        return []
    entries = [e for i, item in enumerate(raw) if (e := _parse_entry(options, i, item)) is not None]
    entries = _told_apart(entries)
    first: dict[str, int] = {}
    for entry in entries:
        if entry.label in first:
            options.problem(
                f"sources.{entry.index}.label",
                f"{entry.label!r} already labels source {first[entry.label]}: give each source a distinct "
                "label (it names the source in logs and plan; it defaults to the source's name, told apart "
                "from another source's by its first path's stem)",
            )
        first.setdefault(entry.label, entry.index)
    return entries
