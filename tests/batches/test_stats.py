"""Normalisation statistics: equal to numpy's float64 results over the split's positions,
each chunk read once, nothing from val/test, channels per label, JSON-able; the normaliser."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import xarray as xr
from hypothesis import given, settings
from hypothesis import strategies as st

import xinsitu
from tests.conftest import open_three_ways
from xinsitu.accessor import InsituAccessor
from xinsitu.batches.moments import STAT_KEYS, Moments, channel_moments, chunk_moments
from xinsitu.batches.stats import StatsPass, compute_stats
from xinsitu.index.channels import normalizer
from xinsitu.synthetic import era5_like, packing, write_era5_like

RTOL = 1e-6
LEVELS = [500, 850]


# ----------------------------------------------------------------------------- helpers
def split_positions(m: xinsitu.SplitManifest, split: str) -> dict[str, np.ndarray]:
    """Per split dim, a boolean mask of the positions inside the split's chunk blocks (block box)."""
    edges = [np.asarray(m.edges[d]) for d in m.dims]
    masks = np.zeros(tuple(m.sizes[d] for d in m.dims), dtype=bool)
    for b in m.blocks(split):
        coords = np.unravel_index(int(b), m.grid)
        masks[tuple(slice(e[c], e[c + 1]) for e, c in zip(edges, coords, strict=True))] = True
    return masks


def numpy_stats(da: xr.DataArray, m: xinsitu.SplitManifest, split: str, channel_dim: str | None = None) -> dict:
    """numpy float64 statistics of ``da`` over the split's positions (per label of ``channel_dim``)."""
    da = da.load()
    mask = xr.DataArray(split_positions(m, split), dims=m.dims)
    lacking = [d for d in m.dims if d not in da.dims]
    if lacking:  # a variable lacking some split dims: the positions its blocks cover
        mask = mask.any(lacking)
    out: dict[str, list] = {k: [] for k in (*STAT_KEYS, "count")}
    for lab in da[channel_dim].values if channel_dim else [None]:
        x = da.sel({channel_dim: lab}) if channel_dim else da
        sel = mask.broadcast_like(x).transpose(*x.dims).values
        v = np.asarray(x.values, dtype=np.float64)[sel]
        out["nan_count"].append(int(np.isnan(v).sum()))
        v = v[~np.isnan(v)]
        out["count"].append(v.size)
        for k, f in (("mean", np.mean), ("std", np.std), ("min", np.min), ("max", np.max)):
            out[k].append(float(f(v)))
    return out if channel_dim else {k: v[0] for k, v in out.items()}


def assert_stats_close(got: dict, ref: dict) -> None:
    for k in ("mean", "std", "min", "max"):
        np.testing.assert_allclose(got[k], ref[k], rtol=RTOL, atol=0, err_msg=k)
    for k in ("min", "max", "nan_count", "count"):  # extremes and counts are exact
        assert got[k] == ref[k], k


def write_levels(path: str, nt: int = 40, chunk_time: int = 8) -> xr.Dataset:
    """t2m, int16-packed tp (NaNs), z(time, level, lat, lon) with levels 500/850, static lsm."""
    ds = era5_like(nt=nt, ny=4, nx=6, seed=3)[["t2m", "tp", "lsm"]]
    rng = np.random.default_rng(7)
    z = (np.array([5500.0, 1500.0])[None, :, None, None] + 50 * rng.standard_normal((nt, 2, 4, 6)))
    ds["z"] = (("time", "level", "lat", "lon"), z.astype("float32"))
    ds = ds.assign_coords(level=LEVELS)
    enc = {v: {"chunks": tuple(chunk_time if d == "time" else ds.sizes[d] for d in ds[v].dims)}
           for v in ds.data_vars}
    enc["tp"].update(packing())
    ds.to_zarr(path, mode="w", encoding=enc, consolidated=True)
    return ds


@pytest.fixture(scope="module")
def levels_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("stats") / "levels.zarr")
    write_levels(path)
    return path


@pytest.fixture(scope="module")
def ragged_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """nt=100 in chunks of 8: the last chunk is short, so a short unit shares a block with full ones."""
    path = str(tmp_path_factory.mktemp("stats") / "ragged.zarr")
    write_era5_like(path, nt=100, ny=5, nx=7, chunk_time=8)
    return path


# ----------------------------------------------------------------------------- vs numpy
@pytest.mark.parametrize("how", ["xinsitu", "xr_nodask", "xr_dask"])
def test_matches_numpy(era5_path, how):
    ds = open_three_ways(era5_path)[how]
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1}, gap=1)
    st = compute_stats(ds, m, "train", block_chunks=3)
    names = ["t2m", "u10", "v10", "z500", "tp"]
    assert sorted(st["channels"]) == sorted(names) and st["channels"] == st["variables"]
    assert st["split"] == "train"
    assert st["tp"]["nan_count"] > 0, "the fixture must contain missing values"
    for v in names:
        assert_stats_close(st[v], numpy_stats(ds[v], m, "train"))
        assert st[v]["count"] + st[v]["nan_count"] == m.positions("train") * ds.sizes["lat"] * ds.sizes["lon"]


