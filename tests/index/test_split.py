"""Splits: pure chunk-index math (hypothesis) and the manifest's checks and JSON."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
import xarray as xr
from hypothesis import example, given, settings
from hypothesis import strategies as st

import xinsitu
from xinsitu.index.split import SplitManifest, contiguous_split, largest_remainder, random_split

names = st.lists(st.sampled_from(["train", "val", "test", "a", "b"]), min_size=1, max_size=4, unique=True)


@st.composite
def fractions(draw):
    ks = draw(names)
    w = draw(st.lists(st.integers(1, 20), min_size=len(ks), max_size=len(ks)))
    return {k: x / sum(w) for k, x in zip(ks, w, strict=True)}


@given(fractions(), st.integers(0, 500))
def test_largest_remainder_sums(fr, total):
    c = largest_remainder(fr, total)
    assert sum(c.values()) == total
    for k in fr:
        assert abs(c[k] - fr[k] * total) < 1


@given(fractions(), st.integers(1, 300), st.integers(0, 3))
def test_contiguous_split_partitions(fr, n, gap):
    try:
        out = contiguous_split(n, fr, gap)
    except ValueError:
        return  # too few chunks for these splits: raised, never silently empty
    allb = np.concatenate(list(out.values()))
    assert len(np.unique(allb)) == len(allb)  # disjoint
    assert allb.min() >= 0 and allb.max() < n
    runs = list(out.values())
    for r in runs:
        assert len(r) > 0 and np.all(np.diff(r) == 1)  # one contiguous run each
    for a, b in zip(runs, runs[1:], strict=False):
        assert b[0] - a[-1] - 1 == gap  # exactly `gap` chunks between consecutive splits
    assert len(allb) == n - gap * (len(runs) - 1)  # every chunk not in a gap is used


@settings(max_examples=60)
@given(fractions(), st.lists(st.integers(1, 12), min_size=1, max_size=3), st.integers(0, 2), st.integers(0, 99))
def test_random_split_disjoint_and_gapped(fr, grid, gap, seed):
    grid = tuple(grid)
    try:
        out = random_split(grid, fr, gap, seed)
    except ValueError:
        return
    again = random_split(grid, fr, gap, seed)
    assert all(np.array_equal(out[k], again[k]) for k in out)  # reproducible from the seed
    allb = np.concatenate(list(out.values()))
    assert len(np.unique(allb)) == len(allb)
    coords = {k: np.array(np.unravel_index(v, grid)).T for k, v in out.items()}
    ks = list(out)
    for i, a in enumerate(ks):
        for b in ks[i + 1:]:
            if len(coords[a]) and len(coords[b]):
                d = np.abs(coords[a][:, None, :] - coords[b][None, :, :]).max(axis=-1)
                assert d.min() > gap  # no two blocks of different splits within the gap
    if gap == 0:
        assert len(allb) == int(np.prod(grid))


def test_manifest_json_roundtrip(era5_path, tmp_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1}, gap=1)
    p = tmp_path / "m.json"
    m.to_json(p)
    m2 = SplitManifest.from_json(p)
    assert m2 == m
    assert json.loads(p.read_text())["format"] == "xinsitu.SplitManifest"
    # a loaded manifest drives batches on a freshly opened dataset
    gen = xinsitu.open_zarr(era5_path).insitu.batches(m2, "val", batch_size=4, output="numpy")
    assert sum(len(b["t2m"]) for b in gen) == m.positions("val")


def test_manifest_tampering_detected(era5_path, tmp_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    d = m.to_dict()
    d["extra"]["coords"]["time"][0] = "1900-01-01T00:00:00"
    with pytest.raises(ValueError, match="fingerprint"):
        SplitManifest.from_dict(d)
    d = m.to_dict()
    d["sizes"]["time"] += 1  # caught by the checks before the fingerprint
    with pytest.raises(ValueError, match="'edges' of 'time' must rise strictly from 0 to its length"):
        SplitManifest.from_dict(d)
    with pytest.raises(ValueError, match="not an xinsitu SplitManifest"):
        SplitManifest.from_dict({"dims": ["time"]})


def test_manifest_on_other_geometry_raises(era5_path, tmp_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    with pytest.raises(ValueError, match="length"):
        ds.isel(time=slice(0, 80)).insitu.batches(m, "train")
    rechunked = tmp_path / "r.zarr"
    xr.open_zarr(era5_path).load().to_zarr(rechunked, encoding={v: {"chunks": (12, 6, 10)} for v in
                                                                ["t2m", "u10", "v10", "z500", "tp"]}
                                            | {"lsm": {"chunks": (6, 10)}})
    with pytest.raises(ValueError, match="chunk grid along 'time'"):
        xinsitu.open_zarr(str(rechunked)).insitu.batches(m, "train")
    shifted = ds.assign_coords(time=ds.time + np.timedelta64(1, "D"))
    with pytest.raises(ValueError, match="coordinate 'time'"):
        shifted.insitu.batches(m, "train")


def test_ranges_split(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", ranges={"train": slice("1979-01-01", "1979-01-20"),
                                        "val": slice("1979-01-23", None)})
    e = np.asarray(m.edges["time"])
    times = ds.time.values
    for k, b in m.splits.items():
        first, last = e[b[0]], e[b[-1] + 1] - 1
        # rounded inward: whole chunks inside the label range
        assert np.datetime64(m.labels[k]["time"][0]) == times[first]
        assert np.datetime64(m.labels[k]["time"][1]) == times[last]
    assert times[e[m.splits["train"][-1] + 1] - 1] <= np.datetime64("1979-01-20T23:59")
    assert times[e[m.splits["val"][0]]] >= np.datetime64("1979-01-23")
    with pytest.raises(ValueError, match="closer than gap"):
        ds.insitu.split("time", ranges={"train": slice("1979-01-01", "1979-01-20"),
                                        "val": slice("1979-01-23", None)}, gap=3)
    # a range written backwards is named as such (it said "falls outside the coordinate"), and so is one
    # written forwards on a descending coordinate
    with pytest.raises(ValueError, match=r"runs against .*slice\('1979-01-01', '1979-01-20'\) here"):
        ds.insitu.split("time", ranges={"train": slice("1979-01-20", "1979-01-01"), "val": slice("1979-01-23", None)})
    desc = xr.Dataset({"a": (("lat", "x"), np.zeros((8, 2)))}, coords={"lat": np.arange(80.0, 0, -10)}).chunk(lat=2)
    with pytest.raises(ValueError, match=r"runs against .*slice\(70, 20\) here"):
        desc.insitu.split("lat", ranges={"train": slice(20, 70)})
    with pytest.raises(ValueError, match="falls outside"):
        ds.insitu.split("time", ranges={"train": slice("1990-01-01", "1990-02-01")})
    # a range inside the coordinate that holds no label is not said to fall outside it
    with pytest.raises(ValueError, match=r"\('1979-01-05T01'..'1979-01-05T04'\) holds no label of the 'time' "
                                         r"coordinate: it lies between 1979-01-05T00:00:00 and 1979-01-05T06:00:00"):
        ds.insitu.split("time", ranges={"train": slice("1979-01-05T01", "1979-01-05T04")})
    # split names as fractions= takes them (a name '' or 1 made a manifest that JSON could not give back)
    for name in ("", 1, None, ("a",)):
        with pytest.raises(ValueError, match=r"split names must be non-empty strings, got"):
            ds.insitu.split("time", ranges={name: slice(None, None)})


def test_ranges_that_adjoin_leave_no_room_for_a_gap(era5_path):
    """``ranges=`` keeps every range where it is (the gap is not carved out of one, as ``fractions=``
    does): adjoining ranges with ``gap=`` raise, saying to leave room or to use ``fractions=``; ranges
    that leave the room split."""
    ds = xinsitu.open_zarr(era5_path)
    step = int(ds.insitu.chunks["time"])
    t = ds.time.values
    split_at = 4 * step  # a chunk edge
    adjoining = {"train": slice(t[0], t[split_at - 1]), "val": slice(t[split_at], None)}
    assert ds.insitu.split("time", ranges=adjoining).gap == 0
    with pytest.raises(ValueError, match=r"(?s)0 chunk\(s\) apart.*gap=2.*leave 2 chunk\(s\).*fractions="):
        ds.insitu.split("time", ranges=adjoining, gap=2)
    room = {"train": slice(t[0], t[split_at - 1]), "val": slice(t[split_at + 2 * step], None)}
    m = ds.insitu.split("time", ranges=room, gap=2)
    assert m.splits["val"][0] - m.splits["train"][-1] - 1 == 2
    f = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5}, gap=2)  # carves the gap out
    assert f.splits["val"][0] - f.splits["train"][-1] - 1 == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"fractions": {"train": 0.8, "val": 0.1}}, "sum to 1"),
        ({"fractions": {"train": 1.2, "val": -0.2}}, "negative"),
        ({"fractions": {"train": 0.5, "val": 0.5}, "ranges": {"a": slice(None)}}, "exactly one"),
        ({"fractions": {"train": 0.999, "val": 0.001}}, "no chunk"),
        ({"fractions": {"train": 0.5, "val": 0.5}, "gap": -1}, "gap"),
        ({"fractions": {"train": 0.5, "val": 0.5}, "gap": 100}, "cannot hold"),
        ({"ranges": {"a": slice("1979-01-01", "1979-01-10"), "b": slice("1979-01-05", "1979-01-28")}}, "overlap"),
        # labels that overlap though the whole chunks each range keeps do not (chunks of 2 days), and one range
        # inside another: both were taken (or refused for covering no whole chunk)
        ({"ranges": {"a": slice("1979-01-01", "1979-01-04T12"), "b": slice("1979-01-03T06", "1979-01-20")}},
         "overlap: both hold 'time' 1979-01-03T06:00:00..1979-01-04T12:00:00"),
        ({"ranges": {"a": slice("1979-01-01", "1979-01-28"), "b": slice("1979-01-10T06", "1979-01-10T12")}},
         "overlap"),
        ({"ranges": {"a": slice("2050-01-01", "2051-01-01")}}, "outside"),
        ({"ranges": {"a": slice("1979-01-01T00", "1979-01-01T06")}}, "no whole chunk"),
    ],
)
def test_bad_split_arguments(era5_path, kwargs, match):
    ds = xinsitu.open_zarr(era5_path)
    with pytest.raises(ValueError, match=match):
        ds.insitu.split("time", **kwargs)


def test_bad_dims(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    with pytest.raises(ValueError, match="unknown dim 'level'"):
        ds.insitu.split("level", fractions={"a": 1.0})
    with pytest.raises(ValueError, match=r"held in one chunk of 6 .*block=\{.lat.: n\}"):
        ds.insitu.split("lat", fractions={"a": 0.5, "b": 0.5})


def test_summary_and_reprs(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2}, gap=1)
    for text in (m.summary(), repr(m)):
        assert "train" in text and "val" in text and "1979-01-01T00:00:00" in text
    assert "class='xi-timeline'" in m._repr_html_() or 'class="xi-timeline"' in m._repr_html_()


def _exact_largest_remainder(weights: dict[str, int], total: int) -> dict[str, int]:
    """Largest remainder on the exact fractions ``w / sum(w)``, ties to the split named first."""
    whole = sum(weights.values())
    raw = {k: Fraction(w * total, whole) for k, w in weights.items()}
    counts = {k: math.floor(v) for k, v in raw.items()}
    names = list(raw)
    for k in sorted(names, key=lambda k: (counts[k] - raw[k], names.index(k)))[:total - sum(counts.values())]:
        counts[k] += 1
    return counts


@example({"a": 1, "b": 5}, 165)  # 27.5 / 137.5: the tie goes to a (float noise gave it to b after 1/6 * 165)
@example({"a": 1, "b": 2, "c": 17}, 56)  # 0.05/0.1/0.85 of 56: 2.8, 5.6, 47.6: b and c tie on .6
@given(st.dictionaries(st.sampled_from(["train", "val", "test", "a", "b"]), st.integers(1, 20), min_size=1),
       st.integers(0, 500))
def test_largest_remainder_is_exact_and_ties_go_to_the_split_named_first(weights, total):
    """Remainders are ranked exactly (not in float, where equal remainders differ by noise): the counts
    are those of the exact fractions, ties to the split named first, also for fractions written as decimals."""
    whole = sum(weights.values())
    assert largest_remainder({k: w / whole for k, w in weights.items()}, total) == _exact_largest_remainder(
        weights, total)
    decimal = {k: round(w / whole, 2) for k, w in weights.items()}
    if sum(Fraction(str(v)) for v in decimal.values()) == 1:
        as_int = {k: int(Fraction(str(v)) * 100) for k, v in decimal.items()}
        assert largest_remainder(decimal, total) == _exact_largest_remainder(as_int, total)


def test_fractions_that_tie_go_to_the_split_named_first():
    ds = xr.Dataset({"v": (("time",), np.zeros(56))})
    m = ds.insitu.split("time", fractions={"a": 0.05, "b": 0.1, "c": 0.85})
    assert {k: len(v) for k, v in m.splits.items()} == {"a": 3, "b": 6, "c": 47}  # float ranking gave 3/5/48
    m = ds.insitu.split("time", fractions={"c": 0.85, "b": 0.1, "a": 0.05})
    assert {k: len(v) for k, v in m.splits.items()} == {"c": 48, "b": 5, "a": 3}


def test_a_dim_of_length_zero_is_named(era5_path):
    """A selection that holds no position of the split dim (a .sel range past the data) raises a
    ValueError saying so, for fractions= and ranges= (it raised pandas' IndexError, or advised block=)."""
    empty = xinsitu.open_zarr(era5_path).sel(time=slice("2005", "2006"))
    assert empty.sizes["time"] == 0
    for kw in ({"fractions": {"train": 1.0}}, {"fractions": {"train": 0.5, "val": 0.5}},
               {"ranges": {"train": slice(None, None)}}, {"fractions": {"train": 1.0}, "block": {"time": 1}}):
        with pytest.raises(ValueError, match=r"dim 'time' has length 0 here: the selection holds no position"):
            empty.insitu.split("time", **kw)


@pytest.fixture(scope="module")
def lon_archive(tmp_path_factory):
    """180 longitudes 0..358 stored in chunks of 50: [0, 50) [50, 100) [100, 150) [150, 180)."""
    p = str(tmp_path_factory.mktemp("lon") / "lon.zarr")
    rng = np.random.default_rng(0)
    xr.Dataset({"t": (("time", "lon"), rng.random((4, 180)).astype("f4"))},
               coords={"lon": np.arange(0, 360, 2.0)}).to_zarr(p, encoding={"t": {"chunks": (4, 50)}})
    return p


def _recentred(p, how):
    if how == "sortby":
        src = xinsitu.open_zarr(p)
        ds = src.assign_coords(lon=(src.lon + 180) % 360 - 180).sortby("lon")
        return ds, np.argsort((np.arange(0, 360, 2.0) + 180) % 360 - 180, kind="stable")
    return xr.open_zarr(p).roll(lon=90, roll_coords=True), np.roll(np.arange(180), 90)


@pytest.mark.parametrize("how", ["sortby", "roll"])
def test_a_stored_chunk_in_two_places_is_refused(lon_archive, how):
    """Re-centring longitudes (sortby after assign_coords, or roll) puts stored chunk 1 at both ends of
    the new axis: split() made it two chunk blocks and gave them to train and val (one read serving both).
    It raises, naming the dim, the stored chunk and the ways out; with block= it splits, every sample in
    one split, values as xarray's."""
    ds, stored = _recentred(lon_archive, how)
    with pytest.raises(ValueError, match=r"(?s)dim 'lon': the selection reorders 'lon' so that stored chunk 1 "
                                         r"of 't' \(stored positions 50..99\) appears in two places.*"
                                         r"block=\{'lon': n\}.*archive's own order"):
        ds.insitu.split("lon", fractions={"train": 0.6, "val": 0.4})
    with pytest.raises(ValueError, match="stored chunk 1"):
        ds.insitu.split("lon", ranges={"train": slice(-180, -2), "val": slice(0, None)})
    with pytest.raises(ValueError, match="stored chunk 1"):
        ds.insitu.split(["time", "lon"], fractions={"a": 0.5, "b": 0.5}, block={"time": 1})
    one = ds.insitu.split("lon", fractions={"all": 1.0})  # one split: no read serves two
    assert len(one.indices("all")["lon"]) == 180
    m = ds.insitu.split("lon", fractions={"train": 0.6, "val": 0.4}, block={"lon": 10})
    seen = []
    for name in m.splits:
        ind = m.indices(name)["lon"]
        seen.append(stored[ind])
        got = np.concatenate([b["t"] for b in ds.insitu.batches(m, name, batch_size=7, shuffle=False,
                                                                   output="numpy")])
        np.testing.assert_array_equal(got, ds.t.isel(lon=ind).transpose("lon", "time").values)
    assert not set(seen[0]) & set(seen[1])


def test_a_reordering_that_keeps_each_chunk_in_one_place_splits(lon_archive):
    """A reversed dim (each stored chunk still one run) splits on whole stored chunks, as before."""
    ds = xinsitu.open_zarr(lon_archive).isel(lon=slice(None, None, -1))
    m = ds.insitu.split("lon", fractions={"train": 0.5, "val": 0.5})
    stored = np.arange(180)[::-1]
    chunks = {k: set(stored[m.indices(k)["lon"]] // 50) for k in m.splits}
    assert not chunks["train"] & chunks["val"] and chunks["train"] | chunks["val"] == {0, 1, 2, 3}
