"""Admission control on loopback: the queue's order under mixed classes and tenants, the full,
timeout, displaced and shed paths with their Retry-After, a client leaving the queue, and
saturation read from the engine's own queue."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from functools import partial

import aiohttp
import openai
import orjson
import pytest

from enginesim.tiny_tokenizer import TINY_DIR
from tests.support.factories import model_block
from tests.support.http import chat_body, openai_client, post
from tests.support.waiting import until, wait_for

CHAT = [{"role": "user", "content": "hello there"}]
body = partial(chat_body, CHAT)
HOLD = {"x-sim-fault": "stall_before_first=inf"}      # runs on the engine until its client leaves
KEYS = {"alice": "sk-alice", "bob": "sk-bob", "carol": "sk-carol", "erin": "sk-erin"}


def queue(gw):
    return gw.gw.admission._models["m"].queue


async def capped_gateway(sims, gateway, admission=None, **blocks):
    """One engine, and admission that lets one request at a time onto it."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       admission={"enabled": True, "max_in_flight_per_endpoint": 1, **(admission or {})}, **blocks)
    return sim, gw


async def hold(gw, **headers):
    """A request that occupies the endpoint until the task is cancelled (its client leaves)."""
    task = asyncio.create_task(post(gw.url, body(), {**HOLD, **headers}))
    assert await wait_for(lambda: gw.gw.pool.endpoints("m")[0].in_flight == 1)
    return task


async def cancel(task):
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_queue_order_by_class_then_round_robin_across_users(sims, gateway):
    auth = {"api_keys": [{"key": k, "user": u} for u, k in KEYS.items()]}
    limits = {"users": {"carol": {"priority": "critical"}}}
    _, gw = await capped_gateway(sims, gateway, auth=auth, limits=limits)
    served: list[str] = []
    gw.gw.observers.append(lambda rec, _d: served.append(rec.request_id) if rec.status == 200 else None)
    blocker = await hold(gw, Authorization="Bearer sk-alice")
    order = [("s1", "erin", "sheddable"), ("a1", "alice", None), ("a2", "alice", None), ("b1", "bob", None),
             ("a3", "alice", "critical"),      # above alice's class: kept at standard
             ("c1", "carol", None)]
    tasks = []
    for i, (rid, user, prio) in enumerate(order):
        h = {"Authorization": f"Bearer {KEYS[user]}", "x-request-id": rid}
        if prio:
            h["x-priority"] = prio
        tasks.append(asyncio.create_task(post(gw.url, body(), h)))
        assert await wait_for(lambda n=i + 1: len(queue(gw)) == n)
    await cancel(blocker)
    results = await asyncio.gather(*tasks)
    assert [st for st, _, _ in results] == [200] * len(order)
    assert served == ["c1", "a1", "b1", "a2", "a3", "s1"]
    text = await gw.metrics_text()
    assert 'switchyard_admission_wait_seconds_count{model="m",outcome="dispatched",priority="critical"} 1.0' in text
    assert 'switchyard_admission_queue_depth{model="m",priority="standard"} 0.0' in text


async def test_full_and_timeout_answer_429_with_a_computed_retry_after(sims, gateway):
    _, gw = await capped_gateway(sims, gateway, {"queue_max": 1, "queue_timeout_s": 0.5})
    client = openai_client(gw)
    for _ in range(4):         # requests that drained: the rate Retry-After is computed from
        await client.chat.completions.create(**body())
    blocker = await hold(gw)
    waiting = asyncio.create_task(post(gw.url, body()))
    assert await wait_for(lambda: len(queue(gw)) == 1)
    with pytest.raises(openai.RateLimitError) as full:
        await client.chat.completions.create(**body())
    r = full.value.response
    assert full.value.code == "queue_full"
    assert r.headers["x-error-admission"] == "queue_full"
    assert r.headers["x-ratelimit-limit-queue"] == "1" and r.headers["x-ratelimit-remaining-queue"] == "0"
    after = int(r.headers["Retry-After"])
    # one request ahead at four or more per second over the 10 s window: a few seconds, not the cap
    assert 1 <= after < 60 and int(r.headers["retry-after-ms"]) <= after * 1000
    status, headers, raw = await waiting              # nothing freed the endpoint: it times out
    assert status == 429 and orjson.loads(raw)["error"]["code"] == "queue_timeout"
    assert 1 <= int(headers["Retry-After"]) < 60
    await cancel(blocker)
    await client.chat.completions.create(**body())   # and the gateway serves again
    await client.close()
    text = await gw.metrics_text()
    for reason in ("queue_full", "queue_timeout"):
        assert f'switchyard_admission_shed_total{{model="m",priority="standard",reason="{reason}"}} 1.0' in text


async def test_a_higher_class_displaces_a_sheddable_one_and_sheddable_is_shed_while_it_waits(sims, gateway):
    _, gw = await capped_gateway(sims, gateway, {"queue_max": 1})
    blocker = await hold(gw)
    low = asyncio.create_task(post(gw.url, body(), {"x-priority": "sheddable"}))
    assert await wait_for(lambda: len(queue(gw)) == 1)
    high = asyncio.create_task(post(gw.url, body()))
    status, headers, raw = await low
    assert status == 429 and orjson.loads(raw)["error"]["code"] == "displaced" and int(headers["Retry-After"]) >= 1
    assert await wait_for(lambda: queue(gw).count(1) == 1)
    status, _, raw = await post(gw.url, body(), {"x-priority": "sheddable"})
    assert status == 429 and orjson.loads(raw)["error"]["code"] == "shed"
    await cancel(blocker)
    assert (await high)[0] == 200


async def test_a_client_that_leaves_while_queued_leaves_the_queue(sims, gateway):
    _, gw = await capped_gateway(sims, gateway)
    blocker = await hold(gw)
    waiting = asyncio.create_task(post(gw.url, body()))
    assert await wait_for(lambda: len(queue(gw)) == 1)
    await cancel(waiting)
    assert await wait_for(lambda: len(queue(gw)) == 0)
    await cancel(blocker)
    assert (await post(gw.url, body()))[0] == 200
    assert gw.gw.admission._models["m"].granted == 0
    text = await gw.metrics_text()
    assert 'switchyard_admission_wait_seconds_count{model="m",outcome="cancelled",priority="standard"} 1.0' in text



@pytest.mark.parametrize("ending", ["client_closed", "sdk_timeout_stream", "queue_timeout", "displaced"])
async def test_the_line_of_a_request_that_waited_says_how_its_wait_ended(sims, gateway, ending):
    """Whatever ended a wait in the queue, the request's log line has ``queue_wait_ms`` and
    ``queue_outcome`` (the outcome of ``switchyard_admission_wait_seconds``), and a shed one its
    ``queue_position`` and ``retry_after_s``; the queue, its bytes and its granted slots are back to
    nothing after it, and the next request is served."""
    _, gw = await capped_gateway(sims, gateway, {"queue_timeout_s": 0.5 if ending == "queue_timeout" else 30,
                                                 "queue_max": 1})
    with gw.gw.request_log.capture() as lines:
        blocker = await hold(gw)
        if ending == "sdk_timeout_stream":
            client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="none", max_retries=0, timeout=0.3)
            with pytest.raises(openai.APITimeoutError):
                await client.chat.completions.create(**body(stream=True), extra_headers={"x-request-id": "w"})
            await client.close()
        else:
            prio = {"x-priority": "sheddable"} if ending == "displaced" else {}
            waiting = asyncio.create_task(post(gw.url, body(stream=True), {"x-request-id": "w", **prio}))
            assert await wait_for(lambda: len(queue(gw)) == 1)
            if ending == "client_closed":
                await cancel(waiting)
            elif ending == "displaced":
                newcomer = asyncio.create_task(post(gw.url, body(), {"x-request-id": "n"}))
                status, _, raw = await waiting
                assert status == 429 and orjson.loads(raw)["error"]["code"] == "displaced"
            else:
                status, _, raw = await waiting
                assert status == 429 and orjson.loads(raw)["error"]["code"] == "queue_timeout"
        line = await until(lambda: next((x for x in lines if x["request_id"] == "w"), None))
        shed = ending in ("queue_timeout", "displaced")
        assert line["status"] == (429 if shed else 499)
        assert line.get("queue_wait_ms", 0) > 0, line
        if shed:
            assert line.get("queue_position") == 0 and line.get("retry_after_s", 0) >= 1, line
            assert line["error_class"] == f"admission_{ending}"
        assert line.get("queue_outcome") == ("shed" if shed else "cancelled"), line
        await cancel(blocker)
        if ending == "displaced":
            assert (await newcomer)[0] == 200
    assert await wait_for(lambda: len(queue(gw)) == 0 and queue(gw).bytes == 0)
    assert gw.gw.admission._models["m"].granted == 0
    assert (await post(gw.url, body()))[0] == 200


