"""The pure permutations of ``xinsitu.index.shuffle``: properties over many sizes and seeds (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xinsitu.index.shuffle import buffer_permutation, neighbour_order, neighbour_order_nd, quality, unit_order

sizes = st.integers(0, 500)
seeds = st.integers(0, 2**32 - 1)
epochs = st.integers(0, 1000)


def _is_permutation(order: np.ndarray, n: int) -> bool:
    return order.dtype == np.int64 and order.shape == (n,) and np.array_equal(np.sort(order), np.arange(n))


@settings(max_examples=60, deadline=None)
@given(n=sizes, seed=seeds, epoch=epochs, shuffle=st.booleans())
def test_unit_order_is_a_deterministic_permutation(n, seed, epoch, shuffle):
    a = unit_order(n, seed, epoch, shuffle)
    assert _is_permutation(a, n)
    np.testing.assert_array_equal(a, unit_order(n, seed, epoch, shuffle))  # a pure function of its arguments
    if not shuffle:
        np.testing.assert_array_equal(a, np.arange(n))


def test_unit_order_changes_with_the_epoch_and_the_seed():
    base = unit_order(200, 7, 0, True)
    assert not np.array_equal(base, unit_order(200, 7, 1, True))
    assert not np.array_equal(base, unit_order(200, 8, 0, True))


@settings(max_examples=60, deadline=None)
@given(n=sizes, block=st.integers(1, 40), seed=seeds, epoch=epochs)
def test_neighbour_order_is_a_permutation_whose_neighbours_share_or_follow_a_buffer(n, block, seed, epoch):
    order = neighbour_order(n, block, seed, epoch)
    assert _is_permutation(order, n)
    np.testing.assert_array_equal(order, neighbour_order(n, block, seed, epoch))
    if n < 2:
        return
    buffer_of = np.empty(n, np.int64)
    buffer_of[order] = np.arange(n) // block  # buffer j holds order[j*block:(j+1)*block]
    # units u and u+1 (neighbours in the split) are at most one buffer apart, except across the seam
    # where the serpentine wraps (at most one pair per row turn)
    far = np.abs(np.diff(buffer_of)) > 1
    assert far.sum() <= block


@st.composite
def _grids(draw: st.DrawFn) -> tuple[np.ndarray, tuple[bool, ...]]:
    """The block coordinates of a split's units on a grid of 2-3 split dims (a random subset of the
    blocks, in C order), and which dims tiles spill along (at least one)."""
    shape = draw(st.lists(st.integers(1, 6), min_size=2, max_size=3))
    spill = tuple(draw(st.lists(st.booleans(), min_size=len(shape), max_size=len(shape))))
    if not any(spill):
        spill = (True,) + spill[1:]
    keep = draw(st.lists(st.booleans(), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    ids = np.flatnonzero(keep)
    return np.stack(np.unravel_index(ids, shape), axis=1).reshape(len(ids), len(shape)), spill


@settings(max_examples=80, deadline=None)
@given(grid=_grids(), block=st.integers(1, 20), seed=seeds, epoch=epochs)
def test_the_order_of_tiles_spilling_over_several_dims_is_a_permutation_after_their_neighbours(grid, block, seed,
                                                                                             epoch):
    """A permutation, a pure function of its arguments, in which each unit comes after every neighbour
    its tiles spill into (one block further along any spilling dims), so only edges are passed on."""
    coords, spill = grid
    order = neighbour_order_nd(coords, spill, block, seed, epoch)
    assert _is_permutation(order, len(coords))
    np.testing.assert_array_equal(order, neighbour_order_nd(coords, spill, block, seed, epoch))
    at = {tuple(c): p for p, c in enumerate(coords[order].tolist())}
    for c in coords.tolist():
        for step in np.ndindex(*(2 if s else 1 for s in spill)):
            target = tuple(a + b for a, b in zip(c, step, strict=True))
            if any(step) and target in at:
                assert at[target] < at[tuple(c)], (c, target)


def test_the_order_of_tiles_spilling_over_several_dims_changes_with_the_epoch_and_mixes_groups():
    """Other orders per (seed, epoch); where a split dim does not spill (time blocks beside a grid), a
    buffer's units come from several of its blocks, a few more when buffers are bigger."""
    coords = np.stack(np.unravel_index(np.arange(80), (8, 10)), axis=1)
    orders = {tuple(neighbour_order_nd(coords, (True, True), 4, s, e)) for s in range(3) for e in range(3)}
    assert len(orders) == 9
    grouped = np.stack(np.unravel_index(np.arange(400), (100, 2, 2)), axis=1)  # 100 time blocks, 2 x 2 tiles
    for block, least in ((4, 1), (8, 4), (16, 8)):
        order = neighbour_order_nd(grouped, (False, True, True), block, 0, 0)
        groups = [len(set(grouped[order[a:a + block], 0].tolist())) for a in range(0, 400, block)]
        assert np.mean(groups) >= least, (block, np.mean(groups))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), seed=seeds, epoch=epochs, world=st.integers(1, 8), j=st.integers(0, 50))
