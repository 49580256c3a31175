"""Decode stored chunks with zarr's own codecs.

zarr's private API (``zarr.core``, underscored codec members) is used only through
``xinsitu.compat.zarr_api``, feature-detected there and held by ``tests/compat/test_compat.py``.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import sys
from typing import Any

import numpy as np

from xinsitu.compat import zarr_api as compat_zarr
from xinsitu.compat.zarr_api import prototype as _prototype


def _zstd_decompress() -> Any:
    """``fn(source, dest)``: a zstd frame decoded into ``dest`` (a C-contiguous array it fills exactly).
    libzstd's ``ZSTD_decompress`` as numcodecs' own extension exports it, called through ``ctypes`` (which
    lets the GIL go for the call), where it does; else numcodecs' ``zstd.decompress``; None without either.

    numcodecs' ``decompress`` checks its arguments in Python first (``ensure_contiguous_ndarray_like``:
    protocol checks, views), holding the GIL the decode threads share: without them, an epoch of the
    yardstick's 24-step chunks ran 5-20 % faster (alternated runs). Here the caller has checked the
    destination (``ChunkDecoder.decode_into``), and the source is any buffer."""
    try:
        import numcodecs.zstd as nz
    except ImportError:
        return None
    try:
        lib = ctypes.CDLL(nz.__file__)  # (loaded already: the same library, its symbols)
        fn, is_error, name = lib.ZSTD_decompress, lib.ZSTD_isError, lib.ZSTD_getErrorName
    except (OSError, AttributeError):  # symbols not exported (a static build): numcodecs' own call
        return nz.decompress
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_size_t
    is_error.argtypes, is_error.restype = [ctypes.c_size_t], ctypes.c_uint
    name.argtypes, name.restype = [ctypes.c_size_t], ctypes.c_char_p

    byref, at = ctypes.byref, ctypes.c_char.from_buffer

    def decompress(source: Any, dest: np.ndarray) -> None:
        # pointers by ``c_char.from_buffer`` (1 us), not ``__array_interface__`` (3.5 us, a dict each): held
        # GIL per chunk, which one-sample chunks of 32 kB pay once per 40 us decode
        try:
            src: Any = byref(at(source))
        except (TypeError, ValueError):  # read-only (bytes: passed as they are) or empty
            src = source if type(source) is bytes else np.frombuffer(source, np.uint8).ctypes.data
        dst = byref(at(dest)) if dest.nbytes else dest.ctypes.data  # type: ignore[arg-type]
        n = fn(dst, dest.nbytes, src, memoryview(source).nbytes)
        if n != dest.nbytes:
            why = name(n).decode() if is_error(n) else f"{n} bytes decoded, {dest.nbytes} expected"
            raise RuntimeError(f"Zstd decompression error: {why}")

    return decompress


class ChunkDecoder:
    """Turn the bytes of one stored object of a zarr array into a numpy array.

    Where every codec of the chain can decode synchronously (zarr's ``_decode_sync``,
    e.g. bytes + zstd/blosc/gzip/crc32c), a chunk is decoded in one hop to the decode
    thread pool; otherwise (v2 filters, numcodecs wrappers, sharding) through zarr's
    asynchronous codec pipeline, which also decodes in threads.
    """

    def __init__(self, array: Any, pipeline: Any = None, spec: Any = None):
        aa = array.async_array if hasattr(array, "async_array") else array
        self.metadata = aa.metadata
        self.pipeline = pipeline if pipeline is not None else aa.codec_pipeline
        self.spec = spec if spec is not None else compat_zarr.stored_chunk_spec(aa)
        self.shape = tuple(self.spec.shape)  # stored object shape (a whole shard, for sharded arrays)
        self.dtype = np.dtype(self.spec.dtype.to_native_dtype())
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize  # of one decoded chunk
        self.fill_value = np.asarray(self.spec.fill_value, dtype=self.dtype) if self.spec.fill_value is not None \
            else np.zeros((), self.dtype)
        self._framed = _blosc_frame if type(compat_zarr.outer_codec(self.pipeline)).__name__ in _BLOSC else None
        self._sync = self._sync_chain()
        self._into = self._into_chain()
        self._direct = self._direct_codec()
        self._zstd = _zstd_decompress() if type(self._direct).__name__ == "Zstd" else None
        self._key = self._key_format()

    def _sync_chain(self) -> list[tuple[Any, Any]] | None:
        """[(codec, spec)] in decode order when every codec decodes synchronously, else None."""
        p = self.pipeline
        needed = ("array_array_codecs", "array_bytes_codec", "bytes_bytes_codecs")
        if not all(hasattr(p, n) for n in needed):
            return None
        codecs = [_sync_numcodec(c) for c in (*p.array_array_codecs, p.array_bytes_codec, *p.bytes_bytes_codecs)]
        if not all(isinstance(c, _SyncNumcodec) or compat_zarr.sync_decodable(c) for c in codecs):
            return None
        specs, spec = [], self.spec
        for c in codecs:  # encode order: each codec sees the spec its predecessor resolved
            specs.append(spec)
            spec = c.resolve_metadata(spec)
        return list(reversed(list(zip(codecs, specs, strict=True))))

    def _into_chain(self) -> tuple[list[tuple[Any, Any]], Any] | None:
        """(steps before, numcodec) where the chain ends in a numcodecs codec then plain ``bytes`` in native
        order (NetCDF4's shuffle + deflate): that codec then decodes straight into the chunk's array."""
        if self._sync is None or len(self._sync) < 2:
            return None
        (last, _), (arr_bytes, _) = self._sync[-2], self._sync[-1]
        endian = getattr(getattr(arr_bytes, "endian", None), "value", getattr(arr_bytes, "endian", None))
        if not isinstance(last, _SyncNumcodec) or type(arr_bytes).__name__ != "BytesCodec":
            return None
        if self.dtype.itemsize > 1 and endian != sys.byteorder:
            return None
        return self._sync[:-2], last.numcodec

    def _direct_codec(self) -> Any:
        """The numcodecs codec that can decode a stored chunk straight into a caller's array: the
        chain is one compressor then plain ``bytes`` in native order (e.g. bytes + zstd/blosc)."""
        if self._sync is None or len(self._sync) != 2:
            return None
        (comp, _), (arr_bytes, _) = self._sync
        if type(arr_bytes).__name__ != "BytesCodec":
            return None
        endian = getattr(getattr(arr_bytes, "endian", None), "value", getattr(arr_bytes, "endian", None))
        if self.dtype.itemsize > 1 and endian != sys.byteorder:
            return None
        for attr in ("_zstd_codec", "_blosc_codec", "numcodec"):
            codec = getattr(comp, attr, None)
            if codec is not None and callable(getattr(codec, "decode", None)):
                return codec
        return None

    def decode_into(self, raw: Any, out: np.ndarray) -> bool:
        """Decode straight into ``out`` (C-contiguous, chunk shape and dtype); False where this
        chain cannot, and the caller decodes and copies instead."""
        if self._direct is None or out.dtype != self.dtype or not out.flags.c_contiguous \
                or out.shape != self.shape:
            return False
        if self._framed is not None:
            self._framed(raw)
        if self._zstd is not None:  # what Zstd.decode(raw, out=out) does, without its argument checks
            self._zstd(raw, out)
        else:
            self._direct.decode(raw, out=out)
        return True

    @property
    def sync(self) -> bool:
        """Whether chunks decode in one synchronous call (see ``decode_sync``)."""
        return self._sync is not None

    def key(self, coords: tuple[int, ...]) -> str:
        """The store key of chunk ``coords`` (zarr's chunk key encoding; per chunk, so a format string
        where one gives zarr's keys: a third of the time)."""
        if self._key is not None:
            return self._key(*coords)
        return self.metadata.encode_chunk_key(coords)  # type: ignore[no-any-return]

    def _key_format(self) -> Any:
        """``str.format`` of a template giving zarr's key for any chunk of this array (zarr's default and
        v2 encodings: a prefix, then the coordinates joined by a separator), checked against zarr's own
        on probe coordinates; None where it does not (another encoding: zarr's is asked per chunk)."""
        enc = getattr(self.metadata, "chunk_key_encoding", None)
        sep = getattr(enc, "separator", None)
        n = len(self.shape)
        if sep not in ("/", ".") or not n:
            return None
        probes = [(0,) * n, tuple(range(1, n + 1)), tuple(12345 + i for i in range(n))]
        for prefix in (f"c{sep}", ""):
            fmt = (prefix + sep.join(["{}"] * n)).format
            try:
                if all(fmt(*c) == self.metadata.encode_chunk_key(c) for c in probes):
                    return fmt
            except Exception:  # noqa: BLE001 - zarr's encoding refused a probe: ask it per chunk
                return None
        return None

    def fill(self) -> np.ndarray:
        """A chunk that was never written: zarr's fill value everywhere."""
        return np.full(self.shape, self.fill_value, dtype=self.dtype)

    def decode_sync(self, raw: Any) -> np.ndarray:
        """Decode in the calling thread (needs a synchronous codec chain)."""
        assert self._sync is not None
        if self._framed is not None:
            self._framed(raw)
        buf: Any = _prototype().buffer.from_bytes(raw)
        if self._into is not None:  # one allocation fewer, no copy: the last codec writes the chunk
            steps, last = self._into
            for codec, spec in steps:
                buf = codec._decode_sync(buf, spec)
            out = np.empty(self.shape, self.dtype)
            last.decode(buf.as_numpy_array(), out=out)
            return out
        for codec, spec in self._sync:
            buf = codec._decode_sync(buf, spec)
        return np.asarray(buf.as_ndarray_like()).reshape(self.shape)

    async def decode(self, raw: Any) -> np.ndarray:
        """Decode off the event loop (in the loop's decode thread pool)."""
        if self._sync is not None:
            return await asyncio.get_running_loop().run_in_executor(None, self.decode_sync, raw)
        if self._framed is not None:
            self._framed(raw)
        buf = _prototype().buffer.from_bytes(raw)
        (out,) = await self.pipeline.decode_batch([(buf, self.spec)])
        if out is None:
            return self.fill()
        return np.asarray(out.as_ndarray_like()).reshape(self.shape)


_BLOSC = ("Blosc", "BloscCodec")  # numcodecs' (v2, and numcodecs.zarr3's) and zarr's


def _blosc_frame(raw: Any) -> None:
    """Raise where ``raw`` is not one whole blosc frame: blosc decodes a frame cut short (a body that lost its
    tail in transit, where the HTTP layer could not see it) without an error, into garbage. The frame's header
    gives its length (bytes 12-16, little-endian: ``cbytes``); the caller fetches the object again."""
    view = memoryview(raw).cast("B")
    if len(view) < 16:
        raise ValueError(f"blosc: {len(view)} bytes received, fewer than a frame's header (cut short, or damaged)")
    nbytes, cbytes = int.from_bytes(view[4:8], "little"), int.from_bytes(view[12:16], "little")
    if view[0] not in (1, 2) or cbytes < 16 or cbytes > nbytes + 16 + 16 * (nbytes // 65536 + 1):
        # (blosc's versions 1-2; a frame is never much bigger than what it holds)
        raise ValueError(f"blosc: these {len(view)} bytes are not a blosc frame (damaged; in an HDF5 file, a chunk "
                         "its writer stored without the blosc filter, as HDF5 does where the filter does not shrink "
                         "it: its references cannot tell)")
    if cbytes > len(view):  # (bytes after the frame, as padding, decode as they did)
        raise ValueError(f"blosc: a frame of {cbytes} bytes, {len(view)} bytes received (cut short in transit, or "
                         "damaged)")


class _SyncNumcodec:
    """A numcodecs bytes->bytes codec as zarr wraps it (``numcodecs.zlib``, ``numcodecs.shuffle``: what
    NetCDF4/HDF5 files use), decoded in the calling thread; zarr's wrapper only decodes asynchronously,
    one hop to a thread per codec per chunk."""

    def __init__(self, codec: Any, numcodec: Any):
        self.codec = codec
        self.numcodec = numcodec
        self.decode = _faster(codec.codec_config) or self.numcodec.decode

    def resolve_metadata(self, spec: Any) -> Any:
        return self.codec.resolve_metadata(spec)

    def _decode_sync(self, buf: Any, spec: Any) -> Any:
        return spec.prototype.buffer.from_bytes(self.decode(buf.as_numpy_array()))


def _faster(config: dict[str, Any]) -> Any:
    """A faster decoder giving the same bytes, where one is installed: zlib-ng (imagecodecs, in the
    ``virtual`` extra) inflates zlib streams -- NetCDF4's deflate -- about 3x faster than zlib."""
    if config.get("id") != "zlib":
        return None
    try:
        import imagecodecs
    except ImportError:
        return None
    return imagecodecs.zlibng_decode if getattr(imagecodecs.ZLIBNG, "available", False) else None


def _sync_numcodec(codec: Any) -> Any:
    """``codec``, or a synchronous stand-in (that can decode into the chunk) where it is a numcodecs
    bytes->bytes wrapper."""
    numcodec = compat_zarr.numcodecs_bytes_codec(codec)
    return codec if numcodec is None else _SyncNumcodec(codec, numcodec)


def is_sharded(array: Any) -> bool:
    return bool(getattr(array, "shards", None))


class ShardLayout:
    """How to find and decode the inner chunks of a sharded (v3 ``sharding_indexed``) array."""

    def __init__(self, array: Any):
        aa = array.async_array if hasattr(array, "async_array") else array
        codec = compat_zarr.sharding_codec(aa)
        if codec is None:
            raise NotImplementedError("sharded array layout not understood by this zarr version")
        self.codec = codec
        shard_spec = compat_zarr.stored_chunk_spec(aa)
        self.shard_shape = tuple(shard_spec.shape)
        self.inner_shape = tuple(codec.chunk_shape)
        self.per_shard = tuple(s // c for s, c in zip(self.shard_shape, self.inner_shape, strict=True))
        self.index_size = compat_zarr.shard_index_size(codec, self.per_shard)
        self.index_at_end = str(getattr(codec.index_location, "value", codec.index_location)) == "end"
        self.inner = ChunkDecoder(array, pipeline=codec.codec_pipeline,
                                  spec=compat_zarr.inner_chunk_spec(codec, shard_spec))
        self.metadata = aa.metadata

    def shard_key(self, shard: tuple[int, ...]) -> str:
        return self.metadata.encode_chunk_key(shard)

    async def index(self, raw: Any) -> np.ndarray:
        """(offset, length) of every inner chunk, shape ``per_shard + (2,)``; 2**64-1 where empty."""
        return await compat_zarr.decode_shard_index(self.codec, raw, self.per_shard)


def store_root(zstore: Any) -> tuple[str, Any]:
    """('obstore', obstore store) | ('local', root path) | ('zarr', store) for a zarr store object."""
    obs = getattr(zstore, "store", None)
    if type(zstore).__name__ == "ObjectStore" and obs is not None:
        return "obstore", obs
    root = getattr(zstore, "root", None)
    if type(zstore).__name__ == "LocalStore" and root is not None:
        return "local", str(root)
    return "zarr", zstore


def is_remote(zstore: Any) -> bool:
    """Whether reads of ``zstore`` cross a network (anything but local files and memory)."""
    kind, obj = store_root(zstore)
    if kind == "local":
        return False
    inner = obj if kind == "obstore" else zstore
    if type(inner).__name__ in ("LocalStore", "MemoryStore", "ManagedMemoryStore"):
        return False
    if type(inner).__name__ == "FsspecStore":
        return "file" not in (getattr(getattr(inner, "fs", None), "protocol", ()) or ())
    return True


async def zarr_store_get(zstore: Any, key: str, byte_range: Any = None) -> bytes | None:
    """Read one object (or ``byte_range`` of it: zarr's ``RangeByteRequest``, ``SuffixByteRequest``)
    through a zarr store's own async ``get`` (None where it does not exist)."""
    buf = await zstore.get(key, prototype=_prototype(), byte_range=byte_range)
    return None if buf is None else buf.to_bytes()


def decode_path() -> str:
    """How chunks are decoded here, in words (``python -m xinsitu doctor``)."""
    feats = compat_zarr.features()
    parts = ["zarr codecs' _decode_sync in the decode threads"]
    if feats["numcodecs_wrapper"]:
        zlib = "zlib-ng" if _faster({"id": "zlib"}) is not None else "zlib"
        parts.append(f"numcodecs filters into the chunk ({zlib})")
    else:
        parts.append("numcodecs filters through zarr's pipeline")
    parts.append("shard index " + ("sync" if feats["shard_index_sync"] else "async"))
    return ", ".join(parts)
