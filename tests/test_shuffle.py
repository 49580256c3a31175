"""The pure permutations of ``xinsitu.shuffle``: properties over many sizes and seeds (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from xinsitu.shuffle import buffer_permutation, neighbour_order, quality, unit_order

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
