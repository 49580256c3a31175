"""Map-style dataset (``xinsitu.batches.mapstyle.InsituDataset``): ``d[i]`` and ``__getitems__`` against
plain xarray and against ``batches()``, each chunk read once per call, torch DataLoaders with
samplers, workers under spawn/fork (in subprocesses with a timeout), and argument errors."""

from __future__ import annotations

import itertools
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xinsitu
from tests.index.test_sampling import general_oracle, grid_ds, write
from xinsitu.batches.mapstyle import InsituDataset, SampleBatch, collate

ROOT = str(Path(__file__).resolve().parents[2])


def starts_of(d: InsituDataset, ids) -> np.ndarray:
    sp = d._gen.space
    unit, local = sp.locate(np.asarray(ids, dtype=np.int64))
    return np.stack([sp.unit_starts(int(u))[int(k)] for u, k in zip(unit, local, strict=True)])


def oracle(ds: xr.Dataset, d: InsituDataset, ids) -> xr.Dataset:
    return general_oracle(ds, d._gen, starts_of(d, ids))


def check_batch(batch, ref: xr.Dataset, d: InsituDataset, output: str, stack: bool = False) -> None:
    """Bit-identity of a batch (leading batch axis) with the xarray oracle."""
    if output == "xarray" and not stack:
        xr.testing.assert_identical(batch, ref)
        return
    if stack or output == "dataarray":
        exp = np.stack([ref[v].values for v in d.variables], axis=1)
        exp = exp.astype(np.result_type(*[ref[v].dtype for v in d.variables]))
        got = batch.values if output == "dataarray" else batch.numpy() if output == "torch" else batch
        if output == "dataarray":
            assert batch.dims[:2] == ("sample", "variable")
            assert list(batch["variable"].values) == d.channels
        assert got.dtype == exp.dtype and got.shape == exp.shape
        assert np.array_equal(got, exp, equal_nan=True)
        return
    assert list(batch) == d.variables
    for v in d.variables:
        got = batch[v].numpy() if output == "torch" else batch[v]
        assert got.dtype == ref[v].dtype and got.shape == ref[v].shape, v
        assert np.array_equal(got, ref[v].values, equal_nan=True), v


def check_item(item, ref: xr.Dataset, d: InsituDataset, output: str, stack: bool = False) -> None:
    """One sample (no batch axis) against sample 0 of a one-sample oracle."""
    if output == "xarray" and not stack:
        one = ref.isel(sample=0)  # a dim's own coordinate indexed, as ds.isel(...) of that one sample has it
        for k in [k for k, v in one.coords.items() if v.dims == (k,) and k not in one.indexes]:
            one = one.set_xindex(k)
        xr.testing.assert_identical(item, one)
        return
    if output == "dataarray":
        assert "sample" not in item.dims
        item = item.expand_dims("sample")
    elif stack:
        item = item[None]
    else:
        item = {v: a[None] for v, a in item.items()}
    check_batch(item, ref, d, output, stack)


@pytest.fixture(params=["units", "regions"])
def read_path(request, monkeypatch):
    """Both ways a call reads: whole chunk blocks into a block buffer, or each sample's region."""
    import xinsitu.batches.mapstyle as mod

    monkeypatch.setattr(mod, "SPARSE_PER_UNIT", 0 if request.param == "units" else 10**9)
    return request.param


