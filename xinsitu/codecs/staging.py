"""Page-locked staging: a buffer's compressed chunks on the host, on their way to the device (SPEC §4 "GPU").

A buffer's chunks land ONCE on the host, in a page-locked staging buffer (:class:`Staging`, from a
:class:`PinnedRing` whose buffers are each reused once their copy's event completed): a local file is
read straight into it, other bytes (obstore's) are copied in. The staging goes to the device in ONE
transfer (``nvcomp``'s decoders), its payloads at ``ALIGN``-aligned offsets.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from xinsitu.io.place import SCRATCH

#: byte alignment of each payload inside the transfer (nvCOMP's batched decoders need 8 at most; 64:
#: a local file read into its region is copied by the kernel at a third of the speed where the region
#: starts 8 or 16 bytes past a multiple of 64, measured on AMD EPYC, see ``mempool.page_aligned``)
ALIGN = 64
#: page-locked staging buffers a decoder reuses at least (each handed out again once its copy completed)
RING_SLOTS = 3


def _done(event: Any) -> bool:
    """Whether the work before ``event`` completed (CuPy's ``done``; the stand-in's always)."""
    return event is None or bool(event.done)


# ------------------------------------------------------------------------------------------ staging
class PinnedRing:
    """Page-locked staging buffers, reused batch after batch (``take``, ``give_back``): a buffer comes
    back with the event of its copy to the device and is handed out again only once that event has
    completed -- at once where its copy is done, else waited for where ``slots`` buffers exist already
    (the oldest first). ``alloc``: ``fn(nbytes) -> uint8 array`` of page-locked memory."""

    def __init__(self, alloc: Callable[[int], np.ndarray], slots: int = RING_SLOTS):
        self.alloc, self.slots = alloc, slots
        self._free: list[tuple[np.ndarray, Any]] = []  # (buffer, event of its last copy), oldest first
        self.n = 0  # buffers made and not let go
        self.allocs = self.waits = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` whose last copy has completed."""
        wait = None
        with self._lock:
            fits = [i for i, (b, _) in enumerate(self._free) if b.nbytes >= nbytes]
            for i in fits:
                buf, ev = self._free[i]
                if _done(ev):
                    del self._free[i]
                    return buf
            if fits and self.n >= self.slots:
                buf, wait = self._free.pop(fits[0])
                self.waits += 1
            else:
                self.n += 1
                self.allocs += 1
        if wait is not None:
            wait.synchronize()  # its copy to the device is under way: the buffer is reused once it is done
            return buf
        return self.alloc(max(nbytes + nbytes // 8, ALIGN))

    def give_back(self, buf: np.ndarray, event: Any = None) -> None:
        """``buf`` may be handed out again once ``event`` (None: at once) has completed; beyond ``slots``
        buffers kept, the oldest is let go (once its copy is done: page-locked memory freed under a copy
        would be read by it)."""
        with self._lock:
            self._free.append((buf, event))
            drop = self._free.pop(0) if len(self._free) > self.slots else None
            if drop is not None:
                self.n -= 1
        if drop is not None and not _done(drop[1]):
            drop[1].synchronize()


class Staging:
    """One buffer's compressed chunks on the host, in one page-locked buffer of ``capacity`` bytes (taken
    from ``ring`` when the first chunk comes): regions handed out one after another at ``ALIGN``-aligned
    offsets, to whichever decode thread asks (thread-safe). A local read fills its region itself
    (``take``, the scratch ``LocalBackend.read`` reads into); other bytes are copied into one (``put``).
    Bytes that do not fit are kept aside and packed behind the rest at ``finish``."""

    def __init__(self, ring: PinnedRing, capacity: int):
        self.ring, self.capacity = ring, max(capacity, ALIGN)
        self.buf: np.ndarray | None = None
        self.used = 0
        self.aside: list[bytes] = []  # what did not fit: at offsets -1, -2, ... until ``finish``
        self._lock = threading.Lock()
        self._mine = threading.local()  # the offset of the region this thread took last

    def _reserve(self, n: int) -> int | None:
        with self._lock:
            if self.buf is None:
                self.buf = self.ring.take(self.capacity)
            o = self.used
            end = o + -(-n // ALIGN) * ALIGN
            if end > self.buf.nbytes:
                return None
            self.used = end
            return o

    def take(self, n: int) -> memoryview:
        """``n`` bytes to read a chunk into (``decode.ThreadScratch``'s protocol): a region of the staging,
        or, where it is full, this thread's scratch (``put`` then keeps its bytes aside)."""
        o = self._reserve(n)
        self._mine.at = o
        if o is None:
            return SCRATCH.take(n)
        assert self.buf is not None
        return self.buf.data[o:o + n]

    def locate(self, raw: Any) -> int | None:
        """The offset of ``raw`` where it is the region this thread took last (read there), else None."""
        at = getattr(self._mine, "at", None)
        if at is None or not isinstance(raw, memoryview) or raw.obj is not self.buf:
            return None
        self._mine.at = None
        return at  # type: ignore[no-any-return]

    def put(self, part: memoryview) -> int:
        """``part`` copied into a region of its own (the one host copy of bytes not read here); its offset
        (negative: kept aside, see ``finish``)."""
        o = self._reserve(len(part))
        if o is None:
            with self._lock:
                self.aside.append(bytes(part))
                return -len(self.aside)
        assert self.buf is not None
        self.buf[o:o + len(part)] = np.frombuffer(part, dtype=np.uint8)
        return o

    def finish(self) -> tuple[np.ndarray | None, list[int]]:
        """The staging's buffer with everything in it, and the offsets the bytes kept aside now have (a
        bigger buffer, from the ring, where any were)."""
        if not self.aside:
            return self.buf, []
        old, used = self.buf, self.used
        total = used + sum(-(-len(a) // ALIGN) * ALIGN for a in self.aside)
        buf = self.ring.take(total)
        if old is not None:
            buf[:used] = old[:used]
            self.ring.give_back(old)  # (never copied to the device)
        offsets, o = [], used
        for a in self.aside:
            buf[o:o + len(a)] = np.frombuffer(a, dtype=np.uint8)
            offsets.append(o)
            o += -(-len(a) // ALIGN) * ALIGN
        self.buf, self.used, self.aside = buf, total, []
        return buf, offsets

    def release(self, event: Any = None) -> None:
        """The staging's buffer back to the ring, reused once ``event`` (its copy's) has completed."""
        if self.buf is not None:
            self.ring.give_back(self.buf, event)
            self.buf = None
