#!/usr/bin/env python
"""What issue 31 asks to measure on a GPU machine, in one run (no GPU: it says so and exits 0).

    python bench/gpu_bench.py ARCHIVE [--stages epochs,copy,decode,kvikio] [--vars t2m,u10]

Stages (each a JSON object in ``$OUT/gpu_bench.json``, else /tmp/out; one line printed per stage):

* ``epochs``: samples/s of whole epochs, side by side: cold with chunks decoded on the CPU, on the GPU
  and as ``decode="auto"`` chooses (``decode=``; what it chose and why: its repr line), warm as numpy
  from the host memory tier, on ``cuda`` decoded on the CPU, and from a device cache tier
  (``ChunkCache(device=)``) beside a device-to-device copy of the same bytes; the ratios issue 36
  targets; peak device memory.

* ``copy``: host-to-device copies of one stacked batch (batch 32 and 128): ``pin_memory()`` per batch
  then copy (xinsitu before the ring), a plain pageable ``.cuda(non_blocking=True)``, and
  ``xinsitu.batches.device_copy.DeviceMover`` (reused pinned ring, own stream, event per batch) -- GB/s, and the
  overlap with a GPU step of ~1.4 ms (efficiency = steps on resident data / steps fed by the copies).
* ``decode``: the archive's zstd chunks decoded by ``xinsitu.codecs.nvcomp.NvcompDecoder`` (one pinned
  transfer and one batched nvCOMP call per 64 chunks, bit-checked against numcodecs) against numcodecs
  on 2 and on every CPU core -- GB/s of decoded bytes.
* ``kvikio``: reading the chunk files into device memory: Python ``readinto`` into pinned memory then
  one copy (today's read + copy), ``kvikio.CuFile.pread`` straight into device memory (GDS where the
  machine has it, else kvikio's own bounce buffers), and over HTTP from a server on 127.0.0.1:
  ``kvikio.RemoteFile.open_http`` into device memory against obstore's HTTP reads into host memory.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

OUT = os.environ.get("OUT", "/tmp/out")


def _time(fn, n=5):
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def stage_copy(torch, args):
    W = torch.randn(2048, 2048, device="cuda")

    def model(x):
        y = W * x.float().mean()
        for _ in range(4):
            y = y @ W
        return y

    return {f"bs{bs}": _copy_one(torch, bs, model) for bs in (32, 128)}


def _copy_one(torch, bs, model, steps=40):
    from xinsitu.batches.device_copy import DeviceMover, TorchCuda

    host = np.random.default_rng(0).normal(size=(bs, 4, 64, 128)).astype("f4")
    t = torch.from_numpy(host)
    nb = host.nbytes
    res = {"batch_MB": round(nb / 1e6, 1)}
    mover = DeviceMover(TorchCuda("cuda"))
    resident = torch.from_numpy(host).cuda()

    def run(kind, with_model):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            if kind == "pin_each":  # xinsitu before the ring
                d = t.pin_memory().to("cuda", non_blocking=True)
            elif kind == "pageable":  # the user's own .cuda(non_blocking=True)
                d = t.cuda(non_blocking=True)
            elif kind == "ring":
                d = mover.hand_out(mover.move(host))
            else:
                d = resident
            if with_model:
                model(d)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for kind in ("pin_each", "pageable", "ring"):
        run(kind, False)
        res[f"{kind}_GBps"] = round(steps * nb / run(kind, False) / 1e9, 1)
    ideal = run("resident", True)
    for kind in ("pin_each", "pageable", "ring"):
        res[f"{kind}_overlap_eff"] = round(ideal / run(kind, True), 3)
    res["step_ms"] = round(ideal / steps * 1e3, 2)
    res["ring_pinned_allocs"] = mover.stats.pinned_allocs
    res["ring_waits"] = mover.stats.waits
    return res


def chunk_files(args):
    files = []
    for v in args.vars.split(","):
        files += sorted(f for f in glob.glob(f"{args.archive}/{v}/c/**", recursive=True) if os.path.isfile(f))
    return files


def stage_decode(torch, args):
    res = {}
    for v in args.vars.split(","):
        res.update(_decode_one(args, v))
    return res


def _decode_one(args, v):
    import cupy
    import numcodecs
    import zarr

    from xinsitu.codecs.gpu_chain import gpu_chain
    from xinsitu.codecs.nvcomp import NvcompDecoder

    a = zarr.open_array(args.archive, path=v, mode="r")
    chain = gpu_chain(a)
    res = {f"{v}_chain": chain.describe()}
    if not chain.gpu:
        return res
    files = sorted(f for f in glob.glob(f"{args.archive}/{v}/c/**", recursive=True) if os.path.isfile(f))
    raws = [open(f, "rb").read() for f in files]
    z = numcodecs.Zstd()
    ref = [np.frombuffer(z.decode(r), dtype=chain.dtype).reshape(chain.shape) for r in raws]
    raw_bytes = sum(r.nbytes for r in ref)
    dec = NvcompDecoder()
    group = 64  # chunks per transfer and per batched call (a buffer's worth)
    dests = [cupy.empty(chain.shape, chain.dtype) for _ in raws]

    def gpu():
        for i in range(0, len(raws), group):
            dec.decode_many(raws[i:i + group], dests[i:i + group], chain)
        cupy.cuda.Device().synchronize()

    gpu()
    res[f"{v}_bit_identical"] = all(np.array_equal(cupy.asnumpy(d).view("u1"), r.view("u1"))
                                    for d, r in zip(dests, ref, strict=True))
    res[f"{v}_gpu_GBps"] = round(raw_bytes / _time(gpu, 3) / 1e9, 2)
    for th in (2, os.cpu_count()):
        with ThreadPoolExecutor(th) as ex:
            res[f"{v}_cpu_{th}threads_GBps"] = round(
                raw_bytes / _time(lambda ex=ex: list(ex.map(z.decode, raws)), 3) / 1e9, 2)
    res[f"{v}_transfers"], res[f"{v}_decode_calls"] = dec.transfers, dec.decode_calls
    res[f"{v}_configs_made_ahead"] = dec.configs  # False: nvCOMP's decompression configs were given up
    return res


def stage_kvikio(torch, args):
    import cupy

    res = {}
    files = chunk_files(args)
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    res["files"], res["MB"] = len(files), round(total / 1e6, 1)
    pinned = np.frombuffer(cupy.cuda.alloc_pinned_memory(total), dtype=np.uint8, count=total)
    dev = cupy.empty(total, dtype=cupy.uint8)
    offs = np.concatenate([[0], np.cumsum(sizes)])

    def python_read():
        for f, o, n in zip(files, offs, sizes, strict=False):
            with open(f, "rb", buffering=0) as fh:
                fh.readinto(memoryview(pinned[o:o + n]))
        dev.set(pinned)
        cupy.cuda.Device().synchronize()

    res["python_read_pinned_copy_GBps"] = round(total / _time(python_read, 3) / 1e9, 2)
    try:
        import kvikio
    except ImportError as e:
        res["kvikio"] = f"not installed ({e})"
        return res
    res["kvikio_version"] = kvikio.__version__
    res["kvikio_compat_mode"] = str(kvikio.defaults.compat_mode()) if hasattr(kvikio.defaults, "compat_mode") else "?"

    def kv_read():
        futs = []
        for f, o, n in zip(files, offs, sizes, strict=False):
            fh = kvikio.CuFile(f, "r")
            futs.append((fh, fh.pread(dev[o:o + n])))
        for fh, fut in futs:
            fut.get()
            fh.close()
        cupy.cuda.Device().synchronize()

    res["kvikio_cufile_device_GBps"] = round(total / _time(kv_read, 3) / 1e9, 2)
    # HTTP from 127.0.0.1
    import functools
    import http.server

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=args.archive)
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        base = f"http://127.0.0.1:{srv.server_address[1]}/"
        rel = [os.path.relpath(f, args.archive) for f in files]
        if hasattr(kvikio, "RemoteFile"):
            def kv_http():
                futs = []
                for r, o, n in zip(rel, offs, sizes, strict=False):
                    rf = kvikio.RemoteFile.open_http(base + r)
                    futs.append((rf, rf.pread(dev[o:o + n])))
                for _rf, fut in futs:
                    fut.get()
                cupy.cuda.Device().synchronize()

            res["kvikio_http_device_GBps"] = round(total / _time(kv_http, 2) / 1e9, 3)
        import obstore
        from obstore.store import HTTPStore

        store = HTTPStore.from_url(base)

        def obs_http():
            with ThreadPoolExecutor(16) as ex:
                list(ex.map(lambda r: obstore.get(store, r).bytes(), rel))

        res["obstore_http_host_GBps"] = round(total / _time(obs_http, 2) / 1e9, 3)
    finally:
        srv.shutdown()
    return res


def stage_epochs(torch, args):
    """The issue's targets side by side in one run: cold epochs decoded on the CPU, on the GPU and as
    ``decode="auto"`` chooses (and its repr line: what it chose, why), warm epochs as numpy (host memory
    tier), on the device without a device tier, and from the device tier beside a device-to-device copy
    of the same bytes -- samples/s, and the device's peak memory."""
    import xinsitu

    ds = xinsitu.open_zarr(args.archive)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    kw = dict(batch_size=32, stack=True, variables=args.vars.split(","))
    out = {}

    def rate(gen, epochs=1):
        n, t0 = 0, time.perf_counter()
        for e in range(epochs):
            gen.set_epoch(e)
            for b in gen:
                n += len(b)
        torch.cuda.synchronize()
        return round(n / (time.perf_counter() - t0))

    paths = [("cold_cpu_decode", dict(output="torch", device="cuda", decode="cpu")),
             ("cold_gpu_decode", dict(output="torch", device="cuda", decode="gpu")),
             ("cold_auto_decode", dict(output="torch", device="cuda", decode="auto"))]
    for _, more in paths:  # first use in the process (CuPy's kernels compiled, nvCOMP set up, the first
        rate(ds.insitu.batches(m, "val", **kw, **more))  # buffers' rates measured) on the val split
    runs: dict = {name: [] for name, _ in paths}
    for _ in range(3):  # cold = a new generator without a cache, alternating, median of 3
        for name, more in paths:
            runs[name].append(rate(ds.insitu.batches(m, "train", **kw, **more)))
    for name, r in runs.items():
        out[name] = sorted(r)[1]
        out[name + "_runs"] = r
    auto = ds.insitu.batches(m, "train", **kw, output="torch", device="cuda", decode="auto")
    out["auto_chose"] = auto.decode_summary  # which path each variable takes, and the two rates that chose it
    host = ds.insitu.batches(m, "train", output="numpy", cache=True, **kw)
    rate(host)
    out["warm_numpy_host"] = rate(host, 2)
    dev = ds.insitu.batches(m, "train", output="torch", device="cuda", decode="cpu", cache=True, **kw)
    rate(dev)
    out["warm_cuda_cpu_decode"] = rate(dev, 2)
    torch.cuda.reset_peak_memory_stats()
    tiered = ds.insitu.batches(m, "train", output="torch", device="cuda", decode="gpu",
                               cache=xinsitu.ChunkCache(device="8GB"), **kw)
    out["cold_gpu_decode_into_tier"] = rate(tiered)
    out["warm_device_tier"] = rate(tiered, 2)
    out["io_stats_warm"] = {k: tiered.io_stats.get(k) for k in ("cache_hits", "chunks", "samples_per_s")}
    # the bound of a device tier: the same bytes copied device to device, a batch at a time
    n = len(tiered)
    b0 = next(iter(tiered))
    src = b0.reshape(-1).clone()
    dst = torch.empty_like(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        dst.copy_(src)
    torch.cuda.synchronize()
    out["d2d_copy"] = round(n * len(b0) / (time.perf_counter() - t0))
    try:
        import cupy

        pool = cupy.get_default_memory_pool()
        out["cupy_pool_peak_MB"] = round(pool.total_bytes() / 1e6, 1)
    except ImportError:
        pass
    out["torch_peak_MB"] = round(torch.cuda.max_memory_allocated() / 1e6, 1)
    out["ratios"] = {"cold_gpu_over_cpu": round(out["cold_gpu_decode"] / out["cold_cpu_decode"], 2),
                     "cold_auto_over_faster": round(out["cold_auto_decode"]
                                                    / max(out["cold_gpu_decode"], out["cold_cpu_decode"]), 2),
                     "warm_tier_over_d2d_copy": round(out["warm_device_tier"] / out["d2d_copy"], 2),
                     "warm_cuda_over_numpy": round(out["warm_cuda_cpu_decode"] / out["warm_numpy_host"], 2),
                     "warm_tier_over_numpy": round(out["warm_device_tier"] / out["warm_numpy_host"], 2)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("archive")
    ap.add_argument("--stages", default="epochs,copy,decode,kvikio")
    ap.add_argument("--vars", default="t2m,u10", help="variables (all of a weather-model archive: "
                    "z,t,u,v,q,w,t2m,u10,v10,msl)")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device: the GPU figures are taken on a GPU machine"}))
        return 0
    results = {"gpu": torch.cuda.get_device_name(0), "cpus": os.cpu_count()}
    stages = {"epochs": stage_epochs, "copy": stage_copy, "decode": stage_decode, "kvikio": stage_kvikio}
    for name in args.stages.split(","):
        t0 = time.perf_counter()
        try:
            results[name] = stages[name](torch, args)
        except Exception as e:  # noqa: BLE001 - one stage's failure is a finding
            import traceback

            results[name] = {"error": repr(e)[:500], "tb": traceback.format_exc()[-2000:]}
        print(f"== {name} ({time.perf_counter() - t0:.1f} s): {json.dumps(results[name], default=str)[:2000]}",
              flush=True)
        with open(f"{OUT}/gpu_bench.json", "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
