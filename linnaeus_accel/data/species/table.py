"""A table of observations (one row per photo) read as linnaeus' ``labels.h5`` is read.

Users without linnaeus' files have a folder of photos and a table: ``.csv``, ``.jsonl`` / ``.ndjson``
(one JSON object a line) or ``.parquet``. ``ObservationTable`` has ``LabelsFile``'s interface, so a
dataset takes either. Its columns:

- the image column: each photo's file name, never empty;
- one column per rank, finest first: taxon ids (whole numbers; 0, as in ``labels.h5``, and empty are
  null) or taxon names (text, empty = null), not both in one column;
- optionally latitude and longitude (degrees), a date (ISO ``YYYY-MM-DD``, a time may follow) and an
  elevation (metres), encoded once at open as linnaeus encodes them (``metadata``). An empty value
  leaves that component missing for the row (zeros, ``valid`` False).

An empty value is an empty cell (CSV), a null or absent key (JSON Lines) or a null (Parquet). Rows
are counted from 0, a CSV header not counted. The table is read whole and held in memory (the
encoded metadata as float32, the file names as one UTF-8 buffer): a table is far smaller than its
photos, and each DataLoader worker gets its copy by pickling.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ...config import ConfigError
from ..paths import resolved
from .labels import ComponentSpec, LabelRow, LabelRows, row_indices
from .metadata import (
    DEFAULT_ELEVATION_SCALES,
    TemporalKind,
    encode_elevation,
    encode_spatial,
    encode_temporal,
)

DATA_EXTRA = "pip install 'linnaeus-accel[data]'"
OPTIONS_KEY = "DATA.DATASET.OPTIONS"
TABLE_KEY = f"{OPTIONS_KEY}.table"
IMAGE_KEY = f"{OPTIONS_KEY}.image_column"
RANKS_KEY = f"{OPTIONS_KEY}.rank_columns"
LATITUDE_KEY = f"{OPTIONS_KEY}.latitude_column"
LONGITUDE_KEY = f"{OPTIONS_KEY}.longitude_column"
DATE_KEY = f"{OPTIONS_KEY}.date_column"
ELEVATION_KEY = f"{OPTIONS_KEY}.elevation_column"
TEMPORAL_KEY = f"{OPTIONS_KEY}.temporal"
SCALES_KEY = f"{OPTIONS_KEY}.elevation_scales"
FORMATS = {".csv": "CSV", ".jsonl": "JSON Lines", ".ndjson": "JSON Lines", ".parquet": "Parquet"}
_NO_ROWS = "has no rows: write one row per photo into it"
MAX_ID = 2**32 - 1  # ids are uint32, as in labels.h5
_ID_TEXT = r"^[0-9]+(\.0+)?$"  # "101.0" too: an id column with gaps, as pandas writes it

Problems = list[tuple[str, str]]
Floats = npt.NDArray[np.float64]
Encoded = tuple[npt.NDArray[np.float32], npt.NDArray[np.bool_]]


class ObservationTable:
    """A table of observations, checked and encoded when made, with ``LabelsFile``'s interface.

    ``image_column``: the column of photo file names. ``rank_columns``: the taxon columns, finest
    first; they are the ``task_keys``. ``latitude_column`` and ``longitude_column`` (both or neither)
    make ``SPATIAL``, ``date_column`` ``TEMPORAL`` (``temporal``: ``"month"`` or ``"day_of_year"``),
    ``elevation_column`` ``ELEVATION`` (one sin/cos pair per scale of ``elevation_scales``, metres);
    the components take IDX in that order, from 0. Every problem found is raised at once, as one
    ``ConfigError`` keyed under ``DATA.DATASET.OPTIONS`` (the file itself: ``...OPTIONS.table``).

    A rank of names gets ids by position: its distinct names sorted, numbered from 1, the same name
    the same id throughout the table. Another table (one more name) numbers them differently, so a
    run keeps the ids it trained on, with their ``names``, in its taxonomy file, never renumbering.

    ``arrow``: the rows already read, as a pyarrow Table (a Hugging Face dataset's columns,
    ``hf_images``), read instead of the file; ``path`` then only names them in messages.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        image_column: str,
        rank_columns: Sequence[str],
        latitude_column: str | None = None,
        longitude_column: str | None = None,
        date_column: str | None = None,
        elevation_column: str | None = None,
        temporal: TemporalKind = "month",
        elevation_scales: Sequence[float] = DEFAULT_ELEVATION_SCALES,
        arrow: Any = None,
    ) -> None:
        self.path = Path(path)
        self._label = label = str(path)
        self.task_keys: list[str] = [rank_columns] if isinstance(rank_columns, str) else list(rank_columns)
        located = latitude_column is not None and longitude_column is not None
        problems = _option_problems(
            self.task_keys, latitude_column, longitude_column, temporal, elevation_column, elevation_scales
        )
        bad_options = {key for key, _ in problems}
        table = _read(self.path, image_column, date_column, problems) if arrow is None else arrow
        present = ", ".join(table.column_names)
        location = [(LATITUDE_KEY, latitude_column), (LONGITUDE_KEY, longitude_column)] if located else []
        named = [(IMAGE_KEY, image_column), *((RANKS_KEY, rank) for rank in self.task_keys), *location]
        for key, name in [*named, (DATE_KEY, date_column), (ELEVATION_KEY, elevation_column)]:
            if name is not None and name not in table.column_names:
                fix = f"remove it from {key}" if key == RANKS_KEY else f"set {key} to one of them"
                problems.append((key, f"{label} has no column {name!r} (its columns: {present}): {fix}"))
        self.n_rows = int(table.num_rows)
        if self.n_rows == 0:
            raise ConfigError([*problems, (TABLE_KEY, f"{label} {_NO_ROWS}")])
        specs = [
            ("SPATIAL", "spatial", 3, located),
            ("TEMPORAL", "temporal", 2, date_column is not None),
            ("ELEVATION", "elevation", 2 * len(elevation_scales), elevation_column is not None),
        ]
        self.components = tuple(
            ComponentSpec(name, source, dim, idx)
            for idx, (name, source, dim, _) in enumerate(spec for spec in specs if spec[3])
        )

        def column(key: str, name: str | None, read: Callable[[Any], tuple[Any, str | None]]) -> Any:
            # A column refused above is skipped, the others still read: every problem shows at once.
            if name is None or name not in table.column_names:
                return None
            values, problem = read(table.column(name))
            if problem is not None:
                problems.append((key, f"{label}: column {name!r} {problem}"))
            return values

        parts: list[Encoded] = []

        def encoded(where: Mapping[str, str | None], encode: Callable[[], Encoded]) -> None:
            try:
                parts.append(encode())
            except ConfigError as exc:
                for _, message in exc.problems:
                    # The encoders say what they found: "row 3 has latitude 91.0, ...".
                    key = next((k for k in where if f" has {_word(k)} " in message), next(iter(where)))
                    problems.append((key, f"{label}, column {where[key]!r}: {message}"))

        names = column(IMAGE_KEY, image_column, _file_names)
        self._blob, self._offsets = _packed(names or [])
        self._taxa: dict[str, npt.NDArray[np.uint32]] = {}
        self._names: dict[str, dict[int, str]] = {}
        for rank in self.task_keys:
            taxa = column(RANKS_KEY, rank, _taxa)
            self._taxa[rank], self._names[rank] = taxa or (np.zeros(self.n_rows, np.uint32), {})
        lat = column(LATITUDE_KEY, latitude_column if located else None, lambda c: _numbers(c, "degrees"))
        lon = column(LONGITUDE_KEY, longitude_column if located else None, lambda c: _numbers(c, "degrees"))
        if lat is not None and lon is not None:
            where = {LATITUDE_KEY: latitude_column, LONGITUDE_KEY: longitude_column}
            encoded(where, lambda: encode_spatial(lat, lon))
        dates = column(DATE_KEY, date_column, _dates)
        if dates is not None and TEMPORAL_KEY not in bad_options:
            encoded({DATE_KEY: date_column}, lambda: encode_temporal(dates, temporal))
        metres = column(ELEVATION_KEY, elevation_column, lambda c: _numbers(c, "metres"))
        if metres is not None and SCALES_KEY not in bad_options:
            encoded({ELEVATION_KEY: elevation_column}, lambda: encode_elevation(metres, elevation_scales))
        if problems:
            raise ConfigError(problems)
        self.component_slices: dict[str, slice] = {}
        start = 0
        for c in self.components:
            self.component_slices[c.name] = slice(start, start + c.dim)
            start += c.dim
        self.meta_dim = start
        self._meta = np.concatenate([np.zeros((self.n_rows, 0), np.float32), *(v for v, _ in parts)], axis=1)
        self._valid = np.stack([v for _, v in parts], axis=1) if parts else np.zeros((self.n_rows, 0), bool)

    def __len__(self) -> int:
        return self.n_rows

    def __repr__(self) -> str:
        return f"ObservationTable({self._label!r}, {self.n_rows} rows)"

    def close(self) -> None:
        """Nothing to close: the table is held in memory (``LabelsFile`` has a file to close)."""

    def names(self, rank: str) -> dict[int, str]:
        """The name of each id at a rank of names (ids from 1); empty for a rank of ids."""
        if rank not in self._names:
            raise KeyError(f"{rank!r} is not a rank of {self._label}: its ranks are {self.task_keys}")
        return dict(self._names[rank])

    def taxa_columns(self) -> dict[str, npt.NDArray[np.uint32]]:
        """Every row's taxon id, per task key (0 = null): copies, so the table's own stay as read."""
        return {rank: ids.copy() for rank, ids in self._taxa.items()}

    def row(self, index: int) -> LabelRow:
        """Row ``index`` (0 <= index < n_rows)."""
        return self.rows([index])[0]

    def rows(self, indices: Sequence[int] | npt.NDArray[np.integer[Any]]) -> LabelRows:
        """The rows at ``indices``, in that order (repeats allowed)."""
        wanted = row_indices(indices, self.n_rows, self._label)
        bounds = zip(self._offsets[wanted].tolist(), self._offsets[wanted + 1].tolist(), strict=True)
        return LabelRows(
            indices=wanted,
            identifiers=[self._blob[start:end].decode("utf-8") for start, end in bounds],
            taxa={rank: ids[wanted] for rank, ids in self._taxa.items()},
            meta=self._meta[wanted],
            valid=self._valid[wanted],
        )


