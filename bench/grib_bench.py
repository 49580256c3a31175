"""GRIB files read in place (one message per chunk) against the same data as one-message-per-chunk Zarr.

Four ERA5-like surface fields (``2t``, ``2d``, ``msl``, ``sp``) on a regular lat/lon grid are
written with ecCodes as GRIB files of ``--file-times`` reference times each (``--edition``,
``--packing``, 16 bits a value: what ECMWF and most NWP centres publish). The same values, read
back through cfgrib, are written as a native Zarr v3 archive chunked one field a chunk
(``(1, lat, lon)``, zarr's default ``zstd``), so both sides read the same number of chunks of
the same size. Variants:

* ``zarr``: the native Zarr archive (``xinsitu.open_zarr``);
* ``grib``: the GRIB files in place (``xinsitu.virtual.open_grib``, decoder ``auto``: gribberish
  where verified for the packing, else ecCodes);
* ``grib-eccodes``: the same with every message decoded by ecCodes.

Each variant runs in a fresh subprocess, in rotating order, ``--rounds`` times; a run is
``--epochs`` epochs of the train split (80 %) with ``batch_size=16, output="numpy",
stack=True``, the first epoch a warm-up. Reported: median samples/s, CPU time per sample, and
the ratios to native Zarr, side by side from one invocation.

    python bench/grib_bench.py                        # defaults: 240 x 181 x 360, GRIB2 simple packing
    python bench/grib_bench.py --nt 96 --rounds 2     # quicker
    python bench/grib_bench.py --edition 1            # GRIB1
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

FIELDS = ("2t", "2d", "msl", "sp")
VARS = ["t2m", "d2m", "msl", "sp"]  # cfgrib's names for them
VARIANTS = ("zarr", "grib", "grib-eccodes")
FRACTIONS = {"train": 0.8, "val": 0.1, "test": 0.1}


# ----------------------------------------------------------------------------- data
def _fields(nt: int, ny: int, nx: int, seed: int) -> dict[str, np.ndarray]:
    """Smooth large-scale patterns plus noise, as float64 (time, step, lat, lon)."""
    rng = np.random.default_rng(seed)
    lat = np.linspace(-np.pi / 2, np.pi / 2, ny)[:, None]
    lon = np.linspace(0, 2 * np.pi, nx)[None, :]
    t = np.arange(nt)[:, None, None]
    base = np.sin(3 * lon + 0.1 * t) * np.cos(2 * lat)
    noise = lambda s: s * rng.standard_normal((nt, ny, nx))  # noqa: E731
    t2m = 288 - 30 * np.sin(lat) ** 2 + 5 * base + noise(0.5)
    out = {"2t": t2m, "2d": t2m - 5 + 2 * np.cos(2 * lon - 0.1 * t) * np.cos(lat) + noise(1),
           "msl": 101300 + 800 * base + noise(50), "sp": 98000 + 2000 * np.cos(lat) + 700 * base + noise(50)}
    return {k: v[:, None] for k, v in out.items()}


def prepare(a: argparse.Namespace) -> dict[str, str]:
    """Paths of every variant's data, written first where missing."""
    import pandas as pd
    import xarray as xr

    from xinsitu.formats.grib import write_grib

    base = os.path.join(a.data_dir, f"grib_t{a.nt}_y{a.ny}_x{a.nx}_f{a.file_times}_e{a.edition}_{a.packing}")
    gdir, zpath = os.path.join(base, "grib"), os.path.join(base, "messages.zarr")
    if not os.path.exists(os.path.join(gdir, ".done")):
        t0 = time.perf_counter()
        os.makedirs(gdir, exist_ok=True)
        times = pd.date_range("2020-01-01", periods=a.nt, freq="12h")
        for k, i in enumerate(range(0, a.nt, a.file_times)):
            n = min(a.file_times, a.nt - i)
            write_grib(os.path.join(gdir, f"part{k:04d}.grib"), _fields(n, a.ny, a.nx, seed=k), times[i:i + n], [0],
                       edition=a.edition, packing=a.packing, lat0=90.0, dlat=180.0 / (a.ny - 1), dlon=360.0 / a.nx)
        open(os.path.join(gdir, ".done"), "w").close()
        size = sum(os.path.getsize(f) for f in glob.glob(gdir + "/*.grib"))
        print(f"  wrote {len(glob.glob(gdir + '/*.grib'))} GRIB files ({size / 2**20:.0f} MiB) in "
              f"{time.perf_counter() - t0:.1f} s")
    if not os.path.exists(os.path.join(zpath, ".done")):
        t0 = time.perf_counter()
        files = sorted(glob.glob(gdir + "/*.grib"))
        ds = xr.concat([xr.open_dataset(f, engine="cfgrib", indexpath="").load() for f in files], dim="time",
                       coords="different", compat="equals", join="exact", combine_attrs="override")
        enc = {v: {"chunks": (1,) * (ds[v].ndim - 2) + ds[v].shape[-2:]} for v in ds.data_vars}
        ds.to_zarr(zpath, mode="w", zarr_format=3, encoding=enc, consolidated=True)
        open(os.path.join(zpath, ".done"), "w").close()
        print(f"  wrote the one-message-per-chunk Zarr in {time.perf_counter() - t0:.1f} s")
    return {"zarr": zpath, "grib": gdir, "grib-eccodes": gdir}


