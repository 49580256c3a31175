"""Acceptance tests: SPEC.md sentences checked against plain xarray as the oracle.

Every archive here is written by another tool (xarray/zarr/netCDF4/eccodes/icechunk),
never by xinsitu's synthetic writer.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import xinsitu
import xinsitu.virtual  # noqa: F401  (see test_virtual_attribute_after_plain_import)
from tests.support.own_process import own_process

warnings.filterwarnings("ignore", message=".*[Cc]onsolidated.*")

NT, NLAT, NLON, NLEV = 40, 6, 8, 3
CT, CLAT, CLON = 4, 3, 4


# --------------------------------------------------------------------------- data


def make_ds(nt: int = NT) -> xr.Dataset:
    rng = np.random.default_rng(42)
    time = pd.date_range("2000-01-01", periods=nt, freq="6h")
    lat = np.linspace(60, 10, NLAT)
    lon = np.arange(NLON) * 2.5
    level = np.array([850, 500, 250])
    t2m = rng.normal(280, 5, (nt, NLAT, NLON)).astype("float32")
    z = rng.normal(5e4, 100, (nt, NLEV, NLAT, NLON)).astype("float32")
    tp = rng.uniform(0, 0.01, (nt, NLAT, NLON))
    tp[rng.uniform(size=tp.shape) < 0.1] = np.nan
    u = rng.normal(0, 10, (nt, NLEV, NLAT, NLON)).astype("float32")
    ds = xr.Dataset(
        {
            "t2m": (("time", "lat", "lon"), t2m, {"units": "K"}),
            "z": (("time", "level", "lat", "lon"), z),
            "tp": (("time", "lat", "lon"), tp),
            "u": (("time", "level", "lat", "lon"), u),
            "lsm": (("lat", "lon"), rng.uniform(size=(NLAT, NLON)).astype("float32")),
        },
        coords={"time": time, "lat": lat, "lon": lon, "level": level},
        attrs={"title": "acceptance"},
    )
    return ds


def encoding(zarr_format: int = 3) -> dict:
    enc = {
        "t2m": {"chunks": (CT, CLAT, CLON)},
        "z": {"chunks": (CT, NLEV, CLAT, CLON)},
        "u": {"chunks": (CT, NLEV, CLAT, CLON)},
        "tp": {"chunks": (CT, CLAT, CLON), "dtype": "int16", "scale_factor": 1e-6,
               "add_offset": 0.0, "_FillValue": -32767},
        "lsm": {"chunks": (CLAT, CLON)},
    }
    return enc


@pytest.fixture(scope="module")
def v3_path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("acc") / "v3.zarr")
    make_ds().to_zarr(p, zarr_format=3, encoding=encoding(3), consolidated=False)
    return p


@pytest.fixture(scope="module")
def v3c_path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("acc") / "v3c.zarr")
    make_ds().to_zarr(p, zarr_format=3, encoding=encoding(3), consolidated=True)
    return p


@pytest.fixture(scope="module")
def v2_path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("acc") / "v2.zarr")
    make_ds().to_zarr(p, zarr_format=2, encoding=encoding(2), consolidated=True)
    return p


@pytest.fixture(scope="module")
def nc_path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("acc") / "f.nc")
    ds = make_ds()
    enc = {k: {kk: vv for kk, vv in v.items() if kk != "chunks"} for k, v in encoding().items()}
    ds.to_netcdf(p, engine="netcdf4", encoding=enc)
    return p


def oracle_for(ds: xr.Dataset, batch: xr.Dataset, dims=("time",)) -> xr.Dataset:
    """Plain xarray for the samples named by the batch's coordinates along ``sample``."""
    ind = {}
    for d in dims:
        ind[d] = xr.DataArray(ds.indexes[d].get_indexer(batch[d].values), dims="sample")
        assert (ind[d] >= 0).all()
    return ds.isel(ind).transpose("sample", ...).load()


def all_batches(gen):
    return list(gen)


def sample_times(gen) -> list:
    out = []
    for b in gen:
        out.extend(pd.to_datetime(b["time"].values).tolist())
    return out


def positions_to_xarray(ds, split_dim, ids_starts):
    ind = xr.DataArray(np.asarray(ids_starts), dims="sample")
    return ds.isel({split_dim: ind}).transpose("sample", ...).load()


def assert_values_equal(batch: xr.Dataset, ref: xr.Dataset) -> None:
    # default variables are the data vars on the split dim (SPEC §4): a static field may be left out
    assert set(batch.data_vars) <= set(ref.data_vars)
    assert set(ref.data_vars) - set(batch.data_vars) <= {"lsm"}
    assert batch.data_vars
    for v in batch.data_vars:
        a, b = batch[v], ref[v]
        assert a.dims == b.dims, (v, a.dims, b.dims)
        assert a.dtype == b.dtype, (v, a.dtype, b.dtype)
        assert np.array_equal(a.values, b.values, equal_nan=True), v


# --------------------------------------------------------------------------- §1 opening


OPENERS = {
    "xinsitu_v3_noconsolidated": lambda p: xinsitu.open_zarr(p),
    "xinsitu_file_url": lambda p: xinsitu.open_zarr("file://" + os.path.abspath(p)),
    "xr_open_zarr_dask": lambda p: xr.open_zarr(p, consolidated=False),
    "xr_open_zarr_nodask": lambda p: xr.open_zarr(p, chunks=None, consolidated=False),
    "xr_open_dataset_engine_zarr": lambda p: xr.open_dataset(p, engine="zarr", consolidated=False),
}


@pytest.mark.parametrize("how", list(OPENERS))
@pytest.mark.slow
def test_open_ways_batches_equal_xarray(v3_path, how):
    ds = OPENERS[how](v3_path)
    ref = xr.open_zarr(v3_path, chunks=None, consolidated=False)
    m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
    gen = ds.insitu.batches(m, "train", batch_size=5, shuffle=True, seed=1)
    seen = []
    for b in gen:
        assert "sample" in b.dims
        assert_values_equal(b, oracle_for(ref[list(b.data_vars)], b))
        seen.extend(b.time.values.tolist())
    n_val = sum(b.sizes["sample"] for b in ds.insitu.batches(m, "val", batch_size=64))
    # 7.5 of 10 chunks: largest remainder gives 7 or 8 whole chunks of 4
    assert len(seen) == len(set(seen)) and len(seen) in (28, 32) and len(seen) + n_val == NT


