"""Credentials and signed URLs never show: not in a repr, a log line, an exception (or its
traceback), a manifest or a saved state. Manifests and states are JSON, never pickle."""

from __future__ import annotations

import json
import logging
import pickle
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import xinsitu
from tests.support.servers import Faults, FileServer, MotoS3, write_archive
from xinsitu.stores.opening import make_store

# distinctive fake credentials: any of them found in a text is a leak
ACCESS_KEY = "AKIAXINSITULEAK7777"
SECRET_KEY = "xinsitu-SECRET-key-do-not-leak-4242"
SESSION = "xinsitu-SESSION-token-do-not-leak-9191"
SIGNATURE = "xinsitu-SIGNATURE-do-not-leak-5151"
BEARER = "xinsitu-BEARER-do-not-leak-6161"
SECRETS = (ACCESS_KEY, SECRET_KEY, SESSION, SIGNATURE, BEARER)
# the in-process test servers log what they receive (a real store's logs are not ours)
SERVER_LOGGERS = ("moto", "werkzeug")
FAST = {"max_retries": 2,
        "backoff": {"init_backoff": timedelta(milliseconds=5), "max_backoff": timedelta(milliseconds=20)}}


def assert_clean(text: str, where: str) -> None:
    for s in SECRETS:
        assert s not in text, f"{where} shows a credential: ...{text[max(0, text.find(s) - 80):text.find(s) + 40]}..."


def error_text(e: BaseException) -> str:
    """Everything a traceback or a logger would print about ``e``, its causes included, and the
    messages of every exception reachable from it (a handler or a debugger reads ``__context__``
    even where the traceback leaves it out: ``raise ... from None``)."""
    chain, todo, seen = [], [e], set()
    while todo:
        cur = todo.pop()
        if cur is not None and id(cur) not in seen:
            seen.add(id(cur))
            chain.append(f"{type(cur).__name__}: {cur}")
            todo += [cur.__cause__, cur.__context__]
    return "".join(traceback.format_exception(e)) + repr(e) + "\n".join(chain)


def everything_shown(ds, m, gen) -> dict[str, str]:
    """Every text xinsitu shows about a Dataset, its manifest and a generator."""
    g = ds.insitu.geometry
    state = gen.state_dict()
    return {
        "dataset repr": repr(ds), "encodings": json.dumps({v: ds[v].encoding for v in ds.variables}, default=str),
        "dataset attrs": json.dumps(ds.attrs, default=str),
        "geometry repr": repr(g), "geometry html": g._repr_html_(),
        "manifest repr": repr(m), "manifest html": m._repr_html_(), "manifest summary": m.summary(),
        "manifest json": m.to_json(), "generator repr": repr(gen), "generator html": gen._repr_html_(),
        "state": json.dumps(state), "io stats": json.dumps(gen.io_stats, default=str),
        "sample": repr(gen.sample(0)),
    }


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_archive(tmp_path_factory.mktemp("security") / "era5.zarr")


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.DEBUG)  # every logger, every level
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caplog, caught


def _check_logs(logs: Any) -> None:
    caplog, caught = logs
    fmt = logging.Formatter("%(name)s %(levelname)s %(message)s")
    for rec in caplog.records:
        if rec.name.split(".")[0] in SERVER_LOGGERS:
            continue
        text = fmt.format(rec)  # includes the formatted exception, if any
        assert_clean(text, f"log record of {rec.name}")
    for w in caught:
        assert_clean(str(w.message), "a warning")


def _epoch_until_error(gen) -> BaseException | None:
    try:
        for _ in gen:
            pass
    except Exception as e:  # noqa: BLE001 - returned to the test
        return e
    return None


