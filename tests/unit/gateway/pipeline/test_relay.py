"""The relay's stream watchdog: one timer per stream that bounds each wait for the next chunk."""

from __future__ import annotations

import asyncio

from gateway.pipeline.relay import Watchdog, WatchdogFired
from tests.support.waiting import until


class FakeResponse:
    def __init__(self) -> None:
        self.waiting = False
        self.interrupted: list[BaseException] = []

    def interrupt(self, exc: BaseException) -> None:
        self.interrupted.append(exc)


async def test_a_wait_longer_than_the_first_chunk_bound_fires_that_phase():
    resp = FakeResponse()
    resp.waiting = True
    w = Watchdog(resp, 0.05, 10.0)
    await until(lambda: resp.interrupted)
    [exc] = resp.interrupted
    assert isinstance(exc, WatchdogFired) and (exc.phase, exc.seconds) == ("first_chunk", 0.05)
    w.cancel()


async def test_time_spent_writing_is_not_a_wait_and_the_idle_bound_follows_the_first_chunk():
    resp = FakeResponse()
    w = Watchdog(resp, 0.03, 0.05)
    w.first_chunk_came()
    await asyncio.sleep(0.2)           # writing to the client: no wait in progress
    assert resp.interrupted == []
    w.since = asyncio.get_running_loop().time()
    resp.waiting = True
    await until(lambda: resp.interrupted)
    [exc] = resp.interrupted
    assert (exc.phase, exc.seconds) == ("idle", 0.05)
    w.cancel()


async def test_no_idle_bound_stops_the_timer_after_the_first_chunk():
    resp = FakeResponse()
    resp.waiting = True
    w = Watchdog(resp, 30.0, 0.0)
    w.first_chunk_came()
    assert w.handle is None
    await asyncio.sleep(0.05)
    assert resp.interrupted == []


async def test_cancel_stops_it():
    resp = FakeResponse()
    resp.waiting = True
    w = Watchdog(resp, 0.02, 0.02)
    w.cancel()
    await asyncio.sleep(0.1)
    assert resp.interrupted == [] and w.handle is None
