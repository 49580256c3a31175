"""Session archives written once to tmp_path_factory, and the oracle helpers."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import xarray as xr

import xinsitu
from xinsitu.synthetic import write_era5_like

warnings.filterwarnings("ignore", message=".*[Cc]onsolidated metadata.*")

NT, NY, NX, CT = 120, 6, 10, 8


@pytest.fixture(scope="session")
def era5_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Zarr v3, time chunks of 8 (last one partial), int16-packed ``tp`` with missing values."""
    path = str(tmp_path_factory.mktemp("archives") / "era5.zarr")
    write_era5_like(path, nt=NT, ny=NY, nx=NX, chunk_time=CT)
    return path


@pytest.fixture(scope="session")
def era5_v2_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("archives") / "era5_v2.zarr")
    write_era5_like(path, nt=NT, ny=NY, nx=NX, chunk_time=CT, zarr_format=2)
    return path


def open_three_ways(path: str) -> dict[str, xr.Dataset]:
    return {
        "xinsitu": xinsitu.open_zarr(path),
        "xr_nodask": xr.open_zarr(path, chunks=None),
        "xr_dask": xr.open_zarr(path),
    }


def oracle(ds: xr.Dataset, split_dims: list[str], starts: np.ndarray) -> xr.Dataset:
    """What plain xarray gives for samples at ``starts`` (one row per sample)."""
    ind = {d: xr.DataArray(starts[:, k], dims="sample") for k, d in enumerate(split_dims)}
    return ds.isel(ind).transpose("sample", ...).load()


def assert_batch_equal(batch, ref: xr.Dataset, output: str) -> None:
    """Bit-identity (NaN == NaN) of a batch with the oracle, per output kind."""
    if output == "xarray":
        xr.testing.assert_identical(batch, ref)
        return
    assert set(batch) == set(ref.data_vars)
    for v in ref.data_vars:
        got = batch[v].numpy() if output == "torch" else batch[v]
        exp = ref[v].values
        assert got.dtype == exp.dtype, (v, got.dtype, exp.dtype)
        assert got.shape == exp.shape, (v, got.shape, exp.shape)
        assert np.array_equal(got, exp, equal_nan=True), v


def pytest_collection_modifyitems(config, items):
    """Where torch is not installed (Python 3.12+ in CI: the CPU build is pinned for 3.11 only), the
    cases of a test parametrized with ``output="torch"`` are skipped, and say why."""
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        return
    skip = pytest.mark.skip(reason="torch is not installed")
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("output") == "torch":
            item.add_marker(skip)
