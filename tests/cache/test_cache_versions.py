"""Issue 39, items 2, 3 and the disk tier's part of 3a: the disk cache keys what it keeps by a version no
rewrite keeps, or keeps nothing and says so.

* A local chunk file rewritten in place with its size, modification time and inode kept (``rsync
  --inplace -t``, ``tar x``) is a miss: its change time, which no user call can set back, is in the key.
* An HTTP store whose objects carry no trustworthy version (``python -m http.server``: no ETag, a
  Last-Modified of whole seconds; a HEAD answered 405; neither header) keeps nothing on disk unless
  ``immutable=True``: warned once, and said in the generator's repr. A rewrite that keeps size and
  modification time is then never served stale.
* An archive read through fsspec (``xr.open_zarr(url)``) is kept on disk by the versions fsspec's
  ``info()`` gives (ETag and size), and a rewritten object is a miss.
* Two S3 endpoints serving the same bucket and key never share keys (s3fs and obstore alike).
* The version checks are bounded by ``XINSITU_REQUEST_TIMEOUT``: a server that never answers HEAD
  costs a bounded wait, then the chunks are read as without a disk tier.

Every server runs on 127.0.0.1 (the standard library's, ``tests.support.plain_http``; the file server
and moto of ``tests.support.servers``). What could hang runs in a subprocess under a timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from datetime import timedelta

import numpy as np
import pytest
import xarray as xr

import xinsitu
from xinsitu.cache.chunk_cache import ChunkCache
from xinsitu.cache.disk_tier import _SUBDIR

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NT, CT = 32, 4


def _archive(path) -> str:
    """An uncompressed archive (every full chunk object has the same size): ``a(time, y, x)``, 8 chunks."""
    a = np.arange(NT * 3 * 5, dtype="f4").reshape(NT, 3, 5)
    src = xr.Dataset({"a": (("time", "y", "x"), a)}, coords={"time": np.arange(NT), "y": np.arange(3),
                                                             "x": np.arange(5)})
    src.to_zarr(str(path), mode="w", zarr_format=3, consolidated=True,
                encoding={"a": {"chunks": (CT, 3, 5), "compressors": None}})
    return str(path)


def _rewrite_keeping_size_and_mtime(path: str) -> None:
    """Chunk 0's object gets chunk 1's bytes, in place (same size, same inode), and its modification time
    back to the nanosecond: what ``rsync --inplace -t`` or ``tar x`` leave."""
    first, second = (os.path.join(path, "a", "c", str(i), "0", "0") for i in (0, 1))
    st = os.stat(first)
    data = open(second, "rb").read()
    assert len(data) == st.st_size
    with open(first, "r+b") as f:
        f.write(data)
    os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(first)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)


def _gen(ds: xr.Dataset, cache=None):
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", batch_size=4, output="numpy", shuffle=False, cache=cache)
    gen.read_ahead = False  # else the next epoch's first buffer is read as an epoch ends: after a rewrite, too
    return gen


def _epoch(gen) -> list[np.ndarray]:
    return [np.array(b["a"], copy=True) for b in gen]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _entries(disk) -> int:
    return sum(f.endswith(".chunk") for _, _, fs in os.walk(os.path.join(disk, _SUBDIR)) for f in fs)


def _ours(caught) -> list[str]:
    return [str(w.message) for w in caught if "disk tier" in str(w.message)]


#: obstore's retries made short: a server that answers ``HEAD`` 501 (a server error: retried) is given up at once
_FAST = {"backoff": {"init_backoff": timedelta(milliseconds=5), "max_backoff": timedelta(milliseconds=20)}}
OPENERS = {"xinsitu": lambda url: xinsitu.open_zarr(url, retry_config=_FAST),
           "xarray": lambda url: xr.open_zarr(url, chunks=None)}


# --------------------------------------------------------------------------- 2(b) local chunk files
def test_a_local_rewrite_keeping_size_mtime_and_inode_is_a_miss(tmp_path):
    """``rsync --inplace -t``: the chunk's bytes change, its size, mtime (ns) and inode do not. The disk
    entry of the old bytes is not served: the key holds the file's change time too."""
    path = _archive(tmp_path / "a.zarr")
    disk = tmp_path / "c"
    first = _gen(xinsitu.open_zarr(path), ChunkCache(memory=0, disk=disk))
    old = _epoch(first)
    assert first.io_stats["cache_misses"] == first.io_stats["chunks"] == _entries(disk) == 4
    _rewrite_keeping_size_and_mtime(path)
    new = _epoch(_gen(xinsitu.open_zarr(path)))
    assert not _same(new, old)
    again = _gen(xinsitu.open_zarr(path), ChunkCache(memory=0, disk=disk))
    assert _same(_epoch(again), new)
    st = again.io_stats
    assert st["cache_misses"] == 1 and st["cache_disk_hits"] == st["chunks"] - 1, st


