"""The batch pipeline of one epoch: ``EpochRun``.

Three parties work at once. The I/O loop reads buffers (``block_chunks`` units each) ahead (a
few buffers in flight, their chunk reads bounded by ``max_inflight``); a prefetch thread gathers
batches from loaded buffers into a small bounded queue; the caller's thread only takes finished
batches off that queue. Errors travel through the queues and are raised to the caller;
``close()`` (or breaking out of the loop that iterates the generator) stops both helpers.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from xinsitu.batches.output import OutputBuilder
from xinsitu.index.plan import EpochPlan
from xinsitu.io import loop as _loop

_END = object()
#: buffers read ahead or held: one being gathered from, one spanning, one loading
READ_AHEAD_BUFFERS = 3
#: ... and at most this many where the store is far (enough buffers loading to fill ``max_inflight``)
MAX_READ_AHEAD_BUFFERS = 6
#: ... or enough to hold this many decoded bytes (small buffers)
READ_AHEAD_BYTES = 32 << 20
#: ... and past ``MAX_READ_AHEAD_BUFFERS`` small buffers of a far store, while they hold at most this
#: many bytes: the requests of one-sample-per-chunk archives fill ``max_inflight`` only that way
FAR_READ_AHEAD_BYTES = 64 << 20
#: finished batches waiting for the caller
PREFETCH_BATCHES = 2
#: ``close`` waits this long at most for the next epoch's read ahead to start (on the I/O loop, at once)
THEN_WAIT_S = 1.0
WAIT_STEP_S = 0.05  # queue waits are this long at most, then check that the other side still runs



class EpochRun:
    """One pass over an epoch plan from batch ``start`` on: the I/O producer, the prefetch thread,
    and their queues. Iterate it for ``(batch index, batch)``; ``close()`` stops both helpers (always
    call it, e.g. in a ``finally``); ``report()`` gives the pass's I/O counters and rates.

    ``loader`` reads the plan's buffers (through its reader); ``builder`` makes batches of them.
    ``first``: a task on the I/O loop already loading the first buffer (read while the epoch before
    ended), used where it holds the very samples, in the order, this plan's first buffer yields
    (else dropped and the buffer read again), with ``counters_from`` the reader's counters when it
    began. ``then``: called on the I/O loop once every buffer is loaded (e.g. to start the next
    epoch's first buffer); the I/O counters of this run stop there.
    """

    #: items read ahead or held at the start (buffers: one gathered from, one spanning, one loading)
    start_depth = READ_AHEAD_BUFFERS
    #: finished batches waiting for the caller
    queued = PREFETCH_BATCHES

    def __init__(self, plan: EpochPlan, start: int, loader: Any, builder: OutputBuilder,
                 first: asyncio.Task | None = None, counters_from: dict[str, Any] | None = None,
                 then: Callable[[], None] | None = None, budget: int | None = None):
        self.plan, self.start, self.builder = plan, start, builder
        self.loader = loader
        self.counters_before = counters_from if first is not None and counters_from is not None \
            else _copy_counters(self.loader.reader.counters)
        self.counters_end: dict[str, Any] | None = None
        self.then = then
        self.buffers: queue.Queue = queue.Queue()
        self.batches: queue.Queue = queue.Queue(self.queued)
        self.stop = threading.Event()
        self.wait_s = 0.0
        self.samples = 0
        self.n_batches = 0
        self.borrowed = 0
        self.t0 = time.perf_counter()
        self.t_end: float | None = None
        self.loop = _loop.get_loop()
        self.credits: asyncio.Semaphore | None = None
        self.depth = self.start_depth  # items read ahead or held (grows with requests in flight, up to ``budget``)
        self.budget = budget  # bytes the items held may take (None: no bound beyond the read-ahead rule)
        self.n_loaded = 0
        self.held_bytes = 0  # the most host memory a loaded item held (what the budget counts)
        self.failed = False  # a buffer failed to load (set on the I/O loop)
        self.tasks: set[asyncio.Task] = set()  # buffer loads in flight
        self.then_done = threading.Event()  # ``then`` has been called or let go (``_then``)
        self.items = self._items()  # what the I/O loop reads, in order
        self.first = first if self.reads_first else None
        if first is not None and self.first is None:
            self.loop.call_soon_threadsafe(first.cancel)
        self.io_future = _loop.submit(self._produce())
        self.thread = threading.Thread(target=self._assemble, name="xinsitu-prefetch", daemon=True)
        self.thread.start()

    def _items(self) -> range:
        """The buffers this run reads (from the one holding batch ``start``), and the plan of the
        chunks that windows spill into, passed from buffer to buffer rather than read twice."""
        plan = self.plan
        first = plan.n_buffers if self.start >= plan.n_batches else plan.buffers_of(*plan.batch_span(self.start))[0]
        self.halo = self.loader.halo_plan(plan, first)
        return range(first, plan.n_buffers)

    @property
    def reads_first(self) -> bool:
        """Whether a first item read ahead (``first``) can be used: not where windows spill into later buffers."""
        return self.halo is None

    # -- I/O loop side
    async def _produce(self) -> None:
        self.credits = asyncio.Semaphore(self.depth)
        prev: asyncio.Task | None = None
        try:
            for j in self.items:
                await self.credits.acquire()
                if self.stop.is_set() or self.failed:
                    break  # a failed buffer ends the epoch: its error is on its way to the caller
                prev = asyncio.ensure_future(self._load(j, prev))
                self.tasks.add(prev)
                prev.add_done_callback(self.tasks.discard)
            delivered = True if prev is None else await prev
            if delivered and not self.stop.is_set():
                if prev is None:
                    self._ended()
                self.buffers.put(_END)
        except asyncio.CancelledError:
            for t in list(self.tasks):  # closed early: stop the reads of buffers nobody will take
                t.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - delivered to the caller
            self.buffers.put(e)

    async def _load(self, j: int, prev: asyncio.Task | None) -> bool:
        """Load buffer ``j`` and hand it (or its error) on after buffer ``j - 1``; whether it was delivered."""
        try:
            buffer: Any = await self._first(j) if j == self.items[0] and self.first is not None else None
            if buffer is None:
                buffer = await self._read(j)
        except Exception as e:  # noqa: BLE001 - delivered to the caller, in order
            buffer = e
            self.failed = True
            if self.credits is not None:
                self.credits.release()  # wake the producer, which may be waiting for a credit, so that it stops
        else:
            self.n_loaded += 1
            self.held_bytes = max(self.held_bytes, _host_bytes(buffer))
            self._deepen()
        if prev is not None and not await prev:  # an earlier buffer failed: its error goes first, alone
            if not isinstance(buffer, BaseException):
                self.loader.recycle(buffer)
            return False
        if j == self.items[-1] and not isinstance(buffer, BaseException) and not self.stop.is_set():
            self._ended()  # before the last item is handed on: the caller may end the run right after it
        self.buffers.put(buffer)
        return not isinstance(buffer, BaseException)

    def _ended(self) -> None:
        """Every item is read: the run's I/O counters stop here, and ``then`` is called once an item's
        room is free (``_then``)."""
        self.counters_end = _copy_counters(self.loader.reader.counters)
        if self.then is not None:
            task = asyncio.ensure_future(self._then())
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _then(self) -> None:
        """``then`` (the next epoch's first item, read ahead), once the caller is done with an item of this
        run: it takes that item's credit, so the items held stay within the read-ahead depth and the byte
        budget (SPEC §5), where it was one item more at every epoch's end (a 0.33 GB buffer over a 1 GiB
        budget). A run closed before its last batch was handed out (the caller stopped early) reads
        nothing ahead."""
        try:
            if self.credits is not None:
                await self.credits.acquire()  # (kept: the run has no item left to read)
            if self.stop.is_set() and self.n_batches < self.plan.n_batches - self.start:
                return
            try:
                self.then()  # type: ignore[misc]
            except Exception:  # noqa: BLE001 - a read ahead that cannot start is only not made
                pass
        finally:
            self.then_done.set()

    async def _first(self, j: int) -> Any:
        """Buffer ``j`` as read ahead (``first``), or None where it failed or holds other samples."""
        task, self.first = self.first, None
        assert task is not None
        try:
            buffer = await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if not task.cancelled() or (me is not None and me.cancelling()):  # this run is cancelled
                raise
            return None  # the read ahead was (e.g. dropped): read the buffer here
        except Exception:  # noqa: BLE001 - read again below: its error, if it lasts, comes from there
            return None
        if buffer is None:
            return None
        if not np.array_equal(buffer.ids, self._ids(j)):
            self.loader.recycle(buffer)
            return None
        return buffer

    async def _read(self, j: int) -> Any:
        """Read item ``j`` (a buffer)."""
        return await self.loader.load(self.plan, j, self.halo)

    def _ids(self, j: int) -> np.ndarray:
        """The sample ids item ``j`` holds, in the order it yields them."""
        return self.plan.buffer_order(j, self.loader.space.offsets)

    def _deepen(self) -> None:
        """Read further ahead where the buffers read so far call for it (``read_ahead_depth``)."""
        reader = self.loader.reader
        per_buffer = (reader.counters.requests - self.counters_before["requests"]) / self.n_loaded
        bytes_per_buffer = (reader.counters.bytes_decoded - self.counters_before["bytes_decoded"]) / self.n_loaded
        want = self._depth(reader.inflight.limit, reader.inflight.far, per_buffer, bytes_per_buffer)
        if self.budget is not None:  # memory: the items held stay within the byte budget (what they hold,
            # which is more than they decode where earlier buffers pass on what windows spill into)
            want = min(want, self._cap(max(1.0, bytes_per_buffer, self.held_bytes)))
        while self.depth < want and self.credits is not None:
            self.depth += 1
            self.credits.release()

    @staticmethod
    def _depth(limit: int, far: bool, per_item: float, bytes_per_item: float) -> int:
        """Items to keep read ahead or held (``read_ahead_depth``)."""
        return read_ahead_depth(limit, far, per_item, bytes_per_item)

    def _cap(self, item_bytes: float) -> int:
        """Items read ahead or held at most, for items of ``item_bytes``: as many as ``budget`` holds, at
        least the start depth."""
        if self.budget is None:
            return MAX_READ_AHEAD_BUFFERS
        return max(self.start_depth, int(self.budget // item_bytes))

    def _release(self) -> None:
        if self.credits is not None:
            self.loop.call_soon_threadsafe(self.credits.release)

    # -- prefetch thread
    def _assemble(self) -> None:
        plan, builder = self.plan, self.builder
        loaded: dict[int, Any] = {}
        try:
            for i in range(self.start, plan.n_batches):
                a, b = plan.batch_span(i)
                js = plan.buffers_of(a, b)
                # buffers no batch is gathered from again go back before this batch's are waited for: a
                # batch spanning many buffers then holds those alone (what a window spills into was copied
                # out as each loaded: ``halo``)
                for old in [k for k in loaded if k < js[0]]:
                    self._give_back(loaded.pop(old))
                for j in js:
                    while j not in loaded:
                        if len(loaded) >= self.depth - 1:
                            # this batch spans more buffers than the read-ahead allows: lend the
                            # producer one more buffer, paid back when a buffer is recycled
                            self.borrowed += 1
                            self._release()
                        item = self._next_buffer()
                        if item is None:
                            return  # closed
                        if isinstance(item, BaseException):
                            raise item
                        if item is _END:
                            raise RuntimeError(f"xinsitu: buffer {j} was never read (internal error)")
                        loaded[item.j] = item
                direct = builder.direct_stack(b - a)  # gather straight into the stacked batch
                raw_parts, start_parts, done = [], [], 0
                for j in js:
                    off = plan.buffer_offsets[j]
                    lo, hi = max(a, off) - off, min(b, plan.buffer_offsets[j + 1]) - off
                    rows = np.arange(lo, hi)
                    into = None if direct is None else {n: v[done:done + len(rows)] for n, v in direct[1].items()}
                    raw_parts.append(self.loader.gather(loaded[j], rows, into))
                    start_parts.append(loaded[j].starts[rows])
                    done += len(rows)
                raw = raw_parts[0] if len(raw_parts) == 1 else {
                    n: (np.concatenate([p[n] for p in raw_parts]) if builder.layouts[n].has_sample_axis
                        else raw_parts[0][n]) for n in raw_parts[0] if direct is None or n not in direct[1]}
                starts = np.concatenate(start_parts)
                batch = builder.build(raw, starts) if direct is None else builder.finish_direct(direct, raw, starts)
                del raw, raw_parts, direct
                if not self._put((i, batch, b - a)):
                    return
                del batch  # not held while the next is made: its memory goes back to the pool once the caller's done
            for old in list(loaded):  # the last buffers too: their arrays back to the pool, their credits freed
                self._give_back(loaded.pop(old))
            self._put(_END)
        except BaseException as e:  # noqa: BLE001 - delivered to the caller
            self._put(e)

    def _give_back(self, buffer: Any) -> None:
        """A buffer no batch is gathered from again: its arrays back to the pool, and its credit to the
        producer (or, where it lent one more buffer, that loan paid back)."""
        self.loader.recycle(buffer)
        if self.borrowed:
            self.borrowed -= 1
        else:
            self._release()

    def _next_buffer(self) -> Any:
        """The next loaded buffer (or error, or ``_END``); None once closed. Waits in short steps and
        checks the producer meanwhile, so that a producer that ended without a word cannot hang us."""
        while True:
            try:
                return self.buffers.get(timeout=WAIT_STEP_S)
            except queue.Empty:
                pass
            if self.stop.is_set():
                return None
            if self.io_future.done():
                try:
                    return self.buffers.get_nowait()  # put just before the producer ended
                except queue.Empty:
                    pass
                err = None if self.io_future.cancelled() else self.io_future.exception()
                return err or RuntimeError("xinsitu: the reading task ended before the epoch did (internal error)")

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.batches.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    # -- caller side
    def __iter__(self) -> Any:
        while True:
            t = time.perf_counter()
            item = self._next_batch()
            self.wait_s += time.perf_counter() - t
            if item is _END:
                self.t_end = time.perf_counter()
                return
            if isinstance(item, BaseException):
                raise item
            i, batch, n = item
            self.samples += n
            self.n_batches += 1
            del item
            yield i, batch
            del batch  # not held while the next is awaited: only the caller decides how long a batch lives

    def _next_batch(self) -> Any:
        """The next finished batch (or error, or ``_END``), waiting in short steps while the
        prefetch thread lives."""
        while True:
            try:
                return self.batches.get(timeout=WAIT_STEP_S)
            except queue.Empty:
                if not self.thread.is_alive():
                    try:
                        return self.batches.get_nowait()
                    except queue.Empty:
                        return RuntimeError("xinsitu: the prefetch thread ended before the epoch did "
                                            "(internal error)")

    def close(self) -> None:
        self.stop.set()
        # wake the prefetch thread now, not after its wait step (50 ms a break on the direct path): one waiting
        # for a buffer gets None (closed), one waiting for room for a batch gets the room
        self.buffers.put(None)
        try:
            self.batches.get_nowait()
        except queue.Empty:
            pass
        if self.first is not None:  # never taken: let its read stop
            self.loop.call_soon_threadsafe(self.first.cancel)
        self._release()  # the producer waits for one credit at a time: woken, it sees ``stop`` and ends
        self.io_future.cancel()
        self.thread.join(timeout=5)
        if self.then is not None and self.counters_end is not None:  # ``then`` waits for an item's room: the
            self.then_done.wait(THEN_WAIT_S)  # credit just given back lets it go, so an epoch that ended has
            # its next epoch's read ahead under way when the iteration returns

    def report(self) -> dict[str, Any]:
        c = dict(self.counters_end) if self.counters_end is not None else _copy_counters(self.loader.reader.counters)
        for k, v in self.counters_before.items():
            c[k] -= v
        dt = (self.t_end or time.perf_counter()) - self.t0
        if c["missing"]:
            c["missing_chunk"] = self.loader.reader.last_missing  # (variable, chunk, key): one of them
        return {"epoch": self.plan.epoch, "batches": self.n_batches, **c,
                "wait_s": self.wait_s, "seconds": dt, "samples": self.samples,
                "samples_per_s": self.samples / dt if dt > 0 else 0.0,
                "mb_per_s": c["bytes_decoded"] / dt / 1e6 if dt > 0 else 0.0}


class DirectRun(EpochRun):
    """``EpochRun`` of batches filled in place (``direct.DirectLoader``): the I/O loop reads whole batches
    ahead, straight into their arrays, and the prefetch thread only turns them into the output's kind
    (``transform=``, the device copy). ``budget``: bytes of batches read ahead at most (beyond the
    first two)."""

    start_depth = 1  # the first batch read by every decode thread, then the next ones overlapping (``_deepen``)

    queued = 1  # batches are finished by then: one waiting for the caller keeps it fed

    @staticmethod
    def _depth(limit: int, far: bool, per_item: float, bytes_per_item: float) -> int:
        """Batches to keep reading: enough to fill the in-flight limit with requests, or to hold
        ``READ_AHEAD_BYTES`` (small batches: a few ms of decoding each); one where a batch alone does
        (a global field of dozens of channels: each batch holds more chunks than there are decode
        threads). No batch is gathered from here (``read_ahead_depth`` counts one): fewer batch
        arrays, and a process touches less fresh memory."""
        return max(1, read_ahead_depth(limit, far, per_item, bytes_per_item) - 1)

    def _cap(self, item_bytes: float) -> int:
        """Batches read ahead at most: the budget holds them, the one waiting and the caller's (at least one)."""
        if self.budget is None:
            return MAX_READ_AHEAD_BUFFERS
        return max(1, int(self.budget // item_bytes) - self.queued - 1)

    def _items(self) -> range:
        self.halo = None
        return range(min(self.start, self.plan.n_batches), self.plan.n_batches)

    async def _read(self, j: int) -> Any:
        return await self.loader.load(self.plan, j)

    def _ids(self, j: int) -> np.ndarray:
        return self.loader.batch_ids(self.plan, j)

    def _assemble(self) -> None:
        builder, plan = self.builder, self.plan
        try:
            for i in self.items:
                item = self._next_buffer()
                if item is None:
                    return  # closed
                if isinstance(item, BaseException):
                    raise item
                if item is _END or item.i != i:
                    raise RuntimeError(f"xinsitu: batch {i} was never read (internal error)")
                batch = builder.finish(self.loader.output(item))
                del item
                a, b = plan.batch_span(i)
                if not self._put((i, batch, b - a)):
                    return
                del batch  # not held while the next is read (see ``EpochRun._assemble``)
                self._release()  # its place in the read-ahead is free once it waits in the queue
            self._put(_END)
        except BaseException as e:  # noqa: BLE001 - delivered to the caller
            self._put(e)


def read_ahead_depth(limit: int, far: bool, per_buffer: float, bytes_per_buffer: float) -> int:
    """How many buffers an epoch keeps loading or loaded, from what each buffer read so far took
    (``per_buffer`` requests, ``bytes_per_buffer`` decoded bytes) and the reader's in-flight
    ``limit``: one buffer gathered from, and enough loading to fill that limit with requests (a far
    store, see ``InflightLimit``) or to hold ``READ_AHEAD_BYTES`` (small buffers, e.g. of
    one-sample-per-chunk archives: a few ms of decoding each, which leaves the decode threads idle
    between buffers), at most ``MAX_READ_AHEAD_BUFFERS``. Small buffers of a far store (``far``) go
    further, while they hold at most ``FAR_READ_AHEAD_BYTES``: as many as hold twice the limit's
    requests (buffers read but not yet gathered from hold none; with one sample per chunk over HTTP,
    that is what keeps the limit's requests in flight). 0 where the buffers took no request (every
    chunk from the cache: nothing to keep in flight, no need to read ahead)."""
    if not per_buffer:
        return 0
    bytes_per_buffer = max(1.0, bytes_per_buffer)
    want = min(MAX_READ_AHEAD_BUFFERS, 1 + max(math.ceil(limit / per_buffer),
                                               math.ceil(READ_AHEAD_BYTES / bytes_per_buffer)))
    if far:
        want = max(want, min(int(FAR_READ_AHEAD_BYTES // bytes_per_buffer), 1 + math.ceil(2 * limit / per_buffer)))
    return want


def _host_bytes(item: Any) -> int:
    """Host memory a loaded buffer holds: its arrays, less slabs of the cache (not the buffer's own) and
    device arrays."""
    arrays = getattr(item, "arrays", None)
    if not isinstance(arrays, dict):
        return 0
    rows = getattr(item, "rows", {})
    return sum(a.nbytes for n, a in arrays.items() if isinstance(a, np.ndarray) and n not in rows)


def _copy_counters(c: Any) -> dict[str, Any]:
    return {k: getattr(c, k) for k in c.__dataclass_fields__}
