"""The metadata reads of an open, bounded, retried and checked: each ``get``/``exists`` of a zarr
store given ``XINSITU_REQUEST_TIMEOUT`` seconds a try, ``FETCH_ATTEMPTS`` tries (``bounded_request``,
``bounded_store``); a transient fault of a store that does not retry itself (fsspec's) made again
with backoff (``retried``); and a metadata object that is not valid JSON (damaged in transit) fetched
again. The store kinds keep their names and what they are (a ``zarr.storage.ObjectStore``, a
``zarr.storage.FsspecStore``): the reader picks its way of reading by them.
"""

from __future__ import annotations

import asyncio
import copy
import errno
import html.parser
import json
import random
import re
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from xinsitu.io import loop as _loop
from xinsitu.stores.redact import client_timed_out, recording_store, redact, redact_url

T = TypeVar("T")


#: fetches of one object before a damaged body (short, undecodable, not JSON) is an error
FETCH_ATTEMPTS = 3
#: what "no answer" covers: the store's client retries 5xx answers and dropped connections on its own
#: (``DEFAULT_RETRY_CONFIG``), so a server that keeps answering 503 reads, from here, as one that is silent
NO_ANSWER_WHY = "or only answers its client retries, such as 5xx or dropped connections"
#: metadata objects: JSON, checked as read (a damaged body is fetched again, then named)
_METADATA = ("zarr.json", ".zmetadata", ".zarray", ".zattrs", ".zgroup")
#: transient faults of stores that do not retry them themselves (fsspec's, zarr's own): retries at
#: most, and the backoff before each, doubling from the first to the most (with jitter) -- as
#: obstore retries by xinsitu's defaults (``xinsitu.stores.opening.DEFAULT_RETRY_CONFIG``)
RETRIES = 10
BACKOFF_S = (0.1, 10.0)
#: HTTP answers that are faults of the moment (besides every 5xx): a new try may get the object
_TRANSIENT_STATUS = frozenset({408, 425, 429})
#: ``OSError`` numbers of faults of the moment (s3fs raises ``EIO`` for a server error it does not map)
_TRANSIENT_ERRNO = frozenset({errno.EIO, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED,
                              errno.EPIPE, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EAGAIN})
#: exception types of the HTTP clients under fsspec (aiohttp, botocore) for a dropped or refused
#: connection, a body cut short or a timeout of their own
_TRANSIENT_TYPES = frozenset({
    "ClientPayloadError", "ClientConnectionError", "ServerDisconnectedError", "ClientOSError", "ServerTimeoutError",
    "ConnectionTimeoutError", "SocketTimeoutError", "ContentLengthError", "TransferEncodingError",
    "EndpointConnectionError", "ReadTimeoutError", "ConnectTimeoutError", "IncompleteReadError",
    "ResponseStreamingError", "ConnectionClosedError"})
_ANSWERS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


def transient(e: BaseException) -> bool:
    """Whether ``e`` is a fault a new try may not meet: a 5xx answer (or 408, 425, 429), a connection
    refused, reset or dropped, a body cut short, a client's own timeout. Any other answer (a missing
    object, a refused permission, another 4xx) is not: trying again gets it again."""
    if isinstance(e, _ANSWERS):
        return False
    status = getattr(e, "status", None)  # aiohttp's ClientResponseError (fsspec's HTTP)
    if isinstance(status, int) and not isinstance(status, bool):
        return status >= 500 or status in _TRANSIENT_STATUS
    names = {c.__name__ for c in type(e).__mro__}
    if any("SSL" in n or "Certificate" in n for n in names):
        return False
    if names & _TRANSIENT_TYPES or isinstance(e, (TimeoutError, ConnectionError)):
        return True
    return isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNO


def backoff_s(retry: int) -> float:
    """Seconds to wait before retry ``retry`` (0 first): doubling within ``BACKOFF_S``, jittered."""
    return random.uniform(0.5, 1.0) * min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** min(retry, 32))


