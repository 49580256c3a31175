"""The one I/O event loop: lazy, fork-aware, errors re-raised on the caller's thread.

Every asynchronous read in xinsitu runs on a single asyncio loop that lives in a
daemon thread. The loop is created on first use, its decode thread pool is its
default executor, and both are forgotten in a forked child (threads do not survive
``fork``), so the child builds its own on first use.

The façade, the only ways the rest of xinsitu drives the loop:

* :func:`run` -- run a coroutine there and wait for its result, bounded in time (``timeout=``,
  ``XINSITU_TIMEOUT``): every blocking wait on the loop goes through it;
* :func:`submit` -- schedule a coroutine and return at once with a
  ``concurrent.futures.Future``: the one non-blocking entry point, for a producer that runs
  for a whole epoch while its consumer polls (``xinsitu.batches.pipeline``); whoever waits on the
  future bounds that wait;
* :func:`call_soon` -- a plain callback, from any thread (e.g. releasing a semaphore of the
  loop's).

Code running *on* the loop uses ``asyncio`` itself (``get_running_loop``, ``run_in_executor``
for the decode threads). The fork policy (:func:`refuse_after_fork`, :data:`FORK_HELP`) lives
here too.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

#: seconds ``run`` waits for a result at most, by default (``XINSITU_TIMEOUT`` overrides it)
RUN_TIMEOUT = 3600.0
#: seconds one request may wait for its answer before it is given up and made again
#: (``XINSITU_REQUEST_TIMEOUT`` overrides it): this bounds every backend, zarr stores and Icechunk
#: included, and the metadata reads of an open. Long enough for obstore's own stall detection
#: (``xinsitu.stores.opening.DEFAULT_CLIENT_OPTIONS``: connect and read timeouts) to fire and retry within
#: one try; shorter than obstore's retry timeout (``DEFAULT_RETRY_CONFIG``), so that a server that
#: never answers ends in xinsitu's ``TimeoutError`` naming the object, three tries (3 minutes) at
#: most. A chunk read waits longer while other requests to its store are answered (a slow link
#: busy with large chunks, not a silent store): up to ``REQUEST_PATIENCE`` times this.
REQUEST_TIMEOUT = 60.0
#: ... the most a request waits, in multiples of the request timeout, while its store answers others
REQUEST_PATIENCE = 6.0
#: seconds the interpreter's exit waits at most for reads still in flight (see ``_shutdown``)
EXIT_WAIT_S = 5.0

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_pool: ThreadPoolExecutor | None = None
_copies: ThreadPoolExecutor | None = None  # see ``in_parallel``
_forked = False
_imported_at_fork: frozenset[str] = frozenset()  # Rust-runtime modules a forking parent had imported
_native = 0  # calls into a Rust runtime (obstore) awaited on the loop now: waited for at exit
#: ... those awaited on another loop (zarr's: the metadata reads of an open), by task: cancelled and
#: waited for at exit too
_foreign: dict[asyncio.Task, asyncio.AbstractEventLoop] = {}
_count_lock = threading.Lock()  # (two loops' threads count)


class PerLoop:
    """One object per running loop, made by ``factory(loop)`` on first use there (a new one after
    ``fork``, or on another loop); ``get()`` from code running on the loop."""

    __slots__ = ("factory", "_held")

    def __init__(self, factory: Callable[[asyncio.AbstractEventLoop], Any]):
        self.factory = factory
        self._held: tuple[asyncio.AbstractEventLoop, Any] | None = None

    def get(self) -> Any:
        loop = asyncio.get_running_loop()
        held = self._held
        if held is None or held[0] is not loop:
            held = self._held = (loop, self.factory(loop))
        return held[1]


class OneTurn:
    """Items added during one turn of the running loop, handed to ``flush(items)`` together once the
    turn ends (one ``call_soon`` per turn, not per item): what batches the decode threads' calls
    (``decode.TurnBatch``) and a virtual store's byte ranges (``ManifestBackend``)."""

    __slots__ = ("flush", "_items")

    def __init__(self, flush: Callable[[list[Any]], None]):
        self.flush = flush
        self._items: list[Any] | None = None

    def add(self, item: Any) -> None:
        if self._items is None:
            self._items = []
            asyncio.get_running_loop().call_soon(self._end)
        self._items.append(item)

    def _end(self) -> None:
        items, self._items = self._items or [], None
        self.flush(items)


def decode_threads() -> int:
    """Threads that decode chunks: one per core this process may run on (its CPU affinity, as
    ``os.process_cpu_count`` says on Python 3.13), at least two (decode releases the GIL);
    ``XINSITU_DECODE_THREADS`` sets it."""
    n = env_number("XINSITU_DECODE_THREADS", int)
    return max(2, usable_cores()) if n is None else int(n)


