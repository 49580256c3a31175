"""A user's output shows only what concerns them: the demo prints no warning, and the test servers
print no traceback when a client hangs up."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.servers import FileServer

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("overloaded", [False, True])
def test_server_quiet_when_a_client_hangs_up(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             overloaded: bool) -> None:
    with FileServer(tmp_path, overloaded=overloaded) as srv:
        server = srv._server
        assert server is not None
        for exc in (ConnectionResetError(104, "Connection reset by peer"), BrokenPipeError(32, "Broken pipe"),
                    TimeoutError("timed out")):
            try:
                raise exc
            except OSError:
                server.handle_error(None, ("127.0.0.1", 1))
        assert "Exception occurred" not in capsys.readouterr().err
        try:  # anything else is still reported
            raise ValueError("a bug in the handler")
        except ValueError:
            server.handle_error(None, ("127.0.0.1", 1))
        assert "a bug in the handler" in capsys.readouterr().err


def test_server_quiet_on_a_reset_connection(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A client that resets its connection mid-request: the server goes on, silently."""
    import struct
    import urllib.request

    (tmp_path / "a").write_bytes(b"x" * 100)
    with FileServer(tmp_path) as srv:
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n")  # an unfinished request, then a reset
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        with urllib.request.urlopen(f"{srv.url}/a", timeout=10) as r:
            assert r.read() == b"x" * 100
    assert "Exception occurred" not in capfd.readouterr().err


@pytest.mark.slow
def test_demo_prints_no_warning(tmp_path: Path) -> None:
    """The demo on its own synthetic archive: no ZarrUserWarning (consolidated metadata on v3) or any other."""
    pytest.importorskip("torch")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "default"}
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "train_demo.py"), "--nt", "480", "--epochs", "1"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Warning" not in p.stdout + p.stderr, p.stderr
    assert "epoch 0:" in p.stdout


@pytest.mark.slow
def test_no_jax_fork_warning_after_the_jax_tests() -> None:
    """The jax tests, then a test that forks, in one pytest run: no "JAX is multithreaded" warning."""
    pytest.importorskip("jax")
    env = {k: v for k, v in os.environ.items() if k not in ("XINSITU_TEST_CHILD", "PYTEST_CURRENT_TEST")}
    env["PYTHONPATH"] = str(ROOT)
    # (tests/batches/test_jax.py runs its tests in a process of their own: nothing of it stays here to fork)
    targets = ["tests/test_acceptance_spec.py::test_output_jax",
               "tests/io/test_loop.py::test_a_forked_child_gets_its_own_loop_and_the_fork_policy"]
    p = subprocess.run([sys.executable, "-m", "pytest", *targets, "-q", "-p", "no:cacheprovider"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    assert "JAX is multithreaded" not in p.stdout + p.stderr, p.stdout[-6000:]
