"""``python -m xinsitu inspect|bench``: run as real processes on archives written here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import xinsitu
from tests.conftest import CT, NT
from xinsitu import cli
from xinsitu.synthetic import write_era5_like

VARS = ["t2m", "tp", "u10", "v10", "z500"]  # the data variables on time


def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-W", "ignore", "-m", "xinsitu", *args], capture_output=True, text=True,
                       timeout=120)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def test_inspect_text(era5_path: str) -> None:
    out = run("inspect", era5_path).stdout
    assert "<xinsitu.Geometry>" in out and "t2m" in out and "zstd" in out
    assert "Suggested split:" in out
    assert "m = ds.insitu.split('time', fractions={'train': 0.8, 'val': 0.1, 'test': 0.1}, gap=1)" in out
    assert "1979-01-01T00:00:00" in out  # the summary's label range of train


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
    keys = cli.raw_keys(gen)
    assert len({(id(s), k) for s, k in keys}) == len(keys)
    for _ in gen:
        pass
    assert len(keys) == gen.io_stats["chunks"]
    raw = cli.raw_pass(keys, 8)
    assert raw["bytes"] == gen.io_stats["bytes_read"]


def test_split_dim_prefers_the_largest_variables_leading_dim(era5_path: str) -> None:
    g = xinsitu.open_zarr(era5_path).insitu.geometry
    assert list(g.variables)[0] == "lsm"  # a (lat, lon) variable comes first, yet time is chosen
    assert cli.split_dim(g) == "time"
    assert cli.split_dim(xinsitu.open_zarr(era5_path)[["lsm"]].insitu.geometry) is None


def test_verdict_sentences() -> None:
    io = {"seconds": 1.0, "batches": 10}
    assert "store" in cli.verdict({"seconds": 0.9}, io, 32, None)[0]
    assert "CPU" in cli.verdict({"seconds": 0.1}, io, 32, None)[0]
    assert cli.verdict(None, io, 32, 500.0)[0].startswith("Model-bound")
    assert cli.verdict(None, io, 32, 5.0)[0].startswith("Store-bound")
    assert np.isclose(float(cli.verdict(None, io, 32, 5.0)[0].split("needs ")[1].split(" ms")[0]), 100.0)


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


# ----------------------------------------------------------------------------- doctor
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
    assert set(got) == {"python", "xinsitu", *cli.DOCTOR_PACKAGES, "cuda", "decode"}
