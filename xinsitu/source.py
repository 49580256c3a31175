"""Map each data variable of an ``xr.Dataset`` back to where its values live.

A variable is either *stored* (a zarr array, plus, per dimension of that array, the
positions the Dataset's selection took) or *in memory* (a numpy array plus a chunk
grid). Nothing here reads data, except the small index coordinates needed to map a
dask-backed selection back to its store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xarray as xr

#: CF keys that xarray moves from attrs to ``encoding`` when it decodes a variable.
CF_KEYS = ("_FillValue", "missing_value", "scale_factor", "add_offset", "_Unsigned", "units", "calendar", "dtype")

#: dask layer names that only select or re-chunk the values they read (no arithmetic).
_SELECT_ONLY = ("original-", "open_dataset-", "getitem-", "rechunk-", "xarray-", "array-", "astype-")


@dataclass
class VarSource:
    """Where one data variable's values come from; picklable (goes to DataLoader workers)."""

    name: str
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype  # what xarray returns (after CF decoding)
    raw_dtype: np.dtype  # what the store holds
    cf: dict[str, Any] = field(default_factory=dict)  # CF encoding to re-apply after a raw read
    array: Any = None  # zarr.Array (stored variables)
    src_dims: tuple[str, ...] = ()
    index: tuple[Any, ...] = ()  # per source dim: int64 positions, or an int for a dropped dim
    chunk_shape: tuple[int, ...] = ()  # inner chunk of the source array (unit of reading)
    values: np.ndarray | None = None  # in-memory variables
    mem_chunks: tuple[tuple[int, ...], ...] = ()

    @property
    def stored(self) -> bool:
        return self.array is not None

    def chunk_ids(self, dim: str) -> np.ndarray:
        """Chunk index (of the source grid) of every position of ``dim`` in this selection."""
        if self.stored:
            ax = self.src_dims.index(dim)
            return np.asarray(self.index[ax], dtype=np.int64) // self.chunk_shape[ax]
        sizes = self.mem_chunks[self.dims.index(dim)]
        return np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)

    def chunk_len(self, dim: str) -> int | None:
        """The chunk length along ``dim`` (None for a ragged in-memory grid)."""
        if self.stored:
            return self.chunk_shape[self.src_dims.index(dim)]
        sizes = set(self.mem_chunks[self.dims.index(dim)][:-1]) or set(self.mem_chunks[self.dims.index(dim)])
        return sizes.pop() if len(sizes) == 1 else None


class SourceError(ValueError):
    """The Dataset cannot be mapped back to a store or to memory."""


def resolve(ds: xr.Dataset, variables: list[str] | None = None) -> dict[str, VarSource]:
    """Return a ``VarSource`` for each data variable (or the ones named)."""
    names = list(ds.data_vars) if variables is None else list(variables)
    if not names:
        raise ValueError("the Dataset has no data variables")
    missing = [v for v in names if v not in ds.data_vars]
    if missing:
        raise ValueError(f"unknown variable(s) {missing}; the Dataset has {list(ds.data_vars)}")
    return {v: _resolve_var(ds, v) for v in names}


def _resolve_var(ds: xr.Dataset, name: str) -> VarSource:
    var = ds[name].variable
    data = var._data
    base = dict(name=name, dims=tuple(var.dims), shape=tuple(var.shape), dtype=np.dtype(var.dtype))
    if _is_dask(data):
        return _resolve_dask(ds, name, data, base)
    if isinstance(data, np.ndarray):
        chunks = _memory_chunks(var)
        return VarSource(raw_dtype=np.dtype(var.dtype), values=data, mem_chunks=chunks, **base)
    zarray, keys = _unwrap_lazy(data)
    if zarray is None:
        if _in_memory(data):  # e.g. a stored variable that xarray has already loaded and cached
            values = np.asarray(var.values)
            return VarSource(raw_dtype=values.dtype, values=values, mem_chunks=_memory_chunks(var), **base)
        raise SourceError(
            f"variable {name!r} is backed by {type(data).__name__}, which xinsitu cannot map back to a "
            "zarr store; open the archive with xinsitu.open_zarr or xr.open_zarr, or load it into memory"
        )
    src_dims = _array_dims(zarray, name)
    index = _compose_keys(zarray.shape, keys)
    return _stored(base, var, zarray, src_dims, index)


