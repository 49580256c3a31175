"""Object storage for real: S3 (moto's server), HTTP, and GCS/Azure protocol stores against
servers these tests start on 127.0.0.1. Every epoch equals the same epoch read from disk."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr

import xinsitu
from tests.support.servers import Faults, FileServer, MotoS3, assert_same_epoch, epoch_numpy, write_archive
from xinsitu.stores.opening import DEFAULT_CLIENT_OPTIONS, DEFAULT_RETRY_CONFIG, make_store

BUCKET = "era5-bucket"
KW = {"batch_size": 10, "block_chunks": 3, "output": "numpy", "seed": 7}


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_archive(tmp_path_factory.mktemp("remote") / "era5.zarr")


@pytest.fixture(scope="module")
def manifest(archive: str) -> xinsitu.SplitManifest:
    return xinsitu.open_zarr(archive).insitu.split("time", fractions={"train": 0.75, "val": 0.25}, gap=1)


@pytest.fixture(scope="module")
def local_epochs(archive: str, manifest: xinsitu.SplitManifest) -> dict:
    """Epochs 0 and 1 of both splits read from local disk: the reference."""
    ds = xinsitu.open_zarr(archive)
    out = {}
    for split in manifest.splits:
        gen = ds.insitu.batches(manifest, split, **KW)
        for e in (0, 1):
            gen.set_epoch(e)
            out[split, e] = epoch_numpy(gen)
    return out


@pytest.fixture(scope="module")
def s3(archive: str):
    with MotoS3() as srv:
        srv.upload(archive, BUCKET, "data/era5.zarr")
        yield srv


@pytest.fixture(scope="module")
def http(archive: str):
    with FileServer(Path(archive).parent) as srv:
        yield srv


def _check_epochs(ds: xr.Dataset, manifest, local_epochs, splits=("train", "val"), epochs=(0, 1)) -> None:
    for split in splits:
        gen = ds.insitu.batches(manifest, split, **KW)
        for e in epochs:
            gen.set_epoch(e)
            assert_same_epoch(epoch_numpy(gen), local_epochs[split, e])


# ----------------------------------------------------------------------------- S3
@pytest.mark.slow
def test_s3_epochs_equal_local(s3, manifest, local_epochs):
    ds = xinsitu.open_zarr(f"s3://{BUCKET}/data/era5.zarr", **s3.options)
    assert "dask" not in type(ds.t2m.variable._data).__module__
    _check_epochs(ds, manifest, local_epochs)


def test_s3_store_objects_and_plain_xarray(s3, manifest, local_epochs):
    """An obstore S3Store, a zarr ObjectStore over it, and xr.open_zarr on that: same epochs."""
    import zarr.storage

    obs = s3.store(BUCKET, prefix="data/era5.zarr")
    zs = zarr.storage.ObjectStore(obs, read_only=True)
    for ds in (xinsitu.open_zarr(obs), xinsitu.open_zarr(zs), xr.open_zarr(zs, chunks=None)):
        _check_epochs(ds, manifest, local_epochs, splits=("train",), epochs=(1,))


def test_s3_subset_equals_local(s3, archive, manifest):
    ds = xinsitu.open_zarr(f"s3://{BUCKET}/data/era5.zarr", **s3.options)
    local = xinsitu.open_zarr(archive)
    sub = {"variables": ["tp", "lsm", "t2m"], "window": {"time": 3}, "patch": {"lat": 4, "lon": 8}}
    ref = local.isel(lat=slice(0, 8)).insitu.batches(manifest, "train", **KW, **sub)
    got = ds.isel(lat=slice(0, 8)).insitu.batches(manifest, "train", **KW, **sub)
    assert_same_epoch(epoch_numpy(got), epoch_numpy(ref))


def test_s3_anonymous_needs_a_public_bucket(s3, archive, manifest, local_epochs):
    bucket = "era5-public"
    s3.upload(archive, bucket, "era5.zarr")
    url = f"s3://{bucket}/era5.zarr"
    opts = {"endpoint": s3.endpoint, "region": s3.region, "client_options": {"allow_http": True}}
    with pytest.raises(PermissionError):  # unsigned requests are refused: anonymous really is unsigned
        xinsitu.open_zarr(url, anonymous=True, **opts)
    s3.make_public(bucket)
    ds = xinsitu.open_zarr(url, anonymous=True, **opts)
    _check_epochs(ds, manifest, local_epochs, splits=("val",), epochs=(0,))


def test_s3_wrong_bucket_is_a_clear_error(s3):
    with pytest.raises(FileNotFoundError, match="no zarr group found at s3://era5-bucket/nothing-here"):
        xinsitu.open_zarr(f"s3://{BUCKET}/nothing-here", **s3.options)


# ----------------------------------------------------------------------------- HTTP, GCS, Azure
def test_http_epochs_equal_local(http, manifest, local_epochs):
    ds = xinsitu.open_zarr(f"{http.url}/era5.zarr")  # plain http works without allow_http
    _check_epochs(ds, manifest, local_epochs)


def test_gcs_and_azure_protocols_equal_local(archive, tmp_path, manifest, local_epochs):
    """gs:// and az:// stores (unsigned) speaking to a local server laid out like those services."""
    shutil.copytree(archive, tmp_path / "gbucket" / "era5.zarr")
    shutil.copytree(archive, tmp_path / "acct" / "cont" / "era5.zarr")
    with FileServer(tmp_path) as srv:
        opts = {"skip_signature": True, "client_options": {"allow_http": True}}
        gs = xinsitu.open_zarr("gs://gbucket/era5.zarr", base_url=srv.url, **opts)
        az = xinsitu.open_zarr("az://cont/era5.zarr", account_name="acct", endpoint=f"{srv.url}/acct", **opts)
        for ds in (gs, az):
            _check_epochs(ds, manifest, local_epochs, splits=("train",), epochs=(0,))
        assert not [p for p in srv.missing if "/c/" in p]  # every chunk was found where expected


