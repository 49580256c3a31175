#!/usr/bin/env python
"""Host-side time per chunk of the GPU decode path, without a GPU (issue "GPU decode that pays").

    python bench/gpu_host_cost.py [--chunks 64] [--rounds 7] [--out FILE.json]

Everything the GPU path does on the host for a chunk -- its bytes landing in page-locked staging, the
framing stripped (and crc32c checked), packing, the batch's bookkeeping, the read path's settling and
counters -- with the device's work replaced by no-ops: the stand-in device side (``StandInGpu``) whose
decoder copies nothing to a device and decodes nothing (no transfer, no nvCOMP, no device-side copy into
the destinations). The first-use check is not part of it (chains marked checked). Three stages, per
chunk size (64 kB and the yardstick's 786 kB, float32 noise in zstd: about 1.1x), ``--chunks`` chunks a
batch (the issue's 64-chunk batch), the median of ``--rounds``, one thread:

* ``bytes``: chunks already in memory (what obstore hands over): added to a batch and flushed;
* ``files``: chunk files read from the page cache as the local read path reads them, added, flushed
  (``read_only``: the same files only read, as the CPU path reads them; ``files_minus_read``: the GPU
  path's own host cost on top of the read);
* ``read_gpu``: a whole batch through ``Reader.read_gpu`` (one decode thread: the loop, the completion
  step, ``Reader.settle``'s counters, the flush), from local files;
* ``tier``: a whole batch that the device cache tier holds, through ``Reader.read_gpu`` (a warm epoch of
  ``ChunkCache(device=)``), with the tier's copies on the device as no-ops; beside it
  ``tier_device_copies_per_batch``, the copies a GPU would launch (before: one per chunk).

It runs against whichever ``xinsitu`` is imported, from the split of ``codecs/gpu.py`` on (the code before
issue 36's rework was measured with an earlier version of this file, see docs/performance.md). Prints one
line per size and writes the JSON to ``--out`` (else ``$OUT/gpu_host_cost.json``, ``/tmp/out`` by default).
Nothing is timed-asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

SIZES = {"64kB": (16, 32, 32), "786kB": (24, 64, 128)}  # chunk shapes, float32


def make_archive(root: str, label: str, shape: tuple[int, ...], n: int) -> str:
    """``n`` chunks of ``shape`` along time of one float32 variable ``x``, zstd (zarr's default chain)."""
    import xarray as xr
    from zarr.codecs import ZstdCodec

    path = os.path.join(root, f"{label}.zarr")
    full = (shape[0] * n, *shape[1:])
    rng = np.random.default_rng(0)
    ds = xr.Dataset({"x": (("time", "lat", "lon"), rng.standard_normal(full).astype("f4"))})
    ds.to_zarr(path, encoding={"x": {"chunks": shape, "compressors": [ZstdCodec(level=3)]}}, consolidated=False,
               zarr_format=3)
    return path


def _array(path: str):
    """The archive's zarr array and its chunk keys (from the store's root)."""
    import zarr

    a = zarr.open_group(path, mode="r")["x"]
    return a, [f"x/{a.metadata.encode_chunk_key((i, 0, 0))}" for i in range(a.cdata_shape[0])]


def noop_gpu():
    """The stand-in device side with the device's work as no-ops."""
    from xinsitu.codecs import nvcomp
    from xinsitu.codecs.gpu import StandInGpu

    class NoDeviceDecoder(nvcomp.StandInDecoder):
        def _run(self, host, lo, hi, calls):  # the host side of _run: no transfer, no decode
            stream = nvcomp.LIFETIMES.stream("stand-in", 0, nvcomp.StandInStream)
            for call in calls:
                nvcomp._check_sizes(call)
                [host[o:o + n] for o, n in call.spans]
                [nvcomp._bytes_of(d) for d in call.outs]
                if call.compressor is not None:
                    nvcomp.LIFETIMES.codec(stream.ptr, call.compressor, lambda: None)
            return nvcomp._COMPLETED, nvcomp._COMPLETED

    class NoDeviceGpu(StandInGpu):
        def _make_decoder(self):
            return NoDeviceDecoder()

    return NoDeviceGpu()


def batch_of(gpu, chain, n):
    from xinsitu.codecs.gpu_batch import GpuBatch

    return GpuBatch(gpu.decoder(), n * chain.bound, gpu.asarray)


def stage_bytes(path: str, n: int, rounds: int) -> float:
    from xinsitu.codecs.gpu_chain import gpu_chain

    a, keys = _array(path)
    chain = gpu_chain(a)
    raws = [open(os.path.join(path, k), "rb").read() for k in keys]
    gpu = noop_gpu()
    dests = [np.empty(chain.shape, chain.dtype) for _ in range(n)]
    times = []
    for _ in range(rounds + 1):
        batch = batch_of(gpu, chain, n)
        t0 = time.perf_counter()
        for i, (raw, d) in enumerate(zip(raws, dests, strict=True)):
            batch.add(raw, chain, d, ("x", (i, 0, 0), keys[i]))
        batch.flush()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / n


def stage_read_only(path: str, n: int, rounds: int) -> float:
    """The baseline of ``files``: the chunk files only read, as the CPU path reads them (no GPU path)."""
    from xinsitu.io.place import SCRATCH
    from xinsitu.stores.backend import LocalBackend

    _, keys = _array(path)
    store = LocalBackend(path, None)
    times = []
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        for k in keys[:n]:
            store.read(k, SCRATCH)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / n


def stage_files(path: str, n: int, rounds: int) -> float:
    from xinsitu.codecs.gpu_chain import gpu_chain
    from xinsitu.stores.backend import LocalBackend

    a, keys = _array(path)
    chain = gpu_chain(a)
    store = LocalBackend(path, None)
    gpu = noop_gpu()
    dests = [np.empty(chain.shape, chain.dtype) for _ in range(n)]
    times = []
    for _ in range(rounds + 1):
        batch = batch_of(gpu, chain, n)
        scratch = batch.staging  # what the read path reads a GPU chunk into
        t0 = time.perf_counter()
        for i, d in enumerate(dests):
            batch.add(store.read(keys[i], scratch), chain, d, ("x", (i, 0, 0), keys[i]))
        batch.flush()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / n


def stage_read_gpu(path: str, n: int, rounds: int) -> float:
    import xinsitu
    from xinsitu.codecs.gpu_chain import gpu_chain
    from xinsitu.index.source import resolve
    from xinsitu.io import loop as _loop
    from xinsitu.io.reader import GpuRead, Reader

    src = resolve(xinsitu.open_zarr(path), ["x"])["x"]
    chain = gpu_chain(src.array)
    gpu = noop_gpu()
    gpu.checked.add(chain)
    coords = [(i, 0, 0) for i in range(n)]
    outs = [np.empty(chain.shape, chain.dtype) for _ in range(n)]
    reader = Reader()

    async def one():
        await reader.read_gpu([GpuRead(src, coords, outs, chain)], gpu)

    times = []
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        _loop.run(one())
        times.append(time.perf_counter() - t0)
    assert reader.counters.chunks == n * (rounds + 1), reader.counters
    return statistics.median(times[1:]) / n


class NoopDev:
    """A device array whose device work is a no-op: a view costs what a view costs on the host, and each
    copy on the device (``a[...] = b``, a take) is counted where a GPU would launch a kernel."""

    copies = 0

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, k):
        if isinstance(k, (int, np.integer)):
            return NoopDev(self.shape[1:], self.dtype)
        if isinstance(k, slice):
            return NoopDev((len(range(*k.indices(self.shape[0]))), *self.shape[1:]), self.dtype)
        NoopDev.copies += 1  # an index array: a take
        return NoopDev((len(k), *self.shape[1:]), self.dtype)

    def __setitem__(self, k, v):
        NoopDev.copies += 1


