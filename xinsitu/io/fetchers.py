"""Producers of chunk bytes for the reader's one completion step (``decode.place``, then
``Reader.settle``): local files read in the decode threads (``read_local``), whole objects fetched by
callbacks with no task per chunk (``WholeFetches``), inner chunks of shards by byte ranges
(``Shards``). Anything that fails there is fetched again the long way (``Reader._fetch``: one task,
bounded in time, its failure named).
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, NoReturn, cast

import numpy as np

from xinsitu.cache.keys import changed_since, file_clock_ns
from xinsitu.codecs.cpu import ShardLayout
from xinsitu.io import loop as _loop
from xinsitu.io.place import DECODED, EMPTY, SCRATCH, ChunkOutcome, Destination, Pieces, place, place_async, place_each
from xinsitu.stores.backend import (
    ChunkReadError,
    DamagedObjectError,
    RangeBackend,
    WholeBackend,
    deadlines_here,
    refetched,
)

if TYPE_CHECKING:
    from xinsitu.index.source import VarSource
    from xinsitu.io.reader import Reader, Route

INDEX_CACHE = 4096  # shard indexes kept (each a few bytes per inner chunk)
_EMPTY = 2**64 - 1  # shard index entry of an inner chunk never written


#: seconds a failed read waits at most for its cancelled siblings to stop (each of their waits is bounded too)
DRAIN_S = 10.0


async def all_or_none(coros: Any) -> None:
    """Run ``coros`` concurrently; where one fails, cancel the others and wait until they have stopped
    (as zarr's ``_cancel_and_drain``), then raise its error.

    Not a bare ``gather``: its other reads would run on (retrying, holding permits of the in-flight
    limit) after the caller has given up, and delay the reads that come next; and a read that returns
    before its siblings have stopped could see them write into a destination it hands on.
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        live = [t for t in tasks if not t.done()]
        if live:
            await asyncio.wait(live, timeout=DRAIN_S)
        for t in tasks:  # their outcomes are retrieved: the first error is the one raised
            if t.done() and not t.cancelled():
                t.exception()
        raise


def reraise(name: str, coords: tuple[int, ...], path: str, e: Exception, unit: str = "chunk") -> NoReturn:
    """Raise for a failed read: the fork hint and an error naming its chunk already as they are,
    anything else as an error naming the chunk."""
    if isinstance(e, (_loop.ForkError, ChunkReadError)):
        raise e
    raise ChunkReadError(name, coords, path, e, unit) from e


# ----------------------------------------------------------------------------- local files
class LocalTally:
    """What one ``read_local`` job did for the chunks of one array (``route``): how many it read (``n``;
    their seconds reading and placing, summed), the chunks decoded (``decoded``; their bytes read and
    seconds decoding, summed), each chunk's (seconds reading, seconds placing) for
    ``LocalBackend.observe_all``, and every other outcome as ``(coords, outcome)``, to settle one by one.
    Summed in the decode thread: the loop, which the decode threads wait on for the GIL, does no work
    per chunk."""

    __slots__ = ("route", "n", "read_s", "took", "decoded", "nbytes", "decode_s", "times", "others")

    def __init__(self, route: Route):
        self.route = route
        self.n = self.decoded = self.nbytes = 0
        self.read_s = self.took = self.decode_s = 0.0
        self.times: list[tuple[float, float]] = []
        self.others: list[tuple[tuple[int, ...], ChunkOutcome]] = []


def read_local(todo: deque[tuple[Route, tuple[int, ...], Destination]], scratch: Any = SCRATCH) -> list[LocalTally]:
    """Local chunk files (``LocalBackend.read``; items ``(route, coords, destination)``, of one array or
    several) taken from ``todo`` until none is left, each read and placed in turn by this decode thread:
    what it did, per array (``LocalTally``). Every decode thread takes from the same ``todo`` (work
    stealing: chunks of uneven size keep every thread busy to the end). A chunk that fails raises
    ``ChunkReadError`` naming it (a file reads the same bytes again: no second try). ``scratch``: what
    files are read into (``ThreadScratch.take``'s protocol; the GPU path's page-locked staging)."""
    tallies: dict[int, LocalTally] = {}
    while True:
        try:
            route, coords, dest = todo.popleft()  # atomic: each chunk is taken by one thread
        except IndexError:
            return list(tallies.values())
        dec = route.dec
        path = route.prefix + dec.key(coords)
        try:
            t0 = time.perf_counter()
            raw = route.store.read(path, scratch)  # type: ignore[attr-defined]
            read_s = time.perf_counter() - t0
            try:
                outcome = place(dec, raw, dest, read_s)
            except Exception as e:  # noqa: BLE001 - named below
                raise DamagedObjectError(f"object {path!r} failed to decode (corrupt in the store, or the archive "
                                         f"written again since it was opened?): {type(e).__name__}: {e}") from e
        except Exception as e:  # noqa: BLE001 - every failure names its chunk
            todo.clear()  # the read fails: the other threads take no more of its chunks
            raise ChunkReadError(route.src.name, coords, path, e, route.unit) from e
        t = tallies.get(id(route))
        if t is None:
            t = tallies[id(route)] = LocalTally(route)
        t.n += 1
        t.read_s += read_s
        t.took += outcome.took
        t.times.append((read_s, outcome.took))
        if outcome.status == DECODED:
            t.decoded += 1
            t.nbytes += outcome.nbytes
            t.decode_s += outcome.took
        else:
            t.others.append((coords, outcome))


# ----------------------------------------------------------------------------- callbacks
class WholeFetches:
    """The chunks of one read from a store that can start a request without awaiting it
    (``start_whole``: obstore's), each fetched and then placed by callbacks: no task, coroutine or
    timer per chunk. On one-sample-per-chunk archives over HTTP those cost the I/O loop more than the
    rest of a chunk's way together (~70 of ~110 µs).

    One coroutine (``run``) takes a slot of the in-flight limit for each chunk in turn and starts its
    request; the request's end hands the bytes to the decode threads (``TurnBatch``: ``place``), and
    the placing's end to ``Reader.settle``, which gives the slot back. Each request is bounded in
    time by the loop's ``Deadlines``. Anything but bytes that decode -- an error, no answer in time,
    bytes that fail to decode -- sends the chunk the long way (``Reader._fetch``: fetched again,
    bounded, its failure named) in a task of its own, counting the fetch made here; an error obstore
    gave after its own retries is raised as the long way would (``whole_error``). The first failure
    ends the read: its other requests are cancelled, and so are they where the read is cancelled.
    Every way a chunk ends gives its slot back (``InflightLimit.give`` gives a slot once).
    """

    def __init__(self, reader: Reader, route: Route):
        self.reader, self.route = reader, route
        self.store = cast(WholeBackend, route.store)  # (``Route.CALLBACKS``)
        self.loop = asyncio.get_running_loop()
        self.deadlines = deadlines_here()
        self.limit_s = _loop.request_timeout()
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.left = 0
        self.pending: set[asyncio.Future] = set()  # requests and decodes under way, and long ways

    async def run(self, items: list[tuple[tuple[int, ...], Destination]]) -> None:
        inflight, r = self.reader.inflight, self.route
        start = self.store.start_whole
        self.left = len(items)
        try:
            async with self.reader.starting():
                for i, (coords, dest) in enumerate(items):
                    slot = (self, i)
                    await inflight.take(slot)
                    if self.done.done():  # failed: start nothing more
                        inflight.give(slot)
                        break
                    path = r.path(coords)
                    try:
                        fut = await start(path)
                    except BaseException:
                        inflight.give(slot)
                        raise
                    if fut is None:  # this store takes the long way (it ignores ranges)
                        inflight.give(slot)
                        self._long(coords, dest, None)
                        continue
                    self.pending.add(fut)
                    w = self.deadlines.watch(fut, self.limit_s, self.store)
                    fut.add_done_callback(functools.partial(self._arrived, coords, dest, path, slot, w,
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

    def _arrived(self, coords: tuple[int, ...], dest: Destination, path: str, slot: Any, w: Any, t0: float,
                 fut: asyncio.Future) -> None:
        self.pending.discard(fut)
        self.deadlines.unwatch(w)
        reader = self.reader
        # (an error is always looked at: one never retrieved is logged, unscrubbed, by asyncio)
        err = None if fut.cancelled() else fut.exception()
        if self.done.done() or fut.cancelled() or (err is not None and not isinstance(err, FileNotFoundError)):
            reader.inflight.give(slot)
            if self.done.done():
                return
            if fut.cancelled():  # (else the read was cancelled, and ``done`` with it)
                self._long(coords, dest, TimeoutError("no answer in time"))
                return
            raised = self.store.whole_error(err)  # type: ignore[arg-type]  # (an error: not cancelled)
            if raised is None:  # a range refused: fetched without one there
                self._long(coords, dest, None)
            else:  # (obstore retried what was transient)
                self._fail(ChunkReadError(self.route.src.name, coords, path, raised, self.route.unit))
            return
        reader.counters.requests += 1
        reader.inflight.arrived(slot)
        raw = None if err is not None else fut.result()  # FileNotFoundError: no object, the fill value
        job = reader.turn.run(place, self.route.dec, raw, dest, time.perf_counter() - t0)
        self.pending.add(job)
        job.add_done_callback(functools.partial(self._placed, coords, dest, slot, raw is not None))

    def _placed(self, coords: tuple[int, ...], dest: Destination, slot: Any, fetched: bool,
                job: asyncio.Future) -> None:
        self.pending.discard(job)
        err = None if job.cancelled() else job.exception()
        if self.done.done() or job.cancelled() or err is not None:
            self.reader.inflight.give(slot)
            if self.done.done() or job.cancelled():
                return
            if fetched:
                self._long(coords, dest, err)  # fetched again there, this fetch counted
            else:  # filling failed: nothing to fetch again
                self._fail(ChunkReadError(self.route.src.name, coords, self.route.path(coords), err,  # type: ignore[arg-type]
                                           self.route.unit))
            return
        try:
            self.reader.settle(self.route, coords, job.result(), slot)
        except Exception as e:  # noqa: BLE001 - missing="raise": named like every failure
            self._fail(e)
            return
        self._one_done()

    def _long(self, coords: tuple[int, ...], dest: Destination, first: BaseException | None) -> None:
        """The long way for one chunk (``Reader._fetch``), in a task of its own."""
        task = asyncio.ensure_future(self.reader._fetch(self.route, coords, dest, first))
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


# ----------------------------------------------------------------------------- shards
class Shards:
    """Inner chunks of sharded arrays fetched by byte range: a shard's index once (kept, a few bytes
    per inner chunk), then the inner chunks a read needs in one coalesced request per shard, each
    placed (``place_each``) and settled by ``Reader.settle``."""

    def __init__(self, reader: Reader):
        self.reader = reader
        self.layouts: dict[int, ShardLayout] = {}
        self.indexes: OrderedDict[str, tuple[np.ndarray | None, int]] = OrderedDict()  # (index, fetched since)
        self.pending: dict[str, asyncio.Future[np.ndarray | None]] = {}  # indexes being fetched

    def layout(self, src: VarSource) -> ShardLayout:
        key = id(src.array)
        if key not in self.layouts:
            self.layouts[key] = ShardLayout(src.array)
        return self.layouts[key]

    async def read(self, route: Route, lay: ShardLayout, chunks: dict[tuple[int, ...], Pieces]) -> None:
        by_shard: dict[tuple[int, ...], dict[tuple[int, ...], Pieces]] = {}
        for coords, dest in chunks.items():
            shard = tuple(c // n for c, n in zip(coords, lay.per_shard, strict=True))
            by_shard.setdefault(shard, {})[coords] = dest
        await all_or_none(self._fetch(route, lay, sh, inner) for sh, inner in by_shard.items())

    async def _index(self, lay: ShardLayout, store: Any, path: str) -> np.ndarray | None:
        """The shard's index, fetched once and cached (a few bytes per inner chunk); reads of one shard
        under way at once share the one fetch. A local shard written since is fetched again (an archive
        rewritten between epochs: its inner chunks lie elsewhere now)."""
        kept = self.indexes.get(path)
        file = _local_file(store, path)
        if kept is not None and (file is None or not changed_since(file, kept[1])):
            self.indexes.move_to_end(path)
            return kept[0]
        self.indexes.pop(path, None)
        pending = self.pending.get(path)
        if pending is None:
            pending = self.pending[path] = asyncio.ensure_future(self._fetch_index(lay, store, path))
            pending.add_done_callback(functools.partial(self._fetched, path))
        return await asyncio.shield(pending)

    def _fetched(self, path: str, fut: asyncio.Future) -> None:
        """An index fetch ended: the next read of the shard finds it kept (or fetches it again where it
        failed); its failure is retrieved here too, where every read waiting for it was cancelled."""
        self.pending.pop(path, None)
        if not fut.cancelled():
            fut.exception()

    async def _fetch_index(self, lay: ShardLayout, store: Any, path: str) -> np.ndarray | None:
        counters = self.reader.counters

        def fetch() -> Any:
            counters.requests += 1
            if lay.index_at_end:
                return store.get_suffix(path, lay.index_size)
            return store.get_range(path, 0, lay.index_size)

        async def use(raw: Any) -> np.ndarray | None:
            return None if raw is None else await lay.index(raw)

        # an index that fails its checksum (a flipped bit in transit) is fetched again
        since = file_clock_ns()
        index = await refetched(fetch, path, use, on_retry=self.reader.inflight.failed, source=store)
        self.indexes[path] = (index, since)
        while len(self.indexes) > INDEX_CACHE:
            self.indexes.popitem(last=False)
        return index

    async def _fetch(self, route: Route, lay: ShardLayout, shard: tuple[int, ...],
                     inner: dict[tuple[int, ...], Pieces]) -> None:
        reader, store, dec = self.reader, cast(RangeBackend, route.store), route.dec
        inflight = reader.inflight
        path = route.prefix + lay.shard_key(shard)
        if reader.journal is not None:
            reader.journal.append((store, path))
        loop = asyncio.get_running_loop()
        slot = object()
        await inflight.take(slot)
        try:
            index = await self._index(lay, store, path)
            want: list[tuple[tuple[int, ...], Pieces]] = []
            starts: list[int] = []
            ends: list[int] = []
            for coords, dest in inner.items():
                local = tuple(c - s * n for c, s, n in zip(coords, shard, lay.per_shard, strict=True))
                if index is None:  # no shard: each inner chunk is missing
                    reader.settle(route, coords, await loop.run_in_executor(None, place, dec, None, dest), key=path)
                    continue
                off, nb = int(index[local][0]), int(index[local][1])
                if off == _EMPTY:  # never written: the fill value, as zarr reads it
                    reader.settle(route, coords, await loop.run_in_executor(None, place, dec, None, dest, 0.0,
                                                                             EMPTY))
                    continue
                want.append((coords, dest))
                starts.append(off)
                ends.append(off + nb)
            if want:
                placed: list[ChunkOutcome] = []  # a fetch made again skips the inner chunks placed (hooks run once)
                t_start = time.perf_counter()
                waited = [0.0]

                def fetch() -> Any:
                    return store.get_ranges(path, starts[len(placed):], ends[len(placed):])  # coalesced

                async def use(raws: Any) -> None:
                    waited[0] = time.perf_counter() - t_start
                    inflight.arrived(slot)
                    reader.counters.requests += 1
                    rest = [d for _, d in want[len(placed):]]
                    if dec.sync:
                        await loop.run_in_executor(None, place_each, dec, raws, rest, placed)
                        return
                    for raw, d in zip(raws, rest, strict=True):
                        placed.append(await place_async(dec, raw, d))

                await refetched(fetch, path, use, on_retry=inflight.failed, source=store)
                for (coords, _), o in zip(want, placed, strict=True):
                    reader.settle(route, coords, o, observe=False)
                inflight.observe(waited[0], sum(o.took for o in placed), slot)
        except Exception as e:  # noqa: BLE001 - every failure names its shard
            reraise(route.src.name, shard, path, e, "shard")
        finally:
            inflight.give(slot)


def reads_changed(reads: list[tuple[Any, str]], since_ns: int) -> bool:
    """Whether what a read ahead read (``reads``: ``(backend, key)`` of chunks or shards, as ``Reader.journal``
    records them) may differ from what a read would give now: a local file among them written at or after
    ``since_ns`` (``file_clock_ns``), or a file a NetCDF or GRIB store references changed since it was opened (the
    epoch's own read of it then says so). Objects of other stores are not looked at (a chunk without a file read
    as its fill value, and still without one, did not change)."""
    for store, key in reads:
        changed = getattr(store, "changed", None)  # (``ManifestBackend``'s)
        if changed is not None:
            if changed(key):
                return True
        elif (file := _local_file(store, key)) is not None and changed_since(file, since_ns, gone=False):
            return True
    return False


def _local_file(store: Any, key: str) -> str | None:
    """The file of object ``key`` where ``store`` is a backend of a local directory (its ``root``), else None."""
    root = getattr(store, "root", None)
    return None if root is None else os.path.join(root, key)