@pytest.mark.slow
def test_s3_credentials_never_shown(archive, logs):
    import obstore

    caplog, _ = logs
    with MotoS3(access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY) as s3:
        s3.upload(archive, "secure", "era5.zarr")
        s3.upload(archive, "private", "era5.zarr")
        caplog.clear()  # from here on, only what reading does (boto3 above logs its own signing)
        opts = s3.options | {"session_token": SESSION}
        url = "s3://secure/era5.zarr"
        store = make_store(url, **opts)
        assert SECRET_KEY in json.dumps(store.config)  # the store holds them: the checks below mean something
        ds = xinsitu.open_zarr(url, **opts)
        m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
        gen = ds.insitu.batches(m, "train", batch_size=8, output="numpy")
        assert _epoch_until_error(gen) is None
        for where, text in everything_shown(ds, m, gen).items():
            assert_clean(text, where)
        # a corrupt chunk, a missing group and a refused request: none of the errors shows a credential
        obstore.put(s3.store("secure"), "era5.zarr/t2m/c/1/0/0", b"garbage" * 9)
        gen = ds.insitu.batches(m, "train", batch_size=8, output="numpy", shuffle=False)
        err = _epoch_until_error(gen)
        assert isinstance(err, xinsitu.ChunkReadError)
        assert_clean(error_text(err), "ChunkReadError")
        with pytest.raises(FileNotFoundError) as ei:
            xinsitu.open_zarr("s3://secure/missing.zarr", **opts)
        assert_clean(error_text(ei.value), "FileNotFoundError")
        with pytest.raises(PermissionError) as ei:
            xinsitu.open_zarr("s3://private/era5.zarr", anonymous=True, endpoint=s3.endpoint,
                              client_options={"allow_http": True})
        assert_clean(error_text(ei.value), "PermissionError")
        with pytest.raises(Exception) as ei:  # a misspelt option: its value stays hidden
            make_store(url, secret_acess_key=SECRET_KEY)
        assert_clean(error_text(ei.value), "bad option error")
    _check_logs(logs)


def test_signed_url_and_bearer_never_shown(archive, logs):
    query = f"X-Amz-Credential={ACCESS_KEY}&X-Amz-Signature={SIGNATURE}"
    client = {"default_headers": {"Authorization": f"Bearer {BEARER}"}}
    with FileServer(Path(archive).parent) as srv:
        url = f"{srv.url}/era5.zarr?{query}"
        ds = xinsitu.open_zarr(url, client_options=client, retry_config=FAST)
        assert srv.seen == ({query}, {f"Bearer {BEARER}"})  # every request carried the credentials
        m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
        gen = ds.insitu.batches(m, "val", batch_size=8, output="xarray")
        assert _epoch_until_error(gen) is None
        for where, text in everything_shown(ds, m, gen).items():
            assert_clean(text, where)
        for status in (503, 403, 500):  # obstore's messages quote the request URL, query and all
            srv.faults = Faults(always=r"/era5.zarr/u10/c/", always_status=status)
            gen = ds.insitu.batches(m, "train", batch_size=8, output="numpy")
            err = _epoch_until_error(gen)
            assert isinstance(err, xinsitu.ChunkReadError), repr(err)
            assert str(status) in str(err) and "u10" in str(err)
            assert_clean(error_text(err), f"ChunkReadError ({status})")
        srv.faults = Faults(always=r"zarr\.json$", always_status=403)
        with pytest.raises(PermissionError) as ei:
            xinsitu.open_zarr(url, client_options=client, retry_config=FAST)
        assert_clean(error_text(ei.value), "PermissionError at open")
        srv.faults = Faults()
        with pytest.raises(FileNotFoundError) as ei:
            xinsitu.open_zarr(f"{srv.url}/nothing.zarr?{query}", client_options=client, retry_config=FAST)
        assert "?" in str(ei.value) or "nothing.zarr" in str(ei.value)
        assert_clean(error_text(ei.value), "FileNotFoundError at open")
    _check_logs(logs)


