"""output="jax": jax arrays bit-identical to the numpy output, on device= or jax's default device."""

from __future__ import annotations

import os

import numpy as np
import pytest

import xinsitu
from tests.support.own_process import in_child, run_in_child

# on a GPU, jax would take 75% of its memory at first use, leaving too little for the example's own
# process (test_train_jax_example_runs): allocate as needed instead (read when jax's backend starts)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax", reason="output='jax' needs jax (pip install 'xinsitu[jax]')")


@pytest.fixture
def ds_m(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    return ds, ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})


@pytest.fixture
def x64():
    """jax with 64-bit types on (``tp`` decodes to float64), restored afterwards."""
    before = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


@pytest.mark.parametrize("stack", [False, True])
def test_jax_bit_identical_to_numpy(ds_m, stack, x64):
    ds, m = ds_m
    kw = dict(batch_size=9, shuffle=True, seed=4, block_chunks=2, stack=stack)
    ref = ds.insitu.batches(m, "train", output="numpy", **kw)
    gen = ds.insitu.batches(m, "train", output="jax", **kw)
    n = 0
    for a, b in zip(ref, gen, strict=True):
        if stack:
            assert isinstance(b, jax.Array) and b.dtype == a.dtype and b.shape == a.shape
            assert np.array_equal(np.asarray(b), a, equal_nan=True)
            n += len(a)
            continue
        assert set(a) == set(b)
        for v in a:
            assert isinstance(b[v], jax.Array), v
            assert b[v].dtype == a[v].dtype and b[v].shape == a[v].shape, v
            assert np.array_equal(np.asarray(b[v]), a[v], equal_nan=True), v  # tp: NaN where missing
        n += len(a["t2m"])
    assert n == m.positions("train")


def test_jax_device_default_and_explicit(ds_m):
    ds, m = ds_m
    b = next(iter(ds.insitu.batches(m, "train", batch_size=4, output="jax", variables=["t2m"])))
    assert b["t2m"].devices() == {jax.devices()[0]}
    cpu = jax.devices("cpu")[0]
    b = next(iter(ds.insitu.batches(m, "train", batch_size=4, output="jax", variables=["t2m"], device=cpu)))
    assert b["t2m"].devices() == {cpu}


def test_jax_float32_without_x64(ds_m):
    ds, m = ds_m
    if jax.config.read("jax_enable_x64"):
        pytest.skip("jax_enable_x64 is on in this process")
    kw = dict(batch_size=6, shuffle=False, variables=["t2m", "u10"])
    for a, b in zip(ds.insitu.batches(m, "train", output="numpy", **kw),
                    ds.insitu.batches(m, "train", output="jax", **kw), strict=True):
        for v in a:
            assert b[v].dtype == np.float32 and np.array_equal(np.asarray(b[v]), a[v])


def test_jax_refuses_silent_downcast(ds_m):
    """tp decodes to float64: with 64-bit types off jax would make it float32 (not the numpy values)."""
    ds, m = ds_m
    if jax.config.read("jax_enable_x64"):
        pytest.skip("jax_enable_x64 is on in this process")
    with pytest.raises(ValueError, match="'tp'.*jax_enable_x64"):
        ds.insitu.batches(m, "train", output="jax", variables=["t2m", "tp"])
    gen = ds.insitu.batches(m, "train", output="jax", variables=["t2m", "tp"], transform=lambda b: b)
    with pytest.raises(ValueError, match="jax_enable_x64"):
        next(iter(gen))
    # a transform that casts is the way without x64
    gen = ds.insitu.batches(m, "train", batch_size=3, output="jax", variables=["t2m", "tp"],
                            transform=lambda b: {k: v.astype("float32") for k, v in b.items()})
    assert next(iter(gen))["tp"].dtype == np.float32


@pytest.mark.parametrize("dtype", [">f4", "float128"])
def test_a_dtype_jax_has_no_array_for_is_refused_naming_it(ds_m, dtype):
    """Refused when the generator is made (it failed in jax, at the first batch, not naming dtype)."""
    ds, m = ds_m
    if dtype[0].isalpha() and not hasattr(np, dtype):  # (platforms without extended precision)
        pytest.skip(f"numpy has no {dtype} here")
    with pytest.raises(TypeError, match=f"dtype: output='jax' has no array type for {dtype}"):
        ds.insitu.batches(m, "train", output="jax", variables=["t2m"], dtype=dtype)


