"""Epoch time on an overloaded HTTP store: ``max_inflight=None`` (automatic) against fixed limits.

The server is ``tests.support.servers.FileServer(overloaded=True)``: a plain ``http.server`` (one
request at a time, HTTP/1.0) with an accept backlog of 5, so a burst of new connections beyond
it waits for the client's SYN retransmit.
A fixed small limit never bursts; the automatic one must back off instead of reading the
queueing as distance. A far, healthy store (``--latency``) shows it still climbs to the top.

    python bench/overload_inflight.py [--limits auto,4,64] [--latency 0] [--epochs 2]

Prints one line per limit: seconds per epoch, requests in flight at the end and at most.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import xinsitu  # noqa: E402
from tests.support.servers import Faults, FileServer, write_archive  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limits", default="auto,4,64")
    ap.add_argument("--latency", type=float, default=0.0, help="seconds added to every request")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--nt", type=int, default=384)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_archive(Path(tmp) / "era5.zarr", nt=a.nt, ny=8, nx=16, chunk_time=4)
        with FileServer(tmp, Faults(latency=a.latency), overloaded=a.latency == 0, max_lifetime_s=1200) as srv:
            m = xinsitu.open_zarr(path).insitu.split("time", fractions={"train": 1.0})
            for spec in a.limits.split(","):
                limit = None if spec == "auto" else int(spec)
                ds = xinsitu.open_zarr(f"{srv.url}/era5.zarr")
                gen = ds.insitu.batches(m, "train", batch_size=16, block_chunks=8, output="numpy",
                                        max_inflight=limit)
                times, tops = [], []
                for e in range(a.epochs):
                    gen.set_epoch(e)
                    srv.reset_counts()
                    t = time.perf_counter()
                    n = sum(len(next(iter(b.values()))) for b in gen)
                    times.append(time.perf_counter() - t)
                    tops.append(srv.peak)
                    assert n == m.positions("train"), n
                lim = gen._reader.inflight
                top = max([lim.limit] + [n for n, _ in getattr(lim, "history", [])])
                print(f"max_inflight={spec:>4}: epochs {', '.join(f'{x:.2f}' for x in times)} s; "
                      f"limit at the end {lim.limit} (highest {top}), "
                      f"peak in flight at the server {max(tops)}", flush=True)


if __name__ == "__main__":
    main()