def _stored(base: dict, var: xr.Variable, zarray: Any, src_dims: tuple[str, ...], index: list) -> VarSource:
    kept = tuple(d for d, ix in zip(src_dims, index, strict=True) if not isinstance(ix, int))
    if kept != base["dims"]:
        raise SourceError(
            f"variable {base['name']!r}: its dims {base['dims']} do not follow the stored array's {src_dims}; "
            "transposed views are not supported, select variables without transposing them"
        )
    cf = {k: var.encoding[k] for k in CF_KEYS if k in var.encoding}
    return VarSource(
        raw_dtype=np.dtype(zarray.dtype),
        cf=cf,
        array=zarray,
        src_dims=src_dims,
        index=tuple(index),
        chunk_shape=tuple(zarray.chunks),
        **base,
    )


def _is_dask(data: Any) -> bool:
    return type(data).__module__.startswith("dask") and hasattr(data, "__dask_graph__")


def _in_memory(data: Any) -> bool:
    """Whether xarray's wrappers around ``data`` end in values already in memory."""
    from xarray.core import indexing

    node = data
    for _ in range(64):
        if isinstance(node, np.ndarray | indexing.NumpyIndexingAdapter | indexing.PandasIndexingAdapter):
            return True
        if isinstance(node, indexing.LazilyIndexedArray | indexing.LazilyVectorizedIndexedArray):
            return False
        node = getattr(node, "array", None)
        if node is None:
            return False
    return False


def _memory_chunks(var: xr.Variable) -> tuple[tuple[int, ...], ...]:
    """Chunk grid of an in-memory variable: dask chunks, else encoded chunks, else one per position."""
    if var.chunks is not None:
        return tuple(tuple(int(c) for c in cs) for cs in var.chunks)
    enc = var.encoding.get("chunks")
    out = []
    for ax, n in enumerate(var.shape):
        c = int(enc[ax]) if enc is not None and len(enc) == var.ndim and enc[ax] else 1
        full, rest = divmod(n, c)
        out.append((c,) * full + ((rest,) if rest else ()))
    return tuple(out)


def _unwrap_lazy(data: Any) -> tuple[Any, list]:
    """Walk xarray's lazy wrappers down to the zarr array; return it and the keys, outermost first."""
    from xarray.core import indexing

    keys: list = []
    node = data
    for _ in range(64):
        if isinstance(node, indexing.LazilyVectorizedIndexedArray):
            raise SourceError(
                "vectorised (pointwise) indexing of a stored variable cannot be mapped back to its chunks; "
                "use orthogonal selections (isel/sel with slices, lists or scalars)"
            )
        if isinstance(node, indexing.LazilyIndexedArray):
            keys.append(node.key.tuple)
            node = node.array
            continue
        if type(node).__name__ == "ZarrArrayWrapper":
            return node._array, keys
        inner = getattr(node, "array", None)
        if inner is None:
            return None, keys
        node = inner
    return None, keys


def _compose_keys(shape: tuple[int, ...], keys: list) -> list:
    """Apply lazy indexing keys (outermost first) to per-dim positions of the stored array."""
    index: list = [np.arange(n, dtype=np.int64) for n in shape]
    for key in reversed(keys):
        live = [ax for ax, ix in enumerate(index) if not isinstance(ix, int)]
        if len(key) != len(live):
            raise SourceError(f"cannot compose indexing key {key} with {len(live)} dims")
        for ax, k in zip(live, key, strict=True):
            pos = index[ax]
            if isinstance(k, (int, np.integer)):
                index[ax] = int(pos[int(k)])
            else:
                index[ax] = pos[np.asarray(k) if not isinstance(k, slice) else k]
    return index