def env_number(name: str, kind: type = float) -> float | None:
    """The positive number of ``kind`` environment variable ``name`` holds, None where it is unset or
    empty; ``ValueError`` naming the variable where it holds anything else (``abc``, ``0``)."""
    env = os.environ.get(name, "").strip()
    if not env:
        return None
    try:
        value = kind(env)
    except ValueError:
        value = None
    if value is None or not value > 0:
        what = "whole number" if kind is int else "number of seconds"
        raise ValueError(f"{name} must be a positive {what}, got {env!r}")
    return value


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one), else every core."""
    count = getattr(os, "process_cpu_count", None)  # Python 3.13
    if count is not None:
        return count() or 1
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def get_loop() -> asyncio.AbstractEventLoop:
    """The running I/O loop, started on first use (drive it through ``run``, ``submit``, ``call_soon``)."""
    global _loop, _thread, _pool
    if _loop is not None:
        return _loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            _pool = ThreadPoolExecutor(decode_threads(), thread_name_prefix="xinsitu-decode")
            loop.set_default_executor(_pool)
            th = threading.Thread(target=loop.run_forever, name="xinsitu-io", daemon=True)
            th.start()
            _loop, _thread = loop, th
    return _loop


def in_parallel(calls: list[Callable[[], Any]]) -> None:
    """Run ``calls`` (copies that release the GIL: numpy's) on every usable core and wait for them all;
    the first exception is raised. Threads of their own, not the decode threads: a batch's copies never
    queue behind the chunk reads of the buffers read ahead."""
    global _copies
    if len(calls) < 2:
        for call in calls:
            call()
        return
    pool = _copies
    if pool is None:
        with _lock:
            if _copies is None:
                _copies = ThreadPoolExecutor(usable_cores(), thread_name_prefix="xinsitu-copy")
            pool = _copies
    futs = [pool.submit(call) for call in calls]
    for f in futs:
        f.result()


def run_timeout() -> float:
    """Seconds ``run`` waits at most by default: ``XINSITU_TIMEOUT``, else ``RUN_TIMEOUT``."""
    t = env_number("XINSITU_TIMEOUT")
    return RUN_TIMEOUT if t is None else t


def request_timeout() -> float:
    """Seconds one request (one object or byte range) may take before it is given up and retried:
    ``XINSITU_REQUEST_TIMEOUT``, else ``REQUEST_TIMEOUT``."""
    t = env_number("XINSITU_REQUEST_TIMEOUT")
    return REQUEST_TIMEOUT if t is None else t


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the I/O loop and return its result here (exceptions re-raised).

    Parameters
    ----------
    coro : the coroutine.
    timeout : seconds to wait at most (default: ``run_timeout()``); then ``coro`` is cancelled
        and ``TimeoutError`` raised. Reads bound each request themselves (``request_timeout``):
        this is the backstop that keeps any call from waiting forever.
    """
    loop = get_loop()
    if threading.current_thread() is _thread:
        coro.close()
        raise RuntimeError("xinsitu: blocking call made from inside the I/O loop")
    try:
        limit = run_timeout() if timeout is None else float(timeout)
        if not limit > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    except BaseException:
        coro.close()  # never started: closed, so nothing warns that it was never awaited
        raise
    fut = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return fut.result(timeout=limit)
    except concurrent.futures.TimeoutError:  # (the builtin TimeoutError: also what ``coro`` may raise)
        if fut.done():  # coro's own TimeoutError (or it ended just now): its outcome, as it is
            return fut.result()
        fut.cancel()
        raise TimeoutError(f"xinsitu: no result within {limit:g} s (timeout=, XINSITU_TIMEOUT)") from None
    except BaseException:
        fut.cancel()  # e.g. KeyboardInterrupt in the caller: stop the work on the loop too
        raise


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Schedule ``coro`` on the I/O loop and return at once: the one non-blocking entry point.

    The caller owns the returned ``concurrent.futures.Future``: it polls it or waits on it with a
    timeout, and cancels it when it gives up (``xinsitu.batches.pipeline.EpochRun`` does all three).
    """
    return asyncio.run_coroutine_threadsafe(coro, get_loop())


def call_soon(callback: Callable[..., object], *args: Any) -> None:
    """Call ``callback(*args)`` on the I/O loop soon; safe from any thread, never waits."""
    get_loop().call_soon_threadsafe(callback, *args)


async def native(awaitable: Awaitable[T]) -> T:
    """``await awaitable``, counted as a call into a Rust runtime (obstore) until it comes back.

    Such a call ends by taking the GIL from one of the runtime's own threads to hand over its
    result (or to see that it was cancelled). After the interpreter began to finalize, a thread
    taking the GIL is ended with ``pthread_exit``, which aborts a Rust thread: the whole process
    dies with SIGABRT at exit. ``_shutdown`` therefore waits (bounded) for the count to reach zero
    before the interpreter finalizes.
    """
    global _native
    running = asyncio.get_running_loop()
    task = asyncio.current_task() if running is not _loop else None  # on another loop (zarr's)
    with _count_lock:
        _native += 1
        if task is not None:
            _foreign[task] = running
            exit_first()  # (that loop's own exit handler, zarr's, must not stop it before ours ran)
    try:
        return await awaitable
    finally:
        with _count_lock:
            _native -= 1
            if task is not None:
                _foreign.pop(task, None)


def native_future(fut: asyncio.Future) -> None:
    """Count ``fut``, a call into a Rust runtime not awaited (see ``native``), until it ends."""
    global _native
    with _count_lock:
        _native += 1
    fut.add_done_callback(_native_ended)


def _native_ended(_: asyncio.Future) -> None:
    global _native
    with _count_lock:
        _native -= 1


def in_forked_child() -> bool:
    """True in a process made by ``fork`` after xinsitu was imported (obstore unusable there)."""
    return _forked


# --------------------------------------------------------------------------- fork policy
# The one fork policy of xinsitu. obstore's and Icechunk's Rust runtimes do not survive
# ``fork``: any call into them in a forked child (even on a store object made there) hangs
# once the parent has used them. So in a forked child local files are read with plain file
# I/O (``xinsitu.stores.backend.backend_for`` picks that backend), and every read that would have
# to go through obstore or Icechunk raises ``ForkError`` at once, through ``refuse_after_fork``.

#: What to do instead; every fork refusal ends with it.
FORK_HELP = (
    "obstore, Icechunk and fsspec's async clients cannot run in a process forked from one that has used them "
    "(the read would hang or fail). "
    "Use DataLoader(..., num_workers=0) (xinsitu reads in parallel already) or start workers with "
    "multiprocessing_context='spawn' or 'forkserver'"
)


class ForkError(RuntimeError):
    """A read that would hang in this forked process (obstore or Icechunk after ``fork``)."""


def refuse_after_fork(what: str) -> None:
    """Raise ``ForkError`` naming ``what`` in a forked child; do nothing elsewhere.

    Parameters
    ----------
    what : str
        What would have been read, e.g. ``"remote store HTTPStore('http://...')"``.
    """
    if _forked:
        raise ForkError(f"{what} cannot be read in this forked process: {FORK_HELP}")


def forked_after(module: str) -> bool:
    """Whether this process was forked from one that had imported ``module`` (``"obstore"``): the parent may
    have used its runtime then; a parent that never imported it leaves the child free to use it."""
    return _forked and module in _imported_at_fork


def _after_fork_in_child() -> None:
    global _loop, _thread, _pool, _copies, _lock, _forked, _imported_at_fork
    _loop = _thread = _pool = _copies = None
    _lock = threading.Lock()
    _forked = True
    _imported_at_fork = _imported_at_fork | frozenset(m for m in ("obstore", "icechunk") if m in sys.modules)


async def _drain(wait_s: float) -> None:
    """Cancel every task on the loop, then wait until no call into a Rust runtime is left (cancelled
    ones report back too), at most ``wait_s`` seconds in all."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=wait_s)
    while _native and loop.time() < deadline:
        await asyncio.sleep(0.005)
    if tasks:  # a cancelled call's runtime thread takes the GIL once more, right after: let it
        await asyncio.sleep(0.05)


def _shutdown() -> None:
    """At exit (before the interpreter finalizes): stop the reads still under way -- e.g. the next
    epoch's first buffer, read ahead -- and wait for the Rust runtime's threads to be done with
    Python (see ``native``), then stop the loop."""
    loop, pool = _loop, _pool
    deadline = time.monotonic() + EXIT_WAIT_S
    with _count_lock:
        foreign = list(_foreign.items())
    for task, home in foreign:  # calls awaited on another loop (zarr's): cancelled there, waited for below
        if home.is_running():
            home.call_soon_threadsafe(task.cancel)
    if loop is not None and not loop.is_closed():
        if loop.is_running() and _thread is not None and _thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(_drain(EXIT_WAIT_S), loop).result(EXIT_WAIT_S + 1.0)
            except BaseException:  # noqa: BLE001 - exiting: nothing left to report to
                pass
        loop.call_soon_threadsafe(loop.stop)
    if foreign:
        while _native and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)  # a cancelled call's runtime thread takes the GIL once more, right after: let it
    for p in (pool, _copies):
        if p is not None:
            p.shutdown(wait=False, cancel_futures=True)


def exit_first() -> None:
    """Run this loop's exit (``_shutdown``) before every exit handler registered so far (``atexit`` runs
    the last registered first): reads that run on another library's loop (zarr's: an fsspec store's
    reads, an open's metadata reads) are then cancelled and waited for while that loop still runs --
    zarr's own handler, registered once zarr's loop is made, stops it: a read cancelled after that
    printed "Event loop is closed" and "Task was destroyed but it is pending" tracebacks at the end of
    a user's script, and an obstore call left in flight there aborted it (see ``native``)."""
    atexit.unregister(_shutdown)
    atexit.register(_shutdown)


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_shutdown)
