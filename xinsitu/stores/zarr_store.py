"""Objects of the stores obstore cannot read (fsspec's, zarr's ``MemoryStore`` ...), through the zarr
store's own async ``get`` (``xinsitu.stores.backend.backend_for`` picks it). An asynchronous fsspec
filesystem's client session is bound to the loop zarr opened it on: its ``get`` runs there.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from xinsitu.codecs.cpu import zarr_store_get
from xinsitu.io import loop as _loop
from xinsitu.stores.reads import retried
from xinsitu.stores.redact import redact_url, scrubbed


class _ZarrBackend:
    """Whole objects through the zarr store's own async ``get`` (stores obstore cannot read).

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

    async def get(self, key: str) -> Any:
        err: BaseException | None = None
        try:
            return await self.at_home(self._get(key))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - same message, without URL query strings
            err = scrubbed(e)
        raise err

    async def _get(self, key: str) -> bytes | None:
        if self._retries:
            return await retried(lambda: zarr_store_get(self.zstore, key))
        return await zarr_store_get(self.zstore, key)


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
