"""Where a cold epoch with decode='gpu' spends its time, beside one with decode='cpu' (on a GPU machine).

    python bench/gpu_profile.py ARCHIVE

Wraps the GPU path's steps (a chunk landing in the batch's staging, the flush, the one transfer and the
batched decodes -- waited for, so that their device time is counted --, the read of a buffer and its
gathers, the batches filled in place) with timers summed over threads, after one untimed epoch of each
path on the val split (CuPy's kernels compiled, nvCOMP set up, the first buffers' rates measured). Sums
over threads exceed the wall time where steps overlap.
"""

from __future__ import annotations

import collections
import functools
import inspect
import sys
import threading
import time

T: dict[str, float] = collections.defaultdict(float)
N: collections.Counter = collections.Counter()
LOCK = threading.Lock()


def _count(label: str, t0: float) -> None:
    with LOCK:
        T[label] += time.perf_counter() - t0
        N[label] += 1


def timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapped_async(*a, **k):
            t0 = time.perf_counter()
            try:
                return await fn(*a, **k)
            finally:
                _count(label, t0)
        setattr(owner, name, wrapped_async)
        return

    @functools.wraps(fn)
    def wrapped(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _count(label, t0)
    setattr(owner, name, wrapped)


def main() -> int:
    try:
        import cupy  # noqa: F401 - the GPU path needs it
        import torch
    except ImportError:
        print("needs torch and CuPy on a CUDA machine")
        return 0
    import xinsitu
    from xinsitu.batches import buffer, direct
    from xinsitu.codecs import gpu_batch, nvcomp, staging

    timed(gpu_batch.GpuBatch, "add", "GpuBatch.add (decode threads)")
    timed(gpu_batch.GpuBatch, "flush", "GpuBatch.flush")
    timed(staging.Staging, "put", "  Staging.put (bytes copied in once)")
    timed(staging.Staging, "take", "  Staging.take (a local read's region)")
    run = nvcomp.NvcompDecoder._run

    def synced(self, host, lo, hi, calls):
        t0 = time.perf_counter()
        copied, done = run(self, host, lo, hi, calls)
        done.synchronize()
        _count("  one transfer + batched decodes (synced)", t0)
        return copied, done

    nvcomp.NvcompDecoder._run = synced
    for name in ("_read_gpu", "_first_gather", "gather", "_gather_var"):
        timed(buffer.BufferLoader, name, f"BufferLoader.{name}")
    for name in ("load", "_convert_all"):
        timed(direct.DeviceDirectLoader, name, f"DeviceDirectLoader.{name}")

    ds = xinsitu.open_zarr(sys.argv[1])
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    kw = dict(batch_size=32, stack=True, variables=["t2m", "u10"], output="torch", device="cuda")

    def epoch(split, decode):
        gen = ds.insitu.batches(m, split, decode=decode, **kw)
        n, t0 = 0, time.perf_counter()
        for b in gen:
            n += len(b)
        torch.cuda.synchronize()
        return n / (time.perf_counter() - t0), gen

    for decode in ("gpu", "cpu"):
        epoch("val", decode)
    for decode in ("gpu", "cpu", "gpu"):
        T.clear()
        N.clear()
        rate, gen = epoch("train", decode)
        print(f"decode={decode}: {rate:.0f} samples/s; chunks {gen.io_stats.get('chunks')}, "
              f"decode_s {gen.io_stats.get('decode_s', 0):.3f}")
        for k in sorted(T, key=lambda k: -T[k]):
            print(f"   {k:40s} {T[k] * 1e3:9.1f} ms  x{N[k]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
