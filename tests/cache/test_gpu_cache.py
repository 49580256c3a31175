"""The device cache tier (SPEC §4 "Cache across epochs", ``ChunkCache(device=...)``): decoded chunks in
GPU memory within a byte budget, keep-what-fits like the memory tier, a batch gathered from many
chunks in one take per slab. Through the stand-in arrays (numpy) here; on CuPy with the ``gpu`` marker."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import xinsitu
from tests.support.gpu import CUDA, CountingArrays
from xinsitu.cache.device_tier import DeviceCache, HostArrays


def chunk(i, shape=(4, 5), dtype="f4"):
    return np.full(shape, i, dtype=dtype)


def test_keeps_what_fits_within_the_budget():
    n = chunk(0).nbytes
    c = DeviceCache(5 * n + n // 2, HostArrays())
    kept = [c.put(("t2m", (i,)), chunk(i)) for i in range(8)]
    assert kept == [True] * 5 + [False] * 3  # then keeps them: no eviction
    assert c.stats.bytes == 5 * n <= c.budget and c.stats.refused == 3 and len(c) == 5
    assert c.put(("t2m", (0,)), chunk(0))  # already there
    assert c.stats.bytes == 5 * n
    np.testing.assert_array_equal(c.get(("t2m", (3,))), chunk(3))
    assert c.get(("t2m", (7,))) is None


def test_the_budget_bounds_the_device_memory_its_slabs_take():
    """Each class of chunks (shape, dtype) had a slab sized to the whole rest of the budget: 6 classes of a
    few kB each took 5.9 budgets of device memory (a model's), while the tier said it used a few kB. The slabs
    made stay within the budget now, each class taking a little at first; every class is kept while it fits."""

    class Tracking(HostArrays):
        made = 0

        def empty(self, shape, dtype):
            out = super().empty(shape, dtype)
            self.made += out.nbytes
            return out

    arrays = Tracking()
    c = DeviceCache(1 << 20, arrays)
    chunks = [np.zeros(2048, "f4"), np.zeros(1024, "f8"), np.zeros(4096, "i2"), np.zeros(8192, "u1"),
              np.zeros((16, 128), "f4"), np.zeros((128, 16), "f4")]
    assert all(c.put(("v", i), x) for i, x in enumerate(chunks))
    assert arrays.made <= c.budget, arrays.made
    k = 0
    while c.put(("more", k), chunks[k % 6]):  # then fill it: within the budget to the last slab
        k += 1
    assert arrays.made <= c.budget and c.stats.bytes <= arrays.made and k > 60


def test_gather_one_take_per_slab_in_key_order():
    arrays = HostArrays()
    c = DeviceCache(10**6, arrays)
    for i in range(6):
        c.put(i, chunk(i))
    out = c.gather([4, 0, 5, 5, 2])
    assert out.shape == (5, 4, 5)
    assert [int(out[k, 0, 0]) for k in range(5)] == [4, 0, 5, 5, 2]
    assert arrays.allocs == 1  # one slab for chunks of one shape and dtype
    assert c.stats.hits == 5


def test_gather_across_slabs_and_missing_keys():
    arrays = HostArrays()
    c = DeviceCache(10**6, arrays)
    c.SLAB_ROWS = 2
    for i in range(5):
        c.put(i, chunk(i))
    assert arrays.allocs == 3
    out = c.gather([4, 1, 2, 0])
    assert [int(out[k, 0, 0]) for k in range(4)] == [4, 1, 2, 0]
    with pytest.raises(KeyError, match="not in the device cache: 9 and 1 more"):
        c.gather([0, 9, 10])
    assert c.stats.misses == 2


def test_shapes_and_dtypes_keep_their_own_slabs():
    c = DeviceCache(10**6, HostArrays())
    c.put("a", chunk(1, (2, 3), "f4"))
    c.put("b", chunk(2, (2, 3), "i2"))
    c.put("c", chunk(3, (3, 3), "f4"))
    assert c.get("b").dtype == np.int16 and c.get("c").shape == (3, 3)


def strided_stack(n, fill=-1.0):
    """``n`` rows of chunk shape (4, 5) as a channel slice of a batch (not contiguous across rows), and the
    batch."""
    batch = np.full((n, 3, 4, 5), fill, "f4")
    return batch[:, 1], batch


@pytest.mark.parametrize("slab_rows", [2, 256])
@pytest.mark.parametrize("cached", ["all", "some"])
def test_copy_out_takes_once_per_slab_into_a_strided_stack(slab_rows, cached):
    arrays = CountingArrays()
    c = DeviceCache(10**6, arrays)
    c.SLAB_ROWS = slab_rows
    have = list(range(7)) if cached == "all" else [0, 2, 4, 6]
    for k in have:
        c.put(k, chunk(k))
    order = [5, 0, 6, 3, 1, 4, 2]
    places = c.locate_many(order)
    stack, batch = strided_stack(len(order))
    before = arrays.calls
    c.copy_out(places, [stack[i] for i in range(len(order))], stack)
    per_slab: dict[int, int] = {}
    for p in places:
        if p is not None:
            per_slab[id(p[0])] = per_slab.get(id(p[0]), 0) + 1
    # per slab: one take into the stack where it holds every row, else a take and a scatter (a lone chunk:
    # copied as it is)
    want = sum(1 if k == len(order) else 0 if k == 1 else 2 for k in per_slab.values())
    assert arrays.calls - before == want <= 2 * len(per_slab)
    for i, k in enumerate(order):
        np.testing.assert_array_equal(stack[i], chunk(k) if k in have else np.full((4, 5), -1, "f4"))
    assert (batch[:, 0] == -1).all() and (batch[:, 2] == -1).all()  # nothing beside the channel slice


def test_copy_out_without_a_stack_copies_each_chunk():
    c = DeviceCache(10**6, HostArrays())
    for k in range(3):
        c.put(k, chunk(k))
    outs = [np.zeros((4, 5), "f4") for _ in range(4)]
    c.copy_out(c.locate_many([2, 9, 0, 1]), outs)
    assert [int(o[0, 0]) for o in outs] == [2, 0, 0, 1]


@pytest.mark.parametrize("slab_rows", [2, 256])
@pytest.mark.parametrize("with_stack", [True, False])
def test_put_many_keeps_what_fits_once_per_key(slab_rows, with_stack):
    n = chunk(0).nbytes
    arrays = CountingArrays()
    c = DeviceCache(5 * n, arrays)
    c.SLAB_ROWS = slab_rows
    stack, _ = strided_stack(8)
    for i in range(8):
        stack[i] = chunk(i)
    keys = ["a", "b", "c", "b", "d", "e", "f", "g"]  # "b" twice: one row
    kept = c.put_many(keys, list(range(8)), [stack[i] for i in range(8)], stack if with_stack else None)
    assert kept == 6 and len(c) == 5 and c.stats.refused == 2 and c.stats.bytes == 5 * n
    for key, i in [("a", 0), ("b", 1), ("c", 2), ("d", 4), ("e", 5)]:
        np.testing.assert_array_equal(c.get(key), chunk(i))
    assert c.get("f") is None and c.get("g") is None
    slabs = -(-5 // min(slab_rows, 5))
    assert arrays.calls <= (slabs if with_stack else 0)  # at most a take per slab, never one per chunk
    # a run of positions in one slab is copied as one slice; a later call adds to the slab's rows
    c2 = DeviceCache(10**6, arrays)
    assert c2.put_many([1, 2, 3], [0, 1, 2], [stack[i] for i in range(8)], stack) == 3
    assert c2.put_many([4], [7], [stack[i] for i in range(8)], stack) == 1
    assert [int(c2.get(k)[0, 0]) for k in (1, 2, 3, 4)] == [0, 1, 2, 7]


@pytest.mark.parametrize("bad", [-1, True, "1GB", 1.5])
def test_budget_validated(bad):
    with pytest.raises(ValueError, match="budget"):
        DeviceCache(bad, HostArrays())


@pytest.mark.parametrize("bad,exc", [(True, TypeError), (-5, ValueError), ("lots", ValueError), ([1], TypeError)])
def test_chunk_cache_device_argument_validated(bad, exc):
    with pytest.raises(exc, match="device"):
        xinsitu.ChunkCache(memory="1MB", device=bad)


@pytest.mark.skipif(CUDA, reason="the error of a machine without CuPy or CUDA")
def test_chunk_cache_device_without_gpu_names_the_extra():
    with pytest.raises(RuntimeError, match=r"device=.*(xinsitu\[gpu-cu12\]|no CUDA device)"):
        xinsitu.ChunkCache(memory="1MB", device="1GB")


def test_chunk_cache_without_device_tier_pickles():
    c = xinsitu.ChunkCache(memory="1MB", device=None)
    assert c.device_budget == 0
    assert pickle.loads(pickle.dumps(c)).device_budget == 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cupy_device_cache():
    cupy = pytest.importorskip("cupy")
    cc = xinsitu.ChunkCache(memory="1MB", device="1MB")
    assert pickle.loads(pickle.dumps(cc)).device_budget == 10**6
    c = DeviceCache(cc.device_budget)
    c.SLAB_ROWS = 4
    for i in range(6):
        assert c.put(i, chunk(i))
    out = c.gather([3, 1, 5])
    assert isinstance(out, cupy.ndarray)
    assert [int(v) for v in cupy.asnumpy(out[:, 0, 0])] == [3, 1, 5]
    # a batch's channel slice (strided) filled from the tier in a take per slab, and kept from it
    batch = cupy.full((5, 3, 4, 5), -1, "f4")
    stack = batch[:, 1]
    order = [3, 8, 1, 5, 0]  # 8: not cached; 0..3 and 4..5 in two slabs
    c.copy_out(c.locate_many(order), [stack[i] for i in range(5)], stack)
    got = cupy.asnumpy(batch)
    for i, k in enumerate(order):
        np.testing.assert_array_equal(got[i, 1], chunk(k) if k != 8 else np.full((4, 5), -1, "f4"))
    assert (got[:, 0] == -1).all() and (got[:, 2] == -1).all()
    stack[...] = cupy.asarray(np.stack([chunk(10 + i) for i in range(5)]))
    assert c.put_many(["a", "b", "c"], [0, 1, 3], [stack[i] for i in range(5)], stack) == 3
    assert [int(c.get(k)[0, 0]) for k in ("a", "b", "c")] == [10, 11, 13]


def test_a_gpu_tier_that_keeps_nothing_says_so_and_the_reprs_show_it(era5_path):
    """A ``ChunkCache`` with a tier in GPU memory given to a generator whose batches are host arrays
    (``output="numpy"``): the tier keeps nothing, and the generator says so once, in a warning and in its
    repr, with the reason (it was silent, and no repr showed the tier at all)."""
    import warnings

    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    cache = xinsitu.ChunkCache(memory=0)
    cache.device_budget = 10**9  # what ChunkCache(device="1GB") sets (it needs CuPy to be made)
    assert repr(cache) == "ChunkCache(memory=off, disk=off, device=1.0 GB (not used yet))"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen = ds.insitu.batches(m, "train", batch_size=8, output="numpy", cache=cache)
        ds.insitu.batches(m, "val", batch_size=8, output="numpy", cache=cache)
    said = [str(w.message) for w in caught if "GPU tier" in str(w.message)]
    assert len(said) == 1 and "keeps nothing" in said[0] and "output='numpy'" in said[0], said
    text = repr(gen)
    assert "device 1.0 GB (not used yet)" in text and "device tier: keeps nothing" in text, text
