"""The package's layout, read from the source: four layers, no import cycle.

A module imports only from its own layer or below. Imports inside functions count (a lazy
import is still a dependency); imports under ``if TYPE_CHECKING:`` do not (annotations only),
the same rule as ``shared/tools/cycles.py``. Every module must be in ``LAYERS``: a new module
says where it belongs.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "xinsitu"

#: module -> layer. 1: metadata and pure math (no I/O, no threads); 2: I/O; 3: batches; 4: surface.
LAYERS = {
    # 1 -- metadata and pure math
    "source": 1, "geometry": 1, "manifest": 1, "split": 1, "sampling": 1, "shuffle": 1, "plan": 1,
    "channels": 1, "state": 1, "snapshot": 1, "xr_adapter": 1, "regions": 1,
    # ``formatting`` (every repr) and ``plot`` (the manifest's drawing) are presentation, listed under
    # "surface" in issue 17, but they sit here: they are pure string (or matplotlib) building that takes
    # the objects duck-typed (their types only under TYPE_CHECKING), and the layer-1 records call them
    # from ``__repr__``/``SplitManifest.plot``: in layer 4 those calls would point upward.
    "formatting": 1, "plot": 1,
    # the adapters to private API of zarr and VirtualiZarr (metadata only: no I/O of their own)
    "compat_zarr": 1, "compat_virtualizarr": 1,
    # 2 -- I/O
    "_loop": 2, "store": 2, "redact": 2, "store_reads": 2, "backend": 2, "virtual_backend": 2, "zarr_backend": 2,
    "codecs": 2, "reader": 2, "cache": 2,
    "inflight": 2, "decode": 2, "fetchers": 2, "cached": 2, "gpu_decode": 2, "device_cache": 2, "mempool": 2,
    # 3 -- batches
    "buffer": 3, "direct": 3, "device": 3, "output": 3, "pipeline": 3, "loader": 3, "stats": 3, "dataset": 3,
    "validity": 3, "cluster": 3,
    # ``torch`` (the IterableDataset over a generator, public generator methods only) is listed under
    # "surface" in issue 17, but ``BatchGenerator.to_torch()`` (public API) makes it: an adapter of the
    # batches layer, importing nothing above it.
    "torch": 3,
    # 4 -- surface
    "accessor": 4, "references": 4, "virtual": 4, "grib": 4, "netcdf3": 4, "cli": 4, "synthetic": 4,
    "__init__": 4, "__main__": 4,
}

#: Known violations, (importer, imported). Empty since step 2 of issue 17; nothing may be added.
#: Imports from a higher layer:
ALLOWED: set[tuple[str, str]] = set()
#: Edges of import cycles (the cycle check leaves them out):
ALLOWED_CYCLE_EDGES: set[tuple[str, str]] = set()


def _imports(path: Path) -> set[str]:
    """The ``xinsitu`` modules ``path`` imports (by module name; the package itself as ``__init__``)."""
    modules = {p.stem for p in PKG.glob("*.py")}
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for n in node.orelse:
                visit(n)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "xinsitu":
                    out.add(parts[1] if len(parts) > 1 else "__init__")
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:  # relative: the package is flat
                mod = "xinsitu" + ("." + mod if mod else "")
            parts = mod.split(".")
            if parts[0] == "xinsitu":
                if len(parts) > 1:
                    out.add(parts[1])
                else:  # from xinsitu import x: a module, or a name of the package face
                    out.update(a.name if a.name in modules else "__init__" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    out.discard(path.stem)
    return out


def _graph() -> dict[str, set[str]]:
    return {p.stem: _imports(p) for p in sorted(PKG.glob("*.py"))}


def test_every_module_has_a_layer() -> None:
    modules = {p.stem for p in PKG.glob("*.py")}
    assert not list(PKG.glob("*/*.py")), "the package is flat: give a subpackage's modules layers here"
    assert modules - set(LAYERS) == set(), "new module(s) without a layer: add them to LAYERS"
    assert set(LAYERS) - modules == set(), "LAYERS names module(s) that no longer exist"


def test_imports_go_down_the_layers() -> None:
    bad = sorted((m, d) for m, deps in _graph().items() for d in deps
                 if d in LAYERS and LAYERS[d] > LAYERS[m] and (m, d) not in ALLOWED)
    assert bad == [], "imports from a higher layer: " + ", ".join(
        f"{m} (layer {LAYERS[m]}) -> {d} (layer {LAYERS[d]})" for m, d in bad)


def test_allow_list_is_current() -> None:
    """An allowed violation that is gone must leave the list (it only shrinks)."""
    g = _graph()
    stale = sorted((m, d) for m, d in ALLOWED | ALLOWED_CYCLE_EDGES if d not in g.get(m, set()))
    assert stale == [], f"no longer imported, remove from ALLOWED: {stale}"


def test_no_import_cycle() -> None:
    g = {m: {d for d in deps if d != "__init__" and (m, d) not in ALLOWED_CYCLE_EDGES}
         for m, deps in _graph().items() if m != "__init__"}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def strong(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
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
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strong(v)
    assert cycles == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)
