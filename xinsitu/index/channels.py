"""The channel rule, CF decoding and normalisation: how a generator's variables become values.

Layer 1 (no I/O). One rule names the channels of a set of variables, for stacked batches,
for the stats record and for normalisation alike: the *base* dims are the shortest
variable's output dims (window/patch dims aside); each variable is one channel, or, where
it has dims beyond the base (its *extra* dims), one ``{var}_{label}`` channel per label
of them. Variables lacking a base dim cannot be stacked together. ``stack=["level"]``
(``fold``) makes a dim channels even where every variable has it; a variable lacking it
(``t2m`` beside ``z``, ``u``, ``v``) is one channel ``{var}``. Statistics are keyed by these
channel names, and ``normalizer`` applies them by name.

CF decoding re-applies a variable's encoding to raw values exactly as xarray decodes
them; ``decodes_to_itself`` tells where that is the identity (a pass saved per chunk).
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr

if TYPE_CHECKING:
    from xinsitu.index.manifest import SplitManifest
    from xinsitu.index.sampling import VarLayout
    from xinsitu.index.source import VarSource

#: top-level keys of a stats record that are not variables
RESERVED = ("split", "channels", "variables", "split_blocks")


# ----------------------------------------------------------------------------- CF decoding
def decodes_to_itself(src: VarSource) -> bool:
    """Whether CF decoding leaves raw values as they are: not stored (values already decoded), no CF
    attribute, or floats whose only CF attribute is a NaN fill value (what xarray writes for float
    variables: it masks nothing). Not where the store holds another byte order than the values' (a
    big-endian zarr v2 array: xarray gives native values)."""
    attrs = {k: v for k, v in src.cf.items() if k != "dtype"}
    if not src.stored:
        return True
    if not attrs:
        return src.raw_dtype == src.dtype
    return (src.raw_dtype == src.dtype and src.dtype.kind == "f" and set(attrs) <= {"_FillValue", "missing_value"}
            and all(bool(np.all(np.isnan(np.asarray(v, dtype=np.float64)))) for v in attrs.values()))


def array_module(a: Any) -> Any:
    """numpy for a numpy array, else the module of the array's type (``cupy`` for a CuPy array)."""
    if isinstance(a, np.ndarray):
        return np
    return sys.modules[type(a).__module__.split(".")[0]]


def identity(raw: np.ndarray) -> np.ndarray:
    """The decoder of a variable whose CF decoding is the identity."""
    return raw


class _CFDecode:
    """raw -> values exactly as xarray decodes them; a class, not a closure, so that a
    generator pickles into spawned DataLoader workers."""

    def __init__(self, name: str, attrs: dict[str, Any], dtype: np.dtype | None = None,
                 stored: np.dtype | None = None):
        self.name, self.attrs, self.options = name, attrs, _time_options(dtype)
        self.stored = stored  # the stored array's dtype, in the byte order xarray is handed it

    def __call__(self, raw: np.ndarray) -> np.ndarray:
        # in the byte order xarray decodes it in (a chunk may come in another: a v3 array stored big-endian, from
        # zarr 3.1): xarray's mask of an _Unsigned fill depends on it (the byte-swapped twin, in big-endian order)
        raw = raw.astype(raw.dtype.newbyteorder("=") if self.stored is None else self.stored, copy=False)
        var = xr.Variable(tuple(f"_{i}" for i in range(raw.ndim)), raw, attrs=dict(self.attrs))
        return np.asarray(xr.conventions.decode_cf_variable(self.name, var, **self.options).values)


