"""``decode="auto"`` picks the faster path by measurement (SPEC §4 "GPU"): the first buffer of each codec
chain is decoded both ways by the first-use check, both timed, and the faster path kept for that chain
for the rest of the process on that device; the repr says which path each variable takes and why, with
the two rates. Through the stand-in device side, whose measured rates a test sets (``StandInGpu.judge``,
the seam the two timings go through): both outcomes deterministic, no timing asserted."""

from __future__ import annotations

import numpy as np
import pytest

import xinsitu
from tests.support.gpu import CountingGpu, on_gpu, same
from xinsitu.codecs.gpu import StandInGpu
from xinsitu.codecs.gpu_batch import Verdict
from xinsitu.codecs.gpu_chain import GpuChain


@pytest.fixture
def ds_m(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    return ds, ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})


FAST, SLOW = (9.1e9, 7.8e9), (2.1e9, 7.8e9)
KW = dict(batch_size=5, seed=2, block_chunks=2, output="numpy", stack=True)


def test_auto_keeps_the_gpu_where_its_first_buffer_decoded_faster(ds_m):
    ds, m = ds_m
    kw = dict(KW, variables=["t2m", "u10"])
    ref = list(ds.insitu.batches(m, "train", **kw))
    gpu = CountingGpu({"float32": FAST})
    gen, _ = on_gpu(ds.insitu.batches(m, "train", **kw), gpu)
    assert "its first buffer, decoded both ways, decides" in repr(gen)
    same(ref, list(gen))
    assert gen.decode_paths["t2m"].gpu and gen._gpu is gpu
    assert gpu.judged == [("float32", gpu.judged[0][1])]  # one chain (t2m and u10 alike), judged once
    said = "gpu (zstd, nvCOMP: GPU 9.1 GB/s > CPU 7.8 GB/s, measured on the first buffer)"
    assert gen.decode_summary == said and said in repr(gen)
    gen.set_epoch(0)
    before = gpu.decoded
    same(ref, list(gen))
    assert gpu.decoded - before == gen.io_stats["chunks"]  # every chunk on the device


def test_auto_takes_the_cpu_path_where_the_cpu_decoded_faster(ds_m):
    """The first buffer decodes on both sides; the CPU path was faster: the repr says so with both rates,
    and from the next epoch on nothing is decoded on the device and batches are built on the host."""
    ds, m = ds_m
    kw = dict(KW, variables=["t2m", "u10"])
    ref = list(ds.insitu.batches(m, "train", **kw))
    gpu = CountingGpu({"float32": SLOW})
    gen, _ = on_gpu(ds.insitu.batches(m, "train", **kw), gpu)
    same(ref, list(gen))
    # within the first epoch already: the buffers started once the first was in (its verdict given)
    # decoded on the CPU; only those read ahead beside the first (3 of the 6) on the device
    assert 0 < gpu.decoded <= 3 * 2 * 2 < gen.io_stats["chunks"]
    said = "cpu (zstd: GPU 2.1 GB/s < CPU 7.8 GB/s, measured on the first buffer)"
    assert gen.decode_summary == said and said in repr(gen)
    gen.set_epoch(0)
    before = gpu.decoded
    same(ref, list(gen))
    assert gpu.decoded == before and gen._gpu is None  # the CPU path, as without a GPU
    assert not gen.decode_paths["t2m"].gpu and gen.decode_summary == said
    assert len(gpu.judged) == 1


def test_auto_judges_each_chain_on_its_own(ds_m):
    """t2m (float32) decodes faster on the GPU, tp (int16, CF-packed) by the CPU path: each variable
    takes its own chain's faster path, the batches stay bit-identical, the repr says both."""
    ds, m = ds_m
    kw = dict(KW, variables=["t2m", "tp"])
    ref = list(ds.insitu.batches(m, "train", **kw))
    gpu = CountingGpu({"float32": FAST, "int16": SLOW})
    gen, _ = on_gpu(ds.insitu.batches(m, "train", **kw), gpu)
    same(ref, list(gen))
    assert sorted(d for d, _ in gpu.judged) == ["float32", "int16"]
    assert gen.decode_summary == ("t2m: gpu (zstd, nvCOMP: GPU 9.1 GB/s > CPU 7.8 GB/s, measured on the first "
                                  "buffer); tp: cpu (zstd: GPU 2.1 GB/s < CPU 7.8 GB/s, measured on the first "
                                  "buffer)")
    gen.set_epoch(0)
    got = list(gen)
    same(ref, got)
    assert gen._gpu is gpu and gen.decode_paths["t2m"].gpu and not gen.decode_paths["tp"].gpu
    assert gen._buffer_loader().on_gpu.keys() == {"t2m"}


def test_a_later_generator_starts_on_the_path_measured(ds_m):
    """The verdict holds for the process on that device: a generator made after it takes the faster path
    from its first batch, without decoding its first buffer twice again."""
    ds, m = ds_m
    kw = dict(KW, variables=["t2m"])
    gpu = CountingGpu({"float32": SLOW})
    list(on_gpu(ds.insitu.batches(m, "train", **kw), gpu)[0])
    judged, decoded = len(gpu.judged), gpu.decoded
    later, _ = on_gpu(ds.insitu.batches(m, "val", **kw), gpu)
    assert later._gpu is None and "GPU 2.1 GB/s < CPU 7.8 GB/s" in later.decode_summary
    same(list(ds.insitu.batches(m, "val", **kw)), list(later))
    assert (len(gpu.judged), gpu.decoded) == (judged, decoded)


def test_decode_gpu_stays_on_the_gpu_and_says_the_rates(ds_m):
    ds, m = ds_m
    kw = dict(KW, variables=["t2m"])
    ref = list(ds.insitu.batches(m, "train", **kw))
    gpu = CountingGpu({"float32": SLOW})
    gen, _ = on_gpu(ds.insitu.batches(m, "train", **kw), gpu, decode="gpu")
    assert gen.decode_summary == "gpu (zstd, nvCOMP; decode='gpu')"
    same(ref, list(gen))
    gen.set_epoch(0)
    before = gpu.decoded
    same(ref, list(gen))
    assert gpu.decoded - before == gen.io_stats["chunks"] and gen._gpu is gpu
    assert gen.decode_summary == ("gpu (zstd, nvCOMP: GPU 2.1 GB/s < CPU 7.8 GB/s, measured on the first buffer; "
                                  "decode='gpu')")


def test_the_measured_seconds_make_the_rates():
    """Without a test's rates, ``judge`` turns the two timings into decoded bytes per second."""
    chain = GpuChain(True, "zstd", "zstd", False, (4,), np.dtype("f4"))
    v = StandInGpu().judge(chain, 8_000_000_000, 2.0, 4.0)
    assert (v.gpu_rate, v.cpu_rate, v.gpu_faster) == (2e9, 4e9, False)
    assert v.words() == "GPU 2.0 GB/s < CPU 4.0 GB/s, measured on the first buffer"
    assert Verdict(3e7, 1e7).words() == "GPU 30.0 MB/s > CPU 10.0 MB/s, measured on the first buffer"
