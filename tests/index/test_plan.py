"""Property tests of the pure index math (no I/O): exactly once, disjoint ranks, equal
batch counts, determinism, resume offsets and DataLoader worker shares."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xinsitu.index import shuffle as _shuffle
from xinsitu.index.plan import EpochPlan, epoch_plan, plan_head, rank_share, unit_order, worker_batches
from xinsitu.index.sampling import EqualOffsets, SampleDim, SampleSpace

settings.register_profile("xinsitu", max_examples=150, deadline=None, derandomize=True)
settings.load_profile("xinsitu")


@st.composite
def spaces(draw: st.DrawFn) -> SampleSpace:
    """A split of a random chunk grid (one or two split dims), with windows and ``over`` dims; a third
    of them regular (chunks of one size, as ``unit_size`` and the O(share) plan need)."""
    kind = draw(st.integers(0, 2))
    if kind == 2:
        size, n = draw(st.integers(1, 4)), draw(st.integers(1, 40))
        edges = np.arange(n + 1, dtype=np.int64) * size
        blocks = draw(st.lists(st.integers(0, n - 1), min_size=1, unique=True).map(sorted))
        width = draw(st.sampled_from([1, 1, 2]))
        dims = [SampleDim("t", int(edges[-1]), width, 1, keep=width > 1, split=True)]
        if draw(st.booleans()):
            dims.append(SampleDim("o", draw(st.integers(1, 3))))
        return SampleSpace(dims, {"t": edges}, np.array(blocks))
    if kind == 1:
        chunks = draw(st.lists(st.integers(1, 6), min_size=1, max_size=12))
        edges = np.concatenate([[0], np.cumsum(chunks)])
        blocks = draw(st.lists(st.integers(0, len(chunks) - 1), min_size=1, unique=True).map(sorted))
        width = draw(st.integers(1, 3))
        dims = [SampleDim("t", int(edges[-1]), width, 1, keep=width > 1, split=True)]
        if draw(st.booleans()):
            dims.append(SampleDim("o", draw(st.integers(1, 3))))
        return SampleSpace(dims, {"t": edges}, np.array(blocks))
    cy = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    cx = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    ey, ex = np.concatenate([[0], np.cumsum(cy)]), np.concatenate([[0], np.cumsum(cx)])
    blocks = draw(st.lists(st.integers(0, len(cy) * len(cx) - 1), min_size=1, unique=True).map(sorted))
    dims = [SampleDim("y", int(ey[-1]), split=True), SampleDim("x", int(ex[-1]), split=True)]
    return SampleSpace(dims, {"y": ey, "x": ex}, np.array(blocks))


configs = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1),
    "epoch": st.integers(0, 50),
    "shuffle": st.booleans(),
    "batch_size": st.integers(1, 7),
    "block_chunks": st.integers(1, 5),
    "drop_last": st.booleans(),
})
world_sizes = st.integers(1, 5)


def plans(space: SampleSpace, world_size: int, **cfg) -> list[EpochPlan]:
    return [epoch_plan(space, rank=r, world_size=world_size, **cfg) for r in range(world_size)]


def batches_of(plan: EpochPlan, ids: np.ndarray) -> list[np.ndarray]:
    return [ids[slice(*plan.batch_span(i))] for i in range(plan.n_batches)]


@given(spaces(), configs, world_sizes)
def test_exactly_once_across_ranks(space, cfg, world_size):
    ps = plans(space, world_size, **cfg)
    ids = [p.all_ids(space.offsets) for p in ps]
    n, bs = space.n_samples, cfg["batch_size"]
    every = np.concatenate(ids)
    assert len(np.unique(every)) == len(every), "a sample is yielded twice"
    assert every.size == 0 or (every.min() >= 0 and every.max() < n)
    assert 0 <= n - len(every) < world_size * bs or n == len(every) == 0, "too many samples left out"
    assert len({p.n_batches for p in ps}) == 1, "ranks yield different numbers of batches"
    for p, i in zip(ps, ids, strict=True):
        assert len(i) == p.n_samples
        sizes = [len(b) for b in batches_of(p, i)]
        assert sum(sizes) == p.n_samples
        assert all(s == bs for s in sizes[:-1])
        if cfg["drop_last"]:
            assert all(s == bs for s in sizes)
        # every id comes from a piece of this rank's plan (what it reads is what it yields from)
        unit, local = space.locate(i)
        piece = {int(u): (int(lo), int(hi)) for u, lo, hi in zip(p.units, p.lo, p.hi, strict=True)}
        assert all(piece[int(u)][0] <= loc < piece[int(u)][1] for u, loc in zip(unit, local, strict=True))
    if world_size == 1 and not cfg["drop_last"]:
        assert np.array_equal(np.sort(every), np.arange(n))


@given(spaces(), configs, world_sizes)
@pytest.mark.slow
def test_whole_units_are_read_by_one_rank(space, cfg, world_size):
    ps = plans(space, world_size, **cfg)
    whole = all(np.array_equal(p.lo, np.zeros_like(p.lo)) and np.array_equal(p.hi, space.counts[p.units])
                for p in ps)
    units = np.concatenate([p.units for p in ps])
    if whole:
        assert len(np.unique(units)) == len(units), "a chunk block is read by two ranks"
    # cut inside units or not, a unit is shared by at most the ranks its samples were cut between
    pieces = [(int(u), int(lo), int(hi)) for p in ps for u, lo, hi in zip(p.units, p.lo, p.hi, strict=True)]
    assert len(set(pieces)) == len(pieces)


@given(st.lists(st.integers(0, 20), min_size=0, max_size=30), world_sizes, st.integers(1, 9), st.booleans())
def test_rank_share_bounds(counts, world_size, batch_size, drop_last):
    counts = np.array(counts, dtype=np.int64)
    shares = [rank_share(counts, world_size, r, batch_size, drop_last) for r in range(world_size)]
    n_batches = {(n // batch_size if drop_last else -(-n // batch_size)) for *_, n in shares}
    assert len(n_batches) == 1
    for pos, lo, hi, n in shares:
        assert np.all(lo >= 0) and np.all(lo <= hi) and np.all(hi <= counts[pos])
        assert n <= int((hi - lo).sum())
    assert 0 <= counts.sum() - sum(n for *_, n in shares) < world_size * batch_size or counts.sum() == 0
    # an epoch has a batch wherever an equal cut of the samples gives every rank one (few big units
    # among many ranks: whole units left one rank, and so every rank, without a batch)
    q = int(counts.sum()) // world_size
    if q >= (batch_size if drop_last else 1):
        assert n_batches != {0}


@pytest.mark.parametrize("equal", [False, True])
def test_few_big_units_among_many_ranks_still_give_every_rank_a_batch(equal):
    """3 days of hourly validation, a day per chunk, on 8 ranks with batch_size 32: every rank gets one
    batch of 9 (whole days gave 5 ranks no day, so no rank a batch: the split was refused)."""
    counts = np.broadcast_to(np.int64(24), (3,)) if equal else np.array([24, 24, 24], dtype=np.int64)
    shares = [rank_share(counts, 8, r, 32, False) for r in range(8)]
    assert [n for *_, n in shares] == [9] * 8
    assert [n for *_, n in (rank_share(counts, 8, r, 32, True) for r in range(8))] == [0] * 8  # drop_last: none


@given(st.integers(1, 60), st.integers(1, 9), world_sizes | st.integers(6, 80), st.integers(1, 9), st.booleans())
def test_rank_share_of_equal_units_is_the_arithmetic_cut(n_units, size, world_size, batch_size, drop_last):
    """Equal counts given as a stride-0 array are cut by arithmetic on positions (O(share)); the cut
    is the one of the same counts given as a plain array (prefix sums), for every rank -- including
    many ranks over few units, where cuts fall inside units."""
    plain = np.full(n_units, size, dtype=np.int64)
    equal = np.broadcast_to(np.int64(size), (n_units,))
    for r in range(world_size):
        want, got = rank_share(plain, world_size, r, batch_size, drop_last), rank_share(equal, world_size, r,
                                                                                       batch_size, drop_last)
        for w, g in zip(want[:3], got[:3], strict=True):
            assert g.dtype == np.int64 and np.array_equal(w, g)
        assert want[3] == got[3]


def _plan_of_whole_order(space: SampleSpace, *, rank: int, world_size: int, **cfg) -> EpochPlan:
    """The plan as made before the O(share) path: the whole unit order, its counts, then the cut."""
    order = unit_order(space, seed=cfg["seed"], epoch=cfg["epoch"], shuffle=cfg["shuffle"],
                       block_chunks=cfg["block_chunks"])
    pos, lo, hi, n = rank_share(np.array(space.counts)[order], world_size, rank, cfg["batch_size"],
                                cfg["drop_last"])
    return EpochPlan(units=order[pos], lo=lo, hi=hi, n_samples=n, rank=rank, world_size=world_size, **cfg)


@given(spaces(), configs, world_sizes | st.integers(6, 50), st.data())
def test_the_share_of_equal_units_is_the_share_of_the_whole_order(space, cfg, world_size, data):
    """Where units are of equal size a rank orders only its share (``shuffle.units_at`` at its
    positions): the plan is the one of ordering every unit and cutting."""
    rank = data.draw(st.integers(0, world_size - 1))
    got = epoch_plan(space, rank=rank, world_size=world_size, **cfg)
    want = _plan_of_whole_order(space, rank=rank, world_size=world_size, **cfg)
    for f in ("units", "lo", "hi"):
        assert np.array_equal(getattr(got, f), getattr(want, f)), f
    assert got.n_samples == want.n_samples and got.n_batches == want.n_batches


def test_a_regular_split_holds_no_per_unit_array():
    """10^7 one-step chunk blocks in one run: counts, offsets and block ids are arithmetic, and rank 0
    of 1,024 plans its 1/1024 share without an array of every unit."""
    n = 10_000_000
    space = SampleSpace([SampleDim("t", n, split=True)], {"t": np.arange(n + 1, dtype=np.int64)},
                        _blocks_range(0, 8 * n // 10))
    assert space.unit_size == 1 and space.counts.strides == (0,) and isinstance(space.offsets, EqualOffsets)
    assert space.n_samples == 8 * n // 10 and space.blocks[123] == 123
    assert [a.tolist() for a in space.locate(np.array([0, 5, 7_999_999]))] == [[0, 5, 7_999_999], [0, 0, 0]]
    p = epoch_plan(space, seed=0, epoch=3, shuffle=True, batch_size=32, block_chunks=16, drop_last=False, rank=0,
                   world_size=1024)
    assert len(p.units) == 7812 and p.n_samples == 7812
    assert np.array_equal(p.units, _shuffle.units_at(np.arange(7812), 8 * n // 10, 0, 3))
    per_unit = [k for k, v in vars(space).items()
                if isinstance(v, np.ndarray) and v.size >= n // 2 and v.strides != (0,)]
    assert not per_unit, f"per-unit arrays held: {per_unit}"


def _blocks_range(a: int, b: int):
    from xinsitu.index.runs import Blocks

    return Blocks.range(a, b)


@given(spaces(), configs, world_sizes, st.data())
def test_order_is_a_pure_function(space, cfg, world_size, data):
    rank = data.draw(st.integers(0, world_size - 1))
    a = epoch_plan(space, rank=rank, world_size=world_size, **cfg)
    again = SampleSpace(space.dims, {d.name: e for d, e in zip(space.split_dims, space.edges, strict=True)},
                        np.asarray(space.blocks))  # rebuilt from scratch, as in another process
    b = epoch_plan(again, rank=rank, world_size=world_size, **cfg)
    assert np.array_equal(a.all_ids(space.offsets), b.all_ids(again.offsets))
    for f in ("units", "lo", "hi"):
        assert np.array_equal(getattr(a, f), getattr(b, f))
        assert getattr(a, f).dtype == np.int64  # numpy arrays, never lists (forked workers copy those)


@given(spaces(), configs, world_sizes)
def test_epochs_differ(space, cfg, world_size):
    cfg = {**cfg, "shuffle": True}
    seq = [np.concatenate([p.all_ids(space.offsets) for p in plans(space, world_size, **{**cfg, "epoch": e})])
           for e in (cfg["epoch"], cfg["epoch"] + 1)]
    if world_size == 1 and not cfg["drop_last"]:
        assert np.array_equal(np.sort(seq[0]), np.sort(seq[1]))
    # with 16+ samples to permute the chance that two epochs agree is below 1e-9
    if len(seq[0]) >= 16:
        assert not np.array_equal(seq[0], seq[1])


@given(spaces(), configs, world_sizes)
def test_unshuffled_is_split_order(space, cfg, world_size):
    cfg = {**cfg, "shuffle": False}
    seq = np.concatenate([p.all_ids(space.offsets) for p in plans(space, world_size, **cfg)])
    assert np.all(np.diff(seq) > 0), "ranks in order, each in split order"
    if world_size == 1:
        assert np.array_equal(seq, np.arange(len(seq)))


@given(spaces(), configs, world_sizes, st.data())
def test_resume_offsets_give_the_tail(space, cfg, world_size, data):
    """What the loader does to resume after batch i (find the blocks of batch i+1 on, read
    each whole, cut its slice out) gives exactly the tail of the uninterrupted epoch."""
    rank = data.draw(st.integers(0, world_size - 1))
    p = epoch_plan(space, rank=rank, world_size=world_size, **cfg)
    full = batches_of(p, p.all_ids(space.offsets))
    start = data.draw(st.integers(0, p.n_batches))
    resumed = []
    for i in range(start, p.n_batches):
        a, b = p.batch_span(i)
        parts = []
        for j in p.buffers_of(a, b):
            off, end = p.buffer_offsets[j], p.buffer_offsets[j + 1]
            parts.append(p.buffer_order(j, space.offsets)[max(a, off) - off:min(b, end) - off])
        resumed.append(np.concatenate(parts))
    assert len(resumed) == len(full) - start
    for got, exp in zip(resumed, full[start:], strict=True):
        assert np.array_equal(got, exp)


@given(spaces(), configs, world_sizes, st.data())
def test_plan_head_keeps_the_batches(space, cfg, world_size, data):
    p = epoch_plan(space, rank=0, world_size=world_size, **cfg)
    stop = data.draw(st.integers(0, p.n_batches + 2))
    h = plan_head(p, stop)
    assert h.n_batches == min(stop, p.n_batches)
    full, head = batches_of(p, p.all_ids(space.offsets)), batches_of(h, h.all_ids(space.offsets))
    for got, exp in zip(head, full[: len(head)], strict=True):
        assert np.array_equal(got, exp)
    needed = p.buffers_of(0, h.n_samples)[-1] + 1 if h.n_samples else 0
    assert h.n_buffers == needed, "a block no batch draws from would be read"


@given(spaces(), configs, world_sizes, st.integers(1, 6), st.data())
def test_worker_shares(space, cfg, world_size, num_workers, data):
    rank = data.draw(st.integers(0, world_size - 1))
    p = epoch_plan(space, rank=rank, world_size=world_size, **cfg)
    runs = [worker_batches(p.n_batches, num_workers, w) for w in range(num_workers)]
    assert runs[0][0] == 0 and runs[-1][1] == p.n_batches
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:], strict=False)), "contiguous, disjoint, covering"
    sizes = [b - a for a, b in runs]
    assert max(sizes) - min(sizes) <= 1
    # blocks each worker reads: only a block a run boundary falls inside is read twice
    reads = []
    for a, b in runs:
        if a == b:
            reads.append(set())
            continue
        h = plan_head(p, b)
        first = h.buffers_of(*h.batch_span(a))[0]
        reads.append(set(range(first, h.n_buffers)))
    together = sum(len(r) for r in reads)
    distinct = set().union(*reads)
    assert distinct == set(range(plan_head(p, p.n_batches).n_buffers))
    assert together - len(distinct) <= num_workers - 1


def test_worker_batches_rejects_bad_worker():
    with pytest.raises(ValueError, match="worker"):
        worker_batches(10, 2, 2)


# ----------------------------------------------------------------------------- reader chunk plans
@settings(max_examples=200, deadline=None)
@given(st.integers(0, 500), st.integers(1, 200), st.integers(1, 64))
def test_range_plan_equals_axis_plan(start, n, chunk):
    """The integer-arithmetic plan of a run of positions is the general plan of the same positions."""
    from xinsitu.index.regions import axis_plan as _axis_plan
    from xinsitu.index.regions import range_plan as _range_plan

    got = _range_plan(start, start + n, chunk)
    ref = _axis_plan(np.arange(start, start + n, dtype=np.int64), chunk)
    assert [(c, o, i) for c, o, i in got] == [(c, o, i) for c, o, i in ref]


@given(spaces(), configs, world_sizes)
def test_buffer_offsets_of_equal_pieces_by_arithmetic(space, cfg, world_size):
    """Pieces of one size (stride-0 ``lo``/``hi``) have their blocks' offsets by arithmetic: the same
    as summing the pieces of each block; ``buffers_of`` finds each position's block."""
    for p in plans(space, world_size, **cfg):
        sizes = np.asarray(p.hi - p.lo)
        want = np.concatenate([[0], np.cumsum([sizes[p.buffer_pieces(j)].sum()
                                               for j in range(-(-len(sizes) // p.block_chunks))])]).astype(np.int64)
        assert np.array_equal(p.buffer_offsets, want)
        for a in range(int(want[-1])):
            (j,) = p.buffers_of(a, a + 1)
            assert want[j] <= a < want[j + 1]
