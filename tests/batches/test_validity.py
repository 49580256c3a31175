"""Valid samples only: the mask equals numpy's per-sample oracle, is compact and JSON-able, and
batches then yield exactly the valid samples (once each, shuffled, equal batch counts across
ranks, resumable, elastic)."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import xarray as xr
from hypothesis import given, settings
from hypothesis import strategies as st

import xinsitu
from xinsitu.index.plan import epoch_plan
from xinsitu.index.runs import decode_mask, encode_mask
from xinsitu.index.sampling import SampleDim, SampleSpace, sampling

NT, NLAT, NLON = 48, 6, 5


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> xr.Dataset:
    """x with NaN at known places (a land point, a whole missing step, single NaN), an integer
    key per (time, lat) naming each sample, and a target with its own NaN stretch."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NT, NLAT, NLON)).astype("float32")
    x[:10, 2, 3] = np.nan  # a land point in the first steps: samples keeping lat 2 / lon 3 there are invalid
    x[17] = np.nan
    x[30, 0, 0] = np.inf
    x[5, 4, 1] = np.nan
    y = rng.normal(size=NT)
    y[40:43] = np.nan
    key = (np.arange(NT)[:, None] * 100 + np.arange(NLAT)[None, :]).astype("int64")
    src = xr.Dataset({"x": (("time", "lat", "lon"), x), "y": ("time", y), "key": (("time", "lat"), key)},
                     coords={"time": np.arange(NT)})
    path = str(tmp_path_factory.mktemp("valid") / "v.zarr")
    src.chunk({"time": 4}).to_zarr(path, mode="w", consolidated=True)
    return xr.open_zarr(path, consolidated=True)


@pytest.fixture
def m(ds: xr.Dataset) -> xinsitu.SplitManifest:
    return ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25}, contiguous=False, seed=1)


def oracle_mask(ds: xr.Dataset, m: xinsitu.SplitManifest, split: str, variables: list[str], **kw) -> np.ndarray:
    """Per sample (in the split's numbering), whether every value of ``variables`` in it is finite:
    plain xarray, one ``isel`` per sample."""
    sp = sampling(ds, m, split, variables=variables, **kw).space
    out = []
    for u in range(len(sp.blocks)):
        for row in sp.all_unit_starts(u):
            sel = {d.name: slice(int(s), int(s) + d.width) for d, s in zip(sp.dims, row, strict=True)}
            sub = ds[variables].isel({k: v for k, v in sel.items() if k in ds[variables].dims})
            out.append(all(bool(np.isfinite(sub[v].values).all()) for v in variables))
    return np.array(out, dtype=bool)


SAMPLINGS = [{}, {"window": {"time": 3}}, {"patch": {"lat": 3, "lon": 2}, "stride": {"lon": 1}},
             {"over": "lat"}, {"window": {"time": 2}, "over": ["lat"]}]


@pytest.mark.parametrize("kw", SAMPLINGS)
@pytest.mark.slow
def test_finite_mask_equals_oracle(ds: xr.Dataset, m: xinsitu.SplitManifest, kw: dict) -> None:
    r = ds.insitu.validity(m, "train", variables=["x"], **kw)
    mask = decode_mask(m.validity["train"])
    exp = oracle_mask(ds, m, "train", ["x"], **kw)
    assert np.array_equal(mask, exp)
    assert r["valid"] == int(exp.sum()) and r["total"] == len(exp)
    assert 0 < r["valid"] < r["total"]  # the fixture makes some invalid, some valid
    assert "val" not in m.validity


def test_default_variables_and_target(ds: xr.Dataset, m: xinsitu.SplitManifest) -> None:
    ds.insitu.validity(m, "train", variables="y")  # NaN targets only
    assert np.array_equal(decode_mask(m.validity["train"]), oracle_mask(ds, m, "train", ["y"]))
    ds.insitu.validity(m, "train")  # default: every variable on the split dim
    assert np.array_equal(decode_mask(m.validity["train"]), oracle_mask(ds, m, "train", ["x", "y", "key"]))


