"""The lifecycle's wait for no request in flight (a stop's drain): told when the last one leaves,
with nothing done per request while none waits."""

from __future__ import annotations

import asyncio

from gateway.server.lifecycle import Lifecycle


async def test_wait_idle_is_true_at_once_when_nothing_is_in_flight():
    life = Lifecycle()
    assert await life.wait_idle(0)
    life.enter()
    life.leave()
    assert await life.wait_idle(0)


async def test_wait_idle_ends_when_the_last_request_leaves():
    life = Lifecycle()
    life.enter()
    life.enter()
    waits = [asyncio.ensure_future(life.wait_idle(5)) for _ in range(2)]
    await asyncio.sleep(0)
    life.leave()
    await asyncio.sleep(0)
    assert not any(w.done() for w in waits)         # one is still in flight
    life.leave()
    life.enter()                                    # a new one after: the waits were told already
    assert await asyncio.gather(*waits) == [True, True]
    life.leave()


async def test_wait_idle_times_out_while_a_request_stays():
    life = Lifecycle()
    life.enter()
    assert not await life.wait_idle(0.01)
    assert life._idle_waiters == []                 # the wait that ended is not kept
    task = asyncio.ensure_future(life.wait_idle(5))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert life._idle_waiters == []
    life.leave()
