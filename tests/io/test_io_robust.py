"""The read path under stores that misbehave (issue 16): an overloaded store is not made slower by
the automatic in-flight limit, a read that never answers times out and names its chunk, a body
corrupted in transit never becomes wrong values where the archive has checksums, a 200 answered
to a Range request is used, and obstore's runtime does not pile up threads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

import xinsitu
from tests.support.servers import Faults, FileServer, assert_same_epoch, epoch_numpy, write_archive

KW = {"batch_size": 10, "block_chunks": 3, "output": "numpy", "seed": 3}
CHUNKS = r"/(t2m|u10|v10|z500|tp|lsm)/c/"
# one shuffle buffer for the whole split: a failing chunk then ends the epoch here whatever the
# loader's read-ahead does with the blocks after it (that is issue 16 item 11, tested elsewhere)
ONE_BLOCK = KW | {"block_chunks": 24}


def watch_limit(monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple], list[tuple]]:
    """What the automatic limit decided, as it decided (its windows and its stalls), to hold it to its rule
    whatever this machine's load did to the latencies it saw: per window ``(limit before, whether the reads
    used every slot, the cap then (Little's law, ``AUTO_*``), slow start, ceiling, strikes after, limit
    after)``; per stall ``(limit before, limit after, ceiling after)``."""
    from xinsitu.io.inflight import AUTO_INFLIGHT, AUTO_REMOTE, InflightLimit

    windows: list[tuple] = []
    stalls: list[tuple] = []
    window, stalled = InflightLimit._window, InflightLimit._stalled

    def in_window(self, now, mean):
        cap = min(self._cap(), AUTO_REMOTE[1], AUTO_INFLIGHT[1])
        before = (self.limit, self.slots.filled, cap, self._slow_start, self._ceiling)
        window(self, now, mean)
        windows.append((*before, self._strikes, self.limit))

    def in_stall(self, now):
        before = self.limit
        stalled(self, now)
        stalls.append((before, self.limit, self._ceiling))

    monkeypatch.setattr(InflightLimit, "_window", in_window)
    monkeypatch.setattr(InflightLimit, "_stalled", in_stall)
    return windows, stalls


def assert_grew_by_rule(windows: list[tuple], top: int) -> None:
    """Each window the reads used, that did not count as a strike (a latency 1.6 times the quickest:
    the knee, or this machine busy), and with no ceiling set by a stall, grew the limit: doubled in slow
    start, else by an eighth -- up to ``top`` or the cap then (Little's law); a limit that never grows
    fails."""
    from xinsitu.io.inflight import AUTO_REMOTE

    for before, used, cap, slow, ceiling, strikes, after in windows:
        if used and strikes == 0 and not ceiling:
            grown = 2 * before if slow else before + max(1, before // 8)
            assert after == max(AUTO_REMOTE[0], min(cap, top, grown)), windows


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_archive(tmp_path_factory.mktemp("io") / "era5.zarr", nt=96, chunk_time=4)


@pytest.fixture(scope="module")
def manifest(archive: str) -> xinsitu.SplitManifest:
    return xinsitu.open_zarr(archive).insitu.split("time", fractions={"train": 1.0})


@pytest.fixture(scope="module")
def reference(archive: str, manifest: xinsitu.SplitManifest) -> tuple:
    gen = xinsitu.open_zarr(archive).insitu.batches(manifest, "train", **KW)
    return epoch_numpy(gen)


# ----------------------------------------------------------------------------- 5. in-flight limit
@pytest.mark.slow
def test_automatic_limit_backs_off_on_an_overloaded_store(archive, manifest, reference, monkeypatch):
    """A server that holds 6 requests at most and answers them one at a time (a plain ``http.server``:
    one in hand, 5 in its accept queue); a request past them waits a second, then two, as a dropped
    connection waits for the SYN retransmit. By rule, not by timing: whatever this machine's load,
    the automatic limit grows paced, notices each request turned away (left a second behind the
    ones after it) and backs off to the bottom, then grows past a quarter of the limit that stalled
    only by single probes of one step, every 5 s at most -- where one that never went back stays at its
    peak and turns away ~200 requests. How far slow start got before the first stall showed, and so
    where the ceiling sits, depends on this machine's load (idle: 11-48 turned away, peak 16; under a
    3-worker test run on 2 cores: 121, peak 32, and a probe to 9 under way as the test ended; once
    in CI: 1, turned away with the limit at the bottom, where a stall only starts the window again), so
    those are reported, not bounded: the test holds the rule, stall by stall. Every epoch is exact."""
    from xinsitu.io.inflight import AUTO_REMOTE

    windows, stalls = watch_limit(monkeypatch)
    reference_of = {0: reference}
    with FileServer(Path(archive).parent, capacity=6) as srv:
        gen = xinsitu.open_zarr(f"{srv.url}/era5.zarr").insitu.batches(manifest, "train", **KW)
        srv.reset_counts()
        for epoch in (0, 1, 2):
            gen.set_epoch(epoch)
            if epoch not in reference_of:
                local = xinsitu.open_zarr(archive).insitu.batches(manifest, "train", **KW)
                local.set_epoch(epoch)
                reference_of[epoch] = epoch_numpy(local)
            assert_same_epoch(epoch_numpy(gen), reference_of[epoch])
        lim = gen._reader.inflight
        assert lim.remote and lim.history, "the limit never adapted"
        assert not srv.turned_away or stalls, (srv.turned_away, lim.history)  # noticed
        seen = (lim.limit, srv.turned_away, lim.history, stalls, lim._ceiling)
        for before, after, ceiling in stalls:  # backed off: to the bottom, the ceiling a quarter up
            assert after == AUTO_REMOTE[0], seen
            if before > AUTO_REMOTE[0]:
                assert ceiling == max(AUTO_REMOTE[0], before // 4), seen
        # ... and past the ceiling (a quarter, or where a probe came back whole) by one step at most
        if lim._ceiling:
            assert lim.limit <= lim._ceiling + max(1, lim._ceiling // 8), seen
        assert_grew_by_rule(windows, AUTO_REMOTE[1])


@pytest.mark.slow
def test_automatic_limit_climbs_for_a_far_healthy_store(archive, manifest, monkeypatch):
    """100 ms away, latency that does not grow with load: the limit doubles to the top, where the reads
    ask for that many chunks at once (one buffer for the whole split: 144), in two short epochs. By rule:
    a window this machine's load made slow (a strike) or starved (the reads did not use it) holds the
    limit, as it should; where none did, it got to the top."""
    from xinsitu.io import inflight

    monkeypatch.setattr(inflight, "AUTO_REMOTE", (4, 64))
    windows, stalls = watch_limit(monkeypatch)
    local = xinsitu.open_zarr(archive).insitu.batches(manifest, "train", **ONE_BLOCK)
    with FileServer(Path(archive).parent, Faults(latency=0.1)) as srv:
        gen = xinsitu.open_zarr(f"{srv.url}/era5.zarr").insitu.batches(manifest, "train", **ONE_BLOCK)
        for epoch in (0, 1):
            gen.set_epoch(epoch)
            local.set_epoch(epoch)
            assert_same_epoch(epoch_numpy(gen), epoch_numpy(local))
        lim = gen._reader.inflight
        trajectory = [n for n, _ in lim.history] + [lim.limit]
        assert trajectory[0] == 4, lim.history
        assert_grew_by_rule(windows, 64)  # (the first window, the quickest so far, is never a strike)
        assert any(used and strikes == 0 for _, used, _, _, _, strikes, _ in windows), windows
        if not stalls and all(used and strikes == 0 for _, used, _, _, _, strikes, _ in windows):
            assert max(trajectory) == 64, windows


def _simulate(lim, latency, answers: int, decode_s: float = 0.0005, at: list[float] | None = None) -> list[int]:
    """A closed loop in simulated time: a request sent whenever the limit has a free slot (``lim.take``:
    growth is paced, as in a read), one sent while ``k`` are in flight (itself included) answered
    ``latency(k)`` seconds later, ``observe`` called as each is decoded, its slot given back. The
    limit after each answer (and in ``at``, when it came)."""
    import asyncio
    import heapq
    import itertools

    now = lim.clock.now  # a _remote limit runs on simulated time
    flight: list[tuple[float, int]] = []  # (answered, request)
    ids = itertools.count()
    seen = []
    loop = asyncio.new_event_loop()
    try:
        for _ in range(answers):
            while lim.free() > 0:
                rid = next(ids)
                loop.run_until_complete(lim.take(rid))  # (a free slot: taken at once)
                heapq.heappush(flight, (now[0] + latency(len(flight) + 1), rid))
            done, rid = heapq.heappop(flight)
            sent = lim.slots.sent[rid]
            lim.arrived(rid)
            now[0] = done + decode_s
            lim.observe(done - sent, decode_s, rid)
            lim.give(rid)
            seen.append(lim.limit)
            if at is not None:
                at.append(now[0])
    finally:
        loop.close()
    return seen


class _Clock:
    def __init__(self) -> None:
        self.now = [0.0]

    def __call__(self) -> float:
        return self.now[0]


def _remote(fixed: int | None = None):
    """An in-flight limit for a remote store, on simulated time."""
    from xinsitu.io.inflight import InflightLimit

    lim = InflightLimit(fixed, threads=2)
    lim.clock = _Clock()
    lim.expect_remote()
    return lim


def _jitter(latency, amount: float = 0.15, seed: int = 0):
    """``latency`` times a random factor within 1 +- ``amount`` (a busy machine's noise)."""
    import random

    rng = random.Random(seed)
    return lambda k: latency(k) * (1 + amount * (2 * rng.random() - 1))


def test_inflight_limit_is_aimd_for_remote_stores():
    """Synthetic stores: a queueing one (latency grows with the limit) keeps it low; a far one with
    flat latency sends it to the top; a failure halves it; a fixed limit never moves."""
    from xinsitu.io.inflight import AUTO_REMOTE

    seen = _simulate(queue := _remote(), lambda k: 0.002 * k, 2000)  # one at a time: latency is queueing
    assert max(seen) <= 16 and seen[-1] <= 8, (max(seen), seen[-1], queue.history[:8])
    seen = _simulate(far := _remote(), lambda k: 0.1, 2000)
    assert seen[-1] == AUTO_REMOTE[1]
    far.failed()
    assert far.limit == AUTO_REMOTE[1] // 2
    fixed = _remote(4)
    fixed.failed()
    assert _simulate(fixed, lambda k: 1.0, 50)[-1] == 4


@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_inflight_limit_follows_throughput_not_latency_alone(seed):
    """The client's own cores saturating (a small machine decoding, gathering, perhaps serving too):
    the latency rises with the requests in flight -- past 3x the quickest at 64 -- but the
    completions per second keep growing, then flatten (Little's law: ``k / (30 ms + k / 700)``,
    75 % of the plateau at 64, 86 % at 128). The limit ends at the knee, not at the top and not
    where the latency first rose (latency alone holds it at 32). A store that only queues
    (latency proportional to the requests, completions per second flat) still backs off, with the
    same noise."""
    from xinsitu.io.inflight import AUTO_REMOTE

    def noisy(f):
        return f if seed is None else _jitter(f, seed=seed)

    cpu = _remote()
    seen = _simulate(cpu, noisy(lambda k: 0.03 + k / 700), 3000)
    assert 64 <= seen[-1] <= 128 and min(seen[len(seen) // 2:]) >= 48, (seen[-1], cpu.history[:12])
    assert seen[-1] < AUTO_REMOTE[1]
    queue = _remote()
    seen = _simulate(queue, noisy(lambda k: 0.002 * k), 3000)
    assert max(seen) <= 16 and seen[-1] <= 8, (max(seen), seen[-1], queue.history[:12])


def test_inflight_limit_reaches_a_far_store_within_a_few_round_trips():
    """A far, healthy store (100 ms, answers equally quick): slow start doubles the limit every two
    round trips -- one to send the new requests as answers come (paced: no burst an overloaded
    server would drop), one to see what they bought -- so the top is reached in 12 round trips
    (1.2 s), with no step down on the way."""
    from xinsitu.io.inflight import AUTO_REMOTE

    far = _remote()
    at: list[float] = []
    seen = _simulate(far, lambda k: 0.1, 600, at=at)
    top = seen.index(AUTO_REMOTE[1])
    assert seen[-1] == AUTO_REMOTE[1] and at[top] <= 12 * 0.1 + 0.05, (at[top], far.history)
    assert seen[:top + 1] == sorted(seen[:top + 1]), far.history


def _overloaded_epoch(lim, n: int = 600, *, client_s: float, spikes: float, seed: int, service_s: float = 0.0005,
                     backlog: int = 5, decode_s: float = 0.0003) -> tuple[float, int]:
    """``n`` requests through ``lim`` in simulated time to a plain ``http.server``: one request at a
    time (``service_s`` each), an accept queue of ``backlog`` connections, one connection per request;
    a connection past a full queue is dropped and comes back with the client's SYN retransmit (after
    1 s, then 2 s, 4 s...). The client adds to each answer a delay of its own (``client_s`` on average,
    and 50 ms more for a share ``spikes`` of them: a busy machine, whose cores -- not the store --
    slow some answers). (seconds the epoch took, connections the server dropped)."""
    import asyncio
    import heapq
    import itertools
    import random

    rng = random.Random(seed)
    now = lim.clock.now
    events: list[tuple[float, int, str, int, int]] = []  # (when, order, what, request, tries)
    order = itertools.count()
    queue: list[int] = []  # accepted, not answered yet (the one served first)
    busy, dropped, sent, done = False, 0, 0, 0

    def at(t: float, what: str, rid: int, tries: int = 0) -> None:
        heapq.heappush(events, (t, next(order), what, rid, tries))

    loop = asyncio.new_event_loop()
    try:
        while done < n:
            while lim.free() > 0 and sent < n:
                loop.run_until_complete(lim.take(sent))
                at(now[0] + 0.0001, "connect", sent)
                sent += 1
            t, _, what, rid, tries = heapq.heappop(events)
            now[0] = t
            if what == "connect":
                if len(queue) <= backlog:
                    queue.append(rid)
                else:
                    dropped += 1
                    at(t + 2.0 ** min(tries, 4), "connect", rid, tries + 1)
            elif what == "served":
                queue.remove(rid)
                busy = False
                late = rng.expovariate(1 / client_s) + (0.05 if rng.random() < spikes else 0.0)
                at(t + 0.0001 + late, "answer", rid)
            else:  # the answer, decoded: observed, its slot given back
                sent_at = lim.slots.sent[rid]
                lim.arrived(rid)
                now[0] = t + decode_s
                lim.observe(t - sent_at, decode_s, rid)
                lim.give(rid)
                done += 1
            if not busy and queue:
                busy = True
                at(now[0] + service_s * rng.uniform(0.7, 1.3), "served", queue[0])
    finally:
        loop.close()
    return now[0], dropped


def test_a_connect_stall_sends_the_limit_to_the_bottom_then_slow_start_to_a_quarter():
    """By rule, in simulated time: a far store's limit climbs; one request is then left a connect stall's
    time behind the others (a dropped connection waiting for the SYN retransmit). The limit goes back to
    the bottom, then climbs again to a quarter of where it stalled, and no higher (no probe is due yet)."""
    import itertools

    from xinsitu.io.inflight import AUTO_REMOTE

    lim = _remote()
    sends = itertools.count()
    seen = _simulate(lim, lambda k: 1.5 if next(sends) == 200 else 0.05, answers=1500)
    assert lim.stalls == 1
    peak = max(seen)
    assert peak >= 16 * AUTO_REMOTE[0], seen
    after = seen[seen.index(peak):]
    bottom = after.index(AUTO_REMOTE[0])  # back to the bottom ...
    assert max(after[bottom:]) == peak // 4, after  # ... then up to a quarter of the peak


def test_growing_back_after_a_stall_stops_at_its_ceiling():
    """By rule, in simulated time: a far store's limit climbs (the most completions per second at its
    peak), a connect stall sends it to the bottom, and slow start to a quarter of the peak. Then this
    client gets busy (every answer twice as slow: not queueing, no throughput gained), which grows a
    limit below its best back by an eighth a window -- but never past the ceiling the stall set: past
    it only probes go, one step at a time (the CI run on a busy machine that ended at 9 with a ceiling
    of 8 was a probe)."""
    import itertools

    from xinsitu.io.inflight import AUTO_REMOTE

    lim = _remote()
    sends = itertools.count()

    def latency(k: int) -> float:
        i = next(sends)
        return 1.5 if i == 200 else 0.05 if i < 400 else 0.1

    seen = _simulate(lim, latency, answers=3000)
    assert lim.stalls == 1
    peak = max(seen)
    assert peak >= 16 * AUTO_REMOTE[0], seen
    after = seen[seen.index(peak):]
    after = after[after.index(AUTO_REMOTE[0]):]  # back to the bottom
    ceiling = peak // 4
    assert ceiling in after and max(after) <= ceiling + max(1, ceiling // 8), (ceiling, lim.history)


@pytest.mark.parametrize(("client_s", "spikes"), [(0.0005, 0.0), (0.002, 0.01), (0.005, 0.05), (0.02, 0.05)],
                         ids=["idle", "busy", "busier", "saturated"])
def test_automatic_limit_is_never_slower_than_a_fixed_small_one_on_an_overloaded_store(client_s, spikes):
    """SPEC 5: the automatic limit never makes an overloaded store slower than a fixed small limit
    would. A plain ``http.server`` (accept queue of 5: a burst past it waits a second for the SYN
    retransmit, and the retransmits, a burst again, may meet a full queue) and a client from idle to
    saturated: in simulated time, so that no run depends on how busy this machine is. The automatic
    limit takes no longer than the slower of 4 and 8 in flight (a tenth of a second at most), and at
    most one retransmit (1 s) longer than 4 in flight: a limit that grows meets the queue's end
    once, where 8 in flight meet it at once. It took 80-290 s where 8 in flight took 1-2 s: it grew
    8x per window while the answers came back quick, past the queue, before the dropped
    connections showed."""
    for seed in range(3):
        (t4, _), (t8, _), (auto, dropped) = (_overloaded_epoch(_remote(fixed), client_s=client_s, spikes=spikes,
                                                               seed=seed) for fixed in (4, 8, None))
        assert auto <= max(t4, t8) + 0.1 and auto <= t4 + 1.05, (seed, auto, t4, t8, dropped)


# ----------------------------------------------------------------------------- 6. nothing waits forever
def _epoch_in_thread(gen, limit_s: float) -> tuple[bool, BaseException | None]:
    """(finished within ``limit_s``, the error it raised): a hang fails the test instead of hanging it."""
    import threading

    box: list[BaseException | None] = [None]

    def go() -> None:
        try:
            for _ in gen:
                pass
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box[0] = e

    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(limit_s)
    return not th.is_alive(), box[0]


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.slow
def test_read_that_never_answers_times_out_naming_the_chunk(archive, manifest, tmp_path, monkeypatch, sharded):
    """A server that accepts chunk requests and never answers: with the default store options (obstore
    would wait 30 s per try, 10 tries), the request timeout gives up on each try, retries, then
    raises ``ChunkReadError`` naming the variable, the chunk and the key."""
    monkeypatch.setenv("XINSITU_REQUEST_TIMEOUT", "0.5")
    root = Path(archive).parent
    name = "era5.zarr"
    if sharded:
        name = "hang_sharded.zarr"
        if not (root / name).exists():
            write_archive(root / name, nt=96, chunk_time=4, shard_time=16)
    with FileServer(root, Faults(hang=1.0, pattern=CHUNKS, max_per_key=None)) as srv:
        gen = xinsitu.open_zarr(f"{srv.url}/{name}").insitu.batches(manifest, "train", **ONE_BLOCK)
        finished, err = _epoch_in_thread(gen, 60)
        assert finished, "the epoch hangs on a read that never answers"
        assert isinstance(err, xinsitu.ChunkReadError), repr(err)
        assert err.var in ("t2m", "u10", "v10", "z500") and err.key in str(err) and "/c/" in err.key
        assert "no answer within 0.5 s" in str(err), str(err)
        with pytest.raises(xinsitu.ChunkReadError, match="no answer"):
            gen.sample(0)


def test_a_chunk_obstore_gave_up_on_is_named_as_a_timeout(archive, manifest, monkeypatch):
    """A chunk whose request obstore's own client gave up on (its read timeout, after its retries:
    here 0.3 s and 1 s, under a request bound of 30 s) raises ``ChunkReadError`` from a
    ``TimeoutError`` that says so, not from a generic ``OSError``."""
    from datetime import timedelta

    monkeypatch.setenv("XINSITU_REQUEST_TIMEOUT", "30")
    with FileServer(Path(archive).parent, Faults(hang=1.0, pattern=CHUNKS, max_per_key=None)) as srv:
        ds = xinsitu.open_zarr(f"{srv.url}/era5.zarr", client_options={"read_timeout": "300ms"},
                               retry_config={"max_retries": 2, "retry_timeout": timedelta(seconds=1)})
        finished, err = _epoch_in_thread(ds.insitu.batches(manifest, "train", **ONE_BLOCK), 60)
    assert finished, "the epoch hangs"
    assert isinstance(err, xinsitu.ChunkReadError) and "/c/" in err.key, repr(err)
    assert "TimeoutError" in str(err) and "timed out" in str(err), str(err)


class _FakeLoop:
    """What ``Deadlines`` asks of a loop, on a clock the test sets (``now``); ``call_at`` only records."""

    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback) -> _Request:
        return _Request()  # a timer never run: the test sweeps by hand


class _Request:
    """A request's future as ``Deadlines`` sees it: cancelled by ``cancel``."""

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_a_request_waits_longer_while_its_store_answers_others(monkeypatch):
    """The request timeout gives up a request whose store answers nothing; one whose store answers
    other requests meanwhile (a slow link busy with large chunks) waits on, ``limit`` past the last
    answer, ``REQUEST_PATIENCE`` times its limit at most. Another store's answers do not count.
    (Simulated time: ``Deadlines`` on a loop whose clock the test sets.)"""
    from xinsitu.io import loop as _loop
    from xinsitu.stores.backend import Deadlines

    monkeypatch.setattr(_loop, "REQUEST_PATIENCE", 4.0)
    loop = _FakeLoop()
    d = Deadlines(loop)  # type: ignore[arg-type]
    busy, silent, other = object(), object(), object()
    waits = {name: _Request() for name in ("busy", "silent", "none")}
    w_busy = d.watch(waits["busy"], 10.0, busy)
    d.watch(waits["silent"], 10.0, silent)
    d.watch(waits["none"], 10.0)
    for t in range(1, 60):  # the busy store answers a request every second; the silent one none
        loop.now = float(t)
        d.unwatch(d.watch(_Request(), 10.0, busy))
        if t == 3:
            d.unwatch(d.watch(_Request(), 10.0, other))
        d._sweep()
        if t < 10:
            assert not any(r.cancelled for r in waits.values()), t
        elif t < 40:
            assert waits["silent"].cancelled and waits["none"].cancelled and not waits["busy"].cancelled, t
        else:  # 4 x 10 s at most, whatever
            assert waits["busy"].cancelled and w_busy.fired, t
    stopped = _Request()
    d.watch(stopped, 10.0, busy)
    loop.now = 71.0  # the busy store's last answer came at 59 s: nothing for 10 s
    d._sweep()
    assert stopped.cancelled


def test_loop_run_has_a_timeout():
    import asyncio

    from xinsitu.io import loop as _loop

    with pytest.raises(TimeoutError, match="no result within 0.2 s"):
        _loop.run(asyncio.sleep(30), timeout=0.2)
    assert _loop.run(asyncio.sleep(0, result=7), timeout=5) == 7

    async def own():
        raise TimeoutError("the coroutine's own")

    with pytest.raises(TimeoutError, match="the coroutine's own"):  # not taken for the wait's
        _loop.run(own(), timeout=5)


# ----------------------------------------------------------------------------- 12. bit flips
@pytest.fixture(scope="module")
def crc_archive(archive: str) -> str:
    """The archive rewritten with a crc32c checksum after zstd (and one without any checksum)."""
    src = xinsitu.open_zarr(archive)
    out = str(Path(archive).parent / "crc.zarr")
    enc = {v: {"compressors": [zarr.codecs.ZstdCodec(), zarr.codecs.Crc32cCodec()],
               "chunks": src[v].encoding["chunks"]} for v in src.data_vars}
    src.to_zarr(out, mode="w", encoding=enc, zarr_format=3, consolidated=True)
    return out


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.slow
def test_bit_flips_never_become_wrong_values_with_crc32c(crc_archive, manifest, tmp_path, sharded):
    """A body with a flipped bit: with crc32c in the codec chain the checksum catches it and the chunk
    is fetched again -- the epoch equals the local one; one that flips every time raises."""
    name = Path(crc_archive).name
    if sharded:  # the shard index has its own crc32c (zarr's default index codecs)
        src = xinsitu.open_zarr(crc_archive)
        enc = {v: {"compressors": [zarr.codecs.ZstdCodec(), zarr.codecs.Crc32cCodec()],
                   "chunks": src[v].encoding["chunks"], "shards": (16,) + src[v].shape[1:]}
               for v in src.data_vars}
        name = "crc_sharded.zarr"
        src.to_zarr(Path(crc_archive).parent / name, mode="w", encoding=enc, zarr_format=3, consolidated=True)
    ref = epoch_numpy(xinsitu.open_zarr(crc_archive).insitu.batches(manifest, "train", **KW))
    with FileServer(Path(crc_archive).parent, Faults(flip=0.5, pattern=CHUNKS, max_per_key=2, seed=4)) as srv:
        gen = xinsitu.open_zarr(f"{srv.url}/{name}").insitu.batches(manifest, "train", **KW)
        got = epoch_numpy(gen)
        assert srv.counts["flip"] > 5, srv.counts
        assert_same_epoch(got, ref)
        srv.faults = Faults(flip=1.0, pattern=r"/t2m/c/", max_per_key=None)
        gen = xinsitu.open_zarr(f"{srv.url}/{name}").insitu.batches(manifest, "train", **ONE_BLOCK)
        finished, err = _epoch_in_thread(gen, 60)
        assert finished and isinstance(err, xinsitu.ChunkReadError), repr(err)
        assert err.var == "t2m" and "failed to decode 3 times" in str(err)


# ----------------------------------------------------------------------------- 16. smaller
@pytest.mark.slow
def test_client_options_from_the_environment_are_respected(archive, manifest, reference, tmp_path, monkeypatch):
    """``AWS_ALLOW_HTTP=true`` (and the endpoint, credentials) from the environment: xinsitu's own
    client defaults no longer replace it (obstore failed with ``builder error``)."""
    import shutil

    shutil.copytree(archive, tmp_path / "bucket" / "era5.zarr")
    with FileServer(tmp_path) as srv:  # answers S3's path-style GETs
        for k, v in {"AWS_ALLOW_HTTP": "true", "AWS_ENDPOINT": srv.url, "AWS_ACCESS_KEY_ID": "AKIAXINSITUENV0",
                     "AWS_SECRET_ACCESS_KEY": "env-secret-0000", "AWS_REGION": "us-east-1"}.items():
            monkeypatch.setenv(k, v)
        for opts in ({}, {"client_options": {"timeout": "100s"}}):
            gen = xinsitu.open_zarr("s3://bucket/era5.zarr", **opts).insitu.batches(manifest, "train", **KW)
            assert_same_epoch(epoch_numpy(gen), reference)
        with pytest.raises(Exception, match="builder error|HTTP"):  # yours still win over the environment's
            xinsitu.open_zarr("s3://bucket/era5.zarr", client_options={"allow_http": False})


def test_range_request_answered_with_the_whole_object(archive, manifest):
    """A server (or proxy) that ignores ``Range`` and answers 200 with the whole object: the range is
    cut from it, for shard indexes, inner chunks and resumed transfers alike."""
    root = Path(archive).parent
    if not (root / "full_sharded.zarr").exists():
        write_archive(root / "full_sharded.zarr", nt=96, chunk_time=4, shard_time=16)
    reference = epoch_numpy(xinsitu.open_zarr(archive).insitu.batches(manifest, "train", **ONE_BLOCK))
    with FileServer(root, Faults(full=0.5, pattern=CHUNKS, max_per_key=None, seed=5)) as srv:
        gen = xinsitu.open_zarr(f"{srv.url}/full_sharded.zarr").insitu.batches(manifest, "train", **ONE_BLOCK)
        assert_same_epoch(epoch_numpy(gen), reference)
        assert srv.counts["full"] > 3, srv.counts


# ----------------------------------------------------------------------------- 10. errors that point the right way
def test_open_errors_say_what_is_wrong(tmp_path):
    """A v2 group without ``_ARRAY_DIMENSIONS`` and an array path where a group is expected each get
    a message that names the problem and the fix (a non-consolidated archive over a plain HTTP
    server that lists nothing: ``tests/stores/test_remote.py``)."""
    import xarray as xr

    g = zarr.open_group(tmp_path / "v2.zarr", mode="w", zarr_format=2)
    g.create_array("a", shape=(4,), dtype="f4")
    with pytest.raises(ValueError, match=r"\['a'\] have no '_ARRAY_DIMENSIONS'"):
        xinsitu.open_zarr(str(tmp_path / "v2.zarr"))
    g = zarr.open_group(tmp_path / "v3.zarr", mode="w", zarr_format=3)  # (was xarray's KeyError, naming neither)
    g.create_array("a", shape=(4,), dtype="f4")
    g.create_array("b", shape=(4,), dtype="f4", dimension_names=["t"])
    g.create_array("s", shape=(), dtype="f4")  # a scalar needs no dim names
    with pytest.raises(ValueError, match=r"v3.zarr: zarr v3 arrays \['a'\] have no 'dimension_names'"):
        xinsitu.open_zarr(str(tmp_path / "v3.zarr"))
    xr.Dataset({"a": (("t",), np.arange(4.0))}).to_zarr(tmp_path / "noc.zarr", zarr_format=3, consolidated=False)
    with pytest.raises(ValueError, match=r"is a zarr array .* not a group.*\['a'\]"):
        xinsitu.open_zarr(str(tmp_path / "noc.zarr" / "a"))
    with pytest.raises(ValueError, match=r"group='a'\) is a zarr array"):
        xinsitu.open_zarr(str(tmp_path / "noc.zarr"), group="a")


def test_damaged_metadata_is_fetched_again_then_named(archive):
    """A ``zarr.json`` body damaged in transit is fetched again (the open succeeds); one damaged every
    time raises naming the key, not a bare ``JSONDecodeError``."""
    import pickle

    # half the body (never valid JSON): a flipped bit can leave valid JSON with another value, which
    # no reader can tell from the real one without a checksum (where the bit falls depends on the path)
    with FileServer(Path(archive).parent, Faults(short=1.0, pattern=r"zarr\.json$", max_per_key=2)) as srv:
        ds = xinsitu.open_zarr(f"{srv.url}/era5.zarr")
        assert srv.counts["short"] == 2, srv.counts
        local = xinsitu.open_zarr(archive)
        assert list(ds.data_vars) == list(local.data_vars)
        assert np.array_equal(pickle.loads(pickle.dumps(ds)).t2m[:4].values, local.t2m[:4].values)
        srv.faults = Faults(short=1.0, pattern=r"/era5\.zarr/zarr\.json$", max_per_key=None)
        with pytest.raises(ValueError, match=r"metadata object 'zarr.json' is not valid JSON, 3 fetches"):
            xinsitu.open_zarr(f"{srv.url}/era5.zarr")


@pytest.mark.slow
def test_abandoned_epochs_stop_reading_and_threads_stay_bounded(tmp_path):
    """An epoch abandoned after one batch stops its reads (they used to run on, holding connections
    and threads of obstore's runtime); after several, obstore's threads stay within the process-wide
    bound on requests in flight."""
    import gc
    import os
    import time

    from xinsitu.stores.backend import PROCESS_INFLIGHT

    def runtime_threads() -> int:
        n = 0
        for t in os.listdir("/proc/self/task"):
            try:
                n += "tokio" in Path(f"/proc/self/task/{t}/comm").read_text()
            except OSError:  # the thread ended meanwhile
                pass
        return n

    path = write_archive(tmp_path / "long.zarr", nt=384, chunk_time=4)
    m = xinsitu.open_zarr(path).insitu.split("time", fractions={"train": 1.0})
    with FileServer(tmp_path, Faults(latency=0.2)) as srv:
        for _ in range(4):
            gen = xinsitu.open_zarr(f"{srv.url}/long.zarr").insitu.batches(
                m, "train", batch_size=8, block_chunks=16, max_inflight=16, output="numpy")
            it = iter(gen)
            next(it)
            it.close()
            del it, gen
            gc.collect()
            time.sleep(0.5)  # requests already at the server finish (0.2 s each)
            before = srv.requests
            time.sleep(1.0)
            assert srv.requests - before <= 2, f"an abandoned epoch kept reading: {srv.requests - before} requests"
            assert runtime_threads() <= 16 + PROCESS_INFLIGHT


def test_a_paced_growth_is_whole_once_the_last_slot_is_back():
    """Slots of a paced growth come one per slot given back; where the reads end first (an epoch ended
    by an error, or by its last chunk), the rest are free at once, not owed until reads start again."""
    import asyncio
    import time

    from xinsitu.io.inflight import Slots

    slots = Slots(4, time.monotonic)
    loop = asyncio.new_event_loop()
    try:
        for r in range(3):
            loop.run_until_complete(slots.take(r))
        slots.resize(20, paced=True)
        assert slots.free() == 1 and slots.pacing()
        slots.give(0)
        assert slots.free() == 3 and slots.pacing()  # its own and one of the growth
        slots.give(1)
        slots.give(2)  # the last: every slot is free
        assert slots.held() == 0 and slots.free() == 20 and not slots.pacing()
        for r in range(20):  # and taken without waiting
            loop.run_until_complete(asyncio.wait_for(slots.take(r), 1))
        assert slots.free() == 0
    finally:
        loop.close()


def test_an_archive_written_again_under_an_open_dataset_is_not_only_called_corrupt(tmp_path):
    """``to_zarr(mode="w")`` with another chunking over an archive opened before: its chunks no longer decode
    by the metadata read at the open. The error named only damage in the store ("corrupt in the store?"),
    sending the user to look for it; it names the rewrite too now."""
    import xarray as xr

    from xinsitu.stores.backend import ChunkReadError

    path = str(tmp_path / "a.zarr")
    data = xr.Dataset({"a": (("time", "x"), np.arange(48.0).reshape(12, 4))})
    data.to_zarr(path, encoding={"a": {"chunks": (2, 4)}})
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 1.0})
    data.to_zarr(path, mode="w", encoding={"a": {"chunks": (4, 4)}})
    with pytest.raises(ChunkReadError, match=r"variable 'a'.*failed to decode.*\(corrupt in the store, or the archive "
                                             r"written again since it was opened\?\)"):
        list(ds.insitu.batches(m, "train", batch_size=4, shuffle=False, output="numpy"))
