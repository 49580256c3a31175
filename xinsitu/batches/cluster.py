"""One-pass jobs in parts, and the Dask cluster that runs them.

Layer 3. A one-pass job (``stats``, ``validity``) splits into ``n`` parts: part ``i`` reads the
``i``-th share of the split's chunk blocks (units) and gives a small JSON-able partial result that
names its job (``job_id``) and its place (``part: [i, n]``); ``parts_in_order`` checks a set of
parts before they are merged (one job, each part once, none missing) and puts them in part order.
Any engine can run the parts (a Slurm job array, Beam, a loop); ``run_parts`` runs them on a
``distributed.Client``:

- the job (a ``StatsPass`` or ``ValidityPass`` that has not run) travels once to each worker,
  scattered, as a ``Shipped`` blob: the pickled sources name where the archive is (a URL with its
  store options, a local path, a read-only Icechunk session, virtual references), so each worker
  opens the archive itself; index arrays that are arithmetic progressions (the positions of a
  whole dim, a regular chunk grid: 8 MB each for 10^6 steps) travel as three numbers;
- a Dataset a worker cannot reopen is refused before anything is sent (``check_portable``):
  values held in memory, files read through dask, an in-memory store, a store that does not pickle
  (a writable Icechunk session);
- tasks are keyed ``xinsitu-<kind>-<token>-<i>`` and take the scattered job by reference: no task's
  arguments (nor their repr, nor a log line) hold a credential;
- a worker that dies is the scheduler's to replace: its tasks run again elsewhere, and the merge,
  which adds exact sums in part order, gives the same bits; a chunk that cannot be read comes back
  as data and is raised here as the ``ChunkReadError`` the worker met (variable, chunk, key).
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import math
import pickle
import threading
import uuid
import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np

from xinsitu.batches.describe import missing_note, progress_bar
from xinsitu.cache.keys import array_store, store_identity
from xinsitu.compat import virtualizarr_api as compat_virtualizarr
from xinsitu.index.snapshot import writable_session
from xinsitu.stores.backend import ChunkReadError
from xinsitu.stores.redact import redact, redact_url

#: tasks per worker thread (more tasks than threads: a slow or lost task holds less of the pass back)
TASKS_PER_THREAD = 4
#: chunk blocks (units) per task at most: a task lost with its worker costs at most this much again
UNITS_PER_TASK = 1024
#: index arrays at least this long travel as (start, step, length) where they are arithmetic progressions
COMPACT_MIN = 1024


# ----------------------------------------------------------------------------- parts
def selection_of(sources: dict[str, Any]) -> dict[str, str]:
    """What each variable (``xinsitu.index.source.VarSource``) is of its stored array, as a short hash
    per name: its dims and shape, and the positions it takes along each stored dim. Part of a job, so
    that parts of differently selected Datasets (one task opened ``ds``, another ``ds.isel(lat=...)``)
    are never merged."""
    out = {}
    for name in sorted(sources):
        src = sources[name]
        h = hashlib.blake2b(json.dumps([list(src.dims), list(src.shape), list(src.src_dims)]).encode(),
                            digest_size=8)
        for ix in src.index:
            if isinstance(ix, (int, np.integer)):
                h.update(f";{int(ix)}".encode())
            else:
                h.update(b";")
                h.update(np.ascontiguousarray(ix, dtype=np.int64).tobytes())
        out[str(name)] = h.hexdigest()
    return out


def archive_of(sources: dict[str, Any]) -> dict[str, str]:
    """Which archive each variable is read from, as a short hash per name (``_identity``): the store's
    identity (``xinsitu.cache.keys.store_identity``: scheme, bucket, endpoint, path; never credentials)
    and the array's path in it, the files a NetCDF/GRIB variable read in place references, a dask array's
    name, an in-memory variable's values. Part of a job, so that parts of two archives of the same
    geometry (a re-processed copy beside the first) are never merged; an Icechunk store is told apart by
    its snapshot, another store without a lasting identity (a ``MemoryStore``) not at all."""
    out = {}
    for name in sorted(sources):
        src = sources[name]
        out[str(name)] = hashlib.blake2b(json.dumps(_identity(src)).encode(), digest_size=8).hexdigest()
    return out


def _identity(src: Any) -> list[Any]:
    """What names the stored array (or the files) a variable is read from, in any process (``archive_of``)."""
    if isinstance(src.values, np.ndarray):  # in memory: its values (a Dataset to prototype on: small)
        h = hashlib.blake2b(np.ascontiguousarray(src.values).tobytes(), digest_size=8) \
            if src.values.dtype.kind not in "OUSV" else hashlib.blake2b(pickle.dumps(src.values), digest_size=8)
        return ["values", src.values.dtype.str, list(src.values.shape), h.hexdigest()]
    if src.array is None:  # read through dask: its array's name (xarray's token names the files and their mtime)
        return ["dask", str(getattr(getattr(src.values, "data", None), "name", None))]
    store = array_store(src.array)
    path = str(getattr(src.array, "path", "") or "")
    if compat_virtualizarr.is_manifest_store(store):  # NetCDF/GRIB read in place: the files it references
        return ["files", compat_virtualizarr.manifest_files(store, path)]
    ident = store_identity(store)
    return [None if ident is None else ident[0], path]


def job_digest(job: dict[str, Any]) -> str:
    """A short hash of a job's identity (what its parts carry as ``job_id``; see ``parts_in_order``)."""
    return hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()[:16]


