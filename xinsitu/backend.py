"""How chunk objects are fetched in this process: obstore where the store allows it (the
fast path), the zarr store's own async ``get`` otherwise (and after ``fork``, where
obstore would hang). Files of a local directory are read in the decode thread that
decodes them, while reading costs less than decoding (``LocalBackend``).

A backend has one coroutine, ``get(key) -> bytes | None`` (None: the object does not
exist, which zarr reads as the fill value). ``fetch_decoded`` wraps it for the reader:
it fetches again when the bytes fail to decode.

What is retried where:

* transient faults of one request (5xx, dropped or reset connections, a body cut off
  before its ``Content-Length``, timeouts) by obstore, per ``retry_config`` and the
  timeouts of ``client_options`` (defaults in ``xinsitu.store``);
* a body shorter than the object it claims to be (checked here against the response's
  byte range) by ``get``, up to ``FETCH_ATTEMPTS`` fetches;
* bytes that fail to decode (a body cut short where the HTTP layer cannot see it, e.g.
  by a proxy that rewrote ``Content-Length``) by ``fetch_decoded``, up to
  ``FETCH_ATTEMPTS`` fetches. An object that never decodes is corrupt in the store:
  the error names it, and the reader names the variable and the chunk.

Errors raised here never quote credentials or signed URLs (``xinsitu.store.scrubbed``).
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from xinsitu import _loop
from xinsitu._loop import FORK_HELP  # noqa: F401 - re-exported: the message lives in _loop
from xinsitu.decode import store_root, zarr_store_get
from xinsitu.store import FETCH_ATTEMPTS, redact_url, scrubbed, secrets_of

T = TypeVar("T")

#: Fetches of one object at most, when its body comes back short or fails to decode.

#: Byte ranges of one object less than this apart are fetched in one request (as obstore does).
COALESCE = 1024 * 1024


#: obstore requests in flight in this process at most, all readers and stores together. Each
#: request may hold a connection and, while it opens, one of the threads of obstore's runtime
#: (name resolution): readers of abandoned epochs and of other generators cannot add up past it.
PROCESS_INFLIGHT = 256
_limit: tuple[Any, asyncio.Semaphore] | None = None


def _process_limit() -> asyncio.Semaphore:
    """The process-wide bound on obstore requests, for the running loop (a new one after ``fork``)."""
    global _limit
    loop = asyncio.get_running_loop()
    if _limit is None or _limit[0] is not loop:
        _limit = (loop, asyncio.Semaphore(PROCESS_INFLIGHT))
    return _limit[1]


class DamagedObjectError(OSError):
    """The bytes of a stored object came back short, or failed to decode, every time."""


class _ObstoreBackend:
    """Whole objects (``get``) and byte ranges (``get_range``, ``get_suffix``, ``get_ranges``:
    what the reader needs to fetch inner chunks of shards) through obstore's async API."""

    def __init__(self, store: Any):
        self.store = store
        self._secrets = secrets_of(store)

    async def _fetch(self, key: str, options: dict[str, Any] | None = None) -> Any:
        """The bytes of ``key`` (or of a range of it), None where it does not exist."""
        import obstore

        got = want = 0
        for _ in range(FETCH_ATTEMPTS):
            err: BaseException | None = None
            try:
                async with _process_limit():
                    resp = await obstore.get_async(self.store, key, options=options)  # type: ignore[arg-type]
                    data = await resp.bytes_async()
            except FileNotFoundError:
                return None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - obstore already retried what was transient
                if type(e).__name__ == "NotSupportedError" and "Range request not supported" in str(e):
                    # the server (or a proxy) answered a Range request -- ours, or obstore's own to resume
                    # a cut transfer -- with 200 and the whole object: take the range from the whole
                    return await self._whole_then_slice(key, options)
                err = scrubbed(e, self._secrets)
                if type(e).__name__ == "NotSupportedError":
                    err = NotImplementedError(str(err))
            if err is not None:  # raised outside the handler: the original stays off the traceback
                raise err
            lo, hi = resp.range
            got, want = len(data), hi - lo
            if got == want:
                return data
        raise DamagedObjectError(f"object {key!r}: received {got} of {want} bytes, {FETCH_ATTEMPTS} times")

    async def _whole_then_slice(self, key: str, options: dict[str, Any] | None) -> Any:
        """The range ``options`` asks for, cut from the whole object (a server that ignores ``Range``)."""
        rng = (options or {}).get("range")
        whole = await self._fetch(key) if rng is not None or options else None
        if rng is None and not options:  # a whole-object read whose resumed transfer got a 200: read it again
            import obstore

            resp = await obstore.get_async(self.store, key)  # type: ignore[arg-type]
            return await resp.bytes_async()
        if whole is None:
            return None
        view = memoryview(whole)
        if isinstance(rng, dict):
            return view[max(0, len(view) - int(rng["suffix"])):]
        return view[int(rng[0]):int(rng[1])]

    async def get(self, key: str) -> Any:
        return await self._fetch(key)

    async def get_range(self, key: str, start: int, end: int) -> Any:
        """Bytes ``start:end`` of ``key`` (fewer where the object is shorter); None where it is missing."""
        return await self._fetch(key, {"range": (int(start), int(end))})

    async def get_suffix(self, key: str, n: int) -> Any:
        """The last ``n`` bytes of ``key``; None where it is missing."""
        try:
            return await self._fetch(key, {"range": {"suffix": int(n)}})
        except NotImplementedError:  # Azure has no suffix ranges: ask the size first
            import obstore

            try:
                size = int((await obstore.head_async(self.store, key))["size"])
            except FileNotFoundError:
                return None
            return await self._fetch(key, {"range": (max(0, size - int(n)), size)})

    async def get_ranges(self, key: str, starts: list[int], ends: list[int]) -> list[Any]:
        """Several ranges of one object; ranges less than ``COALESCE`` bytes apart share a request.

        Not ``obstore.get_ranges_async``: given a body shorter than the range it asked for, it
        panics (obstore 0.12) instead of raising something a retry could heal. Each span here is
        checked against its ``Content-Range`` and fetched again when short (``_fetch``).
        """
        starts, ends = [int(x) for x in starts], [int(x) for x in ends]
        spans: list[list[int]] = []  # [start, end, first range, last range + 1] over ranges sorted by start
        order = sorted(range(len(starts)), key=starts.__getitem__)
        for i in order:
            if spans and starts[i] - spans[-1][1] <= COALESCE:
                spans[-1][1] = max(spans[-1][1], ends[i])
                spans[-1][3] += 1
            else:
                spans.append([starts[i], ends[i], len(spans) and spans[-1][3], 0])
                spans[-1][3] = spans[-1][2] + 1
        bodies = await asyncio.gather(*(self._fetch(key, {"range": (lo, hi)}) for lo, hi, _, _ in spans))
        out: list[Any] = [None] * len(starts)
        for (lo, hi, first, stop), body in zip(spans, bodies, strict=True):
            if body is None:
                raise FileNotFoundError(f"object {key!r} does not exist")
            if len(body) != hi - lo:  # the object ends before the range does
                raise DamagedObjectError(f"object {key!r}: bytes {lo}-{hi} asked for, {len(body)} exist")
            view = memoryview(body)
            for i in order[first:stop]:
                out[i] = view[starts[i] - lo: ends[i] - lo]
        return out


