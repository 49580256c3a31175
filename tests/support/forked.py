"""Run a check in a child made by ``os.fork`` and bring its answer back through a pipe."""

from __future__ import annotations

import os
from collections.abc import Callable

from xinsitu import _loop


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
