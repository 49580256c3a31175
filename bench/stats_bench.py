#!/usr/bin/env python
"""Throughput of ``compute_stats`` against the read+decode limit of the same split.

Three passes over the 80 % train split of a 4-variable float32 archive (by default the
yardstick's shape: 2920 x 64 x 128, chunks of 24 time steps, zstd), alternated, the page
cache warmed first, the median of ``--repeat`` runs reported:

- ``stats``: ``StatsPass(...).run()``, what ``ds.insitu.stats`` runs;
- ``read``: the same pass with the reduction left out: the same reader, the same reads in
  flight, each chunk fetched and decoded into the decode thread's buffer, nothing else;
- ``ceiling``: the read+decode limit: every chunk object of the split fetched once with
  obstore (``--inflight`` requests in flight) and decoded by numcodecs in a pool of as many
  threads as xinsitu decodes with, into one reused array per thread (``bench/workloads.py``);
- ``yardstick``: the yardstick's own ceiling (``../shared/bench/peers.py``, the judge's
  definition of the read+decode limit: the same, each chunk decoded into a new array), run
  in this process when that file is there (``--yardstick PATH``).

The target is stats / ceiling >= 0.85; stats / read is what the reduction itself costs.
The same ratios of process CPU seconds are shown beside them.

    python bench/stats_bench.py                        # writes the archive to a temp dir
    python bench/stats_bench.py --data ../bench-data/era5_v3.zarr --repeat 9
    # a store with 20 ms per request (the yardstick's server; the archive needs consolidated metadata)
    python ../shared/bench/latency_server.py ../bench-data/era5_v3.zarr --port 8000 --latency-ms 20 &
    python bench/stats_bench.py --data http://127.0.0.1:8000/

On local disk every pass is CPU-bound (chunk decoding), so the ratios are what the
reduction costs in CPU; on a store with latency the reduction hides behind the reads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workloads  # noqa: E402  (bench/workloads.py)

import xinsitu  # noqa: E402
from xinsitu.batches.stats import StatsPass  # noqa: E402
from xinsitu.io import loop as _loop  # noqa: E402
from xinsitu.synthetic import FLOAT_VARS, era5_like  # noqa: E402

warnings.filterwarnings("ignore", message=".*[Cc]onsolidated metadata.*")


def write_archive(path: str, nt: int, ny: int, nx: int, chunk_time: int) -> None:
    ds = era5_like(nt, ny, nx)[list(FLOAT_VARS)]
    enc = {v: {"chunks": (chunk_time, ny, nx)} for v in FLOAT_VARS}
    ds.to_zarr(path, mode="w", zarr_format=3, encoding=enc, consolidated=True)


class ReadOnly(StatsPass):
    """The stats pass without the reduction: chunks are read and decoded, then dropped."""

    def _reduce(self, name: str, raw: Any, out_sel: list[Any]) -> None:
        pass


def yardstick_ceiling(peers_py: str, path: str, inflight: int) -> Any:
    """One pass of the yardstick's ``ceiling`` peer over ``path`` (its 80 % train split)."""
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location("yardstick_peers", peers_py)
    assert spec is not None and spec.loader is not None
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    a = types.SimpleNamespace(data=path, train_frac=0.8, batch_size=32, seed=0, max_batches=0, max_seconds=0,
                              warmup=0, inflight=inflight, decode_threads=_loop.decode_threads(), block_chunks=16,
                              mp_context=None, verify=False, ceiling_passes=1)
    task = peers.Task(a)
    return lambda: peers.peer_ceiling(task, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="an existing archive (default: write one to a temp dir)")
    ap.add_argument("--nt", type=int, default=2920)
    ap.add_argument("--ny", type=int, default=64)
    ap.add_argument("--nx", type=int, default=128)
    ap.add_argument("--chunk-time", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--inflight", type=int, default=128, help="the ceiling's requests in flight (yardstick: 128)")
    ap.add_argument("--no-ceiling", action="store_true", help="leave the ceilings out (archives not bytes+zstd)")
    ap.add_argument("--yardstick", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "bench",
                                                        "peers.py"), help="the yardstick's peers.py (if present)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    tmp = None
    path = args.data
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="xinsitu-stats-bench-")
        path = os.path.join(tmp.name, "era5.zarr")
        write_archive(path, args.nt, args.ny, args.nx, args.chunk_time)
    ds = xinsitu.open_zarr(path)[list(FLOAT_VARS)]
    m = ds.insitu.split("time", fractions=workloads.FRACTIONS)
    chunks = [int(c) for c in m.splits["train"]]
    passes: dict[str, Any] = {
        "stats": lambda: StatsPass(ds, m, "train").run(),
        "read": lambda: ReadOnly(ds, m, "train").run(),
    }
    if not args.no_ceiling:
        ceiling = workloads.Ceiling({"url": path, "train_chunks": chunks, "inflight": args.inflight,
                                     "decode_threads": _loop.decode_threads()})
        passes["ceiling"] = ceiling.run
        if os.path.exists(args.yardstick):
            passes["yardstick"] = yardstick_ceiling(args.yardstick, path, args.inflight)
    for run in passes.values():  # warm the page cache, the loops, the threads, the connections
        run()
    wall: dict[str, list[float]] = {k: [] for k in passes}
    cpu: dict[str, list[float]] = {k: [] for k in passes}
    for _ in range(args.repeat):
        for name, run in passes.items():
            t0, c0 = time.perf_counter(), time.process_time()
            run()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    sp = StatsPass(ds, m, "train")
    sp.run()
    mb = sp.reader.counters.bytes_decoded / 1e6
    med = {k: statistics.median(v) for k, v in wall.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    res: dict[str, Any] = {
        "archive": path if args.data else f"{args.nt}x{args.ny}x{args.nx}, {len(FLOAT_VARS)} vars, "
                                           f"chunks of {args.chunk_time}",
        "cpus": os.cpu_count(), "decode_threads": _loop.decode_threads(), "chunks": sp.reader.counters.chunks,
        "decoded_mb": round(mb, 1), "max_inflight": sp.reader.inflight.limit,
        **{f"{k}_s": round(v, 4) for k, v in med.items()},
        **{f"{k}_mb_s": round(mb / v, 1) for k, v in med.items()},
        **{f"stats_vs_{k}": round(v / med["stats"], 3) for k, v in med.items() if k != "stats"},
        **{f"cpu_s_{k}": round(v, 4) for k, v in cmed.items()},
        **{f"cpu_stats_vs_{k}": round(v / cmed["stats"], 3) for k, v in cmed.items() if k != "stats"},
        "runs_s": {k: [round(t, 4) for t in v] for k, v in wall.items()},
    }
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