@pytest.mark.slow
def test_sharded_archive_by_byte_ranges_equals_local(tmp_path, manifest, local_epochs, s3):
    """Shards of 4 inner chunks: inner chunks are fetched by byte range, over HTTP and S3."""
    path = write_archive(tmp_path / "sharded.zarr", shard_time=32)
    assert xinsitu.open_zarr(path).insitu.geometry.variables["t2m"].shards is not None
    s3.upload(path, "shards", "sharded.zarr")
    _check_epochs(xinsitu.open_zarr("s3://shards/sharded.zarr", **s3.options), manifest, local_epochs,
                  splits=("train", "val"), epochs=(1,))
    with FileServer(tmp_path) as srv:
        ds = xinsitu.open_zarr(f"{srv.url}/sharded.zarr")
        srv.reset_counts()
        _check_epochs(ds, manifest, local_epochs, splits=("train", "val"), epochs=(0,))
        assert srv.ranged > 0  # byte ranges, not whole shards


@pytest.mark.slow
def test_max_inflight_bounds_requests(archive, manifest):
    """With latency on every request, the server never sees more than max_inflight at once."""
    with FileServer(Path(archive).parent, Faults(latency=0.05)) as srv:
        ds = xinsitu.open_zarr(f"{srv.url}/era5.zarr")
        srv.reset_counts()
        gen = ds.insitu.batches(manifest, "train", batch_size=16, block_chunks=4, max_inflight=3, output="numpy")
        n = sum(len(next(iter(b.values()))) for b in gen)
        assert n == manifest.positions("train")
        assert 2 <= srv.peak <= 3, srv.peak


def test_automatic_max_inflight_grows_with_latency(archive, manifest, monkeypatch):
    """max_inflight=None over a network: many requests in flight at once, never more than the cap. By
    rule (``assert_grew_by_rule``): a window this machine's load made slow holds the limit; where none
    did, it got to the cap."""
    from tests.io.test_io_robust import assert_grew_by_rule, watch_limit
    from xinsitu.io import inflight

    monkeypatch.setattr(inflight, "AUTO_INFLIGHT", (3, 12))
    windows, stalls = watch_limit(monkeypatch)
    with FileServer(Path(archive).parent, Faults(latency=0.05)) as srv:
        ds = xinsitu.open_zarr(f"{srv.url}/era5.zarr")
        srv.reset_counts()
        gen = ds.insitu.batches(manifest, "train", batch_size=16, block_chunks=4, output="numpy")
        n = sum(len(next(iter(b.values()))) for b in gen)
        assert n == manifest.positions("train")
        limit = gen._reader.inflight
        top = max([limit.limit] + [n for n, _ in limit.history])  # it may step back where latency inflates
        assert limit.latency_s > 0.04, (limit.history, limit.latency_s)
        assert_grew_by_rule(windows, 12)  # (the first window, the quickest so far, is never a strike)
        assert any(used and strikes == 0 for _, used, _, _, _, strikes, _ in windows), windows
        if not stalls and all(used and strikes == 0 and cap == 12 for _, used, cap, _, _, strikes, _ in windows):
            assert top == 12, windows
        assert 3 < srv.peak <= 12, srv.peak


