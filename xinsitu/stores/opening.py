"""URLs and paths -> obstore stores; ``open_zarr`` on top of them.

Options go to obstore unchanged (``config`` keys such as credentials and endpoint as
keyword arguments, ``client_options``, ``retry_config``, ``credential_provider``), over
defaults tuned for training: long transfers are allowed, stalls are caught by a read
timeout, and transient faults are retried with backoff (see ``DEFAULT_CLIENT_OPTIONS`` and
``DEFAULT_RETRY_CONFIG``). Credentials are never put in messages: ``xinsitu.stores.redact`` scrubs
them. The metadata reads of an open are bounded and checked (``xinsitu.stores.reads``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, cast
from urllib.parse import urlsplit

import numpy as np
import pandas as pd
import xarray as xr

from xinsitu.index.source import CONSOLIDATED_WARNING
from xinsitu.index.xr_adapter import (
    CACHING,
    ELEMENTWISE,
    LAZY,
    closer,
    decode_cf_datetime,
    is_zarr_wrapper,
    lazy_key,
    variable_data,
    zarr_array_of,
    zarr_group_of,
)
from xinsitu.stores.memo import ByIdentity
from xinsitu.stores.paths import check_zarr_path
from xinsitu.stores.reads import _checked_store, bounded_store
from xinsitu.stores.redact import (
    RecordingProvider,
    _chain_text,
    opening_error,
    redact,
    redact_url,
    scrubbed,
    secrets_in_options,
    secrets_of,
    userinfo_as_header,
)

_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss", "adl", "http", "https", "file", "memory")
_REMOTE = ("s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss", "adl", "http", "https")
_SIGNED = ("s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss", "adl")

#: HTTP client defaults for remote stores; ``client_options=`` keys override them one by one.
#: obstore's own 30 s limit on a whole request would kill (and retry forever) large chunks
#: fetched many at a time on a slow link, so the whole-request limit is long and a stalled
#: transfer is caught by the read timeout instead (no byte for 30 s).
DEFAULT_CLIENT_OPTIONS: dict[str, Any] = {
    "connect_timeout": "10s",
    "read_timeout": "30s",
    "timeout": "300s",
}

#: Retry defaults for remote stores; ``retry_config=`` keys override them one by one
#: (``{"max_retries": 0}`` turns retries off). 5xx answers, dropped connections, cut
#: bodies and timeouts are retried with exponential backoff and jitter.
DEFAULT_RETRY_CONFIG: dict[str, Any] = {
    "max_retries": 12,
    "retry_timeout": timedelta(minutes=4),  # obstore advises < 5 min (signed requests expire)
    # obstore draws each wait at random between init_backoff and base x the last one: with base 2 the
    # waits hardly grow (10 retries spanned 1.3-2.6 s, and a 6 s burst of 503s ended an epoch). With
    # these, 12 retries span at least 8 s in 999 of 1000 draws, 30 s typically, and at most 45 s: within
    # the request bound (60 s), so a server that always answers 5xx (501 to HEAD) is given up, not timed out
    "backoff": {"init_backoff": timedelta(milliseconds=250), "max_backoff": timedelta(seconds=4), "base": 4},
}


def make_store(url: str | os.PathLike, **options: Any) -> Any:
    """An obstore store for a URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``file://``,
    ``memory://``) or a local path.

    ``anonymous=True`` reads a public bucket without credentials (obstore's
    ``skip_signature``). For remote URLs, ``client_options`` and ``retry_config`` are laid
    over ``DEFAULT_CLIENT_OPTIONS`` and ``DEFAULT_RETRY_CONFIG``; ``http://`` allows plain
    HTTP without an option.
    """
    import obstore.store

    s = os.fspath(url)
    scheme = urlsplit(s).scheme.lower()
    anonymous = options.pop("anonymous", None)
    if scheme not in _SCHEMES or (len(scheme) == 1 and os.name == "nt"):
        if "://" in s:
            raise ValueError(f"unsupported URL scheme {scheme!r} in {redact_url(s)}; use one of {_SCHEMES} or a path")
        if options or anonymous is not None:
            raise TypeError(f"store options {sorted(options)} apply to URLs, not to a local path")
        path = os.path.abspath(os.path.expanduser(s))
        check_zarr_path(path)
        return obstore.store.LocalStore(prefix=path)
    if anonymous is not None:
        if scheme not in _SIGNED and scheme not in ("http", "https"):
            raise TypeError(f"anonymous= applies to object storage URLs, not to {scheme}://")
        if scheme in _SIGNED or _signed_https(s):
            options.setdefault("skip_signature", bool(anonymous))
    if scheme == "memory" and not options:  # a new, empty store whatever its name (obstore takes none)
        return obstore.store.MemoryStore()
    if scheme == "file":
        path = urlsplit(s).path
        if not os.path.isdir(path):  # (obstore: "Unable to canonicalize filesystem root")
            raise FileNotFoundError(f"no zarr store at {s!r}")
    provider = options.get("credential_provider")
    if provider is not None and not isinstance(provider, RecordingProvider):
        options["credential_provider"] = RecordingProvider(provider)
    if scheme in _REMOTE:
        # yours over the environment's (AWS_ALLOW_HTTP...) over xinsitu's: obstore takes one
        # ``client_options`` whole, and would otherwise drop what it read from the environment
        client = DEFAULT_CLIENT_OPTIONS | env_client_options(s) | dict(options.pop("client_options", None) or {})
        # a client option given beside the store's own (open_zarr(url, endpoint=..., allow_http=True)): obstore
        # takes it only in client_options, and panicked ("Expected config prefix to start with aws_")
        client |= {k: options.pop(k) for k in _CLIENT_KEYS if k in options}
        if scheme == "http":
            client.setdefault("allow_http", True)
        options["client_options"] = client
        if scheme in ("http", "https"):
            s = userinfo_as_header(s, options)
        options["retry_config"] = _merge_retry(options.pop("retry_config", None))
    try:
        return obstore.store.from_url(s, **options)
    except Exception as e:  # noqa: BLE001 - re-raised without the credentials it may quote
        err = scrubbed(e, secrets_in_options(s, options))
    raise err  # out of the except block: obstore's error (which may quote them) is not its __context__


#: ``client_options`` keys obstore also reads from ``<PREFIX>_<KEY>`` environment variables
_CLIENT_KEYS = ("allow_http", "allow_invalid_certificates", "connect_timeout", "default_content_type",
                "http1_only", "http2_only", "http2_keep_alive_interval", "http2_keep_alive_timeout",
                "http2_keep_alive_while_idle", "pool_idle_timeout", "pool_max_idle_per_host", "proxy_url",
                "proxy_ca_certificate", "proxy_excludes", "randomize_addresses", "timeout", "user_agent")


def env_client_options(url: str) -> dict[str, str]:
    """Client options set in the environment for ``url``'s kind of store (``AWS_ALLOW_HTTP=true``
    for ``s3://``, ``AZURE_...`` for ``az://``, ``GOOGLE_...`` for ``gs://``)."""
    p = urlsplit(url)
    scheme, host = p.scheme.lower(), (p.hostname or "").lower()
    if scheme in ("s3", "s3a") or host.endswith(("amazonaws.com", "r2.cloudflarestorage.com")):
        prefix = "AWS_"
    elif scheme in ("gs", "gcs"):
        prefix = "GOOGLE_"
    elif scheme in ("az", "azure", "abfs", "abfss", "adl") or _signed_https(url):
        prefix = "AZURE_"
    else:
        return {}
    return {k: os.environ[prefix + k.upper()] for k in _CLIENT_KEYS if os.environ.get(prefix + k.upper())}