def test_float_fill_value_and_scale_are_decoded(tmp_path):
    """Float variables with a non-NaN _FillValue, or scale/offset, go through CF decoding."""
    ds = era5_like(nt=40, ny=3, nx=4, seed=5)[["t2m", "u10"]]
    ds["t2m"][::3, 0, 0] = np.nan
    ds["u10"][1::4, 1, :] = np.nan
    enc = {"t2m": {"chunks": (8, 3, 4), "_FillValue": -9999.0},
           "u10": {"chunks": (8, 3, 4), "dtype": "float32", "scale_factor": 0.5, "add_offset": 1.0}}
    ds.to_zarr(tmp_path / "f.zarr", mode="w", encoding=enc)
    ds = xinsitu.open_zarr(tmp_path / "f.zarr")
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    st = compute_stats(ds, m, "train")
    for v in ("t2m", "u10"):
        ref = numpy_stats(ds[v], m, "train")
        assert ref["nan_count"] > 0
        assert_stats_close(st[v], ref)


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_short_chunks_and_recycled_buffers(ragged_path, split):
    """Units shorter than the block's longest (the archive's last chunk) read only their own rows,
    even from buffers recycled from earlier blocks."""
    ds = xinsitu.open_zarr(ragged_path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.25, "test": 0.25})
    st = compute_stats(ds, m, split, variables=["t2m", "tp"], block_chunks=2)
    for v in ("t2m", "tp"):
        assert_stats_close(st[v], numpy_stats(ds[v], m, split))


def test_spatial_split_ragged_blocks(era5_path):
    """A random split on chunk blocks of (lat, lon) with short edge blocks; a variable lacking `lon`
    counts each of its blocks once though several units share it."""
    ds = xr.open_zarr(era5_path).load()
    ds["zonal"] = ds.t2m.mean("lon")
    ds = ds[["t2m", "tp", "zonal"]].chunk({"lat": 4, "lon": 4})  # lat 6 -> 4+2, lon 10 -> 4+4+2
    m = ds.insitu.split(["lat", "lon"], fractions={"train": 0.5, "val": 0.5}, contiguous=False, seed=2)
    st = compute_stats(ds, m, "train", block_chunks=2)
    for v in ("t2m", "tp"):
        assert_stats_close(st[v], numpy_stats(ds[v], m, "train"))
    ref = numpy_stats(ds["zonal"], m, "train")
    assert_stats_close(st["zonal"], ref)
    assert ref["count"] < m.positions("train") * ds.sizes["time"]  # really fewer than lat x lon positions


def test_each_chunk_read_once(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    sp = StatsPass(ds, m, "train", block_chunks=3)
    sp.run()
    n_vars = len(sp.layouts)
    assert sp.reader.counters.chunks == n_vars * len(m.splits["train"])
    assert sp.reader.counters.requests == n_vars * len(m.splits["train"])
    with pytest.raises(RuntimeError, match="runs once"):
        sp.run()


def test_values_are_left_alone(era5_path):
    """The reduction overwrites only chunks the reader decoded for it: never a Dataset's own memory,
    never an array handed to ``Moments``."""
    ds = xr.open_zarr(era5_path).load()[["t2m", "tp"]]
    before = ds.copy(deep=True)
    m = ds.chunk(time=8).insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    st = compute_stats(ds, m, "train")
    xr.testing.assert_identical(ds, before)
    assert_stats_close(st["t2m"], numpy_stats(ds["t2m"], m, "train"))
    x = ds.t2m.values.copy()
    Moments.of(x[None])
    np.testing.assert_array_equal(x, ds.t2m.values)


def test_result_independent_of_blocking(era5_path):
    """Moments merge per unit in split order: block size and reads in flight change no bit."""
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    a = compute_stats(ds, m, "train", block_chunks=1, max_inflight=1)
    b = compute_stats(ds, m, "train", block_chunks=16, max_inflight=64)
    assert a == b


# ----------------------------------------------------------------------------- no leakage
@pytest.mark.parametrize("where", ["memory", "archive"])
def test_val_and_test_never_enter_train_stats(tmp_path, where):
    """Huge values in every val/test time step change no bit of the train statistics."""
    clean = era5_like(nt=96, ny=4, nx=5, seed=1)[["t2m", "tp"]]
    m = clean.chunk(time=8).insitu.split("time", fractions={"train": 0.5, "val": 0.25, "test": 0.25}, gap=1)
    outside = {"time": ~split_positions(m, "train")}
    poisoned = clean.copy(deep=True)
    poisoned["t2m"][outside] = 1e30
    poisoned["tp"][outside] = 60.0  # near the top of what the int16 packing holds; the data is < 10
    stats = {}
    for name, data in (("clean", clean), ("poisoned", poisoned)):
        if where == "memory":
            ds = data.chunk(time=8)
        else:
            enc = {"t2m": {"chunks": (8, 4, 5)}, "tp": {"chunks": (8, 4, 5), **packing()}}
            data.to_zarr(tmp_path / f"{name}.zarr", mode="w", encoding=enc)
            ds = xinsitu.open_zarr(tmp_path / f"{name}.zarr")
        stats[name] = compute_stats(ds, m, "train")
        for v in ("t2m", "tp"):
            assert_stats_close(stats[name][v], numpy_stats(ds[v], m, "train"))
    assert stats["poisoned"]["t2m"]["max"] < 1e3 and stats["poisoned"]["tp"]["max"] < 20
    assert stats["poisoned"] == stats["clean"]
    assert compute_stats(poisoned.chunk(time=8), m, "val")["t2m"]["max"] == float(np.float32(1e30))


def test_val_and_test_chunks_are_never_read(tmp_path):
    """Garbage in every val/test chunk object: train statistics come out all the same; val's raise."""
    path = tmp_path / "a.zarr"
    write_era5_like(path, nt=48, ny=3, nx=4, chunk_time=8)
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    before = compute_stats(ds, m, "train")
    for v in before["variables"]:
        for c in m.splits["val"]:
            (path / v / "c" / str(c) / "0" / "0").write_bytes(b"not a chunk")
    ds = xinsitu.open_zarr(path)
    assert compute_stats(ds, m, "train") == before
    with pytest.raises(xinsitu.ChunkReadError, match="cannot read chunk"):
        compute_stats(ds, m, "val")


def test_stats_differ_per_split(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    tr, va = (compute_stats(ds, m, s, variables=["t2m"]) for s in ("train", "val"))
    assert tr["split"] == "train" and va["split"] == "val"
    assert tr["t2m"]["mean"] != va["t2m"]["mean"]


# ----------------------------------------------------------------------------- channels
def test_extra_dim_gives_lists_in_label_order(levels_path):
    ds = xinsitu.open_zarr(levels_path)
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.4})
    st = compute_stats(ds, m, "train", variables=["t2m", "tp", "z"])
    assert st["channels"] == ["t2m", "tp", "z_500", "z_850"]
    gen = ds.insitu.batches(m, "train", variables=["t2m", "tp", "z"], output="numpy", stack=True)
    assert st["channels"] == gen.channels
    assert st["z"]["dims"] == ["level"] and st["z"]["channels"] == ["z_500", "z_850"]
    for k in STAT_KEYS:
        assert isinstance(st["z"][k], list) and len(st["z"][k]) == 2
        assert not isinstance(st["t2m"][k], list)
    assert st["z"]["mean"][0] > 5000 > 2000 > st["z"]["mean"][1]  # 500 hPa first, as labelled
    assert_stats_close(st["z"], numpy_stats(ds.z, m, "train", channel_dim="level"))
    assert_stats_close(st["t2m"], numpy_stats(ds.t2m, m, "train"))


