"""Region math of the reader: which chunks a region of a variable touches and where each piece of
them lies (pure index math on the selection, no I/O).

A region is a range of positions along some dims of a variable (its other dims whole); reading it
fetches each chunk it touches exactly once. ``RegionPlans`` plans regions once and keeps the plans
(an epoch reads the same units in a new order, every epoch); ``Target`` says where one chunk goes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from xinsitu.index.geometry import run_start
from xinsitu.index.source import VarSource

#: called with (values, out_sel): a chunk's values within a region and where they lie in it
PieceHook = Callable[[np.ndarray, list], None]
#: region plans kept per reader (a few hundred bytes each)
REGION_PLANS = 1 << 17


class Target(NamedTuple):
    """Where one chunk goes."""

    out: np.ndarray | None  # destination (None: hooks only)
    out_sel: list  # where the piece lies in the destination
    in_sel: list  # the piece within the chunk (after ``drop``)
    drop: list  # scalar-dim selections applied first ([] where none)
    hook: PieceHook | None


#: a region's shape and its pieces: [(chunk coords, out selection, in-chunk selection, drop)]
RegionPlan = tuple[tuple[int, ...], list[tuple[tuple[int, ...], list, list, list]]]


def range_plan(start: int, stop: int, chunk: int) -> list[tuple[int, Any, Any]]:
    """``axis_plan`` of the positions ``start, start + 1, ..., stop - 1``, in integer arithmetic."""
    out = []
    for c in range(start // chunk, (stop - 1) // chunk + 1):
        a, b = max(start, c * chunk), min(stop, (c + 1) * chunk)
        out.append((c, slice(a - start, b - start), slice(a - c * chunk, b - c * chunk)))
    return out


def axis_plan(pos: np.ndarray, chunk: int) -> list[tuple[int, Any, Any]]:
    """For one axis: [(chunk id, out selection, in-chunk selection)], slices where contiguous."""
    cid = pos // chunk
    out: list[tuple[int, Any, Any]] = []
    brk = np.flatnonzero(np.diff(cid)) + 1
    for a, b in zip(np.concatenate([[0], brk]), np.concatenate([brk, [len(pos)]]), strict=True):
        c = int(cid[a])
        local = pos[a:b] - c * chunk
        if np.all(np.diff(local) == 1):
            out.append((c, slice(int(a), int(b)), slice(int(local[0]), int(local[-1]) + 1)))
        else:
            out.append((c, np.arange(a, b), local))
    # a chunk met twice (unsorted positions) is read once per run; merge runs of the same chunk
    merged: dict[int, tuple[list, list]] = {}
    for c, o, i in out:
        merged.setdefault(c, ([], []))
        merged[c][0].append(np.arange(o.start, o.stop) if isinstance(o, slice) else o)
        merged[c][1].append(np.arange(i.start, i.stop) if isinstance(i, slice) else i)
    if len(merged) == len(out):
        return out
    return [(c, np.concatenate(o), np.concatenate(i)) for c, (o, i) in merged.items()]


def all_slices(sel: list[Any]) -> bool:
    for s in sel:
        if not isinstance(s, slice):
            return False
    return True


def piece(chunk: np.ndarray, in_sel: list[Any], drop: list[Any]) -> np.ndarray:
    """chunk[drop][in_sel], orthogonally: the values a target takes from the chunk."""
    if drop:
        chunk = chunk[tuple(drop)]
    if all_slices(in_sel):
        return chunk[tuple(in_sel)]
    return chunk[np.ix_(*[np.arange(s.start, s.stop) if isinstance(s, slice) else s for s in in_sel])]


def assign(out: np.ndarray, out_sel: list[Any], chunk: np.ndarray, in_sel: list[Any], drop: list[Any]) -> None:
    """out[out_sel] = chunk[drop][in_sel], orthogonally (arrays on several axes don't broadcast)."""
    values = piece(chunk, in_sel, drop)
    if all_slices(out_sel):
        out[tuple(out_sel)] = values
    else:
        out[np.ix_(*[np.arange(s.start, s.stop) if isinstance(s, slice) else s for s in out_sel])] = values


def readonly(a: np.ndarray) -> np.ndarray:
    """A view of ``a`` that cannot be written through (values a hook must leave alone)."""
    v = a.view()
    v.flags.writeable = False
    return v


def whole_view(shape: tuple[int, ...], targets: list[Target]) -> np.ndarray | None:
    """The destination view where a chunk of ``shape`` lands whole, in one place (no copy needed), else None."""
    if len(targets) != 1:
        return None
    out, out_sel, in_sel, drop, _ = targets[0]
    if out is None or drop or len(in_sel) != len(shape) or not all_slices(out_sel) or not all_slices(in_sel):
        return None
    if any((s.start or 0) != 0 or s.stop != n for s, n in zip(in_sel, shape, strict=True)):
        return None
    return out[tuple(out_sel)]


def positions(src: VarSource, region: dict[str, tuple[int, int]]) -> list[Any]:
    """Per stored dim, the stored positions the region covers (an int for a dim selected away)."""
    return [ix if isinstance(ix, int) else (ix[slice(*region[d])] if d in region else ix)
            for d, ix in zip(src.src_dims, src.index, strict=True)]


class RegionPlans:
    """The region plans of one reader, each made once and kept (bounded by ``REGION_PLANS``).

    ``sharded(array)`` says whether an array's objects are shards (``whole_chunk`` never applies).
    """

    def __init__(self, sharded: Callable[[Any], bool]):
        self.sharded = sharded
        self._whole_plans: dict[tuple[int, int], list[tuple[int, Any, Any]]] = {}
        self._plans: dict[tuple[int, tuple], tuple[VarSource, RegionPlan]] = {}
        self._ranges: dict[tuple[int, int], bool] = {}
        self._whole_axes: dict[int, tuple[VarSource, list[tuple[str, Any, int, int]] | None]] = {}

    def plan(self, src: VarSource, region: dict[str, tuple[int, int]]) -> RegionPlan:
        """The region's shape and the chunks it touches with where each piece goes: pure index math
        on the region alone, so planned once and kept (an epoch reads the same units in a new order,
        every epoch; one-sample-per-chunk archives pay this per chunk otherwise)."""
        key = (id(src), tuple(region.items()))  # callers name dims in one order: no sort
        got = self._plans.get(key)
        if got is not None and got[0] is src:  # (an id is reused once its object is gone)
            return got[1]
        pos = positions(src, region)
        shape = tuple(len(p) for p in pos if not isinstance(p, int))
        pieces: list[tuple[tuple[int, ...], list, list, list]] = []
        if math.prod(shape) != 0:
            plans = []
            for ax, (d, p) in enumerate(zip(src.src_dims, pos, strict=True)):
                cs = src.chunk_shape[ax]
                if isinstance(p, int):
                    plans.append([(p // cs, None, p % cs)])
                elif d in region:
                    if len(p) and self.is_range(src, ax):  # a slice of a step-1 index: integer math
                        plans.append(range_plan(int(p[0]), int(p[-1]) + 1, cs))
                    else:
                        plans.append(axis_plan(p, cs))
                else:  # a dim read whole: the same plan for every region, computed once
                    wk = (id(src), ax)
                    if wk not in self._whole_plans:
                        self._whole_plans[wk] = axis_plan(p, cs)
                    plans.append(self._whole_plans[wk])
            for combo in itertools.product(*plans):
                coords = tuple(int(c) for c, _, _ in combo)
                out_sel = [o for _, o, _ in combo if o is not None]
                in_sel = [i for _, o, i in combo if o is not None]
                drop = [i if o is None else slice(None) for _, o, i in combo]
                drop = drop if any(o is None for _, o, _ in combo) else []
                pieces.append((coords, out_sel, in_sel, drop))
        if len(self._plans) >= REGION_PLANS:  # bounded: a new region set (e.g. another split)
            self._plans.clear()
        plan: RegionPlan = (shape, pieces)
        self._plans[key] = (src, plan)
        return plan

    def shape(self, src: VarSource, region: dict[str, tuple[int, int]]) -> tuple[int, ...]:
        if not src.stored:
            return tuple(len(range(*region[d])) if d in region else n for d, n in zip(src.dims, src.shape,
                                                                                      strict=True))
        return tuple(len(p) for p in positions(src, region) if not isinstance(p, int))

    def is_range(self, src: VarSource, ax: int) -> bool:
        """Whether the positions ``src`` selects along axis ``ax`` step by one (checked once)."""
        key = (id(src), ax)
        got = self._ranges.get(key)
        if got is None:
            ix = src.index[ax]  # a view of the shared 0..n-1 index needs no pass (10^7 positions: 80 MB)
            got = self._ranges[key] = bool(len(ix) > 0 and run_start(np.asarray(ix, np.int64)) is not None)
        return got

    def whole_chunk(self, src: VarSource, region: dict[str, tuple[int, int]]) -> tuple[int, ...] | None:
        """The grid coordinates of the one chunk ``region`` is exactly (all of it and nothing else, in
        order), else None. Integer math on the selection, no region plan."""
        axes = self._whole_axes_of(src)
        coords = []
        for d, ix, n, cs in axes or ():
            a, b = region[d] if d in region else (0, n)
            if b - a != cs or not 0 <= a < b <= n:
                return None
            p0 = int(ix[a])
            if p0 % cs:
                return None
            coords.append(p0 // cs)
        return tuple(coords) if axes is not None else None

    def whole_chunks(self, src: VarSource, at: dict[str, np.ndarray]) -> np.ndarray | None:
        """``whole_chunk`` of many regions at once, each one position wide along the dims of ``at`` (the
        regions' positions there, one array per dim) and all of every other dim: their grid coordinates,
        shape (regions, stored dims), or None where any region is not exactly one chunk. The I/O loop's
        per-batch work on one-sample-per-chunk archives: one pass of numpy, not a Python call per sample
        and variable."""
        axes = self._whole_axes_of(src)
        if axes is None or not at:
            return None
        n = len(next(iter(at.values())))
        cols = []
        for d, ix, size, cs in axes:
            first = int(ix[0])  # the positions run by one (``_axes_of``)
            a = at.get(d)
            if a is None:  # all of the dim: one whole chunk
                if size != cs or first % cs:
                    return None
                cols.append(np.full(n, first // cs, dtype=np.int64))
            else:  # one position: a chunk of one, inside the selection
                if cs != 1 or (n and (int(a.min()) < 0 or int(a.max()) >= size)):
                    return None
                cols.append(first + np.asarray(a, dtype=np.int64))
        return np.stack(cols, axis=1) if cols else None

    def _whole_axes_of(self, src: VarSource) -> list[tuple[str, Any, int, int]] | None:
        """``_axes_of(src)``, made once per array."""
        got = self._whole_axes.get(id(src))
        if got is None or got[0] is not src:  # (an id is reused once its object is gone)
            got = self._whole_axes[id(src)] = (src, self._axes_of(src))
        return got[1]

    def _axes_of(self, src: VarSource) -> list[tuple[str, Any, int, int]] | None:
        """(dim, positions, their count, chunk length) per stored dim where every dim selects a run of
        positions (``whole_chunk`` can apply), else None."""
        if not src.stored or self.sharded(src.array):
            return None
        out = []
        for ax, (d, ix) in enumerate(zip(src.src_dims, src.index, strict=True)):
            if isinstance(ix, int) or not len(ix) or not self.is_range(src, ax):
                return None
            out.append((d, ix, len(ix), src.chunk_shape[ax]))
        return out
