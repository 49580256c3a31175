"""stack=["level"]: dims every variable has folded into channels ``{var}_{label}`` (variable then
label), with per-channel statistics and normalisation; oracle: xarray's own stacking and per-level
``.mean()``/``.std()``."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import xinsitu
from tests.support.own_process import rerun_here_in_child

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
    ds["t2m"] = (("time", "lat", "lon"), (280 + 5 * rng.standard_normal((nt, ny, nx))).astype("float32"))
    path = str(tmp_path_factory.mktemp("levels") / "levels.zarr")
    enc = {k: {"chunks": (4, nl, ny, nx)} for k in "uvz"} | {"t2m": {"chunks": (4, ny, nx)}}
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
    # stack=True with a surface variable beside u: u's levels are channels, the pooled statistics have none
    with pytest.raises(ValueError, match=r"no statistics for channel\(s\) \['u_500', 'u_700', 'u_850'\]"):
        ds.insitu.batches(m, "train", output="numpy", stack=True, variables=["u", "t2m"], normalize=pooled)


def test_normalize_by_channel_name(ds_m):
    """SPEC §1: statistics are keyed by channel name; normalize= applies them whatever the order of
    variables= (or of the labels), and a channel they lack raises, naming it."""
    ds, m = ds_m
    st = ds.insitu.stats(m, "train", variables=["u", "v", "z"], stack=["level"])
    kw = dict(batch_size=64, output="numpy", stack=["level"], shuffle=False)
    ref = np.concatenate(list(ds.insitu.batches(m, "val", variables=["u", "v", "z"], normalize=st, **kw)))
    got = ds.insitu.batches(m, "val", variables=["z", "u"], normalize=st, **kw)
    assert got.channels == [f"{v}_{lev}" for v in "zu" for lev in LEVELS]
    x = np.concatenate(list(got))
    np.testing.assert_array_equal(x[:, :3], ref[:, 6:9])  # z, normalised with z's statistics
    np.testing.assert_array_equal(x[:, 3:], ref[:, :3])  # u
    # labels in another order (and a subset of them): each by its name
    flip = ds.isel(level=[2, 0])
    x = np.concatenate(list(flip.insitu.batches(m, "val", variables=["v"], normalize=st, **kw)))
    np.testing.assert_array_equal(x, ref[:, [5, 3]])
    # a channel the statistics lack
    some = ds.insitu.stats(m, "train", variables=["u", "z"], stack=["level"])
    with pytest.raises(ValueError, match=r"no statistics for .*'v_500'"):
        ds.insitu.batches(m, "val", variables=["z", "v"], normalize=some, **kw)
    fewer = ds.isel(level=[0, 1])
    st2 = fewer.insitu.stats(m, "train", variables=["u"], stack=["level"])
    with pytest.raises(ValueError, match=r"no statistics for channel\(s\) \['u_850'\]"):
        ds.insitu.batches(m, "val", variables=["u"], normalize=st2, output="numpy")


@pytest.mark.parametrize("bad", ["1e3", [1.0, "2", 3.0], True, {"a": 1}])
def test_normalize_values_must_be_numbers(ds_m, bad):
    ds, m = ds_m
    with pytest.raises(TypeError, match="normalize"):
        ds.insitu.batches(m, "val", variables=["t2m"], normalize={"t2m": {"mean": bad, "std": 1.0}}, output="numpy")
    with pytest.raises(TypeError, match="normalize"):
        ds.insitu.batches(m, "val", variables=["t2m"], normalize={"t2m": {"mean": 2.0, "std": bad}}, output="numpy")


def test_dim_missing_on_every_variable(ds_m):
    ds, m = ds_m
    with pytest.raises(ValueError, match=r"stack: no selected variable has dim 'level'"):
        ds.insitu.batches(m, "train", output="numpy", stack=["level"], variables=["t2m", "lsm"])
    with pytest.raises(ValueError, match=r"stack: no selected variable has dim 'level'"):
        ds.insitu.stats(m, "train", variables=["t2m", "lsm"], stack=["level"])


def test_window_dim_cannot_be_folded(ds_m):
    ds, m = ds_m
    with pytest.raises(ValueError, match=r"stack: 'time' is a window/patch dim"):
        ds.insitu.batches(m, "train", output="numpy", stack=["level", "time"], variables=["u", "t2m"],
                          window={"time": 2})


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


@pytest.mark.parametrize("variables", [["z", "t2m", "lsm"], ["t2m", "lsm"]])
def test_stack_with_window_and_patch_beside_a_static_field(ds_m, variables):
    """A variable lacking a dim the stacked batch keeps (lsm: no time window; with a patch) is
    broadcast along it, as ``to_dataarray`` does: it crashed ("axes don't match array") where only
    variables without a sample axis were taken to be broadcast."""
    ds, m = ds_m
    stack = ["level"] if "z" in variables else True
    gen = ds.insitu.batches(m, "train", batch_size=3, shuffle=False, output="numpy", stack=stack,
                            variables=variables, window={"time": 2}, patch={"lat": 2, "lon": 3})
    got = next(iter(gen))
    parts = []
    for v in variables:
        sel = {"time": slice(0, 2), "lat": slice(0, 2), "lon": slice(0, 3)}
        da = ds[v].isel({k: s for k, s in sel.items() if k in ds[v].dims}).load()
        for lev in (LEVELS if "level" in da.dims else [None]):
            one = da if lev is None else da.sel(level=lev)
            parts.append(one.broadcast_like(ds.time.isel(time=slice(0, 2))).transpose("time", "lat", "lon").values)
    assert got.shape == (3, len(parts), 2, 2, 3)
    np.testing.assert_array_equal(got[0], np.stack(parts))
    d = ds.insitu.dataset(m, "train", output="numpy", stack=stack, variables=variables,
                          window={"time": 2}, patch={"lat": 2, "lon": 3})
    np.testing.assert_array_equal(d[0], np.stack(parts))


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


# ------------------------------------------------------------------ surface variables beside levels
WEATHER = ["z", "t2m", "u", "v"]  # the usual GraphCast/WeatherBench input: t2m has no level
WEATHER_CHANNELS = [f"z_{lev}" for lev in LEVELS] + ["t2m"] + [f"{v}_{lev}" for v in "uv" for lev in LEVELS]


def weather_oracle(ds, times, variables=WEATHER):
    """(sample, channel, lat, lon) the xarray way: ``ds[v].sel(level=l)`` per label, a surface
    variable as it is, stacked in variable-then-label order."""
    sel = ds[variables].sel(time=times).load()
    parts = []
    for v in variables:
        labels = sel.level.values if "level" in sel[v].dims else [None]
        for lev in labels:
            da = sel[v] if lev is None else sel[v].sel(level=lev)
            parts.append(da.transpose("time", "lat", "lon").values)
    return np.stack(parts, axis=1)


@pytest.mark.parametrize("output", ["numpy", "torch", "jax", "dataarray", "xarray"])
@pytest.mark.slow
def test_surface_variables_beside_levels_match_xarray(ds_m, output):
    """SPEC §4: stack=['level'] with t2m beside z, u, v: one channel `t2m`, `{var}_{label}` for the
    others, in variable-then-label order, bit for bit what xarray gives."""
    if output == "jax":
        pytest.importorskip("jax")
        if rerun_here_in_child():  # jax's threads and its at-fork warning stay in a child process
            return
    ds, m = ds_m
    kw = dict(batch_size=5, shuffle=True, seed=1, block_chunks=2, variables=WEATHER)
    gen = ds.insitu.batches(m, "train", output=output, stack=["level"], **kw)
    assert gen.channels == WEATHER_CHANNELS
    times = ds.insitu.batches(m, "train", output="xarray", **kw)
    n = 0
    for ref, got in zip(times, gen, strict=True):
        exp = weather_oracle(ds, ref.time.values)
        arr = got.values if output in ("dataarray", "xarray") else np.asarray(got)
        assert arr.shape == exp.shape == (len(ref.time), 10, 5, 6) and arr.dtype == exp.dtype
        assert np.array_equal(arr, exp, equal_nan=True)
        if output in ("dataarray", "xarray"):
            assert list(got["variable"].values) == WEATHER_CHANNELS
            assert got.dims == ("sample", "variable", "lat", "lon")
            np.testing.assert_array_equal(got.time.values, ref.time.values)
        n += len(exp)
    assert n == m.positions("train")


def test_surface_variables_beside_levels_stats_and_normalize(ds_m):
    ds, m = ds_m
    st = ds.insitu.stats(m, "train", variables=WEATHER, stack=["level"])
    assert st["channels"] == WEATHER_CHANNELS
    train = ds[WEATHER].isel(time=slice(0, m.positions("train"))).load().astype("f8")
    # a number for the surface variable, a list in label order for the others
    assert st["t2m"]["dims"] == [] and st["t2m"]["channels"] == ["t2m"] and isinstance(st["t2m"]["mean"], float)
    np.testing.assert_allclose(st["t2m"]["mean"], float(train.t2m.mean()), rtol=1e-12)
    np.testing.assert_allclose(st["t2m"]["std"], float(train.t2m.std()), rtol=1e-7)
    for v in ("z", "u", "v"):
        assert st[v]["channels"] == [f"{v}_{lev}" for lev in LEVELS]
        np.testing.assert_allclose(st[v]["mean"], train[v].mean(["time", "lat", "lon"]).values, rtol=1e-12)
    # normalize= per channel: every channel of the train split standardised, each with its own statistics
    gen = ds.insitu.batches(m, "train", batch_size=64, output="numpy", stack=["level"], variables=WEATHER,
                            normalize=st, shuffle=False)
    x = np.concatenate(list(gen)).astype("f8")
    np.testing.assert_allclose(np.nanmean(x, axis=(0, 2, 3)), 0, atol=1e-4)
    np.testing.assert_allclose(np.nanstd(x, axis=(0, 2, 3)), 1, rtol=1e-4)
    raw = weather_oracle(ds, ds.time.values[:m.positions("train")])
    mu = np.array([st[c.split("_")[0]]["mean"][LEVELS.index(int(c.split("_")[1]))] if "_" in c else st[c]["mean"]
                   for c in WEATHER_CHANNELS], "f4")[None, :, None, None]
    sd = np.array([st[c.split("_")[0]]["std"][LEVELS.index(int(c.split("_")[1]))] if "_" in c else st[c]["std"]
                   for c in WEATHER_CHANNELS], "f4")[None, :, None, None]
    np.testing.assert_array_equal(np.concatenate(list(gen)), (raw - mu) / sd)
    # the same statistics, other variables in another order: by channel name
    other = ds.insitu.batches(m, "train", batch_size=64, output="numpy", stack=["level"], variables=["t2m", "v"],
                              normalize=st, shuffle=False)
    y = np.concatenate(list(other))
    np.testing.assert_array_equal(y, np.concatenate(list(gen))[:, [3, 7, 8, 9]])


def test_surface_variables_beside_levels_map_style_and_state(ds_m):
    ds, m = ds_m
    d = ds.insitu.dataset(m, "train", output="numpy", variables=WEATHER, stack=["level"])
    assert d.channels == WEATHER_CHANNELS
    got = d.batch([5, 0, 11])
    assert np.array_equal(got, weather_oracle(ds, ds.time.values[[5, 0, 11]]), equal_nan=True)
    assert np.array_equal(d[7], weather_oracle(ds, ds.time.values[[7]])[0], equal_nan=True)
    a = ds.insitu.batches(m, "train", batch_size=4, output="numpy", stack=["level"], variables=WEATHER)
    next(iter(a))
    assert a.state_dict()["channels"] == WEATHER_CHANNELS
    b = ds.insitu.batches(m, "train", batch_size=4, output="numpy", stack=["level"], variables=["t2m", "z", "u", "v"])
    with pytest.raises(ValueError, match=r"channel order.*'z_500'.*'t2m'.*here.*'t2m', 'z_500'"):
        b.load_state_dict(a.state_dict())


def test_weather_input_doc_example_runs(tmp_path, monkeypatch, capsys):
    """docs/how-to/level-channels.md opens with a runnable example of the weather-model input."""
    import re
    import tempfile
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "how-to" / "level-channels.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    exec(compile(code, "level-channels.md", "exec"), {"__name__": "doc"})
    out = capsys.readouterr().out.splitlines()
    levels = [500, 700, 850]
    assert out == [str([f"z_{lev}" for lev in levels] + ["t2m"] + [f"{v}_{lev}" for v in "uv" for lev in levels]),
                   "(8, 10, 8, 16) float32"]


@pytest.mark.parametrize("name", ["variable", "sample"])
def test_a_dim_named_like_a_batch_dim(tmp_path, name):
    """An archive whose data has a dim ``variable`` (anemoi's ``data(time, variable, cell)``) or ``sample``
    (an ensemble dim): a labeled batch names its leading dim ``sample`` and a stacked one its channel dim
    ``variable``. Where they would meet, ``batches`` refuses at once, naming the dim and the ways out (the
    first batch failed inside xarray: "conflicting sizes for dimension"); the ways out it names work, equal
    to xarray, and so do the outputs where the names do not meet."""
    src = xr.Dataset({"data": (("time", name, "cell"), np.arange(60.0).reshape(4, 3, 5))},
                     coords={"time": np.arange(4), name: ["a", "b", "c"]})
    src.to_zarr(tmp_path / "a.zarr", zarr_format=3, consolidated=False)
    ds = xinsitu.open_zarr(tmp_path / "a.zarr")
    m = ds.insitu.split("time", fractions={"train": 1.0})
    meet = [{"output": "dataarray"}, {"output": "xarray", "stack": True}]
    if name == "sample":
        meet.append({"output": "xarray"})
    for kw in meet:
        with pytest.raises(ValueError, match=rf"variable 'data' has a dim '{name}'.*ds.rename"):
            ds.insitu.batches(m, "train", batch_size=2, **kw)
    ways = [ds.rename({name: "member"}).insitu.batches(m, "train", batch_size=2, shuffle=False, output="dataarray")]
    if name == "variable":
        ways.append(ds.insitu.batches(m, "train", batch_size=2, shuffle=False, output="dataarray", stack=[name]))
        got = next(iter(ds.insitu.batches(m, "train", batch_size=2, shuffle=False, output="xarray")))
        want = ds.data.isel(time=[0, 1]).drop_vars("time")
        xr.testing.assert_equal(got["data"].drop_vars("time").rename(sample="time"), want)
    for gen in ways:
        got = next(iter(gen))
        np.testing.assert_array_equal(got.values.reshape(2, 3, 5), ds.data.isel(time=[0, 1]).values)
