"""Real servers on 127.0.0.1 for remote-store tests: a static file server that can inject
faults (503s, connection resets, truncated or short bodies, slow and stalled responses,
fixed latency), ``python -m http.server`` (directory index pages) and moto's S3 server.

Both bind to 127.0.0.1 only, on a free port, and stop themselves: when their context
ends, after ``max_lifetime_s`` seconds, or (file server) after ``max_requests`` requests.
Faults are drawn from a seeded hash of (seed, path, attempt), so the same run injects the
same faults whatever the timing.

Run ``python -m tests.support.servers ROOT [--latency S] [--lifetime S]`` to serve a folder from a
separate process; it prints its URL on the first line (used by ``bench/soak.py``).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import os
import posixpath
import re
import socket
import struct
import sys
import threading
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
KINDS = ("error_503", "reset", "truncate", "short", "slow", "stall", "hang", "flip", "full")


@dataclass
class Faults:
    """Share of requests that meet each fault (drawn per request, at most one per request).

    error_503 : answer ``503 Service Unavailable``.
    reset : close the connection with a TCP reset before answering.
    truncate : announce the full ``Content-Length``, send half the body, close the connection.
    short : announce and send only half the body (a broken proxy: the HTTP layer cannot tell).
    slow : wait ``slow_s`` before answering (longer than the client's timeout: a timeout).
    stall : send half the body, wait ``slow_s``, then send the rest (a stalled read).
    hang : accept the request and never answer (until the server stops).
    flip : send the whole body with one bit flipped (corruption in transit the HTTP layer cannot see).
    full : answer a ``Range`` request with ``200`` and the whole object (a server or proxy that
        ignores ranges).
    latency : seconds added to every request.
    max_per_key : faults injected on one path at most, then it is served cleanly (None: no bound).
    pattern : regex on the request path; only matching paths meet faults.
    always : regex on the path; matching paths always answer ``always_status``, with a body that
        quotes the request's ``Authorization`` and ``X-Amz-Security-Token`` headers and its query
        string, as sent (as S3 quotes the key id and the canonical request in signature errors).
    """

    error_503: float = 0.0
    reset: float = 0.0
    truncate: float = 0.0
    short: float = 0.0
    slow: float = 0.0
    stall: float = 0.0
    hang: float = 0.0
    flip: float = 0.0
    full: float = 0.0
    latency: float = 0.0
    slow_s: float = 2.0
    max_per_key: int | None = 3
    pattern: str = r".*"
    always: str | None = None
    always_status: int = 503
    seed: int = 0

    def __post_init__(self) -> None:
        total = sum(getattr(self, k) for k in KINDS)
        if not all(0.0 <= getattr(self, k) <= 1.0 for k in KINDS) or total > 1.0:
            raise ValueError(f"fault shares must be in [0, 1] and sum to at most 1, got {total}")
        if not 0 <= self.latency <= 60 or not 0 <= self.slow_s <= 60:
            raise ValueError("latency and slow_s must be in [0, 60] seconds")

    def draw(self, path: str, attempt: int) -> str | None:
        """The fault (or None) for the ``attempt``-th request of ``path``; depends on nothing else."""
        if not re.search(self.pattern, path):
            return None
        h = hashlib.sha256(f"{self.seed}:{path}:{attempt}".encode()).digest()
        u = struct.unpack("<Q", h[:8])[0] / 2**64
        acc = 0.0
        for k in KINDS:
            acc += getattr(self, k)
            if u < acc:
                return k
        return None


@dataclass
class _State:
    root: Path
    faults: Faults
    stop: threading.Event
    max_requests: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    attempts: Counter = field(default_factory=Counter)  # requests per path
    injected: Counter = field(default_factory=Counter)  # faults per path
    counts: Counter = field(default_factory=Counter)  # faults (and "ok", "404") per kind
    requests: int = 0
    inflight: int = 0  # requests being answered now
    ranged: int = 0  # requests for a byte range
    peak: int = 0  # most requests answered at once
    conns: set = field(default_factory=set)
    missing: set = field(default_factory=set)  # paths answered 404
    queries: set = field(default_factory=set)  # query strings seen
    auth: set = field(default_factory=set)  # Authorization headers seen
    methods: Counter = field(default_factory=Counter)  # requests per method (PROPFIND is answered 501)
    capacity: int | None = None  # requests held at once at most (answered one at a time), or no bound
    penalty_s: float = 1.0  # ... a request past it waits this long (then twice, 4x...) to come in again
    held: int = 0  # requests held now (capacity)
    turned_away: int = 0  # times a request found the server full
    serving: threading.Lock = field(default_factory=threading.Lock)  # one answer at a time (capacity)
    etag: str = "md5"  # "md5": of the bytes (S3's); else of the modification time and size: "ns" (in nanoseconds,
    # as Apache and Caddy make theirs), "nginx" (in whole seconds, nginx's default), "starlette" (their MD5)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: pooled connections meet the resets too
    server_version = "xinsitu-test"
    timeout = 60  # an idle keep-alive connection is closed after this

    @property
    def st(self) -> _State:
        return self.server.state  # type: ignore[attr-defined]

    def setup(self) -> None:
        super().setup()
        with self.st.lock:
            self.st.conns.add(self.connection)

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok:
            with self.st.lock:
                self.st.methods[self.command] += 1
        return ok

    def finish(self) -> None:
        try:
            super().finish()
        except (OSError, ValueError):
            pass  # the client (or a reset fault) closed the socket first
        with self.st.lock:
            self.st.conns.discard(self.connection)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    # ------------------------------------------------------------------
    def _file(self) -> Path | None:
        rel = posixpath.normpath("/" + urllib.parse.unquote(self.path.split("?", 1)[0])).lstrip("/")
        if rel.startswith("..") or "\0" in rel:
            return None
        p = self.st.root / rel
        return p if p.is_file() else None

    def _decide(self) -> tuple[str | None, int]:
        st, f = self.st, self.st.faults
        path = self.path.split("?", 1)[0]
        with st.lock:
            st.requests += 1
            if "?" in self.path:
                st.queries.add(self.path.split("?", 1)[1])
            if self.headers.get("Authorization"):
                st.auth.add(self.headers["Authorization"])
            if st.requests > st.max_requests:
                st.stop.set()
            attempt = st.attempts[path]
            st.attempts[path] += 1
            if f.always and re.search(f.always, path):
                st.counts["always"] += 1
                return "always", attempt
            kind = f.draw(path, attempt)
            if kind is not None and f.max_per_key is not None and st.injected[path] >= f.max_per_key:
                kind = None
            if kind is not None:
                st.injected[path] += 1
            st.counts[kind or "ok"] += 1
        return kind, attempt

    def _send_status(self, code: int, echo: bool = False) -> None:
        msg = f"{code}\n".encode()
        if echo:
            msg += "".join(f"{k}: {v}\n" for k, v in self.headers.items()
                           if k.lower() in ("authorization", "x-amz-security-token")).encode()
            if "?" in self.path:  # as S3 quotes a presigned request's canonical query string
                msg += f"query: {self.path.split('?', 1)[1]}\n".encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(msg)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(msg)

    def _serve(self, head: bool) -> None:
        st = self.st
        if st.capacity is not None:
            self._admit()
        with st.lock:
            st.inflight += 1
            st.peak = max(st.peak, st.inflight)
        try:
            if st.capacity is None:
                self._answer(head)
            else:
                with st.serving:
                    self._answer(head)
        finally:
            with st.lock:
                st.inflight -= 1
                if st.capacity is not None:
                    st.held -= 1

    def _admit(self) -> None:
        """Hold the request once fewer than ``capacity`` are held; till then it waits ``penalty_s``, then
        twice that... (a connection past a full accept queue, dropped, waits for the client's SYN
        retransmit: 1 s, 2 s, 4 s), each time counted in ``turned_away``."""
        st = self.st
        for tries in range(16):
            with st.lock:
                if st.held < st.capacity:  # type: ignore[operator]
                    st.held += 1
                    return
                st.turned_away += 1
            if st.stop.wait(st.penalty_s * 2 ** min(tries, 3)):
                break
        with st.lock:
            st.held += 1  # (stopping: let it through)

    def _answer(self, head: bool) -> None:
        st, f = self.st, self.st.faults
        if st.stop.is_set():
            self.close_connection = True
            return self._send_status(503)
        kind, _ = self._decide()
        if f.latency:
            st.stop.wait(f.latency)
        if kind == "always":  # like S3's signature errors, the answer quotes what the request carried
            return self._send_status(f.always_status, echo=True)
        if kind == "error_503":
            return self._send_status(503)
        if kind == "reset":
            self.close_connection = True
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            return None
        if kind == "slow":
            st.stop.wait(f.slow_s)
        if kind == "hang":  # the connection stays open, no byte comes back
            st.stop.wait()
            self.close_connection = True
            return None
        p = self._file()
        if p is None:
            with st.lock:
                st.counts["404"] += 1
                st.missing.add(self.path.split("?", 1)[0])
            return self._send_status(404)
        data = p.read_bytes()
        size = len(data)
        status, lo, hi = 200, 0, size
        rng = self.headers.get("Range")
        if rng and kind != "full":
            with st.lock:
                st.ranged += 1
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
            if not m or (not m.group(1) and not m.group(2)):
                return self._send_status(416)
            if m.group(1):
                lo, hi = int(m.group(1)), (int(m.group(2)) + 1 if m.group(2) else size)
            else:  # suffix range: the last n bytes
                lo, hi = max(0, size - int(m.group(2))), size
            hi = min(hi, size)
            if lo >= size or lo >= hi:
                return self._send_status(416)
            status = 206
        body = data[lo:hi]
        if kind == "flip" and body:
            h = int(hashlib.sha256(f"{f.seed}:{p}:{lo}".encode()).hexdigest(), 16)
            i = h % len(body)
            body = body[:i] + bytes([body[i] ^ (1 << (h >> 64) % 8)]) + body[i + 1:]
        half = body[: len(body) // 2]
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(half) if kind == "short" else len(body)))
        self.send_header("Last-Modified", self.date_time_string(int(p.stat().st_mtime)))
        if st.etag == "md5":
            self.send_header("ETag", f'"{hashlib.md5(data).hexdigest()}"')
        elif st.etag == "starlette":  # the MD5 of the time and size, as Starlette's StaticFiles makes it
            stat = p.stat()
            self.send_header("ETag", f'"{hashlib.md5(f"{stat.st_mtime}-{stat.st_size}".encode()).hexdigest()}"')
        else:
            stat = p.stat()
            stamp = int(stat.st_mtime) if st.etag == "nginx" else stat.st_mtime_ns
            self.send_header("ETag", f'"{stamp:x}-{size:x}"')
        if status == 206:
            self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{size}")
        self.end_headers()
        if head:
            return None
        try:
            if kind == "short":
                self.wfile.write(half)
            elif kind == "truncate":
                self.wfile.write(half)
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
            elif kind == "stall":
                self.wfile.write(half)
                self.wfile.flush()
                st.stop.wait(f.slow_s)
                self.wfile.write(body[len(half):])
            else:
                self.wfile.write(body)
        except OSError:
            self.close_connection = True  # the client gave up (a timeout did its job)
        return None


#: what a client that hangs up (a timeout, a reset fault, a test that is done) leaves in a handler
_DISCONNECTS = (ConnectionError, TimeoutError, socket.timeout)


class _QuietOnDisconnect:
    """``socketserver``'s ``handle_error`` prints "Exception occurred during processing of request"
    and a traceback for any error in a handler; a client that hangs up is expected here, and says
    nothing. Anything else is still printed."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], _DISCONNECTS):
            return
        super().handle_error(request, client_address)  # type: ignore[misc]


class _Server(_QuietOnDisconnect, ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 256  # a burst of new connections (one per request in flight) is not dropped


class _OneAtATimeHandler(_Handler):
    protocol_version = "HTTP/1.0"  # one request per connection, as ``http.server``'s default


class _OverloadedServer(_QuietOnDisconnect, HTTPServer):
    """A plain ``http.server``: one request at a time, one connection each, an accept backlog of
    5. Connections beyond the backlog are dropped and wait for the client's SYN retransmit (a
    second or more): many requests in flight only make it slower."""

    allow_reuse_address = True
    request_queue_size = 5


class FileServer:
    """Serve the files under ``root`` over HTTP/1.1 on 127.0.0.1, optionally with faults.

    ``overloaded=True`` serves like a plain ``http.server`` instead (HTTP/1.0, one request at a
    time, an accept backlog of 5): a store that more requests in flight only slow down.
    ``capacity=n`` does the same by rule, whatever the timing: it holds ``n`` requests at most,
    answers them one at a time, and a request past them waits ``penalty_s`` (then 2x, 4x...) before
    it is let in, as a connection past a full accept queue waits for the client's SYN retransmit;
    ``turned_away`` counts those waits.

    Each answer has a Last-Modified (whole seconds) and a strong ETag: the MD5 of the object's bytes, as S3
    gives (default), or, as web servers make theirs, of the file's modification time and size: ``etag="ns"``
    in nanoseconds (Apache's and Caddy's kind: a rewrite that sets the time back keeps it), ``etag="nginx"``
    in whole seconds as nginx's default (a rewrite within the second keeps it), ``etag="starlette"`` the MD5
    of ``"<mtime>-<size>"`` (Starlette's ``StaticFiles``: it looks like a hash of the bytes, and is not).

    Use as a context manager (or ``start()``/``stop()``); ``url`` is the base URL,
    ``counts`` how many requests met each fault, ``requests`` how many were answered.
    """

    def __init__(self, root: str | os.PathLike, faults: Faults | None = None, *, max_lifetime_s: float = 300.0,
                 max_requests: int = 200_000, overloaded: bool = False, capacity: int | None = None,
                 penalty_s: float = 1.0, etag: str = "md5"):
        if etag not in ("md5", "ns", "nginx", "starlette"):
            raise ValueError(f"etag must be 'md5', 'ns', 'nginx' or 'starlette', not {etag!r}")
        self.overloaded = overloaded
        self.state = _State(Path(root).resolve(), faults or Faults(), threading.Event(), int(max_requests),
                            capacity=capacity, penalty_s=float(penalty_s), etag=etag)
        self.max_lifetime_s = float(max_lifetime_s)
        self._server: _Server | None = None
        self._threads: list[threading.Thread] = []

    @property
    def faults(self) -> Faults:
        return self.state.faults

    @faults.setter
    def faults(self, f: Faults) -> None:
        with self.state.lock:
            self.state.faults = f
            self.state.attempts.clear()
            self.state.injected.clear()

    @property
    def port(self) -> int:
        assert self._server is not None, "server not started"
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def counts(self) -> Counter:
        with self.state.lock:
            return Counter(self.state.counts)

    @property
    def requests(self) -> int:
        return self.state.requests

    @property
    def seen(self) -> tuple[set[str], set[str]]:
        """(query strings, ``Authorization`` headers) the requests carried."""
        with self.state.lock:
            return set(self.state.queries), set(self.state.auth)

    @property
    def turned_away(self) -> int:
        """Times a request found the server full (``capacity``) since the last ``reset_counts``."""
        return self.state.turned_away

    @property
    def methods(self) -> Counter:
        """Requests per method (``GET``, ``HEAD``, ``PROPFIND`` -- answered 501 ...) since the last ``reset_counts``."""
        with self.state.lock:
            return Counter(self.state.methods)

    @property
    def missing(self) -> set[str]:
        """Paths answered ``404 Not Found``."""
        with self.state.lock:
            return set(self.state.missing)

    @property
    def ranged(self) -> int:
        """Requests for a byte range since the last ``reset_counts``."""
        return self.state.ranged

    @property
    def peak(self) -> int:
        """Most requests answered at the same time since the last ``reset_counts``."""
        return self.state.peak

    def reset_counts(self) -> None:
        with self.state.lock:
            self.state.counts.clear()
            self.state.attempts.clear()
            self.state.injected.clear()
            self.state.requests = 0
            self.state.peak = 0
            self.state.ranged = 0
            self.state.missing.clear()
            self.state.methods.clear()
            self.state.turned_away = 0

    def start(self) -> FileServer:
        srv = _OverloadedServer((HOST, 0), _OneAtATimeHandler) if self.overloaded else _Server((HOST, 0), _Handler)
        srv.state = self.state  # type: ignore[attr-defined]
        self._server = srv
        serve = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05},
                                 name="test-fileserver", daemon=True)
        watch = threading.Thread(target=self._watchdog, name="test-fileserver-watchdog", daemon=True)
        serve.start()
        watch.start()
        self._threads = [serve, watch]
        return self

    def _watchdog(self) -> None:
        self.state.stop.wait(self.max_lifetime_s)
        self.state.stop.set()
        self._shutdown()

    def _shutdown(self) -> None:
        srv, self._server = self._server, None
        if srv is None:
            return
        srv.shutdown()
        srv.server_close()
        with self.state.lock:
            conns = list(self.state.conns)
        for c in conns:  # wake handler threads blocked on idle keep-alive connections
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self) -> None:
        self.state.stop.set()
        for t in self._threads:
            t.join(timeout=10)
        self._shutdown()

    def __enter__(self) -> FileServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class _IndexHandler(SimpleHTTPRequestHandler):
    """``python -m http.server``'s handler, counting requests by method."""

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok:
            with self.server.lock:  # type: ignore[attr-defined]
                self.server.methods[self.command] += 1  # type: ignore[attr-defined]
        return ok

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass


class _IndexServer(_QuietOnDisconnect, ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True


class IndexServer:
    """What ``python -m http.server`` serves, on 127.0.0.1 in a thread: the files under ``root``, and an
    index page for each directory (no WebDAV: a ``PROPFIND`` is answered ``501``). ``methods`` counts
    the requests by method. Stops with its context, or after ``max_lifetime_s``."""

    def __init__(self, root: str | os.PathLike, *, max_lifetime_s: float = 300.0):
        self.root = str(Path(root).resolve())
        self.max_lifetime_s = float(max_lifetime_s)
        self._server: _IndexServer | None = None
        self._timer: threading.Timer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "server not started"
        return f"http://{HOST}:{self._server.server_address[1]}"

    @property
    def turned_away(self) -> int:
        """Times a request found the server full (``capacity``) since the last ``reset_counts``."""
        return self.state.turned_away

    @property
    def methods(self) -> Counter:
        assert self._server is not None, "server not started"
        with self._server.lock:  # type: ignore[attr-defined]
            return Counter(self._server.methods)  # type: ignore[attr-defined]

    def start(self) -> IndexServer:
        srv = _IndexServer((HOST, 0), functools.partial(_IndexHandler, directory=self.root))
        srv.lock, srv.methods = threading.Lock(), Counter()  # type: ignore[attr-defined]
        self._server = srv
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, name="test-indexserver",
                         daemon=True).start()
        self._timer = threading.Timer(self.max_lifetime_s, self.stop)
        self._timer.daemon = True
        self._timer.start()
        return self

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        srv, self._server = self._server, None
        if srv is not None:
            srv.shutdown()
            srv.server_close()

    def __enter__(self) -> IndexServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class MotoS3:
    """moto's S3 server on 127.0.0.1 (a free port); stops with its context.

    ``options`` are this server's endpoint and credentials as ``xinsitu.open_zarr``
    keywords; ``store(bucket)`` an obstore ``S3Store`` with them. moto does not check the
    credentials' values, but it does refuse unsigned requests unless a bucket policy allows
    them (``make_public``).
    """

    def __init__(self, access_key_id: str = "AKIATESTFAKEKEY0001", secret_access_key: str = "test-fake-secret-0001",
                 region: str = "us-east-1", max_lifetime_s: float = 300.0):
        self.region = region
        self.access_key_id, self.secret_access_key = access_key_id, secret_access_key
        self.max_lifetime_s = float(max_lifetime_s)
        self._server: Any = None
        self._timer: threading.Timer | None = None
        self.endpoint = ""

    def start(self) -> MotoS3:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._server = ThreadedMotoServer(ip_address=HOST, port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        assert host == HOST, host
        self.endpoint = f"http://{host}:{port}"
        self._timer = threading.Timer(self.max_lifetime_s, self.stop)
        self._timer.daemon = True
        self._timer.start()
        return self

    @property
    def options(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "access_key_id": self.access_key_id,
                "secret_access_key": self.secret_access_key, "region": self.region,
                "client_options": {"allow_http": True}}

    def _client(self) -> Any:
        import boto3  # moto's own dependency; used for bucket set-up only

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key_id,
                            aws_secret_access_key=self.secret_access_key, region_name=self.region)

    def create_bucket(self, bucket: str) -> None:
        c = self._client()
        if bucket not in [b["Name"] for b in c.list_buckets().get("Buckets", [])]:
            c.create_bucket(Bucket=bucket)

    def make_public(self, bucket: str) -> None:
        """Let anyone (unsigned requests) read the bucket's objects."""
        pol = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": "*", "Action": ["s3:GetObject"],
                                                       "Resource": [f"arn:aws:s3:::{bucket}/*"]}]}
        self._client().put_bucket_policy(Bucket=bucket, Policy=json.dumps(pol))

    def store(self, bucket: str, prefix: str | None = None) -> Any:
        import obstore.store

        return obstore.store.S3Store(bucket, prefix=prefix, **self.options)

    def upload(self, local: str | os.PathLike, bucket: str, prefix: str) -> int:
        """Copy the files under ``local`` to ``prefix/`` in ``bucket`` (made if needed); return how many."""
        import obstore

        self.create_bucket(bucket)
        store = self.store(bucket)
        root = Path(local)
        n = 0
        for p in sorted(root.rglob("*")):
            if p.is_file():
                obstore.put(store, f"{prefix}/{p.relative_to(root).as_posix()}", p.read_bytes())
                n += 1
        return n

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        srv, self._server = self._server, None
        if srv is not None:
            srv.stop()

    def __enter__(self) -> MotoS3:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# ----------------------------------------------------------------------------- helpers for the tests