def _signed_https(url: str) -> bool:
    """Whether obstore reads this https URL as S3 or Azure (which sign requests), not plain HTTP."""
    host = (urlsplit(url).hostname or "").lower()
    return host.endswith(("amazonaws.com", "r2.cloudflarestorage.com", "blob.core.windows.net",
                          "dfs.core.windows.net", "blob.fabric.microsoft.com", "dfs.fabric.microsoft.com"))


def _merge_retry(user: dict[str, Any] | None) -> dict[str, Any]:
    out = dict(DEFAULT_RETRY_CONFIG)
    user = dict(user or {})
    if "backoff" in user:
        out["backoff"] = dict(DEFAULT_RETRY_CONFIG["backoff"]) | dict(user.pop("backoff") or {})
    return out | user




# ----------------------------------------------------------------------------- open
def open_zarr(store: Any, *, consolidated: bool | None = None, group: str | None = None,
              decode_times: Any = True, decode_cf: bool | None = None, mask_and_scale: bool | None = None,
              decode_timedelta: Any = None, drop_variables: Any = None, decode_coords: Any = None,
              use_cftime: bool | None = None, concat_characters: bool | None = None, chunks: Any = None,
              **store_options: Any) -> xr.Dataset:
    """Open a Zarr v2/v3 archive lazily (no dask), reading through obstore.

    Parameters
    ----------
    store : URL, local path, obstore store, or zarr v3 store object
        ``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``file://``, ``memory://`` or a path;
        or a store already built (``zarr.storage.ObjectStore``, ``LocalStore``, an Icechunk
        session's ``store``...).
    consolidated : use consolidated metadata (None: if present). Over plain HTTP without it, the
        arrays are found from the server's directory index pages (as fsspec finds them), else
        from WebDAV; a server with neither raises at once, saying so.
    group : path of the group inside the store.
    decode_times : passed to xarray. One departure from xarray's default (True): an integer time
        axis xarray would leave as ``cftime`` objects only because its dates are out of
        ``datetime64[ns]``'s range (an hourly axis past 2262) is decoded to ``datetime64[s]``, as
        ``xr.coders.CFDatetimeCoder(time_unit="s")`` decodes it; for ``cftime`` objects pass
        ``xr.coders.CFDatetimeCoder(use_cftime=True)``.
    decode_cf, mask_and_scale, decode_timedelta, drop_variables, decode_coords, concat_characters : passed to
        xarray, as ``xr.open_zarr`` takes them (None: xarray's default).
    use_cftime : as ``xr.open_zarr`` takes it: ``decode_times=xr.coders.CFDatetimeCoder(use_cftime=...)``.
    chunks : None only: the Dataset is read without dask (``xr.open_zarr(..., chunks=...)`` gives a
        dask-backed one, which ``ds.insitu`` reads too).
    **store_options : obstore options, for URLs only: credentials and other per-store
        config (``access_key_id``, ``secret_access_key``, ``session_token``, ``endpoint``,
        ``region``, ``skip_signature``...; ``anonymous=True`` is ``skip_signature=True``),
        ``client_options`` (timeouts, ``allow_http``...) and ``retry_config``, each laid
        over ``DEFAULT_CLIENT_OPTIONS`` / ``DEFAULT_RETRY_CONFIG`` key by key.

    Returns
    -------
    xr.Dataset
        Lazily indexed (numpy-backed on access, no dask); ``ds.insitu`` reads it in place.

    Raises
    ------
    TypeError
        ``group`` not a str, ``consolidated`` not a bool or None, ``decode_times`` a string or a
        number (the message names the argument).
    TimeoutError
        A metadata object got no answer within ``XINSITU_REQUEST_TIMEOUT`` seconds, three times
        (the message names the object and the store).

    Examples
    --------
    >>> ds = xinsitu.open_zarr("s3://bucket/era5.zarr", region="us-east-1")  # doctest: +SKIP
    >>> ds = xinsitu.open_zarr("s3://bucket/era5.zarr", endpoint="http://127.0.0.1:9000",
    ...                        access_key_id="...", secret_access_key="...",
    ...                        client_options={"allow_http": True},
    ...                        retry_config={"max_retries": 3})  # doctest: +SKIP
    >>> ds = xinsitu.open_zarr("s3://public-bucket/era5.zarr", anonymous=True)  # doctest: +SKIP
    """

    _check_open_arguments(consolidated, group, decode_times, use_cftime, chunks)
    _check_store_arguments(store, store_options)
    if use_cftime is not None and decode_times is not False:  # (a coder of the user's is refused above)
        decode_times = xr.coders.CFDatetimeCoder(use_cftime=bool(use_cftime))
    decoding = {k: v for k, v in dict(decode_cf=decode_cf, mask_and_scale=mask_and_scale,
                                      decode_timedelta=decode_timedelta, drop_variables=drop_variables,
                                      decode_coords=decode_coords, concat_characters=concat_characters).items()
                if v is not None}
    if decode_cf is False:
        decode_times = False
    secrets: list[str] = []
    if isinstance(store, (str, os.PathLike)):
        url = os.fspath(store)
        secrets = secrets_in_options(url, store_options)
        obs = make_store(store, **store_options)
        secrets += secrets_of(obs)  # (what the store was built with: the header a URL's user info became too)
        zstore = _checked_store()(obs, read_only=True)
        where = redact_url(url) if "://" in url else url
    else:
        if store_options:
            raise TypeError(f"store options {sorted(store_options)} apply to URLs and paths only, "
                            "not to a store object")
        # the same kind of store, each request bounded in time (and retried, for fsspec's): one that
        # never answers is named in seconds, not waited for (an Icechunk or a local store as it is)
        zstore = bounded_store(store, others=False)
        obs = getattr(zstore, "store", None)
        secrets = secrets_of(obs) if type(obs).__module__.startswith("obstore") else []
        where = type(store).__name__
    # each error is raised out of the except block that made it: the one caught (obstore's, which may quote
    # a credential) is not its __context__
    err: BaseException | None
    try:
        ds = _open_xr(zstore, consolidated, group, decode_times, decoding)
        # without consolidated metadata the arrays are listed in no fixed order (an Icechunk
        # repository's differs from process to process): sort them, so channels never permute
        return ds if _read_consolidated(ds, zstore, group, consolidated) else _by_name(ds)
    except TimeoutError as e:  # the store does not answer: asking it more (is it an array?) would wait again
        text = _chain_text(e)
        if redact(text, secrets) == text:
            raise
        err = scrubbed(e, secrets)
    except FileNotFoundError as e:
        err = _array_error(zstore, group, where) or \
            FileNotFoundError(f"no zarr group found at {where}: {scrubbed(e, secrets)}")
    except KeyError as e:  # zarr's for a group the consolidated metadata lacks; xarray's for v3 arrays without dims
        err = _no_dims_error(zstore, group, where) if "dimension_names" in str(e) else None
        if err is None and group is None:
            raise
        err = err or ValueError(f"group={group!r}: no such group in {where} ({scrubbed(e, secrets)})")
    except Exception as e:
        err = _array_error(zstore, group, where)
        if err is None and isinstance(e, TypeError) and "prototype" in str(e):  # xarray's, for v2 arrays without dims
            err = _no_dims_error(zstore, group, where)
        if err is None:
            text = _chain_text(e)
            # obstore's errors become the builtin ones (PermissionError...); none may quote a credential
            if not type(e).__module__.startswith("obstore") and redact(text, secrets) == text:
                raise
            err = opening_error(e, secrets, where)
    raise err


