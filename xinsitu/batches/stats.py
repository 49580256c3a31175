"""Normalisation statistics of one split, from one streaming pass over its chunks.

``compute_stats`` reads the split's units (chunk blocks along the split dims) in order
through the async reader that batches use, each chunk once and many in flight. Each
chunk is reduced in the decode thread right after decoding, while it is still in
cache, and is copied nowhere: its values are CF-decoded and reduced per channel into
moments (count, mean, M2, min, max, NaN count), combined at the end with Chan et al.'s
parallel formula, its sums exactly rounded (the result does not depend on timing).
Statistics are taken over the split's *positions*: every position along the split dims
inside the split's chunk blocks, counted once, whatever window, patch or ``over`` a
generator later uses; other dims are taken whole.

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
from typing import Any

import numpy as np
import xarray as xr

from xinsitu.cache.chunk_cache import resolve_cache
from xinsitu.index.channels import RESERVED, cf_decoder, channel_plan, check_fold, decodes_to_itself, fold_dims
from xinsitu.index.manifest import SplitManifest
from xinsitu.index.plan import EpochPlan, epoch_plan
from xinsitu.index.sampling import check_split, positive_int, sampling
from xinsitu.io import loop as _loop
from xinsitu.io.reader import Reader

#: the keys every variable's entry has
STAT_KEYS = ("mean", "std", "min", "max", "nan_count")
#: units in flight: at least this many buffers' worth (times ``block_chunks``; each unit holds only its
#: chunks' compressed bytes). Not the batch pipeline's read-ahead (``pipeline.READ_AHEAD_BUFFERS``)
INFLIGHT_BUFFERS = 3
#: values per partial sum of deviations (float32 sums for float32 values, see ``Moments``)
ROW = 1024
#: spans (max - min) of float32 values reduced in float32 partial sums: their squares neither
#: overflow nor fall to where float32 keeps too few digits; other spans are reduced in float64
F32_SPAN = (1e-10, 5e17)


# ----------------------------------------------------------------------------- moments
class Moments:
    """Per-channel statistics in float64: count, mean, M2, min, max and NaN count.

    :meth:`reduce` sets a channel to the moments of some values (a chunk's, see
    ``chunk_moments``). The mean is a float64 sum, as numpy's. The deviations from it
    (rounded to the grid of the largest value, so little cancels and their rounding is
    unbiased) are squared and summed in partial sums of ``ROW`` values -- float32 sums
    for float32 data, one BLAS dot product per ``ROW`` -- which are added in float64:
    the std is within about 1e-9 of numpy's float64 std, 1e-8 at worst on skewed data.
    Integers, float16, infinities and float32 spans outside ``F32_SPAN`` are reduced in
    float64 throughout. The moments of many chunks are combined by :meth:`combine` with
    the closed form of Chan, Golub & LeVeque's pairwise update, which stays accurate over
    billions of values where a running sum of squares would cancel; its sums are exactly
    rounded, so the same values give the same bits every run, in any order.
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
        """The moments of ``x``, shaped ``(channels, values...)`` (any real dtype; NaNs counted, left out)."""
        m = cls(x.shape[0])
        for c in range(x.shape[0]):
            m.reduce(c, x[c])
        return m

    def reduce(self, c: int, values: np.ndarray) -> None:
        """Set channel ``c`` to the moments of ``values`` (any shape and strides; NaNs counted, left out)."""
        self.count[c], self.nan_count[c], self.mean[c], self.m2[c], self.min[c], self.max[c] = chunk_moments(values)

    @classmethod
    def combine(cls, n_channels: int, parts: list[tuple[int, tuple[int, int, float, float, float, float]]]) -> Moments:
        """The moments of many pieces at once: ``parts`` is ``[(channel, chunk_moments(...)), ...]``.

        Uses the pairwise update's closed form, total M2 = sum M2_i + sum n_i (mean_i - mean)^2,
        with every sum exactly rounded (``math.fsum``): the result does not depend on the order of
        the pieces, nor on how the values were cut into pieces beyond each piece's own rounding.
        """
        m = cls(n_channels)
        by: dict[int, list[tuple[int, int, float, float, float, float]]] = {}
        for c, part in parts:
            by.setdefault(c, []).append(part)
        for c, ps in by.items():
            m.nan_count[c] = sum(p[1] for p in ps)
            seen = [p for p in ps if p[0]]
            if not seen:
                continue
            n = sum(p[0] for p in seen)
            mean = math.fsum(p[0] * p[2] for p in seen) / n
            m2 = math.fsum(p[3] for p in seen) + math.fsum(p[0] * (p[2] - mean) ** 2 for p in seen)
            m.count[c], m.mean[c], m.m2[c] = n, mean, m2
            m.min[c], m.max[c] = min(p[4] for p in seen), max(p[5] for p in seen)
        return m

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


