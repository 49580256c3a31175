"""Inputs and targets from two archives through ``xr.merge([a, b])``: different chunking along time
and a static field. Batches equal plain xarray's merge; a split made on the merge puts every chunk
of every variable (and so every sample, window included) in one split only."""

from __future__ import annotations

import math

import numpy as np
import pytest
import xarray as xr

import xinsitu
from tests.conftest import oracle
from xinsitu.synthetic import era5_like

NT, NY, NX = 100, 6, 10


def write_two(root, ct_a: int, ct_b: int) -> tuple[str, str]:
    """Archive a: inputs t2m, u10 (time chunks ct_a) and a static lsm; archive b: target tp (ct_b),
    int16-packed as in the synthetic archive."""
    ds = era5_like(nt=NT, ny=NY, nx=NX)
    a, b = str(root / f"inputs_{ct_a}.zarr"), str(root / f"targets_{ct_b}.zarr")
    ds[["t2m", "u10", "lsm"]].to_zarr(a, mode="w", zarr_format=3, consolidated=True,
                                      encoding={v: {"chunks": (ct_a, NY, NX)} for v in ("t2m", "u10")})
    enc = {"tp": {"chunks": (ct_b, NY, NX), "dtype": "int16", "scale_factor": 0.001, "add_offset": 30.0,
                  "_FillValue": -32768}}
    ds[["tp"]].to_zarr(b, mode="w", zarr_format=2, consolidated=True, encoding=enc)
    return a, b


GRIDS = [(24, 6), (8, 6), (12, 9)]


@pytest.fixture(scope="module", params=GRIDS, ids=[f"{a}v{b}" for a, b in GRIDS])
def two(request, tmp_path_factory):
    ct_a, ct_b = request.param
    a, b = write_two(tmp_path_factory.mktemp("multi"), ct_a, ct_b)
    return a, b, ct_a, ct_b


def merged(a: str, b: str) -> xr.Dataset:
    return xr.merge([xinsitu.open_zarr(a), xinsitu.open_zarr(b)])


def test_merged_grid_is_the_common_chunk_edges(two):
    """The split grid of a merge: positions where *every* variable starts a chunk (the common edges,
    every lcm(ct_a, ct_b) steps), so a chunk block is whole chunks of each archive."""
    a, b, ct_a, ct_b = two
    ds = merged(a, b)
    step = math.lcm(ct_a, ct_b)
    edges = ds.insitu.geometry.edges["time"]
    np.testing.assert_array_equal(edges, np.unique(np.r_[np.arange(0, NT, step), NT]))
    assert ds.insitu.geometry.dims["time"] == tuple(sorted({ct_a, ct_b})) or ct_a == ct_b


@pytest.mark.parametrize("window", [None, 3])
def test_splits_leak_free_across_both_grids(two, window):
    a, b, ct_a, ct_b = two
    ds = merged(a, b)
    splits = {"train": 0.6, "val": 0.2, "test": 0.2} if math.lcm(ct_a, ct_b) <= 24 else {"train": 0.6, "val": 0.4}
    m = ds.insitu.split("time", fractions=splits)
    owner_a: dict[int, set[str]] = {}
    owner_b: dict[int, set[str]] = {}
    seen: dict[int, str] = {}
    for split in m.splits:
        gen = ds.insitu.batches(m, split, batch_size=5, output="xarray", shuffle=True, seed=1,
                                window=None if window is None else {"time": window}, variables=["t2m", "tp"])
        for batch in gen:
            pos = np.searchsorted(ds.time.values, batch.time.values)  # (sample,) or (sample, window)
            for p in np.atleast_2d(pos.T).T.reshape(len(batch.sample), -1):
                for t in p:
                    owner_a.setdefault(int(t) // ct_a, set()).add(split)
                    owner_b.setdefault(int(t) // ct_b, set()).add(split)
                key = int(p[0])
                assert key not in seen, "a sample drawn twice"
                seen[key] = split
    # every chunk of either archive feeds one split only: no value (and no chunk) crosses a split
    assert all(len(s) == 1 for s in owner_a.values()), owner_a
    assert all(len(s) == 1 for s in owner_b.values()), owner_b
    if window is None:  # every position of every split block drawn exactly once
        assert sorted(seen) == sorted(p for s in m.splits for blk in m.blocks(s)
                                      for p in range(*_span(ds, blk)))


def _span(ds: xr.Dataset, blk: int) -> tuple[int, int]:
    e = ds.insitu.geometry.edges["time"]
    return int(e[blk]), int(e[blk + 1])


@pytest.mark.parametrize("output", ["xarray", "numpy"])
@pytest.mark.slow
def test_batches_equal_plain_xarray_merge(two, output):
    a, b, _, _ = two
    ds = merged(a, b)
    plain = xr.merge([xr.open_zarr(a, chunks=None), xr.open_zarr(b, chunks=None)])
    m = ds.insitu.split("time", fractions={"train": 0.7, "val": 0.3})
    names = ["t2m", "u10", "tp", "lsm"]
    kw = dict(batch_size=6, shuffle=True, seed=5, block_chunks=2, variables=names)
    ref_gen = ds.insitu.batches(m, "train", output="xarray", **kw)
    gen = ds.insitu.batches(m, "train", output=output, **kw)
    n = 0
    for ref, got in zip(ref_gen, gen, strict=True):
        pos = np.searchsorted(plain.time.values, ref.time.values)
        exp = oracle(plain[names], ["time"], pos[:, None])
        if output == "xarray":
            xr.testing.assert_identical(got, exp)
        else:
            for v in names:
                assert got[v].dtype == exp[v].dtype and got[v].shape == exp[v].shape, v
                assert np.array_equal(got[v], exp[v].values, equal_nan=True), v
        n += len(pos)
    assert n == m.positions("train")


@pytest.mark.parametrize("block_chunks", [16, 1])
def test_static_field_read_once_per_epoch(two, block_chunks):
    """lsm (no time dim) comes once per batch without a sample axis, and is read once per epoch."""
    a, b, ct_a, ct_b = two
    ds = merged(a, b)
    m = ds.insitu.split("time", fractions={"train": 0.7, "val": 0.3})
    gen = ds.insitu.batches(m, "train", batch_size=4, output="numpy", variables=["t2m", "tp", "lsm"],
                            block_chunks=block_chunks)
    batches = list(gen)
    assert all(bt["lsm"].shape == (NY, NX) for bt in batches)
    n = m.positions("train")
    expected = math.ceil(n / ct_a) + math.ceil(n / ct_b) + 1  # t2m's chunks, tp's chunks, lsm once
    assert gen.io_stats["chunks"] == expected
