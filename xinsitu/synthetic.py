"""A small synthetic ERA5-like archive, for the demo, the tests and the docs.

time x lat x lon, 6-hourly; float32 ``t2m``, ``u10``, ``v10``, ``z500``; ``tp`` stored
as int16 packed with ``scale_factor``/``add_offset``/``_FillValue`` (with some missing
values); a static ``lsm(lat, lon)``. Smooth fields plus noise, so compressors see
realistic ratios.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

FLOAT_VARS = ("t2m", "u10", "v10", "z500")

#: what zarr says each time it writes consolidated metadata into a Zarr v3 archive
_CONSOLIDATED_V3 = "Consolidated metadata is currently not part"


def _to_zarr(ds: xr.Dataset, path: str | os.PathLike, **kwargs: Any) -> None:
    """``ds.to_zarr(path, **kwargs)`` without zarr's note that consolidated metadata is not part of the
    Zarr v3 specification (asked for here on purpose: a plain HTTP server needs it); every other warning
    shows as usual."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_CONSOLIDATED_V3)
        ds.to_zarr(path, **kwargs)


def era5_like(nt: int = 1460, ny: int = 32, nx: int = 64, seed: int = 0) -> xr.Dataset:
    """An in-memory ERA5-like Dataset (decoded values; ``tp`` carries its packing in encoding)."""
    rng = np.random.default_rng(seed)
    t = np.arange(nt, dtype=np.float64)[:, None, None]
    lat = np.linspace(90, -90, ny)
    lon = np.linspace(0, 360, nx, endpoint=False)
    la = np.deg2rad(lat)[None, :, None]
    lo = np.deg2rad(lon)[None, None, :]
    year, day = 2 * np.pi * t / 1460.0, 2 * np.pi * t / 4.0
    wave = np.cos(la) ** 2 * np.sin(3 * lo - 0.35 * t / 4.0 + 2 * la)
    noise = rng.standard_normal((4, nt, ny, nx))
    fields = {
        "t2m": 288.0 - 40.0 * np.sin(la) ** 2 + 12.0 * np.cos(year) * np.sin(la) + 4.0 * np.cos(day + lo)
        * np.cos(la) + 5.0 * wave + 0.5 * noise[0],
        "u10": 6.0 * np.cos(2 * la) * np.cos(la) + 4.0 * wave + noise[1],
        "v10": 4.0 * np.roll(wave, 3, axis=-1) + noise[2],
        "z500": 57000.0 - 4000.0 * np.sin(la) ** 2 + 900.0 * wave + 20.0 * noise[3],
    }
    tp = np.clip(2.0 * wave + 0.5 * noise[0], 0, None) * 3.0
    tp[rng.random(tp.shape) < 0.01] = np.nan  # missing observations -> _FillValue
    data: dict[str, tuple[tuple[str, ...], np.ndarray]] = {
        k: (("time", "lat", "lon"), v.astype("float32")) for k, v in fields.items()}
    data["tp"] = (("time", "lat", "lon"), tp.astype("float32"))
    data["lsm"] = (("lat", "lon"), (np.cos(3 * np.deg2rad(lon))[None, :] * np.cos(la[0]) > 0.2).astype("float32"))
    ds = xr.Dataset(
        data,
        coords={"time": pd.date_range("1979-01-01", periods=nt, freq="6h"),
                "lat": lat.astype("float32"), "lon": lon.astype("float32")},
        attrs={"title": "synthetic ERA5-like archive (xinsitu)"},
    )
    units = {"t2m": "K", "u10": "m s-1", "v10": "m s-1", "z500": "m2 s-2", "tp": "mm", "lsm": "1"}
    for k, u in units.items():
        ds[k].attrs["units"] = u
    return ds


def packing() -> dict[str, Any]:
    """How ``tp`` is packed on disk: int16 with scale/offset and a fill value."""
    return {"dtype": "int16", "scale_factor": 0.001, "add_offset": 30.0, "_FillValue": -32768}


def write_era5_like(path: str | os.PathLike, nt: int = 1460, ny: int = 32, nx: int = 64, chunk_time: int = 24,
                    zarr_format: int = 3, seed: int = 0, shard_time: int | None = None,
                    chunk_space: tuple[int, int] | None = None, consolidated: bool = True) -> xr.Dataset:
    """Write :func:`era5_like` to ``path`` as Zarr and return it: chunked along time only, or also in
    ``(lat, lon)`` tiles of ``chunk_space``.

    ``consolidated=True`` writes consolidated metadata (what a plain HTTP server needs: it cannot
    list), without zarr's warning that it is not part of the Zarr v3 specification. An archive read
    from local disk or object storage does not need it (``consolidated=False``)."""
    ds = era5_like(nt, ny, nx, seed)
    cy, cx = chunk_space or (ny, nx)
    enc: dict[str, dict[str, Any]] = {}
    for v in ds.data_vars:
        chunks = (chunk_time, cy, cx) if "time" in ds[v].dims else (cy, cx)
        e: dict[str, Any] = {"chunks": chunks}
        if shard_time and "time" in ds[v].dims and zarr_format == 3:
            e["shards"] = (shard_time, ny, nx)
        enc[str(v)] = e
    enc["tp"].update(packing())
    _to_zarr(ds, path, mode="w", zarr_format=zarr_format, encoding=enc, consolidated=consolidated)
    return ds


LEVELS = (500, 700, 850)


def weatherbench_like(nt: int = 1460, ny: int = 32, nx: int = 64, seed: int = 0) -> xr.Dataset:
    """A WeatherBench-like Dataset: surface ``t2m``, ``msl`` (time, lat, lon) and ``z``, ``u``, ``v`` on
    three pressure levels (time, level, lat, lon), float32, 6-hourly from 1979."""
    base = era5_like(nt, ny, nx, seed)
    scale = np.array(LEVELS, dtype=np.float32)[None, :, None, None] / 500.0
    data = {"t2m": base["t2m"], "msl": (base["z500"] * 1.78).astype("float32").rename("msl")}
    for name, src, offset in (("z", "z500", -25000.0), ("u", "u10", 0.0), ("v", "v10", 0.0)):
        v = base[src].values[:, None]
        data[name] = xr.DataArray((v / scale + offset * (scale - 1)).astype("float32"),
                                  dims=("time", "level", "lat", "lon"))
    ds = xr.Dataset(data, coords={**base.coords, "level": np.array(LEVELS, dtype=np.int32)},
                    attrs={"title": "synthetic WeatherBench-like archive (xinsitu)"})
    for k, u in {"t2m": "K", "msl": "Pa", "z": "m2 s-2", "u": "m s-1", "v": "m s-1"}.items():
        ds[k].attrs["units"] = u
    return ds


def write_weatherbench_like(path: str | os.PathLike, nt: int = 1460, ny: int = 32, nx: int = 64, chunk_time: int = 24,
                            zarr_format: int = 3, seed: int = 0, consolidated: bool = True) -> xr.Dataset:
    """Write :func:`weatherbench_like` to ``path`` as Zarr (chunked along time, all levels in a chunk)."""
    ds = weatherbench_like(nt, ny, nx, seed)
    enc = {str(v): {"chunks": (chunk_time,) + ds[v].shape[1:]} for v in ds.data_vars}
    _to_zarr(ds, path, mode="w", zarr_format=zarr_format, encoding=enc, consolidated=consolidated)
    return ds
