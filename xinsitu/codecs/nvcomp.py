"""The device side of a GPU decode: the decoders, and the lifetimes of their streams and codecs (SPEC §4 "GPU").

The device side of a decode is a *decoder*: :class:`NvcompDecoder` (CuPy + ``nvidia.nvcomp``; its
decompression configs made once per batch shape, no stream synchronisation per call) or
:class:`StandInDecoder` (numpy for device memory, numcodecs/zlib for nvCOMP), behind the same interface
and with the same objects -- a stream per device and thread kept for the process, codecs that borrow it
by handle (:data:`LIFETIMES`) -- so that CI runs the very host-side steps, bit for bit against zarr, and
the objects' lifetimes. A decoder copies a staging's payloads to the device in ONE transfer and decodes
them with ONE batched call per compressor (a :class:`Call`), straight into the destinations.
:func:`gpu_modules` imports CuPy and nvCOMP, or names the extra to install.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from xinsitu.codecs.gpu_chain import ALGORITHMS, GpuChain, host_decode, payload
from xinsitu.codecs.staging import ALIGN, PinnedRing, Staging

#: seconds the exit hook waits for decodes under way before it frees the codecs and streams
EXIT_WAIT_S = 5.0


def _bytes_of(dest: Any) -> Any:
    """A destination (a C-contiguous array of the chunk's shape) as its bytes, uint8, 1-D."""
    return dest.reshape(-1).view(np.uint8)


# ------------------------------------------------------------------------------------------ lifetimes
class _Lifetimes:
    """The decode streams (one per device and thread, kept for the process) and the codecs that borrow
    them by handle (one per thread, stream and compressor; nvCOMP's codecs are not shared between
    threads). nvCOMP's codec holds its stream's raw handle: a stream destroyed before its codecs crashes
    the process when they are freed (a generator's objects collected in another order did, on an H200).
    So both live until the process exits, and at exit (an ``atexit`` hook, set with the first stream)
    the decodes under way are waited for (``EXIT_WAIT_S`` at most), then the codecs are freed, then the
    streams."""

    def __init__(self) -> None:
        self.streams: dict[tuple[str, int, int], Any] = {}  # (kind, device, thread) -> stream
        self.codecs: dict[tuple[int, int, str], Any] = {}  # (thread, stream handle, compressor) -> codec
        self.busy = 0  # decodes under way
        self.closed = False
        self._cond = threading.Condition()

    def stream(self, kind: str, device: int, make: Callable[[], Any]) -> Any:
        """This thread's decode stream on ``device`` (made by ``make`` on first use)."""
        key = (kind, device, threading.get_ident())
        got = self.streams.get(key)
        if got is None:
            with self._cond:
                if not self.streams and not self.codecs:
                    atexit.register(self.close)
                got = self.streams.setdefault(key, make())
        return got

    def codec(self, handle: int, compressor: str, make: Callable[[], Any]) -> Any:
        """This thread's codec of ``compressor`` on the stream of ``handle`` (made by ``make`` on first use)."""
        key = (threading.get_ident(), handle, compressor)
        got = self.codecs.get(key)
        if got is None:
            with self._cond:
                got = self.codecs.setdefault(key, make())
        return got

    def __enter__(self) -> None:
        with self._cond:
            if self.closed:
                raise RuntimeError("xinsitu: the interpreter is exiting; no more GPU decodes")
            self.busy += 1

    def __exit__(self, *exc: Any) -> None:
        with self._cond:
            self.busy -= 1
            self._cond.notify_all()

    def close(self) -> None:
        """At exit: wait for the decodes under way, then free the codecs, then the streams they borrow."""
        with self._cond:
            self.closed = True
            self._cond.wait_for(lambda: self.busy == 0, timeout=EXIT_WAIT_S)
            codecs, self.codecs = self.codecs, {}
        codecs.clear()  # first: they borrow the streams
        with self._cond:
            streams, self.streams = self.streams, {}
        streams.clear()


#: the process's decode streams and codecs (see ``_Lifetimes``)
LIFETIMES = _Lifetimes()
#: what the stand-in's codecs saw freed out of order (a codec freed after the stream it borrows)
LIFETIME_ERRORS: list[str] = []
_LIVE_STREAMS: set[int] = set()  # handles of the stand-in's streams not freed yet
_HANDLES = itertools.count(1)


class StandInStream:
    """A CUDA stream of the stand-in: a handle that codecs borrow (``ptr``), valid until it is freed."""

    def __init__(self) -> None:
        self.ptr = next(_HANDLES)
        self._live = _LIVE_STREAMS  # (held: module globals are gone late in interpreter shutdown)
        self._live.add(self.ptr)

    def __del__(self) -> None:
        self._live.discard(self.ptr)


class StandInCodec:
    """nvCOMP's codec as the stand-in has it: holding only its stream's handle (as nvCOMP does), decoding
    on the host (``host_decode``) straight into the destinations. One freed after its stream is what
    crashes nvCOMP: it is recorded in ``LIFETIME_ERRORS`` (and said on stderr)."""

    def __init__(self, compressor: str, stream: int):
        self.compressor, self.stream = compressor, stream
        self._live, self._errors, self._write = _LIVE_STREAMS, LIFETIME_ERRORS, os.write  # (as the stream's)

    def decode(self, parts: list[np.ndarray], outs: list[np.ndarray]) -> None:
        if self.stream not in self._live:
            raise RuntimeError(f"stand-in nvCOMP codec used after its stream {self.stream} was freed")
        for part, out in zip(parts, outs, strict=True):
            host_decode(self.compressor, part, out)

    def __del__(self) -> None:
        if self.stream not in self._live:
            msg = f"stand-in nvCOMP codec ({self.compressor}) freed after its stream {self.stream}"
            self._errors.append(msg)
            self._write(2, f"xinsitu: {msg}\n".encode())  # (fd 2: sys.stderr may be closed at exit)


class _Completed:
    """The stand-in's CUDA event: its work is done when it is recorded (the stand-in's device is the host)."""

    done = True

    def synchronize(self) -> None:
        pass


_COMPLETED = _Completed()


# ------------------------------------------------------------------------------------------ decoders
class Call(NamedTuple):
    """One batched decode: chunks of one compressor (None: stored uncompressed), their payloads at
    ``spans`` (offset, length) of the staging, decoded straight into ``outs`` (arrays of their chunk's
    shape); ``names`` say which chunk each is (words, or ``(variable, chunk, key)``: put in words only
    where an error names it)."""

    compressor: str | None
    spans: list[tuple[int, int]]
    outs: list[Any]
    names: list[Any]


class _Decoder:
    """What both decoders do the same: ``decode_staged`` copies a staging's payloads to the device in one
    transfer and runs one batched decode per ``Call``; ``decode_many`` is the same for a list of stored
    chunks of one chain (benches, tests). The device side is the subclass's (``_run``)."""

    kind = "?"

    def __init__(self, ring: PinnedRing):
        self.ring = ring
        self.transfers = self.decode_calls = 0
        self._lock = threading.Lock()  # the counters (batches run in several threads)

    def decode_staged(self, host: np.ndarray, calls: list[Call]) -> tuple[Any, Any]:
        """The payloads of ``calls`` (in ``host``, page-locked) copied to the device in ONE transfer (the
        span from the first to the last) and decoded by one batched call per ``Call`` into its outs, on
        this thread's decode stream, after the work queued so far on the thread's current stream (which
        may have used the destinations' memory last). Returns two events: the copy done (``host`` may be
        reused), everything done."""
        copied, done = self._staged(host, calls)
        with self._lock:
            self.transfers += 1
            self.decode_calls += sum(c.compressor is not None for c in calls)
        return copied, done

    def time_staged(self, host: np.ndarray, calls: list[Call]) -> float:
        """The seconds ``decode_staged`` of ``calls`` takes, transfer included, waited for: the first-use
        check's measure (the same chunks decoded again; not counted as a transfer)."""
        t0 = time.perf_counter()
        _, done = self._staged(host, calls)
        done.synchronize()
        return time.perf_counter() - t0

    def _staged(self, host: np.ndarray, calls: list[Call]) -> tuple[Any, Any]:
        spans = [s for c in calls for s in c.spans]
        lo = min(o for o, _ in spans)
        hi = max(o + n for o, n in spans)
        with LIFETIMES:
            return self._run(host, lo, hi, calls)

    def _run(self, host: np.ndarray, lo: int, hi: int, calls: list[Call]) -> tuple[Any, Any]:
        raise NotImplementedError

    def relax(self) -> bool:
        """Give up an optimisation the device's first decode may have failed on (True: something was
        given up, worth trying again)."""
        return False

    def decode_many(self, raws: list[Any], dests: list[Any], chain: GpuChain, where: list[str] | None = None) -> None:
        """Decode the stored bytes ``raws`` of chunks of ``chain`` into ``dests`` (arrays of the chunk's
        shape), through a staging and one ``decode_staged``; done when it returns."""
        if not chain.gpu:
            raise ValueError(f"this chain decodes on the CPU: {chain.reason}")
        if len(raws) != len(dests):
            raise ValueError(f"decode_many: {len(raws)} chunks but {len(dests)} destinations")
        if not raws:
            return
        names = where or [f"chunk {i}" for i in range(len(raws))]
        for d, w in zip(dests, names, strict=True):
            check_dest(d, chain, w)
        parts = [payload(r, chain, w) for r, w in zip(raws, names, strict=True)]
        staging = Staging(self.ring, sum(-(-len(p) // ALIGN) * ALIGN for p in parts))
        spans = [(staging.put(p), len(p)) for p in parts]
        host, _ = staging.finish()
        assert host is not None
        copied = None
        try:
            copied, done = self.decode_staged(host, [Call(chain.compressor, spans, list(dests), names)])
            done.synchronize()
        finally:
            staging.release(copied)


def check_dest(dest: Any, chain: GpuChain, where: str) -> None:
    """``dest`` must be a C-contiguous array of the chunk's shape and dtype (decoded straight into)."""
    if tuple(dest.shape) != chain.shape or dest.dtype != chain.dtype or not dest.flags.c_contiguous:
        raise ValueError(f"{where}: destination {tuple(dest.shape)} {dest.dtype} is not the chunk's "
                         f"{chain.shape} {chain.dtype} (C-contiguous)")


def _check_sizes(call: Call) -> None:
    """Stored-uncompressed payloads must be their chunk's size (the decoders copy them as they are)."""
    if call.compressor is None:
        for (_, n), out, w in zip(call.spans, call.outs, call.names, strict=True):
            if n != out.nbytes:
                raise ValueError(f"{_words(w)}: {n} bytes stored uncompressed, the chunk has {out.nbytes}")


def _words(name: Any) -> str:
    """``(variable, chunk, key)`` in words (words as they are)."""
    if isinstance(name, str):
        return name
    var, chunk, key = name
    return f"variable {var!r}, chunk {chunk}, key {key!r}"


class StandInDecoder(_Decoder):
    """The decoder with numpy for device memory and ``StandInCodec`` (numcodecs/zlib) for nvCOMP's: the
    same staging, transfer and batched calls as ``NvcompDecoder``, on a stand-in stream per thread kept
    for the process, with codecs that borrow it by handle."""

    kind = "stand-in"

    def __init__(self, ring: PinnedRing | None = None):
        super().__init__(ring or PinnedRing(lambda n: np.empty(n, dtype=np.uint8)))

    def _transfer(self, host: np.ndarray) -> np.ndarray:
        """The one host-to-"device" copy."""
        return host.copy()

    def _run(self, host: np.ndarray, lo: int, hi: int, calls: list[Call]) -> tuple[Any, Any]:
        stream = LIFETIMES.stream("stand-in", 0, StandInStream)
        device = self._transfer(host[lo:hi])
        for call in calls:
            _check_sizes(call)
            parts = [device[o - lo:o - lo + n] for o, n in call.spans]
            outs = [_bytes_of(d) for d in call.outs]
            if call.compressor is None:
                for p, o in zip(parts, outs, strict=True):
                    o[...] = p
                continue
            codec = LIFETIMES.codec(stream.ptr, call.compressor, functools.partial(StandInCodec, call.compressor,
                                                                                     stream.ptr))
            codec.decode(parts, outs)
        return _COMPLETED, _COMPLETED


class NvcompDecoder(_Decoder):
    """Decode on a CUDA device with nvCOMP (``from nvidia import nvcomp``) straight into CuPy arrays.

    Per thread a stream and its codecs, kept for the process (``LIFETIMES``); the staging's payloads go
    to the device in one ``set`` on that stream, the codec decodes them there into the destinations
    (``out=``) with a decompression config made once per batch shape (compressor and chunk sizes: from a
    compression config of those sizes, so no call synchronises the stream to read the chunks' headers),
    and an event after the copy releases the page-locked buffer for the next batch."""

    kind = "nvcomp"

    def __init__(self, ring: PinnedRing | None = None):
        cupy, nvcomp = gpu_modules()
        self.cupy, self.nvcomp = cupy, nvcomp
        super().__init__(ring or PinnedRing(
            lambda n: np.frombuffer(cupy.cuda.alloc_pinned_memory(n), dtype=np.uint8, count=n)))
        self.configs = True  # decompression configs made ahead (False: nvCOMP reads each batch's headers)
        self._configs: dict[tuple[int, str, tuple[tuple[int, int], ...]], Any] = {}

    def relax(self) -> bool:
        if not self.configs:
            return False
        self.configs = False
        return True

    def _config(self, codec: Any, compressor: str, outs: list[Any]) -> Any:
        """The decompression config of a batch of outputs of these sizes (None: let nvCOMP read them)."""
        if not self.configs:
            return None
        runs: list[list[int]] = []
        for o in outs:
            if runs and runs[-1][0] == o.nbytes:
                runs[-1][1] += 1
            else:
                runs.append([o.nbytes, 1])
        key = (id(codec), compressor, tuple((n, k) for n, k in runs))
        got = self._configs.get(key)
        if got is None:
            try:
                got = codec.decompression_config(codec.compression_config([o.nbytes for o in outs]))
            except Exception:  # noqa: BLE001 - an nvCOMP without configs made ahead: it reads the headers
                self.configs = False
                return None
            if len(self._configs) > 256:
                self._configs.clear()
            self._configs[key] = got
        return got

    def _run(self, host: np.ndarray, lo: int, hi: int, calls: list[Call]) -> tuple[Any, Any]:
        cupy, nvcomp = self.cupy, self.nvcomp
        stream = LIFETIMES.stream("cupy", int(cupy.cuda.runtime.getDevice()),
                                  lambda: cupy.cuda.Stream(non_blocking=True))
        after = cupy.cuda.Event(disable_timing=True)
        after.record(cupy.cuda.get_current_stream())
        with stream:
            stream.wait_event(after)
            device = cupy.empty(hi - lo, dtype=cupy.uint8)
            device.set(host[lo:hi], stream=stream)  # the ONE transfer
            copied = cupy.cuda.Event(disable_timing=True)
            copied.record(stream)
            for call in calls:
                _check_sizes(call)
                parts = [device[o - lo:o - lo + n] for o, n in call.spans]
                outs = [_bytes_of(d) for d in call.outs]
                if call.compressor is None:
                    for p, o in zip(parts, outs, strict=True):
                        o[...] = p
                    continue
                c = call.compressor
                codec = LIFETIMES.codec(int(stream.ptr), c, functools.partial(
                    nvcomp.Codec, algorithm=ALGORITHMS[c], bitstream_kind=nvcomp.BitstreamKind.RAW,
                    cuda_stream=int(stream.ptr)))
                cfg = self._config(codec, c, outs)
                more = {} if cfg is None else {"decompression_config": cfg}
                codec.decode(nvcomp.as_arrays(parts), out=nvcomp.as_arrays(outs), **more)
            done = cupy.cuda.Event(disable_timing=True)
            done.record(stream)
        return copied, done


def gpu_extra_hint() -> str:
    """The install line named by every error of a GPU option asked for without its packages."""
    return "pip install 'xinsitu[gpu-cu12]' (CUDA 12) or 'xinsitu[gpu-cu13]' (CUDA 13)"


def gpu_modules() -> tuple[Any, Any]:
    """(cupy, nvidia.nvcomp), or RuntimeError naming the extra to install."""
    try:
        import cupy

        nvcomp = importlib.import_module("nvidia.nvcomp")  # the nvidia-nvcomp-cu12/cu13 wheels
    except ImportError as e:
        raise RuntimeError(f"decode='gpu' needs cupy and nvCOMP ({e.name} is missing): {gpu_extra_hint()}") from None
    return cupy, nvcomp

