"""Smoke test of bench/run.py: a tiny archive, local + latency server; results and plots written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
for mod in ("matplotlib", "aiohttp", "psutil", "torch"):
    pytest.importorskip(mod)


@pytest.mark.tools
def test_bench_run_smoke(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench" / "run.py"), "--sections", "peers,wait,memory",
           "--stores", "local,http:5", "--peers", "ceiling,xinsitu,isel0", "--repeats", "1", "--no-long",
           "--epochs", "2", "--max-seconds", "1", "--shape", "240x16x32",
           "--data-dir", str(tmp_path / "data"), "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    peers = [r for r in rows if r.get("section") == "peers"]
    assert {(r["store"], r["peer"]) for r in peers} == {
        (s, p) for s in ("local", "http:5") for p in ("ceiling", "xinsitu", "isel0")}
    for r in peers:
        assert "error" not in r, r["error"]
        assert r["samples_per_s"] > 0 and r["peak_rss_mb"] > 0
    for r in (r for r in peers if r["peer"] == "xinsitu"):
        assert r["batch_shape"][1:] == [4, 16, 32]
        assert r["io"]["chunks"] == 8 * 4  # 8 train chunks x 4 variables, each read once per epoch
    assert all(r["objects"] == 8 * 4 for r in peers if r["peer"] == "ceiling")
    waits = [r for r in rows if r.get("section") == "wait"]
    assert len(waits) == 2 and all("error" not in r and len(r["runs"]) == 2 for r in waits)
    mem = [r for r in rows if r.get("section") == "memory"]
    assert mem and all("error" not in r and r["peak_mb"] >= r["baseline_mb"] for r in mem)
    for name in ("summary.md", "bench_throughput.png", "bench_wait.png", "bench_memory.png"):
        assert (out / name).stat().st_size > 0


@pytest.mark.tools
def test_wm_shapes_smoke(tmp_path):
    """bench/wm_shapes.py (the weather-model shape) runs end to end on a tiny grid: every peer reports a
    rate, and the RSS run reports its peak against the batch's bytes."""
    script = str(ROOT / "bench" / "wm_shapes.py")
    common = [str(tmp_path), "--grid", "24x12", "--level-vars", "2"]
    subprocess.run([sys.executable, script, "make", *common, "--nt", "10"], check=True, timeout=300,
                   capture_output=True)
    p = subprocess.run([sys.executable, script, "run", *common, "--rounds", "1", "--batch", "3"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rounds = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(rounds) == 1
    for peer in ("decode", "xinsitu", "warm", "copy1", "stats", "xarray"):
        assert rounds[0][peer] > 0, (peer, p.stdout)
    p = subprocess.run([sys.executable, script, "rss", *common, "--batch", "3"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    row = json.loads(p.stdout.splitlines()[0])
    assert row["peak_rss_gb"] > 0 and row["batch_gb"] == 3 * 30 * 12 * 24 * 4 / 1e9 and row["buffer"].startswith("none")


@pytest.mark.tools
def test_floor_smoke(tmp_path):
    """bench/floor.py (what a hand-written in-place loader reaches beside xinsitu) runs on both layouts of a
    tiny yardstick archive; its floor's last batch is checked against xarray inside the script."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from archives import write_archive
    finally:
        sys.path.remove(str(ROOT / "bench"))
    for chunk_time in (8, 1):
        path = str(tmp_path / f"c{chunk_time}.zarr")
        write_archive(path, 260, 16, 32, chunk_time)  # two blocks of 13 chunks of 8: a short last batch each
        p = subprocess.run([sys.executable, str(ROOT / "bench" / "floor.py"), path, "--rounds", "1"],
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        peers = ["decode", "decode, kept", "read+decode", "floor", "xinsitu"] + ["floor, scatter"] * (chunk_time > 1)
        for peer in peers:
            assert f"  {peer} " in p.stdout, (peer, p.stdout)


@pytest.mark.tools
def test_gpu_host_cost_smoke(tmp_path):
    """bench/gpu_host_cost.py (the GPU path's host-side cost, the device's work as no-ops) runs: every stage
    reports, and a batch from the device cache tier asks the device for one copy, not one per chunk."""
    out = tmp_path / "cost.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_host_cost.py"), "--chunks", "8", "--rounds", "2",
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res["us_per_chunk"]) == {"64kB", "786kB"}
    for cost in res["us_per_chunk"].values():
        assert all(cost[k] > 0 for k in ("bytes", "files", "read_gpu", "tier"))
        assert cost["tier_device_copies_per_batch"] == 1


@pytest.mark.tools
def test_halo_reads_smoke(tmp_path):
    """bench/halo_reads.py (chunk reads and the halo held where tiles spill over a grid of blocks) runs:
    every case reports, and buffers of 16 blocks read each chunk once."""
    out = tmp_path / "halo.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "halo_reads.py"), "--grid", "4", "5", "--epochs", "1",
                        "--block-chunks", "16", "4", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 * 2
    assert all(r["reads"] == 1.0 for r in rows if r["block_chunks"] == 16), rows
