"""What a split's samples are: the options that shape them, checked, and the sample space.

Layer 1 (no I/O, no threads). ``sampling(ds, manifest, split, ...)`` checks a manifest
against a Dataset and turns the sampling options (``window``, ``patch``, ``stride``,
``over``, ``variables``) into a :class:`Sampling`: the variables' sources and geometry,
the :class:`SampleSpace` (per unit, i.e. per chunk block of the split, how many samples
and which) and each variable's :class:`VarLayout`. ``BatchGenerator`` and ``StatsPass``
both start from it. Samples are numbered by a global id: units in split order, and inside
a unit in C order over the sampled dims (split dims, then window/patch dims, then ``over``
dims).
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

import numpy as np
import xarray as xr

from xinsitu.index.geometry import Geometry, dataset_geometry
from xinsitu.index.manifest import SplitManifest, coord_span
from xinsitu.index.runs import MASK_SAMPLING, Blocks, decode_mask
from xinsitu.index.snapshot import snapshot_of_sources
from xinsitu.index.source import VarSource


# ---------------------------------------------------------------------- option checks
def int_arg(name: str, v: Any, minimum: int | None = None) -> int:
    """``v`` as an int; a bool, a float or a string is refused (never truncated or parsed)."""
    if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {type(v).__name__} {v!r}")
    if minimum is not None and v < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {v!r}")
    return int(v)


def positive_int(name: str, v: Any) -> int:
    return int_arg(name, v, 1)


def flag(name: str, v: Any) -> bool:
    """``v`` as a bool; ``"no"`` or ``"False"`` would be truthy, so only real booleans pass."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(v).__name__} {v!r}")
    return bool(v)


def variable_names(v: Any, ds: xr.Dataset) -> list[str] | None:
    """``variables=`` as a list of data variable names (None: the default)."""
    if v is None:
        return None
    names = [v] if isinstance(v, str) else v
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"variables must be a variable name or a list of names, got {type(v).__name__} {v!r}")
    if not names:
        raise ValueError("variables is empty: name at least one data variable")
    unknown = [n for n in names if n not in ds.data_vars]
    if unknown:
        raise ValueError(f"variables: unknown variable(s) {unknown}; the Dataset has {list(ds.data_vars)}")
    if len(set(names)) != len(names):
        raise ValueError(f"variables names a variable twice: {list(names)}")
    return list(names)


def dim_map(name: str, v: Any, sizes: dict[str, int]) -> dict[str, int]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise TypeError(f"{name} must be a dict of dim -> length, got {type(v).__name__}")
    out = {}
    for d, n in v.items():
        if d not in sizes:
            raise ValueError(f"{name}: unknown dim {d!r}; the variables have dims {sorted(sizes)}")
        n = positive_int(f"{name}[{d!r}]", n)
        if n > sizes[d]:
            raise ValueError(f"{name}[{d!r}] = {n} is longer than dim {d!r} ({sizes[d]})")
        out[d] = n
    return out


#: ranks a generator plans for at most (its plans hold arrays of this length: a typo of 2**40 ranks would
#: ask for terabytes)
MAX_WORLD_SIZE = 2**20


