#!/usr/bin/env python
"""Profile xinsitu's hot path: CPU time per thread, and py-spy for where it goes inside each thread.

    python bench/profile_hot.py ARCHIVE [--batch-sizes 8,32,128] [--epochs 12] [--out DIR]

Each run is ``py-spy record -f raw -t`` of a process that iterates shuffled epochs of
``ds.insitu.batches(m, "train", output="numpy", stack=True)`` after one warm-up epoch. The
process reads its threads' own CPU clocks around the measured epochs (exact, and unmoved by
other work on the machine): CPU microseconds per sample, per thread. Comparing batch sizes
separates what is paid per sample from what is paid per batch:
``cpu/sample = per_sample + per_batch / batch_size``. py-spy then says where each thread's
busy samples go (top leaf frames and deepest xinsitu lines): only the ``xinsitu-*`` threads
and the caller's thread inside the batch iterator count, and a thread parked in a lock, a
queue or ``select`` is idle. On a loaded machine py-spy also counts runnable-but-waiting
threads as busy: read its shares, not its totals.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

RATE = 500  # py-spy samples per second
IDLE = (
    "Condition.wait",
    "EpollSelector.select",
    "Event.wait",
    "Queue.get",
    "_worker (concurrent/futures/thread.py",
    "Thread._wait_for_tstate_lock",
    "_EpochRun._put (",
)
HOT_MAIN = "_EpochRun.__iter__"


_ENDED: dict[str, float] = collections.defaultdict(float)


def _count_ended_threads() -> None:
    """Make every Python thread add its CPU time to ``_ENDED`` when it ends (the prefetch
    thread lives for one epoch: it is gone before anyone can read its clock from outside)."""
    import threading

    run = threading.Thread.run

    def counted(self: threading.Thread) -> None:
        try:
            run(self)
        finally:
            _ENDED[re.sub(r"_\d+$", "", self.name)] += time.thread_time()

    threading.Thread.run = counted  # type: ignore[method-assign]


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process, by thread name (pool threads summed; threads
    Python does not know, e.g. obstore's Rust runtime, under "native")."""
    import threading

    import psutil

    names = {t.native_id: re.sub(r"_\d+$", "", t.name) for t in threading.enumerate()}
    out: dict[str, float] = collections.defaultdict(float)
    for t in psutil.Process().threads():
        if t.id in names:
            out[names[t.id]] += t.user_time + t.system_time
    for k, v in _ENDED.items():
        out[k] += v
    return dict(out)


def target(archive: str, batch_size: int, epochs: int) -> None:
    """The profiled process: shuffled epochs, as a user runs them; CPU time per thread."""
    import warnings

    warnings.filterwarnings("ignore")
    _count_ended_threads()
    import xinsitu

    ds = xinsitu.open_zarr(archive)[["t2m", "u10", "v10", "z500"]]
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1})
    gen = ds.insitu.batches(m, "train", batch_size=batch_size, output="numpy", stack=True)
    gen.set_epoch(0)
    for _ in gen:  # warm-up epoch: threads, pools and connections exist from here on
        pass
    n, nb = 0, 0
    before, total0 = thread_cpu(), time.process_time()
    t0 = time.perf_counter()
    for e in range(1, epochs + 1):
        gen.set_epoch(e)
        for b in gen:
            n += b.shape[0]
            nb += 1
    dt = time.perf_counter() - t0
    after, total = thread_cpu(), time.process_time() - total0
    cpu = {k: v - before.get(k, 0.0) for k, v in after.items()}
    cpu = {k: v for k, v in cpu.items() if abs(v) > 1e-3}
    cpu["native"] = total - sum(cpu.values())  # threads Python did not start: obstore's runtime
    res = {
        "samples": n,
        "batches": nb,
        "seconds": dt,
        "chunks": gen.io_stats.get("chunks", 0) * epochs,
        "thread_cpu_s": cpu,
    }
    print("RESULT " + json.dumps(res), flush=True)


def _thread(frame0: str) -> str:
    """py-spy's ``thread (0x7f..): name`` (or ``thread (123): name``) -> name, numbers dropped."""
    name = frame0.split(":", 1)[1].strip() if ":" in frame0 else frame0
    return re.sub(r"_\d+$", "", name) or "?"


