"""The package type-checks: ``mypy xinsitu`` (configured in pyproject.toml) reports no error, and
``py.typed`` ships, so users' type checkers read the annotations."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_py_typed_ships() -> None:
    assert (ROOT / "xinsitu" / "py.typed").is_file()
    assert "py.typed" in (ROOT / "pyproject.toml").read_text()


@pytest.mark.tools
def test_mypy_is_clean(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy is in the dev extra")
    probe = tmp_path / "probe.py"
    probe.write_text("import numpy as np\n\nnp.zeros(3).max()\n")
    got = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", str(probe)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    if got.returncode == 1 and "call-overload" in got.stdout:  # numpy 2.5's stubs: no overload without arguments
        pytest.skip(f"the installed numpy's type stubs reject `np.zeros(3).max()`: {got.stdout.strip()[-300:]}")
    proc = subprocess.run([sys.executable, "-m", "mypy", "xinsitu"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
