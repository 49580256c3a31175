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
both; see ``docs/how-to/cache.md``). Each entry is one file, written to a temporary name in
the same directory and renamed into place, so a reader never sees a partial entry, even
after ``kill -9`` mid-write; a header (length, dtype, shape, checksum) catches the rest
(a torn write after a power loss, a truncated copy), and a bad entry is a miss and is
deleted.

The disk tier trusts no one else: a directory another user owns or can write (unless sticky)
is refused, its own directories are 0700 and entries 0600, entries are reached from an open
descriptor without following any link, a special file is a miss, and only files named as the
cache names them are ever deleted. What it cannot read or write is counted
(``CacheStats.disk_errors``) and warned of once.
"""

from __future__ import annotations

import difflib
import errno
import functools
import itertools
import json
import os
import re
import stat
import struct
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from xinsitu.cache.budget import _fmt, auto_memory_budget, parse_size
from xinsitu.cache.keys import ChunkKey, trusted, why_not
from xinsitu.io.mempool import page_aligned

#: ``disk_size=None``: the disk tier grows while the file system keeps this share free ...
DISK_FREE_SHARE = 0.10
#: ... and at least this many bytes
DISK_FREE_MIN = 2**30
#: when over its size, the disk tier evicts down to this share of it (so it does not evict at every put)
DISK_LOW_WATER = 0.9
#: the disk tier rescans its directory after this process wrote this share of its size (other processes write too)
DISK_RESCAN_SHARE = 0.1
#: a full disk tier (every entry used during this run) is scanned again for room at most this often
FULL_RESCAN_S = 5.0
#: temporary files older than this are left over by a killed writer and are deleted by a scan
STALE_TMP_S = 600.0

_SUBDIR = "xinsitu-chunks-v1"  # the format version: another format never reads these files
_SUFFIX = ".chunk"
_TMP = ".tmp"
_MAGIC = b"XICC"
_VERSION = 1
# magic, version, checksum kind, length of the JSON metadata, payload length, checksum of metadata + payload
_HEADER = struct.Struct("<4sBBIQQ")
_CRC32, _CRC32C = 0, 1
_ALIGN = 64  # the payload's offset in an entry file (aligned, should a reader ever map the file)
_PEEK = 4096  # the first read of an entry: header and metadata (well under this) and the payload's start
_HEX = re.compile(r"[0-9a-f]{8,128}")
_SHARD = re.compile(r"[0-9a-f]{2}")
_ENTRY = re.compile(r"[0-9a-f]{8,128}\.chunk")
_TMP_NAME = re.compile(r"\.[0-9a-f]{8,128}\.[0-9]+\.[0-9]+\.[0-9]+\.tmp")
_O_DIRECTORY, _O_NOFOLLOW = getattr(os, "O_DIRECTORY", 0), getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC, _O_NONBLOCK = getattr(os, "O_CLOEXEC", 0), getattr(os, "O_NONBLOCK", 0)
_DIR_FLAGS = os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC


@functools.cache
def _checksummer() -> tuple[int, Callable[[Any, int], int]]:
    """The fastest checksum at hand: hardware CRC-32C (google-crc32c, which zarr installs), else zlib's CRC-32."""
    try:
        import google_crc32c

        return _CRC32C, lambda data, crc: int(google_crc32c.extend(crc, data))
    except ImportError:
        return _CRC32, lambda data, crc: zlib.crc32(data, crc)


def _checksum_of(kind: int) -> Callable[[Any, int], int] | None:
    """The function for checksum ``kind`` (None where this process cannot compute it: the entry is a miss)."""
    own, fn = _checksummer()
    if kind == own:
        return fn
    if kind == _CRC32:
        return lambda data, crc: zlib.crc32(data, crc)
    return None


