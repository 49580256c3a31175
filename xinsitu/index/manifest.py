"""The ``SplitManifest``: split name -> chunk blocks of the split dim(s), a plain JSON-able record.

Layer 1 (no I/O). A *chunk block* is one chunk along each split dim (the grid every variable
shares, see ``geometry.common_edges``), named by its flat id (C order over the split dims).
In memory a split's chunk blocks are a ``Blocks`` (runs of ids); on disk, runs, or for a
scattered split one compressed owner per chunk block (both encodings in ``runs``). Loading
validates every field and checks the fingerprint. ``split.make_split`` makes manifests.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
import pandas as pd

from xinsitu.index.runs import (
    INT64_MAX,
    Blocks,
    _decode_owner,
    _encode_owner,
    _is_int,
    check_mask_record,
    decode_steps,
    steps_length,
    steps_of,
)
from xinsitu.repr import formatting

#: 2: chunk blocks stored as runs (or, for a scattered split, one compressed owner per block),
#: chunk edges as arithmetic runs; version-1 files (explicit lists) still load
FORMAT_VERSION = 2
#: a manifest written with more runs than this stores one owner per chunk block when that is smaller
MAX_RUNS = 4096
_MAX_OWNED = 255  # splits a compressed owner array can tell apart (the last code: left out)
#: chunk edges a manifest may hold over all its split dims (1 GiB of int64): a hand-made file that
#: claims more (a run of 10^10 steps is a few bytes of JSON) is refused before anything is allocated
MAX_EDGES = 1 << 27


# ----------------------------------------------------------------------------- labels
def json_label(v: Any) -> Any:
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


def coord_span(ds: Any, dim: str) -> list[Any] | None:
    """First and last label of ``dim``'s index coordinate, JSON-able (None without one)."""
    if dim not in ds.indexes or ds.sizes[dim] == 0:
        return None
    idx = ds.indexes[dim]
    return [json_label(idx[0]), json_label(idx[-1])]


def _same_label(a: Any, b: Any) -> bool:
    """Whether two labels (as a manifest records them) are the same; NaN is the same as NaN (a coordinate
    whose first label is missing: a zarr v2 integer coordinate with fill value 0 reads 0 as NaN)."""
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return bool(a == b)