def write_archive(path: str | os.PathLike, nt: int = 96, ny: int = 8, nx: int = 16, chunk_time: int = 8,
                  shard_time: int | None = None) -> str:
    """A small ERA5-like archive (12 time chunks by default, in shards of ``shard_time``) at ``path``."""
    from xinsitu.synthetic import write_era5_like

    write_era5_like(str(path), nt=nt, ny=ny, nx=nx, chunk_time=chunk_time, shard_time=shard_time)
    return str(path)


def epoch_numpy(gen: Any) -> tuple[list[Any], list[dict[str, Any]]]:
    """(sample ids of each batch, the batches) of one epoch of a ``output="numpy"`` generator."""
    ids = gen.batch_ids()
    return ids, list(gen)


def assert_same_epoch(got: tuple[list[Any], list[dict[str, Any]]], ref: tuple[list[Any], list[dict[str, Any]]]) -> None:
    """The same samples in the same batches, with bit-identical values (NaN == NaN)."""
    import numpy as np

    ids, batches = got
    rids, rbatches = ref
    assert len(ids) == len(rids) == len(batches) == len(rbatches), (len(ids), len(rids), len(batches), len(rbatches))
    for k, (i, r, b, rb) in enumerate(zip(ids, rids, batches, rbatches, strict=True)):
        assert np.array_equal(i, r), f"batch {k}: other samples"
        assert set(b) == set(rb), f"batch {k}: other variables"
        for v in rb:
            assert b[v].dtype == rb[v].dtype and b[v].shape == rb[v].shape, (k, v, b[v].shape, rb[v].shape)
            assert np.array_equal(b[v], rb[v], equal_nan=True), f"batch {k}, variable {v!r}: other values"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Serve a folder over HTTP on 127.0.0.1 (test server).")
    ap.add_argument("root")
    ap.add_argument("--latency", type=float, default=0.0)
    ap.add_argument("--lifetime", type=float, default=600.0)
    for k in KINDS:
        ap.add_argument(f"--{k.replace('_', '-')}", type=float, default=0.0)
    a = ap.parse_args(argv)
    faults = Faults(latency=a.latency, **{k: getattr(a, k) for k in KINDS})
    srv = FileServer(a.root, faults, max_lifetime_s=a.lifetime).start()
    print(srv.url, flush=True)
    if not sys.stdin.isatty():  # ends when the parent closes our stdin (or exits)
        threading.Thread(target=_exit_when_parent_closes_stdin, args=(srv.state.stop,), daemon=True).start()
    try:
        srv.state.stop.wait(a.lifetime)
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0


def _exit_when_parent_closes_stdin(stop: threading.Event) -> None:
    sys.stdin.read()
    stop.set()


if __name__ == "__main__":
    sys.exit(main())
