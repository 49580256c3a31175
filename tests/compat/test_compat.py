"""Contract tests of the adapters to private API (``xinsitu.compat.zarr_api``, ``virtualizarr_api``, ``dask_api``).

Each private symbol xinsitu still uses is exercised here against the installed zarr / VirtualiZarr,
and its result checked against what the public API reads: a release that removes or changes one
fails here, naming it, and not deep inside a batch.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import xarray as xr
import zarr

from xinsitu.compat import zarr_api as compat_zarr

# numcodecs codecs inside zarr v3 metadata are what these contract tests exercise
pytestmark = pytest.mark.filterwarnings("ignore:Numcodecs codecs are not in the Zarr version 3")

DATA = (np.arange(8 * 6, dtype="float32").reshape(8, 6) * 0.5 - 3)


def _array(tmp_path, fmt: int = 3, **kw):
    path = str(tmp_path / f"a{fmt}.zarr")
    arr = zarr.create_array(path, shape=DATA.shape, chunks=(4, 3), dtype="float32", zarr_format=fmt,
                            fill_value=-9.0, **kw)
    arr[:] = DATA
    return zarr.open_array(path, mode="r")


def _raw(arr, key: str) -> bytes:
    buf = asyncio.run(arr.store.get(key, prototype=compat_zarr.prototype()))
    assert buf is not None, key
    return buf.to_bytes()


# ----------------------------------------------------------------------------- zarr
@pytest.mark.parametrize("fmt", [2, 3])
def test_stored_chunk_spec_is_the_array_spec_zarr_decodes_with(tmp_path, fmt):
    """``zarr.core.array_spec.ArraySpec``: the spec of one stored chunk, and the codecs decode with it."""
    arr = _array(tmp_path, fmt)
    spec = compat_zarr.stored_chunk_spec(arr.async_array)
    assert tuple(spec.shape) == (4, 3)
    assert np.dtype(spec.dtype.to_native_dtype()) == np.float32
    assert float(spec.fill_value) == -9.0
    key = arr.metadata.encode_chunk_key((1, 1))
    buf = compat_zarr.prototype().buffer.from_bytes(_raw(arr, key))
    (out,) = asyncio.run(arr.async_array.codec_pipeline.decode([(buf, spec)]))
    np.testing.assert_array_equal(np.asarray(out.as_ndarray_like()), DATA[4:8, 3:6])


def test_array_spec_with_another_dtype(tmp_path):
    spec = compat_zarr.stored_chunk_spec(_array(tmp_path).async_array)
    other = compat_zarr.array_spec((2, 2), zarr.dtype.parse_dtype(np.dtype("<i2"), zarr_format=3), 0,
                                   spec.config, spec.prototype)
    assert tuple(other.shape) == (2, 2) and np.dtype(other.dtype.to_native_dtype()) == np.int16


def test_parse_named_configuration():
    """``zarr.core.common.parse_named_configuration``: how the GRIB / NetCDF codecs read their JSON."""
    assert compat_zarr.parse_named_configuration({"name": "x", "configuration": {"a": 1}}, "x") == ("x", {"a": 1})
    name, cfg = compat_zarr.parse_named_configuration({"name": "x"}, "x", require_configuration=False)
    assert name == "x" and not cfg
    with pytest.raises(ValueError):
        compat_zarr.parse_named_configuration({"name": "y", "configuration": {}}, "x")


def test_numcodecs_wrapper_gives_its_numcodec(tmp_path):
    """``zarr.codecs.numcodecs._codecs._NumcodecsBytesBytesCodec`` and its ``_codec``."""
    import numcodecs
    import zarr.codecs.numcodecs as znc

    arr = _array(tmp_path, 3, compressors=[znc.Zlib(level=1)])
    (codec,) = arr.async_array.codec_pipeline.bytes_bytes_codecs
    inner = compat_zarr.numcodecs_bytes_codec(codec)
    assert isinstance(inner, numcodecs.Zlib)
    raw = _raw(arr, arr.metadata.encode_chunk_key((0, 0)))
    np.testing.assert_array_equal(np.frombuffer(inner.decode(raw), "<f4").reshape(4, 3), DATA[:4, :3])
    assert compat_zarr.numcodecs_bytes_codec(zarr.codecs.ZstdCodec()) is None


def test_outer_codec_is_the_one_that_decodes_the_stored_bytes_first(tmp_path):
    """v3: the last bytes -> bytes codec; v2: the compressor of zarr's ``V2Codec`` (the chunk decoder checks a
    blosc frame's length there: blosc decodes one cut short without an error)."""
    import numcodecs

    v3 = _array(tmp_path / "v3", 3, compressors=[zarr.codecs.ZstdCodec(), zarr.codecs.BloscCodec()])
    assert type(compat_zarr.outer_codec(v3.async_array.codec_pipeline)).__name__ == "BloscCodec"
    v2 = _array(tmp_path / "v2", 2, compressors=[numcodecs.Blosc()])
    assert isinstance(compat_zarr.outer_codec(v2.async_array.codec_pipeline), numcodecs.Blosc)
    bare = _array(tmp_path / "bare", 3, compressors=None)
    assert compat_zarr.outer_codec(bare.async_array.codec_pipeline) is None


