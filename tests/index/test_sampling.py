"""Sample geometry: windows, patches (stride), `over` dims, multi-dim splits, mixed
variables and Zarr layouts -- every batch against plain xarray, and exactly-once."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xinsitu


def general_oracle(ds: xr.Dataset, gen, starts: np.ndarray) -> xr.Dataset:
    """Plain xarray for samples at ``starts``: vectorised isel, windows/tiles as 2-D indexers."""
    ind = {}
    for k, d in enumerate(gen.space.dims):
        if d.keep:
            ind[d.name] = xr.DataArray(starts[:, k, None] + np.arange(d.width), dims=("sample", d.name))
        else:
            ind[d.name] = xr.DataArray(starts[:, k], dims="sample")
    sel = ds[list(gen.layouts)]
    ref = sel.isel({k: v for k, v in ind.items() if k in sel.dims}).load()
    out = {}
    for v, lay in gen.layouts.items():
        out[v] = ref[v].transpose("sample", *lay.out_dims) if lay.has_sample_axis else ref[v]
    return xr.Dataset(out, coords=ref.coords, attrs=ref.attrs)


def run_epoch(ds: xr.Dataset, gen, output: str = "numpy") -> np.ndarray:
    """Compare every batch with the oracle; return all sample ids seen, in order."""
    seen = []
    batches = list(gen)
    ids = gen.batch_ids()
    assert len(batches) == len(ids) == len(gen)
    for b, i in zip(batches, ids, strict=True):
        unit, local = gen.space.locate(i)
        starts = np.stack([gen.space.unit_starts(int(u))[int(k)] for u, k in zip(unit, local, strict=True)])
        ref = general_oracle(ds, gen, starts)
        if output == "xarray":
            xr.testing.assert_identical(b, ref)
        else:
            for v in gen.layouts:
                got = b[v] if output == "numpy" else b[v].numpy()
                assert got.shape == ref[v].shape, (v, got.shape, ref[v].shape)
                assert got.dtype == ref[v].dtype
                assert np.array_equal(got, ref[v].values, equal_nan=True), v
        seen.append(i)
    return np.concatenate(seen) if seen else np.zeros(0, np.int64)


def write(path, ds: xr.Dataset, chunks: dict[str, dict[str, int]], **kw) -> xr.Dataset:
    enc = {v: {"chunks": tuple(chunks.get(v, {}).get(d, ds.sizes[d]) for d in ds[v].dims)} for v in ds.data_vars}
    for v, extra in kw.get("extra", {}).items():
        enc[v].update(extra)
    ds.to_zarr(path, mode="w", zarr_format=kw.get("zarr_format", 3), encoding=enc, consolidated=True)
    return xinsitu.open_zarr(str(path))


def grid_ds(nt=24, ny=12, nx=10, seed=0) -> xr.Dataset:
    rng = np.random.default_rng(seed)
    return xr.Dataset(
        {"a": (("time", "lat", "lon"), rng.standard_normal((nt, ny, nx)).astype("f4")),
         "b": (("time", "lat", "lon"), rng.standard_normal((nt, ny, nx)).astype("f8")),
         "mask": (("lat", "lon"), (rng.random((ny, nx)) > 0.5).astype("i1"))},
        coords={"time": pd.date_range("2000-01-01", periods=nt, freq="D"),
                "lat": np.linspace(-60, 60, ny), "lon": np.arange(nx) * 3.0},
    )


# ---------------------------------------------------------------- windows
@pytest.mark.parametrize("k", [1, 2, 3, 9, 17])
@pytest.mark.parametrize("output", ["numpy", "xarray"])
@pytest.mark.slow
def test_windows(era5_path, k, output):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.2, "test": 0.2}, gap=1)
    for split in m.splits:
        if m.positions(split) < k:  # no window fits: refused rather than an empty generator
            with pytest.raises(ValueError, match="window"):
                ds.insitu.batches(m, split, batch_size=6, window={"time": k}, output=output, block_chunks=2)
            continue
        gen = ds.insitu.batches(m, split, batch_size=6, window={"time": k}, output=output, block_chunks=2)
        ids = run_epoch(ds, gen, output)
        assert np.array_equal(np.sort(ids), np.arange(gen.n_samples))  # exactly once
        # windows never cross a split boundary or gap: n = positions - (k-1) per contiguous run
        assert gen.n_samples == m.positions(split) - (k - 1)


def test_window_reads_each_chunk_once_per_block(era5_path):
    ds = xinsitu.open_zarr(era5_path)[["t2m"]]
    m = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", batch_size=8, window={"time": 3}, output="numpy", block_chunks=100)
    list(gen)
    nchunks = len(m.splits["train"])
    assert gen.io_stats["chunks"] == nchunks  # one block: every chunk read exactly once
    gen = ds.insitu.batches(m, "train", batch_size=8, window={"time": 3}, output="numpy", block_chunks=1,
                            shuffle=False)
    list(gen)
    # one unit per block: the chunk a window spills into is passed on to the next block, not read again
    assert gen.io_stats["chunks"] == nchunks


# ---------------------------------------------------------------- patches
@pytest.mark.parametrize("patch, stride", [({"lat": 4, "lon": 5}, None), ({"lat": 5}, {"lat": 2}),
                                           ({"lat": 12, "lon": 3}, {"lon": 4}), ({"lon": 7}, {"lon": 3})])
@pytest.mark.slow
def test_patches(tmp_path, patch, stride):
    ds = write(tmp_path / "g.zarr", grid_ds(), {"a": {"time": 4, "lat": 5, "lon": 4},
                                                "b": {"time": 4, "lat": 6, "lon": 10}})
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", batch_size=7, patch=patch, stride=stride, output="xarray", seed=1)
    ids = run_epoch(ds, gen, "xarray")
    assert np.array_equal(np.sort(ids), np.arange(gen.n_samples))
    # as xbatcher: tiles start at multiples of the stride, a remainder smaller than the patch is dropped
    ntiles = 1
    for d, p in patch.items():
        s = (stride or {}).get(d, p)
        ntiles *= (ds.sizes[d] - p) // s + 1
    assert gen.n_samples == m.positions("train") * ntiles


def test_window_and_patch_with_static_var(tmp_path):
    ds = write(tmp_path / "g.zarr", grid_ds(), {"a": {"time": 3, "lat": 4, "lon": 5}, "b": {"time": 6}})
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "val", batch_size=5, window={"time": 4}, patch={"lat": 6, "lon": 5},
                            variables=["a", "b", "mask"], output="xarray")
    ids = run_epoch(ds, gen, "xarray")
    assert len(ids) == gen.n_samples > 0
    b = next(iter(gen))
    assert b.mask.dims == ("sample", "lat", "lon")  # tiled like the others, no time axis
    assert b.a.dims == ("sample", "time", "lat", "lon")


# ---------------------------------------------------------------- multi-dim splits
@pytest.mark.parametrize("over", [None, "time"])
@pytest.mark.slow
def test_spatial_split(tmp_path, over):
    ds = write(tmp_path / "g.zarr", grid_ds(), {"a": {"time": 24, "lat": 3, "lon": 2},
                                                "b": {"time": 12, "lat": 3, "lon": 4}, "mask": {"lat": 6, "lon": 10}})
    with pytest.raises(ValueError, match="'mask'"):  # its chunk spans every lon: it would serve every split
        ds.insitu.split(["lat", "lon"], fractions={"train": 0.7, "val": 0.3})
    ds = ds[["a", "b"]]
    m = ds.insitu.split(["lat", "lon"], fractions={"train": 0.7, "val": 0.3}, seed=4)
    assert m.grid == (4, 3)  # common grid: lat chunks of 3 (both); lon edges where 2 and 4 both start
    for split in m.splits:
        gen = ds.insitu.batches(m, split, batch_size=11, over=over, output="numpy", block_chunks=3)
        ids = run_epoch(ds, gen)
        assert np.array_equal(np.sort(ids), np.arange(gen.n_samples))
        per_point = ds.sizes["time"] if over else 1
        assert gen.n_samples == m.positions(split) * per_point


@pytest.mark.slow
def test_spatial_split_with_patches_across_blocks(tmp_path):
    ds = write(tmp_path / "g.zarr", grid_ds(ny=16, nx=16), {"a": {"time": 8, "lat": 4, "lon": 4},
                                                            "b": {"time": 8, "lat": 4, "lon": 4},
                                                            "mask": {"lat": 4, "lon": 4}})
    m = ds.insitu.split(["lat", "lon"], fractions={"train": 0.75, "val": 0.25}, seed=2)
    for split in m.splits:
        gen = ds.insitu.batches(m, split, batch_size=4, patch={"lat": 4, "lon": 4}, stride={"lat": 2, "lon": 2},
                                over="time", output="xarray")
        ids = run_epoch(ds, gen, "xarray")
        assert np.array_equal(np.sort(ids), np.arange(gen.n_samples))


def test_time_split_with_spatial_blocks_and_over_is_rejected_for_split_dims(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    with pytest.raises(ValueError, match="already a split"):
        ds.insitu.batches(m, "train", over="time")
    with pytest.raises(ValueError, match="both window and patch"):
        ds.insitu.batches(m, "train", window={"time": 2}, patch={"time": 2})
    with pytest.raises(ValueError, match="longer than dim"):
        ds.insitu.batches(m, "train", patch={"lat": 100})
    with pytest.raises(ValueError, match="not a patch dim"):
        ds.insitu.batches(m, "train", stride={"lat": 2})


# ---------------------------------------------------------------- mixed variables
def test_mixed_chunking_common_grid(tmp_path):
    ds = write(tmp_path / "g.zarr", grid_ds(nt=48), {"a": {"time": 8}, "b": {"time": 12}})
    assert ds.insitu.geometry.dims["time"] == (8, 12)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    assert m.edges["time"].tolist() == [0, 24, 48]  # blocks where both variables start a chunk
    gen = ds.insitu.batches(m, "train", batch_size=5, output="numpy", window={"time": 2})
    run_epoch(ds, gen)
    assert gen.io_stats["chunks"] == 3 + 2  # a: 3 chunks of 8, b: 2 chunks of 12, each read once


# ---------------------------------------------------------------- layouts
def _layout_cases():
    import numcodecs

    return {
        "v3_sharded": dict(zarr_format=3, chunks={"a": {"time": 2}, "b": {"time": 2}},
                           extra={"a": {"shards": (8, 12, 10)}, "b": {"shards": (8, 12, 10)}}),
        "v2_blosc_shuffle": dict(zarr_format=2, chunks={"a": {"time": 5}, "b": {"time": 5}},
                                 extra={"a": {"compressors": (numcodecs.Blosc("lz4", 5, numcodecs.Blosc.SHUFFLE),)},
                                        "b": {"compressors": (numcodecs.Zstd(3),),
                                              "filters": (numcodecs.Delta("f8"),)}}),
        "v2_bigendian": dict(zarr_format=2, chunks={"a": {"time": 4}, "b": {"time": 4}},
                             extra={"a": {"dtype": ">f4"}, "b": {"dtype": ">f8"}}),
        "v3_bigendian": dict(zarr_format=3, chunks={"a": {"time": 4}, "b": {"time": 4}},
                             extra={"a": {"serializer": "big"}}),
    }


@pytest.mark.parametrize("case", list(_layout_cases()))
def test_layouts(tmp_path, case):
    kw = _layout_cases()[case]
    extra = kw["extra"]
    if case == "v3_bigendian":
        from zarr.codecs import BytesCodec

        extra = {"a": {"serializer": BytesCodec(endian="big")}}
    ds = write(tmp_path / "l.zarr", grid_ds(), kw["chunks"], zarr_format=kw["zarr_format"], extra=extra)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    for split in m.splits:
        gen = ds.insitu.batches(m, split, batch_size=5, window={"time": 3}, output="numpy")
        run_epoch(ds, gen)


@pytest.mark.parametrize("dtype", [">i2", ">f4"])
def test_a_big_endian_array_without_cf_attributes_gives_native_values(tmp_path, dtype):
    """A zarr v2 big-endian array with no fill value and no CF attribute: xarray gives its values in
    the native byte order, and so do batches, stacked or not, and statistics (batches kept the stored
    order: another dtype than xarray's, which torch refused)."""
    import zarr

    path = tmp_path / "big.zarr"
    g = zarr.open_group(str(path), mode="w", zarr_format=2)
    a = g.create_array("a", shape=(8, 3), dtype=dtype, chunks=(2, 3), fill_value=None, compressors=None)
    a[:] = np.arange(24).reshape(8, 3)
    a.attrs["_ARRAY_DIMENSIONS"] = ["time", "x"]
    zarr.consolidate_metadata(str(path))
    for ds in (xinsitu.open_zarr(str(path)), xr.open_zarr(str(path)), xr.open_zarr(str(path), chunks=None)):
        want = ds.a.values
        assert want.dtype == np.dtype(dtype).newbyteorder("=")
        m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
        for kw in ({"output": "numpy"}, {"output": "numpy", "stack": True}, {"output": "xarray"}):
            b = next(iter(ds.insitu.batches(m, "train", batch_size=4, shuffle=False, **kw)))
            got = (b if kw.get("stack") else np.asarray(b["a"])).reshape(4, 3)
            assert got.dtype == want.dtype and got.dtype.isnative
            np.testing.assert_array_equal(got, want[:4])
        assert ds.insitu.stats(m, "train")["a"]["max"] == 11


@pytest.mark.parametrize("chunk", [2, 1])
def test_a_variable_of_strings_reads_as_xarray_reads_it(tmp_path, chunk):
    """A variable of variable-length strings (numpy's StringDType, as zarr gives them) beside a numeric one:
    batches hold what ``isel`` gives, through a buffer and filled in place (it raised AttributeError: a
    string's row has no ``nbytes``)."""
    path = str(tmp_path / "s.zarr")
    xr.Dataset({"a": (("time", "x"), np.arange(24.0).reshape(8, 3)),
                "lab": (("time",), np.array([f"s{i}" for i in range(8)], dtype=object))},
               coords={"time": np.arange(8)}).to_zarr(path, encoding={"lab": {"chunks": (chunk,)},
                                                                      "a": {"chunks": (chunk, 3)}})
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    for output in ("numpy", "xarray"):
        got = list(ds.insitu.batches(m, "train", batch_size=3, shuffle=False, output=output))
        labs = np.concatenate([np.asarray(b["lab"]) for b in got])
        assert labs.dtype == ds.lab.dtype
        np.testing.assert_array_equal(labs, ds.lab.values[:4])


def test_missing_chunks_read_as_fill(tmp_path, era5_path):
    import shutil

    path = tmp_path / "holes.zarr"
    shutil.copytree(era5_path, path)
    for key in ["t2m/c/2/0/0", "tp/c/3/0/0"]:
        (path / key).unlink()
    ds = xinsitu.open_zarr(str(path))
    assert np.isnan(ds.t2m.isel(time=17).values).all()  # xarray reads the fill value: NaN
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", batch_size=9, output="numpy")
    run_epoch(ds, gen)


# ---------------------------------------------------------------- hypothesis
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ct=st.integers(1, 7), k=st.integers(1, 5), py=st.integers(1, 6), sy=st.integers(1, 4),
       bs=st.integers(1, 9), nblock=st.integers(1, 4), seed=st.integers(0, 9), shuffle=st.booleans())
