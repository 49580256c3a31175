"""The halo: windows and tiles that spill from one chunk block into its neighbours, passed on from the
buffer that reads a block to the later buffers that need part of it, rather than read again
(``HaloPlan``: planned once per epoch, pure index math; ``_Step``: what one buffer reads, takes and
gives, on the I/O loop). Boxes are per split dim ``(first, end)`` positions.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable

import numpy as np

from xinsitu.index.plan import EpochPlan
from xinsitu.index.sampling import SampleSpace, VarLayout

Region = dict[str, tuple[int, int]]
#: a buffer passes the chunks a window spills into on to the buffers up to this many later (at most: a
#: plan reaches as far as its order needs, 1-2 buffers along one split dim, a few more over a grid)
HALO_BUFFERS = 64
#: ... as long as what is passed on and not yet taken stays within this many buffers of whole units
#: (as much as the buffers read ahead and held): where it would hold more, it reaches less far and a
#: chunk is read again (a grid of many blocks, in buffers of few units, whose tiles are as big as a chunk)
HALO_HELD_BUFFERS = 3

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (first, end) positions per split dim
#: an entry a buffer passes on: (the buffer, the unit, the box of the unit's positions)
Entry = tuple[int, int, tuple[int, ...], tuple[int, ...]]


def _box(dims: tuple[str, ...], names: list[str], lo: tuple[int, ...], hi: tuple[int, ...],
         origin: list[int] | tuple[int, ...]) -> tuple[slice, ...]:
    """Where box ``[lo, hi)`` (per split dim ``names``) lies in an array of ``dims`` whose first position
    along each split dim is ``origin`` (its other dims whole)."""
    at = {n: k for k, n in enumerate(names)}
    return tuple(slice(lo[at[d]] - origin[at[d]], hi[at[d]] - origin[at[d]]) if d in at else slice(None)
                 for d in dims)


class _Step:
    """What buffer ``j`` of a ``HaloPlan`` reads, takes and gives (state lives on the I/O loop)."""

    def __init__(self, halo: HaloPlan, j: int):
        self.halo, self.j = halo, j
        self.segments = halo.segments[j]  # per slot: [(lo, hi, entry or None)]
        self.give = halo.gives[j]  # entry -> (lo, hi): the box this buffer reads for later buffers
        self.held = halo.held  # entry -> {var: array (the box, in the variable's dim order)}

    def region(self, lo: tuple[int, ...], hi: tuple[int, ...]) -> Region:
        return {n: (a, b) for n, a, b in zip(self.halo.names, lo, hi, strict=True)}

    def piece(self, lay: VarLayout, view: np.ndarray, lo: tuple[int, ...], hi: tuple[int, ...],
              origin: list[int]) -> np.ndarray:
        """Box ``[lo, hi)`` of ``view``: a variable's slot in its own dim order, whose first position is
        ``origin``."""
        return view[_box(lay.src.dims, self.halo.names, lo, hi, origin)]

    def held_array(self, lay: VarLayout, lo: tuple[int, ...], hi: tuple[int, ...]) -> np.ndarray:
        """A new array for box ``[lo, hi)`` of a variable (its own dim order, its other dims whole)."""
        ext = {n: b - a for n, a, b in zip(self.halo.names, lo, hi, strict=True)}
        return np.empty([ext.get(d, n) for d, n in zip(lay.src.dims, lay.src.shape, strict=True)],
                        lay.src.raw_dtype)

    async def take(self, arrays: dict[str, np.ndarray], origin: np.ndarray, inverse: dict[str, tuple[int, ...]],
                   layouts: dict[str, VarLayout]) -> None:
        """Copy what earlier buffers passed on into this buffer's slots (after they are loaded)."""
        h = self.halo
        want = {e for seg in self.segments for _, _, e in seg if e is not None}
        for g in sorted({e[0] for e in want}):
            await asyncio.shield(h.ready(g))
        if not want:
            return

        def copy() -> None:
            for s, seg in enumerate(self.segments):
                o = origin[s].tolist()
                for lo, hi, e in seg:
                    if e is None:
                        continue
                    for name, held in h.held[e].items():
                        dims = layouts[name].src.dims
                        view = arrays[name][s].transpose(inverse[name])
                        view[_box(dims, h.names, lo, hi, o)] = held[_box(dims, h.names, lo, hi, e[2])]

        await asyncio.get_running_loop().run_in_executor(None, copy)
        for e in want:
            h.takers[e] -= 1
            if not h.takers[e]:  # its last taker has it: let it go
                h.held.pop(e, None)

    def done(self) -> None:
        fut = self.halo.ready(self.j)
        if not fut.done():
            fut.set_result(None)

    def fail(self, e: BaseException) -> None:
        fut = self.halo.ready(self.j)
        if not fut.done():
            fut.set_exception(e if isinstance(e, Exception) else RuntimeError("xinsitu: buffer load cancelled"))
            fut.exception()  # retrieved: no "never retrieved" warning where no buffer waits on it


