"""Credentials out of messages: the values a store was built with, those of the environment
variables obstore reads and those a credential provider answered (``RecordingProvider``) are
replaced in the text of an error (``redact``, ``scrubbed``); a URL is named without its user info
or query string (``redact_url``), and a printed line names it and the options with ``...`` in their
place (``masked_url``, ``masked``). A store built with a credential provider elsewhere is rebuilt with
it recorded (``recording_store``).
"""

from __future__ import annotations

import base64
import inspect
import os
import re
from typing import Any
from urllib.parse import parse_qsl, quote, quote_plus, unquote, urlsplit, urlunsplit

# option names (any store kind) whose values are credentials
_SECRET_KEY = re.compile(r"secret|token|key|password|sas|credential|signature|authorization|client_id|bearer",
                         re.IGNORECASE)
#: an AWS credential scope (``X-Amz-Credential``): its first part is the access key id, which S3 quotes alone
_SCOPE = re.compile(r"([^/\s]{4,})/\d{8}/[^/\s]+/[^/\s]+/aws4_request")
_URL = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^/\s@\"'<>]*@)?(?P<rest>[^\s?#\"'<>]*)"
                  r"(?P<query>\?[^\s#\"'<>]*)?")


#: environment variables obstore reads credentials from (their names also match ``_SECRET_KEY``)
_ENV_PREFIXES = ("AWS_", "AZURE_", "GOOGLE_", "GCS_", "GCP_", "OBJECT_STORE_")
_seen: dict[str, None] = {}  # credentials a credential_provider handed to obstore, newest last
_SEEN_MAX = 256


def env_secrets() -> list[str]:
    """Credential values in the environment variables obstore reads (``AWS_SECRET_ACCESS_KEY``...)."""
    found: list[str] = []
    for k, v in os.environ.items():
        if k.upper().startswith(_ENV_PREFIXES) and _SECRET_KEY.search(k) and len(v) >= 4:
            found.append(v)
            found.extend(w for w in v.split() if len(w) >= 8)
    return found


def _remember(value: Any) -> None:
    """Record the credential values of a provider's answer (a dict or an object with attributes)."""
    items = value.items() if isinstance(value, dict) else \
        ((k, getattr(value, k, None)) for k in dir(value) if not k.startswith("_"))
    for k, v in items:
        if isinstance(v, str) and len(v) >= 4 and _SECRET_KEY.search(str(k)):
            _seen.pop(v, None)
            _seen[v] = None
    while len(_seen) > _SEEN_MAX:
        del _seen[next(iter(_seen))]


