"""The one way a chunk lands: ``place(decoder, raw | None, dest) -> ChunkOutcome``, run in a decode
thread (or, for a codec chain that decodes on the loop, ``place_async``), and the decode threads'
batching of the calls of one loop turn (``TurnBatch``).

Every read strategy of the reader -- local files read in the decode threads, remote objects
fetched by callbacks or by tasks, inner chunks of shards -- only produces the chunk's bytes
(None: no object, the fill value) and hands them to ``place`` with the chunk's destination; the
reader then settles the outcome in one place (``Reader.settle``: counters, the in-flight policy,
``missing=``, the slot given back once).

A destination is anything with ``decode(dec, raw)`` and ``fill(dec)`` (``Destination``). Two exist:
``Slot`` -- a whole chunk decoded straight into an array of its shape (a buffer's row) -- and
``Pieces`` -- a chunk's pieces copied into regions and handed to hooks. Both may carry a cache keep:
the decoded chunk is handed to the cache in the decode thread, where copying it costs the loop
nothing. A new destination (a device buffer: the decode writes into device memory; a decoder that
takes many raws at once: a destination that queues the raw and is flushed per batch) is one more
class with these two methods, not a new route: the fetchers and ``Reader.settle`` stay as they are.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import numpy as np

from xinsitu.index.regions import Target, all_slices, assign, piece, readonly, whole_view
from xinsitu.io import loop as _loop
from xinsitu.io.mempool import page_aligned

if TYPE_CHECKING:
    from xinsitu.codecs.cpu import ChunkDecoder


class ChunkCache(Protocol):
    """What the completion step asks of a chunk cache (``xinsitu.cache.ChunkCache``): keep a decoded chunk.
    (A protocol, not the cache's type: the cache's modules import this one.)"""

    def put(self, key: Any, array: np.ndarray, *, disk_key: str | None = None, born: int | None = None,
            version: str | None = None) -> None: ...


class ChunkKey(Protocol):
    """The cache keys of one array's chunks (``xinsitu.cache.ChunkKey``), as the completion step uses them."""

    since_ns: int

    def memory_key(self, chunk: tuple[int, ...]) -> Any: ...

T = TypeVar("T")

#: ``ChunkOutcome.status``: the chunk's bytes were decoded into place
DECODED = "decoded"
#: ... no object: the fill value was put in place (``missing=`` applies)
MISSING = "missing"
#: ... an inner chunk its shard's index says was never written: the fill value, as zarr reads it
EMPTY = "empty"
#: ... the bytes were handed to a decoder that decodes many chunks at once, later (the GPU path's
#: ``gpu_batch.GpuSlot``): counted as read now, as decoded once that decoder has decoded it
QUEUED = "queued"
#: chunks a decoder of many decoded (``QUEUED`` before): ``nbytes`` decoded, ``took`` its seconds
BATCH_DECODED = "batch decoded"
#: chunks a cache tier had (memory or device): put in place without a request or a decode
HIT = "hit"
#: ... chunks the disk tier had
DISK_HIT = "disk hit"
#: a region another reader read whole in one request (zarr for shards it cannot split, dask):
#: ``nbytes`` decoded
READ_ELSEWHERE = "read elsewhere"


class ChunkOutcome(NamedTuple):
    """How one chunk landed: ``status`` (``DECODED``, ``MISSING``, ``EMPTY``, ``QUEUED``; and for the
    outcomes settled without ``place``: ``BATCH_DECODED``, ``HIT``, ``DISK_HIT``, ``READ_ELSEWHERE``),
    the bytes read, the seconds its request waited for them (0 where unknown) and the seconds its decode
    took (measured in the thread that decoded it: waiting for a free thread is not decoding)."""

    status: str
    nbytes: int
    waited: float
    took: float


#: the outcome of chunks a cache tier had (settled ``n`` at a time)
SETTLED_HIT = ChunkOutcome(HIT, 0, 0.0, 0.0)
SETTLED_DISK_HIT = ChunkOutcome(DISK_HIT, 0, 0.0, 0.0)


