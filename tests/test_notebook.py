"""The quickstart notebook runs, top to bottom, in a real Jupyter kernel of this interpreter."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is needed to read the notebook")
nbclient = pytest.importorskip("nbclient", reason="nbclient is needed to execute the notebook")
pytest.importorskip("ipykernel", reason="ipykernel is needed to run a Jupyter kernel")
pytest.importorskip("torch", reason="the notebook trains a torch model")
pytest.importorskip("matplotlib", reason="the notebook plots")

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "quickstart.ipynb"
KERNEL = "xinsitu-test"


@pytest.fixture
def kernel_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A kernelspec that starts *this* interpreter (so the notebook imports this checkout's
    xinsitu, whatever kernels the user has installed)."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "xinsitu tests",
                                                  "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    return KERNEL


def test_notebook_is_committed_without_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "the notebook has no code cells"
    for c in code:
        assert not c.get("outputs") and c.get("execution_count") is None, f"cell with outputs: {c.source[:60]!r}"


@pytest.mark.tools
def test_notebook_runs(kernel_name: str, tmp_path: Path) -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # proves which interpreter ran it
    nb.cells.append(nbformat.v4.new_code_cell("import sys, xinsitu; print(sys.executable); print(xinsitu.__file__)"))
    client = nbclient.NotebookClient(nb, kernel_name=kernel_name, timeout=120,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on the first cell that errors (a cell past 120 s: a hang)

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    exe, mod = outputs[-1]["text"].split()[:2]
    assert Path(exe) == Path(sys.executable)
    import xinsitu

    assert Path(mod) == Path(xinsitu.__file__)

    html = [o["data"]["text/html"] for o in outputs if o.output_type == "execute_result" and "text/html" in o["data"]]
    rich = "".join(html)
    for title in ("xinsitu.Geometry", "xinsitu.SplitManifest", "xinsitu.BatchGenerator"):
        assert title in rich, f"no rich repr of {title} in the notebook's outputs"
    assert "class='xi-timeline'" in rich  # the split timeline
    assert "<xarray.Dataset" in "".join(o["data"].get("text/plain", "") for o in outputs if "data" in o)
    images = [o for o in outputs if "data" in o and "image/png" in o["data"]]
    assert len(images) >= 2, "expected the split plot and the t2m map"
    # the resume cell evaluates to True only when the resumed batches equal the uninterrupted ones
    results = [o["data"]["text/plain"] for o in outputs if o.output_type == "execute_result"]
    assert "True" in results


@pytest.mark.tools
@pytest.mark.parametrize("widgets", [True, False])
def test_progress_in_a_notebook(kernel_name: str, tmp_path: Path, widgets: bool) -> None:
    """``progress=True`` in Jupyter: a widget where ipywidgets is installed (the ``notebook`` extra); a
    text bar without it, and no tqdm warning that it is missing (there was one, before any bar)."""
    if widgets:
        pytest.importorskip("ipywidgets")
    block = "" if widgets else "import sys; sys.modules['ipywidgets'] = None  # as if not installed\n"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(block + (
        "import xinsitu\n"
        "from xinsitu.synthetic import era5_like\n"
        "ds = era5_like(nt=24, ny=4, nx=8).chunk(time=4)\n"
        "m = ds.insitu.split('time', fractions={'train': 0.5, 'val': 0.5})\n"
        "n = sum(1 for _ in ds.insitu.batches(m, 'train', batch_size=4, progress=True))\n"
        "print('batches', n)"))])
    nbclient.NotebookClient(nb, kernel_name=kernel_name, timeout=120,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = nb.cells[0].outputs
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "batches 3" in text and "IProgress not found" not in text and "Warning" not in text, text
    views = [o for o in outputs if "data" in o and "application/vnd.jupyter.widget-view+json" in o["data"]]
    assert bool(views) == widgets, outputs
    if not widgets:
        assert "train epoch 0" in text  # the text bar, on stderr
