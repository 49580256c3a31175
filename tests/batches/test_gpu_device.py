"""Copies that overlap (SPEC §4 "GPU"): a ring of reused pinned staging buffers, copies on xinsitu's
own stream, an event per batch that the caller's stream waits on; a staging buffer is rewritten only
after its copy completed. The rules run here through the stand-in device (numpy for device memory,
copies that run only once an event after them is waited on); the real ones are marked ``gpu``."""

from __future__ import annotations

import collections

import numpy as np
import pytest

import xinsitu
from tests.support.gpu import CUDA
from xinsitu.batches.device_copy import DeviceMover, StandInDevice
from xinsitu.codecs.nvcomp import gpu_extra_hint


@pytest.fixture
def ds_m(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    return ds, ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})


def test_ring_reuses_pinned_buffers_and_keeps_values():
    dev = StandInDevice()
    mover = DeviceMover(dev, slots=3)
    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(4, 5)).astype("f4"), "y": np.arange(3, dtype="i8") + i} for i in range(10)]
    got = []
    for b in batches:
        moved = mover.move(b)
        got.append(mover.hand_out(moved))  # the caller's stream waits: the copy is then done
    for b, g in zip(batches, got, strict=True):
        np.testing.assert_array_equal(g["x"], b["x"])
        np.testing.assert_array_equal(g["y"], b["y"])
    assert dev.pinned_allocs == 3  # one per slot, then reused
    assert mover.stats.slot_of[:6] == [0, 1, 2, 0, 1, 2]
    assert [e[0] for e in dev.log if e[0] == "wait"] == ["wait"] * 10


def test_staging_buffer_reused_only_after_its_copy_completed():
    """Copies that have not run when the slot comes round again: the mover waits for the slot's event
    before overwriting it, so every batch arrives intact (without the wait, batch 0 would read batch 3)."""
    dev = StandInDevice()
    mover = DeviceMover(dev, slots=3)
    batches = [np.full((8,), i, dtype="f8") for i in range(7)]
    moved = [mover.move(b) for b in batches]  # nobody handed out yet: copies still queued
    assert mover.stats.waits == 4  # slots 0, 1, 2 came round for batches 3..6
    syncs = [e for e in dev.log if e[0] == "synchronize"]
    assert [s[1] for s in syncs] == ["1", "2", "3", "4"]  # the events of batches 0..3, in order
    for i, m in enumerate(moved):
        mover.hand_out(m)
        np.testing.assert_array_equal(m, batches[i])


def test_pinned_batch_memory_copied_straight_and_not_reused_before_its_copy():
    """A batch gathered into the mover's page-locked memory (BatchArrays(alloc=mover.host_alloc)) is
    copied from there without staging, and BatchArrays does not hand that memory out again until its
    copy completed (the mover holds it till then)."""
    from xinsitu.batches.output import BatchArrays

    dev = StandInDevice()
    mover = DeviceMover(dev, slots=2)
    arrays = BatchArrays(alloc=mover.host_alloc)
    a = arrays.empty((4, 5), "f4")
    a[...] = 7
    moved = mover.move(a)
    first = a.ctypes.data
    del a
    b = arrays.empty((4, 5), "f4")  # a's copy has not run: its memory is still held
    assert b.ctypes.data != first
    b[...] = -3
    moved_b = mover.move(b)
    assert mover.stats.direct == 2 and mover.stats.pinned_allocs == 0 and mover.stats.host_allocs == 2
    assert mover.hand_out(moved).tolist() == np.full((4, 5), 7, "f4").tolist()
    assert mover.hand_out(moved_b).tolist() == np.full((4, 5), -3, "f4").tolist()
    del b
    c = arrays.empty((4, 5), "f4")
    c[...] = 1
    assert mover.hand_out(mover.move(c)).tolist() == np.ones((4, 5), "f4").tolist()
    del c
    arrays.empty((4, 5), "f4")  # the completed copies' memory was given back as the ring turned
    assert mover.stats.host_allocs == 2


def test_non_contiguous_or_foreign_arrays_are_staged():
    dev = StandInDevice()
    mover = DeviceMover(dev)
    pinned = mover.host_alloc(400).view("f4")
    pinned[:] = np.arange(100)
    out = mover.hand_out(mover.move({"strided": pinned[::2], "foreign": np.arange(3.0), "in": pinned[:10]}))
    assert out["strided"].tolist() == list(range(0, 100, 2)) and out["foreign"].tolist() == [0, 1, 2]
    assert out["in"].tolist() == list(range(10))
    assert mover.stats.direct == 1 and mover.stats.pinned_allocs == 1


