"""Compact JSON encodings of index sets: a manifest's chunk blocks, chunk edges and masks, in O(runs).

Layer 1 (no I/O). ``Blocks``: a split's chunk blocks (flat ids) held as runs of consecutive ids;
``encode_steps``/``decode_steps``: an increasing int array (a grid's chunk edges) as runs of equal
steps; ``_encode_owner``/``_decode_owner``: one owner per chunk block, bit-packed and compressed (a
scattered split on disk); ``encode_mask``/``decode_mask``: a split's valid-sample bitmap
(``ds.insitu.validity``). ``manifest.SplitManifest`` holds and writes them.
"""

from __future__ import annotations

import base64
import bz2
import hashlib
import weakref
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np


# ----------------------------------------------------------------------------- compact block sets
class Blocks(Sequence):
    """Flat chunk-block ids of one split, in split order, held as runs ``[start, stop)`` of
    consecutive ids: a contiguous split of 10^7 chunks is two numbers.

    Reads like the list of ids it stands for (``len``, iteration, indexing, ``np.asarray``,
    ``==`` with a list); ``ids()`` gives them as an int64 array.
    """

    __slots__ = ("starts", "stops", "_len", "_digest")

    def __init__(self, starts: Any, stops: Any):
        self.starts = np.array(starts, dtype=np.int64).reshape(-1)
        self.stops = np.array(stops, dtype=np.int64).reshape(-1)
        self.starts.setflags(write=False)
        self.stops.setflags(write=False)
        self._len = int((self.stops - self.starts).sum())
        self._digest: str | None = None

    @classmethod
    def from_ids(cls, ids: Any) -> Blocks:
        """Runs of the ids ``ids`` (kept in their order)."""
        if isinstance(ids, Blocks):
            return ids
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if not len(ids):
            return cls([], [])
        brk = np.flatnonzero(ids[1:] != ids[:-1] + 1) + 1
        return cls(ids[np.concatenate([[0], brk])], ids[np.concatenate([brk - 1, [len(ids) - 1]])] + 1)

    @classmethod
    def range(cls, start: int, stop: int) -> Blocks:
        return cls([start], [stop]) if stop > start else cls([], [])

    @property
    def nruns(self) -> int:
        return len(self.starts)

    def ids(self) -> np.ndarray:
        """The block ids as a new int64 array."""
        if self.nruns == 1:
            return np.arange(self.starts[0], self.stops[0], dtype=np.int64)
        lengths = self.stops - self.starts
        offsets = np.cumsum(lengths) - lengths
        return np.repeat(self.starts - offsets, lengths) + np.arange(self._len, dtype=np.int64)

    def ascending(self) -> bool:
        """Whether the ids are strictly increasing (split order is block order)."""
        return bool((self.starts[1:] >= self.stops[:-1]).all()) and bool((self.stops > self.starts).all())

    def bounds(self) -> tuple[int, int]:
        """Smallest and largest id."""
        keep = self.stops > self.starts
        return int(self.starts[keep].min()), int(self.stops[keep].max()) - 1

    def digest(self) -> str:
        """A hash of the ids (of their runs), computed once."""
        if self._digest is None:
            h = hashlib.sha256(b"xinsitu.Blocks")
            h.update(self.starts.tobytes())
            h.update(self.stops.tobytes())
            self._digest = h.hexdigest()
        return self._digest

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        for a, b in zip(self.starts.tolist(), self.stops.tolist(), strict=True):
            yield from range(a, b)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return Blocks.from_ids(self.ids()[i])
        i = int(i)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"block index {i} out of range for {self._len} blocks")
        ends = np.cumsum(self.stops - self.starts)
        r = int(np.searchsorted(ends, i, side="right"))
        return int(self.stops[r] - (ends[r] - i))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.ids()
        return a if dtype is None else a.astype(dtype)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Blocks):
            mine, theirs = self._nonempty(), other._nonempty()
            return np.array_equal(mine.starts, theirs.starts) and np.array_equal(mine.stops, theirs.stops)
        if isinstance(other, (list, tuple, np.ndarray)):
            return len(other) == self._len and bool(np.array_equal(self.ids(), np.asarray(other)))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def _nonempty(self) -> Blocks:
        keep = self.stops > self.starts
        return self if keep.all() else Blocks(self.starts[keep], self.stops[keep])

    def __repr__(self) -> str:
        return f"Blocks({self._len} ids in {self.nruns} run{'s' if self.nruns != 1 else ''})"

    def to_json(self) -> list[list[int]]:
        return np.stack([self.starts, self.stops], axis=1).tolist()


#: positions per pass of ``encode_steps`` (its temporaries are a few of these, not of the array)
_STEP_BLOCK = 1 << 20


