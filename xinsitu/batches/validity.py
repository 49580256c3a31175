"""Valid samples only: one streaming pass that marks which samples of a split are valid.

Layer 3. ``compute_validity`` reads the split's samples once, unshuffled, tests each batch
(``"finite"``: no NaN or inf anywhere in the sample as the generator yields it; or a user
predicate on the ``xarray`` batch) and stores the result in the manifest as a compact bitmap
(``manifest.encode_mask``), with the sampling options it was made for. Generators of that split
with the same options then draw only valid samples (``sampling.sampling(valid_only=True)``); other
options raise ``ValueError``.

Without ``client=`` the pass reads through a ``BatchGenerator`` (the same reader and buffers as
training, reading ahead: each chunk once, memory bounded by ``block_chunks``). A share of the pass
(``ValidityPass.part(i, n)``: the samples of the i-th of n shares of the split's units) reads
through the map-style dataset instead, whole units at a time (``InsituDataset.batch``: each chunk
once per call), and gives a JSON-able partial result, its bitmap; ``merge_validity`` puts the
bitmaps of the ``n`` parts end to end. With ``client=`` the parts run on a Dask cluster
(``xinsitu.batches.cluster``). The mask is the same either way: each sample is tested on its own values.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import pickle
import types
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import xarray as xr

from xinsitu.batches.cluster import (
    archive_of,
    check_client,
    job_digest,
    part_arg,
    parts_in_order,
    run_parts,
    selection_of,
    warn_missing,
)
from xinsitu.batches.generator import BatchGenerator
from xinsitu.batches.mapstyle import InsituDataset
from xinsitu.cache.chunk_cache import ChunkCache
from xinsitu.index.manifest import SplitManifest
from xinsitu.index.runs import decode_mask, encode_mask
from xinsitu.index.sampling import check_split, flag, positive_int, sampling, sampling_key
from xinsitu.index.snapshot import snapshot_of_sources

#: samples tested at once (one batch of the pass) at most, and the bytes such a batch may hold:
#: a batch of large patches is cut smaller, so the pass stays within a few buffers' memory
PASS_BATCH = 4096
PASS_BYTES = 64 * 2**20
#: the format of a partial result (``ValidityPass.part``)
PART_VERSION = 1


def _pass_batch(sp: Any) -> int:
    """Samples per batch of the pass: ``PASS_BATCH``, fewer where samples are large."""
    width = {d.name: d.width for d in sp.space.dims}
    nbytes = sum(int(np.prod([width.get(d, n) for d, n in zip(src.dims, src.shape, strict=True)]))
                 * src.dtype.itemsize for src in sp.sources.values())
    return max(1, min(PASS_BATCH, PASS_BYTES // max(nbytes, 1)))


def _finite(batch: dict[str, np.ndarray], n: int, static: frozenset[str]) -> np.ndarray:
    """Per sample of ``batch`` (``n`` samples), whether no value of it is NaN, NaT or infinite; a variable of
    ``static`` (without a sample axis: a land-sea mask) is part of every sample, so it spoils every
    sample or none -- whatever its first dim's length (it may equal ``n``)."""
    ok = np.ones(n, dtype=bool)
    for name, a in batch.items():
        a = np.asarray(a)
        if a.dtype.kind not in "fcmM":
            continue  # integers and bools hold no NaN (times and time spans: NaT, xarray's missing)
        if name in static:
            ok &= bool(np.isfinite(a).all())
        else:
            ok &= np.isfinite(a).reshape(n, -1).all(axis=1)
    return ok


def _predicate(fn: Callable[[xr.Dataset], Any], batch: xr.Dataset, n: int) -> np.ndarray:
    got = np.asarray(fn(batch))
    if got.shape != (n,):
        raise ValueError(f"where: the predicate must return one bool per sample, shape ({n},), "
                         f"got shape {got.shape}")
    if got.dtype != bool:
        raise ValueError(f"where: the predicate must return bools (dtype bool), got dtype {got.dtype}")
    return got


class _PassData(InsituDataset):
    """The map-style dataset a part of the pass reads through: never a torch ``Dataset`` (``InsituDataset``
    itself is one where torch is installed), so a Dask worker running a part does not import torch."""

    def missing_record(self) -> list[Any] | None:
        """Of the chunks read so far, those that had no object (``Reader.missing_record``); None if none."""
        return None if self._loader is None else self._loader.reader.missing_record()