# --------------------------------------------------------------------------------------------- cache
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
        self._evicting = threading.Lock()
        self._pid = os.getpid()
        self._mem: dict[Hashable, np.ndarray] = {}  # key -> the chunk (a read-only row of a slab)
        self._rows: dict[Hashable, tuple[np.ndarray, int]] = {}  # key -> (slab, row)
        # key -> (since when, time.time_ns(), the entry is known to match its source; the version of its
        # remote object where that was known when it was kept) (``kept_before``)
        self._born: dict[Hashable, tuple[int, str | None]] = {}
        self._slabs: dict[tuple[tuple[int, ...], str], list[Any]] = {}  # (shape, dtype) -> [slab, rows used]
        self._stats = CacheStats()
        self._device: Any = None  # the tier in GPU memory, made on first use (``device_tier``)
        self._tmp_ids = itertools.count()
        self._scanned = False
        self._written_since_scan = 0
        self._full_since = -float("inf")  # when a put last found the disk tier full (time.monotonic)
        self._checksum_kind, self._checksum = _checksummer()
        self._warned = False
        self._notes: dict[str, str] = {}  # what a tier could not keep, said once each (``notes``)
        self._top = -1  # a descriptor of <disk>/xinsitu-chunks-v1: entries are reached from it, never by path
        self._shard_fds: dict[str, int] = {}  # shard directory -> its descriptor (``_shard``)
        self._uid = os.geteuid()
        if self.disk is not None:
            self._top = _open_disk(self.disk)
            weakref.finalize(self, _close_all, self._top, self._shard_fds)

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
            self._evicting = threading.Lock()
            self._pid = os.getpid()

    # ------------------------------------------------------------------ public
    def get(self, key: Hashable, disk_key: str | None = None) -> np.ndarray | None:
        """The chunk stored under ``key`` (read-only, not a copy), or None.

        Looks in memory, then on disk (under ``disk_key``, or ``key`` where it is a string from
        ``ChunkKey.key``); a disk hit is kept in memory where it fits.
        """
        arr = self.peek(key)
        if arr is not None:
            return arr
        dk = self._disk_key(key, disk_key)
        if dk is not None:
            arr = self._disk_get(dk)
            if arr is not None:
                with self._lock:
                    self._stats.disk_hits += 1
                kept = self._keep(key, arr)
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
            self._path(dk)  # a key that cannot name a file is refused before either tier keeps it
        arr = np.asarray(array)
        with self._lock:
            self._stats.puts += 1
            known = key in self._mem
        if not known:
            self._keep(key, arr, born, version)
        if dk is not None and not known:
            try:
                self._disk_put(dk, arr)
            except OSError as e:  # a scan or the free space that failed (the directory gone?): counted, warned
                self._disk_error(e, "keep a chunk")

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
        if n:
            with self._lock:
                self._stats.version_requests += n
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

    def _say(self, key: str, note: str, message: str) -> None:
        """Note ``note`` (``notes``) and warn ``message``, once per ``key``."""
        with self._lock:
            if key in self._notes:
                return
            self._notes[key] = note
        warnings.warn(message, RuntimeWarning, stacklevel=3)

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
                  f"the chunk cache keeps nothing of {what}: its store ({kind}) has no identity that lasts "
                  f"({why}), so its chunks are read every epoch (warned once)")

    def note_read_by_zarr(self, what: str, kind: str) -> None:
        """Say once that ``what`` (a sharded variable whose store, of ``kind``, xinsitu does not read by byte
        range: zarr reads its inner chunks) is not cached."""
        self._say(f"uncached shards {kind}", f"not cached: {what} (a sharded array its store, {kind}, gives to "
                  "zarr to read)", f"the chunk cache keeps nothing of {what}: it is sharded, and zarr reads its "
                  f"inner chunks from its store ({kind}; xinsitu reads shards by byte range from local paths and "
                  "xinsitu.open_zarr URLs), so they are read every epoch (warned once)")

    def note_read_through_dask(self, what: str) -> None:
        """Say once that ``what`` (a variable read through dask: NetCDF or GRIB files opened by xarray) is
        not cached: its chunks have no keys the cache could check against the files."""
        self._say("uncached dask", f"not cached: {what} (read through dask; only Zarr and Icechunk archives are "
                  "cached: ds.to_zarr(...) makes one)",
                  f"the chunk cache keeps nothing of {what}: it is read through dask (files opened by "
                  "xr.open_dataset or open_mfdataset with chunks=), whose chunks the cache has no key for, so they "
                  "are read every epoch. xinsitu.virtual.open_netcdf / open_grib read the same files in place "
                  "without dask, but their chunks are not cached either; to cache them, copy the data to Zarr "
                  "(ds.to_zarr) and train from that (warned once)")

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
        if self.disk is None or not isinstance(key, str):
            return False
        self._path(key)
        try:
            sfd = self._shard(key[:2], create=False)
        except OSError:
            return False
        if sfd is None:
            return False
        try:
            return stat.S_ISREG(os.stat(key + _SUFFIX, dir_fd=sfd, follow_symlinks=False).st_mode)
        except OSError:
            return False

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
        if self.disk is None:
            return
        with self._evicting:  # only files this cache writes (their names say so): nothing else is deleted
            for _, _, shard, name in self._entries(include_tmp=True):
                self._unlink(shard, name)
            with self._lock:
                self._stats.disk_bytes = 0
                self._written_since_scan = 0
                self._scanned = True

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the counters (hits, misses, bytes held ...) of this process."""
        with self._lock:
            return CacheStats(**asdict(self._stats))

    @property
    def disk_limit(self) -> int | None:
        """The disk tier's bound now: ``disk_size``, or what the free space allows (None without a disk tier)."""
        if self.disk is None:
            return None
        if self.disk_size is not None:
            return self.disk_size
        st = os.statvfs(self.disk)
        total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        keep = max(DISK_FREE_SHARE * total, DISK_FREE_MIN)
        with self._lock:
            used = self._stats.disk_bytes
        return int(max(0, used + free - keep))

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
        bound = _fmt(self.disk_size) if self.disk_size is not None else "free space"
        used = _fmt(s.disk_bytes) if self._scanned else unscanned
        return mem, f"{used} of {bound}"

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
            self._born[key] = (time.time_ns() if born is None else born, version)
            self._stats.memory_entries += 1
        return view

    def kept_before(self, keys: list[Hashable], since: int) -> list[tuple[int, int, str | None]]:
        """``(position in keys, since when it is known to match its source, its remote object's version)``
        of the memory tier's entries among ``keys`` not known to match since ``since`` (kept by a reader
        that started before): what a new reader of a mutable archive checks once (``cache.lookup``)."""
        born, never = self._born, (since, None)
        with self._lock:
            return [(i, *b) for i, k in enumerate(keys) if (b := born.get(k, never))[0] < since]

    def recheck(self, keys: list[Hashable], changed: list[bool], since: int, requests: int = 0) -> None:
        """After ``kept_before``: drop the entries whose source changed (their rows stay unused, counted
        against the budget, as long as their slab lives: a batch may still gather from them), and mark
        the others as matching since ``since``; ``requests`` asked the store for versions to tell."""
        with self._lock:
            self._stats.version_requests += requests
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

    # ------------------------------------------------------------------ disk tier
    def _path(self, key: str) -> str:
        assert self.disk is not None
        if not _HEX.fullmatch(key):  # it becomes a file name: nothing else may reach the file system
            raise ValueError(f"a disk cache key is a hex digest (ChunkKey.key), not {key!r}")
        return os.path.join(self.disk, _SUBDIR, key[:2], key + _SUFFIX)

    def _shard(self, name: str, create: bool) -> int | None:
        """A descriptor of shard directory ``name``, reached from the tier's own descriptor without
        following a link, made (0700) where ``create``, and kept open for the cache's life (the
        cache's, not the caller's to close: a lookup then costs one ``open``); None where it is not
        there. Raises ``OSError`` for a link, a file, or a directory of another user."""
        fd = self._shard_fds.get(name)
        if fd is not None:
            return fd
        fd = _open_dir(self._top, name, create)
        if fd is None:
            return None
        with self._lock:
            kept = self._shard_fds.setdefault(name, fd)
        if kept != fd:  # another thread opened it meanwhile
            os.close(fd)
        return kept

    def _unlink(self, shard: str, name: str) -> bool:
        """Delete entry (or temporary file) ``name`` of shard ``shard``; False where it is gone already."""
        try:
            sfd = self._shard(shard, create=False)
        except OSError:
            return False
        return sfd is not None and _unlink(name, sfd)

    def _disk_error(self, e: BaseException, doing: str) -> None:
        """Count a failure of the disk tier (``stats.disk_errors``) and warn of the first one: the chunk
        is read from the store instead, never a failed read, never silent."""
        with self._lock:
            self._stats.disk_errors += 1
            first, self._warned = not self._warned, True
            if first:
                self._notes.setdefault("errors", f"disk tier failed to {doing}: {type(e).__name__}: {e} "
                                                 "(such chunks are read from the store; stats.disk_errors)")
        if first:
            warnings.warn(f"the chunk cache's disk tier {self.disk!r} failed to {doing}: {type(e).__name__}: {e}; "
                          "such chunks are read from the store (cache.stats.disk_errors counts them; warned once)",
                          RuntimeWarning, stacklevel=3)

    def _disk_get(self, key: str) -> np.ndarray | None:
        self._path(key)  # a key that cannot name a file is refused
        name = key + _SUFFIX
        try:
            sfd = self._shard(key[:2], create=False)
        except OSError as e:
            self._disk_error(e, f"open its directory {key[:2]!r}")
            return None
        if sfd is None:  # not cached
            return None
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=sfd)  # a FIFO opens at once (O_NONBLOCK), a link not at all
        except OSError:  # FileNotFoundError above all: not cached, or evicted meanwhile
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != self._uid:
                return None  # a special file (FIFO, device) or another user's file: a miss, left alone
            with open(fd, "rb", buffering=0, closefd=False) as f:  # unbuffered: straight into the array
                got = self._read_entry(f, key, st)
            if got is not None and got[1] < self._since_ns:  # mark it used during this run (eviction order)
                try:
                    os.utime(fd)
                except OSError:
                    pass
        except OSError:
            got = None
        finally:
            os.close(fd)
        if got is None:  # a bad entry: never served, and deleted so that it is written again
            with self._lock:
                self._stats.corrupt += 1
            _unlink(name, sfd)
            return None
        arr = got[0]
        arr.flags.writeable = False
        return arr

    @staticmethod
    def _read_entry(f: Any, key: str, st: os.stat_result | None = None) -> tuple[np.ndarray, int] | None:
        """(the chunk, its last use time) of an open entry file, or None where anything in it is wrong.

        A small first read (header, metadata, the payload's start), then the rest straight into
        the chunk's array: from a device, the small read starts the kernel's readahead and the
        whole took 0.6 ms for a 786 kB entry, one large read 1.1 ms (a 2-core VM, virtio disk).
        """
        st = os.fstat(f.fileno()) if st is None else st  # (the caller's, where it has one)
        first = f.read(_PEEK)
        if len(first) < _HEADER.size:
            return None
        magic, version, kind, meta_len, payload_len, checksum = _HEADER.unpack_from(first)
        meta_end = _HEADER.size + meta_len
        if magic != _MAGIC or version != _VERSION or st.st_size != meta_end + payload_len:
            return None
        fn = _checksum_of(kind)
        if fn is None:
            return None
        if meta_end > len(first):  # a long dtype description: the rest of the metadata
            first += f.read(meta_end - len(first))
            if meta_end > len(first):
                return None
        meta_raw = first[_HEADER.size:meta_end]
        layout, _, own = meta_raw.rstrip(b" ").rpartition(b"\n")
        got = _layout(layout)
        if got is None or own != key.encode() or got[2] != payload_len:
            return None
        dtype, shape, _ = got
        pos = min(len(first) - meta_end, payload_len)
        # the rest of the payload is read from a page boundary of the file (the first read took a page)
        # into a page boundary (``page_aligned``: 11-14 GB/s against 1.5 into an np.empty's memory); an
        # array, not a memoryview: google-crc32c takes only these
        flat = page_aligned(payload_len, at=pos if pos < payload_len else 0)
        arr = flat.view(dtype).reshape(shape)
        flat[:pos] = np.frombuffer(first, np.uint8, pos, meta_end)
        while pos < payload_len:
            n = f.readinto(flat[pos:].data)
            if not n:
                return None  # shorter than it was a moment ago: cut meanwhile
            pos += n
        if fn(flat, fn(meta_raw, 0)) != checksum:
            return None
        return arr, st.st_mtime_ns

    def _disk_put(self, key: str, arr: np.ndarray) -> None:
        data = np.ascontiguousarray(arr)
        # the layout (the same for every chunk of an array: parsed once per process), then the key
        meta = json.dumps({"dtype": np.lib.format.dtype_to_descr(data.dtype), "shape": list(data.shape)},
                          separators=(",", ":")).encode() + b"\n" + key.encode()
        meta += b" " * (-(_HEADER.size + len(meta)) % _ALIGN)
        if not self._disk_room(_HEADER.size + len(meta) + data.nbytes):
            return
        payload = data.reshape(-1).view(np.uint8)
        checksum = self._checksum(payload, self._checksum(meta, 0))
        head = _HEADER.pack(_MAGIC, _VERSION, self._checksum_kind, len(meta), payload.nbytes, checksum)
        self._path(key)
        tmp = f".{key}.{os.getpid()}.{threading.get_ident()}.{next(self._tmp_ids)}{_TMP}"
        try:
            sfd = self._shard(key[:2], create=True)
            assert sfd is not None
        except OSError as e:
            self._disk_error(e, f"open its directory {key[:2]!r}")
            return
        try:
            fd = os.open(tmp, _WRITE_FLAGS, 0o600, dir_fd=sfd)
            with open(fd, "wb") as f:
                os.fchmod(fd, 0o600)  # whatever the umask: the chunks are as private as the cache
                f.write(head)
                f.write(meta)
                f.write(payload.data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            # atomic: readers see the old entry, the new one, or none
            os.replace(tmp, key + _SUFFIX, src_dir_fd=sfd, dst_dir_fd=sfd)
        except OSError as e:
            _unlink(tmp, sfd)
            self._disk_error(e, f"write entry {key!r}")
            return
        n = len(head) + len(meta) + payload.nbytes
        with self._lock:
            self._stats.disk_writes += 1
            self._stats.disk_bytes += n
            self._written_since_scan += n
        self._maybe_evict()

    def _disk_room(self, n: int) -> bool:
        """Whether an entry of ``n`` bytes may be written: the tier has room, or gets it by evicting
        entries not used during this run. A full tier is scanned again at most every ``FULL_RESCAN_S``."""
        if not self._scanned:
            self._maybe_evict()  # the first put of this process: learn what the directory holds
        limit = self.disk_limit
        assert limit is not None
        with self._lock:
            fits = self._stats.disk_bytes + n <= limit
            recheck = time.monotonic() - self._full_since >= FULL_RESCAN_S
            if not fits and not recheck:
                self._stats.not_admitted += 1
        if not fits and not recheck:
            self._full()
        if fits or not recheck:
            return fits
        if self._evicting.acquire(blocking=False):
            try:
                self._evict(room=n)
            finally:
                self._evicting.release()
        with self._lock:
            fits = self._stats.disk_bytes + n <= limit
            # only a tier found full of entries used during this run waits before the next scan
            self._full_since = -float("inf") if fits else time.monotonic()
            if not fits:
                self._stats.not_admitted += 1
        if not fits:
            self._full()
        return fits

    def _full(self) -> None:
        """Say once that the disk tier turned a chunk away: full of entries used during this run."""
        bound = f"disk_size={_fmt(self.disk_size)}" if self.disk_size is not None else "the free space it may use"
        self._say("full", f"disk tier full ({bound}): chunks past it are not kept (stats.not_admitted)",
                  f"the chunk cache's disk tier {self.disk!r} is full ({bound}) of chunks used during this run; "
                  "chunks past it are not kept on disk (cache.stats.not_admitted counts them; a larger "
                  "disk_size keeps more) (warned once)")

    def _maybe_evict(self) -> None:
        """Rescan and evict when this process's count says the tier is over its bound, or when it has
        written enough since the last scan that other processes' writes may have filled it."""
        limit = self.disk_limit
        assert limit is not None
        with self._lock:
            due = (not self._scanned or self._stats.disk_bytes > limit
                   or self._written_since_scan > DISK_RESCAN_SHARE * max(limit, 1))
        if not due or not self._evicting.acquire(blocking=False):  # one thread of a process scans at a time
            return
        try:
            self._evict()
        finally:
            self._evicting.release()

    def _evict(self, room: int = 0) -> None:
        entries = self._entries(include_tmp=False)
        used = sum(e[1] for e in entries)
        with self._lock:
            self._stats.disk_bytes = used
            self._written_since_scan = 0
            self._scanned = True
        limit = self.disk_limit
        assert limit is not None
        if used + room <= limit:
            return
        target = DISK_LOW_WATER * limit - room
        evicted = 0
        for mtime_ns, size, shard, name in sorted(entries):
            if used <= target or mtime_ns >= self._since_ns:
                break  # what is left was used during this run: kept (pinned)
            if self._unlink(shard, name):
                evicted += 1
            used -= size  # gone either way: another process may have evicted it first
        with self._lock:
            self._stats.disk_bytes = used
            self._stats.disk_evictions += evicted

    def _entries(self, include_tmp: bool) -> list[tuple[int, int, str, str]]:
        """(use time, size, shard, name) of every entry; temporary files left by killed writers are deleted
        (or listed, with ``include_tmp``) and count towards the size while they are young. Only regular
        files named as this cache names them count (and are ever deleted); links are not followed."""
        out: list[tuple[int, int, str, str]] = []
        stale = time.time_ns() - int(STALE_TMP_S * 1e9)
        top = os.open(".", _DIR_FLAGS, dir_fd=self._top)  # its own offset: processes forked from this one scan too
        try:
            shards = [d.name for d in os.scandir(top) if _SHARD.fullmatch(d.name) and d.is_dir(follow_symlinks=False)]
        finally:
            os.close(top)
        for shard in shards:
            try:
                sfd = self._shard(shard, create=False)
                if sfd is None:
                    continue
            except OSError as e:
                self._disk_error(e, f"open its directory {shard!r}")
                continue
            # a new descriptor, with its own offset (processes forked from this one share the kept one), open
            # while the entries are stat'ed (they name their directory by it)
            own = -1
            try:
                own = os.open(".", _DIR_FLAGS, dir_fd=sfd)
                it = list(os.scandir(own))
            except OSError as err:  # unreadable (permissions): counted and warned, the other shards still serve
                self._disk_error(err, f"list its directory {shard!r}")
                it = []
            try:
                self._scan_shard(shard, sfd, it, include_tmp, stale, out)
            finally:
                if own >= 0:
                    os.close(own)
        return out

    def _scan_shard(self, shard: str, sfd: int, it: list[os.DirEntry], include_tmp: bool, stale: int,
                    out: list[tuple[int, int, str, str]]) -> None:
        """``_entries`` of one shard directory (``sfd``) whose entries are ``it``."""
        for ent in it:
            try:
                st = ent.stat(follow_symlinks=False)
            except FileNotFoundError:  # evicted or renamed meanwhile by another process
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if _TMP_NAME.fullmatch(ent.name) and ent.name[1:3] == shard:
                if include_tmp:
                    out.append((st.st_mtime_ns, st.st_size, shard, ent.name))
                elif st.st_mtime_ns < stale:
                    _unlink(ent.name, sfd)
                else:  # a write under way: never evicted
                    out.append((self._since_ns, st.st_size, shard, ent.name))
            elif _ENTRY.fullmatch(ent.name) and ent.name[:2] == shard:
                out.append((st.st_mtime_ns, st.st_size, shard, ent.name))


@functools.lru_cache(maxsize=1024)
def _layout(raw: bytes) -> tuple[np.dtype, tuple[int, ...], int] | None:
    """(dtype, shape, bytes) from an entry's layout JSON; None where it is not one."""
    try:
        meta = json.loads(raw)
        dtype = np.lib.format.descr_to_dtype(meta["dtype"])
        shape = tuple(int(n) for n in meta["shape"])
    except (ValueError, KeyError, TypeError):
        return None
    if dtype.hasobject or any(n < 0 for n in shape):
        return None
    return dtype, shape, int(np.prod(shape)) * dtype.itemsize


def _close_all(top: int, shards: dict[str, int]) -> None:
    """Close a disk tier's descriptors (its cache is gone)."""
    for fd in [top, *shards.values()]:
        try:
            os.close(fd)
        except OSError:
            pass


def _unlink(name: str, dir_fd: int) -> bool:
    """Delete ``name`` of directory ``dir_fd`` (a link itself, never its target); False where it is gone
    already (another process evicted it)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False


def _untrusted(st: os.stat_result, own: bool) -> str | None:
    """Why a directory cannot hold the cache's entries (another user could plant or read them), or None.
    ``own``: it must be this user's (the cache's own directories); else root's will do, and a
    directory others can write is fine where it is sticky (such as /tmp)."""
    me = os.geteuid()
    if st.st_uid != me and (own or st.st_uid != 0):
        return f"is owned by another user (uid {st.st_uid})"
    others = st.st_mode & (0o002 if not own and _private_group(st.st_gid) else 0o022)
    if others and (own or not st.st_mode & stat.S_ISVTX):
        return f"can be written by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _private_group(gid: int) -> bool:
    """Whether group ``gid`` is this user's alone (a user private group, as a umask of 002 gives each
    user's directories): no other user has it, as a member or as their primary group."""
    try:
        import grp
        import pwd

        me = pwd.getpwuid(os.geteuid()).pw_name
        if gid != os.getegid() or set(grp.getgrgid(gid).gr_mem) - {me}:
            return False
        return all(u.pw_name == me for u in pwd.getpwall() if u.pw_gid == gid)
    except (ImportError, KeyError, OSError):
        return False


