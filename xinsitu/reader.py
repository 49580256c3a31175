"""Asynchronous chunk reads: objects fetched through obstore (or a zarr store's own
``get``), a bounded number in flight, decoded in threads, copied into place.

A region is a range of positions along some dims of a variable (its other dims whole);
reading it fetches each chunk it touches exactly once. A read may also hand each chunk's
piece of the region to a callback in the decode thread, while the piece is still in
cache, with or without putting it in place (``read_many``). Where each slot of a buffer is
one whole chunk, chunks are decoded straight into their slots (``read_whole``): local files in
one job per decode thread, obstore's objects by callbacks with no task per chunk
(``_WholeFetches``).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn, TypeVar

import numpy as np

from xinsitu import _loop
from xinsitu.backend import DamagedObjectError, ReadScratch, backend_for, deadlines_here, fetch_decoded, refetched
from xinsitu.cache import ChunkCache, ChunkKey
from xinsitu.codecs import ChunkDecoder, ShardLayout, is_remote, is_sharded, store_root
from xinsitu.geometry import run_start
from xinsitu.source import VarSource

T = TypeVar("T")

INDEX_CACHE = 4096  # shard indexes kept (each a few bytes per inner chunk)
#: ``max_inflight=None``: bounds of the requests in flight (see ``InflightLimit``)
AUTO_INFLIGHT = (64, 256)
#: ... to this many times what keeps the decode threads busy while each request waits
AUTO_HEADROOM = 2.0
#: stores across a network: bounds of the throughput-driven limit (it starts at the bottom)
AUTO_REMOTE = (4, 256)
#: ... completions per window at least (a window is also at least half the limit)
AUTO_WINDOW = 4
#: ... a window's mean latency past this many times the quickest window's: the store queues
AUTO_INFLATED = 3.0
#: ... and within this many times it: no queueing (grow the limit)
AUTO_HEALTHY = 1.6
#: ... a window's completions per second past this many times the most seen before: more
#: requests bought throughput (grow the limit, whatever the latency; its limit becomes the best)
AUTO_BETTER = 1.15
#: ... that many windows in a row that bought no throughput and saw the latency rise: the
#: requests past the limit that gave the most only queue (go back to it)
AUTO_STRIKES = 2
#: ... a window whose slowest answer came within this many times its quickest (no request
#: queued behind another) while the latency stays healthy: slow start quadruples, not doubles
AUTO_FLAT = 1.5
#: ... seconds between probes past the limit at which the store last queued (each probe of an
#: overloaded store can cost a SYN retransmit, ~1 s)
AUTO_PROBE_S = 5.0
_EMPTY = 2**64 - 1  # shard index entry of an inner chunk never written

#: called with (values, out_sel): a chunk's values within a region and where they lie in it
PieceHook = Callable[[np.ndarray, list], None]
#: where one chunk goes: (destination or None, out selection, in-chunk selection, scalar-dim drops, hook or None)


class Target(NamedTuple):
    """Where one chunk goes."""

    out: np.ndarray | None  # destination (None: hooks only)
    out_sel: list  # where the piece lies in the destination
    in_sel: list  # the piece within the chunk (after ``drop``)
    drop: list  # scalar-dim selections applied first ([] where none)
    hook: PieceHook | None


#: a region's shape and its pieces: [(chunk coords, out selection, in-chunk selection, drop)]
_RegionPlan = tuple[tuple[int, ...], list[tuple[tuple[int, ...], list, list, list]]]
REGION_PLANS = 1 << 17  # region plans kept per reader (a few hundred bytes each)
#: cache hits of one read copied in place on the I/O loop up to this many bytes (more: in a decode thread)
INLINE_COPY_BYTES = 1 << 20


class ChunkReadError(OSError):
    """A chunk could not be read or decoded; names the variable, the chunk and the store key."""

    def __init__(self, var: str, chunk: tuple[int, ...], key: str, cause: BaseException):
        self.var, self.chunk, self.key = var, chunk, key
        super().__init__(f"cannot read chunk {chunk} of variable {var!r} (key {key!r}): "
                         f"{type(cause).__name__}: {cause}")


@dataclass
class IOCounters:
    """What the reads of one epoch cost."""

    chunks: int = 0
    requests: int = 0
    bytes_read: int = 0
    bytes_decoded: int = 0
    decode_s: float = 0.0
    missing: int = 0  # chunks with no object in the store, read as the fill value
    cache_hits: int = 0  # chunks the cache had (memory or disk): not fetched, not decoded
    cache_disk_hits: int = 0  # ... of which its disk tier had
    cache_misses: int = 0  # chunks of cached arrays it did not have (fetched, then kept)


# ----------------------------------------------------------------------------- selection
def _range_plan(start: int, stop: int, chunk: int) -> list[tuple[int, Any, Any]]:
    """``_axis_plan`` of the positions ``start, start + 1, ..., stop - 1``, in integer arithmetic."""
    out = []
    for c in range(start // chunk, (stop - 1) // chunk + 1):
        a, b = max(start, c * chunk), min(stop, (c + 1) * chunk)
        out.append((c, slice(a - start, b - start), slice(a - c * chunk, b - c * chunk)))
    return out


def _axis_plan(pos: np.ndarray, chunk: int) -> list[tuple[int, Any, Any]]:
    """For one axis: [(chunk id, out selection, in-chunk selection)], slices where contiguous."""
    cid = pos // chunk
    out: list[tuple[int, Any, Any]] = []
    brk = np.flatnonzero(np.diff(cid)) + 1
    for a, b in zip(np.concatenate([[0], brk]), np.concatenate([brk, [len(pos)]]), strict=True):
        c = int(cid[a])
        local = pos[a:b] - c * chunk
        if np.all(np.diff(local) == 1):
            out.append((c, slice(int(a), int(b)), slice(int(local[0]), int(local[-1]) + 1)))
        else:
            out.append((c, np.arange(a, b), local))
    # a chunk met twice (unsorted positions) is read once per run; merge runs of the same chunk
    merged: dict[int, tuple[list, list]] = {}
    for c, o, i in out:
        merged.setdefault(c, ([], []))
        merged[c][0].append(np.arange(o.start, o.stop) if isinstance(o, slice) else o)
        merged[c][1].append(np.arange(i.start, i.stop) if isinstance(i, slice) else i)
    if len(merged) == len(out):
        return out
    return [(c, np.concatenate(o), np.concatenate(i)) for c, (o, i) in merged.items()]


def _assign(out: np.ndarray, out_sel: list[Any], chunk: np.ndarray, in_sel: list[Any], drop: list[Any]) -> None:
    """out[out_sel] = chunk[drop][in_sel], orthogonally (arrays on several axes don't broadcast)."""
    piece = _piece(chunk, in_sel, drop)
    if all(isinstance(s, slice) for s in out_sel):
        out[tuple(out_sel)] = piece
    else:
        out[np.ix_(*[np.arange(s.start, s.stop) if isinstance(s, slice) else s for s in out_sel])] = piece


class InflightLimit:
    """How many chunk requests may be in flight at once (``async with limit:`` around each).

    A number fixes it. ``None`` adapts it. Enough requests must be in flight to keep ``threads``
    decode threads busy while every request waits ``latency`` (Little's law: about
    ``threads x latency / decode time per chunk``; ``AUTO_HEADROOM`` times that, between the
    bounds of ``AUTO_INFLIGHT``): local disks sit at the bottom (more requests only slow the
    first batch).

    A store across a network (``expect_remote``) may be overloaded, where more requests only
    queue up, or far, where only many requests at once fill the decode threads; and the client's
    own cores (decoding, gathering -- on a small machine also the server's) inflate the latency
    it measures as they saturate, so latency alone takes a busy client for a store that queues.
    The limit follows what each window of completed requests (those sent since the limit last
    changed, at least ``AUTO_WINDOW``, at least half the limit) bought: it starts at
    ``AUTO_REMOTE[0]`` and, in slow start, doubles per window -- quadruples while the answers
    come back equally quick (the slowest within ``AUTO_FLAT`` times the quickest: none waited
    behind another) and the latency stays near the quickest window's (``AUTO_HEALTHY``) -- as
    long as the latency stays near it or the completions per second grew past ``AUTO_BETTER``
    times the most seen (more requests, more throughput, whatever the latency). Past that it
    grows by an eighth per window on the same test (additive increase). A window that bought no
    throughput and saw the latency rise, at a limit past the one that gave the most completions
    per second, goes back to that limit: a store that only queues gains nothing from more
    requests, so it stays at the bottom, and a busy client keeps what it gained. A request that
    fails or times out halves the limit, never below half that best limit nor below
    ``AUTO_REMOTE[0]``. So it is never much slower than a fixed small limit on a store that
    queues, reaches the top for a far, healthy one, and sits near the knee of the throughput
    curve where the client's cores are the bound. Little's law bounds it from above.
    """

    def __init__(self, fixed: int | None, threads: int):
        self.fixed = fixed
        self.limit = fixed if fixed is not None else AUTO_INFLIGHT[0]
        self.threads = threads
        self.latency_s: float | None = None
        self.decode_s: float | None = None
        self.remote = False  # the limit follows a far store's throughput (``expect_remote``, auto only)
        self.far = False  # the store is across a network (whatever the limit)
        self.history: list[tuple[int, float]] = []  # (limit, mean latency) at each window's end (remote)
        self.clock: Callable[[], float] = time.perf_counter  # (a test drives it with simulated time)
        self._base: float | None = None  # quickest window's mean latency (remote)
        self._slow_start = True
        self._best_rate = 0.0  # most completions per second of a window so far (remote)
        self._best_limit = AUTO_REMOTE[0]  # ... and the limit it had
        self._last_rate = math.inf  # the last window's
        self._strikes = 0  # windows in a row that bought nothing and saw the latency rise
        self._trouble = 0  # the limit at which the store last queued or failed (0: never)
        self._probed = 0.0  # when growth last went to or past it
        self._since = 0.0  # when the limit last changed: requests sent before do not count
        self._settled: float | None = 0.0  # ... nor those sent before its first answer came
        self._n = 0  # answers in this window (to requests sent since the limit last changed)
        self._sum = 0.0  # their latencies
        self._lo = math.inf  # ... the quickest
        self._hi = 0.0  # ... and the slowest
        self._waiting: dict[Any, float] = {}  # task -> when its request went out, until its bytes came
        self._sent: dict[Any, float] = {}  # task -> when it took its slot, until it gives it back
        self._sem: asyncio.Semaphore | None = None
        self._owed = 0  # permits to keep back as requests end (the limit shrank)

    def semaphore(self) -> asyncio.Semaphore:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.limit)
        return self._sem

    async def __aenter__(self) -> None:
        await self.take(asyncio.current_task())

    async def take(self, slot: Any) -> None:
        """Wait for a free slot, held under ``slot`` (any hashable: a task, a request's number) until
        ``give(slot)``; ``async with limit:`` holds one under the current task."""
        await self.semaphore().acquire()
        self._waiting[slot] = self._sent[slot] = self.clock()

    def arrived(self, slot: Any = None) -> None:
        """The request of ``slot`` (default: the current task's) has its bytes (what it waits for next
        is not the store)."""
        self._waiting.pop(asyncio.current_task() if slot is None else slot, None)

    async def __aexit__(self, *exc: Any) -> None:
        self.give(asyncio.current_task())

    def give(self, slot: Any) -> None:
        """Give back the slot held under ``slot``."""
        self._waiting.pop(slot, None)
        self._sent.pop(slot, None)
        if self._owed:
            self._owed -= 1
        else:
            self.semaphore().release()

    def expect_remote(self) -> None:
        """The store is across a network: its limit follows throughput and latency (see the class)."""
        self.far = True
        if self.fixed is None and not self.remote:
            self.remote = True
            self._resize(AUTO_REMOTE[0])

    def _cap(self) -> int:
        """Little's law: requests that keep the decode threads busy, within ``AUTO_INFLIGHT``."""
        if self.latency_s is None or self.decode_s is None:
            return AUTO_INFLIGHT[1]
        want = AUTO_HEADROOM * self.threads * self.latency_s / max(self.decode_s, 1e-6)
        return max(AUTO_INFLIGHT[0], min(AUTO_INFLIGHT[1], math.ceil(want)))

    def _sent_at(self, latency_s: float, decode_s: float, now: float, slot: Any) -> float:
        """When the request of ``slot`` (None: the current task's) went out (unknown: ``now`` less its
        latency and decode)."""
        if slot is None:
            try:
                slot = asyncio.current_task()
            except RuntimeError:  # no running loop
                slot = None
        sent = self._sent.get(slot) if slot is not None else None
        return now - latency_s - decode_s if sent is None else sent

    def observe(self, latency_s: float, decode_s: float, slot: Any = None) -> None:
        """One request's wait for its bytes and its decode time (on the I/O loop); ``slot`` as in ``take``
        (default: the current task's)."""
        if self.fixed is not None:
            return
        self.latency_s = latency_s if self.latency_s is None else 0.9 * self.latency_s + 0.1 * latency_s
        self.decode_s = decode_s if self.decode_s is None else 0.9 * self.decode_s + 0.1 * decode_s
        if not self.remote:
            target = self._cap()
            if target > self.limit or target < 0.75 * self.limit:  # shrink only on a clear change
                self._resize(target)
            return
        now = self.clock()
        sent = self._sent_at(latency_s, decode_s, now, slot)
        if sent < self._since:  # sent under the limit before: its latency is not this limit's
            return
        # answers equally quick (a burst sent at once, none queued behind another) or not
        self._lo, self._hi = min(self._lo, latency_s), max(self._hi, latency_s)
        if self._settled is None:  # the first answer sent under this limit: the queues it meets
            self._settled = now  # are this limit's from now on (those before still ramp up)
        if sent < self._settled:
            return
        self._n += 1
        self._sum += latency_s
        if self._n < max(AUTO_WINDOW, self.limit // 2):
            return
        # a window's requests that are still waiting count too: the ones a store queues (or a
        # dropped connection delays) come back last, after quicker ones have filled the window
        oldest = now - min(self._waiting.values()) if self._waiting else 0.0
        mean = max(self._sum / self._n, oldest)
        self._window(now, mean, max(self._hi, oldest) <= AUTO_FLAT * self._lo)

    def _window(self, now: float, mean: float, flat: bool) -> None:
        """A window's end: grow, hold, or go back (see the class)."""
        self._n, self._sum, self._lo, self._hi = 0, 0.0, math.inf, 0.0
        self.history.append((self.limit, mean))
        base = self._base = mean if self._base is None else min(self._base, mean)
        # completions per second by Little's law (requests in flight / latency): counted answers
        # come in bursts as the loader asks for whole buffers; a store that only queues answers
        # twice the requests twice as late
        rate = self.limit / mean
        gained = rate > AUTO_BETTER * self._best_rate  # more requests bought more throughput
        last, self._last_rate = self._last_rate, rate
        if gained:
            self._best_rate, self._best_limit = rate, self.limit
        healthy = mean <= AUTO_HEALTHY * base
        if healthy or gained:
            self._strikes = 0
            if self._slow_start:  # faster while nothing queues, or the last step doubled the rate
                grown = self.limit * (8 if healthy and flat else 4 if rate >= 2 * last else 2)
            else:
                grown = self.limit + max(1, self.limit // 8)
            if self._trouble and grown >= self._trouble:  # where the store queued before: probe rarely
                if now - self._probed < AUTO_PROBE_S:
                    grown = min(grown, max(self.limit, self._trouble - 1))
                else:
                    self._probed = now
            self._resize(max(AUTO_REMOTE[0], min(self._cap(), AUTO_REMOTE[1], grown)))
            return
        # the latency rose and throughput did not: the knee is behind (once may be this machine
        # busy for a moment -- its cores, not the store -- so twice in a row)
        self._strikes += 1
        if self._strikes < AUTO_STRIKES:
            return
        self._slow_start = False
        if self.limit > self._best_limit:  # requests past the best limit only queue: back to it
            self._trouble, self._probed = self.limit, now
            self._resize(max(AUTO_REMOTE[0], self._best_limit))
        elif self.limit < self._best_limit and mean <= AUTO_INFLATED * base:
            # below the best limit (after a failure) and no longer queueing: grow back
            self._resize(self.limit + max(1, self.limit // 8))

    def failed(self) -> None:
        """A request failed or timed out: fewer in flight (a store under load fails first)."""
        if self.fixed is None and self.remote:
            self._decrease()

    def _decrease(self) -> None:
        # never far below the limit of the best window: a burst of failures halves it once or
        # twice, not down to the bottom
        self._slow_start = False
        self._trouble, self._probed = self.limit, self.clock()
        self._resize(max(AUTO_REMOTE[0], self._best_limit // 2, self.limit // 2))

    def _resize(self, n: int) -> None:
        if n == self.limit:
            return
        grow, self.limit = n - self.limit, n
        # the next window counts only requests sent once this limit's first answer came
        self._since, self._settled = self.clock(), None
        self._n, self._sum, self._lo, self._hi = 0, 0.0, math.inf, 0.0
        if self._sem is None:
            return
        if grow < 0:
            self._owed -= grow  # taken back as requests end
            return
        paid = min(grow, self._owed)
        self._owed -= paid
        for _ in range(grow - paid):
            self._sem.release()


class Reader:
    """Reads regions of the variables of one Dataset; one per process (built lazily).

    With a ``cache`` (``xinsitu.cache.ChunkCache``), decoded chunks of stored arrays are kept
    across reads: a chunk it has is copied into place without a request or a decode (see
    ``_serve_cached``). Values and their order are the same either way.
    """

    def __init__(self, max_inflight: int | None = None, cache: ChunkCache | None = None):
        self.inflight = InflightLimit(max_inflight, _loop.decode_threads())
        self.cache = cache
        self._keys: dict[int, ChunkKey | None] = {}
        self._decoders: dict[int, ChunkDecoder] = {}
        self._layouts: dict[int, ShardLayout] = {}
        self._backends: dict[int, Any] = {}
        self.counters = IOCounters()
        self._index_cache: OrderedDict[str, np.ndarray | None] = OrderedDict()
        self._whole_plans: dict[tuple[int, int], list[tuple[int, Any, Any]]] = {}
        self._region_plans: dict[tuple[int, tuple], tuple[VarSource, _RegionPlan]] = {}
        self._ranges: dict[tuple[int, int], bool] = {}
        self._whole_axes: dict[int, tuple[VarSource, list[tuple[str, Any, int, int]] | None]] = {}
        self.on_missing = "fill"  # or "raise": a chunk with no object is an error
        #: decode-thread work asked for in one turn of the loop, sent to the threads together
        self._turn = TurnBatch(self.inflight.threads)
        self.last_missing: tuple[str, tuple[int, ...], str] | None = None  # (variable, chunk, key)
        self._starts: tuple[Any, asyncio.Lock] | None = None  # (loop, lock): see ``starting``

    def starting(self) -> asyncio.Lock:
        """Held by a ``_WholeFetches`` while it starts its requests: those of one call all go out
        before those of a call made after it, as they would queue for the in-flight limit one task
        each. (Else two calls would take turns, slot by slot, and a read ahead whose requests hang
        could hold every slot while the buffer the caller waits for has none.)"""
        loop = asyncio.get_running_loop()
        if self._starts is None or self._starts[0] is not loop:
            self._starts = (loop, asyncio.Lock())
        return self._starts[1]

    def _missing(self, src: VarSource, coords: tuple[int, ...], path: str) -> None:
        """A chunk with no object: counted and named (a deleted archive or a 404 would otherwise
        pass as fill values in silence), or an error where ``on_missing`` is ``"raise"``."""
        self.counters.missing += 1
        self.last_missing = (src.name, coords, path)
        if self.on_missing == "raise":
            raise FileNotFoundError("no object at this key (missing='raise'; zarr would read the fill value)")

    def _decoder(self, src: VarSource) -> ChunkDecoder:
        key = id(src.array)
        if key not in self._decoders:
            self._decoders[key] = ChunkDecoder(src.array)
        return self._decoders[key]

    def _store(self, src: VarSource) -> Any:
        zstore = src.array.store
        key = id(zstore)
        if key not in self._backends:
            self._backends[key] = backend_for(zstore)
            if is_remote(zstore):
                self.inflight.expect_remote()
        return self._backends[key]

    async def read(self, src: VarSource, region: dict[str, tuple[int, int]],
                   out: np.ndarray | None = None) -> np.ndarray:
        """Raw (not CF-decoded) values of ``src`` over ``region`` (other dims whole), var dim order.

        With ``out`` (any view of the right shape), chunks are decoded straight into it.
        """
        (res,) = await self.read_many(src, [(region, out)])
        assert res is not None  # no hook: the values land somewhere
        return res

    async def read_many(self, src: VarSource, jobs: list[tuple[Any, ...]]) -> list[np.ndarray | None]:
        """Read several regions of ``src``; a chunk that several regions touch is fetched and
        decoded once, then copied into each of them.

        A job is ``(region, out)`` or ``(region, out, hook)``. ``out`` is the destination (None: a
        new array). With a ``hook``, each chunk's piece of the region is also passed to
        ``hook(values, out_sel)`` (``out_sel``: where the piece lies in the region), in the decode
        thread right after decoding; with a hook and ``out=None`` the values are put nowhere
        (the job's result is None) and the chunk is decoded into a reused buffer. ``values`` is
        only valid during the call; where it is writeable (the chunk's one consumer, in the reader's
        own memory), the hook may use it as scratch space. A hook must not raise (a failure would
        read as a damaged chunk).
        """
        outs: list[np.ndarray | None] = []
        targets: dict[tuple[int, ...], list[Target]] = {}
        sharded = src.stored and is_sharded(src.array) and not self._native_shards(src)
        for job in jobs:
            region, out = job[0], job[1]
            hook = job[2] if len(job) > 2 else None
            if not src.stored or sharded:
                if out is None and hook is None:
                    out = np.empty(self._shape(src, region), dtype=src.raw_dtype)
                if src.stored:
                    values = await self._read_with_zarr(src, self._positions(src, region))
                elif isinstance(src.values, np.ndarray):
                    values = self._values(src, region)
                else:  # read through dask (files that are not Zarr): file reads and decoding, in a thread
                    async with self.inflight:
                        try:
                            values = await asyncio.get_running_loop().run_in_executor(None, self._values, src,
                                                                                      region)
                        except Exception as e:  # noqa: BLE001 - every failure names its chunk
                            raise ChunkReadError(src.name, src.chunk_at(region), getattr(src.values, "where", "?"),
                                                 e) from e
                    self.counters.requests += 1  # what io_stats shows, and how far the loader reads ahead
                    self.counters.chunks += 1
                    self.counters.bytes_decoded += values.nbytes
                if out is not None:
                    out[...] = values
                if hook is not None:  # values may be the caller's own array
                    hook(_readonly(np.asarray(values)), [slice(None)] * np.ndim(values))
                outs.append(out)
                continue
            shape, pieces = self._region_plan(src, region)
            if out is None and hook is None:
                out = np.empty(shape, dtype=src.raw_dtype)
            elif out is not None and out.shape != shape:
                raise ValueError(f"read of {src.name!r}: destination shape {out.shape} != region shape {shape}")
            outs.append(out)
            for coords, out_sel, in_sel, drop in pieces:
                got = targets.get(coords)
                if got is None:
                    targets[coords] = [Target(out, out_sel, in_sel, drop, hook)]
                else:
                    got.append(Target(out, out_sel, in_sel, drop, hook))
        if targets and is_sharded(src.array):
            await self._read_shards(src, targets)
            return outs
        if targets and self.cache is not None:
            targets = await self._serve_cached(src, targets, self._decoder(src).key)
        if not targets:
            return outs
        dec, store = self._decoder(src), self._store(src)
        if getattr(store, "fused", False) and dec.sync:  # local files: a few jobs, not one per chunk
            await self._read_local(src, dec, store, list(targets.items()))
        elif len(targets) == 1:  # one chunk (a chunk-aligned unit): no task of its own
            ((c, t),) = targets.items()
            await self._fetch_into(src, dec, store, c, t)
        else:
            await _all_or_none(self._fetch_into(src, dec, store, c, t) for c, t in targets.items())
        return outs

    async def _read_local(self, src: VarSource, dec: ChunkDecoder, store: Any, items: list[tuple[tuple[int, ...], Any]],
                          keep: tuple[ChunkCache, ChunkKey] | None = None) -> None:
        """Local chunk files read and decoded by the decode threads, each reading, decoding and putting
        in place its share in turn: per chunk no task, no executor hand-off and no wake-up of the
        loop, which for one-sample-per-chunk archives cost more than the decode itself. The reads
        asked for in one turn of the loop (every variable of a buffer) go out together, in one job per
        decode thread (``TurnBatch``)."""
        prefix = f"{src.array.path}/" if src.array.path else ""
        k = max(1, min(len(items), self.inflight.threads))
        parts = await asyncio.gather(*(self._turn.run(_read_decode_assign_many, store, prefix, dec, src.name,
                                                      items[i::k], keep) for i in range(k)))
        rows = [row for part in parts for row in part]
        counters = self.counters
        read_sum = took_sum = 0.0
        for coords, path, read_s, nbytes, took in rows:
            if nbytes is None:
                try:
                    self._missing(src, coords, path)
                except Exception as e:  # noqa: BLE001 - missing="raise": named like every failure
                    _reraise(src, coords, path, e)
            counters.bytes_read += nbytes or 0
            read_sum += read_s
            took_sum += took
            store.observe(read_s, took)
        n = len(rows)
        counters.requests += n
        counters.chunks += n
        counters.decode_s += took_sum
        counters.bytes_decoded += n * dec.nbytes
        if n:
            self.inflight.observe(read_sum / n, took_sum / n)

    def _region_plan(self, src: VarSource, region: dict[str, tuple[int, int]]) -> _RegionPlan:
        """The region's shape and the chunks it touches with where each piece goes: pure index math
        on the region alone, so planned once and kept (an epoch reads the same units in a new order,
        every epoch; one-sample-per-chunk archives pay this per chunk otherwise)."""
        key = (id(src), tuple(region.items()))  # callers name dims in one order: no sort
        got = self._region_plans.get(key)
        if got is not None and got[0] is src:  # (an id is reused once its object is gone)
            return got[1]
        pos = self._positions(src, region)
        shape = tuple(len(p) for p in pos if not isinstance(p, int))
        pieces: list[tuple[tuple[int, ...], list, list, list]] = []
        if math.prod(shape) != 0:
            plans = []
            for ax, (d, p) in enumerate(zip(src.src_dims, pos, strict=True)):
                cs = src.chunk_shape[ax]
                if isinstance(p, int):
                    plans.append([(p // cs, None, p % cs)])
                elif d in region:
                    if len(p) and self._is_range(src, ax):  # a slice of a step-1 index: integer math
                        plans.append(_range_plan(int(p[0]), int(p[-1]) + 1, cs))
                    else:
                        plans.append(_axis_plan(p, cs))
                else:  # a dim read whole: the same plan for every region, computed once
                    wk = (id(src), ax)
                    if wk not in self._whole_plans:
                        self._whole_plans[wk] = _axis_plan(p, cs)
                    plans.append(self._whole_plans[wk])
            for combo in itertools.product(*plans):
                coords = tuple(int(c) for c, _, _ in combo)
                out_sel = [o for _, o, _ in combo if o is not None]
                in_sel = [i for _, o, i in combo if o is not None]
                drop = [i if o is None else slice(None) for _, o, i in combo]
                drop = drop if any(o is None for _, o, _ in combo) else []
                pieces.append((coords, out_sel, in_sel, drop))
        if len(self._region_plans) >= REGION_PLANS:  # bounded: a new region set (e.g. another split)
            self._region_plans.clear()
        plan: _RegionPlan = (shape, pieces)
        self._region_plans[key] = (src, plan)
        return plan

    @staticmethod
    def _positions(src: VarSource, region: dict[str, tuple[int, int]]) -> list[Any]:
        """Per stored dim, the stored positions the region covers (an int for a dim selected away)."""
        return [ix if isinstance(ix, int) else (ix[slice(*region[d])] if d in region else ix)
                for d, ix in zip(src.src_dims, src.index, strict=True)]

    def _shape(self, src: VarSource, region: dict[str, tuple[int, int]]) -> tuple[int, ...]:
        if not src.stored:
            return tuple(len(range(*region[d])) if d in region else n for d, n in zip(src.dims, src.shape,
                                                                                      strict=True))
        return tuple(len(p) for p in self._positions(src, region) if not isinstance(p, int))

    @staticmethod
    def _values(src: VarSource, region: dict[str, tuple[int, int]]) -> np.ndarray:
        """A region of a variable held in memory (or by dask)."""
        sel = tuple(slice(*region[d]) if d in region else slice(None) for d in src.dims)
        assert src.values is not None  # not stored: held in memory or by dask
        return np.asarray(src.values[sel])

    def _is_range(self, src: VarSource, ax: int) -> bool:
        """Whether the positions ``src`` selects along axis ``ax`` step by one (checked once)."""
        key = (id(src), ax)
        got = self._ranges.get(key)
        if got is None:
            ix = src.index[ax]  # a view of the shared 0..n-1 index needs no pass (10^7 positions: 80 MB)
            got = self._ranges[key] = bool(len(ix) > 0 and run_start(np.asarray(ix, np.int64)) is not None)
        return got

    # ------------------------------------------------------------------ cache
    def _chunk_keys(self, src: VarSource) -> ChunkKey | None:
        """The cache keys of ``src``'s chunks, made once; None where its store has no lasting identity
        (a memory store, uncommitted Icechunk changes): such an array is read, not cached."""
        k = id(src.array)
        if k not in self._keys:
            try:
                self._keys[k] = ChunkKey.for_array(src.array)
            except Exception:  # noqa: BLE001 - an array the keys cannot describe is simply not cached
                self._keys[k] = None
        return self._keys[k]

    async def _serve_cached(self, src: VarSource, targets: dict[tuple[int, ...], list[Target]],
                            object_of: Callable[[tuple[int, ...]], str],
                            dec: ChunkDecoder | None = None) -> dict[tuple[int, ...], list[Target]]:
        """Put the chunks the cache has in place; return the others (to fetch), each tagged so that
        the decode thread hands it to the cache once decoded (``_Keep``).

        Hits take no request, no in-flight slot and no task per chunk. The memory tier is looked up
        here, on the I/O loop, all chunks of the read under one lock (its keys need no hashing and no
        ``stat``: ``ChunkKey.memory_key``); its hits are copied in place here too where they are a
        few plain copies (``INLINE_COPY_BYTES``), else in one decode-thread job. What memory lacks is
        looked up on disk in one decode-thread job (a local chunk file's disk key needs a ``stat``,
        an entry a file read), which also copies what it finds. ``object_of(coords)`` is the store
        key holding chunk ``coords`` (its shard's, for a sharded array).
        """
        keys = self._chunk_keys(src)
        if keys is None:
            return targets
        cache = self.cache
        assert cache is not None
        dec = dec or self._decoder(src)
        items = list(targets.items())
        mkeys: list[Any] = [keys.memory_key(c) for c, _ in items]
        disk = cache.disk is not None
        got = cache.peek_many(mkeys, count_misses=not disk)
        hits: list[tuple[np.ndarray, list[Target]]] = []
        missing: list[tuple[tuple[int, ...], list[Target], Any]] = []
        for (c, t), mk, arr in zip(items, mkeys, got, strict=True):
            if arr is None:
                missing.append((c, t, mk))
            else:
                hits.append((arr, t))
        loop = asyncio.get_running_loop()
        n_disk = 0
        rest: dict[tuple[int, ...], list[Target]] = {}
        if disk and missing:
            prefix = f"{src.array.path}/" if src.array.path else ""
            n_disk, misses = await loop.run_in_executor(None, _disk_lookup_take, cache, keys, prefix, object_of,
                                                        missing)
            rest = {c: _Keep(t, cache, mk, dk) for c, t, mk, dk in misses}
        else:
            rest = {c: _Keep(t, cache, mk, None) for c, t, mk in missing}
        if hits:
            if _plain(hits) and len(hits) * dec.nbytes <= INLINE_COPY_BYTES:
                _take(hits)
            else:
                await loop.run_in_executor(None, _take, hits)
        n = len(hits) + n_disk
        self.counters.cache_hits += n
        self.counters.cache_disk_hits += n_disk
        self.counters.cache_misses += len(rest)
        self.counters.chunks += n
        self.counters.bytes_decoded += n * dec.nbytes
        return rest

    def whole_chunk(self, src: VarSource, region: dict[str, tuple[int, int]]) -> tuple[int, ...] | None:
        """The grid coordinates of the one chunk ``region`` is exactly (all of it and nothing else, in
        order), else None: then the chunk can be decoded straight into, or copied whole into, a
        destination of its shape. Integer math on the selection, no region plan."""
        axes = self._whole_axes.get(id(src))
        if axes is None or axes[0] is not src:
            axes = self._whole_axes[id(src)] = (src, self._axes_of(src))
        coords = []
        for d, ix, n, cs in axes[1] or ():
            a, b = region[d] if d in region else (0, n)
            if b - a != cs or not 0 <= a < b <= n:
                return None
            p0 = int(ix[a])
            if p0 % cs:
                return None
            coords.append(p0 // cs)
        return tuple(coords) if axes[1] is not None else None

    def _axes_of(self, src: VarSource) -> list[tuple[str, Any, int, int]] | None:
        """(dim, positions, their count, chunk length) per stored dim where every dim selects a run of
        positions (``whole_chunk`` can apply), else None."""
        if not src.stored or is_sharded(src.array):
            return None
        out = []
        for ax, (d, ix) in enumerate(zip(src.src_dims, src.index, strict=True)):
            if isinstance(ix, int) or not len(ix) or not self._is_range(src, ax):
                return None
            out.append((d, ix, len(ix), src.chunk_shape[ax]))
        return out

    async def read_whole(self, src: VarSource, coords: list[tuple[int, ...]], outs: list[np.ndarray]) -> bool:
        """Read whole chunks ``coords`` straight into ``outs`` (each of the chunk's shape), with no
        region plan or target per chunk: chunk files of a local directory in one job per decode
        thread, objects of other stores each fetched and then decoded in place (``_fetch_whole``);
        chunks the memory tier should keep are kept. False (nothing read) where this path does not
        apply (a codec chain decoded on the loop, a sharded array, a disk tier): use ``read_many``."""
        dec, store = self._decoder(src), self._store(src)
        if not dec.sync or is_sharded(src.array):
            return False
        keep = None
        if self.cache is not None:
            keys = self._chunk_keys(src)
            if keys is not None:
                if self.cache.disk is not None:
                    return False
                keep = (self.cache, keys)
                self.cache.count_misses(len(coords))  # ``take_cached`` looked them up first
                self.counters.cache_misses += len(coords)
        items = list(zip(coords, outs, strict=True))
        if getattr(store, "fused", False):
            await self._read_local(src, dec, store, items, keep)
        elif hasattr(store, "start_whole"):
            await _WholeFetches(self, src, dec, store, keep).run(items)
        elif len(items) == 1:  # one chunk: no task of its own
            await self._fetch_whole(src, dec, store, *items[0], keep)
        else:
            await _all_or_none(self._fetch_whole(src, dec, store, c, out, keep) for c, out in items)
        return True

    async def _fetch_whole(self, src: VarSource, dec: ChunkDecoder, store: Any, coords: tuple[int, ...],
                           out: np.ndarray, keep: tuple[ChunkCache, ChunkKey] | None,
                           first: BaseException | None = None) -> None:
        """Fetch one whole chunk and decode it straight into ``out`` (``_fetch_into`` without targets);
        ``first``: how a first fetch made already failed (``fetch_decoded``)."""
        key = dec.key(coords)
        path = f"{src.array.path}/{key}" if src.array.path else key

        async def use(raw: Any) -> None:
            self.counters.requests += 1
            self.inflight.arrived()
            if raw is None:
                self._missing(src, coords, path)
                await self._turn.run(_fill, dec, out)
                return
            waited = time.perf_counter() - t_start
            self.counters.bytes_read += len(raw)
            took = await self._turn.run(_decode_whole, dec, raw, out, keep, coords)
            self.counters.decode_s += took
            self.inflight.observe(waited, took)

        async with self.inflight:
            t_start = time.perf_counter()
            try:
                await fetch_decoded(store, path, use, on_retry=self.inflight.failed, first=first)
            except Exception as e:  # noqa: BLE001 - every failure names its chunk
                _reraise(src, coords, path, e)
        self.counters.chunks += 1
        self.counters.bytes_decoded += dec.nbytes

    async def take_cached(self, src: VarSource, coords: list[tuple[int, ...]],
                          out: np.ndarray) -> tuple[list[int], tuple[np.ndarray, np.ndarray] | None]:
        """The whole chunks ``coords`` from the memory tier, for a buffer whose row ``i`` is chunk
        ``coords[i]`` (``out``: one chunk per row, each of the chunk's shape): ``(rows it lacks, for
        read_many; slab)``.

        The fast path of cached epochs: one lookup for all, no plan or target per chunk. Where the
        tier holds every chunk in one slab, nothing is copied: ``slab`` is ``(the slab, its row of
        each chunk)`` and the batches are gathered from it (``out`` is left as it is). Else the
        chunks it holds are copied into ``out`` (all at once where it holds all), on the I/O loop
        when small, else in a decode thread, and ``slab`` is None.
        """
        everything = list(range(len(coords)))
        keys = self._chunk_keys(src) if self.cache is not None and self.cache.memory_budget else None
        if keys is None:
            return everything, None
        places = self.cache.locate_many([keys.memory_key(c) for c in coords])  # type: ignore[union-attr]
        held = [i for i, p in enumerate(places) if p is not None]
        if not held:
            return everything, None
        dec = self._decoder(src)
        n = len(held)
        self.counters.cache_hits += n
        self.counters.chunks += n
        self.counters.bytes_decoded += n * dec.nbytes
        if n == len(coords):
            slab = places[0][0]  # type: ignore[index]
            if all(p[0] is slab for p in places):  # type: ignore[index]
                return [], (slab, np.array([p[1] for p in places], dtype=np.int64))  # type: ignore[index]
        chunks = [None if p is None else p[0][p[1]] for p in places]
        if n == len(coords) and out.flags.c_contiguous:
            flat = out.reshape((-1,) + out.shape[2:])

            def copy() -> None:
                np.concatenate(chunks, axis=0, out=flat)  # type: ignore[arg-type]
        else:
            def copy() -> None:
                for i in held:
                    out[i] = chunks[i]
        if n * dec.nbytes <= INLINE_COPY_BYTES:
            copy()
        else:
            await asyncio.get_running_loop().run_in_executor(None, copy)
        return [i for i, p in enumerate(places) if p is None], None

    # ------------------------------------------------------------------ sharded arrays
    def _native_shards(self, src: VarSource) -> bool:
        """Whether inner chunks of ``src`` can be fetched by byte range here (else zarr reads them)."""
        store = self._store(src)
        if not all(hasattr(store, n) for n in ("get_ranges", "get_range")):
            return False
        try:
            self._layout(src)
        except NotImplementedError:
            return False
        return True

    def _layout(self, src: VarSource) -> ShardLayout:
        key = id(src.array)
        if key not in self._layouts:
            self._layouts[key] = ShardLayout(src.array)
        return self._layouts[key]

    async def _read_shards(self, src: VarSource, targets: dict[tuple[int, ...], list[Target]]) -> None:
        lay = self._layout(src)
        if self.cache is not None:  # inner chunks keyed by their coordinates and their shard's file
            targets = await self._serve_cached(src, targets, lambda c: lay.shard_key(
                tuple(i // n for i, n in zip(c, lay.per_shard, strict=True))), lay.inner)
            if not targets:
                return
        by_shard: dict[tuple[int, ...], dict[tuple[int, ...], list]] = {}
        for coords, t in targets.items():
            shard = tuple(c // n for c, n in zip(coords, lay.per_shard, strict=True))
            by_shard.setdefault(shard, {})[coords] = t
        store = self._store(src)
        await _all_or_none(self._fetch_shard(src, lay, store, sh, inner) for sh, inner in by_shard.items())

    async def _shard_index(self, lay: ShardLayout, store: Any, path: str) -> np.ndarray | None:
        """The shard's index, fetched once and cached (a few bytes per inner chunk)."""
        if path in self._index_cache:
            self._index_cache.move_to_end(path)
            return self._index_cache[path]
        def fetch() -> Any:
            self.counters.requests += 1
            if lay.index_at_end:
                return store.get_suffix(path, lay.index_size)
            return store.get_range(path, 0, lay.index_size)

        async def use(raw: Any) -> np.ndarray | None:
            return None if raw is None else await lay.index(raw)

        # an index that fails its checksum (a flipped bit in transit) is fetched again
        index = await refetched(fetch, path, use, on_retry=self.inflight.failed)
        self._index_cache[path] = index
        while len(self._index_cache) > INDEX_CACHE:
            self._index_cache.popitem(last=False)
        return index

    async def _fetch_shard(self, src: VarSource, lay: ShardLayout, store: Any, shard: tuple[int, ...],
                           inner: dict[tuple[int, ...], list]) -> None:
        key = lay.shard_key(shard)
        path = f"{src.array.path}/{key}" if src.array.path else key
        dec = lay.inner
        loop = asyncio.get_running_loop()
        async with self.inflight:
            try:
                index = await self._shard_index(lay, store, path)
                want: list[list[Target]] = []
                starts: list[int] = []
                ends: list[int] = []
                for coords, t in inner.items():
                    local = tuple(c - s * n for c, s, n in zip(coords, shard, lay.per_shard, strict=True))
                    if index is None:
                        self._missing(src, coords, path)
                    off, nb = (_EMPTY, 0) if index is None else (int(index[local][0]), int(index[local][1]))
                    if off == _EMPTY:
                        await loop.run_in_executor(None, _assign_all, dec.fill(), t)
                        continue
                    want.append(t)
                    starts.append(off)
                    ends.append(off + nb)
                if want:
                    done = [0]  # inner chunks put in place: a fetch made again skips them (hooks run once)
                    t_start = time.perf_counter()
                    waited = [0.0]

                    def fetch() -> Any:
                        return store.get_ranges(path, starts[done[0]:], ends[done[0]:])  # coalesced

                    async def use(raws: Any) -> float:
                        waited[0] = time.perf_counter() - t_start
                        self.inflight.arrived()
                        self.counters.requests += 1
                        self.counters.bytes_read += sum(len(r) for r in raws)
                        rest = want[done[0]:]
                        if dec.sync:
                            return await loop.run_in_executor(None, _decode_assign_many, dec, raws, rest, done)
                        t0 = time.perf_counter()
                        for raw, t in zip(raws, rest, strict=True):
                            _assign_all(await dec.decode(raw), t)
                            done[0] += 1
                        return time.perf_counter() - t0

                    took = await refetched(fetch, path, use, on_retry=self.inflight.failed)
                    self.counters.decode_s += took
                    self.inflight.observe(waited[0], took)
            except Exception as e:  # noqa: BLE001 - every failure names its shard
                _reraise(src, shard, path, e)
        self.counters.chunks += len(inner)
        self.counters.bytes_decoded += len(inner) * dec.nbytes

    async def _fetch_into(self, src: VarSource, dec: ChunkDecoder, store: Any, coords: tuple[int, ...],
                          targets: list[Target]) -> None:
        key = dec.key(coords)
        path = f"{src.array.path}/{key}" if src.array.path else key
        loop = asyncio.get_running_loop()

        async def use(raw: Any) -> None:
            self.counters.requests += 1
            self.inflight.arrived()
            if raw is None:
                self._missing(src, coords, path)
                await loop.run_in_executor(None, _assign_all, dec.fill(), targets)
            else:
                waited = time.perf_counter() - t_start
                self.counters.bytes_read += len(raw)
                if dec.sync:  # timed inside the thread: waiting for a free thread is not decoding
                    took = await self._turn.run(_decode_assign, dec, raw, targets)
                else:
                    t0 = time.perf_counter()
                    _assign_all(await dec.decode(raw), targets)
                    took = time.perf_counter() - t0
                self.counters.decode_s += took
                self.inflight.observe(waited, took)

        async with self.inflight:
            t_start = time.perf_counter()
            try:
                # fetched again when the bytes fail to decode or no answer comes in time (local files
                # that read in the decode threads go through ``_read_local`` instead)
                await fetch_decoded(store, path, use, on_retry=self.inflight.failed)
            except Exception as e:  # noqa: BLE001 - every failure names its chunk
                _reraise(src, coords, path, e)
        self.counters.chunks += 1
        self.counters.bytes_decoded += dec.nbytes

    async def _read_with_zarr(self, src: VarSource, pos: list[Any]) -> np.ndarray:
        """Sharded arrays: zarr reads the inner chunks it needs (range requests into shards)."""
        path = f"{src.array.path} (sharded selection)"
        async with self.inflight:
            try:
                if store_root(src.array.store)[0] == "obstore":  # zarr would call obstore here: a hang after fork
                    _loop.refuse_after_fork(f"sharded array {src.array.path!r} (through zarr)")
                res = await src.array.async_array.get_orthogonal_selection(tuple(pos))
            except Exception as e:  # noqa: BLE001 - every failure names its array
                _reraise(src, (), path, e)
        arr = np.asarray(res.as_ndarray_like() if hasattr(res, "as_ndarray_like") else res)
        self.counters.requests += 1
        self.counters.chunks += 1
        self.counters.bytes_decoded += arr.nbytes
        return arr


class _WholeFetches:
    """The whole chunks of one ``Reader.read_whole`` call from a store that can start a request
    without awaiting it (``start_whole``: obstore's), each fetched and then decoded into its slot by
    callbacks: no task, coroutine or timer per chunk. On one-sample-per-chunk archives over HTTP
    those cost the I/O loop more than the rest of a chunk's way together (~70 of ~110 µs).

    One coroutine (``run``) takes a slot of the in-flight limit for each chunk in turn and starts
    its request; the request's end hands the bytes to the decode threads (``TurnBatch``), the
    decode's end gives the slot back. Each request is bounded in time by the loop's ``Deadlines``.
    Anything but bytes that decode -- an error, no answer in time, bytes that fail to decode --
    sends the chunk the long way (``Reader._fetch_whole``: fetched again, bounded, its failure
    named) in a task of its own, counting the fetch made here; an error obstore gave after its own
    retries is raised as the long way would (``whole_error``). The first failure ends the call:
    its other requests are cancelled, and so are they where the call is cancelled.
    """

    def __init__(self, reader: Reader, src: VarSource, dec: ChunkDecoder, store: Any,
                 keep: tuple[ChunkCache, ChunkKey] | None):
        self.reader, self.src, self.dec, self.store, self.keep = reader, src, dec, store, keep
        self.prefix = f"{src.array.path}/" if src.array.path else ""
        self.loop = asyncio.get_running_loop()
        self.deadlines = deadlines_here()
        self.limit_s = _loop.request_timeout()
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.left = 0
        self.pending: set[asyncio.Future] = set()  # requests and decodes under way, and long ways

    async def run(self, items: list[tuple[tuple[int, ...], np.ndarray]]) -> None:
        inflight, start = self.reader.inflight, self.store.start_whole
        self.left = len(items)
        try:
            async with self.reader.starting():
                for i, (coords, out) in enumerate(items):
                    slot = (self, i)
                    await inflight.take(slot)
                    if self.done.done():  # failed: start nothing more
                        inflight.give(slot)
                        break
                    path = self.prefix + self.dec.key(coords)
                    try:
                        fut = await start(path)
                    except BaseException:
                        inflight.give(slot)
                        raise
                    if fut is None:  # this store takes the long way (it ignores ranges)
                        inflight.give(slot)
                        self._long(coords, out, None)
                        continue
                    self.pending.add(fut)
                    w = self.deadlines.watch(fut, self.limit_s)
                    fut.add_done_callback(functools.partial(self._arrived, coords, out, path, slot, w,
                                                            time.perf_counter()))
            if self.left:
                await self.done
        except BaseException:
            if not self.done.done():
                self.done.cancel()  # what ends from now on only gives its slot back
            elif not self.done.cancelled():
                self.done.exception()  # (seen: raised here, or the cancellation's instead)
            for f in list(self.pending):
                f.cancel()
            raise

    def _arrived(self, coords: tuple[int, ...], out: np.ndarray, path: str, slot: Any, w: Any, t0: float,
                 fut: asyncio.Future) -> None:
        self.pending.discard(fut)
        self.deadlines.unwatch(w)
        reader, inflight = self.reader, self.reader.inflight
        # (an error is always looked at: one never retrieved is logged, unscrubbed, by asyncio)
        err = None if fut.cancelled() else fut.exception()
        if self.done.done():
            inflight.give(slot)
            return
        if fut.cancelled():  # (else the call was cancelled, and ``done`` with it)
            inflight.give(slot)
            self._long(coords, out, TimeoutError("no answer in time"))
            return
        if err is not None and not isinstance(err, FileNotFoundError):
            inflight.give(slot)
            raised = self.store.whole_error(err)
            if raised is None:  # a range refused: fetched without one there
                self._long(coords, out, None)
            else:  # (obstore retried what was transient)
                self._fail(ChunkReadError(self.src.name, coords, path, raised))
            return
        reader.counters.requests += 1
        inflight.arrived(slot)
        job: asyncio.Future[Any]
        if err is not None:  # no object: the fill value
            try:
                reader._missing(self.src, coords, path)
            except Exception as e:  # noqa: BLE001 - missing="raise": named like every failure
                inflight.give(slot)
                self._fail(ChunkReadError(self.src.name, coords, path, e))
                return
            job = reader._turn.run(_fill, self.dec, out)
            waited = None
        else:
            raw = fut.result()
            waited = time.perf_counter() - t0
            reader.counters.bytes_read += len(raw)
            job = reader._turn.run(_decode_whole, self.dec, raw, out, self.keep, coords)
        self.pending.add(job)
        job.add_done_callback(functools.partial(self._decoded, coords, out, path, slot, waited))

    def _decoded(self, coords: tuple[int, ...], out: np.ndarray, path: str, slot: Any, waited: float | None,
                 job: asyncio.Future) -> None:
        self.pending.discard(job)
        reader, inflight = self.reader, self.reader.inflight
        err = None if job.cancelled() else job.exception()
        if self.done.done() or job.cancelled():
            inflight.give(slot)
            return
        if err is not None:
            inflight.give(slot)
            if waited is None:  # filling failed: nothing to fetch again
                self._fail(ChunkReadError(self.src.name, coords, path, err))
            else:
                self._long(coords, out, err)  # fetched again there, this fetch counted
            return
        if waited is not None:
            took = job.result()
            reader.counters.decode_s += took
            inflight.observe(waited, took, slot)
        inflight.give(slot)
        reader.counters.chunks += 1
        reader.counters.bytes_decoded += self.dec.nbytes
        self._one_done()

    def _long(self, coords: tuple[int, ...], out: np.ndarray, first: BaseException | None) -> None:
        """The long way for one chunk (``Reader._fetch_whole``), in a task of its own."""
        task = asyncio.ensure_future(self.reader._fetch_whole(self.src, self.dec, self.store, coords, out,
                                                              self.keep, first))
        self.pending.add(task)
        task.add_done_callback(self._long_ended)

    def _long_ended(self, task: asyncio.Future) -> None:
        self.pending.discard(task)
        err = None if task.cancelled() else task.exception()
        if task.cancelled() or self.done.done():
            return
        if err is not None:
            self._fail(err)
        else:
            self._one_done()

    def _one_done(self) -> None:
        self.left -= 1
        if not self.left and not self.done.done():
            self.done.set_result(None)

    def _fail(self, err: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(err)


async def _all_or_none(coros: Any) -> None:
    """Run ``coros`` concurrently; where one fails, cancel the others before raising its error.

    Not a bare ``gather``: its other reads would run on (retrying, holding permits of the in-flight
    limit) after the caller has given up, and delay the reads that come next.
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


def _reraise(src: VarSource, coords: tuple[int, ...], path: str, e: Exception) -> NoReturn:
    """Raise for a failed read: the fork hint as it is, anything else as an error naming the chunk."""
    if isinstance(e, _loop.ForkError):
        raise e
    raise ChunkReadError(src.name, coords, path, e) from e


def _piece(chunk: np.ndarray, in_sel: list[Any], drop: list[Any]) -> np.ndarray:
    """chunk[drop][in_sel], orthogonally: the values a target takes from the chunk."""
    if drop:
        chunk = chunk[tuple(drop)]
    if all(isinstance(s, slice) for s in in_sel):
        return chunk[tuple(in_sel)]
    return chunk[np.ix_(*[np.arange(s.start, s.stop) if isinstance(s, slice) else s for s in in_sel])]


def _readonly(a: np.ndarray) -> np.ndarray:
    """A view of ``a`` that cannot be written through (values a hook must leave alone)."""
    v = a.view()
    v.flags.writeable = False
    return v


def _assign_all(chunk: np.ndarray, targets: list[Target]) -> None:
    """Put a decoded chunk (the reader's own array) in place and call the hooks; a hook may write to
    its values only where it is the chunk's one consumer."""
    for out, out_sel, in_sel, drop, hook in targets:
        if out is not None:
            _assign(out, out_sel, chunk, in_sel, drop)
        if hook is not None:
            piece = _piece(chunk, in_sel, drop)
            hook(piece if len(targets) == 1 else _readonly(piece), out_sel)


def _decode_assign_many(dec: ChunkDecoder, raws: list[Any], targets: list[list[Target]], done: list[int]) -> float:
    """Decode and put in place inner chunks in turn, counting in ``done[0]`` those finished."""
    t0 = time.perf_counter()
    for raw, t in zip(raws, targets, strict=True):
        _decode_put(dec, raw, t)
        done[0] += 1
    return time.perf_counter() - t0


def _whole(dec: ChunkDecoder, targets: list[Target]) -> np.ndarray | None:
    """The destination view when the chunk lands whole, in one place (no copy needed), else None."""
    if len(targets) != 1:
        return None
    out, out_sel, in_sel, drop, _ = targets[0]
    if out is None or drop or len(in_sel) != len(dec.shape) \
            or not all(isinstance(s, slice) for s in out_sel + in_sel):
        return None
    if any((s.start or 0) != 0 or s.stop != n for s, n in zip(in_sel, dec.shape, strict=True)):
        return None
    return out[tuple(out_sel)]


_scratch = threading.local()


def _scratch_chunk(dec: ChunkDecoder) -> np.ndarray:
    """This thread's reused array of the chunk's shape and dtype (for chunks put nowhere)."""
    bufs = getattr(_scratch, "chunks", None)
    if bufs is None:
        bufs = _scratch.chunks = {}
    key = (dec.shape, dec.dtype)
    if key not in bufs:
        if len(bufs) >= 8:
            bufs.clear()
        bufs[key] = np.empty(dec.shape, dec.dtype)
    return bufs[key]


def _decode_put(dec: ChunkDecoder, raw: Any, targets: list[Target]) -> None:
    # a chunk the cache takes (``_Keep``) goes to it before any hook, which may use a buffer as scratch
    keep = targets.keep if isinstance(targets, _Keep) else None
    view = _whole(dec, targets)
    if view is not None and dec.decode_into(raw, view):
        if keep is not None:
            keep(view)  # copied (where memory has room): the view is the caller's
        hook = targets[0].hook
        if hook is not None:
            hook(_readonly(view), targets[0].out_sel)  # the caller's array
        return
    if all(t.out is None for t in targets):  # only hooks: decode into this thread's buffer, no allocation
        buf = _scratch_chunk(dec)
        if dec.decode_into(raw, buf):
            if keep is not None:
                keep(buf)  # copied: the buffer is reused
            _assign_all(buf, targets)
            return
    chunk = dec.decode_sync(raw)
    if keep is not None:
        keep(chunk, copy=False)  # a new array: handed over (read-only from now on where it is kept)
    _assign_all(chunk, targets)


class _Keep(list):
    """A chunk's targets, and the cache keys it is kept under once decoded (see ``Reader._serve_cached``)."""

    __slots__ = ("cache", "key", "disk_key")

    def __init__(self, targets: list[Target], cache: ChunkCache, key: Any, disk_key: str | None):
        super().__init__(targets)
        self.cache, self.key, self.disk_key = cache, key, disk_key

    def keep(self, chunk: np.ndarray, copy: bool = True) -> None:
        try:
            self.cache.put(self.key, chunk, copy=copy, disk_key=self.disk_key)
        except (OSError, MemoryError):  # a chunk the cache cannot keep is still read: never a failed read
            pass


def _disk_lookup_take(cache: ChunkCache, keys: ChunkKey, prefix: str, object_of: Callable[[tuple[int, ...]], str],
                      missing: list[tuple[tuple[int, ...], list[Target], Any]]) -> tuple[int, list[Any]]:
    """Look up on disk the chunks memory lacks and put those found in place (a decode-thread job: keys
    of local chunk files ``stat`` them, entries are files): (disk hits, misses as (coords, targets,
    memory key, disk key))."""
    found, misses = [], []
    dks = cache.disk_keys(keys, [(coords, prefix + object_of(coords)) for coords, _, _ in missing])
    for (coords, t, mk), dk in zip(missing, dks, strict=True):
        got = cache.get(mk, disk_key=dk)
        if got is None:
            misses.append((coords, t, mk, dk))
        else:
            found.append((got, t))
    _take(found)
    return len(found), misses


def _plain(hits: list[tuple[np.ndarray, list[Target]]]) -> bool:
    """Whether every hit is one plain copy into one destination (no hook, slices only)."""
    for _, t in hits:
        if len(t) != 1:
            return False
        out, out_sel, in_sel, drop, hook = t[0]
        if out is None or hook is not None or drop or not _all_slices(out_sel) or not _all_slices(in_sel):
            return False
    return True


def _take(hits: list[tuple[np.ndarray, list[Target]]]) -> None:
    """Put cached chunks in place (one copy per target)."""
    for chunk, t in hits:
        if len(t) == 1:
            out, out_sel, in_sel, drop, hook = t[0]
            if out is not None and hook is None and not drop and _all_slices(out_sel) and _all_slices(in_sel):
                out[tuple(out_sel)] = chunk[tuple(in_sel)]  # the common case: one plain copy
                continue
        _assign_all(chunk, t)


def _all_slices(sel: list[Any]) -> bool:
    for s in sel:
        if not isinstance(s, slice):
            return False
    return True


#: the decode threads' read buffers: a chunk's bytes are decoded, and copied where they are kept,
#: before the thread reads its next one
_SCRATCH = ReadScratch()


def _read_decode_assign(store: Any, path: str, dec: ChunkDecoder,
                        targets: list[Target] | np.ndarray) -> tuple[float, int | None, float]:
    """Read a local file (``LocalBackend``), decode it and put it in place, in one decode-thread job:
    (seconds reading, bytes read or None where there is no file, seconds decoding). ``targets`` may
    be an array of the chunk's shape instead: the chunk is decoded straight into it."""
    t0 = time.perf_counter()
    raw = store.read(path, _SCRATCH)
    t1 = time.perf_counter()
    if raw is None:
        if isinstance(targets, np.ndarray):
            _fill(dec, targets)
        else:
            _assign_all(dec.fill(), targets)
        return t1 - t0, None, time.perf_counter() - t1
    try:
        if isinstance(targets, np.ndarray):
            _decode_into(dec, raw, targets)
        else:
            _decode_put(dec, raw, targets)
    except Exception as e:  # noqa: BLE001 - a file reads the same bytes again: no second try
        raise DamagedObjectError(f"object {path!r} failed to decode (corrupt in the store?): "
                                 f"{type(e).__name__}: {e}") from e
    return t1 - t0, len(raw), time.perf_counter() - t1


def _read_decode_assign_many(store: Any, prefix: str, dec: ChunkDecoder, name: str,
                             share: list[tuple[tuple[int, ...], Any]],
                             keep: tuple[ChunkCache, ChunkKey] | None = None) -> list[tuple[Any, ...]]:
    """``_read_decode_assign`` for several chunks in turn: (coords, key, seconds reading, bytes or None,
    seconds decoding) per chunk; a chunk that fails raises ``ChunkReadError`` naming it. With ``keep``
    (a cache and the array's ``ChunkKey``; chunks decoded into arrays of their own), each chunk
    read is kept (chunks of targets are kept by them: ``_Keep``)."""
    out = []
    for coords, targets in share:
        path = prefix + dec.key(coords)
        try:
            read_s, nbytes, took = _read_decode_assign(store, path, dec, targets)
        except Exception as e:  # noqa: BLE001 - every failure names its chunk
            raise ChunkReadError(name, coords, path, e) from e
        if keep is not None and nbytes is not None:  # a chunk with no object is not cached
            _keep_whole(keep, coords, targets)
        out.append((coords, path, read_s, nbytes, took))
    return out


class TurnBatch:
    """Calls for the decode threads, gathered over one turn of the I/O loop and sent as one job per
    thread (each runs its calls in turn), instead of one executor hand-off per call. Every hand-off
    wakes another thread, and its end wakes the loop: a futex call each, and in a virtual machine an
    interrupt to another CPU; for chunks of a few kB that cost more than decoding them. ``run`` is
    awaited like ``loop.run_in_executor``: the call's result, or its exception."""

    def __init__(self, threads: int):
        self.threads = threads
        self._calls: list[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future]] | None = None

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        if self._calls is None:
            self._calls = []
            loop.call_soon(self._flush, loop)
        self._calls.append((fn, args, fut))
        return fut

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        calls, self._calls = self._calls or [], None
        k = max(1, min(len(calls), self.threads))
        for i in range(k):
            share = calls[i::k]
            try:
                job = loop.run_in_executor(None, _run_calls, [(fn, args) for fn, args, _ in share])
            except BaseException as e:  # (a pool shut down at exit): these calls fail with it
                job = loop.create_future()
                job.set_exception(e)
            job.add_done_callback(functools.partial(_settle, [fut for *_, fut in share]))


def _run_calls(calls: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> list[tuple[bool, Any]]:
    """One decode thread's job of a ``TurnBatch``: each call's (ok, result or exception); one that
    fails does not keep the others from running."""
    out: list[tuple[bool, Any]] = []
    for fn, args in calls:
        try:
            out.append((True, fn(*args)))
        except Exception as e:  # noqa: BLE001 - handed to the call's awaiter
            out.append((False, e))
    return out


def _settle(futs: list[asyncio.Future], job: asyncio.Future) -> None:
    """Hand each call of a ``TurnBatch`` job its result or exception, once the job ended."""
    if job.cancelled():
        for fut in futs:
            fut.cancel()
        return
    err = job.exception()
    results: list[tuple[bool, Any]] = [(False, err)] * len(futs) if err is not None else job.result()
    for fut, (ok, val) in zip(futs, results, strict=True):
        if fut.done():  # its awaiter was cancelled
            continue
        if ok:
            fut.set_result(val)
        else:
            fut.set_exception(val)


def _decode_whole(dec: ChunkDecoder, raw: Any, out: np.ndarray, keep: tuple[ChunkCache, ChunkKey] | None,
                  coords: tuple[int, ...]) -> float:
    """Decode a whole chunk straight into ``out`` and keep it where the memory tier should; returns
    the seconds spent (measured in the decode thread)."""
    t0 = time.perf_counter()
    _decode_into(dec, raw, out)
    if keep is not None:
        _keep_whole(keep, coords, out)
    return time.perf_counter() - t0


def _decode_into(dec: ChunkDecoder, raw: Any, out: np.ndarray) -> None:
    """Decode a whole chunk into ``out``, in place where the codec chain can."""
    if not dec.decode_into(raw, out):
        out[...] = dec.decode_sync(raw)


def _keep_whole(keep: tuple[ChunkCache, ChunkKey], coords: tuple[int, ...], chunk: np.ndarray) -> None:
    """Hand a whole chunk, decoded into the caller's array, to the memory tier (it copies it)."""
    try:
        keep[0].put(keep[1].memory_key(coords), chunk)
    except (OSError, MemoryError):  # a chunk the cache cannot keep is still read
        pass


def _fill(dec: ChunkDecoder, out: np.ndarray) -> None:
    out[...] = dec.fill()


def _decode_assign(dec: ChunkDecoder, raw: Any, targets: list[Target]) -> float:
    """Decode and put in place; returns the seconds spent (measured in the decode thread)."""
    t0 = time.perf_counter()
    _decode_put(dec, raw, targets)
    return time.perf_counter() - t0
