"""stack=["level"]: dims every variable has folded into channels ``{var}_{label}`` (variable then
label), with per-channel statistics and normalisation; oracle: xarray's own stacking and per-level
``.mean()``/``.std()``."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import xinsitu

LEVELS = [500, 700, 850]


@pytest.fixture(scope="module")
def levels_path(tmp_path_factory):
    """u, v, z on 3 pressure levels (very different scales per level for z), time chunks of 4."""
    rng = np.random.default_rng(0)
    nt, nl, ny, nx = 40, len(LEVELS), 5, 6
    scale = np.array([1.0, 3.0, 10.0])[None, :, None, None]
    base = np.array([5500.0, 3000.0, 1500.0])[None, :, None, None]
    data = {
        "u": (10 * scale * rng.standard_normal((nt, nl, ny, nx))).astype("float32"),
        "v": (rng.standard_normal((nt, nl, ny, nx)) + scale).astype("float32"),
        "z": (base * 9.81 + 50 * scale * rng.standard_normal((nt, nl, ny, nx))).astype("float32"),
    }
    data["v"][3, 1, 2, 2] = np.nan  # a missing value: counted, left out of the moments
    ds = xr.Dataset({k: (("time", "level", "lat", "lon"), v) for k, v in data.items()},
                    coords={"time": pd.date_range("2000-01-01", periods=nt, freq="6h"), "level": LEVELS,
                            "lat": np.linspace(60, 40, ny), "lon": np.linspace(0, 10, nx)})
    ds["lsm"] = (("lat", "lon"), rng.random((ny, nx)).astype("float32"))
    path = str(tmp_path_factory.mktemp("levels") / "levels.zarr")
    enc = {k: {"chunks": (4, nl, ny, nx)} for k in "uvz"}
    ds.to_zarr(path, mode="w", zarr_format=3, encoding=enc, consolidated=True)
    return path


@pytest.fixture
def ds_m(levels_path):
    ds = xinsitu.open_zarr(levels_path)
    return ds, ds.insitu.split("time", fractions={"train": 0.6, "val": 0.4})


def manual_stack(ds, times, variables):
    """(sample, channel, lat, lon) the xarray way: select, to_dataarray, fold level into channels."""
    sel = ds[variables].sel(time=times).rename(time="sample").load()
    da = sel.to_dataarray("variable").transpose("sample", "variable", "level", "lat", "lon")
    return da.values.reshape(len(times), -1, *da.shape[3:])


@pytest.mark.parametrize("output", ["numpy", "torch", "dataarray"])
def test_level_channels_match_xarray(ds_m, output):
    ds, m = ds_m
    kw = dict(batch_size=5, shuffle=True, seed=2, block_chunks=2, variables=["u", "v", "z"])
    gen = ds.insitu.batches(m, "train", output=output, stack=["level"], **kw)
    assert gen.channels == [f"{v}_{lev}" for v in "uvz" for lev in LEVELS]
    times = ds.insitu.batches(m, "train", output="xarray", **kw)
    n = 0
    for ref, got in zip(times, gen, strict=True):
        exp = manual_stack(ds, ref.time.values, ["u", "v", "z"])
        arr = got.numpy() if output == "torch" else got.values if output == "dataarray" else got
        assert arr.shape == exp.shape and arr.dtype == exp.dtype
        assert np.array_equal(arr, exp, equal_nan=True)
        if output == "dataarray":
            assert list(got["variable"].values) == gen.channels
            assert got.dims == ("sample", "variable", "lat", "lon")
        n += len(exp)
    assert n == m.positions("train")


def test_stats_per_level_match_xarray(ds_m):
    ds, m = ds_m
    st = ds.insitu.stats(m, "train", variables=["u", "v", "z"], stack=["level"])
    assert st["channels"] == [f"{v}_{lev}" for v in "uvz" for lev in LEVELS]
    train = ds[["u", "v", "z"]].isel(time=slice(0, m.positions("train"))).load().astype("f8")
    assert train.sizes["time"] == 24  # 0.6 of 40 steps, on the 4-step chunk grid
    for v in "uvz":
        assert st[v]["dims"] == ["level"] and st[v]["channels"] == [f"{v}_{lev}" for lev in LEVELS]
        np.testing.assert_allclose(st[v]["mean"], train[v].mean(["time", "lat", "lon"]).values,
                                   rtol=1e-12)
        np.testing.assert_allclose(st[v]["std"], train[v].std(["time", "lat", "lon"]).values,
                                   rtol=1e-7)  # float32 values reduced in float64 by chunks: float tolerance
        np.testing.assert_array_equal(st[v]["max"], train[v].max(["time", "lat", "lon"]).values)
    assert st["v"]["nan_count"] == [0, 1, 0]


def test_normalize_per_level(ds_m):
    """The issue's symptom: with pooled statistics z at 850 hPa was far from mean 0 / std 1; with
    stack=["level"] statistics every channel of the train split is standardised."""
    ds, m = ds_m
    st = ds.insitu.stats(m, "train", variables=["u", "v", "z"], stack=["level"])
    gen = ds.insitu.batches(m, "train", batch_size=64, output="numpy", stack=["level"], variables=["u", "v", "z"],
                            normalize=st)
    x = np.concatenate(list(gen)).astype("f8")
    mean = np.nanmean(x, axis=(0, 2, 3))
    std = np.nanstd(x, axis=(0, 2, 3))
    np.testing.assert_allclose(mean, 0, atol=1e-4)
    np.testing.assert_allclose(std, 1, rtol=1e-4)
    # and equal to normalising xarray's values by hand, channel by channel
    raw = np.concatenate(list(ds.insitu.batches(m, "train", batch_size=64, output="numpy", stack=["level"],
                                                variables=["u", "v", "z"])))
    mu = np.array([x for v in "uvz" for x in st[v]["mean"]], "f4")[None, :, None, None]
    sd = np.array([x for v in "uvz" for x in st[v]["std"]], "f4")[None, :, None, None]
    np.testing.assert_allclose(x, (raw - mu) / sd, rtol=1e-5, atol=1e-5)


def test_normalize_with_pooled_stats_refused(ds_m):
    ds, m = ds_m
    pooled = ds.insitu.stats(m, "train", variables=["u", "v", "z"])
    with pytest.raises(ValueError, match=r"stack=\['level'\]"):
        ds.insitu.batches(m, "train", output="numpy", stack=["level"], variables=["u", "v", "z"], normalize=pooled)


def test_normalize_checks_channel_order(ds_m):
    ds, m = ds_m
    st = ds.insitu.stats(m, "train", variables=["u", "v", "z"], stack=["level"])
    with pytest.raises(ValueError, match="order"):
        ds.insitu.batches(m, "train", output="numpy", stack=["level"], variables=["z", "u", "v"], normalize=st)


def test_dim_missing_on_a_variable(ds_m):
    ds, m = ds_m
    with pytest.raises(ValueError, match=r"stack.*'lsm'"):
        ds.insitu.batches(m, "train", output="numpy", stack=["level"], variables=["u", "lsm"])
    with pytest.raises(ValueError, match=r"stack.*'lsm'"):
        ds.insitu.stats(m, "train", variables=["u", "lsm"], stack=["level"])


@pytest.mark.parametrize("bad", ["level", [], [3], ["level", "level"]])
def test_bad_stack_argument(ds_m, bad):
    ds, m = ds_m
    with pytest.raises((TypeError, ValueError), match="stack"):
        ds.insitu.batches(m, "train", output="numpy", stack=bad, variables=["u"])


def test_stack_true_false_unchanged(ds_m):
    """stack=True keeps today's rule: a dim every variable has is a base dim, not channels."""
    ds, m = ds_m
    gen = ds.insitu.batches(m, "train", batch_size=4, output="numpy", stack=True, variables=["u", "v"])
    assert gen.channels == ["u", "v"]
    assert next(iter(gen)).shape == (4, 2, 3, 5, 6)
    gen = ds.insitu.batches(m, "train", batch_size=4, output="numpy", variables=["u", "v"])
    assert next(iter(gen))["u"].shape == (4, 3, 5, 6)


