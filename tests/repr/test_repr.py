"""Reprs (text and HTML from one list of sections) and the split drawings (HTML and matplotlib)."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import numpy as np
import pytest

import xinsitu
from xinsitu.index.split import SplitManifest
from xinsitu.repr import formatting as xr_repr
from xinsitu.synthetic import era5_like

VOID = {"input", "br", "hr", "img", "meta", "link", "col", "wbr"}


class _Checker(HTMLParser):
    """Balanced tags, unique ids, every label pointing at an existing checkbox."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.ids: list[str] = []
        self.fors: list[str] = []
        self.checkboxes: list[dict] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if "id" in a:
            self.ids.append(a["id"])
        if tag == "label" and "for" in a:
            self.fors.append(a["for"])
        if tag == "input":
            self.checkboxes.append(a)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if "id" in a:
            self.ids.append(a["id"])

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
        else:
            self.stack.pop()


def check_html(h: str) -> _Checker:
    c = _Checker()
    c.feed(h)
    c.close()
    assert not c.errors and not c.stack, (c.errors, c.stack)
    assert len(set(c.ids)) == len(c.ids), "duplicate ids"
    assert set(c.fors) <= set(c.ids), "a label points at no checkbox"
    assert "<script" not in h.lower()  # no JavaScript
    return c


def fallback_of(h: str) -> str:
    m = re.search(r"<pre class='xi-text-repr-fallback'>(.*?)</pre>", h, re.S)
    assert m, "no text fallback"
    return m.group(1)


# ----------------------------------------------------------------------------- primitives
def sections() -> list[xr_repr.Section]:
    return [xr_repr.Section("Dims", ("dim", "length"), [("time", "480"), ("lat", "16")], summary="(2)"),
            xr_repr.Section("Info", (), [("seed", "0"), ("<b>evil</b>", "a & b")]),
            xr_repr.Section("Long", ("n",), [(str(i),) for i in range(xr_repr.FOLD_ROWS + 1)]),
            xr_repr.Section("Empty")]


def test_text_is_aligned_and_ordered() -> None:
    t = xr_repr.text("xinsitu.Thing", sections(), "a summary")
    lines = t.splitlines()
    assert lines[0] == "<xinsitu.Thing> a summary"
    assert lines[1] == "Dims: (2)"
    assert lines[2] == "    dim   length" and lines[3] == "    time  480"
    assert [ln for ln in lines if not ln.startswith(" ")] == ["<xinsitu.Thing> a summary", "Dims: (2)", "Info:",
                                                              "Long:", "Empty:"]


def test_html_structure_fallback_and_escaping() -> None:
    secs = sections()
    fallback = xr_repr.text("xinsitu.Thing", secs, "a <summary>")
    h = xr_repr.html("xinsitu.Thing", secs, fallback, "a <summary>")
    c = check_html(h)
    # the escaped text repr, for untrusted notebooks (no <style>: the rich part stays hidden)
    assert fallback_of(h) == fallback.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    assert "<div class='xi-wrap' style='display:none'>" in h
    assert "<b>evil</b>" not in h and "&lt;b&gt;evil&lt;/b&gt;" in h and "a &amp; b" in h
    # collapsible sections: checkbox + label; long ones start folded, empty ones can't open
    boxes = {b["id"]: b for b in c.checkboxes}
    assert len(boxes) == len(secs) and all(b["type"] == "checkbox" for b in boxes.values())
    states = [("checked" in b, "disabled" in b) for b in c.checkboxes]
    assert states == [(True, False), (True, False), (False, False), (False, True)]
    assert h.count("<table class='xi-table'>") == 3
    # two renders never share an id (a label would fold the other output)
    assert not set(check_html(xr_repr.html("x", secs, "x")).ids) & set(c.ids)


def test_css_packaged_loaded_once_with_theme_support() -> None:
    xr_repr._css.cache_clear()
    h1 = xr_repr.html("x", sections(), "x")
    xr_repr.html("x", sections(), "x")
    assert xr_repr._css.cache_info().misses == 1
    css = xr_repr._css()
    assert css in h1
    assert "--jp-content-font-color0" in css and "--jp-layout-color0" in css  # JupyterLab variables
    assert 'html[theme="dark"]' in css and "body.vscode-dark" in css  # dark themes elsewhere
    assert re.search(r"\.xi-wrap \{[^}]*display: block !important", css)
    assert re.search(r"\.xi-text-repr-fallback \{[^}]*display: none", css)
    assert ".xi-section-in:checked ~ .xi-section-body" in css


