"""Batches filled in place (``xinsitu.batches.direct``), ``dtype=``, batches that own their arrays, and the
buffer's byte budget (issue "At the decode limit on the shapes weather models train with").

Oracle: plain xarray. The weather-model shape in small: pressure-level variables (``z``, ``u``) beside
surface fields (``t2m``), one CF-packed int16 variable (``tp``: float64 scale factor), a static
land-sea mask, one time step per chunk.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from hypothesis import given, settings
from hypothesis import strategies as st

import xinsitu
from xinsitu.batches.buffer import BUDGET_BUFFERS, MAX_BLOCK_CHUNKS, default_block_chunks, unit_nbytes

NT, NL, NY, NX = 24, 3, 5, 7
LEVEL_VARS, SURF = ["z", "u"], ["t2m", "tp"]


def _source(nt: int = NT, seed: int = 0) -> xr.Dataset:
    rng = np.random.default_rng(seed)
    data = {v: (("time", "level", "lat", "lon"), rng.standard_normal((nt, NL, NY, NX)).astype("f4") * (k + 1))
            for k, v in enumerate(LEVEL_VARS)}
    data["t2m"] = (("time", "lat", "lon"), (280 + rng.standard_normal((nt, NY, NX))).astype("f4"))
    tp = np.abs(rng.standard_normal((nt, NY, NX))) * 3.0
    tp[rng.random(tp.shape) < 0.1] = np.nan
    data["tp"] = (("time", "lat", "lon"), tp.astype("f4"))
    data["lsm"] = (("lat", "lon"), (rng.random((NY, NX)) > 0.5).astype("f4"))
    return xr.Dataset(data, coords={"time": pd.date_range("2000-01-01", periods=nt, freq="6h"),
                                    "level": np.array([500, 850, 1000][:NL], "i4"),
                                    "lat": np.linspace(90, -90, NY).astype("f4"), "lon": np.arange(NX, dtype="f4")})


def _write(path: str, chunks: dict[str, int] | None = None, **kw) -> xr.Dataset:
    """One time step per chunk (``chunks`` overrides per dim); ``tp`` packed as int16."""
    src = _source(**kw)
    c = {"time": 1, "level": NL, "lat": NY, "lon": NX, **(chunks or {})}
    enc = {v: {"chunks": tuple(c[d] for d in src[v].dims)} for v in src.data_vars}
    enc["tp"].update(dtype="int16", scale_factor=0.001, add_offset=0.0, _FillValue=-32768)
    src.to_zarr(path, encoding=enc, consolidated=False)
    return src


@pytest.fixture(scope="module")
def wm(tmp_path_factory) -> tuple[xr.Dataset, xinsitu.SplitManifest, str]:
    path = str(tmp_path_factory.mktemp("direct") / "wm.zarr")
    _write(path)
    ds = xinsitu.open_zarr(path)
    return ds, ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25}), path


def _starts(gen, ids: np.ndarray) -> np.ndarray:
    """Each sample's start along the sampled dims (the generator's own index math, public attributes)."""
    units, local = gen.space.locate(ids)
    return np.stack([gen.space.unit_starts(int(u))[int(k)] for u, k in zip(units, local, strict=True)])


def _oracle_stacked(ds: xr.Dataset, times: np.ndarray, variables: list[str], dtype=None) -> np.ndarray:
    """(sample, channel, lat, lon): xarray's decoded values, levels as channels, stacked in
    variable-then-label order; cast to ``dtype`` after stacking where given (else the result dtype)."""
    sel = ds[variables].isel(time=times).compute()
    parts = []
    for v in variables:
        da = sel[v]
        if "level" in da.dims:
            parts.append(da.values.reshape(len(times), -1, NY, NX))
        else:
            parts.append((np.broadcast_to(da.values, (len(times), NY, NX)) if "time" not in da.dims
                          else da.values)[:, None])
    out = np.concatenate(parts, axis=1)
    return out if dtype is None else out.astype(dtype)


def _epoch(gen):
    return [(np.asarray(b) if not isinstance(b, dict) else {k: np.asarray(v) for k, v in b.items()}) for b in gen]


@pytest.mark.parametrize("variables", [LEVEL_VARS + SURF, LEVEL_VARS + ["t2m", "lsm"]])
@pytest.mark.parametrize("dtype", [None, "float32"])
@pytest.mark.slow
def test_stacked_batches_filled_in_place_equal_xarray(wm, variables, dtype):
    """One step per chunk: no buffer (chunks decode straight into each sample's channels), and every
    batch equals xarray's stacking of ``ds.isel(time=...)`` bit for bit, CF decoding included; with
    ``dtype=`` the stacking's ``.astype(dtype)``; a static variable is broadcast into its channel."""
    ds, m, _ = wm
    gen = ds.insitu.batches(m, "train", batch_size=5, variables=variables, stack=["level"], output="numpy",
                            dtype=dtype, seed=3)
    assert gen.buffer_reason is None and "none" in gen.buffer_summary and "buffer" in repr(gen)
    want_dtype = np.dtype("float32") if dtype else np.result_type(*[ds[v].dtype for v in variables])
    for ep in (0, 1):
        gen.set_epoch(ep)
        ids = gen.batch_ids()
        batches = _epoch(gen)
        assert len(batches) == len(ids) == len(gen)
        for b, i in zip(batches, ids, strict=True):
            times = _starts(gen, i)[:, 0]
            assert b.dtype == want_dtype
            assert np.array_equal(b, _oracle_stacked(ds, times, variables, dtype), equal_nan=True)
        # every chunk once per epoch (the static one once per generator)
        assert gen.io_stats["chunks"] == m.positions("train") * sum("time" in ds[v].dims for v in variables) \
            + (ep == 0) * sum("time" not in ds[v].dims for v in variables)


@pytest.mark.parametrize("output", ["numpy", "torch", "xarray", "dataarray"])
def test_every_output_kind_filled_in_place(wm, output):
    """The per-variable and labeled outputs of the in-place path equal ``ds.isel`` (as the buffered
    path's oracle tests check them)."""
    if output == "torch":
        pytest.importorskip("torch")
    ds, m, _ = wm
    variables = LEVEL_VARS + SURF + ["lsm"]
    stack = ["level"] if output == "dataarray" else False
    gen = ds.insitu.batches(m, "train", batch_size=4, variables=variables, output=output, stack=stack, seed=1)
    assert gen.buffer_reason is None
    for b, i in zip(gen, gen.batch_ids(), strict=True):
        times = _starts(gen, i)[:, 0]
        ref = ds[variables].isel(time=xr.DataArray(times, dims="sample")).compute()
        if output == "xarray":
            xr.testing.assert_identical(b, ref.transpose("sample", ...))
        elif output == "dataarray":
            assert list(b["variable"].values) == gen.channels
            assert np.array_equal(b.values, _oracle_stacked(ds, times, variables), equal_nan=True)
            assert np.array_equal(b.time.values, ds.time.values[times])
        else:
            for v in variables:
                got = b[v].numpy() if output == "torch" else b[v]
                exp = ref[v].values
                assert got.dtype == exp.dtype and np.array_equal(got, exp, equal_nan=True), v


def test_dtype_float32_for_a_packed_variable(wm):
    """The issue's first-model-call failure: one int16 variable with a float64 scale factor made every
    channel float64. ``dtype="float32"`` gives float32 everywhere, equal to xarray's decoded values
    ``.astype("float32")``, per variable and stacked, in place and buffered (windows)."""
    ds, m, _ = wm
    gen = ds.insitu.batches(m, "train", batch_size=6, variables=["t2m", "tp"], stack=True, output="numpy")
    assert next(iter(gen)).dtype == np.float64  # what xarray's stacking gives: the reason for dtype=
    for kw in ({}, {"window": {"time": 2}}):
        gen = ds.insitu.batches(m, "train", batch_size=6, variables=["t2m", "tp"], output="numpy",
                                dtype="float32", seed=2, **kw)
        assert gen.dtype == np.float32 and (gen.buffer_reason is None) == (not kw)
        rows = {line.split()[0]: line.split()[-3:] for line in repr(gen).splitlines() if line.startswith("    t")}
        assert rows["tp"] == [str(ds.tp.dtype), "->", "float32"] and rows["t2m"][-1] == "float32", rows  # the repr too
        for b, i in zip(gen, gen.batch_ids(), strict=True):
            st_ = _starts(gen, i)
            idx = st_[:, 0:1] + np.arange(kw["window"]["time"] if kw else 1)
            for v in ("t2m", "tp"):
                exp = ds[v].values[idx].astype("float32")
                exp = exp if kw else exp[:, 0]
                assert b[v].dtype == np.float32 and np.array_equal(b[v], exp, equal_nan=True), v


@pytest.mark.parametrize("bad, err", [("float33", TypeError), ("float33", ValueError), (3, TypeError),
                                      ("bool", ValueError), ("U4", ValueError),
                                      ("datetime64[ns]", ValueError), (object, ValueError)])
def test_dtype_refused_naming_it(wm, bad, err):
    ds, m, _ = wm
    with pytest.raises(err, match="dtype"):
        ds.insitu.batches(m, "train", output="numpy", dtype=bad)


def test_normalised_in_place_equals_xarray(wm):
    """``normalize=`` on the in-place path: ``(x - mean) / std`` per channel, as xarray computes it."""
    ds, m, _ = wm
    variables = ["z", "t2m", "tp"]
    stats = ds.insitu.stats(m, "train", variables=variables, stack=["level"])
    gen = ds.insitu.batches(m, "train", batch_size=5, variables=variables, stack=["level"], output="numpy",
                            normalize=stats, dtype="float32")
    assert gen.buffer_reason is None
    for b, i in zip(gen, gen.batch_ids(), strict=True):
        times = _starts(gen, i)[:, 0]
        parts = []
        for v in variables:
            x = ds[v].isel(time=times).values
            mean, std = np.asarray(stats[v]["mean"]), np.asarray(stats[v]["std"])
            if x.ndim == 4:
                mean, std = mean[None, :, None, None], std[None, :, None, None]
            parts.append(((x - mean.astype(x.dtype)) / np.where(std == 0, 1, std).astype(x.dtype)).reshape(
                len(times), -1, NY, NX))
        assert np.array_equal(b, np.concatenate(parts, axis=1).astype("float32"), equal_nan=True)


@pytest.mark.parametrize("output", ["numpy", "xarray", "torch"])
@pytest.mark.parametrize("window", [None, {"time": 2}])
def test_a_batch_owns_its_arrays(wm, output, window):
    """SPEC §4: changing one batch in place never changes another; a variable without the split dim
    (the land-sea mask) is a fresh array per batch or read-only -- on both paths."""
    if output == "torch":
        torch = pytest.importorskip("torch")
    ds, m, _ = wm
    gen = ds.insitu.batches(m, "train", batch_size=4, variables=["t2m", "lsm"], output=output, window=window)
    batches = list(gen)
    first = batches[0]
    lsm = ds.lsm.values
    for b in batches[1:]:
        arr = b["lsm"].values if output == "xarray" else b["lsm"]
        if output == "torch":
            arr -= 1.0  # tensors are fresh copies
            assert np.array_equal(first["lsm"].numpy(), lsm)
            continue
        with pytest.raises(ValueError, match="read-only"):
            arr -= 1.0
        if output == "xarray":
            with pytest.raises(ValueError, match="read-only"):
                b["lsm"] -= 1.0
    got = first["lsm"].numpy() if output == "torch" else np.asarray(first["lsm"])
    assert np.array_equal(got, lsm)
    if output == "torch":
        assert isinstance(first["lsm"], torch.Tensor)
    # gen.sample(i), for inspection, gives arrays of the caller's own: changing one changes nothing else
    s = gen.sample(0)
    s["lsm"].values[...] = -1.0
    assert np.array_equal(gen.sample(1)["lsm"].values, lsm)
    after = next(iter(gen))["lsm"]
    assert np.array_equal(after.numpy() if output == "torch" else np.asarray(after), lsm)


@pytest.mark.parametrize("output", ["xarray", "dataarray"])
def test_a_coordinate_without_the_split_dim_is_not_shared_writable(output):
    """A coordinate the samples do not index (2-D latitudes, a mask stored as a coordinate, the grid's
    own index) is the same in every batch: read-only, so changing it in one batch (or in ``gen.sample``)
    cannot change another batch or a later epoch (it did: one array, shared and writable)."""
    lat2d = np.arange(12.0).reshape(3, 4)
    ds = xr.Dataset({"t2m": (("time", "y", "x"), np.arange(16 * 12, dtype="f4").reshape(16, 3, 4))},
                    coords={"time": pd.date_range("2000", periods=16, freq="6h"), "y": [10.0, 20, 30],
                            "lat2d": (("y", "x"), lat2d)}).chunk({"time": 4})
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", batch_size=2, shuffle=False, output=output)
    first = next(iter(gen))

    def change(values: np.ndarray) -> None:
        try:
            values[...] = -1.0
        except ValueError as e:  # read-only is one way; a fresh array per batch the other
            assert "read-only" in str(e)

    for name in ("lat2d", "y"):
        change(first[name].values)
    change(gen.sample(0)["lat2d"].values)
    change(gen.sample(1)["y"].values)
    assert all(np.array_equal(b.lat2d.values, lat2d) and np.array_equal(b.y.values, [10, 20, 30]) for b in gen)
    assert np.array_equal(gen.sample(0).lat2d.values, lat2d)
    fresh = next(iter(gen))
    assert np.array_equal((fresh + 1).lat2d.values, lat2d)  # xarray's arithmetic and copies still work
    copy = fresh.copy(deep=True)
    copy["lat2d"].values[...] = 0.0
    assert np.array_equal(next(iter(gen)).lat2d.values, lat2d)


def test_a_dropped_batch_leaves_its_raw_arrays_to_its_threads(wm, monkeypatch):
    """A batch read ahead and dropped (iterating an epoch again without ``set_epoch`` drops the next
    epoch's first batch) may leave decode threads writing into its raw arrays: cancelling an await does
    not stop a thread. No other batch gets those arrays (one did: a field of another time step showed
    up in a re-iterated epoch's first batch, about one pass in 40)."""
    import asyncio
    import threading

    from xinsitu.batches.direct import DirectLoader
    from xinsitu.io import loop as _loop

    ds, m, _ = wm
    gen = ds.insitu.batches(m, "train", batch_size=4, output="numpy", stack=True, dtype="float32")
    loader, plan = gen._item_loader(), gen.plan()
    assert isinstance(loader, DirectLoader) and loader.builder.converts("tp")  # int16 packed: raw, then converted
    busy, release = threading.Event(), threading.Event()
    writing = []
    real = loader._read_all

    async def still_decoding(reads, at, regions):
        await real(reads, at, regions)
        writing.extend(d for _, dests in reads for d in dests)

        def decode() -> None:  # a decode thread that is still writing when its load is cancelled
            busy.set()
            release.wait(30)

        await asyncio.get_running_loop().run_in_executor(None, decode)

    monkeypatch.setattr(loader, "_read_all", still_decoding)
    load = _loop.submit(loader.load(plan, 0))
    try:
        assert busy.wait(30)
        load.cancel()
        _loop.run(asyncio.sleep(0.05))  # (the cancellation reaches the load on the I/O loop)
        monkeypatch.setattr(loader, "_read_all", real)
        taken = loader._take_raw(loader.layouts["tp"], 4)  # what the next batch's tp is read into
        assert not any(np.shares_memory(taken, d) for d in writing)
    finally:
        release.set()


@pytest.mark.parametrize("sampling", [{"window": {"time": 1}}, {"patch": {"time": 1}}])
@pytest.mark.parametrize("output", ["numpy", "xarray"])
def test_a_window_of_one_position_on_one_step_chunks_equals_xarray(wm, sampling, output):
    """``window={"time": 1}`` over one step per chunk: each sample keeps a ``time`` axis of length 1 (the
    path that fills batches in place does not take it: it crashed, "axes don't match array")."""
    from tests.index.test_sampling import run_epoch

    ds, m, _ = wm
    gen = ds.insitu.batches(m, "train", batch_size=4, output=output, seed=1, **sampling)
    ids = run_epoch(ds, gen, output=output)
    assert np.array_equal(np.sort(ids), np.arange(gen.n_samples))


def test_resume_and_elastic_in_place(wm):
    """Exact resume mid-epoch and an elastic resume (2 ranks -> 3) on the in-place path: the batches
    after the saved one are the uninterrupted run's, and the rest of the epoch is dealt exactly once."""
    ds, m, _ = wm
    kw = dict(batch_size=3, variables=LEVEL_VARS + SURF, stack=["level"], output="numpy", seed=5)
    gen = ds.insitu.batches(m, "train", **kw)
    gen.set_epoch(1)
    full = _epoch(gen)
    it = iter(gen)
    for _ in range(2):
        next(it)
    state = gen.state_dict()
    it.close()
    again = ds.insitu.batches(m, "train", **kw)
    again.load_state_dict(state)
    rest = _epoch(again)
    assert len(rest) == len(full) - 2
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(rest, full[2:], strict=True))
    # elastic: both ranks of 2 yield one batch, then 3 ranks share the rest
    ranks = [ds.insitu.batches(m, "train", rank=r, world_size=2, **kw) for r in range(2)]
    seen = []
    for g in ranks:
        it = iter(g)
        next(it)
        seen.append(g.batch_ids()[0])
        saved = g.state_dict()
        it.close()
    for r in range(3):
        g = ds.insitu.batches(m, "train", rank=r, world_size=3, **kw)
        g.load_state_dict(saved)
        ids = g.batch_ids()
        for b, i in zip(g, ids, strict=True):
            assert np.array_equal(b, _oracle_stacked(ds, _starts(g, i)[:, 0], kw["variables"]), equal_nan=True)
        seen.extend(ids)
    ids = np.concatenate(seen)
    assert len(np.unique(ids)) == len(ids) and m.positions("train") - len(ids) < 3 * kw["batch_size"]