def test_channels_follow_the_variables_chosen(levels_path):
    ds = xinsitu.open_zarr(levels_path)
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.4})
    # on its own, z has no dim the others lack: one channel over all levels, as gen.channels says
    alone = compute_stats(ds, m, "train", variables=["z"])
    gen = ds.insitu.batches(m, "train", variables=["z"], output="numpy", stack=True)
    assert alone["channels"] == gen.channels == ["z"]
    assert alone["z"]["dims"] == []
    assert_stats_close(alone["z"], numpy_stats(ds.z, m, "train"))
    # variable order sets channel order; a static variable is one channel, read once
    st = compute_stats(ds, m, "train", variables=["z", "lsm", "t2m"])
    assert st["channels"] == ["z_500", "z_850", "lsm", "t2m"]
    ref = ds.lsm.values.astype(np.float64)
    assert st["lsm"]["count"] == ref.size and st["lsm"]["mean"] == pytest.approx(ref.mean(), rel=RTOL)


def test_channels_when_variables_do_not_stack(era5_path):
    mem = xr.open_zarr(era5_path, chunks=None).load()
    ds = mem.assign(zonal=mem.t2m.mean("lon"), meridional=mem.t2m.mean("lat")).chunk(time=8)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    # zonal(time, lat) and meridional(time, lon) do not stack: one channel per variable
    st = compute_stats(ds, m, "train", variables=["zonal", "meridional"])
    assert st["channels"] == ["zonal", "meridional"]
    for v in ("zonal", "meridional"):
        assert_stats_close(st[v], numpy_stats(ds[v], m, "train"))
    # beside zonal, t2m's extra dim is lon: a channel per longitude, as gen.channels has it
    st = compute_stats(ds, m, "train", variables=["t2m", "zonal"])
    gen = ds.insitu.batches(m, "train", variables=["t2m", "zonal"], output="numpy", stack=True)
    assert st["channels"] == gen.channels and st["t2m"]["dims"] == ["lon"]
    assert_stats_close(st["t2m"], numpy_stats(ds.t2m, m, "train", channel_dim="lon"))


# ----------------------------------------------------------------------------- record
def test_json_round_trip(levels_path, tmp_path):
    ds = xinsitu.open_zarr(levels_path)
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.4})
    st = compute_stats(ds, m, "train", variables=["t2m", "tp", "z"])
    assert json.loads(json.dumps(st, allow_nan=False)) == st  # strict JSON: plain numbers, lists, str
    for v in st["variables"]:
        vals = st[v]["mean"] if isinstance(st[v]["mean"], list) else [st[v]["mean"]]
        assert all(type(x) is float for x in vals)
        assert type(st[v]["nan_count"] if v != "z" else st[v]["nan_count"][0]) is int
    m.stats = st
    m.to_json(tmp_path / "m.json")
    assert xinsitu.SplitManifest.from_json(tmp_path / "m.json").stats == st


def test_all_nan_channel_is_none(era5_path):
    ds = xr.open_zarr(era5_path).load()[["t2m", "u10"]]
    ds["u10"][:] = np.nan
    m = ds.chunk(time=8).insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    st = compute_stats(ds.chunk(time=8), m, "train")
    assert st["u10"]["mean"] is None and st["u10"]["std"] is None and st["u10"]["count"] == 0
    assert st["u10"]["nan_count"] == m.positions("train") * 6 * 10
    json.dumps(st, allow_nan=False)


@pytest.mark.parametrize("dtype", ["int64", "uint64"])
def test_integer_min_and_max_are_exact(tmp_path, dtype):
    """An integer channel's min and max are Python ints, xarray's to the last digit, also beyond 2**53 (a
    float64 rounds 2**60 + 1 to 2**60), through parts and their JSON too."""
    x = np.arange(40 * 3, dtype=dtype).reshape(40, 3) + np.array(2**60 + 1, dtype)
    path = str(tmp_path / "ints.zarr")
    xr.Dataset({"a": (("t", "x"), x)}).to_zarr(path, encoding={"a": {"chunks": (4, 3)}})
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("t", fractions={"train": 0.5, "val": 0.5})
    want = ds.a.isel(t=slice(0, 20))
    st = ds.insitu.stats(m, "train")
    assert (st["a"]["min"], st["a"]["max"]) == (int(want.min()), int(want.max()))
    assert isinstance(st["a"]["min"], int) and st["a"]["min"] % 2 == 1
    parts = [json.loads(json.dumps(ds.insitu.stats_part(m, "train", part=(i, 3)))) for i in range(3)]
    assert xinsitu.merge_stats(parts) == st