def _where(where: Any) -> tuple[str, str]:
    """``where=`` checked: its label in the mask record, and the output the test takes."""
    if isinstance(where, str):
        if where != "finite":
            raise ValueError(f"where must be 'finite' or a callable predicate, got {where!r}")
        return "finite", "numpy"
    if callable(where):
        return "fn:" + getattr(where, "__qualname__", type(where).__name__), "xarray"
    raise TypeError(f"where must be 'finite' or a callable predicate, got {type(where).__name__} {where!r}")


#: values a predicate reads from its module that go into its digest (not modules, classes or functions)
_VALUES = (bool, int, float, complex, str, bytes, tuple, list, dict, set, frozenset, np.ndarray, np.generic)


def _names(code: types.CodeType) -> set[str]:
    """The global names ``code`` reads, its nested code (comprehensions, inner functions) included."""
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names(c)
    return out


def _stable(v: Any, depth: int = 0) -> bytes:
    """Bytes that stand for ``v`` the same way in every process: a predicate's code, constants, defaults,
    closure values, the module-level values it reads and, for a callable object or a bound method, the
    object's state (``predicate_digest``); another object by its pickle, else its type's name."""
    if depth > 8:
        return b"..."
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return repr(v).encode()
    if isinstance(v, (tuple, list, frozenset, set)):
        items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
        return b"(" + b",".join(_stable(x, depth + 1) for x in items) + b")"
    if isinstance(v, dict):
        return b"{" + b",".join(_stable(k, depth + 1) + b":" + _stable(x, depth + 1)
                                for k, x in sorted(v.items(), key=lambda kv: repr(kv[0]))) + b"}"
    if isinstance(v, np.ndarray):
        h = hashlib.blake2b(np.ascontiguousarray(v).tobytes(), digest_size=8).hexdigest()
        return f"array({v.dtype.str},{v.shape},{h})".encode()
    if isinstance(v, np.generic):
        return repr(v.item()).encode()
    if isinstance(v, types.CodeType):
        return b"code(" + v.co_code + _stable(v.co_consts, depth + 1) + _stable(v.co_names, depth + 1) + b")"
    if isinstance(v, functools.partial):
        return b"partial(" + _stable((v.func, v.args, v.keywords), depth + 1) + b")"
    if isinstance(v, types.MethodType):  # a bound method: its function and the object it is bound to
        return b"method(" + _stable(v.__func__, depth + 1) + _stable(v.__self__, depth + 1) + b")"
    if isinstance(v, types.FunctionType):
        cells = []
        for c in v.__closure__ or ():
            try:
                cells.append(c.cell_contents if c.cell_contents is not v else None)
            except ValueError:  # an empty cell
                cells.append(None)
        # the module-level values it reads (a threshold set in a notebook cell), not modules or functions
        used = {n: v.__globals__[n] for n in sorted(_names(v.__code__))
                if n in v.__globals__ and isinstance(v.__globals__[n], _VALUES)}
        return (f"fn({v.__module__}.{v.__qualname__}".encode() + _stable(v.__code__, depth + 1)
                + _stable(v.__defaults__, depth + 1) + _stable(v.__kwdefaults__, depth + 1)
                + _stable(tuple(cells), depth + 1) + _stable(used, depth + 1) + b")")
    if isinstance(v, (types.BuiltinFunctionType, np.ufunc, type, types.ModuleType)):
        return f"<{getattr(v, '__module__', None)}.{getattr(v, '__qualname__', getattr(v, '__name__', '?'))}>".encode()
    call = vars(type(v)).get("__call__")
    if isinstance(call, types.FunctionType):  # a callable object: its class's __call__ and its state
        state = getattr(v, "__dict__", None)
        return b"object(" + _stable(call, depth + 1) + _stable(state, depth + 1) + b")"
    try:  # a value it closes over (a DataArray mask, a dataclass of thresholds): by its pickle
        return b"pickle(" + hashlib.blake2b(pickle.dumps(v, protocol=4), digest_size=8).digest() + b")"
    except Exception:  # noqa: BLE001 - not picklable: by its type (a predicate over it cannot run on a cluster)
        return f"<{type(v).__module__}.{type(v).__qualname__}>".encode()


