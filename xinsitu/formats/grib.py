"""GRIB edition 1 and 2 files read in place: one message per chunk, through virtual references.

Each message of a GRIB file is a self-contained byte range (``GRIB ... 7777``): it becomes one
chunk of a VirtualiZarr ``ManifestArray`` -- (file, offset, length) into the original file --
decoded by the zarr v3 codec :class:`GribCodec` (registered as ``"xinsitu.grib"``). Names,
coordinates and attributes are the ones cfgrib gives (``xr.open_dataset(path, engine="cfgrib")``):
cfgrib's own index of each file says which message holds which (time, step, level...) field;
ecCodes says where each message starts and how long it is (real offsets: GRIB1 messages of
some archives, ERA5's among them, are padded, so offsets are not running sums of lengths).

The decoder: gribberish (Rust) where every message of a variable uses a packing it was measured
to decode exactly as ecCodes does (and a message of the variable decodes to the same values with
both) and its fields are small (under ``GRIBBERISH_MAX_VALUES``: on larger ones ecCodes is the
faster), else ecCodes itself. gribberish decodes GRIB1 IEEE and matrix packings to wrong values
without an error, and refuses GRIB2 IEEE, second-order and matrix packings; ecCodes decodes
them all (it is what cfgrib reads with).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import xarray as xr

from xinsitu.formats.references import (
    PARSE_THREADS,
    InlineCoords,
    _jsonable,
    as_urls,
    check_decodable,
    in_store_order,
    read_only_bytes_codec,
    register_codec_class,
    registry_for,
)
from xinsitu.stores.virtual_store import VirtualReferenceError, named, note_opened

#: Packings gribberish 0.30 decodes to exactly ecCodes' values, by edition (measured; see the module doc).
GRIBBERISH_PACKINGS = {
    1: {"grid_simple"},
    2: {"grid_simple", "grid_ccsds", "grid_png", "grid_jpeg", "grid_complex_spatial_differencing"},
}
#: The packing ``scan_messages`` records for a message that codes one value or none, whatever its packingType:
#: gribberish (0.30 and 1.9) decodes a constant field under a bitmap as the constant everywhere, a GRIB2 constant
#: field (0.30) as zeros, and spins for good, holding the GIL, on an all-missing JPEG 2000 message. ecCodes it is.
CONSTANT = "constant"
_FOR_GRIBBERISH = set().union(*GRIBBERISH_PACKINGS.values())  # (IEEE's bitsPerValue says nothing of the kind)
#: ... for gribberish before 1.0 (the newest on Python 3.11): its other packings decode some messages wrong
#: (complex spatial differencing: 1456 of 1457 values of a later message; ccsds whose bits per value change
#: between messages: a "Memory error"), where the first message, which ``_choose_decoder`` checks, is right
GRIBBERISH_0_PACKINGS = {1: {"grid_simple"}, 2: {"grid_simple"}}

#: Fields of this many values or more decode with ecCodes even where gribberish is exact: measured in
#: the batch path (gribberish 0.30.3 and 1.9, ecCodes 2.50, 2 cores), gribberish is 1.2-1.6x faster on
#: 91 x 180 fields, even at 181 x 360 (65,160 values), and ecCodes 1.7-2.3x faster at 361 x 720.
GRIBBERISH_MAX_VALUES = 65_536

CODEC_NAME = "xinsitu.grib"

_GRIB_HELP = "is it a GRIB file? (open NetCDF files with xinsitu.virtual.open_netcdf)"


class GribError(VirtualReferenceError):
    """A GRIB file that cannot be read in place (not GRIB, truncated, a layout one zarr array cannot hold)."""


# ----------------------------------------------------------------------------- the codec
def _decode_eccodes(raw: bytes, missing_value: float | None) -> tuple[np.ndarray, bool]:
    import eccodes

    h = eccodes.codes_new_from_message(bytes(raw))
    try:
        if missing_value is not None:  # as cfgrib: points the bitmap leaves out come back as this value
            eccodes.codes_set(h, "missingValue", missing_value)
        values = eccodes.codes_get_values(h)
        alt = bool(eccodes.codes_get(h, "alternativeRowScanning")) \
            if eccodes.codes_is_defined(h, "alternativeRowScanning") else False
    finally:
        eccodes.codes_release(h)
    return values, alt


def _decode_gribberish(raw: bytes, missing_value: float | None) -> tuple[np.ndarray, bool]:
    from gribberish import parse_grib_array

    try:
        return np.asarray(parse_grib_array(bytes(raw), 0)).ravel(), False
    except BaseException as e:  # a Rust panic is a BaseException: make it an ordinary decode error
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise ValueError(f"gribberish cannot decode this message: {type(e).__name__}: {e}") from None


def decode_message(raw: bytes, shape: tuple[int, ...], missing_value: float | None, decoder: str) -> np.ndarray:
    """One GRIB message -> its field as cfgrib gives it: float32, ``missing_value`` as NaN.

    As cfgrib's ``OnDiskArray``: ``missingValue`` set to ``missing_value`` (so that points the
    bitmap leaves out come back as it), values in the message's order (rows reversed on alternate
    rows where ``alternativeRowScanning`` is set), cast to float32, then NaN where equal to
    ``missing_value``. gribberish gives NaN where the bitmap leaves a point out.
    """
    try:
        values, alt = (_decode_gribberish if decoder == "gribberish" else _decode_eccodes)(raw, missing_value)
    except ValueError:
        if decoder != "gribberish":
            raise
        values, alt = _decode_eccodes(raw, missing_value)  # a message gribberish cannot decode: ecCodes can
    if values.size != int(np.prod(shape)):
        raise ValueError(f"the GRIB message holds {values.size} values, the chunk {int(np.prod(shape))}")
    if alt and len(shape) >= 2:
        values = values.copy().reshape(shape[-2:])
        values[1::2, :] = values[1::2, ::-1]
    out = np.asarray(values, dtype=np.float32).reshape(shape)
    if missing_value is not None:
        out[out == missing_value] = np.nan
    return out


def _register_codec() -> type:
    from xinsitu.compat.zarr_api import parse_named_configuration

    @dataclass(frozen=True)
    class GribCodec(read_only_bytes_codec()):  # type: ignore[misc]
        """Read-only zarr v3 codec: the bytes of one GRIB message -> its field (see :func:`decode_message`).

        ``decoder`` is ``"gribberish"`` or ``"eccodes"``; ``missing_value`` the message's
        cfgrib's missing-value indicator (values equal to it become NaN).
        """

        decoder: str = "eccodes"
        missing_value: float | None = None
        is_fixed_size = False
        read_as = "GRIB messages"

        @classmethod
        def from_dict(cls, data: dict[str, Any]) -> GribCodec:
            _, cfg = parse_named_configuration(data, CODEC_NAME, require_configuration=False)
            return cls(**(cfg or {}))  # type: ignore[arg-type]  # zarr's JSON config: checked by zarr

        def to_dict(self) -> dict[str, Any]:
            return {"name": CODEC_NAME, "configuration": {"decoder": self.decoder, "missing_value": self.missing_value}}

        def _decode_sync(self, chunk_bytes: Any, chunk_spec: Any) -> Any:
            out = decode_message(chunk_bytes.to_bytes(), tuple(chunk_spec.shape), self.missing_value, self.decoder)
            dtype = chunk_spec.dtype.to_native_dtype()
            return chunk_spec.prototype.nd_buffer.from_ndarray_like(out.astype(dtype, copy=False))

        def compute_encoded_size(self, input_byte_length: int, chunk_spec: Any) -> int:
            raise NotImplementedError

    return register_codec_class(GribCodec, CODEC_NAME, __name__)


try:  # zarr is a dependency; the class is built lazily only so that this module imports fast
    GribCodec = _register_codec()
except ImportError:  # pragma: no cover
    GribCodec = None  # type: ignore[assignment,misc]


# ----------------------------------------------------------------------------- scanning
def scan_messages(path: str) -> list[tuple[int, int, int, str]]:
    """(offset, length, edition, packingType) of every message of a local GRIB file, by ecCodes; ``CONSTANT``
    for the packing (one gribberish may decode) of a message that codes one value (``bitsPerValue`` 0) or none
    (every point missing).

    Raises ``GribError`` naming the file where it holds no GRIB message, where a message is cut
    short (truncated file) or damaged, or where bytes between messages hold another ``GRIB``
    header that ecCodes skipped: never fewer messages in silence.
    """
    import eccodes

    out: list[tuple[int, int, int, str]] = []
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        while True:
            try:
                h = eccodes.codes_grib_new_from_file(f, headers_only=True)  # values are not read: fast
            except Exception as e:  # noqa: BLE001 - ecCodes' errors (premature end, wrong length...)
                if not out:
                    raise GribError(f"{path} is not a GRIB file, or its first message is damaged (ecCodes: "
                                    f"{type(e).__name__}: {e}); {_GRIB_HELP}") from None
                at = out[-1][0] + out[-1][1]
                raise GribError(f"{path}: the GRIB message after byte {at} cannot be read ({type(e).__name__}: "
                                f"{e}); the file is truncated or damaged ({len(out)} messages read before it)") \
                    from None
            if h is None:
                break
            try:
                off, n = int(eccodes.codes_get_long(h, "offset")), int(eccodes.codes_get_long(h, "totalLength"))
                packing = str(eccodes.codes_get_string(h, "packingType"))
                if packing in _FOR_GRIBBERISH and (not eccodes.codes_get_long(h, "bitsPerValue")
                                                   or not eccodes.codes_get_long(h, "numberOfValues")):
                    packing = CONSTANT  # one value, or none: what gribberish decodes wrong (or hangs on)
                out.append((off, n, int(eccodes.codes_get_long(h, "edition")), packing))
            except Exception as e:  # noqa: BLE001 - ecCodes' errors: a header whose keys cannot be read
                where = f"after byte {out[-1][0] + out[-1][1]}" if out else "at the start"
                raise GribError(f"{path}: the GRIB message {where} is damaged: ecCodes cannot read its header "
                                f"({type(e).__name__}: {e}; {len(out)} messages read before it)") from None
            finally:
                eccodes.codes_release(h)
    if not out:
        raise GribError(f"{path} holds no GRIB message: {_GRIB_HELP}")
    if out[-1][0] + out[-1][1] > size:
        raise GribError(f"{path}: its last GRIB message ends at byte {out[-1][0] + out[-1][1]}, past the end of "
                        f"the file ({size} bytes): the file is truncated")
    _check_framing(path, out, size)
    return out


def _check_framing(path: str, msgs: list[tuple[int, int, int, str]], size: int) -> None:
    """Every message ends with ``7777`` where its length says, and the bytes between messages (GRIB1
    padding) hold no message ecCodes did not return: a message cut short is never skipped in silence."""
    ends = [0] + [o + n for o, n, _, _ in msgs]
    starts = [o for o, _, _, _ in msgs] + [size]
    with open(path, "rb") as f:
        for o, n, _, _ in msgs:
            f.seek(o + n - 4)
            if f.read(4) != b"7777":
                raise GribError(f"{path}: the GRIB message at byte {o} does not end with '7777' where its length "
                                f"({n} bytes) says: the message is damaged or cut short")
        for a, b in zip(ends, starts, strict=True):
            if b > a:
                f.seek(a)
                if b"GRIB" in f.read(b - a):
                    raise GribError(f"{path}: bytes {a}..{b} between messages hold a GRIB header that could not be "
                                    "read as a message (damaged message?)")


# ----------------------------------------------------------------------------- one file
class _Messages(NamedTuple):
    """One variable of one file: its dims, shape and attributes as cfgrib gives them, the dims of one
    message (``geo_ndim``), and where each message lies: ``paths`` (the file's URL, "" where missing)
    and ``ol`` (offsets and lengths, stacked); ``missing_value`` is what cfgrib turns into NaN."""

    dims: tuple[str, ...]
    shape: tuple[int, ...]
    attrs: dict[str, Any]
    geo_ndim: int
    paths: np.ndarray
    ol: np.ndarray
    missing_value: float | None


@dataclass
class _File:
    url: str
    attrs: dict[str, Any]
    coords: xr.Dataset  # decoded coordinates, as cfgrib's backend gives them
    data: dict[str, _Messages]
    packings: dict[str, set[tuple[int, str]]]


def _local_path(url: str) -> str:
    from urllib.parse import unquote, urlparse

    p = urlparse(url)
    if p.scheme != "file":
        raise GribError(f"{named(url)}: GRIB files are scanned with ecCodes, which reads local files only; "
                        "copy the files to a local disk (or a mounted file system) to read them in place")
    return unquote(p.path)


def _read_file(url: str, cfgrib_kwargs: dict[str, Any]) -> _File:
    import cfgrib.dataset as cd

    path = _local_path(url)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist")
    msgs = scan_messages(path)
    length = {o: n for o, n, _, _ in msgs}
    kind = {o: (e, p) for o, _, e, p in msgs}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cds = cd.open_file(path, indexpath="", **cfgrib_kwargs)
    except Exception as e:  # noqa: BLE001
        raise GribError(f"{path}: cfgrib cannot build a dataset from it ({type(e).__name__}: {e}); pass "
                        "filter_by_keys= (e.g. {'typeOfLevel': 'surface'}) to open one hypercube at a time") from None
    coords: dict[str, xr.Variable] = {}
    data: dict[str, _Messages] = {}
    packings: dict[str, set[tuple[int, str]]] = {}
    for name, var in cds.variables.items():
        if not isinstance(var.data, cd.OnDiskArray):
            coords[name] = xr.Variable(var.dimensions, var.data, dict(var.attributes))
            continue
        oda = var.data
        header = oda.shape[: len(oda.shape) - oda.geo_ndim]
        offsets = np.zeros(header, dtype=np.uint64)
        lengths = np.zeros(header, dtype=np.uint64)
        present = np.zeros(header, dtype=bool)
        packings[name] = set()
        for idx, ids in oda.field_id_index.items():
            mid = ids[0]
            if not isinstance(mid, (int, np.integer)) or int(mid) not in length:
                raise GribError(f"{path}: variable {name!r} is one of several fields of one GRIB message "
                                f"(message id {mid!r}); one message per chunk cannot reference it")
            offsets[idx], lengths[idx], present[idx] = int(mid), length[int(mid)], True
            packings[name].add(kind[int(mid)])
        paths = np.where(present, url, "").astype(np.dtypes.StringDType())
        mv = oda.missing_value  # what cfgrib turns into NaN
        data[name] = _Messages(tuple(var.dimensions), tuple(oda.shape), dict(var.attributes), oda.geo_ndim,
                               paths, np.stack([offsets, lengths]), None if mv is None else float(mv))
    # decoded the way xarray's cfgrib backend decodes them (times, steps)
    cds_coords = xr.decode_cf(xr.Dataset(coords=coords))
    return _File(url, dict(cds.attributes), cds_coords, data, packings)


# ----------------------------------------------------------------------------- joining files
def _joined_coords(files: list[_File], concat_dim: str) -> xr.Dataset:
    """The coordinates of all files along ``concat_dim``, as ``xr.concat(..., coords="different")`` joins them;
    a coordinate other than those along ``concat_dim`` that differs between files raises."""
    if len(files) == 1:
        return files[0].coords
    first = files[0].coords
    for f in files[1:]:
        for name, var in f.coords.variables.items():
            if name == concat_dim or name not in first.variables:
                continue
            if name in var.dims and not var.equals(first[name].variable):
                raise GribError(f"coordinate {name!r} in {named(f.url)} differs from the one in "
                                f"{named(files[0].url)}: the files do not share one grid")
    try:
        return xr.concat([f.coords for f in files], dim=concat_dim, coords="different", compat="equals",
                         join="exact", combine_attrs="override")
    except Exception as e:  # noqa: BLE001
        raise GribError(f"the coordinates of {named(files[0].url)} ... {named(files[-1].url)} cannot be joined "
                        f"along {concat_dim!r}: {type(e).__name__}: {e}") from None


def _order(files: list[_File], concat_dim: str) -> list[_File]:
    """Files in the order of their first ``concat_dim`` label; files that overlap raise."""
    if not all(concat_dim in f.coords.variables for f in files):
        missing = next(f for f in files if concat_dim not in f.coords.variables)
        raise GribError(f"{named(missing.url)} has no coordinate {concat_dim!r} to join the files along")
    key = [np.atleast_1d(f.coords[concat_dim].values) for f in files]
    order = sorted(range(len(files)), key=lambda i: key[i][0])
    for a, b in zip(order, order[1:], strict=False):
        if not key[a][-1] < key[b][0]:
            raise GribError(f"{named(files[a].url)} and {named(files[b].url)} overlap along {concat_dim!r}: "
                            "files must follow each other")
    return [files[i] for i in order]


def _choose_decoder(name: str, files: list[_File], decoder: str) -> str:
    if decoder != "auto":
        return decoder
    try:
        import gribberish  # noqa: F401
    except ImportError:
        return "eccodes"
    packs = set().union(*(f.packings.get(name, set()) for f in files))
    exact = GRIBBERISH_PACKINGS if _gribberish_major() >= 1 else GRIBBERISH_0_PACKINGS
    if not all(p in exact.get(e, ()) for e, p in packs):
        return "eccodes"
    f = files[0]
    _, shape, _, geo_ndim, paths, ol, mv = f.data[name]
    field = shape[len(shape) - geo_ndim:]
    if math.prod(field) >= GRIBBERISH_MAX_VALUES:  # ecCodes is the faster there
        return "eccodes"
    # the first message of the variable decodes to the same values with both, or ecCodes it is
    at = np.argwhere(paths != "")
    if not len(at):
        return "eccodes"
    idx = tuple(at[0])
    off, n = int(ol[0][idx]), int(ol[1][idx])
    with open(_local_path(f.url), "rb") as fh:
        fh.seek(off)
        raw = fh.read(n)
    try:
        a = decode_message(raw, field, mv, "gribberish")
    except Exception:  # noqa: BLE001
        return "eccodes"
    return "gribberish" if np.array_equal(a, decode_message(raw, field, mv, "eccodes"), equal_nan=True) else "eccodes"


def _gribberish_major() -> int:
    """The installed gribberish's major version (0 where it cannot be told)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("gribberish").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return 0


def _data_array(name: str, files: list[_File], concat_dim: str, decoder: str) -> Any:
    from virtualizarr.manifests import ChunkManifest, ManifestArray
    from virtualizarr.manifests.utils import create_v3_array_metadata

    missing = next((f for f in files if name not in f.data), None)
    if missing is not None:
        raise GribError(f"variable {name!r} is in {named(files[0].url)} but not in {named(missing.url)}")
    # where a file's scalar concat_dim becomes a dimension: where other files have it (cfgrib puts an
    # ensemble's ``number`` before ``time``), else first, as xr.concat puts a new dimension
    pos = next((f.data[name].dims.index(concat_dim) for f in files if concat_dim in f.data[name].dims), 0)
    parts = []
    dims0: tuple[str, ...] | None = None
    for f in files:
        dims, shape, attrs, geo_ndim, paths, ol, mv = f.data[name]
        if len(files) > 1 and concat_dim not in dims:  # a scalar coordinate in each file becomes a dimension
            dims, shape = (*dims[:pos], concat_dim, *dims[pos:]), (*shape[:pos], 1, *shape[pos:])
            paths, ol = np.expand_dims(paths, pos), np.expand_dims(ol, pos + 1)
        if dims0 is None:
            dims0, shape0, attrs0, geo0, mv0 = dims, shape, attrs, geo_ndim, mv
        ax = dims.index(concat_dim) if concat_dim in dims else 0
        if dims != dims0 or geo_ndim != geo0 or [s for i, s in enumerate(shape) if i != ax] != \
                [s for i, s in enumerate(shape0) if i != ax]:
            raise GribError(f"variable {name!r} has dims {dims} and shape {shape} in {named(f.url)} but {dims0} and "
                            f"{shape0} in {named(files[0].url)} (other than along {concat_dim!r})")
        if mv != mv0:
            raise GribError(f"variable {name!r} has missingValue {mv} in {named(f.url)} but {mv0} in "
                            f"{named(files[0].url)}: one codec cannot decode both")
        parts.append((shape, paths, ol))
    assert dims0 is not None  # files is never empty
    ax = dims0.index(concat_dim) if concat_dim in dims0 else 0
    shape_out = list(shape0)
    if len(parts) > 1:
        shape_out[ax] = sum(p[0][ax] for p in parts)
    paths = np.concatenate([p[1] for p in parts], axis=ax) if len(parts) > 1 else parts[0][1]
    ol = np.concatenate([p[2] for p in parts], axis=ax + 1) if len(parts) > 1 else parts[0][2]
    nh = len(shape_out) - geo0
    chunks = (1,) * nh + tuple(shape_out[nh:])
    attrs = {k: _jsonable(v) for k, v in attrs0.items()}
    md = create_v3_array_metadata(
        shape=tuple(shape_out), data_type=np.dtype("float32"), chunk_shape=chunks, fill_value=np.float32("nan"),
        codecs=[{"name": CODEC_NAME, "configuration": {"decoder": decoder, "missing_value": mv0}}],
        attributes=attrs, dimension_names=dims0)
    grid = tuple(shape_out[:nh]) + (1,) * geo0
    manifest = ChunkManifest.from_arrays(paths=paths.reshape(grid), offsets=ol[0].reshape(grid),  # type: ignore[arg-type]
                                         lengths=ol[1].reshape(grid), validate_paths=False)  # (StringDType paths)
    return ManifestArray(metadata=md, chunkmanifest=manifest)


def grib_store(paths: str | os.PathLike | Iterable[str | os.PathLike], *, concat_dim: str = "time",
               filter_by_keys: dict[str, Any] | None = None, decoder: str = "auto", registry: Any = None,
               **cfgrib_kwargs: Any) -> Any:
    """One virtual Zarr store over GRIB files (editions 1 and 2) joined along ``concat_dim``; nothing is copied.

    Parameters
    ----------
    paths : a glob (``"/data/era5/*.grib"``), a path, or a list of them (local files: ecCodes scans them).
        Files are put in the order of their first ``concat_dim`` label.
    concat_dim : the dimension the files follow each other along (cfgrib's ``time``: the reference time).
        Where each file holds one reference time (cfgrib then makes ``time`` a scalar coordinate), it
        becomes the first dimension, as ``xr.concat`` makes it.
    filter_by_keys : cfgrib's: which messages make the Dataset (e.g. ``{"typeOfLevel": "isobaricInhPa"}``),
        where a file holds several hypercubes.
    decoder : ``"auto"`` (gribberish where its decoding of the variable's packing was verified, else
        ecCodes), ``"gribberish"`` or ``"eccodes"``.
    registry : an ``obspec_utils`` ``ObjectStoreRegistry`` resolving the files' URLs (default: local files).
    **cfgrib_kwargs : other arguments of cfgrib (``read_keys``, ``time_dims``, ``extra_coords``...).

    Returns
    -------
    virtualizarr.manifests.ManifestStore
        Every data variable's chunks are single GRIB messages of the files (one message per chunk:
        ``(1, ..., 1, latitude, longitude)``), decoded by the ``xinsitu.grib`` codec; coordinates
        are held inline. A field no message holds reads as NaN, as in cfgrib.

    Raises
    ------
    GribError
        Naming the file: not GRIB, truncated or damaged, fields cfgrib cannot arrange as one
        hypercube, files that do not share a grid, variables or steps that differ between files.
    """
    from virtualizarr.manifests import ManifestGroup, ManifestStore

    if decoder not in ("auto", "gribberish", "eccodes"):
        raise ValueError(f"decoder must be 'auto', 'gribberish' or 'eccodes', not {decoder!r}")
    urls = as_urls(paths)
    kwargs = dict(cfgrib_kwargs)
    if filter_by_keys:
        if not isinstance(filter_by_keys, dict):
            raise TypeError(f"filter_by_keys must be a dict of GRIB keys and values (e.g. {{'typeOfLevel': "
                            f"'surface'}}), got {type(filter_by_keys).__name__}: {filter_by_keys!r}")
        kwargs["filter_by_keys"] = dict(filter_by_keys)
    # files scanned a few at a time: ecCodes releases the GIL while it reads and parses headers
    with ThreadPoolExecutor(min(PARSE_THREADS, len(urls))) as pool:
        files = list(pool.map(lambda u: _read_file(u, kwargs), urls))
    if len(files) > 1:
        files = _order(files, concat_dim)
    reg = registry_for([f.url for f in files], registry, {})
    coords = _joined_coords(files, concat_dim)
    inline = InlineCoords()
    arrays: dict[str, Any] = {}
    for name in files[0].data:
        arrays[name] = _data_array(name, files, concat_dim, _choose_decoder(name, files, decoder))
    for f in files[1:]:
        extra = sorted(set(f.data) - set(files[0].data))
        if extra:
            raise GribError(f"variable(s) {extra} are in {named(f.url)} but not in {named(files[0].url)}; "
                            "pass filter_by_keys= to open the same fields of every file")
    for key, var in coords.variables.items():
        name = str(key)
        arrays[name] = inline.array(name, var)
    inline.register(reg)
    out = ManifestStore(ManifestGroup(arrays=arrays, attributes={k: _jsonable(v) for k, v in files[0].attrs.items()}),
                        registry=reg)
    check_decodable(out, files[0].url)
    return note_opened(out)  # a file changed since is refused (references are byte offsets)


def open_grib(paths: str | os.PathLike | Iterable[str | os.PathLike], *, concat_dim: str = "time",
              filter_by_keys: dict[str, Any] | None = None, decoder: str = "auto", registry: Any = None,
              decode_times: bool = True, **cfgrib_kwargs: Any) -> xr.Dataset:
    """``xinsitu.open_zarr(grib_store(paths, ...))``: GRIB files as one lazy Dataset, read in place.

    Equals ``xr.open_dataset(path, engine="cfgrib")`` for one file (names, coordinates, attributes
    and values), and ``xr.concat`` of those along ``concat_dim`` for several, without dask and
    without copying or converting the data. See :func:`grib_store` for the arguments.
    """
    from xinsitu.stores.opening import open_zarr

    store = grib_store(paths, concat_dim=concat_dim, filter_by_keys=filter_by_keys, decoder=decoder,
                       registry=registry, **cfgrib_kwargs)
    # cfgrib's variable order (the store lists its arrays in it; open_zarr sorts them by name)
    return in_store_order(open_zarr(store, consolidated=False, decode_times=decode_times), store)


# ----------------------------------------------------------------------------- writing (examples, tests, benchmarks)
def write_grib(path: str | os.PathLike, fields: dict[str, np.ndarray], times: Any, steps: Iterable[int] = (0,), *,
               edition: int = 2, lat0: float = 90.0, dlat: float = 1.0, lon0: float = 0.0, dlon: float = 1.0,
               packing: str = "grid_simple", bits_per_value: int = 16, pad: int = 0,
               missing: float | None = None) -> str:
    """Write ``fields`` as GRIB messages with ecCodes' samples: one message per (time, step, field).

    Parameters
    ----------
    fields : ``{shortName: array (time, step, lat, lon)}`` (``"2t"``, ``"msl"``, ``"10u"``...).
    times : the reference times (anything ``pandas.to_datetime`` reads), one per index of axis 0.
    steps : forecast steps in hours, one per index of axis 1.
    edition : 1 or 2 (samples ``regular_ll_sfc_grib1`` / ``regular_ll_sfc_grib2``).
    lat0, dlat, lon0, dlon : the regular lat/lon grid (latitudes go down from ``lat0``).
    packing : ecCodes' ``packingType`` (``grid_simple``, ``grid_ccsds``, ``grid_ieee``...).
    pad : zero bytes written after each message (as some GRIB1 archives pad theirs).
    missing : values equal to this are left out through a bitmap.
    """
    import eccodes
    import pandas as pd

    times = pd.to_datetime(np.atleast_1d(np.asarray(times)))
    steps = list(steps)
    with open(path, "wb") as f:
        for it, t in enumerate(times):
            for js, step in enumerate(steps):
                for name, arr in fields.items():
                    ny, nx = arr.shape[-2:]
                    h = eccodes.codes_grib_new_from_samples(f"regular_ll_sfc_grib{edition}")
                    try:
                        for k, v in (("Ni", nx), ("Nj", ny), ("latitudeOfFirstGridPointInDegrees", lat0),
                                     ("latitudeOfLastGridPointInDegrees", lat0 - (ny - 1) * dlat),
                                     ("longitudeOfFirstGridPointInDegrees", lon0),
                                     ("longitudeOfLastGridPointInDegrees", lon0 + (nx - 1) * dlon),
                                     ("iDirectionIncrementInDegrees", dlon), ("jDirectionIncrementInDegrees", dlat),
                                     ("dataDate", int(t.strftime("%Y%m%d"))), ("dataTime", int(t.strftime("%H%M"))),
                                     ("shortName", name), ("step", int(step)), ("bitsPerValue", bits_per_value)):
                            eccodes.codes_set(h, k, v)
                        values = np.asarray(arr[it, js], dtype=np.float64).ravel()
                        if missing is not None:
                            eccodes.codes_set(h, "bitmapPresent", 1)
                            eccodes.codes_set(h, "missingValue", missing)
                        eccodes.codes_set(h, "packingType", packing)
                        eccodes.codes_set_values(h, values)
                        f.write(eccodes.codes_get_message(h))
                        f.write(b"\0" * pad)
                    finally:
                        eccodes.codes_release(h)
    return os.fspath(path)
