#!/usr/bin/env python
"""Serve a directory over HTTP with a fixed delay on every request: a local Zarr made to
look like an object store.

    python bench/latency_server.py ROOT --latency-ms 20 [--port 0]

Every request (GET or HEAD) waits ``--latency-ms`` before its response starts; requests in
flight overlap, as they do against S3 or GCS, so a reader that keeps many requests in
flight hides the latency and one that reads one object at a time pays it in full.
Single byte ranges (``Range: bytes=a-b``, ``a-``, ``-n``) are honoured; there is no
listing (obstore's ``HTTPStore.list`` fails), so Zarr archives need consolidated
metadata. On start the server prints ``LISTENING http://HOST:PORT/`` and flushes;
``GET /_bench/stats`` returns ``{"requests": n, "bytes": n}`` without any delay.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys

from aiohttp import web


def byte_range(header: str, size: int) -> tuple[int, int] | None:
    """(first, last) inclusive of a single ``bytes=`` range; None when it cannot be satisfied."""
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return 0, size - 1  # not ours to serve piecewise: the whole object
    a, _, b = spec.strip().partition("-")
    if not a:
        n = int(b)
        return (max(0, size - n), size - 1) if n > 0 and size else None
    first = int(a)
    last = min(int(b), size - 1) if b else size - 1
    return (first, last) if first < size and first <= last else None


def make_app(root: str, latency_s: float) -> web.Application:
    root = os.path.realpath(root)
    counters = {"requests": 0, "bytes": 0}

    async def serve_file(request: web.Request) -> web.Response:
        counters["requests"] += 1
        if latency_s > 0:
            await asyncio.sleep(latency_s)
        path = os.path.realpath(os.path.join(root, request.match_info["path"]))
        if not path.startswith(root + os.sep) or not os.path.isfile(path):
            raise web.HTTPNotFound()
        st = os.stat(path)
        headers = {
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            "ETag": f'"{st.st_mtime_ns:x}-{st.st_size:x}"',
            "Last-Modified": _http_date(st.st_mtime),
        }
        first, last, status = 0, st.st_size - 1, 200
        if "Range" in request.headers:
            r = byte_range(request.headers["Range"], st.st_size)
            if r is None:
                headers["Content-Range"] = f"bytes */{st.st_size}"
                return web.Response(status=416, headers=headers)
            first, last = r
            status = 206
            headers["Content-Range"] = f"bytes {first}-{last}/{st.st_size}"
        n = max(0, last - first + 1)
        if request.method == "HEAD":
            headers["Content-Length"] = str(n)
            return web.Response(status=status, headers=headers)
        with open(path, "rb") as f:  # chunk objects are small: one read
            f.seek(first)
            body = f.read(n)
        counters["bytes"] += len(body)
        return web.Response(status=status, headers=headers, body=body)

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(counters)

    app = web.Application()
    app.router.add_get("/_bench/stats", stats)
    app.router.add_route("GET", "/{path:.+}", serve_file)
    app.router.add_route("HEAD", "/{path:.+}", serve_file)
    return app


def _http_date(ts: float) -> str:
    from email.utils import formatdate

    return formatdate(ts, usegmt=True)


async def main(root: str, host: str, port: int, latency_ms: float) -> None:
    runner = web.AppRunner(make_app(root, latency_ms / 1000.0), access_log=None, handle_signals=False)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    await web.SockSite(runner, sock, backlog=2048).start()
    print(f"LISTENING http://{host}:{sock.getsockname()[1]}/", flush=True)
    done = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, done.set)
    await done.wait()
    await runner.cleanup()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", help="directory to serve")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: any free port")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="delay added to every request")
    a = ap.parse_args()
    if not os.path.isdir(a.root):
        sys.exit(f"not a directory: {a.root}")
    asyncio.run(main(a.root, a.host, a.port, a.latency_ms))
