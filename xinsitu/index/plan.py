"""Pure index math: who yields which samples of a split in an epoch (the samples themselves,
per unit, are ``sampling.SampleSpace``).

A *unit* is one chunk block of the split (the shuffle unit). Samples are numbered by
a global id: units in split order, and inside a unit in C order over the sampled dims
(split dims, then window/patch dims, then ``over`` dims). Everything here works on
int64 numpy arrays, never on per-sample Python objects.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from xinsitu.index import shuffle as _shuffle

if TYPE_CHECKING:
    from xinsitu.index.sampling import Offsets, SampleSpace


def piece_ids(offsets: Offsets, units: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Global sample ids of pieces (samples ``lo..hi`` of each unit, pieces in order): each unit's
    offset + the sample's position in it, without a pass per piece."""
    sizes = np.asarray(hi - lo, dtype=np.int64)
    if not len(sizes):
        return np.zeros(0, np.int64)
    first = np.asarray(offsets[units], dtype=np.int64) + lo  # each piece's first sample id
    return np.repeat(first - (np.cumsum(sizes) - sizes), sizes) + np.arange(int(sizes.sum()), dtype=np.int64)


# ---------------------------------------------------------------------- epoch plan
@dataclass(frozen=True)
class EpochPlan:
    """What one rank yields in one epoch: pieces of units, grouped in buffers.

    ``units[i]``/``lo[i]``/``hi[i]``: piece i is samples ``lo..hi`` (local ids) of unit
    ``units[i]``. A buffer is ``block_chunks`` consecutive pieces. The rank yields the
    first ``n_samples`` samples of its sequence (buffers in order, each buffer's samples
    permuted when shuffling), cut into ``n_batches`` batches.
    """

    units: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    block_chunks: int
    n_samples: int
    batch_size: int
    drop_last: bool
    shuffle: bool
    seed: int
    epoch: int
    rank: int
    world_size: int

    @cached_property
    def buffer_offsets(self) -> np.ndarray:
        """Position in this rank's sequence where each block starts (len = blocks + 1)."""
        n, bc = len(self.units), self.block_chunks
        if n and self.lo.strides == (0,) and self.hi.strides == (0,):  # pieces of one size: by arithmetic
            ends = np.minimum(np.arange(0, n + bc, bc, dtype=np.int64)[: -(-n // bc) + 1], n)
            return ends * int(self.hi[0] - self.lo[0])
        sizes = self.hi - self.lo
        per_block = np.add.reduceat(sizes, np.arange(0, len(sizes), bc)) if len(sizes) else sizes
        return np.concatenate([[0], np.cumsum(per_block)]).astype(np.int64)

    @property
    def n_buffers(self) -> int:
        return len(self.buffer_offsets) - 1

    @property
    def n_batches(self) -> int:
        full, rest = divmod(self.n_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def buffer_pieces(self, j: int) -> slice:
        return slice(j * self.block_chunks, min((j + 1) * self.block_chunks, len(self.units)))

    def buffer_perm(self, j: int, n: int) -> np.ndarray:
        """Order in which the ``n`` samples of block ``j`` (in piece order) are yielded."""
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        return _shuffle.buffer_permutation(n, self.seed, self.epoch, self.world_size, self.rank, j)

    def buffer_order(self, j: int, offsets: Offsets) -> np.ndarray:
        """Global sample ids of block ``j`` in the order they are yielded."""
        sl = self.buffer_pieces(j)
        ids = piece_ids(offsets, self.units[sl], self.lo[sl], self.hi[sl])
        return ids[self.buffer_perm(j, len(ids))]

    def batch_span(self, i: int) -> tuple[int, int]:
        """Positions ``[a, b)`` of batch ``i`` in this rank's sequence."""
        a = i * self.batch_size
        return a, min(a + self.batch_size, self.n_samples)

    def buffers_of(self, a: int, b: int) -> range:
        """Blocks holding sequence positions ``[a, b)``."""
        first, stop = np.searchsorted(self.buffer_offsets, [a, b - 1], side="right")
        return range(int(first) - 1, int(stop))

    def all_ids(self, offsets: Offsets) -> np.ndarray:
        """Every yielded sample id in order (for tests and inspection; O(samples))."""
        if not self.n_buffers:
            return np.zeros(0, np.int64)
        return np.concatenate([self.buffer_order(j, offsets) for j in range(self.n_buffers)])[: self.n_samples]


def rank_share(counts: np.ndarray, world_size: int, rank: int, batch_size: int,
               drop_last: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Cut a sequence of units (sample ``counts``, in epoch order) among ranks.

    Returns this rank's pieces (unit positions into ``counts``, lo, hi) and how many
    samples it yields. Every rank yields the same number of batches; fewer than
    ``world_size * batch_size`` samples are left out. Cuts fall on unit edges (no
    chunk read by two ranks) where that keeps within the bound, else inside units.
    """
    counts = np.asarray(counts, dtype=np.int64)
    n_units = len(counts)
    if n_units and counts.strides == (0,) and int(counts[0]) > 0:  # one count shared by every unit
        return _equal_share(n_units, int(counts[0]), world_size, rank, batch_size, drop_last)
    cum = np.concatenate([[0], np.cumsum(counts)])
    total = int(cum[-1])
    idx = np.arange(n_units, dtype=np.int64)
    if world_size == 1:
        n = total if not drop_last else total - total % batch_size
        return idx, np.zeros(n_units, np.int64), counts.copy(), n
    # whole units: cut at the unit edge nearest to each ideal cut
    ideal = np.arange(world_size + 1) * total / world_size
    pos = np.searchsorted(cum, ideal)
    pos = np.clip(pos, 0, n_units)
    prev = np.clip(pos - 1, 0, n_units)
    pos = np.where(np.abs(cum[prev] - ideal) <= np.abs(cum[pos] - ideal), prev, pos)
    pos[0], pos[-1] = 0, n_units
    pos = np.maximum.accumulate(pos)
    per_rank = cum[pos[1:]] - cum[pos[:-1]]
    n_each = _equalise(per_rank, batch_size, drop_last)
    if _whole_units_do(per_rank, n_each, total, world_size, batch_size, drop_last):
        a, b = pos[rank], pos[rank + 1]
        return idx[a:b], np.zeros(b - a, np.int64), counts[a:b].copy(), int(n_each[rank])
    # cut inside units: rank r takes samples [r*q, (r+1)*q) of the sequence
    q = total // world_size
    lo_s, hi_s = rank * q, (rank + 1) * q
    a = int(np.searchsorted(cum, lo_s, side="right")) - 1
    b = int(np.searchsorted(cum, hi_s, side="left"))
    units = idx[a:b]
    lo = np.maximum(lo_s - cum[a:b], 0)
    hi = np.minimum(hi_s - cum[a:b], counts[a:b])
    keep = hi > lo
    n = q if not drop_last else q - q % batch_size
    return units[keep], lo[keep], hi[keep], n


def _equal_share(n_units: int, size: int, world_size: int, rank: int, batch_size: int,
                 drop_last: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """``rank_share`` of ``n_units`` units of ``size`` samples each (``size > 0``), by arithmetic on
    unit positions: O(this rank's share) in time and memory, whatever ``n_units`` (the same cut:
    the prefix sums are ``k * size``). ``lo``/``hi`` of whole units are read-only arrays of stride 0."""
    total = n_units * size

    def whole(a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        return np.broadcast_to(np.int64(0), (b - a,)), np.broadcast_to(np.int64(size), (b - a,))

    if world_size == 1:
        n = total if not drop_last else total - total % batch_size
        return (np.arange(n_units, dtype=np.int64), *whole(0, n_units), n)
    ideal = np.arange(world_size + 1) * total / world_size
    # searchsorted(k * size, ideal): the first k with k * size >= ideal (compared as numpy does, in float64)
    pos = np.clip(np.ceil(ideal / size).astype(np.int64), 0, n_units)
    pos = np.where((pos * size).astype(np.float64) < ideal, pos + 1, pos)
    pos = np.where((pos > 0) & (((pos - 1) * size).astype(np.float64) >= ideal), pos - 1, pos)
    pos = np.clip(pos, 0, n_units)
    prev = np.clip(pos - 1, 0, n_units)
    pos = np.where(np.abs(prev * size - ideal) <= np.abs(pos * size - ideal), prev, pos)
    pos[0], pos[-1] = 0, n_units
    pos = np.maximum.accumulate(pos)
    per_rank = (pos[1:] - pos[:-1]) * size
    n_each = _equalise(per_rank, batch_size, drop_last)
    if _whole_units_do(per_rank, n_each, total, world_size, batch_size, drop_last):
        a, b = int(pos[rank]), int(pos[rank + 1])
        return (np.arange(a, b, dtype=np.int64), *whole(a, b), int(n_each[rank]))
    q = total // world_size
    lo_s, hi_s = rank * q, (rank + 1) * q
    a = min(lo_s // size, n_units)  # the unit holding sample lo_s
    b = min(-(-hi_s // size), n_units)
    units = np.arange(a, b, dtype=np.int64)
    lo = np.maximum(lo_s - units * size, 0)
    hi = np.minimum(hi_s - units * size, size)
    keep = hi > lo
    n = q if not drop_last else q - q % batch_size
    return units[keep], lo[keep], hi[keep], n


def epoch_size(space: SampleSpace, *, world_size: int, rank: int, batch_size: int,
               drop_last: bool) -> tuple[int, int] | None:
    """``(samples, units)`` of one rank's epoch where the unit order cannot change them (one rank,
    or units of equal size: any regular grid), without ordering the units (no permutation of
    10^7 units for ``len``); None where it can (ask ``epoch_plan``). Equals
    ``(plan.n_samples, len(plan.units))`` of ``epoch_plan`` with the same arguments."""
    if world_size == 1:
        total = space.n_samples
        return (total - total % batch_size if drop_last else total), space.n_units
    size = space.unit_size
    if size is not None:  # every order has the same prefix sums
        pos, _, _, n = rank_share(np.broadcast_to(np.int64(size), (space.n_units,)), world_size, rank, batch_size,
                                  drop_last)
        return n, len(pos)
    return None


def _whole_units_do(per_rank: np.ndarray, n_each: np.ndarray, total: int, world_size: int, batch_size: int,
                    drop_last: bool) -> bool:
    """Whether the ranks' shares are whole units (``per_rank`` samples each, of which ``n_each`` are
    yielded): where that leaves out fewer than ``world_size * batch_size`` samples, and does not make an
    epoch of no batch where cutting inside units gives every rank one (a few big blocks among many
    ranks: one rank without a block left every rank without a batch)."""
    if int((per_rank - n_each).sum()) >= world_size * batch_size:
        return False
    return bool(n_each.any()) or total // world_size < (batch_size if drop_last else 1)


def _equalise(per_rank: np.ndarray, batch_size: int, drop_last: bool) -> np.ndarray:
    """Samples each rank yields so that all ranks yield the same number of batches."""
    if drop_last:
        nb = int((per_rank // batch_size).min())
        return np.full_like(per_rank, nb * batch_size)
    nb = int((-(-per_rank // batch_size)).min())
    return np.minimum(per_rank, nb * batch_size)


def unit_order(space: SampleSpace, *, seed: int, epoch: int, shuffle: bool, block_chunks: int) -> np.ndarray:
    """The epoch's order of the split's units, before ranks take their shares."""
    if shuffle and space.spills:  # neighbours share a block or follow each other: chunks read once
        if len(space.split_dims) == 1:
            return _shuffle.neighbour_order(space.n_units, block_chunks, seed, epoch)
        coords = np.stack(np.unravel_index(space.blocks.ids(), space.grid), axis=1)
        return _shuffle.neighbour_order_nd(coords, space.spill_dims, block_chunks, seed, epoch)
    return _shuffle.unit_order(space.n_units, seed, epoch, shuffle)


def epoch_plan(space: SampleSpace, *, seed: int, epoch: int, shuffle: bool, batch_size: int,
               block_chunks: int, drop_last: bool, rank: int, world_size: int) -> EpochPlan:
    """The plan of one rank for one epoch (pure: depends on its arguments only).

    Where units are of equal size (``space.unit_size``: any regular grid without a validity mask)
    and the order is a plain shuffle (no windows spilling into the next unit), the rank's cut is
    arithmetic over positions of the epoch's unit order and only its positions' units are
    computed (``shuffle.units_at``): O(share), not O(units). Else the whole order is made and cut;
    both give the same plan."""
    size = space.unit_size
    if size and not (shuffle and space.spills):
        n_units = space.n_units
        pos, lo, hi, n = rank_share(np.broadcast_to(np.int64(size), (n_units,)), world_size, rank, batch_size,
                                    drop_last)
        if shuffle and len(pos) and int(pos[-1] - pos[0]) == len(pos) - 1:  # a run of positions (one rank: all)
            run = range(int(pos[0]), int(pos[0]) + len(pos))
            del pos  # made a slice at a time, not as an array of positions first
            units = _shuffle.units_at(run, n_units, seed, epoch)
        else:
            units = _shuffle.units_at(pos, n_units, seed, epoch) if shuffle else pos
    else:
        order = unit_order(space, seed=seed, epoch=epoch, shuffle=shuffle, block_chunks=block_chunks)
        pos, lo, hi, n = rank_share(space.counts[order], world_size, rank, batch_size, drop_last)
        units = order[pos]
    return EpochPlan(units=units, lo=lo, hi=hi, block_chunks=block_chunks, n_samples=n,
                     batch_size=batch_size, drop_last=drop_last, shuffle=shuffle, seed=seed, epoch=epoch,
                     rank=rank, world_size=world_size)


def plan_quality(plan: EpochPlan, space: SampleSpace, batch_size: int, max_batches: int) -> float:
    """How well the first ``max_batches`` batches of ``plan`` mix units, 0..1 (``shuffle.quality``);
    only the buffers those batches come from are ordered."""
    need = min(plan.n_samples, max_batches * batch_size)
    parts, n, j = [], 0, 0
    while n < need and j < plan.n_buffers:
        parts.append(plan.buffer_order(j, space.offsets))
        n += len(parts[-1])
        j += 1
    ids = np.concatenate(parts)[:need] if parts else np.zeros(0, np.int64)
    units = [space.locate(ids[k:k + batch_size])[0] for k in range(0, len(ids), batch_size)]
    return _shuffle.quality(units, space.counts)


# ---------------------------------------------------------------------- DataLoader workers
def worker_batches(n_batches: int, num_workers: int, worker: int) -> tuple[int, int]:
    """Batches ``[start, stop)`` of a rank's epoch that DataLoader worker ``worker`` yields.

    Each worker takes one contiguous run of batches (run lengths differ by at most one),
    so it reads its own run of buffers: only a buffer that a run boundary falls
    inside is read by two workers (at most ``num_workers - 1`` per epoch), instead of
    every block by every worker as a round-robin of batches would need. The batches are
    the rank's own, so ``len`` and the rank's batch count do not depend on the workers;
    only the order in which a DataLoader interleaves them does.
    """
    if num_workers < 1 or not 0 <= worker < num_workers:
        raise ValueError(f"worker must be in [0, {num_workers}), got {worker}")
    return n_batches * worker // num_workers, n_batches * (worker + 1) // num_workers


def plan_head(plan: EpochPlan, n_batches: int) -> EpochPlan:
    """The first ``n_batches`` batches of ``plan``, holding only the blocks they draw from.

    The blocks kept are whole and keep their indices, so their sample order (and every
    batch) is the same as in ``plan``; blocks after the last batch are never read.
    """
    stop = max(0, min(int(n_batches), plan.n_batches))
    n = min(stop * plan.batch_size, plan.n_samples)
    keep = 0
    if n:
        last = int(np.searchsorted(plan.buffer_offsets, n - 1, side="right")) - 1
        keep = min((last + 1) * plan.block_chunks, len(plan.units))
    return replace(plan, units=plan.units[:keep], lo=plan.lo[:keep], hi=plan.hi[:keep], n_samples=n)


# ---------------------------------------------------------------------- elastic resume
@dataclass(frozen=True)
class Pieces:
    """Samples as pieces of units, in order: piece i is the local ids ``lo[i]..hi[i]-1`` of unit
    ``units[i]`` -- or, where ``picks[i]`` is not None, only the (sorted) local ids it lists."""

    units: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    picks: tuple[np.ndarray | None, ...]

    @cached_property
    def counts(self) -> np.ndarray:
        return np.array([len(p) if p is not None else h - lo for p, lo, h in
                         zip(self.picks, self.lo.tolist(), self.hi.tolist(), strict=True)], dtype=np.int64)

    def local_ids(self, i: int) -> np.ndarray:
        p = self.picks[i]
        return p if p is not None else np.arange(self.lo[i], self.hi[i], dtype=np.int64)

    def ids(self, offsets: np.ndarray) -> np.ndarray:
        """Global sample ids, in piece order (for tests and inspection; O(samples))."""
        parts = [offsets[u] + self.local_ids(i) for i, u in enumerate(self.units.tolist())]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    @staticmethod
    def of(units: list[int], lo: list[int], hi: list[int], picks: list[np.ndarray | None]) -> Pieces:
        return Pieces(np.asarray(units, np.int64).reshape(-1), np.asarray(lo, np.int64).reshape(-1),
                      np.asarray(hi, np.int64).reshape(-1), tuple(picks))


@dataclass(frozen=True)
class RemainderPlan(EpochPlan):
    """An :class:`EpochPlan` whose blocks may hold only some samples of their pieces: ``keep[j]``
    lists, for block ``j``, the positions (into the block's samples in piece order) it yields;
    None keeps them all. Made by :func:`segment_plan` for the rest of an epoch after an elastic resume.
    """

    keep: tuple[np.ndarray | None, ...] = ()

    @cached_property
    def buffer_offsets(self) -> np.ndarray:
        sizes = self.hi - self.lo
        starts = np.arange(0, len(sizes), self.block_chunks)
        per_block = np.add.reduceat(sizes, starts) if len(sizes) else sizes
        for j in range(len(per_block)):
            k = self.keep[j] if j < len(self.keep) else None
            if k is not None:
                per_block[j] = len(k)
        return np.concatenate([[0], np.cumsum(per_block)]).astype(np.int64)

    def buffer_perm(self, j: int, n: int) -> np.ndarray:
        k = self.keep[j] if j < len(self.keep) else None
        if k is None:
            return super().buffer_perm(j, n)
        if not self.shuffle:
            return k
        return k[_shuffle.buffer_permutation(len(k), self.seed, self.epoch, self.world_size, self.rank, j)]


def _deal(seq: Pieces, world_size: int, rank: int, batch_size: int, drop_last: bool) -> tuple[Pieces, int]:
    """This rank's share of ``seq`` (cut as ``rank_share`` cuts), and how many samples it yields."""
    pos, lo, hi, n = rank_share(seq.counts, world_size, rank, batch_size, drop_last)
    units: list[int] = []
    los: list[int] = []
    his: list[int] = []
    picks: list[np.ndarray | None] = []
    for p, a, b in zip(pos.tolist(), lo.tolist(), hi.tolist(), strict=True):
        pick = seq.picks[p]
        if pick is None:
            base = int(seq.lo[p])
            units.append(int(seq.units[p]))
            los.append(base + a)
            his.append(base + b)
            picks.append(None)
        elif b > a:
            ids = pick[a:b]
            units.append(int(seq.units[p]))
            los.append(int(ids[0]))
            his.append(int(ids[-1]) + 1)
            picks.append(None if len(ids) == ids[-1] + 1 - ids[0] else ids)
    return Pieces.of(units, los, his, picks), n


def _plan_of(share: Pieces, n: int, *, world_size: int, rank: int, **cfg: object) -> EpochPlan:
    """The plan that yields ``share`` (in blocks of ``block_chunks`` pieces), its first ``n`` samples."""
    bc = int(cfg["block_chunks"])  # type: ignore[call-overload]
    keep: list[np.ndarray | None] = []
    sizes = (share.hi - share.lo).tolist()
    for j in range(0, len(share.picks), bc):
        if all(p is None for p in share.picks[j:j + bc]):
            keep.append(None)
            continue
        parts, base = [], 0
        for s in range(j, min(j + bc, len(sizes))):
            p = share.picks[s]
            parts.append(base + (p - share.lo[s] if p is not None else np.arange(sizes[s], dtype=np.int64)))
            base += sizes[s]
        keep.append(np.concatenate(parts).astype(np.int64))
    return RemainderPlan(units=share.units, lo=share.lo, hi=share.hi, n_samples=n, rank=rank,
                         world_size=world_size, keep=tuple(keep), **cfg)  # type: ignore[arg-type]


def _remaining(plan: EpochPlan, done: int) -> Pieces:
    """The samples of ``plan``'s pieces that are not among the first ``done`` it yields, in piece order."""
    off = plan.buffer_offsets
    units: list[int] = []
    los: list[int] = []
    his: list[int] = []
    picks: list[np.ndarray | None] = []
    for j in range(plan.n_buffers):
        if off[j + 1] <= done:
            continue  # yielded whole
        sl = plan.buffer_pieces(j)
        u, lo, hi = plan.units[sl], plan.lo[sl], plan.hi[sl]
        keep = plan.keep[j] if isinstance(plan, RemainderPlan) and j < len(plan.keep) else None
        if keep is None and off[j] >= done:  # untouched, whole pieces
            units += u.tolist()
            los += lo.tolist()
            his += hi.tolist()
            picks += [None] * len(u)
            continue
        sizes = hi - lo
        n = int(sizes.sum())
        left = plan.buffer_perm(j, n)[max(done - int(off[j]), 0):]  # positions not yielded yet
        left = np.sort(left)
        cut = np.concatenate([[0], np.cumsum(sizes)])
        for s in range(len(u)):
            a, b = np.searchsorted(left, [cut[s], cut[s + 1]])
            if b == a:
                continue
            ids = left[a:b] - cut[s] + lo[s]
            units.append(int(u[s]))
            los.append(int(ids[0]))
            his.append(int(ids[-1]) + 1)
            picks.append(None if b - a == sizes[s] else ids)
    return Pieces.of(units, los, his, picks)


def _tail(seq: Pieces, start: int) -> Pieces:
    """The samples of ``seq`` from position ``start`` on (those ``rank_share`` gave no rank)."""
    cum = np.concatenate([[0], np.cumsum(seq.counts)])
    i = int(np.searchsorted(cum, start, side="right")) - 1
    units: list[int] = []
    los: list[int] = []
    his: list[int] = []
    picks: list[np.ndarray | None] = []
    for p in range(max(i, 0), len(seq.picks)):
        skip = max(start - int(cum[p]), 0)
        if skip >= seq.counts[p]:
            continue
        pick = seq.picks[p]
        units.append(int(seq.units[p]))
        if pick is None:
            los.append(int(seq.lo[p]) + skip)
            his.append(int(seq.hi[p]))
            picks.append(None)
        else:
            ids = pick[skip:]
            los.append(int(ids[0]))
            his.append(int(ids[-1]) + 1)
            picks.append(None if len(ids) == ids[-1] + 1 - ids[0] else ids)
    return Pieces.of(units, los, his, picks)


def _concat(parts: list[Pieces]) -> Pieces:
    return Pieces(np.concatenate([p.units for p in parts] + [np.zeros(0, np.int64)]),
                  np.concatenate([p.lo for p in parts] + [np.zeros(0, np.int64)]),
                  np.concatenate([p.hi for p in parts] + [np.zeros(0, np.int64)]),
                  tuple(x for p in parts for x in p.picks))


def epoch_rest(space: SampleSpace, hops: list[tuple[int, int]], *, seed: int, epoch: int, shuffle: bool,
               batch_size: int, block_chunks: int, drop_last: bool) -> Pieces:
    """The samples of ``epoch`` no rank has yielded after the elastic ``hops``, in dealing order.

    ``hops[t] = (W, b)``: the ranks of a run of world size ``W`` (in lockstep) each yielded ``b``
    batches of their share of what the hops before left (the epoch's own plan for the first).
    Every sample of the split not yielded in a hop is in the result, exactly once: each old
    rank's unread rest in its order, then what no old rank was given.
    """
    order = unit_order(space, seed=seed, epoch=epoch, shuffle=shuffle, block_chunks=block_chunks)
    n = len(order)
    seq = Pieces(order, np.zeros(n, np.int64), space.counts[order].copy(), (None,) * n)
    cfg = dict(block_chunks=block_chunks, batch_size=batch_size, drop_last=drop_last, shuffle=shuffle, seed=seed,
               epoch=epoch)
    for world_size, done in hops:
        rest, given = [], 0
        for r in range(world_size):
            share, n_r = _deal(seq, world_size, r, batch_size, drop_last)
            given += int(share.counts.sum())
            rest.append(_remaining(_plan_of(share, n_r, world_size=world_size, rank=r, **cfg),
                                   min(done * batch_size, n_r)))
        rest.append(_tail(seq, given))
        seq = _concat(rest)
    return seq


def segment_plan(space: SampleSpace, hops: list[tuple[int, int]], *, seed: int, epoch: int, shuffle: bool,
                 batch_size: int, block_chunks: int, drop_last: bool, rank: int, world_size: int) -> EpochPlan:
    """This rank's plan for the rest of ``epoch`` after the elastic ``hops`` (see :func:`epoch_rest`):
    the rest dealt across ``world_size`` ranks as an epoch is (equal batch counts, fewer than
    ``world_size * batch_size`` samples left out, none twice). Without hops, ``epoch_plan``'s."""
    cfg = dict(seed=seed, epoch=epoch, shuffle=shuffle, batch_size=batch_size, block_chunks=block_chunks,
               drop_last=drop_last)
    if not hops:
        return epoch_plan(space, rank=rank, world_size=world_size, **cfg)  # type: ignore[arg-type]
    seq = epoch_rest(space, hops, **cfg)  # type: ignore[arg-type]
    share, n = _deal(seq, world_size, rank, batch_size, drop_last)
    return _plan_of(share, n, world_size=world_size, rank=rank, **cfg)