@pytest.mark.parametrize("layout", ["tiles", "time_last", "missing"])
@pytest.mark.slow
def test_in_place_on_other_layouts(tmp_path, layout):
    """Samples that span several chunks (spatial tiles), a split dim that is not a variable's first,
    and chunks with no object (the fill value, as xarray reads it): still straight into the batch, bit
    for bit."""
    path = str(tmp_path / "a.zarr")
    src = _write(path, {"lat": 2, "lon": 3} if layout == "tiles" else None)
    if layout == "time_last":
        src = src.transpose("level", "lat", "lon", "time")
        path = str(tmp_path / "b.zarr")
        enc = {v: {"chunks": tuple({"time": 1}.get(d, src.sizes[d]) for d in src[v].dims)} for v in src.data_vars}
        src.to_zarr(path, encoding=enc, consolidated=False)
    if layout == "missing":
        import shutil

        shutil.rmtree(f"{path}/z/c/3")  # the chunk of step 3 (all levels) is gone
    ds = xinsitu.open_zarr(path)
    xr_ds = xr.open_zarr(path, consolidated=False)
    m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
    gen = ds.insitu.batches(m, "train", batch_size=4, variables=LEVEL_VARS + SURF, output="numpy", seed=4)
    assert gen.buffer_reason is None
    for b, i in zip(gen, gen.batch_ids(), strict=True):
        times = _starts(gen, i)[:, 0]
        ref = xr_ds[LEVEL_VARS + SURF].isel(time=xr.DataArray(times, dims="sample")).transpose("sample", ...).compute()
        for v in LEVEL_VARS + SURF:
            assert np.array_equal(b[v], ref[v].values, equal_nan=True), v
    if layout == "missing":
        assert gen.io_stats["missing"] == 1


