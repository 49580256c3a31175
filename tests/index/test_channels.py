"""Stacked output: variables as channels, an extra dim expanded into ``{var}_{label}``
channels, bit for bit what ``Dataset.to_dataarray("variable")`` gives for the same samples."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import xinsitu
from tests.batches.test_stats import LEVELS, write_levels


@pytest.fixture(scope="module")
def levels_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """t2m float32, tp int16-packed (decodes to float64, NaNs), z(time, level, ...), lsm, and
    `count` stored as plain int16."""
    path = str(tmp_path_factory.mktemp("channels") / "levels.zarr")
    write_levels(path, nt=48)
    cnt = (np.arange(48 * 4 * 6) % 7).astype("int16").reshape(48, 4, 6)
    xr.Dataset({"count": (("time", "lat", "lon"), cnt)}).to_zarr(
        path, mode="a", encoding={"count": {"chunks": (8, 4, 6)}})
    return path


@pytest.fixture
def levels_ds(levels_path: str) -> xr.Dataset:
    return xinsitu.open_zarr(levels_path)


def sample_starts(gen, ids: np.ndarray) -> np.ndarray:
    unit, local = gen.space.locate(ids)
    return np.stack([gen.space.unit_starts(int(u))[int(lo)] for u, lo in zip(unit, local, strict=True)])


def expanded_oracle(ds: xr.Dataset, gen, starts: np.ndarray, variables: list[str]) -> xr.DataArray:
    """Plain xarray: select the samples, give each label of `level` its own `{var}_{label}` variable,
    then ``to_dataarray("variable")``."""
    ind = {}
    for k, d in enumerate(gen.space.dims):
        pos = starts[:, k, None] + np.arange(d.width) if d.keep else starts[:, k]
        ind[d.name] = xr.DataArray(pos, dims=("sample", d.name) if d.keep else "sample")
    sel = ds[variables].isel(ind).load()
    base_has_level = all("level" in sel[v].dims for v in variables)
    parts = {}
    for v in variables:
        if "level" in sel[v].dims and not base_has_level:
            for i, lab in enumerate(sel.level.values):
                parts[f"{v}_{lab}"] = sel[v].isel(level=i, drop=True)
        else:
            parts[v] = sel[v]
    out = xr.Dataset(parts, attrs=sel.attrs).to_dataarray("variable")
    return out.transpose("sample", "variable", ...)


def epoch_pairs(gen):
    for batch, ids in zip(list(gen), gen.batch_ids(), strict=True):
        yield batch, sample_starts(gen, ids)


VARSETS = {
    "float32+float64": ["t2m", "tp", "z"],  # tp decodes to float64: the stack is float64
    "float32+int16": ["z", "count", "t2m"],  # int16 with float32 -> float32, as to_dataarray does
    "float32 only": ["t2m", "z"],
}


@pytest.mark.parametrize("varset", list(VARSETS))
def test_stacked_numpy_equals_to_dataarray(levels_ds, varset):
    variables = VARSETS[varset]
    ds = levels_ds
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", variables=variables, output="numpy", stack=True, batch_size=5,
                            block_chunks=2, seed=4)
    expected_channels = [c for v in variables for c in ([f"{v}_{lab}" for lab in LEVELS] if v == "z" else [v])]
    assert gen.channels == expected_channels
    n = 0
    for batch, starts in epoch_pairs(gen):
        ref = expanded_oracle(ds, gen, starts, variables)
        assert list(ref["variable"].values) == gen.channels
        assert batch.dtype == ref.dtype, (batch.dtype, ref.dtype)
        assert batch.shape == ref.shape
        assert np.array_equal(batch, ref.values, equal_nan=True)
        n += len(batch)
    assert n == m.positions("train")


def test_stacked_dtype_is_the_common_result_dtype(levels_ds):
    m = levels_ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    for variables, dtype in (([*VARSETS["float32+float64"]], np.float64), (["z", "count"], np.float32),
                             (["t2m", "z"], np.float32), (["count"], np.int16)):
        gen = levels_ds.insitu.batches(m, "val", variables=variables, output="numpy", stack=True, batch_size=3)
        assert next(iter(gen)).dtype == dtype, variables
        assert levels_ds[variables].isel(time=[0]).to_dataarray().dtype == dtype


def test_stacked_torch(levels_ds):
    torch = pytest.importorskip("torch")
    m = levels_ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    kw = dict(variables=["t2m", "tp", "z"], stack=True, batch_size=6, shuffle=False)
    a = next(iter(levels_ds.insitu.batches(m, "train", output="numpy", **kw)))
    t = next(iter(levels_ds.insitu.batches(m, "train", output="torch", **kw)))
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float64
    assert np.array_equal(t.numpy(), a, equal_nan=True)


def test_stacked_window(levels_ds):
    """A window keeps its dim after the channel axis; levels still expand into channels."""
    ds = levels_ds
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    variables = ["t2m", "z"]
    gen = ds.insitu.batches(m, "val", variables=variables, output="numpy", stack=True, batch_size=4,
                            window={"time": 3}, seed=1)
    assert gen.channels == ["t2m", "z_500", "z_850"]
    for batch, starts in epoch_pairs(gen):
        ref = expanded_oracle(ds, gen, starts, variables).transpose("sample", "variable", "time", "lat", "lon")
        assert batch.shape == ref.shape
        assert np.array_equal(batch, ref.values)


def test_dataarray_output(levels_ds):
    variables = ["t2m", "tp"]
    ds = levels_ds[variables].assign_attrs(title="era5", source="x")  # no `level` coordinate left
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", variables=variables, output="dataarray", batch_size=7, seed=2)
    for batch, starts in epoch_pairs(gen):
        ref = expanded_oracle(ds, gen, starts, variables)
        assert isinstance(batch, xr.DataArray)
        assert batch.dims == ("sample", "variable", "lat", "lon")
        assert list(batch["variable"].values) == gen.channels == variables
        assert batch.dtype == ref.dtype
        assert np.array_equal(batch.values, ref.values, equal_nan=True)
        np.testing.assert_array_equal(batch.time.values, ref.time.values)  # sample coords kept
        assert batch.attrs == ref.attrs == {"title": "era5", "source": "x"}  # as to_dataarray keeps them


def test_xarray_output_with_stack_is_the_labeled_stacked_array(levels_ds):
    """output="xarray", stack=True: the same labeled ``(sample, variable, ...)`` DataArray as "dataarray"."""
    ds = levels_ds[["t2m", "tp"]]
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    kw = dict(batch_size=7, seed=2, shuffle=False)
    got = list(ds.insitu.batches(m, "train", output="xarray", stack=True, **kw))
    ref = list(ds.insitu.batches(m, "train", output="dataarray", **kw))
    assert len(got) == len(ref) > 0
    for a, b in zip(got, ref, strict=True):
        assert isinstance(a, xr.DataArray)
        xr.testing.assert_identical(a, b)


@pytest.mark.parametrize("variables", [["t2m", "tp", "z"], ["t2m", "tp"]], ids=["z-levels", "level-coord-only"])
def test_dataarray_output_with_extra_dim(levels_ds, variables):
    ds = levels_ds
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", variables=variables, output="dataarray", batch_size=7, seed=2)
    for batch, starts in epoch_pairs(gen):
        ref = expanded_oracle(ds, gen, starts, variables)
        assert list(batch["variable"].values) == gen.channels == list(ref["variable"].values)
        assert batch.dtype == ref.dtype
        assert np.array_equal(batch.values, ref.values, equal_nan=True)
        assert "level" not in batch.coords


@pytest.mark.parametrize("window", [None, {"time": 2}], ids=["no-window", "window"])
def test_stacked_static_variable_is_broadcast(levels_ds, window):
    """lsm(lat, lon) stacked with t2m: the same for every sample, as to_dataarray broadcasts it."""
    ds = levels_ds
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    variables = ["lsm", "t2m"]
    gen = ds.insitu.batches(m, "val", variables=variables, output="numpy", stack=True, batch_size=4,
                            window=window)
    assert gen.channels == variables
    for batch, starts in epoch_pairs(gen):
        ref = expanded_oracle(ds, gen, starts, variables)
        ref = ref.transpose("sample", "variable", *(["time"] if window else []), "lat", "lon")
        assert batch.shape == ref.shape
        assert np.array_equal(batch, ref.values)


def test_any_dim_the_others_lack_becomes_channels(levels_path):
    """zonal(time, lat) beside t2m(time, lat, lon): `lon` is t2m's extra dim, one channel per label."""
    mem = xr.open_zarr(levels_path, chunks=None).load()
    ds = mem.assign(zonal=mem.t2m.mean("lon"), meridional=mem.t2m.mean("lat"))
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", variables=["t2m", "zonal"], output="numpy", stack=True, batch_size=4)
    assert gen.channels == [f"t2m_{lon}" for lon in ds.lon.values] + ["zonal"]
    batch, starts = next(epoch_pairs(gen))
    sel = ds.isel(time=starts[:, 0])
    np.testing.assert_array_equal(batch[:, :6], sel.t2m.transpose("time", "lon", "lat").values)
    np.testing.assert_array_equal(batch[:, 6], sel.zonal.values)
    with pytest.raises(ValueError, match="cannot stack"):  # neither has the other's dims
        ds.insitu.batches(m, "train", variables=["zonal", "meridional"], output="numpy", stack=True)