def dist_defaults(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)``: as given, else torch.distributed's where it is initialised, else ``(0, 1)``.

    ``world_size`` > 1 without ``rank`` (and no torch.distributed to give it) raises ``ValueError``:
    every process would take rank 0 and yield the same batches. ``TypeError``/``ValueError`` name the
    argument for anything else that is not a rank in ``[0, world_size)`` of at most ``MAX_WORLD_SIZE``.
    """
    if rank is None or world_size is None:
        # only a process that imported torch.distributed can have initialised it: don't import
        # torch (~200 MB, ~1 s) just to learn that it hasn't
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
    world_size = 1 if world_size is None else positive_int("world_size", world_size)
    if world_size > MAX_WORLD_SIZE:
        raise ValueError(f"world_size={world_size} is more ranks than xinsitu plans for (at most {MAX_WORLD_SIZE})")
    if rank is None and world_size > 1:
        raise ValueError(f"world_size={world_size} needs rank= (this process's rank, 0 to {world_size - 1}): "
                         "torch.distributed is not initialised here to give it, and taking rank 0 in every "
                         "process would give each the same batches")
    rank = 0 if rank is None else int_arg("rank", rank)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}) for world_size={world_size}, got {rank}")
    return rank, world_size


# ---------------------------------------------------------------------- per-unit arrays by arithmetic
def _index(i: Any, n: int) -> tuple[np.ndarray | None, int | None]:
    """``i`` (an int, a slice or an int array) as positions in ``[0, n)``: ``(array, None)`` or
    ``(None, int)``; ``IndexError`` outside, negative positions counted from the end (as numpy)."""
    if isinstance(i, slice):
        return np.arange(*i.indices(n), dtype=np.int64), None
    if isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)):
        k = int(i) + (n if i < 0 else 0)
        if not 0 <= k < n:
            raise IndexError(f"index {int(i)} is out of bounds for {n} units")
        return None, k
    a = np.asarray(i)
    if a.dtype == bool:
        raise TypeError("boolean indexing is not supported here; use np.asarray first")
    a = a.astype(np.int64, copy=False)
    if a.size and (int(a.min()) < -n or int(a.max()) >= n):
        raise IndexError(f"index out of bounds for {n} units")
    return np.where(a < 0, a + n, a), None


class UnitBlocks:
    """The block id of each unit of a split (unit ``k``: its ``k``-th block), read from the
    manifest's runs (:class:`~xinsitu.index.runs.Blocks`): indexing (an int, a slice or an int
    array) is arithmetic on the runs, so a split of 10^7 chunk blocks in one run holds two
    numbers, not 80 MB of ids. ``np.asarray`` (or ``ids()``) gives them all."""

    def __init__(self, runs: Blocks):
        self.runs = runs
        lengths = runs.stops - runs.starts
        self._ends = np.cumsum(lengths)  # O(runs)
        self._first = self._ends - lengths

    def __len__(self) -> int:
        return len(self.runs)

    def __getitem__(self, i: Any) -> Any:
        a, k = _index(i, len(self))
        if a is None:
            a = np.array([k], dtype=np.int64)
        if self.runs.nruns == 1:
            out = self.runs.starts[0] + a
        else:
            r = np.searchsorted(self._ends, a, side="right")
            out = self.runs.starts[r] + (a - self._first[r])
        return int(out[0]) if k is not None else out

    def __iter__(self) -> Any:
        return iter(self.runs)

    def ids(self) -> np.ndarray:
        return self.runs.ids()

    def copy(self) -> np.ndarray:
        return self.ids()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.ids()
        return a if dtype is None else a.astype(dtype)

    def __repr__(self) -> str:
        return f"UnitBlocks({self.runs!r})"


class EqualOffsets:
    """Global id of each unit's first sample where every unit holds ``size`` samples: ``k * size``
    for ``k`` in ``[0, n_units]`` (as ``SampleSpace.offsets`` is), by arithmetic. Indexing as an
    int64 array's; ``np.asarray`` makes the array."""

    def __init__(self, n_units: int, size: int):
        self.n_units, self.size = int(n_units), int(size)

    def __len__(self) -> int:
        return self.n_units + 1

    def __getitem__(self, i: Any) -> Any:
        a, k = _index(i, self.n_units + 1)
        return a * self.size if a is not None else np.int64(cast(int, k) * self.size)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = np.arange(self.n_units + 1, dtype=np.int64) * self.size
        return a if dtype is None else a.astype(dtype)

    def __repr__(self) -> str:
        return f"EqualOffsets({self.n_units} units of {self.size})"


#: per-unit sample offsets: an array, or arithmetic where units are of equal size
Offsets = np.ndarray | EqualOffsets


def _equal(n: int, size: int) -> np.ndarray:
    """``n`` equal counts as a read-only int64 array of stride 0 (no memory, whatever ``n``);
    ``plan.rank_share`` cuts such counts by arithmetic."""
    return np.broadcast_to(np.int64(size), (n,))


# ---------------------------------------------------------------------- the sample space
@dataclass(frozen=True)
class SampleDim:
    """One dim along which samples are taken."""

    name: str
    size: int  # length in the Dataset
    width: int = 1  # window/patch length (1: a single position)
    stride: int = 1  # tiles start at multiples of the stride
    keep: bool = False  # kept in the output (window/patch); else reduced to one position
    split: bool = False  # a split dim (its chunk blocks are the units)

    def starts(self) -> np.ndarray:
        return np.arange(0, self.size - self.width + 1, self.stride, dtype=np.int64)


