"""What a generator reports: the progress bar, ``io_stats`` of the last epoch, and
``shuffle_quality``."""

from __future__ import annotations

import os

import numpy as np
import pytest

import xinsitu
from tests.conftest import CT
from xinsitu.index.shuffle import quality

VARIABLES = ["t2m", "tp"]


def _gen(path: str, split: str = "train", **kw):
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    return ds.insitu.batches(m, split, variables=VARIABLES, **{"batch_size": 5, "output": "numpy", **kw})


# ---------------------------------------------------------------------- progress
def test_progress_bar_counts_batches(era5_path, capfd):
    gen = _gen(era5_path, progress=True, block_chunks=2)
    n = len(gen)
    for _ in gen:
        pass
    err = capfd.readouterr().err
    assert "train epoch 0" in err
    assert f"{n}/{n}" in err


def test_progress_bar_starts_at_resumed_batch(era5_path, capfd):
    gen = _gen(era5_path, progress=True)
    n = len(gen)
    gen.load_state_dict({**gen.state_dict(), "batch": n - 2})
    assert sum(1 for _ in gen) == 2
    err = capfd.readouterr().err
    assert f"{n - 2}/{n}" in err and f"{n}/{n}" in err


def test_no_progress_bar_by_default(era5_path, capfd):
    for _ in _gen(era5_path):
        pass
    assert capfd.readouterr().err == ""


# ---------------------------------------------------------------------- io_stats
def _chunk_files(path: str, var: str, chunks: list[int]) -> int:
    return sum(os.path.getsize(os.path.join(path, var, "c", str(c), "0", "0")) for c in chunks)


def test_io_stats_of_an_epoch(era5_path):
    gen = _gen(era5_path, block_chunks=3)
    assert gen.io_stats == {} or gen.io_stats.get("chunks", 0) == 0
    for _ in gen:
        pass
    st = gen.io_stats
    for key in ("chunks", "requests", "bytes_read", "bytes_decoded", "decode_s", "wait_s", "samples_per_s",
                "mb_per_s"):
        assert key in st, key
    units = gen.manifest.splits["train"]
    assert st["chunks"] == st["requests"] == len(VARIABLES) * len(units)
    # bytes read are the chunk objects on disk; decoded bytes are the chunks' in-memory size
    assert st["bytes_read"] == sum(_chunk_files(era5_path, v, list(units)) for v in VARIABLES)
    ny, nx = gen.sources["t2m"].shape[1:]
    assert st["bytes_decoded"] == len(units) * CT * ny * nx * (4 + 2)  # float32 t2m, int16-packed tp
    assert st["samples"] == gen.n_samples
    assert st["decode_s"] > 0 and st["wait_s"] >= 0 and st["seconds"] > 0
    assert st["samples_per_s"] == pytest.approx(st["samples"] / st["seconds"])
    assert st["mb_per_s"] == pytest.approx(st["bytes_decoded"] / st["seconds"] / 1e6)


def test_io_stats_are_the_last_epochs(era5_path):
    gen = _gen(era5_path, block_chunks=2)
    for _ in gen:
        pass
    first = gen.io_stats
    gen.set_epoch(1)
    for _ in gen:
        pass
    second = gen.io_stats
    assert second["epoch"] == 1
    for key in ("chunks", "requests", "bytes_read", "bytes_decoded", "samples"):
        assert second[key] == first[key], key  # not accumulated over epochs


def test_io_stats_of_a_resumed_epoch_count_only_what_was_read(era5_path):
    gen = _gen(era5_path, block_chunks=1, batch_size=8, shuffle=False)  # one chunk per batch
    n = len(gen)
    gen.load_state_dict({**gen.state_dict(), "batch": n - 3})
    for _ in gen:
        pass
    assert gen.io_stats["chunks"] == 3 * len(VARIABLES)
    assert gen.io_stats["samples"] == 3 * 8


# ---------------------------------------------------------------------- shuffle quality
@pytest.mark.parametrize("steps_per_chunk", [1, 8])
def test_io_stats_leave_out_the_samples_asked_for_meanwhile(tmp_path, steps_per_chunk):
    """``gen.sample(i)`` while an epoch runs is inspection: its reads are not the epoch's (``io_stats`` counted
    them, a number that changed from run to run, 1.19x the chunks where each is read once)."""
    import xarray as xr

    path = str(tmp_path / "a.zarr")
    xr.Dataset({v: (("time", "x"), np.arange(96 * 4, dtype="f4").reshape(96, 4)) for v in "ab"}).to_zarr(
        path, encoding={v: {"chunks": (steps_per_chunk, 4)} for v in "ab"})
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", batch_size=4, shuffle=False, output="numpy")
    list(gen)
    alone = gen.io_stats["chunks"]
    for _ in gen:
        gen.sample(50)
    assert gen.io_stats["chunks"] == alone == 2 * 96 // steps_per_chunk


def test_shuffle_quality_orders_the_mixing(era5_path):
    q = {bc: _gen(era5_path, batch_size=8, block_chunks=bc).shuffle_quality() for bc in (1, 4, 12)}
    unshuffled = _gen(era5_path, batch_size=8, shuffle=False).shuffle_quality()
    assert all(0.0 <= v <= 1.0 for v in [*q.values(), unshuffled])
    assert unshuffled < 0.3  # each batch is one chunk
    assert q[1] < q[4] < q[12]
    assert q[12] > 0.9  # one block holds the whole split: a global shuffle


def test_shuffle_quality_scores_the_yielded_batches(era5_path):
    """The score is that of the batches the generator really yields (chunks read from their timestamps)."""
    gen = _gen(era5_path, batch_size=6, block_chunks=3, output="xarray")
    times = gen._ds.time.values
    first = gen.manifest.edges["time"][gen.manifest.splits["train"][0]]
    units = []
    for b in gen:
        pos = np.searchsorted(times, b.time.values)
        units.append((pos - first) // CT)
    assert gen.shuffle_quality() == pytest.approx(quality(units, gen.space.counts))
