"""Normalisation statistics of one split, from one streaming pass over its chunks.

``compute_stats`` walks the split's chunk blocks in order through the same block loader
and async reader that batches use (each chunk read once, the next blocks read while the
current one is reduced), CF-decodes each block's values and folds them, per channel,
into float64 running moments merged with Chan et al.'s parallel algorithm (count, mean,
M2), plus min, max and the NaN count. Statistics are taken over the split's *positions*:
every position along the split dims inside the split's chunk blocks, counted once,
whatever window, patch or ``over`` a generator later uses; other dims are taken whole.

Channels are named as ``output.plan_channels`` names them for the same variables: each
variable, or ``{var}_{label}`` per label of a dim the other selected variables lack.
``normalizer`` turns the result into the ``(x - mean) / std`` step of the batch gather.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import xarray as xr

from xinsitu import _loop
from xinsitu.buffer import Block, BlockLoader, VarLayout
from xinsitu.plan import EpochPlan, epoch_plan
from xinsitu.reader import Reader
from xinsitu.split import SplitManifest

#: top-level keys of a stats dict that are not variables
RESERVED = ("split", "channels", "variables")
#: the keys every variable's entry has
STAT_KEYS = ("mean", "std", "min", "max", "nan_count")
#: blocks read ahead while one is reduced (memory: PREFETCH_BLOCKS + 1 blocks)
PREFETCH_BLOCKS = 2
#: pieces (unit x variable) one job of the decode threads reduces
PIECES_PER_JOB = 4


# ----------------------------------------------------------------------------- moments
class Moments:
    """Per-channel statistics in float64: count, mean, M2, min, max and NaN count.

    A block's values are reduced exactly (two passes, in float64) by :meth:`of`, and
    accumulators are combined with Chan, Golub & LeVeque's pairwise update
    (:meth:`merge`), which stays accurate over billions of values where a running sum
    of squares would cancel. Merging in a fixed order gives the same bits every run.
    """

    def __init__(self, n_channels: int):
        self.count = np.zeros(n_channels, np.int64)
        self.mean = np.zeros(n_channels)
        self.m2 = np.zeros(n_channels)
        self.min = np.full(n_channels, np.nan)
        self.max = np.full(n_channels, np.nan)
        self.nan_count = np.zeros(n_channels, np.int64)

    @classmethod
    def of(cls, x: np.ndarray) -> Moments:
        """The moments of ``x``, shaped ``(channels, values)`` (any real dtype; NaNs counted, left out)."""
        m = cls(x.shape[0])
        for c in range(x.shape[0]):
            m._reduce_row(c, x[c])
        return m

    def _reduce_row(self, c: int, row: np.ndarray) -> None:
        if row.size == 0:
            return
        v = row.astype(np.float64)  # a copy: the block buffer is never written
        s = float(v.sum())
        if math.isnan(s):  # NaNs (or +inf and -inf) somewhere: drop the NaNs, count them
            ok = ~np.isnan(v)
            self.nan_count[c] = v.size - int(np.count_nonzero(ok))
            v = v[ok]
            if v.size == 0:
                return
            s = float(v.sum())
            self.min[c], self.max[c] = v.min(), v.max()
        else:  # no NaN: min/max of the raw row read half the memory of the float64 copy
            self.min[c], self.max[c] = row.min(), row.max()
        n = v.size
        mean = s / n
        v -= mean
        np.square(v, out=v)
        self.count[c], self.mean[c], self.m2[c] = n, mean, float(v.sum())

    def merge(self, other: Moments) -> None:
        """Fold ``other`` (the same channels, other values) into this accumulator."""
        na, nb = self.count, other.count
        tot = na + nb
        with np.errstate(invalid="ignore", divide="ignore"):
            w = np.where(tot > 0, nb / np.maximum(tot, 1), 0.0)
            delta = other.mean - self.mean
            mean = np.where(na == 0, other.mean, self.mean + delta * w)
            m2 = np.where(na == 0, other.m2, self.m2 + other.m2 + delta * delta * na * w)
        take = nb > 0
        self.mean = np.where(take, mean, self.mean)
        self.m2 = np.where(take, m2, self.m2)
        self.count = tot
        self.min = np.fmin(self.min, other.min)
        self.max = np.fmax(self.max, other.max)
        self.nan_count = self.nan_count + other.nan_count

    def result(self) -> dict[str, list[Any]]:
        """Per channel: mean, std (ddof=0), min, max, nan_count, count; None where no value was seen."""
        out: dict[str, list[Any]] = {k: [] for k in (*STAT_KEYS, "count")}
        for c in range(len(self.count)):
            n = int(self.count[c])
            seen = n > 0
            out["mean"].append(float(self.mean[c]) if seen else None)
            out["std"].append(math.sqrt(max(float(self.m2[c]), 0.0) / n) if seen else None)
            out["min"].append(float(self.min[c]) if seen else None)
            out["max"].append(float(self.max[c]) if seen else None)
            out["nan_count"].append(int(self.nan_count[c]))
            out["count"].append(n)
        return out


# ----------------------------------------------------------------------------- the pass
class StatsPass:
    """One streaming pass over a split's chunk blocks, reduced per channel.

    Parameters
    ----------
    ds : the Dataset (stored, dask-backed or in memory), as for ``ds.insitu.batches``.
    manifest, split : the split whose positions are reduced.
    variables : variables to reduce (default: the data variables on the split dims, as for batches).
    block_chunks : chunk blocks read per step (memory: about ``PREFETCH_BLOCKS + 1`` steps).
    max_inflight : chunk reads in flight at once.
    reader : the ``Reader`` to read through (default: a new one); its ``counters`` show the cost.
    """

    def __init__(self, ds: xr.Dataset, manifest: SplitManifest, split: str, variables: list[str] | None = None,
                 *, block_chunks: int = 16, max_inflight: int | None = None, reader: Reader | None = None):
        # imported here: output.py imports this module for ``normalizer``
        from xinsitu.loader import BatchGenerator
        from xinsitu.output import cf_decoder

        # a generator with no window/patch/over: its samples are exactly the split's positions, and it
        # validates the manifest, the variables and the arguments the way ds.insitu.batches does
        self.gen = BatchGenerator(ds, manifest, split, variables=variables, shuffle=False, batch_size=1,
                                  block_chunks=block_chunks, max_inflight=max_inflight, rank=0, world_size=1,
                                  output="numpy")
        self.split = split
        self.space, self.layouts = self.gen.space, self.gen.layouts
        clash = [n for n in self.layouts if n in RESERVED]
        if clash:
            raise ValueError(f"variable(s) {clash} are named like a key of the stats record {RESERVED}; "
                             "rename them (ds.rename) to compute statistics")
        for n, lay in self.layouts.items():
            if lay.src.dtype.kind not in "biuf":
                raise ValueError(f"variable {n!r} has dtype {lay.src.dtype}; statistics need real numbers "
                                 "(select numeric variables with variables=[...])")
        self.reader = reader if reader is not None else Reader(max_inflight)
        self.loader = BlockLoader(self.space, self.layouts, self.reader)
        self.decoders = {n: None if _decodes_to_itself(lay) else cf_decoder(n, lay)
                         for n, lay in self.layouts.items()}
        self.channels, self.extra = channel_plan(ds, self.layouts)
        self.moments = {n: Moments(len(chs)) for n, chs in self.channels.items()}
        # per variable, the buffer axes of its extra dims (channel axes) after the slot axis
        self._channel_axes = {n: [lay.order.index(lay.src.dims.index(d)) for d in self.extra[n]]
                              for n, lay in self.layouts.items()}
        self._owners: dict[str, set[int]] = {}
        self._done = False

    def plan(self) -> EpochPlan:
        """The unshuffled single-rank plan: every unit of the split once, in split order."""
        return epoch_plan(self.space, seed=0, epoch=0, shuffle=False, batch_size=1,
                          block_chunks=self.gen.block_chunks, drop_last=False, rank=0, world_size=1)

    def run(self) -> dict[str, Any]:
        """Read and reduce every chunk block of the split once; return the stats record."""
        if self._done:
            raise RuntimeError("a StatsPass runs once; make a new one")
        self._done = True
        fut = _loop.submit(self._run(self.plan()))
        try:
            fut.result()
        except BaseException:
            fut.cancel()  # e.g. KeyboardInterrupt: stop the reads too
            raise
        return self.record()

    async def _run(self, plan: EpochPlan) -> None:
        # a block's read starts as soon as fewer than PREFETCH_BLOCKS + 1 blocks are held (read, being
        # read or being reduced), so reads go on while earlier blocks are reduced in the decode threads;
        # the moments are merged in split order at the end, so the result does not depend on timing
        self._owners = self._first_units(plan)
        held = asyncio.Semaphore(PREFETCH_BLOCKS + 1)
        failed: list[BaseException] = []
        tasks: list[asyncio.Task] = []
        try:
            for j in range(plan.n_blocks):
                await held.acquire()
                if failed:
                    break
                tasks.append(asyncio.ensure_future(self._process(plan, j, held, failed)))
            parts = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        for block_parts in parts:
            for n, mom in block_parts:
                self.moments[n].merge(mom)

    async def _process(self, plan: EpochPlan, j: int, held: asyncio.Semaphore,
                       failed: list[BaseException]) -> list[tuple[str, Moments]]:
        """Read block ``j`` and reduce each of its (unit, variable) pieces in the decode threads."""
        try:
            block = await self.loader.load(plan, j)
            pieces = self._pieces(plan, block)
            # a job reduces a few pieces of one variable: fewer hops to the threads, still many jobs
            jobs: list[tuple[str, list[np.ndarray]]] = []
            for n in self.layouts:
                raws = [raw for m, raw in pieces if m == n]
                jobs += [(n, raws[i:i + PIECES_PER_JOB]) for i in range(0, len(raws), PIECES_PER_JOB)]
            loop = asyncio.get_running_loop()
            done = await asyncio.gather(*(loop.run_in_executor(None, self._moments_of, n, raws)
                                          for n, raws in jobs))
            self.loader.recycle(block)
            return [(n, m) for (n, _), ms in zip(jobs, done, strict=True) for m in ms]
        except BaseException as e:
            failed.append(e)  # stop starting reads; gather raises it
            raise
        finally:
            held.release()

    def _first_units(self, plan: EpochPlan) -> dict[str, set[int]]:
        """For variables lacking some split dim: the units whose piece of them is reduced (the first
        unit of each chunk block of theirs, so shared blocks count once)."""
        sp = self.space
        owners: dict[str, set[int]] = {}
        for n, lay in self.layouts.items():
            if lay.static or len(lay.sampled) == len(sp.split_dims):
                continue
            first: dict[tuple[int, ...], int] = {}
            for u in plan.units:
                coords = np.unravel_index(int(sp.blocks[u]), sp.grid)
                first.setdefault(tuple(int(coords[k]) for k in lay.sampled), int(u))
            owners[n] = set(first.values())
        return owners

    def _pieces(self, plan: EpochPlan, block: Block) -> list[tuple[str, np.ndarray]]:
        """(variable, raw values) of every unit of the block, each split position once."""
        sp = self.space
        out = [(n, block.arrays[n][0]) for n, lay in self.layouts.items() if lay.static and block.j == 0]
        for s, u in enumerate(plan.units[plan.block_pieces(block.j)]):
            coords = np.unravel_index(int(sp.blocks[u]), sp.grid)
            sizes = [int(sp.edges[k][c + 1] - sp.edges[k][c]) for k, c in enumerate(coords)]
            for n, lay in self.layouts.items():
                if lay.static or (n in self._owners and int(u) not in self._owners[n]):
                    continue
                # a slot holds its unit's positions first; past them (a shorter unit) is stale data
                out.append((n, block.arrays[n][s][tuple(slice(0, sizes[k]) for k in lay.sampled)]))
        return out

    def _moments_of(self, name: str, raws: list[np.ndarray]) -> list[Moments]:
        """The moments of each piece (runs in a decode thread; numpy releases the GIL)."""
        decode, axes, nch = self.decoders[name], self._channel_axes[name], len(self.channels[name])
        out = []
        for raw in raws:
            values = decode(raw) if decode is not None else raw
            x = np.moveaxis(values, axes, list(range(len(axes)))) if axes else values
            out.append(Moments.of(x.reshape(nch, -1)))
        return out

    # -- result
    def record(self) -> dict[str, Any]:
        """The JSON-able stats record (see ``compute_stats``)."""
        out: dict[str, Any] = {"split": self.split,
                               "channels": [c for chs in self.channels.values() for c in chs],
                               "variables": list(self.layouts)}
        for n, mom in self.moments.items():
            res = mom.result()
            one = not self.extra[n]
            entry: dict[str, Any] = {k: (v[0] if one else v) for k, v in res.items()}
            entry["dims"] = list(self.extra[n])
            entry["channels"] = list(self.channels[n])
            out[n] = entry
        return out


def _decodes_to_itself(lay: VarLayout) -> bool:
    """Whether CF decoding leaves raw values as they are: floats whose only CF attribute is a NaN fill
    value (what xarray writes for float variables). Saves a pass per block; anything else is decoded."""
    src = lay.src
    attrs = {k: v for k, v in src.cf.items() if k != "dtype"}
    if not src.stored or not attrs:
        return True
    return (src.raw_dtype == src.dtype and src.dtype.kind == "f" and set(attrs) <= {"_FillValue", "missing_value"}
            and all(np.isnan(np.asarray(v, dtype=np.float64)).all() for v in attrs.values()))


def channel_plan(ds: xr.Dataset, layouts: dict[str, VarLayout]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Per variable, its channel names and its extra (channel) dims, as ``plan_channels`` has them.

    Variables that cannot be stacked together (no shared dims) are one channel each.
    """
    from xinsitu.output import plan_channels

    try:
        chans, base = plan_channels(ds, layouts)
    except ValueError:
        return {n: [n] for n in layouts}, {n: [] for n in layouts}
    names: dict[str, list[str]] = {n: [] for n in layouts}
    for ch in chans:
        names[ch.var].append(ch.name)
    extra = {n: [d for d in lay.out_dims if d not in base] for n, lay in layouts.items()}
    return names, extra