def encode_steps(values: np.ndarray) -> list[list[int]]:
    """An increasing int array as runs of equal steps ``[first, step, count]`` (a regular chunk
    grid of any length is two runs). In bounded passes: no temporary the size of ``values``."""
    v = np.asarray(values, dtype=np.int64)
    n = len(v)
    if n < 2:
        return [[int(x), 0, 1] for x in v]
    parts = [np.zeros(1, np.int64)]  # where the step d[k] = v[k+1] - v[k] changes (k in 1..n-2), by blocks of k
    for i in range(0, n - 2, _STEP_BLOCK):
        d = np.diff(v[i:i + _STEP_BLOCK + 2])
        parts.append(np.flatnonzero(d[1:] != d[:-1]) + (i + 1))
    starts = np.concatenate(parts)
    counts = np.diff(np.append(starts, n))
    steps = v[starts + 1] - v[starts]  # (every start is at most n - 2)
    return np.stack([v[starts], steps, counts], axis=1).tolist()


_STEPS: dict[int, tuple[Any, list[list[int]]]] = {}


def steps_of(values: Any) -> list[list[int]]:
    """``encode_steps(values)``, remembered for a read-only array (a manifest's or geometry's edges):
    the fingerprint and every ``to_json`` of a 10^7-chunk grid share one pass over it."""
    if not isinstance(values, np.ndarray) or values.flags.writeable:
        return encode_steps(values)
    key = id(values)
    hit = _STEPS.get(key)
    if hit is None or hit[0]() is not values:
        def forget(_: Any, k: int = key) -> None:
            _STEPS.pop(k, None)

        hit = (weakref.ref(values, forget), encode_steps(values))
        _STEPS[key] = hit
    return [list(r) for r in hit[1]]  # a copy: the caller may edit it


#: the bounds of an int64: every integer a manifest gives is checked against them before numpy holds it
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def steps_length(runs: Any, what: str) -> int:
    """How many values the runs of equal steps ``runs`` (``encode_steps``) stand for, checked without
    decoding them (types, ``count >= 1``, ``step >= 0``, every value an int64): ``ValueError`` naming ``what``."""
    if not isinstance(runs, list) or not all(isinstance(r, list) and len(r) == 3 and all(_is_int(x) for x in r)
                                             for r in runs):
        raise ValueError(f"{what} must be a list of [first, step, count] integer triples")
    if any(r[2] < 1 or r[1] < 0 for r in runs):
        raise ValueError(f"{what}: each [first, step, count] needs count >= 1 and step >= 0")
    if any(not INT64_MIN <= a <= INT64_MAX or a + s * (n - 1) > INT64_MAX for a, s, n in runs):
        raise ValueError(f"{what}: a [first, step, count] goes past the 64-bit integers")
    return sum(n for _, _, n in runs)


def decode_steps(runs: Any, what: str, limit: int | None = None) -> np.ndarray:
    """The int array ``encode_steps`` encoded; ``ValueError`` naming ``what`` on a malformed one, or on
    one of more than ``limit`` values (checked before anything is allocated)."""
    total = steps_length(runs, what)
    if limit is not None and total > limit:
        raise ValueError(f"{what}: the runs hold {total} values, more than the {limit} expected")
    if len(runs) < 1000:  # one array, each run filled in place (a, s, s, ... summed): no temporary of its size
        out = np.empty(total, dtype=np.int64)
        i = 0
        for a, s, n in runs:
            seg = out[i:i + n]
            seg.fill(s)
            seg[0] = a
            np.cumsum(seg, out=seg)
            i += n
        return out
    r = np.asarray(runs, dtype=np.int64)
    pos = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(r[:, 2]) - r[:, 2], r[:, 2])
    return np.repeat(r[:, 0], r[:, 2]) + np.repeat(r[:, 1], r[:, 2]) * pos


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _owner_bits(nsplits: int) -> int:
    """Bits per chunk block in the compressed owner array: room for each split and 'left out'."""
    return next(b for b in (1, 2, 4, 8) if nsplits < (1 << b))


def _encode_owner(owner: np.ndarray, nsplits: int) -> dict[str, Any]:
    """A per-block owner array (split index, ``nsplits`` or more where no split holds the block) as
    JSON: packed to the fewest bits that hold every owner (2 for three splits), then zlib, base64."""
    bits = _owner_bits(nsplits)
    left = (1 << bits) - 1
    own = np.where(owner < nsplits, owner, left).astype(np.uint8)
    per = 8 // bits
    own = np.concatenate([own, np.zeros(-len(own) % per, np.uint8)]).reshape(-1, per)
    packed = np.zeros(len(own), np.uint8)
    for j in range(per):
        packed |= own[:, j] << np.uint8(8 - bits * (j + 1))
    # bz2 and base85: a random 5-way split of 10^7 chunk blocks in 3.7 MB of JSON (zlib and base64: 4.3)
    raw = bz2.compress(packed.tobytes(), 9)
    return {"encoding": "bz2+base85", "bits": bits, "left_out": left, "length": int(len(owner)),
            "data": base64.b85encode(raw).decode("ascii")}


_OWNER_ENCODINGS = ("bz2+base85", "zlib+base64")


