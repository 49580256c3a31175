#!/usr/bin/env python
"""Scale: planning cost of archives of 10^6-10^7 chunks (no chunk is ever read).

Mirrors ``../shared/bench/scale.py``: a metadata-only Zarr v3 archive (no chunk written)
of N time steps, one step per chunk, 4 variables of (4, 4), then times, in this process:
open, geometry (first and second call, and on a derived Dataset), split (0.8/0.1/0.1,
gap=1), ``batches(...)``, ``len(gen)``, ``state_dict()``, ``repr(gen)``, the first batch,
``repr`` of the manifest and geometry, the manifest's JSON (size, write and load), a
random ``contiguous=False`` split's JSON size, planning rank 0 of 1,024 (``len`` of a
generator with ``world_size=1024``, then its plan) on both splits, and the peak RSS
(``--rss-steps``: after each step, with the RSS then). Prints one JSON line.

    python bench/scale_bench.py --steps 1000000
    python bench/scale_bench.py --steps 10000000 --dir ../scale-data
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, "/work/shared/bench")


def rss_mb() -> int:
    """Resident memory now (MB): what a step keeps, next to the peak (ru_maxrss) it reached."""
    try:
        with open("/proc/self/statm") as f:
            return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6)
    except OSError:
        return -1


def make(path: str, steps: int) -> None:
    try:
        from scale import make as shared_make  # the shared script's archive, when it is there
    except ImportError:
        shared_make = None
    if shared_make is not None:
        shared_make(path, steps)
        return
    import numpy as np
    import zarr
    if os.path.exists(os.path.join(path, "zarr.json")):
        return
    g = zarr.open_group(path, mode="w", zarr_format=3)
    t = g.create_array("time", shape=(steps,), chunks=(min(steps, 1_000_000),), dtype="int64",
                       dimension_names=["time"], fill_value=0)
    t.attrs.update({"units": "hours since 1940-01-01", "calendar": "proleptic_gregorian"})
    for s in range(0, steps, 1_000_000):
        e = min(steps, s + 1_000_000)
        t[s:e] = np.arange(s, e, dtype="int64")
    for v in ("a", "b", "c", "d"):
        g.create_array(v, shape=(steps, 4, 4), chunks=(1, 4, 4), dtype="float32", fill_value=float("nan"),
                       dimension_names=["time", "y", "x"])
    zarr.consolidate_metadata(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "xinsitu-scale"))
    ap.add_argument("--no-random", action="store_true", help="skip the contiguous=False split")
    ap.add_argument("--trainer", action="store_true",
                    help="only what a training process does (open, geometry, split, batches, len, state, repr, the "
                         "first batch, rank 0 of 1,024): its peak RSS, without the bench's extra geometries and "
                         "manifests")
    ap.add_argument("--rss-steps", action="store_true",
                    help="also report the peak RSS after each step (_peak_mb) and the RSS then (_rss_mb)")
    ap.add_argument("--time-unit", default=None,
                    help="decode the time axis to datetime64 of this unit (e.g. 's'): an hourly axis of 10^7 "
                         "steps from 1940 ends past 2262, where xarray's default (ns) falls back to 10^7 cftime "
                         "objects (tens of seconds and GBs in open alone)")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, f"meta_{a.steps}.zarr")
    make(path, a.steps)
    import xinsitu
    from xinsitu import SplitManifest
    out: dict = {"steps": a.steps, "chunks": a.steps * 4}

    def step(name, fn):
        t0, c0 = time.perf_counter(), time.process_time()
        r = fn()
        out[name + "_s"] = round(time.perf_counter() - t0, 4)
        out[name + "_cpu_s"] = round(time.process_time() - c0, 4)  # the machine may be shared
        if a.rss_steps:
            out[name + "_peak_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3)
            out[name + "_rss_mb"] = rss_mb()
        return r

    kw = {}
    if a.time_unit:
        import xarray as xr
        kw["decode_times"] = xr.coders.CFDatetimeCoder(time_unit=a.time_unit)
    out["time_unit"] = a.time_unit
    ds = step("open", lambda: xinsitu.open_zarr(path, **kw))
    out["rss_after_open_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3)
    g = step("geometry", lambda: ds.insitu.geometry)
    if not a.trainer:
        step("geometry_again", lambda: ds.insitu.geometry)
        step("geometry_derived", lambda: ds[["a", "b"]].insitu.geometry)
    m = step("split", lambda: ds.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1}, gap=1))
    gen = step("batches", lambda: ds.insitu.batches(m, "train", batch_size=32, output="numpy"))
    step("len", lambda: len(gen))
    step("state_dict", lambda: gen.state_dict())
    step("state_dict_again", lambda: gen.state_dict())
    step("repr", lambda: repr(gen))
    step("repr_manifest", lambda: repr(m))
    step("repr_geometry", lambda: repr(g))
    it = iter(gen)
    step("first_batch", lambda: next(it))
    it.close()
    js = os.path.join(a.dir, "manifest.json")
    if not a.trainer:
        step("to_json", lambda: m.to_json(js))
        out["manifest_bytes"] = os.path.getsize(js)
        step("from_json", lambda: SplitManifest.from_json(js))
    g1024 = step("batches_rank0_of_1024", lambda: ds.insitu.batches(m, "train", batch_size=32, output="numpy",
                                                                     rank=0, world_size=1024))
    step("plan_rank0_of_1024", lambda: g1024.plan())
    p = g1024.plan()
    out["rank0_units"] = int(len(p.units))
    out["rank0_plan_bytes"] = int(sum(x.nbytes if x.strides != (0,) else x.itemsize for x in (p.units, p.lo, p.hi)))
    out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3)
    if not a.no_random and not a.trainer:
        mr = step("split_random", lambda: ds.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1},
                                                          contiguous=False, seed=0))
        step("to_json_random", lambda: mr.to_json(js))
        out["manifest_random_bytes"] = os.path.getsize(js)
        step("from_json_random", lambda: SplitManifest.from_json(js))
        # a scattered split (runs of random length): the same planning, over ~10^6 runs
        gr = step("batches_random_rank0_of_1024", lambda: ds.insitu.batches(mr, "train", batch_size=32,
                                                                            output="numpy", rank=0, world_size=1024))
        step("plan_random_rank0_of_1024", lambda: gr.plan())
        out["random_runs"] = int(mr.splits["train"].nruns)
        out["peak_rss_with_random_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
