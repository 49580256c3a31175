"""xinsitu.batches.buffer.BufferLoader: a loaded buffer gathers to exactly what ``ds.isel`` gives for its
samples, also once its arrays are recycled into the next buffer."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import xinsitu
from xinsitu.batches.buffer import BufferLoader
from xinsitu.io import loop as _loop
from xinsitu.io.reader import Reader


@pytest.fixture
def path(tmp_path) -> str:
    rng = np.random.default_rng(1)
    nt = 30
    ds = xr.Dataset(
        {"a": (("time", "y", "x"), rng.standard_normal((nt, 3, 5)).astype("float32")),
         "b": (("time",), np.arange(nt, dtype="float64") * 1.5),
         "s": (("y", "x"), rng.standard_normal((3, 5)).astype("float32"))},
        coords={"time": pd.date_range("2000-01-01", periods=nt, freq="D")})
    p = str(tmp_path / "b.zarr")
    ds.to_zarr(p, encoding={"a": {"chunks": (4, 3, 5)}, "b": {"chunks": (4,)}}, zarr_format=3, consolidated=False)
    return p


def _gen(path, **kw):
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    return ds, ds.insitu.batches(m, "train", batch_size=4, output="numpy", block_chunks=2, seed=5, **kw)


def _expect(ds, names, starts, window=None):
    t = starts[:, 0]
    if window:
        ind = xr.DataArray(t[:, None] + np.arange(window), dims=("sample", "time"))
        ref = ds[names].isel(time=ind)
    else:
        ref = ds[names].isel(time=xr.DataArray(t, dims="sample"))
    return ref.load()


def _check_all(loader, plan, ds, names, window=None):
    seen = []
    for j in range(plan.n_buffers):
        buf = _loop.run(loader.load(plan, j))
        rows = np.arange(len(buf.ids))
        got = loader.gather(buf, rows)
        ref = _expect(ds, names, buf.starts, window)
        for n in names:
            exp = ref[n]
            if "sample" in exp.dims:
                exp = exp.transpose("sample", ...)
            assert got[n].dtype == exp.dtype
            np.testing.assert_array_equal(got[n], exp.values, err_msg=f"buffer {j} var {n}")
        seen.append(buf.ids)
        loader.recycle(buf)  # the next buffer reuses these arrays: its values must still be its own
    return np.concatenate(seen)


def test_load_gather_equals_isel(path):
    ds, gen = _gen(path, variables=["a", "b", "s"])  # s: no split dim, read once into a static slot
    assert gen.layouts["s"].static and not gen.layouts["a"].static
    plan = gen.plan()
    assert plan.n_buffers > 2  # several buffers: recycling is exercised
    loader = BufferLoader(gen.space, gen.layouts, Reader())
    ids = _check_all(loader, plan, ds, list(gen.layouts))
    assert np.array_equal(np.sort(ids), np.arange(gen.n_samples))


def test_window_gather_equals_isel(path):
    ds, gen = _gen(path, window={"time": 3})
    plan = gen.plan()
    loader = BufferLoader(gen.space, gen.layouts, Reader())
    _check_all(loader, plan, ds, list(gen.layouts), window=3)


def test_gather_subset_rows_and_into(path):
    ds, gen = _gen(path, variables=["a"])
    plan = gen.plan()
    loader = BufferLoader(gen.space, gen.layouts, Reader())
    buf = _loop.run(loader.load(plan, 1))
    rows = np.array([len(buf.ids) - 1, 0])
    into = {"a": np.full((2, 3, 5), np.nan, dtype="float32")}
    got = loader.gather(buf, rows, into=into)
    ref = _expect(ds, ["a"], buf.starts[rows])
    np.testing.assert_array_equal(into["a"], ref["a"].transpose("sample", ...).values)
    assert got["a"] is into["a"] or np.shares_memory(got["a"], into["a"])


@pytest.mark.parametrize("equal", [True, False])
def test_piece_ids_match_the_per_piece_definition(equal):
    """Pieces' global sample ids, computed for all pieces at once (``plan.piece_ids``: a buffer's ids,
    and the order an epoch yields), equal the definition: piece ``s`` is samples ``lo..hi`` of its
    unit, whose ids start at the unit's offset."""
    from xinsitu.index.plan import piece_ids
    from xinsitu.index.sampling import EqualOffsets

    rng = np.random.default_rng(0)
    for _ in range(50):
        n_units = int(rng.integers(1, 40))
        sizes = np.full(n_units, 7) if equal else rng.integers(1, 9, n_units)
        offsets = EqualOffsets(n_units, 7) if equal else np.concatenate([[0], np.cumsum(sizes)])
        k = int(rng.integers(0, 12))
        units = rng.choice(n_units, size=min(k, n_units), replace=False)
        lo = np.array([rng.integers(0, sizes[u]) for u in units], dtype=np.int64)
        hi = np.array([rng.integers(a + 1, sizes[u] + 1) for a, u in zip(lo, units, strict=True)], dtype=np.int64)
        exp = np.concatenate([int(offsets[int(u)]) + np.arange(a, b) for u, a, b in zip(units, lo, hi, strict=True)]
                             or [np.zeros(0)])
        np.testing.assert_array_equal(piece_ids(offsets, units, lo, hi), exp)


