"""``xinsitu.open_zarr`` decodes an integer CF time index axis itself (in place, no temporaries of
the axis's size), and gives exactly what ``xr.open_zarr`` gives: values bit for bit, dtype, attrs,
encoding, index, variable order; anything else is left to xarray, with the same result.

One departure: under xarray's default decoding, an axis xarray would leave as ``cftime`` objects only
because its dates are out of ``datetime64[ns]``'s range (an hourly axis past 2262) is decoded to what
``decode_times=CFDatetimeCoder(time_unit="s")`` gives, without xarray's (then false) warning."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import xarray as xr
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xinsitu
import xinsitu.stores.opening as store_mod


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

    def wrapped(var, *args):
        out = real(var, *args)
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
    ("an origin out of the ns range, the dates in it", np.arange(40_000, 40_100, dtype="int64"),
     {"units": "days since 1600-01-01", "calendar": "proleptic_gregorian"}, {}),
    ("an origin past 2262, the dates before it", np.arange(-200, -100, dtype="int64"),
     {"units": "days since 2262-06-01", "calendar": "standard"}, {}),
]


@pytest.mark.parametrize("case", FAST, ids=[c[0] for c in FAST])
@pytest.mark.slow
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
    ("past 2262, use_cftime", _past_2262(), HOURS, {"decode_times": xr.coders.CFDatetimeCoder(use_cftime=True)}, {}),
    ("past 2262, a coder of the user's (ns)", _past_2262(), HOURS, {"decode_times": xr.coders.CFDatetimeCoder()}, {}),
    ("past 2262, noleap", _past_2262(), {**HOURS, "calendar": "noleap"}, {}, {}),
    ("past 2262, 360_day", _past_2262(), {**HOURS, "calendar": "360_day"}, {}, {}),
    ("past 2262, julian", _past_2262(), {**HOURS, "calendar": "julian"}, {}, {}),
    ("past 2262 and before the reform, standard", np.array([0, 5_000_000], dtype="int64"),
     {"units": "days since 1500-01-01", "calendar": "standard"}, {}, {}),
    ("before the reform after a later origin, standard", np.array([-200_000, 0, 10], dtype="int64"),
     {"units": "days since 1600-01-01", "calendar": "gregorian"}, {}, {}),
    ("past 2262, a _FillValue (masked)", _past_2262(), {**HOURS, "_FillValue": 7}, {}, {}),
    ("past 2262, float hours", _past_2262().astype("float64"), HOURS, {}, {}),
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
@pytest.mark.slow
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
    ref = _oracle(path, ref, w_ref) if not kw else ref
    ours, w_ours = _ours(path, **kw)
    _assert_same(ours, ref)
    assert w_ours == (w_ref if ref is not None and ref.time.dtype.kind != "M" or kw else _kept(w_ref))


_RANGE = "Unable to decode time axis into full numpy.datetime64[ns] objects"


def _kept(said):
    """``said`` but for xarray's warnings that it falls back to cftime for the ns range."""
    return [w for w in said if not (w.startswith(_RANGE) and "dates out of range" in w)]


def _oracle(path, ref, w_ref):
    """What ``open_zarr`` gives under xarray's default decoding: ``ref`` (``xr.open_zarr(path)``), but
    where xarray fell back to cftime objects for the time axis only because the dates are out of
    ``datetime64[ns]``'s range (its warnings say that and nothing else) and ``time_unit="s"`` decodes it
    to datetime64 without a warning: that decoding."""
    if ref.time.dtype != object or not w_ref or _kept(w_ref):
        return ref
    coarse, w_coarse = _reference(path, decode_times=xr.coders.CFDatetimeCoder(time_unit="s"))
    return coarse if coarse.time.dtype.kind == "M" and not w_coarse else ref


def _reopened(ds, tmp_path, name):
    p = str(tmp_path / name)
    ds.to_zarr(p, mode="w", consolidated=True, zarr_format=3)
    return xr.open_zarr(zarr.storage.LocalStore(p, read_only=True), chunks=None,
                        decode_times=xr.coders.CFDatetimeCoder(time_unit="s"))