@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_stacked_gather_straight_into_batch(era5_path, output):
    """Float variables with a NaN fill stack without a copy (gathered into the batch's channels);
    batches spanning two shuffle blocks included, equal to to_dataarray bit for bit."""
    import xinsitu

    ds = xinsitu.open_zarr(era5_path)[["t2m", "u10", "z500"]]
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    gen = ds.insitu.batches(m, "train", batch_size=7, block_chunks=2, output=output, stack=True, seed=3)
    assert gen.builder.direct_stack(1) is not None  # the copy-free path is the one under test
    ids = gen.batch_ids()
    batches = list(gen)
    assert len(batches) == len(ids)
    for b, i in zip(batches, ids, strict=True):
        got = b.numpy() if output == "torch" else b
        ref = ds.isel(time=xr.DataArray(i, dims="sample")).to_dataarray("variable").transpose("sample", "variable", ...)
        assert got.dtype == ref.dtype
        assert np.array_equal(got, ref.values, equal_nan=True)


def _time_vars(path) -> str:
    ds = xr.Dataset({"valid": (("time", "x"), np.datetime64("2001-01-01", "ns")
                               + np.arange(16).reshape(8, 2) * np.timedelta64(1, "h")),
                     "lead": (("time", "x"), (np.arange(16).reshape(8, 2) * np.timedelta64(1, "h")).astype("m8[ns]"))},
                    coords={"time": pd.date_range("2000", periods=8)})
    ds.to_zarr(path, encoding={"valid": {"chunks": (2, 2)}, "lead": {"chunks": (2, 2)}}, mode="w")
    return str(path)


