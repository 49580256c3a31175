"""NetCDF4/HDF5, NetCDF-3 and GRIB files read in place, through virtual references (VirtualiZarr manifests).

VirtualiZarr's HDF parser turns one file into a ``ManifestStore``: zarr metadata plus,
for every chunk, where its bytes lie in the original file (path, offset, length). NetCDF-3
files get theirs from their header (:mod:`xinsitu.formats.netcdf3`), GRIB files one chunk per message
(:mod:`xinsitu.formats.grib`, :func:`open_grib`).
:func:`netcdf_store` joins the stores of many files along one dimension into one store,
after checking that they can be joined (same chunks, codecs and CF packing; a message
names the file and the variable where they cannot), so that ``xinsitu.open_zarr(store)``
and ``xr.open_zarr(store)`` see a year of daily files as one Dataset.

Coordinates along the joined dimension (``time``, which xarray-written files each encode
with their own units) are read once, decoded, joined, encoded again and kept inline (in
memory, a few bytes per step), and so are a time coordinate's bounds (``time_bnds``, decoded
with its units) and datetime/timedelta variables along it where the files encode them
differently; the data variables stay in the files. Files of one step each whose ``time`` is a
scalar coordinate (written from ``ds.isel(time=i)``) are stacked along it, as ``xr.concat`` does. A scalar
coordinate that differs from file to file (``valid_time``, ``step``, ``forecast_reference_time``, even where only
the data variables' ``coordinates`` attribute names it) is read from every file, decoded (each file's own units)
and joined along ``time`` inline, as ``xr.open_mfdataset``'s default ``coords="different"`` joins it; one equal in
every file (``level``) stays a scalar.

:class:`xinsitu.stores.virtual_store.ManifestBackend` (I/O, so it lives there) is how xinsitu fetches the
chunks of such a store: byte ranges of the original files straight
through obstore; on object storage the ranges of one file asked
for in the same turn of the event loop go out as one ``get_ranges`` request (obstore merges
ranges that lie close together), local files are read one range at a time so that reads
and decodes overlap, and in a forked process (where obstore would hang) with plain file
I/O. A referenced file that has gone, or that is shorter than the references say, raises
an error that names it: a virtual chunk is never read as the fill value.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import xarray as xr

from xinsitu.compat.virtualizarr_api import (
    chunk_shape,
    concat_manifests,
    expand_manifest,
    hdf5_variable_manifest,
    keeps_chunks_inline,
    manifest_group,
    manifest_registry,
)
from xinsitu.formats.references import (
    PARSE_THREADS,
    InlineCoords,
    as_urls,
    check_decodable,
    in_store_order,
    registry_for,
)
from xinsitu.stores.redact import secrets_of
from xinsitu.stores.virtual_store import (  # noqa: F401 - ManifestBackend, is_manifest_store: re-exported
    ManifestBackend,
    VirtualReferenceError,
    file_error,
    is_manifest_store,
    named,
    note_opened,
    path_in_store,
)

#: Attributes that change how xarray decodes a variable: they must agree across files.
CF_ATTRS = ("scale_factor", "add_offset", "_FillValue", "missing_value", "_Unsigned", "units", "calendar",
            "valid_min", "valid_max", "valid_range", "dtype")

#: zarr warns each time it reads metadata naming a numcodecs codec (shuffle, zlib: what NetCDF4 files use).
_NUMCODECS_WARNING = "Numcodecs codecs are not in the Zarr version 3 specification"

#: the optional modules reading files in place needs, per extra that installs them
EXTRA_MODULES = {"virtual": ("virtualizarr", "h5py", "h5netcdf", "imagecodecs", "obspec_utils"),
                 "grib": ("virtualizarr", "eccodes", "gribapi", "cfgrib", "gribberish")}


@contextlib.contextmanager
def needs_extra(extra: str, what: str) -> Iterator[None]:
    """A missing module of ``extra`` raises ``ModuleNotFoundError`` (``name``: that module) saying which
    extra installs it, rather than from deep inside the call."""
    try:
        yield
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in EXTRA_MODULES[extra]:
            raise
        raise ModuleNotFoundError(f"{what} needs {top}, which is not installed: pip install 'xinsitu[{extra}]'",
                                  name=top) from None


_REWRITE_HINT = ("rewrite the files with chunks that tile each file along {dim!r} (e.g. `nccopy -c {dim}/N` "
                 "or xarray's to_netcdf(encoding={{var: {{'chunksizes': ...}}}})), or convert them to Zarr")


def _head(url: str, registry: Any) -> tuple[Any, Any, int]:
    """(read(start, end), first 4 bytes, size) of ``url``, through the registry's store; each request bounded as
    an open's metadata reads are (``XINSITU_REQUEST_TIMEOUT`` a try: a silent server took obstore's 4 minutes)."""
    import obstore

    from xinsitu.io import loop as _loop
    from xinsitu.stores.reads import bounded_request

    if _loop.forked_after("obstore"):  # (obstore would wait until the bound, then time out)
        _loop.refuse_after_fork(f"{named(url)}, opened here,")
    store, path = registry.resolve(url)
    path = path_in_store(url, store) if store is not None else path
    try:
        size = int(_loop.run(bounded_request(lambda: obstore.head_async(store, path), "its size"))["size"])

        def read(start: int, end: int) -> bytes:
            if end <= start:
                return b""
            got = _loop.run(bounded_request(lambda: obstore.get_range_async(store, path, start=start, end=end),
                                            f"bytes {start}..{end}"))
            return bytes(got)

        return read, read(0, min(4, size)), size
    except Exception as e:  # noqa: BLE001
        raise file_error(e, url, secrets_of(store)) from None


def _parse(url: str, registry: Any, group: str | None, drop: list[str], concat_dim: str = "time") -> Any:
    """One file -> its ManifestStore; failures name the file and, where one is to blame, the variable."""
    from virtualizarr.parsers import HDFParser

    from xinsitu.formats import netcdf3

    read, head, size = _head(url, registry)
    if netcdf3.is_netcdf3(head):  # classic / 64-bit offset / CDF-5: byte ranges from the header
        if group:
            raise VirtualReferenceError(f"{named(url)} is a NetCDF-3 file: it has no groups (group={group!r})")
        return netcdf3.manifest_store(url, read, size, registry, concat_dim=concat_dim, drop=drop)
    try:
        store = HDFParser(group=group, drop_variables=drop)(url, registry)
    except ModuleNotFoundError:  # a module of the extra is missing, not a fault of the file (needs_extra names it)
        raise
    except Exception as e:  # noqa: BLE001 - diagnosed and re-raised with the file (and variable) named
        raise _diagnose(url, registry, group, drop, e) from None
    return _typed_packing(store, url, registry, group)


def _typed_packing(store: Any, url: str, registry: Any, group: str | None) -> Any:
    """``store`` with its packed variables decoded as xarray decodes the file (float32 packing stays float32).

    VirtualiZarr keeps attributes as JSON numbers: a float32 ``scale_factor`` would decode to
    float64, where xarray reading the file gives float32. Such variables get their attributes'
    types back from the HDF5 file (a few small reads) and the ``xinsitu.cf`` codec. Signed values stored
    unsigned get their fill values as signed numbers (``_signed_fills``).
    """
    arrays = manifest_group(store).arrays
    new = {n: _signed_fills(a) for n, a in arrays.items()}
    packed = [n for n, a in new.items() if {"scale_factor", "add_offset"} & set(a.metadata.attributes or {})]
    if packed:
        import h5py
        from obspec_utils.readers import BlockStoreReader

        from xinsitu.formats.netcdf3 import typed_packing

        obs, path = registry.resolve(url)
        try:
            with h5py.File(BlockStoreReader(obs, path), mode="r") as f:
                g = f[group or "/"]
                for name in packed:
                    new[name] = typed_packing(new[name], dict(g[name].attrs))
        except Exception as e:  # noqa: BLE001
            raise VirtualReferenceError(f"{named(url)}: cannot read the packing attributes of {packed}: "
                                        f"{type(e).__name__}: {e}") from None
    if all(new[n] is arrays[n] for n in arrays):
        return store
    from virtualizarr.manifests import ManifestGroup, ManifestStore

    return ManifestStore(ManifestGroup(arrays=new, attributes=dict(manifest_group(store).metadata.attributes or {})),
                         registry=registry)


def _signed_fills(arr: Any) -> Any:
    """``arr`` (a ManifestArray) with the fill values of an unsigned variable marked ``_Unsigned="false"`` (signed
    values stored as unsigned, as netCDF-Java writes them) as the signed numbers they stand for: xarray decodes
    the file's typed ``np.uint8(255)`` to -1, but the JSON ``255`` overflows int8 and the file failed to open."""
    attrs = dict(arr.metadata.attributes or {})
    raw = np.dtype(arr.metadata.data_type.to_native_dtype())
    if attrs.get("_Unsigned") != "false" or raw.kind != "u":
        return arr
    signed = np.dtype(f"i{raw.itemsize}")

    def as_signed(v: Any) -> Any:
        vals = np.atleast_1d(np.asarray(v))
        if vals.dtype.kind not in "iu" or not ((vals >= 0) & (vals <= np.iinfo(raw).max)).all():
            return v
        got = vals.astype(raw).view(signed).tolist()
        return got[0] if np.ndim(v) == 0 else got

    fixed = {k: as_signed(attrs[k]) for k in ("_FillValue", "missing_value") if k in attrs}
    if all(fixed[k] == attrs[k] for k in fixed):
        return arr
    import dataclasses

    from virtualizarr.manifests import ManifestArray

    return ManifestArray(metadata=dataclasses.replace(arr.metadata, attributes={**attrs, **fixed}),
                         chunkmanifest=arr.manifest)


