"""Dask-backed Datasets over files that are not Zarr (``xr.open_dataset(nc, chunks=...)``,
``xr.open_mfdataset``) and lazily opened NetCDF/GRIB files.

SPEC §1: such a Dataset is never loaded whole behind the user's back. Geometry and splits
come from the dask chunks with no dask task run; batches compute only the dask chunks of
the blocks they draw from (each once per epoch), values bit-identical to ``ds.isel``; where
that is impossible, the error names ``xinsitu.virtual.open_netcdf`` / ``open_grib``.
Dask tasks are counted with a ``dask.callbacks.Callback``, memory with ``tracemalloc``.
"""

from __future__ import annotations

import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from dask.callbacks import Callback

import xinsitu
from tests.conftest import assert_batch_equal, oracle
from xinsitu.index.source import SourceError

NT, NY, NX, CT = 768, 32, 48, 8  # 2 variables of 4.7 MB each; a dask chunk is 49 kB
VARS = ["t2m", "u10"]


class TaskLog(Callback):
    """Every dask compute and task that runs while active (any thread, any local scheduler)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: list = []
        self.starts: list = []
        self.shapes: list[tuple[int, ...]] = []

    def _start(self, dsk) -> None:  # noqa: ANN001 - dask's signature
        self.starts.append(len(dsk))

    def _posttask(self, key, result, dsk, state, worker_id) -> None:  # noqa: ANN001 - dask's signature
        self.keys.append(key)
        if isinstance(result, np.ndarray):
            self.shapes.append(result.shape)

    def check_reads(self, n_chunks: int, chunk_len: int = CT) -> None:
        """``n_chunks`` computes, each of one dask chunk along time at most (so none read more)."""
        assert len(self.starts) == n_chunks, f"{len(self.starts)} dask computes for {n_chunks} chunks"
        assert self.shapes and max(s[0] for s in self.shapes) <= chunk_len, "a compute spanned several chunks"


def _data(nt: int = NT) -> xr.Dataset:
    rng = np.random.default_rng(0)
    time = np.datetime64("2000-01-01", "ns") + np.arange(nt) * np.timedelta64(6, "h")
    return xr.Dataset(
        {v: (("time", "lat", "lon"), rng.standard_normal((nt, NY, NX), dtype=np.float32)) for v in VARS},
        coords={"time": time, "lat": np.linspace(90, -90, NY), "lon": np.linspace(0, 360, NX, endpoint=False)},
    )


@pytest.fixture(scope="module")
def nc_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("nc") / "era.nc")
    _data().to_netcdf(path, engine="netcdf4", encoding={v: {"chunksizes": (CT, NY, NX)} for v in VARS})
    return path


@pytest.fixture(scope="module")
def nc_pair(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    d = tmp_path_factory.mktemp("ncpair")
    ds = _data()
    paths = [str(d / "a.nc"), str(d / "b.nc")]
    ds.isel(time=slice(0, NT // 2)).to_netcdf(paths[0])
    ds.isel(time=slice(NT // 2, None)).to_netcdf(paths[1])
    return paths


def _epoch(ds: xr.Dataset, m, split: str, **kw) -> tuple[list, object]:
    gen = ds.insitu.batches(m, split, variables=VARS, batch_size=16, block_chunks=2, output="xarray", seed=0,
                            **kw)
    return list(gen), gen


def _check_values(ds: xr.Dataset, batches: list) -> int:
    """Every batch equals plain xarray at the same samples; returns the number of samples."""
    n = 0
    for b in batches:
        pos = ds.indexes["time"].get_indexer(b.time.values)
        assert (pos >= 0).all()
        assert_batch_equal(b, oracle(ds[VARS], ["time"], pos[:, None]), "xarray")
        n += len(pos)
    return n


# ---------------------------------------------------------------------- one NetCDF file, dask chunks
def test_netcdf_geometry_and_split_compute_nothing(nc_path):
    ds = xr.open_dataset(nc_path, chunks={"time": CT})
    nbytes = sum(ds[v].nbytes for v in VARS)
    tracemalloc.start()
    try:
        with TaskLog() as log:
            chunks = ds.insitu.chunks
            geo = ds.insitu.geometry
            m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
            m2 = ds.insitu.split("time", ranges={"train": slice(None, "2000-02-01"), "val": slice("2000-02-03", None)})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert log.keys == [], f"{len(log.keys)} dask tasks ran for chunks/geometry/split"
    assert peak < nbytes / 4, f"peak {peak} B: the file was loaded ({nbytes} B of variables)"
    assert chunks == {"time": CT, "lat": NY, "lon": NX}
    assert geo.variables["t2m"].nchunks == NT // CT
    assert len(m.blocks("val")) == NT // CT // 4
    assert len(m2.blocks("val"))


def test_netcdf_batches_read_only_needed_chunks_once(nc_path):
    ds = xr.open_dataset(nc_path, chunks={"time": CT})
    m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
    with TaskLog() as log:
        batches, _ = _epoch(ds, m, "val", shuffle=True)
    log.check_reads(len(VARS) * len(m.blocks("val")))  # each chunk of the split once, nothing else
    assert _check_values(ds, batches) == m.positions("val")
    assert len({t for b in batches for t in b.time.values}) == m.positions("val")  # exactly once


def _epoch_peak(ds: xr.Dataset, block_chunks: int) -> tuple[int, int]:
    """(samples, peak traced bytes) of a training epoch (3/4 of the file), batches dropped as they come."""
    m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
    kw = dict(variables=VARS, batch_size=16, block_chunks=block_chunks, output="numpy", seed=0)
    next(iter(ds.insitu.batches(m, "val", **kw)))  # imports and first-use set-up are not what is measured
    tracemalloc.start()
    try:
        gen = ds.insitu.batches(m, "train", **kw)
        n = sum(len(b["t2m"]) for b in gen)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == m.positions("train")
    return n, peak


@pytest.mark.parametrize("block_chunks", [2, 4])
@pytest.mark.slow
def test_netcdf_epoch_memory_bounded_as_zarr(nc_path, tmp_path, block_chunks):
    """An epoch holds a few shuffle blocks (as many as from a Zarr copy of the file), never the file."""
    ds = xr.open_dataset(nc_path, chunks={"time": CT})
    nbytes = sum(ds[v].nbytes for v in VARS)
    ds.to_zarr(tmp_path / "copy.zarr")
    _, peak = _epoch_peak(ds, block_chunks)
    _, peak_zarr = _epoch_peak(xinsitu.open_zarr(tmp_path / "copy.zarr"), block_chunks)
    assert peak < nbytes / 2, f"peak {peak / 1e6:.1f} MB for an epoch over {nbytes / 1e6:.1f} MB of variables"
    assert peak < 1.5 * peak_zarr + 1e6, f"peak {peak / 1e6:.1f} MB, {peak_zarr / 1e6:.1f} MB from Zarr"


def test_netcdf_batches_of_a_selection(nc_path):
    """A subset that starts mid-chunk keeps the dask grid (its first chunk is partial); still exact."""
    ds = xr.open_dataset(nc_path, chunks={"time": CT}).isel(time=slice(3, 100), lat=slice(0, 16))
    with TaskLog() as log:
        m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    assert log.keys == []
    with TaskLog() as log:
        batches, _ = _epoch(ds, m, "train", shuffle=False)
    assert _check_values(ds, batches) == m.positions("train")
    log.check_reads(len(VARS) * len(m.blocks("train")))


# ---------------------------------------------------------------------- open_mfdataset
def test_open_mfdataset_two_files(nc_pair):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ds = xr.open_mfdataset(nc_pair, chunks={"time": CT}, combine="by_coords")
    with TaskLog() as log:
        assert ds.insitu.chunks == {"time": CT, "lat": NY, "lon": NX}
        m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    assert log.keys == []
    with TaskLog() as log:
        batches, _ = _epoch(ds, m, "val", shuffle=True)
    assert _check_values(ds, batches) == NT // 2
    log.check_reads(len(VARS) * NT // CT // 2)


# ---------------------------------------------------------------------- impossible: a clear error
def test_computed_graph_over_netcdf_names_open_netcdf(nc_path):
    ds = xr.open_dataset(nc_path, chunks={"time": CT})
    ds["t2m"] = ds.t2m * 2
    with TaskLog() as log, pytest.raises(SourceError, match=r"xinsitu\.virtual\.open_netcdf") as e:
        _ = ds.insitu.chunks
    assert log.keys == []
    assert "computed lazily by dask" in str(e.value)


# ---------------------------------------------------------------------- lazily opened, no dask (issue 16 item 10)
def test_lazy_netcdf_names_open_netcdf(nc_path):
    ds = xr.open_dataset(nc_path)
    with pytest.raises(SourceError, match=r"xinsitu\.virtual\.open_netcdf") as e:
        _ = ds.insitu.chunks
    assert "open_zarr" not in str(e.value)


def test_lazy_netcdf_h5netcdf_names_open_netcdf(nc_path):
    ds = xr.open_dataset(nc_path, engine="h5netcdf")
    with pytest.raises(SourceError, match=r"xinsitu\.virtual\.open_netcdf"):
        _ = ds.insitu.geometry


def _write_grib(path: Path) -> None:
    """A 4-message GRIB2 file (t2m on a 3 x 4 grid, 4 steps), from eccodes' own sample."""
    eccodes = pytest.importorskip("eccodes")
    with open(path, "wb") as f:
        for step in range(4):
            gid = eccodes.codes_grib_new_from_samples("regular_ll_sfc_grib2")
            eccodes.codes_set_key_vals(gid, {"Ni": 4, "Nj": 3, "iDirectionIncrementInDegrees": 90,
                                             "jDirectionIncrementInDegrees": 90,
                                             "latitudeOfFirstGridPointInDegrees": 90,
                                             "latitudeOfLastGridPointInDegrees": -90,
                                             "longitudeOfFirstGridPointInDegrees": 0,
                                             "longitudeOfLastGridPointInDegrees": 270,
                                             "shortName": "2t", "step": step * 6})
            eccodes.codes_set_values(gid, np.arange(12, dtype=float) + step)
            eccodes.codes_write(gid, f)
            eccodes.codes_release(gid)