def test_runs_and_bytes() -> None:
    assert xr_repr.runs(np.array([0, 0, -1, 1, 1, 1])) == [(0, 0, 2), (-1, 2, 3), (1, 3, 6)]
    assert xr_repr.runs(np.array([], dtype=int)) == []
    assert [xr_repr.fmt_bytes(n) for n in (999, 1000, 49152, 3.1e6, 2e12)] == ["999 B", "1.0 kB", "49.2 kB",
                                                                                 "3.1 MB", "2.0 TB"]


def test_timeline_to_scale_with_gaps_and_labels() -> None:
    owner = np.array([0, 0, 0, -1, 1, -1, 2])
    edges = np.array([0, 10, 20, 30, 40, 50, 60, 65])  # last chunk partial
    h = xr_repr.timeline(owner, edges, ["train", "val", "test"], dim="time",
                         labels={"train": ("1979-01-01", "1979-01-08"), "val": ("a", "b"), "test": ("c", "d")},
                         span=("1979-01-01", "1979-02-01"))
    check_html(h)
    grows = [float(g) for g in re.findall(r"flex-grow:([0-9.]+)", h)]
    assert grows == [30, 10, 10, 10, 5]  # positions, not chunk counts
    assert h.count("xi-seg xi-seg-gap") == 2
    assert "train: 1979-01-01 .. 1979-01-08, chunk blocks 0..2, positions 0..29" in h
    assert xr_repr.split_color(0) in h and xr_repr.split_color(2) in h
    assert "1979-02-01" in h and "left out (gap)" in h


def test_timeline_bins_very_long_random_splits() -> None:
    owner = np.random.default_rng(0).integers(0, 2, 20_000)
    h = xr_repr.timeline(owner, np.arange(20_001), ["a", "b"], dim="time")
    assert h.count("class='xi-seg") <= xr_repr.MAX_SEGMENTS and "binned" in h
    grows = [float(g) for g in re.findall(r"flex-grow:([0-9.]+)", h)]
    assert sum(grows) == 20_000


def test_grid_svg_to_scale_and_sampled_when_large() -> None:
    owner = np.array([[0, 0, 1], [-1, 1, 1]])
    h = xr_repr.grid(owner, [0, 4, 6], [0, 8, 16, 20], ["train", "val"], dims=("lat", "lon"),
                     spans={"lat": ("90", "-90")})
    check_html(h)
    assert "viewBox='0 0 20 6'" in h
    rects = re.findall(r"<rect x='(\d+)' y='(\d+)' width='(\d+)' height='(\d+)' fill='([^']+)'/>", h)
    assert ("0", "0", "16", "4", xr_repr.split_color(0)) in rects  # one rect per run in a row
    assert any(r[4].startswith("url(#") for r in rects)  # the gap, hatched
    assert "lat 90 … -90" in h
    big = xr_repr.grid(np.zeros((500, 300), int), np.arange(501), np.arange(301), ["a"])
    assert "(sampled)" in big and len(big) < 200_000


# ----------------------------------------------------------------------------- objects
@pytest.fixture(scope="module")
def ds2d():
    return era5_like(nt=16, ny=16, nx=32).chunk({"time": 8, "lat": 4, "lon": 8})


def _same_sections(obj: object) -> None:
    """Text and HTML show the same sections, in the same order; the text stays short."""
    t, h = repr(obj), obj._repr_html_()
    check_html(h)
    assert fallback_of(h) == t.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("'", "&#x27;")
    titles = [s.title for s in xr_repr.sections(obj)]
    assert re.findall(r"class='xi-section-label'>([^<]+)<", h) == titles
    assert [ln.split(":")[0] for ln in t.splitlines()[1:] if not ln.startswith(" ")] == titles
    assert len(t.splitlines()) <= 40 and max(map(len, t.splitlines())) <= 160


def test_geometry_repr(era5_path: str) -> None:
    g = xinsitu.open_zarr(era5_path).insitu.geometry
    _same_sections(g)
    t = repr(g)
    assert t.startswith("<xinsitu.Geometry> 6 variables, chunked along time (15 chunks)")
    assert "zstd" in t and "int16" in t and "kB" in t


