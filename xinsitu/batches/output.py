"""Turn gathered raw values into what the user asked for: CF-decoded numpy, a labeled
``xr.Dataset``/``xr.DataArray``, torch tensors, jax arrays; variables stacked as channels.

Order of the last steps (all in the prefetch thread): gather -> CF decode -> normalise -> stack
-> the output kind on the CPU (numpy / torch CPU tensors; numpy for cupy) -> ``transform=`` -> the
``device=`` copy (torch, cupy: ``xinsitu.batches.device_copy``) or the move onto a jax device (jax). So a
transform sees host values and may return any structure (tuples, nested dicts); the device copy
then moves every array in it, numpy arrays becoming arrays of the output kind."""

from __future__ import annotations

import warnings
from functools import cached_property
from typing import Any, cast

import numpy as np
import pandas as pd
import xarray as xr

from xinsitu.batches.device_copy import NUMERIC_KINDS, DeviceMover, device_api, host_numpy
from xinsitu.batches.device_copy import tree_map as _tree_map
from xinsitu.cache.device_tier import require_cupy
from xinsitu.index.channels import (
    array_cf,
    cf_decoder,
    check_fold,
    fold_dims,
    identity,
    normalizer,
    plan_channels,
)
from xinsitu.index.sampling import SampleSpace, VarLayout
from xinsitu.io.mempool import ArrayPool

#: pandas before 3 hands out an index's own writable array (``Index.values``): a batch's index coordinate
#: of a dim it keeps whole is then copied per batch, so writing into it never reaches another batch
_INDEX_VALUES_WRITABLE = int(pd.__version__.split(".")[0]) < 3

OUTPUTS = ("xarray", "dataarray", "numpy", "torch", "cupy", "jax")


