"""One list of sections per object feeds both its text ``repr`` and its ``_repr_html_``.

The HTML follows xarray's: the escaped text repr sits in a ``<pre>`` that shows where
the notebook is untrusted (no CSS, no ``<style>``), and the rich view is hidden by an
inline style that the packaged CSS overrides. Sections fold with a checkbox and a label
(no JavaScript); colours come from JupyterLab's ``--jp-*`` variables, with plain
fallbacks and dark-theme selectors for other front ends. Drawings (a split timeline, a
grid of chunk blocks) are small HTML/SVG snippets built from plain arrays here, so the
objects that own the data only say *what* to draw.
"""

from __future__ import annotations

import html as _html
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

#: the objects described here, taken duck-typed: an ``index.manifest.SplitManifest``, an
#: ``index.geometry.Geometry``. Their modules call these reprs, so naming their types here, even for
#: annotations only, would tie the folders between into one circle.
ManifestLike = Any
GeometryLike = Any

#: Colour of split ``i`` (``i`` in the manifest's split order), shared with ``xinsitu.repr.plot``
#: (matplotlib's tab10 without its grey, which marks gaps).
SPLIT_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22",
                "#17becf")
GAP_COLOR = "#b0b0b0"

#: Sections with more rows than this start folded in HTML (as xarray folds long variable lists).
FOLD_ROWS = 15
#: Most segments a timeline draws; longer runs lists are binned (each bin shows its majority split).
MAX_SEGMENTS = 400
#: Most cells per side of a grid drawing; larger grids are sampled.
MAX_GRID = 200


@dataclass
class Section:
    """One titled part of a repr.

    Parameters
    ----------
    title : str
        Section name, e.g. ``"Variables"``.
    header : tuple of str
        Column names; empty for key/value lines.
    rows : list of tuple of str
        Table rows (already formatted).
    extra_html : str
        HTML shown under the table in the rich repr only (a drawing, a legend).
    summary : str
        A few words after the title, in both reprs (e.g. a count).
    collapsed : bool
        Start folded in HTML (sections with more than ``FOLD_ROWS`` rows always do).
    """

    title: str
    header: tuple[str, ...] = ()
    rows: Sequence[tuple[str, ...]] = field(default_factory=list)
    extra_html: str = ""
    summary: str = ""
    collapsed: bool = False


