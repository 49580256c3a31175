#!/usr/bin/env python
"""Soak: many epochs over HTTP through a server with latency (and, optionally, faults);
memory stays flat and connections and threads stay bounded.

    python bench/soak.py                       # 20 epochs, 5 ms latency, a synthetic archive
    python bench/soak.py --epochs 60 --faults 0.03 --max-inflight 16

The file server (``tests/support/servers.py``) runs in a child process on 127.0.0.1, so every
thread and socket this process holds is the reader's. After each epoch it records RSS
(after ``gc.collect()``), and, sampled every 20 ms during the epoch, the most Python
threads, OS threads and TCP connections to the server this process had. Every epoch must yield each
sample of the split once. The verdict (exit status 1 when it fails):

* RSS flat: after ``--warmup`` epochs, the least-squares slope of RSS per epoch is under
  ``--max-slope-mb`` and mean RSS of the last third of the epochs is within
  ``--max-growth-mb`` of the first third's. RSS is read after ``malloc_trim(0)``, i.e. live
  memory rather than freed blocks the allocator keeps (printed too, "untrimmed"). glibc's
  mmap threshold is pinned by default (``--malloc``; see ``pin_mmap_threshold``): left
  dynamic, RSS climbs for 10-20 epochs (allocator fragmentation) before it levels off;
* connections bounded: never more than ``2 x max_inflight + 16``, and no more in the last
  third of the epochs than in the first third after the warm-up (plus 2). Requests in
  flight are bounded by ``max_inflight`` (the server never sees more:
  ``tests/stores/test_remote.py`` checks it); the client's pool may open a connection for a
  request while another is on its way back to the pool, and keeps the ones zarr opened
  for metadata;
* threads bounded: xinsitu's own (Python) threads are no more after the warm-up than
  during it; all OS threads stay under Python threads + cores + 512 + 8, tokio's bounds
  for obstore's runtime (its workers, and a blocking pool whose idle threads exit after
  10 s). That pool grows with how long finished requests wait for the GIL, so under heavy
  decoding or a loaded machine it holds more threads than ``max_inflight`` (obstore
  alone, with two GIL-bound Python threads beside it, goes from 34 to 47 threads).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
TOKIO_MAX_BLOCKING = 512  # tokio's default cap on its blocking pool (obstore's runtime)
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore", message=".*[Cc]onsolidated metadata.*")

import xinsitu  # noqa: E402
from xinsitu.synthetic import write_era5_like  # noqa: E402


class Sampler:
    """Most threads and TCP connections to ``port`` this process holds, sampled every ``every`` s."""

    def __init__(self, port: int, every: float = 0.02):
        self.proc, self.port, self.every = psutil.Process(), port, every
        self.stop = threading.Event()
        self.threads = self.py_threads = self.conns = 0
        self._t = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def conns_now(self) -> int:
        return sum(1 for c in self.proc.net_connections(kind="tcp") if c.raddr and c.raddr.port == self.port)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.threads = max(self.threads, self.proc.num_threads() - 1)  # not counting this sampler
            self.py_threads = max(self.py_threads, threading.active_count() - 1)
            self.conns = max(self.conns, self.conns_now())
            self.stop.wait(self.every)

    def __enter__(self) -> Sampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._t.join(timeout=5)


def start_server(root: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "tests.support.servers", str(root), "--latency", str(args.latency),
           "--lifetime", str(args.lifetime)]
    if args.faults:
        cmd += ["--error-503", str(args.faults), "--reset", str(args.faults), "--truncate", str(args.faults)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    url = proc.stdout.readline().strip() if proc.stdout else ""
    if not url.startswith("http://127.0.0.1:"):
        proc.kill()
        raise RuntimeError(f"the file server did not start (said {url!r})")
    return proc, url


def thread_names() -> dict[str, int]:
    """This process's OS threads, counted by name (Linux: /proc/self/task/*/comm)."""
    out: dict[str, int] = {}
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            name = comm.read_text().strip().rstrip("0123456789-_")
        except OSError:
            continue
        out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