async def test_saturation_follows_the_engines_queue_between_scrapes(sims, gateway):
    """One running slot on the engine, at most one request queued there: the third request waits
    in the gateway, and goes as soon as one of the two ends (a release, not a scrape)."""
    sim = await sims("vllm", "m", max_num_seqs=1)
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       admission={"enabled": True, "max_waiting_per_endpoint": 1})
    ep = gw.gw.pool.endpoints("m")[0]
    first = await hold(gw)
    second = asyncio.create_task(post(gw.url, body(), HOLD))
    assert await wait_for(lambda: ep.metrics is not None and ep.metrics.waiting == 1 and ep.metrics.running == 1)
    third = asyncio.create_task(post(gw.url, body()))
    assert await wait_for(lambda: len(queue(gw)) == 1)
    await cancel(first)                    # its slot goes to the second; the third may queue on the engine
    assert await wait_for(lambda: len(queue(gw)) == 0)
    await cancel(second)
    status, _, _ = await third
    assert status == 200
    text = await gw.metrics_text()
    assert f'switchyard_endpoint_saturated{{endpoint="{ep.name}",model="m"}} 0.0' in text


async def test_a_bad_x_priority_is_a_400_that_costs_the_user_nothing(sims, gateway):
    auth = {"api_keys": [{"key": KEYS["alice"], "user": "alice"}]}
    _, gw = await capped_gateway(sims, gateway, auth=auth, limits={"users": {"alice": {"rpm": 10}}})
    alice = {"Authorization": f"Bearer {KEYS['alice']}"}
    for _ in range(3):
        status, _, raw = await post(gw.url, body(), {**alice, "x-priority": "urgent"})
        assert status == 400 and orjson.loads(raw)["error"]["param"] == "x-priority"
    status, headers, _ = await post(gw.url, body(), alice)
    assert status == 200 and headers["x-ratelimit-remaining-requests"] == "9"    # the refused ones not counted


async def test_an_x_priority_sent_twice_is_a_400_whatever_its_first_line(sims, gateway):
    """``x-priority`` holds one class, so two lines of it are read whole, as RFC 9110 joins them
    (``standard, bogus``): no class, a 400, whichever line comes first and whether or not the lines
    agree, and the user's window does not count it. Which line counts is not left to the reader (a
    proxy in front that lowered the class by adding a line of its own would otherwise be ignored)."""
    import aiohttp
    from multidict import CIMultiDict

    auth = {"api_keys": [{"key": KEYS["alice"], "user": "alice"}]}
    _, gw = await capped_gateway(sims, gateway, auth=auth, limits={"users": {"alice": {"rpm": 10}}})
    async with aiohttp.ClientSession() as s:
        for first, second in (("standard", "bogus"), ("critical", "sheddable"), ("standard", "standard")):
            headers = CIMultiDict([("Authorization", f"Bearer {KEYS['alice']}"),
                                   ("x-priority", first), ("x-priority", second)])
            async with s.post(gw.url + "/v1/chat/completions", json=body(), headers=headers) as r:
                answer = await r.json()
                assert r.status == 400, (first, second, answer)
                assert answer["error"]["param"] == "x-priority" and answer["error"]["code"] == "invalid_priority"
    status, headers, _ = await post(gw.url, body(), {"Authorization": f"Bearer {KEYS['alice']}"})
    assert status == 200 and headers["x-ratelimit-remaining-requests"] == "9"    # the refused ones not counted


async def test_no_flood_before_the_engines_capacity_is_known(sims, gateway):
    """Twelve requests at once on a fresh engine of two slots, standard class (its share of
    max_waiting_per_endpoint 2 is one queued request): before its capacity is known it gets one
    slot's worth and that one (slow start); a scrape sees two running and nobody waiting (the
    window is two), then one waiting (the capacity is two). Its queue never passes the class's
    share; the rest wait in the gateway."""
    sim = await sims("vllm", "m", max_num_seqs=2)
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       admission={"enabled": True, "max_waiting_per_endpoint": 2})
    ep = gw.gw.pool.endpoints("m")[0]
    assert await wait_for(lambda: ep.metrics is not None)
    tasks = [asyncio.create_task(post(gw.url, body(), HOLD)) for _ in range(12)]
    assert await wait_for(lambda: "m" in gw.gw.admission._models and len(queue(gw)) == 9 and ep.in_flight == 3)
    b = ep.extra["admission_baseline"]
    assert await wait_for(lambda: (b.capacity, b.source) == (2, "queued"))
    assert await wait_for(lambda: sim.engine.counts.started == 3)
    assert sim.engine.counts.waiting_peak == 1
    assert len(queue(gw)) == 9
    for t in tasks:
        await cancel(t)
    assert sim.engine.counts.waiting_peak == 1


async def test_a_full_queue_evicts_the_heaviest_users_newest_not_a_light_newcomer(sims, gateway):
    auth = {"api_keys": [{"key": k, "user": u} for u, k in KEYS.items()]}
    _, gw = await capped_gateway(sims, gateway, {"queue_max": 2}, auth=auth)
    served: list[str] = []
    gw.gw.observers.append(lambda rec, _d: served.append(rec.request_id) if rec.status == 200 else None)
    blocker = await hold(gw, Authorization="Bearer sk-erin")
    heavy = []
    for i in range(2):
        heavy.append(asyncio.create_task(post(gw.url, body(), {"Authorization": "Bearer sk-alice",
                                                               "x-request-id": f"a{i}"})))
        assert await wait_for(lambda n=i + 1: len(queue(gw)) == n)
    light = asyncio.create_task(post(gw.url, body(), {"Authorization": "Bearer sk-bob", "x-request-id": "b0"}))
    status, headers, raw = await heavy[1]
    assert status == 429 and orjson.loads(raw)["error"]["code"] == "fair_share" and int(headers["Retry-After"]) >= 1
    status, _, raw = await post(gw.url, body(), {"Authorization": "Bearer sk-alice"})
    assert status == 429 and orjson.loads(raw)["error"]["code"] == "queue_full"   # alice's own newcomer
    await cancel(blocker)
    assert (await light)[0] == 200 and (await heavy[0])[0] == 200
    assert served == ["a0", "b0"]
    text = await gw.metrics_text()
    assert 'switchyard_admission_shed_total{model="m",priority="standard",reason="fair_share"} 1.0' in text



def sized(content_len: int, user: str, max_tokens: int = 4) -> bytes:
    """A chat request's bytes as the client sends them (the queue counts these), ``content_len``
    characters of prompt."""
    return orjson.dumps(chat_body([{"role": "user", "content": "x" * content_len}], user=user, max_tokens=max_tokens))


@pytest.mark.parametrize("case", ["larger_than_the_queue", "larger_than_evictions_free"])
async def test_a_request_that_cannot_fit_the_queues_bytes_evicts_nobody(sims, gateway, case):
    """A newcomer is refused ``queue_full`` without touching the queue when no eviction the rules
    allow would make room for its body: alone larger than ``queue_max_bytes``, or larger than what
    the requests it may evict hold (here a sheddable one it could displace, beside a critical one of
    a lighter user it may not)."""
    small = sized(10, "erin")
    if case == "larger_than_the_queue":
        queued = [(small, "sheddable"), (small, "sheddable")]
        newcomer, limit = sized(2000, "bob"), 1500
    else:
        first = sized(1700, "alice")
        newcomer = sized(1300, "bob", max_tokens=4000)   # bob's cost outweighs alice's: no fair_share
        queued = [(small, "sheddable"), (first, "critical")]     # sheddable first: it is shed behind a critical one
        limit = len(first) + len(newcomer) - 1           # both critical ones never fit together
    _, gw = await capped_gateway(sims, gateway, {"queue_max_bytes": limit, "default_priority": "critical"})
    blocker = await hold(gw)
    waiting = []
    for i, (raw, prio) in enumerate(queued):
        waiting.append(asyncio.create_task(post(gw.url, raw, {"x-priority": prio})))
        assert await wait_for(lambda n=i + 1: len(queue(gw)) == n)
    held = queue(gw).bytes
    status, headers, raw = await post(gw.url, newcomer, {"x-priority": "standard" if case == "larger_than_the_queue"
                                                          else "critical"})
    assert status == 429 and orjson.loads(raw)["error"]["code"] == "queue_full"
    assert headers["x-error-admission"] == "queue_full" and int(headers["Retry-After"]) >= 1
    assert len(queue(gw)) == len(queued) and queue(gw).bytes == held       # nobody evicted for nothing
    await cancel(blocker)
    assert [r.status for r in await asyncio.gather(*waiting)] == [200] * len(queued)
    text = await gw.metrics_text()
    assert 'reason="displaced"' not in text and 'reason="fair_share"' not in text


async def test_a_body_of_exactly_queue_max_bytes_waits_and_is_served(sims, gateway):
    """The byte bound holds the body at it: such a request waits (the queue then full, the same
    user's next one refused queue_full) and is served once room frees."""
    raw = sized(500, "alice")
    _, gw = await capped_gateway(sims, gateway, {"queue_max_bytes": len(raw)})
    blocker = await hold(gw)
    waiting = asyncio.create_task(post(gw.url, raw))
    assert await wait_for(lambda: len(queue(gw)) == 1)
    assert queue(gw).bytes == len(raw)
    status, _, body_ = await post(gw.url, sized(1, "alice"))
    assert status == 429 and orjson.loads(body_)["error"]["code"] == "queue_full"
    await cancel(blocker)
    assert (await waiting).status == 200
    assert queue(gw).bytes == 0

