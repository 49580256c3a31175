"""Tests that run in a child pytest process of their own.

jax starts threads when its backend starts and, from then on, warns at every ``os.fork()`` of
the process ("os.fork() was called ... JAX is multithreaded"): the fork tests that run after a
jax test in the same pytest process would print it. The jax tests run in a child process
instead, which exits with them; their outcome, and their output on a failure, come back.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = "XINSITU_TEST_CHILD"
TIMEOUT_S = 600


def in_child() -> bool:
    """True in the child process that :func:`run_in_child` starts."""
    return os.environ.get(CHILD) == "1"


def run_in_child(*targets: str, timeout: float = TIMEOUT_S) -> None:
    """``pytest targets`` in a child process: fails with its output if a test fails, skips if all skipped."""
    env = {**os.environ, CHILD: "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("PYTEST_CURRENT_TEST", None)
    p = subprocess.run([sys.executable, "-m", "pytest", *targets, "-q", "-rs", "-p", "no:cacheprovider"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    assert p.returncode == 0, f"in a child process: {' '.join(targets)}\n{out[-8000:]}"
    if "passed" not in summary and "skipped" in summary:
        pytest.skip(f"in a child process: {summary}")


def own_process(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: the test runs in a child pytest process (its fixtures are set up there too)."""
    if in_child():
        return fn

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        nodeid = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
        run_in_child(nodeid)

    return run


def rerun_here_in_child() -> bool:
    """In the main pytest process: run the current test (this parameter only) in a child and return True;
    in the child: False (go on). For one jax parameter of a parametrized test."""
    if in_child():
        return False
    run_in_child(os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0])
    return True
