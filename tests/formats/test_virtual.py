"""NetCDF4 files read in place through virtual references: every batch equals
``xr.open_mfdataset(files)`` of the same samples, bit for bit (int16 packing with
scale/offset/_FillValue included); splits, windows and resume work as on Zarr; what cannot
be read in place is refused with the file and the variable named."""

from __future__ import annotations

import asyncio
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

import xinsitu
from tests.index.test_sampling import run_epoch
from tests.support.forked import epoch_in_fork
from tests.support.resume_check import record, run_test_save_load_state
from xinsitu.synthetic import era5_like, packing

pytest.importorskip("virtualizarr", reason="the virtual extra is not installed")
pytest.importorskip("h5py", reason="the virtual extra is not installed")
pytest.importorskip("h5netcdf", reason="the virtual extra is not installed")

from xinsitu.virtual import ManifestBackend, VirtualReferenceError, netcdf_store, open_netcdf  # noqa: E402

NDAYS, STEPS, NY, NX, CT = 12, 4, 6, 10, 2  # daily files of 4 six-hourly steps, chunks of 2 steps
try:  # the files are written as most are: by netCDF-C (xarray's default engine); else by h5py
    import netCDF4  # noqa: F401

    ENGINE = "netcdf4"
except ImportError:
    ENGINE = "h5netcdf"
MF = {"data_vars": "minimal", "coords": "minimal", "compat": "override"}
pytestmark = pytest.mark.filterwarnings("ignore:Numcodecs codecs are not in the Zarr version 3")


def encoding(ds: xr.Dataset, ct: int = CT, **tp: object) -> dict:
    enc = {v: {"zlib": True, "shuffle": True, "complevel": 4,
               "chunksizes": (ct, NY, NX) if "time" in ds[v].dims else (NY, NX)} for v in ds.data_vars}
    enc["tp"].update(packing() | tp)
    return enc


def write_days(d, ds: xr.Dataset, steps: list[int] | None = None, **kw) -> list[str]:
    """``ds`` written as consecutive NetCDF4 files of ``steps`` time steps each (xarray's default time units
    per file: each file counts hours from its own first step)."""
    os.makedirs(d, exist_ok=True)
    steps = steps or [STEPS] * (ds.sizes["time"] // STEPS)
    files, a = [], 0
    for k, n in enumerate(steps):
        f = os.path.join(d, f"day{k:03d}.nc")
        part = ds.isel(time=slice(a, a + n))
        part.to_netcdf(f, encoding=kw.get("enc", {}).get(k) or encoding(part), unlimited_dims=["time"], engine=ENGINE)
        files.append(f)
        a += n
    return files


@pytest.fixture(scope="module")
def days(tmp_path_factory) -> list[str]:
    return write_days(tmp_path_factory.mktemp("netcdf") / "days", era5_like(NDAYS * STEPS, NY, NX))


@pytest.fixture(scope="module")
def ref(days) -> xr.Dataset:
    """The oracle: what xarray gives for the same files."""
    return xr.open_mfdataset(days, **MF).load()


# ----------------------------------------------------------------------------- the Dataset
@pytest.mark.slow
def test_same_dataset_as_open_mfdataset(days, ref):
    ds = open_netcdf(days)
    xr.testing.assert_identical(ds.load(), ref)
    assert ds.tp.encoding["dtype"] == np.dtype("int16") and np.isnan(ds.tp.values).any()
    assert ref.time.encoding["units"].startswith(ds.time.encoding["units"])  # the first file's units
    assert ds.t2m.encoding["chunks"] == (CT, NY, NX)


@pytest.mark.slow
def test_order_of_files_does_not_matter(days, ref):
    xr.testing.assert_identical(open_netcdf(list(reversed(days))).load(), ref)
    xr.testing.assert_identical(open_netcdf(os.path.join(os.path.dirname(days[0]), "day*.nc")).load(), ref)


def test_data_stays_in_the_files(days):
    """Data variables are byte ranges of the NetCDF files; only coordinates along time are inline."""
    store = netcdf_store(days)
    paths = {str(p) for p in store._group.arrays["t2m"].manifest._paths.ravel()}
    assert paths == {"file://" + os.path.abspath(f) for f in days}
    assert store._group.arrays["t2m"].manifest.shape_chunk_grid == (NDAYS * STEPS // CT, 1, 1)
    assert str(store._group.arrays["time"].manifest._paths.ravel()[0]).startswith("xinsitu-inline://")


# ----------------------------------------------------------------------------- batches
@pytest.mark.parametrize("output", ["xarray", "numpy"])
@pytest.mark.slow
def test_epoch_matches_open_mfdataset(days, ref, output):
    ds = open_netcdf(days)
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.2, "test": 0.2}, gap=1)
    for split in m.splits:
        gen = ds.insitu.batches(m, split, batch_size=5, output=output, block_chunks=3, seed=4)
        seen = run_epoch(ref, gen, output)
        assert np.array_equal(np.sort(seen), np.arange(gen.n_samples))
        assert len(seen) == m.positions(split)