PAST = [
    ("hourly past 2262, proleptic (scale.py)", np.arange(0, 3_000_000, 9973, dtype="int64"), HOURS),
    ("past 2262, standard", _past_2262(), {**HOURS, "calendar": "standard"}),
    ("past 2262, gregorian", _past_2262(), {**HOURS, "calendar": "gregorian"}),
    ("past 2262, no calendar", _past_2262(), {"units": HOURS["units"]}),
    ("past 2262, unsorted", np.array([3_000_000, 7, 2_999_999, 0], dtype="int64"), HOURS),
    ("out of range inside only (first and last in it)", np.array([0, 3_000_000, 5], dtype="int64"), HOURS),
    ("before 1677, proleptic", np.arange(-1000, 10, dtype="int64"), {"units": "days since 1677-01-01",
                                                                   "calendar": "proleptic_gregorian"}),
    ("before 1677 after the reform, standard", np.arange(0, 40, 3, dtype="int64"),
     {"units": "days since 1600-01-01", "calendar": "standard"}),
    ("int32 days past 2262", np.arange(0, 200_000, 777, dtype="int32"), {"units": "days since 1900-01-01"}),
    ("uint16 days before 1677", np.arange(0, 60_000, 999, dtype="uint16"), {"units": "days since 1600-01-01"}),
    ("minutes, an origin with a time", np.array([0, 10**8, 2 * 10**8], dtype="int64"),
     {"units": "minutes since 1940-01-01 06:30:00", "calendar": "standard"}),
    ("seconds past 2262", np.array([0, 10**10], dtype="int64"), {"units": "seconds since 2000-01-01"}),
    ("milliseconds past 2262: ms", np.array([0, 10**13], dtype="int64"), {"units": "milliseconds since 2000-01-01"}),
    ("other attrs kept", _past_2262(), {**HOURS, "long_name": "time", "axis": "T"}),
]


@pytest.mark.parametrize("case", PAST, ids=[c[0] for c in PAST])
@pytest.mark.parametrize("decode_times", [True, None])
@pytest.mark.slow
def test_axes_out_of_the_ns_range_are_decoded_to_seconds(tmp_path, spy, case, decode_times):
    """xarray's default keeps cftime objects (and says so); open_zarr decodes them as ``time_unit="s"``
    does, bit for bit, and says nothing."""
    _, values, attrs = case
    path = _write(tmp_path / "t.zarr", values, attrs)
    default, w_default = _reference(path)
    assert default.time.dtype == object and w_default and not _kept(w_default)  # xarray: cftime, out of range
    ref, w_ref = _reference(path, decode_times=xr.coders.CFDatetimeCoder(time_unit="s"))
    assert ref.time.dtype.kind == "M" and w_ref == []
    ours, w_ours = _ours(path, decode_times=decode_times)
    assert spy == [True]
    _assert_same(ours, ref)
    assert w_ours == []  # xarray's fallback warning would be false
    assert np.array_equal(ours.a.values, ref.a.values)
    _round_trip(ours, ref, tmp_path)
    _assert_same(_reopened(ours, tmp_path, "o.zarr"), _reopened(ref, tmp_path, "r.zarr"))


def test_use_cftime_gives_xarrays_default(tmp_path, spy):
    """How to get xarray's default back (as documented): ``use_cftime=True``, the same cftime objects."""
    path = _write(tmp_path / "t.zarr", _past_2262(), HOURS)
    default, _ = _reference(path)
    ours, w_ours = _ours(path, decode_times=xr.coders.CFDatetimeCoder(use_cftime=True))
    assert spy == [False] and w_ours == []
    _assert_same(ours, default)


def test_past_2262_in_zarr_v2(tmp_path, spy):
    path = _write(tmp_path / "v2.zarr", _past_2262(), HOURS, fill_value=None, zarr_format=2)
    ref, _ = _reference(path, decode_times=xr.coders.CFDatetimeCoder(time_unit="s"))
    ours, w_ours = _ours(path)
    assert spy == [True] and w_ours == []
    _assert_same(ours, ref)