def test_inflight_limit_follows_littles_law():
    """Enough requests to keep the decode threads busy while each waits, twice over, within the bounds."""
    from xinsitu.io.inflight import AUTO_INFLIGHT, AUTO_REMOTE, InflightLimit

    fast = InflightLimit(None, threads=2)
    for _ in range(20):
        fast.observe(latency_s=0.0005, decode_s=0.00025)  # local disk: 2 x 2 x 2 = 8 wanted
    assert fast.limit == AUTO_INFLIGHT[0]
    far = InflightLimit(None, threads=2)
    far.observe(latency_s=0.02, decode_s=0.0005)  # 20 ms away: 2 x 2 x 40 = 160
    assert far.limit == 160
    for _ in range(30):
        far.observe(latency_s=0.1, decode_s=0.0005)  # 100 ms away: 800 wanted, never past the cap
    assert far.limit == AUTO_INFLIGHT[1]
    from tests.io.test_io_robust import _remote, _simulate  # a remote limit runs on simulated time there

    near = _remote()  # a store across a network starts low (it may be overloaded) ...
    assert near.limit == AUTO_REMOTE[0]
    seen = _simulate(near, lambda k: 0.001, 400)  # ... and Little's law bounds it when it answers in 1 ms
    assert seen[-1] == AUTO_INFLIGHT[0] and max(seen) == AUTO_INFLIGHT[0]
    fixed = InflightLimit(5, threads=2)
    fixed.observe(latency_s=1.0, decode_s=0.001)
    assert fixed.limit == 5


def test_missing_chunk_reads_as_fill_value(archive, tmp_path, manifest):
    """A chunk object that does not exist reads as zarr's fill value, locally and over HTTP."""
    path = tmp_path / "holes.zarr"
    shutil.copytree(archive, path)
    for key in ("t2m/c/2/0/0", "tp/c/5/0/0"):
        os.remove(path / key)
    ref = xr.open_zarr(path, chunks=None).load()
    assert np.isnan(ref.t2m.values[16:24]).all()  # float fill value NaN
    assert (ref.tp.values[40:48] == 30.0).all()  # int16 fill value 0, unpacked: 0 * 0.001 + 30
    m = xinsitu.open_zarr(str(path)).insitu.split("time", fractions={"all": 1.0})
    with FileServer(tmp_path) as srv:
        for ds in (xinsitu.open_zarr(str(path)), xinsitu.open_zarr(f"{srv.url}/holes.zarr")):
            gen = ds.insitu.batches(m, "all", batch_size=96, shuffle=False, output="numpy")
            (batch,) = list(gen)
            for v in ("t2m", "tp", "u10"):
                np.testing.assert_array_equal(batch[v], ref[v].values)
        assert sorted(p for p in srv.missing if "/c/" in p) == ["/holes.zarr/t2m/c/2/0/0", "/holes.zarr/tp/c/5/0/0"]