def test_caller_waits_on_the_batch_event_not_the_host():
    dev = StandInDevice()
    mover = DeviceMover(dev)
    a = mover.move({"x": np.ones(3)})
    b = mover.move({"x": np.zeros(3)})
    mover.hand_out(a)
    waits = [e for e in dev.log if e[0] == "wait"]
    assert waits == [("wait", "caller", "1")]  # batch a's event, on the caller's stream
    assert not [e for e in dev.log if e[0] == "synchronize"]  # no host wait
    mover.hand_out(b)
    assert b["x"].tolist() == [0, 0, 0]


def test_structure_kept_non_arrays_untouched():
    dev = StandInDevice()
    mover = DeviceMover(dev)
    Pair = collections.namedtuple("Pair", "x y")
    src = Pair({"a": np.arange(4.0), "name": "t2m", "t": np.array(["2020"], dtype="datetime64[D]")}, [np.ones(2), 3])
    out = mover.hand_out(mover.move(src))
    assert isinstance(out, Pair) and out.x["name"] == "t2m" and out.y[1] == 3
    assert out.x["t"] is src.x["t"]  # not a number: stays on the host as it is
    assert out.x["a"] is not src.x["a"] and out.x["a"].tolist() == [0, 1, 2, 3]


def test_bigger_batch_grows_a_slot():
    dev = StandInDevice()
    mover = DeviceMover(dev, slots=2)
    for n in (4, 4, 400, 4, 400):
        out = mover.hand_out(mover.move(np.arange(n, dtype="f4")))
        np.testing.assert_array_equal(out, np.arange(n, dtype="f4"))
    assert dev.pinned_allocs == 3  # two slots, one grown


class OwnArraysDevice(StandInDevice):
    """A device API that gives the caller arrays of its own at hand-out (as CuPy's does)."""

    def hand_out(self, event, arrays):
        super().hand_out(event, arrays)
        return [a.copy() for a in arrays]


def test_caller_gets_arrays_of_its_own_in_the_same_structure():
    dev = OwnArraysDevice()
    mover = DeviceMover(dev)
    src = ({"x": np.arange(3.0)}, [np.ones(2, "i4"), "keep"])
    moved = mover.move(src)
    out = mover.hand_out(moved)
    assert out is not moved and isinstance(out, tuple) and out[1][1] == "keep"
    assert out[0]["x"] is not moved[0]["x"] and out[0]["x"].tolist() == [0, 1, 2]
    assert out[1][0].dtype == np.int32 and out[1][0].tolist() == [1, 1]
    assert mover.hand_out(out) is out  # not one of ours: handed on as it is


@pytest.mark.parametrize("slots", [1, 0, "2"])
def test_slots_validated(slots):
    with pytest.raises(ValueError, match="slots"):
        DeviceMover(StandInDevice(), slots=slots)


def test_arrays_on_the_device_already_are_handed_out_like_copies():
    """A batch built on the device (the GPU path), or a transform's device arrays: not copied again,
    and handed out as the copied ones are -- the caller's stream waits on the batch's event."""
    from xinsitu.batches.device_copy import StandInDeviceArray

    dev = StandInDevice()
    mover = DeviceMover(dev)
    built = np.arange(6.0).view(StandInDeviceArray)
    moved = mover.move({"x": built, "lsm": np.ones(3, "f4")})
    assert moved["x"] is built and mover.stats.direct == 0 and mover.stats.pinned_allocs == 1
    out = mover.hand_out(moved)
    assert [e[0] for e in dev.log].count("wait") == 1
    assert out["x"] is built and out["lsm"].tolist() == [1, 1, 1]


