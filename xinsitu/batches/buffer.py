"""Buffers: ``block_chunks`` units (chunk blocks of the split) read together into one array per
variable, and batches gathered from them with vectorised numpy (one fancy-index per variable).

Layout of a variable's buffer: ``(slot, sampled dims the variable has (space order),
its other dims (own order))``. A *slot* holds one unit (chunk block) of the split,
plus the halo a window or tile spills into; variables without a split dim hold the
whole variable in a single slot, read once.
"""

from __future__ import annotations

import asyncio
import functools
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xinsitu.batches.halo import HALO_BUFFERS, HALO_HELD_BUFFERS, HaloPlan, Region
from xinsitu.batches.pipeline import MAX_READ_AHEAD_BUFFERS
from xinsitu.codecs.gpu import chain_on_gpu
from xinsitu.codecs.gpu_chain import GpuChain, GpuPathError, leave_gpu
from xinsitu.index.plan import EpochPlan, piece_ids
from xinsitu.index.sampling import SampleSpace, VarLayout
from xinsitu.io import loop as _loop
from xinsitu.io.mempool import ArrayPool
from xinsitu.io.reader import GpuRead, Reader
from xinsitu.repr.formatting import fmt_bytes

#: bytes the buffers of a generator read ahead and held take at most by default (SPEC §5: about 1 GiB)
BUFFER_BUDGET = 1 << 30
#: buffers read ahead and held at once, which the budget is shared by (``pipeline.READ_AHEAD_BUFFERS``)
BUDGET_BUFFERS = 3
#: chunk blocks per buffer where the budget allows more (the shuffle's block; at least 2 whatever the budget)
MAX_BLOCK_CHUNKS = 16
#: samples of a variable at least this big are gathered by a plain copy each (``np.take`` copies big rows,
#: above all into a batch's channel slice, slower than a copy per row: measured here, 128 kB rows 3.1 vs
#: 6.2 GB/s, 512 kB 2.0 vs 5.2; at 16-32 kB the two are level, at 4 kB np.take is twice as fast)
ROW_COPY_BYTES = 64 << 10
#: ... and into a batch's channel slice (not contiguous: ``np.take`` gathers into a temporary and copies that
#: over) from this size: the yardstick's 32 kB samples into a stacked batch, rows from buffers bigger than the
#: caches, 4.4 vs 3.4 GB/s; the prefetch thread's CPU per epoch 0.13 vs 0.16 s (8 kB: np.take 3.2 vs 2.4)
ROW_COPY_SLICE_BYTES = 16 << 10
#: a gather into place of at least this many bytes runs on every core, in shares of ``SHARE_BYTES``
PARALLEL_GATHER_BYTES = 8 << 20
SHARE_BYTES = 4 << 20
UNIT_SLOTS = 1 << 17  # units whose slot planning is kept (a few hundred bytes each)


def unit_nbytes(space: SampleSpace, layouts: dict[str, VarLayout]) -> int:
    """Decoded bytes of one unit (chunk block) of every variable with a split dim: its longest block
    along each split dim (plus the halo a window spills into), the variable's other dims whole."""
    return _unit_bytes(space, [(lay.src.dims, lay.src.shape, np.dtype(lay.src.raw_dtype).itemsize)
                               for lay in layouts.values() if not lay.static])


def dataset_unit_nbytes(space: SampleSpace, ds: Any) -> int:
    """``unit_nbytes`` of every data variable of ``ds`` (an ``xr.Dataset``) with a split dim, read or not,
    at the larger of its stored and decoded item sizes: what the default ``block_chunks`` follows, so that
    generators of one Dataset with other ``variables=`` (inputs and targets read apart) draw one order."""
    split = {d.name for d in space.split_dims}
    arrays = []
    for v in ds.data_vars.values():
        if split & set(v.dims):
            stored = v.encoding.get("dtype")
            size = max(v.dtype.itemsize, np.dtype(stored).itemsize if stored is not None else 0)
            arrays.append((v.dims, v.shape, size))
    return _unit_bytes(space, arrays)


def _unit_bytes(space: SampleSpace, arrays: list[tuple[tuple[Any, ...], tuple[int, ...], int]]) -> int:
    """Bytes of one unit of arrays ``(dims, shape, item size)`` (see ``unit_nbytes``)."""
    extent = {d.name: int(np.diff(e).max()) + d.width - 1 if len(e) > 1 else d.width
              for d, e in zip(space.split_dims, space.edges, strict=True)}
    return sum(int(np.prod([extent.get(d, n) for d, n in zip(dims, shape, strict=True)], dtype=np.int64)) * size
               for dims, shape, size in arrays)


