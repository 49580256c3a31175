"""Several epochs of one generator, as a training loop runs them: throughput per epoch and the
wait for the first batch of each epoch (with ``--sleep`` seconds per batch standing in for the
model). Speed lives here, never in a timed test.

    python bench/epochs_bench.py --data ../bench-data/era5_v3_c1.zarr --epochs 3 --cache
    python bench/epochs_bench.py --data ../bench-data/era5_v3_c1.zarr --epochs 4 --sleep 0.01
"""
from __future__ import annotations

import argparse
import json
import time

import xinsitu

VARS = ["t2m", "u10", "v10", "z500"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per batch: the model")
    p.add_argument("--cache", action="store_true")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-batches", type=int, default=0, help="per epoch (0: all)")
    a = p.parse_args()
    ds = xinsitu.open_zarr(a.data)[VARS]
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1})
    kw = dict(batch_size=a.batch_size, shuffle=True, seed=0, output="numpy", stack=True)
    if a.cache:
        kw["cache"] = True
    gen = ds.insitu.batches(m, "train", **kw)
    rows = []
    for e in range(a.epochs):
        gen.set_epoch(e)
        t0 = time.perf_counter()
        c0 = time.process_time()
        first = None
        n = waits = 0
        t_prev = t0
        work = 0.0
        for n, _b in enumerate(gen, 1):
            now = time.perf_counter()
            waits += now - t_prev
            if first is None:
                first = now - t0
            if a.sleep:
                time.sleep(a.sleep)
                work += a.sleep
            t_prev = time.perf_counter()
            if a.max_batches and n >= a.max_batches:
                break
        total = time.perf_counter() - t0
        cpu = time.process_time() - c0
        st = gen.io_stats
        rows.append(dict(epoch=e, batches=n, first_batch_wait_s=round(first or 0.0, 4),
                         wait_s=round(waits, 3), total_s=round(total, 3),
                         samples_per_s=round(n * a.batch_size / total, 1),
                         io_wait_s=round(st.get("wait_s", 0.0), 3), hits=st.get("cache_hits"),
                         cpu_us_per_chunk=round(1e6 * (cpu - work * 0) / max(st.get("chunks", 0), 1), 1)))
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
