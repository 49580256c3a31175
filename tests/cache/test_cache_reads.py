"""``cache=`` on batches and stats: cached epochs give the very same batches in the same order
(memory tier, disk tier, a budget of half the split, ranks, shards), memory stays within the
budget, a disk cache serves a second generator and a second process from its first epoch, a
rewritten chunk file is never served stale, and DataLoader workers (fork, spawn) get the same
epochs. Every subprocess runs under a timeout; no timed assertion."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys

import numpy as np
import pytest
import zarr

import xinsitu
from tests.batches.test_torch import _job  # the DataLoader job in a subprocess, under a timeout
from tests.support.clock import past_the_writes
from xinsitu.cache.chunk_cache import ChunkCache
from xinsitu.synthetic import write_era5_like

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARS = ["t2m", "u10", "tp"]


def _gen(path: str, cache=None, **kw):
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    kw = {"batch_size": 5, "block_chunks": 2, "output": "numpy", "variables": VARS, **kw}
    return ds.insitu.batches(m, "train", cache=cache, **kw)


def _epochs(gen, epochs=(0, 1, 2)) -> list[list[dict[str, np.ndarray]]]:
    out = []
    for e in epochs:
        gen.set_epoch(e)
        out.append([{k: np.array(v, copy=True) for k, v in b.items()} for b in gen])
    return out


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        len(ea) == len(eb) and all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k], equal_nan=True) for k in x)
                                   for x, y in zip(ea, eb, strict=True))
        for ea, eb in zip(a, b, strict=True))


def _split_bytes(gen) -> int:
    """Decoded bytes of the chunks the split reads (what a cache holding all of it keeps)."""
    from xinsitu.batches.describe import _epoch_bytes

    return _epoch_bytes(gen, gen.plan())


# ------------------------------------------------------------------------------------- the oracle
@pytest.mark.parametrize("tier", ["memory", "disk", "half"])
def test_cached_epochs_equal_uncached(era5_path, tmp_path, tier):
    """Epochs 0..2 with the cache are the epochs without it, bit for bit and in order."""
    ref = _epochs(_gen(era5_path))
    probe = _gen(era5_path)
    split = _split_bytes(probe)
    cache = {"memory": ChunkCache(memory="1GB"), "disk": ChunkCache(memory=0, disk=tmp_path / "c"),
             "half": ChunkCache(memory=split // 2)}[tier]
    gen = _gen(era5_path, cache=cache)
    got = _epochs(gen, (0,))
    first = gen.io_stats
    got += _epochs(gen, (1, 2))
    assert _same(got, ref)
    n = first["chunks"]
    assert first["cache_misses"] == n and first["cache_hits"] == 0 and first["requests"] == n
    st = gen.io_stats
    assert st["chunks"] == n and st["cache_hits"] + st["cache_misses"] == n
    if tier == "memory":
        assert st["cache_hits"] == n and st["requests"] == 0 and st["bytes_read"] == 0
    elif tier == "disk":
        assert st["cache_hits"] == st["cache_disk_hits"] == n and st["requests"] == 0
    else:  # keeps what fits: about half the chunks hit, every epoch after the first
        assert 0.3 * n <= st["cache_hits"] <= 0.7 * n, st
        assert st["requests"] == st["cache_misses"]
    assert cache.stats.memory_bytes <= cache.memory_budget  # the cache's own accounting


@pytest.mark.parametrize("chunk_time", [1, 3])
@pytest.mark.parametrize("budget", ["all", "half"])
@pytest.mark.slow
def test_whole_chunk_slots_are_copied_from_the_cache_at_once(tmp_path, monkeypatch, chunk_time, budget):
    """Where each slot of a buffer is one whole chunk (time chunks holding whole maps), batches are
    gathered straight from the cache's slab where it holds every chunk of the buffer; where each chunk
    is one sample (no buffer), the chunks it holds are copied straight into the batch; else the chunks
    it holds go in with one copy per variable and buffer (``Reader.take_cached``) and those it lacks are
    read as usual: the epochs are the uncached ones, bit for bit, also when only some of a buffer's
    chunks are held."""
    from xinsitu.io.reader import Reader

    path = str(tmp_path / "a.zarr")
    write_era5_like(path, nt=61, ny=3, nx=4, chunk_time=chunk_time)  # the last chunk partial where chunk_time=3
    ref = _epochs(_gen(path, block_chunks=4))
    served, slabs = [], []
    real = Reader.take_cached

    async def spy(self, src, coords, out):
        rest, slab = await real(self, src, coords, out)
        served.append(len(coords) - len(rest))
        slabs.append(slab is not None)
        return rest, slab

    monkeypatch.setattr(Reader, "take_cached", spy)
    split = _split_bytes(_gen(path, block_chunks=4))
    cache = ChunkCache(memory="1GB" if budget == "all" else split // 2)
    gen = _gen(path, cache=cache, block_chunks=4)
    gen.read_ahead = False  # else the next epoch's first buffer is read (and counted) before the clear
    assert _same(_epochs(gen), ref)
    served.clear()
    slabs.clear()
    _epochs(gen, (3,))
    st = gen.io_stats
    assert 0 < sum(served) <= st["cache_hits"]
    if chunk_time == 1:  # every slot is a whole chunk: every hit went in through the fast path
        assert sum(served) == st["cache_hits"]
    if gen.buffer_reason is None:  # one sample per chunk: no buffer, each hit copied once, into the batch
        assert chunk_time == 1 and slabs and not any(slabs)
    elif budget == "all":  # the cache holds every chunk, in one slab per variable: gathered from it, no copy
        assert all(slabs)
    else:
        assert not all(slabs)
    if budget == "all":
        assert st["cache_hits"] == st["chunks"] and st["requests"] == 0
    else:
        assert 0 < st["cache_hits"] < st["chunks"] and st["requests"] == st["cache_misses"]


def test_cache_true_and_memory_string(era5_path):
    for spelling in (True, "memory"):
        gen = _gen(era5_path, cache=spelling)
        assert isinstance(gen.cache, ChunkCache) and gen.cache.disk is None
        _epochs(gen, (0, 1))
        assert gen.io_stats["cache_hits"] == gen.io_stats["chunks"] > 0
    assert _gen(era5_path).cache is None


def test_directory_spelling_gives_a_disk_tier(era5_path, tmp_path):
    gen = _gen(era5_path, cache=str(tmp_path / "cachedir"))
    assert gen.cache.disk == str(tmp_path / "cachedir")
    _epochs(gen, (0,))
    assert any(f.endswith(".chunk") for _, _, fs in os.walk(tmp_path / "cachedir") for f in fs)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_with_a_cache(era5_path, world_size):
    for rank in range(world_size):
        ref = _epochs(_gen(era5_path, rank=rank, world_size=world_size))
        gen = _gen(era5_path, cache=ChunkCache(memory="1GB"), rank=rank, world_size=world_size)
        assert _same(_epochs(gen), ref)


def test_shuffle_off_windows_and_xarray_output(era5_path):
    """Other read shapes: windows spanning chunks (halo hand-over) and unshuffled xarray batches."""
    for kw in ({"window": {"time": 3}}, {"shuffle": False, "output": "xarray"}):
        ref_gen, gen = _gen(era5_path, **kw), _gen(era5_path, cache=True, **kw)
        for e in range(3):
            ref_gen.set_epoch(e)
            gen.set_epoch(e)
            for a, b in zip(ref_gen, gen, strict=True):
                if isinstance(a, dict):
                    assert all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)
                else:
                    assert a.identical(b)
        assert gen.io_stats["cache_hits"] > 0 and gen.io_stats["cache_misses"] == 0


def test_sharded_archive(tmp_path):
    path = str(tmp_path / "sharded.zarr")
    write_era5_like(path, nt=120, ny=6, nx=10, chunk_time=8, shard_time=32)
    ref = _epochs(_gen(path))
    gen = _gen(path, cache=ChunkCache(memory="1GB"))
    assert _same(_epochs(gen), ref)
    assert gen.io_stats["cache_hits"] == gen.io_stats["chunks"] > 0 and gen.io_stats["requests"] == 0


def test_repr_shows_the_cache(era5_path):
    gen = _gen(era5_path, cache=ChunkCache(memory="10MB"))
    assert "cache" in repr(gen) and "10.0 MB" in repr(gen)
    _epochs(gen, (0, 1))
    text = repr(gen)
    assert "hits" in text and "misses" in text
    assert "cache" not in repr(_gen(era5_path)).split("Last epoch")[0].split("output")[1]


# ------------------------------------------------------------------------------------------ disk tier
def test_a_disk_cache_serves_a_second_generator_from_its_first_epoch(era5_path, tmp_path):
    ref = _epochs(_gen(era5_path), (0,))
    first = _gen(era5_path, cache=tmp_path)
    _epochs(first, (0,))
    second = _gen(era5_path, cache=ChunkCache(memory=0, disk=tmp_path))
    assert _same(_epochs(second, (0,)), ref)
    st = second.io_stats
    assert st["cache_disk_hits"] == st["chunks"] > 0 and st["requests"] == 0


_SECOND_PROCESS = """
import json, sys
sys.path.insert(0, sys.argv[3])
from tests.cache.test_cache_reads import _gen, _epochs
from xinsitu.cache.chunk_cache import ChunkCache
gen = _gen(sys.argv[1], cache=ChunkCache(memory=0, disk=sys.argv[2]))
got = _epochs(gen, (0,))
print(json.dumps({"stats": {k: gen.io_stats[k] for k in ("chunks", "requests", "cache_disk_hits")},
                  "sums": [[float(np.nansum(v)) for v in b.values()] for b in got[0]]}))
