"""Real-GPU tests carry ``@pytest.mark.gpu`` and ``@pytest.mark.skipif(not CUDA, ...)``: they run where
torch sees a CUDA device and skip elsewhere."""

from __future__ import annotations


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


CUDA = _cuda()
