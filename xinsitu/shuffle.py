"""Pure permutations: the chunk order of an epoch and the mixing inside a buffer.

Every function is a pure function of its integer arguments (never of timing), so an
epoch's order can be recomputed anywhere: in a DataLoader worker, or after a restart.
"""

from __future__ import annotations

import numpy as np

# Distinct streams of one seed: the chunk order and the in-block mixing never share draws.
_UNIT_STREAM, _BLOCK_STREAM = 0, 1


def unit_order(n_units: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Order in which the split's chunk blocks are visited in ``epoch`` (int64)."""
    if not shuffle:
        return np.arange(n_units, dtype=np.int64)
    rng = np.random.default_rng([_UNIT_STREAM, seed, epoch])
    return rng.permutation(n_units).astype(np.int64)


def neighbour_order(n_units: int, block_chunks: int, seed: int, epoch: int) -> np.ndarray:
    """A shuffled unit order in which neighbouring units land in the same or the next buffer.

    For windows and tiles that spill from one chunk into the next: the chunk they spill into is
    then held by a buffer the next one can pass it to (``xinsitu.buffer.HaloPlan``), instead of
    being read twice. The units are laid out in ``block_chunks`` rows, each running the other way
    than the row before (a serpentine), and a buffer takes one column: its units are spread evenly
    over the whole split (batches mix far-apart chunks as a permutation does), and the next buffer
    holds their neighbours. The layout starts at a random unit and runs in a random direction per
    ``(seed, epoch)``.
    """
    if n_units == 0:
        return np.zeros(0, np.int64)
    rng = np.random.default_rng([_UNIT_STREAM, seed, epoch])
    m = -(-n_units // block_chunks)  # columns: the blocks of the epoch
    u = np.arange(n_units, dtype=np.int64)
    row, col = u // m, u % m
    col = np.where(row % 2 == 1, m - 1 - col, col)
    order = (np.lexsort((row, col)) + int(rng.integers(n_units))) % n_units
    return (order[::-1] if rng.integers(2) else order).astype(np.int64)


def buffer_permutation(n: int, seed: int, epoch: int, world_size: int, rank: int, j: int) -> np.ndarray:
    """Random order of the ``n`` samples held by buffer ``j`` of this rank."""
    rng = np.random.default_rng([_BLOCK_STREAM, seed, epoch, world_size, rank, j])
    return rng.permutation(n).astype(np.int64)


def quality(batch_units: list[np.ndarray], counts: np.ndarray) -> float:
    """How well batches mix chunks, 0..1 (1.0 ~ a global shuffle).

    For each batch, the number of distinct chunk blocks it draws from is compared with
    the number a uniform draw of the same size from the whole split would hit on
    average; the score is the mean ratio, capped at 1.
    """
    total = counts.sum()
    if total == 0 or not batch_units:
        return 1.0
    # units of equal size are drawn alike: sum over the distinct sizes (O(units) once, not per batch)
    sizes, mult = np.unique(counts, return_counts=True) if counts.max() > 1 << 20 else _bincount(counts)
    p = sizes / total
    expected: dict[int, float] = {}
    scores = []
    for units in batch_units:
        b = len(units)
        if b <= 1:
            continue
        if b not in expected:  # E[#distinct blocks] for b uniform draws
            expected[b] = float(np.sum(mult * (1.0 - (1.0 - p) ** b)))
        scores.append(min(1.0, len(np.unique(units)) / expected[b]))
    return float(np.mean(scores)) if scores else 1.0


def _bincount(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mult = np.bincount(counts)
    sizes = np.flatnonzero(mult)
    return sizes, mult[sizes]
