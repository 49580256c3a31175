"""The resumable state of a ``BatchGenerator``: a few JSON-able fields.

Like grain's elastic iterator, the state is where the next batch starts (epoch, batches
already yielded) plus what defines the order, so a mismatch is caught on load. The
shuffle buffer's contents are never saved: resuming re-reads the block it was in. The channel
names are recorded, so a generator with another channel order refuses the state. A state
loads elastically into a run of another world size: ``elastic`` then lists the earlier runs
of the epoch as ``[world_size, batches]``, from which ``plan.segment_plan`` recomputes what is
left (no sample list is saved).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, cast

from xinsitu.index.plan import segment_plan

#: 2: a shuffled epoch visits the units in the order of ``shuffle.units_at`` (a keyed bijection
#: evaluated per position, so a rank computes only its share); version 1 states were saved with
#: the earlier order (a NumPy permutation of every unit), which this xinsitu no longer makes.
#: 3: a shuffled epoch whose tiles spill over several split dims visits the units in the order of
#: ``shuffle.neighbour_order_nd`` (version 2: as any shuffled epoch without spills)
STATE_VERSION = 3

# what must match for the saved position to mean the same batches
_DEFINING = ("split", "manifest", "seed", "batch_size", "shuffle", "block_chunks", "drop_last",
             "world_size", "rank", "sampling", "normalize", "valid")


def _sampling(gen: Any) -> str:
    dims = [[d.name, d.width, d.stride, d.keep, d.split] for d in gen.space.dims]
    return hashlib.sha256(json.dumps(dims).encode()).hexdigest()[:16]


def _sampled(gen: Any) -> dict[str, list[Any]]:
    """The sampled dims in words, as a state records them beside their digest (``_sampling``): per dim
    ``[window or patch length, stride, kept whole in the output, a split dim]``."""
    return {d.name: [int(d.width), int(d.stride), bool(d.keep), bool(d.split)] for d in gen.space.dims}


def _sampling_diff(saved: Any, here: dict[str, list[Any]]) -> str:
    """What differs between two states' sampled dims, per dim, in words."""
    if not isinstance(saved, dict):
        return ""

    def words(v: Any) -> str:
        if not isinstance(v, list) or len(v) != 4:
            return "not sampled"
        return (f"{'split, ' if v[3] else ''}{'window/patch' if v[2] else 'one position'} of {v[0]}"
                + (f", stride {v[1]}" if v[1] != 1 else ""))

    said = [f"{d!r}: saved {words(saved.get(d))}, here {words(here.get(d))}"
            for d in sorted(set(saved) | set(here), key=str) if saved.get(d) != here.get(d)]
    return "; ".join(said)