@pytest.mark.slow
def test_hypothesis_windows_patches(tmp_path_factory, ct, k, py, sy, bs, nblock, seed, shuffle):
    path = tmp_path_factory.mktemp("h") / "h.zarr"
    ds = write(path, grid_ds(nt=30, ny=6, nx=3, seed=seed), {"a": {"time": ct, "lat": 4}, "b": {"time": ct}})
    try:
        m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5}, gap=1 if 30 // ct > 3 else 0)
    except ValueError:
        return
    gen = ds.insitu.batches(m, "train", batch_size=bs, window={"time": min(k, 30)}, patch={"lat": py},
                            stride={"lat": sy}, output="numpy", block_chunks=nblock, shuffle=shuffle, seed=seed)
    ids = run_epoch(ds, gen)
    assert np.array_equal(np.sort(ids), np.arange(gen.n_samples))


def test_sample_random_access(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    s = ds.insitu.sample(m, "val", 5, window={"time": 3})
    first = m.edges["time"][m.splits["val"][0]]
    ref = ds[list(s.data_vars)].isel(time=slice(first + 5, first + 8)).load()
    np.testing.assert_array_equal(s.t2m.values, ref.t2m.values)
    np.testing.assert_array_equal(s.time.values, ref.time.values)


def test_unit_size_is_known_from_the_grid_without_per_unit_arrays():
    """Equal units (a regular grid, the last block perhaps shorter and then not in the split) have
    stride-0 counts and arithmetic offsets; a split holding the short last block, or an irregular
    grid, is counted per unit and agrees with it."""
    from xinsitu.index.sampling import EqualOffsets, SampleDim, SampleSpace

    def space(edges, blocks, over=1):
        dims = [SampleDim("t", int(edges[-1]), split=True)] + ([SampleDim("o", over)] if over > 1 else [])
        return SampleSpace(dims, {"t": np.asarray(edges)}, np.asarray(blocks))

    regular = space([0, 3, 6, 9, 11], [0, 2], over=2)  # blocks of 3, the last of 2 not in the split
    assert regular.unit_size == 6 and regular.counts.strides == (0,) and isinstance(regular.offsets, EqualOffsets)
    assert regular.counts.tolist() == [6, 6] and np.asarray(regular.offsets).tolist() == [0, 6, 12]
    with_last = space([0, 3, 6, 9, 11], [1, 3])
    assert with_last.unit_size is None and with_last.counts.tolist() == [3, 2]
    assert np.asarray(with_last.offsets).tolist() == [0, 3, 5]
    only_last = space([0, 3, 6, 9, 11], [3])
    assert only_last.unit_size == 2 and only_last.n_samples == 2
    irregular = space([0, 1, 3, 4, 6], [1, 3])  # blocks of 1, 2, 1, 2: the split's two are of 2
    assert irregular.unit_size == 2 and irregular.counts.strides != (0,) and irregular.counts.tolist() == [2, 2]
    for sp in (regular, with_last, only_last, irregular):
        ids = np.arange(sp.n_samples)
        unit, local = sp.locate(ids)
        assert np.array_equal(np.asarray(sp.offsets)[unit] + local, ids)
        assert np.array_equal(np.asarray(sp.blocks), sp.blocks[np.arange(len(sp.blocks))])


@given(st.lists(st.integers(0, 200), min_size=0, max_size=60, unique=True), st.data())
@settings(max_examples=60, deadline=None)
def test_unit_blocks_index_like_the_ids(ids, data):
    """A split's block ids read from its runs (``UnitBlocks``): int, negative, slice and array indexing
    give what indexing the array of ids gives; out of range raises IndexError."""
    from xinsitu.index.runs import Blocks
    from xinsitu.index.sampling import UnitBlocks

    ids = np.array(data.draw(st.permutations(ids)), dtype=np.int64)
    ub = UnitBlocks(Blocks.from_ids(ids))
    assert len(ub) == len(ids) and np.array_equal(np.asarray(ub), ids) and list(ub) == ids.tolist()
    if len(ids):
        i = data.draw(st.integers(-len(ids), len(ids) - 1))
        assert ub[i] == ids[i] and isinstance(ub[i], int)
        pick = np.array(data.draw(st.lists(st.integers(-len(ids), len(ids) - 1), max_size=20)), dtype=np.int64)
        assert np.array_equal(ub[pick], ids[pick])
        a, b = sorted(data.draw(st.lists(st.integers(-len(ids) - 2, len(ids) + 2), min_size=2, max_size=2)))
        assert np.array_equal(ub[a:b], ids[a:b])
    with pytest.raises(IndexError):
        ub[len(ids)]


def test_a_space_of_equal_units_pickles_small():
    """A worker's copy of a space of 10^6 equal units carries no per-unit array: a few kB."""
    import pickle

    from xinsitu.index.sampling import SampleDim, SampleSpace

    n = 1_000_000
    big = SampleSpace([SampleDim("t", 3 * n, split=True), SampleDim("o", 2)],
                      {"t": np.arange(3 * n + 1, dtype=np.int64)[:: 3]}, np.arange(n))
    assert big.unit_size == 6 and big.counts.strides == (0,) and big.n_samples == 6 * n
    blob = pickle.dumps(big)
    assert len(blob) < 8 * n + 100_000  # the edges (8 MB) and nothing per unit on top
    back = pickle.loads(blob)
    assert back.unit_size == 6 and back.counts.strides == (0,) and back.n_samples == 6 * n
    assert np.array_equal(back.locate(np.array([0, 6 * n - 1]))[0], [0, n - 1])
