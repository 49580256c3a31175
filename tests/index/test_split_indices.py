"""A split's positions: ``m.indices(split)`` and ``m.isel(ds, split)`` against the manifest's own
record (``m.edges``, ``m.blocks``, ``m.positions``), property-tested on random grids without I/O,
and against the samples that ``batches()`` and the map-style dataset read."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from hypothesis import given, settings
from hypothesis import strategies as st

import xinsitu
from xinsitu.index.manifest import SplitManifest
from xinsitu.index.runs import Blocks
from xinsitu.index.split import block_edges, contiguous_split, random_split


@st.composite
def edges_of(draw, max_chunks: int = 9):
    """Chunk edges of one dim: chunks of 1..6 positions (the last one perhaps shorter)."""
    widths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=max_chunks))
    return np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)


@st.composite
def fractions(draw):
    k = draw(st.integers(1, 3))
    w = draw(st.lists(st.integers(1, 9), min_size=k, max_size=k))
    return {n: x / sum(w) for n, x in zip(["train", "val", "test"], w, strict=False)}


@st.composite
def manifests(draw):
    """A manifest made by the split functions on a random 1-, 2- or 3-dim grid (contiguous or
    random, with or without a gap); ``None`` where the grid cannot hold the splits."""
    ndim = draw(st.integers(1, 3))
    dims = ["time", "lat", "lon"][:ndim]
    edges = {d: draw(edges_of(max_chunks=12 if ndim == 1 else 5)) for d in dims}
    grid = tuple(len(edges[d]) - 1 for d in dims)
    fr, gap = draw(fractions()), draw(st.integers(0, 2))
    try:
        if ndim == 1 and draw(st.booleans()):
            splits = dict(contiguous_split(grid[0], fr, gap))
        else:
            splits = {k: Blocks.from_ids(v) for k, v in random_split(grid, fr, gap, draw(st.integers(0, 99))).items()}
    except ValueError:
        return None
    return SplitManifest(dims=dims, sizes={d: int(edges[d][-1]) for d in dims}, edges=edges, splits=splits,
                         labels={}, gap=gap)


def block_points(m: SplitManifest, split: str) -> list[tuple[int, ...]]:
    """The split's grid points by the manifest's record alone: block by block, in split order, each
    block's positions in C order over the split dims."""
    out: list[tuple[int, ...]] = []
    for b in m.blocks(split).tolist():
        idx = np.unravel_index(b, m.grid)
        ranges = [range(int(m.edges[d][i]), int(m.edges[d][i + 1])) for d, i in zip(m.dims, idx, strict=True)]
        out.extend(itertools.product(*ranges))
    return out


@settings(max_examples=300, deadline=None)
@given(manifests())
@pytest.mark.slow
def test_indices_are_the_blocks_positions(m):
    """Per split: one int64 array per split dim, all as long as ``m.positions(split)``; point k is
    ``(ind[d][k] for d in m.dims)``; the points are the split's blocks' positions, in split order
    and C order inside a block. Every grid point is in exactly one split's indices, or in none
    where its block is in none (a gap, or removed near another split)."""
    if m is None:
        return
    owner = np.full(m.grid, -1)
    for k, name in enumerate(m.splits):
        owner.ravel()[m.blocks(name)] = k
    seen = np.zeros([m.sizes[d] for d in m.dims], dtype=np.int64)
    for name in m.splits:
        ind = m.indices(name)
        assert list(ind) == m.dims
        for a in ind.values():
            assert a.dtype == np.int64 and a.ndim == 1 and len(a) == m.positions(name)
        points = list(zip(*(ind[d].tolist() for d in m.dims), strict=True))
        assert points == block_points(m, name)
        np.add.at(seen, tuple(ind[d] for d in m.dims), 1)
    assert seen.max(initial=0) <= 1  # no position in two splits (nor twice in one)
    # a position is in no split exactly where its block is in none
    block_of = [np.searchsorted(m.edges[d], np.arange(m.sizes[d]), side="right") - 1 for d in m.dims]
    in_none = owner[np.ix_(*block_of)] == -1
    assert np.array_equal(seen == 0, in_none)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 60), st.integers(1, 12), fractions(), st.integers(0, 2))
def test_indices_of_blocks_of_positions(size, n, fr, gap):
    """``split(..., block={dim: n})``: the blocks are runs of ``n`` positions (the last one shorter)."""
    e = block_edges(size, min(n, size))
    try:
        splits = dict(contiguous_split(len(e) - 1, fr, gap))
    except ValueError:
        return
    m = SplitManifest(dims=["x"], sizes={"x": size}, edges={"x": e}, splits=splits, labels={}, gap=gap,
                      block={"x": min(n, size)})
    got = np.concatenate([m.indices(k)["x"] for k in m.splits])
    want = np.concatenate([np.arange(e[b.starts[0]], e[b.stops[0]]) for b in m.splits.values()])
    assert np.array_equal(got, want)


