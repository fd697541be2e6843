"""A table of observations (CSV, JSON Lines, Parquet) read as a labels file is: the same rows from
every format, names numbered per rank, empty cells as null ranks and missing metadata, every
mistake refused before training in one sentence, and a taxonomy built from it."""

from __future__ import annotations

import csv
import datetime
import json
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from linnaeus_accel.config import ConfigError
from linnaeus_accel.data.species.metadata import encode_elevation, encode_spatial, encode_temporal
from linnaeus_accel.data.species.table import (
    DATE_KEY,
    ELEVATION_KEY,
    IMAGE_KEY,
    LATITUDE_KEY,
    LONGITUDE_KEY,
    RANKS_KEY,
    SCALES_KEY,
    TABLE_KEY,
    TEMPORAL_KEY,
    ObservationTable,
)
from linnaeus_accel.data.species.taxonomy import Taxonomy

COLUMNS = ["photo", "species", "genus", "lat", "lon", "date", "elev"]
OBSERVATIONS: list[dict[str, Any]] = [
    # Everything known.
    {"photo": "0001.jpg", "species": "Quercus robur", "genus": "Quercus", "lat": 45.5, "lon": 7.25,
     "date": "2021-07-04", "elev": 1200.0},
    # Identified to genus only, and nothing known of where, when or how high.
    {"photo": "0002.jpg", "species": None, "genus": "Quercus", "lat": None, "lon": None, "date": None,
     "elev": None},
    # A time after the date; below sea level.
    {"photo": "0003.jpg", "species": "Fagus sylvatica", "genus": "Fagus", "lat": -10.0, "lon": -20.0,
     "date": "2020-01-31T10:00:00", "elev": -5.0},
    # No elevation alone.
    {"photo": "0004.jpg", "species": "Quercus robur", "genus": "Quercus", "lat": 0.0, "lon": 180.0,
     "date": "2019-12-01", "elev": None},
]  # fmt: skip
OPTIONS: dict[str, Any] = {
    "image_column": "photo",
    "rank_columns": ["species", "genus"],
    "latitude_column": "lat",
    "longitude_column": "lon",
    "date_column": "date",
    "elevation_column": "elev",
}
# (row, photo, ids per rank, validity of SPATIAL, TEMPORAL, ELEVATION); names sorted per rank:
# Fagus sylvatica 1, Quercus robur 2; Fagus 1, Quercus 2.
ROWS = [
    (0, "0001.jpg", {"species": 2, "genus": 2}, [True, True, True]),
    (1, "0002.jpg", {"species": 0, "genus": 2}, [False, False, False]),
    (2, "0003.jpg", {"species": 1, "genus": 1}, [True, True, True]),
    (3, "0004.jpg", {"species": 2, "genus": 2}, [True, True, False]),
]


