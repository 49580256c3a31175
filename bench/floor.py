"""What any in-place loader can reach on this machine, beside xinsitu, in one process.

The yardstick's ``decode`` peer (``../shared/bench/peers.py``) decodes objects it read into memory
before its clock starts; a loader reads the files, and where a chunk holds several samples it must
also copy each sample out of the decoded chunk into a shuffled batch. This script times, passes
alternating in one process (ratios within a round), on an archive of ``peers.py``'s layout:

* ``decode``: the split's chunk objects, in memory, zstd-decoded by a pool of a thread per core
  (numcodecs, as ``peers.py``'s peer: each output freed at once, so the next decode writes into the same,
  cache-warm memory);
* ``decode, kept``: the same, each chunk decoded into its place in one array of the whole split (made and
  touched before the clock): what decoding costs where the values outlive the decode;
* ``read+decode``: the same, each file read inside the clock (``wm_bench.py``'s ``decode`` peer);
* ``floor``: the least a shuffled in-place loader does, by hand with no framework: blocks of 16
  chunks in a shuffled order, each block's files read and decoded by the pool into a block buffer
  while the main thread copies the previous block's samples, in a shuffled order, into stacked
  ``(batch, variable, y, x)`` batches; one sample per chunk: each chunk decoded straight into its
  batch row, no buffer;
* ``floor, scatter`` (chunks of several steps): the floor without the copy out of a block buffer in memory:
  each chunk decoded into a small buffer of its thread and its samples copied from there, still in the
  caches, into a stacked block of batches in yield order; batches are views of it;
* ``xinsitu``: a shuffled epoch of ``ds.insitu.batches(..., stack=True, output="numpy")``.

    python bench/floor.py ../bench-data/era5_v3.zarr --rounds 5
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

BLOCK_CHUNKS = 16


def _meta(path: str, var: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    with open(os.path.join(path, var, "zarr.json")) as f:
        m = json.load(f)
    return tuple(m["shape"]), tuple(m["chunk_grid"]["configuration"]["chunk_shape"])


class Archive:
    def __init__(self, path: str, batch_size: int):
        from numcodecs import Zstd
        self.path, self.batch_size, self.zstd = path, batch_size, Zstd()
        names = [os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(path, "*", "zarr.json"))]
        self.vars = sorted(v for v in names if len(_meta(path, v)[0]) == 3)  # (time, y, x) variables
        shape, chunk = _meta(path, self.vars[0])
        self.ct, self.field = chunk[0], shape[1:]
        self.n_train = int(shape[0] * 0.8) // self.ct * self.ct
        self.n_chunks = self.n_train // self.ct
        self.files = {v: [os.path.join(path, v, "c", str(c), "0", "0") for c in range(self.n_chunks)]
                      for v in self.vars}
        self.last = np.zeros(0, np.int64)  # the steps of the last batch a floor made ...
        self.last_batch = np.zeros(0, "f4")  # ... and that batch
        self.pool = ThreadPoolExecutor(os.cpu_count() or 2)
        self.sample_bytes = len(self.vars) * int(np.prod(self.field)) * 4

    def _read(self, f: str) -> bytes:
        fd = os.open(f, os.O_RDONLY)
        try:
            return os.read(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def decode(self, objects: list[bytes]) -> float:
        t0 = time.perf_counter()
        for _ in self.pool.map(lambda raw: len(self.zstd.decode(raw)), objects):
            pass
        return time.perf_counter() - t0

    def decode_kept(self, objects: list[bytes], into: np.ndarray) -> float:
        t0 = time.perf_counter()
        for _ in self.pool.map(lambda k: self.zstd.decode(objects[k], out=into[k]), range(len(objects))):
            pass
        return time.perf_counter() - t0

    def read_decode(self) -> float:
        t0 = time.perf_counter()
        files = [f for fs in self.files.values() for f in fs]
        for _ in self.pool.map(lambda f: len(self.zstd.decode(self._read(f))), files):
            pass
        return time.perf_counter() - t0

    def floor(self, seed: int, bufs: list[dict[str, np.ndarray]], out: np.ndarray) -> float:
        rng = np.random.default_rng(seed)
        t0 = time.perf_counter()
        if self.ct == 1:  # a chunk is a sample: decode into the batch row, no buffer
            def one(i: int, k: int, c: int) -> None:
                self.zstd.decode(self._read(self.files[self.vars[k]][c]), out=out[i, k])

            order = rng.permutation(self.n_chunks)
            for b0 in range(0, len(order), self.batch_size):
                ids = order[b0:b0 + self.batch_size]
                for fut in [self.pool.submit(one, i, k, c) for i, c in enumerate(ids) for k in range(len(self.vars))]:
                    fut.result()
            self.last, self.last_batch = ids, out[:len(ids)]
            return time.perf_counter() - t0
        blocks = self._blocks(rng)

        def load(block: np.ndarray, buf: dict[str, np.ndarray]) -> list:
            return [self.pool.submit(lambda v, i, c: self.zstd.decode(
                self._read(self.files[v][c]), out=buf[v][i * self.ct:(i + 1) * self.ct]), v, i, c)
                for v in self.vars for i, c in enumerate(block)]

        pending = load(blocks[0], bufs[0])
        for j, block in enumerate(blocks):
            for fut in pending:
                fut.result()
            pending = load(blocks[j + 1], bufs[(j + 1) % 2]) if j + 1 < len(blocks) else []
            buf, order = bufs[j % 2], rng.permutation(len(block) * self.ct)
            for b0 in range(0, len(order), self.batch_size):
                ids = order[b0:b0 + self.batch_size]
                for k, v in enumerate(self.vars):
                    src = buf[v]
                    for i, s in enumerate(ids.tolist()):
                        np.copyto(out[i, k], src[s])
            self.last, self.last_batch = block[ids // self.ct] * self.ct + ids % self.ct, out[:len(ids)]
        return time.perf_counter() - t0

    def _blocks(self, rng: np.random.Generator) -> list[np.ndarray]:
        """The split's chunks in a shuffled order, cut into blocks of at most ``BLOCK_CHUNKS``."""
        return np.array_split(rng.permutation(self.n_chunks), -(-self.n_chunks // BLOCK_CHUNKS))

    def scatter(self, seed: int, blocks_out: list[np.ndarray]) -> float:
        """The floor without the copy out of a block buffer: each chunk decoded into a small buffer of the
        decoding thread (still in its caches), its samples copied from there straight into their rows of a
        stacked block of batches in yield order, and each batch a view of that block."""
        rng = np.random.default_rng(seed)
        local = threading.local()
        t0 = time.perf_counter()
        blocks = self._blocks(rng)

        def one(v: int, i: int, c: int, rows: np.ndarray, out: np.ndarray) -> None:
            scratch = getattr(local, "scratch", None)
            if scratch is None:
                scratch = local.scratch = np.empty((self.ct, *self.field), "f4")
            self.zstd.decode(self._read(self.files[self.vars[v]][c]), out=scratch)
            for t, r in enumerate(rows[i * self.ct:(i + 1) * self.ct].tolist()):
                np.copyto(out[r, v], scratch[t])

        def load(block: np.ndarray, out: np.ndarray) -> tuple[list, np.ndarray]:
            order = rng.permutation(len(block) * self.ct)  # yield order of the block's samples
            rows = np.empty_like(order)
            rows[order] = np.arange(len(order))  # each sample's row in the block of batches
            return [self.pool.submit(one, v, i, c, rows, out) for v in range(len(self.vars))
                    for i, c in enumerate(block)], order

        pending, order = load(blocks[0], blocks_out[0])
        for j, block in enumerate(blocks):
            for fut in pending:
                fut.result()
            done, ids = blocks_out[j % 2][:len(order)], order  # a short block fills only its first rows
            pending, order = load(blocks[j + 1], blocks_out[(j + 1) % 2]) if j + 1 < len(blocks) else ([], order)
            for b0 in range(0, len(ids), self.batch_size):
                batch = done[b0:b0 + self.batch_size]  # a view: nothing copied
            self.last, self.last_batch = block[ids[b0:] // self.ct] * self.ct + ids[b0:] % self.ct, batch
        return time.perf_counter() - t0

    def check(self) -> None:
        """The last batch a floor made holds the steps it says, as xarray reads them (its work is real)."""
        import xarray as xr
        ds = xr.open_zarr(self.path)
        want = np.stack([ds[v].isel(time=self.last).values for v in self.vars], axis=1)
        if not np.array_equal(self.last_batch, want, equal_nan=True):
            raise AssertionError("floor: its last batch differs from xarray's values")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32)
    a = ap.parse_args()
    import xinsitu
    arc = Archive(a.path, a.batch_size)
    objects = [arc._read(f) for fs in arc.files.values() for f in fs]
    bufs = [{v: np.zeros((BLOCK_CHUNKS * arc.ct, *arc.field), dtype="f4") for v in arc.vars} for _ in range(2)]
    out = np.zeros((a.batch_size, len(arc.vars), *arc.field), dtype="f4")
    every = np.ones((len(objects), arc.ct, *arc.field), dtype="f4")  # the split's samples, decoded and kept
    ds = xinsitu.open_zarr(a.path)[arc.vars]
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.1, "test": 0.1})
    gen = ds.insitu.batches(m, "train", batch_size=a.batch_size, output="numpy", stack=True, shuffle=True, seed=0)
    n_x = 0

    def xin(epoch: int) -> float:
        nonlocal n_x
        gen.set_epoch(epoch)
        t0, n = time.perf_counter(), 0
        for b in gen:
            n += b.shape[0]
        n_x = n
        return time.perf_counter() - t0

    runs = {"decode": lambda r: arc.decode(objects), "decode, kept": lambda r: arc.decode_kept(objects, every),
            "read+decode": lambda r: arc.read_decode(),
            "floor": lambda r: arc.floor(r, bufs, out), "xinsitu": xin}
    if arc.ct > 1:
        blks = [np.zeros((BLOCK_CHUNKS * arc.ct, len(arc.vars), *arc.field), "f4") for _ in range(2)]
        runs["floor, scatter"] = lambda r: arc.scatter(r, blks)
    for name, fn in runs.items():  # a pass of each untimed: threads, pools and pages warm
        fn(0)
        if name.startswith("floor"):
            arc.check()
    rates: dict[str, list[float]] = {k: [] for k in runs}
    cores: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(1, a.rounds + 1):
        for name, fn in runs.items():
            c0 = os.times()
            dt = fn(r)
            c1 = os.times()
            n = n_x if name == "xinsitu" else arc.n_train
            rates[name].append(n * arc.sample_bytes / dt / 1e6)
            cores[name].append((c1.user + c1.system - c0.user - c0.system) / dt)
        dec = rates["decode"][-1]
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.0f} MB/s ({v[-1] / dec:.2f}, {cores[k][-1]:.2f} cores)"
                                         for k, v in rates.items()), flush=True)
    print(f"{a.path}: chunks of {arc.ct} step(s), {len(arc.vars)} variables, {arc.n_train} samples, "
          f"{os.cpu_count()} cores; median MB/s and x decode per round:")
    for k, v in rates.items():
        ratios = [x / d for x, d in zip(v, rates["decode"], strict=True)]
        print(f"  {k:12s} {statistics.median(v):7.0f}   x decode {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}), {statistics.median(cores[k]):.2f} cores busy")


if __name__ == "__main__":
    main()
