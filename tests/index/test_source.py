"""Mapping a Dataset's variables back to where their values live (``xinsitu.index.source``): Zarr v2 and
v3 stores (with selections), memory, dask over memory, and the refusals that name the fix."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import xarray as xr

import xinsitu
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


def test_dask_over_zarr_relabelled_then_subset_reads_what_xarray_gives(store):
    """Relabelled (labels shifted one step: each is a label of the store too), then subset: mapped by its labels
    the batches read the next positions, silently (it was refused since). The positions come from the dask graph
    now, not the labels: the batches hold what xarray gives, as without dask."""
    import xinsitu

    ds = xr.open_zarr(store)
    shifted = ds.assign_coords(time=ds.time.values + 1).isel(time=slice(2, 10))
    np.testing.assert_array_equal(resolve(shifted, ["t2m"])["t2m"].index[0], np.arange(2, 10))
    for opened in (ds, xr.open_zarr(store, chunks=None), xinsitu.open_zarr(store)):
        ok = opened.assign_coords(time=opened.time.values + 1).isel(time=slice(2, 10))
        m = ok.insitu.split("time", fractions={"train": 1.0})
        got = np.concatenate([b["t2m"] for b in ok.insitu.batches(m, "train", output="numpy", shuffle=False)])
        np.testing.assert_array_equal(got, ok.t2m.values)


def test_renamed_dims_read_in_place_and_other_views_are_named(store, tmp_path):
    """``ds.rename({"time": "valid_time"})`` reads the stored axes under the new names, as xarray gives them
    (it was refused as a "transposed view", and with dask as a rename). A transposed view is named as such (it
    was called vectorised indexing), and a dask-backed subset of a store whose coordinate holds a label twice
    reads its positions (it was refused: the labels could not say which)."""
    import xinsitu

    for opened in (xr.open_zarr(store), xr.open_zarr(store, chunks=None), xinsitu.open_zarr(store)):
        ren = opened.rename({"time": "valid_time"})
        m = ren.insitu.split("valid_time", fractions={"train": 0.5, "val": 0.5}, block={"valid_time": 2})
        got = np.concatenate([b["t2m"] for b in ren.insitu.batches(m, "val", output="numpy", shuffle=False)])
        np.testing.assert_array_equal(got, ren.t2m.values[6:])
    with pytest.raises(SourceError, match="transposed view"):
        resolve(xr.open_zarr(store, chunks=None).transpose("x", "time"), ["t2m"])
    with pytest.raises(SourceError, match="transposed views are not supported"):  # (was: "computed lazily by dask")
        resolve(xr.open_zarr(store).transpose("x", "time"), ["t2m"])
    dup = str(tmp_path / "dup.zarr")
    t = np.arange(12)
    t[5] = 4
    xr.Dataset({"a": (("time", "x"), np.zeros((12, 2)))}, coords={"time": t}).to_zarr(
        dup, encoding={"a": {"chunks": (4, 2)}})
    for chunks in ({}, None):
        got = resolve(xr.open_zarr(dup, chunks=chunks).isel(time=slice(2, 10)), ["a"])["a"]
        np.testing.assert_array_equal(got.index[0], np.arange(2, 10))


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
    """The user opened with consolidated=False: mapping a dask-backed selection back to the store (once by
    reopening it for its coordinates, now by its dask graph) gives no "Failed to open Zarr store with
    consolidated metadata" warning."""
    path = str(tmp_path / "u.zarr")
    _ds().to_zarr(path, zarr_format=fmt, consolidated=False, encoding={"t2m": {"chunks": (5, 4)}})
    ds = xr.open_zarr(path, consolidated=False).sel(time=[2, 9])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        t = resolve(ds, ["t2m"])["t2m"]
    np.testing.assert_array_equal(t.index[0], [2, 9])
    assert [str(w.message)[:60] for w in said if "consolidated" in str(w.message)] == []