class OutputBuilder:
    """Assembles one batch in the requested form (runs in the prefetch thread)."""

    def __init__(self, ds: xr.Dataset, space: SampleSpace, layouts: dict[str, VarLayout], output: str,
                 stack: bool | list[str], device: Any = None, normalize: dict[str, Any] | None = None,
                 transform: Any = None, dtype: Any = None):
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be a callable fn(batch) -> batch, got {type(transform).__name__}")
        self.transform = transform
        self._said_none = False  # warned that transform= returned None (once)
        self.arrays = BatchArrays()
        self.fold = fold_dims(stack)
        self.output, self.device = output, device
        self.stack = bool(stack) or output == "dataarray"
        self.space, self.layouts = space, layouts
        self.decoders = {n: cf_decoder(n, lay) for n, lay in layouts.items()}
        self.attrs = {n: dict(ds[n].attrs) for n in layouts}
        self.ds_attrs = dict(ds.attrs)
        kept = tuple(d.name for d in space.dims if d.keep)  # window/patch dims: sample axes, never channels
        check_fold(layouts, self.fold, kept)
        self.channels, self.base_dims = plan_channels(ds, layouts, kept, self.fold) if self.stack else ([], ())
        if output in ("xarray", "dataarray"):
            self._check_dim_names(layouts)
        # (x - mean) / std per channel after CF decoding; m.stats from ds.insitu.stats, or a dict like it,
        # applied by channel name (whatever the order of variables=)
        self.normalizer = normalizer(normalize, layouts, kept, self.fold, ds) if normalize is not None else None
        # each variable's values after CF decoding and normalising; ``dtype=`` casts every output array
        self.out_dtype = output_dtype(dtype)
        self.value_dtypes = {n: self.normalizer.dtype(lay.src.dtype) if self.normalizer is not None
                             else np.dtype(lay.src.dtype) for n, lay in layouts.items()}
        for n, dt in self.value_dtypes.items():  # text is cast to no number (it was tried at the first batch)
            if self.out_dtype is not None and dt.kind in "OSTU" and self.out_dtype.kind not in "OSTU":
                raise TypeError(f"dtype={dtype!r}: variable {n!r} holds {dt} values, which cast to no "
                                f"{self.out_dtype}; leave it out (variables=[...]) or give no dtype=")
        #: the stacked batch's dtype: ``dtype=``, else the variables' common result dtype (as ``to_dataarray``)
        self.dtype = self.out_dtype if self.out_dtype is not None else self._common_dtype()
        #: each output array's dtype (a variable's own, or the stacked batch's)
        self.var_dtypes = {n: self.dtype if self.stack or self.out_dtype is not None else dt
                           for n, dt in self.value_dtypes.items()}
        self._coords: xr.Dataset | None = None
        self._direct: bool | None = None
        self.gpu: Any = None  # the GPU path's device side: batches built on the device (``use_gpu``)
        self._device_ok: bool | None = None  # the device's build passed its check on the first batch
        self._ds_coords = ds[list(layouts)].coords  # those ds[variables] keeps, as xarray gives them
        # each output array's dtype, by what a message calls it
        arrays = {"the stacked batch": self.dtype} if self.stack else self.var_dtypes
        if output == "torch":
            try:
                import torch  # noqa: F401  - fail now, not in the prefetch thread
            except ImportError:
                raise RuntimeError("output='torch' needs torch: pip install 'xinsitu[torch]' (on a machine "
                                   "without CUDA, install torch's CPU build first)") from None
            if transform is None:  # else the transform may cast
                for n, dt in arrays.items():
                    _check_torch_dtype(n, dt, dtype)
        if output == "jax":
            self.device = _jax_device(device)
            if transform is None:  # else the transform may cast; checked per array in _to_jax
                for n, dt in arrays.items():
                    _check_jax_dtype(n, dt)
        elif device is not None and output != "torch":
            raise ValueError(f"device={device!r} applies to output='torch' or 'jax' (output='cupy' uses the "
                             "current CuPy device)")
        if output == "cupy":  # CuPy and a CUDA device, else say so now
            require_cupy("output='cupy'", "output='cupy' needs CuPy: {hint}, on a machine with CUDA")
        if device is not None and output == "torch":
            self._check_device(device)
        # a CUDA device: batches go through a ring of reused pinned buffers on xinsitu's own stream
        api = device_api(output, self.device)
        self.mover: DeviceMover | None = DeviceMover(api) if api is not None else None
        if self.mover is not None:  # stacked batches are gathered into page-locked memory: no staging copy
            self.arrays.alloc = self.mover.host_alloc

    def cuda_target(self) -> str | None:
        """None where batches go to a CUDA device (so chunks may decode there), else why not."""
        if self.output == "cupy" or self.mover is not None:
            return None
        if self.output == "jax":
            import jax

            dev = self.device if self.device is not None else jax.devices()[0]
            return None if dev.platform == "gpu" else f"the jax device {dev}"
        if self.output == "torch" and self.device is not None:
            return f"device={self.device!r}"
        return f"output={self.output!r}" + ("" if self.output in ("torch", "jax") else " (host arrays)")

    def _check_dim_names(self, layouts: dict[str, VarLayout]) -> None:
        """A labeled batch names its leading dim ``sample`` and a stacked one its channel dim ``variable``
        (as ``to_dataarray``): a variable's own dim of either name is refused now, naming the ways out
        (it failed in xarray at the first batch)."""
        for n, lay in layouts.items():
            dims = [d for d in lay.out_dims if d in self.base_dims] if self.stack else list(lay.out_dims)
            if "sample" in dims:
                raise ValueError(f"output={self.output!r}: variable {n!r} has a dim 'sample', the name of a batch's "
                                 "leading dim; rename it (ds.rename({'sample': 'member'})), or take output='numpy'")
            if self.stack and "variable" in dims:
                raise ValueError(f"output={self.output!r}" + (", stack=True" if self.output == "xarray" else "")
                                 + f": variable {n!r} has a dim 'variable', the name of a stacked batch's channel "
                                 "dim; fold it into the channels (stack=['variable']), rename it "
                                 "(ds.rename({'variable': 'channel'})), or take output='numpy'")

    def _common_dtype(self) -> np.dtype:
        """The variables' common result dtype (the stacked batch's); one that does not exist (datetimes beside
        numbers) refuses ``stack`` naming the variables, and is not needed where nothing is stacked."""
        try:
            return np.result_type(*self.value_dtypes.values())
        except (TypeError, ValueError) as e:  # (numpy's DTypePromotionError is a TypeError)
            if not self.stack:
                return np.dtype(object)  # (never used: each array keeps its variable's dtype)
            kinds = ", ".join(f"{n!r} {dt}" for n, dt in self.value_dtypes.items())
            raise TypeError(f"stack: the variables have no common dtype to stack them in ({kinds}: {e}); leave "
                            "the ones of another kind out (variables=[...]) or give dtype=") from None

    def use_gpu(self, gpu: Any) -> None:
        """Build batches on the device (``gpu``: ``codecs.gpu.CupyGpu`` or its stand-in): variables
        gathered there from device buffers stay there, the others are copied there after their CF
        decoding; normalising and stacking then run on the device (None: on the host, as before)."""
        self.gpu, self._device_ok, self._direct = gpu, None, None
        # CF decoding on the device, where array operations give xarray's values (else on the host)
        self.device_cf = {} if gpu is None else {
            n: array_cf(lay.src, self.decoders[n]) for n, lay in self.layouts.items()
            if self.decoders[n] is not identity}

    def _check_device(self, device: Any) -> None:
        import torch

        if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
            raise TypeError(f"device={device!r}: a torch device is a str, an int or a torch.device, "
                            f"not {type(device).__name__}; use e.g. 'cpu' or 'cuda:0'")
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:  # torch's own words do not name the argument
            raise ValueError(f"device={device!r} is not a torch device ({e}); use e.g. 'cpu' or 'cuda:0'") from None
        if dev.type == "meta":  # meta tensors have a shape but no values: every batch would be empty
            raise ValueError(f"device={device!r} holds no data; use 'cpu' or a GPU such as 'cuda:0'")
        if dev.type == "cuda" and not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise RuntimeError(f"device={device!r}: CUDA is not available to torch on this machine (torch "
                               f"{torch.__version__}, {build}, sees no GPU); use device='cpu', or run where a GPU "
                               "and a CUDA build of torch are")
        if dev.type not in ("cpu", "cuda"):  # mps, xla, xpu...: asked now, not at the first batch's copy
            try:
                torch.empty(0, device=dev)
            except (RuntimeError, AssertionError) as e:
                why = (str(e).strip().splitlines() or [type(e).__name__])[0]  # (torch lists every backend after it)
                raise RuntimeError(f"device={device!r} cannot be used on this machine: {why}") from None

    @property
    def coords(self) -> xr.Dataset:
        if self._coords is None:  # small: index and auxiliary coords, loaded once
            coords = xr.Dataset(coords=self._ds_coords).load()
            for v in coords.variables.values():  # a batch gets those it does not index as they are: read-only
                if not isinstance(v, xr.IndexVariable):
                    v.data = _readonly(np.asarray(v.data))
            self._coords = coords
        return self._coords

    def direct_stack(self, n: int) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
        """A stacked batch of ``n`` samples to gather into, and the views of the variables gathered
        straight into it (``{var: its channels}``: raw values that are output values, in the buffer's
        layout); the others are put in by ``fill_stacked``. None where a variable has no place of its own
        in it (broadcast along a dim it lacks) or batches are built on the device."""
        if self._direct is None:
            self._direct = (self.gpu is None and self.stack and all(
                set(self.base_dims) <= set(lay.out_dims if lay.has_sample_axis else lay.src.dims)
                for lay in self.layouts.values()))
        if not self._direct:
            return None
        arr = cast(np.ndarray, self.empty_batch(n))
        return arr, {name: self.value_view(arr, name, slice(None)) for name, lay in self.layouts.items()
                     if lay.has_sample_axis and lay.out_perm is None and not self.converts(name)}

    def finish_direct(self, direct: tuple[np.ndarray, dict[str, np.ndarray]], raw: dict[str, np.ndarray],
                      starts: np.ndarray) -> Any:
        """The batch whose stacked array ``direct_stack`` gave: the variables of ``raw`` not gathered
        straight into it (not yet CF-decoded) decoded, normalised and cast in one copy into their channels
        (a variable without a sample axis broadcast over the samples), then the output's kind."""
        arr, gathered = direct
        for name, a in raw.items():
            if name not in gathered:
                values = self.decode({name: a}, cast=False)[name]
                np.copyto(self.value_view(arr, name, slice(None)), values, casting="unsafe")
        return self.finish(self.assemble(arr, starts))

    # ------------------------------------------------------------------ batches filled in place
    def converts(self, name: str) -> bool:
        """Whether variable ``name``'s raw values need work before they are output values (CF decoding,
        normalising, a cast to ``dtype=`` or to the stacked batch's dtype); else they are decoded
        straight into the batch."""
        return (self.decoders[name] is not identity or self.normalizer is not None
                or np.dtype(self.layouts[name].src.raw_dtype) != self.var_dtypes[name])

    def empty_batch(self, n: int) -> np.ndarray | dict[str, np.ndarray]:
        """The host arrays of a batch of ``n`` samples, to fill in place (``value_view``): the stacked
        batch, or one array per variable with a sample axis (``n`` first, then its output dims)."""
        if self.stack:
            return self.arrays.empty((n, len(self.channels), *self._stacked_shape()), self.dtype)
        out = {}
        for name, lay in self.layouts.items():
            if lay.has_sample_axis:
                out[name] = self.arrays.empty((n, *self._out_shape(lay)), self.var_dtypes[name])
        return out

    def _out_shape(self, lay: VarLayout) -> tuple[int, ...]:
        """One sample's shape of a variable (its output dims: window/patch widths, else whole)."""
        widths = {d.name: d.width for d in self.space.dims if d.keep}
        return tuple(widths.get(d, lay.src.shape[lay.src.dims.index(d)]) for d in lay.out_dims)

    def batch_nbytes(self, n: int) -> int:
        """Bytes of the host arrays of a batch of ``n`` samples (as ``empty_batch`` makes them)."""
        if self.stack:
            return n * len(self.channels) * int(np.prod(self._stacked_shape(), dtype=np.int64)) * self.dtype.itemsize
        return sum(n * int(np.prod(self._out_shape(lay), dtype=np.int64)) * self.var_dtypes[name].itemsize
                   for name, lay in self.layouts.items() if lay.has_sample_axis)

    def value_view(self, batch: np.ndarray | dict[str, np.ndarray], name: str, rows: slice) -> np.ndarray:
        """Where variable ``name``'s values of samples ``rows`` lie in ``batch`` (from ``empty_batch``), as a
        view shaped ``(rows, *its output dims)`` (its sample axis first; a variable without one: its own
        dims, broadcast over ``rows`` when stacked)."""
        lay = self.layouts[name]
        if not self.stack:
            return batch[name][rows]  # type: ignore[index]
        arr = cast(np.ndarray, batch)[rows]
        c0, extra = self._channel_slots[name]
        sizes = dict(zip(self.base_dims, arr.shape[2:], strict=True))
        for d in extra:
            sizes[d] = lay.src.shape[lay.src.dims.index(d)]
        part = arr[:, c0:c0 + int(np.prod([sizes[d] for d in extra], dtype=np.int64))]
        part = part.reshape(arr.shape[0], *[sizes[d] for d in extra], *arr.shape[2:])
        dims = list(lay.out_dims) if lay.has_sample_axis else list(lay.src.dims)
        have = [*extra, *self.base_dims]
        return part.transpose(0, *[have.index(d) + 1 for d in dims]) if have != dims else part

    @cached_property
    def _channel_slots(self) -> dict[str, tuple[int, list[str]]]:
        """Per variable of a stacked batch: its first channel and its extra (channel) dims, in order."""
        out: dict[str, tuple[int, list[str]]] = {}
        for c, ch in enumerate(self.channels):
            if ch.var not in out:
                lay = self.layouts[ch.var]
                dims = lay.out_dims if lay.has_sample_axis else lay.src.dims
                out[ch.var] = (c, [d for d in dims if d not in self.base_dims])
        return out

    def _stacked_shape(self) -> tuple[int, ...]:
        """The stacked batch's shape after its channel axis (the base dims)."""
        widths = {d.name: d.width for d in self.space.dims if d.keep}
        sizes: dict[str, int] = {}
        for lay in self.layouts.values():
            sizes.update(zip(lay.src.dims, lay.src.shape, strict=True))
        return tuple(widths.get(d, sizes[d]) for d in self.base_dims)

    def finish(self, batch: Any) -> Any:
        """``transform=`` on the host batch, then the ``device=`` copy (torch, cupy) or the move onto
        the jax device, of every array in whatever structure the transform returned: numpy arrays
        become arrays of the output kind on the device."""
        if self.transform is not None:
            try:
                batch = self.transform(batch)
            except Exception as e:
                # the caller gets the transform's own exception (type and traceback); say where it came from
                e.add_note("xinsitu: raised by transform= (applied to each batch in the prefetch thread)")
                raise
            if batch is None and not self._said_none:  # a function that changes its argument and returns nothing?
                self._said_none = True
                warnings.warn("transform= returned None, which is what the training loop gets as the batch: did it "
                              "forget `return batch`?", UserWarning, stacklevel=2)
        if self.mover is not None:
            return self.mover.move(batch)
        if self.output == "torch" and (self.device is not None or self.transform is not None):
            return _tree_map(batch, self._move_torch)
        if self.output == "jax":
            return _tree_map(batch, self._to_jax)
        return batch

    def hand_out(self, batch: Any) -> Any:
        """On the caller's thread, as ``batch`` is handed out: its device copies are made safe on the
        caller's current stream (a no-op without a CUDA device)."""
        return batch if self.mover is None else self.mover.hand_out(batch)

    def decode(self, raw: dict[str, np.ndarray], cast: bool = True) -> dict[str, np.ndarray]:
        """Raw values CF-decoded, normalised and (``cast``) cast to ``dtype=`` (a stacked batch casts as
        it stacks)."""
        values = {n: self.decoders[n](a) for n, a in raw.items()}
        if self.normalizer is not None:
            values = self.normalizer(values)
        if cast and self.out_dtype is not None:
            values = {n: a.astype(self.out_dtype, copy=False) for n, a in values.items()}
        return values

    def stacked(self, values: dict[str, np.ndarray], xp: Any = np) -> np.ndarray:
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
            a = xp.broadcast_to(a, (n, *a.shape[1:1 + len(extra)], *base_shape))
            parts.append(a.reshape(n, -1, *base_shape))
        if len(parts) == 1:
            return parts[0].astype(self.dtype, copy=False)
        empty = self.arrays.empty if xp is np else xp.empty
        out = empty((n, sum(p.shape[1] for p in parts), *base_shape), self.dtype)
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
        out = self.coords.isel({d: v for d, v in ind.items() if d in have})
        if _INDEX_VALUES_WRITABLE:
            out = out.assign_coords({k: xr.IndexVariable(v.dims, np.array(v.values), v.attrs, v.encoding)
                                     for k, v in out.variables.items() if isinstance(v, xr.IndexVariable)})
        return out

    def build(self, raw: dict[str, np.ndarray], starts: np.ndarray) -> Any:
        gpu = self.gpu
        if gpu is None:
            return self.finish(self._build_host(raw, starts))
        if self._device_ok is None:
            return self.finish(self._first_on_device(raw, starts))
        if not self._device_ok:  # the device's build failed its check: the host builds, as without a GPU
            return self.finish(self._build_host({n: self._host(a) for n, a in raw.items()}, starts))
        return self.finish(self._out(self._device_values(raw)))

    def _host(self, a: Any) -> Any:
        return self.gpu.to_host(a) if self.gpu.is_device(a) else a

    def _first_on_device(self, raw: dict[str, Any], starts: np.ndarray) -> Any:
        """The first batch built on the device, checked bit for bit against the host's build of it;
        where they differ (or the device's build fails), said once, and the host builds from then on."""
        host_raw = {n: self._host(a) for n, a in raw.items()}
        try:
            values = self._device_values(raw)
            ref = self.decode(host_raw, cast=not self.stack)
            if self.stack:
                ref = {"": self.stacked(ref)}
            got = {"": values} if self.stack else values
            for k, r in ref.items():
                g = self._host(got[k])
                if g.dtype != r.dtype or g.shape != r.shape or g.tobytes() != np.ascontiguousarray(r).tobytes():
                    raise ValueError(f"{k or 'the stacked batch'} built on the device differs from the host's")
            self._device_ok = True
            return self._out(values)
        except Exception as e:  # noqa: BLE001 - said, and the host builds
            warnings.warn(f"xinsitu: building batches on the GPU failed its check on the first batch "
                          f"({type(e).__name__}: {e}); they are built on the host and copied from now on",
                          RuntimeWarning, stacklevel=2)
            self._device_ok = False
            return self._build_host(host_raw, starts)

    def device_value(self, name: str, raw: Any) -> Any:
        """One variable's raw values (on the device, or the host) as its values on the device (the GPU path):
        CF decoding there (``channels.ArrayCF``) where array operations give xarray's values, else on the
        host as xarray does it; then normalising on the device (not cast to ``dtype=``)."""
        gpu = self.gpu
        dec = self.decoders[name]
        a = raw
        if dec is not identity:
            there = self.device_cf.get(name)
            a = there(a) if there is not None and gpu.is_device(a) else dec(self._host(a))
        if not gpu.is_device(a):
            a = gpu.asarray(a)
        if self.normalizer is not None and name in self.normalizer.params:
            a = self.normalizer.apply(name, a)
        return a

    def device_empty_batch(self, n: int) -> Any:
        """The device arrays of a batch of ``n`` samples (the GPU path), to fill in place (``value_view``): new
        ones each batch (handed out as they are), laid out as ``empty_batch``'s."""
        gpu = self.gpu
        if self.stack:
            return gpu.new((n, len(self.channels), *self._stacked_shape()), self.dtype)
        return {name: gpu.new((n, *self._out_shape(lay)), self.var_dtypes[name])
                for name, lay in self.layouts.items() if lay.has_sample_axis}

    def device_output(self, values: Any) -> Any:
        """A batch filled in place on the device as arrays of the output kind (complete when it returns)."""
        return self._out(values)

    def _device_values(self, raw: dict[str, Any]) -> Any:
        """The batch's values on the device (the GPU path, ``device_value``); then stacking on the device.
        Complete (the device's work done) when it returns."""
        gpu = self.gpu
        values = {n: self.device_value(n, a) for n, a in raw.items()}
        if self.out_dtype is not None and not self.stack:
            values = {n: a.astype(self.out_dtype, copy=False) for n, a in values.items()}
        out = self.stacked(values, gpu.xp) if self.stack else values
        gpu.synchronize()
        return out

    def _out(self, values: Any) -> Any:
        """The device's values as arrays of the output kind (complete when it returns)."""
        out = {n: self._device_out(a) for n, a in values.items()} if isinstance(values, dict) else \
            self._device_out(values)
        self.gpu.synchronize()
        return out

    def _device_out(self, a: Any) -> Any:
        """A device array of the GPU path as an array of the output kind: a tensor in torch's own memory
        (so that the hand-out ties it to the caller's stream, ``record_stream``), a CuPy array, a jax
        array sharing its memory."""
        if self.output == "torch":
            import torch

            if isinstance(a, np.ndarray):  # (the stand-in's)
                return torch.as_tensor(a)
            t = torch.empty(tuple(a.shape), dtype=torch.from_numpy(np.empty(0, a.dtype)).dtype, device=self.device)
            self.gpu.xp.asarray(t)[...] = a  # a device-to-device copy into torch's memory
            return t
        if self.output == "jax":
            import jax

            return jax.device_put(jax.dlpack.from_dlpack(a), self.device)
        return a  # cupy (numpy for the stand-in)

    def _build_host(self, raw: dict[str, np.ndarray], starts: np.ndarray) -> Any:
        return self.assemble(self.decode(raw, cast=not self.stack), starts)

    def assemble(self, values: Any, starts: np.ndarray) -> Any:
        """A batch of the output's kind (on the host) from its values (CF-decoded, normalised; cast to
        ``dtype=`` unless stacked), or from its stacked array where stacked already (``direct``)."""
        if not isinstance(values, dict):  # stacked already
            if self.output in ("dataarray", "xarray"):
                return self._labeled(values, starts)
            return self._to_torch(values) if self.output == "torch" else values
        if not self.stack:  # a batch owns its arrays: one shared by every batch (no split dim) is read-only
            values = {n: a if self.layouts[n].has_sample_axis else _readonly(a) for n, a in values.items()}
        if self.output == "xarray" and not self.stack:
            c = self.sample_coords(starts)
            data = {n: xr.Variable(self.dims_of(n), a, attrs=self.attrs[n]) for n, a in values.items()}
            return xr.Dataset(data, coords=c.coords, attrs=self.ds_attrs)
        if self.output in ("dataarray", "xarray"):  # xarray with stack=: the labeled stacked array
            return self._labeled(self.stacked(values), starts)
        if self.stack:
            arr = self.stacked(values)
            return self._to_torch(arr) if self.output == "torch" else arr
        if self.output == "torch":
            return {n: self._to_torch(a) for n, a in values.items()}
        return values  # cupy: host arrays until the device copy in finish

    def _labeled(self, arr: np.ndarray, starts: np.ndarray) -> xr.DataArray:
        """The stacked batch ``arr`` as a labeled ``xr.DataArray`` (``"dataarray"``, or ``"xarray"`` with stack=)."""
        c = self.sample_coords(starts)
        dims = ("sample", "variable", *self.base_dims)
        coords = {k: v for k, v in c.coords.items() if set(v.dims) <= set(dims)}  # e.g. not `level`
        return xr.DataArray(arr, dims=dims, coords={**coords, "variable": [ch.name for ch in self.channels]},
                            attrs=dict(self.ds_attrs))  # as to_dataarray keeps the Dataset's attrs

    def dims_of(self, name: str) -> tuple[str, ...]:
        """The dims of variable ``name`` in a batch (``"sample"`` first where it has a sample axis)."""
        lay = self.layouts[name]
        return ("sample", *lay.out_dims) if lay.has_sample_axis else lay.src.dims

    def _to_torch(self, arr: np.ndarray) -> Any:
        """A CPU tensor (the ``device=`` copy comes after ``transform=``, in :meth:`finish`)."""
        import torch

        return torch.from_numpy(np.ascontiguousarray(arr) if arr.flags.writeable else arr.copy())

    def _move_torch(self, t: Any) -> Any:
        """One array of the batch onto a non-CUDA ``device=`` (CUDA devices go through ``mover``), or, without
        one, as it is on the CPU: a numpy array (a transform's) becomes a tensor, as the output's own arrays are."""
        import torch

        if isinstance(t, np.ndarray) and t.dtype.kind in NUMERIC_KINDS:
            t = self._to_torch(t)
        if not isinstance(t, torch.Tensor) or self.device is None:
            return t
        return t.to(torch.device(self.device))

    def _to_jax(self, a: Any) -> Any:
        """A numeric numpy array (or CPU torch tensor, from a transform) as a ``jax.Array`` on the
        builder's device; anything else as it is. ``jax.device_put`` onto a CPU device aliases
        suitably aligned host memory (no copy)."""
        host = host_numpy(a)
        if host is None:
            return a
        a = host
        import jax

        _check_jax_dtype("an array of the transformed batch", a.dtype)
        return jax.device_put(a, self.device)


