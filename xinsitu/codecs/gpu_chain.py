"""Codec chains nvCOMP can decode, and the stored bytes it decodes of a chunk (SPEC §4 "GPU").

:func:`gpu_chain` reads an array's codec chain from its metadata and says whether nvCOMP can decode
its stored objects bit for bit: plain ``bytes`` in native order (no array-to-array codec, no sharding),
then at most one of zstd / lz4 (numcodecs' framing) / gzip / zlib, then optionally crc32c (verified on
the host, over the compressed bytes, before anything is copied). Anything else (blosc and its shuffle,
filters, GRIB, NetCDF packing, big-endian data) decodes on the CPU, and the chain says why.
:func:`payload` is what nvCOMP decodes of a chunk's stored bytes (the framing left off, a crc32c
checked); :func:`host_decode` decodes one on the host.
"""

from __future__ import annotations

import math
import struct
import sys
import warnings
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from xinsitu.codecs.staging import ALIGN

#: our name of a compressor -> nvCOMP's algorithm
ALGORITHMS = {"zstd": "Zstd", "lz4": "LZ4", "gzip": "Deflate", "zlib": "Deflate"}


class ChecksumError(ValueError):
    """A chunk's stored checksum does not match its bytes."""


class GpuPathError(RuntimeError):
    """The GPU path failed its check on first use (see ``GpuBatch.flush``): the CPU path takes over."""


def leave_gpu(on_gpu: dict[str, Any], name: str, why: BaseException) -> None:
    """Variable ``name``'s chain failed its check on first use: off the GPU (``on_gpu``) for good, said
    once (a warning naming the variable and why)."""
    if on_gpu.pop(name, None) is not None:
        warnings.warn(f"xinsitu: decoding variable {name!r} on the GPU failed its check on first use "
                      f"({why}); its chunks are decoded on the CPU from now on", RuntimeWarning, stacklevel=3)


@dataclass(frozen=True)
class GpuChain:
    """Where the chunks of one array decode, and how (see :func:`gpu_chain`)."""

    gpu: bool
    reason: str  # the chain in words ("zstd"), or why the CPU
    compressor: str | None = None  # "zstd" | "lz4" | "gzip" | "zlib" | None (stored uncompressed)
    crc32c: bool = False
    shape: tuple[int, ...] = ()
    dtype: np.dtype = np.dtype("u1")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def bound(self) -> int:
        """Bytes one stored chunk takes at most as its compressor writes it (zstd's, lz4's and deflate's
        worst cases are under 1 % more than the decoded size, plus their framing and a crc32c), plus the
        byte a local read asks beyond a file's size: the staging a chunk reserves."""
        n = self.nbytes
        return n + n // 128 + 1024 + ALIGN

    def describe(self) -> str:
        if not self.gpu:
            return f"cpu ({self.reason})"
        return f"gpu ({self.reason}, nvCOMP)"


def _name(codec: Any) -> str:
    """A compressor's name: zarr v3 codecs by class, numcodecs codecs (v2, numcodecs.zarr3) by id."""
    cid = getattr(codec, "codec_id", None)
    if isinstance(cid, str):
        return cid
    name = getattr(codec, "codec_name", None)
    if isinstance(name, str):
        return name.removeprefix("numcodecs.")
    return type(codec).__name__.removesuffix("Codec").lower()


def gpu_chain(array: Any) -> GpuChain:
    """Whether the stored objects of zarr array ``array`` can be decoded by nvCOMP, read from its
    metadata (no I/O)."""
    aa = array.async_array if hasattr(array, "async_array") else array
    meta = aa.metadata
    shape = tuple(int(c) for c in getattr(aa, "chunks", meta.chunks if hasattr(meta, "chunks") else ()))
    if getattr(aa, "shards", None):
        return GpuChain(False, "sharded (the shard index is read on the host)")
    dtype = np.dtype(aa.dtype.to_native_dtype() if hasattr(aa.dtype, "to_native_dtype") else aa.dtype)
    if dtype.kind not in "biufc":
        return GpuChain(False, f"dtype {dtype} is not numeric")
    if getattr(meta, "zarr_format", 3) == 2:
        if getattr(meta, "filters", None):
            return GpuChain(False, f"filters {[_name(f) for f in meta.filters]}")
        if getattr(meta, "order", "C") != "C":
            return GpuChain(False, "order 'F'")
        stored = np.dtype(meta.dtype.to_native_dtype()) if hasattr(meta.dtype, "to_native_dtype") else dtype
        if stored.itemsize > 1 and not stored.isnative:
            return GpuChain(False, "stored big-endian")
        comp = meta.compressor
        comps = [] if comp is None else [comp]
        crc = False
    else:
        pipe = aa.codec_pipeline
        if getattr(pipe, "array_array_codecs", ()):
            return GpuChain(False, f"array-to-array codecs {[_name(c) for c in pipe.array_array_codecs]}")
        ab = getattr(pipe, "array_bytes_codec", None)
        if type(ab).__name__ != "BytesCodec":
            return GpuChain(False, f"{_name(ab)} array-to-bytes codec")
        endian = getattr(getattr(ab, "endian", None), "value", getattr(ab, "endian", None))
        if dtype.itemsize > 1 and endian != sys.byteorder:
            return GpuChain(False, f"bytes in {endian} endian order")
        comps = list(getattr(pipe, "bytes_bytes_codecs", ()))
        crc = bool(comps) and _name(comps[-1]) == "crc32c"
        if crc:
            comps = comps[:-1]
    names = [_name(c) for c in comps]
    if len(names) > 1:
        return GpuChain(False, " + ".join(names))
    name = names[0] if names else None
    if name is not None and name not in ALGORITHMS:
        return GpuChain(False, f"{name}" + (" (shuffle inside the blosc frame)" if name == "blosc" else ""))
    words = (name or "uncompressed") + (" + crc32c" if crc else "")
    return GpuChain(True, words, name, crc, shape, dtype)