@pytest.mark.slow
def test_no_dask_no_fsspec_on_the_read_path(http, manifest):
    """A fresh process where dask and fsspec cannot be imported (as if not installed) reads an
    epoch over HTTP, through obstore."""
    script = textwrap.dedent(f"""
        import json, sys
        for name in ("dask", "fsspec", "s3fs", "gcsfs", "adlfs", "upath"):  # upath needs fsspec (zarr >= 3.3)
            sys.modules[name] = None  # `import dask` now fails, find_spec("dask") is None
        import xinsitu
        from xinsitu.stores.backend import backend_for
        from xinsitu.index.source import resolve
        m = xinsitu.SplitManifest.from_json({manifest.to_json()!r})
        ds = xinsitu.open_zarr({http.url + "/era5.zarr"!r})
        gen = ds.insitu.batches(m, "train", batch_size=10, output="numpy")
        n = sum(len(b["t2m"]) for b in gen)
        backend = type(backend_for(resolve(ds)["t2m"].array.store)).__name__
        print(json.dumps({{"n": n, "backend": backend}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res == {"n": manifest.positions("train"), "backend": "_ObstoreBackend"}


@pytest.mark.parametrize("consolidated", [None, False, True])
@pytest.mark.slow
def test_open_on_a_server_that_never_answers_is_bounded_and_named(archive, consolidated):
    """The metadata reads of an open get the request timeout of chunk reads: a server that accepts
    and never answers gives a TimeoutError naming the object and XINSITU_REQUEST_TIMEOUT, after
    3 tries of 0.5 s (obstore alone waited ~241 s a key). The open runs in a process of its own,
    killed at 60 s: a regression fails, it does not hang the suite."""
    script = textwrap.dedent(f"""
        import sys, time, xinsitu
        t = time.monotonic()
        try:
            xinsitu.open_zarr(sys.argv[1], consolidated={consolidated!r})
        except TimeoutError as e:
            print("TimeoutError:", e)
        print("took", time.monotonic() - t)
    """)
    with FileServer(Path(archive).parent, Faults(hang=1.0, max_per_key=None), max_lifetime_s=90) as srv:
        url = f"{srv.url}/era5.zarr"
        out = subprocess.run([sys.executable, "-c", script, url], capture_output=True, text=True,
                             timeout=60, cwd=Path(__file__).parents[2],
                             env={**os.environ, "XINSITU_REQUEST_TIMEOUT": "0.5"})
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stdout
    assert "TimeoutError: metadata object 'zarr.json'" in said and url in said, said
    assert "no answer within 0.5 s, 3 times" in said and "XINSITU_REQUEST_TIMEOUT" in said, said
    assert float(said.split("took")[-1]) < 30, said


@pytest.mark.slow
def test_a_server_that_only_answers_503_within_a_short_timeout_is_not_called_silent(archive):
    """obstore retries 5xx answers on its own; with a request timeout shorter than its retries, a
    server that keeps answering 503 is given up by xinsitu's bound, which cannot see the answers:
    the error says that such a server reads the same as a silent one, not only "no answer"."""
    script = textwrap.dedent("""
        import sys, xinsitu
        try:
            xinsitu.open_zarr(sys.argv[1])
        except TimeoutError as e:
            print("TimeoutError:", e)
    """)
    with FileServer(Path(archive).parent, Faults(error_503=1.0, max_per_key=None), max_lifetime_s=90) as srv:
        out = subprocess.run([sys.executable, "-c", script, f"{srv.url}/era5.zarr"], capture_output=True,
                             text=True, timeout=60, cwd=Path(__file__).parents[2],
                             env={**os.environ, "XINSITU_REQUEST_TIMEOUT": "0.5"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TimeoutError: metadata object 'zarr.json'" in out.stdout, out.stdout
    assert "or only answers its client retries, such as 5xx" in out.stdout, out.stdout


@pytest.mark.parametrize("kind", ["ObjectStore", "FsspecStore"])
@pytest.mark.slow
def test_open_of_a_store_object_on_a_server_that_never_answers_is_bounded(archive, kind):
    """A store object the user built -- ``zarr.storage.ObjectStore`` over their own obstore store,
    ``zarr.storage.FsspecStore`` -- gets the bound of the metadata reads too: a server that accepts
    and never answers gives a TimeoutError naming the object, after 3 tries of 0.5 s (both waited
    minutes: only stores of the obstore module were bounded). In a process of its own, killed at
    60 s: a regression fails, it does not hang the suite."""
    if kind == "FsspecStore":
        pytest.importorskip("fsspec")
        pytest.importorskip("aiohttp")
    script = textwrap.dedent(f"""
        import sys, time, xinsitu, zarr.storage
        if {kind!r} == "ObjectStore":
            import obstore.store
            store = zarr.storage.ObjectStore(obstore.store.HTTPStore.from_url(
                sys.argv[1], client_options={{"allow_http": True}}), read_only=True)
        else:
            store = zarr.storage.FsspecStore.from_url(sys.argv[1], read_only=True)
        t = time.monotonic()
        try:
            xinsitu.open_zarr(store)
        except TimeoutError as e:
            print("TimeoutError:", e)
        print("took", time.monotonic() - t)
    """)
    with FileServer(Path(archive).parent, Faults(hang=1.0, max_per_key=None), max_lifetime_s=90) as srv:
        url = f"{srv.url}/era5.zarr"
        out = subprocess.run([sys.executable, "-c", script, url], capture_output=True,
                             text=True, timeout=60, cwd=Path(__file__).parents[2],
                             env={**os.environ, "XINSITU_REQUEST_TIMEOUT": "0.5"})
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stdout
    assert f"TimeoutError: metadata object 'zarr.json' of {url}:" in said, said
    assert "no answer within 0.5 s, 3 times" in said and "XINSITU_REQUEST_TIMEOUT" in said, said
    assert float(said.split("took")[-1]) < 30, said


@pytest.mark.slow
def test_a_timeout_of_obstore_s_own_is_a_timeout_error_naming_the_object(archive):
    """Where obstore gives up first (its read timeout, retried until its retry timeout: here 0.3 s and
    1 s, under a request bound of 30 s), the open raises ``TimeoutError`` naming the object at once
    -- not a generic ``OSError`` after the same wait made again for the next object."""
    script = textwrap.dedent("""
        import sys, time, xinsitu
        from datetime import timedelta
        t = time.monotonic()
        try:
            xinsitu.open_zarr(sys.argv[1], client_options={"read_timeout": "300ms"},
                              retry_config={"max_retries": 3, "retry_timeout": timedelta(seconds=1)})
        except TimeoutError as e:
            print("TimeoutError:", e)
        print("took", time.monotonic() - t)
    """)
    with FileServer(Path(archive).parent, Faults(hang=1.0, max_per_key=None), max_lifetime_s=90) as srv:
        url = f"{srv.url}/era5.zarr"
        out = subprocess.run([sys.executable, "-c", script, url], capture_output=True, text=True,
                             timeout=60, cwd=Path(__file__).parents[2],
                             env={**os.environ, "XINSITU_REQUEST_TIMEOUT": "30"})
        tries = srv.requests
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stdout
    import re

    assert re.search(rf"TimeoutError: metadata object '(zarr\.json|\.zgroup|\.zattrs|\.zmetadata)' of {url}: no answer",
                     said), said
    assert float(said.split("took")[-1]) < 20, said
    assert tries <= 16, tries  # obstore's own tries of the objects zarr asks for at once, not of each in turn


def test_the_default_request_bound_ends_a_silent_server_s_wait(monkeypatch):
    """Without ``XINSITU_REQUEST_TIMEOUT``: each try of a request is given long enough for obstore's
    own stall detection (connect and read timeouts) to fire and retry once, and ends before obstore's
    retry timeout -- so a server that never answers ends in xinsitu's ``TimeoutError`` naming the
    object, not obstore's generic error -- and three tries end within three minutes (the bound was
    360 s a try: an open on a silent server took 724 s, then raised ``OSError``)."""
    from xinsitu.io import loop as _loop
    from xinsitu.stores.reads import FETCH_ATTEMPTS

    monkeypatch.delenv("XINSITU_REQUEST_TIMEOUT", raising=False)
    limit = _loop.request_timeout()

    def seconds(text: str) -> float:
        return float(text.removesuffix("ms")) / 1000 if text.endswith("ms") else float(text.removesuffix("s"))

    stall = seconds(DEFAULT_CLIENT_OPTIONS["connect_timeout"]) + seconds(DEFAULT_CLIENT_OPTIONS["read_timeout"])
    assert stall < limit < DEFAULT_RETRY_CONFIG["retry_timeout"].total_seconds(), limit
    assert limit * FETCH_ATTEMPTS <= 180, limit


@pytest.mark.slow
def test_a_dask_selection_maps_back_without_asking_the_store(archive):
    """A selection of ``xr.open_zarr(URL)`` (fsspec, dask) was mapped back to its stored positions by reopening the
    store for its coordinates (a read that had to be bounded once the server stopped answering). Its dask graph
    says the positions now: with every request hanging, ``resolve`` still answers at once. In a process of its own
    (it starts the server itself), killed at 60 s: a regression fails."""
    pytest.importorskip("fsspec")
    pytest.importorskip("aiohttp")
    script = textwrap.dedent(f"""
        import sys, time
        import xarray as xr
        from tests.support.servers import Faults, FileServer
        from xinsitu.index.source import resolve
        with FileServer({str(Path(archive).parent)!r}, max_lifetime_s=90) as srv:
            ds = xr.open_zarr(srv.url + "/era5.zarr").isel(time=[3, 40])
            ds = ds.sel(time=ds.time.values)
            srv.faults = Faults(hang=1.0, max_per_key=None)
            t = time.monotonic()
            print("index", resolve(ds, ["t2m"])["t2m"].index[0].tolist())
            print("took", time.monotonic() - t)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).parents[2], env={**os.environ, "XINSITU_REQUEST_TIMEOUT": "0.5"})
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stdout
    assert "index [3, 40]" in said, said
    assert float(said.split("took")[-1]) < 10, said


