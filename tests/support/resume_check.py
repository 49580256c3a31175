"""A reusable resume check, after torchdata's ``run_test_save_load_state``: stop an epoch
after batch i, carry the state through JSON into a brand-new generator, and require the
rest of that epoch and the next epoch to equal the uninterrupted run, batch for batch
(sample order and values)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import xarray as xr


def record(batch: Any) -> dict[str, Any]:
    """What identifies a batch: its samples' coordinates (xarray outputs) and a digest of every value."""
    h = hashlib.sha256()
    out: dict[str, Any] = {}
    if isinstance(batch, xr.Dataset | xr.DataArray):
        out["coords"] = {c: batch[c].values.astype("int64" if batch[c].dtype.kind == "M" else batch[c].dtype)
                         .tolist() for c in batch.coords if "sample" in batch[c].dims}
        arrays = [batch.values] if isinstance(batch, xr.DataArray) else [batch[v].values for v in sorted(batch)]
    elif isinstance(batch, dict):
        arrays = [_numpy(batch[k]) for k in sorted(batch)]
    else:
        arrays = [_numpy(batch)]
    for a in arrays:
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    out["sha"] = h.hexdigest()
    return out


def _numpy(a: Any) -> np.ndarray:
    return a.numpy() if hasattr(a, "numpy") else np.asarray(a)


def epoch_records(batches: Iterable[Any]) -> list[dict[str, Any]]:
    return [record(b) for b in batches]


def run_test_save_load_state(make_gen: Callable[[], Any], midpoint: int, epochs: int = 2) -> dict[str, Any]:
    """Resume after batch ``midpoint`` of epoch 0; assert the tail and the next epochs match.

    ``make_gen`` builds a fresh generator (or a torch dataset/loader wrapper with
    ``set_epoch``, ``state_dict``, ``load_state_dict`` and iteration). Returns the state.
    """
    ref_gen = make_gen()
    ref = []
    for e in range(epochs):
        ref_gen.set_epoch(e)
        ref.append(epoch_records(ref_gen))
    assert 0 <= midpoint <= len(ref[0]), (midpoint, len(ref[0]))

    first = make_gen()
    first.set_epoch(0)
    it = iter(first)
    head = [record(next(it)) for _ in range(midpoint)]
    state = json.loads(json.dumps(first.state_dict()))  # a checkpoint is JSON on disk
    it.close() if hasattr(it, "close") else None
    assert head == ref[0][:midpoint]
    assert (state["epoch"], state["batch"]) == (0, midpoint), state

    resumed = make_gen()
    resumed.load_state_dict(state)
    for e in range(epochs):
        resumed.set_epoch(e)  # what a training loop does: same epoch keeps the saved place
        got = epoch_records(resumed)
        exp = ref[e][midpoint:] if e == 0 else ref[e]
        assert len(got) == len(exp), (e, len(got), len(exp))
        for k, (g, x) in enumerate(zip(got, exp, strict=True)):
            assert g == x, f"epoch {e}: batch {k + (midpoint if e == 0 else 0)} differs after resuming"
    return state