def predicate_digest(where: Any) -> str:
    """A short hash of a ``where=`` predicate's code, constants, defaults and closure values: two lambdas,
    or two closures of one factory with other thresholds, share a label (``fn:<lambda>``) but not this,
    so their partial results are never merged. The same in every process that defines it the same way."""
    return hashlib.blake2b(_stable(where), digest_size=8).hexdigest()


class ValidityPass:
    """The validity pass of one split (``compute_validity``), whole (:meth:`run`) or in shares (:meth:`part`).

    Checks every argument when made; pickles (a Dask worker runs a part of a copy that has not run).
    """

    def __init__(self, ds: xr.Dataset, manifest: SplitManifest, split: str, where: Any = "finite",
                 variables: Any = None, *, window: Any = None, patch: Any = None, stride: Any = None,
                 over: Any = None, block_chunks: int = 16, max_inflight: int | None = None,
                 cache: bool | str | os.PathLike[str] | ChunkCache | None = None):
        check_split(manifest, split)
        self.label, self.output = _where(where)
        self.where = where
        self.block_chunks = positive_int("block_chunks", block_chunks)
        # the pass sees every sample: a mask already there must not hide any
        plain = copy.copy(manifest)
        plain.validity = {k: v for k, v in manifest.validity.items() if k != split}
        sp = sampling(ds, plain, split, window=window, patch=patch, stride=stride, over=over, variables=variables,
                      stacklevel=4)
        sp.check_not_empty()
        self.split, self.space = split, sp.space
        self.size = _pass_batch(sp)
        self.key = sampling_key(window, patch, stride, over, sp.geometry.sizes)
        self.total = int(sp.space.n_samples)
        self.variables = list(sp.layouts)
        self.static = frozenset(n for n, lay in sp.layouts.items() if not lay.has_sample_axis)
        self.sources = sp.sources
        self._ds, self._plain = ds, plain
        self._options = dict(window=window, patch=patch, stride=stride, over=over, variables=variables,
                             max_inflight=max_inflight, cache=cache)
        self._data: _PassData | None = None
        #: what identifies this job's partial results (``part``): parts of other jobs are never merged with them
        self.job: dict[str, Any] = {
            "split": split, "manifest": manifest.fingerprint, "blocks": manifest.splits[split].digest(),
            "units": int(sp.space.n_units), "samples": self.total, "snapshot": snapshot_of_sources(sp.sources),
            "variables": self.variables, "where": self.label, "sampling": self.key,
            "where_code": None if isinstance(where, str) else predicate_digest(where),
            "selection": selection_of(sp.sources), "archive": archive_of(sp.sources)}
        self.job_id = job_digest(self.job)
        self._done = False

    def __repr__(self) -> str:
        return (f"<xinsitu.ValidityPass of split {self.split!r}: {self.total} samples in {self.space.n_units} units, "
                f"where={self.label!r}>")

    def _dataset(self) -> _PassData:
        """The map-style dataset a part reads through (made on first use: in the process that reads)."""
        if self._data is None:
            o = self._options
            self._data = _PassData(self._ds, self._plain, self.split, window=o["window"], patch=o["patch"],
                                       stride=o["stride"], over=o["over"], variables=o["variables"],
                                       output=self.output, cache=o["cache"], max_inflight=o["max_inflight"])
        return self._data

    def _test(self, batch: Any, n: int) -> np.ndarray:
        return _finite(batch, n, self.static) if self.output == "numpy" else _predicate(self.where, batch, n)

    def run(self, progress: bool = False) -> np.ndarray:
        """The mask of every sample of the split, through one unshuffled ``BatchGenerator``."""
        self._begin()
        o = self._options
        gen = BatchGenerator(self._ds, self._plain, self.split, batch_size=self.size, shuffle=False,
                             window=o["window"], patch=o["patch"], stride=o["stride"], over=o["over"],
                             variables=o["variables"], output=self.output, block_chunks=self.block_chunks,
                             max_inflight=o["max_inflight"], rank=0, world_size=1, cache=o["cache"],
                             progress=progress)
        mask = np.zeros(self.total, dtype=bool)
        pos = 0
        for batch in gen:  # unshuffled, one rank: global ids 0, 1, 2, ... in order
            n = min(self.size, self.total - pos)
            mask[pos:pos + n] = self._test(batch, n)
            pos += n
        if pos != self.total:  # the generator yields every sample of an unshuffled one-rank epoch
            raise RuntimeError(f"validity pass saw {pos} of {self.total} samples")
        return mask

    def _begin(self) -> None:
        if self._done:
            raise RuntimeError("a ValidityPass runs once; make a new one")
        self._done = True

    def part(self, i: int, n: int, progress: bool = False) -> dict[str, Any]:
        """Test the samples of the ``i``-th of ``n`` shares of the split's units (units ``i*U//n`` to
        ``(i+1)*U//n - 1`` of ``U``, in split order: the samples that start in them); return the JSON-able
        partial result that ``merge_validity`` merges.

        Whole units are read at a time (up to ``block_chunks`` units and the pass's batch of samples, at
        least one unit), each chunk once per read; the next units are read while these are tested.
        """
        i, n = part_arg((i, n))
        self._begin()
        units = self.space.n_units
        a, b = i * units // n, (i + 1) * units // n
        off = self.space.offsets
        s0, s1 = int(off[a]), int(off[b])
        mask = np.zeros(s1 - s0, dtype=bool)
        groups = []
        g = a
        while g < b:  # whole units per read, as many as the batch and block_chunks allow
            fit = int(np.searchsorted(np.asarray(off[g:min(b, g + self.block_chunks) + 1]),
                                      int(off[g]) + self.size, side="right")) - 1
            h = g + max(1, fit)
            groups.append((int(off[g]), int(off[h])))
            g = h
        groups = [(x, y) for x, y in groups if y > x]  # units that hold no sample (a window too long)
        data = self._dataset()
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=s1 - s0, desc=f"validity of {self.split}" + (f", part {i + 1}/{n}" if n > 1 else ""),
                       unit="sample")
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="xinsitu-validity") as ahead:
                nxt = ahead.submit(data.batch, np.arange(*groups[0], dtype=np.int64)) if groups else None
                for k, (x, y) in enumerate(groups):
                    assert nxt is not None
                    batch = nxt.result()
                    nxt = ahead.submit(data.batch, np.arange(*groups[k + 1], dtype=np.int64)) \
                        if k + 1 < len(groups) else None
                    mask[x - s0:y - s0] = self._test(batch, y - x)
                    if bar is not None:
                        bar.update(y - x)
        finally:
            if bar is not None:
                bar.close()
        out = {"xinsitu": "validity_part", "version": PART_VERSION, "job_id": self.job_id, "job": self.job,
               "part": [i, n], "samples": [s0, s1], "mask": encode_mask(mask)}
        if (missing := data.missing_record()) is not None:
            out["missing"] = missing
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_data"] = None  # made again where a part runs
        return state


