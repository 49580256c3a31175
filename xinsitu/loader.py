"""``BatchGenerator``: batches of one split, read in place.

Three parties work at once. The I/O loop reads shuffle blocks ahead (a few blocks in
flight, their chunk reads bounded by ``max_inflight``); a prefetch thread gathers
batches from loaded blocks into a small bounded queue; the caller's thread only takes
finished batches off that queue. Errors travel through the queues and are raised to the
caller; closing the iterator (or breaking out of the loop) stops both helpers.
"""

from __future__ import annotations

import asyncio
import math
import os
import queue
import sys
import threading
import time
import warnings
from typing import Any

import numpy as np
import xarray as xr

from xinsitu import _loop
from xinsitu import repr as _repr
from xinsitu import shuffle as _shuffle
from xinsitu.buffer import BlockLoader, VarLayout
from xinsitu.geometry import geometry_of
from xinsitu.output import OutputBuilder
from xinsitu.plan import EpochPlan, SampleDim, SampleSpace, epoch_plan, plan_head
from xinsitu.reader import Reader
from xinsitu.snapshot import snapshot_of_sources
from xinsitu.source import resolve
from xinsitu.split import SplitManifest, coord_span
from xinsitu.state import check_state, make_state

_END = object()
PREFETCH_BLOCKS = 3  # blocks read ahead or held: one being gathered from, one spanning, one loading
#: ... and at most this many where the store is far (enough blocks loading to fill ``max_inflight``)
MAX_PREFETCH_BLOCKS = 6
PREFETCH_BATCHES = 2


def _positive_int(name: str, v: Any) -> int:
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


def _dim_map(name: str, v: Any, sizes: dict[str, int]) -> dict[str, int]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise TypeError(f"{name} must be a dict of dim -> length, got {type(v).__name__}")
    out = {}
    for d, n in v.items():
        if d not in sizes:
            raise ValueError(f"{name}: unknown dim {d!r}; the variables have dims {sorted(sizes)}")
        n = _positive_int(f"{name}[{d!r}]", n)
        if n > sizes[d]:
            raise ValueError(f"{name}[{d!r}] = {n} is longer than dim {d!r} ({sizes[d]})")
        out[d] = n
    return out


