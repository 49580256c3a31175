#!/usr/bin/env python
"""Throughput of ``compute_stats`` against a read+decode-only pass through the same reader.

Both passes walk the same split (the 80 % train split of a 4-variable float32 archive,
1460 x 64 x 128, chunks of 24 time steps, zstd) block by block through a ``BlockLoader``
and its async ``Reader`` with the same prefetch depth; the read-only pass drops each
block once loaded, the stats pass CF-decodes and reduces it. The ratio
read-only time / stats time is the share of the reader's speed the statistics keep
(target >= 0.85); the same ratio of process CPU seconds is shown beside it. Passes
alternate, the page cache is warmed first, and the median of ``--repeat`` runs is reported.

    python bench/stats_bench.py                        # writes the archive to a temp dir
    python bench/stats_bench.py --data /path/era5.zarr --repeat 7
    # a store with 20 ms per request (the yardstick's server; the archive needs consolidated metadata)
    python ../shared/bench/latency_server.py /path/era5.zarr --port 8000 --latency-ms 20 &
    python bench/stats_bench.py --data http://127.0.0.1:8000/

On local disk both passes are CPU-bound (chunk decoding), so the ratio is what the float64
reduction costs in CPU; on a store with latency the reduction hides behind the reads.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import time
import warnings

import xinsitu
from xinsitu import _loop
from xinsitu.stats import PREFETCH_BLOCKS, StatsPass
from xinsitu.synthetic import FLOAT_VARS, era5_like

warnings.filterwarnings("ignore", message=".*[Cc]onsolidated metadata.*")


def write_archive(path: str, nt: int, ny: int, nx: int, chunk_time: int) -> None:
    ds = era5_like(nt, ny, nx)[list(FLOAT_VARS)]
    enc = {v: {"chunks": (chunk_time, ny, nx)} for v in FLOAT_VARS}
    ds.to_zarr(path, mode="w", zarr_format=3, encoding=enc, consolidated=True)


def read_only(sp: StatsPass) -> None:
    """The stats pass without the reduction: the same blocks, loader, reader and prefetch."""
    plan = sp.plan()
    pending: collections.deque = collections.deque()
    nxt = 0
    while nxt < min(PREFETCH_BLOCKS, plan.n_blocks):
        pending.append(_loop.submit(sp.loader.load(plan, nxt)))
        nxt += 1
    while pending:
        block = pending.popleft().result()
        if nxt < plan.n_blocks:
            pending.append(_loop.submit(sp.loader.load(plan, nxt)))
            nxt += 1
        sp.loader.recycle(block)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="an existing archive (default: write one to a temp dir)")
    ap.add_argument("--nt", type=int, default=1460)
    ap.add_argument("--ny", type=int, default=64)
    ap.add_argument("--nx", type=int, default=128)
    ap.add_argument("--chunk-time", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--block-chunks", type=int, default=16)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    tmp = None
    path = args.data
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="xinsitu-stats-bench-")
        path = os.path.join(tmp.name, "era5.zarr")
        write_archive(path, args.nt, args.ny, args.nx, args.chunk_time)
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1})

    def new_pass() -> StatsPass:
        return StatsPass(ds, m, "train", block_chunks=args.block_chunks)

    read_only(new_pass())  # warm the page cache, the loop and the decode threads
    new_pass().run()
    t_read, t_stats, c_read, c_stats, mb = [], [], [], [], 0.0
    for _ in range(args.repeat):
        sp = new_pass()
        t0, c0 = time.perf_counter(), time.process_time()
        read_only(sp)
        t_read.append(time.perf_counter() - t0)
        c_read.append(time.process_time() - c0)
        sp = new_pass()
        t0, c0 = time.perf_counter(), time.process_time()
        sp.run()
        t_stats.append(time.perf_counter() - t0)
        c_stats.append(time.process_time() - c0)
        mb = sp.reader.counters.bytes_decoded / 1e6
    r, s = statistics.median(t_read), statistics.median(t_stats)
    res = {"archive": f"{args.nt}x{args.ny}x{args.nx}, {len(FLOAT_VARS)} vars, chunks of {args.chunk_time}",
           "cpus": os.cpu_count(), "decoded_mb": round(mb, 1), "read_only_s": round(r, 4),
           "stats_s": round(s, 4), "read_only_mb_s": round(mb / r, 1), "stats_mb_s": round(mb / s, 1),
           "ratio": round(r / s, 3),
           "cpu_s_read_only": round(statistics.median(c_read), 4), "cpu_s_stats": round(statistics.median(c_stats), 4),
           "cpu_ratio": round(statistics.median(c_read) / statistics.median(c_stats), 3),
           "runs_read_only_s": [round(t, 4) for t in t_read],
           "runs_stats_s": [round(t, 4) for t in t_stats]}
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