def test_lazy_grib_names_open_grib(tmp_path):
    pytest.importorskip("cfgrib")
    path = tmp_path / "t2m.grib2"
    _write_grib(path)
    ds = xr.open_dataset(path, engine="cfgrib", backend_kwargs={"indexpath": ""})
    with pytest.raises(SourceError, match=r"xinsitu\.virtual\.open_grib") as e:
        _ = ds.insitu.chunks
    assert "open_netcdf" not in str(e.value) and "open_zarr" not in str(e.value)
    # the same file without its extension: known by its first bytes
    plain = tmp_path / "t2m_data"
    plain.write_bytes(path.read_bytes())
    ds = xr.open_dataset(plain, engine="cfgrib", backend_kwargs={"indexpath": ""})
    with pytest.raises(SourceError, match=r"xinsitu\.virtual\.open_grib"):
        _ = ds.insitu.chunks


def test_open_mfdataset_over_zarr_stores_reads_each(tmp_path):
    """Several Zarr stores concatenated by dask are read through dask, never mapped to the first one."""
    ds0 = _data(64)
    paths = [tmp_path / "a.zarr", tmp_path / "b.zarr"]
    ds0.isel(time=slice(0, 32)).chunk({"time": CT}).to_zarr(paths[0])
    ds0.isel(time=slice(32, None)).chunk({"time": CT}).to_zarr(paths[1])
    ds = xr.open_mfdataset(paths, engine="zarr", combine="by_coords", data_vars="minimal")
    assert ds.insitu.chunks == {"time": CT, "lat": NY, "lon": NX}
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    batches, _ = _epoch(ds, m, "val", shuffle=True)
    assert _check_values(ds, batches) == 32


