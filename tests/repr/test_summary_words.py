"""``m.summary()`` and the manifest's repr count a split's units with the same word: chunk blocks."""

from __future__ import annotations

import re

import numpy as np
import xarray as xr


def test_summary_and_repr_say_chunk_blocks():
    ds = xr.Dataset({"t2m": (("time", "x"), np.zeros((40, 3), "f4"))}, coords={"time": np.arange(40)})
    ds = ds.chunk({"time": 4})
    m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
    summary, text = m.summary(), repr(m)
    assert "chunk blocks" in text
    for name, n in (("train", 8), ("val", 2)):
        line = next(ln for ln in summary.splitlines() if ln.strip().startswith(f"{name}:"))
        assert f"{n} chunk blocks" in line, line
    assert not re.search(r"\d+ chunks\b", summary), summary
