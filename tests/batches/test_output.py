"""xinsitu.batches.output.OutputBuilder: CF decoding as xarray does it, stacking, dtypes and dims."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr

import xinsitu
from xinsitu.batches.output import OutputBuilder

NT = 12


@pytest.fixture
def path(tmp_path) -> str:
    rng = np.random.default_rng(3)
    p = rng.uniform(0, 10, (NT, 2, 3))
    p[0, 0, 0] = np.nan  # written as _FillValue
    ds = xr.Dataset(
        {"a": (("time", "y", "x"), rng.standard_normal((NT, 2, 3)).astype("float32")),
         "b": (("time", "y", "x"), rng.standard_normal((NT, 2, 3))),
         "p": (("time", "y", "x"), p),
         "s": (("y", "x"), np.arange(6, dtype="float32").reshape(2, 3))},
        coords={"time": pd.date_range("2002-01-01", periods=NT, freq="D"), "y": [10.0, 20.0], "x": [1, 2, 3]})
    out = str(tmp_path / "o.zarr")
    ds.to_zarr(out, zarr_format=3, consolidated=False, encoding={
        "a": {"chunks": (4, 2, 3)}, "b": {"chunks": (4, 2, 3)},
        "p": {"chunks": (4, 2, 3), "dtype": "int16", "scale_factor": 0.01, "add_offset": 5.0, "_FillValue": -32768}})
    return out


def _builder(path, variables, output="numpy", stack=False, **kw):
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", batch_size=4, variables=variables, output="numpy")
    return ds, OutputBuilder(ds, gen.space, gen.layouts, output, stack, **kw)


def test_cf_decode_equals_xarray(path):
    ds, b = _builder(path, ["p"])
    raw = zarr.open_array(path, path="p")[...]
    assert raw.dtype == np.dtype("int16")
    got = b.decode({"p": raw})["p"]
    exp = xr.open_zarr(path, chunks=None).p.values
    assert got.dtype == exp.dtype
    assert np.isnan(got[0, 0, 0])
    np.testing.assert_array_equal(got, exp)  # NaN where NaN, bit for bit elsewhere


def test_stacked_channel_order_and_dtype(path):
    ds, b = _builder(path, ["b", "a"], stack=True)
    assert [c.name for c in b.channels] == list(b.layouts) == ["b", "a"]
    assert b.dtype == np.dtype("float64")  # float32 and float64 stack as float64
    va = ds.a.values[:4].astype("float32")
    vb = ds.b.values[:4]
    arr = b.stacked({"b": vb, "a": va})
    assert arr.shape == (4, 2, 2, 3) and arr.dtype == np.dtype("float64")
    np.testing.assert_array_equal(arr[:, 0], vb)
    np.testing.assert_array_equal(arr[:, 1], va.astype("float64"))


def test_stacked_broadcasts_static_variable(path):
    ds, b = _builder(path, ["a", "s"], stack=True)
    assert b.dtype == np.dtype("float32")
    va = ds.a.values[:3]
    vs = ds.s.values
    arr = b.stacked({"a": va, "s": vs})
    assert arr.shape == (3, 2, 2, 3)
    np.testing.assert_array_equal(arr[:, 0], va)
    for k in range(3):
        np.testing.assert_array_equal(arr[k, 1], vs)


def test_dims_of(path):
    _, b = _builder(path, ["a", "s"])
    assert b.dims_of("a") == ("sample", "y", "x")
    assert b.dims_of("s") == ("y", "x")
    _, w = _builder(path, ["a"])
    assert not w.stack and w.channels == []


def test_build_xarray_equals_isel(path):
    ds, b = _builder(path, ["a", "p", "s"], output="xarray")
    starts = np.array([[7], [2], [2], [11]])
    idx = starts[:, 0]
    raw = {n: zarr.open_array(path, path=n)[...] for n in ("a", "p")}
    batch = b.build({"a": raw["a"][idx], "p": raw["p"][idx], "s": ds.s.values}, starts)
    ref = xr.open_zarr(path, chunks=None)[["a", "p", "s"]].isel(time=xr.DataArray(idx, dims="sample"))
    xr.testing.assert_identical(batch, ref.transpose("sample", ...).load())


@pytest.mark.parametrize("variables", [["cnt"], ["z"], ["cnt", "z"]])
def test_xarray_batch_keeps_the_coordinates_of_the_selected_variables(variables):
    """output="xarray" with variables=: the dims and coordinates ds[variables] keeps, as xarray gives them
    (a batch of cnt(time) carried level, lat and area of another variable: 24 rows in to_dataframe)."""
    nt = 8
    ds = xr.Dataset({"cnt": (("time",), np.arange(nt, dtype="float32")),
                     "z": (("time", "level", "lat"), np.zeros((nt, 2, 3), "float32"))},
                    coords={"time": np.arange(nt), "level": [500, 850], "lat": [10.0, 20.0, 30.0],
                            "area": (("lat",), [1.0, 2.0, 3.0])}).chunk({"time": 2})
    m = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", batch_size=4, shuffle=False, output="xarray", variables=variables)
    want = ds[variables].isel(time=range(4))
    got = next(iter(gen))
    assert dict(got.sizes) == {"sample" if d == "time" else d: n for d, n in want.sizes.items()}
    assert set(got.coords) == set(want.coords)
    assert set(gen.sample(0).coords) == set(ds[variables].isel(time=0).coords)


def test_bad_arguments(path):
    with pytest.raises(ValueError, match="output must be one of"):
        _builder(path, ["a"], output="pandas")
    with pytest.raises(TypeError, match="transform"):
        _builder(path, ["a"], transform=3)
    with pytest.raises(ValueError, match="device="):
        _builder(path, ["a"], output="numpy", device="cpu")


def test_dtype_names_a_text_variable_it_cannot_cast(tmp_path):
    """``dtype='float32'`` with a variable of strings: refused when the generator is made, naming the
    variable and ``dtype`` (numpy's "could not convert string to float" came at the first batch)."""
    path = str(tmp_path / "s.zarr")
    xr.Dataset({"a": ("time", np.arange(8.0)), "label": ("time", np.array([f"c{i % 3}" for i in range(8)], object))}
               ).to_zarr(path, encoding={"a": {"chunks": (4,)}, "label": {"chunks": (4,)}})
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    with pytest.raises(TypeError, match="dtype='float32': variable 'label' holds"):
        ds.insitu.batches(m, "train", batch_size=4, dtype="float32")
    (b, _) = ds.insitu.batches(m, "train", batch_size=4, shuffle=False, dtype="float32", variables=["a"])
    assert b["a"].dtype == np.float32 and list(b["a"]) == [0, 1, 2, 3]


def test_transform_applied_in_finish(path):
    _, b = _builder(path, ["a"], transform=lambda batch: {k: v * 2 for k, v in batch.items()})
    x = np.ones((2, 2, 3), dtype="float32")
    out = b.build({"a": x}, np.array([[0], [1]]))
    np.testing.assert_array_equal(out["a"], x * 2)


@pytest.mark.parametrize("where", ["zarr", "memory"])
def test_a_datetime_variable_beside_numbers(tmp_path, where):
    """A datetime variable (an analysis time per step) beside float ones: each array keeps its own dtype,
    values as xarray's; only stacking them, which has no common dtype, is refused naming ``stack``."""
    nt = 8
    hours = np.datetime64("2000-01-01T00", "ns") + np.arange(nt) * np.timedelta64(1, "h")
    src = xr.Dataset({"x": (("time",), np.arange(nt, dtype="float32")), "when": (("time",), hours)},
                     coords={"time": np.arange(nt)})
    if where == "zarr":
        p = str(tmp_path / "d.zarr")
        src.to_zarr(p, encoding={"x": {"chunks": (2,)}, "when": {"chunks": (2,)}}, consolidated=False)
        ds, ref = xinsitu.open_zarr(p), xr.open_zarr(p, chunks=None).load()
    else:
        ds = ref = src
    m = ds.insitu.split("time", fractions={"train": 1.0})
    for output in ("numpy", "xarray"):
        gen = ds.insitu.batches(m, "train", batch_size=3, output=output, seed=2)
        seen = 0
        for b, pos in zip(gen, gen.batch_ids(), strict=True):
            idx = [int(i) for i in np.asarray(pos).ravel()] if output == "numpy" else b.time.values
            for v in ("x", "when"):
                got = np.asarray(b[v])
                assert got.dtype == ref[v].dtype
                np.testing.assert_array_equal(got, ref[v].values[idx])
            seen += len(idx)
        assert seen == nt
    with pytest.raises(TypeError, match="stack: the variables have no common dtype"):
        ds.insitu.batches(m, "train", output="numpy", stack=True)


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("options", [{}, {"decode_cf": False}])
def test_a_boolean_stored_as_int8_with_a_dtype_attribute(tmp_path, zarr_format, options):
    """int8 storage with the attribute ``dtype: "bool"`` (how xarray writes booleans to NetCDF, kept by Zarr
    stores converted from NetCDF) decodes to bool, as xarray's BooleanCoder does (it was refused: 're-applying
    its CF encoding gives int8')."""
    path = str(tmp_path / "bool.zarr")
    g = zarr.open_group(path, mode="w", zarr_format=zarr_format)
    kw = (dict(attributes={"dtype": "bool", "_ARRAY_DIMENSIONS": ["time", "y"]}) if zarr_format == 2
          else dict(attributes={"dtype": "bool"}, dimension_names=["time", "y"]))
    a = g.create_array("mask", shape=(8, 3), dtype="i1", chunks=(2, 3), fill_value=0, **kw)
    a[...] = np.random.default_rng(0).integers(0, 3, (8, 3))
    zarr.consolidate_metadata(path)
    ds = xr.open_zarr(path, **options)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    b = next(iter(ds.insitu.batches(m, "train", batch_size=8, shuffle=False, output="numpy")))
    assert b["mask"].dtype == ds.mask.dtype == bool
    np.testing.assert_array_equal(b["mask"], ds.mask.values)