# ----------------------------------------------------------------------------- no consolidated metadata over plain HTTP
def _unconsolidated(path: Path, zarr_format: int) -> xr.Dataset:
    """An archive without consolidated metadata at ``path``, with a group ``g`` inside; the Dataset."""
    ds = xr.Dataset({"b": (("time", "x"), np.arange(24.0).reshape(6, 4)), "a": (("time",), np.arange(6, dtype="i4"))},
                    coords={"time": np.arange(6), "x": np.arange(4.0)})
    ds.to_zarr(path, zarr_format=zarr_format, consolidated=False, encoding={"b": {"chunks": (2, 4)}})
    ds[["a"]].to_zarr(path, group="g", zarr_format=zarr_format, consolidated=False)
    return ds


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.slow
def test_an_unconsolidated_archive_over_plain_http_opens_from_the_index_pages(tmp_path, zarr_format):
    """``python -m http.server`` serving an archive written without consolidated metadata (someone
    else's: the reader cannot consolidate it): ``xinsitu.open_zarr(url)`` finds the arrays from the
    server's directory index pages, as fsspec does for ``xr.open_zarr(url)``, without a word and
    without a ``PROPFIND`` (it refused: "consolidate the metadata"; with ``consolidated=False`` it
    raised after ten ``PROPFIND`` answered 501). Batches equal plain xarray's."""
    import warnings

    from tests.support.servers import IndexServer

    src = _unconsolidated(tmp_path / "noc.zarr", zarr_format)
    with IndexServer(tmp_path) as srv:
        url = f"{srv.url}/noc.zarr"
        for consolidated in (None, False):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                ds = xinsitu.open_zarr(url, consolidated=consolidated)
            assert list(ds.data_vars) == ["a", "b"], list(ds.data_vars)
            xr.testing.assert_identical(ds.load(), src.load())
        assert list(xinsitu.open_zarr(url, group="g").data_vars) == ["a"]
        m = ds.insitu.split("time", fractions={"train": 1.0})
        for b, ids in zip(ds.insitu.batches(m, "train", batch_size=3, output="numpy"),
                          ds.insitu.batches(m, "train", batch_size=3, output="numpy").batch_ids(), strict=True):
            assert np.array_equal(b["b"], src.b.values[ids]), ids
        assert srv.methods["PROPFIND"] == 0, srv.methods