""".replace("import json, sys", "import json, sys\nimport numpy as np")


@pytest.mark.slow
def test_a_disk_cache_serves_another_process(era5_path, tmp_path):
    _epochs(_gen(era5_path, cache=tmp_path), (0,))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", _SECOND_PROCESS, era5_path, str(tmp_path), ROOT], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["stats"]["cache_disk_hits"] == out["stats"]["chunks"] > 0 and out["stats"]["requests"] == 0
    ref = _epochs(_gen(era5_path), (0,))[0]
    assert out["sums"] == [[float(np.nansum(v)) for v in b.values()] for b in ref]


def _rewrite_first_chunk(path: str) -> None:
    """New values for t2m's first time chunk (the file is written again)."""
    arr = zarr.open_array(os.path.join(path, "t2m"), mode="r+")
    ct = arr.chunks[0]
    arr[:ct] = np.asarray(arr[:ct]) + 100.0


@pytest.mark.parametrize("tier", ["disk", "memory", "both"])
@pytest.mark.parametrize("window", [None, 2])  # whole chunks from the memory tier, or regions of them
def test_a_rewritten_chunk_file_is_never_served_stale(tmp_path, tier, window):
    """The disk tier outlives the process: it keys each local chunk file by size, modification time
    and inode, so a rewritten file is a miss for the next run. The memory tier's keys cost no ``stat``:
    a new generator given the same ``ChunkCache`` checks once each chunk an earlier one kept, by its
    file's change time, and reads the rewritten one again; the others stay hits."""
    path = str(tmp_path / "era5.zarr")
    write_era5_like(path, nt=64, ny=4, nx=6, chunk_time=8)
    cache = ChunkCache(memory=0 if tier == "disk" else "1GB", disk=None if tier == "memory" else tmp_path / "c")
    kw = {"shuffle": False, **({"window": {"time": window}} if window else {})}
    gen = _gen(path, cache=cache, **kw)
    _epochs(gen, (0, 1))
    assert gen.io_stats["cache_hits"] == gen.io_stats["chunks"]
    _rewrite_first_chunk(path)
    ref = _epochs(_gen(path, **kw), (0,))
    again = _gen(path, cache=cache, **kw)
    got = _epochs(again, (0, 1))
    assert _same(got[:1], ref)
    st = again.io_stats  # of epoch 1: every chunk from the cache
    assert st["cache_hits"] == st["chunks"] and st["cache_misses"] == 0
    assert _same(got[1:], _epochs(_gen(path, **kw), (1,)))
    again = _gen(path, cache=cache, **kw)  # a third generator: the chunk read again is no longer stale
    _epochs(again, (0,))
    st = again.io_stats
    assert st["cache_hits"] == st["chunks"] and st["cache_misses"] == 0
    if tier != "memory":
        assert st["cache_disk_hits"] == (st["chunks"] if tier == "disk" else 0)
    fresh = _gen(path, cache=ChunkCache(memory=0, disk=tmp_path / "c") if tier != "memory" else True, **kw)
    assert _same(_epochs(fresh, (0,)), ref)  # a new cache, as the next run makes


