#!/usr/bin/env python
"""``ds.insitu.stats`` on a Dask cluster against one process, and what a task costs.

    python bench/cluster_stats.py [--data DIR.zarr] [--nt 730] [--ny 121] [--nx 240] [--chunk-time 1]
                                  [--repeat 3] [--threads 1] [--json out.json]

On the 80 % train split of an ERA5-like archive (``--data``, or one written to a temp dir: float32
t2m, u10, v10, z500 and int16-packed tp, zstd, ``--chunk-time`` steps per chunk), the median of
``--repeat`` runs of:

- ``local``: ``ds.insitu.stats(m, "train")`` in this process (its decode threads: every core);
- ``client-1``, ``client-2``: ``stats(..., client=c)`` on a ``distributed.LocalCluster`` of 1 and 2
  worker processes (``--threads`` threads each; each worker reads with its own decode threads); the
  first run of each cluster (workers importing xinsitu, opening the archive) is timed apart (``warm-up``);
- ``overhead``: on the 1-worker cluster, the same statistics cut into one task per unit (chunk block)
  and into one task: (t_many - t_one) / (tasks - 1) is what a task costs beyond its reads (scheduling,
  the shipped job's copy, the reader, planning the part, the partial result and its merge).

Every result is checked equal, bit for bit, to the local one. Rates are decoded MB/s (the split's
values as float32/float64 after CF decoding). The machine may be shared: compare within one run.
No timed assertion anywhere.
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

warnings.filterwarnings("ignore", message=".*[Cc]onsolidated metadata.*")


def timed(fn: Any, repeat: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="an existing archive (default: write one to a temp dir)")
    ap.add_argument("--nt", type=int, default=730)
    ap.add_argument("--ny", type=int, default=121)
    ap.add_argument("--nx", type=int, default=240)
    ap.add_argument("--chunk-time", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="threads per worker process")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()

    import numpy as np
    from distributed import Client, LocalCluster

    import xinsitu
    import xinsitu.batches.cluster as cluster
    from xinsitu.synthetic import write_era5_like

    tmp = None
    path = a.data
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="xinsitu-cluster-bench-")
        path = os.path.join(tmp.name, "era5.zarr")
        write_era5_like(path, nt=a.nt, ny=a.ny, nx=a.nx, chunk_time=a.chunk_time)
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    variables = [v for v in ds.data_vars if "time" in ds[v].dims]
    units = len(m.splits["train"])
    mb = sum(ds[v].isel(time=0).nbytes for v in variables) * m.positions("train") / 1e6
    same = json.dumps

    t_local, ref = timed(lambda: ds.insitu.stats(m, "train"), a.repeat)
    rows: list[dict[str, Any]] = [{"run": "local", "workers": 0, "tasks": 1, "s": t_local}]
    overhead: dict[str, Any] = {}
    for workers in (1, 2):
        with LocalCluster(n_workers=workers, threads_per_worker=a.threads, processes=True,
                          dashboard_address=":0") as lc, Client(lc) as c:
            t0 = time.perf_counter()
            got = ds.insitu.stats(m, "train", client=c)
            warm = time.perf_counter() - t0
            assert same(got, sort_keys=True) == same(ref, sort_keys=True), "cluster result differs"
            t, got = timed(lambda c=c: ds.insitu.stats(m, "train", client=c), a.repeat)
            assert same(got, sort_keys=True) == same(ref, sort_keys=True), "cluster result differs"
            tasks = cluster.task_count(c, units)
            rows.append({"run": f"client-{workers}", "workers": workers, "tasks": tasks, "s": t, "warm_up_s": warm})
            if workers == 1:
                saved = (cluster.TASKS_PER_THREAD, cluster.UNITS_PER_TASK)
                try:
                    cluster.TASKS_PER_THREAD, cluster.UNITS_PER_TASK = 1, 10**9  # one task
                    t_one, _ = timed(lambda c=c: ds.insitu.stats(m, "train", client=c), a.repeat)
                    cluster.TASKS_PER_THREAD, cluster.UNITS_PER_TASK = 1, 1  # one task per unit
                    t_many, got = timed(lambda c=c: ds.insitu.stats(m, "train", client=c), a.repeat)
                    assert same(got, sort_keys=True) == same(ref, sort_keys=True), "cluster result differs"
                finally:
                    cluster.TASKS_PER_THREAD, cluster.UNITS_PER_TASK = saved
                overhead = {"one_task_s": t_one, "tasks": units, "one_per_unit_s": t_many,
                            "per_task_ms": 1e3 * (t_many - t_one) / max(units - 1, 1),
                            "unit_mb": mb / units, "per_task_rate_mb_s": mb / t_one}
    for r in rows:
        r["mb_s"] = mb / r["s"]
        r["vs_local"] = t_local / r["s"]
    res = {"archive": path if a.data else f"{a.nt}x{a.ny}x{a.nx}, chunks of {a.chunk_time} step(s), "
                                          f"{len(variables)} variables",
           "cpus": os.cpu_count(), "units": units, "decoded_mb": round(mb, 1), "runs": rows, "overhead": overhead,
           "numpy": np.__version__}
    print(f"{res['archive']}: train split of {units} units (chunk blocks), {mb:.0f} MB decoded, "
          f"{os.cpu_count()} CPUs, {a.threads} thread(s) per worker; median of {a.repeat}\n")
    print("| run | workers | tasks | s | MB/s | vs local | first run (warm-up) s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['workers'] or '-'} | {r['tasks']} | {r['s']:.2f} | {r['mb_s']:.0f} | "
              f"{r['vs_local']:.2f} | {r.get('warm_up_s', float('nan')):.1f} |")
    if overhead:
        print(f"\noverhead per task (1 worker): {overhead['per_task_ms']:.1f} ms "
              f"({overhead['tasks']} tasks of one unit in {overhead['one_per_unit_s']:.2f} s, "
              f"one task in {overhead['one_task_s']:.2f} s); one task reads {overhead['per_task_rate_mb_s']:.0f} "
              f"MB/s, a unit is {overhead['unit_mb']:.2f} MB")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if tmp is not None:
        tmp.cleanup()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
