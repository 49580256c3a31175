"""Valid samples only: one streaming pass that marks which samples of a split are valid.

Layer 3. ``compute_validity`` reads the split's samples once, unshuffled, through a
``BatchGenerator`` (the same reader and buffers as training: each chunk once, memory bounded by
``block_chunks``), tests each batch (``"finite"``: no NaN or inf anywhere in the sample as the
generator yields it; or a user predicate on the ``xarray`` batch) and stores the result in the
manifest as a compact bitmap (``manifest.encode_mask``), with the sampling options it was made
for. Generators of that split with the same options then draw only valid samples
(``sampling.sampling(valid_only=True)``); other options raise ``ValueError``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import xarray as xr

from xinsitu.batches.generator import BatchGenerator
from xinsitu.cache.chunk_cache import ChunkCache
from xinsitu.index.manifest import SplitManifest, encode_mask
from xinsitu.index.sampling import check_split, positive_int, sampling, sampling_key

#: samples tested at once (one batch of the pass) at most, and the bytes such a batch may hold:
#: a batch of large patches is cut smaller, so the pass stays within a few buffers' memory
PASS_BATCH = 4096
PASS_BYTES = 64 * 2**20


def _pass_batch(ds: xr.Dataset, manifest: SplitManifest, split: str, **kw: Any) -> int:
    """Samples per batch of the pass: ``PASS_BATCH``, fewer where samples are large."""
    sp = sampling(ds, manifest, split, **kw)
    width = {d.name: d.width for d in sp.space.dims}
    nbytes = sum(int(np.prod([width.get(d, n) for d, n in zip(src.dims, src.shape, strict=True)]))
                 * src.dtype.itemsize for src in sp.sources.values())
    return max(1, min(PASS_BATCH, PASS_BYTES // max(nbytes, 1)))


def _finite(batch: dict[str, np.ndarray], n: int) -> np.ndarray:
    ok = np.ones(n, dtype=bool)
    for a in batch.values():
        a = np.asarray(a)
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.complexfloating)):
            continue  # integers and bools hold no NaN
        if a.ndim and a.shape[0] == n:
            ok &= np.isfinite(a).reshape(n, -1).all(axis=1)
        else:  # a variable without a sample axis (static): it spoils every sample or none
            ok &= bool(np.isfinite(a).all())
    return ok


def _predicate(fn: Callable[[xr.Dataset], Any], batch: xr.Dataset, n: int) -> np.ndarray:
    got = np.asarray(fn(batch))
    if got.shape != (n,):
        raise ValueError(f"where: the predicate must return one bool per sample, shape ({n},), "
                         f"got shape {got.shape}")
    if got.dtype != bool:
        raise ValueError(f"where: the predicate must return bools (dtype bool), got dtype {got.dtype}")
    return got


def compute_validity(ds: xr.Dataset, manifest: SplitManifest, split: str, where: Any = "finite",
                     variables: Any = None, *, window: Any = None, patch: Any = None, stride: Any = None,
                     over: Any = None, block_chunks: int = 16, max_inflight: int | None = None,
                     cache: bool | str | os.PathLike[str] | ChunkCache | None = None) -> dict[str, Any]:
    """Mark the valid samples of ``split`` and store the mask in ``manifest`` (see the accessor's
    ``validity``); returns ``{"split", "valid", "total", "where", "sampling"}``."""
    check_split(manifest, split)
    if isinstance(where, str):
        if where != "finite":
            raise ValueError(f"where must be 'finite' or a callable predicate, got {where!r}")
        label, output = "finite", "numpy"
    elif callable(where):
        label, output = "fn:" + getattr(where, "__qualname__", type(where).__name__), "xarray"
    else:
        raise TypeError(f"where must be 'finite' or a callable predicate, got {type(where).__name__} {where!r}")
    block_chunks = positive_int("block_chunks", block_chunks)
    # the pass sees every sample: a mask already there must not hide any
    plain = copy.copy(manifest)
    plain.validity = {k: v for k, v in manifest.validity.items() if k != split}
    size = _pass_batch(ds, plain, split, window=window, patch=patch, stride=stride, over=over, variables=variables,
                       stacklevel=4)
    gen = BatchGenerator(ds, plain, split, batch_size=size, shuffle=False, window=window, patch=patch,
                         stride=stride, over=over, variables=variables, output=output,
                         block_chunks=block_chunks, max_inflight=max_inflight, rank=0, world_size=1,
                         cache=cache)
    key = sampling_key(window, patch, stride, over, gen.geometry.sizes)
    total = gen.space.n_samples
    mask = np.zeros(total, dtype=bool)
    pos = 0
    for batch in gen:  # unshuffled, one rank: global ids 0, 1, 2, ... in order
        n = min(size, total - pos)
        mask[pos:pos + n] = _finite(batch, n) if output == "numpy" else _predicate(where, batch, n)
        pos += n
    if pos != total:  # the generator yields every sample of an unshuffled one-rank epoch
        raise RuntimeError(f"validity pass saw {pos} of {total} samples")
    record = {"where": label, "variables": list(gen.layouts), "sampling": key, **encode_mask(mask)}
    manifest.set_validity(split, record)
    return {"split": split, "valid": record["valid"], "total": total, "where": label, "sampling": key}