_scratch = threading.local()
_SPANS = {np.dtype(np.float32): F32_SPAN, np.dtype(np.float64): (1e-100, 1e100)}
_NONE = (0, 0, math.nan, math.nan, math.nan, math.nan)
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_min, _max, _sum, _sub, _vecdot, _einsum = (np.minimum.reduce, np.maximum.reduce, np.add.reduce, np.subtract,
                                             np.vecdot, np.einsum)


def chunk_moments(values: np.ndarray, scratch: bool = False) -> tuple[int, int, float, float, float, float]:
    """(count, nan_count, mean, M2, min, max) of ``values`` (any real dtype, shape and strides), NaNs
    counted and left out; mean, M2, min and max NaN where no value is left. See ``Moments``.

    ``scratch=True`` lets it overwrite ``values`` (a chunk the reader decoded for nothing else):
    one buffer fewer to stream through cache.
    """
    if values.size == 0:
        return _NONE
    spans = _SPANS.get(values.dtype)
    if spans is None:
        return _exact_moments(values)
    lo, hi = _min(values, axis=None), _max(values, axis=None)  # NaN where any value is NaN
    nans = 0
    if lo != lo:
        ok = ~np.isnan(values)
        values = values[ok]  # a copy
        nans = ok.size - values.size
        if values.size == 0:
            return (0, nans, *_NONE[2:])
        lo, hi = _min(values), _max(values)
    lo, hi = float(lo), float(hi)
    span = hi - lo
    if span == 0:
        return values.size, nans, lo, 0.0, lo, hi
    if not spans[0] <= span <= spans[1]:  # also infinities
        n, _, mean, m2, lo, hi = _exact_moments(values)
        return n, nans, mean, m2, lo, hi
    mean, m2 = _centred_moments(values, scratch or nans > 0, max(-lo, hi))  # values[ok] is a copy
    return values.size, nans, mean, m2, lo, hi


def _exact_moments(values: np.ndarray) -> tuple[int, int, float, float, float, float]:
    """``chunk_moments`` in float64 throughout (integers, float16, extreme spans, infinities)."""
    v = values.astype(np.float64).ravel()  # a copy: the values passed in are never written
    ok = ~np.isnan(v)
    nans = v.size - int(np.count_nonzero(ok))
    if nans:
        v = v[ok]
        if v.size == 0:
            return (0, nans, *_NONE[2:])
    mean = float(v.sum()) / v.size
    lo, hi = float(v.min()), float(v.max())
    with np.errstate(invalid="ignore"):  # an infinity: mean and std are not finite, as numpy's
        v -= mean
    return v.size, nans, mean, float(np.dot(v, v)), lo, hi


def _deviations(n: int, dtype: np.dtype) -> np.ndarray:
    """This thread's reused buffer of ``n`` values, 64-byte aligned (the dot products then sum in the
    same order wherever the values lie: the same bits)."""
    buf = getattr(_scratch, dtype.name, None)
    if buf is None or buf.size < n:
        raw = np.empty(n * dtype.itemsize + 64, np.uint8)
        off = -raw.ctypes.data % 64
        buf = raw[off:off + n * dtype.itemsize].view(dtype)
        setattr(_scratch, dtype.name, buf)
    return buf[:n]


