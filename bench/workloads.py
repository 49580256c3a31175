#!/usr/bin/env python
"""The child side of the benchmarks: one workload per process, one ``RESULT {json}`` line.

    python bench/workloads.py '{"task": "xinsitu", "url": "/path/or/http/url.zarr", ...}'

``run.py`` starts every workload in a fresh process (``harness.run_child``) so that each
one pays its own start-up, owns its own thread pools and connections, and has its peak
RSS measured alone. Tasks:

ceiling     every chunk object of the train split fetched once with obstore (``inflight``
            requests in flight) and zstd-decoded in a thread pool (``decode_threads``)
            into a reused buffer: the read+decode limit, no batches. ``passes`` passes,
            the first one a warm-up.
xinsitu     ``ds.insitu.batches(m, "train", batch_size=32, output="numpy", stack=True)``
            as a user calls it, ``epochs`` epochs (the first a warm-up); extra keyword
            arguments in ``kwargs`` (``shuffle``, ``block_chunks``, ``max_inflight``).
xbatcher    ``xbatcher.BatchGenerator`` over ``xr.open_zarr(chunks={})`` (dask), stacked
            with ``to_array``, ``MapDataset`` into a shuffling torch ``DataLoader``.
isel        a map-style torch Dataset doing ``ds.isel(time=i)`` on ``xr.open_zarr(chunks=None)``
            into a shuffling ``DataLoader`` with ``workers`` worker processes.
wait        the training loop's view: a model step (``time.sleep``) after each batch, shorter
            and longer than the time a batch takes to read; how long ``next()`` blocks.
memory      RSS sampled from inside every 2 ms during ``epochs`` epochs, against the RSS
            just before the first batch.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import threading
import time
import warnings
from typing import Any

import numpy as np

warnings.filterwarnings("ignore", message=".*[Cc]onsolidated metadata.*")

VARS = ["t2m", "u10", "v10", "z500"]
FRACTIONS = {"train": 0.8, "val": 0.1, "test": 0.1}


def is_http(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def zarr_store(url: str) -> Any:
    """What a user hands ``xr.open_zarr``: the path, or an obstore HTTPStore wrapped for zarr."""
    if not is_http(url):
        return url
    import obstore.store
    import zarr.storage

    return zarr.storage.ObjectStore(
        obstore.store.HTTPStore.from_url(url, client_options={"allow_http": True}), read_only=True
    )


def obstore_store(url: str) -> Any:
    import obstore.store

    if is_http(url):
        return obstore.store.HTTPStore.from_url(url, client_options={"allow_http": True})
    return obstore.store.LocalStore(prefix=os.path.abspath(url))


# ----------------------------------------------------------------------------- timing
def cpu_seconds() -> float:
    """CPU time of this process (all threads) and of its children, live or finished."""
    import psutil

    tot = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        tot += r.ru_utime + r.ru_stime
    for c in psutil.Process().children(recursive=True):
        try:
            t = c.cpu_times()
            tot += t.user + t.system
        except psutil.Error:
            pass
    return tot


class Clock:
    """Timestamps of the batches of one pass: the first ``warmup`` batches are excluded from
    the steady rate (first reads, worker start-up); the epoch rate counts everything."""

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.cpu0 = cpu_seconds()
        self.t0 = time.perf_counter()
        self.times: list[float] = []
        self.sizes: list[int] = []

    def tick(self, n: int) -> None:
        self.times.append(time.perf_counter())
        self.sizes.append(n)

    def result(self) -> dict[str, Any]:
        if not self.times:
            return {"batches": 0, "samples": 0}
        t, s = np.array(self.times), np.array(self.sizes)
        r = {
            "batches": len(t),
            "samples": int(s.sum()),
            "seconds": float(t[-1] - self.t0),
            "first_batch_s": float(t[0] - self.t0),
            "epoch_sps": float(s.sum() / (t[-1] - self.t0)),
            "cpu_us_per_sample": 1e6 * (cpu_seconds() - self.cpu0) / max(1, int(s.sum())),
        }
        w = self.warmup
        if len(t) > w + 1 and w > 0:
            r["steady_sps"] = float(s[w:].sum() / (t[-1] - t[w - 1]))
        else:
            r["steady_sps"] = r["epoch_sps"]
        return r


def summarise(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over the measured passes (all but the first, the warm-up, when there are several)."""
    meas = passes[1:] if len(passes) > 1 else passes
    out: dict[str, Any] = {"passes": passes}
    for k in ("epoch_sps", "steady_sps", "first_batch_s", "seconds", "cpu_us_per_sample"):
        vals = [p[k] for p in meas if k in p]
        if vals:
            out[k] = float(np.median(vals))
    out["samples_per_s"] = out.get("steady_sps", out.get("epoch_sps", 0.0))
    return out


