"""Manifests at scale: compact runs, old files, validation on load, refined grids.

Byte-size bounds here are sizes, not timings; the speed of archives of 10^6-10^7 chunks
is measured by ``bench/scale_bench.py``.
"""

from __future__ import annotations

import base64
import json
import tracemalloc
import zlib
from unittest import mock

import numpy as np
import pytest
import xarray as xr
from hypothesis import given, settings
from hypothesis import strategies as st

import xinsitu
import xinsitu.index.manifest as manifest_module
from tests.conftest import CT, NT
from xinsitu.index.geometry import chunk_breaks, common_edges, geometry_of
from xinsitu.index.manifest import SplitManifest, fingerprint_of, fingerprint_v1
from xinsitu.index.runs import Blocks, _decode_owner, _encode_owner, decode_steps, encode_steps
from xinsitu.index.source import resolve
from xinsitu.index.split import contiguous_split, random_split

FR = {"train": 0.8, "val": 0.1, "test": 0.1}


def bare_manifest(nblocks: int, splits: dict, chunk: int = 1) -> SplitManifest:
    """A manifest over a 1-d grid of ``nblocks`` blocks of ``chunk`` positions (no dataset)."""
    edges = np.arange(nblocks + 1, dtype=np.int64) * chunk
    sizes = {"time": nblocks * chunk}
    coords = {"time": None}
    return SplitManifest(dims=["time"], sizes=sizes, edges={"time": edges}, splits=splits, labels={},
                         fingerprint=fingerprint_of(["time"], sizes, {"time": edges}, coords),
                         extra={"coords": coords})


# ----------------------------------------------------------------------------- run-length encoding
@settings(deadline=None)
@given(st.lists(st.integers(0, 60), max_size=80))
def test_blocks_encode_decode_identity(ids):
    """Any id sequence (unsorted, repeated) comes back as it was, in its order."""
    b = Blocks.from_ids(ids)
    assert b.ids().tolist() == ids and list(b) == ids and len(b) == len(ids)
    assert b == ids and b == Blocks.from_ids(np.asarray(ids))
    assert [b[i] for i in range(len(ids))] == ids and [b[-1 - i] for i in range(len(ids))] == ids[::-1]
    assert b.nruns == sum(1 for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1] + 1)
    assert np.asarray(b).dtype == np.int64
    if ids:
        assert b.bounds() == (min(ids), max(ids))
    assert b.ascending() == all(x < y for x, y in zip(ids, ids[1:], strict=False))


@settings(deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=60), st.integers(0, 5))
def test_edges_steps_identity(widths, start):
    e = np.concatenate([[start], start + np.cumsum(widths)]).astype(np.int64)
    runs = encode_steps(e)
    assert np.array_equal(decode_steps(runs, "edges"), e)
    assert len(runs) <= len(e)


def test_regular_edges_are_two_runs():
    e = np.concatenate([np.arange(0, 10_000_000, 24), [10_000_001]]).astype(np.int64)
    runs = encode_steps(e)
    assert len(runs) == 2 and np.array_equal(decode_steps(runs, "edges"), e)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(0, 6), min_size=1, max_size=300))
def test_owner_encode_decode_identity(nsplits, owner):
    owner = np.minimum(np.asarray(owner), nsplits)  # nsplits: left out
    d = json.loads(json.dumps(_encode_owner(owner, nsplits)))
    got = _decode_owner(d, len(owner))
    assert np.array_equal(np.where(got >= nsplits, nsplits, got), owner)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 400), st.sampled_from([FR, {"a": 0.5, "b": 0.5}, {"a": 0.3, "b": 0.3, "c": 0.2, "d": 0.2}]),
       st.integers(0, 2), st.integers(0, 99), st.booleans())
