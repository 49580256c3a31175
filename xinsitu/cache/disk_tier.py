"""The disk tier of a ``ChunkCache``: decoded chunks in files of a local directory, which persist across
runs and are shared by the processes of one machine.

Each entry is one file, written to a temporary name in the same directory and renamed into place, so a
reader never sees a partial entry, even after ``kill -9`` mid-write; a header (length, dtype, shape,
checksum) catches the rest (a torn write after a power loss, a truncated copy), and a bad entry is a miss
and is deleted. The tier evicts the least recently used entries not used during this run (the run began
when its cache was made); where every entry was used since, it admits nothing more.

The tier trusts no one else: a directory another user owns or can write (unless sticky) is refused, its
own directories are 0700 and entries 0600, entries are reached from an open descriptor without following
any link, a special file is a miss, and only files named as the tier names them are ever deleted. What it
cannot read or write is counted (``DiskCounts.disk_errors``) and said once.
"""

from __future__ import annotations

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
import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from xinsitu.cache.budget import _fmt
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



@dataclass
class DiskCounts:
    """What a ``DiskTier`` did in this process (``ChunkCache.stats`` shows them)."""

    disk_writes: int = 0
    disk_bytes: int = 0  # the directory's size at the last scan plus this process's writes since
    disk_evictions: int = 0
    corrupt: int = 0  # bad entries found (a miss, and deleted)
    disk_errors: int = 0  # writes that failed (disk full, permissions): the chunk is simply not kept
    not_admitted: int = 0  # puts the full tier turned away (everything in it was used during this run)


