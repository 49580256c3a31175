#!/usr/bin/env python
"""Should the disk tier of ``xinsitu.ChunkCache`` keep decoded chunks or the compressed objects?

For ``--chunks`` chunks of the yardstick archive (float32, 24 x 64 x 128, bytes + zstd), the
time to get one chunk back as a decoded array, median over chunks and ``--repeat`` rounds,
one thread (what one decode thread pays per chunk), and the bytes on disk:

- ``decoded``: ``ChunkCache(memory=0, disk=DIR).get(key)``, the tier as built: open, read
  the header, ``readinto`` a new array, CRC-32C over it, mark it used;
- ``compressed``: the same entry format holding the zstd object instead: open, read, CRC-32C
  over the compressed bytes, zstd decode into a new array (numcodecs, as zarr decodes);
- ``store``: no cache: read the chunk file of the archive and decode it (what a miss costs
  on a local archive, for scale).

Each is measured with the files in the page cache (``warm``) and after
``posix_fadvise(DONTNEED)`` has dropped them from it (``cold``: the read goes to the device),
in wall time and in CPU time of the thread (what the decode threads, the scarce resource of
a cached epoch, spend per chunk).

    python bench/cache_bench.py                                   # ../bench-data/era5_v3.zarr
    python bench/cache_bench.py --data ../bench-data/era5_v3.zarr --chunks 64 --repeat 5 --dir /nvme/tmp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from xinsitu.cache.chunk_cache import ChunkCache  # noqa: E402
from xinsitu.cache.keys import ChunkKey  # noqa: E402


def _crc() -> Any:
    try:
        import google_crc32c

        return lambda data: int(google_crc32c.value(data))
    except ImportError:
        return zlib.crc32


def _drop(path: str) -> None:
    """Drop a file's pages from the page cache (the next read goes to the device)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd) if os.access(path, os.W_OK) else None
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _time(ways: dict[str, tuple[Any, list[Any], list[str]]], cold: bool) -> dict[str, list[tuple[float, float]]]:
    """(seconds, CPU seconds of this thread) per chunk for each way, the ways taking turns chunk by
    chunk (a load that comes and goes on a shared machine slows every way alike)."""
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    n = len(next(iter(ways.values()))[1])
    for i in range(n):
        for name, (fn, items, files) in ways.items():
            if cold:
                _drop(files[i])
            t0, c0 = time.perf_counter(), time.thread_time()
            fn(items[i])
            out[name].append((time.perf_counter() - t0, time.thread_time() - c0))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.join(here, "..", "..", "..", "bench-data", "era5_v3.zarr"))
    p.add_argument("--var", default="t2m")
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the cache directories go (default: a temp dir)")
    args = p.parse_args(argv)

    import numcodecs
    import zarr

    data = os.path.abspath(args.data if os.path.exists(args.data) else "/work/bench-data/era5_v3.zarr")
    arr = zarr.open_array(os.path.join(data, args.var), mode="r")
    keys = ChunkKey.for_array(arr)
    assert keys is not None
    nchunks = arr.cdata_shape[0]
    picks = np.linspace(0, nchunks - 1, min(args.chunks, nchunks)).astype(int)
    coords = [(int(i),) + (0,) * (arr.ndim - 1) for i in picks]
    store_files = [os.path.join(data, args.var, "c", *map(str, c)) for c in coords]
    raws = [open(f, "rb").read() for f in store_files]
    codec = numcodecs.Zstd()
    shape, dtype = tuple(arr.chunks), np.dtype(arr.dtype)
    decoded = [np.frombuffer(codec.decode(r), dtype=dtype).reshape(shape) for r in raws]
    for c, d in zip(coords[:2], decoded[:2], strict=True):  # the bench decodes what zarr decodes
        assert np.array_equal(d, arr[tuple(slice(i * n, (i + 1) * n) for i, n in zip(c, shape, strict=True))],
                              equal_nan=True)

    root = tempfile.mkdtemp(prefix="cache-bench-", dir=args.dir)
    try:
        # decoded: the tier as built
        cache = ChunkCache(memory=0, disk=os.path.join(root, "decoded"))
        ckeys = [keys.key(c) for c in coords]
        for k, d in zip(ckeys, decoded, strict=True):
            cache.put(k, d)
        dec_files = [cache._disk.file_of(k) for k in ckeys]

        # compressed: the same layout (header + checksum), zstd bytes as the payload
        crc = _crc()
        comp_dir = os.path.join(root, "compressed")
        os.makedirs(comp_dir)
        comp_files = []
        for k, r in zip(ckeys, raws, strict=True):
            path = os.path.join(comp_dir, k + ".chunk")
            head = np.array([len(r), crc(r)], dtype="<u8").tobytes()
            with open(path + ".tmp", "wb") as f:
                f.write(head)
                f.write(r)
            os.replace(path + ".tmp", path)
            comp_files.append(path)

        def get_compressed(path: str) -> np.ndarray:
            with open(path, "rb") as f:
                blob = f.read()
            n, check = np.frombuffer(blob[:16], dtype="<u8")
            body = np.frombuffer(blob, np.uint8, offset=16)
            assert len(body) == n and crc(body) == check
            out = np.empty(shape, dtype)
            codec.decode(body, out=out)
            return out

        def get_store(path: str) -> np.ndarray:
            with open(path, "rb") as f:
                raw = f.read()
            out = np.empty(shape, dtype)
            codec.decode(raw, out=out)
            return out

        for k, d in zip(ckeys[:2], decoded[:2], strict=True):
            assert np.array_equal(cache.get(k), d, equal_nan=True)
        assert np.array_equal(get_compressed(comp_files[0]), decoded[0], equal_nan=True)

        ways = {
            "decoded": (cache.get, ckeys, dec_files),
            "compressed": (get_compressed, comp_files, comp_files),
            "store": (get_store, store_files, store_files),
        }
        times: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for _ in range(args.repeat):
            for mode in ("warm", "cold"):
                if mode == "warm":
                    _time(ways, cold=False)  # into the page cache first
                for name, took in _time(ways, cold=mode == "cold").items():
                    times.setdefault((name, mode), []).extend(took)
        sizes = {name: sum(os.path.getsize(f) for f in files) for name, (_, _, files) in ways.items()}
        chunk_bytes = int(np.prod(shape)) * dtype.itemsize
        result: dict[str, Any] = {"chunk": f"{shape} {dtype}", "chunk_bytes": chunk_bytes, "chunks": len(coords),
                                  "ratio": chunk_bytes * len(coords) / sizes["store"], "ways": {}}
        print(f"{len(coords)} chunks of {args.var} {shape} {dtype} ({chunk_bytes / 1e6:.2f} MB decoded), "
              f"zstd ratio {result['ratio']:.2f}, {args.repeat} rounds, one thread, median per chunk")
        print(f"{'way':<12}{'warm ms':>9}{'cpu ms':>8}{'cold ms':>9}{'cpu ms':>8}{'warm GB/s':>11}{'disk MB':>9}")
        for name in ways:
            row = {}
            for mode in ("warm", "cold"):
                row[f"{mode}_ms"] = statistics.median(t for t, _ in times[(name, mode)]) * 1e3
                row[f"{mode}_cpu_ms"] = statistics.median(c for _, c in times[(name, mode)]) * 1e3
            result["ways"][name] = {**row, "disk_bytes": sizes[name]}
            print(f"{name:<12}{row['warm_ms']:>9.3f}{row['warm_cpu_ms']:>8.3f}{row['cold_ms']:>9.3f}"
                  f"{row['cold_cpu_ms']:>8.3f}{chunk_bytes / row['warm_ms'] / 1e6:>11.2f}{sizes[name] / 1e6:>9.1f}")
        print(json.dumps(result))
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
