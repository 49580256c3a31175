"""Icechunk: a read-only session's store (by branch or by snapshot id) read end to end, and the
snapshot a split was made on recorded in its manifest (another snapshot warns)."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
import xarray as xr

import xinsitu
from tests.conftest import CT, NT, NX, NY
from tests.index.test_sampling import run_epoch
from xinsitu.index.snapshot import snapshot_of
from xinsitu.synthetic import era5_like, packing

icechunk = pytest.importorskip("icechunk", reason="the icechunk extra is not installed")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A repository on local storage: commit 1 the synthetic archive, commit 2 a change to t2m."""
    icechunk.set_logs_filter("error")  # "LocalFileSystem storage is not safe for concurrent commits"
    path = str(tmp_path_factory.mktemp("icechunk") / "repo")
    repo = icechunk.Repository.create(icechunk.local_filesystem_storage(path))
    ds = era5_like(NT, NY, NX)
    enc = {v: {"chunks": (CT, NY, NX) if "time" in ds[v].dims else (NY, NX)} for v in ds.data_vars}
    enc["tp"].update(packing())
    s = repo.writable_session("main")
    ds.to_zarr(s.store, encoding=enc, zarr_format=3, consolidated=False)
    first = s.commit("synthetic archive")
    s = repo.writable_session("main")
    (ds[["t2m"]].isel(time=slice(0, CT)) + 100).drop_vars(["lat", "lon"]).to_zarr(
        s.store, region={"time": slice(0, CT)}, consolidated=False)
    second = s.commit("t2m of the first chunk changed")
    return {"path": path, "repo": repo, "first": first, "second": second, "ds": ds}


def _session(repo: dict, how: str):
    r = icechunk.Repository.open(icechunk.local_filesystem_storage(repo["path"]))
    if how == "branch":
        return r.readonly_session(branch="main")
    return r.readonly_session(snapshot_id=repo[how])


@pytest.mark.parametrize("opener", ["xinsitu", "xr_nodask", "xr_dask"])
@pytest.mark.parametrize("how", ["branch", "first"])
@pytest.mark.slow
def test_readonly_session_epoch_matches_xarray(repo, how, opener):
    store = _session(repo, how).store
    if opener == "xinsitu":
        ds = xinsitu.open_zarr(store)
    else:
        ds = xr.open_zarr(store, chunks=None if opener == "xr_nodask" else {}, consolidated=False)
    m = ds.insitu.split("time", fractions={"train": 0.7, "val": 0.3}, gap=1)
    for split, output in (("train", "xarray"), ("val", "numpy")):
        gen = ds.insitu.batches(m, split, batch_size=6, output=output, block_chunks=2, seed=2)
        seen = run_epoch(ds, gen, output)
        assert np.array_equal(np.sort(seen), np.arange(gen.n_samples))


@pytest.mark.parametrize(("how", "shift"), [("first", 0.0), ("second", 100.0), ("branch", 100.0)])
def test_session_reads_its_snapshot(repo, how, shift):
    """The batches hold the data of the snapshot asked for (the first chunk of t2m differs between them)."""
    ds = xinsitu.open_zarr(_session(repo, how).store)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", batch_size=CT, output="numpy", shuffle=False, variables=["t2m", "tp"])
    b = next(iter(gen))
    exp = repo["ds"].t2m.isel(time=slice(0, CT)).values + np.float32(shift)
    assert np.array_equal(b["t2m"], exp)
    tp = xr.open_zarr(_session(repo, how).store, chunks=None).tp.isel(time=slice(0, CT)).values
    assert np.array_equal(b["tp"], tp, equal_nan=True) and np.isnan(tp).any()


