"""What the builders of virtual stores share (:mod:`xinsitu.virtual` for NetCDF4/HDF5,
:mod:`xinsitu.formats.netcdf3`, :mod:`xinsitu.formats.grib`): file arguments as URLs, the store registry,
coordinates kept inline (encoded, in memory), attributes made JSON, the final check that
zarr can build every array's codecs, and the read-only zarr codec base of the decoders
that read a file's bytes in their own format (GRIB messages, NetCDF-3 big-endian data).

They sit below the three builders so that none imports another's helpers; what reading
such a store needs at run time (``ManifestBackend``, ``VirtualReferenceError``) is I/O and
lives in :mod:`xinsitu.stores.virtual_store`.
"""

from __future__ import annotations

import asyncio
import functools
import glob
import os
import uuid
import warnings
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlparse

import numpy as np
import xarray as xr

from xinsitu.compat.virtualizarr_api import manifest_group
from xinsitu.stores.virtual_store import VirtualReferenceError, named

#: ``encoding`` keys of a decoded variable that describe its CF encoding (the rest is zarr's).
_CF_ENCODING = ("units", "calendar", "dtype", "_FillValue", "missing_value", "scale_factor", "add_offset")

INLINE_SCHEME = "xinsitu-inline"

#: Files parsed at once when building a store.
PARSE_THREADS = 8


class _InlineStore:
    """A tiny read-only obspec store over bytes held in memory (joined coordinates); picklable."""

    def __init__(self, objects: dict[str, bytes]):
        self.objects = dict(objects)

    def _slice(self, path: str, start: int, end: int | None) -> bytes:
        data = self.objects.get(path)
        if data is None:
            raise FileNotFoundError(f"{INLINE_SCHEME} object {path!r} does not exist")
        return data[start:end]

    def get_range(self, path: str, *, start: int, end: int | None = None, length: int | None = None) -> bytes:
        return self._slice(path, start, end if end is not None else (start + length if length else None))

    async def get_range_async(self, path: str, *, start: int, end: int | None = None,
                              length: int | None = None) -> bytes:
        return self.get_range(path, start=start, end=end, length=length)

    async def get_ranges_async(self, path: str, *, starts: Sequence[int], ends: Sequence[int] | None = None,
                               lengths: Sequence[int] | None = None) -> list[bytes]:
        ends = list(ends) if ends is not None else [s + n for s, n in zip(starts, lengths or (), strict=True)]
        return [self._slice(path, s, e) for s, e in zip(starts, ends, strict=True)]

    def __repr__(self) -> str:
        return f"_InlineStore({sorted(self.objects)})"


