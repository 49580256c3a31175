"""The cache and chunks that live outside the archive's own objects: an Icechunk snapshot's virtual
chunks (references to byte ranges of other files, which a snapshot id does not name) are never served
stale after the referenced file is rewritten, whatever the rewrite kept; the disk tier keeps nothing of
such a repository unless ``immutable=True``, and says so once. Icechunk 1.x and 2.x alike (the two
virtual environments of the project). No timed assertion."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

import xinsitu
from xinsitu.cache.chunk_cache import ChunkCache
from xinsitu.cache.disk_tier import _SUBDIR

NT, CT = 32, 4


def _repo(tmp_path):
    """An Icechunk repository whose array ``a(time, y, x)`` is 8 virtual chunks of ``raw.bin``
    (uncompressed float32), and ``raw.bin``."""
    icechunk = pytest.importorskip("icechunk")
    import zarr

    icechunk.set_logs_filter("error")
    raw = str(tmp_path / "raw.bin")
    np.arange(NT * 15, dtype="<f4").tofile(raw)
    prefix = f"file://{tmp_path}/"
    cfg = icechunk.RepositoryConfig.default()
    container = icechunk.VirtualChunkContainer(prefix, icechunk.local_filesystem_store(str(tmp_path)))
    cfg.set_virtual_chunk_container(container)
    # icechunk 2 names local access (None is deprecated there); 1.x takes None
    cred = icechunk.containers_credentials({prefix: getattr(icechunk.credentials, "LocalFileSystemAccess", None)})
    repo = icechunk.Repository.create(icechunk.local_filesystem_storage(str(tmp_path / "repo")), cfg,
                                      authorize_virtual_chunk_access=cred)
    s = repo.writable_session("main")
    g = zarr.group(s.store)
    g.create_array("a", shape=(NT, 3, 5), chunks=(CT, 3, 5), dtype="f4", compressors=None,
                   dimension_names=("time", "y", "x"), fill_value=float("nan"))
    t = g.create_array("time", shape=(NT,), chunks=(NT,), dtype="i8", dimension_names=("time",))
    t[:] = np.arange(NT)
    for i in range(NT // CT):
        s.store.set_virtual_ref(f"a/c/{i}/0/0", f"file://{raw}", offset=i * CT * 15 * 4, length=CT * 15 * 4)
    s.commit("virtual")
    return repo, raw


def _rewrite_keeping_size_and_mtime(raw: str) -> None:
    st = os.stat(raw)
    with open(raw, "r+b") as f:
        f.write((np.arange(NT * 15, dtype="<f4") + 1000).tobytes())
    os.utime(raw, ns=(st.st_atime_ns, st.st_mtime_ns))


def _epoch(repo, cache) -> tuple[np.ndarray, object]:
    ds = xinsitu.open_zarr(repo.readonly_session(branch="main").store)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", batch_size=4, output="numpy", shuffle=False, cache=cache)
    return np.concatenate([np.array(b["a"], copy=True) for b in gen]), gen


def _entries(disk) -> int:
    return sum(f.endswith(".chunk") for _, _, fs in os.walk(os.path.join(disk, _SUBDIR)) for f in fs)


def _ours(caught) -> list[str]:
    return [str(w.message) for w in caught if "chunk cache" in str(w.message)]


def test_a_rewritten_file_of_an_icechunk_virtual_chunk_is_never_served_stale_from_disk(tmp_path):
    """The snapshot id stays, the referenced file is rewritten with its size and modification time kept:
    a new run (a new cache on the same directory) reads the new values. The disk tier keeps nothing of
    such a repository (warned once, in the repr too) unless ``immutable=True``."""
    repo, raw = _repo(tmp_path)
    disk = tmp_path / "c"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old, gen = _epoch(repo, ChunkCache(memory=0, disk=disk))
    said = _ours(caught)
    assert np.array_equal(old, np.arange(NT * 15, dtype="f4").reshape(NT, 3, 5))
    assert len(said) == 1 and "virtual chunk" in said[0] and "immutable=True" in said[0], said
    assert "virtual chunk" in repr(gen) and _entries(disk) == 0
    _rewrite_keeping_size_and_mtime(raw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        new, gen = _epoch(repo, ChunkCache(memory=0, disk=disk))
    assert np.array_equal(new, old + 1000) and gen.io_stats["cache_disk_hits"] == 0
    kept = ChunkCache(memory=0, disk=tmp_path / "kept", immutable=True)
    assert np.array_equal(_epoch(repo, kept)[0], new) and _entries(tmp_path / "kept") == NT // CT


def test_the_memory_tier_checks_the_files_an_icechunk_snapshot_references(tmp_path):
    """One ``ChunkCache`` (memory) for several generators: a second one takes every chunk from memory
    while the referenced file is unchanged; after it was rewritten (size and modification time kept),
    the next one reads it again."""
    repo, raw = _repo(tmp_path)
    cache = ChunkCache(memory="1GB")
    old, _ = _epoch(repo, cache)
    same, gen = _epoch(repo, cache)
    assert np.array_equal(same, old) and gen.io_stats["cache_hits"] == gen.io_stats["chunks"] == NT // CT
    _rewrite_keeping_size_and_mtime(raw)
    new, gen = _epoch(repo, cache)
    assert np.array_equal(new, old + 1000)
    assert gen.io_stats["cache_hits"] == 0


def test_an_icechunk_repository_without_virtual_chunk_containers_is_kept_on_disk_by_its_snapshot(tmp_path):
    """What the snapshot names alone (no virtual chunk containers) is kept on disk, as before, silently."""
    icechunk = pytest.importorskip("icechunk")
    import zarr

    repo = icechunk.Repository.create(icechunk.local_filesystem_storage(str(tmp_path / "repo")))
    s = repo.writable_session("main")
    g = zarr.group(s.store)
    a = g.create_array("a", shape=(NT, 3, 5), chunks=(CT, 3, 5), dtype="f4", dimension_names=("time", "y", "x"))
    a[:] = np.arange(NT * 15, dtype="f4").reshape(NT, 3, 5)
    t = g.create_array("time", shape=(NT,), chunks=(NT,), dtype="i8", dimension_names=("time",))
    t[:] = np.arange(NT)
    s.commit("native chunks")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _epoch(repo, ChunkCache(memory=0, disk=tmp_path / "c"))
        got, gen = _epoch(repo, ChunkCache(memory=0, disk=tmp_path / "c"))
    assert not _ours(caught) and _entries(tmp_path / "c") == NT // CT
    assert gen.io_stats["cache_disk_hits"] == NT // CT
    assert np.array_equal(got, np.arange(NT * 15, dtype="f4").reshape(NT, 3, 5))


def test_the_files_a_snapshot_references_are_looked_at_once_per_reader(tmp_path, monkeypatch):
    """Two arrays of virtual chunks in one snapshot: a generator looks at the files the snapshot
    references once, not once per array (each look ``stat``s every referenced file: minutes for many
    variables over many files on a network file system)."""
    import zarr

    from xinsitu.cache import keys

    repo, raw = _repo(tmp_path)
    s = repo.writable_session("main")
    b = zarr.open_group(s.store)["a"]
    g = zarr.open_group(s.store)
    g.create_array("b", shape=b.shape, chunks=b.chunks, dtype="f4", compressors=None,
                   dimension_names=("time", "y", "x"), fill_value=float("nan"))
    for i in range(NT // CT):
        s.store.set_virtual_ref(f"b/c/{i}/0/0", f"file://{raw}", offset=i * CT * 15 * 4, length=CT * 15 * 4)
    s.commit("b")
    looks = []
    real = keys.referenced_state
    monkeypatch.setattr(keys, "referenced_state", lambda *a: looks.append(a[1]) or real(*a))
    ds = xinsitu.open_zarr(repo.readonly_session(branch="main").store)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", batch_size=4, output="numpy", shuffle=False, cache=True)
    got = list(gen)
    np.testing.assert_array_equal(np.concatenate([x["b"] for x in got]), ds.b.values)
    assert len(looks) == 1