def test_open_zarr_returns_lazy_dataset_without_dask(v3_path):
    ds = xinsitu.open_zarr(v3_path)
    assert isinstance(ds, xr.Dataset)
    for v in ds.data_vars:
        assert not hasattr(ds[v].variable._data, "dask"), v
        import dask.array as da
        assert not isinstance(ds[v].data, da.Array)


def test_v3_without_consolidated_sorts_variables(v3_path):
    ds = xinsitu.open_zarr(v3_path)
    assert list(ds.data_vars) == sorted(ds.data_vars)


def test_v2_store(v2_path):
    ds = xinsitu.open_zarr(v2_path)
    ref = xr.open_zarr(v2_path, chunks=None)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    for b in ds.insitu.batches(m, "val", batch_size=7, shuffle=False):
        assert_values_equal(b, oracle_for(ref[list(b.data_vars)], b))


def test_consolidated_v3_keeps_dataset_order(v3c_path):
    ds = xinsitu.open_zarr(v3c_path)
    ref = xr.open_zarr(v3c_path, chunks=None)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", batch_size=4, stack=True, output="numpy", variables=["tp", "t2m"])
    assert gen.channels == ["tp", "t2m"]
    assert set(ds.data_vars) == set(ref.data_vars)


def test_localstore_object(v3_path):
    import zarr
    store = zarr.storage.LocalStore(v3_path, read_only=True)
    ds = xinsitu.open_zarr(store)
    ref = xr.open_zarr(v3_path, chunks=None, consolidated=False)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    for b in ds.insitu.batches(m, "train", batch_size=6):
        assert_values_equal(b, oracle_for(ref[list(b.data_vars)], b))


def test_memory_url_opens_or_clear_error():
    # memory:// is an obstore URL; an empty one must raise a clear error, not hang or crash oddly.
    with pytest.raises(Exception) as ei:
        xinsitu.open_zarr("memory://nothing-here.zarr")
    assert "memory" in str(ei.value).lower() or "not" in str(ei.value).lower()


def test_icechunk_session_store(tmp_path):
    icechunk = pytest.importorskip("icechunk")
    repo = icechunk.Repository.create(icechunk.local_filesystem_storage(str(tmp_path / "repo")))
    session = repo.writable_session("main")
    ds0 = make_ds()
    ds0.to_zarr(session.store, zarr_format=3, consolidated=False, encoding=encoding())
    snap = session.commit("init")
    ro = repo.readonly_session(snapshot_id=snap)
    ds = xinsitu.open_zarr(ro.store)
    assert list(ds.data_vars) == sorted(ds.data_vars)
    ref = xr.open_zarr(repo.readonly_session(snapshot_id=snap).store, chunks=None, consolidated=False)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    d = json.loads(m.to_json())
    assert snap in json.dumps(d)
    for b in ds.insitu.batches(m, "val", batch_size=8):
        assert_values_equal(b, oracle_for(ref[list(b.data_vars)], b))


SUBSETS = {
    "vars": lambda ds: ds[["t2m", "tp"]],
    "sel_level": lambda ds: ds.sel(level=500),
    "isel_lat": lambda ds: ds.isel(lat=slice(0, 4)),
    "isel_lat_mid": lambda ds: ds.isel(lat=slice(1, 5), lon=slice(2, 8)),
    "sel_time": lambda ds: ds.sel(time=slice("2000-01-02", "2000-01-08")),
    "isel_time_midchunk": lambda ds: ds.isel(time=slice(2, 33)),
}


@pytest.mark.parametrize("sub", list(SUBSETS))
@pytest.mark.parametrize("opener", ["xinsitu", "xr_dask", "xr_nodask"])
@pytest.mark.slow
def test_subsets_equal_xarray(v3_path, sub, opener):
    base = {"xinsitu": lambda: xinsitu.open_zarr(v3_path),
            "xr_dask": lambda: xr.open_zarr(v3_path, consolidated=False),
            "xr_nodask": lambda: xr.open_zarr(v3_path, chunks=None, consolidated=False)}[opener]()
    ds = SUBSETS[sub](base)
    ref = SUBSETS[sub](xr.open_zarr(v3_path, chunks=None, consolidated=False))
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    seen = []
    for split in ("train", "val"):
        for b in ds.insitu.batches(m, split, batch_size=5, seed=3):
            assert_values_equal(b, oracle_for(ref[list(b.data_vars)], b))
            seen.extend(b.time.values.tolist())
    assert len(seen) == len(set(seen))


