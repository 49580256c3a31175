"""Synthetic ERA5-like archives for the benchmarks, written once and cached.

Each archive is ``time x lat x lon`` with the four float32 variables of
``xinsitu.synthetic`` (``t2m``, ``u10``, ``v10``, ``z500``), zarr v3, zstd (zarr's
default codec chain: ``bytes`` + ``zstd``), chunks of ``chunk_time`` steps spanning the
whole lat x lon plane, consolidated metadata (needed over plain HTTP). Long archives are
written in slabs, so writing an 8x archive needs no more memory than a 1x one.

The data live outside the repository (``/work/bench-data/xinsitu-bench`` by default,
``XINSITU_BENCH_DATA`` or ``--data-dir`` to change it): they are never committed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings

import numpy as np

VARS = ["t2m", "u10", "v10", "z500"]
DEFAULT_DIR = os.environ.get("XINSITU_BENCH_DATA", "/work/bench-data/xinsitu-bench")
STAMP = ".xinsitu-bench.json"


def archive_name(nt: int, ny: int, nx: int, chunk_time: int) -> str:
    return f"era5_t{nt}_y{ny}_x{nx}_c{chunk_time}.zarr"


def ensure_archive(
    data_dir: str,
    nt: int = 1460,
    ny: int = 64,
    nx: int = 128,
    chunk_time: int = 24,
    slab: int | None = None,
    quiet: bool = False,
) -> str:
    """Path of the archive with these parameters, written first if it is not there yet."""
    path = os.path.join(data_dir, archive_name(nt, ny, nx, chunk_time))
    params = {"nt": nt, "ny": ny, "nx": nx, "chunk_time": chunk_time, "vars": VARS, "version": 1}
    stamp = os.path.join(path, STAMP)
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == params:
                return path
    os.makedirs(data_dir, exist_ok=True)
    if os.path.exists(path):
        shutil.rmtree(path)
    t0 = time.perf_counter()
    write_archive(path, nt, ny, nx, chunk_time, slab)
    with open(stamp, "w") as f:
        json.dump(params, f)
    if not quiet:
        print(
            f"  wrote {path} ({nt} x {ny} x {nx}, chunks of {chunk_time}) in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
    return path


def write_archive(path: str, nt: int, ny: int, nx: int, chunk_time: int, slab: int | None = None) -> None:
    """Write the archive in slabs of whole chunks (about 1460 steps each)."""
    import pandas as pd

    from xinsitu.synthetic import era5_like

    if slab is None:
        slab = max(chunk_time, (1460 // chunk_time) * chunk_time) if nt > 1464 else nt
    times = pd.date_range("1979-01-01", periods=nt, freq="6h")
    enc = {v: {"chunks": (chunk_time, ny, nx)} for v in VARS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr: "consolidated metadata is not part of the v3 spec"
        for k, a in enumerate(range(0, nt, slab)):
            n = min(slab, nt - a)
            ds = era5_like(n, ny, nx, seed=k)[VARS].assign_coords(time=times[a : a + n])
            if a == 0:
                ds.to_zarr(path, mode="w", zarr_format=3, encoding=enc, consolidated=True)
            else:
                ds.to_zarr(path, mode="a", append_dim="time", consolidated=True)


def chunk_nbytes(nt_chunk: int, ny: int, nx: int) -> int:
    """Decoded bytes of one chunk of one variable."""
    return nt_chunk * ny * nx * np.dtype("float32").itemsize


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=DEFAULT_DIR)
    ap.add_argument("--nt", type=int, default=1460)
    ap.add_argument("--ny", type=int, default=64)
    ap.add_argument("--nx", type=int, default=128)
    ap.add_argument("--chunk-time", type=int, default=24)
    a = ap.parse_args()
    print(ensure_archive(a.data_dir, a.nt, a.ny, a.nx, a.chunk_time))
