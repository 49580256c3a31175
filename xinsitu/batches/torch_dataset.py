"""The torch surface: an ``IterableDataset`` over a ``BatchGenerator`` (imported lazily).

Meant for ``DataLoader(ds, batch_size=None, num_workers=0)``: xinsitu already reads in
parallel (many requests in flight on one event loop, decoding in threads), so workers
add processes, not throughput.

With ``num_workers = n > 0`` worker ``w`` yields one contiguous run of the rank's batches
(``xinsitu.index.plan.worker_batches``) and reads only the shuffle blocks that run draws from,
on its own event loop. The trade-off, chosen for I/O: the DataLoader yields the very
batches of ``num_workers=0`` (same samples, same values, same ``len``, so every rank
still yields the same number of batches), interleaved worker by worker — the order
depends on ``n`` as well as on ``(seed, epoch, world_size, rank)``. The round-robin
alternative (worker ``w`` takes batches ``w, w+n, ...``) keeps the serial order but
makes every worker read every block: ``n`` times the I/O. Here only a block that a run
boundary falls inside is read by two workers (at most ``n - 1`` blocks per epoch), and
each worker holds its own few blocks in memory.

``set_epoch``, on this dataset or on the generator it was made from, also reaches
``persistent_workers=True`` workers (the epoch lives in shared memory).
Under ``fork`` a worker reads a local archive with plain file I/O, whether
``xinsitu.open_zarr`` or ``xr.open_zarr`` opened it, even after the parent used obstore
(which cannot run in a forked child); one that would have to call obstore or Icechunk
(object storage, HTTP) fails at once with an error naming the fix instead of hanging
(``xinsitu.io.loop.refuse_after_fork``). A progress bar is shown
for ``num_workers=0`` only, and ``gen.io_stats`` counts the reads of this process only.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.utils.data

from xinsitu.index.plan import worker_batches
from xinsitu.index.state import make_state
from xinsitu.io import loop as _loop
from xinsitu.stores.backend import backend_for


class InsituIterableDataset(torch.utils.data.IterableDataset):
    """Batches of a ``BatchGenerator`` for a torch ``DataLoader`` (use ``batch_size=None``).

    Parameters
    ----------
    gen : BatchGenerator
        The generator; its ``rank``/``world_size`` pick this process's share.

    Notes
    -----
    ``state_dict``/``load_state_dict`` are what torchdata's ``StatefulDataLoader`` calls
    (in each worker when ``num_workers > 0``). A worker's state carries its place among
    the workers and only loads into that same worker; a state saved with
    ``num_workers=0`` (or by ``gen.state_dict()``) loads into any number of workers.
    """

    def __init__(self, gen: Any):
        super().__init__()
        self.gen = gen
        # what must reach workers after they took their copy of ``gen``, and the main process from them: [the
        # epoch ``set_epoch`` gave persistent workers (-1: none yet), whether an iteration's workers took the
        # resume loaded into ``gen`` before they started (one pass resumes, as with num_workers=0), that
        # iteration's id, the states loaded into ``gen`` so far (``gen._loads``), 1 + the epoch workers last
        # began (0: none yet), the process of the last worker 0 that began, whether the loss of a cache's
        # memory tier with the workers was said]
        self._shared = torch.tensor([-1, 0, 0, gen._loads, 0, 0, 0], dtype=torch.int64).share_memory_()
        self._resume: int | None = None  # next batch to yield, from a loaded state (workers)
        self._pos: int | None = None  # next batch this worker yields (rank numbering)
        self._iterated = False  # this copy has run an epoch in this worker process already

    def __len__(self) -> int:
        return len(self.gen)

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from the next iteration on, in this process and the workers."""
        self.gen.set_epoch(epoch)  # (which also tells the workers, through ``_shared``)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Small JSON-able state (the generator's, plus the worker's place among the workers)."""
        info = torch.utils.data.get_worker_info()
        if info is None:
            return self.gen.state_dict()
        start, _ = worker_batches(len(self.gen), info.num_workers, info.id)
        nxt = self._pos if self._pos is not None else max(start, self._resume or 0)
        return {**make_state(self.gen, self.gen.epoch, nxt), "worker": [info.id, info.num_workers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next iteration yields the batch after the last one saved."""
        info = torch.utils.data.get_worker_info()
        saved = state.get("worker") if isinstance(state, dict) else None
        here = None if info is None else [info.id, info.num_workers]
        if saved is not None and saved != here:
            where = "the main process (num_workers=0)" if here is None else f"worker {here[0]} of {here[1]}"
            raise ValueError(f"state was saved by DataLoader worker {saved[0]} of {saved[1]} and cannot be "
                             f"loaded into {where}: resume with the same num_workers (StatefulDataLoader "
                             "does this), or save the state with num_workers=0")
        if info is None:
            self.gen.load_state_dict({k: v for k, v in state.items() if k != "worker"} if isinstance(state, dict)
                                     else state)
            return
        self.gen._load_worker_state(state)
        self._resume, self._pos = int(state["batch"]), None

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        if info is None:
            return iter(self.gen)
        # set up now, not at the first batch: StatefulDataLoader saves a worker's state as soon
        # as it creates the iterator (a persistent worker, at the start of every epoch)
        _check_fork(self.gen)
        gen = self.gen
        epoch = int(self._shared[0])
        if self._iterated and int(self._shared[3]) != gen._loads:  # a persistent worker's copy predates a load
            # raised at the first batch, which the DataLoader hands to the caller (one raised here ends the worker)
            return _raise(RuntimeError(
                "a state was loaded into the generator (gen.load_state_dict) after this DataLoader's persistent "
                "workers took their copies of it: they cannot resume from it (they would repeat the epoch). Make a "
                "new DataLoader after loading a state, or checkpoint with torchdata's StatefulDataLoader, whose "
                "load_state_dict reaches its workers"))
        if self._iterated and epoch >= 0:  # a persistent worker: its copy of gen missed set_epoch
            gen.set_epoch(epoch)
        if info.id == 0 and not self._iterated:
            before = int(self._shared[5])
            if before and not _alive(before) and not int(self._shared[6]):
                # a fresh worker 0 where the last one has ended: workers that are not persistent, and what a
                # memory tier kept went with them (a live one is another DataLoader's, over the same dataset)
                self._shared[6] = int(gen.cache is not None and gen.cache.note_memory_lost_with_workers())
            self._shared[5] = os.getpid()
        self._iterated = True
        self._shared[4] = gen.epoch + 1  # the main process's gen.state_dict() cannot see where workers are
        start, stop = worker_batches(len(gen), info.num_workers, info.id)
        # a worker's own state (StatefulDataLoader), else one loaded into the generator before the workers
        # started (its copy here carries it): the rest of that epoch, each worker its part of it
        resume = self._resume if self._resume is not None else gen._resume_batch if self._claim(info) else 0
        gen._resume_batch = 0
        if resume:
            start = min(max(start, resume), stop)
        self._resume = None
        self._pos = start
        return self._batches(start, stop)

    def _claim(self, info: Any) -> bool:
        """Whether the workers of this DataLoader iteration take the resume loaded into ``gen`` before they
        started: the first iteration's do; non-persistent workers of a later one (the same epoch again,
        without ``set_epoch``) start from fresh copies of ``gen`` that still carry it, and yield the whole
        epoch instead. The workers of one iteration share its seed less their ids."""
        if not self.gen._resume_batch:
            return False
        iteration = info.seed - info.id
        if not int(self._shared[1]):  # the first to look: its iteration takes it (the id is written first,
            self._shared[2] = iteration  # so a worker seeing the flag sees the id)
            self._shared[1] = 1
            return True
        return int(self._shared[2]) == iteration

    def _batches(self, start: int, stop: int) -> Any:
        # no bar per worker (it would mislead); the DataLoader's caller can wrap the loader in one
        for batch in self.gen.iter_batches(start, stop, progress=False):
            self._pos = (self._pos or 0) + 1
            yield batch


def _alive(pid: int) -> bool:
    """Whether process ``pid`` is still running (a DataLoader's workers are joined as its iteration ends)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's: alive)
        return True
    return True


def _raise(e: BaseException) -> Any:
    """An iterator that raises ``e`` at its first ``next``."""
    raise e
    yield  # (a generator)


def _check_fork(gen: Any) -> None:
    """Fail at once (never hang) where a forked worker would have to call obstore or Icechunk.

    ``backend_for`` holds the fork policy: it gives a local archive plain file reads in a forked
    child, whichever store opened it, and raises ``_loop.ForkError`` for anything else.
    """
    if not _loop.in_forked_child():
        return
    for src in gen.sources.values():
        if src.stored:
            backend_for(src.array.store)
