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
#: a buffer passes the chunks a window spills into on to the buffers up to this many later (as far as the
#: order needs: a window of k one-step chunks, k - 1 buffers; a grid's anti-diagonal of blocks, a few more)
HALO_BUFFERS = 64
#: ... as long as what is passed on and not yet taken stays within this many buffers of slots (a unit and
#: what its windows spill into: as much as the buffers read ahead and held); a box that would hold more is
#: read again by its takers (a grid of many blocks in buffers of one or two, tiles as big as a chunk)
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
        self.segments = halo.segments(j)  # per slot: [(lo, hi, entry or None)]
        self.give = halo.gives(j)  # entry -> (lo, hi): the box this buffer reads for later buffers
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
                del h.takers[e]
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
    it that later buffers need and passes them on, up to ``ahead`` buffers later (the epoch's order
    puts a unit close after the neighbours it spills into: ``shuffle.neighbour_order``,
    ``neighbour_order_nd``), as long as what is held stays within ``HALO_HELD_BUFFERS`` buffers of
    slots: a box that would hold more is read again by its takers. Values and order are unchanged. A
    box inside one passed on already is taken from that one; each is let go after its last taker.

    Pure index math, planned a buffer at a time as the epoch's loads ask for it (``step``), so an epoch
    of a million one-step chunks starts at once: per buffer and slot the boxes of its region, one per
    unit it touches, each read or taken from an entry ``(buffer, unit, box)`` an earlier buffer fills.
    """

    def __init__(self, sp: SampleSpace, plan: EpochPlan, first: int, ahead: int,
                 regions: Callable[[int], tuple[np.ndarray, np.ndarray]]):
        self.names = [d.name for d in sp.split_dims]
        unit_of = np.full(int(np.prod(sp.grid)), -1, np.int64)  # block id -> unit (-1: not the split's)
        unit_of[sp.blocks.ids()] = np.arange(sp.n_units)

        def needs(j: int) -> list[list[Need]]:
            origin, end = regions(j)
            return [_boxes(sp.edges, sp.grid, unit_of, o, e) for o, e in zip(origin.tolist(), end.tolist(),
                                                                             strict=True)]

        # positions of a slot: a unit and what its windows and tiles spill into (what buffers hold per unit)
        self.slot = slot = int(np.prod([int(np.diff(e).max()) + d.width - 1
                                          for d, e in zip(sp.split_dims, sp.edges, strict=True)]))
        most = HALO_HELD_BUFFERS * slot * max(1, min(plan.block_chunks, len(plan.units)))
        self._assign = _Assign(needs, range(first, plan.n_buffers), ahead, most)
        self.takers = self._assign.takers  # entry -> buffers yet to take it
        self.held: dict[Entry, dict[str, np.ndarray]] = {}
        self._ready: dict[int, asyncio.Future] = {}

    def ready(self, j: int) -> asyncio.Future:
        """Resolved when buffer ``j`` has filled what it passes on (created on the I/O loop)."""
        if j not in self._ready:
            self._ready[j] = asyncio.get_running_loop().create_future()
        return self._ready[j]

    def step(self, j: int) -> _Step:
        """What buffer ``j`` reads, takes and gives (planned now, with what it passes on)."""
        self._assign.through(j)
        return _Step(self, j)

    def segments(self, j: int) -> list[list[tuple[tuple[int, ...], tuple[int, ...], Entry | None]]]:
        return self._assign.segments.pop(j)

    def gives(self, j: int) -> dict[Entry, Box]:
        return self._assign.gives.pop(j)

    @property
    def n_entries(self) -> int:
        """Entries passed on over the epoch (plans the rest of it: for tests and benchmarks)."""
        self._assign.through(self._assign.buffers.stop - 1)
        return self._assign.n_entries

    @property
    def peak(self) -> int:
        """The most positions held at once over the epoch (plans the rest of it: for tests and benchmarks)."""
        self._assign.through(self._assign.buffers.stop - 1)
        return self._assign.peak


Need = tuple[int | None, tuple[int, ...], tuple[int, ...]]  # (unit or None, lo, hi): a box of a slot


class _Assign:
    """A ``HaloPlan``, buffer by buffer (``through``): per buffer and slot its boxes, each ``(lo, hi,
    entry)`` (entry None: read here); per buffer the entries it gives; per entry its takers; and the
    most positions held at once (``peak``: summed over the entries given and not yet taken by their
    last taker), never more than ``most``: an entry that would hold more is not given."""

    def __init__(self, needs: Callable[[int], list[list[Need]]], buffers: range, ahead: int, most: int):
        self.needs, self.buffers, self.ahead, self.most = needs, buffers, ahead, most
        self.need: dict[int, list[list[Need]]] = {}  # buffer -> per slot its boxes (until it is planned)
        self.by_unit: dict[int, list[tuple[int, int, int, tuple[int, ...], tuple[int, ...]]]] = {}
        self.segments: dict[int, list[list[tuple[tuple[int, ...], tuple[int, ...], Entry | None]]]] = {}
        self.gives: dict[int, dict[Entry, Box]] = {}
        self.takers: dict[Entry, int] = {}  # entry -> buffers taking from it (it is let go after the last)
        self.assigned: dict[tuple[int, int, int], Entry] = {}  # (buffer, slot, box) -> the entry it takes
        self.held: dict[int, int] = {}  # buffer -> positions held while it loads
        self.next = self.known = buffers.start
        self.peak = self.n_entries = 0

    def through(self, j: int) -> None:
        """Plan every buffer up to ``j``."""
        while self.next <= min(j, self.buffers.stop - 1):
            self._plan(self.next)
            self.next += 1

    def _know(self, k: int) -> None:
        """The boxes of every buffer up to ``k``, and who needs each unit."""
        while self.known <= min(k, self.buffers.stop - 1):
            segs = self.need[self.known] = self.needs(self.known)
            for s, seg in enumerate(segs):
                for i, (u, lo, hi) in enumerate(seg):
                    if u is not None:
                        self.by_unit.setdefault(u, []).append((self.known, s, i, lo, hi))
            self.known += 1

    def _plan(self, j: int) -> None:
        self._know(j + self.ahead)
        assigned = self.assigned
        reads = set()
        per_slot = []
        need = self.need.pop(j)
        for s, segs in enumerate(need):
            out = []
            for i, (u, lo, hi) in enumerate(segs):
                if u is None:  # a block not the split's: no sample reaches it (SPEC §3), so it is not read
                    continue
                key = assigned.pop((j, s, i), None)
                out.append((lo, hi, key))
                if key is None:
                    reads.add(u)
            per_slot.append(out)
        self.segments[j] = per_slot
        for u in {u for segs in need for u, _, _ in segs if u is not None}:  # this buffer's needs are met
            rest = [w for w in self.by_unit[u] if w[0] > j]
            if rest:
                self.by_unit[u] = rest
            else:
                del self.by_unit[u]
        # what later buffers need of the units read here, biggest boxes first: a box inside one given
        # already is taken from that one (a unit's whole box and its neighbours' edges: held once)
        wanted = sorted(((k, s, i, u, lo, hi) for u in reads for k, s, i, lo, hi in self.by_unit.get(u, ())
                         if k <= j + self.ahead and (k, s, i) not in assigned),
                        key=lambda w: (-_volume(w[4], w[5]), w[0], w[1], w[2]))
        mine: dict[int, list[Entry]] = {}
        takes: dict[Entry, list[tuple[int, int, int]]] = {}
        for k, s, i, u, lo, hi in wanted:
            key = next((e for e in mine.get(u, ()) if _inside(lo, hi, e[2], e[3])), None)
            if key is None:
                key = (j, u, lo, hi)
                mine.setdefault(u, []).append(key)
                takes[key] = []
            takes[key].append((k, s, i))
        gives: dict[Entry, Box] = {}
        held = self.held
        held.pop(j - 1, None)
        for key, who in takes.items():  # (biggest first)
            last = max(k for k, _, _ in who)
            vol = _volume(key[2], key[3])
            if max(held.get(t, 0) for t in range(j, last)) + vol > self.most:
                continue  # it would hold too much: its takers read it themselves
            for t in range(j, last):
                held[t] = held.get(t, 0) + vol
                self.peak = max(self.peak, held[t])
            gives[key] = (key[2], key[3])
            self.takers[key] = len({k for k, _, _ in who})
            for w in who:
                assigned[w] = key
        self.gives[j] = gives
        self.n_entries += len(gives)


def _volume(lo: tuple[int, ...], hi: tuple[int, ...]) -> int:
    """Positions in box ``[lo, hi)``."""
    if len(lo) == 1:
        return hi[0] - lo[0]
    return math.prod(b - a for a, b in zip(lo, hi, strict=True))


def _inside(lo: tuple[int, ...], hi: tuple[int, ...], lo2: tuple[int, ...], hi2: tuple[int, ...]) -> bool:
    """Whether box ``[lo, hi)`` lies inside box ``[lo2, hi2)``."""
    return all(a >= a2 and b <= b2 for a, b, a2, b2 in zip(lo, hi, lo2, hi2, strict=True))


def _boxes(edges: list[np.ndarray], grid: tuple[int, ...], unit_of: np.ndarray, origin: list[int],
           end: list[int]) -> list[Need]:
    """A slot's region ``[origin, end)`` cut at the chunk-block edges: per block it touches, the block's
    unit (None where the block is not the split's) and the box of the region in it."""
    per_dim = []
    for e, o, z in zip(edges, origin, end, strict=True):
        c0 = int(e.searchsorted(o, side="right")) - 1
        c1 = int(e.searchsorted(z - 1, side="right")) - 1
        per_dim.append([(c, max(o, int(e[c])), min(z, int(e[c + 1]))) for c in range(c0, c1 + 1)])
    if len(per_dim) == 1:  # one split dim: the blocks along it
        return [(u if (u := int(unit_of[c])) >= 0 else None, (a,), (b,)) for c, a, b in per_dim[0]]
    out = []
    for combo in itertools.product(*per_dim):
        u = int(unit_of[np.ravel_multi_index(tuple(c for c, _, _ in combo), grid)])
        out.append((u if u >= 0 else None, tuple(a for _, a, _ in combo), tuple(b for _, _, b in combo)))
    return out