def test_complex64_is_not_taken_for_a_64_bit_type(ds_m):
    """complex64 is two 32-bit parts, which jax keeps with 64-bit types off (it was refused)."""
    ds, m = ds_m
    a, b = (next(iter(ds.insitu.batches(m, "train", batch_size=3, output=o, variables=["t2m"], dtype="complex64")))
            for o in ("numpy", "jax"))
    assert b["t2m"].dtype == np.complex64 and np.array_equal(np.asarray(b["t2m"]), a["t2m"])


@pytest.mark.parametrize("bad", ["cpu", "cuda:0", 0])
def test_jax_device_must_be_a_jax_device(ds_m, bad):
    ds, m = ds_m
    with pytest.raises(TypeError, match="device"):
        ds.insitu.batches(m, "train", output="jax", device=bad)


def test_decode_gpu_on_a_cpu_jax_device_is_refused_in_words(ds_m):
    ds, m = ds_m
    # (it said "... not the jax device cpu:0 is not a GPU")
    with pytest.raises(ValueError, match=r", not the jax device [^ ]+$"):
        ds.insitu.batches(m, "train", output="jax", decode="gpu", device=jax.devices("cpu")[0], dtype="float32")


def test_jax_transform_sees_numpy_first(ds_m):
    """transform= gets host numpy values; what it returns is then put on the jax device."""
    ds, m = ds_m
    seen = []

    def pair(b):
        seen.append(type(b["t2m"]))
        return b["t2m"], {"wind": (b["u10"], b["v10"])}

    gen = ds.insitu.batches(m, "train", batch_size=5, output="jax", variables=["t2m", "u10", "v10"],
                            transform=pair)
    x, y = next(iter(gen))
    assert seen and set(seen) == {np.ndarray}
    assert isinstance(x, jax.Array) and all(isinstance(a, jax.Array) for a in y["wind"])


def test_jax_stacked_cpu_zero_copy(ds_m):
    """A stacked batch is allocated aligned, so jax on the CPU aliases it rather than copying."""
    ds, m = ds_m
    from xinsitu.batches.output import JAX_ALIGN, BatchArrays

    arrays = BatchArrays()
    a = arrays.empty((3, 5, 7), np.float32)
    assert a.ctypes.data % JAX_ALIGN == 0 and a.shape == (3, 5, 7) and a.flags.c_contiguous
    a[:] = 1.5
    b = jax.device_put(a, jax.devices("cpu")[0])
    assert b.unsafe_buffer_pointer() == a.ctypes.data
    # the jax array aliases the batch's memory: it must never be handed out again while b lives
    at = a.ctypes.data
    del a
    again = arrays.empty((3, 5, 7), np.float32)
    assert again.ctypes.data != at
    again[:] = -1.0
    np.testing.assert_array_equal(np.asarray(b), np.full((3, 5, 7), 1.5, np.float32))
    gen = ds.insitu.batches(m, "train", batch_size=4, output="jax", stack=True, variables=["t2m", "u10"],
                            device=jax.devices("cpu")[0])
    assert isinstance(next(iter(gen)), jax.Array)


def test_jax_map_style_dataset(ds_m, x64):
    ds, m = ds_m
    d = ds.insitu.dataset(m, "train", output="jax", variables=["t2m", "tp"])
    ref = ds.insitu.dataset(m, "train", output="numpy", variables=["t2m", "tp"])
    got, exp = d.batch([3, 1, 17]), ref.batch([3, 1, 17])
    for v in exp:
        assert isinstance(got[v], jax.Array)
        assert np.array_equal(np.asarray(got[v]), exp[v], equal_nan=True)


def test_train_jax_example_runs(tmp_path):
    """examples/train_jax.py trains on a small synthetic archive (written in tmp_path) and learns; on a GPU,
    beside this process's jax, in GPU memory of its own."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "train_jax.py"
    # its own share of a GPU: no preallocation, and at most a third of the memory whatever this process holds
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.33"}
    p = subprocess.run([sys.executable, "-W", "ignore", str(script), "--nt", "400", "--epochs", "2"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    losses = [float(line.rsplit("val loss ", 1)[1]) for line in p.stdout.splitlines() if "val loss" in line]
    assert len(losses) == 2 and all(np.isfinite(losses)), p.stdout


# ----------------------------------------------------------------------------- a process of their own
# jax's backend, once started, warns at every later os.fork() of this process (and the fork tests run
# later): in the pytest process itself the tests above run as one child pytest process.
if not in_child():
    for _name in [n for n in globals() if n.startswith("test_")]:
        del globals()[_name]

    @pytest.mark.slow
    def test_jax_tests_in_their_own_process() -> None:
        run_in_child(__file__)