def test_store_through_xr_open_zarr(days, ref):
    """The store is a zarr store like any other: plain ``xr.open_zarr`` (dask-backed) works too."""
    ds = xr.open_zarr(netcdf_store(days))
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    run_epoch(ref, ds.insitu.batches(m, "val", batch_size=4, output="xarray", seed=1), "xarray")


@pytest.mark.slow
def test_ranges_and_windows(days, ref):
    ds = open_netcdf(days)
    m = ds.insitu.split("time", ranges={"train": slice("1979-01-01", "1979-01-08"),
                                        "val": slice("1979-01-10", None)}, gap=1)
    assert m.labels["val"]["time"][0].startswith("1979-01-10")
    for split in m.splits:
        gen = ds.insitu.batches(m, split, batch_size=6, window={"time": 3}, output="numpy", block_chunks=2)
        assert len(run_epoch(ref, gen, "numpy")) == gen.n_samples > 0
    gen = ds.insitu.batches(m, "train", batch_size=6, window={"time": 3}, patch={"lat": 3, "lon": 5},
                            output="xarray", variables=["tp", "lsm"])
    run_epoch(ref, gen, "xarray")


@pytest.mark.slow
def test_resume(days):
    ds = open_netcdf(days)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})

    def make():
        return ds.insitu.batches(m, "train", batch_size=7, window={"time": 3}, block_chunks=2, seed=9)

    run_test_save_load_state(make, len(make()) // 2, epochs=2)


def test_virtualizarr_manifest_store_of_one_file(days):
    """A ManifestStore straight from VirtualiZarr's HDF parser (one file) is a store like any other."""
    import obstore.store
    from obspec_utils.registry import ObjectStoreRegistry
    from virtualizarr.parsers import HDFParser

    f = os.path.abspath(days[3])
    store = HDFParser()("file://" + f, ObjectStoreRegistry({"file://": obstore.store.LocalStore()}))
    ds = xinsitu.open_zarr(store)
    ref = xr.open_dataset(f).load()
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    for split in m.splits:
        run_epoch(ref, ds.insitu.batches(m, split, batch_size=3, output="xarray"), "xarray")


def test_dataset_pickles(days, ref):
    """spawn/forkserver workers get the Dataset pickled; inline coordinates and references travel with it."""
    ds = pickle.loads(pickle.dumps(open_netcdf(days)))
    xr.testing.assert_identical(ds.load(), ref)


def test_last_file_may_end_mid_chunk(tmp_path):
    """Files of 4, 4 and 3 steps in chunks of 2: the last chunk is partial, as zarr allows."""
    files = write_days(tmp_path / "d", era5_like(11, NY, NX, seed=3), steps=[4, 4, 3])
    ref = xr.open_mfdataset(files, **MF).load()
    ds = open_netcdf(files)
    xr.testing.assert_identical(ds.load(), ref)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    run_epoch(ref, ds.insitu.batches(m, "val", batch_size=3, output="numpy"), "numpy")


# ----------------------------------------------------------------------------- the read path
@pytest.mark.parametrize("units,calendar", [("days since 1500-01-01", "standard"),   # before the reform
                                            ("days since 2290-01-01", "standard"),   # past datetime64[ns]
                                            ("days since 2290-01-01", "noleap"),
                                            ("days since 1-1-1", "360_day")])
def test_time_axes_xarray_keeps_as_cftime_open_as_xarray_opens_them(tmp_path, units, calendar):
    """A file whose times xarray decodes to cftime (with a warning that they stay cftime: paleo runs, CMIP
    extensions to 2300) was refused as if its files could not be joined: the decode's warning was taken for
    the encode's. It opens as ``xr.open_dataset`` opens it, and batches carry those times."""
    netCDF4 = pytest.importorskip("netCDF4")
    p = str(tmp_path / "cal.nc")
    with netCDF4.Dataset(p, "w") as f:
        f.createDimension("time", None)
        f.createDimension("x", 4)
        t = f.createVariable("time", "f8", ("time",))
        t.units, t.calendar = units, calendar
        t[:] = np.arange(8) * 1.0
        v = f.createVariable("v", "f4", ("time", "x"), chunksizes=(2, 4))
        v[:] = np.arange(32, dtype="f4").reshape(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's: the times stay cftime)
        ref = xr.open_dataset(p)
        ds = open_netcdf(p)
    assert ds.time.dtype == ref.time.dtype == object
    np.testing.assert_array_equal(ds.time.values, ref.time.values)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    (b,) = list(ds.insitu.batches(m, "train", batch_size=8, shuffle=False, output="xarray"))
    np.testing.assert_array_equal(b.time.values, ref.time.values)
    np.testing.assert_array_equal(b.v.values, ref.v.values)


def test_backend_reads_the_referenced_ranges(days):
    """Every chunk read through ManifestBackend equals VirtualiZarr's own ManifestStore.get; local files are
    read one range at a time (reads overlap), remote ones coalesced (see test_files_over_http)."""
    from zarr.core.buffer import default_buffer_prototype

    store = netcdf_store(days)
    be = ManifestBackend(store)
    keys = [f"{v}/c/{i}/0/0" for v in ("t2m", "tp") for i in range(NDAYS * STEPS // CT)] + ["lsm/c/0/0", "time/c/0"]

    async def go():
        got = await asyncio.gather(*(be.get(k) for k in keys))
        exp = [await store.get(k, prototype=default_buffer_prototype()) for k in keys]
        return got, exp

    got, exp = asyncio.run(go())
    for k, g, e in zip(keys, got, exp, strict=True):
        assert bytes(g) == e.to_bytes(), k
    assert be.requests == len(keys)


@pytest.mark.slow
def test_files_over_http(days, ref):
    """Remote files (here plain HTTP): references resolve through obstore; chunks of one file asked for
    together go out as one request (obstore merges nearby ranges), not one per chunk."""
    from tests.support.servers import FileServer

    root = os.path.dirname(days[0])
    with FileServer(root) as srv:
        urls = [f"{srv.url}/{os.path.basename(f)}" for f in days]
        ds = open_netcdf(urls)
        m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
        run_epoch(ref, ds.insitu.batches(m, "val", batch_size=5, output="xarray", seed=3), "xarray")
        be = ManifestBackend(netcdf_store(urls[:4]))
        keys = [f"{v}/c/{i}/0/0" for v in ("t2m", "u10", "v10", "z500", "tp") for i in range(4 * STEPS // CT)]
        n0 = srv.requests

        async def go():
            return await asyncio.gather(*(be.get(k) for k in keys))

        got = asyncio.run(go())
        assert srv.requests - n0 == be.requests == 4  # 40 chunks, 4 files
        assert all(len(g) > 0 for g in got)


def test_missing_file_names_it(days, tmp_path):
    files = [shutil.copy(f, tmp_path / os.path.basename(f)) for f in days[:4]]
    ds = open_netcdf(files)
    os.remove(files[2])
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    with pytest.raises(OSError, match=os.path.basename(files[2])) as err:
        list(ds.insitu.batches(m, "val", batch_size=4, output="numpy", shuffle=False))
    assert re.search(r"variable '(t2m|u10|v10|z500|tp)'", str(err.value)), err.value


def test_forked_child_reads_local_files(days):
    """A process forked after the parent read through obstore (a DataLoader worker under Linux's default
    start method) reads the local files with plain file I/O: the same epoch, no hang."""
    ds = open_netcdf(days)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", batch_size=5, output="numpy", seed=2)
    expected = [record(b) for b in gen]  # the parent has used obstore now
    status, got = epoch_in_fork(gen, 30, lambda g: [record(b) for b in g])
    assert status == "ok", got
    assert got == expected
    # opening files there would go through obstore (the HDF5 parser reads them with it): refused at once,
    # naming the fix, where it waited three request bounds (or for ever) and then blamed a timeout
    status, said = epoch_in_fork(days, 30, open_netcdf)
    assert status == "error" and said.startswith("ForkError: ") and "forked process" in said, said
    assert os.path.basename(days[0]) in said, said


def test_a_child_forked_before_obstore_was_imported_opens_files(days):
    """A process that imported xinsitu but read nothing through obstore forks a pool that opens files (a
    conversion job, a worker_init_fn): obstore starts afresh in each child, so they open and read (only a
    child of a parent that had imported obstore is refused, above)."""
    script = textwrap.dedent("""
        import multiprocessing as mp, sys
        import xinsitu.virtual

        def job(path):
            return float(xinsitu.virtual.open_netcdf(path).t2m.isel(time=0).values.sum())

        if __name__ == "__main__":
            assert "obstore" not in sys.modules
            with mp.get_context("fork").Pool(1) as pool:
                print(pool.apply_async(job, (sys.argv[1],)).get(timeout=60))
    """)
    out = subprocess.run([sys.executable, "-c", script, days[0]], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) == pytest.approx(float(open_netcdf(days[0]).t2m.isel(time=0).values.sum()))


# ----------------------------------------------------------------------------- Icechunk
def test_virtual_references_committed_to_icechunk(days, ref, tmp_path):
    """VirtualiZarr's own route: open_virtual_mfdataset, references committed to Icechunk, read from a session."""
    icechunk = pytest.importorskip("icechunk", reason="the icechunk extra is not installed")
    import inspect

    import virtualizarr.writers.icechunk as vz_icechunk
    if "set_virtual_refs_arr" in inspect.getsource(vz_icechunk) and not hasattr(icechunk.IcechunkStore,
                                                                                  "set_virtual_refs_arr"):
        pytest.skip(f"this VirtualiZarr writes Icechunk references with icechunk>=2's set_virtual_refs_arr; "
                    f"icechunk {icechunk.__version__} is installed (xinsitu reads Icechunk 1.x and 2.x sessions)")
    import obstore.store
    from obspec_utils.registry import ObjectStoreRegistry
    from virtualizarr import open_virtual_mfdataset
    from virtualizarr.parsers import HDFParser

    from xinsitu.index.snapshot import snapshot_of

    icechunk.set_logs_filter("error")
    urls = ["file://" + os.path.abspath(f) for f in days]
    vds = open_virtual_mfdataset(urls, registry=ObjectStoreRegistry({"file://": obstore.store.LocalStore()}),
                                 parser=HDFParser(), **MF)
    prefix = "file://" + os.path.dirname(os.path.abspath(days[0])) + "/"
    cfg = icechunk.RepositoryConfig.default()
    cfg.set_virtual_chunk_container(icechunk.VirtualChunkContainer(prefix, icechunk.local_filesystem_store(prefix[7:])))
    # icechunk 2 names local access (None is deprecated there); 1.x takes None
    cred = icechunk.containers_credentials({prefix: getattr(icechunk.credentials, "LocalFileSystemAccess", None)})
    repo = icechunk.Repository.create(icechunk.local_filesystem_storage(str(tmp_path / "repo")), cfg,
                                      authorize_virtual_chunk_access=cred)
    session = repo.writable_session("main")
    vds.vz.to_icechunk(session.store)
    sid = session.commit("virtual references to the daily files")
    ds = xinsitu.open_zarr(repo.readonly_session(branch="main").store)
    assert snapshot_of(ds) == sid
    xr.testing.assert_identical(ds.load(), ref)
    m = ds.insitu.split("time", fractions={"train": 0.7, "val": 0.3})
    run_epoch(ref, ds.insitu.batches(m, "train", batch_size=6, window={"time": 2}, output="numpy"), "numpy")


# ----------------------------------------------------------------------------- what cannot be read in place
def test_chunks_that_differ_between_files(tmp_path):
    ds = era5_like(3 * STEPS, NY, NX)
    files = write_days(tmp_path, ds, enc={1: encoding(ds.isel(time=slice(4, 8)), ct=1)})
    with pytest.raises(VirtualReferenceError, match=r"'u10'|'t2m'") as err:
        netcdf_store(files)
    assert "day001.nc" in str(err.value) and "chunks" in str(err.value) and "day000.nc" in str(err.value)


def test_file_not_a_whole_number_of_chunks(tmp_path):
    files = write_days(tmp_path, era5_like(11, NY, NX), steps=[4, 3, 4])
    with pytest.raises(VirtualReferenceError, match=r"day001\.nc holds 3 steps of 'time', not a multiple"):
        netcdf_store(files)


def test_packing_that_differs_between_files(tmp_path):
    ds = era5_like(2 * STEPS, NY, NX)
    files = write_days(tmp_path, ds, enc={1: encoding(ds, scale_factor=0.002)})
    with pytest.raises(VirtualReferenceError, match=r"'tp' in .*day001\.nc.*scale_factor"):
        netcdf_store(files)


def test_filter_without_a_decoder(tmp_path):
    ds = era5_like(STEPS, NY, NX)
    f = str(tmp_path / "lzf.nc")
    ds.to_netcdf(f, engine="h5netcdf", encoding={"u10": {"compression": "lzf", "chunksizes": (CT, NY, NX)}})
    with pytest.raises(VirtualReferenceError, match=r"lzf\.nc: variable 'u10' cannot be read in place.*lzf"):
        netcdf_store([f])
    ok = open_netcdf([f], drop_variables=["u10"])  # the way out the message names
    xr.testing.assert_identical(ok.load(), xr.open_dataset(f).drop_vars("u10").load())


def test_not_netcdf(tmp_path):
    """A file that is neither HDF5/NetCDF4 nor NetCDF-3 (NetCDF-3 is read in place: see test_netcdf3.py)."""
    f = tmp_path / "notes.nc"
    f.write_text("not NetCDF\n" * 100)
    with pytest.raises(VirtualReferenceError, match=r"notes\.nc is neither an HDF5/NetCDF4 nor a NetCDF-3 file"):
        netcdf_store([str(f)])


def test_a_netcdf4_file_cut_short_is_called_so(tmp_path):
    """A NetCDF4/HDF5 file truncated (a download that did not finish) is named as one cut short, not as a
    file of another kind."""
    f = tmp_path / "cut.nc"
    xr.Dataset({"a": (("t", "x"), np.random.default_rng(0).random((50, 100)))}).to_netcdf(
        f, engine="h5netcdf", encoding={"a": {"zlib": True}})
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)
    with pytest.raises(VirtualReferenceError, match=r"cut\.nc is an HDF5/NetCDF4 file cut short"):
        netcdf_store([str(f)])
    with open(f, "r+b") as fh:  # within its superblock: HDF5's signature, then too little
        fh.truncate(20)
    with pytest.raises(VirtualReferenceError, match=r"cut\.nc is an HDF5/NetCDF4 file cut short or damaged"):
        netcdf_store([str(f)])
    with open(f, "r+b") as fh:
        fh.truncate(0)
    with pytest.raises(VirtualReferenceError, match=r"cut\.nc is empty"):
        netcdf_store([str(f)])


def test_netcdf3_and_netcdf4_files_do_not_mix(tmp_path):
    """NetCDF-3 files (raw bytes) and NetCDF4 files (deflate) cannot share one array: refused, naming both."""
    pytest.importorskip("netCDF4", reason="writing a NetCDF-3 file needs netCDF4")
    ds = era5_like(3 * STEPS, NY, NX)
    files = write_days(tmp_path / "nc4", ds, enc={k: encoding(ds.isel(time=slice(0, STEPS)), ct=1) for k in range(3)})
    f3 = str(tmp_path / "day001.nc")
    ds.isel(time=slice(STEPS, 2 * STEPS)).to_netcdf(f3, format="NETCDF3_64BIT", engine="netcdf4",
                                                     encoding={"tp": {"dtype": "int16", **packing()}})
    with pytest.raises(VirtualReferenceError, match=r"day001\.nc differs from .*day000\.nc in its codecs"):
        netcdf_store([files[0], f3, files[2]])  # deflate there, raw bytes here: one array, one codec chain


def test_variable_missing_from_a_file(tmp_path):
    ds = era5_like(2 * STEPS, NY, NX)
    files = write_days(tmp_path, ds.drop_vars("v10"), steps=[4])
    files += write_days(tmp_path / "b", ds.isel(time=slice(4, 8)), steps=[4])
    with pytest.raises(VirtualReferenceError, match=r"'v10'.*day000\.nc"):
        netcdf_store(files)


def test_float32_packing_decodes_as_xarray(tmp_path):
    """int16 packed with float32 scale_factor/add_offset decodes to float32, as xarray reads the file (zarr's JSON
    attributes alone would make it float64): the attributes' file types are read back and the xinsitu.cf codec
    decodes each chunk with them."""
    ds = era5_like(2 * STEPS, NY, NX)
    f32 = {"dtype": "int16", "scale_factor": np.float32(0.002), "add_offset": np.float32(-1.5),
           "_FillValue": np.int16(-32768)}
    files = write_days(tmp_path, ds, enc={k: encoding(ds.isel(time=slice(0, STEPS)), **f32) for k in range(2)})
    ref = xr.open_mfdataset(files, **MF).load()
    got = open_netcdf(files)
    assert ref.tp.dtype == np.float32
    xr.testing.assert_identical(got.load(), ref)
    assert netcdf_store(files)._group.arrays["tp"].metadata.codecs[0].to_dict()["name"] == "xinsitu.cf"
    m = got.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    run_epoch(ref, got.insitu.batches(m, "train", batch_size=3, output="numpy"), "numpy")
    run_epoch(ref, got.insitu.batches(m, "val", batch_size=3, output="xarray"), "xarray")


# raw values, dtype, the variable's own attributes and fill value (netCDF4's), as files written by other tools have them
FILE_TYPED = {
    # signed bytes stored unsigned, as netCDF-Java writes them: 255 is -1, masked (the file failed to open:
    # OverflowError, int8(255) of the JSON fill value)
    "_Unsigned false, _FillValue 255": ([[0, 255, 200], [1, 2, 128]] * 2, "u1", {"_Unsigned": "false"},
                                        np.uint8(255)),
    # a short scale_factor decodes to int16, wrap-around included (zarr's JSON int made it int64: another dtype,
    # and other values where int16 wraps)
    "short scale_factor": ([[1, 2], [3, 20000], [5, 6], [7, 8]], "i2", {"scale_factor": np.int16(2)}, False),
}


@pytest.mark.parametrize("case", list(FILE_TYPED))
def test_attributes_of_their_file_type_decode_as_xarray_reads_the_file(tmp_path, case):
    """NetCDF4 attributes whose type JSON loses decode as ``xr.open_dataset`` decodes the file, dtype included."""
    netcdf4 = pytest.importorskip("netCDF4", reason="writing the file needs netCDF4")
    values, dtype, attrs, fill = FILE_TYPED[case]
    raw = np.array(values, dtype=dtype)
    path = str(tmp_path / "typed.nc")
    with netcdf4.Dataset(path, "w") as f:
        f.createDimension("time", raw.shape[0])
        f.createDimension("y", raw.shape[1])
        f.createVariable("time", "i4", ("time",))[:] = np.arange(raw.shape[0])
        v = f.createVariable("v", dtype, ("time", "y"), fill_value=fill, chunksizes=(2, raw.shape[1]))
        v.set_auto_maskandscale(False)
        for k, a in attrs.items():
            v.setncattr(k, a)
        v[:] = raw
    ref = xr.open_dataset(path)
    got = open_netcdf(path)
    assert got.v.dtype == ref.v.dtype
    m = got.insitu.split("time", fractions={"train": 1.0})
    b = next(iter(got.insitu.batches(m, "train", batch_size=4, shuffle=False, output="numpy")))
    assert b["v"].dtype == ref.v.dtype
    np.testing.assert_array_equal(b["v"], ref.v.values)


@pytest.mark.parametrize("fmt", ["NETCDF4", "NETCDF3_CLASSIC"])
def test_variables_in_the_files_order(tmp_path, fmt):
    """Data variables (and so stacked channels) come in the file's order, as ``xr.open_dataset`` gives them,
    not sorted by name: stacked batches equal ``to_dataarray`` of the oracle."""
    if fmt != "NETCDF4":
        pytest.importorskip("netCDF4", reason="writing a NetCDF-3 file needs netCDF4")
    t = era5_like(2 * STEPS, NY, NX).time
    ds = xr.Dataset({v: (("time", "x"), np.full((len(t), 2), i, "f4")) for i, v in enumerate("ztuv")},
                    coords={"time": t})
    enc = {v: {"chunksizes": (1, 2)} for v in "ztuv"} if fmt == "NETCDF4" else {}
    files = [str(tmp_path / f"f{k}.nc") for k in range(2)]
    for k, f in enumerate(files):
        ds.isel(time=slice(STEPS * k, STEPS * (k + 1))).to_netcdf(f, format=fmt, encoding=enc)
    assert list(xr.open_dataset(files[0]).data_vars) == ["z", "t", "u", "v"]
    for paths in (files[0], files):
        ref = xr.open_mfdataset(paths, **MF).load() if paths is files else xr.open_dataset(paths).load()
        got = open_netcdf(paths)
        assert list(got.data_vars) == ["z", "t", "u", "v"]
        xr.testing.assert_identical(got.load(), ref)
        m = got.insitu.split("time", fractions={"train": 1.0})
        gen = got.insitu.batches(m, "train", batch_size=4, shuffle=False, output="numpy", stack=True)
        assert gen.channels == ["z", "t", "u", "v"]
        stacked = np.concatenate(list(gen))
        np.testing.assert_array_equal(stacked, ref.to_dataarray("variable").transpose("time", "variable", "x").values)


def test_a_ragged_variable_is_named_as_such(tmp_path):
    """A variable-length integer variable (ragged arrays) is refused naming it and ``drop_variables=`` -- not
    as 'variable-length strings' that a newer VirtualiZarr reads (it reads strings only)."""
    netCDF4 = pytest.importorskip("netCDF4")
    f = str(tmp_path / "ragged.nc")
    with netCDF4.Dataset(f, "w") as nc:
        nc.createDimension("time", 3)
        nc.createVariable("a", "f4", ("time",))[:] = [1, 2, 3]
        ragged = nc.createVariable("ragged", nc.createVLType(np.int32, "vl_t"), ("time",))
        for i in range(3):
            ragged[i] = np.arange(i + 1, dtype="i4")
    with pytest.raises(VirtualReferenceError, match=r"'ragged' holds ragged arrays \(variable-length int32\)") as e:
        open_netcdf(f)
    assert "drop_variables=['ragged']" in str(e.value) and "upgrade" not in str(e.value)
    np.testing.assert_array_equal(open_netcdf(f, drop_variables=["ragged"]).a.values, [1, 2, 3])


def test_variable_length_strings(tmp_path):
    """A variable-length string variable (station names): read in place where the installed VirtualiZarr can
    (2.8), else refused naming it and what to do -- leave it out, or upgrade -- not an HDF5 filter."""
    f = str(tmp_path / "s.nc")
    ds = xr.Dataset({"a": (("time", "station"), np.arange(12, dtype="f4").reshape(4, 3)),
                     "name": (("station",), np.array(["ab", "cde", "f"], dtype=object)),
                     "label": (("time",), np.array(["x", "yy", "z", "ww"], dtype=object))},
                    coords={"time": era5_like(4, NY, NX).time})
    ds.to_netcdf(f, engine=ENGINE)
    ref = xr.open_dataset(f).load()
    try:
        got = open_netcdf(f)
    except VirtualReferenceError as e:
        text = str(e)
        named = re.search(r"variable '(\w+)' holds variable-length strings", text)
        assert named and f"drop_variables=['{named[1]}']" in text
        assert "upgrade virtualizarr" in text and "filter" not in text and "nccopy" not in text
        xr.testing.assert_identical(open_netcdf(f, drop_variables=["name", "label"]).load(),
                                    ref.drop_vars(["name", "label"]))
    else:
        xr.testing.assert_identical(got.load(), ref)
        # VirtualiZarr keeps such chunks in the manifest itself: batches read them there (they asked a store
        # registered for the URL '__inlined__'); a fresh open (``load`` kept the values in memory)
        got = open_netcdf(f)
        m = got.insitu.split("time", fractions={"train": 1.0})
        (b,) = got.insitu.batches(m, "train", batch_size=4, shuffle=False, output="numpy", variables=["label", "a"])
        assert list(b["label"]) == ["x", "yy", "z", "ww"] and np.array_equal(b["a"], ref.a.values)


def test_a_silent_server_ends_an_open_within_the_request_bound(days, monkeypatch):
    """``open_netcdf`` of a file on a server that never answers waited obstore's own retries, about 4
    minutes, where ``open_zarr`` and chunk reads end after ``XINSITU_REQUEST_TIMEOUT`` a try; it ends as
    they do now, naming the file."""
    from tests.support.servers import Faults, FileServer

    monkeypatch.setenv("XINSITU_REQUEST_TIMEOUT", "0.5")
    with FileServer(os.path.dirname(days[0]), Faults(hang=1.0, max_per_key=None), max_lifetime_s=60) as srv:
        url = f"{srv.url}/{os.path.basename(days[0])}"
        with pytest.raises(TimeoutError, match=re.escape(url) + r": its size: no answer within 0.5 s, 3 times"):
            open_netcdf(url)