def region_chunks(d: InsituDataset, ids) -> int:
    """Chunks the samples' own regions touch (window/tile along sampled dims, other dims whole),
    over every variable: what the ``regions`` path reads (archives written whole: no subsetting)."""
    sp, total = d._gen.space, 0
    st = starts_of(d, ids)
    for lay in d._gen.layouts.values():
        src = lay.src
        touched = set()
        for row in st.tolist():
            ranges = []
            for dim, cs, size in zip(src.dims, src.chunk_shape, src.shape, strict=True):
                k = [j for j, sd in enumerate(sp.dims) if sd.name == dim]
                a, b = (row[k[0]], row[k[0]] + sp.dims[k[0]].width) if k else (0, size)
                ranges.append(range(a // cs, (b - 1) // cs + 1))
            touched |= set(itertools.product(*ranges))
        total += len(touched)
    return total


@pytest.fixture(scope="module")
def era5(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.2, "test": 0.2}, gap=1)
    return ds, m


# ---------------------------------------------------------------- values
@pytest.mark.parametrize("output, stack", [("numpy", False), ("torch", False), ("xarray", False), ("numpy", True),
                                           ("torch", True), ("dataarray", False)])
@pytest.mark.slow
def test_items_and_batches_match_xarray(era5, output, stack, read_path):
    if output == "torch":
        pytest.importorskip("torch")
    ds, m = era5
    d = InsituDataset(ds, m, "train", output=output, stack=stack)
    n = len(d)
    assert n == m.positions("train")
    for i in [0, 7, 8, n - 1, -1, -n]:
        check_item(d[i], oracle(ds, d, [i % n]), d, output, stack)
    # unsorted, duplicates, many chunks (time chunks of 8)
    ids = [n - 1, 3, 3, 40, 0, 17, 40, 9, 55, 3]
    got = d.__getitems__(ids)
    assert isinstance(got, SampleBatch) and len(got) == len(ids)
    ref = oracle(ds, d, ids)
    check_batch(got.batch, ref, d, output, stack)
    check_batch(d.batch(np.array(ids)), ref, d, output, stack)
    for k, item in enumerate(got):
        check_item(item, ref.isel(sample=[k]), d, output, stack)


def test_dtype_gives_every_array_of_a_sample_and_a_batch_in_it(era5):
    """``dataset(dtype=)`` as ``batches(dtype=)``: a float64 or int16-packed archive read as float32 needed a cast
    per sample in the training loop (the default collate gave float64 tensors); values are xarray's cast."""
    ds, m = era5
    d = ds.insitu.dataset(m, "train", dtype="float32")
    ids = [0, 9, 3]
    got = d.__getitems__(ids).batch
    ref = oracle(ds, d, ids)
    for v in ref.data_vars:
        assert got[v].dtype == np.float32, v
        np.testing.assert_array_equal(got[v], ref[v].values.astype("float32"))
        assert d[9][v].dtype == np.float32 and np.array_equal(d[9][v], ref[v].values[1].astype("float32"),
                                                             equal_nan=True)
    with pytest.raises(TypeError, match="dtype"):
        ds.insitu.dataset(m, "train", dtype="no such dtype")


def test_item_equals_gen_sample(era5):
    ds, m = era5
    d = InsituDataset(ds, m, "val", output="xarray", window={"time": 3})
    gen = ds.insitu.batches(m, "val", window={"time": 3}, shuffle=False)
    for i in [0, 5, len(d) - 1]:
        xr.testing.assert_identical(d[i], gen.sample(i))


@pytest.mark.parametrize("kw", [
    dict(window={"time": 3}),
    dict(window={"time": 9}, output="xarray"),
    dict(patch={"lat": 3, "lon": 4}, stride={"lon": 3}),
    dict(window={"time": 2}, patch={"lat": 2}, stack=True),
    dict(normalize="stats"),
    dict(normalize="stats", stack=True, variables=["t2m", "z500"]),
    dict(variables="t2m", output="xarray", patch={"lon": 5}),
    dict(variables=["t2m", "u10"], stack=True, window={"time": 2}),  # gathered straight into the stacked batch
])
@pytest.mark.slow
def test_batches_equal_generator_batches(era5, kw, read_path):
    """Every batch of a shuffled epoch of ``batches()``, read back through the dataset by its ids."""
    ds, m = era5
    kw = dict(kw)
    if kw.get("normalize") == "stats":
        kw["normalize"] = ds.insitu.stats(m, "train", variables=kw.get("variables"))
    output = kw.pop("output", "numpy")
    gen = ds.insitu.batches(m, "train", batch_size=7, output=output, seed=3, block_chunks=2, **kw)
    d = InsituDataset(ds, m, "train", output=output, **kw)
    assert len(d) == gen.n_samples
    for b, ids in zip(gen, gen.batch_ids(), strict=True):
        got = d.batch(ids)
        if output == "xarray":
            xr.testing.assert_identical(got, b)
        elif isinstance(b, dict):
            assert list(got) == list(b)
            for v in b:
                assert got[v].dtype == b[v].dtype and np.array_equal(got[v], b[v], equal_nan=True), v
        else:
            assert got.dtype == b.dtype and np.array_equal(got, b, equal_nan=True)


@pytest.mark.slow
def test_patches_over_spatial_split_and_static_var(tmp_path, read_path):
    ds = write(tmp_path / "g.zarr", grid_ds(ny=16, nx=16), {"a": {"time": 8, "lat": 4, "lon": 4},
                                                            "b": {"time": 8, "lat": 4, "lon": 4},
                                                            "mask": {"lat": 4, "lon": 4}})
    m = ds.insitu.split(["lat", "lon"], fractions={"train": 0.75, "val": 0.25}, seed=2)
    for output in ("numpy", "xarray"):
        d = InsituDataset(ds, m, "val", patch={"lat": 4, "lon": 4}, stride={"lat": 2, "lon": 2}, over="time",
                          output=output)
        rng = np.random.default_rng(0)
        ids = rng.integers(0, len(d), 25).tolist() + [0, 0, len(d) - 1]
        check_batch(d.batch(ids), oracle(ds, d, ids), d, output)
        check_item(d[len(d) // 2], oracle(ds, d, [len(d) // 2]), d, output)
    # a static variable (no split dim) keeps its own dims in a batch, tiled like the others
    ds3 = write(tmp_path / "s.zarr", grid_ds(), {"a": {"time": 3, "lat": 4, "lon": 5}, "b": {"time": 6}})
    m3 = ds3.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    d = InsituDataset(ds3, m3, "val", window={"time": 4}, patch={"lat": 6, "lon": 5}, variables=["a", "b", "mask"],
                      output="xarray")
    ids = [5, 1, 5, len(d) - 1]
    check_batch(d.batch(ids), oracle(ds3, d, ids), d, "xarray")
    # without a patch, mask has no sampled dim: read once, no batch axis
    d = InsituDataset(ds3, m3, "val", window={"time": 2}, variables=["a", "mask"])
    ids = [5, 1, 5, len(d) - 1]
    check_batch(d.batch(ids), oracle(ds3, d, ids), d, "numpy")
    assert d[2]["mask"].shape == ds3["mask"].shape


def test_in_memory_and_dask_datasets(era5_path, read_path):
    for ds in (xr.open_zarr(era5_path).load(), xr.open_zarr(era5_path)):
        m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
        d = InsituDataset(ds, m, "val", window={"time": 2})
        ids = [3, 0, len(d) - 1, 3]
        check_batch(d.batch(ids), oracle(ds, d, ids), d, "numpy")


# ---------------------------------------------------------------- reads
def _chunks_touched(d: InsituDataset, ids, chunk: int) -> int:
    """Time chunks the samples' units and windows touch (the whole unit is read for a sample in it)."""
    st = starts_of(d, ids)[:, 0]
    w = d._gen.space.split_dims[0].width
    touched = {c for s in st.tolist() for c in range(s // chunk, (s + w - 1) // chunk + 1)}
    return len(touched)


@pytest.mark.parametrize("window", [1, 3, 12])
def test_each_chunk_read_once_per_call(era5, window, read_path):
    ds, m = era5
    d = InsituDataset(ds, m, "train", window={"time": window})
    nvar = len(d.variables)
    cases = [[0], [0, 1, 2, 3], [0, 7, 8, 9], list(range(len(d))), [len(d) - 1] * 5 + [0] * 5,
             [30, 2, 31, 15, 16, 30, 50, 8]]
    for ids in cases:
        d.batch(ids)
        assert d.io_stats["last"]["chunks"] == nvar * _chunks_touched(d, ids, 8), ids
        assert d.io_stats["last"]["samples"] == len(ids)
    assert d.io_stats["calls"] == len(cases)


def test_cache_serves_second_call(era5):
    ds, m = era5
    import inspect

    from xinsitu.io.reader import Reader

    if "cache" not in inspect.signature(Reader).parameters:
        pytest.skip("Reader(..., cache=) is not in this tree yet: cache= is stored (dataset.py HOOK(cache))")
    d = InsituDataset(ds, m, "train", cache=True)
    ref = d.batch([0, 20, 40])
    again = d.batch([0, 20, 40])
    assert d.io_stats["last"]["requests"] == 0
    for v in ref:
        assert np.array_equal(ref[v], again[v], equal_nan=True)


def test_pickle_leaves_reader_behind(era5):
    ds, m = era5
    d = InsituDataset(ds, m, "train")
    fresh = len(pickle.dumps(d))
    d.batch(list(range(0, len(d), 3)))
    used = pickle.dumps(d)
    assert len(used) < fresh + 1024, "the pickled dataset carries this process's reader or buffers"
    d2 = pickle.loads(used)
    assert type(d2) is type(d) and d2.io_stats["calls"] == 0
    a, b = d[5], d2[5]
    assert all(np.array_equal(a[v], b[v], equal_nan=True) for v in a)


def test_without_torch(era5, monkeypatch):
    ds, m = era5
    import xinsitu.batches.mapstyle as mod

    monkeypatch.setattr(mod, "_torch_installed", lambda: False)
    d = InsituDataset(ds, m, "train")
    assert type(d) is InsituDataset
    check_item(d[3], oracle(ds, d, [3]), d, "numpy")
    torch = pytest.importorskip("torch")
    monkeypatch.undo()
    d = InsituDataset(ds, m, "train")
    assert isinstance(d, torch.utils.data.Dataset) and isinstance(d, InsituDataset)


# ---------------------------------------------------------------- DataLoader, in process
def _expected(d: InsituDataset, order: list[int], bs: int):
    return [order[k:k + bs] for k in range(0, len(order), bs)]


def _assert_tensor_batch(got, exp: dict) -> None:
    assert set(got) == set(exp)
    for v in exp:
        assert np.array_equal(got[v].numpy(), exp[v], equal_nan=True), v


def test_dataloader_samplers(era5):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, WeightedRandomSampler

    ds, m = era5
    d = InsituDataset(ds, m, "train")
    bs = 6
    # RandomSampler: the default collate stacks the per-sample items into the batch (torch tensors)
    order = torch.randperm(len(d), generator=torch.Generator().manual_seed(1)).tolist()
    got = list(DataLoader(d, batch_size=bs, sampler=RandomSampler(d, generator=torch.Generator().manual_seed(1))))
    exp = _expected(d, order, bs)
    assert len(got) == len(exp)
    for g, ids in zip(got, exp, strict=True):
        _assert_tensor_batch(g, d.batch(ids))
    # collate: the batch itself (numpy, no stacking copy)
    got = list(DataLoader(d, batch_size=bs, sampler=order, collate_fn=collate))
    for g, ids in zip(got, exp, strict=True):
        ref = d.batch(ids)
        assert all(isinstance(g[v], np.ndarray) and np.array_equal(g[v], ref[v], equal_nan=True) for v in ref)
    # WeightedRandomSampler: draws with replacement (duplicates within a batch)
    w = torch.zeros(len(d))
    w[:10] = 1.0
    s = WeightedRandomSampler(w, num_samples=40, replacement=True, generator=torch.Generator().manual_seed(2))
    drawn = list(s)
    s = WeightedRandomSampler(w, num_samples=40, replacement=True, generator=torch.Generator().manual_seed(2))
    got = list(DataLoader(d, batch_size=bs, sampler=s))
    assert len(set(drawn)) < len(drawn)
    for g, ids in zip(got, _expected(d, drawn, bs), strict=True):
        _assert_tensor_batch(g, d.batch(ids))
    # DistributedSampler, two ranks in one process: disjoint shares covering the split (torch pads)
    seen = []
    for rank in range(2):
        s = DistributedSampler(d, num_replicas=2, rank=rank, shuffle=True, seed=5)
        s.set_epoch(1)
        mine = list(s)
        got = list(DataLoader(d, batch_size=bs, sampler=s))
        for g, ids in zip(got, _expected(d, mine, bs), strict=True):
            _assert_tensor_batch(g, d.batch(ids))
        seen += mine
    assert set(seen) == set(range(len(d)))


def test_dataloader_stacked_torch_and_xarray(era5):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    ds, m = era5
    d = InsituDataset(ds, m, "train", output="torch", stack=True)
    order = list(range(len(d)))[::-1]
    for g, ids in zip(DataLoader(d, batch_size=8, sampler=order), _expected(d, order, 8), strict=True):
        assert isinstance(g, torch.Tensor) and np.array_equal(g.numpy(), d.batch(ids).numpy(), equal_nan=True)
    dx = InsituDataset(ds, m, "train", output="xarray")
    for g, ids in zip(DataLoader(dx, batch_size=8, sampler=order, collate_fn=collate), _expected(d, order, 8),
                      strict=True):
        xr.testing.assert_identical(g, oracle(ds, dx, ids))


# ---------------------------------------------------------------- DataLoader workers, in subprocesses
def job_main(path: str, out: str, method: str, how: str) -> None:
    """Run by ``_job`` in a fresh process: a DataLoader with 2 workers over a permutation of the split,
    each batch compared in the parent with ``d.batch`` (read there, after the workers ran)."""
    import time
    import traceback
    import warnings

    warnings.filterwarnings("ignore", message=".*[Cc]onsolidated metadata.*")
    import torch
    from torch.utils.data import DataLoader

    t0 = time.perf_counter()
    res: dict = {}
    try:
        ds = xinsitu.open_zarr(path) if how == "xinsitu" else xr.open_zarr(path, chunks=None)
        m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
        d = InsituDataset(ds, m, "train", output="torch")
        d.batch([0, 50])  # the parent has used the store (obstore's runtime running) before the fork
        order = torch.randperm(len(d), generator=torch.Generator().manual_seed(0)).tolist()
        dl = DataLoader(d, batch_size=7, sampler=order, num_workers=2, multiprocessing_context=method)
        got = list(dl)
        ok = []
        for g, ids in zip(got, _expected(d, order, 7), strict=True):
            ref = d.batch(ids)
            ok.append(all(np.array_equal(g[v].numpy(), ref[v].numpy(), equal_nan=True) for v in ref))
        res = {"batches": len(got), "expected": len(_expected(d, order, 7)), "ok": all(ok)}
    except Exception as e:  # noqa: BLE001 - reported to the test
        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    res["seconds"] = time.perf_counter() - t0
    with open(out, "w") as f:
        json.dump(res, f)


def _job(path: str, tmp_path, method: str, how: str, timeout: int = 150) -> dict:
    out = tmp_path / f"{method}-{how}.json"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "XINSITU_DECODE_THREADS": "2"}
    code = f"from tests.batches.test_dataset import job_main; job_main({path!r}, {str(out)!r}, {method!r}, {how!r})"
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:  # a hang is a failure, never a frozen CI
        pytest.fail(f"DataLoader job hung (killed after {timeout}s): {(e.stderr or b'')[-3000:]!r}")
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("method, how", [("spawn", "xinsitu"), ("fork", "xinsitu"), ("fork", "xr")])
@pytest.mark.slow
def test_dataloader_workers(era5_path, tmp_path, method, how):
    pytest.importorskip("torch")
    out = _job(era5_path, tmp_path, method, how)
    assert "error" not in out, out.get("traceback")
    assert out["ok"] and out["batches"] == out["expected"] > 0


@pytest.mark.slow
def test_dataloader_fork_remote_fails_at_once(era5_path, tmp_path):
    pytest.importorskip("torch")
    from tests.support.servers import FileServer

    with FileServer(Path(era5_path).parent) as srv:
        base = srv.url
        out = _job(f"{base}/{Path(era5_path).name}", tmp_path, "fork", "xinsitu", timeout=90)
    assert "error" in out
    assert "ForkError" in out["traceback"] and base in out["error"]
    assert "spawn" in out["error"] and "num_workers=0" in out["error"]
    assert out["seconds"] < 60


# ---------------------------------------------------------------- arguments
def test_index_errors(era5):
    ds, m = era5
    d = InsituDataset(ds, m, "train")
    n = len(d)
    for bad in (1.5, "3", True, None, slice(0, 2), [1, 2]):
        with pytest.raises(TypeError, match="index"):
            d[bad]
    for bad in (n, -n - 1, 10**12):
        with pytest.raises(IndexError, match="out of range"):
            d[bad]
    assert np.array_equal(d[np.int32(2)]["t2m"], d[2]["t2m"])
    for bad in ([1.5, 2.0], ["a"], [True, False], 3, "12", [[1, 2]]):
        with pytest.raises(TypeError, match="indices"):
            d.__getitems__(bad)
    with pytest.raises(IndexError, match="out of range"):
        d.__getitems__([0, n])
    with pytest.raises(ValueError, match="empty"):
        d.batch([])
    assert len(d.__getitems__(range(3))) == 3
    assert len(d.__getitems__(np.array([1, -1], dtype=np.int16))) == 2
    torch = pytest.importorskip("torch")
    got = d.__getitems__(torch.tensor([4, 2]))
    assert np.array_equal(got[0]["t2m"], d[4]["t2m"]) and np.array_equal(d[torch.tensor(2)]["t2m"], d[2]["t2m"])


@pytest.mark.parametrize("bad", [2**64 - 1, 2**64 - 48, 2**63, 2**64, 2**70, -2**63, -2**64 - 1, -2**70,
                                 np.uint64(2**64 - 1), np.uint64(2**64 - 48), np.uint64(2**63)])
def test_huge_indices_never_wrap(era5, bad):
    """An integer of any size or type out of range is an IndexError: never cast to int64 first (where
    2**64 - 1 became -1, the last sample, and a uint64 2**64 - n sample 0)."""
    ds, m = era5
    d = InsituDataset(ds, m, "train")
    with pytest.raises(IndexError, match="out of range"):
        d[bad]
    with pytest.raises(IndexError, match="out of range"):
        d.__getitems__([0, bad])
    with pytest.raises(IndexError, match="out of range"):
        d.batch([bad, 1])
    if isinstance(bad, np.integer) or 0 <= bad < 2**64:
        with pytest.raises(IndexError, match="out of range"):
            d.batch(np.array([bad, 1], dtype=np.uint64))


def test_in_range_indices_of_any_integer_type(era5):
    ds, m = era5
    d = InsituDataset(ds, m, "train")
    n = len(d)
    last = d[n - 1]["t2m"]
    for i in (np.uint64(n - 1), np.int64(-1), -1, np.uint8(n - 1) if n <= 256 else n - 1):
        assert np.array_equal(d[i]["t2m"], last)
    got = d.batch(np.array([n - 1, 0], dtype=np.uint64))["t2m"]
    assert np.array_equal(got[0], last) and np.array_equal(got[1], d[0]["t2m"])
    assert np.array_equal(d.batch([-1, 2**3])["t2m"][0], last)


@pytest.mark.slow
def test_hypothesis_index_range_like_python(era5):
    """Property: any integer, of any size, as a Python int, a numpy scalar or in an int64/uint64 array,
    selects what ``range(n)[i]`` selects, or raises IndexError where that does."""
    ds, m = era5
    d = InsituDataset(ds, m, "train")
    n = len(d)

    def expect(i: int) -> int | None:
        try:
            return range(n)[i]
        except IndexError:
            return None

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.one_of(st.integers(-3 * n, 3 * n), st.integers(-2**70, 2**70),
                              st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**63, -2**63 - 1])),
                    min_size=1, max_size=4))
    def check(ids: list[int]) -> None:
        want = [expect(i) for i in ids]
        kinds: list = [ids]
        if all(-2**63 <= i < 2**63 for i in ids):
            kinds.append(np.array(ids, dtype=np.int64))
        if all(0 <= i < 2**64 for i in ids):
            kinds.append(np.array(ids, dtype=np.uint64))
            kinds.append([np.uint64(i) for i in ids])
        for idx in kinds:
            if None in want:
                with pytest.raises(IndexError, match="out of range"):
                    d._ids(idx, "indices")
            else:
                assert d._ids(idx, "indices").tolist() == want
        for i, w in zip(ids, want, strict=True):
            if w is None:
                with pytest.raises(IndexError, match="out of range"):
                    d._ids([i], "index")

    check()