def part_arg(part: Any) -> tuple[int, int]:
    """``part=(i, n)`` checked: ``0 <= i < n``; ``TypeError``/``ValueError`` naming ``part``."""
    if not isinstance(part, (tuple, list)) or len(part) != 2 or not all(
            isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) for x in part):
        raise TypeError(f"part must be (i, n), two integers: share i of n, got {type(part).__name__} {part!r}")
    i, n = int(part[0]), int(part[1])
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"part must be (i, n) with n >= 1 and 0 <= i < n, got {part!r}")
    return i, n


def warn_missing(parts: list[dict[str, Any]], what: str) -> None:
    """Warn once where the parts read chunks that had no object in the store (their ``missing`` records,
    ``Reader.missing_record``): they read as the fill value, as in zarr, but a deleted archive looks the
    same."""
    recs = [m for p in parts if isinstance(m := p.get("missing"), list) and len(m) == 4]
    if recs:
        n = sum(int(m[0]) for m in recs)
        warnings.warn(f"{what}: {missing_note(n, *recs[0][1:])}.", UserWarning, stacklevel=4)


def parts_in_order(parts: Iterable[Any], kind: str, version: int, what: str) -> list[dict[str, Any]]:
    """The parts of one job, checked and in part order (JSON text is parsed).

    ``ValueError`` (naming ``what``) where a part is not a ``kind`` part of this ``version``, where parts
    of different jobs are mixed, where one is missing or given twice.
    """
    if isinstance(parts, (str, bytes, dict)):
        raise TypeError(f"{what}: parts must be a list of partial results, got one {type(parts).__name__}")
    got: list[dict[str, Any]] = []
    for p in parts:
        if isinstance(p, (str, bytes)):
            try:
                p = json.loads(p)
            except ValueError as e:
                raise ValueError(f"{what}: a part is not JSON ({e})") from None
        if not isinstance(p, dict) or p.get("xinsitu") != kind:
            raise ValueError(f"{what}: expected partial results of ds.insitu.{kind}, got "
                             f"{type(p).__name__} {str(p)[:80]!r}")
        if p.get("version") != version:
            raise ValueError(f"{what}: a part of format version {p.get('version')!r}; this xinsitu reads {version}")
        place = p.get("part")
        if not (isinstance(place, list) and len(place) == 2 and all(isinstance(x, int) for x in place)
                and place[1] >= 1 and 0 <= place[0] < place[1]):
            raise ValueError(f"{what}: a part's place must be [i, n], got {place!r}")
        if not isinstance(p.get("job"), dict) or job_digest(p["job"]) != p.get("job_id"):
            raise ValueError(f"{what}: part {place[0]}'s job does not match its job_id (edited or damaged)")
        got.append(p)
    if not got:
        raise ValueError(f"{what}: no parts given")
    jobs = {p.get("job_id") for p in got}
    if len(jobs) > 1:
        first, other = got[0], next(p for p in got if p.get("job_id") != got[0].get("job_id"))
        diff = sorted(k for k in set(first.get("job", {})) | set(other.get("job", {}))
                      if first.get("job", {}).get(k) != other.get("job", {}).get(k))
        raise ValueError(f"{what}: the parts come from {len(jobs)} different jobs (they differ in {diff}); "
                         "merge the parts of one job only")
    ns = {p["part"][1] for p in got}
    if len(ns) > 1:
        raise ValueError(f"{what}: the parts cut the job into different numbers of shares {sorted(ns)}")
    n = ns.pop()
    seen: dict[int, int] = {}
    for p in got:
        seen[p["part"][0]] = seen.get(p["part"][0], 0) + 1
    twice = sorted(i for i, k in seen.items() if k > 1)
    missing = sorted(set(range(n)) - set(seen))
    if twice or missing:
        said = [f"part(s) {_few(missing)} missing"] if missing else []
        said += [f"part(s) {_few(twice)} given twice"] if twice else []
        raise ValueError(f"{what}: each of the {n} parts must be given once: " + "; ".join(said))
    return sorted(got, key=lambda p: p["part"][0])