async def retried(fetch: Callable[[], Awaitable[T]]) -> T:
    """``await fetch()``, made again after a transient fault (``transient``), ``RETRIES`` times at most,
    with backoff (``backoff_s``): what obstore does for its stores, for a store that does not retry
    (fsspec's). Anything else, and the last fault, is raised as it is."""
    for i in range(RETRIES + 1):
        try:
            return await fetch()
        except Exception as e:  # noqa: BLE001 - sorted here, re-raised as it is
            if i == RETRIES or not transient(e):
                raise
        await asyncio.sleep(backoff_s(i))
    raise AssertionError("unreachable")  # pragma: no cover


async def bounded_request(fetch: Callable[[], Awaitable[T]], what: str) -> T:
    """``await fetch()``, each try given ``XINSITU_REQUEST_TIMEOUT`` seconds (``_loop.request_timeout``),
    ``FETCH_ATTEMPTS`` tries: the bound of chunk reads (``xinsitu.stores.backend.bounded``) on the metadata
    reads of an open (a server that accepts and never answers). Then ``TimeoutError`` naming ``what``.
    A ``TimeoutError`` of the store's own is raised as it is; so is, as a ``TimeoutError`` naming
    ``what``, obstore's error for a request its client gave up waiting for (after its own retries)."""
    limit = _loop.request_timeout()
    for _ in range(FETCH_ATTEMPTS):
        cm = asyncio.timeout(limit)
        err: BaseException | None = None
        try:
            async with cm:  # counted as a call into obstore's runtime: an exit waits for it (``native``)
                return await _loop.native(fetch())
        except TimeoutError:
            if not cm.expired():
                raise
        except Exception as e:  # noqa: BLE001 - obstore's timeouts named below, the rest as they are
            if not client_timed_out(e):
                raise
            said = redact(str(e).split("\n\nDebug source:", 1)[0].strip())
            err = TimeoutError(f"{what}: no answer: the store's client gave up waiting, after its own retries "
                               f"({type(e).__name__}: {said})")
        if err is not None:  # raised outside the handler: obstore's original stays off the traceback
            raise err
    raise TimeoutError(f"{what}: no answer within {limit:g} s, {FETCH_ATTEMPTS} times ({NO_ANSWER_WHY}; set "
                       "XINSITU_REQUEST_TIMEOUT to a number of seconds to wait longer, or fewer)")


async def _bounded_listing(listing: AsyncIterator[str], what: str) -> AsyncIterator[str]:
    """``listing``'s keys, each given ``XINSITU_REQUEST_TIMEOUT`` seconds to come (once: a listing cut off
    cannot be taken up again), then ``TimeoutError`` naming ``what``."""
    limit = _loop.request_timeout()
    it = aiter(listing)
    while True:
        cm = asyncio.timeout(limit)
        try:
            async with cm:
                key = await anext(it)
        except StopAsyncIteration:
            return
        except TimeoutError:
            if not cm.expired():
                raise
            raise TimeoutError(f"{what}: no answer within {limit:g} s (set XINSITU_REQUEST_TIMEOUT to a number of "
                               "seconds to wait longer, or fewer)") from None
        yield key


class DamagedObjectError(OSError):
    """The bytes of a stored object came back short, or failed to decode, every time."""


class NoListingError(ValueError):
    """A plain HTTP server that lists no directory: the arrays of a group without consolidated
    metadata cannot be found."""