def compute_stats(ds: xr.Dataset, manifest: SplitManifest, split: str, variables: list[str] | None = None, *,
                  block_chunks: int = 16, max_inflight: int | None = None) -> dict[str, Any]:
    """Normalisation statistics of one split, from one streaming pass over its chunks.

    Parameters
    ----------
    ds : the Dataset the manifest was made on (or a selection of it).
    manifest : a ``SplitManifest`` from ``ds.insitu.split``.
    split : the split to reduce (e.g. ``"train"``); no other split's chunk is read.
    variables : variables to reduce (default: the data variables on the split dims).
    block_chunks : chunk blocks read per step.
    max_inflight : chunk reads in flight at once.

    Returns
    -------
    dict
        Plain JSON-able data::

            {"split": "train", "channels": ["t2m", "z_500", "z_850"], "variables": ["t2m", "z"],
             "t2m": {"mean": 281.2, "std": 15.3, "min": 230.1, "max": 318.0, "nan_count": 0,
                     "count": 786432, "dims": [], "channels": ["t2m"]},
             "z": {"mean": [m500, m850], "std": [...], ..., "dims": ["level"],
                   "channels": ["z_500", "z_850"]}}

        Per channel: mean, std (ddof=0, like xarray's ``.std()``), min and max of the
        CF-decoded values with NaNs left out, the NaN count and the count of values used;
        a number per key, or a list in channel (label) order for a variable with an extra
        dim. A channel with no value at all has ``None`` for mean/std/min/max.
    """
    return StatsPass(ds, manifest, split, variables, block_chunks=block_chunks, max_inflight=max_inflight).run()