class Destination(Protocol):
    """Where a chunk lands (see the module)."""

    def decode(self, dec: ChunkDecoder, raw: Any) -> str | None:
        """Decode ``raw`` (the chunk's bytes) into place; ``QUEUED`` where it is only queued for a
        decode of many chunks at once (None: decoded)."""
        ...

    def fill(self, dec: ChunkDecoder) -> None:
        """Put the fill value in place (the chunk has no bytes)."""
        ...


def place(dec: ChunkDecoder, raw: Any, dest: Destination, waited: float = 0.0, absent: str = MISSING) -> ChunkOutcome:
    """Decode ``raw`` into ``dest`` (None: the fill value, with status ``absent``): the one per-chunk
    completion step of every read (a decode-thread call). A destination that only queues the bytes
    for a later decode says so (``QUEUED``, its ``decode``'s return value)."""
    t0 = time.perf_counter()
    if raw is None:
        dest.fill(dec)
        return ChunkOutcome(absent, 0, waited, time.perf_counter() - t0)
    status = dest.decode(dec, raw) or DECODED
    return ChunkOutcome(status, len(raw), waited, time.perf_counter() - t0)


async def place_async(dec: ChunkDecoder, raw: Any, dest: Pieces, waited: float = 0.0) -> ChunkOutcome:
    """``place`` for a codec chain that decodes on the loop (not ``dec.sync``)."""
    t0 = time.perf_counter()
    if raw is None:
        dest.fill(dec)
        return ChunkOutcome(MISSING, 0, waited, time.perf_counter() - t0)
    dest.put(await dec.decode(raw))
    return ChunkOutcome(DECODED, len(raw), waited, time.perf_counter() - t0)


def place_each(dec: ChunkDecoder, raws: Sequence[Any], dests: Sequence[Destination],
               placed: list[ChunkOutcome]) -> None:
    """``place`` for several chunks in turn (inner chunks of a shard), each outcome appended to
    ``placed`` as it lands (a fetch made again after a failure skips those: hooks run once)."""
    for raw, dest in zip(raws, dests, strict=True):
        placed.append(place(dec, raw, dest))


