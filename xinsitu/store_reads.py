"""The metadata reads of an open, bounded and checked: each ``get``/``exists`` of a zarr store
given ``XINSITU_REQUEST_TIMEOUT`` seconds a try, ``FETCH_ATTEMPTS`` tries (``bounded_request``,
``bounded_store``), and a metadata object that is not valid JSON (damaged in transit) fetched again
(the checked obstore store of ``xinsitu.open_zarr``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from xinsitu import _loop, source
from xinsitu.redact import redact_url

T = TypeVar("T")


#: fetches of one object before a damaged body (short, undecodable, not JSON) is an error
FETCH_ATTEMPTS = 3
#: metadata objects: JSON, checked as read (a damaged body is fetched again, then named)
_METADATA = ("zarr.json", ".zmetadata", ".zarray", ".zattrs", ".zgroup")
_checked: Any = None


def _checked_store() -> Any:
    """``zarr.storage.ObjectStore`` whose metadata reads are checked: a body that is not valid JSON
    (damaged in transit) is fetched again, ``FETCH_ATTEMPTS`` times, then raises naming its key."""
    global _checked
    if _checked is None:
        import zarr.storage

        class ObjectStore(zarr.storage.ObjectStore):  # same name: code that checks the kind keeps working
            async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
                def fetch() -> Any:
                    return super(ObjectStore, self).get(key, prototype, byte_range)

                what = f"object {key!r} of {_store_name(self.store)}"
                if byte_range is not None or not key.endswith(_METADATA):
                    return await bounded_request(fetch, what)
                err: Exception | None = None
                for _ in range(FETCH_ATTEMPTS):
                    buf = await bounded_request(fetch, "metadata " + what)
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
                return await bounded_request(lambda: super(ObjectStore, self).exists(key),
                                             f"object {key!r} of {_store_name(self.store)}")

        ObjectStore.__module__ = __name__
        ObjectStore.__qualname__ = "_CheckedObjectStore"
        _checked = ObjectStore
    return _checked


def _store_name(obs: Any) -> str:
    """An obstore store as messages name it: its URL without credentials, else its type."""
    url = getattr(obs, "url", None)
    return redact_url(str(url)) if url else type(obs).__name__


async def bounded_request(fetch: Callable[[], Awaitable[T]], what: str) -> T:
    """``await fetch()``, each try given ``XINSITU_REQUEST_TIMEOUT`` seconds (``_loop.request_timeout``),
    ``FETCH_ATTEMPTS`` tries: the bound of chunk reads (``xinsitu.backend.bounded``) on the metadata
    reads of an open (a server that accepts and never answers). Then ``TimeoutError`` naming ``what``.
    A ``TimeoutError`` of the store's own is raised as it is."""
    limit = _loop.request_timeout()
    for _ in range(FETCH_ATTEMPTS):
        cm = asyncio.timeout(limit)
        try:
            async with cm:
                return await fetch()
        except TimeoutError:
            if not cm.expired():
                raise
    raise TimeoutError(f"{what}: no answer within {limit:g} s, {FETCH_ATTEMPTS} times (set XINSITU_REQUEST_TIMEOUT "
                       "to a number of seconds to wait longer, or fewer)")


def bounded_store(zstore: Any) -> Any:
    """``zstore`` with each ``get`` and ``exists`` bounded as ``bounded_request`` bounds them (the
    checked obstore store of ``open_zarr`` is bounded already and is returned as it is)."""
    if isinstance(zstore, _checked_store()):
        return zstore
    import zarr.storage

    class BoundedStore(zarr.storage.WrapperStore):
        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            return await bounded_request(lambda: self._store.get(key, prototype, byte_range),
                                         f"object {key!r} of {type(self._store).__name__}")

        async def exists(self, key: str) -> bool:
            return await bounded_request(lambda: self._store.exists(key),
                                         f"object {key!r} of {type(self._store).__name__}")

    return BoundedStore(zstore)


source.reopen_store = bounded_store  # xinsitu's reopen of a dask-backed Dataset's store (layer 1)

def __getattr__(name: str) -> Any:  # pickles name the checked store class by this attribute
    if name == "_CheckedObjectStore":
        return _checked_store()
    raise AttributeError(name)
