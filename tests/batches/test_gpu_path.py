"""The GPU path end to end through the stand-in device side (SPEC §4 "GPU"): chunks whose codecs
nvCOMP decodes are fetched as bytes, handed by the read path's completion step to a batch decoder
(one transfer, one batched decode per variable and buffer) into device buffers, gathered, normalised
and stacked on the device, with a device cache tier across epochs -- numpy and numcodecs standing in
for CuPy and nvCOMP (``gpu.StandInGpu``), so that CI runs the very steps a GPU runs. Every
batch is checked bit for bit against the CPU path. On a real GPU the same runs with CuPy (``gpu``)."""

from __future__ import annotations

import numpy as np
import pytest

import xinsitu
from tests.support.gpu import CUDA, CountingArrays, CountingGpu, on_gpu, same
from xinsitu.codecs.nvcomp import gpu_modules


@pytest.fixture
def ds_m(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    return ds, ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})


KW = [
    dict(stack=True, variables=["t2m", "u10"]),
    dict(stack=False),
    dict(stack=True),  # tp: int16 packed with a fill value (CF decoding not the identity)
    dict(stack=True, block_chunks=3, batch_size=7),  # batches spanning buffers
    dict(stack=True, patch={"lat": 3, "lon": 4}, variables=["t2m", "u10"]),  # patches: an indexed gather
    dict(stack=False, patch={"lat": 2, "lon": 5}, stride={"lat": 2, "lon": 5}),
]


@pytest.mark.parametrize("kw", KW)
def test_batches_bit_identical_to_the_cpu_path(ds_m, kw):
    ds, m = ds_m
    kw = dict(dict(batch_size=5, seed=3, block_chunks=2, output="numpy"), **kw)
    ref = list(ds.insitu.batches(m, "train", **kw))
    gen, gpu = on_gpu(ds.insitu.batches(m, "train", **kw))
    assert any(c.gpu for c in gen.decode_paths.values()) and "gpu (zstd" in repr(gen)
    got = list(gen)
    assert len(got) == len(ref)
    for r, g in zip(ref, got, strict=True):
        same(r, g)
    assert gpu.flushes >= 1 and gpu.decoded >= 1


def test_one_transfer_and_one_batched_call_per_buffer_for_every_variable(ds_m, monkeypatch):
    """A buffer's chunks of every variable (t2m float32, tp int16: both zstd) go to the device in one
    transfer and decode in one batched call; only the first buffer of each chain is decoded on its own
    too (the first-use check, timed per chain). Each chunk is counted decoded once. The local chunk
    files are read straight into the page-locked staging (no copy after the read)."""
    from xinsitu.codecs.staging import Staging

    found, missed = [], []
    locate = Staging.locate

    def counted(self, raw):
        at = locate(self, raw)
        (missed if at is None else found).append(1)
        return at

    monkeypatch.setattr(Staging, "locate", counted)
    ds, m = ds_m
    kw = dict(batch_size=4, seed=0, block_chunks=4, output="numpy", stack=True, variables=["t2m", "tp"])
    gen, gpu = on_gpu(ds.insitu.batches(m, "train", **kw))
    gen.read_ahead = False  # (not the next epoch's first buffer too)
    list(gen)
    n = gen.plan(0).n_buffers
    assert n >= 3
    assert gpu.flushes == gpu.calls == n + 1  # one per buffer, and the first buffer's second chain on its own
    assert gpu.decoded == gen.io_stats["chunks"] > 2 * n  # every chunk decoded on the "device", counted once
    assert len(found) == gpu.decoded and not missed  # each read into the staging, where it was decoded from
    dec = gpu.decoder()
    assert dec.transfers == n + 1
    made = dec.ring.allocs
    gen.set_epoch(1)
    list(gen)
    assert dec.transfers == 2 * n + 1 and dec.ring.allocs == made  # the page-locked staging buffers reused


