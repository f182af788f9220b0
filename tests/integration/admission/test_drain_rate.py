"""The admission queue's drain rate (what ``Retry-After`` and a deadline's check are computed from)
counts the requests an engine answered: a 2xx, or a 4xx the engine gave about the request. An
engine that fails fast (its 5xx, a refused connection) serves nobody however quickly it frees its
slot, so a queue in front of it must not promise a short wait."""

from __future__ import annotations

import asyncio
import contextlib
from functools import partial

import openai
import pytest

from tests.support.factories import model_block
from tests.support.http import chat_body, openai_client, post
from tests.support.waiting import wait_for

CHAT = [{"role": "user", "content": "hello there"}]
body = partial(chat_body, CHAT)
HOLD = {"x-sim-fault": "stall_before_first=inf"}
CAP = 60
# what each answer is, how it is made, and whether it counts as drained
ANSWERS = {
    "200": ({}, None, True),
    "400": ({"x-sim-fault": "status=400"}, openai.BadRequestError, True),
    "404": ({"x-sim-fault": "status=404"}, openai.NotFoundError, True),
    "500": ({"x-sim-fault": "status=500"}, openai.InternalServerError, False),
    "503": ({"x-sim-fault": "status=503"}, openai.InternalServerError, False),
    "error_event": ({"x-sim-fault": "error_after=0"}, openai.APIError, False),
    "refused": ({}, openai.InternalServerError, False),
}


@pytest.mark.parametrize("case", sorted(ANSWERS))
async def test_only_answers_of_the_engine_drain_the_queue(sims, gateway, case):
    headers, raised, drains = ANSWERS[case]
    sim = await sims("vllm", "m")
    # the engine's failures must not take it out of rotation here: the queue is what is looked at
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       admission={"enabled": True, "max_in_flight_per_endpoint": 1, "queue_max": 1,
                                  "queue_timeout_s": 30, "retry_after_max_s": CAP},
                       health={"interval_s": 60, "timeout_s": 1.0, "passive": False},
                       scrape={"enabled": False}, breaker={"enabled": False},
                       retry={"enabled": False})
    assert await wait_for(lambda: gw.gw.pool.ready("m"))
    client = openai_client(gw)
    if case == "refused":           # the engine goes after the gateway saw it ready
        await sim.close()
    for _ in range(4):
        try:
            r = await client.chat.completions.create(**body(), stream=case == "error_event",
                                                     extra_headers=headers)
            if case == "error_event":
                async for _ in r:
                    pass
        except openai.APIError as e:
            assert raised is not None and isinstance(e, raised), e
        else:
            assert raised is None
    mq = gw.gw.admission._models["m"]
    assert (mq.drain.rate(gw.gw.admission.clock()) > 0) is drains
    text = await gw.metrics_text()
    assert ('switchyard_admission_drain_rate{model="m"} 0.0' in text) is not drains
    if case == "refused":           # no engine to hold a request on
        await client.close()
        return
    # one request on the engine, one waiting: the next is shed with the Retry-After the rate gives
    holder = asyncio.create_task(post(gw.url, body(), HOLD))
    assert await wait_for(lambda: sum(e.in_flight for e in gw.gw.pool.endpoints("m")) == 1)
    waiting = asyncio.create_task(post(gw.url, body(), HOLD))
    assert await wait_for(lambda: len(mq.queue) == 1)
    with pytest.raises(openai.RateLimitError) as full:
        await client.chat.completions.create(**body())
    after = int(full.value.response.headers["Retry-After"])
    if drains:
        assert after < CAP
    else:                           # nothing was served: no rate to promise a wait from
        assert after == CAP
    for task in (waiting, holder):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await client.close()