def test_argument_errors(era5):
    ds, m = era5
    cases = [
        (dict(window={"time": "3"}), TypeError, "window"),
        (dict(window={"nope": 3}), ValueError, "window"),
        (dict(patch={"lat": 100}), ValueError, "patch"),
        (dict(stride={"lat": 2}), ValueError, "stride"),
        (dict(over="time"), ValueError, "over"),
        (dict(variables=["nope"]), ValueError, "variables"),
        (dict(output="bogus"), ValueError, "output"),
        (dict(stack="yes"), TypeError, "stack"),
        (dict(cache=5), TypeError, "cache"),
        (dict(missing="skip"), ValueError, "missing"),
    ]
    for kw, exc, word in cases:
        with pytest.raises(exc, match=word):
            InsituDataset(ds, m, "train", **kw)
    with pytest.raises(ValueError, match="unknown split"):
        InsituDataset(ds, m, "nope")
    with pytest.raises(TypeError, match="manifest"):
        InsituDataset(ds, {"train": [0]}, "train")


# ---------------------------------------------------------------- random geometries
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ct=st.integers(1, 7), k=st.integers(1, 5), py=st.integers(1, 6), sy=st.integers(1, 4),
       seed=st.integers(0, 9), n=st.integers(1, 40), sparse=st.sampled_from([0, 4, 10**9]))