# ----------------------------------------------------------------------------- normalising
class Normalizer:
    """``(x - mean) / std`` per channel, applied to CF-decoded values of one generator's variables.

    Made by :func:`normalizer`. Call it on ``{var: values}`` (values shaped as a batch
    gives them: a leading sample axis, then the variable's output dims; or the
    variable's own dims for a variable without a split dim), or use ``apply(var, values)``.
    Floating values keep their dtype (mean and std are cast to it, as
    ``(da - mean) / std`` does with Python floats); integers become float64. A channel
    with std 0 is only centred (scale 1, as scikit-learn does); one without statistics
    (``None``) becomes NaN.
    """

    def __init__(self, params: dict[str, tuple[np.ndarray, np.ndarray]]):
        self.params = params  # var -> (mean, scale), float64 and shaped to broadcast against a batch

    def dtype(self, dtype: np.dtype) -> np.dtype:
        """The dtype normalised values of ``dtype`` have."""
        return np.result_type(np.dtype(dtype), 1.0)

    def apply(self, name: str, values: np.ndarray) -> np.ndarray:
        mean, scale = self.params[name]
        dt = self.dtype(values.dtype)
        out = np.subtract(values, mean.astype(dt), dtype=dt)  # never in place: values may be a block buffer
        out /= scale.astype(dt)
        return out

    def __call__(self, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {n: self.apply(n, a) if n in self.params else a for n, a in values.items()}


def normalizer(stats: dict[str, Any], layouts: dict[str, VarLayout], kept: tuple[str, ...] = ()) -> Normalizer:
    """A :class:`Normalizer` applying ``stats`` (from :func:`compute_stats`) to these variables.

    Parameters
    ----------
    stats : ``{var: {"mean": ..., "std": ...}, ...}`` (a ``compute_stats`` record, e.g. ``m.stats``,
        or a hand-written dict of the same shape). A variable with an extra dim needs a list per
        key, in channel order (C order over the entry's ``"dims"``, the extra dims; default: the
        dims the other variables lack, as in ``plan_channels``).
    layouts : the generator's variable layouts (``gen.layouts``).
    kept : the window/patch dims of the generator's samples (never channel dims).

    Raises
    ------
    ValueError
        When a variable has no statistics, or its number of channels differs.
    """
    if not isinstance(stats, dict):
        raise TypeError(f"normalize= takes a stats dict (e.g. m.stats from ds.insitu.stats), got "
                        f"{type(stats).__name__}")
    inferred = _extra_dims(layouts, kept)
    params = {}
    for n, lay in layouts.items():
        entry = stats.get(n)
        if not isinstance(entry, dict) or "mean" not in entry or "std" not in entry:
            have = [k for k in stats if k not in RESERVED]
            raise ValueError(f"normalize: no statistics for variable {n!r} (the stats have {have}); compute "
                             f"them for these variables: ds.insitu.stats(m, split, variables={list(layouts)})")
        extra = list(entry.get("dims", inferred[n]))
        out_dims = ("sample", *lay.out_dims) if lay.has_sample_axis else lay.src.dims
        missing = [d for d in extra if d not in out_dims]
        if missing:
            raise ValueError(f"normalize: the statistics of {n!r} are per {extra}, but its batches have dims "
                             f"{out_dims} (was a dim selected away after computing the statistics?)")
        sizes = [lay.src.shape[lay.src.dims.index(d)] for d in extra]
        mean, std = (_channel_values(n, entry[k], k, sizes) for k in ("mean", "std"))
        shape = [1] * len(out_dims)
        for d, size in zip(extra, sizes, strict=True):
            shape[out_dims.index(d)] = size
        # the channel list is C order over ``extra``; lay its axes out in the batch's dim order
        order = sorted(range(len(extra)), key=lambda i: out_dims.index(extra[i]))
        mean = mean.reshape(sizes).transpose(order).reshape(shape)
        std = std.reshape(sizes).transpose(order).reshape(shape)
        scale = np.where(std == 0, 1.0, std)
        params[n] = (mean, scale)
    return Normalizer(params)


def _channel_values(name: str, v: Any, key: str, sizes: list[int]) -> np.ndarray:
    n = int(np.prod(sizes)) if sizes else 1
    arr = np.array([np.nan if x is None else x for x in (v if isinstance(v, (list, tuple)) else [v])],
                   dtype=np.float64)
    if sizes and arr.size != n:
        raise ValueError(f"normalize: {name!r} has {n} channels but its {key!r} has {arr.size} value(s)")
    if not sizes and arr.size != 1:
        raise ValueError(f"normalize: {name!r} is one channel here, but its {key!r} has {arr.size} values "
                         "(statistics computed with another set of variables?)")
    return arr


def _extra_dims(layouts: dict[str, VarLayout], kept: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """The dims each variable has beyond the shortest variable's (the channel dims of plan_channels),
    window/patch dims left aside."""
    outs = {n: tuple(d for d in lay.out_dims if d not in kept) for n, lay in layouts.items()}
    base = min(outs.values(), key=len)
    return {n: [d for d in dims if d not in base] if all(d in dims for d in base) else []
            for n, dims in outs.items()}

