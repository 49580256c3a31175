"""transform=fn: applied to every finished batch in the prefetch thread, on host values, before the
device= copy; its exceptions reach the caller; a generator with one pickles."""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest

import xinsitu
from tests.conftest import oracle
from tests.support.own_process import own_process

torch = pytest.importorskip("torch", reason="torch is not installed")


def to_pair(batch):
    """A collate into the model's own structure: (inputs, target) with a nested dict."""
    return {"x": {"t2m": batch["t2m"], "u10": batch["u10"]}}, batch["tp"]


class Recorder:
    """Records the thread and the types it saw (a class: it pickles)."""

    def __init__(self):
        self.threads: set[int] = set()
        self.kinds: set[tuple[str, str]] = set()

    def __call__(self, batch):
        self.threads.add(threading.get_ident())
        for v in batch.values():
            self.kinds.add((type(v).__name__, str(getattr(v, "device", "host"))))
        return batch


def boom(batch):
    raise KeyError("no such field in my collate")


@pytest.fixture
def ds_m(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    return ds, ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})


def test_transform_gives_user_structure_equal_to_xarray(ds_m):
    ds, m = ds_m
    kw = dict(batch_size=7, shuffle=True, seed=3, block_chunks=2, variables=["t2m", "u10", "tp"])
    ref_gen = ds.insitu.batches(m, "train", output="xarray", **kw)
    gen = ds.insitu.batches(m, "train", output="numpy", transform=to_pair, **kw)
    n = 0
    for ref, got in zip(ref_gen, gen, strict=True):
        assert isinstance(got, tuple) and isinstance(got[0]["x"], dict)
        exp = oracle(ds[["t2m", "u10", "tp"]], ["time"],
                     np.searchsorted(ds.time.values, ref.time.values)[:, None])
        np.testing.assert_array_equal(got[0]["x"]["t2m"], exp.t2m.values)
        np.testing.assert_array_equal(got[0]["x"]["u10"], exp.u10.values)
        assert np.array_equal(got[1], exp.tp.values, equal_nan=True)
        n += len(ref.time)
    assert n == m.positions("train")


@pytest.mark.parametrize("stack", [False, True])
def test_transform_runs_in_prefetch_thread_before_device_copy(ds_m, stack):
    ds, m = ds_m
    rec = Recorder()
    if stack:
        def fn(b):
            return rec({"x": b})
    else:
        fn = rec
    gen = ds.insitu.batches(m, "train", batch_size=16, output="torch", device="cpu", stack=stack,
                            variables=["t2m", "u10"], transform=fn)
    out = list(gen)
    assert rec.threads and threading.get_ident() not in rec.threads  # off the caller's thread
    assert rec.kinds == {("Tensor", "cpu")}  # host torch tensors, before the device= copy
    first = out[0]["x"] if stack else out[0]
    assert isinstance(first, torch.Tensor) if stack else isinstance(first["t2m"], torch.Tensor)


def test_transform_output_moved_to_device_after(ds_m):
    """What the transform returns (any structure) is what device= moves: the 'meta'-free check here is
    that tensors made *by* the transform arrive as tensors on the device too."""
    ds, m = ds_m

    def extra(b):
        return [b["t2m"], (b["u10"] * 2, torch.ones(3))]

    gen = ds.insitu.batches(m, "train", batch_size=4, output="torch", device="cpu", variables=["t2m", "u10"],
                            transform=extra)
    got = next(iter(gen))
    assert isinstance(got, list) and isinstance(got[1], tuple)
    assert got[1][1].device.type == "cpu" and torch.equal(got[1][1], torch.ones(3))


def test_transform_exception_reaches_caller(ds_m):
    ds, m = ds_m
    gen = ds.insitu.batches(m, "train", batch_size=8, output="numpy", transform=boom)
    with pytest.raises(KeyError, match="no such field") as info:
        next(iter(gen))
    # the original exception, its traceback through the transform, and a note saying where
    assert any(tb.tb_frame.f_code.co_name == "boom" for tb in _walk(info.value.__traceback__))
    assert any("transform=" in note for note in getattr(info.value, "__notes__", []))
    # the generator stays usable after the error (no stuck threads): a fresh epoch raises again
    with pytest.raises(KeyError):
        list(gen)


def test_a_transform_that_returns_nothing_is_named(ds_m):
    """A transform that changes the batch in place and forgets ``return``: the loop gets what it returned,
    and a warning says so (it got None batches in silence)."""
    ds, m = ds_m

    def scale(batch):
        for v in batch:
            batch[v] *= 2

    gen = ds.insitu.batches(m, "train", batch_size=8, output="numpy", transform=scale)
    with pytest.warns(UserWarning, match="transform= returned None") as said:
        got = list(gen)
    assert got == [None] * len(gen) and len(said) == 1  # what it returned, said once