def test_other_warnings_still_reach_the_user(tmp_path, spy):
    """Decoded: ``time``. Left to xarray, each with the same warning as ``time``'s: a noleap axis past
    2262 (an index) and a coordinate past 2262 that is no index. Their warnings are all given, as
    xarray gives them."""
    n = 4
    extra = {"t2": (("t2",), np.array([0, 3_000_000], dtype="int64"), {**HOURS, "calendar": "noleap"}),
             "valid_time": (("time", "x"), np.full((n, 3), 3_000_000, dtype="int64"), HOURS)}
    path = _write(tmp_path / "t.zarr", np.array([0, 1, 2, 3_000_000], dtype="int64"), HOURS, extra=extra)
    ref, w_ref = _reference(path)
    ours, w_ours = _ours(path)
    assert sorted(spy) == [False, True]  # time; t2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ours.valid_time.values.dtype == object  # (lazy: decoded by xarray, saying so)
    assert [str(w.message) for w in caught] == w_ref[:1]  # (before anything reads it)
    assert ref.time.dtype == object and ours.time.dtype == np.dtype("M8[s]")
    _assert_same(ours.drop_vars("time"), ref.drop_vars("time"))
    coarse, _ = _reference(path, decode_times=xr.coders.CFDatetimeCoder(time_unit="s"))
    _assert_same(ours[["time"]], coarse[["time"]])
    # xarray: on opening, time, t2 and valid_time (first and last value checked), then the indexes
    # time and t2 made; open_zarr: the same but for time's two
    assert len(w_ref) == 5 and not _kept(w_ref)
    assert w_ours == w_ref[:3]


def test_past_2262_with_a_nat_marker_fails_as_in_xarray(tmp_path, spy):
    """xarray's cftime fallback cannot take the NaT marker: open_zarr leaves the axis to it, and fails alike."""
    path = _write(tmp_path / "t.zarr", np.array([0, np.iinfo(np.int64).min, 3_000_000], dtype="int64"), HOURS)
    with pytest.raises(OverflowError):
        _reference(path)
    with pytest.raises(OverflowError):
        _ours(path)
    assert spy == [False]


def test_held_warnings_are_given_where_xarray_gave_them(tmp_path):
    """The warnings of xarray's open, held and given again, keep their place (the line of
    ``xinsitu.stores.opening`` that called xarray) and module: the user's filters apply to them as before."""
    path = _write(tmp_path / "t.zarr", _past_2262(), {**HOURS, "calendar": "noleap"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        xinsitu.open_zarr(path)
    assert len(caught) == 2 and all(w.filename == store_mod.__file__ for w in caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", module=r"xinsitu\.store")
        xinsitu.open_zarr(path)
    assert caught == []


_ORIGINS = ["1582-10-15", "1600-01-01", "1677-01-01", "1940-01-01 06:00", "2000-02-29T12:34:56", "2262-01-01",
            "2500-01-01"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(),
       unit=st.sampled_from(["seconds", "minutes", "hours", "days", "hour", "day"]),
       origin=st.sampled_from(_ORIGINS),
       calendar=st.sampled_from([None, "standard", "gregorian", "proleptic_gregorian"]),
       dtype=st.sampled_from(["int64", "int32"]))
@pytest.mark.slow
def test_any_axis_out_of_the_ns_range_decodes_as_time_unit_s(tmp_path_factory, data, unit, origin, calendar, dtype):
    """Any integer axis of a standard calendar out of ``datetime64[ns]``'s range (after the reform):
    as ``time_unit="s"`` decodes it, without a warning; before the reform: as xarray."""
    span = {"seconds": 2**31 - 1, "minutes": 6 * 10**8, "hours": 10**7, "days": 4 * 10**5}[unit.rstrip("s") + "s"]
    values = data.draw(st.lists(st.integers(-span, span), min_size=1, max_size=12))
    attrs = {"units": f"{unit} since {origin}"} | ({"calendar": calendar} if calendar else {})
    path = _write(tmp_path_factory.mktemp("p") / "t.zarr", np.asarray(values, dtype=dtype), attrs)
    ref, w_ref = _reference(path)
    expected = _oracle(path, ref, w_ref)
    ours, w_ours = _ours(path)
    _assert_same(ours, expected)
    assert w_ours == (_kept(w_ref) if expected is not ref else w_ref)