def test_normalised_on_the_device_bit_identical(ds_m):
    ds, m = ds_m
    st = ds.insitu.stats(m, "train", variables=["t2m", "u10"])
    kw = dict(batch_size=6, seed=1, output="numpy", stack=True, variables=["t2m", "u10"], normalize=st)
    ref = list(ds.insitu.batches(m, "train", **kw))
    gen, _ = on_gpu(ds.insitu.batches(m, "train", **kw))
    for r, g in zip(ref, gen, strict=True):
        same(r, g)


@pytest.mark.parametrize("block_chunks", [2, 4])
def test_device_cache_tier_serves_later_epochs(ds_m, block_chunks):
    ds, m = ds_m
    cache = xinsitu.ChunkCache()
    cache.device_budget = 1 << 30  # (ChunkCache(device=) checks for a CUDA device: set as it would be)
    kw = dict(batch_size=5, seed=2, block_chunks=block_chunks, output="numpy", stack=True, variables=["t2m", "u10"])
    ref = [list(ds.insitu.batches(m, "train", **kw)) for _ in range(2)]
    gen, gpu = on_gpu(ds.insitu.batches(m, "train", cache=cache, **kw))
    first = list(gen)
    decoded = gpu.decoded
    assert gen.io_stats["cache_hits"] == 0
    tier = cache.device_tier(None, 0)
    tier.arrays = counting = CountingArrays()
    gen.set_epoch(0)
    second = list(gen)
    assert gpu.decoded == decoded  # nothing decoded again: every whole chunk came from the device tier
    assert gen.io_stats["cache_hits"] >= decoded
    assert tier is not None and len(tier) == decoded and tier.stats.hits >= decoded
    # a buffer's chunks of a variable copied into its device buffer in one take (one slab), not one by one
    buffers = -(-decoded // len(kw["variables"]) // block_chunks)
    assert 0 < counting.calls <= buffers * len(kw["variables"])
    for r, g in zip(ref[0], first, strict=True):
        same(r, g)
    for r, g in zip(ref[0], second, strict=True):
        same(r, g)


def test_a_memory_cache_keeps_gpu_decoded_chunks_on_the_device(ds_m):
    """``cache=True`` on the GPU path: the memory tier's budget (up to half the free device memory)
    becomes a tier in device memory; nothing is kept on the host."""
    ds, m = ds_m
    kw = dict(batch_size=5, seed=2, output="numpy", stack=True, variables=["t2m"])
    ref = list(ds.insitu.batches(m, "train", **kw))
    gen, gpu = on_gpu(ds.insitu.batches(m, "train", cache=True, **kw))
    assert gen.decode_paths["t2m"].gpu
    for _ in range(2):
        gen.set_epoch(0)
        for r, g in zip(ref, gen, strict=True):
            same(r, g)
    tier = gen.cache.device_tier(None, 1 << 50)  # (made already: the stand-in's free memory is 1 TiB)
    assert tier is not None and tier.budget == gen.cache.memory_budget and len(tier) > 0
    assert gen.io_stats["cache_hits"] > 0 and gen.cache.stats.memory_entries == 0


class WrongGpu(CountingGpu):
    """A device whose decoder gets the values wrong."""

    def _make_decoder(self):
        dec = super()._make_decoder()
        parent = dec.decode_staged

        def wrong(host, calls):
            got = parent(host, calls)
            for c in calls:
                for d in c.outs:
                    d.reshape(-1).view("u1")[:1] ^= 1
            return got

        dec.decode_staged = wrong
        return dec


class _NoBroadcast:
    """numpy without ``broadcast_to`` (only stacking uses it): an array module the build fails on."""

    def __getattr__(self, name):
        if name == "broadcast_to":
            raise AttributeError("no such device call: broadcast_to")
        return getattr(np, name)


class BrokenBuildGpu(CountingGpu):
    """A device whose array module fails in the batch's build (an API the device's library lacks)."""

    xp = _NoBroadcast()


class BrokenGatherGpu(CountingGpu):
    """A device on which the gather's indexed take fails."""

    def index(self, idx):
        raise TypeError("no such device call: index arrays")


class BrokenSyncGpu(CountingGpu):
    """A device whose every wait fails (a driver error)."""

    def synchronize(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.mark.parametrize("gpu,what", [(WrongGpu, "decoding variable '(t2m|tp)' on the GPU failed its check"),
                                      (BrokenGatherGpu, "gathering batches on the GPU failed its check"),
                                      (BrokenBuildGpu, "building batches on the GPU failed its check"),
                                      (BrokenSyncGpu, "on the GPU failed its check")])
def test_the_gpu_path_checks_itself_on_first_use_and_gives_way_to_the_cpu(ds_m, gpu, what):
    """Never wrong values, never a crash from the device's side: the first decode of each chain and
    the first batch built are checked bit for bit against the host; a failure is said once, and the
    CPU path takes over, with the same batches."""
    ds, m = ds_m
    kw = dict(batch_size=5, seed=2, block_chunks=2, output="numpy", stack=True, variables=["t2m", "tp"])
    ref = list(ds.insitu.batches(m, "train", **kw))
    gen, _ = on_gpu(ds.insitu.batches(m, "train", **kw), gpu())
    with pytest.warns(RuntimeWarning, match=what):
        got = list(gen)
    for r, g in zip(ref, got, strict=True):
        same(r, g)


def test_windows_across_chunks_stay_on_the_cpu_path(ds_m):
    ds, m = ds_m
    kw = dict(output="numpy", variables=["t2m"], window={"time": 3}, batch_size=4, seed=0)
    gen, _ = on_gpu(ds.insitu.batches(m, "train", **kw))
    assert not gen.decode_paths["t2m"].gpu and "span chunk blocks" in gen.decode_paths["t2m"].reason
    same(next(iter(ds.insitu.batches(m, "train", **kw))), next(iter(gen)))
    with pytest.raises(ValueError, match="decode='gpu'.*span chunk blocks"):
        on_gpu(ds.insitu.batches(m, "train", **kw), decode="gpu")


def test_missing_chunks_get_their_fill_value_on_the_device(tmp_path):
    import shutil

    from xinsitu.synthetic import write_era5_like

    path = str(tmp_path / "a.zarr")
    write_era5_like(path, nt=40, ny=4, nx=5, chunk_time=8)
    shutil.rmtree(f"{path}/t2m/c/1")  # chunk 1 along time: no object (zarr reads the fill value)
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"all": 1.0})
    kw = dict(batch_size=8, shuffle=False, output="numpy", variables=["t2m"], stack=True)
    with pytest.warns(UserWarning, match="no object"):
        ref = list(ds.insitu.batches(m, "all", **kw))
    gen, _ = on_gpu(ds.insitu.batches(m, "all", **kw))
    with pytest.warns(UserWarning, match="no object"):
        got = list(gen)
    for r, g in zip(ref, got, strict=True):
        same(r, g)