def _check_open_arguments(consolidated: Any, group: Any, decode_times: Any, use_cftime: Any = None,
                          chunks: Any = None) -> None:
    """TypeError naming the argument where ``open_zarr`` is given a value xarray would misread
    (a string for a flag, a number for a group); ValueError for what it does not do (``chunks``: dask) or
    what contradicts itself (``use_cftime`` beside a ``decode_times`` coder)."""
    if chunks is not None:
        raise ValueError(f"chunks={chunks!r}: xinsitu.open_zarr reads without dask; for dask arrays open with "
                         "xr.open_zarr(..., chunks=...), whose Dataset ds.insitu reads too")
    if use_cftime is not None:
        if not isinstance(use_cftime, (bool, np.bool_)):
            raise TypeError(f"use_cftime must be True, False or None, got {type(use_cftime).__name__}: {use_cftime!r}")
        if decode_times not in (True, False, None):
            raise ValueError("use_cftime= and a decode_times coder: give use_cftime to the coder, "
                             "xr.coders.CFDatetimeCoder(use_cftime=...)")
    if group is not None and not isinstance(group, str):
        raise TypeError(f"group must be a str (a path inside the store) or None, got {type(group).__name__}: {group!r}")
    if consolidated is not None and not isinstance(consolidated, bool):
        raise TypeError(f"consolidated must be True, False or None, got {type(consolidated).__name__}: "
                        f"{consolidated!r}")
    if isinstance(decode_times, (str, bytes, int, float, complex)) and not isinstance(decode_times, bool):
        raise TypeError(f"decode_times must be True, False, None or a coder such as "
                        f"xr.coders.CFDatetimeCoder(...), got {type(decode_times).__name__}: {decode_times!r}")


