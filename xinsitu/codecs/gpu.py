"""Chunk decode on the GPU (nvCOMP), which variables take it, and whether it pays (SPEC §4 "GPU").

* :func:`gpu_chain` reads an array's codec chain from its metadata and says whether nvCOMP can
  decode its stored objects bit for bit: plain ``bytes`` in native order (no array-to-array codec,
  no sharding), then at most one of zstd / lz4 (numcodecs' framing) / gzip / zlib, then optionally
  crc32c (verified on the host, over the compressed bytes, before anything is copied). Anything
  else (blosc and its shuffle, filters, GRIB, NetCDF packing, big-endian data) decodes on the CPU,
  and the chain says why.
* A buffer's chunks on their way to the device (:class:`GpuBatch`): the read path's completion step
  hands each chunk's stored bytes to the batch (``GpuSlot``) instead of decoding them. They land ONCE
  on the host, in a page-locked staging buffer (:class:`Staging`, from a :class:`PinnedRing` whose
  buffers are each reused once their copy's event completed): a local file is read straight into it,
  other bytes (obstore's) are copied in; the framing is stripped and a crc32c checked in the decode
  thread that fetched the chunk. Once every chunk of the buffer is in -- every variable's --
  ``flush`` copies the staging to the device in ONE transfer and decodes it with ONE batched call
  per compressor, straight into the destinations (``out=``: rows of a device buffer, or a sample's
  channels in a device batch). A chunk the device cannot decode is fetched again and decoded the
  CPU way by the reader.
* The device side of a decode is a *decoder*: :class:`NvcompDecoder` (CuPy + ``nvidia.nvcomp``; its
  decompression configs made once per batch shape, no stream synchronisation per call) or
  :class:`StandInDecoder` (numpy for device memory, numcodecs/zlib for nvCOMP), behind the same
  interface and with the same objects -- a stream per device and thread kept for the process, codecs
  that borrow it by handle (:data:`LIFETIMES`) -- so that CI runs the very host-side steps, bit for
  bit against zarr, and the objects' lifetimes.
* ``decode="auto"`` by measurement: the first buffer of each codec chain is decoded both ways (the
  first-use check, which compares them bit for bit) and timed; the faster path is kept for that
  chain for the rest of the process, on that device (:class:`Verdict`).
"""

from __future__ import annotations

import atexit
import functools
import importlib
import itertools
import math
import os
import struct
import sys
import threading
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from xinsitu.io import loop as _loop
from xinsitu.io.mempool import ArrayPool
from xinsitu.io.place import QUEUED, SCRATCH

#: decode= values
DECODES = ("auto", "cpu", "gpu")
#: byte alignment of each payload inside the transfer (nvCOMP's batched decoders need 8 at most; 64:
#: a local file read into its region is copied by the kernel at a third of the speed where the region
#: starts 8 or 16 bytes past a multiple of 64, measured on AMD EPYC, see ``mempool.page_aligned``)
ALIGN = 64
#: page-locked staging buffers a decoder reuses at least (each handed out again once its copy completed)
RING_SLOTS = 3
#: seconds the exit hook waits for decodes under way before it frees the codecs and streams
EXIT_WAIT_S = 5.0
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


def _bytes_of(dest: Any) -> Any:
    """A destination (a C-contiguous array of the chunk's shape) as its bytes, uint8, 1-D."""
    return dest.reshape(-1).view(np.uint8)


def _done(event: Any) -> bool:
    """Whether the work before ``event`` completed (CuPy's ``done``; the stand-in's always)."""
    return event is None or bool(event.done)


