"""Mapping a Dataset's variables back to where their values live (``xinsitu.index.source``): Zarr v2 and
v3 stores (with selections), memory, dask over memory, and the refusals that name the fix."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import xarray as xr

from xinsitu.index.source import DaskBlocks, SourceError, VarSource, resolve


def _ds() -> xr.Dataset:
    t = np.arange(12, dtype="f4").reshape(12, 1) * 100 + np.arange(8, dtype="f4")
    return xr.Dataset({"t2m": (("time", "x"), t), "lsm": (("x",), np.arange(8, dtype="i2"))},
                      coords={"time": np.arange(12), "x": np.arange(8) * 0.5})


@pytest.fixture(scope="module", params=[2, 3])
def store(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"v{request.param}") / "s.zarr")
    _ds().to_zarr(path, zarr_format=request.param, encoding={"t2m": {"chunks": (5, 4)}, "lsm": {"chunks": (3,)}})
    return path


def test_stored_variables_map_to_their_array_and_chunks(store):
    ds = xr.open_zarr(store, chunks=None)
    src = resolve(ds)
    assert set(src) == {"t2m", "lsm"}
    t = src["t2m"]
    assert isinstance(t, VarSource) and t.stored
    assert t.chunk_shape == (5, 4) and t.src_dims == ("time", "x") and t.shape == (12, 8)
    assert t.dtype == np.float32 and t.values is None
    np.testing.assert_array_equal(t.chunk_ids("time"), np.arange(12) // 5)


def test_a_selection_keeps_positions_in_the_store(store):
    ds = xr.open_zarr(store, chunks=None).isel(time=slice(3, 11, 2), x=[7, 1])
    t = resolve(ds, ["t2m"])["t2m"]
    np.testing.assert_array_equal(t.index[0], [3, 5, 7, 9])
    np.testing.assert_array_equal(t.index[1], [7, 1])
    np.testing.assert_array_equal(t.chunk_ids("time"), [0, 1, 1, 1])
    np.testing.assert_array_equal(t.chunk_ids("x"), [1, 0])


def test_a_scalar_selection_drops_the_dim_and_keeps_its_position(store):
    ds = xr.open_zarr(store, chunks=None).isel(time=6)
    t = resolve(ds, ["t2m"])["t2m"]
    assert t.dims == ("x",) and t.src_dims == ("time", "x") and t.index[0] == 6


def test_dask_over_zarr_maps_back_through_the_coordinates(store):
    ds = xr.open_zarr(store).sel(time=[2, 9])  # dask-backed: positions come from the labels
    t = resolve(ds, ["t2m"])["t2m"]
    assert t.stored
    np.testing.assert_array_equal(t.index[0], [2, 9])


def test_dask_over_zarr_relabelled_reads_the_values_it_holds(store):
    """``assign_coords`` relabels without moving data: the whole stored array is what the Dataset holds,
    whatever its labels (mapped by its reversed labels, the reads came from the other end)."""
    ds = xr.open_zarr(store)
    relabelled = ds.assign_coords(time=ds.time.values[::-1].copy())
    t = resolve(relabelled, ["t2m"])["t2m"]
    np.testing.assert_array_equal(t.index[0], np.arange(12))
    m = relabelled.insitu.split("time", fractions={"train": 0.5, "val": 0.5}, block={"time": 2})
    got = np.concatenate([b["t2m"] for b in relabelled.insitu.batches(m, "train", output="numpy", shuffle=False)])
    np.testing.assert_array_equal(got, relabelled.t2m.values[:6])


def test_dask_over_zarr_relabelled_then_subset_is_refused_naming_the_fix(store):
    """Relabelled (labels shifted one step: each is a label of the store too), then subset: the labels no
    longer say which stored positions the selection holds, and mapped by them the batches read the next
    positions, silently. Refused, naming chunks=None and xinsitu.open_zarr, which follow positions (and
    give what xarray gives)."""
    import xinsitu

    ds = xr.open_zarr(store)
    shifted = ds.assign_coords(time=ds.time.values + 1).isel(time=slice(2, 10))
    with pytest.raises(SourceError, match=r"coordinate 'time' was assigned after .* chunks=None or xinsitu.open_zarr"):
        resolve(shifted, ["t2m"])
    for opened in (xr.open_zarr(store, chunks=None), xinsitu.open_zarr(store)):
        ok = opened.assign_coords(time=opened.time.values + 1).isel(time=slice(2, 10))
        m = ok.insitu.split("time", fractions={"train": 1.0})
        got = np.concatenate([b["t2m"] for b in ok.insitu.batches(m, "train", output="numpy", shuffle=False)])
        np.testing.assert_array_equal(got, ok.t2m.values)
    kept = ds.isel(time=slice(2, 10))  # a subset of the stored labels maps as before
    np.testing.assert_array_equal(resolve(kept, ["t2m"])["t2m"].index[0], np.arange(2, 10))


def test_renamed_dims_read_in_place_and_other_views_are_named(store, tmp_path):
    """``ds.rename({"time": "valid_time"})`` opened without dask reads the stored axes under the new names,
    as xarray gives them (it was refused as a "transposed view"); with dask it is refused, naming a rename.
    A transposed view is named as such (it was called vectorised indexing), and a store whose coordinate
    holds a label twice refuses a dask-backed subset naming the duplicate (pandas raised
    ``InvalidIndexError``)."""
    import xinsitu

    for opened in (xr.open_zarr(store, chunks=None), xinsitu.open_zarr(store)):
        ren = opened.rename({"time": "valid_time"})
        m = ren.insitu.split("valid_time", fractions={"train": 0.5, "val": 0.5}, block={"valid_time": 2})
        got = np.concatenate([b["t2m"] for b in ren.insitu.batches(m, "val", output="numpy", shuffle=False)])
        np.testing.assert_array_equal(got, ren.t2m.values[6:])
    with pytest.raises(SourceError, match=r"renamed, ds.rename"):
        resolve(xr.open_zarr(store).rename({"time": "valid_time"}), ["t2m"])
    with pytest.raises(SourceError, match="transposed view"):
        resolve(xr.open_zarr(store, chunks=None).transpose("x", "time"), ["t2m"])
    dup = str(tmp_path / "dup.zarr")
    t = np.arange(12)
    t[5] = 4
    xr.Dataset({"a": (("time", "x"), np.zeros((12, 2)))}, coords={"time": t}).to_zarr(
        dup, encoding={"a": {"chunks": (4, 2)}})
    with pytest.raises(SourceError, match="holds a label twice"):
        resolve(xr.open_zarr(dup).isel(time=slice(2, 10)), ["a"])
    assert isinstance(resolve(xr.open_zarr(dup, chunks=None).isel(time=slice(2, 10)), ["a"])["a"], VarSource)


def test_in_memory_and_dask_over_memory_keep_their_chunks():
    ds = _ds()
    mem = resolve(ds, ["t2m"])["t2m"]
    assert not mem.stored and mem.mem_chunks == ((1,) * 12, (1,) * 8)  # no chunks known: one per position
    np.testing.assert_array_equal(mem.chunk_ids("time"), np.arange(12))
    enc = _ds()
    enc.t2m.encoding["chunks"] = (5, 8)  # e.g. read from a store, then loaded
    assert resolve(enc, ["t2m"])["t2m"].mem_chunks == ((5, 5, 2), (8,))
    chunked = resolve(ds.chunk({"time": 5}), ["t2m"])["t2m"]
    assert isinstance(chunked.values, np.ndarray) and chunked.mem_chunks == ((5, 5, 2), (8,))
    np.testing.assert_array_equal(chunked.values, ds.t2m.values)
    np.testing.assert_array_equal(chunked.chunk_ids("time"), [0] * 5 + [1] * 5 + [2] * 2)


def test_dask_blocks_compute_only_what_is_asked(tmp_path):
    path = str(tmp_path / "f.nc")
    _ds().to_netcdf(path)
    ds = xr.open_dataset(path, chunks={"time": 4})
    t = resolve(ds, ["t2m"])["t2m"]
    assert isinstance(t.values, DaskBlocks) and "f.nc" in t.values.where
    np.testing.assert_array_equal(t.values[5:7, 2:4], _ds().t2m.values[5:7, 2:4])


def test_refusals_name_the_variable_and_the_fix(store):
    ds = xr.open_zarr(store)
    with pytest.raises(ValueError, match=r"unknown variable\(s\) \['nope'\]"):
        resolve(ds, ["nope"])
    with pytest.raises(ValueError, match="no data variables"):
        resolve(xr.Dataset())
    with pytest.raises(SourceError, match=r"'t2m' is computed lazily by dask.*isel/sel"):
        resolve(ds * 2, ["t2m"])
    pts = xr.DataArray([1, 2], dims="p")
    with pytest.raises(SourceError, match=r"vectorised \(pointwise\) selection .* orthogonal selections"):
        resolve(xr.open_zarr(store, chunks=None).isel(time=pts, x=pts), ["t2m"])


@pytest.mark.parametrize("fmt", [2, 3])
def test_the_reopen_of_a_dask_selection_says_nothing_about_consolidated_metadata(tmp_path, fmt):
    """The user opened with consolidated=False: xinsitu's own reopen (the coordinates of a dask-backed
    selection) gives no "Failed to open Zarr store with consolidated metadata" warning."""
    path = str(tmp_path / "u.zarr")
    _ds().to_zarr(path, zarr_format=fmt, consolidated=False, encoding={"t2m": {"chunks": (5, 4)}})
    ds = xr.open_zarr(path, consolidated=False).sel(time=[2, 9])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        t = resolve(ds, ["t2m"])["t2m"]
    np.testing.assert_array_equal(t.index[0], [2, 9])
    assert [str(w.message)[:60] for w in said if "consolidated" in str(w.message)] == []