# ----------------------------------------------------------------------------- ceiling
class Ceiling:
    """The read+decode limit of the train split: ``run()`` is one pass, (raw bytes, decoded bytes)."""

    def __init__(self, cfg: dict[str, Any]):
        import concurrent.futures as cf

        import numcodecs
        import obstore

        self.obstore, self.inflight = obstore, cfg["inflight"]
        self.store = obstore_store(cfg["url"])
        self.jobs: list[str] = []
        chunk_shape: tuple[int, ...] = ()
        for v in VARS:
            meta = json.loads(bytes(obstore.get(self.store, f"{v}/zarr.json").bytes()))
            names = [c["name"] for c in meta["codecs"]]
            if names != ["bytes", "zstd"] or meta["chunk_key_encoding"]["name"] != "default":
                raise NotImplementedError(f"ceiling reads bytes+zstd chunks with default keys, {v} has {names}")
            chunk_shape = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
            grid_rest = [-(-n // c) for n, c in zip(meta["shape"][1:], chunk_shape[1:], strict=True)]
            for c in cfg["train_chunks"]:
                for rest in np.ndindex(*grid_rest):
                    self.jobs.append(f"{v}/c/" + "/".join(map(str, (c, *rest))))
        self.nbytes = int(np.prod(chunk_shape)) * 4
        self.zstd = numcodecs.Zstd()
        self.local = threading.local()
        self.pool = cf.ThreadPoolExecutor(cfg["decode_threads"], thread_name_prefix="ceiling-decode")

    def _decode(self, raw: Any) -> int:
        buf = getattr(self.local, "buf", None)
        if buf is None:  # one reused destination per thread: no allocation, no page faults
            buf = self.local.buf = np.empty(self.nbytes, dtype=np.uint8)
        self.zstd.decode(memoryview(raw), out=buf)
        return self.nbytes

    async def _pass(self) -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        sem = asyncio.Semaphore(self.inflight)  # bounds fetch + decode, as xinsitu's max_inflight does

        async def one(key: str) -> tuple[int, int]:
            async with sem:
                raw = await (await self.obstore.get_async(self.store, key)).bytes_async()
                return len(raw), await loop.run_in_executor(self.pool, self._decode, raw)

        sizes = await asyncio.gather(*(one(k) for k in self.jobs))
        return sum(s[0] for s in sizes), sum(s[1] for s in sizes)

    def run(self) -> tuple[int, int]:
        return asyncio.run(self._pass())


def ceiling(cfg: dict[str, Any]) -> dict[str, Any]:
    c = Ceiling(cfg)
    passes = []
    for _ in range(cfg.get("passes", 3)):
        cpu0 = cpu_seconds()
        t0 = time.perf_counter()
        raw_b, dec_b = c.run()
        dt = time.perf_counter() - t0
        n = cfg["train_steps"]
        passes.append(
            {
                "seconds": dt,
                "epoch_sps": n / dt,
                "steady_sps": n / dt,
                "cpu_us_per_sample": 1e6 * (cpu_seconds() - cpu0) / n,
            }
        )
    r = summarise(passes)
    r.update(objects=len(c.jobs), bytes_read=raw_b, bytes_decoded=dec_b, samples=cfg["train_steps"])
    return r


def run_sweep(cfg: dict[str, Any]) -> dict[str, Any]:
    """Variants of ``batches(...)`` keyword arguments and the ceiling, side by side in one
    process: ``rounds`` rounds, each a ceiling pass and one epoch of every variant (in an order
    shuffled per round), after a warm-up round. Ratios are taken within a round."""
    import random

    import xinsitu

    ds = xinsitu.open_zarr(cfg["url"])[VARS]
    m = ds.insitu.split("time", fractions=FRACTIONS)
    c = Ceiling(cfg)
    variants = cfg["variants"]
    rounds: list[dict[str, Any]] = []
    quality: dict[str, Any] = {}
    rng = random.Random(0)
    for rnd in range(cfg.get("rounds", 3) + 1):
        order = list(range(len(variants)))
        rng.shuffle(order)
        row: dict[str, Any] = {}
        t0 = time.perf_counter()
        c.run()
        row["ceiling"] = cfg["train_steps"] / (time.perf_counter() - t0)
        for k in order:
            v = variants[k]
            gen = ds.insitu.batches(m, "train", batch_size=32, output="numpy", stack=True, seed=0, **v["kwargs"])
            gen.set_epoch(rnd)
            clock = Clock(cfg.get("warmup", 2))
            for b in gen:
                clock.tick(b.shape[0])
            row[str(v["value"])] = clock.result()
            if str(v["value"]) not in quality:
                quality[str(v["value"])] = float(gen.shuffle_quality())
            del gen  # its block buffers go before the next variant allocates its own
        if rnd > 0:  # round 0 warms connections, page cache and allocator
            rounds.append(row)
    out = []
    for v in variants:
        key = str(v["value"])
        eps = [r[key]["epoch_sps"] for r in rounds]
        out.append(
            {
                "value": v["value"],
                "epoch_sps": float(np.median(eps)),
                "x_ceiling": float(np.median([r[key]["epoch_sps"] / r["ceiling"] for r in rounds])),
                "x_ceiling_all": [r[key]["epoch_sps"] / r["ceiling"] for r in rounds],
                "first_batch_s": float(np.median([r[key]["first_batch_s"] for r in rounds])),
                "shuffle_quality": quality[key],
            }
        )
    return {
        "points": out,
        "ceiling_sps": float(np.median([r["ceiling"] for r in rounds])),
        "rounds": rounds,
        "samples_per_s": 0.0,
    }


# ----------------------------------------------------------------------------- xinsitu
def _generator(cfg: dict[str, Any]) -> Any:
    import xinsitu

    ds = xinsitu.open_zarr(cfg["url"])[VARS]
    m = ds.insitu.split("time", fractions=FRACTIONS)
    kw = {"batch_size": cfg.get("batch_size", 32), "output": "numpy", "stack": True, "seed": 0, **cfg.get("kwargs", {})}
    return ds.insitu.batches(m, "train", **kw)


def run_xinsitu(cfg: dict[str, Any]) -> dict[str, Any]:
    gen = _generator(cfg)
    passes = []
    shape = None
    for e in range(cfg.get("epochs", 3)):
        gen.set_epoch(e)
        clock = Clock(cfg.get("warmup", 2))
        for b in gen:
            clock.tick(b.shape[0])
            shape = b.shape
        p = clock.result()
        p["io"] = {k: v for k, v in gen.io_stats.items() if isinstance(v, (int, float))}
        passes.append(p)
    r = summarise(passes)
    r["batch_shape"] = list(shape) if shape is not None else None
    r["io"] = passes[-1]["io"]
    try:
        r["shuffle_quality"] = float(gen.shuffle_quality())
    except Exception:  # noqa: BLE001 - a score, not the benchmark
        r["shuffle_quality"] = None
    return r


# ----------------------------------------------------------------------------- DataLoader peers
def _drain(loader: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    clock = Clock(cfg.get("warmup", 2))
    shape = None
    for b in loader:
        clock.tick(int(b.shape[0]))
        shape = tuple(b.shape)
        spent = time.perf_counter() - clock.t0
        if (spent > cfg["max_seconds"] and len(clock.times) >= cfg.get("min_batches", 1)) or spent > 6 * cfg[
            "max_seconds"
        ]:
            break
    r = clock.result()
    r["samples_per_s"] = r.get("steady_sps", 0.0)
    r["batch_shape"] = list(shape) if shape else None
    r["complete_epoch"] = r.get("samples") == cfg["train_steps"]
    return r


def _dataloader(dataset: Any, cfg: dict[str, Any]) -> Any:
    import torch

    kw: dict[str, Any] = {}
    workers = cfg.get("workers", 0)
    if workers:
        # obstore does not survive fork once used: HTTP readers need fresh worker interpreters
        kw["multiprocessing_context"] = "forkserver" if is_http(cfg["url"]) else "fork"
    return torch.utils.data.DataLoader(
        dataset, batch_size=32, shuffle=True, num_workers=workers, generator=torch.Generator().manual_seed(0), **kw
    )


def run_xbatcher(cfg: dict[str, Any]) -> dict[str, Any]:
    import xarray as xr
    import xbatcher
    from xbatcher.loaders.torch import MapDataset

    ds = xr.open_zarr(zarr_store(cfg["url"]), chunks={}, consolidated=True)
    da = ds[VARS].isel(time=slice(0, cfg["train_steps"])).to_array("variable")
    gen = xbatcher.BatchGenerator(da, input_dims={"time": 1, "lat": ds.sizes["lat"], "lon": ds.sizes["lon"]})
    return _drain(_dataloader(MapDataset(gen), cfg), cfg)


class IselDataset:
    """Map-style dataset: one time step of the four variables, ``ds.isel(time=i)``."""

    def __init__(self, ds: Any, n: int):
        self.ds, self.n = ds, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        s = self.ds.isel(time=int(i))
        return np.stack([s[v].values for v in VARS])


def run_isel(cfg: dict[str, Any]) -> dict[str, Any]:
    import xarray as xr

    ds = xr.open_zarr(zarr_store(cfg["url"]), chunks=None, consolidated=True)[VARS]
    return _drain(_dataloader(IselDataset(ds, cfg["train_steps"]), cfg), cfg)


# ----------------------------------------------------------------------------- wait
def run_wait(cfg: dict[str, Any]) -> dict[str, Any]:
    """Per-batch read time from unthrottled epochs, then epochs with a model step of
    ``factor`` x that time after every batch."""
    gen = _generator(cfg)
    read_s = []
    for e in range(2):
        gen.set_epoch(e)
        t0 = time.perf_counter()
        n = sum(1 for _ in gen)
        read_s.append((time.perf_counter() - t0) / n)
    per_batch = read_s[-1]
    runs = []
    for k, factor in enumerate(cfg["factors"]):
        step = factor * per_batch
        gen.set_epoch(2 + k)
        waits = []
        it = iter(gen)
        t0 = time.perf_counter()
        while True:
            t = time.perf_counter()
            try:
                next(it)
            except StopIteration:
                break
            waits.append(time.perf_counter() - t)
            time.sleep(step)  # the model: forward + backward + optimizer step
        total = time.perf_counter() - t0
        io = gen.io_stats
        runs.append(
            {
                "factor": factor,
                "step_s": step,
                "batches": len(waits),
                "seconds": total,
                "wait_s": io.get("wait_s"),
                "wait_measured_s": float(sum(waits)),
                "first_wait_s": waits[0],
                "wait_after_first_s": float(sum(waits[1:])),
                "wait_frac": io.get("wait_s", 0.0) / total,
                "wait_frac_after_first": float(sum(waits[1:])) / total,
                "model_s": step * len(waits),
            }
        )
    return {"read_per_batch_s": per_batch, "runs": runs, "samples_per_s": 0.0}


# ----------------------------------------------------------------------------- memory
def run_memory(cfg: dict[str, Any]) -> dict[str, Any]:
    import gc

    import psutil

    proc = psutil.Process()
    rss_import = proc.memory_info().rss
    gen = _generator(cfg)
    gc.collect()
    base = proc.memory_info().rss
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            stop.wait(0.002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    per_epoch = []
    t0 = time.perf_counter()
    n = 0
    for e in range(cfg.get("epochs", 2)):
        gen.set_epoch(e)
        for b in gen:
            n += b.shape[0]
        per_epoch.append(peak[0])
    dt = time.perf_counter() - t0
    stop.set()
    th.join()
    lay = gen.geometry
    return {
        "rss_after_imports_mb": rss_import / 1e6,
        "baseline_mb": base / 1e6,
        "peak_mb": peak[0] / 1e6,
        "delta_mb": (peak[0] - base) / 1e6,
        "peak_after_epoch_mb": [p / 1e6 for p in per_epoch],
        "samples": n,
        "samples_per_s": n / dt,
        "train_chunks": len(gen.manifest.splits["train"]),
        "block_chunks": gen.block_chunks,
        "max_inflight": gen.max_inflight if gen.max_inflight is not None else gen._reader.inflight.limit,
        "geometry": repr(lay)[:2000],
    }


def own_peak_rss() -> int:
    """This process's peak RSS (``VmHWM``). Not ``ru_maxrss``: Linux carries that across
    ``exec``, so a child would report its (possibly much larger) parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


TASKS = {
    "sweep": run_sweep,
    "ceiling": ceiling,
    "xinsitu": run_xinsitu,
    "xbatcher": run_xbatcher,
    "isel": run_isel,
    "wait": run_wait,
    "memory": run_memory,
}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    try:
        r = TASKS[cfg["task"]](cfg)
    except Exception as e:  # noqa: BLE001 - reported in the table, not a crash of the driver
        import traceback

        traceback.print_exc()
        r = {"error": f"{type(e).__name__}: {e}"[:400]}
    r["hwm_mb"] = own_peak_rss() / 1e6
    print("RESULT " + json.dumps(r, default=float), flush=True)
    sys.stdout.flush()
    os._exit(0)  # no slow teardown of thread pools, event loops and DataLoader workers


if __name__ == "__main__":
    main()
