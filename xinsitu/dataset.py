"""The map-style dataset, for a ``torch.utils.data.DataLoader`` with workers and a sampler (public face; the
code is in :mod:`xinsitu.batches.mapstyle`). ``ds.insitu.dataset(...)`` makes one."""

from xinsitu.batches.mapstyle import InsituDataset, SampleBatch, collate

__all__ = ["InsituDataset", "SampleBatch", "collate"]
