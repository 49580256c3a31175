"""A chunk cache across epochs: decoded chunks kept in memory within a byte budget, and
optionally in a local directory that persists across runs and is shared by the processes
of one machine.

The reader asks the cache between "which chunk of which array" and "fetch + decode": a hit
is the decoded chunk (the store's dtype and chunk shape, before CF decoding), so fetching
and decoding are skipped. Keys (``ChunkKey``, in ``keys``) name the store, the array, the chunk, a hash
of the array's metadata and the Icechunk snapshot where there is one. The disk tier, which
outlives the process, also keys each chunk file of a local directory by its size,
modification time, change time and inode (the change time is what no user call can set back:
``rsync --inplace -t`` or ``tar x`` keep the rest), and each object of a remote store by its
version, a strong ETag and the size (``ChunkKey.versions``, ``ChunkCache.disk_keys``): an
archive that changed never serves stale chunks from it (unless the cache is declared
``immutable``). An object whose store gives no trustworthy version (no ETag, only a
Last-Modified of whole seconds, a refused ``HEAD``), or none in time, is not kept on disk,
and the cache says so once (a warning, and ``ChunkCache.notes`` for the generator's repr).
The memory tier takes the archive as the process found it (as an open
Dataset does) and needs no ``stat`` per lookup (``ChunkKey.memory_key``).

Why the tiers keep what they admitted instead of evicting the least recently used: a
shuffled epoch touches every chunk once, in a new order. Under LRU, a split larger than the
budget evicts each chunk before its next use and nothing ever hits. Keeping the first
chunks that fit (the memory tier never evicts) gives a hit rate of ``budget / split`` from
the second epoch on -- about 50% for a split twice the budget.

The disk tier stores decoded bytes, not the compressed object: read back from the page
cache or an SSD, a decoded chunk costs a read and a checksum, while the compressed one
costs about as much to read and a decompression on top (``bench/cache_bench.py`` measures
both; see ``docs/how-to/cache.md``). The disk tier's files, and how it trusts no one else, are
``disk_tier``'s.
"""

from __future__ import annotations

import difflib
import os
import threading
import time
import warnings
from collections.abc import Hashable
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from xinsitu.cache.budget import _fmt, auto_memory_budget, parse_size
from xinsitu.cache.disk_tier import DiskTier, _disk_path
from xinsitu.cache.keys import ChunkKey, file_clock_ns
from xinsitu.cache.versions import MISSING, trusted, why_not


@dataclass
class CacheStats:
    """What a ``ChunkCache`` did in this process (``cache.stats``; subtract two for an interval)."""

    hits: int = 0  # from memory
    disk_hits: int = 0  # from the disk tier (then promoted to memory where it fits)
    misses: int = 0
    puts: int = 0
    memory_bytes: int = 0
    memory_entries: int = 0
    disk_writes: int = 0
    disk_bytes: int = 0  # the directory's size at the last scan plus this process's writes since
    disk_evictions: int = 0
    corrupt: int = 0  # bad entries found (a miss, and deleted)
    disk_errors: int = 0  # writes that failed (disk full, permissions): the chunk is simply not kept
    not_admitted: int = 0  # puts the full disk tier turned away (everything in it was used during this run)
    version_requests: int = 0  # requests asking a remote store its objects' versions (ETags), for disk keys

    def __sub__(self, other: CacheStats) -> CacheStats:
        gauges = ("memory_bytes", "memory_entries", "disk_bytes")
        return CacheStats(**{f.name: getattr(self, f.name) - (0 if f.name in gauges else getattr(other, f.name))
                             for f in fields(self)})

    @property
    def hit_rate(self) -> float:
        """Hits (memory and disk) per lookup; 0.0 before any."""
        n = self.hits + self.disk_hits + self.misses
        return (self.hits + self.disk_hits) / n if n else 0.0


