"""The main job: split an archive in place and train a tiny model from ``ds.insitu.batches()``.

    python examples/train_demo.py [ARCHIVE] [--epochs N] [--batch-size B]

With no ARCHIVE, a small synthetic ERA5-like Zarr v3 archive is written to
``data/era5_demo.zarr`` first (time x lat x lon, float32 t2m/u10/v10/z500 and an
int16-packed tp). The model predicts t2m from the other variables.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

import xinsitu
from xinsitu.synthetic import write_era5_like

INPUTS = ["u10", "v10", "z500", "tp"]
TARGET = "t2m"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("archive", nargs="?", help="URL or path of a Zarr archive with the variables above")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--nt", type=int, default=1460, help="time steps of the synthetic archive")
    a = ap.parse_args()

    path, consolidated = a.archive, None  # None: consolidated metadata where the archive has it
    if path is None:
        consolidated = False
        path = os.path.join("data", "era5_demo.zarr")
        if not os.path.exists(path):
            t = time.perf_counter()
            write_era5_like(path, nt=a.nt, ny=32, nx=64, chunk_time=24, consolidated=False)  # local: no need
            print(f"wrote synthetic archive {path} in {time.perf_counter() - t:.1f}s")
    ds = xinsitu.open_zarr(path, consolidated=consolidated)
    print(ds.insitu.geometry)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1}, gap=1)
    print(m.summary())

    variables = INPUTS + [TARGET]
    train = ds.insitu.batches(m, "train", batch_size=a.batch_size, output="torch", variables=variables)
    val = ds.insitu.batches(m, "val", batch_size=64, output="torch", shuffle=False, variables=variables)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(len(INPUTS), 16, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(16, 1, 3, padding=1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def xy(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.stack([batch[v].float() for v in INPUTS], dim=1)
        x = torch.nan_to_num((x - x.mean(dim=(0, 2, 3), keepdim=True)) / (x.std(dim=(0, 2, 3), keepdim=True) + 1e-6))
        y = batch[TARGET].float().unsqueeze(1)
        return x, (y - 273.15) / 20.0

    for epoch in range(a.epochs):
        train.set_epoch(epoch)
        t0, n, loss_sum = time.perf_counter(), 0, 0.0
        for batch in train:
            x, y = xy(batch)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            n += x.shape[0]
            loss_sum += loss.item() * x.shape[0]
        dt = time.perf_counter() - t0
        io = train.io_stats
        with torch.no_grad():
            vl = [float(torch.nn.functional.mse_loss(model(x), y)) for x, y in map(xy, val)]
        print(f"epoch {epoch}: {n} samples in {dt:.2f}s = {n / dt:.0f} samples/s, "
              f"{io['bytes_decoded'] / dt / 1e6:.1f} MB/s decoded ({io['chunks']} chunks read once each), "
              f"waited {io['wait_s']:.2f}s for data; train loss {loss_sum / max(n, 1):.4f}, "
              f"val loss {np.mean(vl):.4f}")

    # the loader alone, with no model step: how fast the archive can feed training
    train.set_epoch(a.epochs)
    t0 = time.perf_counter()
    n = sum(b[TARGET].shape[0] for b in train)
    dt = time.perf_counter() - t0
    print(f"loader alone: {n / dt:.0f} samples/s, {train.io_stats['mb_per_s']:.1f} MB/s")


if __name__ == "__main__":
    main()