def _decode_owner(d: Any, n: int) -> np.ndarray:
    """The owner array of ``_encode_owner``'s JSON (``left_out`` where no split holds a block)."""
    if (not isinstance(d, dict) or d.get("encoding") not in _OWNER_ENCODINGS or d.get("bits") not in (1, 2, 4, 8)
            or d.get("left_out") != (1 << d["bits"]) - 1 or not isinstance(d.get("data"), str)):
        raise ValueError("manifest 'owner' must be {'encoding': 'bz2+base85' (or 'zlib+base64'), 'bits': 1|2|4|8, "
                         "'left_out': 2**bits - 1, 'length': n, 'data': str}")
    if d.get("length") != n:
        raise ValueError(f"manifest 'owner' holds {d.get('length')!r} chunk blocks, the grid has {n}")
    bits = d["bits"]
    per = 8 // bits
    size = -(-n // per)
    try:  # at most the bytes expected (and one more, to tell too many): a damaged file costs no memory
        if d["encoding"] == "zlib+base64":  # (manifests written before bz2+base85)
            raw = zlib.decompressobj().decompress(base64.b64decode(d["data"], validate=True), size + 1)
        else:
            raw = bz2.BZ2Decompressor().decompress(base64.b85decode(d["data"]), size + 1)
    except (ValueError, OSError, EOFError, zlib.error) as e:
        raise ValueError(f"manifest 'owner' data cannot be decoded: {e}") from None
    if len(raw) != size:
        raise ValueError(f"manifest 'owner' data decodes to {len(raw)} bytes, {size} expected for {n} chunk blocks")
    packed = np.frombuffer(raw, dtype=np.uint8)
    if per == 1:
        return packed
    mask = np.uint8((1 << bits) - 1)
    own = np.stack([(packed >> np.uint8(8 - bits * (j + 1))) & mask for j in range(per)], axis=1)
    return own.reshape(-1)[:n]


# ----------------------------------------------------------------------------- valid-sample masks
#: the sampling options a mask was made for (compared with a generator's before the mask is used)
MASK_SAMPLING = ("window", "patch", "stride", "over")


def encode_mask(mask: np.ndarray) -> dict[str, Any]:
    """A bool mask over a split's samples as JSON-able fields: its length, how many are valid,
    a digest and the bitmap (``np.packbits``, zlib, base64): 10^7 samples take ~1.3 MB at worst
    and far less for the runs that ocean tiles or NaN stretches make."""
    mask = np.asarray(mask, dtype=bool).ravel()
    raw = np.packbits(mask).tobytes()
    return {"n": int(mask.size), "valid": int(mask.sum()), "digest": hashlib.sha256(raw).hexdigest()[:16],
            "bitmap": base64.b64encode(zlib.compress(raw, 6)).decode("ascii")}


#: samples a valid-sample mask may claim: a bitmap of 2**40 samples is 128 GiB, far past any split
MAX_MASK = 1 << 40


def decode_mask(record: dict[str, Any], what: str = "validity") -> np.ndarray:
    """The bool mask of an ``encode_mask`` record; ``ValueError`` naming ``what`` if it is damaged."""
    got: Any = record.get("n")
    if not _is_int(got) or got < 0:
        raise ValueError(f"{what}: 'n' must be a non-negative integer, got {got!r}")
    n = int(got)
    if n > MAX_MASK:
        raise ValueError(f"{what}: 'n' ({n}) is more samples than a mask holds (at most {MAX_MASK})")
    size = (n + 7) // 8
    try:  # at most the bytes expected (and one more, to tell too many): a damaged or forged bitmap costs no memory
        inflate = zlib.decompressobj()
        raw = inflate.decompress(base64.b64decode(record["bitmap"], validate=True), size + 1)
        if len(raw) <= size and not inflate.eof:
            raise zlib.error("incomplete or truncated stream")
    except (KeyError, TypeError, ValueError, zlib.error) as e:
        raise ValueError(f"{what}: 'bitmap' is not a base64 zlib bitmap ({e})") from None
    if len(raw) != size:
        held = f"more than {8 * size}" if len(raw) > size else str(8 * len(raw))
        raise ValueError(f"{what}: the bitmap holds {held} bits, not the {n} samples it claims "
                         f"(wrong length: made for another split or sampling?)")
    mask = np.unpackbits(np.frombuffer(raw, np.uint8), count=n).astype(bool)
    if record.get("valid") != int(mask.sum()):
        raise ValueError(f"{what}: 'valid' ({record.get('valid')!r}) does not match the bitmap ({int(mask.sum())})")
    if record.get("digest") != hashlib.sha256(raw).hexdigest()[:16]:
        raise ValueError(f"{what}: 'digest' does not match the bitmap (the file was edited or damaged)")
    return mask


def check_mask_record(record: Any, what: str) -> None:
    """Validate a mask record (fields, types, bitmap length): ``ValueError`` naming ``what``."""
    if not isinstance(record, dict):
        raise ValueError(f"{what} must be a dict (an encode_mask record), got {type(record).__name__}")
    sampling = record.get("sampling")
    if not isinstance(sampling, dict) or set(sampling) != set(MASK_SAMPLING):
        raise ValueError(f"{what}: 'sampling' must give {list(MASK_SAMPLING)}, got {sampling!r}")
    if not isinstance(record.get("where"), str):
        raise ValueError(f"{what}: 'where' must be a str, got {record.get('where')!r}")
    decode_mask(record, what)
