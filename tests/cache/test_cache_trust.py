"""Issue 28, items 1-6: the disk cache never serves what the archive no longer holds, nor what
another user planted; it keeps its entries private, follows no link, never deletes what it did
not write, takes a special file for a miss and says when it cannot write.

Remote archives are served on 127.0.0.1 (moto S3, the HTTP server of ``tests/support``). The
tests run as root here: "another user" is uid 65534 by ``os.chown``, and the non-root case runs
a subprocess under ``setpriv``. Whatever could hang runs in a subprocess under a timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import zarr

from tests.cache.test_cache_reads import _epochs, _gen, _same
from xinsitu.cache.chunk_cache import ChunkCache, resolve_cache
from xinsitu.cache.disk_tier import _SUBDIR
from xinsitu.cache.keys import ChunkKey
from xinsitu.synthetic import write_era5_like

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOBODY = 65534
VARS = ["t2m", "u10", "tp"]


def _archive(path) -> str:
    write_era5_like(str(path), nt=64, ny=4, nx=6, chunk_time=8)
    return str(path)


def _rewrite(path: str) -> None:
    """New values in every chunk object of the variables read (same metadata; sizes may change)."""
    for v in VARS:
        arr = zarr.open_array(os.path.join(path, v), mode="r+")
        arr[...] = np.asarray(arr[...]) * 2 + 1


def _entries(disk) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(disk, _SUBDIR)) for f in fs if f.endswith(".chunk")]


# ---------------------------------------------------------------------------- 1. remote archives
@pytest.fixture(params=["http", "s3"])
def remote(request, tmp_path):
    """(url, open options, re-publish) of an archive served on 127.0.0.1, and the local copy."""
    from tests.support.servers import FileServer, MotoS3

    path = _archive(tmp_path / "era5.zarr")
    if request.param == "http":
        with FileServer(tmp_path) as srv:
            yield srv, f"{srv.url}/era5.zarr", {}, path, lambda: None
    else:
        with MotoS3() as s3:
            s3.upload(path, "bkt", "era5.zarr")
            yield None, "s3://bkt/era5.zarr", s3.options, path, lambda: s3.upload(path, "bkt", "era5.zarr")


def _remote_gen(url, opts, cache):
    import xinsitu

    ds = xinsitu.open_zarr(url, **opts)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    return ds.insitu.batches(m, "train", batch_size=5, block_chunks=2, output="numpy", variables=VARS,
                             shuffle=False, cache=cache)


@pytest.mark.slow
@pytest.mark.parametrize("disk_filled", [False, True])
def test_a_shared_cache_checks_remote_objects_an_earlier_generator_kept(tmp_path, remote, disk_filled):
    """One ``ChunkCache`` with both tiers, given to a generator and then, after the objects were
    replaced, to a new one: the memory tier's entries are checked by their objects' versions (the
    listing or ``HEAD``s the disk tier asks anyway) and the new generator gets the new values (it got
    the old ones from memory); with the archive unchanged since, a third one takes every chunk from
    memory. ``disk_filled``: an earlier run filled the disk tier, so the first generator's chunks came
    to memory from the disk, with the versions they were found by (they were kept unversioned, and
    served stale)."""
    srv, url, opts, path, publish = remote
    if disk_filled:
        _epochs(_remote_gen(url, opts, ChunkCache(memory=0, disk=tmp_path / "c")), (0,))
    cache = ChunkCache(memory="1GB", disk=tmp_path / "c")
    first = _remote_gen(url, opts, cache)
    old = _epochs(first, (0,))
    if disk_filled:
        assert first.io_stats["cache_disk_hits"] == first.io_stats["chunks"] > 0
    _rewrite(path)
    publish()
    new = _epochs(_remote_gen(url, opts, None), (0,))
    assert not _same(new, old)
    again = _remote_gen(url, opts, cache)
    assert _same(_epochs(again, (0,)), new)
    assert again.io_stats["cache_hits"] == 0
    third = _remote_gen(url, opts, cache)
    asked, served = cache.stats.version_requests, None if srv is None else srv.requests
    assert _same(_epochs(third, (0,)), new)
    st = third.io_stats
    assert st["cache_hits"] == st["chunks"] > 0 and st["cache_disk_hits"] == 0 and st["requests"] == 0
    assert cache.stats.version_requests > asked  # the check's own requests are counted
    if srv is not None:  # HTTP: one HEAD per object, and nothing else
        assert srv.requests - served == cache.stats.version_requests - asked


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["device", "memory"])
def test_a_device_tier_checks_remote_objects_an_earlier_generator_kept(tmp_path, remote, tier):
    """The GPU path's tier in device memory (``device=``, or the memory budget the GPU path moves there) on
    a remote archive, with a disk tier: its entries carry their objects' versions, asked as the disk tier
    asks, so a generator after the objects were replaced gets the new values (it got the old ones: kept
    without a version, an entry is never checked); with the archive unchanged since, every chunk comes
    from the device tier."""
    from tests.support.gpu import on_gpu

    srv, url, opts, path, publish = remote
    cache = ChunkCache(memory=0 if tier == "device" else "1GB", disk=tmp_path / "c")
    cache.device_budget = 1 << 30 if tier == "device" else 0  # (as ChunkCache(device=) sets it with a CUDA device)

    def epoch():
        gen, _ = on_gpu(_remote_gen(url, opts, cache))
        return _epochs(gen, (0,)), gen.io_stats

    old, _ = epoch()
    _rewrite(path)
    publish()
    new = _epochs(_remote_gen(url, opts, None), (0,))
    assert not _same(new, old)
    got, st = epoch()
    assert _same(got, new) and st["cache_hits"] == 0
    got, st = epoch()
    assert _same(got, new) and st["cache_hits"] == st["chunks"] > 0


@pytest.mark.slow
def test_a_rewritten_remote_object_is_never_served_stale(tmp_path, remote):
    """Run 1 fills the disk cache; the objects are replaced with new values; run 2 (a new process's
    cache on the same directory) gives the new values, as an uncached run does, not the old ones; an
    archive left as it is is served from the disk at the cost of one listing (S3) or one HEAD per
    object (HTTP), and no chunk fetched."""
    srv, url, opts, path, publish = remote
    disk = tmp_path / "c"
    first = _remote_gen(url, opts, ChunkCache(memory=0, disk=disk))
    old = _epochs(first, (0,))
    assert first.io_stats["cache_misses"] == first.io_stats["chunks"] > 0
    _rewrite(path)
    publish()
    new = _epochs(_remote_gen(url, opts, None), (0,))
    assert not _same(new, old)
    cache = ChunkCache(memory=0, disk=disk)
    again = _remote_gen(url, opts, cache)
    assert _same(_epochs(again, (0,)), new)
    assert again.io_stats["cache_disk_hits"] == 0 and cache.stats.version_requests > 0
    cache = ChunkCache(memory=0, disk=disk)  # the archive unchanged since: every chunk from the disk
    third = _remote_gen(url, opts, cache)
    if srv is not None:
        srv.reset_counts()
    assert _same(_epochs(third, (0,)), new)
    st = third.io_stats
    assert st["cache_disk_hits"] == st["chunks"] > 0 and st["requests"] == 0
    if srv is not None:  # HTTP cannot list: one HEAD per object, and one GET of an object whose ETag is checked
        # against its bytes (once per web server and process: at most once per array), and nothing else
        arrays = len(third.layouts)
        assert srv.requests == cache.stats.version_requests
        assert st["chunks"] <= cache.stats.version_requests <= st["chunks"] + arrays


@pytest.mark.slow
def test_immutable_skips_the_version_check(tmp_path, remote):
    """The opt-out: ``immutable=True`` declares that the archive is never rewritten; its disk entries
    are keyed without versions (no listing, no HEAD) -- and, as declared, a rewritten archive then
    still gets the old chunks."""
    srv, url, opts, path, publish = remote
    disk = tmp_path / "c"
    old = _epochs(_remote_gen(url, opts, ChunkCache(memory=0, disk=disk, immutable=True)), (0,))
    _rewrite(path)
    publish()
    cache = ChunkCache(memory=0, disk=disk, immutable=True)
    gen = _remote_gen(url, opts, cache)
    if srv is not None:
        srv.reset_counts()
    assert _same(_epochs(gen, (0,)), old)
    assert gen.io_stats["cache_disk_hits"] == gen.io_stats["chunks"] and cache.stats.version_requests == 0
    if srv is not None:
        assert srv.requests == 0


def test_versions_of_objects(tmp_path):
    """``object_versions``: a listing and HEADs give the same versions; a missing object is MISSING."""
    from tests.support.servers import MotoS3
    from xinsitu.cache.versions import MISSING, object_versions

    path = _archive(tmp_path / "era5.zarr")
    with MotoS3() as s3:
        s3.upload(path, "bkt", "era5.zarr")
        store = s3.store("bkt", prefix="era5.zarr")
        listed, n = object_versions(store, prefix="t2m")
        assert n == 1 and listed and all(k.startswith("t2m/") for k in listed)
        keys = sorted(listed)[:3] + ["t2m/c/99/0/0"]
        headed, n = object_versions(store, keys)
        assert n == 4 and headed == {**{k: listed[k] for k in keys[:3]}, "t2m/c/99/0/0": MISSING}


# --------------------------------------------------------------------- 2.-4. who may touch the cache
def test_a_directory_others_can_write_is_refused(tmp_path):
    """Another user could plant entries (with a right checksum) in a directory they can write or own."""
    open_to_all = tmp_path / "all"
    open_to_all.mkdir()
    os.chmod(open_to_all, 0o777)
    with pytest.raises(ValueError, match="all.*written by other users"):
        ChunkCache(disk=open_to_all)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ValueError, match="theirs.*owned by another user"):
        ChunkCache(disk=theirs)
    planted = tmp_path / "planted"  # the directory is fine, the entries' directory is another user's
    (planted / _SUBDIR).mkdir(parents=True, mode=0o755)
    os.chown(planted / _SUBDIR, NOBODY, NOBODY)
    with pytest.raises(ValueError, match=f"{_SUBDIR}.*owned by another user"):
        ChunkCache(disk=planted)
    shared_group = tmp_path / "group"  # a group that is not this user's alone: its members could write
    shared_group.mkdir()
    os.chmod(shared_group, 0o775)
    os.chown(shared_group, -1, NOBODY)
    with pytest.raises(ValueError, match="group.*written by other users"):
        ChunkCache(disk=shared_group)
    from xinsitu.cache.disk_tier import _private_group

    if _private_group(os.getegid()):  # a umask of 002 with user private groups: the user's own dirs are 0775
        upg = tmp_path / "upg"
        upg.mkdir()
        os.chmod(upg, 0o775)
        os.chown(upg, -1, os.getegid())
        ChunkCache(disk=upg).put("cd" * 16, np.arange(3.0))
    sticky = tmp_path / "sticky"  # like /tmp: others write, but cannot touch what is not theirs
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    ChunkCache(disk=sticky).put("ab" * 16, np.arange(3.0))
    with pytest.raises(ValueError, match="written by other users"):
        resolve_cache(str(open_to_all))


def test_planted_entries_in_a_shared_directory_are_never_served(tmp_path):
    """The campaign's attack: entries of a cache in a directory of mode 0777 rewritten by another user
    with -999 and a recomputed checksum. Such a directory is refused before anything is read."""
    path = _archive(tmp_path / "era5.zarr")
    disk = tmp_path / "shared"
    disk.mkdir()
    _epochs(_gen(path, cache=ChunkCache(memory=0, disk=disk), shuffle=False), (0,))
    os.chmod(disk, 0o777)
    with pytest.raises(ValueError, match="shared"):
        _gen(path, cache=str(disk))


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_entries_are_private_whatever_the_umask(tmp_path, umask):
    """Directories 0700 and files 0600 (the archive may be private); an older cache's 0755 directory
    is made private when opened."""
    old = os.umask(umask)
    try:
        disk = tmp_path / "c"
        disk.mkdir(mode=0o700)
        (disk / _SUBDIR).mkdir(mode=0o755)
        os.chmod(disk / _SUBDIR, 0o755)
        c = ChunkCache(memory=0, disk=disk)
        for i in range(8):
            c.put(f"{i:02x}" * 16, np.arange(4.0) + i)
    finally:
        os.umask(old)
    modes = {}
    for d, _, files in os.walk(disk / _SUBDIR):
        modes[d] = stat.S_IMODE(os.stat(d).st_mode)
        for f in files:
            modes[os.path.join(d, f)] = stat.S_IMODE(os.stat(os.path.join(d, f)).st_mode)
    assert len(modes) == 1 + 8 + 8
    assert all(m == (0o700 if os.path.isdir(p) else 0o600) for p, m in modes.items()), modes


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_the_folders_made_for_a_new_cache_path_are_private_whatever_the_umask(tmp_path, umask):
    """Issue 39, item 3c: ``ChunkCache(disk="new/a/b/c")`` makes the missing parent folders too; under a
    umask of 000 ``os.makedirs`` made them 0777 (any user could then swap the cache's folder). Each folder
    the cache makes is 0700, like the cache's own; a folder that was there is left as it is."""
    there = tmp_path / "there"
    there.mkdir()
    os.chmod(there, 0o755)
    old = os.umask(umask)
    try:
        c = ChunkCache(memory=0, disk=there / "a" / "b" / "c")
        c.put("ab" * 16, np.arange(3.0))
    finally:
        os.umask(old)
    made = [there / "a", there / "a" / "b", there / "a" / "b" / "c"]
    assert {str(d): stat.S_IMODE(os.stat(d).st_mode) for d in made} == {str(d): 0o700 for d in made}
    assert stat.S_IMODE(os.stat(there).st_mode) == 0o755


def test_shard_directories_replaced_by_links_are_not_followed(tmp_path):
    """Shard directories replaced by links to an outside directory: nothing is written or read there
    (the campaign saw 12 entries written into the outside directory)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    disk = tmp_path / "c"
    c = ChunkCache(memory=0, disk=disk)
    keys = [f"{i:02x}" * 16 for i in range(12)]
    for k in keys:
        os.symlink(outside, disk / _SUBDIR / k[:2])
    with pytest.warns(RuntimeWarning, match="'00' is a symbolic link"):  # warned of once, counted each time
        for k in keys:
            c.put(k, np.arange(4.0))
            assert c.get(k) is None and k not in c
    assert os.listdir(outside) == [] and c.stats.disk_writes == 0 and c.stats.disk_errors >= 12
    for k in keys:  # what the cache found is left alone: the links, and what they point to
        assert os.path.islink(disk / _SUBDIR / k[:2])


def test_the_entries_directory_as_a_link_is_refused(tmp_path):
    """``<cache>/xinsitu-chunks-v1`` a link: refused, naming it, before anything is written there."""
    outside = tmp_path / "outside"
    outside.mkdir()
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(outside, linked / _SUBDIR)
    with pytest.raises(ValueError, match="not a link"):
        ChunkCache(disk=linked)
    assert os.listdir(outside) == []


def test_nothing_the_cache_did_not_write_is_deleted(tmp_path):
    """The cache root a link to a home directory that holds files of the user's own under names like
    the cache's (an hour old): neither a run's scans (a full tier scans at every put) nor ``clear()``
    deletes them; the campaign saw ``notes.tmp`` and ``results.chunk`` deleted."""
    keys = [f"{i:02x}" * 16 for i in range(12)]
    home = tmp_path / "home"
    mine = home / _SUBDIR / "ab"
    mine.mkdir(parents=True)
    hour_ago = time.time() - 3600
    for name in ("notes.tmp", "results.chunk", ".notes.1.2.3.tmp"):
        (mine / name).write_text("mine")
        os.utime(mine / name, (hour_ago, hour_ago))
    os.symlink(home, tmp_path / "root-link")
    c = ChunkCache(memory=0, disk=tmp_path / "root-link", disk_size=600)  # fills: puts scan and evict
    for k in keys:
        c.put(k, np.arange(4.0))
    assert c.stats.disk_writes > 0 and c.stats.not_admitted > 0  # the tier was full: scanned at its puts
    assert sorted(os.listdir(mine)) == [".notes.1.2.3.tmp", "notes.tmp", "results.chunk"]
    c.clear()
    assert sorted(os.listdir(mine)) == [".notes.1.2.3.tmp", "notes.tmp", "results.chunk"]
    assert c.get(keys[0]) is None


_FIFO_JOB = """
import json, os, sys
import numpy as np
from tests.cache.test_cache_reads import _gen, _epochs, _same
from xinsitu.cache.chunk_cache import ChunkCache
from xinsitu.cache.disk_tier import _SUBDIR
path, disk = sys.argv[1], sys.argv[2]
first = _gen(path, cache=ChunkCache(memory=0, disk=disk), shuffle=False)
first.read_ahead = False  # nothing of it reads on (its read ahead would write the entry again)
_epochs(first, (0,))
entries = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(disk, _SUBDIR)) for f in fs)
os.unlink(entries[0])
os.mkfifo(entries[0])
cache = ChunkCache(memory=0, disk=disk)
gen = _gen(path, cache=cache, shuffle=False)
same = _same(_epochs(gen, (0,)), _epochs(_gen(path, shuffle=False), (0,)))
print(json.dumps({"same": same, "stats": gen.io_stats, "fifo": os.path.exists(entries[0])}))
"""


@pytest.mark.slow
def test_a_fifo_in_place_of_an_entry_is_a_miss(tmp_path):
    """An entry replaced by a FIFO blocked the decode thread in ``open`` for ever; it is a miss now
    (the epoch runs in a subprocess under a timeout: a regression fails, it does not hang)."""
    path = _archive(tmp_path / "era5.zarr")
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-c", _FIFO_JOB, path, str(tmp_path / "c")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["same"]
    st = out["stats"]
    assert st["cache_misses"] == 1 and st["cache_disk_hits"] == st["chunks"] - 1


# ------------------------------------------------------------------------- 6. an unwritable shard
_UNREADABLE_JOB = """
import json, os, sys, warnings
import numpy as np
from tests.cache.test_cache_reads import _gen, _epochs
from xinsitu.cache.chunk_cache import ChunkCache
from xinsitu.cache.disk_tier import _SUBDIR
from xinsitu.cache.keys import ChunkKey
path, disk = sys.argv[1], sys.argv[2]
cache = ChunkCache(memory=0, disk=disk, disk_size="1GB")
gen = _gen(path, cache=cache, shuffle=False)
os.makedirs(os.path.join(disk, _SUBDIR), exist_ok=True)
for i in range(256):  # every shard directory there, one of them unreadable
    os.makedirs(os.path.join(disk, _SUBDIR, f"{i:02x}"), mode=0o700, exist_ok=True)
