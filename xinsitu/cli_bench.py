"""What ``python -m xinsitu bench`` measures beside the loader: the *raw* pass (every stored object the
split's chunk blocks touch, fetched once through the loader's own backend, not decoded), and the
verdict that compares the two: the store, the decoding or the model."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import numpy as np


def _chunk_coords(src: Any, manifest: Any, split: str) -> set[tuple[int, ...]]:
    """Coordinates (in the stored array's grid of objects) of every object the split's chunk
    blocks touch in variable ``src``: each one once."""
    grid_shape = tuple(src.array.shards) if getattr(src.array, "shards", None) else tuple(src.chunk_shape)
    per_dim: list[np.ndarray | None] = []  # chunk id of each selected position, per source dim
    for ax, ix in enumerate(src.index):
        per_dim.append(None if isinstance(ix, (int, np.integer)) else np.asarray(ix, np.int64) // grid_shape[ax])
    whole = [np.array([int(ix) // grid_shape[ax]]) if (d := per_dim[ax]) is None else np.unique(d)
             for ax, ix in enumerate(src.index)]
    split_axes = {d: src.src_dims.index(d) for d in manifest.dims if d in src.dims}
    if not split_axes:  # a variable without the split dims is read whole, once
        return set(itertools.product(*[w.tolist() for w in whole]))
    edges = {d: np.asarray(manifest.edges[d], np.int64) for d in manifest.dims}
    out: set[tuple[int, ...]] = set()
    blocks = np.unravel_index(manifest.blocks(split), manifest.grid)
    for b in range(len(blocks[0]) if blocks else 0):
        axes = [w.tolist() for w in whole]
        for k, d in enumerate(manifest.dims):
            if d in split_axes:
                ax, c = split_axes[d], int(blocks[k][b])
                ids = per_dim[ax]
                assert ids is not None
                axes[ax] = np.unique(ids[edges[d][c]:edges[d][c + 1]]).tolist()
        out.update(itertools.product(*axes))
    return out


def raw_keys(gen: Any) -> list[tuple[Any, str]]:
    """``[(zarr store, key)]`` of every stored object the generator's split needs, each once.

    Parameters
    ----------
    gen : BatchGenerator

    Returns
    -------
    list of (store, str)
    """
    keys = []
    for src in gen.sources.values():
        if not src.stored:
            continue
        meta = src.array.metadata
        for coords in sorted(_chunk_coords(src, gen.manifest, gen.split)):
            key = meta.encode_chunk_key(coords)
            keys.append((src.array.store, f"{src.array.path}/{key}" if src.array.path else key))
    return keys


def raw_pass(keys: list[tuple[Any, str]], max_inflight: int) -> dict[str, Any]:
    """Fetch every object once through the loader's backend (no decoding); time it.

    Parameters
    ----------
    keys : list of (store, str)
        From :func:`raw_keys`.
    max_inflight : int
        Requests in flight at once.

    Returns
    -------
    dict
        ``objects``, ``missing``, ``bytes``, ``seconds``, ``mb_per_s``, ``requests_per_s``.
    """
    from xinsitu.io import loop as _loop
    from xinsitu.stores.backend import backend_for

    backends: dict[int, Any] = {}

    async def go() -> tuple[int, int]:
        sem = asyncio.Semaphore(max_inflight)
        nbytes = missing = 0

        async def one(store: Any, key: str) -> None:
            nonlocal nbytes, missing
            be = backends.setdefault(id(store), backend_for(store))
            async with sem:
                raw = await be.get(key)
            if raw is None:
                missing += 1
            else:
                nbytes += len(raw)

        await asyncio.gather(*(one(s, k) for s, k in keys))
        return nbytes, missing

    t0 = time.perf_counter()
    nbytes, missing = _loop.run(go())
    dt = time.perf_counter() - t0
    return {"objects": len(keys), "missing": missing, "bytes": nbytes, "seconds": dt,
            "mb_per_s": nbytes / dt / 1e6 if dt > 0 else 0.0, "requests_per_s": len(keys) / dt if dt > 0 else 0.0}


def verdict(raw: dict[str, Any] | None, io: dict[str, Any], batch_size: int, step_ms: float | None) -> list[str]:
    """Plain sentences naming the likely bottleneck.

    Parameters
    ----------
    raw : dict or None
        :func:`raw_pass` result (None for an in-memory dataset).
    io : dict
        ``gen.io_stats`` of the loader pass.
    batch_size : int
    step_ms : float, optional
        The model's time per training step, in ms.

    Returns
    -------
    list of str
    """
    out = []
    per_batch = 1000 * io["seconds"] / max(io["batches"], 1)
    if raw is not None and io["seconds"] > 0:
        share = raw["seconds"] / io["seconds"]
        if share >= 0.6:
            out.append(f"Fetching alone takes {100 * share:.0f}% of the loader's time: the store (network or "
                       "disk) limits the loader; more requests in flight (--max-inflight) or a store closer to "
                       "the compute would help.")
        else:
            out.append(f"Fetching alone takes {100 * share:.0f}% of the loader's time: decoding and gathering "
                       "(CPU) limit the loader; more cores or a lighter compressor would help.")
    if step_ms is None:
        out.append(f"The loader feeds a batch of {batch_size} every {per_batch:.1f} ms. A model step slower "
                   f"than that makes the model the bottleneck (the data is always ready); a faster one waits "
                   "on the store. Pass --step-ms to compare with your model.")
    elif step_ms >= per_batch:
        out.append(f"Model-bound: a step takes {step_ms:g} ms and the loader needs {per_batch:.1f} ms per batch, "
                   "so the data is ready before the model asks for it.")
    else:
        out.append(f"Store-bound: a step takes {step_ms:g} ms but the loader needs {per_batch:.1f} ms per batch; "
                   f"the model would wait about {per_batch - step_ms:.1f} ms per step for data.")
    return out