def test_subset_midchunk_keeps_source_grid(v3_path):
    ds = xinsitu.open_zarr(v3_path).isel(time=slice(2, 34))
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    # source chunks of 4, starting at 2: the first partial chunk (2 steps) is its own chunk
    times = {}
    for s in ("train", "val"):
        times[s] = sorted(sample_times(ds.insitu.batches(m, s, batch_size=64, shuffle=False)))
    edges = pd.to_datetime(ds.time.values)
    full = pd.to_datetime(xr.open_zarr(v3_path, chunks=None, consolidated=False).time.values)
    for s, ts in times.items():
        pos = full.get_indexer(ts)
        # each split consists of whole source chunks (positions // 4)
        blocks = set(pos // CT)
        other = set(full.get_indexer(times["val" if s == "train" else "train"]) // CT)
        assert not (blocks & other), s
    assert len(times["train"]) + len(times["val"]) == len(edges)


def test_in_memory_dataset():
    ds = make_ds(nt=12)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    # each position is its own chunk
    assert ds.insitu.chunks["time"] == 1
    seen = []
    for b in ds.insitu.batches(m, "train", batch_size=4, seed=0):
        assert_values_equal(b, oracle_for(ds[list(b.data_vars)], b))
        seen.extend(b.time.values.tolist())
    assert len(seen) == 6


def test_in_memory_dask_chunks_set_grid():
    ds = make_ds(nt=12).chunk({"time": 3})
    assert ds.insitu.chunks["time"] == 3
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    for b in ds.insitu.batches(m, "val", batch_size=4, seed=0):
        assert_values_equal(b, oracle_for(ds[list(b.data_vars)].compute(), b))


def test_dask_netcdf_dataset(nc_path):
    ds = xr.open_dataset(nc_path, chunks={"time": 4})
    ref = xr.open_dataset(nc_path)
    assert ds.insitu.chunks["time"] == 4
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    try:
        gen = ds.insitu.batches(m, "train", batch_size=6, seed=0)
        for b in gen:
            assert_values_equal(b, oracle_for(ref[list(b.data_vars)], b))
    except Exception as e:  # allowed only if it names the virtual openers
        assert "open_netcdf" in str(e), e


def test_dims_without_coordinates(v3_path):
    ds = xinsitu.open_zarr(v3_path).drop_vars(["lat", "lon", "time"])
    ref = xr.open_zarr(v3_path, chunks=None, consolidated=False).drop_vars(["lat", "lon", "time"])
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", batch_size=5, shuffle=False)
    ids = np.concatenate(gen.batch_ids())
    got = xr.concat(list(gen), "sample")
    # unshuffled: sample ids are positions within the split; labels are positions
    assert np.all(np.diff(ids) > 0)
    assert got.sizes["sample"] == 20
    exp = ref.isel(time=xr.DataArray(np.arange(20), dims="sample")).transpose("sample", ...)
    for v in got.data_vars:
        assert np.array_equal(got[v].values, exp[v].values, equal_nan=True), v
    s = ds.insitu.split("lat", fractions={"a": 0.5, "b": 0.5})
    assert s is not None


def test_cannot_map_back_clear_error(v3_path):
    a = xr.open_zarr(v3_path, consolidated=False)
    ds = (a + a.shift(time=1))[["t2m"]]
    with pytest.raises((ValueError, TypeError)) as ei:
        m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
        list(ds.insitu.batches(m, "train"))
    assert len(str(ei.value)) > 20


# --------------------------------------------------------------------------- §2 geometry


def test_geometry_matches_encoding(v3_path):
    ds = xinsitu.open_zarr(v3_path)
    g = ds.insitu.geometry
    assert ds.insitu.chunks == {"time": CT, "lat": CLAT, "lon": CLON, "level": NLEV}
    r = repr(g)
    assert "t2m" in r
    assert "<" in g._repr_html_()
    xr_ds = xr.open_zarr(v3_path, consolidated=False)
    assert xr_ds.insitu.chunks == ds.insitu.chunks


def test_geometry_sharded(tmp_path):
    p = str(tmp_path / "sh.zarr")
    ds = make_ds()[["t2m"]]
    ds.to_zarr(p, zarr_format=3, consolidated=False,
               encoding={"t2m": {"chunks": (2, 3, 4), "shards": (8, 6, 8)}})
    d = xinsitu.open_zarr(p)
    assert d.insitu.chunks == {"time": 2, "lat": 3, "lon": 4}
    r = repr(d.insitu.geometry)
    assert "8" in r and "shard" in r.lower()
    ref = xr.open_zarr(p, chunks=None, consolidated=False)
    m = d.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    for b in d.insitu.batches(m, "train", batch_size=7):
        assert_values_equal(b, oracle_for(ref, b))


# --------------------------------------------------------------------------- §3 split


@pytest.fixture(scope="module")
def ds3(v3_path):
    return xinsitu.open_zarr(v3_path)


def _chunks_of(m, name):
    d = json.loads(m.to_json())
    return d


def test_split_fractions_whole_chunks(ds3):
    m = ds3.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1}, gap=0)
    n = {s: len(sample_times(ds3.insitu.batches(m, s, batch_size=100))) for s in ("train", "val", "test")}
    assert n == {"train": 32, "val": 4, "test": 4}


def test_split_gap(ds3):
    m = ds3.insitu.split("time", fractions={"train": 0.75, "val": 0.125, "test": 0.125}, gap=1)
    t = {s: sorted(sample_times(ds3.insitu.batches(m, s, batch_size=100, shuffle=False)))
         for s in ("train", "val", "test")}
    full = pd.to_datetime(ds3.time.values)
    ctr = full.get_indexer(t["train"]) // CT
    cva = full.get_indexer(t["val"]) // CT
    cte = full.get_indexer(t["test"]) // CT
    assert cva.min() - ctr.max() >= 2 and cte.min() - cva.max() >= 2
    assert len(t["train"]) + len(t["val"]) + len(t["test"]) == NT - 2 * CT
    assert ctr.max() < cva.min() < cte.min()


def test_split_ranges_inward_and_labels(ds3):
    m = ds3.insitu.split("time", ranges={"train": slice("2000-01-01", "2000-01-06T06"),
                                         "val": slice("2000-01-07T12", None)})
    tr = sorted(sample_times(ds3.insitu.batches(m, "train", batch_size=100)))
    va = sorted(sample_times(ds3.insitu.batches(m, "val", batch_size=100)))
    sel_tr = pd.to_datetime(ds3.sel(time=slice("2000-01-01", "2000-01-06T06")).time.values)
    # rounded inward: a subset of the label range, on chunk edges
    assert set(tr) <= set(sel_tr)
    full = pd.to_datetime(ds3.time.values)
    assert len(tr) % CT == 0 and full.get_indexer([tr[0]])[0] % CT == 0
    assert len(va) % CT == 0 and full.get_indexer([va[0]])[0] % CT == 0
    assert tr[-1] < va[0]
    s = m.summary() if callable(getattr(m, "summary", None)) else m.summary
    txt = str(s) + repr(m)
    assert str(tr[0].date()) in txt or tr[0].isoformat()[:10] in txt


def test_split_ranges_too_close_for_gap(ds3):
    with pytest.raises(ValueError):
        ds3.insitu.split("time", ranges={"train": slice("2000-01-01", "2000-01-04T18"),
                                         "val": slice("2000-01-05", None)}, gap=1)


@pytest.mark.parametrize("kw, word", [
    (dict(fractions={"train": 0.7, "val": 0.2}), "sum"),
    (dict(fractions={"train": 1.2, "val": -0.2}), "negative"),
    (dict(fractions={"train": 0.99, "val": 0.01}), "no chunk"),
    (dict(ranges={"a": slice("2000-01-01", "2000-01-05"), "b": slice("2000-01-03", None)}), "overlap"),
    (dict(ranges={"a": slice("1990-01-01", "1990-02-01")}), ""),
])
def test_split_bad_input_valueerror(ds3, kw, word):
    with pytest.raises(ValueError) as ei:
        ds3.insitu.split("time", **kw)
    assert word in str(ei.value).lower()


def test_split_unknown_dim(ds3):
    with pytest.raises(ValueError) as ei:
        ds3.insitu.split("height", fractions={"a": 0.5, "b": 0.5})
    assert "height" in str(ei.value)


def test_split_unchunked_dim(tmp_path):
    p = str(tmp_path / "one.zarr")
    make_ds()[["t2m"]].to_zarr(p, encoding={"t2m": {"chunks": (4, NLAT, NLON)}}, consolidated=False)
    ds = xinsitu.open_zarr(p)
    with pytest.raises(ValueError) as ei:
        ds.insitu.split("lat", fractions={"a": 0.5, "b": 0.5})
    assert "lat" in str(ei.value)


