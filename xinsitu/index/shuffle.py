"""Pure permutations: the chunk order of an epoch and the mixing inside a buffer.

Every function is a pure function of its integer arguments (never of timing), so an
epoch's order can be recomputed anywhere: in a DataLoader worker, or after a restart.
"""

from __future__ import annotations

import hashlib

import numpy as np

# Distinct streams of one seed: the chunk order and the in-block mixing never share draws.
_UNIT_STREAM, _BLOCK_STREAM = 0, 1


def unit_order(n_units: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Order in which the split's chunk blocks are visited in ``epoch`` (int64): position ``p``
    holds unit ``units_at(p)`` (the whole of :func:`units_at`)."""
    if not shuffle:
        return np.arange(n_units, dtype=np.int64)
    return units_at(np.arange(n_units, dtype=np.int64), n_units, seed, epoch)


# ---------------------------------------------------------------------- index shuffle
_ROUNDS = 8  # Feistel rounds (4 of each kind); 3-4 make a pseudo-random permutation, 8 for a margin
_SMALL = 1 << 12  # up to this many units, the order is a sort by a keyed hash (a Feistel network of few bits
# is far from uniform: n = 5 in 2^3 was, and cycle walking in a wider domain takes long walks)
_CHUNK = 1 << 18  # positions evaluated at once: bounds the temporaries of a whole order to a few MB
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's finaliser


def _round_keys(seed: int, epoch: int) -> np.ndarray:
    """The Feistel round keys of ``(seed, epoch)``: from a hash, so the order is the same on every
    NumPy (a ``Generator``'s stream may change between NumPy versions)."""
    h = hashlib.sha256(f"xinsitu.units_at:{int(seed)}:{int(epoch)}".encode()).digest()
    h += hashlib.sha256(h).digest()
    return np.frombuffer(h[: 8 * _ROUNDS], dtype="<u8").astype(np.uint64)


def _mix(v: np.ndarray, key: np.uint64) -> np.ndarray:
    """A keyed 64-bit hash of ``v`` (uint64; wraps modulo 2^64)."""
    z = v ^ key
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _feistel(x: np.ndarray, hi_bits: int, lo_bits: int, keys: np.ndarray) -> np.ndarray:
    """A permutation of ``[0, 2^(hi_bits + lo_bits))``: an alternating (unbalanced) Feistel network
    on the high and low bits of ``x``; each round XORs one part with a keyed hash of the other, so
    each round is a bijection and so is their sequence."""
    lo_mask, hi_mask = np.uint64((1 << lo_bits) - 1), np.uint64((1 << hi_bits) - 1)
    shift = np.uint64(lo_bits)
    hi, lo = x >> shift, x & lo_mask
    for r in range(0, len(keys), 2):
        lo = lo ^ (_mix(hi, keys[r]) & lo_mask)
        hi = hi ^ (_mix(lo, keys[r + 1]) & hi_mask)
    return (hi << shift) | lo


def units_at(positions: np.ndarray | range, n_units: int, seed: int, epoch: int) -> np.ndarray:
    """Unit at each of ``positions`` (ints in ``[0, n_units)``) of the shuffled order of
    ``(seed, epoch)``, without ordering the other units: a keyed bijection of ``[0, n_units)``
    evaluated where asked (as grain's ``index_shuffle``), so a rank of 1,024 computes only its
    share of 10^7 units. A Feistel network permutes ``[0, 2^k)``, the smallest power of two
    holding ``n_units`` (at most twice as many); a value past ``n_units`` is permuted again until
    it falls inside (cycle walking), which keeps the map a bijection of ``[0, n_units)``. Up to
    ``_SMALL`` units (microseconds for all of them) the units are sorted by a keyed hash instead.
    ``positions`` may be a ``range`` of step 1: no array of them is made then (one rank: 10^7)."""
    if isinstance(positions, range) and positions.step == 1:
        start, size = positions.start, len(positions)
        pos = None
        if size and (start < 0 or positions.stop > n_units):
            raise IndexError(f"positions must lie in [0, {n_units})")
    else:
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        start, size = 0, pos.size
        if size and (int(pos.min()) < 0 or int(pos.max()) >= n_units):
            raise IndexError(f"positions must lie in [0, {n_units})")

    def part(a: int, b: int) -> np.ndarray:  # positions [a, b) of the ones asked for
        return np.arange(start + a, start + b, dtype=np.int64) if pos is None else pos[a:b]

    if n_units <= 1 or not size:
        return part(0, size).copy()
    keys = _round_keys(seed, epoch)
    if n_units <= _SMALL:
        order = np.argsort(_mix(_mix(np.arange(n_units, dtype=np.uint64), keys[0]), keys[1]), kind="stable")
        return order.astype(np.int64)[part(0, size)]
    bits = int(n_units - 1).bit_length()
    hi_bits, lo_bits = bits - bits // 2, bits // 2
    out = np.empty(size, dtype=np.int64)
    n = np.uint64(n_units)
    for a in range(0, size, _CHUNK):
        x = _feistel(part(a, min(size, a + _CHUNK)).astype(np.uint64), hi_bits, lo_bits, keys)
        out_of = np.flatnonzero(x >= n)
        while out_of.size:  # cycle walking: each step leaves [0, n_units) at most half the time
            y = _feistel(x[out_of], hi_bits, lo_bits, keys)
            x[out_of] = y
            out_of = out_of[y >= n]
        out[a:a + _CHUNK] = x.astype(np.int64)
    return out


def neighbour_order(n_units: int, block_chunks: int, seed: int, epoch: int) -> np.ndarray:
    """A shuffled unit order in which neighbouring units land in the same or the next buffer.

    For windows and tiles that spill from one chunk into the next: the chunk they spill into is
    then held by a buffer the next one can pass it to (``xinsitu.batches.halo.HaloPlan``), instead of
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


def neighbour_order_nd(coords: np.ndarray, spill: tuple[bool, ...], block_chunks: int, seed: int,
                       epoch: int) -> np.ndarray:
    """:func:`neighbour_order` for units on a grid of several split dims (``coords``: each unit's block
    coordinates, ``(n_units, dims)``), where tiles spill along the dims ``spill`` marks.

    A unit's tiles spill into its neighbours one block further along the spilling dims (and the
    diagonals between them). The units go by anti-diagonal, counted down from the far corner (the
    sum of a unit's coordinates along the spilling dims, largest first), in a random order along
    each anti-diagonal: a unit comes after every neighbour it spills into, so what a ``HaloPlan``
    passes on is their edges (whole units only where a tile is as wide as a block), held for about
    two anti-diagonals. Units that differ along the other split dims (e.g. time blocks beside a spatial
    grid) share no tiles: their groups are shuffled and taken a few at a time, as many as put about
    ``block_chunks`` units on an anti-diagonal, so a buffer mixes several groups. Random per
    ``(seed, epoch)``: the order along an anti-diagonal and of the groups. (A serpentine of columns as
    :func:`neighbour_order`'s, spreading each buffer over the whole grid, runs half its columns
    against the spill and passes whole units on: on a grid of 8 x 10 blocks it held 3.4 buffers of
    them where this holds 1-2.)
    """
    n = len(coords)
    if n == 0:
        return np.zeros(0, np.int64)
    rng = np.random.default_rng([_UNIT_STREAM, seed, epoch, len(spill)])
    c = np.asarray(coords, dtype=np.int64).reshape(n, len(spill))
    mask = np.asarray(spill, dtype=bool)
    down = -c[:, mask].sum(axis=1)
    group = np.zeros(n, np.int64)
    if not mask.all():  # the other split dims: groups of units that share no tiles
        _, inverse = np.unique(c[:, ~mask], axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        n_groups = int(inverse.max()) + 1
        per_key = n / (n_groups * len(np.unique(down)))  # units of a group on an anti-diagonal (mean)
        group = rng.permutation(n_groups)[inverse] // max(1, int(round(block_chunks / per_key)))
    return np.lexsort((rng.permutation(n), down, group)).astype(np.int64)


def buffer_permutation(n: int, seed: int, epoch: int, world_size: int, rank: int, j: int) -> np.ndarray:
    """Random order of the ``n`` samples held by buffer ``j`` of this rank."""
    return _rng(_BLOCK_STREAM, seed, epoch, world_size, rank, j).permutation(n).astype(np.int64)


def _rng(*key: int) -> np.random.Generator:
    """``np.random.default_rng(list(key))``. Where every entry fits in 32 bits, from a uint32 array of
    them: the same seed (numpy turns each such int into that one word) in 25 instead of 60 us, once per
    block on the I/O loop, which the decode threads wait on for the GIL."""
    if all(0 <= k < 1 << 32 for k in key):
        return np.random.default_rng(np.array(key, dtype=np.uint32))
    return np.random.default_rng(list(key))


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
    if counts.strides == (0,):  # one size shared by every unit (a stride-0 array): no pass over them
        sizes, mult = counts[:1].copy(), np.array([len(counts)])
    elif counts.max() > 1 << 20:
        sizes, mult = np.unique(counts, return_counts=True)
    else:
        sizes, mult = _bincount(counts)
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
