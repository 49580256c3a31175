"""Zarr v3 store objects (``ObjectStore``, ``LocalStore``, ``FsspecStore``, ``MemoryStore``, a bare
obstore store) given to ``xinsitu.open_zarr`` or to ``xr.open_zarr``: every batch of an epoch
equals plain xarray's values for its samples, bit for bit."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import xarray as xr
import zarr
import zarr.storage

import xinsitu
from tests.conftest import CT, NT, NX, NY
from tests.index.test_sampling import run_epoch
from xinsitu.stores.backend import backend_for
from xinsitu.synthetic import era5_like, packing

KINDS = ["ObjectStore", "LocalStore", "FsspecStore", "MemoryStore", "obstore"]


def make_store(kind: str, path: str) -> object:
    """A read-only store object of ``kind`` over the archive at ``path`` (MemoryStore: a copy in memory)."""
    import obstore.store

    if kind == "ObjectStore":
        return zarr.storage.ObjectStore(obstore.store.LocalStore(prefix=path), read_only=True)
    if kind == "LocalStore":
        return zarr.storage.LocalStore(path, read_only=True)
    if kind == "FsspecStore":
        pytest.importorskip("fsspec", reason="FsspecStore needs fsspec")
        return zarr.storage.FsspecStore.from_url("file://" + path, read_only=True)
    if kind == "MemoryStore":
        store = zarr.storage.MemoryStore()
        ds = era5_like(NT, NY, NX)
        enc = {v: {"chunks": (CT, NY, NX) if "time" in ds[v].dims else (NY, NX)} for v in ds.data_vars}
        enc["tp"].update(packing())
        ds.to_zarr(store, encoding=enc, zarr_format=3, consolidated=False)
        return store
    if kind == "obstore":
        return obstore.store.LocalStore(prefix=path)
    raise ValueError(kind)


def open_with(opener: str, store: object) -> xr.Dataset:
    if opener == "xinsitu":
        return xinsitu.open_zarr(store)
    if type(store).__module__.startswith("obstore"):
        pytest.skip("xarray opens zarr stores, not bare obstore stores (xinsitu.open_zarr wraps them)")
    return xr.open_zarr(store, chunks=None if opener == "xr_nodask" else {}, consolidated=None)


@pytest.mark.parametrize("opener", ["xinsitu", "xr_nodask", "xr_dask"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_store_object_epoch_matches_xarray(era5_path, kind, opener):
    ds = open_with(opener, make_store(kind, era5_path))
    m = ds.insitu.split("time", fractions={"train": 0.7, "val": 0.3}, gap=1)
    for split, output in (("train", "xarray"), ("val", "numpy")):
        gen = ds.insitu.batches(m, split, batch_size=6, output=output, block_chunks=2, seed=1)
        seen = run_epoch(ds, gen, output)
        assert np.array_equal(np.sort(seen), np.arange(gen.n_samples))


@pytest.mark.parametrize("kind", KINDS)
def test_store_object_holds_the_archive(era5_path, kind):
    """What the store serves is the archive itself: same values as opening the path, tp decoded to NaN."""
    ds = xinsitu.open_zarr(make_store(kind, era5_path))
    ref = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "val", batch_size=64, output="numpy", shuffle=False, variables=["tp", "t2m"])
    got = np.concatenate([b["tp"] for b in gen])
    exp = ref.tp.isel(time=slice(NT - len(got), NT)).values
    assert got.dtype == exp.dtype == np.float64
    assert np.isnan(got).any()
    assert np.array_equal(got, exp, equal_nan=True)


def test_store_objects_with_subsets(era5_path):
    ds = xinsitu.open_zarr(make_store("LocalStore", era5_path)).isel(lat=slice(1, 5), time=slice(3, 100))
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.4})
    gen = ds.insitu.batches(m, "train", batch_size=5, window={"time": 3}, output="numpy", block_chunks=2)
    run_epoch(ds, gen, "numpy")


def test_v2_archive_through_store_object(era5_v2_path):
    ds = xr.open_zarr(zarr.storage.LocalStore(era5_v2_path, read_only=True), chunks=None)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    run_epoch(ds, ds.insitu.batches(m, "train", batch_size=9, output="xarray"), "xarray")


@pytest.mark.parametrize(("kind", "backend"), [("ObjectStore", "LocalBackend"), ("LocalStore", "LocalBackend"),
                                               ("FsspecStore", "_ZarrBackend"), ("MemoryStore", "_ZarrBackend")])
def test_fast_path_where_the_store_allows_it(era5_path, kind, backend):
    """Local directories (in an obstore ObjectStore or a zarr LocalStore) are read file by file in the
    decode threads, with obstore behind; other stores go through their own ``get``."""
    ds = xinsitu.open_zarr(make_store(kind, era5_path))
    zstore = ds.insitu.batches(ds.insitu.split("time", fractions={"a": 0.5, "b": 0.5}), "a").sources["t2m"].array.store
    assert type(backend_for(zstore)).__name__ == backend


def test_store_options_with_a_store_object(era5_path):
    with pytest.raises(TypeError, match="store options"):
        xinsitu.open_zarr(make_store("LocalStore", era5_path), region="us-east-1")


@pytest.mark.parametrize("kind", ["ObjectStore", "LocalStore"])
def test_dataset_on_store_object_pickles(era5_path, kind):
    """DataLoader workers started with spawn get the Dataset by pickle: it must read the same after."""
    ds = xinsitu.open_zarr(make_store(kind, era5_path))
    ds2 = pickle.loads(pickle.dumps(ds))
    m = ds2.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    run_epoch(ds, ds2.insitu.batches(m, "val", batch_size=8, output="numpy"), "numpy")


def test_local_reads_leave_the_decode_threads_only_for_slow_disks():
    """Medians and a floor in milliseconds: a busy process whose reads wait for the GIL -- every read
    slower than every decode, as measured on a loaded 2-core machine -- keeps reading in the decode
    threads; a disk whose every read seeks sends them to obstore."""
    from xinsitu.stores.backend import LocalBackend

    be = LocalBackend("/nowhere", inner=None)
    n = LocalBackend.WINDOW
    for _ in range(3):  # page cache under contention: reads 0.1-0.9 ms, decodes 0.07 ms
        for k in range(n):
            be.observe(1e-4 * (1 + k % 9), 7e-5)
        assert be.fused
    for k in range(n):  # a few reads wait long (another process, a page fault): the median does not
        be.observe(0.05 if k % 4 == 0 else 2e-4, 5e-4)
    assert be.fused
    for _ in range(n):  # a spinning disk: every read 5 ms, decodes 0.5 ms
        be.observe(5e-3, 5e-4)
    assert not be.fused


def test_network_file_systems_are_read_with_many_requests_in_flight(monkeypatch):
    """NFS, Lustre, SMB and FUSE mounts (gcsfuse, s3fs) wait on the network for every read: obstore's
    async reads from the first chunk on; local file systems read in the decode threads."""
    from xinsitu.stores import backend

    mounts = ("36 1 0:1 / / rw - ext4 /dev/vda rw\n"
              "40 36 0:2 / /data rw - nfs4 server:/export rw\n"
              "41 36 0:3 / /data/bucket rw - fuse.gcsfuse bucket rw\n"
              "42 36 0:4 / /scratch\\040space rw - lustre fs rw\n")
    real_open = open

    def fake_open(path, *a, **k):
        if path == "/proc/self/mountinfo":
            import io
            return io.StringIO(mounts)
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", fake_open)
    assert backend.fs_type("/home/me/era5.zarr") == "ext4"
    assert backend.fs_type("/data/era5.zarr") == "nfs4"
    assert backend.fs_type("/data/bucket/era5.zarr") == "fuse.gcsfuse"
    assert backend.fs_type("/scratch space/x.zarr") == "lustre"
    assert backend.fs_type("/datax/era5.zarr") == "ext4"  # a prefix of the name is not the mount
    for path, fused in [("/home/me/a.zarr", True), ("/data/a.zarr", False), ("/data/bucket/a.zarr", False),
                        ("/scratch space/a.zarr", False)]:
        assert backend.LocalBackend(path, inner=None).fused is fused, path


def test_slow_local_disk_reads_through_obstore(era5_path, monkeypatch):
    """Files that take 6 ms each to read: after a window of them the reader fetches through obstore,
    many in flight; the epoch is the same, sample for sample, as the one read from memory."""
    import time as _time

    from tests.support.servers import assert_same_epoch, epoch_numpy
    from xinsitu.stores.backend import LocalBackend

    ref_ds = xr.open_zarr(era5_path).load()
    m = ref_ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
    kw = {"batch_size": 10, "block_chunks": 3, "output": "numpy", "seed": 3}
    ref = epoch_numpy(ref_ds.insitu.batches(m, "train", **kw))

    fast_read = LocalBackend.read
    monkeypatch.setattr(LocalBackend, "read",
                        lambda self, key, scratch=None: (_time.sleep(6e-3), fast_read(self, key, scratch))[1])
    monkeypatch.setattr(LocalBackend, "WINDOW", 8)  # this small archive has fewer chunks than a whole window
    gen = xinsitu.open_zarr(era5_path).insitu.batches(m, "train", **kw)
    gen.read_ahead = False  # the next epoch's first buffer, read while this one ends, would be counted mid-flight
    got = epoch_numpy(gen)
    (be,) = [b for b in gen._reader._backends.values() if isinstance(b, LocalBackend)]
    assert not be.fused, "6 ms reads should have left the decode threads"
    assert gen._reader.counters.requests == gen._reader.counters.chunks  # one read per chunk
    assert_same_epoch(got, ref)
