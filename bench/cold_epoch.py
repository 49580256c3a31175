#!/usr/bin/env python
"""A cold epoch against a second one, in fresh processes: samples/s, page faults and CPU.

    python bench/cold_epoch.py ARCHIVE [--runs 5] [--batch-size 32]

Each run is a new process that iterates two shuffled epochs of
``ds.insitu.batches(m, "train", output="numpy", stack=True)`` (no cache: the second epoch reads and
decodes everything again) and reports, per epoch: steady samples/s (after the first two batches, as
the yardstick counts), minor page faults, and user and system CPU seconds of the process. What the
first epoch pays beyond the second is fresh memory: a page fault, and a page zeroed by the kernel, for
each page touched the first time (buffers, batches, read buffers). Prints one JSON line per run, then
the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time, warnings
warnings.filterwarnings("ignore")
import xinsitu
path, bs = sys.argv[1], int(sys.argv[2])
ds = xinsitu.open_zarr(path)
m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1})
gen = ds.insitu.batches(m, "train", batch_size=bs, output="numpy", stack=True, seed=0)
out = {}
for epoch in range(2):
    gen.set_epoch(epoch)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    ts, n = [], 0
    for b in gen:
        ts.append(time.perf_counter())
        n += len(b)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    steady = (n - 2 * bs) / (ts[-1] - ts[1]) if len(ts) > 3 else float("nan")
    out[f"epoch{epoch}"] = {"samples_per_s": round(steady), "minor_faults": r1.ru_minflt - r0.ru_minflt,
                            "user_s": round(r1.ru_utime - r0.ru_utime, 3), "sys_s": round(r1.ru_stime - r0.ru_stime, 3)}
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("archive")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32)
    a = ap.parse_args()
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    runs = []
    for _ in range(a.runs):
        line = subprocess.run([sys.executable, "-c", CHILD, a.archive, str(a.batch_size)], env=env, check=True,
                              capture_output=True, text=True, timeout=600).stdout.strip().splitlines()[-1]
        print(line, flush=True)
        runs.append(json.loads(line))
    med = {e: {k: statistics.median(r[e][k] for r in runs) for k in runs[0][e]} for e in runs[0]}
    print(json.dumps({"median_of": len(runs), **med}))


if __name__ == "__main__":
    main()