def test_manifest_json_exactly_once(n, fractions, gap, seed, contiguous):
    """Through JSON (runs or owner array), every block is in at most one split and every split
    keeps exactly its blocks; with gap 0 and random splits, every block is in exactly one."""
    try:
        splits = contiguous_split(n, fractions, gap) if contiguous else random_split((n,), fractions, gap, seed)
    except ValueError:
        return
    m = bare_manifest(n, splits)
    back = SplitManifest.from_json(m.to_json())
    assert back == m
    if all(b.ascending() for b in m.splits.values()):
        with mock.patch.object(manifest_module, "MAX_RUNS", 0):  # the owner-array form, for small grids too
            text = m.to_json()
        assert SplitManifest.from_json(text) == m
    owned = np.concatenate([back.blocks(k) for k in back.splits])
    assert len(np.unique(owned)) == len(owned) and owned.min() >= 0 and owned.max() < n  # disjoint, in range
    for k in splits:
        assert np.array_equal(back.blocks(k), np.asarray(splits[k]))
    if gap == 0:
        assert len(owned) == n  # exactly once


# ----------------------------------------------------------------------------- compact files
def test_contiguous_manifest_of_ten_million_chunks_is_small():
    n = 10_000_000
    m = bare_manifest(n, contiguous_split(n, FR, 1), chunk=1)
    text = m.to_json()
    assert len(text.encode()) <= 2_000  # a few hundred bytes: runs, and edges as step runs (SPEC: <= 100 kB)
    assert SplitManifest.from_json(text) == m


def test_random_manifest_is_compact():
    """A contiguous=False split stores one packed owner per block: <= 0.4 bytes per block (4 MB per 10^7)."""
    n = 1_000_000
    m = bare_manifest(n, random_split((n,), FR, 0, 0))
    text = m.to_json()
    d = json.loads(text)
    assert "owner" in d and d["owner"]["bits"] == 2
    assert len(text.encode()) <= 0.4 * n
    assert SplitManifest.from_json(text) == m


@pytest.mark.parametrize("k", [3, 5])
def test_a_random_split_in_five_folds_is_compact(k):
    """k equal random splits (5-fold cross-validation) of 10^6 blocks: <= 0.4 bytes per block, 4 MB per 10^7
    (zlib and base64 took 0.43 for 5); a manifest written with zlib and base64 still loads."""
    import base64
    import zlib

    n = 1_000_000
    m = bare_manifest(n, random_split((n,), {f"fold{i}": 1 / k for i in range(k)}, 0, 0))
    text = m.to_json()
    assert len(text.encode()) <= 0.4 * n
    assert SplitManifest.from_json(text) == m
    d = json.loads(text)
    owner = _decode_owner(d["owner"], n)
    bits, per = d["owner"]["bits"], 8 // d["owner"]["bits"]
    own = np.concatenate([owner, np.zeros(-n % per, np.uint8)]).reshape(-1, per)
    packed = np.zeros(len(own), np.uint8)
    for j in range(per):
        packed |= own[:, j] << np.uint8(8 - bits * (j + 1))
    d["owner"].update(encoding="zlib+base64", data=base64.b64encode(zlib.compress(packed.tobytes())).decode())
    assert SplitManifest.from_json(json.dumps(d)) == m


def test_old_manifest_with_explicit_lists_loads(era5_path, tmp_path):
    """Format 1 (every edge and block id listed, the old fingerprint) loads and gives the same batches."""
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.2, "test": 0.2}, gap=1)
    coords = m.extra["coords"]
    edges = {d: [int(x) for x in e] for d, e in m.edges.items()}
    old = {"format": "xinsitu.SplitManifest", "version": 1, "dims": m.dims, "sizes": m.sizes, "edges": edges,
           "splits": {k: [int(b) for b in v] for k, v in m.splits.items()}, "labels": m.labels, "seed": m.seed,
           "gap": m.gap, "contiguous": m.contiguous, "method": m.method,
           "fingerprint": fingerprint_v1(m.dims, m.sizes, edges, coords), "snapshot": m.snapshot, "stats": None,
           "extra": m.extra}
    p = tmp_path / "old.json"
    p.write_text(json.dumps(old))
    back = SplitManifest.from_json(p)
    assert back == m  # and it now carries the current fingerprint
    new = json.loads(back.to_json())
    assert new["version"] == 2 and new["splits"]["train"] == {"runs": [list(map(int, (m.splits["train"][0],
                                                                                       m.splits["train"][-1] + 1)))]}
    kw = dict(batch_size=7, shuffle=True, seed=3, output="numpy")
    a = [b["t2m"] for b in ds.insitu.batches(m, "train", **kw)]
    b = [b["t2m"] for b in ds.insitu.batches(back, "train", **kw)]
    assert len(a) == len(b) and all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a, b, strict=True))
    old["edges"]["time"][1] += 1  # an edited old file is still caught
    with pytest.raises(ValueError, match="fingerprint"):
        SplitManifest.from_dict(old)