async def test_deadlines_earliest_first_and_shed_when_the_queue_cannot_meet_them(sims, gateway):
    _, gw = await capped_gateway(sims, gateway)
    served: list[str] = []
    gw.gw.observers.append(lambda rec, _d: served.append(rec.request_id) if rec.status == 200 else None)
    blocker = await hold(gw)
    tasks = []
    for i, (rid, slo) in enumerate([("none", None), ("late", "60000"), ("soon", "30000")]):
        h = {"x-request-id": rid, **({"x-slo-ttft-ms": slo} if slo else {})}
        tasks.append(asyncio.create_task(post(gw.url, body(), h)))
        assert await wait_for(lambda n=i + 1: len(queue(gw)) == n)
    await cancel(blocker)
    assert [r[0] for r in await asyncio.gather(*tasks)] == [200, 200, 200]
    assert served == ["soon", "late", "none"]
    # the queue drains at a few per second: a 1 ms objective behind a held request cannot be met
    blocker = await hold(gw)
    waiting = asyncio.create_task(post(gw.url, body()))
    assert await wait_for(lambda: len(queue(gw)) == 1)
    status, headers, raw = await post(gw.url, body(), {"x-slo-ttft-ms": "1"})
    assert status == 429 and orjson.loads(raw)["error"]["code"] == "deadline" and int(headers["Retry-After"]) >= 1
    await cancel(blocker)
    assert (await waiting)[0] == 200
    text = await gw.metrics_text()
    assert 'switchyard_admission_shed_total{model="m",priority="standard",reason="deadline"} 1.0' in text
    assert 'switchyard_slo_requests_total{model="m",objective="ttft",outcome="shed"} 1.0' in text


async def test_a_waiter_whose_deadline_passed_before_its_timer_ran_is_shed_not_served_late(sims, gateway):
    """A busy event loop can run the release that frees a slot before the timer of a waiter whose
    deadline has just passed (seen at three times capacity: waits of 503 ms on a 500 ms objective).
    The admission clock is moved past the deadline while the loop's timer is still far off (no
    scrapes: the in-flight cap alone says when there is room, so the clock does not age them)."""
    sim, gw = await capped_gateway(sims, gateway, scrape={"enabled": False})
    blocker = await hold(gw)
    served = queue(gw).counter(1, "")                    # the blocker's cost, on the user's counter
    waiting = asyncio.create_task(post(gw.url, body(), {"x-slo-ttft-ms": "60000"}))
    assert await wait_for(lambda: len(queue(gw)) == 1)
    gw.gw.admission.clock = lambda: time.monotonic() + 3600
    await cancel(blocker)                                # room, after the deadline
    status, headers, raw = await waiting
    assert status == 429 and orjson.loads(raw)["error"]["code"] == "deadline" and int(headers["Retry-After"]) >= 1
    assert queue(gw).counter(1, "") == served            # shed, not served: its user is not charged for it
    assert sim.engine.counts.started == 1                # only the blocker reached the engine
    assert len(queue(gw)) == 0 and gw.gw.admission._models["m"].granted == 0
    gw.gw.admission.clock = time.monotonic
    assert (await post(gw.url, body()))[0] == 200        # and the next request is served
    text = await gw.metrics_text()
    assert 'switchyard_admission_shed_total{model="m",priority="standard",reason="deadline"} 1.0' in text
    assert 'switchyard_slo_requests_total{model="m",objective="ttft",outcome="shed"} 1.0' in text


async def test_objectives_met_and_missed_are_counted(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], admission={"enabled": True})
    for slo in ("60000", "60000"):
        assert (await post(gw.url, body(stream=True), {"x-slo-ttft-ms": slo, "x-slo-tpot-ms": "60000"}))[0] == 200
    assert (await post(gw.url, body(stream=True), {"x-slo-ttft-ms": "0.001"}))[0] == 200
    text = await gw.metrics_text()
    assert 'switchyard_slo_requests_total{model="m",objective="ttft",outcome="met"} 2.0' in text
    assert 'switchyard_slo_requests_total{model="m",objective="tpot",outcome="met"} 2.0' in text
    assert 'switchyard_slo_requests_total{model="m",objective="ttft",outcome="missed"} 1.0' in text


async def test_a_critical_request_finds_the_headroom_lower_classes_may_not_fill(sims, gateway):
    """One slot; the engine queue may hold five, of which sheddable work may fill one. With the
    gateway's queue full of sheddable requests, a critical one goes to the engine at once."""
    sim = await sims("vllm", "m", max_num_seqs=1)
    auth = {"api_keys": [{"key": k, "user": u} for u, k in KEYS.items()]}
    gw = await gateway([model_block("m", "vllm", [sim.url])], admission={"enabled": True},
                       auth=auth, limits={"users": {"carol": {"priority": "critical"},
                                                    "erin": {"priority": "sheddable"}}})
    ep = gw.gw.pool.endpoints("m")[0]
    assert await wait_for(lambda: ep.metrics is not None)
    low = [asyncio.create_task(post(gw.url, body(), {**HOLD, "Authorization": "Bearer sk-erin"})) for _ in range(5)]
    assert await wait_for(lambda: "m" in gw.gw.admission._models and len(queue(gw)) == 3 and ep.in_flight == 2)
    high = asyncio.create_task(post(gw.url, body(), {**HOLD, "Authorization": "Bearer sk-carol"}))
    assert await wait_for(lambda: ep.in_flight == 3 and sim.engine.counts.started == 3)
    assert len(queue(gw)) == 3 and queue(gw).count(0) == 3
    for t in (*low, high):
        await cancel(t)


async def test_a_reload_keeps_the_queue_waiting(sims, gateway):
    """``Settings apply on reload; queues are kept``: a reload (here of the same file) must not
    let every queued request onto the engine at once."""
    from gateway.server.app import RELOAD_KEY

    _, gw = await capped_gateway(sims, gateway)
    blocker = await hold(gw)
    waiting = [asyncio.create_task(post(gw.url, body())) for _ in range(4)]
    assert await wait_for(lambda: len(queue(gw)) == 4)
    reloader = gw.runner.app[RELOAD_KEY]
    assert reloader.reload("test", reloader.live.config).result == "ok"
    await asyncio.sleep(0.2)
    assert len(queue(gw)) == 4 and gw.gw.pool.endpoints("m")[0].in_flight == 1     # still one at a time
    await cancel(blocker)
    assert [st for st, _, _ in await asyncio.gather(*waiting)] == [200] * 4


async def test_a_reload_that_turns_admission_off_lets_the_queue_go_at_once(sims, gateway):
    """A reload that turns admission off for the model while requests wait sends them to the
    engine at once, as it would send them arriving then: none is lost, refused or left waiting for
    room that nothing counts any more, and each wait is counted dispatched."""
    import msgspec

    from gateway.server.app import RELOAD_KEY
    from tests.support.metrics import metric

    _, gw = await capped_gateway(sims, gateway, scrape={"enabled": False})
    blocker = await hold(gw)
    waiting = [asyncio.create_task(post(gw.url, body())) for _ in range(3)]
    assert await wait_for(lambda: len(queue(gw)) == 3)
    reloader = gw.runner.app[RELOAD_KEY]
    config = reloader.live.config
    off = msgspec.structs.replace(config, admission=msgspec.structs.replace(config.admission, enabled=False))
    assert reloader.reload("test", off).result == "ok"
    assert [st for st, _, _ in await asyncio.gather(*waiting)] == [200] * 3      # the blocker still runs
    page = await gw.metrics_text()
    assert metric(page, "switchyard_admission_wait_seconds_count", outcome="dispatched") == 3
    assert metric(page, "switchyard_admission_queue_depth") == 0
    await cancel(blocker)


async def test_a_newcomer_to_a_queue_a_reload_left_over_its_bound_takes_one_place(sims, gateway):
    """A reload that lowers ``queue_max`` below the requests waiting keeps them queued; a newcomer of
    a higher class then displaces one of them, as at a full queue, and the queue shrinks as its
    requests go, not all at once for one newcomer."""
    import msgspec

    from gateway.server.app import RELOAD_KEY

    _, gw = await capped_gateway(sims, gateway)
    blocker = await hold(gw)
    low = []
    for i in range(6):
        low.append(asyncio.create_task(post(gw.url, body(user=f"u{i}"), {"x-priority": "sheddable"})))
        assert await wait_for(lambda n=i + 1: len(queue(gw)) == n)
    reloader = gw.runner.app[RELOAD_KEY]
    config = reloader.live.config
    assert reloader.reload("test", msgspec.structs.replace(
        config, admission=msgspec.structs.replace(config.admission, queue_max=2))).result == "ok"
    assert len(queue(gw)) == 6                      # waiting requests stay queued
    newcomer = asyncio.create_task(post(gw.url, body(user="new")))
    assert await wait_for(lambda: queue(gw).count(1) == 1)      # the newcomer waits
    assert len(queue(gw)) == 6, f"{6 - (len(queue(gw)) - 1)} displaced for one newcomer"
    shed = await until(lambda: [t for t in low if t.done()])
    assert len(shed) == 1
    status, _, raw = shed[0].result()
    assert status == 429 and orjson.loads(raw)["error"]["code"] == "displaced"
    await cancel(blocker)
    assert (await newcomer).status == 200
    assert [r.status for r in await asyncio.gather(*(t for t in low if t is not shed[0]))] == [200] * 5


