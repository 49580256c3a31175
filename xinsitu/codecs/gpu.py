"""Chunk decode on the GPU (nvCOMP), which variables take it, and whether it pays (SPEC §4 "GPU"): the
device sides and the choice of path.

* The device side of the GPU path: :class:`CupyGpu` (CuPy's current device, decoding with nvCOMP) or
  :class:`StandInGpu` (numpy for device memory, ``nvcomp.StandInDecoder`` for nvCOMP), so that CI runs
  the very same read, gather and build steps as a GPU does: device memory, the decoder, the chains that
  passed their check on first use and the verdicts of ``decode="auto"`` (on a device: kept for the
  process).
* The choice of path: :func:`resolve_decode` says where each variable's chunks decode (``decode=``
  "auto", "cpu" or "gpu"), :func:`chain_on_gpu` whether a variable's chunks still go to the device once
  its chain's first buffer was judged, :func:`gpu_status` whether the GPU can decode here, in words.

The rest of the GPU path has modules of its own: ``gpu_chain`` (which chains nvCOMP decodes, the bytes
it decodes of a chunk), ``staging`` (page-locked staging), ``nvcomp`` (the decoders, the lifetimes of
their streams and codecs) and ``gpu_batch`` (a buffer's chunks decoded together, the verdict).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from xinsitu.codecs.gpu_batch import Verdict
from xinsitu.codecs.gpu_chain import GpuChain, gpu_chain
from xinsitu.codecs.nvcomp import NvcompDecoder, StandInDecoder, gpu_extra_hint, gpu_modules
from xinsitu.io.mempool import ArrayPool

#: decode= values
DECODES = ("auto", "cpu", "gpu")


def chain_on_gpu(on_gpu: dict[str, GpuChain], name: str, gpu: Any, follow_verdicts: bool) -> GpuChain | None:
    """Variable ``name``'s chain where its chunks go to the device (decoded there, or kept there: in
    ``on_gpu``), else None. With ``follow_verdicts`` (``decode='auto'``), a chain whose first buffer decoded
    faster by the CPU path (``gpu.verdicts``) leaves ``on_gpu`` here: the CPU path from then on."""
    chain = on_gpu.get(name)
    if chain is not None and chain.gpu and follow_verdicts:
        verdict = gpu.verdicts.get(chain)
        if verdict is not None and not verdict.gpu_faster:
            on_gpu.pop(name, None)
            return None
    return chain


# ------------------------------------------------------------------------------------------ devices
class StandInGpu:
    """The device side of the GPU path with numpy for device memory and :class:`StandInDecoder` for
    nvCOMP: CI runs the very same read, gather and build steps as :class:`CupyGpu` does on a GPU."""

    kind = "stand-in"
    xp: Any = np

    def __init__(self) -> None:
        self._decoder: Any = None
        self._pool = ArrayPool(keep=4, alloc=self._alloc)  # device buffers, given back as host ones are
        self._lock = threading.Lock()
        self.checked: set[Any] = set()  # chains (and "kept") whose device work passed its check on first use
        self.verdicts: dict[GpuChain, Verdict] = {}  # chain -> its first buffer's two rates
        self.first_use = threading.Lock()  # held by a buffer checking a chain on first use (one at a time)

    def is_device(self, a: Any) -> bool:
        """Whether ``a`` is in device memory (for the stand-in, every array is: numpy is its device)."""
        return True

    def free(self) -> int:
        """Free device memory, in bytes."""
        return 1 << 40

    def __reduce__(self) -> tuple[Any, ...]:  # a worker process's copy starts with no device state
        return (type(self), ())

    def _make_decoder(self) -> Any:
        return StandInDecoder()

    def _alloc(self, nbytes: int) -> Any:
        return self.xp.empty(nbytes, dtype=np.uint8)

    def decoder(self) -> Any:
        """The decoder of this device (one for every chain: its staging ring is shared)."""
        with self._lock:
            if self._decoder is None:
                self._decoder = self._make_decoder()
            return self._decoder

    def judge(self, chain: GpuChain, nbytes: int, cpu_s: float, gpu_s: float) -> Verdict:
        """The verdict on a chain's first buffer: ``nbytes`` decoded by the CPU path in ``cpu_s`` seconds
        (the host's decode shared by the decode threads) and on the device in ``gpu_s`` (transfer and
        batched decode, waited for). The seam where a test sets the two rates."""
        return Verdict(nbytes / max(gpu_s, 1e-9), nbytes / max(cpu_s, 1e-9))

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A device array (a buffer's): one given back before, where one of that shape and dtype is free."""
        return self._pool.take(shape, dtype)

    def new(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A new device array (a batch's own, handed out)."""
        return self.xp.empty(shape, dtype=dtype)

    def give_back(self, arr: Any) -> None:
        self._pool.give_back(arr)

    def asarray(self, a: Any) -> Any:
        """``a`` (a host array) on the device."""
        return self.xp.array(a, copy=True)

    def to_host(self, a: Any) -> np.ndarray:
        return np.array(a, copy=True)

    def index(self, idx: np.ndarray) -> Any:
        """A host index array on the device (for a take or fancy index there)."""
        return idx

    def synchronize(self) -> None:
        """The work this thread queued on the device has completed."""


_CHECKED: dict[int, set[Any]] = {}  # device -> chains (and "kept") whose device work passed its check
_VERDICTS: dict[int, dict[GpuChain, Verdict]] = {}  # device -> chain -> its first buffer's two rates
_FIRST_USE: dict[int, threading.Lock] = {}  # device -> held while a chain is checked on first use


class CupyGpu(StandInGpu):
    """The device side of the GPU path on CuPy's current device, decoding with nvCOMP."""

    kind = "cupy"

    def __init__(self) -> None:
        try:
            import cupy
        except ImportError:
            raise RuntimeError(f"the GPU path needs CuPy: {gpu_extra_hint()}") from None
        super().__init__()
        self.xp = cupy
        # what passed its check on this device passed it for the process: a later generator does not
        # decode its first buffers twice (on the host too) to check nvCOMP again, and keeps the path
        # the first buffer's rates chose
        device = int(cupy.cuda.runtime.getDevice())
        self.checked = _CHECKED.setdefault(device, set())
        self.verdicts = _VERDICTS.setdefault(device, {})
        self.first_use = _FIRST_USE.setdefault(device, threading.Lock())

    def _make_decoder(self) -> Any:
        return NvcompDecoder()

    def asarray(self, a: Any) -> Any:
        return self.xp.asarray(np.ascontiguousarray(a))

    def to_host(self, a: Any) -> np.ndarray:
        return self.xp.asnumpy(a)  # type: ignore[no-any-return]

    def is_device(self, a: Any) -> bool:
        return isinstance(a, self.xp.ndarray)

    def free(self) -> int:
        return int(self.xp.cuda.runtime.memGetInfo()[0])

    def index(self, idx: np.ndarray) -> Any:
        return self.xp.asarray(idx)

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()

# ------------------------------------------------------------------------------------------ decode=
def gpu_status() -> str:
    """Whether ``decode='auto'`` can decode on the GPU here, in words (``python -m xinsitu doctor``)."""
    try:
        cupy, nvcomp = gpu_modules()
    except RuntimeError as e:
        return f"cpu only: {e}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver: what doctor is for
        return f"cpu only: nvCOMP {getattr(nvcomp, '__version__', '?')} is installed, no CUDA device ({e})"
    return (f"nvCOMP {getattr(nvcomp, '__version__', '?')} on {n} CUDA device(s): zstd, lz4, gzip and zlib chunks "
            "decode on the GPU where batches go to one (decode='auto')")


def check_decode(decode: Any) -> str:
    if not isinstance(decode, str):
        raise TypeError(f"decode must be one of {DECODES}, got {type(decode).__name__} {decode!r}")
    if decode not in DECODES:
        raise ValueError(f"decode must be one of {DECODES}, got {decode!r}")
    return decode


def resolve_decode(decode: Any, cuda_target: str | None, arrays: dict[str, Any],
                   has_modules: Any = None) -> dict[str, GpuChain]:
    """Where each variable's chunks decode. ``cuda_target``: None where batches go to a CUDA device,
    else why not (e.g. "output='numpy'"); ``arrays``: variable -> zarr array (None: not a stored
    zarr array). ``decode='gpu'`` that cannot be honoured raises, naming why; ``'auto'`` takes the
    GPU where it can; ``'cpu'`` never does."""
    decode = check_decode(decode)
    if decode == "cpu":
        return {n: GpuChain(False, "decode='cpu'") for n in arrays}
    if cuda_target is not None:
        if decode == "gpu":
            raise ValueError(f"decode='gpu' needs batches on a CUDA device (device='cuda:0' with output='torch', "
                             f"output='cupy', or a GPU jax device), not {cuda_target}")
        return {n: GpuChain(False, f"no CUDA device: {cuda_target}") for n in arrays}
    try:
        (has_modules or gpu_modules)()
    except RuntimeError as e:
        if decode == "gpu":
            raise
        return {n: GpuChain(False, f"the gpu extra is not installed ({e})") for n in arrays}
    chains = {n: (gpu_chain(a) if a is not None else GpuChain(False, "not a stored zarr array"))
              for n, a in arrays.items()}
    if decode == "gpu":
        bad = {n: c.reason for n, c in chains.items() if not c.gpu}
        if bad:
            raise ValueError("decode='gpu': nvCOMP cannot decode the chunks of "
                             + ", ".join(f"{n!r} ({r})" for n, r in bad.items())
                             + "; leave decode='auto' to decode those on the CPU, or variables=[...] out")
    return chains