def write_csv(path: Path, records: list[dict[str, Any]], columns: list[str] = COLUMNS) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows([["" if r.get(c) is None else r[c] for c in columns] for r in records])
    return path


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    # Empty values as absent keys, JSON Lines' usual way; the first row has every key.
    lines = [
        json.dumps(r if i == 0 else {k: v for k, v in r.items() if v is not None})
        for i, r in enumerate(records)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_parquet(path: Path, records: list[dict[str, Any]]) -> Path:
    # Dates as Parquet holds them, typed timestamps, not text.
    typed = [{**r, "date": r["date"] and datetime.datetime.fromisoformat(r["date"])} for r in records]
    pq.write_table(pa.Table.from_pylist(typed), path)
    return path


WRITERS = {
    "obs.csv": write_csv,
    "obs.jsonl": write_jsonl,
    "obs.ndjson": write_jsonl,
    "obs.parquet": write_parquet,
}


def problems_of(path: Path, **options: Any) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        ObservationTable(path, **options)
    return info.value.problems


@pytest.mark.parametrize("name", WRITERS)
def test_every_format_reads_back_the_same_rows(tmp_path: Path, name: str) -> None:
    table = ObservationTable(WRITERS[name](tmp_path / name, OBSERVATIONS), **OPTIONS)
    assert (len(table), table.n_rows, table.task_keys) == (4, 4, ["species", "genus"])
    assert [(c.name, c.source, c.dim, c.idx) for c in table.components] == [
        ("SPATIAL", "spatial", 3, 0),
        ("TEMPORAL", "temporal", 2, 1),
        ("ELEVATION", "elevation", 10, 2),  # five default scales, a sin/cos pair each
    ]
    assert table.component_slices == {
        "SPATIAL": slice(0, 3),
        "TEMPORAL": slice(3, 5),
        "ELEVATION": slice(5, 15),
    }
    assert table.meta_dim == 15
    column = {c: [r[c] for r in OBSERVATIONS] for c in COLUMNS}
    expected = np.concatenate(
        [
            encode_spatial(column["lat"], column["lon"])[0],
            encode_temporal(column["date"])[0],
            encode_elevation(column["elev"])[0],
        ],
        axis=1,
    )
    batch = table.rows([3, 0, 2, 1])
    assert batch.identifiers == ["0004.jpg", "0001.jpg", "0003.jpg", "0002.jpg"]
    np.testing.assert_allclose(batch.meta, expected[[3, 0, 2, 1]], atol=1e-6)
    for index, photo, ids, valid in ROWS:
        row = table.row(index)
        assert (row.index, row.identifier, row.taxa, row.valid.tolist()) == (index, photo, ids, valid)
        assert row.meta.dtype == np.float32
    assert not table.row(1).meta.any()  # a missing component is zeros, never fed as a value
    assert table.names("genus") == {1: "Fagus", 2: "Quercus"}


def test_ids_names_and_empty_cells(tmp_path: Path) -> None:
    records = [
        {"photo": "a.jpg", "species": "101", "genus": " Quercus "},  # spaces around a name are not part of it
        {"photo": "b.jpg", "species": "", "genus": "Abies"},  # empty: null at that rank
        {
            "photo": "c.jpg",
            "species": "102.0",
            "genus": "  ",
        },  # an id written through a float; blank is empty
        {"photo": "d.jpg", "species": "0", "genus": "Quercus"},  # 0 is null, as in labels.h5
    ]
    path = write_csv(tmp_path / "obs.csv", records, ["photo", "species", "genus"])
    table = ObservationTable(path, image_column="photo", rank_columns=["species", "genus"])
    taxa = table.taxa_columns()
    assert {rank: ids.tolist() for rank, ids in taxa.items()} == {
        "species": [101, 0, 102, 0],
        "genus": [2, 1, 0, 2],
    }
    assert all(ids.dtype == np.uint32 for ids in taxa.values())
    assert (table.names("species"), table.names("genus")) == ({}, {1: "Abies", 2: "Quercus"})
    assert (table.components, table.meta_dim, table.row(0).meta.shape, table.row(0).valid.shape) == (
        (),
        0,
        (0,),
        (0,),
    )
    taxa["genus"][:] = 7
    assert table.taxa_columns()["genus"].tolist() == [2, 1, 0, 2]  # a copy: the table's ids stay as read
    with pytest.raises(KeyError, match="'family' is not a rank"):
        table.names("family")
    with pytest.raises(IndexError, match=r"row 4 is outside .*obs.csv \(4 rows, 0 to 3\)"):
        table.rows([0, 4])


def test_some_components_and_day_of_year(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "obs.csv", OBSERVATIONS)
    table = ObservationTable(
        path, image_column="photo", rank_columns=["genus"], date_column="date", elevation_column="elev",
        temporal="day_of_year", elevation_scales=[1000.0],
    )  # fmt: skip
    # Only the columns given make components, in IDX order from 0.
    assert [(c.name, c.dim, c.idx) for c in table.components] == [("TEMPORAL", 2, 0), ("ELEVATION", 2, 1)]
    np.testing.assert_allclose(
        table.row(0).meta[:2], encode_temporal(["2021-07-04"], "day_of_year")[0][0], atol=1e-6
    )
    np.testing.assert_allclose(table.row(0).meta[2:], encode_elevation([1200.0], [1000.0])[0][0], atol=1e-6)


def test_a_timestamp_with_a_zone_keeps_its_local_date(tmp_path: Path) -> None:
    # 1 July, 01:00 in Tokyo is still 30 June in UTC: the month of the observation is July.
    local = pa.array([datetime.datetime(2021, 6, 30, 16, 0)], pa.timestamp("s", tz="UTC")).cast(
        pa.timestamp("s", tz="Asia/Tokyo")
    )
    pq.write_table(pa.table({"photo": ["a.jpg"], "genus": [3], "date": local}), tmp_path / "obs.parquet")
    table = ObservationTable(
        tmp_path / "obs.parquet", image_column="photo", rank_columns=["genus"], date_column="date"
    )
    np.testing.assert_allclose(table.row(0).meta, encode_temporal(["2021-07-01"])[0][0], atol=1e-6)


def test_pickles_whole(tmp_path: Path) -> None:
    table = ObservationTable(write_csv(tmp_path / "obs.csv", OBSERVATIONS), **OPTIONS)
    copy = pickle.loads(pickle.dumps(table))
    original, restored = table.rows([0, 1, 2, 3]), copy.rows([0, 1, 2, 3])
    assert restored.identifiers == original.identifiers
    assert {k: v.tolist() for k, v in restored.taxa.items()} == {
        k: v.tolist() for k, v in original.taxa.items()
    }
    np.testing.assert_array_equal(restored.meta, original.meta)
    np.testing.assert_array_equal(restored.valid, original.valid)
    assert copy.names("species") == table.names("species")


def test_a_taxonomy_builds_from_it(tmp_path: Path) -> None:
    table = ObservationTable(write_csv(tmp_path / "obs.csv", OBSERVATIONS), **OPTIONS)
    taxonomy = Taxonomy(list(table.taxa_columns().values()), table.task_keys, partial_levels=True)
    assert taxonomy.rank_names == ("species", "genus")
    assert taxonomy.num_classes == (3, 3)  # the null class and two taxa at each rank
    # Fagus sylvatica under Fagus, Quercus robur under Quercus, the null class under none.
    assert taxonomy.parent_index(0).tolist() == [-1, 1, 2]
    names = [table.names("species").get(int(i), "") for i in taxonomy.class_ids(0)]
    assert names == ["", "Fagus sylvatica", "Quercus robur"]


BASE = {"image_column": "photo", "rank_columns": ["species", "genus"]}
GOOD = "photo,species,genus,lat,lon,date\na.jpg,1,10,1,2,2021-01-01\n"
PRESENT = "(its columns: photo, species, genus, lat, lon, date)"
MIXED = "mixes taxon ids and names (row 0 has '42', row 1 has 'Quercus robur'): write ids or names throughout the column"
# (file name, its text, options, the problems raised; PATH stands for the file's path).
REFUSALS: list[tuple[str, str, dict[str, Any], list[tuple[str, str]]]] = [
    # An unknown column: the columns present are named.
    ("obs.csv", GOOD, {**BASE, "image_column": "img"},
     [(IMAGE_KEY, f"PATH has no column 'img' {PRESENT}: set {IMAGE_KEY} to one of them")]),
    # A rank column missing, and none at all.
    ("obs.csv", GOOD, {**BASE, "rank_columns": ["species", "family"]},
     [(RANKS_KEY, f"PATH has no column 'family' {PRESENT}: remove it from {RANKS_KEY}")]),
    ("obs.csv", GOOD, {**BASE, "rank_columns": []},
     [(RANKS_KEY, f"{RANKS_KEY} is empty: list the table's rank columns, finest first")]),
    # Photos missing: the first row is named, the others counted.
    ("obs.csv", "photo,species,genus\na.jpg,1,2\n,1,2\nc.jpg,1,2\n  ,1,2\n", BASE,
     [(IMAGE_KEY, "PATH: column 'photo' has no photo at row 1 (and 1 other row): give every row its photo's file "
                  "name or drop the rows without one")]),
    # Ids and names in one rank column, in CSV and in JSON Lines alike.
    ("obs.csv", "photo,species,genus\na.jpg,42,\nb.jpg,Quercus robur,\n", BASE,
     [(RANKS_KEY, f"PATH: column 'species' {MIXED}")]),
    ("obs.jsonl", '{"photo": "a.jpg", "species": 42}\n{"photo": "b.jpg", "species": "Quercus robur"}\n',
     {**BASE, "rank_columns": ["species"]}, [(RANKS_KEY, f"PATH: column 'species' {MIXED}")]),
    # An id that is no uint32.
    ("obs.csv", "photo,species,genus\na.jpg,-3,\nb.jpg,4294967296,\n", BASE,
     [(RANKS_KEY, "PATH: column 'species' holds -3 at row 0 (and 1 other row), not a taxon id (1 to 4294967295): "
                  "correct it or leave the cell empty")]),
    # Out-of-range coordinates, refused by the encoder, keyed to the column to fix.
    ("obs.csv", "photo,species,genus,y,x\na.jpg,1,2,10,20\nb.jpg,1,2,91,20\n",
     {**BASE, "latitude_column": "y", "longitude_column": "x"},
     [(LATITUDE_KEY, "PATH, column 'y': row 1 has latitude 91.0, which is not within [-90, 90] degrees; NaN marks "
                     "a missing value")]),
    ("obs.csv", "photo,species,genus,y,x\na.jpg,1,2,10,-181\n", {**BASE, "latitude_column": "y", "longitude_column": "x"},
     [(LONGITUDE_KEY, "PATH, column 'x': row 0 has longitude -181.0, which is not within [-180, 180] degrees; NaN "
                      "marks a missing value")]),
    # A latitude without its longitude.
    ("obs.csv", GOOD, {**BASE, "latitude_column": "lat"},
     [(LONGITUDE_KEY, f"{LATITUDE_KEY} is set but {LONGITUDE_KEY} is not: a location needs both, so set both or "
                      "neither")]),
    # An unparseable date; a temporal encoding that does not exist.
    ("obs.csv", "photo,species,genus,when\na.jpg,1,2,2021-07-04\nb.jpg,1,2,2021-13-45\n",
     {**BASE, "date_column": "when"},
     [(DATE_KEY, "PATH, column 'when': row 1 has date '2021-13-45', which is not an ISO date (YYYY-MM-DD, a time "
                 "may follow)")]),
    ("obs.csv", GOOD, {**BASE, "date_column": "date", "temporal": "week"},
     [(TEMPORAL_KEY, f"{TEMPORAL_KEY} is 'month' or 'day_of_year', not 'week'")]),
    # Text where metres are expected; scales that are no lengths.
    ("obs.csv", "photo,species,genus,m\na.jpg,1,2,12\nb.jpg,1,2,high\n", {**BASE, "elevation_column": "m"},
     [(ELEVATION_KEY, "PATH: column 'm' holds 'high' at row 1, not a number of metres: correct it or leave the "
                      "cell empty")]),
    ("obs.csv", "photo,species,genus,m\na.jpg,1,2,12\n", {**BASE, "elevation_column": "m", "elevation_scales": [0.0]},
     [(SCALES_KEY, f"{SCALES_KEY}: scales must be one or more positive numbers of metres, not [0.0]")]),
    # Empty tables: a header alone, an empty file.
    ("obs.csv", "photo,species,genus\n", BASE, [(TABLE_KEY, "PATH has no rows: write one row per photo into it")]),
    ("obs.jsonl", "", BASE, [(TABLE_KEY, "PATH has no rows: write one row per photo into it")]),
    # A file that is no table this reads.
    ("obs.xlsx", "x", BASE,
     [(TABLE_KEY, "PATH is no table this reads: name a .csv, .jsonl, .ndjson or .parquet file")]),
    # Every problem at once, options first, then the columns in the order of the options.
    ("obs.csv", "photo,species,genus,y,x\n,42,,1,2\na.jpg,Quercus robur,,1,2\n",
     {**BASE, "rank_columns": ["species", "family"], "latitude_column": "y", "longitude_column": "lon",
      "temporal": "week"},
     [(TEMPORAL_KEY, f"{TEMPORAL_KEY} is 'month' or 'day_of_year', not 'week'"),
      (RANKS_KEY, f"PATH has no column 'family' (its columns: photo, species, genus, y, x): remove it from "
                  f"{RANKS_KEY}"),
      (LONGITUDE_KEY, f"PATH has no column 'lon' (its columns: photo, species, genus, y, x): set {LONGITUDE_KEY} "
                      "to one of them"),
      (IMAGE_KEY, "PATH: column 'photo' has no photo at row 0: give every row its photo's file name or drop the "
                  "rows without one"),
      (RANKS_KEY, f"PATH: column 'species' {MIXED}")]),
]  # fmt: skip


REFUSED = [
    "unknown column", "missing rank column", "no rank column", "empty photo", "mixed ranks csv", "mixed ranks jsonl",
    "bad id", "latitude", "longitude", "latitude alone", "bad date", "bad temporal", "bad elevation", "bad scales",
    "header only", "empty file", "unknown format", "all at once",
]  # fmt: skip


@pytest.mark.parametrize(("name", "text", "options", "expected"), REFUSALS, ids=REFUSED)
def test_every_refusal_in_one_sentence(
    tmp_path: Path, name: str, text: str, options: dict[str, Any], expected: list[tuple[str, str]]
) -> None:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    assert problems_of(path, **options) == [
        (key, message.replace("PATH", str(path))) for key, message in expected
    ]


def test_a_file_that_is_no_table_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "obs.parquet"
    path.write_text("not parquet", encoding="utf-8")
    [(key, message)] = problems_of(path, **BASE)
    assert key == TABLE_KEY
    assert message.startswith(f"{path} cannot be read as Parquet (")
    assert message.endswith("): write it as Parquet or name it by what it holds")


def test_a_missing_file_names_where_it_was_looked_for(tmp_path: Path) -> None:
    [(key, message)] = problems_of(tmp_path / "gone.csv", image_column="photo", rank_columns=["genus"])
    assert key == TABLE_KEY
    assert message.startswith(f"{tmp_path / 'gone.csv'} does not exist")
    assert message.endswith(f": point {TABLE_KEY} at the table of observations")


def test_without_pyarrow_the_extra_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_csv(tmp_path / "obs.csv", OBSERVATIONS)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what an install without the extra sees
    assert problems_of(path, **OPTIONS) == [
        (TABLE_KEY, "reading an observation table needs pyarrow: pip install 'linnaeus-accel[data]'")
    ]
