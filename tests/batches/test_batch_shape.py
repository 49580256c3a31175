"""What a batch looks like, said where a user looks: the generator's repr names the batch's axes
(the channel axis right after the batch axis, a window's axis after the channels), checked against
the batches themselves."""

from __future__ import annotations

import re

import numpy as np
import pytest

import xinsitu
from xinsitu.synthetic import write_era5_like


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    path = tmp_path_factory.mktemp("shape") / "a.zarr"
    write_era5_like(path, nt=48, ny=4, nx=6, chunk_time=8, consolidated=False)
    ds = xinsitu.open_zarr(str(path), consolidated=False)
    return ds, ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})


def _batch_line(gen) -> str:
    line = next((ln for ln in repr(gen).splitlines() if ln.strip().startswith("batch ")), None)
    assert line is not None, repr(gen)
    assert line.strip() in gen._repr_html_().replace("&#x27;", "'") or line.split(None, 1)[1] in gen._repr_html_()
    return line.split(None, 1)[1]


def _axes(text: str) -> list[tuple[str, int]]:
    """``(batch 8, channel 4, time 2, ...)`` -> [("batch", 8), ("channel", 4), ...]."""
    inner = re.search(r"\(([^)]*)\)", text).group(1)
    return [(name, int(n)) for name, n in re.findall(r"(\w+): (\d+)", inner)]


@pytest.mark.parametrize("output", ["numpy", "dataarray"])
def test_a_stacked_window_is_batch_channel_time(ds, output):
    ds, m = ds
    variables = ["t2m", "u10", "v10", "z500"]
    gen = ds.insitu.batches(m, "train", batch_size=8, window={"time": 2}, stack=True, output=output,
                            variables=variables)
    b = next(iter(gen))
    shape = b.shape
    line = _batch_line(gen)
    axes = _axes(line)
    assert [n for _, n in axes] == list(shape), (line, shape)
    assert [a for a, _ in axes][:3] == ["batch" if output != "dataarray" else "sample",
                                        "channel" if output != "dataarray" else "variable", "time"], line
    # how to get (batch, time, channel, ...): the axes swapped, as the repr says
    if output == "dataarray":
        assert "b.transpose('sample', 'time', ...)" in line, line
        assert b.transpose("sample", "time", ...).dims[:3] == ("sample", "time", "variable")
    else:
        assert "x.swapaxes(1, 2)" in line, line
        x = np.swapaxes(b, 1, 2)
        assert x.shape == (shape[0], 2, len(variables), *shape[3:])
        assert np.array_equal(x[:, :, 0], b[:, 0])


def test_the_batch_line_of_other_outputs(ds):
    ds, m = ds
    gen = ds.insitu.batches(m, "train", batch_size=8, output="numpy", variables=["t2m", "lsm"])
    line = _batch_line(gen)
    b = next(iter(gen))
    assert "t2m" not in line or "(8, lat: 4, lon: 6)" in line
    assert "dict" in line, line
    gen = ds.insitu.batches(m, "train", batch_size=8, stack=True, output="numpy", variables=["t2m", "u10"])
    line = _batch_line(gen)
    assert [n for _, n in _axes(line)] == list(next(iter(gen)).shape)
    assert "swapaxes" not in line  # no window: nothing to move
    gen = ds.insitu.batches(m, "train", batch_size=8, output="xarray", window={"time": 3})
    line = _batch_line(gen)
    assert "xr.Dataset" in line and "sample" in line, line
    assert b["t2m"].shape == (8, 4, 6)