def _array_dims(zarray: Any, name: str) -> tuple[str, ...]:
    dims = getattr(zarray.metadata, "dimension_names", None)
    if not dims:
        dims = zarray.attrs.get("_ARRAY_DIMENSIONS")
    if not dims:
        raise SourceError(f"stored array for {name!r} has no dimension names")
    return tuple(dims)


# --------------------------------------------------------------------------- dask
def _dask_zarr_array(data: Any) -> Any:
    """The zarr array a dask-backed variable was opened from, or None; raises for computed graphs."""
    graph = data.__dask_graph__()
    layers = getattr(graph, "layers", {})
    for lname in layers:
        if not lname.startswith(_SELECT_ONLY):
            raise SourceError(
                f"this variable is computed lazily by dask (graph layer {lname!r}), so its values are not "
                "the stored ones; xinsitu reads from the store itself. Select variables and positions only "
                "(isel/sel), or .load()/.compute() the result to train from memory"
            )
    for layer in layers.values():
        for v in layer.values():
            adapter = getattr(v, "array", None)
            if adapter is None:
                continue
            zarray, _ = _unwrap_lazy(adapter)
            if zarray is not None:
                return zarray
    return None


def _resolve_dask(ds: xr.Dataset, name: str, data: Any, base: dict) -> VarSource:
    var = ds[name].variable
    zarray = _dask_zarr_array(data)
    if zarray is None:  # built from memory with .chunk(): the dask chunks set the grid
        values = np.asarray(data.compute())
        return VarSource(raw_dtype=values.dtype, values=values, mem_chunks=_memory_chunks(var), **base)
    src_dims = _array_dims(zarray, name)
    index: list = []
    source_ds = None
    for ax, d in enumerate(src_dims):
        n_src = zarray.shape[ax]
        if d in var.dims:
            n = var.sizes[d]
            if d in ds.indexes:
                source_ds = source_ds if source_ds is not None else _open_source(zarray)
                index.append(_positions(ds.indexes[d], source_ds, d, name))
            elif n == n_src:
                index.append(np.arange(n, dtype=np.int64))
            else:
                raise SourceError(
                    f"variable {name!r}: dim {d!r} was subset ({n} of {n_src}) but has no coordinate, so a "
                    "dask-backed selection cannot be mapped back to the store; open with chunks=None or "
                    "xinsitu.open_zarr"
                )
        else:  # dropped by a scalar selection: find the label of the scalar coordinate
            if d not in ds.coords or ds.coords[d].ndim != 0:
                raise SourceError(f"variable {name!r}: dim {d!r} was dropped and has no scalar coordinate")
            source_ds = source_ds if source_ds is not None else _open_source(zarray)
            pos = _positions(ds.coords[d].to_index() if ds.coords[d].ndim else [ds.coords[d].values[()]],
                             source_ds, d, name)
            index.append(int(pos[0]))
    return _stored(base, var, zarray, src_dims, index)


def _open_source(zarray: Any) -> xr.Dataset:
    """Re-open the group holding ``zarray`` lazily (no dask) to read its index coordinates."""
    path = zarray.path.rsplit("/", 1)[0] if "/" in zarray.path else ""
    return xr.open_zarr(zarray.store, group=path or None, chunks=None, consolidated=None)


def _positions(labels: Any, source: xr.Dataset, dim: str, name: str) -> np.ndarray:
    if dim not in source.indexes:
        raise SourceError(f"variable {name!r}: the store has no coordinate for dim {dim!r}")
    pos = source.indexes[dim].get_indexer(labels)
    if (pos < 0).any():
        raise SourceError(f"variable {name!r}: some {dim!r} labels are not in the store's coordinate")
    return pos.astype(np.int64)
