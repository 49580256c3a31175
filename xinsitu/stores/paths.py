"""What a local path given to ``open_zarr`` holds where it is no zarr store, and what opens it instead."""

from __future__ import annotations

import os

#: a file's first bytes -> what it is and what opens it in place
_MAGIC = (
    (b"CDF\x01", "a NetCDF-3 file", "xinsitu.virtual.open_netcdf(path)"),
    (b"CDF\x02", "a NetCDF-3 file", "xinsitu.virtual.open_netcdf(path)"),
    (b"CDF\x05", "a NetCDF-3 (CDF-5) file", "xinsitu.virtual.open_netcdf(path)"),
    (b"\x89HDF\r\n\x1a\n", "a NetCDF-4/HDF5 file", "xinsitu.virtual.open_netcdf(path)"),
    (b"GRIB", "a GRIB file", "xinsitu.virtual.open_grib(path)"),
    (b"{", "a JSON file (kerchunk references?)",
     "VirtualiZarr's KerchunkJSONParser into a ManifestStore, then xr.open_zarr(store)"),
)


def check_zarr_path(path: str) -> None:
    """Refuse a local ``path`` (absolute) that is no zarr store ``open_zarr`` can open: ``ValueError`` naming what
    it holds and what opens it (``_not_a_zarr_store``), ``FileNotFoundError`` where nothing is there."""
    why = _not_a_zarr_store(path)
    if why is not None:
        raise ValueError(why)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no zarr store at {path!r}")


def _not_a_zarr_store(path: str) -> str | None:
    """Why ``path`` (absolute) is no zarr store that ``open_zarr`` can open, naming what opens it; None where it
    may be one (a directory that is not an Icechunk repository), or is nothing."""
    if os.path.isfile(path):
        with open(path, "rb") as f:
            head = f.read(8)
        for magic, what, opener in _MAGIC:
            if head.startswith(magic):
                return f"{path!r} is {what}, not a zarr store: open it with {opener}"
        return f"{path!r} is a file, not a zarr store (a directory)"
    if any(os.path.exists(os.path.join(path, m)) for m in ("zarr.json", ".zgroup", ".zattrs", ".zmetadata")):
        return None  # a zarr group (whatever its groups are named)
    has = {n for n in ("refs", "snapshots", "repo", "config.yaml") if os.path.exists(os.path.join(path, n))}
    if "snapshots" in has and has & {"refs", "repo", "config.yaml"}:  # (Icechunk 1.x: refs/; 2.x: a repo file)
        return (f"{path!r} is an Icechunk repository, not a zarr store: open a session of it, "
                "xinsitu.open_zarr(icechunk.Repository.open(icechunk.local_filesystem_storage(path))"
                ".readonly_session('main').store)")
    return None