os.chmod(os.path.join(disk, _SUBDIR, "00"), 0o300)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    _epochs(gen, (0,))
ours = [str(x.message) for x in w if "disk tier" in str(x.message)]
s = cache.stats
print(json.dumps({"warnings": ours, "errors": s.disk_errors, "writes": s.disk_writes,
                  "chunks": gen.io_stats["chunks"]}))
"""


@pytest.mark.skipif(not shutil.which("setpriv") or os.geteuid() != 0,
                    reason="needs root and setpriv to run the job as another (non-root) user")
@pytest.mark.slow
def test_an_unreadable_shard_is_counted_and_warned_once(tmp_path):
    """A shard directory the (non-root) user cannot list: the disk tier went on without writing anything,
    silently. Now the other shards are written, the failures counted and warned of once."""
    work = tempfile.mkdtemp(prefix="xinsitu-cachetrust-")  # pytest's tmp_path is root's alone (0700)
    try:
        path = _archive(os.path.join(work, "era5.zarr"))
        for d, _, files in os.walk(work):
            os.chown(d, NOBODY, NOBODY)
            for f in files:
                os.chown(os.path.join(d, f), NOBODY, NOBODY)
        env = {**os.environ, "PYTHONPATH": ROOT, "HOME": work}
        cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c",
               _UNREADABLE_JOB, path, os.path.join(work, "c")]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["errors"] >= 1 and len(out["warnings"]) == 1, out
    assert "'00'" in out["warnings"][0] and "disk_errors" in out["warnings"][0]
    assert 0 < out["writes"] <= out["chunks"], out  # the chunks of the other shards were kept


def test_chunk_key_versions_name_the_object(tmp_path):
    """A remote object's version is part of its disk key; without one, the key is as before."""
    k = ChunkKey("s3:x", "t2m", {"a": 1})
    assert k.key((0, 0)) == ChunkKey("s3:x", "t2m", {"a": 1}).key((0, 0))
    assert len({k.key((0, 0)), k.key((0, 0), version="etag a 1"), k.key((0, 0), version="etag b 1")}) == 3
