"""NetCDF files joined along time where each file encodes its times its own way (xarray's default: units of
the file's own first step), or holds one step as a scalar ``time``: ``open_netcdf`` equals
``xr.open_mfdataset`` bit for bit -- a time coordinate's bounds (``time_bnds``) and datetime data variables
decoded file by file, files of one scalar step stacked along ``time``, a scalar coordinate that differs per
file (``valid_time``) joined along it -- and never silently keeps only the
first file (a ``concat_dim`` no file has raises, naming it)."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from tests.index.test_sampling import run_epoch

pytest.importorskip("virtualizarr", reason="the virtual extra is not installed")
pytest.importorskip("h5py", reason="the virtual extra is not installed")
netCDF4 = pytest.importorskip("netCDF4", reason="writing NetCDF-3 files needs netCDF4")

from xinsitu.virtual import VirtualReferenceError, netcdf_store, open_netcdf  # noqa: E402

MF = {"data_vars": "minimal", "coords": "minimal", "compat": "override"}
pytestmark = [pytest.mark.filterwarnings("ignore:Numcodecs codecs are not in the Zarr version 3"),
              # xarray writing each file: its time_bnds in the units of its own time (what these tests are about)
              pytest.mark.filterwarnings("ignore:Variable time has datetime type and a bounds variable")]
T = pd.date_range("2000-01-01", periods=8, freq="6h")


def _bounded(t: pd.DatetimeIndex = T) -> xr.Dataset:
    """Six-hourly steps with their bounds, and a datetime data variable along time (when each was issued)."""
    bnds = np.stack([t.values, t.values + np.timedelta64(6, "h")], 1)
    return xr.Dataset({"a": (("time", "y"), np.arange(2 * len(t), dtype="f4").reshape(-1, 2)),
                       "time_bnds": (("time", "nv"), bnds), "issued": ("time", t.values - np.timedelta64(3, "h"))},
                      coords={"time": ("time", t, {"bounds": "time_bnds"})})


def _write_halves(d, ds: xr.Dataset, fmt: str, units: str | None = None) -> list[str]:
    """Two files of 4 steps each, each counting hours from its own first step (xarray's default units), or
    all in ``units``."""
    enc: dict = {v: {"chunksizes": (2, 2)[: ds[v].ndim]} if fmt == "NETCDF4" else {} for v in ds.data_vars}
    if units:
        enc["time"], enc["issued"]["units"] = {"units": units}, units
    os.makedirs(d, exist_ok=True)
    files = []
    for k in range(2):
        files.append(os.path.join(d, f"f{k}.nc"))
        ds.isel(time=slice(4 * k, 4 * k + 4)).to_netcdf(files[-1], format=fmt, encoding=enc, unlimited_dims=["time"])
    return files


@pytest.mark.parametrize("fmt", ["NETCDF4", "NETCDF3_CLASSIC"])
def test_bounds_and_datetimes_in_each_files_units(tmp_path, fmt):
    """``time_bnds`` (no units of its own: xarray decodes it with ``time``'s, which differ from file to file)
    and ``issued`` (its own units, also per file) equal ``xr.open_mfdataset``: they were decoded with the first
    file's units (a day off in the second file) and refused, and now batches carry the right values."""
    files = _write_halves(tmp_path, _bounded(), fmt)
    with xr.open_dataset(files[0]) as a, xr.open_dataset(files[1]) as b:  # the premise: units differ per file
        assert a.time_bnds.encoding["units"] != b.time_bnds.encoding["units"]
        assert a.issued.encoding["units"] != b.issued.encoding["units"]
    ref = xr.open_mfdataset(files, **MF).load()
    got = open_netcdf(files)
    xr.testing.assert_identical(got.load(), ref)
    np.testing.assert_array_equal(got.time_bnds.values, _bounded().time_bnds.values)
    assert got.time_bnds.encoding["chunks"] == got.a.encoding["chunks"]  # joined inline in the files' chunks
    m = got.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    for split in m.splits:
        run_epoch(ref, got.insitu.batches(m, split, batch_size=3, output="numpy", shuffle=False), "numpy")
    run_epoch(ref, got.insitu.batches(m, "val", batch_size=2, output="xarray", seed=1), "xarray")

    # files in one set of units: bounds and datetimes stay byte ranges of the files (inline only where needed)
    files = _write_halves(tmp_path / "same", _bounded(), fmt, units="hours since 2000-01-01")
    store = netcdf_store(files)
    for v in ("time_bnds", "issued"):
        assert str(store._group.arrays[v].manifest._paths.ravel()[-1]).endswith("f1.nc")
    xr.testing.assert_identical(open_netcdf(files).load(), xr.open_mfdataset(files, **MF).load())


def test_datetimes_that_cannot_be_joined_raise(tmp_path):
    """A datetime variable decoded file by file whose shape differs beyond ``time`` is refused, naming it."""
    files = _write_halves(tmp_path, _bounded(), "NETCDF3_CLASSIC")
    other = _bounded().isel(time=slice(4, 8))
    other = other.assign(issued=(("time", "y"), np.repeat(other.issued.values[:, None], 2, 1)))
    other.to_netcdf(files[1], format="NETCDF3_CLASSIC", unlimited_dims=["time"])
    with pytest.raises(VirtualReferenceError, match=r"'issued' cannot be joined along 'time'"):
        netcdf_store(files)


@pytest.mark.parametrize("fmt", ["NETCDF4", "NETCDF3_CLASSIC"])
def test_one_scalar_step_per_file(tmp_path, fmt):
    """Files written from ``ds.isel(time=i)`` (``time`` a scalar coordinate) join along ``time`` as
    ``xr.open_mfdataset(combine="nested", concat_dim="time")`` joins them (every data variable gets the
    dimension, the constant one too): it was the first file alone, without a time dimension or an error."""
    ds = _bounded(T[:5]).drop_vars("time_bnds").assign(lsm=(("y",), np.array([0.0, 1.0])))
    ds["time"].attrs = {}
    files = []
    for i in reversed(range(5)):  # given out of order: put in the order of their times
        files.append(os.path.join(tmp_path, f"step{i}.nc"))
        ds.isel(time=i).to_netcdf(files[-1], format=fmt)
    assert "time" not in xr.open_dataset(files[0]).dims
    ref = xr.open_mfdataset(sorted(files), combine="nested", concat_dim="time", **MF).load()
    got = open_netcdf(files)
    assert dict(got.sizes) == {"time": 5, "y": 2} and got.lsm.dims == ("time", "y")
    xr.testing.assert_identical(got.load(), ref)
    m = got.insitu.split("time", fractions={"train": 0.6, "val": 0.4})
    for split in m.splits:
        run_epoch(ref, got.insitu.batches(m, split, batch_size=2, output="numpy", shuffle=False), "numpy")
    one = open_netcdf(files[0])  # one file alone stays as xr.open_dataset gives it
    xr.testing.assert_identical(one.load(), xr.open_dataset(files[0]).load())


# xr.open_mfdataset's defaults (named: xarray warns that they will change)
DEFAULT = {"combine": "nested", "concat_dim": "time", "data_vars": "all", "coords": "different",
           "compat": "no_conflicts", "join": "outer"}


@pytest.mark.parametrize("fmt", ["NETCDF4", "NETCDF3_CLASSIC"])
def test_scalar_coordinates_of_one_step_files(tmp_path, fmt):
    """Files written from ``ds.isel(time=i)`` whose other scalar coordinates, named only in the data variables'
    ``coordinates`` attribute, differ per file (``valid_time``, a datetime in each file's own units; ``step``, a
    timedelta) join along ``time`` as ``xr.open_mfdataset(combine="nested", concat_dim="time")`` joins them,
    and those equal in every file (``level``, ``forecast_reference_time``) stay scalars: they came from the
    first file as scalars."""
    t = T[:4]
    ds = xr.Dataset({"a": (("time", "y"), np.arange(8, dtype="f4").reshape(4, 2))},
                    coords={"time": t, "valid_time": ("time", t + pd.Timedelta("1h")),
                            "step": ("time", pd.to_timedelta(np.arange(4) * 6, "h")),
                            "forecast_reference_time": T[0], "level": 500.0})
    files = []
    for i in reversed(range(4)):  # given out of order: put in the order of their times
        files.append(os.path.join(tmp_path, f"step{i}.nc"))
        ds.isel(time=i).to_netcdf(files[-1], format=fmt)
    with xr.open_dataset(files[0]) as a, xr.open_dataset(files[1]) as b:  # the premise: scalars, own units
        assert a.valid_time.dims == () and "valid_time" in a.coords
        assert a.valid_time.encoding["units"] != b.valid_time.encoding["units"]
    ref = xr.open_mfdataset(sorted(files), **DEFAULT).load()
    assert ref.valid_time.dims == ("time",) and ref.level.dims == ()
    got = open_netcdf(files)
    xr.testing.assert_identical(got.load(), ref)
    np.testing.assert_array_equal(got.valid_time.values, ds.valid_time.values)
    np.testing.assert_array_equal(got.step.values, ds.step.values)
    assert got.level.dims == () and got.forecast_reference_time.dims == ()
    m = got.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    for split in m.splits:
        run_epoch(ref, got.insitu.batches(m, split, batch_size=2, output="xarray", shuffle=False), "xarray")
    one = open_netcdf(files[0])  # one file alone stays as xr.open_dataset gives it
    xr.testing.assert_identical(one.load(), xr.open_dataset(files[0]).load())


@pytest.mark.parametrize("fmt", ["NETCDF4", "NETCDF3_CLASSIC"])
def test_coordinates_along_time_and_scalar_of_multistep_files(tmp_path, fmt):
    """Forecast files of several steps each: ``valid_time(time)`` (each file in its own units) is joined as
    ``xr.open_mfdataset`` joins it, and ``forecast_reference_time``, a scalar that differs per file, gets
    ``time`` (each file's value for each of its steps) as the default ``coords="different"`` gives it: it
    came from the first file alone, as a scalar."""
    files = []
    for k in range(3):
        t = T[4 * k: 4 * k + 4] if k < 2 else pd.date_range(T[-1] + pd.Timedelta("6h"), periods=2, freq="6h")
        ds = xr.Dataset({"a": (("time", "y"), np.arange(2 * len(t), dtype="f4").reshape(-1, 2) + 10 * k)},
                        coords={"time": t, "valid_time": ("time", t + pd.Timedelta("3h")),
                                "forecast_reference_time": t[0] - pd.Timedelta("12h"), "level": 850.0})
        enc = {"a": {"chunksizes": (2, 2)}} if fmt == "NETCDF4" else {}
        files.append(os.path.join(tmp_path, f"f{k}.nc"))
        ds.to_netcdf(files[-1], format=fmt, encoding=enc, unlimited_dims=["time"])
    with xr.open_dataset(files[0]) as a, xr.open_dataset(files[1]) as b:  # the premise: each file its own units
        assert a.valid_time.encoding["units"] != b.valid_time.encoding["units"]
    ref = xr.open_mfdataset(files, **DEFAULT).load()
    assert ref.forecast_reference_time.dims == ("time",) and ref.level.dims == ()
    got = open_netcdf(files[::-1])
    xr.testing.assert_identical(got.load(), ref)
    np.testing.assert_array_equal(got.valid_time.values, ref.time.values + np.timedelta64(3, "h"))
    m = got.insitu.split("time", fractions={"train": 0.6, "val": 0.4})
    for split in m.splits:
        run_epoch(ref, got.insitu.batches(m, split, batch_size=3, output="numpy", shuffle=False), "numpy")
    # the same forecast_reference_time in every file: a scalar, as xarray keeps it
    os.makedirs(tmp_path / "same")
    same = [os.path.join(tmp_path, "same", os.path.basename(f)) for f in files]
    for f, g in zip(files, same, strict=True):
        with xr.open_dataset(f) as d:
            d.assign_coords(forecast_reference_time=T[0]).to_netcdf(g, format=fmt, unlimited_dims=["time"])
    got = open_netcdf(same)
    assert got.forecast_reference_time.dims == ()
    xr.testing.assert_identical(got.load(), xr.open_mfdataset(same, **DEFAULT).load())


def test_concat_dim_no_file_has(tmp_path):
    """A ``concat_dim`` none of several files has (a typo) raises, naming it: it gave the first file alone."""
    ds = _bounded(T[:4])
    files = [os.path.join(tmp_path, f"f{k}.nc") for k in range(2)]
    for k, f in enumerate(files):
        ds.isel(time=slice(2 * k, 2 * k + 2)).to_netcdf(f)
    with pytest.raises(ValueError, match=r"concat_dim='tiem'.*none of the 2 files.*\['nv', 'time', 'y'\]"):
        open_netcdf(files, concat_dim="tiem")
    assert open_netcdf(files[0], concat_dim="tiem").sizes["time"] == 2  # one file: nothing to join
