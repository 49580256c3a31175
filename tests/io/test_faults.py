"""Faults that lose nothing: through a server that answers 503, resets connections, cuts
bodies short, stalls and lags, an epoch equals the epoch read from disk sample for sample;
a chunk that keeps failing, or is corrupt in the store, raises ``ChunkReadError`` naming
the variable, the chunk and the key, and no batch after it is ever yielded."""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

import xinsitu
from tests.support.servers import Faults, FileServer, assert_same_epoch, epoch_numpy, write_archive

KW = {"batch_size": 10, "block_chunks": 3, "output": "numpy", "seed": 3}
CHUNKS = r"/(t2m|u10|v10|z500|tp|lsm)/c/"  # data chunk objects (not metadata, not coordinates)
# quick retries so the tests stay short; the timeouts turn `slow` and `stall` into timeouts
FAST = {"retry_config": {"max_retries": 5, "backoff": {"init_backoff": timedelta(milliseconds=5),
                                                       "max_backoff": timedelta(milliseconds=50)}},
        "client_options": {"timeout": "1s", "read_timeout": "500ms"}}


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_archive(tmp_path_factory.mktemp("faults") / "era5.zarr")


@pytest.fixture(scope="module")
def manifest(archive: str) -> xinsitu.SplitManifest:
    return xinsitu.open_zarr(archive).insitu.split("time", fractions={"train": 0.75, "val": 0.25}, gap=1)


@pytest.fixture(scope="module")
def reference(archive: str, manifest: xinsitu.SplitManifest) -> tuple:
    """Epoch 1 of the train split read from local disk."""
    gen = xinsitu.open_zarr(archive).insitu.batches(manifest, "train", **KW)
    gen.set_epoch(1)
    return epoch_numpy(gen)


@pytest.fixture(scope="module")
def server(archive: str):
    with FileServer(Path(archive).parent, max_lifetime_s=240) as srv:
        yield srv


def _remote_epoch(srv: FileServer, faults: Faults, manifest, options=FAST, name="era5.zarr") -> tuple:
    srv.faults = faults
    srv.reset_counts()
    ds = xinsitu.open_zarr(f"{srv.url}/{name}", **options)
    gen = ds.insitu.batches(manifest, "train", **KW)
    gen.set_epoch(1)
    return epoch_numpy(gen)


# fault kind x share of requests (each path meets at most `max_per_key` faults: retries can win)
MATRIX = {
    "503 x 0.3": Faults(error_503=0.3),
    "503 x 1.0 (2 per key)": Faults(error_503=1.0, max_per_key=2, pattern=CHUNKS),
    "reset x 0.3": Faults(reset=0.3),
    "reset x 1.0 (2 per key)": Faults(reset=1.0, max_per_key=2, pattern=CHUNKS),
    "truncate x 0.3": Faults(truncate=0.3),
    "truncate x 1.0 (2 per key)": Faults(truncate=1.0, max_per_key=2, pattern=CHUNKS),
    "slow x 0.2": Faults(slow=0.2, pattern=CHUNKS, slow_s=2.0),
    "stall x 0.2": Faults(stall=0.2, pattern=CHUNKS, slow_s=2.0),
    "short x 0.3": Faults(short=0.3, max_per_key=2, pattern=CHUNKS),
    "mix x 0.5 + 10 ms": Faults(error_503=0.1, reset=0.1, truncate=0.1, short=0.1, slow=0.05, stall=0.05,
                                latency=0.01, max_per_key=2, pattern=CHUNKS, seed=1),
}


@pytest.mark.parametrize("name", list(MATRIX))
@pytest.mark.slow
def test_epoch_through_faults_equals_local(server, manifest, reference, name):
    faults = MATRIX[name]
    got = _remote_epoch(server, faults, manifest)
    counts = server.counts
    injected = {k: counts[k] for k in ("error_503", "reset", "truncate", "short", "slow", "stall") if counts[k]}
    assert injected, f"no fault was injected ({dict(counts)}): the test would prove nothing"
    assert_same_epoch(got, reference)


def test_default_retry_settings_ride_out_faults(server, manifest, reference):
    """No retry or timeout options given: the defaults retry 503s, resets and cut bodies."""
    faults = Faults(error_503=0.15, reset=0.15, truncate=0.15, max_per_key=2, seed=2)
    got = _remote_epoch(server, faults, manifest, options={})
    assert sum(server.counts[k] for k in ("error_503", "reset", "truncate")) > 5
    assert_same_epoch(got, reference)