@pytest.mark.slow
def test_hypothesis_random_indices(tmp_path_factory, monkeypatch, ct, k, py, sy, seed, n, sparse):
    """Random chunking, window, tile and indices (duplicates, any order): the batch, each item and
    the chunk count of the call against xarray."""
    path = tmp_path_factory.mktemp("h") / "h.zarr"
    ds = write(path, grid_ds(nt=30, ny=6, nx=3, seed=seed), {"a": {"time": ct, "lat": 4}, "b": {"time": ct}})
    try:
        m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5}, gap=1 if 30 // ct > 3 else 0)
        d = InsituDataset(ds, m, "train", window={"time": k}, patch={"lat": py}, stride={"lat": sy},
                          variables=["a", "b"])
    except ValueError:  # no chunk for a split, or no window fits: refused, as for batches
        return
    import xinsitu.batches.mapstyle as mod

    monkeypatch.setattr(mod, "SPARSE_PER_UNIT", sparse)
    ids = np.random.default_rng(seed).integers(-len(d), len(d), n)
    check_batch(d.batch(ids), oracle(ds, d, ids % len(d)), d, "numpy")
    n_units = len(np.unique(d._gen.space.locate(np.unique(ids % len(d)))[0]))
    if len(np.unique(ids % len(d))) > sparse * n_units:  # whole units: a's 2 lat chunks and b's one, per time chunk
        assert d.io_stats["last"]["chunks"] == 3 * _chunks_touched(d, ids % len(d), ct)
    else:  # each sample's region: only the lat chunks its tile touches
        assert d.io_stats["last"]["chunks"] == region_chunks(d, ids % len(d))
    i = int(ids[0])
    check_item(d[i], oracle(ds, d, [i % len(d)]), d, "numpy")