def default_block_chunks(space: SampleSpace, layouts: dict[str, VarLayout], budget: int, ds: Any = None) -> int:
    """Chunk blocks per buffer where ``block_chunks`` is not given: as many as keep the buffers read ahead
    and held (``BUDGET_BUFFERS``) within ``budget`` bytes, between 2 and ``MAX_BLOCK_CHUNKS`` -- or 1 where
    no block holds more than one sample (one step per chunk with a window: the chunk order is a global
    shuffle already, and a buffer of 2 blocks of a 0.25-degree field is 665 MB). Where windows or tiles
    along a split dim spill into later buffers, the boxes passed on to them (``halo``: up to
    ``HALO_HELD_BUFFERS`` buffers of slots) share the budget too. With ``ds``, the Dataset the variables
    are read from, the bytes are those of all its variables on the split dims (``dataset_unit_nbytes``):
    the count, and so the order, is not the read variables' (SPEC §4: the order depends on the manifest)."""
    per = max(1, unit_nbytes(space, layouts), dataset_unit_nbytes(space, ds) if ds is not None else 0)
    size = space.unit_size
    least = 1 if (size if size is not None else int(np.max(space.counts, initial=0))) <= 1 else 2
    return int(min(MAX_BLOCK_CHUNKS, max(least, budget // (buffers_held(space) * per))))


def budget_note(space: SampleSpace, nbytes: int, budget: int, batch_size: int, block_chunks: int) -> str:
    """How buffers of ``nbytes`` each (``block_chunks`` chunk blocks, the default) stand to the byte ``budget``,
    in words: within it, over it where the least a buffer holds is (``buffers_held`` of them), or over it
    where a batch of ``batch_size`` draws from more buffers (it holds them all, and one more is read ahead)."""
    held = buffers_held(space)
    if held * nbytes > budget:
        more = held - BUDGET_BUFFERS
        spill = f", with up to {more} more of what windows spill into," if more else ""
        why = (f"the least a buffer holds: the {BUDGET_BUFFERS} buffers read ahead and held{spill} take "
               f"~{fmt_bytes(held * nbytes)}, more than the budget of {fmt_bytes(budget)}")
    else:
        why = f"within a budget of {fmt_bytes(budget)} for the buffers held"
    spans = -(-(batch_size - 1) * space.n_units // max(1, block_chunks * space.n_samples)) + 1
    if (spans + 1) * nbytes > max(budget, held * nbytes):
        why = (f"a batch of {batch_size} draws from up to {spans} buffers: ~{fmt_bytes((spans + 1) * nbytes)} held, "
               f"more than the budget of {fmt_bytes(budget)}")
    return why


def buffers_held(space: SampleSpace) -> int:
    """Buffers' worth of memory the byte budget is shared by: those read ahead and held
    (``BUDGET_BUFFERS``), and where windows or tiles along a split dim spill into later buffers, the
    boxes passed on to them (``HALO_HELD_BUFFERS``)."""
    return BUDGET_BUFFERS + (HALO_HELD_BUFFERS if any(d.width > 1 for d in space.split_dims) else 0)


@dataclass
class Buffer:
    """Buffer ``j`` of an epoch, loaded: per-variable buffers and its samples in yield order."""

    j: int
    ids: np.ndarray  # global sample ids, in yield order
    slot: np.ndarray  # slot of each sample (yield order)
    starts: np.ndarray  # (n, sampled dims) start positions (yield order)
    origin: np.ndarray  # (slots, split dims) first position held by each slot
    arrays: dict[str, np.ndarray]
    # variables gathered straight from a cache slab: arrays[name] is the slab, rows[name] its row per slot
    rows: dict[str, np.ndarray] = field(default_factory=dict)
    # variables whose arrays are in device memory (decoded on the GPU: ``BufferLoader.gpu``)
    on_device: frozenset[str] = frozenset()


class BufferLoader:
    """Reads buffers and gathers batches from them."""

    def __init__(self, space: SampleSpace, layouts: dict[str, VarLayout], reader: Reader,
                 gpu: Any = None, on_gpu: dict[str, GpuChain] | None = None, tier: Any = None,
                 follow_verdicts: bool = False):
        self.space = space
        self.layouts = layouts
        self.reader = reader
        self.n_split = len(space.split_dims)
        self._static: asyncio.Future[dict[str, np.ndarray]] | None = None
        # buffer arrays, given back by recycle: per shape and dtype, as many as the buffers an epoch may hold
        # at once use (they are the arrays made: a pool holds no more than the most in use at once, within the
        # byte budget); 4 a shape left each buffer of a weather model's 6 level variables making 2 anew, each
        # page faulted in (15-20 % of an epoch at 1 degree)
        same = Counter((lay.src.shape, lay.src.raw_dtype) for lay in layouts.values())
        self._pool = ArrayPool(keep=max(same.values(), default=1) * (MAX_READ_AHEAD_BUFFERS + 2))
        self._inverses: dict[str, tuple[int, ...]] = {}
        self._unit_slots: dict[tuple[int, int, int], tuple[np.ndarray, list[int], np.ndarray]] = {}
        self._whole: dict[tuple[str, int, int, int], tuple[int, ...] | None] = {}
        # the GPU path (SPEC §4 "GPU"): variables whose chunks decode on the device (``on_gpu``: their
        # ``GpuChain``), into device buffers (``gpu``: ``codecs.gpu.CupyGpu`` or its stand-in), with a
        # device cache tier (``tier``) where the cache has one; ``follow_verdicts`` (decode="auto"): a chain
        # whose first buffer decoded faster by the CPU path (``gpu.verdicts``) leaves the GPU from then on
        self.gpu, self.on_gpu, self.tier = gpu, dict(on_gpu or {}), tier
        self.follow_verdicts = follow_verdicts
        self._gather_ok: bool | None = None  # the device's gather passed its check on first use

    # ------------------------------------------------------------------ reading
    async def load_static(self) -> dict[str, np.ndarray]:
        """Variables without a split dim: read whole, once per generator (buffers loading at once
        share the one read in progress)."""
        got = self._static
        if got is not None and got.done() and not got.cancelled() and got.exception() is None:
            return got.result()  # read already: no shield (a future and callbacks) per buffer
        if got is None or got.done():
            got = self._static = asyncio.ensure_future(self._read_static())
        # shielded: a buffer load cancelled while waiting leaves the shared read to the others
        return await asyncio.shield(got)

    async def _read_static(self) -> dict[str, np.ndarray]:
        static = {n: lay for n, lay in self.layouts.items() if lay.static}
        arrs = await asyncio.gather(*(self.reader.read(lay.src, {}) for lay in static.values()))
        return {n: np.transpose(a, lay.order)[None] for (n, lay), a in zip(static.items(), arrs, strict=True)}

    def _slots(self, plan: EpochPlan, j: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """Buffer ``j``'s sample starts per slot, and the region each slot holds: its unit from the
        first position (``origin``) to the end of the last window or tile (``end``, halo included)."""
        sl = plan.buffer_pieces(j)
        units, lo, hi = plan.units[sl], plan.lo[sl], plan.hi[sl]
        tables, origins, ends = [], [], []
        for u, a, b in zip(units.tolist(), lo.tolist(), hi.tolist(), strict=True):
            st, o, e = self._unit_slot(u, a, b)
            tables.append(st)
            origins.append(o)
            ends.append(e)
        origin = np.array(origins, dtype=np.int64).reshape(len(units), self.n_split)
        end = np.array(ends, dtype=np.int64).reshape(len(units), self.n_split)
        return tables, origin, end

    def _unit_slot(self, u: int, a: int, b: int) -> tuple[np.ndarray, list[int], np.ndarray]:
        """Unit ``u``'s sample starts ``a..b``, its first position and the end of its region: index
        math on the unit alone, kept across buffers and epochs (one-chunk units pay it per chunk)."""
        key = (u, a, b)
        got = self._unit_slots.get(key)
        if got is not None:
            return got
        sp = self.space
        widths = np.array([d.width for d in sp.split_dims], dtype=np.int64)
        st = sp.unit_starts(u)[a:b]
        coords = np.unravel_index(int(sp.blocks[u]), sp.grid)
        origin = [int(sp.edges[k][c]) for k, c in enumerate(coords)]
        block_end = np.array([sp.edges[k][c + 1] for k, c in enumerate(coords)], dtype=np.int64)
        end = np.maximum(block_end, (st[:, : self.n_split] + widths).max(axis=0)) if len(st) else block_end
        if len(self._unit_slots) >= UNIT_SLOTS:
            self._unit_slots.clear()
        got = self._unit_slots[key] = (st, origin, end)
        return got

    async def load(self, plan: EpochPlan, j: int, halo: HaloPlan | None = None) -> Buffer:
        """Read every chunk of buffer ``j`` once (all variables, all units concurrently); with ``halo``,
        take what an earlier buffer passes on instead of reading it again, and pass on what later
        buffers need."""
        sp = self.space
        sl = plan.buffer_pieces(j)
        units, lo, hi = plan.units[sl], plan.lo[sl], plan.hi[sl]
        tables, origin, end = self._slots(plan, j)
        extent = (end - origin).max(axis=0) if len(units) else np.zeros(self.n_split, np.int64)
        base_starts = np.concatenate(tables) if tables else np.zeros((0, len(sp.dims)), np.int64)
        base_slot = np.repeat(np.arange(len(units), dtype=np.int64), hi - lo)
        base_ids = piece_ids(sp.offsets, units, lo, hi)
        perm = plan.buffer_perm(j, len(base_ids))
        # each slot's region along the split dims (the same for every variable that has them all)
        ol, el = origin.tolist(), end.tolist()
        regions = [{d.name: (ol[s][k], el[s][k]) for k, d in enumerate(sp.split_dims)} for s in range(len(units))]
        arrays = {}
        jobs: list[Any] = []
        step = None if halo is None else halo.step(j)
        keys = list(zip(units.tolist(), lo.tolist(), hi.tolist(), strict=True))  # what makes a slot's region
        slabbed: list[tuple[str, int]] = []  # (variable, its job) where the cache may hold every chunk
        on_device: list[str] = []
        uploads: list[str] = []  # of those, read on the host (then copied to the device)
        gpu_reads: list[tuple[str, VarLayout, GpuChain, list[tuple[int, ...]], list[Region]]] = []
        for name, lay in self.layouts.items():
            if lay.static:
                continue
            vstep = step if self._passes(lay) else None  # (a variable lacking a split dim reads its whole region)
            shape = [len(units)] + [self._axis_len(lay, ax, extent) for ax in lay.order]
            chain = self.gpu_chain(name)  # (one look: the prefetch thread may clear it, see ``_first_gather``)
            if chain is not None:
                on_device.append(name)
                mine = self._regions_of(lay, regions)
                whole = None if vstep is not None else self._whole_chunks(
                    name, lay, shape, self._inverse(name, lay), keys, mine)
                if whole is not None:  # decoded on the GPU straight into a device buffer
                    arrays[name] = self.gpu.empty(shape, lay.src.raw_dtype)
                    if chain.gpu:  # every such variable of the buffer in one batch (below)
                        gpu_reads.append((name, lay, chain, whole, mine))
                    else:
                        jobs.append(self._read_kept(name, lay, whole, arrays, on_device, mine))
                    continue
                # a buffer whose slots are not whole chunks (a partial chunk at the end): read on the
                # host as any, then copied to the device (below)
                uploads.append(name)
            buf = self._pool.take(shape, lay.src.raw_dtype)
            arrays[name] = buf
            reads = []
            inv = self._inverse(name, lay)
            mine = self._regions_of(lay, regions)
            whole = self._whole_chunks(name, lay, shape, inv, keys, mine) if vstep is None else None
            if whole is not None:  # each slot is one whole chunk: gathered from the cache's slab, or read
                slabbed.append((name, len(jobs)))
                jobs.append(self._cached_then_read(lay, whole, buf, mine))
                continue
            for s in range(len(units)):
                region = mine[s]
                view = self._slot_view(lay, buf, s, region, inv)
                if vstep is None:
                    reads.append((region, view))
                    continue
                for box_lo, box_hi, got in vstep.segments[s]:
                    if got is None:  # read here (else copied from what an earlier buffer passes on, below)
                        reads.append((vstep.region(box_lo, box_hi), vstep.piece(lay, view, box_lo, box_hi, ol[s])))
            if vstep is not None:
                for key, (box_lo, box_hi) in vstep.give.items():
                    held = vstep.held.setdefault(key, {})[name] = vstep.held_array(lay, box_lo, box_hi)
                    reads.append((vstep.region(box_lo, box_hi), held))
            jobs.append(self.reader.read_many(lay.src, reads))
        if gpu_reads:
            jobs.append(self._read_gpu(gpu_reads, arrays, on_device))
        rows: dict[str, np.ndarray] = {}
        try:
            done = await asyncio.gather(*jobs)
            for name, k in slabbed:
                if done[k] is not None:
                    self._pool.give_back(arrays[name])
                    arrays[name], rows[name] = done[k]
            if step is not None:
                await step.take(arrays, origin, self._inverses, self.layouts)
            if uploads:
                await asyncio.get_running_loop().run_in_executor(None, self._to_device, arrays, uploads)
        except BaseException as e:
            if step is not None:
                step.fail(e)
            raise
        if step is not None:
            step.done()
        arrays.update(await self.load_static())
        return Buffer(j, base_ids[perm], base_slot[perm], base_starts[perm], origin, arrays, rows,
                      frozenset(on_device))

    def gpu_chain(self, name: str) -> GpuChain | None:
        """Variable ``name``'s chain where its chunks go to the device, else None (``chain_on_gpu``)."""
        return chain_on_gpu(self.on_gpu, name, self.gpu, self.follow_verdicts)

    async def _read_gpu(self, reads: list[tuple[str, VarLayout, GpuChain, list[tuple[int, ...]], list[Region]]],
                        arrays: dict[str, Any], on_device: list[str]) -> None:
        """The GPU variables' buffers of whole chunks, decoded on the device together (``Reader.read_gpu``:
        one batch for the buffer). A variable whose chain fails its check on first use says so once, and
        its chunks are read and decoded on the host from then on (this buffer's too)."""
        failed = await self.reader.read_gpu(
            [GpuRead(lay.src, coords, [arrays[name][s] for s in range(len(coords))], chain, arrays[name])
             for name, lay, chain, coords, _ in reads], self.gpu, self.tier)
        again = []
        for name, lay, _, coords, regions in reads:
            e = failed.get(name)
            if e is None:
                continue
            leave_gpu(self.on_gpu, name, e)
            again.append(self._on_host(name, lay, len(coords), arrays, on_device, regions))
        await asyncio.gather(*again)

    async def _read_kept(self, name: str, lay: VarLayout, coords: list[tuple[int, ...]], arrays: dict[str, Any],
                         on_device: list[str], regions: list[Region]) -> None:
        """A variable decoded on the host whose chunks a device cache tier keeps (``ChunkCache(device=)``):
        its buffer of whole chunks copied there (``Reader.read_kept``). Where that fails its check on first
        use, it says so once, and the variable is read on the host from then on (this buffer's too)."""
        dev = arrays[name]
        try:
            await self.reader.read_kept(lay.src, coords, [dev[s] for s in range(len(coords))], regions,
                                        self.gpu, self.tier, dev)
            return
        except GpuPathError as e:
            if self.on_gpu.pop(name, None) is not None:
                warnings.warn(f"xinsitu: keeping variable {name!r} in GPU memory failed its check on first use "
                              f"({e}); it is read on the host from now on", RuntimeWarning, stacklevel=2)
        await self._on_host(name, lay, len(coords), arrays, on_device, regions)

    async def _on_host(self, name: str, lay: VarLayout, n: int, arrays: dict[str, Any], on_device: list[str],
                       regions: list[Region]) -> None:
        """A variable's buffer read on the host after all (its device buffer given back)."""
        dev = arrays[name]
        self.gpu.give_back(dev)
        buf = arrays[name] = self._pool.take(list(dev.shape), lay.src.raw_dtype)
        on_device.remove(name)
        await self.reader.read_many(lay.src, [(regions[s], buf[s]) for s in range(n)])

    def device_reason(self, name: str) -> str | None:
        """Why variable ``name``'s buffers cannot be decoded on the GPU straight into device memory
        (each slot must be one whole chunk, in the chunk's layout), None where they can: judged on
        the split's first unit (a partial chunk at the end is read on the host, then copied over)."""
        lay, sp = self.layouts[name], self.space
        if lay.static:
            return "no split dim: read once, on the host"
        if not sp.n_units:
            return "no samples"
        if any(d.width > 1 for d in sp.split_dims):
            return f"samples span chunk blocks along {[d.name for d in sp.split_dims if d.width > 1]}"
        _, origin, end = self._unit_slot(0, 0, 1)
        extent = np.asarray(end, np.int64) - np.asarray(origin, np.int64)
        shape = [self._axis_len(lay, ax, extent) for ax in lay.order]
        region = self._regions_of(lay, [{d.name: (int(origin[k]), int(end[k])) for k, d in enumerate(sp.split_dims)}])
        if (self._inverse(name, lay) != tuple(range(len(lay.order))) or tuple(shape) != tuple(lay.src.chunk_shape)
                or self.reader.whole_chunk(lay.src, region[0]) is None):
            return f"a buffer slot is not one whole chunk (slot {tuple(shape)}, chunks {tuple(lay.src.chunk_shape)})"
        return None

    def _regions_of(self, lay: VarLayout, regions: list[Region]) -> list[Region]:
        """Each slot's region, cut to the split dims variable ``lay`` has."""
        if all(d.name in lay.src.dims for d in self.space.split_dims):
            return regions
        return [{d: r for d, r in reg.items() if d in lay.src.dims} for reg in regions]

    def _to_device(self, arrays: dict[str, Any], names: list[str]) -> None:
        """GPU variables' buffers read on the host (slots that are not whole chunks) copied to the device."""
        for n in names:
            host = arrays[n]
            arrays[n] = self.gpu.asarray(host)
            self._pool.give_back(host)

    def _whole_chunks(self, name: str, lay: VarLayout, shape: list[int], inv: tuple[int, ...],
                      keys: list[tuple[int, int, int]],
                      regions: list[dict[str, tuple[int, int]]]) -> list[tuple[int, ...]] | None:
        """The chunk each slot of a variable's buffer is, whole, where every slot is exactly one chunk
        in the chunk's own layout (``Reader.whole_chunk``), else None. Kept per (variable, unit, samples)."""
        if inv != tuple(range(len(inv))) or tuple(shape[1:]) != tuple(lay.src.chunk_shape):
            return None
        known = self._whole
        coords: list[tuple[int, ...]] = []
        for k, region in zip(keys, regions, strict=True):
            key = (name, *k)
            if key in known:
                c = known[key]
            else:
                c = known[key] = self.reader.whole_chunk(lay.src, region)
            if c is None:
                return None
            coords.append(c)
        if len(known) >= UNIT_SLOTS:
            known.clear()
        return coords

    async def _cached_then_read(self, lay: VarLayout, coords: list[tuple[int, ...]], buf: np.ndarray,
                                regions: list[dict[str, tuple[int, int]]]) -> tuple[np.ndarray, np.ndarray] | None:
        """Whole-chunk slots: ``(slab, rows)`` where the cache holds them all in one slab (nothing is
        copied); else what it holds copied into ``buf`` at once, the rest decoded straight into their
        slots (``Reader.read_whole``), and None."""
        rest, slab = await self.reader.take_cached(lay.src, coords, buf)
        if rest:
            await self.reader.read_whole(lay.src, [coords[s] for s in rest], [buf[s] for s in rest],
                                         [regions[s] for s in rest])
        return slab

    @functools.cached_property
    def passes_halo(self) -> bool:
        """Whether buffers pass on what windows or tiles spill into (``halo_plan``): those of the variables
        that have every split dim (``_passes``)."""
        return self.space.spills and any(self._passes(lay) for lay in self.layouts.values())

    def _passes(self, lay: VarLayout) -> bool:
        """Whether the halo passes on a variable's chunks: it has every split dim (one that lacks one reads
        its slots' whole regions, its chunks again where a window spills)."""
        return not lay.static and all(d.name in lay.src.dims for d in self.space.split_dims)

    def halo_plan(self, plan: EpochPlan, first: int, ahead: int = HALO_BUFFERS) -> HaloPlan | None:
        """Where windows or tiles spill over split dims into neighbouring units: which buffer passes
        which boxes of a unit on to which later one, up to ``ahead`` buffers later (None where nothing
        spills, or where no variable has every split dim; one that lacks one reads its chunks again)."""
        if not self.passes_halo:
            return None
        for name, lay in self.layouts.items():
            self._inverse(name, lay)  # (made here: the halo's copies use them in a thread)
        return HaloPlan(self.space, plan, first, ahead, lambda j: self._slots(plan, j)[1:])

    def _axis_len(self, lay: VarLayout, ax: int, extent: np.ndarray) -> int:
        dim = lay.src.dims[ax]
        for k, d in enumerate(self.space.split_dims):
            if d.name == dim:
                return int(extent[k])
        return lay.src.shape[ax]

    def _inverse(self, name: str, lay: VarLayout) -> tuple[int, ...]:
        """The permutation from a variable's buffer layout back to its own dim order (made once)."""
        got = self._inverses.get(name)
        if got is None:
            got = self._inverses[name] = tuple(int(i) for i in np.argsort(lay.order))
        return got

    @staticmethod
    def _slot_view(lay: VarLayout, buf: np.ndarray, s: int, region: dict[str, tuple[int, int]],
                   inv: tuple[int, ...] | None = None) -> np.ndarray:
        """Slot ``s`` of ``buf`` seen in the variable's dim order, cut to ``region``'s extent."""
        view = buf[s].transpose(inv if inv is not None else tuple(np.argsort(lay.order)))
        return view[tuple(slice(0, region[d][1] - region[d][0]) if d in region else slice(None)
                          for d in lay.src.dims)]

    # ------------------------------------------------------------------ buffers
    def recycle(self, buffer: Buffer) -> None:
        """Give a buffer's arrays back once no batch will be gathered from it again."""
        for name, arr in buffer.arrays.items():
            if name in buffer.on_device:
                self.gpu.give_back(arr)
                continue
            if not self.layouts[name].static and name not in buffer.rows:  # a slab is the cache's
                self._pool.give_back(arr)

    # ------------------------------------------------------------------ gathering
    def gather(self, buffer: Buffer, rows: np.ndarray,
               into: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Raw values of samples ``rows`` (positions in the buffer's yield order), per variable;
        written into ``into[var]`` (e.g. a channel of a stacked batch) where given."""
        slot = buffer.slot[rows]
        st = buffer.starts[rows]
        if buffer.on_device and self._gather_ok is False:
            self._to_host(buffer)
        out = {}
        shares: list[Any] = []  # big gathers into place: in row shares, on every core (below)
        for name, lay in self.layouts.items():
            buf = buffer.arrays[name]
            if not lay.has_sample_axis:
                out[name] = buf[0].transpose(np.argsort(lay.order))
                continue
            if name in buffer.on_device and not self._gather_ok:
                out[name] = self._first_gather(buffer, name, slot, st)
                continue
            dest = None if into is None else into.get(name)
            if dest is not None and name not in buffer.on_device and dest.nbytes >= PARALLEL_GATHER_BYTES:
                out[name] = dest
                step = max(1, -(-len(slot) * SHARE_BYTES // dest.nbytes))
                for a in range(0, len(slot), step):
                    r = slice(a, a + step)
                    shares.append(functools.partial(self._gather_var, lay, buf, slot[r], st[r], buffer.origin,
                                                    dest[r], buffer.rows.get(name)))
                continue
            out[name] = self._gather_var(lay, buf, slot, st, buffer.origin, dest,
                                         buffer.rows.get(name), self.gpu if name in buffer.on_device else None)
        _loop.in_parallel(shares)
        return out

    def _first_gather(self, buffer: Buffer, name: str, slot: np.ndarray, st: np.ndarray) -> Any:
        """The device's first gather, checked bit for bit against the host's from the same buffer;
        where they differ (or the device's fails), said once, and the GPU path gives way: buffers
        on the device come back to the host, and buffers are read and decoded on the host from then on."""
        lay, gpu = self.layouts[name], self.gpu
        host = gpu.to_host(buffer.arrays[name])
        ref = self._gather_var(lay, host, slot, st, buffer.origin)
        try:
            got = self._gather_var(lay, buffer.arrays[name], slot, st, buffer.origin, dev=gpu)
            back = gpu.to_host(got)
            if back.dtype != ref.dtype or back.shape != ref.shape or back.tobytes() != ref.tobytes():
                raise ValueError(f"variable {name!r} gathered on the device differs from the host's gather")
            self._gather_ok = True
            return got
        except Exception as e:  # noqa: BLE001 - said, and the host takes over
            warnings.warn(f"xinsitu: gathering batches on the GPU failed its check on first use ({type(e).__name__}: "
                          f"{e}); chunks are read, decoded and gathered on the host from then on", RuntimeWarning,
                          stacklevel=3)
            self._gather_ok = False
            self.on_gpu.clear()
            self._to_host(buffer)
            return ref

    def _to_host(self, buffer: Buffer) -> None:
        """A buffer's device arrays copied to the host (the GPU path gave way)."""
        for name in buffer.on_device:
            buffer.arrays[name] = self.gpu.to_host(buffer.arrays[name])
        buffer.on_device = frozenset()

    def _gather_var(self, lay: VarLayout, buf: np.ndarray, slot: np.ndarray, st: np.ndarray,
                    origin: np.ndarray, into: np.ndarray | None = None,
                    rows: np.ndarray | None = None, dev: Any = None) -> np.ndarray:
        """``rows``: ``buf`` is a cache slab and slot ``s`` is its row ``rows[s]``; ``dev``: ``buf`` is in
        device memory (the GPU path's side): the index math is done here, the take on the device."""
        sp = self.space
        n = len(slot)
        kept = [k for k in lay.sampled if sp.dims[k].keep]
        nk = len(kept)
        slot_idx = np.zeros(n, np.int64) if lay.static else slot
        local = []
        for k in lay.sampled:
            pos = st[:, k] - (origin[slot_idx, k] if sp.dims[k].split else 0)
            local.append(pos)
        if rows is not None:  # slots are rows of a cache slab
            slot_idx = rows[slot_idx]
        # samples at least this big are copied one by one (below)
        big = ROW_COPY_BYTES if into is None or into.flags.c_contiguous else ROW_COPY_SLICE_BYTES
        # fast path: one position-only sampled dim first in a contiguous buffer -> a single np.take
        if len(lay.sampled) == 1 and nk == 0 and buf.flags.c_contiguous:
            flat = buf.reshape(buf.shape[0] * buf.shape[1], *buf.shape[2:])
            if dev is not None:
                return dev.xp.take(flat, dev.index(slot_idx * buf.shape[1] + local[0]), axis=0)
            at = slot_idx * buf.shape[1] + local[0]
            if row_nbytes(flat) >= big:  # big samples: a plain copy each (np.take is slower on big rows)
                res = into if into is not None else np.empty((n, *flat.shape[1:]), flat.dtype)
                for k, i in enumerate(at.tolist()):
                    np.copyto(res[k], flat[i])
                return res
            # indices are in range by construction: mode="clip" lets numpy write into `into` unbuffered
            return np.take(flat, at, axis=0, out=into, mode="clip")
        if len(lay.sampled) == 1 and nk == 1 and dev is None and buf.flags.c_contiguous:
            # one window or tile along the buffer's first axis: each sample is one block of the buffer; big
            # ones a plain copy each, straight into place (fancy indexing makes a temporary, then copied into a
            # stacked batch: 1-degree shape, window 2, 11.4 vs 12.6-13.2 GB/s)
            w = sp.dims[lay.sampled[0]].width
            if w * row_nbytes(buf[0]) >= big:
                q = None if lay.out_perm is None else tuple(p - 1 for p in lay.out_perm[1:])
                block = (w, *buf.shape[2:])
                res = into if into is not None else np.empty(
                    (n, *(block if q is None else [block[i] for i in q])), buf.dtype)
                for k, (s, p) in enumerate(zip(slot_idx.tolist(), local[0].tolist(), strict=True)):
                    np.copyto(res[k], buf[s, p:p + w] if q is None else buf[s, p:p + w].transpose(q))
                return res
        idx: list[Any] = [slot_idx.reshape((n,) + (1,) * nk)]
        for k, pos in zip(lay.sampled, local, strict=True):
            shape = [n] + [1] * nk
            if sp.dims[k].keep:
                at = kept.index(k) + 1
                w = sp.dims[k].width
                shape[at] = w
                ar = np.arange(w, dtype=np.int64).reshape([1] + [w if i == at else 1 for i in range(1, nk + 1)])
                idx.append(pos.reshape([n] + [1] * nk) + ar)
            else:
                idx.append(pos.reshape([n] + [1] * nk))
        xp = np if dev is None else dev.xp
        res = buf[tuple(idx) if dev is None else tuple(dev.index(i) for i in idx)]
        if lay.out_perm is not None:
            res = xp.ascontiguousarray(res.transpose(lay.out_perm))
        if into is not None:  # (never on the device: a stacked batch is gathered into only on the host)
            into[...] = res
            return into
        return res


def row_nbytes(a: np.ndarray) -> int:
    """Bytes of one row ``a[0]`` of ``a``, by its shape (``a[0].nbytes`` of a 1-D array of strings is a
    ``str``'s, which has none)."""
    return int(np.prod(a.shape[1:], dtype=np.int64)) * a.dtype.itemsize
