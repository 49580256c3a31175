"""Chunk-aligned splits: pure index math on the chunk-block grid, and ``make_split``.

A *chunk block* is one chunk along each split dim (the grid every variable shares, see
``geometry.common_edges``). Splits are sets of flat chunk-block ids (C order over the split
dims), so no read ever serves two splits. The record they go into, ``SplitManifest``, lives
in ``xinsitu.index.manifest`` (re-exported here).
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from xinsitu.index.geometry import Geometry, chunk_in_two_blocks, kept_sources, regular_edges
from xinsitu.index.manifest import SplitManifest, coord_span, fingerprint_of, json_label
from xinsitu.index.runs import Blocks
from xinsitu.index.source import VarSource

__all__ = ["SplitManifest", "check_fractions", "contiguous_split", "largest_remainder", "make_split",
           "random_split", "range_split"]


# ----------------------------------------------------------------------------- pure math
def largest_remainder(fractions: dict[str, float], total: int) -> dict[str, int]:
    """Whole counts summing to ``total``, proportional to ``fractions`` (largest remainder).

    Exact: each fraction is taken as the simplest rational its float stands for (``0.1`` is 1/10,
    ``1 / 6`` is 1/6, not the binary floats next to them), normalised to sum to 1, so remainders
    that are equal tie exactly and ties go to the split named first (0.05/0.1/0.85 of 56: 3/6/47).
    """
    exact = {k: simplest_fraction(float(f)) for k, f in fractions.items()}
    whole = sum(exact.values())
    raw = {k: f / whole * total if whole else Fraction(0) for k, f in exact.items()}
    counts = {k: math.floor(v) for k, v in raw.items()}
    left = total - sum(counts.values())
    # ties go to the split named first, so the result is deterministic
    names = list(raw)
    order = sorted(names, key=lambda k: (-(raw[k] - counts[k]), names.index(k)))
    for k in order[:left]:
        counts[k] += 1
    return counts


def simplest_fraction(f: float) -> Fraction:
    """The rational with the smallest denominator that rounds to the float ``f`` (a finite float):
    ``0.1`` -> 1/10, ``1 / 3`` -> 1/3, ``0.3333333`` -> 3333333/10000000."""
    x = Fraction(f)
    lo = (x + Fraction(math.nextafter(f, -math.inf))) / 2  # the floats' rounding interval, ends excluded
    hi = (x + Fraction(math.nextafter(f, math.inf))) / 2
    return _simplest_between(lo, hi)


def _simplest_between(lo: Fraction, hi: Fraction | None) -> Fraction:
    """The rational with the smallest denominator strictly between ``lo`` and ``hi`` (None: no upper
    end), by continued fractions."""
    n = math.floor(lo) + 1
    if hi is None or n < hi:
        return Fraction(n)
    fl = n - 1  # lo and hi both lie in (fl, fl + 1]; x = fl + 1 / y with y between 1/(hi - fl) and 1/(lo - fl)
    return fl + 1 / _simplest_between(1 / (hi - fl), None if lo == fl else 1 / (lo - fl))


def check_split_name(name: Any) -> None:
    """``ValueError`` unless ``name`` (a key of ``fractions=`` or ``ranges=``) is a non-empty string."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"split names must be non-empty strings, got {name!r}")


def check_fractions(fractions: dict[str, float]) -> dict[str, float]:
    """``fractions`` checked, as plain floats: any real number (numpy scalars included) is taken;
    a string or a bool raises ``TypeError`` naming ``fractions``."""
    if not isinstance(fractions, dict) or not fractions:
        raise ValueError("fractions must be a non-empty dict of split name -> fraction")
    out: dict[str, float] = {}
    for k, f in fractions.items():
        check_split_name(k)
        if not isinstance(f, numbers.Real) or isinstance(f, (bool, np.bool_)):
            raise TypeError(f"fractions[{k!r}] must be a number, got {type(f).__name__} {f!r}")
        f = float(f)
        if not math.isfinite(f):
            raise ValueError(f"fractions[{k!r}] must be a finite number, got {f!r}")
        if f < 0:
            raise ValueError(f"fraction for split {k!r} is negative ({f})")
        out[k] = f
    total = sum(out.values())
    if not math.isclose(total, 1.0, rel_tol=0, abs_tol=1e-6):
        raise ValueError(f"fractions must sum to 1, they sum to {total:g}: {fractions}")
    return out


def contiguous_split(nblocks: int, fractions: dict[str, float], gap: int) -> dict[str, Blocks]:
    """Consecutive runs of blocks in split order, ``gap`` blocks left out between runs."""
    avail = nblocks - gap * (len(fractions) - 1)
    if avail < len(fractions):
        raise ValueError(
            f"{nblocks} chunks cannot hold {len(fractions)} splits with gap={gap} "
            f"({avail} chunks left after gaps)"
        )
    counts = largest_remainder(fractions, avail)
    _check_nonempty(counts)
    out, start = {}, 0
    for k, c in counts.items():
        out[k] = Blocks.range(start, start + c)
        start += c + gap
    return out


