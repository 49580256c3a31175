"""``python -m http.server`` as a user runs it, on 127.0.0.1, and servers like it that are poorer
still: what the disk cache meets on HTTP stores that give their objects no trustworthy version.

``PlainServer(root)`` serves with the standard library's own handler (``SimpleHTTPRequestHandler``):
a ``Last-Modified`` in whole seconds, no ``ETag``, no byte ranges. ``head=`` changes how it
answers ``HEAD`` (``GET`` stays as it is): ``"405"`` (Method Not Allowed), ``"501"`` (Not
Implemented: what a handler that defines only ``do_GET`` answers, and obstore retries), ``"404"`` (Not
Found: a proxy or signed-URL service that answers ``HEAD`` wrongly), ``"bare"`` (neither
``ETag`` nor ``Last-Modified``, on ``GET`` either), or ``"silent"`` (the request is taken and never
answered, until the server stops). ``head`` may be changed while it serves. ``heads`` counts the
``HEAD`` requests it got. ``lengths=False`` sends no ``Content-Length`` (each body ends as its
connection closes: complete, as dynamic servers send them). ``auth="user:password"`` answers 401
to any request without that HTTP Basic ``Authorization``.

The server binds 127.0.0.1 on a free port and stops with its context (or after ``max_lifetime_s``).
"""

from __future__ import annotations

import base64
import functools
import os
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HEADS = ("plain", "405", "501", "404", "bare", "silent")


class _Handler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    @property
    def owner(self) -> PlainServer:
        return self.server.owner  # type: ignore[attr-defined]

    def _refused(self) -> bool:
        """Whether the request lacks the credentials the server asks (answered 401 here)."""
        auth = self.owner.auth
        if auth is None or self.headers.get("Authorization") == "Basic " + base64.b64encode(auth.encode()).decode():
            return False
        self.send_error(401)
        return True

    def do_GET(self) -> None:
        if not self._refused():
            super().do_GET()

    def do_HEAD(self) -> None:
        owner = self.owner
        with owner.lock:
            owner.heads += 1
        if self._refused():
            return
        if owner.head in ("405", "501", "404"):
            self.send_error(int(owner.head))
            return
        if owner.head == "silent":  # taken, never answered: the client's own bound must end it
            owner.stopping.wait()
            self.close_connection = True
            return
        super().do_HEAD()

    def send_header(self, keyword: str, value: str) -> None:
        if self.owner.head == "bare" and keyword.lower() in ("last-modified", "etag"):
            return
        if not self.owner.lengths and keyword.lower() == "content-length":
            return
        super().send_header(keyword, value)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128


class PlainServer:
    """The standard library's HTTP file server over ``root`` (see the module's docstring)."""

    def __init__(self, root: str | os.PathLike[str], head: str = "plain", max_lifetime_s: float = 300.0,
                 lengths: bool = True, auth: str | None = None):
        if head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {head!r}")
        self.root, self.head, self.max_lifetime_s = os.fspath(root), head, float(max_lifetime_s)
        self.lengths, self.auth = lengths, auth
        self.lock = threading.Lock()
        self.heads = 0
        self.stopping = threading.Event()
        self._server: _Server | None = None
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        assert self._server is not None, "server not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> PlainServer:
        srv = _Server(("127.0.0.1", 0), functools.partial(_Handler, directory=self.root))
        srv.owner = self  # type: ignore[attr-defined]
        self._server = srv
        serve = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                                 name="test-plain-http")
        watch = threading.Thread(target=self._watchdog, daemon=True, name="test-plain-http-watchdog")
        serve.start()
        watch.start()
        self._threads = [serve, watch]
        return self

    def _watchdog(self) -> None:
        self.stopping.wait(self.max_lifetime_s)
        self.stop()

    def stop(self) -> None:
        self.stopping.set()  # wakes the silent HEADs
        srv, self._server = self._server, None
        if srv is not None:
            srv.shutdown()
            srv.server_close()

    def __enter__(self) -> PlainServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=10)