def test_sync_decodable():
    """``_decode_sync`` (``zarr.abc.codec.SupportsSyncCodec``) on the codecs xinsitu decodes in one call."""
    for codec in (zarr.codecs.BytesCodec(), zarr.codecs.ZstdCodec(), zarr.codecs.Crc32cCodec(),
                  zarr.codecs.BloscCodec(), zarr.codecs.GzipCodec()):
        assert compat_zarr.sync_decodable(codec), type(codec).__name__


def test_sharding_members(tmp_path):
    """The sharding codec's ``_shard_index_size``, ``_get_chunk_spec`` and ``_decode_shard_index(_sync)``:
    an inner chunk found by the index decodes to what zarr reads."""
    path = str(tmp_path / "s.zarr")
    arr = zarr.create_array(path, shape=DATA.shape, chunks=(2, 3), shards=(4, 6), dtype="float32",
                            compressors=[zarr.codecs.ZstdCodec()], fill_value=0.0)
    arr[:] = DATA
    arr = zarr.open_array(path, mode="r")
    aa = arr.async_array
    codec = compat_zarr.sharding_codec(aa)
    assert codec is not None
    shard_spec = compat_zarr.stored_chunk_spec(aa)
    assert tuple(shard_spec.shape) == (4, 6)
    inner = compat_zarr.inner_chunk_spec(codec, shard_spec)
    assert tuple(inner.shape) == (2, 3)
    per_shard = (2, 2)
    size = compat_zarr.shard_index_size(codec, per_shard)
    assert size == 2 * 2 * 16 + 4  # (offset, length) uint64 per inner chunk, crc32c
    raw = _raw(arr, arr.metadata.encode_chunk_key((1, 0)))
    at_end = str(getattr(codec.index_location, "value", codec.index_location)) == "end"
    index = asyncio.run(compat_zarr.decode_shard_index(codec, raw[-size:] if at_end else raw[:size], per_shard))
    assert index.shape == (2, 2, 2)
    off, length = (int(v) for v in index[1, 0])
    buf = compat_zarr.prototype().buffer.from_bytes(raw[off:off + length])
    (out,) = asyncio.run(codec.codec_pipeline.decode([(buf, inner)]))
    np.testing.assert_array_equal(np.asarray(out.as_ndarray_like()), DATA[6:8, 0:3])


def test_features_and_decode_path():
    from xinsitu.codecs.cpu import decode_path

    feats = compat_zarr.features()
    assert set(feats) == {"numcodecs_wrapper", "shard_index_sync"}
    assert all(isinstance(v, bool) for v in feats.values())
    assert feats["numcodecs_wrapper"], "zarr's numcodecs wrapper moved: NetCDF4 deflate decodes slower"
    assert "shard index" in decode_path()


# ----------------------------------------------------------------------------- VirtualiZarr
@pytest.fixture(scope="module")
def nc_files(tmp_path_factory):
    pytest.importorskip("virtualizarr", reason="the virtual extra is not installed")
    d = tmp_path_factory.mktemp("nc")
    files = []
    for i in range(2):
        ds = xr.Dataset({"t": (("time", "x"), DATA[4 * i:4 * i + 4])},
                        coords={"time": np.arange(4 * i, 4 * i + 4), "x": np.arange(6)})
        p = str(d / f"f{i}.nc")
        ds.to_netcdf(p, engine="h5netcdf", encoding={"t": {"chunksizes": (2, 6), "zlib": True}})
        files.append(p)
    return files


def _parsed(path):
    import obstore.store
    from obspec_utils.registry import ObjectStoreRegistry
    from virtualizarr.parsers import HDFParser

    url = "file://" + path
    registry = ObjectStoreRegistry({"file://": obstore.store.LocalStore()})
    return url, HDFParser()(url, registry)