def _time_options(dtype: np.dtype | None) -> dict[str, Any]:
    """xarray's decoding options that give values of ``dtype`` (the Dataset's): times in its unit
    (``CFDatetimeCoder(time_unit="s")``, as a user may open with), cftime objects, time deltas (whose
    marker, a ``dtype`` attribute, xarray moved to the encoding)."""
    if dtype is None:
        return {}
    unit: Any = np.datetime_data(dtype)[0] if dtype.kind in "Mm" else None  # "s", "ms", "us" or "ns"
    if dtype.kind == "M":
        return {"decode_times": xr.coders.CFDatetimeCoder(time_unit=unit)}
    if dtype.kind == "m":  # the values are time deltas: by the units, whatever marked them so
        return {"decode_timedelta": xr.coders.CFTimedeltaCoder(time_unit=unit, decode_via_units=True)}
    if dtype.kind == "O":
        return {"decode_times": xr.coders.CFDatetimeCoder(use_cftime=True)}
    return {}


class _Cast:
    """raw -> the same values in ``dtype`` (the native byte order xarray gives a big-endian array)."""

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype

    def __call__(self, raw: np.ndarray) -> np.ndarray:
        return raw.astype(self.dtype)


def cf_decoder(name: str, layout: VarLayout) -> Any:
    """A function raw -> values exactly as xarray decodes them (scale/offset/fill -> NaN)."""
    src = layout.src
    if decodes_to_itself(src):
        return identity
    # (an encoding's dtype is the stored one, not an attribute to decode -- but for the "dtype": "bool" attribute
    # xarray's BooleanCoder decodes, which int8 storage of NetCDF booleans carries)
    attrs = {k: v for k, v in src.cf.items() if k != "dtype" or (isinstance(v, str) and v == "bool")}
    if not attrs and src.raw_dtype.newbyteorder("=") == src.dtype.newbyteorder("="):
        return _Cast(src.dtype)
    decode = _CFDecode(name, attrs, np.dtype(src.dtype), np.dtype(src.raw_dtype))
    probe = decode(np.zeros((1,), dtype=src.raw_dtype))
    if probe.dtype != src.dtype:
        raise ValueError(f"variable {name!r}: re-applying its CF encoding gives {probe.dtype}, but the Dataset "
                         f"has {src.dtype}; was it opened with unusual decoding options, or its data or encoding "
                         "replaced (copy(data=...), assign, .encoding edits)? Open with xinsitu.open_zarr or "
                         "chunks=None and select without replacing data, or .load() it to train from memory")
    return decode


class ArrayCF:
    """CF decoding (fill values to NaN, then ``* scale_factor + add_offset``) written with array
    operations of one dtype each, so that it runs on any array module (numpy, CuPy on the GPU) with
    no type promotion left to the module: ``work`` is the dtype the arithmetic runs in (the one
    xarray's decoding turns out to use, see :func:`array_cf`), ``dtype`` the decoded values'."""

    def __init__(self, fills: list[Any], scale: Any, offset: Any, work: np.dtype, dtype: np.dtype):
        self.fills, self.scale, self.offset, self.work, self.dtype = fills, scale, offset, work, dtype

    def __call__(self, raw: Any) -> Any:
        xp = array_module(raw)
        mask = None
        for fv in self.fills:
            hit = xp.isnan(raw) if fv is None else raw == xp.asarray(fv, dtype=raw.dtype)
            mask = hit if mask is None else mask | hit
        data = raw.astype(self.work)
        if self.scale is not None:
            data = data * xp.asarray(self.scale, dtype=self.work)
        if self.offset is not None:
            data = data + xp.asarray(self.offset, dtype=self.work)
        data = data.astype(self.dtype, copy=False)
        if mask is not None:
            data = xp.where(mask, xp.asarray(np.nan, dtype=self.dtype), data)
        return data