def test_buffer_permutation_is_a_permutation_per_rank_and_buffer(n, seed, epoch, world, j):
    rank = j % world
    p = buffer_permutation(n, seed, epoch, world, rank, j)
    assert _is_permutation(p, n)
    np.testing.assert_array_equal(p, buffer_permutation(n, seed, epoch, world, rank, j))


def test_buffer_permutations_differ_between_buffers_and_ranks():
    a = buffer_permutation(100, 1, 0, 2, 0, 0)
    assert not np.array_equal(a, buffer_permutation(100, 1, 0, 2, 0, 1))
    assert not np.array_equal(a, buffer_permutation(100, 1, 0, 2, 1, 0))


def test_quality_is_one_for_well_mixed_batches_and_low_for_one_chunk_batches():
    counts = np.full(100, 10)
    rng = np.random.default_rng(0)
    mixed = [rng.choice(100, 32, replace=True) for _ in range(20)]
    assert quality(mixed, counts) > 0.9
    one_chunk = [np.full(32, k) for k in range(20)]
    assert quality(one_chunk, counts) < 0.1
    assert quality([], counts) == 1.0 and quality(one_chunk, np.zeros(100, np.int64)) == 1.0


@given(batches=st.lists(st.lists(st.integers(0, 49), min_size=0, max_size=20), max_size=10))
def test_quality_lies_between_zero_and_one(batches):
    q = quality([np.asarray(b, np.int64) for b in batches], np.full(50, 4))
    assert 0.0 <= q <= 1.0


# ---------------------------------------------------------------------- index shuffle (units_at)
def _primes(limit: int) -> list[int]:
    return [n for n in range(2, limit) if all(n % d for d in range(2, int(n**0.5) + 1))]


special_sizes = st.sampled_from([1, 2, 3, 4, 5, 7, 8, 16, 17, 31, 32, 33, 64, 127, 128, 129, 997, 1024, 1025, 4096])


@settings(max_examples=80, deadline=None)
@given(n=special_sizes | st.integers(1, 3000) | st.sampled_from(_primes(600)), seed=seeds, epoch=epochs)
def test_units_at_is_a_bijection_of_the_units(n, seed, epoch):
    """A bijection of [0, n) for any n (1, primes, powers of two and their neighbours): every unit at
    exactly one position; evaluated at some positions it gives those positions' units of the whole."""
    from xinsitu.index.shuffle import units_at

    whole = units_at(np.arange(n), n, seed, epoch)
    assert _is_permutation(whole, n)
    np.testing.assert_array_equal(whole, units_at(np.arange(n), n, seed, epoch))  # deterministic
    np.testing.assert_array_equal(whole, unit_order(n, seed, epoch, True))
    pick = np.random.default_rng(n).integers(0, n, size=min(n, 50))
    np.testing.assert_array_equal(units_at(pick, n, seed, epoch), whole[pick])
    cut = n // 3
    np.testing.assert_array_equal(units_at(np.arange(cut, n), n, seed, epoch), whole[cut:])


@settings(max_examples=30, deadline=None)
@given(n=st.integers(16, 5000), seed=seeds, epoch=epochs)
def test_units_at_differs_across_epochs_and_seeds(n, seed, epoch):
    """16+ units: two orders agree with probability below 1/16! (~5e-14)."""
    from xinsitu.index.shuffle import units_at

    pos = np.arange(n)
    base = units_at(pos, n, seed, epoch)
    assert not np.array_equal(base, units_at(pos, n, seed, epoch + 1))
    assert not np.array_equal(base, units_at(pos, n, seed + 1, epoch))


