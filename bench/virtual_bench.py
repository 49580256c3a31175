"""NetCDF files read in place (virtual references) against the same data as native Zarr.

The bench archive of ``bench/data.py`` (1460 x 64 x 128, four float32 variables, chunks of
24 time steps, zarr v3 ``bytes`` + ``zstd``) is also written as NetCDF4 files of
``--file-steps`` steps each (deflate + shuffle, chunks of 24 steps: what xarray's
``to_netcdf(encoding={"zlib": True, "shuffle": True, "chunksizes": ...})`` writes), and as a
native Zarr with the NetCDF files' codecs (``numcodecs.shuffle`` + ``numcodecs.zlib``), which
separates what the codec costs from what the in-place path costs. With icechunk installed,
the NetCDF files are also referenced from an Icechunk repository (virtual chunks).

Each variant runs in a fresh subprocess, in rotating order, ``--rounds`` times; a run is
``--epochs`` epochs of the train split (80 %), ``batch_size=32, output="numpy",
stack=True``, the first epoch a warm-up. Reported: the median samples/s of each variant
and the ratios to native Zarr.

    python bench/virtual_bench.py                      # defaults: the bench-like archive
    python bench/virtual_bench.py --nt 480 --rounds 2  # quicker
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
import warnings
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from data import DEFAULT_DIR, VARS, ensure_archive  # noqa: E402

FRACTIONS = {"train": 0.8, "val": 0.1, "test": 0.1}
VARIANTS = ("zarr", "zarr-zlib", "netcdf", "icechunk")


# ----------------------------------------------------------------------------- data
def prepare(a: argparse.Namespace) -> dict[str, str]:
    """Paths of every variant's archive, written first where missing (from the native Zarr's values)."""
    import xarray as xr

    native = ensure_archive(a.data_dir, a.nt, a.ny, a.nx, a.chunk_time)
    base = os.path.join(a.data_dir, f"virtual_t{a.nt}_y{a.ny}_x{a.nx}_c{a.chunk_time}_f{a.file_steps}")
    ncdir = os.path.join(base, "nc")
    paths = {"zarr": native, "zarr-zlib": os.path.join(base, "zlib.zarr"), "netcdf": ncdir,
             "icechunk": os.path.join(base, "icechunk")}
    warnings.simplefilter("ignore")
    src = xr.open_zarr(native, chunks=None)[VARS]
    if not os.path.exists(os.path.join(ncdir, ".done")):
        t0 = time.perf_counter()
        os.makedirs(ncdir, exist_ok=True)
        enc = {v: {"zlib": True, "shuffle": True, "complevel": 4, "chunksizes": (a.chunk_time, a.ny, a.nx)}
               for v in VARS}
        for k, i in enumerate(range(0, a.nt, a.file_steps)):
            part = src.isel(time=slice(i, i + a.file_steps)).load()
            part.to_netcdf(os.path.join(ncdir, f"part{k:04d}.nc"), encoding=enc, unlimited_dims=["time"])
        open(os.path.join(ncdir, ".done"), "w").close()
        print(f"  wrote {len(glob.glob(ncdir + '/*.nc'))} NetCDF files in {time.perf_counter() - t0:.1f} s")
    if not os.path.exists(os.path.join(paths["zarr-zlib"], ".done")):
        from zarr.codecs.numcodecs import Shuffle, Zlib

        t0 = time.perf_counter()
        enc = {v: {"chunks": (a.chunk_time, a.ny, a.nx), "compressors": [Shuffle(elementsize=4), Zlib(level=4)]}
               for v in VARS}
        src.load().to_zarr(paths["zarr-zlib"], mode="w", zarr_format=3, encoding=enc, consolidated=True)
        open(os.path.join(paths["zarr-zlib"], ".done"), "w").close()
        print(f"  wrote the shuffle+zlib Zarr in {time.perf_counter() - t0:.1f} s")
    try:
        import icechunk  # noqa: F401
        import virtualizarr  # noqa: F401
    except ImportError:
        paths.pop("icechunk")
    else:
        if not os.path.exists(os.path.join(paths["icechunk"], ".done")):
            write_icechunk(paths["icechunk"], sorted(glob.glob(ncdir + "/*.nc")))
    return paths


def _icechunk_container(ncdir: str) -> tuple[Any, Any]:
    import icechunk

    prefix = "file://" + os.path.abspath(ncdir).rstrip("/") + "/"
    cfg = icechunk.RepositoryConfig.default()
    cfg.set_virtual_chunk_container(icechunk.VirtualChunkContainer(prefix, icechunk.local_filesystem_store(ncdir)))
    return cfg, icechunk.containers_credentials({prefix: getattr(icechunk.credentials, "LocalFileSystemAccess", None)})


def write_icechunk(repo_dir: str, files: list[str]) -> None:
    """The NetCDF files as virtual references committed to an Icechunk repository."""
    import icechunk

    from xinsitu.virtual import netcdf_store

    t0 = time.perf_counter()
    # VirtualiZarr's own open_virtual_mfdataset refuses a last file that ends mid-chunk; netcdf_store
    # joins the files and its virtual dataset (time loaded, data variables virtual) goes to Icechunk
    vds = netcdf_store(files).to_virtual_dataset(loadable_variables=["time"])
    cfg, cred = _icechunk_container(os.path.dirname(files[0]))
    repo = icechunk.Repository.create(icechunk.local_filesystem_storage(repo_dir), cfg,
                                      authorize_virtual_chunk_access=cred)
    session = repo.writable_session("main")
    vds.vz.to_icechunk(session.store)
    session.commit("virtual references to the NetCDF files")
    open(os.path.join(repo_dir, ".done"), "w").close()
    print(f"  wrote the Icechunk repository (virtual) in {time.perf_counter() - t0:.1f} s")


# ----------------------------------------------------------------------------- one run
def _cpu_s() -> float:
    """CPU seconds of this process, all threads: less disturbed than wall time on a busy machine."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def open_variant(variant: str, path: str) -> Any:
    import xinsitu

    if variant in ("zarr", "zarr-zlib"):
        return xinsitu.open_zarr(path)
    if variant == "netcdf":
        from xinsitu.virtual import open_netcdf

        return open_netcdf(sorted(glob.glob(os.path.join(path, "*.nc"))))
    if variant == "icechunk":
        import icechunk

        icechunk.set_logs_filter("error")
        cfg, cred = _icechunk_container(os.path.join(os.path.dirname(path), "nc"))
        repo = icechunk.Repository.open(icechunk.local_filesystem_storage(path), cfg,
                                        authorize_virtual_chunk_access=cred)
        return xinsitu.open_zarr(repo.readonly_session(branch="main").store)
    raise SystemExit(f"unknown variant {variant!r}")


