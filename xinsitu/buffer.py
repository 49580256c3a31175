"""The shuffle-block buffer: a block of chunk blocks read into one array per variable,
and batches gathered from it with vectorised numpy (one fancy-index per variable).

Layout of a variable's buffer: ``(slot, sampled dims the variable has (space order),
its other dims (own order))``. A *slot* holds one unit (chunk block) of the split,
plus the halo a window or tile spills into; variables without a split dim hold the
whole variable in a single slot, read once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np

from xinsitu.plan import EpochPlan, SampleSpace
from xinsitu.reader import Reader
from xinsitu.source import VarSource


@dataclass
class VarLayout:
    """Where one variable's axes go in its buffer and in its output."""

    src: VarSource
    sampled: list[int]  # positions in space.dims of the sampled dims this variable has
    order: list[int]  # var axis of each buffer axis after the slot axis
    out_dims: tuple[str, ...]  # output dims after the sample axis
    out_perm: tuple[int, ...] | None  # transpose of the gathered array into out_dims (None: none needed)
    static: bool  # no split dim: read once, whole

    @classmethod
    def build(cls, src: VarSource, space: SampleSpace) -> VarLayout:
        names = [d.name for d in space.dims]
        sampled = [k for k, n in enumerate(names) if n in src.dims]
        samp_axes = [src.dims.index(names[k]) for k in sampled]
        other = [ax for ax in range(len(src.dims)) if ax not in samp_axes]
        order = samp_axes + other
        kept_names = [names[k] for k in sampled if space.dims[k].keep]
        gathered = kept_names + [src.dims[ax] for ax in other]
        out_dims = tuple(d for d in src.dims if d in gathered)
        perm = tuple(gathered.index(d) + 1 for d in out_dims)
        out_perm = None if perm == tuple(range(1, len(perm) + 1)) else (0, *perm)
        static = not any(space.dims[k].split for k in sampled)
        return cls(src, sampled, order, out_dims, out_perm, static)

    @property
    def has_sample_axis(self) -> bool:
        return bool(self.sampled)


@dataclass
class Block:
    """Block ``j`` of an epoch, loaded: per-variable buffers and its samples in yield order."""

    j: int
    ids: np.ndarray  # global sample ids, in yield order
    slot: np.ndarray  # slot of each sample (yield order)
    starts: np.ndarray  # (n, sampled dims) start positions (yield order)
    origin: np.ndarray  # (slots, split dims) first position held by each slot
    arrays: dict[str, np.ndarray]