def _walk(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


@pytest.mark.parametrize("bad", [3, "collate", [to_pair]])
def test_transform_not_callable(ds_m, bad):
    ds, m = ds_m
    with pytest.raises(TypeError, match="transform must be a callable"):
        ds.insitu.batches(m, "train", transform=bad)


def test_generator_with_transform_pickles(ds_m):
    ds, m = ds_m
    kw = dict(batch_size=8, shuffle=True, seed=1, output="numpy", variables=["t2m", "u10", "tp"])
    gen = ds.insitu.batches(m, "train", transform=to_pair, **kw)
    clone = pickle.loads(pickle.dumps(gen))
    for a, b in zip(gen, clone, strict=True):
        np.testing.assert_array_equal(a[0]["x"]["t2m"], b[0]["x"]["t2m"])
        assert np.array_equal(a[1], b[1], equal_nan=True)


@pytest.mark.slow
def test_transform_in_spawned_dataloader_workers(ds_m):
    """A picklable transform travels into spawned DataLoader workers with the generator."""
    ds, m = ds_m
    gen = ds.insitu.batches(m, "train", batch_size=8, shuffle=False, output="numpy",
                            variables=["t2m", "u10", "tp"], transform=to_pair)
    dl = torch.utils.data.DataLoader(gen.to_torch(), batch_size=None, num_workers=2,
                                     multiprocessing_context="spawn")
    n = sum(len(tp) for _, tp in dl)
    assert n == m.positions("train")


def to_xy(batch):
    """docs/how-to/transform.md's collate: numpy arrays out of the (torch) batch."""
    x = np.stack([batch["t2m"], batch["u10"]], axis=1)
    return {"inputs": {"x": x, "lsm": np.asarray(batch["u10"])[:, :1]}}, np.asarray(batch["t2m"])[:, None]


@pytest.mark.parametrize("device", ["cpu", None])
def test_transform_numpy_arrays_become_tensors_on_the_device(ds_m, device):
    """SPEC §4 Other outputs: the device= copy moves every array the transform returned, numpy arrays
    becoming tensors of the output kind (not left behind as numpy on the host); without device=, tensors
    on the CPU, as the output's own arrays are (they stayed numpy: the docs' loop got no tensors)."""
    ds, m = ds_m
    kw = dict(batch_size=6, seed=4, block_chunks=2, variables=["t2m", "u10"])
    ref = [to_xy(b) for b in ds.insitu.batches(m, "train", output="numpy", **kw)]
    gen = ds.insitu.batches(m, "train", output="torch", device=device, transform=to_xy, **kw)
    n = 0
    for (rin, ry), (inputs, y) in zip(ref, gen, strict=True):
        for got, exp in ((inputs["inputs"]["x"], rin["inputs"]["x"]), (inputs["inputs"]["lsm"], rin["inputs"]["lsm"]),
                         (y, ry)):
            assert isinstance(got, torch.Tensor) and got.device.type == "cpu"
            assert np.array_equal(got.numpy(), exp, equal_nan=True)
        n += 1
    assert n == len(ref) > 0


def test_transform_non_numeric_arrays_stay_as_they_are(ds_m):
    ds, m = ds_m

    def with_time(b):
        return {"t2m": np.asarray(b["t2m"]), "names": np.array(["t2m"]), "step": 3}

    got = next(iter(ds.insitu.batches(m, "train", batch_size=4, output="torch", device="cpu", variables=["t2m"],
                                      transform=with_time)))
    assert isinstance(got["t2m"], torch.Tensor)
    assert isinstance(got["names"], np.ndarray) and got["step"] == 3


@own_process  # jax's threads and its at-fork warning stay in a child process
@pytest.mark.slow
def test_transform_output_jax_takes_numpy_and_cpu_tensors(ds_m):
    jax = pytest.importorskip("jax")
    ds, m = ds_m

    def mixed(b):
        return {"x": np.asarray(b["t2m"]), "t": torch.ones(2, dtype=torch.float32), "name": np.array(["a"])}

    got = next(iter(ds.insitu.batches(m, "train", batch_size=4, output="jax", variables=["t2m"], transform=mixed)))
    assert isinstance(got["x"], jax.Array) and isinstance(got["t"], jax.Array)
    assert np.array_equal(np.asarray(got["t"]), np.ones(2, "f4"))
    assert isinstance(got["name"], np.ndarray)  # not numbers: handed on as it is


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_transform_numpy_arrays_arrive_on_cuda(ds_m):
    ds, m = ds_m
    kw = dict(batch_size=6, seed=4, block_chunks=2, variables=["t2m", "u10"])
    ref = [to_xy(b) for b in ds.insitu.batches(m, "train", output="numpy", **kw)]
    gen = ds.insitu.batches(m, "train", output="torch", device="cuda:0", transform=to_xy, **kw)
    for (rin, ry), (inputs, y) in zip(ref, gen, strict=True):
        assert inputs["inputs"]["x"].is_cuda and inputs["inputs"]["lsm"].is_cuda and y.is_cuda
        assert np.array_equal(inputs["inputs"]["x"].cpu().numpy(), rin["inputs"]["x"], equal_nan=True)
        assert np.array_equal(y.cpu().numpy(), ry, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_transform_then_cuda_copy(ds_m):
    """On a GPU: the transform sees CPU tensors, and every tensor of its result arrives on cuda."""
    ds, m = ds_m
    rec = Recorder()

    def fn(b):
        rec(b)
        return {"x": torch.stack([b["t2m"], b["u10"]], 1)}, [b["t2m"]]

    gen = ds.insitu.batches(m, "train", batch_size=8, output="torch", device="cuda:0", variables=["t2m", "u10"],
                            transform=fn)
    n = 0
    for x, (y,) in gen:
        assert x["x"].is_cuda and y.is_cuda
        n += len(y)
    assert rec.kinds == {("Tensor", "cpu")} and n == m.positions("train")