def test_state_of_a_manifest_is_the_same_after_json(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions=FR, gap=1)
    back = SplitManifest.from_json(m.to_json())
    g1 = ds.insitu.batches(m, "train", batch_size=5)
    g2 = ds.insitu.batches(back, "train", batch_size=5)
    assert g1.state_dict() == g2.state_dict()
    g2.load_state_dict(g1.state_dict())


# ----------------------------------------------------------------------------- validation on load
def _valid() -> dict:
    return bare_manifest(10, {"train": Blocks.range(0, 6), "val": Blocks.range(7, 10)}, chunk=3).to_dict()


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["splits"].update(train={"runs": [[0, 11]]}),
     r"split 'train' holds chunk block 10, outside the grid of 10"),
    (lambda d: d["splits"].update(train={"runs": [[-1, 3]]}), r"split 'train' holds chunk block -1, outside the grid"),
    (lambda d: d["splits"].update(train=[0, 1, 2, 99]), r"split 'train' holds chunk block 99, outside the grid"),
    (lambda d: d["splits"].update(train={"runs": [[0, 8]]}),
     r"splits 'train' and 'val' overlap \(both hold chunk block 7\)"),
    (lambda d: d["splits"].update(train=[0, 1, 2, 1]), r"split 'train' holds chunk block 1 twice"),
    (lambda d: d["splits"].update(train={"runs": [[0, 3], [2, 4]]}), r"split 'train' holds chunk block 2 twice"),
    (lambda d: d["splits"].update(train={"runs": [[3, 3]]}), r"'runs' must be a list of \[start, stop\] integer pairs"),
    (lambda d: d["splits"].update(train={"runs": [[0, 2.5]]}), r"'runs' must be a list of \[start, stop\]"),
    (lambda d: d["splits"].update(train=[0, True]), r"split 'train' must list integer chunk blocks"),
    (lambda d: d["splits"].update(train="0-5"), r"split 'train' must be a list of chunk blocks or"),
    (lambda d: d.update(splits=[]), r"'splits' must be a non-empty dict"),
    (lambda d: d.update(dims="time"), r"'dims' must be a non-empty list"),
    (lambda d: d["sizes"].update(time=-1), r"'sizes' must map each of \['time'\] to a non-negative integer"),
    (lambda d: d["edges"].update(time={"steps": [[0, 3, 5], [12, 0, 1]]}), r"'edges' of 'time' must rise strictly"),
    (lambda d: d["edges"].update(time={"steps": "0:30:3"}),
     r"'edges' of 'time' must be a list of \[first, step, count\]"),
    (lambda d: d["edges"].update(time=[0, 3, 6]), r"'edges' of 'time' must rise strictly from 0 to its length 30"),
    (lambda d: d.update(gap=-1), r"'gap' has a wrong type or value"),
    (lambda d: d.update(seed="0"), r"'seed' has a wrong type or value"),
    (lambda d: d.update(contiguous=1), r"'contiguous' has a wrong type or value"),
    (lambda d: d.update(method="pickle"), r"'method' has a wrong type or value"),
    (lambda d: d.update(version="2"), r"'version' must be a positive integer"),
    (lambda d: d.update(version=3), r"newer than this xinsitu understands"),
    # hand-made numbers past int64 (they gave OverflowError) and an empty split (it loaded)
    (lambda d: d["splits"].update(train={"runs": [[0, 10**30]]}), r"split 'train' holds chunk block 9+, outside"),
    (lambda d: d["splits"].update(train=[0, 10**30]), r"split 'train' holds chunk block 10+, outside the grid"),
    (lambda d: d["splits"].update(val={"runs": []}), r"split 'val' holds no chunk block: an empty split is refused"),
    (lambda d: d["splits"].update(val=[]), r"split 'val' holds no chunk block"),
    (lambda d: d["sizes"].update(time=10**30), r"'sizes' must map each of \['time'\] to a non-negative integer"),
    (lambda d: d["edges"].update(time={"steps": [[10**30, 1, 2]]}), r"'edges' of 'time': .* past the 64-bit"),
    (lambda d: d["edges"].update(time={"steps": [[0, 3, 10**6]]}),
     r"'edges' of 'time' hold 1000000 chunk edges, more than its length 30 allows \(31\)"),
    (lambda d: (d["sizes"].update(time=10**10), d["edges"].update(time={"steps": [[0, 1, 10**10 + 1]]})),
     r"'edges' of 'time' hold 10000000001 chunk edges, more than this xinsitu loads"),
    (lambda d: d.update(gap=10**30), r"'gap' has a wrong type or value"),
    (lambda d: d.update(block={"time": 10**30}), r"'block' must map split dims"),
])
def test_invalid_manifest_raises_naming_the_problem(edit, match):
    d = _valid()
    SplitManifest.from_dict(d)  # the unedited one loads
    edit(d)
    with pytest.raises(ValueError, match=match):
        SplitManifest.from_dict(json.loads(json.dumps(d)))