# ----------------------------------------------------------------------------- text
def text(title: str, sections: list[Section], summary: str = "") -> str:
    """Plain, aligned text, short enough for a terminal.

    Parameters
    ----------
    title : str
        Object type, shown as ``<title>``.
    sections : list of Section
        What to show, in order.
    summary : str
        One line after the title.

    Returns
    -------
    str
    """
    out = [f"<{title}>" + (f" {summary}" if summary else "")]
    for s in sections:
        out.append(f"{s.title}:" + (f" {s.summary}" if s.summary else ""))
        table = [s.header, *s.rows] if s.header else list(s.rows)
        if not table:
            continue
        ncol = max(len(r) for r in table)
        widths = [max(len(r[i]) for r in table if i < len(r)) for i in range(ncol)]
        for r in table:
            out.append("    " + "  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
    return "\n".join(out)


# ----------------------------------------------------------------------------- HTML
@cache
def _css() -> str:
    """The packaged style sheet, read once per process."""
    return resources.files("xinsitu").joinpath("static/style.css").read_text(encoding="utf-8")


def _e(s: object) -> str:
    return _html.escape(str(s), quote=True)


def _uid() -> str:
    # uuid, not id(): ids are reused once an object is freed, and two outputs of one
    # notebook must never share a checkbox id (a label would fold the other output).
    return "xi-" + uuid.uuid4().hex[:12]


def _table(s: Section) -> str:
    if not s.rows:
        return ""
    parts = ["<table class='xi-table'>"]
    if s.header:
        parts.append("<thead><tr>" + "".join(f"<th>{_e(h)}</th>" for h in s.header) + "</tr></thead>")
        parts.append("<tbody>")
        for r in s.rows:
            parts.append("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>")
    else:  # key/value lines
        parts.append("<tbody>")
        for r in s.rows:
            key, *vals = r
            parts.append(f"<tr><th scope='row' class='xi-key'>{_e(key)}</th>"
                         + "".join(f"<td>{_e(v)}</td>" for v in vals) + "</tr>")
    parts.append("</tbody></table>")
    return "".join(parts)


def html(title: str, sections: list[Section], fallback: str, summary: str = "") -> str:
    """HTML with foldable sections (checkbox + label, no JavaScript) and a text fallback.

    Parameters
    ----------
    title : str
        Object type, e.g. ``"xinsitu.Geometry"``.
    sections : list of Section
        What to show, in order (the same list the text repr shows).
    fallback : str
        The text repr; shown instead where the notebook is untrusted.
    summary : str
        One line next to the title.

    Returns
    -------
    str
    """
    parts = [f"<div><style>{_css()}</style>",
             f"<pre class='xi-text-repr-fallback'>{_e(fallback)}</pre>",
             "<div class='xi-wrap' style='display:none'>",
             f"<div class='xi-header'><div class='xi-obj-type'>{_e(title)}</div>",
             f"<div class='xi-obj-summary'>{_e(summary)}</div></div>" if summary else "</div>",
             "<ul class='xi-sections'>"]
    for s in sections:
        sid = _uid()
        folded = s.collapsed or len(s.rows) > FOLD_ROWS
        body = _table(s) + s.extra_html
        disabled = "" if body else " disabled"
        checked = "" if folded or not body else " checked"
        count = f"<span class='xi-section-count'>{_e(s.summary)}</span>" if s.summary else ""
        parts.append(f"<li class='xi-section'><input id='{sid}' class='xi-section-in' type='checkbox'"
                     f"{checked}{disabled}><label for='{sid}' class='xi-section-label'>{_e(s.title)}{count}</label>"
                     f"<div class='xi-section-body'>{body}</div></li>")
    parts.append("</ul></div></div>")
    return "".join(parts)


# ----------------------------------------------------------------------------- drawings
def split_color(i: int) -> str:
    """Colour of the ``i``-th split (``-1``: a gap)."""
    return GAP_COLOR if i < 0 else SPLIT_COLORS[i % len(SPLIT_COLORS)]


def fmt_bytes(n: float) -> str:
    """``1234567`` -> ``'1.2 MB'`` (decimal units, as object stores bill)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"  # unreachable, keeps type checkers content


def runs(owner: np.ndarray) -> list[tuple[int, int, int]]:
    """``[(owner, first, stop)]`` for each run of equal values of a 1-D array."""
    owner = np.asarray(owner)
    if owner.size == 0:
        return []
    brk = np.flatnonzero(owner[1:] != owner[:-1]) + 1
    starts = np.concatenate([[0], brk])
    stops = np.concatenate([brk, [owner.size]])
    return [(int(owner[a]), int(a), int(b)) for a, b in zip(starts, stops, strict=True)]


def _binned(owner: np.ndarray, weights: np.ndarray, nbins: int) -> tuple[np.ndarray, np.ndarray]:
    """Coarsen blocks to ``nbins`` bins of consecutive blocks, each the majority owner by weight."""
    edges = np.linspace(0, owner.size, nbins + 1).round().astype(np.int64)
    out = np.empty(nbins, dtype=owner.dtype)
    w = np.empty(nbins, dtype=np.float64)
    for k in range(nbins):
        o, ww = owner[edges[k]:edges[k + 1]], weights[edges[k]:edges[k + 1]]
        vals, inv = np.unique(o, return_inverse=True)
        out[k] = vals[np.argmax(np.bincount(inv, weights=ww))]
        w[k] = ww.sum()
    return out, w


def timeline(owner: Sequence[int] | np.ndarray, edges: Sequence[int] | np.ndarray, names: Sequence[str], *,
             dim: str = "", labels: dict[str, tuple[str, str]] | None = None,
             span: tuple[str, str] | None = None) -> str:
    """A horizontal bar of coloured spans: which split owns each chunk block of one dim.

    Parameters
    ----------
    owner : array of int
        Per chunk block, the index of its split in ``names``, or ``-1`` for a block left out.
    edges : array of int
        Block edges in positions (``len(owner) + 1`` values); widths follow positions, so
        uneven chunks are drawn to scale.
    names : sequence of str
        Split names.
    dim : str
        Name of the dim, shown under the bar.
    labels : dict
        ``{split: (first label, last label)}`` shown in each span's tooltip and the legend.
    span : tuple of str
        First and last label of the whole dim, shown at the ends of the bar.

    Returns
    -------
    str
        HTML (a ``div.xi-timeline``, an axis line and a legend).
    """
    owner = np.asarray(owner, dtype=np.int64)
    edges = np.asarray(edges, dtype=np.int64)
    widths = np.diff(edges).astype(np.float64)
    labels = labels or {}
    binned = len(runs(owner)) > MAX_SEGMENTS
    if binned:
        owner, widths = _binned(owner, widths, MAX_SEGMENTS)
        bounds = np.linspace(0, len(edges) - 1, MAX_SEGMENTS + 1).round().astype(np.int64)
    else:
        bounds = np.arange(len(edges))
    segs = []
    pieces = runs(owner)
    nruns = np.bincount([o + 1 for o, _, _ in pieces], minlength=len(names) + 1)
    for o, a, b in pieces:
        name = "gap" if o < 0 else names[o]
        ca, cb = int(bounds[a]), int(bounds[b]) - 1
        tip = f"{name}: "
        if o >= 0 and nruns[o + 1] == 1 and name in labels:  # the run is the whole split: its labels are exact
            tip += f"{labels[name][0]} .. {labels[name][1]}, "
        tip += f"chunk block{'s' if cb > ca else ''} {ca}" + (f"..{cb}" if cb > ca else "")
        tip += f", positions {int(edges[ca])}..{int(edges[cb + 1]) - 1}"
        cls = "xi-seg xi-seg-gap" if o < 0 else "xi-seg"
        style = f"flex-grow:{widths[a:b].sum():g}" + ("" if o < 0 else f";background-color:{split_color(o)}")
        segs.append(f"<div class='{cls}' style='{style}' title='{_e(tip)}'>"
                    f"<span>{'' if o < 0 else _e(name)}</span></div>")
    out = [f"<div class='xi-timeline' role='img' aria-label='{_e('split timeline along ' + dim)}'>",
           *segs, "</div>"]
    lo, hi = span if span else ("0", str(int(edges[-1]) - 1))
    axis = _e(dim) + (" (binned: each bin shows its main split)" if binned else "")
    out.append(f"<div class='xi-axis'><span>{_e(lo)}</span><span>{axis}</span><span>{_e(hi)}</span></div>")
    out.append(legend(names, labels, gaps=bool((owner < 0).any())))
    return "".join(out)


def legend(names: Sequence[str], labels: dict[str, tuple[str, str]] | None = None, *, gaps: bool = False) -> str:
    """Coloured keys for the splits (and for gaps), with each split's label range."""
    labels = labels or {}
    items = []
    for i, n in enumerate(names):
        rng = labels.get(n)
        what = f" {rng[0]} … {rng[1]}" if rng else ""
        items.append(f"<span class='xi-key-item'><span class='xi-swatch' style='background-color:{split_color(i)}'>"
                     f"</span><b>{_e(n)}</b>{_e(what)}</span>")
    if gaps:
        items.append("<span class='xi-key-item'><span class='xi-swatch xi-seg-gap'></span>left out (gap)</span>")
    return "<div class='xi-legend'>" + "".join(items) + "</div>"


def _sample_axis(n: int) -> np.ndarray:
    return np.arange(n) if n <= MAX_GRID else np.linspace(0, n - 1, MAX_GRID).round().astype(np.int64)


def grid(owner: np.ndarray, row_edges: Sequence[int] | np.ndarray, col_edges: Sequence[int] | np.ndarray,
         names: Sequence[str], *, dims: tuple[str, str] = ("", ""),
         spans: dict[str, tuple[str, str]] | None = None) -> str:
    """An SVG map of a 2-D split: one cell per chunk block, coloured by split.

    Parameters
    ----------
    owner : 2-D array of int
        ``owner[i, j]``: index in ``names`` of the split owning block ``(i, j)``, ``-1`` if left out.
    row_edges, col_edges : arrays of int
        Block edges in positions along the first and second dim (cells are drawn to scale).
    names : sequence of str
        Split names.
    dims : tuple of str
        Names of the row and column dims.
    spans : dict
        ``{dim: (first label, last label)}`` of each dim, written along the axes.

    Returns
    -------
    str
        HTML (an inline ``svg.xi-grid`` and a legend).
    """
    owner = np.asarray(owner, dtype=np.int64)
    re_, ce = np.asarray(row_edges, dtype=np.int64), np.asarray(col_edges, dtype=np.int64)
    ri, ci = _sample_axis(owner.shape[0]), _sample_axis(owner.shape[1])
    sampled = len(ri) < owner.shape[0] or len(ci) < owner.shape[1]
    if sampled:  # draw a sample of the blocks as an even grid
        owner = owner[np.ix_(ri, ci)]
        re_, ce = np.arange(len(ri) + 1), np.arange(len(ci) + 1)
    H, W = int(re_[-1] - re_[0]), int(ce[-1] - ce[0])
    width = 280.0
    height = float(np.clip(width * H / max(W, 1), 60, 280))
    pid = _uid()
    rects = []
    for i in range(owner.shape[0]):
        y, h = int(re_[i] - re_[0]), int(re_[i + 1] - re_[i])
        for o, a, b in runs(owner[i]):
            x, w = int(ce[a] - ce[0]), int(ce[b] - ce[a])
            fill = f"url(#{pid})" if o < 0 else split_color(o)
            rects.append(f"<rect x='{x}' y='{y}' width='{w}' height='{h}' fill='{fill}'/>")
    lines = []
    if not sampled and owner.shape[0] * owner.shape[1] <= 64 * 64:  # chunk edges, where they stay legible
        lines += [f"<line x1='0' x2='{W}' y1='{int(r - re_[0])}' y2='{int(r - re_[0])}'/>" for r in re_[1:-1]]
        lines += [f"<line y1='0' y2='{H}' x1='{int(c - ce[0])}' x2='{int(c - ce[0])}'/>" for c in ce[1:-1]]
    svg = (f"<svg class='xi-grid' viewBox='0 0 {W} {H}' width='{width:.0f}' height='{height:.0f}' "
           f"preserveAspectRatio='none' role='img' aria-label='{_e('split grid over ' + ' x '.join(dims))}'>"
           f"<defs><pattern id='{pid}' width='4' height='4' patternUnits='userSpaceOnUse' "
           f"patternTransform='rotate(45)'><rect width='4' height='4' fill='{GAP_COLOR}' fill-opacity='0.35'/>"
           f"<rect width='2' height='4' fill='{GAP_COLOR}'/></pattern></defs>"
           + "".join(rects) + "<g class='xi-grid-lines'>" + "".join(lines) + "</g></svg>")
    spans = spans or {}
    rd, cd = dims
    rlab = f"{rd} {spans[rd][0]} … {spans[rd][1]}" if rd in spans else rd
    clab = f"{cd} {spans[cd][0]} … {spans[cd][1]}" if cd in spans else cd
    note = " (sampled)" if sampled else ""
    return ("<div class='xi-grid-box'>"
            f"<div class='xi-axis xi-axis-top'>{_e(clab)} →{_e(note)}</div>"
            f"<div class='xi-grid-row'><div class='xi-axis xi-axis-left'>{_e(rlab)} →</div>{svg}</div>"
            "</div>" + legend(names, gaps=bool((owner < 0).any())))


# ----------------------------------------------------------------------------- the objects' reprs
# Each object builds its own parts -- ``obj._repr_parts(drawing) -> (title, headline, sections)`` -- and its
# ``__repr__`` is ``text_repr(self)``, its ``_repr_html_`` ``html_repr(self)``: one list of sections feeds
# both. (``geometry_parts`` and ``manifest_parts`` below are those of a ``Geometry`` and a ``SplitManifest``;
# a ``BatchGenerator``'s are in ``xinsitu.batches.describe``.)
def text_repr(obj: Any) -> str:
    """The text repr of an object that builds its parts (``obj._repr_parts``)."""
    title, headline, secs = obj._repr_parts(drawing=False)
    return text(title, secs, headline)


def html_repr(obj: Any) -> str:
    """The HTML repr of the same objects (with drawings; the text repr as its fallback)."""
    title, headline, secs = obj._repr_parts(drawing=True)
    return html(title, secs, text_repr(obj), headline)


def sections(obj: Any, drawing: bool = False) -> list[Section]:
    """The sections both reprs of ``obj`` show (``drawing``: with the HTML-only drawings)."""
    return obj._repr_parts(drawing=drawing)[2]  # type: ignore[no-any-return]


def geometry_parts(g: GeometryLike, drawing: bool = False) -> tuple[str, str, list[Section]]:
    """A ``Geometry``'s repr: title, headline, sections."""
    return "xinsitu.Geometry", _geometry_headline(g), _geometry_sections(g, drawing)


def manifest_parts(m: ManifestLike, drawing: bool = False) -> tuple[str, str, list[Section]]:
    """A ``SplitManifest``'s repr: title, headline, sections."""
    return "xinsitu.SplitManifest", _manifest_headline(m), _manifest_sections(m, drawing)


def _geometry_headline(g: GeometryLike) -> str:
    split = [f"{d} ({g.nblocks(d)} chunks)" for d in g.dims if g.nblocks(d) > 1]
    nv = len(g.variables)
    return f"{nv} variable{'s' if nv != 1 else ''}, chunked along " + (", ".join(split) or "no dim")


def _geometry_sections(g: GeometryLike, drawing: bool = False) -> list[Section]:
    sharded = any(v.shards for v in g.variables.values())
    header = ("variable", "dims", "shape", "chunk", *(("shard",) if sharded else ()), "dtype", "codecs",
              "chunk size", "chunks")
    rows = [
        (
            v.name,
            "(" + ", ".join(v.dims) + ")",
            _fmt_shape(v.shape),
            _fmt_shape(v.chunks),
            *((_fmt_shape(v.shards) if v.shards else "-",) if sharded else ()),
            v.dtype,
            ", ".join(v.codecs) or "-",
            fmt_bytes(v.chunk_nbytes),
            str(v.nchunks),
        )
        for v in g.variables.values()
    ]
    dim_rows = [
        (d, str(g.sizes[d]), str(c) if isinstance(c, int) else "differs: " + ", ".join(map(str, c)),
         str(g.nblocks(d)))
        for d, c in g.dims.items()
    ]
    return [
        Section("Dimensions", ("dim", "length", "chunk", "chunk blocks"), dim_rows, summary=f"({len(dim_rows)})"),
        Section("Variables", header, rows, summary=f"({len(rows)})"),
    ]


def _fmt_shape(shape: tuple[int, ...] | None) -> str:
    return "(" + ", ".join(map(str, shape or ())) + ")"


# -- SplitManifest
def manifest_summary(m: ManifestLike) -> str:
    """``SplitManifest.summary()``: a few plain lines."""
    lines = [f"split on {', '.join(m.dims)} ({' x '.join(map(str, m.grid))} chunk blocks{_blocks_of(m)}, "
             f"method={m.method}, gap={m.gap}, seed={m.seed})"]
    for k, v in _manifest_rows(m):
        lines.append(f"  {k}: " + "  ".join(v))
    return "\n".join(lines)


def _blocks_of(m: ManifestLike) -> str:
    """Where a split dim is cut in blocks of positions (``split(..., block=)``): "; blocks of n along d"."""
    return "".join(f"; blocks of {n} along {d}" for d, n in m.block.items())


def _manifest_rows(m: ManifestLike) -> list[tuple[str, tuple[str, ...]]]:
    rows: list[tuple[str, tuple[str, ...]]] = []
    for name, blocks in m.splits.items():
        rng = "; ".join(f"{d} {lab[0]} .. {lab[1]}" for d, lab in m.labels.get(name, {}).items())
        rows.append((name, (f"{len(blocks)} chunk blocks", f"{m.positions(name)} positions", rng)))
    return rows


def _manifest_headline(m: ManifestLike) -> str:
    how = ("ranges" if m.method == "ranges" else
           "contiguous fractions" if m.contiguous else f"random fractions (seed {m.seed})")
    return (f"on {' x '.join(m.dims)}: {' x '.join(map(str, m.grid))} chunk blocks{_blocks_of(m)}, {how}, "
            f"gap {m.gap}")


def _manifest_sections(m: ManifestLike, drawing: bool = False) -> list[Section]:
    """The repr's sections; ``drawing``: with the timeline/grid (HTML only, O(chunk blocks))."""
    one = len(m.dims) == 1
    total = sum(m.sizes[d] for d in m.dims) if one else int(np.prod([m.sizes[d] for d in m.dims]))
    rows: list[tuple[str, ...]] = []
    for name, blocks in m.splits.items():
        n = m.positions(name)
        labs = m.labels.get(name, {})
        where: tuple[str, ...]
        if one:
            lab = labs.get(m.dims[0])
            where = (str(lab[0]), str(lab[1])) if lab else ("", "")
        else:
            where = ("; ".join(f"{d} {v[0]} .. {v[1]}" for d, v in labs.items()),)
        rows.append((name, str(len(blocks)), str(n), f"{100 * n / max(total, 1):.1f}%", *where))
    left = int(np.prod(m.grid)) - sum(len(b) for b in m.splits.values())  # splits are disjoint
    if left > 0:
        n = total - sum(m.positions(k) for k in m.splits)
        rows.append(("(left out)", str(left), str(n), f"{100 * n / max(total, 1):.1f}%",
                     *([""] * (2 if one else 1))))
    header = ("split", "chunk blocks", "positions", "share", *(("first", "last") if one else ("labels",)))
    coords = m.extra.get("coords", {})
    spans = {d: (str(v[0]), str(v[1])) for d, v in coords.items() if v}
    owner = m.owner() if drawing and len(m.dims) <= 2 else None
    picture = ""
    if owner is not None and one:
        d = m.dims[0]
        picture = timeline(owner, m.edges[d], list(m.splits), dim=d, span=spans.get(d),
                           labels={k: (str(v[d][0]), str(v[d][1])) for k, v in m.labels.items() if d in v})
    elif owner is not None:
        picture = grid(owner, m.edges[m.dims[0]], m.edges[m.dims[1]], list(m.splits),
                       dims=(m.dims[0], m.dims[1]), spans=spans)
    info = [("dims", ", ".join(f"{d} ({m.sizes[d]}, {len(m.edges[d]) - 1} "
                               + (f"blocks of {m.block[d]})" if d in m.block else "chunk blocks)") for d in m.dims)),
            ("method", m.method + ("" if m.method == "ranges" else
                                   ", contiguous" if m.contiguous else ", random")),
            ("gap", f"{m.gap} chunk block{'s' if m.gap != 1 else ''}"), ("seed", str(m.seed)),
            ("fingerprint", m.fingerprint[:12])]
    if m.snapshot:
        info.append(("snapshot", m.snapshot))
    if m.stats:
        info.append(("stats", f"{len(m.stats.get('channels', m.stats))} channels "
                              f"from split {m.stats.get('split', '?')!r}"))
    return [Section("Splits", header, rows, extra_html=picture, summary=f"({len(m.splits)})"),
            Section("Manifest", (), info, collapsed=True)]


