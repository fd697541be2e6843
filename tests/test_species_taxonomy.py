"""The taxonomy of linnaeus' labels: class indices per rank with and without partial levels, the
parent of each taxon (a taxon under two parents refused), and the JSON a run saves to name its
predictions."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from linnaeus_accel.config import ConfigError
from linnaeus_accel.data.species.taxonomy import Taxonomy

RANKS = ["taxa_L10", "taxa_L20", "taxa_L30"]
# One row per observation: (species, genus, family); 0 is null.
ROWS = [
    (101, 11, 1),
    (102, 11, 1),
    (201, 21, 1),
    (0, 21, 1),  # identified to genus only
    (103, 0, 1),  # a species whose genus is missing: no parent known
    (101, 0, 1),  # genus missing here, but row 0 knows 101's genus: no conflict
    (301, 31, 2),
    (0, 0, 0),  # no label at all
]


def columns(rows: list[tuple[int, ...]]) -> list[np.ndarray[Any, np.dtype[np.uint32]]]:
    return [np.array(column, dtype=np.uint32) for column in zip(*rows, strict=True)]


def taxonomy(partial: bool) -> Taxonomy:
    return Taxonomy(columns(ROWS), RANKS, partial_levels=partial)


# (partial levels, rank, taxon ids, class indices)
INDICES = [
    (True, 0, [0, 101, 102, 103, 201, 301], [0, 1, 2, 3, 4, 5]),  # null is class 0, the sorted ids follow
    (True, 1, [31, 0, 11], [3, 0, 1]),  # in any order
    (False, 0, [101, 102, 103, 201, 301], [0, 1, 2, 3, 4]),  # no null class: the ids start at 0
    (False, 2, [2, 1], [1, 0]),
]


@pytest.mark.parametrize(("partial", "rank", "ids", "expected"), INDICES)
def test_taxon_ids_become_class_indices(
    partial: bool, rank: int, ids: list[int], expected: list[int]
) -> None:
    indices = taxonomy(partial).encode(rank, np.array(ids, dtype=np.uint32))
    assert indices.dtype == np.int64
    assert indices.tolist() == expected


# (partial levels, classes per rank)
NUM_CLASSES = [
    (True, (6, 4, 3)),  # each rank's distinct ids, and a null class
    (False, (5, 3, 2)),  # the same ids, no null class
]


@pytest.mark.parametrize(("partial", "expected"), NUM_CLASSES)
def test_classes_per_rank(partial: bool, expected: tuple[int, ...]) -> None:
    assert taxonomy(partial).num_classes == expected


# (partial levels, which of ROWS training keeps)
KEPT = [
    (False, [True, True, True, False, False, False, True, False]),  # a null at any rank drops the row
    (True, [True, True, True, True, True, True, True, False]),  # only the row null everywhere goes
]


@pytest.mark.parametrize(("partial", "expected"), KEPT)
def test_rows_training_keeps(partial: bool, expected: list[bool]) -> None:
    assert taxonomy(partial).keep_rows(columns(ROWS)).tolist() == expected


def test_a_null_is_no_class_without_partial_levels() -> None:
    with pytest.raises(ValueError, match=r"id 0 \(null\) at taxa_L10 is no class without partial levels"):
        taxonomy(False).encode(0, [101, 0])


@pytest.mark.parametrize("partial", [True, False], ids=["partial", "no-partial"])
def test_decode_undoes_encode(partial: bool) -> None:
    tax = taxonomy(partial)
    for rank, ids in enumerate(columns(ROWS[:3] + ROWS[6:7])):
        assert tax.decode(rank, tax.encode(rank, ids)).tolist() == ids.tolist()


def test_an_unseen_id_is_named() -> None:
    with pytest.raises(ValueError, match=r"^taxon 999 was never seen at taxa_L10, so it has no class index$"):
        taxonomy(True).encode(0, [101, 999])


def test_a_class_index_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="class index 6 is out of range at taxa_L10, which has 6 classes"):
        taxonomy(True).decode(0, [6])


# (partial levels, rank, parent class index of each class index at that rank; -1: none known)
PARENTS = [
    (True, 0, [-1, 1, 1, -1, 2, 3]),  # null has none; 103's genus is in no row
    (True, 1, [-1, 1, 1, 2]),  # genus 11 and 21 in family 1, 31 in family 2
    (False, 0, [0, 0, -1, 1, 2]),  # the same links, without the null class on either side
]


@pytest.mark.parametrize(("partial", "rank", "expected"), PARENTS)
def test_parent_index(partial: bool, rank: int, expected: list[int]) -> None:
    assert taxonomy(partial).parent_index(rank).tolist() == expected


def test_the_coarsest_rank_has_no_parents() -> None:
    with pytest.raises(ValueError, match="taxa_L30 is the coarsest rank"):
        taxonomy(True).parent_index(2)


def test_a_taxon_under_two_parents_is_refused_in_one_sentence() -> None:
    rows = [(101, 11), (101, 0), (101, 12), (101, 11)]  # row 1's missing genus is not a third parent
    with pytest.raises(ConfigError) as caught:
        Taxonomy(columns(rows), ["taxa_L10", "taxa_L20"], partial_levels=True)
    assert caught.value.problems == [
        (
            "DATA.TASK_KEYS_H5",
            "taxon 101 at taxa_L10 has 2 different parents at taxa_L20, 11 (first at row 0) and 12 "
            "(first at row 2): each taxon needs exactly one parent, so correct the rows that disagree",
        )
    ]


def test_ranks_listed_coarsest_first_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"ranks go finest first \(taxa_L10 before taxa_L20\)"):
        Taxonomy(columns([(11, 101)]), ["taxa_L20", "taxa_L10"], partial_levels=True)


@pytest.mark.parametrize("partial", [True, False], ids=["partial", "no-partial"])
def test_saved_and_loaded_it_names_the_same_classes(tmp_path: Path, partial: bool) -> None:
    tax = taxonomy(partial)
    path = tmp_path / "taxonomy.json"
    tax.save(path)
    loaded = Taxonomy.load(path)
    assert json.loads(path.read_text())["version"] == 1
    assert loaded.to_json() == tax.to_json()
    assert loaded.num_classes == tax.num_classes
    assert loaded.decode(0, [1, 2]).tolist() == tax.decode(0, [1, 2]).tolist()
    assert loaded.parent_index(0).tolist() == tax.parent_index(0).tolist()
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left beside it


Edit = Callable[[dict[str, Any]], object]


def ranks(n: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A rank's entry in the file's data."""

    def entry(data: dict[str, Any]) -> dict[str, Any]:
        found: dict[str, Any] = data["ranks"][n]
        return found

    return entry