def test_presigned_credentials_never_shown_encoded(archive, logs):
    """A presigned URL's session token (an STS one has ``/``, ``+`` and ``=``) and access key id are
    sent percent-encoded, and S3's signature errors quote them so (the canonical query string) and
    the key id alone (``<AWSAccessKeyId>``): neither form shows."""
    from urllib.parse import quote, quote_plus, urlencode

    token = f"IQoJb3JpZ2luX2Vj/{SESSION}+Tok=="
    query = urlencode({"X-Amz-Algorithm": "AWS4-HMAC-SHA256",
                       "X-Amz-Credential": f"{ACCESS_KEY}/20250101/us-east-1/s3/aws4_request",
                       "X-Amz-Security-Token": token, "X-Amz-Signature": SIGNATURE})
    forms = {f for s in (ACCESS_KEY, token, SIGNATURE) for f in (s, quote(s, safe=""), quote_plus(s))}
    with FileServer(Path(archive).parent) as srv:
        url = f"{srv.url}/era5.zarr?{query}"
        ds = xinsitu.open_zarr(url, retry_config=FAST)
        m = ds.insitu.split("time", fractions={"train": 1.0})
        srv.faults = Faults(always=r"/era5.zarr/u10/c/", always_status=403)
        err = _epoch_until_error(ds.insitu.batches(m, "train", batch_size=8, output="numpy"))
        assert isinstance(err, xinsitu.ChunkReadError), repr(err)
        assert "query: X-Amz-Algorithm=***&X-Amz-Credential=***" in str(err), str(err)  # quoted, scrubbed
        srv.faults = Faults(always=r"zarr\.json$", always_status=403)
        with pytest.raises(PermissionError) as ei:
            xinsitu.open_zarr(url, retry_config=FAST)
        for where, e in (("ChunkReadError", err), ("PermissionError at open", ei.value)):
            text = error_text(e)
            assert not [f for f in forms if f in text], f"{where} shows a credential: {text}"
    _check_logs(logs)


def test_credentials_from_the_provider_of_a_store_object_never_shown(archive, tmp_path, logs):
    """An obstore store built with a ``credential_provider`` and passed to ``open_zarr`` as a zarr
    ``ObjectStore`` (or as it is), or to ``xr.open_zarr``: what the provider answers is scrubbed, as
    for a URL. Each way has credentials of its own: those a provider answered earlier in the process
    would be scrubbed anyway."""
    import shutil
    import uuid

    import xarray as xr
    import zarr.storage
    from obstore.store import S3Store

    shutil.copytree(archive, tmp_path / "bucket" / "era5.zarr")
    with FileServer(tmp_path) as srv:
        for way in ("ObjectStore", "S3Store", "xr.open_zarr"):
            key, token = (f"{name}-{uuid.uuid4().hex}" for name in ("AKIAOWNSTORE", "own-token"))
            answer = {"access_key_id": key, "secret_access_key": "own-secret-0123", "token": token,
                      "expires_at": None}
            provider = answer.copy
            store = S3Store("bucket", prefix="era5.zarr", endpoint=srv.url, region="us-east-1",
                            client_options={"allow_http": True}, retry_config=FAST, credential_provider=provider)
            given = store if way == "S3Store" else zarr.storage.ObjectStore(store, read_only=True)
            shown = {}
            if way != "xr.open_zarr":  # first: nothing the provider answered is known before
                srv.faults = Faults(always=r"zarr\.json$", always_status=403)
                with pytest.raises(PermissionError) as ei:
                    xinsitu.open_zarr(given)
                assert "***" in str(ei.value), str(ei.value)
                shown["PermissionError at open"] = error_text(ei.value)
            srv.faults = Faults()
            # opened by xarray (dask-backed), xinsitu reads the chunks through that store
            ds = xr.open_zarr(given, chunks={}) if way == "xr.open_zarr" else xinsitu.open_zarr(given)
            m = ds.insitu.split("time", fractions={"train": 1.0})
            srv.faults = Faults(always=r"/era5.zarr/u10/c/", always_status=403)
            err = _epoch_until_error(ds.insitu.batches(m, "train", batch_size=8, output="numpy"))
            assert isinstance(err, xinsitu.ChunkReadError), repr(err)
            assert any(key in a for a in srv.seen[1]), "the requests were not signed with these credentials"
            assert "***" in str(err) and "u10" in str(err), str(err)  # the quoted headers were there, scrubbed
            shown["ChunkReadError"] = error_text(err)
            for where, text in shown.items():
                assert key not in text and token not in text, f"{where} ({way}) shows a credential"
            assert store.credential_provider is provider  # the store given is left as it was
    _check_logs(logs)


