"""xinsitu.batches.pipeline.EpochRun: batches in plan order, a clean close mid-epoch, errors delivered."""

from __future__ import annotations

import asyncio

import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr

import xinsitu
from xinsitu.batches.buffer import BufferLoader
from xinsitu.batches.pipeline import EpochRun
from xinsitu.io.reader import ChunkReadError, Reader

NT = 40


@pytest.fixture
def path(tmp_path) -> str:
    rng = np.random.default_rng(4)
    ds = xr.Dataset({"a": (("time", "x"), rng.standard_normal((NT, 3)).astype("float32"))},
                    coords={"time": pd.date_range("2003-01-01", periods=NT, freq="D")})
    p = str(tmp_path / "p.zarr")
    ds.to_zarr(p, encoding={"a": {"chunks": (4, 3)}}, zarr_format=3, consolidated=False)
    return p


def _parts(path, shuffle=True):
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", batch_size=3, output="numpy", block_chunks=1, seed=7, shuffle=shuffle)
    reader = Reader()
    return ds, gen, reader, BufferLoader(gen.space, gen.layouts, reader)


def test_batches_in_plan_order(path):
    ds, gen, _, loader = _parts(path)
    plan = gen.plan()
    ids = gen.batch_ids()
    run = EpochRun(plan, 0, loader, gen.builder)
    try:
        got = list(run)
    finally:
        run.close()
    assert [i for i, _ in got] == list(range(plan.n_batches)) == list(range(len(ids)))
    values = ds.a.values
    for (_, b), i in zip(got, ids, strict=True):
        np.testing.assert_array_equal(b["a"], values[i])
    rep = run.report()
    assert rep["batches"] == plan.n_batches and rep["samples"] == NT


def test_start_mid_epoch(path):
    ds, gen, _, loader = _parts(path)
    ids = gen.batch_ids()
    run = EpochRun(gen.plan(), 5, loader, gen.builder)
    try:
        got = list(run)
    finally:
        run.close()
    assert [i for i, _ in got] == list(range(5, len(ids)))
    np.testing.assert_array_equal(got[0][1]["a"], ds.a.values[ids[5]])


def test_close_mid_epoch_stops_thread(path):
    _, gen, _, loader = _parts(path)
    run = EpochRun(gen.plan(), 0, loader, gen.builder)
    it = iter(run)
    i, _ = next(it)
    assert i == 0
    run.close()
    assert not run.thread.is_alive()
    assert run.io_future.done()


def test_load_error_reaches_consumer(path):
    arr = zarr.open_array(path, path="a")
    asyncio.run(arr.store.delete("a/" + arr.metadata.encode_chunk_key((6, 0))))  # times 24..27
    ds, gen, reader, loader = _parts(path, shuffle=False)
    reader.on_missing = "raise"
    run = EpochRun(gen.plan(), 0, loader, gen.builder)
    got = []
    try:
        with pytest.raises(ChunkReadError) as err:
            for i, b in run:
                got.append((i, b))
    finally:
        run.close()
    assert err.value.var == "a" and err.value.chunk == (6, 0)
    # every batch before the failing chunk's arrived, with its values
    assert len(got) == 24 // 3  # batches 0..7 hold times 0..23; batch 8 needs the chunk
    for i, b in got:
        np.testing.assert_array_equal(b["a"], ds.a.values[3 * i:3 * i + 3])
    assert not run.thread.is_alive()


@pytest.mark.parametrize(("far", "requests", "mb", "limit", "depth"), [
    (True, 64, 2.1, 256, 9),  # one sample per chunk over HTTP: twice the limit's requests, past 6 buffers
    (False, 64, 2.1, 256, 6),  # the same buffers of a local store (or a fixed limit's): 6 at most
    (True, 64, 50.0, 256, 5),  # large buffers of a far store: the limit's requests, 6 at most
    (True, 64, 2.1, 4096, 30),  # ... small ones while they hold 64 MB at most
    (False, 64, 2.1, 8, 6),  # small buffers of a local store: 32 MB of them, 6 at most
    (False, 16, 50.0, 4, 3),  # large buffers of a local store: as deep as it was
])
def test_read_ahead_fills_the_inflight_limit_within_its_bytes(far, requests, mb, limit, depth):
    """How many buffers an epoch keeps loading or loaded (``pipeline.read_ahead_depth``), from what the
    buffers read so far took: enough for the reader's in-flight limit of requests, or for
    ``READ_AHEAD_BYTES``, ``MAX_READ_AHEAD_BUFFERS`` at most; small buffers of a far store enough for
    twice the limit's requests, while they hold ``FAR_READ_AHEAD_BYTES`` at most; never shallower
    than it was (an epoch only deepens)."""
    from xinsitu.batches.pipeline import READ_AHEAD_BUFFERS, read_ahead_depth

    assert max(READ_AHEAD_BUFFERS, read_ahead_depth(limit, far, requests, mb * 2**20)) == depth
    assert read_ahead_depth(limit, far, 0, mb * 2**20) == 0  # every chunk from the cache: nothing in flight