def test_manifest_store_group_and_registry(nc_files):
    """``ManifestStore._group`` and ``._registry``."""
    from xinsitu.compat import virtualizarr_api as cv

    url, store = _parsed(nc_files[0])
    assert cv.is_manifest_store(store)
    group = cv.manifest_group(store)
    assert {"t", "time", "x"} <= set(group.arrays)
    obs, path = cv.manifest_registry(store).resolve(url)
    assert obs is not None and path.endswith("f0.nc")


def test_chunk_shape_and_concat_manifests(nc_files):
    """``ChunkManifest._paths`` / ``_offsets`` / ``_lengths`` (``_inlined`` where it exists), joined."""
    from xinsitu.compat import virtualizarr_api as cv

    arrs = [cv.manifest_group(_parsed(p)[1]).arrays["t"] for p in nc_files]
    assert cv.chunk_shape(arrs[0]) == (2, 6)
    joined = cv.concat_manifests([a.manifest for a in arrs], axis=0)
    assert joined.shape_chunk_grid == (4, 1)
    for i, a in enumerate(arrs):
        for j in range(2):
            assert joined.get_entry((2 * i + j, 0)) == a.manifest.get_entry((j, 0))


def test_expand_manifest(nc_files):
    """``ChunkManifest._paths`` / ``_offsets`` / ``_lengths`` (``_inlined`` where it exists), given an axis of 1."""
    from xinsitu.compat import virtualizarr_api as cv

    m = cv.manifest_group(_parsed(nc_files[0])[1]).arrays["t"].manifest
    for axis in (0, 1, 2):
        out = cv.expand_manifest(m, axis)
        grid = list(m.shape_chunk_grid)
        grid.insert(axis, 1)
        assert out.shape_chunk_grid == tuple(grid)
        for j in range(2):
            idx = [j, 0]
            idx.insert(axis, 0)
            assert out.get_entry(tuple(idx)) == m.get_entry((j, 0))


def test_hdf5_variable_manifest(nc_files):
    """``virtualizarr.parsers.hdf.hdf._construct_manifest_array``: one HDF5 dataset alone."""
    import h5py

    from xinsitu.compat import virtualizarr_api as cv

    with h5py.File(nc_files[1], "r") as f:
        arr = cv.hdf5_variable_manifest("file://" + nc_files[1], f["t"], "/")
    assert tuple(arr.shape) == (4, 6) and cv.chunk_shape(arr) == (2, 6)


def test_zarr_sync_runs_on_zarrs_own_loop():
    """``zarr.core.sync.sync`` (the loop an fsspec store's session is bound to; zarr_backend.home_loop)."""
    import asyncio

    from xinsitu.compat.zarr_api import zarr_sync

    async def here() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    loop = zarr_sync(here())
    assert isinstance(loop, asyncio.AbstractEventLoop) and loop is zarr_sync(here())


def test_dask_task_spec_runs_a_graph_of_selections():
    """``xinsitu.compat.dask_api``: the installed dask (the dev environments' is newer than 2024.12) has its task
    spec, and a chunked array's graph converts to tasks that name their dependencies and run with their values:
    what ``xinsitu.index.dask_trace`` relies on (where this fails, the tracing falls back to ``dask.get``)."""
    da = pytest.importorskip("dask.array")
    from dask.core import flatten

    from xinsitu.compat.dask_api import task_spec

    spec = task_spec()
    assert spec is not None, "dask has no dask._task_spec: xinsitu traces dask graphs with dask.get (4x slower)"
    DataNode, GraphNode, convert_legacy_graph = spec
    x = da.from_array(np.arange(12).reshape(6, 2), chunks=(2, 2))[::-1]
    nodes = convert_legacy_graph(dict(x.__dask_graph__()))
    assert all(isinstance(n, GraphNode) for n in nodes.values())
    done: dict = {}

    def value(k):
        if k not in done:
            node = nodes[k]
            done[k] = node({d: value(d) for d in node.dependencies})
        return done[k]

    blocks = [value(k) for k in flatten(x.__dask_keys__())]
    np.testing.assert_array_equal(np.concatenate(blocks), np.arange(12).reshape(6, 2)[::-1])
    assert DataNode("k", 3)({}) == 3


def test_keeps_chunks_inline_is_what_the_manifest_does(nc_files):
    """``keeps_chunks_inline()`` (the ragged-variable message's "upgrade" advice) says whether a ``ChunkManifest``
    holds chunks itself (``_inlined``), found by feature, not by version string."""
    from virtualizarr.manifests import ChunkManifest

    from xinsitu.compat import virtualizarr_api as cv

    m = ChunkManifest({"0": {"path": "file:///x.nc", "offset": 0, "length": 1}})
    assert cv.keeps_chunks_inline() == hasattr(m, "_inlined")