def test_manifest_json_roundtrip(ds3, tmp_path):
    m = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5}, gap=1)
    p = tmp_path / "m.json"
    m.to_json(str(p))
    m2 = xinsitu.SplitManifest.from_json(str(p))
    json.loads(p.read_text())
    a = [b.time.values for b in ds3.insitu.batches(m, "val", batch_size=3, seed=5)]
    b_ = [b.time.values for b in ds3.insitu.batches(m2, "val", batch_size=3, seed=5)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b_, strict=False)) and len(a) == len(b_)
    assert m2.to_json() == m.to_json()
    assert "<" in m._repr_html_()


@pytest.mark.slow
def test_manifest_compact_contiguous_large(tmp_path):
    # 10^7 chunks along time, metadata only (no chunk written): zarr.create_array
    import zarr
    p = str(tmp_path / "big.zarr")
    g = zarr.open_group(p, mode="w", zarr_format=3)
    g.create_array("x", shape=(2 * 10**7,), chunks=(2,), dtype="f4", fill_value=0.0,
                   dimension_names=["time"])
    ds = xinsitu.open_zarr(p)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1}, gap=2)
    assert len(m.to_json()) < 2000
    m2 = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5}, contiguous=False, seed=0)
    assert len(m2.to_json()) <= 4 * 2**20