# -- reading the file ------------------------------------------------------------------------------


def _pyarrow() -> Any:
    # An optional extra: the rest of the package imports without it.
    try:
        import pyarrow as pa  # type: ignore[import-untyped]
        import pyarrow.compute  # type: ignore[import-untyped]
        import pyarrow.csv  # type: ignore[import-untyped]
        import pyarrow.json  # type: ignore[import-untyped]
        import pyarrow.parquet  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigError(
            [(TABLE_KEY, f"reading an observation table needs pyarrow: {DATA_EXTRA}")]
        ) from None
    return pa


def _option_problems(
    ranks: list[str],
    latitude: str | None,
    longitude: str | None,
    temporal: str,
    elevation: str | None,
    scales: Sequence[float],
) -> Problems:
    problems: Problems = []
    if not ranks:
        problems.append((RANKS_KEY, f"{RANKS_KEY} is empty: list the table's rank columns, finest first"))
    for rank in dict.fromkeys(r for r in ranks if ranks.count(r) > 1):
        problems.append((RANKS_KEY, f"{RANKS_KEY} lists {rank!r} twice: list each rank once, finest first"))
    if (latitude is None) != (longitude is None):
        given, missing = (LATITUDE_KEY, LONGITUDE_KEY) if longitude is None else (LONGITUDE_KEY, LATITUDE_KEY)
        message = f"{given} is set but {missing} is not: a location needs both, so set both or neither"
        problems.append((missing, message))
    if temporal not in ("month", "day_of_year"):
        problems.append((TEMPORAL_KEY, f"{TEMPORAL_KEY} is 'month' or 'day_of_year', not {temporal!r}"))
    if elevation is not None:
        try:
            encode_elevation(np.zeros(1), scales)
        except ValueError as exc:
            problems.append((SCALES_KEY, f"{SCALES_KEY}: {exc}"))
    return problems