def test_where_fn(ds: xr.Dataset, m: xinsitu.SplitManifest) -> None:
    seen = []

    def few_nan(b: xr.Dataset) -> np.ndarray:
        seen.append(b)
        return (b["x"].isnull().sum(["lat", "lon"]) <= 6).values

    r = ds.insitu.validity(m, "train", where=few_nan, variables=["x"])
    assert all(isinstance(b, xr.Dataset) and "sample" in b.dims for b in seen)
    sp = sampling(ds, m, "train", variables=["x"]).space
    starts = np.concatenate([sp.all_unit_starts(u) for u in range(len(sp.blocks))])[:, 0]
    exp = np.isnan(ds["x"].values[starts]).sum(axis=(1, 2)) <= 6
    assert np.array_equal(decode_mask(m.validity["train"]), exp)
    assert r["valid"] == int(exp.sum()) and r["where"].startswith("fn:")


def first_key(b: dict) -> np.ndarray:
    """The sample's name: its first key (time * 100 + lat) whatever the sample's shape."""
    k = np.asarray(b["key"])
    return k.reshape(len(k), -1)[:, 0]


def yielded(gen, epoch: int = 0) -> list[np.ndarray]:
    gen.set_epoch(epoch)
    return [first_key(b) for b in gen]


def valid_keys(ds: xr.Dataset, m: xinsitu.SplitManifest, split: str, **kw) -> np.ndarray:
    """The key (time * 100 + lat) of each valid sample, from the oracle."""
    sp = sampling(ds, m, split, variables=["x", "key"], **kw).space
    rows = np.concatenate([sp.all_unit_starts(u) for u in range(len(sp.blocks))])
    names = [d.name for d in sp.dims]
    t = rows[:, names.index("time")]
    lat = rows[:, names.index("lat")] if "lat" in names else np.zeros(len(rows), np.int64)
    keys = t * 100 + lat
    return keys[oracle_mask(ds, m, split, ["x"], **kw)]


@pytest.mark.parametrize("kw", [{"window": {"time": 2}}, {"over": "lat"}])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.slow
def test_batches_exactly_valid_once(ds: xr.Dataset, m: xinsitu.SplitManifest, kw: dict, world_size: int) -> None:
    ds.insitu.validity(m, "train", variables=["x"], **kw)
    want = valid_keys(ds, m, "train", **kw)
    bs = 4
    for epoch in range(3):
        per_rank = [yielded(ds.insitu.batches(m, "train", batch_size=bs, output="numpy", variables=["x", "key"],
                                              rank=r, world_size=world_size, block_chunks=2, seed=3, **kw), epoch)
                    for r in range(world_size)]
        assert len({len(b) for b in per_rank}) == 1  # equal batch counts
        got = np.concatenate([k for b in per_rank for k in b])
        assert len(np.unique(got)) == len(got)  # exactly once, disjoint across ranks
        assert set(got.tolist()) <= set(want.tolist())  # only valid samples
        assert len(want) - len(got) < world_size * bs  # and all but fewer than W x B of them
        if world_size == 1:
            assert sorted(got.tolist()) == sorted(want.tolist())


def test_values_match_xarray(ds: xr.Dataset, m: xinsitu.SplitManifest) -> None:
    ds.insitu.validity(m, "train", variables=["x"], window={"time": 2})
    for b in ds.insitu.batches(m, "train", batch_size=5, output="numpy", window={"time": 2}, seed=0):
        t = b["key"][:, 0, 0] // 100
        ref = np.stack([ds["x"].values[s:s + 2] for s in t])
        assert np.array_equal(b["x"], ref)
        assert np.isfinite(b["x"]).all()


def test_shuffle_determinism(ds: xr.Dataset, m: xinsitu.SplitManifest) -> None:
    ds.insitu.validity(m, "train", variables=["x"], over="lat")

    def run(seed: int, epoch: int) -> list[int]:
        g = ds.insitu.batches(m, "train", batch_size=4, output="numpy", over="lat", seed=seed, block_chunks=2)
        return np.concatenate(yielded(g, epoch)).tolist()

    assert run(0, 0) == run(0, 0)
    assert run(0, 0) != run(0, 1) and run(0, 0) != run(5, 0)
    assert sorted(run(0, 0)) == sorted(run(5, 1))


