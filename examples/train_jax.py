"""Train a tiny JAX model from ``ds.insitu.batches(output="jax")`` (the JAX twin of train_demo.py).

    python examples/train_jax.py [ARCHIVE] [--epochs N] [--batch-size B]

With no ARCHIVE, a small synthetic ERA5-like Zarr v3 archive is written to
``data/era5_demo.zarr`` first. The model (two 3x3 convolutions in plain ``jax.numpy`` /
``jax.lax``, trained by SGD with momentum, no other library) predicts t2m from u10, v10,
z500 and tp. Statistics come from the train split only (``ds.insitu.stats``);
``transform=`` collates each normalised batch into ``(x, y)`` float32 arrays in the
loader's background thread, and ``output="jax"`` puts them on jax's default device.
Needs ``pip install 'xinsitu[jax]'``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import xinsitu
from xinsitu.synthetic import write_era5_like

INPUTS = ["u10", "v10", "z500", "tp"]
TARGET = "t2m"


def to_xy(batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Normalised numpy batch -> (x: (B, C, H, W), y: (B, 1, H, W)) float32, NaN (missing tp) as 0.

    A module-level function, so that it pickles (DataLoader workers under spawn)."""
    x = np.stack([batch[v] for v in INPUTS], axis=1).astype(np.float32)
    y = batch[TARGET][:, None].astype(np.float32)
    return np.nan_to_num(x), y


def init(key: jax.Array, c_in: int, hidden: int = 16) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (hidden, c_in, 3, 3)) * (2.0 / (9 * c_in)) ** 0.5,
            "b1": jnp.zeros((hidden,)),
            "w2": jax.random.normal(k2, (1, hidden, 3, 3)) * (1.0 / (9 * hidden)) ** 0.5,
            "b2": jnp.zeros((1,))}


def conv(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return y + b[None, :, None, None]


def model(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return conv(jax.nn.relu(conv(x, p["w1"], p["b1"])), p["w2"], p["b2"])


def loss_fn(p: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(p, x) - y) ** 2)


@jax.jit
def step(p: Any, v: Any, x: jax.Array, y: jax.Array, lr: float = 0.01, mu: float = 0.9) -> tuple[Any, Any, Any]:
    loss, g = jax.value_and_grad(loss_fn)(p, x, y)
    v = jax.tree_util.tree_map(lambda v_, g_: mu * v_ + g_, v, g)
    p = jax.tree_util.tree_map(lambda p_, v_: p_ - lr * v_, p, v)
    return p, v, loss


eval_loss = jax.jit(loss_fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("archive", nargs="?", help="URL or path of a Zarr archive with the variables above")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--nt", type=int, default=1460, help="time steps of the synthetic archive")
    a = ap.parse_args()

    path = a.archive
    if path is None:
        path = os.path.join("data", "era5_demo.zarr")
        if not os.path.exists(path):
            write_era5_like(path, nt=a.nt, ny=32, nx=64, chunk_time=24)
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1}, gap=1)
    variables = INPUTS + [TARGET]
    stats = ds.insitu.stats(m, "train", variables=variables)  # train split only: no leakage
    kw: dict[str, Any] = dict(output="jax", variables=variables, normalize=stats, transform=to_xy)
    train = ds.insitu.batches(m, "train", batch_size=a.batch_size, **kw)
    val = ds.insitu.batches(m, "val", batch_size=64, shuffle=False, **kw)
    print(f"jax {jax.__version__} on {jax.devices()[0]}; {len(train)} train batches per epoch")

    params = init(jax.random.PRNGKey(0), len(INPUTS))
    vel = jax.tree_util.tree_map(jnp.zeros_like, params)
    for epoch in range(a.epochs):
        train.set_epoch(epoch)
        t0, n, total = time.perf_counter(), 0, 0.0
        for x, y in train:  # jax arrays already, collated off this thread
            params, vel, loss = step(params, vel, x, y)
            n += x.shape[0]
            total += float(loss) * x.shape[0]
        dt = time.perf_counter() - t0
        vl = np.mean([float(eval_loss(params, x, y)) for x, y in val])
        print(f"epoch {epoch}: {n} samples in {dt:.2f}s = {n / dt:.0f} samples/s, waited "
              f"{train.io_stats['wait_s']:.2f}s for data; train loss {total / max(n, 1):.4f}, val loss {vl:.4f}")


if __name__ == "__main__":
    main()