def _dist_defaults(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        # only a process that imported torch.distributed can have initialised it: don't import
        # torch (~200 MB, ~1 s) just to learn that it hasn't
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
    world_size = 1 if world_size is None else _positive_int("world_size", world_size)
    rank = 0 if rank is None else int(rank)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return rank, world_size


class BatchGenerator:
    """Batches of one split of a Dataset, read in place (``ds.insitu.batches(...)`` makes one).

    Parameters
    ----------
    ds : xr.Dataset
        Opened by ``xinsitu.open_zarr``, ``xr.open_zarr`` (with or without dask), a subset of
        one, or in memory.
    manifest : SplitManifest
        The chunk-aligned split (``ds.insitu.split``).
    split : str
        The split to draw from.
    batch_size : int, default 32
    shuffle : bool, default True
        Permute the chunk blocks per ``(seed, epoch)`` and draw at random from a buffer of
        ``block_chunks`` blocks; False walks in split order.
    seed : int, default 0
    window : dict of str to int, optional
        ``{dim: k}``: each sample carries ``k`` consecutive positions (e.g. history + lead).
    patch : dict of str to int, optional
        ``{dim: size}``: tiles (xbatcher's ``input_dims``).
    stride : dict of str to int, optional
        Tile stride per patch dim (default: the patch size; xbatcher's
        ``input_overlap = patch - stride``).
    over : str or list of str, optional
        More dims whose positions are samples.
    variables : list of str, optional
        Default: the data variables on the split dim(s).
    output : {"xarray", "dataarray", "numpy", "torch", "cupy"}, default "xarray"
    stack : bool, default False
        One ``(sample, channel, ...)`` array per batch (see ``channels``).
    normalize : dict, optional
        Statistics from ``ds.insitu.stats`` (``m.stats``): ``(x - mean) / std`` per channel.
    device : str or torch.device, optional
        Where torch tensors go (e.g. ``"cuda:0"``).
    block_chunks : int, default 16
        Chunk blocks per shuffle block (memory ~ a few blocks).
    max_inflight : int, optional
        Chunk requests in flight at most. Default: sized from the store's latency, from 64
        (local disk) up to 256 (object stores; see ``xinsitu.reader.InflightLimit``).
    drop_last : bool, default False
    rank, world_size : int, optional
        Default: torch.distributed's when it is initialised, else 0 and 1.
    progress : bool, default False
        Show a tqdm progress bar.
    """

    def __init__(self, ds: xr.Dataset, manifest: SplitManifest, split: str, *, batch_size: int = 32,
                 shuffle: bool = True, seed: int = 0, window: dict[str, int] | None = None,
                 patch: dict[str, int] | None = None, stride: dict[str, int] | None = None,
                 over: str | list[str] | None = None, variables: list[str] | None = None,
                 output: str = "xarray", stack: bool = False, normalize: Any = None, device: Any = None,
                 block_chunks: int = 16, max_inflight: int | None = None, drop_last: bool = False,
                 rank: int | None = None, world_size: int | None = None, progress: bool = False):
        if not isinstance(manifest, SplitManifest):
            raise TypeError(f"manifest must be a SplitManifest (from ds.insitu.split), got {type(manifest).__name__}")
        if split not in manifest.splits:
            raise ValueError(f"unknown split {split!r}; the manifest has {list(manifest.splits)}")
        self.batch_size = _positive_int("batch_size", batch_size)
        self.block_chunks = _positive_int("block_chunks", block_chunks)
        self.max_inflight = None if max_inflight is None else _positive_int("max_inflight", max_inflight)
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
            raise TypeError(f"seed must be an integer, got {seed!r}")
        self.seed, self.shuffle, self.drop_last = int(seed), bool(shuffle), bool(drop_last)
        self.rank, self.world_size = _dist_defaults(rank, world_size)
        self.manifest, self.split, self.progress = manifest, split, bool(progress)
        if variables is None:
            variables = [v for v in ds.data_vars if any(d in ds[v].dims for d in manifest.dims)]
        elif isinstance(variables, str):
            variables = [variables]
        self.sources = resolve(ds, variables)
        self.geometry = geometry_of(self.sources)
        self._check_manifest(ds)
        self.space = self._sample_space(window, patch, stride, over)
        self.layouts = {n: VarLayout.build(s, self.space) for n, s in self.sources.items()}
        self.builder = OutputBuilder(ds, self.space, self.layouts, output, stack, device, normalize=normalize)
        self.normalize = normalize
        self.output = output
        self._ds = ds
        self.epoch = 0
        self._resume_batch = 0
        self._yielded = 0
        self._reader: Reader | None = None
        self._loader: BlockLoader | None = None
        self._pid = -1
        self._io: dict[str, Any] = {}

    # ------------------------------------------------------------------ set-up
    def _check_manifest(self, ds: xr.Dataset) -> None:
        m, g = self.manifest, self.geometry
        for d in m.dims:
            if d not in g.sizes:
                raise ValueError(f"manifest splits dim {d!r}, which the selected variables do not have")
            if g.sizes[d] != m.sizes[d]:
                raise ValueError(f"manifest was made on {d!r} of length {m.sizes[d]}, this dataset has {g.sizes[d]}")
            if not np.isin(np.asarray(m.edges[d]), g.edges[d]).all():
                raise ValueError(f"the chunk grid along {d!r} (chunks of {g.dims[d]}) does not match the "
                                 "manifest's: it was made on a dataset chunked differently")
        m.check_labels({d: coord_span(ds, d) for d in m.dims if coord_span(ds, d) is not None})
        snap = snapshot_of_sources(self.sources)
        if m.snapshot is not None and snap is not None and snap != m.snapshot:
            warnings.warn(f"manifest was made on snapshot {m.snapshot}, this dataset is snapshot {snap}: "
                          "the data may have changed", UserWarning, stacklevel=4)

    def _sample_space(self, window: Any, patch: Any, stride: Any, over: Any) -> SampleSpace:
        sizes = self.geometry.sizes
        window = _dim_map("window", window, sizes)
        patch = _dim_map("patch", patch, sizes)
        stride = _dim_map("stride", stride, sizes)
        over = [over] if isinstance(over, str) else list(over or [])
        both = set(window) & set(patch)
        if both:
            raise ValueError(f"dims {sorted(both)} are in both window and patch")
        for d in stride:
            if d not in patch:
                raise ValueError(f"stride[{d!r}] given but {d!r} is not a patch dim")
        for d in over:
            if d not in sizes:
                raise ValueError(f"over: unknown dim {d!r}; the variables have dims {sorted(sizes)}")
            if d in self.manifest.dims or d in window or d in patch:
                raise ValueError(f"over: dim {d!r} is already a split, window or patch dim")
        dims = []
        for d in self.manifest.dims:
            w = window.get(d, patch.get(d, 1))
            st = stride.get(d, patch.get(d, 1)) if d in patch else 1
            dims.append(SampleDim(d, sizes[d], w, st, keep=d in window or d in patch, split=True))
        for d in list(patch) + list(window):
            if d not in self.manifest.dims:
                st = stride.get(d, patch[d]) if d in patch else 1
                dims.append(SampleDim(d, sizes[d], patch.get(d, window.get(d, 1)), st, keep=True))
        for d in over:
            dims.append(SampleDim(d, sizes[d]))
        return SampleSpace(dims, self.geometry.edges | {d: np.asarray(self.manifest.edges[d])
                                                        for d in self.manifest.dims},
                           self.manifest.blocks(self.split))

    def _blockloader(self) -> BlockLoader:
        if self._loader is None or self._pid != os.getpid():  # a new process gets its own reader
            self._reader = Reader(self.max_inflight)
            self._loader = BlockLoader(self.space, self.layouts, self._reader)
            self._pid = os.getpid()
        return self._loader

    # ------------------------------------------------------------------ epochs
    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from the next iteration on."""
        if not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        if int(epoch) != self.epoch:
            self._resume_batch = self._yielded = 0  # a state saved now is the new epoch's start
        self.epoch = int(epoch)

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """This rank's plan of ``epoch`` (default: the current one)."""
        return epoch_plan(self.space, seed=self.seed, epoch=self.epoch if epoch is None else epoch,
                          shuffle=self.shuffle, batch_size=self.batch_size, block_chunks=self.block_chunks,
                          drop_last=self.drop_last, rank=self.rank, world_size=self.world_size)

    def __len__(self) -> int:
        return self.plan().n_batches

    @property
    def n_samples(self) -> int:
        """Samples in the whole split (all ranks)."""
        return self.space.n_samples

    def batch_ids(self, epoch: int | None = None) -> list[np.ndarray]:
        """Global sample ids of each batch this rank yields in ``epoch`` (no I/O)."""
        p = self.plan(epoch)
        ids = p.all_ids(self.space.offsets)
        return [ids[i * self.batch_size:(i + 1) * self.batch_size] for i in range(p.n_batches)]

    def __iter__(self) -> Any:
        start, self._resume_batch = self._resume_batch, 0
        return self._iter_range(start, None)

    def _iter_range(self, start: int, stop: int | None) -> Any:
        """Batches ``start..stop-1`` of this rank's epoch, reading only the blocks they draw from."""
        plan = self.plan()
        plan = plan_head(plan, plan.n_batches if stop is None else stop)  # blocks past the last batch: unread
        self._yielded = start
        run = _EpochRun(self, plan, start)
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=plan.n_batches, initial=start, desc=f"{self.split} epoch {self.epoch}", unit="batch")
        try:
            for i, batch in run:
                self._yielded = i + 1
                if bar is not None:
                    bar.update(1)
                yield batch
        finally:
            run.close()
            self._io = run.report()
            if bar is not None:
                bar.close()

    def __getstate__(self) -> dict[str, Any]:
        # a pickled generator (e.g. sent to a spawned DataLoader worker) leaves this process's
        # reader and recycled block buffers behind: the new process builds its own
        state = self.__dict__.copy()
        state.update(_reader=None, _loader=None, _pid=-1, _io={})
        return state

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Small JSON-able state: where this generator is in which epoch, and what it was made with."""
        return make_state(self, self.epoch, self._yielded)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next iteration yields the batch after the last one saved."""
        check_state(self, state)
        self.epoch = int(state["epoch"])
        self._resume_batch = self._yielded = int(state["batch"])

    # ------------------------------------------------------------------ inspection
    @property
    def io_stats(self) -> dict[str, Any]:
        """Reads of the last epoch: chunks, bytes, requests, decode and wait seconds, rates."""
        return dict(self._io)

    @property
    def channels(self) -> list[str]:
        """Channel names of a stacked batch, in order."""
        from xinsitu.output import plan_channels

        kept = tuple(d.name for d in self.space.dims if d.keep)
        return [c.name for c in plan_channels(self._ds, self.layouts, kept)[0]]

    def shuffle_quality(self, max_batches: int = 200) -> float:
        """How well batches mix chunks, 0..1 (1.0 ~ a global shuffle); computed from the plan.

        Scores the first ``max_batches`` batches of this rank's epoch (no I/O; only the
        shuffle blocks those batches come from are ordered).
        """
        p = self.plan()
        need = min(p.n_samples, max_batches * self.batch_size)
        parts, n, j = [], 0, 0
        while n < need and j < p.n_blocks:
            parts.append(p.block_order(j, self.space.offsets))
            n += len(parts[-1])
            j += 1
        ids = np.concatenate(parts)[:need] if parts else np.zeros(0, np.int64)
        units = [self.space.locate(ids[k:k + self.batch_size])[0] for k in range(0, len(ids), self.batch_size)]
        return _shuffle.quality(units, self.space.counts)

    def sample(self, i: int) -> xr.Dataset:
        """Sample ``i`` of the whole split (unshuffled order) as a labeled ``xr.Dataset``."""
        unit, local = self.space.locate(np.array([i]))
        plan = EpochPlan(units=unit, lo=local, hi=local + 1, block_chunks=1, n_samples=1, batch_size=1,
                         drop_last=False, shuffle=False, seed=0, epoch=0, rank=0, world_size=1)
        loader = self._blockloader()
        block = _loop.run(loader.load(plan, 0))
        raw = loader.gather(block, np.array([0]))
        values = self.builder.decode(raw)
        coords = self.builder.sample_coords(block.starts[:1]).isel(sample=0)
        data = {n: xr.Variable(self.builder._dims(n)[1:] if self.layouts[n].has_sample_axis else
                               self.layouts[n].src.dims, a[0] if self.layouts[n].has_sample_axis else a,
                               attrs=self.builder.attrs[n]) for n, a in values.items()}
        return xr.Dataset(data, coords=coords.coords, attrs=self.builder.ds_attrs)

    def to_torch(self) -> Any:
        """A ``torch.utils.data.IterableDataset`` over this generator (use ``batch_size=None``)."""
        from xinsitu.torch import InsituIterableDataset

        return InsituIterableDataset(self)

    def _headline(self) -> str:
        return f"{self.split!r}: {len(self)} batches of {self.batch_size}, output={self.output!r}"

    def _epoch_bytes(self, p: EpochPlan) -> int:
        """Decoded bytes of the chunk blocks this rank reads in an epoch (halos and partial chunks aside)."""
        sp = self.space
        coords = np.unravel_index(sp.blocks[p.units], sp.grid)
        extent = {d.name: np.diff(sp.edges[k])[coords[k]] for k, d in enumerate(sp.split_dims)}
        total = 0
        for lay in self.layouts.values():
            src = lay.src
            per = np.ones(len(p.units), dtype=np.int64)
            rest = src.raw_dtype.itemsize
            for d, n in zip(src.dims, src.shape, strict=True):
                if d in extent:
                    per = per * extent[d]
                else:
                    rest *= n
            total += rest if lay.static else int(per.sum()) * rest  # a static variable is read once
        return total

    def _sections(self) -> list[_repr.Section]:
        p = self.plan()
        nvar = sum(1 for lay in self.layouts.values() if not lay.static)
        batches = f"{p.n_batches} x {self.batch_size} samples"
        if p.n_samples % self.batch_size:
            batches += " (short last batch dropped)" if self.drop_last else " (last one short)"
        samples = f"{p.n_samples} of {self.space.n_samples} in split {self.split!r}"
        if self.world_size > 1:
            samples += f" (rank {self.rank} of {self.world_size})"
        if self.shuffle:
            shuffle = (f"seed {self.seed}, epoch {self.epoch}, buffers of {self.block_chunks} chunk blocks; "
                       f"quality {self.shuffle_quality(50):.2f} (1.0 ~ global)")
        else:
            shuffle = f"off: chunk blocks in split order (epoch {self.epoch})"
        once = "" if any(d.width > 1 for d in self.space.split_dims) else ", each chunk read once"
        info = [("batches", batches), ("samples", samples),
                ("reads / epoch", f"{len(p.units)} chunk blocks x {nvar} variable{'s' if nvar != 1 else ''}, "
                                  f"~{_repr.fmt_bytes(self._epoch_bytes(p))} decoded{once}"),
                ("shuffle", shuffle), ("output", self.output + (f" on {self.builder.device}"
                                                                if getattr(self.builder, "device", None) else ""))]
        roles = []
        sampled = {d.name for d in self.space.dims}
        for d in self.space.dims:
            if d.width == 1:
                what = "1 position"
            elif d.stride == 1:
                what = f"window of {d.width}"
            else:
                what = f"tile of {d.width}, stride {d.stride}"
            role = "split dim" if d.split else ("over: one sample per position" if not d.keep else "window / patch")
            roles.append((d.name, str(d.size), what, role))
        for d, n in self.geometry.sizes.items():
            if d not in sampled:
                roles.append((d, str(n), f"whole ({n})", "kept"))
        width = {d.name: d.width for d in self.space.dims if d.keep}
        var_rows = []
        for name, lay in self.layouts.items():
            shape = ", ".join(f"{d}: {width.get(d, self.geometry.sizes.get(d, 0))}" for d in lay.out_dims)
            var_rows.append((name, f"({shape})", str(lay.src.dtype), "static: same in every batch" if lay.static
                             else ""))
        sections = [_repr.Section("Epoch", (), info),
                    _repr.Section("Sample", ("dim", "length", "takes", "role"), roles),
                    _repr.Section("Variables", ("variable", "per sample", "dtype", ""), var_rows,
                                  summary=f"({len(var_rows)})")]
        io = {k: self._io.get(k, 0) for k in ("chunks", "requests", "bytes_read", "bytes_decoded", "samples_per_s",
                                               "mb_per_s", "seconds", "wait_s", "epoch", "batches")}
        if self._io:  # a repr never raises: missing counters read as 0
            sections.append(_repr.Section("Last epoch I/O", (), [
                ("read", f"{io['chunks']} chunks in {io['requests']} requests, {_repr.fmt_bytes(io['bytes_read'])} "
                         f"stored -> {_repr.fmt_bytes(io['bytes_decoded'])} decoded"),
                ("rate", f"{io['samples_per_s']:.0f} samples/s, {io['mb_per_s']:.1f} MB/s decoded "
                         f"over {io['seconds']:.2f} s"),
                ("waited for data", f"{io['wait_s']:.2f} s")],
                summary=f"(epoch {io['epoch']}, {io['batches']} batches)", collapsed=True))
        return sections

    def __repr__(self) -> str:
        return _repr.text("xinsitu.BatchGenerator", self._sections(), self._headline())

    def _repr_html_(self) -> str:
        return _repr.html("xinsitu.BatchGenerator", self._sections(), repr(self), self._headline())