def test_a_damaged_chunk_names_variable_chunk_and_key(tmp_path):
    from xinsitu.synthetic import write_era5_like

    path = str(tmp_path / "a.zarr")
    write_era5_like(path, nt=16, ny=4, nx=5, chunk_time=8)
    with open(f"{path}/t2m/c/1/0/0", "r+b") as f:
        f.write(b"\0\0\0\0garbage")
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"all": 1.0})
    gen, _ = on_gpu(ds.insitu.batches(m, "all", batch_size=16, output="numpy", variables=["t2m"], stack=True))
    with pytest.raises(Exception, match=r"t2m.*\(1, 0, 0\)|\(1, 0, 0\).*t2m") as e:
        list(gen)
    assert "t2m/c/1/0/0" in str(e.value) + "".join(getattr(e.value, "__notes__", []))


def test_sample_reads_back_to_the_host(ds_m):
    ds, m = ds_m
    kw = dict(output="numpy", variables=["t2m", "tp"], stack=True)
    gen, _ = on_gpu(ds.insitu.batches(m, "train", **kw))
    ref = ds.insitu.batches(m, "train", **kw).sample(3)
    got = gen.sample(3)
    assert got.identical(ref)


# ------------------------------------------------------------------ on a real GPU
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("stack,cached", [(True, False), (False, False), (True, True)])
def test_real_gpu_decode_bit_identical(ds_m, stack, cached):
    pytest.importorskip("cupy")
    try:
        gpu_modules()
    except RuntimeError as e:
        pytest.skip(str(e))
    import torch

    ds, m = ds_m
    kw = dict(batch_size=8, seed=1, block_chunks=2, stack=stack, variables=["t2m", "u10", "tp"])
    ref = list(ds.insitu.batches(m, "train", output="numpy", **kw))
    cache = xinsitu.ChunkCache(device="1GB") if cached else None
    gen = ds.insitu.batches(m, "train", output="torch", device="cuda:0", decode="auto", cache=cache, **kw)
    assert gen.decode_paths["t2m"].gpu, gen.decode_paths
    got = list(gen)
    if cached:
        got = list(gen)  # the second epoch: from the device tier
        assert gen.io_stats["cache_hits"] > 0
    for r, g in zip(ref, got, strict=True):
        if stack:
            assert g.device.type == "cuda" and np.array_equal(r, g.cpu().numpy(), equal_nan=True)
        else:
            for k in r:
                assert g[k].device.type == "cuda" and np.array_equal(r[k], g[k].cpu().numpy(), equal_nan=True)
    torch.cuda.synchronize()


