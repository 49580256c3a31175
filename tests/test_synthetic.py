"""The synthetic archives of the demo, the tests and the docs: written without a warning (every doc
example starts by writing one), and what they claim about consolidated metadata holds."""

from __future__ import annotations

import json
import warnings

import pytest

import xinsitu
from xinsitu.synthetic import write_era5_like, write_weatherbench_like


@pytest.mark.parametrize("write", [write_era5_like, write_weatherbench_like])
@pytest.mark.parametrize("consolidated, zarr_format", [(True, 3), (False, 3), (True, 2)])
def test_written_without_a_warning(tmp_path, write, consolidated, zarr_format):
    path = tmp_path / "a.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails
        write(path, nt=8, ny=2, nx=3, chunk_time=4, zarr_format=zarr_format, consolidated=consolidated)
    meta = path / ("zarr.json" if zarr_format == 3 else ".zmetadata")
    if zarr_format == 3:
        assert ("consolidated_metadata" in json.loads(meta.read_text())) is consolidated
    else:
        assert meta.exists()
    ds = xinsitu.open_zarr(str(path))
    assert ds.sizes["time"] == 8


def test_other_warnings_are_not_hidden(tmp_path, monkeypatch):
    """Only zarr's note on consolidated metadata is silenced: another warning from the write still shows."""
    import xarray as xr

    real = xr.Dataset.to_zarr

    def noisy(self, *args, **kwargs):
        warnings.warn("something else", UserWarning, stacklevel=2)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(xr.Dataset, "to_zarr", noisy)
    with pytest.warns(UserWarning, match="something else"):
        write_era5_like(tmp_path / "b.zarr", nt=8, ny=2, nx=3, chunk_time=4)
