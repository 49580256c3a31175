"""Dims without a coordinate (in-memory Datasets, NetCDF files without coordinate variables, images):
their labels are their positions, everywhere -- splits, batches in every output, ``sample``, stats,
reprs -- and every batch equals ``ds.isel(...)`` for the same samples."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

import xinsitu  # noqa: F401  (registers ds.insitu)
from tests.index.test_sampling import general_oracle, grid_ds, run_epoch, write


def _bare(nt: int = 24) -> xr.Dataset:
    """grid_ds without any coordinate."""
    return grid_ds(nt=nt).drop_vars(["time", "lat", "lon"])


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> xr.Dataset:
    path = tmp_path_factory.mktemp("nocoords") / "bare.zarr"
    return write(path, _bare(), {"a": {"time": 4, "lat": 6, "lon": 5}, "b": {"time": 4, "lat": 6, "lon": 5},
                                 "mask": {"lat": 6, "lon": 5}})


def _datasets(stored: xr.Dataset) -> dict[str, xr.Dataset]:
    bare = _bare()
    return {"stored": stored,
            "memory": bare,  # numpy-backed: each position its own chunk
            "dask": bare.chunk({"time": 4, "lat": 6, "lon": 5}),
            # a 2-D auxiliary coordinate on lat/lon, still no index on any dim
            "aux": stored.assign_coords(area=(("lat", "lon"), np.arange(120.0).reshape(12, 10)))}


SHAPES = {
    "plain": {},
    "window": {"window": {"time": 3}},
    "patch": {"patch": {"lat": 4, "lon": 5}, "stride": {"lat": 2}},
    "over": {"over": "lat", "variables": ["a", "b"]},
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("output", ["xarray", "numpy"])
@pytest.mark.parametrize("kind", ["stored", "memory", "dask", "aux"])
@pytest.mark.slow
def test_batches_equal_isel_without_coords(stored, kind, output, shape):
    ds = _datasets(stored)[kind]
    m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
    gen = ds.insitu.batches(m, "train", batch_size=5, output=output, block_chunks=2, seed=1, **SHAPES[shape])
    seen = run_epoch(ds, gen, output)
    assert np.array_equal(np.sort(seen), np.arange(gen.n_samples))


@pytest.mark.parametrize("output", ["dataarray", "numpy"])
@pytest.mark.parametrize("kind", ["stored", "memory"])
def test_stacked_without_coords(stored, kind, output):
    ds = _datasets(stored)[kind]
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "val", batch_size=4, output=output, stack=True, window={"time": 2},
                            variables=["a", "b"], shuffle=False)
    assert gen.channels == ["a", "b"]
    for b, ids in zip(gen, gen.batch_ids(), strict=True):
        unit, local = gen.space.locate(ids)
        starts = np.stack([gen.space.unit_starts(int(u))[int(k)] for u, k in zip(unit, local, strict=True)])
        ref = general_oracle(ds, gen, starts).to_dataarray("variable").transpose("sample", "variable", ...)
        got = b.values if output == "dataarray" else b
        assert np.array_equal(got, ref.values)
        if output == "dataarray":
            assert b.dims == ref.dims
            assert list(b["variable"].values) == ["a", "b"]


@pytest.mark.parametrize("kind", ["stored", "memory", "dask", "aux"])
def test_sample_without_coords(stored, kind):
    ds = _datasets(stored)[kind]
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "val", window={"time": 3}, patch={"lon": 5})
    for i in (0, 7, gen.n_samples - 1):
        unit, local = gen.space.locate(np.array([i]))
        start = gen.space.unit_starts(int(unit[0]))[int(local[0])]
        ref = general_oracle(ds, gen, start[None])
        ref = ref.isel(sample=0) if "sample" in ref.dims else ref
        xr.testing.assert_identical(gen.sample(i), ref)
        xr.testing.assert_identical(ds.insitu.sample(m, "val", i, window={"time": 3}, patch={"lon": 5}), ref)


@pytest.mark.slow
def test_ranges_use_positions_without_coords(stored):
    """ranges= takes positions as labels (``.sel`` semantics: both ends included); the manifest
    reports the positions each split covers."""
    ds = stored
    m = ds.insitu.split("time", ranges={"train": slice(0, 15), "val": slice(16, None)})
    assert m.splits == {"train": [0, 1, 2, 3], "val": [4, 5]}
    assert m.labels == {"train": {"time": [0, 15]}, "val": {"time": [16, 23]}}
    mf = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    assert mf.labels == {"train": {"time": [0, 11]}, "val": {"time": [12, 23]}}
    # rounded inward to chunk edges, as with labels
    m2 = ds.insitu.split("time", ranges={"train": slice(1, 13)})
    assert m2.splits == {"train": [1, 2]} and m2.labels["train"]["time"] == [4, 11]
    gen = ds.insitu.batches(m, "val", batch_size=3, output="xarray")
    run_epoch(ds, gen, "xarray")
    with pytest.raises(ValueError, match="outside"):
        ds.insitu.split("time", ranges={"train": slice(30, 40)})
    # a two-dim split on dims without coordinates
    m3 = ds.insitu.split(["lat", "lon"], fractions={"a": 0.5, "b": 0.5}, seed=0)
    gen = ds.insitu.batches(m3, "a", batch_size=7, output="xarray", over="time", variables=["a"])
    run_epoch(ds, gen, "xarray")


def test_stats_and_reprs_without_coords(stored):
    ds = stored
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    st = ds.insitu.stats(m, "train", variables=["a", "b"])
    train = ds.isel(time=slice(0, 12))
    for v in ("a", "b"):
        vals = train[v].values.astype("f8")
        assert st[v]["mean"] == pytest.approx(vals.mean(), rel=1e-9, abs=1e-12)
        assert st[v]["std"] == pytest.approx(vals.std(), rel=1e-8)
    gen = ds.insitu.batches(m, "train", normalize=st, variables=["a", "b"], window={"time": 2})
    b = next(iter(gen))
    assert np.isfinite(b["a"].values).all()
    for obj in (m, gen, ds.insitu.geometry):
        assert repr(obj) and obj._repr_html_()
    assert "val" in m.summary()


@pytest.mark.parametrize("output", ["xarray", "dataarray"])
def test_netcdf_without_coordinate_variables(tmp_path, output):
    """A NetCDF4 file with no coordinate variable, read in place through xinsitu.virtual.open_netcdf."""
    pytest.importorskip("h5py")
    pytest.importorskip("virtualizarr")
    from xinsitu.virtual import open_netcdf

    path = str(tmp_path / "bare.nc")
    _bare().to_netcdf(path, encoding={v: {"chunksizes": (4, 6, 5)} for v in ("a", "b")})
    ds = open_netcdf(path)
    ref = xr.open_dataset(path).load()
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", batch_size=5, window={"time": 2}, output=output, variables=["a", "b"])
    if output == "xarray":
        run_epoch(ref, gen, "xarray")
    else:
        b, ids = next(iter(gen)), gen.batch_ids()[0]
        unit, local = gen.space.locate(ids)
        starts = np.stack([gen.space.unit_starts(int(u))[int(k)] for u, k in zip(unit, local, strict=True)])
        exp = general_oracle(ref, gen, starts).to_dataarray("variable").transpose("sample", "variable", ...)
        assert np.array_equal(b.values, exp.values) and b.dims == exp.dims
    one = general_oracle(ref, gen, gen.space.unit_starts(0)[3][None]).isel(sample=0)
    xr.testing.assert_identical(gen.sample(3), one)


@pytest.mark.parametrize(("output", "stack"), [("numpy", False), ("numpy", True), ("torch", False),
                                               ("torch", True), ("dataarray", False), ("xarray", False)])
def test_every_output_without_coords(stored, output, stack):
    if output == "torch":
        pytest.importorskip("torch")
    m = stored.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = stored.insitu.batches(m, "train", batch_size=4, output=output, stack=stack, window={"time": 2},
                                patch={"lon": 5}, variables=["a", "b"])
    n = 0
    for b in gen:
        arr = b if not isinstance(b, dict) else b["a"]
        n += (arr.sizes["sample"] if isinstance(arr, xr.Dataset) else arr.shape[0])
    assert n == gen.n_samples
