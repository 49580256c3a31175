"""Batches filled in place, with no shuffle buffer: ``DirectLoader``.

Where every unit of a split (its chunk block) is one sample -- one position along each split dim,
no window, tile or ``over`` dim: one time step per chunk, as GRIB messages and ARCO-ERA5 keep them
-- the permutation of the units is already a global shuffle (SPEC §5), and a buffer of chunk blocks
would only add a copy. Each sample's chunks are then decoded straight into their place in the batch:
a variable's channel slice of the stacked array (``OutputBuilder.value_view``), or its row of the
variable's array. Variables whose raw values need work first (CF decoding, normalising, a cast to
``dtype=``) are decoded into a raw array of the batch and converted in one pass into place, in the
decode threads. Variables without a split dim are read once and copied (stacked) or handed out
read-only (per variable) in every batch.

The order of the samples is the plan's (``EpochPlan``): the same batches as the buffered path.

On the GPU path (SPEC §4 "GPU") the same shape is filled on the device (``DeviceDirectLoader``): a
sample's chunks decoded by nvCOMP straight into their place in a device batch, with no device buffer
and no gather.
"""

from __future__ import annotations

import asyncio
import warnings
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from xinsitu.batches.buffer import row_nbytes
from xinsitu.batches.output import OutputBuilder
from xinsitu.batches.pipeline import MAX_READ_AHEAD_BUFFERS
from xinsitu.codecs.gpu import chain_on_gpu
from xinsitu.codecs.gpu_chain import GpuChain, GpuPathError, leave_gpu
from xinsitu.index.plan import EpochPlan
from xinsitu.index.sampling import SampleSpace, VarLayout
from xinsitu.io.mempool import ArrayPool
from xinsitu.io.reader import GpuRead, Reader

#: a conversion into place is split into this many rows' worth of bytes per decode-thread job at least
CONVERT_JOB_BYTES = 4 << 20


@dataclass
class Filled:
    """Batch ``i`` of a plan, read into place: its sample ids, their start positions along the
    sampled dims, and its values (the stacked array, or ``{var: array}``)."""

    i: int
    ids: np.ndarray
    starts: np.ndarray
    values: Any


def direct_reason(space: SampleSpace, layouts: dict[str, VarLayout], builder: OutputBuilder) -> str | None:
    """Why batches of this sample space need a shuffle buffer (None: they do not, ``DirectLoader``)."""
    if space.free_dims:
        return f"several samples per chunk block (dims {[d.name for d in space.free_dims]} are sampled too)"
    if any(d.width > 1 for d in space.split_dims):
        return "windows span several positions"
    for e in space.edges:
        if len(e) > 1 and int(np.diff(e).max()) > 1:
            return "several samples per chunk block"
    for name, lay in layouts.items():
        if not lay.static and not all(d.name in lay.src.dims for d in space.split_dims):
            return f"variable {name!r} lacks a split dim"
        if not lay.static and any(d.name in lay.out_dims for d in space.split_dims):
            return "windows or tiles of one position keep a split dim in each sample"
        if lay.static and builder.stack and not set(builder.base_dims) <= set(lay.src.dims):
            return f"variable {name!r} is broadcast along dims it lacks"
    return None


