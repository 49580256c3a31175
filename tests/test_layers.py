"""The package's layout, read from the source: the folders are the layers.

``xinsitu/<folder>/`` holds the modules of one layer (``FOLDERS``); the surface -- the accessor, the
command line, the public faces ``xinsitu.virtual`` and ``xinsitu.synthetic`` and the documented paths
``xinsitu.grib``, ``xinsitu.torch``, ``xinsitu.dataset``, ``xinsitu.plot`` (re-exports) -- sits at the top. A
module imports only from its own layer or below. Imports inside functions count (a lazy import is still
a dependency); imports under ``if TYPE_CHECKING:`` (annotations only) do not make a runtime cycle, but
they may not tie more than ``MAX_ANNOTATION_CIRCLE`` files into a circle either. A name with a leading
underscore is private to its folder: no module imports one from another folder.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "xinsitu"

#: folder -> layer. 1: metadata and pure math (no I/O, no threads); 2: I/O; 3: batches; 4: surface.
FOLDERS = {
    "index": 1,  # split, manifest, sampling, plans, shuffles, channels: pure index math on numpy arrays
    "repr": 1,  # text and HTML reprs, the manifest's drawing: string building over duck-typed objects
    "compat": 1,  # the adapters to private API of zarr and VirtualiZarr (metadata only)
    "stores": 2,  # opening a URL or store, the backends, retries and deadlines, redaction
    "codecs": 2,  # a chunk's bytes to values: on the CPU, on the GPU
    "io": 2,  # the I/O loop, the reader and its one completion step, fetchers, the in-flight limit
    "cache": 2,  # the chunk cache: keys and versions, memory and disk tiers, the device tier, lookups
    "batches": 3,  # buffers, batches filled in place, the pipeline, outputs, generator, map-style, stats
    "formats": 4,  # files read in place: virtual references, GRIB, NetCDF-3
}
#: modules at the top of the package: the surface
TOP = {"__init__": 4, "__main__": 4, "accessor": 4, "cli": 4, "cli_bench": 4, "virtual": 4, "synthetic": 4,
       # the public faces of documented paths (``from xinsitu.grib import write_grib``): re-exports only
       "grib": 4, "torch": 4, "dataset": 4, "plot": 4}
#: files an annotation-only circle may tie together at most
MAX_ANNOTATION_CIRCLE = 3


def _modules() -> dict[str, Path]:
    """Every module, by its dotted name under ``xinsitu`` (a folder's face as the folder's name)."""
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def layer(mod: str) -> int:
    head = mod.split(".")[0]
    return FOLDERS[head] if head in FOLDERS else TOP[mod]


def _imports(path: Path, mods: set[str], annotations: bool = False) -> dict[str, set[str]]:
    """``{module imported: names taken from it}`` (``annotations``: only those under TYPE_CHECKING)."""
    out: dict[str, set[str]] = {}

    def add(mod: str, names: set[str]) -> None:
        out.setdefault(mod, set()).update(names)

    def visit(node: ast.AST, typing: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for n in node.body:
                visit(n, True)
            for n in node.orelse:
                visit(n, typing)
            return
        if typing == annotations:
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("xinsitu."):
                        name = a.name[len("xinsitu."):]
                        if name in mods:
                            add(name, set())
            elif isinstance(node, ast.ImportFrom) and not node.level:
                base = node.module or ""
                if base == "xinsitu" or base.startswith("xinsitu."):
                    base = base[len("xinsitu."):] if base != "xinsitu" else "__init__"
                    for a in node.names:
                        sub = f"{base}.{a.name}" if base != "__init__" else a.name
                        if sub in mods:  # a module named in a from-import
                            add(sub, set())
                        elif base in mods:
                            add(base, {a.name})
        for child in ast.iter_child_nodes(node):
            visit(child, typing)

    visit(ast.parse(path.read_text(), str(path)), False)
    return out


def _graph(annotations: bool = False) -> dict[str, dict[str, set[str]]]:
    mods = _modules()
    g = {m: _imports(p, set(mods), annotations) for m, p in mods.items()}
    for m, deps in g.items():
        deps.pop(m, None)
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strong(v)
    return out


def test_every_module_is_in_a_layer_folder() -> None:
    mods = _modules()
    stray = sorted(m for m in mods if "." not in m and m not in TOP and m not in FOLDERS)
    assert stray == [], f"modules outside the layer folders: {stray} (put each in the folder of its layer)"
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(FOLDERS), f"folders {sorted(folders ^ set(FOLDERS))}: give each a layer in FOLDERS"
    for name in FOLDERS:
        doc = ast.get_docstring(ast.parse((PKG / name / "__init__.py").read_text()))
        assert doc and len(doc) > 80, f"xinsitu/{name}/__init__.py says in a paragraph what the folder holds"


def test_imports_go_down_the_layers() -> None:
    bad = sorted((m, d) for m, deps in _graph().items() for d in deps if layer(d) > layer(m))
    assert bad == [], "imports from a higher layer: " + ", ".join(
        f"{m} (layer {layer(m)}) -> {d} (layer {layer(d)})" for m, d in bad)


def test_no_import_cycle() -> None:
    g = {m: {d for d in deps if d != "__init__"} for m, deps in _graph().items() if m != "__init__"}
    cycles = _cycles(g)
    assert cycles == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_annotation_imports_make_no_wide_circle() -> None:
    """Annotation-only imports, with the runtime ones: no circle of more than three files."""
    run, ann = _graph(), _graph(annotations=True)
    g = {m: {d for d in set(run[m]) | set(ann.get(m, ())) if d != "__init__"} for m in run if m != "__init__"}
    wide = [c for c in _cycles(g) if len(c) > MAX_ANNOTATION_CIRCLE]
    assert wide == [], "circles of annotation imports: " + "; ".join(" <-> ".join(c) for c in wide)


def test_no_private_name_crosses_a_folder() -> None:
    def folder(m: str) -> str:
        return m.split(".")[0] if m.split(".")[0] in FOLDERS else ""

    bad = sorted((m, d, n) for kind in (False, True) for m, deps in _graph(kind).items()
                 for d, names in deps.items() for n in names
                 if n.startswith("_") and not n.startswith("__") and folder(m) != folder(d))
    assert bad == [], "private names imported from another folder: " + ", ".join(
        f"{m} takes {n} from {d}" for m, d, n in bad)


def test_readme_layout_names_every_folder_and_module() -> None:
    """The README's layout table is the house as it is: each folder at its layer, with all its modules."""
    text = (PKG.parent / "README.md").read_text()
    table = text[text.index("## Layout"):].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            folder = cells[1].strip("`/")
            rows[folder] = (int(cells[0]), {m.strip(" `") for m in cells[2].split(",")})
    want = {name: (lay, {p.stem for p in (PKG / name).glob("*.py") if p.stem != "__init__"})
            for name, lay in FOLDERS.items()}
    want["xinsitu"] = (4, {m for m in TOP if not m.startswith("__")})
    assert rows == want, "README.md's layout table differs from the package: " + ", ".join(
        f"{k}: README {rows.get(k)} package {want.get(k)}" for k in sorted(set(rows) | set(want))
        if rows.get(k) != want.get(k))