def test_the_memory_tier_checks_what_an_earlier_generator_kept(tmp_path):
    """The counts of the memory tier's check: a second generator on the same ``ChunkCache`` reads the
    one rewritten chunk again (a miss), finds every other chunk of the epoch in memory, and a chunk
    file deleted since (read as the fill value) is not served from memory either."""
    path = str(tmp_path / "era5.zarr")
    write_era5_like(path, nt=64, ny=4, nx=6, chunk_time=8)
    past_the_writes(path)  # (a chunk written just before a reader began is read again by the next)
    cache = ChunkCache(memory="1GB")
    gen = _gen(path, cache=cache, shuffle=False)
    _epochs(gen, (0,))
    n = gen.io_stats["chunks"]
    _rewrite_first_chunk(path)
    past_the_writes(path)
    again = _gen(path, cache=cache, shuffle=False)
    _epochs(again, (0,))
    assert again.io_stats["cache_misses"] == 1 and again.io_stats["cache_hits"] == n - 1
    os.remove(os.path.join(path, "u10", "c", "1", "0", "0"))
    with pytest.warns(UserWarning, match="no object in the store"):
        ref = _epochs(_gen(path, shuffle=False), (0,))
    third = _gen(path, cache=cache, shuffle=False)
    with pytest.warns(UserWarning, match="no object in the store"):
        assert _same(_epochs(third, (0,)), ref)
    assert third.io_stats["cache_misses"] == 1


