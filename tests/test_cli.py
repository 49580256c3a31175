"""``python -m xinsitu inspect|bench``: run as real processes on archives written here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import xinsitu
from tests.conftest import CT, NT
from xinsitu import cli, cli_bench
from xinsitu.synthetic import write_era5_like

VARS = ["t2m", "tp", "u10", "v10", "z500"]  # the data variables on time


def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    # a crash says where (Python's stacks on a fatal signal; glibc's own abort message to stderr, not the tty)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "LIBC_FATAL_STDERR_": "1"}
    p = subprocess.run([sys.executable, "-W", "ignore", "-m", "xinsitu", *args], capture_output=True, text=True,
                       timeout=120, env=env)
    if ok:
        assert p.returncode == 0, f"exit status {p.returncode}: {p.stderr}"
    return p


@pytest.mark.slow
def test_inspect_text(era5_path: str) -> None:
    out = run("inspect", era5_path).stdout
    assert "<xinsitu.Geometry>" in out and "t2m" in out and "zstd" in out
    assert "Suggested split:" in out
    assert "m = ds.insitu.split('time', fractions={'train': 0.8, 'val': 0.1, 'test': 0.1}, gap=1)" in out
    assert "1979-01-01T00:00:00" in out  # the summary's label range of train


@pytest.mark.slow
def test_inspect_json_matches_the_library(era5_path: str) -> None:
    got = json.loads(run("inspect", era5_path, "--json").stdout)
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1}, gap=1)
    assert got["split"]["splits"] == m.to_dict()["splits"] and got["split"]["gap"] == 1
    assert got["split"]["fingerprint"] == m.fingerprint
    n = sum(len(b) for b in m.splits.values())
    assert n + 2 == math.ceil(NT / CT)  # every chunk block but the two gaps
    assert got["geometry"]["dims"]["time"] == {"length": NT, "chunk": CT, "blocks": math.ceil(NT / CT)}
    assert got["geometry"]["variables"]["tp"]["dtype"] == "int16"


def test_inspect_falls_back_and_explains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    few = str(tmp_path / "few.zarr")
    write_era5_like(few, nt=16, ny=2, nx=3, chunk_time=4)  # 4 chunk blocks: no room for 3 splits + 2 gaps
    assert cli.main(["inspect", few, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["split"] is not None and got["split"]["gap"] == 0 and "gap=0" in got["code"]
    assert sum(b - a for s in got["split"]["splits"].values() for a, b in s["runs"]) == 4  # runs [start, stop)
    whole = str(tmp_path / "whole.zarr")
    write_era5_like(whole, nt=8, ny=2, nx=3, chunk_time=8)  # one chunk: nothing to split
    assert cli.main(["inspect", whole]) == 0
    out = capsys.readouterr().out
    assert "No split suggested" in out and "re-chunk" in out
    assert cli.main(["inspect", str(tmp_path / "nowhere.zarr")]) == 1
    err = capsys.readouterr().err
    assert "nowhere.zarr" in err and "Traceback" not in err


@pytest.mark.slow
def test_bench_reads_every_chunk_once(era5_path: str, tmp_path: Path) -> None:
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.6, "val": 0.4})
    path = tmp_path / "m.json"
    m.to_json(path)
    got = json.loads(run("bench", era5_path, "--manifest", str(path), "--split", "val", "--batch-size", "7",
                         "--json").stdout)
    nblocks = len(m.splits["val"])
    assert got["blocks"] == nblocks and got["variables"] == VARS
    raw, io = got["raw"], got["loader"]
    assert raw["objects"] == io["chunks"] == nblocks * len(VARS)  # each chunk once, in both passes
    assert raw["bytes"] == io["bytes_read"] > 0 and raw["missing"] == 0
    samples = m.positions("val")
    assert io["samples"] == samples and io["batches"] == math.ceil(samples / 7)
    assert io["bytes_decoded"] == samples * 6 * 10 * (4 * 4 + 2)  # NY x NX, four float32 and one int16
    assert got["verdict"] and all(isinstance(s, str) for s in got["verdict"])


@pytest.mark.slow
def test_bench_text_names_the_bottleneck(era5_path: str) -> None:
    out = run("bench", era5_path, "--max-blocks", "3", "--step-ms", "100000").stdout
    assert "split 'train': 3 of" in out
    assert "raw pass" in out and "15 objects" in out  # 3 chunk blocks x 5 variables
    assert "loader" in out and "15 chunks read once each" in out
    assert "Model-bound" in out


def test_version_and_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("--version").stdout.strip() == f"xinsitu {xinsitu.__version__}"
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2 and "inspect" in capsys.readouterr().err


@pytest.mark.parametrize("sel", [{"time": slice(5, 70)}, {"time": slice(3, 40), "lat": slice(1, 5)}])
def test_raw_keys_match_the_loader_on_subsets(era5_path: str, sel: dict) -> None:
    """The raw pass fetches exactly the objects the loader reads, also for a subset that
    starts mid-chunk (its first, partial chunk is a chunk block of its own)."""
    ds = xinsitu.open_zarr(era5_path).isel(sel)
    m = ds.insitu.split("time", fractions={"a": 0.5, "b": 0.5})
    gen = ds.insitu.batches(m, "b", batch_size=16, output="numpy")
    keys = cli_bench.raw_keys(gen)
    assert len({(id(s), k) for s, k in keys}) == len(keys)
    for _ in gen:
        pass
    assert len(keys) == gen.io_stats["chunks"]
    raw = cli_bench.raw_pass(keys, 8)
    assert raw["bytes"] == gen.io_stats["bytes_read"]


def test_split_dim_prefers_the_largest_variables_leading_dim(era5_path: str) -> None:
    g = xinsitu.open_zarr(era5_path).insitu.geometry
    assert list(g.variables)[0] == "lsm"  # a (lat, lon) variable comes first, yet time is chosen
    assert cli.split_dim(g) == "time"
    assert cli.split_dim(xinsitu.open_zarr(era5_path)[["lsm"]].insitu.geometry) is None


def test_verdict_sentences() -> None:
    io = {"seconds": 1.0, "batches": 10}
    assert "store" in cli_bench.verdict({"seconds": 0.9}, io, 32, None)[0]
    assert "CPU" in cli_bench.verdict({"seconds": 0.1}, io, 32, None)[0]
    assert cli_bench.verdict(None, io, 32, 500.0)[0].startswith("Model-bound")
    assert cli_bench.verdict(None, io, 32, 5.0)[0].startswith("Store-bound")
    assert np.isclose(float(cli_bench.verdict(None, io, 32, 5.0)[0].split("needs ")[1].split(" ms")[0]), 100.0)


@pytest.mark.slow
def test_inspect_says_whether_chunks_carry_checksums(tmp_path: Path) -> None:
    """Without a checksum, transfer corruption cannot be detected: ``inspect`` says so; with crc32c it says
    chunks are verified."""
    import xarray as xr
    import zarr

    ds = xr.Dataset({"a": (("t", "x"), np.arange(40.0).reshape(20, 2))})
    ds.to_zarr(tmp_path / "plain.zarr", encoding={"a": {"chunks": (5, 2)}}, zarr_format=3)
    ds.to_zarr(tmp_path / "crc.zarr", zarr_format=3, encoding={"a": {
        "chunks": (5, 2), "compressors": [zarr.codecs.ZstdCodec(), zarr.codecs.Crc32cCodec()]}})
    plain = run("inspect", str(tmp_path / "plain.zarr")).stdout
    assert "Checksums: none on a" in plain and "cannot be detected" in plain and "Crc32cCodec" in plain
    crc = run("inspect", str(tmp_path / "crc.zarr")).stdout
    assert "carry one (crc32c)" in crc
    got = json.loads(run("inspect", str(tmp_path / "crc.zarr"), "--json").stdout)
    assert got["checksums"] == {"a": "crc32c"}


def _netcdf_files(tmp_path: Path) -> dict[str, list[str]]:
    """A NetCDF classic file (CDF-1), a 64-bit offset one (CDF-2), and two NetCDF4 files of one year."""
    pytest.importorskip("virtualizarr", reason="the virtual extra is not installed")
    pytest.importorskip("netCDF4", reason="writing NetCDF files needs netCDF4")
    from xinsitu.synthetic import era5_like

    ds = era5_like(24, 4, 6)
    out: dict[str, list[str]] = {}
    for fmt in ("NETCDF3_CLASSIC", "NETCDF3_64BIT"):
        f = str(tmp_path / f"{fmt}.nc")
        ds.to_netcdf(f, format=fmt, engine="netcdf4", unlimited_dims=["time"])
        out[fmt] = [f]
    enc = {v: {"chunksizes": (4, 4, 6)} for v in ds.data_vars if "time" in ds[v].dims}
    out["NETCDF4"] = []
    for i in (0, 1):
        f = str(tmp_path / f"part{i}.nc4")
        ds.isel(time=slice(12 * i, 12 * i + 12)).to_netcdf(f, format="NETCDF4", engine="netcdf4", encoding=enc)
        out["NETCDF4"].append(f)
    return out


@pytest.mark.slow
def test_inspect_opens_netcdf_files_in_place(tmp_path: Path) -> None:
    files = _netcdf_files(tmp_path)
    for fmt in ("NETCDF3_CLASSIC", "NETCDF3_64BIT"):
        out = run("inspect", files[fmt][0]).stdout
        assert "<xinsitu.Geometry>" in out and "t2m" in out and "Suggested split:" in out, out
        assert f"ds = xinsitu.virtual.open_netcdf({files[fmt][0]!r})" in out
    glob_ = str(tmp_path / "part*.nc4")
    for args in ([glob_], files["NETCDF4"]):  # a quoted glob, and the files one by one
        got = json.loads(run("inspect", *args, "--json").stdout)
        assert got["geometry"]["dims"]["time"] == {"length": 24, "chunk": 4, "blocks": 6}
        assert got["code"] is not None
    out = run("inspect", glob_).stdout
    assert f"ds = xinsitu.virtual.open_netcdf({files['NETCDF4']!r})" in out


@pytest.mark.slow
def test_inspect_opens_grib_files_in_place(tmp_path: Path) -> None:
    pytest.importorskip("virtualizarr", reason="the virtual extra is not installed")
    pytest.importorskip("eccodes", reason="the grib extra is not installed")
    pytest.importorskip("cfgrib", reason="the grib extra is not installed")
    import pandas as pd

    from xinsitu.formats.grib import write_grib

    rng = np.random.default_rng(0)
    f = write_grib(tmp_path / "an.grib", {"2t": 280 + rng.standard_normal((6, 1, 5, 8))},
                   pd.date_range("2020-01-01", periods=6, freq="12h"), [0])
    out = run("inspect", f).stdout
    assert "<xinsitu.Geometry>" in out and "t2m" in out, out
    assert f"ds = xinsitu.virtual.open_grib({f!r})" in out


def test_inspect_on_another_file_names_the_functions(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("not an archive")
    p = run("inspect", str(f), ok=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "xinsitu.virtual.open_netcdf" in p.stderr and "xinsitu.virtual.open_grib" in p.stderr, p.stderr
    assert "notes.txt" in p.stderr


@pytest.mark.slow
def test_inspect_says_one_line_on_consolidated_metadata_and_takes_the_option(tmp_path: Path) -> None:
    """Without consolidated metadata: one line naming --consolidated, not xarray's paragraph (which a
    process run with warnings shown would print); --consolidated false: nothing."""
    path = str(tmp_path / "u.zarr")
    write_era5_like(path, nt=16, ny=2, nx=3, chunk_time=4)
    meta = json.loads((Path(path) / "zarr.json").read_text())
    assert meta.pop("consolidated_metadata", None) is not None  # taken away
    (Path(path) / "zarr.json").write_text(json.dumps(meta))

    def said(*args: str) -> str:
        p = subprocess.run([sys.executable, "-W", "default", "-m", "xinsitu", "inspect", path, *args],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        return p.stderr

    err = said()
    assert "Failed to open Zarr store with consolidated metadata" not in err, err
    assert "--consolidated false" in err
    assert "consolidated" not in said("--consolidated", "false")


# ----------------------------------------------------------------------------- doctor
@pytest.mark.slow
def test_doctor_one_line_to_paste() -> None:
    """``python -m xinsitu doctor``: one line, every version that matters, and the decode path chosen."""
    import platform
    from importlib import metadata

    import zarr

    out = run("doctor").stdout
    assert out.count("\n") == 1, out
    for part in (f"python {platform.python_version()}", f"xinsitu {xinsitu.__version__}", f"zarr {zarr.__version__}",
                 f"numpy {np.__version__}", f"xarray {metadata.version('xarray')}",
                 f"obstore {metadata.version('obstore')}", "torch ", "jax ", "cupy ", "cuda ", "decode "):
        assert part in out, (part, out)
    got = json.loads(run("doctor", "--json").stdout)
    assert got["zarr"] == zarr.__version__ and got["numpy"] == np.__version__
    assert got["decode"] == cli.doctor()["decode"] and "shard index" in got["decode"]
    assert got["gpu decode"].startswith(("cpu only: ", "nvCOMP "))  # where chunks may decode on a GPU
    assert set(got) == {"python", "xinsitu", *cli.DOCTOR_PACKAGES, "cuda", "decode", "gpu decode"}


# ----------------------------------------------------------------------------- a missing extra
def _inspect_without(module: str, path: str) -> subprocess.CompletedProcess:
    """``python -m xinsitu inspect path`` in a process where ``module`` cannot be imported (as where its
    extra was never installed: ``None`` in ``sys.modules`` makes ``import module`` fail)."""
    code = (f"import sys; sys.modules[{module!r}] = None; sys.argv = ['xinsitu', 'inspect', {path!r}]; "
            "import runpy; runpy.run_module('xinsitu', run_name='__main__')")
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module", ["virtualizarr", "eccodes", "cfgrib"])
@pytest.mark.slow
def test_inspect_grib_without_the_grib_extra_says_so_in_one_line(tmp_path: Path, module: str) -> None:
    pytest.importorskip("eccodes", reason="writing a GRIB file needs ecCodes")
    import pandas as pd

    from xinsitu.formats.grib import write_grib

    f = write_grib(tmp_path / "an.grib", {"2t": 280 + np.zeros((4, 1, 3, 4))},
                   pd.date_range("2020-01-01", periods=4, freq="12h"), [0])
    p = _inspect_without(module, str(f))
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "pip install 'xinsitu[grib]'" in p.stderr and module in p.stderr, p.stderr


@pytest.mark.parametrize("module", ["virtualizarr", "h5py"])
@pytest.mark.slow
def test_inspect_netcdf_without_the_virtual_extra_says_so_in_one_line(tmp_path: Path, module: str) -> None:
    files = _netcdf_files(tmp_path)
    p = _inspect_without(module, files["NETCDF4"][0])
    if module == "h5py" and p.returncode == 0:
        pytest.skip("this NetCDF4 file opens without h5py")
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "pip install 'xinsitu[virtual]'" in p.stderr and module in p.stderr, p.stderr
    p = _inspect_without("virtualizarr", files["NETCDF3_CLASSIC"][0])
    assert p.returncode != 0 and "Traceback" not in p.stderr and "'xinsitu[virtual]'" in p.stderr, p.stderr


@pytest.mark.slow
def test_open_netcdf_without_the_extra_names_it(tmp_path: Path) -> None:
    """The library's own error (not only the command line's) names the extra."""
    files = _netcdf_files(tmp_path)
    code = ("import sys; sys.modules['virtualizarr'] = None; import xinsitu.virtual\n"
            f"try:\n    xinsitu.virtual.open_netcdf({files['NETCDF4'][0]!r})\n"
            "except ModuleNotFoundError as e:\n    print(e.name, '|', e)\n")
    p = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("virtualizarr |") and "pip install 'xinsitu[virtual]'" in p.stdout, p.stdout


# ----------------------------------------------------------------------------- few chunks, files in place
@pytest.mark.parametrize("nchunks", [2, 3])
def test_inspect_suggests_a_split_of_two_or_three_chunks(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         nchunks: int) -> None:
    """Two chunk blocks hold train 1 / val 1 (a file of two months, one record each): suggested, and the
    line of Python it prints makes that split."""
    path = str(tmp_path / "few.zarr")
    write_era5_like(path, nt=4 * nchunks, ny=2, nx=3, chunk_time=4)
    assert cli.main(["inspect", path, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["split"] is not None, got["problem"]
    assert {"train", "val"} <= set(got["split"]["splits"])
    ns = {"ds": xinsitu.open_zarr(path)}
    exec(got["code"], ns)
    assert ns["m"].to_dict()["splits"] == got["split"]["splits"]
    assert all(ns["m"].positions(k) > 0 for k in ns["m"].splits)


@pytest.mark.slow
def test_inspect_of_files_in_place_suggests_no_rewrite(tmp_path: Path) -> None:
    """GRIB and NetCDF files are read as they are: no advice to write them with a crc32c codec; a
    NetCDF-3 file of two records (two time steps, one chunk each) gets a train/val split."""
    pytest.importorskip("virtualizarr", reason="the virtual extra is not installed")
    pytest.importorskip("netCDF4", reason="writing NetCDF files needs netCDF4")
    from xinsitu.synthetic import era5_like

    f = str(tmp_path / "two_months.nc")
    era5_like(2, 4, 6).to_netcdf(f, format="NETCDF3_CLASSIC", engine="netcdf4", unlimited_dims=["time"])
    out = run("inspect", f).stdout
    assert "Checksums: none" in out and "read in place" in out, out
    assert "crc32c" not in out.lower() and "write the archive" not in out, out
    assert "Suggested split:" in out and "'val'" in out, out
    got = json.loads(run("inspect", f, "--json").stdout)
    assert "crc32c" not in got["checksum_note"].lower()


def test_arguments_that_cannot_be_honoured_are_errors(era5_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A split asked for that cannot be made (an unknown --dim, fractions over 1) is an error, exit 1, not
    "No split suggested" and exit 0; negative counts and times are refused by the parser (exit 2:
    --max-blocks -1 read all blocks but the last); a numeric store option stays a string, as obstore
    takes it (-o timeout=60 was made an int, which no store option may be)."""
    for bad in (["--dim", "nope"], ["--fractions", "train=1.2"]):
        assert cli.main(["inspect", era5_path, *bad]) == 1
        err = capsys.readouterr().err
        assert "Traceback" not in err and ("nope" in err or "1.2" in err or "sum" in err), err
    for bad in (["inspect", era5_path, "--gap", "-3"], ["bench", era5_path, "--max-blocks", "-1"],
                ["bench", era5_path, "--step-ms", "-5"], ["bench", era5_path, "--batch-size", "0"]):
        with pytest.raises(SystemExit) as e:
            cli.main(bad)
        assert e.value.code == 2 and "at least" in capsys.readouterr().err
    assert cli._option("timeout=60") == ("timeout", "60") and cli._option("allow_http=true") == ("allow_http", True)