class DiskTier:
    """Decoded chunks in files under ``<root>/xinsitu-chunks-v1/``, within ``size`` bytes (None: while the
    file system keeps ``DISK_FREE_SHARE`` free), each entry named by its key (a hex digest).

    ``since_ns``: when the run began (entries used since are not evicted); ``say(key, note, message)``:
    the owner's way to note and warn once (a full or failing tier). Thread-safe; processes of one
    machine may share the directory. Raises ``ValueError`` where ``root`` cannot be used (another user's,
    writable by others).
    """

    def __init__(self, root: str, size: int | None, *, fsync: bool, since_ns: int,
                 say: Callable[[str, str, str], None]):
        self.root, self.size, self.fsync, self.since_ns = root, size, fsync, since_ns
        self._say = say
        self.counts = DiskCounts()
        self._lock = threading.Lock()
        self._evicting = threading.Lock()
        self._pid = os.getpid()
        self._tmp_ids = itertools.count()
        self.scanned = False  # the directory's size is known (a scan)
        self._written_since_scan = 0  # bytes of this process's entries written since the last scan began
        self._pending = 0  # bytes of entries being written (room reserved by ``_room``)
        self._scan_writes: dict[str, int] | None = None  # entries written while ``evict`` scans: name -> bytes
        self._full_since = -float("inf")  # when a put last found the tier full (time.monotonic)
        self._checksum_kind, self._checksum = _checksummer()
        self._shard_fds: dict[str, int] = {}  # shard directory -> its descriptor (``_shard``)
        self._uid = os.geteuid()
        self._top = _open_disk(root)  # <root>/xinsitu-chunks-v1: entries are reached from it, never by path
        weakref.finalize(self, _close_all, self._top, self._shard_fds)

    def after_fork(self) -> None:
        """In a forked child: fresh locks (a parent's thread may have held one at the fork)."""
        if os.getpid() != self._pid:
            self._lock = threading.Lock()
            self._evicting = threading.Lock()
            self._pid = os.getpid()
            self._pending = 0  # the parent's writes under way are not this process's

    def limit(self) -> int:
        """The tier's bound now: ``size``, or what the free space allows."""
        if self.size is not None:
            return self.size
        st = os.statvfs(self.root)
        total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        keep = max(DISK_FREE_SHARE * total, DISK_FREE_MIN)
        with self._lock:
            used = self.counts.disk_bytes
        return int(max(0, used + free - keep))

    def holds(self, key: str) -> bool:
        """Whether an entry file of ``key`` is there (not read, not checked)."""
        self.file_of(key)
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
        """Delete every entry (and temporary file) of the directory; nothing else is touched."""
        with self._evicting:  # only files this tier writes (their names say so): nothing else is deleted
            for _, _, shard, name in self.entries(include_tmp=True):
                self._unlink(shard, name)
            with self._lock:
                self.counts.disk_bytes = 0
                self._written_since_scan = 0
                self.scanned = True

    def file_of(self, key: str) -> str:
        """The entry file of ``key`` (``ValueError`` for a key that cannot name one: a hex digest only)."""
        if not _HEX.fullmatch(key):  # it becomes a file name: nothing else may reach the file system
            raise ValueError(f"a disk cache key is a hex digest (ChunkKey.key), not {key!r}")
        return os.path.join(self.root, _SUBDIR, key[:2], key + _SUFFIX)

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

    def error(self, e: BaseException, doing: str) -> None:
        """Count a failure of the disk tier (``counts.disk_errors``) and say the first one: the chunk is
        read from the store instead, never a failed read, never silent."""
        with self._lock:
            self.counts.disk_errors += 1
        self._say("errors", f"disk tier failed to {doing}: {type(e).__name__}: {e} (such chunks are read from "
                  "the store; stats.disk_errors)",
                  f"the chunk cache's disk tier {self.root!r} failed to {doing}: {type(e).__name__}: {e}; such "
                  "chunks are read from the store (cache.stats.disk_errors counts them; warned once)")

    def get(self, key: str) -> np.ndarray | None:
        """The chunk kept under ``key`` (read-only), or None: not kept, or a bad entry (counted, deleted)."""
        self.file_of(key)  # a key that cannot name a file is refused
        name = key + _SUFFIX
        try:
            sfd = self._shard(key[:2], create=False)
        except OSError as e:
            self.error(e, f"open its directory {key[:2]!r}")
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
            if got is not None and got[1] < self.since_ns:  # mark it used during this run (eviction order)
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
                self.counts.corrupt += 1
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

    def put(self, key: str, arr: np.ndarray) -> None:
        """Write ``arr`` as the entry of ``key`` where the tier has room (else counted, said once)."""
        data = np.ascontiguousarray(arr)
        # the layout (the same for every chunk of an array: parsed once per process), then the key
        meta = json.dumps({"dtype": np.lib.format.dtype_to_descr(data.dtype), "shape": list(data.shape)},
                          separators=(",", ":")).encode() + b"\n" + key.encode()
        meta += b" " * (-(_HEADER.size + len(meta)) % _ALIGN)
        n = _HEADER.size + len(meta) + data.nbytes
        if not self._room(n):  # room reserved for it: threads writing at once cannot all pass the bound
            return
        written = False
        try:
            written = self._write(key, meta, data)
        finally:
            with self._lock:
                self._pending -= n
                if written:
                    self.counts.disk_writes += 1
                    self.counts.disk_bytes += n
                    self._written_since_scan += n
                    if self._scan_writes is not None:  # a scan under way may or may not find it
                        self._scan_writes[key + _SUFFIX] = n
        self._maybe_evict()

    def _write(self, key: str, meta: bytes, data: np.ndarray) -> bool:
        """Write the entry of ``key`` (header, ``meta``, ``data``'s bytes) atomically; False where it failed
        (counted and said by ``error``)."""
        payload = data.reshape(-1).view(np.uint8)
        checksum = self._checksum(payload, self._checksum(meta, 0))
        head = _HEADER.pack(_MAGIC, _VERSION, self._checksum_kind, len(meta), payload.nbytes, checksum)
        self.file_of(key)
        tmp = f".{key}.{os.getpid()}.{threading.get_ident()}.{next(self._tmp_ids)}{_TMP}"
        try:
            sfd = self._shard(key[:2], create=True)
            assert sfd is not None
        except OSError as e:
            self.error(e, f"open its directory {key[:2]!r}")
            return False
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
            self.error(e, f"write entry {key!r}")
            return False
        return True

    def _room(self, n: int) -> bool:
        """Whether an entry of ``n`` bytes may be written: the tier has room, or gets it by evicting
        entries not used during this run. A full tier is scanned again at most every ``FULL_RESCAN_S``."""
        if not self.scanned:
            self._maybe_evict()  # the first put of this process: learn what the directory holds
        limit = self.limit()
        if n > limit and self.size is not None:  # no eviction makes room: said as such, not as a full tier
            with self._lock:
                self.counts.not_admitted += 1
            self._say("too big", f"disk tier keeps no chunk of {_fmt(n)}: larger than disk_size={_fmt(self.size)}",
                      f"the chunk cache's disk tier {self.root!r} keeps no chunk of {_fmt(n)} (its entry): that is "
                      f"larger than the whole tier (disk_size={_fmt(self.size)}); give a larger disk_size "
                      "(warned once)")
            return False
        with self._lock:
            fits = self.counts.disk_bytes + self._pending + n <= limit
            if fits:
                self._pending += n
            recheck = time.monotonic() - self._full_since >= FULL_RESCAN_S
            if not fits and not recheck:
                self.counts.not_admitted += 1
        if not fits and not recheck:
            self._full()
        if fits or not recheck:
            return fits
        if self._evicting.acquire(blocking=False):
            try:
                self.evict(room=n)
            finally:
                self._evicting.release()
        with self._lock:
            fits = self.counts.disk_bytes + self._pending + n <= limit
            if fits:
                self._pending += n
            # only a tier found full of entries used during this run waits before the next scan
            self._full_since = -float("inf") if fits else time.monotonic()
            if not fits:
                self.counts.not_admitted += 1
        if not fits:
            self._full()
        return fits

    def _full(self) -> None:
        """Say once that the disk tier turned a chunk away: full of entries used during this run."""
        bound = f"disk_size={_fmt(self.size)}" if self.size is not None else "the free space it may use"
        self._say("full", f"disk tier full ({bound}): chunks past it are not kept (stats.not_admitted)",
                  f"the chunk cache's disk tier {self.root!r} is full ({bound}) of chunks used during this run; "
                  "chunks past it are not kept on disk (cache.stats.not_admitted counts them; a larger "
                  "disk_size keeps more) (warned once)")

    def _maybe_evict(self) -> None:
        """Rescan and evict when this process's count says the tier is over its bound, or when it has
        written enough since the last scan that other processes' writes may have filled it."""
        limit = self.limit()
        with self._lock:
            due = (not self.scanned or self.counts.disk_bytes > limit
                   or self._written_since_scan > DISK_RESCAN_SHARE * max(limit, 1))
        if not due or not self._evicting.acquire(blocking=False):  # one thread of a process scans at a time
            return
        try:
            self.evict()
        finally:
            self._evicting.release()

    def evict(self, room: int = 0) -> None:
        """Scan the directory and delete the least recently used entries not used during this run until
        ``room`` more bytes fit within the bound (with ``DISK_LOW_WATER``'s slack)."""
        with self._lock:  # entries this process writes during the scan are added to what it finds
            self._written_since_scan = 0
            self._scan_writes = {}
        try:
            entries = self.entries(include_tmp=False)
        except BaseException:
            with self._lock:
                self._scan_writes = None
            raise
        with self._lock:
            during, self._scan_writes = self._scan_writes or {}, None
            seen = {name for _, _, _, name in entries}
            used = sum(e[1] for e in entries) + sum(n for name, n in during.items() if name not in seen)
            self.counts.disk_bytes = used
            self.scanned = True
            room += self._pending
        limit = self.limit()
        if used + room <= limit:
            return
        target = DISK_LOW_WATER * limit - room
        before, evicted = used, 0
        for mtime_ns, size, shard, name in sorted(entries):
            if used <= target or mtime_ns >= self.since_ns:
                break  # what is left was used during this run: kept (pinned)
            if self._unlink(shard, name):
                evicted += 1
            used -= size  # gone either way: another process may have evicted it first
        with self._lock:
            self.counts.disk_bytes += used - before  # what the deletions took; writes since stay counted
            self.counts.disk_evictions += evicted

    def entries(self, include_tmp: bool) -> list[tuple[int, int, str, str]]:
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
                self.error(e, f"open its directory {shard!r}")
                continue
            # a new descriptor, with its own offset (processes forked from this one share the kept one), open
            # while the entries are stat'ed (they name their directory by it)
            own = -1
            try:
                own = os.open(".", _DIR_FLAGS, dir_fd=sfd)
                it = list(os.scandir(own))
            except OSError as err:  # unreadable (permissions): counted and warned, the other shards still serve
                self.error(err, f"list its directory {shard!r}")
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
                    out.append((self.since_ns, st.st_size, shard, ent.name))
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
            need = ("made in a directory you can write" if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
                    else "a directory of your own, not a link")
            raise ValueError(f"refusing {os.path.join(disk, _SUBDIR)!r} as the cache's disk tier: it must be "
                             f"{need} ({type(e).__name__}: {e})") from e
    finally:
        os.close(root)