class LocalBackend:
    """Chunk files of a local directory.

    The reader reads a file in the decode thread that then decodes it (``read``): one hop to a
    thread per chunk, no async runtime in between, about 0.4 ms of CPU less per chunk than
    obstore's async reads of the same file from the page cache. That holds while a file reads
    faster than it decodes (page cache, SSDs); where reads take longer (a spinning disk, a network
    file system), a decode thread would wait on each of them, so the reader goes back to ``inner``
    -- obstore's async reads, many in flight -- for good (``observe``). Byte ranges (shards) and the
    ``get`` of other callers always go through ``inner``.
    """

    #: reads timed before the choice is made, and the window it looks at
    WINDOW = 32

    def __init__(self, root: str, inner: Any):
        self.root = root
        self.inner = inner
        self.fused = True  # read in the decode thread
        self._times: deque[tuple[float, float]] = deque(maxlen=self.WINDOW)

    def read(self, key: str) -> bytes | None:
        """The bytes of ``key``, None where the file does not exist (blocking: call it in a thread)."""
        try:
            with open(os.path.join(self.root, key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def observe(self, read_s: float, decode_s: float) -> None:
        """One file's read and decode time, measured in the decode thread.

        Both include waits for the GIL and for a core, which come and go; the quickest of the
        last ``WINDOW`` reads and decodes do not. Reads stay in the decode threads while the
        quickest read is no slower than the quickest decode: page cache and SSDs, not a spinning
        disk or a network file system, whose every read waits.
        """
        self._times.append((read_s, decode_s))
        if len(self._times) == self.WINDOW:
            self.fused = min(r for r, _ in self._times) <= min(d for _, d in self._times)

    async def get(self, key: str) -> Any:
        return await self.inner.get(key)

    def __getattr__(self, name: str) -> Any:  # get_range, get_suffix, get_ranges where ``inner`` has them
        return getattr(self.inner, name)


class _FileBackend:
    """Objects of a local directory by plain file I/O, in the decode threads: what a forked child
    reads an obstore ``LocalStore`` with (obstore itself would hang there). Same methods, same
    answers as ``_ObstoreBackend``."""

    def __init__(self, root: str):
        self.root = root

    def _read(self, key: str, start: int = 0, end: int | None = None, suffix: int | None = None) -> bytes | None:
        try:
            with open(os.path.join(self.root, key), "rb") as f:
                if suffix is not None:
                    f.seek(max(0, os.fstat(f.fileno()).st_size - suffix))
                    return f.read()
                f.seek(start)
                return f.read() if end is None else f.read(max(0, end - start))
        except FileNotFoundError:
            return None

    async def _run(self, *args: Any) -> bytes | None:
        return await asyncio.get_running_loop().run_in_executor(None, self._read, *args)

    async def get(self, key: str) -> Any:
        return await self._run(key)

    async def get_range(self, key: str, start: int, end: int) -> Any:
        return await self._run(key, int(start), int(end))

    async def get_suffix(self, key: str, n: int) -> Any:
        return await self._run(key, 0, None, int(n))

    async def get_ranges(self, key: str, starts: list[int], ends: list[int]) -> list[Any]:
        bodies = await asyncio.gather(*(self._run(key, int(a), int(b)) for a, b in zip(starts, ends, strict=True)))
        for a, b, body in zip(starts, ends, bodies, strict=True):
            if body is None:
                raise FileNotFoundError(f"object {key!r} does not exist")
            if len(body) != b - a:
                raise DamagedObjectError(f"object {key!r}: bytes {a}-{b} asked for, {len(body)} exist")
        return list(bodies)


class _ZarrBackend:
    def __init__(self, zstore: Any):
        self.zstore = zstore

    async def get(self, key: str) -> Any:
        err: BaseException | None = None
        try:
            return await zarr_store_get(self.zstore, key)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - same message, without URL query strings
            err = scrubbed(e)
        raise err


async def bounded(request: Callable[[], Awaitable[T]], key: str, on_retry: Callable[[], None] | None = None,
                  attempts: int = FETCH_ATTEMPTS) -> T:
    """``await request()``, each try given ``_loop.request_timeout()`` seconds, ``attempts`` tries.

    A request that gets no answer (a server that accepts and never replies, a stalled body the
    HTTP client does not time out) is cancelled and made again; after ``attempts`` it raises
    ``TimeoutError`` naming ``key``. ``on_retry`` is called before each new try.
    """
    limit = _loop.request_timeout()
    for i in range(attempts):
        if i and on_retry is not None:
            on_retry()
        try:
            return await asyncio.wait_for(request(), limit)
        except TimeoutError as e:
            if not isinstance(e.__cause__, asyncio.CancelledError):
                raise  # the store's own timeout, after its own retries: not ours to repeat
            continue
    raise TimeoutError(f"object {key!r}: no answer within {limit:g} s, {attempts} times "
                       "(XINSITU_REQUEST_TIMEOUT sets the limit)")


async def fetch_decoded(backend: Any, key: str, use: Callable[[Any], Awaitable[T]],
                        attempts: int = FETCH_ATTEMPTS, on_retry: Callable[[], None] | None = None) -> T:
    """Fetch ``key`` and return ``await use(raw)`` (``raw`` None where the object is missing).

    ``use`` decodes the bytes (and puts them in place). Where it fails, the object is
    fetched again, ``attempts`` fetches in all: a transfer damaged where the HTTP layer
    cannot see it heals (a checksum that does not match included), an object corrupt in the
    store raises ``DamagedObjectError``. Each fetch is bounded in time (``bounded``).
    ``on_retry`` is called before each fetch made again.
    """
    return await refetched(lambda: backend.get(key), key, use, attempts, on_retry)


async def refetched(fetch: Callable[[], Awaitable[Any]], key: str, use: Callable[[Any], Awaitable[T]],
                    attempts: int = FETCH_ATTEMPTS, on_retry: Callable[[], None] | None = None) -> T:
    """``await use(await fetch())``, fetched again where ``use`` fails (see ``fetch_decoded``)."""
    last: BaseException | None = None
    for i in range(attempts):
        if i and on_retry is not None:
            on_retry()
        raw = await bounded(fetch, key, on_retry)
        if raw is None:
            return await use(None)
        try:
            return await use(raw)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any decode failure: fetch again, bounded
            last = e
    assert last is not None
    raise DamagedObjectError(f"object {key!r} failed to decode {attempts} times (corrupt in the store?): "
                             f"{type(last).__name__}: {last}") from last


def backend_for(zstore: Any) -> Any:
    """The fastest fork-safe way to read objects of ``zstore`` in this process.

    In a forked child (``_loop.in_forked_child``) local files are read with plain file I/O,
    whichever store opened them; anything that would need obstore's or Icechunk's runtime
    there raises ``_loop.ForkError`` at once (the fork policy, see ``xinsitu._loop``).
    """
    if type(zstore).__name__ == "IcechunkStore":
        _loop.refuse_after_fork("an Icechunk repository")  # Icechunk's Rust runtime, like obstore's, hangs
    if type(zstore).__name__ == "ManifestStore":  # VirtualiZarr: byte ranges of NetCDF/HDF5 files
        from xinsitu.virtual import ManifestBackend, is_manifest_store

        if is_manifest_store(zstore):
            return ManifestBackend(zstore)
    kind, obj = store_root(zstore)
    if kind == "obstore":
        if type(obj).__name__ == "LocalStore" and getattr(obj, "prefix", None) is not None:
            root = str(obj.prefix)  # what xinsitu.open_zarr opens a path with
            return LocalBackend(root, _FileBackend(root) if _loop.in_forked_child() else _ObstoreBackend(obj))
        _loop.refuse_after_fork(f"the store {_store_url(obj)}")
        return _ObstoreBackend(obj)
    if kind == "local":
        if _loop.in_forked_child():  # zarr's LocalStore is plain file I/O: safe after fork
            return LocalBackend(obj, _ZarrBackend(zstore))
        import obstore.store

        return LocalBackend(obj, _ObstoreBackend(obstore.store.LocalStore(prefix=obj)))
    return _ZarrBackend(zstore)


def _store_url(obs: Any) -> str:
    """An obstore store as messages name it: its URL without credentials, else its type."""
    url = getattr(obs, "url", None)
    return f"{type(obs).__name__}({redact_url(str(url))!r})" if url else type(obs).__name__
