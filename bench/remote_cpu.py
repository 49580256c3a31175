#!/usr/bin/env python
"""Where the CPU of a shuffled epoch over HTTP goes, per chunk and per thread, in fresh processes.

    python bench/remote_cpu.py ARCHIVE [--latency-ms 20] [--runs 3] [--batch-size 32]

Serves the archive's folder with the yardstick's latency server (``../shared/bench/latency_server.py``
where it exists, else ``bench/latency_server.py``), then in a new process per run iterates one shuffled
epoch of ``ds.insitu.batches(m, "train", output="numpy", stack=True)`` and reports: samples/s over the
whole epoch, and µs of CPU per chunk of each of the process's threads, by name -- ``xinsitu-io`` (the
I/O loop), ``xinsitu-decode`` (the decode threads), ``native`` (threads Python did not start: obstore's
runtime), ``MainThread``; the epoch's batch-gathering thread has ended by then and counts only in
``process_us``, the whole process's -- and of the server process. Chunks = samples x variables (the bench archives
of ``--chunk-time 1`` hold one sample per chunk). One JSON line per run, then the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import collections, json, re, sys, threading, time, warnings
warnings.filterwarnings("ignore")
import psutil
import xinsitu
url, bs, server_pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
server = psutil.Process(server_pid)

def threads():
    names = {t.native_id: re.sub(r"[-_]\d+$", "", t.name) for t in threading.enumerate()}
    out = collections.defaultdict(float)
    for t in psutil.Process().threads():
        out[names.get(t.id, "native")] += t.user_time + t.system_time
    return out

def server_cpu():
    t = server.cpu_times()
    return t.user + t.system

def process_cpu():  # (threads that ended count here, not in threads())
    t = psutil.Process().cpu_times()
    return t.user + t.system

ds = xinsitu.open_zarr(url)
m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1})
gen = ds.insitu.batches(m, "train", batch_size=bs, output="numpy", stack=True, seed=0)
before, srv0, cpu0, t0, n = threads(), server_cpu(), process_cpu(), time.perf_counter(), 0
for b in gen:
    n += len(b)
dt = time.perf_counter() - t0
after, srv1, cpu1 = threads(), server_cpu(), process_cpu()
chunks = n * len(ds.data_vars)
out = {"samples_per_s": n / dt, "chunks": chunks, "process_us": (cpu1 - cpu0) / chunks * 1e6,
       "server_us": (srv1 - srv0) / chunks * 1e6}
for k in after:
    used = after[k] - before.get(k, 0.0)
    if used > 0.005:
        out[k + "_us"] = used / chunks * 1e6
print("RESULT " + json.dumps(out), flush=True)
"""


def _server_script() -> str:
    shared = os.path.join(HERE, "..", "..", "shared", "bench", "latency_server.py")
    return shared if os.path.exists(shared) else os.path.join(HERE, "latency_server.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archive")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    a = ap.parse_args()
    path = os.path.abspath(a.archive)
    srv = subprocess.Popen([sys.executable, _server_script(), os.path.dirname(path), "--port", "0",
                            "--latency-ms", str(a.latency_ms)], stdout=subprocess.PIPE, text=True)
    try:
        line = srv.stdout.readline() if srv.stdout else ""
        if not line.startswith("LISTENING"):
            raise SystemExit(f"the latency server did not start: {line!r}")
        url = line.split()[1].rstrip("/") + "/" + os.path.basename(path)
        rows = []
        for _ in range(a.runs):
            p = subprocess.run([sys.executable, "-c", CHILD, url, str(a.batch_size), str(srv.pid)],
                               capture_output=True, text=True, timeout=900)
            got = [ln[7:] for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if not got:
                raise SystemExit(p.stderr[-2000:])
            rows.append(json.loads(got[0]))
            print(json.dumps({k: round(v, 1) for k, v in rows[-1].items()}), flush=True)
    finally:
        srv.terminate()
        srv.wait(10)
    keys = sorted({k for r in rows for k in r})
    print("medians:", json.dumps({k: round(statistics.median(r.get(k, 0.0) for r in rows), 1) for k in keys}))


if __name__ == "__main__":
    main()
