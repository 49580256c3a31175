"""Chunk geometry of a Dataset, read from metadata alone (never from data)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from xinsitu.index.source import _ARANGES, DaskBlocks, VarSource, resolve
from xinsitu.index.xr_adapter import variable_data
from xinsitu.repr import formatting


@dataclass(frozen=True)
class VarGeometry:
    """Chunk layout of one variable, in the Dataset's dims (after any selection)."""

    name: str
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    chunks: tuple[int, ...]  # inner chunk (the smallest unit read), per dim
    shards: tuple[int, ...] | None  # stored object, where the array is sharded
    dtype: str
    codecs: tuple[str, ...]
    chunk_nbytes: int  # decoded size of one chunk
    nchunks: int  # chunks the selection touches
    stored: bool


@dataclass(frozen=True)
class Geometry:
    """Per-variable chunk layout and, per dim, the chunk size the variables share.

    ``dims[d]`` is an int where every variable with dim ``d`` has the same chunk size,
    else the sorted tuple of the differing sizes. ``edges[d]`` are the positions where
    every such variable starts a new chunk: the grid splits are aligned to.
    """

    variables: dict[str, VarGeometry]
    dims: dict[str, int | tuple[int, ...]]
    sizes: dict[str, int]
    edges: dict[str, np.ndarray]

    def nblocks(self, dim: str) -> int:
        return len(self.edges[dim]) - 1

    def _repr_parts(self, drawing: bool = False) -> tuple[str, str, list[Any]]:
        """Title, headline and sections of both reprs (``xinsitu.repr.formatting.text_repr``)."""
        return formatting.geometry_parts(self, drawing)

    def __repr__(self) -> str:
        return formatting.text_repr(self)

    def _repr_html_(self) -> str:
        return formatting.html_repr(self)


def _codec_names(array: object) -> tuple[str, ...]:
    names = []
    for attr in ("filters", "serializer", "compressors"):
        val = getattr(array, attr, None)
        if val is None:
            continue
        for c in val if isinstance(val, tuple) else (val,):
            cfg = c.to_dict() if hasattr(c, "to_dict") else c.get_config()
            names.append(str(cfg.get("name", cfg.get("id", type(c).__name__))))
    return tuple(names)


def run_start(ix: np.ndarray) -> int | None:
    """First position where ``ix`` is the consecutive run ``a, a+1, ..., a+len-1``, else None.

    An untouched or sliced stored dim is such a run: its chunk grid is then arithmetic and
    needs no per-position (or per-chunk) array. One vectorised pass over ``ix``, no sort.
    """
    n = len(ix)
    if n == 0:
        return 0
    base = ix if ix.base is None else ix.base
    if ix.strides == (8,) and isinstance(base, np.ndarray) and base is _ARANGES.get(len(base)):
        return int(ix[0])  # a step-1 view of the shared 0..n-1 (an untouched or sliced dim): no pass
    a = int(ix[0])
    if int(ix[-1]) - a != n - 1:
        return None
    return a if n < 2 or bool((ix[1:] > ix[:-1]).all()) else None  # n increasing ints spanning n-1: a run


def _chunks_touched(ix: np.ndarray, c: int) -> int:
    """Distinct chunks (of length ``c``) the positions ``ix`` fall in."""
    a = run_start(ix)
    if a is not None:
        return 0 if len(ix) == 0 else (a + len(ix) - 1) // c - a // c + 1
    ids = ix // c
    if len(ids) < 2 or bool((ids[1:] >= ids[:-1]).all()):  # sorted selection: count the changes
        return int(len(ids) > 0) + int(np.count_nonzero(ids[1:] != ids[:-1]))
    return len(np.unique(ids))


def var_geometry(src: VarSource) -> VarGeometry:
    """Geometry of one variable from its source (metadata only; no per-chunk array on a regular grid)."""
    itemsize = src.raw_dtype.itemsize
    if src.stored:
        kept = [ax for ax, ix in enumerate(src.index) if not isinstance(ix, int)]
        chunks = tuple(src.chunk_shape[ax] for ax in kept)
        shards = getattr(src.array, "shards", None)
        shards = tuple(shards[ax] for ax in kept) if shards else None
        nchunks = 1
        for ax, ix in enumerate(src.index):
            if not isinstance(ix, int):
                nchunks *= _chunks_touched(np.asarray(ix, dtype=np.int64), src.chunk_shape[ax])
        return VarGeometry(
            src.name, src.dims, src.shape, chunks, shards, str(src.raw_dtype), _codec_names(src.array),
            int(np.prod(src.chunk_shape)) * itemsize, int(nchunks), True,
        )
    chunks = tuple(max(c) if c else 0 for c in src.mem_chunks)
    nchunks = int(np.prod([len(c) for c in src.mem_chunks])) if src.mem_chunks else 1
    return VarGeometry(src.name, src.dims, src.shape, chunks, None, str(src.raw_dtype), (),
                       int(np.prod(chunks)) * itemsize, nchunks, False)


