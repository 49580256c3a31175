"""The resumable state of a ``BatchGenerator``: a few JSON-able fields.

Like grain's elastic iterator, the state is where the next batch starts (epoch, batches
already yielded) plus what defines the order, so a mismatch is caught on load. The
shuffle buffer's contents are never saved: resuming re-reads the block it was in.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

STATE_VERSION = 1

# what must match for the saved position to mean the same batches
_DEFINING = ("split", "manifest", "seed", "batch_size", "shuffle", "block_chunks", "drop_last",
             "world_size", "rank", "sampling", "normalize")


def _sampling(gen: Any) -> str:
    dims = [[d.name, d.width, d.stride, d.keep, d.split] for d in gen.space.dims]
    return hashlib.sha256(json.dumps(dims).encode()).hexdigest()[:16]


def _normalize_id(gen: Any) -> str | None:
    """Which normalisation statistics the batches use (a hash; None without normalisation)."""
    stats = getattr(gen, "normalize", None)
    if stats is None:
        return None
    return hashlib.sha256(json.dumps(stats, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _manifest_id(gen: Any) -> str:
    """Which manifest and split: a hash of the geometry fingerprint and the split's block runs
    (the runs' hash is computed once per split, so a state of a 10^7-chunk split costs no pass)."""
    from xinsitu.split import Blocks

    m = gen.manifest
    blob = json.dumps({"fp": m.fingerprint, "blocks": Blocks.from_ids(m.splits[gen.split]).digest()})
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def make_state(gen: Any, epoch: int, batch: int) -> dict[str, Any]:
    return {"version": STATE_VERSION, "epoch": int(epoch), "batch": int(batch), "split": gen.split,
            "manifest": _manifest_id(gen), "seed": gen.seed, "batch_size": gen.batch_size,
            "shuffle": gen.shuffle, "block_chunks": gen.block_chunks, "drop_last": gen.drop_last,
            "world_size": gen.world_size, "rank": gen.rank, "sampling": _sampling(gen),
            "normalize": _normalize_id(gen)}


def check_state(gen: Any, state: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming every field where ``state`` was made differently."""
    if not isinstance(state, dict) or "epoch" not in state or "batch" not in state:
        raise ValueError("not an xinsitu BatchGenerator state (needs 'epoch' and 'batch')")
    if not isinstance(state.get("version", 0), int) or state.get("version", 0) > STATE_VERSION:
        raise ValueError(f"state version {state['version']!r} is newer than this xinsitu understands")
    for k in ("epoch", "batch"):
        if not isinstance(state[k], int) or isinstance(state[k], bool) or state[k] < 0:
            raise ValueError(f"state {k} must be a non-negative integer, got {state[k]!r}")
    mine = make_state(gen, state["epoch"], state["batch"])
    diff = [f"{k} (saved {state.get(k)!r}, here {mine[k]!r})" for k in _DEFINING if state.get(k) != mine[k]]
    if diff:
        raise ValueError("state was saved with a different " + ", ".join(diff))
    n = gen.plan(state["epoch"]).n_batches
    if state["batch"] > n:
        raise ValueError(f"state batch {state['batch']} is past the end of epoch {state['epoch']} ({n} batches)")
