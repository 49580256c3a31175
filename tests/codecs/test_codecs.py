"""xinsitu.codecs.cpu.ChunkDecoder: a chunk's stored bytes decode to what zarr reads."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import xarray as xr
import zarr

from xinsitu.codecs.cpu import ChunkDecoder
from xinsitu.io import loop as _loop


def _write(tmp_path, compressors, zarr_format=3):
    p = str(tmp_path / f"c{zarr_format}.zarr")
    data = np.arange(6 * 8, dtype="int32").reshape(6, 8) * 7 - 100
    enc = {"chunks": (3, 4)}
    if zarr_format == 3:
        enc["compressors"] = compressors
    ds = xr.Dataset({"v": (("y", "x"), data)})
    ds.to_zarr(p, encoding={"v": enc}, zarr_format=zarr_format, consolidated=False)
    arr = zarr.open_array(p, path="v")
    return arr, data


def _raw(arr, coords):
    dec = ChunkDecoder(arr)
    key = "v/" + dec.key(coords)
    from zarr.core.buffer import default_buffer_prototype

    buf = asyncio.run(arr.store.get(key, prototype=default_buffer_prototype()))
    assert buf is not None
    return dec, buf.to_bytes()


@pytest.mark.parametrize("compressors", [None, [zarr.codecs.ZstdCodec()]], ids=["raw", "zstd"])
def test_decode_sync_equals_zarr(tmp_path, compressors):
    arr, data = _write(tmp_path, compressors)
    dec, raw = _raw(arr, (1, 1))
    assert dec.shape == (3, 4) and dec.dtype == np.dtype("int32")
    got = dec.decode_sync(raw)
    np.testing.assert_array_equal(got, arr[3:6, 4:8])
    np.testing.assert_array_equal(got, data[3:6, 4:8])


def test_decode_async_equals_zarr_v2(tmp_path):
    arr, data = _write(tmp_path, None, zarr_format=2)
    dec, raw = _raw(arr, (0, 1))
    got = _loop.run(dec.decode(raw))
    np.testing.assert_array_equal(got, data[0:3, 4:8])


def test_decode_into_fills_view(tmp_path):
    arr, data = _write(tmp_path, [zarr.codecs.ZstdCodec()])
    dec, raw = _raw(arr, (1, 0))
    out = np.full((3, 4), -1, dtype="int32")
    if not dec.decode_into(raw, out):
        pytest.skip("this codec chain cannot decode in place")
    np.testing.assert_array_equal(out, data[3:6, 0:4])
    # a destination of the wrong shape or dtype is refused, not written
    wrong = np.full((3, 4), -1, dtype="int64")
    assert dec.decode_into(raw, wrong) is False
    assert (wrong == -1).all()


def test_fill_and_key(tmp_path):
    arr, _ = _write(tmp_path, None)
    dec = ChunkDecoder(arr)
    f = dec.fill()
    assert f.shape == (3, 4) and f.dtype == np.dtype("int32")
    assert (f == np.asarray(arr.metadata.fill_value)).all()
    assert dec.key((1, 0)) == arr.metadata.encode_chunk_key((1, 0)) == "c/1/0"


def test_zstd_straight_into_place_checks_what_it_decodes(tmp_path):
    """A zstd chunk decoded into place by libzstd itself (``_zstd_decompress``: no Python argument checks):
    the same values as zarr, from bytes, a view of reused memory (read-only or not) or an array; a truncated
    frame or a frame of another size raises naming zstd, before anything passes as decoded."""
    import ctypes

    import numcodecs.zstd

    from xinsitu.codecs.cpu import _zstd_decompress

    arr, data = _write(tmp_path, [zarr.codecs.ZstdCodec()])
    dec, raw = _raw(arr, (1, 1))
    assert dec._zstd is not None
    if hasattr(ctypes.CDLL(numcodecs.zstd.__file__), "ZSTD_decompress"):  # (exported by the Linux wheels)
        assert dec._zstd is not numcodecs.zstd.decompress
    scratch = bytearray(len(raw) + 100)
    scratch[:len(raw)] = raw
    # bytes, a view of reused memory, a read-only view, an array of bytes
    for source in (raw, memoryview(scratch)[:len(raw)], memoryview(bytes(raw)), np.frombuffer(raw, np.uint8).copy()):
        out = np.full((3, 4), -1, dtype="int32")
        assert dec.decode_into(source, out)
        np.testing.assert_array_equal(out, data[3:6, 4:8])
    decompress = _zstd_decompress()
    with pytest.raises(RuntimeError, match="Zstd"):
        decompress(raw[:-3], np.empty((3, 4), "int32"))
    with pytest.raises(RuntimeError, match="Zstd"):
        decompress(raw, np.empty((3, 2), "int32"))  # too small
    with pytest.raises(RuntimeError, match="Zstd"):
        decompress(raw, np.empty((3, 8), "int32"))  # too big: part of it would stay unwritten