async def _shed_costs_nothing(gw) -> None:
    alice = {"Authorization": f"Bearer {KEYS['alice']}"}
    blocker = await hold(gw, **alice)                   # counted: it reached the engine
    waiting = asyncio.create_task(post(gw.url, body(), alice))
    assert await wait_for(lambda: len(queue(gw)) == 1)
    for _ in range(3):                                  # the queue is full: shed, 429
        status, _, raw = await post(gw.url, body(), alice)
        assert status == 429 and orjson.loads(raw)["error"]["code"] == "queue_full"
    await cancel(blocker)
    assert (await waiting)[0] == 200                    # counted: it ran
    for _ in range(20):                                 # the refunds land in the background
        status, headers, _ = await post(gw.url, body(), alice)
        assert status == 200
        if headers["x-ratelimit-remaining-requests"] == "7":
            break
        await asyncio.sleep(0.05)
    # ten a minute: the blocker, the one that waited and this one; the three shed ones given back
    assert headers["x-ratelimit-remaining-requests"] == "7"


async def test_a_request_admission_sheds_costs_the_user_nothing(sims, gateway):
    """A request refused before any engine saw it gives back its count in the user's request
    window: a client that obeys a shed's Retry-After has lost nothing of its RPM."""
    auth = {"api_keys": [{"key": KEYS["alice"], "user": "alice"}]}
    _, gw = await capped_gateway(sims, gateway, {"queue_max": 1}, auth=auth,
                                 limits={"users": {"alice": {"rpm": 10}}})
    await _shed_costs_nothing(gw)


async def test_a_request_admission_sheds_costs_the_user_nothing_on_shared_state(sims, gateway, redis_server):
    from tests.support.redis_failover import FAST_STATE

    auth = {"api_keys": [{"key": KEYS["alice"], "user": "alice"}]}
    _, gw = await capped_gateway(sims, gateway, {"queue_max": 1}, auth=auth,
                                 limits={"users": {"alice": {"rpm": 10}}},
                                 state={"redis_url": redis_server.url, **FAST_STATE})
    await _shed_costs_nothing(gw)


async def test_a_reload_that_changes_drain_window_s_measures_the_drain_over_the_new_window(sims, gateway):
    """``Settings apply on reload``: the drain rate a queue already had is measured over the
    reloaded ``drain_window_s`` too, not over the window the model's first request found."""
    import msgspec

    from gateway.server.app import RELOAD_KEY

    _, gw = await capped_gateway(sims, gateway, {"queue_max": 0, "drain_window_s": 1})
    client = openai_client(gw)
    await client.chat.completions.create(**body())           # the model's queue exists, its window 1 s
    reloader = gw.runner.app[RELOAD_KEY]
    config = reloader.live.config
    wider = msgspec.structs.replace(config, admission=msgspec.structs.replace(config.admission, drain_window_s=60))
    assert reloader.reload("test", wider).result == "ok"
    for _ in range(4):
        await client.chat.completions.create(**body())
    await asyncio.sleep(2.2)          # out of a 1 s window, well inside a 60 s one
    blocker = await hold(gw)
    with pytest.raises(openai.RateLimitError) as full:
        await client.chat.completions.create(**body())
    # five requests finished in the last 60 s: a rate, so not the cap that says nothing drained
    assert int(full.value.response.headers["Retry-After"]) < 60
    await cancel(blocker)
    await client.close()


async def test_after_a_reload_a_scrape_still_rebases_the_engines_queue(sims, gateway):
    """A scrape taken after a reload and before the model's next request records the gateway's
    load at that scrape, as before the reload: requests that end afterwards free their room at
    once, not only at the next scrape."""
    from gateway.server.app import RELOAD_KEY

    sim = await sims("vllm", "m", max_num_seqs=1)
    gw = await gateway([model_block("m", "vllm", [sim.url])], scrape={"interval_s": 2.0},
                       admission={"enabled": True, "max_waiting_per_endpoint": 1, "metrics_max_age_s": 30})
    ep = gw.gw.pool.endpoints("m")[0]
    first = await hold(gw)
    second = asyncio.create_task(post(gw.url, body(), HOLD))
    assert await wait_for(lambda: ep.metrics is not None and (ep.metrics.running, ep.metrics.waiting) == (1, 1),
                          timeout=10)
    reloader = gw.runner.app[RELOAD_KEY]
    assert reloader.reload("test", reloader.live.config).result == "ok"
    before = ep.metrics
    assert await wait_for(lambda: ep.metrics is not before, timeout=10)     # a scrape after the reload
    snap = ep.metrics
    assert (snap.running, snap.waiting) == (1, 1)
    await cancel(first)
    await cancel(second)
    assert await wait_for(lambda: ep.in_flight == 0)
    row = gw.gw.admission.status("m")["endpoints"][0]
    assert ep.metrics is snap, "a scrape came in between: the check says nothing"
    # the engine was left with both requests the gateway had on it at the scrape: it is idle now
    assert not row["saturated"] and row["engine_queue"] <= 0


@pytest.mark.timeout(90)
async def test_the_status_page_shows_the_gateways_queue_whichever_worker_answers(sims, tmp_path):
    """``--workers 2``: each worker queues the requests its connections brought, and the page's
    admission rows add them up as ``/metrics`` does, whichever worker answers it."""
    from pathlib import Path

    import jsonschema

    from tests.support.gateway_process import gateway_process, get_new, per_worker
    from tests.support.metrics import metric
    from tests.support.ports import listen_port

    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 2, log_level: warning}\n"
                   "scrape: {enabled: false}\n"
                   "admission: {enabled: true, max_in_flight_per_endpoint: 2, queue_max: 60, queue_timeout_s: 60}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
        base = f"http://127.0.0.1:{port}"
        # each on a connection of its own: the kernel spreads them over the workers
        tasks = [asyncio.create_task(post(base, body(), {**HOLD, "user": ("alice", "bob")[i % 2]}))
                 for i in range(10)]

        async def settled():
            page = (await get_new(port, "/metrics"))[1]
            queued = metric(page, "switchyard_admission_queue_depth")
            return page if metric(page, "switchyard_in_flight_requests") == 10 \
                and queued + sim.engine.counts.started == 10 else None
        page = await until(settled, timeout=20)
        queued = metric(page, "switchyard_admission_queue_depth", priority="standard")
        assert queued >= 8
        docs = await per_worker(port, 2, "/status.json")
        # read after every worker built its page: a worker no request reached shows the model from then on
        headroom = metric((await get_new(port, "/metrics"))[1], "switchyard_endpoint_admission_headroom")
        schema = orjson.loads((Path(__file__).resolve().parents[3] / "docs" / "status.schema.json").read_bytes())
        for doc in docs.values():
            jsonschema.validate(doc, schema)
            view = doc["models"][0]["admission"]
            assert view["queue"] == {"sheddable": 0, "standard": queued, "critical": 0}
            assert view["users_waiting"]["standard"] == 2          # alice and bob, once each
            assert view["queue_max"] == 60
            assert view["queue_bytes"] > 0
            assert view["endpoints"][0]["headroom"] == headroom
        for t in tasks:
            await cancel(t)

        async def empty():
            docs = await per_worker(port, 2, "/status.json")
            return all(d["models"][0]["admission"]["queue"]["standard"] == 0 for d in docs.values())
        await until(empty, timeout=10)


async def test_an_endpoint_added_while_requests_wait_takes_them(sims, gateway):
    """The queue built while the model's one engine was full goes to an engine a reload adds (or
    one back from a restart, or discovery's new pod), rather than waiting for the full one."""
    import msgspec

    from gateway.server.app import RELOAD_KEY

    _, gw = await capped_gateway(sims, gateway, {"queue_timeout_s": 5}, scrape={"enabled": False})
    added = await sims("vllm", "m")
    blocker = await hold(gw)
    waiting = [asyncio.create_task(post(gw.url, body())) for _ in range(3)]
    assert await wait_for(lambda: len(queue(gw)) == 3)
    reloader = gw.runner.app[RELOAD_KEY]
    config = reloader.live.config
    first = config.models[0]
    model = msgspec.structs.replace(first, endpoints=(*first.endpoints,
                                                      msgspec.structs.replace(first.endpoints[0], url=added.url)))
    assert reloader.reload("test", msgspec.structs.replace(config, models=(model,))).result == "ok"
    assert [st for st, _, _ in await asyncio.gather(*waiting)] == [200] * 3
    assert added.engine.counts.started == 3
    await cancel(blocker)


@pytest.mark.parametrize("path,payload", [
    ("/v1/chat/completions", body()),
    ("/v1/messages", {"model": "m", "messages": CHAT, "max_tokens": 4}),
    ("/v1/responses", {"model": "m", "input": "hello there", "max_output_tokens": 4}),
    ("/tokenize", {"model": "m", "prompt": "hello there"}),
], ids=["chat", "messages", "responses", "passthrough"])
async def test_a_request_waiting_while_a_reload_replaces_its_engine_goes_to_the_new_one(sims, gateway, path, payload):
    """A reload that replaces the model's one engine while a request waits: the request goes to the
    new engine when room is there, whatever its API, as a chat request does; the endpoints its
    API's path is served by (the Messages API, a pass-through path, the Responses API without an
    engine-held previous response) are those of its model ready when its turn comes."""
    import msgspec

    from gateway.server.app import RELOAD_KEY

    _, gw = await capped_gateway(sims, gateway, {"queue_timeout_s": 30}, scrape={"enabled": False})
    added = await sims("vllm", "m")
    blocker = await hold(gw)
    waiting = asyncio.create_task(post(gw.url, payload, path=path))
    assert await wait_for(lambda: len(queue(gw)) == 1)
    reloader = gw.runner.app[RELOAD_KEY]
    config = reloader.live.config
    first = config.models[0]
    model = msgspec.structs.replace(first, endpoints=(msgspec.structs.replace(first.endpoints[0], url=added.url),))
    assert reloader.reload("test", msgspec.structs.replace(config, models=(model,))).result == "ok"
    status, _, raw = await waiting
    assert status == 200, raw
    assert added.engine.counts.started == 1 or path == "/tokenize"     # tokenize runs no generation
    await cancel(blocker)                   # the replaced engine's request finishes there


