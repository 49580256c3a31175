"""fsspec stores for real: ``xr.open_zarr("http://127.0.0.1:PORT/...")`` (fsspec's HTTP filesystem, aiohttp)
and ``s3://`` through s3fs against moto, with and without dask: every batch equals plain xarray's
values for its samples, bit for bit, and the map-style dataset's items equal those read from disk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import xarray as xr

import xinsitu
from tests.index.test_sampling import run_epoch
from tests.support.servers import Faults, FileServer, MotoS3, assert_same_epoch, epoch_numpy, write_archive

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_archive(tmp_path_factory.mktemp("fsspec") / "era5.zarr")


@pytest.fixture(scope="module")
def http(archive: str):
    with FileServer(Path(archive).parent) as srv:
        yield srv


def _check(ds: xr.Dataset, archive: str) -> None:
    m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25}, gap=1)
    gen = ds.insitu.batches(m, "train", batch_size=10, block_chunks=2, output="numpy", seed=3)
    seen = run_epoch(ds, gen, "numpy")  # each batch against ds.isel(...) of the same Dataset
    assert np.array_equal(np.sort(seen), np.arange(gen.n_samples))
    ref = xinsitu.open_zarr(archive).insitu.dataset(m, "val", output="numpy")
    got = ds.insitu.dataset(m, "val", output="numpy")
    for i in (0, len(got) - 1):
        a, b = got[i], ref[i]
        assert set(a) == set(b)
        for v in a:
            assert a[v].dtype == b[v].dtype and np.array_equal(a[v], b[v], equal_nan=True), v


@pytest.mark.parametrize("chunks", [None, {}], ids=["nodask", "dask"])
@pytest.mark.slow
def test_fsspec_http_store_reads_like_xarray(http, archive, chunks):
    ds = xr.open_zarr(f"{http.url}/era5.zarr", chunks=chunks)
    _check(ds, archive)


def s3fs_opened(srv: MotoS3, url: str, **kw) -> xr.Dataset:
    """``xr.open_zarr(url)`` through s3fs, against the moto server ``srv``."""
    pytest.importorskip("s3fs", reason="s3fs (the dev extra) is not installed here")
    opts = {"key": srv.access_key_id, "secret": srv.secret_access_key,
            "client_kwargs": {"endpoint_url": srv.endpoint, "region_name": srv.region}}
    return xr.open_zarr(url, storage_options=opts, **kw)


@pytest.mark.parametrize("chunks", [None, {}], ids=["nodask", "dask"])
@pytest.mark.slow
def test_s3fs_store_reads_like_xarray(archive, chunks):
    pytest.importorskip("s3fs", reason="s3fs (the dev extra) is not installed here")
    with MotoS3() as srv:
        srv.upload(archive, "fsspec-bucket", "era5.zarr")
        _check(s3fs_opened(srv, "s3://fsspec-bucket/era5.zarr", chunks=chunks), archive)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> str:
    from xinsitu.synthetic import write_era5_like

    path = tmp_path_factory.mktemp("fsspec_sharded") / "sharded.zarr"
    write_era5_like(str(path), nt=40, ny=6, nx=8, chunk_time=4, shard_time=16)
    return str(path)


def cached_twice(ds: xr.Dataset) -> tuple[dict, dict]:
    """Two epochs of ``ds`` with a memory cache, each equal to plain xarray: their ``io_stats``."""
    m = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", batch_size=8, shuffle=False, output="numpy", cache=True)
    stats = []
    for epoch in (0, 1):
        gen.set_epoch(epoch)
        for batch, ids in zip(gen, gen.batch_ids(), strict=True):
            for v, a in batch.items():
                np.testing.assert_array_equal(a, ds[v].isel(time=ids).values)
        stats.append(gen.io_stats)
    return stats[0], stats[1]


@pytest.mark.parametrize("kind", ["http", "s3"])
@pytest.mark.slow
def test_a_sharded_archive_over_fsspec_reads_like_xarray(sharded, kind):
    """A sharded array's inner chunks are read by byte range through the fsspec store's own ``get``, on
    zarr's loop, where the fsspec session lives (on xinsitu's loop every read failed, naming chunk ()):
    equal to xarray, counted in ``io_stats`` and kept by the cache (zarr read them for xinsitu before,
    uncached and counting 0 bytes)."""
    if kind == "http":
        with FileServer(Path(sharded).parent) as srv:
            ds = xr.open_zarr(f"{srv.url}/sharded.zarr", chunks=None)
            _check(ds, sharded)
            first, second = cached_twice(ds)
    else:
        pytest.importorskip("s3fs", reason="s3fs (the dev extra) is not installed here")
        with MotoS3() as srv:
            srv.upload(sharded, "sharded-bucket", "sharded.zarr")
            ds = s3fs_opened(srv, "s3://sharded-bucket/sharded.zarr", chunks=None)
            _check(ds, sharded)
            first, second = cached_twice(ds)
    assert first["bytes_read"] > 0 and first["cache_misses"] == first["chunks"] > 0, first
    assert second["cache_hits"] == second["chunks"] == first["chunks"] and second["requests"] == 0, second


CHUNKS = r"/(t2m|u10|v10|z500|tp|lsm)/c/"  # data chunk objects (not metadata, not coordinates)


@pytest.mark.parametrize("kind", ["error_503", "truncate", "reset"])
@pytest.mark.parametrize("opener", ["xr", "xinsitu"])
@pytest.mark.slow
def test_fsspec_store_rides_out_transient_faults(archive, kind, opener):
    """SPEC 5: transient faults are retried whatever the store. Through fsspec's HTTP filesystem
    (``xr.open_zarr(URL)``, or ``xinsitu.open_zarr`` of that ``FsspecStore``), every chunk answered
    with a 503 or a cut body once, or with a reset connection twice (aiohttp itself makes a request
    on a reused connection again, once): the epoch equals the local one (it failed with
    ``ChunkReadError`` at the first fault)."""
    import zarr.storage

    m = xinsitu.open_zarr(archive).insitu.split("time", fractions={"train": 1.0})
    kw = {"batch_size": 10, "block_chunks": 3, "output": "numpy", "seed": 3}
    ref = epoch_numpy(xinsitu.open_zarr(archive).insitu.batches(m, "train", **kw))
    per_key = 2 if kind == "reset" else 1
    with FileServer(Path(archive).parent, Faults(**{kind: 1.0}, max_per_key=per_key, pattern=CHUNKS)) as srv:
        url = f"{srv.url}/era5.zarr"
        if opener == "xr":
            ds = xr.open_zarr(url, chunks=None)
        else:
            ds = xinsitu.open_zarr(zarr.storage.FsspecStore.from_url(url, read_only=True))
        got = epoch_numpy(ds.insitu.batches(m, "train", **kw))
        assert srv.counts[kind] >= 12, srv.counts  # every chunk met its fault once
    assert_same_epoch(got, ref)


@pytest.mark.slow
def test_fsspec_store_names_a_chunk_that_keeps_failing(archive, monkeypatch):
    """A chunk answered 503 every time, through fsspec: retried (with backoff), then
    ``ChunkReadError`` naming the variable, the chunk and the key; a 403 is an answer, not retried."""
    from xinsitu.stores import reads as store_reads

    monkeypatch.setattr(store_reads, "BACKOFF_S", (0.001, 0.01))
    m = xinsitu.open_zarr(archive).insitu.split("time", fractions={"train": 1.0})
    kw = {"batch_size": 10, "block_chunks": 24, "output": "numpy", "seed": 3}
    for status, tries in ((503, 1 + store_reads.RETRIES), (403, 1)):
        faults = Faults(always=r"/t2m/c/0/", always_status=status)
        with FileServer(Path(archive).parent, faults) as srv:
            gen = xr.open_zarr(f"{srv.url}/era5.zarr", chunks=None).insitu.batches(m, "train", **kw)
            with pytest.raises(xinsitu.ChunkReadError) as err:
                list(gen)
            assert err.value.var == "t2m" and err.value.key == "t2m/c/0/0/0", str(err.value)
            assert str(status) in str(err.value), str(err.value)
            assert srv.counts["always"] == tries, (status, srv.counts)


@pytest.mark.slow
def test_a_script_ends_quietly_after_an_epoch_on_an_fsspec_store(http):
    """A script that reads an epoch over ``xr.open_zarr("http://...")`` and ends, the next epoch's first
    reads still under way on zarr's loop: no "Event loop is closed" or "Task was destroyed" traceback
    (zarr's exit handler closed its loop before xinsitu's cancelled the reads there)."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import xarray as xr, xinsitu
        ds = xr.open_zarr({http.url + "/era5.zarr"!r})
        m = ds.insitu.split("time", fractions={{"train": 1.0}})
        gen = ds.insitu.batches(m, "train", batch_size=4, block_chunks=2, output="numpy")
        print("batches", sum(1 for _ in gen), flush=True)
    """)
    root = Path(__file__).parents[2]
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0 and "batches" in out.stdout, out.stderr[-3000:]
    for noise in ("Event loop is closed", "Task was destroyed", "Traceback"):
        assert noise not in out.stderr, out.stderr[-3000:]