def test_resume_on_a_session(repo):
    from tests.support.resume_check import run_test_save_load_state

    ds = xinsitu.open_zarr(_session(repo, "first").store)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})

    def make():
        return ds.insitu.batches(m, "train", batch_size=7, window={"time": 3}, block_chunks=2, seed=5)

    run_test_save_load_state(make, len(make()) // 2, epochs=2)


def test_session_dataset_pickles(repo):
    """spawn/forkserver DataLoader workers receive the Dataset pickled: a read-only session store pickles."""
    ds = xinsitu.open_zarr(_session(repo, "first").store)
    ds2 = pickle.loads(pickle.dumps(ds))
    m = ds2.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    run_epoch(ds, ds2.insitu.batches(m, "val", batch_size=8, output="numpy"), "numpy")


def _epoch_in_child(gen, conn) -> None:
    try:
        conn.send(("ok", len(list(gen))))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))


def test_forked_child_fails_at_once_naming_the_fix(repo):
    """Icechunk's runtime, like obstore's, cannot run in a process forked after it was used (a DataLoader
    worker under Linux's default start method): the read fails at once with the fix, never hangs."""
    import multiprocessing as mp

    ds = xinsitu.open_zarr(_session(repo, "first").store)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", batch_size=5, output="numpy")
    n = len(list(gen))  # the parent has used Icechunk now
    parent, child = mp.get_context("fork").Pipe()
    p = mp.get_context("fork").Process(target=_epoch_in_child, args=(gen, child), daemon=True)
    p.start()
    try:
        assert parent.poll(30), "the forked child neither read nor failed within 30 s: it hung"
        status, got = parent.recv()
    finally:
        p.join(5)
        if p.is_alive():
            p.kill()
    if status == "ok":
        assert got == n
    else:
        assert "spawn" in got and "num_workers=0" in got, got


# ----------------------------------------------------------------------------- snapshot ids
def test_snapshot_of(repo, era5_path):
    assert snapshot_of(xinsitu.open_zarr(_session(repo, "first").store)) == repo["first"]
    assert snapshot_of(xr.open_zarr(_session(repo, "branch").store)) == repo["second"]  # dask-backed too
    assert snapshot_of(xinsitu.open_zarr(_session(repo, "first").store)[["t2m"]].isel(lat=1)) == repo["first"]
    assert snapshot_of(xinsitu.open_zarr(era5_path)) is None  # plain Zarr: no snapshot
    assert snapshot_of(repo["ds"]) is None  # in memory
    s = repo["repo"].writable_session("main")
    assert snapshot_of(xinsitu.open_zarr(s.store)) == repo["second"]  # nothing changed yet: the base snapshot
    xr.Dataset({"extra": ("x", np.arange(3.0))}).to_zarr(s.store, group="other", zarr_format=3, consolidated=False)
    assert snapshot_of(xinsitu.open_zarr(s.store)) is None  # uncommitted changes: no snapshot


def test_manifest_records_the_snapshot(repo, tmp_path):
    ds = xinsitu.open_zarr(_session(repo, "first").store)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    assert m.snapshot == repo["first"]
    m.to_json(tmp_path / "m.json")
    assert xinsitu.SplitManifest.from_json(tmp_path / "m.json").snapshot == repo["first"]
    assert repo["first"] in m.summary() or repo["first"] in repr(m)


def test_split_used_on_another_snapshot_warns(repo):
    m = xinsitu.open_zarr(_session(repo, "first").store).insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    same = xinsitu.open_zarr(_session(repo, "first").store)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same snapshot: no warning
        same.insitu.batches(m, "train", batch_size=4)
    other = xinsitu.open_zarr(_session(repo, "branch").store)
    with pytest.warns(UserWarning, match=f"{repo['first']}.*{repo['second']}"):
        gen = other.insitu.batches(m, "train", batch_size=4)
    assert len(list(gen)) == len(gen)  # a warning, not an error: the chunk grid is the same


