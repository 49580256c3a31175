"""How chunk objects are fetched in this process: obstore where the store allows it (the
fast path), the zarr store's own async ``get`` otherwise (``xinsitu.stores.zarr_store``), and after ``fork`` (where
obstore would hang). Files of a local directory are read in the decode thread that
decodes them, while reading costs less than decoding (``LocalBackend``).

A backend is typed by :class:`Backend`: one coroutine, ``get(key) -> bytes | None`` (None:
the object does not exist, which zarr reads as the fill value); a :class:`RangeBackend` also
fetches byte ranges (what the reader needs for the inner chunks of shards). ``fetch_decoded``
wraps ``get`` for the reader: it fetches again when the bytes fail to decode, and bounds
each try in time (``bounded``, with one timer per loop for all requests: ``Deadlines``).
obstore's backend also starts a whole-object request without awaiting it (``start_whole``),
for the reader's callback path of small whole chunks. ``ManifestBackend`` fetches the chunks
of a VirtualiZarr store (byte ranges of NetCDF/GRIB files; ``xinsitu.stores.virtual_store``).

What is retried where:

* transient faults of one request (5xx, dropped or reset connections, a body cut off
  before its ``Content-Length``, timeouts) by obstore, per ``retry_config`` and the
  timeouts of ``client_options`` (defaults in ``xinsitu.stores.opening``);
* a body shorter than the range it claims to be (checked here against the response's
  byte range) by ``get_range``, ``get_suffix`` and ``get_ranges``, up to ``FETCH_ATTEMPTS``
  fetches (a whole object, asked as an open range in one call, is checked by decoding it);
* bytes that fail to decode (a body cut short where the HTTP layer cannot see it, e.g.
  by a proxy that rewrote ``Content-Length``) by ``fetch_decoded``, up to
  ``FETCH_ATTEMPTS`` fetches. An object that never decodes is corrupt in the store:
  the error names it, and the reader names the variable and the chunk.

Errors raised here never quote credentials or signed URLs (``xinsitu.stores.redact.scrubbed``).
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeAlias, TypeVar, runtime_checkable

from xinsitu.codecs.cpu import store_root
from xinsitu.io import loop as _loop
from xinsitu.stores.reads import FETCH_ATTEMPTS, NO_ANSWER_WHY, DamagedObjectError
from xinsitu.stores.redact import recording_store, redact_url, scrubbed, secrets_of
from xinsitu.stores.virtual_store import ManifestBackend, is_manifest_store
from xinsitu.stores.zarr_store import _ZarrBackend

T = TypeVar("T")

#: What a fetch returns: ``bytes``, a ``memoryview`` or obstore's ``Bytes`` (all buffers with a ``len``).
Data: TypeAlias = Any


@runtime_checkable
class Backend(Protocol):
    """How the reader fetches the objects of one store (whole objects)."""

    async def get(self, key: str) -> Data | None:
        """The bytes of object ``key``; None where it does not exist (zarr's fill value)."""
        ...


@runtime_checkable
class RangeBackend(Backend, Protocol):
    """A backend that also fetches byte ranges: inner chunks of shards, a shard's index."""

    async def get_range(self, key: str, start: int, end: int) -> Data | None:
        """Bytes ``start:end`` of ``key`` (fewer where the object is shorter); None where it is missing."""
        ...

    async def get_suffix(self, key: str, n: int) -> Data | None:
        """The last ``n`` bytes of ``key``; None where it is missing."""
        ...

    async def get_ranges(self, key: str, starts: list[int], ends: list[int]) -> list[Data]:
        """Several ranges of one object, in the order asked; raises where the object is missing or short."""
        ...


@runtime_checkable
class WholeBackend(Backend, Protocol):
    """A backend that starts a whole-object request without awaiting it (obstore's): what the reader's
    callback path (``fetchers.WholeFetches``) needs."""

    async def start_whole(self, key: str) -> asyncio.Future | None:
        """The request's future, started; None where this store takes ``get`` for every object."""
        ...

    def whole_error(self, e: BaseException) -> BaseException | None:
        """What to raise for a failed whole-object request (None: fetch it with ``get`` instead)."""
        ...


class Scratch(Protocol):
    """A decode thread's reused read buffer (``place.ThreadScratch``). One that also has ``room()`` (a view
    of all it holds now, maybe empty) lets a file be read into it without asking its size first."""

    def take(self, n: int) -> memoryview:
        ...


class ChunkReadError(OSError):
    """A chunk (``unit`` "shard": a sharded array's object) could not be read; names variable, coordinates, key."""

    def __init__(self, var: str, chunk: tuple[int, ...], key: str, cause: BaseException, unit: str = "chunk"):
        self.var, self.chunk, self.key = var, chunk, key
        super().__init__(f"cannot read {unit} {chunk} of variable {var!r} (key {key!r}): "
                         f"{type(cause).__name__}: {cause}")

#: Byte ranges of one object less than this apart are fetched in one request (as obstore does).
COALESCE = 1024 * 1024


#: obstore requests in flight in this process at most, all readers and stores together. Each
#: request may hold a connection and, while it opens, one of the threads of obstore's runtime
#: (name resolution): readers of abandoned epochs and of other generators cannot add up past it.
PROCESS_INFLIGHT = 256
_limit = _loop.PerLoop(lambda _: asyncio.Semaphore(PROCESS_INFLIGHT))


def _process_limit() -> asyncio.Semaphore:
    """The process-wide bound on obstore requests, for the running loop (a new one after ``fork``)."""
    return _limit.get()  # type: ignore[no-any-return]


#: The end of the byte range asked for a whole object (``_ObstoreBackend._whole``): past any object.
OPEN_END = 1 << 62


def _range_refused(e: BaseException) -> bool:
    """Whether obstore's error says the store refused a byte range (an empty object: 416); obstore has
    no exception type of its own for it (a ``GenericError``), so its text tells."""
    text = str(e)
    return "Range Not Satisfiable" in text or "range was invalid" in text or "InvalidRange" in text


def _not_supported(e: BaseException) -> bool:
    """Whether obstore's error says the store does not support the operation (its typed exception)."""
    from obstore.exceptions import NotSupportedError

    return isinstance(e, NotSupportedError)


def _ranges_ignored(e: BaseException) -> bool:
    """Whether obstore's error says the server answered a byte range with the whole object (200)."""
    return _not_supported(e) and "Range request not supported" in str(e)




class _ObstoreBackend:
    """Whole objects (``get``) and byte ranges (``get_range``, ``get_suffix``, ``get_ranges``:
    what the reader needs to fetch inner chunks of shards) through obstore's async API."""

    def __init__(self, store: Any):
        self.store = store
        self._secrets = secrets_of(store)
        self._open_ranges = True  # whole objects as one open byte range (``_whole``), until refused

    async def _whole(self, key: str) -> Any:
        """The bytes of ``key`` in one call into obstore: the byte range ``0-OPEN_END``, which the
        server cuts at the object's end (RFC 9110 §14.1.1), through ``get_range_async``.

        ``get_async`` and then ``bytes_async`` cost two calls into obstore's runtime, each with
        its future, its hand-over of the GIL and its wake-up of the loop: ~120 µs of CPU per
        object of the one-sample-per-chunk archive over HTTP, a third of all its CPU. The
        response's own byte range is not seen this way: a body shorter than the object fails to
        decode and is fetched again (``fetch_decoded``). Where the range is refused -- an empty
        object (416), a server that answers ranges with the whole object -- this falls back to
        the two calls, and for good after a server that ignores ranges.
        """
        fut = await self.start_whole(key)
        if fut is not None:
            try:
                return await fut
            except FileNotFoundError:
                return None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - sorted by whole_error; obstore already retried what was transient
                err = self.whole_error(e)
                if err is not None:
                    raise err from None
        return await self._fetch(key)

    def whole_error(self, e: BaseException) -> BaseException | None:
        """What a whole-object read that failed with ``e`` raises (scrubbed of secrets), or None where
        the range was refused and the object is fetched without one (``_fetch``)."""
        if _ranges_ignored(e):
            self._open_ranges = False  # a server that ignores ranges: whole objects without one from now on
            return None
        if _range_refused(e):
            return None
        return self._raised(e)

    def _raised(self, e: BaseException) -> BaseException:
        """The error to raise for obstore's ``e``: scrubbed of secrets, ``NotImplementedError`` for an
        operation the store does not support."""
        err = scrubbed(e, self._secrets)
        if _not_supported(e):
            err = NotImplementedError(str(err))
        return err

    async def start_whole(self, key: str) -> asyncio.Future | None:
        """Start fetching the whole object ``key`` as ``get`` does (one open byte range) and return its
        future at once, without waiting for it: its bytes, or the error obstore raised
        (``FileNotFoundError`` where the object does not exist; ``whole_error`` says what to raise
        for the others, or that ``get`` would fetch it another way). None where this store takes
        the long way (``get``) for every object: it ignores ranges."""
        if not self._open_ranges:
            return None
        import obstore

        limit = _process_limit()
        await limit.acquire()
        try:
            fut = asyncio.ensure_future(obstore.get_range_async(self.store, key, start=0, end=OPEN_END))
        except BaseException:
            limit.release()
            raise
        _loop.native_future(fut)
        fut.add_done_callback(lambda _: limit.release())
        return fut

    async def _fetch(self, key: str, options: dict[str, Any] | None = None) -> Any:
        """The bytes of ``key`` (or of a range of it), None where it does not exist."""
        import obstore

        got = want = 0
        for _ in range(FETCH_ATTEMPTS):
            err: BaseException | None = None
            try:
                async with _process_limit():
                    resp = await _loop.native(
                        obstore.get_async(self.store, key, options=options))  # type: ignore[arg-type]
                    data = await _loop.native(resp.bytes_async())
            except FileNotFoundError:
                return None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - obstore already retried what was transient
                if _ranges_ignored(e):
                    # the server (or a proxy) answered a Range request -- ours, or obstore's own to resume
                    # a cut transfer -- with 200 and the whole object: take the range from the whole
                    return await self._whole_then_slice(key, options)
                err = self._raised(e)
            if err is not None:  # raised outside the handler: the original stays off the traceback
                raise err
            lo, hi = resp.range
            got, want = len(data), hi - lo
            if got == want:
                return data
        raise DamagedObjectError(f"object {key!r}: received {got} of {want} bytes, {FETCH_ATTEMPTS} times")

    async def _whole_then_slice(self, key: str, options: dict[str, Any] | None) -> Any:
        """The range ``options`` asks for, cut from the whole object (a server that ignores ``Range``)."""
        rng: Any = (options or {}).get("range")
        whole = await self._fetch(key) if rng is not None or options else None
        if rng is None and not options:  # a whole-object read whose resumed transfer got a 200: read it again
            import obstore

            resp = await _loop.native(obstore.get_async(self.store, key))  # type: ignore[arg-type]
            return await _loop.native(resp.bytes_async())
        if whole is None:
            return None
        view = memoryview(whole)
        if isinstance(rng, dict):
            return view[max(0, len(view) - int(rng["suffix"])):]
        return view[int(rng[0]):int(rng[1])]

    async def get(self, key: str) -> Any:
        return await self._whole(key)

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
                size = int((await _loop.native(obstore.head_async(self.store, key)))["size"])
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


#: File systems whose reads wait on a network (``fuse`` stands for every FUSE mount: gcsfuse,
#: s3fs, sshfs ...): local chunk files there are read with many requests in flight, not one by one.
NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
                        "9p", "afs", "fuse", "fuseblk", "panfs", "wekafs"})


