"""Chunks the cache has, put in place without a request or a decode: the reader's cache hits
(``serve_cached`` for regions, ``take_cached`` for whole-chunk slots of a buffer). What the cache
lacks goes on to be fetched as destinations that keep the chunk once decoded (``decode.Pieces``,
``decode.Slot``)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from xinsitu.cache.chunk_cache import ChunkCache
from xinsitu.cache.keys import ChunkKey, changed_since
from xinsitu.cache.versions import trusted
from xinsitu.index.regions import Target
from xinsitu.io.place import SETTLED_DISK_HIT, SETTLED_HIT, Pieces
from xinsitu.io.place import plain as _plain
from xinsitu.io.place import put_hits as _put_hits

if TYPE_CHECKING:
    from xinsitu.codecs.cpu import ChunkDecoder
    from xinsitu.index.source import VarSource
    from xinsitu.io.reader import Reader

#: cache hits of one read copied in place on the I/O loop up to this many bytes (more: in a decode thread)
INLINE_COPY_BYTES = 1 << 20


async def serve_cached(reader: Reader, src: VarSource, targets: dict[tuple[int, ...], list[Target]],
                        object_of: Any, dec: ChunkDecoder) -> dict[tuple[int, ...], Pieces]:
    """Put the chunks the cache has in place; return the others (to fetch) as destinations that
    hand the chunk to the cache once decoded (``decode.Pieces``).

    Hits take no request, no in-flight slot and no task per chunk. The memory tier is looked up
    here, on the I/O loop, all chunks of the read under one lock (its keys need no hashing and no
    ``stat``: ``ChunkKey.memory_key``); its hits are copied in place here too where they are a
    few plain copies (``INLINE_COPY_BYTES``), else in one decode-thread job. What memory lacks is
    looked up on disk in one decode-thread job (a local chunk file's disk key needs a ``stat``,
    an entry a file read), which also copies what it finds. ``object_of(coords)`` is the store
    key holding chunk ``coords`` (its shard's, for a sharded array).
    """
    keys = _keys(reader, src)
    if keys is None:
        return {c: Pieces(t) for c, t in targets.items()}
    cache = reader.cache
    assert cache is not None
    items = list(targets.items())
    mkeys: list[Any] = [keys.memory_key(c) for c, _ in items]
    disk = cache.disk is not None
    prefix = reader.route(src).prefix
    await _drop_rewritten(cache, keys, mkeys, lambda i: prefix + object_of(items[i][0]))
    got = cache.peek_many(mkeys, count_misses=not disk)
    hits: list[tuple[np.ndarray, list[Target]]] = []
    missing: list[tuple[tuple[int, ...], list[Target], Any]] = []
    for (c, t), mk, arr in zip(items, mkeys, got, strict=True):
        if arr is None:
            missing.append((c, t, mk))
        else:
            hits.append((arr, t))
    loop = asyncio.get_running_loop()
    n_disk = 0
    rest: dict[tuple[int, ...], Pieces] = {}
    if disk and missing:
        n_disk, misses = await loop.run_in_executor(None, _disk_lookup_take, cache, keys, prefix, object_of,
                                                    missing)
        known = keys.known_version if keys.needs_version else (lambda _: None)  # asked for the disk keys
        rest = {c: Pieces(t, cache, mk, dk, keys.since_ns, known(prefix + object_of(c))) for c, t, mk, dk in misses}
    else:
        rest = {c: Pieces(t, cache, mk, None, keys.since_ns) for c, t, mk in missing}
    if hits:
        if _plain(hits) and len(hits) * dec.nbytes <= INLINE_COPY_BYTES:
            _put_hits(hits)
        else:
            await loop.run_in_executor(None, _put_hits, hits)
    route = reader.route(src)
    if hits:
        reader.settle(route, None, SETTLED_HIT, n=len(hits))
    if n_disk:
        reader.settle(route, None, SETTLED_DISK_HIT, n=n_disk)
    reader.counters.cache_misses += len(rest)
    return rest


async def take_cached(reader: Reader, src: VarSource, coords: list[tuple[int, ...]],
                      out: np.ndarray | list[np.ndarray]) -> tuple[list[int], tuple[np.ndarray, np.ndarray] | None]:
    """The whole chunks ``coords`` from the memory tier, for destinations ``out[i]`` of chunk
    ``coords[i]``'s shape (``out``: a buffer with one chunk per row, or a list of arrays):
    ``(the positions it lacks, for a read; slab)``.

    The fast path of cached epochs: one lookup for all, no plan or target per chunk. Where ``out`` is a
    buffer and the tier holds every chunk in one slab, nothing is copied: ``slab`` is ``(the slab, its
    row of each chunk)`` and the batches are gathered from it (``out`` is left as it is). Else the
    chunks it holds are copied into place (one copy per chunk, or all at once into a buffer where it
    holds all), on the I/O loop when small, else in the decode threads, in shares; ``slab`` is None.
    """
    everything = list(range(len(coords)))
    keys = _keys(reader, src) if reader.cache is not None and reader.cache.memory_budget else None
    if keys is None:
        return everything, None
    cache = reader.cache
    assert cache is not None
    mkeys: list[Any] = [keys.memory_key(c) for c in coords]
    route = reader.route(src)
    await _drop_rewritten(cache, keys, mkeys, lambda i: route.prefix + route.dec.key(coords[i]))
    places = cache.locate_many(mkeys)
    held = [i for i, p in enumerate(places) if p is not None]
    if not held:
        return everything, None
    dec = route.dec
    n = len(held)
    reader.settle(route, None, SETTLED_HIT, n=n)
    buffer = isinstance(out, np.ndarray)
    if n == len(coords) and buffer:
        slab = places[0][0]  # type: ignore[index]
        if all(p[0] is slab for p in places):  # type: ignore[index]
            return [], (slab, np.array([p[1] for p in places], dtype=np.int64))  # type: ignore[index]
    chunks = [None if p is None else p[0][p[1]] for p in places]
    if n == len(coords) and buffer and out.flags.c_contiguous:  # type: ignore[union-attr]
        flat = out.reshape((-1,) + out.shape[2:])  # type: ignore[union-attr]
        shares: list[Any] = [lambda: np.concatenate(chunks, axis=0, out=flat)]  # type: ignore[arg-type]
    else:
        k = max(1, min(n, reader.inflight.threads, n * dec.nbytes // INLINE_COPY_BYTES))

        def share(part: list[int]) -> Any:
            def copy() -> None:
                for i in part:
                    np.copyto(out[i], chunks[i])  # type: ignore[arg-type]
            return copy
        shares = [share(held[s::k]) for s in range(k)]
    if n * dec.nbytes <= INLINE_COPY_BYTES:
        for copy in shares:
            copy()
    else:
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, copy) for copy in shares))
    return [i for i, p in enumerate(places) if p is None], None


async def _drop_rewritten(cache: ChunkCache, keys: ChunkKey, mkeys: list[Any], object_of: Any,
                          tier: Any = None) -> None:
    """Drop from the memory tier (or the device tier ``tier``) the chunks among ``mkeys`` (of store objects
    ``object_of(i)``) whose source changed since an earlier reader kept them (a generator made before this
    one with the same ``ChunkCache``), so they are read again; mark the others as checked.

    Each entry is checked once per reader, at its first lookup, in a decode thread: entries this reader
    kept, or checked, are not. A local file by its change time (one ``stat``; a change time cannot be set
    back, so a rewrite that kept size and modification time is seen too), gone if deleted (a directory
    swapped in by a rename, whose files may be older, is another ``ChunkKey.ident``: not kept here); a remote object
    by its version (``ChunkKey.versions``: the listing, or the ``HEAD``s, that the disk tier asks anyway),
    where the entry's reader knew it (a cache with a disk tier): another version, or none that is
    trusted, drops it. Not for an ``immutable`` cache, nor Icechunk snapshots (which name their data); a
    remote entry kept without a version (a cache without a disk tier) stays as the process first read
    it."""
    held = cache if tier is None else tier
    if keys.snapshot is not None or cache.immutable or not (cache.memory_budget if tier is None else len(tier)):
        return
    local = keys.local_root is not None
    if not local and not (keys.needs_version and keys.remote is not None and cache.disk is not None):
        return
    since = keys.since_ns
    old = held.kept_before(mkeys, since)
    if not local:
        old = [o for o in old if o[2] is not None]
    if not old:
        return

    def changed() -> tuple[list[bool], int]:
        if not local:
            now, n = keys.versions([object_of(i) for i, _, _ in old])
            return [v != was or not trusted(v) for v, (_, _, was) in zip(now, old, strict=True)], n
        return [changed_since(keys.file_of(object_of(i)), born) for i, born, _ in old], 0  # type: ignore[arg-type]

    gone, asked = await asyncio.get_running_loop().run_in_executor(None, changed)
    held.recheck([mkeys[i] for i, _, _ in old], gone, since)
    cache.count_version_requests(asked)


class TierPlan(NamedTuple):
    """Whole chunks of a variable and the device cache tier (``in_device_tier``): their memory keys (None:
    not cached), where the tier has each (``(slab, row)`` or None), the positions of those it lacks, and
    what the tier keeps with those (``keep``)."""

    keys: list[Any] | None
    places: list[Any]
    todo: list[int]
    born: int | None = None
    versions: list[str | None] | None = None

    def keep(self, tier: Any, pos: list[int], outs: list[Any], stack: Any = None) -> None:
        """Hand the device tier the chunks at ``pos`` (``outs[i]``; rows of ``stack``, as ``put_many`` takes
        them) with since when they are known to match their source and their objects' versions; nothing
        where they are not cached."""
        if self.keys is not None:
            tier.put_many([self.keys[i] for i in pos], pos, outs, stack, born=self.born,
                          versions=None if self.versions is None else [self.versions[i] for i in pos])


async def in_device_tier(reader: Reader, src: VarSource, coords: list[tuple[int, ...]], tier: Any) -> TierPlan:
    """Chunks ``coords`` of ``src`` looked up in the device cache tier ``tier`` (hits counted), once those a
    reader before this one kept and whose source changed since are dropped (as from the memory tier)."""
    keys = _keys(reader, src) if tier is not None else None
    if keys is None:
        return TierPlan(None, [None] * len(coords), list(range(len(coords))))
    assert reader.cache is not None
    route = reader.route(src)
    mkeys = [keys.memory_key(c) for c in coords]
    objects = [route.prefix + route.dec.key(c) for c in coords]
    await _drop_rewritten(reader.cache, keys, mkeys, objects.__getitem__, tier)
    places = tier.locate_many(mkeys)
    todo = [i for i, p in enumerate(places) if p is None]
    if len(todo) < len(coords):
        reader.settle(route, None, SETTLED_HIT, n=len(coords) - len(todo))
    versions = None
    if keys.needs_version:  # the versions of those it will keep, asked as the disk tier asks (a later reader
        cache = reader.cache  # checks the entries against them; one kept without a version stays as read)
        if todo and keys.remote is not None and cache.disk is not None and not cache.immutable:
            _, asked = await asyncio.get_running_loop().run_in_executor(None, keys.versions,
                                                                        [objects[i] for i in todo])
            cache.count_version_requests(asked)
        versions = [keys.known_version(o) for o in objects]
    return TierPlan(mkeys, places, todo, keys.since_ns, versions)


def _keys(reader: Reader, src: VarSource) -> ChunkKey | None:
    """The cache keys of ``src``'s chunks (``Reader.chunk_keys``); None without a cache, or where its store
    has no lasting identity (the cache then says once that it keeps nothing of it)."""
    return None if reader.cache is None else reader.chunk_keys(src)


def _disk_lookup_take(cache: ChunkCache, keys: ChunkKey, prefix: str, object_of: Any,
                      missing: list[tuple[tuple[int, ...], list[Target], Any]]) -> tuple[int, list[Any]]:
    """Look up on disk the chunks memory lacks and put those found in place (a decode-thread job: keys
    of local chunk files ``stat`` them, entries are files): (disk hits, misses as (coords, targets,
    memory key, disk key))."""
    found, misses = [], []
    dks = cache.disk_keys(keys, [(coords, prefix + object_of(coords)) for coords, _, _ in missing])
    known = keys.known_version if keys.needs_version else (lambda _: None)  # asked for the disk keys
    for (coords, t, mk), dk in zip(missing, dks, strict=True):
        # kept in memory as a chunk this reader read: known to match its source since it began
        got = cache.get(mk, disk_key=dk, born=keys.since_ns, version=known(prefix + object_of(coords)))
        if got is None:
            misses.append((coords, t, mk, dk))
        else:
            found.append((got, t))
    _put_hits(found)
    return len(found), misses