class ThreadScratch(threading.local):
    """Each decode thread's reused memory: the bytes of the file it reads (``LocalBackend.read``),
    grown as needed and never shrunk, and a chunk array per (shape, dtype) for chunks put nowhere
    but in hooks."""

    buf = memoryview(bytearray())
    chunks: dict[tuple[Any, ...], np.ndarray] | None = None

    def take(self, n: int) -> memoryview:
        """A view of ``n`` bytes of this thread's buffer, valid until its next ``take``; it starts on a page
        (``mempool.page_aligned``: files are read into it)."""
        if len(self.buf) < n:
            self.buf = page_aligned(n + n // 4).data  # a new one: views of the old may still be alive
        return self.buf[:n]

    def room(self) -> memoryview:
        """All of this thread's buffer (empty before its first ``take``), valid until its next ``take``: a
        file that reads short of its end is whole (``LocalBackend.read``)."""
        return self.buf

    def chunk(self, dec: ChunkDecoder) -> np.ndarray:
        """This thread's reused array of the chunk's shape and dtype."""
        if self.chunks is None:
            self.chunks = {}
        key = (dec.shape, dec.dtype)
        got = self.chunks.get(key)
        if got is None:
            if len(self.chunks) >= 8:
                self.chunks.clear()
            got = self.chunks[key] = np.empty(dec.shape, dec.dtype)
        return got


#: the decode threads' scratch memory (see ``ThreadScratch``)
SCRATCH = ThreadScratch()


def _put_cache(cache: ChunkCache, key: Any, chunk: np.ndarray, disk_key: str | None = None,
               born: int | None = None, version: str | None = None) -> None:
    """Hand a decoded chunk to the cache, which copies it (never a failed read: one it cannot keep is read)."""
    try:
        cache.put(key, chunk, disk_key=disk_key, born=born, version=version)
    except (OSError, MemoryError):  # a chunk the cache cannot keep is still read: never a failed read
        pass


class Slot:
    """A whole chunk decoded straight into ``out`` (an array of the chunk's shape: a buffer's row);
    with ``keep`` (a cache and the array's ``ChunkKey``) the memory tier keeps a copy under chunk
    ``coords``."""

    __slots__ = ("out", "keep", "coords")

    def __init__(self, out: np.ndarray, keep: tuple[ChunkCache, ChunkKey] | None = None,
                 coords: tuple[int, ...] = ()):
        self.out, self.keep, self.coords = out, keep, coords

    def decode(self, dec: ChunkDecoder, raw: Any) -> None:
        out = self.out
        if not dec.decode_into(raw, out):
            out[...] = dec.decode_sync(raw)
        if self.keep is not None:
            cache, keys = self.keep  # copied: the row is the caller's
            _put_cache(cache, keys.memory_key(self.coords), out, born=keys.since_ns)

    def fill(self, dec: ChunkDecoder) -> None:
        self.out[...] = dec.fill()  # a chunk with no object is not cached


class Pieces:
    """A chunk's pieces: each target's piece copied into its region and handed to its hook. With a
    cache (``cache``, its memory ``key``, where it has a disk tier ``disk_key``, ``born``: the reader's
    ``ChunkKey.since_ns``, and the remote object's ``version`` where known) the decoded chunk is kept
    (see ``cache.lookup.serve_cached``), before any hook (which may use it as scratch)."""

    __slots__ = ("targets", "cache", "key", "disk_key", "born", "version")

    def __init__(self, targets: list[Target], cache: ChunkCache | None = None, key: Any = None,
                 disk_key: str | None = None, born: int | None = None, version: str | None = None):
        self.targets, self.cache, self.key, self.disk_key = targets, cache, key, disk_key
        self.born, self.version = born, version

    def decode(self, dec: ChunkDecoder, raw: Any) -> None:
        targets, cache = self.targets, self.cache
        view = whole_view(dec.shape, targets)
        if view is not None and dec.decode_into(raw, view):
            if cache is not None:
                self.keep(view)  # copied: the view is the caller's
            hook = targets[0].hook
            if hook is not None:
                hook(readonly(view), targets[0].out_sel)  # the caller's array
            return
        if all(t.out is None for t in targets):  # only hooks: decode into this thread's buffer, no allocation
            buf = SCRATCH.chunk(dec)
            if dec.decode_into(raw, buf):
                if cache is not None:
                    self.keep(buf)  # copied: the buffer is reused
                put_all(buf, targets)
                return
        self.put(dec.decode_sync(raw))

    def keep(self, chunk: np.ndarray) -> None:
        """Hand the decoded chunk to the cache (which copies it)."""
        assert self.cache is not None
        _put_cache(self.cache, self.key, chunk, self.disk_key, self.born, self.version)

    def put(self, chunk: np.ndarray) -> None:
        """Put a decoded chunk (the reader's own new array) in place, kept where cached."""
        if self.cache is not None:
            self.keep(chunk)
        put_all(chunk, self.targets)

    def fill(self, dec: ChunkDecoder) -> None:
        put_all(dec.fill(), self.targets)  # a chunk with no object is not cached


def put_all(chunk: np.ndarray, targets: list[Target]) -> None:
    """Put a chunk (the reader's own array, or a cached one) in place and call the hooks; a hook may
    write to its values only where it is the chunk's one consumer."""
    for out, out_sel, in_sel, drop, hook in targets:
        if out is not None:
            assign(out, out_sel, chunk, in_sel, drop)
        if hook is not None:
            values = piece(chunk, in_sel, drop)
            hook(values if len(targets) == 1 else readonly(values), out_sel)


def plain(hits: list[tuple[np.ndarray, list[Target]]]) -> bool:
    """Whether every hit is one plain copy into one destination (no hook, slices only)."""
    for _, t in hits:
        if len(t) != 1:
            return False
        out, out_sel, in_sel, drop, hook = t[0]
        if out is None or hook is not None or drop or not all_slices(out_sel) or not all_slices(in_sel):
            return False
    return True


def put_hits(hits: list[tuple[np.ndarray, list[Target]]]) -> None:
    """Put cached chunks in place (one copy per target)."""
    for chunk, t in hits:
        if len(t) == 1:
            out, out_sel, in_sel, drop, hook = t[0]
            if out is not None and hook is None and not drop and all_slices(out_sel) and all_slices(in_sel):
                out[tuple(out_sel)] = chunk[tuple(in_sel)]  # the common case: one plain copy
                continue
        put_all(chunk, t)


class TurnBatch:
    """Calls for the decode threads, gathered over one turn of the I/O loop and run by one job per
    thread, instead of one executor hand-off per call. Every hand-off wakes another thread, and its
    end wakes the loop: a futex call each, and in a virtual machine an interrupt to another CPU; for
    chunks of a few kB that cost more than decoding them. The jobs take the calls from one queue
    (work stealing), not in fixed shares: calls of uneven cost (a 3.4 MB chunk of 13 levels beside a
    0.26 MB surface field) leave no thread idle while another still has some to run. ``run`` is
    awaited like ``loop.run_in_executor``: the call's result, or its exception."""

    def __init__(self, threads: int):
        self.threads = threads
        self._turn = _loop.OneTurn(self._flush)

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._turn.add((fn, args, fut))
        return fut

    def _flush(self, calls: list[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future]]) -> None:
        loop = asyncio.get_running_loop()
        futs = [fut for *_, fut in calls]
        todo = deque((i, fn, args) for i, (fn, args, _) in enumerate(calls))  # taken by every job
        for _ in range(max(1, min(len(calls), self.threads))):
            ran: list[list[Any]] = []  # [call, ok, result or exception], one per call this job took
            try:
                job = loop.run_in_executor(None, _run_calls, todo, ran)
            except BaseException as e:  # (a pool shut down at exit): the calls no job took fail with it
                job = loop.create_future()
                job.set_exception(e)
            job.add_done_callback(functools.partial(_settle, futs, todo, ran))