# ----------------------------------------------------------------------------- dask graphs: positions, not labels
def _grid(seed: int = 0, t0: str = "2000-01-01") -> xr.Dataset:
    """``img`` over dims without a coordinate (y, x), ``t2m`` over a labelled lon, ``tp`` packed as int16 with a
    scale factor, ``lsm`` static: what the audit of dask-backed Datasets found wrong values and words for."""
    rng = np.random.default_rng(seed)
    return xr.Dataset(
        {"img": (("time", "y", "x"), rng.standard_normal((8, 4, 3)).astype("f4")),
         "t2m": (("time", "lon"), rng.standard_normal((8, 10)).astype("f4")),
         "tp": (("time", "lon"), rng.random((8, 10))),
         "lsm": (("lat", "lon"), rng.random((6, 10)).astype("f4"))},
        coords={"time": np.datetime64(t0, "ns") + np.arange(8) * np.timedelta64(6, "h"),
                "lon": np.arange(10) * 36.0, "lat": np.linspace(75, -75, 6)})


_GRID_ENC = {"img": {"chunks": (2, 4, 3)}, "t2m": {"chunks": (2, 5)}, "lsm": {"chunks": (3, 5)},
             "tp": {"chunks": (2, 5), "dtype": "int16", "scale_factor": 0.01, "_FillValue": -32767}}


@pytest.fixture(scope="module", params=[2, 3])
def grids(request, tmp_path_factory):
    """Two archives written by ``to_zarr`` in zarr format 2 or 3, the second following the first in time."""
    root = tmp_path_factory.mktemp(f"grid{request.param}")
    paths = [str(root / "a.zarr"), str(root / "b.zarr")]
    _grid().to_zarr(paths[0], zarr_format=request.param, encoding=_GRID_ENC)
    _grid(1, "2000-01-03").to_zarr(paths[1], zarr_format=request.param, encoding=_GRID_ENC)
    return paths


def _same_as_xarray(ds: xr.Dataset, dim: str = "time") -> None:
    """Every batch (numpy and xarray output) and ``sample`` holds what plain xarray gives, bit for bit."""
    m = ds.insitu.split(dim, fractions={"train": 1.0})
    for output in ("numpy", "xarray"):
        gen = ds.insitu.batches(m, "train", batch_size=3, shuffle=False, output=output,
                                variables=list(ds.data_vars))
        got = list(gen)
        for v in ds.data_vars:
            want = ds[v].values
            if dim in ds[v].dims:
                want = np.moveaxis(want, ds[v].dims.index(dim), 0)
                have = np.concatenate([np.asarray(b[v]) for b in got])
                np.testing.assert_array_equal(np.asarray(gen.sample(2)[v]).squeeze(), want[2].squeeze(), err_msg=v)
            elif output == "xarray":
                have = got[0][v].values
            else:
                continue
            assert have.dtype == want.dtype, v
            np.testing.assert_array_equal(have, want, err_msg=v)


def test_dask_reordered_dims_without_a_coordinate_read_what_xarray_gives(grids):
    """A dim without a coordinate, reversed or permuted on a dask-backed Dataset, gave the archive's stored order
    (full length, no labels: taken for untouched). Its positions come from the dask graph now."""
    import xinsitu

    p = grids[0]
    for ds in (xr.open_zarr(p).isel(y=slice(None, None, -1)), xr.open_zarr(p).isel(x=[2, 0, 1]),
               xinsitu.open_zarr(p).isel(y=slice(None, None, -1)).chunk({"time": 2}),
               xinsitu.open_zarr(p).isel(x=[2, 0, 1]).chunk({"time": 4, "y": 3}),
               xr.open_zarr(p).drop_vars("time").isel(time=slice(None, None, -1)),
               xr.open_zarr(p).drop_vars("lon").isel(lon=slice(None, None, -1), y=[3, 1])):
        _same_as_xarray(ds)
    t = resolve(xr.open_zarr(p).isel(y=slice(None, None, -1), x=[2, 0, 1]), ["img"])["img"]
    np.testing.assert_array_equal(t.index[1], [3, 2, 1, 0])
    np.testing.assert_array_equal(t.index[2], [2, 0, 1])