def array_cf(src: VarSource, decode: Any) -> ArrayCF | None:
    """An :class:`ArrayCF` giving bit for bit what ``decode`` (xarray's decoding of ``src``) gives, on
    probe values (the raw dtype's extremes, its fill values, zero, random values); None where the
    variable's encoding has more than fill values, scale and offset, or no candidate matches."""
    attrs = {k: v for k, v in src.cf.items() if k not in ("dtype", "units")}
    if set(attrs) - {"_FillValue", "missing_value", "scale_factor", "add_offset"} or src.dtype.kind != "f":
        return None
    raw_t = np.dtype(src.raw_dtype).newbyteorder("=")  # (numpy draws test values in native order only)
    if raw_t.kind not in "iuf":
        return None
    fills: list[Any] = []
    for k in ("_FillValue", "missing_value"):
        for v in np.atleast_1d(np.asarray(attrs.get(k, []))).tolist():
            if isinstance(v, float) and np.isnan(v):
                fills.append(None)
            elif np.asarray(v).astype(raw_t) == v:
                fills.append(np.asarray(v).astype(raw_t).item())
    rng = np.random.default_rng(0)
    if raw_t.kind == "f":
        probe = np.concatenate([rng.normal(0, 1e3, 512), [0.0, -0.0, np.inf, -np.inf, np.nan]]).astype(raw_t)
    else:
        info = np.iinfo(raw_t)
        probe = np.concatenate([rng.integers(info.min, info.max, 512, endpoint=True, dtype=raw_t),
                                np.array([info.min, info.max, 0, 1], dtype=raw_t)])
    probe = np.concatenate([probe, np.array([f for f in fills if f is not None], dtype=raw_t)])
    want = np.asarray(decode(probe))
    scale, offset = attrs.get("scale_factor"), attrs.get("add_offset")
    for work in dict.fromkeys([np.dtype(src.dtype), np.dtype("f8")]):
        cand = ArrayCF(fills, scale, offset, work, np.dtype(src.dtype))
        got = cand(probe)
        if got.dtype == want.dtype and got.tobytes() == want.tobytes():
            return cand
    return None


# ----------------------------------------------------------------------------- the channel rule
def fold_dims(stack: Any) -> tuple[str, ...]:
    """The dims of ``stack=[dims]`` (none for ``stack=True/False``)."""
    if isinstance(stack, bool):
        return ()
    if isinstance(stack, (list, tuple)) and stack and all(isinstance(d, str) for d in stack):
        if len(set(stack)) != len(stack):
            raise ValueError(f"stack names a dim twice: {list(stack)}")
        return tuple(stack)
    raise TypeError(f"stack must be True, False or a non-empty list of dim names (e.g. ['level']), got {stack!r}")


def check_fold(layouts: dict[str, VarLayout], fold: tuple[str, ...], kept: tuple[str, ...] = ()) -> None:
    """Refuse ``stack=[dims]`` (``fold``) naming a window/patch dim (those are sample axes) or a dim
    that no selected variable has. A variable lacking a folded dim (``t2m`` beside ``z`` on levels)
    is one channel, named ``{var}``."""
    for d in fold:
        if d in kept:
            raise ValueError(f"stack: {d!r} is a window/patch dim (a sample axis), it cannot become channels")
        if not any(d in lay.out_dims for lay in layouts.values()):
            dims = {n: lay.out_dims for n, lay in layouts.items()}
            raise ValueError(f"stack: no selected variable has dim {d!r} to fold into channels (their batch "
                             f"dims: {dims})")


def _base_and_extra(layouts: dict[str, VarLayout], kept: tuple[str, ...] = (),
                    fold: tuple[str, ...] = ()) -> tuple[tuple[str, ...], dict[str, list[str] | None]]:
    """The base dims (the shortest variable's output dims, window/patch dims ``kept`` and the dims
    ``fold`` (``stack=[dims]``) aside) and per variable its extra dims, in its order; None for a
    variable lacking a base dim (not stackable). A folded dim is an extra dim of every variable."""
    outs = {n: tuple(d for d in lay.out_dims if d not in kept) for n, lay in layouts.items()}
    base = tuple(d for d in min(outs.values(), key=len) if d not in fold)
    return base, {n: [d for d in dims if d not in base] if all(d in dims for d in base) else None
                  for n, dims in outs.items()}


@dataclass
class Channel:
    """One channel of a stacked batch: a variable, or one label of its extra dim."""

    name: str
    var: str
    index: tuple[int, ...]  # position along the variable's extra dims (empty: the whole variable)