class _EpochRun:
    """One pass over an epoch plan: the I/O producer, the prefetch thread, and their queues."""

    def __init__(self, gen: BatchGenerator, plan: EpochPlan, start: int):
        self.gen, self.plan, self.start = gen, plan, start
        self.loader = gen._blockloader()
        self.counters_before = _copy_counters(self.loader.reader.counters)
        self.blocks: queue.Queue = queue.Queue()
        self.batches: queue.Queue = queue.Queue(PREFETCH_BATCHES)
        self.stop = threading.Event()
        self.wait_s = 0.0
        self.samples = 0
        self.n_batches = 0
        self.borrowed = 0
        self.t0 = time.perf_counter()
        self.t_end: float | None = None
        self.loop = _loop.get_loop()
        self.credits: asyncio.Semaphore | None = None
        self.depth = PREFETCH_BLOCKS  # blocks read ahead or held (grows with requests in flight)
        self.n_loaded = 0
        if start >= plan.n_batches:
            self.first_block = plan.n_blocks
        else:
            self.first_block = plan.blocks_of(*plan.batch_span(start))[0]
        self.io_future = _loop.submit(self._produce())
        self.thread = threading.Thread(target=self._assemble, name="xinsitu-prefetch", daemon=True)
        self.thread.start()

    # -- I/O loop side
    async def _produce(self) -> None:
        self.credits = asyncio.Semaphore(self.depth)
        prev: asyncio.Task | None = None
        loads: list[asyncio.Task] = []
        try:
            for j in range(self.first_block, self.plan.n_blocks):
                await self.credits.acquire()
                if self.stop.is_set():
                    break
                prev = asyncio.ensure_future(self._load(j, prev))
                loads = [t for t in loads if not t.done()] + [prev]
            if prev is not None:
                await prev
            self.blocks.put(_END)
        except asyncio.CancelledError:
            for t in loads:  # an abandoned epoch: its reads stop too (they would hold connections and threads)
                t.cancel()
            raise
        except BaseException as e:  # noqa: BLE001 - delivered to the caller
            self.blocks.put(e)

    async def _load(self, j: int, prev: asyncio.Task | None) -> None:
        block = await self.loader.load(self.plan, j)
        self.n_loaded += 1
        self._deepen()
        if prev is not None:
            await prev  # deliver in order
        self.blocks.put(block)

    def _deepen(self) -> None:
        """Read further ahead where the reader keeps more requests in flight than the blocks being
        loaded hold (a far store, see ``InflightLimit``): one block gathered from, and enough
        loading to fill the limit, at most ``MAX_PREFETCH_BLOCKS``."""
        reader = self.loader.reader
        per_block = (reader.counters.requests - self.counters_before["requests"]) / self.n_loaded
        want = min(MAX_PREFETCH_BLOCKS, 1 + math.ceil(reader.inflight.limit / max(per_block, 1.0)))
        while self.depth < want and self.credits is not None:
            self.depth += 1
            self.credits.release()

    def _release(self) -> None:
        if self.credits is not None:
            self.loop.call_soon_threadsafe(self.credits.release)

    # -- prefetch thread
    def _assemble(self) -> None:
        plan, gen = self.plan, self.gen
        loaded: dict[int, Any] = {}
        try:
            for i in range(self.start, plan.n_batches):
                a, b = plan.batch_span(i)
                js = plan.blocks_of(a, b)
                for j in js:
                    while j not in loaded:
                        if len(loaded) >= self.depth - 1:
                            # this batch spans more blocks than the read-ahead allows: lend the
                            # producer one more block, paid back when a block is recycled
                            self.borrowed += 1
                            self._release()
                        item = self.blocks.get()
                        if isinstance(item, BaseException):
                            raise item
                        if item is _END:
                            raise RuntimeError(f"xinsitu: block {j} was never read (internal error)")
                        loaded[item.j] = item
                for old in [k for k in loaded if k < js[0]]:
                    self.loader.recycle(loaded.pop(old))
                    if self.borrowed:
                        self.borrowed -= 1
                    else:
                        self._release()
                direct = gen.builder.direct_stack(b - a)  # gather straight into the stacked batch
                raw_parts, start_parts, done = [], [], 0
                for j in js:
                    off = plan.block_offsets[j]
                    lo, hi = max(a, off) - off, min(b, plan.block_offsets[j + 1]) - off
                    rows = np.arange(lo, hi)
                    into = None if direct is None else {n: v[done:done + len(rows)] for n, v in direct[1].items()}
                    raw_parts.append(self.loader.gather(loaded[j], rows, into))
                    start_parts.append(loaded[j].starts[rows])
                    done += len(rows)
                if direct is not None:
                    batch = gen.builder.finish_stacked(direct[0])
                else:
                    raw = raw_parts[0] if len(raw_parts) == 1 else {
                        n: (np.concatenate([p[n] for p in raw_parts]) if gen.layouts[n].has_sample_axis
                            else raw_parts[0][n]) for n in raw_parts[0]}
                    batch = gen.builder.build(raw, np.concatenate(start_parts))
                if not self._put((i, batch, b - a)):
                    return
            self._put(_END)
        except BaseException as e:  # noqa: BLE001 - delivered to the caller
            self._put(e)

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
            item = self.batches.get()
            self.wait_s += time.perf_counter() - t
            if item is _END:
                self.t_end = time.perf_counter()
                return
            if isinstance(item, BaseException):
                raise item
            i, batch, n = item
            self.samples += n
            self.n_batches += 1
            yield i, batch

    def close(self) -> None:
        self.stop.set()
        for _ in range(MAX_PREFETCH_BLOCKS + 1):
            self._release()
        self.io_future.cancel()
        self.thread.join(timeout=5)

    def report(self) -> dict[str, Any]:
        c = _copy_counters(self.loader.reader.counters)
        for k, v in self.counters_before.items():
            c[k] -= v
        dt = (self.t_end or time.perf_counter()) - self.t0
        return {"epoch": self.plan.epoch, "batches": self.n_batches, **c,
                "wait_s": self.wait_s, "seconds": dt, "samples": self.samples,
                "samples_per_s": self.samples / dt if dt > 0 else 0.0,
                "mb_per_s": c["bytes_decoded"] / dt / 1e6 if dt > 0 else 0.0}


def _copy_counters(c: Any) -> dict[str, Any]:
    return {k: getattr(c, k) for k in c.__dataclass_fields__}