# ------------------------------------------------------------------------------------------ framing
def crc32c_payload(raw: memoryview, where: str = "") -> memoryview:
    """The bytes before a crc32c codec's 4-byte checksum, after checking it (zarr's own check)."""
    import google_crc32c  # what zarr's crc32c codec computes with

    if len(raw) < 4:
        raise ChecksumError(f"{where}: {len(raw)} bytes, too short for a crc32c checksum")
    body, stored = raw[:-4], bytes(raw[-4:])
    got = np.uint32(google_crc32c.value(np.frombuffer(body, dtype=np.uint8))).tobytes()
    if got != stored:
        raise ChecksumError(f"{where}: stored crc32c {stored.hex()} does not match the bytes' {got.hex()}")
    return body


def zstd_content_size(view: memoryview) -> int | None:
    """The decoded size a zstd frame's header declares (its Frame_Content_Size), None where it declares
    none (or the bytes start with no zstd frame)."""
    if len(view) < 6 or bytes(view[:4]) != b"\x28\xb5\x2f\xfd":
        return None
    fhd = view[4]
    single = fhd >> 5 & 1
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
    size = (1 if single else 0, 2, 4, 8)[fhd >> 6]
    if not size or len(view) < pos + size:
        return None
    value = int.from_bytes(view[pos:pos + size], "little")
    return value + 256 if size == 2 else value


def payload_span(view: memoryview, chain: GpuChain, where: str = "") -> tuple[int, int]:
    """Where, in the stored bytes of one chunk, lies what nvCOMP decodes: crc32c checked and left off,
    the compressor's own framing left off (numcodecs' lz4 size prefix, gzip's and zlib's headers and
    trailers); the decoded sizes they store (and a zstd frame's) checked against the chunk's.
    ``ValueError`` (``ChecksumError``) where the bytes are not such a chunk."""
    stop = len(view)
    if chain.crc32c:
        stop = len(crc32c_payload(view, where))
    n = chain.nbytes
    c = chain.compressor
    if c == "zstd":
        size = zstd_content_size(view[:stop])
        if size is not None and size != n:
            raise ValueError(f"{where}: zstd frame holds {size} bytes, the chunk {n}")
        return 0, stop
    if c == "lz4":
        if stop < 4:
            raise ValueError(f"{where}: {stop} bytes, too short for an lz4 frame")
        (size,) = struct.unpack_from("<i", view, 0)
        if size != n:
            raise ValueError(f"{where}: lz4 frame holds {size} bytes, the chunk {n}")
        return 4, stop
    if c == "zlib":
        if stop < 6:
            raise ValueError(f"{where}: {stop} bytes, too short for a zlib stream")
        cmf, flg = view[0], view[1]
        if cmf & 0x0F != 8 or (cmf * 256 + flg) % 31 or flg & 0x20:
            raise ValueError(f"{where}: not a zlib stream nvCOMP can inflate (header {bytes(view[:2]).hex()})")
        return 2, stop - 4
    if c == "gzip":
        if stop < 18 or bytes(view[:3]) != b"\x1f\x8b\x08":
            raise ValueError(f"{where}: not a gzip stream (header {bytes(view[:3]).hex()})")
        flg, pos = view[3], 10
        if flg & 4:  # FEXTRA
            pos += 2 + struct.unpack_from("<H", view, pos)[0]
        for bit in (8, 16):  # FNAME, FCOMMENT: zero-terminated
            if flg & bit:
                pos = bytes(view[pos:stop]).index(b"\0", 0) + pos + 1
        if flg & 2:  # FHCRC
            pos += 2
        (isize,) = struct.unpack_from("<I", view, stop - 4)
        if isize != n & 0xFFFFFFFF:
            raise ValueError(f"{where}: gzip stream holds {isize} bytes, the chunk {n}")
        return pos, stop - 8
    if c is None and stop != n:
        raise ValueError(f"{where}: {stop} bytes stored uncompressed, the chunk has {n}")
    return 0, stop


def payload(raw: Any, chain: GpuChain, where: str = "") -> memoryview:
    """What nvCOMP decodes, from the stored bytes of one chunk (``payload_span``)."""
    view = memoryview(raw).cast("B")
    a, b = payload_span(view, chain, where)
    return view[a:b]


def host_decode(compressor: str | None, part: Any, out: np.ndarray) -> None:
    """One payload (``payload``) decoded on the host into ``out`` (the chunk's bytes, uint8): what the
    stand-in's codecs do, and the CPU side of the first-use check."""
    n = out.nbytes
    if compressor is None:
        if len(part) != n:
            raise ValueError(f"{len(part)} bytes stored uncompressed, the chunk has {n}")
        out[...] = np.frombuffer(part, dtype=np.uint8)
        return
    if compressor == "zstd":
        import numcodecs

        numcodecs.Zstd().decode(part, out=out)
        return
    if compressor == "lz4":
        import numcodecs

        numcodecs.LZ4().decode(struct.pack("<i", n) + bytes(part), out=out)
        return
    d = zlib.decompressobj(-15)  # raw deflate, as nvCOMP's Deflate decodes it
    got = d.decompress(bytes(part), n + 1)
    if len(got) != n or not d.eof:
        raise ValueError(f"deflate stream holds {len(got)}{'+' if not d.eof else ''} bytes, the chunk {n}")
    out[...] = np.frombuffer(got, dtype=np.uint8)