# ------------------------------------------------------------------ CF decoding with array operations
ENCODINGS = {
    "int16 f8 scale+offset+fill": dict(dtype="int16", scale_factor=0.001, add_offset=30.0, _FillValue=-32768),
    "int16 f4 scale+offset": dict(dtype="int16", scale_factor=np.float32(0.05), add_offset=np.float32(-3.0),
                                  _FillValue=np.int16(-1)),
    "uint8 scale": dict(dtype="uint8", scale_factor=0.5, _FillValue=255),
    "int32 missing_value": dict(dtype="int32", scale_factor=1e-3, missing_value=-999),
    "float32 scale only": dict(dtype="float32", scale_factor=np.float32(2.0)),
}


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_array_cf_decodes_as_xarray(tmp_path, name):
    """CF decoding written as array operations of one dtype each (what runs on the device) gives
    xarray's values bit for bit, on values beyond the probe it was chosen on; and the GPU path's
    batches with it equal the CPU path's."""
    import xarray as xr

    from xinsitu.index.channels import array_cf, cf_decoder

    rng = np.random.default_rng(1)
    vals = rng.normal(10, 5, (24, 3, 4)).astype("f8")
    vals[rng.random(vals.shape) < 0.1] = np.nan
    ds0 = xr.Dataset({"x": (("time", "lat", "lon"), vals)}, coords={"time": np.arange(24)})
    path = str(tmp_path / "a.zarr")
    ds0.to_zarr(path, encoding={"x": dict(ENCODINGS[name], chunks=(4, 3, 4))}, consolidated=False, zarr_format=3)
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"all": 1.0})
    kw = dict(batch_size=5, seed=0, output="numpy", stack=True)
    gen = ds.insitu.batches(m, "all", **kw)
    lay = gen.layouts["x"]
    dec = cf_decoder("x", lay)
    cf = array_cf(lay.src, dec)
    assert cf is not None
    raw_t = np.dtype(lay.src.raw_dtype)
    if raw_t.kind == "f":
        raw = rng.normal(0, 100, 4096).astype(raw_t)
    else:
        info = np.iinfo(raw_t)
        raw = rng.integers(info.min, info.max, 4096, endpoint=True, dtype=raw_t)
    assert cf(raw).tobytes() == np.asarray(dec(raw)).tobytes()
    ref = list(gen)
    got, _ = on_gpu(ds.insitu.batches(m, "all", **kw))
    assert got.builder.device_cf["x"] is not None
    for r, g in zip(ref, got, strict=True):
        same(r, g)