def test_invalid_owner_array_raises():
    n = 50_000
    d = bare_manifest(n, random_split((n,), FR, 0, 1)).to_dict()
    assert "owner" in d
    SplitManifest.from_dict(d)
    bad = json.loads(json.dumps(d))
    bad["owner"]["data"] = bad["owner"]["data"][:-40]
    with pytest.raises(ValueError, match="'owner' data"):
        SplitManifest.from_dict(bad)
    bad = json.loads(json.dumps(d))
    bad["owner"]["length"] = n + 1
    with pytest.raises(ValueError, match="'owner' holds 50001 chunk blocks, the grid has 50000"):
        SplitManifest.from_dict(bad)
    bad = json.loads(json.dumps(d))
    bad["splits"]["val"] = {"owner": 0}
    with pytest.raises(ValueError, match="splits 'train' and 'val' overlap"):
        SplitManifest.from_dict(bad)
    with pytest.raises(ValueError, match="not valid JSON"):
        SplitManifest.from_json("{'format': 1}")


def _peak_bytes(f) -> int:
    """Peak memory (traced: Python and numpy allocations) while ``f()`` runs."""
    tracemalloc.start()
    try:
        f()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_hand_made_counts_are_bounded_before_anything_is_allocated():
    """A few bytes of JSON claiming 2*10^7 edges, or a 64 MiB zlib bomb as an 8-sample validity bitmap:
    ValueError before the edges are decoded or the bitmap inflated (they were allocated, then checked)."""
    d = _valid()
    d["edges"]["time"] = {"steps": [[0, 1, 2 * 10**7]]}
    with pytest.raises(ValueError, match="hold 20000000 chunk edges, more than its length 30 allows"):
        SplitManifest.from_dict(d)
    assert _peak_bytes(lambda: pytest.raises(ValueError, SplitManifest.from_dict, d)) < 8 << 20
    d = _valid()
    bomb = base64.b64encode(zlib.compress(b"\0" * (64 << 20), 9)).decode()
    d["validity"] = {"train": {"n": 8, "valid": 0, "digest": "0", "bitmap": bomb, "where": "finite",
                               "sampling": {"window": None, "patch": None, "stride": None, "over": None}}}
    with pytest.raises(ValueError, match="validity of split 'train': the bitmap holds more than 8 bits, not the 8"):
        SplitManifest.from_dict(d)
    assert _peak_bytes(lambda: pytest.raises(ValueError, SplitManifest.from_dict, d)) < 8 << 20


