"""Objects of the stores obstore cannot read (fsspec's, Icechunk's, zarr's ``MemoryStore`` ...), and
byte ranges of them (the inner chunks of shards, a shard's index), through the zarr store's own async
``get`` (``xinsitu.stores.backend.backend_for`` picks it). An asynchronous fsspec filesystem's client
session is bound to the loop zarr opened it on: its ``get`` runs there.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from xinsitu.codecs.cpu import zarr_store_get
from xinsitu.io import loop as _loop
from xinsitu.stores.reads import DamagedObjectError, retried
from xinsitu.stores.redact import redact_url, scrubbed


class _ZarrBackend:
    """Whole objects, and byte ranges of them, through the zarr store's own async ``get`` (stores
    obstore cannot read): a ``RangeBackend``, so that xinsitu reads the inner chunks of shards itself,
    as from obstore's stores (caching and counting them), not through zarr.

    An fsspec store's client session (aiohttp for ``http://``, aiobotocore for s3fs) belongs to the
    loop zarr opened it on: its ``get`` runs there, in a task of that loop (``home``). Such a store
    does not retry a transient fault (a 5xx, a dropped connection, a body cut short) as obstore does:
    each ``get`` is made again after one, with backoff (``store_reads.retried``), unless the store
    retries itself (a store ``xinsitu.open_zarr`` checked)."""

    def __init__(self, zstore: Any):
        if type(zstore).__name__ == "FsspecStore" and getattr(getattr(zstore, "fs", None), "async_impl", False):
            # its client session (aiohttp, aiobotocore) belongs to the parent's loop: unusable in a forked child
            _loop.refuse_after_fork(f"the fsspec store {_url(zstore)!r}")
        self.zstore = zstore
        self._home: tuple[int, asyncio.AbstractEventLoop | None] = (os.getpid(), home_loop(zstore))
        self._retries = not getattr(zstore, "_xinsitu_bounded", False)

    @property
    def home(self) -> asyncio.AbstractEventLoop | None:
        """zarr's loop in this process (zarr makes a new one after ``fork``), for an fsspec store; else None."""
        if self._home[0] != os.getpid():
            self._home = (os.getpid(), home_loop(self.zstore))
        return self._home[1]

    async def at_home(self, coro: Any) -> Any:
        """Await ``coro`` on zarr's loop where the store has one (``home``), else here."""
        home = self.home
        if home is not None and home is not asyncio.get_running_loop():
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, home))
        return await coro

    async def get(self, key: str, byte_range: Any = None) -> Any:
        """The object ``key`` (or ``byte_range`` of it: zarr's ``RangeByteRequest``, ``SuffixByteRequest``);
        None where it is missing."""
        err: BaseException | None = None
        try:
            return await self.at_home(self._get(key, byte_range))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - same message, without URL query strings
            err = scrubbed(e)
        raise err

    async def _get(self, key: str, byte_range: Any = None) -> bytes | None:
        if self._retries:
            return await retried(lambda: zarr_store_get(self.zstore, key, byte_range))
        return await zarr_store_get(self.zstore, key, byte_range)

    async def get_range(self, key: str, start: int, end: int) -> memoryview | None:
        """Bytes ``start:end`` of ``key`` (fewer where the object is shorter); None where it is missing."""
        from zarr.abc.store import RangeByteRequest

        start, end = int(start), int(end)
        data = await self.get(key, RangeByteRequest(start, end))
        if data is None:
            return None
        view = memoryview(data)  # more than asked: a server that ignores ``Range`` sent the whole object
        return view[start:end] if len(view) > end - start else view

    async def get_suffix(self, key: str, n: int) -> memoryview | None:
        """The last ``n`` bytes of ``key``; None where it is missing."""
        from zarr.abc.store import SuffixByteRequest

        data = await self.get(key, SuffixByteRequest(int(n)))
        return None if data is None else memoryview(data)[max(0, len(data) - int(n)):]

    async def get_ranges(self, key: str, starts: list[int], ends: list[int]) -> list[memoryview]:
        """Several ranges of one object, in the order asked, one ``get`` each (the store's own client
        pools its connections); raises where the object is missing or ends before a range does."""
        bodies = await asyncio.gather(*(self.get_range(key, lo, hi) for lo, hi in zip(starts, ends, strict=True)))
        for lo, hi, body in zip(starts, ends, bodies, strict=True):
            if body is None:
                raise FileNotFoundError(f"object {key!r} does not exist")
            if len(body) != int(hi) - int(lo):
                raise DamagedObjectError(f"object {key!r}: bytes {lo}-{hi} asked for, {len(body)} exist")
        return bodies  # type: ignore[return-value]


def _url(zstore: Any) -> str:
    """An fsspec store as messages name it: its URL without credentials."""
    proto = getattr(zstore.fs, "protocol", "")
    proto = proto[0] if isinstance(proto, (tuple, list)) else proto
    path = str(getattr(zstore, "path", ""))
    return redact_url(path if "://" in path else f"{proto}://{path}")


async def _running_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


def home_loop(zstore: Any) -> asyncio.AbstractEventLoop | None:
    """zarr's own loop for a store of an asynchronous fsspec filesystem (whose sessions are bound to
    the loop zarr first used them on), else None."""
    fs = getattr(zstore, "fs", None)
    if type(zstore).__name__ != "FsspecStore" or not (getattr(fs, "async_impl", False)
                                                      and getattr(fs, "asynchronous", False)):
        return None
    from xinsitu.compat.zarr_api import zarr_sync

    home: asyncio.AbstractEventLoop = zarr_sync(_running_loop())
    _loop.exit_first()  # reads on zarr's loop are stopped at exit before zarr closes it
    return home
