"""NetCDF-3 files (classic, 64-bit offset, and CDF-5) read in place: byte ranges from the header.

A NetCDF-3 file is a header then the variables' values, uncompressed and big-endian, in the
order the header gives: each fixed-size variable contiguous from its ``begin`` offset, then the
records, each record holding one slab of every record variable (variables along the unlimited
dimension are interleaved). So every record of every record variable is its own byte range,
``begin + i * recsize``: one chunk per record along the unlimited dimension. A fixed-size
variable is stored contiguously in C order, so one index of its first dimension is one
contiguous slab, ``begin + i * slab``: every fixed-size data variable is addressed in such slabs,
one index of its first dimension a chunk (as records are), so it can be split along that
dimension like a chunked array (e.g. ERA-Interim's u, v, z on month x level x lat x lon, split
along month) and files of different lengths join along it. One index, not several: a slab of
several would need the dimension's length to be a multiple of it (an edge chunk is read whole),
a split could only cut between slabs, and all variables along the dimension share the one grid
of the record variables; a slab is one field (the variable's other dimensions), the unit a
record variable reads anyway. Only a first dimension longer than ``MAX_SLABS`` (not the join
dimension) gets slabs of several indices (``slab_steps``: the fewest that keep the references
bounded, e.g. 10^7 observations of a 1-d variable). Coordinate variables (``x(x)``) stay one
chunk, or one per index where they are large or along the join dimension: xarray reads them
whole when it opens the files.

Values are decoded as xarray decodes them (``_FillValue``, ``missing_value``, ``scale_factor``,
``add_offset``, ``_Unsigned``) by the :class:`CFBytesCodec` zarr codec (``"xinsitu.cf_bytes"``),
which runs xarray's own CF decoder on each chunk: the attributes keep their NetCDF types there
(a float32 ``scale_factor`` decodes to float32, as xarray does it), which zarr's JSON attributes
would lose. Variables that need no CF decoding are plain big-endian ``bytes``.
:class:`CFArrayCodec` (``"xinsitu.cf"``) does the same after the codecs of a NetCDF4/HDF5
variable packed with float32 ``scale_factor``/``add_offset`` (see :func:`typed_packing`).
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xarray as xr

#: NetCDF-3 versions (the 4th byte of the file), by name.
VERSIONS = {1: "classic", 2: "64-bit offset", 5: "64-bit data (CDF-5)"}

#: nc_type -> numpy dtype (big-endian, as stored).
NC_TYPES = {1: np.dtype("i1"), 2: np.dtype("S1"), 3: np.dtype(">i2"), 4: np.dtype(">i4"), 5: np.dtype(">f4"),
            6: np.dtype(">f8"), 7: np.dtype("u1"), 8: np.dtype(">u2"), 9: np.dtype(">u4"), 10: np.dtype(">i8"),
            11: np.dtype(">u8")}

#: Attributes xarray's CF decoder applies to values (the rest are kept as attributes).
CF_VALUE_ATTRS = ("_FillValue", "missing_value", "scale_factor", "add_offset", "_Unsigned")

#: A coordinate variable (not along the join dimension) larger than this is chunked along its first dimension.
WHOLE_CHUNK_BYTES = 64 * 2**20
#: A fixed-size variable (not along the join dimension) is cut into at most this many slabs along its first
#: dimension (``slab_steps``): a 1-d variable of 10^7 observations is not 10^7 references of 4 bytes.
MAX_SLABS = 4096

CODEC_NAME = "xinsitu.cf_bytes"
ARRAY_CODEC_NAME = "xinsitu.cf"

_NC_DIMENSION, _NC_VARIABLE, _NC_ATTRIBUTE = 10, 11, 12
_STREAMING = 0xFFFFFFFF


def slab_steps(n: int) -> int:
    """Indices of the first dimension per chunk of a fixed-size variable of length ``n`` along it: 1 where
    ``n <= MAX_SLABS``, else the smallest divisor of ``n`` that leaves at most ``MAX_SLABS`` chunks (a divisor:
    an edge chunk is read whole, so every slab must be full). It depends on ``n`` alone, so every variable
    along a dimension gets the same grid."""
    if n <= MAX_SLABS:
        return 1
    want = -(-n // MAX_SLABS)
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return min(d for d in small + [n // d for d in small] if d >= want)


def is_netcdf3(head: bytes) -> bool:
    """Whether ``head`` (the first 4 bytes of a file) is a NetCDF-3 magic number."""
    return len(head) >= 4 and head[:3] == b"CDF" and head[3] in VERSIONS


@dataclass
class Var:
    name: str
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    attrs: dict[str, Any]
    begin: int
    record: bool

    @property
    def slab(self) -> int:
        """Bytes of one record (record variables) or of the whole variable."""
        n = int(np.prod(self.shape[1:] if self.record else self.shape, dtype=np.int64))
        return n * self.dtype.itemsize


@dataclass
class Header:
    version: int
    numrecs: int
    dims: dict[str, int]
    record_dim: str | None
    attrs: dict[str, Any]
    vars: list[Var] = field(default_factory=list)
    recsize: int = 0


class _Truncated(Exception):
    """The header goes on past the bytes read so far."""


class _Reader:
    def __init__(self, data: bytes, version: int):
        self.data, self.pos, self.version = data, 0, version

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise _Truncated
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def int32(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def uint32(self) -> int:
        return struct.unpack(">I", self.take(4))[0]

    def count(self) -> int:  # NON_NEG: 64-bit in CDF-5
        return struct.unpack(">q", self.take(8))[0] if self.version == 5 else self.int32()

    def offset(self) -> int:
        return struct.unpack(">q", self.take(8))[0] if self.version in (2, 5) else self.int32()

    def name(self) -> str:
        n = self.count()
        raw = self.take(n)
        self.take(-n % 4)
        return raw.decode("utf-8")

    def values(self, nc_type: int, n: int) -> Any:
        dtype = NC_TYPES.get(nc_type)
        if dtype is None:
            raise ValueError(f"unknown nc_type {nc_type}")
        raw = self.take(n * dtype.itemsize)
        self.take(-(n * dtype.itemsize) % 4)
        if nc_type == 2:  # text, as netCDF4-python returns it
            return raw.rstrip(b"\0").decode("utf-8", errors="replace")
        arr = np.frombuffer(raw, dtype).astype(dtype.newbyteorder("="))
        return arr[0] if n == 1 else arr

    def attrs(self) -> dict[str, Any]:
        tag, n = self.int32(), self.count()
        if tag == 0 and n == 0:
            return {}
        if tag != _NC_ATTRIBUTE:
            raise ValueError(f"expected an attribute list, found tag {tag}")
        out = {}
        for _ in range(n):
            name = self.name()
            nc_type, count = self.int32(), self.count()
            out[name] = self.values(nc_type, count)
        return out


def parse_header(data: bytes) -> Header:
    """The header of a NetCDF-3 file from its first bytes (``_Truncated`` where more are needed)."""
    if not is_netcdf3(data[:4]):
        raise ValueError("not a NetCDF-3 file (no CDF magic number)")
    r = _Reader(data, data[3])
    r.take(4)
    numrecs = struct.unpack(">q", r.take(8))[0] if r.version == 5 else r.uint32()
    tag, n = r.int32(), r.count()
    dims: list[tuple[str, int]] = []
    if not (tag == 0 and n == 0):
        if tag != _NC_DIMENSION:
            raise ValueError(f"expected the dimension list, found tag {tag}")
        dims = [(r.name(), r.count()) for _ in range(n)]
    record_dim = next((d for d, size in dims if size == 0), None)
    gattrs = r.attrs()
    tag, n = r.int32(), r.count()
    raw_vars = []
    if not (tag == 0 and n == 0):
        if tag != _NC_VARIABLE:
            raise ValueError(f"expected the variable list, found tag {tag}")
        for _ in range(n):
            name = r.name()
            ids = [r.count() for _ in range(r.count())]
            attrs = r.attrs()
            nc_type = r.int32()
            r.count()  # vsize: redundant, and clipped for large variables
            raw_vars.append((name, ids, attrs, nc_type, r.offset()))
    h = Header(r.version, numrecs, {d: size for d, size in dims}, record_dim, gattrs)
    for name, ids, attrs, nc_type, begin in raw_vars:
        names = tuple(dims[i][0] for i in ids)
        record = bool(names) and names[0] == record_dim
        shape = tuple(numrecs if (k == 0 and record) else dims[i][1] for k, i in enumerate(ids))
        h.vars.append(Var(name, names, shape, NC_TYPES[nc_type], attrs, begin, record))
    rec = [v for v in h.vars if v.record]
    # one record variable: records are not padded; several: each slab is padded to 4 bytes
    h.recsize = rec[0].slab if len(rec) == 1 else sum(v.slab + (-v.slab % 4) for v in rec)
    return h


def read_header(read: Callable[[int, int], bytes], size: int) -> Header:
    """Parse the header reading ``read(start, end)`` in growing pieces (headers are usually a few kB)."""
    n = 64 * 1024
    while True:
        data = read(0, min(n, size))
        try:
            return parse_header(data)
        except _Truncated:
            if n >= size:
                raise ValueError("the header runs past the end of the file (truncated?)") from None
            n *= 4


# ----------------------------------------------------------------------------- CF decoding codec
def _pack(value: Any) -> dict[str, Any]:
    """An attribute value with its NetCDF type, JSON-safe and exact."""
    if isinstance(value, str):
        return {"str": value}
    arr = np.asarray(value)
    return {"dtype": arr.dtype.newbyteorder("<").str, "shape": list(arr.shape),
            "b64": base64.b64encode(arr.astype(arr.dtype.newbyteorder("<")).tobytes()).decode()}


def _unpack(packed: dict[str, Any]) -> Any:
    if "str" in packed:
        return packed["str"]
    arr = np.frombuffer(base64.b64decode(packed["b64"]), np.dtype(packed["dtype"])).reshape(packed["shape"])
    arr = arr.astype(arr.dtype.newbyteorder("="))
    return arr[()] if arr.ndim == 0 else arr


def cf_decode(raw: np.ndarray, cf_attrs: dict[str, Any], name: str = "") -> np.ndarray:
    """``raw`` (as stored) decoded by xarray's CF decoder with ``cf_attrs`` (mask, scale, offset, unsigned), in
    native byte order first: xarray masks ``_Unsigned`` values of a big-endian array against the byte-swapped fill
    (a real value became NaN, the fill came through), where netCDF4 and scipy hand it native arrays."""
    raw = raw.astype(raw.dtype.newbyteorder("="), copy=False)
    var = xr.Variable(tuple(f"dim_{i}" for i in range(raw.ndim)), raw, dict(cf_attrs))
    return np.asarray(xr.conventions.decode_cf_variable(
        name, var, mask_and_scale=True, decode_times=False, decode_endianness=True, stack_char_dim=False,
        concat_characters=False, decode_timedelta=False).values)


def _register_codec() -> type:
    from dataclasses import dataclass as frozen_dataclass

    from xinsitu.compat.zarr_api import parse_named_configuration
    from xinsitu.formats.references import read_only_bytes_codec, register_codec_class

    @frozen_dataclass(frozen=True)
    class CFBytesCodec(read_only_bytes_codec()):  # type: ignore[misc]
        """Read-only zarr v3 codec: raw NetCDF values (``dtype``, big-endian) -> xarray's CF decoding of them.

        ``attrs`` maps each CF attribute xarray applies (``_FillValue``, ``scale_factor``...) to its
        value with its NetCDF type (see ``_pack``).
        """

        dtype: str = ">f4"
        attrs: tuple[tuple[str, Any], ...] = ()
        is_fixed_size = True
        read_as = "NetCDF-3 files"

        def __init__(self, dtype: str = ">f4", attrs: Any = ()):
            items = attrs.items() if isinstance(attrs, dict) else attrs
            object.__setattr__(self, "dtype", str(dtype))
            object.__setattr__(self, "attrs", tuple((str(k), _freeze(v)) for k, v in items))

        @classmethod
        def from_dict(cls, data: dict[str, Any]) -> CFBytesCodec:
            _, cfg = parse_named_configuration(data, CODEC_NAME, require_configuration=True)
            return cls(**(cfg or {}))  # type: ignore[arg-type]  # zarr's JSON config: checked by zarr

        def to_dict(self) -> dict[str, Any]:
            return {"name": CODEC_NAME, "configuration": {"dtype": self.dtype,
                                                          "attrs": {k: _thaw(v) for k, v in self.attrs}}}

        def cf_attrs(self) -> dict[str, Any]:
            return {k: _unpack(_thaw(v)) for k, v in self.attrs}

        def _decode_sync(self, chunk_bytes: Any, chunk_spec: Any) -> Any:
            raw = np.frombuffer(chunk_bytes.as_numpy_array(), np.dtype(self.dtype)).reshape(chunk_spec.shape)
            out = cf_decode(raw, self.cf_attrs())
            dtype = chunk_spec.dtype.to_native_dtype()
            return chunk_spec.prototype.nd_buffer.from_ndarray_like(np.ascontiguousarray(out, dtype=dtype))

        def compute_encoded_size(self, input_byte_length: int, chunk_spec: Any) -> int:
            return input_byte_length // chunk_spec.dtype.to_native_dtype().itemsize * np.dtype(self.dtype).itemsize

    return register_codec_class(CFBytesCodec, CODEC_NAME, __name__)


def _register_array_codec() -> type:
    from zarr.abc.codec import ArrayArrayCodec
    from zarr.dtype import parse_dtype

    from xinsitu.compat.zarr_api import array_spec, parse_named_configuration
    from xinsitu.formats.references import register_codec_class

    class CFArrayCodec(ArrayArrayCodec):
        """Read-only zarr v3 codec: stored values (``dtype``) -> xarray's CF decoding of them, with the CF
        attributes in their NetCDF types (see :class:`CFBytesCodec`); for NetCDF4/HDF5 variables packed
        with float32 ``scale_factor``/``add_offset``, which zarr's JSON attributes would turn into float64.
        ``fill_value`` is the stored array's fill value.
        """

        is_fixed_size = True
        dtype: str
        attrs: tuple[tuple[str, Any], ...]
        fill_value: Any

        def __init__(self, dtype: str = "<i2", attrs: Any = (), fill_value: Any = None):
            items = attrs.items() if isinstance(attrs, dict) else attrs
            object.__setattr__(self, "dtype", str(dtype))
            object.__setattr__(self, "attrs", tuple((str(k), _freeze(v)) for k, v in items))
            object.__setattr__(self, "fill_value", fill_value)

        def __eq__(self, other: object) -> bool:
            return isinstance(other, CFArrayCodec) and self.to_dict() == other.to_dict()

        def __hash__(self) -> int:
            return hash((self.dtype, self.attrs, repr(self.fill_value)))

        @classmethod
        def from_dict(cls, data: dict[str, Any]) -> CFArrayCodec:
            _, cfg = parse_named_configuration(data, ARRAY_CODEC_NAME, require_configuration=True)
            return cls(**(cfg or {}))  # type: ignore[arg-type]  # zarr's JSON config: checked by zarr

        def to_dict(self) -> dict[str, Any]:
            return {"name": ARRAY_CODEC_NAME, "configuration": {
                "dtype": self.dtype, "attrs": {k: _thaw(v) for k, v in self.attrs}, "fill_value": self.fill_value}}

        def resolve_metadata(self, chunk_spec: Any) -> Any:
            """The stored side: the raw dtype and its fill value."""
            return array_spec(chunk_spec.shape, parse_dtype(np.dtype(self.dtype), zarr_format=3),
                              self.fill_value if self.fill_value is not None else 0,
                              chunk_spec.config, chunk_spec.prototype)

        def _decode_sync(self, chunk_array: Any, chunk_spec: Any) -> Any:
            raw = np.asarray(chunk_array.as_ndarray_like())
            out = cf_decode(raw, {k: _unpack(_thaw(v)) for k, v in self.attrs})
            dtype = chunk_spec.dtype.to_native_dtype()
            return chunk_spec.prototype.nd_buffer.from_ndarray_like(np.ascontiguousarray(out, dtype=dtype))

        async def _decode_single(self, chunk_array: Any, chunk_spec: Any) -> Any:
            return self._decode_sync(chunk_array, chunk_spec)

        async def _encode_single(self, chunk_array: Any, chunk_spec: Any) -> Any:
            raise NotImplementedError("files read in place are never written")

        def compute_encoded_size(self, input_byte_length: int, chunk_spec: Any) -> int:
            return input_byte_length // chunk_spec.dtype.to_native_dtype().itemsize * np.dtype(self.dtype).itemsize

    return register_codec_class(CFArrayCodec, ARRAY_CODEC_NAME, __name__)


def _freeze(packed: dict[str, Any]) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in packed.items()))


def _thaw(frozen: tuple) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in frozen}


CFBytesCodec = _register_codec()
CFArrayCodec = _register_array_codec()


def typed_packing(arr: Any, h5attrs: Any) -> Any:
    """``arr`` (a NetCDF4 variable's ManifestArray, its attributes as JSON) decoded as xarray decodes the file.

    Where ``scale_factor``/``add_offset`` have a type JSON loses (float32: xarray then decodes to
    float32, from JSON to float64), the array's dtype becomes the one xarray gives and the
    ``xinsitu.cf`` codec decodes each chunk with the attributes in their file types (``h5attrs``,
    the HDF5 attributes). Anything else is returned unchanged.
    """
    import warnings

    from virtualizarr.manifests import ManifestArray

    attrs = dict(arr.metadata.attributes or {})
    if not ({"scale_factor", "add_offset"} & set(attrs)):
        return arr
    typed = {k: h5attrs[k] for k in CF_VALUE_ATTRS if k in h5attrs}
    typed = {k: (v.decode() if isinstance(v, bytes) else v[0] if np.ndim(v) == 1 and len(v) == 1 else v)
             for k, v in typed.items()}
    raw = np.dtype(arr.metadata.data_type.to_native_dtype())

    def decoded(cf: dict[str, Any]) -> Any:
        sample = xr.Variable(("x",), np.zeros(1, raw), dict(cf))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return xr.conventions.decode_cf_variable("v", sample, mask_and_scale=True, decode_times=False,
                                                    decode_timedelta=False)

    json_typed = {k: float(v) if isinstance(v, np.floating) else int(v) if isinstance(v, np.integer) else v
                  for k, v in typed.items()}
    dec = decoded(typed)
    if dec.dtype == decoded(json_typed).dtype:
        return arr  # JSON gives the same decoding
    applied = {k: dec.encoding[k] for k in CF_VALUE_ATTRS if k in dec.encoding}
    md = arr.metadata
    codec = {"name": ARRAY_CODEC_NAME, "configuration": {
        "dtype": raw.str, "attrs": {k: _pack(v) for k, v in applied.items()},
        "fill_value": md.fill_value.item() if hasattr(md.fill_value, "item") else md.fill_value}}
    from virtualizarr.manifests.utils import create_v3_array_metadata

    new = create_v3_array_metadata(
        shape=md.shape, data_type=np.dtype(dec.dtype), chunk_shape=md.chunks,
        chunk_key_encoding=md.chunk_key_encoding, fill_value=np.nan if dec.dtype.kind == "f" else None,
        codecs=[codec, *[c.to_dict() for c in md.codecs]],
        attributes={k: v for k, v in attrs.items() if k not in typed or k in dec.attrs},
        dimension_names=md.dimension_names)
    return ManifestArray(metadata=new, chunkmanifest=arr.manifest)


# ----------------------------------------------------------------------------- a file -> ManifestStore
def _decoded_form(var: Var) -> tuple[np.dtype, dict[str, Any], dict[str, Any]]:
    """(dtype, attributes, CF attributes applied) of ``var`` once xarray decodes it (not its times)."""
    import warnings

    sample = xr.Variable(("x",), np.zeros(1, var.dtype.newbyteorder("=")), dict(var.attrs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "non-conforming _FillValue ... dropping": the decoder drops it
        dec = xr.conventions.decode_cf_variable(var.name, sample, mask_and_scale=True, decode_times=False,
                                                decode_endianness=True, stack_char_dim=False,
                                                concat_characters=False, decode_timedelta=False)
    applied = {k: dec.encoding[k] for k in CF_VALUE_ATTRS if k in dec.encoding}
    if var.dtype.kind == "f" and np.dtype(dec.dtype) == var.dtype.newbyteorder("=") and all(
            k in ("_FillValue", "missing_value") and np.isnan(np.asarray(v, dtype=float)).all()
            for k, v in applied.items()):
        applied = {}  # floats masked where NaN: nothing to do (what xarray writes for every float variable)
    return np.dtype(dec.dtype), dict(dec.attrs), applied


def manifest_store(url: str, read: Callable[[int, int], bytes], size: int, registry: Any, *,
                   concat_dim: str = "time", drop: list[str] | None = None) -> Any:
    """The ``ManifestStore`` of one NetCDF-3 file; ``read(start, end)`` reads its bytes (the header only)."""
    from virtualizarr.manifests import ChunkManifest, ManifestArray, ManifestGroup, ManifestStore
    from virtualizarr.manifests.utils import create_v3_array_metadata

    from xinsitu.formats.references import _jsonable
    from xinsitu.stores.virtual_store import VirtualReferenceError, named

    try:
        h = read_header(read, size)
    except Exception as e:  # noqa: BLE001
        raise VirtualReferenceError(f"{named(url)}: its NetCDF-3 header cannot be read ({type(e).__name__}: "
                                    f"{e})") from None
    if h.numrecs == _STREAMING and h.version != 5:  # written by a stream: records until the end of the file
        first = min((v.begin for v in h.vars if v.record), default=size)
        h.numrecs = (size - first) // h.recsize if h.recsize else 0
        for v in h.vars:
            if v.record:
                v.shape = (h.numrecs, *v.shape[1:])
    arrays: dict[str, Any] = {}
    for v in h.vars:
        if v.name in (drop or ()):
            continue
        if v.dtype.kind == "S":
            raise VirtualReferenceError(
                f"{named(url)}: variable {v.name!r} holds characters (NC_CHAR), which this reader does not "
                f"reference in place; leave it out with drop_variables=[{v.name!r}]")
        coordinate = v.dims == (v.name,)  # x(x): read whole by xarray on open
        step = v.dims and (v.record or v.dims[0] == concat_dim or not coordinate or v.slab > WHOLE_CHUNK_BYTES)
        per = 1 if not step or v.record or v.dims[0] == concat_dim else slab_steps(v.shape[0])
        n0 = v.shape[0] // per if step else 1
        chunk = (per, *v.shape[1:]) if step else v.shape
        nbytes = int(np.prod(chunk, dtype=np.int64)) * v.dtype.itemsize
        stride = h.recsize if v.record else nbytes
        grid = (n0,) + (1,) * (len(v.shape) - 1) if v.shape else ()
        offsets = (v.begin + stride * np.arange(n0, dtype=np.uint64)).reshape(grid)
        end = int(offsets.max()) + nbytes if n0 else 0
        if end > size:
            raise VirtualReferenceError(f"{named(url)}: variable {v.name!r} ends at byte {end}, past the end of "
                                        f"the file ({size} bytes): the file is truncated")
        dtype, attrs, applied = _decoded_form(v)
        codecs: list[dict[str, Any]] | None
        if applied:
            codecs = [{"name": CODEC_NAME, "configuration": {
                "dtype": v.dtype.str, "attrs": {k: _pack(val) for k, val in applied.items()}}}]
        else:
            codecs = [{"name": "bytes", "configuration": {"endian": "big"}}] if v.dtype.itemsize > 1 else None
        md = create_v3_array_metadata(
            shape=v.shape, data_type=dtype, chunk_shape=chunk if v.shape else (),
            fill_value=np.nan if dtype.kind == "f" else None, codecs=codecs,
            attributes={k: _jsonable(val) for k, val in attrs.items()}, dimension_names=v.dims)
        manifest = ChunkManifest.from_arrays(
            paths=np.full(grid, url, dtype=np.dtypes.StringDType()), offsets=offsets,
            lengths=np.full(grid, nbytes, dtype=np.uint64), validate_paths=False)
        arrays[v.name] = ManifestArray(metadata=md, chunkmanifest=manifest)
    return ManifestStore(ManifestGroup(arrays=arrays, attributes={k: _jsonable(a) for k, a in h.attrs.items()}),
                         registry=registry)
