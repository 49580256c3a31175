"""Chunk decode on the GPU (nvCOMP), and which variables can take it (SPEC §4 "GPU").

* :func:`gpu_chain` reads an array's codec chain from its metadata and says whether nvCOMP can
  decode its stored objects bit for bit: plain ``bytes`` in native order (no array-to-array codec,
  no sharding), then at most one of zstd / lz4 (numcodecs' framing) / gzip / zlib, then optionally
  crc32c (verified on the host, over the compressed bytes, before anything is copied). Anything
  else (blosc and its shuffle, filters, GRIB, NetCDF packing, big-endian data) decodes on the CPU,
  and the chain says why.
* A *decoder* turns a buffer's compressed chunks into decoded chunks in device memory:
  ``decode_many(raws, dests)`` takes each chunk's stored bytes and a destination (a device array of
  the chunk's shape and dtype), strips the framing on the host, packs the payloads into one reused
  page-locked buffer, copies them to the device in ONE transfer, and decodes them in ONE batched
  nvCOMP call. :class:`NvcompDecoder` is the real one (cupy + ``nvidia.nvcomp``);
  :class:`StandInDecoder` runs the very same host-side steps with numpy standing in for device
  memory and numcodecs/zlib for nvCOMP, so that CI checks them bit for bit against zarr's decode.

How the read path uses it (its one completion step, ``place(decoder, raw, dest)``): for a variable
whose chain is on the GPU, ``place`` hands ``(raw, dest)`` to a :class:`GpuBatch` instead of decoding;
once the buffer's chunks are all in, ``GpuBatch.flush()`` decodes them together.
"""

from __future__ import annotations

import importlib
import math
import struct
import sys
import threading
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from xinsitu.backend import ChunkReadError
from xinsitu.mempool import ArrayPool

#: decode= values
DECODES = ("auto", "cpu", "gpu")
#: byte alignment of each payload inside the transfer (nvCOMP's batched decoders need 8 at most)
ALIGN = 16
#: our name of a compressor -> nvCOMP's algorithm
ALGORITHMS = {"zstd": "Zstd", "lz4": "LZ4", "gzip": "Deflate", "zlib": "Deflate"}


class ChecksumError(ValueError):
    """A chunk's stored checksum does not match its bytes."""


class GpuPathError(RuntimeError):
    """The GPU path failed its check on first use (see ``GpuBatch.flush``): the CPU path takes over."""


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


def payload(raw: Any, chain: GpuChain, where: str = "") -> memoryview:
    """What nvCOMP decodes, from the stored bytes of one chunk: crc32c checked and stripped, and
    the compressor's own framing stripped (numcodecs' lz4 size prefix, gzip's and zlib's headers and
    trailers; their stored decoded sizes are checked against the chunk's)."""
    view = memoryview(raw).cast("B")
    if chain.crc32c:
        view = crc32c_payload(view, where)
    n = chain.nbytes
    c = chain.compressor
    if c == "lz4":
        (size,) = struct.unpack_from("<i", view, 0)
        if size != n:
            raise ValueError(f"{where}: lz4 frame holds {size} bytes, the chunk {n}")
        return view[4:]
    if c == "zlib":
        cmf, flg = view[0], view[1]
        if cmf & 0x0F != 8 or (cmf * 256 + flg) % 31 or flg & 0x20:
            raise ValueError(f"{where}: not a zlib stream nvCOMP can inflate (header {bytes(view[:2]).hex()})")
        return view[2:-4]
    if c == "gzip":
        if bytes(view[:3]) != b"\x1f\x8b\x08":
            raise ValueError(f"{where}: not a gzip stream (header {bytes(view[:3]).hex()})")
        flg, pos = view[3], 10
        if flg & 4:  # FEXTRA
            pos += 2 + struct.unpack_from("<H", view, pos)[0]
        for bit in (8, 16):  # FNAME, FCOMMENT: zero-terminated
            if flg & bit:
                pos = bytes(view[pos:]).index(b"\0", 0) + pos + 1
        if flg & 2:  # FHCRC
            pos += 2
        (isize,) = struct.unpack_from("<I", view, len(view) - 4)
        if isize != n & 0xFFFFFFFF:
            raise ValueError(f"{where}: gzip stream holds {isize} bytes, the chunk {n}")
        return view[pos:-8]
    if c is None and len(view) != n:
        raise ValueError(f"{where}: {len(view)} bytes stored uncompressed, the chunk has {n}")
    return view