def merge_validity(parts: Iterable[dict[str, Any] | str], manifest: SplitManifest | None = None) -> dict[str, Any]:
    """Merge the partial results of ``ds.insitu.validity_part`` into what ``validity()`` gives.

    Parameters
    ----------
    parts : iterable of dict (or JSON text)
        The ``n`` parts ``(0, n) .. (n-1, n)`` of one job, each once, in any order.
    manifest : SplitManifest, optional
        Where to store the mask (``manifest.set_validity(split, record)``, as ``validity()`` does); it must
        be the manifest the parts were made with.

    Returns
    -------
    dict
        ``{"split", "valid", "total", "where", "sampling", "record"}``: how many samples are valid of how
        many, and ``record``, the mask record ``m.set_validity(split, record)`` takes.

    Raises
    ------
    ValueError
        Parts of different jobs, a part missing or given twice, a damaged part, or a ``manifest`` the
        parts were not made with.
    """
    got = parts_in_order(parts, "validity_part", PART_VERSION, "merge_validity")
    job = got[0]["job"]
    warn_missing(got, f"validity of split {job['split']!r}")
    masks, pos = [], 0
    for p in got:
        s0, s1 = p.get("samples", [None, None])
        if s0 != pos or not isinstance(s1, int) or s1 < s0:
            raise ValueError(f"merge_validity: part {p['part'][0]} holds samples {p.get('samples')!r}, expected "
                             f"them to start at {pos}")
        mask = decode_mask(p["mask"], f"merge_validity: part {p['part'][0]}")
        if mask.size != s1 - s0:
            raise ValueError(f"merge_validity: part {p['part'][0]}'s mask holds {mask.size} samples, not {s1 - s0}")
        masks.append(mask)
        pos = s1
    if pos != job["samples"]:
        raise ValueError(f"merge_validity: the parts hold {pos} samples, the split has {job['samples']}")
    return _result(job["split"], np.concatenate(masks), job["where"], job["variables"], job["sampling"], manifest,
                   job)