def test_resume_mid_epoch(ds: xr.Dataset, m: xinsitu.SplitManifest) -> None:
    ds.insitu.validity(m, "train", variables=["x"], over="lat")
    kw = dict(batch_size=3, output="numpy", over="lat", seed=2, block_chunks=2)
    full = [b["key"] for b in ds.insitu.batches(m, "train", **kw)]
    g = ds.insitu.batches(m, "train", **kw)
    it = iter(g)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(g.state_dict()))
    assert state["valid"] == m.validity["train"]["digest"]
    again = ds.insitu.batches(m, "train", **kw)
    again.load_state_dict(state)
    tail = [b["key"] for b in again]
    assert len(tail) == len(full) - 5
    assert all(np.array_equal(a, b) for a, b in zip(tail, full[5:], strict=True))
    # another mask (or none) is another sample space: the state is refused
    m.set_validity("train", None)
    with pytest.raises(ValueError, match="valid"):
        ds.insitu.batches(m, "train", **kw).load_state_dict(state)


@pytest.mark.slow
def test_elastic_resume(ds: xr.Dataset, m: xinsitu.SplitManifest) -> None:
    ds.insitu.validity(m, "train", variables=["x"], over="lat")
    kw = dict(batch_size=2, output="numpy", over="lat", seed=4, block_chunks=2, variables=["x", "key"])
    first, states = [], []
    for r in range(2):
        g = ds.insitu.batches(m, "train", rank=r, world_size=2, **kw)
        it = iter(g)
        first += [first_key(next(it)) for _ in range(3)]
        states.append(g.state_dict())
    rest = []
    counts = set()
    for r in range(3):
        g = ds.insitu.batches(m, "train", rank=r, world_size=3, **kw)
        g.load_state_dict(states[r % 2])
        got = [first_key(b) for b in g]
        counts.add(len(got))
        rest += got
    assert len(counts) == 1
    allk = np.concatenate(first + rest)
    want = valid_keys(ds, m, "train", over="lat")
    assert len(np.unique(allk)) == len(allk)
    assert set(allk.tolist()) <= set(want.tolist()) and len(want) - len(allk) < 3 * 2 + 2 * 2


def test_dataset_holds_valid_samples(ds: xr.Dataset, m: xinsitu.SplitManifest) -> None:
    r = ds.insitu.validity(m, "train", variables=["x"], window={"time": 2})
    d = ds.insitu.dataset(m, "train", window={"time": 2})
    assert len(d) == r["valid"]
    assert all(np.isfinite(d[i]["x"]).all() for i in range(len(d)))


