"""The torch surface: ``gen.to_torch()`` in a DataLoader, with and without workers, under
every start method, and checkpointed by torchdata's ``StatefulDataLoader``.

Every DataLoader with workers runs in a subprocess with a timeout, so a hang fails the
test instead of freezing the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

import xinsitu
from tests.support.keylog import ENV, chunk_reads
from tests.support.resume_check import epoch_records
from xinsitu.index.plan import worker_batches

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIABLES = ["t2m", "tp"]
JOB = dict(batch_size=5, block_chunks=2, seed=0)  # tests/support/torch_job.py's defaults


def _gen(path: str, **kw):
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    return ds.insitu.batches(m, "train", variables=VARIABLES, **{**JOB, "output": "xarray", **kw})


def _reference(path: str, epoch: int = 0) -> list[dict]:
    """What the job's generator yields serially (num_workers=0), as tests/support/torch_job.py records it."""
    from tests.support.torch_job import record

    gen = _gen(path)
    gen.set_epoch(epoch)
    return [record(b) for b in gen]


def _interleave(runs: list[list]) -> list:
    """The order a DataLoader takes batches from its workers: one from each in turn."""
    out = []
    for k in range(max(len(r) for r in runs)):
        out += [r[k] for r in runs if k < len(r)]
    return out