def test_array_cf_refuses_what_it_cannot_match(era5_path):
    from xinsitu.index.channels import array_cf

    ds = xinsitu.open_zarr(era5_path)
    gen = ds.insitu.batches(ds.insitu.split("time", fractions={"a": 1.0}), "a", output="numpy")
    src = gen.layouts["tp"].src

    def off_by_one_ulp(raw):  # a "decoding" no array arithmetic of the candidates gives
        return np.nextafter(raw.astype("f8") * 0.001 + 30.0, np.inf)

    assert array_cf(src, off_by_one_ulp) is None


# ------------------------------------------------------------------ a device tier for chunks decoded on the host
def _host_and_device_decoded(tmp_path):
    """An archive of x (blosc: nvCOMP cannot decode it, the host does) and y (zstd: the device decodes it),
    10 chunks each: (its path, the values written)."""
    import xarray as xr
    from zarr.codecs import BloscCodec

    rng = np.random.default_rng(0)
    ds0 = xr.Dataset({"x": (("time", "lat", "lon"), rng.normal(size=(40, 3, 4)).astype("f4")),
                      "y": (("time", "lat", "lon"), rng.normal(size=(40, 3, 4)).astype("f4"))},
                     coords={"time": np.arange(40)})
    path = str(tmp_path / "a.zarr")
    ds0.to_zarr(path, encoding={"x": dict(chunks=(4, 3, 4), compressors=[BloscCodec()]),
                                "y": dict(chunks=(4, 3, 4))}, consolidated=False, zarr_format=3)
    return path, ds0


def test_device_tier_keeps_chunks_decoded_on_the_host(tmp_path):
    """Chunks nvCOMP cannot decode (blosc) are decoded on the host and, with ``ChunkCache(device=)``,
    kept in GPU memory: later epochs copy them from there, read and decode nothing."""
    path, ds0 = _host_and_device_decoded(tmp_path)
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"all": 1.0})
    kw = dict(batch_size=6, seed=1, block_chunks=2, output="numpy", stack=True)
    ref = list(ds.insitu.batches(m, "all", **kw))
    cache = xinsitu.ChunkCache(memory=0)
    cache.device_budget = 1 << 20  # (ChunkCache(device=) checks for a CUDA device: set as it would be)
    gen, gpu = on_gpu(ds.insitu.batches(m, "all", cache=cache, **kw))
    assert not gen.decode_paths["x"].gpu and "kept in GPU memory" in gen.decode_paths["x"].reason
    assert gen.decode_paths["y"].gpu
    for epoch in range(2):
        gen.set_epoch(0)
        got = list(gen)
        for r, g in zip(ref, got, strict=True):
            same(r, g)
        if epoch:
            assert gen.io_stats["cache_hits"] == gen.io_stats["chunks"] == 20  # 10 chunks x 2 variables
    tier = cache.device_tier(None)
    assert len(tier) == 20


@pytest.mark.parametrize("tier", ["device", "memory"])
def test_a_device_tier_checks_what_an_earlier_generator_kept(tmp_path, tier):
    """A ``ChunkCache`` with a tier in GPU memory (``device=``, or a memory budget the GPU path moves there)
    given to a second generator after another tool rewrote a chunk of each variable: the rewritten chunks
    are read again, as from the memory tier, the others copied from the device tier -- for chunks
    decoded on the device (y) and on the host (x: blosc)."""
    path, ds0 = _host_and_device_decoded(tmp_path)
    kw = dict(batch_size=8, shuffle=False, block_chunks=2, output="numpy", stack=True)
    cache = xinsitu.ChunkCache(memory=0 if tier == "device" else "1MB")
    cache.device_budget = 1 << 20 if tier == "device" else 0  # (as ChunkCache(device=) sets it with a CUDA device)

    def epoch():
        ds = xinsitu.open_zarr(path)
        m = ds.insitu.split("time", fractions={"all": 1.0})
        ref = list(ds.insitu.batches(m, "all", **kw))
        gen, _ = on_gpu(ds.insitu.batches(m, "all", cache=cache, **kw))
        got = list(gen)
        same(ref, got)
        return gen.io_stats

    from tests.support.clock import past_the_writes

    past_the_writes(path)  # (a chunk written just before a reader began is read again by the next)
    assert epoch()["cache_hits"] == 0
    ds1 = ds0.isel(time=slice(0, 4)) + 100  # the first time chunk of each variable written again
    ds1.drop_vars("time").to_zarr(path, mode="r+", region={"time": slice(0, 4)})
    st = epoch()
    assert st["cache_misses"] == 2 and st["cache_hits"] == st["chunks"] - 2 == 18


