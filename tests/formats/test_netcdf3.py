"""NetCDF-3 files (classic, 64-bit offset, CDF-5) read in place from their header's byte ranges:
the Dataset, every ``isel`` and every batch equal ``xr.open_dataset(nc)`` / ``xr.open_mfdataset``
bit for bit -- fixed-size and record (interleaved) variables, int16 packing with a negative
scale factor, a NaN ``_FillValue`` on an int16 variable (which xarray drops), ``_Unsigned`` bytes;
a truncated file or a character variable is refused naming the file and the variable."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import xarray as xr
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.index.test_sampling import run_epoch
from xinsitu.synthetic import era5_like, packing

pytest.importorskip("virtualizarr", reason="the virtual extra is not installed")
netCDF4 = pytest.importorskip("netCDF4", reason="writing NetCDF-3 files needs netCDF4")

from xinsitu.formats.netcdf3 import CODEC_NAME, parse_header  # noqa: E402
from xinsitu.virtual import VirtualReferenceError, netcdf_store, open_netcdf  # noqa: E402

NT, NY, NX = 12, 6, 10
MF = {"data_vars": "minimal", "coords": "minimal", "compat": "override"}
FORMATS = ["NETCDF3_CLASSIC", "NETCDF3_64BIT"]


def write(path, ds: xr.Dataset, fmt: str = "NETCDF3_CLASSIC", unlimited: bool = True, **tp) -> str:
    enc = {"tp": packing() | {"dtype": "int16"} | tp}
    ds.to_netcdf(path, format=fmt, engine="netcdf4", unlimited_dims=["time"] if unlimited else [], encoding=enc)
    return str(path)


@pytest.fixture(scope="module", params=[(f, u) for f in FORMATS for u in (True, False)],
                ids=[f"{f[8:].lower()}-{'record' if u else 'fixed'}" for f in FORMATS for u in (True, False)])
def nc3(request, tmp_path_factory) -> str:
    fmt, unlimited = request.param
    return write(tmp_path_factory.mktemp("nc3") / "a.nc", era5_like(NT, NY, NX), fmt, unlimited)


def test_same_dataset_as_xarray(nc3):
    ds, ref = open_netcdf(nc3), xr.open_dataset(nc3).load()
    xr.testing.assert_identical(ds.load(), ref)
    assert ds.tp.dtype == ref.tp.dtype and np.isnan(ds.tp.values).any()
    assert ds.t2m.encoding["chunks"] == (1, NY, NX)  # one record (or one step) a chunk
    codecs = {v: a.metadata.codecs[0].to_dict()["name"] for v, a in netcdf_store(nc3)._group.arrays.items()
              if v in ("t2m", "tp")}
    assert codecs == {"t2m": "bytes", "tp": CODEC_NAME}  # a NaN _FillValue on floats needs no decoding
    for sel in ({"time": 5}, {"time": slice(2, 9), "lat": slice(1, 4)}, {"lon": [0, 4, 9]}):
        xr.testing.assert_identical(ds.isel(sel).load(), ref.isel(sel))


def test_store_through_xr_open_zarr(nc3):
    xr.testing.assert_identical(xr.open_zarr(netcdf_store(nc3), consolidated=False).load(), xr.open_dataset(nc3).load())


def test_records_are_byte_ranges_of_the_file(nc3):
    """Record variables are interleaved: record i of a variable is at begin + i * recsize."""
    store = netcdf_store(nc3)
    with open(nc3, "rb") as f:
        h = parse_header(f.read(1 << 16))
    v = next(x for x in h.vars if x.name == "t2m")
    m = store._group.arrays["t2m"].manifest
    stride = h.recsize if v.record else v.slab // NT
    assert v.record == (h.record_dim == "time")
    assert m._offsets.ravel().tolist() == [v.begin + i * stride for i in range(NT)]
    assert set(m._lengths.ravel().tolist()) == {NY * NX * 4}
    assert {str(p) for p in m._paths.ravel()} == {"file://" + os.path.abspath(nc3)}


@pytest.mark.parametrize("output", ["xarray", "numpy"])
@pytest.mark.slow
def test_epoch_matches_xarray(nc3, output):
    ds, ref = open_netcdf(nc3), xr.open_dataset(nc3).load()
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.4}, gap=1)
    for split in m.splits:
        gen = ds.insitu.batches(m, split, batch_size=3, output=output, block_chunks=2, seed=2)
        seen = run_epoch(ref, gen, output)
        assert np.array_equal(np.sort(seen), np.arange(gen.n_samples))
    gen = ds.insitu.batches(m, "train", batch_size=2, window={"time": 3}, patch={"lat": 3, "lon": 5}, output="xarray")
    run_epoch(ref, gen, "xarray")


def test_files_join_along_time(tmp_path):
    """Files of 4, 4 and 3 steps (record dim, and fixed dims), joined as xr.open_mfdataset joins them."""
    ds = era5_like(11, NY, NX, seed=4)
    files = []
    for k, (a, b) in enumerate([(0, 4), (4, 8), (8, 11)]):
        files.append(write(tmp_path / f"day{k}.nc", ds.isel(time=slice(a, b)), FORMATS[k % 2], unlimited=k != 1))
    ref = xr.open_mfdataset(files, **MF).load()
    got = open_netcdf(list(reversed(files)))
    xr.testing.assert_identical(got.load(), ref)
    m = got.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    run_epoch(ref, got.insitu.batches(m, "val", batch_size=3, output="numpy"), "numpy")


def _rename_attr(path: str, old: bytes, new: bytes) -> None:
    """Rename an attribute in place (same length): how a header xarray would not write is made."""
    raw = open(path, "rb").read()
    assert raw.count(old) == 1
    open(path, "wb").write(raw.replace(old, new))


@pytest.mark.parametrize("fmt", ["NETCDF3_CLASSIC", "NETCDF3_64BIT_OFFSET", "NETCDF3_64BIT_DATA"])
def test_packing_the_way_xarray_decodes_it(tmp_path, fmt):
    """int16 with a float32 negative scale factor (decodes to float32), int16 whose _FillValue is NaN (xarray
    drops it, values stay int16 but scaled), _Unsigned bytes, a lone record variable of an odd size (records not
    padded) and record variables of odd sizes (padded)."""
    f = str(tmp_path / "packed.nc")
    rng = np.random.default_rng(0)
    with netCDF4.Dataset(f, "w", format=fmt) as nc:
        nc.createDimension("time", None)
        nc.createDimension("x", 3)
        nc.createDimension("y", 5)
        nc.title = "packed"
        nc.version = np.int32(3)
        neg = nc.createVariable("neg", "i2", ("time", "y"), fill_value=np.int16(-32767))
        neg.scale_factor, neg.add_offset = np.float32(-0.25), np.float32(10.0)
        neg.units = "K"
        nanfill = nc.createVariable("nanfill", "i2", ("time", "x"))
        nanfill.setncattr("_FillValuX", np.float32(np.nan))  # renamed below: netCDF-C refuses it
        nanfill.scale_factor = np.float64(0.5)
        ub = nc.createVariable("ub", "i1", ("time", "x"))
        ub.setncattr("_Unsigned", "true")
        fixed = nc.createVariable("fixed", "f8", ("y",))
        fixed.long_name = "a fixed-size variable"
        nc.createVariable("time", "f8", ("time",)).units = "hours since 2000-01-01"
        nc.set_auto_maskandscale(False)  # the raw values are written
        neg[:] = rng.integers(-30000, 30000, (7, 5)).astype("i2")
        neg[2, 1] = -32767
        nanfill[:] = rng.integers(-100, 100, (7, 3)).astype("i2")
        ub[:] = rng.integers(-128, 127, (7, 3)).astype("i1")
        fixed[:] = rng.standard_normal(5)
        nc["time"][:] = np.arange(7) * 6.0
    _rename_attr(f, b"_FillValuX", b"_FillValue")
    with pytest.warns(Warning, match="_FillValue"):
        ref = xr.open_dataset(f).load()  # "non-conforming '_FillValue' ... dropping"
    ds = open_netcdf(f)
    xr.testing.assert_identical(ds.load(), ref)
    assert ds.neg.dtype == np.float32 and np.isnan(ds.neg.values[2, 1]) and (np.diff(ref.neg.values[0]) != 0).all()
    assert ds.nanfill.dtype == ref.nanfill.dtype and ds.ub.dtype == np.uint8
    codecs = {v: netcdf_store(f)._group.arrays[v].metadata.codecs[0].to_dict()["name"] for v in ("neg", "fixed")}
    assert codecs == {"neg": CODEC_NAME, "fixed": "bytes"}
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    run_epoch(ref, ds.insitu.batches(m, "train", batch_size=2, output="xarray"), "xarray")

    one = str(tmp_path / "one_record_var.nc")  # a lone record variable: records are 3 bytes, not padded to 4
    with netCDF4.Dataset(one, "w", format=fmt) as nc:
        nc.createDimension("time", None)
        nc.createDimension("x", 3)
        nc.createVariable("b", "i1", ("time", "x"))[:] = np.arange(21).reshape(7, 3)
    xr.testing.assert_identical(open_netcdf(one).load(), xr.open_dataset(one).load())


def test_big_header(tmp_path):
    """A header longer than the first read (64 kB) is read in growing pieces."""
    ds = era5_like(4, NY, NX)
    ds.attrs["history"] = "x" * 200_000
    f = write(tmp_path / "long.nc", ds)
    xr.testing.assert_identical(open_netcdf(f).load(), xr.open_dataset(f).load())


def test_truncated_file_names_it(tmp_path):
    f = write(tmp_path / "cut.nc", era5_like(NT, NY, NX))
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 100)
    with pytest.raises(VirtualReferenceError, match=r"cut\.nc: variable '\w+' ends at byte \d+, past the end"):
        open_netcdf(f)
    with open(f, "r+b") as fh:
        fh.truncate(40)
    with pytest.raises(VirtualReferenceError, match=r"cut\.nc: its NetCDF-3 header cannot be read"):
        open_netcdf(f)


def test_characters_refused_naming_the_variable(tmp_path):
    ds = era5_like(4, NY, NX).assign(station=("lat", np.array(["a", "bb", "ccc", "d", "e", "f"], dtype="S3")))
    f = str(tmp_path / "chars.nc")
    ds.to_netcdf(f, format="NETCDF3_CLASSIC", engine="netcdf4")
    with pytest.raises(VirtualReferenceError, match=re.escape("chars.nc: variable 'station' holds characters")):
        open_netcdf(f)
    ok = open_netcdf(f, drop_variables=["station"])
    xr.testing.assert_identical(ok.load(), xr.open_dataset(f).drop_vars("station").load())


def era_interim_like(nm: int = 12, nl: int = 3, ny: int = NY, nx: int = NX, seed: int = 0) -> xr.Dataset:
    """u, v, z on month x level x lat x lon (as the ERA-Interim monthly means), and a land-sea mask."""
    rng = np.random.default_rng(seed)
    shape = (nm, nl, ny, nx)
    dims = ("month", "level", "lat", "lon")
    return xr.Dataset(
        {"u": (dims, rng.normal(0, 10, shape).astype("f4")), "v": (dims, rng.normal(0, 10, shape).astype("f4")),
         "z": (dims, rng.normal(5e4, 1e3, shape).astype("f8")),
         "lsm": (("lat", "lon"), (rng.random((ny, nx)) > 0.5).astype("f4"))},
        coords={"month": np.arange(1, nm + 1, dtype="i4"), "level": np.array([500, 700, 850][:nl], dtype="i4"),
                "lat": np.linspace(60, -60, ny), "lon": np.arange(nx) * 36.0})


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.slow
def test_fixed_size_variables_split_along_their_first_dim(tmp_path, fmt):
    """Contiguous fixed-size variables are addressed in slabs of one index of their first dim (month, not the
    join dim): splits along month work as on a chunked array, values equal xr.open_dataset bit for bit."""
    f = str(tmp_path / "ei.nc")
    src = era_interim_like()
    src["u"].encoding.update(packing() | {"dtype": "int16"})  # packed, as ERA-Interim's files are
    src.to_netcdf(f, format=fmt, engine="netcdf4")
    with open(f, "rb") as fh:
        h = parse_header(fh.read(1 << 16))
    assert h.record_dim is None  # every variable fixed-size, stored contiguously
    ds, ref = open_netcdf(f), xr.open_dataset(f).load()
    xr.testing.assert_identical(ds.load(), ref)
    assert ds.u.encoding["chunks"] == (1, 3, NY, NX) and ds.lsm.encoding["chunks"] == (1, NX)
    assert ds.insitu.geometry.nblocks("month") == 12
    m = ds.insitu.split("month", fractions={"train": 0.5, "val": 0.25, "test": 0.25}, gap=1)
    assert [list(b) for b in m.splits.values()] == [[0, 1, 2, 3, 4], [6, 7, 8], [10, 11]]
    for split in m.splits:
        for kw in ({}, {"window": {"month": 2}, "over": "level"}):
            gen = ds.insitu.batches(m, split, batch_size=2, output="xarray", block_chunks=2, seed=1, **kw)
            seen = run_epoch(ref, gen, "xarray")
            assert np.array_equal(np.sort(seen), np.arange(gen.n_samples))
    one = ds.insitu.split("level", fractions={"train": 1.0})  # one chunk along level: one split needs no block
    gen = ds.insitu.batches(one, "train", batch_size=4, output="numpy", over="month", variables=["u", "z"])
    assert np.array_equal(np.sort(run_epoch(ref, gen)), np.arange(3 * 12))
    # a spatial hold-out on the one-chunk fields: in blocks
    sp = ds.insitu.split(["lat", "lon"], fractions={"train": 0.5, "val": 0.5}, contiguous=False, seed=2,
                         block={"lat": 2, "lon": 5})
    gen = ds.insitu.batches(sp, "val", batch_size=5, output="numpy", over="month", variables=["v", "lsm"])
    assert np.array_equal(np.sort(run_epoch(ref, gen)), np.arange(gen.n_samples))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 3 * 10**6))
def test_slab_steps_divide_and_bound_the_references(n):
    from xinsitu.formats.netcdf3 import MAX_SLABS, slab_steps

    s = slab_steps(n)
    assert n % s == 0 and n // s <= MAX_SLABS  # full slabs, a bounded number of them
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    assert all(n // d > MAX_SLABS for d in small + [n // d for d in small] if d < s)  # the fewest indices a slab


def test_long_first_dim_in_slabs_of_several(tmp_path, monkeypatch):
    """A first dim longer than MAX_SLABS: slabs of the smallest divisor that bounds them, shared by every
    variable along it; splits cut between slabs and values still equal xarray's."""
    import xinsitu.formats.netcdf3 as nc3mod

    monkeypatch.setattr(nc3mod, "MAX_SLABS", 5)
    f = str(tmp_path / "ei.nc")
    src = era_interim_like().assign(tm=("month", np.arange(12.0)))
    src.to_netcdf(f, format="NETCDF3_CLASSIC", engine="netcdf4")
    ds, ref = open_netcdf(f), xr.open_dataset(f).load()
    xr.testing.assert_identical(ds.load(), ref)
    assert ds.u.encoding["chunks"] == (3, 3, NY, NX) and ds.tm.encoding["chunks"] == (3,)
    m = ds.insitu.split("month", fractions={"train": 0.5, "val": 0.5})
    assert np.array_equal(m.edges["month"], [0, 3, 6, 9, 12])
    gen = ds.insitu.batches(m, "val", batch_size=4, output="numpy", over="level", seed=2)
    assert np.array_equal(np.sort(run_epoch(ref, gen)), np.arange(6 * 3))


