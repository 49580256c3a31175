"""PyTorch's ``IterableDataset`` over a batch generator (public face; the code is in
:mod:`xinsitu.batches.torch_dataset`). ``BatchGenerator.to_torch()`` makes one."""

from xinsitu.batches.torch_dataset import InsituIterableDataset

__all__ = ["InsituIterableDataset"]