def _diagnose(url: str, registry: Any, group: str | None, drop: list[str], cause: BaseException) -> Exception:
    where = named(url)
    text = f"{type(cause).__name__}: {cause}"
    try:
        import h5py
        from obspec_utils.readers import BlockStoreReader

        store, path = registry.resolve(url)
        f = h5py.File(BlockStoreReader(store, path), mode="r")
    except Exception as e:  # noqa: BLE001
        if "truncated file" in str(e):  # HDF5's: "truncated file: eof = X, sblock->base_addr = 0, stored_eof = Y"
            return VirtualReferenceError(f"{where} is an HDF5/NetCDF4 file cut short (truncated: a copy or download "
                                         f"that did not finish?): {type(e).__name__}: {e}")
        try:
            head: bytes | None = _head(url, registry)[1]
        except Exception:  # noqa: BLE001 - only a detail of the message
            head = None
        if head == b"":
            return VirtualReferenceError(f"{where} is empty (0 bytes): a copy or download that did not finish?")
        if head is not None and head.startswith(b"\x89HDF"):  # HDF5's signature, too short to hold its superblock
            return VirtualReferenceError(f"{where} is an HDF5/NetCDF4 file cut short or damaged (its superblock "
                                         f"cannot be read): {type(e).__name__}: {e}")
        if "signature" in str(e) or "not an HDF5" in str(e) or "Unable to" in str(e):
            return VirtualReferenceError(
                f"{where} is neither an HDF5/NetCDF4 nor a NetCDF-3 file (GRIB files open with "
                f"xinsitu.virtual.open_grib): {text}")
        return VirtualReferenceError(f"{where} cannot be read: {text}")
    try:
        g = f[group or "/"]
        for name, obj in g.items():
            if name in drop or not isinstance(obj, h5py.Dataset):
                continue
            try:
                hdf5_variable_manifest(url, obj, str(g.name))
            except Exception as e:  # noqa: BLE001
                base = h5py.check_vlen_dtype(obj.dtype)
                if base is not None:
                    import virtualizarr

                    strings = h5py.check_string_dtype(obj.dtype) is not None
                    what = "variable-length strings" if strings else f"ragged arrays (variable-length {base})"
                    newer = strings and not keeps_chunks_inline()  # (2.8 reads strings)
                    return VirtualReferenceError(
                        f"{where}: variable {name!r} holds {what} (dtype {obj.dtype}), which virtualizarr "
                        f"{virtualizarr.__version__} cannot reference in place ({type(e).__name__}: {e}). Leave "
                        f"it out (drop_variables=[{name!r}])"
                        + (" or upgrade virtualizarr (2.8 reads such variables)" if newer else ""))
                filters = dict(getattr(obj, "_filters", {}) or {})
                return VirtualReferenceError(
                    f"{where}: variable {name!r} cannot be read in place: its HDF5 filters {filters} include one "
                    f"that has no zarr/numcodecs decoder ({type(e).__name__}: {e}). Rewrite the file without it "
                    f"(e.g. `nccopy -d 1 -s in.nc out.nc` for deflate + shuffle) or drop the variable "
                    f"(drop_variables=[{name!r}])")
    except Exception:  # noqa: BLE001 - diagnosis is best effort
        pass
    finally:
        f.close()
    return VirtualReferenceError(f"{where} cannot be referenced in place: {text}")