@pytest.mark.parametrize("publish", ["rename", "symlink"])
@pytest.mark.parametrize("tier", ["memory", "both"])
def test_an_archive_swapped_in_by_a_rename_or_a_link_is_never_served_stale(tmp_path, publish, tier):
    """A new version written beside the archive before the first generator ran (its files are older
    than what the memory tier kept, so their change times tell nothing), then published by renaming
    the directory into place or by repointing a link: a second generator on the same ``ChunkCache``
    reads the new version (no hit), as an uncached one does."""
    cur, new = str(tmp_path / "era5.zarr"), str(tmp_path / "era5-new.zarr")
    write_era5_like(new, nt=64, ny=4, nx=6, chunk_time=8, seed=1)
    old = str(tmp_path / "era5-old.zarr")
    write_era5_like(old, nt=64, ny=4, nx=6, chunk_time=8)
    if publish == "rename":
        os.rename(old, cur)
    else:
        os.symlink(old, cur)
    cache = ChunkCache(memory="1GB", disk=tmp_path / "c" if tier == "both" else None)
    first = _epochs(_gen(cur, cache=cache, shuffle=False), (0,))
    if publish == "rename":
        os.rename(cur, old)
        os.rename(new, cur)
    else:
        os.symlink(new, cur + ".tmp")
        os.replace(cur + ".tmp", cur)
    ref = _epochs(_gen(cur, shuffle=False), (0,))
    assert not _same(ref, first)
    again = _gen(cur, cache=cache, shuffle=False)
    assert _same(_epochs(again, (0,)), ref)
    st = again.io_stats
    assert st["cache_hits"] == 0 and st["cache_misses"] == st["chunks"] > 0


# --------------------------------------------------------------------------------------------- stats
def test_stats_with_a_cache_then_batches(era5_path):
    """A stats pass fills the cache (its reductions use chunks as scratch: the cached copies stay
    intact), a second pass and the epochs that follow are served from it, all values unchanged."""
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    ref_stats = ds.insitu.stats(m, "train", variables=VARS)
    cache = ChunkCache(memory="1GB")
    assert ds.insitu.stats(m, "train", variables=VARS, cache=cache) == ref_stats
    held = cache.stats.memory_entries
    assert held > 0 and cache.stats.misses == held
    assert ds.insitu.stats(m, "train", variables=VARS, cache=cache) == ref_stats
    assert cache.stats.hits == held
    gen = _gen(era5_path, cache=cache)
    assert _same(_epochs(gen, (0, 1)), _epochs(_gen(era5_path), (0, 1)))
    assert gen.io_stats["cache_hits"] == gen.io_stats["chunks"]


