"""The weather-model shape on the GPU path (SPEC §4 "GPU"; issue "GPU decode that pays"): where a chunk
holds one sample, its chunks are decoded on the device straight into the device batch's channel slice
(``direct.DeviceDirectLoader``): no device buffer, no gather, every variable's chunks of a batch in one
transfer. Through the stand-in device side, checked bit for bit against the CPU path's batches (whose
own oracle is xarray, ``test_direct``)."""

from __future__ import annotations

import pytest

import xinsitu
from tests.batches.test_direct import LEVEL_VARS, SURF, _source
from tests.support.gpu import CountingArrays, on_gpu, same
from xinsitu.batches.direct import DeviceDirectLoader
from xinsitu.cache.device_tier import DeviceCache

NL, NY, NX = 3, 5, 7


def _write(path: str, blosc: tuple[str, ...] = ()) -> None:
    """One time step per chunk; ``tp`` packed as int16; ``blosc`` variables compressed with blosc (which
    nvCOMP cannot decode: the CPU path)."""
    from zarr.codecs import BloscCodec

    src = _source()
    c = {"time": 1, "level": NL, "lat": NY, "lon": NX}
    enc = {v: {"chunks": tuple(c[d] for d in src[v].dims)} for v in src.data_vars}
    enc["tp"].update(dtype="int16", scale_factor=0.001, add_offset=0.0, _FillValue=-32768)
    for v in blosc:
        enc[v]["compressors"] = [BloscCodec()]
    src.to_zarr(path, encoding=enc, consolidated=False)


@pytest.fixture(scope="module")
def wm(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gpu_direct") / "wm.zarr")
    _write(path)
    ds = xinsitu.open_zarr(path)
    return ds, ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})


KW = dict(batch_size=5, seed=3, output="numpy")


@pytest.mark.parametrize("kw,in_place", [
    (dict(variables=LEVEL_VARS + ["t2m", "lsm"], stack=["level"]), True),  # float32 all: decoded into place
    (dict(variables=LEVEL_VARS + ["t2m"], stack=["level"], dtype="float32"), True),
    (dict(variables=LEVEL_VARS + SURF, stack=["level"]), False),  # tp CF-packed: converted on the device
    (dict(variables=LEVEL_VARS + SURF + ["lsm"], stack=False), False),
    (dict(variables=["z", "t2m"], stack=["level"], dtype="float16"), False),  # a cast into place
])
def test_device_batches_filled_in_place_bit_identical(wm, kw, in_place):
    ds, m = wm
    ref = list(ds.insitu.batches(m, "train", **KW, **kw))
    gen, gpu = on_gpu(ds.insitu.batches(m, "train", **KW, **kw))
    assert gen.buffer_reason is None and isinstance(gen._item_loader(), DeviceDirectLoader)
    got = list(gen)
    same(ref, got)
    timed = [v for v in kw["variables"] if "time" in ds[v].dims]
    assert gpu.buffers == 0  # no device buffer: nothing gathered
    assert gpu.decoded == gen.io_stats["chunks"] - ("lsm" in kw["variables"]) == len(timed) * m.positions("train")
    if in_place:  # one new device array per batch: the batch itself, every chunk decoded into its channels
        assert gpu.arrays == len(got)


def test_normalised_on_the_device_in_place(wm):
    ds, m = wm
    kw = dict(KW, variables=LEVEL_VARS + ["t2m"], stack=["level"])
    st = ds.insitu.stats(m, "train", variables=kw["variables"], stack=["level"])
    ref = list(ds.insitu.batches(m, "train", normalize=st, **kw))
    gen, _ = on_gpu(ds.insitu.batches(m, "train", normalize=st, **kw))
    same(ref, list(gen))