class _Links(html.parser.HTMLParser):
    """The ``href`` of every link of an HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs.extend(v for k, v in attrs if k == "href" and v)


def index_entries(page: bytes, base: str) -> list[str] | None:
    """The folders a directory's index page (``base``, ending in ``/``) links to, by name, in order:
    links to ``base`` + one path segment + ``/`` (what ``python -m http.server``, nginx's autoindex and
    Apache list, and what fsspec reads a directory from). None where the page links to nothing in
    ``base`` at all (not an index page)."""
    parser = _Links()
    parser.feed(page.decode("utf-8", "replace"))
    base_path = urllib.parse.urlsplit(base)
    names: dict[str, None] = {}
    linked = False
    for href in parser.hrefs:
        u = urllib.parse.urlsplit(urllib.parse.urljoin(base, href))
        if (u.scheme, u.netloc) != (base_path.scheme, base_path.netloc) or not u.path.startswith(base_path.path):
            continue
        rest = u.path[len(base_path.path):]
        linked = linked or bool(rest)
        name = urllib.parse.unquote(rest[:-1]) if rest.endswith("/") else ""
        if name and "/" not in name and name not in (".", ".."):
            names[name] = None
    return list(names) if linked or names else None


async def _http_listing(zstore: Any, prefix: str) -> AsyncIterator[str]:
    """The names of the folders under ``prefix`` of a plain HTTP store (an obstore ``HTTPStore``), where
    zarr asks for a group's members: from the server's index page of that directory (one ``GET``),
    else from one ``PROPFIND`` (WebDAV) without retries; else ``NoListingError`` at once (a ``404`` or
    a ``501`` is the server's answer, not a fault: obstore would retry a ``PROPFIND`` answered 501
    ten times)."""
    import obstore
    import obstore.store

    obs = zstore.store
    root = str(obs.url).rstrip("/") + "/"
    sub = prefix.strip("/")
    base = root + (urllib.parse.quote(sub) + "/" if sub else "")
    page_said = dav_said = ""
    try:
        directory = obstore.store.HTTPStore.from_url(base, client_options=obs.client_options,
                                                     retry_config=obs.retry_config)
        page = bytes(await (await obstore.get_async(directory, "")).bytes_async())
        names = index_entries(page, base)
        if names is not None:
            for name in names:
                yield name
            return
        page_said = "a page that links to nothing in it"
    except (FileNotFoundError, PermissionError) as e:
        page_said = _answer(e)
    except Exception as e:  # noqa: BLE001 - any other answer: try WebDAV, then say both
        if not type(e).__module__.startswith("obstore"):
            raise
        page_said = _answer(e)
    try:
        dav = obstore.store.HTTPStore.from_url(root, client_options=obs.client_options,
                                               retry_config={"max_retries": 0})
        listed = await obstore.list_with_delimiter_async(dav, sub or None)
        for p in listed["common_prefixes"]:
            yield str(p).rstrip("/").rsplit("/", 1)[-1]
        return
    except Exception as e:  # noqa: BLE001 - the server's answer, named below
        if not type(e).__module__.startswith("obstore") and not isinstance(e, OSError):
            raise
        dav_said = _answer(e)
    where = redact_url(base)
    raise NoListingError(
        f"{redact_url(root.rstrip('/'))}: no consolidated metadata, and the server lists no directory (GET {where}: "
        f"{page_said}; PROPFIND: {dav_said}), so the arrays of the group cannot be found over plain HTTP "
        "(xr.open_zarr(url) finds them the same way, from the server's directory pages: it would open no "
        "variable). Consolidate the metadata where the archive is written (zarr.consolidate_metadata(path), or "
        "ds.to_zarr(..., consolidated=True)), serve its directory listing, or open it from the object store "
        "behind the server (s3://, gs://...)")


def _answer(e: BaseException) -> str:
    """A server's answer as an error of obstore's says it: its status line, without the page."""
    text = str(e)
    m = re.search(r"status code: (\d{3}[^:\n]*)", text)
    if m:
        return m.group(1).strip()
    return redact(text.split("\n", 1)[0])[:200]


def _under_a_file(e: BaseException) -> bool:
    """Whether ``e`` says a key's path runs through a plain file (``ENOTDIR``; obstore's ``LocalStore`` says it
    in a ``GenericError`` where zarr's ``LocalStore`` finds nothing)."""
    return isinstance(e, NotADirectoryError) or f"(os error {errno.ENOTDIR})" in str(e)


def fork_stand_in(zstore: Any) -> Any:
    """What reads ``zstore`` (a zarr ``ObjectStore``) in a process forked from one that used obstore, whose runtime
    hangs there: zarr's ``LocalStore`` of the same directory for a local store (plain file I/O, safe after fork:
    the fork policy of ``xinsitu.io.loop``), made once; ``ForkError`` for any other obstore store; None where
    the store needs none (no fork, or not obstore's)."""
    obs: Any = getattr(zstore, "store", None)
    if not _loop.forked_after("obstore") or not type(obs).__module__.startswith("obstore"):
        return None
    if type(obs).__name__ != "LocalStore" or getattr(obs, "prefix", None) is None:
        _loop.refuse_after_fork(f"the store {store_name(zstore)}")
    stand_in = getattr(zstore, "_xinsitu_fork_local", None)
    if stand_in is None:
        import zarr.storage

        stand_in = zarr.storage.LocalStore(str(obs.prefix), read_only=True)
        zstore._xinsitu_fork_local = stand_in
    return stand_in


