"""The I/O loop's façade (``xinsitu.io.loop``): results and errors come back to the caller's thread,
every wait is bounded, and a forked child gets a loop of its own and the fork policy."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path

import pytest

from tests.support.forked import in_fork
from xinsitu.io import loop as _loop


def test_run_returns_the_result_computed_on_the_loop_thread():
    async def where():
        await asyncio.sleep(0)
        return threading.current_thread().name

    assert _loop.run(where(), timeout=10) == "xinsitu-io"
    assert threading.current_thread().name != "xinsitu-io"


def test_run_reraises_the_coroutines_own_exception():
    class Boom(Exception):
        pass

    async def fail():
        raise Boom("from the loop")

    with pytest.raises(Boom, match="from the loop"):
        _loop.run(fail(), timeout=10)


def test_run_timeout_cancels_the_coroutine():
    cancelled = threading.Event()

    async def slow():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError, match=r"no result within 0\.2 s"):
        _loop.run(slow(), timeout=0.2)
    assert cancelled.wait(10), "the timed-out coroutine was left running"


def test_run_default_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("XINSITU_TIMEOUT", "0.2")
    assert _loop.run_timeout() == 0.2
    with pytest.raises(TimeoutError, match="XINSITU_TIMEOUT"):
        _loop.run(asyncio.sleep(60))


@pytest.mark.parametrize("bad", [0, -1.0])
def test_run_rejects_a_timeout_that_is_not_positive(bad):
    coro = asyncio.sleep(0)
    with pytest.raises(ValueError, match="timeout"):
        _loop.run(coro, timeout=bad)
    assert coro.cr_frame is None  # closed, not left to warn "never awaited"


def test_request_timeout_rejects_nonsense(monkeypatch):
    monkeypatch.setenv("XINSITU_REQUEST_TIMEOUT", "-3")
    with pytest.raises(ValueError, match="XINSITU_REQUEST_TIMEOUT"):
        _loop.request_timeout()
    monkeypatch.setenv("XINSITU_REQUEST_TIMEOUT", "2.5")
    assert _loop.request_timeout() == 2.5


def test_a_blocking_run_from_inside_the_loop_is_refused():
    async def nested():
        inner = asyncio.sleep(0)
        try:
            _loop.run(inner, timeout=1)
        except RuntimeError as e:
            return str(e)
        return "ran"

    assert "inside the I/O loop" in _loop.run(nested(), timeout=10)


def test_submit_returns_at_once_and_call_soon_runs_on_the_loop():
    gate = threading.Event()
    seen: list[str] = []

    async def wait_for_gate():
        while not gate.is_set():
            await asyncio.sleep(0.01)
        return 5

    fut = _loop.submit(wait_for_gate())
    assert not fut.done()  # submit did not wait
    _loop.call_soon(lambda: (seen.append(threading.current_thread().name), gate.set()))
    assert fut.result(timeout=10) == 5
    assert seen == ["xinsitu-io"]


def test_refuse_after_fork_is_silent_in_the_parent():
    assert not _loop.in_forked_child()
    _loop.refuse_after_fork("anything")  # no error


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs os.fork")
def test_a_forked_child_gets_its_own_loop_and_the_fork_policy():
    _loop.get_loop()  # the parent's loop and thread exist before the fork
    ok, msg = in_fork(lambda: _loop.in_forked_child() and _loop.run(asyncio.sleep(0, result=3), timeout=10) == 3,
                      lambda: _loop.refuse_after_fork("store X"))
    assert ok
    assert msg.startswith("store X cannot be read in this forked process") and msg.endswith(_loop.FORK_HELP)


_EXIT_CHILD = r"""
import atexit, sys, time, warnings
warnings.filterwarnings("ignore")
left = {}
# registered before xinsitu is imported, so it runs after xinsitu's own exit handler (LIFO)
atexit.register(lambda: print("native left at exit:", left["loop"]._native, round(time.monotonic() - left["t"], 2),
                              flush=True))
