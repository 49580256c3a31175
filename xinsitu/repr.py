"""One list of sections per object feeds both its text ``repr`` and its ``_repr_html_``."""

from __future__ import annotations

import html as _html
from dataclasses import dataclass, field
from functools import cache
from importlib import resources


@dataclass
class Section:
    """A titled table (header + rows of strings), or key/value lines when ``header`` is empty."""

    title: str
    header: tuple[str, ...] = ()
    rows: list[tuple[str, ...]] = field(default_factory=list)
    extra_html: str = ""  # e.g. a timeline drawing, shown under the table in HTML only


def text(title: str, sections: list[Section]) -> str:
    """Plain, aligned text: short enough for a terminal."""
    out = [f"<{title}>"]
    for s in sections:
        out.append(f"{s.title}:")
        table = [s.header, *s.rows] if s.header else list(s.rows)
        if not table:
            continue
        widths = [max(len(r[i]) for r in table if i < len(r)) for i in range(max(len(r) for r in table))]
        for r in table:
            out.append("    " + "  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
    return "\n".join(out)


@cache
def _css() -> str:
    return resources.files("xinsitu").joinpath("static/style.css").read_text()


def html(title: str, sections: list[Section], fallback: str) -> str:
    """HTML with collapsible sections (checkbox + label, no JavaScript) and a text fallback."""
    parts = [f"<style>{_css()}</style>", "<div class='xi-wrap'>",
             f"<pre class='xi-text-repr-fallback'>{_html.escape(fallback)}</pre>",
             f"<div class='xi-root' hidden><div class='xi-title'>{_html.escape(title)}</div>"]
    for i, s in enumerate(sections):
        sid = f"xi-{id(sections)}-{i}"
        parts.append(f"<input id='{sid}' class='xi-toggle' type='checkbox' checked>"
                     f"<label for='{sid}' class='xi-section'>{_html.escape(s.title)}</label><div class='xi-body'>")
        if s.rows:
            parts.append("<table class='xi-table'>")
            if s.header:
                parts.append("<tr>" + "".join(f"<th>{_html.escape(h)}</th>" for h in s.header) + "</tr>")
            for r in s.rows:
                parts.append("<tr>" + "".join(f"<td>{_html.escape(c)}</td>" for c in r) + "</tr>")
            parts.append("</table>")
        parts.append(s.extra_html + "</div>")
    parts.append("</div></div>")
    return "".join(parts)
