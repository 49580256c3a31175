"""GRIB files (editions 1 and 2) read in place, one message per chunk: the Dataset, every batch and
every ``isel`` equal ``xr.open_dataset(path, engine="cfgrib")`` bit for bit (names, coordinates,
attributes, values: bitmaps, padded GRIB1, several packings); several files join along time;
truncated, damaged and non-GRIB files raise naming the file. The GRIB files are written here with
ecCodes' samples."""

from __future__ import annotations

import os
import pickle
import re

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from tests.index.test_sampling import run_epoch
from tests.support.resume_check import run_test_save_load_state

pytest.importorskip("virtualizarr", reason="the virtual extra is not installed")
pytest.importorskip("eccodes", reason="the grib extra is not installed")
pytest.importorskip("cfgrib", reason="the grib extra is not installed")

from xinsitu.formats.grib import GribError, decode_message, grib_store, scan_messages, write_grib  # noqa: E402
from xinsitu.virtual import ManifestBackend, open_grib  # noqa: E402

NT, NS, NY, NX = 6, 2, 7, 12  # reference times, steps, grid
TIMES = pd.date_range("2020-01-01", periods=NT, freq="12h")
STEPS = [0, 6]
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def fields(nt: int = NT, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (nt, NS, NY, NX)
    return {"2t": 280 + 10 * rng.standard_normal(shape), "msl": 101300 + 500 * rng.standard_normal(shape)}


def cfgrib(path: str) -> xr.Dataset:
    """The oracle, without the history attribute (it holds the minute cfgrib opened the file)."""
    ds = xr.open_dataset(path, engine="cfgrib", indexpath="").load()
    ds.attrs.pop("history", None)
    return ds


def with_history(ref: xr.Dataset, ds: xr.Dataset) -> xr.Dataset:
    """``ref`` with the history of ``ds`` (batches carry the Dataset's attributes); both name the same versions."""
    strip = re.compile(r"^\S+ ")
    assert strip.sub("", ds.attrs["history"]).startswith("GRIB to CDM+CF via cfgrib-")
    return ref.assign_attrs(history=ds.attrs["history"])


def same(ds: xr.Dataset, ref: xr.Dataset) -> None:
    got = ds.load()
    xr.testing.assert_identical(got.assign_attrs(history=None).drop_attrs(deep=False).assign_attrs(
        {k: v for k, v in got.attrs.items() if k != "history"}), ref)


@pytest.fixture(scope="module", params=[1, 2], ids=["grib1", "grib2"])
def edition(request) -> int:
    return request.param


@pytest.fixture(scope="module")
def one_file(tmp_path_factory, edition) -> str:
    d = tmp_path_factory.mktemp(f"grib{edition}")
    return write_grib(d / "an.grib", fields(), TIMES, STEPS, edition=edition)


# ----------------------------------------------------------------------------- the Dataset
def test_same_dataset_as_cfgrib(one_file, edition):
    ds = open_grib(one_file)
    ref = cfgrib(one_file)
    same(ds, ref)
    assert list(ds.data_vars) == list(ref.data_vars) == ["t2m", "msl"]
    assert ds.attrs["GRIB_edition"] == edition
    assert ds.t2m.encoding["chunks"] == (1, 1, NY, NX)  # one message per chunk
    assert "valid_time" in ds.coords and ds.valid_time.dims == ("time", "step")


def test_data_stays_in_the_files(one_file):
    """Every chunk is one message of the file: (file, offset, length) as ecCodes scanned them."""
    store = grib_store(one_file)
    msgs = scan_messages(one_file)
    arr = store._group.arrays["msl"]
    assert {str(p) for p in arr.manifest._paths.ravel()} == {"file://" + os.path.abspath(one_file)}
    got = sorted(zip(arr.manifest._offsets.ravel().tolist(), arr.manifest._lengths.ravel().tolist(), strict=True))
    assert got == [(o, n) for o, n, _, _ in msgs][1::2]  # 2t, msl, 2t, msl...: msl is every second message
    assert arr.manifest.shape_chunk_grid == (NT, NS, 1, 1)
    assert str(store._group.arrays["latitude"].manifest._paths.ravel()[0]).startswith("xinsitu-inline://")


def test_store_through_xr_open_zarr(one_file):
    """The store is a zarr store like any other: plain ``xr.open_zarr`` (dask, zarr's own codec pipeline) reads it."""
    same(xr.open_zarr(grib_store(one_file), consolidated=False), cfgrib(one_file))


def test_isel_equals_cfgrib(one_file):
    ds, ref = open_grib(one_file), cfgrib(one_file)
    for sel in ({"time": 3}, {"time": slice(1, 4), "step": 1}, {"latitude": slice(2, 5), "longitude": [0, 3, 7]}):
        xr.testing.assert_identical(ds.isel(sel).t2m.load(), ref.isel(sel).t2m)


@pytest.mark.parametrize("output", ["xarray", "numpy"])
@pytest.mark.slow
def test_epoch_matches_cfgrib(one_file, output):
    ds = open_grib(one_file)
    ref = with_history(cfgrib(one_file), ds)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    for split in m.splits:
        gen = ds.insitu.batches(m, split, batch_size=2, output=output, block_chunks=2, seed=3)
        seen = run_epoch(ref, gen, output)
        assert np.array_equal(np.sort(seen), np.arange(gen.n_samples))


def test_windows_patches_and_resume(one_file):
    ds = open_grib(one_file)
    ref = with_history(cfgrib(one_file), ds)
    m = ds.insitu.split("time", fractions={"train": 0.7, "val": 0.3})
    gen = ds.insitu.batches(m, "train", batch_size=2, window={"time": 2}, patch={"latitude": 3, "longitude": 4},
                            output="xarray", variables=["msl"])
    run_epoch(ref, gen, "xarray")

    def make():
        return ds.insitu.batches(m, "train", batch_size=1, window={"time": 2}, seed=5)

    run_test_save_load_state(make, len(make()) // 2, epochs=2)


def test_dataset_pickles(one_file):
    """spawn/forkserver workers get the Dataset pickled: the codec and the inline coordinates travel with it."""
    same(pickle.loads(pickle.dumps(open_grib(one_file))), cfgrib(one_file))


def test_backend_reads_whole_messages(one_file):
    import asyncio

    be = ManifestBackend(grib_store(one_file))
    raw = asyncio.run(be.get("t2m/c/2/1/0/0"))
    assert bytes(raw[:4]) == b"GRIB" and bytes(raw[-4:]) == b"7777"


# ----------------------------------------------------------------------------- what GRIB files hold
def test_padded_grib1(tmp_path):
    """GRIB1 messages followed by padding (as in ERA5's GRIB1 archives): offsets are real offsets."""
    f = write_grib(tmp_path / "pad.grib", fields(3), TIMES[:3], STEPS, edition=1, pad=120)
    msgs = scan_messages(f)
    assert msgs[1][0] == msgs[0][1] + 120  # not a running sum of lengths
    same(open_grib(f), cfgrib(f))


@pytest.mark.parametrize("edition", [1, 2])
def test_bitmap_reads_as_nan(tmp_path, edition):
    data = fields(2)
    data["2t"][:, :, 1::3, ::4] = 9999.0
    f = write_grib(tmp_path / "bitmap.grib", data, TIMES[:2], STEPS, edition=edition, missing=9999.0)
    ds, ref = open_grib(f), cfgrib(f)
    same(ds, ref)
    assert np.isnan(ds.t2m.values).sum() == np.isnan(ref.t2m.values).sum() > 0


@pytest.mark.parametrize("edition,packing,decoder", [
    (1, "grid_simple", "gribberish"),
    (1, "grid_ieee", "eccodes"),            # gribberish 0.30 decodes GRIB1 IEEE to wrong values
    (1, "grid_second_order", "eccodes"),    # ... and refuses GRIB1 second-order packing
    (2, "grid_simple", "gribberish"),
    (2, "grid_ccsds", "gribberish"),
    (2, "grid_complex_spatial_differencing", "gribberish"),
    (2, "grid_png", "gribberish"),
    (2, "grid_ieee", "eccodes"),
])
@pytest.mark.slow
def test_packings(tmp_path, edition, packing, decoder):
    """Each packing reads as cfgrib reads it; gribberish decodes only the packings it was verified on."""
    pytest.importorskip("gribberish", reason="the grib extra is not installed")
    ny, nx = 40, 60
    rng = np.random.default_rng(1)
    y, x = np.meshgrid(np.linspace(0, 3, ny), np.linspace(0, 6, nx), indexing="ij")
    smooth = 280 + 10 * np.sin(y) * np.cos(x)
    data = {"2t": smooth + rng.standard_normal((2, 1, ny, nx))}
    f = write_grib(tmp_path / f"{packing}.grib", data, TIMES[:2], [0], edition=edition, packing=packing)
    assert {p for _, _, _, p in scan_messages(f)} == {packing}
    from xinsitu.formats.grib import _gribberish_major

    if _gribberish_major() < 1 and packing != "grid_simple":
        decoder = "eccodes"  # gribberish 0.x (Python 3.11's newest) decodes only grid_simple exactly
    store = grib_store(f)
    assert store._group.arrays["t2m"].metadata.codecs[0].decoder == decoder
    same(open_grib(f), cfgrib(f))
    same(open_grib(f, decoder="eccodes"), cfgrib(f))


@pytest.mark.parametrize("packing,bits", [("grid_complex_spatial_differencing", [16]), ("grid_ccsds", [16, 24])])
def test_every_message_reads_as_cfgrib_reads_it(tmp_path, packing, bits):
    """Many messages of a packing gribberish 0.30 decodes wrong beyond the first (which is the one checked):
    complex spatial differencing gave 1456 of 1457 values of later messages wrong, silently; ccsds whose
    bits per value change between messages failed ("Memory error", as if the file were damaged). Every
    message now reads as cfgrib reads it; a message gribberish cannot decode is decoded by ecCodes."""
    pytest.importorskip("gribberish", reason="the grib extra is not installed")
    ny, nx = 31, 47
    y, x = np.meshgrid(np.linspace(0, 3, ny), np.linspace(0, 6, nx), indexing="ij")
    rng = np.random.default_rng(0)
    times = pd.date_range("2021-03-01", periods=6, freq="6h")
    paths = []
    for k, b in enumerate(bits):  # (files of other bits per value, joined along time)
        data = {"2t": np.stack([np.stack([280 + 10 * np.sin(y + i) * np.cos(x - s) + rng.standard_normal((ny, nx))
                                          for s in (0, 6)]) for i in range(k * 3, k * 3 + 3)])}
        paths.append(write_grib(tmp_path / f"f{k}.grib2", data, times[k * 3:k * 3 + 3], [0, 6], edition=2,
                                packing=packing, bits_per_value=b))
    ref = xr.concat([cfgrib(p) for p in paths], "time") if len(paths) > 1 else cfgrib(paths[0])
    ds = open_grib(paths if len(paths) > 1 else paths[0])
    np.testing.assert_array_equal(ds.t2m.values, ref.t2m.values)
    if packing != "grid_ccsds":
        return
    for o, n, _, _ in scan_messages(paths[-1]):  # gribberish asked for: ecCodes where it cannot decode
        with open(paths[-1], "rb") as fh:
            fh.seek(o)
            raw = fh.read(n)
        np.testing.assert_array_equal(decode_message(raw, (ny, nx), None, "gribberish"),
                                      decode_message(raw, (ny, nx), None, "eccodes"))


@pytest.mark.parametrize("edition,packing", [(1, "grid_simple"), (2, "grid_simple"), (2, "grid_jpeg")])
def test_constant_and_all_missing_messages_read_as_cfgrib_reads_them(tmp_path, edition, packing):
    """Messages after an ordinary first one (the one ``decoder="auto"`` checks) that code one value or none:
    gribberish gave a constant field under a bitmap as the constant everywhere (GRIB1 and 2), a GRIB2 constant
    field as zeros (0.30), and spun for good, holding the GIL, on an all-missing JPEG 2000 message (1.9). A
    variable with such a message decodes with ecCodes: as cfgrib, NaN where the bitmap says."""
    pytest.importorskip("gribberish", reason="the grib extra is not installed")
    from xinsitu.formats.grib import CONSTANT

    ny, nx = 7, 12
    first = 280 + np.random.default_rng(3).standard_normal((ny, nx))
    masked = np.full((ny, nx), 5.0)
    masked[::2, ::3] = 9999.0
    data = {"2t": np.stack([first, np.full((ny, nx), 273.15), masked, np.full((ny, nx), 9999.0)])[:, None]}
    f = write_grib(tmp_path / "constant.grib", data, pd.date_range("2020-01-01", periods=4, freq="6h"), [0],
                   edition=edition, packing=packing, missing=9999.0)
    assert [p for _, _, _, p in scan_messages(f)][1:] == [CONSTANT] * 3
    assert grib_store(f)._group.arrays["t2m"].metadata.codecs[0].decoder == "eccodes"
    ds, ref = open_grib(f), cfgrib(f)
    same(ds, ref)
    got = ds.t2m.values
    assert np.isnan(got[2]).sum() == masked[masked == 9999.0].size and np.isnan(got[3]).all()
    np.testing.assert_allclose(got[1], 273.15, rtol=1e-6)


def test_large_fields_decode_with_eccodes(tmp_path, monkeypatch):
    """gribberish only for small fields (measured: ecCodes is ~2x faster from 361 x 720 on); both exact."""
    pytest.importorskip("gribberish", reason="the grib extra is not installed")
    import xinsitu.formats.grib as grib

    ny, nx = 40, 60
    data = {"2t": 280 + np.random.default_rng(2).standard_normal((2, 1, ny, nx))}
    f = write_grib(tmp_path / "f.grib", data, TIMES[:2], [0], edition=2)
    assert grib_store(f)._group.arrays["t2m"].metadata.codecs[0].decoder == "gribberish"
    monkeypatch.setattr(grib, "GRIBBERISH_MAX_VALUES", ny * nx)  # the same field counts as large now
    assert grib_store(f)._group.arrays["t2m"].metadata.codecs[0].decoder == "eccodes"
    same(open_grib(f), cfgrib(f))


def test_decoders_agree(one_file):
    pytest.importorskip("gribberish", reason="the grib extra is not installed")
    for o, n, _, _ in scan_messages(one_file):
        with open(one_file, "rb") as fh:
            fh.seek(o)
            raw = fh.read(n)
        a = decode_message(raw, (NY, NX), np.finfo(np.float32).max, "gribberish")
        b = decode_message(raw, (NY, NX), np.finfo(np.float32).max, "eccodes")
        assert np.array_equal(a, b, equal_nan=True)


def test_missing_field_reads_as_nan(tmp_path):
    """A (time, step) no message holds is NaN, as in cfgrib; the chunk has no reference."""
    f1 = write_grib(tmp_path / "a.grib", fields(2), TIMES[:2], STEPS, edition=2)
    raw = open(f1, "rb").read()
    msgs = scan_messages(f1)
    f = tmp_path / "holes.grib"
    f.write_bytes(b"".join(raw[o:o + n] for i, (o, n, _, _) in enumerate(msgs) if i != 2))  # 2t at (0, 6h)
    ds, ref = open_grib(str(f)), cfgrib(str(f))
    same(ds, ref)
    assert np.isnan(ds.t2m.values[0, 1]).all() and not np.isnan(ds.msl.values).any()


def test_a_file_changed_after_opening_is_refused_naming_it(tmp_path):
    """The references are byte offsets into the file as it was opened: a file written again since -- here
    the same messages in another order, each of the same size, so every offset still lands on a message --
    is refused naming the file (its batches held one field as another), by a pickled copy too (a worker's:
    it read in silence); opened again, it reads as cfgrib."""
    from xinsitu.stores.backend import ChunkReadError

    data = fields(2)
    f = write_grib(tmp_path / "a.grib", data, TIMES[:2], STEPS, edition=2)
    ds = open_grib(f)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    write_grib(f, {"msl": data["msl"], "2t": data["2t"]}, TIMES[:2], STEPS, edition=2)
    with pytest.raises(ChunkReadError, match=re.escape(str(f)) + " changed after it was opened"):
        list(ds.insitu.batches(m, "train", batch_size=2, shuffle=False, output="numpy"))
    copy = pickle.loads(pickle.dumps(ds))  # (as a DataLoader worker under spawn or a cluster's worker gets it)
    with pytest.raises(ChunkReadError, match=re.escape(str(f)) + " changed after it was opened"):
        list(copy.insitu.batches(m, "train", batch_size=2, shuffle=False, output="numpy"))
    again = open_grib(f)
    same(again, cfgrib(f))
    assert len(list(again.insitu.batches(m, "train", batch_size=2, output="numpy"))) == 1  # (2 steps)


def test_a_file_changed_during_a_run_is_refused_at_its_next_read(tmp_path):
    """Checked at every read, not only the first: a file written again between two epochs of one generator
    (the same messages in another order) is refused at the next epoch's read, naming the file. (The first
    sample, read ahead as the first epoch ended, was read before the change.)"""
    from xinsitu.stores.backend import ChunkReadError

    data = fields(2)
    f = write_grib(tmp_path / "a.grib", data, TIMES[:2], STEPS, edition=2)
    ds = open_grib(f)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", batch_size=1, shuffle=False, output="numpy")
    first = [b["t2m"] for b in gen]
    np.testing.assert_array_equal(np.concatenate(first), cfgrib(f).t2m.values)
    was = os.stat(f)
    write_grib(f, {"msl": data["msl"], "2t": data["2t"]}, TIMES[:2], STEPS, edition=2)
    os.utime(f, ns=(was.st_atime_ns, was.st_mtime_ns + 10**9))  # (a later write, whatever the clock's grain)
    gen.set_epoch(1)
    with pytest.raises(ChunkReadError, match=re.escape(str(f)) + " changed after it was opened"):
        list(gen)


# ----------------------------------------------------------------------------- several files
@pytest.mark.slow
def test_files_join_along_time(tmp_path, edition):
    """Daily files, each one reference time (cfgrib makes ``time`` a scalar there): joined along time as
    ``xr.concat`` joins them; the order of the files given does not matter."""
    data = fields()
    files = [write_grib(tmp_path / f"day{i}.grib", {k: v[i:i + 1] for k, v in data.items()}, TIMES[i:i + 1], STEPS,
                        edition=edition) for i in range(NT)]
    ref = xr.concat([cfgrib(f) for f in files], dim="time", coords="different", compat="equals", join="exact",
                    combine_attrs="override")
    ds = open_grib(list(reversed(files)))
    same(ds, ref)
    assert ds.t2m.dims == ("time", "step", "latitude", "longitude") and ds.sizes["time"] == NT
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    run_epoch(with_history(ref, ds), ds.insitu.batches(m, "val", batch_size=2, output="xarray", seed=1), "xarray")
    same(open_grib(str(tmp_path / "day*.grib")), ref)


def test_files_of_several_times_join(tmp_path):
    data = fields()
    files = [write_grib(tmp_path / f"part{i}.grib", {k: v[2 * i:2 * i + 2] for k, v in data.items()},
                        TIMES[2 * i:2 * i + 2], STEPS) for i in range(NT // 2)]
    ref = xr.concat([cfgrib(f) for f in files], dim="time", coords="different", compat="equals", join="exact",
                    combine_attrs="override")
    same(open_grib(files), ref)
    whole = write_grib(tmp_path / "whole.grib", data, TIMES, STEPS)
    same(open_grib(files), cfgrib(whole))


def test_files_on_other_grids_refused(tmp_path):
    a = write_grib(tmp_path / "a.grib", fields(1), TIMES[:1], STEPS)
    b = write_grib(tmp_path / "b.grib", fields(1), TIMES[1:2], STEPS, lat0=80.0)
    with pytest.raises(GribError, match=r"coordinate 'latitude' in .*b\.grib differs"):
        grib_store([a, b])


def test_overlapping_files_refused(tmp_path):
    a = write_grib(tmp_path / "a.grib", fields(2), TIMES[:2], STEPS)
    b = write_grib(tmp_path / "b.grib", fields(2), TIMES[1:3], STEPS)
    with pytest.raises(GribError, match=r"a\.grib and .*b\.grib overlap along 'time'"):
        grib_store([a, b])


# ----------------------------------------------------------------------------- broken files
def test_truncated_file_names_it(tmp_path, one_file):
    raw = open(one_file, "rb").read()
    f = tmp_path / "cut.grib"
    f.write_bytes(raw[:-50])
    with pytest.raises(GribError, match=re.escape(str(f)) + r": the GRIB message after byte \d+ cannot be read.*"
                                        r"truncated"):
        open_grib(str(f))
    f.write_bytes(raw + raw[:12])  # a last message cut within its first section
    with pytest.raises(GribError, match=re.escape(str(f))):
        open_grib(str(f))


def test_damaged_message_in_the_middle_names_it(tmp_path, one_file):
    raw = open(one_file, "rb").read()
    msgs = scan_messages(one_file)
    o, n = msgs[3][0], msgs[3][1]
    f = tmp_path / "hole.grib"
    f.write_bytes(raw[:o + n // 2] + raw[o + n:])  # half of message 3 gone
    with pytest.raises(GribError, match=re.escape(str(f))):
        open_grib(str(f))
    f.write_bytes(raw[:o + 40] + bytes(40) + raw[o + 80:])  # its header zeroed, its length and '7777' kept
    with pytest.raises(GribError, match=re.escape(str(f))):  # (GRIB2: ecCodes cannot read its keys, was unnamed)
        open_grib(str(f))


def test_not_grib_names_it(tmp_path):
    f = tmp_path / "notes.grib"
    f.write_text("plain text\n" * 40)
    with pytest.raises(GribError, match=re.escape(str(f)) + " holds no GRIB message"):
        open_grib(str(f))
    f.write_text("not a GRIB file\n" * 40)  # "GRIB" where a message would start, then nothing of one
    with pytest.raises(GribError, match=re.escape(str(f)) + " is not a GRIB file"):
        open_grib(str(f))
    g = tmp_path / "data.nc"
    xr.Dataset({"a": ("x", np.arange(3.0))}).to_netcdf(g)
    with pytest.raises(GribError, match=re.escape(str(g))):
        open_grib([str(g)])


def test_file_changed_after_opening_names_it(tmp_path, one_file):
    import shutil

    f = shutil.copy(one_file, tmp_path / "moving.grib")
    ds = open_grib(f)
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    with pytest.raises(OSError, match="moving.grib"):
        list(ds.insitu.batches(m, "val", batch_size=2, output="numpy", shuffle=False))


@pytest.mark.parametrize("sample", ["reduced_gg_pl_32_grib1", "reduced_gg_pl_32_grib2", "regular_gg_sfc_grib2",
                                    "rotated_ll_sfc_grib2", "sh_ml_grib2"])
def test_other_grids(tmp_path, sample):
    """Reduced and regular Gaussian grids, rotated lat/lon (2-D coordinates) and spherical harmonics read as cfgrib
    reads them (a reduced grid or spectral field is one ``values`` dimension, one message a chunk)."""
    import eccodes

    rng = np.random.default_rng(2)
    f = str(tmp_path / f"{sample}.grib")
    with open(f, "wb") as fh:
        for date in (20200101, 20200102, 20200103):
            h = eccodes.codes_grib_new_from_samples(sample)
            eccodes.codes_set(h, "dataDate", date)
            eccodes.codes_set_values(h, 280 + rng.standard_normal(eccodes.codes_get(h, "numberOfValues")))
            fh.write(eccodes.codes_get_message(h))
            eccodes.codes_release(h)
    ds, ref = open_grib(f), cfgrib(f)
    same(ds, ref)
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.4})
    run_epoch(with_history(ref, ds), ds.insitu.batches(m, "train", batch_size=1, output="xarray"), "xarray")


def test_filter_by_keys(tmp_path):
    """Fields on two levels (2 m and 10 m above ground): cfgrib opens one hypercube at a time, and so does open_grib."""
    rng = np.random.default_rng(3)
    f = str(tmp_path / "levels.grib")
    a = write_grib(tmp_path / "a.grib", {"2t": 280 + rng.standard_normal((2, 1, NY, NX))}, TIMES[:2])
    b = write_grib(tmp_path / "b.grib", {"10u": rng.standard_normal((2, 1, NY, NX))}, TIMES[:2])
    with open(f, "wb") as out:
        out.write(open(a, "rb").read() + open(b, "rb").read())
    keys = {"typeOfLevel": "heightAboveGround", "level": 10}
    ref = xr.open_dataset(f, engine="cfgrib", indexpath="", filter_by_keys=keys).load()
    ref.attrs.pop("history")
    ds = open_grib(f, filter_by_keys=keys)
    same(ds, ref)
    assert list(ds.data_vars) == ["u10"]


@pytest.mark.slow
def test_grib_bench_smoke(tmp_path):
    """bench/grib_bench.py on a tiny archive: every variant runs and reads the same number of chunks."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "res.json"
    cmd = [sys.executable, str(root / "bench" / "grib_bench.py"), "--nt", "20", "--ny", "11", "--nx", "20",
           "--file-times", "10", "--rounds", "1", "--epochs", "2", "--batch-size", "4",
           "--data-dir", str(tmp_path / "data"), "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["median_samples_per_s"]) == {"zarr", "grib", "grib-eccodes"}
    chunks = {v: rs[0]["io"]["chunks"] for v, rs in res["runs"].items()}
    assert len(set(chunks.values())) == 1 and chunks["zarr"] > 0, chunks
    assert res["runs"]["grib-eccodes"][0]["decoders"] == ["eccodes"]


def test_forked_child_reads_grib(one_file):
    """A process forked after the parent read (a DataLoader worker under Linux's default start method) reads the
    messages with plain file I/O and decodes them: the same epoch, no hang."""
    from tests.support.forked import epoch_in_fork
    from tests.support.resume_check import record

    ds = open_grib(one_file)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", batch_size=2, output="numpy", seed=2)
    expected = [record(b) for b in gen]
    status, got = epoch_in_fork(gen, 60, lambda g: [record(b) for b in g])
    assert status == "ok", got
    assert got == expected


def test_ensembles_join_along_time(tmp_path):
    """Ensemble members (cfgrib's ``number`` comes before ``time``): files of 2 and 1 reference times join along
    ``time``, the second axis, as ``xr.concat`` joins them (the one-time file's scalar ``time`` becomes that axis)."""
    import eccodes

    rng = np.random.default_rng(4)

    def write(path, dates):
        with open(path, "wb") as fh:
            for date in dates:
                for member in (1, 2, 3):
                    for step in STEPS:
                        h = eccodes.codes_grib_new_from_samples("regular_ll_sfc_grib2")
                        for k, v in (("productDefinitionTemplateNumber", 1), ("perturbationNumber", member),
                                     ("numberOfForecastsInEnsemble", 10), ("typeOfEnsembleForecast", 3),
                                     ("dataDate", date), ("step", step), ("shortName", "2t")):
                            eccodes.codes_set(h, k, v)
                        eccodes.codes_set_values(h, 280 + rng.standard_normal(eccodes.codes_get(h, "numberOfValues")))
                        fh.write(eccodes.codes_get_message(h))
                        eccodes.codes_release(h)
        return str(path)

    files = [write(tmp_path / "b.grib", [20200103]), write(tmp_path / "a.grib", [20200101, 20200102])]
    one = cfgrib(files[1])
    assert one.t2m.dims == ("number", "time", "step", "latitude", "longitude")
    same(open_grib(files[1]), one)
    ref = xr.concat([cfgrib(files[1]), cfgrib(files[0]).expand_dims("time", axis=1)], dim="time",
                    coords="different", compat="equals", join="exact", combine_attrs="override")
    ds = open_grib(files)
    same(ds, ref)
    assert ds.t2m.dims == ("number", "time", "step", "latitude", "longitude") and ds.sizes["time"] == 3
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.4})
    run_epoch(with_history(ref, ds), ds.insitu.batches(m, "train", batch_size=2, output="xarray"), "xarray")