def _open_dir(parent: int, name: str, create: bool) -> int | None:
    """A descriptor of directory ``name`` under ``parent``, without following a link, checked to be this
    user's and made private (0700, whatever the umask); made where ``create`` (else None where it is
    not there). Raises ``OSError`` for a link, a file or another user's directory."""
    try:
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                return None
            try:
                os.mkdir(name, 0o700, dir_fd=parent)
            except FileExistsError:  # another process made it meanwhile
                pass
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(os.lstat(name, dir_fd=parent).st_mode):
            raise PermissionError(f"{name!r} is a symbolic link (never followed)") from e
        raise
    try:
        st = os.fstat(fd)
        why = _untrusted(st, own=True) if st.st_uid != os.geteuid() else None
        if why is not None:
            raise PermissionError(f"{name!r} {why}")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)  # this user's: made private (a cache of an older version, a umask)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make_private_dirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, with every folder it makes private (0700) whatever the umask:
    ``os.makedirs`` gives the parents it makes the umask's mode (0777 under a umask of 000)."""
    made: list[str] = []
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        made.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(made):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:  # another process made it meanwhile: theirs, left as it is
            continue
        os.chmod(d, 0o700)  # the umask may have taken bits away: this user's, private


def _disk_path(disk: Any) -> str:
    """``disk=`` as an absolute path (``~`` expanded); ``TypeError``/``ValueError`` naming ``disk`` for what is none."""
    if isinstance(disk, bytes) or not isinstance(disk, (str, os.PathLike)):
        raise TypeError(f"disk must be a directory (a str or os.PathLike), got {type(disk).__name__}: {disk!r}")
    path = os.fspath(disk)
    if not isinstance(path, str):
        raise TypeError(f"disk must be a path of str, not {type(path).__name__}")
    if not path.strip():
        raise ValueError("disk='' is not a directory; give the disk tier a directory (or disk=None for none)")
    if "\0" in path:
        raise ValueError(f"disk={path!r} holds a NUL character: not a path")
    return os.path.abspath(os.path.expanduser(path))  # "~/c" is the home's, not a folder named "~"