#: ``retry_config`` keys obstore takes (it ignores others without a word: a misspelt key would be lost)
_RETRY_KEYS = {"max_retries", "retry_timeout", "backoff"}
_BACKOFF_KEYS = {"init_backoff", "max_backoff", "base"}


def _check_store_arguments(store: Any, options: dict[str, Any]) -> None:
    """``TypeError``/``ValueError`` naming the argument where ``open_zarr``'s ``store`` or a store option
    is of a kind obstore would refuse deep inside (``'int' object is not an instance of 'str'``, naming
    nothing), misread (``anonymous="no"`` is true) or ignore (a misspelt ``retry_config`` key)."""
    if store is None or isinstance(store, (bytes, bool, int, float, complex)):
        raise TypeError(f"store must be a URL, a path or a zarr/obstore store, got {type(store).__name__}: {store!r}")
    if isinstance(store, (xr.Dataset, xr.DataArray)):
        raise TypeError(f"store must be a URL, a path or a zarr/obstore store, got an xarray {type(store).__name__}, "
                        "which is open already: use its .insitu accessor (a DataArray: da.to_dataset().insitu)")
    if not isinstance(store, (str, os.PathLike)) or "://" not in os.fspath(store):
        return  # options for a path or a store object are refused by ``open_zarr`` itself, whatever their kind
    for key, value in options.items():
        if key == "anonymous":
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"anonymous must be True or False, got {type(value).__name__}: {value!r}")
        elif key == "credential_provider":
            if value is not None and not callable(value):
                raise TypeError(f"credential_provider must be a callable that returns credentials, got "
                                f"{type(value).__name__}")
        elif key == "client_options":
            if value is None:
                continue
            if not isinstance(value, dict):
                raise TypeError("client_options must be a dict (e.g. {'timeout': '60s'}), got "
                                f"{type(value).__name__}")
            for k, v in value.items():
                if not isinstance(v, (str, bool, timedelta, dict)):
                    raise TypeError(f"client_options[{k!r}] must be a string (e.g. '30s', '10'), a bool or a "
                                    f"timedelta, got {type(v).__name__}: {v!r}")
        elif key == "retry_config":
            _check_retry_config(value)
        elif not isinstance(value, (str, bool, timedelta)):
            raise TypeError(f"store option {key}= must be a string (or a bool), got {type(value).__name__}: {value!r}")


