"""Which stored positions a dask-backed variable holds, read off its own dask graph.

A variable of ``xr.open_zarr(p)`` (or ``.chunk()`` of a lazy one) is a dask graph that starts from xarray's
wrapper of the zarr array and then only selects and arranges: ``getitem`` (isel, reversal, a permutation),
``concatenate`` (``roll``, ``xr.concat``), ``rechunk``. xinsitu reads the stored chunks itself, so it needs the
stored position behind every position of the variable, per axis. Labels cannot say that with certainty
(a dim without a coordinate, ``roll`` that leaves the coordinate where it was, ``assign_coords``,
``copy(data=...)``), so the graph itself is run, with each wrapper of the zarr array replaced by a
:class:`Positions`: an array-like that holds, per axis, the stored positions it covers (one small vector per
axis, never the values). Every task of the graph then selects and arranges those positions exactly as it would
the values. Anything the graph does that is not a pure orthogonal selection (arithmetic, pointwise indexing,
broadcasting, values from elsewhere) raises :class:`Untraceable`, and the caller refuses the variable: a guess
could read other values than xarray gives, silently.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from xinsitu.compat.dask_api import task_spec

#: graphs traced in this process, by the dask array's name and its sources' positions (a Dataset's variables are
#: resolved again by each call: ``geometry``, ``split``, ``batches``), the most recent ``_MEMO_SIZE``
_MEMO: OrderedDict[tuple[str, str], Positions] = OrderedDict()
_MEMO_SIZE = 256
_MEMO_LOCK = threading.Lock()


class Untraceable(Exception):
    """The graph does something to the values other than an orthogonal selection (the message says what)."""


class Positions:
    """An array-like of stored positions: per axis, the stored axis it comes from (None: an axis the graph added)
    and the positions along it; ``dropped``: stored axes a scalar selection took, and the position it took."""

    __array_priority__ = 1000

    def __init__(self, axes: tuple[tuple[int | None, np.ndarray], ...], dropped: tuple[tuple[int, int], ...],
                 dtype: np.dtype):
        self.axes, self.dropped, self.dtype = axes, dropped, np.dtype(dtype)
        self.shape: tuple[int, ...] = tuple(len(p) for _, p in axes)

    @classmethod
    def of_source(cls, index: list, dtype: Any) -> Positions:
        """The positions a wrapper of the zarr array covers: ``index`` per stored axis (positions, or an int)."""
        axes = tuple((ax, np.asarray(ix, dtype=np.int64)) for ax, ix in enumerate(index) if not isinstance(ix, int))
        dropped = tuple((ax, ix) for ax, ix in enumerate(index) if isinstance(ix, int))
        return cls(axes, dropped, dtype)

    @property
    def ndim(self) -> int:
        return len(self.axes)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> Positions:
        key = key if isinstance(key, tuple) else (key,)
        arrays = [k for k in key if not isinstance(k, (slice, int, np.integer, type(None), type(Ellipsis)))]
        if len(arrays) > 1:
            raise Untraceable("pointwise (vectorised) indexing")
        if any(k is Ellipsis for k in key):
            at = key.index(Ellipsis)
            fill = self.ndim - sum(k is not None for k in key if k is not Ellipsis)
            key = key[:at] + (slice(None),) * fill + key[at + 1:]
        key = key + (slice(None),) * (self.ndim - sum(k is not None for k in key))
        axes: list[tuple[int | None, np.ndarray]] = []
        dropped = list(self.dropped)
        it = iter(self.axes)
        for k in key:
            if k is None:
                axes.append((None, np.zeros(1, dtype=np.int64)))
                continue
            src, pos = next(it)
            if isinstance(k, (int, np.integer)) or (isinstance(k, np.ndarray) and k.ndim == 0 and k.dtype.kind in "iu"):
                if src is not None:
                    dropped.append((src, int(pos[int(k)])))
                continue
            if not isinstance(k, slice):
                k = np.asarray(k)
                k = k.astype(np.int64) if k.size == 0 else k  # an empty list is float64 to numpy
                if k.ndim != 1 or k.dtype.kind not in "iub":
                    raise Untraceable(f"indexing with a {k.ndim}-d {k.dtype} array")
            axes.append((src, pos[k]))
        return Positions(tuple(axes), tuple(sorted(dropped)), self.dtype)

    def astype(self, dtype: Any, *args: Any, **kwargs: Any) -> Positions:
        if np.dtype(dtype) != self.dtype:  # a cast changes values (a round trip through a narrower type, too)
            raise Untraceable(f"a cast from {self.dtype} to {np.dtype(dtype)} (.astype)")
        return self

    def copy(self, *args: Any, **kwargs: Any) -> Positions:
        return self

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func is np.concatenate:
            return _concatenate(*args, **kwargs)
        if func is np.take:  # dask's selection of a list of positions, on one axis
            return _take(*args, **kwargs)
        raise Untraceable(f"np.{getattr(func, '__name__', func)}")

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        raise Untraceable(f"np.{getattr(ufunc, '__name__', ufunc)}")

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise Untraceable("a conversion to a numpy array")


def _take(a: Positions, indices: Any, axis: int | None = None, **kwargs: Any) -> Positions:
    if axis is None or kwargs.get("out") is not None or kwargs.get("mode", "raise") != "raise":
        raise Untraceable("np.take without an axis, or with out= or mode=")
    indices = np.asarray(indices)
    if indices.ndim != 1:
        raise Untraceable(f"np.take of a {indices.ndim}-d array of positions")
    axis = axis + a.ndim if axis < 0 else axis
    return a[(slice(None),) * axis + (indices,)]


def _concatenate(seq: Any, axis: int | None = 0, **kwargs: Any) -> Positions:
    parts = list(seq)
    if axis is None or kwargs.get("out") is not None or not parts:
        raise Untraceable("np.concatenate with axis=None or out=")
    if not all(isinstance(p, Positions) for p in parts):
        raise Untraceable("a concatenation with values that are not read from the store")
    first = parts[0]
    axis = axis + first.ndim if axis < 0 else axis
    for p in parts[1:]:
        if (p.ndim != first.ndim or p.dropped != first.dropped or p.dtype != first.dtype
                or any(a[0] != b[0] or (i != axis and not np.array_equal(a[1], b[1]))
                       for i, (a, b) in enumerate(zip(p.axes, first.axes, strict=True)))):
            raise Untraceable("a concatenation of pieces from different stored positions")
    axes = list(first.axes)
    axes[axis] = (first.axes[axis][0], np.concatenate([p.axes[axis][1] for p in parts]))
    return Positions(tuple(axes), first.dropped, first.dtype)


def trace(data: Any, sources: dict[Any, Positions]) -> Positions:
    """Run the dask graph of ``data`` with each graph value in ``sources`` (by key) replaced by its
    :class:`Positions`, and put the blocks together: the stored positions of the whole variable.

    Raises :class:`Untraceable` where a block is not a pure selection of the sources, or where the blocks do
    not line up orthogonally (a block row whose positions differ from another's along the same axis).
    """
    memo = (repr((str(data.name), data.shape, data.chunks, str(data.dtype))), _digest(sources))
    with _MEMO_LOCK:
        if memo in _MEMO:
            _MEMO.move_to_end(memo)
            return _MEMO[memo]
    traced = _trace(data, sources)
    with _MEMO_LOCK:
        _MEMO[memo] = traced
        while len(_MEMO) > _MEMO_SIZE:
            _MEMO.popitem(last=False)
    return traced


def _digest(sources: dict[Any, Positions]) -> str:
    """What names the positions ``sources`` cover (their keys, axes and positions)."""
    h = hashlib.blake2b(digest_size=16)
    for k in sorted(sources, key=repr):
        p = sources[k]
        h.update(repr((k, [(ax, len(pos)) for ax, pos in p.axes], p.dropped, str(p.dtype))).encode())
        for _, pos in p.axes:
            h.update(np.ascontiguousarray(pos).tobytes())
    return h.hexdigest()


def _trace(data: Any, sources: dict[Any, Positions]) -> Positions:
    from dask.core import flatten

    keys = list(flatten(data.__dask_keys__()))
    try:
        lazy, graph = _split_layers(data.__dask_graph__(), sources)
        if lazy is None:  # every task of the graph, run by dask's own scheduler where its task spec is missing
            blocks = _run({**dict(data.__dask_graph__()), **sources}, keys)
        else:
            blocks = _run({**graph, **sources}, keys, lazy)
    except Untraceable:
        raise
    except Exception as e:  # e.g. a task that takes the values' attributes that Positions lacks
        raise Untraceable(f"{type(e).__name__}: {e}") from e
    return _assemble(data, keys, blocks)


#: dask's getters of ``from_array`` (xarray chunks a lazy array with it): a block is ``source[slices]``
_GETTERS = frozenset({"getter", "getter_nofancy", "getter_inline"})


def _split_layers(hlg: Any, sources: dict[Any, Positions]) -> tuple[dict | None, dict]:
    """The graph's ``from_array`` layers over a source, whose blocks are slices of it by their chunk bounds (by
    name: ``(source, bounds per axis)``, made per block as asked, not all materialised: the layer of an archive
    of a million chunks), and every other layer's tasks. ``(None, {})`` where a layer is not of dask's task spec
    (a dask before 2024.12: its tasks name their dependencies only in the graph as a whole)."""
    spec = task_spec()
    if spec is None:  # pragma: no cover - a dask before its task spec (2024.12)
        return None, {}
    GraphNode = spec[1]
    lazy: dict[str, tuple[Positions, tuple]] = {}
    graph: dict = {}
    for name, layer in hlg.layers.items():
        task, deps = getattr(layer, "task", None), getattr(layer, "io_deps", None)
        indices: Any = getattr(layer, "indices", ())
        if (task is not None and deps and len(deps) == 1 and len(indices) == 2 and indices[0][1] is None
                and getattr(getattr(task, "func", None), "__name__", "") in _GETTERS
                and getattr(indices[0][0], "key", None) in sources and hasattr(next(iter(deps.values())), "starts")):
            lazy[name] = (sources[indices[0][0].key], next(iter(deps.values())).starts)
            continue
        for k, v in layer.items():
            if k in sources:
                continue
            if not isinstance(v, GraphNode):
                return None, {}
            graph[k] = v
    return lazy, graph


def _run(graph: dict, keys: list, lazy: dict[str, tuple[Positions, tuple]] | None = None) -> list:
    """The values of ``keys`` in ``graph``, each task run once, in this thread (dask's own scheduler, where its
    task spec is missing: it orders and tracks far more than a graph of selections needs, at 4x the time); the
    blocks of ``lazy`` layers (``_split_layers``) are sliced from their source as they are asked for."""
    spec = task_spec()
    if spec is None:  # pragma: no cover - a dask before its task spec (2024.12)
        import dask

        return list(dask.get(graph, keys))
    DataNode, _, convert_legacy_graph = spec
    sources = {k: v for k, v in graph.items() if isinstance(v, Positions)}
    rest = {k: v for k, v in graph.items() if k not in sources}
    nodes = rest if lazy is not None else convert_legacy_graph(rest)
    nodes.update({k: DataNode(k, v) for k, v in sources.items()})
    lazy = lazy or {}
    done: dict = {}
    for key in keys:
        stack = [key]
        while stack:
            k = stack[-1]
            if k in done:
                stack.pop()
                continue
            if isinstance(k, tuple) and k and k[0] in lazy:  # a block of a from_array layer: its slice of the source
                src, starts = lazy[k[0]]
                done[k] = src[tuple(slice(st[i], st[i + 1]) for st, i in zip(starts, k[1:], strict=True))]
                stack.pop()
                continue
            node = nodes[k]
            todo = [d for d in node.dependencies if d not in done]
            if todo:
                stack.extend(todo)
                continue
            done[k] = node({d: done[d] for d in node.dependencies})
            stack.pop()
    return [done[k] for k in keys]


def _assemble(data: Any, keys: list, blocks: Any) -> Positions:
    first: Positions | None = None
    per_axis: list[dict[int, np.ndarray]] = [{} for _ in range(data.ndim)]
    for key, block in zip(keys, blocks, strict=True):
        if not isinstance(block, Positions):
            raise Untraceable(f"a block that is not read from the store ({type(block).__name__})")
        if block.shape != tuple(data.chunks[ax][i] for ax, i in enumerate(key[1:])):
            raise Untraceable("a block whose shape is not its chunk's")
        first = block if first is None else first
        if block.dropped != first.dropped or block.dtype != first.dtype:
            raise Untraceable("blocks from different stored positions")
        for ax, i in enumerate(key[1:]):
            src, pos = block.axes[ax]
            if src != first.axes[ax][0]:
                raise Untraceable("blocks from different stored axes")
            seen = per_axis[ax].setdefault(i, pos)
            if seen is not pos and not np.array_equal(seen, pos):
                raise Untraceable("blocks whose positions do not line up orthogonally")
    if first is None:
        raise Untraceable("a graph without blocks")
    axes = tuple((first.axes[ax][0], np.concatenate([per_axis[ax][i] for i in range(len(data.chunks[ax]))])
                  if data.chunks[ax] else np.zeros(0, dtype=np.int64)) for ax in range(data.ndim))
    return Positions(axes, first.dropped, first.dtype)