def chunk_breaks(src: VarSource, dim: str) -> np.ndarray:
    """Positions ``1..n-1`` of ``dim`` (in this selection) where ``src`` starts a new chunk.

    Arithmetic where the selection is a run of the stored dim (O(chunks)); per position only
    for a scattered selection.
    """
    return _breaks(src, dim)[1]


def _breaks(src: VarSource, dim: str) -> tuple[tuple[int, ...] | None, np.ndarray]:
    """``chunk_breaks`` and, where the grid is arithmetic, what fixes it (start, length, chunk)."""
    if not src.stored:
        sizes = np.asarray(src.mem_chunks[src.dims.index(dim)], dtype=np.int64)
        return None, (np.cumsum(sizes[:-1])[sizes[:-1] > 0] if len(sizes) > 1 else np.zeros(0, np.int64))
    ax = src.src_dims.index(dim)
    ix = np.asarray(src.index[ax], dtype=np.int64)
    c = src.chunk_shape[ax]
    a = run_start(ix)
    if a is not None:
        return (a % c, len(ix), c), np.arange((-a) % c or c, len(ix), c, dtype=np.int64)
    ids = ix // c
    return None, (np.flatnonzero(ids[1:] != ids[:-1]) + 1).astype(np.int64)


_EDGES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def regular_edges(start: int, length: int, c: int) -> np.ndarray:
    """Chunk edges ``0, .., length`` of ``length`` positions from stored position ``start`` on chunks of ``c``.

    One allocation (no breaks-then-concatenate temporaries), read-only, and shared while alive:
    every geometry on that grid (a derived Dataset's, the generator's) holds the same array
    (10^7 chunks: one 80 MB array, not one per geometry).
    """
    key = (start % c, length, c)
    e = _EDGES.get(key)
    if e is None:
        first = (-start) % c or c
        m = len(range(first, length, c))
        e = np.arange(m + 2, dtype=np.int64)  # then k*c + first - c in place: 0, first, first + c, ..., length
        e *= c
        e += first - c
        e[0], e[-1] = 0, length
        e.setflags(write=False)
        _EDGES[key] = e
    return e


def common_edges(sources: dict[str, VarSource], dim: str) -> np.ndarray:
    """Positions where every variable with ``dim`` starts a chunk (plus 0 and the length); variables held
    in memory count only where no variable read from a store or through dask has ``dim``.

    O(variables) for variables on one regular grid (the shared ``regular_edges``), O(chunks)
    for differing regular grids.
    """
    have = [s for s in sources.values() if dim in s.dims]
    if not have:
        raise ValueError(f"no data variable has dim {dim!r}")
    read = [s for s in have if s.stored or not isinstance(s.values, np.ndarray)]
    if read:  # values in memory cut anywhere: their grid (a loaded variable's encoded chunks, counted from its
        have = read  # first position, whatever the selection) makes no edges where stored variables share the dim
    n = have[0].shape[have[0].dims.index(dim)]
    brk: np.ndarray | None = None
    grids: dict[tuple[int, int, int], int] = {}  # arithmetic grids: (start mod c, length, c) -> start
    for s in have:
        if s.stored:
            ax = s.src_dims.index(dim)
            ix = np.asarray(s.index[ax], dtype=np.int64)
            a = run_start(ix)
            if a is not None:  # the same arithmetic grid as a variable already counted adds nothing
                c = s.chunk_shape[ax]
                grids.setdefault((a % c, len(ix), c), a)
                continue
        b = _breaks(s, dim)[1]
        brk = b if brk is None else np.intersect1d(brk, b, assume_unique=True)
    if brk is None and len(grids) == 1:
        ((_, length, c), a), = grids.items()
        return regular_edges(a, length, c)
    for (_, length, c), a in grids.items():
        b = np.arange((-a) % c or c, length, c, dtype=np.int64)
        brk = b if brk is None else np.intersect1d(brk, b, assume_unique=True)
    assert brk is not None
    out = np.empty(len(brk) + 2, dtype=np.int64)
    out[0], out[1:-1], out[-1] = 0, brk, n
    return out


def chunk_in_two_blocks(sources: dict[str, VarSource], dim: str,
                        edges: np.ndarray) -> tuple[str, int, int, tuple[int, int], tuple[int, int]] | None:
    """A stored chunk along ``dim`` that two chunk blocks (of ``edges``) hold, or None.

    A selection that reorders or repeats ``dim`` (``sortby`` after re-centring longitudes, ``roll``,
    ``isel`` with an index array) can put one stored chunk in two places, which the chunk grid of the
    selection sees as two blocks. Returns the variable, the stored chunk, its chunk length and the
    selection's positions ``[start, stop)`` of its first two places in different blocks. Only a
    selection that is not a run of the stored dim is looked at (one pass over its positions).
    """
    for s in sources.values():
        if not s.stored or dim not in s.dims:
            continue
        ax = s.src_dims.index(dim)
        ix = np.asarray(s.index[ax], dtype=np.int64)
        if len(ix) < 2 or run_start(ix) is not None:
            continue
        c = s.chunk_shape[ax]
        ids = ix // c
        starts = np.concatenate([[0], np.flatnonzero(ids[1:] != ids[:-1]) + 1]).astype(np.int64)
        stops = np.append(starts[1:], len(ix))
        run_ids = ids[starts]
        run_block = np.searchsorted(edges, starts, side="right") - 1  # each run lies in one block
        order = np.lexsort((starts, run_ids))  # by chunk, then by place in the selection
        rid, rblock = run_ids[order], run_block[order]
        other = np.flatnonzero((rid[1:] == rid[:-1]) & (rblock[1:] != rblock[:-1]))
        if len(other):
            k = int(rid[other[0]])
            runs = order[rid == k]  # the chunk's runs, in the selection's order
            first = int(runs[0])
            second = next(int(r) for r in runs if run_block[r] != run_block[first])
            return (s.name, k, c, (int(starts[first]), int(stops[first])),
                    (int(starts[second]), int(stops[second])))
    return None


