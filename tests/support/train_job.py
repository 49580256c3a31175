"""A small training job for the resume tests: it checkpoints the generator's state after
every batch and logs every batch it trains on. Run by tests/batches/test_resume.py::

    python -m tests.support.train_job ARCHIVE WORKDIR [--resume] [--hang-after I]

``--hang-after I``: after the checkpoint of batch I (epoch 0), print ``CKPT I`` and wait
(the prefetch keeps reading) until the test kills the process with SIGKILL.
``--resume``: load WORKDIR/ckpt.json first, then carry on to the end of the last epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore", message=".*[Cc]onsolidated metadata.*")

EPOCHS = 2


def make_gen(archive: str):  # noqa: ANN201 - a BatchGenerator
    import xinsitu

    ds = xinsitu.open_zarr(archive)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    return ds.insitu.batches(m, "train", batch_size=5, block_chunks=2, seed=7, output="xarray",
                             window={"time": 2}, variables=["t2m", "tp"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("archive")
    p.add_argument("workdir")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--hang-after", type=int, default=-1)
    args = p.parse_args()
    from tests.support.resume_check import record

    ckpt = os.path.join(args.workdir, "ckpt.json")
    log = open(os.path.join(args.workdir, "resumed.jsonl" if args.resume else "first.jsonl"), "a")
    gen = make_gen(args.archive)
    start_epoch = 0
    if args.resume:
        with open(ckpt) as f:
            state = json.load(f)
        gen.load_state_dict(state)
        start_epoch = state["epoch"]
    for epoch in range(start_epoch, EPOCHS):
        gen.set_epoch(epoch)
        for batch in gen:
            # "train", then checkpoint: the state after this batch, written atomically
            log.write(json.dumps({"epoch": epoch, **record(batch)}) + "\n")
            log.flush()
            tmp = ckpt + ".tmp"
            with open(tmp, "w") as f:
                json.dump(gen.state_dict(), f)
            os.replace(tmp, ckpt)
            if epoch == 0 and gen.state_dict()["batch"] == args.hang_after + 1:
                print(f"CKPT {args.hang_after}", flush=True)
                while True:  # mid-epoch, reads in flight: wait to be killed
                    time.sleep(1)
    log.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