class SampleSpace:
    """The samples of one split: per unit (chunk block) how many, and which.

    Parameters
    ----------
    dims : sampled dims, split dims first (in the manifest's order)
    edges : per split dim, the chunk-block edges (len = blocks + 1)
    blocks : flat block ids of the split (C order over the split dims), in split order: an array or
        the manifest's runs (``Blocks``); held as runs (``UnitBlocks``)
    valid : optional bool mask over the split's samples (``ds.insitu.validity``): the space then
        holds only the valid ones. ``counts``, ``offsets``, ``locate`` and ``unit_starts`` all
        speak of valid samples (a unit's local index k is its k-th valid sample), so plans,
        buffers and the map-style dataset need no change to draw valid samples only.
    valid_digest : the mask's digest (part of a generator state)
    """

    def __init__(self, dims: list[SampleDim], edges: dict[str, np.ndarray], blocks: np.ndarray | Blocks | UnitBlocks,
                 valid: np.ndarray | None = None, valid_digest: str | None = None):
        self.dims = list(dims)
        self.split_dims = [d for d in self.dims if d.split]
        self.free_dims = [d for d in self.dims if not d.split]
        if self.dims[: len(self.split_dims)] != self.split_dims:
            raise ValueError("split dims must come first")
        self.edges = [np.asarray(edges[d.name], dtype=np.int64) for d in self.split_dims]
        self.grid = tuple(len(e) - 1 for e in self.edges)
        runs = blocks.runs if isinstance(blocks, UnitBlocks) else Blocks.from_ids(blocks)
        self.blocks = UnitBlocks(runs)
        self._free_starts = [d.starts() for d in self.free_dims]
        self._free_n = int(np.prod([len(s) for s in self._free_starts])) if self.free_dims else 1
        self.valid = None if valid is None else np.asarray(valid, dtype=bool).ravel()
        self.valid_digest = valid_digest
        if self.valid is not None and self.valid.size != int(self.all_offsets[-1]):
            raise ValueError(f"validity mask holds {self.valid.size} samples, the split has "
                             f"{int(self.all_offsets[-1])} of this shape: it was made for other samples")

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a DataLoader worker's copy) without the stride-0 counts of equal units: pickling
        would write them out in full (80 MB at 10^7); they are made again, without memory, on use."""
        state = self.__dict__.copy()
        for k in ("counts", "all_counts"):
            v = state.get(k)
            if isinstance(v, np.ndarray) and v.ndim == 1 and v.strides == (0,):
                del state[k]
        return state

    @property
    def n_units(self) -> int:
        return len(self.blocks)

    @property
    def _one_position(self) -> bool:
        """One split dim sampled at every position: a unit's samples are its block's positions."""
        return len(self.split_dims) == 1 and self.split_dims[0].width == 1 and self.split_dims[0].stride == 1

    @cached_property
    def _cs(self) -> np.ndarray:
        """n-d prefix sums of the membership grid: box queries in O(2^k). Made on first use (windows,
        tiles, several split dims): a split of 10^7 one-position units never needs them."""
        mask = np.zeros(int(np.prod(self.grid)), dtype=bool)
        mask[self.blocks.ids()] = True
        cs = mask.reshape(self.grid).astype(np.int64)
        for ax in range(cs.ndim):
            cs = np.cumsum(cs, axis=ax)
        return np.pad(cs, [(1, 0)] * cs.ndim)

    # ------------------------------------------------------------------ per unit
    def _candidates(self, k: int, c: int) -> tuple[np.ndarray, np.ndarray]:
        """Starts along split dim ``k`` inside block ``c``, and the last block each touches."""
        d, e = self.split_dims[k], self.edges[k]
        lo, hi = e[c], e[c + 1]
        first = -(-lo // d.stride) * d.stride
        s = np.arange(first, min(hi, d.size - d.width + 1), d.stride, dtype=np.int64)
        last = np.searchsorted(e, s + d.width - 1, side="right") - 1
        return s, last

    def _box_full(self, lo: list[np.ndarray], hi: list[np.ndarray]) -> np.ndarray:
        """Whether every block in the box [lo, hi] (inclusive, per dim) belongs to the split."""
        k = len(lo)
        total = np.zeros(np.broadcast_shapes(*[a.shape for a in lo + hi]), dtype=np.int64)
        for corner in range(1 << k):
            idx, sign = [], 1
            for ax in range(k):
                if corner >> ax & 1:
                    idx.append(lo[ax])
                    sign = -sign
                else:
                    idx.append(hi[ax] + 1)
            total = total + sign * self._cs[tuple(idx)]
        size = np.ones_like(total)
        for ax in range(k):
            size = size * (hi[ax] - lo[ax] + 1)
        return total == size

    def split_starts(self, unit: int) -> np.ndarray:
        """Valid start positions along the split dims in unit ``unit`` (rows in C order)."""
        if self._one_position:
            # every position of the block is a sample (as ``counts`` says): no mesh, no box test per unit
            e, c = self.edges[0], int(self.blocks[unit])
            return np.arange(e[c], e[c + 1], dtype=np.int64)[:, None]
        if len(self.split_dims) == 1:  # windows or tiles along one split dim: no mesh (a unit per chunk)
            c = int(self.blocks[unit])
            starts, reach = self._candidates(0, c)
            ok = self._cs[reach + 1] - self._cs[c] == reach - c + 1  # every block it touches is the split's
            return starts[ok][:, None]
        coords = np.unravel_index(int(self.blocks[unit]), self.grid)
        cand = [self._candidates(k, int(c)) for k, c in enumerate(coords)]
        mesh = np.meshgrid(*[s for s, _ in cand], indexing="ij")
        last = list(np.meshgrid(*[e for _, e in cand], indexing="ij"))
        lo = [np.full(m.shape, c, dtype=np.int64) for m, c in zip(mesh, coords, strict=True)]
        ok = self._box_full(lo, last)
        return np.stack([m[ok] for m in mesh], axis=1) if mesh else np.zeros((1, 0), np.int64)

    def unit_starts(self, unit: int) -> np.ndarray:
        """Start of every (valid) sample of ``unit`` along every sampled dim, shape (n, len(dims))."""
        st = self.all_unit_starts(unit)
        if self.valid is None:
            return st
        a, b = self.all_offsets[unit], self.all_offsets[unit + 1]
        return st[self.valid[a:b]]

    def all_unit_starts(self, unit: int) -> np.ndarray:
        """Start of every sample of ``unit``, valid or not (the mask's numbering)."""
        sp = self.split_starts(unit)
        if not self.free_dims:
            return sp
        free = np.stack([m.ravel() for m in np.meshgrid(*self._free_starts, indexing="ij")], axis=1)
        return np.concatenate([np.repeat(sp, len(free), axis=0), np.tile(free, (len(sp), 1))], axis=1)

    # ------------------------------------------------------------------ counts
    @cached_property
    def _all_size(self) -> int | None:
        """Samples per unit, valid or not, where every unit holds as many and that is known from the
        chunk edges alone (one split dim sampled at every position, blocks of one length but perhaps
        the grid's last): no per-unit array is made, the edges are read a bounded slice at a time.
        None otherwise (then ``unit_size`` compares the counts)."""
        if not self._one_position or not len(self.blocks):
            return None
        e, runs = self.edges[0], self.blocks.runs
        n_blocks = len(e) - 1
        last = int(e[n_blocks] - e[n_blocks - 1])
        body: int | None = None
        for c in range(0, n_blocks - 1, 1 << 20):  # every block but the last: one length?
            d = np.diff(e[c:min(n_blocks - 1, c + (1 << 20)) + 1])
            lo, hi = int(d.min()), int(d.max())
            if lo != hi or (body is not None and lo != body):
                return None
            body = lo
        has_last = bool(((runs.starts <= n_blocks - 1) & (runs.stops > n_blocks - 1)).any())
        if body is None or body == last:  # one block, or all of one length
            size = last
        elif not has_last:
            size = body
        elif len(self.blocks) == 1:
            size = last
        else:
            return None
        return size * self._free_n

    @cached_property
    def unit_size(self) -> int | None:
        """Samples per unit where every unit holds as many (any regular chunk grid without a
        validity mask: known without per-unit arrays), else None. Plans then cut and order
        units by arithmetic (``plan.epoch_plan``)."""
        if self.valid is None and self._all_size is not None:
            return self._all_size
        c = self.counts
        return int(c[0]) if len(c) and bool((c == c[0]).all()) else None

    @cached_property
    def counts(self) -> np.ndarray:
        """Samples per unit (int64, in split order): valid samples where a mask is set. Where units
        are of equal size, a read-only array of stride 0 (no memory)."""
        if self.valid is None:
            return self.all_counts
        # valid samples before each unit's first sample: one cumsum, no loop over units
        before = np.concatenate([[0], np.cumsum(self.valid, dtype=np.int64)])[np.asarray(self.all_offsets)]
        return np.diff(before).astype(np.int64)

    @cached_property
    def all_offsets(self) -> Offsets:
        """Global id of each unit's first sample, valid or not (the mask's numbering)."""
        if self.valid is None:
            return self.offsets
        if self._all_size is not None:
            return EqualOffsets(len(self.blocks), self._all_size)
        return np.concatenate([[0], np.cumsum(self.all_counts)]).astype(np.int64)

    @cached_property
    def all_counts(self) -> np.ndarray:
        """Samples per unit, valid or not (int64, in split order; stride 0 where they are equal)."""
        if self._all_size is not None:
            return _equal(len(self.blocks), self._all_size)
        if self._one_position:
            sizes = np.diff(self.edges[0])[self.blocks.ids()]  # every position of a block is a sample
        elif len(self.split_dims) == 1:
            d, e = self.split_dims[0], self.edges[0]
            s = d.starts()
            first = np.searchsorted(e, s, side="right") - 1
            last = np.searchsorted(e, s + d.width - 1, side="right") - 1
            ok = self._box_full([first], [last])
            per_block = np.bincount(first[ok], minlength=self.grid[0])
            sizes = per_block[self.blocks.ids()]
        else:
            sizes = np.array([len(self.split_starts(u)) for u in range(len(self.blocks))], dtype=np.int64)
        sizes = sizes.astype(np.int64, copy=False)  # no copy of 10^7 counts that are int64 already
        return sizes * self._free_n if self._free_n != 1 else sizes

    @cached_property
    def spill_dims(self) -> tuple[bool, ...]:
        """Per split dim, whether windows or tiles along it reach from a unit into the next one."""
        out = []
        for d, e in zip(self.split_dims, self.edges, strict=True):
            s = d.starts()
            out.append(d.width > 1 and bool(np.any(np.searchsorted(e, s, side="right")
                                                   != np.searchsorted(e, s + d.width - 1, side="right"))))
        return tuple(out)

    @property
    def spills(self) -> bool:
        """Whether windows or tiles reach from a unit into a neighbouring one (along any split dim)."""
        return any(self.spill_dims)

    @cached_property
    def offsets(self) -> Offsets:
        """Global id of each unit's first sample (len = units + 1): ``EqualOffsets`` (arithmetic)
        where units are of equal size."""
        if self.unit_size is not None:
            return EqualOffsets(len(self.blocks), self.unit_size)
        return np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)

    @property
    def n_samples(self) -> int:
        return int(self.offsets[-1])

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(unit, local index) of global sample ids."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_samples):
            raise IndexError(f"sample index out of range for a split of {self.n_samples} samples")
        if self.unit_size:
            return ids // self.unit_size, ids % self.unit_size
        offsets = cast(np.ndarray, self.offsets)
        unit = np.searchsorted(offsets, ids, side="right") - 1
        return unit, ids - offsets[unit]


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