def test_accessor_dataset(era5):
    """``ds.insitu.dataset`` spells every keyword out and gives the same dataset (runs once the
    accessor method is merged)."""
    import inspect

    from xinsitu.accessor import InsituAccessor

    if not hasattr(InsituAccessor, "dataset"):
        pytest.skip("ds.insitu.dataset is added to accessor.py at merge")
    params = inspect.signature(InsituAccessor.dataset).parameters
    assert {"window", "patch", "stride", "over", "variables", "output", "stack", "normalize", "cache"} <= set(params)
    ds, m = era5
    d = ds.insitu.dataset(m, "train", window={"time": 2}, output="numpy")
    ref = InsituDataset(ds, m, "train", window={"time": 2})
    assert isinstance(d, InsituDataset) and len(d) == len(ref)
    a, b = d.batch([3, 1]), ref.batch([3, 1])
    assert all(np.array_equal(a[v], b[v], equal_nan=True) for v in b)


# ---------------------------------------------------------------- every sample shape, against plain isel
@pytest.fixture(scope="module")
def shapes_archive(tmp_path_factory):
    """30 steps x 8 x 8, chunks (5, 4, 4) and (5, 2, 4): a 3-d float32 and float64 variable, a 1-d
    one (time only) and a static one (y, x); a time split and a spatial split of it."""
    rng = np.random.default_rng(7)
    src = xr.Dataset({"a": (("time", "y", "x"), rng.standard_normal((30, 8, 8)).astype("f4")),
                      "b": (("time", "y", "x"), rng.standard_normal((30, 8, 8)).astype("f4")),
                      "c": (("time", "y", "x"), rng.standard_normal((30, 8, 8))),
                      "s": (("time",), rng.standard_normal(30).astype("f4")),
                      "mask": (("y", "x"), (rng.random((8, 8)) > 0.5).astype("i1"))},
                     coords={"time": pd.date_range("2001-01-01", periods=30, freq="6h"), "y": np.arange(8.0),
                             "x": np.arange(8) * 2}, attrs={"title": "shapes"})
    path = tmp_path_factory.mktemp("shapes") / "s.zarr"
    src.to_zarr(path, zarr_format=3, consolidated=True,
                encoding={"a": {"chunks": (5, 4, 4)}, "b": {"chunks": (5, 2, 4)}, "c": {"chunks": (5, 4, 4)},
                          "s": {"chunks": (5,)}, "mask": {"chunks": (2, 4)}})
    ds = xinsitu.open_zarr(str(path))
    return ds, {"time": ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5}),
                "space": ds.insitu.split(["y", "x"], fractions={"train": 0.5, "val": 0.5}, seed=1)}


