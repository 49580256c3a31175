#!/usr/bin/env python
"""The shapes weather models train with: global fields, dozens of channels, one step per chunk.

    python bench/wm_shapes.py make DIR [--grid 1deg|0.25deg|WxH] [--nt 96] [--chunk-time 1]
    python bench/wm_shapes.py run DIR [--grid 1deg] [--peers decode,xinsitu,warm,copy1,stats,xarray] [--rounds 3]
    python bench/wm_shapes.py rss DIR --grid 0.25deg [--batch 2]     # peak RSS of one epoch, vs batch bytes

``--level-vars 2`` (with ``make``, ``run`` and ``rss``) keeps z and t only: 30 channels, the issue's 0.25° case
(``make DIR --grid 0.25deg --nt 16 --level-vars 2``, then ``rss DIR --grid 0.25deg --level-vars 2 --batch 2``).

The archive (as ``shared/bench/wm_bench.py`` writes it, at any grid): z, t, u, v, q, w on 13 pressure levels
and t2m, u10, v10, msl, float32, zstd, zarr v3, ``--chunk-time`` steps per chunk (1: ARCO-ERA5, GRIB). One
shuffled epoch of the 80 % train split as ``(B, 82, lat, lon)`` (levels as channels, ``stack=["level"]``).

Peers, each in a fresh process, one after the other in every round (the machine is shared: compare the
ratios within a round):
  decode   every chunk object of the train steps read and zstd-decoded by one thread per core, no assembly
  xinsitu  ds.insitu.batches(m, "train", stack=["level"], output="numpy", dtype="float32"), cold
  warm     the same generator's second epoch with cache=True
  again    the same generator's second epoch without a cache: every chunk read and decoded again, in a
           process whose memory was touched before (the first epoch also pays the first touch of each
           batch array's pages: 0.4-6 GB/s in this VM, where ``decode`` touches a few MB)
  copy1    one thread copying the same bytes (a cached epoch's bound: memory speed)
  stats    ds.insitu.stats(m, "train", stack=["level"]), the one-pass job on the same reader
  xarray   the loop a user writes by hand: ds.isel(time=batch) + np.concatenate
Rates are decoded GB/s; the table gives each peer's ratio to ``decode`` (``copy1`` for ``warm``).
No timed assertion anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

LEVEL_VARS = ["z", "t", "u", "v", "q", "w"]
SURF_VARS = ["t2m", "u10", "v10", "msl"]
LEVELS = [50, 100, 150, 200, 250, 300, 400, 500, 600, 700, 850, 925, 1000]
GRIDS = {"1deg": (181, 360), "0.25deg": (721, 1440)}


def grid(name: str) -> tuple[int, int]:
    if name in GRIDS:
        return GRIDS[name]
    w, h = name.lower().split("x")
    return int(h), int(w)


def archive(d: str, name: str, chunk_time: int, level_vars: int = len(LEVEL_VARS)) -> str:
    lv = "" if level_vars == len(LEVEL_VARS) else f"_lv{level_vars}"
    return os.path.join(d, f"wm_{name}_c{chunk_time}{lv}.zarr")


def variables(ds) -> list[str]:
    """The archive's variables, level variables first (as written)."""
    return [v for v in LEVEL_VARS + SURF_VARS if v in ds.data_vars]


def make(d: str, name: str, nt: int, chunk_time: int, level_vars: int = len(LEVEL_VARS)) -> str:
    import pandas as pd
    import xarray as xr

    nlat, nlon = grid(name)
    path = archive(d, name, chunk_time, level_vars)
    rng = np.random.default_rng(0)
    lat = np.linspace(90, -90, nlat, dtype="f4")
    lon = np.linspace(0, 360, nlon, endpoint=False, dtype="f4")
    base = (np.cos(np.deg2rad(lat))[:, None] * np.sin(np.deg2rad(lon))[None, :]).astype("f4")
    ds = xr.Dataset(coords={"time": pd.date_range("2000-01-01", periods=nt, freq="6h"),
                            "level": np.array(LEVELS, "i4"), "lat": lat, "lon": lon})
    enc = {}
    first = True
    for k, v in enumerate(LEVEL_VARS[:level_vars] + SURF_VARS):  # one variable at a time: memory stays one variable's
        shape = (nt, len(LEVELS), nlat, nlon) if v in LEVEL_VARS else (nt, nlat, nlon)
        a = np.empty(shape, "f4")
        for t in range(nt):
            noise = rng.standard_normal(shape[1:], dtype="f4") * np.float32(0.05)
            a[t] = base * np.float32(k + 1) + np.float32(0.01 * t) + noise
        dims = ("time", "level", "lat", "lon") if v in LEVEL_VARS else ("time", "lat", "lon")
        one = xr.Dataset({v: (dims, a)}, coords=ds.coords if first else None)
        enc = {v: {"chunks": (chunk_time, *shape[1:])}}
        one.to_zarr(path, mode="w" if first else "a", zarr_format=3, encoding=enc, consolidated=False)
        first = False
    return path


