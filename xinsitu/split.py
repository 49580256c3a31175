"""Chunk-aligned splits: pure index math on the chunk-block grid, and the ``SplitManifest``.

A *block* is one chunk along each split dim (the grid every variable shares, see
``geometry.common_edges``). Splits are sets of flat block ids (C order over the split
dims), so no read ever serves two splits.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from xinsitu import repr as _repr
from xinsitu.geometry import Geometry

FORMAT_VERSION = 1


# ----------------------------------------------------------------------------- pure math
def largest_remainder(fractions: dict[str, float], total: int) -> dict[str, int]:
    """Whole counts summing to ``total``, proportional to ``fractions`` (largest remainder)."""
    raw = {k: f * total for k, f in fractions.items()}
    counts = {k: int(math.floor(v)) for k, v in raw.items()}
    left = total - sum(counts.values())
    # ties go to the split named first, so the result is deterministic
    order = sorted(raw, key=lambda k: (-(raw[k] - counts[k]), list(raw).index(k)))
    for k in order[:left]:
        counts[k] += 1
    return counts


def check_fractions(fractions: dict[str, float]) -> None:
    if not isinstance(fractions, dict) or not fractions:
        raise ValueError("fractions must be a non-empty dict of split name -> fraction")
    for k, f in fractions.items():
        if not isinstance(k, str) or not k:
            raise ValueError(f"split names must be non-empty strings, got {k!r}")
        if not isinstance(f, (int, float)) or isinstance(f, bool) or not math.isfinite(f):
            raise ValueError(f"fraction for split {k!r} must be a number, got {f!r}")
        if f < 0:
            raise ValueError(f"fraction for split {k!r} is negative ({f})")
    total = sum(fractions.values())
    if not math.isclose(total, 1.0, rel_tol=0, abs_tol=1e-6):
        raise ValueError(f"fractions must sum to 1, they sum to {total:g}: {fractions}")


def contiguous_split(nblocks: int, fractions: dict[str, float], gap: int) -> dict[str, np.ndarray]:
    """Consecutive runs of blocks in split order, ``gap`` blocks left out between runs."""
    avail = nblocks - gap * (len(fractions) - 1)
    if avail < len(fractions):
        raise ValueError(
            f"{nblocks} chunks cannot hold {len(fractions)} splits with gap={gap} "
            f"({avail} chunks left after gaps)"
        )
    counts = largest_remainder(fractions, avail)
    _check_nonempty(counts)
    out, start = {}, 0
    for k, c in counts.items():
        out[k] = np.arange(start, start + c, dtype=np.int64)
        start += c + gap
    return out


def random_split(grid: tuple[int, ...], fractions: dict[str, float], gap: int, seed: int) -> dict[str, np.ndarray]:
    """Blocks assigned at random by fraction; then, in split order, a later split loses the blocks
    within ``gap`` blocks (Chebyshev distance on the block grid) of a block of an earlier split."""
    n = int(np.prod(grid))
    counts = largest_remainder(fractions, n)
    _check_nonempty(counts)
    perm = np.random.default_rng(seed).permutation(n)
    label = np.empty(n, dtype=np.int64)
    start = 0
    for i, c in enumerate(counts.values()):
        label[perm[start:start + c]] = i
        start += c
    label = label.reshape(grid)
    if gap > 0:
        taken = np.zeros(grid, dtype=bool)
        for i in range(len(counts)):
            mine = label == i
            near = _dilate(taken, gap)
            label[mine & near] = -1
            taken |= label == i
    flat = label.ravel()
    out = {k: np.flatnonzero(flat == i).astype(np.int64) for i, k in enumerate(counts)}
    _check_nonempty({k: len(v) for k, v in out.items()}, after_gap=True)
    return out


def _dilate(mask: np.ndarray, k: int) -> np.ndarray:
    """Cells within Chebyshev distance k of a True cell."""
    out = mask.copy()
    for ax in range(mask.ndim):
        cur = out.copy()
        for s in range(1, k + 1):
            lo = [slice(None)] * mask.ndim
            hi = [slice(None)] * mask.ndim
            lo[ax], hi[ax] = slice(s, None), slice(None, -s)
            out[tuple(lo)] |= cur[tuple(hi)]
            out[tuple(hi)] |= cur[tuple(lo)]
    return out


def _check_nonempty(counts: dict[str, int], after_gap: bool = False) -> None:
    empty = [k for k, c in counts.items() if c == 0]
    if empty:
        why = " after removing chunks within the gap" if after_gap else ""
        raise ValueError(f"split(s) {empty} would get no chunk{why}; use fewer splits, a smaller gap "
                         "or larger fractions")


def range_split(edges: np.ndarray, index: pd.Index, ranges: dict[str, slice], gap: int,
                dim: str) -> dict[str, np.ndarray]:
    """Blocks fully inside each label range (``.sel`` semantics, rounded inward to chunk edges)."""
    out: dict[str, np.ndarray] = {}
    spans: list[tuple[str, int, int]] = []
    for name, rng in ranges.items():
        if not isinstance(rng, slice) or rng.step is not None:
            raise ValueError(f"range for split {name!r} must be a slice(start, stop), got {rng!r}")
        try:
            sl = index.slice_indexer(rng.start, rng.stop)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"range for split {name!r} ({rng.start!r}, {rng.stop!r}) does not fit the "
                             f"{dim!r} coordinate: {e}") from None
        a, b = int(sl.start or 0), int(sl.stop if sl.stop is not None else len(index))
        if b <= a:
            raise ValueError(
                f"range for split {name!r} ({rng.start!r}..{rng.stop!r}) falls outside the {dim!r} coordinate "
                f"({_label(index[0])}..{_label(index[-1])})"
            )
        first = int(np.searchsorted(edges, a, side="left"))  # first block starting at or after a
        last = int(np.searchsorted(edges, b, side="right")) - 1  # blocks ending at or before b
        if last <= first:
            raise ValueError(f"range for split {name!r} covers no whole chunk of {dim!r} "
                             f"(chunks are {int(edges[1] - edges[0])} long)")
        spans.append((name, first, last))
        out[name] = np.arange(first, last, dtype=np.int64)
    ordered = sorted(spans, key=lambda s: s[1])
    for (n1, _, e1), (n2, s2, _) in zip(ordered, ordered[1:], strict=False):
        if s2 < e1:
            raise ValueError(f"ranges of splits {n1!r} and {n2!r} overlap")
        if s2 - e1 < gap:
            raise ValueError(f"splits {n1!r} and {n2!r} are {s2 - e1} chunk(s) apart, closer than gap={gap}")
    return out


# ----------------------------------------------------------------------------- labels
def _label(v: Any) -> Any:
    """A JSON-able coordinate label: ISO strings for times, plain numbers, else str."""
    if isinstance(v, (np.integer, int)) and not isinstance(v, bool):
        return int(v)
    if isinstance(v, (np.floating, float)):
        return float(v)
    if isinstance(v, np.datetime64):
        return pd.Timestamp(v).isoformat()
    if hasattr(v, "isoformat"):  # pandas/datetime/cftime
        return v.isoformat()
    return str(v)


# ----------------------------------------------------------------------------- manifest
@dataclass
class SplitManifest:
    """Split name -> chunk blocks of the split dim(s), plus what is needed to check and show it.

    Plain JSON-able record: ``to_json``/``from_json`` use ``json`` only (no pickle).
    """

    dims: list[str]
    sizes: dict[str, int]
    edges: dict[str, list[int]]
    splits: dict[str, list[int]]
    labels: dict[str, dict[str, list[Any]]]
    seed: int | None = None
    gap: int = 0
    contiguous: bool = True
    method: str = "fractions"
    fingerprint: str = ""
    snapshot: str | None = None
    stats: dict[str, Any] | None = None
    version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    # -- derived
    @property
    def grid(self) -> tuple[int, ...]:
        """Number of chunk blocks along each split dim."""
        return tuple(len(self.edges[d]) - 1 for d in self.dims)

    def blocks(self, split: str) -> np.ndarray:
        """Flat block ids of ``split`` (C order over ``dims``), as an int64 array."""
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r}; this manifest has {list(self.splits)}")
        return np.asarray(self.splits[split], dtype=np.int64)

    def positions(self, split: str) -> int:
        """Number of positions (grid points along the split dims) the split covers."""
        ends = [np.diff(np.asarray(self.edges[d])) for d in self.dims]
        idx = np.unravel_index(self.blocks(split), self.grid)
        return int(np.prod([ends[k][idx[k]] for k in range(len(self.dims))], axis=0).sum())

    # -- checks
    def check_labels(self, first_last: dict[str, list[Any]]) -> None:
        for d, fl in first_last.items():
            mine = self.extra.get("coords", {}).get(d)
            if mine is not None and list(mine) != list(fl):
                raise ValueError(f"coordinate {d!r} spans {fl[0]}..{fl[1]} here, but the manifest was made "
                                 f"on {mine[0]}..{mine[1]}")

    # -- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "xinsitu.SplitManifest", "version": self.version, "dims": self.dims,
            "sizes": self.sizes, "edges": self.edges, "splits": self.splits, "labels": self.labels,
            "seed": self.seed, "gap": self.gap, "contiguous": self.contiguous, "method": self.method,
            "fingerprint": self.fingerprint, "snapshot": self.snapshot, "stats": self.stats,
            "extra": self.extra,
        }

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """Write the manifest as JSON to ``path`` (if given) and return the JSON text."""
        text = json.dumps(self.to_dict(), indent=1, allow_nan=True)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SplitManifest:
        if not isinstance(d, dict) or d.get("format") != "xinsitu.SplitManifest":
            raise ValueError("not an xinsitu SplitManifest (missing 'format': 'xinsitu.SplitManifest')")
        if d.get("version", 0) > FORMAT_VERSION:
            raise ValueError(f"manifest format version {d['version']} is newer than this xinsitu "
                             f"understands ({FORMAT_VERSION})")
        keys = ("dims", "sizes", "edges", "splits", "labels", "seed", "gap", "contiguous", "method",
                "fingerprint", "snapshot", "stats", "extra")
        m = cls(**{k: d[k] for k in keys if k in d})
        if m.fingerprint and m.fingerprint != fingerprint_of(m.dims, m.sizes, m.edges, m.extra.get("coords", {})):
            raise ValueError("manifest fingerprint does not match its contents (the file was edited or damaged)")
        return m

    @classmethod
    def from_json(cls, path_or_text: str | os.PathLike) -> SplitManifest:
        """Load a manifest written by ``to_json`` (a path, or the JSON text itself)."""
        s = str(path_or_text)
        text = s if s.lstrip().startswith("{") else open(s).read()
        return cls.from_dict(json.loads(text))

    # -- display
    def summary(self) -> str:
        lines = [f"split on {', '.join(self.dims)} ({' x '.join(map(str, self.grid))} chunk blocks, "
                 f"method={self.method}, gap={self.gap}, seed={self.seed})"]
        for k, v in self._rows():
            lines.append(f"  {k}: " + "  ".join(v))
        return "\n".join(lines)

    def _rows(self) -> list[tuple[str, tuple[str, ...]]]:
        rows = []
        for name, blocks in self.splits.items():
            rng = "; ".join(f"{d} {lab[0]} .. {lab[1]}" for d, lab in self.labels.get(name, {}).items())
            rows.append((name, (f"{len(blocks)} chunks", f"{self.positions(name)} positions", rng)))
        return rows

    def _owner(self) -> np.ndarray:
        """Per chunk block (shaped as ``grid``): index of its split in ``splits``, ``-1`` where left out."""
        owner = np.full(int(np.prod(self.grid)), -1, dtype=np.int64)
        for i, blocks in enumerate(self.splits.values()):
            owner[np.asarray(blocks, dtype=np.int64)] = i
        return owner.reshape(self.grid)

    def _headline(self) -> str:
        how = ("ranges" if self.method == "ranges" else
               "contiguous fractions" if self.contiguous else f"random fractions (seed {self.seed})")
        return (f"on {' x '.join(self.dims)}: {' x '.join(map(str, self.grid))} chunk blocks, {how}, "
                f"gap {self.gap}")

    def _sections(self) -> list[_repr.Section]:
        one = len(self.dims) == 1
        owner = self._owner()
        total = sum(self.sizes[d] for d in self.dims) if one else int(np.prod([self.sizes[d] for d in self.dims]))
        rows = []
        for name, blocks in self.splits.items():
            n = self.positions(name)
            labs = self.labels.get(name, {})
            if one:
                lab = labs.get(self.dims[0])
                where = (str(lab[0]), str(lab[1])) if lab else ("", "")
            else:
                where = ("; ".join(f"{d} {v[0]} .. {v[1]}" for d, v in labs.items()),)
            rows.append((name, str(len(blocks)), str(n), f"{100 * n / max(total, 1):.1f}%", *where))
        left = int((owner < 0).sum())
        if left:
            n = total - sum(self.positions(k) for k in self.splits)
            rows.append(("(left out)", str(left), str(n), f"{100 * n / max(total, 1):.1f}%",
                         *([""] * (2 if one else 1))))
        header = ("split", "chunk blocks", "positions", "share", *(("first", "last") if one else ("labels",)))
        coords = self.extra.get("coords", {})
        spans = {d: (str(v[0]), str(v[1])) for d, v in coords.items() if v}
        if one:
            d = self.dims[0]
            drawing = _repr.timeline(owner, self.edges[d], list(self.splits), dim=d, span=spans.get(d),
                                     labels={k: (str(v[d][0]), str(v[d][1])) for k, v in self.labels.items()
                                             if d in v})
        elif len(self.dims) == 2:
            drawing = _repr.grid(owner, self.edges[self.dims[0]], self.edges[self.dims[1]], list(self.splits),
                                 dims=(self.dims[0], self.dims[1]), spans=spans)
        else:
            drawing = ""
        info = [("dims", ", ".join(f"{d} ({self.sizes[d]}, {len(self.edges[d]) - 1} chunk blocks)"
                                   for d in self.dims)),
                ("method", self.method + ("" if self.method == "ranges" else
                                          ", contiguous" if self.contiguous else ", random")),
                ("gap", f"{self.gap} chunk block{'s' if self.gap != 1 else ''}"), ("seed", str(self.seed)),
                ("fingerprint", self.fingerprint[:12])]
        if self.snapshot:
            info.append(("snapshot", self.snapshot))
        if self.stats:
            info.append(("stats", f"{len(self.stats.get('channels', self.stats))} channels "
                                  f"from split {self.stats.get('split', '?')!r}"))
        return [_repr.Section("Splits", header, rows, extra_html=drawing, summary=f"({len(self.splits)})"),
                _repr.Section("Manifest", (), info, collapsed=True)]

    def plot(self, ax: Any = None) -> Any:
        """Draw the splits with matplotlib (a timeline for one dim, a grid for two); see
        ``xinsitu.plot.plot_manifest``. Returns the Axes."""
        from xinsitu.plot import plot_manifest

        return plot_manifest(self, ax=ax)

    def __repr__(self) -> str:
        return _repr.text("xinsitu.SplitManifest", self._sections(), self._headline())

    def _repr_html_(self) -> str:
        return _repr.html("xinsitu.SplitManifest", self._sections(), repr(self), self._headline())


def fingerprint_of(dims: list[str], sizes: dict[str, int], edges: dict[str, list[int]],
                   coords: dict[str, list[Any]]) -> str:
    """Hash of the split dims' geometry (lengths, chunk grid, first/last labels)."""
    blob = json.dumps({"dims": list(dims), "sizes": {d: sizes[d] for d in dims},
                       "edges": {d: list(edges[d]) for d in dims},
                       "coords": {d: coords.get(d) for d in dims}}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def coord_span(ds: Any, dim: str) -> list[Any] | None:
    """First and last label of ``dim``'s index coordinate, JSON-able (None without one)."""
    if dim not in ds.indexes or ds.sizes[dim] == 0:
        return None
    idx = ds.indexes[dim]
    return [_label(idx[0]), _label(idx[-1])]


def make_split(ds: Any, geometry: Geometry, dim: str | list[str], *, fractions: dict[str, float] | None = None,
               ranges: dict[str, slice] | None = None, gap: int = 0, contiguous: bool | None = None,
               seed: int | None = 0) -> SplitManifest:
    """Split ``ds`` (with ``geometry``) along ``dim`` into a ``SplitManifest``; see ``Dataset.insitu.split``."""
    dims = [dim] if isinstance(dim, str) else list(dim)
    if not dims or not all(isinstance(d, str) for d in dims):
        raise ValueError(f"dim must be a dim name or a list of names, got {dim!r}")
    if len(set(dims)) != len(dims):
        raise ValueError(f"dim lists a dimension twice: {dims}")
    for d in dims:
        if d not in geometry.sizes:
            have = sorted(geometry.sizes)
            raise ValueError(f"unknown dim {d!r}: the data variables have dims {have}")
        if geometry.nblocks(d) < 2:
            whole = [v for v, g in geometry.variables.items() if d in g.dims
                     and g.chunks[g.dims.index(d)] >= g.shape[g.dims.index(d)]]
            raise ValueError(f"dim {d!r} is not chunked (one chunk of {geometry.sizes[d]}"
                             + (f"; variables {whole} hold it in a single chunk" if whole else
                                f"; the variables' chunks of {geometry.dims[d]} share no edge inside it")
                             + f"): a split needs at least one chunk per split; re-chunk the archive along "
                             f"{d!r} or select variables chunked along it")
    if not isinstance(gap, (int, np.integer)) or isinstance(gap, bool) or gap < 0:
        raise ValueError(f"gap must be a non-negative whole number of chunks, got {gap!r}")
    if (fractions is None) == (ranges is None):
        raise ValueError("give exactly one of fractions= or ranges=")
    if contiguous is None:
        contiguous = len(dims) == 1
    grid = tuple(geometry.nblocks(d) for d in dims)
    if fractions is not None:
        check_fractions(fractions)
        if contiguous:
            if len(dims) != 1:
                raise ValueError("contiguous=True needs a single split dim; use contiguous=False for several")
            splits = contiguous_split(grid[0], fractions, int(gap))
        else:
            if seed is None:
                raise ValueError("contiguous=False draws chunks at random and needs an integer seed")
            splits = random_split(grid, fractions, int(gap), int(seed))
        method = "fractions"
    else:
        if not isinstance(ranges, dict) or not ranges:
            raise ValueError("ranges must be a non-empty dict of split name -> slice of labels")
        if len(dims) != 1:
            raise ValueError("ranges= works on a single split dim")
        # a dim without a coordinate is labelled by its positions
        index = ds.indexes[dims[0]] if dims[0] in ds.indexes else pd.RangeIndex(geometry.sizes[dims[0]])
        splits = range_split(geometry.edges[dims[0]], index, ranges, int(gap), dims[0])
        method = "ranges"
    edges = {d: [int(x) for x in geometry.edges[d]] for d in dims}
    sizes = {d: int(geometry.sizes[d]) for d in dims}
    labels: dict[str, dict[str, list[Any]]] = {}
    for name, blocks in splits.items():
        idx = np.unravel_index(blocks, grid)
        labels[name] = {}
        for k, d in enumerate(dims):
            first = edges[d][int(idx[k].min())]
            last = edges[d][int(idx[k].max()) + 1] - 1
            # without a coordinate, the labels are the positions
            labels[name][d] = ([_label(ds.indexes[d][first]), _label(ds.indexes[d][last])] if d in ds.indexes
                               else [first, last])
    coords = {d: coord_span(ds, d) for d in dims}
    fp = fingerprint_of(dims, sizes, edges, coords)
    from xinsitu.snapshot import snapshot_of
    return SplitManifest(dims=dims, sizes=sizes, edges=edges,
                         splits={k: [int(b) for b in v] for k, v in splits.items()},
                         labels=labels, seed=None if seed is None else int(seed), gap=int(gap),
                         contiguous=bool(contiguous), method=method, fingerprint=fp,
                         snapshot=snapshot_of(ds), extra={"coords": coords})
