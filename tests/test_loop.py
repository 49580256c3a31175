"""The I/O loop's façade (``xinsitu._loop``): results and errors come back to the caller's thread,
every wait is bounded, and a forked child gets a loop of its own and the fork policy."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

from tests.support.forked import in_fork
from xinsitu import _loop


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