def geometry_of(sources: dict[str, VarSource]) -> Geometry:
    """The Geometry of a set of variable sources."""
    variables = {name: var_geometry(s) for name, s in sources.items()}
    dims: dict[str, int | tuple[int, ...]] = {}
    sizes: dict[str, int] = {}
    edges: dict[str, np.ndarray] = {}
    for g in variables.values():
        for d, n in zip(g.dims, g.shape, strict=True):
            sizes.setdefault(d, n)
    for d in sizes:
        cs = sorted({g.chunks[g.dims.index(d)] for g in variables.values() if d in g.dims})
        dims[d] = cs[0] if len(cs) == 1 else tuple(cs)
        edges[d] = common_edges(sources, d)
        edges[d].setflags(write=False)  # shared with the manifests split on it
    return Geometry(variables, dims, sizes, edges)


# --------------------------------------------------------------------------- once per Dataset
#: per Dataset (by id, dropped when it is collected): its data variables (what the entry is valid
#: for), the sources kept and the geometry of all its data variables
_BY_DATASET: dict[int, tuple[weakref.ref, list[tuple[Any, Any, Any]], dict[str, VarSource], Geometry]] = {}


def _data_key(ds: xr.Dataset) -> list[tuple[Any, Any, Any]]:
    return [(k, v, variable_data(v)) for k, v in ((k, ds.variables[k]) for k in ds.data_vars)]


def _same(a: list[tuple[Any, Any, Any]], b: list[tuple[Any, Any, Any]]) -> bool:
    return len(a) == len(b) and all(x[0] == y[0] and x[1] is y[1] and x[2] is y[2] for x, y in zip(a, b, strict=True))


def _keepable(src: VarSource, ds: xr.Dataset) -> bool:
    """Whether keeping ``src`` with the Dataset holds nothing the Dataset does not hold already (a
    stored array's positions, a dask wrapper, the variable's own numpy values; not a computed copy)."""
    return src.stored or isinstance(src.values, DaskBlocks) or src.values is variable_data(ds.variables[src.name])


def _forgetter(key: int) -> Any:
    def forget(ref: weakref.ref) -> None:  # (an id is reused once its Dataset is gone: drop only its own)
        hit = _BY_DATASET.get(key)
        if hit is not None and hit[0] is ref:
            del _BY_DATASET[key]
    return forget


def dataset_geometry(ds: xr.Dataset, names: list[str] | None = None) -> tuple[dict[str, VarSource], Geometry]:
    """Sources and geometry of ``names`` (default: every data variable) of ``ds``, computed once per Dataset.

    The sources and geometry of all its data variables are kept with the Dataset (again only when
    its data variables change: added, replaced, loaded in place), so ``ds.insitu.geometry``, a split
    and every generator share them: one position index per dim (the views of ``source._arange``),
    one edges array per grid. ``names`` in the Dataset's order of all of them gets that geometry;
    other ``names`` one of their own, made of the kept sources (O(variables) on a regular grid).
    """
    key = _data_key(ds)
    hit = _BY_DATASET.get(id(ds))
    fresh = hit is not None and hit[0]() is ds and _same(hit[1], key)
    every = [k for k, _, _ in key]
    if not fresh and (names is None or list(names) == every):
        sources = resolve(ds)
        geometry = geometry_of(sources)
        kept = {n: s for n, s in sources.items() if _keepable(s, ds)}
        _BY_DATASET[id(ds)] = (weakref.ref(ds, _forgetter(id(ds))), key, kept, geometry)
        return sources, geometry
    if not fresh:
        sources = resolve(ds, names)
        return sources, geometry_of(sources)
    assert hit is not None
    kept = hit[2]
    want = every if names is None else list(names)
    redo = [n for n in want if n not in kept]
    got = resolve(ds, redo) if redo else {}  # (raises as resolve does for names not in the Dataset)
    sources = {n: kept[n] if n in kept else got[n] for n in want}
    return sources, (hit[3] if want == every else geometry_of(sources))


def kept_sources(ds: xr.Dataset) -> dict[str, VarSource]:
    """The sources ``dataset_geometry`` keeps with ``ds`` (every stored variable's among them), without
    resolving again the variables it does not keep (in-memory copies)."""
    dataset_geometry(ds)
    hit = _BY_DATASET.get(id(ds))
    return dict(hit[2]) if hit is not None and hit[0]() is ds else {}
