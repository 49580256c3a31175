"""Resumable generators: the state after batch i gives batch i+1 next and then exactly the
uninterrupted run — in process, and across a SIGKILLed training process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import xinsitu
from tests.support.resume_check import epoch_records, record, run_test_save_load_state
from tests.support.train_job import EPOCHS
from tests.support.train_job import make_gen as job_gen

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _split(ds, **kw):
    return ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2}, **kw)


CASES = {
    "shuffled": dict(batch_size=7, block_chunks=3),
    "unshuffled": dict(batch_size=7, shuffle=False),
    "drop_last": dict(batch_size=9, drop_last=True, block_chunks=2),
    "rank1of3": dict(batch_size=4, rank=1, world_size=3, block_chunks=2),
    "window": dict(batch_size=6, window={"time": 3}, block_chunks=1, output="numpy"),
    "dataarray": dict(batch_size=5, output="dataarray", variables=["t2m", "u10"]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("where", ["start", "middle", "last", "end"])
@pytest.mark.slow
def test_save_load_state(era5_path, case, where):
    ds = xinsitu.open_zarr(era5_path)
    m = _split(ds)

    def make():
        return ds.insitu.batches(m, "train", seed=11, **CASES[case])

    n = len(make())
    midpoint = {"start": 0, "middle": n // 2, "last": n - 1, "end": n}[where]
    run_test_save_load_state(make, midpoint, epochs=2)


def test_state_is_small_json(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    gen = ds.insitu.batches(_split(ds), "train", batch_size=4)
    it = iter(gen)
    next(it)
    state = gen.state_dict()
    text = json.dumps(state)
    assert len(text) < 1000
    assert json.loads(text) == state
    assert (state["epoch"], state["batch"]) == (0, 1)


def test_state_after_set_epoch_is_the_new_epochs_start(era5_path):
    """A checkpoint written between set_epoch(e + 1) and the first batch resumes at batch 0 of e + 1."""
    ds = xinsitu.open_zarr(era5_path)
    m = _split(ds)
    gen = ds.insitu.batches(m, "train", batch_size=8, output="numpy")
    ref = ds.insitu.batches(m, "train", batch_size=8, output="numpy")
    ref.set_epoch(1)
    expected = epoch_records(ref)
    for _ in gen:
        pass
    assert gen.state_dict()["batch"] == len(gen)  # the end of epoch 0
    gen.set_epoch(1)
    state = gen.state_dict()
    assert (state["epoch"], state["batch"]) == (1, 0)
    fresh = ds.insitu.batches(m, "train", batch_size=8, output="numpy")
    fresh.load_state_dict(state)
    fresh.set_epoch(1)
    assert epoch_records(fresh) == expected


def test_break_then_state_resumes_after_last_batch_handed_out(era5_path):
    """Prefetched batches that were never handed out are not counted as done."""
    ds = xinsitu.open_zarr(era5_path)
    m = _split(ds)
    gen = ds.insitu.batches(m, "train", batch_size=3, block_chunks=1, output="numpy")
    ref = epoch_records(ds.insitu.batches(m, "train", batch_size=3, block_chunks=1, output="numpy"))
    for i, _ in enumerate(gen):
        if i == 4:
            break
    state = gen.state_dict()
    assert state["batch"] == 5
    again = ds.insitu.batches(m, "train", batch_size=3, block_chunks=1, output="numpy")
    again.load_state_dict(state)
    assert epoch_records(again) == ref[5:]


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(manifest="other"), "manifest"),
        (dict(seed=1), "seed"),
        (dict(batch_size=5), "batch_size"),
        (dict(shuffle=False), "shuffle"),
        (dict(block_chunks=4), "block_chunks"),
        (dict(drop_last=True), "drop_last"),
        (dict(window={"time": 2}), "sampling \\('time': saved split, one position of 1, here split, "
                                   "window/patch of 2\\)"),
        (dict(patch={"lat": 2}), "sampling \\('lat': saved not sampled, here window/patch of 2, stride 2\\)"),
        (dict(split="val"), "split"),
    ],
)
def test_mismatched_state_raises(era5_path, change, field):
    """(Another rank or world size is no mismatch: such a state resumes elastically, see test_elastic.py.)"""
    ds = xinsitu.open_zarr(era5_path)
    m = _split(ds)
    base = dict(batch_size=4, seed=0, world_size=3, rank=0)
    gen = ds.insitu.batches(m, "train", **base)
    it = iter(gen)
    next(it)
    state = gen.state_dict()
    it.close()
    kw = {**base, **change}
    man = _split(ds, gap=1) if kw.pop("manifest", None) else m
    split = kw.pop("split", "train")
    other = ds.insitu.batches(man, split, **kw)
    with pytest.raises(ValueError, match=field):
        other.load_state_dict(state)
    gen.load_state_dict(state)  # the same settings load fine


def test_a_state_from_before_an_append_names_the_growth(tmp_path):
    """The archive grew (to_zarr(append_dim="time")) and the split was made again with the same ranges: the
    state's manifest differs (the geometry's length), and the message says so and how to resume, where it
    showed two hashes."""
    import numpy as np
    import pandas as pd
    import xarray as xr

    path = str(tmp_path / "grow.zarr")
    one = xr.Dataset({"a": (("time", "x"), np.arange(60.0).reshape(30, 2))},
                     coords={"time": pd.date_range("2000-01-01", periods=30)})
    one.to_zarr(path, encoding={"a": {"chunks": (3, 2)}})
    ranges = {"train": slice("2000-01-01", "2000-01-21"), "val": slice("2000-01-25", None)}
    ds = xinsitu.open_zarr(path)
    gen = ds.insitu.batches(ds.insitu.split("time", ranges=ranges), "train", batch_size=2)
    it = iter(gen)
    next(it)
    state = gen.state_dict()
    it.close()
    more = one.isel(time=slice(0, 3)).assign_coords(time=pd.date_range("2000-01-31", periods=3))
    more.to_zarr(path, append_dim="time")
    grown = xinsitu.open_zarr(path)
    later = grown.insitu.batches(grown.insitu.split("time", ranges=ranges), "train", batch_size=2)
    with pytest.raises(ValueError, match=r"manifest, made on 'time' of length 30 then, 33 here: the archive grew "
                                         r"since; resume on ds.isel\(time=slice\(0, 30\)\)"):
        later.load_state_dict(state)
    with pytest.raises(ValueError, match=r"of length 30, this dataset has 33: the archive grew since\? "
                                         r"ds.isel\(time=slice\(0, 30\)\) is what it was made on"):
        grown.insitu.batches(gen.manifest, "train", batch_size=2)  # the old manifest on the grown archive
    cut = grown.isel(time=slice(0, 30))
    cut.insitu.batches(gen.manifest, "train", batch_size=2).load_state_dict(state)


@pytest.mark.parametrize("bad", [None, [], {"epoch": 0}, {"batch": 3}])
def test_not_a_state_raises(era5_path, bad):
    ds = xinsitu.open_zarr(era5_path)
    gen = ds.insitu.batches(_split(ds), "train", batch_size=4)
    with pytest.raises(ValueError):
        gen.load_state_dict(bad)


@pytest.mark.parametrize("field, value, match", [("batch", 10**6, "past the end"), ("batch", -1, "batch"),
                                                 ("epoch", -1, "epoch"), ("batch", True, "batch"),
                                                 ("epoch", "0", "epoch"), ("version", 99, "version")])
def test_bad_position_raises(era5_path, field, value, match):
    ds = xinsitu.open_zarr(era5_path)
    gen = ds.insitu.batches(_split(ds), "train", batch_size=4)
    state = {**gen.state_dict(), field: value}
    with pytest.raises(ValueError, match=match):
        gen.load_state_dict(state)


def _job(args: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", "tests.support.train_job", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _read_log(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("hang_after", [4])
@pytest.mark.slow
def test_resume_after_sigkill(era5_path, tmp_path, hang_after):
    """Kill a training process mid-epoch (after its checkpoint of batch i, with reads in
    flight); a fresh process resumed from that checkpoint trains on batch i+1 next and
    then on exactly the batches of the uninterrupted run, through the next epoch."""
    gen = job_gen(era5_path)
    ref = []
    for e in range(EPOCHS):
        gen.set_epoch(e)
        ref += [{"epoch": e, **record(b)} for b in gen]
    n0 = len(gen.plan(0).all_ids(gen.space.offsets)) and gen.plan(0).n_batches
    assert hang_after + 1 < n0

    first = _job([era5_path, str(tmp_path), "--hang-after", str(hang_after)])
    try:
        line = first.stdout.readline()  # blocks until the checkpoint is written (or the job dies)
        assert line.strip() == f"CKPT {hang_after}", first.stderr.read()
        first.send_signal(signal.SIGKILL)
        assert first.wait(timeout=60) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    with open(tmp_path / "ckpt.json") as f:
        state = json.load(f)
    assert (state["epoch"], state["batch"]) == (0, hang_after + 1)
    assert _read_log(tmp_path / "first.jsonl") == ref[: hang_after + 1]

    second = _job([era5_path, str(tmp_path), "--resume"])
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    resumed = _read_log(tmp_path / "resumed.jsonl")
    assert resumed[0] == ref[hang_after + 1], "the resumed job must train on batch i+1 first"
    assert resumed == ref[hang_after + 1:]
