"""A buffer's chunks on their way to the device, and ``decode="auto"``'s verdict (SPEC §4 "GPU").

* A buffer's chunks on their way to the device (:class:`GpuBatch`): the read path's completion step
  hands each chunk's stored bytes to the batch (``GpuSlot``) instead of decoding them. They land ONCE
  on the host, in a page-locked staging buffer (``staging``): a local file is read straight into it,
  other bytes (obstore's) are copied in; the framing is stripped and a crc32c checked in the decode
  thread that fetched the chunk. Once every chunk of the buffer is in -- every variable's --
  ``flush`` copies the staging to the device in ONE transfer and decodes it with ONE batched call
  per compressor, straight into the destinations (``out=``: rows of a device buffer, or a sample's
  channels in a device batch). A chunk the device cannot decode is fetched again and decoded the
  CPU way by the reader.
* ``decode="auto"`` by measurement: the first buffer of each codec chain is decoded both ways (the
  first-use check, which compares them bit for bit) and timed; the faster path is kept for that
  chain for the rest of the process, on that device (:class:`Verdict`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from xinsitu.codecs.gpu_chain import GpuChain, GpuPathError, host_decode, payload_span
from xinsitu.codecs.nvcomp import Call, _words
from xinsitu.codecs.staging import ALIGN, Staging
from xinsitu.io import loop as _loop
from xinsitu.io.place import QUEUED


# ------------------------------------------------------------------------------------------ a buffer's chunks
@dataclass(frozen=True)
class Verdict:
    """How fast the first buffer of a codec chain decoded on the GPU and by the CPU path (decoded bytes
    per second), and so which path ``decode="auto"`` keeps for that chain."""

    gpu_rate: float
    cpu_rate: float

    @property
    def gpu_faster(self) -> bool:
        return self.gpu_rate > self.cpu_rate

    def words(self) -> str:
        """"GPU 2.1 GB/s < CPU 7.8 GB/s, measured on the first buffer"."""
        sign = ">" if self.gpu_faster else "<" if self.gpu_rate < self.cpu_rate else "="
        return f"GPU {_rate(self.gpu_rate)} {sign} CPU {_rate(self.cpu_rate)}, measured on the first buffer"


def _rate(r: float) -> str:
    return f"{r / 1e9:.1f} GB/s" if r >= 1e8 else f"{r / 1e6:.1f} MB/s"


class _Entry(NamedTuple):
    chain: GpuChain
    off: int  # offset of the payload in the staging (negative: kept aside, see ``Staging.finish``)
    n: int
    dest: Any
    name: tuple[str, tuple[int, ...], str]  # (variable, chunk, key)


@dataclass
class Flushed:
    """What a ``GpuBatch.flush`` did: chunks decoded on the device per chain, chains whose check on first
    use failed (their chunks are not in place: the CPU path takes them over), chains that passed it,
    and chunks the device could not decode (``(chain, dest, name)``: to fetch again and decode the CPU
    way), and the seconds it took."""

    decoded: dict[GpuChain, int] = field(default_factory=dict)
    failed: dict[GpuChain, GpuPathError] = field(default_factory=dict)
    checked: list[GpuChain] = field(default_factory=list)
    refetch: list[tuple[GpuChain, Any, tuple[str, tuple[int, ...], str]]] = field(default_factory=list)
    seconds: float = 0.0


class GpuBatch:
    """A buffer's chunks decoded on the GPU -- every variable's -- collected by the read path's completion
    step (``GpuSlot``, in the decode threads) into one staging and decoded together by ``flush``.

    ``add`` finds or copies a chunk's bytes in the staging (a local read put them there already) and
    leaves its framing off there, checking a crc32c, in the calling decode thread; a chunk whose stored
    bytes are not what the chain says goes to the CPU way (``Flushed.refetch``). ``add_fill`` notes a
    chunk with no object, given its fill value at ``flush``. A chunk is named by ``(variable, chunk, key)``.
    ``capacity``: the staging's bytes (the chunks' ``GpuChain.bound``)."""

    def __init__(self, decoder: Any, capacity: int, asarray: Any = np.asarray):
        self.decoder, self.asarray = decoder, asarray  # asarray: a host array onto the device
        self.staging = Staging(decoder.ring, capacity)
        self.entries: list[_Entry] = []
        self.bad: list[tuple[GpuChain, Any, tuple[str, tuple[int, ...], str]]] = []
        self.fills: list[tuple[Any, np.ndarray]] = []
        self._lock = threading.Lock()

    def add(self, raw: Any, chain: GpuChain, dest: Any, name: tuple[str, tuple[int, ...], str]) -> None:
        staging = self.staging
        at = staging.locate(raw)
        view = memoryview(raw).cast("B") if at is None else raw
        try:
            a, b = payload_span(view, chain, _words(name))
        except ValueError:  # not a chunk of this chain (damaged, or framed otherwise): the CPU way decides
            with self._lock:
                self.bad.append((chain, dest, name))
            return
        if at is None:
            off = staging.put(view[a:b])
        elif (at + a) % ALIGN:  # framing before the payload (lz4, zlib, gzip): moved to the aligned start
            buf = staging.buf
            assert buf is not None
            buf[at:at + b - a] = buf[at + a:at + b]  # (numpy copies overlapping ranges correctly)
            off = at
        else:
            off = at + a
        with self._lock:
            self.entries.append(_Entry(chain, off, b - a, dest, name))

    def add_fill(self, dest: Any, value: np.ndarray) -> None:
        with self._lock:
            self.fills.append((dest, value))

    def flush(self, gpu: Any = None) -> Flushed:
        """Decode every chunk added (and put the fill values in place); done on the device when it returns.

        With ``gpu`` (the device side), the chunks of a chain it has not checked yet (``gpu.checked``) are
        decoded on the host too, both timed, and compared bit for bit: a chain that fails is in
        ``Flushed.failed``; the two rates are ``gpu.judge``d into ``gpu.verdicts``."""
        t0 = time.perf_counter()
        with self._lock:
            entries, fills, bad = self.entries, self.fills, self.bad
            self.entries, self.fills, self.bad = [], [], []
        out = Flushed(refetch=list(bad))
        staging = self.staging
        host, moved = staging.finish()
        if moved:
            entries = [e._replace(off=moved[-e.off - 1]) if e.off < 0 else e for e in entries]
        copied = None
        try:
            first = [] if gpu is None else list(dict.fromkeys(e.chain for e in entries if e.chain not in gpu.checked))
            for chain in first:
                mine = [e for e in entries if e.chain == chain]
                try:
                    out.decoded[chain] = self._first_use(host, chain, mine, gpu, out)
                    out.checked.append(chain)
                except GpuPathError as e:
                    out.failed[chain] = e
            rest = [e for e in entries if e.chain not in first]
            if rest:
                assert host is not None
                copied = self._decode(host, rest, out)
        finally:
            staging.release(copied)
        for dest, value in fills:
            dest[...] = self.asarray(value)
        out.seconds = time.perf_counter() - t0
        return out

    def _decode(self, host: np.ndarray, entries: list[_Entry], out: Flushed) -> Any:
        """``entries`` decoded: one transfer, one batched call per compressor; where that fails, one by one,
        and those that fail alone are left to the CPU way. The event of the (last) copy."""
        calls = _calls(entries)
        try:
            copied, done = self.decoder.decode_staged(host, calls)
            done.synchronize()
        except Exception:  # noqa: BLE001 - which chunk: decoded one by one below
            copied = None
            for e in entries:
                try:
                    copied, done = self.decoder.decode_staged(host, _calls([e]))
                    done.synchronize()
                except Exception:  # noqa: BLE001 - fetched again and decoded the CPU way, named there if it fails
                    out.refetch.append((e.chain, e.dest, e.name))
                    continue
                out.decoded[e.chain] = out.decoded.get(e.chain, 0) + 1
            return copied
        for e in entries:
            out.decoded[e.chain] = out.decoded.get(e.chain, 0) + 1
        return copied

    def _first_use(self, host: np.ndarray | None, chain: GpuChain, entries: list[_Entry], gpu: Any,
                   out: Flushed) -> int:
        """The first buffer of ``chain`` on this device: decoded on the host (timed: one thread's rate, times
        the decode threads, at most one chunk each: the CPU path's) and on the device (its payloads packed
        together, as a buffer of them alone would be, then one transfer and one batched call, waited for),
        compared bit for bit, then decoded on the device again, timed (the first time pays for the device
        side's set-up); the verdict kept in ``gpu.verdicts``. ``GpuPathError`` where the device's decode
        fails or differs (after giving up what ``decoder.relax`` gives up, once). The number of chunks
        decoded."""
        assert host is not None
        ref, good = [], []
        t0 = time.perf_counter()
        for e in entries:
            r = np.empty(chain.nbytes, dtype=np.uint8)
            try:
                host_decode(chain.compressor, host[e.off:e.off + e.n], r)
            except Exception:  # noqa: BLE001 - the data, not the device: fetched again the CPU way, and named
                out.refetch.append((e.chain, e.dest, e.name))
                continue
            ref.append(r)
            good.append(e)
        cpu_s = time.perf_counter() - t0
        if not good:
            return 0
        ring = self.decoder.ring
        dense = Staging(ring, sum(-(-e.n // ALIGN) * ALIGN for e in good))
        spans = [(dense.put(host[e.off:e.off + e.n].data), e.n) for e in good]
        packed, _ = dense.finish()
        assert packed is not None
        call = [Call(chain.compressor, spans, [e.dest for e in good], [e.name for e in good])]
        copied = None
        try:
            for attempt in (0, 1):
                try:
                    copied, done = self.decoder.decode_staged(packed, call)
                    done.synchronize()
                    for r, e in zip(ref, good, strict=True):
                        if r.tobytes() != np.ascontiguousarray(gpu.to_host(e.dest)).view(np.uint8).tobytes():
                            raise ValueError(f"{_words(e.name)} decoded on the device differs from the host's decode")
                    # timed the second time: the first pays the device side's set-up (codecs, kernels)
                    gpu_s = self.decoder.time_staged(packed, call)
                    break
                except Exception as err:  # noqa: BLE001 - said, and the CPU path takes over
                    if attempt == 0 and self.decoder.relax():
                        continue
                    raise GpuPathError(f"{type(err).__name__}: {err}") from err
        finally:
            dense.release(copied)
        nbytes = chain.nbytes * len(good)
        gpu.verdicts[chain] = gpu.judge(chain, nbytes, cpu_s / min(len(good), _loop.decode_threads()), gpu_s)
        return len(good)


def _calls(entries: list[_Entry]) -> list[Call]:
    """One ``Call`` per compressor, its chunks grouped by chain (so that a batch of the same chunks has
    the same sizes in the same order: one decompression config)."""
    by: dict[str | None, list[_Entry]] = {}
    for e in sorted(entries, key=lambda e: (e.chain.nbytes, e.chain.reason)):
        by.setdefault(e.chain.compressor, []).append(e)
    return [Call(c, [(e.off, e.n) for e in es], [e.dest for e in es], [e.name for e in es]) for c, es in by.items()]


class GpuSlot:
    """The destination of a chunk decoded on the GPU (``decode.Destination``): ``out``, a device array of
    the chunk's shape (a row of a device buffer, a sample's channels in a device batch). ``decode`` only
    hands the bytes to ``batch`` (``QUEUED``), which decodes the buffer's chunks together once all are
    in; ``name``: ``(variable, chunk, key)``."""

    __slots__ = ("batch", "out", "chain", "name")

    def __init__(self, batch: GpuBatch, out: Any, chain: GpuChain, name: tuple[str, tuple[int, ...], str]):
        self.batch, self.out, self.chain, self.name = batch, out, chain, name

    def decode(self, dec: Any, raw: Any) -> str:
        self.batch.add(raw, self.chain, self.out, self.name)
        return QUEUED

    def fill(self, dec: Any) -> None:
        self.batch.add_fill(self.out, dec.fill())

