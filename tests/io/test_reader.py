"""xinsitu.io.reader: a region read equals ``ds.isel``; chunks shared by regions are read once;
a chunk never written reads as the fill value."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
import zarr

import xinsitu
from xinsitu.index.source import resolve
from xinsitu.io import loop as _loop
from xinsitu.io.reader import Reader


@pytest.fixture
def path(tmp_path) -> str:
    rng = np.random.default_rng(0)
    ds = xr.Dataset({"a": (("t", "y", "x"), rng.standard_normal((20, 4, 6)).astype("float32"))})
    p = str(tmp_path / "r.zarr")
    ds.to_zarr(p, encoding={"a": {"chunks": (5, 2, 6)}}, zarr_format=3, consolidated=False)
    return p


def test_read_region_equals_isel(path):
    ds = xinsitu.open_zarr(path)
    src = resolve(ds, ["a"])["a"]
    r = Reader()
    got = _loop.run(r.read(src, {"t": (3, 13), "y": (1, 4)}))
    exp = xr.open_zarr(path, chunks=None).a.isel(t=slice(3, 13), y=slice(1, 4)).values
    assert got.dtype == exp.dtype
    np.testing.assert_array_equal(got, exp)
    # t 3..12 touches time chunks 0,1,2; y 1..3 touches y chunks 0,1: six chunks
    assert r.counters.chunks == 6


def test_read_into_out(path):
    ds = xinsitu.open_zarr(path)
    src = resolve(ds, ["a"])["a"]
    out = np.full((4, 4, 6), -1.0, dtype="float32")
    got = _loop.run(Reader().read(src, {"t": (16, 20)}, out=out))
    exp = xr.open_zarr(path, chunks=None).a.isel(t=slice(16, 20)).values
    np.testing.assert_array_equal(out, exp)
    np.testing.assert_array_equal(got, exp)


def test_read_many_reads_shared_chunk_once(path):
    ds = xinsitu.open_zarr(path)
    src = resolve(ds, ["a"])["a"]
    r = Reader()
    # both regions lie in time chunk 1 (positions 5..9), all y chunks: 2 chunks in all
    a, b = _loop.run(r.read_many(src, [({"t": (5, 7)}, None), ({"t": (6, 10)}, None)]))
    exp = xr.open_zarr(path, chunks=None).a
    np.testing.assert_array_equal(a, exp.isel(t=slice(5, 7)).values)
    np.testing.assert_array_equal(b, exp.isel(t=slice(6, 10)).values)
    assert r.counters.chunks == 2


def test_missing_chunk_reads_fill_value(tmp_path):
    p = str(tmp_path / "m.zarr")
    ds = xr.Dataset({"v": (("t", "x"), np.arange(40, dtype="float64").reshape(10, 4))})
    ds.to_zarr(p, encoding={"v": {"chunks": (5, 4)}}, zarr_format=3, consolidated=False)
    arr = zarr.open_array(p, path="v")
    store = arr.store
    key = "v/" + arr.metadata.encode_chunk_key((1, 0))
    import asyncio
    asyncio.run(store.delete(key))
    ref = xr.open_zarr(p, chunks=None).v.values  # zarr's reading: NaN fill for the missing chunk
    assert np.isnan(ref[5:]).all()
    src = resolve(xinsitu.open_zarr(p), ["v"])["v"]
    r = Reader()
    got = _loop.run(r.read(src, {"t": (0, 10)}))
    np.testing.assert_array_equal(got, ref)
    assert r.counters.missing == 1
    r2 = Reader()
    r2.on_missing = "raise"
    with pytest.raises(OSError):
        _loop.run(r2.read(src, {"t": (3, 8)}))


def test_one_completion_step_takes_any_destination(path):
    """``decode.place`` lands a chunk's bytes in any destination with ``decode``/``fill`` (the seam a
    device buffer plugs into) and says how: decoded with its byte count, or missing and filled. The
    values equal xarray's for that chunk; ``Reader.settle`` counts it and applies ``missing=``."""
    from pathlib import Path

    from xinsitu.codecs.cpu import ChunkDecoder
    from xinsitu.io.place import DECODED, MISSING, place
    from xinsitu.io.reader import ChunkReadError, Route

    class Recorded:  # a destination that is not a host array slot
        def __init__(self) -> None:
            self.values: np.ndarray | None = None

        def decode(self, dec, raw) -> None:
            self.values = dec.decode_sync(raw)

        def fill(self, dec) -> None:
            self.values = np.broadcast_to(dec.fill(), dec.shape)

    ds = xinsitu.open_zarr(path)
    src = resolve(ds, ["a"])["a"]
    dec = ChunkDecoder(src.array)
    raw = (Path(path) / "a" / dec.key((1, 1, 0))).read_bytes()
    dest = Recorded()
    got = place(dec, raw, dest)
    assert got.status == DECODED and got.nbytes == len(raw) and got.took >= 0
    exp = xr.open_zarr(path, chunks=None).a.isel(t=slice(5, 10), y=slice(2, 4)).values
    np.testing.assert_array_equal(dest.values, exp)
    empty = Recorded()
    assert place(dec, None, empty).status == MISSING
    assert empty.values is not None and empty.values.shape == dec.shape

    r = Reader()
    route = Route(src, dec, r._store(src))
    r.settle(route, (1, 1, 0), got)
    r.settle(route, (0, 0, 0), place(dec, None, Recorded()))
    assert (r.counters.chunks, r.counters.bytes_read, r.counters.missing) == (2, len(raw), 1)
    assert r.last_missing == ("a", (0, 0, 0), "a/" + dec.key((0, 0, 0)))
    r.on_missing = "raise"
    with pytest.raises(ChunkReadError, match="missing='raise'") as err:
        r.settle(route, (0, 0, 0), place(dec, None, Recorded()))
    assert err.value.var == "a" and err.value.chunk == (0, 0, 0)