def test_a_server_that_lists_nothing_is_said_at_once(tmp_path):
    """A server with neither index pages (404) nor WebDAV (``PROPFIND`` answered 501): those are its
    answers, not faults. The open raises at once -- one ``PROPFIND``, no retries -- saying what the
    server answered (not its HTML page), why the arrays cannot be found, and what works; with
    consolidated metadata written, the same URL opens."""
    _unconsolidated(tmp_path / "noc.zarr", 3)
    with FileServer(tmp_path) as srv:  # files only
        url = f"{srv.url}/noc.zarr"
        for consolidated in (None, False):
            srv.reset_counts()
            with pytest.raises(ValueError, match="lists no directory") as err:
                xinsitu.open_zarr(url, consolidated=consolidated)
            said = str(err.value)
            assert "404" in said and "501" in said and "xr.open_zarr(url)" in said, said
            assert "zarr.consolidate_metadata" in said and "html" not in said.lower(), said
            assert srv.methods["PROPFIND"] == 1 and srv.state.attempts["/noc.zarr/"] == 1, srv.methods
        zarr.consolidate_metadata(str(tmp_path / "noc.zarr"))
        assert list(xinsitu.open_zarr(url).data_vars) == ["a", "b"]


# ----------------------------------------------------------------------------- options
def test_the_default_backoff_waits_out_a_burst_of_503s():
    """obstore waits, between retries, a time drawn at random between ``init_backoff`` and ``base`` times
    the last wait (at most ``max_backoff``; object_store's ``Backoff::next``). The defaults wait out 5 s
    of 503s (S3's SlowDown, a short outage) in 999 of 1000 draws -- with base 2 the waits hardly grew, and
    10 retries spanned under 1.5 s in 1 draw of 100 (a 6 s burst ended an epoch) -- and give up a store
    that always answers 5xx within the request bound, never past it."""
    import random

    back, n = DEFAULT_RETRY_CONFIG["backoff"], DEFAULT_RETRY_CONFIG["max_retries"]
    init, top = back["init_backoff"].total_seconds(), back["max_backoff"].total_seconds()

    def window(rng: random.Random) -> float:
        nxt, total = init, 0.0
        for _ in range(n):
            total, nxt = total + nxt, min(top, rng.uniform(init, nxt * back["base"]))
        return total

    rng = random.Random(0)
    spans = sorted(window(rng) for _ in range(10_000))
    assert spans[10] >= 5.0
    from xinsitu.io.loop import REQUEST_TIMEOUT

    assert init + (n - 1) * top < REQUEST_TIMEOUT  # the longest it can take


