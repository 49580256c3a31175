"""Memory reused instead of allocated, one way for every batch path: an :class:`ArrayPool`.

Fresh memory costs a page fault per page on first touch, and an array of a few MB is fresh memory
every time (glibc maps and unmaps it). A pool hands out an array of the shape and dtype asked that
it got back, else a new one. Arrays come back one of two ways:

* given back (``give_back``) by an owner that knows nothing reads them any more (the block buffers
  of ``xinsitu.batches.buffer``, once no batch will be gathered from them again);
* taken back (``counted=True``) once nothing outside the pool holds them, as their reference count
  says: no batch, tensor, view or jax array made from them (the stacked batches of
  ``xinsitu.batches.output.BatchArrays``, which the user may keep). An interpreter without
  ``sys.getrefcount`` (PyPy), or that counts otherwise, never has an array taken back.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

#: the memory page's size (``page_aligned``)
PAGE = 4096


def page_aligned(n: int, at: int = 0) -> np.ndarray:
    """``n`` bytes of new memory (a uint8 array) whose byte ``at`` starts a page. What a file is read
    into: the kernel copies page-cache pages into memory that starts on a page at 3-9x the speed it
    copies them 8 or 16 bytes into one, where a large ``bytearray`` or ``np.empty`` starts (AMD EPYC,
    measured: 3.5-4.3 against 1.2 GB/s for whole chunk files, 11-14 against 1.5 for the cache's
    entries read from a page boundary)."""
    raw = np.empty(n + PAGE, np.uint8)
    off = -(raw.ctypes.data + at) % PAGE
    return raw[off:off + n]


def _refs_seen(held: deque[np.ndarray], i: int) -> int:
    """``sys.getrefcount`` of ``held[i]`` as ``ArrayPool.take`` sees it (one function for the check and
    its calibration, so both count the same references); -1 without ``sys.getrefcount``."""
    count = getattr(sys, "getrefcount", None)
    if count is None:
        return -1
    raw = held[i]
    return count(raw)


def _calibrate() -> int | None:
    """The count ``_refs_seen`` gives an array nothing but the pool holds; None where one more
    reference elsewhere does not show as one more: then no array is ever taken back."""
    held: deque[np.ndarray] = deque([np.empty(1)])
    idle = _refs_seen(held, 0)
    other = held[0]
    busy = _refs_seen(held, 0)
    del other
    return idle if busy == idle + 1 and _refs_seen(held, 0) == idle else None


#: what ``_refs_seen`` says of an array only the pool holds (None: never taken back by count)
_IDLE = _calibrate()


class ArrayPool:
    """Arrays handed out again once back (see the module doc); thread-safe.

    ``keep``: arrays kept at most, per shape and dtype where given back, in all where ``counted``
    (those handed out included: the oldest is dropped first). ``alloc``: ``fn(nbytes) -> uint8
    array`` making new memory (e.g. page-locked memory for a device copy), else ``np.empty``; a
    counted pool with ``alloc`` is asked for 1-D uint8 arrays, so that what it counts is alloc's own
    array (the base of every view made from it).
    A pickled pool (a worker process's) starts empty.
    """

    def __init__(self, keep: int, alloc: Callable[[int], np.ndarray] | None = None, counted: bool = False):
        self.keep, self.alloc, self.counted = keep, alloc, counted
        self._free: dict[tuple[tuple[int, ...], np.dtype], list[np.ndarray]] = {}  # given back
        self._held: deque[np.ndarray] = deque(maxlen=keep)  # handed out, counted: taken back when idle
        self._lock = threading.Lock()  # one array to one caller, where several threads take
        self.made = 0  # arrays made anew (not handed out again): new memory, its pages faulted in at first use

    def __reduce__(self) -> tuple[Any, ...]:
        return (ArrayPool, (self.keep, self.alloc, self.counted))

    def take(self, shape: tuple[int, ...] | list[int], dtype: Any) -> np.ndarray:
        """An array of ``shape`` and ``dtype``, its values left as they were (as ``np.empty``)."""
        shape, dtype = tuple(shape), np.dtype(dtype)
        with self._lock:
            if self.counted:
                held, idle = self._held, _IDLE
                for i in range(len(held) if idle is not None else 0):
                    if held[i].shape == shape and held[i].dtype == dtype and _refs_seen(held, i) == idle:
                        arr = held[i]
                        del held[i]
                        held.append(arr)  # the newest: older ones are dropped first
                        return arr
            else:
                free = self._free.get((shape, dtype))
                if free:
                    return free.pop()
            self.made += 1
            if self.alloc is None:
                arr = np.empty(shape, dtype=dtype)
            else:  # alloc's own array where it is the one asked (1-D uint8): the one counted and kept alive
                arr = self.alloc(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
                if arr.shape != shape or arr.dtype != dtype:
                    arr = arr.view(dtype).reshape(shape)
            if self.counted:
                self._held.append(arr)
            return arr

    def give_back(self, arr: np.ndarray) -> None:
        """``arr`` (from ``take``) may be handed out again: nothing reads it any more."""
        with self._lock:
            free = self._free.setdefault((arr.shape, arr.dtype), [])
            if len(free) < self.keep:
                free.append(arr)
