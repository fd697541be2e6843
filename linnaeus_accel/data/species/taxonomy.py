"""The classes of each taxonomic rank and the parent of each taxon, read from the labels' rows.

A ``labels.h5`` holds one ``taxa_LXX`` column of taxon ids per rank (``DATA.TASK_KEYS_H5``, finest
first); id 0 is null (an observation identified to genus only has 0 at species). ``Taxonomy``
turns those ids into the class indices a model is trained on, and back, as linnaeus does:

- a rank's classes are its distinct non-null ids, sorted; with partial levels (``DATA.PARTIAL.LEVELS``)
  null is class 0 and the ids follow from 1; without, null is no class and ``keep_rows`` says which
  rows keep (those with an id at every rank);
- a taxon's parent is the id beside it at the next coarser rank. A taxon seen under two parents is
  refused before training: which one a model learns must not depend on row order.

Saved as JSON (``to_json``, version 1) beside a run, it names the predictions:

    {"version": 1, "partial_levels": true,
     "ranks": [{"name": "taxa_L10", "ids": [101, 102], "parents": [11, 0]},
               {"name": "taxa_L20", "ids": [11]}]}

``ids`` are each rank's classes in index order (after the null class with partial levels);
``parents[i]`` is the parent id of ``ids[i]`` at the next rank, 0 where no row says; the coarsest
rank has no ``parents``.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ...config.loading import ConfigError
from ...durable_files import write_durably

FORMAT_VERSION = 1
RANKS_KEY = "DATA.TASK_KEYS_H5"
NO_PARENT = -1  # parent_index where no row names a parent
_MOST_CONFLICTS = 10  # a broken export can disagree on thousands of taxa: the first few tell the story
_RANK_NAME = re.compile(r"taxa_L(\d+)")

IdArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]


class Taxonomy:
    """The classes of each rank and their parents.

    ``ids``: one column of taxon ids per rank, finest first, all of the same length (one entry per
    row; uint32 as in ``labels.h5``, or any integer type). ``rank_names``: the ranks' names in the
    same order, e.g. ``DATA.TASK_KEYS_H5``. The classes come from every row given: a caller that
    drops rows first (``keep_rows``) gets only the classes of the rows it kept.
    """

    def __init__(self, ids: Sequence[ArrayLike], rank_names: Sequence[str], *, partial_levels: bool) -> None:
        names = _check_rank_names(rank_names)
        columns = _columns(ids, names)
        self._names = names
        self._partial = bool(partial_levels)
        self._ids = [_distinct_non_null(column) for column in columns]
        self._parents: list[IdArray] = []
        problems: list[str] = []
        conflicts = 0
        for r in range(len(names) - 1):
            parents, messages, count = self._parents_from_rows(r, columns[r], columns[r + 1])
            self._parents.append(parents)
            problems += messages
            conflicts += count
        if conflicts:
            if conflicts > _MOST_CONFLICTS:
                problems = [
                    *problems[:_MOST_CONFLICTS],
                    f"... and {conflicts - _MOST_CONFLICTS} more taxa with more than one parent",
                ]
            raise ConfigError([(RANKS_KEY, problem) for problem in problems], source="labels")

    # -- what a run asks -------------------------------------------------------------------------

    @property
    def rank_names(self) -> tuple[str, ...]:
        return self._names

    @property
    def partial_levels(self) -> bool:
        return self._partial

    @property
    def num_classes(self) -> tuple[int, ...]:
        """Classes per rank, the null class included with partial levels."""
        return tuple(len(ids) + self._offset for ids in self._ids)

    def class_ids(self, rank_index: int) -> IdArray:
        """The taxon id of each class index at a rank (0 for the null class)."""
        ids = self._ids[self._rank(rank_index)]
        return np.concatenate([np.zeros(1, np.int64), ids]) if self._partial else ids.copy()

    def encode(self, rank_index: int, ids: ArrayLike) -> IdArray:
        """Class indices (int64) of taxon ids at a rank; an id no row had at that rank is a ValueError."""
        r = self._rank(rank_index)
        values = _as_ids(ids, f"ids at {self._names[r]}")
        known = self._ids[r]
        null = values == 0
        if null.any() and not self._partial:
            raise ValueError(
                f"id 0 (null) at {self._names[r]} is no class without partial levels: "
                "drop those rows first (keep_rows), or set DATA.PARTIAL.LEVELS"
            )
        positions = np.searchsorted(known, values)
        found = positions < len(known)
        found[found] = known[positions[found]] == values[found]
        unseen = ~found & ~null
        if unseen.any():
            first = int(values[np.argmax(unseen)])
            count = len(np.unique(values[unseen]))
            others = {1: "", 2: " (and 1 other unseen id)"}.get(count, f" (and {count - 1} other unseen ids)")
            raise ValueError(
                f"taxon {first} was never seen at {self._names[r]}{others}, so it has no class index"
            )
        indices = positions + self._offset
        indices[null] = 0
        return indices.astype(np.int64, copy=False)

    def decode(self, rank_index: int, indices: ArrayLike) -> IdArray:
        """Taxon ids (int64, 0 for the null class) of class indices at a rank."""
        r = self._rank(rank_index)
        values = _as_ids(indices, f"class indices at {self._names[r]}")
        bad = values >= self.num_classes[r]
        if bad.any():
            raise ValueError(
                f"class index {int(values[np.argmax(bad)])} is out of range at {self._names[r]}, "
                f"which has {self.num_classes[r]} classes"
            )
        return self.class_ids(r)[values]

    def parent_index(self, rank_index: int) -> IdArray:
        """For each class index at a rank, its parent's class index at the next coarser rank, or
        ``NO_PARENT`` (-1) where no row names one (the null class included): what a
        hierarchy-aware head or loss needs to tie the ranks together."""
        r = self._rank(rank_index)
        if r == len(self._names) - 1:
            raise ValueError(f"{self._names[r]} is the coarsest rank: it has no parent rank")
        parents = self._parents[r]
        out = np.full(len(parents), NO_PARENT, dtype=np.int64)
        known = parents != 0
        out[known] = np.searchsorted(self._ids[r + 1], parents[known]) + self._offset
        if self._partial:
            out = np.concatenate([np.full(1, NO_PARENT, dtype=np.int64), out])
        return out

    def keep_rows(self, ids: Sequence[ArrayLike]) -> BoolArray:
        """Which rows training keeps, as linnaeus: without partial levels those with an id at every
        rank; with them those with an id at some rank (a row null everywhere teaches nothing)."""
        columns = _columns(ids, self._names)
        stacked = np.stack(columns, axis=1) != 0
        kept: BoolArray = stacked.any(axis=1) if self._partial else stacked.all(axis=1)
        return kept

    def __repr__(self) -> str:
        ranks = ", ".join(f"{name}: {n}" for name, n in zip(self._names, self.num_classes, strict=True))
        return f"Taxonomy({ranks} classes, partial_levels={self._partial})"

    # -- JSON ------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The taxonomy as plain JSON data (see the module's docstring for the layout)."""
        ranks: list[dict[str, Any]] = []
        for r, name in enumerate(self._names):
            rank: dict[str, Any] = {"name": name, "ids": self._ids[r].tolist()}
            if r < len(self._parents):
                rank["parents"] = self._parents[r].tolist()
            ranks.append(rank)
        return {"version": FORMAT_VERSION, "partial_levels": self._partial, "ranks": ranks}

    @classmethod
    def from_json(cls, data: Any, *, source: str = "taxonomy JSON") -> Taxonomy:
        """The taxonomy ``to_json`` wrote; ``source`` names the data in a ValueError when it is malformed."""

        def bad(message: str) -> ValueError:
            return ValueError(f"{source} is not a version-{FORMAT_VERSION} taxonomy: {message}")

        if not isinstance(data, dict):
            raise bad(f"it holds a {type(data).__name__}, not an object")
        if set(data) != {"version", "partial_levels", "ranks"}:
            raise bad(f"it has the keys {sorted(data)}, not exactly 'version', 'partial_levels' and 'ranks'")
        if data["version"] != FORMAT_VERSION or isinstance(data["version"], bool):
            raise bad(f"its version is {data['version']!r}")
        if not isinstance(data["partial_levels"], bool):
            raise bad(f"partial_levels is {data['partial_levels']!r}, not true or false")
        ranks = data["ranks"]
        if not isinstance(ranks, list) or not ranks:
            raise bad("ranks is not a non-empty list")
        names: list[str] = []
        ids: list[IdArray] = []
        for r, rank in enumerate(ranks):
            expected = {"name", "ids", "parents"} if r < len(ranks) - 1 else {"name", "ids"}
            if not isinstance(rank, dict) or set(rank) != expected:
                raise bad(f"ranks[{r}] is not an object with exactly the keys {sorted(expected)}")
            if not isinstance(rank["name"], str) or not rank["name"]:
                raise bad(f"ranks[{r}].name is not a non-empty string")
            names.append(rank["name"])
            column = _int_list(rank["ids"], f"ranks[{r}].ids", bad)
            if (column <= 0).any() or (np.diff(column) <= 0).any():
                raise bad(f"ranks[{r}].ids are not positive and strictly increasing")
            ids.append(column)
        parents: list[IdArray] = []
        for r in range(len(ranks) - 1):
            column = _int_list(ranks[r]["parents"], f"ranks[{r}].parents", bad)
            if len(column) != len(ids[r]):
                raise bad(f"ranks[{r}] has {len(ids[r])} ids but {len(column)} parents")
            named = column[column != 0]
            unknown = ~np.isin(named, ids[r + 1])
            if unknown.any():
                raise bad(
                    f"ranks[{r}].parents names {int(named[np.argmax(unknown)])}, not an id of ranks[{r + 1}]"
                )
            parents.append(column)
        try:
            checked = _check_rank_names(names)
        except ConfigError as exc:
            raise bad(exc.problems[0][1]) from None
        taxonomy = cls.__new__(cls)
        taxonomy._names = checked
        taxonomy._partial = data["partial_levels"]
        taxonomy._ids = ids
        taxonomy._parents = parents
        return taxonomy

    def save(self, path: str | Path) -> None:
        """Write the JSON to ``path`` whole or not at all (a reader never sees half a file)."""
        target = Path(path)
        data = json.dumps(self.to_json(), indent=1).encode("utf-8")
        write_durably(target, target.with_name(f".{target.name}.tmp"), data)

    @classmethod
    def load(cls, path: str | Path) -> Taxonomy:
        """The taxonomy saved at ``path``; a malformed file is a ValueError naming it."""
        text = Path(path).read_text(encoding="utf-8")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON ({exc}), so not a saved taxonomy") from None
        return cls.from_json(data, source=str(path))

    # -- building --------------------------------------------------------------------------------

    @property
    def _offset(self) -> int:
        return 1 if self._partial else 0

    def _rank(self, rank_index: int) -> int:
        if isinstance(rank_index, bool) or not isinstance(rank_index, (int, np.integer)):
            raise TypeError(f"rank_index is a position in {list(self._names)}, not {rank_index!r}")
        if not 0 <= rank_index < len(self._names):
            raise ValueError(f"rank_index {rank_index} is not a rank: there are {len(self._names)} ranks")
        return int(rank_index)

    def _parents_from_rows(self, r: int, child: IdArray, parent: IdArray) -> tuple[IdArray, list[str], int]:
        """The parent id (0: none known) of each class of rank ``r``, with a message for each of the
        first few children seen under more than one parent and the number of such children. A row
        with a null on either side says nothing about the link."""
        rows = np.flatnonzero((child != 0) & (parent != 0))
        pair_child, pair_parent = child[rows], parent[rows]
        order = np.lexsort((pair_parent, pair_child))  # stable: each pair's first row stays first
        pair_child, pair_parent, rows = pair_child[order], pair_parent[order], rows[order]
        first = np.ones(len(rows), dtype=bool)
        first[1:] = (pair_child[1:] != pair_child[:-1]) | (pair_parent[1:] != pair_parent[:-1])
        pair_child, pair_parent, rows = pair_child[first], pair_parent[first], rows[first]
        torn = np.unique(pair_child[1:][pair_child[1:] == pair_child[:-1]])
        messages = []
        for taxon in torn[:_MOST_CONFLICTS]:
            mine = pair_child == taxon
            named = [
                f"{p} (first at row {row})" for p, row in zip(pair_parent[mine], rows[mine], strict=True)
            ]
            messages.append(
                f"taxon {taxon} at {self._names[r]} has {len(named)} different parents at {self._names[r + 1]}, "
                f"{_and(named)}: each taxon needs exactly one parent, so correct the rows that disagree"
            )
        parents = np.zeros(len(self._ids[r]), dtype=np.int64)
        parents[np.searchsorted(self._ids[r], pair_child)] = pair_parent
        return parents, messages, len(torn)


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _check_rank_names(rank_names: Sequence[str]) -> tuple[str, ...]:
    names = tuple(rank_names)
    if not names or not all(isinstance(name, str) and name for name in names):
        raise ConfigError([(RANKS_KEY, f"needs one or more rank names, not {list(names)}")], source="labels")
    if len(set(names)) != len(names):
        raise ConfigError([(RANKS_KEY, f"lists a rank twice: {list(names)}")], source="labels")
    levels = [_RANK_NAME.fullmatch(name) for name in names]
    if all(levels) and any(int(a[1]) >= int(b[1]) for a, b in itertools.pairwise(levels) if a and b):
        raise ConfigError(
            [(RANKS_KEY, f"lists {list(names)}, but ranks go finest first (taxa_L10 before taxa_L20)")],
            source="labels",
        )
    return names