def test_units_at_refuses_positions_outside_the_units():
    import pytest

    from xinsitu.index.shuffle import units_at

    with pytest.raises(IndexError):
        units_at(np.array([5]), 5, 0, 0)
    with pytest.raises(IndexError):
        units_at(np.array([-1]), 5, 0, 0)
    assert units_at(np.zeros(0, np.int64), 0, 0, 0).shape == (0,)


def test_units_at_is_the_same_on_every_numpy():
    """The order comes from a hash of (seed, epoch), not from a NumPy Generator's stream: pinned."""
    from xinsitu.index.shuffle import units_at

    assert units_at(np.arange(10), 10, 0, 0).tolist() == [7, 6, 4, 8, 1, 2, 5, 3, 0, 9]


def test_units_at_mixes_like_a_random_permutation():
    """Buffers of consecutive positions hold units spread over the split: the mean distance between
    the units of a buffer is that of a random permutation's (n/3 for uniform draws), and the number
    of units that keep their neighbour (u, u+1 at positions p, p+1) is about 1 (a random permutation's
    expectation), not a run."""
    from xinsitu.index.shuffle import units_at

    n = 100_000
    for seed in range(3):
        order = units_at(np.arange(n), n, seed, 0)
        gaps = np.abs(np.diff(order.reshape(-1, 16), axis=1)).mean()
        assert abs(gaps / (n / 3) - 1) < 0.02
        assert int((np.diff(order) == 1).sum()) < 8


@pytest.mark.parametrize("n", [3, 4, 5, 4097])
@pytest.mark.slow
def test_units_at_draws_orders_alike(n):
    """Over many seeds, every order of a few units comes about equally often, as from a uniform random
    permutation (chi-square per degree of freedom near 1; a Feistel network on a domain of 3 bits, as
    n = 5 had before small orders became a keyed sort, scores 2.5 of at most 1.65). Past 4,096 units (the Feistel
    network): each of units 0..9 lands in each tenth of the positions about equally often."""
    from math import factorial

    from xinsitu.index.shuffle import units_at

    if n > 100:
        seeds, cells = 2_000, 10
        hits = np.zeros((cells, cells))
        for s in range(seeds):
            at = np.argsort(units_at(np.arange(n), n, s, 0))[:cells]  # positions of units 0..9
            hits[np.arange(cells), at * cells // n] += 1
        assert ((hits - seeds / cells) ** 2 / (seeds / cells)).sum() / (cells * (cells - 1)) < 1.5
        return
    seeds, k = 12_000, factorial(n)
    seen: dict[tuple[int, ...], int] = {}
    for s in range(seeds):
        key = tuple(units_at(np.arange(n), n, s, 0).tolist())
        seen[key] = seen.get(key, 0) + 1
    assert len(seen) == k
    freq = np.array(list(seen.values()))
    # chi-square per degree of freedom: 1 +- sqrt(2 / dof) by chance; refused 5 of those above
    assert ((freq - seeds / k) ** 2 / (seeds / k)).sum() / (k - 1) < 1 + 5 * (2 / (k - 1)) ** 0.5


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 10_000), seed=seeds, epoch=epochs, data=st.data())
def test_units_at_a_range_is_units_at_its_positions(n, seed, epoch, data):
    from xinsitu.index.shuffle import units_at

    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    np.testing.assert_array_equal(units_at(range(a, b), n, seed, epoch), units_at(np.arange(a, b), n, seed, epoch))
    with pytest.raises(IndexError):
        units_at(range(a, n + 1), n, seed, epoch)


@settings(max_examples=100, deadline=None)
@given(key=st.lists(st.integers(0, 2**40), min_size=1, max_size=6), n=st.integers(0, 50))
def test_block_seeds_are_numpys_seed_of_the_same_ints(key, n):
    """The fast seed of a block's permutation (a uint32 array where every int fits) draws what
    ``default_rng`` of the list of ints draws: the order of every epoch is unchanged by it."""
    from xinsitu.index.shuffle import _rng

    np.testing.assert_array_equal(_rng(*key).permutation(n), np.random.default_rng(key).permutation(n))
