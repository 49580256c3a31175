"""xinsitu.batches.generator.BatchGenerator: its length, batch ids, slices of an epoch and its state."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import xinsitu
from xinsitu.batches.generator import BatchGenerator

NT = 37


@pytest.fixture
def ds(tmp_path) -> xr.Dataset:
    rng = np.random.default_rng(2)
    src = xr.Dataset(
        {"a": (("time", "x"), rng.standard_normal((NT, 4)).astype("float32"))},
        coords={"time": pd.date_range("2001-01-01", periods=NT, freq="D")})
    p = str(tmp_path / "l.zarr")
    src.to_zarr(p, encoding={"a": {"chunks": (5, 4)}}, zarr_format=3, consolidated=False)
    return xinsitu.open_zarr(p)


def _gen(ds, **kw):
    m = ds.insitu.split("time", fractions={"train": 1.0})
    kw.setdefault("batch_size", 6)
    return BatchGenerator(ds, m, "train", output="numpy", block_chunks=2, seed=9, **kw)


@pytest.mark.parametrize("drop_last, n", [(False, 7), (True, 6)])
def test_len_and_batch_ids_cover_split_once(ds, drop_last, n):
    gen = _gen(ds, drop_last=drop_last)
    assert len(gen) == n == len(gen.batch_ids())
    ids = np.concatenate(gen.batch_ids())
    assert [len(b) for b in gen.batch_ids()][:-1] == [6] * (n - 1)
    if drop_last:
        assert len(ids) == 36 and len(np.unique(ids)) == 36
    else:
        assert np.array_equal(np.sort(ids), np.arange(NT))


def test_epochs_differ_when_shuffled(ds):
    gen = _gen(ds)
    a, b = np.concatenate(gen.batch_ids(0)), np.concatenate(gen.batch_ids(1))
    assert np.array_equal(np.sort(a), np.sort(b)) and not np.array_equal(a, b)
    plain = _gen(ds, shuffle=False)
    assert np.array_equal(np.concatenate(plain.batch_ids()), np.arange(NT))


def test_batches_follow_batch_ids(ds):
    gen = _gen(ds)
    values = ds.a.values
    batches = list(gen)
    for b, ids in zip(batches, gen.batch_ids(), strict=True):
        np.testing.assert_array_equal(b["a"], values[ids])


def test_iter_batches_equals_slice_of_epoch(ds):
    gen = _gen(ds)
    full = list(gen)
    part = list(gen.iter_batches(2, 5))
    assert len(part) == 3
    for got, exp in zip(part, full[2:5], strict=True):
        np.testing.assert_array_equal(got["a"], exp["a"])
    tail = list(gen.iter_batches(5))
    assert len(tail) == len(full) - 5
    np.testing.assert_array_equal(tail[-1]["a"], full[-1]["a"])


def test_state_dict_and_resume(ds):
    gen = _gen(ds)
    it = iter(gen)
    first = [next(it) for _ in range(3)]
    state = gen.state_dict()
    json.dumps(state)  # JSON-able
    assert {"epoch", "batch", "split", "seed", "batch_size", "shuffle", "block_chunks",
            "drop_last", "world_size", "rank"} <= set(state)
    assert (state["epoch"], state["batch"], state["batch_size"], state["seed"]) == (0, 3, 6, 9)
    rest_ref = list(it)
    again = _gen(ds)
    again.load_state_dict(state)
    rest = list(again)
    assert len(first) + len(rest) == len(gen)
    for got, exp in zip(rest, rest_ref, strict=True):
        np.testing.assert_array_equal(got["a"], exp["a"])
    with pytest.raises(ValueError):
        _gen(ds, batch_size=5).load_state_dict(state)