class RecordingProvider:
    """A ``credential_provider`` that hands obstore what ``inner`` returns and remembers it, so that
    ``redact`` can scrub those credentials too. Picklable where ``inner`` is (spawned workers)."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __call__(self) -> Any:
        got = self.inner()
        if inspect.isawaitable(got):
            return self._wait(got)
        _remember(got)
        return got

    async def _wait(self, pending: Any) -> Any:
        got = await pending
        _remember(got)
        return got

    def __getattr__(self, name: str) -> Any:  # e.g. obstore's ``config`` of its own providers
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"RecordingProvider({type(self.inner).__name__})"


def recording_store(store: Any) -> Any:
    """``store`` (an obstore store) rebuilt with its ``credential_provider`` wrapped in a
    ``RecordingProvider``, so that ``redact`` scrubs what the provider answers (a store built by the
    user and passed to ``open_zarr``); ``store`` itself where it has no provider or records already."""
    provider = getattr(store, "credential_provider", None)
    if provider is None or isinstance(provider, RecordingProvider):
        return store
    args, kw = store.__getnewargs_ex__()  # what obstore pickles: prefix, config, client and retry options
    kw["credential_provider"] = RecordingProvider(provider)
    return type(store)(*args, **kw)


def redact_url(url: str) -> str:
    """A URL without user info or query string (signed URLs carry credentials there)."""
    p = urlsplit(url)
    host = p.hostname or ""
    if p.port:
        host += f":{p.port}"
    return f"{p.scheme}://{host}{p.path}" + ("?…" if p.query else "")


def userinfo_as_header(url: str, options: dict[str, Any]) -> str:
    """An ``http(s)://user:password@host/...`` URL taken as curl, requests and fsspec take it: its user info goes
    into ``options``' ``client_options`` as an ``Authorization: Basic`` header (obstore drops it unsent), one
    given there already kept; the URL is returned without it, so the store never shows it (zarr logs its repr)."""
    p = urlsplit(url)
    if "@" not in p.netloc:
        return url
    client = dict(options.get("client_options") or {})
    headers = dict(client.get("default_headers") or {})
    if not any(str(k).lower() == "authorization" for k in headers):
        pair = f"{unquote(p.username or '')}:{unquote(p.password or '')}".encode()
        headers["Authorization"] = "Basic " + base64.b64encode(pair).decode()
    options["client_options"] = {**client, "default_headers": headers}
    return urlunsplit(p._replace(netloc=p.netloc.rsplit("@", 1)[1]))


def masked_url(url: str) -> str:
    """``url`` as a printed line of Python names it (``redact_url`` for messages drops these parts): its
    password and its query string (a signed URL's credentials) as ``...``, and a user name given without
    a password too (``https://TOKEN@host``: a token, as many hosts take one); a path as it is."""
    if "://" not in url:
        return url
    p = urlsplit(url)
    netloc = p.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.split(':', 1)[0]}:...@{host}" if p.password is not None else f"...@{host}"
    return urlunsplit((p.scheme, netloc, p.path, "..." if p.query else "", p.fragment))


def masked(value: Any, secrets: list[str]) -> Any:
    """``value`` (an option's, at any depth of dicts, lists and tuples) with each string that holds one of
    ``secrets`` as ``"..."``, and URLs as ``masked_url`` names them."""
    if isinstance(value, dict):
        return {k: masked(x, secrets) for k, x in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(masked(x, secrets) for x in value)
    if isinstance(value, str):
        return "..." if any(x in value for x in secrets) else masked_url(value)
    return value


def secrets_in_options(url: str, options: dict[str, Any]) -> list[str]:
    """Credential values among store options (and a URL's user info and query values)."""
    found: list[str] = []

    def walk(key: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(str(k), x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(key, x)
        elif isinstance(v, (str, bytes)) and _SECRET_KEY.search(key):
            s = v.decode(errors="replace") if isinstance(v, bytes) else v
            found.append(s)
            found.extend(w for w in s.split() if len(w) >= 8)  # "Bearer <token>": the token alone too

    walk("", options)
    p = urlsplit(url)
    if p.password:
        found.append(p.password)
    found.extend(v for _, v in parse_qsl(p.query))
    # a presigned URL's X-Amz-Credential is "<key id>/<date>/<region>/s3/aws4_request": S3 quotes the key id alone
    found.extend(m[1] for s in list(found) for m in _SCOPE.finditer(s))
    return sorted({s for s in found if len(s) >= 4}, key=len, reverse=True)


def secrets_of(store: Any) -> list[str]:
    """Credential values an obstore store was built with (empty for local and memory stores)."""
    opts: dict[str, Any] = {}
    for attr in ("config", "client_options"):
        try:
            opts[attr] = dict(getattr(store, attr, None) or {})
        except Exception:  # noqa: BLE001 - a store kind without that property
            pass
    url = getattr(store, "url", "") or ""
    return secrets_in_options(url if isinstance(url, str) else "", opts)


def redact(text: str, secrets: list[str] | tuple[str, ...] = ()) -> str:
    """``text`` with URL query strings and user info, and every credential, replaced: the values in
    ``secrets``, those of the environment variables obstore reads and those a credential provider
    answered (``RecordingProvider``); each also percent- and form-encoded, as a URL's query string carries it
    (an S3 error quotes a presigned URL's canonical query, ``%2F`` for ``/``)."""
    every = {s for s in (*secrets, *env_secrets(), *_seen) if len(s) >= 4}
    every |= {e for s in every for e in _encoded(s)}
    for s in sorted(every, key=len, reverse=True):
        text = text.replace(s, "***")
    return _URL.sub(lambda m: m["scheme"] + ("***@" if m["user"] else "") + m["rest"]
                    + ("?***" if m["query"] else ""), text)


def _encoded(secret: str) -> set[str]:
    """``secret`` as a URL's path or query string encodes it (percent-encoded, form-encoded)."""
    return {quote(secret, safe=""), quote_plus(secret)} - {secret}


def scrubbed(e: BaseException, secrets: list[str] | tuple[str, ...] = ()) -> BaseException:
    """An exception like ``e`` whose message names no credential; obstore's debug dump is cut.

    The caller raises it ``from None``: the original (which may quote a signed URL) stays out
    of tracebacks and logs.
    """
    msg = str(e).split("\n\nDebug source:", 1)[0].strip()
    msg = redact(msg, secrets)
    base: type[BaseException]
    if isinstance(e, FileNotFoundError):
        base = FileNotFoundError
    elif isinstance(e, PermissionError) or type(e).__name__ in ("PermissionDeniedError", "UnauthenticatedError"):
        base = PermissionError
    elif type(e).__name__ in ("UnknownConfigurationKeyError", "InvalidPathError"):
        base = ValueError
    elif client_timed_out(e):  # obstore's own timeouts, after its retries: a TimeoutError, and says so
        base = TimeoutError
        msg += " (timed out: no answer)"
    elif isinstance(e, (TimeoutError, ConnectionError, ValueError, TypeError, KeyError, OSError)):
        base = next(t for t in (TimeoutError, ConnectionError, ValueError, TypeError, KeyError, OSError)
                    if isinstance(e, t))
    else:
        base = OSError
    name = type(e).__name__
    return base(msg if name == base.__name__ else f"{name}: {msg}")


#: what an error of obstore's means where its text says the first, and what to do
_HINTS = (
    ("169.254.169.254", "no AWS credentials were found (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, ~/.aws, an "
                        "instance role): set them, or pass anonymous=True for a public bucket"),
    ("Content-Length Header missing", "the server sends no Content-Length, which obstore's HTTP store needs: "
                                      "xr.open_zarr(url) opens it through fsspec, and ds.insitu reads that "
                                      "Dataset too"),
)


def opening_error(e: BaseException, secrets: list[str] | tuple[str, ...], where: str) -> BaseException:
    """``scrubbed(e)`` naming what was being opened (``where``, a URL without credentials), and what to do where
    obstore's text says a known cause (no credentials found; an HTTP server without ``Content-Length``)."""
    err = scrubbed(e, secrets)
    text = _chain_text(e)
    hint = next((h for key, h in _HINTS if key in text), None)
    return type(err)(f"opening {where}: {err}" + (f" -- {hint}" if hint else ""))


#: how obstore (reqwest) says a request timed out, in its error's debug text
_TIMED_OUT = re.compile(r"kind:\s*Timeout\b|\bTimedOut\b|operation timed out", re.IGNORECASE)


def client_timed_out(e: BaseException) -> bool:
    """Whether ``e`` is an obstore error for a request its HTTP client gave up waiting for (its connect
    or read timeout, or its whole-request limit, after its own retries): obstore raises those as a
    ``GenericError`` whose debug text names the timeout."""
    return type(e).__module__.startswith("obstore") and not isinstance(e, TimeoutError) \
        and _TIMED_OUT.search(str(e)) is not None


def _chain_text(e: BaseException) -> str:
    """Messages of ``e`` and of every exception it was raised from or during."""
    out: list[str] = []
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        out.append(str(cur))
        cur = cur.__cause__ or cur.__context__
    return "\n".join(out)
