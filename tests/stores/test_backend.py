"""The fetch backends (``xinsitu.stores.backend``) against real files in a temporary directory, and over
a real HTTP server on 127.0.0.1: whole objects, byte ranges, missing and empty objects, short
bodies, servers that ignore ranges, the typed seam and the fork policy."""

from __future__ import annotations

import asyncio
import os
import sys

import numpy as np
import obstore.store
import pytest
import zarr

from tests.support.forked import in_fork
from tests.support.servers import Faults, FileServer
from xinsitu.io import loop as _loop
from xinsitu.stores.backend import (
    Backend,
    DamagedObjectError,
    LocalBackend,
    RangeBackend,
    _FileBackend,
    _ObstoreBackend,
    backend_for,
    bounded,
    deadlines_here,
    fetch_decoded,
)

PAYLOAD = bytes(range(256)) * 40  # 10240 bytes, every offset recognisable


@pytest.fixture
def root(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "obj").write_bytes(PAYLOAD)
    (tmp_path / "small").write_bytes(b"xyz")
    return str(tmp_path)


def _backends(root):
    return [_ObstoreBackend(obstore.store.LocalStore(prefix=root)), _FileBackend(root)]


@pytest.mark.parametrize("kind", ["obstore", "file"])
def test_whole_objects_ranges_and_missing_objects(root, kind):
    be = dict(zip(["obstore", "file"], _backends(root), strict=True))[kind]
    assert isinstance(be, RangeBackend)

    async def go():
        return (await be.get("a/obj"), await be.get("a/none"), await be.get_range("a/obj", 100, 300),
                await be.get_suffix("a/obj", 7), await be.get_ranges("a/obj", [5000, 0, 10], [5010, 4, 12]))

    whole, missing, rng, suffix, many = _loop.run(go(), timeout=30)
    assert bytes(whole) == PAYLOAD
    assert missing is None
    assert bytes(rng) == PAYLOAD[100:300]
    assert bytes(suffix) == PAYLOAD[-7:]
    assert [bytes(m) for m in many] == [PAYLOAD[5000:5010], PAYLOAD[0:4], PAYLOAD[10:12]]  # in the order asked


@pytest.mark.parametrize("kind", ["obstore", "file"])
def test_ranges_of_a_missing_or_short_object_raise(root, kind):
    be = dict(zip(["obstore", "file"], _backends(root), strict=True))[kind]
    with pytest.raises(FileNotFoundError, match="a/none"):
        _loop.run(be.get_ranges("a/none", [0], [4]), timeout=30)
    with pytest.raises(DamagedObjectError, match=r"'small': bytes 0-10 asked for, 3 exist"):
        _loop.run(be.get_ranges("small", [0], [10]), timeout=30)


def test_local_backend_reads_in_the_caller_and_forwards_ranges(root):
    inner = _FileBackend(root)
    be = LocalBackend(root, inner)
    assert isinstance(be, RangeBackend)
    assert be.read("a/obj") == PAYLOAD and be.read("nothing") is None
    assert bytes(_loop.run(be.get_range("a/obj", 1, 4), timeout=30)) == PAYLOAD[1:4]
    assert not hasattr(be, "no_such_method")  # explicit methods, nothing forwarded blindly