def plan_channels(ds: xr.Dataset, layouts: dict[str, VarLayout], kept: tuple[str, ...] = (),
                  fold: tuple[str, ...] = ()) -> tuple[list[Channel], tuple[str, ...]]:
    """Channels in order (variables in order; an extra dim expands into ``{var}_{label}``) and the
    dims every channel shares (after the sample axis). Window/patch dims (``kept``) are sample axes,
    never channels: a variable lacking them (a static one) is broadcast along them. Dims in
    ``fold`` (``stack=["level"]``) are channels (``{var}_{label}``) of every variable that has them."""
    base, extras = _base_and_extra(layouts, kept, fold)
    channels: list[Channel] = []
    for n, extra in extras.items():
        if extra is None:
            dims = tuple(d for d in layouts[n].out_dims if d not in kept)
            raise ValueError(f"cannot stack {n!r} {dims} with variables of dims {base}: stacked variables "
                             "must share their dims (an extra dim becomes channels)")
        if not extra:
            channels.append(Channel(n, n, ()))
            continue
        sizes = [layouts[n].src.shape[layouts[n].src.dims.index(d)] for d in extra]
        labels = [_labels(ds, d, s) for d, s in zip(extra, sizes, strict=True)]
        for idx in np.ndindex(*sizes):
            lab = "_".join(str(labels[k][i]) for k, i in enumerate(idx))
            channels.append(Channel(f"{n}_{lab}", n, tuple(int(i) for i in idx)))
    seen: dict[str, str] = {}
    for ch in channels:  # statistics, normalize= and states name channels: one name, one channel
        if ch.name in seen and seen[ch.name] == ch.var:  # one variable's labels: a label given twice
            extra = extras[ch.var] or []
            raise ValueError(f"channel name {ch.name!r} is given twice by variable {ch.var!r}: its dim(s) "
                             f"{extra} hold a label twice ({{var}}_{{label}} names a channel per label); select "
                             f"each label once (e.g. ds.isel({extra[0] if extra else 'dim'}=[...])) or relabel "
                             "the dim (ds.assign_coords)")
        if ch.name in seen:
            raise ValueError(f"channel name {ch.name!r} is given twice, by variables {seen[ch.name]!r} and "
                             f"{ch.var!r} ({{var}}_{{label}} names a variable's channel per label): rename one "
                             f"variable (ds.rename) or leave one out (variables=)")
        seen[ch.name] = ch.var
    # the shared dims in the order a sampled variable has them (kept dims included)
    order = max((lay.out_dims for lay in layouts.values() if lay.has_sample_axis), key=len, default=base)
    shared = tuple(d for d in order if d in kept or d in base)
    return channels, shared + tuple(d for d in base if d not in shared)


def _labels(ds: xr.Dataset, dim: str, size: int) -> list[Any]:
    if dim in ds.indexes:
        vals = ds.indexes[dim]
        return [v.item() if hasattr(v, "item") else v for v in vals]
    return list(range(size))


