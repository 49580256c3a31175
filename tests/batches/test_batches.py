"""Oracle tests: every batch of an epoch equals plain xarray's values for its samples."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

import xinsitu
from tests.conftest import assert_batch_equal, open_three_ways, oracle

OUTPUTS = ["xarray", "numpy", "torch"]


def epoch_ids(gen) -> list[np.ndarray]:
    return gen.batch_ids()


def check_epoch(ds: xr.Dataset, gen, output: str, variables=None) -> int:
    """Run one epoch and compare every batch with the oracle; return the samples seen."""
    sel = ds if variables is None else ds[variables]
    dims = gen.manifest.dims
    n = 0
    batches = list(gen)
    ids = gen.batch_ids()
    assert len(batches) == len(ids) == len(gen)
    for b, i in zip(batches, ids, strict=True):
        starts = np.concatenate([gen.space.unit_starts(int(u))[[int(k)]] for u, k in zip(*gen.space.locate(i),
                                                                                       strict=True)])
        ref = oracle(sel[list(gen.layouts)], dims, starts[:, : len(dims)])
        assert_batch_equal(b, ref, output)
        n += len(i)
    return n


@pytest.mark.parametrize("how", ["xinsitu", "xr_nodask", "xr_dask"])
@pytest.mark.parametrize("output", OUTPUTS)
@pytest.mark.slow
def test_epoch_matches_xarray(era5_path, how, output):
    ds = open_three_ways(era5_path)[how]
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1}, gap=1)
    gen = ds.insitu.batches(m, "train", batch_size=7, output=output, block_chunks=3)
    n = check_epoch(ds, gen, output)
    assert n == m.positions("train")


@pytest.mark.parametrize(
    "subset",
    [
        lambda d: d[["t2m", "tp"]],
        lambda d: d.isel(lat=slice(1, 5)),
        lambda d: d.isel(lon=[0, 3, 4, 9]),
        lambda d: d.sel(time=slice("1979-01-03", "1979-01-28")),
        lambda d: d.isel(time=slice(3, 100)),  # starts mid-chunk: first partial chunk is its own block
        lambda d: d.isel(time=slice(0, 100, 2)),
        lambda d: d.isel(lat=2),  # scalar selection drops a dim
    ],
    ids=["vars", "isel_lat", "isel_lon_list", "sel_time", "mid_chunk", "step", "scalar"],
)
@pytest.mark.parametrize("how", ["xinsitu", "xr_dask"])
@pytest.mark.slow
def test_subsets_match_xarray(era5_path, subset, how):
    ds = subset(open_three_ways(era5_path)[how])
    m = ds.insitu.split("time", fractions={"train": 0.7, "val": 0.3})
    for split in m.splits:
        gen = ds.insitu.batches(m, split, batch_size=5, output="numpy", block_chunks=2, seed=3)
        assert check_epoch(ds, gen, "numpy") == m.positions(split)


def test_v2_archive(era5_v2_path):
    ds = xinsitu.open_zarr(era5_v2_path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "val", batch_size=16, output="xarray")
    assert check_epoch(ds, gen, "xarray") == m.positions("val")


def test_cf_decoding_bit_identical(era5_path):
    """tp is int16 with scale/offset/_FillValue: decoded exactly as xarray does, NaNs included."""
    ds = xinsitu.open_zarr(era5_path)
    assert ds.tp.encoding["dtype"] == np.dtype("int16")
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", batch_size=64, output="numpy", shuffle=False, variables=["tp"])
    got = np.concatenate([b["tp"] for b in gen])
    ref = ds.tp.isel(time=slice(0, len(got))).values
    assert got.dtype == ref.dtype
    assert np.isnan(got).any(), "the fixture must contain missing values"
    assert np.array_equal(got, ref, equal_nan=True)


def test_in_memory_dataset(era5_path):
    mem = xr.open_zarr(era5_path).load()
    for v in mem.variables.values():
        v.encoding = {}
    m = mem.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    # without chunk encoding every position is its own chunk
    assert m.grid == (mem.sizes["time"],)
    gen = mem.insitu.batches(m, "train", batch_size=9, output="xarray")
    assert check_epoch(mem, gen, "xarray") == mem.sizes["time"] // 2


def test_dask_memory_dataset_uses_dask_chunks(era5_path):
    mem = xr.open_zarr(era5_path).load().chunk(time=10)
    m = mem.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    assert m.edges["time"][:3].tolist() == [0, 10, 20]
    gen = mem.insitu.batches(m, "val", batch_size=9, output="numpy")
    check_epoch(mem, gen, "numpy")


def test_static_variable_kept_whole(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", batch_size=4, variables=["t2m", "lsm"], output="xarray")
    b = next(iter(gen))
    assert b.lsm.dims == ("lat", "lon")
    assert b.t2m.dims == ("sample", "lat", "lon")
    np.testing.assert_array_equal(b.lsm.values, ds.lsm.values)
    # by default only variables on the split dim are batched
    assert set(next(iter(ds.insitu.batches(m, "train", batch_size=4, output="numpy")))) == {
        "t2m", "u10", "v10", "z500", "tp"}


@pytest.mark.parametrize("shuffle", [True, False])
def test_order_independent_of_inflight(era5_path, shuffle):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    runs = []
    for inflight in (1, 3, 64):
        gen = ds.insitu.batches(m, "train", batch_size=6, output="numpy", shuffle=shuffle, seed=5,
                                max_inflight=inflight, block_chunks=4)
        runs.append([b["t2m"] for b in gen])
    for other in runs[1:]:
        assert len(other) == len(runs[0])
        for a, b in zip(runs[0], other, strict=True):
            np.testing.assert_array_equal(a, b)


def test_unshuffled_walks_in_order(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", batch_size=10, output="xarray", shuffle=False)
    times = np.concatenate([b.time.values for b in gen])
    np.testing.assert_array_equal(times, ds.time.values[: len(times)])


def test_epochs_differ_and_repeat(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    gen = ds.insitu.batches(m, "train", batch_size=8, output="xarray")
    e0 = np.concatenate([b.time.values for b in gen])
    again = np.concatenate([b.time.values for b in gen])
    np.testing.assert_array_equal(e0, again)  # no set_epoch: same order, like DistributedSampler
    gen.set_epoch(1)
    e1 = np.concatenate([b.time.values for b in gen])
    assert not np.array_equal(e0, e1)
    assert np.array_equal(np.sort(e0), np.sort(e1))
    for bad, error in ((True, TypeError), (1.0, TypeError), (-1, ValueError)):  # (True was epoch 1)
        with pytest.raises(error, match="epoch must be"):
            gen.set_epoch(bad)


def test_each_chunk_read_once_per_epoch(era5_path):
    ds = xinsitu.open_zarr(era5_path)[["t2m", "u10"]]
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    gen = ds.insitu.batches(m, "train", batch_size=5, output="numpy", block_chunks=3)
    for _ in gen:
        pass
    assert gen.io_stats["chunks"] == 2 * len(m.splits["train"])
    assert gen.io_stats["samples"] == m.positions("train")


def test_drop_last(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    n = m.positions("train")
    gen = ds.insitu.batches(m, "train", batch_size=7, output="numpy", drop_last=True)
    sizes = [len(b["t2m"]) for b in gen]
    assert sizes == [7] * (n // 7) and len(gen) == n // 7


def test_sample_inspection(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "val", batch_size=4)
    s = gen.sample(3)
    first = m.edges["time"][m.splits["val"][0]]
    xr.testing.assert_identical(s, ds[list(gen.layouts)].isel(time=first + 3).load())


def test_sample_inspection_of_a_tile(era5_path):
    """A tile keeps its lat/lon indexes, as ``isel`` does (they came back as coordinates without one)."""
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "val", batch_size=4, patch={"lat": 3, "lon": 5}, shuffle=False)
    s = gen.sample(0)
    first = m.edges["time"][m.splits["val"][0]]
    ref = ds[list(gen.layouts)].isel(time=first, lat=slice(0, 3), lon=slice(0, 5)).load()
    xr.testing.assert_identical(s, ref)
    assert set(s.indexes) == {"lat", "lon"}


def test_break_stops_cleanly(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    gen = ds.insitu.batches(m, "train", batch_size=2, output="numpy", block_chunks=1)
    for i, _ in enumerate(gen):
        if i == 2:
            break
    # the generator is reusable afterwards and still yields a full epoch
    assert sum(len(b["t2m"]) for b in gen) == m.positions("train")


def test_after_xarray_cached_values(era5_path):
    """Once xarray has loaded (and cached) a variable, it is read from memory: same batches."""
    ds = xinsitu.open_zarr(era5_path)
    float(ds.t2m.mean())  # loads and caches t2m in xarray's MemoryCachedArray
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", batch_size=8, output="numpy")
    assert check_epoch(ds, gen, "numpy") == m.positions("train")


def test_gpu_outputs_fail_clearly_without_cuda(era5_path):
    """No silent CPU fallback: without CUDA, device/cupy options raise and say why."""
    torch = pytest.importorskip("torch", reason="torch is not installed")

    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            ds.insitu.batches(m, "train", output="torch", device="cuda")
    try:
        import cupy  # noqa: F401

        has_cupy = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        has_cupy = False
    if not has_cupy:
        with pytest.raises(RuntimeError, match="cupy|CuPy|CUDA"):
            ds.insitu.batches(m, "train", output="cupy")
    with pytest.raises(ValueError, match="applies to output='torch'"):
        ds.insitu.batches(m, "train", output="numpy", device="cuda")