def aggregate(raw_path: str) -> dict[str, Any]:
    """Busy samples per thread; top leaf frames and deepest xinsitu lines per thread."""
    busy: collections.Counter = collections.Counter()
    leaf: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    line: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    total = 0
    with open(raw_path) as f:
        for row in f:
            row = row.rstrip()
            if not row:
                continue
            stack, _, n_s = row.rpartition(" ")
            n = int(n_s)
            frames = stack.split(";")
            total += n
            th = _thread(frames[0])
            if th == "MainThread" and not any(HOT_MAIN in fr for fr in frames):
                continue  # imports, opening, set-up: not the hot path
            if not (th.startswith("xinsitu") or th == "MainThread"):
                continue  # other libraries' idle helper threads (zarr's loop, ...)
            top = frames[-1]
            if any(top.startswith(p) or p in top for p in IDLE):
                continue
            busy[th] += n
            leaf[th][_short(top)] += n
            ours = [fr for fr in frames if "xinsitu/" in fr]
            line[th][_short(ours[-1]) if ours else "(outside xinsitu)"] += n
    return {
        "total_samples": total,
        "busy": dict(busy),
        "leaf": {t: c.most_common(8) for t, c in leaf.items()},
        "xinsitu_line": {t: c.most_common(8) for t, c in line.items()},
    }


def _short(frame: str) -> str:
    return frame.replace("site-packages/", "")


def profile_one(archive: str, batch_size: int, epochs: int, raw_path: str) -> dict[str, Any] | None:
    cmd = [
        "py-spy",
        "record",
        "--nonblocking",
        "-r",
        str(RATE),
        "-f",
        "raw",
        "-t",
        "-o",
        raw_path,
        "--",
        sys.executable,
        os.path.abspath(__file__),
        "--target",
        archive,
        str(batch_size),
        str(epochs),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True)
    res = next((json.loads(ln[7:]) for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if res is None or not os.path.exists(raw_path):
        return None
    res.update(batch_size=batch_size, archive=os.path.basename(archive), **aggregate(raw_path))
    return res


def profile(
    archive: str, out_dir: str, batch_sizes: list[int], epochs: int, extra: list[tuple[str, int, int]] | None = None
) -> dict[str, Any] | None:
    """Profile each batch size (and each ``(archive, batch_size, epochs)`` of ``extra``); the report."""
    os.makedirs(out_dir, exist_ok=True)
    runs = []
    jobs = [(archive, bs, epochs) for bs in batch_sizes] + list(extra or [])
    for arch, bs, ep in jobs:
        raw = os.path.join(out_dir, f"pyspy_{os.path.basename(arch).replace('.zarr', '')}_bs{bs}.txt")
        r = profile_one(arch, bs, ep, raw)
        if r is None:
            return None
        runs.append(r)
    return {"runs": runs, "text": render(runs)}


def render(runs: list[dict[str, Any]]) -> str:
    threads = sorted({t for r in runs for t in r["thread_cpu_s"]}, key=lambda t: (t == "native", t))
    out = [
        "CPU µs per sample, by thread (each thread's own CPU clock, after a warm-up epoch;"
        " native = obstore's runtime threads):"
    ]
    out.append(
        f"  {'archive':30s} {'batch':>5s} {'samples/s':>9s} "
        + " ".join(f"{t[:16]:>16s}" for t in threads)
        + f" {'total':>8s}"
    )
    for r in runs:
        us = {t: 1e6 * v / r["samples"] for t, v in r["thread_cpu_s"].items()}
        out.append(
            f"  {r['archive'][:30]:30s} {r['batch_size']:5d} {r['samples'] / r['seconds']:9.0f} "
            + " ".join(f"{us.get(t, 0.0):16.1f}" for t in threads)
            + f" {sum(us.values()):8.1f}"
        )
    same = [r for r in runs if r["archive"] == runs[0]["archive"]]
    if len(same) >= 2:  # least squares of cost = a + b / batch_size over the batch sizes
        import numpy as np

        x = np.array([1.0 / r["batch_size"] for r in same])
        out.append("  fit: CPU per sample = per_sample + per_batch / batch_size")
        for t in threads:
            y = np.array([1e6 * r["thread_cpu_s"].get(t, 0.0) / r["samples"] for r in same])
            b, a = np.polyfit(x, y, 1)
            out.append(f"    {t:24s} per sample {a:8.1f} µs   per batch {b:9.1f} µs")
    main = next((r for r in runs if r["batch_size"] == 32), runs[0])
    out.append(
        f"\ntop frames, {main['archive']} batch {main['batch_size']} (py-spy {RATE} Hz; share of the thread's "
        "busy samples)"
    )
    for t in threads:
        n = main["busy"].get(t, 0)
        if not n:
            continue
        out.append(f"  [{t}] {n} busy samples")
        for fr, k in main["leaf"].get(t, [])[:6]:
            out.append(f"     leaf {100 * k / n:5.1f} %  {fr}")
        for fr, k in main["xinsitu_line"].get(t, [])[:6]:
            out.append(f"     line {100 * k / n:5.1f} %  {fr}")
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--target":
        target(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        sys.exit(0)
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("archive")
    ap.add_argument("--batch-sizes", default="8,32,128")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="xinsitu-profile-"))
    a = ap.parse_args()
    res = profile(a.archive, a.out, [int(b) for b in a.batch_sizes.split(",")], a.epochs)
    print(res["text"] if res else "py-spy failed (is it installed, and is ptrace allowed?)")
    print(f"raw stacks in {a.out}")