def test_bad_input(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    with pytest.raises(ValueError, match="unknown split"):
        compute_stats(ds, m, "test")
    with pytest.raises(ValueError, match="unknown variable"):
        compute_stats(ds, m, "train", variables=["nope"])
    clash = ds[["t2m"]].rename(t2m="channels")
    with pytest.raises(ValueError, match="named like a key"):
        compute_stats(clash, m, "train")
    txt = ds[["t2m"]].assign(when=ds.time.broadcast_like(ds.t2m).load())
    with pytest.raises(ValueError, match="real numbers"):
        compute_stats(txt.chunk(time=8), txt.chunk(time=8).insitu.split("time", fractions={"a": .5, "b": .5}),
                      "a", variables=["when"])


# ----------------------------------------------------------------------------- moments
@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 400), min_size=1, max_size=6), st.integers(0, 2**31 - 1),
       st.floats(-1e6, 1e6), st.floats(1e-3, 1e4), st.floats(0, 0.3), st.sampled_from(["float32", "float64"]))
def test_merged_moments_equal_numpy(cuts, seed, loc, scale, nan_frac, dtype):
    """Pieces reduced one by one and combined as the stats pass combines chunks: means within 1e-9,
    stds within 2e-7 (the suite's bar is 1e-6): float32 deviations are rounded to float32 and their
    squares summed in float32 partial sums; each piece's mean is rounded to a float64 ulp, which is
    1e-7 of a spread 1e9 times smaller than the mean."""
    rng = np.random.default_rng(seed)
    x = (loc + scale * rng.standard_normal((3, sum(cuts)))).astype(dtype)
    x[rng.random(x.shape) < nan_frac] = np.nan
    rel = 2e-7
    edges = np.cumsum([0, *cuts])
    parts = [(c, chunk_moments(x[c, a:b])) for a, b in zip(edges[:-1], edges[1:], strict=True) for c in range(3)]
    res = Moments.combine(3, parts).result()
    for c in range(3):
        v = x[c].astype(np.float64)
        v = v[~np.isnan(v)]
        assert res["nan_count"][c] == x.shape[1] - v.size and res["count"][c] == v.size
        if v.size == 0:
            assert res["mean"][c] is None
            continue
        assert res["mean"][c] == pytest.approx(v.mean(), rel=1e-9, abs=1e-9 * v.std())
        assert res["std"][c] == pytest.approx(v.std(), rel=rel, abs=1e-12 * scale)
        assert (res["min"][c], res["max"][c]) == (v.min(), v.max())


@pytest.mark.parametrize("kind", ["t2m", "u10 near 0", "pressure", "humidity (lognormal)", "sorted", "constant",
                                  "tiny spread", "huge spread", "int16", "float16", "with inf", "nan rows"])
def test_chunk_reduction_accuracy(kind):
    """One chunk-sized array of each kind of data, in every code path of ``Moments.reduce``: the mean as
    numpy's float64 mean, the std within 2e-7 (the suite's bar is 1e-6), extremes and counts exact."""
    rng = np.random.default_rng(4)
    shape = (24, 32, 40)
    x = {"t2m": lambda: rng.normal(280, 15, shape), "u10 near 0": lambda: rng.normal(0.05, 5, shape),
         "pressure": lambda: rng.normal(101325, 800, shape),
         "humidity (lognormal)": lambda: rng.lognormal(-7, 1.5, shape),
         "sorted": lambda: np.sort(rng.normal(280, 15, shape), axis=None).reshape(shape),
         "constant": lambda: np.full(shape, 3.3), "tiny spread": lambda: 1e-12 * rng.standard_normal(shape),
         "huge spread": lambda: rng.normal(0, 1e18, shape), "int16": lambda: rng.integers(-300, 300, shape),
         "float16": lambda: rng.normal(10, 2, shape), "with inf": lambda: np.where(rng.random(shape) < .01, np.inf,
                                                                                    rng.normal(0, 1, shape)),
         "nan rows": lambda: np.where(rng.random(shape) < .3, np.nan, rng.normal(300, 2, shape))}[kind]()
    x = x.astype({"int16": np.int16, "float16": np.float16}.get(kind, np.float32))
    view = x[:, 3:29, :]  # strided, as a chunk's piece of a region can be
    mom = Moments(1)
    mom.reduce(0, view)
    res = {k: v[0] for k, v in mom.result().items()}
    v = view.astype(np.float64).ravel()
    assert res["nan_count"] == int(np.isnan(v).sum())
    v = v[~np.isnan(v)]
    assert res["count"] == v.size and (res["min"], res["max"]) == (v.min(), v.max())
    if not np.isfinite(v).all():
        assert not np.isfinite(res["mean"])
        return
    assert res["mean"] == pytest.approx(v.mean(), rel=1e-12, abs=0)  # a float64 sum, as numpy's
    assert res["std"] == pytest.approx(v.std(), rel=2e-7, abs=1e-300)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3000), st.data(), st.sampled_from(["float32", "float64", "int16"]),
       st.booleans())