def test_local_backend_reads_into_the_threads_scratch(root, tmp_path, monkeypatch):
    """With a scratch, a file is read into the calling thread's own buffer (no new bytes per chunk): each
    view holds the file read; a file that fits in the buffer is read without asking its size (no
    ``fstat``), one that fills it is read whole the sized way into a larger buffer; and a file that grows
    between ``fstat`` and the read is still read whole."""
    from xinsitu.io.place import ThreadScratch

    be = LocalBackend(root, _FileBackend(root))
    scratch = ThreadScratch()
    small = be.read("small", scratch)
    assert isinstance(small, memoryview) and bytes(small) == b"xyz"
    buf = scratch.buf
    big = be.read("a/obj", scratch)
    assert bytes(big) == PAYLOAD and scratch.buf is not buf  # it filled the buffer: grown, a new one
    real_fstat = os.fstat

    def no_fstat(fd):
        raise AssertionError("fstat called for a file that fits in the scratch")

    monkeypatch.setattr(os, "fstat", no_fstat)
    again = be.read("small", scratch)
    assert bytes(again) == b"xyz" and be.read("nothing", scratch) is None
    assert bytes(be.read("a/obj", scratch)) == PAYLOAD
    monkeypatch.undo()

    grows = tmp_path / "grows"
    grows.write_bytes(b"a" * 10)

    def fstat_then_grow(fd):  # the file gets longer right after its size is taken
        st = real_fstat(fd)
        with open(grows, "ab") as f:
            f.write(b"b" * 5000)
        return st

    monkeypatch.setattr(os, "fstat", fstat_then_grow)
    got = LocalBackend(str(tmp_path), _FileBackend(str(tmp_path))).read("grows", ThreadScratch())  # no room yet
    monkeypatch.undo()
    assert bytes(got) == b"a" * 10 + b"b" * 5000


def test_a_decode_thread_reads_files_into_memory_that_starts_on_a_page(tmp_path):
    """The file's bytes land at the start of a page: a large bytearray or np.empty starts 16 bytes into
    one, where the kernel copies page-cache pages at a third of the speed on AMD EPYC (measured)."""
    from xinsitu.io.mempool import PAGE
    from xinsitu.io.place import ThreadScratch

    data = np.random.default_rng(0).integers(0, 256, 700_000, dtype=np.uint8).tobytes()
    (tmp_path / "chunk").write_bytes(data)
    scratch = ThreadScratch()
    store = LocalBackend(str(tmp_path), _FileBackend(str(tmp_path)))
    for _ in range(2):  # and again, into the same buffer
        got = store.read("chunk", scratch)
        assert bytes(got) == data
        assert np.frombuffer(got, np.uint8).ctypes.data % PAGE == 0
    bigger = scratch.take(3_000_000)  # grown: a new buffer, on a page too
    assert np.frombuffer(bigger, np.uint8).ctypes.data % PAGE == 0


def test_local_backend_leaves_the_decode_threads_when_reads_are_slow(root):
    be = LocalBackend(root, _FileBackend(root))
    assert be.fused  # a local file system: read in the decode threads
    for _ in range(LocalBackend.WINDOW - 1):
        be.observe(0.010, 0.001)
    assert be.fused  # not decided before the window is full
    be.observe(0.010, 0.001)
    assert not be.fused
    for _ in range(LocalBackend.WINDOW):
        be.observe(0.0001, 0.001)
    assert not be.fused  # for good: no more reads are timed in the decode threads