def _six_variables(tmp_path, chunk_time: int, **kw):
    """A generator (batches of 6, the whole archive) over six float32 variables of one shape, 48 steps in chunks
    of ``chunk_time`` (a weather model's level variables, in small)."""
    rng = np.random.default_rng(0)
    ds = xr.Dataset({f"v{i}": (("time", "x"), rng.random((48, 5), dtype="f4")) for i in range(6)})
    path = str(tmp_path / "six.zarr")
    ds.to_zarr(path, encoding={v: {"chunks": (chunk_time, 5)} for v in ds})
    opened = xinsitu.open_zarr(path)
    m = opened.insitu.split("time", fractions={"train": 1.0})
    return opened.insitu.batches(m, "train", batch_size=6, output="numpy", **kw)


def test_buffers_of_variables_sharing_a_shape_take_no_new_memory_epoch_after_epoch(tmp_path):
    """Six variables of one shape (a weather model's level variables) shared a pool keeping four arrays per
    shape: every buffer made two anew, epoch after epoch (about 1 GB of new memory a 1° epoch, each page
    faulted in: 15-20 % of an epoch). The arrays made now stay within what the buffers an epoch may hold at
    once use, however many epochs run (18 more an epoch before: 126 after six)."""
    from xinsitu.batches.pipeline import MAX_READ_AHEAD_BUFFERS

    gen = _six_variables(tmp_path, 4, block_chunks=2)
    for e in range(6):
        gen.set_epoch(e)
        assert len(list(gen)) == 8
    made = gen._buffer_loader()._pool.made
    assert 0 < made <= 6 * (MAX_READ_AHEAD_BUFFERS + 2), made  # (6 arrays a buffer, 8 buffers at most at once)


def test_raw_arrays_of_converted_variables_are_made_once_not_every_batch(tmp_path):
    """The direct path (one sample a chunk) decodes a variable that is converted (``dtype=``, CF decoding) into
    a raw array first. Its pool kept 2 a shape, so a weather model's level variables (6 of one shape) made 4
    arrays anew each batch, every page faulted in: it keeps what the batches read at once use."""
    from xinsitu.batches.pipeline import MAX_READ_AHEAD_BUFFERS

    gen = _six_variables(tmp_path, 1, dtype="float64")
    assert gen.buffer_reason is None  # the direct path
    for e in range(6):
        gen.set_epoch(e)
        got = list(gen)
        assert len(got) == 8 and got[0]["v0"].dtype == np.float64
    made = gen._direct._raw.made
    assert 0 < made <= 6 * (MAX_READ_AHEAD_BUFFERS + 2), made  # (against 6 epochs x 8 batches x 4 = 192 before)