def test_channel_moments_equal_chunk_moments_row_by_row(channels, n, data, dtype, scratch):
    """The channels of a chunk reduced together (``channel_moments``) give what each row reduced alone
    gives: counts, NaN counts and extremes exactly, mean and M2 to the last bits or nearly (the same
    arithmetic; only the place of a row in memory differs). Rows of every kind mixed: NaNs, constant,
    a tiny or huge spread (the row-by-row way), ordinary data; lengths across ``ROW`` (body and tail)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    x = 300 + 20 * rng.standard_normal((channels, n))
    for c in range(channels):
        kind = data.draw(st.sampled_from(["plain", "plain", "nan", "constant", "tiny", "huge"]))
        if kind == "nan":
            x[c, rng.integers(0, n)] = np.nan
        elif kind == "constant":
            x[c] = 5.0
        elif kind == "tiny":
            x[c] = 1.0 + 1e-12 * rng.standard_normal(n)
        elif kind == "huge":
            x[c] *= 1e30
    x = x.astype(dtype) if dtype != "int16" else np.nan_to_num(np.clip(x, -3e4, 3e4)).astype(dtype)
    rows = [chunk_moments(r.copy(), scratch) for r in x]
    together = channel_moments(x.copy(), scratch)
    assert len(together) == channels
    for one, many in zip(rows, together, strict=True):
        assert (one[0], one[1]) == (many[0], many[1])
        np.testing.assert_equal(one[4:], many[4:])  # NaN where no value is left, as chunk_moments
        np.testing.assert_allclose(many[2:4], one[2:4], rtol=1e-12, atol=0)


def test_stats_of_one_step_chunks_reduce_a_chunk_s_levels_together(tmp_path, monkeypatch):
    """Level variables chunked one time step at a time (ARCO-ERA5): each chunk's levels reduced in one
    ``channel_moments`` call, and the statistics numpy's."""
    import xinsitu.batches.stats as stats_mod

    path = str(tmp_path / "one_step.zarr")
    ds0 = write_levels(path, nt=12, chunk_time=1)
    calls = []
    real = stats_mod.channel_moments
    monkeypatch.setattr(stats_mod, "channel_moments", lambda v, s=False: calls.append(v.shape) or real(v, s))
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
    st_ = compute_stats(ds, m, "train", variables=["t2m", "z"], stack=["level"])
    assert calls and set(calls) == {(2, 24)}  # z's 2 levels of 4 x 6, once per time step read
    assert len(calls) == m.positions("train")
    assert_stats_close(st_["z"], numpy_stats(ds0.z, m, "train", channel_dim="level"))
    assert_stats_close(st_["t2m"], numpy_stats(ds0.t2m, m, "train"))


# ----------------------------------------------------------------------------- normalizer
def test_normalizer_matches_xarray(levels_path):
    ds = xinsitu.open_zarr(levels_path)
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.4})
    names = ["t2m", "tp", "z", "lsm"]
    st = compute_stats(ds, m, "train", variables=names)
    gen = ds.insitu.batches(m, "val", variables=names, output="numpy", shuffle=False, batch_size=64,
                            window={"time": 2})
    norm = normalizer(st, gen.layouts)
    batch = next(iter(gen))
    out = norm(batch)
    first = m.edges["time"][m.splits["val"][0]]
    n = len(batch["t2m"])
    ind = xr.DataArray(first + np.arange(n)[:, None] + np.arange(2), dims=("sample", "time"))
    ref = ds.isel(time=ind).load()
    for v in ("t2m", "tp"):  # what a user writes with xarray and Python floats, bit for bit
        exp = ((ref[v] - st[v]["mean"]) / st[v]["std"]).transpose("sample", "time", "lat", "lon").values
        assert out[v].dtype == exp.dtype == batch[v].dtype
        np.testing.assert_array_equal(out[v], exp)
    assert np.isnan(out["tp"]).sum() == np.isnan(batch["tp"]).sum()
    for i, lev in enumerate(LEVELS):  # broadcast per label along the level axis (axis 2 here)
        zl = ref.z.sel(level=lev).transpose("sample", "time", "lat", "lon")
        exp = ((zl - st["z"]["mean"][i]) / st["z"]["std"][i]).values
        np.testing.assert_array_equal(out["z"][:, :, i], exp)
    # the static variable (no sample axis) too; the input arrays are never changed
    np.testing.assert_array_equal(out["lsm"], ((ds.lsm - st["lsm"]["mean"]) / st["lsm"]["std"]).values)
    np.testing.assert_array_equal(batch["lsm"], ds.lsm.values)
    assert out["z"].mean() != batch["z"].mean()


def test_normalizer_edge_cases(levels_path):
    ds = xinsitu.open_zarr(levels_path)
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.4})
    gen = ds.insitu.batches(m, "train", variables=["t2m", "z"], output="numpy")
    hand = {"t2m": {"mean": 280.0, "std": 0.0}, "z": {"mean": [1.0, 2.0], "std": [2.0, 4.0]}}
    norm = normalizer(hand, gen.layouts)  # hand-written: dims inferred, std 0 only centres
    x = {"t2m": np.full((2, 4, 6), 281, np.float32), "z": np.ones((2, 2, 4, 6), np.int16)}
    out = norm(x)
    np.testing.assert_array_equal(out["t2m"], 1.0)
    assert out["z"].dtype == np.float64  # integers become float64, as (x - mean) / std does
    np.testing.assert_array_equal(out["z"][:, 0], 0.0)
    np.testing.assert_array_equal(out["z"][:, 1], -0.25)
    with pytest.raises(ValueError, match="no statistics for variable 'z'"):
        normalizer({"t2m": hand["t2m"]}, gen.layouts)
    with pytest.raises(ValueError, match="2 channels"):
        normalizer({**hand, "z": {"mean": [1.0, 2.0, 3.0], "std": [1.0, 1.0, 1.0]}}, gen.layouts)
    with pytest.raises(TypeError):
        normalizer([1, 2], gen.layouts)
    alone = ds.insitu.batches(m, "train", variables=["z"], output="numpy")
    with pytest.raises(ValueError, match="one channel here"):
        normalizer({"z": hand["z"]}, alone.layouts)
    # hand-written lists follow the "dims" given; a window dim is never taken for a channel dim
    win = ds.insitu.batches(m, "train", variables=["t2m", "lsm"], output="numpy", window={"time": 2})
    plain = {"t2m": {"mean": 1.0, "std": 2.0}, "lsm": {"mean": 0.0, "std": 1.0}}
    norm = normalizer(plain, win.layouts, kept=("time",))
    np.testing.assert_array_equal(norm({"t2m": np.full((1, 2, 4, 6), 3.0, np.float32)})["t2m"], 1.0)
    with pytest.raises(ValueError, match="one channel here"):
        normalizer({**plain, "t2m": {"mean": [1.0, 2.0], "std": [1.0, 1.0]}}, win.layouts, kept=("time",))
    swapped = {"t2m": {"mean": [0.0] * 24, "std": [float(i) + 1 for i in range(24)], "dims": ["lon", "lat"]},
               "z": hand["z"]}
    norm = normalizer(swapped, gen.layouts)
    got = norm({"t2m": np.ones((1, 4, 6), np.float32)})["t2m"][0]
    np.testing.assert_array_equal(got, 1.0 / (np.arange(24).reshape(6, 4).T + 1).astype(np.float32))