def test_an_unsigned_short_with_a_fill_masks_the_fill(tmp_path):
    """NetCDF-3 stores big-endian: an ``int16`` with ``_Unsigned="true"`` and a ``_FillValue`` was decoded in
    that byte order, and xarray's decoder then masked the fill's byte-swapped twin (65407 became NaN, the fill
    came through as 32767). Decoded in native order now: ``xr.open_dataset``'s values, in batches too."""
    netCDF4 = pytest.importorskip("netCDF4")
    p = str(tmp_path / "u.nc")
    with netCDF4.Dataset(p, "w", format="NETCDF3_CLASSIC") as f:
        f.createDimension("time", 4)
        t = f.createVariable("time", "i4", ("time",))
        t.units = "days since 2000-01-01"
        t[:] = np.arange(4)
        v = f.createVariable("x", "i2", ("time",), fill_value=np.int16(32767))
        v.set_auto_maskandscale(False)
        v._Unsigned = "true"
        v[:] = np.array([-129, 32767, 5, -1], "i2")  # as unsigned: 65407, the fill, 5, 65535
    want = xr.open_dataset(p).x.values
    np.testing.assert_array_equal(want, [65407, np.nan, 5, 65535])
    ds = open_netcdf(p)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    got = next(iter(ds.insitu.batches(m, "train", batch_size=4, shuffle=False, output="numpy")))["x"]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ds.x.values, want)