def _checked_get(cls: type, retries: bool) -> Any:
    """``cls`` (a zarr store class) with each ``get``, ``exists`` and listing bounded in time, a metadata
    body that is not valid JSON (damaged in transit) fetched again, ``FETCH_ATTEMPTS`` times, then
    raised naming its key; with ``retries``, transient faults retried (``retried``: a store that does
    not retry itself). Same name as ``cls``: code that checks the kind keeps working."""

    class Checked(cls):  # type: ignore[misc, valid-type]
        _xinsitu_bounded = True  # each request bounded here (and retried where the store does not)

        def _own(self, name: str) -> Any:
            """This store's method ``name``, or its stand-in's in a forked child (``fork_stand_in``)."""
            stand_in = fork_stand_in(self)
            return getattr(super(), name) if stand_in is None else getattr(stand_in, name)

        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            def fetch() -> Any:
                one = self._own("get")
                return retried(lambda: one(key, prototype, byte_range)) if retries else one(key, prototype, byte_range)

            what = f"object {key!r} of {store_name(self)}"
            if byte_range is not None or not key.endswith(_METADATA):
                return await bounded_request(fetch, what)
            err: Exception | None = None
            for _ in range(FETCH_ATTEMPTS):
                try:
                    buf = await bounded_request(fetch, "metadata " + what)
                except Exception as e:
                    if not _under_a_file(e):
                        raise
                    return None  # as zarr's LocalStore: a plain file at a group's level (a README) holds no node
                if buf is None:
                    return None
                try:
                    json.loads(buf.to_bytes())
                    return buf
                except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                    err = e
            raise ValueError(f"metadata object {key!r} is not valid JSON, {FETCH_ATTEMPTS} fetches in a row "
                             f"(damaged in the store?): {type(err).__name__}: {err}")

        async def exists(self, key: str) -> bool:
            def fetch() -> Any:
                one = self._own("exists")
                return retried(lambda: one(key)) if retries else one(key)

            return await bounded_request(fetch, f"object {key!r} of {store_name(self)}")

        async def get_partial_values(self, prototype: Any, key_ranges: Any) -> Any:
            key_ranges = list(key_ranges)

            def fetch() -> Any:
                one = self._own("get_partial_values")
                return retried(lambda: one(prototype, key_ranges)) if retries else one(prototype, key_ranges)

            keys = sorted({k for k, _ in key_ranges})
            return await bounded_request(fetch, f"objects {keys[:3]}{'...' if len(keys) > 3 else ''} of "
                                                f"{store_name(self)}")

        async def getsize(self, key: str) -> int:
            return await bounded_request(lambda: self._own("getsize")(key), f"the size of {key!r} of "
                                                                             f"{store_name(self)}")

        async def getsize_prefix(self, prefix: str) -> int:  # (zarr's: a listing, then each object's size)
            return await self._own("getsize_prefix")(prefix)

        def list(self) -> AsyncIterator[str]:
            return _bounded_listing(self._own("list")(), f"the listing of {store_name(self)}")

        def list_prefix(self, prefix: str) -> AsyncIterator[str]:
            listing = self._own("list_prefix")(prefix)
            return _bounded_listing(listing, f"the listing of {prefix!r} of {store_name(self)}")

        def list_dir(self, prefix: str) -> AsyncIterator[str]:
            inner = getattr(self, "store", None)
            if type(inner).__name__ == "HTTPStore" and type(inner).__module__.startswith("obstore"):
                listing = _http_listing(self, prefix)  # plain HTTP: index pages, not PROPFIND
            else:
                listing = self._own("list_dir")(prefix)
            return _bounded_listing(listing, f"the listing of {prefix!r} of {store_name(self)}")

    Checked.__name__ = cls.__name__
    return Checked


_checked: Any = None
_fsspec: Any = None


