"""Admission and circuit breakers: what an endpoint whose breaker is not closed adds to a model's capacity."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.support.factories import model_block
from tests.support.http import chat_body, post
from tests.support.waiting import wait_for

CHAT = [{"role": "user", "content": "hello there"}]
HOLD = {"x-sim-fault": "hang=inf"}
body = chat_body(CHAT, stream=False, max_tokens=2)


async def sim_config(url, **cfg):
    async with aiohttp.ClientSession() as s, s.post(url + "/_sim/config", json=cfg) as r:
        assert r.status == 200


async def test_a_half_open_endpoint_adds_only_its_free_trials_to_what_the_queue_may_take(sims, gateway):
    """Two endpoints of at most 2 requests each: the good one full, the other's breaker open (its
    engine's 500), four requests waiting in the queue. The other comes back half-open with one trial
    slot, and a slot frees on the good one: the queue lets 2 go, one the trial and one to the good
    endpoint, none past its cap. It let 3 go, the half-open endpoint counted for the 2 of its cap:
    once the trial took the one slot, the third went to the good endpoint anyway, a third request
    on an endpoint of 2."""
    good = await sims("vllm", "m")
    sick = await sims("vllm", "m", fault="status=500")
    gw = await gateway([model_block("m", "vllm", [sick.url, good.url])],
                       admission={"enabled": True, "max_in_flight_per_endpoint": 2, "queue_max": 10,
                                  "queue_timeout_s": 60},
                       routing={"strategy": "round-robin"}, health={"interval_s": 0.1, "timeout_s": 1.0},
                       scrape={"enabled": False},
                       breaker={"consecutive_faults": 1, "base_ejection_s": 60, "half_open_trials": 1,
                                "success_threshold": 1, "max_ejection_percent": 50})
    half, full = (next(e for e in gw.gw.pool.endpoints("m") if e.url == u) for u in (sick.url, good.url))
    for _ in range(4):                  # its 500 (retried on the good one) opens its breaker
        assert (await post(gw.url, body))[0] == 200
        if not half.ready:
            break
    assert not half.ready
    held = [asyncio.create_task(post(gw.url, body, HOLD)) for _ in range(2)]
    assert await wait_for(lambda: full.in_flight == 2)
    mq = gw.gw.admission._models["m"]
    waiting = [asyncio.create_task(post(gw.url, body, HOLD)) for _ in range(4)]
    try:
        assert await wait_for(lambda: len(mq.queue) == 4)
        await sim_config(sick.url, dead=True)          # the probes find it down, then back: half-open
        assert await wait_for(lambda: not half.healthy)
        await sim_config(sick.url, dead=False)
        assert await wait_for(lambda: half.ready, timeout=10)
        assert len(mq.queue) == 4
        held[0].cancel()                                 # a slot frees on the good endpoint
        assert await wait_for(lambda: half.in_flight == 1)           # the trial went
        assert await wait_for(lambda: mq.granted == 0)               # and every request let go was routed
        assert full.in_flight == 2
        assert len(mq.queue) == 2
    finally:
        for t in held + waiting:
            t.cancel()
        await asyncio.gather(*held, *waiting, return_exceptions=True)