def test_stand_in_stream_runs_each_copy_once_under_threads():
    """The stand-in is a device: two threads waiting on its events at once (the prefetch thread on a
    slot, the caller on a batch) run every enqueued copy exactly once, in order -- else the
    generator test below sees copies that never ran, now and then."""
    import threading
    import time

    dev = StandInDevice()
    stream = dev.stream()
    ran: list[int] = []
    events = []
    def copy(i: int) -> None:
        time.sleep(0)  # a real copy lets go of the GIL: the other thread runs meanwhile
        ran.append(i)

    for i in range(4000):
        stream.enqueue(lambda i=i: copy(i))
        if i % 7 == 6:
            ev = dev.event()
            ev.record(stream)
            events.append(ev)
    barrier = threading.Barrier(4)

    def wait_all(evs):
        barrier.wait()
        for ev in evs:
            ev.synchronize()

    threads = [threading.Thread(target=wait_all, args=(events[k::2],)) for k in range(2)]
    threads += [threading.Thread(target=wait_all, args=(events[::-1],)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    stream.flush()
    assert ran == list(range(4000))


@pytest.mark.parametrize("stack", [True, False])
def test_generator_through_stand_in_device_bit_identical(ds_m, stack):
    """The generator's own path (finish in the prefetch thread, hand_out as each batch is yielded)
    through the stand-in device: every batch equals the host batch, each handed out after its wait."""
    ds, m = ds_m
    kw = dict(batch_size=5, seed=2, block_chunks=2, output="numpy", stack=stack)
    ref = [b.copy() if stack else {k: v.copy() for k, v in b.items()} for b in ds.insitu.batches(m, "train", **kw)]
    gen = ds.insitu.batches(m, "train", **kw)
    dev = StandInDevice()
    gen.builder.mover = mover = DeviceMover(dev)
    gen.builder.arrays.alloc = mover.host_alloc  # as OutputBuilder wires a real device
    n = 0
    for r, g in zip(ref, gen, strict=True):
        if stack:
            assert np.array_equal(r, g, equal_nan=True)
        else:
            assert r.keys() == g.keys() and all(np.array_equal(r[k], g[k], equal_nan=True) for k in r)
        n += 1
    assert sum(e[0] == "wait" for e in dev.log) == n
    if stack:  # gathered straight into page-locked memory: copied from there, no staging copy
        assert mover.stats.direct == n and mover.stats.pinned_allocs == 0
        assert mover.stats.host_allocs <= 6  # BatchArrays took its memory back as copies completed
    else:
        assert mover.stats.pinned_allocs <= 3


def test_gpu_extra_hint_names_both_extras():
    assert "xinsitu[gpu-cu12]" in gpu_extra_hint() and "xinsitu[gpu-cu13]" in gpu_extra_hint()


# ------------------------------------------------------------------ on a real GPU
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("stack", [True, False])
@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_real_device_ring_bit_identical(ds_m, stack, kind):
    ds, m = ds_m
    kw = dict(batch_size=8, seed=1, block_chunks=2, stack=stack)
    ref = [b.copy() if stack else {k: v.copy() for k, v in b.items()}
           for b in ds.insitu.batches(m, "train", output="numpy", **kw)]
    if kind == "torch":
        import torch

        gen = ds.insitu.batches(m, "train", output="torch", device="cuda:0", **kw)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # the caller's own current stream: the batch is safe on it
            got = [(g * 1) if stack else {k: v * 1 for k, v in g.items()} for g in gen]
        torch.cuda.synchronize()

        def host(a):
            return a.cpu().numpy()
    else:
        import cupy

        gen = ds.insitu.batches(m, "train", output="cupy", **kw)
        got = list(gen)
        host = cupy.asnumpy
    assert len(got) == len(ref)
    for r, g in zip(ref, got, strict=True):
        if stack:
            assert np.array_equal(host(g), r, equal_nan=True)
        else:
            assert all(np.array_equal(host(g[k]), r[k], equal_nan=True) for k in r)
    assert gen.builder.mover.stats.pinned_allocs <= 3


def test_cupy_output_without_cupy_names_the_extra(ds_m):
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("CuPy is installed here")
    ds, m = ds_m
    with pytest.raises(RuntimeError, match=r"output='cupy' needs CuPy: pip install 'xinsitu\[gpu-cu12\]'"):
        ds.insitu.batches(m, "train", output="cupy")


def test_mover_pickles_without_its_state():
    import pickle

    mover = DeviceMover(StandInDevice(), slots=4)
    mover.hand_out(mover.move(np.ones(3)))
    copy = pickle.loads(pickle.dumps(mover))
    assert len(copy.slots) == 4 and copy.stats.batches == 0 and copy.stream is None


def test_torch_cuda_api_pickles_without_cuda():
    import pickle

    pytest.importorskip("torch")
    from xinsitu.batches.device_copy import TorchCuda

    api = pickle.loads(pickle.dumps(TorchCuda("cuda:1")))  # no CUDA needed to make or move it
    assert str(api.device) == "cuda:1"


def test_done_asks_each_kind_of_event_its_own_way():
    """torch's events answer query(), CuPy's a done property (a CuPy batch once raised AttributeError)."""
    from xinsitu.batches.device_copy import done

    class TorchLike:
        def __init__(self, v):
            self.v = v

        def query(self):
            return self.v

    class CupyLike:
        def __init__(self, v):
            self.done = v

    assert done(TorchLike(True)) and not done(TorchLike(False))
    assert done(CupyLike(True)) and not done(CupyLike(False))
