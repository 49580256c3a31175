#!/usr/bin/env python
"""Peak memory of cached epochs against the bound issue 18 sets:

    peak RSS - RSS before the generator  <=  cache held + (block_chunks + in flight) x chunk x 1.5

For each ``--budget`` (a memory-tier budget: ``all`` holds the whole split, or bytes such as
``100MB``), a fresh process opens the archive, notes its RSS, makes
``ds.insitu.batches(m, "train", cache=ChunkCache(memory=budget), output="numpy", stack=True)``
and runs ``--epochs`` shuffled epochs while a thread samples its RSS every 2 ms. The bound's
terms: *cache held* is what the memory tier holds at the end (``cache.stats.memory_bytes``),
*chunk* the decoded bytes of one chunk of each variable summed (a unit of one time chunk, all
variables), *block_chunks* the generator's, *in flight* the reader's request limit at the end.
Prints one JSON line per budget.

    python bench/cache_memory.py --data ../bench-data/era5_v3.zarr --budget all,100MB,0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_one(data: str, budget: str, epochs: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    sys.path.insert(0, ROOT)
    import xinsitu
    from xinsitu.cache.chunk_cache import ChunkCache

    ds = xinsitu.open_zarr(data)[["t2m", "u10", "v10", "z500"]]
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1})
    base = _rss()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    if budget == "all":
        mem: int | str = "100GB"
    else:
        mem = budget
    cache = ChunkCache(memory=mem)
    gen = ds.insitu.batches(m, "train", batch_size=32, output="numpy", stack=True, cache=cache)
    t0 = time.perf_counter()
    n = 0
    for e in range(epochs):
        gen.set_epoch(e)
        for b in gen:
            n += len(b)
    dt = time.perf_counter() - t0
    stop.set()
    th.join()
    chunk = sum(_chunk_bytes(ds[v]) for v in ds.data_vars)
    reader = gen._reader
    held = cache.stats.memory_bytes
    inflight = reader.inflight.limit if reader is not None else 0
    bound = held + (gen.block_chunks + inflight) * chunk * 1.5
    return {"budget": budget, "epochs": epochs, "samples_per_s": round(n / dt), "rss_before_mb": round(base / 1e6),
            "peak_above_mb": round((peak[0] - base) / 1e6, 1), "cache_held_mb": round(held / 1e6, 1),
            "chunk_all_vars_mb": round(chunk / 1e6, 2), "block_chunks": gen.block_chunks, "in_flight": inflight,
            "bound_mb": round(bound / 1e6, 1), "within": peak[0] - base <= bound}


def _chunk_bytes(da) -> int:  # noqa: ANN001 - a DataArray
    import numpy as np

    chunks = da.encoding.get("chunks") or da.encoding.get("preferred_chunks", {}) or da.shape
    if isinstance(chunks, dict):
        chunks = [chunks.get(d, n) for d, n in zip(da.dims, da.shape, strict=True)]
    return int(np.prod(chunks)) * da.dtype.itemsize


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.join(ROOT, "..", "bench-data", "era5_v3.zarr"))
    p.add_argument("--budget", default="all,100MB,0")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one is not None:
        print("RESULT " + json.dumps(run_one(a.data, a.one, a.epochs)), flush=True)
        return
    for b in a.budget.split(","):
        out = subprocess.run([sys.executable, __file__, "--data", a.data, "--epochs", str(a.epochs), "--one", b],
                             capture_output=True, text=True, timeout=1800)
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        print(line[0][7:] if line else json.dumps({"budget": b, "error": out.stderr[-500:]}), flush=True)


if __name__ == "__main__":
    main()
