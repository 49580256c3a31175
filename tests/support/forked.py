"""Run a check (or an epoch) in a child made by ``os.fork`` and bring its answer back through a pipe."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from xinsitu.io import loop as _loop


def in_fork(check: Callable[[], bool], refused: Callable[[], object]) -> tuple[bool, str]:
    """In a forked child: ``check()``, then ``refused()``, which should raise ``ForkError``. Returns
    (what ``check`` returned, the ``ForkError`` message or ``"no error"``). The child leaves with
    ``os._exit`` (never the parent's atexit handlers); its exit status must be 0."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ok = check()
            try:
                refused()
                msg = "no error"
            except _loop.ForkError as e:
                msg = str(e)
            os.write(w, f"{ok}|{msg}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    ok, msg = out.split("|", 1)
    return ok == "True", msg


def epoch_in_fork(gen: Any, within: float, what: Callable[[Any], Any]) -> tuple[str, Any]:
    """``what(gen)`` (e.g. an epoch's batches, recorded) in a child forked by multiprocessing (a DataLoader
    worker under Linux's default start method): ``("ok", answer)`` or ``("error", message)``. Waits at
    most ``within`` seconds, then fails naming the hang; a child still alive after is killed."""
    import multiprocessing as mp

    parent, child = mp.get_context("fork").Pipe()
    p = mp.get_context("fork").Process(target=_in_child, args=(gen, child, what), daemon=True)
    p.start()
    try:
        assert parent.poll(within), f"the forked child neither read nor failed within {within:g} s: it hung"
        return parent.recv()
    finally:
        p.join(5)
        if p.is_alive():
            p.kill()


def _in_child(gen: Any, conn: Any, what: Callable[[Any], Any]) -> None:
    try:
        conn.send(("ok", what(gen)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))