async def test_a_continuation_waiting_while_its_responses_engine_leaves_gets_the_owner_gone_409(sims, gateway):
    """A Responses follow-up whose previous response an engine holds (``responses.state: engine``)
    can only go to that engine: when a reload removes it while the follow-up waits, the follow-up
    gets the 409 ``response_owner_gone`` it would get arriving then, not a 503 saying the model has
    no ready endpoint (it has one; a retry after the 503's Retry-After meets the 409)."""
    import msgspec

    from gateway.server.app import RELOAD_KEY

    _, gw = await capped_gateway(sims, gateway, {"queue_timeout_s": 30}, scrape={"enabled": False})
    added = await sims("vllm", "m")
    first = await post(gw.url, {"model": "m", "input": "hello there", "max_output_tokens": 4}, path="/v1/responses")
    follow_up = {"model": "m", "input": "and then?", "max_output_tokens": 4, "previous_response_id": first.json()["id"]}
    blocker = await hold(gw)
    waiting = asyncio.create_task(post(gw.url, follow_up, path="/v1/responses"))
    assert await wait_for(lambda: len(queue(gw)) == 1)
    reloader = gw.runner.app[RELOAD_KEY]
    config = reloader.live.config
    model = msgspec.structs.replace(config.models[0], endpoints=(
        msgspec.structs.replace(config.models[0].endpoints[0], url=added.url),))
    assert reloader.reload("test", msgspec.structs.replace(config, models=(model,))).result == "ok"
    queued = await waiting
    arriving = await post(gw.url, follow_up, path="/v1/responses")
    assert arriving.status == 409 and arriving.json()["error"]["code"] == "response_owner_gone"
    assert queued.status == 409, queued.body
    assert queued.json()["error"]["code"] == "response_owner_gone"
    await cancel(blocker)


@pytest.mark.timeout(90)
async def test_every_worker_has_a_slot_when_the_cap_deals_one_per_worker(tmp_path):
    """``--workers 2``, two idle engines capped at one request each: the gateway's two slots go one
    to each worker, whatever the engines' URLs, so a request never waits while an engine idles
    (the turns were a hash of each URL: two URLs that hashed alike gave one worker both slots and
    the other none, whose requests all waited and were shed)."""
    import zlib

    from enginesim import SimConfig, start_sim
    from tests.support.gateway_process import gateway_process, post_new
    from tests.support.ports import listen_port

    ports: list[int] = []
    while len(ports) < 2:       # URLs of one hash parity: the old turns gave both slots to one worker
        p = listen_port()
        if zlib.crc32(f"http://127.0.0.1:{p}".encode()) % 2 == 0:
            ports.append(p)
    engines = [await start_sim(SimConfig(engine="vllm", model="m", port=p, host="127.0.0.1", ttft_base_ms=2.0,
                                         prefill_ms_per_token=0.0, itl_ms=1.0)) for p in ports]
    try:
        port = listen_port()
        cfg = tmp_path / "gw.yaml"
        cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                       "server: {drain_delay_s: 0, shutdown_grace_s: 2, log_level: warning}\n"
                       "scrape: {enabled: false}\n"
                       "admission: {enabled: true, max_in_flight_per_endpoint: 1, queue_timeout_s: 2}\n"
                       f"models: [{{name: m, engine: vllm, endpoints: {[e.url for e in engines]}}}]\n")
        async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
            statuses = []
            for _ in range(8):      # one at a time, each on a connection of its own: either worker
                status, _, _ = await post_new(port, "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})
                statuses.append(status)
            assert statuses == [200] * 8
    finally:
        for e in engines:
            await e.close()


@pytest.mark.timeout(90)
async def test_an_endpoint_reads_saturated_only_when_no_worker_has_room_on_it(sims, tmp_path):
    """``--workers 2`` and a cap of two on the one engine: a slot each. One request held fills one
    worker's share; the other still admits at once, so ``/metrics`` says the endpoint has room
    (headroom 1, not saturated), as one process would. So it does of a model a reload added, which
    the other worker has not served yet: its share of the room is counted all the same (its rows
    were left out of ``/metrics`` until it served the model or built a status page, and the
    gateway's figures were the first worker's alone: headroom 0, saturated)."""
    import os
    import signal

    from tests.support.gateway_process import gateway_process, get_new
    from tests.support.metrics import metric
    from tests.support.ports import listen_port

    sim = await sims("vllm", "m")
    added = await sims("vllm", "m2")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"

    def write(*sims_) -> None:
        models = ", ".join(f"{{name: {s.engine.cfg.model}, engine: vllm, endpoints: ['{s.url}']}}" for s in sims_)
        cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                       "server: {drain_delay_s: 0, shutdown_grace_s: 2, log_level: warning}\n"
                       "scrape: {enabled: false}\n"
                       "admission: {enabled: true, max_in_flight_per_endpoint: 2, queue_timeout_s: 60}\n"
                       f"models: [{models}]\n")
    write(sim)
    name = sim.url.removeprefix("http://")
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2) as proc:
        base = f"http://127.0.0.1:{port}"

        assert (await post(base, body()))[0] == 200

        async def a_slot_each():
            page = (await get_new(port, "/metrics"))[1]
            return metric(page, "switchyard_endpoint_admission_headroom", endpoint=name) == 2
        await until(a_slot_each, timeout=20)
        held = asyncio.create_task(post(base, body(), HOLD))

        async def held_there():
            page = (await get_new(port, "/metrics"))[1]
            return page if metric(page, "switchyard_endpoint_in_flight_requests", endpoint=name) == 1 else None
        page = await until(held_there, timeout=10)
        assert metric(page, "switchyard_endpoint_admission_headroom", endpoint=name) == 1
        assert metric(page, "switchyard_endpoint_saturated", endpoint=name) == 0
        await cancel(held)

        write(sim, added)
        os.kill(proc.pid, signal.SIGHUP)

        async def reloaded():
            return metric((await get_new(port, "/metrics"))[1], "switchyard_config_generation") == 2
        await until(reloaded, timeout=20)
        name = added.url.removeprefix("http://")
        held = asyncio.create_task(post(base, body(model="m2"), HOLD))
        page = await until(held_there, timeout=10)      # one worker met m2; the other has not
        assert metric(page, "switchyard_endpoint_admission_headroom", endpoint=name) == 1
        assert metric(page, "switchyard_endpoint_saturated", endpoint=name) == 0
        await cancel(held)


async def test_a_waiter_whose_deadline_ends_its_wait_is_shed_as_deadline_when_its_timer_runs_early(sims, gateway):
    """A request with a TTFT objective waits until its deadline at most. A timer that runs a little
    before the admission clock reaches the deadline (uvloop's timers count whole milliseconds) still
    sheds it as ``deadline``, not as a ``queue_timeout`` whose message says it waited the 30 s it never
    did (seen at three times capacity: 4 of 93 deadline sheds, after about 450 ms). The admission clock
    runs at half speed here, so the timer is early for it."""
    _, gw = await capped_gateway(sims, gateway, scrape={"enabled": False})
    blocker = await hold(gw)
    t0 = time.monotonic()
    gw.gw.admission.clock = lambda: t0 + (time.monotonic() - t0) / 2
    status, headers, raw = await post(gw.url, body(), {"x-slo-ttft-ms": "200"})
    gw.gw.admission.clock = time.monotonic
    assert status == 429 and orjson.loads(raw)["error"]["code"] == "deadline"
    assert headers["x-error-admission"] == "deadline"
    await cancel(blocker)
    text = await gw.metrics_text()
    assert 'switchyard_admission_shed_total{model="m",priority="standard",reason="deadline"} 1.0' in text
    assert 'reason="queue_timeout"' not in text