def test_json_round_trip(ds: xr.Dataset, m: xinsitu.SplitManifest, tmp_path) -> None:
    ds.insitu.validity(m, "train", variables=["x"], patch={"lat": 3, "lon": 2}, stride={"lon": 1})
    path = tmp_path / "m.json"
    m.to_json(path)
    back = xinsitu.SplitManifest.from_json(path)
    assert back == m
    assert np.array_equal(decode_mask(back.validity["train"]), decode_mask(m.validity["train"]))
    kw = dict(batch_size=4, output="numpy", patch={"lat": 3, "lon": 2}, stride={"lon": 1}, seed=0)
    a = [b["x"] for b in ds.insitu.batches(m, "train", **kw)]
    b = [b["x"] for b in ds.insitu.batches(back, "train", **kw)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    # a damaged or wrong-length bitmap is refused on load
    d = json.loads(m.to_json())
    d["validity"]["train"]["n"] += 9
    with pytest.raises(ValueError, match="wrong length"):
        xinsitu.SplitManifest.from_dict(d)
    d = json.loads(m.to_json())
    d["validity"]["train"]["bitmap"] = "not base64!"
    with pytest.raises(ValueError, match="bitmap"):
        xinsitu.SplitManifest.from_dict(d)
    d = json.loads(m.to_json())
    d["validity"]["nope"] = d["validity"]["train"]
    with pytest.raises(ValueError, match="validity"):
        xinsitu.SplitManifest.from_dict(d)


def test_ten_million_sample_mask_is_small(m: xinsitu.SplitManifest) -> None:
    """A 10^7-sample mask in the JSON: random (the worst case for compression) stays under 2 MB."""
    mask = np.random.default_rng(0).random(10**7) < 0.5
    rec = {"where": "finite", "variables": ["x"], "sampling": {"window": {}, "patch": {}, "stride": {}, "over": []},
           **encode_mask(mask)}
    m.set_validity("train", rec)
    text = m.to_json()
    assert len(text.encode()) < 2 * 1024**2
    assert np.array_equal(decode_mask(xinsitu.SplitManifest.from_json(text).validity["train"]), mask)
    # the ocean/land case: long runs compress to almost nothing
    runs = np.repeat(np.arange(1000) % 2 == 0, 10**4)
    assert len(json.dumps(encode_mask(runs))) < 50_000


def test_other_sampling_refused(ds: xr.Dataset, m: xinsitu.SplitManifest) -> None:
    ds.insitu.validity(m, "train", variables=["x"], window={"time": 3})
    with pytest.raises(ValueError, match="window"):
        ds.insitu.batches(m, "train", batch_size=4)
    with pytest.raises(ValueError, match="over"):
        ds.insitu.batches(m, "train", batch_size=4, window={"time": 3}, over="lat")
    ds.insitu.batches(m, "val", batch_size=4)  # another split has no mask
    ds.insitu.stats(m, "train")  # statistics are over the split's positions, mask or not


def test_bad_arguments(ds: xr.Dataset, m: xinsitu.SplitManifest) -> None:
    with pytest.raises(ValueError, match="where"):
        ds.insitu.validity(m, "train", where="nan")
    with pytest.raises(TypeError, match="where"):
        ds.insitu.validity(m, "train", where=3)
    with pytest.raises(ValueError, match="where"):
        ds.insitu.validity(m, "train", where=lambda b: np.ones(2, bool))
    with pytest.raises(ValueError, match="where"):
        ds.insitu.validity(m, "train", where=lambda b: np.ones(b.sizes["sample"], np.int8))
    with pytest.raises(ValueError, match="split"):
        ds.insitu.validity(m, "nope")
    with pytest.raises(TypeError, match="manifest"):
        ds.insitu.validity({}, "train")
    with pytest.raises(ValueError, match="variables"):
        ds.insitu.validity(m, "train", variables=["zz"])
    with pytest.raises(ValueError, match="block_chunks"):
        ds.insitu.validity(m, "train", block_chunks=0)
    with pytest.raises(ValueError, match="split"):
        m.set_validity("nope", None)
    with pytest.raises(ValueError, match="sampling"):
        m.set_validity("train", {"where": "finite", **encode_mask(np.ones(3, bool))})
    assert m.validity == {}  # nothing stored by a failed pass
    with pytest.warns(UserWarning, match="no sample of .* is valid"):  # said at once, not at the batches
        r = ds.insitu.validity(m, "train", where=lambda b: np.zeros(b.sizes["sample"], bool))
    assert r["valid"] == 0
    with pytest.raises(ValueError, match="no valid sample"):
        ds.insitu.batches(m, "train", batch_size=4)


# ----------------------------------------------------------------------------- index math
@settings(max_examples=60, deadline=None)
@given(chunks=st.lists(st.integers(1, 6), min_size=1, max_size=12), width=st.integers(1, 4),
       free=st.integers(1, 3), data=st.data())
def test_masked_space_properties(chunks: list[int], width: int, free: int, data: st.DataObject) -> None:
    edges = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
    size = int(edges[-1])
    if width > size:
        width = 1
    blocks = np.array(sorted(data.draw(st.sets(st.integers(0, len(chunks) - 1), min_size=1))), np.int64)
    dims = [SampleDim("t", size, width, 1, keep=width > 1, split=True), SampleDim("o", free)]
    plain = SampleSpace(dims, {"t": edges}, blocks)
    n = plain.n_samples
    mask = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    sp = SampleSpace(dims, {"t": edges}, blocks, valid=mask, valid_digest="x")
    assert sp.n_samples == int(mask.sum())
    assert np.array_equal(sp.all_offsets, plain.offsets)
    every = np.concatenate([plain.unit_starts(u) for u in range(len(blocks))]) if n else np.zeros((0, 2))
    kept = [sp.unit_starts(u) for u in range(len(blocks))]
    assert [len(k) for k in kept] == sp.counts.tolist()
    assert np.array_equal(np.concatenate(kept) if kept else every[:0], every[mask])
    ids = np.arange(sp.n_samples)
    unit, local = sp.locate(ids)
    got = np.array([sp.unit_starts(int(u))[int(i)] for u, i in zip(unit, local, strict=True)]).reshape(-1, 2)
    assert np.array_equal(got, every[mask])
    world = data.draw(st.integers(1, 4))
    bs = data.draw(st.integers(1, 4))
    if sp.n_samples:
        seen = [epoch_plan(sp, seed=1, epoch=0, shuffle=True, batch_size=bs, block_chunks=2, drop_last=False,
                           rank=r, world_size=world).all_ids(sp.offsets) for r in range(world)]
        allids = np.concatenate(seen)
        assert len(np.unique(allids)) == len(allids)  # exactly once, disjoint across ranks
        assert sp.n_samples - len(allids) < world * bs
    with pytest.raises(ValueError, match="mask"):
        SampleSpace(dims, {"t": edges}, blocks, valid=np.ones(n + 1, bool))


@pytest.mark.slow
def test_pass_in_many_batches(ds: xr.Dataset, m: xinsitu.SplitManifest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Large samples are tested in smaller batches of the pass: the same mask."""
    import xinsitu.batches.validity as validity

    kw = {"window": {"time": 2}, "over": "lat"}
    ds.insitu.validity(m, "train", variables=["x"], **kw)
    whole = decode_mask(m.validity["train"])
    monkeypatch.setattr(validity, "PASS_BYTES", 3 * 2 * NLON * 4)  # three samples per batch of the pass
    assert validity._pass_batch(sampling(ds, m, "train", variables=["x"], **kw)) == 3
    ds.insitu.validity(m, "train", variables=["x"], **kw)
    assert np.array_equal(decode_mask(m.validity["train"]), whole)
    assert np.array_equal(whole, oracle_mask(ds, m, "train", ["x"], **kw))


@pytest.mark.parametrize("ny", [4, 20])
def test_a_static_variable_spoils_every_sample_or_none(tmp_path, ny: int) -> None:
    """A field without the split dim (a land-sea mask) is part of every sample: one NaN in it makes every
    sample invalid, however many samples a batch of the pass or a part tests at once -- also where its
    first dim's length equals that number (20 samples in one batch; 4 per part of 5)."""
    rng = np.random.default_rng(1)
    lsm = rng.random((ny, 5)).astype("float32")
    lsm[1, 2] = np.nan
    path = str(tmp_path / "static.zarr")
    xr.Dataset({"a": (("time", "y", "x"), rng.normal(size=(40, ny, 5)).astype("float32")),
                "lsm": (("y", "x"), lsm)}).to_zarr(path, encoding={"a": {"chunks": (4, ny, 5)}})
    d = xinsitu.open_zarr(path)
    mm = d.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    whole = d.insitu.validity(mm, "train", variables=["a", "lsm"])
    parts = [d.insitu.validity_part(mm, "train", variables=["a", "lsm"], part=(i, 5)) for i in range(5)]
    assert (whole["valid"], whole["total"]) == (0, 20)
    assert xinsitu.merge_validity(parts)["record"] == whole["record"]
    lsm[1, 2] = 0.5  # and without the NaN, every sample is valid
    d2 = xr.Dataset({"a": d.a.load(), "lsm": (("y", "x"), lsm)})
    assert d2.insitu.validity(d2.insitu.split("time", fractions={"train": 0.5, "val": 0.5}, block={"time": 4}),
                              "train", variables=["a", "lsm"])["valid"] == 20


def test_nat_is_missing_as_nan_is(tmp_path) -> None:
    """A time (CF-decoded, a fill value read as NaT) and a time span with NaT spoil their samples, as NaN
    does: xarray's ``isnull`` and numpy's ``isfinite`` both call NaT missing; batches then hold none."""
    import pandas as pd

    vt = np.array(pd.date_range("1990-01-01", periods=8, freq="h"))
    vt[3] = np.datetime64("NaT", "ns")
    lead = (np.arange(8) * np.timedelta64(1, "h")).astype("m8[ns]")
    lead[5] = np.timedelta64("NaT", "ns")
    path = str(tmp_path / "nat.zarr")
    xr.Dataset({"valid_time": ("time", vt), "lead": ("time", lead), "a": ("time", np.arange(8.0))}).to_zarr(
        path, encoding={v: {"chunks": (4,)} for v in ("valid_time", "lead", "a")})
    d = xinsitu.open_zarr(path)
    assert np.isnat(xr.open_zarr(path).valid_time.values[3])  # (stored as CF's fill value)
    mm = d.insitu.split("time", fractions={"train": 1.0})
    for variables, valid in ((["a"], 8), (["valid_time"], 7), (["lead"], 7), (None, 6)):  # the last one recorded
        assert d.insitu.validity(mm, "train", variables=variables)["valid"] == valid, variables
    (b,) = d.insitu.batches(mm, "train", batch_size=6, shuffle=False, output="numpy")
    assert list(b["a"]) == [0, 1, 2, 4, 6, 7]


# ----------------------------------------------------------------------------- parts (issue 37)
@pytest.mark.parametrize("kw", [*SAMPLINGS[1:], {"where": "fn"}])
def test_parts_merge_to_the_mask_of_one_pass(ds: xr.Dataset, m: xinsitu.SplitManifest, kw: dict) -> None:
    """``validity_part`` in any number of shares, merged in any order (through JSON), gives what
    ``validity()`` gives, and stores the same mask in the manifest."""
    kw = dict(kw)
    if kw.pop("where", None):
        kw["where"] = lambda b: (b["x"].isnull().sum(["lat", "lon"]) <= 6).values
    whole = ds.insitu.validity(m, "train", variables=["x"], **kw)
    assert m.validity["train"] == whole["record"] and 0 < whole["valid"] < whole["total"]
    units = len(m.splits["train"])
    for n in (1, 2, 5, units + 3):
        parts = [json.loads(json.dumps(ds.insitu.validity_part(m, "train", variables=["x"], part=(i, n), **kw)))
                 for i in range(n)]
        np.random.default_rng(n).shuffle(parts)
        other = copy.deepcopy(m)
        other.set_validity("train", None)
        assert xinsitu.merge_validity(parts, other) == whole
        assert other.validity["train"] == whole["record"]


def test_merge_validity_refuses(ds: xr.Dataset, m: xinsitu.SplitManifest) -> None:
    parts = [ds.insitu.validity_part(m, "train", variables=["x"], part=(i, 3)) for i in range(3)]
    with pytest.raises(ValueError, match=r"part\(s\) \[0\] missing"):
        xinsitu.merge_validity(parts[1:])
    with pytest.raises(ValueError, match=r"expected partial results of ds\.insitu\.validity_part, got dict"):
        xinsitu.merge_validity([ds.insitu.stats_part(m, "train", variables=["x"], part=(0, 1))])
    with pytest.raises(ValueError, match="different jobs"):
        xinsitu.merge_validity([parts[0], ds.insitu.validity_part(m, "train", variables=["y"], part=(1, 3)), parts[2]])
    with pytest.raises(ValueError, match="different jobs"):
        xinsitu.merge_validity([parts[0], ds.insitu.validity_part(m, "train", variables=["x"], part=(1, 3),
                                                                  window={"time": 2}), parts[2]])
    lazy = xinsitu.open_zarr(ds.encoding["source"])
    north, south = lazy.isel(lat=slice(0, 2)), lazy.isel(lat=slice(2, 4))  # tasks that opened other regions
    mixed = [north.insitu.validity_part(m, "train", variables=["x"], part=(0, 2)),
             south.insitu.validity_part(m, "train", variables=["x"], part=(1, 2))]
    with pytest.raises(ValueError, match=r"different jobs \(they differ in \['selection'\]\)"):
        xinsitu.merge_validity(mixed)
    with pytest.raises(ValueError, match="another manifest"):
        xinsitu.merge_validity(parts, ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5}))
    copied = str(ds.encoding["source"]) + "-copy"  # another archive of the same geometry (a re-processed one)
    shutil.copytree(ds.encoding["source"], copied)
    other = xinsitu.open_zarr(copied).insitu.validity_part(m, "train", variables=["x"], part=(1, 3))
    with pytest.raises(ValueError, match=r"different jobs \(they differ in \['archive'\]\)"):
        xinsitu.merge_validity([parts[0], other, parts[2]])
    bad = json.loads(json.dumps(parts[1]))
    bad["mask"]["bitmap"] = bad["mask"]["bitmap"][:-4] + "AAAA"
    with pytest.raises(ValueError, match="part 1"):
        xinsitu.merge_validity([parts[0], bad, parts[2]])
    with pytest.raises(TypeError, match="part"):
        ds.insitu.validity_part(m, "train", part=[0, 1, 2])
    with pytest.raises(ValueError, match="stats_part"):
        xinsitu.merge_stats(parts)


