"""A cache tier in GPU memory (SPEC §4 "Cache across epochs": ``ChunkCache(device=...)``).

Decoded chunks are kept in device memory within a byte budget, with the memory tier's policy
(``xinsitu.cache.chunk_cache``): admit chunks until the budget is full, then keep them -- in shuffled epochs an
LRU would evict each chunk before its next use. Chunks of one shape and dtype share *slabs*
(``(rows, *chunk_shape)`` device arrays), so a batch is gathered from many chunks in one indexed
take per slab, on the device, with no host work. Rows are never reused while the tier lives.

Device memory goes through a small API (:class:`CupyArrays` on a GPU; :class:`HostArrays`, numpy,
standing in for it in CI), the seam ``xinsitu.batches.device_copy`` and ``xinsitu.codecs.gpu`` use too.

Wiring (after the read path's rebuild): a buffer's chunks found here skip the read and the decode;
a chunk decoded on the device (``gpu_decode``) or copied there is ``put`` as it lands.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np


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
        from xinsitu.codecs.gpu import gpu_extra_hint

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

    Thread-safe. ``put`` copies a chunk (a host or device array) into a row of its slab; ``locate_many``
    says where chunks are; ``gather`` takes rows of cached chunks into one device array."""

    def __init__(self, budget: int, arrays: Any = None):
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
            raise ValueError(f"budget must be a number of bytes >= 0, got {budget!r}")
        self.budget = int(budget)
        self.arrays = arrays if arrays is not None else CupyArrays()
        self._lock = threading.Lock()
        self._rows: dict[Hashable, tuple[Any, int]] = {}
        self._slabs: dict[tuple[tuple[int, ...], str], list[Any]] = {}  # (shape, dtype) -> [slab, rows used]
        self.stats = DeviceCacheStats()

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._rows

    def put(self, key: Hashable, chunk: Any) -> bool:
        """Keep ``chunk`` under ``key`` where the budget has room; False where it was not kept."""
        with self._lock:
            self.stats.puts += 1
            if key in self._rows:
                return True
            place = self._reserve(tuple(chunk.shape), np.dtype(chunk.dtype), int(chunk.nbytes))
            if place is None:
                self.stats.refused += 1
                return False
            slab, row = place
            slab[row] = self.arrays.asarray(chunk)
            self._rows[key] = place
            self.stats.entries += 1
            return True

    def _reserve(self, shape: tuple[int, ...], dtype: np.dtype, n: int) -> tuple[Any, int] | None:
        """A free row (the lock held), counted against the budget; None where the budget is full. A new
        slab holds as many rows as the rest of the budget allows, up to ``SLAB_ROWS``, so that device
        memory is taken as chunks come, not all at once."""
        if self.stats.bytes + n > self.budget:
            return None
        cls = (shape, dtype.str)
        got = self._slabs.get(cls)
        if got is None or got[1] >= len(got[0]):
            rows = max(1, min(self.SLAB_ROWS, (self.budget - self.stats.bytes) // max(n, 1)))
            got = [self.arrays.empty((rows, *shape), dtype), 0]
            self._slabs[cls] = got
        slab, row = got[0], got[1]
        got[1] += 1
        self.stats.bytes += n
        return slab, row

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

    def gather(self, keys: list[Hashable]) -> Any:
        """The chunks of ``keys`` (all cached, one shape and dtype) as one ``(len(keys), *chunk)`` device
        array, in one take per slab; KeyError naming the first one missing."""
        places = self.locate_many(keys)
        missing = [k for k, p in zip(keys, places, strict=True) if p is None]
        if missing:
            raise KeyError(f"not in the device cache: {missing[0]!r}" + (f" and {len(missing) - 1} more"
                                                                          if len(missing) > 1 else ""))
        slabs: dict[int, tuple[Any, list[int], list[int]]] = {}
        for i, (slab, row) in enumerate(p for p in places if p is not None):
            s = slabs.setdefault(id(slab), (slab, [], []))
            s[1].append(i)
            s[2].append(row)
        if len(slabs) == 1:
            slab, _, rows = next(iter(slabs.values()))
            return self.arrays.take(slab, np.asarray(rows))
        first = places[0]
        assert first is not None
        out = self.arrays.empty((len(keys), *first[0].shape[1:]), first[0].dtype)
        for slab, pos, rows in slabs.values():
            self.arrays.scatter(out, np.asarray(pos), self.arrays.take(slab, np.asarray(rows)))
        return out

    def summary(self) -> str:
        s = self.stats
        return f"device {s.bytes / 1e6:.1f} MB of {self.budget / 1e6:.1f} MB ({s.entries} chunks)"
