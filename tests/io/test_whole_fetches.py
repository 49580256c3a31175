"""Whole chunks over HTTP by callbacks (``reader._WholeFetches``): one sample per chunk, so every
slot of a buffer is one whole chunk, fetched by obstore and decoded into place with no task per
chunk. Checked against plain xarray, against a real server on 127.0.0.1 that injects faults:
the slots of the in-flight limit all come back, an error is one request named, a request that
never answers and bytes that fail to decode go the long way and heal."""

from __future__ import annotations

import time

import numpy as np
import pytest
import xarray as xr

import xinsitu
from tests.support.servers import Faults, FileServer, write_archive

VARS = ["t2m", "u10", "v10", "z500"]
KW = {"batch_size": 8, "output": "numpy", "seed": 3}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("whole")
    write_archive(path / "c1.zarr", nt=48, ny=4, nx=8, chunk_time=1)
    return path


@pytest.fixture(scope="module")
def expected(root):
    return xr.open_zarr(root / "c1.zarr", chunks=None)[VARS].load()


def _check(gen, ds, expected) -> int:
    """Every batch equals ``expected.isel`` of its samples, bit for bit; the samples seen."""
    seen = 0
    for ids, batch in zip(gen.batch_ids(), gen, strict=True):
        ids = np.asarray(ids).ravel()
        for v in VARS:
            want = expected[v].isel(time=ids).values
            assert np.array_equal(batch[v], want, equal_nan=True), v
        seen += len(ids)
    return seen


def _slots_back(gen, wait_s: float = 10.0) -> bool:
    """Whether every slot of the generator's in-flight limit is free again (waits a little: the reads
    of a closed epoch end on the I/O loop)."""
    lim = gen._reader.inflight
    t_end = time.monotonic() + wait_s
    while time.monotonic() < t_end:
        if lim.held() == 0 and lim.free() == lim.limit:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_whole_chunks_over_http_equal_xarray_and_every_slot_comes_back(root, expected):
    with FileServer(root) as srv:
        ds = xinsitu.open_zarr(f"{srv.url}/c1.zarr")[VARS]
        m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
        gen = ds.insitu.batches(m, "train", max_inflight=8, **KW)  # fewer slots than chunks: they queue
        for epoch in (0, 1):
            gen.set_epoch(epoch)
            assert _check(gen, ds, expected) == m.positions("train")
        assert _slots_back(gen)
        assert srv.ranged >= 36  # whole objects as one open range each
        gen.set_epoch(2)
        it = iter(gen)
        next(it)
        it.close()  # closed with reads in flight: theirs come back too
        assert _slots_back(gen)


def test_an_error_is_one_request_and_names_the_chunk(root):
    """A 403 (obstore does not retry it) ends the epoch with the chunk named, after one request:
    the long way does not ask again."""
    with FileServer(root, Faults(always=r"/c1.zarr/u10/c/5/0/0$", always_status=403)) as srv:
        ds = xinsitu.open_zarr(f"{srv.url}/c1.zarr")[VARS]
        m = ds.insitu.split("time", fractions={"train": 1.0})
        gen = ds.insitu.batches(m, "train", **KW)
        with pytest.raises(xinsitu.ChunkReadError) as ei:
            for _ in gen:
                pass
        assert ei.value.var == "u10" and ei.value.key == "u10/c/5/0/0", str(ei.value)
        assert srv.counts["always"] == 1
        assert _slots_back(gen)


@pytest.mark.parametrize("kind", ["hang", "short"])
@pytest.mark.slow
def test_no_answer_or_bytes_that_fail_to_decode_go_the_long_way(root, expected, monkeypatch, kind):
    """A request that never answers (past ``XINSITU_REQUEST_TIMEOUT``) or a body cut short where
    HTTP cannot see it: fetched again, the epoch is exact."""
    monkeypatch.setenv("XINSITU_REQUEST_TIMEOUT", "0.5")
    faults = Faults(**{kind: 1.0}, max_per_key=1, pattern=r"/c1.zarr/(t2m|v10)/c/(3|17|30)/0/0$")
    with FileServer(root, faults) as srv:
        ds = xinsitu.open_zarr(f"{srv.url}/c1.zarr")[VARS]
        m = ds.insitu.split("time", fractions={"train": 1.0})
        gen = ds.insitu.batches(m, "train", **KW)
        assert _check(gen, ds, expected) == 48
        assert srv.counts[kind] == 6
        assert _slots_back(gen)
