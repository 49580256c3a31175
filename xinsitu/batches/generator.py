"""``BatchGenerator``: batches of one split, read in place.

The generator holds the configuration (checked, see ``sampling``), the epoch and the resume
state, and answers questions about them without I/O (``len``, ``plan``, ``batch_ids``,
``shuffle_quality``, the repr). Iterating it runs one ``pipeline.EpochRun``: the I/O loop
reads buffers ahead, a prefetch thread gathers batches, the caller takes them.
"""

from __future__ import annotations

import asyncio
import os
import warnings
import weakref
from typing import Any

import numpy as np
import xarray as xr

from xinsitu.batches import describe
from xinsitu.batches.ahead import Ahead, mark, may_read_ahead, quiet, served, settle, take
from xinsitu.batches.buffer import BUFFER_BUDGET, BufferLoader, default_block_chunks
from xinsitu.batches.direct import DeviceDirectLoader, DirectLoader, direct_reason
from xinsitu.batches.output import OutputBuilder, with_dim_indexes
from xinsitu.batches.pipeline import DirectRun, EpochRun
from xinsitu.cache.chunk_cache import ChunkCache, resolve_cache
from xinsitu.cache.device_tier import CupyArrays, HostArrays
from xinsitu.cache.keys import array_store, file_clock_ns
from xinsitu.codecs.gpu import CupyGpu, resolve_decode
from xinsitu.codecs.gpu_chain import GpuChain
from xinsitu.index.channels import channel_names, check_stats_origin
from xinsitu.index.manifest import SplitManifest
from xinsitu.index.plan import EpochPlan, epoch_plan, epoch_size, plan_head, plan_quality, segment_plan
from xinsitu.index.sampling import check_split, dist_defaults, flag, int_arg, positive_int, sampling
from xinsitu.index.snapshot import writable_session
from xinsitu.index.state import check_state, make_state
from xinsitu.io import loop as _loop
from xinsitu.io.reader import Reader
from xinsitu.repr import formatting


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
    output : {"xarray", "dataarray", "numpy", "torch", "cupy", "jax"}, default "xarray"
    stack : bool or list of str, default False
        One ``(sample, channel, ...)`` array per batch (see ``channels``): variables as
        channels, a dim the other variables lack (``level`` beside surface fields) as one channel
        per label, ``{var}_{label}``: with ``variables=["z", "t2m", "u", "v"]`` the usual
        weather-model input ``(B, C, H, W)``. A list of dims (e.g. ``["level"]``) folds those
        dims into channels ``{var}_{label}`` even where every variable has them; a selected
        variable lacking them (``t2m``) is one channel ``{var}``. Variable then label order.
    normalize : dict, optional
        Statistics from ``ds.insitu.stats`` (``m.stats``): ``(x - mean) / std`` per channel,
        applied by channel name (any order of ``variables=``).
    device : str, torch.device or jax.Device, optional
        Where torch tensors go (e.g. ``"cuda:0"``); for ``output="jax"`` a jax device
        (default: jax's default device).
    transform : callable, optional
        ``fn(batch) -> anything``, applied to every finished batch in the background
        (prefetch) thread, on host values (numpy, CPU tensors) before the ``device=`` copy,
        which then moves every array in what it returned (with ``decode="gpu"`` the batch is
        built on the device, and the transform gets it there). Its exceptions are raised to the
        caller from the iterator. Must pickle for spawned DataLoader workers.
    dtype : str or numpy dtype, optional
        The dtype of every output array (e.g. ``"float32"``, what a model takes): values are xarray's
        decoded (and normalised) values cast to it, in the one copy that builds the batch. Default:
        each variable's own (a stacked batch: their common result dtype).
    block_chunks : int, optional
        Chunk blocks (units) per buffer: read together, samples drawn at random from them. Default:
        as many as the buffer's byte budget allows (``buffer_budget``, about 1 GiB for the buffers
        read ahead and held), between 2 and 16. Where every chunk block is one sample (one time step
        per chunk) no buffer is held: chunks are decoded straight into the batch, and this only
        shapes the shuffle.
    max_inflight : int, optional
        Chunk requests in flight at most. Default: sized from the store's latency, from 64
        (local disk) up to 256 (object stores; see ``xinsitu.io.inflight.InflightLimit``).
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
    decode : {"auto", "cpu", "gpu"}, default "auto"
        Where chunks are decoded: ``"gpu"`` on the CUDA device the batches go to (nvCOMP: zstd,
        lz4, gzip, zlib), raising where that cannot be (no CUDA device, the ``gpu`` extra missing,
        a codec chain nvCOMP cannot decode); ``"cpu"`` never on the GPU; ``"auto"`` on the GPU
        where it can and where it is faster: the first buffer of each codec chain is decoded both
        ways (the first-use check) and timed, and the faster path is kept for that chain for the
        rest of the process on that device. ``decode_summary`` (and the repr) say which path each
        variable takes and why, with the two rates. On the GPU path a buffer's chunks (every
        variable's) are decoded together straight into device memory, and batches are gathered,
        normalised and stacked there -- or, where each chunk block is one sample, decoded straight
        into the device batch's channels; it needs each buffer slot to be one whole chunk and,
        with ``cache=``, keeps them in GPU memory (``ChunkCache(device=...)``'s budget, or the
        memory tier's up to half the free device memory).
    """

    #: read the next epoch's first buffer while an epoch ends (iterating the whole epoch); False
    #: reads every epoch's chunks within it (e.g. to log which chunks each epoch reads)
    read_ahead = True
    #: bytes the buffers read ahead and held may take (with ``block_chunks=None``), or the batches read
    #: ahead where no buffer is needed (SPEC §5)
    buffer_budget = BUFFER_BUDGET

    def __init__(self, ds: xr.Dataset, manifest: SplitManifest, split: str, *, batch_size: int = 32,
                 shuffle: bool = True, seed: int = 0, window: dict[str, int] | None = None,
                 patch: dict[str, int] | None = None, stride: dict[str, int] | None = None,
                 over: str | list[str] | None = None, variables: str | list[str] | None = None,
                 output: str = "xarray", stack: bool | list[str] = False, dtype: Any = None,
                 normalize: Any = None, device: Any = None, block_chunks: int | None = None,
                 max_inflight: int | None = None, drop_last: bool = False,
                 rank: int | None = None, world_size: int | None = None, progress: bool = False,
                 missing: str = "fill", cache: bool | str | os.PathLike[str] | ChunkCache | None = None,
                 transform: Any = None, decode: str = "auto"):
        check_split(manifest, split)
        self.batch_size = positive_int("batch_size", batch_size)
        self._block_chunks_given = block_chunks is not None
        if block_chunks is not None:
            block_chunks = positive_int("block_chunks", block_chunks)
        self.max_inflight = None if max_inflight is None else positive_int("max_inflight", max_inflight)
        self.seed = int_arg("seed", seed, 0)  # numpy's generators take no negative seed
        self.shuffle, self.drop_last = flag("shuffle", shuffle), flag("drop_last", drop_last)
        self.rank, self.world_size = dist_defaults(rank, world_size)
        self.manifest, self.split, self.progress = manifest, split, flag("progress", progress)
        if missing not in ("fill", "raise"):
            raise ValueError(f"missing must be 'fill' or 'raise', got {missing!r}")
        self.missing = missing
        self.cache = resolve_cache(cache)
        sampled = sampling(ds, manifest, split, window=window, patch=patch, stride=stride, over=over,
                           variables=variables, stacklevel=3, valid_only=True)
        self.sampling = sampled
        self.sources, self.geometry, self.space, self.layouts = (sampled.sources, sampled.geometry, sampled.space,
                                                                 sampled.layouts)
        #: chunk blocks per buffer: given, or what the byte budget allows (for the Dataset's variables: one
        #: order whichever are read)
        self.block_chunks = block_chunks if block_chunks is not None else default_block_chunks(
            self.space, self.layouts, self.buffer_budget, ds)
        self.builder = OutputBuilder(ds, self.space, self.layouts, output, stack, device, normalize=normalize,
                                     transform=transform, dtype=dtype)
        if normalize is not None:  # statistics of this manifest's split, not of val/test or another manifest
            check_stats_origin(normalize, manifest, split, stacklevel=4)
        self.dtype = self.builder.out_dtype
        self.normalize = normalize
        self.output = output
        # where each variable's chunks decode (SPEC §4 GPU); raises where decode='gpu' cannot be honoured
        self.decode = decode
        self._gpu: Any = None  # the GPU path's device side (``codecs.gpu.CupyGpu``), where a variable takes it
        self._kept: set[str] = set()  # variables decoded on the host whose chunks a device cache tier keeps
        self._chains: dict[str, GpuChain] = {}  # what the codecs allow, before the first buffers' verdicts
        self._ds = ds
        self.epoch = 0
        self._resume_batch = 0
        self._loads = 0  # states loaded: a persistent DataLoader worker whose copy missed one refuses
        self._yielded_at = (0, 0)  # (epoch, batches) of the last batch handed out: what state_dict saves
        self._live = 0  # iterations under way
        # the epochs of the torch datasets made from this generator (``to_torch``), in shared memory: a
        # ``set_epoch`` here reaches their persistent DataLoader workers, which keep copies of this generator
        self._shared: list[weakref.ref[Any]] = []  # torch datasets' shared state (weak: let go with them)
        self._runs = 0  # iterations begun (the read ahead an iteration asks for is made only while it is the last)
        self._last_whole: int | None = None  # the epoch the last whole iteration (not iter_batches) went through
        self._reader: Reader | None = None
        self._loader: BufferLoader | None = None
        self._aside: BufferLoader | None = None  # what ``sample`` reads through (``_sample_loader``)
        self._direct: DirectLoader | None = None
        self._pid = -1
        self._io: dict[str, Any] = {}
        # the next epoch's first buffer, read while an epoch ends (``ahead.Ahead``)
        self._ahead: Ahead | None = None
        self._channels: list[str] | None = None
        # elastic resume: the (world_size, batches) hops of epoch ``_elastic_epoch`` so far (see state.py)
        self._elastic: list[tuple[int, int]] = []
        self._elastic_epoch = -1
        self._elastic_plan: EpochPlan | None = None
        self._check_not_empty()
        cuda_target = self.builder.cuda_target()
        self.decode_paths = resolve_decode(decode, cuda_target, {n: lay.src.array for n, lay in self.layouts.items()})
        if any(c.gpu for c in self.decode_paths.values()) or (self._device_tier() and cuda_target is None):
            self._use_gpu(CupyGpu(), self.decode_paths)
        if self._device_tier() and self._gpu is None and self.cache is not None:  # asked for, and idle: said
            why = "; ".join(sorted({c.reason for c in self.decode_paths.values()})) or "no variable goes there"
            self.cache.note_device_unused(f"split {self.split!r}", why)
        #: why batches go through a shuffle buffer (None: filled in place, ``xinsitu.batches.direct``; on the device
        #: too, on the GPU path)
        self.buffer_reason = direct_reason(self.space, self.layouts, self.builder)

    def _check_not_empty(self) -> None:
        """Refuse a generator that would yield nothing: an empty epoch looks like a finished one."""
        self.sampling.check_not_empty()
        if self.world_size > 1 or self.drop_last:
            n = self.plan(self.epoch).n_batches
            if n == 0:
                raise ValueError(f"rank {self.rank} of world_size={self.world_size} gets no batch: split "
                                 f"{self.split!r} has {self.space.n_samples} samples, too few for "
                                 f"{self.world_size} rank(s) x batch_size={self.batch_size}"
                                 + (" with drop_last=True" if self.drop_last else "")
                                 + "; use fewer ranks or a smaller batch_size")

    # ------------------------------------------------------------------ set-up
    def _buffer_loader(self) -> BufferLoader:
        if self._loader is None or self._pid != os.getpid():  # a new process gets its own reader
            self._loader = self._new_loader()
            self._reader = self._loader.reader
            self._direct = self._aside = None
            self._pid = os.getpid()
        return self._loader

    def _new_loader(self) -> BufferLoader:
        """A ``BufferLoader`` over a reader of its own (the cache and the GPU's side shared)."""
        reader = Reader(self.max_inflight, cache=self.cache)
        reader.on_missing = self.missing
        on_gpu, tier = {}, None
        if self._gpu is not None:
            on_gpu = {n: c for n, c in self.decode_paths.items() if c.gpu or n in self._kept}
            arrays = CupyArrays() if self._gpu.kind == "cupy" else HostArrays()  # the tier's device memory
            tier = None if self.cache is None else self.cache.device_tier(arrays, self._gpu.free())
        return BufferLoader(self.space, self.layouts, reader, self._gpu, on_gpu, tier,
                            follow_verdicts=self.decode == "auto")

    def _sample_loader(self) -> BufferLoader:
        """What ``sample`` reads through: a loader whose reader is not the epochs' (``io_stats`` counts the
        epoch's reads, not those of samples asked for while it runs)."""
        self._buffer_loader()  # (a new process, or a new GPU side: made again with it)
        if self._aside is None:
            self._aside = self._new_loader()
        return self._aside

    def _item_loader(self) -> BufferLoader | DirectLoader:
        """What reads this generator's batches: a ``DirectLoader`` (no buffer) or the ``BufferLoader``."""
        loader = self._buffer_loader()
        if self.buffer_reason is not None:
            return loader
        if self._direct is None:
            if self._gpu is not None:  # filled in place on the device: no device buffer, no gather
                self._direct = DeviceDirectLoader(self.space, self.layouts, loader.reader, self.builder, self._gpu,
                                                  loader.on_gpu, loader.tier, follow_verdicts=self.decode == "auto")
            else:
                self._direct = DirectLoader(self.space, self.layouts, loader.reader, self.builder)
        return self._direct

    def _device_tier(self) -> bool:
        """Whether the cache has a tier in GPU memory asked for (``ChunkCache(device=)``)."""
        return bool(self.cache is not None and self.cache.device_budget)

    def _use_gpu(self, gpu: Any, chains: dict[str, GpuChain]) -> None:
        """Decode on the GPU (``gpu``: its device side) the variables whose ``chains`` allow it and
        whose buffers it can fill (each slot one whole chunk), keeping them, with ``cache=``, in a
        tier in GPU memory (``ChunkCache.device_tier``); with a tier asked for (``ChunkCache(device=)``),
        the chunks of the others that such buffers can hold are decoded on the host and kept there too;
        ``decode='gpu'`` raises naming the others. Gathering, CF decoding, normalising and stacking
        then happen on the device too. With ``decode='auto'``, a chain whose first buffer (in this process,
        on this device) decoded faster by the CPU path than on the GPU (``gpu.verdicts``) stays on the CPU,
        and where no variable is left on the GPU, batches are built on the host as without one."""
        self._chains = dict(chains)
        paths, kept = {}, set()
        # transform= takes the batch on the host, before the device= copy (SPEC 4): only decode='gpu'
        # builds the batch on the device, and then the transform gets it there (no loader to ask then)
        host = self.decode != "gpu" and self.builder.transform is not None
        loader = None if host else self._buffer_loader()
        for n, c in chains.items():
            why = ("transform= takes batches on the host (decode='gpu' builds them on the device, transform= "
                   "included)") if loader is None else loader.device_reason(n)
            if c.gpu and why is not None:
                c = GpuChain(False, why)
            elif c.gpu and self.decode == "auto" and not self._gpu_pays(gpu, c):
                c = GpuChain(False, f"{c.reason}: {gpu.verdicts[c].words()}")
            if not c.gpu and why is None and self._device_tier():  # decoded on the host, kept on the device
                c = GpuChain(False, f"{c.reason}; its chunks kept in GPU memory")
                kept.add(n)
            paths[n] = c
        if self.decode == "gpu":
            bad = {n: c.reason for n, c in paths.items() if not c.gpu}
            if bad:
                raise ValueError("decode='gpu': the chunks of " + ", ".join(f"{n!r} ({r})" for n, r in bad.items())
                                 + " cannot be decoded on the GPU; leave decode='auto' to decode those on the CPU")
        self.decode_paths = paths
        self._kept = kept
        self._gpu = gpu if kept or any(c.gpu for c in paths.values()) else None
        self._loader = self._aside = None  # made again, with the GPU's side
        self._direct = None
        self.builder.use_gpu(self._gpu)

    @staticmethod
    def _gpu_pays(gpu: Any, chain: GpuChain) -> bool:
        """Whether ``chain`` decodes on the GPU under ``decode='auto'``: not measured yet (its first buffer
        decides), or its first buffer decoded faster there than by the CPU path."""
        verdict = gpu.verdicts.get(chain)
        return verdict is None or verdict.gpu_faster

    def _follow_verdicts(self) -> None:
        """Before an iteration (none under way), with ``decode='auto'``: the variables whose chain's first
        buffer decoded faster by the CPU path go to the CPU path (``_use_gpu`` again); where none is left on
        the GPU, batches are built on the host again, as without a GPU (filled in place where they can be).
        A first buffer read ahead by the other path is dropped."""
        gpu = self._gpu
        if gpu is None or self.decode != "auto" or self._live:
            return
        if all(self._gpu_pays(gpu, c) for c in self.decode_paths.values() if c.gpu):
            return
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.pid == os.getpid():
            _loop.run(settle(ahead.task), timeout=30)
        self._use_gpu(gpu, self._chains)
        self.buffer_reason = direct_reason(self.space, self.layouts, self.builder)

    # ------------------------------------------------------------------ epochs
    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from the next iteration on (an iterator already made keeps its epoch)."""
        epoch = int_arg("epoch", epoch, 0)
        if epoch != self.epoch:
            self._resume_batch = 0
            if epoch != self._elastic_epoch:  # an elastic remainder belongs to the epoch it was saved in
                self._elastic, self._elastic_epoch, self._elastic_plan = [], -1, None
            if not self._live:  # a state saved now is the new epoch's start; else the live iterator's place
                self._yielded_at = (epoch, 0)
        self.epoch = epoch
        for shared in self._shared_with_workers():
            shared[0] = self.epoch

    def _shared_with_workers(self) -> list[Any]:
        """The shared state of the torch datasets made by ``to_torch`` that are still alive (see there)."""
        live = [(ref, shared) for ref in self._shared if (shared := ref()) is not None]
        self._shared = [ref for ref, _ in live]
        return [shared for _, shared in live]

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
        size = None if self.elastic_remainder else epoch_size(self.space, world_size=self.world_size, rank=self.rank,
                                               batch_size=self.batch_size, drop_last=self.drop_last)
        if size is None:
            p = self.plan()
            return p.n_samples, len(p.units)
        return size

    def __len__(self) -> int:
        full, rest = divmod(self._epoch_size()[0], self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    @property
    def elastic_remainder(self) -> bool:
        """Whether the current epoch is the rest of one saved by a run of another world size
        (``load_state_dict``): its plan deals what no rank had yielded across this run's ranks."""
        return bool(self._elastic) and self.epoch == self._elastic_epoch

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
        return self._batches(self.epoch, start, None, self.progress, ahead=True)

    def iter_batches(self, start: int = 0, stop: int | None = None, *, progress: bool | None = None) -> Any:
        """Batches ``start..stop-1`` of this rank's current epoch (``stop=None``: to its end), reading
        only the buffers they draw from; a DataLoader worker iterates its share this way.

        The epoch is fixed now: a later ``set_epoch`` takes effect at the next iteration.
        ``progress`` (default: the generator's) shows a tqdm bar for this iteration.
        """
        start = int_arg("start", start, 0)
        stop = None if stop is None else int_arg("stop", stop, 0)
        progress = self.progress if progress is None else flag("progress", progress)
        return self._batches(self.epoch, start, stop, progress)

    def _batches(self, epoch: int, start: int, stop: int | None, progress: bool, ahead: bool = False) -> Any:
        self._follow_verdicts()
        plan = self.plan(epoch)
        plan = plan_head(plan, plan.n_batches if stop is None else stop)  # blocks past the last batch: unread
        self._live += 1
        self._yielded_at = (epoch, start)
        loader = self._item_loader()
        first, counters_from = self._take_ahead(epoch, start)
        # a whole epoch (not a worker's range of batches): read the next one's first buffer as it ends
        self._runs += 1
        run_no = self._runs
        nxt = epoch if self._last_whole == epoch else epoch + 1  # (this one's: iterated again without set_epoch)
        self._last_whole = epoch if ahead else self._last_whole
        at_start = served(loader)
        then = (lambda: self._read_ahead(nxt, run_no, at_start)) if ahead and stop is None and self.read_ahead else None
        kind = DirectRun if isinstance(loader, DirectLoader) else EpochRun
        run = kind(plan, start, loader, self.builder, first=first, counters_from=counters_from, then=then,
                   budget=self.buffer_budget)
        bar = None
        if progress:
            bar = describe.progress_bar(total=plan.n_batches, initial=start, desc=f"{self.split} epoch {epoch}",
                                        unit="batch")
        try:
            for i, batch in run:
                self._yielded_at = (epoch, i + 1)  # the state of the last batch handed out (as grain keeps it)
                if bar is not None:
                    bar.update(1)
                yield self.builder.hand_out(batch)  # a CUDA batch: safe on the caller's current stream
                del batch  # not held while the next is awaited: its memory goes back to the pool once the caller's done
        finally:
            run.close()
            self._io = run.report()
            self._warn_missing()
            self._live -= 1
            if not self._live and self.epoch != epoch:  # set_epoch came during this iteration: now it counts
                self._yielded_at = (self.epoch, 0)
            if bar is not None:
                bar.close()

    def _read_ahead(self, epoch: int, run_no: int, at_start: tuple[int, ...] | None = None) -> None:
        """On the I/O loop, once every buffer of an epoch is loaded and one is given back (``EpochRun``'s
        ``then``): start reading ``epoch``'s first buffer (it depends only on the seed and the epoch), so
        that a training loop that goes on with ``set_epoch(epoch)`` finds it read. At most one buffer is
        held this way; the next iteration takes it where its plan starts with those very samples, else
        drops it. Not made once another iteration than the one asking (``run_no``) began: it reads its own;
        nor where every chunk of that iteration came from the cache's memory tier (``at_start``: ``served`` as
        it began): the next epoch's buffer is then a gather away, and one read now would be one more held while the
        caller holds its last batch (a batch's arrays made again, every page faulted in, each cached epoch)."""
        loader: Any = self._direct if self.buffer_reason is None else self._loader
        if loader is None or self._pid != os.getpid() or self._elastic or run_no != self._runs:
            return
        now = served(loader)
        if at_start is not None and now is not None and now[:2] == at_start[:2] and now[2] > at_start[2]:
            return
        if not all(lay.src.stored for lay in self.layouts.values()):
            # files read through dask (NetCDF, HDF5) hold library locks while read: a read running on
            # in the background could hold one when a DataLoader forks its workers
            return
        stores = self._stores()
        if not may_read_ahead(stores):
            return
        self._drop_ahead()
        reader = loader.reader
        counters = {k: getattr(reader.counters, k) for k in reader.counters.__dataclass_fields__}
        began = file_clock_ns()
        journal: list[Any] = []
        marks: dict[int, str] = {}

        async def first() -> Any:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, mark, stores, marks)  # before it reads
            plan = await loop.run_in_executor(None, self.plan, epoch)  # pure math, off the loop
            if isinstance(loader, DirectLoader):
                if not plan.n_batches:
                    return None
            elif plan.n_buffers == 0 or loader.passes_halo:
                return None  # windows spilling into later buffers: their halo plan starts with the run
            reader.journal = journal
            try:
                return await loader.load(plan, 0)
            finally:
                reader.journal = None

        task = asyncio.ensure_future(first())
        task.add_done_callback(quiet)
        self._ahead = Ahead(os.getpid(), epoch, task, counters, began, journal, stores, marks)

    def _stores(self) -> list[Any]:
        """The zarr stores the variables are read from, each once."""
        return list({id(st): st for lay in self.layouts.values() if lay.src.stored
                     and (st := array_store(lay.src.array)) is not None}.values())

    def _take_ahead(self, epoch: int, start: int) -> tuple[Any, dict[str, Any] | None]:
        """The first buffer read ahead for this iteration (a task and the counters when it began), or (None,
        None): ``ahead.take``."""
        ahead, self._ahead = self._ahead, None
        return take(ahead, epoch, start, self.shuffle, self._live)

    def _drop_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.pid == os.getpid():
            ahead.task.cancel()  # on the I/O loop (called there)

    def _warn_missing(self) -> None:
        """Once per epoch: chunks that had no object read as fill values (zarr's rule), but a deleted
        archive or a store answering 404 looks just like that."""
        n = self._io.get("missing", 0)
        if n and self.missing == "fill":  # with "raise" the error has said it
            var, chunk, key = self._io["missing_chunk"]
            note = describe.missing_note(n, var, chunk, key)
            warnings.warn(f"epoch {self._io['epoch']} of split {self.split!r}: {note}. Pass missing='raise' to make "
                          "it an error.", UserWarning, stacklevel=3)

    def __getstate__(self) -> dict[str, Any]:
        # a pickled generator (e.g. sent to a spawned DataLoader worker) leaves this process's
        # reader and recycled block buffers behind: the new process builds its own
        if any(writable_session(st) for st in self._stores()):
            raise TypeError("a generator over a writable Icechunk session cannot be pickled or copied, so its batches "
                            "cannot come from another process (DataLoader workers under spawn or forkserver): open "
                            "the archive from a read-only session (repo.readonly_session(...)), or read in this "
                            "process (num_workers=0)")
        state = self.__dict__.copy()
        state.update(_reader=None, _loader=None, _aside=None, _direct=None, _pid=-1, _io={}, _live=0, _ahead=None,
                     _shared=[])
        return state

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Small JSON-able state: where this generator is in which epoch, and what it was made with.

        While an iteration runs, the place of the last batch it handed out (a ``set_epoch`` meanwhile
        counts from the next iteration on). Where DataLoader workers (``to_torch``) yield this epoch's
        batches, the place is theirs, not this process's: warned (checkpoint with torchdata's
        ``StatefulDataLoader`` then)."""
        if not self._live and any(int(s[4]) == self.epoch + 1 for s in self._shared_with_workers()):
            warnings.warn(f"state_dict(): DataLoader workers over gen.to_torch() are yielding epoch {self.epoch}'s "
                          "batches, and this process does not know their place: this state resumes at the start of "
                          "the epoch (repeating what was trained on). Checkpoint mid-epoch with torchdata's "
                          "StatefulDataLoader (its state_dict), or after set_epoch() for the next epoch",
                          UserWarning, stacklevel=2)
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
        self._loads += 1
        for shared in self._shared_with_workers():  # the next DataLoader iteration's workers resume
            shared[0], shared[1], shared[3], shared[4] = epoch, 0, self._loads, 0

    def _load_worker_state(self, state: dict[str, Any]) -> None:
        """Take a DataLoader worker's ``state`` (``to_torch``): its epoch, checked like a state of this
        generator's; the batch to resume after is the worker's to count. A worker's state within an
        elastically resumed epoch names the resumes that epoch went through: this worker's batches are
        cut from that epoch's rest, as its run's were (a fresh copy of the generator has none)."""
        epoch, hops = state.get("epoch"), state.get("elastic")
        before = (self._elastic, self._elastic_epoch, self._elastic_plan)
        if hops and isinstance(hops, list) and isinstance(epoch, int):
            self._elastic, self._elastic_epoch, self._elastic_plan = [tuple(h) for h in hops], epoch, None
        try:
            check_state(self, state)
        except BaseException:
            self._elastic, self._elastic_epoch, self._elastic_plan = before
            raise
        self.set_epoch(int(state["epoch"]))

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
            self._channels = channel_names(self._ds, self.layouts, tuple(d.name for d in self.space.dims if d.keep),
                                           self.builder.fold)
        return list(self._channels)

    def shuffle_quality(self, max_batches: int = 200) -> float:
        """How well batches mix chunks, 0..1 (1.0 ~ a global shuffle); computed from the plan.

        Scores the first ``max_batches`` batches of this rank's epoch (no I/O; only the buffers those
        batches come from are ordered) by how many chunk blocks each draws from, not by their order:
        batches in the split's order (``shuffle=False``) of chunks of one or a few samples score high.
        """
        return plan_quality(self.plan(), self.space, self.batch_size, max_batches)

    def sample(self, i: int) -> xr.Dataset:
        """Sample ``i`` of the whole split (unshuffled order) as a labeled ``xr.Dataset``; a negative
        ``i`` counts from the end, as in a list (and the map-style dataset)."""
        i, n = int_arg("i", i), self.space.n_samples
        if not -n <= i < n:
            raise IndexError(f"sample index i={i} is out of range: split {self.split!r} has {n} samples")
        i = i + n if i < 0 else i
        unit, local = self.space.locate(np.array([i]))
        plan = EpochPlan(units=unit, lo=local, hi=local + 1, block_chunks=1, n_samples=1, batch_size=1,
                         drop_last=False, shuffle=False, seed=0, epoch=0, rank=0, world_size=1)
        loader = self._sample_loader()
        block = _loop.run(loader.load(plan, 0))
        raw = loader.gather(block, np.array([0]))
        raw = {n: self._gpu.to_host(a) if n in block.on_device else a for n, a in raw.items()}
        values = self.builder.decode(raw)
        coords = self.builder.sample_coords(block.starts[:1])
        if "sample" in coords.dims:  # not where no sampled dim has a coordinate
            coords = coords.isel(sample=0)
        # (a variable without the split dim is copied: the loader keeps its values for every batch)
        data = {n: xr.Variable(self.builder.dims_of(n)[1:] if self.layouts[n].has_sample_axis else
                               self.layouts[n].src.dims, a[0] if self.layouts[n].has_sample_axis else np.array(a),
                               attrs=self.builder.attrs[n]) for n, a in values.items()}
        return with_dim_indexes(xr.Dataset(data, coords=coords.coords, attrs=self.builder.ds_attrs))

    def to_torch(self) -> Any:
        """A ``torch.utils.data.IterableDataset`` over this generator (use ``batch_size=None``)."""
        from xinsitu.batches.torch_dataset import InsituIterableDataset

        ds = InsituIterableDataset(self)
        self._shared.append(weakref.ref(ds._shared))
        return ds

    @property
    def buffer_summary(self) -> str:
        """What memory the batches are assembled in, in words: no buffer (chunks decoded straight into the
        batch), or the buffer's chunk blocks and bytes, and whether a byte budget or ``block_chunks=`` set them."""
        return describe.buffer_words(self)

    @property
    def decode_summary(self) -> str:
        """Which path each variable's chunks decode on, and why, in words (one line where all alike): on the
        GPU path with the two rates its chain's first buffer decoded at (``decode='auto'`` keeps the faster
        path), or the CPU path's reason."""
        said = {n: describe.decode_words(self, c) for n, c in self.decode_paths.items()}
        if len(set(said.values())) == 1:
            return next(iter(said.values()))
        return "; ".join(f"{n}: {w}" for n, w in said.items())

    def _repr_parts(self, drawing: bool = False) -> tuple[str, str, list[Any]]:
        """Title, headline and sections of both reprs (``xinsitu.repr.formatting.text_repr``)."""
        return describe.generator_parts(self, drawing)

    def __repr__(self) -> str:
        return formatting.text_repr(self)

    def _repr_html_(self) -> str:
        return formatting.html_repr(self)