def test_from_json_tells_text_from_a_path(tmp_path, monkeypatch):
    """JSON text that is not an object ("[]", "null") is refused as such (it was taken for a path:
    FileNotFoundError); nesting past Python's limit is a ValueError (RecursionError); paths still load."""
    for text, kind in [("[]", "an array"), ("null", "null"), (" 3", "a number"), ('"m.json"', "a string")]:
        with pytest.raises(ValueError, match=f"not an xinsitu SplitManifest: the JSON text is {kind}"):
            SplitManifest.from_json(text)
    deep = json.dumps(_valid())[:-1] + ', "stats": {"a": ' + "[" * 100_000 + "]" * 100_000 + "}}"
    with pytest.raises(ValueError, match="nested too deeply"):
        SplitManifest.from_json(deep)
    m = SplitManifest.from_dict(_valid())
    p = tmp_path / "m.json"
    m.to_json(p)
    assert SplitManifest.from_json(p) == m and SplitManifest.from_json(str(p)) == m
    assert SplitManifest.from_json("\ufeff" + m.to_json()) == m  # a byte-order mark left by an editor
    monkeypatch.chdir(tmp_path)
    m.to_json("null")  # a file named like a JSON text is read as the file
    assert SplitManifest.from_json("null") == m
    with pytest.raises(FileNotFoundError):
        SplitManifest.from_json(str(tmp_path / "missing.json"))