#: (split, sampling options): every sample shape -- a point (every sampled dim one position), a
#: window, a patch, over dims -- and their combinations, on a time split and on a spatial split
SHAPES = [
    ("time", {}),                                                    # a time step, its grid whole
    ("time", dict(over=["y", "x"])),                                 # a point
    ("time", dict(over="x")),
    ("time", dict(window={"time": 3})),
    ("time", dict(patch={"y": 3, "x": 2}, stride={"x": 3})),
    ("time", dict(patch={"y": 3}, over="x")),
    ("time", dict(window={"time": 2}, over="x")),
    ("time", dict(window={"time": 2}, over=["y", "x"])),
    ("time", dict(window={"time": 2}, patch={"y": 4, "x": 2}, stride={"x": 3})),
    ("space", {}),                                                   # a column: every time step
    ("space", dict(over="time")),                                    # a point
    ("space", dict(window={"time": 3})),
    ("space", dict(window={"y": 2}, over="time")),
    ("space", dict(patch={"y": 2}, over="time")),
    ("space", dict(patch={"y": 2, "x": 2}, over="time")),
    ("space", dict(patch={"y": 2, "x": 2}, window={"time": 4})),
]
VARIABLE_SETS = [["a", "b"], ["a", "s", "mask"], ["c", "a"], ["mask", "b"]]


