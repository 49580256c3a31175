"""The torch surface: an ``IterableDataset`` over a ``BatchGenerator`` (imported lazily).

Use it with ``DataLoader(ds, batch_size=None, num_workers=0)``: xinsitu already reads in
parallel. With ``num_workers > 0`` worker ``w`` of ``n`` yields batches ``w, w+n, ...``
of the epoch, so the DataLoader, which takes one batch from each worker in turn,
yields exactly the batches (and order) of ``num_workers=0``.
"""

from __future__ import annotations

from typing import Any

import torch.utils.data

from xinsitu import _loop
from xinsitu.decode import store_root
from xinsitu.backend import FORK_HELP


class InsituIterableDataset(torch.utils.data.IterableDataset):
    """Batches of a ``BatchGenerator`` for a torch ``DataLoader`` (``batch_size=None``)."""

    def __init__(self, gen: Any):
        super().__init__()
        self.gen = gen

    def __len__(self) -> int:
        return len(self.gen)

    def set_epoch(self, epoch: int) -> None:
        self.gen.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.gen.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gen.load_state_dict(state)

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        if info is None or info.num_workers == 1:
            if info is not None:
                _check_fork(self.gen)
            yield from self.gen
            return
        _check_fork(self.gen)
        n, w = info.num_workers, info.id
        start = self.gen._resume_batch
        for i, batch in enumerate(self.gen, start=start):
            if i % n == w:
                yield batch


def _check_fork(gen: Any) -> None:
    """Fail at once (never hang) where a forked worker would have to call obstore."""
    if not _loop.in_forked_child():
        return
    for src in gen.sources.values():
        if src.stored and store_root(src.array.store)[0] == "obstore":
            raise RuntimeError(FORK_HELP)