def test_dask_roll_and_replaced_data_read_what_xarray_gives(grids):
    """``roll`` (coordinates left in place, xarray's default) and ``copy(data=...)`` move values, not labels: mapped
    back by the labels, the batches held the un-rolled values. Also over ``xr.open_mfdataset`` of Zarr stores (its
    static variable comes from one store). A graph that is not one orthogonal selection is refused, never guessed."""
    import dask.array as da

    import xinsitu

    a, b = grids
    rev = xr.open_zarr(a)
    rev["t2m"] = rev.t2m.copy(data=rev.t2m.data[:, ::-1])
    mf = xr.open_mfdataset([a, b], engine="zarr", combine="nested", concat_dim="time", data_vars="minimal",
                           coords="minimal", compat="override")
    for ds in (xr.open_zarr(a).roll(lon=3), xr.open_zarr(a).roll(time=3, lon=-4, y=1),
               xinsitu.open_zarr(a).chunk({"time": 2}).roll(time=1), rev, mf.roll(lat=2), mf.roll(lon=3)):
        _same_as_xarray(ds)
    mixed = xr.open_zarr(a)[["t2m"]]
    d = mixed.t2m.data
    mixed["t2m"] = mixed.t2m.copy(data=da.concatenate([d[:4, ::-1], d[4:]]))  # reversed for half the times only
    with pytest.raises(SourceError, match=r"'t2m': its dask graph does more than select .* chunks=None or "
                                          r"xinsitu.open_zarr .* \.load\(\)"):
        resolve(mixed, ["t2m"])


def test_dask_astype_is_refused_naming_astype_and_batches_dtype(grids):
    """``xr.open_zarr(p).astype(...)`` was refused as if the store's CF encoding were odd. It names the cast now
    and the ways out; the dtype asked of the batches gives xarray's cast values bit for bit."""
    p = grids[0]
    for ds, name in ((xr.open_zarr(p).astype("float32"), "tp"), (xr.open_zarr(p)[["t2m"]].astype("float64"), "t2m")):
        with pytest.raises(SourceError, match=rf"{name!r} is cast by dask .*astype.*batches\(\.\.\., dtype=\.\.\.\)"
                                              r".*chunks=None"):
            resolve(ds, [name])
    want = xr.open_zarr(p).tp.astype("float32").values
    ds = xr.open_zarr(p)[["tp"]]
    m = ds.insitu.split("time", fractions={"train": 1.0})
    got = np.concatenate([b["tp"] for b in ds.insitu.batches(m, "train", output="numpy", shuffle=False,
                                                              dtype="float32")])
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    _same_as_xarray(xr.open_zarr(p)[["t2m", "img"]].astype("float32"))  # a cast to the dtype it has is no cast


def test_dask_casts_replaced_data_and_shared_names_are_never_read_wrong(grids, tmp_path):
    """Three ways a dask-backed variable read other values than xarray gives, silently: a lossy cast round trip
    (``astype("int32").astype("float32")``: the final dtype is the stored one), another variable's data under
    this one's CF encoding (``a.copy(data=c.data)``: read from ``c``, decoded with ``a``'s scale), and two
    selections chunked under one dask name (``chunk(token=...)``) served the first one's positions. The first two
    are refused naming the way out; the third reads what xarray gives."""
    with pytest.raises(SourceError, match=r"'t2m': .*a cast from float32 to int32 \(\.astype\).*chunks=None"):
        resolve(xr.open_zarr(grids[0])[["t2m"]].astype("int32").astype("float32"), ["t2m"])
    p = str(tmp_path / "packed.zarr")
    raw = np.arange(48, dtype="f4").reshape(12, 4)
    xr.Dataset({"a": (("time", "x"), raw * 0.5), "c": (("time", "x"), raw * 0.25 + 100)}).to_zarr(p, encoding={
        "a": {"chunks": (4, 4), "dtype": "i2", "scale_factor": 0.5},
        "c": {"chunks": (4, 4), "dtype": "i2", "scale_factor": 0.25, "add_offset": 100.0}})
    ds = xr.open_zarr(p)
    ds["a"] = ds.a.copy(data=ds.c.data)
    with pytest.raises(SourceError, match=r"'a': .*reads the stored array 'c', but its encoding's scale_factor=0.5 "
                                          r"is not the stored array's \(0.25\).*copy\(data=\.\.\.\)"):
        resolve(ds, ["a"])
    p = str(tmp_path / "plain.zarr")
    xr.Dataset({"a": (("time", "y", "x"), np.arange(120, dtype="f4").reshape(6, 4, 5))}).to_zarr(
        p, encoding={"a": {"chunks": (2, 2, 5)}})
    lazy, whole = xr.open_zarr(p, chunks=None), {"time": -1, "y": -1, "x": -1}
    first = lazy.isel(time=[1, 2], y=[3]).chunk(whole, token="T")
    other = lazy.isel(time=[1], y=[2, 3]).chunk(whole, token="T")
    assert first.a.data.name == other.a.data.name
    resolve(first)
    np.testing.assert_array_equal(resolve(other)["a"].index[1], [2, 3])
    m = other.insitu.split("y", fractions={"train": 1.0})
    got = np.concatenate([b["a"] for b in other.insitu.batches(m, "train", output="numpy", shuffle=False)])
    np.testing.assert_array_equal(got, np.moveaxis(other.a.values, 1, 0))


