"""URLs and paths -> obstore stores; ``open_zarr`` on top of them.

Options go to obstore unchanged (``config`` keys such as credentials and endpoint as
keyword arguments, ``client_options``, ``retry_config``, ``credential_provider``).
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

import xarray as xr

_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss", "adl", "http", "https", "file", "memory")


def make_store(url: str | os.PathLike, **options: Any) -> Any:
    """An obstore store for a URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``file://``,
    ``memory://``) or a local path."""
    import obstore.store

    s = os.fspath(url)
    scheme = urlsplit(s).scheme.lower()
    if scheme not in _SCHEMES or (len(scheme) == 1 and os.name == "nt"):
        if "://" in s:
            raise ValueError(f"unsupported URL scheme {scheme!r} in {_redact(s)}; use one of {_SCHEMES} or a path")
        path = os.path.abspath(os.path.expanduser(s))
        if not os.path.isdir(path):
            raise FileNotFoundError(f"no zarr store at {path!r}")
        return obstore.store.LocalStore(prefix=path)
    if scheme == "http":
        client = dict(options.pop("client_options", None) or {})
        client.setdefault("allow_http", True)
        options["client_options"] = client
    return obstore.store.from_url(s, **options)


def _redact(url: str) -> str:
    """A URL without user info or query string (signed URLs carry credentials there)."""
    p = urlsplit(url)
    host = p.hostname or ""
    if p.port:
        host += f":{p.port}"
    return f"{p.scheme}://{host}{p.path}" + ("?…" if p.query else "")


def open_zarr(store: Any, *, consolidated: bool | None = None, group: str | None = None,
              decode_times: bool = True, **store_options: Any) -> xr.Dataset:
    """Open a Zarr v2/v3 archive lazily (no dask), reading through obstore.

    Parameters
    ----------
    store : URL, local path, obstore store, or zarr v3 store object
        ``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``file://``, ``memory://`` or a path;
        or a store already built (``zarr.storage.ObjectStore``, ``LocalStore``, an Icechunk
        session's ``store``...).
    consolidated : use consolidated metadata (None: if present). Needed over plain HTTP.
    group : path of the group inside the store.
    decode_times : passed to xarray.
    **store_options : obstore options (credentials, ``endpoint``, ``region``,
        ``client_options``, ``retry_config``...), for URLs and paths only.

    Returns
    -------
    xr.Dataset
        Lazily indexed (numpy-backed on access, no dask); ``ds.insitu`` reads it in place.
    """
    import zarr.storage

    if isinstance(store, (str, os.PathLike)):
        zstore = zarr.storage.ObjectStore(make_store(store, **store_options), read_only=True)
    else:
        if store_options:
            raise TypeError(f"store options {sorted(store_options)} apply to URLs and paths only, "
                            "not to a store object")
        mod = type(store).__module__
        zstore = zarr.storage.ObjectStore(store, read_only=True) if mod.startswith("obstore") else store
    try:
        return xr.open_zarr(zstore, chunks=None, consolidated=consolidated, group=group,
                            decode_times=decode_times)
    except FileNotFoundError as e:
        where = _redact(os.fspath(store)) if isinstance(store, (str, os.PathLike)) else type(store).__name__
        raise FileNotFoundError(f"no zarr group found at {where}: {e}") from None