def test_cached_epochs_in_place(wm):
    """``cache=True``: the second epoch's chunks come from the memory tier, copied straight into the
    batch (no request), the batches those of an uncached generator."""
    ds, m, _ = wm
    kw = dict(batch_size=5, variables=LEVEL_VARS + SURF, stack=["level"], output="numpy", seed=8)
    ref = ds.insitu.batches(m, "train", **kw)
    gen = ds.insitu.batches(m, "train", cache=True, **kw)
    for ep in (0, 1):
        ref.set_epoch(ep)
        gen.set_epoch(ep)
        assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(_epoch(gen), _epoch(ref), strict=True))
    assert gen.io_stats["cache_hits"] == gen.io_stats["chunks"] and gen.io_stats["requests"] == 0


@pytest.mark.parametrize("big", [None, "row_copy", "parallel"])
def test_buffered_path_gathers_levels_into_their_channels(tmp_path, monkeypatch, big):
    """Chunks of several steps (a buffer): level variables gathered straight into their channel slice of
    the stacked batch (by ``np.take``, or where samples are big a copy per sample, and where batches are
    big in row shares on every core), a CF-packed one converted into its channel in one copy; equal to
    xarray."""
    if big == "row_copy":
        monkeypatch.setattr("xinsitu.batches.buffer.ROW_COPY_BYTES", 1)
        monkeypatch.setattr("xinsitu.batches.buffer.ROW_COPY_SLICE_BYTES", 1)  # (into a channel slice)
    if big == "parallel":
        monkeypatch.setattr("xinsitu.batches.buffer.PARALLEL_GATHER_BYTES", 1)
        monkeypatch.setattr("xinsitu.batches.buffer.SHARE_BYTES", 600)  # z: shares of 2 samples (420 bytes each)
    path = str(tmp_path / "a.zarr")
    _write(path, {"time": 4})
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
    variables = LEVEL_VARS + SURF + ["lsm"]
    for dtype in (None, "float32"):
        gen = ds.insitu.batches(m, "train", batch_size=5, variables=variables, stack=["level"], output="numpy",
                                dtype=dtype, seed=2, block_chunks=2)
        assert gen.buffer_reason is not None and "block_chunks=" in gen.buffer_summary
        for b, i in zip(gen, gen.batch_ids(), strict=True):
            assert np.array_equal(b, _oracle_stacked(ds, _starts(gen, i)[:, 0], variables, dtype), equal_nan=True)