def pin_mmap_threshold(nbytes: int = 128 * 1024) -> bool:
    """Fix glibc's mmap threshold (``mallopt(M_MMAP_THRESHOLD)``), turning off its dynamic rise.

    By default glibc raises the threshold each time a large block that it had mmap'd is
    freed, so later chunk-sized temporaries come from the heap arenas instead, whose
    fragmentation makes RSS climb for the first 10-20 epochs before it levels off. Pinned,
    RSS is flat from the first epoch and a leak stands out at once.
    """
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, nbytes))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def trim() -> None:
    """Give freed heap pages back to the OS (glibc), so RSS shows live memory, not the allocator's
    cache of freed blocks (which the decode threads' arenas fill and empty from epoch to epoch)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def slope(y: list[float]) -> float:
    if len(y) < 2:
        return 0.0
    x = np.arange(len(y), dtype=float)
    return float(np.polyfit(x, np.asarray(y, dtype=float), 1)[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5, help="epochs before memory is expected to be flat")
    ap.add_argument("--latency", type=float, default=0.005, help="seconds added to every request")
    ap.add_argument("--faults", type=float, default=0.0, help="share of requests meeting each of 503/reset/truncate")
    ap.add_argument("--nt", type=int, default=1460)
    ap.add_argument("--ny", type=int, default=32)
    ap.add_argument("--nx", type=int, default=64)
    ap.add_argument("--chunk-time", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--block-chunks", type=int, default=16)
    ap.add_argument("--max-inflight", type=int, default=32)
    ap.add_argument("--max-slope-mb", type=float, default=0.5, help="allowed RSS slope after warm-up, MB/epoch")
    ap.add_argument("--max-growth-mb", type=float, default=8.0,
                    help="allowed rise of mean RSS from the first to the last third after warm-up, MB")
    ap.add_argument("--lifetime", type=float, default=1800.0, help="the server stops itself after this")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line at the end")
    ap.add_argument("--verbose", action="store_true", help="print the threads by name after each epoch")
    ap.add_argument("--malloc", choices=["pinned", "default"], default="pinned",
                    help="pinned: fix glibc's mmap threshold (RSS flat from the start); default: leave glibc "
                         "as it is (RSS climbs for 10-20 epochs, then levels off: use --epochs 60 --warmup 20)")
    args = ap.parse_args(argv)
    if args.epochs <= args.warmup:
        ap.error("--epochs must be larger than --warmup")
    if args.malloc == "pinned" and not pin_mmap_threshold():
        print("soak: could not pin the mmap threshold (not glibc?): RSS may climb for a while before it levels off")

    with tempfile.TemporaryDirectory(prefix="xinsitu-soak-") as tmp:
        root = Path(tmp)
        write_era5_like(root / "era5.zarr", nt=args.nt, ny=args.ny, nx=args.nx, chunk_time=args.chunk_time)
        server, url = start_server(root, args)
        port = int(url.rsplit(":", 1)[1])
        try:
            return soak(f"{url}/era5.zarr", port, args)
        finally:
            if server.stdin:
                server.stdin.close()  # the server stops when its stdin closes
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.kill()


def soak(url: str, port: int, args: argparse.Namespace) -> int:
    proc = psutil.Process()
    ds = xinsitu.open_zarr(url)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1}, gap=1)
    gen = ds.insitu.batches(m, "train", batch_size=args.batch_size, block_chunks=args.block_chunks,
                            max_inflight=args.max_inflight, output="numpy", seed=0)
    expected = sum(len(b) for b in gen.batch_ids())
    rows = []
    print(f"soak: {args.epochs} epochs of {len(gen)} batches ({expected} samples) from {url}, "
          f"latency {args.latency * 1e3:.0f} ms, faults {args.faults:.0%} each of 503/reset/truncate, "
          f"max_inflight {args.max_inflight}, glibc malloc {args.malloc}")
    print(f"{'epoch':>5} {'seconds':>8} {'MB/s':>7} {'RSS MB':>8} {'(untrimmed)':>11} {'py thr':>7} {'OS thr':>7} "
          f"{'conns':>6} {'requests':>9}")
    for e in range(args.epochs):
        gen.set_epoch(e)
        t0 = time.perf_counter()
        n = 0
        with Sampler(port) as s:
            for batch in gen:
                n += len(batch["t2m"])
        dt = time.perf_counter() - t0
        if n != expected:
            print(f"epoch {e}: {n} samples, expected {expected}")
            return 1
        gc.collect()
        rss_raw = proc.memory_info().rss / 2**20
        trim()
        io = gen.io_stats
        row = {"epoch": e, "seconds": dt, "rss_raw_mb": rss_raw, "rss_mb": proc.memory_info().rss / 2**20,
               "threads": s.threads, "py_threads": s.py_threads,
               "conns": s.conns, "conns_after": Sampler(port).conns_now(), "requests": io.get("requests", 0),
               "mb_per_s": io.get("mb_per_s", 0.0)}
        rows.append(row)
        if args.verbose:
            print("       threads by name:", thread_names())
        print(f"{e:>5} {dt:>8.2f} {row['mb_per_s']:>7.1f} {row['rss_mb']:>8.1f} {rss_raw:>11.1f} {s.py_threads:>7} "
              f"{s.threads:>7} {s.conns:>6} {row['requests']:>9}")

    warm, rest = rows[: args.warmup], rows[args.warmup:]
    third = max(1, len(rest) // 3)
    rss = [r["rss_mb"] for r in rest]
    rss_slope = slope(rss)
    rss_rise = float(np.mean(rss[-third:]) - np.mean(rss[:third]))
    conn_cap = 2 * args.max_inflight + 16

    def most(key: str, rs: list[dict]) -> int:
        return max(r[key] for r in rs)

    most_py = most("py_threads", rows)
    thread_cap = most_py + (os.cpu_count() or 1) + TOKIO_MAX_BLOCKING + 8
    checks = {
        f"RSS slope after warm-up {rss_slope:+.2f} MB/epoch < {args.max_slope_mb}": rss_slope < args.max_slope_mb,
        f"RSS, last third vs first third after warm-up {rss_rise:+.1f} MB < {args.max_growth_mb}":
            rss_rise < args.max_growth_mb,
        f"connections (most {most('conns', rows)}) <= 2 x max_inflight + 16 = {conn_cap}":
            most("conns", rows) <= conn_cap,
        "connections in the last third <= first third after warm-up + 2":
            most("conns", rest[-third:]) <= most("conns", rest[:third]) + 2,
        f"Python threads after warm-up (most {most('py_threads', rest)}) <= during it ({most('py_threads', warm)})":
            most("py_threads", rest) <= most("py_threads", warm),
        f"OS threads (most {most('threads', rows)}) <= Python threads + cores + tokio's blocking pool "
        f"({TOKIO_MAX_BLOCKING}) + 8 = {thread_cap}": most("threads", rows) <= thread_cap,
    }
    for text, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {text}")
    ok = all(checks.values())
    if args.json:
        print(json.dumps({"ok": ok, "rows": rows, "checks": checks, "args": vars(args)}))
    print("soak:", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
