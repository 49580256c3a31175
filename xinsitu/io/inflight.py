"""How many chunk requests may be in flight at once: the reader's slots (``take``/``give``) and
the policy that sizes them (``InflightLimit``: Little's law for local disks, a throughput-driven
slow start and additive increase for stores across a network)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

_NONE = object()
#: ``max_inflight=None``: bounds of the requests in flight (see ``InflightLimit``)
AUTO_INFLIGHT = (64, 256)
#: ... to this many times what keeps the decode threads busy while each request waits
AUTO_HEADROOM = 2.0
#: stores across a network: bounds of the throughput-driven limit (it starts at the bottom)
AUTO_REMOTE = (4, 256)
#: ... completions per window at least (a window is also at least half the limit)
AUTO_WINDOW = 4
#: ... a window's mean latency past this many times the quickest window's: the store queues
AUTO_INFLATED = 3.0
#: ... and within this many times it: no queueing (grow the limit)
AUTO_HEALTHY = 1.6
#: ... a window's completions per second past this many times the most seen before: more
#: requests bought throughput (grow the limit, whatever the latency; its limit becomes the best)
AUTO_BETTER = 1.15
#: ... that many windows in a row that bought no throughput and saw the latency rise: the
#: requests past the limit that gave the most only queue (go back to it)
AUTO_STRIKES = 2
#: ... seconds between probes past the limit at which the store last queued (each probe of an
#: overloaded store can cost a SYN retransmit, ~1 s); after a connect stall, twice the last wait,
#: up to ``AUTO_PROBE_MAX_S``
AUTO_PROBE_S = 5.0
AUTO_PROBE_MAX_S = 160.0
#: ... a request left behind (later ones came back first) waiting past this many times the quickest
#: window's mean latency, and ``AUTO_STALL_S``, is a connect stall (a dropped connection waiting for the
#: client's SYN retransmit, a second): the store is overloaded
AUTO_STALL = 8.0
AUTO_STALL_S = 0.5


class Slots:
    """Permits for the requests in flight, ``n`` of them, resizable: where ``resize`` shrinks them while
    more are held, the difference is kept back as held ones are given back (owed); where it grows them
    ``paced``, the new ones come one with each slot given back (a request answered lets two go out,
    as TCP's slow start sends: no burst of new requests at once). Each slot is held under a key (any
    hashable) from ``take`` to ``give``, with when it was taken (``sent``) and, until its bytes came
    (``arrived``), when its request went out (``waiting``). ``give`` gives a slot back once: a key
    given back already, or never taken, is left alone."""

    def __init__(self, n: int, clock: Callable[[], float]):
        self.n, self.clock = n, clock
        self.waiting: dict[Any, float] = {}  # slot -> when its request went out, until its bytes came
        self.sent: dict[Any, float] = {}  # slot -> when it was taken, until it is given back
        self._sem: asyncio.Semaphore | None = None
        self._count = n  # the semaphore's free permits, counted here (asyncio.Semaphore has no public count)
        self._owed = 0  # permits to keep back as slots are given back (shrunk)
        self._paced = 0  # permits to add, one per slot given back (grown, paced)
        self.filled = False  # every slot was taken at once (since ``filled`` was last set False)

    def semaphore(self) -> asyncio.Semaphore:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.n)
        return self._sem

    async def take(self, slot: Any) -> None:
        sem = self.semaphore()
        await sem.acquire()
        self._count -= 1
        self.waiting[slot] = self.sent[slot] = self.clock()
        if self._count <= self._owed and not self._paced:
            self.filled = True

    def arrived(self, slot: Any) -> None:
        self.waiting.pop(slot, None)

    def give(self, slot: Any) -> None:
        self.waiting.pop(slot, None)
        if self.sent.pop(slot, _NONE) is _NONE:
            return
        if self._owed:
            self._owed -= 1
            return
        self._release()
        if self._paced:
            self._paced -= 1
            self._release()
            if not self.sent:  # the last one back: nothing would give the rest out (as ``resize``: at once)
                for _ in range(self._paced):
                    self._release()
                self._paced = 0

    def held(self) -> int:
        return len(self.sent)

    def pacing(self) -> bool:
        """Whether slots of a paced growth are still to come."""
        return self._paced > 0

    def free(self) -> int:
        return self._count - self._owed

    def _release(self) -> None:
        self.semaphore().release()
        self._count += 1

    def resize(self, n: int, paced: bool = False) -> None:
        grow, self.n = n - self.n, n
        if self._sem is None:
            self._count = n
            return
        if grow < 0:
            taken = min(-grow, self._paced)  # not given out yet
            self._paced -= taken
            self._owed += -grow - taken  # taken back as slots are given back
            return
        paid = min(grow, self._owed)
        self._owed -= paid
        if paced and self.sent:  # (with none held, nothing would give them out: at once)
            self._paced += grow - paid
            return
        for _ in range(grow - paid):
            self._release()


class InflightLimit:
    """How many chunk requests may be in flight at once (``async with limit:`` around each).

    A number fixes it. ``None`` adapts it. Enough requests must be in flight to keep ``threads``
    decode threads busy while every request waits ``latency`` (Little's law: about
    ``threads x latency / decode time per chunk``; ``AUTO_HEADROOM`` times that, between the
    bounds of ``AUTO_INFLIGHT``): local disks sit at the bottom (more requests only slow the
    first batch).

    A store across a network (``expect_remote``) may be overloaded, where more requests only
    queue up, or far, where only many requests at once fill the decode threads; and the client's
    own cores (decoding, gathering -- on a small machine also the server's) inflate the latency
    it measures as they saturate, so latency alone takes a busy client for a store that queues.
    The limit follows what each window of completed requests (those sent since the limit last
    changed, at least ``AUTO_WINDOW``, at least half the limit) bought: it starts at
    ``AUTO_REMOTE[0]`` and, in slow start, doubles per window -- two round trips: one for the new
    requests to go out, one to see what they bought -- as long as the latency stays near the
    quickest window's (``AUTO_HEALTHY``) or the completions per second grew past ``AUTO_BETTER``
    times the most seen (more requests, more throughput, whatever the latency). Past that it
    grows by an eighth per window on the same test (additive increase). It grows only past a
    limit the reads used -- every slot taken at once in the window --, never past one they did not
    try (a reader asking a few chunks at a time). A window that bought no throughput and saw the
    latency rise, at a limit past the one that gave the most completions per second, goes back to
    that limit: a store that only queues gains nothing from more requests, so it stays at the
    bottom, and a busy client keeps what it gained. A request that fails or times out halves the
    limit, never below half that best limit nor below ``AUTO_REMOTE[0]``.

    Bursts are what an overloaded server cannot take: one whose accept queue is full drops new
    connections, which wait for the client's SYN retransmit (a second: hundreds of its answers;
    and a burst of retransmits meets a full queue again). So the limit grows paced (``Slots``:
    each answer lets two requests go out, none at once), and a window does not end while a request
    is left behind: sent before one the window counted, and not back (a store answers in about
    the order it is asked; a dropped connection is passed by every request after it). One left
    behind ``AUTO_STALL`` times the quickest window's mean latency and ``AUTO_STALL_S`` (or coming
    back that late) is a connect stall: the store is overloaded. As TCP after a timeout, the limit
    goes back to the bottom (the requests turned away come back to an emptied queue) and slow
    start runs to a quarter of the limit that stalled (the stall shows a second late: the limit
    may have doubled since the first request was turned away). That is a ceiling: the limit goes
    one step past it per ``AUTO_PROBE_S`` (twice as long after each stall, ``AUTO_PROBE_MAX_S`` at
    most), and a step that comes back whole raises it. Going back to the best limit sets the
    ceiling there; a failure, just below the limit that failed.

    None of it asks the client's cores to be idle: a busy client slows every answer alike, a
    stall is one answer left far behind its peers. So it is never much slower than a fixed small
    limit on a store that queues or drops connections, reaches the top for a far, healthy one,
    and sits near the knee of the throughput curve where the client's cores are the bound.
    Little's law bounds it from above.
    """

    def __init__(self, fixed: int | None, threads: int):
        self.fixed = fixed
        self.limit = fixed if fixed is not None else AUTO_INFLIGHT[0]
        self.threads = threads
        self.latency_s: float | None = None
        self.decode_s: float | None = None
        self.remote = False  # the limit follows a far store's throughput (``expect_remote``, auto only)
        self.far = False  # the store is across a network (whatever the limit)
        self.history: list[tuple[int, float]] = []  # (limit, mean latency) at each window's end (remote)
        self.clock: Callable[[], float] = time.perf_counter  # (a test drives it with simulated time)
        self._base: float | None = None  # quickest window's mean latency (remote)
        self._slow_start = True
        self._best_rate = 0.0  # most completions per second of a window so far (remote)
        self._best_limit = AUTO_REMOTE[0]  # ... and the limit it had
        self._strikes = 0  # windows in a row that bought nothing and saw the latency rise
        self._ceiling = 0  # the limit may grow past it only by probes (0: no ceiling): where the store
        self._probed = 0.0  # last queued, stalled or failed ... when growth last went past it
        self._probe_wait = AUTO_PROBE_S  # seconds between such probes (doubled by each stall)
        self.stalls = 0  # connect stalls seen (``_stalled``)
        self._stall_seen = -math.inf  # when the last one was: requests sent before it were seen then
        self._since = 0.0  # when the limit last changed: requests sent before do not count
        self._settled: float | None = 0.0  # ... nor those sent before its first answer came
        self._n = 0  # answers in this window (to requests sent since the limit last changed)
        self._sum = 0.0  # their latencies
        self._hi = 0.0  # ... the slowest
        self._passed = -math.inf  # ... when the last of them was sent
        self.slots = Slots(self.limit, lambda: self.clock())  # the permits this policy sizes

    def semaphore(self) -> asyncio.Semaphore:
        return self.slots.semaphore()

    async def __aenter__(self) -> None:
        await self.take(asyncio.current_task())

    async def __aexit__(self, *exc: Any) -> None:
        self.give(asyncio.current_task())

    async def take(self, slot: Any) -> None:
        """Wait for a free slot, held under ``slot`` (any hashable: a task, a request's number) until
        ``give(slot)``; ``async with limit:`` holds one under the current task."""
        await self.slots.take(slot)

    def arrived(self, slot: Any = None) -> None:
        """The request of ``slot`` (default: the current task's) has its bytes (what it waits for next
        is not the store)."""
        self.slots.arrived(asyncio.current_task() if slot is None else slot)

    def give(self, slot: Any) -> None:
        """Give back the slot held under ``slot``; a slot given back already (or never taken) is left
        alone, so that every way a request ends may give its slot and it still comes back once."""
        self.slots.give(slot)

    def held(self) -> int:
        """Slots taken and not given back yet."""
        return self.slots.held()

    def free(self) -> int:
        """Slots that ``take`` would get now without waiting (the limit less those held)."""
        return self.slots.free()

    def expect_remote(self) -> None:
        """The store is across a network: its limit follows throughput and latency (see the class)."""
        self.far = True
        if self.fixed is None and not self.remote:
            self.remote = True
            self._resize(AUTO_REMOTE[0])

    def _cap(self) -> int:
        """Little's law: requests that keep the decode threads busy, within ``AUTO_INFLIGHT``."""
        if self.latency_s is None or self.decode_s is None:
            return AUTO_INFLIGHT[1]
        want = AUTO_HEADROOM * self.threads * self.latency_s / max(self.decode_s, 1e-6)
        return max(AUTO_INFLIGHT[0], min(AUTO_INFLIGHT[1], math.ceil(want)))

    def _sent_at(self, latency_s: float, decode_s: float, now: float, slot: Any) -> float:
        """When the request of ``slot`` (None: the current task's) went out (unknown: ``now`` less its
        latency and decode)."""
        if slot is None:
            try:
                slot = asyncio.current_task()
            except RuntimeError:  # no running loop
                slot = None
        sent = self.slots.sent.get(slot) if slot is not None else None
        return now - latency_s - decode_s if sent is None else sent

    def observe(self, latency_s: float, decode_s: float, slot: Any = None) -> None:
        """One request's wait for its bytes and its decode time (on the I/O loop); ``slot`` as in ``take``
        (default: the current task's)."""
        if self.fixed is not None:
            return
        self.latency_s = latency_s if self.latency_s is None else 0.9 * self.latency_s + 0.1 * latency_s
        self.decode_s = decode_s if self.decode_s is None else 0.9 * self.decode_s + 0.1 * decode_s
        if not self.remote:
            target = self._cap()
            if target > self.limit or target < 0.75 * self.limit:  # shrink only on a clear change
                self._resize(target)
            return
        now = self.clock()
        sent = self._sent_at(latency_s, decode_s, now, slot)
        if sent < self._since:  # sent under the limit before: its latency is not this limit's
            return
        self._hi = max(self._hi, latency_s)
        if self._settled is None:  # the first answer with every slot of this limit out: the queues
            if self.slots.pacing():  # it meets are this limit's from now on (those before still ramp up)
                return
            self._settled = now
        if sent < self._settled:
            return
        self._n += 1
        self._sum += latency_s
        self._passed = max(self._passed, sent)
        if self._n < max(AUTO_WINDOW, self.limit // 2):
            return
        # the window ends once no request is left behind -- sent before one the window counted, and
        # not back: one a dropped connection delays comes back a second late, after quicker ones have
        # filled the window (``waiting`` is in the order the requests went out)
        waiting = self.slots.waiting
        typical = self._sum / self._n if self._base is None else self._base  # (not this window's: its late ones)
        stall_s = max(AUTO_STALL_S, AUTO_STALL * typical)
        oldest = next(iter(waiting.values()), None)
        if oldest is not None and oldest < self._passed:
            if oldest >= self._stall_seen and now - oldest >= stall_s:  # (those before the last stall:
                self._stalled(now)  # seen then)
            return
        if self._hi >= stall_s:  # one came back that late (no answer came while it waited)
            self._stalled(now)
            return
        # a window's requests that are still waiting count too: the ones a store queues come back
        # last, after quicker ones have filled the window
        oldest = now - oldest if oldest is not None else 0.0
        mean = max(self._sum / self._n, oldest)
        self._window(now, mean)

    def _window(self, now: float, mean: float) -> None:
        """A window's end: grow, hold, or go back (see the class)."""
        self._n, self._sum, self._hi, self._passed = 0, 0.0, 0.0, -math.inf
        self.history.append((self.limit, mean))
        base = self._base = mean if self._base is None else min(self._base, mean)
        # completions per second by Little's law (requests in flight / latency): counted answers
        # come in bursts as the loader asks for whole buffers; a store that only queues answers
        # twice the requests twice as late
        rate = self.limit / mean
        gained = rate > AUTO_BETTER * self._best_rate  # more requests bought more throughput
        if gained:
            self._best_rate, self._best_limit = rate, self.limit
        healthy = mean <= AUTO_HEALTHY * base
        used, self.slots.filled = self.slots.filled, False
        if self._ceiling and self.limit > self._ceiling and (healthy or gained) and used:
            self._ceiling = self.limit  # a probe came back whole: the store takes this limit now
        if (healthy or gained) and not used:
            return  # the reads never asked for as many requests at once: this limit is untried
        if healthy or gained:
            self._strikes = 0
            if self._slow_start:
                grown = 2 * self.limit
            else:
                grown = self.limit + max(1, self.limit // 8)
            if self._ceiling and grown > self._ceiling:  # where the store queued before: probe rarely
                self._slow_start = False
                if now - self._probed < self._probe_wait:
                    grown = max(self.limit, self._ceiling)
                else:  # one step past it
                    self._probed = now
                    grown = max(self.limit, self._ceiling) + max(1, self._ceiling // 8)
            # the new requests go out as answers come (``Slots``: paced), not as a burst
            self._resize(max(AUTO_REMOTE[0], min(self._cap(), AUTO_REMOTE[1], grown)), paced=True)
            return
        # the latency rose and throughput did not: the knee is behind (once may be this machine
        # busy for a moment -- its cores, not the store -- so twice in a row)
        self._strikes += 1
        if self._strikes < AUTO_STRIKES:
            return
        self._slow_start = False
        if self.limit > self._best_limit:  # requests past the best limit only queue: back to it
            self._ceiling, self._probed = max(AUTO_REMOTE[0], self._best_limit), now
            self._resize(self._ceiling)
        elif self.limit < self._best_limit and mean <= AUTO_INFLATED * base:
            # below the best limit (after a failure) and no longer queueing: grow back, up to the
            # ceiling (where the store stalled or failed; past it only probes go)
            grown = self.limit + max(1, self.limit // 8)
            if self._ceiling:
                grown = min(grown, max(self.limit, self._ceiling))
            self._resize(grown)

    def _stalled(self, now: float) -> None:
        """A request was left behind a connect stall's time while later ones came back: the store is
        overloaded (a full accept queue drops new connections). Back to the bottom, slow start to a
        quarter of this limit, the ceiling there; probes past it wait twice as long as the last ones
        did. At the bottom already, only the window starts again."""
        self.stalls += 1
        self._stall_seen = now
        self._strikes = 0
        if self.limit <= AUTO_REMOTE[0]:  # at the bottom: the queue of a stall before, still draining
            self._restart()
            return
        if self._ceiling:  # stalled again: probe half as often
            self._probe_wait = min(AUTO_PROBE_MAX_S, 2 * self._probe_wait)
        # as TCP after a timeout: from the bottom, where the requests turned away come back to an
        # emptied queue, slow start to a quarter of the limit that stalled (seen a second late, the
        # limit may have doubled past the one that first overflowed), probes past it
        self._ceiling, self._probed = max(AUTO_REMOTE[0], self.limit // 4), now
        self._slow_start = True
        self._resize(AUTO_REMOTE[0])
        self._restart()  # (at the bottom already: the window starts again all the same)

    def failed(self) -> None:
        """A request failed or timed out: fewer in flight (a store under load fails first)."""
        if self.fixed is None and self.remote:
            self._decrease()

    def _decrease(self) -> None:
        # never far below the limit of the best window: a burst of failures halves it once or
        # twice, not down to the bottom
        self._slow_start = False
        self._ceiling, self._probed = max(AUTO_REMOTE[0], self.limit - 1), self.clock()
        self._resize(max(AUTO_REMOTE[0], self._best_limit // 2, self.limit // 2))

    def _resize(self, n: int, paced: bool = False) -> None:
        if n == self.limit:
            return
        self.limit = n
        self._restart()
        self.slots.resize(n, paced)

    def _restart(self) -> None:
        """A new window: it counts only requests sent once this limit's first answer came."""
        self.slots.filled = False
        self._since, self._settled = self.clock(), None
        self._n, self._sum, self._hi, self._passed = 0, 0.0, 0.0, -math.inf