@pytest.mark.parametrize("opts", [{}, {"decode_times": "s"}, {"decode_times": "cftime"}, {"decode_timedelta": True}])
@pytest.mark.parametrize("opener", ["xinsitu", "xarray"])
def test_time_data_variables_under_xarrays_decoding_options(tmp_path, opts, opener):
    """Datetime and timedelta *data variables* opened with xarray's own options (times in seconds, as
    ``CFDatetimeCoder(time_unit="s")``; cftime objects; ``decode_timedelta``): batches give what
    ``isel`` gives, dtype included (each was refused: "re-applying its CF encoding gives int64, but the
    Dataset has timedelta64[ns]" -- a plain ``to_zarr`` timedelta too), stacked too (an object array,
    as ``to_dataarray`` gives: it crashed)."""
    path = _time_vars(tmp_path / "t.zarr")
    kw = dict(opts)
    if kw.get("decode_times") == "s":
        kw["decode_times"] = xr.coders.CFDatetimeCoder(time_unit="s")
    elif kw.get("decode_times") == "cftime":
        pytest.importorskip("cftime")
        kw["decode_times"] = xr.coders.CFDatetimeCoder(use_cftime=True)
    ds = xinsitu.open_zarr(path, **kw) if opener == "xinsitu" else xr.open_zarr(path, **kw)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    for v in ("valid", "lead"):
        b = next(iter(ds.insitu.batches(m, "train", batch_size=2, shuffle=False, output="numpy", variables=[v])))
        want = ds[v].isel(time=slice(0, 2)).values
        assert b[v].dtype == want.dtype
        np.testing.assert_array_equal(b[v], want)
    if ds.valid.dtype == object:
        b = next(iter(ds.insitu.batches(m, "train", batch_size=2, shuffle=False, output="dataarray",
                                        variables=["valid"])))
        want = ds[["valid"]].isel(time=slice(0, 2)).to_dataarray("variable").transpose("time", ...)
        assert b.dtype == want.dtype == object
        np.testing.assert_array_equal(b.values, want.values)


def test_a_channel_name_given_twice_is_refused_naming_both_variables():
    """``t`` on levels [500, 850] beside a variable ``t_850``: two channels named ``t_850`` (statistics,
    ``normalize=`` and states go by channel name) are refused, naming both variables (they were
    accepted: ``gen.channels`` listed ``t_850`` twice)."""
    ds = xr.Dataset({"t": (("time", "level", "x"), np.zeros((4, 2, 3))), "t_850": (("time", "x"), np.ones((4, 3)))},
                    coords={"level": [500, 850]}).chunk(time=2)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    with pytest.raises(ValueError, match="'t_850' is given twice, by variables 't' and 't_850'"):
        ds.insitu.batches(m, "train", batch_size=2, stack=["level"])
    with pytest.raises(ValueError, match="given twice"):
        ds.insitu.stats(m, "train", stack=["level"])
    gen = ds.insitu.batches(m, "train", batch_size=2, stack=["level"], variables=["t"])
    assert gen.channels == ["t_500", "t_850"]
    # one variable whose level holds a label twice: the label is named, not "variables 't' and 't'"
    twice = ds[["t"]].assign_coords(level=[500, 500])
    with pytest.raises(ValueError, match=r"'t_500' is given twice by variable 't': its dim\(s\) \['level'\] hold a"):
        twice.insitu.batches(m, "train", batch_size=2, stack=["level"])