def _flag(name: str, value: Any) -> bool:
    """``value`` as a bool where it is one (numpy's too); ``TypeError`` naming ``name`` for anything else
    (``"false"`` would be true)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {type(value).__name__}: {value!r}")


def _open_disk(disk: str) -> int:
    """A descriptor of ``<disk>/xinsitu-chunks-v1`` (made, private), after checking that no other user can
    plant entries there or read them. Raises ``ValueError`` naming the directory where it cannot be used."""
    try:
        _make_private_dirs(disk)
        link = os.lstat(disk)
        root = os.open(disk, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"cannot use {disk!r} as the cache's disk tier: {e}") from e
    try:
        why = _untrusted(os.fstat(root), own=False)
        if why is None and stat.S_ISLNK(link.st_mode) and link.st_uid not in (os.geteuid(), 0):
            why = f"is a symbolic link of another user (uid {link.st_uid})"
        if why is not None:
            raise ValueError(f"refusing {disk!r} as the cache's disk tier: it {why}, who could plant entries; "
                             "use a directory of your own that only you can write")
        try:
            return _open_dir(root, _SUBDIR, create=True)  # type: ignore[return-value]
        except OSError as e:
            need = ("made in a directory you can write" if e.errno in (errno.EACCES, errno.EROFS)
                    else "a directory of your own, not a link")
            raise ValueError(f"refusing {os.path.join(disk, _SUBDIR)!r} as the cache's disk tier: it must be "
                             f"{need} ({type(e).__name__}: {e})") from e
    finally:
        os.close(root)


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
