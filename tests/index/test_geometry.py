"""Geometry comes from metadata alone and describes every layout."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import xarray as xr

import xinsitu
from tests.conftest import CT, NT, NX, NY


def test_geometry_fields(era5_path):
    g = xinsitu.open_zarr(era5_path).insitu.geometry
    t = g.variables["t2m"]
    assert t.dims == ("time", "lat", "lon") and t.shape == (NT, NY, NX)
    assert t.chunks == (CT, NY, NX) and t.shards is None
    assert t.dtype == "float32" and "zstd" in t.codecs
    assert t.chunk_nbytes == CT * NY * NX * 4
    assert t.nchunks == -(-NT // CT)
    assert g.variables["tp"].dtype == "int16"
    assert g.variables["lsm"].dims == ("lat", "lon")
    assert g.dims == {"time": CT, "lat": NY, "lon": NX}
    assert "t2m" in repr(g) and "<table" in g._repr_html_()


def test_chunks_property_ignores_coords(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    assert ds.insitu.chunks == {"time": CT, "lat": NY, "lon": NX}
    assert ds.isel(time=slice(3, 50)).insitu.geometry.variables["t2m"].nchunks == 7  # 3..49 touches chunks 0..6


def test_geometry_reads_no_data(era5_path, tmp_path):
    """Delete every chunk object: geometry (and a split) still work, since they read metadata only."""
    bare = tmp_path / "bare.zarr"
    shutil.copytree(era5_path, bare)
    for var in ["t2m", "u10", "v10", "z500", "tp", "lsm"]:
        shutil.rmtree(bare / var / "c")
    assert not any((bare / "t2m").glob("c/**/*"))
    ds = xinsitu.open_zarr(str(bare))
    assert ds.insitu.geometry.variables["t2m"].nchunks == -(-NT // CT)
    ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    assert os.path.exists(bare / "t2m" / "zarr.json")


def test_sharded_geometry(tmp_path):
    from xinsitu.synthetic import write_era5_like

    path = tmp_path / "sharded.zarr"
    write_era5_like(path, nt=48, ny=4, nx=6, chunk_time=2, shard_time=12)
    g = xinsitu.open_zarr(str(path)).insitu.geometry
    assert g.variables["t2m"].chunks == (2, 4, 6)  # inner chunk: the smallest unit read
    assert g.variables["t2m"].shards == (12, 4, 6)
    assert g.dims["time"] == 2


def test_unmappable_dataset_errors(era5_path):
    ds = xr.open_zarr(era5_path)
    computed = ds.assign(t2m=ds.t2m * 2)
    with pytest.raises(ValueError, match="computed lazily by dask"):
        _ = computed.insitu.geometry


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_scalar_data_variable_is_no_obstacle(tmp_path, zarr_format):
    """A 0-d data variable (a CF ``crs`` grid mapping, ``rotated_pole``) beside the fields: geometry, split and
    batches work, as on xarray (its empty dim list was taken for none: 'has no dimension names')."""
    ds = xr.Dataset({"t2m": (("time", "y"), np.random.default_rng(0).random((8, 3)).astype("f4"),
                             {"grid_mapping": "crs"}),
                     "crs": ((), np.int32(0), {"grid_mapping_name": "latitude_longitude"})},
                    coords={"time": np.arange(8), "y": np.arange(3)})
    path = str(tmp_path / "scalar.zarr")
    ds.to_zarr(path, zarr_format=zarr_format, encoding={"t2m": {"chunks": (2, 3)}})
    for d in (xr.open_zarr(path), xinsitu.open_zarr(path)):
        assert d.insitu.geometry.variables["crs"].shape == ()
        m = d.insitu.split("time", fractions={"train": 1.0})
        b = next(iter(d.insitu.batches(m, "train", batch_size=8, shuffle=False, output="numpy")))
        assert list(b) == ["t2m"]
        np.testing.assert_array_equal(b["t2m"], d.t2m.values)


def test_a_variable_xarray_cached_makes_no_edges_beside_stored_ones(era5_path):
    """Any ``.values`` or ``.mean()`` caches a lazily opened variable in memory, where its grid is only its
    encoded chunks counted from its first position: after a selection that starts mid-chunk, that grid
    shared no edge with the stored variables' and the split was refused ("held in one chunk"). Stored
    variables make the edges now; the batches equal xarray's."""
    lazy = xinsitu.open_zarr(era5_path).isel(time=slice(3, None))
    ds = xinsitu.open_zarr(era5_path)
    float(ds.t2m.mean())  # (cached in memory: its lazy chain is gone)
    ds = ds.isel(time=slice(3, None))
    edges = ds.insitu.geometry.edges["time"]
    assert edges.tolist() == lazy.insitu.geometry.edges["time"].tolist() and edges[1] == CT - 3
    m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
    gen = ds.insitu.batches(m, "val", batch_size=5, shuffle=False, output="numpy")
    got = np.concatenate([b["t2m"] for b in gen])
    np.testing.assert_array_equal(got, ds.t2m.isel(time=m.indices("val")["time"]).values)
