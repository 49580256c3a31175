"""The next epoch's first buffer is read while an epoch ends (no wait at an epoch start): the
epochs that follow are bit for bit those of plain xarray, in order, whether the read ahead is
taken (``set_epoch(e + 1)``), dropped (another epoch, a resume, a range of batches) or made for
windows; ``io_stats`` of each epoch counts its own reads. Speed: bench/epochs_bench.py."""
from __future__ import annotations

import numpy as np
import pytest

import xinsitu
from xinsitu.batches.ahead import settle
from xinsitu.io import loop as _loop

VARS = ["t2m", "u10"]


def _gen(path: str, **kw):
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    kw = {"batch_size": 5, "block_chunks": 2, "output": "numpy", "variables": VARS, **kw}
    return ds, m, ds.insitu.batches(m, "train", **kw)


def _oracle(ds, gen, epoch: int) -> list[dict[str, np.ndarray]]:
    """Epoch ``epoch`` as plain xarray gives it: ``ds.isel`` of each batch's sample ids."""
    out = []
    for ids in gen.batch_ids(epoch):
        pos = np.asarray(ids, dtype=np.int64)  # the train split starts at time 0: id = time position
        out.append({v: ds[v].isel(time=pos).values for v in VARS})
    return out


def _epoch(gen) -> list[dict[str, np.ndarray]]:
    return [{k: np.array(v, copy=True) for k, v in b.items()} for b in gen]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        all(np.array_equal(x[k], y[k], equal_nan=True) for k in y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("shuffle", [True, False])
def test_read_ahead_taken_gives_the_same_epochs(era5_path, shuffle):
    ds, _, gen = _gen(era5_path, shuffle=shuffle)
    for e in range(3):
        gen.set_epoch(e)
        got = _epoch(gen)
        assert gen._ahead is not None and gen._ahead.epoch == e + 1  # the next epoch's first buffer is on its way
        assert _same(got, _oracle(ds, gen, e))
        st = gen.io_stats
        assert st["epoch"] == e and st["batches"] == len(got)


def test_read_ahead_dropped_for_another_epoch_or_a_resume(era5_path):
    ds, _, gen = _gen(era5_path)
    gen.set_epoch(0)
    _epoch(gen)
    gen.set_epoch(5)  # not the epoch read ahead (1): dropped, epoch 5 read as it is
    assert _same(_epoch(gen), _oracle(ds, gen, 5))
    gen.set_epoch(6)
    it = iter(gen)
    next(it)
    state = gen.state_dict()
    del it
    _, _, again = _gen(era5_path)
    again.set_epoch(0)
    _epoch(again)  # reads epoch 1's first buffer ahead
    again.load_state_dict(state)  # ... but the run resumes in epoch 6 after one batch
    assert _same(_epoch(again), _oracle(ds, gen, 6)[1:])
    part = list(gen.iter_batches(1, 3))  # a range of batches: no read ahead made or taken
    assert _same([{k: np.asarray(v) for k, v in b.items()} for b in part], _oracle(ds, gen, 6)[1:3])


def test_read_ahead_with_windows(era5_path):
    """Windows spill into the next unit: the first buffer is read by the run (halo plan), still right."""
    ds, _, gen = _gen(era5_path, window={"time": 3})
    for e in range(2):
        gen.set_epoch(e)
        got = _epoch(gen)
        ref = []
        for ids in gen.batch_ids(e):
            ref.append({v: np.stack([ds[v].isel(time=slice(int(i), int(i) + 3)).values for i in ids]) for v in VARS})
        assert len(got) == len(ref)
        for x, y in zip(got, ref, strict=True):
            for v in VARS:
                assert np.array_equal(x[v], y[v], equal_nan=True)


def test_read_ahead_off(era5_path):
    ds, _, gen = _gen(era5_path)
    gen.read_ahead = False
    gen.set_epoch(0)
    _epoch(gen)
    assert gen._ahead is None
    gen.set_epoch(1)
    assert _same(_epoch(gen), _oracle(ds, gen, 1))


def test_read_ahead_stays_within_the_buffers_held(era5_path):
    """The next epoch's first buffer is read once the run gives a buffer back, never as one more buffer
    beside those the run holds (SPEC §5: memory within the buffers' byte budget); every buffer, the
    last ones too, goes back to the pool. Batches of one buffer each (8 steps a chunk): none spans two,
    so the run borrows no buffer past its depth."""
    from xinsitu.batches.pipeline import EpochRun

    ds, _, gen = _gen(era5_path, block_chunks=1, batch_size=8)
    gen.buffer_budget = 1  # the read-ahead depth stays at its start (3 buffers), however small they are
    loader = gen._item_loader()
    held, most = [0], [0]
    load, recycle = loader.load, loader.recycle

    async def counted_load(*a, **k):
        buf = await load(*a, **k)
        held[0] += 1  # (on the I/O loop: one thread counts up)
        most[0] = max(most[0], held[0])
        return buf

    def counted_recycle(buf):
        held[0] -= 1  # (the GIL makes the count exact enough for a bound)
        recycle(buf)

    loader.load, loader.recycle = counted_load, counted_recycle
    for e in range(3):
        gen.set_epoch(e)
        assert _same(_epoch(gen), _oracle(ds, gen, e))
        assert gen._ahead is not None and gen._ahead.epoch == e + 1
        assert held[0] <= 1  # at most the buffer read ahead: the run gave back all of its own
    assert most[0] <= EpochRun.start_depth, most[0]


# one step a chunk (batches filled in place), buffers of blocks, shards of one-step chunks
@pytest.mark.parametrize("chunk_time, shard_time", [(1, None), (4, None), (1, 4)])
def test_an_archive_rewritten_between_epochs_is_read_as_it_is_now(tmp_path, chunk_time, shard_time):
    """The next epoch's first buffer is read as an epoch ends: an archive rewritten before the next epoch
    (no cache) gave that epoch's first samples as they were before the rewrite and the others as after
    (8 of 40 old). A read ahead is dropped where a local chunk file (or shard) it read was written since it
    began; one whose files did not change is taken. A shard's index, kept, is read again where its file was
    written since (its inner chunks were read at their old places: other values, or a decode error)."""
    import zarr

    from tests.support.clock import past_the_writes
    from xinsitu.synthetic import write_era5_like

    path = str(tmp_path / "a.zarr")
    write_era5_like(path, nt=40, ny=4, nx=6, chunk_time=chunk_time, shard_time=shard_time)
    ds, _, gen = _gen(path, batch_size=8, block_chunks=8 // chunk_time)
    gen.set_epoch(0)
    assert _same(_epoch(gen), _oracle(ds, gen, 0))
    rng = np.random.default_rng(1)
    for v in VARS:
        arr = zarr.open_array(f"{path}/{v}", mode="r+")
        arr[...] = arr[...] + 100 + rng.random(arr.shape)  # (chunks of other sizes: a shard's index changes)
    past_the_writes(path)  # (so that epoch 3's read ahead, below, begins past them: a short epoch may not)
    gen.set_epoch(1)
    got = _epoch(gen)
    assert _same(got, _oracle(ds, gen, 1)) and float(got[0]["t2m"].min()) > 150
    gen.set_epoch(2)
    _epoch(gen)
    task, _ = gen._take_ahead(3, 0)
    assert task is not None  # (nothing written since: taken)
    _loop.run(settle(task), timeout=30)


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_generator_iterated_again_without_set_epoch_uses_its_read_ahead(era5_path, shuffle):
    """A validation loop iterates one generator each epoch without ``set_epoch``: the read ahead was made
    for the next epoch and dropped at every pass, so a split of one or two buffers was read twice a pass
    (SPEC §5: 1.15× at most). In order, any epoch's first buffer serves; shuffled, the epoch iterated again
    is read ahead from its second pass on."""
    ds, m, _ = _gen(era5_path)
    gen = ds.insitu.batches(m, "val", batch_size=5, block_chunks=2, output="numpy", variables=VARS, shuffle=shuffle)
    start = int(m.indices("val")["time"][0])
    want = [{v: ds[v].isel(time=np.asarray(ids, dtype=np.int64) + start).values for v in VARS}
            for ids in gen.batch_ids(0)]
    for k in range(4):
        assert _same(_epoch(gen), want)
        assert gen._ahead is not None and gen._ahead.epoch == (1 if k == 0 else 0)  # (then this epoch again)
    gen.set_epoch(1)
    task, _ = gen._take_ahead(1, 0)  # epoch 0's first buffer: what epoch 1 starts with, in order
    assert (task is not None) == (not shuffle)
    if task is not None:
        _loop.run(settle(task), timeout=30)


@pytest.mark.parametrize("block_chunks", [1, 2])
def test_no_read_ahead_after_an_epoch_served_from_the_memory_tier(era5_path, block_chunks):
    """An epoch whose every chunk came from the cache's memory tier reads the next one's first buffer as it
    starts (a gather away), not ahead: one read ahead was one more buffer held beside the caller's last batch,
    so a batch's arrays were made again (every page faulted in) in one cached epoch in two. An epoch that read
    anything (the cold one) still reads ahead; every epoch is plain xarray's."""
    ds, _, gen = _gen(era5_path, cache=True, block_chunks=block_chunks, seed=1)
    gen.set_epoch(0)
    assert _same(_epoch(gen), _oracle(ds, gen, 0))
    assert gen._ahead is not None  # the cold epoch read: the next epoch's first buffer is on its way
    for e in range(1, 4):
        gen.set_epoch(e)
        assert _same(_epoch(gen), _oracle(ds, gen, e))
        assert gen.io_stats["requests"] == 0
        if e > 1:  # (epoch 1's reads include what epoch 0's read ahead fetched for it)
            assert gen._ahead is None


def _read_ahead_done(gen) -> None:
    """Wait until the next epoch's first buffer, read ahead, is in (so a change after it is one it missed)."""
    import asyncio

    assert gen._ahead is not None
    _loop.run(asyncio.wait([gen._ahead.task]), timeout=30)


def test_a_file_behind_icechunk_virtual_chunks_rewritten_between_epochs_is_read_as_it_is_now(tmp_path):
    """A read-only Icechunk session whose chunks are byte ranges of a local file: the file rewritten after the
    next epoch's first buffer was read ahead. That buffer was served (8 of 32 samples old); the files its
    snapshot references are looked at (their state, as the cache looks at them) before it is taken."""
    from tests.cache.test_cache_virtual import NT, _repo

    repo, raw = _repo(tmp_path)
    ds = xinsitu.open_zarr(repo.readonly_session(branch="main").store)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", batch_size=4, block_chunks=2, output="numpy", shuffle=False)
    assert len(_epoch(gen)) == NT // 4
    _read_ahead_done(gen)
    (np.arange(NT * 15, dtype="<f4") + 10000).tofile(raw)
    gen.set_epoch(1)
    got = np.concatenate([b["a"] for b in _epoch(gen)])
    np.testing.assert_array_equal(got, ds.a.values)
    assert got.min() >= 10000


def test_no_read_ahead_from_a_writable_icechunk_session(tmp_path):
    """A writable session, written into between epochs (in this process, committed or not): what the read ahead
    read before the write was served, a whole epoch on a small archive. Such a session is read as it is."""
    icechunk = pytest.importorskip("icechunk")
    import xarray as xr

    icechunk.set_logs_filter("error")
    repo = icechunk.Repository.create(icechunk.local_filesystem_storage(str(tmp_path / "repo")))
    s = repo.writable_session("main")
    src = xr.Dataset({"t2m": (("time", "x"), np.arange(40 * 3, dtype="f4").reshape(40, 3))})
    src.to_zarr(s.store, encoding={"t2m": {"chunks": (4, 3)}}, zarr_format=3, consolidated=False)
    s.commit("first")
    ws = repo.writable_session("main")
    ds = xinsitu.open_zarr(ws.store)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", batch_size=4, output="numpy", shuffle=False)
    _epoch(gen)
    assert gen._ahead is None
    (src + 1000).to_zarr(ws.store, region="auto", consolidated=False)
    gen.set_epoch(1)
    np.testing.assert_array_equal(np.concatenate([b["t2m"] for b in _epoch(gen)]), src.t2m.values + 1000)


def test_a_netcdf_file_changed_between_epochs_is_refused_before_a_batch_of_it(tmp_path):
    """A file ``open_netcdf`` references, changed after the next epoch's first buffer was read ahead: that buffer
    was served as if nothing had changed (the whole epoch, on a small file). The change is said as a read of
    the file says it (SPEC §6: a file changed after opening is a clear error), before any batch of that epoch."""
    xr = pytest.importorskip("xarray")
    pytest.importorskip("h5netcdf")
    from xinsitu.virtual import open_netcdf

    path = str(tmp_path / "f.nc")
    src = xr.Dataset({"t2m": (("time", "x"), np.arange(40 * 3, dtype="f4").reshape(40, 3))})
    src.to_netcdf(path, engine="h5netcdf", encoding={"t2m": {"chunksizes": (4, 3)}})
    ds = open_netcdf(path)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", batch_size=4, output="numpy", shuffle=False)
    _epoch(gen)
    _read_ahead_done(gen)
    (src + 1000).to_netcdf(path, engine="h5netcdf", encoding={"t2m": {"chunksizes": (4, 3)}})
    gen.set_epoch(1)
    it = iter(gen)
    with pytest.raises(Exception, match="changed after it was opened"):
        next(it)


def test_no_read_ahead_from_an_in_memory_store():
    """A zarr ``MemoryStore`` written into between epochs (in this process, nothing on disk to look at): what the
    read ahead read before the write was served, the whole next epoch on a small archive."""
    import xarray as xr
    import zarr

    store = zarr.storage.MemoryStore()
    src = xr.Dataset({"t2m": (("time", "x"), np.arange(40 * 3, dtype="f4").reshape(40, 3))})
    src.to_zarr(store, encoding={"t2m": {"chunks": (4, 3)}}, zarr_format=3, consolidated=False)
    ds = xinsitu.open_zarr(store)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", batch_size=4, output="numpy", shuffle=False)
    _epoch(gen)
    assert gen._ahead is None
    (src + 1000).to_zarr(store, region="auto", consolidated=False)
    gen.set_epoch(1)
    np.testing.assert_array_equal(np.concatenate([b["t2m"] for b in _epoch(gen)]), src.t2m.values + 1000)
