"""Stacked batches are gathered into memory handed out before (``output.BatchArrays``), once nothing
holds it any more: a batch the user keeps, or anything made from it, is never written again.
Oracle: plain xarray, with every batch of the epoch held at once."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import xinsitu
from xinsitu.batches.output import BatchArrays
from xinsitu.io import mempool

VARS = ["t2m", "u10", "v10"]


def test_an_array_nothing_holds_is_handed_out_again():
    arrays = BatchArrays()
    assert mempool._IDLE is not None  # this interpreter counts references as we check them
    a = arrays.empty((4, 3, 5), np.float32)
    at = a.ctypes.data
    del a
    b = arrays.empty((4, 3, 5), np.float32)
    assert b.ctypes.data == at
    other = arrays.empty((4, 3, 6), np.float32)  # another size: memory of its own
    assert other.ctypes.data != at


@pytest.mark.parametrize("keep", ["array", "view", "channel", "copy_of_base", "torch", "memoryview"])
@pytest.mark.slow
def test_an_array_something_holds_is_never_handed_out(keep):
    arrays = BatchArrays()
    a = arrays.empty((4, 3, 5), np.float32)
    a[:] = 7.0
    if keep == "array":
        held = a
    elif keep == "view":
        held = a[1:3]
    elif keep == "channel":
        held = a[:, 2]
    elif keep == "copy_of_base":
        held = a.reshape(12, 5)
    elif keep == "torch":
        torch = pytest.importorskip("torch")
        held = torch.from_numpy(a)
    else:
        held = memoryview(a)
    del a
    gc.collect()
    for _ in range(BatchArrays.KEEP + 2):
        b = arrays.empty((4, 3, 5), np.float32)
        b[:] = -1.0
    assert np.all(np.asarray(held) == 7.0)


def test_pickled_starts_empty():  # generators go to spawned DataLoader workers by pickle
    import pickle

    arrays = BatchArrays()
    a = arrays.empty((3,), np.float32)
    copy = pickle.loads(pickle.dumps(arrays))
    assert isinstance(copy, BatchArrays) and not copy._pool._held and a.shape == (3,)


def test_many_threads_never_share_an_array():
    """Threads that each hold an array at the same moment (a barrier) never hold the same memory, and
    each finds its own values in it. Seen and checked here, in the test's thread."""
    import threading

    arrays = BatchArrays()
    n, rounds = 4, 50
    barrier = threading.Barrier(n, timeout=30)
    held: list[list[tuple[int, int, bool]]] = [[] for _ in range(rounds)]  # per round: (thread, address, own values)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for r in range(rounds):
                a = arrays.empty((64,), np.float64)
                a[:] = k
                barrier.wait()  # every thread holds its array now
                with lock:
                    held[r].append((k, a.ctypes.data, bool(np.all(a == k))))
                barrier.wait()
                del a
        except BaseException as e:  # noqa: BLE001 - seen by the test below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    for r in held:
        assert len(r) == n
        assert len({addr for _, addr, _ in r}) == n, r  # no two threads share memory
        assert all(own for *_, own in r), r  # nobody else wrote into a thread's array


def test_an_interpreter_without_getrefcount_imports_and_reuses_nothing(monkeypatch):
    """Where ``sys.getrefcount`` does not exist (PyPy), the module still imports; no array is ever
    taken back (nothing can say it is free)."""
    import sys

    monkeypatch.delattr(sys, "getrefcount")
    assert mempool._calibrate() is None
    monkeypatch.setattr(mempool, "_IDLE", mempool._calibrate())
    arrays = BatchArrays()
    a = arrays.empty((8,), np.float32)
    at = a.ctypes.data
    del a
    b = arrays.empty((8,), np.float32)
    assert b.ctypes.data != at


@pytest.mark.parametrize("output", ["numpy", "torch"])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.slow
def test_stacked_batches_held_all_at_once_match_xarray(era5_path, output, shuffle):
    if output == "torch":
        pytest.importorskip("torch")
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
    kw = dict(batch_size=7, shuffle=shuffle, seed=3, block_chunks=2, variables=VARS)
    gen = ds.insitu.batches(m, "train", output=output, stack=True, **kw)
    ref = ds.insitu.batches(m, "train", output="xarray", **kw)
    for epoch in range(2):  # the second epoch reuses the first's memory where it may
        gen.set_epoch(epoch)
        ref.set_epoch(epoch)
        held = list(gen)  # every batch alive at once: none may be gathered into again
        refs = list(ref)
        assert len(held) == len(refs) > BatchArrays.KEEP
        for got, xb in zip(held, refs, strict=True):
            exp = np.stack([ds[v].sel(time=xb.time).values for v in VARS], axis=1)
            got = got.numpy() if output == "torch" else got
            np.testing.assert_array_equal(got, exp)
        del held


def test_stacked_batches_dropped_one_by_one_reuse_memory(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
    kw = dict(batch_size=7, shuffle=True, seed=3, block_chunks=2, variables=VARS)
    gen = ds.insitu.batches(m, "train", output="numpy", stack=True, **kw)
    ref = ds.insitu.batches(m, "train", output="xarray", **kw)
    addresses = set()
    n = 0
    for got, xb in zip(gen, ref, strict=True):
        addresses.add(got.ctypes.data)
        exp = np.stack([ds[v].sel(time=xb.time).values for v in VARS], axis=1)
        np.testing.assert_array_equal(got, exp)
        n += 1
    assert len(addresses) <= BatchArrays.KEEP < n  # a handful of arrays served the whole epoch
