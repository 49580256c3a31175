"""The resumable state (``xinsitu.index.state``), through the generator's public ``state_dict`` /
``load_state_dict``: JSON round trips, and every mismatch refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest

import xinsitu  # noqa: F401 - registers ds.insitu
from xinsitu.synthetic import era5_like


@pytest.fixture(scope="module")
def ds():
    return era5_like(48, 4, 8).chunk({"time": 6})  # in memory, chunks of 6 steps


@pytest.fixture(scope="module")
def m(ds):
    return ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25}, gap=0)


def _gen(ds, m, **kw):
    args = dict(batch_size=4, seed=3, shuffle=True, output="numpy")
    args.update(kw)
    return ds.insitu.batches(m, "train", **args)


def test_a_fresh_state_is_json_and_loads_back(ds, m):
    gen = _gen(ds, m)
    state = json.loads(json.dumps(gen.state_dict()))
    assert (state["epoch"], state["batch"]) == (0, 0)
    other = _gen(ds, m)
    other.load_state_dict(state)
    assert other.state_dict() == gen.state_dict()


def test_a_state_resumes_at_the_next_batch(ds, m):
    gen = _gen(ds, m)
    ids = gen.batch_ids()
    it = gen.iter_batches()
    for _ in range(3):
        next(it)
    state = gen.state_dict()
    it.close()
    assert state["batch"] == 3
    again = _gen(ds, m)
    again.load_state_dict(state)
    np.testing.assert_array_equal(np.concatenate(again.batch_ids()), np.concatenate(ids))  # same epoch plan
    assert again.state_dict()["batch"] == 3


@pytest.mark.parametrize(("change", "field"), [
    ({"seed": 4}, "seed"),
    ({"batch_size": 8}, "batch_size"),
    ({"shuffle": False}, "shuffle"),
    ({"block_chunks": 2}, "block_chunks"),
])
def test_a_state_of_another_setup_is_refused_naming_the_field(ds, m, change, field):
    state = _gen(ds, m).state_dict()
    with pytest.raises(ValueError, match=rf"different .*{field} \(saved"):
        _gen(ds, m, **change).load_state_dict(state)


def test_a_state_of_another_split_or_manifest_is_refused(ds, m):
    state = _gen(ds, m).state_dict()
    other = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5}, gap=0)
    with pytest.raises(ValueError, match="manifest"):
        _gen(ds, other).load_state_dict(state)


@pytest.mark.parametrize(("bad", "msg"), [
    ({}, "needs 'epoch' and 'batch'"),
    ({"epoch": -1, "batch": 0}, "epoch must be a non-negative integer"),
    ({"epoch": 0, "batch": True}, "batch must be a non-negative integer"),
    ({"epoch": 0, "batch": 0, "version": 99}, "newer than this xinsitu"),
    ({"epoch": 0, "batch": 0, "elastic": [[0, 1]]}, "elastic must be a list"),
])
def test_malformed_states_are_refused(ds, m, bad, msg):
    with pytest.raises(ValueError, match=msg):
        _gen(ds, m).load_state_dict(bad)


def test_a_batch_past_the_end_is_refused(ds, m):
    gen = _gen(ds, m)
    state = dict(gen.state_dict(), batch=len(gen) + 1)
    with pytest.raises(ValueError, match="past the end of epoch 0"):
        _gen(ds, m).load_state_dict(state)


def test_a_state_of_the_earlier_shuffled_order_is_refused(ds, m):
    """Version 1 states were saved under another shuffled unit order (a NumPy permutation of every
    unit): resuming one would yield other samples than the saved run had left, so it is refused."""
    from xinsitu.index.state import STATE_VERSION

    assert STATE_VERSION == 3
    state = {**_gen(ds, m).state_dict(), "version": 1, "batch": 2}
    with pytest.raises(ValueError, match=r"saved by an older xinsitu \(state version 1.*cannot resume that order"):
        _gen(ds, m).load_state_dict(state)
    with pytest.raises(ValueError, match="older xinsitu"):
        _gen(ds, m).load_state_dict({k: v for k, v in state.items() if k != "version"})


def test_a_version_2_state_of_tiles_spilling_over_several_split_dims_is_refused(ds):
    """Version 3 orders the units of tiles spilling over several split dims by their neighbours
    (``neighbour_order_nd``); a version 2 state of such an epoch meant another order: refused. One of
    windows spilling along one split dim (the order of version 2) still resumes."""
    grid = ds.chunk({"time": 6, "lat": 2, "lon": 4})
    m2 = grid.insitu.split(["lat", "lon"], fractions={"train": 1.0})
    gen = grid.insitu.batches(m2, "train", batch_size=4, seed=3, output="numpy", patch={"lat": 2, "lon": 3})
    assert gen.space.spills
    state = {**gen.state_dict(), "version": 2, "batch": 1}
    with pytest.raises(ValueError, match=r"state version 2.*cannot resume that order"):
        grid.insitu.batches(m2, "train", batch_size=4, seed=3, output="numpy",
                            patch={"lat": 2, "lon": 3}).load_state_dict(state)
    m1 = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m1, "train", batch_size=4, seed=3, output="numpy", window={"time": 3})
    assert gen.space.spills
    again = ds.insitu.batches(m1, "train", batch_size=4, seed=3, output="numpy", window={"time": 3})
    again.load_state_dict({**gen.state_dict(), "version": 2, "batch": 1})
    assert again.state_dict()["batch"] == 1


def test_a_state_of_an_earlier_version_resumes_where_the_order_is_unchanged(ds, m):
    """Unshuffled epochs are in split order in every version: their version 1 state still resumes."""
    gen = _gen(ds, m, shuffle=False)
    state = {**gen.state_dict(), "version": 1, "batch": 2}
    again = _gen(ds, m, shuffle=False)
    again.load_state_dict(state)
    assert again.state_dict()["batch"] == 2
    np.testing.assert_array_equal(np.concatenate(again.batch_ids()), np.concatenate(gen.batch_ids()))