def test_manifest_applies_to_refined_grid(v3_path, tmp_path):
    ds = xinsitu.open_zarr(v3_path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    p = str(tmp_path / "fine.zarr")
    make_ds().to_zarr(p, encoding={k: {**v, "chunks": (2,) + tuple(v["chunks"][1:])} if k != "lsm" else v
                                   for k, v in encoding().items()}, consolidated=False)
    fine = xinsitu.open_zarr(p)
    a = sorted(sample_times(ds.insitu.batches(m, "train", batch_size=100)))
    b = sorted(sample_times(fine.insitu.batches(m, "train", batch_size=100)))
    assert a == b


def test_manifest_other_grid_valueerror(v3_path, tmp_path):
    ds = xinsitu.open_zarr(v3_path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    p = str(tmp_path / "coarse.zarr")
    make_ds().to_zarr(p, encoding={k: {**v, "chunks": (5,) + tuple(v["chunks"][1:])} if k != "lsm" else v
                                   for k, v in encoding().items()}, consolidated=False)
    other = xinsitu.open_zarr(p)
    with pytest.raises(ValueError) as ei:
        list(other.insitu.batches(m, "train"))
    assert "chunk" in str(ei.value).lower() or "time" in str(ei.value)


def test_spatial_split_noncontiguous(ds3):
    m = ds3.insitu.split(["lat", "lon"], fractions={"train": 0.5, "val": 0.5}, contiguous=False, seed=0)
    m2 = ds3.insitu.split(["lat", "lon"], fractions={"train": 0.5, "val": 0.5}, contiguous=False, seed=0)
    assert m.to_json() == m2.to_json()
    xr.open_zarr(ds3.encoding.get("source", "") or "", chunks=None) if False else None
    pts = {}
    for s in ("train", "val"):
        gen = ds3.insitu.batches(m, s, batch_size=8, variables=["t2m"], shuffle=False)
        pts[s] = set()
        for b in gen:
            for la, lo in zip(b.lat.values, b.lon.values, strict=False):
                pts[s].add((float(la), float(lo)))
            assert b.t2m.dims == ("sample", "time")
    assert not pts["train"] & pts["val"]
    assert len(pts["train"]) + len(pts["val"]) == NLAT * NLON


# --------------------------------------------------------------------------- §4 batches


def test_exactly_once_and_last_short_batch(ds3):
    m = ds3.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    gen = ds3.insitu.batches(m, "train", batch_size=7, seed=0)
    sizes = [b.sizes["sample"] for b in gen]
    assert sum(sizes) == 32 and sizes[-1] == 32 % 7 and len(gen) == len(sizes)
    t = sample_times(gen)
    assert len(t) == len(set(t)) == 32
    gen2 = ds3.insitu.batches(m, "train", batch_size=7, seed=0, drop_last=True)
    assert [b.sizes["sample"] for b in gen2] == [7] * 4


@pytest.mark.parametrize("ws", [2, 3])
def test_ranks_equal_batches_disjoint(ds3, ws):
    m = ds3.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    per = [sample_times(ds3.insitu.batches(m, "train", batch_size=3, rank=r, world_size=ws, seed=2))
           for r in range(ws)]
    counts = [len(ds3.insitu.batches(m, "train", batch_size=3, rank=r, world_size=ws)) for r in range(ws)]
    assert len(set(counts)) == 1
    allt = sum(per, [])
    assert len(allt) == len(set(allt))
    assert 32 - len(allt) < ws * 3


def test_shuffle_determinism(ds3):
    m = ds3.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    g1 = ds3.insitu.batches(m, "train", batch_size=4, seed=9)
    g2 = ds3.insitu.batches(m, "train", batch_size=4, seed=9, max_inflight=1)
    a, b = sample_times(g1), sample_times(g2)
    assert a == b
    assert sample_times(g1) == a  # again without set_epoch: same order
    g1.set_epoch(1)
    c = sample_times(g1)
    assert sorted(c) == sorted(a) and c != a
    g3 = ds3.insitu.batches(m, "train", batch_size=4, seed=10)
    assert sample_times(g3) != a


def test_shuffle_false_order(ds3):
    m = ds3.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    t = sample_times(ds3.insitu.batches(m, "train", batch_size=5, shuffle=False))
    assert t == sorted(t)


def test_shuffle_false_order_two_dims(ds3):
    m = ds3.insitu.split(["lat", "lon"], fractions={"a": 0.5, "b": 0.5}, contiguous=False, seed=1)
    gen = ds3.insitu.batches(m, "a", batch_size=100, shuffle=False, variables=["t2m"])
    b = next(iter(gen))
    la = ds3.indexes["lat"].get_indexer(b.lat.values)
    lo = ds3.indexes["lon"].get_indexer(b.lon.values)
    blocks = list(zip(la // CLAT, lo // CLON, strict=False))
    # chunk blocks in split order (C order over blocks), within a block C order over (lat, lon)
    order = sorted(range(len(blocks)), key=lambda i: (blocks[i], la[i], lo[i]))
    assert order == list(range(len(blocks)))


def test_window_semantics(ds3):
    m = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds3.insitu.batches(m, "train", batch_size=4, window={"time": 3}, shuffle=False, variables=["t2m"])
    ref = xr.open_zarr(ds3.encoding.get("source", None) or "", chunks=None) if False else ds3.load()
    n = 0
    starts = []
    for b in gen:
        assert b.t2m.dims[:2] == ("sample", "time")
        assert b.t2m.shape[1] == 3
        for k in range(b.sizes["sample"]):
            tt = b.time.values[k]
            i0 = ds3.indexes["time"].get_loc(pd.Timestamp(tt[0]))
            starts.append(i0)
            exp = ref.t2m.isel(time=slice(i0, i0 + 3)).values
            assert np.array_equal(b.t2m.values[k], exp)
        n += b.sizes["sample"]
    assert starts == list(range(0, 18))  # windows fully inside the 20-step split


def test_patch_stride_xbatcher(ds3):
    m = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds3.insitu.batches(m, "train", batch_size=50, patch={"lat": 4, "lon": 3}, stride={"lat": 2, "lon": 3},
                             shuffle=False, variables=["t2m"])
    b = xr.concat(list(gen), "sample")
    # tiles: lat starts 0,2 (4 would need 8 > 6), lon starts 0,3 (6 would need 9 > 8)
    assert b.t2m.dims == ("sample", "lat", "lon")
    assert b.sizes["lat"] == 4 and b.sizes["lon"] == 3
    assert b.sizes["sample"] == 20 * 2 * 2
    ref = ds3.load()
    seen = set()
    for k in range(b.sizes["sample"]):
        t = b.time.values[k]
        la0 = ds3.indexes["lat"].get_loc(b.lat.values[k][0])
        lo0 = ds3.indexes["lon"].get_loc(b.lon.values[k][0])
        seen.add((la0, lo0))
        exp = ref.t2m.sel(time=t).isel(lat=slice(la0, la0 + 4), lon=slice(lo0, lo0 + 3)).values
        assert np.array_equal(b.t2m.values[k], exp)
    assert seen == {(0, 0), (0, 3), (2, 0), (2, 3)}


def test_over_dim(ds3):
    m = ds3.insitu.split(["lat", "lon"], fractions={"a": 0.5, "b": 0.5}, contiguous=False, seed=0)
    gen = ds3.insitu.batches(m, "a", batch_size=64, patch={"lat": 3, "lon": 4}, over="time",
                             variables=["t2m"], shuffle=False)
    tot = sum(b.sizes["sample"] for b in gen)
    assert tot % NT == 0
    b = next(iter(gen))
    assert b.t2m.dims == ("sample", "lat", "lon")
    with pytest.raises(ValueError):
        ds3.insitu.batches(m, "a", patch={"lat": 3, "lon": 4}, over="lat")


def test_outputs_numpy_torch(ds3):
    torch = pytest.importorskip("torch")
    m = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gx = ds3.insitu.batches(m, "train", batch_size=6, shuffle=False)
    gn = ds3.insitu.batches(m, "train", batch_size=6, shuffle=False, output="numpy")
    gt = ds3.insitu.batches(m, "train", batch_size=6, shuffle=False, output="torch")
    for bx, bn, bt in zip(gx, gn, gt, strict=False):
        assert set(bn) == set(bx.data_vars) == set(bt)
        for v in bn:
            assert isinstance(bn[v], np.ndarray) and isinstance(bt[v], torch.Tensor)
            assert np.array_equal(bn[v], bx[v].values, equal_nan=True)
            assert np.array_equal(bt[v].numpy(), bx[v].values, equal_nan=True)


def test_cf_decoding_tp(ds3, v3_path):
    ref = xr.open_zarr(v3_path, chunks=None, consolidated=False)
    assert ref.tp.dtype == np.float64 or ref.tp.dtype == np.float32
    m = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    b = xr.concat(list(ds3.insitu.batches(m, "train", batch_size=100, variables=["tp"], shuffle=False)), "sample")
    exp = ref.tp.isel(time=slice(0, 20)).values
    assert b.tp.dtype == ref.tp.dtype
    assert np.array_equal(b.tp.values, exp, equal_nan=True)
    assert np.isnan(exp).any()


def test_xarray_output_coords(ds3):
    m = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    b = next(iter(ds3.insitu.batches(m, "train", batch_size=5, seed=0)))
    assert b.time.dims == ("sample",)
    assert "lat" in b.coords and "level" in b.coords
    assert np.array_equal(b.lat.values, ds3.lat.values)
    b2 = next(iter(ds3.insitu.batches(m, "train", batch_size=5, seed=0, variables=["t2m", "lsm"])))
    assert b2.lsm.dims == ("lat", "lon")  # broadcast-free: keeps its own dims
    assert np.array_equal(b2.lsm.values, ds3.lsm.values)


def test_dataarray_channels(ds3):
    m = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds3.insitu.batches(m, "train", batch_size=5, output="dataarray", variables=["t2m", "z"],
                             shuffle=False)
    assert gen.channels == ["t2m", "z_850", "z_500", "z_250"]
    b = next(iter(gen))
    assert b.dims[:2] == ("sample", "variable")
    assert list(b["variable"].values) == gen.channels
    ref = ds3.load()
    exp_z = ref.z.isel(time=slice(0, 5)).values
    assert np.array_equal(b.values[:, 1:4], exp_z)
    assert np.array_equal(b.values[:, 0], ref.t2m.isel(time=slice(0, 5)).values)


def test_stack_numpy_common_dtype(ds3):
    m = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds3.insitu.batches(m, "train", batch_size=5, output="numpy", stack=True, variables=["t2m", "tp"],
                             shuffle=False)
    b = next(iter(gen))
    arr = b if isinstance(b, np.ndarray) else b[next(iter(b))]
    ref = ds3[["t2m", "tp"]].isel(time=slice(0, 5)).load().to_dataarray("variable").transpose("time", "variable", ...)
    assert arr.dtype == ref.dtype
    assert np.array_equal(arr, ref.values, equal_nan=True)


def _accessor_cls():
    return type(make_ds(nt=2).insitu)


def _batches_params():
    return inspect.signature(_accessor_cls().batches).parameters


def test_stack_level_list(ds3):
    assert "stack" in _batches_params()
    m = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds3.insitu.batches(m, "train", batch_size=4, output="numpy", stack=["level"],
                             variables=["u", "z"], shuffle=False)
    assert gen.channels == ["u_850", "u_500", "u_250", "z_850", "z_500", "z_250"]
    b = next(iter(gen))
    arr = b if isinstance(b, np.ndarray) else b[next(iter(b))]
    assert arr.shape == (4, 6, NLAT, NLON)
    # a surface variable beside them is one channel `{var}` (the usual weather-model input)
    gen = ds3.insitu.batches(m, "train", batch_size=4, output="numpy", stack=["level"],
                             variables=["z", "t2m", "u"], shuffle=False)
    assert gen.channels == ["z_850", "z_500", "z_250", "t2m", "u_850", "u_500", "u_250"]
    b = next(iter(gen))
    assert b.shape == (4, 7, NLAT, NLON)
    np.testing.assert_array_equal(b[:, 3], ds3.t2m.isel(time=slice(0, 4)).values)
    np.testing.assert_array_equal(b[:, 1], ds3.z.sel(level=500).isel(time=slice(0, 4)).values)


@own_process  # jax's threads and its at-fork warning stay in a child process
@pytest.mark.slow
def test_output_jax(ds3):
    jax = pytest.importorskip("jax")
    m = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    f32 = [v for v in ds3.data_vars if ds3[v].dtype == np.float32]
    if not jax.config.jax_enable_x64 and len(f32) < len(ds3.data_vars):
        # jax without 64-bit types cannot hold float64 values bit for bit: refused, naming the variable
        with pytest.raises(ValueError, match="float64"):
            ds3.insitu.batches(m, "train", batch_size=4, output="jax")
    gen = ds3.insitu.batches(m, "train", batch_size=4, output="jax", shuffle=False, variables=f32)
    gn = ds3.insitu.batches(m, "train", batch_size=4, output="numpy", shuffle=False, variables=f32)
    for bj, bn in zip(gen, gn, strict=False):
        for v in bn:
            assert isinstance(bj[v], jax.Array)
            assert np.array_equal(np.asarray(bj[v]), bn[v], equal_nan=True)


@pytest.mark.parametrize("kw", ["transform", "cache"])
def test_documented_keywords_work(v3_path, kw):
    """SPEC §4's ``transform=fn`` is applied to every finished batch; ``cache=True`` keeps decoded chunks:
    the second epoch takes them from it, with the very same batches."""
    ds3 = xinsitu.open_zarr(v3_path)  # its own: other tests ``load()`` the module's one into memory
    m = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    plain = ds3.insitu.batches(m, "train", batch_size=4, output="numpy", variables=["t2m"], shuffle=False)
    want = [b["t2m"] for b in plain]
    if kw == "transform":
        gen = ds3.insitu.batches(m, "train", batch_size=4, output="numpy", variables=["t2m"], shuffle=False,
                                 transform=lambda b: {"t2m": b["t2m"], "twice": 2 * b["t2m"]})
        got = list(gen)
        assert len(got) == len(want)
        for b, w in zip(got, want, strict=True):
            assert np.array_equal(b["t2m"], w, equal_nan=True)
            assert np.array_equal(b["twice"], 2 * w, equal_nan=True)
        return
    cache = xinsitu.ChunkCache()  # what cache=True makes, held here to read its counters
    gen = ds3.insitu.batches(m, "train", batch_size=4, output="numpy", variables=["t2m"], shuffle=False,
                             cache=cache)
    for epoch in (0, 1):
        gen.set_epoch(epoch)
        got = [b["t2m"] for b in gen]
        assert len(got) == len(want)
        assert all(np.array_equal(b, w, equal_nan=True) for b, w in zip(got, want, strict=True))
    st = cache.stats  # (per-epoch io_stats may count a read ahead into the epoch before)
    assert st.hits > 0 and st.misses > 0, st  # read once, then taken from it


def test_validity_keeps_only_valid_samples(ds3):
    """SPEC §4: ``validity(m, split, where=fn)`` records which samples are valid (``fn``: one bool per
    sample of a batch); batches of the split then draw only those, each once."""
    m = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5})

    def samples() -> list[np.ndarray]:
        gen = ds3.insitu.batches(m, "train", batch_size=1, output="numpy", variables=["t2m"], shuffle=False)
        return [b["t2m"][0] for b in gen]

    every = samples()
    want = [x for x in every if x.mean() > 280]
    assert 0 < len(want) < len(every)
    ds3.insitu.validity(m, "train", where=lambda b: (b.t2m.mean(["lat", "lon"]) > 280).values, variables=["t2m"])
    got = samples()
    assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


def test_stats_vs_xarray(ds3):
    m = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    st = ds3.insitu.stats(m, "train", variables=["t2m", "tp", "z"])
    json.dumps(st)
    tr = ds3.isel(time=slice(0, 20)).load()
    for v in ("t2m", "tp"):
        for k in ("mean", "std", "min", "max", "nan_count"):
            assert k in st[v]
        np.testing.assert_allclose(st[v]["mean"], float(tr[v].mean()), rtol=1e-5)
        np.testing.assert_allclose(st[v]["std"], float(tr[v].std()), rtol=1e-4)
        np.testing.assert_allclose(st[v]["min"], float(tr[v].min()), rtol=1e-6)
        assert st[v]["nan_count"] == int(tr[v].isnull().sum())
    assert isinstance(st["z"]["mean"], list) and len(st["z"]["mean"]) == 3
    np.testing.assert_allclose(st["z"]["std"], tr.z.std(["time", "lat", "lon"]).values, rtol=1e-4)
    assert m.stats is not None


def test_normalize_applies(ds3):
    m = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    st = ds3.insitu.stats(m, "train", variables=["t2m"])
    gen = ds3.insitu.batches(m, "val", batch_size=20, variables=["t2m"], normalize=st, shuffle=False,
                             output="numpy")
    b = next(iter(gen))
    raw = ds3.t2m.isel(time=slice(20, 40)).values
    exp = (raw - st["t2m"]["mean"]) / st["t2m"]["std"]
    np.testing.assert_allclose(b["t2m"], exp, rtol=1e-5, atol=1e-5)


def test_normalize_other_channel_order(ds3):
    """SPEC §1: statistics are keyed by channel name, applied whatever the order of variables=."""
    m = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    st = ds3.insitu.stats(m, "train", variables=["t2m", "tp"])
    gen = ds3.insitu.batches(m, "val", batch_size=4, variables=["tp", "t2m"], normalize=m.stats, stack=True,
                             output="numpy", shuffle=False)
    b = next(iter(gen))
    raw = ds3.t2m.isel(time=slice(20, 24)).values
    np.testing.assert_allclose(b[:, 1], (raw - st["t2m"]["mean"]) / st["t2m"]["std"], rtol=1e-5, atol=1e-5)


def test_resume_exact(ds3):
    m = ds3.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    g = ds3.insitu.batches(m, "train", batch_size=3, seed=4)
    g.set_epoch(2)
    full = [b.time.values for b in g]
    g = ds3.insitu.batches(m, "train", batch_size=3, seed=4)
    g.set_epoch(2)
    it = iter(g)
    for _ in range(4):
        next(it)
    state = json.loads(json.dumps(g.state_dict()))
    g2 = ds3.insitu.batches(m, "train", batch_size=3, seed=4)
    g2.load_state_dict(state)
    rest = [b.time.values for b in g2]
    assert len(rest) == len(full) - 4
    assert all(np.array_equal(a, b) for a, b in zip(rest, full[4:], strict=False))
    g3 = ds3.insitu.batches(m, "train", batch_size=4, seed=4)
    with pytest.raises(ValueError):
        g3.load_state_dict(state)
    g4 = ds3.insitu.batches(m, "train", batch_size=3, seed=5)
    with pytest.raises(ValueError):
        g4.load_state_dict(state)


def test_elastic_resume(ds3):
    m = ds3.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    W, W2, B = 2, 3, 2
    gens = [ds3.insitu.batches(m, "train", batch_size=B, rank=r, world_size=W, seed=1) for r in range(W)]
    its = [iter(g) for g in gens]
    yielded = []
    for _ in range(3):
        for it in its:
            yielded.extend(next(it).time.values.tolist())
    state = gens[1].state_dict()
    rest = []
    counts = []
    for r in range(W2):
        g = ds3.insitu.batches(m, "train", batch_size=B, rank=r, world_size=W2, seed=1)
        g.load_state_dict(state)
        bs = list(g)
        counts.append(len(bs))
        for b in bs:
            rest.extend(b.time.values.tolist())
    assert len(set(counts)) == 1
    allt = yielded + rest
    assert len(allt) == len(set(allt))
    assert 32 - len(allt) <= W2 * B


def test_len_sample_iostats(ds3):
    m = ds3.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    g = ds3.insitu.batches(m, "train", batch_size=5, window={"time": 2}, variables=["t2m"])
    assert len(g) == len(list(g))
    s = g.sample(3)
    assert isinstance(s, xr.Dataset)
    assert np.array_equal(s.t2m.values, ds3.t2m.isel(time=slice(3, 5)).values)
    st = g.io_stats
    assert isinstance(st, dict) and st
    keys = " ".join(st)
    for w in ("chunk", "bytes", "request"):
        assert w in keys, (w, list(st))


def test_typed_signature():
    params = _batches_params()
    for k in ("batch_size", "shuffle", "seed", "window", "patch", "stride", "over", "variables", "output",
              "stack", "normalize", "device", "block_chunks", "max_inflight", "drop_last", "rank",
              "world_size", "progress"):
        assert k in params, k


def test_map_style_dataloader(ds3):
    torch = pytest.importorskip("torch")
    m = ds3.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    d = ds3.insitu.dataset(m, "train", variables=["t2m", "tp"])
    assert isinstance(d, torch.utils.data.Dataset)
    assert len(d) == 32
    x = d[5]
    assert np.array_equal(np.asarray(x["t2m"]), ds3.t2m.isel(time=5).values)
    sampler = torch.utils.data.RandomSampler(range(len(d)), generator=torch.Generator().manual_seed(0))
    idx = list(sampler)
    dl = torch.utils.data.DataLoader(d, batch_size=6, sampler=idx, num_workers=0)
    got = [b for b in dl]
    cat = np.concatenate([np.asarray(b["tp"]) for b in got])
    exp = ds3.tp.isel(time=idx).values
    assert np.array_equal(cat, exp, equal_nan=True)


TORCH_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, torch, xinsitu, multiprocessing as mp
    path, nw = sys.argv[1], int(sys.argv[2])
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    # parent uses the store first (the obstore fork hazard)
    next(iter(ds.insitu.batches(m, "val", batch_size=2)))
    gen = ds.insitu.batches(m, "train", batch_size=3, output="numpy", variables=["t2m"])
    dl = torch.utils.data.DataLoader(gen.to_torch(), batch_size=None, num_workers=nw,
                                     multiprocessing_context="fork" if nw else None)
    vals = np.concatenate([np.asarray(b["t2m"]) for b in dl])
    ref = ds.t2m.isel(time=slice(0, 32)).values
    a = sorted(map(bytes, vals.reshape(len(vals), -1).view(np.uint8)))
    b = sorted(map(bytes, ref.reshape(len(ref), -1).view(np.uint8)))
    assert len(vals) == 32, len(vals)
    assert a == b
    print("OK")
""")


@pytest.mark.parametrize("nw", [0, 2])
@pytest.mark.slow
def test_to_torch_fork(v3_path, tmp_path, nw):
    pytest.importorskip("torch")
    script = tmp_path / "t.py"
    script.write_text(TORCH_SCRIPT)
    r = subprocess.run([sys.executable, str(script), v3_path, str(nw)], capture_output=True, text=True,
                       timeout=240, env={**os.environ})
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


# --------------------------------------------------------------------------- §5 read path


def test_missing_chunk_reads_fill(tmp_path):
    p = str(tmp_path / "miss.zarr")
    ds0 = make_ds()[["t2m"]]
    ds0.to_zarr(p, encoding={"t2m": {"chunks": (CT, CLAT, CLON), "_FillValue": -999.0}}, consolidated=False)
    os.remove(os.path.join(p, "t2m", "c", "1", "0", "0"))
    ref = xr.open_zarr(p, chunks=None, consolidated=False).load()
    ds = xinsitu.open_zarr(p)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b = xr.concat(list(ds.insitu.batches(m, "train", batch_size=100, shuffle=False)), "sample")
    exp = ref.t2m.isel(time=slice(0, 20)).values
    assert np.array_equal(b.t2m.values, exp, equal_nan=True)


def test_garbage_chunk_raises(tmp_path):
    p = str(tmp_path / "bad.zarr")
    ds0 = make_ds()[["t2m"]]
    ds0.to_zarr(p, encoding={"t2m": {"chunks": (CT, CLAT, CLON)}}, consolidated=False)
    key = os.path.join(p, "t2m", "c", "1", "0", "0")
    with open(key, "wb") as f:
        f.write(b"this is not a zstd frame" * 3)
    ds = xinsitu.open_zarr(p)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    with pytest.raises(xinsitu.ChunkReadError) as ei:
        list(ds.insitu.batches(m, "train", batch_size=100))
    msg = str(ei.value)
    assert "t2m" in msg and "c/1/0/0" in msg


# --------------------------------------------------------------------------- §6 files in place


@pytest.mark.parametrize("fmt", ["NETCDF4", "NETCDF3_CLASSIC", "NETCDF3_64BIT"])
def test_virtual_netcdf(tmp_path, fmt):
    pytest.importorskip("virtualizarr")
    ds0 = make_ds()[["t2m", "tp", "lsm"]]
    paths = []
    for k in range(2):
        p = str(tmp_path / f"f{k}.nc")
        part = ds0.isel(time=slice(20 * k, 20 * (k + 1)))
        enc = {"tp": {"dtype": "int16", "scale_factor": 1e-6, "add_offset": 0.0, "_FillValue": -32767}}
        if fmt == "NETCDF4":
            enc["t2m"] = {"chunksizes": (4, NLAT, NLON), "zlib": True}
        part.to_netcdf(p, format=fmt, encoding=enc)
        paths.append(p)
    ds = xinsitu.virtual.open_netcdf(paths)
    ref = xr.open_mfdataset(paths, combine="nested", concat_dim="time", data_vars="minimal",
                            compat="no_conflicts").load()
    for v in ("t2m", "tp"):
        assert np.array_equal(ds[v].values, ref[v].values, equal_nan=True), v
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    seen = 0
    for b in ds.insitu.batches(m, "val", batch_size=6, variables=["t2m", "tp"]):
        assert_values_equal(b, oracle_for(ref[["t2m", "tp"]], b))
        seen += b.sizes["sample"]
    assert seen > 0


def _write_grib(path, nsteps=3, edition=2):
    eccodes = pytest.importorskip("eccodes")
    rng = np.random.default_rng(0)
    vals = []
    with open(path, "wb") as f:
        for k in range(nsteps):
            sample = "regular_ll_sfc_grib2" if edition == 2 else "regular_ll_sfc_grib1"
            h = eccodes.codes_grib_new_from_samples(sample)
            eccodes.codes_set(h, "Ni", 8)
            eccodes.codes_set(h, "Nj", 6)
            eccodes.codes_set(h, "latitudeOfFirstGridPointInDegrees", 60.0)
            eccodes.codes_set(h, "latitudeOfLastGridPointInDegrees", 10.0)
            eccodes.codes_set(h, "longitudeOfFirstGridPointInDegrees", 0.0)
            eccodes.codes_set(h, "longitudeOfLastGridPointInDegrees", 17.5)
            eccodes.codes_set(h, "iDirectionIncrementInDegrees", 2.5)
            eccodes.codes_set(h, "jDirectionIncrementInDegrees", 10.0)
            eccodes.codes_set(h, "dataDate", 20000101 + k)
            eccodes.codes_set(h, "dataTime", 0)
            eccodes.codes_set(h, "shortName", "2t")
            v = rng.normal(280, 5, 48)
            eccodes.codes_set_values(h, v)
            vals.append(v)
            eccodes.codes_write(h, f)
            eccodes.codes_release(h)
    return vals


@pytest.mark.parametrize("edition", [2, 1])
def test_virtual_grib(tmp_path, edition):
    pytest.importorskip("cfgrib")
    pytest.importorskip("virtualizarr")
    p = str(tmp_path / f"f{edition}.grib")
    _write_grib(p, edition=edition)
    ref = xr.open_dataset(p, engine="cfgrib", backend_kwargs={"indexpath": ""}).load()
    ds = xinsitu.virtual.open_grib(p)
    for v in ref.data_vars:
        assert v in ds
        assert np.array_equal(ds[v].values, ref[v].values, equal_nan=True), v
    v = list(ref.data_vars)[0]
    m = ds.insitu.split("time", fractions={"a": 2 / 3, "b": 1 / 3})
    for b in ds.insitu.batches(m, "a", batch_size=2, variables=[v]):
        assert np.array_equal(b[v].values, oracle_for(ref[[v]], b)[v].values, equal_nan=True)


# --------------------------------------------------------------------------- argument errors


@pytest.mark.parametrize("kw, name", [
    (dict(batch_size=0), "batch_size"),
    (dict(batch_size="8"), "batch_size"),
    (dict(output="pandas"), "output"),
    (dict(window={"time": 0}), "window"),
    (dict(window={"foo": 2}), "foo"),
    (dict(patch={"lat": 100}), "patch"),
    (dict(variables=["nope"]), "nope"),
    (dict(seed=-1), "seed"),
    (dict(block_chunks=0), "block_chunks"),
    (dict(rank=3, world_size=2), "rank"),
    (dict(stride={"lat": 2}), "stride"),
])
def test_bad_batches_args(ds3, kw, name):
    m = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    with pytest.raises((ValueError, TypeError)) as ei:
        g = ds3.insitu.batches(m, "train", **kw)
        list(g)
    assert name in str(ei.value)


def test_unknown_split_name(ds3):
    m = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    with pytest.raises((ValueError, KeyError)) as ei:
        ds3.insitu.batches(m, "tset")
    assert "tset" in str(ei.value)


@pytest.mark.slow
def test_virtual_attribute_after_plain_import():
    r = subprocess.run([sys.executable, "-c", "import xinsitu; xinsitu.virtual.open_netcdf; xinsitu.virtual.open_grib"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-500:]


def test_state_other_channel_order_names_both(ds3):
    m = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    g = ds3.insitu.batches(m, "train", batch_size=4, variables=["t2m", "tp"])
    next(iter(g))
    state = g.state_dict()
    g2 = ds3.insitu.batches(m, "train", batch_size=4, variables=["tp", "t2m"])
    with pytest.raises(ValueError) as ei:
        g2.load_state_dict(state)
    msg = str(ei.value)
    assert "t2m" in msg and "tp" in msg


def test_stats_stack_level_keyword(ds3):
    params = inspect.signature(_accessor_cls().stats).parameters
    assert "stack" in params
    m = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    st = ds3.insitu.stats(m, "train", variables=["z", "t2m"], stack=["level"])
    assert st["channels"] == ["z_850", "z_500", "z_250", "t2m"]
    assert len(st["z"]["mean"]) == 3 and isinstance(st["t2m"]["mean"], float)
    gen = ds3.insitu.batches(m, "train", batch_size=4, output="numpy", stack=["level"], variables=["t2m", "z"],
                             normalize=st)
    assert next(iter(gen)).shape == (4, 4, NLAT, NLON)
