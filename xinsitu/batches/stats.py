"""Normalisation statistics of one split, from one streaming pass over its chunks.

``compute_stats`` reads the split's units (chunk blocks along the split dims) through the
async reader that batches use, each chunk once and many in flight. Each chunk is reduced
in the decode thread right after decoding, while it is still in cache, and is copied
nowhere: its values are CF-decoded and reduced per channel into moments (count, mean,
M2, min, max, NaN count, ``moments.Moments``). Statistics are taken over the split's
*positions*: every position along the split dims inside the split's chunk blocks,
counted once, whatever window, patch or ``over`` a generator later uses; other dims are
taken whole.

The moments of the pieces are added up *exactly* (``moments.ChannelSums``), so the result
does not depend on the order the pieces arrive in nor on how they are grouped. That is
what makes the pass splittable: ``StatsPass.part(i, n)`` reduces the i-th of n shares of
the split's units to a small JSON-able partial result, and ``merge_stats`` adds partials
up, in any order, to the very bits one pass gives (``compute_stats`` is itself the merge
of one part; with ``client=`` the parts run on a Dask cluster, ``xinsitu.batches.cluster``).

``diffs="time"`` also reduces the one-step differences ``x[t + 1] - x[t]`` along that
split dim, for pairs of positions that are both in the split (never across a gap or
another split's blocks). Pairs inside a chunk's piece are differenced there; a pair
across the edge of two pieces (chunks, units) is made from the last and first slab of
the two when both have been read (``StatsPass._meet``); a part reads the first slab of
the unit after its last one (a halo) where that unit belongs to another part.

Channels are named by the one channel rule (``channels.plan_channels``) for the same variables: each
variable, or ``{var}_{label}`` per label of a dim the other selected variables lack.
``channels.normalizer`` turns the result into the ``(x - mean) / std`` step of the batch gather.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import xarray as xr

from xinsitu.batches.cluster import (
    archive_of,
    check_client,
    job_digest,
    part_arg,
    parts_in_order,
    run_parts,
    selection_of,
    warn_missing,
)
from xinsitu.batches.describe import progress_bar
from xinsitu.batches.moments import ChannelSums, _channel_rows, channel_moments, chunk_moments
from xinsitu.cache.chunk_cache import resolve_cache
from xinsitu.index.channels import RESERVED, cf_decoder, channel_plan, check_fold, decodes_to_itself, fold_dims
from xinsitu.index.manifest import SplitManifest
from xinsitu.index.sampling import check_split, flag, positive_int, sampling
from xinsitu.index.snapshot import snapshot_of_sources
from xinsitu.io import loop as _loop
from xinsitu.io.reader import Reader

#: the keys a variable's entry has besides ``moments.STAT_KEYS``, with ``diffs=``
DIFF_KEYS = ("diff_mean", "diff_std", "diff_count")
#: units in flight: at least this many buffers' worth (times ``block_chunks``; each unit holds only its
#: chunks' compressed bytes). Not the batch pipeline's read-ahead (``pipeline.READ_AHEAD_BUFFERS``)
INFLIGHT_BUFFERS = 3
#: the format of a partial result (``StatsPass.part``)
PART_VERSION = 1


# ----------------------------------------------------------------------------- the pass
#: a piece's moments per channel: ``(channel, chunk_moments(...))``
Piece = tuple[int, tuple[int, int, float, float, float, float]]


def diff_dim(diffs: Any, manifest: SplitManifest) -> str | None:
    """``diffs=`` checked: None, or the name of a split dim of ``manifest``."""
    if diffs is None:
        return None
    if not isinstance(diffs, str):
        raise TypeError(f"diffs must be the name of a split dim (a str) or None, got {type(diffs).__name__} {diffs!r}")
    if diffs not in manifest.dims:
        raise ValueError(f"diffs={diffs!r}: one-step differences are taken along a split dim of the manifest, "
                         f"{list(manifest.dims)}; {diffs!r} is not one")
    return diffs


def _along(a: np.ndarray, ax: int, lo: int | None, hi: int | None) -> np.ndarray:
    """``a[..., lo:hi, ...]`` on axis ``ax`` (a view)."""
    return a[(slice(None),) * ax + (slice(lo, hi),)]


def _diff_dtype(dt: np.dtype) -> np.dtype:
    """The dtype one-step differences are taken in: float32 and float64 as they are, others in float64
    (integers would wrap round, float16 would round)."""
    return dt if dt in (np.dtype(np.float32), np.dtype(np.float64)) else np.dtype(np.float64)


class StatsPass:
    """One streaming pass over a split's units (or a share of them), reduced per channel in the decode threads.

    Parameters
    ----------
    ds : the Dataset (stored, dask-backed or in memory), as for ``ds.insitu.batches``.
    manifest, split : the split whose positions are reduced.
    variables : variables to reduce (default: the data variables on the split dims, as for batches).
    block_chunks : units (chunk blocks) read ahead: at least ``INFLIGHT_BUFFERS * block_chunks``.
    max_inflight : chunk reads in flight at once (default: sized from the store's latency).
    reader : the ``Reader`` to read through (default: a new one); its ``counters`` show the cost.
    cache : a chunk cache for the new reader, as ``cache=`` of ``ds.insitu.batches`` (e.g. the one the
        training epochs use next: the statistics pass fills it).
    stack : dims to fold into channels, as ``stack=["level"]`` of ``batches`` (statistics per level,
        not pooled over levels; a variable lacking the dim, e.g. ``t2m``, is one channel).
    diffs : a split dim (e.g. ``"time"``): also the moments of one-step differences along it.

    A pass runs once (:meth:`run`, or :meth:`part` for a share of the units). It pickles without its
    reader, so a copy of one that has not run can run a part in another process (``xinsitu.batches.cluster``).
    """

    def __init__(self, ds: xr.Dataset, manifest: SplitManifest, split: str, variables: str | list[str] | None = None,
                 *, block_chunks: int = 16, max_inflight: int | None = None, reader: Reader | None = None,
                 cache: Any = None, stack: list[str] | None = None, diffs: str | None = None):
        # no window/patch/over: the samples are exactly the split's positions; the manifest, the variables
        # and the arguments are checked the way ds.insitu.batches checks them
        check_split(manifest, split)
        self.block_chunks = positive_int("block_chunks", block_chunks)
        self.max_inflight = None if max_inflight is None else positive_int("max_inflight", max_inflight)
        self.diffs = diff_dim(diffs, manifest)
        sampled = sampling(ds, manifest, split, variables=variables, stacklevel=3)
        sampled.check_not_empty()
        self.split = split
        self.space, self.layouts = sampled.space, sampled.layouts
        clash = [n for n in self.layouts if n in RESERVED]
        if clash:
            raise ValueError(f"variable(s) {clash} are named like a key of the stats record {RESERVED}; "
                             "rename them (ds.rename) to compute statistics")
        for n, lay in self.layouts.items():
            if lay.src.dtype.kind not in "biuf":
                raise ValueError(f"variable {n!r} has dtype {lay.src.dtype}; statistics need real numbers "
                                 "(select numeric variables with variables=[...])")
        self.cache = resolve_cache(cache)
        self.reader = reader
        self.decoders = {n: None if decodes_to_itself(lay.src) else cf_decoder(n, lay)
                         for n, lay in self.layouts.items()}
        self.fold = () if stack is None or stack is False else fold_dims(stack)
        check_fold(self.layouts, self.fold)
        self.channels, self.extra = channel_plan(ds, self.layouts, self.fold)
        # per variable: the axes (in its dims) of its extra dims, which are channels, and their sizes
        self._channel_axes = {n: [lay.src.dims.index(d) for d in self.extra[n]] for n, lay in self.layouts.items()}
        self._channel_sizes = {n: [lay.src.shape[ax] for ax in self._channel_axes[n]]
                               for n, lay in self.layouts.items()}
        self._chans_seen: dict[tuple[Any, ...], list[tuple[int, tuple[Any, ...] | None]]] = {}  # ``_channels_of``
        # per variable with the diffs dim: its axis
        self._diff_axis = {n: lay.src.dims.index(self.diffs) for n, lay in self.layouts.items()
                           if self.diffs is not None and not lay.static and self.diffs in lay.src.dims}
        #: what identifies this job's partial results (``part``): parts of other jobs are never merged with them
        self.job: dict[str, Any] = {
            "split": split, "manifest": manifest.fingerprint, "blocks": manifest.splits[split].digest(),
            "units": int(self.space.n_units), "snapshot": snapshot_of_sources(sampled.sources),
            "variables": list(self.layouts), "channels": {n: list(c) for n, c in self.channels.items()},
            "dims": {n: list(e) for n, e in self.extra.items()}, "stack": list(self.fold), "diffs": self.diffs,
            "diff_variables": list(self._diff_axis), "selection": selection_of(sampled.sources),
            "archive": archive_of(sampled.sources)}
        self.job_id = job_digest(self.job)
        self._done = False

    def __getstate__(self) -> dict[str, Any]:
        # a copy sent to another process (a Dask worker) leaves this process's reader behind
        state = self.__dict__.copy()
        state["reader"] = None
        for k in ("_parts", "_dparts", "_errors", "_starts", "_ends", "_lock"):
            state.pop(k, None)
        return state

    def __repr__(self) -> str:
        return (f"<xinsitu.StatsPass of split {self.split!r}: {self.space.n_units} units, variables "
                f"{list(self.layouts)}" + (f", diffs={self.diffs!r}" if self.diffs else "") + ">")

    def run(self, progress: bool = False) -> dict[str, Any]:
        """Read and reduce every chunk of the split once; return the stats record (``merge_stats`` of the
        one part that is the whole split)."""
        return merge_stats([self.part(0, 1, progress=progress)])

    def part(self, i: int, n: int, progress: bool = False) -> dict[str, Any]:
        """Read and reduce the ``i``-th of ``n`` shares of the split's units (units ``i*U//n`` to
        ``(i+1)*U//n - 1`` of ``U``, in split order; variables without a split dim in share 0); return the
        JSON-able partial result that ``merge_stats`` merges."""
        i, n = part_arg((i, n))
        if self._done:
            raise RuntimeError("a StatsPass runs once; make a new one")
        self._done = True
        if self.reader is None:
            self.reader = Reader(self.max_inflight, cache=self.cache)
        total = self.space.n_units
        a, b = i * total // n, (i + 1) * total // n
        self._parts: dict[str, list[Piece]] = {name: [] for name in self.layouts}
        self._dparts: dict[str, list[Piece]] = {name: [] for name in self._diff_axis}
        self._errors: list[BaseException] = []
        # the first and last slabs (along the diffs dim) of pieces whose neighbour has not been read yet,
        # keyed by (variable, the later position of the pair, where the slab lies along the other dims)
        self._starts: dict[tuple[Any, ...], np.ndarray] = {}
        self._ends: dict[tuple[Any, ...], np.ndarray] = {}
        self._lock = threading.Lock()
        jobs = self._jobs(a, b, static=i == 0)
        bar = None
        if progress:
            part = f", part {i + 1}/{n}" if n > 1 else ""
            bar = progress_bar(total=len(jobs), desc=f"stats of {self.split}{part}", unit="unit")
        fut = _loop.submit(self._run(jobs, bar))
        try:
            fut.result()
        except BaseException:
            fut.cancel()  # e.g. KeyboardInterrupt: stop the reads too
            raise
        finally:
            if bar is not None:
                bar.close()
        return self._partial(i, n, a, b)

    # -- what a part reads
    def _jobs(self, a: int, b: int, static: bool) -> list[list[tuple[str, dict[str, tuple[int, int]], Any]]]:
        """The reads of units ``a..b-1``: per unit, ``(variable, region, hook)`` of each variable it reads
        (a variable lacking some split dim: in the first unit of each of its blocks only); the variables
        without a split dim (``static``); and the halo reads of the diffs (see ``_halos``)."""
        owners = self._owners()
        jobs: list[list[tuple[str, dict[str, tuple[int, int]], Any]]] = []
        if static:
            still: list[tuple[str, dict[str, tuple[int, int]], Any]] = [
                (n, {}, functools.partial(self._reduce, n)) for n, lay in self.layouts.items() if lay.static]
            if still:
                jobs.append(still)
        units = np.arange(a, b, dtype=np.int64)
        for u, box in zip(units.tolist(), self._boxes(units), strict=True):
            job = []
            for n, lay in self.layouts.items():
                if lay.static or (n in owners and u not in owners[n]):
                    continue
                region = {d: ab for d, ab in box.items() if d in lay.src.dims}
                hook = (functools.partial(self._reduce_diffs, n, region) if n in self._diff_axis
                        else functools.partial(self._reduce, n))
                job.append((n, region, hook))
            if job:
                jobs.append(job)
        for n, region in self._halos(a, b, owners):
            jobs.append([(n, region, functools.partial(self._halo, n, region))])
        return jobs

    def _owners(self) -> dict[str, set[int]]:
        """For variables lacking some split dims: the units that read them (the first unit, in split order,
        of each chunk block of theirs, so shared blocks count once), of the whole split."""
        sp = self.space
        owners: dict[str, set[int]] = {}
        coords = None
        for n, lay in self.layouts.items():
            if lay.static or len(lay.sampled) == len(sp.split_dims):
                continue
            coords = coords if coords is not None else np.unravel_index(sp.blocks.ids(), sp.grid)
            key = np.ravel_multi_index(tuple(coords[k] for k in lay.sampled), tuple(sp.grid[k] for k in lay.sampled))
            owners[n] = set(np.unique(key, return_index=True)[1].tolist())
        return owners

    def _halos(self, a: int, b: int, owners: dict[str, set[int]]) -> list[tuple[str, dict[str, tuple[int, int]]]]:
        """Reads of one position along the diffs dim: the first of the chunk block that follows (along it) a
        block units ``a..b-1`` read, where that block is in the split but read by a unit of another part."""
        sp = self.space
        if self.diffs is None or not self._diff_axis or (a == 0 and b == sp.n_units) or a >= b:
            return []
        kd = [d.name for d in sp.split_dims].index(self.diffs)
        coords = np.unravel_index(sp.blocks.ids(), sp.grid)
        out: list[tuple[str, dict[str, tuple[int, int]]]] = []
        for n in self._diff_axis:
            lay = self.layouts[n]
            dims = list(lay.sampled)  # the split dims it has (the diffs dim among them)
            shape = tuple(sp.grid[k] for k in dims)
            key = np.ravel_multi_index(tuple(coords[k] for k in dims), shape)
            uniq, first = np.unique(key, return_index=True)  # its blocks, and the unit that reads each
            mine = np.arange(a, b, dtype=np.int64)
            if n in owners:
                mine = mine[np.isin(mine, np.fromiter(owners[n], np.int64))]
            nxt = [coords[k][mine].copy() for k in dims]
            j = dims.index(kd)
            nxt[j] += 1
            ok = nxt[j] < sp.grid[kd]
            if not ok.any():
                continue
            nk = np.ravel_multi_index(tuple(c[ok] for c in nxt), shape)
            pos = np.minimum(np.searchsorted(uniq, nk), len(uniq) - 1)
            reader = first[pos]
            far = (uniq[pos] == nk) & ((reader < a) | (reader >= b))
            for box in self._boxes(reader[far]):
                region = {d: ab for d, ab in box.items() if d in lay.src.dims}
                lo = region[self.diffs][0]
                region[self.diffs] = (lo, lo + 1)
                out.append((n, region))
        return out

    async def _run(self, jobs: list[list[tuple[str, dict[str, tuple[int, int]], Any]]], bar: Any) -> None:
        # units read at once: at least INFLIGHT_BUFFERS buffers' worth, more where the reader keeps more
        # chunk requests in flight (a far store). A unit holds only the compressed bytes of its chunks in
        # flight (the reader bounds those), and a chunk's values only while a decode thread reduces them
        assert self.reader is not None
        per_unit = max(1, len(self.layouts))
        running = 0
        room = asyncio.Event()

        def done(_: asyncio.Future) -> None:
            nonlocal running
            running -= 1
            room.set()
            if bar is not None:
                bar.update(1)

        tasks: list[asyncio.Task] = []
        try:
            for job in jobs:
                while running >= max(INFLIGHT_BUFFERS * self.block_chunks,
                                     math.ceil(1.5 * self.reader.inflight.limit / per_unit)):
                    room.clear()
                    await room.wait()
                if self._errors:  # a unit failed: start no more reads
                    break
                task = asyncio.ensure_future(self._unit(job))
                running += 1
                task.add_done_callback(done)
                tasks.append(task)
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        if self._errors:
            raise self._errors[0]

    def _boxes(self, units: np.ndarray) -> list[dict[str, tuple[int, int]]]:
        """Each unit's positions along each split dim."""
        sp = self.space
        coords = np.unravel_index(sp.blocks[units], sp.grid)
        cols = [(d.name, np.asarray(sp.edges[k])[coords[k]].tolist(), np.asarray(sp.edges[k])[coords[k] + 1].tolist())
                for k, d in enumerate(sp.split_dims)]
        return [{name: (lo[i], hi[i]) for name, lo, hi in cols} for i in range(len(units))]

    async def _unit(self, job: list[tuple[str, dict[str, tuple[int, int]], Any]]) -> None:
        """Read one unit's regions (``(variable, region, hook)``; a region ``{}``: the variable whole); each
        chunk is reduced by its hook in the decode thread that decoded it."""
        assert self.reader is not None
        reads = [self.reader.read_many(self.layouts[n].src, [(region, None, hook)]) for n, region, hook in job]
        try:
            await asyncio.gather(*reads)
        except BaseException as e:
            self._errors.append(e)
            raise

    # -- in the decode threads
    def _decoded(self, name: str, raw: np.ndarray) -> tuple[np.ndarray, bool]:
        """A chunk's piece CF-decoded, and whether it may be overwritten (CF decoding's new array, or a
        chunk the reader decoded for nothing else)."""
        decode = self.decoders[name]
        values = decode(raw) if decode is not None else raw
        return values, values is not raw or raw.flags.writeable

    def _reduce(self, name: str, raw: np.ndarray, out_sel: list[Any]) -> None:
        """The moments of one chunk's piece of a unit (runs in a decode thread; numpy releases the GIL)."""
        try:
            values, scratch = self._decoded(name, raw)
            self._moments(self._parts[name], values, self._channels_of(name, values.ndim, out_sel), scratch)
        except BaseException as e:  # noqa: BLE001 - raised by run(): the reader would take it for a damaged chunk
            self._errors.append(e)

    def _reduce_diffs(self, name: str, region: dict[str, tuple[int, int]], raw: np.ndarray, out_sel: list[Any]) -> None:
        """``_reduce``, and first the one-step differences of the piece (before the moments may overwrite it)."""
        try:
            values, scratch = self._decoded(name, raw)
            chans = self._channels_of(name, values.ndim, out_sel)
            self._differences(name, region, values, out_sel, chans)
            self._moments(self._parts[name], values, chans, scratch)
        except BaseException as e:  # noqa: BLE001 - raised by run()
            self._errors.append(e)

    def _halo(self, name: str, region: dict[str, tuple[int, int]], raw: np.ndarray, out_sel: list[Any]) -> None:
        """A piece of a halo read: only the start of a pair whose first position this part holds."""
        try:
            values, _ = self._decoded(name, raw)
            ax = self._diff_axis[name]
            pos = self._positions(name, region, values, out_sel)
            self._meet(name, int(pos[0]), self._where(name, region, values, out_sel),
                       np.array(_along(values, ax, 0, 1)), self._channels_of(name, values.ndim, out_sel), True)
        except BaseException as e:  # noqa: BLE001 - raised by run()
            self._errors.append(e)

    def _channels_of(self, name: str, ndim: int, out_sel: list[Any]) -> list[tuple[int, tuple[Any, ...] | None]]:
        """The channels a piece holds: ``(channel, selection of it in the piece)`` (None: the whole piece)."""
        axes, sizes = self._channel_axes[name], self._channel_sizes[name]
        if not axes:
            return [(0, None)]
        key = (name, ndim, *(("s", s.start, s.stop, s.step) if isinstance(s, slice)
                             else ("a", np.ndim(s), *np.ravel(s).tolist()) for s in (out_sel[ax] for ax in axes)))
        known = self._chans_seen.get(key)
        if known is not None:  # the same channels as a piece before (every time step of a level variable)
            return known
        # each label (combination of labels) of the extra dims this piece holds is one channel
        labels = [np.arange(n)[out_sel[ax]] for ax, n in zip(axes, sizes, strict=True)]
        out: list[tuple[int, tuple[Any, ...] | None]] = []
        for idx in itertools.product(*(range(len(lab)) for lab in labels)):
            sel: list[Any] = [slice(None)] * ndim
            for ax, i in zip(axes, idx, strict=True):
                sel[ax] = i
            c = int(np.ravel_multi_index(tuple(lab[i] for lab, i in zip(labels, idx, strict=True)), sizes))
            out.append((c, tuple(sel)))
        self._chans_seen[key] = out
        return out

    @staticmethod
    def _moments(into: list[Piece], values: np.ndarray, chans: list[tuple[int, tuple[Any, ...] | None]],
                 scratch: bool) -> None:
        rows = _channel_rows(values, chans)
        if rows is not None:  # every channel of the piece a row of it (levels of one time step)
            into.extend(zip((c for c, _ in chans), channel_moments(rows, scratch), strict=True))
            return
        for c, sel in chans:
            into.append((c, chunk_moments(values if sel is None else values[sel], scratch)))

    def _positions(self, name: str, region: dict[str, tuple[int, int]], values: np.ndarray,
                   out_sel: list[Any]) -> np.ndarray:
        """The positions along the diffs dim that a piece holds (in the Dataset's numbering)."""
        ax = self._diff_axis[name]
        base = region[self.diffs][0] if self.diffs in region else 0
        s = out_sel[ax]
        if isinstance(s, slice):
            start = s.start or 0
            return np.arange(base + start, base + start + values.shape[ax], dtype=np.int64)
        return base + np.asarray(s, dtype=np.int64)

    def _where(self, name: str, region: dict[str, tuple[int, int]], values: np.ndarray,
               out_sel: list[Any]) -> tuple[Any, ...]:
        """Where a piece lies along every dim but the diffs dim (positions in the Dataset's numbering)."""
        ax, dims = self._diff_axis[name], self.layouts[name].src.dims
        out: list[Any] = []
        for k, (d, s) in enumerate(zip(dims, out_sel, strict=True)):
            if k == ax:
                continue
            base = region[d][0] if d in region else 0
            if isinstance(s, slice):
                start = s.start or 0
                out.append((base + start, base + start + values.shape[k]))
            else:
                out.append((base, tuple(np.asarray(s).tolist())))
        return tuple(out)

    def _differences(self, name: str, region: dict[str, tuple[int, int]], values: np.ndarray, out_sel: list[Any],
                     chans: list[tuple[int, tuple[Any, ...] | None]]) -> None:
        """The one-step differences inside a piece, and its first and last slabs along the diffs dim for the
        pairs across its edges (``_meet``)."""
        ax = self._diff_axis[name]
        pos = self._positions(name, region, values, out_sel)
        if len(pos) > 1 and not bool((pos[1:] > pos[:-1]).all()):  # an unsorted selection: in position order
            order = np.argsort(pos, kind="stable")
            values, pos = np.take(values, order, axis=ax), pos[order]
        where = self._where(name, region, values, out_sel)
        dt = _diff_dtype(values.dtype)
        cuts = np.flatnonzero(pos[1:] != pos[:-1] + 1) + 1  # runs of consecutive positions
        bounds = [0, *cuts.tolist(), len(pos)]
        for j0, j1 in zip(bounds[:-1], bounds[1:], strict=True):
            run = _along(values, ax, j0, j1)
            if j1 - j0 > 1:
                d = np.subtract(_along(run, ax, 1, None), _along(run, ax, 0, -1), dtype=dt)
                self._moments(self._dparts[name], d, chans, True)
            first = np.array(_along(run, ax, 0, 1))  # copies: the piece's buffer is reused
            last = first if j1 - j0 == 1 else np.array(_along(run, ax, -1, None))
            self._meet(name, int(pos[j0]), where, first, chans, True)
            self._meet(name, int(pos[j1 - 1]), where, last, chans, False)

    def _meet(self, name: str, t: int, where: tuple[Any, ...], slab: np.ndarray,
              chans: list[tuple[int, tuple[Any, ...] | None]], start: bool) -> None:
        """A piece's first slab (``start``, at position ``t``) or last slab (at ``t``): the difference with
        the slab on the other side of the edge, where that one has been read, else kept until it is."""
        key = (name, t if start else t + 1, where)
        with self._lock:
            other = (self._ends if start else self._starts).pop(key, None)
            if other is None:
                (self._starts if start else self._ends)[key] = slab
                return
        later, earlier = (slab, other) if start else (other, slab)
        d = np.subtract(later, earlier, dtype=_diff_dtype(slab.dtype))
        self._moments(self._dparts[name], d, chans, True)

    # -- result
    def _partial(self, i: int, n: int, a: int, b: int) -> dict[str, Any]:
        """The JSON-able partial result of units ``a..b-1`` (see ``merge_stats``)."""
        def sums(parts: list[Piece], k: int) -> list[dict[str, Any]]:
            acc = [ChannelSums() for _ in range(k)]
            for c, mom in parts:
                acc[c].add(*mom)
            return [s.to_json() for s in acc]

        out: dict[str, Any] = {"xinsitu": "stats_part", "version": PART_VERSION, "job_id": self.job_id,
                               "job": self.job, "part": [i, n], "units": [a, b],
                               "stats": {name: sums(p, len(self.channels[name])) for name, p in self._parts.items()}}
        if self.diffs is not None:
            out["diffs"] = {name: sums(p, len(self.channels[name])) for name, p in self._dparts.items()}
        if self.reader is not None and (missing := self.reader.missing_record()) is not None:
            out["missing"] = missing
        return out


def merge_stats(parts: Iterable[dict[str, Any] | str]) -> dict[str, Any]:
    """Merge the partial results of ``ds.insitu.stats_part`` into the stats record ``stats()`` gives.

    Parameters
    ----------
    parts : iterable of dict (or JSON text)
        The ``n`` parts ``(0, n) .. (n-1, n)`` of one job, each once, in any order (as they arrive from
        workers, Slurm array tasks, ...).

    Returns
    -------
    dict
        The stats record (see ``compute_stats``): the very bits ``stats()`` gives for the same
        arguments -- the pieces' sums are exact, so neither the order nor the number of parts changes
        a bit.

    Raises
    ------
    ValueError
        Parts of different jobs (another split, manifest, variables, channels, ``stack``, ``diffs`` or
        Icechunk snapshot), a part missing or given twice, or a damaged part.
    """
    got = parts_in_order(parts, "stats_part", PART_VERSION, "merge_stats")
    job = got[0]["job"]
    warn_missing(got, f"stats of split {job['split']!r}")
    names = list(job["variables"])
    sums = {name: [ChannelSums() for _ in job["channels"][name]] for name in names}
    dsums = {name: [ChannelSums() for _ in job["channels"][name]] for name in job["diff_variables"]}
    for p in got:
        i = p["part"][0]
        for key, acc in (("stats", sums), ("diffs", dsums)):
            recs = p.get(key, {}) if acc else {}
            if set(recs) != set(acc):
                raise ValueError(f"merge_stats: part {i} holds {key} of {sorted(recs)}, its job has {sorted(acc)}")
            for name, chans in acc.items():
                if not isinstance(recs[name], list) or len(recs[name]) != len(chans):
                    raise ValueError(f"merge_stats: part {i}: {key} of {name!r} are not one per channel")
                for c, rec in enumerate(recs[name]):
                    chans[c].merge(ChannelSums.from_json(rec, f"merge_stats: part {i}, {key} of {name!r}"))
    out: dict[str, Any] = {"split": job["split"], "channels": [c for n in names for c in job["channels"][n]],
                           "variables": names, "split_blocks": job["blocks"]}
    for name in names:
        one = not job["dims"][name]
        res = [s.result() for s in sums[name]]
        cols: dict[str, list[Any]] = {"mean": [r[0] for r in res], "std": [r[1] for r in res],
                                      "min": [r[2] for r in res], "max": [r[3] for r in res],
                                      "nan_count": [s.nan_count for s in sums[name]],
                                      "count": [s.count for s in sums[name]]}
        if job["diffs"] is not None:
            d = dsums.get(name)
            dres = [s.result() for s in d] if d is not None else [(None, None, None, None)] * len(res)
            cols["diff_mean"] = [r[0] for r in dres]
            cols["diff_std"] = [r[1] for r in dres]
            cols["diff_count"] = [s.count for s in d] if d is not None else [0] * len(res)
        entry: dict[str, Any] = {k: (v[0] if one else v) for k, v in cols.items()}
        entry["dims"] = list(job["dims"][name])
        entry["channels"] = list(job["channels"][name])
        if job["diffs"] is not None:
            entry["diff_dim"] = job["diffs"]
        out[name] = entry
    return out



def compute_stats(ds: xr.Dataset, manifest: SplitManifest, split: str, variables: str | list[str] | None = None, *,
                  block_chunks: int = 16, max_inflight: int | None = None, cache: Any = None,
                  stack: list[str] | None = None, diffs: str | None = None, client: Any = None,
                  progress: bool = False) -> dict[str, Any]:
    """Normalisation statistics of one split, from one streaming pass over its chunks.

    Parameters
    ----------
    ds : the Dataset the manifest was made on (or a selection of it).
    manifest : a ``SplitManifest`` from ``ds.insitu.split``.
    split : the split to reduce (e.g. ``"train"``); no other split's chunk is read.
    variables : variables to reduce (default: the data variables on the split dims).
    block_chunks : units (chunk blocks) read ahead: at least 3 × ``block_chunks``.
    max_inflight : chunk reads in flight at once.
    cache : ``True``, ``"memory"``, a directory or an ``xinsitu.ChunkCache``: chunks it holds are not
        read again, and the chunks read are kept (pass the same ``ChunkCache`` to ``batches``).
    stack : dims to make channels of, as ``stack=["level"]`` of ``batches``: then each variable with
        the dim gets a list in label order (per-level mean/std), and one without it (a surface field
        such as ``t2m``) a number: the channels the batches have.
    diffs : a split dim (e.g. ``"time"``): also, per channel, ``diff_mean``, ``diff_std`` and
        ``diff_count`` of the one-step differences ``x[t + 1] - x[t]`` along it, over the pairs of
        positions that are both in the split (never across a gap or another split's blocks).
    client : a ``distributed.Client``: the split's units are read on the cluster's workers (each opens
        the archive itself) in tasks merged here; the same result as without, whatever the workers.
    progress : show a tqdm bar (units read; with ``client``, tasks done).

    Returns
    -------
    dict
        Plain JSON-able data::

            {"split": "train", "channels": ["t2m", "z_500", "z_850"], "variables": ["t2m", "z"],
             "split_blocks": "<a digest of the split's chunk blocks>",
             "t2m": {"mean": 281.2, "std": 15.3, "min": 230.1, "max": 318.0, "nan_count": 0,
                     "count": 786432, "dims": [], "channels": ["t2m"]},
             "z": {"mean": [m500, m850], "std": [...], ..., "dims": ["level"],
                   "channels": ["z_500", "z_850"]}}

        Per channel: mean, std (ddof=0, like xarray's ``.std()``), min and max of the
        CF-decoded values with NaNs left out, the NaN count and the count of values used;
        a number per key, or a list in channel (label) order for a variable with an extra
        dim. A channel with no value at all has ``None`` for mean/std/min/max. With ``diffs``
        also ``diff_mean``, ``diff_std``, ``diff_count`` and ``diff_dim`` (None and 0 for a
        variable without that dim). ``split_blocks`` tells ``normalize=`` the statistics of another
        manifest's split of the same name (other chunk blocks), which it refuses.
    """
    progress = flag("progress", progress)
    if client is not None:
        check_client(client, cache)
    sp = StatsPass(ds, manifest, split, variables, block_chunks=block_chunks, max_inflight=max_inflight,
                   cache=cache, stack=stack, diffs=diffs)
    if client is None:
        return sp.run(progress=progress)
    parts = run_parts(client, sp, sp.space.n_units, {n: lay.src for n, lay in sp.layouts.items()},
                      what=f"stats of split {split!r}", progress=progress)
    return merge_stats(parts)


def stats_part(ds: xr.Dataset, manifest: SplitManifest, split: str, variables: str | list[str] | None = None, *,
               part: tuple[int, int], block_chunks: int = 16, max_inflight: int | None = None, cache: Any = None,
               stack: list[str] | None = None, diffs: str | None = None, progress: bool = False) -> dict[str, Any]:
    """The partial result of share ``part = (i, n)`` of ``compute_stats`` (see ``StatsPass.part``)."""
    i, n = part_arg(part)
    return StatsPass(ds, manifest, split, variables, block_chunks=block_chunks, max_inflight=max_inflight,
                     cache=cache, stack=stack, diffs=diffs).part(i, n, progress=flag("progress", progress))