def _result(split: str, mask: np.ndarray, label: str, variables: list[str], key: dict[str, Any],
            manifest: SplitManifest | None, job: dict[str, Any] | None = None) -> dict[str, Any]:
    """The mask record, stored in ``manifest`` (checked against the job's where given), and the summary."""
    record = {"where": label, "variables": list(variables), "sampling": key, **encode_mask(mask)}
    if mask.size and not record["valid"]:  # batches of the split would raise "holds no valid sample"
        warnings.warn(f"validity of split {split!r}: no sample of {mask.size} is valid (where={label!r} on "
                      f"{list(variables)}); batches of this split will have none to draw. A NaN anywhere in a "
                      "sample makes it invalid for 'finite': name the variables to test (variables=[...]) or "
                      "pass a predicate (where=fn)", UserWarning, stacklevel=4)
    if manifest is not None:
        if job is not None and (split not in manifest.splits or manifest.fingerprint != job["manifest"]
                                or manifest.splits[split].digest() != job["blocks"]):
            raise ValueError(f"merge_validity: the parts were made with another manifest (split {split!r} "
                             "differs, or the manifest's grid); pass the manifest they were made with")
        manifest.set_validity(split, record)
    return {"split": split, "valid": record["valid"], "total": int(mask.size), "where": label, "sampling": key,
            "record": record}


def compute_validity(ds: xr.Dataset, manifest: SplitManifest, split: str, where: Any = "finite",
                     variables: Any = None, *, window: Any = None, patch: Any = None, stride: Any = None,
                     over: Any = None, block_chunks: int = 16, max_inflight: int | None = None,
                     cache: bool | str | os.PathLike[str] | ChunkCache | None = None, client: Any = None,
                     progress: bool = False) -> dict[str, Any]:
    """Mark the valid samples of ``split`` and store the mask in ``manifest`` (see the accessor's
    ``validity``); returns ``{"split", "valid", "total", "where", "sampling", "record"}``."""
    progress = flag("progress", progress)
    if client is not None:
        check_client(client, cache)
    vp = ValidityPass(ds, manifest, split, where, variables, window=window, patch=patch, stride=stride, over=over,
                      block_chunks=block_chunks, max_inflight=max_inflight, cache=cache)
    if client is None:
        return _result(split, vp.run(progress=progress), vp.label, vp.variables, vp.key, manifest)
    parts = run_parts(client, vp, vp.space.n_units, vp.sources, what=f"validity of split {split!r}",
                      progress=progress)
    return merge_validity(parts, manifest)


def validity_part(ds: xr.Dataset, manifest: SplitManifest, split: str, where: Any = "finite", variables: Any = None,
                  *, part: tuple[int, int], window: Any = None, patch: Any = None, stride: Any = None,
                  over: Any = None, block_chunks: int = 16, max_inflight: int | None = None,
                  cache: bool | str | os.PathLike[str] | ChunkCache | None = None,
                  progress: bool = False) -> dict[str, Any]:
    """The partial result of share ``part = (i, n)`` of ``compute_validity`` (see ``ValidityPass.part``)."""
    i, n = part_arg(part)
    return ValidityPass(ds, manifest, split, where, variables, window=window, patch=patch, stride=stride, over=over,
                        block_chunks=block_chunks, max_inflight=max_inflight,
                        cache=cache).part(i, n, progress=flag("progress", progress))
