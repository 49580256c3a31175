"""xinsitu.repr.plot.plot_manifest: what the drawing of a split says (on the Agg backend)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import xinsitu
from xinsitu.repr.plot import plot_manifest

mpl = pytest.importorskip("matplotlib")
mpl.use("Agg")
plt = pytest.importorskip("matplotlib.pyplot")


@pytest.fixture
def ds(tmp_path) -> xr.Dataset:
    src = xr.Dataset({"a": (("time", "y", "x"), np.zeros((40, 6, 8), "float32"))},
                     coords={"time": pd.date_range("2004-01-01", periods=40, freq="D")})
    p = str(tmp_path / "m.zarr")
    src.to_zarr(p, encoding={"a": {"chunks": (4, 2, 2)}}, zarr_format=3, consolidated=False)
    return xinsitu.open_zarr(p)


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def _legend(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_timeline(ds):
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2}, gap=1)
    ax = plot_manifest(m)
    assert ax.get_xlim() == (0.0, 40.0)
    assert ax.get_title() == f"split on time: 10 chunk blocks, gap {m.gap}"
    counts = {n: len(m.splits[n]) for n in m.splits}
    labels = _legend(ax)
    assert labels[:2] == [f"{n} ({c} chunk{'' if c == 1 else 's'})" for n, c in counts.items()]
    assert (m.owner() < 0).any() and labels[-1] == "left out (gap)"  # gap=1 leaves a block out
    assert sum(counts.values()) + int((m.owner() < 0).sum()) == 10


def test_draws_on_given_axes(ds):
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    _, given = plt.subplots()
    assert plot_manifest(m, ax=given) is given
    assert "left out (gap)" not in _legend(given)


def test_grid_of_two_dims(ds):
    m = ds.insitu.split(["y", "x"], fractions={"train": 0.5, "val": 0.5})
    ax = plot_manifest(m)
    assert ax.get_title() == "split on y x x: 3 x 4 chunk blocks"
    assert ax.get_ylim() == (6.0, 0.0)  # first position at the top
    assert ax.get_xlim() == (0.0, 8.0)


def test_three_dims_refused(ds):
    m = ds.insitu.split(["time", "y", "x"], fractions={"train": 0.5, "val": 0.5})
    with pytest.raises(ValueError, match="one or two split dims"):
        plot_manifest(m)
