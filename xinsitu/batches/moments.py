"""The moments of chunks' values per channel, and their exact sums: the arithmetic of ``stats``' pass.

``chunk_moments`` reduces one channel's values in a chunk to (count, NaN count, mean, M2, min, max), and
``channel_moments`` the channels of a chunk at once, in the decode thread that decoded it (see ``Moments``
for how, and how accurate). The moments of the pieces are added up *exactly* (``ChannelSums``: integer
sums of the pieces' ``n * mean`` and ``M2 + n * mean**2``, rounded once at the end), so the result does
not depend on the order the pieces arrive in nor on how they are grouped. Nothing here reads or waits:
``stats`` reads the chunks and hands their values in, so this arithmetic is checked against numpy alone.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

#: the keys every variable's entry has
STAT_KEYS = ("mean", "std", "min", "max", "nan_count")
#: values per partial sum of deviations (float32 sums for float32 values, see ``Moments``)
ROW = 1024
#: spans (max - min) of float32 values reduced in float32 partial sums: their squares neither
#: overflow nor fall to where float32 keeps too few digits; other spans are reduced in float64
F32_SPAN = (1e-10, 5e17)


# ----------------------------------------------------------------------------- exact sums
def _exact(x: float) -> tuple[int, int]:
    """A finite float as ``(m, e)`` with ``x == m * 2**e`` exactly (``m`` odd, or 0)."""
    num, den = x.as_integer_ratio()
    if not num:
        return 0, 0
    tz = (num & -num).bit_length() - 1
    return num >> tz, tz + 1 - den.bit_length()


def _plus(acc: tuple[int, int], m: int, e: int) -> tuple[int, int]:
    """``acc + m * 2**e``, exactly (``acc`` is ``(m, e)`` too)."""
    am, ae = acc
    if not m:
        return acc
    if not am:
        return m, e
    if e < ae:
        return (am << (ae - e)) + m, e
    return am + (m << (e - ae)), ae


def _ratio(m: int, e: int, d: int) -> float:
    """``m * 2**e / d`` rounded once (Python's division of integers is correctly rounded)."""
    try:
        return (m << e) / d if e >= 0 else m / (d << -e)
    except OverflowError:
        return math.copysign(math.inf, m)


def _exact_text(acc: tuple[int, int]) -> str:
    m, e = acc
    if m:
        tz = (m & -m).bit_length() - 1
        m, e = m >> tz, e + tz
    return f"{m:x}p{e}"


def _exact_parse(s: Any, what: str) -> tuple[int, int]:
    try:
        m, e = s.split("p")
        return int(m, 16), int(e)
    except (AttributeError, ValueError):
        raise ValueError(f"{what}: {s!r} is not an exact sum ('<hex>p<exponent>')") from None


def _float_text(x: float | None) -> str | int | None:
    """A float as ``float.hex`` (exact, and no NaN or infinity in the JSON); an integer's min or max as it is."""
    return None if x is None else x if isinstance(x, int) else float.hex(x)


def _float_parse(s: Any, what: str) -> float | None:
    if s is None or (isinstance(s, int) and not isinstance(s, bool)):
        return s
    try:
        return float.fromhex(s)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: {s!r} is not a float written by float.hex") from None


class ChannelSums:
    """The statistics of one channel over many pieces, added up exactly.

    Each piece gives ``chunk_moments``: count, NaN count, mean, M2, min, max. The sums kept are
    integers (as ``(m, e)``: ``m * 2**e``) of ``n * mean`` and of ``M2 + n * mean**2`` over the
    pieces, which a float gives exactly; the result rounds once: ``mean = S1 / N`` and
    ``var = (N * S2 - S1**2) / N**2`` (Chan, Golub & LeVeque's pairwise update in closed form,
    evaluated without rounding). So pieces added in any order and grouping -- one pass, or parts
    merged on a cluster -- give the same bits. Pieces whose mean or M2 is not finite (infinite
    values) are counted aside: the mean is then +-inf or NaN and the std NaN, as numpy's. Min and
    max are exact (of two zeros, min takes -0.0 and max +0.0, whatever the order).
    """

    __slots__ = ("count", "nan_count", "min", "max", "s1", "s2", "odd")
    #: what ``odd`` counts: pieces with a +inf, -inf or NaN mean, with a NaN or an infinite M2
    ODD = ("mean_pinf", "mean_ninf", "mean_nan", "m2_nan", "m2_inf")

    def __init__(self) -> None:
        self.count = 0
        self.nan_count = 0
        self.min: float | None = None
        self.max: float | None = None
        self.s1 = (0, 0)
        self.s2 = (0, 0)
        self.odd = [0, 0, 0, 0, 0]

    def add(self, count: int, nan_count: int, mean: float, m2: float, lo: float, hi: float) -> None:
        """Add one piece's moments (``chunk_moments``' order)."""
        self.nan_count += int(nan_count)
        if not count:
            return
        self.count += int(count)
        self._extremes(*((lo, hi) if isinstance(lo, int) else (float(lo), float(hi))))
        mean, m2 = float(mean), float(m2)
        if not math.isfinite(mean):
            self.odd[2 if mean != mean else 0 if mean > 0 else 1] += 1
            return
        k, f = _exact(mean)
        self.s1 = _plus(self.s1, count * k, f)
        self.s2 = _plus(self.s2, count * k * k, 2 * f)
        if math.isfinite(m2):
            self.s2 = _plus(self.s2, *_exact(m2))
        else:
            self.odd[3 if m2 != m2 else 4] += 1

    def merge(self, other: ChannelSums) -> None:
        """Add another set of pieces' sums."""
        self.count += other.count
        self.nan_count += other.nan_count
        if other.count:
            self._extremes(other.min, other.max)  # type: ignore[arg-type]  # set where count > 0
        self.s1 = _plus(self.s1, *other.s1)
        self.s2 = _plus(self.s2, *other.s2)
        self.odd = [a + b for a, b in zip(self.odd, other.odd, strict=True)]

    def _extremes(self, lo: float, hi: float) -> None:
        a, b = self.min, self.max
        if a is None or lo < a or (lo == a and math.copysign(1.0, lo) < math.copysign(1.0, a)):
            self.min = lo
        if b is None or hi > b or (hi == b and math.copysign(1.0, hi) > math.copysign(1.0, b)):
            self.max = hi

    def result(self) -> tuple[float | None, float | None, float | None, float | None]:
        """(mean, std (ddof=0), min, max); None where no value was seen."""
        n = self.count
        if not n:
            return None, None, None, None
        pinf, ninf, nanm, nan2, inf2 = self.odd
        if nanm or (pinf and ninf):
            mean = math.nan
        elif pinf or ninf:
            mean = math.inf if pinf else -math.inf
        else:
            mean = _ratio(*self.s1, n)
        if pinf or ninf or nanm or nan2:
            std = math.nan
        elif inf2:
            std = math.inf
        else:
            (m1, e1), (m2, e2) = self.s1, self.s2
            e = min(e2, 2 * e1)
            num = n * (m2 << (e2 - e)) - ((m1 * m1) << (2 * e1 - e))  # >= 0: Cauchy-Schwarz, exactly
            std = math.sqrt(max(_ratio(num, e, n * n), 0.0))
        return mean, std, self.min, self.max

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (no NaN or infinity: floats as ``float.hex``, the sums as ``<hex>p<exponent>``)."""
        return {"count": self.count, "nan_count": self.nan_count, "min": _float_text(self.min),
                "max": _float_text(self.max), "s1": _exact_text(self.s1), "s2": _exact_text(self.s2),
                "odd": list(self.odd)}

    @classmethod
    def from_json(cls, d: Any, what: str) -> ChannelSums:
        """Read ``to_json``'s record; ``ValueError`` naming ``what`` where it is damaged."""
        if not isinstance(d, dict):
            raise ValueError(f"{what}: expected a dict of sums, got {type(d).__name__}")
        s = cls()
        try:
            s.count, s.nan_count = int(d["count"]), int(d["nan_count"])
            s.min, s.max = _float_parse(d["min"], what), _float_parse(d["max"], what)
            s.s1, s.s2 = _exact_parse(d["s1"], what), _exact_parse(d["s2"], what)
            s.odd = [int(x) for x in d["odd"]]
        except (KeyError, TypeError) as e:
            raise ValueError(f"{what}: damaged sums ({type(e).__name__}: {e})") from None
        if len(s.odd) != len(cls.ODD) or s.count < 0 or s.nan_count < 0 or ((s.min is None) != (s.count == 0)):
            raise ValueError(f"{what}: damaged sums {d!r}")
        return s


# ----------------------------------------------------------------------------- moments
class Moments:
    """Per-channel statistics of a variable: count, mean, std, min, max and NaN count.

    :meth:`reduce` sets a channel to the moments of some values (a chunk's, see
    ``chunk_moments``). The mean is a float64 sum, as numpy's. The deviations from it
    (rounded to the grid of the largest value, so little cancels and their rounding is
    unbiased) are squared and summed in partial sums of ``ROW`` values -- float32 sums
    for float32 data, one BLAS dot product per ``ROW`` -- which are added in float64:
    the std is within about 1e-9 of numpy's float64 std; 4e-8 (relative) on rare outliers.
    Integers, float16, infinities and float32 spans outside ``F32_SPAN`` are reduced in
    float64 throughout. The moments of many chunks are combined by :meth:`combine` in
    ``ChannelSums``, exactly: the same values give the same bits every run, in any order
    and grouping of the pieces.
    """

    def __init__(self, n_channels: int):
        self.sums = [ChannelSums() for _ in range(n_channels)]

    @classmethod
    def of(cls, x: np.ndarray) -> Moments:
        """The moments of ``x``, shaped ``(channels, values...)`` (any real dtype; NaNs counted, left out)."""
        m = cls(x.shape[0])
        for c in range(x.shape[0]):
            m.reduce(c, x[c])
        return m

    def reduce(self, c: int, values: np.ndarray) -> None:
        """Set channel ``c`` to the moments of ``values`` (any shape and strides; NaNs counted, left out)."""
        self.sums[c] = ChannelSums()
        self.sums[c].add(*chunk_moments(values))

    @classmethod
    def combine(cls, n_channels: int, parts: list[tuple[int, tuple[int, int, float, float, float, float]]]) -> Moments:
        """The moments of many pieces at once: ``parts`` is ``[(channel, chunk_moments(...)), ...]``, added
        exactly (``ChannelSums``): the result depends neither on the order of the pieces nor on how they
        are grouped, only on how the values were cut into pieces (each piece's own rounding)."""
        m = cls(n_channels)
        for c, part in parts:
            m.sums[c].add(*part)
        return m

    def result(self) -> dict[str, list[Any]]:
        """Per channel: mean, std (ddof=0), min, max, nan_count, count; None where no value was seen."""
        out: dict[str, list[Any]] = {k: [] for k in (*STAT_KEYS, "count")}
        for s in self.sums:
            mean, std, lo, hi = s.result()
            out["mean"].append(mean)
            out["std"].append(std)
            out["min"].append(lo)
            out["max"].append(hi)
            out["nan_count"].append(s.nan_count)
            out["count"].append(s.count)
        return out


_scratch = threading.local()
_SPANS = {np.dtype(np.float32): F32_SPAN, np.dtype(np.float64): (1e-100, 1e100)}
_NONE = (0, 0, math.nan, math.nan, math.nan, math.nan)
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_min, _max, _sum, _sub, _vecdot, _einsum = (np.minimum.reduce, np.maximum.reduce, np.add.reduce, np.subtract,
                                             np.vecdot, np.einsum)


def chunk_moments(values: np.ndarray, scratch: bool = False) -> tuple[int, int, float, float, float, float]:
    """(count, nan_count, mean, M2, min, max) of ``values`` (any real dtype, shape and strides), NaNs
    counted and left out; mean, M2, min and max NaN where no value is left. See ``Moments``.

    ``scratch=True`` lets it overwrite ``values`` (a chunk the reader decoded for nothing else):
    one buffer fewer to stream through cache.
    """
    if values.size == 0:
        return _NONE
    spans = _SPANS.get(values.dtype)
    if spans is None:
        return _exact_moments(values)
    lo, hi = _min(values, axis=None), _max(values, axis=None)  # NaN where any value is NaN
    nans = 0
    if lo != lo:
        ok = ~np.isnan(values)
        values = values[ok]  # a copy
        nans = ok.size - values.size
        if values.size == 0:
            return (0, nans, *_NONE[2:])
        lo, hi = _min(values), _max(values)
    lo, hi = float(lo), float(hi)
    span = hi - lo
    if span == 0:
        return values.size, nans, lo, 0.0, lo, hi
    if not spans[0] <= span <= spans[1]:  # also infinities
        n, _, mean, m2, lo, hi = _exact_moments(values)
        return n, nans, mean, m2, lo, hi
    mean, m2 = _centred_moments(values, scratch or nans > 0, max(-lo, hi))  # values[ok] is a copy
    return values.size, nans, mean, m2, lo, hi


def channel_moments(values: np.ndarray, scratch: bool = False) -> list[tuple[int, int, float, float, float, float]]:
    """``chunk_moments`` of each row of ``values`` (``(channels, n)``, C-contiguous): the channels of a
    chunk (13 pressure levels) reduced by a handful of numpy calls for all of them, not a dozen per
    channel. Each call lets go of the GIL and takes it back, and where two decode threads reduce
    chunks the hand-offs cost more than the arithmetic. Rows with a NaN, a span outside ``_SPANS`` or
    no spread go ``chunk_moments``' way, one by one; the others get the same arithmetic, so the same
    values give the same bits every run (``scratch``: as ``chunk_moments``)."""
    c, n = values.shape
    spans = _SPANS.get(values.dtype)
    if spans is None or not c or not n:
        return [chunk_moments(row, scratch) for row in values]
    lo, hi = _min(values, axis=1), _max(values, axis=1)
    span = hi.astype(np.float64) - lo
    if not np.all((span >= spans[0]) & (span <= spans[1])):  # also NaN and infinities: row by row
        return [chunk_moments(row, scratch) for row in values]
    dt = values.dtype
    mean = _einsum("ij->i", values, dtype=np.float64) / n
    grid = np.spacing(np.maximum(-lo, hi))  # in the values' dtype, as ``_centred_moments``'
    shift = (np.round(mean / grid) * grid).astype(dt)
    if scratch and values.flags.writeable:
        dev = _sub(values, shift[:, None], out=values)
    else:
        dev = _sub(values, shift[:, None], out=_deviations(c * n, dt).reshape(c, n))
    body = n - n % ROW
    s2 = _sum(_vecdot(dev[:, :body].reshape(c, -1, ROW), dev[:, :body].reshape(c, -1, ROW)), axis=1,
              dtype=np.float64)
    if body < n:
        s2 += _vecdot(dev[:, body:], dev[:, body:])
    off = mean - shift
    m2 = np.maximum(s2 - n * off * off, 0.0)
    return [(n, 0, float(mean[k]), float(m2[k]), float(lo[k]), float(hi[k])) for k in range(c)]


def _exact_moments(values: np.ndarray) -> tuple[int, int, float, float, float, float]:
    """``chunk_moments`` in float64 throughout (integers, float16, extreme spans, infinities)."""
    v = values.astype(np.float64).ravel()  # a copy: the values passed in are never written
    ok = ~np.isnan(v)
    nans = v.size - int(np.count_nonzero(ok))
    if nans:
        v = v[ok]
        if v.size == 0:
            return (0, nans, *_NONE[2:])
    mean = float(v.sum()) / v.size
    lo: float
    hi: float
    if values.dtype.kind in "iu":  # an integer's min and max as Python ints: exact beyond 2**53, as xarray's
        lo, hi = int(_min(values, axis=None)), int(_max(values, axis=None))
    else:
        lo, hi = float(v.min()), float(v.max())
    with np.errstate(invalid="ignore"):  # an infinity: mean and std are not finite, as numpy's
        v -= mean
    return v.size, nans, mean, float(np.dot(v, v)), lo, hi


def _deviations(n: int, dtype: np.dtype) -> np.ndarray:
    """This thread's reused buffer of ``n`` values, 64-byte aligned (the dot products then sum in the
    same order wherever the values lie: the same bits)."""
    buf = getattr(_scratch, dtype.name, None)
    if buf is None or buf.size < n:
        raw = np.empty(n * dtype.itemsize + 64, np.uint8)
        off = -raw.ctypes.data % 64
        buf = raw[off:off + n * dtype.itemsize].view(dtype)
        setattr(_scratch, dtype.name, buf)
    return buf[:n]


def _centred_moments(values: np.ndarray, scratch: bool, top: float) -> tuple[float, float]:
    """(mean, M2) of finite float ``values`` (float32 or float64, any shape, largest magnitude ``top``;
    overwritten where ``scratch``), see ``Moments``."""
    n, dt = values.size, values.dtype
    # the mean from a float64 sum, as numpy's (float32 partial sums would leave 1e-10 of the spread in
    # it: more than 1e-6 of a mean near zero)
    flat = values.reshape(-1) if values.flags.c_contiguous else values
    mean = float(_einsum(_LETTERS[:flat.ndim] + "->", flat, dtype=np.float64)) / n
    # the deviations are taken from the mean rounded to the grid of the largest value: then each one is
    # exact or rounds on its value's own low bits, and their rounding errors cancel out instead of all
    # dropping the same low bits of the shift (a bias)
    grid = float(np.spacing(dt.type(top)))
    shift = dt.type(round(mean / grid) * grid)
    if scratch and values.flags.writeable and values.flags.c_contiguous:  # deviations in place
        dev = _sub(flat, shift, out=flat)
    else:
        dev = _deviations(n, dt)
        _sub(values, shift, out=dev.reshape(values.shape))
    # the squares of the deviations from the (coarse) mean, summed in float32 partial sums of ROW
    body = n - n % ROW
    rows = dev[:body].reshape(-1, ROW)
    s2 = float(_sum(_vecdot(rows, rows), dtype=np.float64))
    if body < n:  # the last, partial row
        tail = dev[body:]
        s2 += float(_vecdot(tail, tail))
    off = mean - float(shift)
    return mean, max(s2 - n * off * off, 0.0)


def _channel_rows(values: np.ndarray, chans: list[tuple[int, tuple[Any, ...] | None]]) -> np.ndarray | None:
    """``values`` as ``(channels, n)`` rows, one per entry of ``chans`` in order, where each channel is
    one index along one axis, all of it in order and nothing but size-1 axes before it (a chunk of one
    time step and its levels, C-contiguous); else None."""
    if len(chans) < 2 or not values.flags.c_contiguous:
        return None
    first = chans[0][1]
    if first is None:
        return None
    axes = [k for k, x in enumerate(first) if not isinstance(x, slice)]
    if len(axes) != 1 or any(x != slice(None) for x in first if isinstance(x, slice)):
        return None
    ax = axes[0]
    if values.shape[ax] != len(chans) or any(values.shape[k] != 1 for k in range(ax)) \
            or any(sel is None or sel[ax] != k for k, (_, sel) in enumerate(chans)):
        return None
    return values.reshape(len(chans), -1)