def _read(path: Path, image_column: str, date_column: str | None, problems: Problems) -> Any:
    """The whole table as a pyarrow Table; a file that cannot be read raises, with ``problems``."""
    label = str(path)
    kind = FORMATS.get(path.suffix.lower())
    fail: str | None = None
    if kind is None:
        fail = f"{label} is no table this reads: name a .csv, .jsonl, .ndjson or .parquet file"
    elif not path.is_file():
        state = "is not a file" if path.exists() else f"does not exist{resolved(label)}"
        fail = f"{label} {state}: point {TABLE_KEY} at the table of observations"
    elif path.stat().st_size == 0:
        fail = f"{label} {_NO_ROWS}"
    if fail is not None:
        raise ConfigError([*problems, (TABLE_KEY, fail)])
    pa = _pyarrow()
    try:
        if kind == "CSV":
            # File names and dates as written: no "0012.jpg" read as 12, no date read through a time zone.
            types = {c: pa.string() for c in (image_column, date_column) if c is not None}
            return pa.csv.read_csv(path, convert_options=pa.csv.ConvertOptions(column_types=types))
        if kind == "Parquet":
            return pa.parquet.read_table(path)
        return _read_json(pa, path, date_column)
    except (OSError, ValueError, pa.ArrowException) as exc:
        message = f"{label} cannot be read as {kind} ({exc}): write it as {kind} or name it by what it holds"
        raise ConfigError([*problems, (TABLE_KEY, message)]) from None