def test_dask_refusals_name_what_was_done(grids):
    """``decode_times=False`` was mapped back by labels the store's default decoding did not have ("labels are not
    in the store's coordinate"): it reads now. ``expand_dims`` and ``resample().mean()`` were called transposed
    views; each is named for what it is."""
    p = grids[0]
    _same_as_xarray(xr.open_zarr(p, decode_times=False).isel(time=slice(2, 6)))
    with pytest.raises(SourceError, match=r"'img': dim\(s\) \['member'\] are not in the stored array .*expand_dims"):
        resolve(xr.open_zarr(p).expand_dims("member"), ["img"])
    with pytest.raises(SourceError) as said:
        resolve(xr.open_zarr(p).resample(time="12h").mean(), ["img", "lsm"])
    assert "transposed" not in str(said.value) and ("computed lazily" in str(said.value)
                                                     or "not in the stored array" in str(said.value))


def test_a_rectilinear_chunk_grid_is_refused_naming_the_variable(tmp_path):
    """zarr >= 3.4 writes chunk grids of varying sizes along a dim (``array.rectilinear_chunks``); xarray
    reads them, and xinsitu refuses one with a ``SourceError`` naming the variable and what to do (was
    zarr's bare ``NotImplementedError`` from ``.chunks``, naming nothing)."""
    import zarr

    path = str(tmp_path / "r.zarr")
    with zarr.config.set({"array.rectilinear_chunks": True}):
        try:
            g = zarr.open_group(path, mode="w", zarr_format=3)
            a = g.create_array("v", shape=(20, 4), dtype="f4", chunks=[[3, 7, 2, 8], [4]],
                               dimension_names=["time", "x"])
        except (TypeError, ValueError, KeyError) as e:  # a zarr without rectilinear grids (< 3.4)
            pytest.skip(f"this zarr ({zarr.__version__}) writes no rectilinear chunk grid: {e}")
        a[:] = np.arange(80, dtype="f4").reshape(20, 4)
        for ds in (xinsitu.open_zarr(path), xr.open_zarr(path, consolidated=False)):
            with pytest.raises(SourceError, match="variable 'v' is stored on a rectilinear chunk grid"):
                print(ds.insitu.geometry)
        loaded = xinsitu.open_zarr(path)[["v"]].load()  # what the message offers: its chunks are the grid's
        m = loaded.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
        got = np.concatenate([b["v"] for b in loaded.insitu.batches(m, "train", output="numpy", shuffle=False)])
        np.testing.assert_array_equal(got, loaded.v.values[:len(got)])
        assert len(got) in (3, 10, 12)  # whole chunks of the grid


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_an_integer_with_time_like_units_and_a_fill_is_read_as_xarray_reads_it(tmp_path, zarr_format):
    """An int32 lead time in ``units: hours`` with a ``_FillValue``, opened with default options: xarray keeps
    ``units`` as an attribute (no time deltas) and masks it as an integer (int64, the fill the smallest
    int64), not as a float with NaN. Its batches equal xarray's, whichever way it is opened (was refused:
    the decoding re-applied without the units gave float64)."""
    path = str(tmp_path / "lead.zarr")
    xr.Dataset({"lead": (("time",), np.array([0, -1, 2, 3, 4, 5, -1, 7], dtype="i4"), {"units": "hours"})}).to_zarr(
        path, zarr_format=zarr_format, consolidated=False, encoding={"lead": {"_FillValue": -1, "chunks": (2,)}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # xarray's, on the units of a time delta it does not decode
        want = xr.open_zarr(path, consolidated=False).lead.values
        for ds in (xinsitu.open_zarr(path), xr.open_zarr(path, consolidated=False),
                   xr.open_dataset(path, engine="zarr", chunks=None, consolidated=False)):
            m = ds.insitu.split("time", fractions={"train": 1.0})
            got = np.concatenate([b["lead"] for b in ds.insitu.batches(m, "train", output="numpy", shuffle=False,
                                                                         batch_size=3)])
            assert got.dtype == want.dtype == np.int64 and np.array_equal(got, want), (got, want)
    # opened with decode_times=False, xarray masks it as a float with NaN (what its lazy chain says it does;
    # the units alone said integers, and the variable was refused)
    for ds in (xr.open_zarr(path, consolidated=False, decode_times=False),
               xinsitu.open_zarr(path, decode_times=False)):
        want = ds.lead.values
        m = ds.insitu.split("time", fractions={"train": 1.0})
        got = np.concatenate([b["lead"] for b in ds.insitu.batches(m, "train", output="numpy", shuffle=False,
                                                                     batch_size=3)])
        assert got.dtype == want.dtype == np.float64 and np.array_equal(got, want, equal_nan=True), (got, want)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_an_encoding_dropped_or_edited_since_the_open_is_refused(tmp_path, zarr_format):
    """xinsitu decodes the stored chunks as a variable's encoding says; xarray decodes them lazily as the open
    found them. After ``ds.drop_encoding()`` (or an edited ``_FillValue`` / ``scale_factor``), the Dataset
    still shows decoded values while the batches held the stored ones (-9999. where xarray gives NaN, a scale
    twice too big). Refused now, naming the variable and what xarray applies, on every opener; the Dataset as
    opened reads what xarray gives."""
    p = str(tmp_path / "cf.zarr")
    raw = np.arange(48, dtype="f4").reshape(12, 4)
    raw[0, 0] = np.nan
    xr.Dataset({"f": (("time", "x"), raw), "p": (("time", "x"), raw * 0.5)}).to_zarr(
        p, zarr_format=zarr_format, encoding={"f": {"chunks": (4, 4), "_FillValue": np.float32(-9999.0)},
                                             "p": {"chunks": (4, 4), "dtype": "i2", "scale_factor": 0.5,
                                                   "_FillValue": -1}})
    openers = (lambda: xinsitu.open_zarr(p), lambda: xr.open_zarr(p, chunks=None), lambda: xr.open_zarr(p))
    for open_ in openers:
        _same_as_xarray(open_())
        ds = open_().drop_encoding()
        with pytest.raises(SourceError, match=r"'f': xarray decodes its stored values with fill values \[-9999.0\] "
                                              r"\(its encoding: None\).*drop_encoding"):
            resolve(ds, ["f"])
        with pytest.raises(SourceError, match=r"'p': xarray decodes .*scale_factor, add_offset \(0.5, None\) "
                                              r"\(its encoding: None\); fill values \[-1\]"):
            resolve(ds, ["p"])
        ds = open_()
        ds.f.encoding["_FillValue"] = np.float32(0)
        with pytest.raises(SourceError, match=r"'f': .*fill values \[-9999.0\] \(its encoding: \[0.0\]\)"):
            resolve(ds, ["f"])
    ds = xinsitu.open_zarr(p)
    ds.p.encoding["scale_factor"] = 0.25
    with pytest.raises(SourceError, match=r"'p': .*add_offset \(0.5, None\) \(its encoding: \(0.25, None\)"):
        resolve(ds, ["p"])