# ---------------------------------------------------------------------- one split's sampling
@dataclass(frozen=True)
class Sampling:
    """The samples of one split of a Dataset: what ``sampling`` makes of the options."""

    split: str
    sources: dict[str, VarSource]
    geometry: Geometry
    space: SampleSpace
    layouts: dict[str, VarLayout]

    def check_not_empty(self) -> None:
        """Refuse a split that holds no sample of this shape: an empty epoch looks like a finished one."""
        if self.space.n_samples == 0 and self.space.valid is not None:
            raise ValueError(f"split {self.split!r} holds no valid sample: its validity mask (ds.insitu.validity) "
                             f"marks none of its {self.space.valid.size} samples valid; check `where` and "
                             "`variables`, or remove the mask with m.set_validity(split, None)")
        if self.space.n_samples == 0:
            wide = {d.name: d.width for d in self.space.dims if d.width > 1}
            raise ValueError(f"split {self.split!r} holds no sample of this shape ({wide or 'one position'}): "
                             "every window/patch is longer than the split's runs of whole chunk blocks "
                             f"along {[d.name for d in self.space.split_dims]}; use a shorter window or patch")


def check_split(manifest: Any, split: Any) -> None:
    """``manifest`` is a ``SplitManifest`` and ``split`` names one of its splits."""
    if not isinstance(manifest, SplitManifest):
        raise TypeError(f"manifest must be a SplitManifest (from ds.insitu.split), got {type(manifest).__name__}")
    if not isinstance(split, str):
        raise TypeError(f"split must be the name of a split (a str), got {type(split).__name__} {split!r}")
    if split not in manifest.splits:
        raise ValueError(f"unknown split {split!r}; the manifest has {list(manifest.splits)}")