def random_split(grid: tuple[int, ...], fractions: dict[str, float], gap: int, seed: int) -> dict[str, np.ndarray]:
    """Blocks assigned at random by fraction; then, in split order, a later split loses the blocks
    within ``gap`` blocks (Chebyshev distance on the block grid) of a block of an earlier split."""
    n = int(np.prod(grid))
    counts = largest_remainder(fractions, n)
    _check_nonempty(counts)
    perm = np.random.default_rng(seed).permutation(n)
    label = np.empty(n, dtype=np.int64)
    start = 0
    for i, c in enumerate(counts.values()):
        label[perm[start:start + c]] = i
        start += c
    label = label.reshape(grid)
    if gap > 0:
        taken = np.zeros(grid, dtype=bool)
        for i in range(len(counts)):
            mine = label == i
            near = _dilate(taken, gap)
            label[mine & near] = -1
            taken |= label == i
    flat = label.ravel()
    out = {k: np.flatnonzero(flat == i).astype(np.int64) for i, k in enumerate(counts)}
    _check_nonempty({k: len(v) for k, v in out.items()}, after_gap=True)
    return out


def _dilate(mask: np.ndarray, k: int) -> np.ndarray:
    """Cells within Chebyshev distance k of a True cell."""
    out = mask.copy()
    for ax in range(mask.ndim):
        cur = out.copy()
        for s in range(1, k + 1):
            lo = [slice(None)] * mask.ndim
            hi = [slice(None)] * mask.ndim
            lo[ax], hi[ax] = slice(s, None), slice(None, -s)
            out[tuple(lo)] |= cur[tuple(hi)]
            out[tuple(hi)] |= cur[tuple(lo)]
    return out


def _check_nonempty(counts: dict[str, int], after_gap: bool = False) -> None:
    empty = [k for k, c in counts.items() if c == 0]
    if empty:
        why = " after removing chunks within the gap" if after_gap else ""
        raise ValueError(f"split(s) {empty} would get no chunk{why}; use fewer splits, a smaller gap "
                         "or larger fractions")


def _fits(index: pd.Index, start: Any, stop: Any) -> bool:
    """Whether ``.sel``'s ``slice(start, stop)`` holds a label of ``index``."""
    try:
        sl = index.slice_indexer(start, stop)
    except (KeyError, TypeError, ValueError):
        return False
    return int(sl.stop if sl.stop is not None else len(index)) > int(sl.start or 0)


def range_split(edges: np.ndarray, index: pd.Index, ranges: dict[str, slice], gap: int,
                dim: str) -> dict[str, Blocks]:
    """Blocks fully inside each label range (``.sel`` semantics, rounded inward to chunk edges)."""
    out: dict[str, Blocks] = {}
    spans: list[tuple[str, int, int]] = []
    positions: list[tuple[str, int, int]] = []
    for name, rng in ranges.items():
        check_split_name(name)
        if not isinstance(rng, slice) or rng.step is not None:
            raise ValueError(f"range for split {name!r} must be a slice(start, stop), got {rng!r}")
        try:
            sl = index.slice_indexer(rng.start, rng.stop)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"range for split {name!r} ({rng.start!r}, {rng.stop!r}) does not fit the "
                             f"{dim!r} coordinate: {e}") from None
        a, b = int(sl.start or 0), int(sl.stop if sl.stop is not None else len(index))
        if b <= a and rng.start is not None and rng.stop is not None and _fits(index, rng.stop, rng.start):
            raise ValueError(
                f"range for split {name!r} ({rng.start!r}..{rng.stop!r}) runs against the {dim!r} coordinate, "
                f"whose labels run {json_label(index[0])}..{json_label(index[-1])}: as in .sel, a range is "
                f"slice(start, stop) in the coordinate's order (slice({rng.stop!r}, {rng.start!r}) here)"
            )
        if b <= a and 0 < a < len(index):
            raise ValueError(
                f"range for split {name!r} ({rng.start!r}..{rng.stop!r}) holds no label of the {dim!r} coordinate: "
                f"it lies between {json_label(index[a - 1])} and {json_label(index[a])}")
        if b <= a:
            raise ValueError(
                f"range for split {name!r} ({rng.start!r}..{rng.stop!r}) falls outside the {dim!r} coordinate "
                f"({json_label(index[0])}..{json_label(index[-1])})"
            )
        positions.append((name, a, b))
    by_start = sorted(positions, key=lambda p: p[1])
    for (n1, _, b1), (n2, a2, b2) in zip(by_start, by_start[1:], strict=False):  # the labels, before rounding
        if a2 < b1:
            raise ValueError(f"ranges of splits {n1!r} and {n2!r} overlap: both hold {dim!r} "
                             f"{json_label(index[a2])}..{json_label(index[min(b1, b2) - 1])}")
    for name, a, b in positions:
        first = int(np.searchsorted(edges, a, side="left"))  # first block starting at or after a
        last = int(np.searchsorted(edges, b, side="right")) - 1  # blocks ending at or before b
        if last <= first:
            raise ValueError(f"range for split {name!r} covers no whole chunk of {dim!r} "
                             f"(chunks are {int(edges[1] - edges[0])} long; block={{{dim!r}: n}} splits in "
                             "blocks of n positions instead)")
        spans.append((name, first, last))
        out[name] = Blocks.range(first, last)
    ordered = sorted(spans, key=lambda s: s[1])
    for (n1, _, e1), (n2, s2, _) in zip(ordered, ordered[1:], strict=False):  # (apart: their labels are)
        if s2 - e1 < gap:
            raise ValueError(f"splits {n1!r} and {n2!r} are {s2 - e1} chunk(s) apart, closer than gap={gap}: "
                             "ranges= keeps each range where it is and does not carve a gap out of one; leave "
                             f"{gap} chunk(s) of {dim!r} between the ranges, or use fractions= with gap={gap}, "
                             "which does")
    return out