def test_generator_pickles_and_stats(nc_path):
    """What spawn workers get (the pickled generator) reads the same batches; statistics read the
    split's chunks through dask too and equal those of the loaded Dataset."""
    import pickle

    ds = xr.open_dataset(nc_path, chunks={"time": CT})
    m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
    gen = ds.insitu.batches(m, "val", variables=VARS, batch_size=16, block_chunks=2, output="numpy", seed=0)
    again = pickle.loads(pickle.dumps(gen))
    for a, b in zip(gen, again, strict=True):
        assert all(np.array_equal(a[v], b[v]) for v in VARS)
    with TaskLog() as log:
        st = ds.insitu.stats(m, "val", variables=VARS)
    log.check_reads(len(VARS) * len(m.blocks("val")))
    ref = ds.load().insitu.stats(m, "val", variables=VARS)
    for v in VARS:
        for k in ("mean", "std", "min", "max", "nan_count"):
            assert st[v][k] == pytest.approx(ref[v][k], rel=1e-12), (v, k)


def test_grib_through_dask(tmp_path):
    """GRIB through cfgrib with dask chunks: read chunk by chunk too; values equal cfgrib's."""
    pytest.importorskip("cfgrib")
    path = tmp_path / "t2m.grib2"
    _write_grib(path)
    ds = xr.open_dataset(path, engine="cfgrib", chunks={"step": 1}, backend_kwargs={"indexpath": ""})
    with TaskLog() as log:
        assert ds.insitu.chunks == {"step": 1, "latitude": 3, "longitude": 4}
        m = ds.insitu.split("step", fractions={"train": 0.5, "val": 0.5})
    assert log.keys == []
    gen = ds.insitu.batches(m, "val", batch_size=2, output="numpy", shuffle=False)
    with TaskLog() as log:
        (batch,) = list(gen)
    log.check_reads(2, chunk_len=1)
    np.testing.assert_array_equal(batch["t2m"], ds.t2m.isel(step=[2, 3]).values)


def test_unreadable_file_names_variable_chunk_and_file(tmp_path):
    """A file that breaks after opening (here: truncated) fails with ChunkReadError naming the chunk."""
    from xinsitu.io.reader import ChunkReadError

    path = tmp_path / "broken.nc"
    _data(64).to_netcdf(path, encoding={v: {"chunksizes": (CT, NY, NX)} for v in VARS})
    ds = xr.open_dataset(path, chunks={"time": CT}, cache=False)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "val", variables=["t2m"], batch_size=8, output="numpy", shuffle=False)
    ds.close()
    with open(path, "r+b") as f:
        f.truncate(4096)
    with pytest.raises(ChunkReadError) as e:
        list(gen)
    assert e.value.var == "t2m" and e.value.chunk[0] >= 4 and str(path) in e.value.key