def test_manifest_repr_one_dim(era5_path: str) -> None:
    m = xinsitu.open_zarr(era5_path).insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1}, gap=1)
    _same_sections(m)
    t, h = repr(m), m._repr_html_()
    assert "1979-01-01T00:00:00" in t and "(left out)" in t
    assert "class='xi-timeline'" in h and h.count("class='xi-seg xi-seg-gap'") == 2
    assert len(re.findall(r"class='xi-seg' style", h)) == 3  # one span per contiguous split


def test_manifest_repr_two_dims_is_a_grid(ds2d) -> None:
    m = ds2d.insitu.split(["lat", "lon"], fractions={"train": 0.75, "val": 0.25}, seed=0)
    _same_sections(m)
    h = m._repr_html_()
    assert "<svg class='xi-grid'" in h and "class='xi-timeline'" not in h
    assert "viewBox='0 0 32 16'" in h


def test_generator_repr(era5_path: str) -> None:
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    gen = ds.insitu.batches(m, "train", batch_size=16, window={"time": 2}, output="numpy")
    _same_sections(gen)
    t = repr(gen)
    assert t.startswith(f"<xinsitu.BatchGenerator> 'train': {len(gen)} batches of 16")
    assert "quality" in t and "window of 2" in t and "Last epoch" not in t
    for _ in gen:
        pass
    t = repr(gen)
    assert "Last epoch I/O" in t and f"{gen.io_stats['chunks']} chunks" in t


def test_shuffle_quality_reads_only_the_first_blocks(era5_path: str) -> None:
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    gen = ds.insitu.batches(m, "train", batch_size=8, block_chunks=2)
    q = gen.shuffle_quality(3)
    ids = np.concatenate(gen.batch_ids())[:24]
    units = [gen.space.locate(ids[k:k + 8])[0] for k in range(0, 24, 8)]
    from xinsitu.index.shuffle import quality

    assert q == quality(units, gen.space.counts)
    assert 0 < q <= 1


# ----------------------------------------------------------------------------- matplotlib
mpl = pytest.importorskip("matplotlib", reason="plots need matplotlib")
mpl.use("Agg")


def test_plot_timeline(era5_path: str) -> None:
    import matplotlib.pyplot as plt

    from xinsitu.repr.plot import plot_manifest

    m = xinsitu.open_zarr(era5_path).insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1}, gap=1)
    ax = plot_manifest(m)
    try:
        bars = ax.collections
        assert len(bars) >= 5  # 3 splits and 2 gaps (plus the chunk edge lines)
        spans = [tuple(p.get_paths()[0].get_extents().bounds[::2]) for p in bars if p.get_paths()]
        first = min(spans)
        assert first[0] == 0 and np.isclose(first[1], m.edges["time"][len(m.splits["train"])])
        texts = " ".join(t.get_text() for t in ax.texts)
        assert "train" in texts and "1979-01-01" in texts
        assert [t.get_text() for t in ax.get_legend().get_texts()][-1] == "left out (gap)"
        assert ax.get_xlim() == (0, m.sizes["time"])
    finally:
        plt.close(ax.figure)


def test_plot_grid_on_given_axes(ds2d) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.collections import QuadMesh

    from xinsitu.repr.plot import plot_manifest

    m = ds2d.insitu.split(["lat", "lon"], fractions={"train": 0.75, "val": 0.25}, seed=0)
    fig, ax = plt.subplots()
    try:
        assert plot_manifest(m, ax=ax) is ax
        mesh = [c for c in ax.collections if isinstance(c, QuadMesh)]
        assert len(mesh) == 1
        values = np.asarray(mesh[0].get_array()).reshape(m.grid)
        owner = np.full(m.grid, -1)
        for i, b in enumerate(m.splits.values()):
            owner.flat[np.asarray(b)] = i  # (numpy 2.0 takes no sequence-like object in .flat)
        assert np.array_equal(values, owner)
        assert ax.get_ylim() == (16, 0)  # first position on top
    finally:
        plt.close(fig)


def test_plot_refuses_three_dims() -> None:
    from xinsitu.repr.plot import plot_manifest

    m = SplitManifest(dims=["a", "b", "c"], sizes={"a": 4, "b": 4, "c": 4}, edges={d: [0, 2, 4] for d in "abc"},
                      splits={"x": [0, 1, 2, 3], "y": [4, 5, 6, 7]}, labels={})
    with pytest.raises(ValueError, match="one or two split dims"):
        plot_manifest(m)