# ------------------------------------------------------------- 2(a) HTTP stores without a version
@pytest.mark.filterwarnings("ignore:the chunk cache's disk tier:RuntimeWarning")  # those of the runs after the first
@pytest.mark.parametrize(("head", "opener"), [(h, o) for h in ("plain", "405", "501", "404", "bare") for o in OPENERS
                                             if (h, o) != ("501", "xarray")])  # (fsspec asks a GET where HEAD fails)
@pytest.mark.slow
def test_an_http_store_without_versions_keeps_nothing_on_disk_and_says_so(tmp_path, head, opener):
    """``python -m http.server`` (and poorer servers): nothing is kept on disk, the first epoch warns
    once, naming the store and why, and the repr says it; a rewrite within the same second, or with its
    modification time restored, is then read as it is now. ``immutable=True`` keeps them, as declared.
    A server that does not implement ``HEAD`` (501, which obstore retries) is a refusal too; one that
    answers ``HEAD`` with 404 and then serves the object says so once it has served one."""
    from tests.support.plain_http import PlainServer

    path = _archive(tmp_path / "a.zarr")
    disk = tmp_path / "c"
    with PlainServer(tmp_path, head=head) as srv:
        url = f"{srv.url}/a.zarr"
        cache = ChunkCache(memory=0, disk=disk)
        first = _gen(OPENERS[opener](url), cache)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old = _epoch(first)
            _epoch(first)  # a second epoch says nothing more
        said, text, writes = _ours(caught), repr(first), _entries(disk)
        _rewrite_keeping_size_and_mtime(path)
        new = _epoch(_gen(xinsitu.open_zarr(path)))
        assert not _same(new, old)
        assert _same(_epoch(_gen(OPENERS[opener](url), ChunkCache(memory=0, disk=disk))), new)
        assert len(said) == 1, said
        assert srv.url.split("//")[1] in said[0] and "immutable=True" in said[0]
        if opener == "xinsitu":  # obstore's HEAD: the header missing, or the HEAD refused, is named
            why = {"plain": "no ETag", "405": "HEAD", "501": "HEAD", "404": "says objects are missing",
                   "bare": "neither ETag nor Last-Modified"}[head]
            assert why in said[0], said[0]
        assert writes == 0 and cache.stats.disk_writes == 0
        assert "disk" in text and "no trustworthy version" in text and srv.url.split("//")[1] in text, text

        kept = ChunkCache(memory=0, disk=tmp_path / "kept", immutable=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _same(_epoch(_gen(OPENERS[opener](url), kept)), new)
        assert not _ours(caught) and _entries(tmp_path / "kept") == 4
        again = _gen(OPENERS[opener](url), ChunkCache(memory=0, disk=tmp_path / "kept", immutable=True))
        assert _same(_epoch(again), new) and again.io_stats["cache_disk_hits"] == again.io_stats["chunks"] == 4


@pytest.mark.filterwarnings("ignore:the chunk cache's disk tier:RuntimeWarning")  # those of the runs after the first
@pytest.mark.parametrize("opener", list(OPENERS))
@pytest.mark.parametrize(("etag", "why"), [("nginx", "whole seconds"), ("ns", "not a content hash"),
                                           ("starlette", "not a hash of the bytes")])
def test_a_web_server_etag_of_time_and_size_keeps_nothing_on_disk_and_says_so(tmp_path, opener, etag, why):
    """A web server's strong ETag made of the file's modification time and size -- nginx's default,
    ``"<mtime seconds hex>-<size hex>"``, one in nanoseconds as Apache and Caddy make theirs, or their MD5
    as Starlette makes it (shaped as a hash: checked against one object's bytes) -- names
    only what the time and size name: nothing is kept on disk (said once, naming why), and a rewrite that
    keeps size and modification time (``cp -p``, ``rsync -a``) is read as it is now, not served stale."""
    from tests.support.servers import FileServer

    path = _archive(tmp_path / "a.zarr")
    disk = tmp_path / "c"
    with FileServer(tmp_path, etag=etag) as srv:
        url = f"{srv.url}/a.zarr"
        first = _gen(OPENERS[opener](url), ChunkCache(memory=0, disk=disk))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old = _epoch(first)
        said = _ours(caught)
        assert len(said) == 1 and why in said[0] and "immutable=True" in said[0], said
        assert _entries(disk) == 0
        _rewrite_keeping_size_and_mtime(path)
        new = _epoch(_gen(xinsitu.open_zarr(path)))
        assert not _same(new, old)
        again = _gen(OPENERS[opener](url), ChunkCache(memory=0, disk=disk))
        assert _same(_epoch(again), new)
        assert again.io_stats["cache_disk_hits"] == 0


def test_a_web_server_s_etag_is_trusted_only_where_it_is_a_content_hash():
    """From a web server (``HTTPStore``, fsspec's HTTP) only an ETag that looks like a content hash keys a
    disk entry: MD5 in hex (S3, GCS, R2 behind HTTP), S3's multipart one, SHA-256, base64 of MD5, Azure's
    change counter. Apache's ``"<size>-<µs>"`` (with or without the inode), Caddy's base36, lighttpd's
    decimal hash and IIS's ``<filetime>:<n>`` are the file's time and size, and are not; an object store's
    strong ETag is trusted whatever it looks like."""
    from xinsitu.cache.versions import _version, trusted, why_not

    hashes = ['"d41d8cd98f00b204e9800998ecf8427e"', '"d41d8cd98f00b204e9800998ecf8427e-12"', '"' + "ab" * 32 + '"',
              '"1B2M2Y8AsgTpgAmY7PhCfg=="', '"0x8DC1234567890AB"']
    stamps = ['"2d-5f8a1b2c3d4e5"', '"1a2b3c-2d-5f8a1b2c3d4e5"', '"s1kq9v2p1a"', '"3053469370"',
              '"a0e1c3b3f5d9d81:0"']
    for tag in hashes:
        assert trusted(_version(tag, 45, None, web=True)), tag
    for tag in stamps:
        v = _version(tag, 45, None, web=True)
        assert not trusted(v) and "not a content hash" in why_not(v)[1], (tag, v)
        assert trusted(_version(tag, 45, None)), tag  # an object store's
    import base64
    import hashlib

    from xinsitu.cache.versions import _names_bytes

    data = b"chunk bytes"
    for tag in (hashlib.md5(data).hexdigest(), hashlib.sha1(data).hexdigest().upper(), hashlib.sha256(data).hexdigest(),
                base64.b64encode(hashlib.md5(data).digest()).decode()):
        assert _names_bytes(f'"{tag}"', data) and not _names_bytes(f'"{tag}"', data + b"!"), tag
    stamp = hashlib.md5(b"1714564807.123-11").hexdigest()
    for tag in (stamp, hashlib.md5(data).hexdigest() + "-2", "0x8DC1234567890AB"):
        assert not _names_bytes(f'"{tag}"', data), tag  # of the time and size; multipart; Azure's: not checkable


def test_which_etags_of_a_time_and_a_size_are_trusted():
    """nginx's ``"<seconds hex>-<size hex>"`` is not trusted, whether the Last-Modified it matches comes as
    a ``datetime`` (obstore), an HTTP date (fsspec) or not at all; an ETag of nanoseconds (the file server's),
    one whose time is not the Last-Modified, one of another size, S3's multipart ETag and a hash are."""
    import datetime

    from xinsitu.cache.versions import _version, trusted, why_not

    at = datetime.datetime(2024, 5, 1, 12, 0, 7, tzinfo=datetime.UTC)
    secs, ns, size = int(at.timestamp()), int(at.timestamp()) * 10**9 + 123, 1234
    http_date = "Wed, 01 May 2024 12:00:07 GMT"
    for modified in (at, http_date, None):
        v = _version(f'"{secs:x}-{size:x}"', size, modified)
        assert not trusted(v) and "whole seconds" in why_not(v)[1], v
    for tag, modified in ((f'"{ns:x}-{size:x}"', at), (f'"{secs + 60:x}-{size:x}"', at),
                          (f'"{secs:x}-{size + 1:x}"', at), ('"' + "0" * 31 + 'a-3"', at),
                          ('"d41d8cd98f00b204"', None)):
        assert trusted(_version(tag, size, modified)), tag


# ---------------------------------------------------------------------------------- 3. fsspec stores
def test_an_archive_read_through_fsspec_is_kept_on_disk_by_its_versions(tmp_path):
    """``xr.open_zarr(url)`` (fsspec's HTTP filesystem) with ``cache="/dir"``: the first run keeps every
    chunk on disk (keyed by the ETag and size fsspec's ``info()`` gives), a new run is served from it
    (one HEAD per object, no GET), and a rewritten object is a miss."""
    from tests.support.servers import FileServer

    path = _archive(tmp_path / "a.zarr")
    disk = tmp_path / "c"
    with FileServer(tmp_path) as srv:
        url = f"{srv.url}/a.zarr"
        first = _gen(xr.open_zarr(url, chunks=None), str(disk))
        old = _epoch(first)
        assert _entries(disk) == first.io_stats["chunks"] == 4
        cache = ChunkCache(memory=0, disk=disk)
        again = _gen(xr.open_zarr(url, chunks=None), cache)
        srv.reset_counts()
        assert _same(_epoch(again), old)
        assert again.io_stats["cache_disk_hits"] == again.io_stats["chunks"] == 4
        assert srv.requests == cache.stats.version_requests == 4  # the HEADs, and nothing else
        _rewrite_keeping_size_and_mtime(path)  # the file server's ETag names the mtime in ns: kept here,
        os.utime(os.path.join(path, "a", "c", "0", "0", "0"))  # so the object is given a new one
        new = _epoch(_gen(xinsitu.open_zarr(path)))
        third = _gen(xr.open_zarr(url, chunks=None), ChunkCache(memory=0, disk=disk))
        assert _same(_epoch(third), new) and not _same(new, old)
        assert third.io_stats["cache_misses"] == 1 and third.io_stats["cache_disk_hits"] == 3


# ------------------------------------------------------------------ two endpoints, one bucket and key
@pytest.mark.parametrize("opener", ["s3fs", "obstore"])
@pytest.mark.slow
def test_two_endpoints_serving_the_same_bucket_and_key_never_share_keys(tmp_path, opener):
    """Two S3 servers, the same bucket and key, other values; one ``ChunkCache`` (memory and disk): each
    archive gets its own chunks."""
    from tests.support.servers import MotoS3

    if opener == "s3fs":
        pytest.importorskip("s3fs", reason="s3fs (the dev extra) is not installed here")
    one = _archive(tmp_path / "one" / "a.zarr")
    two = _archive(tmp_path / "two" / "a.zarr")
    ds2 = xr.open_zarr(two, chunks=None)
    (ds2 * 2 + 1).to_zarr(two, mode="w", zarr_format=3, consolidated=True,
                          encoding={"a": {"chunks": (CT, 3, 5), "compressors": None}})
    cache = ChunkCache(memory="1GB", disk=tmp_path / "c")
    with MotoS3() as s1, MotoS3() as s2:
        got, want = [], []
        for srv, local in ((s1, one), (s2, two)):
            srv.upload(local, "bkt", "a.zarr")
            if opener == "s3fs":
                opts = {"key": srv.access_key_id, "secret": srv.secret_access_key,
                        "client_kwargs": {"endpoint_url": srv.endpoint, "region_name": srv.region}}
                ds = xr.open_zarr("s3://bkt/a.zarr", chunks=None, storage_options=opts)
            else:
                ds = xinsitu.open_zarr("s3://bkt/a.zarr", **srv.options)
            got.append(_epoch(_gen(ds, cache)))
            want.append(_epoch(_gen(xinsitu.open_zarr(local))))
    assert not _same(want[0], want[1])
    assert _same(got[0], want[0]) and _same(got[1], want[1])


@pytest.mark.parametrize("tier", ["memory", "disk, immutable"])
def test_two_endpoints_given_by_the_environment_never_share_keys(tmp_path, monkeypatch, tier):
    """The endpoint from ``AWS_ENDPOINT_URL`` (as boto3 and aws-cli users set it; obstore reads it, but its
    ``config`` does not show it), switched between two opens of the same bucket and key on two servers:
    each archive gets its own chunks, from a shared memory tier or from a disk tier that does not ask
    for versions."""
    from tests.support.servers import MotoS3

    one = _archive(tmp_path / "one" / "a.zarr")
    two = _archive(tmp_path / "two" / "a.zarr")
    ds2 = xr.open_zarr(two, chunks=None)
    (ds2 * 2 + 1).to_zarr(two, mode="w", zarr_format=3, consolidated=True,
                          encoding={"a": {"chunks": (CT, 3, 5), "compressors": None}})
    shared = ChunkCache(memory="1GB")
    got, want = [], []
    with MotoS3() as s1, MotoS3() as s2:
        for srv, local in ((s1, one), (s2, two)):
            srv.upload(local, "bkt", "a.zarr")
            monkeypatch.setenv("AWS_ENDPOINT_URL", srv.endpoint)
            monkeypatch.setenv("AWS_REGION", srv.region)
            opts = {k: v for k, v in srv.options.items() if k not in ("endpoint", "region")}
            cache = shared if tier == "memory" else ChunkCache(memory=0, disk=tmp_path / "c", immutable=True)
            gen = _gen(xinsitu.open_zarr("s3://bkt/a.zarr", **opts), cache)
            got.append(_epoch(gen))
            want.append(_epoch(_gen(xinsitu.open_zarr(local))))
            assert gen.io_stats["cache_hits"] == 0
    assert not _same(want[0], want[1])
    assert _same(got[0], want[0]) and _same(got[1], want[1])


# ------------------------------------------------------------------------- 3a. a HEAD never answered
_SILENT_JOB = """
import json, os, sys, warnings
import numpy as np, xarray as xr
import xinsitu
from tests.support.plain_http import PlainServer
from tests.cache.test_cache_versions import _epoch, _gen, _ours
from xinsitu.cache.chunk_cache import ChunkCache
root, disk, opener = sys.argv[1], sys.argv[2], sys.argv[3]
with PlainServer(root) as srv:
    url = f"{srv.url}/a.zarr"
    ds = xinsitu.open_zarr(url) if opener == "xinsitu" else xr.open_zarr(url, chunks=None)
    ref = _epoch(_gen(ds))
    srv.head = "silent"  # opened; from now on HEAD is never answered (GET still is)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _epoch(_gen(ds, ChunkCache(memory=0, disk=disk)))
    heads = srv.heads
print(json.dumps({"same": all(np.array_equal(a, b) for a, b in zip(got, ref)) and len(got) == len(ref),
                  "said": _ours(caught), "heads": heads}))
"""


@pytest.mark.parametrize("opener", list(OPENERS))
@pytest.mark.slow
def test_version_checks_on_a_silent_server_are_bounded(tmp_path, opener):
    """A server that takes HEAD and never answers it (GET is answered): with
    ``XINSITU_REQUEST_TIMEOUT=1`` the epoch ends with the right values, the chunks read as without a disk
    tier and the disk tier saying that it could not learn their versions. Before, each HEAD waited on
    obstore's own retries (about four minutes): the subprocess's timeout catches a regression."""
    _archive(tmp_path / "a.zarr")
    env = {**os.environ, "PYTHONPATH": ROOT, "XINSITU_REQUEST_TIMEOUT": "1"}
    p = subprocess.run([sys.executable, "-c", _SILENT_JOB, str(tmp_path), str(tmp_path / "c"), opener], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["same"] and out["heads"] >= 1
    assert len(out["said"]) == 1 and "no answer" in out["said"][0], out["said"]


# ------------------------------------------------------------------- a store the cache cannot name
@pytest.mark.parametrize("cache", ["dir", "disk only"])
def test_a_store_without_a_lasting_identity_is_said_to_be_uncached(tmp_path, cache):
    """An archive in a zarr ``MemoryStore`` has no identity that outlives it: nothing of it is cached, in
    memory or on disk. That was silent; it is warned once and said in the repr, with a disk tier alone
    too (that was silent still)."""
    import zarr

    store = zarr.storage.MemoryStore()
    xr.open_zarr(_archive(tmp_path / "a.zarr"), chunks=None).to_zarr(store, zarr_format=3, consolidated=False)
    gen = _gen(xinsitu.open_zarr(store), str(tmp_path / "c") if cache == "dir" else
               ChunkCache(memory=0, disk=tmp_path / "c"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _epoch(gen)
        _epoch(gen)
    said = [str(w.message) for w in caught if "keeps nothing" in str(w.message)]
    assert len(said) == 1 and "variable 'a'" in said[0] and "MemoryStore" in said[0], said
    assert "not cached: variable 'a'" in repr(gen) and _entries(tmp_path / "c") == 0


def test_variables_read_through_dask_are_said_to_be_uncached(tmp_path):
    """NetCDF files opened by ``xr.open_mfdataset`` (dask): their chunks have no key the cache could check,
    so none is cached; that was silent. It is warned once, naming ``xinsitu.virtual.open_netcdf``, and
    said in the repr; batches are xarray's."""
    pytest.importorskip("netCDF4")
    ds = xr.open_zarr(_archive(tmp_path / "a.zarr"), chunks=None).load()
    ds.to_netcdf(tmp_path / "a.nc")
    src = xr.open_mfdataset([str(tmp_path / "a.nc")], chunks={"time": 4})
    gen = _gen(src, str(tmp_path / "c"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = _epoch(gen), _epoch(gen)
    said = [str(w.message) for w in caught if "keeps nothing" in str(w.message)]
    assert len(said) == 1 and "variable 'a'" in said[0] and "open_netcdf" in said[0], said
    assert "not cached either" in said[0] and "their chunks are cached" not in said[0], said
    assert "not cached: variable 'a' (read through dask" in repr(gen) and _entries(tmp_path / "c") == 0
    assert "to_zarr" in repr(gen) and "open_netcdf" not in repr(gen)
    assert _same(first, second) and _same(first, _epoch(_gen(ds)))


def test_netcdf_read_in_place_is_said_to_be_uncached_for_what_it_is(tmp_path):
    """``xinsitu.virtual.open_netcdf``'s store (a ``ManifestStore``) has no identity the cache can check the
    files by: nothing is cached, and the warning and the repr say so for what it is (not "a memory store,
    uncommitted Icechunk changes, or a kind of store the cache does not know")."""
    pytest.importorskip("netCDF4")
    pytest.importorskip("virtualizarr")
    from xinsitu.virtual import open_netcdf

    ds = xr.open_zarr(_archive(tmp_path / "a.zarr"), chunks=None).load()
    ds.to_netcdf(tmp_path / "a.nc", encoding={"a": {"chunksizes": (CT, 3, 5)}})
    gen = _gen(open_netcdf(str(tmp_path / "a.nc")), ChunkCache(memory="1GB", disk=tmp_path / "c"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = _epoch(gen), _epoch(gen)
    said = [str(w.message) for w in caught if "keeps nothing" in str(w.message)]
    assert len(said) == 1 and "ManifestStore" in said[0] and "NetCDF or GRIB files read in place" in said[0], said
    assert "memory store" not in said[0] and "uncommitted" not in said[0], said
    assert "NetCDF or GRIB files read in place" in repr(gen) and _entries(tmp_path / "c") == 0
    assert gen.io_stats["cache_hits"] == 0 and _same(first, second) and _same(first, _epoch(_gen(ds)))


# ------------------------------------------------------------------ an archive appended to between runs
@pytest.mark.parametrize("where", ["local", "http immutable"])
def test_an_appended_archive_keeps_its_whole_chunks_and_reads_the_cut_one_again(tmp_path, where):
    """An archive appended to along time between two runs (``to_zarr(append_dim="time")``, as a daily
    update does): its metadata changed only in the shape, so the disk tier still serves every chunk
    the append left whole, and reads again the last one, which the old shape cut and the append wrote
    into -- also where nothing else tells a rewrite (an HTTP store without versions, kept as
    ``immutable``; locally the file's change time tells it too). Every epoch equals plain xarray."""
    from tests.support.plain_http import PlainServer

    def part(t0: int, n: int) -> xr.Dataset:
        t = np.arange(t0, t0 + n)
        a = (t[:, None, None] * 100 + np.arange(15).reshape(1, 3, 5)).astype("f4")
        return xr.Dataset({"a": (("time", "y", "x"), a)}, coords={"time": t})

    path = str(tmp_path / "a.zarr")
    part(0, 10).to_zarr(path, mode="w", zarr_format=3, consolidated=True,
                        encoding={"a": {"chunks": (CT, 3, 5), "compressors": None}})  # chunks 0-1 whole, 2 cut

    def run(url: str) -> tuple[list[np.ndarray], dict]:
        ds = xinsitu.open_zarr(url)
        m = ds.insitu.split("time", fractions={"all": 1.0})
        cache = ChunkCache(memory=0, disk=tmp_path / "c", immutable=where != "local")
        gen = ds.insitu.batches(m, "all", batch_size=3, output="numpy", shuffle=False, cache=cache)
        got = _epoch(gen)
        want = [ds.a.isel(time=ids).values for ids in gen.batch_ids()]
        assert _same(got, want)
        assert _same(got, [xr.open_zarr(path, chunks=None).a.isel(time=ids).values for ids in gen.batch_ids()])
        return got, gen.io_stats

    with PlainServer(tmp_path) as srv:
        url = path if where == "local" else f"{srv.url}/a.zarr"
        _, first = run(url)
        assert first["cache_misses"] == first["chunks"] == 3, first
        part(10, 3).to_zarr(path, append_dim="time", consolidated=True)  # chunk 2 written into, 3 new
        got, st = run(url)
        assert sum(len(b) for b in got) == 13
        assert st["cache_disk_hits"] == 2 and st["cache_misses"] == 2, st  # chunks 0-1 kept; 2 and 3 read
