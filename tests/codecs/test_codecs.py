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


@pytest.mark.parametrize("chunk_time", [1, 3])
@pytest.mark.parametrize("cache", [None, "disk"])
def test_v2_column_major_chunks_read_as_xarray(tmp_path, chunk_time, cache):
    """A zarr v2 array stored in ``"order": "F"`` (older writers, ``create_array(order="F")``): each chunk
    is column-major on disk. Batches (straight into the batch where a chunk is one sample, from a shuffle
    buffer, from the disk cache) equal xarray's values, not the chunk read as row-major."""
    import xinsitu

    p = str(tmp_path / "f.zarr")
    data = (np.arange(12 * 4 * 5, dtype="float32").reshape(12, 4, 5) * 1.5) - 7
    xr.Dataset(coords={"time": np.arange(12)}).to_zarr(p, zarr_format=2, consolidated=False)
    g = zarr.open_group(p, mode="a", zarr_format=2)
    for name, comp in (("v", "default"), ("w", None)):
        kw = {} if comp == "default" else {"compressors": None}
        a = g.create_array(name, shape=data.shape, dtype=data.dtype, chunks=(chunk_time, 4, 5), order="F",
                           fill_value=np.nan, **kw)
        a[...] = data if name == "v" else -data
        a.attrs["_ARRAY_DIMENSIONS"] = ["time", "y", "x"]
    assert zarr.open_array(p, path="v").metadata.order == "F"
    ref = xr.open_dataset(p, engine="zarr", chunks=None, consolidated=False)
    for ds in (xinsitu.open_zarr(p), xr.open_zarr(p, consolidated=False)):
        m = ds.insitu.split("time", fractions={"train": 1.0})
        gen = ds.insitu.batches(m, "train", batch_size=5, output="xarray", seed=1,
                                cache=str(tmp_path / "cache") if cache else None)
        for epoch in (0, 1):
            gen.set_epoch(epoch)
            seen = []
            for b in gen:
                exp = ref.isel(time=b.time.values).rename(time="sample")
                for v in ("v", "w"):
                    np.testing.assert_array_equal(b[v].values, exp[v].values)
                seen += b.time.values.tolist()
            assert sorted(seen) == list(range(12))


def test_a_blosc_frame_is_checked_whole_before_it_is_decoded():
    """blosc decodes a frame missing its tail without an error, into garbage: the frame's header gives its
    length. Cut short: refused as such (the chunk is fetched again); bytes that are no blosc frame at all (an
    HDF5 chunk its writer stored without the filter): refused as such; bytes after a whole frame: decoded."""
    import numcodecs

    from xinsitu.codecs.cpu import _blosc_frame

    frame = numcodecs.Blosc("lz4").encode(np.arange(5000, dtype="f4"))
    _blosc_frame(frame)
    _blosc_frame(frame + b"\0" * 7)
    _blosc_frame(memoryview(frame))
    with pytest.raises(ValueError, match=r"a frame of \d+ bytes, \d+ bytes received \(cut short"):
        _blosc_frame(frame[:-1])
    with pytest.raises(ValueError, match="not a blosc frame"):
        _blosc_frame(np.arange(180, dtype="f4").tobytes())
    with pytest.raises(ValueError, match="fewer than a frame's header"):
        _blosc_frame(frame[:10])
