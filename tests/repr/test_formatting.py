"""Every repr (``xinsitu.repr.formatting``): one list of sections feeds the text and the HTML repr."""

from __future__ import annotations

import html as _html
import re

import numpy as np
import pytest

import xinsitu  # noqa: F401 - registers ds.insitu
from xinsitu.repr import formatting
from xinsitu.repr.formatting import Section, fmt_bytes, runs
from xinsitu.synthetic import era5_like


@pytest.fixture(scope="module")
def objects():
    ds = era5_like(48, 4, 8).chunk({"time": 6})
    m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25}, gap=1)
    gen = ds.insitu.batches(m, "train", batch_size=4, output="numpy")
    return {"manifest": m, "generator": gen, "geometry": gen.geometry}


def test_text_aligns_columns_and_keeps_section_order():
    out = formatting.text("T", [Section("First", ("a", "bb"), [("xxx", "y")], summary="(1)"), Section("Empty")],
                          summary="hello")
    assert out.splitlines() == ["<T> hello", "First: (1)", "    a    bb", "    xxx  y", "Empty:"]


def test_html_escapes_everything_and_embeds_the_text_as_fallback():
    s = [Section("<b>", ("h",), [("<script>",)])]
    out = formatting.html("x<y", s, fallback="<T> & more")
    assert "<script>" not in out and "&lt;script&gt;" in out and "&lt;b&gt;" in out
    assert f"<pre class='xi-text-repr-fallback'>{_html.escape('<T> & more')}</pre>" in out


@pytest.mark.parametrize("name", ["manifest", "generator", "geometry"])
def test_text_and_html_reprs_show_the_same_sections_in_the_same_order(objects, name):
    obj = objects[name]
    titles = [s.title for s in formatting.sections(obj)]
    assert titles and titles == [s.title for s in formatting.sections(obj, drawing=True)]
    text = repr(obj)
    assert text == formatting.text_repr(obj)
    text_titles = re.findall(r"^([^<\s][^:\n]*):", text, flags=re.M)  # section lines start at column 0
    assert text_titles == titles
    html = obj._repr_html_()
    html_titles = [_html.unescape(t) for t in re.findall(r"class='xi-section-label'>([^<]*)", html)]
    assert html_titles == titles
    assert f"<pre class='xi-text-repr-fallback'>{_html.escape(text)}</pre>" in html  # the text repr, as fallback


@pytest.mark.parametrize(("n", "want"), [(0, "0 B"), (999, "999 B"), (1234567, "1.2 MB"), (5e12, "5.0 TB")])
def test_fmt_bytes(n, want):
    assert fmt_bytes(n) == want


def test_runs():
    assert runs(np.array([2, 2, 0, 1, 1, 1])) == [(2, 0, 2), (0, 2, 3), (1, 3, 6)]
    assert runs(np.array([], dtype=int)) == []