def _centred_moments(values: np.ndarray, scratch: bool, top: float) -> tuple[float, float]:
    """(mean, M2) of finite float ``values`` (float32 or float64, any shape, largest magnitude ``top``;
    overwritten where ``scratch``), see ``Moments``."""
    n, dt = values.size, values.dtype
    # the mean from a float64 sum, as numpy's (float32 partial sums would leave 1e-10 of the spread in
    # it: more than 1e-6 of a mean near zero)
    flat = values.reshape(-1) if values.flags.c_contiguous else values
    mean = float(_einsum(_LETTERS[:flat.ndim] + "->", flat, dtype=np.float64)) / n
    # the deviations are taken from the mean rounded to the grid of the largest value: then each one is
    # exact or rounds on its value's own low bits, and their rounding errors cancel out instead of all
    # dropping the same low bits of the shift (a bias)
    grid = float(np.spacing(dt.type(top)))
    shift = dt.type(round(mean / grid) * grid)
    if scratch and values.flags.writeable and values.flags.c_contiguous:  # deviations in place
        dev = _sub(flat, shift, out=flat)
    else:
        dev = _deviations(n, dt)
        _sub(values, shift, out=dev.reshape(values.shape))
    # the squares of the deviations from the (coarse) mean, summed in float32 partial sums of ROW
    body = n - n % ROW
    rows = dev[:body].reshape(-1, ROW)
    s2 = float(_sum(_vecdot(rows, rows), dtype=np.float64))
    if body < n:  # the last, partial row
        tail = dev[body:]
        s2 += float(_vecdot(tail, tail))
    off = mean - float(shift)
    return mean, max(s2 - n * off * off, 0.0)