#: units xarray decodes to timedelta64 (``xarray.coding.times.TIME_UNITS``)
_TIMEDELTA_UNITS = {"days", "hours", "minutes", "seconds", "milliseconds", "microseconds", "nanoseconds"}


def _decoding_attrs(arrays: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each array's attributes as xarray decodes it: a bounds variable (``time_bnds``) without units or calendar
    of its own takes those of the time coordinate naming it (as ``xarray.conventions`` does)."""
    out = {n: dict(a.metadata.attributes or {}) for n, a in arrays.items()}
    for a in arrays.values():
        attrs = dict(a.metadata.attributes or {})
        units, bounds = attrs.get("units"), attrs.get("bounds")
        if isinstance(units, str) and "since" in units and isinstance(bounds, str) and bounds in out:
            out[bounds].setdefault("units", units)
            if "calendar" in attrs:
                out[bounds].setdefault("calendar", attrs["calendar"])
    return out


def _time_like(attrs: dict[str, Any]) -> bool:
    """Whether xarray decodes a variable with these attributes to datetimes or timedeltas (by their units)."""
    units = attrs.get("units")
    return isinstance(units, str) and ("since" in units or units.strip().lower() in _TIMEDELTA_UNITS)


def _signature(arr: Any, attrs: dict[str, Any] | None = None) -> dict[str, Any]:
    md = arr.metadata
    attrs = dict(md.attributes or {}) if attrs is None else attrs
    return {
        "dims": tuple(md.dimension_names or ()),
        "dtype": str(np.dtype(arr.dtype)),
        "chunks": chunk_shape(arr),
        "codecs": [c.to_dict() for c in md.codecs],
        "fill_value": repr(md.fill_value),
        **{f"attribute {k}": repr(attrs.get(k)) for k in CF_ATTRS if k in attrs},
    }


def _check_same(name: str, first: tuple[str, Any, dict[str, Any]], other: tuple[str, Any, dict[str, Any]],
                concat_dim: str) -> None:
    """``other`` (url, ManifestArray, the attributes xarray decodes it with) can share one array with ``first``."""
    (u0, a0, at0), (u1, a1, at1) = first, other
    s0, s1 = _signature(a0, at0), _signature(a1, at1)
    keys = sorted(set(s0) | set(s1), key=lambda k: list(s0).index(k) if k in s0 else 99)
    for k in keys:
        if s0.get(k) != s1.get(k):
            hint = ""
            if k == "chunks":
                hint = "; chunks must be the same in every file: " + _REWRITE_HINT.format(dim=concat_dim)
            elif k.startswith("attribute") or k in ("dtype", "fill_value"):
                hint = ("; xarray would decode this variable differently in the two files, so they cannot share "
                        "one virtual array")
            elif k == "codecs":
                hint = "; one zarr array has one codec chain: rewrite the files with the same compression"
            raise VirtualReferenceError(
                f"variable {name!r} in {named(u1)} differs from {named(u0)} in its {k}: "
                f"{s1.get(k, '(absent)')} here, {s0.get(k, '(absent)')} there{hint}")
    ax = s0["dims"].index(concat_dim) if concat_dim in s0["dims"] else None
    sh0, sh1 = list(a0.shape), list(a1.shape)
    if ax is not None:
        sh0.pop(ax)
        sh1.pop(ax)
    if sh0 != sh1:
        raise VirtualReferenceError(f"variable {name!r} has shape {tuple(a1.shape)} in {named(u1)} but "
                                    f"{tuple(a0.shape)} in {named(u0)} (other than along {concat_dim!r})")


def _concat(name: str, parts: list[tuple[str, Any]], axis: int, concat_dim: str) -> Any:
    """Join the ManifestArrays of one variable along ``axis`` (only the last may end in a partial chunk)."""
    from virtualizarr.manifests import ManifestArray

    chunk = chunk_shape(parts[0][1])[axis]
    for url, arr in parts[:-1]:
        if arr.shape[axis] % chunk:
            raise VirtualReferenceError(
                f"variable {name!r} in {named(url)} holds {arr.shape[axis]} steps of {concat_dim!r}, not a "
                f"multiple of its chunk length {chunk}: a chunk would straddle two files, which one virtual "
                "array cannot reference (only the last file may end with a partial chunk); "
                + _REWRITE_HINT.format(dim=concat_dim))
    ms = [arr.manifest for _, arr in parts]
    manifest = concat_manifests(ms, axis)
    shape = list(parts[0][1].shape)
    shape[axis] = sum(arr.shape[axis] for _, arr in parts)
    return ManifestArray(metadata=parts[0][1].metadata.update_shape(tuple(shape)), chunkmanifest=manifest)


def netcdf_store(paths: str | os.PathLike | Iterable[str | os.PathLike], *, concat_dim: str = "time",
                 group: str | None = None, drop_variables: Iterable[str] | None = None, registry: Any = None,
                 **store_options: Any) -> Any:
    """One virtual Zarr store over NetCDF4/HDF5 or NetCDF-3 files joined along ``concat_dim``; nothing is copied.

    NetCDF-3 files (classic, 64-bit offset, CDF-5) are referenced from their header: one chunk per
    record of each record variable (and per step of fixed-size variables along ``concat_dim``),
    CF-decoded by xarray's own decoder in the ``xinsitu.cf_bytes`` codec.

    Parameters
    ----------
    paths : a glob (``"/data/era5/*.nc"``), a path or URL, or a list of them. Files are put in the
        order of their ``concat_dim`` coordinate (as ``xr.open_mfdataset(combine="by_coords")``).
    concat_dim : the dimension the files follow each other along. Where a file holds it as a scalar
        coordinate (one step, written from ``ds.isel(time=i)``), every data variable of that file gets it
        as a first dimension of length 1, as ``xr.open_mfdataset(combine="nested", concat_dim=...)`` does.
    group : HDF5 group to read (default: the root).
    drop_variables : variables to leave out (e.g. one compressed with a filter zarr cannot decode).
    registry : an ``obspec_utils.registry.ObjectStoreRegistry`` resolving the URLs; by default one
        is built (``file://`` for local paths, ``xinsitu.stores.opening.make_store`` with ``store_options``
        for ``s3://``, ``gs://``, ``https://``...).

    Returns
    -------
    virtualizarr.manifests.ManifestStore
        Data variables along ``concat_dim`` refer to byte ranges of the files; variables without it
        come from the first file; coordinates along it are held inline, and so are the bounds of a time
        coordinate and datetime/timedelta variables along it where the files encode them differently
        (each file's own units), decoded file by file. A scalar coordinate (``valid_time``, ``step``...)
        that differs between files gets ``concat_dim`` (each file's value for each of its steps, decoded
        file by file and held inline), as ``xr.open_mfdataset``'s default ``coords="different"`` gives it;
        one equal in every file stays a scalar. Pass it to ``xinsitu.open_zarr`` or ``xr.open_zarr``.

    Raises
    ------
    ModuleNotFoundError
        Where a module of the ``virtual`` extra is not installed, naming it and the extra.
    ValueError
        Where several files are given and none has ``concat_dim`` (as a dimension or a scalar coordinate).
    VirtualReferenceError
        Where the files cannot be one virtual store, naming the file and the variable: chunks,
        codecs or CF packing that differ between files, a file whose length along ``concat_dim`` is
        not a whole number of chunks (other than the last), a filter without a decoder, a file that
        is neither HDF5 nor NetCDF-3, a NetCDF-3 character variable, a variable-length string variable
        the installed VirtualiZarr cannot reference, or a NetCDF-3 file shorter than its header says.
    """
    with warnings.catch_warnings(), needs_extra("virtual", "reading NetCDF files in place"):
        warnings.filterwarnings("ignore", message=_NUMCODECS_WARNING)
        return note_opened(_netcdf_store(paths, concat_dim, group, drop_variables, registry, store_options))


def _netcdf_store(paths: Any, concat_dim: str, group: str | None, drop_variables: Iterable[str] | None,
                  registry: Any, store_options: dict[str, Any]) -> Any:
    from virtualizarr.manifests import ManifestGroup, ManifestStore

    urls = as_urls(paths)
    reg = registry_for(urls, registry, store_options)
    drop = list(drop_variables or ())
    def one(u: str) -> tuple[Any, dict[str, xr.Variable]]:
        s = _parse(u, reg, group, drop, concat_dim)
        return s, _file_coords(u, s, concat_dim)

    # files parsed a few at a time: on object storage each costs several round trips
    with ThreadPoolExecutor(min(PARSE_THREADS, len(urls))) as pool:
        parsed = list(pool.map(one, urls))
    stores, coords = [p[0] for p in parsed], [p[1] for p in parsed]
    if len(urls) > 1:
        _check_concat_dim(urls, stores, concat_dim)
        for i in range(len(urls)):
            if concat_dim in coords[i] and coords[i][concat_dim].ndim == 0 and not _has_dim(stores[i], concat_dim):
                stores[i], coords[i] = _one_step(stores[i], coords[i], concat_dim)
    order = _order(urls, coords, concat_dim)
    urls, stores, coords = [urls[i] for i in order], [stores[i] for i in order], [coords[i] for i in order]

    groups = [manifest_group(s) for s in stores]
    attrs = [_decoding_attrs(g.arrays) for g in groups]
    first = groups[0]
    inline_names = [n for n, v in coords[0].items() if concat_dim in v.dims]
    retimed = _retimed(groups, attrs, concat_dim, inline_names)
    if retimed:  # decoded file by file (each in its own units), then joined as the coordinates are
        with ThreadPoolExecutor(min(PARSE_THREADS, len(urls))) as pool:
            found = list(pool.map(lambda i: _file_variables(urls[i], stores[i], retimed), range(len(urls))))
        for c, v in zip(coords, found, strict=True):
            c.update(v)
        inline_names += retimed
    inline = InlineCoords()
    arrays: dict[str, Any] = {}
    for name, arr in first.arrays.items():
        dims = tuple(arr.metadata.dimension_names or ())
        if name in inline_names:
            arrays[name] = inline.array(name, _joined(name, urls, coords, concat_dim),
                                        chunk_shape(arr) if name in retimed else None)
            continue
        if concat_dim not in dims:
            differs = next((u for u, c in zip(urls[1:], coords[1:], strict=True)
                            if name in c and not c[name].equals(coords[0][name])), None)
            if differs is not None and name in coords[0] and coords[0][name].ndim == 0:
                # a scalar coordinate that differs from file to file (valid_time, step...): along concat_dim,
                # each file's value for each of its steps, as xr.open_mfdataset's default coords="different"
                steps = [{name: c[name].set_dims({concat_dim: _length(g, c, concat_dim)})} if name in c else {}
                         for g, c in zip(groups, coords, strict=True)]
                arrays[name] = inline.array(name, _joined(name, urls, steps, concat_dim))
                continue
            if differs is not None:  # a shared coordinate must be the same
                raise VirtualReferenceError(f"coordinate {name!r} in {named(differs)} differs from the one in "
                                            f"{named(urls[0])}: the files do not share one grid")
            arrays[name] = arr
            continue
        parts = []
        for u, g, at in zip(urls, groups, attrs, strict=True):
            other = g.arrays.get(name)
            if other is None:
                raise VirtualReferenceError(f"variable {name!r} is in {named(urls[0])} but not in "
                                            f"{named(u)}; drop it with drop_variables=[{name!r}]")
            _check_same(name, (urls[0], arr, attrs[0][name]), (u, other, at[name]), concat_dim)
            parts.append((u, other))
        arrays[name] = _concat(name, parts, dims.index(concat_dim), concat_dim)
    for u, g in zip(urls[1:], groups[1:], strict=True):
        extra = sorted(set(g.arrays) - set(first.arrays))
        if extra:
            raise VirtualReferenceError(f"variable(s) {extra} are in {named(u)} but not in "
                                        f"{named(urls[0])}; drop them with drop_variables={extra}")
    inline.register(reg)
    out = ManifestStore(ManifestGroup(arrays=arrays, attributes=dict(first.metadata.attributes or {})),
                        registry=reg)
    check_decodable(out, urls[0])
    return out


def _has_dim(store: Any, dim: str) -> bool:
    return any(dim in (a.metadata.dimension_names or ()) for a in manifest_group(store).arrays.values())


def _length(group: Any, coords: dict[str, xr.Variable], concat_dim: str) -> int:
    """How many steps along ``concat_dim`` one file holds (its coordinate's length, or its variables')."""
    if concat_dim in coords and coords[concat_dim].ndim == 1:
        return int(coords[concat_dim].size)
    for a in group.arrays.values():
        dims = list(a.metadata.dimension_names or ())
        if concat_dim in dims:
            return int(a.shape[dims.index(concat_dim)])
    return 1


def _check_concat_dim(urls: list[str], stores: list[Any], concat_dim: str) -> None:
    """Several files must have ``concat_dim``, as a dimension or a (scalar) variable, to be joined along it."""
    if any(_has_dim(s, concat_dim) or concat_dim in manifest_group(s).arrays for s in stores):
        return
    dims = sorted({d for s in stores for a in manifest_group(s).arrays.values()
                   for d in (a.metadata.dimension_names or ())})
    raise ValueError(f"concat_dim={concat_dim!r}: none of the {len(urls)} files has a dimension or a coordinate "
                     f"{concat_dim!r} to join them along (their dimensions: {dims}); pass the one they follow "
                     "each other along")


def _one_step(store: Any, coords: dict[str, xr.Variable], concat_dim: str) -> tuple[Any, dict[str, xr.Variable]]:
    """A file of one step whose ``concat_dim`` is a scalar coordinate (written from ``ds.isel(time=i)``) as a
    file of one step along it, as ``xr.concat`` makes it: the coordinate 1-D, and every data variable with
    a leading ``concat_dim`` of length 1 (chunks and byte ranges unchanged)."""
    from virtualizarr.manifests import ManifestArray, ManifestGroup, ManifestStore
    from virtualizarr.manifests.utils import copy_and_replace_metadata

    group = manifest_group(store)
    coord_names = set(coords) | set(str((group.metadata.attributes or {}).get("coordinates", "")).split())
    for a in group.arrays.values():
        coord_names |= set(a.metadata.dimension_names or ())
        coord_names |= set(str((a.metadata.attributes or {}).get("coordinates", "")).split())
    arrays = dict(group.arrays)
    for name, a in group.arrays.items():
        if name in coord_names:
            continue
        md = copy_and_replace_metadata(a.metadata, new_shape=[1, *a.shape], new_chunks=[1, *chunk_shape(a)],
                                       new_dimension_names=[concat_dim, *(a.metadata.dimension_names or ())])
        arrays[name] = ManifestArray(metadata=md, chunkmanifest=expand_manifest(a.manifest, 0))
    out = dict(coords)
    out[concat_dim] = coords[concat_dim].set_dims({concat_dim: 1})
    return ManifestStore(ManifestGroup(arrays=arrays, attributes=dict(group.metadata.attributes or {})),
                         registry=manifest_registry(store)), out


def _retimed(groups: list[Any], attrs: list[dict[str, dict[str, Any]]], concat_dim: str,
             skip: list[str]) -> list[str]:
    """The variables along ``concat_dim`` that decode to datetimes or timedeltas and are encoded differently in
    some file (xarray writes each file's times in units of its own first step, and a time coordinate's bounds
    in its units): decoded file by file and joined inline as the time coordinate is, for the values
    ``xr.open_mfdataset`` gives (their bytes joined would all be decoded with the first file's units)."""
    out = []
    for name, arr in groups[0].arrays.items():
        if name in skip or concat_dim not in (arr.metadata.dimension_names or ()):
            continue
        found = [(g.arrays[name], a[name]) for g, a in zip(groups, attrs, strict=True) if name in g.arrays]
        if not any(_time_like(at) for _, at in found):
            continue
        sig = _signature(arr, attrs[0][name])
        if any(_signature(other, at) != sig for other, at in found[1:]):
            out.append(name)
    return out


def _joined(name: str, urls: list[str], coords: list[dict[str, xr.Variable]], concat_dim: str) -> xr.Variable:
    """The decoded variable ``name`` of every file joined along ``concat_dim``, with the first file's encoding."""
    missing = next((u for u, c in zip(urls, coords, strict=True) if name not in c), None)
    if missing is not None:
        raise VirtualReferenceError(f"variable {name!r} is in {named(urls[0])} but not in {named(missing)}; "
                                    f"drop it with drop_variables=[{name!r}]")
    try:
        var = xr.Variable.concat([c[name].to_base_variable() for c in coords], dim=concat_dim)
    except ValueError as e:
        raise VirtualReferenceError(f"variable {name!r} cannot be joined along {concat_dim!r} across "
                                    f"{named(urls[0])} and the other files: {e}") from None
    var.encoding = dict(coords[0][name].encoding)
    return var


def _file_variables(url: str, store: Any, names: list[str]) -> dict[str, xr.Variable]:
    """Variables ``names`` of one file decoded as xarray decodes them (a bounds variable with the units of the
    coordinate naming it), read whole."""
    arrays = manifest_group(store).arrays
    keep = set(names) | {n for n, a in arrays.items() if (a.metadata.attributes or {}).get("bounds") in names}
    return _read_decoded(url, store, keep, lambda ds: [n for n in names if n in ds.variables], str(names))


def _read_decoded(url: str, store: Any, keep: set[str], pick: Any, what: str) -> dict[str, xr.Variable]:
    """The variables ``pick(ds)`` of one file, ``ds`` opened with only ``keep`` (as xarray decodes them: a
    coordinate's bounds with its units), read whole; a failure names ``what`` and the file."""
    drop = sorted(set(manifest_group(store).arrays) - keep)
    try:
        ds = xr.open_zarr(store, chunks=None, consolidated=False, drop_variables=drop)
        return {n: ds[n].variable.load() for n in pick(ds)}
    except Exception as e:  # noqa: BLE001
        raise VirtualReferenceError(f"cannot read {what} of {named(url)}: {type(e).__name__}: {e}") from None


def _file_coords(url: str, store: Any, concat_dim: str) -> dict[str, xr.Variable]:
    """The decoded coordinate variables of one file (small reads): its dimension coordinates, and the scalar
    coordinates (``concat_dim``'s, ``valid_time``, ``step``...) even where only the data variables (not read
    here) name them in their ``coordinates`` attribute, so that a scalar that differs between files is seen."""
    group = manifest_group(store)
    arrays = group.arrays
    dims = {d for a in arrays.values() for d in (a.metadata.dimension_names or ())}
    keep = {n for n in arrays if n in dims}
    # CF (as xarray decodes it): variables named by a variable's or the file's "coordinates" attribute
    named_coords = set(str((group.metadata.attributes or {}).get("coordinates", "")).split())
    for a in arrays.values():
        named_coords |= set(str((a.metadata.attributes or {}).get("coordinates", "")).split())
    keep |= named_coords
    keep |= {str(arrays[n].metadata.attributes.get("bounds")) for n in list(keep)  # and their bounds
             if n in arrays and (arrays[n].metadata.attributes or {}).get("bounds")}
    return _read_decoded(url, store, keep, lambda ds: [n for n in ds.variables if n in keep and (
        n in ds.coords or n == concat_dim or (n in named_coords and ds[n].ndim == 0))], "the coordinates")


def _order(urls: list[str], coords: list[dict[str, xr.Variable]], concat_dim: str) -> list[int]:
    """Files in the order of their ``concat_dim`` labels; overlapping files raise."""
    if not all(concat_dim in c and c[concat_dim].ndim == 1 and c[concat_dim].size for c in coords):
        return list(range(len(urls)))
    order = sorted(range(len(urls)), key=lambda i: coords[i][concat_dim].values[0])
    for a, b in zip(order, order[1:], strict=False):
        if not coords[a][concat_dim].values[-1] < coords[b][concat_dim].values[0]:
            raise VirtualReferenceError(f"{named(urls[a])} and {named(urls[b])} overlap along "
                                        f"{concat_dim!r}: files must follow each other")
    return order


def open_netcdf(paths: str | os.PathLike | Iterable[str | os.PathLike], *, concat_dim: str = "time",
                group: str | None = None, drop_variables: Iterable[str] | None = None, registry: Any = None,
                decode_times: bool = True, **store_options: Any) -> xr.Dataset:
    """``xinsitu.open_zarr(netcdf_store(paths, ...))``: NetCDF4 or NetCDF-3 files as one lazy Dataset, read in place.

    Equals ``xr.open_mfdataset(paths, data_vars="minimal", coords="minimal", compat="override")``
    (values, CF decoding, coordinates and attributes of the first file, the data variables in the
    first file's order), and ``xr.open_dataset(path)`` for one file; for files of one scalar step each,
    ``xr.open_mfdataset(paths, combine="nested", concat_dim="time")``. A scalar coordinate that differs
    between files (``valid_time``, ``forecast_reference_time``) gets ``time``, as with ``open_mfdataset``'s
    default ``coords="different"``. Without dask and without copying the data. See :func:`netcdf_store` for
    the arguments.
    """
    from xinsitu.stores.opening import open_zarr

    store = netcdf_store(paths, concat_dim=concat_dim, group=group, drop_variables=drop_variables,
                         registry=registry, **store_options)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NUMCODECS_WARNING)
        ds = open_zarr(store, consolidated=False, decode_times=decode_times)
    return in_store_order(ds, store)  # the file's variable order, as xr.open_dataset gives it


def grib_store(paths: str | os.PathLike | Iterable[str | os.PathLike], **kwargs: Any) -> Any:
    """One virtual Zarr store over GRIB files, one message per chunk: see :func:`xinsitu.formats.grib.grib_store`."""
    with needs_extra("grib", "reading GRIB files in place"):
        from xinsitu.formats.grib import grib_store as _grib_store

        return _grib_store(paths, **kwargs)


def open_grib(paths: str | os.PathLike | Iterable[str | os.PathLike], **kwargs: Any) -> xr.Dataset:
    """GRIB files (editions 1 and 2) as one lazy Dataset read in place: see :func:`xinsitu.formats.grib.open_grib`.

    Equals ``xr.open_dataset(path, engine="cfgrib")`` (names, coordinates, attributes, values).
    """
    with needs_extra("grib", "reading GRIB files in place"):
        from xinsitu.formats.grib import open_grib as _open_grib

        return _open_grib(paths, **kwargs)
