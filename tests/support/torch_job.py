"""Run epochs of ``gen.to_torch()`` through a torch DataLoader in a fresh process, and
write what came out (each batch's sample timestamps and a digest of its values) as JSON.

Run by tests/batches/test_torch.py under a timeout (a hang fails the test, never freezes CI)::

    python -m tests.support.torch_job ARCHIVE OUT.json --workers 2 --method spawn [--open xr] ...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback
import warnings
from typing import Any

import numpy as np

warnings.filterwarnings("ignore", message=".*[Cc]onsolidated metadata.*")


def passthrough(batch: Any) -> Any:
    """DataLoader collate that keeps the xarray batch as it is (module level: picklable)."""
    return batch


def record(batch: Any) -> dict[str, Any]:
    """Sample timestamps and a digest of every value of one xarray batch."""
    h = hashlib.sha256()
    for v in sorted(batch.data_vars):
        h.update(np.ascontiguousarray(batch[v].values).tobytes())
    return {"times": batch.time.values.astype("int64").tolist(), "sha": h.hexdigest()}


def open_archive(path: str, how: str) -> Any:
    import xarray as xr

    import xinsitu

    if how == "xinsitu":
        return xinsitu.open_zarr(path)  # obstore: not usable in a forked child
    if how == "xr":
        return xr.open_zarr(path, chunks=None)  # zarr LocalStore: plain file reads after fork
    if how == "nc":  # a NetCDF file read through dask (xinsitu computes the dask chunks it needs)
        return xr.open_dataset(path, chunks={"time": 8})
    if how == "keylog":
        from tests.support.keylog import KeyLogStore

        return xr.open_zarr(KeyLogStore(path, read_only=True), chunks=None)
    raise SystemExit(f"unknown --open {how}")


def make_dataset(args: argparse.Namespace, rank: int = 0, world_size: int = 1) -> Any:
    ds = open_archive(args.archive, args.open)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    gen = ds.insitu.batches(m, "train", batch_size=args.batch_size, block_chunks=args.block_chunks,
                            output="xarray", seed=args.seed, variables=args.variables, rank=rank, world_size=world_size,
                            cache=None if args.cache is None else (True if args.cache == "memory" else args.cache))
    return gen, gen.to_torch()


def loader(dset: Any, args: argparse.Namespace, stateful: bool = False) -> Any:
    from torch.utils.data import DataLoader

    kw: dict[str, Any] = dict(batch_size=None, num_workers=args.workers, collate_fn=passthrough)
    if args.workers:
        kw.update(multiprocessing_context=args.method, persistent_workers=args.persistent)
    if stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(dset, **kw)
    return DataLoader(dset, **kw)


def run_epochs(args: argparse.Namespace) -> dict[str, Any]:
    gen, dset = make_dataset(args)
    if args.touch:  # use the store in this process first (obstore runtime and I/O loop running)
        next(iter(gen))
    if args.warm:  # a whole epoch in this process first, as a user checking the data would
        for _ in gen:
            pass
    if args.resume_at:  # a state saved in this process after that many batches, loaded into a new dataset
        it = iter(gen)
        for _ in range(args.resume_at):
            next(it)
        state = json.loads(json.dumps(gen.state_dict()))
        it.close()
        gen, dset = make_dataset(args)
        dset.load_state_dict(state)
    dl = loader(dset, args)
    out: dict[str, Any] = {"len": len(dset), "epochs": []}
    for e in range(args.epochs):
        if not args.resume_at or e:
            (gen if args.gen_epoch else dset).set_epoch(e)  # the generator's own, as SPEC's loop calls it
        out["epochs"].append([record(b) for b in dl])
        if args.again and not e:  # the same epoch again, without set_epoch
            out["again"] = [record(b) for b in dl]
        log = os.environ.get("XINSITU_TEST_KEYLOG")
        if log and os.path.exists(log):
            os.replace(log, f"{log}.{e}")  # the next epoch's reads go to a new file
    return out


def run_stateful(args: argparse.Namespace) -> dict[str, Any]:
    """Save a StatefulDataLoader's state after ``--stop`` batches (through JSON, like a
    checkpoint), resume a new loader from it, and run the next epoch on both."""
    _, dset = make_dataset(args)
    before = []
    if args.elastic_from:  # first a run of that world size: 2 batches per rank, in lockstep; rank 0's state
        gens = [make_dataset(args, r, args.elastic_from)[0] for r in range(args.elastic_from)]
        its = [iter(g) for g in gens]
        before = [record(next(it)) for _ in range(2) for it in its]
        dset.load_state_dict(json.loads(json.dumps(gens[0].state_dict())))
    dl = loader(dset, args, stateful=True)
    ref, state = [], None
    for i, b in enumerate(dl):
        ref.append(record(b))
        if i + 1 == args.stop:
            state = json.loads(json.dumps(dl.state_dict()))
    dset.set_epoch(1)
    ref_next = [record(b) for b in dl]
    _, dset2 = make_dataset(args)
    dl2 = loader(dset2, args, stateful=True)
    dl2.load_state_dict(state)
    resumed = [record(b) for b in dl2]
    dset2.set_epoch(1)
    resumed_next = [record(b) for b in dl2]
    return {"len": len(dset), "ref": ref, "ref_next": ref_next, "resumed": resumed, "resumed_next": resumed_next,
            "before": before}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("archive")
    p.add_argument("out")
    p.add_argument("--open", default="xr", choices=["xinsitu", "xr", "keylog", "nc"])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--method", default="spawn", choices=["spawn", "forkserver", "fork"])
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--gen-epoch", action="store_true", help="gen.set_epoch(e), not the dataset's")
    p.add_argument("--resume-at", type=int, default=0, help="first load a state saved after this many batches")
    p.add_argument("--again", action="store_true", help="iterate the first epoch twice")
    p.add_argument("--touch", action="store_true")
    p.add_argument("--warm", action="store_true")
    p.add_argument("--stateful", action="store_true")
    p.add_argument("--stop", type=int, default=3)
    p.add_argument("--elastic-from", type=int, default=0, help="--stateful: resume a run of this world size first")
    p.add_argument("--batch-size", type=int, default=5)
    p.add_argument("--block-chunks", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variables", nargs="*", default=["t2m", "tp"])
    p.add_argument("--cache", help="'memory' or a directory: cache= of the generator")
    args = p.parse_args()
    t0 = time.perf_counter()
    try:
        result = run_stateful(args) if args.stateful else run_epochs(args)
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    result["seconds"] = time.perf_counter() - t0
    with open(args.out, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