# ----------------------------------------------------------------------------- the pass
class StatsPass:
    """One streaming pass over a split's units, reduced per channel in the decode threads.

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
    """

    def __init__(self, ds: xr.Dataset, manifest: SplitManifest, split: str, variables: str | list[str] | None = None,
                 *, block_chunks: int = 16, max_inflight: int | None = None, reader: Reader | None = None,
                 cache: Any = None, stack: list[str] | None = None):
        # no window/patch/over: the samples are exactly the split's positions; the manifest, the variables
        # and the arguments are checked the way ds.insitu.batches checks them
        check_split(manifest, split)
        self.block_chunks = positive_int("block_chunks", block_chunks)
        max_inflight = None if max_inflight is None else positive_int("max_inflight", max_inflight)
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
        self.reader = reader if reader is not None else Reader(max_inflight, cache=resolve_cache(cache))
        self.decoders = {n: None if decodes_to_itself(lay.src) else cf_decoder(n, lay)
                         for n, lay in self.layouts.items()}
        self.fold = () if stack is None or stack is False else fold_dims(stack)
        check_fold(self.layouts, self.fold)
        self.channels, self.extra = channel_plan(ds, self.layouts, self.fold)
        self.moments = {n: Moments(len(chs)) for n, chs in self.channels.items()}
        # per variable: the axes (in its dims) of its extra dims, which are channels, and their sizes
        self._channel_axes = {n: [lay.src.dims.index(d) for d in self.extra[n]] for n, lay in self.layouts.items()}
        self._channel_sizes = {n: [lay.src.shape[ax] for ax in self._channel_axes[n]]
                               for n, lay in self.layouts.items()}
        # per variable: (channel, chunk_moments(...)) of every chunk's piece, appended by the decode threads
        self._parts: dict[str, list[tuple[int, tuple[int, int, float, float, float, float]]]] = \
            {n: [] for n in self.layouts}
        self._errors: list[BaseException] = []
        self._done = False

    def plan(self) -> EpochPlan:
        """The unshuffled single-rank plan: every unit of the split once, in split order."""
        return epoch_plan(self.space, seed=0, epoch=0, shuffle=False, batch_size=1,
                          block_chunks=self.block_chunks, drop_last=False, rank=0, world_size=1)

    def run(self) -> dict[str, Any]:
        """Read and reduce every chunk of the split once; return the stats record."""
        if self._done:
            raise RuntimeError("a StatsPass runs once; make a new one")
        self._done = True
        fut = _loop.submit(self._run(self.plan()))
        try:
            fut.result()
        except BaseException:
            fut.cancel()  # e.g. KeyboardInterrupt: stop the reads too
            raise
        # combined exactly rounded, in no particular order: the result does not depend on timing
        for n, parts in self._parts.items():
            self.moments[n] = Moments.combine(len(self.channels[n]), parts)
        return self.record()

    async def _run(self, plan: EpochPlan) -> None:
        owners = self._first_units(plan)
        # units read at once: at least INFLIGHT_BUFFERS buffers' worth, more where the reader keeps more
        # chunk requests in flight (a far store). A unit holds only the compressed bytes of its chunks in
        # flight (the reader bounds those), and a chunk's values only while a decode thread reduces them
        per_unit = max(1, len(self.layouts))
        running = 0
        room = asyncio.Event()

        def done(_: asyncio.Future) -> None:
            nonlocal running
            running -= 1
            room.set()

        tasks: list[asyncio.Task] = []
        try:
            static = [n for n, lay in self.layouts.items() if lay.static]
            if static:
                tasks.append(asyncio.ensure_future(self._unit(None, static)))
            for u, box in zip(plan.units.tolist(), self._boxes(plan.units), strict=True):
                names = [n for n, lay in self.layouts.items()
                         if not lay.static and (n not in owners or u in owners[n])]
                while running >= max(INFLIGHT_BUFFERS * self.block_chunks,
                                     math.ceil(1.5 * self.reader.inflight.limit / per_unit)):
                    room.clear()
                    await room.wait()
                if self._errors:  # a unit failed: start no more reads
                    break
                task = asyncio.ensure_future(self._unit(box, names))
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

    async def _unit(self, box: dict[str, tuple[int, int]] | None, names: list[str]) -> None:
        """Read the unit at ``box`` of variables ``names`` (None: variables without a split dim, whole);
        each chunk is reduced by ``_reduce`` in the decode thread that decoded it."""
        reads = []
        for n in names:
            src = self.layouts[n].src
            region = {d: ab for d, ab in box.items() if d in src.dims} if box is not None else {}
            hook = functools.partial(self._reduce, n)
            reads.append(self.reader.read_many(src, [(region, None, hook)]))
        try:
            await asyncio.gather(*reads)
        except BaseException as e:
            self._errors.append(e)
            raise

    def _reduce(self, name: str, raw: np.ndarray, out_sel: list[Any]) -> None:
        """The moments of one chunk's piece of a unit (runs in a decode thread; numpy releases the GIL)."""
        try:
            decode = self.decoders[name]
            values = decode(raw) if decode is not None else raw
            axes, sizes = self._channel_axes[name], self._channel_sizes[name]
            # CF decoding's new array, or a chunk the reader decoded for nothing else: free to overwrite
            scratch = values is not raw or raw.flags.writeable
            if not axes:
                self._parts[name].append((0, chunk_moments(values, scratch)))
                return
            # each label (combination of labels) of the extra dims this piece holds is one channel
            labels = [np.arange(n)[out_sel[ax]] for ax, n in zip(axes, sizes, strict=True)]
            for idx in itertools.product(*(range(len(lab)) for lab in labels)):
                sel: list[Any] = [slice(None)] * values.ndim
                for ax, i in zip(axes, idx, strict=True):
                    sel[ax] = i
                c = int(np.ravel_multi_index(tuple(lab[i] for lab, i in zip(labels, idx, strict=True)), sizes))
                self._parts[name].append((c, chunk_moments(values[tuple(sel)], scratch)))
        except BaseException as e:  # noqa: BLE001 - raised by run(): the reader would take it for a damaged chunk
            self._errors.append(e)

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


def compute_stats(ds: xr.Dataset, manifest: SplitManifest, split: str, variables: str | list[str] | None = None, *,
                  block_chunks: int = 16, max_inflight: int | None = None, cache: Any = None,
                  stack: list[str] | None = None) -> dict[str, Any]:
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
    return StatsPass(ds, manifest, split, variables, block_chunks=block_chunks, max_inflight=max_inflight,
                     cache=cache, stack=stack).run()
