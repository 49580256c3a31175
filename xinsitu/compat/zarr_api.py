"""The one place xinsitu touches zarr's private API (``zarr.core``, underscored codec members).

Supported: zarr 3.1.6 to 3.4 (and newer while the contract test holds). Everything else in xinsitu
uses zarr's public API: ``zarr.abc.codec`` (codec base classes, the ``SupportsSyncCodec``
protocol whose ``_decode_sync`` is zarr's synchronous decode entry point), ``zarr.buffer``,
``zarr.dtype``, ``zarr.registry``. Where zarr releases differ, the path is chosen once, by
feature (never by version string). ``tests/compat/test_compat.py`` exercises every symbol named
here, so a zarr release that removes one fails there, loudly, and not deep in a batch.

Private symbols still used, and why:

- ``zarr.core.array_spec.ArraySpec``: the per-chunk spec every codec's ``_decode_sync``
  takes; zarr has no public constructor for one (``ArrayV3Metadata.get_chunk_spec`` is gone in
  zarr 3.3+).
- ``zarr.core.common.parse_named_configuration``: how zarr's own codecs read their JSON; the
  read-only codecs of GRIB and NetCDF references do the same.
- ``zarr.codecs.numcodecs._codecs._NumcodecsBytesBytesCodec`` and its ``_codec``: to decode
  NetCDF4's shuffle + deflate straight into the chunk (zlib-ng where installed).
- the sharding codec's ``_shard_index_size``, ``_get_chunk_spec`` and ``_decode_shard_index``
  (zarr < 3.3, async) / ``_decode_shard_index_sync`` (zarr >= 3.3): to read one inner chunk of
  a shard by byte range, without reading the shard.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def prototype() -> Any:
    """zarr's default buffer prototype (CPU)."""
    from zarr.buffer import default_buffer_prototype

    return default_buffer_prototype()


def array_spec(shape: tuple[int, ...], dtype: Any, fill_value: Any, config: Any, proto: Any = None) -> Any:
    """A zarr ``ArraySpec`` (private: ``zarr.core.array_spec``)."""
    from zarr.core.array_spec import ArraySpec

    return ArraySpec(shape=tuple(shape), dtype=dtype, fill_value=fill_value, config=config,
                     prototype=proto if proto is not None else prototype())


def stored_chunk_spec(aa: Any) -> Any:
    """The ``ArraySpec`` of one stored object of ``aa`` (an ``AsyncArray``): its chunk, or its whole shard.

    Built from public attributes (``shards``, ``chunks``, ``metadata.dtype``, ``metadata.fill_value``,
    ``config``, ``order``), the same spec as zarr < 3.3's ``metadata.get_chunk_spec`` gave for a regular
    grid. A v2 array's chunks are laid out in its metadata's ``order`` (``"F"``: column-major), whatever
    the array's config says: zarr's ``V2Codec`` reshapes a chunk by the spec's order.
    """
    shape = tuple(aa.shards or aa.chunks)
    config = aa.config
    if aa.metadata.zarr_format == 2 and aa.order != config.order:
        import dataclasses

        config = dataclasses.replace(config, order=aa.order)
    return array_spec(shape, aa.metadata.dtype, aa.metadata.fill_value, config)


def parse_named_configuration(data: Any, name: str, require_configuration: bool = True) -> tuple[str, Any]:
    """``(name, configuration)`` of a codec's JSON, checked as zarr checks its own codecs'."""
    from zarr.core.common import parse_named_configuration as parse

    return parse(data, name, require_configuration=require_configuration)


def numcodecs_bytes_codec(codec: Any) -> Any:
    """The numcodecs codec inside zarr's wrapper of a numcodecs bytes -> bytes codec (``numcodecs.zlib``,
    ``numcodecs.shuffle``), or None where ``codec`` is no such wrapper."""
    try:
        from zarr.codecs.numcodecs._codecs import _NumcodecsBytesBytesCodec
    except ImportError:  # zarr moved it: the codec is then decoded as zarr decodes it
        return None
    return codec._codec if isinstance(codec, _NumcodecsBytesBytesCodec) else None


def outer_codec(pipeline: Any) -> Any:
    """The codec that decodes a stored object's bytes first: the last bytes -> bytes codec of a v3 chain, a v2
    array's compressor (zarr's ``V2Codec``), unwrapped where zarr wraps a numcodecs codec; None without one."""
    bb = getattr(pipeline, "bytes_bytes_codecs", None) or ()
    codec = bb[-1] if bb else getattr(getattr(pipeline, "array_bytes_codec", None), "compressor", None)
    inner = None if codec is None else numcodecs_bytes_codec(codec)
    return codec if inner is None else inner


def sync_decodable(codec: Any) -> bool:
    """Whether ``codec`` decodes synchronously (``zarr.abc.codec.SupportsSyncCodec``, public) and can do so now:
    zarr >= 3.3 lets a codec opt out at run time (a sharding codec with an async-only inner codec)."""
    if not callable(getattr(codec, "_decode_sync", None)):
        return False
    return bool(getattr(codec, "_sync_capable", True))


# ----------------------------------------------------------------------------- sharding
SHARDING_MEMBERS = ("_shard_index_size", "_get_chunk_spec", "codec_pipeline", "chunk_shape", "index_location")


def sharding_codec(aa: Any) -> Any:
    """The sharding codec of ``aa`` (an ``AsyncArray``), or None where zarr's layout is not the one understood."""
    codecs: Any = getattr(aa.metadata, "codecs", ())
    codec = codecs[0] if len(codecs) == 1 else None
    if codec is None or not all(hasattr(codec, n) for n in SHARDING_MEMBERS):
        return None
    if not (callable(getattr(codec, "_decode_shard_index_sync", None))
            or callable(getattr(codec, "_decode_shard_index", None))):
        return None
    return codec


def shard_index_size(codec: Any, per_shard: tuple[int, ...]) -> int:
    return int(codec._shard_index_size(per_shard))


def inner_chunk_spec(codec: Any, shard_spec: Any) -> Any:
    return codec._get_chunk_spec(shard_spec)


async def decode_shard_index(codec: Any, raw: Any, per_shard: tuple[int, ...]) -> np.ndarray:
    """(offset, length) of every inner chunk of a shard, from the index's bytes (shape ``per_shard + (2,)``)."""
    buf = prototype().buffer.from_bytes(raw)
    sync = getattr(codec, "_decode_shard_index_sync", None)
    idx = sync(buf, per_shard) if callable(sync) else await codec._decode_shard_index(buf, per_shard)
    return np.asarray(idx.offsets_and_lengths)


def features() -> dict[str, bool]:
    """Which of zarr's ways this zarr has (what ``python -m xinsitu doctor`` reports)."""
    try:
        from zarr.codecs.numcodecs._codecs import _NumcodecsBytesBytesCodec  # noqa: F401
        wrapper = True
    except ImportError:
        wrapper = False
    from zarr.codecs import ShardingCodec

    return {"numcodecs_wrapper": wrapper, "shard_index_sync": hasattr(ShardingCodec, "_decode_shard_index_sync")}


def zarr_sync(coro: Any) -> Any:
    """Run ``coro`` on zarr's own event loop and return its result (``zarr.core.sync.sync``: the loop
    an fsspec store's client session is bound to)."""
    from zarr.core.sync import sync

    return sync(coro)
