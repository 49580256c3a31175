"""Real-GPU tests carry ``@pytest.mark.gpu`` and ``@pytest.mark.skipif(not CUDA, ...)``: they run where
torch sees a CUDA device and skip elsewhere."""

from __future__ import annotations

from xinsitu.cache.device_tier import HostArrays


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


CUDA = _cuda()


class CountingArrays(HostArrays):
    """The device cache tier's stand-in arrays, counting the calls that copy on the "device" (takes and
    scatters: a chunk copied on its own is not one)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def take(self, slab, rows):
        self.calls += 1
        return super().take(slab, rows)

    def take_into(self, slab, rows, out):
        self.calls += 1
        super().take_into(slab, rows, out)

    def scatter(self, out, pos, values):
        self.calls += 1
        super().scatter(out, pos, values)
