"""Turn gathered raw values into what the user asked for: CF-decoded numpy, a labeled
``xr.Dataset``/``xr.DataArray``, torch tensors; variables stacked as channels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from xinsitu.buffer import VarLayout
from xinsitu.plan import SampleSpace
from xinsitu.stats import channel_names, check_channel_order, normalizer

OUTPUTS = ("xarray", "dataarray", "numpy", "torch", "cupy")


def _identity(raw: np.ndarray) -> np.ndarray:
    return raw


class _CFDecode:
    """raw -> values exactly as xarray decodes them; a class, not a closure, so that a
    generator pickles into spawned DataLoader workers."""

    def __init__(self, name: str, attrs: dict[str, Any]):
        self.name, self.attrs = name, attrs

    def __call__(self, raw: np.ndarray) -> np.ndarray:
        var = xr.Variable(tuple(f"_{i}" for i in range(raw.ndim)), raw, attrs=dict(self.attrs))
        return np.asarray(xr.conventions.decode_cf_variable(self.name, var).values)


def _nan_fill_only(attrs: dict[str, Any], src: Any) -> bool:
    """A float variable whose only CF encoding is a NaN fill value: xarray masks nothing."""
    if src.raw_dtype.kind != "f" or src.dtype != src.raw_dtype:
        return False
    if set(attrs) - {"_FillValue", "missing_value"}:
        return False
    return all(bool(np.all(np.isnan(np.asarray(v, dtype="f8")))) for v in attrs.values())


def cf_decoder(name: str, layout: VarLayout) -> Any:
    """A function raw -> values exactly as xarray decodes them (scale/offset/fill -> NaN)."""
    src = layout.src
    attrs = {k: v for k, v in src.cf.items() if k != "dtype"}
    if not src.stored or not attrs or _nan_fill_only(attrs, src):
        return _identity
    decode = _CFDecode(name, attrs)
    probe = decode(np.zeros((1,), dtype=src.raw_dtype))
    if probe.dtype != src.dtype:
        raise ValueError(f"variable {name!r}: re-applying its CF encoding gives {probe.dtype}, but the Dataset "
                         f"has {src.dtype}; was it opened with unusual decoding options?")
    return decode


@dataclass
class Channel:
    """One channel of a stacked batch: a variable, or one label of its extra dim."""

    name: str
    var: str
    index: tuple[int, ...]  # position along the variable's extra dims (empty: the whole variable)


def plan_channels(ds: xr.Dataset, layouts: dict[str, VarLayout],
                  kept: tuple[str, ...] = ()) -> tuple[list[Channel], tuple[str, ...]]:
    """Channels in order (variables in order; an extra dim expands into ``{var}_{label}``) and the
    dims every channel shares (after the sample axis). Window/patch dims (``kept``) are sample axes,
    never channels: a variable lacking them (a static one) is broadcast along them."""
    outs = {n: tuple(d for d in lay.out_dims if d not in kept) for n, lay in layouts.items()}
    base = min(outs.values(), key=len)
    channels: list[Channel] = []
    for n, dims in outs.items():
        if any(d not in dims for d in base):
            raise ValueError(f"cannot stack {n!r} {dims} with variables of dims {base}: stacked variables "
                             "must share their dims (an extra dim becomes channels)")
        extra = [d for d in dims if d not in base]
        if not extra:
            channels.append(Channel(n, n, ()))
            continue
        sizes = [layouts[n].src.shape[layouts[n].src.dims.index(d)] for d in extra]
        labels = [_labels(ds, d, s) for d, s in zip(extra, sizes, strict=True)]
        for idx in np.ndindex(*sizes):
            lab = "_".join(str(labels[k][i]) for k, i in enumerate(idx))
            channels.append(Channel(f"{n}_{lab}", n, tuple(int(i) for i in idx)))
    # the shared dims in the order a sampled variable has them (kept dims included)
    order = max((lay.out_dims for lay in layouts.values() if lay.has_sample_axis), key=len, default=base)
    shared = tuple(d for d in order if d in kept or d in base)
    return channels, shared + tuple(d for d in base if d not in shared)


def _labels(ds: xr.Dataset, dim: str, size: int) -> list[Any]:
    if dim in ds.indexes:
        vals = ds.indexes[dim]
        return [v.item() if hasattr(v, "item") else v for v in vals]
    return list(range(size))


class OutputBuilder:
    """Assembles one batch in the requested form (runs in the prefetch thread)."""

    def __init__(self, ds: xr.Dataset, space: SampleSpace, layouts: dict[str, VarLayout], output: str,
                 stack: bool, device: Any = None, normalize: dict[str, Any] | None = None):
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        if not isinstance(stack, bool):
            raise TypeError(f"stack must be True or False, got {stack!r}")
        self.output, self.device = output, device
        self.stack = stack or output == "dataarray"
        self.space, self.layouts = space, layouts
        self.decoders = {n: cf_decoder(n, lay) for n, lay in layouts.items()}
        self.attrs = {n: dict(ds[n].attrs) for n in layouts}
        self.ds_attrs = dict(ds.attrs)
        kept = tuple(d.name for d in space.dims if d.keep)  # window/patch dims: sample axes, never channels
        self.channels, self.base_dims = plan_channels(ds, layouts, kept) if self.stack else ([], ())
        # (x - mean) / std per channel after CF decoding; m.stats from ds.insitu.stats, or a dict like it
        self.normalizer = normalizer(normalize, layouts, kept) if normalize is not None else None
        if normalize is not None:
            check_channel_order(normalize, channel_names(ds, layouts, kept))
        dtypes = [lay.src.dtype for lay in layouts.values()]
        if self.normalizer is not None:
            dtypes = [self.normalizer.dtype(d) for d in dtypes]
        self.dtype = np.result_type(*dtypes)
        self._coords: xr.Dataset | None = None
        self._direct: tuple[int, ...] | bool | None = None
        self._ds_coords = ds.coords
        if output in ("torch",):
            import torch  # noqa: F401  - fail now, not in the prefetch thread
        if device is not None and output != "torch":
            raise ValueError(f"device={device!r} applies to output='torch' (output='cupy' uses the current "
                             "CuPy device)")
        if output == "cupy":
            _check_cupy()
        if device is not None:
            self._check_device(device)

    def _check_device(self, device: Any) -> None:
        import torch

        dev = torch.device(device)
        if dev.type == "meta":  # meta tensors have a shape but no values: every batch would be empty
            raise ValueError(f"device={device!r} holds no data; use 'cpu' or a GPU such as 'cuda:0'")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device={device!r}: CUDA is not available to torch on this machine")

    @property
    def coords(self) -> xr.Dataset:
        if self._coords is None:  # small: index and auxiliary coords, loaded once
            self._coords = xr.Dataset(coords=self._ds_coords).load()
        return self._coords

    def direct_stack(self, n: int) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
        """A stacked batch to gather straight into -- ``(array, {var: its channel view})`` -- where
        nothing happens between gather and stacking (one channel per variable, no CF decoding,
        no normalisation, one dtype), else None."""
        if self._direct is None:
            lays = self.layouts
            ok = (self.stack and self.output in ("numpy", "torch", "cupy") and self.normalizer is None
                  and all(d is _identity for d in self.decoders.values())
                  and len(self.channels) == len(lays)
                  and all(lay.has_sample_axis and lay.out_perm is None and lay.out_dims == self.base_dims
                          and lay.src.raw_dtype == self.dtype for lay in lays.values()))
            self._direct = self._sample_shape() if ok else False
        if self._direct is False:
            return None
        arr = np.empty((n, len(self.layouts), *self._direct), dtype=self.dtype)
        return arr, {name: arr[:, c] for c, name in enumerate(self.layouts)}

    def _sample_shape(self) -> tuple[int, ...]:
        """Shape of one sample of one channel (window/patch widths, then whole dims)."""
        widths = {d.name: d.width for d in self.space.dims if d.keep}
        lay = next(iter(self.layouts.values()))
        return tuple(widths.get(d, lay.src.shape[lay.src.dims.index(d)]) for d in self.base_dims)

    def finish_stacked(self, arr: np.ndarray) -> Any:
        """The stacked batch gathered by ``direct_stack``, in the output's kind."""
        if self.output == "torch":
            return self._to_torch(arr)
        return _to_cupy(arr) if self.output == "cupy" else arr

    def decode(self, raw: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = {n: self.decoders[n](a) for n, a in raw.items()}
        return values if self.normalizer is None else self.normalizer(values)

    def stacked(self, values: dict[str, np.ndarray]) -> np.ndarray:
        """(sample, channel, *base) array of the common result dtype; a variable lacking the sample axis
        or a window/patch dim is broadcast along it, as ``to_dataarray`` broadcasts."""
        sizes: dict[str, int] = {}
        n = 0
        for name, arr in values.items():
            lay = self.layouts[name]
            if lay.has_sample_axis:
                n = arr.shape[0]
                sizes.update(zip(lay.out_dims, arr.shape[1:], strict=True))
            else:
                sizes.update(zip(lay.src.dims, arr.shape, strict=True))
        base_shape = tuple(sizes[d] for d in self.base_dims)
        parts = []
        for name, arr in values.items():
            lay = self.layouts[name]
            dims = list(lay.out_dims) if lay.has_sample_axis else list(lay.src.dims)
            if not lay.has_sample_axis:
                arr = arr[None]
            missing = [d for d in self.base_dims if d not in dims]
            if missing:
                arr = arr.reshape(arr.shape + (1,) * len(missing))
                dims += missing
            extra = [d for d in dims if d not in self.base_dims]
            order = [dims.index(d) + 1 for d in extra + list(self.base_dims)]
            a = arr.transpose(0, *order) if order != list(range(1, arr.ndim)) else arr
            a = np.broadcast_to(a, (n, *a.shape[1:1 + len(extra)], *base_shape))
            parts.append(a.reshape(n, -1, *base_shape))
        if len(parts) == 1:
            return parts[0].astype(self.dtype, copy=False)
        out = np.empty((n, sum(p.shape[1] for p in parts), *base_shape), dtype=self.dtype)
        c = 0
        for p in parts:
            out[:, c:c + p.shape[1]] = p
            c += p.shape[1]
        return out

    def sample_coords(self, starts: np.ndarray) -> xr.Dataset:
        """The coordinates of ``starts`` (one row per sample) along a ``sample`` dim."""
        ind = {}
        for k, d in enumerate(self.space.dims):
            if d.keep:
                pos = starts[:, k, None] + np.arange(d.width)
                ind[d.name] = xr.DataArray(pos, dims=("sample", d.name))
            else:
                ind[d.name] = xr.DataArray(starts[:, k], dims="sample")
        # a dim without any coordinate has no labels to pick (its labels are its positions): as
        # ds.isel(...) gives, the batch then has no coordinate along it
        have = self.coords.dims
        return self.coords.isel({d: v for d, v in ind.items() if d in have})

    def build(self, raw: dict[str, np.ndarray], starts: np.ndarray) -> Any:
        values = self.decode(raw)
        if self.output == "xarray" and not self.stack:
            c = self.sample_coords(starts)
            data = {n: xr.Variable(self._dims(n), a, attrs=self.attrs[n]) for n, a in values.items()}
            return xr.Dataset(data, coords=c.coords, attrs=self.ds_attrs)
        if self.output == "dataarray":
            c = self.sample_coords(starts)
            arr = self.stacked(values)
            dims = ("sample", "variable", *self.base_dims)
            coords = {k: v for k, v in c.coords.items() if set(v.dims) <= set(dims)}  # e.g. not `level`
            return xr.DataArray(arr, dims=dims, coords={**coords, "variable": [ch.name for ch in self.channels]})
        if self.stack:
            arr = self.stacked(values)
            return self._to_torch(arr) if self.output == "torch" else _to_cupy(arr) if self.output == "cupy" else arr
        if self.output == "torch":
            return {n: self._to_torch(a) for n, a in values.items()}
        if self.output == "cupy":
            return {n: _to_cupy(a) for n, a in values.items()}
        return values

    def _dims(self, name: str) -> tuple[str, ...]:
        lay = self.layouts[name]
        return ("sample", *lay.out_dims) if lay.has_sample_axis else lay.src.dims

    def _to_torch(self, arr: np.ndarray) -> Any:
        import torch

        t = torch.from_numpy(np.ascontiguousarray(arr) if arr.flags.writeable else arr.copy())
        if self.device is not None:
            dev = torch.device(self.device)
            if dev.type == "cuda":
                t = t.pin_memory().to(dev, non_blocking=True)
            else:
                t = t.to(dev)
        return t


def _check_cupy() -> None:
    """output='cupy' needs CuPy and a CUDA device: say so now, never fall back to the CPU."""
    try:
        import cupy
    except ImportError:
        raise RuntimeError("output='cupy' needs CuPy: pip install 'xinsitu[gpu]' on a machine with CUDA") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, no device
        raise RuntimeError(f"output='cupy': no CUDA device is available ({e})") from None
    if n < 1:
        raise RuntimeError("output='cupy': no CUDA device is available")


def _to_cupy(arr: np.ndarray) -> Any:
    """A CuPy array on the current device (copied from host memory)."""
    import cupy

    return cupy.asarray(arr)