@pytest.mark.timeout(90)
async def test_an_unbounded_endpoints_headroom_is_capped_at_1e6_for_the_gateway(tmp_path):
    """``--workers 2``, admission on with no bound for the engine (no in-flight cap, and an engine
    whose metrics say what it runs but not what waits): each worker's headroom is capped at 1e6, and
    so is the gateway's, on ``/metrics`` as on the status page."""
    from aiohttp import web

    from tests.integration.server.test_worker_restart_metrics import connections
    from tests.support.fake_engine import fake_engine
    from tests.support.gateway_process import gateway_process, get_new
    from tests.support.metrics import metric
    from tests.support.ports import listen_port

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"id": "c", "object": "chat.completion", "model": "m", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]})

    running = 'vllm:num_requests_running{model_name="m"} 0\n'
    async with fake_engine(chat, metrics=running) as url, contextlib.AsyncExitStack() as stack:
        port = listen_port()
        cfg = tmp_path / "gw.yaml"
        cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                       "server: {drain_delay_s: 0, shutdown_grace_s: 2, log_level: warning}\n"
                       "scrape: {interval_s: 0.2}\n"
                       "admission: {enabled: true}\n"
                       f"models: [{{name: m, engine: vllm, endpoints: ['{url}']}}]\n")
        name = url.removeprefix("http://")
        await stack.enter_async_context(gateway_process(cfg, port, "--workers", "2", ready_workers=2))

        workers = await connections(port, 2, stack)

        async def served_by_both() -> bool:      # each worker's first scrape is in
            for w in workers:
                async with w.session.post(w.base + "/v1/chat/completions", json=body()) as r:
                    await r.read()
                    if r.status != 200:         # its first scrape not in yet
                        return False
            return True
        await until(served_by_both, timeout=20)
        page = (await get_new(port, "/metrics"))[1]
        assert metric(page, "switchyard_endpoint_admission_headroom", endpoint=name) == 1_000_000
        assert metric(page, "switchyard_endpoint_saturated", endpoint=name) == 0
        doc = (await get_new(port, "/status.json"))[1]
        assert doc["models"][0]["admission"]["endpoints"][0]["headroom"] == 1_000_000


@pytest.mark.timeout(90)
async def test_a_sighup_that_shrinks_then_grows_the_cap_applies_to_the_queue_waiting(sims, tmp_path):
    """A gateway process with requests queued behind a full engine: a SIGHUP that lowers
    ``max_in_flight_per_endpoint`` lets none of them go while the engine holds the new cap or more
    (its requests in flight finish on it), one that raises it lets the queue onto the room at once,
    and none is lost: every wait is counted dispatched or cancelled, the gauges back to 0 after."""
    import os
    import signal

    from tests.support.gateway_process import gateway_process, get_new
    from tests.support.metrics import metric
    from tests.support.ports import listen_port

    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"

    def write(cap: int) -> None:
        cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                       "server: {drain_delay_s: 0, shutdown_grace_s: 2, log_level: warning}\n"
                       "scrape: {enabled: false}\n"
                       f"admission: {{enabled: true, max_in_flight_per_endpoint: {cap}, queue_timeout_s: 60}}\n"
                       f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")

    async def page():
        return (await get_new(port, "/metrics"))[1]

    async def at(in_flight: int, queued: int, generation: int):
        p = await page()
        return p if (metric(p, "switchyard_in_flight_requests"), metric(p, "switchyard_admission_queue_depth"),
                     metric(p, "switchyard_config_generation")) == (in_flight, queued, generation) else None

    write(2)
    async with gateway_process(cfg, port) as proc:
        base = f"http://127.0.0.1:{port}"
        running = [asyncio.create_task(post(base, body(), HOLD)) for _ in range(2)]
        await until(lambda: sim.engine.counts.started == 2, timeout=20)
        waiting = [asyncio.create_task(post(base, body(), HOLD)) for _ in range(4)]
        await until(lambda: at(6, 4, 1), timeout=20)
        write(1)
        os.kill(proc.pid, signal.SIGHUP)
        await until(lambda: at(6, 4, 2), timeout=20)
        await cancel(running[0])            # the engine still holds one: the new cap
        await until(lambda: at(5, 4, 2), timeout=20)   # the queue was pumped as the request left: nobody went
        assert sim.engine.counts.started == 2
        await cancel(running[1])            # room for one
        await until(lambda: at(4, 3, 2), timeout=20)
        await until(lambda: sim.engine.counts.started == 3, timeout=20)
        write(3)
        os.kill(proc.pid, signal.SIGHUP)
        await until(lambda: at(4, 1, 3), timeout=20)    # two more go at once
        await until(lambda: sim.engine.counts.started == 5, timeout=20)
        for t in waiting:
            await cancel(t)
        p = await until(lambda: at(0, 0, 3), timeout=20)
        assert metric(p, "switchyard_admission_queue_bytes") == 0
        # the one left queued went when a request ahead was cancelled, or was cancelled itself
        waits = {o: metric(p, "switchyard_admission_wait_seconds_count", outcome=o)
                 for o in ("dispatched", "cancelled", "shed")}
        assert waits["dispatched"] >= 3 and waits["dispatched"] + waits["cancelled"] == 4 and waits["shed"] == 0
        assert (await post(base, body())).status == 200       # no slot left held


async def test_a_request_of_several_choices_is_reserved_every_choices_output(sims, gateway):
    """Alice's request of 8 choices of 20 tokens reserves 8 x 20 output tokens on her counter while
    it runs, not one choice's 20: Bob, whose one request of 50 tokens was served meanwhile, has been
    served less and goes before her next request."""
    auth = {"api_keys": [{"key": k, "user": u} for u, k in KEYS.items()]}
    _, gw = await capped_gateway(sims, gateway, {"max_in_flight_per_endpoint": 2}, auth=auth)
    served: list[str] = []
    gw.gw.observers.append(lambda rec, _d: served.append(rec.request_id) if rec.status == 200 else None)
    ep = gw.gw.pool.endpoints("m")[0]
    blockers = []
    for i in range(2):
        blockers.append(asyncio.create_task(post(gw.url, body(), {**HOLD, "Authorization": "Bearer sk-erin"})))
        assert await wait_for(lambda n=i + 1: ep.in_flight == n)
    order = [("a1", "alice", {"n": 8, "max_tokens": 20}, HOLD), ("b1", "bob", {"max_tokens": 50}, {}),
             ("a2", "alice", {"max_tokens": 1}, {}), ("b2", "bob", {"max_tokens": 1}, {})]
    tasks = []
    for i, (rid, user, fields, fault) in enumerate(order):
        h = {"Authorization": f"Bearer {KEYS[user]}", "x-request-id": rid, **fault}
        tasks.append(asyncio.create_task(post(gw.url, chat_body(CHAT, ignore_eos=True, **fields), h)))
        assert await wait_for(lambda n=i + 1: len(queue(gw)) == n)
    await cancel(blockers[0])           # a1 goes first (the users tie; alice waited first), and runs on
    assert await wait_for(lambda: len(queue(gw)) == 3)
    assert queue(gw).counter(1, "alice") >= 2 * 8 * 20
    await cancel(blockers[1])
    results = await asyncio.gather(*tasks[1:])
    assert [st for st, _, _ in results] == [200] * 3
    assert served == ["b1", "b2", "a2"]
    await cancel(tasks[0])


async def test_a_model_a_reload_removed_leaves_the_admission_gauges(sims, gateway):
    """A reload that removes a model whose queue is empty takes its admission gauges off /metrics
    (queue depth, bytes and drain rate: a drain rate that still read 1 request/s said the gone model
    was served); the model kept has its own, and its counters stay as every model's do."""
    import msgspec

    from gateway.server.app import RELOAD_KEY

    kept, gone = await sims("vllm", "m"), await sims("vllm", "gone")
    gw = await gateway([model_block("m", "vllm", [kept.url]), model_block("gone", "vllm", [gone.url])],
                       admission={"enabled": True, "max_in_flight_per_endpoint": 4})
    client = openai_client(gw)
    for model in ("m", "gone"):
        await client.chat.completions.create(**body(model=model))
    gauges = ("switchyard_admission_queue_depth", "switchyard_admission_queue_bytes", "switchyard_admission_drain_rate")

    def series(page: str, model: str) -> list[str]:
        return [line for line in page.splitlines() if line.startswith(gauges) and f'model="{model}"' in line]

    assert series(await gw.metrics_text(), "gone")
    reloader = gw.runner.app[RELOAD_KEY]
    config = reloader.live.config
    assert reloader.reload("test", msgspec.structs.replace(
        config, models=[m for m in config.models if m.name == "m"])).result == "ok"
    page = await gw.metrics_text()
    assert series(page, "gone") == [] and len(series(page, "m")) == 5
    assert 'switchyard_requests_total{model="gone",status="200"' in page
    assert reloader.reload("test", config).result == "ok"          # back: admitted, its gauges again
    await client.chat.completions.create(**body(model="gone"))
    assert len(series(await gw.metrics_text(), "gone")) == 5
    await client.close()


async def test_a_background_response_holds_its_endpoint_until_it_ends_on_its_engine(sims, gateway):
    """A ``background: true`` response is answered ``queued`` at once and goes on on its engine: it
    is one of the gateway's requests on that endpoint until it ends there, so with
    ``max_in_flight_per_endpoint: 1`` the next request waits in the queue meanwhile, and goes once
    the gateway's poll finds the response ended (here, cancelled)."""
    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])], responses={"state": "engine"},
                       admission={"enabled": True, "max_in_flight_per_endpoint": 1, "initial_capacity": 8})
    client = openai_client(gw)
    bg = await client.responses.create(model="m", input="Tell me about switchyards.", max_output_tokens=100,
                                       background=True, extra_headers=HOLD)
    assert bg.status in ("queued", "in_progress")
    ep = gw.gw.pool.endpoints("m")[0]
    assert ep.in_flight == 1                 # going on on its engine after its answer
    after = asyncio.create_task(post(gw.url, body()))
    assert await wait_for(lambda: len(queue(gw)) == 1 or after.done())
    assert not after.done()
    assert (await client.responses.cancel(bg.id)).status == "cancelled"
    assert (await after)[0] == 200           # served once the poll found the response ended
    assert await wait_for(lambda: ep.in_flight == 0)
    assert gw.gw.admission._models["m"].granted == 0