@pytest.fixture(scope="module")
def sharded(archive: str) -> str:
    return write_archive(Path(archive).parent / "sharded.zarr", shard_time=32)


SHARD_FAULTS = {
    "503 x 0.3": Faults(error_503=0.3, pattern=CHUNKS),
    "reset x 0.3": Faults(reset=0.3, pattern=CHUNKS),
    "truncate x 0.3": Faults(truncate=0.3, pattern=CHUNKS),
    "short x 0.3": Faults(short=0.3, max_per_key=2, pattern=CHUNKS),
    "stall x 0.2": Faults(stall=0.2, pattern=CHUNKS, slow_s=2.0),
}


@pytest.mark.parametrize("name", list(SHARD_FAULTS))
@pytest.mark.slow
def test_sharded_epoch_through_faults_equals_local(server, sharded, manifest, reference, name):
    """Inner chunks fetched by byte range (shard index, then coalesced ranges) ride out faults too."""
    got = _remote_epoch(server, SHARD_FAULTS[name], manifest, name="sharded.zarr")
    assert server.ranged > 0
    assert sum(server.counts[k] for k in ("error_503", "reset", "truncate", "short", "stall")) > 0
    assert_same_epoch(got, reference)


@pytest.fixture(scope="module")
def blosc_v2(archive: str) -> str:
    """The archive as zarr v2 with blosc (what xarray and zarr-python write to v2 by default)."""
    import numcodecs
    import xarray as xr
    import zarr

    src = xr.open_zarr(archive)
    enc = {v: {"chunks": src[v].encoding["chunks"], "compressors": [numcodecs.Blosc("lz4")]} for v in src.data_vars}
    path = str(Path(archive).parent / "blosc_v2.zarr")
    src.drop_encoding().to_zarr(path, zarr_format=2, mode="w", encoding=enc)
    assert type(zarr.open_array(path + "/t2m").compressors[0]).__name__ == "Blosc"
    return path


@pytest.mark.slow
def test_blosc_chunks_cut_short_are_fetched_again(server, blosc_v2):
    """blosc decodes a frame cut short without an error, into garbage: a chunk's body cut short where HTTP
    cannot see it (``short``) is found by the frame's own length and fetched again, as other codecs' are;
    one cut short every time is named (variable, chunk, key), never served."""
    ds = xinsitu.open_zarr(blosc_v2)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", **KW)
    reference = epoch_numpy(gen)
    pattern = r"/blosc_v2\.zarr/(t2m|u10|v10|z500|tp|lsm)/\d"
    server.faults = Faults(short=0.5, max_per_key=2, pattern=pattern, seed=5)
    server.reset_counts()
    remote = xinsitu.open_zarr(f"{server.url}/blosc_v2.zarr", **FAST)
    assert_same_epoch(epoch_numpy(remote.insitu.batches(m, "train", **KW)), reference)
    assert server.counts["short"] > 5, server.counts
    server.faults = Faults(short=1.0, max_per_key=None, pattern=r"/blosc_v2\.zarr/t2m/3\.")
    with pytest.raises(xinsitu.ChunkReadError, match=r"'t2m'.*t2m/3\.0\.0.*blosc: a frame of \d+ bytes"):
        list(remote.insitu.batches(m, "train", **KW))
    server.faults = Faults()


def _until_error(gen) -> tuple[list, BaseException | None]:
    out = []
    try:
        for b in gen:
            out.append(b)
    except Exception as e:  # noqa: BLE001 - returned to the test
        return out, e
    return out, None


def _check_partial(batches: list, reference: tuple) -> None:
    """Batches yielded before an error are the right ones, in order, none short or repeated."""
    _, ref = reference
    assert len(batches) < len(ref)
    for k, (b, r) in enumerate(zip(batches, ref, strict=False)):
        for v in r:
            assert b[v].shape == r[v].shape and np.array_equal(b[v], r[v], equal_nan=True), (k, v)