def as_urls(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        s = os.fspath(paths)
        if "://" not in s and any(c in s for c in "*?["):
            found = sorted(glob.glob(os.path.expanduser(s)))
            if not found:
                raise FileNotFoundError(f"no file matches {s!r}")
            items: list[str] = found
        else:
            items = [s]
    else:
        items = [os.fspath(p) for p in paths]
    if not items:
        raise ValueError("no files given")
    urls = []
    for s in items:
        if "://" in s:
            urls.append(s)
        else:
            p = os.path.abspath(os.path.expanduser(s))
            if not os.path.isfile(p):
                raise FileNotFoundError(f"no file at {p!r}")
            urls.append("file://" + p)
    return urls


def registry_for(urls: list[str], registry: Any, store_options: dict[str, Any]) -> Any:
    from obspec_utils.registry import ObjectStoreRegistry

    if registry is not None:
        if store_options:
            raise TypeError(f"store options {sorted(store_options)} apply when no registry= is given")
        return registry
    import obstore.store

    from xinsitu.stores.opening import make_store

    reg: Any = ObjectStoreRegistry()
    done: set[str] = set()
    for u in urls:
        p = urlparse(u)
        base = f"{p.scheme}://{p.netloc}"
        if base in done:
            continue
        done.add(base)
        if p.scheme == "file":
            if store_options:
                raise TypeError(f"store options {sorted(store_options)} apply to URLs, not to local files")
            reg.register("file://", obstore.store.LocalStore())
        else:
            reg.register(base, make_store(base, **store_options))
    return reg


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v


def _encode_inline(name: str, var: xr.Variable) -> xr.Variable:
    """``var`` (decoded) encoded with its first file's CF encoding, or xarray's choice where that is not exact."""
    enc0 = {k: var.encoding[k] for k in _CF_ENCODING if k in var.encoding}
    why = "its values do not come back"
    for enc in (enc0, {}):
        v = xr.Variable(var.dims, var.values, dict(var.attrs), dict(enc))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # "cannot be serialized faithfully": try the next encoding
                out = xr.conventions.encode_cf_variable(v, name=name)
            with warnings.catch_warnings():  # (decoded as the files were: cftime dates outside datetime64[ns]
                warnings.simplefilter("ignore")  # warn that they stay cftime, and so they did there)
                back = xr.conventions.decode_cf_variable(name, out)
        except Exception as e:  # noqa: BLE001
            why = f"{type(e).__name__}: {e}"
            continue
        if back.dtype == var.dtype and np.array_equal(np.asarray(back.values), np.asarray(var.values),
                                                      equal_nan=var.dtype.kind in "fcmM"):
            return out
    raise VirtualReferenceError(f"coordinate {name!r} cannot be kept exactly in memory: encoded as its file "
                                f"encodes it, or as xarray would, {why}")


class InlineCoords:
    """Joined coordinates kept in memory: one ``_InlineStore`` under a fresh token (``INLINE_SCHEME`` URLs)."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self.store = _InlineStore({})

    def array(self, name: str, var: xr.Variable, chunks: tuple[int, ...] | None = None) -> Any:
        """The ManifestArray of coordinate ``name``, its bytes kept in the store: one chunk, or ``chunks``
        (a data variable keeps its files' chunks, so that it splits and batches as the others)."""
        arr, self.store.objects[name] = _inline_array(name, var, f"{INLINE_SCHEME}://{self.token}/{name}", chunks)
        return arr

    def register(self, reg: Any) -> None:
        """Make the store readable through the obstore registry ``reg`` (where it holds anything)."""
        if self.store.objects:
            reg.register(f"{INLINE_SCHEME}://{self.token}", self.store)


def _inline_array(name: str, var: xr.Variable, url: str,
                  chunks: tuple[int, ...] | None = None) -> tuple[Any, bytes]:
    from virtualizarr.manifests import ChunkManifest, ManifestArray
    from virtualizarr.manifests.utils import create_v3_array_metadata

    enc = _encode_inline(name, var)
    values = np.ascontiguousarray(enc.values).reshape(np.shape(enc.values))  # 0-d stays 0-d
    if values.dtype.kind not in "biuf":
        raise VirtualReferenceError(f"coordinate {name!r} of dtype {values.dtype} cannot be kept inline")
    values = values.astype(values.dtype.newbyteorder("<"), copy=False)
    attrs = {k: _jsonable(v) for k, v in enc.attrs.items()}
    if "_FillValue" in attrs:  # xarray reads a zarr v3 _FillValue attribute in its own encoding (base64 for floats)
        from xinsitu.index.xr_adapter import FillValueCoder

        attrs["_FillValue"] = FillValueCoder.encode(enc.attrs["_FillValue"], values.dtype)
    shape: tuple[int, ...] = values.shape
    chunk = tuple(max(1, min(int(c), n)) for c, n in zip(chunks, shape, strict=True)) if chunks else shape
    md = create_v3_array_metadata(shape=values.shape, data_type=values.dtype, chunk_shape=chunk,
                                  attributes=attrs, dimension_names=[str(d) for d in enc.dims])
    grid = tuple(-(-n // c) for n, c in zip(shape, chunk, strict=True))
    # each chunk whole (an edge chunk padded to the chunk shape, as zarr reads it), one after the other
    blobs = []
    for idx in np.ndindex(grid):
        part = values[tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, chunk, strict=True))]
        if part.shape != chunk:
            part = np.pad(part, [(0, c - n) for c, n in zip(chunk, part.shape, strict=True)])
        blobs.append(part.tobytes())
    nbytes = np.array([len(b) for b in blobs], dtype=np.uint64).reshape(grid)
    manifest = ChunkManifest.from_arrays(
        paths=np.full(grid, url, dtype=np.dtypes.StringDType()),
        offsets=(np.cumsum(nbytes.ravel()) - nbytes.ravel()).astype(np.uint64).reshape(grid),
        lengths=nbytes,
        validate_paths=False,
    )
    return ManifestArray(metadata=md, chunkmanifest=manifest), b"".join(blobs)


def in_store_order(ds: xr.Dataset, store: Any) -> xr.Dataset:
    """``ds`` (opened from ``store``) with its data variables in the order ``store`` lists its arrays: the
    file's order, as xarray reading the file gives it (``open_zarr`` sorts the arrays of a store without
    consolidated metadata by name). Coordinates, attributes and lazy data kept."""
    order = [n for n in manifest_group(store).arrays if n in ds.data_vars]
    if list(ds.data_vars) == order:
        return ds
    out = ds[order]
    missing = {k: ds.coords[k].variable for k in ds.coords if k not in out.coords}
    out = out.assign_coords(missing) if missing else out
    out.attrs, out.encoding = dict(ds.attrs), dict(ds.encoding)
    return out


def check_decodable(store: Any, first_url: str) -> None:
    """Every array's codecs resolve in zarr (else reading would fail later, less clearly)."""
    import zarr

    for name in manifest_group(store).arrays:
        try:
            zarr.open_array(store, path=name, mode="r")
        except Exception as e:  # noqa: BLE001
            raise VirtualReferenceError(f"variable {name!r} (from {named(first_url)}) cannot be read in "
                                        f"place: zarr cannot build its codecs ({type(e).__name__}: {e})") from None


# ----------------------------------------------------------------------------- read-only codecs
@functools.cache
def read_only_bytes_codec() -> type:
    """The base of the zarr v3 array -> bytes codecs that decode a file's bytes in their own format.

    A subclass gives ``_decode_sync(chunk_bytes, chunk_spec)`` and ``read_as`` (what the bytes
    are, for the message raised on writing). Built on first use: zarr imports only then.
    """
    from zarr.abc.codec import ArrayBytesCodec

    class ReadOnlyBytesCodec(ArrayBytesCodec):  # type: ignore[misc]  # zarr's ABC is untyped here
        #: what the stored bytes are ("GRIB messages"), named when something tries to write them
        read_as = "files"

        def _decode_sync(self, chunk_bytes: Any, chunk_spec: Any) -> Any:
            raise NotImplementedError

        async def _decode_single(self, chunk_bytes: Any, chunk_spec: Any) -> Any:
            # decoding is CPU work: in a worker thread, the event loop keeps fetching meanwhile
            return await asyncio.to_thread(self._decode_sync, chunk_bytes, chunk_spec)

        async def _encode_single(self, chunk_array: Any, chunk_spec: Any) -> Any:
            raise NotImplementedError(f"{self.read_as} are read in place, never written")

    return ReadOnlyBytesCodec


def register_codec_class(cls: type, name: str, module: str) -> type:
    """Register ``cls`` with zarr as codec ``name``, named as a class of ``module`` (pickles, reprs)."""
    from zarr.registry import register_codec

    cls.__module__ = module
    cls.__qualname__ = cls.__name__
    register_codec(name, cls)
    return cls