def fs_type(path: str) -> str | None:
    """The type of the file system ``path`` lies on (``"ext4"``, ``"nfs4"``, ``"fuse.gcsfuse"`` ...),
    from ``/proc/self/mountinfo``; None where that cannot be read (not Linux)."""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    real = os.path.realpath(path)
    best, kind = -1, None
    for line in lines:
        pre, sep, post = line.partition(" - ")
        fields = pre.split()
        if not sep or len(fields) < 5 or not post:
            continue
        mount = fields[4].replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > best:
            best, kind = len(mount), post.split()[0]
    return kind


def network_fs(kind: str | None) -> bool:
    """Whether file system type ``kind`` (``fs_type``) reads over a network."""
    return kind is not None and (kind in NETWORK_FS or kind.split(".")[0] in NETWORK_FS)


class LocalBackend:
    """Chunk files of a local directory.

    The reader reads a file in the decode thread that then decodes it (``read``): one hop to a
    thread per chunk, no async runtime in between, about 0.4 ms of CPU less per chunk than
    obstore's async reads of the same file from the page cache. That holds while a file reads
    faster than it decodes (page cache, SSDs). A network file system (NFS, Lustre, SMB, a FUSE
    mount such as gcsfuse or s3fs), whose every read waits on the network, is read through
    ``inner`` -- obstore's async reads, many in flight -- from the start (``network_fs``); so is
    a disk found slow (``observe``: reads that take milliseconds, as a spinning disk's seeks do).
    Byte ranges (shards) and the ``get`` of other callers always go through ``inner``.
    """

    #: reads timed before the choice is made, and the window it looks at
    WINDOW = 64
    #: reads go to ``inner`` once the median of the window takes this long ...
    SLOW_READ_S = 4e-3
    #: ... and this many times the median decode (a GIL or core wait slows one read, not the median)
    SLOW_READ_RATIO = 2.0

    def __init__(self, root: str, inner: RangeBackend):
        self.root = root
        self._prefix = os.path.join(root, "")  # the root and a separator: a key's file is _prefix + key
        self.inner = inner
        self.fs_type = fs_type(root)
        self.fused = not network_fs(self.fs_type)  # read in the decode thread
        self._times: deque[tuple[float, float]] = deque(maxlen=self.WINDOW)

    def read(self, key: str, scratch: Scratch | None = None) -> bytes | memoryview | None:
        """The bytes of ``key``, None where the file does not exist (blocking: call it in a thread).

        ``os.read`` of the file's size, not ``open().read()``: no buffered reader, no guessing
        of the size (11 against 14 us for a 27 kB file from the page cache). With ``scratch`` (the
        calling thread's own, grown as needed) the file is read into it and a view of it is returned,
        valid until the next read into the same scratch: no fresh allocation per chunk. A new bytes
        object of a chunk's size each read makes glibc map, unmap and fault pages in again
        (0.3 s of system time in a 0.4 s cold epoch of the yardstick, with 20k page faults).

        A scratch with ``room()`` is read into whole first, with no ``fstat``: a local file's read ends short
        only at its end (a system call less per chunk, each one a wait to take the GIL back: 47 against 54
        us per 32 kB chunk in a plain two-thread loop); a file that fills it is read again the sized way."""
        try:
            fd = os.open(self._prefix + key, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            room = getattr(scratch, "room", None)
            if room is not None and len(view := room()):
                if (n := os.readv(fd, [view])) < len(view):
                    return view[:n]
                os.lseek(fd, 0, os.SEEK_SET)  # it filled the room: read again, sized
            size = os.fstat(fd).st_size
            if scratch is not None:
                view = scratch.take(size + 1)
                n = os.readv(fd, [view])
                if n <= size:
                    return view[:n]
                data = bytes(view)  # the file grew meanwhile: read it whole, the slow way
            else:
                data = os.read(fd, size + 1)  # one byte more: a file that grew meanwhile is read whole
            if len(data) > size:
                parts = [data]
                while part := os.read(fd, 1 << 20):
                    parts.append(part)
                data = b"".join(parts)
            return data
        finally:
            os.close(fd)

    def observe(self, read_s: float, decode_s: float) -> None:
        """One file's read and decode time, measured in the decode thread.

        Both include waits for the GIL and for a core, which come and go and can make the quickest
        reads of a busy process slower than its quickest decodes (reads give the GIL up; decodes of
        small chunks may not): medians, and a floor in milliseconds, are not moved by them. Reads
        leave the decode threads for good where the window's median read takes ``SLOW_READ_S`` and
        ``SLOW_READ_RATIO`` times the median decode: a disk whose every read waits."""
        self.observe_all([(read_s, decode_s)])

    def observe_all(self, times: list[tuple[float, float]]) -> None:
        """``observe`` of many files' (read, decode) times."""
        w, i = self._times, 0
        while i < len(times):  # the window filled, judged and emptied in turn
            k = min(self.WINDOW - len(w), len(times) - i)
            w.extend(times[i:i + k])
            i += k
            if len(w) == self.WINDOW:
                reads, decodes = (sorted(x)[self.WINDOW // 2] for x in zip(*w, strict=True))  # medians
                if reads >= self.SLOW_READ_S and reads >= self.SLOW_READ_RATIO * decodes:
                    self.fused = False
                w.clear()

    async def get(self, key: str) -> Data | None:
        return await self.inner.get(key)

    async def get_range(self, key: str, start: int, end: int) -> Data | None:
        return await self.inner.get_range(key, start, end)

    async def get_suffix(self, key: str, n: int) -> Data | None:
        return await self.inner.get_suffix(key, n)

    async def get_ranges(self, key: str, starts: list[int], ends: list[int]) -> list[Data]:
        return await self.inner.get_ranges(key, starts, ends)


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


class _Watch:
    """One request's deadline (``Deadlines``)."""

    __slots__ = ("deadline", "slack", "task", "cancelling", "fired", "limit", "until", "source")

    def __init__(self, deadline: float, slack: float, task: asyncio.Future, cancelling: int, limit: float,
                 source: int | None):
        self.deadline, self.slack, self.task, self.cancelling = deadline, slack, task, cancelling
        self.fired = False
        self.limit, self.source = limit, source
        self.until = deadline + limit * (_loop.REQUEST_PATIENCE - 1)  # the latest it may be put off to


class Deadlines:
    """The time limits of the requests in flight on one loop, enforced by one timer (``bounded``).

    ``asyncio.timeout`` gives each request a timer of its own: a handle pushed on the loop's heap and
    struck off it again, ~10 µs of the I/O loop per request, a tenth of its time on archives of
    small chunks. Here a request is a dict entry; one timer fires when the earliest deadline is
    past (at most ``SLACK`` of its limit late), cancels each task past its deadline the way
    ``asyncio.timeout`` does, and sets itself for the next.

    A request with a ``source`` (its store) whose deadline is past while that store answered another
    request within the last ``limit`` seconds is not given up yet: the store is alive and the request
    waits behind others (large chunks on a slow link). Its deadline moves to ``limit`` after that
    answer, never past ``_loop.REQUEST_PATIENCE`` times its limit. A store that answers nothing
    (a server that accepts and never replies) sees each request given up after ``limit``.
    """

    SLACK = 0.125
    SOURCES = 1024  # stores whose last answer is kept (the oldest forgotten past it)

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.watches: dict[_Watch, None] = {}
        self.answered: dict[int, float] = {}  # id of a source -> when it last answered a watched request
        self._timer: asyncio.TimerHandle | None = None
        self._due = float("inf")

    def watch(self, task: asyncio.Future, limit: float, source: Any = None) -> _Watch:
        """Cancel ``task`` (a task, or a future: a request not awaited) once ``limit`` seconds passed,
        unless ``unwatch`` came first (later where ``source``, the store it asks, answers others
        meanwhile); the watch's ``fired`` tells."""
        cancelling = task.cancelling() if isinstance(task, asyncio.Task) else 0
        w = _Watch(self.loop.time() + limit, limit * self.SLACK, task, cancelling, limit,
                   None if source is None else id(source))
        self.watches[w] = None
        if w.deadline + w.slack < self._due:
            self._arm(w.deadline + w.slack)
        return w

    def unwatch(self, w: _Watch) -> None:
        """The request of ``w`` ended (its answer came, or it was given up: ``fired``)."""
        self.watches.pop(w, None)
        if w.source is not None and not w.fired:
            answered = self.answered
            answered[w.source] = self.loop.time()
            if len(answered) > self.SOURCES:
                del answered[next(iter(answered))]

    def _arm(self, due: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._due, self._timer = due, self.loop.call_at(due, self._sweep)

    def _sweep(self) -> None:
        self._timer, self._due = None, float("inf")
        now, due = self.loop.time(), float("inf")
        for w in list(self.watches):
            if w.deadline <= now and w.source is not None:  # put off while its store answers others
                last = self.answered.get(w.source)
                if last is not None:
                    w.deadline = max(w.deadline, min(last + w.limit, w.until))
            if w.deadline <= now:
                del self.watches[w]
                w.fired = True
                w.task.cancel()
            else:
                due = min(due, w.deadline + w.slack)
        if due < float("inf"):
            self._arm(due)


_deadlines = _loop.PerLoop(Deadlines)


def deadlines_here() -> Deadlines:
    """The running loop's ``Deadlines`` (a new one after ``fork``, or on another loop)."""
    return _deadlines.get()  # type: ignore[no-any-return]


async def bounded(request: Callable[[], Awaitable[T]], key: str, on_retry: Callable[[], None] | None = None,
                  attempts: int = FETCH_ATTEMPTS, tried: int = 0, source: Any = None) -> T:
    """``await request()``, each try given ``_loop.request_timeout()`` seconds (``Deadlines``; longer
    while ``source``, the store asked, answers other requests), ``attempts`` tries (``tried`` of them
    already made, and timed out, by the caller).

    A request that gets no answer (a server that accepts and never replies, a stalled body the
    HTTP client does not time out) is cancelled and made again; after ``attempts`` it raises
    ``TimeoutError`` naming ``key``. ``on_retry`` is called before each new try. A ``TimeoutError``
    of the store's own (after its own retries) is raised as it is.
    """
    limit = _loop.request_timeout()
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("bounded() runs in a task")
    deadlines = deadlines_here()
    for i in range(min(tried, attempts - 1), attempts):
        if i and on_retry is not None:
            on_retry()
        w = deadlines.watch(task, limit, source)
        try:
            return await request()
        except asyncio.CancelledError:
            if not w.fired:
                raise
            w.fired = False
            if task.uncancel() > w.cancelling:  # cancelled from outside as well: not ours to retry
                raise
        finally:
            deadlines.unwatch(w)
            if w.fired:  # the deadline passed as the request ended: its cancellation is void
                task.uncancel()
    raise TimeoutError(f"object {key!r}: no answer within {limit:g} s, {attempts} times "
                       f"({NO_ANSWER_WHY}; XINSITU_REQUEST_TIMEOUT sets the limit)")


async def fetch_decoded(backend: Backend, key: str, use: Callable[[Any], Awaitable[T]],
                        attempts: int = FETCH_ATTEMPTS, on_retry: Callable[[], None] | None = None,
                        first: BaseException | None = None) -> T:
    """Fetch ``key`` and return ``await use(raw)`` (``raw`` None where the object is missing).

    ``use`` decodes the bytes (and puts them in place). Where it fails, the object is
    fetched again, ``attempts`` fetches in all: a transfer damaged where the HTTP layer
    cannot see it heals (a checksum that does not match included), an object corrupt in the
    store raises ``DamagedObjectError``. Each fetch is bounded in time (``bounded``).
    ``on_retry`` is called before each fetch made again. ``first``: how a first fetch the caller
    made itself failed (bytes that failed to decode, or ``TimeoutError``: no answer in time),
    counted among the ``attempts``.
    """
    return await refetched(lambda: backend.get(key), key, use, attempts, on_retry, first, source=backend)


async def refetched(fetch: Callable[[], Awaitable[Any]], key: str, use: Callable[[Any], Awaitable[T]],
                    attempts: int = FETCH_ATTEMPTS, on_retry: Callable[[], None] | None = None,
                    first: BaseException | None = None, source: Any = None) -> T:
    """``await use(await fetch())``, fetched again where ``use`` fails (see ``fetch_decoded``); ``source``:
    the store asked (``bounded``)."""
    timed_out = isinstance(first, TimeoutError)
    last: BaseException | None = None if timed_out else first
    for i in range(1 if last is not None else 0, attempts):
        if i and on_retry is not None:
            on_retry()
        raw = await bounded(fetch, key, on_retry, tried=int(timed_out and i == 0), source=source)
        if raw is None:
            return await use(None)
        try:
            return await use(raw)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any decode failure: fetch again, bounded
            last = e
    assert last is not None
    raise DamagedObjectError(f"object {key!r} failed to decode {attempts} times (corrupt in the store, or "
                             "the archive written again since it was opened?): "
                             f"{type(last).__name__}: {last}") from last


def backend_for(zstore: Any) -> Backend:
    """The fastest fork-safe way to read objects of ``zstore`` in this process.

    In a forked child (``_loop.in_forked_child``) local files are read with plain file I/O,
    whichever store opened them; anything that would need obstore's or Icechunk's runtime
    there raises ``_loop.ForkError`` at once (the fork policy, see ``xinsitu.io.loop``).
    """
    if type(zstore).__name__ == "IcechunkStore":
        _loop.refuse_after_fork("an Icechunk repository")  # Icechunk's Rust runtime, like obstore's, hangs
    if type(zstore).__name__ == "ManifestStore":  # VirtualiZarr: byte ranges of NetCDF/HDF5 files
        if is_manifest_store(zstore):
            return ManifestBackend(zstore)
    kind, obj = store_root(zstore)
    if kind == "obstore":
        if type(obj).__name__ == "LocalStore" and getattr(obj, "prefix", None) is not None:
            root = str(obj.prefix)  # what xinsitu.open_zarr opens a path with
            return LocalBackend(root, _FileBackend(root) if _loop.in_forked_child() else _ObstoreBackend(obj))
        _loop.refuse_after_fork(f"the store {_store_url(obj)}")
        return _ObstoreBackend(recording_store(obj))  # the user's store (xr.open_zarr): its provider's answers scrubbed
    if kind == "local":
        if _loop.in_forked_child():  # plain file I/O, as zarr's LocalStore itself: safe after fork
            return LocalBackend(obj, _FileBackend(obj))
        import obstore.store

        return LocalBackend(obj, _ObstoreBackend(obstore.store.LocalStore(prefix=obj)))
    return _ZarrBackend(zstore)


def _store_url(obs: Any) -> str:
    """An obstore store as messages name it: its URL without credentials, else its type."""
    url = getattr(obs, "url", None)
    return f"{type(obs).__name__}({redact_url(str(url))!r})" if url else type(obs).__name__