def _few(ids: list[int]) -> str:
    return str(ids) if len(ids) <= 10 else f"{ids[:10]}... ({len(ids)} in all)"


# ----------------------------------------------------------------------------- what travels
def check_portable(sources: dict[str, Any], what: str) -> None:
    """Refuse (``ValueError``) variables a worker could not open itself: values in memory, files read
    through dask, arrays of an in-memory store."""
    for name, src in sources.items():
        if not src.stored:
            how = ("is read through dask from files that are not Zarr; open them in place with "
                   "xinsitu.virtual.open_netcdf/open_grib (workers then read the files themselves)"
                   if type(src.values).__name__ == "DaskBlocks" else
                   "holds its values in memory (a Dataset built or loaded in this process)")
            raise ValueError(f"{what} with client=: variable {name!r} {how}, so the cluster's workers cannot open "
                             "it; write it to a Zarr store they can reach, or compute without client=")
        store = src.array.store
        kind = type(getattr(store, "store", store)).__name__
        if "MemoryStore" in (type(store).__name__, kind):
            raise ValueError(f"{what} with client=: variable {name!r} is in an in-memory store ({kind}), which the "
                             "cluster's workers cannot open; write it to a store they can reach (a path, a URL)")
        if writable_session(store):
            raise ValueError(f"{what} with client=: variable {name!r} is in a writable Icechunk session, which "
                             "cannot be sent to the workers; open a read-only session "
                             "(repo.readonly_session(...)), or compute without client=")


def _arange(start: int, step: int, n: int, dtype: str, writeable: bool) -> np.ndarray:
    """An arithmetic progression, as ``Shipped`` sends one (see ``_Compact``)."""
    a = (start + step * np.arange(n, dtype=np.int64)).view(np.dtype(dtype)) if np.dtype(dtype).kind in "mM" else \
        (start + step * np.arange(n, dtype=np.int64)).astype(dtype)
    if not writeable:
        a.setflags(write=False)
    return a


def _progression(a: np.ndarray) -> tuple[int, int] | None:
    """``(start, step)`` where 1-d integer (or datetime) ``a`` is an arithmetic progression, else None."""
    v = a.view(np.int64) if a.dtype.kind in "mM" and a.dtype.itemsize == 8 else a
    if v.dtype.kind not in "iu" or not v.flags.c_contiguous:
        return None
    start, step = int(v[0]), int(v[1]) - int(v[0])
    d = np.diff(v)
    return (start, step) if bool((d == step).all()) else None


def _dumps(obj: Any) -> bytes:
    """``obj`` pickled with cloudpickle (lambdas and local functions too), long arithmetic progressions
    written as three numbers."""
    import cloudpickle  # type: ignore[import-untyped]

    class _Compact(cloudpickle.Pickler):  # type: ignore[misc, name-defined]
        def reducer_override(self, o: Any) -> Any:
            if type(o) is np.ndarray and o.ndim == 1 and o.size >= COMPACT_MIN and o.dtype.kind in "iumM":
                prog = _progression(o)
                if prog is not None:
                    return _arange, (*prog, o.size, o.dtype.str, bool(o.flags.writeable))
            return super().reducer_override(o)

    buf = io.BytesIO()
    _Compact(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


class Shipped:
    """A job as it travels to the workers: pickled once (``_dumps``), unpickled once per worker process
    (``get``), shown without what it holds (a store's URL without credentials, the size)."""

    def __init__(self, job: Any, what: str, where: str):
        self.blob = _dumps(job)
        self.what, self.where = what, where
        self._job: Any = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"blob": self.blob, "what": self.what, "where": self.where}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._job, self._lock = None, threading.Lock()

    def get(self) -> Any:
        """The job (unpickled on first use in this process; several tasks share it, each runs a copy)."""
        with self._lock:
            if self._job is None:
                self._job = pickle.loads(self.blob)
            return self._job

    def __repr__(self) -> str:
        return f"<xinsitu job: {self.what} of {self.where}, {len(self.blob)} bytes>"


def where_of(sources: dict[str, Any]) -> str:
    """Where the sources' archive is, for messages and reprs: a URL without user info or query, a path."""
    for src in sources.values():
        store = src.array.store
        for attr in ("url", "root", "prefix", "path"):
            v = getattr(store, attr, None) or getattr(getattr(store, "store", None), attr, None)
            if isinstance(v, str) and v:
                return redact_url(v) if "://" in v else v
            if v is not None and hasattr(v, "__fspath__"):
                return str(v)
        return redact(type(store).__name__)
    return "?"


