#!/usr/bin/env python
"""Map-style reads (``InsituDataset`` + a torch ``RandomSampler``) beside ``batches()``.

On the yardstick archive (2920 x 64 x 128, 4 float32 variables, chunks of 24 time steps,
zstd; the 80 % train split), ``--batches`` batches of 32 each way, in one run, the page
cache warmed first:

- ``batches``: ``ds.insitu.batches(m, "train", batch_size=32, output="torch", stack=True)``,
  the shuffled epoch of xinsitu's own plan (each chunk read once per epoch);
- ``map random``: ``DataLoader(d, batch_size=32, sampler=RandomSampler(d), num_workers=0)``
  over ``d = InsituDataset(ds, m, "train", output="torch", stack=True)`` with the default
  ``collate_fn`` (stacks the per-sample items ``__getitems__`` returns);
- ``map random, collate``: the same with ``collate_fn=xinsitu.batches.mapstyle.collate`` (the batch
  ``__getitems__`` read, handed on without the stacking copy);
- ``map sequential``: a ``SequentialSampler`` (consecutive samples: ~2 chunks per batch);
- ``map random, cache``: ``cache=True`` after one pass over the split has filled it (only
  where ``Reader`` takes ``cache=``).

Reported per pass (medians of ``--repeat`` rounds, the passes alternated): samples/s and its
ratio to ``batches``; process CPU time per sample (all threads) and its ratio, which a busy
shared machine disturbs far less than wall time; chunks read and cache hits per sample. Why map
style is slower under a random sampler: each random sample falls in a chunk of 24 steps of
its own, and the whole chunk is fetched and decoded to serve it -- about 24 times the
decoding per sample of ``batches()``, which serves all 24 samples of a chunk from one read.

    python bench/dataset_bench.py                               # ../bench-data/era5_v3.zarr
    python bench/dataset_bench.py --data /work/bench-data/era5_v3.zarr --batches 30 --json out.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", message=".*[Cc]onsolidated metadata.*")

import torch  # noqa: E402
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler  # noqa: E402

import xinsitu  # noqa: E402
from xinsitu.batches.mapstyle import InsituDataset, collate  # noqa: E402
from xinsitu.io.reader import Reader  # noqa: E402

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "bench-data",
                            "era5_v3.zarr")


def _warm(path: str) -> None:
    """Read every file once so that every pass finds the archive in the page cache."""
    for root, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                while fh.read(1 << 22):
                    pass


def run_batches(ds: Any, m: Any, n: int, bs: int) -> dict[str, float]:
    gen = ds.insitu.batches(m, "train", batch_size=bs, output="torch", stack=True, seed=0)
    it = iter(gen)
    next(it)  # start-up (first block read) outside the timing, as for the map passes
    t0, c0, samples = time.perf_counter(), time.process_time(), 0
    for _ in range(n):
        samples += len(next(it))
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    chunks = gen._buffer_loader().reader.counters.chunks  # this process's reads, first batch included
    it.close()
    return {"samples": samples, "seconds": dt, "samples_per_s": samples / dt, "cpu_ms_per_sample": cpu / samples * 1e3,
            "chunks_per_sample": chunks / (samples + bs)}


def run_map(d: InsituDataset, sampler: Any, n: int, bs: int, collate_fn: Any = None) -> dict[str, float]:
    dl = DataLoader(d, batch_size=bs, sampler=sampler, num_workers=0, collate_fn=collate_fn)
    it = iter(dl)
    next(it)
    before = d.io_stats
    t0, c0, samples = time.perf_counter(), time.process_time(), 0
    for _ in range(n):
        samples += len(next(it))
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = d.io_stats
    return {"samples": samples, "seconds": dt, "samples_per_s": samples / dt, "cpu_ms_per_sample": cpu / samples * 1e3,
            "chunks_per_sample": (after["chunks"] - before["chunks"]) / samples,
            "cache_hits_per_sample": (after.get("cache_hits", 0) - before.get("cache_hits", 0)) / samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--batches", type=int, default=30, help="timed batches per pass")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3, help="rounds of all passes, alternated; medians reported")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the stacking copy of the default collate: one thread, as a training loop has
    _warm(args.data)
    ds = xinsitu.open_zarr(args.data)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    n, bs = args.batches, args.batch_size
    d = InsituDataset(ds, m, "train", output="torch", stack=True)
    dc = None
    if "cache" in inspect.signature(Reader).parameters:
        dc = InsituDataset(ds, m, "train", output="torch", stack=True, cache=True)
        for k in range(0, len(dc), 256):  # fill the cache: one pass over the split
            dc.batch(range(k, min(k + 256, len(dc))))
    seeds = iter(range(10**6))

    def rand(x: InsituDataset) -> RandomSampler:
        return RandomSampler(x, generator=torch.Generator().manual_seed(next(seeds)))

    passes = {"batches": lambda: run_batches(ds, m, n, bs),
              "map random": lambda: run_map(d, rand(d), n, bs),
              "map random, collate": lambda: run_map(d, rand(d), n, bs, collate),
              "map sequential": lambda: run_map(d, SequentialSampler(d), n, bs)}
    if dc is not None:
        passes["map random, cache"] = lambda: run_map(dc, rand(dc), n, bs)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in passes}
    for _ in range(args.repeat):  # alternated: a slow spell of a shared machine hits every pass alike
        for name, fn in passes.items():
            runs[name].append(fn())
    res = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    base = res["batches"]["samples_per_s"]
    print(f"{args.data}: train split {len(d)} samples, {n} batches of {bs} per pass, median of {args.repeat}, "
          f"{os.cpu_count()} cores, decode threads {xinsitu.io.loop.decode_threads()}")
    cpu = res["batches"]["cpu_ms_per_sample"]
    print(f"{'pass':<22} {'samples/s':>10} {'vs batches':>11} {'CPU ms/sample':>14} {'CPU vs batches':>15} "
          f"{'chunks/sample':>14} {'cache hits':>11}")
    for name, r in res.items():
        print(f"{name:<22} {r['samples_per_s']:>10.0f} {r['samples_per_s'] / base:>10.3f}x "
              f"{r['cpu_ms_per_sample']:>14.3f} {r['cpu_ms_per_sample'] / cpu:>14.1f}x "
              f"{r['chunks_per_sample']:>14.2f} {r.get('cache_hits_per_sample', 0.0):>11.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
