"""``reader.TurnBatch``: the decode-thread calls of one turn of the I/O loop go out as one job per
thread; each awaiter gets its own call's result or exception, whatever else failed."""

from __future__ import annotations

import asyncio
import threading

import pytest

from xinsitu.io import loop as _loop
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
    by_thread: dict[int, list[int]] = {}
    for i, t in seen:
        by_thread.setdefault(t, []).append(i)
    # two jobs, every other call each, each run in turn in one thread
    assert sorted(sorted(v) for v in by_thread.values()) in ([[0, 2, 4, 6], [1, 3, 5, 7]], [list(range(8))])


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
