"""A chunk with no object in the store reads as the fill value (zarr's rule), but never in
silence: ``io_stats["missing"]`` counts it, a ``UserWarning`` names it once per epoch, and
``missing="raise"`` makes it a ``ChunkReadError`` naming the variable, the chunk and the key
(a deleted archive, a transient 404)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

import xinsitu
from tests.support.servers import Faults, FileServer, write_archive

KEY = "z500/c/2/0/0"  # time steps 16..23


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_archive(tmp_path_factory.mktemp("missing") / "clean.zarr", nt=48, ny=4, nx=4, chunk_time=8)


@pytest.fixture(scope="module")
def holed(clean: str) -> str:
    path = Path(clean).parent / "holed.zarr"
    shutil.copytree(clean, path)
    (path / KEY).unlink()
    return str(path)


def _gen(url: str, **kw):
    ds = xinsitu.open_zarr(url)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    return ds.insitu.batches(m, "train", batch_size=8, block_chunks=2, output="numpy", seed=2, **kw)


def _check_values(gen, path: str) -> None:
    """Every batch equals plain xarray (which reads the missing chunk as NaN, the fill value)."""
    ref = xr.open_zarr(path, chunks=None)
    n = 0
    for ids, b in zip(gen.batch_ids(), list(gen), strict=True):
        for v in b:
            assert np.array_equal(b[v], ref[v].values[ids], equal_nan=True), v
        n += int(np.isnan(b["z500"]).all(axis=(1, 2)).sum())
    assert n == 8  # the 8 time steps of the missing chunk


def test_missing_chunk_counts_and_warns_once_per_epoch(holed):
    gen = _gen(holed)
    for epoch in range(2):
        gen.set_epoch(epoch)
        with pytest.warns(UserWarning, match=rf"epoch {epoch} .*: 1 chunk\(s\) had no object.*'z500'.*"
                                             rf"{KEY}.*missing='raise'") as rec:
            _check_values(gen, holed)
        assert len([w for w in rec if "had no object" in str(w.message)]) == 1
        assert gen.io_stats["missing"] == 1
        assert gen.io_stats["missing_chunk"] == ("z500", (2, 0, 0), KEY)


def test_no_missing_chunk_no_warning(clean):
    gen = _gen(clean)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        list(gen)
    assert gen.io_stats["missing"] == 0


def _raises(gen) -> None:
    with pytest.raises(xinsitu.ChunkReadError) as info:
        list(gen)
    e = info.value
    assert (e.var, e.chunk, e.key) == ("z500", (2, 0, 0), KEY)
    assert "'z500'" in str(e) and "(2, 0, 0)" in str(e) and KEY in str(e) and "missing='raise'" in str(e)


@pytest.mark.slow
def test_missing_raise_local_and_remote(clean, holed):
    _raises(_gen(holed, missing="raise"))
    with FileServer(Path(holed).parent) as srv:
        _raises(_gen(f"{srv.url}/holed.zarr", missing="raise"))  # deleted: the server answers 404
        # the object is there, but the store answers 404 for it (a transient 404)
        srv.faults = Faults(always=rf"/clean.zarr/{KEY}$", always_status=404)
        _raises(_gen(f"{srv.url}/clean.zarr", missing="raise"))
        gen = _gen(f"{srv.url}/clean.zarr")
        with pytest.warns(UserWarning, match="1 chunk"):
            list(gen)
        assert gen.io_stats["missing"] == 1
        srv.faults = Faults()
        gen = _gen(f"{srv.url}/clean.zarr", missing="raise")
        assert len(list(gen)) == len(gen) and gen.io_stats["missing"] == 0


def test_missing_sample_raises(holed):
    gen = _gen(holed, missing="raise")
    gen.sample(0)
    with pytest.raises(xinsitu.ChunkReadError, match="missing='raise'"):
        gen.sample(17)


@pytest.mark.parametrize("bad", ["no", None, True, "Raise"])
def test_missing_argument_is_validated(clean, bad):
    with pytest.raises(ValueError, match="missing"):
        _gen(clean, missing=bad)


def test_missing_chunk_of_one_variable_among_a_batchs_one_step_chunks(tmp_path):
    """One step per chunk (batches filled in place, every variable's chunk files read by one set of
    decode-thread jobs): a missing chunk of the last variable reads as its fill value while the other
    variables' chunks of the same batch land, is counted and named as that variable's, and with
    ``missing="raise"`` fails naming it."""
    path = write_archive(tmp_path / "c1.zarr", nt=24, ny=4, nx=4, chunk_time=1)
    ds = xinsitu.open_zarr(path)
    names = [v for v in ds.data_vars if "time" in ds[v].dims]
    last = names[-1]
    key = f"{last}/c/5/0/0"
    (Path(path) / key).unlink()
    gen = _gen(path, variables=names, stack=True)
    assert gen.buffer_reason is None  # filled in place, no shuffle buffer
    ref = xr.open_zarr(path, chunks=None)
    with pytest.warns(UserWarning, match="1 chunk"):
        batches = list(gen)
    for ids, b in zip(gen.batch_ids(), batches, strict=True):
        want = np.stack([ref[v].values[ids] for v in names], axis=1)
        assert np.array_equal(b, want, equal_nan=True)
    assert gen.io_stats["missing"] == 1
    assert gen.io_stats["missing_chunk"] == (last, (5, 0, 0), key)
    with pytest.raises(xinsitu.ChunkReadError) as info:
        list(_gen(path, variables=names, stack=True, missing="raise"))
    assert (info.value.var, info.value.chunk, info.value.key) == (last, (5, 0, 0), key)
