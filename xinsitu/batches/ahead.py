"""The next epoch's first buffer, read as an epoch ends (``BatchGenerator._read_ahead``): what a read ahead
holds, whether the next iteration may take it (``take``), and how one is let go."""

from __future__ import annotations

import asyncio
import os
from typing import Any, NamedTuple

from xinsitu.cache.virtual_refs import holds_virtual_chunks, referenced_state
from xinsitu.index.snapshot import snapshot_of_store, writable_session
from xinsitu.io import loop as _loop
from xinsitu.io.fetchers import reads_changed


class Ahead(NamedTuple):
    """A read ahead under way: the process that began it, the epoch it reads, its task on the I/O loop, the
    reader's counters and the file clock (``file_clock_ns``) as it began, what it fetched (``Reader.journal``),
    the zarr stores it reads and what ``mark`` noted of them as it began."""

    pid: int
    epoch: int
    task: Any
    counters: dict[str, Any]
    began: int
    journal: list[Any]
    stores: list[Any]
    marks: dict[int, str]


def may_read_ahead(stores: list[Any]) -> bool:
    """Whether chunks of ``stores`` (zarr stores) may be read ahead: not where what they hold may change in this
    process without a file or snapshot to tell (a writable Icechunk session, an in-memory store)."""
    return not any(writable_session(s) or type(getattr(s, "store", s)).__name__ in _IN_MEMORY for s in stores)


_IN_MEMORY = ("MemoryStore", "GpuMemoryStore", "ManagedMemoryStore")  # zarr's and obstore's


def mark(stores: list[Any], marks: dict[int, str]) -> None:
    """Note in ``marks``, by store id, the state of the files each read-only Icechunk session of ``stores`` with
    virtual chunks references (``take`` compares it). Off the I/O loop: listing them reads the snapshot's
    manifests, once per snapshot."""
    for store in stores:
        snapshot = snapshot_of_store(store)
        if snapshot is not None and holds_virtual_chunks(store):
            marks[id(store)] = referenced_state(store, snapshot)


def _marks_changed(stores: list[Any], marks: dict[int, str]) -> bool:
    """Whether a file an Icechunk session of ``stores`` references is in another state than ``mark`` noted."""
    for s in stores:
        snapshot = snapshot_of_store(s)
        if id(s) in marks and snapshot is not None and referenced_state(s, snapshot) != marks[id(s)]:
            return True
    return False


async def settle(task: Any) -> None:
    """Cancel a read ahead and wait until it has stopped."""
    task.cancel()
    await asyncio.wait([task])


def quiet(task: Any) -> None:
    """Retrieve a read ahead's outcome: one that failed or was dropped is simply not used."""
    if not task.cancelled():
        task.exception()


def served(loader: Any) -> tuple[int, int, int] | None:
    """(requests, chunks from the cache's disk tier, chunks from the cache) the loader's reader made so far."""
    c = getattr(getattr(loader, "reader", None), "counters", None)
    return None if c is None else (c.requests, c.cache_disk_hits, c.cache_hits)


def take(ahead: Ahead | None, epoch: int, start: int, shuffle: bool, live: int) -> tuple[Any, dict[str, Any] | None]:
    """The task and counters of ``ahead`` for an iteration of ``epoch`` from batch ``start`` (``live``
    iterations under way, this one included), or (None, None). One read for another epoch (where the order
    depends on it: ``shuffle``) or place is dropped, and settled before the iteration reads: its reads neither
    count in the epoch's io_stats nor run on beside it. So is one where a local file it read (or one its
    Icechunk snapshot references) was written since it began (an archive rewritten between epochs): the epoch
    reads it as it is now (a NetCDF or GRIB file changed since it was opened: its first read says so)."""
    if ahead is None or ahead.pid != os.getpid():
        return None, None
    drop = True
    try:
        drop = (ahead.epoch != epoch and shuffle) or start != 0 or live > 1 or \
            reads_changed(list(ahead.journal), ahead.began) or _marks_changed(ahead.stores, ahead.marks)
    finally:
        if drop:
            _loop.run(settle(ahead.task), timeout=30)
    return (None, None) if drop else (ahead.task, ahead.counters)
