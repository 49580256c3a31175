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
from xinsitu.cache import ChunkCache, resolve_cache
from xinsitu.geometry import geometry_of
from xinsitu.output import OutputBuilder
from xinsitu.plan import EpochPlan, SampleDim, SampleSpace, epoch_plan, epoch_size, plan_head, rank_share, segment_plan
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
WAIT_STEP_S = 0.05  # queue waits are this long at most, then check that the other side still runs


def _int_arg(name: str, v: Any, minimum: int | None = None) -> int:
    """``v`` as an int; a bool, a float or a string is refused (never truncated or parsed)."""
    if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {type(v).__name__} {v!r}")
    if minimum is not None and v < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {v!r}")
    return int(v)


def _positive_int(name: str, v: Any) -> int:
    return _int_arg(name, v, 1)


def _flag(name: str, v: Any) -> bool:
    """``v`` as a bool; ``"no"`` or ``"False"`` would be truthy, so only real booleans pass."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(v).__name__} {v!r}")
    return bool(v)


def _variable_names(v: Any, ds: xr.Dataset) -> list[str] | None:
    """``variables=`` as a list of data variable names (None: the default)."""
    if v is None:
        return None
    names = [v] if isinstance(v, str) else v
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"variables must be a variable name or a list of names, got {type(v).__name__} {v!r}")
    if not names:
        raise ValueError("variables is empty: name at least one data variable")
    unknown = [n for n in names if n not in ds.data_vars]
    if unknown:
        raise ValueError(f"variables: unknown variable(s) {unknown}; the Dataset has {list(ds.data_vars)}")
    if len(set(names)) != len(names):
        raise ValueError(f"variables names a variable twice: {list(names)}")
    return list(names)


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
    rank = 0 if rank is None else _int_arg("rank", rank)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}) for world_size={world_size}, got {rank}")
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
    missing : {"fill", "raise"}, default "fill"
        A chunk with no object in the store: read as the fill value, as zarr does (counted in
        ``io_stats["missing"]``, with a warning once per epoch), or raise ``ChunkReadError``.
    cache : bool, str, os.PathLike or ChunkCache, optional
        Keep decoded chunks across epochs: ``True`` or ``"memory"`` (a memory tier with the
        default budget), a directory (plus a disk tier there that persists across runs), or an
        ``xinsitu.ChunkCache``. The same batches in the same order as without.
    """

    def __init__(self, ds: xr.Dataset, manifest: SplitManifest, split: str, *, batch_size: int = 32,
                 shuffle: bool = True, seed: int = 0, window: dict[str, int] | None = None,
                 patch: dict[str, int] | None = None, stride: dict[str, int] | None = None,
                 over: str | list[str] | None = None, variables: list[str] | None = None,
                 output: str = "xarray", stack: bool = False, normalize: Any = None, device: Any = None,
                 block_chunks: int = 16, max_inflight: int | None = None, drop_last: bool = False,
                 rank: int | None = None, world_size: int | None = None, progress: bool = False,
                 missing: str = "fill", cache: bool | str | os.PathLike[str] | ChunkCache | None = None):
        if not isinstance(manifest, SplitManifest):
            raise TypeError(f"manifest must be a SplitManifest (from ds.insitu.split), got {type(manifest).__name__}")
        if not isinstance(split, str):
            raise TypeError(f"split must be the name of a split (a str), got {type(split).__name__} {split!r}")
        if split not in manifest.splits:
            raise ValueError(f"unknown split {split!r}; the manifest has {list(manifest.splits)}")
        self.batch_size = _positive_int("batch_size", batch_size)
        self.block_chunks = _positive_int("block_chunks", block_chunks)
        self.max_inflight = None if max_inflight is None else _positive_int("max_inflight", max_inflight)
        self.seed = _int_arg("seed", seed, 0)  # numpy's generators take no negative seed
        self.shuffle, self.drop_last = _flag("shuffle", shuffle), _flag("drop_last", drop_last)
        self.rank, self.world_size = _dist_defaults(rank, world_size)
        self.manifest, self.split, self.progress = manifest, split, _flag("progress", progress)
        if missing not in ("fill", "raise"):
            raise ValueError(f"missing must be 'fill' or 'raise', got {missing!r}")
        self.missing = missing
        self.cache = resolve_cache(cache)
        variables = _variable_names(variables, ds)
        if variables is None:
            variables = [v for v in ds.data_vars if any(d in ds[v].dims for d in manifest.dims)]
        self.sources = resolve(ds, variables)
        self.geometry = geometry_of(self.sources)
        self._check_manifest(ds)
        self.space = self._sample_space(window, patch, stride, over)
        self.space.offsets  # noqa: B018 (samples per unit and their offsets: made once, for len, plans and sample)
        self.layouts = {n: VarLayout.build(s, self.space) for n, s in self.sources.items()}
        self.builder = OutputBuilder(ds, self.space, self.layouts, output, stack, device, normalize=normalize)
        self.normalize = normalize
        self.output = output
        self._ds = ds
        self.epoch = 0
        self._resume_batch = 0
        self._yielded_at = (0, 0)  # (epoch, batches) of the last batch handed out: what state_dict saves
        self._live = 0  # iterations under way
        self._reader: Reader | None = None
        self._loader: BlockLoader | None = None
        self._pid = -1
        self._io: dict[str, Any] = {}
        self._channels: list[str] | None = None
        # elastic resume: the (world_size, batches) hops of epoch ``_elastic_epoch`` so far (see state.py)
        self._elastic: list[tuple[int, int]] = []
        self._elastic_epoch = -1
        self._elastic_plan: EpochPlan | None = None
        self._check_not_empty()

    def _check_not_empty(self) -> None:
        """Refuse a generator that would yield nothing: an empty epoch looks like a finished one."""
        if self.space.n_samples == 0:
            wide = {d.name: d.width for d in self.space.dims if d.width > 1}
            raise ValueError(f"split {self.split!r} holds no sample of this shape ({wide or 'one position'}): "
                             "every window/patch is longer than the split's runs of whole chunk blocks "
                             f"along {[d.name for d in self.space.split_dims]}; use a shorter window or patch")
        if self.world_size > 1 or self.drop_last:
            n = self.plan(self.epoch).n_batches
            if n == 0:
                raise ValueError(f"rank {self.rank} of world_size={self.world_size} gets no batch: split "
                                 f"{self.split!r} has {self.space.n_samples} samples, too few for "
                                 f"{self.world_size} rank(s) x batch_size={self.batch_size}"
                                 + (" with drop_last=True" if self.drop_last else "")
                                 + "; use fewer ranks or a smaller batch_size")

    # ------------------------------------------------------------------ set-up
    def _check_manifest(self, ds: xr.Dataset) -> None:
        m, g = self.manifest, self.geometry
        m.check_grid(g.sizes, g.edges, g.dims)  # its own grid or a refinement of it
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
            self._reader = Reader(self.max_inflight, cache=self.cache)
            self._reader.on_missing = self.missing
            self._loader = BlockLoader(self.space, self.layouts, self._reader)
            self._pid = os.getpid()
        return self._loader

    # ------------------------------------------------------------------ epochs
    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from the next iteration on (an iterator already made keeps its epoch)."""
        if not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        if int(epoch) != self.epoch:
            self._resume_batch = 0
            if int(epoch) != self._elastic_epoch:  # an elastic remainder belongs to the epoch it was saved in
                self._elastic, self._elastic_epoch, self._elastic_plan = [], -1, None
            if not self._live:  # a state saved now is the new epoch's start; else the live iterator's place
                self._yielded_at = (int(epoch), 0)
        self.epoch = int(epoch)

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """This rank's plan of ``epoch`` (default: the current one); after an elastic resume, the rest
        of that epoch dealt across this run's ranks."""
        epoch = self.epoch if epoch is None else epoch
        if self._elastic and epoch == self._elastic_epoch:
            if self._elastic_plan is None:
                self._elastic_plan = segment_plan(
                    self.space, self._elastic, seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                    batch_size=self.batch_size, block_chunks=self.block_chunks, drop_last=self.drop_last,
                    rank=self.rank, world_size=self.world_size)
            return self._elastic_plan
        return epoch_plan(self.space, seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                          batch_size=self.batch_size, block_chunks=self.block_chunks,
                          drop_last=self.drop_last, rank=self.rank, world_size=self.world_size)

    def _epoch_size(self) -> tuple[int, int]:
        """(samples, units) of this rank's current epoch, without ordering 10^7 units where the
        order cannot change them (``plan.epoch_size``)."""
        resumed = bool(self._elastic) and self.epoch == self._elastic_epoch  # the rest of an epoch: its own plan
        size = None if resumed else epoch_size(self.space, world_size=self.world_size, rank=self.rank,
                                               batch_size=self.batch_size, drop_last=self.drop_last)
        if size is None:
            p = self.plan()
            return p.n_samples, len(p.units)
        return size

    def __len__(self) -> int:
        full, rest = divmod(self._epoch_size()[0], self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

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
        """Batches ``start..stop-1`` of this rank's epoch, reading only the blocks they draw from.

        The epoch is fixed now: a later ``set_epoch`` takes effect at the next iteration."""
        return self._batches(self.epoch, start, stop)

    def _batches(self, epoch: int, start: int, stop: int | None) -> Any:
        plan = self.plan(epoch)
        plan = plan_head(plan, plan.n_batches if stop is None else stop)  # blocks past the last batch: unread
        self._live += 1
        self._yielded_at = (epoch, start)
        run = _EpochRun(self, plan, start)
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=plan.n_batches, initial=start, desc=f"{self.split} epoch {epoch}", unit="batch")
        try:
            for i, batch in run:
                self._yielded_at = (epoch, i + 1)  # the state of the last batch handed out (as grain keeps it)
                if bar is not None:
                    bar.update(1)
                yield batch
        finally:
            run.close()
            self._io = run.report()
            self._warn_missing()
            self._live -= 1
            if not self._live and self.epoch != epoch:  # set_epoch came during this iteration: now it counts
                self._yielded_at = (self.epoch, 0)
            if bar is not None:
                bar.close()

    def _warn_missing(self) -> None:
        """Once per epoch: chunks that had no object read as fill values (zarr's rule), but a deleted
        archive or a store answering 404 looks just like that."""
        n = self._io.get("missing", 0)
        if n and self.missing == "fill":  # with "raise" the error has said it
            var, chunk, key = self._io["missing_chunk"]
            warnings.warn(f"epoch {self._io['epoch']} of split {self.split!r}: {n} chunk(s) had no object in the "
                          f"store and read as the fill value (e.g. chunk {chunk} of variable {var!r}, key "
                          f"{key!r}); zarr writers skip chunks that are all fill value, but a deleted archive "
                          "or a store answering 404 looks the same. Pass missing='raise' to make it an error.",
                          UserWarning, stacklevel=3)

    def __getstate__(self) -> dict[str, Any]:
        # a pickled generator (e.g. sent to a spawned DataLoader worker) leaves this process's
        # reader and recycled block buffers behind: the new process builds its own
        state = self.__dict__.copy()
        state.update(_reader=None, _loader=None, _pid=-1, _io={}, _live=0)
        return state

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Small JSON-able state: where this generator is in which epoch, and what it was made with.

        While an iteration runs, the place of the last batch it handed out (a ``set_epoch`` meanwhile
        counts from the next iteration on)."""
        return make_state(self, *self._yielded_at)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next iteration yields the batch after the last one saved.

        A state saved by any rank of a run of another world size (ranks in lockstep, as DDP runs) is
        elastic: the rest of that epoch -- every sample no rank had yielded -- is dealt across this
        run's ranks, exactly once and in equal batch counts; later epochs follow this run's plan.
        """
        check_state(self, state, elastic=True)
        epoch, batch = int(state["epoch"]), int(state["batch"])
        hops = [(int(w), int(b)) for w, b in state.get("elastic", [])]
        saved_world = int(state.get("world_size", self.world_size))
        if saved_world != self.world_size:
            hops.append((saved_world, batch))  # the saved run's ranks each yielded ``batch`` batches
            batch = 0
        self.epoch = epoch
        self._elastic, self._elastic_epoch, self._elastic_plan = hops, epoch, None
        self._resume_batch = batch
        self._yielded_at = (epoch, batch)

    # ------------------------------------------------------------------ inspection
    @property
    def io_stats(self) -> dict[str, Any]:
        """Reads of the last epoch: chunks, bytes, requests, decode and wait seconds, rates,
        ``missing``: chunks with no object in the store (read as the fill value), and with a
        ``cache``: ``cache_hits`` (chunks taken from it, neither fetched nor decoded),
        ``cache_disk_hits`` (those its disk tier had) and ``cache_misses``."""
        return dict(self._io)

    @property
    def channels(self) -> list[str]:
        """Channel names of a stacked batch, in order (the variables' names where they cannot be stacked)."""
        if self._channels is None:
            from xinsitu.stats import channel_names

            self._channels = channel_names(self._ds, self.layouts, tuple(d.name for d in self.space.dims if d.keep))
        return list(self._channels)

    def shuffle_quality(self, max_batches: int = 200) -> float:
        """How well batches mix chunks, 0..1 (1.0 ~ a global shuffle); computed from the plan.

        Scores the first ``max_batches`` batches of this rank's epoch (no I/O; only the
        shuffle blocks those batches come from are ordered).
        """
        return self._quality(self.plan(), max_batches)

    def _quality(self, p: EpochPlan, max_batches: int) -> float:
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
        i = _int_arg("i", i)
        if not 0 <= i < self.space.n_samples:
            raise IndexError(f"sample index i={i} is out of range: split {self.split!r} has "
                             f"{self.space.n_samples} samples")
        unit, local = self.space.locate(np.array([i]))
        plan = EpochPlan(units=unit, lo=local, hi=local + 1, block_chunks=1, n_samples=1, batch_size=1,
                         drop_last=False, shuffle=False, seed=0, epoch=0, rank=0, world_size=1)
        loader = self._blockloader()
        block = _loop.run(loader.load(plan, 0))
        raw = loader.gather(block, np.array([0]))
        values = self.builder.decode(raw)
        coords = self.builder.sample_coords(block.starts[:1])
        if "sample" in coords.dims:  # not where no sampled dim has a coordinate
            coords = coords.isel(sample=0)
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

    def _display_plan(self) -> tuple[EpochPlan, int]:
        """The plan the repr describes (its first 50 batches at least) and how many units it reads:
        where the unit order cannot change what the repr shows (units of equal size), the same cut
        with the units in split order, and for one rank only its head (no permutation of, nor pass
        over, 10^7 units just to print); else the plan."""
        c = self.space.counts
        resumed = bool(self._elastic) and self.epoch == self._elastic_epoch
        if resumed or not len(c) or not bool((c == c[0]).all()) or not c[0]:
            p = self.plan()
            return p, len(p.units)
        kw = dict(block_chunks=self.block_chunks, batch_size=self.batch_size, drop_last=self.drop_last,
                  shuffle=self.shuffle, seed=self.seed, epoch=self.epoch, rank=self.rank, world_size=self.world_size)
        if self.world_size == 1:
            n, units = epoch_size(self.space, world_size=1, rank=0, batch_size=self.batch_size,
                                  drop_last=self.drop_last)
            k = min(units, (-(-50 * self.batch_size // int(c[0])) // self.block_chunks + 1) * self.block_chunks)
            return EpochPlan(units=np.arange(k), lo=np.zeros(k, np.int64), hi=c[:k].copy(), n_samples=n, **kw), units
        pos, lo, hi, n = rank_share(c, self.world_size, self.rank, self.batch_size, self.drop_last)
        return EpochPlan(units=pos, lo=lo, hi=hi, n_samples=n, **kw), len(pos)

    def _epoch_bytes(self, p: EpochPlan, n_units: int | None = None) -> int:
        """Decoded bytes of the chunk blocks this rank reads in an epoch (halos and partial chunks aside)."""
        sp = self.space
        split = {d.name for d in sp.split_dims}
        n_units = len(p.units) if n_units is None else n_units
        if n_units == len(sp.blocks) and all(lay.static or split <= set(lay.src.dims) for lay in self.layouts.values()):
            # every unit once (one rank): the split's positions, O(runs of the manifest)
            n = self.manifest.positions(self.split)
            total = 0
            for lay in self.layouts.values():
                rest = lay.src.raw_dtype.itemsize * int(np.prod([k for d, k in zip(lay.src.dims, lay.src.shape,
                                                                                 strict=True) if d not in split]))
                total += rest * (1 if lay.static else n)
            return total
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
        p, n_units = self._display_plan()
        nvar = sum(1 for lay in self.layouts.values() if not lay.static)
        batches = f"{p.n_batches} x {self.batch_size} samples"
        if p.n_samples % self.batch_size:
            batches += " (short last batch dropped)" if self.drop_last else " (last one short)"
        samples = f"{p.n_samples} of {self.space.n_samples} in split {self.split!r}"
        if self.world_size > 1:
            samples += f" (rank {self.rank} of {self.world_size})"
        if self.shuffle:
            shuffle = (f"seed {self.seed}, epoch {self.epoch}, buffers of {self.block_chunks} chunk blocks; "
                       f"quality {self._quality(p, 50):.2f} (1.0 ~ global)")
        else:
            shuffle = f"off: chunk blocks in split order (epoch {self.epoch})"
        once = "" if any(d.width > 1 for d in self.space.split_dims) else ", each chunk read once"
        info = [("batches", batches), ("samples", samples),
                ("reads / epoch", f"{n_units} chunk blocks x {nvar} variable{'s' if nvar != 1 else ''}, "
                                  f"~{_repr.fmt_bytes(self._epoch_bytes(p, n_units))} decoded{once}"),
                ("shuffle", shuffle), ("output", self.output + (f" on {self.builder.device}"
                                                                if getattr(self.builder, "device", None) else ""))]
        if self.cache is not None:
            info.append(("cache", self.cache.summary()))
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
                ("waited for data", f"{io['wait_s']:.2f} s")]
                + ([("cache", f"{self._io.get('cache_hits', 0)} hits ({self._io.get('cache_disk_hits', 0)} from "
                              f"disk), {self._io.get('cache_misses', 0)} misses")] if self.cache is not None else []),
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
        self.failed = False  # a block failed to load (set on the I/O loop)
        self.tasks: set[asyncio.Task] = set()  # block loads in flight
        if start >= plan.n_batches:
            self.first_block = plan.n_blocks
        else:
            self.first_block = plan.blocks_of(*plan.batch_span(start))[0]
        # chunks that windows spill into, passed from block to block rather than read twice
        self.halo = self.loader.halo_plan(plan, self.first_block)
        self.io_future = _loop.submit(self._produce())
        self.thread = threading.Thread(target=self._assemble, name="xinsitu-prefetch", daemon=True)
        self.thread.start()

    # -- I/O loop side
    async def _produce(self) -> None:
        self.credits = asyncio.Semaphore(self.depth)
        prev: asyncio.Task | None = None
        try:
            for j in range(self.first_block, self.plan.n_blocks):
                await self.credits.acquire()
                if self.stop.is_set() or self.failed:
                    break  # a failed block ends the epoch: its error is on its way to the caller
                prev = asyncio.ensure_future(self._load(j, prev))
                self.tasks.add(prev)
                prev.add_done_callback(self.tasks.discard)
            delivered = True if prev is None else await prev
            if delivered and not self.stop.is_set():
                self.blocks.put(_END)
        except asyncio.CancelledError:
            for t in list(self.tasks):  # closed early: stop the reads of blocks nobody will take
                t.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - delivered to the caller
            self.blocks.put(e)

    async def _load(self, j: int, prev: asyncio.Task | None) -> bool:
        """Load block ``j`` and hand it (or its error) on after block ``j - 1``; whether it was delivered."""
        try:
            block: Any = await self.loader.load(self.plan, j, self.halo)
        except Exception as e:  # noqa: BLE001 - delivered to the caller, in order
            block = e
            self.failed = True
            self.credits.release()  # wake the producer, which may be waiting for a credit, so that it stops
        else:
            self.n_loaded += 1
            self._deepen()
        if prev is not None and not await prev:  # an earlier block failed: its error goes first, alone
            if not isinstance(block, BaseException):
                self.loader.recycle(block)
            return False
        self.blocks.put(block)
        return not isinstance(block, BaseException)

    def _deepen(self) -> None:
        """Read further ahead where the reader keeps more requests in flight than the blocks being
        loaded hold (a far store, see ``InflightLimit``): one block gathered from, and enough
        loading to fill the limit, at most ``MAX_PREFETCH_BLOCKS``."""
        reader = self.loader.reader
        per_block = (reader.counters.requests - self.counters_before["requests"]) / self.n_loaded
        if not per_block:  # every chunk came from the cache: no request to keep in flight, no need to read ahead
            return
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
                        item = self._next_block()
                        if item is None:
                            return  # closed
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

    def _next_block(self) -> Any:
        """The next loaded block (or error, or ``_END``); None once closed. Waits in short steps and
        checks the producer meanwhile, so that a producer that ended without a word cannot hang us."""
        while True:
            try:
                return self.blocks.get(timeout=WAIT_STEP_S)
            except queue.Empty:
                pass
            if self.stop.is_set():
                return None
            if self.io_future.done():
                try:
                    return self.blocks.get_nowait()  # put just before the producer ended
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
            yield i, batch

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
        for _ in range(MAX_PREFETCH_BLOCKS + 1):
            self._release()
        self.io_future.cancel()
        self.thread.join(timeout=5)

    def report(self) -> dict[str, Any]:
        c = _copy_counters(self.loader.reader.counters)
        for k, v in self.counters_before.items():
            c[k] -= v
        dt = (self.t_end or time.perf_counter()) - self.t0
        if c["missing"]:
            c["missing_chunk"] = self.loader.reader.last_missing  # (variable, chunk, key): one of them
        return {"epoch": self.plan.epoch, "batches": self.n_batches, **c,
                "wait_s": self.wait_s, "seconds": dt, "samples": self.samples,
                "samples_per_s": self.samples / dt if dt > 0 else 0.0,
                "mb_per_s": c["bytes_decoded"] / dt / 1e6 if dt > 0 else 0.0}


def _copy_counters(c: Any) -> dict[str, Any]:
    return {k: getattr(c, k) for k in c.__dataclass_fields__}
