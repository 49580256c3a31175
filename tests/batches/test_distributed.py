"""Real distributed runs: ``torchrun`` with 2 and 3 processes on the gloo backend.

Every rank gets ``rank``/``world_size`` from torch.distributed; together the ranks yield
every sample at most once, leave out fewer than ``world_size * batch_size``, yield the
same number of batches (one all-reduce per batch, as DDP), yield the values the plan
says, and never read a chunk another rank reads where the plan kept chunk blocks whole.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

import xinsitu
from tests.support.dist_worker import CONFIGS, VARIABLES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytest.importorskip("torch.distributed")


def _torchrun(archive: str, out_dir: str, nproc: int) -> dict:
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    cmd = [torchrun, "--standalone", "--nnodes=1", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "tests", "support", "dist_worker.py"), archive, out_dir]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "XINSITU_DECODE_THREADS": "2"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(os.path.join(out_dir, "out.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def run(request, era5_path, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"dist{request.param}")
    return _torchrun(era5_path, str(out), request.param)


def _expected_times(era5_path: str, cfg: dict, rank: int, world: int, epoch: int) -> list[list[int]]:
    """The start timestamp of every sample of every batch, as this rank's plan says."""
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    cfg = dict(cfg)
    gen = ds.insitu.batches(m, cfg.pop("split", "train"), seed=3, variables=VARIABLES, rank=rank,
                            world_size=world, **cfg)
    times = ds.time.values.astype("int64")
    out = []
    for ids in gen.batch_ids(epoch):
        unit, local = gen.space.locate(ids)
        starts = [int(gen.space.unit_starts(int(u))[int(j), 0]) for u, j in zip(unit, local, strict=True)]
        out.append(times[starts].tolist())
    return out


@pytest.mark.slow
def test_ranks_exactly_once_equal_batches(run, era5_path):
    world = run["world_size"]
    by = {(r["config"], r["epoch"]): [] for ranks in run["ranks"] for r in ranks}
    for ranks in run["ranks"]:
        for r in ranks:
            by[(r["config"], r["epoch"])].append(r)
    assert len(by) == 2 * len(CONFIGS)
    for (c, epoch), recs in by.items():
        cfg, bs = CONFIGS[c], CONFIGS[c]["batch_size"]
        assert [r["rank"] for r in recs] == list(range(world))
        # equal batch counts: len(gen) and what was yielded, on every rank
        assert len({r["len"] for r in recs}) == 1
        assert all(len(r["times"]) == r["len"] == len(r["ids"]) for r in recs)
        assert len({tuple(r["global_batch_sizes"]) for r in recs}) == 1
        # disjoint, covering the split but fewer than world_size * batch_size, never a repeat
        ids = np.concatenate([np.concatenate(r["ids"]) if r["ids"] else [] for r in recs]).astype(np.int64)
        n = recs[0]["n_samples"]
        assert len(np.unique(ids)) == len(ids)
        assert ids.min() >= 0 and ids.max() < n
        assert 0 <= n - len(ids) < world * bs
        # what each rank yielded (the timestamps in its batches) is what its plan says
        yielded = [t for r in recs for b in r["times"] for t in b]
        assert len(set(yielded)) == len(yielded) == len(ids)
        for r in recs:
            assert r["times"] == _expected_times(era5_path, cfg, r["rank"], world, epoch), (c, epoch, r["rank"])
        # chunks: each rank reads each of its chunks once; none read by two ranks where units stay whole.
        # (A window that spills into the next chunk block reads that block again as its halo: not checked.)
        if "window" in cfg:
            continue
        for r in recs:
            assert max(Counter(r["keys"]).values(), default=1) == 1, "a chunk read twice in one epoch"
            assert r["chunks_read"] == len(r["keys"])
        whole = all(r["lo"] == [0] * len(r["lo"]) and r["hi"] == r["counts"] for r in recs)
        keys = [k for r in recs for k in r["keys"]]
        if whole:
            assert len(set(keys)) == len(keys), "a chunk was read by two ranks"
            for r in recs:
                assert r["chunks_read"] <= len(VARIABLES) * len(r["units"])


def test_both_kinds_of_cut_happen(run):
    """The configurations exercise whole chunk blocks per rank, and (2 ranks) cuts inside blocks."""
    whole = [all(r["lo"] == [0] * len(r["lo"]) and r["hi"] == r["counts"] for r in [ranks[i] for ranks in run["ranks"]])
             for i in range(len(run["ranks"][0]))]
    assert any(whole)
    if run["world_size"] == 2:
        assert not all(whole)
