"""xarray's private API, in one place: what xinsitu needs of xarray that xarray does not export.

xinsitu reads the chunks a Dataset's variables are stored in, so it looks through xarray's lazy
wrappers down to the zarr array; xarray has no public way to do that. Every private name xinsitu
uses is here, looked up once, at import, by feature (a slot, a class, a function; not by version
number); the rest of xinsitu calls the functions below and never names an xarray private itself.
``tests/compat/test_compat_xarray.py`` exercises each one, so a new xarray that moves one fails that test,
by name, rather than a read somewhere else.

Private names used:

* ``Variable._data``: the array a Variable wraps, without loading it (``variable_data``);
* ``Dataset._close``: the function that closes its files; for a Zarr open, a method of xarray's
  ``ZarrStore``, whose ``zarr_group`` is the group opened (``closer``, ``zarr_group_of``);
* ``ZarrArrayWrapper._array``: the ``zarr.Array`` behind a stored variable (``zarr_array_of``);
* ``xarray.core.indexing``: the lazy wrappers' classes (``LAZY``, ``LAZY_VECTORIZED``, ``IN_MEMORY``,
  ``CACHING``), and a lazy selection's key (``lazy_key``);
* ``xarray.coding.common._ElementwiseFunctionArray``: a lazily applied CF decoding (``ELEMENTWISE``), its
  function and keywords (``lazy_decodings``);
* ``xarray.coding.times.decode_cf_datetime``: xarray's CF time decoding;
* ``xarray.backends.zarr.FillValueCoder``: xarray's encoding of a zarr v3 ``_FillValue`` attribute.
"""

from __future__ import annotations

import importlib
from typing import Any

import xarray as xr


class XarrayPrivateError(RuntimeError):
    """This xarray lacks a private name xinsitu needs (see ``xinsitu.index.xr_adapter``)."""


def _has_slot(cls: type, name: str) -> bool:
    return any(name in getattr(k, "__slots__", ()) for k in cls.__mro__)


def _missing(what: str) -> XarrayPrivateError:
    return XarrayPrivateError(f"xarray {xr.__version__} has no {what}, which xinsitu reads (xinsitu.index.xr_adapter): "
                              "install an xarray that xinsitu supports (see pyproject.toml)")


HAS_VARIABLE_DATA = _has_slot(xr.Variable, "_data")
HAS_CLOSE = _has_slot(xr.Dataset, "_close")

def _lookup(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):  # pragma: no cover - another xarray
        return None


def _classes(*names: str) -> tuple[Any, ...]:
    found = tuple(_lookup("xarray.core.indexing", n) for n in names)
    return found if all(c is not None for c in found) else ()


LAZY = _classes("LazilyIndexedArray")
LAZY_VECTORIZED = _classes("LazilyVectorizedIndexedArray")
IN_MEMORY = _classes("NumpyIndexingAdapter", "PandasIndexingAdapter")
#: wrappers that only cache or copy what they wrap (``.array``)
CACHING = _classes("MemoryCachedArray", "CopyOnWriteArray")
_Elementwise: Any = _lookup("xarray.coding.common", "_ElementwiseFunctionArray")
#: a CF decoding applied lazily (``.func`` of ``.array``)
ELEMENTWISE: tuple[Any, ...] = (_Elementwise,) if _Elementwise is not None else ()
_ZarrArrayWrapper: Any = _lookup("xarray.backends.zarr", "ZarrArrayWrapper")
HAS_ZARR_ARRAY = _ZarrArrayWrapper is not None and _has_slot(_ZarrArrayWrapper, "_array")
decode_cf_datetime: Any = _lookup("xarray.coding.times", "decode_cf_datetime")
FillValueCoder: Any = _lookup("xarray.backends.zarr", "FillValueCoder")


def variable_data(var: xr.Variable) -> Any:
    """The array ``var`` wraps, as it is (a lazy wrapper stays lazy; ``var.data`` would load it)."""
    if not HAS_VARIABLE_DATA:  # pragma: no cover - another xarray
        raise _missing("Variable._data")
    return var._data


def closer(ds: xr.Dataset) -> Any:
    """The function that closes ``ds``'s files (what ``ds.set_close`` set), or None."""
    return ds._close if HAS_CLOSE else None


def zarr_group_of(ds: xr.Dataset) -> Any:
    """The ``zarr.Group`` ``xr.open_zarr`` opened ``ds`` from, or None (another kind of open)."""
    return getattr(getattr(closer(ds), "__self__", None), "zarr_group", None)


def is_zarr_wrapper(node: Any) -> bool:
    """Whether ``node`` is xarray's wrapper of a ``zarr.Array`` (the end of a stored variable's lazy chain)."""
    return _ZarrArrayWrapper is not None and isinstance(node, _ZarrArrayWrapper)


def lazy_decodings(data: Any) -> list[tuple[str, dict[str, Any]]] | None:
    """The CF decodings xarray's lazy chain ``data`` applies to a stored array's values (``ELEMENTWISE``),
    outermost first, as (its function's name, its keywords): ``_apply_mask``, ``_scale_offset_decoding``,
    ``asarray`` (``_Unsigned``), ``decode_cf_datetime``...; None where the chain does not end in a stored
    array or this xarray has no such wrapper (nothing known)."""
    if not ELEMENTWISE:  # pragma: no cover - another xarray
        return None
    out: list[tuple[str, dict[str, Any]]] = []
    node = data
    for _ in range(64):
        if is_zarr_wrapper(node):
            return out
        if isinstance(node, ELEMENTWISE):
            func = node.func
            base = getattr(func, "func", func)
            out.append((str(getattr(base, "__name__", "")), dict(getattr(func, "keywords", None) or {})))
        node = getattr(node, "array", None)
        if node is None:
            return None
    return None


def zarr_array_of(node: Any) -> Any:
    """The ``zarr.Array`` xarray's ``ZarrArrayWrapper`` ``node`` wraps."""
    if not HAS_ZARR_ARRAY:  # pragma: no cover - another xarray
        raise _missing("ZarrArrayWrapper._array")
    return node._array


def lazy_key(node: Any) -> tuple:
    """The key (one item per axis) of a lazy orthogonal selection (``LAZY``)."""
    return node.key.tuple