# ---------------------------------------------------------------------- index math and the budget
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), batch=st.integers(1, 9), block=st.integers(1, 7), world=st.integers(1, 3),
       seed=st.integers(0, 5), epoch=st.integers(0, 3), drop=st.booleans())
def test_batch_ids_are_the_plans_order(n, batch, block, world, seed, epoch, drop):
    """``DirectLoader.batch_ids`` (batch by batch, across buffer edges) is the plan's sample order cut
    into batches: the in-place path yields the buffered path's batches."""
    from xinsitu.batches.direct import DirectLoader
    from xinsitu.index.plan import epoch_plan
    from xinsitu.index.sampling import SampleDim, SampleSpace

    space = SampleSpace([SampleDim("time", n, split=True)], {"time": np.arange(n + 1)}, np.arange(n))
    for rank in range(world):
        plan = epoch_plan(space, seed=seed, epoch=epoch, shuffle=True, batch_size=batch, block_chunks=block,
                          drop_last=drop, rank=rank, world_size=world)
        loader = DirectLoader(space, {}, None, None)  # type: ignore[arg-type]
        got = [loader.batch_ids(plan, i) for i in range(plan.n_batches)]
        ids = plan.all_ids(space.offsets)
        assert [len(g) for g in got] == [len(ids[i * batch:(i + 1) * batch]) for i in range(plan.n_batches)]
        assert all(np.array_equal(g, ids[i * batch:(i + 1) * batch]) for i, g in enumerate(got))
        assert np.array_equal(loader.starts_of(ids)[:, 0], ids)  # one position per unit, in split order