def worker(variant: str, path: str, epochs: int, warmup: int) -> dict[str, Any]:
    from xinsitu.stores.backend import backend_for

    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    ds = open_variant(variant, path)[VARS]
    open_s = time.perf_counter() - t0
    m = ds.insitu.split("time", fractions=FRACTIONS)
    gen = ds.insitu.batches(m, "train", batch_size=32, output="numpy", stack=True, seed=0)
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
    zstore = gen.sources[VARS[0]].array.store
    measured = slice(1, None) if len(rates) > 1 else slice(None)
    return {"variant": variant, "samples_per_s": float(np.median(rates[measured])),
            "cpu_us_per_sample": float(np.median(cpus[measured])),
            "epochs_sps": rates, "open_s": open_s, "backend": type(backend_for(zstore)).__name__,
            "io": {k: v for k, v in gen.io_stats.items() if k in ("chunks", "requests", "bytes_read")}}


# ----------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=DEFAULT_DIR)
    ap.add_argument("--nt", type=int, default=1460)
    ap.add_argument("--ny", type=int, default=64)
    ap.add_argument("--nx", type=int, default=128)
    ap.add_argument("--chunk-time", type=int, default=24)
    ap.add_argument("--file-steps", type=int, default=120, help="time steps per NetCDF file (a multiple of the chunk)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3, help="per run; the first is a warm-up")
    ap.add_argument("--warmup-batches", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--worker", nargs=2, metavar=("VARIANT", "PATH"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(a.worker[0], a.worker[1], a.epochs, a.warmup_batches)))
        return
    if a.file_steps % a.chunk_time:
        raise SystemExit("--file-steps must be a multiple of --chunk-time (only the last file may end mid-chunk)")
    paths = prepare(a)
    variants = [v for v in a.variants.split(",") if v in paths]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for r in range(a.rounds):
        for v in variants[r % len(variants):] + variants[: r % len(variants)]:
            cmd = [sys.executable, __file__, "--worker", v, paths[v], "--epochs", str(a.epochs),
                   "--warmup-batches", str(a.warmup_batches)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{v} failed:\n{out.stderr[-3000:]}")
            res = json.loads(line[7:])
            runs[v].append(res)
            print(f"  round {r} {v:10s} {res['samples_per_s']:8.0f} samples/s {res['cpu_us_per_sample']:7.0f} "
                  f"CPU us/sample  (backend {res['backend']})", flush=True)
    med = {v: float(np.median([x["samples_per_s"] for x in rs])) for v, rs in runs.items()}
    cpu = {v: float(np.median([x["cpu_us_per_sample"] for x in rs])) for v, rs in runs.items()}
    print(f"\n{a.nt} x {a.ny} x {a.nx}, {len(VARS)} float32 vars, chunks of {a.chunk_time} steps, "
          f"NetCDF files of {a.file_steps} steps; median of {a.rounds} runs")
    print("  (rate: samples/s and its ratio to native Zarr; CPU: CPU time per sample and the ratio of native "
          "Zarr's to it, so that 1.00 is parity either way)")
    for v in variants:
        print(f"  {v:10s} {med[v]:7.0f} samples/s x{med[v] / med['zarr']:.2f}   {cpu[v]:6.0f} CPU us/sample "
              f"x{cpu['zarr'] / cpu[v]:.2f}"
              + (f"   vs native Zarr with the same codecs: rate x{med[v] / med['zarr-zlib']:.2f}, "
                 f"CPU x{cpu['zarr-zlib'] / cpu[v]:.2f}" if "zarr-zlib" in med and v not in ("zarr", "zarr-zlib")
                 else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"median_samples_per_s": med, "median_cpu_us_per_sample": cpu, "runs": runs, "args": vars(a)},
                      f, indent=1)


if __name__ == "__main__":
    main()
