"""The versions of a store's objects, which key the disk tier's entries (``xinsitu.cache.keys.ChunkKey``):
a strong ETag (or a generation) and the size, asked of obstore by listing the array's prefix or one ``HEAD``
per object (``object_versions``), of fsspec by ``info`` (``fsspec_versions``); ``trusted`` says whether one
names the object's bytes, ``why_not`` why not (no ETag, a Last-Modified of whole seconds, a refused ``HEAD``,
no answer in time). Every request is bounded by ``XINSITU_REQUEST_TIMEOUT``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from xinsitu.io import loop as _loop
from xinsitu.stores.memo import ByIdentity

#: the version of an object the store does not have (its chunk reads as the fill value). Such a chunk is not
#: kept on disk: a store may say "not found" of an object it has (obstore takes a HEAD answered 405 for a 404)
MISSING = "missing"
#: how a version that may key a disk entry starts: a strong ETag (or a generation), then the size
_TRUSTED = "etag "
#: how a version that is none starts; the rest says why (no ETag, a refused HEAD ...)
_UNTRUSTED = "untrusted: "
#: how the version of an object whose store did not answer in time starts (the rest says so)
UNKNOWN = "unknown: "
#: why a version is none where the store refuses ``HEAD`` (405, 501 ...): its other objects are not asked
_HEAD_REFUSED = "its HEAD requests are refused"
#: ``HEAD`` requests in flight at once when versions are asked one object at a time
HEAD_CONCURRENCY = 16


def trusted(version: str | None) -> bool:
    """Whether ``version`` (from ``object_versions``/``fsspec_versions``) names the object's bytes: a
    strong ETag and the size. A modification time does not (``cp -p``, ``rsync -t`` and ``tar x`` set
    it back; HTTP gives it in whole seconds), nor an ETag made of one (nginx's: ``_of_seconds_and_size``),
    nor does a missing object (its store may be wrong)."""
    return version is not None and version.startswith(_TRUSTED)


def why_not(version: str | None) -> tuple[str, str] | None:
    """Why ``version`` cannot key a disk entry, where that is known: ``("untrusted", why)`` for a store
    that gives no trustworthy version, ``("unknown", why)`` for one that did not answer in time; None
    for a trusted version, a missing object or an error that may pass."""
    for kind in (_UNTRUSTED, UNKNOWN):
        if version is not None and version.startswith(kind):
            return kind[:-2], version[len(kind):]
    return None


#: ETags that name an object's bytes whoever serves them: a content hash (MD5, SHA-1, SHA-256 in hex, an S3
#: multipart ``<md5>-<parts>``; base64 of 16 or more bytes) or Azure's change counter (``0x8D...``)
_CONTENT_TAG = re.compile(r"[0-9a-f]{32,128}(-\d+)?|[a-z0-9+/]{22,}={0,2}|0x[0-9a-f]{15,16}")


def _of_content(tag: str) -> bool:
    """Whether the strong ETag ``tag`` looks like one that names the bytes (``_CONTENT_TAG``)."""
    return _CONTENT_TAG.fullmatch(tag.strip('"').lower()) is not None


def _version(tag: Any, size: Any, modified: Any, web: bool = False) -> str:
    """An object's version from its ETag (or generation), size and modification time (None where the
    store gave none): ``etag <tag> <size>`` for a strong ETag, else ``untrusted: <why>``.

    ``web``: the store is a web server (``HTTPStore``, fsspec's HTTP), whose strong ETag is, as often as
    not, its file's modification time and size (Apache's ``"<size>-<µs>"``, Caddy's, lighttpd's, IIS's,
    nginx's): a rewrite that keeps both (``cp -p``, ``rsync -a``, ``tar x``) keeps it. Its ETag is
    trusted only where it looks like a content hash (``_CONTENT_TAG``); object stores manage theirs."""
    tag = "" if tag is None else str(tag).strip()
    if tag and not tag.startswith(("W/", "w/")):
        if _of_seconds_and_size(tag, size, modified):
            return (f"{_UNTRUSTED}an ETag made of the modification time in whole seconds and the size ({tag}, "
                    "nginx's), which a rewrite within the second keeps and cp -p, rsync -t or tar x set back")
        if web and not tag.startswith("generation ") and not _of_content(tag):
            return (f"{_UNTRUSTED}a web server's ETag that is not a content hash ({tag}): web servers (Apache, "
                    "Caddy, lighttpd, IIS) make theirs of the file's modification time and size, which a "
                    "rewrite that keeps both (cp -p, rsync -a, tar x) keeps")
        return f"{_TRUSTED}{tag} {size}"
    if tag:
        return f"{_UNTRUSTED}a weak ETag ({tag}), which does not name the bytes"
    if modified is None:
        return f"{_UNTRUSTED}neither ETag nor Last-Modified"
    seconds = getattr(modified, "microsecond", None) == 0 or isinstance(modified, str)
    return (_UNTRUSTED + "no ETag, only a Last-Modified" + (" of whole seconds, which a rewrite within the second"
                                                             if seconds else ", which a rewrite")
            + " keeps and cp -p, rsync -t or tar x set back")


#: nginx's ETag: the modification time in whole seconds and the size, in hex
_SECONDS_SIZE_TAG = re.compile(r'"?([0-9a-f]{1,16})-([0-9a-f]{1,16})"?')
#: the whole seconds a ``_SECONDS_SIZE_TAG`` is taken to hold where the store gives no modification time:
#: 1995 to 2106 (an ETag with nanoseconds, or a hash, is beyond)
_PLAUSIBLE_SECONDS = (0x2F000000, 0xFFFFFFFF)


def _seconds(modified: Any) -> int | None:
    """A modification time (a ``datetime``, an HTTP date, a POSIX timestamp) in whole seconds, or None."""
    try:
        if isinstance(modified, str):
            import email.utils

            modified = email.utils.parsedate_to_datetime(modified)
        if hasattr(modified, "timestamp"):
            return int(modified.timestamp())
        if isinstance(modified, (int, float)):
            return int(modified)
    except (TypeError, ValueError, OverflowError):
        pass
    return None


def _of_seconds_and_size(tag: str, size: Any, modified: Any) -> bool:
    """Whether the strong ETag ``tag`` is only the modification time in whole seconds and the size (nginx's
    default, ``"<seconds hex>-<size hex>"``): the modification time where the store gave it must match,
    else the seconds must be plausible (``_PLAUSIBLE_SECONDS``)."""
    m = _SECONDS_SIZE_TAG.fullmatch(tag.lower())
    if m is None or size is None:
        return False
    try:
        if int(m.group(2), 16) != int(size):
            return False
    except (TypeError, ValueError):
        return False
    seconds = int(m.group(1), 16)
    at = _seconds(modified)
    return seconds == at if at is not None else _PLAUSIBLE_SECONDS[0] <= seconds <= _PLAUSIBLE_SECONDS[1]


def _names_bytes(tag: str, data: bytes) -> bool:
    """Whether the ETag ``tag`` is a hash of ``data`` (MD5, SHA-1 or SHA-256, in hex or base64)."""
    import base64
    import binascii
    import hashlib

    t = tag.strip().strip('"')
    digest: bytes | None = None
    if re.fullmatch(r"[0-9a-fA-F]{32}|[0-9a-fA-F]{40}|[0-9a-fA-F]{64}", t):
        digest = bytes.fromhex(t)
    else:
        try:
            digest = base64.b64decode(t, validate=True)
        except (binascii.Error, ValueError):
            return False
    algo = {16: hashlib.md5, 20: hashlib.sha1, 32: hashlib.sha256}.get(len(digest))
    return algo is not None and algo(data).digest() == digest


#: what one object's bytes said of a web server's ETags (``_sampled``), by server: (the store, None where they are
#: hashes of the bytes, else why they are not trusted)
_SAMPLED: ByIdentity[tuple[str | None]] = ByIdentity(64)


async def _sampled(server: Any, host: str, keys: list[str], got: list[str | None], fetch: Callable[[str], Any],
                   limit: float) -> tuple[list[str | None], int]:
    """A web server's versions, checked on one object: its ETag must be a hash of its bytes (``GET``),
    else none of its ETags is trusted; (versions, requests made). A server may make an ETag that looks like
    a hash of the file's time and size (Starlette's ``StaticFiles``: the MD5 of ``"<mtime>-<size>"``), which
    a rewrite that keeps both keeps too; a server makes all its ETags one way, so one object per server
    (``server``, a store or filesystem, and ``host``, which a filesystem serves many of) and process tells."""
    first = next((i for i, v in enumerate(got) if trusted(v)), None)
    if first is None:
        return got, 0
    seen = _SAMPLED.get(server, host)
    if seen is not None:
        why = seen[0]
        return ([why if trusted(v) else v for v in got] if why else got), 0
    tag = str(got[first])[len(_TRUSTED):].rsplit(" ", 1)[0]
    try:
        async with asyncio.timeout(limit):
            data = await fetch(keys[first])
    except Exception:  # noqa: BLE001 - no answer in time, or an error: not known now, the chunk read says more
        return [no_answer(limit) if trusted(v) else v for v in got], 1
    why = None
    if data is None or not _names_bytes(tag, bytes(data)):
        why = (f"{_UNTRUSTED}a web server's ETag that is not a hash of the bytes ({tag}, checked on {keys[first]!r}): "
               "it may be made of the file's modification time and size, which a rewrite that keeps both (cp -p, "
               "rsync -a, tar x) keeps")
    _SAMPLED.put(server, host, (why,))
    return ([why if trusted(v) else v for v in got] if why else got), 1


def _version_of(meta: Any, web: bool = False) -> str:
    """An object's version from obstore's ``ObjectMeta`` (``_version``; ``web``: an ``HTTPStore``'s): obstore
    gives a ``last_modified`` of 1970-01-01 where the server sent none."""
    modified = meta.get("last_modified")
    if modified is not None and modified.timestamp() == 0:
        modified = None
    return _version(meta.get("e_tag"), meta.get("size"), modified, web)


def _refused(e: BaseException) -> str | None:
    """Why a ``HEAD`` that failed with ``e`` is a refusal (a 4xx other than 404 and 410, or an operation
    the store does not support), or None (the object is missing, or the failure may pass)."""
    text = str(e)
    m = re.search(r"status(?: code)?:? (\d{3})\b([ A-Za-z-]*)", text)
    status = int(m.group(1)) if m else None
    if status is not None and (400 <= status < 500 and status not in (404, 410) or status == 501):
        return f"{_HEAD_REFUSED} ({status}{m.group(2).rstrip() if m else ''})"
    if type(e).__name__ == "NotSupportedError":
        return "it does not answer HEAD requests"
    return None


def _run_bounded(coro: Any) -> Any:
    """``asyncio.run(coro)`` here, or in a thread of its own where this thread runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def no_answer(limit: float) -> str:
    """The version of an object whose store did not answer in time (``why_not``: unknown)."""
    return f"{UNKNOWN}no answer within {limit:g} s (XINSITU_REQUEST_TIMEOUT sets the limit)"


async def _ask_each(keys: list[str], one: Callable[[str], Any], limit: float) -> list[str | None]:
    """``await one(k)`` for each key, ``HEAD_CONCURRENCY`` at a time, each given ``limit`` seconds. Once
    one of them gets no answer in time, the store is taken as silent and the keys not asked yet are
    not: a silent server costs one bound, not one per key. Such keys get ``no_answer``. Likewise once
    one is refused (a server that does not do ``HEAD``): the rest get the same answer unasked."""
    sem = asyncio.Semaphore(HEAD_CONCURRENCY)
    silent = False
    refused: str | None = None

    async def each(k: str) -> str | None:
        nonlocal silent, refused
        async with sem:
            if silent:
                return no_answer(limit)
            if refused is not None:
                return refused
            try:
                async with asyncio.timeout(limit):
                    got = await one(k)
                if got is not None and got.startswith(_UNTRUSTED + _HEAD_REFUSED):
                    refused = got
                return got  # type: ignore[no-any-return]
            except TimeoutError:
                silent = True
                return no_answer(limit)

    return list(await asyncio.gather(*(each(k) for k in keys)))


def object_versions(store: Any, object_keys: list[str] | None = None, *,
                    prefix: str | None = None) -> tuple[dict[str, str], int]:
    """The current versions of objects of an obstore store: ``({object key: version}, requests
    made)``. A version is ``etag <ETag> <size>`` where the store gives a strong ETag (``trusted``),
    else it says why it is none (``why_not``).

    Each request is given ``XINSITU_REQUEST_TIMEOUT`` seconds (``_loop.request_timeout``), one try:
    obstore's own retries of a silent store would take minutes.

    Parameters
    ----------
    store
        An obstore store (``S3Store``, ``HTTPStore`` ...).
    object_keys
        Objects to ask one ``HEAD`` each (``HEAD_CONCURRENCY`` at once); one the store lacks is
        ``MISSING``, one whose ``HEAD`` is refused (405 ...) untrusted, one that got no answer in time
        unknown (``why_not``), one it could not tell about (an error) is left out.
    prefix
        Instead: list every object under ``prefix`` (one request per 1000 objects); raises where the
        store cannot list (``TimeoutError`` where a page got no answer in time).
    """
    import obstore

    limit = _loop.request_timeout()
    web = type(store).__name__ == "HTTPStore"
    if prefix is not None:
        async def listing() -> dict[str, str]:
            out: dict[str, str] = {}
            pages = obstore.list(store, prefix=prefix or None, chunk_size=1000)
            while True:
                try:
                    async with asyncio.timeout(limit):
                        batch = await pages.__anext__()
                except StopAsyncIteration:
                    return out
                for meta in batch:
                    out[meta["path"]] = _version_of(meta, web)

        listed = _run_bounded(listing())
        return listed, max(1, -(-len(listed) // 1000))
    keys = list(dict.fromkeys(object_keys or ()))

    async def one(k: str) -> str | None:
        try:
            return _version_of(await obstore.head_async(store, k), web)
        except FileNotFoundError as e:
            why = _refused(e)
            return MISSING if why is None else _UNTRUSTED + why
        except Exception as e:  # noqa: BLE001 - not known: the chunk is not kept on disk (and its read reports the error)
            why = _refused(e)
            return None if why is None else _UNTRUSTED + why

    async def fetch(k: str) -> bytes:
        return bytes(await (await obstore.get_async(store, k)).bytes_async())

    async def work() -> tuple[list[str | None], int]:
        got = await _ask_each(keys, one, limit)
        return await _sampled(store, str(getattr(store, "url", "")), keys, got, fetch, limit) if web else (got, 0)

    got, sampled = _run_bounded(work())
    return {k: v for k, v in zip(keys, got, strict=True) if v is not None}, len(keys) + sampled


def _fsspec_version(info: dict[str, Any], web: bool = False) -> str:
    """An object's version from an fsspec ``info()``: HTTP's ``ETag`` and s3fs's, gcsfs's ``etag`` or
    ``generation``, a ``VersionId``; else why there is none (``web``: HTTP's, ``_version``)."""
    low = {str(k).lower(): v for k, v in info.items() if v not in (None, "")}
    tag = low.get("etag") or low.get("e_tag")
    gen = low.get("generation") or low.get("versionid") or low.get("version_id")
    if gen is not None and (tag is None or str(tag).startswith(("W/", "w/"))):
        tag = f"generation {gen}"
    modified = low.get("last-modified") or low.get("lastmodified") or low.get("last_modified") or low.get("mtime")
    return _version(tag, low.get("size"), modified, web)


def fsspec_versions(zstore: Any, object_keys: list[str]) -> tuple[dict[str, str], int]:
    """The current versions of objects of a zarr ``FsspecStore`` (``_fsspec_version`` of its
    filesystem's ``info``, run on the loop its session belongs to), as ``object_versions`` gives them:
    ``({object key: version}, requests made)``; an object it lacks is ``MISSING``, one that got no
    answer within ``XINSITU_REQUEST_TIMEOUT`` unknown (``why_not``), one it could not tell about (an
    error) is left out."""
    from xinsitu.stores.zarr_store import home_loop

    fs = zstore.fs
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    web = bool({"http", "https"} & set(protocols))
    base = str(getattr(zstore, "path", "")).rstrip("/")
    keys = list(dict.fromkeys(object_keys))
    limit = _loop.request_timeout()

    async def one(k: str) -> str | None:
        path = f"{base}/{k}" if base else k
        try:
            info = await fs._info(path) if getattr(fs, "async_impl", False) else await asyncio.to_thread(fs.info, path)
        except FileNotFoundError:
            return MISSING
        except Exception as e:  # noqa: BLE001 - not known: the chunk is not kept on disk (its read reports the error)
            why = _refused(e)
            return None if why is None else _UNTRUSTED + why
        return _fsspec_version(info, web)

    async def fetch(k: str) -> bytes:
        path = f"{base}/{k}" if base else k
        if getattr(fs, "async_impl", False):
            return bytes(await fs._cat_file(path))
        return bytes(await asyncio.to_thread(fs.cat_file, path))

    async def asked() -> tuple[list[str | None], int]:
        got = await _ask_each(keys, one, limit)
        return await _sampled(fs, urlsplit(base).netloc, keys, got, fetch, limit) if web else (got, 0)

    home = home_loop(zstore)
    work = asked()
    if home is None:
        got, sampled = _run_bounded(work)
    else:
        try:
            if asyncio.get_running_loop() is home:  # its own loop would wait on itself: not asked here
                work.close()
                return {}, 0
        except RuntimeError:
            pass
        # each request is bounded in ``_ask_each``; this bound is the backstop
        got, sampled = asyncio.run_coroutine_threadsafe(work, home).result(timeout=_loop.run_timeout())
    return {k: v for k, v in zip(keys, got, strict=True) if v is not None}, len(keys) + sampled

