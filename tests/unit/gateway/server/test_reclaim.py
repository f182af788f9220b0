from __future__ import annotations

import asyncio

from gateway.server.reclaim import MemoryReclaimer


def make(counts: list[int], min_drop: int = 1000) -> tuple[MemoryReclaimer, list[int]]:
    it = iter(counts)
    r = MemoryReclaimer(lambda: next(it), min_drop=min_drop)
    ran: list[int] = []
    r.reclaim = lambda: ran.append(r.peak)   # type: ignore[method-assign]
    return r, ran


def test_reclaims_once_the_in_flight_count_fell_by_min_drop_and_below_half_its_peak():
    r, ran = make([100, 5000, 10000, 9000, 6000, 4000, 3000, 3000, 3100, 2000, 0, 0, 0])
    fired = [r.check() for _ in range(13)]
    # 9000 and 6000 are above half the peak; from 4000 on it is below, but still falling; at the
    # second 3000 the fall stopped: memory goes back, and the peak restarts there (then 3100). The
    # fall to 0 is another 3100: once it stops, memory goes back again
    assert fired == [False, False, False, False, False, False, False, True, False, False, False, True, False]
    assert ran == [3000, 0]


def test_steady_traffic_and_small_bursts_never_reclaim():
    r, ran = make([50, 400, 900, 10, 300, 0] * 3)
    assert not any(r.check() for _ in range(18))
    assert ran == []


def test_a_real_reclaim_runs_and_is_counted():
    counted = []
    r = MemoryReclaimer(lambda: 0, on_reclaim=lambda: counted.append(1))
    r.reclaim()
    assert r.runs == 1 and counted == [1]


def test_min_drop_zero_turns_it_off():
    async def scenario() -> None:
        r = MemoryReclaimer(lambda: 0, min_drop=0)
        r.start()
        assert r._task is None
        await r.stop()

    asyncio.run(scenario())