# ------------------------------------------------------------------------------------------ staging
class PinnedRing:
    """Page-locked staging buffers, reused batch after batch (``take``, ``give_back``): a buffer comes
    back with the event of its copy to the device and is handed out again only once that event has
    completed -- at once where its copy is done, else waited for where ``slots`` buffers exist already
    (the oldest first). ``alloc``: ``fn(nbytes) -> uint8 array`` of page-locked memory."""

    def __init__(self, alloc: Callable[[int], np.ndarray], slots: int = RING_SLOTS):
        self.alloc, self.slots = alloc, slots
        self._free: list[tuple[np.ndarray, Any]] = []  # (buffer, event of its last copy), oldest first
        self.n = 0  # buffers made and not let go
        self.allocs = self.waits = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` whose last copy has completed."""
        wait = None
        with self._lock:
            fits = [i for i, (b, _) in enumerate(self._free) if b.nbytes >= nbytes]
            for i in fits:
                buf, ev = self._free[i]
                if _done(ev):
                    del self._free[i]
                    return buf
            if fits and self.n >= self.slots:
                buf, wait = self._free.pop(fits[0])
                self.waits += 1
            else:
                self.n += 1
                self.allocs += 1
        if wait is not None:
            wait.synchronize()  # its copy to the device is under way: the buffer is reused once it is done
            return buf
        return self.alloc(max(nbytes + nbytes // 8, ALIGN))

    def give_back(self, buf: np.ndarray, event: Any = None) -> None:
        """``buf`` may be handed out again once ``event`` (None: at once) has completed; beyond ``slots``
        buffers kept, the oldest is let go (once its copy is done: page-locked memory freed under a copy
        would be read by it)."""
        with self._lock:
            self._free.append((buf, event))
            drop = self._free.pop(0) if len(self._free) > self.slots else None
            if drop is not None:
                self.n -= 1
        if drop is not None and not _done(drop[1]):
            drop[1].synchronize()


class Staging:
    """One buffer's compressed chunks on the host, in one page-locked buffer of ``capacity`` bytes (taken
    from ``ring`` when the first chunk comes): regions handed out one after another at ``ALIGN``-aligned
    offsets, to whichever decode thread asks (thread-safe). A local read fills its region itself
    (``take``, the scratch ``LocalBackend.read`` reads into); other bytes are copied into one (``put``).
    Bytes that do not fit are kept aside and packed behind the rest at ``finish``."""

    def __init__(self, ring: PinnedRing, capacity: int):
        self.ring, self.capacity = ring, max(capacity, ALIGN)
        self.buf: np.ndarray | None = None
        self.used = 0
        self.aside: list[bytes] = []  # what did not fit: at offsets -1, -2, ... until ``finish``
        self._lock = threading.Lock()
        self._mine = threading.local()  # the offset of the region this thread took last

    def _reserve(self, n: int) -> int | None:
        with self._lock:
            if self.buf is None:
                self.buf = self.ring.take(self.capacity)
            o = self.used
            end = o + -(-n // ALIGN) * ALIGN
            if end > self.buf.nbytes:
                return None
            self.used = end
            return o

    def take(self, n: int) -> memoryview:
        """``n`` bytes to read a chunk into (``decode.ThreadScratch``'s protocol): a region of the staging,
        or, where it is full, this thread's scratch (``put`` then keeps its bytes aside)."""
        o = self._reserve(n)
        self._mine.at = o
        if o is None:
            return SCRATCH.take(n)
        assert self.buf is not None
        return self.buf.data[o:o + n]

    def locate(self, raw: Any) -> int | None:
        """The offset of ``raw`` where it is the region this thread took last (read there), else None."""
        at = getattr(self._mine, "at", None)
        if at is None or not isinstance(raw, memoryview) or raw.obj is not self.buf:
            return None
        self._mine.at = None
        return at  # type: ignore[no-any-return]

    def put(self, part: memoryview) -> int:
        """``part`` copied into a region of its own (the one host copy of bytes not read here); its offset
        (negative: kept aside, see ``finish``)."""
        o = self._reserve(len(part))
        if o is None:
            with self._lock:
                self.aside.append(bytes(part))
                return -len(self.aside)
        assert self.buf is not None
        self.buf[o:o + len(part)] = np.frombuffer(part, dtype=np.uint8)
        return o

    def finish(self) -> tuple[np.ndarray | None, list[int]]:
        """The staging's buffer with everything in it, and the offsets the bytes kept aside now have (a
        bigger buffer, from the ring, where any were)."""
        if not self.aside:
            return self.buf, []
        old, used = self.buf, self.used
        total = used + sum(-(-len(a) // ALIGN) * ALIGN for a in self.aside)
        buf = self.ring.take(total)
        if old is not None:
            buf[:used] = old[:used]
            self.ring.give_back(old)  # (never copied to the device)
        offsets, o = [], used
        for a in self.aside:
            buf[o:o + len(a)] = np.frombuffer(a, dtype=np.uint8)
            offsets.append(o)
            o += -(-len(a) // ALIGN) * ALIGN
        self.buf, self.used, self.aside = buf, total, []
        return buf, offsets

    def release(self, event: Any = None) -> None:
        """The staging's buffer back to the ring, reused once ``event`` (its copy's) has completed."""
        if self.buf is not None:
            self.ring.give_back(self.buf, event)
            self.buf = None


# ------------------------------------------------------------------------------------------ lifetimes
class _Lifetimes:
    """The decode streams (one per device and thread, kept for the process) and the codecs that borrow
    them by handle (one per thread, stream and compressor; nvCOMP's codecs are not shared between
    threads). nvCOMP's codec holds its stream's raw handle: a stream destroyed before its codecs crashes
    the process when they are freed (a generator's objects collected in another order did, on an H200).
    So both live until the process exits, and at exit (an ``atexit`` hook, set with the first stream)
    the decodes under way are waited for (``EXIT_WAIT_S`` at most), then the codecs are freed, then the
    streams."""

    def __init__(self) -> None:
        self.streams: dict[tuple[str, int, int], Any] = {}  # (kind, device, thread) -> stream
        self.codecs: dict[tuple[int, int, str], Any] = {}  # (thread, stream handle, compressor) -> codec
        self.busy = 0  # decodes under way
        self.closed = False
        self._cond = threading.Condition()

    def stream(self, kind: str, device: int, make: Callable[[], Any]) -> Any:
        """This thread's decode stream on ``device`` (made by ``make`` on first use)."""
        key = (kind, device, threading.get_ident())
        got = self.streams.get(key)
        if got is None:
            with self._cond:
                if not self.streams and not self.codecs:
                    atexit.register(self.close)
                got = self.streams.setdefault(key, make())
        return got

    def codec(self, handle: int, compressor: str, make: Callable[[], Any]) -> Any:
        """This thread's codec of ``compressor`` on the stream of ``handle`` (made by ``make`` on first use)."""
        key = (threading.get_ident(), handle, compressor)
        got = self.codecs.get(key)
        if got is None:
            with self._cond:
                got = self.codecs.setdefault(key, make())
        return got

    def __enter__(self) -> None:
        with self._cond:
            if self.closed:
                raise RuntimeError("xinsitu: the interpreter is exiting; no more GPU decodes")
            self.busy += 1

    def __exit__(self, *exc: Any) -> None:
        with self._cond:
            self.busy -= 1
            self._cond.notify_all()

    def close(self) -> None:
        """At exit: wait for the decodes under way, then free the codecs, then the streams they borrow."""
        with self._cond:
            self.closed = True
            self._cond.wait_for(lambda: self.busy == 0, timeout=EXIT_WAIT_S)
            codecs, self.codecs = self.codecs, {}
        codecs.clear()  # first: they borrow the streams
        with self._cond:
            streams, self.streams = self.streams, {}
        streams.clear()


#: the process's decode streams and codecs (see ``_Lifetimes``)
LIFETIMES = _Lifetimes()
#: what the stand-in's codecs saw freed out of order (a codec freed after the stream it borrows)
LIFETIME_ERRORS: list[str] = []
_LIVE_STREAMS: set[int] = set()  # handles of the stand-in's streams not freed yet
_HANDLES = itertools.count(1)


class StandInStream:
    """A CUDA stream of the stand-in: a handle that codecs borrow (``ptr``), valid until it is freed."""

    def __init__(self) -> None:
        self.ptr = next(_HANDLES)
        self._live = _LIVE_STREAMS  # (held: module globals are gone late in interpreter shutdown)
        self._live.add(self.ptr)

    def __del__(self) -> None:
        self._live.discard(self.ptr)


class StandInCodec:
    """nvCOMP's codec as the stand-in has it: holding only its stream's handle (as nvCOMP does), decoding
    on the host (``host_decode``) straight into the destinations. One freed after its stream is what
    crashes nvCOMP: it is recorded in ``LIFETIME_ERRORS`` (and said on stderr)."""

    def __init__(self, compressor: str, stream: int):
        self.compressor, self.stream = compressor, stream
        self._live, self._errors, self._write = _LIVE_STREAMS, LIFETIME_ERRORS, os.write  # (as the stream's)

    def decode(self, parts: list[np.ndarray], outs: list[np.ndarray]) -> None:
        if self.stream not in self._live:
            raise RuntimeError(f"stand-in nvCOMP codec used after its stream {self.stream} was freed")
        for part, out in zip(parts, outs, strict=True):
            host_decode(self.compressor, part, out)

    def __del__(self) -> None:
        if self.stream not in self._live:
            msg = f"stand-in nvCOMP codec ({self.compressor}) freed after its stream {self.stream}"
            self._errors.append(msg)
            self._write(2, f"xinsitu: {msg}\n".encode())  # (fd 2: sys.stderr may be closed at exit)


class _Completed:
    """The stand-in's CUDA event: its work is done when it is recorded (the stand-in's device is the host)."""

    done = True

    def synchronize(self) -> None:
        pass


_COMPLETED = _Completed()


# ------------------------------------------------------------------------------------------ decoders
class Call(NamedTuple):
    """One batched decode: chunks of one compressor (None: stored uncompressed), their payloads at
    ``spans`` (offset, length) of the staging, decoded straight into ``outs`` (arrays of their chunk's
    shape); ``names`` say which chunk each is (words, or ``(variable, chunk, key)``: put in words only
    where an error names it)."""

    compressor: str | None
    spans: list[tuple[int, int]]
    outs: list[Any]
    names: list[Any]


class _Decoder:
    """What both decoders do the same: ``decode_staged`` copies a staging's payloads to the device in one
    transfer and runs one batched decode per ``Call``; ``decode_many`` is the same for a list of stored
    chunks of one chain (benches, tests). The device side is the subclass's (``_run``)."""

    kind = "?"

    def __init__(self, ring: PinnedRing):
        self.ring = ring
        self.transfers = self.decode_calls = 0
        self._lock = threading.Lock()  # the counters (batches run in several threads)

    def decode_staged(self, host: np.ndarray, calls: list[Call]) -> tuple[Any, Any]:
        """The payloads of ``calls`` (in ``host``, page-locked) copied to the device in ONE transfer (the
        span from the first to the last) and decoded by one batched call per ``Call`` into its outs, on
        this thread's decode stream, after the work queued so far on the thread's current stream (which
        may have used the destinations' memory last). Returns two events: the copy done (``host`` may be
        reused), everything done."""
        copied, done = self._staged(host, calls)
        with self._lock:
            self.transfers += 1
            self.decode_calls += sum(c.compressor is not None for c in calls)
        return copied, done

    def time_staged(self, host: np.ndarray, calls: list[Call]) -> float:
        """The seconds ``decode_staged`` of ``calls`` takes, transfer included, waited for: the first-use
        check's measure (the same chunks decoded again; not counted as a transfer)."""
        t0 = time.perf_counter()
        _, done = self._staged(host, calls)
        done.synchronize()
        return time.perf_counter() - t0

    def _staged(self, host: np.ndarray, calls: list[Call]) -> tuple[Any, Any]:
        spans = [s for c in calls for s in c.spans]
        lo = min(o for o, _ in spans)
        hi = max(o + n for o, n in spans)
        with LIFETIMES:
            return self._run(host, lo, hi, calls)

    def _run(self, host: np.ndarray, lo: int, hi: int, calls: list[Call]) -> tuple[Any, Any]:
        raise NotImplementedError

    def relax(self) -> bool:
        """Give up an optimisation the device's first decode may have failed on (True: something was
        given up, worth trying again)."""
        return False

    def decode_many(self, raws: list[Any], dests: list[Any], chain: GpuChain, where: list[str] | None = None) -> None:
        """Decode the stored bytes ``raws`` of chunks of ``chain`` into ``dests`` (arrays of the chunk's
        shape), through a staging and one ``decode_staged``; done when it returns."""
        if not chain.gpu:
            raise ValueError(f"this chain decodes on the CPU: {chain.reason}")
        if len(raws) != len(dests):
            raise ValueError(f"decode_many: {len(raws)} chunks but {len(dests)} destinations")
        if not raws:
            return
        names = where or [f"chunk {i}" for i in range(len(raws))]
        for d, w in zip(dests, names, strict=True):
            check_dest(d, chain, w)
        parts = [payload(r, chain, w) for r, w in zip(raws, names, strict=True)]
        staging = Staging(self.ring, sum(-(-len(p) // ALIGN) * ALIGN for p in parts))
        spans = [(staging.put(p), len(p)) for p in parts]
        host, _ = staging.finish()
        assert host is not None
        copied = None
        try:
            copied, done = self.decode_staged(host, [Call(chain.compressor, spans, list(dests), names)])
            done.synchronize()
        finally:
            staging.release(copied)


def check_dest(dest: Any, chain: GpuChain, where: str) -> None:
    """``dest`` must be a C-contiguous array of the chunk's shape and dtype (decoded straight into)."""
    if tuple(dest.shape) != chain.shape or dest.dtype != chain.dtype or not dest.flags.c_contiguous:
        raise ValueError(f"{where}: destination {tuple(dest.shape)} {dest.dtype} is not the chunk's "
                         f"{chain.shape} {chain.dtype} (C-contiguous)")


def _check_sizes(call: Call) -> None:
    """Stored-uncompressed payloads must be their chunk's size (the decoders copy them as they are)."""
    if call.compressor is None:
        for (_, n), out, w in zip(call.spans, call.outs, call.names, strict=True):
            if n != out.nbytes:
                raise ValueError(f"{_words(w)}: {n} bytes stored uncompressed, the chunk has {out.nbytes}")


class StandInDecoder(_Decoder):
    """The decoder with numpy for device memory and ``StandInCodec`` (numcodecs/zlib) for nvCOMP's: the
    same staging, transfer and batched calls as ``NvcompDecoder``, on a stand-in stream per thread kept
    for the process, with codecs that borrow it by handle."""

    kind = "stand-in"

    def __init__(self, ring: PinnedRing | None = None):
        super().__init__(ring or PinnedRing(lambda n: np.empty(n, dtype=np.uint8)))

    def _transfer(self, host: np.ndarray) -> np.ndarray:
        """The one host-to-"device" copy."""
        return host.copy()

    def _run(self, host: np.ndarray, lo: int, hi: int, calls: list[Call]) -> tuple[Any, Any]:
        stream = LIFETIMES.stream("stand-in", 0, StandInStream)
        device = self._transfer(host[lo:hi])
        for call in calls:
            _check_sizes(call)
            parts = [device[o - lo:o - lo + n] for o, n in call.spans]
            outs = [_bytes_of(d) for d in call.outs]
            if call.compressor is None:
                for p, o in zip(parts, outs, strict=True):
                    o[...] = p
                continue
            codec = LIFETIMES.codec(stream.ptr, call.compressor, functools.partial(StandInCodec, call.compressor,
                                                                                     stream.ptr))
            codec.decode(parts, outs)
        return _COMPLETED, _COMPLETED


class NvcompDecoder(_Decoder):
    """Decode on a CUDA device with nvCOMP (``from nvidia import nvcomp``) straight into CuPy arrays.

    Per thread a stream and its codecs, kept for the process (``LIFETIMES``); the staging's payloads go
    to the device in one ``set`` on that stream, the codec decodes them there into the destinations
    (``out=``) with a decompression config made once per batch shape (compressor and chunk sizes: from a
    compression config of those sizes, so no call synchronises the stream to read the chunks' headers),
    and an event after the copy releases the page-locked buffer for the next batch."""

    kind = "nvcomp"

    def __init__(self, ring: PinnedRing | None = None):
        cupy, nvcomp = gpu_modules()
        self.cupy, self.nvcomp = cupy, nvcomp
        super().__init__(ring or PinnedRing(
            lambda n: np.frombuffer(cupy.cuda.alloc_pinned_memory(n), dtype=np.uint8, count=n)))
        self.configs = True  # decompression configs made ahead (False: nvCOMP reads each batch's headers)
        self._configs: dict[tuple[int, str, tuple[tuple[int, int], ...]], Any] = {}

    def relax(self) -> bool:
        if not self.configs:
            return False
        self.configs = False
        return True

    def _config(self, codec: Any, compressor: str, outs: list[Any]) -> Any:
        """The decompression config of a batch of outputs of these sizes (None: let nvCOMP read them)."""
        if not self.configs:
            return None
        runs: list[list[int]] = []
        for o in outs:
            if runs and runs[-1][0] == o.nbytes:
                runs[-1][1] += 1
            else:
                runs.append([o.nbytes, 1])
        key = (id(codec), compressor, tuple((n, k) for n, k in runs))
        got = self._configs.get(key)
        if got is None:
            try:
                got = codec.decompression_config(codec.compression_config([o.nbytes for o in outs]))
            except Exception:  # noqa: BLE001 - an nvCOMP without configs made ahead: it reads the headers
                self.configs = False
                return None
            if len(self._configs) > 256:
                self._configs.clear()
            self._configs[key] = got
        return got

    def _run(self, host: np.ndarray, lo: int, hi: int, calls: list[Call]) -> tuple[Any, Any]:
        cupy, nvcomp = self.cupy, self.nvcomp
        stream = LIFETIMES.stream("cupy", int(cupy.cuda.runtime.getDevice()),
                                  lambda: cupy.cuda.Stream(non_blocking=True))
        after = cupy.cuda.Event(disable_timing=True)
        after.record(cupy.cuda.get_current_stream())
        with stream:
            stream.wait_event(after)
            device = cupy.empty(hi - lo, dtype=cupy.uint8)
            device.set(host[lo:hi], stream=stream)  # the ONE transfer
            copied = cupy.cuda.Event(disable_timing=True)
            copied.record(stream)
            for call in calls:
                _check_sizes(call)
                parts = [device[o - lo:o - lo + n] for o, n in call.spans]
                outs = [_bytes_of(d) for d in call.outs]
                if call.compressor is None:
                    for p, o in zip(parts, outs, strict=True):
                        o[...] = p
                    continue
                c = call.compressor
                codec = LIFETIMES.codec(int(stream.ptr), c, functools.partial(
                    nvcomp.Codec, algorithm=ALGORITHMS[c], bitstream_kind=nvcomp.BitstreamKind.RAW,
                    cuda_stream=int(stream.ptr)))
                cfg = self._config(codec, c, outs)
                more = {} if cfg is None else {"decompression_config": cfg}
                codec.decode(nvcomp.as_arrays(parts), out=nvcomp.as_arrays(outs), **more)
            done = cupy.cuda.Event(disable_timing=True)
            done.record(stream)
        return copied, done


# ------------------------------------------------------------------------------------------ a buffer's chunks
@dataclass(frozen=True)
class Verdict:
    """How fast the first buffer of a codec chain decoded on the GPU and by the CPU path (decoded bytes
    per second), and so which path ``decode="auto"`` keeps for that chain."""

    gpu_rate: float
    cpu_rate: float

    @property
    def gpu_faster(self) -> bool:
        return self.gpu_rate > self.cpu_rate

    def words(self) -> str:
        """"GPU 2.1 GB/s < CPU 7.8 GB/s, measured on the first buffer"."""
        sign = ">" if self.gpu_faster else "<" if self.gpu_rate < self.cpu_rate else "="
        return f"GPU {_rate(self.gpu_rate)} {sign} CPU {_rate(self.cpu_rate)}, measured on the first buffer"


def _rate(r: float) -> str:
    return f"{r / 1e9:.1f} GB/s" if r >= 1e8 else f"{r / 1e6:.1f} MB/s"


class _Entry(NamedTuple):
    chain: GpuChain
    off: int  # offset of the payload in the staging (negative: kept aside, see ``Staging.finish``)
    n: int
    dest: Any
    name: tuple[str, tuple[int, ...], str]  # (variable, chunk, key)


@dataclass
class Flushed:
    """What a ``GpuBatch.flush`` did: chunks decoded on the device per chain, chains whose check on first
    use failed (their chunks are not in place: the CPU path takes them over), chains that passed it,
    and chunks the device could not decode (``(chain, dest, name)``: to fetch again and decode the CPU
    way), and the seconds it took."""

    decoded: dict[GpuChain, int] = field(default_factory=dict)
    failed: dict[GpuChain, GpuPathError] = field(default_factory=dict)
    checked: list[GpuChain] = field(default_factory=list)
    refetch: list[tuple[GpuChain, Any, tuple[str, tuple[int, ...], str]]] = field(default_factory=list)
    seconds: float = 0.0


class GpuBatch:
    """A buffer's chunks decoded on the GPU -- every variable's -- collected by the read path's completion
    step (``GpuSlot``, in the decode threads) into one staging and decoded together by ``flush``.

    ``add`` finds or copies a chunk's bytes in the staging (a local read put them there already) and
    leaves its framing off there, checking a crc32c, in the calling decode thread; a chunk whose stored
    bytes are not what the chain says goes to the CPU way (``Flushed.refetch``). ``add_fill`` notes a
    chunk with no object, given its fill value at ``flush``. A chunk is named by ``(variable, chunk, key)``.
    ``capacity``: the staging's bytes (the chunks' ``GpuChain.bound``)."""

    def __init__(self, decoder: Any, capacity: int, asarray: Any = np.asarray):
        self.decoder, self.asarray = decoder, asarray  # asarray: a host array onto the device
        self.staging = Staging(decoder.ring, capacity)
        self.entries: list[_Entry] = []
        self.bad: list[tuple[GpuChain, Any, tuple[str, tuple[int, ...], str]]] = []
        self.fills: list[tuple[Any, np.ndarray]] = []
        self._lock = threading.Lock()

    def add(self, raw: Any, chain: GpuChain, dest: Any, name: tuple[str, tuple[int, ...], str]) -> None:
        staging = self.staging
        at = staging.locate(raw)
        view = memoryview(raw).cast("B") if at is None else raw
        try:
            a, b = payload_span(view, chain, _words(name))
        except ValueError:  # not a chunk of this chain (damaged, or framed otherwise): the CPU way decides
            with self._lock:
                self.bad.append((chain, dest, name))
            return
        if at is None:
            off = staging.put(view[a:b])
        elif (at + a) % ALIGN:  # framing before the payload (lz4, zlib, gzip): moved to the aligned start
            buf = staging.buf
            assert buf is not None
            buf[at:at + b - a] = buf[at + a:at + b]  # (numpy copies overlapping ranges correctly)
            off = at
        else:
            off = at + a
        with self._lock:
            self.entries.append(_Entry(chain, off, b - a, dest, name))

    def add_fill(self, dest: Any, value: np.ndarray) -> None:
        with self._lock:
            self.fills.append((dest, value))

    def flush(self, gpu: Any = None) -> Flushed:
        """Decode every chunk added (and put the fill values in place); done on the device when it returns.

        With ``gpu`` (the device side), the chunks of a chain it has not checked yet (``gpu.checked``) are
        decoded on the host too, both timed, and compared bit for bit: a chain that fails is in
        ``Flushed.failed``; the two rates are ``gpu.judge``d into ``gpu.verdicts``."""
        t0 = time.perf_counter()
        with self._lock:
            entries, fills, bad = self.entries, self.fills, self.bad
            self.entries, self.fills, self.bad = [], [], []
        out = Flushed(refetch=list(bad))
        staging = self.staging
        host, moved = staging.finish()
        if moved:
            entries = [e._replace(off=moved[-e.off - 1]) if e.off < 0 else e for e in entries]
        copied = None
        try:
            first = [] if gpu is None else list(dict.fromkeys(e.chain for e in entries if e.chain not in gpu.checked))
            for chain in first:
                mine = [e for e in entries if e.chain == chain]
                try:
                    out.decoded[chain] = self._first_use(host, chain, mine, gpu, out)
                    out.checked.append(chain)
                except GpuPathError as e:
                    out.failed[chain] = e
            rest = [e for e in entries if e.chain not in first]
            if rest:
                assert host is not None
                copied = self._decode(host, rest, out)
        finally:
            staging.release(copied)
        for dest, value in fills:
            dest[...] = self.asarray(value)
        out.seconds = time.perf_counter() - t0
        return out

    def _decode(self, host: np.ndarray, entries: list[_Entry], out: Flushed) -> Any:
        """``entries`` decoded: one transfer, one batched call per compressor; where that fails, one by one,
        and those that fail alone are left to the CPU way. The event of the (last) copy."""
        calls = _calls(entries)
        try:
            copied, done = self.decoder.decode_staged(host, calls)
            done.synchronize()
        except Exception:  # noqa: BLE001 - which chunk: decoded one by one below
            copied = None
            for e in entries:
                try:
                    copied, done = self.decoder.decode_staged(host, _calls([e]))
                    done.synchronize()
                except Exception:  # noqa: BLE001 - fetched again and decoded the CPU way, named there if it fails
                    out.refetch.append((e.chain, e.dest, e.name))
                    continue
                out.decoded[e.chain] = out.decoded.get(e.chain, 0) + 1
            return copied
        for e in entries:
            out.decoded[e.chain] = out.decoded.get(e.chain, 0) + 1
        return copied

    def _first_use(self, host: np.ndarray | None, chain: GpuChain, entries: list[_Entry], gpu: Any,
                   out: Flushed) -> int:
        """The first buffer of ``chain`` on this device: decoded on the host (timed: one thread's rate, times
        the decode threads, at most one chunk each: the CPU path's) and on the device (its payloads packed
        together, as a buffer of them alone would be, then one transfer and one batched call, waited for),
        compared bit for bit, then decoded on the device again, timed (the first time pays for the device
        side's set-up); the verdict kept in ``gpu.verdicts``. ``GpuPathError`` where the device's decode
        fails or differs (after giving up what ``decoder.relax`` gives up, once). The number of chunks
        decoded."""
        assert host is not None
        ref, good = [], []
        t0 = time.perf_counter()
        for e in entries:
            r = np.empty(chain.nbytes, dtype=np.uint8)
            try:
                host_decode(chain.compressor, host[e.off:e.off + e.n], r)
            except Exception:  # noqa: BLE001 - the data, not the device: fetched again the CPU way, and named
                out.refetch.append((e.chain, e.dest, e.name))
                continue
            ref.append(r)
            good.append(e)
        cpu_s = time.perf_counter() - t0
        if not good:
            return 0
        ring = self.decoder.ring
        dense = Staging(ring, sum(-(-e.n // ALIGN) * ALIGN for e in good))
        spans = [(dense.put(host[e.off:e.off + e.n].data), e.n) for e in good]
        packed, _ = dense.finish()
        assert packed is not None
        call = [Call(chain.compressor, spans, [e.dest for e in good], [e.name for e in good])]
        copied = None
        try:
            for attempt in (0, 1):
                try:
                    copied, done = self.decoder.decode_staged(packed, call)
                    done.synchronize()
                    for r, e in zip(ref, good, strict=True):
                        if r.tobytes() != np.ascontiguousarray(gpu.to_host(e.dest)).view(np.uint8).tobytes():
                            raise ValueError(f"{_words(e.name)} decoded on the device differs from the host's decode")
                    # timed the second time: the first pays the device side's set-up (codecs, kernels)
                    gpu_s = self.decoder.time_staged(packed, call)
                    break
                except Exception as err:  # noqa: BLE001 - said, and the CPU path takes over
                    if attempt == 0 and self.decoder.relax():
                        continue
                    raise GpuPathError(f"{type(err).__name__}: {err}") from err
        finally:
            dense.release(copied)
        nbytes = chain.nbytes * len(good)
        gpu.verdicts[chain] = gpu.judge(chain, nbytes, cpu_s / min(len(good), _loop.decode_threads()), gpu_s)
        return len(good)


def _calls(entries: list[_Entry]) -> list[Call]:
    """One ``Call`` per compressor, its chunks grouped by chain (so that a batch of the same chunks has
    the same sizes in the same order: one decompression config)."""
    by: dict[str | None, list[_Entry]] = {}
    for e in sorted(entries, key=lambda e: (e.chain.nbytes, e.chain.reason)):
        by.setdefault(e.chain.compressor, []).append(e)
    return [Call(c, [(e.off, e.n) for e in es], [e.dest for e in es], [e.name for e in es]) for c, es in by.items()]


def _words(name: Any) -> str:
    """``(variable, chunk, key)`` in words (words as they are)."""
    if isinstance(name, str):
        return name
    var, chunk, key = name
    return f"variable {var!r}, chunk {chunk}, key {key!r}"


class GpuSlot:
    """The destination of a chunk decoded on the GPU (``decode.Destination``): ``out``, a device array of
    the chunk's shape (a row of a device buffer, a sample's channels in a device batch). ``decode`` only
    hands the bytes to ``batch`` (``QUEUED``), which decodes the buffer's chunks together once all are
    in; ``name``: ``(variable, chunk, key)``."""

    __slots__ = ("batch", "out", "chain", "name")

    def __init__(self, batch: GpuBatch, out: Any, chain: GpuChain, name: tuple[str, tuple[int, ...], str]):
        self.batch, self.out, self.chain, self.name = batch, out, chain, name

    def decode(self, dec: Any, raw: Any) -> str:
        self.batch.add(raw, self.chain, self.out, self.name)
        return QUEUED

    def fill(self, dec: Any) -> None:
        self.batch.add_fill(self.out, dec.fill())


def chain_on_gpu(on_gpu: dict[str, GpuChain], name: str, gpu: Any, follow_verdicts: bool) -> GpuChain | None:
    """Variable ``name``'s chain where its chunks go to the device (decoded there, or kept there: in
    ``on_gpu``), else None. With ``follow_verdicts`` (``decode='auto'``), a chain whose first buffer decoded
    faster by the CPU path (``gpu.verdicts``) leaves ``on_gpu`` here: the CPU path from then on."""
    chain = on_gpu.get(name)
    if chain is not None and chain.gpu and follow_verdicts:
        verdict = gpu.verdicts.get(chain)
        if verdict is not None and not verdict.gpu_faster:
            on_gpu.pop(name, None)
            return None
    return chain


# ------------------------------------------------------------------------------------------ devices
class StandInGpu:
    """The device side of the GPU path with numpy for device memory and :class:`StandInDecoder` for
    nvCOMP: CI runs the very same read, gather and build steps as :class:`CupyGpu` does on a GPU."""

    kind = "stand-in"
    xp: Any = np

    def __init__(self) -> None:
        self._decoder: Any = None
        self._pool = ArrayPool(keep=4, alloc=self._alloc)  # device buffers, given back as host ones are
        self._lock = threading.Lock()
        self.checked: set[Any] = set()  # chains (and "kept") whose device work passed its check on first use
        self.verdicts: dict[GpuChain, Verdict] = {}  # chain -> its first buffer's two rates
        self.first_use = threading.Lock()  # held by a buffer checking a chain on first use (one at a time)

    def is_device(self, a: Any) -> bool:
        """Whether ``a`` is in device memory (for the stand-in, every array is: numpy is its device)."""
        return True

    def free(self) -> int:
        """Free device memory, in bytes."""
        return 1 << 40

    def __reduce__(self) -> tuple[Any, ...]:  # a worker process's copy starts with no device state
        return (type(self), ())

    def _make_decoder(self) -> Any:
        return StandInDecoder()

    def _alloc(self, nbytes: int) -> Any:
        return self.xp.empty(nbytes, dtype=np.uint8)

    def decoder(self) -> Any:
        """The decoder of this device (one for every chain: its staging ring is shared)."""
        with self._lock:
            if self._decoder is None:
                self._decoder = self._make_decoder()
            return self._decoder

    def judge(self, chain: GpuChain, nbytes: int, cpu_s: float, gpu_s: float) -> Verdict:
        """The verdict on a chain's first buffer: ``nbytes`` decoded by the CPU path in ``cpu_s`` seconds
        (the host's decode shared by the decode threads) and on the device in ``gpu_s`` (transfer and
        batched decode, waited for). The seam where a test sets the two rates."""
        return Verdict(nbytes / max(gpu_s, 1e-9), nbytes / max(cpu_s, 1e-9))

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A device array (a buffer's): one given back before, where one of that shape and dtype is free."""
        return self._pool.take(shape, dtype)

    def new(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A new device array (a batch's own, handed out)."""
        return self.xp.empty(shape, dtype=dtype)

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
_VERDICTS: dict[int, dict[GpuChain, Verdict]] = {}  # device -> chain -> its first buffer's two rates
_FIRST_USE: dict[int, threading.Lock] = {}  # device -> held while a chain is checked on first use


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
        # decode its first buffers twice (on the host too) to check nvCOMP again, and keeps the path
        # the first buffer's rates chose
        device = int(cupy.cuda.runtime.getDevice())
        self.checked = _CHECKED.setdefault(device, set())
        self.verdicts = _VERDICTS.setdefault(device, {})
        self.first_use = _FIRST_USE.setdefault(device, threading.Lock())

    def _make_decoder(self) -> Any:
        return NvcompDecoder()

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