def _check_retry_config(value: Any) -> None:
    """``retry_config=``: a dict of obstore's keys, each of the kind obstore takes (see ``_check_store_arguments``)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise TypeError(f"retry_config must be a dict (e.g. {{'max_retries': 3}}), got {type(value).__name__}")
    unknown = set(value) - _RETRY_KEYS
    if unknown:
        raise ValueError(f"retry_config has unknown key(s) {sorted(unknown)}; obstore takes {sorted(_RETRY_KEYS)}")
    n = value.get("max_retries", 0)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise TypeError(f"retry_config['max_retries'] must be an int, at least 0, got {type(n).__name__}: {n!r}")
    if not isinstance(value.get("retry_timeout", timedelta()), timedelta):
        raise TypeError("retry_config['retry_timeout'] must be a datetime.timedelta, got "
                        f"{type(value['retry_timeout']).__name__}: {value['retry_timeout']!r}")
    backoff = value.get("backoff") or {}
    if not isinstance(backoff, dict) or set(backoff) - _BACKOFF_KEYS:
        raise TypeError(f"retry_config['backoff'] must be a dict of {sorted(_BACKOFF_KEYS)}, got {backoff!r}")
    for k in ("init_backoff", "max_backoff"):
        if k in backoff and not isinstance(backoff[k], timedelta):
            raise TypeError(f"retry_config['backoff'][{k!r}] must be a datetime.timedelta, got {backoff[k]!r}")
    if "base" in backoff and (isinstance(backoff["base"], bool) or not isinstance(backoff["base"], (int, float))):
        raise TypeError(f"retry_config['backoff']['base'] must be a number, got {backoff['base']!r}")


def _open_xr(zstore: Any, consolidated: bool | None, group: str | None, decode_times: Any,
             decoding: dict[str, Any]) -> xr.Dataset:
    """``xr.open_zarr(zstore, chunks=None, ...)``, the same Dataset, with integer CF time axes decoded
    in place (``_decoded_times``): xarray's own decoding of a 10^7-step axis makes several
    temporaries of its size (~400 MB at its peak); this one reads it and decodes it in place.

    One departure, under xarray's default decoding only (``decode_times`` True or None: no coder of
    the user's): an axis xarray would leave as ``cftime`` objects only because its dates are out of
    ``datetime64[ns]``'s range is decoded to what ``CFDatetimeCoder(time_unit="s")`` gives
    (``datetime64[s]``); the warnings of the open are held (``_held``) until then, and given again
    but for xarray's about that fallback, which would then be false."""
    kw = dict(chunks=None, consolidated=consolidated, group=group, decode_times=decode_times, **decoding)
    if decode_times is False:
        with warnings.catch_warnings():
            _no_fallback_warning()
            return xr.open_zarr(zstore, **kw)
    said: list[warnings.WarningMessage] | None = [] if decode_times is True or decode_times is None else None
    try:  # xarray's indexes are made below, as xarray makes them (``_maybe_create_default_indexes``)
        with _held(said):
            ds = xr.open_zarr(zstore, create_default_indexes=False, **kw)
    except Exception as e:
        _reemit(said)
        if not isinstance(e, TypeError) or "create_default_indexes" not in str(e):
            raise
        with warnings.catch_warnings():
            _no_fallback_warning()
            return xr.open_zarr(zstore, **kw)  # an xarray without create_default_indexes
    to_index = {name: c.variable for name, c in ds.coords.items() if c.dims == (name,) and name not in ds.xindexes}
    try:
        for name, var in to_index.items():
            values = _decoded_times(var, said)
            if values is not None:  # as an index already (pandas would copy an array: 80 MB at 10^7 steps)
                to_index[name] = xr.IndexVariable(var.dims, pd.Index(values, copy=False, name=name),
                                                  attrs=var.attrs, encoding=var.encoding)
    finally:
        _reemit(said)
    if not to_index:
        return ds
    out = ds.assign_coords(xr.Coordinates(to_index))
    out.set_close(closer(ds))
    return out


