"""Elastic resume: a state saved by any rank of a run of world size W loads into every rank of a run
of world size W'; the rest of the epoch is dealt across the W' ranks exactly once with equal batch
counts (fewer than W' x batch_size left out, none repeated), and later epochs follow W''s plan.

Property tests on the pure index math (``xinsitu.index.plan.segment_plan``), and generators iterated end to
end (ranks in-process through ``rank=``/``world_size=``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xarray as xr
from hypothesis import given
from hypothesis import strategies as st

import xinsitu
from tests.index.test_plan import configs, spaces
from xinsitu.index.plan import epoch_plan, segment_plan
from xinsitu.index.sampling import SampleSpace


def _yielded(space: SampleSpace, hops: list[tuple[int, int]], world_size: int, batches: int | None,
             **cfg) -> tuple[list[np.ndarray], list[int]]:
    """Per rank of a run of ``world_size`` after ``hops``: the ids it yields in its first ``batches``
    batches (all where None), and every rank's batch count."""
    bs = cfg["batch_size"]
    out, counts = [], []
    for r in range(world_size):
        p = segment_plan(space, hops, rank=r, world_size=world_size, **cfg)
        ids = p.all_ids(space.offsets)
        assert len(ids) == p.n_samples
        out.append(ids if batches is None else ids[: batches * bs])
        counts.append(p.n_batches)
    return out, counts


def _check_epoch(space: SampleSpace, hops: list[tuple[int, int]], new_world: int, **cfg) -> None:
    bs = cfg["batch_size"]
    before = []
    for t, (w, b) in enumerate(hops):  # what each earlier run yielded, in lockstep
        ids, counts = _yielded(space, hops[:t], w, b, **cfg)
        assert len(set(counts)) == 1 and b <= counts[0]
        before += ids
    after, counts = _yielded(space, hops, new_world, None, **cfg)
    assert len(set(counts)) == 1, f"ranks yield different numbers of batches: {counts}"
    for ids, n in zip(after, counts, strict=True):
        sizes = [len(ids[i:i + bs]) for i in range(0, len(ids), bs)]
        assert len(sizes) == n and all(s == bs for s in sizes[:-1])
        if cfg["drop_last"]:
            assert all(s == bs for s in sizes)
    every = np.concatenate(before + after + [np.zeros(0, np.int64)])
    assert len(np.unique(every)) == len(every), "a sample is yielded twice"
    assert every.size == 0 or (every.min() >= 0 and every.max() < space.n_samples)
    # every sample no rank had yielded is dealt, but for fewer than W' x batch_size
    rest = space.n_samples - sum(len(x) for x in before)
    left_out = rest - sum(len(x) for x in after)
    assert 0 <= left_out < new_world * bs or rest == 0, (left_out, new_world, bs)


@given(spaces(), configs, st.integers(1, 5), st.integers(1, 6), st.data())
@pytest.mark.slow
def test_elastic_exactly_once(space, cfg, old_world, new_world, data):
    n = epoch_plan(space, rank=0, world_size=old_world, **cfg).n_batches
    stop = data.draw(st.integers(0, n))
    _check_epoch(space, [(old_world, stop)], new_world, **cfg)


@given(spaces(), configs, st.lists(st.integers(1, 5), min_size=2, max_size=3), st.integers(1, 6), st.data())
@pytest.mark.slow
def test_elastic_twice_in_one_epoch(space, cfg, worlds, new_world, data):
    """Resized twice (or more) inside one epoch: the hops chain, still exactly once."""
    hops: list[tuple[int, int]] = []
    for w in worlds:
        n = segment_plan(space, hops, rank=0, world_size=w, **cfg).n_batches
        hops.append((w, data.draw(st.integers(0, n))))
    _check_epoch(space, hops, new_world, **cfg)


@given(spaces(), configs, st.integers(1, 5))
@pytest.mark.slow
def test_no_hop_is_the_epoch_plan(space, cfg, world_size):
    for r in range(world_size):
        a = epoch_plan(space, rank=r, world_size=world_size, **cfg)
        b = segment_plan(space, [], rank=r, world_size=world_size, **cfg)
        assert np.array_equal(a.all_ids(space.offsets), b.all_ids(space.offsets))


@given(spaces(), configs, st.integers(1, 4), st.integers(1, 4), st.data())
def test_elastic_reads_only_the_pieces_it_yields(space, cfg, old_world, new_world, data):
    """A remainder plan's blocks hold the samples it yields: each id lies in one of its pieces."""
    n = epoch_plan(space, rank=0, world_size=old_world, **cfg).n_batches
    hops = [(old_world, data.draw(st.integers(0, n)))]
    for r in range(new_world):
        p = segment_plan(space, hops, rank=r, world_size=new_world, **cfg)
        ids = p.all_ids(space.offsets)
        unit, local = space.locate(ids)
        piece = {}
        for u, lo, hi in zip(p.units.tolist(), p.lo.tolist(), p.hi.tolist(), strict=True):
            piece.setdefault(u, []).append((lo, hi))
        assert all(any(lo <= loc < hi for lo, hi in piece[int(u)]) for u, loc in zip(unit, local, strict=True))
        assert p.n_samples <= int(p.buffer_offsets[-1])


