"""Raw observation columns encoded as linnaeus' metadata components (spatial, temporal, elevation),
with a validity mask that keeps a missing value from passing for a real zero."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from linnaeus_accel.config import ConfigError
from linnaeus_accel.data.species.metadata import (
    DEFAULT_ELEVATION_SCALES,
    encode_elevation,
    encode_spatial,
    encode_temporal,
    validity_from_rows,
)

HALF_ROOT3 = math.sqrt(3) / 2

# (latitude, longitude, the point on the unit sphere)
POINTS = [
    (90.0, 0.0, (0, 0, 1)),  # the north pole
    (-90.0, 45.0, (0, 0, -1)),  # the south pole, whatever the longitude
    (0.0, 0.0, (1, 0, 0)),  # the equator at Greenwich
    (0.0, 90.0, (0, 1, 0)),  # a quarter turn east
    (0.0, -90.0, (0, -1, 0)),  # a quarter turn west
    (0.0, 180.0, (-1, 0, 0)),  # the antimeridian (-180 is the same point)
    (30.0, 0.0, (HALF_ROOT3, 0, 0.5)),  # z is sin(latitude)
]


@pytest.mark.parametrize(("lat", "lon", "expected"), POINTS)
def test_spatial_is_the_point_on_the_unit_sphere(lat: float, lon: float, expected: tuple[float, ...]) -> None:
    values, valid = encode_spatial([lat], [lon])
    assert values.dtype == np.float32
    assert values.shape == (1, 3)
    np.testing.assert_allclose(values[0], expected, atol=1e-6)
    assert valid.tolist() == [True]


# (latitudes, longitudes, validity: a location needs both)
MISSING_LOCATIONS = [
    ([np.nan], [10.0], [False]),  # no latitude
    ([10.0], [np.nan], [False]),  # no longitude
    ([None, 0.0], [None, 0.0], [False, True]),  # None is missing; (0, 0) is a real place
]


@pytest.mark.parametrize(("lat", "lon", "expected"), MISSING_LOCATIONS)
def test_a_missing_location_is_zeros_and_invalid(
    lat: list[Any], lon: list[Any], expected: list[bool]
) -> None:
    values, valid = encode_spatial(lat, lon)
    assert valid.tolist() == expected
    assert not values[~valid].any()
    assert values[valid].any(axis=1).all()  # a valid row is on the sphere, never all zeros


# (latitudes, longitudes, the one-sentence problem)
OUT_OF_RANGE = [
    (
        [0.0, 91.5],
        [0.0, 0.0],
        "row 1 has latitude 91.5, which is not within [-90, 90] degrees; NaN marks a missing value",
    ),  # latitude past the pole
    (
        [0.0, 0.0, 0.0],
        [-181.0, 200.0, 0.0],
        "row 0 has longitude -181.0 (and 1 other row), which is not within [-180, 180] degrees; "
        "NaN marks a missing value",
    ),  # longitudes past the antimeridian, the first named
    (
        [-math.inf],
        [0.0],
        "row 0 has latitude -inf, which is not within [-90, 90] degrees; NaN marks a missing value",
    ),  # infinity is no missing mark
]


@pytest.mark.parametrize(("lat", "lon", "message"), OUT_OF_RANGE)
def test_coordinates_out_of_range_are_refused(lat: list[float], lon: list[float], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        encode_spatial(lat, lon)
    assert caught.value.problems == [("DATA.META.COMPONENTS.SPATIAL", message)]


# (date, kind, [sin, cos])
DATES = [
    ("2021-01-15", "month", (0.5, HALF_ROOT3)),  # January: one twelfth of a turn
    ("2021-07-15", "month", (-0.5, -HALF_ROOT3)),  # July: opposite January
    ("2021-12-31", "month", (0.0, 1.0)),  # December: a whole turn, next to January
    ("2021-07-15T23:30:00-05:00", "month", (-0.5, -HALF_ROOT3)),  # the local date as written, not UTC
    (np.datetime64("2021-01-20"), "month", (0.5, HALF_ROOT3)),  # datetime64 as well as strings
    ("2021-01-01", "day_of_year", (math.sin(2 * math.pi / 365.25), math.cos(2 * math.pi / 365.25))),  # day 1
    (
        "2021-07-02",
        "day_of_year",
        (math.sin(2 * math.pi * 183 / 365.25), math.cos(2 * math.pi * 183 / 365.25)),
    ),  # day 183: about half a turn
]


@pytest.mark.parametrize(("date", "kind", "expected"), DATES)
def test_temporal_is_the_angle_of_the_month_or_day(
    date: Any, kind: Any, expected: tuple[float, float]
) -> None:
    values, valid = encode_temporal(np.array([date]), kind=kind)
    assert values.dtype == np.float32
    np.testing.assert_allclose(values[0], expected, atol=1e-6)
    assert valid.tolist() == [True]


def test_january_and_july_are_opposite() -> None:
    values, _ = encode_temporal(["2021-01-15", "2021-07-15"])
    np.testing.assert_allclose(values[0], -values[1], atol=1e-6)


# (dates, validity)
MISSING_DATES = [
    ([None, "2021-03-01"], [False, True]),  # None
    (["", "  ", "2021-03-01"], [False, False, True]),  # empty strings
    (np.array(["NaT", "2021-03-01"], dtype="datetime64[D]"), [False, True]),  # NaT
    (np.array([np.nan, "2021-03-01"], dtype=object), [False, True]),  # NaN from a table's empty cell
]


@pytest.mark.parametrize(("dates", "expected"), MISSING_DATES)
def test_a_missing_date_is_zeros_and_invalid(dates: Any, expected: list[bool]) -> None:
    values, valid = encode_temporal(dates)
    assert valid.tolist() == expected
    assert not values[~valid].any()
    assert values[valid].any(axis=1).all()


# (date, why it is refused)
BAD_DATES = [
    "2021-13-01",  # no thirteenth month
    "2021-07",  # a month alone would be read as the 1st: a day never observed
    "07/04/2021",  # not ISO
    "2021-07-041",  # what follows the date is no time
]


@pytest.mark.parametrize("date", BAD_DATES)
def test_a_date_that_is_no_iso_date_is_refused(date: str) -> None:
    with pytest.raises(ConfigError) as caught:
        encode_temporal(["2021-01-01", date], kind="day_of_year")
    assert caught.value.problems == [
        (
            "DATA.META.COMPONENTS.TEMPORAL",
            f"row 1 has date {date!r}, which is not an ISO date (YYYY-MM-DD, a time may follow)",
        )
    ]


# (metres, scales, the encoded row)
ELEVATIONS = [
    (250.0, [1000.0], (1.0, 0.0)),  # a quarter of the scale: a quarter turn
    (500.0, [1000.0, 2000.0], (0.0, -1.0, 1.0, 0.0)),  # one sin/cos pair per scale, in order
    (0.0, [100.0, 1000.0], (0.0, 1.0, 0.0, 1.0)),  # sea level is a value, not a missing mark
    (-430.0, [430.0 * 4], (-1.0, 0.0)),  # below sea level turns the other way
]


@pytest.mark.parametrize(("metres", "scales", "expected"), ELEVATIONS)
def test_elevation_is_sin_cos_at_each_scale(
    metres: float, scales: list[float], expected: tuple[float, ...]
) -> None:
    values, valid = encode_elevation([metres], scales)
    np.testing.assert_allclose(values[0], expected, atol=1e-6)
    assert valid.tolist() == [True]


def test_elevation_has_two_columns_per_default_scale() -> None:
    values, valid = encode_elevation([1200.0, np.nan, None])
    assert values.shape == (3, 2 * len(DEFAULT_ELEVATION_SCALES)) == (3, 10)  # linnaeus' default DIM
    assert valid.tolist() == [True, False, False]
    assert not values[1:].any()


# (rows as read from labels.h5, elevation's own null pattern too, validity)
ROWS = [
    ([[0.0, 0.0, 0.0]], False, [False]),  # all zeros: missing
    ([[0.0, 0.0, 1.0]], False, [True]),  # a zero in a row is a value (the north pole)
    ([[0.0, 1.0, 0.0, 1.0]], True, [False]),  # elevation 0 m as linnaeus' generator wrote missing
    ([[0.0, 1.0, 0.0, 1.0]], False, [True]),  # the same row elsewhere is a value
    ([[0.0, 0.0], [0.5, 0.8]], True, [False, True]),  # all zeros is missing for elevation as well
]


@pytest.mark.parametrize(("rows", "elevation", "expected"), ROWS)
def test_validity_from_rows(rows: list[list[float]], elevation: bool, expected: list[bool]) -> None:
    assert (
        validity_from_rows(np.array(rows, dtype=np.float32), elevation_pattern=elevation).tolist() == expected
    )


def test_a_nan_row_is_damage_not_a_missing_value() -> None:
    with pytest.raises(ValueError, match=r"row 1 holds \[nan, 0.0\]"):
        validity_from_rows([[1.0, 0.0], [np.nan, 0.0]])


def test_encoded_missing_values_read_back_as_missing() -> None:
    # What an encoder writes, linnaeus' files' reader reads back: zeros for missing, nothing else.
    values, valid = encode_spatial([10.0, np.nan, 0.0], [20.0, 5.0, 0.0])
    assert validity_from_rows(values).tolist() == valid.tolist() == [True, False, True]