class BlockLoader:
    """Reads shuffle blocks and gathers batches from them."""

    def __init__(self, space: SampleSpace, layouts: dict[str, VarLayout], reader: Reader):
        self.space = space
        self.layouts = layouts
        self.reader = reader
        self.n_split = len(space.split_dims)
        self._static: dict[str, np.ndarray] | None = None
        self._pool: dict[tuple[tuple[int, ...], np.dtype], list[np.ndarray]] = {}
        self.pool_size = 4

    # ------------------------------------------------------------------ reading
    async def load_static(self) -> dict[str, np.ndarray]:
        """Variables without a split dim: read whole, once per generator."""
        if self._static is None:
            static = {n: lay for n, lay in self.layouts.items() if lay.static}
            arrs = await asyncio.gather(*(self.reader.read(lay.src, {}) for lay in static.values()))
            self._static = {n: np.transpose(a, lay.order)[None] for (n, lay), a in zip(static.items(), arrs,
                                                                                       strict=True)}
        return self._static

    async def load(self, plan: EpochPlan, j: int) -> Block:
        """Read every chunk of block ``j`` once (all variables, all units concurrently)."""
        sp = self.space
        sl = plan.block_pieces(j)
        units, lo, hi = plan.units[sl], plan.lo[sl], plan.hi[sl]
        tables, slots, origins, ends = [], [], [], []
        for s, (u, a, b) in enumerate(zip(units, lo, hi, strict=True)):
            st = sp.unit_starts(int(u))
            st = st[a:b]
            tables.append(st)
            slots.append(np.full(len(st), s, dtype=np.int64))
            coords = np.unravel_index(int(sp.blocks[u]), sp.grid)
            org = np.array([sp.edges[k][c] for k, c in enumerate(coords)], dtype=np.int64)
            widths = np.array([d.width for d in sp.split_dims], dtype=np.int64)
            block_end = np.array([sp.edges[k][c + 1] for k, c in enumerate(coords)], dtype=np.int64)
            end = np.maximum(block_end, (st[:, : self.n_split] + widths).max(axis=0)) if len(st) else block_end
            origins.append(org)
            ends.append(end)
        origin = np.array(origins, dtype=np.int64).reshape(len(units), self.n_split)
        end = np.array(ends, dtype=np.int64).reshape(len(units), self.n_split)
        extent = (end - origin).max(axis=0) if len(units) else np.zeros(self.n_split, np.int64)
        base_starts = np.concatenate(tables) if tables else np.zeros((0, len(sp.dims)), np.int64)
        base_slot = np.concatenate(slots) if slots else np.zeros(0, np.int64)
        base_ids = np.concatenate([plan_ids(sp, int(u), int(a), int(b)) for u, a, b in zip(units, lo, hi,
                                                                                          strict=True)]) \
            if len(units) else np.zeros(0, np.int64)
        perm = plan.block_perm(j, len(base_ids))
        arrays = {}
        jobs = []
        for name, lay in self.layouts.items():
            if lay.static:
                continue
            shape = [len(units)] + [self._axis_len(lay, ax, extent) for ax in lay.order]
            buf = self._empty(shape, lay.src.raw_dtype)
            arrays[name] = buf
            reads = []
            for s in range(len(units)):
                region = {d.name: (int(origin[s, k]), int(end[s, k])) for k, d in enumerate(sp.split_dims)
                          if d.name in lay.src.dims}
                reads.append((region, self._slot_view(lay, buf, s, region)))
            jobs.append(self.reader.read_many(lay.src, reads))
        await asyncio.gather(*jobs)
        arrays.update(await self.load_static())
        return Block(j, base_ids[perm], base_slot[perm], base_starts[perm], origin, arrays)

    def _axis_len(self, lay: VarLayout, ax: int, extent: np.ndarray) -> int:
        dim = lay.src.dims[ax]
        for k, d in enumerate(self.space.split_dims):
            if d.name == dim:
                return int(extent[k])
        return lay.src.shape[ax]

    @staticmethod
    def _slot_view(lay: VarLayout, buf: np.ndarray, s: int, region: dict[str, tuple[int, int]]) -> np.ndarray:
        """Slot ``s`` of ``buf`` seen in the variable's dim order, cut to ``region``'s extent."""
        view = np.transpose(buf[s], np.argsort(lay.order))
        return view[tuple(slice(0, region[d][1] - region[d][0]) if d in region else slice(None)
                          for d in lay.src.dims)]

    # ------------------------------------------------------------------ buffers
    def _empty(self, shape: list[int], dtype: np.dtype) -> np.ndarray:
        """A block array, recycled from a released block where one of that shape is free
        (fresh pages cost a page fault each on first touch)."""
        free = self._pool.get((tuple(shape), np.dtype(dtype)))
        return free.pop() if free else np.empty(shape, dtype=dtype)

    def recycle(self, block: Block) -> None:
        """Give a block's arrays back once no batch will be gathered from it again."""
        for name, arr in block.arrays.items():
            if not self.layouts[name].static:
                free = self._pool.setdefault((arr.shape, arr.dtype), [])
                if len(free) < self.pool_size:
                    free.append(arr)

    # ------------------------------------------------------------------ gathering
    def gather(self, block: Block, rows: np.ndarray,
               into: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Raw values of samples ``rows`` (positions in the block's yield order), per variable;
        written into ``into[var]`` (e.g. a channel of a stacked batch) where given."""
        slot = block.slot[rows]
        st = block.starts[rows]
        out = {}
        for name, lay in self.layouts.items():
            buf = block.arrays[name]
            if not lay.has_sample_axis:
                out[name] = buf[0].transpose(np.argsort(lay.order))
                continue
            out[name] = self._gather_var(lay, buf, slot, st, block.origin, None if into is None else into[name])
        return out

    def _gather_var(self, lay: VarLayout, buf: np.ndarray, slot: np.ndarray, st: np.ndarray,
                    origin: np.ndarray, into: np.ndarray | None = None) -> np.ndarray:
        sp = self.space
        n = len(slot)
        kept = [k for k in lay.sampled if sp.dims[k].keep]
        nk = len(kept)
        slot_idx = np.zeros(n, np.int64) if lay.static else slot
        local = []
        for k in lay.sampled:
            pos = st[:, k] - (origin[slot_idx, k] if sp.dims[k].split else 0)
            local.append(pos)
        # fast path: one position-only sampled dim first in a contiguous buffer -> a single np.take
        if len(lay.sampled) == 1 and nk == 0 and buf.flags.c_contiguous:
            flat = buf.reshape(buf.shape[0] * buf.shape[1], *buf.shape[2:])
            # indices are in range by construction: mode="clip" lets numpy write into `into` unbuffered
            return np.take(flat, slot_idx * buf.shape[1] + local[0], axis=0, out=into, mode="clip")
        idx: list[Any] = [slot_idx.reshape((n,) + (1,) * nk)]
        for k, pos in zip(lay.sampled, local, strict=True):
            shape = [n] + [1] * nk
            if sp.dims[k].keep:
                at = kept.index(k) + 1
                w = sp.dims[k].width
                shape[at] = w
                ar = np.arange(w, dtype=np.int64).reshape([1] + [w if i == at else 1 for i in range(1, nk + 1)])
                idx.append(pos.reshape([n] + [1] * nk) + ar)
            else:
                idx.append(pos.reshape([n] + [1] * nk))
        res = buf[tuple(idx)]
        if lay.out_perm is not None:
            res = np.ascontiguousarray(res.transpose(lay.out_perm))
        if into is not None:
            into[...] = res
            return into
        return res


def plan_ids(space: SampleSpace, unit: int, lo: int, hi: int) -> np.ndarray:
    return space.offsets[unit] + np.arange(lo, hi, dtype=np.int64)