def isel_sample(ds: xr.Dataset, d: InsituDataset, i: int) -> xr.Dataset:
    """Sample ``i`` by plain ``ds.isel``: a slice along each window/patch dim, one position along the
    others (its start as the dataset numbers it)."""
    sp = d._gen.space
    row = starts_of(d, [i])[0].tolist()
    sel = {sd.name: slice(a, a + sd.width) if sd.keep else a for sd, a in zip(sp.dims, row, strict=True)}
    sub = ds[d.variables]
    return sub.isel({k: v for k, v in sel.items() if k in sub.dims}).load()


def check_sample(got, ref: xr.Dataset, d: InsituDataset, output: str, stack: bool) -> None:
    """One sample (no batch axis) bit for bit against its ``isel``."""
    if output == "xarray":
        # a window/patch dim of a sample cut from a batch has its coordinate but no index (in the
        # batch that coordinate is 2-d, (sample, dim)); the values are compared all the same
        xr.testing.assert_identical(got, ref.drop_indexes([k for k in ref.xindexes if k not in got.xindexes]))
    elif stack:
        exp = np.stack([ref[v].values for v in d.variables])
        assert got.dtype == exp.dtype and got.shape == exp.shape, (got.shape, exp.shape)
        assert np.array_equal(got, exp, equal_nan=True)
    else:
        assert list(got) == d.variables
        for v in d.variables:
            g = np.asarray(got[v])
            assert g.dtype == ref[v].dtype and g.shape == ref[v].shape, (v, g.shape, ref[v].shape)
            assert np.array_equal(g, ref[v].values, equal_nan=True), v