@pytest.mark.parametrize("status", [503, 500, 403])
@pytest.mark.slow
def test_chunk_that_keeps_failing_names_itself(server, manifest, reference, status):
    server.faults = Faults(always=r"/era5.zarr/z500/c/3/0/0$", always_status=status)
    server.reset_counts()
    ds = xinsitu.open_zarr(f"{server.url}/era5.zarr", **FAST)
    gen = ds.insitu.batches(manifest, "train", **KW)
    gen.set_epoch(1)
    batches, err = _until_error(gen)
    assert isinstance(err, xinsitu.ChunkReadError), repr(err)
    assert (err.var, err.chunk, err.key) == ("z500", (3, 0, 0), "z500/c/3/0/0")
    assert "'z500'" in str(err) and "(3, 0, 0)" in str(err) and "z500/c/3/0/0" in str(err)
    assert str(status) in str(err)
    _check_partial(batches, reference)
    retries = server.counts["always"]
    assert retries == (1 if status == 403 else 1 + FAST["retry_config"]["max_retries"])  # 4xx is not retried


@pytest.mark.parametrize("kind", ["truncate", "short", "reset"])
def test_damage_every_time_is_an_error_not_wrong_data(server, manifest, reference, kind):
    """A chunk whose every transfer is damaged raises; it never becomes a wrong batch."""
    server.faults = Faults(**{kind: 1.0}, max_per_key=None, pattern=r"/era5.zarr/tp/c/2/0/0$")
    server.reset_counts()
    ds = xinsitu.open_zarr(f"{server.url}/era5.zarr", **FAST)
    gen = ds.insitu.batches(manifest, "train", **KW)
    gen.set_epoch(1)
    batches, err = _until_error(gen)
    assert isinstance(err, xinsitu.ChunkReadError), repr(err)
    assert (err.var, err.chunk, err.key) == ("tp", (2, 0, 0), "tp/c/2/0/0")
    _check_partial(batches, reference)
    assert server.counts[kind] >= 2


def test_corrupt_object_in_store(archive, manifest, reference, tmp_path):
    """Bytes on disk that do not decode: ChunkReadError naming the chunk, locally and over HTTP."""
    path = tmp_path / "corrupt.zarr"
    shutil.copytree(archive, path)
    obj = path / "u10" / "c" / "5" / "0" / "0"
    raw = bytearray(obj.read_bytes())
    raw[len(raw) // 3: len(raw) // 3 + 64] = np.random.default_rng(0).integers(0, 256, 64, dtype=np.uint8).tobytes()
    obj.write_bytes(bytes(raw[: len(raw) - 7]))
    with FileServer(tmp_path) as srv:
        for url in (str(path), f"{srv.url}/corrupt.zarr"):
            ds = xinsitu.open_zarr(url, **(FAST if url.startswith("http") else {}))
            gen = ds.insitu.batches(manifest, "train", **KW)
            gen.set_epoch(1)
            batches, err = _until_error(gen)
            assert isinstance(err, xinsitu.ChunkReadError), (url, repr(err))
            assert (err.var, err.chunk, err.key) == ("u10", (5, 0, 0), "u10/c/5/0/0")
            _check_partial(batches, reference)


def test_stats_through_faults(server, archive, manifest):
    """Statistics reduce each chunk in the decode thread: through 503s, resets and cut bodies they
    equal the statistics read from disk bit for bit; a chunk that keeps failing, or is corrupt, raises
    ``ChunkReadError`` naming it, and no statistics come back."""
    from xinsitu.batches.stats import compute_stats

    local = compute_stats(xinsitu.open_zarr(archive), manifest, "train", block_chunks=3)
    server.faults = Faults(error_503=0.2, reset=0.2, truncate=0.2, short=0.2, max_per_key=2, pattern=CHUNKS, seed=4)
    server.reset_counts()
    remote = compute_stats(xinsitu.open_zarr(f"{server.url}/era5.zarr", **FAST), manifest, "train", block_chunks=3)
    assert sum(server.counts[k] for k in ("error_503", "reset", "truncate", "short")) > 5
    assert remote == local

    server.faults = Faults(truncate=1.0, max_per_key=None, pattern=r"/era5.zarr/t2m/c/4/0/0$")
    with pytest.raises(xinsitu.ChunkReadError) as info:
        compute_stats(xinsitu.open_zarr(f"{server.url}/era5.zarr", **FAST), manifest, "train", block_chunks=3)
    assert (info.value.var, info.value.chunk, info.value.key) == ("t2m", (4, 0, 0), "t2m/c/4/0/0")