# ----------------------------------------------------------------------------- wired into the API
wired = pytest.mark.skipif(not hasattr(InsituAccessor, "stats"),
                           reason="ds.insitu.stats / batches(normalize=) not wired into the accessor yet")


@wired
def test_accessor_stores_stats_on_the_manifest(levels_path, tmp_path):
    ds = xinsitu.open_zarr(levels_path)
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.4})
    st = ds.insitu.stats(m, "train", variables=["t2m", "tp", "z"])
    assert m.stats is st and st == compute_stats(ds, m, "train", variables=["t2m", "tp", "z"])
    m.to_json(tmp_path / "m.json")
    assert xinsitu.SplitManifest.from_json(tmp_path / "m.json").stats == st
    assert ds.insitu.stats(m)["split"] == "train"  # default split, default variables


@wired
@pytest.mark.parametrize("output", ["numpy", "xarray"])
def test_batches_normalize(levels_path, output):
    ds = xinsitu.open_zarr(levels_path)
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.4})
    names = ["t2m", "tp", "z"]
    st = ds.insitu.stats(m, "train", variables=names)
    kw = dict(variables=names, shuffle=False, batch_size=7)
    plain = ds.insitu.batches(m, "val", output="numpy", **kw)
    normed = ds.insitu.batches(m, "val", output=output, normalize=m.stats, **kw)
    norm = normalizer(st, plain.layouts)
    for a, b in zip(plain, normed, strict=True):
        exp = norm(a)
        for v in names:
            got = b[v].values if output == "xarray" else b[v]
            assert got.dtype == a[v].dtype
            np.testing.assert_array_equal(got, exp[v])
    s = normed.sample(2)  # inspection shows the normalised values too
    first = m.edges["time"][m.splits["val"][0]]
    ref = ds.t2m.isel(time=first + 2)
    np.testing.assert_array_equal(s.t2m.values, ((ref - st["t2m"]["mean"]) / st["t2m"]["std"]).values)


@wired
def test_stacked_normalize_per_channel(levels_path):
    ds = xinsitu.open_zarr(levels_path)
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.4})
    names = ["t2m", "z"]
    st = ds.insitu.stats(m, "train", variables=names)
    gen = ds.insitu.batches(m, "train", variables=names, output="numpy", stack=True, normalize=st,
                            shuffle=False, batch_size=1000)
    x = next(iter(gen))
    assert x.dtype == np.float32 and gen.channels == st["channels"]
    # over the split it was computed on, every channel has mean ~0 and std ~1
    flat = x.transpose(1, 0, 2, 3).reshape(len(gen.channels), -1).astype(np.float64)
    np.testing.assert_allclose(flat.mean(axis=1), 0, atol=1e-5)
    np.testing.assert_allclose(flat.std(axis=1), 1, atol=1e-5)
    means = [st["t2m"]["mean"], *st["z"]["mean"]]
    assert np.ptp(means) > 1000  # the channels really had different scales


def test_state_records_normalisation(tmp_path):
    from xinsitu.synthetic import write_era5_like

    path = tmp_path / "n.zarr"
    write_era5_like(path, nt=48, ny=4, nx=6, chunk_time=8)
    ds = xinsitu.open_zarr(str(path))
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    st = ds.insitu.stats(m, "train")
    gen = ds.insitu.batches(m, "train", normalize=st, batch_size=4, output="numpy")
    state = gen.state_dict()
    assert state["normalize"] is not None
    plain = ds.insitu.batches(m, "train", batch_size=4, output="numpy")
    assert plain.state_dict()["normalize"] is None
    with pytest.raises(ValueError, match="normalize"):
        plain.load_state_dict(state)


# ----------------------------------------------------------------------------- parts and merge (issue 37)
def parts_of(run, n: int, seed: int) -> list:
    """The ``n`` parts of a job, through JSON, in a shuffled order (as they arrive from workers)."""
    parts = [json.loads(json.dumps(run((i, n)), allow_nan=False)) for i in range(n)]
    np.random.default_rng(seed).shuffle(parts)
    return parts


def same(a: dict, b: dict) -> bool:
    """Equal to the bit (floats written exactly by json)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@pytest.mark.parametrize("case", ["gap", "random chunks", "levels", "time and lat blocks"])
@pytest.mark.slow
def test_parts_merge_to_the_bits_of_one_pass(era5_path, levels_path, case):
    """Any number of parts, merged in any order, give the very bits of ``stats()`` (diffs included): the
    sums are exact; the pairs across a part's edge are counted once (the earlier part reads a halo)."""
    kw: dict = {"diffs": "time"}
    if case == "levels":
        ds = xinsitu.open_zarr(levels_path)
        m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.4})
        kw["stack"] = ["level"]
    else:
        ds = xinsitu.open_zarr(era5_path)
        if case == "gap":
            m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.2, "test": 0.2}, gap=1)
        elif case == "random chunks":
            m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.4}, contiguous=False, seed=3)
        else:
            m = ds.insitu.split(["time", "lat"], fractions={"train": 0.6, "val": 0.4}, contiguous=False, seed=2,
                                block={"time": 5, "lat": 2})
    whole = ds.insitu.stats(m, "train", **kw)
    units = len(m.splits["train"])
    for n in (1, 2, 3, units - 1, units + 2):
        got = xinsitu.merge_stats(parts_of(lambda p: ds.insitu.stats_part(m, "train", part=p, **kw), n, n))
        assert same(got, whole), n