def _job(path: str, tmp_path, *args: str, timeout: int = 150, keylog: bool = False) -> dict:
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "XINSITU_DECODE_THREADS": "2"}
    if keylog:
        env[ENV] = str(tmp_path / "keys")
    try:
        proc = subprocess.run([sys.executable, "-m", "tests.support.torch_job", path, str(out), *args], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # a hang is a failure, reported with what it printed
        pytest.fail(f"DataLoader job hung (killed after {timeout}s): {(e.stderr or b'')[-3000:]!r}")
    assert proc.returncode == 0, proc.stderr[-5000:]
    with open(out) as f:
        return {**json.load(f), "stderr": proc.stderr}


def _check_workers_epoch(got: list[dict], ref: list[dict], num_workers: int) -> None:
    """The workers yield the serial epoch's batches, each exactly once, interleaved worker by worker."""
    assert Counter(b["sha"] for b in got) == Counter(b["sha"] for b in ref)
    times = [t for b in got for t in b["times"]]
    assert len(times) == len(set(times)) == sum(len(b["times"]) for b in ref)
    runs = [ref[slice(*worker_batches(len(ref), num_workers, w))] for w in range(num_workers)]
    assert got == _interleave(runs)


# ---------------------------------------------------------------------- in process
def test_dataloader_no_workers_matches_generator(era5_path):
    gen = _gen(era5_path, output="torch")
    ds = gen.to_torch()
    assert isinstance(ds, torch.utils.data.IterableDataset)
    assert len(ds) == len(gen) == len(DataLoader(ds, batch_size=None))
    ref = epoch_records(_gen(era5_path, output="torch"))
    got = list(DataLoader(ds, batch_size=None, num_workers=0))
    assert all(isinstance(b["t2m"], torch.Tensor) for b in got)
    assert epoch_records(got) == ref
    ds.set_epoch(1)
    assert gen.epoch == 1
    assert epoch_records(DataLoader(ds, batch_size=None)) != ref


def _stateful_dataloader() -> type:
    """torchdata's ``StatefulDataLoader``, or a skip where torchdata is not installed (the ``torch`` extra
    has it; an environment with torch alone does not)."""
    mod = pytest.importorskip("torchdata.stateful_dataloader",
                              reason="torchdata is not installed (pip install 'xinsitu[torch]' brings it)")
    return mod.StatefulDataLoader


def test_stateful_dataloader_no_workers(era5_path):
    """StatefulDataLoader, num_workers=0: a state saved after batch 3 (through JSON) resumes
    a new loader at batch 4, and the next epoch matches too."""
    StatefulDataLoader = _stateful_dataloader()

    def make():
        ds = _gen(era5_path, output="numpy").to_torch()
        return ds, StatefulDataLoader(ds, batch_size=None, num_workers=0)

    ds, dl = make()
    ref, state = [], None
    for i, b in enumerate(dl):
        ref.append(epoch_records([b])[0])
        if i == 2:
            state = json.loads(json.dumps(dl.state_dict()))
            assert ds.state_dict()["batch"] == 3
    ds.set_epoch(1)
    ref_next = epoch_records(dl)
    ds2, dl2 = make()
    dl2.load_state_dict(state)
    assert epoch_records(dl2) == ref[3:]
    ds2.set_epoch(1)
    assert epoch_records(dl2) == ref_next


def test_worker_state_does_not_load_in_main_process(era5_path):
    ds = _gen(era5_path).to_torch()
    state = {**ds.state_dict(), "worker": [1, 2]}
    with pytest.raises(ValueError, match="worker 1 of 2"):
        ds.load_state_dict(state)


def test_dataset_pickles_without_buffers(era5_path):
    """What spawn sends to each worker: small, and usable after the generator has run."""
    import pickle

    gen = _gen(era5_path, output="numpy")
    ds = gen.to_torch()
    fresh = len(pickle.dumps(ds))
    for _ in gen:
        pass
    used = pickle.dumps(ds)
    assert len(used) < fresh + 4096, "the pickled generator carries this process's reader or buffers"
    again = pickle.loads(used)
    assert epoch_records(again.gen) == epoch_records(gen)


# ---------------------------------------------------------------------- workers, in subprocesses
@pytest.mark.slow
def test_the_generators_set_epoch_reaches_persistent_workers(era5_path, tmp_path):
    """``gen.set_epoch(e)`` (SPEC §4's loop), not the dataset's: persistent workers keep copies of the
    generator, and the epoch reaches them in shared memory (each epoch repeated epoch 0's order)."""
    out = _job(era5_path, tmp_path, "--method", "fork", "--workers", "2", "--epochs", "2", "--persistent",
               "--gen-epoch")
    assert "error" not in out, out.get("traceback")
    for e in range(2):
        _check_workers_epoch(out["epochs"][e], _reference(era5_path, e), 2)


@pytest.mark.slow
@pytest.mark.parametrize(("method", "persistent"), [("fork", False), ("fork", True), ("spawn", False)])
def test_a_state_loaded_before_the_workers_start_resumes_in_them(era5_path, tmp_path, method, persistent):
    """A state saved by the generator (or with num_workers=0) and loaded into ``gen.to_torch()``: the
    workers yield the rest of that epoch, each exactly once (they replayed the whole epoch), then the
    next epoch whole."""
    out = _job(era5_path, tmp_path, "--method", method, "--workers", "2", "--epochs", "2", "--resume-at", "3",
               "--again", *(["--persistent"] if persistent else []))
    assert "error" not in out, out.get("traceback")
    ref = _reference(era5_path, 0)
    got = out["epochs"][0]
    assert Counter(b["sha"] for b in got) == Counter(b["sha"] for b in ref[3:])
    times = [t for b in got for t in b["times"]]
    assert len(times) == len(set(times)) == sum(len(b["times"]) for b in ref[3:])
    # one pass resumes: the same epoch again without set_epoch is the whole epoch, as with num_workers=0
    # (non-persistent workers start from fresh copies of the generator, which still carry the state)
    _check_workers_epoch(out["again"], ref, 2)
    _check_workers_epoch(out["epochs"][1], _reference(era5_path, 1), 2)


_WORKERS_AND_STATES = """
import sys, warnings
import xinsitu
from torch.utils.data import DataLoader
ds = xinsitu.open_zarr(sys.argv[1])
m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
gen = ds.insitu.batches(m, "train", variables=["t2m"], batch_size=5, output="torch")
saved = gen.state_dict()
dl = DataLoader(gen.to_torch(), batch_size=None, num_workers=2, persistent_workers=True,
                multiprocessing_context="fork")
it = iter(dl)
next(it)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    gen.state_dict()  # mid-epoch: the place is the workers'
    said = [str(x.message) for x in w if "StatefulDataLoader" in str(x.message)]
print("warned mid-epoch:", bool(said))
list(it)
gen.set_epoch(1)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    gen.state_dict()  # the next epoch's start: right
    print("warned after set_epoch:", any("StatefulDataLoader" in str(x.message) for x in w))
gen.load_state_dict(saved)  # the persistent workers' copies cannot take it
try:
    list(dl)
    print("persistent workers after a load: no error")
except RuntimeError as e:
    print("persistent workers after a load:", "Make a new DataLoader" in str(e) or str(e)[-300:])
"""


@pytest.mark.slow
def test_states_and_dataloader_workers_are_never_silently_wrong(era5_path, tmp_path):
    """Where the main process cannot know the place (DataLoader workers yield the epoch), ``gen.state_dict()``
    warns (it said batch 0: resuming repeated what was trained on); a state loaded after persistent workers
    took their copies is refused at their first batch, naming the fix (they replayed the whole epoch: 10
    samples repeated)."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-c", _WORKERS_AND_STATES, era5_path],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == ["warned mid-epoch: True", "warned after set_epoch: False",
                                     "persistent workers after a load: True"], p.stdout + p.stderr[-2000:]


@pytest.mark.slow
def test_spawn_workers_disjoint_reads_persistent_epochs(era5_path, tmp_path):
    """spawn, 2 persistent workers, 2 epochs: exactly once per epoch, set_epoch reaches the
    workers, and each worker reads its own chunks (only a block a boundary falls in twice)."""
    out = _job(era5_path, tmp_path, "--open", "keylog", "--method", "spawn", "--workers", "2", "--epochs", "2",
               "--persistent", keylog=True)
    assert "error" not in out, out.get("traceback")
    refs = [_reference(era5_path, e) for e in range(2)]
    assert out["len"] == len(refs[0])
    for e in range(2):
        _check_workers_epoch(out["epochs"][e], refs[e], 2)
    assert out["epochs"][0] != out["epochs"][1]
    gen = _gen(era5_path)
    n_units = len(gen.plan().units)
    for e in range(2):
        reads = chunk_reads(str(tmp_path / f"keys.{e}"), VARIABLES)
        assert len(reads) == 2, f"expected reads from 2 worker processes, got {list(reads)}"
        every = [k for keys in reads.values() for k in keys]
        for keys in reads.values():
            assert len(keys) == len(set(keys)), "a worker read a chunk twice"
        assert len(set(every)) == len(VARIABLES) * n_units, "some chunk was never read"
        assert len(every) - len(set(every)) <= len(VARIABLES) * JOB["block_chunks"], "more than one block read twice"


@pytest.mark.slow
def test_forkserver_workers(era5_path, tmp_path):
    out = _job(era5_path, tmp_path, "--open", "xinsitu", "--method", "forkserver", "--workers", "2")
    assert "error" not in out, out.get("traceback")
    _check_workers_epoch(out["epochs"][0], _reference(era5_path), 2)


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True])
def test_a_memory_tier_lost_with_workers_each_epoch_is_said_once(era5_path, tmp_path, persistent):
    """``cache=True`` (a memory tier only) and torch's default ``persistent_workers=False``: each epoch's
    workers start with an empty tier and nothing is ever served from it (SPEC §4: no silently empty
    tier). Said once for the run, naming the fix; persistent workers keep theirs, and nothing is said."""
    args = ["--method", "fork", "--workers", "2", "--epochs", "3", "--gen-epoch", "--cache", "memory"]
    out = _job(era5_path, tmp_path, *args, *(["--persistent"] if persistent else []))
    assert "error" not in out, out.get("traceback")
    for e in range(3):
        _check_workers_epoch(out["epochs"][e], _reference(era5_path, e), 2)
    said = out["stderr"].count("workers that are not persistent end with each epoch")
    assert said == (0 if persistent else 1), out["stderr"][-3000:]
    if not persistent:
        assert "persistent_workers=True" in out["stderr"]


@pytest.mark.slow
def test_two_persistent_dataloaders_over_one_dataset_say_nothing_of_a_lost_memory_tier(era5_path):
    """A training and an evaluation DataLoader over the same ``gen.to_torch()``, both persistent, iterated in
    turn: each keeps its workers and their memory tiers. The second one's fresh workers were taken for the
    first one's replacements, and the memory tier was said to be lost."""
    script = f"""
import torch, xinsitu
from torch.utils.data import DataLoader
ds = xinsitu.open_zarr({era5_path!r})
m = ds.insitu.split("time", fractions={{"train": 1.0}})
gen = ds.insitu.batches(m, "train", batch_size=5, output="numpy", cache=True, seed=0)
dset = gen.to_torch()
kw = dict(batch_size=None, num_workers=2, multiprocessing_context="fork", persistent_workers=True)
a, b = DataLoader(dset, **kw), DataLoader(dset, **kw)
for e, loader in enumerate([a, b, a, b]):
    gen.set_epoch(e)
    assert sum(1 for _ in loader) == len(gen)
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=150)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"DataLoader job hung: {(e.stderr or b'')[-3000:]!r}")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    assert "workers that are not persistent" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_fork_local_archive_works(era5_path, tmp_path):
    """fork, 3 workers, after the parent used obstore (--touch, its reads still in flight):
    the workers read the local archive with plain file I/O."""
    out = _job(era5_path, tmp_path, "--open", "xr", "--method", "fork", "--workers", "3", "--touch")
    assert "error" not in out, out.get("traceback")
    _check_workers_epoch(out["epochs"][0], _reference(era5_path), 3)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
@pytest.mark.slow
def test_workers_xinsitu_local_after_parent_epoch(era5_path, tmp_path, method):
    """The most common set-up: ``xinsitu.open_zarr(path)``, a whole epoch in the parent (obstore's
    runtime used there), then 2 workers: exactly once under every start method. Under fork the
    workers read the files without obstore (which would hang in a forked child)."""
    out = _job(era5_path, tmp_path, "--open", "xinsitu", "--method", method, "--workers", "2", "--warm")
    assert "error" not in out, out.get("traceback")
    _check_workers_epoch(out["epochs"][0], _reference(era5_path), 2)


@pytest.mark.slow
def test_fork_xinsitu_sharded_local_after_parent_epoch(tmp_path):
    """Shards of a local archive (byte ranges of one file) are read without obstore after fork too."""
    from xinsitu.synthetic import write_era5_like

    path = str(tmp_path / "sharded.zarr")
    write_era5_like(path, nt=120, ny=6, nx=10, chunk_time=8, shard_time=32)
    out = _job(path, tmp_path, "--open", "xinsitu", "--method", "fork", "--workers", "2", "--warm")
    assert "error" not in out, out.get("traceback")
    _check_workers_epoch(out["epochs"][0], _reference(path), 2)


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.slow
def test_workers_netcdf_through_dask(era5_path, tmp_path, method):
    """A NetCDF copy of the archive opened with dask chunks (read through dask, chunk by chunk),
    after a whole epoch in the parent: the same batches as the Zarr archive, exactly once."""
    import xarray as xr

    nc = str(tmp_path / "era5.nc")
    xr.open_zarr(era5_path, chunks=None).to_netcdf(nc)
    out = _job(nc, tmp_path, "--open", "nc", "--method", method, "--workers", "2", "--warm")
    assert "error" not in out, out.get("traceback")
    _check_workers_epoch(out["epochs"][0], _reference(era5_path), 2)


@pytest.mark.slow
def test_fork_remote_fails_at_once(era5_path, tmp_path):
    """fork with a remote (HTTP) store the parent has read from: an error naming the store and
    the fix, at the worker's first step, never a hang."""
    from pathlib import Path

    from tests.support.servers import FileServer

    with FileServer(Path(era5_path).parent) as srv:
        base = srv.url
        out = _job(f"{base}/{Path(era5_path).name}", tmp_path, "--open", "xinsitu", "--method", "fork",
                   "--workers", "2", "--touch", timeout=90)
    assert "error" in out
    assert "ForkError" in out["traceback"] and base in out["error"]
    assert "spawn" in out["error"] and "forkserver" in out["error"] and "num_workers=0" in out["error"]
    assert out["seconds"] < 30


@pytest.mark.slow
def test_stateful_dataloader_workers(era5_path, tmp_path):
    """StatefulDataLoader, 2 persistent workers: a state saved mid-epoch (through JSON)
    resumes the remaining batches exactly, and the next epoch matches."""
    _stateful_dataloader()  # the job imports it in its own process: skip here, not an error there
    out = _job(era5_path, tmp_path, "--open", "xr", "--method", "fork", "--workers", "2", "--stateful",
               "--stop", "3", "--persistent")
    assert "error" not in out, out.get("traceback")
    _check_workers_epoch(out["ref"], _reference(era5_path), 2)
    assert out["resumed"] == out["ref"][3:]
    assert out["resumed_next"] == out["ref_next"]
    _check_workers_epoch(out["ref_next"], _reference(era5_path, 1), 2)


@pytest.mark.slow
def test_stateful_dataloader_workers_in_an_elastic_epoch(era5_path, tmp_path):
    """A run of world size 2 stops after 2 batches per rank; a run of world size 1 resumes its state with
    2 StatefulDataLoader workers and is checkpointed in turn: a new loader resumes that checkpoint (it
    raised "different elastic resume": a worker's fresh generator knew nothing of the resume) and yields
    the rest of the epoch, every sample of it exactly once."""
    _stateful_dataloader()
    out = _job(era5_path, tmp_path, "--open", "xr", "--method", "fork", "--workers", "2", "--stateful",
               "--stop", "2", "--elastic-from", "2")
    assert "error" not in out, out.get("traceback")
    assert out["resumed"] == out["ref"][2:]
    times = [t for b in out["before"] + out["ref"] for t in b["times"]]
    assert len(times) == len(set(times)) == sum(len(b["times"]) for b in _reference(era5_path))


def test_worker_order_is_deterministic():
    """Worker shares are a pure function of (batches, workers): runs, no gaps, no overlaps."""
    for n in range(0, 30):
        for k in range(1, 5):
            runs = [worker_batches(n, k, w) for w in range(k)]
            assert [i for a, b in runs for i in range(a, b)] == list(range(n))
    assert np.diff([b - a for a, b in (worker_batches(10, 3, w) for w in range(3))]).max() <= 1
