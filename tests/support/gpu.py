"""Real-GPU tests carry ``@pytest.mark.gpu`` and ``@pytest.mark.skipif(not CUDA, ...)``: they run where
torch sees a CUDA device and skip elsewhere. The GPU path's tests without a GPU run through the stand-in
device side (``CountingGpu``, ``on_gpu``) and compare batches bit for bit (``same``)."""

from __future__ import annotations

import numpy as np

from xinsitu.cache.device_tier import HostArrays
from xinsitu.codecs.gpu import StandInGpu
from xinsitu.codecs.gpu_batch import Verdict
from xinsitu.codecs.gpu_chain import gpu_chain


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


CUDA = _cuda()


class CountingArrays(HostArrays):
    """The device cache tier's stand-in arrays, counting the calls that copy on the "device" (takes and
    scatters: a chunk copied on its own is not one)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def take(self, slab, rows):
        self.calls += 1
        return super().take(slab, rows)

    def take_into(self, slab, rows, out):
        self.calls += 1
        super().take_into(slab, rows, out)

    def scatter(self, out, pos, values):
        self.calls += 1
        super().scatter(out, pos, values)


class CountingGpu(StandInGpu):
    """The stand-in device side (numpy for device memory), counting what it does: transfers (``flushes``,
    one per buffer decoded together), batched calls (``calls``), chunks decoded on the "device"
    (``decoded``), device buffers asked for (``buffers``), new device arrays (``arrays``: batches, raw
    arrays) and the chains judged (``judged``: dtype name, bytes). Its first buffers measure ``rates``
    (decoded bytes per second, GPU then CPU, or a dict of them by the chain's dtype name): by default the
    GPU twice as fast, so ``decode="auto"`` keeps the GPU path."""

    rates: tuple[float, float] | dict[str, tuple[float, float]] = (2e9, 1e9)

    def __init__(self, rates=None):
        super().__init__()
        if rates is not None:
            self.rates = rates
        self.decoded = self.flushes = self.calls = self.buffers = self.arrays = 0
        self.judged = []

    def judge(self, chain, nbytes, cpu_s, gpu_s):
        assert nbytes > 0 and cpu_s >= 0 and gpu_s >= 0
        self.judged.append((chain.dtype.name, nbytes))
        return Verdict(*(self.rates[chain.dtype.name] if isinstance(self.rates, dict) else self.rates))

    def empty(self, shape, dtype):
        self.buffers += 1
        return super().empty(shape, dtype)

    def new(self, shape, dtype):
        self.arrays += 1
        return super().new(shape, dtype)

    def _make_decoder(self):
        dec = super()._make_decoder()
        parent, gpu = dec.decode_staged, self

        def counting(host, calls):
            gpu.flushes += 1
            gpu.calls += len(calls)
            gpu.decoded += sum(len(c.spans) for c in calls)
            return parent(host, calls)

        dec.decode_staged = counting
        return dec


def on_gpu(gen, gpu=None, decode="auto"):
    """``gen`` with its GPU path on the stand-in device ``gpu`` (a new ``CountingGpu`` by default), as a CUDA
    device turns it on; without the next epoch's read-ahead (what an epoch decodes is its own)."""
    gen.decode = decode
    gen.read_ahead = False
    gpu = gpu if gpu is not None else CountingGpu()
    gen._use_gpu(gpu, {n: gpu_chain(lay.src.array) for n, lay in gen.layouts.items()})
    return gen, gpu


def same(ref, got):
    """Batches equal bit for bit (lists of them, dicts of arrays, or arrays): type, dtype, shape, values
    (NaN where NaN)."""
    if isinstance(ref, list):
        assert isinstance(got, list) and len(ref) == len(got)
        for r, g in zip(ref, got, strict=True):
            same(r, g)
        return
    if isinstance(ref, dict):
        assert ref.keys() == got.keys()
        for k in ref:
            same(ref[k], got[k])
        return
    assert type(ref) is type(got) and ref.dtype == got.dtype and ref.shape == got.shape
    assert np.array_equal(ref, got, equal_nan=True)
