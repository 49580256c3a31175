"""How chunk objects are fetched in this process: obstore where the store allows it (the
fast path), the zarr store's own async ``get`` otherwise (and after ``fork``, where
obstore would hang).

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
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from xinsitu import _loop
from xinsitu.decode import store_root, zarr_store_get
from xinsitu.store import scrubbed, secrets_of

T = TypeVar("T")

FORK_HELP = (
    "obstore cannot run in a process forked from one that already used it (the read would hang). "
    "Use DataLoader(..., num_workers=0) (xinsitu reads in parallel already) or start workers with "
    "multiprocessing_context='spawn' or 'forkserver'"
)

#: Fetches of one object at most, when its body comes back short or fails to decode.
FETCH_ATTEMPTS = 3


class DamagedObjectError(OSError):
    """The bytes of a stored object came back short, or failed to decode, every time."""


class _ObstoreBackend:
    def __init__(self, store: Any):
        self.store = store
        self._secrets = secrets_of(store)

    async def get(self, key: str) -> Any:
        import obstore

        got = want = 0
        for _ in range(FETCH_ATTEMPTS):
            err: BaseException | None = None
            try:
                resp = await obstore.get_async(self.store, key)
                data = await resp.bytes_async()
            except FileNotFoundError:
                return None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - obstore already retried what was transient
                err = scrubbed(e, self._secrets)
            if err is not None:  # raised outside the handler: the original stays off the traceback
                raise err
            lo, hi = resp.range
            got, want = len(data), hi - lo
            if got == want:
                return data
        raise DamagedObjectError(f"object {key!r}: received {got} of {want} bytes, {FETCH_ATTEMPTS} times")


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


async def fetch_decoded(backend: Any, key: str, use: Callable[[Any], Awaitable[T]],
                        attempts: int = FETCH_ATTEMPTS) -> T:
    """Fetch ``key`` and return ``await use(raw)`` (``raw`` None where the object is missing).

    ``use`` decodes the bytes (and puts them in place). Where it fails, the object is
    fetched again, ``attempts`` fetches in all: a transfer damaged where the HTTP layer
    cannot see it heals, an object corrupt in the store raises ``DamagedObjectError``.
    """
    last: BaseException | None = None
    for _ in range(attempts):
        raw = await backend.get(key)
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
    """The fastest fork-safe way to read objects of ``zstore`` in this process."""
    kind, obj = store_root(zstore)
    if kind == "obstore":
        if _loop.in_forked_child():
            raise RuntimeError(FORK_HELP)
        return _ObstoreBackend(obj)
    if kind == "local":
        if _loop.in_forked_child():  # zarr's LocalStore is plain file I/O: safe after fork
            return _ZarrBackend(zstore)
        import obstore.store

        return _ObstoreBackend(obstore.store.LocalStore(prefix=obj))
    return _ZarrBackend(zstore)