def test_a_transform_takes_host_batches_unless_decode_gpu(ds_m):
    """SPEC 4: transform= runs before the device= copy, on host values; decode='auto' keeps it so (a
    numpy transform such as the docs' to_xy failed on a GPU machine); decode='gpu' hands it the batch
    built on the device."""
    ds, m = ds_m
    seen = []

    def to_xy(b):
        seen.append(type(b["t2m"]).__module__)
        return np.stack([b["t2m"], b["u10"]], axis=1), b["t2m"][:, :1]

    kw = dict(output="numpy", variables=["t2m", "u10"], batch_size=8, seed=1, transform=to_xy)
    gen, gpu = on_gpu(ds.insitu.batches(m, "train", **kw))
    assert gen._gpu is None and all("transform=" in c.reason for c in gen.decode_paths.values())
    ref = list(ds.insitu.batches(m, "train", **kw))
    for (rx, ry), (x, y) in zip(ref, gen, strict=True):
        same(rx, x)
        same(ry, y)
    assert gpu.decoded == 0
    gen, gpu = on_gpu(ds.insitu.batches(m, "train", **{**kw, "transform": lambda b: b}), decode="gpu")
    assert gen._gpu is not None and all(c.gpu for c in gen.decode_paths.values())
    next(iter(gen))
    assert gpu.decoded > 0


@pytest.mark.parametrize("tier", [False, True])
def test_a_big_endian_packed_integer_beside_a_device_decoded_variable(tmp_path, tier):
    """A zarr v2 ``'>i2'`` variable with ``scale_factor`` (as NetCDF-to-Zarr conversions keep) beside a zstd
    float one the device decodes: the CF probe of the device path drew its test values in the stored byte
    order, which numpy refuses ("a dtype with a non-native byteorder"), and ``batches`` failed at set-up. The
    big-endian variable is decoded on the host; batches equal xarray."""
    import numcodecs
    import xarray as xr
    import zarr

    p = str(tmp_path / "v2.zarr")
    g = zarr.open_group(p, mode="w", zarr_format=2)
    a = g.create_array("t", shape=(16, 6), chunks=(4, 6), dtype="<f4", compressors=numcodecs.Zstd(),
                       fill_value=np.nan, attributes={"_ARRAY_DIMENSIONS": ["time", "x"]})
    a[:] = np.arange(96, dtype="f4").reshape(16, 6)
    b = g.create_array("p", shape=(16, 6), chunks=(4, 6), dtype=">i2", fill_value=-32767,
                       attributes={"_ARRAY_DIMENSIONS": ["time", "x"], "scale_factor": 0.5, "_FillValue": -32767})
    b[:] = np.arange(96, dtype=">i2").reshape(16, 6)
    zarr.consolidate_metadata(p)
    ds = xinsitu.open_zarr(p)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    cache = None
    if tier:
        cache = xinsitu.ChunkCache(memory=0)
        cache.device_budget = 1 << 20  # (as ChunkCache(device=) sets it with a CUDA device)
    gen, _ = on_gpu(ds.insitu.batches(m, "train", batch_size=4, shuffle=False, output="numpy", cache=cache))
    assert not gen.decode_paths["p"].gpu and gen.decode_paths["t"].gpu
    ref = xr.open_zarr(p)
    got = list(gen)
    for v in ("t", "p"):
        np.testing.assert_array_equal(np.concatenate([o[v] for o in got]), ref[v].values)
