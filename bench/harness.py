"""The parent side of the benchmarks: latency servers, one fresh subprocess per run, peak
RSS of the subprocess tree sampled from outside."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = os.path.join(HERE, "workloads.py")


class LatencyServer:
    """``latency_server.py`` serving ``root`` in a subprocess, ``latency_ms`` added per request."""

    def __init__(self, root: str, latency_ms: float):
        self.latency_ms = latency_ms
        cmd = [sys.executable, os.path.join(HERE, "latency_server.py"), root, "--latency-ms", str(latency_ms)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("LISTENING "):
            self.close()
            raise RuntimeError(f"latency server did not start: {line!r}")
        self.url = line.split()[1]

    def counters(self) -> dict[str, int]:
        with urllib.request.urlopen(self.url + "_bench/stats", timeout=10) as r:
            return json.load(r)

    def cpu_s(self) -> float:
        import psutil

        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> LatencyServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Stores:
    """The stores of a run: ``local`` or ``http:MS`` -> the base URL (or directory) archives are under."""

    def __init__(self, data_dir: str, specs: list[str]):
        self.data_dir = data_dir
        self.servers: dict[str, LatencyServer] = {}
        for s in specs:
            if s.startswith("http:"):
                self.servers[s] = LatencyServer(data_dir, float(s.split(":", 1)[1]))
            elif s != "local":
                raise SystemExit(f"unknown store {s!r}: use local or http:MS")

    def url(self, store: str, archive: str) -> str:
        """What ``xinsitu.open_zarr`` is given for ``archive`` (a path under ``data_dir``) on ``store``."""
        name = os.path.relpath(archive, self.data_dir)
        if store == "local":
            return archive
        return self.servers[store].url + name

    def close(self) -> None:
        for s in self.servers.values():
            s.close()

    def __enter__(self) -> Stores:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_child(
    config: dict[str, Any], timeout_s: float, env: dict[str, str] | None = None, server: LatencyServer | None = None
) -> dict[str, Any]:
    """Run one workload (``workloads.py``) in a fresh process group; sample the RSS of the tree.

    Returns the workload's result plus ``peak_rss_mb`` (the sampled peak of the sum over the
    process and its children, or the child's own ``VmHWM`` where larger), ``wall_s`` and,
    with a ``server``, the requests and CPU seconds it served.
    """
    import psutil

    cmd = [sys.executable, WORKLOADS, json.dumps(config)]
    full_env = dict(os.environ, **(env or {}))
    srv0 = (server.counters(), server.cpu_s()) if server else None
    t0 = time.perf_counter()
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, start_new_session=True
    )
    peak = {"rss": 0, "procs": 1}
    done = threading.Event()

    def sample() -> None:
        try:
            root = psutil.Process(p.pid)
        except psutil.Error:
            return
        while not done.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
                rss = 0
                for q in procs:
                    try:
                        rss += q.memory_info().rss
                    except psutil.Error:
                        pass
                peak["rss"] = max(peak["rss"], rss)
                peak["procs"] = max(peak["procs"], len(procs))
            except psutil.Error:
                pass
            done.wait(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        out, err = p.communicate(timeout=timeout_s)
        rc: Any = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # takes DataLoader workers along
        out, err = p.communicate()
        rc = "timeout"
    done.set()
    th.join()
    try:
        os.killpg(p.pid, signal.SIGKILL)  # orphaned workers of this run, if any
    except (ProcessLookupError, PermissionError):
        pass
    res: dict[str, Any] = {}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT ") :])
    res["rc"] = rc
    res["wall_s"] = time.perf_counter() - t0
    res["sampled_rss_mb"] = peak["rss"] / 1e6
    res["peak_rss_mb"] = max(peak["rss"] / 1e6, res.get("hwm_mb", 0.0))
    res["procs"] = peak["procs"]
    if server and srv0:
        c1 = server.counters()
        res["server_requests"] = c1["requests"] - srv0[0]["requests"]
        res["server_mb"] = (c1["bytes"] - srv0[0]["bytes"]) / 1e6
        res["server_cpu_s"] = server.cpu_s() - srv0[1]
    if "error" not in res and rc != 0:
        tail = (err or "").strip().splitlines()
        res["error"] = tail[-1][:400] if tail else f"exit status {rc}"
    return res
