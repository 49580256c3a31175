"""Run one epoch of a generator over an archive with a chunk that keeps failing, in a fresh
process (in process, or through a torch DataLoader with workers), and write what came out
as JSON: how many batches, and the error (type, message, and the variable, chunk and key
it names).

Run by tests/io/test_unreadable.py under a timeout (a hang fails the test, never freezes CI)::

    python -m tests.support.fault_job ARCHIVE OUT.json [--workers 2 --method fork] [--open xr] [--options JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings
from datetime import timedelta
from typing import Any

warnings.filterwarnings("ignore", message=".*[Cc]onsolidated metadata.*")

# a generator with the defaults (block_chunks=16: a split of more than 48 chunks has more
# shuffle blocks than the read-ahead holds)
GEN = {"batch_size": 16, "output": "numpy", "seed": 1}
# quick retries (persistent 5xx are retried, then raise)
FAST = {"retry_config": {"max_retries": 3, "backoff": {"init_backoff": timedelta(milliseconds=5),
                                                       "max_backoff": timedelta(milliseconds=50)}},
        "client_options": {"timeout": "2s"}}


def make_gen(archive: str, how: str = "xinsitu", fast: bool = False, window: int = 1) -> Any:
    import xarray as xr

    import xinsitu

    ds = xinsitu.open_zarr(archive, **(FAST if fast else {})) if how == "xinsitu" else xr.open_zarr(archive,
                                                                                                    chunks=None)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    return ds.insitu.batches(m, "train", **GEN, window={"time": window} if window > 1 else None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    gen = make_gen(args.archive, args.open, args.fast, args.window)
    n = 0
    try:
        if args.workers:
            from torch.utils.data import DataLoader

            dl = DataLoader(gen.to_torch(), batch_size=None, num_workers=args.workers,
                            multiprocessing_context=args.method)
            for _ in dl:
                n += 1
        else:
            for _ in gen:
                n += 1
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"batches": n, "error": type(e).__name__, "message": str(e), "var": getattr(e, "var", None),
                "chunk": list(getattr(e, "chunk", None) or []) or None, "key": getattr(e, "key", None)}
    return {"batches": n, "error": None}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("archive")
    p.add_argument("out")
    p.add_argument("--open", default="xinsitu", choices=["xinsitu", "xr"])
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--method", default="fork", choices=["spawn", "forkserver", "fork"])
    p.add_argument("--window", type=int, default=1, help="windows along time (blocks pass chunks on)")
    p.add_argument("--fast", action="store_true", help="quick retries (remote stores)")
    args = p.parse_args()
    try:
        result = run(args)
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = {"setup_error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    with open(args.out, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    # the report is written: leave without interpreter teardown. Under a loaded full suite a process
    # that ends right after an epoch raised has aborted (SIGABRT, nothing on stderr) during teardown,
    # after its report; that teardown crash is tracked apart from what this job tests (no hang, the
    # error named).
    os._exit(0)


if __name__ == "__main__":
    main()