def test_local_backend_judges_each_window_of_the_times_given_at_once(root):
    """``observe_all``: the times of many reads, judged window by window as one by one would."""
    w = LocalBackend.WINDOW
    be = LocalBackend(root, _FileBackend(root))
    be.observe_all([(0.0001, 0.001)] * w + [(0.010, 0.001)] * (w - 1))  # a quick window, then most of a slow one
    assert be.fused
    be.observe_all([(0.010, 0.001)] * 2)  # the slow window is full: judged slow
    assert not be.fused
    be = LocalBackend(root, _FileBackend(root))
    be.observe_all([(0.010, 0.001)] * (w // 2 - 1) + [(0.0001, 0.001)] * (w // 2 + 1) + [(0.010, 0.001)] * (w - 1))
    assert be.fused  # a window of under half slow reads (median quick), then a slow one not yet full


def test_backend_for_a_local_zarr_store_reads_files_directly(tmp_path):
    path = str(tmp_path / "d.zarr")
    zarr.create_array(path, shape=(4,), chunks=(2,), dtype="i4")[:] = np.arange(4, dtype="i4")
    be = backend_for(zarr.storage.LocalStore(path))
    assert isinstance(be, LocalBackend) and isinstance(be, Backend)
    assert be.read("zarr.json") is not None


def test_fetch_decoded_fetches_again_then_names_the_object(root):
    be = _FileBackend(root)
    calls: list[int] = []

    async def fails_once(raw):
        calls.append(len(raw))
        if len(calls) == 1:
            raise ValueError("bad bytes")
        return len(raw)

    assert _loop.run(fetch_decoded(be, "small", fails_once), timeout=30) == 3
    assert calls == [3, 3]

    async def never(raw):
        raise ValueError("still bad")

    with pytest.raises(DamagedObjectError, match=r"'small' failed to decode 2 times.*still bad"):
        _loop.run(fetch_decoded(be, "small", never, attempts=2), timeout=30)


@pytest.fixture
def on_own_loop():
    """``run(coro, timeout)`` on one event loop of the test's own: its ``Deadlines`` watch this test's
    requests only (on the shared I/O loop, reads another test left running in this process -- e.g. under
    pytest-xdist -- are watched too)."""
    loop = asyncio.new_event_loop()
    yield lambda coro, timeout: loop.run_until_complete(asyncio.wait_for(coro, timeout))
    loop.close()


def test_bounded_gives_each_try_its_limit_then_names_the_object(monkeypatch, on_own_loop):
    """A request that never answers is cancelled after the limit and made again, ``attempts`` times,
    then ``TimeoutError`` names the object; one that answers on its second try returns; the store's
    own ``TimeoutError`` is not repeated; nothing stays watched."""
    import time

    monkeypatch.setenv("XINSITU_REQUEST_TIMEOUT", "0.2")
    tries: list[float] = []
    retries: list[int] = []

    async def never():
        tries.append(time.perf_counter())
        await asyncio.sleep(3600)

    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"object 'k/0': no answer within 0.2 s, 3 times"):
        on_own_loop(bounded(never, "k/0", on_retry=lambda: retries.append(1)), timeout=30)
    took = time.perf_counter() - t0
    assert len(tries) == 3 and retries == [1, 1]
    assert took >= 0.6, took  # three waits of the limit (above: no bound, a loaded machine is slow)
    gaps = np.diff(tries)
    assert (gaps >= 0.2).all(), gaps

    n = [0]

    async def second():
        n[0] += 1
        if n[0] == 1:
            await asyncio.sleep(3600)
        return "bytes"

    assert on_own_loop(bounded(second, "k/1"), timeout=30) == "bytes" and n[0] == 2

    async def store_gave_up():
        n[0] += 1
        raise TimeoutError("the store's own timeout")

    n[0] = 0
    with pytest.raises(TimeoutError, match="the store's own"):
        on_own_loop(bounded(store_gave_up, "k/2"), timeout=30)
    assert n[0] == 1

    async def watched():
        return len(deadlines_here().watches)

    assert on_own_loop(watched(), timeout=30) == 0


def test_bounded_lets_a_cancellation_from_outside_through(monkeypatch, on_own_loop):
    """Cancelling the task that waits raises ``CancelledError`` at once (no retry, no ``TimeoutError``),
    also where it meets the deadline's own cancellation; many requests with their own limits end
    each by its own."""
    monkeypatch.setenv("XINSITU_REQUEST_TIMEOUT", "30")
    started = []

    async def slow():
        started.append(1)
        await asyncio.sleep(3600)

    async def outside():
        t = asyncio.ensure_future(bounded(slow, "k/3"))
        await asyncio.sleep(0.05)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        return len(started), len(deadlines_here().watches)

    assert on_own_loop(outside(), timeout=30) == (1, 0)

    async def both():  # the deadline passes and the task is cancelled in the same turn of the loop
        started.clear()
        d = deadlines_here()
        t = asyncio.ensure_future(bounded(slow, "k/4"))
        await asyncio.sleep(0.05)
        for w in d.watches:
            w.deadline = 0.0
        d._sweep()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        return len(started), len(d.watches)

    assert on_own_loop(both(), timeout=30) == (1, 0)

    async def mixed():
        async def one(limit):
            os.environ["XINSITU_REQUEST_TIMEOUT"] = str(limit)
            t0 = asyncio.get_running_loop().time()
            try:
                await bounded(slow, f"k/{limit}", attempts=1)
            except TimeoutError:
                return asyncio.get_running_loop().time() - t0

        async def watched():  # each request's own deadline, set as it went out
            await asyncio.sleep(0.05)
            return sorted(w.limit for w in deadlines_here().watches)

        return await asyncio.gather(one(0.6), one(0.1), one(0.3), watched())

    long, short, mid, watches = on_own_loop(mixed(), timeout=30)
    # each ended by its own limit, not before (how long after depends on this machine's load: no bound)
    assert watches == [0.1, 0.3, 0.6], watches
    assert 0.1 <= short <= mid <= long and mid >= 0.3 and long >= 0.6, (short, mid, long)


def _http(srv):
    return _ObstoreBackend(obstore.store.HTTPStore.from_url(srv.url, client_options={"allow_http": True}))


def test_whole_objects_over_http_are_one_ranged_request(root, tmp_path):
    """A whole object is one request for an open byte range (one call into obstore); an empty object,
    which no range fits (416), and a missing one come back as they are."""
    (tmp_path / "empty").write_bytes(b"")
    with FileServer(root) as srv:
        be = _http(srv)
        assert bytes(_loop.run(be.get("a/obj"), timeout=30)) == PAYLOAD
        assert (srv.requests, srv.ranged) == (1, 1)
        assert bytes(_loop.run(be.get("small"), timeout=30)) == b"xyz"
        assert bytes(_loop.run(be.get("empty"), timeout=30)) == b""
        assert _loop.run(be.get("a/none"), timeout=30) is None
        assert bytes(_loop.run(be.get_range("a/obj", 100, 300), timeout=30)) == PAYLOAD[100:300]
        assert be._open_ranges  # an empty object is no reason to stop asking for ranges


def test_a_server_that_ignores_ranges_is_asked_for_whole_objects(root):
    """A server that answers a range with 200 and the whole object (``http.server``, some proxies):
    the first whole object is fetched again without a range, the next ones at once without."""
    with FileServer(root, Faults(full=1.0, max_per_key=None)) as srv:
        be = _http(srv)
        assert bytes(_loop.run(be.get("a/obj"), timeout=30)) == PAYLOAD
        first = srv.requests
        assert first == 2 and not be._open_ranges
        assert bytes(_loop.run(be.get("small"), timeout=30)) == b"xyz"
        assert srv.requests == first + 1


def test_a_short_whole_object_over_http_fails_to_decode_and_is_fetched_again(root):
    """A body cut short where HTTP cannot see it (``Content-Length`` rewritten) comes back short from
    the open range: the decode fails, and ``fetch_decoded`` fetches it again."""
    with FileServer(root, Faults(short=1.0, max_per_key=1)) as srv:
        be = _http(srv)
        seen: list[int] = []

        async def decode(raw):
            seen.append(len(raw))
            if len(raw) != len(PAYLOAD):
                raise ValueError("truncated frame")
            return bytes(raw)

        assert _loop.run(fetch_decoded(be, "a/obj", decode), timeout=60) == PAYLOAD
        assert seen == [len(PAYLOAD) // 2, len(PAYLOAD)]


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs os.fork")
def test_fork_policy_local_files_read_remote_stores_refused(root):
    """In a forked child a local obstore directory is read with plain file I/O; a remote store raises
    ``ForkError`` at once (obstore would hang there)."""
    _loop.run(asyncio.sleep(0), timeout=10)  # the parent has used its loop
    remote = obstore.store.HTTPStore.from_url("http://127.0.0.1:9/")
    zlocal = zarr.storage.ObjectStore(obstore.store.LocalStore(prefix=root), read_only=True)
    zremote = zarr.storage.ObjectStore(remote, read_only=True)

    def check() -> bool:
        be = backend_for(zlocal)
        return (isinstance(be, LocalBackend) and isinstance(be.inner, _FileBackend)
                and bytes(_loop.run(be.get("a/obj"), timeout=10)) == PAYLOAD)

    ok, msg = in_fork(check, lambda: backend_for(zremote))
    assert ok
    assert "127.0.0.1:9" in msg and msg.endswith(_loop.FORK_HELP)


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs os.fork")
def test_plain_xarray_reads_of_an_opened_local_archive_work_in_a_forked_child(era5_path):
    """A Dataset from ``xinsitu.open_zarr(path)``, read by xarray itself (``.values``) in a DataLoader worker of
    the user's own (forked): its store's reads go through zarr's ``LocalStore`` of the same directory there
    (the child hung for good in obstore's runtime); a remote obstore store raises ``ForkError`` at once."""
    import xinsitu
    from tests.support.forked import epoch_in_fork
    from xinsitu.stores.reads import _checked_store, fork_stand_in

    ds = xinsitu.open_zarr(era5_path)
    want = ds.t2m.isel(time=slice(20, 30)).values  # the parent has used obstore's runtime
    got = epoch_in_fork(ds, 60, lambda d: d.t2m.isel(time=slice(20, 30)).values)
    assert got[0] == "ok", got
    np.testing.assert_array_equal(got[1], want)
    zs = _checked_store()(obstore.store.LocalStore(prefix=era5_path), read_only=True)
    stored = zarr.open_group(zs, mode="r")["t2m"]
    assert epoch_in_fork(stored, 60, lambda a: a.nbytes_stored()) == ("ok", stored.nbytes_stored())  # (sizes)
    zremote = _checked_store()(obstore.store.HTTPStore.from_url("http://127.0.0.1:9/a.zarr"), read_only=True)
    ok, msg = in_fork(lambda: True, lambda: fork_stand_in(zremote))
    assert ok and "http://127.0.0.1:9/a.zarr" in msg and msg.endswith(_loop.FORK_HELP), msg


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs os.fork")
def test_fork_policy_refuses_an_async_fsspec_store(root):
    """An fsspec store of an async filesystem (``xr.open_zarr("http://...")``, s3fs): its client session
    belongs to the parent's loop, so a forked child gets ``ForkError`` naming the store and the fix (it got
    asyncio's "attached to a different loop", naming nothing)."""
    pytest.importorskip("aiohttp")
    _loop.run(asyncio.sleep(0), timeout=10)
    zhttp = zarr.storage.FsspecStore.from_url("http://127.0.0.1:9/a.zarr", read_only=True)
    backend_for(zhttp)  # here, in the process that made it: fine
    ok, msg = in_fork(lambda: True, lambda: backend_for(zhttp))
    assert ok
    assert "'http://127.0.0.1:9/a.zarr'" in msg and msg.endswith(_loop.FORK_HELP)


def test_a_metadata_read_is_counted_as_a_call_into_obstore():
    """``bounded_request`` (an open's metadata reads, on zarr's loop) counts its fetch while in flight,
    as the chunk reads on xinsitu's loop are: the exit waits for it (``loop.native``)."""
    from xinsitu.io import loop as _loop
    from xinsitu.stores.reads import bounded_request

    seen = []

    async def fetch():
        seen.append(asyncio.current_task() in _loop._foreign and _loop._native >= 1)
        return b"x"

    async def main():
        got = await bounded_request(fetch, "object 'k'")
        return got, asyncio.current_task() in _loop._foreign

    got, still = asyncio.run(main())
    assert got == b"x" and seen == [True] and not still


def test_a_bucket_store_is_named_by_its_bucket_prefix_and_endpoint():
    """A timeout or a failure names the store: obstore's S3, GCS and Azure stores have no URL, and were named
    by their type alone ('S3Store'), so a user with several buckets could not tell which one stalled;
    never a credential."""
    from xinsitu.stores.reads import store_name

    st = obstore.store.S3Store("bkt", prefix="era5.zarr", endpoint="http://127.0.0.1:9", region="us-east-1",
                               access_key_id="AKIAXNAME", secret_access_key="SECRETNAME")
    for store in (st, zarr.storage.ObjectStore(st, read_only=True)):
        assert store_name(store) == "s3://bkt/era5.zarr (endpoint http://127.0.0.1:9)"
    assert store_name(obstore.store.S3Store("bkt", region="us-east-1")) == "s3://bkt"
    assert "SECRET" not in store_name(st) and "AKIA" not in store_name(st)