def check_block(block: Any, dims: list[str], sizes: dict[str, int]) -> dict[str, int]:
    """``block=`` as ``{dim: positions per block}`` for split dims: ``TypeError``/``ValueError`` naming ``block``."""
    if block is None:
        return {}
    if not isinstance(block, dict):
        raise TypeError(f"block must be a dict of split dim -> positions per block, got {type(block).__name__} "
                        f"{block!r}")
    out = {}
    for d, n in block.items():
        if d not in dims:
            raise ValueError(f"block: {d!r} is not a split dim (the split dims are {dims})")
        if not isinstance(n, (int, np.integer)) or isinstance(n, (bool, np.bool_)):
            raise TypeError(f"block[{d!r}] must be a whole number of positions, got {type(n).__name__} {n!r}")
        if not 1 <= n <= sizes[d]:
            raise ValueError(f"block[{d!r}] must be between 1 and the length of {d!r} ({sizes[d]}), got {n!r}")
        out[d] = int(n)
    return out


def block_edges(size: int, n: int) -> np.ndarray:
    """Edges ``0, n, 2n, .., size`` of blocks of ``n`` positions (the last one may be shorter), read-only."""
    return regular_edges(0, size, n)


def _unsplittable(geometry: Geometry, d: str) -> ValueError:
    """The error for a split dim held in a single chunk: split it in blocks, or join files along it."""
    whole = [v for v, g in geometry.variables.items()
             if d in g.dims and g.chunks[g.dims.index(d)] >= g.shape[g.dims.index(d)]]
    n = geometry.sizes[d]
    return ValueError(
        f"dim {d!r} is held in one chunk of {n}"
        + (f" (variables {whole} hold it in a single chunk)" if whole else
           f" (the variables' chunks of {geometry.dims[d]} share no edge inside it)")
        + f", so its chunks cannot go to several splits: pass block={{{d!r}: n}} to split it in blocks of n "
        f"positions instead (a chunk is then read by several splits, a sample never), or, for files that hold "
        f"one step each, open them with xinsitu.virtual.open_netcdf(files, concat_dim={d!r}) "
        f"(or open_grib(..., concat_dim={d!r})) so that each file is a chunk along {d!r}; "
        "one split (fractions={'train': 1.0}) needs neither")


def _check_chunks_in_one_block(sources: dict[str, VarSource], d: str, edges: np.ndarray) -> None:
    """``ValueError`` where a selection that reorders ``d`` puts one stored chunk in two chunk blocks, which
    could then go to two splits (one read serving both)."""
    hit = chunk_in_two_blocks(sources, d, edges)
    if hit is None:
        return
    name, k, c, (a1, b1), (a2, b2) = hit
    raise ValueError(
        f"dim {d!r}: the selection reorders {d!r} so that stored chunk {k} of {name!r} (stored positions "
        f"{k * c}..{k * c + c - 1}) appears in two places, positions {a1}..{b1 - 1} and {a2}..{b2 - 1} here "
        f"(e.g. sortby after re-centring longitudes, or roll): its two parts would be two chunk blocks, which "
        f"could go to two splits, one read serving both. Pass block={{{d!r}: n}} to split in blocks of n "
        "positions (a chunk may then be read by several splits, a sample never), or split the Dataset in the "
        f"archive's own order of {d!r} (before sortby/roll) and reorder the samples afterwards"
    )