# -------------------------------------------------------------------------------------------- workers
def _forked_epoch(gen, conn) -> None:
    try:
        gen.set_epoch(1)
        sums = [[float(np.nansum(v)) for v in b.values()] for b in gen]
        conn.send({"stats": gen.io_stats, "sums": sums})
    except BaseException as e:  # noqa: BLE001 - reported to the test
        conn.send({"error": repr(e)})


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_a_forked_child_keeps_the_parent_s_memory_tier(era5_path):
    gen = _gen(era5_path, cache=ChunkCache(memory="1GB"))
    _epochs(gen, (0,))  # fills the memory tier (and runs the I/O loop and obstore in this process)
    ref = _gen(era5_path)
    ref.set_epoch(1)
    want = [[float(np.nansum(v)) for v in b.values()] for b in ref]
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_forked_epoch, args=(gen, child))
    p.start()
    try:
        assert parent.poll(120), "the forked child hung"
        out = parent.recv()
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert "error" not in out, out
    assert out["sums"] == want
    assert out["stats"]["cache_hits"] == out["stats"]["chunks"] > 0 and out["stats"]["requests"] == 0


@pytest.mark.parametrize("method, cache", [("fork", "memory"), ("spawn", "memory"), ("fork", "disk"),
                                           ("spawn", "disk")])
@pytest.mark.slow
def test_dataloader_workers_with_a_cache(era5_path, tmp_path, method, cache):
    """2 persistent workers, 2 epochs, the parent warmed by a whole epoch first: the same batches as
    the same job without a cache, each epoch exactly once."""
    pytest.importorskip("torch")
    spec = "memory" if cache == "memory" else str(tmp_path / "c")
    args = ("--open", "xinsitu", "--method", method, "--workers", "2", "--epochs", "2", "--persistent", "--warm")
    ref = _job(era5_path, tmp_path, *args)
    got = _job(era5_path, tmp_path, *args, "--cache", spec)
    assert "error" not in got, got.get("traceback")
    assert got["epochs"] == ref["epochs"] and got["len"] == ref["len"]
    if cache == "disk":
        assert any(f.endswith(".chunk") for _, _, fs in os.walk(tmp_path / "c") for f in fs)


# --------------------------------------------------------------------------------------------- remote
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.slow
def test_http_store_memory_and_disk_tiers(tmp_path, sharded):
    """A remote store (keys without a file to stat: looked up on the I/O loop for a memory tier, in a
    decode thread for a disk tier): cached epochs equal uncached ones and send no request."""
    from tests.support.servers import FileServer

    path = tmp_path / "era5.zarr"
    write_era5_like(str(path), nt=64, ny=4, nx=6, chunk_time=8, shard_time=32 if sharded else None)
    ref = _epochs(_gen(str(path)))
    with FileServer(tmp_path) as srv:
        url = f"{srv.url}/era5.zarr"
        for cache in (ChunkCache(memory="1GB"), ChunkCache(memory=0, disk=tmp_path / "c")):
            gen = _gen(url, cache=cache)
            srv.reset_counts()
            got = _epochs(gen, (0,))
            assert srv.requests > 0 and gen.io_stats["cache_misses"] == gen.io_stats["chunks"]
            srv.reset_counts()
            got += _epochs(gen, (1, 2))
            assert _same(got, ref)
            assert srv.requests == 0 and gen.io_stats["requests"] == 0
            assert gen.io_stats["cache_hits"] == gen.io_stats["chunks"] > 0


def test_cached_chunks_over_several_slabs_come_back_in_order(tmp_path, monkeypatch):
    """Where the memory tier could not make one slab for a variable (no address space that large: its
    slabs shrink), a buffer's chunks, all held but in several slabs, are copied in at once, each into its
    own row: the cached epochs are the uncached ones, bit for bit."""
    import types

    import xinsitu.cache.chunk_cache as chunk_cache

    path = str(tmp_path / "a.zarr")
    write_era5_like(path, nt=61, ny=3, nx=4, chunk_time=3)
    ref = _epochs(_gen(path, block_chunks=4))
    real = np.empty

    def small_slabs(shape, dtype=float, *a, **k):  # slabs of 2 rows at most: "no address space" for more
        if isinstance(shape, tuple) and len(shape) == 4 and shape[0] > 2:
            raise MemoryError
        return real(shape, dtype, *a, **k)

    monkeypatch.setattr(chunk_cache, "np", types.SimpleNamespace(**{**np.__dict__, "empty": small_slabs}))
    from xinsitu.io.reader import Reader

    copied = []
    real_take = Reader.take_cached

    async def spy(self, src, coords, out):
        rest, slab = await real_take(self, src, coords, out)
        copied.append(not rest and slab is None)
        return rest, slab

    monkeypatch.setattr(Reader, "take_cached", spy)
    gen = _gen(path, cache=ChunkCache(memory="1GB"), block_chunks=4)
    assert gen.buffer_reason is not None
    got = _epochs(gen)
    assert _same(got, ref)
    assert any(copied)  # every chunk held, in several slabs: copied in at once


