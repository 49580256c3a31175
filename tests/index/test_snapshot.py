"""Which Icechunk snapshot a Dataset was read from (``xinsitu.index.snapshot``)."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
import zarr

from xinsitu.index.snapshot import snapshot_of, snapshot_of_sources, snapshot_of_store
from xinsitu.index.source import resolve

icechunk = pytest.importorskip("icechunk", reason="the icechunk extra is not installed")


@pytest.fixture(scope="module")
def two_snapshots(tmp_path_factory):
    icechunk.set_logs_filter("error")
    repo = icechunk.Repository.create(icechunk.local_filesystem_storage(str(tmp_path_factory.mktemp("ic") / "r")))
    ids = []
    for v in (1.0, 2.0):
        s = repo.writable_session("main")
        xr.Dataset({"a": ("x", np.full(4, v))}).to_zarr(s.store, zarr_format=3, consolidated=False, mode="w")
        ids.append(s.commit(f"a = {v}"))
    return repo, ids


def test_a_readonly_session_names_its_snapshot(two_snapshots):
    repo, ids = two_snapshots
    store = repo.readonly_session(snapshot_id=ids[0]).store
    assert snapshot_of_store(store) == ids[0]
    assert snapshot_of(xr.open_zarr(store, chunks=None, consolidated=False)) == ids[0]


def test_variables_from_two_snapshots_are_joined_in_sorted_order(two_snapshots):
    repo, ids = two_snapshots
    a, b = (xr.open_zarr(repo.readonly_session(snapshot_id=i).store, chunks=None, consolidated=False) for i in ids)
    sources = {"first": resolve(a)["a"], "second": resolve(b)["a"]}
    assert snapshot_of_sources(sources) == "+".join(sorted(ids))


def test_no_snapshot_outside_icechunk(tmp_path):
    path = str(tmp_path / "p.zarr")
    xr.Dataset({"a": ("x", np.arange(3.0))}).to_zarr(path)
    assert snapshot_of_store(zarr.storage.LocalStore(path)) is None
    assert snapshot_of(xr.open_zarr(path, chunks=None)) is None
    assert snapshot_of(xr.Dataset({"a": ("x", np.arange(3.0))})) is None  # memory
    assert snapshot_of(xr.Dataset()) is None  # nothing to map back