class _Trap:
    """Unpickling this touches a file: proof that something ran code from a pickle."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_manifest_and_state_are_json_never_pickle(archive, tmp_path):
    ds = xinsitu.open_zarr(archive)
    m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
    p = tmp_path / "split.json"
    m.to_json(p)
    assert json.loads(p.read_text())["splits"] == m.to_dict()["splits"]  # plain JSON on disk
    assert xinsitu.SplitManifest.from_json(p).to_json() == m.to_json()
    gen = ds.insitu.batches(m, "train", batch_size=8, output="numpy")
    it = iter(gen)
    next(it)
    state = json.loads(json.dumps(gen.state_dict()))  # JSON round trip loses nothing
    it.close()
    gen2 = ds.insitu.batches(m, "train", batch_size=8, output="numpy")
    gen2.load_state_dict(state)
    assert gen2.state_dict() == state

    sentinel = tmp_path / "pwned"
    for proto in (0, pickle.HIGHEST_PROTOCOL):
        evil = tmp_path / f"evil{proto}.json"
        evil.write_bytes(pickle.dumps(_Trap(str(sentinel)), protocol=proto))
        with pytest.raises((ValueError, UnicodeDecodeError)):
            xinsitu.SplitManifest.from_json(evil)
        with pytest.raises((ValueError, TypeError)):
            gen2.load_state_dict(evil.read_bytes())  # type: ignore[arg-type]
    assert not sentinel.exists()


@pytest.mark.parametrize("source", ["environment", "credential_provider"])
def test_credentials_from_environment_or_provider_never_shown(archive, tmp_path, monkeypatch, logs, source):
    """AWS echoes the key id in signature errors; here the server quotes the ``Authorization`` and
    session-token headers in its 403 answers. Credentials obstore took from ``AWS_*`` environment
    variables or from a ``credential_provider`` are scrubbed like those passed as options."""
    import shutil

    shutil.copytree(archive, tmp_path / "bucket" / "era5.zarr")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    extra: dict[str, Any] = {}
    if source == "environment":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION)
    else:
        extra["credential_provider"] = lambda: {"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY,
                                                "token": SESSION, "expires_at": None}
    with FileServer(tmp_path) as srv:
        opts = {"endpoint": srv.url, "region": "us-east-1", "client_options": {"allow_http": True},
                "retry_config": FAST, **extra}
        ds = xinsitu.open_zarr("s3://bucket/era5.zarr", **opts)
        m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
        srv.faults = Faults(always=r"/era5.zarr/u10/c/", always_status=403)
        err = _epoch_until_error(ds.insitu.batches(m, "train", batch_size=8, output="numpy"))
        assert isinstance(err, xinsitu.ChunkReadError), repr(err)
        assert any(ACCESS_KEY in a for a in srv.seen[1]), "the requests were not signed with these credentials"
        assert "***" in str(err) and "u10" in str(err), str(err)  # the quoted headers were there, scrubbed
        assert_clean(error_text(err), f"ChunkReadError ({source})")
        srv.faults = Faults(always=r"zarr\.json$", always_status=403)
        with pytest.raises(PermissionError) as ei:
            xinsitu.open_zarr("s3://bucket/era5.zarr", **opts)
        assert "***" in str(ei.value)
        assert_clean(error_text(ei.value), f"PermissionError at open ({source})")
    _check_logs(logs)