def test_state_stays_small_json():
    """No sample list in the state: a resized epoch of 10^6 samples saves a few hundred bytes."""
    from xinsitu.index.sampling import SampleDim

    space = SampleSpace([SampleDim("t", 10**6, split=True)], {"t": np.arange(0, 10**6 + 1, 1000)}, np.arange(1000))
    cfg = dict(seed=0, epoch=0, shuffle=True, batch_size=32, block_chunks=16, drop_last=False)
    p = segment_plan(space, [(2, 5000), (3, 1000)], rank=1, world_size=4, **cfg)
    assert p.n_batches > 0
    state = {"elastic": [[2, 5000], [3, 1000]], "world_size": 4, "batch": 7}
    assert len(json.dumps(state)) < 100


# ---------------------------------------------------------------- generators end to end
@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> xr.Dataset:
    path = str(tmp_path_factory.mktemp("elastic") / "e.zarr")
    t = np.arange(203)
    xr.Dataset({"v": (("time", "x"), np.repeat(t[:, None].astype("f8"), 2, axis=1))},
               coords={"time": t}).to_zarr(path, zarr_format=3, encoding={"v": {"chunks": (7, 2)}})
    return xinsitu.open_zarr(path)


def _times(batch) -> list[int]:
    return batch["v"][:, 0].astype(np.int64).tolist()


@pytest.mark.parametrize(("old", "new", "stop", "drop_last"),
                         [(2, 4, 3, False), (2, 3, 1, True), (4, 2, 2, False), (3, 1, 4, False), (1, 3, 5, True),
                          (2, 4, 0, False), (2, 5, 10, False)])
@pytest.mark.slow
def test_generators_resume_elastically(ds, old, new, stop, drop_last):
    m = ds.insitu.split("time", fractions={"train": 0.9, "val": 0.1})
    kw = dict(batch_size=4, output="numpy", block_chunks=2, seed=5, drop_last=drop_last)
    olds = [ds.insitu.batches(m, "train", rank=r, world_size=old, **kw) for r in range(old)]
    for g in olds:
        g.set_epoch(3)
    its = [iter(g) for g in olds]
    before = [t for it in its for _ in range(stop) for t in _times(next(it))]  # ranks in lockstep
    states = [json.loads(json.dumps(g.state_dict())) for g in olds]
    for it in its:
        it.close()
    assert len({json.dumps({k: v for k, v in s.items() if k != "rank"}) for s in states}) == 1
    news = [ds.insitu.batches(m, "train", rank=r, world_size=new, **kw) for r in range(new)]
    for r, g in enumerate(news):
        g.load_state_dict(states[(r * 7) % old])  # any old rank's state
    assert len({len(g) for g in news}) == 1
    after = [[t for b in g for t in _times(b)] for g in news]
    assert {len(a) for a in after} == {len(news[0]) * 4} or not drop_last
    every = before + [t for a in after for t in a]
    assert len(every) == len(set(every)), "a sample is yielded twice"
    train = set(range(news[0].n_samples))
    assert set(every) <= train
    assert len(train) - len(every) < new * 4
    # a state saved in the middle of the resized epoch resumes there, at the same world size
    if len(news[0]) >= 2:
        g = news[0]
        it = iter(g)
        first = _times(next(it))
        state = json.loads(json.dumps(g.state_dict()))
        rest = [t for b in it for t in _times(b)]
        again = ds.insitu.batches(m, "train", rank=0, world_size=new, **kw)
        again.load_state_dict(state)
        assert [t for b in again for t in _times(b)] == rest
        assert first + rest == after[0]
    # later epochs follow the new world size's plan
    for g in news:
        g.set_epoch(4)
    fresh = [ds.insitu.batches(m, "train", rank=r, world_size=new, **kw) for r in range(new)]
    for g, f in zip(news, fresh, strict=True):
        f.set_epoch(4)
        assert [_times(b) for b in g] == [_times(b) for b in f]


def test_same_world_size_any_rank_resumes_in_place(ds):
    m = ds.insitu.split("time", fractions={"train": 0.9, "val": 0.1})
    kw = dict(batch_size=4, output="numpy", block_chunks=2, world_size=3)
    a = ds.insitu.batches(m, "train", rank=0, **kw)
    it = iter(a)
    next(it)
    next(it)
    state = a.state_dict()
    it.close()
    b = ds.insitu.batches(m, "train", rank=2, **kw)
    b.load_state_dict(state)  # rank 0's state, loaded by rank 2 of the same run
    ref = ds.insitu.batches(m, "train", rank=2, **kw)
    assert [_times(x) for x in b] == [_times(x) for x in ref][2:]


def test_elastic_state_checks(ds):
    m = ds.insitu.split("time", fractions={"train": 0.9, "val": 0.1})
    g = ds.insitu.batches(m, "train", batch_size=4, rank=0, world_size=2)
    state = g.state_dict()
    other = ds.insitu.batches(m, "train", batch_size=4, rank=0, world_size=4)
    for bad in ({**state, "elastic": [[0, 3]]}, {**state, "elastic": "x"}, {**state, "world_size": 0},
                {**state, "batch": 10**6}):
        with pytest.raises(ValueError):
            other.load_state_dict(bad)
    with pytest.raises(ValueError, match="batch_size"):
        ds.insitu.batches(m, "train", batch_size=5, rank=0, world_size=4).load_state_dict(state)