def test_strings_are_read_past_the_disk_tier(tmp_path):
    """A variable of variable-length strings (as xarray writes a str/object array to zarr v3) with a disk
    tier: its chunks are not written there -- they have no fixed-size layout -- and read from the store,
    said once; the batches equal xarray's (the read failed, blamed on the store)."""
    import warnings

    import xarray as xr

    path = str(tmp_path / "s.zarr")
    names = np.array([f"st{i}" * (i % 3 + 1) for i in range(32)], dtype=object)
    xr.Dataset({"a": ("time", np.arange(32.0)), "station": ("time", names)}, coords={"time": np.arange(32)}).to_zarr(
        path, zarr_format=3, consolidated=False, encoding={"a": {"chunks": (4,)}, "station": {"chunks": (4,)}})
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    cache = ChunkCache(memory=0, disk=tmp_path / "c")
    gen = ds.insitu.batches(m, "train", batch_size=8, shuffle=False, output="numpy", cache=cache)
    with pytest.warns(RuntimeWarning, match="keeps nothing of arrays of Python objects or variable-length strings"):
        got = _epochs(gen, (0,))
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        got += _epochs(gen, (1,))
    assert not [w for w in again if "Python objects" in str(w.message)]  # said once
    for epoch in got:
        assert list(np.concatenate([b["station"] for b in epoch])) == list(names)
    assert gen.io_stats["cache_disk_hits"] == gen.io_stats["chunks"] // 2  # a's chunks, from the disk
    assert any("Python objects" in n for n in cache.notes)


def test_the_cache_saying_something_fails_no_read_where_warnings_are_errors(tmp_path):
    """Under ``-W error`` (pytest's ``filterwarnings = error``) what the cache says once -- here, its disk
    tier full -- raises where it is said, in a decode thread: the read goes on (it was reported as a
    damaged object in the store), and the cache's notes say it."""
    import warnings

    path = str(tmp_path / "era5.zarr")
    write_era5_like(path, nt=32, ny=4, nx=6, chunk_time=4)
    ref = _epochs(_gen(path), (0,))
    cache = ChunkCache(memory=0, disk=tmp_path / "c", disk_size="1kB")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert _same(_epochs(_gen(path, cache=cache), (0,)), ref)
    assert any("full" in n for n in cache.notes)
    from tests.support.servers import FileServer  # said as the chunks are looked up: a store it cannot trust

    cache = ChunkCache(memory=0, disk=tmp_path / "c2")
    with FileServer(tmp_path, etag="nginx") as srv, warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert _same(_epochs(_gen(f"{srv.url}/era5.zarr", cache=cache), (0,)), ref)
    assert any("no trustworthy version" in n for n in cache.notes)


def test_variables_in_memory_and_of_an_uncached_store_are_each_named(tmp_path):
    """SPEC §4, no silently empty tier: a Dataset in memory given a disk cache left the directory empty with
    no word; and a memory store's note named only its first variable, as if the others were cached."""
    import warnings

    import xarray as xr

    ds = xr.Dataset({"a": (("time", "x"), np.arange(24.0).reshape(8, 3)), "b": (("time", "x"), np.ones((8, 3)))})
    m = ds.chunk({"time": 2}).insitu.split("time", fractions={"train": 1.0})
    mem = ds.chunk({"time": 2}).load()
    cache = ChunkCache(memory=0, disk=tmp_path / "c")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = _epochs(mem.insitu.batches(m, "train", batch_size=4, shuffle=False, output="numpy", cache=cache), (0, 1))
    for epoch in got:
        np.testing.assert_array_equal(np.concatenate([b["a"] for b in epoch]), ds.a.values)
    assert [str(w.message) for w in said if "keeps nothing" in str(w.message)] == [
        "the chunk cache keeps nothing of variable 'a' nor of any other variable held in memory: their values are "
        "in memory already (loaded or computed by xarray), so no epoch reads them again; cache= serves variables "
        "read from a store (warned once)"]
    assert cache.notes == ["not cached: variable 'a', variable 'b' (its values are in memory already)"]
    store = zarr.storage.MemoryStore()
    ds.to_zarr(store, zarr_format=3, consolidated=False, encoding={v: {"chunks": (2, 3)} for v in ds})
    opened = xr.open_zarr(store, chunks=None, consolidated=False)
    cache = ChunkCache(memory=0, disk=tmp_path / "d")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _epochs(opened.insitu.batches(m, "train", batch_size=4, output="numpy", cache=cache), (0,))
    assert len(cache.notes) == 1 and cache.notes[0].startswith("not cached: variable 'a', variable 'b' (its store")