import xinsitu
from xinsitu.io import loop as _loop
left["loop"] = _loop
ds = xinsitu.open_zarr(sys.argv[1])
m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
gen = ds.insitu.batches(m, "train", batch_size=2, output="numpy", max_inflight=16, shuffle=False)
it = iter(gen)  # held to the end: never closed
next(it)  # the first buffer holds time 0..15; later buffers are being read (through obstore) as the script ends
left["t"] = time.monotonic()
"""


@pytest.mark.parametrize("how", ["slow", "hang"])
@pytest.mark.slow
def test_exit_waits_for_reads_in_flight_then_ends(tmp_path, how):
    """A script that ends while reads are in flight exits cleanly: the exit handler cancels them and
    waits until obstore's runtime threads are done with Python. (A runtime thread that takes the GIL
    once the interpreter finalizes is ended by ``pthread_exit``, which aborts the process: SIGABRT,
    exit code 134, at the end of a training script that finished its work.) A server that never
    answers does not hold the exit up past ``EXIT_WAIT_S``."""
    import subprocess

    import zarr

    from tests.support.servers import Faults, FileServer, write_archive

    write_archive(tmp_path / "a.zarr", nt=64, ny=4, nx=4, chunk_time=1)
    zarr.consolidate_metadata(str(tmp_path / "a.zarr"))
    script = tmp_path / "child.py"
    script.write_text(_EXIT_CHILD)
    with FileServer(tmp_path) as srv:
        srv.faults = Faults(latency=0.3) if how == "slow" else Faults(hang=1.0, pattern=r"/c/(1[6-9]|[2-9]\d)/")
        p = subprocess.run([sys.executable, str(script), srv.url + "/a.zarr"], capture_output=True, text=True,
                           timeout=120, cwd=str(Path(__file__).resolve().parents[2]))
    assert p.returncode == 0, p.stderr[-2000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("native left at exit:")]
    assert line, p.stdout
    left, took = line[0].split(":")[1].split()
    assert int(left) == 0
    assert float(took) < _loop.EXIT_WAIT_S + 30  # bounded (generously: a loaded machine), never a hang


_FOREIGN_CHILD = r"""
import asyncio, threading, time
from xinsitu.io import loop as _loop
home = asyncio.new_event_loop()  # another library's loop (zarr's, where an open's metadata reads run)
threading.Thread(target=home.run_forever, daemon=True).start()


async def call():
    try:
        await _loop.native(asyncio.sleep(60))  # stands in for an obstore request that has no answer yet
    except asyncio.CancelledError:
        print("cancelled at exit", flush=True)
        raise

asyncio.run_coroutine_threadsafe(call(), home)
while not _loop._foreign:
    time.sleep(0.01)
print("counted", _loop._native, flush=True)
"""


def test_exit_cancels_and_waits_for_calls_on_another_loop(tmp_path):
    """A call into obstore's runtime awaited on another loop than xinsitu's -- the metadata reads of an
    open run on zarr's, and an open that failed on one (a server that does not answer) left the others
    in flight -- is counted, cancelled at exit and waited for: else obstore's runtime thread took the
    GIL once the interpreter finalized, and a script that had done its work died of SIGABRT (7 of 80
    runs of a failed open under load, none since)."""
    import subprocess

    script = tmp_path / "child.py"
    script.write_text(_FOREIGN_CHILD)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                       cwd=str(Path(__file__).resolve().parents[2]))
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["counted", "1", "cancelled", "at", "exit"], p.stdout


@pytest.mark.parametrize("name", ["XINSITU_TIMEOUT", "XINSITU_REQUEST_TIMEOUT", "XINSITU_DECODE_THREADS"])
@pytest.mark.parametrize("value", ["abc", "0", "-1"])
def test_a_bad_environment_knob_is_named(monkeypatch, name, value):
    """``XINSITU_TIMEOUT=abc`` (or 0) says which variable holds what (it said "could not convert string to
    float: 'abc'", or "timeout ... got None", and left a coroutine never awaited)."""
    import gc
    import warnings

    from xinsitu.io.loop import decode_threads, request_timeout, run, run_timeout

    monkeypatch.setenv(name, value)
    read = {"XINSITU_TIMEOUT": run_timeout, "XINSITU_REQUEST_TIMEOUT": request_timeout,
            "XINSITU_DECODE_THREADS": decode_threads}[name]
    with pytest.raises(ValueError, match=f"{name} must be a positive .*got '{value}'"):
        read()
    if name == "XINSITU_TIMEOUT":
        async def nothing() -> None:
            return None

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ValueError, match=name):
                run(nothing())
            gc.collect()
