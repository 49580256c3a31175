"""The contract with xarray's private API (``xinsitu.index.xr_adapter``): each private name xinsitu uses
exists in this xarray and does what xinsitu relies on. A new xarray that moves one fails here, by name."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
import zarr

from xinsitu.index import xr_adapter as xa


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("compat") / "s.zarr")
    ds = xr.Dataset({"t2m": (("time", "x"), np.arange(24, dtype="f4").reshape(6, 4))},
                    coords={"time": np.arange(6), "x": np.arange(4)})
    ds["time"].attrs["units"] = "hours since 2000-01-01"
    ds.to_zarr(path, zarr_format=3, consolidated=True, encoding={"t2m": {"chunks": (2, 4)}})
    return path


def test_every_feature_is_found():
    assert xa.HAS_VARIABLE_DATA and xa.HAS_CLOSE and xa.HAS_ZARR_ARRAY
    assert xa.LAZY and xa.LAZY_VECTORIZED and xa.IN_MEMORY and xa.CACHING and xa.ELEMENTWISE
    assert callable(xa.decode_cf_datetime) and xa.FillValueCoder is not None


def test_variable_data_is_the_lazy_chain_down_to_the_zarr_array(stored):
    ds = xr.open_zarr(stored, chunks=None).isel(time=slice(1, 5))
    data = xa.variable_data(ds["t2m"].variable)
    assert not isinstance(data, np.ndarray)  # not loaded
    node, keys, seen = data, [], []
    for _ in range(16):
        seen.append(type(node))
        if isinstance(node, xa.LAZY):
            keys.append(xa.lazy_key(node))
        if xa.is_zarr_wrapper(node):
            break
        node = node.array
    assert xa.is_zarr_wrapper(node) and any(issubclass(t, xa.CACHING) for t in seen)
    zarray = xa.zarr_array_of(node)
    assert isinstance(zarray, zarr.Array) and zarray.shape == (6, 4) and zarray.chunks == (2, 4)
    assert keys and keys[0][0] in (slice(1, 5, 1), slice(1, 5, None))  # (xarray before 2025.11: no step)
    vec = ds.isel(time=xr.DataArray([0, 2], dims="p"), x=xr.DataArray([1, 3], dims="p"))
    assert isinstance(xa.variable_data(vec["t2m"].variable).array.array, xa.LAZY_VECTORIZED)  # under the caches
    assert isinstance(xa.variable_data(ds["time"].variable), xa.IN_MEMORY)  # an index coordinate
    assert isinstance(xa.variable_data(ds.load()["t2m"].variable), (np.ndarray, *xa.IN_MEMORY))


def test_closer_and_the_zarr_group_of_an_open(stored):
    ds = xr.open_zarr(stored, chunks=None)
    close = xa.closer(ds)
    assert callable(close)
    group = xa.zarr_group_of(ds)
    assert isinstance(group, zarr.Group) and group.metadata.consolidated_metadata is not None
    assert xa.closer(xr.Dataset()) is None and xa.zarr_group_of(xr.Dataset()) is None


def test_elementwise_decoding_and_cf_datetime(stored):
    ds = xr.open_zarr(stored, chunks=None, decode_times=True, create_default_indexes=False)
    node = xa.variable_data(ds["time"].variable)
    funcs = []
    for _ in range(16):
        if isinstance(node, xa.ELEMENTWISE):
            funcs.append(node.func)
        if xa.is_zarr_wrapper(node):
            break
        node = node.array
    assert funcs and getattr(funcs[0], "func", None) is xa.decode_cf_datetime
    got = xa.decode_cf_datetime(np.array([0, 25]), "hours since 2000-01-01", "standard")
    assert got.tolist() == np.array(["2000-01-01T00", "2000-01-02T01"], dtype="datetime64[ns]").tolist()


def test_fill_value_coder_encodes_a_float_fill_value():
    enc = xa.FillValueCoder.encode(np.float32(np.nan), np.dtype("f4"))
    assert isinstance(enc, str) and np.isnan(xa.FillValueCoder.decode(enc, np.dtype("f4")))


def test_lazy_decodings_name_each_cf_step_and_its_keywords(tmp_path):
    """``lazy_decodings``: the chain's CF decodings by their functions' names and keywords (what
    ``index.source`` checks a variable's encoding against)."""
    p = str(tmp_path / "cf.zarr")
    xr.Dataset({"p": (("t",), np.array([1.5, np.nan])), "u": (("t",), np.array([1.0, 250.0])),
                "time": (("t",), np.array(["2000-01-01", "2000-01-02"], "M8[ns]"))}).to_zarr(
        p, zarr_format=2, encoding={"p": {"dtype": "i2", "scale_factor": 0.5, "add_offset": 1.0, "_FillValue": -9},
                                    "u": {"dtype": "i1", "_Unsigned": "true", "_FillValue": -1},
                                    "time": {"units": "hours since 2000-01-01"}})
    ds = xr.open_zarr(p, chunks=None).isel(t=slice(0, 2))
    got = {v: xa.lazy_decodings(xa.variable_data(ds[v].variable)) for v in ("p", "u")}
    names = {v: [n for n, _ in d] for v, d in got.items()}
    assert names == {"p": ["_scale_offset_decoding", "_apply_mask"], "u": ["_apply_mask", "asarray"]}
    kw = dict(got["p"])
    assert (kw["_scale_offset_decoding"]["scale_factor"], kw["_scale_offset_decoding"]["add_offset"]) == (0.5, 1.0)
    assert kw["_apply_mask"]["encoded_fill_values"] == {-9}
    assert dict(got["u"])["asarray"]["dtype"] == np.dtype("u1")
    t = xr.open_zarr(p, chunks=None, create_default_indexes=False)["time"].variable
    assert dict(xa.lazy_decodings(xa.variable_data(t)))["decode_cf_datetime"]["units"] == "hours since 2000-01-01"
    assert xa.lazy_decodings(np.arange(3)) is None  # (not a chain down to a stored array)
