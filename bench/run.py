#!/usr/bin/env python
"""xinsitu throughput and memory benchmark (GitHub issue 3).

    bash dev.sh bench               # everything: about 12 minutes on 2 cores
    bash dev.sh bench --quick       # a smaller run: about 1 minute (under 3 with archives to write)
    python bench/run.py --sections peers --stores local,http:100 --repeats 5
    python bench/run.py --replot --docs   # tables and plots again, from --out/results.jsonl

The task of every peer: one epoch over the train split (80 % of the time steps, whole
chunks) of a synthetic ERA5-like archive (1460 x 64 x 128, four float32 variables, zstd,
chunks of 24 time steps), batch_size 32, one sample = one time step of the four variables,
delivered as a (32, 4, 64, 128) float32 array (xbatcher: (32, 4, 1, 64, 128)).

Sections (``--sections``):

peers     side by side in one run, each in a fresh subprocess, peak RSS of the process tree
          sampled by this one: the read+decode ceiling, xinsitu shuffled and unshuffled,
          xbatcher + DataLoader (0 workers), a map-style ``ds.isel(time=i)`` DataLoader (0
          and 2 workers), on a local archive and the same archive over HTTP with 20 / 100 ms
          per request (``latency_server.py``, read through obstore's HTTPStore); then the
          ceiling and xinsitu again on an archive 8x as long (the start-up amortised).
wait      "sleep as the model": how long the training loop waits for each batch when the
          model step is slower (and faster) than the read.
memory    peak RSS above the RSS just before the first batch, against
          (block_chunks + max_inflight) x decoded chunk size x 1.5, on archives 1x, 4x and 8x
          longer in time.
scaling   whole-epoch rate / ceiling vs max_inflight, block_chunks and decode threads
          (XINSITU_DECODE_THREADS) on a 4x archive, and vs chunk size (1, 8, 24, 96 steps);
          each sweep in one process with its ceiling, round by round.
profile   CPU time per thread and py-spy attribution of the hot path (``profile_hot.py``).

Rates: "whole epoch" counts the epoch from ``iter()`` to the last batch, first batch
included (what a training loop gets); "after 2 batches" leaves the first ``warmup``
batches out, as the shared yardstick does. Each process runs ``--epochs`` epochs, the first
a warm-up, and reports the median of the others. Ratios are taken between runs of the same
repeat on the same store: this machine is shared and noisy, compare ratios.
Results: ``--out`` (JSON lines, summary.md, bench_*.png). No timed assertion anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import archives as bench_data  # noqa: E402
import harness  # noqa: E402

VARS = bench_data.VARS
NT, NY, NX, CT = 1460, 64, 128, 24  # the archive of the issue (--shape changes it, for smoke tests)
SAMPLE_BYTES = len(VARS) * NY * NX * 4
FAST_PEERS = ["ceiling", "xinsitu", "xinsitu_ordered"]
SLOW_PEERS = ["xbatcher0", "isel0", "isel2"]
ALL_SECTIONS = ["peers", "wait", "memory", "scaling", "profile"]
DEFAULT_INFLIGHT = 256  # the ceiling's requests in flight: the top of xinsitu's automatic max_inflight


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- split of an archive
def train_split(path: str) -> tuple[list[int], int]:
    """(chunk indices, time steps) of the train split xinsitu makes (same call as the peers)."""
    import warnings

    import xinsitu

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = xinsitu.open_zarr(path)[VARS]
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1})
    chunks = [int(c) for c in m.splits["train"]]
    edges = list(m.edges["time"])
    return chunks, int(sum(edges[c + 1] - edges[c] for c in chunks))


def default_decode_threads() -> int:
    from xinsitu.io import loop as _loop

    return _loop.decode_threads()


# ----------------------------------------------------------------------------- peers
def peer_config(peer: str, url: str, split: tuple[list[int], int], a: argparse.Namespace) -> dict[str, Any]:
    chunks, steps = split
    base = {"url": url, "train_steps": steps}
    if peer == "ceiling":
        return {
            **base,
            "task": "ceiling",
            "train_chunks": chunks,
            "inflight": a.inflight,
            "decode_threads": a.decode_threads,
            "passes": a.epochs,
        }
    if peer == "xinsitu":
        return {**base, "task": "xinsitu", "epochs": a.epochs, "warmup": a.warmup}
    if peer == "xinsitu_ordered":
        return {**base, "task": "xinsitu", "epochs": a.epochs, "warmup": a.warmup, "kwargs": {"shuffle": False}}
    slow = {"max_seconds": a.max_seconds, "warmup": 1, "min_batches": 2}
    if peer.startswith("xbatcher"):
        return {**base, **slow, "task": "xbatcher", "workers": int(peer[-1])}
    if peer.startswith("isel"):
        return {**base, **slow, "task": "isel", "workers": int(peer[-1])}
    raise SystemExit(f"unknown peer {peer!r}")


def section_peers(
    a: argparse.Namespace,
    stores: harness.Stores,
    archive: str,
    out: Results,
    length: int = 1,
    peers: list[str] | None = None,
    repeats: int | None = None,
) -> list[dict]:
    split = train_split(archive)
    peers = peers or a.peers
    repeats = repeats or a.repeats
    log(
        f"\n== peers, {length}x archive: train split of {len(split[0])} chunks, {split[1]} samples; "
        f"{repeats} repeat(s) of {[p for p in peers if p not in SLOW_PEERS]}, "
        f"{a.slow_repeats} of {[p for p in peers if p in SLOW_PEERS]}"
    )
    rows = []
    for store in a.stores:
        srv = stores.servers.get(store)
        url = stores.url(store, archive)
        for rep in range(max(repeats, a.slow_repeats)):
            slow_here = rep < a.slow_repeats and not (a.quick and store != "local")  # quick: slow peers local only
            todo = [p for p in peers if (p in SLOW_PEERS and slow_here) or (p not in SLOW_PEERS and rep < repeats)]
            fast = [p for p in todo if p not in SLOW_PEERS]
            if rep % 2:  # alternate who goes first: slow drifts of a shared machine cancel out
                fast = fast[::-1]
            for peer in fast + [p for p in todo if p in SLOW_PEERS]:
                cfg = peer_config(peer, url, split, a)
                if length > 1:
                    cfg["epochs"] = cfg["passes"] = 2
                timeout = 600 if peer in SLOW_PEERS else 300
                r = harness.run_child(cfg, timeout, server=srv)
                r.update(section="peers", peer=peer, store=store, repeat=rep, length=length)
                r["mb_per_s"] = r.get("samples_per_s", 0.0) * SAMPLE_BYTES / 1e6
                out.add(r)
                rows.append(r)
                log(fmt_peer_row(r))
    return rows


def fmt_peer_row(r: dict) -> str:
    if r.get("error"):
        return f"  {r['store']:8s} {r['peer']:16s} FAILED: {r['error']}"
    extra = ""
    if r.get("server_requests") is not None and r.get("samples"):
        extra = f"  requests {r['server_requests']}"
    ep = r.get("epoch_sps")
    return (
        f"  {r['store']:8s} {r['peer']:16s} {r['samples_per_s']:8.1f} samples/s {r['mb_per_s']:7.1f} MB/s"
        f"  epoch {ep if ep is not None else float('nan'):8.1f}/s  first batch {r.get('first_batch_s') or 0:5.2f} s"
        f"  peak RSS {r['peak_rss_mb']:6.0f} MB{extra}"
    )


# ----------------------------------------------------------------------------- wait
def section_wait(a: argparse.Namespace, stores: harness.Stores, archive: str, out: Results) -> list[dict]:
    log("\n== wait: model step (sleep) = factor x the read time of one batch")
    rows = []
    for store in a.stores:
        cfg = {"task": "wait", "url": stores.url(store, archive), "factors": [0.5, 2.0]}
        r = harness.run_child(cfg, 300, server=stores.servers.get(store))
        r.update(section="wait", store=store)
        out.add(r)
        rows.append(r)
        if r.get("error"):
            log(f"  {store:8s} FAILED: {r['error']}")
            continue
        for w in r["runs"]:
            log(
                f"  {store:8s} model step {w['factor']:.1f} x read ({w['step_s'] * 1e3:6.1f} ms): epoch "
                f"{w['seconds']:6.2f} s, waited {w['wait_s']:.3f} s ({100 * w['wait_frac']:.1f} %), "
                f"of which first batch {w['first_wait_s']:.3f} s"
            )
    return rows


# ----------------------------------------------------------------------------- memory
def section_memory(a: argparse.Namespace, stores: harness.Stores, out: Results) -> list[dict]:
    log("\n== memory: peak RSS above the RSS just before the first batch")
    rows = []
    chunk_mb = bench_data.chunk_nbytes(CT, NY, NX) / 1e6
    for mult in a.memory_lengths:
        archive = bench_data.ensure_archive(a.data_dir, NT * mult, NY, NX, CT)
        for store in a.memory_stores:
            for bc, mi in a.memory_settings[mult]:
                kw = {"block_chunks": bc, "max_inflight": mi}
                cfg = {
                    "task": "memory",
                    "url": stores.url(store, archive),
                    "kwargs": kw,
                    "epochs": 2 if mult == 1 else 1,
                }
                r = harness.run_child(cfg, 600, server=stores.servers.get(store))
                r.update(
                    steps=NT * mult,
                    section="memory",
                    store=store,
                    length=mult,
                    block_chunks=bc,
                    max_inflight=mi,
                    chunk_mb=chunk_mb,
                    bound_mb=(bc + mi) * chunk_mb * 1.5,
                    bound_unit_mb=(bc + mi) * chunk_mb * len(VARS) * 1.5,
                )
                r.pop("geometry", None)
                out.add(r)
                rows.append(r)
                if r.get("error"):
                    log(f"  {mult}x {store} {kw} FAILED: {r['error']}")
                    continue
                log(
                    f"  {mult}x ({r['train_chunks']:4d} chunks) {store:8s} block_chunks={bc:3d} max_inflight={mi:3d}: "
                    f"baseline {r['baseline_mb']:5.0f} MB, peak {r['peak_mb']:5.0f} MB, above baseline "
                    f"{r['delta_mb']:5.0f} MB; bound {r['bound_mb']:5.0f} MB (per-variable chunk), "
                    f"{r['bound_unit_mb']:5.0f} MB (chunk of all {len(VARS)} variables)"
                )
    return rows


# ----------------------------------------------------------------------------- scaling
def section_scaling(a: argparse.Namespace, stores: harness.Stores, out: Results) -> list[dict]:
    """Knob sweeps on a longer archive (``a.sweep_length`` x: an epoch holds many shuffle blocks,
    so the rate is the sustained one); chunk-size sweep on 1x archives written with 1, 8, 24, 96
    steps per chunk. Every sweep runs in one process with its ceiling, round by round, the
    variants in a shuffled order per round (``workloads.run_sweep``): ratios within a round."""
    log("\n== scaling (whole-epoch rate / ceiling of the same round; median over rounds)")
    rows = []

    def sweep(
        name: str, store: str, archive: str, values: list[Any], kwargs_of: Any, rounds: int, env: dict | None = None
    ) -> None:
        sp = train_split(archive)
        cfg = {
            "task": "sweep",
            "url": stores.url(store, archive),
            "train_chunks": sp[0],
            "train_steps": sp[1],
            "inflight": a.inflight,
            "decode_threads": a.decode_threads,
            "rounds": rounds,
            "warmup": a.warmup,
            "variants": [{"value": v, "kwargs": kwargs_of(v)} for v in values],
        }
        r = harness.run_child(cfg, 900, env=env, server=stores.servers.get(store))
        if r.get("error"):
            log(f"  {name:14s} {store:8s} FAILED: {r['error']}")
            rows.append({"section": "scaling", "sweep": name, "store": store, "error": r["error"]})
            out.add(rows[-1])
            return
        for p in r["points"]:
            row = {
                "section": "scaling",
                "sweep": name,
                "store": store,
                "peer": "xinsitu",
                "rounds": rounds,
                "ceiling_sps": r["ceiling_sps"],
                "peak_rss_mb": r["peak_rss_mb"],
                **p,
            }
            out.add(row)
            rows.append(row)
            log(
                f"  {name:14s} {str(p['value']):>5s} {store:8s} {p['epoch_sps']:7.0f} samples/s = "
                f"{p['x_ceiling']:.2f} x ceiling ({r['ceiling_sps']:.0f}/s), first batch {p['first_batch_s']:.2f} s, "
                f"shuffle quality {p['shuffle_quality']:.2f}"
            )

    knobs = bench_data.ensure_archive(a.data_dir, NT * a.sweep_length, NY, NX, CT)
    for store in a.scaling_stores:
        rounds = a.sweep_rounds[store]
        sweep("max_inflight", store, knobs, a.sweep_inflight[store], lambda v: {"max_inflight": v}, rounds)
        sweep("block_chunks", store, knobs, a.sweep_blocks[store], lambda v: {"block_chunks": v}, rounds)
    for v in a.sweep_threads:  # the decode pool is sized once per process: one process per value
        sweep(
            "decode_threads",
            "local",
            knobs,
            [v],
            lambda v: {},
            a.sweep_rounds["local"],
            env={"XINSITU_DECODE_THREADS": str(v)},
        )
    for ct in a.sweep_chunks:
        arch = bench_data.ensure_archive(a.data_dir, NT, NY, NX, ct)
        for store in a.scaling_stores:
            sweep("chunk_time", store, arch, [ct], lambda v: {}, 2)
    return rows


# ----------------------------------------------------------------------------- profile
def section_profile(a: argparse.Namespace, archive: str, out: Results) -> dict | None:
    import profile_hot

    if not shutil.which("py-spy"):
        log("\n== profile: skipped (py-spy is not installed)")
        return None
    log("\n== profile: py-spy on the hot path")
    extra = []
    if not a.quick:  # small chunks: what is paid per chunk rather than per sample
        extra.append((bench_data.ensure_archive(a.data_dir, NT, NY, NX, 1), 32, 3))
    res = profile_hot.profile(archive, a.out, a.profile_batch_sizes, a.profile_epochs, extra)
    if res is None:
        log("  py-spy could not attach (ptrace not permitted?): skipped")
        return None
    res["section"] = "profile"
    out.add(res)
    log(res["text"])
    return res


# ----------------------------------------------------------------------------- output
class Results:
    """Rows appended to ``results.jsonl`` as they come (a crash keeps what was measured)."""

    def __init__(self, out_dir: str, meta: dict):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "results.jsonl")
        self.meta = meta
        with open(self.path, "a") as f:
            f.write(json.dumps({"section": "meta", **meta}) + "\n")

    def add(self, row: dict) -> None:
        row = {"run": self.meta["run"], **row}
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=float) + "\n")


def code_version() -> str:
    """The commit the benchmark ran on, ``+dirty`` when the working tree differs from it."""
    import subprocess

    root = os.path.dirname(HERE)
    try:
        rev = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no", "xinsitu"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (rev or "unknown") + ("+dirty" if dirty else "")


def machine() -> dict[str, Any]:
    import psutil

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "decode_threads": default_decode_threads(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller run, under 3 minutes")
    ap.add_argument("--sections", default=None, help=f"comma list of {ALL_SECTIONS} (default: all)")
    ap.add_argument("--stores", default=None, help="comma list: local, http:MS (default local,http:20,http:100)")
    ap.add_argument(
        "--peers", default=",".join(FAST_PEERS + SLOW_PEERS), help=f"comma list of {FAST_PEERS + SLOW_PEERS}"
    )
    ap.add_argument("--repeats", type=int, default=None, help="runs of the ceiling and xinsitu per store (3)")
    ap.add_argument("--slow-repeats", type=int, default=1, help="runs of xbatcher and isel per store")
    ap.add_argument("--epochs", type=int, default=3, help="epochs (ceiling: passes) per run; the first is a warm-up")
    ap.add_argument("--warmup", type=int, default=2, help="batches left out of the steady rate")
    ap.add_argument(
        "--max-seconds", type=float, default=None, help="time budget of a slow peer's run (it still gets 2 batches)"
    )
    ap.add_argument("--inflight", type=int, default=DEFAULT_INFLIGHT, help="ceiling: requests in flight")
    ap.add_argument(
        "--decode-threads", type=int, default=None, help="ceiling: decode threads (default: what xinsitu uses here)"
    )
    ap.add_argument("--data-dir", default=bench_data.DEFAULT_DIR, help="where archives are written (not the repo)")
    ap.add_argument("--shape", default=f"{NT}x{NY}x{NX}", help="time x lat x lon of the archive (chunks of 24 steps)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="results directory")
    ap.add_argument(
        "--no-long",
        dest="long",
        action="store_false",
        help="leave out the ceiling and xinsitu on the 8x longer archive (peers section)",
    )
    ap.add_argument("--docs", action="store_true", help="also copy the plots to docs/img/")
    ap.add_argument("--replot", action="store_true", help="only redraw plots and summary from --out/results.jsonl")
    a = ap.parse_args(argv)
    q = a.quick
    a.sections = (a.sections or ",".join(s for s in ALL_SECTIONS if not (q and s == "profile"))).split(",")
    a.stores = (a.stores or ("local,http:20" if q else "local,http:20,http:100")).split(",")
    a.peers = a.peers.split(",")
    a.repeats = a.repeats or (1 if q else 3)
    a.long = a.long and not q
    a.max_seconds = a.max_seconds or (3.0 if q else 6.0)
    a.decode_threads = a.decode_threads or default_decode_threads()
    a.memory_lengths = [1, 4] if q else [1, 4, 8]
    a.memory_stores = ["local"]
    # default settings on every length; the extremes on the longest archive only
    a.memory_settings = {n: [(16, 64)] for n in a.memory_lengths}
    if not q:
        a.memory_settings[a.memory_lengths[-1]] = [(4, 16), (16, 64), (64, 256)]
    a.scaling_stores = ["local"] if q else ["local", "http:100"]
    a.sweep_length = 1 if q else 4
    a.sweep_rounds = {"local": 2 if q else 3, "http:100": 2}
    a.sweep_inflight = {"local": [8, 64, 256] if q else [4, 16, 64, 256], "http:100": [16, 64, 128, 256]}
    a.sweep_blocks = {"local": [4, 16] if q else [4, 8, 16, 32, 64], "http:100": [4, 16, 64]}
    a.sweep_threads = [] if q else [1, 2, 4]
    a.sweep_chunks = [] if q else [1, 8, 24, 96]
    a.profile_batch_sizes = [8, 32, 128]
    a.profile_epochs = 6
    # servers to start: the stores of the peers and wait sections, and those the others use
    extra = (a.scaling_stores if "scaling" in a.sections else []) + (a.memory_stores if "memory" in a.sections else [])
    a.servers = list(dict.fromkeys(a.stores + extra))
    return a


def main(argv: list[str] | None = None) -> None:
    global NT, NY, NX, SAMPLE_BYTES
    a = parse_args(argv)
    NT, NY, NX = (int(v) for v in a.shape.lower().split("x"))
    SAMPLE_BYTES = len(VARS) * NY * NX * 4
    if a.replot:
        import report

        report.write_all(a.out, docs=a.docs)
        return
    run_id = time.strftime("%Y%m%d-%H%M%S")
    meta = {
        "code": code_version(),
        "run": run_id,
        "argv": sys.argv[1:],
        "machine": machine(),
        "sections": a.sections,
        "stores": a.stores,
        "shape": [NT, NY, NX, CT],
    }
    log(f"# xinsitu bench {run_id} on {meta['code']}: {json.dumps(meta['machine'])}")
    out = Results(a.out, meta)
    t0 = time.perf_counter()
    archive = bench_data.ensure_archive(a.data_dir, NT, NY, NX, CT)
    with harness.Stores(a.data_dir, a.servers) as stores:
        if "peers" in a.sections:
            section_peers(a, stores, archive, out)
            if a.long:
                long_archive = bench_data.ensure_archive(a.data_dir, NT * 8, NY, NX, CT)
                long_peers = [p for p in a.peers if p in ("ceiling", "xinsitu")]
                section_peers(a, stores, long_archive, out, length=8, peers=long_peers, repeats=min(2, a.repeats))
        if "wait" in a.sections:
            section_wait(a, stores, archive, out)
        if "memory" in a.sections:
            section_memory(a, stores, out)
        if "scaling" in a.sections:
            section_scaling(a, stores, out)
    if "profile" in a.sections:
        section_profile(a, archive, out)
    import report

    text = report.write_all(a.out, run=run_id, docs=a.docs)
    log("\n" + text)
    log(f"\nresults: {out.path} (run {run_id}); {time.perf_counter() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
