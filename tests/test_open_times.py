"""``xinsitu.open_zarr`` decodes an integer CF time index axis itself (in place, no temporaries of
the axis's size), and gives exactly what ``xr.open_zarr`` gives: values bit for bit, dtype, attrs,
encoding, index, variable order; anything else is left to xarray, with the same result."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import xarray as xr
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xinsitu
import xinsitu.store as store_mod


def _write(path, values, attrs, *, dtype=None, fill_value=0, zarr_format=3, extra=None):
    g = zarr.open_group(str(path), mode="w", zarr_format=zarr_format)
    kw = {"dimension_names": ["time"]} if zarr_format == 3 else {}
    t = g.create_array("time", shape=(len(values),), chunks=(max(1, min(len(values), 7)),),
                       dtype=dtype or np.asarray(values).dtype, fill_value=fill_value, **kw)
    if zarr_format == 2:
        t.attrs["_ARRAY_DIMENSIONS"] = ["time"]
    t.attrs.update(attrs)
    t[:] = np.asarray(values)
    kw = {"dimension_names": ["time", "x"]} if zarr_format == 3 else {}
    a = g.create_array("a", shape=(len(values), 3), chunks=(2, 3), dtype="float32", fill_value=np.nan, **kw)
    if zarr_format == 2:
        a.attrs["_ARRAY_DIMENSIONS"] = ["time", "x"]
    a[:] = np.arange(len(values) * 3, dtype="float32").reshape(-1, 3)
    for name, (dims, vals, vattrs) in (extra or {}).items():
        kw = {"dimension_names": list(dims)} if zarr_format == 3 else {}
        v = g.create_array(name, shape=np.shape(vals), dtype=np.asarray(vals).dtype, fill_value=0, **kw)
        if zarr_format == 2:
            v.attrs["_ARRAY_DIMENSIONS"] = list(dims)
        v.attrs.update(vattrs)
        v[...] = vals
    zarr.consolidate_metadata(str(path))
    return str(path)


def _reference(path, **kw):
    """What xarray gives for the same store object kind (no ``source`` in the encoding, as xinsitu's)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = xr.open_zarr(zarr.storage.LocalStore(path, read_only=True), chunks=None, **kw)
    return ds, [str(w.message) for w in caught]


def _ours(path, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = xinsitu.open_zarr(path, **kw)
    return ds, [str(w.message) for w in caught]


def _assert_same(a: xr.Dataset, b: xr.Dataset) -> None:
    xr.testing.assert_identical(a, b)
    assert list(a.variables) == list(b.variables) and list(a.coords) == list(b.coords)
    assert list(a.xindexes) == list(b.xindexes)
    for k in a.variables:
        assert a[k].dtype == b[k].dtype, k
        assert repr(a[k].encoding) == repr(b[k].encoding), k  # (NaN fill values: compared as text)
        assert a[k].attrs == b[k].attrs, k
        if a[k].dtype.kind in "Mm":
            assert np.array_equal(a[k].values.view("i8"), b[k].values.view("i8"))  # bit for bit, NaT included
    for k in a.xindexes:
        assert type(a.xindexes[k]) is type(b.xindexes[k])
        ia, ib = a.indexes[k], b.indexes[k]
        assert type(ia) is type(ib) and ia.dtype == ib.dtype and ia.name == ib.name and ia.equals(ib)
    assert a.encoding == b.encoding


def _round_trip(a: xr.Dataset, b: xr.Dataset, tmp_path) -> None:
    """Written back, both store the same time array and attributes."""
    pa, pb = tmp_path / "back_a.zarr", tmp_path / "back_b.zarr"
    for ds, p in ((a, pa), (b, pb)):
        ds.to_zarr(str(p), mode="w", consolidated=True, zarr_format=3)
    za, zb = zarr.open_group(str(pa), mode="r"), zarr.open_group(str(pb), mode="r")
    assert za["time"].dtype == zb["time"].dtype and np.array_equal(za["time"][:], zb["time"][:])
    assert dict(za["time"].attrs) == dict(zb["time"].attrs)


@pytest.fixture
def spy(monkeypatch):
    """The axes ``open_zarr`` decoded itself (not xarray)."""
    done = []
    real = store_mod._decoded_times

    def wrapped(var):
        out = real(var)
        done.append(out is not None)
        return out

    monkeypatch.setattr(store_mod, "_decoded_times", wrapped)
    return done


HOURS = {"units": "hours since 1940-01-01", "calendar": "proleptic_gregorian"}

FAST = [
    ("int64 hours", np.arange(50, dtype="int64"), HOURS, {}),
    ("hours, time unit s", np.arange(50, dtype="int64"), HOURS,
     {"decode_times": xr.coders.CFDatetimeCoder(time_unit="s")}),
    ("origin with a time", np.arange(-20, 30, 3, dtype="int64"),
     {"units": "hours since 1940-01-01 06:30:00", "calendar": "standard"}, {}),
    ("int32 days, no calendar", np.arange(0, 4000, 40, dtype="int32"), {"units": "days since 2000-01-01"}, {}),
    ("gregorian minutes, unsorted", np.array([5, 1, 9, 3, 7], dtype="int64"),
     {"units": "minutes since 1999-12-31T23:00:00", "calendar": "gregorian"}, {}),
    ("seconds, time zone", np.arange(0, 10**6, 9999, dtype="int64"),
     {"units": "seconds since 1970-01-01T00:00:00Z"}, {}),
    ("milliseconds into s: ms", np.arange(0, 5000, 7, dtype="int64"), {"units": "milliseconds since 2020-01-01"},
     {"decode_times": xr.coders.CFDatetimeCoder(time_unit="s")}),
    ("uint16 days", np.arange(0, 60000, 999, dtype="uint16"), {"units": "days since 1900-01-01"}, {}),
    ("one step", np.array([17], dtype="int64"), HOURS, {}),
    ("all equal", np.array([4, 4, 4], dtype="int64"), {"units": "Days since 2001-02-03"}, {}),
    ("other attrs kept", np.arange(10, dtype="int64"), {**HOURS, "long_name": "time", "axis": "T"}, {}),
]


@pytest.mark.parametrize("case", FAST, ids=[c[0] for c in FAST])
def test_integer_time_axes_are_decoded_in_place_as_xarray_decodes_them(tmp_path, spy, case):
    _, values, attrs, kw = case
    path = _write(tmp_path / "t.zarr", values, attrs)
    ours, w_ours = _ours(path, **kw)
    ref, w_ref = _reference(path, **kw)
    assert spy == [True]  # decoded by xinsitu, not by xarray
    _assert_same(ours, ref)
    assert w_ours == w_ref
    assert ours.indexes["time"].values.base is not None or ours.indexes["time"].values.flags.owndata
    _round_trip(ours, ref, tmp_path)
    assert np.array_equal(ours.a.values, ref.a.values)  # data variables read as before


def _past_2262():
    return np.array([0, 10, 3_000_000], dtype="int64")  # hours since 1940: the last is in 2282


OTHER = [
    ("past 2262 in ns: cftime", _past_2262(), HOURS, {}, {}),
    ("noleap calendar: cftime", np.arange(10, dtype="int64"), {"units": "days since 2000-01-01", "calendar": "noleap"},
     {}, {}),
    ("before the reform, standard: cftime", np.arange(10, dtype="int64"),
     {"units": "days since 1500-01-01", "calendar": "standard"}, {}, {}),
    ("float hours", np.arange(10, dtype="float64") / 2, HOURS, {}, {}),
    ("a _FillValue attribute (masked)", np.arange(10, dtype="int64"), {**HOURS, "_FillValue": 3}, {}, {}),
    ("scale_factor", np.arange(10, dtype="int64"), {**HOURS, "scale_factor": 2}, {}, {}),
    ("NaT marker", np.array([0, np.iinfo(np.int64).min, 5], dtype="int64"), HOURS, {}, {}),
    ("use_cftime", np.arange(10, dtype="int64"), HOURS, {"decode_times": xr.coders.CFDatetimeCoder(use_cftime=True)},
     {}),
    ("not a time", np.arange(10, dtype="int64"), {"units": "m"}, {}, {}),
]


@pytest.mark.parametrize("case", OTHER, ids=[c[0] for c in OTHER])
def test_other_axes_are_left_to_xarray_with_the_same_result(tmp_path, spy, case):
    _, values, attrs, kw, extra = case
    path = _write(tmp_path / "t.zarr", values, attrs)
    ref, w_ref = _reference(path, **kw)
    ours, w_ours = _ours(path, **kw)
    assert not any(spy)  # xarray decoded it
    _assert_same(ours, ref)
    assert w_ours == w_ref


def test_zarr_v2_with_and_without_a_fill_value(tmp_path, spy):
    values = np.arange(30, dtype="int64")
    for fill, fast in ((None, True), (0, False)):  # v2's fill value is a CF _FillValue: xarray masks with it
        path = _write(tmp_path / f"v2_{fill}.zarr", values, HOURS, fill_value=fill, zarr_format=2)
        spy.clear()
        ours, _ = _ours(path)
        ref, _ = _reference(path)
        assert spy == [fast]
        _assert_same(ours, ref)


def test_other_coordinates_and_decode_times_false(tmp_path, spy):
    """Other index coordinates (not times), a time coordinate that is not an index (kept lazy, as
    xarray keeps it) and ``decode_times=False``: as xarray."""
    n = 12
    extra = {"x": (("x",), np.array([10, 20, 30], dtype="int64"), {}),
             "valid_time": (("time", "x"), np.arange(n * 3, dtype="int64").reshape(n, 3), HOURS)}
    path = _write(tmp_path / "t.zarr", np.arange(n, dtype="int64"), HOURS, extra=extra)
    ours, _ = _ours(path)
    ref, _ = _reference(path)
    ours = ours.set_coords("valid_time")
    ref = ref.set_coords("valid_time")
    assert spy == [True, False]  # time here; x is not a time (valid_time is no index)
    _assert_same(ours, ref)
    spy.clear()
    ours, _ = _ours(path, decode_times=False)
    ref, _ = _reference(path, decode_times=False)
    assert spy == []
    _assert_same(ours, ref)


def test_no_coordinates(tmp_path, spy):
    g = zarr.open_group(str(tmp_path / "n.zarr"), mode="w", zarr_format=3)
    g.create_array("a", shape=(4, 3), chunks=(2, 3), dtype="float32", dimension_names=["time", "x"])[:] = 1
    zarr.consolidate_metadata(str(tmp_path / "n.zarr"))
    ours, _ = _ours(str(tmp_path / "n.zarr"))
    ref, _ = _reference(str(tmp_path / "n.zarr"))
    assert spy == []
    _assert_same(ours, ref)


_UNITS = ["nanoseconds", "microseconds", "milliseconds", "seconds", "minutes", "hours", "days", "hour", "day"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.lists(st.integers(-10**6, 10**6), min_size=1, max_size=20),
       unit=st.sampled_from(_UNITS),
       origin=st.sampled_from(["1970-01-01", "1940-01-01 06:00", "2000-02-29T12:34:56", "1800-01-01",
                               "2262-01-01", "1678-01-01"]),
       calendar=st.sampled_from([None, "standard", "gregorian", "proleptic_gregorian"]),
       time_unit=st.sampled_from([None, "s", "ms", "us", "ns"]),
       dtype=st.sampled_from(["int64", "int32"]))
def test_any_integer_axis_decodes_as_xarray_decodes_it(tmp_path_factory, values, unit, origin, calendar, time_unit,
                                                       dtype):
    attrs = {"units": f"{unit} since {origin}"} | ({"calendar": calendar} if calendar else {})
    path = _write(tmp_path_factory.mktemp("h") / "t.zarr", np.asarray(values, dtype=dtype), attrs)
    kw = {"decode_times": xr.coders.CFDatetimeCoder(time_unit=time_unit)} if time_unit else {}
    try:
        ref, w_ref = _reference(path, **kw)
    except Exception as e:  # noqa: BLE001 - then xinsitu raises the same
        with pytest.raises(type(e)):
            _ours(path, **kw)
        return
    ours, w_ours = _ours(path, **kw)
    _assert_same(ours, ref)
    assert w_ours == w_ref