def check_shape_case(ds, m, kw, variables, output, stack, ids) -> None:
    d = InsituDataset(ds, m, "val", variables=variables, output=output, stack=stack, **kw)
    n = len(d)
    ids = [int(i) % n for i in ids]
    refs = [isel_sample(ds, d, i) for i in ids]
    check_sample(d[ids[0]], refs[0], d, output, stack)
    check_sample(d[ids[0] - n], refs[0], d, output, stack)  # negative: counted from the end
    got = d.__getitems__(ids)
    assert len(got) == len(ids)
    for item, ref in zip(got, refs, strict=True):
        check_sample(item, ref, d, output, stack)
    # the batch itself: vectorised isel (coordinates along ``sample``), and each sample's isel
    check_batch(got.batch, oracle(ds, d, ids), d, output, stack)
    if output == "numpy" and not stack:
        for v in d.variables:
            if d._gen.layouts[v].has_sample_axis:
                assert np.array_equal(got.batch[v], np.stack([r[v].values for r in refs]), equal_nan=True), v


@pytest.mark.parametrize("split, kw", SHAPES, ids=[f"{s}-{kw}" for s, kw in SHAPES])
@pytest.mark.parametrize("output, stack", [("numpy", False), ("xarray", False), ("numpy", True)])
@pytest.mark.slow
def test_every_sample_shape_matches_isel(shapes_archive, split, kw, output, stack, read_path):
    """``d[i]`` and ``d.__getitems__`` for every sample shape, bit for bit against ``ds.isel`` of
    each sample: a point sample was once read into a scalar copy and handed out unfilled."""
    ds, ms = shapes_archive
    variables = ["a", "b"] if stack else ["a", "c", "s", "mask"]
    if split == "space":
        variables = [v for v in variables if v != "s" or "over" in kw or "window" in kw]
    n = len(InsituDataset(ds, ms[split], "val", variables=variables, **kw))
    ids = [0, 1, n // 2, n - 1, 1, 5 % n]
    check_shape_case(ds, ms[split], kw, variables, output, stack, ids)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(SHAPES), variables=st.sampled_from(VARIABLE_SETS),
       output=st.sampled_from(["numpy", "xarray", "stack"]), sparse=st.sampled_from([0, 4, 10**9]),
       ids=st.lists(st.integers(0, 10**6), min_size=1, max_size=12))
@pytest.mark.slow
def test_hypothesis_sample_shapes(shapes_archive, monkeypatch, case, variables, output, sparse, ids):
    """Any sample shape, variables, output, read path and indices (duplicates, any order) against isel."""
    import xinsitu.batches.mapstyle as mod

    ds, ms = shapes_archive
    split, kw = case
    stack = output == "stack"
    if stack:
        variables = ["a", "b"]
    monkeypatch.setattr(mod, "SPARSE_PER_UNIT", sparse)
    check_shape_case(ds, ms[split], kw, variables, "numpy" if stack else output, stack, ids)


def test_issue_point_samples(tmp_path):
    """The report's case: a time split sampled over (y, x), every sample one point."""
    src = xr.Dataset({"a": (("time", "y", "x"), np.arange(30 * 8 * 8, dtype="f4").reshape(30, 8, 8))},
                     coords={"time": np.arange(30), "y": np.arange(8), "x": np.arange(8)})
    src.to_zarr(tmp_path / "p.zarr", encoding={"a": {"chunks": (5, 4, 4)}}, consolidated=True)
    ds = xinsitu.open_zarr(str(tmp_path / "p.zarr"))
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    d = ds.insitu.dataset(m, "val", output="numpy", over=["y", "x"])
    assert d[0]["a"] == 960
    assert [it["a"] for it in d.__getitems__([0, 1, 5])] == [960, 961, 965]
    assert np.array_equal(d.batch(range(len(d)))["a"], np.arange(960, 1920, dtype="f4"))


def test_gen_sample_counts_a_negative_index_from_the_end(era5):
    """``gen.sample(-1)`` is the last sample, as ``d[-1]`` is (it raised IndexError); ``-n - 1`` and ``n``
    are out of range."""
    ds, m = era5
    gen = ds.insitu.batches(m, "train", batch_size=4)
    d = InsituDataset(ds, m, "train")
    n = len(d)
    assert gen.n_samples == n
    last = gen.sample(-1)
    np.testing.assert_array_equal(last.t2m.values, gen.sample(n - 1).t2m.values)
    np.testing.assert_array_equal(last.t2m.values, d[-1]["t2m"])
    assert last.time.values == gen.sample(n - 1).time.values
    for bad in (n, -n - 1):
        with pytest.raises(IndexError, match="out of range"):
            gen.sample(bad)
