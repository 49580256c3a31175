"""A chunk that keeps failing ends the epoch with ``ChunkReadError`` naming the variable,
the chunk and the key — never an endless wait — on a split with more shuffle blocks than
the read-ahead holds (more than 48 chunks with the default ``block_chunks=16``), in
process and in DataLoader workers (the error reaches the parent).

Every epoch runs in a subprocess under a timeout (tests/support/fault_job.py): a hang fails the
test instead of freezing the suite.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fault_job import make_gen
from tests.support.servers import Faults, FileServer, write_archive

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VAR = "z500"
NT = 160  # chunks of one time step: 160 chunks, 10 shuffle blocks (worker 0 reads 5 of them)


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_archive(tmp_path_factory.mktemp("unreadable") / "clean.zarr", nt=NT, ny=4, nx=4, chunk_time=1)


@pytest.fixture(scope="module")
def failing(archive: str) -> tuple[int, str]:
    """The time chunk of the epoch's first shuffle block (read first, by worker 0 too), and its key."""
    gen = make_gen(archive)
    assert gen.plan().n_buffers > 4
    sp = gen.space
    t = int(sp.edges[0][sp.blocks[gen.plan().units[0]]])
    return t, f"{VAR}/c/{t}/0/0"


def _damage(archive: str, dest: Path, key: str, kind: str) -> str:
    path = dest / f"{kind}.zarr"
    shutil.copytree(archive, path)
    obj = path / key
    raw = obj.read_bytes()
    obj.write_bytes({"garbage": b"not a zstd frame " * 8, "empty": b"", "truncated": raw[: len(raw) // 2]}[kind])
    return str(path)


def _job(tmp_path: Path, url: str, *args: str, timeout: int = 120) -> dict:
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "XINSITU_DECODE_THREADS": "2"}
    # a session of its own: on a timeout the whole group goes, workers a hang left behind included
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.fault_job", url, str(out), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # the bug this file is about: fail, never hang
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"epoch hung on a chunk that keeps failing (killed after {timeout}s): {stderr[-2000:]!r}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-5000:]
    res = json.loads(out.read_text())
    assert "setup_error" not in res, res
    return res


def _check(res: dict, failing: tuple[int, str], workers: int) -> None:
    t, key = failing
    assert res["error"] is not None, f"no error: {res['batches']} batches came out"
    if workers:
        # torch re-raises a worker's error in the parent with the worker's message
        assert "ChunkReadError" in res["message"], res["message"]
    else:
        assert res["error"] == "ChunkReadError", res
        assert (res["var"], res["chunk"], res["key"]) == (VAR, [t, 0, 0], key)
    assert f"'{VAR}'" in res["message"] and f"({t}, 0, 0)" in res["message"] and key in res["message"]


LOCAL = ["garbage", "empty", "truncated"]


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "2-workers"])
@pytest.mark.parametrize("kind", LOCAL)
@pytest.mark.slow
def test_damaged_local_chunk_raises(archive, failing, tmp_path, kind, workers):
    if workers:
        pytest.importorskip("torch", reason="DataLoader workers need torch")
    path = _damage(archive, tmp_path, failing[1], kind)
    args = ["--workers", str(workers), "--method", "fork", "--open", "xr"] if workers else []
    _check(_job(tmp_path, path, *args), failing, workers)


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "2-workers"])
@pytest.mark.parametrize("kind", ["503 every time", "undecodable body"])
@pytest.mark.slow
def test_failing_remote_chunk_raises(archive, failing, tmp_path, kind, workers):
    if workers:
        pytest.importorskip("torch", reason="DataLoader workers need torch")
    root = tmp_path / "served"
    root.mkdir()
    if kind == "undecodable body":
        name = Path(_damage(archive, root, failing[1], "garbage")).name
        faults = Faults()
    else:
        name = "clean.zarr"
        shutil.copytree(archive, root / name)
        faults = Faults(always=rf"/{name}/{failing[1]}$", always_status=503)
    args = ["--fast"] + (["--workers", str(workers), "--method", "spawn"] if workers else [])
    with FileServer(root, faults, max_lifetime_s=150) as srv:
        res = _job(tmp_path, f"{srv.url}/{name}", *args)
        if kind == "503 every time":
            assert srv.counts["always"] >= 2  # retried, then given up
    _check(res, failing, workers)


@pytest.mark.parametrize("window", [2, 3])
@pytest.mark.slow
def test_damaged_chunk_with_windows_raises(archive, failing, tmp_path, window):
    """Windows: blocks pass the chunks they spill into on to later blocks; a failed one fails its takers."""
    path = _damage(archive, tmp_path, failing[1], "garbage")
    _check(_job(tmp_path, path, "--window", str(window)), failing, 0)


def test_a_damaged_shard_is_named_as_a_shard(tmp_path):
    """A sharded array (chunks of 2 steps in shards of 8): a damaged object is named a shard, with its
    coordinates in the grid of shards (it said "chunk (1, 0)", which in the array's grid of chunks is
    another place: steps 2-3, not 8-15)."""
    import numpy as np
    import xarray as xr

    import xinsitu
    from xinsitu.stores.backend import ChunkReadError

    path = tmp_path / "sh.zarr"
    xr.Dataset({"a": (("time", "x"), np.arange(64.0).reshape(16, 4))}).to_zarr(
        path, zarr_format=3, encoding={"a": {"chunks": (2, 4), "shards": (8, 4)}})
    (path / "a" / "c" / "1" / "0").write_bytes(b"not a shard")
    ds = xinsitu.open_zarr(str(path))
    m = ds.insitu.split("time", fractions={"train": 1.0})
    with pytest.raises(ChunkReadError, match=r"cannot read shard \(1, 0\) of variable 'a' \(key 'a/c/1/0'\)"):
        list(ds.insitu.batches(m, "train", batch_size=4, shuffle=False, output="numpy"))
