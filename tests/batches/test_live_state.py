"""``set_epoch`` during an iteration: the running iterator keeps its epoch, ``state_dict()``
describes the last batch it handed out, and the new epoch starts at the next ``iter()``."""

from __future__ import annotations

import json

import xinsitu
from tests.support.resume_check import epoch_records


def _make(ds, m):
    return ds.insitu.batches(m, "train", batch_size=8, block_chunks=2, output="numpy", seed=5)


def test_set_epoch_mid_iteration_keeps_the_running_state(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    ref = _make(ds, m)
    epoch0 = epoch_records(ref)
    ref.set_epoch(1)
    epoch1 = epoch_records(ref)
    assert len(epoch0) > 8 and epoch0 != epoch1

    gen = _make(ds, m)
    it = iter(gen)
    got = epoch_records(next(it) for _ in range(7))
    gen.set_epoch(1)  # mid-epoch: the running iterator is not affected
    state = json.loads(json.dumps(gen.state_dict()))
    assert (state["epoch"], state["batch"]) == (0, 7)
    got += epoch_records([next(it)])
    assert (gen.state_dict()["epoch"], gen.state_dict()["batch"]) == (0, 8)
    got += epoch_records(it)
    assert got == epoch0  # epoch 0 to its end
    assert (gen.state_dict()["epoch"], gen.state_dict()["batch"]) == (1, 0)  # the iteration ended: epoch 1 now
    assert epoch_records(gen) == epoch1

    # the state saved after batch 7 resumes epoch 0 at batch 8: nothing lost, nothing repeated
    fresh = _make(ds, m)
    fresh.load_state_dict(state)
    assert epoch_records(fresh) == epoch0[7:]


def test_iterator_keeps_the_epoch_it_was_made_in(era5_path):
    """``iter()`` fixes the epoch: ``set_epoch`` before the first batch counts from the next ``iter()``."""
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    ref = _make(ds, m)
    epoch0 = epoch_records(ref)
    gen = _make(ds, m)
    it = iter(gen)
    gen.set_epoch(3)
    assert epoch_records(it) == epoch0
    ref.set_epoch(3)
    assert epoch_records(gen) == epoch_records(ref)
