#!/usr/bin/env python
"""Cost of ``ds.insitu.validity`` beside what it is made of, and the size of its masks.

On the 80 % train split of an ERA5-like archive (``sst`` is NaN over land), the median of
``--repeat`` runs of:

- ``stats``: ``ds.insitu.stats`` (one streaming pass, reduction only);
- ``validity``: ``ds.insitu.validity(where="finite")`` with the given patch (the samples read
  unshuffled through the batches' reader, each chunk once, and tested);
- ``epoch``: one unshuffled epoch of ``batches(output="numpy")`` with that patch and no mask,
  the read the pass is built on: validity / epoch is what the test and the bitmap cost;
- ``masked epoch``: one shuffled epoch that draws only the valid samples.

Then the JSON size of a 10^7-sample mask: random (incompressible), 5 % invalid, and in runs.

    python bench/validity_bench.py --nt 2920 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings

import numpy as np

import xinsitu
from xinsitu.index.runs import encode_mask
from xinsitu.synthetic import write_era5_like

warnings.filterwarnings("ignore", message=".*[Cc]onsolidated metadata.*")


def timed(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nt", type=int, default=2920)
    ap.add_argument("--patch", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/e.zarr"
        write_era5_like(path, nt=a.nt, ny=32, nx=64, chunk_time=24)
        ds = xinsitu.open_zarr(path)
        m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
        patch = {"lat": a.patch, "lon": a.patch}
        t_stats, _ = timed(lambda: ds.insitu.stats(m, "train"), a.repeat)
        m.set_validity("train", None)
        t_epoch, n = timed(lambda: sum(len(b["t2m"]) for b in ds.insitu.batches(
            m, "train", batch_size=256, shuffle=False, output="numpy", patch=patch)), a.repeat)
        t_valid, r = timed(lambda: ds.insitu.validity(m, "train", patch=patch), a.repeat)
        t_masked, k = timed(lambda: sum(len(b["t2m"]) for b in ds.insitu.batches(
            m, "train", batch_size=256, output="numpy", patch=patch)), a.repeat)
        print(f"archive {a.nt} x 32 x 64, patch {a.patch}x{a.patch}: {r['valid']} of {r['total']} samples valid")
        print(f"stats        {t_stats:7.2f} s")
        print(f"epoch        {t_epoch:7.2f} s  ({n} samples, unshuffled, no mask)")
        print(f"validity     {t_valid:7.2f} s  (validity / epoch = {t_valid / t_epoch:.2f})")
        print(f"masked epoch {t_masked:7.2f} s  ({k} valid samples, shuffled)")
    rng = np.random.default_rng(0)
    for name, mask in [("random 50 %", rng.random(10**7) < 0.5), ("random 5 % invalid", rng.random(10**7) < 0.95),
                       ("runs of 10^4", np.repeat(np.arange(1000) % 2 == 0, 10**4))]:
        print(f"10^7-sample mask, {name:20s}: {len(json.dumps(encode_mask(mask))) / 1e6:.3f} MB of JSON")


if __name__ == "__main__":
    main()
