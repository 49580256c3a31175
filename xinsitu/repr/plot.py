"""Draw a ``SplitManifest`` with matplotlib: a timeline for one split dim, a grid for two.

matplotlib is optional (``pip install xinsitu[plot]``) and imported only when drawing.
Colours are those of the HTML repr (``xinsitu.repr.formatting.SPLIT_COLORS``); chunk blocks left
out (gaps) are hatched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from xinsitu.repr import formatting

if TYPE_CHECKING:
    from matplotlib.axes import Axes

#: an ``index.manifest.SplitManifest``, duck-typed (see ``formatting.ManifestLike``)
ManifestLike = Any

#: Draw chunk-block edges where there are at most this many blocks along a dim.
MAX_EDGE_LINES = 64


def plot_manifest(m: ManifestLike, ax: Axes | None = None) -> Axes:
    """Draw which chunk blocks each split owns.

    One split dim: a timeline along the dim (in positions), one coloured span per run
    of chunk blocks of a split, gaps hatched, each split's first and last label written
    in its span and in the legend. Two split dims: a grid of chunk blocks (first dim
    down, second across), drawn to scale. ``SplitManifest.plot`` forwards here.

    Parameters
    ----------
    m : ManifestLike
        The manifest (from ``ds.insitu.split``).
    ax : matplotlib.axes.Axes, optional
        Where to draw; a new figure is made when omitted.

    Returns
    -------
    matplotlib.axes.Axes
        The Axes drawn on.

    Raises
    ------
    ValueError
        If the manifest splits more than two dims.
    ImportError
        If matplotlib is not installed.

    Examples
    --------
    >>> m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1}, gap=1)
    >>> ax = plot_manifest(m)  # or m.plot()
    """
    if len(m.dims) > 2:
        raise ValueError(f"plot_manifest draws one or two split dims; this manifest splits {len(m.dims)} "
                         f"({', '.join(m.dims)}): print it, or use m.summary()")
    if len(m.dims) == 1:
        size = (9.0, 2.0)
    else:  # the grid keeps its aspect (to scale, in positions); room on the right for the legend
        h, w = (m.sizes[d] for d in m.dims)
        size = (7.0, float(np.clip(4.5 * h / max(w, 1), 2.0, 6.0)) + 1.0)
    ax = _axes(ax, size)
    owner = m.owner()
    if len(m.dims) == 1:
        _timeline(m, owner, ax)
    else:
        _grid(m, owner, ax)
    return ax


def _axes(ax: Axes | None, size: tuple[float, float]) -> Axes:
    if ax is not None:
        return ax
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("plotting needs matplotlib: pip install matplotlib (or xinsitu[plot])") from e
    _, ax = plt.subplots(figsize=size, layout="constrained")
    return ax


def _short(label: Any) -> str:
    """A coordinate label, short: midnight times lose their clock, floats their noise."""
    if isinstance(label, float):
        return f"{label:g}"
    s = str(label)
    return s[:-9] if s.endswith("T00:00:00") else s.replace("T", " ")


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _legend(m: ManifestLike, ax: Axes, gaps: bool, loc: str) -> None:
    from matplotlib.patches import Patch

    handles = []
    for i, name in enumerate(m.splits):
        n = len(m.splits[name])
        handles.append(Patch(facecolor=formatting.split_color(i), label=f"{name} ({_count(n, 'chunk')})"))
    if gaps:
        handles.append(Patch(facecolor="none", edgecolor=formatting.GAP_COLOR, hatch="///", label="left out (gap)"))
    ax.legend(handles=handles, loc=loc, frameon=False, fontsize="small",  # type: ignore[call-overload]
              **({"bbox_to_anchor": (1.0, 1.0)} if loc == "upper left" else {}))


def _timeline(m: ManifestLike, owner: np.ndarray, ax: Axes) -> None:
    dim = m.dims[0]
    edges = np.asarray(m.edges[dim], dtype=np.int64)
    total = int(edges[-1] - edges[0])
    pieces = formatting.runs(owner)
    nruns = np.bincount([o + 1 for o, _, _ in pieces], minlength=len(m.splits) + 1)
    names = list(m.splits)
    gaps = False
    for o, a, b in pieces:
        x0, w = int(edges[a]), int(edges[b] - edges[a])
        if o < 0:
            gaps = True
            ax.broken_barh([(x0, w)], (0, 1), facecolors="none", edgecolors=formatting.GAP_COLOR, hatch="///",
                           linewidth=0)
            continue
        ax.broken_barh([(x0, w)], (0, 1), facecolors=formatting.split_color(o), linewidth=0)
        if w < 0.06 * total:  # too narrow to write in
            continue
        text = names[o]
        lab = m.labels.get(names[o], {}).get(dim)
        if lab and nruns[o + 1] == 1 and w >= 0.15 * total:  # one run: the split's labels are this run's
            text += f"\n{_short(lab[0])} – {_short(lab[1])}"
        ax.text(x0 + w / 2, 0.5, text, ha="center", va="center", color="white", fontsize="small",
                clip_on=True)
    if len(owner) <= MAX_EDGE_LINES:
        ax.vlines(edges[1:-1], 0, 1, colors="white", linewidth=0.6)
    ax.set_xlim(edges[0], edges[-1])
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    span = m.extra.get("coords", {}).get(dim)
    ax.set_xlabel(f"{dim} (position)" + (f": {_short(span[0])} … {_short(span[1])}" if span else ""))
    ax.set_title(f"split on {dim}: {_count(len(owner), 'chunk block')}, gap {m.gap}", fontsize="medium")
    _legend(m, ax, gaps, "upper left")


def _grid(m: ManifestLike, owner: np.ndarray, ax: Axes) -> None:
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Rectangle

    rd, cd = m.dims
    re_ = np.asarray(m.edges[rd], dtype=np.int64)
    ce = np.asarray(m.edges[cd], dtype=np.int64)
    n = len(m.splits)
    cmap = ListedColormap([formatting.split_color(i) for i in range(n)])
    gaps = bool((owner < 0).any())
    if gaps:  # hatched background shows through the masked (left out) blocks
        ax.add_patch(Rectangle((ce[0], re_[0]), ce[-1] - ce[0], re_[-1] - re_[0], facecolor="none",
                               edgecolor=formatting.GAP_COLOR, hatch="///", linewidth=0, zorder=0))
    lines = max(owner.shape) <= MAX_EDGE_LINES
    ax.pcolormesh(ce, re_, np.ma.masked_less(owner, 0), cmap=cmap, vmin=-0.5, vmax=n - 0.5,
                  edgecolors="white" if lines else "face", linewidth=0.5 if lines else 0, zorder=1)
    ax.set_xlim(ce[0], ce[-1])
    ax.set_ylim(re_[-1], re_[0])  # first position at the top, as an image (e.g. lat 90 .. -90)
    ax.set_aspect("equal" if 0.2 < (re_[-1] - re_[0]) / max(ce[-1] - ce[0], 1) < 5 else "auto")
    coords = m.extra.get("coords", {})
    for d, setter in ((rd, ax.set_ylabel), (cd, ax.set_xlabel)):
        span = coords.get(d)
        setter(f"{d} (position)" + (f": {_short(span[0])} … {_short(span[1])}" if span else ""))
    ax.set_title(f"split on {rd} x {cd}: {owner.shape[0]} x {owner.shape[1]} chunk blocks", fontsize="medium")
    _legend(m, ax, gaps, "upper left")