def _columns(ids: Sequence[ArrayLike], names: tuple[str, ...]) -> list[IdArray]:
    if len(ids) != len(names):
        raise ValueError(f"{len(ids)} id columns for {len(names)} ranks {list(names)}")
    columns = [_as_ids(column, f"ids at {name}") for column, name in zip(ids, names, strict=True)]
    lengths = {len(column) for column in columns}
    if len(lengths) > 1:
        raise ValueError(f"the id columns of {list(names)} differ in length: {[len(c) for c in columns]}")
    return columns


def _as_ids(values: ArrayLike, what: str) -> IdArray:
    """A 1-D int64 copy-if-needed of non-negative integers (taxon ids, class indices)."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional, not of shape {array.shape}")
    if array.dtype.kind not in "iu":
        if array.size == 0:
            return np.zeros(0, dtype=np.int64)
        raise ValueError(f"{what} must be integers, not {array.dtype}")
    if array.dtype == np.uint64 and array.size and array.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{what} holds {int(array.max())}, too large for an id")
    array = array.astype(np.int64, copy=False)
    negative = array < 0
    if negative.any():
        row = int(np.argmax(negative))
        raise ValueError(f"{what} holds {int(array[row])} at row {row}: ids and indices are never negative")
    return array


def _distinct_non_null(column: IdArray) -> IdArray:
    distinct = np.unique(column)
    non_null: IdArray = distinct[distinct != 0]
    return non_null


def _int_list(value: Any, where: str, bad: Callable[[str], ValueError]) -> IdArray:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise bad(f"{where} is not a list of integers")
    if any(not -(2**63) <= v < 2**63 for v in value):
        raise bad(f"{where} holds an integer too large for an id")
    column: IdArray = np.asarray(value, dtype=np.int64)
    return column