def _no_fallback_warning() -> None:
    """Ignore xarray's warning that ``consolidated=None`` found no consolidated metadata and read the
    arrays without it (in the ``warnings.catch_warnings`` block of the caller): a six-line
    ``RuntimeWarning`` that tells a reader of someone else's archive to consolidate it. xinsitu opens
    such an archive as it is, its arrays in name order (``_by_name``)."""
    warnings.filterwarnings("ignore", message=CONSOLIDATED_WARNING, category=RuntimeWarning)


@contextlib.contextmanager
def _held(said: list[warnings.WarningMessage] | None) -> Iterator[None]:
    """Warnings given in the block are recorded into ``said`` (all of them, whatever the filters, but
    xarray's about the fallback from consolidated metadata: ``_no_fallback_warning``), for ``_reemit``;
    with ``said`` None, the block is left alone but for that warning."""
    if said is None:
        with warnings.catch_warnings():
            _no_fallback_warning()
            yield
        return
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        _no_fallback_warning()
        try:
            yield
        finally:
            said.extend(log)


def _reemit(said: list[warnings.WarningMessage] | None) -> None:
    """The warnings ``_held`` recorded, given again as they were first given (text, category, place,
    the module's registry there): the filters in force then apply as they would have. Empties ``said``."""
    if not said:
        return
    where = {getattr(m, "__file__", None): m for m in list(sys.modules.values())}
    for w in said:
        g = getattr(where.get(w.filename), "__dict__", None)
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno,
                               module=g.get("__name__") if g is not None else None,
                               registry=g.setdefault("__warningregistry__", {}) if g is not None else None,
                               source=w.source)
    said.clear()


#: CF time units (as xarray reads them: lower case, plural) -> nanoseconds
_NS_PER = {"nanoseconds": 1, "microseconds": 10**3, "milliseconds": 10**6, "seconds": 10**9, "minutes": 60 * 10**9,
           "hours": 3600 * 10**9, "days": 86400 * 10**9}