class DirectLoader:
    """Reads the batches of a plan straight into place (see the module); the I/O loop's side of a
    ``pipeline.DirectRun``."""

    def __init__(self, space: SampleSpace, layouts: dict[str, VarLayout], reader: Reader, builder: OutputBuilder):
        self.space, self.layouts, self.reader, self.builder = space, layouts, reader, builder
        self.n_split = len(space.split_dims)
        # raw arrays of variables converted into place (dtype=, packed values), given back as each batch is
        # converted: as many a shape as the batches read at once use (2 left a weather model's 6 level variables
        # making 4 anew each batch, every page faulted in: 1.5k-5.7k faults an epoch at 0.25 degrees, float64)
        same = Counter((self._raw_shape(lay, 1), lay.src.raw_dtype) for name, lay in layouts.items()
                       if not lay.static and builder.converts(name))
        self._raw = ArrayPool(keep=max(same.values(), default=1) * (MAX_READ_AHEAD_BUFFERS + 2))
        self._static: asyncio.Future[dict[str, np.ndarray]] | None = None
        self._orders: deque[tuple[EpochPlan, int, np.ndarray]] = deque(maxlen=4)  # (plan, block, its order)
        # a variable's batch layout (sample, *output dims) -> its own dim order (split dims of length 1)
        self._to_var: dict[str, tuple[int, ...]] = {}
        for name, lay in layouts.items():
            if lay.static:
                continue
            have = [d.name for d in space.split_dims] + list(lay.out_dims)
            self._to_var[name] = tuple(have.index(d) for d in lay.src.dims)

    # ------------------------------------------------------------------ which samples
    def batch_ids(self, plan: EpochPlan, i: int) -> np.ndarray:
        """Global sample ids of batch ``i`` of ``plan``, in the order it yields them."""
        a, b = plan.batch_span(i)
        parts = []
        for j in plan.buffers_of(a, b):
            off = int(plan.buffer_offsets[j])
            ids = self._buffer_order(plan, j)
            parts.append(ids[max(a, off) - off:min(b, int(plan.buffer_offsets[j + 1])) - off])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _buffer_order(self, plan: EpochPlan, j: int) -> np.ndarray:
        """``plan.buffer_order(j)``, kept for the next batch: where batches and blocks do not line up, a
        block holds the end of one batch and the start of the next, and its order (a permutation drawn on
        the I/O loop, which the decode threads wait on for the GIL) is made once, not twice."""
        for p, k, ids in self._orders:
            if p is plan and k == j:
                return ids
        ids = plan.buffer_order(j, self.space.offsets)
        self._orders.append((plan, j, ids))
        return ids

    def starts_of(self, ids: np.ndarray) -> np.ndarray:
        """Each sample's position along the split dims, shape (n, split dims)."""
        sp = self.space
        units, _ = sp.locate(ids)
        blocks = np.asarray(sp.blocks[units], dtype=np.int64)
        coords = np.unravel_index(blocks, sp.grid)
        return np.stack([sp.edges[k][c] for k, c in enumerate(coords)], axis=1).astype(np.int64)

    # ------------------------------------------------------------------ reading
    async def load(self, plan: EpochPlan, i: int) -> Filled:
        """Batch ``i`` of ``plan`` read into a new batch's arrays (every chunk once)."""
        ids = self.batch_ids(plan, i)
        starts = self.starts_of(ids)
        n = len(ids)
        b = self.builder
        batch = b.empty_batch(n)
        names = [d.name for d in self.space.split_dims]
        regions = [{d: (p, p + 1) for d, p in zip(names, row, strict=True)} for row in starts.tolist()]
        at = {d: starts[:, k] for k, d in enumerate(names)}
        raws = {}
        reads: list[tuple[VarLayout, list[np.ndarray]]] = []
        for name, lay in self.layouts.items():
            if lay.static:
                continue
            if b.converts(name):  # raw values first, converted into place below
                raws[name] = rows = self._take_raw(lay, n)
            else:
                rows = b.value_view(batch, name, slice(None))
                rows = rows.reshape(n, *([1] * self.n_split), *rows.shape[1:]) if self.n_split != 1 else rows[:, None]
            reads.append((lay, self._dests(name, rows)))
        await self._read_all(reads, at, regions)
        if raws:
            await self._convert(batch, raws)
        # given back only now: a load cancelled or failed may leave decode threads writing into them
        # (a cancelled await does not stop a thread), and another batch must never get one of those
        for raw in raws.values():
            self._raw.give_back(raw)
        static = await self._static_values()
        if isinstance(batch, dict):
            batch.update(static)
        elif static:
            for name, values in static.items():  # broadcast into the stacked batch's channels
                b.value_view(batch, name, slice(None))[...] = values
        return Filled(i, ids, starts, batch)

    def _dests(self, name: str, rows: np.ndarray) -> list[np.ndarray]:
        """Each sample's row of ``rows`` (sample, split dims of 1, *output dims) in variable ``name``'s own
        dim order: views, all of the same strides."""
        perm = self._to_var[name]
        if perm == tuple(range(len(perm))):
            return list(rows)
        return [r.transpose(perm) for r in rows]

    def _take_raw(self, lay: VarLayout, n: int) -> np.ndarray:
        """A raw array for ``n`` samples of a variable: (sample, split dims of 1, *output dims), its stored dtype."""
        return self._raw.take(self._raw_shape(lay, n), lay.src.raw_dtype)

    def _raw_shape(self, lay: VarLayout, n: int) -> tuple[int, ...]:
        return (n, *[1] * self.n_split, *[lay.src.shape[lay.src.dims.index(d)] for d in lay.out_dims])

    async def _read_all(self, reads: list[tuple[VarLayout, list[np.ndarray]]], at: dict[str, np.ndarray],
                        regions: list[dict[str, tuple[int, int]]]) -> None:
        """Variables' samples (at positions ``at`` along the split dims; as ``regions``) read into their
        ``dests`` (``_dests``): whole chunks decoded straight in, every variable's at once
        (``Reader.read_slots_many``: one hand-off to the decode threads), else as regions."""
        reader = self.reader
        slots: list[tuple[Any, list[tuple[int, ...]], list[np.ndarray]]] = []
        jobs: list[Any] = []
        for lay, dests in reads:
            coords = reader.whole_chunks(lay.src, at)
            if coords is not None and dests[0].flags.c_contiguous:  # (every dest has the same strides)
                slots.append((lay.src, list(map(tuple, coords.tolist())), dests))
            else:
                jobs.append(reader.read_many(lay.src, list(zip(regions, dests, strict=True))))
        if slots:
            jobs.append(reader.read_slots_many(slots, regions))
        await asyncio.gather(*jobs)

    async def _convert(self, batch: Any, raws: dict[str, np.ndarray]) -> None:
        """Raw values CF-decoded, normalised and cast into place, in the decode threads (rows in shares)."""
        jobs = []
        loop = asyncio.get_running_loop()
        for name, raw in raws.items():
            raw = raw.reshape(raw.shape[0], *raw.shape[1 + self.n_split:])  # (sample, *output dims)
            step = max(1, CONVERT_JOB_BYTES // max(1, row_nbytes(raw)))
            for a in range(0, len(raw), step):
                jobs.append(loop.run_in_executor(None, self._convert_rows, batch, name, raw, slice(a, a + step)))
        await asyncio.gather(*jobs)

    def _convert_rows(self, batch: Any, name: str, raw: np.ndarray, rows: slice) -> None:
        values = self.builder.decode({name: raw[rows]}, cast=False)[name]
        np.copyto(self.builder.value_view(batch, name, rows), values, casting="unsafe")

    async def _static_values(self) -> dict[str, np.ndarray]:
        """Variables without a split dim, read once: their output values (every batch hands out the same
        array, read-only: ``OutputBuilder.assemble``; a stacked batch copies them into its channels)."""
        got = self._static
        if got is None or (got.done() and (got.cancelled() or got.exception() is not None)):
            got = self._static = asyncio.ensure_future(self._read_static())
        return await asyncio.shield(got)

    async def _read_static(self) -> dict[str, np.ndarray]:
        static = {n: lay for n, lay in self.layouts.items() if lay.static}
        arrs = await asyncio.gather(*(self.reader.read(lay.src, {}) for lay in static.values()))
        return self.builder.decode(dict(zip(static, arrs, strict=True)), cast=not self.builder.stack)

    def recycle(self, item: Filled) -> None:
        """Nothing to give back: a batch's arrays are its own (``OutputBuilder.arrays`` takes them back
        once nothing holds them)."""

    def output(self, item: Filled) -> Any:
        """Batch ``item`` as the output's kind, on the host (``transform=`` and a device copy come after)."""
        return self.builder.assemble(item.values, item.starts)


class DeviceDirectLoader(DirectLoader):
    """``DirectLoader`` on the GPU path (SPEC §4 "GPU"): the batch is made in device memory and each
    sample's chunks are decoded on the device straight into their place in it -- a variable's channel
    slice of the stacked array, or its row -- with no device buffer and no gather: the chunks of every
    variable of the batch in one ``Reader.read_gpu`` (one transfer, one batched call per compressor).

    A variable whose raw values need work first (CF decoding, normalising, a cast), or whose place in the
    batch is not laid out as its chunk is, is decoded into a raw device array and converted on the device
    into place (``OutputBuilder.device_value``); the first batch's conversions are checked bit for bit
    against the host's, and where they differ, that is said once and they run on the host from then on.
    A variable on the CPU path (a codec chain nvCOMP cannot decode; with ``decode='auto'``, one whose first
    buffer decoded faster by the CPU path; one whose chain failed its check on first use) is read as
    ``DirectLoader`` reads it, converted on the host and copied over. ``on_gpu``: the variables whose chunks
    go to the device (``BufferLoader.on_gpu``, shared); ``tier``: the device cache tier, if any."""

    def __init__(self, space: SampleSpace, layouts: dict[str, VarLayout], reader: Reader, builder: OutputBuilder,
                 gpu: Any, on_gpu: dict[str, GpuChain], tier: Any = None, follow_verdicts: bool = False):
        super().__init__(space, layouts, reader, builder)
        self.gpu, self.on_gpu, self.tier, self.follow_verdicts = gpu, on_gpu, tier, follow_verdicts
        self._checked = False  # the first batch's conversions on the device were checked
        self._host_convert = False  # they failed that check: converted on the host from then on
        self._inv = {n: tuple(int(i) for i in np.argsort(p)) for n, p in self._to_var.items()}

    async def load(self, plan: EpochPlan, i: int) -> Filled:
        """Batch ``i`` of ``plan`` read into a new device batch (every chunk once)."""
        ids = self.batch_ids(plan, i)
        starts = self.starts_of(ids)
        n = len(ids)
        b, gpu, reader = self.builder, self.gpu, self.reader
        batch = b.device_empty_batch(n)
        names = [d.name for d in self.space.split_dims]
        regions = [{d: (p, p + 1) for d, p in zip(names, row, strict=True)} for row in starts.tolist()]
        at = {d: starts[:, k] for k, d in enumerate(names)}
        reads: list[tuple[str, GpuRead]] = []
        raws: dict[str, Any] = {}  # device raw arrays (n, *chunk shape) to convert into place
        hosts: dict[str, np.ndarray] = {}  # host raw arrays of variables read the CPU way
        jobs = []
        for name, lay in self.layouts.items():
            if lay.static:
                continue
            src = lay.src
            chain = chain_on_gpu(self.on_gpu, name, gpu, self.follow_verdicts)
            whole = reader.whole_chunks(src, at) if chain is not None else None
            if chain is None or whole is None:
                jobs.append(self._on_host(name, regions, hosts))
                continue
            coords = list(map(tuple, whole.tolist()))
            stack = None if b.converts(name) else self._in_place(batch, name, n)
            if stack is None:
                stack = raws[name] = gpu.new((n, *src.chunk_shape), src.raw_dtype)
            read = GpuRead(src, coords, [stack[k] for k in range(n)], chain, stack)  # type: ignore[arg-type]
            if chain.gpu:
                reads.append((name, read))
            else:  # decoded on the host, kept in the device tier
                jobs.append(self._kept(name, read, regions, raws, hosts))
        if reads:
            jobs.append(self._decode(reads, regions, raws, hosts))
        await asyncio.gather(*jobs)
        static = await self._static_values()
        await asyncio.get_running_loop().run_in_executor(None, self._convert_all, batch, n, raws, hosts, static)
        for raw in hosts.values():  # (only now: see ``DirectLoader.load``)
            self._raw.give_back(raw)
        return Filled(i, ids, starts, batch)

    def _in_place(self, batch: Any, name: str, n: int) -> Any:
        """Variable ``name``'s place in the device batch as ``(n, *chunk shape)``, each sample's row in the
        chunk's layout (decoded straight into), else None (it is not laid out as the chunk is)."""
        view = self.builder.value_view(batch, name, slice(None))
        view = view.reshape(n, *([1] * self.n_split), *view.shape[1:]) if self.n_split != 1 else view[:, None]
        stack = view.transpose(0, *[1 + p for p in self._to_var[name]])
        if not stack[0].flags.c_contiguous or tuple(stack.shape[1:]) != tuple(self.layouts[name].src.chunk_shape):
            return None
        return stack

    async def _on_host(self, name: str, regions: list[dict[str, tuple[int, int]]],
                       hosts: dict[str, np.ndarray]) -> None:
        """Variable ``name``'s samples read the CPU way into a host raw array (``DirectLoader._read_all``)."""
        lay = self.layouts[name]
        raw = hosts[name] = self._take_raw(lay, len(regions))
        at = {d.name: np.array([r[d.name][0] for r in regions], dtype=np.int64) for d in self.space.split_dims}
        await self._read_all([(lay, self._dests(name, raw))], at, regions)

    async def _decode(self, reads: list[tuple[str, GpuRead]], regions: list[dict[str, tuple[int, int]]],
                      raws: dict[str, Any], hosts: dict[str, np.ndarray]) -> None:
        """The GPU variables' chunks decoded on the device together; a variable whose chain fails its check
        on first use says so once, and is read the CPU way from then on (this batch's too)."""
        failed = await self.reader.read_gpu([r for _, r in reads], self.gpu, self.tier)
        again = []
        for name, _ in reads:
            e = failed.get(name)
            if e is None:
                continue
            leave_gpu(self.on_gpu, name, e)
            raws.pop(name, None)
            again.append(self._on_host(name, regions, hosts))
        await asyncio.gather(*again)

    async def _kept(self, name: str, read: GpuRead, regions: list[dict[str, tuple[int, int]]],
                    raws: dict[str, Any], hosts: dict[str, np.ndarray]) -> None:
        """A variable decoded on the host whose chunks the device cache tier keeps (``Reader.read_kept``)."""
        try:
            await self.reader.read_kept(read.src, read.coords, read.outs, regions, self.gpu, self.tier, read.stack)
            return
        except GpuPathError as e:
            if self.on_gpu.pop(name, None) is not None:
                warnings.warn(f"xinsitu: keeping variable {name!r} in GPU memory failed its check on first use "
                              f"({e}); it is read on the host from now on", RuntimeWarning, stacklevel=2)
        raws.pop(name, None)
        await self._on_host(name, regions, hosts)

    def _convert_all(self, batch: Any, n: int, raws: dict[str, Any], hosts: dict[str, np.ndarray],
                     static: dict[str, np.ndarray]) -> None:
        """In a decode thread: the raw device arrays converted into place on the device (on the first batch
        checked against the host), the host ones on the host and copied over, the variables without a split
        dim copied in; the device's work done when it returns."""
        b, gpu = self.builder, self.gpu
        xp = gpu.xp
        for name, raw in raws.items():
            have = raw.transpose(0, *[1 + k for k in self._inv[name]])  # (n, split dims of 1, *output dims)
            have = have.reshape(n, *have.shape[1 + self.n_split:])
            view = b.value_view(batch, name, slice(None))
            if self._host_convert:
                xp.copyto(view, gpu.asarray(self._host_values(name, gpu.to_host(have), view.dtype)), casting="unsafe")
                continue
            xp.copyto(view, b.device_value(name, have), casting="unsafe")
            if not self._checked:
                ref = self._host_values(name, gpu.to_host(have), view.dtype)
                got = np.ascontiguousarray(gpu.to_host(view))
                if got.shape != ref.shape or got.tobytes() != ref.tobytes():
                    warnings.warn(f"xinsitu: converting variable {name!r} (CF decoding, normalising, casting) on the "
                                  "GPU failed its check on the first batch; it runs on the host from now on",
                                  RuntimeWarning, stacklevel=2)
                    self._host_convert = True
                    xp.copyto(view, gpu.asarray(ref), casting="unsafe")
        if raws:
            self._checked = True
        for name, raw in hosts.items():
            view = b.value_view(batch, name, slice(None))
            host = raw.reshape(n, *raw.shape[1 + self.n_split:])
            xp.copyto(view, gpu.asarray(self._host_values(name, host, view.dtype)), casting="unsafe")
        for name, values in static.items():
            if isinstance(batch, dict):
                batch[name] = gpu.asarray(values)  # a fresh copy per batch: a batch owns its arrays
            else:
                b.value_view(batch, name, slice(None))[...] = gpu.asarray(values)
        gpu.synchronize()

    def _host_values(self, name: str, raw: np.ndarray, dtype: Any) -> np.ndarray:
        """A variable's raw host values as its output values, as ``DirectLoader`` converts them."""
        return np.asarray(self.builder.decode({name: raw}, cast=False)[name]).astype(dtype, copy=False)

    def output(self, item: Filled) -> Any:
        """Batch ``item`` (in device memory) as arrays of the output kind."""
        return self.builder.device_output(item.values)