def _read_json(pa: Any, path: Path, date_column: str | None) -> Any:
    try:
        table = pa.json.read_json(path)
    except pa.ArrowInvalid as exc:
        if "changed from" not in str(exc):
            raise
        # pyarrow takes a column of numbers and strings for a broken file: read it line by line, the
        # mixed columns as text, so that the checks name the row and the fix.
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not all(isinstance(row, dict) for row in rows):
            raise ValueError("a line holds no JSON object") from None
        columns = {}
        for name in dict.fromkeys(key for row in rows for key in row):
            values = [row.get(name) for row in rows]
            try:
                columns[name] = pa.array(values)
            except (pa.ArrowException, TypeError, ValueError):
                columns[name] = pa.array([None if v is None else str(v) for v in values], pa.string())
        return pa.table(columns)
    if date_column in table.column_names and pa.types.is_timestamp(table.column(date_column).type):
        # pyarrow reads ISO strings as UTC times; the date is the local date as written.
        schema = pa.schema([(date_column, pa.string())])
        table = pa.json.read_json(path, parse_options=pa.json.ParseOptions(explicit_schema=schema))
    return table


# -- one column each: (values, None), or (None or a stand-in, what is wrong with the column) --------


def _is_text(pa: Any, kind: Any) -> bool:
    return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind))


def _others(count: int) -> str:
    return {1: "", 2: " (and 1 other row)"}.get(count, f" (and {count - 1} other rows)")


def _file_names(column: Any) -> tuple[list[str] | None, str | None]:
    pa = _pyarrow()
    if pa.types.is_integer(column.type):
        column = column.cast(pa.string())
    if not (_is_text(pa, column.type) or pa.types.is_null(column.type)):
        return None, f"holds {column.type}, not photo file names"
    texts = column.to_pylist()
    empty = [i for i, text in enumerate(texts) if text is None or not text.strip()]
    if empty:
        fix = "give every row its photo's file name or drop the rows without one"
        return None, f"has no photo at row {empty[0]}{_others(len(empty))}: {fix}"
    return texts, None


def _packed(texts: list[str]) -> tuple[bytes, npt.NDArray[np.int64]]:
    """The texts as one UTF-8 buffer and its offsets: millions of file names pickle to each worker as
    two objects, not millions."""
    encoded = [text.encode("utf-8") for text in texts]
    offsets = np.zeros(len(encoded) + 1, np.int64)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    return b"".join(encoded), offsets