@settings(max_examples=60, deadline=None)
@given(step=st.integers(1, 10**8), budget=st.integers(1, 1 << 34), chunk=st.sampled_from([1, 2]),
       width=st.sampled_from([1, 3]))
def test_default_block_chunks_follows_the_budget(step, budget, chunk, width):
    """Between 2 (1 where a block holds one sample: the chunk order is a global shuffle already) and 16
    chunk blocks; more than that least only where the buffers held stay within the budget -- with the
    boxes a window spills into, passed on to later buffers (up to ``HALO_HELD_BUFFERS`` buffers of
    slots), counted too (they took the memory of a windowed epoch 40 % past the budget)."""
    from xinsitu.batches.halo import HALO_HELD_BUFFERS
    from xinsitu.index.sampling import SampleDim, SampleSpace, VarLayout

    class Src:
        dims, shape, raw_dtype = ("time", "x"), (10, step), np.dtype("f4")

    n = 10 - width + 1  # window starts
    space = SampleSpace([SampleDim("time", 10, width=width, keep=width > 1, split=True)],
                        {"time": np.arange(0, 11, chunk)}, np.arange(10 // chunk))
    lays = {"a": VarLayout(Src(), [0], [0, 1], ("x",), None, False)}  # type: ignore[arg-type]
    k = default_block_chunks(space, lays, budget)
    per = unit_nbytes(space, lays)
    held = BUDGET_BUFFERS + (HALO_HELD_BUFFERS if width > 1 else 0)
    least = 2 if chunk > 1 else 1
    assert n > 0 and per == 4 * step * (chunk + width - 1) and least <= k <= MAX_BLOCK_CHUNKS
    assert k == least or k * per * held <= budget
    assert k == MAX_BLOCK_CHUNKS or (k + 1) * per * held > budget or k == least


@pytest.mark.parametrize("chunk_time", [1, 4])  # one sample per chunk (no buffer), and buffers of blocks
def test_the_order_is_the_datasets_whichever_variables_are_read(tmp_path, monkeypatch, chunk_time):
    """Inputs and targets read by two generators of one Dataset (other ``variables=``, one manifest, seed
    and epoch) and zipped: the same samples in the same order (SPEC §4: the order depends on the manifest).
    The default ``block_chunks`` follows the bytes of the Dataset's variables on the split dims, not the
    bytes of those read: from those, a budget of two blocks of every variable gave one variable more."""
    from xinsitu.batches.buffer import dataset_unit_nbytes
    from xinsitu.batches.generator import BatchGenerator
    from xinsitu.synthetic import write_era5_like

    path = str(tmp_path / "era5.zarr")
    write_era5_like(path, nt=96, ny=8, nx=12, chunk_time=chunk_time)
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    every = ds.insitu.batches(m, "train", batch_size=4)
    budget = BUDGET_BUFFERS * 2 * dataset_unit_nbytes(every.space, ds)
    monkeypatch.setattr(BatchGenerator, "buffer_budget", budget)
    kw = dict(batch_size=4, output="xarray", seed=3)
    inputs = ds.insitu.batches(m, "train", variables=["u10", "v10", "z500"], **kw)
    target = ds.insitu.batches(m, "train", variables=["t2m"], **kw)
    assert inputs.block_chunks == target.block_chunks == 2
    assert default_block_chunks(target.space, target.layouts, budget) > 8  # (the target's own bytes)
    for epoch in (0, 1):
        inputs.set_epoch(epoch)
        target.set_epoch(epoch)
        for x, y in zip(inputs, target, strict=True):
            assert np.array_equal(x.time.values, y.time.values)


def _count_buffers(monkeypatch) -> list[int]:
    """Counts the buffers loaded and not yet given back: ``[the most at once]``, updated as they come."""
    import xinsitu.batches.buffer as buffer_mod

    live, peak = [0], [0]
    load, recycle = buffer_mod.BufferLoader.load, buffer_mod.BufferLoader.recycle

    async def counting_load(self, *a, **k):
        got = await load(self, *a, **k)
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        return got

    def counting_recycle(self, b):
        live[0] -= 1
        return recycle(self, b)

    monkeypatch.setattr(buffer_mod.BufferLoader, "load", counting_load)
    monkeypatch.setattr(buffer_mod.BufferLoader, "recycle", counting_recycle)
    return peak


def test_one_step_windows_hold_buffers_of_one_block_within_the_budget(tmp_path, monkeypatch):
    """One step per chunk and a window of 2: a block is one sample, so a buffer holds one block where the
    budget holds 3 of them (it held 2: 3 buffers took twice the budget), and the read-ahead counts what a
    buffer holds, not what it decodes (the step its window spills into comes from the buffer before):
    it went 6 buffers deep, twice the budget again."""
    from xinsitu.batches.generator import BatchGenerator
    from xinsitu.batches.pipeline import EpochRun

    path = str(tmp_path / "a.zarr")
    _write(path, nt=96)
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    kw = {"variables": LEVEL_VARS, "output": "numpy", "window": {"time": 2}}
    probe = ds.insitu.batches(m, "train", **kw)
    per = unit_nbytes(probe.space, probe.layouts)  # a slot: a step and the one its window spills into
    monkeypatch.setattr(BatchGenerator, "buffer_budget", 3 * per + per // 2)
    depth, deepen = [0], EpochRun._deepen

    def deepen_seen(self):
        deepen(self)
        depth[0] = max(depth[0], self.depth)

    monkeypatch.setattr(EpochRun, "_deepen", deepen_seen)
    gen = ds.insitu.batches(m, "train", batch_size=1, seed=1, **kw)
    gen.read_ahead = False
    # (the boxes its windows spill into may take up to 3 buffers more: the repr says so)
    assert gen.block_chunks == 1 and "with up to 3 more of what windows spill into" in gen.buffer_summary
    assert sum(len(b["z"]) for b in gen) == 95
    assert gen.io_stats["chunks"] <= 1.15 * 96 * len(LEVEL_VARS)  # SPEC §5: (about) each chunk once
    assert depth[0] == 3  # the read-ahead stays at its start, 3 buffers (it went 6 deep)


def _two_block_buffers(tmp_path, monkeypatch) -> tuple[xr.Dataset, xinsitu.SplitManifest]:
    """Two steps per chunk, and a budget of 4.5 chunk blocks' bytes: buffers of 2 blocks (4 samples)."""
    from xinsitu.batches.generator import BatchGenerator

    path = str(tmp_path / "a.zarr")
    _write(path, {"time": 2}, nt=96)
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    probe = ds.insitu.batches(m, "train", variables=LEVEL_VARS, output="numpy")
    per = unit_nbytes(probe.space, probe.layouts)
    monkeypatch.setattr(BatchGenerator, "buffer_budget", 2 * 2 * per + per // 2)
    return ds, m


def test_buffers_held_stay_within_the_budget(tmp_path, monkeypatch):
    """SPEC §5: the buffers read ahead and held stay within the byte budget whatever the sample size:
    with a budget of 4.5 chunk blocks' bytes the buffers hold 2 blocks each, and the read-ahead (which
    would go to 6 buffers) stays at its start."""
    ds, m = _two_block_buffers(tmp_path, monkeypatch)
    peak = _count_buffers(monkeypatch)
    gen = ds.insitu.batches(m, "train", batch_size=3, variables=LEVEL_VARS, output="numpy", seed=1)
    gen.read_ahead = False
    assert gen.block_chunks == 2 and "budget" in gen.buffer_summary
    # the least a buffer holds, 3 times, is over this budget: the repr says so (it said "within a budget")
    assert "more than the budget" in gen.buffer_summary and "within" not in gen.buffer_summary
    n = sum(len(b["z"]) for b in gen)
    # READ_AHEAD_BUFFERS (the start depth, not deepened past the budget), and one more lent while a batch
    # spans two buffers (``EpochRun.borrowed``)
    assert n == 96 and peak[0] <= 4


def test_the_repr_counts_what_windows_spill_into_against_the_budget(tmp_path, monkeypatch):
    """With a window along the split dim the boxes passed on to later buffers share the budget (up to
    ``HALO_HELD_BUFFERS`` buffers of slots): where 3 buffers of the least size fit it and 6 do not, the repr
    says the budget is exceeded, and by what (it said "within a budget", counting 3)."""
    from xinsitu.batches.generator import BatchGenerator

    path = str(tmp_path / "w.zarr")
    xr.Dataset({"a": (("time", "x"), np.zeros((64, 1000), "f4"))}).to_zarr(path, encoding={"a": {"chunks": (8, 1000)}})
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    kw = {"batch_size": 4, "window": {"time": 3}, "output": "numpy"}
    per = unit_nbytes(ds.insitu.batches(m, "train", **kw).space, ds.insitu.batches(m, "train", **kw).layouts)
    monkeypatch.setattr(BatchGenerator, "buffer_budget", 8 * per)
    said = ds.insitu.batches(m, "train", **kw).buffer_summary
    assert said.startswith("2 chunk blocks") and "with up to 3 more of what windows spill into" in said, said
    assert "more than the budget" in said and "within" not in said, said


@pytest.mark.parametrize("batch_size", [9, 17])
def test_a_batch_spanning_many_buffers_holds_those_and_one_more(tmp_path, monkeypatch, batch_size):
    """A batch bigger than a buffer is gathered from every buffer its samples lie in: those are held at once,
    and one more is read ahead -- no more (the buffers the batch before was gathered from went back only after
    this batch's had come, lent beyond that: 1.6x as many buffers held with batches of 32 on the 1-degree
    archive). Where that is more than the budget, the repr says how much (it said "within a budget")."""
    ds, m = _two_block_buffers(tmp_path, monkeypatch)
    peak = _count_buffers(monkeypatch)
    gen = ds.insitu.batches(m, "train", batch_size=batch_size, variables=LEVEL_VARS, output="numpy", seed=1)
    gen.read_ahead = False
    spans = -(-(batch_size - 1) // 4) + 1  # the most buffers a batch of this many samples lies in
    assert gen.block_chunks == 2 and f"draws from up to {spans} buffers" in gen.buffer_summary, gen.buffer_summary
    for b, ids in zip(gen, gen.batch_ids(), strict=True):
        np.testing.assert_array_equal(b["z"], ds.z.isel(time=ids).values)
    assert peak[0] <= spans + 1, (peak[0], spans)