@pytest.mark.parametrize("open_", ["xinsitu", "xr", "dask"])
def test_a_big_endian_archive_reads_in_native_order_from_every_path(tmp_path, open_):
    """zarr v3 stored big-endian (``BytesCodec(endian="big")``), as zarr 3.1 decodes it (in that order):
    batches from the disk tier came as ``>f4`` from the second epoch on (``torch.from_numpy`` refuses them);
    and ``stats`` of an ``_Unsigned`` integer with a fill counted the fill as a value (xarray's decoder masks
    the byte-swapped fill of a big-endian array). Native order on every path now."""
    import xarray as xr
    import zarr.codecs as zc

    p = str(tmp_path / "be.zarr")
    g = zarr.open_group(p, mode="w", zarr_format=3)
    t = g.create_array("time", shape=(12,), chunks=(12,), dtype="i8", dimension_names=["time"],
                       attributes={"units": "hours since 2000-01-01"})
    t[:] = np.arange(12)
    big = {"serializer": zc.BytesCodec(endian="big")}
    x = g.create_array("x", shape=(12, 3), chunks=(4, 3), dtype="f4", dimension_names=["time", "c"], **big)
    x[:] = np.arange(36, dtype="f4").reshape(12, 3)
    raw = np.random.default_rng(0).integers(-2**31, 2**31 - 1, size=(12, 3), dtype="i4")
    raw[0, 0] = 2**31 - 1  # the fill
    u = g.create_array("u", shape=(12, 3), chunks=(4, 3), dtype="i4", dimension_names=["time", "c"],
                       attributes={"_Unsigned": "true", "scale_factor": 0.5, "_FillValue": 2**31 - 1}, **big)
    u[:] = raw
    ds = {"xinsitu": lambda: xinsitu.open_zarr(p), "xr": lambda: xr.open_zarr(p, chunks=None),
          "dask": lambda: xr.open_zarr(p)}[open_]()
    m = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", batch_size=4, shuffle=False, output="numpy", cache=str(tmp_path / "c"))
    for epoch in _epochs(gen, (0, 1, 2)):
        for v in ("x", "u"):
            assert all(b[v].dtype.isnative and b[v].dtype == ds[v].values.dtype for b in epoch), v
            np.testing.assert_array_equal(np.concatenate([b[v] for b in epoch]), ds[v].values)
    vals = ds.u.values.astype("float64")
    st = ds.insitu.stats(m, "train", variables=["u"])["u"]
    assert st["nan_count"] == 1 == int(np.isnan(vals).sum())
    np.testing.assert_allclose(st["mean"], np.nanmean(vals), rtol=1e-12)
    # zarr v2 declares the byte order in the dtype ('>i2'): xarray decodes in it (and masks an _Unsigned fill's
    # byte-swapped twin: its own quirk); batches and stats decode as it does, bit for bit
    p2 = str(tmp_path / "be2.zarr")
    g2 = zarr.open_group(p2, mode="w", zarr_format=2)
    a = g2.create_array("w", shape=(12, 3), chunks=(4, 3), dtype=">i2", fill_value=-129,
                        attributes={"_ARRAY_DIMENSIONS": ["time", "c"], "_Unsigned": "true", "_FillValue": -129})
    a[:] = np.array([[-129, 32767, 5]] * 12, dtype=">i2")
    zarr.consolidate_metadata(p2)
    v2 = {"xinsitu": lambda: xinsitu.open_zarr(p2), "xr": lambda: xr.open_zarr(p2, chunks=None),
          "dask": lambda: xr.open_zarr(p2)}[open_]()
    m2 = v2.insitu.split("time", fractions={"train": 1.0})
    got = np.concatenate([b["w"] for b in v2.insitu.batches(m2, "train", batch_size=4, shuffle=False,
                                                             output="numpy")])
    np.testing.assert_array_equal(got, v2.w.values)
    assert v2.insitu.stats(m2, "train")["w"]["nan_count"] == int(np.isnan(v2.w.values).sum())