def _taxa(column: Any) -> tuple[tuple[npt.NDArray[np.uint32], dict[int, str]] | None, str | None]:
    """The ids of a rank column (0 = null) and the name of each id where it holds names."""
    pa = _pyarrow()
    pc = pa.compute
    kind = column.type
    if pa.types.is_null(kind):
        return (np.zeros(len(column), np.uint32), {}), None
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        ids, problem = _ids(pc.cast(column, pa.float64(), safe=False).to_numpy(), None)
        return (ids, {}), problem
    if not _is_text(pa, kind):
        return None, f"holds {kind}, not taxon ids or names"
    text = pc.utf8_trim_whitespace(column)
    empty = pc.fill_null(pc.equal(text, ""), True).to_numpy()
    digits = pc.fill_null(pc.match_substring_regex(text, _ID_TEXT), False).to_numpy()
    named = ~empty & ~digits
    if digits.any() and named.any():
        i, j = int(np.argmax(digits)), int(np.argmax(named))
        found = f"row {i} has {text[i].as_py()!r}, row {j} has {text[j].as_py()!r}"
        return None, f"mixes taxon ids and names ({found}): write ids or names throughout the column"
    if digits.any():
        ids, problem = _ids(pc.cast(pc.if_else(pa.array(digits), text, None), pa.float64()).to_numpy(), text)
        return (ids, {}), problem
    names = sorted(pc.unique(pc.filter(text, pa.array(named))).to_pylist())
    positions = pc.fill_null(pc.index_in(text, value_set=pa.array(names, pa.string())), -1).to_numpy()
    ids = np.where(named, positions + 1, 0).astype(np.uint32)
    return (ids, {i + 1: name for i, name in enumerate(names)}), None


def _ids(values: Floats, text: Any) -> tuple[npt.NDArray[np.uint32], str | None]:
    """uint32 ids of numbers (NaN = null); ``text``, where they were read from text, shows a bad one."""
    present = ~np.isnan(values)
    with np.errstate(invalid="ignore"):
        bad = present & ((values < 0) | (values > MAX_ID) | (values != np.floor(values)))
    ids = np.where(present & ~bad, values, 0).astype(np.uint32)
    if not bad.any():
        return ids, None
    row = int(np.argmax(bad))
    shown = repr(text[row].as_py()) if text is not None else f"{values[row]:.17g}"
    fix = "correct it or leave the cell empty"
    return ids, f"holds {shown} at row {row}{_others(int(bad.sum()))}, not a taxon id (1 to {MAX_ID}): {fix}"


def _numbers(column: Any, unit: str) -> tuple[Floats | None, str | None]:
    """The column as float64, NaN where empty."""
    pa = _pyarrow()
    pc = pa.compute
    kind = column.type
    if pa.types.is_null(kind):
        return np.full(len(column), np.nan), None
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return pc.cast(column, pa.float64(), safe=False).to_numpy(), None
    if not _is_text(pa, kind):
        return None, f"holds {kind}, not numbers of {unit}"
    text = pc.utf8_trim_whitespace(column)
    text = pc.if_else(pc.equal(text, ""), None, text)
    try:
        return pc.cast(text, pa.float64()).to_numpy(), None
    except pa.ArrowInvalid:
        texts = text.to_pylist()
        bad = [i for i, t in enumerate(texts) if t is not None and not _is_float(t)]
        shown = f"{texts[bad[0]]!r} at row {bad[0]}{_others(len(bad))}"
        return None, f"holds {shown}, not a number of {unit}: correct it or leave the cell empty"


def _dates(column: Any) -> tuple[Any, str | None]:
    """What ``encode_temporal`` takes: ISO strings (None where empty) or datetime64."""
    pa = _pyarrow()
    kind = column.type
    if pa.types.is_null(kind):
        return np.full(len(column), None, dtype=object), None
    if _is_text(pa, kind):
        return np.asarray(column.to_pylist(), dtype=object), None
    if pa.types.is_timestamp(kind) and kind.tz is not None:
        column = pa.compute.local_timestamp(column)  # the date as written where the photo was taken
    if pa.types.is_timestamp(kind) or pa.types.is_date(kind):
        return column.to_numpy(), None
    return None, f"holds {kind}, not dates"


def _word(key: str) -> str:
    """``latitude`` of ``DATA.DATASET.OPTIONS.latitude_column``."""
    return key.rsplit(".", 1)[-1].removesuffix("_column")


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