# (edit to a good file's data, what the ValueError says)
MALFORMED: list[tuple[Edit, str]] = [
    (lambda d: d.update(version=2), "its version is 2"),  # written by a newer format
    (lambda d: d.pop("ranks"), "it has the keys"),
    (lambda d: d.update(partial_levels="yes"), "partial_levels is 'yes', not true or false"),
    (
        lambda d: ranks(0)(d).update(ids=[102, 101, 103, 201, 301]),
        r"ranks\[0\].ids are not positive and strictly increasing",
    ),
    (
        lambda d: ranks(0)(d).update(ids=["101", 102, 103, 201, 301]),
        r"ranks\[0\].ids is not a list of integers",
    ),
    (lambda d: ranks(0)(d).update(parents=[11]), r"ranks\[0\] has 5 ids but 1 parents"),
    (lambda d: ranks(1)(d).update(parents=[7, 1, 2]), r"ranks\[1\].parents names 7, not an id of ranks\[2\]"),
    (
        lambda d: ranks(2)(d).update(parents=[]),
        r"ranks\[2\] is not an object with exactly the keys \['ids', 'name'\]",
    ),
]
MALFORMED_IDS = [
    "newer-version",
    "no-ranks",
    "flag-not-bool",
    "ids-unsorted",
    "id-as-string",
    "parents-too-few",
    "parent-unknown",
    "coarsest-with-parents",
]


@pytest.mark.parametrize(("edit", "message"), MALFORMED, ids=MALFORMED_IDS)
def test_a_malformed_taxonomy_is_refused(edit: Edit, message: str) -> None:
    data = taxonomy(True).to_json()
    edit(data)
    with pytest.raises(ValueError, match=message):
        Taxonomy.from_json(data)


def test_a_file_that_is_not_json_is_named(tmp_path: Path) -> None:
    path = tmp_path / "taxonomy.json"
    path.write_text('{"version": 1,')  # cut off mid-write by something other than save
    with pytest.raises(ValueError, match=r"taxonomy\.json is not JSON"):
        Taxonomy.load(path)


def test_200k_rows_take_well_under_a_second() -> None:
    rng = np.random.default_rng(0)
    species = rng.integers(1, 50_000, 200_000).astype(np.uint32)
    ranks = [species, species // 10, species // 100, species // 1000]  # each taxon has one parent
    species[rng.random(200_000) < 0.1] = 0  # some identified to genus only
    start = time.perf_counter()
    tax = Taxonomy(ranks, ["taxa_L10", "taxa_L20", "taxa_L30", "taxa_L40"], partial_levels=True)
    indices = tax.encode(0, species)
    assert time.perf_counter() - start < 1.0
    assert tax.decode(0, indices).tolist() == species.tolist()