class ChunkCache:
    """Decoded chunks kept across epochs: a memory tier within a byte budget and an optional
    disk tier (a local directory) that persists across runs.

    Parameters
    ----------
    memory
        The memory tier's budget: bytes (an int, or a string such as ``"4GB"``/``"500MiB"``),
        ``"auto"``/``True`` (``AUTO_MEMORY_SHARE`` of the available memory, at most
        ``AUTO_MEMORY_CAP``), or ``False``/``None``/``0`` (no memory tier). The tier admits
        chunks until the budget is full and then keeps them: in shuffled epochs, LRU would
        evict each chunk before its next use.
    disk
        A directory for the disk tier (an NVMe drive, ideally), or None. Entries go under
        ``<disk>/xinsitu-chunks-v1/``; nothing else in the directory is touched. It must be
        yours (or root's) and writable by no other user unless sticky: else ``ValueError``.
    disk_size
        The disk tier's size bound (bytes or a string). None: it grows while the file system
        keeps ``DISK_FREE_SHARE`` of its size free (at least ``DISK_FREE_MIN``). When over,
        the least recently used entries not used since this cache was made (the run began;
        a pickle carries that time to workers) are deleted; where every entry has been
        used since, new chunks are not admitted (the same reason as the memory tier's).
    fsync
        Flush each disk entry to the device before it is renamed into place. Not needed for a
        killed process (the page cache keeps what was written); it guards against a power
        loss, which the checksum also catches.
    immutable
        Declare that the remote archives read through this cache are never rewritten in place:
        disk entries of object storage and HTTP are then keyed without the objects' versions
        (no listing or ``HEAD`` request). By default (False) each remote object's version (a strong
        ETag and its size) is part of its disk key, so a rewritten object is a miss; an object whose
        store gives no trustworthy version (no ETag, only a Last-Modified of whole seconds, a
        refused ``HEAD``) is not kept on disk, and the cache says so once (a warning, ``notes``).
        ``True`` or ``False`` only (a string such as ``"false"`` raises ``TypeError``).
    device
        A tier in GPU memory: its byte budget (an int or a string such as ``"8GB"``), kept like the
        memory tier (keep what fits); None (default) for none. Needs CuPy and a CUDA device
        (the ``gpu-cu12``/``gpu-cu13`` extra), else ``RuntimeError`` naming the extra.

    Notes
    -----
    Thread-safe; processes of one machine may share the disk directory (DDP ranks,
    DataLoader workers). A pickle carries the configuration, not the contents: a new process
    starts with an empty memory tier and the same disk directory. What a tier could not keep (a
    store without versions, a full or failing disk) is warned of once per process and listed in
    ``notes`` (the generator's repr shows them).
    """

    def __init__(self, memory: int | str | bool | None = "auto", disk: str | os.PathLike[str] | None = None,
                 disk_size: int | str | None = None, *, fsync: bool = False, immutable: bool = False,
                 device: int | str | None = None):
        if memory is True or memory == "auto":
            self.memory_budget = auto_memory_budget()
        elif memory is None or memory is False:
            self.memory_budget = 0
        else:
            self.memory_budget = parse_size(memory, "memory")
        self.disk = None if disk is None else _disk_path(disk)
        self.disk_size = None if disk_size is None else parse_size(disk_size, "disk_size")
        if disk_size is not None and disk is None:
            raise ValueError("disk_size= needs disk= (a directory for the disk tier)")
        self.fsync = _flag("fsync", fsync)
        self.immutable = _flag("immutable", immutable)
        # a tier in GPU memory (xinsitu.cache.device_tier.DeviceCache): its byte budget, 0 for none
        self.device_budget = 0 if device is None or device is False else parse_size(device, "device")
        if self.device_budget:
            from xinsitu.cache.device_tier import check_device_tier

            check_device_tier()
        self._since_ns = time.time_ns()  # the run began: entries used since are not evicted
        self._setup()

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._mem: dict[Hashable, np.ndarray] = {}  # key -> the chunk (a read-only row of a slab)
        self._rows: dict[Hashable, tuple[np.ndarray, int]] = {}  # key -> (slab, row)
        # key -> (since when, time.time_ns(), the entry is known to match its source; the version of its
        # remote object where that was known when it was kept) (``kept_before``)
        self._born: dict[Hashable, tuple[int, str | None]] = {}
        self._slabs: dict[tuple[tuple[int, ...], str], list[Any]] = {}  # (shape, dtype) -> [slab, rows used]
        self._stats = CacheStats()
        self._device: Any = None  # the tier in GPU memory, made on first use (``device_tier``)
        self._notes: dict[str, str] = {}  # what a tier could not keep, said once each (``notes``)
        self._named: dict[str, tuple[str, list[str]]] = {}  # a note naming variables: (its text, those named)
        self._asked: dict[str, ChunkKey] = {}  # arrays whose store said some objects are missing (``_served_missing``)
        self._disk: DiskTier | None = None
        if self.disk is not None:
            self._disk = DiskTier(self.disk, self.disk_size, fsync=self.fsync, since_ns=self._since_ns,
                                  say=self._say)

    # ------------------------------------------------------------------ pickling (configuration only)
    def device_tier(self, arrays: Any, free: int = 0) -> Any:
        """The tier in GPU memory (a ``device_tier.DeviceCache`` over the device memory API
        ``arrays``), made on first use in this process: ``device_budget`` bytes, or, where none was
        given, the memory tier's budget up to half the device memory ``free`` (chunks decoded on the
        GPU are kept there, not on the host); None where neither."""
        budget = self.device_budget or min(self.memory_budget, free // 2)
        if not budget:
            return None
        with self._lock:
            if self._device is None:
                from xinsitu.cache.device_tier import DeviceCache

                self._device = DeviceCache(budget, arrays)
            return self._device

    def __getstate__(self) -> dict[str, Any]:
        return {"memory": self.memory_budget, "disk": self.disk, "disk_size": self.disk_size,
                "fsync": self.fsync, "since_ns": self._since_ns, "immutable": self.immutable,
                "device": self.device_budget}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.memory_budget = state["memory"]
        self.disk, self.disk_size, self.fsync = state["disk"], state["disk_size"], state["fsync"]
        self._since_ns = state["since_ns"]
        self.immutable = state.get("immutable", False)
        self.device_budget = state.get("device", 0)
        self._setup()

    def _after_fork(self) -> None:
        """In a forked child: fresh locks (a parent's thread may have held one at the fork); the memory
        tier's contents stay (copy-on-write pages, still right)."""
        if os.getpid() != self._pid:
            self._lock = threading.Lock()
            self._pid = os.getpid()
        if self._disk is not None:
            self._disk.after_fork()

    # ------------------------------------------------------------------ public
    def get(self, key: Hashable, disk_key: str | None = None, *, born: int | None = None,
            version: str | None = None) -> np.ndarray | None:
        """The chunk stored under ``key`` (read-only, not a copy), or None.

        Looks in memory, then on disk (under ``disk_key``, or ``key`` where it is a string from
        ``ChunkKey.key``); a disk hit is kept in memory where it fits, with ``born`` and ``version``
        (as ``put``'s: a later reader checks it against its source as any entry).
        """
        arr = self.peek(key)
        if arr is not None:
            return arr
        dk = self._disk_key(key, disk_key)
        if dk is not None:
            assert self._disk is not None
            arr = self._disk.get(dk)
            if arr is not None:
                with self._lock:
                    self._stats.disk_hits += 1
                kept = self._keep(key, arr, born, version)
                return arr if kept is None else kept
        with self._lock:
            self._stats.misses += 1
        return None

    def peek(self, key: Hashable) -> np.ndarray | None:
        """The chunk under ``key`` if the memory tier holds it (a hit), else None -- without looking on
        disk and without counting a miss: never blocks, so an event loop may call it, and a miss then
        goes to ``get`` in a thread.
        """
        self._after_fork()
        with self._lock:
            arr = self._mem.get(key)
            if arr is not None:
                self._stats.hits += 1
            return arr

    def peek_many(self, keys: list[Hashable], count_misses: bool = False) -> list[np.ndarray | None]:
        """``peek`` of several keys under one lock: the chunks the memory tier holds, None for the others
        (counted as misses with ``count_misses``: where no disk tier will be asked)."""
        self._after_fork()
        mem = self._mem
        with self._lock:
            got = [mem.get(k) for k in keys]
            n_miss = sum(g is None for g in got)
            self._stats.hits += len(got) - n_miss
            if count_misses:
                self._stats.misses += n_miss
        return got

    def locate_many(self, keys: list[Hashable]) -> list[tuple[np.ndarray, int] | None]:
        """Where the memory tier holds each chunk: ``(slab, row)`` -- the chunk is ``slab[row]``, and
        chunks of one shape and dtype share slabs, so a batch can be gathered from many of them in one
        ``np.take`` -- or None (not counted as a miss). Rows are never reused while a slab lives."""
        self._after_fork()
        rows = self._rows
        with self._lock:
            got = [rows.get(k) for k in keys]
            self._stats.hits += sum(g is not None for g in got)
        return got

    def count_misses(self, n: int) -> None:
        """Count ``n`` lookups that found nothing (made by ``locate_many``, which counts only hits)."""
        with self._lock:
            self._stats.misses += n

    def count_version_requests(self, n: int) -> None:
        """Count ``n`` requests that asked a store for its objects' versions (a listing, ``HEAD``s)."""
        if n:
            with self._lock:
                self._stats.version_requests += n

    def put(self, key: Hashable, array: np.ndarray, *, disk_key: str | None = None, born: int | None = None,
            version: str | None = None) -> None:
        """Keep a decoded chunk under ``key``: in memory while the budget has room, and on disk.

        Parameters
        ----------
        key
            From ``ChunkKey.key`` (kept in both tiers), or ``ChunkKey.memory_key`` with ``disk_key``.
        array
            The decoded chunk: copied into a row of the memory tier's slabs (the caller keeps its array).
        disk_key
            The disk tier's key (``ChunkKey.key``) where ``key`` is a memory key.
        born
            Since when (``time.time_ns()``) the chunk is known to match its source: for a chunk read
            from a local file, the start of its reader (``ChunkKey.since_ns``); default: now.
        version
            The version of the chunk's remote object, where its reader knew it (``ChunkKey.known_version``):
            a later reader keeps the entry only while the object has that version.
        """
        self._after_fork()
        dk = self._disk_key(key, disk_key)
        if dk is not None:
            assert self._disk is not None
            self._disk.file_of(dk)  # a key that cannot name a file is refused before either tier keeps it
        arr = np.asarray(array)
        if not arr.dtype.isnative:  # kept in native order: a hit gave batches of a big-endian dtype (zarr 3.1)
            arr = arr.astype(arr.dtype.newbyteorder("="))
        with self._lock:
            self._stats.puts += 1
            known = key in self._mem
        if not known:
            self._keep(key, arr, born, version)
        if dk is None and version == MISSING and self._disk is not None:
            self._served_missing(key)
        if dk is not None and not known and (arr.dtype.hasobject or arr.dtype.kind == "T"):
            self._say("objects", f"disk tier keeps nothing of arrays of Python objects or strings ({arr.dtype})",
                      f"the chunk cache's disk tier {self.disk!r} keeps nothing of arrays of Python objects or "
                      f"variable-length strings (dtype {arr.dtype}): their chunks are read from the store (and "
                      "kept in the memory tier where it has room) (warned once)")
        elif dk is not None and not known:
            assert self._disk is not None
            try:
                self._disk.put(dk, arr)
            except OSError as e:  # a scan or the free space that failed (the directory gone?): counted, warned
                self._disk.error(e, "keep a chunk")

    def disk_keys(self, keys: ChunkKey, chunks: list[tuple[tuple[int, ...], str]]) -> list[str | None]:
        """The disk tier's keys (``ChunkKey.key``) of chunks ``(coords, object key in the store)`` of one
        array; None for a chunk the disk tier must not serve or keep (no disk tier, or a remote
        object without a trustworthy version). A local file's key names its size, modification
        and change times and inode; a remote object's its version (``ChunkKey.versions``: a listing
        of the array or one ``HEAD`` per object, once per ``ChunkKey``) unless the cache is
        ``immutable``.

        A store whose objects carry no trustworthy version (``cache.trusted``), or that did not answer
        in time, keeps nothing on disk: warned once per store, and said in ``notes``; a store found
        without versions is not asked again.
        """
        if self.disk is None:
            return [None] * len(chunks)
        if not keys.needs_version or self.immutable:
            return [keys.key(c, keys.file_of(k)) for c, k in chunks]
        if keys.remote is None:  # a remote store that cannot be asked
            self._cannot_keep(keys, ("untrusted", keys.unversioned or "its store cannot be asked for versions"))
            return [None] * len(chunks)
        if "untrusted " + keys.store_id in self._notes:  # found without versions: not asked again
            return [None] * len(chunks)
        versions, n = keys.versions([k for _, k in chunks])
        if MISSING in versions:  # read anyway: where it comes with bytes, the store was wrong (``_served_missing``)
            self._asked[keys.ident] = keys
        self.count_version_requests(n)
        out: list[str | None] = []
        why: tuple[str, str] | None = None
        for (c, _), v in zip(chunks, versions, strict=True):
            out.append(keys.key(c, version=v) if trusted(v) else None)
            why = why or why_not(v)
        if why is not None:
            self._cannot_keep(keys, why)
        return out

    @property
    def notes(self) -> list[str]:
        """What a tier could not keep in this process, one line each (a store whose objects carry no
        version, a full or failing disk tier), in the order found; each was warned of once."""
        with self._lock:
            return list(self._notes.values())

    def _say(self, key: str, note: str, message: str, what: str | None = None) -> None:
        """Note ``note`` (``notes``) and warn ``message``, once per ``key``; ``what``, the variable ``note`` names:
        a later call for ``key`` about another adds it to the note (each variable a tier keeps nothing of named)."""
        with self._lock:
            if key in self._notes:
                named = self._named.get(key)
                if named is not None and what is not None and what not in named[1]:
                    named[1].append(what)
                    self._notes[key] = named[0].replace("\0", ", ".join(named[1]))
                return
            self._notes[key] = note
            if what is not None:
                self._named[key] = (note.replace(what, "\0", 1), [what])
        try:
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        except Warning:  # raised where warnings are errors: said in ``notes``, and no read fails of it
            pass

    def _served_missing(self, key: Hashable) -> None:
        """A chunk whose store said it is missing (``disk_keys``: a ``HEAD`` answered 404, a listing without
        it) came with bytes: its version cannot be known, and the disk tier keeps nothing of that store;
        said once (``_cannot_keep``), never a disk tier that stays empty unsaid."""
        ident = key[0] if isinstance(key, tuple) and key and isinstance(key[0], str) else None
        keys = next((k for i, k in list(self._asked.items()) if ident is not None and ident.startswith(i)), None)
        if keys is not None:
            self._cannot_keep(keys, ("untrusted", "it says objects are missing (a HEAD answered 404, or a listing "
                                                  "without them) that it then serves"))

    def _cannot_keep(self, keys: ChunkKey, why: tuple[str, str]) -> None:
        """Say once that the disk tier keeps nothing of ``keys``'s store, and why (``why_not``)."""
        kind, text = why
        name = keys.store_name
        if kind == "untrusted":
            self._say(f"untrusted {keys.store_id}",
                      f"disk tier keeps nothing of {name}: no trustworthy version ({text}); "
                      "ChunkCache(..., immutable=True) keeps it if it is never rewritten",
                      f"the chunk cache's disk tier {self.disk!r} keeps nothing of {name}: its objects carry no "
                      f"trustworthy version ({text}), so a rewritten object could not be told from the one kept. "
                      "Its chunks are read from the store (and kept in the memory tier where it has room); if "
                      "this archive is never rewritten, xinsitu.ChunkCache(disk=..., immutable=True) keeps them "
                      "on disk (warned once)")
        else:
            self._say(f"unknown {keys.store_id}", f"disk tier keeps nothing of {name} for now: {text}",
                      f"the chunk cache's disk tier {self.disk!r} could not learn the versions of the objects of "
                      f"{name}: {text}; those chunks are read from the store and not kept on disk (warned once)")

    def note_uncached(self, what: str, store: Any) -> None:
        """Say once that ``what`` (a variable) is not cached at all: its store has no lasting identity."""
        kind = type(store).__name__
        inner = type(getattr(store, "store", None)).__name__ if kind == "ObjectStore" else kind  # obstore's
        why = {"ManifestStore": "references to NetCDF or GRIB files read in place (xinsitu.virtual), which the "
                                "cache cannot check against the files",
               "IcechunkStore": "a writable Icechunk session, whose chunks may change before a commit: read "
                                "a repo.readonly_session(...) to cache them",
               "MemoryStore": "a memory store"}.get(inner, "a kind of store the cache does not know")
        self._say(f"uncached {kind}", f"not cached: {what} (its store, {kind}, has no lasting identity: {why})",
                  f"the chunk cache keeps nothing of {what} nor of any other variable of its store: its store "
                  f"({kind}) has no identity that lasts ({why}), so its chunks are read every epoch (warned once)",
                  what)

    def note_read_by_zarr(self, what: str, kind: str) -> None:
        """Say once that ``what`` (a sharded variable that xinsitu does not read by byte range from its store,
        of ``kind``: zarr reads its inner chunks) is not cached."""
        self._say(f"uncached shards {kind}", f"not cached: {what} (a sharded array zarr reads from its store, "
                  f"{kind})", f"the chunk cache keeps nothing of {what}: it is sharded in a layout this zarr "
                  f"version does not let xinsitu read by byte range, so zarr reads its inner chunks from its store "
                  f"({kind}) every epoch (warned once)", what)

    def note_read_through_dask(self, what: str) -> None:
        """Say once that ``what`` (a variable read through dask: NetCDF or GRIB files opened by xarray) is
        not cached: its chunks have no keys the cache could check against the files."""
        self._say("uncached dask", f"not cached: {what} (read through dask; only Zarr and Icechunk archives are "
                  "cached: ds.to_zarr(...) makes one)",
                  f"the chunk cache keeps nothing of {what}: it is read through dask (files opened by "
                  "xr.open_dataset or open_mfdataset with chunks=), whose chunks the cache has no key for, so they "
                  "are read every epoch. xinsitu.virtual.open_netcdf / open_grib read the same files in place "
                  "without dask, but their chunks are not cached either; to cache them, copy the data to Zarr "
                  "(ds.to_zarr) and train from that (warned once)", what)

    def note_in_memory(self, what: str) -> None:
        """Say once that ``what`` (a variable whose values are in memory: loaded, computed) is not cached."""
        self._say("uncached memory", f"not cached: {what} (its values are in memory already)",
                  f"the chunk cache keeps nothing of {what} nor of any other variable held in memory: their values "
                  "are in memory already (loaded or computed by xarray), so no epoch reads them again; cache= serves "
                  "variables read from a store (warned once)", what)

    def note_memory_lost_with_workers(self) -> bool:
        """In a DataLoader worker that is not persistent: say once that a memory tier without a disk tier is lost
        with the workers at each epoch's end (so nothing is served from it); whether it was said."""
        if not self.memory_budget or self.disk is not None:
            return False
        self._say("memory lost with workers", "memory tier: lost with each DataLoader's workers (not persistent)",
                  "the chunk cache's memory tier lives in each DataLoader worker, and workers that are not "
                  "persistent end with each epoch, taking what it kept: every epoch reads again. Pass "
                  "persistent_workers=True to the DataLoader and keep that DataLoader for every epoch, or give the "
                  "cache a disk tier (cache=ChunkCache(disk=...)), which workers share (warned once)")
        return True

    def _disk_key(self, key: Hashable, disk_key: str | None) -> str | None:
        """The disk tier's key for an entry, None without a disk tier (or without a key it can use)."""
        if self.disk is None:
            return None
        if disk_key is not None:
            return disk_key
        return key if isinstance(key, str) else None

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            if key in self._mem:
                return True
        return self._disk is not None and isinstance(key, str) and self._disk.holds(key)

    def clear(self) -> None:
        """Empty both tiers: the memory tier of this process and every entry of the disk directory
        (other processes' memory tiers keep theirs)."""
        self._after_fork()
        with self._lock:
            self._mem.clear()
            self._rows.clear()
            self._born.clear()
            self._slabs.clear()  # new slabs from now on: buffers may still gather from the old ones
            self._stats.memory_bytes = self._stats.memory_entries = 0
        if self._disk is not None:
            self._disk.clear()

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the counters (hits, misses, bytes held ...) of this process."""
        with self._lock:
            got = CacheStats(**asdict(self._stats))
        if self._disk is not None:  # the disk tier's own counts
            for k, v in asdict(self._disk.counts).items():
                setattr(got, k, v)
        return got

    @property
    def disk_limit(self) -> int | None:
        """The disk tier's bound now: ``disk_size``, or what the free space allows (None without a disk tier)."""
        return None if self._disk is None else self._disk.limit()

    def summary(self) -> str:
        """One line for a generator's repr: each tier's budget and fill, e.g.
        ``"memory 120.3 MB of 5.6 GB (153 chunks), disk off"``."""
        mem, disk = self._tiers(" ", "not scanned yet")
        out = f"{mem}, disk off" if disk is None else f"{mem}, disk {self.disk} {disk}"
        return out + self._device_words(" ")

    def __repr__(self) -> str:
        mem, disk = self._tiers("=", "not scanned")
        out = f"ChunkCache({mem}, disk=off" if disk is None else f"ChunkCache({mem}, disk={self.disk!r} {disk}"
        return out + self._device_words("=") + ")"

    def _device_words(self, sep: str) -> str:
        """The tier in GPU memory, as ``summary`` and the repr say it ("" where none was asked for)."""
        if self._device is not None:
            return ", " + self._device.summary().replace("device ", f"device{sep}", 1)
        return f", device{sep}{_fmt(self.device_budget)} (not used yet)" if self.device_budget else ""

    def note_device_unused(self, what: str, why: str) -> None:
        """Say once that the tier in GPU memory keeps nothing of ``what``, and why."""
        self._say("device unused " + why, f"device tier: keeps nothing of {what}: {why}",
                  f"the chunk cache's GPU tier (ChunkCache(device=...)) keeps nothing of {what}: {why}")

    def _tiers(self, sep: str, unscanned: str) -> tuple[str, str | None]:
        """The memory tier's fill and the disk tier's (None: no disk tier), as ``summary`` and the repr say them."""
        s = self.stats
        mem = (f"memory{sep}{_fmt(s.memory_bytes)} of {_fmt(self.memory_budget)} ({s.memory_entries} chunks)"
               if self.memory_budget else f"memory{sep}off")
        if self.disk is None:
            return mem, None
        scanned = self._disk is not None and self._disk.scanned
        if self.disk_size is not None:
            return mem, f"{_fmt(s.disk_bytes) if scanned else unscanned} of {_fmt(self.disk_size)}"
        # no size given: as much as leaves the file system its reserve free (``disk_tier``)
        return mem, (f"{_fmt(s.disk_bytes)} used" if scanned else unscanned) + ", bounded by the free space"

    # ------------------------------------------------------------------ memory tier
    def _keep(self, key: Hashable, arr: np.ndarray, born: int | None = None,
              version: str | None = None) -> np.ndarray | None:
        """Copy ``arr`` into a free row of a slab where the budget has room (else None); nothing is
        evicted. The row is taken under the lock and filled outside it; the key is published once
        the row holds the chunk."""
        with self._lock:
            if key in self._mem:
                return self._mem[key]
            place = self._reserve(arr)
        if place is None:
            return None
        slab, row = place
        slab[row] = arr
        view = slab[row]
        view.flags.writeable = False
        with self._lock:
            if key in self._mem:  # another thread kept it meanwhile: this row stays unused
                return self._mem[key]
            self._mem[key] = view
            self._rows[key] = place
            self._born[key] = (file_clock_ns() if born is None else born, version)
            self._stats.memory_entries += 1
        return view

    def kept_before(self, keys: list[Hashable], since: int) -> list[tuple[int, int, str | None]]:
        """``(position in keys, since when it is known to match its source, its remote object's version)``
        of the memory tier's entries among ``keys`` not known to match since ``since`` (kept by a reader
        that started before): what a new reader of a mutable archive checks once (``cache.lookup``)."""
        born, never = self._born, (since, None)
        with self._lock:
            return [(i, *b) for i, k in enumerate(keys) if (b := born.get(k, never))[0] < since]

    def recheck(self, keys: list[Hashable], changed: list[bool], since: int) -> None:
        """After ``kept_before``: drop the entries whose source changed (their rows stay unused, counted
        against the budget, as long as their slab lives: a batch may still gather from them), and mark
        the others as matching since ``since``."""
        with self._lock:
            for k, gone in zip(keys, changed, strict=True):
                if k not in self._mem:
                    continue
                if gone:
                    del self._mem[k], self._rows[k], self._born[k]
                    self._stats.memory_entries -= 1
                else:
                    b, v = self._born[k]
                    self._born[k] = (max(b, since), v)

    def _reserve(self, arr: np.ndarray) -> tuple[np.ndarray, int] | None:
        """A free row for a chunk like ``arr`` (the lock is held), counted against the budget; None
        where the budget has no room. A new slab holds as many rows as the rest of the budget: its
        pages are only backed once written, so its size costs address space, not memory."""
        n = arr.nbytes
        if self._stats.memory_bytes + n > self.memory_budget:
            return None
        cls = (arr.shape, arr.dtype.str)
        got = self._slabs.get(cls)
        if got is None or got[1] >= len(got[0]):
            rows = max(1, (self.memory_budget - self._stats.memory_bytes) // max(n, 1))
            while True:
                try:
                    got = [np.empty((rows, *arr.shape), arr.dtype), 0]
                    break
                except MemoryError:  # no address space that large (strict overcommit): smaller slabs
                    if rows == 1:
                        return None
                    rows = max(1, rows // 4)
            self._slabs[cls] = got
        slab, row = got[0], got[1]
        got[1] += 1
        self._stats.memory_bytes += n
        return slab, row


def _flag(name: str, value: Any) -> bool:
    """``value`` as a bool where it is one (numpy's too); ``TypeError`` naming ``name`` for anything else
    (``"false"`` would be true)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {type(value).__name__}: {value!r}")



def resolve_cache(cache: bool | str | os.PathLike[str] | ChunkCache | None) -> ChunkCache | None:
    """The ``ChunkCache`` a ``cache=`` argument asks for.

    Parameters
    ----------
    cache
        None or False: no cache. True or ``"memory"``: a memory tier with the default budget.
        A directory (str or path): a memory tier and a disk tier there. A ``ChunkCache``: itself.

    Returns
    -------
    ChunkCache or None

    Raises
    ------
    TypeError
        For any other kind of value.
    ValueError
        For an empty string or a path that is a file.
    """
    if cache is None or cache is False:
        return None
    if cache is True:
        return ChunkCache()
    if isinstance(cache, ChunkCache):
        return cache
    if isinstance(cache, str) and cache == "memory":  # a Path("memory") is a directory of that name
        return ChunkCache()
    if (isinstance(cache, str) and "/" not in cache and os.sep not in cache and not os.path.exists(cache)
            and difflib.get_close_matches(cache.lower(), ["memory"], cutoff=0.7)):  # a typo of "memory"
        raise ValueError(f"cache={cache!r}: did you mean 'memory'? (a directory makes a disk cache there: "
                         f"name it ./{cache} to mean that)")
    if isinstance(cache, (str, os.PathLike)):
        path = os.fspath(cache)
        if isinstance(path, bytes):
            raise TypeError("cache= as a path must be a str or os.PathLike of str, not bytes")
        if not path.strip():
            raise ValueError("cache='' is not a directory; pass cache=True for a memory cache, or a directory")
        if os.path.exists(os.path.expanduser(path)) and not os.path.isdir(os.path.expanduser(path)):
            raise ValueError(f"cache={path!r} is a file, not a directory for the disk cache")
        try:
            return ChunkCache(disk=path)
        except ValueError as e:
            raise ValueError(f"cache={path!r}: {e}") from e
    raise TypeError(f"cache= must be None, a bool, 'memory', a directory or an xinsitu.ChunkCache, "
                    f"not {type(cache).__name__}")