# ------------------------------------------------------------------------------------------ decoders
class _Packer:
    """One reused page-locked buffer into which a batch's payloads are packed (grown when too small)."""

    def __init__(self, alloc: Any):
        self.alloc, self.allocs = alloc, 0
        self.buf: Any = None

    def pack(self, parts: list[memoryview]) -> tuple[np.ndarray, list[tuple[int, int]]]:
        spans, total = [], 0
        for p in parts:
            spans.append((total, len(p)))
            total += -(-len(p) // ALIGN) * ALIGN
        if self.buf is None or self.buf.nbytes < total:
            self.buf = self.alloc(max(total, ALIGN))
            self.allocs += 1
        host = self.buf[:total]
        for (off, n), p in zip(spans, parts, strict=True):
            host[off:off + n] = np.frombuffer(p, dtype=np.uint8)
        return host, spans


class _Decoder:
    """What every decoder does the same: ``decode_many`` = ``payload`` per chunk, then
    ``decode_payloads`` (the decoder's own: one transfer, one batched decode)."""

    chain: GpuChain

    def decode_many(self, raws: list[Any], dests: list[Any], where: list[str] | None = None) -> None:
        """Decode the stored bytes ``raws`` of chunks into ``dests`` (arrays of the chunk's shape)."""
        if len(raws) != len(dests):
            raise ValueError(f"decode_many: {len(raws)} chunks but {len(dests)} destinations")
        if not raws:
            return
        names = where or [f"chunk {i}" for i in range(len(raws))]
        self.decode_payloads([payload(r, self.chain, w) for r, w in zip(raws, names, strict=True)], dests, names)

    def decode_payloads(self, parts: list[Any], dests: list[Any], names: list[str]) -> None:
        raise NotImplementedError


class StandInDecoder(_Decoder):
    """The decoder's host-side steps with numpy for device memory and numcodecs/zlib for nvCOMP.

    ``transfers`` counts host-to-"device" copies (one per ``decode_many``), ``decode_calls`` the
    batched decode calls (one per compressor per ``decode_many``)."""

    kind = "stand-in"

    def __init__(self, chain: GpuChain):
        if not chain.gpu:
            raise ValueError(f"this chain decodes on the CPU: {chain.reason}")
        self.chain = chain
        self.packer = _Packer(lambda n: np.empty(n, dtype=np.uint8))
        self.transfers = self.decode_calls = 0
        self._lock = threading.Lock()

    def decode_payloads(self, parts: list[Any], dests: list[np.ndarray], names: list[str]) -> None:
        """``decode_many`` of payloads already stripped of their framing (``payload``)."""
        with self._lock:
            host, spans = self.packer.pack(parts)
            device = host.copy()  # the ONE transfer
            self.transfers += 1
            outs = self._decode_batch([device[off:off + n] for off, n in spans])
            self.decode_calls += 1
        for out, dest, w in zip(outs, dests, names, strict=True):
            _place(out, dest, self.chain, w)

    def _decode_batch(self, bufs: list[np.ndarray]) -> list[np.ndarray]:
        c, n = self.chain.compressor, self.chain.nbytes
        if c is None:
            return bufs
        if c == "zstd":
            import numcodecs

            z = numcodecs.Zstd()
            return [np.frombuffer(z.decode(b), dtype=np.uint8) for b in bufs]
        if c == "lz4":
            import numcodecs

            lz = numcodecs.LZ4()
            return [np.frombuffer(lz.decode(struct.pack("<i", n) + b.tobytes()), dtype=np.uint8) for b in bufs]
        return [np.frombuffer(zlib.decompressobj(-15).decompress(b.tobytes()), dtype=np.uint8) for b in bufs]


_STREAMS: dict[tuple[int, int], Any] = {}  # (device, thread) -> the stream it decodes on, for the process
_CODECS = threading.local()  # this thread's nvCOMP codecs, by (stream, compressor)


def _decode_stream(cupy: Any) -> Any:
    """This thread's stream of GPU decodes on the current device, one per decode thread so that one
    thread's batch decodes on the device while another packs its own. It lives as long as the
    process: nvCOMP's codecs borrow it by its handle, and a stream destroyed before them (a
    generator's objects collected in another order) crashes the process when they are freed."""
    key = (int(cupy.cuda.runtime.getDevice()), threading.get_ident())
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS.setdefault(key, cupy.cuda.Stream(non_blocking=True))
    return stream


def _thread_codec(nvcomp: Any, compressor: str, stream: Any) -> Any:
    """This thread's nvCOMP codec of ``compressor`` on ``stream`` (nvCOMP's codecs are not shared
    between threads); kept for the thread's life, like the stream for the process's."""
    codecs = _CODECS.__dict__.setdefault("by", {})
    key = (int(stream.ptr), compressor)
    codec = codecs.get(key)
    if codec is None:
        codec = codecs[key] = nvcomp.Codec(algorithm=ALGORITHMS[compressor], bitstream_kind=nvcomp.BitstreamKind.RAW,
                                           cuda_stream=stream.ptr)
    return codec


class NvcompDecoder(_Decoder):
    """Decode on a CUDA device with nvCOMP (``from nvidia import nvcomp``) into cupy arrays."""

    kind = "nvcomp"

    def __init__(self, chain: GpuChain):
        if not chain.gpu:
            raise ValueError(f"this chain decodes on the CPU: {chain.reason}")
        cupy, nvcomp = gpu_modules()
        self.cupy, self.nvcomp, self.chain = cupy, nvcomp, chain
        self._packers: list[_Packer] = []  # pinned buffers not in use: a batch takes one, gives it back
        self.transfers = self.decode_calls = 0
        self._lock = threading.Lock()  # the free pinned buffers and the counters (batches run in several threads)

    def _packer(self) -> _Packer:
        cupy = self.cupy
        with self._lock:
            if self._packers:
                return self._packers.pop()
        return _Packer(lambda n: np.frombuffer(cupy.cuda.alloc_pinned_memory(n), dtype=np.uint8, count=n))

    def decode_payloads(self, parts: list[Any], dests: list[Any], names: list[str]) -> None:
        """``decode_many`` of payloads already stripped of their framing (``payload``), on this
        thread's stream: batches of several threads overlap (packing, copying, decoding)."""
        cupy = self.cupy
        stream = _decode_stream(cupy)
        # the destinations may be memory this thread's stream used last (CuPy's pool hands memory back per
        # stream): the decode's stream starts after the work queued there so far
        after = cupy.cuda.Event(disable_timing=True)
        after.record(cupy.cuda.get_current_stream())
        packer, c = self._packer(), self.chain.compressor
        with stream:
            try:
                stream.wait_event(after)
                host, spans = packer.pack(parts)
                device = cupy.empty(host.nbytes, dtype=cupy.uint8)
                device.set(host, stream=stream)  # the ONE transfer
                bufs = [device[off:off + n] for off, n in spans]
                if c is None:
                    outs = bufs
                else:
                    codec = _thread_codec(self.nvcomp, c, stream)
                    outs = [cupy.asarray(o).view(cupy.uint8).ravel()
                            for o in codec.decode(self.nvcomp.as_arrays(bufs))]
                for out, dest, w in zip(outs, dests, names, strict=True):
                    _place(out, dest, self.chain, w)
            finally:
                stream.synchronize()  # done with the pinned buffer: it may go to the next batch
        with self._lock:
            self._packers.append(packer)
            self.transfers += 1
            self.decode_calls += c is not None


def _place(out: Any, dest: Any, chain: GpuChain, where: str) -> None:
    """A decoded chunk's bytes into ``dest`` (the chunk's shape and dtype, C-contiguous)."""
    if out.nbytes != chain.nbytes:
        raise ValueError(f"{where}: decoded to {out.nbytes} bytes, the chunk has {chain.nbytes}")
    if tuple(dest.shape) != chain.shape or dest.dtype != chain.dtype or not dest.flags.c_contiguous:
        raise ValueError(f"{where}: destination {tuple(dest.shape)} {dest.dtype} is not the chunk's "
                         f"{chain.shape} {chain.dtype} (C-contiguous)")
    dest.reshape(-1).view(out.dtype)[...] = out


class GpuBatch:
    """A buffer's GPU-decoded chunks, collected by the read path's completion step (``GpuSlot``, in
    the decode threads) and decoded together by ``flush`` (one transfer, one batched decode).

    ``add`` strips a chunk's framing and checks its crc32c in the calling decode thread, and copies
    the payload (the bytes handed in may be a thread's reused read buffer); ``add_fill`` notes a
    chunk with no object, given its fill value at ``flush``. A chunk is named by ``(variable,
    chunk, key)``: where the batched decode fails, the chunks are decoded one by one, and the one
    that cannot be raises ``ChunkReadError`` naming it."""

    def __init__(self, decoder: Any, asarray: Any = np.asarray):
        self.decoder, self.asarray = decoder, asarray  # asarray: a host array onto the device
        self.parts: list[Any] = []
        self.dests: list[Any] = []
        self.names: list[tuple[str, tuple[int, ...], str]] = []
        self.fills: list[tuple[Any, np.ndarray]] = []
        self.decoded = 0  # chunks decoded by ``flush`` so far
        self._lock = threading.Lock()

    def add(self, raw: Any, dest: Any, name: tuple[str, tuple[int, ...], str]) -> None:
        part = bytes(payload(raw, self.decoder.chain, _words(name)))
        with self._lock:
            self.parts.append(part)
            self.dests.append(dest)
            self.names.append(name)

    def add_fill(self, dest: Any, value: np.ndarray) -> None:
        with self._lock:
            self.fills.append((dest, value))

    def flush(self, check: Any = None) -> int:
        """Decode every chunk added (and put the fill values in place); the number of chunks.

        ``check`` (a function device array -> numpy array, on first use of a decoder): the chunks
        are decoded on the host too (numcodecs, as ``StandInDecoder``) and compared bit for bit;
        ``GpuPathError`` where the device's decode fails or differs."""
        with self._lock:
            parts, dests, names, fills = self.parts, self.dests, self.names, self.fills
            self.parts, self.dests, self.names, self.fills = [], [], [], []
        if parts and check is not None:
            chain, host = self.decoder.chain, StandInDecoder(self.decoder.chain)
            ref = [np.empty(chain.shape, chain.dtype) for _ in parts]
            for part, r, name in zip(parts, ref, names, strict=True):  # the data first: a damaged chunk is named
                _one(host, part, r, name)
            try:
                self.decoder.decode_payloads(parts, dests, [_words(n) for n in names])
                for r, d, n in zip(ref, dests, names, strict=True):
                    got = check(d)
                    if r.tobytes() != got.tobytes():
                        raise ValueError(f"{_words(n)} decoded on the device differs from the host's decode")
            except Exception as e:  # noqa: BLE001 - said, and the CPU path takes over
                raise GpuPathError(f"{type(e).__name__}: {e}") from e
        elif parts:
            try:
                self.decoder.decode_payloads(parts, dests, [_words(n) for n in names])
            except Exception:
                for part, dest, name in zip(parts, dests, names, strict=True):  # which one: decoded one by one
                    _one(self.decoder, part, dest, name)
        for dest, value in fills:
            dest[...] = self.asarray(value)
        self.decoded += len(parts)
        return len(parts) + len(fills)


def _one(decoder: Any, part: Any, dest: Any, name: tuple[str, tuple[int, ...], str]) -> None:
    """One chunk's payload decoded alone by ``decoder``; ``ChunkReadError`` naming it where it cannot be."""
    try:
        decoder.decode_payloads([part], [dest], [_words(name)])
    except Exception as e:
        raise ChunkReadError(*name, e) from e


def _words(name: tuple[str, tuple[int, ...], str]) -> str:
    var, chunk, key = name
    return f"variable {var!r}, chunk {chunk}, key {key!r}"


class GpuSlot:
    """The destination of a chunk decoded on the GPU (``decode.Destination``): ``out``, a device array
    of the chunk's shape (a row of a device buffer). ``decode`` only hands the bytes to ``batch``,
    which decodes the buffer's chunks together once all are in; ``name``: ``(variable, chunk, key)``."""

    __slots__ = ("batch", "out", "name")

    def __init__(self, batch: GpuBatch, out: Any, name: tuple[str, tuple[int, ...], str]):
        self.batch, self.out, self.name = batch, out, name

    def decode(self, dec: Any, raw: Any) -> None:
        self.batch.add(raw, self.out, self.name)

    def fill(self, dec: Any) -> None:
        self.batch.add_fill(self.out, dec.fill())


# ------------------------------------------------------------------------------------------ devices
class StandInGpu:
    """The device side of the GPU path with numpy for device memory and :class:`StandInDecoder` for
    nvCOMP: CI runs the very same read, gather and build steps as :class:`CupyGpu` does on a GPU."""

    kind = "stand-in"
    xp: Any = np

    def __init__(self) -> None:
        self._decoders: dict[GpuChain, Any] = {}
        self._pool = ArrayPool(keep=4, alloc=self._alloc)  # device buffers, given back as host ones are
        self._lock = threading.Lock()
        self.checked: set[Any] = set()  # chains (and "kept") whose device work passed its check on first use

    def is_device(self, a: Any) -> bool:
        """Whether ``a`` is in device memory (for the stand-in, every array is: numpy is its device)."""
        return True

    def free(self) -> int:
        """Free device memory, in bytes."""
        return 1 << 40

    def __reduce__(self) -> tuple[Any, ...]:  # a worker process's copy starts with no device state
        return (type(self), ())

    def _make_decoder(self, chain: GpuChain) -> Any:
        return StandInDecoder(chain)

    def _alloc(self, nbytes: int) -> Any:
        return self.xp.empty(nbytes, dtype=np.uint8)

    def decoder(self, chain: GpuChain) -> Any:
        with self._lock:
            got = self._decoders.get(chain)
            if got is None:
                got = self._decoders[chain] = self._make_decoder(chain)
            return got

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A device array (a buffer's): one given back before, where one of that shape and dtype is free."""
        return self._pool.take(shape, dtype)

    def give_back(self, arr: Any) -> None:
        self._pool.give_back(arr)

    def asarray(self, a: Any) -> Any:
        """``a`` (a host array) on the device."""
        return self.xp.array(a, copy=True)

    def to_host(self, a: Any) -> np.ndarray:
        return np.array(a, copy=True)

    def index(self, idx: np.ndarray) -> Any:
        """A host index array on the device (for a take or fancy index there)."""
        return idx

    def synchronize(self) -> None:
        """The work this thread queued on the device has completed."""


_CHECKED: dict[int, set[Any]] = {}  # device -> chains (and "kept") whose device work passed its check


class CupyGpu(StandInGpu):
    """The device side of the GPU path on CuPy's current device, decoding with nvCOMP."""

    kind = "cupy"

    def __init__(self) -> None:
        try:
            import cupy
        except ImportError:
            raise RuntimeError(f"the GPU path needs CuPy: {gpu_extra_hint()}") from None
        super().__init__()
        self.xp = cupy
        # what passed its check on this device passed it for the process: a later generator does not
        # decode its first buffers twice (on the host too) to check nvCOMP again
        self.checked = _CHECKED.setdefault(int(cupy.cuda.runtime.getDevice()), set())

    def _make_decoder(self, chain: GpuChain) -> Any:
        return NvcompDecoder(chain)

    def asarray(self, a: Any) -> Any:
        return self.xp.asarray(np.ascontiguousarray(a))

    def to_host(self, a: Any) -> np.ndarray:
        return self.xp.asnumpy(a)  # type: ignore[no-any-return]

    def is_device(self, a: Any) -> bool:
        return isinstance(a, self.xp.ndarray)

    def free(self) -> int:
        return int(self.xp.cuda.runtime.memGetInfo()[0])

    def index(self, idx: np.ndarray) -> Any:
        return self.xp.asarray(idx)

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()

# ------------------------------------------------------------------------------------------ decode=
def gpu_extra_hint() -> str:
    """The install line named by every error of a GPU option asked for without its packages."""
    return "pip install 'xinsitu[gpu-cu12]' (CUDA 12) or 'xinsitu[gpu-cu13]' (CUDA 13)"


def gpu_modules() -> tuple[Any, Any]:
    """(cupy, nvidia.nvcomp), or RuntimeError naming the extra to install."""
    try:
        import cupy

        nvcomp = importlib.import_module("nvidia.nvcomp")  # the nvidia-nvcomp-cu12/cu13 wheels
    except ImportError as e:
        raise RuntimeError(f"decode='gpu' needs cupy and nvCOMP ({e.name} is missing): {gpu_extra_hint()}") from None
    return cupy, nvcomp


def gpu_status() -> str:
    """Whether ``decode='auto'`` can decode on the GPU here, in words (``python -m xinsitu doctor``)."""
    try:
        cupy, nvcomp = gpu_modules()
    except RuntimeError as e:
        return f"cpu only: {e}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver: what doctor is for
        return f"cpu only: nvCOMP {getattr(nvcomp, '__version__', '?')} is installed, no CUDA device ({e})"
    return (f"nvCOMP {getattr(nvcomp, '__version__', '?')} on {n} CUDA device(s): zstd, lz4, gzip and zlib chunks "
            "decode on the GPU where batches go to one (decode='auto')")


def check_decode(decode: Any) -> str:
    if not isinstance(decode, str):
        raise TypeError(f"decode must be one of {DECODES}, got {type(decode).__name__} {decode!r}")
    if decode not in DECODES:
        raise ValueError(f"decode must be one of {DECODES}, got {decode!r}")
    return decode


def resolve_decode(decode: Any, cuda_target: str | None, arrays: dict[str, Any],
                   has_modules: Any = None) -> dict[str, GpuChain]:
    """Where each variable's chunks decode. ``cuda_target``: None where batches go to a CUDA device,
    else why not (e.g. "output='numpy'"); ``arrays``: variable -> zarr array (None: not a stored
    zarr array). ``decode='gpu'`` that cannot be honoured raises, naming why; ``'auto'`` takes the
    GPU where it can; ``'cpu'`` never does."""
    decode = check_decode(decode)
    if decode == "cpu":
        return {n: GpuChain(False, "decode='cpu'") for n in arrays}
    if cuda_target is not None:
        if decode == "gpu":
            raise ValueError(f"decode='gpu' needs batches on a CUDA device (device='cuda:0' with output='torch', "
                             f"output='cupy', or a GPU jax device), not {cuda_target}")
        return {n: GpuChain(False, f"no CUDA device: {cuda_target}") for n in arrays}
    try:
        (has_modules or gpu_modules)()
    except RuntimeError as e:
        if decode == "gpu":
            raise
        return {n: GpuChain(False, f"the gpu extra is not installed ({e})") for n in arrays}
    chains = {n: (gpu_chain(a) if a is not None else GpuChain(False, "not a stored zarr array"))
              for n, a in arrays.items()}
    if decode == "gpu":
        bad = {n: c.reason for n, c in chains.items() if not c.gpu}
        if bad:
            raise ValueError("decode='gpu': nvCOMP cannot decode the chunks of "
                             + ", ".join(f"{n!r} ({r})" for n, r in bad.items())
                             + "; leave decode='auto' to decode those on the CPU, or variables=[...] out")
    return chains
