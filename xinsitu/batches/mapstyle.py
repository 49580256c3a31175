"""Map-style access: ``ds.insitu.dataset(m, split, ...)`` → ``InsituDataset``.

``len(d)`` is the number of samples of the whole split, numbered as ``gen.sample(i)`` numbers
them (unshuffled: chunk blocks in split order, then C order over the sampled dims);
``d[i]`` is one sample and ``d.__getitems__(indices)`` reads a whole batch in one pass, so
that a torch ``DataLoader(d, batch_size=B, sampler=...)`` works with any sampler (weighted,
distributed, curriculum, resumable) and reads each chunk once per batch.

How a call reads, two ways with the same values (those of ``batches()`` and of plain xarray):

- *sparse* samples (at most ``SPARSE_PER_UNIT`` per chunk block on average: what a random
  sampler gives): each sample's region -- its window/tile along the sampled dims, its other
  dims whole -- is read straight into its place in the batch, one ``Reader.read_many`` per
  variable, so a chunk two samples share is fetched and decoded once; only the chunks the
  samples touch are read, and only their part of each is copied (a cache hit costs the
  sample's bytes, not the chunk's);
- *dense* samples (a sequential sampler, ``over`` dims), and variables held in memory, read
  through dask or sharded: the samples' chunk blocks become the slots of one shuffle block of
  a one-off, unshuffled ``EpochPlan``, read by ``BufferLoader.load`` (one ``read_many`` per
  variable) and gathered as ``batches()`` gathers.

Either way the gathered values go through the generator's ``OutputBuilder`` (CF decoding,
normalisation, stacking), as in ``batches()``.

Why it is slower than ``batches()`` under a random sampler: each random sample falls in a
chunk of its own, and the whole chunk is fetched and decoded to serve it. With time chunks of
24 steps, a batch of 32 random samples decodes ~27 chunks per variable (3.4 chunks per sample
for 4 variables) where ``batches()`` decodes each chunk once per epoch (~0.17 per sample):
~20 times the decoding, ~10 times fewer samples/s on the yardstick archive
(``bench/dataset_bench.py``). ``cache=`` keeps decoded chunks; once the split is cached, a
random sampler reads about as fast as ``batches()``.

torch is optional. Where it is installed, ``InsituDataset(...)`` makes an instance of
``TorchInsituDataset``, a subclass of both ``InsituDataset`` and ``torch.utils.data.Dataset``
(created, and torch imported, at the first dataset made; ``pickle`` finds it by name, so
spawned workers rebuild it); without torch it is a plain ``InsituDataset``.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import operator
import os
import threading
from typing import Any

import numpy as np
import xarray as xr

from xinsitu.batches.buffer import BufferLoader
from xinsitu.batches.generator import BatchGenerator
from xinsitu.batches.output import with_dim_indexes
from xinsitu.codecs.cpu import is_sharded
from xinsitu.index.plan import EpochPlan
from xinsitu.index.split import SplitManifest
from xinsitu.io import loop as _loop
from xinsitu.io.reader import Reader

__all__ = ["InsituDataset", "SampleBatch", "collate"]

#: A call reads each sample's own region (its window or tile, straight into the batch) where its
#: samples are sparse -- at most this many per chunk block on average, as a random sampler gives --
#: and whole chunk blocks into a shuffle-block buffer (``BufferLoader``) where they are dense (a
#: sequential sampler, ``over`` dims: many samples per block, one gather).
SPARSE_PER_UNIT = 4



def _counters(reader: Reader) -> dict[str, Any]:
    """The reader's counters now (``IOCounters``' fields: chunks, requests, bytes, decode seconds,
    missing chunks, and cache hits/misses where the reader has them)."""
    c = reader.counters
    return {k: getattr(c, k) for k in c.__dataclass_fields__}


class SampleBatch(list):
    """What ``InsituDataset.__getitems__`` returns: the per-sample items (a list, as torch's
    ``Dataset.__getitems__`` contract has it, so the default ``collate_fn`` stacks them) and,
    as ``.batch``, the batch they were cut from (what ``collate`` hands on without a copy).

    Attributes
    ----------
    batch : dict, array, xr.Dataset or xr.DataArray
        The batch in the dataset's output kind, with a leading batch axis (``sample`` dim).
    """

    def __init__(self, items: list[Any], batch: Any):
        super().__init__(items)
        self.batch = batch


def collate(items: Any) -> Any:
    """A DataLoader ``collate_fn`` giving exactly what ``batches()`` gives: the batch itself.

    ``DataLoader(d, batch_size=B, sampler=s, collate_fn=xinsitu.batches.mapstyle.collate)`` yields
    ``d.batch(indices)``: no per-sample stacking copy, xarray outputs as a Dataset with a
    ``sample`` dim, variables without a sampled dim (static ones) once rather than once per
    sample. Anything other than a ``SampleBatch`` goes to torch's ``default_collate``.

    Parameters
    ----------
    items : SampleBatch or list
        What the DataLoader fetched.

    Returns
    -------
    The batch.
    """
    if isinstance(items, SampleBatch):
        return items.batch
    from torch.utils.data import default_collate

    return default_collate(items)


def _index(name: str, v: Any) -> int:
    """``v`` as a Python int (anything with ``__index__``: int, numpy integer, 0-d integer tensor);
    a bool, a float, a string or a slice is refused."""
    if isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {type(v).__name__} {v!r}")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(v).__name__} {v!r}") from None


class InsituDataset:
    """A map-style dataset over the samples of one split, read in place.

    ``ds.insitu.dataset(m, split, ...)`` makes one. Where torch is installed, it is a
    ``torch.utils.data.Dataset`` (see the module's notes).

    Parameters
    ----------
    ds : xr.Dataset
        As for ``ds.insitu.batches``.
    manifest : SplitManifest
        The chunk-aligned split (``ds.insitu.split``).
    split : str
        The split whose samples are numbered ``0 .. len(d) - 1``.
    window, patch, stride, over, variables, normalize
        What a sample is and which values it carries, as for ``ds.insitu.batches``.
    output : {"xarray", "dataarray", "numpy", "torch", "cupy"}, default "numpy"
        The kind of ``d[i]`` and of a batch (``d.batch``); "numpy" or "torch" for a DataLoader
        with the default ``collate_fn``.
    stack : bool or list of str, default False
        One array with the variables as channels (``d.channels`` names them), as for
        ``ds.insitu.batches`` (``["level"]`` folds that dim into ``{var}_{label}`` channels).
    cache : bool, str, os.PathLike or xinsitu.ChunkCache, optional
        Keep decoded chunks across calls (and, with a directory, across runs), as for
        ``ds.insitu.batches``; a random sampler then reads each chunk once per run.
    max_inflight : int, optional
        Chunk requests in flight at most (default: sized from the store's latency).
    missing : {"fill", "raise"}, default "fill"
        A chunk with no object in the store reads as the fill value, or raises.

    Notes
    -----
    ``d[i]`` has no batch axis (an xarray output has no ``sample`` dim); negative ``i`` counts
    from the end; ``IndexError`` out of range, ``TypeError`` for a non-integer.

    ``d.__getitems__(indices)`` (what torch's DataLoader calls with each batch of sampler
    indices) reads the batch in one pass -- each chunk once per call, however many of the
    indices use it; duplicates are allowed and come back in the order given -- and returns a
    ``SampleBatch``: the per-sample items, which the default ``collate_fn`` stacks into a
    batch equal to ``batches()``'s for the same samples (as torch tensors; a static variable
    gets a batch axis), and the batch itself as ``.batch`` (``collate_fn=xinsitu.batches.mapstyle.collate``
    hands it on without the stacking copy, and is needed for xarray outputs).

    Workers: a pickled dataset leaves its reader behind and each process builds its own on first
    use, so ``num_workers > 0`` works under ``spawn``/``forkserver``, and under ``fork`` for a
    local archive; a remote one fails at the first read in a forked worker with an error that
    names the fix (the fork policy of ``xinsitu.io.loop``). Calls are serialised by a lock (the
    reads within a call run in parallel).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is InsituDataset and _torch_installed():
            cls = _torch_class()  # a torch Dataset too (isinstance checks, ``d + other``)
        return super().__new__(cls)

    def __init__(self, ds: xr.Dataset, manifest: SplitManifest, split: str, *,
                 window: dict[str, int] | None = None, patch: dict[str, int] | None = None,
                 stride: dict[str, int] | None = None, over: str | list[str] | None = None,
                 variables: str | list[str] | None = None, output: str = "numpy", stack: bool | list[str] = False,
                 normalize: dict[str, Any] | None = None, cache: Any = None, max_inflight: int | None = None,
                 missing: str = "fill", dtype: Any = None):
        # the generator validates every argument and holds what a read needs (sources, sample space,
        # layouts, output builder); it is never iterated here: one rank, unshuffled, so that its
        # numbering is the split's (``gen.sample(i)``) whatever torch.distributed says
        names = [variables] if isinstance(variables, str) else variables
        self._gen = BatchGenerator(ds, manifest, split, batch_size=1, shuffle=False, window=window, patch=patch,
                                   stride=stride, over=over, variables=names, output=output, stack=stack,
                                   normalize=normalize, max_inflight=max_inflight, rank=0, world_size=1, dtype=dtype,
                                   missing=missing)
        from xinsitu.cache.chunk_cache import resolve_cache

        self.cache = resolve_cache(cache)
        self.split, self.output = split, output
        self._setup()

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._loader: BufferLoader | None = None
        self._pid = -1
        self._io: dict[str, Any] = {"calls": 0, "samples": 0}
        self._last: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        # what a spawned worker gets: the configuration, not this process's reader, lock or buffers
        state = self.__dict__.copy()
        for k in ("_lock", "_loader", "_pid", "_io", "_last"):
            state.pop(k)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    # ------------------------------------------------------------------ sizes and names
    def __len__(self) -> int:
        return self._gen.space.n_samples

    @property
    def channels(self) -> list[str]:
        """Channel names of a stacked sample, in order (as ``BatchGenerator.channels``)."""
        return self._gen.channels

    @property
    def variables(self) -> list[str]:
        """The variables a sample carries, in order."""
        return list(self._gen.layouts)

    @property
    def io_stats(self) -> dict[str, Any]:
        """Reads of this process since the dataset was made (or came to this process): ``calls``,
        ``samples`` and the reader's counters (``chunks``, ``requests``, ``bytes_read``,
        ``bytes_decoded``, ``decode_s``, ``missing``, and the cache's hits and misses where there is
        a cache); ``last``: the same for the last call alone."""
        return {**self._io, "last": dict(self._last)}

    # ------------------------------------------------------------------ access
    def __getitem__(self, i: Any) -> Any:
        """Sample ``i`` (no batch axis)."""
        if isinstance(i, (list, tuple, range, np.ndarray)) and np.ndim(i) > 0:
            raise TypeError(f"index must be an integer, got {type(i).__name__}: for several samples use "
                            "d.batch(indices), or a DataLoader with batch_size= (it calls d.__getitems__)")
        i = self._ids([_index("index", i)], "index")
        batch = self._read(i)
        return self._item(batch, 0)

    def __getitems__(self, indices: Any) -> SampleBatch:
        """Samples ``indices`` read in one pass (each chunk once): the per-sample items, and the batch
        as ``.batch``."""
        batch = self.batch(indices)
        n = self._last["samples"]
        return SampleBatch([self._item(batch, k) for k in range(n)], batch)

    def batch(self, indices: Any) -> Any:
        """Samples ``indices`` as one batch (a leading batch axis / ``sample`` dim), read in one pass.

        Parameters
        ----------
        indices : sequence of int or 1-d integer array
            Sample numbers (negative ones count from the end); duplicates and any order allowed.

        Returns
        -------
        The batch in the dataset's output kind, equal to ``batches()``'s for the same samples.
        """
        return self._read(self._ids(indices, "indices"))

    def _ids(self, indices: Any, name: str) -> np.ndarray:
        """``indices`` as an int64 array in ``[0, len)`` (negatives wrapped, as Python does). The range is
        checked on the values given, before any cast: ``2**64 - 1`` (or a uint64) never wraps round."""
        if isinstance(indices, (str, bytes, dict)) or np.ndim(indices) == 0 and not isinstance(indices, list):
            raise TypeError(f"{name} must be a sequence of integers, got {type(indices).__name__} {indices!r}")
        if isinstance(indices, (list, tuple, range)):
            # one by one, as Python ints: numpy would make [0, 2**64 - 1] float64, and [2**70] objects
            return self._in_range([_index(name, v) for v in indices])
        a = np.asarray(indices)
        if a.ndim != 1:
            raise TypeError(f"{name} must be a 1-d sequence of integers, got shape {a.shape}")
        if a.dtype.kind == "O" or (a.size == 0 and a.dtype.kind == "f"):
            return self._in_range([_index(name, v) for v in a.tolist()])
        if a.dtype.kind not in "iu":
            raise TypeError(f"{name} must be integers, got dtype {a.dtype}")
        n = len(self)
        bad = (a >= n) if a.dtype.kind == "u" else (a < -n) | (a >= n)  # uint64 compared as it is, never cast
        if bad.any():
            self._in_range([int(a[np.argmax(bad)])])
        ids = a.astype(np.int64)
        return np.where(ids < 0, ids + n, ids)

    def _in_range(self, vals: list[int]) -> np.ndarray:
        """Python ints checked against ``[-len, len)``, as an int64 array in ``[0, len)``."""
        n = len(self)
        for v in vals:
            if not -n <= v < n:
                raise IndexError(f"sample index {v} is out of range: split {self.split!r} has {n} samples")
        ids = np.array(vals, dtype=np.int64)
        return np.where(ids < 0, ids + n, ids)

    # ------------------------------------------------------------------ reading
    def _buffer_loader(self) -> BufferLoader:
        if self._loader is None or self._pid != os.getpid():  # a new process builds its own reader
            _check_fork(self._gen)
            gen = self._gen
            reader = Reader(gen.max_inflight, cache=self.cache)
            reader.on_missing = gen.missing
            self._loader = BufferLoader(gen.space, gen.layouts, reader)
            self._pid = os.getpid()
        return self._loader

    def _read(self, ids: np.ndarray) -> Any:
        """The batch of samples ``ids`` (in range), each chunk read once."""
        gen = self._gen
        if not len(ids):
            raise ValueError("indices is empty: give at least one sample index")
        uniq, inv = np.unique(ids, return_inverse=True)
        unit, local = gen.space.locate(uniq)
        units, first = np.unique(unit, return_index=True)  # uniq is sorted, so its units are too
        sparse = len(uniq) <= SPARSE_PER_UNIT * len(units) and self._regions_ok()
        with self._lock:
            loader = self._buffer_loader()
            before = _counters(loader.reader)
            if sparse:
                starts = np.concatenate([gen.space.unit_starts(int(u))[local[a:b]] for u, a, b in
                                         zip(units, first, np.append(first[1:], len(uniq)), strict=True)])
                batch = self._read_regions(loader, starts[inv])
            else:
                batch = self._read_units(loader, uniq, inv, units, first, local)
            self._last = {k: v - before[k] for k, v in _counters(loader.reader).items()}
            self._last["samples"] = len(ids)
            for k, v in self._last.items():
                self._io[k] = self._io.get(k, 0) + v
            self._io["calls"] += 1
        return batch

    def _regions_ok(self) -> bool:
        """Whether every sampled variable is a stored, unsharded zarr array: the reader then fetches a
        chunk that several regions of one call touch once (in memory or through dask, or through
        zarr for shards, each region is its own read)."""
        return all(lay.src.stored and not is_sharded(lay.src.array) for lay in self._gen.layouts.values()
                   if lay.has_sample_axis)

    def _read_units(self, loader: BufferLoader, uniq: np.ndarray, inv: np.ndarray, units: np.ndarray,
                    first: np.ndarray, local: np.ndarray) -> Any:
        """Dense samples: their units become the slots of one block of a one-off, unshuffled plan, read
        as ``batches()`` reads a shuffle block (one ``read_many`` per variable: a chunk that several
        units need, e.g. one a window spills into, is read once), and gathered from it."""
        gen = self._gen
        # one piece per unit, from its first sample asked for to its last (the unit is read whole anyway)
        last = np.append(first[1:], len(uniq)) - 1
        lo, hi = local[first], local[last] + 1
        plan = EpochPlan(units=units, lo=lo, hi=hi, block_chunks=len(units), n_samples=int((hi - lo).sum()),
                         batch_size=len(inv), drop_last=False, shuffle=False, seed=0, epoch=0, rank=0, world_size=1)
        block = _loop.run(loader.load(plan, 0))
        # the block's samples are in id order (units ascending, each piece in order): rows by search
        rows = np.searchsorted(block.ids, uniq)[inv]
        builder = gen.builder
        direct = builder.direct_stack(len(rows))  # gather straight into the stacked batch
        if direct is not None:
            return builder.finish_direct(direct, loader.gather(block, rows, direct[1]), block.starts[rows])
        return builder.build(loader.gather(block, rows), block.starts[rows])

    def _read_regions(self, loader: BufferLoader, starts: np.ndarray) -> Any:
        """Sparse samples: each one's region (its window/tile, other dims whole) read straight into its
        place in the batch, one ``read_many`` per variable (a chunk two samples share is read once).
        Only the chunks the samples touch are read, and only their part of each chunk is copied:
        a cache hit costs a sample's bytes, not a chunk's."""
        gen = self._gen
        sp, builder, n = gen.space, gen.builder, len(starts)
        direct = builder.direct_stack(n)
        raw: dict[str, np.ndarray] = {}
        reads: list[tuple[Any, list[tuple[dict[str, tuple[int, int]], np.ndarray]]]] = []
        for name, lay in gen.layouts.items():
            src = lay.src
            if not lay.has_sample_axis:  # no sampled dim: the same whole array in every batch (below)
                continue
            width = {sp.dims[k].name: sp.dims[k].width for k in lay.sampled}
            one = [src.dims.index(sp.dims[k].name) for k in lay.sampled if not sp.dims[k].keep]
            if direct is not None and name in direct[1]:
                out = direct[1][name]
            else:
                out = np.empty((n, *[width.get(d, src.shape[src.dims.index(d)]) for d in lay.out_dims]),
                               src.raw_dtype)
            raw[name] = out
            regions = []
            for i, row in enumerate(starts[:, lay.sampled].tolist()):
                region = {sp.dims[k].name: (a, a + sp.dims[k].width) for k, a in zip(lay.sampled, row, strict=True)}
                # a position-only sampled dim is one position in the region and no axis in the batch;
                # ``out[i, ...]`` is a view even where a sample is one value (``out[i]`` would be a scalar
                # copy, read into and thrown away)
                view = out[i, ...]
                regions.append((region, np.expand_dims(view, one) if one else view))
            reads.append((src, regions))
        static = {name: lay for name, lay in gen.layouts.items() if not lay.has_sample_axis}

        async def read() -> dict[str, np.ndarray]:
            await asyncio.gather(*(loader.reader.read_many(src, regions) for src, regions in reads))
            return await loader.load_static() if static else {}  # read once per process, as batches() does

        whole = _loop.run(read())
        for name, lay in static.items():
            raw[name] = whole[name][0].transpose(np.argsort(lay.order))
        if direct is not None:
            return builder.finish_direct(direct, raw, starts)
        return builder.build({name: raw[name] for name in gen.layouts}, starts)  # in variable order

    def _item(self, batch: Any, k: int) -> Any:
        """Sample ``k`` of ``batch`` without the batch axis (views where the kind allows)."""
        if isinstance(batch, (xr.Dataset, xr.DataArray)):
            return with_dim_indexes(batch.isel(sample=k)) if "sample" in batch.dims else batch
        if isinstance(batch, dict):
            lays = self._gen.layouts
            return {n: (a[k] if lays[n].has_sample_axis else a) for n, a in batch.items()}
        return batch[k]

    def __repr__(self) -> str:
        gen = self._gen
        wide = {d.name: d.width for d in gen.space.dims if d.keep}
        shape = f", window/patch {wide}" if wide else ""
        return (f"<xinsitu.InsituDataset {len(self)} samples of split {self.split!r}{shape}, "
                f"variables {self.variables}, output={self.output!r}"
                + (", stacked" if gen.builder.stack else "") + (f", cache={self.cache!r}" if self.cache else "") + ">")


def _check_fork(gen: BatchGenerator) -> None:
    """In a forked worker, fail at once where a read would need obstore or Icechunk (the fork policy of
    ``xinsitu.io.loop``, applied by ``xinsitu.batches.torch_dataset._check_fork``); the reader would refuse at its first
    read anyway."""
    if not _loop.in_forked_child():
        return
    try:
        from xinsitu.batches.torch_dataset import _check_fork as check
    except ImportError:  # no torch: the reader's backend refuses at the first read, the same way
        return
    check(gen)


# ---------------------------------------------------------------------- torch, lazily
@functools.cache
def _torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


_torch_cls: type | None = None


def _torch_class() -> type:
    """``TorchInsituDataset``: ``InsituDataset`` and ``torch.utils.data.Dataset`` (made once, on demand)."""
    global _torch_cls
    if _torch_cls is None:
        import torch.utils.data

        _torch_cls = type("TorchInsituDataset", (InsituDataset, torch.utils.data.Dataset), {
            "__module__": __name__, "__qualname__": "TorchInsituDataset",
            "__doc__": "``InsituDataset`` that is also a ``torch.utils.data.Dataset`` (torch is installed)."})
    return _torch_cls


def __getattr__(name: str) -> Any:
    # pickle finds the class by name: a spawned worker makes it here on first use
    if name == "TorchInsituDataset":
        return _torch_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