def make_split(ds: Any, geometry: Geometry, dim: str | list[str], *, fractions: dict[str, float] | None = None,
               ranges: dict[str, slice] | None = None, gap: int = 0, contiguous: bool | None = None,
               seed: int | None = 0, block: dict[str, int] | None = None) -> SplitManifest:
    """Split ``ds`` (with ``geometry``) along ``dim`` into a ``SplitManifest``; see ``Dataset.insitu.split``.

    ``block={d: n}``: the blocks along ``d`` are runs of ``n`` positions instead of the chunk grid's."""
    dims = [dim] if isinstance(dim, str) else list(dim)
    if not dims or not all(isinstance(d, str) for d in dims):
        raise ValueError(f"dim must be a dim name or a list of names, got {dim!r}")
    if len(set(dims)) != len(dims):
        twice = sorted({d for d in dims if dims.count(d) > 1})
        raise ValueError(f"dim lists {twice} more than once ({dims}): name each split dim once")
    for d in dims:
        if d not in geometry.sizes:
            have = sorted(geometry.sizes)
            raise ValueError(f"unknown dim {d!r}: the data variables have dims {have}")
        if geometry.sizes[d] == 0:
            raise ValueError(f"dim {d!r} has length 0 here: the selection holds no position of {d!r} (a .sel "
                             "range outside its coordinate?), so there is nothing to split")
    block = check_block(block, dims, geometry.sizes)
    edges = {d: block_edges(geometry.sizes[d], block[d]) if d in block else geometry.edges[d] for d in dims}
    nsplits = len(fractions) if isinstance(fractions, dict) else len(ranges) if isinstance(ranges, dict) else 2
    for d in dims:
        if len(edges[d]) - 1 < 2 and d not in block and nsplits > 1:
            raise _unsplittable(geometry, d)
    if nsplits > 1 and any(d not in block for d in dims) and isinstance(ds, xr.Dataset):
        sources = kept_sources(ds)
        for d in dims:
            if d not in block:
                _check_chunks_in_one_block(sources, d, edges[d])
    if not isinstance(gap, (int, np.integer)) or isinstance(gap, bool) or gap < 0:
        raise ValueError(f"gap must be a non-negative whole number of chunks, got {gap!r}")
    if (fractions is None) == (ranges is None):
        raise ValueError("give exactly one of fractions= or ranges=")
    if contiguous is None:
        contiguous = len(dims) == 1
    grid = tuple(len(edges[d]) - 1 for d in dims)
    if fractions is not None:
        fractions = check_fractions(fractions)
        if contiguous:
            if len(dims) != 1:
                raise ValueError("contiguous=True needs a single split dim; use contiguous=False for several")
            chosen: dict[str, Any] = contiguous_split(grid[0], fractions, int(gap))
        else:
            if seed is None:
                raise ValueError("contiguous=False draws chunks at random and needs an integer seed")
            chosen = random_split(grid, fractions, int(gap), int(seed))
        method = "fractions"
    else:
        if not isinstance(ranges, dict) or not ranges:
            raise ValueError("ranges must be a non-empty dict of split name -> slice of labels")
        if len(dims) != 1:
            raise ValueError("ranges= works on a single split dim")
        # a dim without a coordinate is labelled by its positions
        index = ds.indexes[dims[0]] if dims[0] in ds.indexes else pd.RangeIndex(geometry.sizes[dims[0]])
        chosen = range_split(edges[dims[0]], index, ranges, int(gap), dims[0])
        method = "ranges"
    sizes = {d: int(geometry.sizes[d]) for d in dims}
    splits = {k: Blocks.from_ids(v) for k, v in chosen.items()}
    labels: dict[str, dict[str, list[Any]]] = {}
    for name, blocks in splits.items():
        idx: tuple[np.ndarray, ...]
        if len(dims) == 1:  # O(runs)
            lo, hi = blocks.bounds()
            idx = (np.array([lo, hi]),)
        else:
            idx = np.unravel_index(blocks.ids(), grid)
        labels[name] = {}
        for k, d in enumerate(dims):
            first = int(edges[d][int(idx[k].min())])
            last = int(edges[d][int(idx[k].max()) + 1]) - 1
            # without a coordinate, the labels are the positions
            labels[name][d] = ([json_label(ds.indexes[d][first]), json_label(ds.indexes[d][last])] if d in ds.indexes
                               else [first, last])
    coords = {d: coord_span(ds, d) for d in dims}
    fp = fingerprint_of(dims, sizes, edges, coords)
    from xinsitu.index.snapshot import snapshot_of
    return SplitManifest(dims=dims, sizes=sizes, edges=edges,
                         splits=splits,
                         labels=labels, seed=None if seed is None else int(seed), gap=int(gap),
                         contiguous=bool(contiguous), method=method, fingerprint=fp,
                         snapshot=snapshot_of(ds), extra={"coords": coords}, block=block)
