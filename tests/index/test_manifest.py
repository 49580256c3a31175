"""The split record (``xinsitu.index.manifest``) and its compact encodings (``xinsitu.index.runs``): runs of
block ids, runs of equal steps, and the manifest's JSON round trip (hypothesis where the math is)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import xinsitu  # noqa: F401 - registers ds.insitu
from xinsitu.index.manifest import SplitManifest
from xinsitu.index.runs import Blocks, decode_steps, encode_steps
from xinsitu.synthetic import era5_like

id_lists = st.lists(st.integers(0, 200), max_size=60)


@given(ids=id_lists)
def test_blocks_read_like_the_ids_they_stand_for(ids):
    b = Blocks.from_ids(ids)
    assert len(b) == len(ids) and list(b) == ids and b == ids
    np.testing.assert_array_equal(b.ids(), np.asarray(ids, dtype=np.int64))
    assert b.nruns <= len(ids)
    if ids:
        assert b[-1] == ids[-1] and list(b[1:]) == ids[1:]


def test_a_contiguous_split_is_one_run():
    b = Blocks.from_ids(range(10**6))
    assert b.nruns == 1 and len(b) == 10**6 and Blocks.range(0, 10**6) == b


@given(values=st.lists(st.integers(-1000, 1000), max_size=50).map(lambda v: np.cumsum(np.abs(v))))
def test_steps_round_trip(values):
    runs = encode_steps(values)
    np.testing.assert_array_equal(decode_steps(runs, "edges"), values)
    assert sum(r[2] for r in runs) == len(values)


def test_a_regular_grid_is_at_most_two_runs():
    assert len(encode_steps(np.arange(0, 10**5 * 24, 24))) <= 2


@pytest.mark.parametrize("bad", ["x", [[0, 1]], [[0, 1, 0]], [[0, -1, 3]], [[0, True, 2]]])
def test_malformed_steps_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="edges"):
        decode_steps(bad, "edges")


def test_a_manifest_round_trips_through_json(tmp_path):
    ds = era5_like(48, 4, 8).chunk({"time": 6})
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.25, "test": 0.25}, gap=1, seed=5)
    back = SplitManifest.from_json(m.to_json())
    assert back.splits == m.splits and back.dims == m.dims and back.sizes == m.sizes
    assert back.fingerprint == m.fingerprint and back.gap == m.gap and back.seed == m.seed
    path = tmp_path / "m.json"
    assert m.to_json(path) is None  # (as pandas': a notebook cell ending with it shows no JSON string)
    assert SplitManifest.from_json(path).splits == m.splits and path.read_text() == m.to_json()
    assert sum(m.positions(k) for k in m.splits) < 48  # gaps leave positions out


def test_the_grid_labels_run_the_way_the_grid_is_drawn():
    """The HTML grid of a 2-D split draws the first block row at the top (``y=0``, lat 90 of a
    north-to-south grid): its row label reads from the top down, first label first, with no rotation
    that would put the first label at the bottom."""
    import re
    from importlib import resources

    ds = era5_like(nt=8, ny=16, nx=32).chunk({"time": 8, "lat": 4, "lon": 8})  # lat 90 .. -90
    m = ds.insitu.split(["lat", "lon"], fractions={"train": 0.75, "val": 0.25}, seed=0)
    h = m._repr_html_()
    owner = m.owner()
    first_row = re.findall(r"<rect x='(\d+)' y='0' width='(\d+)' height='4' fill='([^']+)'/>", h)
    assert first_row and all(f.startswith("url(") or owner[0, int(x) // 8] >= 0 for x, _, f in first_row)
    left = re.search(r"class='xi-axis xi-axis-left'>([^<]*)<", h).group(1)
    assert left.index("90") < left.index("-90"), left  # 90 first: where row 0 is drawn
    css = resources.files("xinsitu").joinpath("static/style.css").read_text()
    rule = re.search(r"\.xi-axis-left\s*\{([^}]*)\}", css).group(1)
    assert "vertical-rl" in rule, rule  # top to bottom, as the rows
    assert "rotate" not in rule, rule   # rotate(180deg) made it read bottom to top: first label at the bottom


def test_a_coordinate_whose_first_label_is_missing_still_matches_its_manifest(tmp_path):
    """A split-dim coordinate whose first label reads as NaN (a zarr v2 integer coordinate keeps its fill
    value 0, which xarray masks): the manifest made on the dataset applies to it, saved and loaded too
    (NaN != NaN refused every batch: "spans nan..7.0 here, but the manifest was made on nan..7.0"); another
    last label is still refused."""
    import xarray as xr

    ds = xr.Dataset({"a": (("time", "x"), np.arange(24.0).reshape(8, 3))},
                    coords={"time": [np.nan, 1, 2, 3, 4, 5, 6, 7]}).chunk({"time": 2})
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    m.to_json(tmp_path / "m.json")
    assert SplitManifest.from_json(tmp_path / "m.json") == m  # (NaN labels compared as labels: was False)
    for man in (m, SplitManifest.from_json(tmp_path / "m.json")):
        b = next(iter(ds.insitu.batches(man, "train", batch_size=2, shuffle=False, output="numpy")))
        np.testing.assert_array_equal(b["a"], ds.a.values[:2])
    other = ds.assign_coords(time=[np.nan, 1, 2, 3, 4, 5, 6, 8])
    with pytest.raises(ValueError, match="spans"):
        other.insitu.batches(m, "train", batch_size=2)