# ----------------------------------------------------------------------------- the cluster
def check_client(client: Any, cache: Any = None) -> None:
    """``client`` is a ``distributed.Client`` (``TypeError`` naming ``client``); the dask extra is there;
    no ``cache`` beside it (``ValueError``: a cache keeps chunks in this process, the workers read them)."""
    if cache is not None:
        raise ValueError("cache= keeps chunks in this process; with client= the chunks are read on the "
                         "workers: leave cache out (or run the pass here, without client=)")
    try:
        from distributed import Client
    except ImportError:
        raise ImportError("client= needs distributed, which is not installed: pip install 'xinsitu[dask]'") from None
    if not isinstance(client, Client):
        raise TypeError(f"client must be a distributed.Client (or None), got {type(client).__name__}")
    if client.status in ("closing", "closed"):
        raise ValueError(f"client is {client.status}: pass a Client that is connected to its cluster")


def task_count(client: Any, units: int) -> int:
    """How many parts to cut ``units`` units into on this cluster: ``TASKS_PER_THREAD`` per worker thread,
    more where that would make tasks of over ``UNITS_PER_TASK`` units, never more than the units."""
    threads = sum(client.nthreads().values()) or 1
    return max(1, min(units, max(TASKS_PER_THREAD * threads, math.ceil(units / UNITS_PER_TASK))))


def _run_part(shipped: Shipped, i: int, n: int) -> dict[str, Any]:
    """A task: part ``i`` of ``n`` of the shipped job, on a copy of it (tasks of one worker share the
    job); a chunk that cannot be read comes back as data (``run_parts`` raises it)."""
    job = copy.copy(shipped.get())
    try:
        return job.part(i, n)  # type: ignore[no-any-return]
    except ChunkReadError as e:
        return {"xinsitu": "error", "error": "ChunkReadError", "var": e.var, "chunk": list(e.chunk), "key": e.key,
                "message": str(e)}


def _chunk_error(rec: dict[str, Any]) -> ChunkReadError:
    """The ``ChunkReadError`` a worker met, as it read it (the same message, variable, chunk and key)."""
    e = ChunkReadError.__new__(ChunkReadError)
    OSError.__init__(e, rec["message"])
    e.var, e.chunk, e.key = rec["var"], tuple(rec["chunk"]), rec["key"]
    return e


def run_parts(client: Any, job: Any, units: int, sources: dict[str, Any], *, what: str,
              progress: bool = False) -> list[dict[str, Any]]:
    """Run ``job`` (with ``part(i, n)``) in parts on ``client``'s workers; the parts, in part order.

    ``units``: how many units the job has (the tasks are cut from them, ``task_count``); ``sources``: the
    variables' sources, checked first (``check_portable``). Each worker gets the job once (scattered); a
    ``ChunkReadError`` on a worker is raised here, the other tasks cancelled.
    """
    check_client(client)
    check_portable(sources, what)
    try:
        shipped = Shipped(job, what, where_of(sources))
    except Exception as e:  # noqa: BLE001 - whatever the store raises when pickled
        where = getattr(job, "where", None)
        if callable(where):  # the predicate of a validity pass, not the Dataset, may be what does not pickle
            try:
                _dumps(where)
            except Exception as e2:  # noqa: BLE001
                raise ValueError(f"{what} with client=: where= cannot be sent to the workers "
                                 f"({type(e2).__name__}: {str(e2)[:300]}); give a predicate that cloudpickle "
                                 "can pickle (one that holds no lock, open file or connection), or compute "
                                 "without client=") from None
        raise ValueError(f"{what} with client=: the Dataset cannot be sent to the workers ({type(e).__name__}: "
                         f"{redact(str(e))[:300]}); open the archive from a path or URL, or a read-only Icechunk "
                         "session (repo.readonly_session(...)), or compute without client=") from None
    n = task_count(client, units)
    token = uuid.uuid4().hex[:8]
    kind = what.split()[0]
    blob = client.scatter(shipped, broadcast=True, hash=False)
    futures = [client.submit(_run_part, blob, i, n, key=f"xinsitu-{kind}-{token}-{i}", pure=False)
               for i in range(n)]
    bar = None
    if progress:
        bar = progress_bar(total=n, desc=what, unit="task")
    from distributed import as_completed

    got: list[dict[str, Any]] = []
    try:
        for fut in as_completed(futures):
            res = fut.result()
            if res.get("xinsitu") == "error":
                raise _chunk_error(res)
            got.append(res)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        client.cancel([*futures, blob])
    return sorted(got, key=lambda p: p["part"][0])