def sampling(ds: xr.Dataset, manifest: SplitManifest, split: str, *, window: Any = None, patch: Any = None,
             stride: Any = None, over: Any = None, variables: Any = None, stacklevel: int = 2,
             valid_only: bool = False) -> Sampling:
    """Check ``manifest`` against ``ds`` and the sampling options; the samples of ``split``.

    ``variables`` defaults to the data variables on the split dim(s). A manifest made on another
    snapshot of the data warns (at ``stacklevel`` above the caller). ``valid_only``: where the
    manifest holds a validity mask for ``split`` (``ds.insitu.validity``), the space holds only
    its valid samples; a mask made with other sampling options raises ``ValueError``.
    """
    check_split(manifest, split)
    names = variable_names(variables, ds)
    if names is None:
        names = cast(list[str], [v for v in ds.data_vars if any(d in ds[v].dims for d in manifest.dims)])
        if not names and len(ds.data_vars):  # (else "no data variables" says it)
            raise ValueError(f"the manifest splits dim(s) {list(manifest.dims)}, which no data variable of this "
                             f"Dataset has (its dims: {list(ds.dims)}): apply it to the Dataset it was made for, "
                             "or make a split of this one")
    sources, geometry = dataset_geometry(ds, names)  # the Dataset's own where it has them (no second index)
    _check_manifest(ds, manifest, geometry, sources, stacklevel + 1)
    for d in manifest.dims:  # edges of as many blocks as the manifest's are checked equal: keep one array of them
        mine, theirs = geometry.edges[d], manifest.edges[d]  # (not two: 80 MB each at 10^7 chunks, e.g. a
        if mine is not theirs and len(mine) == len(theirs) and d not in manifest.block:  # manifest from JSON);
            if mine.flags.writeable:  # the Dataset's geometry keeps its own, so the manifest takes it (equal)
                geometry = Geometry(geometry.variables, geometry.dims, geometry.sizes, geometry.edges | {d: theirs})
            else:
                manifest.edges[d] = mine
    space = _sample_space(manifest, split, geometry, window, patch, stride, over)
    if valid_only and split in manifest.validity:
        space = _masked(space, manifest, split, sampling_key(window, patch, stride, over, geometry.sizes))
    space.offsets  # noqa: B018 (samples per unit and their offsets: made once, for len, plans and sample)
    layouts = {n: VarLayout.build(s, space) for n, s in sources.items()}
    return Sampling(split, sources, geometry, space, layouts)


