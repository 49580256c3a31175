"""``xinsitu.io.mempool.ArrayPool``: the one way batch memory is reused. Arrays given back are handed out
again (block buffers); arrays of a counted pool are handed out again only once nothing else holds them
(stacked batches); both keep a bounded number; memory comes from ``alloc`` where given."""

from __future__ import annotations

import pickle

import numpy as np

import xinsitu
from xinsitu.batches.buffer import BufferLoader
from xinsitu.io import loop as _loop
from xinsitu.io.mempool import ArrayPool
from xinsitu.io.reader import Reader


def test_given_back_is_handed_out_again_per_shape_and_dtype():
    pool = ArrayPool(keep=2)
    a = pool.take([3, 4], np.float32)
    assert a.shape == (3, 4) and a.dtype == np.float32
    pool.give_back(a)
    assert pool.take((3, 5), np.float32) is not a  # another shape: memory of its own
    assert pool.take((3, 4), np.float64) is not a  # another dtype
    assert pool.take((3, 4), "float32") is a
    assert pool.take((3, 4), np.float32) is not a  # handed out: not twice


def test_given_back_keeps_at_most_keep_per_shape():
    pool = ArrayPool(keep=2)
    arrays = [pool.take((8,), np.int16) for _ in range(3)]
    for a in arrays:
        pool.give_back(a)
    again = [pool.take((8,), np.int16) for _ in range(3)]
    kept = [x for x in again if any(x is a for a in arrays)]
    assert len(kept) == 2


def test_counted_takes_back_only_what_nothing_holds():
    pool = ArrayPool(keep=3, counted=True)
    a = pool.take((16,), np.uint8)
    view = a[2:5]
    del a
    b = pool.take((16,), np.uint8)
    assert b.base is None and not np.shares_memory(b, view)  # the view holds a's memory
    at = b.ctypes.data
    del b
    c = pool.take((16,), np.uint8)
    assert c.ctypes.data == at  # nothing held b: taken back


def test_counted_holds_at_most_keep():
    import weakref

    pool = ArrayPool(keep=2, counted=True)
    first = pool.take((4,), np.uint8)
    gone = weakref.ref(first)
    others = [pool.take((4,), np.uint8) for _ in range(2)]  # keep=2: the pool lets go of the oldest
    del first
    assert gone() is None and len(others) == 2


def test_alloc_makes_the_memory_and_is_counted_as_it_is():
    made: list[np.ndarray] = []

    def alloc(nbytes: int) -> np.ndarray:
        made.append(np.zeros(nbytes, np.uint8))
        return made[-1]

    pool = ArrayPool(keep=4, alloc=alloc, counted=True)
    a = pool.take((32,), np.uint8)
    assert a is made[0] and len(made) == 1
    made.clear()  # only the pool (and a) hold it now
    f = pool.take((32,), np.uint8)  # a is alive: new memory
    assert f is made[0] and not np.shares_memory(f, a)
    made.clear()
    del a
    assert pool.take((32,), np.uint8) is not None and not made  # taken back, nothing made
    given = ArrayPool(keep=1, alloc=alloc)
    g = given.take((2, 3), np.float64)  # other shapes and dtypes: a view of alloc's bytes
    assert g.shape == (2, 3) and g.dtype == np.float64 and made[0].nbytes == 48


def test_pickled_pool_starts_empty():
    pool = ArrayPool(keep=2)
    a = pool.take((3,), np.float32)
    pool.give_back(a)
    copy = pickle.loads(pickle.dumps(pool))
    assert copy.keep == 2 and copy.take((3,), np.float32) is not a


def test_buffer_arrays_are_recycled_into_the_next_buffer(tmp_path):
    """The page-fault saving of block buffers: a recycled buffer's arrays are the next buffer's."""
    import xarray as xr

    ds = xr.Dataset({"a": (("time", "x"), np.arange(60, dtype="float32").reshape(30, 2))})
    p = str(tmp_path / "r.zarr")
    ds.to_zarr(p, encoding={"a": {"chunks": (4, 2)}}, zarr_format=3, consolidated=False)
    ds = xinsitu.open_zarr(p)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", batch_size=4, output="numpy", block_chunks=2, shuffle=False)
    plan = gen.plan()
    loader = BufferLoader(gen.space, gen.layouts, Reader())
    first = _loop.run(loader.load(plan, 0))
    at = first.arrays["a"].ctypes.data
    shape = first.arrays["a"].shape
    loader.recycle(first)
    second = _loop.run(loader.load(plan, 1))
    assert second.arrays["a"].shape == shape and second.arrays["a"].ctypes.data == at
    np.testing.assert_array_equal(loader.gather(second, np.arange(len(second.ids)))["a"],
                                  ds["a"].isel(time=xr.DataArray(second.starts[:, 0], dims="sample")).values)


def test_take_waits_for_the_pool_s_lock():
    """One array to one caller where several threads take (the prefetch thread, decode threads): ``take``
    and ``give_back`` hold the pool's lock. Held here, a ``take`` in another thread waits for it (and a
    slow machine only makes it wait longer), then goes on once it is let go."""
    import threading

    pool = ArrayPool(keep=2)
    pool.give_back(pool.take((4,), np.float32))
    got = []
    with pool._lock:
        t = threading.Thread(target=lambda: got.append(pool.take((4,), np.float32)), daemon=True)
        t.start()
        t.join(0.3)
        waited = t.is_alive() and not got
    t.join(30)
    assert waited and len(got) == 1 and not t.is_alive()