def _same_record(a: Any, b: Any) -> bool:
    """Whether two things a manifest records (labels, dicts and lists of them) are the same, NaN as NaN."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_record(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same_record(x, y) for x, y in zip(a, b, strict=True))
    return _same_label(a, b)


# ----------------------------------------------------------------------------- manifest
@dataclass(eq=False)
class SplitManifest:
    """Split name -> chunk blocks of the split dim(s), plus what is needed to check and show it.

    Plain JSON-able record: ``to_json``/``from_json`` use ``json`` only (no pickle). In memory
    ``splits[name]`` is a ``Blocks`` (runs of block ids; reads as the list of ids) and
    ``edges[dim]`` a read-only int64 array; a list given for either is converted.
    """

    dims: list[str]
    sizes: dict[str, int]
    edges: dict[str, np.ndarray]
    splits: dict[str, Blocks]
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
    #: split name -> valid-sample mask record (``ds.insitu.validity``; see ``encode_mask``)
    validity: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: split dim -> positions per block, where the blocks along it are runs of that many positions
    #: (``split(..., block=)``) instead of the chunk grid: any chunking of that dim can then be read
    block: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        edges = {}
        for d, e in self.edges.items():
            e = np.asarray(e, dtype=np.int64)
            if e.flags.writeable:  # a geometry's edges are read-only already: shared, not copied
                e = e.copy()
                e.setflags(write=False)
            edges[d] = e
        self.edges = edges
        self.splits = {k: Blocks.from_ids(v) for k, v in self.splits.items()}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SplitManifest):
            return NotImplemented
        same = (list(self.edges) == list(other.edges)
                and all(np.array_equal(self.edges[d], other.edges[d]) for d in self.edges)
                and list(self.splits) == list(other.splits)
                and all(self.splits[k] == other.splits[k] for k in self.splits))
        rest = ("dims", "sizes", "labels", "seed", "gap", "contiguous", "method", "fingerprint", "snapshot",
                "stats", "version", "extra", "validity", "block")
        return same and all(_same_record(getattr(self, k), getattr(other, k)) for k in rest)

    __hash__ = None  # type: ignore[assignment]

    # -- derived
    @property
    def grid(self) -> tuple[int, ...]:
        """Number of chunk blocks along each split dim."""
        return tuple(len(self.edges[d]) - 1 for d in self.dims)

    def blocks(self, split: str) -> np.ndarray:
        """Flat block ids of ``split`` (C order over ``dims``), as an int64 array."""
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r}; this manifest has {list(self.splits)}")
        return self.splits[split].ids()

    def positions(self, split: str) -> int:
        """Number of positions (grid points along the split dims) the split covers."""
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r}; this manifest has {list(self.splits)}")
        if len(self.dims) == 1:  # O(runs)
            e, b = self.edges[self.dims[0]], self.splits[split]
            return int((e[b.stops] - e[b.starts]).sum())
        ends = [np.diff(np.asarray(self.edges[d])) for d in self.dims]
        idx = np.unravel_index(self.blocks(split), self.grid)
        return int(np.prod([ends[k][idx[k]] for k in range(len(self.dims))], axis=0).sum())

    def indices(self, split: str) -> dict[str, np.ndarray]:
        """The positions (grid points along the split dims) of ``split``, as ``np.nonzero`` gives them:
        one int64 array per split dim, all ``m.positions(split)`` long; point ``k`` is
        ``(ind[d][k] for d in m.dims)``.

        For one split dim, ``ind[dim]`` is the positions along it that the split holds (``gap`` and
        other splits' chunks left out), and ``ds.isel({dim: ind[dim]})`` (or ``m.isel(ds, split)``)
        is the split. For several, the arrays together list the split's points -- not a rectangle:
        ``ds.isel({d: xr.DataArray(ind[d], dims="point") for d in m.dims})`` selects them along a
        ``point`` dim.

        Order: chunk blocks in split order, and inside a block C order over the split dims -- the
        order in which ``shuffle=False`` and the map-style dataset number a split's samples where a
        sample is one position (no window, patch or ``over``).

        Parameters
        ----------
        split : str
            A split of this manifest.

        Returns
        -------
        dict of str to numpy.ndarray
            Split dim -> int64 positions.
        """
        b = self._split_blocks(split)
        if len(self.dims) == 1:  # from the runs: no per-block array
            e = self.edges[self.dims[0]]
            first, last = e[b.starts], e[b.stops]
            lengths = last - first
            offsets = np.cumsum(lengths) - lengths
            return {self.dims[0]: np.repeat(first - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)}
        idx = np.unravel_index(b.ids(), self.grid)
        lo = [self.edges[d][i] for d, i in zip(self.dims, idx, strict=True)]
        width = [self.edges[d][i + 1] - self.edges[d][i] for d, i in zip(self.dims, idx, strict=True)]
        count = np.prod(width, axis=0) if len(b) else np.zeros(0, np.int64)
        offsets = np.cumsum(count) - count
        # each point's rank inside its block, unravelled (C order) by the block's widths
        rank = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(offsets, count)
        out, inner = {}, np.ones_like(count)
        for k in reversed(range(len(self.dims))):
            out[self.dims[k]] = np.repeat(lo[k], count) + (rank // np.repeat(inner, count)) % np.repeat(width[k], count)
            inner = inner * width[k]
        return {d: out[d].astype(np.int64, copy=False) for d in self.dims}

    def isel(self, ds: Any, split: str) -> Any:
        """The part of ``ds`` (a Dataset or DataArray) that ``split`` holds: ``ds.isel({dim: positions})``
        along the split dim, with a slice where the split is one run (a view, as ``ds.isel`` gives).

        For a split over one dim. The samples a split yields are cut from this subset (windows and tiles
        that fit inside one of its runs); a split over several dims is a set of points, not a
        rectangle: select them with ``m.indices(split)`` (``ValueError`` here).

        Parameters
        ----------
        ds : xr.Dataset or xr.DataArray
            The dataset the manifest was made on (or one with the same split dim: same length and
            first/last labels).
        split : str
            A split of this manifest.
        """
        if not (hasattr(ds, "isel") and hasattr(ds, "sizes")):
            raise TypeError(f"ds must be an xarray Dataset or DataArray, got {type(ds).__name__}")
        b = self._split_blocks(split)
        if len(self.dims) != 1:
            raise ValueError(f"the manifest splits {self.dims}: split {split!r} is a set of points, not a rectangle; "
                             "select them with ind = m.indices(split) and "
                             "ds.isel({d: xr.DataArray(ind[d], dims='point') for d in m.dims})")
        dim = self.dims[0]
        if dim not in ds.sizes:
            raise ValueError(f"ds has no dim {dim!r} (the manifest's split dim); its dims are {list(ds.sizes)}")
        if ds.sizes[dim] != self.sizes[dim]:
            raise self._other_length(dim, ds.sizes[dim], "ds")
        span = coord_span(ds, dim)
        if span is not None:
            self.check_labels({dim: span})
        e = self.edges[dim]
        if b.nruns == 1:
            return ds.isel({dim: slice(int(e[b.starts[0]]), int(e[b.stops[0]]))})
        return ds.isel({dim: self.indices(split)[dim]})

    def _split_blocks(self, split: Any) -> Blocks:
        if not isinstance(split, str):
            raise TypeError(f"split must be a split name (str), got {type(split).__name__} {split!r}")
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r}; this manifest has {list(self.splits)}")
        return self.splits[split]

    def set_stats(self, stats: dict[str, Any] | None) -> None:
        """Record normalisation statistics (a ``ds.insitu.stats`` result, which calls this) in the
        manifest, as ``stats``; ``to_json`` saves them. None removes them."""
        if stats is not None and not isinstance(stats, dict):
            raise TypeError(f"stats must be a dict from ds.insitu.stats (or None), got {type(stats).__name__}")
        self.stats = stats

    def set_validity(self, split: str, record: dict[str, Any] | None) -> None:
        """Record the valid-sample mask of ``split`` (an ``encode_mask`` record, which
        ``ds.insitu.validity`` makes); ``to_json`` saves it. None removes it."""
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r}; this manifest has {list(self.splits)}")
        if record is None:
            self.validity.pop(split, None)
            return
        check_mask_record(record, f"validity of split {split!r}")
        self.validity[split] = record

    # -- checks
    def check_labels(self, first_last: dict[str, list[Any]]) -> None:
        for d, fl in first_last.items():
            mine = self.extra.get("coords", {}).get(d)
            if mine is not None and not (len(mine) == len(fl) and all(map(_same_label, mine, fl))):
                raise ValueError(f"coordinate {d!r} spans {fl[0]}..{fl[1]} here, but the manifest was made "
                                 f"on {mine[0]}..{mine[1]}")

    def _other_length(self, dim: str, here: int, what: str) -> ValueError:
        """The error for a dataset (``what`` names it) whose ``dim`` is ``here`` long, not the manifest's length;
        one that grew (an append) is told the selection the manifest was made on."""
        made = self.sizes[dim]
        grew = (f": the archive grew since? ds.isel({dim}=slice(0, {made})) is what it was made on"
                if here > made else "")
        return ValueError(f"manifest was made on {dim!r} of length {made}, {what} has {here}{grew}")

    def check_grid(self, sizes: dict[str, int], edges: dict[str, np.ndarray], chunks: dict[str, Any]) -> None:
        """Raise ``ValueError`` unless a dataset with these split-dim ``sizes`` and chunk ``edges``
        has the manifest's chunk grid or refines it (every manifest edge is an edge there). Along a dim
        split in blocks of positions (``block``) only the length must match: blocks need no chunk edge."""
        for d in self.dims:
            if d not in sizes:
                raise ValueError(f"manifest splits dim {d!r}, which the selected variables do not have")
            if sizes[d] != self.sizes[d]:
                raise self._other_length(d, sizes[d], "this dataset")
            if d in self.block:
                continue
            mine, theirs = self.edges[d], np.asarray(edges[d], dtype=np.int64)
            if len(mine) == len(theirs):
                ok = bool(np.array_equal(mine, theirs))
            elif len(mine) > len(theirs):
                ok = False  # fewer edges here: a coarser (or other) grid
            else:
                at = np.searchsorted(theirs, mine)
                ok = bool((at < len(theirs)).all()) and bool((theirs[np.minimum(at, len(theirs) - 1)] == mine).all())
            if not ok:
                raise ValueError(f"the chunk grid along {d!r} (chunks of {chunks.get(d)}) does not match the "
                                 "manifest's: it was made on a dataset chunked differently (a manifest applies "
                                 "to its own chunk grid or to one that refines it)")

    # -- JSON
    def to_dict(self) -> dict[str, Any]:
        """The manifest as plain JSON-able data (format version 2: runs, not lists of ids)."""
        out: dict[str, Any] = {}
        nruns = sum(b.nruns for b in self.splits.values())
        if nruns > MAX_RUNS and len(self.splits) < _MAX_OWNED and all(b.ascending() for b in self.splits.values()):
            owner = _encode_owner(self.owner(left_out=len(self.splits)).ravel(), len(self.splits))
            if len(owner["data"]) < 16 * nruns:  # ~16 characters per run as JSON
                out["owner"] = owner
        if out:
            splits: dict[str, Any] = {k: {"owner": i} for i, k in enumerate(self.splits)}
        else:
            splits = {k: {"runs": b.to_json()} for k, b in self.splits.items()}
        return {
            "format": "xinsitu.SplitManifest", "version": FORMAT_VERSION, "dims": self.dims,
            "sizes": self.sizes, "edges": {d: {"steps": steps_of(e)} for d, e in self.edges.items()},
            "splits": splits, **out, "labels": self.labels,
            "seed": self.seed, "gap": self.gap, "contiguous": self.contiguous, "method": self.method,
            "fingerprint": self.fingerprint, "snapshot": self.snapshot, "stats": self.stats,
            "extra": self.extra, **({"validity": self.validity} if self.validity else {}),
            **({"block": self.block} if self.block else {}),
        }

    @overload
    def to_json(self, path: None = None) -> str: ...

    @overload
    def to_json(self, path: str | os.PathLike) -> None: ...

    def to_json(self, path: str | os.PathLike | None = None) -> str | None:
        """Write the manifest as JSON to ``path``; without a path, return the JSON text (as pandas' ``to_json``:
        a notebook cell that ends saving the manifest shows no JSON string)."""
        text = json.dumps(self.to_dict(), indent=1, allow_nan=True)
        if path is None:
            return text
        with open(path, "w") as f:
            f.write(text)
        return None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SplitManifest:
        """A manifest from ``to_dict``'s data (either format version), validated: a malformed,
        out-of-range or overlapping one raises ``ValueError`` naming the problem."""
        if not isinstance(d, dict) or d.get("format") != "xinsitu.SplitManifest":
            raise ValueError("not an xinsitu SplitManifest (missing 'format': 'xinsitu.SplitManifest')")
        version = d.get("version", 1)
        if not _is_int(version) or version < 1:
            raise ValueError(f"manifest 'version' must be a positive integer, got {version!r}")
        if version > FORMAT_VERSION:
            raise ValueError(f"manifest format version {d['version']} is newer than this xinsitu "
                             f"understands ({FORMAT_VERSION})")
        try:
            m = cls(**_validated_fields(d, version))
            fp = m.fingerprint and (fingerprint_v1(m.dims, m.sizes, m.edges, m.extra.get("coords", {})) if version == 1
                                    else fingerprint_of(m.dims, m.sizes, m.edges, m.extra.get("coords", {})))
        except RecursionError:  # (labels or coordinates nested past Python's limit in a dict handed in)
            raise ValueError("manifest is nested too deeply to be a manifest") from None
        except OverflowError as e:  # (every integer field is bounded first: a safety net)
            raise ValueError(f"manifest holds an integer too large for its field ({e})") from None
        if m.fingerprint:
            if m.fingerprint != fp:
                raise ValueError("manifest fingerprint does not match its contents (the file was edited or damaged)")
            if version == 1:  # in memory every manifest carries the current fingerprint
                m.fingerprint = fingerprint_of(m.dims, m.sizes, m.edges, m.extra.get("coords", {}))
        return m

    @classmethod
    def from_json(cls, path_or_text: str | os.PathLike) -> SplitManifest:
        """Load a manifest written by ``to_json`` (a path, or the JSON text itself).

        A ``str`` is read as JSON text where it starts with ``{`` or ``[`` or names no existing file
        but parses as JSON (``"null"``: ``ValueError``, not a file not found), else as a path; an
        ``os.PathLike`` is always a path. Every field is checked: ``ValueError`` naming the problem.
        """
        if isinstance(path_or_text, os.PathLike):
            text = _read(path_or_text)
        elif not isinstance(path_or_text, str):
            raise TypeError(f"from_json takes a path or the JSON text (str), got {type(path_or_text).__name__}")
        else:
            s = path_or_text.removeprefix("\ufeff")  # (a byte-order mark left by an editor)
            head = s.lstrip()[:1]
            if head in ("{", "[") or (not os.path.exists(s) and _parses(s)):
                text = s
            else:
                text = _read(s)
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"manifest is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError("manifest JSON is nested too deeply to be a manifest") from None
        if not isinstance(d, dict):
            kind = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
            raise ValueError(f"not an xinsitu SplitManifest: the JSON text is {kind.get(type(d), 'null')}, not an "
                             "object with 'format': 'xinsitu.SplitManifest'")
        return cls.from_dict(d)

    # -- display (``formatting``)
    def summary(self) -> str:
        """A few plain lines: the split dims and, per split, its chunk blocks, positions and labels."""
        return formatting.manifest_summary(self)

    def owner(self, left_out: int = -1) -> np.ndarray:
        """Per chunk block (shaped as ``grid``): index of its split in ``splits``, ``left_out`` where none."""
        n = int(np.prod(self.grid))
        owner = np.full(n, left_out, dtype=np.uint8 if 0 <= left_out < _MAX_OWNED else np.int64)
        for i, b in enumerate(self.splits.values()):
            if b.nruns <= 64:
                for a, z in zip(b.starts.tolist(), b.stops.tolist(), strict=True):
                    owner[a:z] = i
            else:
                owner[b.ids()] = i
        return owner.reshape(self.grid)

    def plot(self, ax: Any = None) -> Any:
        """Draw the splits with matplotlib (a timeline for one dim, a grid for two); see
        ``xinsitu.repr.plot.plot_manifest``. Returns the Axes."""
        from xinsitu.repr.plot import plot_manifest

        return plot_manifest(self, ax=ax)

    def _repr_parts(self, drawing: bool = False) -> tuple[str, str, list[Any]]:
        """Title, headline and sections of both reprs (``xinsitu.repr.formatting.text_repr``)."""
        return formatting.manifest_parts(self, drawing)

    def __repr__(self) -> str:
        return formatting.text_repr(self)

    def _repr_html_(self) -> str:
        return formatting.html_repr(self)


def _read(path: str | os.PathLike) -> str:
    with open(path) as f:
        return f.read()


def _parses(text: str) -> bool:
    """Whether ``text`` is JSON (small texts only: a path is short, and so is a JSON scalar)."""
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def fingerprint_of(dims: list[str], sizes: dict[str, int], edges: dict[str, Any],
                   coords: Mapping[str, list[Any] | None]) -> str:
    """Hash of the split dims' geometry (lengths, chunk grid as runs of equal steps, first/last
    labels): O(runs of the grid), a few hundred bytes hashed for a regular grid of any length."""
    blob = json.dumps({"version": 2, "dims": list(dims), "sizes": {d: sizes[d] for d in dims},
                       "edges": {d: steps_of(edges[d]) for d in dims},
                       "coords": {d: coords.get(d) for d in dims}}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def fingerprint_v1(dims: list[str], sizes: dict[str, int], edges: dict[str, Any],
                   coords: Mapping[str, list[Any] | None]) -> str:
    """The fingerprint format-version-1 manifests carry (every edge listed), checked on load."""
    blob = json.dumps({"dims": list(dims), "sizes": {d: sizes[d] for d in dims},
                       "edges": {d: [int(x) for x in edges[d]] for d in dims},
                       "coords": {d: coords.get(d) for d in dims}}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _validated_fields(d: dict[str, Any], version: int) -> dict[str, Any]:
    """The constructor arguments in ``d``, every field checked (types, grid, block ranges,
    disjoint splits); ``ValueError`` naming the first problem."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError("manifest " + msg)

    dims: Any = d.get("dims")
    sizes: Any = d.get("sizes")
    edges_in: Any = d.get("edges")
    need(isinstance(dims, list) and bool(dims) and all(isinstance(x, str) for x in dims)
         and len(set(dims)) == len(dims), f"'dims' must be a non-empty list of distinct names, got {dims!r}")
    need(isinstance(sizes, dict) and all(x in sizes and _is_int(sizes[x]) and 0 <= sizes[x] <= INT64_MAX
                                         for x in dims),
         f"'sizes' must map each of {dims} to a non-negative integer below 2**63, got {sizes!r}")
    need(isinstance(edges_in, dict) and all(x in edges_in for x in dims),
         f"'edges' must give the chunk edges of each of {dims}")
    edges: dict[str, np.ndarray] = {}
    room = MAX_EDGES
    for x in dims:
        e = edges_in[x]
        # counted before anything is allocated: edges rise strictly from 0 to the length, so at most length + 1
        if isinstance(e, dict) and version >= 2:
            count = steps_length(e.get("steps"), f"manifest 'edges' of {x!r}")
        else:
            need(isinstance(e, list) and all(_is_int(v) and abs(v) <= INT64_MAX for v in e),
                 f"'edges' of {x!r} must be a list of integers below 2**63")
            count = len(e)
        need(count <= sizes[x] + 1, f"'edges' of {x!r} hold {count} chunk edges, more than its length {sizes[x]} "
                                    f"allows ({sizes[x] + 1})")
        need(count <= room, f"'edges' of {x!r} hold {count} chunk edges, more than this xinsitu loads "
                            f"({MAX_EDGES} over all split dims)")
        room -= count
        e = decode_steps(e["steps"], f"manifest 'edges' of {x!r}") if isinstance(e, dict) else np.asarray(e, np.int64)
        need(len(e) >= 2 and e[0] == 0 and e[-1] == sizes[x] and bool((e[1:] > e[:-1]).all()),
             f"'edges' of {x!r} must rise strictly from 0 to its length {sizes[x]}")
        e.setflags(write=False)  # ours: the manifest keeps it as it is, no copy
        edges[x] = e
    grid = tuple(len(edges[x]) - 1 for x in dims)
    n = int(np.prod(grid))
    splits_in: Any = d.get("splits")
    need(isinstance(splits_in, dict) and bool(splits_in) and all(isinstance(k, str) and k for k in splits_in),
         "'splits' must be a non-empty dict of split name -> chunk blocks")
    owner = None
    if any(isinstance(v, dict) and "owner" in v for v in splits_in.values()):
        owner = _decode_owner(d.get("owner"), n)
    splits: dict[str, Blocks] = {}
    for k, v in splits_in.items():
        if isinstance(v, list):  # format 1: every block id listed
            need(all(_is_int(b) for b in v), f"split {k!r} must list integer chunk blocks")
            out_of = next((b for b in v if not 0 <= b < n), None)  # (before numpy holds them: any size of int)
            need(out_of is None, f"split {k!r} holds chunk block {out_of}, outside the grid of {n} chunk blocks "
                                 f"({' x '.join(map(str, grid))})")
            b = Blocks.from_ids(v)
        elif isinstance(v, dict) and "runs" in v:
            r = v["runs"]
            need(isinstance(r, list) and all(isinstance(p, list) and len(p) == 2 and _is_int(p[0]) and _is_int(p[1])
                                             and p[1] > p[0] for p in r),
                 f"split {k!r}: 'runs' must be a list of [start, stop] integer pairs with stop > start")
            out_of = next((p for p in r if p[0] < 0 or p[1] > n), None)
            need(out_of is None, f"split {k!r} holds chunk block "
                                 f"{(out_of[0] if out_of[0] < 0 else out_of[1] - 1) if out_of else ''}, outside the "
                                 f"grid of {n} chunk blocks ({' x '.join(map(str, grid))})")
            b = Blocks([p[0] for p in r], [p[1] for p in r])
        elif isinstance(v, dict) and "owner" in v:
            i = v["owner"]
            need(_is_int(i) and 0 <= i < int(d["owner"]["left_out"]),
                 f"split {k!r}: 'owner' must be an integer below {d['owner']['left_out']}")
            b = Blocks.from_ids(np.flatnonzero(owner == i))
        else:
            raise ValueError(f"manifest split {k!r} must be a list of chunk blocks or {{'runs': [[start, stop], ...]}}")
        need(len(b) > 0, f"split {k!r} holds no chunk block: an empty split is refused, as split() refuses it "
                         "(drop it from 'splits', or give it chunk blocks)")
        lo, hi = b.bounds()
        need(lo >= 0 and hi < n, f"split {k!r} holds chunk block {lo if lo < 0 else hi}, outside the grid of "
                                 f"{n} chunk blocks ({' x '.join(map(str, grid))})")
        splits[k] = b
    _check_disjoint(splits)
    out: dict[str, Any] = {"dims": dims, "sizes": {x: sizes[x] for x in dims}, "edges": edges, "splits": splits}
    labels = d.get("labels", {})
    need(isinstance(labels, dict) and all(isinstance(v, dict) for v in labels.values()),
         "'labels' must be a dict of split name -> {dim: [first, last]}")
    out["labels"] = labels
    checks = {"seed": lambda v: v is None or _is_int(v), "gap": lambda v: _is_int(v) and 0 <= v <= INT64_MAX,
              "contiguous": lambda v: isinstance(v, bool), "method": lambda v: v in ("fractions", "ranges"),
              "fingerprint": lambda v: isinstance(v, str), "snapshot": lambda v: v is None or isinstance(v, str),
              "stats": lambda v: v is None or isinstance(v, dict), "extra": lambda v: isinstance(v, dict)}
    for key, ok in checks.items():
        if key in d:
            need(ok(d[key]), f"{key!r} has a wrong type or value: {d[key]!r}")
            out[key] = d[key]
    validity = d.get("validity", {})
    need(isinstance(validity, dict) and all(k in splits for k in validity),
         f"'validity' must be a dict of split name -> mask, for splits of {list(splits)}")
    for k, rec in validity.items():
        check_mask_record(rec, f"manifest validity of split {k!r}")
    out["validity"] = dict(validity)
    coords = out.get("extra", {}).get("coords", {})
    need(isinstance(coords, dict), "'extra.coords' must be a dict of dim -> [first, last]")
    block = d.get("block", {})
    need(isinstance(block, dict) and all(k in dims and _is_int(n) and 1 <= n <= max(sizes[k], 1)
                                         for k, n in block.items()),
         f"'block' must map split dims of {dims} to positive integers up to their lengths, got {block!r}")
    for k, n in block.items():
        e = edges[k]
        need(len(e) == -(-sizes[k] // n) + 1 and bool((e[:-1] == np.arange(len(e) - 1) * n).all()),
             f"'edges' of {k!r} are not blocks of block[{k!r}] = {n} positions")
    out["block"] = dict(block)
    return out


def _check_disjoint(splits: dict[str, Blocks]) -> None:
    """``ValueError`` naming two splits (or one, twice) that hold the same chunk block."""
    names = list(splits)
    starts = np.concatenate([splits[k].starts for k in names] + [np.zeros(0, np.int64)])
    stops = np.concatenate([splits[k].stops for k in names] + [np.zeros(0, np.int64)])
    who = np.repeat(np.arange(len(names)), [splits[k].nruns for k in names])
    order = np.argsort(starts, kind="stable")
    starts, stops, who = starts[order], stops[order], who[order]
    bad = np.flatnonzero(starts[1:] < stops[:-1])
    if len(bad):
        i = int(bad[0])
        a, b = names[int(who[i])], names[int(who[i + 1])]
        block = int(starts[i + 1])
        if a == b:
            raise ValueError(f"manifest split {a!r} holds chunk block {block} twice")
        raise ValueError(f"manifest splits {a!r} and {b!r} overlap (both hold chunk block {block})")