@pytest.mark.parametrize("tenants", [False, True], ids=["anonymous", "user_with_limits"])
async def test_a_background_stream_its_client_left_holds_its_endpoint_until_it_ends_on_its_engine(
        sims, gateway, tenants):
    """A ``background: true`` stream whose client leaves goes on on its engine (vLLM does not cancel
    it): it stays one of the gateway's requests on that endpoint after its request settles, so with
    ``max_in_flight_per_endpoint: 1`` the next request waits in the queue until the gateway's poll
    finds the response ended (here, cancelled). So too for a user whose limits hold its concurrency
    slot meanwhile (the poll its settlement starts)."""
    sim = await sims("vllm", "m", itl_ms=5.0, enable_responses_store=True)
    blocks = {"auth": {"api_keys": [{"key": KEYS["alice"], "user": "alice"}]},
              "limits": {"users": {"alice": {"tpm": 1_000_000, "max_concurrent": 4}}}} if tenants else {}
    headers = {"Authorization": f"Bearer {KEYS['alice']}"} if tenants else {}
    gw = await gateway([model_block("m", "vllm", [sim.url])], responses={"state": "engine"},
                       admission={"enabled": True, "max_in_flight_per_endpoint": 1, "initial_capacity": 8}, **blocks)
    ended: list[int] = []
    gw.gw.observers.append(lambda rec, _d: ended.append(rec.status))
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/responses", headers=headers, json={"model": "m", "input": "Tell me about switchyards.",
                                                          "max_output_tokens": 5000, "background": True,
                                                          "stream": True}) as r:
            rid = None
            async for line in r.content:
                if line.startswith(b"data: ") and rid is None:
                    rid = orjson.loads(line[6:]).get("response", {}).get("id")
                if line.startswith(b"event: response.output_text.delta"):
                    break
            r.connection.transport.abort()           # gone; the engine goes on
    assert rid
    assert await wait_for(lambda: ended == [499])
    ep = gw.gw.pool.endpoints("m")[0]
    assert ep.in_flight == 1                 # going on on its engine after its client left
    after = asyncio.create_task(post(gw.url, body(), headers))
    assert await wait_for(lambda: len(queue(gw)) == 1 or after.done())
    assert not after.done()
    client = openai_client(gw, KEYS["alice"]) if tenants else openai_client(gw)
    assert (await client.responses.cancel(rid)).status == "cancelled"
    assert (await after)[0] == 200           # served once the poll found the response ended
    assert await wait_for(lambda: ep.in_flight == 0)
    assert gw.gw.admission._models["m"].granted == 0


async def _kv_events_gateway(sims, gateway, **admission):
    """A gateway routing one engine on its KV events, one request in flight an endpoint, with a long
    system prompt served once: the gateway, its KV index, that system message and the endpoint."""
    tok = str(TINY_DIR)
    sim = await sims("vllm", "m", tokenizer=tok, kv_events_port=0, kv_blocks=4096)
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url], "tokenizer": tok,
                         "strategy": "prefix-cache", "kv_events": {"enabled": True, "port": sim.engine.kv_events.port}}],
                       admission={"enabled": True, "max_in_flight_per_endpoint": 1, **admission})
    kv = gw.gw.routing.ctx.precise_index
    await until(lambda: kv.subscribers and sim.engine.kv_events.subscriptions >= 1)
    system = {"role": "system", "content": "You are a careful assistant. " + " ".join(f"rule {i} is kqz" for i in range(120))}
    assert (await post(gw.url, chat_body([system, {"role": "user", "content": "hi"}])))[0] == 200
    return gw, kv, system, gw.gw.pool.endpoints("m")[0]


async def test_a_request_whose_prompt_is_tokenized_off_the_loop_takes_its_room_as_it_routes(sims, gateway):
    """With KV-event routing a long prompt segment is tokenized in a thread before the request
    routes; admission lets a request go only when it will charge its endpoint in the same step, so
    one still tokenizing when another finds the room free is not counted through it: with
    ``max_in_flight_per_endpoint: 1`` the second of two requests waits in the queue."""
    gw, kv, system, ep = await _kv_events_gateway(sims, gateway)
    # the engine's blocks of it are indexed: a segment after them is worth tokenizing
    assert await wait_for(lambda: ep.in_flight == 0 and all(sub.st.emap for sub in kv.subscribers[ep]))
    gate = threading.Event()
    kv.executor.submit(gate.wait, 10)        # the tokenizer thread busy: a long segment waits for it
    try:
        long = [system, {"role": "user", "content": " ".join(f"word{i} zq" for i in range(400))}]
        first = asyncio.create_task(post(gw.url, chat_body(long), HOLD))
        assert await wait_for(lambda: kv.tokenizers["m"]._pending)
        second = asyncio.create_task(post(gw.url, body(), HOLD))
        assert await wait_for(lambda: ep.in_flight == 1 or len(queue(gw)) == 1)
    finally:
        gate.set()
    assert await wait_for(lambda: len(queue(gw)) == 1)
    assert ep.in_flight == 1
    await cancel(first)
    await cancel(second)
    assert await wait_for(lambda: ep.in_flight == 0 and len(queue(gw)) == 0)
    assert gw.gw.admission._models["m"].granted == 0


async def bound_to_a_busy_engine(sims, gateway, headers=None, followers=1, **admission):
    """Two engines, one request at a time on each; the engine that holds a Responses answer is kept
    busy (the hold returned), and a follow-up of that answer, which only that engine may serve,
    waits in the queue (sent with ``headers``; ``followers`` of them: the task that gathers them).
    The other engine is idle."""
    s1 = await sims("vllm", "m", enable_responses_store=True)
    s2 = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [s1.url, s2.url])], scrape={"enabled": False},
                       admission={"enabled": True, "max_in_flight_per_endpoint": 1, **admission})
    first = await post(gw.url, {"model": "m", "input": "hello there", "max_output_tokens": 4}, path="/v1/responses")
    eps = gw.gw.pool.endpoints("m")
    owner = next(ep for ep in eps if ep.name == first.headers["target-pod"])
    holds = [asyncio.create_task(post(gw.url, body(), HOLD))]
    assert await wait_for(lambda: sum(ep.in_flight for ep in eps) == 1)
    if owner.in_flight == 0:                 # it went to the other engine: the next goes to the owner
        holds.append(asyncio.create_task(post(gw.url, body(), HOLD)))
        assert await wait_for(lambda: owner.in_flight == 1)
        await cancel(holds.pop(0))
    assert await wait_for(lambda: sum(ep.in_flight for ep in eps) == 1 and owner.in_flight == 1)
    ups = [asyncio.create_task(post(gw.url, {"model": "m", "input": "and then?", "max_output_tokens": 4,
                                             "previous_response_id": first.json()["id"]}, headers,
                                    path="/v1/responses")) for _ in range(followers)]
    assert await wait_for(lambda: len(queue(gw)) == followers)
    return gw, owner, holds[0], ups[0] if followers == 1 else asyncio.gather(*ups)


async def test_a_request_bound_to_a_busy_engine_does_not_hold_the_queue_back_from_an_idle_one(sims, gateway):
    """A Responses follow-up whose previous response an engine holds can wait for that engine only;
    while it waits, a request any engine may serve goes to the idle one rather than waiting behind
    it (for as long as the busy engine stays busy, up to ``queue_timeout_s``)."""
    gw, owner, blocker, follow_up = await bound_to_a_busy_engine(sims, gateway)
    status, headers, _ = await asyncio.wait_for(post(gw.url, body()), 5)
    assert status == 200 and headers["target-pod"] != owner.name
    assert not follow_up.done() and len(queue(gw)) == 1
    await cancel(blocker)
    status, headers, _ = await follow_up
    assert status == 200 and headers["target-pod"] == owner.name
    assert gw.gw.admission._models["m"].granted == 0


@pytest.mark.parametrize("waiter", ["standard", "sheddable"])
async def test_a_full_queue_of_requests_bound_to_a_busy_engine_does_not_refuse_one_the_idle_engine_takes(
        sims, gateway, waiter):
    """The queue (``queue_max: 1``) holds a follow-up that only its busy engine may serve. A newcomer
    the idle engine has room for goes there at once: it needs no place in the queue, so it is not
    refused as ``queue_full`` (a waiter of its class) nor takes a lower class's place (a sheddable
    waiter is not displaced for it). The waiter is served when its engine frees."""
    gw, owner, blocker, follow_up = await bound_to_a_busy_engine(sims, gateway, {"x-priority": waiter},
                                                                 queue_max=1)
    status, headers, _ = await asyncio.wait_for(post(gw.url, body()), 5)
    assert status == 200 and headers["target-pod"] != owner.name
    assert not follow_up.done() and len(queue(gw)) == 1
    await cancel(blocker)
    status, headers, _ = await follow_up
    assert status == 200 and headers["target-pod"] == owner.name
    assert gw.gw.admission._models["m"].granted == 0