def test_a_chunk_answered_503_eleven_times_is_still_read(archive, manifest, local_epochs):
    """One chunk answers 503 eleven times before it is served (the backoff made short here, the count
    of retries left at its default): the epoch equals local disk's (10 retries gave up)."""
    fast = {"backoff": {"init_backoff": timedelta(milliseconds=5), "max_backoff": timedelta(milliseconds=20)}}
    with FileServer(Path(archive).parent, Faults(error_503=1.0, max_per_key=11, pattern=r"t2m/c/1/0/0$")) as srv:
        ds = xinsitu.open_zarr(f"{srv.url}/era5.zarr", retry_config=fast)
        _check_epochs(ds, manifest, local_epochs, splits=("train",), epochs=(0,))
        assert sum(n for path, n in srv.state.attempts.items() if path.endswith("t2m/c/1/0/0")) == 12


def test_store_options_pass_through_over_defaults(s3):
    st = make_store(f"s3://{BUCKET}/data", endpoint=s3.endpoint, region="eu-west-3", access_key_id="AKIAX",
                    secret_access_key="sk", client_options={"allow_http": True, "timeout": "7s"},
                    retry_config={"max_retries": 2, "backoff": {"max_backoff": timedelta(seconds=1)}})
    assert type(st).__name__ == "S3Store"
    assert st.config["region"] == "eu-west-3" and st.config["endpoint"] == s3.endpoint
    assert st.client_options["timeout"] == "7s"  # the user's value wins, key by key
    assert st.client_options["read_timeout"] == DEFAULT_CLIENT_OPTIONS["read_timeout"]
    assert st.retry_config["max_retries"] == 2
    assert st.retry_config["backoff"]["max_backoff"] == timedelta(seconds=1)
    assert st.retry_config["backoff"]["init_backoff"] == DEFAULT_RETRY_CONFIG["backoff"]["init_backoff"]
    assert st.retry_config["retry_timeout"] == DEFAULT_RETRY_CONFIG["retry_timeout"]


def test_client_options_given_beside_the_store_options(s3, archive):
    """``open_zarr(url, endpoint=..., allow_http=True)``, the way one writes it for a local S3 server: a
    client option given at the top goes into ``client_options`` (obstore panicked, a BaseException that
    no ``except Exception`` catches: "Expected config prefix to start with aws_")."""
    st = make_store(f"s3://{BUCKET}/data", endpoint=s3.endpoint, region=s3.region, allow_http=True, timeout="9s",
                    client_options={"timeout": "7s"})
    assert st.client_options["allow_http"] in (True, "true") and st.client_options["timeout"] == "9s"
    s3.upload(archive, "top-level-options", "era5.zarr")
    opts = {k: v for k, v in s3.options.items() if k != "client_options"}
    ds = xinsitu.open_zarr("s3://top-level-options/era5.zarr", **opts, allow_http=True)
    assert list(ds.data_vars) == list(xinsitu.open_zarr(archive).data_vars)


def test_what_a_new_user_passes_by_mistake_gets_a_clear_error(tmp_path):
    """A Dataset already open, a file:// URL to nothing, a named memory:// URL: errors of open_zarr's own
    (zarr's "Unsupported type for store_like", obstore's "Unable to canonicalize filesystem root" and
    "Unable to recognise URL" before)."""
    import xarray as xr

    ds = xr.Dataset({"a": ("t", np.arange(3.0))})
    for obj in (ds, ds.a):
        with pytest.raises(TypeError, match="open already: use its .insitu accessor"):
            xinsitu.open_zarr(obj)
    with pytest.raises(FileNotFoundError, match="no zarr store at 'file:///"):
        xinsitu.open_zarr(f"file://{tmp_path}/nothing.zarr")
    assert type(make_store("memory://scratch.zarr")).__name__ == "MemoryStore"
    with pytest.raises(FileNotFoundError, match="memory://scratch.zarr"):
        xinsitu.open_zarr("memory://scratch.zarr")


def test_store_kinds_from_urls(tmp_path):
    assert type(make_store("gs://bucket/a.zarr", anonymous=True)).__name__ == "GCSStore"
    az = make_store("az://container/a.zarr", account_name="acct", anonymous=True)
    assert type(az).__name__ == "AzureStore"
    assert type(make_store("https://example.org/a.zarr", anonymous=True)).__name__ == "HTTPStore"
    s3 = make_store("https://bucket.s3.us-west-2.amazonaws.com/a.zarr", anonymous=True)
    assert type(s3).__name__ == "S3Store" and s3.config["skip_signature"] in (True, "true")
    h = make_store("http://127.0.0.1:1/a.zarr")
    assert h.client_options["allow_http"] in (True, "true")
    assert type(make_store(str(tmp_path))).__name__ == "LocalStore"
    assert type(make_store("memory://")).__name__ == "MemoryStore"
    with pytest.raises(TypeError, match="apply to URLs"):
        make_store(str(tmp_path), region="us-east-1")
    with pytest.raises(ValueError, match="unsupported URL scheme 'ftp'"):
        make_store("ftp://host/a.zarr")
    with pytest.raises(FileNotFoundError):
        make_store(str(tmp_path / "nope"))