def sampling_key(window: Any, patch: Any, stride: Any, over: Any, sizes: dict[str, int]) -> dict[str, Any]:
    """The sampling options in one spelling (what a validity mask records and is compared by):
    a patch's stride defaults to the patch, ``over`` is a list."""
    window, patch, stride = (dim_map("window", window, sizes), dim_map("patch", patch, sizes),
                             dim_map("stride", stride, sizes))
    return {"window": dict(sorted(window.items())), "patch": dict(sorted(patch.items())),
            "stride": {d: stride.get(d, patch[d]) for d in sorted(patch)},
            "over": over_dims(over)}


def over_dims(over: Any) -> list[str]:
    """``over=`` as a list of dim names: a name, or a list of distinct names (a dim named twice would
    count its positions twice); ``TypeError``/``ValueError`` naming ``over``."""
    if over is None:
        return []
    names = [over] if isinstance(over, str) else over
    if not isinstance(names, (list, tuple)) or not all(isinstance(d, str) for d in names):
        raise TypeError(f"over must be a dim name or a list of dim names, got {type(over).__name__} {over!r}")
    twice = sorted({d for d in names if names.count(d) > 1})
    if twice:
        raise ValueError(f"over names {twice} more than once ({list(names)}): name each dim once")
    return list(names)