def _checked_store() -> Any:
    """``zarr.storage.ObjectStore`` whose requests are bounded and whose metadata reads are checked
    (``_checked_get``; obstore retries transient faults itself)."""
    global _checked
    if _checked is None:
        import zarr.storage

        cls = _checked_get(zarr.storage.ObjectStore, retries=False)
        cls.__module__, cls.__qualname__ = __name__, "_CheckedObjectStore"
        _checked = cls
    return _checked


def _checked_fsspec() -> Any:
    """``zarr.storage.FsspecStore`` whose requests are bounded and retried and whose metadata reads are
    checked (``_checked_get``)."""
    global _fsspec
    if _fsspec is None:
        import zarr.storage

        cls = _checked_get(zarr.storage.FsspecStore, retries=True)
        cls.__module__, cls.__qualname__ = __name__, "_CheckedFsspecStore"
        _fsspec = cls
    return _fsspec


#: obstore's stores without a URL: (scheme, the config key of their bucket or container)
_BUCKETS = {"S3Store": ("s3", "bucket"), "GCSStore": ("gs", "bucket"), "AzureStore": ("az", "container_name")}


def store_name(zstore: Any) -> str:
    """A zarr store (or an obstore store) as messages name it: its URL without credentials, else its type."""
    obs = getattr(zstore, "store", zstore)  # zarr's ObjectStore: the obstore store it reads
    url = getattr(obs, "url", None)
    if url:
        return redact_url(str(url))
    where = _BUCKETS.get(type(obs).__name__)
    config = getattr(obs, "config", None)
    if where is not None and isinstance(config, dict) and config.get(where[1]):  # obstore's S3, GCS, Azure
        prefix = str(getattr(obs, "prefix", None) or "").strip("/")
        endpoint = config.get("endpoint")
        return (f"{where[0]}://{config[where[1]]}" + (f"/{prefix}" if prefix else "")
                + (f" (endpoint {redact_url(str(endpoint))})" if endpoint else ""))
    if obs is not zstore:
        return type(obs).__name__
    fs, path = getattr(zstore, "fs", None), getattr(zstore, "path", None)
    if fs is not None and isinstance(path, str):  # fsspec's: its protocol and path
        proto = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        return redact_url(path if "://" in path else f"{proto}://{path.lstrip('/')}")
    return type(zstore).__name__


def bounded_store(zstore: Any, others: bool = True) -> Any:
    """``zstore`` with each request bounded as ``bounded_request`` bounds it, of the same kind: an
    obstore store or a ``zarr.storage.ObjectStore`` as the checked ``ObjectStore`` of ``open_zarr``
    (read-only; one with a ``credential_provider`` rebuilt with it recorded: ``recording_store``), a
    ``zarr.storage.FsspecStore`` as a checked one that also retries transient faults
    (a copy: the caller's is left as it is). A store bounded already is returned as it is; so is
    one of another kind where ``others`` is False (else it is wrapped, a ``WrapperStore``)."""
    if getattr(zstore, "_xinsitu_bounded", False):
        return zstore
    import zarr.storage

    # an obstore store's credential_provider is recorded (``recording_store``): what it answers is scrubbed
    if type(zstore).__module__.startswith("obstore"):
        return _checked_store()(recording_store(zstore), read_only=True)
    if isinstance(zstore, zarr.storage.ObjectStore):
        return _checked_store()(recording_store(zstore.store), read_only=True)
    if isinstance(zstore, zarr.storage.FsspecStore):
        out = copy.copy(zstore)
        out.__class__ = _checked_fsspec()
        return out
    if not others:
        return zstore

    class BoundedStore(zarr.storage.WrapperStore):
        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            return await bounded_request(lambda: self._store.get(key, prototype, byte_range),
                                         f"object {key!r} of {store_name(self._store)}")

        async def exists(self, key: str) -> bool:
            return await bounded_request(lambda: self._store.exists(key),
                                         f"object {key!r} of {store_name(self._store)}")

    return BoundedStore(zstore)



def __getattr__(name: str) -> Any:  # pickles name the checked store classes by these attributes
    if name == "_CheckedObjectStore":
        return _checked_store()
    if name == "_CheckedFsspecStore":
        return _checked_fsspec()
    raise AttributeError(name)
