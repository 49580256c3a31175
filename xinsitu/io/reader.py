"""Asynchronous chunk reads: objects fetched through obstore (or a zarr store's own ``get``), a
bounded number in flight (``xinsitu.io.inflight``), decoded in threads into place.

A region is a range of positions along some dims of a variable (its other dims whole); reading it
fetches each chunk it touches exactly once (``xinsitu.index.regions``). A read may also hand each chunk's
piece of the region to a callback in the decode thread, while the piece is still in cache, with or
without putting it in place (``read_many``). Where each slot of a buffer is one whole chunk, chunks
are decoded straight into their slots (``read_whole``).

The chunk's route, whatever the store: the read strategy of an array is chosen once, for its
backend (``Route``); the strategy only produces the chunk's bytes -- local files read in the decode
threads (``fetchers.read_local``), objects fetched by callbacks (``fetchers.WholeFetches``) or by a
task each (``Reader._fetch``), inner chunks of shards by byte range (``fetchers.Shards``) -- and hands
them with the chunk's destination (``decode.Slot``: a buffer's row; ``decode.Pieces``: pieces of
regions and hooks, with the cache's keep) to the one completion step, ``decode.place``, in a decode
thread. Its ``ChunkOutcome`` is settled by ``Reader.settle``: counted, fed to the in-flight policy,
``missing=`` applied, the slot given back. Every other way a chunk lands settles there too: cache hits of
every tier (``cache.lookup``, the device tier), chunks the GPU decoded in one batched call, regions zarr or
dask read whole.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from xinsitu.cache.chunk_cache import ChunkCache
from xinsitu.cache.keys import ChunkKey, array_store
from xinsitu.cache.lookup import TierPlan, in_device_tier, serve_cached, take_cached
from xinsitu.codecs.cpu import ChunkDecoder, is_remote, is_sharded, store_root
from xinsitu.codecs.gpu_batch import GpuBatch, GpuSlot
from xinsitu.codecs.gpu_chain import GpuChain, GpuPathError
from xinsitu.index.regions import PieceHook, RegionPlans, Target
from xinsitu.index.source import VarSource
from xinsitu.io import loop as _loop
from xinsitu.io.fetchers import Shards, WholeFetches, all_or_none, read_local, reraise
from xinsitu.io.inflight import InflightLimit
from xinsitu.io.place import (
    BATCH_DECODED,
    DECODED,
    DISK_HIT,
    HIT,
    MISSING,
    QUEUED,
    READ_ELSEWHERE,
    SCRATCH,
    ChunkOutcome,
    Destination,
    Pieces,
    Slot,
    TurnBatch,
    place,
    place_async,
)
from xinsitu.stores.backend import (
    Backend,
    ChunkReadError,
    LocalBackend,
    RangeBackend,
    WholeBackend,
    backend_for,
    fetch_decoded,
)


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


class GpuRead(NamedTuple):
    """One variable's whole chunks to decode on the GPU (``Reader.read_gpu``): chunks ``coords`` of ``src``
    into ``outs`` (device arrays of the chunk's shape), its codec chain ``chain`` (a ``GpuChain``);
    ``stack``, where there is one, a device array whose row ``i`` is ``outs[i]`` (the device cache tier
    then copies to and from it in one call per slab, not one per chunk)."""

    src: VarSource
    coords: list[tuple[int, ...]]
    outs: list[Any]
    chain: GpuChain
    stack: Any = None


class Route:
    """How the chunks of one array are read: its ``kind``, chosen once for its backend -- ``LOCAL``
    (chunk files), ``CALLBACKS`` (whole chunks by ``start_whole``), else ``TASKS`` (a task each,
    ``Reader._fetch``). One choice is left to the backend and may change during a run: a ``LOCAL``
    array's files are read in the decode threads while the disk keeps up, and by tasks on the loop
    from the moment ``LocalBackend.observe`` finds it slow (a network file system): ``local``. ``dec``
    is the decoder of the array's objects (of its inner chunks, for shards read by byte range)."""

    LOCAL, CALLBACKS, TASKS = "local", "callbacks", "tasks"
    __slots__ = ("array", "src", "dec", "store", "prefix", "kind", "unit")

    def __init__(self, src: VarSource, dec: ChunkDecoder, store: Backend):
        self.array, self.src, self.dec, self.store = src.array, src, dec, store
        self.prefix = f"{src.array.path}/" if src.array.path else ""
        self.unit = "shard" if is_sharded(src.array) else "chunk"  # what an object of the array is, to errors
        if isinstance(store, LocalBackend) and dec.sync:
            self.kind = self.LOCAL
        elif isinstance(store, WholeBackend) and dec.sync:
            self.kind = self.CALLBACKS
        else:
            self.kind = self.TASKS

    def path(self, coords: tuple[int, ...]) -> str:
        """The store key of chunk ``coords`` (the one place it is written)."""
        return self.prefix + self.dec.key(coords)

    @property
    def local(self) -> bool:
        """Read in the decode threads now (a local disk found slow leaves them: ``LocalBackend.observe``)."""
        return self.kind == self.LOCAL and self.store.fused  # type: ignore[attr-defined]


class Reader:
    """Reads regions of the variables of one Dataset; one per process (built lazily).

    With a ``cache`` (``xinsitu.cache.chunk_cache.ChunkCache``), decoded chunks of stored arrays are kept
    across reads: a chunk it has is copied into place without a request or a decode (see
    ``cache.lookup.serve_cached``). Values and their order are the same either way.
    """

    def __init__(self, max_inflight: int | None = None, cache: ChunkCache | None = None):
        self.inflight = InflightLimit(max_inflight, _loop.decode_threads())
        self.cache = cache
        self._keys: dict[int, ChunkKey | None] = {}
        self._states: dict[str, str] = {}  # the files an Icechunk snapshot references, as this reader found them
        self._decoders: dict[int, ChunkDecoder] = {}
        self._backends: dict[int, Backend] = {}
        self._routes: dict[int, Route] = {}
        self.counters = IOCounters()
        self.regions = RegionPlans(is_sharded)
        self.shards = Shards(self)
        self.on_missing = "fill"  # or "raise": a chunk with no object is an error
        #: decode-thread work asked for in one turn of the loop, sent to the threads together
        self.turn = TurnBatch(self.inflight.threads)
        self.last_missing: tuple[str, tuple[int, ...], str] | None = None  # (variable, chunk, key)
        self._starts = _loop.PerLoop(lambda _: asyncio.Lock())  # see ``starting``
        #: while a list, the (backend, key) of each object fetched (what a read ahead read: ``fetchers.reads_changed``)
        self.journal: list[tuple[Any, str]] | None = None

    def missing_record(self) -> list[Any] | None:
        """JSON-able ``[chunks that had no object, variable, chunk, key]`` of one of them, None if none."""
        last = self.last_missing
        if not self.counters.missing or last is None:
            return None
        return [int(self.counters.missing), last[0], [int(c) for c in last[1]], last[2]]

    def starting(self) -> asyncio.Lock:
        """Held by a ``WholeFetches`` while it starts its requests: those of one call all go out
        before those of a call made after it, as they would queue for the in-flight limit one task
        each. (Else two calls would take turns, slot by slot, and a read ahead whose requests hang
        could hold every slot while the buffer the caller waits for has none.)"""
        return self._starts.get()  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ the completion step
    def settle(self, route: Route | None, coords: tuple[int, ...] | None, outcome: ChunkOutcome, slot: Any = None,
               *, observe: bool = True, key: str | None = None, n: int = 1) -> None:
        """THE completion step: every chunk that lands, however it came, is settled here -- counted
        (the one place ``IOCounters``' chunk counts change); a fetched chunk's decode and wait fed to
        the in-flight policy (``observe``; strategies that settle many chunks at once feed their mean);
        ``missing=`` applied to a chunk with no object (``key``: the object that is missing, default the
        chunk's own); and ``slot``, where it holds one, given back -- once, whatever happens here.

        ``outcome.status`` says how it came: fetched and placed (``DECODED``, ``MISSING``, ``EMPTY``; a
        chunk only queued for a decode of many, ``QUEUED``: counted as read now), or settled ``n`` at a
        time without ``place``: decoded by that decoder of many (``BATCH_DECODED``: the GPU path, once
        nvCOMP has decoded them), put in place from a cache tier (``HIT``, ``DISK_HIT``), or a region
        another reader read in one request (``READ_ELSEWHERE``: zarr, dask). For those two last kinds
        and ``BATCH_DECODED``, ``outcome.nbytes`` is what was decoded (``route`` may be None); else a
        chunk decodes to ``route.dec.nbytes``. Requests are counted where their answer arrives (one may
        bring several chunks, or none: a shard's index)."""
        try:
            c = self.counters
            status = outcome.status
            if status == DECODED or status == QUEUED:
                c.bytes_read += outcome.nbytes
                c.decode_s += outcome.took
                if observe:
                    self.inflight.observe(outcome.waited, outcome.took, slot)
            elif status == MISSING:
                assert route is not None and coords is not None  # a fetched chunk
                path = key or route.path(coords)
                c.missing += 1  # counted and named: a deleted archive or a 404 would otherwise pass in silence
                self.last_missing = (route.src.name, coords, path)
                if self.on_missing == "raise":
                    raise ChunkReadError(route.src.name, coords, path, FileNotFoundError(
                        "no object at this key (missing='raise'; zarr would read the fill value)"), route.unit)
            elif status == HIT or status == DISK_HIT:
                c.cache_hits += n
                if status == DISK_HIT:
                    c.cache_disk_hits += n
            elif status == BATCH_DECODED:
                c.decode_s += outcome.took
            if status == QUEUED:
                return
            c.chunks += n
            if status == BATCH_DECODED or status == READ_ELSEWHERE:
                c.bytes_decoded += outcome.nbytes
            else:
                assert route is not None
                c.bytes_decoded += n * route.dec.nbytes
        finally:
            if slot is not None:
                self.inflight.give(slot)

    def _decoder(self, src: VarSource) -> ChunkDecoder:
        key = id(src.array)
        if key not in self._decoders:
            self._decoders[key] = ChunkDecoder(src.array)
        return self._decoders[key]

    def _store(self, src: VarSource) -> Backend:
        zstore = src.array.store
        key = id(zstore)
        if key not in self._backends:
            self._backends[key] = backend_for(zstore)
            if is_remote(zstore):
                self.inflight.expect_remote()
        return self._backends[key]

    def route(self, src: VarSource) -> Route:
        """How ``src``'s chunks are read (chosen once per array)."""
        got = self._routes.get(id(src.array))
        if got is None or got.array is not src.array:  # (an id is reused once its object is gone)
            dec = self.shards.layout(src).inner if is_sharded(src.array) else self._decoder(src)
            got = self._routes[id(src.array)] = Route(src, dec, self._store(src))
        elif got.src.name != src.name:
            got = Route(src, got.dec, got.store)  # the same array under another variable's name
        return got

    # ------------------------------------------------------------------ reads
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
                outs.append(await self._read_other(src, region, out, hook))
                continue
            shape, pieces = self.regions.plan(src, region)
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
        if not targets:
            return outs
        route = self.route(src)
        if is_sharded(src.array):
            lay = self.shards.layout(src)
            chunks = await self._serve_cached(src, targets, lambda c: lay.shard_key(
                tuple(i // n for i, n in zip(c, lay.per_shard, strict=True))), route.dec)
            if chunks:
                await self.shards.read(route, lay, chunks)
            return outs
        chunks = await self._serve_cached(src, targets, route.dec.key, route.dec)
        if chunks:
            await self._fetch_all(route, list(chunks.items()))
        return outs

    async def read_whole(self, src: VarSource, coords: list[tuple[int, ...]], outs: list[np.ndarray],
                         regions: list[dict[str, tuple[int, int]]]) -> None:
        """Read whole chunks ``coords`` (the chunks ``regions`` are exactly) into ``outs`` (each of the
        chunk's shape): straight into them with no region plan or target per chunk (``decode.Slot``;
        chunks the memory tier should keep are kept) where the array's route allows it, else as any
        region (``read_many``: a codec chain decoded on the loop, a sharded array, a disk tier)."""
        slots = self._slots(src, coords, outs)
        if slots is None:
            await self.read_many(src, list(zip(regions, outs, strict=True)))
        else:
            await self._fetch_all(*slots)

    def _slots(self, src: VarSource, coords: list[tuple[int, ...]],
               outs: list[np.ndarray]) -> tuple[Route, list[tuple[tuple[int, ...], Destination]]] | None:
        """``read_whole``'s chunks as ``(route, [(coords, Slot)])``, None where they must be read as regions."""
        route = None if is_sharded(src.array) else self.route(src)
        cache = self.cache
        keys = self.chunk_keys(src) if cache is not None else None
        if route is None or not route.dec.sync or (cache is not None and keys is not None and cache.disk is not None):
            return None
        keep = None
        if cache is not None and keys is not None:
            keep = (cache, keys)
            cache.count_misses(len(coords))  # ``take_cached`` looked them up first
            self.counters.cache_misses += len(coords)
        return route, [(c, Slot(out, keep, c)) for c, out in zip(coords, outs, strict=True)]

    async def read_slots_many(self, reads: list[tuple[VarSource, list[tuple[int, ...]], list[np.ndarray]]],
                              regions: list[dict[str, tuple[int, int]]]) -> None:
        """Whole chunks of several variables at the same positions (``regions``, one per destination: a
        batch's samples), each ``(src, coords, outs)``: ``outs`` C-contiguous arrays of the chunk's shape,
        anywhere (e.g. a sample's channels in a batch). Those the memory tier has are copied from it, the
        others decoded straight in (``read_whole``'s way), the local files of all the variables by one set
        of decode-thread jobs (``_read_local``), not one per variable: a batch of one-sample chunks is then
        one hand-off of the I/O loop, which the decode threads wait on for the GIL."""
        local: list[tuple[Route, tuple[int, ...], Destination]] = []
        jobs: list[Any] = []
        for src, coords, outs in reads:
            rest, _ = await self.take_cached(src, coords, outs)
            if len(rest) < len(coords):
                coords, outs = [coords[i] for i in rest], [outs[i] for i in rest]
                places = [regions[i] for i in rest]
            else:
                places = regions
            if not coords:
                continue
            slots = self._slots(src, coords, outs)
            if slots is None:
                jobs.append(self.read_many(src, list(zip(places, outs, strict=True))))
            elif slots[0].local:
                route = slots[0]
                local.extend((route, c, d) for c, d in slots[1])
            else:
                jobs.append(self._fetch_all(*slots))
        if local:
            jobs.append(self._read_local(local))
        await asyncio.gather(*jobs)

    async def read_gpu(self, reads: list[GpuRead], gpu: Any, tier: Any = None) -> dict[str, GpuPathError]:
        """Whole chunks of several variables (a buffer's, a batch's) decoded on the GPU straight into their
        ``outs`` (``GpuRead``). Each array's route fetches the bytes as for any read -- local files read
        straight into the batch's page-locked staging -- and the completion step hands them to ONE
        ``gpu_batch.GpuBatch`` (``GpuSlot``), which decodes them together once all are in: one transfer,
        one batched call per compressor (``gpu``: the device side, ``codecs.gpu.CupyGpu`` or its stand-in).
        A chunk is counted decoded once it is. With a device cache tier (``tier``, a
        ``device_tier.DeviceCache``), chunks it has are copied from it on the device, and those decoded are
        kept there (keep what fits). A chunk the device cannot decode is fetched again and decoded the CPU
        way (``_fetch``: up to ``FETCH_ATTEMPTS`` fetches, named where it never decodes), then copied over.

        Returns the variables whose codec chain failed its check on first use (name -> why): their
        ``outs`` are not filled (the caller reads them the CPU way); everything else is in place."""
        plans = []
        capacity = 0
        for r in reads:
            plan = await in_device_tier(self, r.src, r.coords, tier)
            if plan.keys is not None:
                self.counters.cache_misses += len(plan.todo)
            plans.append((r, self.route(r.src), plan))
            capacity += len(plan.todo) * r.chain.bound
        batch = GpuBatch(gpu.decoder(), capacity, gpu.asarray)
        jobs = []
        for r, route, plan in plans:
            items: list[tuple[tuple[int, ...], Destination]] = [
                (r.coords[i], GpuSlot(batch, r.outs[i], r.chain, (r.src.name, r.coords[i], route.path(r.coords[i]))))
                for i in plan.todo]
            if items:
                jobs.append(self._fetch_all(route, items, batch.staging))
        if jobs:
            await all_or_none(jobs)

        def run() -> Any:
            if all(r.chain in gpu.checked for r in reads):
                return land(False)
            with gpu.first_use:  # one first use at a time: a buffer after it finds its chains checked
                return land(any(r.chain not in gpu.checked for r in reads))

        def land(first: bool) -> Any:
            try:
                if tier is not None:  # cached: copied on the device
                    for r, _, plan in plans:
                        if len(plan.todo) < len(plan.places):
                            tier.copy_out(plan.places, r.outs, r.stack)
                flushed = batch.flush(gpu)
                if tier is not None:
                    redo = {id(d) for _, d, _ in flushed.refetch}
                    for r, _, plan in plans:
                        if r.chain not in flushed.failed:
                            plan.keep(tier, [i for i in plan.todo if id(r.outs[i]) not in redo], r.outs, r.stack)
                gpu.synchronize()
            except GpuPathError:
                raise
            except Exception as e:
                if first:  # the device's side failed on first use: the CPU path takes over
                    raise GpuPathError(f"{type(e).__name__}: {e}") from e
                raise
            gpu.checked.update(flushed.checked)
            return flushed

        try:
            flushed = await asyncio.get_running_loop().run_in_executor(None, run)
        except GpuPathError as e:
            return {r.src.name: e for r in reads}
        took = flushed.seconds  # the batched decode's seconds, counted once
        for chain, n in flushed.decoded.items():  # settled once nvCOMP has decoded them (``QUEUED`` until now)
            self.settle(None, None, ChunkOutcome(BATCH_DECODED, n * chain.nbytes, 0.0, took), n=n)
            took = 0.0
        failed = {r.src.name: flushed.failed[r.chain] for r in reads if r.chain in flushed.failed}
        redo = [x for x in flushed.refetch if x[2][0] not in failed]
        if redo:
            await self._refetch(redo, {r.src.name: (route, plan, r) for r, route, plan in plans}, gpu, tier)
        return failed

    async def _refetch(self, redo: list[tuple[GpuChain, Any, tuple[str, tuple[int, ...], str]]],
                       of: dict[str, tuple[Route, TierPlan, GpuRead]], gpu: Any, tier: Any) -> None:
        """Chunks the device could not decode, fetched again and decoded the CPU way (``_fetch``: fetched
        again while the bytes do not decode, its failure named), then copied onto the device."""
        hosts = [np.empty(chain.shape, chain.dtype) for chain, _, _ in redo]
        await all_or_none(self._fetch(of[name][0], coords, Slot(h))
                          for h, (_, _, (name, coords, _)) in zip(hosts, redo, strict=True))

        def upload() -> None:
            for h, (_, dest, (name, coords, _)) in zip(hosts, redo, strict=True):
                dest[...] = gpu.asarray(h)  # (``dest`` is the chunk's ``r.outs[i]``)
                _, plan, r = of[name]
                if tier is not None:
                    plan.keep(tier, [r.coords.index(coords)], r.outs)
            gpu.synchronize()

        await asyncio.get_running_loop().run_in_executor(None, upload)

    async def read_kept(self, src: VarSource, coords: list[tuple[int, ...]], outs: list[Any],
                        regions: list[dict[str, tuple[int, int]]], gpu: Any, tier: Any, stack: Any = None) -> None:
        """Whole chunks ``coords`` of a variable decoded on the host, into ``outs`` (device arrays of
        the chunk's shape; ``stack``: as ``GpuRead``'s): those the device cache tier ``tier`` has copied
        from it on the device, the others read as any (``read_whole``), copied over in one transfer and
        kept there."""
        plan = await in_device_tier(self, src, coords, tier)
        todo = plan.todo
        host = np.empty((len(todo), *outs[0].shape), outs[0].dtype)
        if todo:
            await self.read_whole(src, [coords[i] for i in todo], list(host), [regions[i] for i in todo])

        def upload(first: bool) -> bool:
            there = gpu.asarray(host)  # one transfer
            if stack is not None and len(todo) == len(outs):
                stack[...] = there
            elif stack is not None and len(todo) > 1:
                stack[gpu.index(np.asarray(todo, np.int64))] = there
            else:
                for k, i in enumerate(todo):
                    outs[i][...] = there[k]
            return True

        await self._land(gpu, "kept", outs, plan, tier, upload if todo else lambda first: True, stack)

    async def _land(self, gpu: Any, key: Any, outs: list[Any], plan: TierPlan, tier: Any,
                    fill: Callable[[bool], bool], stack: Any = None) -> float:
        """In a decode thread, device work the loop does not wait on: chunks the tier has (``plan.places``)
        copied into ``outs`` (rows of ``stack``, where given) on the device, the others (``plan.todo``) put there
        by ``fill(first)`` and kept in the tier, then the device's work completed (the buffer is gathered
        from in another thread).
        On first use (``key`` not in ``gpu.checked``: ``fill`` says whether it checked), a failure of
        the device's side raises ``GpuPathError``: the CPU path takes over. The seconds ``fill`` took."""
        first = key not in gpu.checked

        def run() -> float:
            try:
                if len(plan.todo) < len(plan.places):  # cached: copied on the device
                    tier.copy_out(plan.places, outs, stack)
                t0 = time.perf_counter()
                checked = fill(first)
                took = time.perf_counter() - t0
                plan.keep(tier, plan.todo, outs, stack)
                gpu.synchronize()
            except (GpuPathError, ChunkReadError):
                raise
            except Exception as e:
                if first:
                    raise GpuPathError(f"{type(e).__name__}: {e}") from e
                raise
            if first and checked:
                gpu.checked.add(key)
            return took

        return await asyncio.get_running_loop().run_in_executor(None, run)

    async def _fetch_all(self, route: Route, items: list[tuple[tuple[int, ...], Destination]],
                         scratch: Any = SCRATCH) -> None:
        """Every chunk of ``items`` fetched and placed by ``route``'s strategy, whatever its destination
        (``scratch``: what local files are read into, see ``fetchers.read_local``)."""
        if route.local:
            await self._read_local([(route, c, d) for c, d in items], scratch)
        elif route.kind == Route.CALLBACKS:
            await WholeFetches(self, route).run(items)
        elif len(items) == 1:  # one chunk (a chunk-aligned unit): no task of its own
            await self._fetch(route, *items[0])
        else:
            await all_or_none(self._fetch(route, c, d) for c, d in items)

    async def _read_local(self, items: list[tuple[Route, tuple[int, ...], Destination]],
                          scratch: Any = SCRATCH) -> None:
        """Local chunk files (of one or several arrays: ``(route, coords, destination)``) read and placed by
        the decode threads, each taking the next chunk left (``fetchers.read_local``): per chunk no task,
        no executor hand-off and no wake-up of the loop, which for one-sample-per-chunk archives cost more
        than the decode itself. The reads asked for in one turn of the loop go out together, in one job per
        decode thread (``TurnBatch``)."""
        if self.journal is not None:
            self.journal += [(r.store, r.path(c)) for r, c, _ in items]
        k = max(1, min(len(items), self.inflight.threads))
        todo = deque(items)
        parts = await asyncio.gather(*(self.turn.run(read_local, todo, scratch) for _ in range(k)))
        n, read_s, took = 0, 0.0, 0.0
        for t in (t for part in parts for t in part):
            route = t.route
            self.counters.requests += t.n
            route.store.observe_all(t.times)  # type: ignore[attr-defined]
            if t.decoded:  # settled at once (their sums: what settling each adds up to)
                self.settle(route, None, ChunkOutcome(DECODED, t.nbytes, 0.0, t.decode_s), observe=False, n=t.decoded)
            for coords, outcome in t.others:
                self.settle(route, coords, outcome, observe=False)
            n, read_s, took = n + t.n, read_s + t.read_s, took + t.took
        if n:
            self.inflight.observe(read_s / n, took / n)

    async def _fetch(self, route: Route, coords: tuple[int, ...], dest: Destination,
                     first: BaseException | None = None) -> None:
        """Fetch one chunk in this task, place it and settle it: fetched again when its bytes fail to
        decode or no answer comes in time (``fetch_decoded``), its failure named. ``first``: how a
        first fetch made already failed."""
        dec, inflight = route.dec, self.inflight
        path = route.path(coords)
        slot = object()
        if self.journal is not None:
            self.journal.append((route.store, path))

        async def use(raw: Any) -> ChunkOutcome:
            self.counters.requests += 1
            inflight.arrived(slot)
            waited = time.perf_counter() - t_start
            if dec.sync or not isinstance(dest, Pieces):  # timed in the thread: waiting for a thread is not decoding
                return await self.turn.run(place, dec, raw, dest, waited)
            return await place_async(dec, raw, dest, waited)  # type: ignore[arg-type]

        await inflight.take(slot)
        try:
            t_start = time.perf_counter()
            outcome = await fetch_decoded(route.store, path, use, on_retry=inflight.failed, first=first)
            self.settle(route, coords, outcome, slot)
        except Exception as e:  # noqa: BLE001 - every failure names its chunk
            reraise(route.src.name, coords, path, e, route.unit)
        finally:
            inflight.give(slot)

    async def _read_other(self, src: VarSource, region: dict[str, tuple[int, int]], out: np.ndarray | None,
                          hook: PieceHook | None) -> np.ndarray | None:
        """A region of a variable not read chunk by chunk here: sharded arrays zarr reads, values in memory, dask."""
        if out is None and hook is None:
            out = np.empty(self.regions.shape(src, region), dtype=src.raw_dtype)
        if src.stored:  # a sharded array its store cannot read by byte range here (fsspec, Icechunk)
            from xinsitu.index.regions import positions
            if self.cache is not None:
                self.cache.note_read_by_zarr(f"variable {src.name!r}", type(src.array.store).__name__)
            values = await self._read_with_zarr(src, positions(src, region))
        elif isinstance(src.values, np.ndarray):
            if self.cache is not None:
                self.cache.note_in_memory(f"variable {src.name!r}")
            values = self._values(src, region)
        else:  # read through dask (files that are not Zarr): file reads and decoding, in a thread
            if self.cache is not None:
                self.cache.note_read_through_dask(f"variable {src.name!r}")
            slot = object()
            await self.inflight.take(slot)
            try:
                values = await asyncio.get_running_loop().run_in_executor(None, self._values, src, region)
            except Exception as e:  # noqa: BLE001 - every failure names its chunk
                raise ChunkReadError(src.name, src.chunk_at(region), getattr(src.values, "where", "?"), e) from e
            finally:
                self.inflight.give(slot)
            self.counters.requests += 1  # what io_stats shows, and how far the loader reads ahead
            self.settle(None, None, ChunkOutcome(READ_ELSEWHERE, values.nbytes, 0.0, 0.0))
        if out is not None:
            out[...] = values
        if hook is not None:  # values may be the caller's own array
            from xinsitu.index.regions import readonly

            hook(readonly(np.asarray(values)), [slice(None)] * np.ndim(values))
        return out

    @staticmethod
    def _values(src: VarSource, region: dict[str, tuple[int, int]]) -> np.ndarray:
        """A region of a variable held in memory (or by dask)."""
        sel = tuple(slice(*region[d]) if d in region else slice(None) for d in src.dims)
        assert src.values is not None  # not stored: held in memory or by dask
        return np.asarray(src.values[sel])

    async def _read_with_zarr(self, src: VarSource, pos: list[Any]) -> np.ndarray:
        """Sharded arrays: zarr reads the inner chunks it needs (range requests into shards)."""
        path = f"{src.array.path} (sharded selection)"
        slot = object()
        await self.inflight.take(slot)
        try:
            if store_root(src.array.store)[0] == "obstore":  # zarr would call obstore here: a hang after fork
                _loop.refuse_after_fork(f"sharded array {src.array.path!r} (through zarr)")
            select = src.array.async_array.get_orthogonal_selection(tuple(pos))
            store = self._store(src)  # an fsspec store's session lives on zarr's loop: the selection runs there
            at_home = getattr(store, "at_home", None)  # (``stores.zarr_store``'s backend)
            res = await (at_home(select) if at_home is not None else select)
        except Exception as e:  # noqa: BLE001 - every failure names its array
            reraise(src.name, (), path, e)
        finally:
            self.inflight.give(slot)
        arr = np.asarray(res.as_ndarray_like() if hasattr(res, "as_ndarray_like") else res)
        self.counters.requests += 1
        self.settle(None, None, ChunkOutcome(READ_ELSEWHERE, arr.nbytes, 0.0, 0.0))
        return arr

    def whole_chunk(self, src: VarSource, region: dict[str, tuple[int, int]]) -> tuple[int, ...] | None:
        """The grid coordinates of the one chunk ``region`` is exactly (all of it and nothing else, in
        order), else None: then the chunk can be decoded straight into, or copied whole into, a
        destination of its shape (``RegionPlans.whole_chunk``)."""
        return self.regions.whole_chunk(src, region)

    def whole_chunks(self, src: VarSource, at: dict[str, np.ndarray]) -> np.ndarray | None:
        """``whole_chunk`` of regions one position wide along the dims of ``at``, at once
        (``RegionPlans.whole_chunks``)."""
        return self.regions.whole_chunks(src, at)

    def _native_shards(self, src: VarSource) -> bool:
        """Whether inner chunks of ``src`` can be fetched by byte range here (else zarr reads them)."""
        store = self._store(src)
        if not isinstance(store, RangeBackend):
            return False
        try:
            self.shards.layout(src)
        except NotImplementedError:
            return False
        return True

    # ------------------------------------------------------------------ cache
    def chunk_keys(self, src: VarSource) -> ChunkKey | None:
        """The cache keys of ``src``'s chunks, made once; None where its store has no lasting identity
        (a memory store, uncommitted Icechunk changes): such an array is read, not cached, and the cache
        says so once (``ChunkCache.notes``), whichever of its tiers would have kept it."""
        k = id(src.array)
        if k not in self._keys:
            try:
                self._keys[k] = ChunkKey.for_array(src.array, states=self._states)
            except Exception:  # noqa: BLE001 - an array the keys cannot describe is simply not cached
                self._keys[k] = None
            if self._keys[k] is None and self.cache is not None:
                self.cache.note_uncached(f"variable {src.name!r}", array_store(src.array))
        return self._keys[k]

    async def _serve_cached(self, src: VarSource, targets: dict[tuple[int, ...], list[Target]],
                            object_of: Any, dec: ChunkDecoder) -> dict[tuple[int, ...], Pieces]:
        """The chunks the cache has put in place; the others returned, to fetch (``cached.serve_cached``)."""
        return await serve_cached(self, src, targets, object_of, dec)

    async def take_cached(self, src: VarSource, coords: list[tuple[int, ...]],
                          out: np.ndarray | list[np.ndarray]) -> tuple[list[int], tuple[np.ndarray, np.ndarray] | None]:
        """The whole chunks ``coords`` from the memory tier, for a buffer whose row ``i`` is chunk
        ``coords[i]``: ``(rows it lacks, for read_many; slab)`` (``cached.take_cached``)."""
        return await take_cached(self, src, coords, out)