# ----------------------------------------------------------------------------- geometry at scale
def test_geometry_of_a_regular_grid_needs_no_per_chunk_array(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    src = resolve(ds)
    for sub in (ds, ds.isel(time=slice(3, 50)), ds.isel(time=slice(5, None)), ds.isel(time=slice(1, None, 3)),
                ds.isel(time=slice(None, None, -1))):
        s = resolve(sub)
        brk = chunk_breaks(s["t2m"], "time")
        ids = np.asarray(s["t2m"].index[0]) // CT  # what the per-position way found
        assert np.array_equal(brk, np.flatnonzero(ids[1:] != ids[:-1]) + 1)
    scattered = ds.isel(time=[0, 1, 9, 17, 18, 40])
    assert np.array_equal(common_edges(resolve(scattered), "time"), [0, 2, 3, 5, 6])
    assert geometry_of(resolve(scattered)).variables["t2m"].nchunks == 4  # chunks 0, 1, 2, 5
    assert geometry_of(resolve(ds.isel(time=[40, 0, 9]))).variables["t2m"].nchunks == 3
    assert np.array_equal(geometry_of(src).edges["time"], list(range(0, NT, CT)) + [NT])


def test_geometry_is_computed_once_per_dataset(era5_path, monkeypatch):
    import xinsitu.index.geometry as geo

    calls = []
    real = geo.geometry_of
    monkeypatch.setattr(geo, "geometry_of", lambda s: calls.append(1) or real(s))
    ds = xinsitu.open_zarr(era5_path)
    g = ds.insitu.geometry
    assert ds.insitu.geometry is g and ds.insitu.chunks == {"time": CT, "lat": 6, "lon": 10}
    ds.insitu.split("time", fractions=FR)
    assert len(calls) == 1
    ds["t2m"] = ds["t2m"].isel(time=slice(None))  # a data variable replaced: computed again
    assert ds.insitu.geometry is not g and len(calls) == 2


# ----------------------------------------------------------------------------- refined and other grids
@pytest.fixture(scope="module")
def refined_path(era5_path, tmp_path_factory):
    """The era5 archive rechunked finer along time (chunks of CT / 2 = 4): every edge of the
    original is an edge here."""
    path = str(tmp_path_factory.mktemp("refined") / "fine.zarr")
    ds = xr.open_zarr(era5_path).load()
    enc = {v: {"chunks": (CT // 2, *ds[v].shape[1:]) if "time" in ds[v].dims else ds[v].shape}
           for v in ds.data_vars}
    for v in ds.data_vars:
        ds[v].encoding = {k: x for k, x in ds[v].encoding.items() if k not in ("chunks", "preferred_chunks")}
    ds.to_zarr(path, encoding=enc, consolidated=True, zarr_format=3)
    return path


@pytest.mark.parametrize("how", [dict(fractions=FR, gap=1),
                                 dict(fractions={"train": 0.6, "val": 0.4}, contiguous=False, seed=4)])
@pytest.mark.parametrize("window", [None, {"time": 3}])
@pytest.mark.slow
def test_manifest_on_refined_grid_keeps_every_sample_in_its_split(era5_path, refined_path, how, window):
    coarse, fine = xinsitu.open_zarr(era5_path), xinsitu.open_zarr(refined_path)
    assert fine.insitu.chunks["time"] == CT // 2
    m = SplitManifest.from_json(coarse.insitu.split("time", **how).to_json())
    owner = np.full(NT, -1)
    for i, k in enumerate(m.splits):
        for b in m.splits[k]:
            owner[m.edges["time"][b]:m.edges["time"][b + 1]] = i
    ref = xr.open_zarr(era5_path, chunks=None)
    w = (window or {}).get("time", 1)
    for i, k in enumerate(m.splits):
        kw = dict(batch_size=5, shuffle=False, window=window, output="xarray")
        on_fine = list(fine.insitu.batches(m, k, **kw))
        on_coarse = list(coarse.insitu.batches(m, k, **kw))
        assert len(on_fine) == len(on_coarse) > 0
        for bf, bc in zip(on_fine, on_coarse, strict=True):
            xr.testing.assert_identical(bf, bc)  # the same samples in the same order, the same values
        starts = np.concatenate([ref.indexes["time"].get_indexer(b.time.values[:, 0] if window else b.time.values)
                                 for b in on_fine])
        assert (starts >= 0).all()
        for s in starts:  # no sample touches another split's chunk or a gap: leak-free
            assert (owner[s:s + w] == i).all(), (k, s)
        first = on_fine[0].isel(sample=0)
        exp = ref.isel(time=slice(int(starts[0]), int(starts[0]) + w)) if window else ref.isel(time=int(starts[0]))
        for v in ("t2m", "tp"):
            np.testing.assert_array_equal(first[v].values, exp[v].values)
        # shuffled: exactly the same samples as on the coarse grid
        kw = dict(batch_size=5, shuffle=True, seed=1, window=window, output="numpy")
        gf = fine.insitu.batches(m, k, **kw)
        gc = coarse.insitu.batches(m, k, **kw)
        assert gf.n_samples == gc.n_samples and sorted(np.concatenate(gf.batch_ids())) == sorted(
            np.concatenate(gc.batch_ids()))


def test_manifest_on_coarser_or_other_grid_is_refused(era5_path, refined_path, tmp_path):
    coarse, fine = xinsitu.open_zarr(era5_path), xinsitu.open_zarr(refined_path)
    m_fine = fine.insitu.split("time", fractions=FR)
    with pytest.raises(ValueError, match="chunk grid along 'time'.*refines it"):
        coarse.insitu.batches(m_fine, "train")  # coarser than the manifest's grid
    other = str(tmp_path / "other.zarr")
    ds = xr.open_zarr(era5_path).load()
    for v in ds.data_vars:
        ds[v].encoding = {}
    ds.to_zarr(other, encoding={v: {"chunks": (6, *ds[v].shape[1:])} for v in ds.data_vars if "time" in ds[v].dims},
               consolidated=True, zarr_format=3)
    m = coarse.insitu.split("time", fractions=FR)
    with pytest.raises(ValueError, match="chunk grid along 'time' \\(chunks of 6\\)"):
        xinsitu.open_zarr(other).insitu.batches(m, "train")  # edges at 6, 12, ...: not every 8 is one
    with pytest.raises(ValueError, match="of length"):
        fine.isel(time=slice(0, NT - 1)).insitu.batches(m, "train")


# ----------------------------------------------------------------------------- len without the plan
@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=40), st.booleans(), st.integers(1, 6), st.data(),
       st.integers(1, 7), st.booleans(), st.booleans())
def test_epoch_size_equals_the_plan(counts, equal, world_size, data, batch_size, drop_last, shuffle):
    """``epoch_size`` (what ``len(gen)`` and the repr use) is the plan's, wherever it answers."""
    from xinsitu.index.plan import epoch_plan, epoch_size
    from xinsitu.index.sampling import SampleDim, SampleSpace

    if equal:
        counts = [counts[0] or 1] * len(counts)
    edges = np.concatenate([[0], np.cumsum(np.maximum(counts, 1))]).astype(np.int64)
    space = SampleSpace([SampleDim("t", int(edges[-1]), split=True)], {"t": edges}, np.arange(len(counts)))
    rank = data.draw(st.integers(0, world_size - 1))
    p = epoch_plan(space, seed=1, epoch=2, shuffle=shuffle, batch_size=batch_size, block_chunks=3,
                   drop_last=drop_last, rank=rank, world_size=world_size)
    size = epoch_size(space, world_size=world_size, rank=rank, batch_size=batch_size, drop_last=drop_last)
    if world_size == 1 or equal:
        assert size == (p.n_samples, len(p.units))
    else:
        assert size is None or size == (p.n_samples, len(p.units))


def test_len_and_repr_match_the_plan(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions=FR)
    for kw in (dict(world_size=3, rank=1), dict(world_size=1), dict(window={"time": 3}, world_size=2, rank=0)):
        gen = ds.insitu.batches(m, "train", batch_size=4, **kw)
        n = len(gen)
        text = repr(gen)  # made without the plan where the order cannot change it
        p = gen.plan()
        assert n == p.n_batches and f"{p.n_batches} x 4 samples" in text
        assert f"quality {gen.shuffle_quality(50):.2f}" in text and repr(gen) == text


# ----------------------------------------------------------------------------- steps in bounded passes
def _encode_steps_whole(values):
    """``encode_steps`` as it was, in one pass over the whole array (the reference)."""
    v = np.asarray(values, dtype=np.int64)
    if len(v) < 2:
        return [[int(x), 0, 1] for x in v]
    d = np.diff(v)
    starts = np.concatenate([[0], np.flatnonzero(d[1:] != d[:-1]) + 1])
    counts = np.diff(np.concatenate([starts, [len(v)]]))
    steps = np.concatenate([d, [0]])[starts]
    return np.stack([v[starts], steps, counts], axis=1).tolist()


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.integers(0, 3), max_size=40), block=st.integers(1, 6))
def test_steps_in_blocks_are_the_steps_of_the_whole(steps, block):
    import xinsitu.index.runs as runs_module

    v = np.cumsum([0, *steps]).astype(np.int64)
    old = runs_module._STEP_BLOCK
    runs_module._STEP_BLOCK = block  # runs that cross block boundaries
    try:
        runs = runs_module.encode_steps(v)
    finally:
        runs_module._STEP_BLOCK = old
    assert runs == _encode_steps_whole(v)
    assert np.array_equal(runs_module.decode_steps(runs, "edges"), v)


