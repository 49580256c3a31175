"""Splits on data in place: ``split(..., block={dim: n})`` cuts a dim held in one chunk (or in coarse
chunks) into blocks of ``n`` positions -- every block in one split, every sample in the split of its
blocks, epochs exactly once and bit-identical to xarray (batches, map-style dataset, stats,
validity); one split needs no block; a single-chunk dim without ``block=`` names ``block=`` and
``concat_dim=``; repeated ``over``/split dims and non-numeric fractions are refused naming the argument."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xinsitu
from tests.batches.test_stats import assert_stats_close, numpy_stats
from tests.index.test_sampling import grid_ds, run_epoch, write
from xinsitu.index.manifest import SplitManifest
from xinsitu.index.runs import decode_mask
from xinsitu.index.sampling import sampling


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> xr.Dataset:
    """Time chunks of 6 and 12; lat and lon each held in one chunk (a globe per chunk, as GRIB fields)."""
    path = tmp_path_factory.mktemp("blocks") / "g.zarr"
    return write(path, grid_ds(), {"a": {"time": 6}, "b": {"time": 12}, "mask": {}})


def owner_of_positions(m: SplitManifest) -> np.ndarray:
    """Per grid point of the split dims, the index of its split (-1: left out), from the block edges."""
    own = m.owner()
    idx = np.ix_(*[np.searchsorted(m.edges[d], np.arange(m.sizes[d]), side="right") - 1 for d in m.dims])
    return own[idx]


# ---------------------------------------------------------------- single chunk: the error, and one split
def test_a_dim_in_one_chunk_names_block_and_concat_dim(whole):
    with pytest.raises(ValueError, match=r"block=\{'lat': n\}") as e:
        whole.insitu.split(["lat", "lon"], fractions={"train": 0.7, "val": 0.3}, contiguous=False)
    assert "concat_dim='lat'" in str(e.value) and "re-chunk" not in str(e.value)
    with pytest.raises(ValueError, match="block=") as e:
        whole.insitu.split("lon", ranges={"a": slice(0, 10), "b": slice(12, 20)})
    assert "re-chunk" not in str(e.value)


def test_one_split_on_a_dim_in_one_chunk(whole):
    m = whole.insitu.split("lat", fractions={"train": 1.0})
    assert m.grid == (1,) and list(m.splits["train"]) == [0] and m.block == {}
    gen = whole.insitu.batches(m, "train", batch_size=5, output="numpy", over="time", seed=1)
    ids = run_epoch(whole, gen)
    assert np.array_equal(np.sort(ids), np.arange(whole.sizes["lat"] * whole.sizes["time"]))


# ---------------------------------------------------------------- blocks finer than chunks
@pytest.mark.parametrize("kw", [{}, {"over": "time"}, {"over": "time", "cache": True},
                                {"patch": {"lat": 4, "lon": 2}, "over": "time"},
                                {"patch": {"lat": 3, "lon": 3}, "stride": {"lat": 1, "lon": 2}, "window": {"time": 2}}])
@pytest.mark.slow
def test_spatial_hold_out_in_blocks(whole, kw):
    m = whole.insitu.split(["lat", "lon"], fractions={"train": 0.7, "val": 0.3}, contiguous=False, seed=3,
                           block={"lat": 4, "lon": 3})
    assert m.grid == (3, 4) and m.block == {"lat": 4, "lon": 3}
    own = owner_of_positions(m)
    total = 0
    for i, split in enumerate(m.splits):
        gen = whole.insitu.batches(m, split, batch_size=7, output="numpy", block_chunks=2, seed=5, **kw)
        for epoch in range(2 if "cache" in kw else 1):  # the second epoch from the cache
            gen.set_epoch(epoch)
            ids = run_epoch(whole, gen)  # every batch bit-identical to xarray
            assert np.array_equal(np.sort(ids), np.arange(gen.n_samples))  # exactly once
        # every sample lies in blocks of its own split only
        sp = gen.space
        w = [d.width for d in sp.split_dims]
        for u in range(sp.n_units):
            for row in sp.unit_starts(u):
                box = own[row[0]:row[0] + w[0], row[1]:row[1] + w[1]]
                assert (box == i).all()
        total += gen.n_samples
    assert total > 0


def test_blocks_along_time_with_gap_windows_and_ranks(whole):
    m = whole.insitu.split("time", fractions={"train": 0.6, "val": 0.4}, gap=1, block={"time": 5})
    assert np.array_equal(m.edges["time"], [0, 5, 10, 15, 20, 24])
    assert list(m.splits["train"]) == [0, 1] and list(m.splits["val"]) == [3, 4]  # block 2 is the gap
    for split in m.splits:
        gen = whole.insitu.batches(m, split, batch_size=3, output="xarray", window={"time": 3}, block_chunks=2)
        ids = run_epoch(whole, gen, "xarray")
        assert np.array_equal(np.sort(ids), np.arange(gen.n_samples))
    # two ranks: disjoint, equal batch counts
    gens = [whole.insitu.batches(m, "train", batch_size=2, output="numpy", rank=r, world_size=2, seed=1)
            for r in range(2)]
    got = [np.concatenate(g.batch_ids()) for g in gens]
    assert len(gens[0]) == len(gens[1]) and not set(got[0]) & set(got[1])
    # ranges on blocks: rounded inward to block edges
    r = whole.insitu.split("time", ranges={"a": slice("2000-01-01", "2000-01-12"), "b": slice("2000-01-16", None)},
                           block={"time": 5})
    assert list(r.splits["a"]) == [0, 1] and list(r.splits["b"]) == [3, 4]
    assert r.labels["a"]["time"] == ["2000-01-01T00:00:00", "2000-01-10T00:00:00"]


def test_dataset_stats_and_validity_with_blocks(whole, tmp_path):
    src = grid_ds()
    src["a"][3:5, 2, 1] = np.nan
    ds = write(tmp_path / "n.zarr", src, {"a": {"time": 6}, "b": {"time": 12}, "mask": {}})
    m = ds.insitu.split(["lat", "lon"], fractions={"train": 0.5, "val": 0.5}, contiguous=False, seed=1,
                        block={"lat": 3, "lon": 5})
    # map-style: every item equals xarray
    d = ds.insitu.dataset(m, "train", over="time", output="numpy", variables=["a", "b"])
    gen = ds.insitu.batches(m, "train", over="time", output="numpy", variables=["a", "b"], shuffle=False,
                            batch_size=len(d))
    full = next(iter(gen))
    got = d.__getitems__(list(range(len(d))))
    for v in ("a", "b"):
        assert np.array_equal(np.stack([x[v] for x in got]) if isinstance(got, list) else got[v], full[v],
                              equal_nan=True)
    # stats over exactly the split's positions
    stt = ds.insitu.stats(m, "train", variables=["a", "b"])
    for v in ("a", "b"):
        assert_stats_close(stt[v], numpy_stats(ds[v], m, "train"))
    # validity: the mask equals the per-sample oracle, and batches draw only valid samples
    r = ds.insitu.validity(m, "train", variables=["a"], over="time")
    sp = sampling(ds, m, "train", variables=["a"], over="time").space
    exp = [bool(np.isfinite(ds["a"].values[t, y, x])) for u in range(sp.n_units) for y, x, t in sp.unit_starts(u)]
    assert np.array_equal(decode_mask(m.validity["train"]), exp) and r["valid"] < r["total"]
    gen = ds.insitu.batches(m, "train", over="time", output="numpy", variables=["a"], batch_size=4)
    assert sum(len(b["a"]) for b in gen) == r["valid"]


def test_manifest_with_blocks_round_trips_and_is_checked(whole, tmp_path):
    m = whole.insitu.split(["lat", "lon"], fractions={"train": 0.7, "val": 0.3}, contiguous=False,
                           block={"lat": 5, "lon": 4})
    m.to_json(tmp_path / "m.json")
    back = SplitManifest.from_json(tmp_path / "m.json")
    assert back == m and back.block == {"lat": 5, "lon": 4}
    for text in (m.summary(), repr(back)):
        assert "blocks of 5 along lat" in text and "blocks of 4 along lon" in text
    assert "blocks of 5" in m._repr_html_()
    gen = whole.insitu.batches(back, "val", batch_size=4, output="numpy")
    assert np.array_equal(np.sort(run_epoch(whole, gen)), np.arange(gen.n_samples))
    assert "each chunk read once" not in repr(gen)  # a chunk holds several blocks: read once per buffer
    d = m.to_dict()
    d["block"] = {"lat": 6, "lon": 4}  # edges are blocks of 5
    with pytest.raises(ValueError, match="block"):
        SplitManifest.from_dict(d)
    d["block"] = {"time": 2}
    with pytest.raises(ValueError, match="block"):
        SplitManifest.from_dict(d)
    # another length along a block dim is still refused
    with pytest.raises(ValueError, match="length 12"):
        whole.isel(lat=slice(0, 8)).insitu.batches(m, "train")


@pytest.mark.parametrize("block, err, match", [
    ([4], TypeError, "block must be a dict"),
    ({"lat": 2.0}, TypeError, r"block\['lat'\]"),
    ({"lat": True}, TypeError, r"block\['lat'\]"),
    ({"lat": 0}, ValueError, r"block\['lat'\]"),
    ({"lat": 13}, ValueError, r"block\['lat'\]"),
    ({"time": 2}, ValueError, "not a split dim"),
])
def test_bad_block(whole, block, err, match):
    with pytest.raises(err, match=match):
        whole.insitu.split(["lat", "lon"], fractions={"a": 0.5, "b": 0.5}, contiguous=False, block=block)


# ---------------------------------------------------------------- hypothesis: the block index math
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(by=st.integers(1, 7), bx=st.integers(1, 6), py=st.integers(1, 4), px=st.integers(1, 3),
       sy=st.integers(1, 3), gap=st.integers(0, 1), seed=st.integers(0, 50), frac=st.floats(0.2, 0.8))
def test_hypothesis_blocks_partition_samples(whole, by, bx, py, px, sy, gap, seed, frac):
    """Blocks partition the grid; each split's samples are exactly the tiles whose blocks are all its
    own (brute force over every tile), counted by ``n_samples``."""
    try:
        m = whole.insitu.split(["lat", "lon"], fractions={"a": frac, "b": 1 - frac}, contiguous=False, seed=seed,
                               gap=gap, block={"lat": by, "lon": bx})
    except ValueError as e:
        assert "no chunk" in str(e)
        return
    ny, nx = whole.sizes["lat"], whole.sizes["lon"]
    assert np.array_equal(m.edges["lat"], np.r_[np.arange(0, ny, by), ny])
    own = owner_of_positions(m)
    for i, split in enumerate(m.splits):
        sp = sampling(whole, m, split, patch={"lat": py, "lon": px}, stride={"lat": sy}).space
        got = sorted(tuple(r[:2]) for u in range(sp.n_units) for r in sp.unit_starts(u))
        want = sorted((y, x) for y in range(0, ny - py + 1, sy) for x in range(0, nx - px + 1, px)
                      if (own[y:y + py, x:x + px] == i).all())
        assert got == want
        assert sp.n_samples == len(want)


# ---------------------------------------------------------------- argument checks
def test_repeated_over_and_split_dims_are_refused(whole):
    m = whole.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    with pytest.raises(ValueError, match="over names .'lat'. more than once"):
        whole.insitu.batches(m, "train", over=["lat", "lat"])
    with pytest.raises(ValueError, match="over"):
        whole.insitu.dataset(m, "train", over=("lon", "lat", "lon"))
    with pytest.raises(TypeError, match="over"):
        whole.insitu.batches(m, "train", over=[3])
    gen = whole.insitu.batches(m, "train", over=["lat"], batch_size=8)
    assert gen.n_samples == m.positions("train") * whole.sizes["lat"]
    with pytest.raises(ValueError, match="more than once"):
        whole.insitu.split(["lat", "lat"], fractions={"a": 1.0})


def test_fractions_take_any_real_number(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    ref = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
    for fr in ({"train": np.float32(0.75), "val": np.float32(0.25)}, {"train": np.float64(0.75), "val": 0.25},
               {"train": 3 / 4, "val": np.float16(0.25)}):
        assert ds.insitu.split("time", fractions=fr).splits == ref.splits
    one = ds.insitu.split("time", fractions={"all": np.int64(1)})
    assert len(one.splits["all"]) == ref.grid[0]
    for bad in ("0.5", True, np.bool_(True), None, [0.5]):
        with pytest.raises(TypeError, match=r"fractions\['train'\]"):
            ds.insitu.split("time", fractions={"train": bad, "val": 0.5})


def test_in_memory_dataset_splits_in_blocks():
    """An in-memory Dataset is one chunk per dim: blocks make it splittable."""
    ds = grid_ds(nt=20)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2}, block={"time": 4})
    assert [list(b) for b in m.splits.values()] == [[0, 1, 2, 3], [4]]
    gen = ds.insitu.batches(m, "val", batch_size=3, output="numpy", variables=["a"])
    assert np.array_equal(np.sort(run_epoch(ds, gen)), np.arange(4))
    assert gen.sample(0).time.values == ds.time.values[16]


@pytest.mark.slow
def test_spatial_hold_out_on_a_grib_file(tmp_path):
    """Issue 29: split(["latitude", "longitude"], contiguous=False) on a GRIB file (one field per chunk) is
    refused naming block=; with block= every epoch equals cfgrib's values, exactly once."""
    pytest.importorskip("virtualizarr", reason="the virtual extra is not installed")
    pytest.importorskip("eccodes", reason="the grib extra is not installed")
    pytest.importorskip("cfgrib", reason="the grib extra is not installed")
    from tests.formats.test_grib import STEPS, TIMES, cfgrib, fields, with_history
    from xinsitu.formats.grib import write_grib
    from xinsitu.virtual import open_grib

    f = write_grib(tmp_path / "an.grib", fields(), TIMES, STEPS, edition=2)
    ds = open_grib(f)
    ref = with_history(cfgrib(f), ds)
    with pytest.raises(ValueError, match="block=") as e:
        ds.insitu.split(["latitude", "longitude"], fractions={"train": 0.8, "val": 0.2}, contiguous=False)
    assert "concat_dim=" in str(e.value) and "re-chunk" not in str(e.value)
    m = ds.insitu.split(["latitude", "longitude"], fractions={"train": 0.8, "val": 0.2}, contiguous=False, seed=1,
                        block={"latitude": 2, "longitude": 3})
    for split in m.splits:
        gen = ds.insitu.batches(m, split, batch_size=5, over=["time", "step"], output="numpy", block_chunks=3)
        assert np.array_equal(np.sort(run_epoch(ref, gen)), np.arange(gen.n_samples))
        assert gen.n_samples == m.positions(split) * len(TIMES) * len(STEPS)


def test_resume_with_blocks(whole):
    """Exact resume (state through JSON) of a shuffled epoch on a block split, patches spilling over blocks."""
    from tests.support.resume_check import run_test_save_load_state

    m = whole.insitu.split(["lat", "lon"], fractions={"train": 0.7, "val": 0.3}, contiguous=False, seed=2,
                           block={"lat": 3, "lon": 2})

    def make():
        return whole.insitu.batches(m, "train", batch_size=5, over="time", patch={"lat": 2, "lon": 2},
                                    stride={"lat": 1}, output="numpy", block_chunks=2, seed=4)

    run_test_save_load_state(make, len(make()) // 2, epochs=2)
