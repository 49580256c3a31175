"""Host-to-device copies that overlap the caller's work (SPEC §4 "GPU").

A :class:`DeviceMover` owns a small ring of reused page-locked (pinned) staging buffers, one side
stream and an event per batch. For each batch (in the prefetch thread) it

1. takes the next slot of the ring -- and, where that slot's last copy has not completed yet,
   waits for its event (a staging buffer is overwritten only after its copy completed);
2. copies every array of the batch into the slot (host to host, in the prefetch thread);
3. enqueues the host-to-device copies on its own stream, into fresh device memory, and records
   the batch's event after them.

A batch already in page-locked memory of :meth:`DeviceMover.host_alloc` (stacked batches are
gathered there: ``BatchArrays(alloc=mover.host_alloc)``) skips step 2: it is copied from where it
lies, and the mover holds that memory until its copy completed.

When the batch is handed to the caller (:meth:`DeviceMover.hand_out`, on the caller's thread),
the caller's *current* stream waits on that event (no host wait), and the device memory is tied
to that stream (torch's ``record_stream``; CuPy, which has none, gets arrays of the caller's stream,
see :class:`CupyCuda`), so the allocator does not give it to a later copy while the caller's work
may still read it. The copy of the next batch thus overlaps the caller's
step; the batch is safe on the caller's stream.

Everything device-specific sits behind a small *device API* (:class:`TorchCuda`, :class:`CupyCuda`,
and :class:`StandInDevice` -- numpy arrays, with streams whose copies run only when an event
after them is waited on -- so that the reuse rules are tested without a GPU).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: slots of the staging ring: the batch being copied, one the caller may still be waiting on, one spare
RING_SLOTS = 3
#: byte offset alignment of the arrays inside a staging buffer
ALIGN = 256
#: numpy kinds a device array can hold (bool, ints, floats, complex); others stay as they are
NUMERIC_KINDS = "biufc"


def host_numpy(x: Any) -> np.ndarray | None:
    """``x`` as a numpy array where it is a numeric numpy array or a CPU torch tensor numpy can hold
    (what a transform may return), else None."""
    if isinstance(x, np.ndarray):
        return x if x.dtype.kind in NUMERIC_KINDS else None
    t = type(x)
    if t.__name__ == "Tensor" and t.__module__.startswith("torch") and x.device.type == "cpu":
        try:
            return x.detach().numpy()
        except (TypeError, RuntimeError):  # e.g. bfloat16: no numpy dtype
            return None
    return None


# ---------------------------------------------------------------------------------------------- stand-in
class _StandInStream:
    """A stream of the stand-in device: enqueued copies run in order, only when flushed. Thread-safe,
    as a device's streams are (the prefetch thread waits on a slot while the caller's thread waits on
    a batch): each copy runs exactly once, in the order it was enqueued."""

    def __init__(self, name: str, log: list[tuple[str, ...]]):
        self.name, self.log = name, log
        self.ops: list[Any] = []  # callables not run yet, in order
        self.enqueued = 0  # copies ever enqueued
        self.ran = 0  # copies run (the first ``ran`` of those enqueued)
        self._lock = threading.Lock()

    def enqueue(self, op: Any) -> None:
        with self._lock:
            self.ops.append(op)
            self.enqueued += 1

    def flush(self, upto: int | None = None) -> None:
        """Run the copies enqueued before the ``upto``-th (all where None)."""
        with self._lock:
            target = self.enqueued if upto is None else upto
            while self.ran < target:
                self.ops.pop(0)()
                self.ran += 1

    def wait_event(self, event: _StandInEvent) -> None:
        self.log.append(("wait", self.name, str(event.serial)))
        event.synchronize(log=False)  # the work of this stream after the wait sees the copy done


class _StandInEvent:
    def __init__(self, serial: int, log: list[tuple[str, ...]]):
        self.serial, self.log = serial, log
        self.stream: _StandInStream | None = None
        self.mark = 0  # copies of the stream enqueued before the event
        self.done = True

    def record(self, stream: _StandInStream) -> None:
        with stream._lock:
            self.stream, self.mark, self.done = stream, stream.enqueued, False
        self.log.append(("record", stream.name, str(self.serial)))

    def query(self) -> bool:
        return self.done or (self.stream is not None and self.stream.ran >= self.mark)

    def synchronize(self, log: bool = True) -> None:
        if not self.done and self.stream is not None:
            if log:
                self.log.append(("synchronize", str(self.serial)))
            self.stream.flush(self.mark)
            self.done = True


class StandInDeviceArray(np.ndarray):
    """A numpy array the stand-in device takes for one already in device memory (built there)."""


class StandInDevice:
    """The device API with numpy standing in for device memory (no GPU needed).

    A copy enqueued on a stream runs only when an event recorded after it is synchronized or waited
    on (or :meth:`complete` runs the stream): a staging buffer overwritten before its copy ran would
    show as wrong values. ``log`` records the order of records, waits and synchronizations."""

    kind = "stand-in"

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.pinned_allocs = 0
        self.current = _StandInStream("caller", self.log)
        self._serial = 0
        self.streams: list[_StandInStream] = []

    def __reduce__(self) -> tuple[Any, ...]:  # a worker process's copy starts with no streams
        return (StandInDevice, ())

    def pinned(self, nbytes: int) -> np.ndarray:
        self.pinned_allocs += 1
        return np.empty(nbytes, dtype=np.uint8)

    def host_view(self, buf: np.ndarray) -> np.ndarray:
        return buf

    def stream(self) -> _StandInStream:
        s = _StandInStream(f"side{len(self.streams)}", self.log)
        self.streams.append(s)
        return s

    def event(self) -> _StandInEvent:
        self._serial += 1
        return _StandInEvent(self._serial, self.log)

    def leaf(self, x: Any) -> np.ndarray | None:
        if isinstance(x, StandInDeviceArray):
            return None
        return x if isinstance(x, np.ndarray) and x.dtype.kind in NUMERIC_KINDS else None

    def on_device(self, x: Any) -> bool:
        return isinstance(x, StandInDeviceArray)

    def span(self, leaf: np.ndarray) -> tuple[int, bool]:
        return int(leaf.ctypes.data), bool(leaf.flags.c_contiguous)

    def direct(self, leaf: np.ndarray) -> np.ndarray:
        return leaf

    def to_device(self, staged: np.ndarray, stream: _StandInStream) -> np.ndarray:
        out = np.empty_like(staged)
        out[...] = -1 if out.dtype.kind in "iuf" else 0  # not the value: a copy that never ran shows

        def op(src: np.ndarray = staged, dst: np.ndarray = out) -> None:
            dst[...] = src

        stream.enqueue(op)
        return out

    def hand_out(self, event: _StandInEvent, arrays: list[Any]) -> list[Any] | None:
        self.current.wait_event(event)
        return None

    def complete(self) -> None:
        """Run every enqueued copy (the device caught up)."""
        for s in self.streams:
            s.flush()


# ---------------------------------------------------------------------------------------------- real devices
class TorchCuda:
    """The device API of torch on a CUDA device."""

    kind = "torch"

    def __init__(self, device: Any):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    def __reduce__(self) -> tuple[Any, ...]:  # a worker process makes its own (no module, no CUDA state)
        return (TorchCuda, (str(self.device),))

    def pinned(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True)

    def host_view(self, buf: Any) -> np.ndarray:
        return buf.numpy()

    def stream(self) -> Any:
        return self.torch.cuda.Stream(self.device)

    def event(self) -> Any:
        return self.torch.cuda.Event()

    def leaf(self, x: Any) -> Any:
        torch = self.torch
        if isinstance(x, torch.Tensor):
            return x.detach() if x.device.type == "cpu" else None
        if isinstance(x, np.ndarray) and x.dtype.kind in NUMERIC_KINDS:
            return x
        return None

    def on_device(self, x: Any) -> bool:
        return isinstance(x, self.torch.Tensor) and x.device.type == "cuda"

    def stage(self, buf: Any, off: int, leaf: Any) -> Any:
        if isinstance(leaf, np.ndarray):
            host = buf.numpy()[off:off + leaf.nbytes].view(leaf.dtype).reshape(leaf.shape)
            np.copyto(host, leaf)
            return self.torch.from_numpy(host)  # inside the pinned buffer: the copy is asynchronous
        view = buf[off:off + leaf.nbytes].view(leaf.dtype).view(leaf.shape)
        view.copy_(leaf)
        return view

    def span(self, leaf: Any) -> tuple[int, bool]:
        if isinstance(leaf, np.ndarray):
            return int(leaf.ctypes.data), bool(leaf.flags.c_contiguous)
        return int(leaf.data_ptr()), bool(leaf.is_contiguous())

    def direct(self, leaf: Any) -> Any:
        return self.torch.from_numpy(leaf) if isinstance(leaf, np.ndarray) else leaf

    def to_device(self, staged: Any, stream: Any) -> Any:
        with self.torch.cuda.stream(stream):
            return staged.to(self.device, non_blocking=True)

    def hand_out(self, event: Any, arrays: list[Any]) -> None:
        cur = self.torch.cuda.current_stream(self.device)
        cur.wait_event(event)
        for a in arrays:
            a.record_stream(cur)  # its memory is not reused before the caller's work on it is done


class CupyCuda:
    """The device API of CuPy on its current device.

    CuPy's memory pool has no ``record_stream``: memory a batch was copied into on xinsitu's stream
    could be given to the next copy while the caller's stream still reads it. So the caller gets
    arrays of its own: at hand-out, on the caller's current stream, the batch is copied device to
    device (a few microseconds) into arrays allocated there -- ordinary CuPy arrays of that stream --
    and the copies on xinsitu's stream are kept until that copy completed (an event tells)."""

    kind = "cupy"

    def __init__(self) -> None:
        import cupy

        self.cupy = cupy
        self._held: list[tuple[list[Any], Any]] = []  # (arrays on our stream, event: copied out)

    def __reduce__(self) -> tuple[Any, ...]:  # a worker process makes its own
        return (CupyCuda, ())

    def pinned(self, nbytes: int) -> Any:
        mem = self.cupy.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(mem, dtype=np.uint8, count=nbytes)

    def host_view(self, buf: np.ndarray) -> np.ndarray:
        return buf

    def stream(self) -> Any:
        return self.cupy.cuda.Stream(non_blocking=True)

    def event(self) -> Any:
        return self.cupy.cuda.Event(block=False, disable_timing=True)

    def leaf(self, x: Any) -> np.ndarray | None:
        return host_numpy(x)  # CPU torch tensors of a transform become CuPy arrays too

    def on_device(self, x: Any) -> bool:
        return isinstance(x, self.cupy.ndarray)

    def span(self, leaf: np.ndarray) -> tuple[int, bool]:
        return int(leaf.ctypes.data), bool(leaf.flags.c_contiguous)

    def direct(self, leaf: np.ndarray) -> np.ndarray:
        return leaf

    def to_device(self, staged: np.ndarray, stream: Any) -> Any:
        with stream:
            out = self.cupy.empty(staged.shape, staged.dtype)
            out.set(staged, stream=stream)
        return out

    def hand_out(self, event: Any, arrays: list[Any]) -> list[Any]:
        cupy = self.cupy
        cur = cupy.cuda.get_current_stream()
        cur.wait_event(event)
        mine = []
        for a in arrays:
            b = cupy.empty(a.shape, a.dtype)  # on the caller's current stream (this thread's)
            if a.nbytes:
                b.data.copy_from_device_async(a.data, a.nbytes, stream=cur)
            mine.append(b)
        copied = self.event()
        copied.record(cur)
        self._held = [(h, e) for h, e in self._held if not done(e)]  # copied out: their memory may go
        self._held.append((arrays, copied))
        return mine


