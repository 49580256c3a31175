"""The read path under stores that misbehave (issue 16): an overloaded store is not made slower by
the automatic in-flight limit, a read that never answers times out and names its chunk, a body
corrupted in transit never becomes wrong values where the archive has checksums, a 200 answered
to a Range request is used, and obstore's runtime does not pile up threads."""

from __future__ import annotations

from pathlib import Path

import pytest

import xinsitu
from tests.servers import Faults, FileServer, assert_same_epoch, epoch_numpy, write_archive

KW = {"batch_size": 10, "block_chunks": 3, "output": "numpy", "seed": 3}
CHUNKS = r"/(t2m|u10|v10|z500|tp|lsm)/c/"


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_archive(tmp_path_factory.mktemp("io") / "era5.zarr", nt=96, chunk_time=4)


@pytest.fixture(scope="module")
def manifest(archive: str) -> xinsitu.SplitManifest:
    return xinsitu.open_zarr(archive).insitu.split("time", fractions={"train": 1.0})


@pytest.fixture(scope="module")
def reference(archive: str, manifest: xinsitu.SplitManifest) -> tuple:
    gen = xinsitu.open_zarr(archive).insitu.batches(manifest, "train", **KW)
    return epoch_numpy(gen)


# ----------------------------------------------------------------------------- 5. in-flight limit
def test_automatic_limit_backs_off_on_an_overloaded_store(archive, manifest, reference):
    """A plain ``http.server`` with an accept backlog of 5: more requests in flight only queue (and
    drop connections). The automatic limit stays low instead of climbing to the top."""
    from xinsitu.reader import AUTO_REMOTE

    with FileServer(Path(archive).parent, overloaded=True) as srv:
        gen = xinsitu.open_zarr(f"{srv.url}/era5.zarr").insitu.batches(manifest, "train", **KW)
        assert_same_epoch(epoch_numpy(gen), reference)
        lim = gen._reader.inflight
        assert lim.remote and lim.history, "the limit never adapted"
        highest = max(n for n, _ in lim.history)
        assert lim.limit <= 8 and highest <= 32 < AUTO_REMOTE[1], (lim.limit, lim.history)


def test_automatic_limit_climbs_for_a_far_healthy_store(archive, manifest, reference, monkeypatch):
    """100 ms away, latency that does not grow with load: the limit doubles to the top."""
    from xinsitu import reader

    monkeypatch.setattr(reader, "AUTO_REMOTE", (4, 64))
    with FileServer(Path(archive).parent, Faults(latency=0.1)) as srv:
        gen = xinsitu.open_zarr(f"{srv.url}/era5.zarr").insitu.batches(manifest, "train", **KW)
        gen.set_epoch(0)
        assert_same_epoch(epoch_numpy(gen), reference)
        lim = gen._reader.inflight
        trajectory = [n for n, _ in lim.history] + [lim.limit]
        assert trajectory[0] == 4 and max(trajectory) == 64, lim.history
        assert trajectory[:5] == sorted(trajectory[:5]), lim.history  # slow start: no step down on the way


def test_inflight_limit_is_aimd_for_remote_stores():
    """Synthetic stores: a queueing one (latency grows with the limit) keeps it low; a far one with
    flat latency sends it to the top; a failure halves it; a fixed limit never moves."""
    from xinsitu.reader import AUTO_REMOTE, InflightLimit

    def run(lim: InflightLimit, latency, n: int = 2000) -> list[int]:
        seen = []
        for _ in range(n):
            lim.observe(latency(lim.limit), 0.0005)
            seen.append(lim.limit)
        return seen

    queue = InflightLimit(None, threads=2)
    queue.expect_remote()
    seen = run(queue, lambda k: 0.002 * k)  # one request at a time: latency is queueing
    assert max(seen) <= 16 and seen[-1] <= 8, (max(seen), seen[-1])
    far = InflightLimit(None, threads=2)
    far.expect_remote()
    seen = run(far, lambda k: 0.1)
    assert seen[-1] == AUTO_REMOTE[1]
    far.failed()
    assert far.limit == AUTO_REMOTE[1] // 2
    fixed = InflightLimit(4, threads=2)
    fixed.expect_remote()
    fixed.failed()
    assert run(fixed, lambda k: 1.0, 50)[-1] == 4
