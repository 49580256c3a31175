"""What the virtual-store builders share (``xinsitu.formats.references``): file arguments as URLs, the inline
store of joined coordinates, and the read-only codec base."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from xinsitu.formats.references import INLINE_SCHEME, _InlineStore, _jsonable, as_urls, read_only_bytes_codec


def test_paths_globs_and_urls_become_urls(tmp_path):
    for name in ("b.nc", "a.nc", "c.txt"):
        (tmp_path / name).write_bytes(b"x")
    assert as_urls(str(tmp_path / "*.nc")) == [f"file://{tmp_path}/a.nc", f"file://{tmp_path}/b.nc"]  # sorted
    assert as_urls([tmp_path / "c.txt", "s3://bucket/k.nc"]) == [f"file://{tmp_path}/c.txt", "s3://bucket/k.nc"]


def test_missing_files_and_empty_lists_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file matches"):
        as_urls(str(tmp_path / "*.grib"))
    with pytest.raises(FileNotFoundError, match="no file at"):
        as_urls(str(tmp_path / "none.nc"))
    with pytest.raises(ValueError, match="no files given"):
        as_urls([])


def test_the_inline_store_serves_ranges_and_names_missing_objects():
    s = _InlineStore({"time": b"0123456789"})
    assert s.get_range("time", start=2, end=5) == b"234"
    assert s.get_range("time", start=7, length=2) == b"78"
    assert asyncio.run(s.get_ranges_async("time", starts=[0, 8], ends=[2, 10])) == [b"01", b"89"]
    with pytest.raises(FileNotFoundError, match=f"{INLINE_SCHEME} object 'lat' does not exist"):
        s.get_range("lat", start=0, end=1)


def test_jsonable():
    assert _jsonable(np.float32(1.5)) == 1.5 and type(_jsonable(np.int16(3))) is int
    assert _jsonable(np.arange(3)) == [0, 1, 2] and _jsonable("s") == "s"


def test_read_only_codecs_refuse_to_write_naming_what_they_read():
    base = read_only_bytes_codec()
    assert read_only_bytes_codec() is base  # one class, built once

    class Demo(base):  # type: ignore[misc,valid-type]
        read_as = "demo files"

        def _decode_sync(self, chunk_bytes, chunk_spec):
            return (chunk_bytes, chunk_spec)

        def compute_encoded_size(self, input_byte_length, chunk_spec):
            return input_byte_length

    codec = Demo()
    assert asyncio.run(codec._decode_single(b"raw", "spec")) == (b"raw", "spec")  # via a worker thread
    with pytest.raises(NotImplementedError, match="demo files are read in place, never written"):
        asyncio.run(codec._encode_single(None, None))