def test_regular_edges_are_one_shared_array():
    from xinsitu.index.geometry import regular_edges

    for start, length, c in [(0, 100, 7), (3, 100, 7), (7, 98, 7), (5, 1, 7), (0, 0, 3), (2, 5, 1)]:
        ids = (np.arange(start, start + length)) // c
        brk = np.flatnonzero(ids[1:] != ids[:-1]) + 1
        e = regular_edges(start, length, c)
        assert np.array_equal(e, np.concatenate([[0], brk, [length]])) and not e.flags.writeable
        assert regular_edges(start + c, length, c) is e  # the same grid: the same array while one is alive


def test_one_edges_array_per_grid_and_one_position_index(era5_path):
    """The Dataset's geometry, a derived Dataset's, a generator's and a manifest loaded from JSON
    share one edges array; the generator reuses the Dataset's sources (no second position index)."""
    ds = xinsitu.open_zarr(era5_path)
    g = ds.insitu.geometry
    assert ds[["t2m"]].insitu.geometry.edges["time"] is g.edges["time"]
    m = SplitManifest.from_json(ds.insitu.split("time", fractions=FR).to_json())
    assert m.edges["time"] is not g.edges["time"]
    gen = ds.insitu.batches(m, "train", batch_size=4, output="numpy")
    assert m.edges["time"] is g.edges["time"]  # the manifest took the Dataset's (equal) array
    from xinsitu.index.geometry import dataset_geometry

    sources, _ = dataset_geometry(ds)
    assert gen.sources["t2m"] is sources["t2m"]