def _open(path: str):
    import xinsitu

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = xinsitu.open_zarr(path)
    return ds, ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})


def peer(path: str, which: str, batch: int) -> dict:
    """One peer, in this process: decoded GB/s over one epoch of the train split."""
    ds, m = _open(path)
    vars_ = variables(ds)
    if which in ("decode", "copy1"):
        return _decode(path, ds, m, which, vars_)
    if which == "stats":
        nbytes = sum(ds[v].isel(time=0).nbytes for v in vars_) * m.positions("train")
        t0 = time.perf_counter()
        ds[vars_].insitu.stats(m, "train", stack=["level"])
        return _row(which, nbytes, time.perf_counter() - t0)
    if which == "xarray":
        return _xarray(path, m, vars_, batch)
    gen = ds.insitu.batches(m, "train", batch_size=batch, variables=vars_, stack=["level"], output="numpy",
                            dtype="float32", seed=0, cache=True if which == "warm" else None)
    rows = []
    for ep in range(2 if which in ("warm", "again") else 1):
        gen.set_epoch(ep)
        t0, nbytes = time.perf_counter(), 0
        for b in gen:
            nbytes += b.nbytes
        rows.append(_row(which, nbytes, time.perf_counter() - t0))
    return rows[-1]


def _row(which: str, nbytes: int, dt: float) -> dict:
    return {"peer": which, "gb_per_s": nbytes / dt / 1e9, "s": dt, "gb": nbytes / 1e9}