def test_stack_with_window(ds_m):
    """With window= the window dim stays a sample axis; level still becomes channels."""
    ds, m = ds_m
    gen = ds.insitu.batches(m, "train", batch_size=3, shuffle=False, output="numpy", stack=["level"],
                            variables=["u", "z"], window={"time": 2})
    b = next(iter(gen))
    assert b.shape == (3, 6, 2, 5, 6)
    exp = ds[["u", "z"]].isel(time=slice(0, 2)).load().to_dataarray("variable")
    exp = exp.transpose("variable", "level", "time", "lat", "lon").values.reshape(6, 2, 5, 6)
    np.testing.assert_array_equal(b[0], exp)


def test_state_records_level_channels(ds_m):
    """A state saved with stack=True (channels u, v) is not loaded by a stack=['level'] generator."""
    ds, m = ds_m
    kw = dict(batch_size=4, output="numpy", variables=["u", "v"])
    a = ds.insitu.batches(m, "train", stack=True, **kw)
    next(iter(a))
    b = ds.insitu.batches(m, "train", stack=["level"], **kw)
    with pytest.raises(ValueError, match="channel order"):
        b.load_state_dict(a.state_dict())


def test_map_style_dataset_level_channels(ds_m):
    ds, m = ds_m
    d = ds.insitu.dataset(m, "train", output="numpy", variables=["u", "v", "z"], stack=["level"])
    assert d.channels == [f"{v}_{lev}" for v in "uvz" for lev in LEVELS]
    got = d.batch([5, 0, 11])
    exp = manual_stack(ds, ds.time.values[[5, 0, 11]], ["u", "v", "z"])
    assert np.array_equal(got, exp, equal_nan=True)
