"""Map each data variable of an ``xr.Dataset`` back to where its values live.

A variable is either *stored* (a zarr array, plus, per dimension of that array, the
positions the Dataset's selection took) or *in memory* (a numpy array plus a chunk
grid), or *read through dask* (a dask array over files that are not Zarr, e.g.
``xr.open_dataset(nc, chunks=...)`` or ``xr.open_mfdataset``: its dask chunks set the
grid, and a read computes only the dask chunks it touches, ``DaskBlocks``). Nothing
here reads data: a dask-backed selection of a Zarr array is mapped back to its stored
positions by running its graph over positions, not values (``xinsitu.index.dask_trace``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from xinsitu.index.dask_trace import Positions, Untraceable, trace
from xinsitu.index.xr_adapter import (
    IN_MEMORY,
    LAZY,
    LAZY_VECTORIZED,
    is_zarr_wrapper,
    lazy_decodings,
    lazy_key,
    variable_data,
    zarr_array_of,
)

#: CF keys that xarray moves from attrs to ``encoding`` when it decodes a variable (kept in ``VarSource.cf``)
CF_KEYS = ("_FillValue", "missing_value", "scale_factor", "add_offset", "_Unsigned", "units", "calendar", "dtype")

#: dask layer names that only select, arrange or re-chunk the values they read (no arithmetic):
#: ``concatenate-`` is how ``xr.open_mfdataset`` puts its files together.
_SELECT_ONLY = ("original-", "open_dataset-", "getitem-", "rechunk-", "xarray-", "array-", "astype-",
                "concatenate-")

#: xarray's backend array wrappers (and where they come from), by the files they read.
_NETCDF_WRAPPERS = ("NetCDF4ArrayWrapper", "H5NetCDFArrayWrapper", "ScipyArrayWrapper", "PydapArrayWrapper")
_GRIB_MODULES = ("cfgrib", "xarray.backends.cfgrib_")
_NETCDF_EXT = (".nc", ".nc4", ".netcdf", ".cdf", ".h5", ".hdf5", ".hdf", ".he5")
_GRIB_EXT = (".grib", ".grb", ".grib1", ".grib2", ".grb2")


class DaskBlocks:
    """A dask array over files that are not Zarr, read block by block.

    ``self[sel]`` computes only the dask chunks that ``sel`` touches, with dask's synchronous
    scheduler in the calling thread (the reader calls it in a decode thread: xinsitu bounds
    the parallelism and memory, not a second thread pool). Picklable (goes to workers).
    """

    def __init__(self, data: Any, where: str = "dask"):
        self.data = data
        self.where = where  # the file(s) it reads, for messages

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.data.dtype)

    def __getitem__(self, sel: Any) -> np.ndarray:
        import dask
        from dask.callbacks import Callback

        # The caller's dask callbacks (a ProgressBar, a task counter) are passed on explicitly: left to
        # dask, each compute would take them from the global set and empty it for its duration, so
        # computes in several decode threads at once would hide them from each other (and could lose them)
        (out,) = dask.compute(self.data[sel], scheduler="synchronous", callbacks=tuple(Callback.active))
        return np.asarray(out)


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
    values: np.ndarray | DaskBlocks | None = None  # in-memory variables (or read through dask)
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

    def chunk_at(self, region: dict[str, tuple[int, int]]) -> tuple[int, ...]:
        """Chunk coordinates where ``region`` starts, in the grid of a variable not stored (messages)."""
        return tuple(int(np.searchsorted(np.cumsum(sizes), region[d][0], side="right")) if d in region else 0
                     for d, sizes in zip(self.dims, self.mem_chunks, strict=True))


class SourceError(ValueError):
    """The Dataset cannot be mapped back to a store or to memory."""


def resolve(ds: xr.Dataset, variables: list[str] | None = None) -> dict[str, VarSource]:
    """Return a ``VarSource`` for each data variable (or the ones named)."""
    names = [str(v) for v in ds.data_vars] if variables is None else list(variables)
    if not names:
        raise ValueError("the Dataset has no data variables")
    missing = [v for v in names if v not in ds.data_vars]
    if missing:
        raise ValueError(f"unknown variable(s) {missing}; the Dataset has {list(ds.data_vars)}")
    return {v: _resolve_var(ds, v) for v in names}


def _resolve_var(ds: xr.Dataset, name: str) -> VarSource:
    var = ds[name].variable
    data = variable_data(var)
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
        raise SourceError(f"variable {name!r} is backed by {type(data).__name__}, which xinsitu cannot map "
                          f"back to a zarr store; {_how_to_open(ds, data)}")
    src_dims = _array_dims(zarray, name)
    index = _compose_keys(zarray.shape, keys)
    return _stored(base, var, zarray, src_dims, index, data)


def _stored(base: dict, var: xr.Variable, zarray: Any, src_dims: tuple[str, ...], index: list,
            chain: Any) -> VarSource:
    kept = tuple(d for d, ix in zip(src_dims, index, strict=True) if not isinstance(ix, int))
    if kept != base["dims"]:
        if sorted(kept) == sorted(base["dims"]) or len(kept) != len(base["dims"]):
            raise _transposed(base["name"], base["dims"], f"the stored array's {src_dims}")
        # renamed dims (ds.rename): the stored axes, in their order, under the Dataset's names
        names = iter(base["dims"])
        src_dims = tuple(d if isinstance(ix, int) else next(names) for d, ix in zip(src_dims, index, strict=True))
    cf = {k: var.encoding[k] for k in CF_KEYS if k in var.encoding}
    done = lazy_decodings(chain)
    _check_decoding(base["name"], cf, done)
    units = var.attrs.get("units")
    masked = dict(done or []).get("_apply_mask", {}).get("dtype")  # what xarray masks it to, where known
    as_int = masked is None or np.dtype(masked).kind in "iu"  # (decode_times=False: a time delta is masked to floats)
    if "units" not in cf and ({"_FillValue", "missing_value"} & cf.keys()) and as_int and _time_like(units):
        cf["units"] = units  # kept as an attribute (not decoded to times), yet xarray masks it as integers
    return VarSource(
        raw_dtype=np.dtype(zarray.dtype),
        cf=cf,
        array=zarray,
        src_dims=src_dims,
        index=tuple(index),
        chunk_shape=_regular_chunks(zarray, base["name"]),
        **base,
    )


def _transposed(name: str, dims: tuple, stored: str) -> SourceError:
    return SourceError(
        f"variable {name!r}: its dims {tuple(dims)} do not follow {stored}; transposed views are not supported, "
        "select variables without transposing them (a model input's axes can be put in any order after the batch: "
        "transform=, or in the model)")


def _check_decoding(name: str, cf: dict[str, Any], done: list[tuple[str, dict[str, Any]]] | None) -> None:
    """Refuse a variable whose encoding does not say the CF decoding xarray applies to its stored values (``done``:
    its lazy chain's, ``lazy_decodings``): xinsitu decodes the stored chunks as the encoding says, so an encoding
    dropped (``ds.drop_encoding()``) or edited since the open would give batches other values than the Dataset's."""
    if done is None:
        return
    applied = dict(done)
    differ = []
    scale = applied.get("_scale_offset_decoding")
    got = None if scale is None else (scale.get("scale_factor"), scale.get("add_offset"))
    want = (cf.get("scale_factor"), cf.get("add_offset")) if {"scale_factor", "add_offset"} & cf.keys() else None
    if (got is None) != (want is None) or (got and want and not all(map(_same_number, got, want))):
        differ.append(f"scale_factor, add_offset {got} (its encoding: {want})")
    mask = applied.get("_apply_mask")
    fills = {_scalar(v) for k in ("_FillValue", "missing_value") if k in cf for v in np.ravel(cf[k])
             if not pd.isnull(v)}
    if mask is None and fills:
        differ.append(f"no fill value (its encoding: {sorted(fills, key=repr)})")
    elif mask is not None:
        masked = {_scalar(v) for v in mask.get("encoded_fill_values", ())}
        if not fills or ("_Unsigned" not in cf and masked != fills):  # (_Unsigned: masked as unsigned values)
            differ.append(f"fill values {sorted(masked, key=repr)} (its encoding: {sorted(fills, key=repr) or None})")
    for func in ("decode_cf_datetime", "decode_cf_timedelta"):
        times = applied.get(func)
        if times is not None and (times.get("units") != cf.get("units") or (
                times.get("calendar") is not None and "calendar" in cf and times["calendar"] != cf["calendar"])):
            differ.append(f"time units {times.get('units')!r} (its encoding: {cf.get('units')!r})")
    if differ:
        raise SourceError(
            f"variable {name!r}: xarray decodes its stored values with {'; '.join(differ)}: the encoding was dropped "
            "(drop_encoding()) or edited since the open, and xinsitu decodes the stored chunks as the encoding says, "
            "so batches would not hold the Dataset's values; give ds.insitu the Dataset as opened (drop_encoding() "
            "returns a new Dataset: keep the opened one for batches), or .load() it to train from memory")


def _same_number(a: Any, b: Any) -> bool:
    """Whether two CF numbers are one (a scalar and a one-element list alike; None only as None)."""
    if a is None or b is None:
        return a is None and b is None
    try:
        return bool(np.array_equal(np.ravel(np.asarray(a, np.float64)), np.ravel(np.asarray(b, np.float64))))
    except (TypeError, ValueError):
        return False


def _scalar(v: Any) -> Any:
    """``v`` as a plain Python scalar (a set of fill values compares by value)."""
    return np.asarray(v).item()


#: the units of a time delta (xarray's): a variable with these, or "<unit> since <date>", is time-like
_DELTA_UNITS = frozenset({"days", "hours", "minutes", "seconds", "milliseconds", "microseconds", "nanoseconds"})


def _time_like(units: Any) -> bool:
    """Whether ``units`` are time-like as xarray's fill-value masking sees them: such an integer variable
    keeps integers (its fill becomes the smallest int64), where another becomes floats with NaN."""
    return isinstance(units, str) and (" since " in units or units.strip().lower() in _DELTA_UNITS)


def _regular_chunks(zarray: Any, name: str) -> tuple[int, ...]:
    """The chunk shape of a zarr array on a regular chunk grid; ``SourceError`` naming ``name`` for a
    rectilinear grid (chunks of varying sizes along a dim, zarr >= 3.4), which xinsitu does not read."""
    try:
        return tuple(int(c) for c in zarray.chunks)
    except NotImplementedError:
        raise SourceError(f"variable {name!r} is stored on a rectilinear chunk grid (chunks of varying sizes along a "
                          "dim), which xinsitu does not read yet; rechunk it to a regular grid, or load it "
                          "(ds[[...]].load()) to use it from memory") from None


def _is_dask(data: Any) -> bool:
    return type(data).__module__.startswith("dask") and hasattr(data, "__dask_graph__")


def _in_memory(data: Any) -> bool:
    """Whether xarray's wrappers around ``data`` end in values already in memory."""
    node: Any = data
    for _ in range(64):
        if isinstance(node, (np.ndarray, *IN_MEMORY)):
            return True
        if isinstance(node, LAZY + LAZY_VECTORIZED):
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
        given = enc[ax] if enc is not None and len(enc) == var.ndim else None
        if isinstance(given, (tuple, list)) and sum(int(x) for x in given) == n:  # a rectilinear grid's sizes
            out.append(tuple(int(x) for x in given))
            continue
        c = int(given) if isinstance(given, (int, np.integer)) and given else 1
        full, rest = divmod(n, c)
        out.append((c,) * full + ((rest,) if rest else ()))
    return tuple(out)


def _unwrap_lazy(data: Any) -> tuple[Any, list]:
    """Walk xarray's lazy wrappers down to the zarr array; return it and the keys, outermost first."""
    keys: list = []
    node: Any = data
    for _ in range(64):
        if isinstance(node, LAZY_VECTORIZED):
            raise SourceError(
                "a transposed view (ds.transpose) or a vectorised (pointwise) selection of a stored variable cannot "
                "be mapped back to its chunks; select with orthogonal selections (isel/sel with slices, lists or "
                "scalars) and without transposing (put a batch's axes in order in transform= or the model)"
            )
        if isinstance(node, LAZY):
            keys.append(lazy_key(node))
            node = node.array
            continue
        if is_zarr_wrapper(node):
            return zarr_array_of(node), keys
        inner = getattr(node, "array", None)
        if inner is None:
            return None, keys
        node = inner
    return None, keys


_ARANGES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _arange(n: int) -> np.ndarray:
    """``0..n-1``, read-only and shared by every variable of that length (10^7 steps: one 80 MB
    array for the archive, not one per variable and per call)."""
    a = _ARANGES.get(n)
    if a is None:
        a = np.arange(n, dtype=np.int64)
        a.setflags(write=False)
        _ARANGES[n] = a
    return a


def _compose_keys(shape: tuple[int, ...], keys: list) -> list:
    """Apply lazy indexing keys (outermost first) to per-dim positions of the stored array."""
    index: list = [_arange(n) for n in shape]
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
    """The stored array's dim names (``()`` for a 0-d one: a CF ``crs`` or ``rotated_pole`` variable)."""
    if zarray.ndim == 0:  # (zarr v3 may name no dims for it at all)
        return ()
    dims = getattr(zarray.metadata, "dimension_names", None)
    if not dims:
        dims = zarray.attrs.get("_ARRAY_DIMENSIONS")
    if not dims:
        raise SourceError(f"stored array for {name!r} has no dimension names")
    return tuple(dims)


# --------------------------------------------------------------------------- files
def _file_kind(ds: xr.Dataset, name: str, data: Any) -> str | None:
    """``"netcdf"``, ``"grib"`` or ``"zarr"``: the kind of file ``data`` is read from (None: unknown).

    From xarray's backend array wrapper where one is found, else from the source file
    (``encoding["source"]``): its extension, then its first bytes.
    """
    for node in _backend_arrays(data):
        kind = type(node).__name__
        if kind == "ZarrArrayWrapper":
            return "zarr"
        if kind in _NETCDF_WRAPPERS:
            return "netcdf"
        if type(node).__module__.startswith(_GRIB_MODULES) or "Grib" in kind:
            return "grib"
    source = ds[name].encoding.get("source") or ds.encoding.get("source")
    if not isinstance(source, str):
        return None
    low = source.lower()
    if low.endswith(_GRIB_EXT):
        return "grib"
    if low.endswith(_NETCDF_EXT):
        return "netcdf"
    try:
        with open(source, "rb") as f:
            head = f.read(8)
    except OSError:
        return None
    if head.startswith(b"GRIB"):
        return "grib"
    if head.startswith((b"CDF", b"\x89HDF")):
        return "netcdf"
    return None


def _backend_arrays(data: Any) -> list[Any]:
    """xarray's wrappers under ``data`` (a lazily indexed array, or every one a dask graph holds)."""
    tops = [data]
    if _is_dask(data):
        tops = [v for layer in data.__dask_graph__().layers.values() for v in layer.values()
                if getattr(v, "array", None) is not None]
    out = []
    for top in tops:
        node = top
        for _ in range(64):
            out.append(node)
            node = getattr(node, "array", None)
            if node is None:
                break
    return out


def _how_to_open(ds: xr.Dataset, data: Any) -> str:
    """What to do instead, for a variable xinsitu cannot read as it is opened."""
    names = [str(v) for v in ds.data_vars if variable_data(ds[v].variable) is data]
    kind = _file_kind(ds, names[0], data) if names else None
    if kind == "netcdf":
        return ("it is read from NetCDF/HDF5 files: open them in place with xinsitu.virtual.open_netcdf(paths), "
                "or load the Dataset into memory")
    if kind == "grib":
        return ("it is read from GRIB files: open them in place with xinsitu.virtual.open_grib(paths), "
                "or load the Dataset into memory")
    return ("open a Zarr archive with xinsitu.open_zarr or xr.open_zarr, NetCDF/HDF5 files with "
            "xinsitu.virtual.open_netcdf, GRIB files with xinsitu.virtual.open_grib, or load it into memory")


# --------------------------------------------------------------------------- dask
def _computed_layer(data: Any) -> str | None:
    """The first layer of a dask graph that computes values (arithmetic, reductions), or None."""
    for lname in getattr(data.__dask_graph__(), "layers", {}):
        if not lname.startswith(_SELECT_ONLY):
            return lname
    return None


def _dask_zarr_sources(data: Any) -> tuple[Any, dict[Any, tuple[Any, list]]]:
    """The one zarr array a dask-backed variable was opened from, and the graph values that wrap it (by key:
    the wrapper, and its lazy selection's keys); ``(None, {})`` where it is not from Zarr, or from several
    arrays (e.g. ``xr.open_mfdataset`` over Zarr stores: then read through dask)."""
    found: dict[tuple[int, str], Any] = {}
    wrappers: dict[Any, tuple[Any, list]] = {}
    for layer in data.__dask_graph__().layers.values():
        if type(layer).__name__ == "Blockwise":  # tasks only (made on demand: 10^5 chunks take seconds)
            continue
        for k, v in layer.items():
            if type(v).__name__ == "DataNode":  # a literal value in dask's task spec
                v = v.value
            if getattr(v, "array", None) is None:
                continue
            zarray, keys = _unwrap_lazy(v)
            if zarray is not None:
                found.setdefault((id(zarray.store), zarray.path), zarray)
                wrappers[k] = (v, keys)
    if len(found) != 1:
        return None, {}
    return next(iter(found.values())), wrappers


def _dask_in_memory(data: Any) -> bool:
    """Whether every array a dask graph starts from is already in memory (``.chunk()`` of numpy)."""
    for layer in data.__dask_graph__().layers.values():
        for v in layer.values():
            if type(v).__name__ == "DataNode":  # a literal value in dask's task spec
                v = v.value
            elif type(v).__module__.startswith("dask") or isinstance(v, tuple | str | int):
                continue  # a task, an alias, a key: it refers to other values of the graph
            if not isinstance(v, np.ndarray | np.generic) and not _in_memory(v):
                return False
    return True


def _resolve_dask(ds: xr.Dataset, name: str, data: Any, base: dict) -> VarSource:
    var = ds[name].variable
    computed = _computed_layer(data)
    if computed is not None and computed.startswith("transpose-"):
        raise _transposed(name, var.dims, "those it was read in")
    if computed is not None:
        kind = _file_kind(ds, name, data)
        what = {"netcdf": ("NetCDF/HDF5", "xinsitu.virtual.open_netcdf(paths)"),
                "grib": ("GRIB", "xinsitu.virtual.open_grib(paths)")}.get(kind or "")
        fix = ("Select variables and positions only (isel/sel)"
               + (f", open the {what[0]} files in place with {what[1]}" if what else "")
               + ", or .load()/.compute() the result to train from memory")
        raise SourceError(
            f"variable {name!r} is computed lazily by dask (graph layer {computed!r}), so its values are not "
            f"the stored ones; xinsitu reads stored chunks and never computes a whole graph. {fix}"
        )
    zarray, wrappers = _dask_zarr_sources(data)
    if zarray is None:
        if _dask_in_memory(data):  # built from memory with .chunk(): computing costs no I/O
            values = np.asarray(data.compute())
            return VarSource(raw_dtype=values.dtype, values=values, mem_chunks=_memory_chunks(var), **base)
        # files that are not Zarr (NetCDF, GRIB through dask): the dask chunks set the grid, and a
        # read computes only the chunks it touches; never the whole array behind the user's back
        source = var.encoding.get("source") or ds.encoding.get("source")
        where = f"{source} through dask" if isinstance(source, str) else "dask"
        return VarSource(raw_dtype=np.dtype(data.dtype), values=DaskBlocks(data, where),
                         mem_chunks=_memory_chunks(var), **base)
    src_dims = _array_dims(zarray, name)
    decoded = {np.dtype(v.dtype) for v, _ in wrappers.values()}
    if decoded != {np.dtype(var.dtype)}:
        raise SourceError(
            f"variable {name!r} is cast by dask from {sorted(map(str, decoded))[0]} to {var.dtype} (.astype), a step "
            "xinsitu's reads of the store do not take; drop the .astype and ask the batches for the dtype instead "
            "(ds.insitu.batches(..., dtype=...)), open with chunks=None (xarray then casts in memory), or .load() "
            "the result to train from memory")
    # the stored positions behind each position of the variable, read off the graph's own selections (never
    # off the labels: a dim without a coordinate, roll, assign_coords or copy(data=...) move values, not labels)
    sources = {k: Positions.of_source(_compose_keys(zarray.shape, keys), v.dtype) for k, (v, keys) in wrappers.items()}
    try:
        traced = trace(data, sources)
    except Untraceable as e:
        raise SourceError(
            f"variable {name!r}: its dask graph does more than select stored positions ({e}), so xinsitu cannot "
            "tell with certainty which stored values it holds; open with chunks=None or xinsitu.open_zarr (lazy, "
            "no dask: selections are followed), or .load() it to train from memory") from None
    added = [d for d, (src, _) in zip(var.dims, traced.axes, strict=True) if src is None]
    if added:
        raise SourceError(
            f"variable {name!r}: dim(s) {added} are not in the stored array {src_dims} (added by expand_dims or "
            "broadcasting); add them after the batch (transform=, or in the model), or .load() the Dataset to "
            "train from memory")
    order = [int(src) for src, _ in traced.axes if src is not None]
    if order != sorted(order):
        raise _transposed(name, var.dims, f"the stored array's {src_dims}")
    _check_encoding(name, var, zarray)
    index: list = [None] * len(src_dims)
    for at, (_, pos) in zip(order, traced.axes, strict=True):
        index[at] = pos
    for src, at in traced.dropped:
        index[src] = at
    return _stored(base, var, zarray, src_dims, index, next(iter(wrappers.values()))[0])


#: CF attributes a variable's encoding takes from its stored array, which xinsitu re-applies after a raw read
_STORED_CF = ("scale_factor", "add_offset", "_Unsigned", "missing_value", "units", "calendar")


def _check_encoding(name: str, var: xr.Variable, zarray: Any) -> None:
    """Refuse a dask-backed variable whose encoding is not that of the stored array its graph reads (its data
    replaced by another variable's, ``copy(data=...)``, or its encoding edited): xinsitu re-applies the encoding
    to the raw chunks, and would decode them with the wrong scale, offset or units, silently."""
    attrs = dict(zarray.attrs)
    for k in _STORED_CF:
        if k in var.encoding and not _same(var.encoding[k], attrs.get(k)):
            why = f"its encoding's {k}={var.encoding[k]!r} is not the stored array's ({attrs.get(k)!r})"
            break
    else:
        dtype, stored = var.encoding.get("dtype"), np.dtype(zarray.dtype)
        if dtype is None or (np.dtype(dtype).kind, np.dtype(dtype).itemsize) == (stored.kind, stored.itemsize):
            return  # (in either byte order: xarray's encoding names the native one)
        if np.dtype(dtype) == np.bool_ and attrs.get("dtype") == "bool":
            return  # xarray's booleans, stored as int8 with a dtype attribute
        why = f"its encoding's dtype {np.dtype(dtype)} is not the stored array's ({np.dtype(zarray.dtype)})"
    raise SourceError(
        f"variable {name!r}: its dask graph reads the stored array {zarray.path!r}, but {why}: its data was "
        "replaced (copy(data=...)) or its encoding edited, so re-decoding the stored chunks would not give the "
        "values xarray gives; open with xinsitu.open_zarr or chunks=None and select without replacing data, or "
        ".load() it to train from memory")


def _same(a: Any, b: Any) -> bool:
    try:
        return b is not None and np.asarray(a).shape == np.asarray(b).shape and bool(np.all(np.asarray(a) == b))
    except (TypeError, ValueError):
        return False


#: xarray's warning where ``consolidated=None`` finds no consolidated metadata (xinsitu's own opens of a
#: store the user opened already do not give it again)
CONSOLIDATED_WARNING = "Failed to open Zarr store with consolidated metadata"