def diff_oracle(x: np.ndarray, inside: np.ndarray) -> np.ndarray:
    """numpy float64 one-step differences along axis 0 of ``x``, for pairs whose two positions are inside the
    split (``inside``: bool, broadcast like ``x``), NaNs left out."""
    both = inside[:-1] & inside[1:]
    d = (x[1:].astype(np.float64) - x[:-1].astype(np.float64))[np.broadcast_to(both, x[1:].shape)]
    return d[~np.isnan(d)]


@pytest.mark.parametrize("case", ["gap", "random chunks", "blocks inside chunks", "time and lat blocks"])
def test_diffs_match_numpy(era5_path, case):
    """``diffs="time"``: mean and std of x[t+1] - x[t] over the pairs both in the split -- never across a
    gap, another split's chunks or blocks -- pairs across chunk and block edges inside a run included."""
    ds = xinsitu.open_zarr(era5_path)
    m = {"gap": lambda: ds.insitu.split("time", fractions={"val": 0.2, "train": 0.6, "test": 0.2}, gap=1),
         "random chunks": lambda: ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5}, contiguous=False,
                                                  seed=4),
         "blocks inside chunks": lambda: ds.insitu.split("time", fractions={"train": 0.7, "val": 0.3},
                                                         contiguous=False, seed=1, block={"time": 3}),
         "time and lat blocks": lambda: ds.insitu.split(["time", "lat"], fractions={"train": 0.6, "val": 0.4},
                                                        contiguous=False, seed=2, block={"time": 5, "lat": 2}),
         }[case]()
    st = ds.insitu.stats(m, "train", diffs="time", variables=["t2m", "tp", "z500", "lsm"])
    inside = split_positions(m, "train")  # over m.dims
    if inside.ndim == 2:  # (time, lat): broadcast over lon
        inside = inside[:, :, None]
    else:
        inside = inside[:, None, None]
    runs = np.flatnonzero(np.diff(inside[:, 0, 0].astype(int)))
    assert len(runs) >= 2 or case == "time and lat blocks"  # the split has edges inside the archive
    for v in ("t2m", "tp", "z500"):
        d = diff_oracle(ds[v].values, inside)
        e = st[v]
        assert e["diff_count"] == d.size and e["diff_dim"] == "time"
        np.testing.assert_allclose([e["diff_mean"], e["diff_std"]], [d.mean(), d.std()], rtol=RTOL, atol=1e-12)
    assert st["lsm"]["diff_mean"] is None and st["lsm"]["diff_count"] == 0  # no time dim: no differences
    assert "diff_mean" not in ds.insitu.stats(m, "train")["t2m"]


def test_diffs_per_level_channel(levels_path):
    ds = xinsitu.open_zarr(levels_path)
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.4})
    st = ds.insitu.stats(m, "train", stack=["level"], diffs="time")
    inside = split_positions(m, "train")
    z = ds["z"].values
    for k in range(len(LEVELS)):
        d = diff_oracle(z[:, k], inside[:, None, None])
        np.testing.assert_allclose([st["z"]["diff_mean"][k], st["z"]["diff_std"][k]], [d.mean(), d.std()], rtol=RTOL)
        assert st["z"]["diff_count"][k] == d.size
    assert st["z"]["channels"] == ["z_500", "z_850"] and isinstance(st["t2m"]["diff_std"], float)
    json.dumps(st, allow_nan=False)