def with_dim_indexes(x: Any) -> Any:
    """``x`` (a Dataset or DataArray: one sample taken out of a batch) with an index on each dim's own
    coordinate that lacks one, as ``isel`` keeps it (along ``sample`` a window's times or a tile's lat/lon
    are coordinates of two dims, without an index)."""
    own = {k: v.variable for k, v in x.coords.items() if v.dims == (k,) and k not in x.indexes}
    return x.drop_vars(list(own)).assign_coords(own) if own else x


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a`` (SPEC §4: a batch owns its arrays; a variable without the split dim is
    the same values in every batch)."""
    if not a.flags.writeable:
        return a
    view = a.view()
    view.flags.writeable = False
    return view


class UnknownDtypeError(ValueError, TypeError):
    """``dtype=`` that numpy does not know: a wrong value (``"float33"``, so a ``ValueError``) or a wrong
    type (``3``, so a ``TypeError``), as numpy itself calls both a ``TypeError``."""


#: what a refusal of bfloat16 adds: numpy has no bfloat16 of its own (ml_dtypes' is not numeric to numpy)
_BF16 = ("; bfloat16 is not an output dtype: take float32 (or float16) and cast on the device, in the model "
         "or in transform=")


def output_dtype(dtype: Any) -> np.dtype | None:
    """``dtype=`` as a numpy dtype (None: the values' own); a dtype numpy does not know, or one that is
    not numeric (bool, strings, datetimes, objects), raises naming ``dtype``."""
    if dtype is None:
        return None
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise UnknownDtypeError(f"dtype: numpy does not know {dtype!r} as a dtype ({e}); use e.g. 'float32'"
                                f"{_BF16 if 'bfloat16' in str(dtype) else ''}") from None
    if dt.kind not in NUMERIC_KINDS or dt.kind == "b":
        raise ValueError(f"dtype: {dtype!r} ({dt}) is not a numeric dtype; use e.g. 'float32', 'float16' or 'float64'"
                         f"{_BF16 if 'bfloat16' in str(dt) else ''}")
    return dt


#: jax (XLA) aliases host memory aligned to this many bytes instead of copying it
JAX_ALIGN = 64


class BatchArrays:
    """The memory of stacked batches: an array handed out before is taken back, once nothing outside
    holds it (no batch, tensor, view or jax array made from it: its reference count says so), for a
    batch of the same size (an ``xinsitu.io.mempool.ArrayPool`` that counts references).

    Fresh memory costs a page fault per page on first touch, and a batch of a few MB is fresh memory
    every time (glibc maps and unmaps it): on the yardstick's cold epoch, 14k page faults and a third
    of the CPU time. Holds at most ``KEEP`` arrays: the batches in the prefetch queue, the one being
    gathered, the user's, and two more. Aligned to ``JAX_ALIGN`` bytes (numpy aligns to 16), so that
    ``output="jax"`` on a CPU device takes a stacked batch without a copy."""

    KEEP = 6

    def __init__(self, alloc: Any = None) -> None:
        self._pool = ArrayPool(self.KEEP, alloc, counted=True)  # taken back by reference count

    @property
    def alloc(self) -> Any:
        """``fn(nbytes) -> uint8 array`` making new memory (page-locked memory for a device copy), else None
        (``np.empty``); may be set after the fact (``OutputBuilder`` wires its device mover's)."""
        return self._pool.alloc

    @alloc.setter
    def alloc(self, fn: Any) -> None:
        self._pool.alloc = fn

    def __reduce__(self) -> tuple[Any, ...]:  # a copy (a worker process's) starts with none held
        return (BatchArrays, ())

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        dtype = np.dtype(dtype)
        if dtype.hasobject:  # cftime dates, a masked bool: objects, not bytes of a pooled buffer
            return np.empty(shape, dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = self._pool.take((nbytes + JAX_ALIGN,), np.uint8)
        off = (-raw.ctypes.data) % JAX_ALIGN
        return raw[off:off + nbytes].view(dtype).reshape(shape)


#: dtypes (``np.dtype.str``) jax was found to take
_JAX_DTYPES: set[str] = set()


def _check_jax_dtype(what: str, dtype: Any) -> None:
    """Refuse a dtype jax has no array type for (float128, a non-native byte order), and 64-bit values
    while jax has 64-bit types off: jax would silently make them 32-bit, and the batch would no longer
    equal the numpy output."""
    import jax

    dtype = np.dtype(dtype)
    name = repr(what) if what.isidentifier() else what
    if dtype.str not in _JAX_DTYPES:
        try:
            jax.device_put(np.zeros(0, dtype), jax.devices("cpu")[0])
        except TypeError:
            raise TypeError(f"dtype: output='jax' has no array type for {dtype} ({name}); use e.g. "
                            "'float32'") from None
        _JAX_DTYPES.add(dtype.str)
    wide = dtype.itemsize // (2 if dtype.kind == "c" else 1) == 8  # complex64 is two 32-bit parts
    if wide and dtype.kind in "fiuc" and not jax.config.read("jax_enable_x64"):
        narrow = np.dtype({"f": "float32", "i": "int32", "u": "uint32", "c": "complex64"}[dtype.kind])
        raise ValueError(f"output='jax': {name} is {dtype}, but jax has 64-bit types off and would turn it into "
                         f"{narrow}; enable them (jax.config.update('jax_enable_x64', True)), leave the "
                         "variable out (variables=[...]), or cast it (dtype='float32', or in transform=)")


def _check_torch_dtype(what: str, dtype: Any, asked: Any) -> None:
    """Refuse a dtype torch has no tensor type for (e.g. float128, a non-native byte order): else the
    first batch would fail in torch, in the prefetch thread, without naming ``dtype``."""
    import torch

    try:
        torch.from_numpy(np.empty(0, np.dtype(dtype)))
    except (TypeError, ValueError):  # ValueError: another byte order
        name = repr(what) if what.isidentifier() else what
        hint = ("leave it out (variables=[...]) or cast it (dtype='float32', or in transform=)" if asked is None
                else "use e.g. 'float32'")
        raise TypeError(f"dtype: output='torch' has no tensor type for {np.dtype(dtype)} ({name}); "
                        f"{hint}") from None


def _jax_device(device: Any) -> Any:
    """The jax device of ``device=`` (None: jax's default device); a torch-style string is refused."""
    try:
        import jax
    except ImportError:
        raise RuntimeError("output='jax' needs jax: pip install 'xinsitu[jax]'") from None
    if device is None:
        return None  # jax.device_put(x, None): jax's default device (honours jax.default_device)
    if isinstance(device, jax.Device):
        return device
    raise TypeError(f"device= for output='jax' takes a jax device (e.g. jax.devices('cpu')[0] or "
                    f"jax.devices()[0]), got {device!r}")
