"""``place.TurnBatch``: the decode-thread calls of one turn of the I/O loop go out as one job per
thread, each taking the next call left (work stealing); each awaiter gets its own call's result or
exception, whatever else failed. ``fetchers.read_local`` takes chunks the same way."""

from __future__ import annotations

import asyncio
import threading
from collections import deque

import numpy as np
import pytest

from xinsitu.io import loop as _loop
from xinsitu.io.fetchers import read_local
from xinsitu.io.place import TurnBatch


def test_calls_of_one_turn_go_out_as_one_job_per_thread():
    turn = TurnBatch(threads=2)
    seen: list[tuple[int, int]] = []  # (call, thread)

    def call(i: int) -> int:
        seen.append((i, threading.get_ident()))
        if i == 3:
            raise ValueError("call 3 fails")
        return i * 10

    async def go():
        futs = [turn.run(call, i) for i in range(8)]  # all in this turn
        return await asyncio.gather(*futs, return_exceptions=True)

    out = _loop.run(go(), timeout=30)
    assert out[:3] == [0, 10, 20] and out[4:] == [40, 50, 60, 70]
    assert isinstance(out[3], ValueError) and "call 3" in str(out[3])
    assert sorted(i for i, _ in seen) == list(range(8))  # the failure kept no other call from running
    assert len({t for _, t in seen}) <= 2  # one job per thread at most


def test_a_slow_call_leaves_the_other_calls_to_the_other_thread():
    """Calls are taken, not dealt: while call 0 runs (it waits until every other call ran), the
    other job runs all the rest. Dealt in fixed shares, calls 2, 4 and 6 would wait behind call 0."""
    turn = TurnBatch(threads=2)
    others_done = threading.Event()
    ran: list[int] = []
    lock = threading.Lock()

    def call(i: int) -> bool:
        if i == 0:
            return others_done.wait(timeout=30)
        with lock:
            ran.append(i)
            if len(ran) == 7:
                others_done.set()
        return True

    async def go():
        return await asyncio.gather(*(turn.run(call, i) for i in range(8)))

    assert _loop.run(go(), timeout=60)[0] is True  # the others all ran while call 0 waited
    assert sorted(ran) == list(range(1, 8))


class _SlowFirstStore:
    """Local-file reads where the first chunk's read waits until every other chunk was read."""

    def __init__(self, n: int):
        self.n, self.read_keys, self.lock, self.others_done = n, [], threading.Lock(), threading.Event()
        self.first_saw_others = None

    def read(self, path: str, scratch=None) -> bytes:
        if path.endswith("/0"):
            self.first_saw_others = self.others_done.wait(timeout=30)
        else:
            with self.lock:
                self.read_keys.append(path)
                if len(self.read_keys) == self.n - 1:
                    self.others_done.set()
        return np.full(4, int(path.rsplit("/", 1)[1]), "u1").tobytes()


class _RawDecoder:
    sync = True

    def key(self, coords):
        return "/".join(map(str, coords))

    def decode_into(self, raw, out):
        out[...] = np.frombuffer(raw, "u1")
        return True


def test_read_local_threads_take_chunks_from_one_queue():
    """Two decode threads reading one variable's chunks: the thread held on chunk 0 leaves every other
    chunk to the other one, and every chunk lands in its own destination once."""
    from types import SimpleNamespace

    from xinsitu.io.place import Slot

    n = 9
    route = SimpleNamespace(store=_SlowFirstStore(n), dec=_RawDecoder(), prefix="v/", src=SimpleNamespace(name="v"))
    store = route.store
    outs = [np.zeros(4, "u1") for _ in range(n)]
    todo = deque((route, (i,), Slot(outs[i])) for i in range(n))
    parts: list = [None, None]

    def work(j: int) -> None:
        parts[j] = read_local(todo)

    threads = [threading.Thread(target=work, args=(j,)) for j in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert store.first_saw_others is True
    assert sum(t.n for part in parts for t in part) == n and all(t.route is route for part in parts for t in part)
    assert [int(o[0]) for o in outs] == list(range(n))


def test_calls_of_later_turns_and_a_cancelled_awaiter():
    turn = TurnBatch(threads=2)

    async def go():
        first = await turn.run(lambda: "a")
        waiting = asyncio.ensure_future(turn.run(lambda: "never seen"))
        waiting.cancel()
        second = await asyncio.gather(turn.run(lambda x: x + 1, 1), turn.run(lambda: None))
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return first, second

    assert _loop.run(go(), timeout=30) == ("a", [2, None])


def test_calls_fail_where_the_pool_refuses_their_jobs():
    """A pool shut down (at exit) runs no job: every call of the turn fails with the pool's error,
    none waits forever."""
    from concurrent.futures import ThreadPoolExecutor

    turn = TurnBatch(threads=2)

    async def go():
        pool = ThreadPoolExecutor(2)
        asyncio.get_running_loop().set_default_executor(pool)
        pool.shutdown()
        futs = [turn.run(lambda i=i: i) for i in range(5)]
        return await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 30)

    out = asyncio.run(go())
    assert len(out) == 5 and all(isinstance(e, RuntimeError) and "shutdown" in str(e) for e in out)
