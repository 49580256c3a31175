"""Statistics and validity on a real Dask cluster (``distributed.LocalCluster`` with worker processes):
the same results as one process, bit for bit (exact sums), on Zarr v2, v3, sharded, Icechunk and
virtual NetCDF archives, with ``stack=["level"]``, ``block=`` splits, windows and ``diffs="time"``;
a worker killed mid-task changes nothing; an unreadable chunk raises ``ChunkReadError`` here, naming
it; what a worker cannot open is refused; no credential reaches a task, a log or an error."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import xarray as xr

import xinsitu
from tests.conftest import CT, NT, NX, NY
from tests.support.servers import Faults, FileServer, MotoS3
from xinsitu.synthetic import era5_like, packing, write_era5_like, write_weatherbench_like

distributed = pytest.importorskip("distributed", reason="the dask extra is not installed")

pytestmark = pytest.mark.filterwarnings("ignore:Numcodecs codecs are not in the Zarr version 3")


@pytest.fixture(scope="module")
def client():
    """Two worker processes of one thread each (the machine's two cores are shared)."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cl, \
            distributed.Client(cl) as c:
        yield c


def same(a: dict, b: dict) -> bool:
    """Equal to the bit: the JSON text of two results (floats written exactly)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def check_both(ds: xr.Dataset, m: xinsitu.SplitManifest, client, stack=None, window=None, patch=None,
               over=None) -> None:
    """``stats`` (with ``diffs="time"`` where time is a split dim) and ``validity`` with and without the cluster."""
    diffs = "time" if "time" in m.dims else None
    one = ds.insitu.stats(m, "train", stack=stack, diffs=diffs)
    many = ds.insitu.stats(m, "train", stack=stack, diffs=diffs, client=client)
    assert same(one, many)
    assert m.stats == many
    kw = {"window": window, "patch": patch, "over": over}
    one = ds.insitu.validity(m, "train", **kw)
    many = ds.insitu.validity(m, "train", **kw, client=client)
    assert many == one and 0 < one["valid"] < one["total"]  # tp's missing values spoil some samples
    assert m.validity["train"] == many["record"]


# ----------------------------------------------------------------------------- archives
@pytest.fixture(scope="module")
def sharded_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("cluster") / "sharded.zarr")
    write_era5_like(path, nt=NT, ny=NY, nx=NX, chunk_time=CT, shard_time=4 * CT)
    return path


@pytest.mark.parametrize("kind", ["v3", "v2", "sharded"])
@pytest.mark.slow
def test_zarr_archives(client, kind, era5_path, era5_v2_path, sharded_path):
    ds = xinsitu.open_zarr({"v3": era5_path, "v2": era5_v2_path, "sharded": sharded_path}[kind])
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.2, "test": 0.2}, gap=1)
    check_both(ds, m, client, window={"time": 3} if kind == "v3" else None)
    if kind == "v3":  # a predicate travels to the workers too (cloudpickle)
        mid = float(ds["t2m"].mean(["lat", "lon"]).median())
        warm = (lambda b: (b["t2m"].mean(["lat", "lon"]) > mid).values)  # noqa: E731 - a closure to ship
        one = ds.insitu.validity(m, "train", where=warm)
        assert ds.insitu.validity(m, "train", where=warm, client=client) == one and 0 < one["valid"] < one["total"]


def test_a_predicate_that_cannot_travel_is_named(client, era5_path):
    """A ``where=`` that does not pickle (it holds a lock) is what the error names, not the Dataset (a
    local path, which travels)."""
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    lock = threading.Lock()

    def holds_a_lock(b, _lock=lock):
        return np.ones(b.sizes["sample"], bool)

    with pytest.raises(ValueError, match="where= cannot be sent to the workers") as e:
        ds.insitu.validity(m, "train", where=holds_a_lock, client=client)
    assert "open the archive" not in str(e.value)


def test_chunks_without_an_object_are_said(client, tmp_path):
    """A chunk file gone from the archive reads as the fill value (zarr's rule) in stats and validity,
    with and without ``client=`` and through the parts, and each says so once, as batches do (stats
    said nothing: an archive deleted after opening gave statistics of nothing)."""
    path = str(tmp_path / "a.zarr")
    write_era5_like(path, nt=NT, ny=NY, nx=NX, chunk_time=CT)
    os.remove(os.path.join(path, "t2m", "c", "1", "0", "0"))
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    said = "1 chunk\\(s\\) had no object in the store .* chunk \\(1, 0, 0\\) of variable 't2m'"
    with pytest.warns(UserWarning, match="stats of split 'train': " + said):
        one = ds.insitu.stats(m, "train", variables=["t2m"])
    with pytest.warns(UserWarning, match="stats of split 'train': " + said):
        assert ds.insitu.stats(m, "train", variables=["t2m"], client=client) == one
    assert one["t2m"]["nan_count"] == CT * NY * NX
    parts = [ds.insitu.stats_part(m, "train", variables=["t2m"], part=(i, 3)) for i in range(3)]
    with pytest.warns(UserWarning, match="stats of split 'train': " + said):
        assert xinsitu.merge_stats(parts) == one
    with pytest.warns(UserWarning, match="validity of split 'train': " + said):
        got = ds.insitu.validity(m, "train", variables=["t2m"], client=client)
    assert got["valid"] == got["total"] - CT


def test_icechunk_session(client, tmp_path):
    icechunk = pytest.importorskip("icechunk", reason="the icechunk extra is not installed")
    icechunk.set_logs_filter("error")
    repo = icechunk.Repository.create(icechunk.local_filesystem_storage(str(tmp_path / "repo")))
    data = era5_like(NT, NY, NX)
    enc = {v: {"chunks": (CT, NY, NX) if "time" in data[v].dims else (NY, NX)} for v in data.data_vars}
    enc["tp"].update(packing())
    s = repo.writable_session("main")
    data.to_zarr(s.store, encoding=enc, zarr_format=3, consolidated=False)
    s.commit("synthetic archive")
    with pytest.raises(ValueError, match="cannot be sent to the workers"):  # a writable session does not pickle
        writable = xinsitu.open_zarr(repo.writable_session("main").store)
        writable.insitu.stats(writable.insitu.split("time", fractions={"train": .5, "val": .5}), client=client)
    ds = xinsitu.open_zarr(repo.readonly_session(branch="main").store)
    m = ds.insitu.split("time", fractions={"train": 0.7, "val": 0.3})
    check_both(ds, m, client, window={"time": 2})


@pytest.mark.slow
def test_virtual_netcdf(client, tmp_path):
    for mod in ("virtualizarr", "h5py", "h5netcdf"):
        pytest.importorskip(mod, reason="the virtual extra is not installed")
    from tests.formats.test_virtual import STEPS, write_days
    from xinsitu.virtual import open_netcdf

    files = write_days(tmp_path / "days", era5_like(12 * STEPS, 6, 10))
    ds = open_netcdf(files)
    m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
    check_both(ds, m, client)


def test_levels_stacked(client, tmp_path):
    path = str(tmp_path / "wb.zarr")
    write_weatherbench_like(path, nt=48, ny=6, nx=8, chunk_time=4)
    ds = xinsitu.open_zarr(path)
    ds["t2m"][5:7] = np.nan  # (in memory only: a variable of a stored Dataset is refused, below)
    m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
    with pytest.raises(ValueError, match="'t2m' holds its values in memory"):
        ds.insitu.stats(m, "train", stack=["level"], client=client)
    ds = xinsitu.open_zarr(path)
    one = ds.insitu.stats(m, "train", stack=["level"], diffs="time")
    assert one["z"]["channels"] == ["z_500", "z_700", "z_850"] and len(one["z"]["diff_std"]) == 3
    assert same(one, ds.insitu.stats(m, "train", stack=["level"], diffs="time", client=client))


def test_block_split(client, tmp_path):
    """A spatial split on blocks of positions (``block=``), chunk blocks dealt at random: a chunk read by
    several splits, never a sample; patches for the validity."""
    path = str(tmp_path / "tiles.zarr")
    write_era5_like(path, nt=16, ny=12, nx=16, chunk_time=8, chunk_space=(6, 8))
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split(["lat", "lon"], fractions={"train": 0.6, "val": 0.4}, contiguous=False, seed=1,
                        block={"lat": 3, "lon": 4})
    check_both(ds, m, client, patch={"lat": 3, "lon": 4}, over="time")
    tm = ds.insitu.split(["time", "lat"], fractions={"train": 0.6, "val": 0.4}, contiguous=False, seed=2,
                         block={"time": 4, "lat": 3})
    one = ds.insitu.stats(tm, "train", diffs="time")
    assert same(one, ds.insitu.stats(tm, "train", diffs="time", client=client))


# ----------------------------------------------------------------------------- faults
@pytest.mark.slow
def test_worker_killed_mid_task(client, tmp_path):
    """A worker process killed while it reads a task: the scheduler runs the task again on a worker, and the
    result is the very one of one process."""
    path = tmp_path / "era5.zarr"
    write_era5_like(path, nt=NT, ny=NY, nx=NX, chunk_time=CT)
    with FileServer(tmp_path, Faults(latency=0.15)) as srv:
        ds = xinsitu.open_zarr(f"{srv.url}/era5.zarr")
        m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
        ref = xinsitu.open_zarr(path).insitu.stats(m, "train", diffs="time")
        pids = client.run(os.getpid)

        def busy(dask_worker) -> bool:  # a stats task running on this worker now
            return any(str(ts.key).startswith("xinsitu-stats") for ts in dask_worker.state.executing)

        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(ds.insitu.stats, m, "train", diffs="time", client=client)
            victim, deadline = None, time.monotonic() + 60
            while victim is None and time.monotonic() < deadline and not fut.done():
                victim = next((a for a, b in client.run(busy).items() if b), None)
                time.sleep(0.02)
            assert victim is not None, "no task was seen running"
            os.kill(pids[victim], signal.SIGKILL)
            got = fut.result(timeout=120)
    assert same(got, ref)
    client.wait_for_workers(2, timeout=60)
    assert pids[victim] not in client.run(os.getpid).values()  # the worker was killed, and replaced


def test_unreadable_chunk_raises_here(client, era5_path, tmp_path):
    path = tmp_path / "corrupt.zarr"
    shutil.copytree(era5_path, path)
    obj = path / "t2m" / "c" / "3" / "0" / "0"
    obj.write_bytes(obj.read_bytes()[:-9])
    ds = xinsitu.open_zarr(str(path))
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    for run in (lambda: ds.insitu.stats(m, "train", client=client),
                lambda: ds.insitu.validity(m, "train", client=client)):
        with pytest.raises(xinsitu.ChunkReadError) as info:
            run()
        assert (info.value.var, info.value.chunk, info.value.key) == ("t2m", (3, 0, 0), "t2m/c/3/0/0")
        assert "cannot read chunk (3, 0, 0) of variable 't2m'" in str(info.value)


def test_what_workers_cannot_open_is_refused(client, era5_path):
    import zarr

    mem = xinsitu.open_zarr(era5_path).load()
    m = mem.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    for ds, match in ((mem, "'t2m' holds its values in memory"), (mem.chunk(time=8), "in memory")):
        with pytest.raises(ValueError, match=match):
            ds.insitu.stats(m, "train", client=client)
        with pytest.raises(ValueError, match=match):
            ds.insitu.validity(m, "train", client=client)
    store = zarr.storage.MemoryStore()
    era5_like(24, 3, 4)[["t2m"]].to_zarr(store, consolidated=False, encoding={"t2m": {"chunks": (8, 3, 4)}})
    ds = xr.open_zarr(store, chunks=None, consolidated=False)
    with pytest.raises(ValueError, match="in-memory store"):
        ds.insitu.stats(ds.insitu.split("time", fractions={"train": .5, "val": .5}), client=client)
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    with pytest.raises(ValueError, match="cache="):
        ds.insitu.stats(m, "train", client=client, cache=True)
    with pytest.raises(TypeError, match="client"):
        ds.insitu.stats(m, "train", client="tcp://127.0.0.1:8786")
    with pytest.raises(TypeError, match="client"):
        ds.insitu.validity(m, "train", client=object())
    closed = distributed.Client(client.cluster)
    closed.close()
    with pytest.raises(ValueError, match="client is closed"):  # (was distributed's AttributeError)
        ds.insitu.stats(m, "train", client=closed)
    icechunk = pytest.importorskip("icechunk")  # a writable session: named, with the read-only one (not the
    repo = icechunk.Repository.create(icechunk.in_memory_storage())  # advice Icechunk gives writers)
    session = repo.writable_session("main")
    era5_like(24, 3, 4)[["t2m"]].to_zarr(session.store, consolidated=False, encoding={"t2m": {"chunks": (8, 3, 4)}})
    ds = xinsitu.open_zarr(session.store)
    with pytest.raises(ValueError, match=r"writable Icechunk session.*repo\.readonly_session"):
        ds.insitu.stats(ds.insitu.split("time", fractions={"train": .5, "val": .5}), client=client)


@pytest.mark.slow
def test_no_credential_in_tasks_logs_or_errors(client, era5_path, capsys):
    """An S3 archive opened with keys: the job a worker gets shows none, nor do the workers' and the
    scheduler's logs, nor the error of a chunk that cannot be read; progress=True draws a bar."""
    with MotoS3() as s3:
        s3.upload(era5_path, "bucket", "era5.zarr")
        ds = xinsitu.open_zarr("s3://bucket/era5.zarr", **s3.options)
        m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
        ref = xinsitu.open_zarr(era5_path).insitu.stats(m, "train")
        assert same(ds.insitu.stats(m, "train", client=client, progress=True), ref)
        assert "stats of split 'train'" in capsys.readouterr().err  # the bar
        from xinsitu.batches.cluster import Shipped
        from xinsitu.batches.stats import StatsPass

        shipped = Shipped(StatsPass(ds, m, "train"), "stats", "s3://bucket/era5.zarr")
        assert s3.secret_access_key.encode() in shipped.blob  # the workers need it to read ...
        seen = [repr(shipped)]
        obstore = pytest.importorskip("obstore")
        obstore.put(s3.store("bucket"), "era5.zarr/t2m/c/2/0/0", b"not a zstd frame")
        with pytest.raises(xinsitu.ChunkReadError) as info:
            ds.insitu.stats(m, "train", client=client)
        seen.append(str(info.value))
        logs = [*client.get_worker_logs().values(), client.get_scheduler_logs()]
    seen.append(json.dumps(logs, default=str))
    for text in seen:  # ... but nothing shows it
        assert s3.secret_access_key not in text and s3.access_key_id not in text


@pytest.mark.slow
def test_tasks_independent_of_threads_and_timing(client, era5_path, monkeypatch):
    """More or fewer tasks than workers: the same bits."""
    import xinsitu.batches.cluster as cluster

    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    ref = ds.insitu.stats(m, "train", diffs="time")
    for per_thread in (1, 3, 50):
        monkeypatch.setattr(cluster, "TASKS_PER_THREAD", per_thread)
        assert same(ds.insitu.stats(m, "train", diffs="time", client=client), ref)


def test_progress_bar_without_client(era5_path, capsys):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    ds.insitu.stats(m, "train", progress=True)
    ds.insitu.validity(m, "train", progress=True)
    err = capsys.readouterr().err
    assert "stats of train" in err and "train epoch 0" in err


def test_threads_share_one_job(era5_path):
    """Parts of one shipped job run at once in threads of one process (a worker with several threads)."""
    from xinsitu.batches.cluster import Shipped, _run_part
    from xinsitu.batches.stats import StatsPass, merge_stats

    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    shipped = Shipped(StatsPass(ds, m, "train", diffs="time"), "stats", "here")
    import pickle

    there = pickle.loads(pickle.dumps(shipped))
    got: list = []
    threads = [threading.Thread(target=lambda i=i: got.append(_run_part(there, i, 5))) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert same(merge_stats(got), ds.insitu.stats(m, "train", diffs="time"))