class HaloPlan:
    """Windows and tiles that spill into neighbouring units, in one epoch: a slot's region reaches
    from its unit into the next ones along the split dims it spills along (and the diagonals between
    them). Rather than read such a chunk again, the first buffer that reads a unit reads the boxes of
    it that later buffers need and passes them on, up to ``ahead`` buffers later: as far as the
    epoch's order needs (``shuffle.neighbour_order``, ``neighbour_order_nd``), as long as what is held
    stays within ``HALO_HELD_BUFFERS`` buffers of units. Values and order are unchanged. A box inside
    one passed on already is taken from that one; each is let go after its last taker.

    Planned once per epoch (pure index math): per buffer and slot the boxes of its region, one per
    unit it touches, each read or taken from an entry ``(buffer, unit, box)`` an earlier buffer fills.
    """

    def __init__(self, sp: SampleSpace, plan: EpochPlan, first: int, ahead: int,
                 regions: Callable[[int], tuple[np.ndarray, np.ndarray]]):
        self.names = [d.name for d in sp.split_dims]
        unit_of = dict(zip(sp.blocks.ids().tolist(), range(sp.n_units), strict=True))  # block id -> unit
        n_buf = plan.n_buffers
        buffers = range(first, n_buf)
        need: dict[int, list[list[tuple[int | None, tuple[int, ...], tuple[int, ...]]]]] = {}
        first_need: dict[int, int] = {}  # unit -> the first buffer that needs any of it
        for j in buffers:
            origin, end = regions(j)
            need[j] = [_boxes(sp.edges, sp.grid, unit_of, o, e) for o, e in zip(origin.tolist(), end.tolist(),
                                                                                 strict=True)]
            for segs in need[j]:
                for u, _, _ in segs:
                    if u is not None:
                        first_need.setdefault(u, j)
        boxes = {j: [(s, i, u, lo, hi) for s, segs in enumerate(need[j]) for i, (u, lo, hi) in enumerate(segs)
                     if u is not None] for j in buffers}
        reach = max((j - first_need[b[2]] for j in buffers for b in boxes[j]), default=0)
        # hold at most about HALO_HELD_BUFFERS buffers of units at once: reach less far where that would
        # hold more (a grid of many blocks in buffers of few units); beyond it a chunk is read again
        block = int(np.prod([int(np.diff(e).max()) for e in sp.edges]))
        most = HALO_HELD_BUFFERS * block * max((len(plan.units[plan.buffer_pieces(j)]) for j in buffers), default=1)
        lo, hi = 1, max(1, min(ahead, reach))
        plans = {hi: _assign(need, boxes, buffers, hi)}
        if plans[hi][3] <= most:
            lo = hi
        while hi - lo > 1:  # the farthest reach that holds no more than that (held grows with the reach)
            mid = (lo + hi) // 2
            plans[mid] = _assign(need, boxes, buffers, mid)
            lo, hi = (mid, hi) if plans[mid][3] <= most else (lo, mid)
        got = plans.get(lo) or _assign(need, boxes, buffers, lo)
        self.segments, self.gives, self.takers, self.peak = got
        self.ahead, self.block = lo, block  # (peak and block: positions of the split dims)
        self.held: dict[Entry, dict[str, np.ndarray]] = {}
        self._ready: dict[int, asyncio.Future] = {}

    def ready(self, j: int) -> asyncio.Future:
        """Resolved when buffer ``j`` has filled what it passes on (created on the I/O loop)."""
        if j not in self._ready:
            self._ready[j] = asyncio.get_running_loop().create_future()
        return self._ready[j]

    def step(self, j: int) -> _Step:
        return _Step(self, j)

    @property
    def n_entries(self) -> int:
        return len(self.takers)


