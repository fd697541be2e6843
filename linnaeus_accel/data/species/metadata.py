"""Raw observation columns (latitude and longitude, date, elevation) encoded as linnaeus' metadata
components: the float datasets of ``labels.h5`` named by each component's ``SOURCE``.

- ``spatial`` (3): the point on the unit sphere, ``x = cos(lat) cos(lon)``, ``y = cos(lat) sin(lon)``,
  ``z = sin(lat)``: the poles are ``(0, 0, ±1)``, and longitude -180 and 180 meet.
- ``temporal`` (2): ``[sin, cos]`` of ``2π month / 12`` (month 1 to 12), or of ``2π day / 365.25``
  (day of the year from 1): December sits next to January.
- ``elevation`` (2 per scale): ``[sin, cos]`` of ``2π metres / scale`` for each scale, finest first.

Every encoder returns ``(values, valid)``: float32 rows and whether each row holds an observed
value. A missing value (NaN, None, NaT, an empty string) is a row of zeros with ``valid`` False,
which is linnaeus' own mark for missing; the mask is the contract, so that a model never takes a
missing value for a real zero. ``validity_from_rows`` reads that mark back from linnaeus' files.

A value that cannot be a measurement (latitude 91, an unparseable date) is refused with a
``ConfigError`` naming its row, before training rather than as a silent zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ...config.loading import ConfigError

SPATIAL_KEY = "DATA.META.COMPONENTS.SPATIAL"
TEMPORAL_KEY = "DATA.META.COMPONENTS.TEMPORAL"
ELEVATION_KEY = "DATA.META.COMPONENTS.ELEVATION"

# linnaeus' default elevation component reads ``elevation_broadrange_2`` (10 columns); the files
# and inference bundles it was trained on record these five scales for it, in metres. (Its inference
# config, when given no bundle, falls back to 100, 1000 and 5000: 6 columns, which that default
# component would not accept.)
DEFAULT_ELEVATION_SCALES: tuple[float, ...] = (200.0, 300.0, 1000.0, 3000.0, 6000.0)
DAYS_PER_YEAR = 365.25  # linnaeus' day-of-year period: leap years cost no discontinuity at New Year

TemporalKind = Literal["month", "day_of_year"]
FloatRows = NDArray[np.float32]
BoolArray = NDArray[np.bool_]

_ISO_DATE_LENGTH = 10  # YYYY-MM-DD: the date part of an ISO string, the part that is encoded


def encode_spatial(latitude: ArrayLike, longitude: ArrayLike) -> tuple[FloatRows, BoolArray]:
    """The ``spatial`` component (N×3) of latitudes and longitudes in degrees; NaN (or None) in
    either is a missing location."""
    lat = _floats(latitude, "latitude")
    lon = _floats(longitude, "longitude")
    if len(lat) != len(lon):
        raise ValueError(f"{len(lat)} latitudes but {len(lon)} longitudes")
    valid = ~(np.isnan(lat) | np.isnan(lon))
    _refuse_outside(lat, valid, -90.0, 90.0, "latitude", SPATIAL_KEY)
    _refuse_outside(lon, valid, -180.0, 180.0, "longitude", SPATIAL_KEY)
    lat_r, lon_r = np.radians(lat[valid]), np.radians(lon[valid])
    values = np.zeros((len(lat), 3), dtype=np.float32)
    values[valid] = np.stack(
        [np.cos(lat_r) * np.cos(lon_r), np.cos(lat_r) * np.sin(lon_r), np.sin(lat_r)], axis=1
    )
    return values, valid


def encode_temporal(dates: ArrayLike, kind: TemporalKind = "month") -> tuple[FloatRows, BoolArray]:
    """The ``temporal`` component (N×2) of observation dates.

    ``dates``: ISO 8601 strings (``2021-07-04``, a time after it is ignored: the local date as written
    is the date), ``datetime.date`` objects or numpy datetime64; None, NaT and empty strings are
    missing. ``kind``: ``"month"`` (linnaeus' default) or ``"day_of_year"``.
    """
    if kind not in ("month", "day_of_year"):
        raise ValueError(f"kind is 'month' or 'day_of_year', not {kind!r}")
    days, valid = _days(dates)
    observed = days[valid]
    if kind == "month":
        months = observed.astype("datetime64[M]").astype(np.int64) % 12 + 1
        turns = months / 12.0
    else:
        day_of_year = (observed - observed.astype("datetime64[Y]")).astype(np.int64) + 1
        turns = day_of_year / DAYS_PER_YEAR
    values = np.zeros((len(days), 2), dtype=np.float32)
    values[valid] = _sin_cos(turns)
    return values, valid


def encode_elevation(
    metres: ArrayLike, scales: Sequence[float] = DEFAULT_ELEVATION_SCALES
) -> tuple[FloatRows, BoolArray]:
    """The elevation component (N×2·len(scales)) of elevations in metres; NaN (or None) is missing.
    ``scales``: the periods in metres, one ``[sin, cos]`` pair each, in this order."""
    periods = np.asarray(scales, dtype=np.float64)
    if periods.ndim != 1 or not len(periods) or not (np.isfinite(periods) & (periods > 0)).all():
        raise ValueError(f"scales must be one or more positive numbers of metres, not {list(scales)}")
    elevation = _floats(metres, "elevation")
    valid = ~np.isnan(elevation)
    _refuse_outside(elevation, valid, -np.inf, np.inf, "elevation", ELEVATION_KEY, finite=True)
    values = np.zeros((len(elevation), 2 * len(periods)), dtype=np.float32)
    pairs = _sin_cos(elevation[valid, None] / periods[None, :])  # (n, scales, 2): sin and cos per scale
    values[valid] = pairs.reshape(len(pairs), -1)
    return values, valid


def validity_from_rows(values: ArrayLike, *, elevation_pattern: bool = False) -> BoolArray:
    """Which rows of a component read from linnaeus' ``labels.h5`` hold a value: a row of zeros
    is missing.

    ``elevation_pattern``: also take ``[0, 1, 0, 1, ...]`` (sin and cos of 0 m at every scale) as
    missing, as linnaeus does for elevation datasets, whose generator wrote missing elevations that
    way; an observation at exactly 0 m then reads as missing too, which those files cannot tell apart.
    """
    rows = np.asarray(values, dtype=np.float64)
    if rows.ndim != 2:
        raise ValueError(f"component values must be rows (N×D), not of shape {rows.shape}")
    finite = np.isfinite(rows).all(axis=1)
    if not finite.all():
        # NaN is no missing-value mark in these files: it is a damaged row, and would spread
        # through a forward pass as the zeros never do.
        row = int(np.argmin(finite))
        raise ValueError(f"row {row} holds {rows[row].tolist()}: a component's values are finite numbers")
    valid: BoolArray = (rows != 0).any(axis=1)
    if elevation_pattern:
        if rows.shape[1] % 2:
            raise ValueError(
                f"elevation rows hold sin/cos pairs, so an even number of columns, not {rows.shape[1]}"
            )
        sea_level = np.isclose(rows[:, 0::2], 0.0).all(axis=1) & np.isclose(rows[:, 1::2], 1.0).all(axis=1)
        valid &= ~sea_level
    return valid


def _sin_cos(turns: NDArray[np.float64]) -> NDArray[np.float64]:
    """``[sin, cos]`` of ``2π turns`` along a new last axis."""
    angle = 2.0 * np.pi * turns
    return np.stack([np.sin(angle), np.cos(angle)], axis=-1)


def _floats(values: ArrayLike, what: str) -> NDArray[np.float64]:
    try:
        array = np.asarray(values, dtype=np.float64)  # None becomes NaN: missing
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be numbers (NaN or None where missing): {exc}") from None
    if array.ndim != 1:
        raise ValueError(f"{what} must be one value per row, not of shape {array.shape}")
    return array


def _refuse_outside(
    values: NDArray[np.float64],
    valid: BoolArray,
    low: float,
    high: float,
    what: str,
    key: str,
    finite: bool = False,
) -> None:
    outside = valid & ((values < low) | (values > high) | (finite & ~np.isfinite(values)))
    if not outside.any():
        return
    row = int(np.argmax(outside))
    count = int(outside.sum())
    others = {1: "", 2: " (and 1 other row)"}.get(count, f" (and {count - 1} other rows)")
    allowed = "a finite number of metres" if finite else f"within [{low:g}, {high:g}] degrees"
    raise ConfigError(
        [
            (
                key,
                f"row {row} has {what} {float(values[row])}{others}, which is not {allowed}; NaN marks a missing value",
            )
        ],
        source="metadata",
    )


def _days(dates: ArrayLike) -> tuple[NDArray[np.datetime64], BoolArray]:
    """Dates as datetime64[D] (NaT where missing) and which are present; an unparseable one is a ConfigError."""
    array = np.asarray(dates)
    if array.ndim != 1:
        raise ValueError(f"dates must be one value per row, not of shape {array.shape}")
    if array.dtype.kind == "M":
        days = array.astype("datetime64[D]")
        return days, ~np.isnat(days)
    if array.dtype.kind == "O":
        missing = np.equal(array, np.asarray(None, dtype=object)) | (
            array != array
        )  # x != x: NaN and NaT, the missing floats and times
        array = np.where(missing, "", array)
    elif array.dtype.kind not in "US":
        raise ValueError(f"dates must be ISO strings, dates or datetime64, not {array.dtype}")
    text = np.char.strip(array.astype(str))
    present = text != ""
    length = np.char.str_len(text)
    joint = text.astype(f"U{_ISO_DATE_LENGTH + 1}")
    # What follows the date must start a time ("T" or a space), so "2021-07-041" is no 4 July.
    torn = (length > _ISO_DATE_LENGTH) & ~(np.char.endswith(joint, "T") | np.char.endswith(joint, " "))
    # A year or a month alone would be read as its first day: a date that was never observed.
    bad = present & ((length < _ISO_DATE_LENGTH) | torn)
    try:
        days = np.where(present, text.astype(f"U{_ISO_DATE_LENGTH}"), "NaT").astype("datetime64[D]")
    except ValueError:
        bad |= present & ~np.array([_parses(t) for t in text.astype(f"U{_ISO_DATE_LENGTH}")])
        days = np.full(len(text), np.datetime64("NaT"), dtype="datetime64[D]")
    if bad.any():
        row = int(np.argmax(bad))
        raise ConfigError(
            [
                (
                    TEMPORAL_KEY,
                    f"row {row} has date {str(text[row])!r}, which is not an ISO date (YYYY-MM-DD, a time may follow)",
                )
            ],
            source="metadata",
        )
    return days, present & ~np.isnat(days)


def _parses(text: str) -> bool:
    try:
        np.datetime64(text, "D")
    except ValueError:
        return False
    return True