@pytest.mark.slow
def test_inspect_prints_the_open_with_its_store_options_and_no_credential(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``inspect s3://... -o endpoint=... -o region=...``: the line of Python it prints opens the archive as
    given, its options included (it left them out, so the line failed as printed), a credential as '...'."""
    from tests.support.servers import MotoS3, write_archive

    archive = write_archive(tmp_path / "era5.zarr")
    with MotoS3() as s3:
        s3.upload(archive, "bkt", "era5.zarr")
        opts = [f"{k}={v}" for k, v in s3.options.items() if isinstance(v, str)] + ["allow_http=true"]
        assert cli.main(["inspect", "s3://bkt/era5.zarr", *[a for o in opts for a in ("-o", o)]]) == 0
    out = capsys.readouterr().out
    line = next(x.strip() for x in out.splitlines() if "xinsitu.open_zarr(" in x)
    assert f"endpoint={s3.options['endpoint']!r}" in line, line
    for k in ("access_key_id", "secret_access_key"):
        assert s3.options[k] not in out and f"{k}='...'" in line, line


def test_inspect_prints_no_credential_of_a_url_a_nested_option_or_a_bad_option(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The line of Python ``inspect`` prints names a URL's password and query string (a signed URL's
    credentials) as '...', a user name given alone (a token: ``https://TOKEN@host``), and a credential
    inside a dict option (a bearer token in ``client_options``) too; the error for several paths names
    them so, and a malformed ``-o`` is not echoed."""
    from tests.support.servers import FileServer, write_archive

    pw, sig, tok, key = "PW-cli-leak-4711", "SIG-cli-leak-0815", "TOK-cli-leak-1337", "KEY-cli-leak-2718"
    write_archive(tmp_path / "era5.zarr")
    with FileServer(tmp_path) as srv:
        host = srv.url.split("://", 1)[1]
        with_pw, signed = f"http://user:{pw}@{host}/era5.zarr", f"{srv.url}/era5.zarr?X-Amz-Signature={sig}"
        client = json.dumps({"allow_http": True, "default_headers": {"Authorization": f"Bearer {tok}"}})
        for args, shown in (([with_pw], f"'http://user:...@{host}/era5.zarr'"),
                            ([f"http://{tok}@{host}/era5.zarr"], f"'http://...@{host}/era5.zarr'"),
                            ([signed], f"'{srv.url}/era5.zarr?...'"),
                            ([f"{srv.url}/era5.zarr", "-o", f"client_options={client}"],
                             "'default_headers': {'Authorization': '...'}")):
            assert cli.main(["inspect", *args]) == 0
            out = capsys.readouterr()
            line = next(x.strip() for x in out.out.splitlines() if "xinsitu.open_zarr(" in x)
            assert shown in line, line
            assert not [s for s in (pw, sig, tok) if s in out.out + out.err], out.out + out.err
        assert cli.main(["inspect", signed, f"{with_pw}/b.nc"]) == 1
        err = capsys.readouterr().err
        assert "several paths given" in err and not [s for s in (pw, sig) if s in err], err
    with pytest.raises(SystemExit):
        cli.main(["inspect", str(tmp_path / "era5.zarr"), "-o", f"secret_access_key {key}"])
    err = capsys.readouterr().err
    assert "KEY=VALUE" in err and "secret_access_key" in err and key not in err, err


def test_a_json_store_option_is_parsed_for_grib_filters(tmp_path: Path) -> None:
    """``-o 'filter_by_keys={"typeOfLevel": "surface"}'``: the only way the CLI can pass what open_grib's
    error asks for (a string was handed on, and failed deep inside); the printed line carries it, and a
    filter that is not a dict is refused naming filter_by_keys."""
    assert cli._option('filter_by_keys={"typeOfLevel": "surface"}') == ("filter_by_keys", {"typeOfLevel": "surface"})
    with pytest.raises(Exception, match="looks like JSON"):
        cli._option("filter_by_keys={typeOfLevel: surface}")
    assert cli._options_code([("filter_by_keys", {"typeOfLevel": "surface"})]) == (
        ", filter_by_keys={'typeOfLevel': 'surface'}")
    pytest.importorskip("cfgrib", reason="the grib extra is not installed")
    from xinsitu.formats.grib import grib_store, write_grib

    f = write_grib(tmp_path / "f.grib2", {"2t": np.zeros((2, 1, 3, 4))}, ["2000-01-01", "2000-01-02"])
    with pytest.raises(TypeError, match="filter_by_keys must be a dict"):
        grib_store(f, filter_by_keys="surface")
