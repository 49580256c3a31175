"""Chunks read per epoch, and what buffers hold to pass on, where windows and tiles spill into the
next chunk block (SPEC §5: at most 1.15x the split's chunks; memory a few buffers).

A spatial split of a grid of blocks (``--grid`` lat x lon blocks of 5 x 6 positions, 6 time steps
whole in chunks of 3, 3 variables, one in another dim order), tiles over ``lat`` and ``lon``,
shuffled epochs per ``block_chunks``; and a split over time blocks too (tiles spill along lat and
lon only, time blocks mixed in buffers). For each: the most chunk reads of an epoch over the
split's chunks, and the most that was passed on and not yet taken at once, in buffers of slots (a
block and what its tiles spill into, as the buffers hold it: ``HaloPlan.peak``; the bound is
``HALO_HELD_BUFFERS``).

    python bench/halo_reads.py --grid 8 10 --out halo.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings

import numpy as np
import xarray as xr

import xinsitu
from xinsitu.batches.halo import HALO_HELD_BUFFERS

NT, CT = 6, 3  # time steps, and per chunk

TILES = {
    "tiles 4x4, stride 2x3": {"patch": {"lat": 4, "lon": 4}, "stride": {"lat": 2, "lon": 3}},
    "tiles 3x8 (wider than a chunk), stride 1x2": {"patch": {"lat": 3, "lon": 8}, "stride": {"lat": 1, "lon": 2}},
    "tiles 2x2": {"patch": {"lat": 2, "lon": 2}},
}


def archive(path: str, ny: int, nx: int) -> xr.Dataset:
    rng = np.random.default_rng(0)
    ds = xr.Dataset({"a": (("time", "lat", "lon"), rng.standard_normal((NT, 5 * ny, 6 * nx)).astype("f4")),
                     "b": (("time", "lat", "lon"), rng.standard_normal((NT, 5 * ny, 6 * nx)))})
    ds["c"] = ds["a"].transpose("lat", "lon", "time") * 2
    ds.to_zarr(path, mode="w", encoding={v: {"chunks": {"time": (CT, 5, 6), "lat": (5, 6, CT)}[ds[v].dims[0]]}
                                         for v in ds.data_vars})
    return xinsitu.open_zarr(path)


def measure(ds: xr.Dataset, m: xinsitu.SplitManifest, kw: dict, block_chunks: int, epochs: int,
            per_unit: int) -> dict:
    gen = ds.insitu.batches(m, "train", batch_size=16, output="numpy", block_chunks=block_chunks, seed=0, **kw)
    reads, peaks = [], []
    for epoch in range(epochs):
        gen.set_epoch(epoch)
        for _ in gen:
            pass
        reads.append(gen.io_stats["chunks"] / (len(m.splits["train"]) * per_unit))
        halo = gen._buffer_loader().halo_plan(gen.plan(), 0)
        peaks.append(0.0 if halo is None else halo.peak / (halo.slot * block_chunks))
    return {"reads": round(max(reads), 3), "held_buffers": round(max(peaks), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", type=int, nargs=2, default=(8, 10), metavar=("LAT", "LON"))
    ap.add_argument("--block-chunks", type=int, nargs="+", default=[16, 8, 4, 2])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    res: dict = {"grid": list(a.grid), "bound_buffers": HALO_HELD_BUFFERS, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        ds = archive(f"{tmp}/grid.zarr", *a.grid)
        spatial = ds.insitu.split(["lat", "lon"], fractions={"train": 1.0})
        cube = ds.insitu.split(["time", "lat", "lon"], fractions={"train": 1.0})
        cases = [(name, spatial, kw, 3 * NT // CT) for name, kw in TILES.items()]
        cases.append(("time blocks x grid, tiles 4x4, stride 2x3", cube, TILES["tiles 4x4, stride 2x3"], 3))
        print(f"{'case':45s} {'block_chunks':>12s} {'reads/split chunks':>19s} {'held, buffers':>14s}")  # (of slots)
        for name, m, kw, per_unit in cases:
            for bc in a.block_chunks:
                r = measure(ds, m, kw, bc, a.epochs, per_unit)
                res["rows"].append({"case": name, "block_chunks": bc, **r})
                print(f"{name:45s} {bc:12d} {r['reads']:19.2f} {r['held_buffers']:14.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