class NoopArrays:
    """The device cache tier's device memory as ``NoopDev`` arrays (its copies counted, not made)."""

    kind = "noop"
    allocs = 0

    def empty(self, shape, dtype):
        return NoopDev(shape, dtype)

    def take(self, slab, rows):
        NoopDev.copies += 1
        return NoopDev((len(rows), *slab.shape[1:]), slab.dtype)

    def take_into(self, slab, rows, out):
        NoopDev.copies += 1

    def scatter(self, out, pos, values):
        NoopDev.copies += 1

    def asarray(self, a):
        return a


def stage_tier(path: str, n: int, rounds: int) -> tuple[float, float]:
    """A batch of ``n`` chunks that the device cache tier holds, through ``Reader.read_gpu`` into a device
    array (its rows the destinations): host seconds per chunk, and copies on the device per batch (the
    kernels a GPU would launch). The first round decodes (no-op) and keeps the chunks; the others hit."""
    import xinsitu
    from xinsitu.cache.device_tier import DeviceCache
    from xinsitu.codecs.gpu_chain import gpu_chain
    from xinsitu.index.source import resolve
    from xinsitu.io import loop as _loop
    from xinsitu.io.reader import GpuRead, Reader

    src = resolve(xinsitu.open_zarr(path), ["x"])["x"]
    chain = gpu_chain(src.array)
    gpu = noop_gpu()
    gpu.checked.add(chain)
    coords = [(i, 0, 0) for i in range(n)]
    tier = DeviceCache(1 << 40, NoopArrays())
    reader = Reader(cache=xinsitu.ChunkCache(memory=0))
    async def one(stack):
        await reader.read_gpu([GpuRead(src, coords, [stack[i] for i in range(n)], chain, stack)], gpu, tier)

    _loop.run(one(np.empty((n, *chain.shape), chain.dtype)))  # decoded (no-op), kept
    assert len(tier) == n, len(tier)
    times, copies = [], []
    for _ in range(rounds):
        before = NoopDev.copies
        stack = NoopDev((n, *chain.shape), chain.dtype)
        t0 = time.perf_counter()
        _loop.run(one(stack))
        times.append(time.perf_counter() - t0)
        copies.append(NoopDev.copies - before)
    assert tier.stats.hits == n * rounds, tier.stats
    return statistics.median(times) / n, statistics.median(copies)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("XINSITU_DECODE_THREADS", "1")
    import xinsitu

    out = {"xinsitu": os.path.dirname(xinsitu.__file__), "chunks_per_batch": args.chunks, "us_per_chunk": {}}
    with tempfile.TemporaryDirectory() as root:
        for label, shape in SIZES.items():
            path = make_archive(root, label, shape, args.chunks)
            res = {}
            for stage in (stage_bytes, stage_read_only, stage_files, stage_read_gpu):
                name = stage.__name__.removeprefix("stage_")
                res[name] = round(stage(path, args.chunks, args.rounds) * 1e6, 1)
            res["files_minus_read"] = round(res["files"] - res["read_only"], 1)
            tier_s, tier_copies = stage_tier(path, args.chunks, args.rounds)
            res["tier"] = round(tier_s * 1e6, 1)
            res["tier_device_copies_per_batch"] = tier_copies
            out["us_per_chunk"][label] = res
            cells = [f"{k} {v:6.1f}" + ("" if k.endswith("_per_batch") else " us/chunk") for k, v in res.items()]
            print(f"{label:6s} " + "  ".join(cells), flush=True)
    dest = args.out or os.path.join(os.environ.get("OUT", "/tmp/out"), "gpu_host_cost.json")
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    with open(dest, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