def test_a_variable_on_the_cpu_path_is_copied_into_the_device_batch(tmp_path):
    """t2m in blosc (nvCOMP cannot decode it; decode='auto'): read and converted on the host as the CPU
    path does, copied into its channel of the device batch beside the others decoded there."""
    path = str(tmp_path / "wm.zarr")
    _write(path, blosc=("t2m",))
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
    kw = dict(KW, variables=LEVEL_VARS + ["t2m"], stack=["level"])
    ref = list(ds.insitu.batches(m, "train", **kw))
    gen, gpu = on_gpu(ds.insitu.batches(m, "train", **kw), decode="auto")
    assert not gen.decode_paths["t2m"].gpu and gen.decode_paths["z"].gpu
    same(ref, list(gen))
    assert gpu.decoded == len(LEVEL_VARS) * m.positions("train")


@pytest.mark.parametrize("slab_rows,part", [(256, False), (3, False), (256, True)])
def test_cached_epochs_from_the_device_tier(wm, monkeypatch, slab_rows, part):
    """Later epochs from the device tier: nothing decoded again, each variable's samples of a batch copied
    into its channels in one take per slab (not one copy per chunk); with small slabs, and with a tier that
    keeps only some chunks (the rest decoded again each epoch), bit-identical still."""
    monkeypatch.setattr(DeviceCache, "SLAB_ROWS", slab_rows)
    ds, m = wm
    variables = LEVEL_VARS + ["t2m"]
    kw = dict(KW, variables=variables, stack=["level"])
    ref = list(ds.insitu.batches(m, "train", **kw))
    cache = xinsitu.ChunkCache(memory=0)
    cache.device_budget = 40 * NL * NY * NX * 4 if part else 1 << 30  # (set as ChunkCache(device=) would)
    gen, gpu = on_gpu(ds.insitu.batches(m, "train", cache=cache, **kw))
    same(ref, list(gen))
    decoded = gpu.decoded
    tier = cache.device_tier(None)
    tier.arrays = counting = CountingArrays()
    for _ in range(2):
        gen.set_epoch(0)
        same(ref, list(gen))
    assert (tier.stats.refused > 0) == part and counting.calls > 0
    if part:
        assert gpu.decoded > decoded and 0 < gen.io_stats["cache_hits"] < gen.io_stats["chunks"]
        return
    assert gpu.decoded == decoded and gen.io_stats["cache_hits"] == gen.io_stats["chunks"] > 0
    if slab_rows == 256:  # one slab per chunk shape: a take per variable and batch, whatever its samples
        assert counting.calls == 2 * len(ref) * len(variables)


def test_a_conversion_that_differs_on_the_device_gives_way_to_the_host(wm, monkeypatch):
    """The first batch's conversions (CF decoding, normalising, casting) on the device are checked
    against the host's; one that differs is said once, and runs on the host from then on."""
    ds, m = wm
    kw = dict(KW, variables=["z", "tp"], stack=["level"])
    ref = list(ds.insitu.batches(m, "train", **kw))
    gen, _ = on_gpu(ds.insitu.batches(m, "train", **kw))
    right = gen.builder.device_value
    monkeypatch.setattr(gen.builder, "device_value", lambda name, raw: right(name, raw) + 1)
    with pytest.warns(RuntimeWarning, match="converting variable '(z|tp)'.*failed its check on the first batch"):
        got = list(gen)
    same(ref, got)


def test_a_damaged_chunk_is_fetched_again_like_a_cpu_one_and_named(tmp_path):
    """A chunk the device cannot decode is fetched again and decoded the CPU way, up to FETCH_ATTEMPTS
    fetches; one that never decodes raises naming the variable, the chunk and its key."""
    from xinsitu.stores.reads import FETCH_ATTEMPTS

    path = str(tmp_path / "wm.zarr")
    _write(path)
    with open(f"{path}/z/c/3/0/0/0", "r+b") as f:
        f.write(b"\0\0\0\0garbage")
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"all": 1.0})
    gen, _ = on_gpu(ds.insitu.batches(m, "all", batch_size=24, shuffle=False, output="numpy", variables=["z"],
                                      stack=True))
    fetched = rf"\(3, 0, 0, 0\) of variable 'z'.*failed to decode {FETCH_ATTEMPTS} times"
    with pytest.raises(Exception, match=fetched) as e:
        list(gen)
    assert "z/c/3/0/0/0" in str(e.value) + "".join(getattr(e.value, "__notes__", []))