# ----------------------------------------------------------------------------- one run
def _cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def open_variant(variant: str, path: str) -> tuple[Any, list[str]]:
    """The Dataset, and the GRIB decoders its variables use."""
    import xinsitu
    from xinsitu.virtual import grib_store

    if variant == "zarr":
        return xinsitu.open_zarr(path), []
    store = grib_store(sorted(glob.glob(os.path.join(path, "*.grib"))),
                       decoder="eccodes" if variant == "grib-eccodes" else "auto")
    decoders = sorted({store._group.arrays[v].metadata.codecs[0].decoder for v in VARS})
    return xinsitu.open_zarr(store, consolidated=False), decoders


def worker(variant: str, path: str, epochs: int, warmup: int, batch_size: int) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    ds, decoders = open_variant(variant, path)
    ds = ds[VARS]
    open_s = time.perf_counter() - t0
    m = ds.insitu.split("time", fractions=FRACTIONS)
    gen = ds.insitu.batches(m, "train", batch_size=batch_size, output="numpy", stack=True, seed=0)
    rates, cpus = [], []
    for e in range(epochs):
        gen.set_epoch(e)
        times, sizes = [], []
        c0 = _cpu_s()
        t0 = time.perf_counter()
        for b in gen:
            times.append(time.perf_counter())
            sizes.append(b.shape[0])
        t, s = np.array(times), np.array(sizes)
        cpus.append(1e6 * (_cpu_s() - c0) / max(1, int(s.sum())))
        rates.append(float(s[warmup:].sum() / (t[-1] - t[warmup - 1])) if len(t) > warmup + 1
                     else float(s.sum() / (t[-1] - t0)))
    measured = slice(1, None) if len(rates) > 1 else slice(None)
    return {"variant": variant, "samples_per_s": float(np.median(rates[measured])),
            "cpu_us_per_sample": float(np.median(cpus[measured])), "epochs_sps": rates, "open_s": open_s,
            "decoders": decoders, "io": {k: v for k, v in gen.io_stats.items() if k in ("chunks", "bytes_read")}}


# ----------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "xinsitu-bench"))
    ap.add_argument("--nt", type=int, default=240, help="reference times (12-hourly)")
    ap.add_argument("--ny", type=int, default=181)
    ap.add_argument("--nx", type=int, default=360)
    ap.add_argument("--file-times", type=int, default=24, help="reference times per GRIB file")
    ap.add_argument("--edition", type=int, default=2, choices=(1, 2))
    ap.add_argument("--packing", default="grid_simple", help="ecCodes packingType (grid_simple, grid_ccsds...)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3, help="per run; the first is a warm-up")
    ap.add_argument("--warmup-batches", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--worker", nargs=2, metavar=("VARIANT", "PATH"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(a.worker[0], a.worker[1], a.epochs, a.warmup_batches, a.batch_size)))
        return
    paths = prepare(a)
    variants = [v for v in a.variants.split(",") if v in paths]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for r in range(a.rounds):
        for v in variants[r % len(variants):] + variants[: r % len(variants)]:
            cmd = [sys.executable, __file__, "--worker", v, paths[v], "--epochs", str(a.epochs),
                   "--warmup-batches", str(a.warmup_batches), "--batch-size", str(a.batch_size)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{v} failed:\n{out.stderr[-3000:]}")
            res = json.loads(line[7:])
            runs[v].append(res)
            print(f"  round {r} {v:13s} {res['samples_per_s']:8.1f} samples/s {res['cpu_us_per_sample']:8.0f} "
                  f"CPU us/sample  open {res['open_s']:.2f} s  decoders {res['decoders']}", flush=True)
    med = {v: float(np.median([x["samples_per_s"] for x in rs])) for v, rs in runs.items()}
    cpu = {v: float(np.median([x["cpu_us_per_sample"] for x in rs])) for v, rs in runs.items()}
    opened = {v: float(np.median([x["open_s"] for x in rs])) for v, rs in runs.items()}
    print(f"\n{a.nt} reference times x {a.ny} x {a.nx}, {len(VARS)} fields, GRIB{a.edition} {a.packing}, files of "
          f"{a.file_times} times; one field a chunk on both sides; median of {a.rounds} runs")
    ref = "zarr" if "zarr" in med else variants[0]
    print(f"  {'variant':13s} {'samples/s':>9s} {'x zarr':>7s} {'CPU us/sample':>14s} {'zarr CPU / this':>16s} "
          f"{'open s':>7s}")
    for v in variants:
        print(f"  {v:13s} {med[v]:9.1f} {med[v] / med[ref]:7.2f} {cpu[v]:14.0f} {cpu[ref] / cpu[v]:16.2f} "
              f"{opened[v]:7.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"median_samples_per_s": med, "median_cpu_us_per_sample": cpu, "open_s": opened, "runs": runs,
                       "args": vars(a)}, f, indent=1)


if __name__ == "__main__":
    main()