def test_a_writable_session_is_never_cached_under_its_snapshot(repo, tmp_path):
    """A writable session read with a disk cache, written (uncommitted) during the epoch: the chunks read
    after the write are not kept under the committed snapshot's id (they were, and a readonly session at
    that snapshot, in a new run, was served the uncommitted values from disk). A writable session is not
    cached at all, and the generator says so once, naming the readonly session."""
    import zarr

    r = icechunk.Repository.open(icechunk.local_filesystem_storage(repo["path"]))
    ws = r.writable_session("main")
    snap = str(ws.snapshot_id)
    cache = xinsitu.ChunkCache(memory="64MB", disk=tmp_path / "c")
    ds = xr.open_zarr(ws.store, chunks=None, consolidated=False)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen = ds.insitu.batches(m, "train", batch_size=CT, shuffle=False, output="numpy", variables=["t2m"],
                                cache=cache)
        it = iter(gen)
        next(it)
        zarr.open_group(ws.store, mode="r+")["t2m"][NT - CT:] = -999.0  # an edit, not committed
        list(it)
    said = [str(w.message) for w in caught if "chunk cache keeps nothing" in str(w.message)]
    assert len(said) == 1 and "writable Icechunk session" in said[0] and "readonly_session" in said[0], said
    assert gen.io_stats["cache_misses"] == 0 and gen.io_stats["cache_hits"] == 0
    ro = r.readonly_session(snapshot_id=snap)
    ref = xr.open_zarr(ro.store, chunks=None, consolidated=False)
    again = xinsitu.ChunkCache(memory=0, disk=tmp_path / "c")  # a new run's cache on the same directory
    got = list(ref.insitu.batches(m, "train", batch_size=CT, shuffle=False, output="numpy", variables=["t2m"],
                                  cache=again))
    np.testing.assert_array_equal(np.concatenate([b["t2m"] for b in got]), ref.t2m.values)


def test_a_sharded_array_is_read_by_byte_range_and_cached(tmp_path):
    """A sharded array in an Icechunk repository: its inner chunks are read by byte range through the
    store's own ``get``, as xarray reads them, counted in ``io_stats`` and kept by the cache (zarr read
    them for xinsitu before: uncached, said once, and counting 0 bytes)."""
    r = icechunk.Repository.create(icechunk.local_filesystem_storage(str(tmp_path / "repo")))
    s = r.writable_session("main")
    xr.Dataset({"a": (("time", "x"), np.arange(64.0).reshape(16, 4))}).to_zarr(
        s.store, zarr_format=3, consolidated=False, encoding={"a": {"chunks": (2, 4), "shards": (8, 4)}})
    s.commit("sharded")
    ds = xinsitu.open_zarr(r.readonly_session(branch="main").store)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen = ds.insitu.batches(m, "train", batch_size=4, shuffle=False, output="numpy", cache=True)
        got = [list(gen) for _ in range(2)]
        stats = gen.io_stats
    for epoch in got:
        np.testing.assert_array_equal(np.concatenate([b["a"] for b in epoch]), ds.a.values)
    said = [str(w.message) for w in caught if "chunk cache keeps nothing" in str(w.message)]
    assert not said and "not cached" not in repr(gen), said
    assert stats["cache_hits"] == stats["chunks"] == 8 and stats["requests"] == 0, stats
    first = ds.insitu.batches(m, "train", batch_size=4, shuffle=False, output="numpy")
    assert [b["a"].tolist() for b in first] == [b["a"].tolist() for b in got[0]]
    assert first.io_stats["bytes_read"] > 0 and first.io_stats["chunks"] == 8, first.io_stats


def test_a_generator_over_a_writable_session_says_how_to_send_it_to_workers(repo):
    """Pickled for spawned DataLoader workers, a generator (or map-style dataset) over a writable session gave
    Icechunk's own advice, for writers (``Session.fork()``, ``to_icechunk``); it names the read-only session."""
    r = icechunk.Repository.open(icechunk.local_filesystem_storage(repo["path"]))
    ds = xinsitu.open_zarr(r.writable_session("main").store)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    for what in (ds.insitu.batches(m, "train", batch_size=4, output="numpy"),
                 ds.insitu.dataset(m, "train", output="numpy")):
        with pytest.raises(TypeError, match=r"writable Icechunk session .*repo\.readonly_session\(\.\.\.\)"):
            pickle.dumps(what)
    ro = xinsitu.open_zarr(r.readonly_session(branch="main").store)
    assert len(pickle.loads(pickle.dumps(ro.insitu.batches(m, "train", batch_size=4, output="numpy")))) > 0