def test_indices_of_a_huge_contiguous_split_are_runs():
    """A split of 10^6 chunks of 24: 2.4e7 positions, built from the runs (no per-block loop)."""
    e = np.arange(0, 24 * 10**6 + 1, 24, dtype=np.int64)
    m = SplitManifest(dims=["time"], sizes={"time": int(e[-1])}, edges={"time": e},
                      splits={"train": Blocks.range(0, 900_000), "val": Blocks.range(900_001, 10**6)}, labels={})
    ind = m.indices("val")["time"]
    assert len(ind) == m.positions("val") == 99_999 * 24
    assert ind[0] == 900_001 * 24 and ind[-1] == 24 * 10**6 - 1 and (np.diff(ind) == 1).all()


def test_unknown_split_and_bad_arguments():
    m = SplitManifest(dims=["time"], sizes={"time": 10}, edges={"time": [0, 5, 10]},
                      splits={"train": [0], "val": [1]}, labels={})
    with pytest.raises(ValueError, match="unknown split 'nope'"):
        m.indices("nope")
    with pytest.raises(TypeError, match="split"):
        m.indices(0)
    ds = xr.Dataset({"a": ("time", np.arange(10.0))})
    with pytest.raises(ValueError, match="unknown split"):
        m.isel(ds, "nope")
    with pytest.raises(TypeError, match="ds"):
        m.isel(np.arange(10), "train")
    with pytest.raises(ValueError, match="'time'"):
        m.isel(xr.Dataset({"a": ("x", np.arange(10.0))}), "train")
    with pytest.raises(ValueError, match="length 10"):
        m.isel(xr.Dataset({"a": ("time", np.arange(12.0))}), "train")


# ---------------------------------------------------------------- m.isel against real archives
@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    rng = np.random.default_rng(3)
    src = xr.Dataset({"a": (("time", "lat", "lon"), rng.standard_normal((40, 6, 8)).astype("f4")),
                      "lsm": (("lat", "lon"), rng.random((6, 8)).astype("f4"))},
                     coords={"time": pd.date_range("2000-01-01", periods=40, freq="D"),
                             "lat": np.linspace(50, 40, 6), "lon": np.arange(8.0)})
    path = tmp_path_factory.mktemp("ind") / "a.zarr"
    src.to_zarr(path, zarr_format=3, consolidated=True,
                encoding={"a": {"chunks": (5, 3, 4)}, "lsm": {"chunks": (3, 4)}})
    return xinsitu.open_zarr(str(path))


def test_isel_is_the_split_along_its_dim(archive):
    ds = archive
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.2, "test": 0.2}, gap=1)
    for name in m.splits:
        sub = m.isel(ds, name)
        idx = m.indices(name)["time"]
        xr.testing.assert_identical(sub, ds.isel(time=idx))
        xr.testing.assert_identical(m.isel(ds["a"], name), ds["a"].isel(time=idx))
        # the labels the manifest reports are the subset's first and last
        first, last = m.labels[name]["time"]
        assert pd.Timestamp(sub.time.values[0]).isoformat() == first
        assert pd.Timestamp(sub.time.values[-1]).isoformat() == last
    # one contiguous run is selected with a slice: a view, as ds.isel(time=slice(...)) gives
    assert m.indices("val")["time"].tolist() == list(range(25, 30))  # 8 chunks of 5: 4, gap, 1, gap, 1
    mem = ds.load()
    assert np.shares_memory(m.isel(mem, "val")["a"].values, mem["a"].values)
    # the split's samples, read by batches() and by the map-style dataset, are its isel
    gen = ds.insitu.batches(m, "val", batch_size=100, shuffle=False, output="xarray")
    b = next(iter(gen))
    ref = m.isel(ds, "val").rename(time="sample")
    assert np.array_equal(b["a"].values, ref["a"].values)
    d = ds.insitu.dataset(m, "val")
    assert np.array_equal(d.batch(range(len(d)))["a"], ref["a"].values)


def test_isel_refuses_a_split_over_several_dims_and_indices_select_its_points(archive):
    ds = archive
    m = ds.insitu.split(["lat", "lon"], fractions={"train": 0.5, "val": 0.5}, seed=0)
    with pytest.raises(ValueError, match="indices"):
        m.isel(ds, "val")
    ind = m.indices("val")
    pts = ds.isel({d: xr.DataArray(ind[d], dims="point") for d in m.dims})
    # the points, sampled one by one with over="time", are what the map-style dataset reads
    d = ds.insitu.dataset(m, "val", over="time", variables="a")
    got = d.batch(range(len(d)))["a"].reshape(len(ind["lat"]), ds.sizes["time"])
    assert np.array_equal(got, pts["a"].transpose("point", "time").values)


def test_isel_on_another_dataset_is_refused(archive):
    ds = archive
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    shifted = ds.assign_coords(time=ds.time + np.timedelta64(1, "D"))
    with pytest.raises(ValueError, match="time"):
        m.isel(shifted, "train")