def channel_plan(ds: xr.Dataset, layouts: dict[str, VarLayout],
                 fold: tuple[str, ...] = ()) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Per variable, its channel names and its extra (channel) dims, as ``plan_channels`` has them.

    Variables that cannot be stacked together (no shared dims) are one channel each (unless dims
    are folded: ``fold``, i.e. ``stack=["level"]``, makes channels of them in every variable that has them).
    """
    extras = _base_and_extra(layouts, (), fold)[1]
    if any(extra is None for extra in extras.values()):
        if fold:
            raise ValueError(f"stack={list(fold)}: the variables {list(layouts)} share no other dims to stack on")
        return {n: [n] for n in layouts}, {n: [] for n in layouts}
    names: dict[str, list[str]] = {n: [] for n in layouts}
    for ch in plan_channels(ds, layouts, (), fold)[0]:
        names[ch.var].append(ch.name)
    return names, {n: extra or [] for n, extra in extras.items()}


def channel_names(ds: xr.Dataset, layouts: dict[str, VarLayout], kept: tuple[str, ...] = (),
                  fold: tuple[str, ...] = ()) -> list[str]:
    """The channel names of these variables in order, as ``gen.channels`` and the stats record list them
    (one per variable where the variables cannot be stacked together)."""
    try:
        return [c.name for c in plan_channels(ds, layouts, kept, fold)[0]]
    except ValueError:
        return list(layouts)


# ----------------------------------------------------------------------------- normalising
class Normalizer:
    """``(x - mean) / std`` per channel, applied to CF-decoded values of one generator's variables.

    Made by :func:`normalizer`. Call it on ``{var: values}`` (values shaped as a batch
    gives them: a leading sample axis, then the variable's output dims; or the
    variable's own dims for a variable without a split dim), or use ``apply(var, values)``.
    Floating values keep their dtype (mean and std are cast to it, as
    ``(da - mean) / std`` does with Python floats); integers become float64. A channel
    with std 0 is only centred (scale 1, as scikit-learn does); one without statistics
    (``None``) becomes NaN.
    """

    def __init__(self, params: dict[str, tuple[np.ndarray, np.ndarray]]):
        self.params = params  # var -> (mean, scale), float64 and shaped to broadcast against a batch

    def dtype(self, dtype: np.dtype) -> np.dtype:
        """The dtype normalised values of ``dtype`` have."""
        return np.result_type(np.dtype(dtype), 1.0)

    def apply(self, name: str, values: np.ndarray) -> np.ndarray:
        """``values`` normalised: numpy arrays, or device arrays (CuPy: on the device, same values)."""
        mean, scale = self.params[name]
        dt = self.dtype(values.dtype)
        xp = array_module(values)
        out = xp.subtract(values, xp.asarray(mean.astype(dt)), dtype=dt)  # never in place: may be a block buffer
        out /= xp.asarray(scale.astype(dt))
        return out

    def __call__(self, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {n: self.apply(n, a) if n in self.params else a for n, a in values.items()}


def normalizer(stats: dict[str, Any], layouts: dict[str, VarLayout], kept: tuple[str, ...] = (),
               fold: tuple[str, ...] = (), ds: xr.Dataset | None = None, *,
               manifest: SplitManifest | None = None, split: str | None = None) -> Normalizer:
    """A :class:`Normalizer` applying ``stats`` (from :func:`compute_stats`) to these variables.

    Statistics are keyed by channel name: where an entry records its ``"channels"`` (every
    ``compute_stats`` record does) and ``ds`` gives the labels, each channel of the batches takes
    the values of the statistics' channel of the same name, whatever the order of the variables
    or of the labels (``ds.isel(level=[2, 0])``); a channel the statistics lack raises, naming it.

    Parameters
    ----------
    stats : ``{var: {"mean": ..., "std": ...}, ...}`` (a ``compute_stats`` record, e.g. ``m.stats``,
        or a hand-written dict of the same shape). A variable with an extra dim needs a list per
        key, in channel order (C order over the entry's ``"dims"``, the extra dims; default: the
        dims the other variables lack, as in ``plan_channels``). Values are numbers (or None).
    layouts : the generator's variable layouts (``gen.layouts``).
    kept : the window/patch dims of the generator's samples (never channel dims).
    fold : dims folded into channels (``stack=["level"]``).
    ds : the generator's Dataset: its labels name the channels (without it, lists apply by position).
    manifest, split : the generator's manifest and split, where the caller gives them: the statistics'
        own record is then checked against them (``check_stats_origin``).

    Raises
    ------
    ValueError
        When a variable or channel has no statistics, or a variable's number of channels differs;
        when a std is negative, NaN or infinite, or a mean NaN or infinite (``None`` is the number
        missing: that channel becomes NaN); when the statistics are of a split the manifest lacks,
        or disagree with the manifest's own for the same split (``check_stats_origin``).
    TypeError
        When ``stats`` is not a dict, or a mean/std is not a number.
    """
    if not isinstance(stats, dict):
        raise TypeError(f"normalize= takes a stats dict (e.g. m.stats from ds.insitu.stats), got "
                        f"{type(stats).__name__}")
    if manifest is not None and split is not None:
        check_stats_origin(stats, manifest, split)
    inferred = _extra_dims(layouts, kept, fold)
    params = {}
    for n, lay in layouts.items():
        entry = stats.get(n)
        if not isinstance(entry, dict) or "mean" not in entry or "std" not in entry:
            have = [k for k in stats if k not in RESERVED]
            mine = _names(ds, n, inferred[n], lay) if ds is not None else [n]
            raise ValueError(f"normalize: no statistics for variable {n!r} (channel(s) {mine}; the stats have "
                             f"{have}); compute them for these variables: "
                             f"ds.insitu.stats(m, split, variables={list(layouts)})")
        extra = list(entry.get("dims", inferred[n]))
        pooled = [d for d in inferred[n] if d not in extra]
        if pooled and ds is not None:  # one mean for all labels of a dim that is channels here: those have none
            mine = _names(ds, n, inferred[n], lay)
            again = f"variables={list(layouts)}" + (f", stack={list(fold)}" if fold else "")
            raise ValueError(f"normalize: no statistics for channel(s) {mine}: the statistics of {n!r} are pooled "
                             f"over {pooled} (channels {entry.get('channels', [n])}); compute them for these "
                             f"channels: ds.insitu.stats(m, split, {again})")
        out_dims = ("sample", *lay.out_dims) if lay.has_sample_axis else lay.src.dims
        missing = [d for d in extra if d not in out_dims]
        if missing:
            raise ValueError(f"normalize: the statistics of {n!r} are per {extra}, but its batches have dims "
                             f"{out_dims} (was a dim selected away after computing the statistics?)")
        sizes = [lay.src.shape[lay.src.dims.index(d)] for d in extra]
        saved = entry.get("channels")
        if ds is not None and isinstance(saved, list) and all(isinstance(c, str) for c in saved):
            # by channel name: the statistics' channel of the same name, wherever it is
            mean, std = (_channel_values(n, entry[k], k, [len(saved)] if extra else [], saved) for k in ("mean", "std"))
            mine = _names(ds, n, extra, lay)
            where = {c: i for i, c in enumerate(saved)}
            lost = [c for c in mine if c not in where]
            if lost:
                raise ValueError(f"normalize: no statistics for channel(s) {lost} (variable {n!r}; its statistics "
                                 f"have channels {saved}); compute them for these channels (same variables, "
                                 "labels and stack=)")
            take = [where[c] for c in mine]
            mean, std = mean[take], std[take]
        else:
            names = saved if isinstance(saved, list) else None
            mean, std = (_channel_values(n, entry[k], k, sizes, names) for k in ("mean", "std"))
        shape = [1] * len(out_dims)
        for d, size in zip(extra, sizes, strict=True):
            shape[out_dims.index(d)] = size
        # the channel list is C order over ``extra``; lay its axes out in the batch's dim order
        order = sorted(range(len(extra)), key=lambda i: out_dims.index(extra[i]))
        mean = mean.reshape(sizes).transpose(order).reshape(shape)
        std = std.reshape(sizes).transpose(order).reshape(shape)
        scale = np.where(std == 0, 1.0, std)
        params[n] = (mean, scale)
    return Normalizer(params)


def _names(ds: xr.Dataset, n: str, extra: list[str], lay: VarLayout) -> list[str]:
    """The channel names of variable ``n`` along its channel dims ``extra`` (C order), as ``plan_channels``
    names them: ``n``, or ``{n}_{label}``."""
    if not extra:
        return [n]
    sizes = [lay.src.shape[lay.src.dims.index(d)] for d in extra]
    labels = [_labels(ds, d, s) for d, s in zip(extra, sizes, strict=True)]
    return [f"{n}_" + "_".join(str(labels[k][i]) for k, i in enumerate(idx)) for idx in np.ndindex(*sizes)]


def _channel_values(name: str, v: Any, key: str, sizes: list[int], channels: list[Any] | None = None) -> np.ndarray:
    """The ``key`` (mean or std) of variable ``name``'s channels as float64, None as NaN; ``TypeError``
    for what is not a number, ``ValueError`` for a NaN or infinite one, or a negative std (naming the
    channel, from ``channels`` where given)."""
    n = int(np.prod(sizes)) if sizes else 1
    if isinstance(v, np.ndarray) and v.dtype.kind in "iuf":
        v = v.ravel().tolist()
    vals = list(v) if isinstance(v, (list, tuple)) else [v]
    for i, x in enumerate(vals):
        if x is not None and (isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer,
                                                                                       np.floating))):
            raise TypeError(f"normalize: the {key!r} of {name!r} must be numbers (or None), got "
                            f"{type(x).__name__} {x!r}")
        if x is not None and (not math.isfinite(x) or (key == "std" and x < 0)):
            chan = (f", channel {channels[i]!r}" if channels is not None and len(channels) == len(vals)
                    else f", channel {i}" if len(vals) > 1 else "")
            what = "a standard deviation is a finite number, 0 or more" if key == "std" else "a mean is a finite number"
            raise ValueError(f"normalize: the {key!r} of {name!r}{chan} is {x!r}: {what} (damaged or hand-made "
                             "statistics? values with infinities?); None marks a channel without statistics, "
                             "which then becomes NaN")
    arr = np.array([np.nan if x is None else x for x in vals], dtype=np.float64)
    if sizes and arr.size != n:
        raise ValueError(f"normalize: {name!r} has {n} channels but its {key!r} has {arr.size} value(s)")
    if not sizes and arr.size != 1:
        raise ValueError(f"normalize: {name!r} is one channel here, but its {key!r} has {arr.size} values "
                         "(statistics computed with another set of variables?)")
    return arr


def check_stats_origin(stats: dict[str, Any], manifest: SplitManifest, split: str, stacklevel: int = 3) -> None:
    """Check that normalisation statistics (a ``ds.insitu.stats`` record, whose ``"split"`` names the
    split they were computed on, and ``"split_blocks"`` that split's chunk blocks) belong to
    ``manifest``, for a generator over ``split``.

    Raises ``ValueError`` where the statistics are of a split ``manifest`` lacks, or of a split of that
    name that holds other chunk blocks (another manifest: its training chunks may be this one's
    validation chunks). Statistics of the same split of other data (another region or variables of the
    same archive) are the user's to choose. Warns (``UserWarning``) where the manifest has a
    ``"train"`` split and the statistics are of another one: statistics of the split a model is
    evaluated on leak it into training. A record without ``"split"`` (hand-written) is not checked.
    """
    origin = stats.get("split") if isinstance(stats, dict) else None
    if not isinstance(origin, str):
        return
    names = list(manifest.splits)
    if origin not in manifest.splits:
        raise ValueError(f"normalize: these statistics are of split {origin!r}, which this manifest does not "
                         f"have (its splits: {names}): statistics of another manifest? Compute them on this "
                         "one: ds.insitu.stats(m, 'train')")
    blocks = stats.get("split_blocks")
    if isinstance(blocks, str) and blocks != manifest.splits[origin].digest():
        raise ValueError(f"normalize: these statistics are of a split {origin!r} made of other chunk blocks than "
                         f"this manifest's (another manifest, or one whose splits changed): its {origin!r} may "
                         f"hold what this one evaluates on. Compute them on this manifest: "
                         f"ds.insitu.stats(m, {origin!r})")
    if "train" in manifest.splits and origin != "train":
        warnings.warn(f"normalize: these statistics are of split {origin!r}, not 'train'; normalising with the "
                      f"statistics of a split a model is evaluated on (here split {split!r}) leaks it into training. "
                      "Use ds.insitu.stats(m, 'train') for every split", UserWarning, stacklevel=stacklevel)


def _extra_dims(layouts: dict[str, VarLayout], kept: tuple[str, ...] = (),
                fold: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """The dims each variable has beyond the base (its channel dims; none for one lacking a base dim)."""
    return {n: extra or [] for n, extra in _base_and_extra(layouts, kept, fold)[1].items()}