def _run_calls(todo: deque[tuple[int, Callable[..., Any], tuple[Any, ...]]], ran: list[list[Any]]) -> None:
    """One job of a ``TurnBatch``: calls taken from ``todo`` until none is left, each one's outcome
    in ``ran``; one that fails does not keep the others from running."""
    while True:
        try:
            i, fn, args = todo.popleft()  # atomic: each call is taken by one job
        except IndexError:
            return
        rec: list[Any] = [i, False, None]
        ran.append(rec)
        try:
            rec[2] = fn(*args)
            rec[1] = True
        except Exception as e:  # noqa: BLE001 - handed to the call's awaiter
            rec[2] = e


def _settle(futs: list[asyncio.Future], todo: deque[Any], ran: list[list[Any]], job: asyncio.Future) -> None:
    """Hand each call a ``TurnBatch`` job took its result or exception, once the job ended. A job
    that never ran (cancelled, or the pool refused it) or died fails the calls no job took, and the
    one it died in: nothing waits forever."""
    err = None if job.cancelled() else job.exception()
    for i, ok, val in ran:
        fut = futs[i]
        if fut.done():  # its awaiter was cancelled
            continue
        if ok:
            fut.set_result(val)
        elif val is not None:
            fut.set_exception(val)
        elif err is not None:  # the job died in this call
            fut.set_exception(err)
        else:
            fut.cancel()
    if job.cancelled() or err is not None:
        while True:
            try:
                i, *_ = todo.popleft()
            except IndexError:
                return
            if futs[i].done():
                continue
            if err is None:
                futs[i].cancel()
            else:
                futs[i].set_exception(err)
