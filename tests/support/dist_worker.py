"""One rank of a distributed run, launched by tests/batches/test_distributed.py with
``torchrun --nproc_per_node=N`` on the gloo backend.

Each rank builds its generators without ``rank``/``world_size`` (they come from
torch.distributed), runs two epochs of several configurations, and all-reduces once per
batch as DDP does (a rank with fewer batches would leave the others waiting: the
process group's timeout turns that into an error, not a hang). Rank 0 writes every
rank's sample ids, yielded timestamps, batch counts, plan and the chunk keys each rank
read to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta

warnings.filterwarnings("ignore", message=".*[Cc]onsolidated metadata.*")

CONFIGS = [
    dict(batch_size=5, block_chunks=2, shuffle=True, drop_last=False),
    dict(batch_size=7, block_chunks=3, shuffle=True, drop_last=True),
    dict(batch_size=4, block_chunks=1, shuffle=False, drop_last=False),
    dict(batch_size=3, block_chunks=2, shuffle=True, drop_last=False, window={"time": 3}),
    dict(batch_size=3, block_chunks=1, shuffle=True, drop_last=False, split="val"),  # 2 ranks: cuts inside blocks
]
VARIABLES = ["t2m", "tp"]


def main() -> None:
    import torch
    import torch.distributed as dist
    import xarray as xr

    import xinsitu  # noqa: F401  (the accessor)
    from tests.support.keylog import ENV, KeyLogStore, chunk_reads

    archive, out_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = xr.open_zarr(KeyLogStore(archive, read_only=True), chunks=None)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    mine = []
    for c, cfg in enumerate(CONFIGS):
        cfg = dict(cfg)
        gen = ds.insitu.batches(m, cfg.pop("split", "train"), seed=3, output="xarray", variables=VARIABLES, **cfg)
        assert (gen.rank, gen.world_size) == (rank, world), "rank/world_size must default to torch.distributed's"
        gen.read_ahead = False  # the key log counts each epoch's reads within it (no next-epoch read ahead)
        for epoch in range(2):
            log = os.path.join(out_dir, f"keys.{c}.{epoch}.{rank}")
            os.environ[ENV] = log
            gen.set_epoch(epoch)
            times, sizes = [], []
            for batch in gen:
                t = torch.tensor([len(batch.sample)], dtype=torch.int64)
                dist.all_reduce(t)  # one collective per step, as DDP's gradient sync
                times.append(batch.time.values[:, 0] if batch.time.ndim == 2 else batch.time.values)
                sizes.append(int(t))
            os.environ.pop(ENV)
            plan = gen.plan()
            mine.append({
                "config": c, "epoch": epoch, "rank": rank, "len": len(gen), "n_samples": gen.n_samples,
                "ids": [b.tolist() for b in gen.batch_ids()],
                "times": [[int(x) for x in t.astype("int64")] for t in times],
                "global_batch_sizes": sizes,
                "units": plan.units.tolist(), "lo": plan.lo.tolist(), "hi": plan.hi.tolist(),
                "counts": gen.space.counts[plan.units].tolist(),
                "chunks_read": gen.io_stats["chunks"],
                "keys": sorted(k for keys in chunk_reads(log, VARIABLES).values() for k in keys),
            })
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(os.path.join(out_dir, "out.json"), "w") as f:
            json.dump({"world_size": world, "ranks": gathered}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
