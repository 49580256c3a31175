"""fsspec stores for real: ``xr.open_zarr("http://127.0.0.1:PORT/...")`` (fsspec's HTTP filesystem, aiohttp)
and ``s3://`` through s3fs against moto, with and without dask: every batch equals plain xarray's
values for its samples, bit for bit, and the map-style dataset's items equal those read from disk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import xarray as xr

import xinsitu
from tests.support.servers import FileServer, MotoS3, write_archive
from tests.test_sampling import run_epoch

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
def test_fsspec_http_store_reads_like_xarray(http, archive, chunks):
    ds = xr.open_zarr(f"{http.url}/era5.zarr", chunks=chunks)
    _check(ds, archive)


@pytest.mark.parametrize("chunks", [None, {}], ids=["nodask", "dask"])
def test_s3fs_store_reads_like_xarray(archive, chunks):
    pytest.importorskip("s3fs", reason="s3fs (the dev extra) is not installed here")
    with MotoS3() as srv:
        srv.upload(archive, "fsspec-bucket", "era5.zarr")
        opts = {"key": srv.access_key_id, "secret": srv.secret_access_key,
                "client_kwargs": {"endpoint_url": srv.endpoint, "region_name": srv.region}}
        ds = xr.open_zarr("s3://fsspec-bucket/era5.zarr", chunks=chunks, storage_options=opts)
        _check(ds, archive)