# ---------------------------------------------------------------------------------------------- the ring
def done(event: Any) -> bool:
    """Whether the work before ``event`` completed: torch's (and the stand-in's) ``query()``, CuPy's
    ``done``."""
    query = getattr(event, "query", None)
    return bool(query()) if query is not None else bool(event.done)


@dataclass
class _Slot:
    buf: Any = None
    nbytes: int = 0
    event: Any = None
    refs: list[Any] = field(default_factory=list)  # pinned host arrays copied from directly: held till done


@dataclass
class MoverStats:
    batches: int = 0
    pinned_allocs: int = 0
    waits: int = 0  # a slot's copy had not completed when the slot came round again
    direct: int = 0  # arrays copied straight from pinned memory of ``host_alloc`` (no staging copy)
    host_allocs: int = 0
    slot_of: list[int] = field(default_factory=list)  # slot used by each batch (kept for the last 64)


class DeviceMover:
    """Moves every array of a batch (any structure of dicts, lists and tuples) to the device through
    a ring of ``slots`` reused pinned staging buffers, on its own stream; see the module docstring.

    ``move`` runs in the prefetch thread, ``hand_out`` on the caller's thread as the batch is handed
    out. A batch never handed out (an epoch closed early) is forgotten after ``slots`` more batches."""

    def __init__(self, api: Any, slots: int = RING_SLOTS):
        if not isinstance(slots, int) or slots < 2:
            raise ValueError(f"slots must be an integer >= 2 (one being copied, one being filled), got {slots!r}")
        self.api = api
        self.slots = [_Slot() for _ in range(slots)]
        self.next = 0
        self.stream: Any = None
        self.stats = MoverStats()
        # id(batch) -> (event, device arrays, the batch's structure with _Leaf placeholders)
        self._pending: dict[int, tuple[Any, list[Any], Any]] = {}
        self._order: list[int] = []
        self._regions: list[tuple[int, int, Any]] = []  # (start, end, weakref) of host_alloc's memory
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:  # a worker process's copy starts with no CUDA state
        return (DeviceMover, (self.api, len(self.slots)))

    def move(self, batch: Any) -> Any:
        """``batch`` with every array moved to the device (others left as they are)."""
        api = self.api
        leaves: list[Any] = []
        adopted: set[int] = set()  # leaves on the device already (built there: the GPU path): not copied

        def collect(x: Any) -> Any:
            leaf = api.leaf(x)
            if leaf is None:
                if not api.on_device(x):
                    return x
                adopted.add(len(leaves))
                leaf = x
            leaves.append(leaf)
            return _Leaf(len(leaves) - 1)

        shape = tree_map(batch, collect)
        if not leaves:
            return batch
        with self._lock:  # one slot to one batch, where several threads finish batches
            if self.stream is None:
                self.stream = api.stream()
            k = self.next
            self.next = (k + 1) % len(self.slots)
            slot = self.slots[k]
            if slot.event is not None and not done(slot.event):
                self.stats.waits += 1
                slot.event.synchronize()  # the staging buffer's last copy must have completed
            slot.refs = []
            self._release()
            direct = [i in adopted or self._pinned(leaf) for i, leaf in enumerate(leaves)]
            offs, total = [], 0
            for leaf, d in zip(leaves, direct, strict=True):
                offs.append(total)
                if not d:
                    total += -(-int(leaf.nbytes) // ALIGN) * ALIGN
            if not all(direct) and (slot.buf is None or slot.nbytes < total):
                slot.buf, slot.nbytes = api.pinned(max(total, ALIGN)), max(total, ALIGN)
                self.stats.pinned_allocs += 1
            outs = []
            for i, (off, leaf, d) in enumerate(zip(offs, leaves, direct, strict=True)):
                if i in adopted:  # on the device already: handed out as the copies are
                    outs.append(leaf)
                elif d:  # already page-locked (gathered into host_alloc's memory): no staging copy
                    outs.append(api.to_device(api.direct(leaf), self.stream))
                    slot.refs.append(leaf)  # not reused (BatchArrays counts references) before the copy
                    self.stats.direct += 1
                else:
                    outs.append(api.to_device(self._stage(slot.buf, off, leaf), self.stream))
            ev = api.event()
            ev.record(self.stream)
            slot.event = ev
            self.stats.batches += 1
            self.stats.slot_of = (self.stats.slot_of + [k])[-64:]
            moved = tree_map(shape, lambda x: outs[x.i] if isinstance(x, _Leaf) else x)
            self._pending[id(moved)] = (ev, outs, shape)
            self._order.append(id(moved))
            while len(self._order) > 2 * len(self.slots) + 8:  # never handed out: forget
                self._pending.pop(self._order.pop(0), None)
        return moved

    def _release(self) -> None:
        """Pinned arrays whose copies completed go back to their owner (the lock held)."""
        for slot in self.slots:
            if slot.refs and slot.event is not None and done(slot.event):
                slot.refs = []

    def host_alloc(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory (a uint8 numpy array) for batches to be gathered into: arrays in it
        are copied to the device straight, without the staging copy (``BatchArrays(alloc=...)``)."""
        buf = self.api.pinned(nbytes)
        host = self.api.host_view(buf)
        start = int(host.ctypes.data)
        with self._lock:
            self._regions = [r for r in self._regions if r[2]() is not None]
            self._regions.append((start, start + int(host.nbytes), weakref.ref(host)))
            self.stats.host_allocs += 1
        return host

    def _pinned(self, leaf: Any) -> bool:
        """Whether ``leaf`` is contiguous and lies in memory of ``host_alloc`` (still alive)."""
        if not self._regions:
            return False
        ptr, contiguous = self.api.span(leaf)
        if not contiguous:
            return False
        end = ptr + int(leaf.nbytes)
        return any(a <= ptr and end <= b and r() is not None for a, b, r in self._regions)

    def _stage(self, buf: Any, off: int, leaf: Any) -> Any:
        stage = getattr(self.api, "stage", None)
        if stage is not None:
            return stage(buf, off, leaf)
        host = self.api.host_view(buf)
        view = host[off:off + leaf.nbytes].view(leaf.dtype).reshape(leaf.shape)
        np.copyto(view, leaf)
        return view

    def hand_out(self, batch: Any) -> Any:
        """On the caller's thread: its current stream waits for ``batch``'s copies (the batch, or the
        same structure with the arrays the device API gave the caller instead)."""
        with self._lock:
            got = self._pending.pop(id(batch), None)
            if got is not None:
                self._order.remove(id(batch))
            self._release()
        if got is None:
            return batch
        event, outs, shape = got
        mine = self.api.hand_out(event, outs)
        if mine is None:
            return batch
        return tree_map(shape, lambda x: mine[x.i] if isinstance(x, _Leaf) else x)


def tree_map(x: Any, fn: Any) -> Any:
    """``fn`` on every leaf of nested dicts, lists and tuples (named tuples kept)."""
    if isinstance(x, dict):
        return {k: tree_map(v, fn) for k, v in x.items()}
    if isinstance(x, tuple):
        items = [tree_map(v, fn) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
    if isinstance(x, list):
        return [tree_map(v, fn) for v in x]
    return fn(x)


class _Leaf:
    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


def device_api(output: str, device: Any) -> Any:
    """The device API of ``output``/``device`` where batches go to a CUDA device, else None."""
    if output == "cupy":
        return CupyCuda()
    if output == "torch" and device is not None:
        import torch

        if torch.device(device).type == "cuda":
            return TorchCuda(device)
    return None
