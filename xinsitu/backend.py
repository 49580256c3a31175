"""How chunk objects are fetched in this process: obstore where the store allows it (the
fast path), the zarr store's own async ``get`` otherwise (and after ``fork``, where
obstore would hang).

A backend has one coroutine, ``get(key) -> bytes | None`` (None: the object does not
exist, which zarr reads as the fill value).
"""

from __future__ import annotations

from typing import Any

from xinsitu import _loop
from xinsitu.decode import store_root, zarr_store_get

FORK_HELP = (
    "obstore cannot run in a process forked from one that already used it (the read would hang). "
    "Use DataLoader(..., num_workers=0) (xinsitu reads in parallel already) or start workers with "
    "multiprocessing_context='spawn' or 'forkserver'"
)


class _ObstoreBackend:
    def __init__(self, store: Any):
        self.store = store

    async def get(self, key: str) -> Any:
        import obstore

        try:
            resp = await obstore.get_async(self.store, key)
            return await resp.bytes_async()
        except FileNotFoundError:
            return None


class _ZarrBackend:
    def __init__(self, zstore: Any):
        self.zstore = zstore

    async def get(self, key: str) -> Any:
        return await zarr_store_get(self.zstore, key)


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
