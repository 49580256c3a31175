"""A cache tier in GPU memory (SPEC §4 "Cache across epochs": ``ChunkCache(device=...)``).

Decoded chunks are kept in device memory within a byte budget, with the memory tier's policy
(``xinsitu.cache.chunk_cache``): admit chunks until the budget is full, then keep them -- in shuffled epochs an
LRU would evict each chunk before its next use. Chunks of one shape and dtype share *slabs*
(``(rows, *chunk_shape)`` device arrays), so a batch is gathered from many chunks in one indexed
take per slab, on the device, with no host work. Rows are never reused while the tier lives.

Device memory goes through a small API (:class:`CupyArrays` on a GPU; :class:`HostArrays`, numpy,
standing in for it in CI), the seam ``xinsitu.batches.device_copy`` and ``xinsitu.codecs.gpu`` use too.

Wiring: a buffer's (or, one sample per chunk, a batch's) chunks found here skip the read and the decode,
and are copied into place in one take per slab (``copy_out``); the chunks decoded on the device
(``codecs.gpu``) or copied there are kept as they land, in one copy per slab (``put_many``).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from xinsitu.cache.keys import file_clock_ns


class HostArrays:
    """numpy standing in for device memory."""

    kind = "stand-in"

    def __init__(self) -> None:
        self.allocs = 0

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        self.allocs += 1
        return np.empty(shape, dtype)

    def take(self, slab: Any, rows: np.ndarray) -> Any:
        return slab[rows]

    def take_into(self, slab: Any, rows: np.ndarray, out: Any) -> None:
        """``out[...] = slab[rows]`` (``out`` may be a strided view, e.g. a channel slice of a batch)."""
        np.take(slab, rows, axis=0, out=out, mode="clip")  # rows are in range: unbuffered where it can

    def asarray(self, a: Any) -> Any:
        return np.asarray(a)

    def scatter(self, out: Any, pos: np.ndarray, values: Any) -> None:
        out[pos] = values


class CupyArrays:
    """CuPy device memory on the current device."""

    kind = "cupy"

    def __init__(self) -> None:
        import cupy

        self.cupy = cupy
        self.allocs = 0

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        self.allocs += 1
        return self.cupy.empty(shape, dtype)

    def take(self, slab: Any, rows: np.ndarray) -> Any:
        return self.cupy.take(slab, self.cupy.asarray(rows), axis=0)

    def take_into(self, slab: Any, rows: np.ndarray, out: Any) -> None:
        """``out[...] = slab[rows]`` (``out`` may be a strided view): a take, then one strided copy."""
        out[...] = self.take(slab, rows)

    def asarray(self, a: Any) -> Any:
        return self.cupy.asarray(a)

    def scatter(self, out: Any, pos: np.ndarray, values: Any) -> None:
        out[self.cupy.asarray(pos)] = values


def require_cupy(what: str, missing: str) -> None:
    """CuPy and a CUDA device, or ``RuntimeError`` now (never a fall back to the CPU): ``missing`` (its
    ``{hint}``: the extra that installs CuPy) where CuPy is not installed, else "``what``: no CUDA device"."""
    try:
        import cupy
    except ImportError:
        from xinsitu.codecs.nvcomp import gpu_extra_hint

        raise RuntimeError(missing.format(hint=gpu_extra_hint())) from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, no device
        raise RuntimeError(f"{what}: no CUDA device is available ({e})") from None
    if n < 1:
        raise RuntimeError(f"{what}: no CUDA device is available")


def check_device_tier() -> None:
    """A device tier needs CuPy and a CUDA device: say so when the cache is made, naming the extra."""
    require_cupy("ChunkCache(device=...)", "ChunkCache(device=...) keeps chunks in GPU memory and needs CuPy: {hint}")


@dataclass
class DeviceCacheStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    refused: int = 0  # chunks not admitted: the budget was full
    bytes: int = 0
    entries: int = 0


class DeviceCache:
    """Decoded chunks in device memory within ``budget`` bytes: keep what fits.

    Thread-safe. ``put``/``put_many`` copy chunks (host or device arrays) into rows of their slab;
    ``locate_many`` says where chunks are; ``copy_out`` copies them from there into their destinations,
    ``gather`` into one new device array."""

    def __init__(self, budget: int, arrays: Any = None):
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
            raise ValueError(f"budget must be a number of bytes >= 0, got {budget!r}")
        self.budget = int(budget)
        self.arrays = arrays if arrays is not None else CupyArrays()
        self._lock = threading.Lock()
        self._rows: dict[Hashable, tuple[Any, int]] = {}
        self._slabs: dict[tuple[tuple[int, ...], str], list[Any]] = {}  # (shape, dtype) -> [slab, rows used]
        self._allocated = 0  # bytes of every slab made (what the budget bounds)
        #: since when each entry is known to match its source, and its remote object's version (as the
        #: memory tier's: a later reader of a mutable archive checks them, ``cache.lookup``)
        self._born: dict[Hashable, tuple[int, str | None]] = {}
        self.stats = DeviceCacheStats()

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._rows

    def put(self, key: Hashable, chunk: Any) -> bool:
        """Keep ``chunk`` under ``key`` where the budget has room; False where it was not kept."""
        return self.put_many([key], [0], [chunk]) == 1

    def put_many(self, keys: list[Hashable], pos: list[int], outs: list[Any], stack: Any = None, *,
                 born: int | None = None, versions: list[str | None] | None = None) -> int:
        """Keep chunks ``outs[pos[k]]`` (host or device arrays) under ``keys[k]`` where the budget has room;
        how many are kept. With ``stack`` (an array whose row ``i`` is ``outs[i]``), the rows a slab gets are
        filled by one copy per slab instead of one per chunk. ``born`` and ``versions[k]``: as
        ``ChunkCache.put``'s (since when the chunks are known to match their source, default now; their
        remote objects' versions)."""
        now = file_clock_ns() if born is None else born
        with self._lock:
            self.stats.puts += len(keys)
            todo: list[tuple[Hashable, int, Any, int, str | None]] = []  # key, position, slab, row, version
            mine: set[Hashable] = set()
            kept = 0
            for k, (key, i) in enumerate(zip(keys, pos, strict=True)):
                if key in self._rows or key in mine:
                    kept += 1
                    continue
                mine.add(key)
                chunk = outs[i]
                place = self._reserve(tuple(chunk.shape), np.dtype(chunk.dtype), int(chunk.nbytes))
                if place is None:
                    self.stats.refused += 1
                    continue
                todo.append((key, i, *place, None if versions is None else versions[k]))
            for slab, at, rows in _by_slab([(p[2], p[3]) for p in todo]):
                got = [todo[k][1] for k in at.tolist()]  # positions of this slab's chunks
                if stack is None or len(got) == 1:
                    for i, r in zip(got, rows.tolist(), strict=True):
                        slab[r] = self.arrays.asarray(outs[i])
                    continue
                r0, n, p0 = int(rows[0]), len(rows), got[0]  # (a slab's rows are reserved in a run)
                run = got == list(range(p0, p0 + n))
                slab[r0:r0 + n] = stack[p0:p0 + n] if run else self.arrays.take(stack, np.asarray(got))
            for key, _, slab, row, version in todo:  # published once their copies are queued
                self._rows[key] = (slab, row)
                self._born[key] = (now, version)
            self.stats.entries += len(todo)
            return kept + len(todo)

    def kept_before(self, keys: list[Hashable], since: int) -> list[tuple[int, int, str | None]]:
        """As ``ChunkCache.kept_before``: the entries among ``keys`` not known to match their source since
        ``since``, as ``(position in keys, since when, version)``."""
        with self._lock:
            return [(i, *b) for i, k in enumerate(keys) if (b := self._born.get(k, (since, None)))[0] < since]

    def recheck(self, keys: list[Hashable], changed: list[bool], since: int) -> None:
        """As ``ChunkCache.recheck``: the entries whose source changed are dropped (their rows stay
        unused, counted against the budget), the others marked as matching since ``since``."""
        with self._lock:
            for k, gone in zip(keys, changed, strict=True):
                if k not in self._rows:
                    continue
                if gone:
                    del self._rows[k], self._born[k]
                    self.stats.entries -= 1
                else:
                    self._born[k] = (max(self._born[k][0], since), self._born[k][1])

    def _reserve(self, shape: tuple[int, ...], dtype: np.dtype, n: int) -> tuple[Any, int] | None:
        """A free row (the lock held), counted against the budget; None where the budget is full. The budget
        bounds the device memory the slabs take, rows used or not: a class of chunks (shape, dtype) starts
        with a slab of ``FIRST_ROWS`` rows or an eighth of what the budget has left, and each next one doubles,
        up to ``SLAB_ROWS``, within what the budget has left (a slab sized to the whole rest, per class, took a
        budget per class)."""
        cls = (shape, dtype.str)
        got = self._slabs.get(cls)
        if got is None or got[1] >= len(got[0]):
            room = (self.budget - self._allocated) // max(n, 1)  # rows the budget has left for this class
            want = max(self.FIRST_ROWS, room // self.FIRST_SHARE) if got is None else 2 * len(got[0])
            rows = min(self.SLAB_ROWS, want, room)
            if rows < 1:
                return None
            got = [self.arrays.empty((rows, *shape), dtype), 0]
            self._slabs[cls] = got
            self._allocated += rows * n
        slab, row = got[0], got[1]
        got[1] += 1
        self.stats.bytes += n
        return slab, row

    #: rows of a class's first slab: ``FIRST_ROWS``, or 1 / ``FIRST_SHARE`` of what the budget has left where that
    #: is more (one slab, one take a batch, where the budget is large); each next one doubles
    FIRST_ROWS = 16
    FIRST_SHARE = 8
    #: rows of one slab at most (the budget is the bound; this only paces the allocations)
    SLAB_ROWS = 256

    def locate_many(self, keys: list[Hashable]) -> list[tuple[Any, int] | None]:
        """``(slab, row)`` of each cached chunk, None for the others (counted as hits and misses)."""
        with self._lock:
            got = [self._rows.get(k) for k in keys]
            hit = sum(g is not None for g in got)
            self.stats.hits += hit
            self.stats.misses += len(got) - hit
        return got

    def get(self, key: Hashable) -> Any:
        """The cached chunk (a view of its row), or None."""
        (got,) = self.locate_many([key])
        return None if got is None else got[0][got[1]]

    def copy_out(self, places: list[tuple[Any, int] | None], outs: list[Any], stack: Any = None) -> None:
        """The chunks ``locate_many`` found (``places[i]``; None for those it did not) copied into their
        destinations on the device: ``outs[i]``, a row of ``stack`` where given (an array whose row ``i`` is
        ``outs[i]``, e.g. a device buffer, or a variable's channels in a batch). With ``stack``, one take per
        slab instead of one copy per chunk: a batch served from the tier costs the host a few calls, however
        many chunks it holds."""
        for slab, pos, rows in _by_slab(places):
            if stack is None or len(pos) == 1:
                for i, r in zip(pos.tolist(), rows.tolist(), strict=True):
                    outs[i][...] = slab[r]
            elif len(pos) == len(stack):  # every row of the stack, in order
                self.arrays.take_into(slab, rows, stack)
            else:
                self.arrays.scatter(stack, pos, self.arrays.take(slab, rows))

    def gather(self, keys: list[Hashable]) -> Any:
        """The chunks of ``keys`` (all cached, one shape and dtype) as one ``(len(keys), *chunk)`` device
        array, in one take per slab; KeyError naming the first one missing."""
        places = self.locate_many(keys)
        missing = [k for k, p in zip(keys, places, strict=True) if p is None]
        if missing:
            raise KeyError(f"not in the device cache: {missing[0]!r}" + (f" and {len(missing) - 1} more"
                                                                          if len(missing) > 1 else ""))
        groups = _by_slab(places)
        if len(groups) == 1:
            slab, _, rows = groups[0]
            return self.arrays.take(slab, rows)
        first = places[0]
        assert first is not None
        out = self.arrays.empty((len(keys), *first[0].shape[1:]), first[0].dtype)
        for slab, pos, rows in groups:
            self.arrays.scatter(out, pos, self.arrays.take(slab, rows))
        return out

    def summary(self) -> str:
        s = self.stats
        return (f"device {s.bytes / 1e6:.1f} MB of {self.budget / 1e6:.1f} MB ({s.entries} chunks, "
                f"{self._allocated / 1e6:.1f} MB allocated)")


def _by_slab(places: list[tuple[Any, int] | None]) -> list[tuple[Any, np.ndarray, np.ndarray]]:
    """``places`` (``(slab, row)`` or None) grouped by slab: ``(slab, positions in places, rows)``, positions
    ascending, slabs in order of first appearance."""
    groups: dict[int, tuple[Any, list[int], list[int]]] = {}
    for i, p in enumerate(places):
        if p is not None:
            g = groups.setdefault(id(p[0]), (p[0], [], []))
            g[1].append(i)
            g[2].append(p[1])
    return [(slab, np.asarray(pos, np.int64), np.asarray(rows, np.int64)) for slab, pos, rows in groups.values()]