async def test_a_sheddable_request_the_idle_engine_takes_is_not_shed_for_a_waiter_bound_elsewhere(sims, gateway):
    """A standard follow-up waits for its busy engine. A sheddable newcomer could only wait behind it
    if it needed that engine; the idle one has room for it, so it is served there. Once no engine
    the waiter cannot use has room, a sheddable newcomer is shed while the waiter waits, as before."""
    gw, owner, blocker, follow_up = await bound_to_a_busy_engine(sims, gateway)
    sheddable = {"x-priority": "sheddable"}
    status, headers, _ = await asyncio.wait_for(post(gw.url, body(), sheddable), 5)
    assert status == 200 and headers["target-pod"] != owner.name
    other = asyncio.create_task(post(gw.url, body(), HOLD))     # the idle engine taken too
    assert await wait_for(lambda: all(ep.in_flight == 1 for ep in gw.gw.pool.endpoints("m")))
    status, _, raw = await post(gw.url, body(), sheddable)
    assert status == 429 and orjson.loads(raw)["error"]["code"] == "shed"
    assert not follow_up.done() and len(queue(gw)) == 1
    await cancel(blocker)
    assert (await follow_up)[0] == 200
    await cancel(other)
    text = await gw.metrics_text()
    assert 'switchyard_admission_shed_total{model="m",priority="sheddable",reason="shed"} 1.0' in text


async def test_a_request_the_idle_engine_takes_is_served_behind_many_waiters_bound_to_the_busy_one(sims, gateway):
    """More waiters than a pump passes over that hold distinct endpoints (``MAX_SKIPPED``, 32) wait
    for the same busy engine: those after the first hold no endpoint it does not, so they are passed
    over without counting, and a request any engine may serve goes to the idle one, whether it finds
    the room on arriving or waits behind them for it."""
    gw, owner, blocker, follow_ups = await bound_to_a_busy_engine(sims, gateway, followers=40, queue_timeout_s=5)
    other = next(ep for ep in gw.gw.pool.endpoints("m") if ep is not owner)
    status, headers, _ = await asyncio.wait_for(post(gw.url, body()), 4)      # finds the room on arriving
    assert status == 200 and headers["target-pod"] == other.name
    taker = asyncio.create_task(post(gw.url, body(), HOLD))                   # the idle engine taken
    assert await wait_for(lambda: other.in_flight == 1)
    waiting = asyncio.create_task(post(gw.url, body()))                       # waits behind them
    assert await wait_for(lambda: len(queue(gw)) == 41)
    await cancel(taker)
    status, headers, _ = await asyncio.wait_for(waiting, 4)
    assert status == 200 and headers["target-pod"] == other.name
    assert not follow_ups.done() and len(queue(gw)) == 40
    await cancel(blocker)
    assert [r[0] for r in await follow_ups] == [200] * 40
    assert gw.gw.admission._models["m"].granted == 0


async def test_a_background_response_whose_engine_is_known_down_gives_its_place_back_at_once(sims, gateway):
    """A ``background: true`` response holds a place on its endpoint while the gateway polls it on
    its engine. When the engine dies, the place is given back as soon as the health probes find it
    down, not once the poll gives up (10 failed polls, up to 2 s apart): what the place counted runs
    nowhere any more."""
    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])], responses={"state": "engine"},
                       admission={"enabled": True, "max_in_flight_per_endpoint": 1, "initial_capacity": 8})
    client = openai_client(gw)
    bg = await client.responses.create(model="m", input="Tell me about switchyards.", max_output_tokens=100,
                                       background=True, extra_headers=HOLD)
    assert bg.status in ("queued", "in_progress")
    ep = gw.gw.pool.endpoints("m")[0]
    assert ep.in_flight == 1
    await sim.close()
    assert await wait_for(lambda: not ep.healthy)
    assert ep.in_flight == 0                 # in the step the probe found it down
    assert gw.gw.admission._models["m"].granted == 0
    await client.close()


async def test_a_background_response_whose_engine_a_breaker_holds_out_gives_its_place_back_at_its_poll(sims, gateway):
    """Without health probes, a request refused by the dead engine opens its breaker
    (``health.passive``); the background response's next poll, unanswered, gives its place back
    rather than holding it until the poll gives up."""
    sims_ = {(s := await sims("vllm", "m", enable_responses_store=True)).url: s for _ in range(2)}
    gw = await gateway([model_block("m", "vllm", list(sims_), strategy="session-affinity")],
                       responses={"state": "engine"}, health={"enabled": False},
                       admission={"enabled": True, "max_in_flight_per_endpoint": 2, "initial_capacity": 8})
    status, headers, raw = await post(gw.url, {"model": "m", "input": "Tell me about switchyards.",
                                               "max_output_tokens": 100, "background": True},
                                      HOLD, path="/v1/responses")
    assert status == 200 and orjson.loads(raw)["status"] in ("queued", "in_progress")
    owner = next(ep for ep in gw.gw.pool.endpoints("m") if ep.name == headers["target-pod"])
    assert owner.in_flight == 1
    await sims_[owner.url].close()
    # sent to the dead engine (its session's), refused: its breaker opens, and the retry goes on
    assert (await post(gw.url, body(), {"x-session-id": headers["x-session-id"]}))[0] == 200
    assert owner.ejected and owner.healthy
    assert await wait_for(lambda: owner.in_flight == 0)    # a poll comes within 2 s; giving up takes ten


async def test_a_request_admission_sheds_is_not_tokenized_for_the_kv_events_match(sims, gateway):
    """With KV-event routing a long prompt segment is tokenized in a thread before admission; a
    request admission sheds whatever its tokens (a sheddable one while a standard one waits) is shed
    first, costing the tokenizer thread nothing, under the overload that sheds it."""
    gw, kv, system, ep = await _kv_events_gateway(sims, gateway)
    assert await wait_for(lambda: ep.in_flight == 0 and all(sub.st.emap for sub in kv.subscribers[ep]))
    tokenizer = kv.tokenizers["m"]
    long = [system, {"role": "user", "content": " ".join(f"word{i} zq" for i in range(400))}]
    blocker = await hold(gw)
    waiter = asyncio.create_task(post(gw.url, body()))
    assert await wait_for(lambda: len(queue(gw)) == 1)
    before = tokenizer.segments_off_loop
    status, _, raw = await post(gw.url, chat_body(long), {"x-priority": "sheddable"})
    assert status == 429 and orjson.loads(raw)["error"]["code"] == "shed"
    assert tokenizer.segments_off_loop == before
    await cancel(blocker)
    assert (await waiter)[0] == 200
    assert (await post(gw.url, chat_body(long), {"x-priority": "sheddable"}))[0] == 200     # let in: tokenized
    assert tokenizer.segments_off_loop > before


@pytest.mark.parametrize("bound", [{"queue_max": 0}, {"queue_max_bytes": 1000}])
async def test_a_request_the_empty_queue_cannot_take_is_not_tokenized_for_the_kv_events_match(sims, gateway, bound):
    """With no queue (``queue_max: 0``), or a body larger than ``queue_max_bytes``, a request that
    finds no room is refused ``queue_full`` though nobody waits: it is refused before its long
    prompt segment is tokenized for the KV events' match, as one shed behind waiters is."""
    gw, kv, system, ep = await _kv_events_gateway(sims, gateway, **bound)
    assert await wait_for(lambda: ep.in_flight == 0 and all(sub.st.emap for sub in kv.subscribers[ep]))
    tokenizer = kv.tokenizers["m"]
    long = [system, {"role": "user", "content": " ".join(f"word{i} zq" for i in range(400))}]
    blocker = await hold(gw)
    before = tokenizer.segments_off_loop
    status, _, raw = await post(gw.url, chat_body(long))
    assert status == 429 and orjson.loads(raw)["error"]["code"] == "queue_full"
    assert tokenizer.segments_off_loop == before and not len(queue(gw))
    await cancel(blocker)
    assert (await post(gw.url, chat_body(long)))[0] == 200      # room: tokenized, served
    assert tokenizer.segments_off_loop > before


async def test_a_reload_that_removes_the_model_answers_its_queue_as_a_newcomer_is(sims, gateway):
    """A reload that removes a model while requests for it wait in its queue answers them as it
    answers a request sent after the reload: 404 ``model_not_found`` (Anthropic's shape on
    /v1/messages), not a 503 that tells the client to retry a model that is no longer served."""
    import msgspec

    from gateway.server.app import RELOAD_KEY

    sim, other = await sims("vllm", "m"), await sims("vllm", "n")
    gw = await gateway([model_block("m", "vllm", [sim.url]), model_block("n", "vllm", [other.url])],
                       admission={"enabled": True, "max_in_flight_per_endpoint": 1})
    reloader = gw.runner.app[RELOAD_KEY]
    config = reloader.live.config
    blocker = await hold(gw)
    chat = asyncio.create_task(post(gw.url, body()))
    messages = asyncio.create_task(post(gw.url, {"model": "m", "messages": CHAT, "max_tokens": 4},
                                        path="/v1/messages"))
    assert await wait_for(lambda: len(queue(gw)) == 2)
    without_m = msgspec.structs.replace(config, models=[m for m in config.models if m.name != "m"])
    assert reloader.reload("test", without_m).result == "ok"
    after = await post(gw.url, body())
    assert after.status == 404 and after.json()["error"]["code"] == "model_not_found", after.body[:300]
    queued = await asyncio.wait_for(chat, 20)
    assert queued.status == 404, queued.body[:300]
    assert queued.json()["error"] == after.json()["error"]
    queued = await asyncio.wait_for(messages, 20)
    assert queued.status == 404, queued.body[:300]
    err = queued.json()
    assert err["type"] == "error" and err["error"]["type"] == "not_found_error", err
    await cancel(blocker)