def _normalize_id(gen: Any) -> str | None:
    """Which normalisation statistics the batches use (a hash; None without normalisation)."""
    stats = getattr(gen, "normalize", None)
    if stats is None:
        return None
    return hashlib.sha256(json.dumps(stats, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _manifest_id(gen: Any) -> str:
    """Which manifest and split: a hash of the geometry fingerprint and the split's block runs
    (the runs' hash is computed once per split, so a state of a 10^7-chunk split costs no pass)."""
    from xinsitu.index.runs import Blocks

    m = gen.manifest
    blob = json.dumps({"fp": m.fingerprint, "blocks": Blocks.from_ids(m.splits[gen.split]).digest()})
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def make_state(gen: Any, epoch: int, batch: int) -> dict[str, Any]:
    return {"version": STATE_VERSION, "epoch": int(epoch), "batch": int(batch), "split": gen.split,
            "manifest": _manifest_id(gen), "seed": gen.seed, "batch_size": gen.batch_size,
            "shuffle": gen.shuffle, "block_chunks": gen.block_chunks, "drop_last": gen.drop_last,
            "world_size": gen.world_size, "rank": gen.rank, "sampling": _sampling(gen),
            "normalize": _normalize_id(gen),
            # the validity mask's digest (None: every sample): another mask is another sample space
            "valid": getattr(gen.space, "valid_digest", None), "channels": _channels(gen.channels),
            "elastic": _hops(gen, epoch), "sampled": _sampled(gen),
            # the split dims' lengths the manifest was made on: what a message names where the manifest differs
            "sizes": {str(d): int(n) for d, n in gen.manifest.sizes.items()}}


#: channel names a state lists in full; past this many, their count, a digest and the first and last few
#: (a field's lat/lon labels as channels -- a time-only variable beside it -- are 65k on a 1-degree grid)
MAX_STATE_CHANNELS = 256


def _channels(names: list[str]) -> list[str] | dict[str, Any]:
    """The channel order as a state records it: the names, or where they are many, what tells one order
    from another (a digest) and what a person reads of it (the count, the first and last names)."""
    if len(names) <= MAX_STATE_CHANNELS:
        return list(names)
    return {"n": len(names), "sha256": hashlib.sha256(json.dumps(names).encode()).hexdigest()[:16],
            "first": list(names[:4]), "last": list(names[-4:])}


def _hops(gen: Any, epoch: int) -> list[list[int]]:
    """The elastic resumes ``epoch`` went through so far: ``[world_size, batches]`` per earlier run
    (empty without one). With the seed and batch size they define the rest of the epoch; no
    sample list is ever saved."""
    if getattr(gen, "_elastic_epoch", -1) != epoch:
        return []
    return [[int(w), int(b)] for w, b in getattr(gen, "_elastic", [])]


def _check_order_version(gen: Any, state: dict[str, Any]) -> None:
    """Refuse a state saved before the current unit order where the order it resumes has changed: a
    shuffled epoch without windows that spill into the next unit (before version 2), or whose tiles
    spill over several split dims (before 3). An unshuffled epoch, or the neighbour order of windows
    spilling along one split dim, are what they were, so such a state resumes."""
    version = state.get("version", 1)
    sp = gen.space
    one_dim = sp.spills and len(sp.split_dims) == 1
    changed = (version < 2 and not one_dim) or (version < 3 and sp.spills and not one_dim)
    if not gen.shuffle or not changed:
        return
    raise ValueError(f"state was saved by an older xinsitu (state version {version}, this is {STATE_VERSION}): "
                     "its shuffled epochs visit chunk blocks in another order, so this xinsitu cannot resume "
                     "that order; start the epoch again (the saved epoch is "
                     f"{state['epoch']}: gen.set_epoch({state['epoch']})), or resume with the xinsitu that saved it")


def check_state(gen: Any, state: dict[str, Any], elastic: bool = False) -> None:
    """Raise ``ValueError`` naming every field where ``state`` was made differently.

    ``elastic=True``: the state may come from any rank of a run of any world size (it is then
    resumed elastically, see ``BatchGenerator.load_state_dict``); else rank and world size must match.
    """
    if not isinstance(state, dict) or "epoch" not in state or "batch" not in state:
        raise ValueError("not an xinsitu BatchGenerator state (needs 'epoch' and 'batch')")
    if not isinstance(state.get("version", 0), int) or state.get("version", 0) > STATE_VERSION:
        raise ValueError(f"state version {state['version']!r} is newer than this xinsitu understands")
    for k in ("epoch", "batch"):
        if not isinstance(state[k], int) or isinstance(state[k], bool) or state[k] < 0:
            raise ValueError(f"state {k} must be a non-negative integer, got {state[k]!r}")
    hops = state.get("elastic", [])
    if not isinstance(hops, list) or not all(
            isinstance(h, list) and len(h) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in h)
            and h[0] >= 1 and h[1] >= 0 for h in hops):
        raise ValueError(f"state elastic must be a list of [world_size, batches] pairs, got {hops!r}")
    _check_order_version(gen, state)
    saved_world = state.get("world_size")
    if elastic and (not isinstance(saved_world, int) or isinstance(saved_world, bool) or saved_world < 1):
        raise ValueError(f"state world_size must be a positive integer, got {saved_world!r}")
    mine = make_state(gen, state["epoch"], state["batch"])
    skip = ("world_size", "rank") if elastic else ()
    diff = [f"{k} (saved {state.get(k)!r}, here {mine[k]!r})" for k in _DEFINING
            if k not in skip and state.get(k) != mine[k]]
    saved_sizes = state.get("sizes")
    if state.get("manifest") != mine["manifest"] and isinstance(saved_sizes, dict) and saved_sizes != mine["sizes"]:
        grown = [f"{d!r} of length {saved_sizes.get(d)} then, {n} here" for d, n in mine["sizes"].items()
                 if saved_sizes.get(d) != n]
        cut = ", ".join(f"{d}=slice(0, {saved_sizes[d]})" for d, n in mine["sizes"].items()
                        if isinstance(saved_sizes.get(d), int) and saved_sizes[d] < n)
        hint = (f": the archive grew since; resume on ds.isel({cut}) with the manifest the state was saved with"
                if cut else "")
        diff = [f"manifest, made on {'; '.join(grown)}{hint}" if d.startswith("manifest (") else d for d in diff]
    if state.get("sampling") != mine["sampling"] and (dims := _sampling_diff(state.get("sampled"), mine["sampled"])):
        diff = [f"sampling ({dims})" if d.startswith("sampling (") else d for d in diff]
    if "channels" in state and state["channels"] != mine["channels"]:  # a state from before has none
        diff.append(f"channel order (saved {state['channels']}, here {mine['channels']})")
    if not elastic and hops != mine["elastic"]:
        diff.append(f"elastic resume (saved {hops}, here {mine['elastic']}); load it with "
                    "gen.load_state_dict (num_workers=0)")
    if diff:
        raise ValueError("state was saved with a different " + ", ".join(diff))
    # the saved run's plan (every rank of it yields as many batches)
    n = segment_plan(gen.space, [tuple(h) for h in hops], seed=gen.seed, epoch=state["epoch"], shuffle=gen.shuffle,
                     batch_size=gen.batch_size, block_chunks=gen.block_chunks, drop_last=gen.drop_last, rank=0,
                     world_size=cast(int, saved_world) if elastic else gen.world_size).n_batches
    if state["batch"] > n:
        raise ValueError(f"state batch {state['batch']} is past the end of epoch {state['epoch']} ({n} batches)")
