"""Windows and tiles that spill over a chunk edge read each chunk about once per epoch (SPEC §5:
at most 1.15x the split's chunks): the chunk a window spills into is passed from the block that
reads it to the later block that needs it, not fetched twice. Batches stay bit-identical to
xarray; the order depends only on (seed, epoch, world_size, rank): a shuffled epoch whose
samples spill lays its chunks out so that neighbours share a block or follow each other
(``xinsitu.index.shuffle.neighbour_order``)."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

import xinsitu
from tests.index.test_sampling import run_epoch
from tests.support.servers import write_archive

NVAR = 5  # t2m, u10, v10, z500, tp along time (lsm is static: read once per generator)
SAMPLING = {
    "window 2": {"window": {"time": 2}},
    "window 3": {"window": {"time": 3}},
    "window 9 (> a chunk)": {"window": {"time": 9}},
    "patch 4, stride 2": {"patch": {"time": 4}, "stride": {"time": 2}},
}


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory):
    # 50 time chunks of 8 steps
    return xinsitu.open_zarr(write_archive(tmp_path_factory.mktemp("w") / "w.zarr", nt=400, ny=4, nx=8, chunk_time=8))


@pytest.mark.parametrize("block_chunks", [16, 4, 1])
@pytest.mark.parametrize("name", list(SAMPLING))
@pytest.mark.slow
def test_windowed_epoch_reads_each_chunk_about_once(ds, name, block_chunks):
    m = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", batch_size=16, output="numpy", block_chunks=block_chunks, seed=0,
                            **SAMPLING[name])
    split_chunks = len(m.splits["train"]) * NVAR
    for epoch in range(3):
        gen.set_epoch(epoch)
        ids = run_epoch(ds, gen)  # every batch equals xarray, in the planned order
        assert np.array_equal(np.sort(ids), np.arange(gen.n_samples))
        reads = gen.io_stats["chunks"]
        assert reads <= 1.15 * split_chunks, (epoch, reads, split_chunks)


def test_spilling_order_is_a_fresh_permutation_per_epoch(ds):
    """The neighbour-aware order is still a permutation of the units, different per (seed, epoch),
    identical for the same ones; epochs stay exactly-once across ranks."""
    from xinsitu.index.shuffle import neighbour_order

    orders = {(s, e): tuple(neighbour_order(50, 16, s, e)) for s in range(3) for e in range(3)}
    assert all(sorted(o) == list(range(50)) for o in orders.values())
    assert len(set(orders.values())) > 5
    assert tuple(neighbour_order(50, 16, 1, 2)) == orders[(1, 2)]
    m = ds.insitu.split("time", fractions={"train": 1.0})
    seen = []
    for rank in range(3):
        gen = ds.insitu.batches(m, "train", batch_size=16, output="numpy", block_chunks=4, window={"time": 2},
                                rank=rank, world_size=3)
        seen += [i for b in gen.batch_ids() for i in b.tolist()]
        assert len(gen) == len(ds.insitu.batches(m, "train", batch_size=16, block_chunks=4, window={"time": 2},
                                                 rank=0, world_size=3))
    assert len(seen) == len(set(seen)) > gen.n_samples - 3 * 16


def test_halo_entries_are_let_go(ds):
    """What a block passes on is dropped once its last taker has it: memory stays a few blocks."""
    from xinsitu.io import loop as _loop

    m = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", batch_size=16, output="numpy", block_chunks=2, window={"time": 3})
    loader, plan = gen._buffer_loader(), gen.plan()
    halo = loader.halo_plan(plan, 0)
    assert halo is not None and halo.n_entries > 0

    async def walk() -> int:
        most = 0
        for j in range(plan.n_buffers):
            await loader.load(plan, j, halo)
            most = max(most, len(halo.held))
        return most

    most = _loop.run(walk())
    assert most <= 2 * 2 * 2  # entries: at most ~ (blocks ahead) x (units per block) x 2
    assert not halo.held


# ---------------------------------------------------------------- tiles spilling over several split dims
TILES = {
    "4x4, stride 2x3": {"patch": {"lat": 4, "lon": 4}, "stride": {"lat": 2, "lon": 3}},
    "3x8, stride 1x2": {"patch": {"lat": 3, "lon": 8}, "stride": {"lat": 1, "lon": 2}},
    "3 along lat, a window in time": {"patch": {"lat": 3}, "window": {"time": 2}},
}


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory):
    """8 x 10 chunk blocks of 5 x 6 (lat x lon), 3 variables (one in another dim order), time whole."""
    from tests.index.test_sampling import grid_ds, write

    ds = grid_ds(nt=3, ny=40, nx=60)[["a", "b"]]
    ds["c"] = ds["a"].transpose("lat", "lon", "time") * 2
    return write(tmp_path_factory.mktemp("g") / "g.zarr", ds, {v: {"lat": 5, "lon": 6} for v in ("a", "b", "c")})


@pytest.mark.parametrize("block_chunks", [None, 8])
@pytest.mark.parametrize("name", list(TILES))
@pytest.mark.slow
def test_tiles_spilling_over_several_split_dims_read_each_chunk_about_once(grid, name, block_chunks):
    """A spatial split whose tiles spill into the next block along lat, lon or both (SPEC §5: at most
    1.15x the split's chunks): the boxes a tile spills into are passed on from the buffer that read
    them (``HaloPlan``), in an order where a unit follows its neighbours (``neighbour_order_nd``);
    batches equal xarray's, every sample once."""
    m = grid.insitu.split(["lat", "lon"], fractions={"train": 1.0})
    gen = grid.insitu.batches(m, "train", batch_size=16, output="numpy", block_chunks=block_chunks, seed=0,
                              **TILES[name])
    split_chunks = len(m.splits["train"]) * 3
    for epoch in range(2):
        gen.set_epoch(epoch)
        ids = run_epoch(grid, gen)
        assert np.array_equal(np.sort(ids), np.arange(gen.n_samples))
        reads = gen.io_stats["chunks"]
        assert reads <= 1.15 * split_chunks, (epoch, reads, split_chunks)


def test_a_grid_halo_holds_edges_within_its_bound(grid):
    """What buffers pass on over a grid of blocks stays within ``HALO_HELD_BUFFERS`` buffers of slots,
    and all of it is let go by the end; in a random split (some neighbours in the other split) too."""
    from xinsitu.batches.halo import HALO_HELD_BUFFERS
    from xinsitu.io import loop as _loop

    for fractions in ({"train": 1.0}, {"train": 0.7, "val": 0.3}):
        m = grid.insitu.split(["lat", "lon"], fractions=fractions, seed=1)
        for block_chunks in (16, 1):  # (one block per buffer: unbounded, it would hold 3.9 buffers of slots)
            gen = grid.insitu.batches(m, "train", batch_size=16, output="numpy", block_chunks=block_chunks,
                                      patch={"lat": 4, "lon": 4}, stride={"lat": 2, "lon": 3})
            loader, plan = gen._buffer_loader(), gen.plan()
            halo = loader.halo_plan(plan, 0)
            assert halo is not None and halo.n_entries > 0
            slot_bytes = (5 + 3) * (6 + 3) * 3 * (4 + 8 + 4)  # a block and what its 4 x 4 tiles spill into
            most = _loop.run(_most_held(loader, plan, halo))
            assert 0 < most <= HALO_HELD_BUFFERS * block_chunks * slot_bytes, (fractions, block_chunks, most)
            assert not halo.held


async def _most_held(loader, plan, halo) -> int:
    """Load an epoch's buffers one after another; the most bytes passed on and not yet taken."""
    most = 0
    for j in range(plan.n_buffers):
        await loader.load(plan, j, halo)
        most = max(most, sum(a.nbytes for held in halo.held.values() for a in held.values()))
    return most


@pytest.mark.parametrize("big", [False, True])
def test_big_windows_are_gathered_as_xarray_gives_them(tmp_path, monkeypatch, big):
    """Windows gathered from buffers: by fancy indexing, or (``big``: samples past ``ROW_COPY_BYTES``) by a
    copy of each sample's block, transposed where the output's dims are in another order (variable ``c``),
    and into the channels of a stacked batch; equal to xarray, stacked or not."""
    from tests.index.test_sampling import grid_ds, write

    if big:
        monkeypatch.setattr("xinsitu.batches.buffer.ROW_COPY_BYTES", 1)
        monkeypatch.setattr("xinsitu.batches.buffer.ROW_COPY_SLICE_BYTES", 1)  # (into a channel slice)
    ds = grid_ds(nt=40, ny=6, nx=5)[["a", "b"]]
    ds["c"] = ds["a"].transpose("lat", "lon", "time") * 2
    ds = write(tmp_path / "w.zarr", ds, {v: {"time": 4} for v in ("a", "b", "c")})
    m = ds.insitu.split("time", fractions={"train": 1.0})
    kw = dict(batch_size=4, window={"time": 3}, variables=["a", "b", "c"], seed=1)
    gen = ds.insitu.batches(m, "train", output="numpy", **kw)
    run_epoch(ds, gen)
    stacked = ds.insitu.batches(m, "train", output="numpy", stack=True, **kw)
    for s, b in zip(stacked, gen, strict=True):
        ref = np.stack([b["a"], b["b"], b["c"].transpose(0, 3, 1, 2)], axis=1)
        assert s.dtype == ref.dtype and np.array_equal(s, ref)


def test_a_halo_is_planned_as_loads_ask():
    """An epoch of many buffers starts at once: the halo is planned a buffer at a time as each load asks
    (with the ``ahead`` buffers it may pass on to), not for the whole epoch up front (an hourly archive
    of 740,000 one-step chunks, windows of 2, waited 70 s for its first batch)."""
    from types import SimpleNamespace

    from xinsitu.batches.halo import HaloPlan
    from xinsitu.index.runs import Blocks

    n, bc, ahead = 4000, 2, 8  # one-position units in order, windows of 2 spilling into the next unit
    sp = SimpleNamespace(split_dims=[SimpleNamespace(name="time", width=2)], edges=[np.arange(n + 1)], grid=(n,),
                         blocks=Blocks.range(0, n), n_units=n)
    plan = SimpleNamespace(n_buffers=n // bc, block_chunks=bc, units=np.arange(n))
    asked = []

    def regions(j):
        asked.append(j)
        units = np.arange(j * bc, (j + 1) * bc)
        return units[:, None], np.minimum(units + 2, n)[:, None]

    halo = HaloPlan(sp, plan, 0, ahead, regions)
    assert not asked
    step = halo.step(0)
    assert sorted(asked) == list(range(ahead + 1))
    assert list(step.give) == [(0, 2, (2,), (3,))]  # its last unit's window spills into the next buffer's first
    assert halo.n_entries == n // bc - 1 and sorted(asked) == list(range(n // bc))


def test_a_slot_never_reads_a_block_of_another_split(tmp_path):
    """SPEC §3: no read serves two splits. A slot's region is the box of its samples' windows and tiles;
    where they spill along two split dims, the box takes in the diagonal block, which no sample reaches
    (one that would is left out) and which may be another split's: it is not read (it was)."""
    from tests.index.test_sampling import write

    rng = np.random.default_rng(0)
    src = xr.Dataset({"a": (("time", "lat", "lon"), rng.standard_normal((12, 10, 4)).astype("f4"))})
    ds = write(tmp_path / "d.zarr", src, {"a": {"time": 6, "lat": 5, "lon": 4}})  # 2 x 2 blocks, a chunk each
    m = next(m for seed in range(100) for m in [ds.insitu.split(["time", "lat"], fractions={"train": 0.25, "val": 0.75},
                                                               contiguous=False, seed=seed)]
             if m.splits["train"].ids().tolist() == [3])  # train: block (1, 1); val: the other three
    gen = ds.insitu.batches(m, "val", batch_size=4, window={"time": 3}, patch={"lat": 4}, stride={"lat": 2},
                            output="numpy", block_chunks=16)
    ids = run_epoch(ds, gen)
    assert np.array_equal(np.sort(ids), np.arange(gen.n_samples)) and gen.n_samples
    assert gen.io_stats["chunks"] == 3  # val's three chunks, each once; not train's


def test_a_variable_lacking_a_split_dim_leaves_the_halo_to_the_others(tmp_path, monkeypatch):
    """A variable without one of the split dims (``c(time, lon)`` beside ``a(time, lat, lon)``, a split on
    time and lat) reads its slots' whole regions; the others still pass on what their windows spill into,
    each chunk read once (the halo was off for every variable then: ``a`` read 1.8x)."""
    from collections import Counter

    from tests.index.test_sampling import write
    from xinsitu.io.reader import Reader

    rng = np.random.default_rng(0)
    src = xr.Dataset({"a": (("time", "lat", "lon"), rng.standard_normal((16, 12, 4)).astype("f4")),
                      "c": (("time", "lon"), rng.standard_normal((16, 4)))})
    ds = write(tmp_path / "d.zarr", src, {"a": {"time": 1, "lat": 3, "lon": 4}, "c": {"time": 1, "lon": 4}})
    m = ds.insitu.split(["time", "lat"], fractions={"train": 1.0})
    fetched: Counter = Counter()
    real = Reader.read_many

    async def counted(self, src, jobs):  # the chunks one call reads (each once, however many pieces)
        fetched[src.name] += len({c for job in jobs for c, *_ in self.regions.plan(src, job[0])[1]})
        return await real(self, src, jobs)

    monkeypatch.setattr(Reader, "read_many", counted)
    gen = ds.insitu.batches(m, "train", batch_size=5, window={"time": 3}, output="numpy", block_chunks=8, seed=2)
    ids = run_epoch(ds, gen)
    assert np.array_equal(np.sort(ids), np.arange(gen.n_samples))
    assert fetched["a"] == 16 * 4 and fetched["c"] > 16, fetched  # a's chunks each once; c's again


@pytest.mark.parametrize("window", [5, 9])
@pytest.mark.parametrize("block_chunks", [4, 16])
def test_wide_windows_over_one_step_chunks_read_each_chunk_once(tmp_path, window, block_chunks):
    """ARCO-ERA5's layout (one step per chunk), shuffled, windows of 5 or 9 steps: a unit is passed on to
    the 4-8 buffers after the one that reads it, within the bound (buffers of slots: a unit and what its
    windows spill into). Each chunk read once (1.5-3.9x while the bound counted units)."""
    from tests.index.test_sampling import write

    rng = np.random.default_rng(0)
    src = xr.Dataset({"a": (("time", "lat", "lon"), rng.standard_normal((60, 4, 4)).astype("f4"))})
    ds = write(tmp_path / "d.zarr", src, {"a": {"time": 1}})
    m = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", batch_size=8, window={"time": window}, block_chunks=block_chunks, seed=0,
                            output="numpy")
    ids = run_epoch(ds, gen)
    assert np.array_equal(np.sort(ids), np.arange(gen.n_samples))
    assert gen.io_stats["chunks"] == 60
