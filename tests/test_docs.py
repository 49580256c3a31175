"""The documentation builds with ``mkdocs build --strict`` (any warning fails), and what it
says about the command line and about planned features matches the code."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


@pytest.mark.tools
def test_docs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is needed to build the docs")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is needed for the API reference")
    site = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                        "--site-dir", str(site)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log
    assert "WARNING" not in log, log
    api = (site / "api" / "index.html").read_text()
    for name in ("open_zarr", "InsituAccessor", "SplitManifest", "BatchGenerator", "plot_manifest", "ChunkReadError"):
        assert re.search(rf'id="xinsitu\.(\w+\.)?{name}"', api), f"{name} missing from the API reference"
    for page in ("getting-started", "concepts", "comparison", "how-to/remote", "how-to/distributed",
                 "how-to/resume", "how-to/windows-patches", "how-to/gpu", "how-to/netcdf", "how-to/cli"):
        assert (site / page / "index.html").is_file(), page


def _doc_commands() -> list[list[str]]:
    cmds = []
    for md in sorted(DOCS.rglob("*.md")):
        for found in re.findall(r"python -m xinsitu ([^`\n]+)", md.read_text()):
            cmds.append(shlex.split(found.rstrip(".)").replace("URL", "data/era5.zarr")))
    return cmds


def test_documented_commands_parse() -> None:
    """Every ``python -m xinsitu ...`` line in the docs is accepted by the real parser."""
    from xinsitu.cli import build_parser

    cmds = _doc_commands()
    assert any(c[0] == "inspect" for c in cmds) and any(c[0] == "bench" for c in cmds)
    parser = build_parser()
    for c in cmds:
        args = parser.parse_args(c)
        assert args.command == c[0]


def test_planned_markers_match_the_code() -> None:
    """A feature the docs call planned is not built yet, and a built one is not called planned."""
    from xinsitu.accessor import InsituAccessor

    normalize = (DOCS / "how-to" / "normalize.md").read_text()
    planned = '!!! note "Planned: `ds.insitu.stats` and `normalize=`"' in normalize
    built = hasattr(InsituAccessor, "stats")
    assert planned != built, ("ds.insitu.stats exists now: update docs/how-to/normalize.md" if built else
                              "docs/how-to/normalize.md documents ds.insitu.stats as built, but it is not")


def test_install_names_every_extra_and_the_cpu_build_of_torch() -> None:
    """Getting started's Install lists every extra of pyproject.toml, and it and the README say how to
    get PyTorch's CPU build (the default wheel brings gigabytes of CUDA libraries a CPU never uses)."""
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    gs = (DOCS / "getting-started.md").read_text()
    install = gs.split("## Install", 1)[1].split("\n## ", 1)[0]
    missing = sorted(e for e in extras - {"bench"} if f"`{e}`" not in install)
    assert not missing, f"getting-started.md's Install does not list the extras {missing}"
    cpu = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in install
    readme = (ROOT / "README.md").read_text()
    assert cpu in readme and "pip install 'xinsitu[torch]'" in readme