def _assign(need: dict[int, list[list[tuple[int | None, tuple[int, ...], tuple[int, ...]]]]],
            boxes: dict[int, list[tuple[int, int, int, tuple[int, ...], tuple[int, ...]]]], buffers: range,
            ahead: int) -> tuple[dict, dict, dict, int]:
    """A ``HaloPlan`` reaching ``ahead`` buffers: per buffer and slot its boxes, each ``(lo, hi, entry)``
    (entry None: read here); per buffer the entries it gives; per entry its takers; and the most
    positions held at once (summed over the boxes that are given and not yet taken by their last taker)."""
    segments: dict[int, list[list[tuple[tuple[int, ...], tuple[int, ...], Entry | None]]]] = {}
    gives: dict[int, dict[Entry, Box]] = {j: {} for j in buffers}
    takers: dict[Entry, int] = {}  # entry -> buffers taking from it (it is let go after the last)
    last: dict[Entry, int] = {}
    assigned: dict[tuple[int, int, int], Entry] = {}  # (buffer, slot, box) -> the entry it takes
    for j in buffers:
        reads = set()
        per_slot = []
        for s, segs in enumerate(need[j]):
            out = []
            for i, (u, lo, hi) in enumerate(segs):
                key = assigned.pop((j, s, i), None)
                out.append((lo, hi, key))
                if key is None and u is not None:
                    reads.add(u)
            per_slot.append(out)
        segments[j] = per_slot
        # what later buffers need of the units read here, biggest boxes first: a box inside one given
        # already is taken from that one (a unit's whole box and its neighbours' edges: held once)
        wanted = [(k, s, i, u, lo, hi) for k in range(j + 1, min(j + ahead + 1, buffers.stop))
                  for s, i, u, lo, hi in boxes[k] if u in reads and (k, s, i) not in assigned]
        wanted.sort(key=lambda w: -_volume(w[4], w[5]))
        mine: dict[int, list[Entry]] = {}
        takes: set[tuple[Entry, int]] = set()
        for k, s, i, u, lo, hi in wanted:
            key = next((e for e in mine.get(u, ()) if _inside(lo, hi, e[2], e[3])), None)
            if key is None:
                key = (j, u, lo, hi)
                gives[j][key] = (lo, hi)
                mine.setdefault(u, []).append(key)
            assigned[(k, s, i)] = key
            takes.add((key, k))
        for key, k in takes:
            takers[key] = takers.get(key, 0) + 1
            last[key] = max(last.get(key, k), k)
    held = np.zeros(len(buffers) + 1, np.int64)
    for key, k in last.items():
        held[key[0] - buffers.start] += _volume(key[2], key[3])
        held[k - buffers.start] -= _volume(key[2], key[3])
    return segments, gives, takers, int(np.cumsum(held).max()) if len(held) else 0


def _volume(lo: tuple[int, ...], hi: tuple[int, ...]) -> int:
    """Positions in box ``[lo, hi)``."""
    return math.prod(b - a for a, b in zip(lo, hi, strict=True))


def _inside(lo: tuple[int, ...], hi: tuple[int, ...], lo2: tuple[int, ...], hi2: tuple[int, ...]) -> bool:
    """Whether box ``[lo, hi)`` lies inside box ``[lo2, hi2)``."""
    return all(a >= a2 and b <= b2 for a, b, a2, b2 in zip(lo, hi, lo2, hi2, strict=True))


def _boxes(edges: list[np.ndarray], grid: tuple[int, ...], unit_of: dict[int, int], origin: list[int],
           end: list[int]) -> list[tuple[int | None, tuple[int, ...], tuple[int, ...]]]:
    """A slot's region ``[origin, end)`` cut at the chunk-block edges: per block it touches, the block's
    unit (None where the block is not the split's) and the box of the region in it."""
    per_dim = []
    for e, o, z in zip(edges, origin, end, strict=True):
        c0 = int(np.searchsorted(e, o, side="right")) - 1
        c1 = int(np.searchsorted(e, z - 1, side="right")) - 1
        per_dim.append([(c, max(o, int(e[c])), min(z, int(e[c + 1]))) for c in range(c0, c1 + 1)])
    out = []
    for combo in itertools.product(*per_dim):
        block = int(np.ravel_multi_index(tuple(c for c, _, _ in combo), grid))
        out.append((unit_of.get(block), tuple(a for _, a, _ in combo), tuple(b for _, _, b in combo)))
    return out