def _decode(path: str, ds, m, which: str, vars_: list[str]) -> dict:
    """Every chunk object of the train steps decoded by one thread per core (``decode``), or the decoded
    bytes copied once by one thread (``copy1``: memory speed, what a cached epoch copies)."""
    from numcodecs import Zstd

    zstd = Zstd()
    chunk_t = ds[vars_[0]].encoding.get("chunks", (1,))[0]
    n_chunks = -(-m.positions("train") // chunk_t)
    files = [os.path.join(path, v, "c", str(c), *(["0"] * (ds[v].ndim - 1))) for c in range(n_chunks) for v in vars_]
    if which == "copy1":
        src = [np.frombuffer(zstd.decode(open(f, "rb").read()), "u1") for f in files[:len(vars_)]]
        dst = [np.empty_like(s) for s in src]
        for s, d in zip(src, dst, strict=True):
            np.copyto(d, s)  # warm
        t0, nbytes = time.perf_counter(), 0
        for _ in range(n_chunks):
            for s, d in zip(src, dst, strict=True):
                np.copyto(d, s)
                nbytes += s.nbytes
        return _row(which, nbytes, time.perf_counter() - t0)

    def one(f: str) -> int:
        with open(f, "rb") as fh:
            return len(zstd.decode(fh.read()))

    from xinsitu.io.loop import usable_cores

    t0 = time.perf_counter()
    with ThreadPoolExecutor(usable_cores()) as ex:
        nbytes = sum(ex.map(one, files))
    return _row(which, nbytes, time.perf_counter() - t0)


def _xarray(path: str, m, vars_: list[str], batch: int) -> dict:
    import xarray as xr

    ds = xr.open_zarr(path, chunks=None, consolidated=False)
    steps = np.arange(m.positions("train"))
    np.random.default_rng(0).shuffle(steps)
    nlat, nlon = ds.sizes["lat"], ds.sizes["lon"]
    t0, nbytes = time.perf_counter(), 0
    for i in range(0, len(steps), batch):
        sub = ds.isel(time=np.sort(steps[i:i + batch]))
        b = np.concatenate([sub[v].values.reshape(len(sub.time), -1, nlat, nlon) for v in vars_], axis=1)
        nbytes += b.nbytes
    return _row("xarray", nbytes, time.perf_counter() - t0)


def _child(args: list[str], timeout: float = 1800) -> dict:
    """Run one peer in a fresh process; its JSON line and its peak RSS."""
    p = subprocess.run([sys.executable, __file__, "_peer", *args], capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        return {"peer": args[1], "error": p.stderr.strip().splitlines()[-1:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def run(a: argparse.Namespace) -> None:
    path = archive(a.dir, a.grid, a.chunk_time, a.level_vars)
    peers = a.peers.split(",")
    rounds = []
    if not os.path.exists(path):
        raise SystemExit(f"no archive at {path}: write it first with `make` (same --grid, --chunk-time, --level-vars)")
    for r in range(a.rounds):
        rows = {p: _child([path, p, str(a.batch)]) for p in peers}
        for p, row in rows.items():
            if "error" in row:
                print(f"peer {p} failed: {row['error']}", file=sys.stderr)
        rounds.append(rows)
        print(json.dumps({"round": r, **{p: round(v.get("gb_per_s", float("nan")), 3) for p, v in rows.items()}}),
              flush=True)
    print(f"\n{a.grid}, {a.chunk_time} step(s) per chunk, batch {a.batch}: decoded GB/s per round, and the ratio "
          "to `decode` (`warm`: to `copy1`) in the same round\n")
    print("| peer | GB/s | ratio |\n|---|---|---|")
    for p in peers:
        gbs = [rows[p].get("gb_per_s", float("nan")) for rows in rounds]
        ref = "copy1" if p == "warm" and "copy1" in peers else "decode"
        ratios = [rows[p].get("gb_per_s", float("nan")) / rows[ref].get("gb_per_s", float("nan"))
                  for rows in rounds if ref in rows]
        print(f"| {p} | {' / '.join(f'{g:.2f}' for g in gbs)} | "
              f"{' / '.join(f'{x:.2f}' for x in ratios)}{'' if ref == 'decode' else ' (of copy1)'} |")


def rss(a: argparse.Namespace) -> None:
    """Peak RSS of one cold epoch of ``batches()`` in a fresh process, against the batch's bytes."""
    path = archive(a.dir, a.grid, a.chunk_time, a.level_vars)
    out = _child([path, "rss", str(a.batch)], timeout=3600)
    print(json.dumps(out))
    if "error" not in out:
        print(f"peak RSS {out['peak_rss_gb']:.2f} GB = {out['peak_rss_gb'] / out['batch_gb']:.1f} batches of "
              f"{out['batch_gb'] * 1e3:.0f} MB (before the first batch: {out['rss_before_gb']:.2f} GB); "
              f"{out['gb_per_s']:.2f} GB/s")


def _rss_peer(path: str, batch: int) -> dict:
    import resource

    import psutil

    ds, m = _open(path)
    vars_ = variables(ds)
    gen = ds.insitu.batches(m, "train", batch_size=batch, variables=vars_, stack=["level"], output="numpy",
                            dtype="float32", seed=0)
    before = psutil.Process().memory_info().rss
    t0, nbytes, bb = time.perf_counter(), 0, 0
    for b in gen:
        nbytes += b.nbytes
        bb = max(bb, b.nbytes)
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peer": "rss", "gb_per_s": nbytes / dt / 1e9, "peak_rss_gb": peak / 1e9, "rss_before_gb": before / 1e9,
            "batch_gb": bb / 1e9, "buffer": gen.buffer_summary}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_peer":
        path, which, batch = sys.argv[2], sys.argv[3], int(sys.argv[4])
        print(json.dumps(_rss_peer(path, batch) if which == "rss" else peer(path, which, batch)))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["make", "run", "rss"])
    ap.add_argument("dir")
    ap.add_argument("--grid", default="1deg")
    ap.add_argument("--nt", type=int, default=96)
    ap.add_argument("--chunk-time", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--level-vars", type=int, default=len(LEVEL_VARS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peers", default="decode,xinsitu,again,warm,copy1,stats,xarray")
    a = ap.parse_args()
    if a.cmd == "make":
        print(make(a.dir, a.grid, a.nt, a.chunk_time, a.level_vars))
    elif a.cmd == "run":
        run(a)
    else:
        rss(a)


if __name__ == "__main__":
    main()