def _masked(space: SampleSpace, manifest: SplitManifest, split: str, key: dict[str, Any]) -> SampleSpace:
    """``space`` restricted to the valid samples of ``manifest.validity[split]``."""
    rec = manifest.validity[split]
    made = rec["sampling"]
    diff = [f"{k} (mask made with {made[k]!r}, here {key[k]!r})" for k in MASK_SAMPLING if made[k] != key[k]]
    if diff:
        raise ValueError(f"the validity mask of split {split!r} was made for other samples: " + ", ".join(diff)
                         + "; run ds.insitu.validity again with these options (or m.set_validity(split, None))")
    mask = decode_mask(rec, f"validity of split {split!r}")
    if mask.size != space.n_samples:
        raise ValueError(f"the validity mask of split {split!r} holds {mask.size} samples, the split has "
                         f"{space.n_samples} of this shape (other variables or another dataset?); "
                         "run ds.insitu.validity again")
    return SampleSpace(space.dims, {d.name: e for d, e in zip(space.split_dims, space.edges, strict=True)},
                       space.blocks, valid=mask, valid_digest=rec["digest"])


def _check_manifest(ds: xr.Dataset, m: SplitManifest, g: Geometry, sources: dict[str, VarSource],
                    stacklevel: int) -> None:
    m.check_grid(g.sizes, g.edges, g.dims)  # its own grid or a refinement of it
    m.check_labels(cast(dict[str, list[Any]], {d: coord_span(ds, d) for d in m.dims if coord_span(ds, d) is not None}))
    snap = snapshot_of_sources(sources)
    if m.snapshot is not None and snap is not None and snap != m.snapshot:
        warnings.warn(f"manifest was made on snapshot {m.snapshot}, this dataset is snapshot {snap}: "
                      "the data may have changed", UserWarning, stacklevel=stacklevel + 1)


def _sample_space(manifest: SplitManifest, split: str, geometry: Geometry, window: Any, patch: Any, stride: Any,
                  over: Any) -> SampleSpace:
    sizes = geometry.sizes
    window = dim_map("window", window, sizes)
    patch = dim_map("patch", patch, sizes)
    stride = dim_map("stride", stride, sizes)
    over = over_dims(over)
    both = set(window) & set(patch)
    if both:
        raise ValueError(f"dims {sorted(both)} are in both window and patch")
    for d in stride:
        if d not in patch:
            raise ValueError(f"stride[{d!r}] given but {d!r} is not a patch dim")
    for d in over:
        if d not in sizes:
            raise ValueError(f"over: unknown dim {d!r}; the variables have dims {sorted(sizes)}")
        if d in manifest.dims or d in window or d in patch:
            raise ValueError(f"over: dim {d!r} is already a split, window or patch dim")
    dims = []
    for d in manifest.dims:
        w = window.get(d, patch.get(d, 1))
        st = stride.get(d, patch.get(d, 1)) if d in patch else 1
        dims.append(SampleDim(d, sizes[d], w, st, keep=d in window or d in patch, split=True))
    for d in list(patch) + list(window):
        if d not in manifest.dims:
            st = stride.get(d, patch[d]) if d in patch else 1
            dims.append(SampleDim(d, sizes[d], patch.get(d, window.get(d, 1)), st, keep=True))
    for d in over:
        dims.append(SampleDim(d, sizes[d]))
    return SampleSpace(dims, geometry.edges | {d: np.asarray(manifest.edges[d]) for d in manifest.dims},
                       manifest.splits[split])  # its runs: no array of the split's block ids