def test_bad_parts_and_diffs_arguments(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    with pytest.raises(ValueError, match="diffs='lat'"):
        ds.insitu.stats(m, "train", diffs="lat")
    with pytest.raises(TypeError, match="diffs"):
        ds.insitu.stats(m, "train", diffs=["time"])
    for part, error in (((3, 3), ValueError), ((0, 0), ValueError), ("0/3", TypeError), ((0.0, 2), TypeError),
                        ((True, 2), TypeError)):
        with pytest.raises(error, match="part"):
            ds.insitu.stats_part(m, "train", part=part)
    with pytest.raises(TypeError, match="part"):
        ds.insitu.stats_part(m, "train")  # part= is required


def test_merge_refuses_other_jobs_and_missing_parts(era5_path, tmp_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    parts = [ds.insitu.stats_part(m, "train", part=(i, 3)) for i in range(3)]
    xinsitu.merge_stats(json.dumps(p) for p in parts)  # JSON text is read too
    with pytest.raises(ValueError, match=r"part\(s\) \[1\] missing"):
        xinsitu.merge_stats([parts[0], parts[2]])
    with pytest.raises(ValueError, match=r"part\(s\) \[2\] given twice"):
        xinsitu.merge_stats([*parts, parts[2]])
    for other in (ds.insitu.stats_part(m, "val", part=(1, 3)),
                  ds.insitu.stats_part(m, "train", part=(1, 3), diffs="time"),
                  ds.insitu.stats_part(m, "train", part=(1, 3), variables=["t2m"])):
        with pytest.raises(ValueError, match="different jobs"):
            xinsitu.merge_stats([parts[0], other, parts[2]])
    # a task that opened another selection of the archive: another size, or the same size elsewhere
    north, south = ds.isel(lat=slice(0, 2)), ds.isel(lat=slice(2, 4))
    for mixed in ([parts[0], north.insitu.stats_part(m, "train", part=(1, 3)), parts[2]],
                  [north.insitu.stats_part(m, "train", part=(0, 2)), south.insitu.stats_part(m, "train", part=(1, 2))]):
        with pytest.raises(ValueError, match=r"different jobs \(they differ in \['selection'\]\)"):
            xinsitu.merge_stats(mixed)
    # a task that opened another archive of the same geometry (a re-processed copy beside the first)
    copied = tmp_path / "copy.zarr"
    shutil.copytree(era5_path, copied)
    other = xinsitu.open_zarr(str(copied)).insitu.stats_part(m, "train", part=(1, 3))
    with pytest.raises(ValueError, match=r"different jobs \(they differ in \['archive'\]\)"):
        xinsitu.merge_stats([parts[0], other, parts[2]])
    with pytest.raises(ValueError, match="different numbers of shares"):
        xinsitu.merge_stats([*parts, ds.insitu.stats_part(m, "train", part=(0, 2))])
    bad = json.loads(json.dumps(parts[1]))
    bad["stats"]["t2m"][0]["s1"] = "zz"  # a damaged sum
    with pytest.raises(ValueError, match="part 1"):
        xinsitu.merge_stats([parts[0], bad, parts[2]])
    bad = json.loads(json.dumps(parts[1]))
    bad["job"]["split"] = "val"
    with pytest.raises(ValueError, match="edited or damaged"):
        xinsitu.merge_stats([bad])
    with pytest.raises(ValueError, match="no parts"):
        xinsitu.merge_stats([])
    with pytest.raises(ValueError, match="stats_part"):
        xinsitu.merge_stats([{"xinsitu": "validity_part"}])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.data(), st.sampled_from(["float32", "float64", "int16"]),
       st.floats(-1e5, 1e5), st.floats(1e-3, 1e3), st.floats(0, 0.5))
def test_merge_any_cut_any_order(size, data, dtype, loc, scale, nan_frac):
    """Values cut into pieces anyhow, pieces dealt into parts anyhow, parts merged in any order (through
    JSON): the same bits as all pieces added in one pass; min, max and NaN counts exactly numpy's."""
    from xinsitu.batches.moments import ChannelSums

    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    x = loc + scale * rng.standard_normal(size)
    if dtype != "int16":
        x[rng.random(size) < nan_frac] = np.nan
        if data.draw(st.booleans()):  # zeros of both signs as extremes: of pieces' -0.0 and 0.0, min takes -0.0
            x = np.abs(x) * (1 if rng.random() < .5 else -1)
            x[rng.integers(0, size, 2)] = [0.0, -0.0] if rng.random() < .5 else [-0.0, 0.0]
    x = x.astype(dtype) if dtype != "int16" else np.clip(x, -3e4, 3e4).astype(dtype)
    cuts = sorted(data.draw(st.lists(st.integers(0, size), max_size=12)))
    pieces = [chunk_moments(p) for p in np.split(x, cuts)]
    owner = data.draw(st.lists(st.integers(0, 5), min_size=len(pieces), max_size=len(pieces)))
    one = ChannelSums()
    for p in pieces:
        one.add(*p)
    parts = {k: ChannelSums() for k in set(owner)}
    for k, p in zip(owner, pieces, strict=True):
        parts[k].add(*p)
    order = data.draw(st.permutations(sorted(parts)))
    merged = ChannelSums()
    for k in order:
        merged.merge(ChannelSums.from_json(json.loads(json.dumps(parts[k].to_json(), allow_nan=False)), "part"))
    assert merged.to_json() == one.to_json()
    got = merged.result()
    assert repr(got) == repr(one.result())  # -0.0 and 0.0 told apart
    v = x.astype(np.float64)
    v = v[~np.isnan(v)]
    assert merged.nan_count == size - v.size and merged.count == v.size
    if v.size:
        assert (got[2], got[3]) == (v.min(), v.max())
        assert got[0] == pytest.approx(v.mean(), rel=1e-12, abs=1e-12 * scale)
        assert got[1] == pytest.approx(v.std(), rel=1e-6, abs=1e-9 * scale)


def test_parts_of_two_sets_of_files_of_one_geometry_are_never_merged(tmp_path):
    """NetCDF files read in place (``xinsitu.virtual.open_netcdf``), through dask (``xr.open_dataset(...,
    chunks=)``) or values in memory: parts of two archives of the same geometry (one all 0, one all 1) were
    merged into a mean of 0.5 that neither has; the files (or the values) a variable is read from are part
    of the job. Parts of the same files, from another process's open, still merge."""
    from xinsitu.virtual import open_netcdf

    files = []
    for k in (0, 1):
        f = tmp_path / f"member{k}.nc"
        xr.Dataset({"a": (("time", "x"), np.full((8, 3), float(k)))}, coords={"time": np.arange(8)}).to_netcdf(f)
        files.append(str(f))
    for opener in (open_netcdf, lambda f: xr.open_dataset(f, chunks={"time": 2}), lambda f: xr.open_dataset(f).load()):
        dss = [opener(f) for f in files]
        m = dss[0].insitu.split("time", fractions={"train": 1.0}, **({} if dss[0].a.chunks else {"block": {"time": 2}}))
        parts = [d.insitu.stats_part(m, "train", part=(i, 2)) for i, d in enumerate(dss)]
        with pytest.raises(ValueError, match=r"differ in \['archive'\]"):
            xinsitu.merge_stats(parts)
        again = opener(files[0])
        same = [dss[0].insitu.stats_part(m, "train", part=(0, 2)), again.insitu.stats_part(m, "train", part=(1, 2))]
        assert xinsitu.merge_stats(same)["a"]["mean"] == 0.0