_NP_NS = {"ns": 1, "us": 10**3, "ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9, "D": 86400 * 10**9}


def _decoded_times(var: xr.Variable, said: list[warnings.WarningMessage] | None = None) -> Any:
    """The values xarray decodes ``var`` to (a 1-D stored integer CF time axis), decoded in place
    in one pass, or None: then xarray decodes it as it does.

    Only where xarray's decoding is ``origin + value × unit`` of the stored integers, and nothing
    else: its lazy wrappers are exactly xarray's CF time decoding over a whole zarr array (no mask,
    scale or other coder; a ``datetime64`` result, not ``cftime``), the values hold no NaT marker,
    and xarray's own decoding of the first and last value (the extremes, which decide whether
    xarray decodes with pandas or falls back to ``cftime``) gives the result's dtype and origin:
    every value is then ``origin + value × (unit / result unit)``, checked at both extremes.

    ``said`` (the warnings of xarray's open, held; given under xarray's default decoding only):
    where that decoding (``time_unit="ns"``, ``use_cftime`` None) falls back to ``cftime`` only
    because the dates are out of ``datetime64[ns]``'s range (its one warning says that and nothing
    else does), and xarray's decoding of the extremes with ``time_unit="s"`` gives a ``datetime64``
    without a word, the axis is decoded to that (what ``CFDatetimeCoder(time_unit="s")`` gives), and
    the warnings xarray's open gave for this axis (its check of the first and last value) are taken
    out of ``said``: they would be false.
    """
    decode: Any = decode_cf_datetime
    if decode is None:  # pragma: no cover - another xarray
        return None
    node: Any = variable_data(var)
    func: Any = None
    full = False
    for _ in range(16):
        if isinstance(node, CACHING):
            node = node.array
        elif isinstance(node, ELEMENTWISE) and func is None:
            func = node.func
            node = node.array
        elif isinstance(node, LAZY) and not full:
            key = lazy_key(node)
            if len(key) != 1 or key[0] != slice(None):
                return None
            full, node = True, node.array
        elif is_zarr_wrapper(node):
            break
        else:
            return None
    else:
        return None
    kw = getattr(func, "keywords", None)
    if (getattr(func, "func", None) is not decode or getattr(func, "args", None) or not kw
            or set(kw) != {"units", "calendar", "use_cftime", "time_unit"} or kw["use_cftime"]):
        return None
    m = re.fullmatch(r"\s*(\w+)\s+since\s+.+", str(kw["units"]), flags=re.IGNORECASE | re.DOTALL)
    unit = m.group(1).lower() if m else ""
    unit = unit if unit.endswith("s") else unit + "s"
    zarray = zarr_array_of(node)
    raw_dtype = np.dtype(zarray.dtype)
    if unit not in _NS_PER or zarray.ndim != 1 or not (raw_dtype.kind == "i" or (raw_dtype.kind == "u"
                                                                                    and raw_dtype.itemsize < 8)):
        return None
    raw = np.asarray(zarray[...])
    if raw.size == 0:
        return None
    if raw.dtype != np.int64 or not raw.flags.writeable or not raw.flags.c_contiguous:
        raw = raw.astype(np.int64)  # (a fresh array of ours: decoded in place below)
    lo, hi = int(raw.min()), int(raw.max())
    big = np.iinfo(np.int64)
    if lo == big.min:  # xarray's NaT marker
        return None
    ends, told = _decoded_ends(func, lo, hi)  # xarray's decoding of the extremes
    at_open: list[warnings.WarningMessage] = []
    if told or ends.dtype.kind != "M":  # cftime objects (out of range, another calendar), or a word to say
        if (said is None or kw["time_unit"] != "ns" or kw["use_cftime"] is not None or ends.dtype.kind != "O"
                or not told or not all(_out_of_ns_range(w) for w in told)):
            return None  # xarray's
        coarser = functools.partial(cast(Callable[..., Any], decode), units=kw["units"], calendar=kw["calendar"],
                                    use_cftime=None, time_unit="s")
        ends, told = _decoded_ends(coarser, lo, hi)
        if told or ends.dtype.kind != "M":
            return None
        _, at_open = _decoded_ends(func, int(raw[0]), int(raw[-1]))  # xarray's check when opening
    res, count = np.datetime_data(ends.dtype)
    if count != 1 or res not in _NP_NS or _NS_PER[unit] % _NP_NS[res]:
        return None
    f = _NS_PER[unit] // _NP_NS[res]
    e0, e1 = (int(x) for x in ends.view(np.int64))
    origin = e0 - lo * f
    if e1 != hi * f + origin or e0 == big.min:
        return None
    # every value is origin + value × f, between e0 and e1; where origin or value × f is out of
    # int64's range (an origin before 1677 in ns), as e0 + (value - lo) × f
    shift = 0 if big.min < origin <= big.max and big.min < lo * f and hi * f <= big.max else lo
    if not (big.min < lo - shift and hi - shift <= big.max and big.min < (lo - shift) * f
            and (hi - shift) * f <= big.max and big.min < origin + shift * f <= big.max):
        return None
    held = said if said is not None else []  # (said is a list where at_open is not empty)
    for w in at_open:  # each taken out of the held warnings once
        for i, o in enumerate(held):
            if o.category is w.category and str(o.message) == str(w.message):
                del held[i]
                break
    if shift:
        np.subtract(raw, shift, out=raw)
    if f != 1:
        np.multiply(raw, f, out=raw)
    if origin + shift * f:
        np.add(raw, origin + shift * f, out=raw)
    return raw.view(ends.dtype)


def _decoded_ends(func: Any, lo: int, hi: int) -> tuple[np.ndarray, list[warnings.WarningMessage]]:
    """``func`` (xarray's CF time decoding) of ``[lo, hi]``, and the warnings it gave."""
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        ends = np.asarray(func(np.array([lo, hi], dtype=np.int64)))
    return ends, list(told)


def _out_of_ns_range(w: warnings.WarningMessage) -> bool:
    """Whether ``w`` is xarray's warning that it keeps ``cftime`` objects because the dates are out of
    ``datetime64[ns]``'s range (and for no other reason)."""
    text = str(w.message)
    return (issubclass(w.category, xr.SerializationWarning) and "datetime64[ns]" in text
            and "out of range" in text and "reform" not in text)


def opened_consolidated(ds: xr.Dataset) -> bool | None:
    """Whether ``ds`` was opened from its Zarr store's consolidated metadata (by ``open_zarr`` or
    ``xr.open_zarr``); None where that cannot be told (another kind of open). ``open_zarr`` says
    nothing when there is none (xarray's warning is not given): a caller that wants to say it asks."""
    zgroup = zarr_group_of(ds)
    if zgroup is None:
        return None
    return getattr(zgroup.metadata, "consolidated_metadata", None) is not None


#: ``lists_in_fixed_order``'s answers, by store and group path
_FIXED_ORDER: ByIdentity[bool] = ByIdentity(256)


def lists_in_fixed_order(zarray: Any) -> bool:
    """Whether the group holding ``zarray`` (a ``zarr.Array``) has consolidated metadata, so that xarray
    lists its arrays in a fixed order; False where it lists them from the store (an order that changes
    from process to process; every Icechunk repository). One metadata read per store and group, bounded
    as ``open_zarr``'s are (``bounded_store``), kept for the process."""
    aa = getattr(zarray, "async_array", zarray)
    sp = getattr(aa, "store_path", None)
    if sp is None:
        return True
    store, path = sp.store, str(sp.path or "")
    if type(store).__name__ == "IcechunkStore":
        return False
    group = path.rsplit("/", 1)[0] if "/" in path else ""
    hit = _FIXED_ORDER.get(store, group)
    if hit is not None:
        return hit
    import zarr

    try:
        zgroup = zarr.open_group(bounded_store(store, others=False), path=group, mode="r")
        fixed = getattr(zgroup.metadata, "consolidated_metadata", None) is not None
    except Exception:  # noqa: BLE001 - no group to ask (an array alone): its order is one array's
        fixed = True
    _FIXED_ORDER.put(store, group, fixed)
    return fixed


def _read_consolidated(ds: xr.Dataset, zstore: Any, group: str | None, consolidated: bool | None) -> bool:
    """Whether ``xr.open_zarr`` listed the arrays from consolidated metadata (a fixed order)."""
    if consolidated is False:
        return False
    zgroup = zarr_group_of(ds)
    if zgroup is None:  # another xarray: ask zarr (one metadata read)
        import zarr

        zgroup = zarr.open_group(zstore, path=group or "", mode="r", use_consolidated=consolidated)
    return getattr(zgroup.metadata, "consolidated_metadata", None) is not None


def _by_name(ds: xr.Dataset) -> xr.Dataset:
    """``ds`` with its data variables in name order; coordinates, lazy data, encodings, indexes and
    attributes kept."""
    out = ds[sorted(ds.data_vars, key=str)]
    out = out.assign_coords({k: ds.coords[k] for k in ds.coords if k not in out.coords})
    out.attrs, out.encoding = dict(ds.attrs), dict(ds.encoding)
    out.set_close(closer(ds))
    return out


def _array_error(zstore: Any, group: str | None, where: str) -> ValueError | None:
    """A clear error where the path given (or ``group``) is a zarr array, not a group (else None)."""
    import zarr

    try:
        arr = zarr.open_array(zstore, path=group or "", mode="r")
    except Exception:  # noqa: BLE001 - not an array: the caller reports what it met
        return None
    at = f"{where} (group={group!r})" if group else where
    name = (group or where).rstrip("/").rsplit("/", 1)[-1]
    return ValueError(f"{at} is a zarr array (shape {arr.shape}), not a group: open the group that contains "
                      f"it and select the variable, e.g. xinsitu.open_zarr(<the parent group>)[{name!r}]")


def _no_dims_error(zstore: Any, group: str | None, where: str) -> ValueError | None:
    """An error naming the zarr v2 arrays that lack ``_ARRAY_DIMENSIONS`` or the v3 arrays that lack
    ``dimension_names`` (what xarray needs for dims), or None."""
    import zarr

    try:
        g = zarr.open_group(zstore, path=group or "", mode="r")
        arrays = list(g.arrays())
        v3 = sorted(n for n, a in arrays if a.metadata.zarr_format == 3 and a.metadata.dimension_names is None
                    and a.ndim)  # (a scalar needs none)
        names = sorted(n for n, a in arrays if a.metadata.zarr_format == 2 and "_ARRAY_DIMENSIONS" not in a.attrs)
    except Exception:  # noqa: BLE001 - unknown: the caller re-raises the original
        return None
    if v3:
        return ValueError(f"{where}: zarr v3 arrays {v3} have no 'dimension_names', which xarray needs to name "
                          "their dimensions: the archive was not written by xarray. Write them with "
                          "zarr.create_array(..., dimension_names=[...]), or add the list to each array's zarr.json")
    if not names:
        return None
    return ValueError(f"{where}: zarr v2 arrays {names} have no '_ARRAY_DIMENSIONS' attribute (nor NCZarr "
                      "metadata), which xarray needs to name their dimensions: the archive was not written by "
                      "xarray. Add the attribute (a list of dim names) to each array's .zattrs")