def test_a_server_without_content_length_is_named_with_the_way_to_open_it(archive):
    """obstore's HTTP store needs a ``Content-Length``; a server that ends each body by closing its connection
    (dynamic servers do) was refused in obstore's words alone. The error names the archive and what opens
    it (fsspec, through ``xr.open_zarr(url)``), whose Dataset ``ds.insitu`` then reads."""
    from tests.support.plain_http import PlainServer

    with PlainServer(Path(archive).parent, lengths=False) as srv:
        url = f"{srv.url}/{Path(archive).name}"
        with pytest.raises(OSError, match=r"opening http://127\.0\.0\.1:\d+/era5\.zarr: .*Content-Length.*"
                                          r"xr\.open_zarr\(url\) opens it through fsspec"):
            xinsitu.open_zarr(url)


def test_an_error_of_obstores_at_opening_names_the_archive():
    """An S3 open without credentials anywhere: obstore asks the instance metadata endpoint, and its refusal is
    said as what it means (no credentials found), naming the archive and both ways on."""
    from xinsitu.stores.redact import opening_error

    class GenericError(Exception):  # obstore's name; its module decides nothing here
        pass

    err = opening_error(GenericError("Generic S3 error: Error performing PUT http://169.254.169.254/latest/api/"
                                     "token: 403 Forbidden"), [], "s3://bucket/era5.zarr")
    assert isinstance(err, OSError)
    assert str(err).startswith("opening s3://bucket/era5.zarr: GenericError: Generic S3 error")
    assert "no AWS credentials were found" in str(err) and "anonymous=True" in str(err)


def test_credentials_in_an_http_url_are_sent_and_never_shown(archive, caplog):
    """``http://user:password@host/...``, as curl and fsspec take it: obstore dropped the user info unsent (the
    server refused, or served without them), and zarr's log lines showed the URL with the password. It is
    sent as HTTP Basic ``Authorization`` now, and the store keeps the URL without it."""
    import logging

    from tests.support.plain_http import PlainServer

    local = xinsitu.open_zarr(archive)
    with PlainServer(Path(archive).parent, auth="reader:s3cr%t pw") as srv:
        url = srv.url.replace("http://", "http://reader:s3cr%25t%20pw@") + "/" + Path(archive).name
        with caplog.at_level(logging.DEBUG):
            ds = xinsitu.open_zarr(url)
            np.testing.assert_array_equal(ds.t2m.isel(time=slice(0, 9)).values, local.t2m.isel(time=slice(0, 9)).values)
            m = ds.insitu.split("time", fractions={"train": 1.0})
            got = next(iter(ds.insitu.batches(m, "train", batch_size=4, shuffle=False, output="numpy")))
        np.testing.assert_array_equal(got["t2m"], local.t2m.isel(time=slice(0, 4)).values)
        shown = caplog.text + repr(ds.t2m.encoding) + repr(ds.insitu.geometry)
        assert "s3cr" not in shown and "reader:" not in shown
        with pytest.raises(PermissionError, match=r"opening http://127\.0\.0\.1:\d+/era5\.zarr"):
            xinsitu.open_zarr(url.replace("s3cr%25t%20pw", "wrong"))


def test_a_refusal_that_quotes_the_request_never_shows_a_urls_credentials(archive):
    """A server whose refusal quotes the request's headers (as S3's signature errors do): the ``Authorization``
    header made of ``http://user:password@`` is scrubbed from the error as one given in ``client_options`` is."""
    import base64

    token = base64.b64encode(b"reader:s3cretPW").decode()
    with FileServer(Path(archive).parent, Faults(always=r".*zarr\.json", always_status=403)) as srv:
        url = srv.url.replace("http://", "http://reader:s3cretPW@") + "/" + Path(archive).name
        with pytest.raises(PermissionError) as raised:
            xinsitu.open_zarr(url)
    said = str(raised.value)
    assert "authorization: ***" in said.lower() and token not in said and "s3cretPW" not in said