def _above(limit: float):
    return lambda b: (b["x"] > limit).any(dim=["lat", "lon"])


THRESHOLD = 0.5
LIMITS = {"x": 0.5}


def _over_the_threshold(b):
    return (b["x"] > THRESHOLD).any(dim=["lat", "lon"])


def _over_the_limits(b):
    return all(bool((b[k] > v).any()) for k, v in LIMITS.items()) & (b["x"] > 0).any(dim=["lat", "lon"])


class _Above:
    def __init__(self, limit: float, op=np.greater):
        self.limit, self.op = limit, op

    def __call__(self, b):
        return self.op(b["x"], self.limit).any(dim=["lat", "lon"])


def test_parts_of_different_predicates_are_never_merged(ds: xr.Dataset, m: xinsitu.SplitManifest) -> None:
    """Two lambdas, two closures of one factory with other limits, or a module-level function whose
    threshold changed between tasks share a label (``fn:<lambda>``, ``fn:_above.<locals>.<lambda>``) but
    not their parts: merged, they would stitch two masks into one that neither predicate gives."""
    global THRESHOLD

    def parts(where, n=2):
        return [ds.insitu.validity_part(m, "train", where=where, variables=["x"], part=(i, n)) for i in range(n)]

    def mixed(a, b):
        return [parts(a)[0], parts(b)[1]]

    for a, b in [(lambda b: b["x"].isnull().any(dim=["lat", "lon"]), lambda b: (b["x"] > 0).any(dim=["lat", "lon"])),
                 (_above(0.0), _above(3.0)), (_Above(0.0), _Above(3.0)), (_Above(0.0).__call__, _Above(3.0).__call__),
                 (_Above(0.0, np.greater), _Above(0.0, np.less))]:
        with pytest.raises(ValueError, match=r"different jobs \(they differ in \['where_code'\]\)"):
            xinsitu.merge_validity(mixed(a, b))
    first = parts(_over_the_threshold)[0]
    THRESHOLD = 2.0
    try:
        with pytest.raises(ValueError, match="where_code"):
            xinsitu.merge_validity([first, parts(_over_the_threshold)[1]])
    finally:
        THRESHOLD = 0.5
    first = parts(_over_the_limits)[0]
    LIMITS["x"] = 2.0  # a module-level dict, read in a generator expression
    try:
        with pytest.raises(ValueError, match="where_code"):
            xinsitu.merge_validity([first, parts(_over_the_limits)[1]])
    finally:
        LIMITS["x"] = 0.5
    same = mixed(_above(1.0), _above(1.0))  # the same predicate made twice: its parts merge
    assert xinsitu.merge_validity(same)["valid"] == ds.insitu.validity(copy.deepcopy(m), "train", where=_above(1.0),
                                                                       variables=["x"])["valid"]
