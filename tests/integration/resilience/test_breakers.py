"""Breakers and retries on loopback: a sick engine ejected and brought back, backpressure and
client errors left alone, the retry budget, the ejection cap, and P/D pairs that skip an open side."""

from __future__ import annotations

import asyncio
import contextlib
from functools import partial

import aiohttp
import anthropic
import openai
import orjson
import pytest
from aiohttp import web

from tests.support.factories import model_block
from tests.support.fake_engine import fake_engine
from tests.support.http import anthropic_client, chat_body, openai_client, post, sim_state, sse_events
from tests.support.metrics import series
from tests.support.waiting import until, wait_for

CHAT = [{"role": "user", "content": "hello there"}]
body = partial(chat_body, CHAT, stream=False, max_tokens=6)
FAST_BREAKER = {"consecutive_faults": 2, "base_ejection_s": 0.3, "half_open_trials": 1, "success_threshold": 1,
                "max_ejection_percent": 50}


async def sim_config(url, **cfg):
    async with aiohttp.ClientSession() as s, s.post(url + "/_sim/config", json=cfg) as r:
        assert r.status == 200


def state_of(text: str, ep_url: str) -> float:
    addr = ep_url.split("//")[1]
    return next(v for k, v in series(text, "switchyard_breaker_state").items() if f'endpoint="{addr}"' in k)


async def test_sick_engine_is_ejected_retried_around_and_comes_back(sims, gateway):
    good = await sims("vllm", "m")
    sick = await sims("vllm", "m", fault="status=500")
    gw = await gateway([model_block("m", "vllm", [sick.url, good.url])], routing={"strategy": "round-robin"},
                       health={"interval_s": 60}, breaker={**FAST_BREAKER, "base_ejection_s": 2})
    client = openai_client(gw)
    retried = 0                         # (the ejection outlasts the requests below on a slow machine)
    for _ in range(6):                  # every client sees a 200: the sick engine's 500s are retried
        raw = await client.chat.completions.with_raw_response.create(**body())
        assert raw.http_response.status_code == 200
        assert raw.headers["target-pod"] == good.url.split("//")[1]
        retried += int(raw.headers.get("x-retries", "0"))
    assert 1 <= retried <= 2            # until two faults in a row opened the sick one's breaker
    text = await gw.metrics_text()
    assert state_of(text, sick.url) == 1 and state_of(text, good.url) == 0
    assert any('from_state="closed"' in k and 'to_state="open"' in k
               for k in series(text, "switchyard_breaker_transitions_total"))
    assert any('outcome="fault"' in k for k in series(text, "switchyard_upstream_outcomes_total"))
    started = (await sim_state(sick.url))["counts"]["started"]

    await sim_config(sick.url, fault="none")          # the engine heals

    async def back() -> bool:
        await client.chat.completions.create(**body())
        return state_of(await gw.metrics_text(), sick.url) == 0
    assert await wait_for(back, timeout=15)            # half-open after 2 s, one trial success closes
    for _ in range(4):
        await client.chat.completions.create(**body())
    assert (await sim_state(sick.url))["counts"]["started"] >= started + 2   # it serves its share again
    await client.close()


async def test_broken_streams_count_as_faults(sims, gateway):
    good = await sims("vllm", "m")
    sick = await sims("vllm", "m", fault="drop_after=2")
    gw = await gateway([model_block("m", "vllm", [sick.url, good.url])], routing={"strategy": "round-robin"},
                       health={"interval_s": 60}, breaker={**FAST_BREAKER, "base_ejection_s": 30})
    client = openai_client(gw)
    broken = 0                          # (the ejection outlasts the test, however slow the machine)
    for _ in range(8):
        try:
            stream = await client.chat.completions.create(**body(stream=True, max_tokens=8))
            async for _ in stream:
                pass
        except openai.APIError:
            broken += 1                 # after its first bytes a stream is not retried
    assert broken == 2                  # two broken streams, then the breaker kept the rest away
    assert state_of(await gw.metrics_text(), sick.url) == 1
    await client.close()


async def test_backpressure_is_retried_where_there_is_headroom_and_never_opens(sims, gateway):
    good = await sims("vllm", "m")
    busy = await sims("vllm", "m", fault="status=503")
    gw = await gateway([model_block("m", "vllm", [busy.url, good.url])], routing={"strategy": "round-robin"},
                       health={"interval_s": 60}, breaker={"consecutive_faults": 1})
    await wait_for(lambda: all(ep.metrics is not None for ep in gw.gw.pool.endpoints()))
    for _ in range(6):
        st, hdrs, _ = await post(gw.url, body())
        assert st == 200
    text = await gw.metrics_text()
    assert state_of(text, busy.url) == 0                   # 503 is "busy", not "sick"
    assert any('outcome="backpressure"' in k for k in series(text, "switchyard_upstream_outcomes_total"))
    assert series(text, "switchyard_retries_total")['model="m"'] >= 3      # each time the busy one was chosen

    # with retries of backpressure off, the client gets the engine's 503 and its Retry-After
    gw2 = await gateway([model_block("m", "vllm", [busy.url])], health={"interval_s": 60},
                        retry={"on_backpressure": False})
    st, hdrs, _ = await post(gw2.url, body())
    assert st == 503 and "x-retries" not in hdrs
    assert hdrs["Retry-After"] == "5"           # the engine named none: the gateway's, as on its own 503s
    st, hdrs, _ = await post(gw2.url, body(), {"x-sim-fault": "status=429"})
    assert st == 429 and hdrs["Retry-After"] == "1"
    # an Anthropic-compatible engine's 529, its overload, is busy as its 503 is: relayed, not charged
    st, hdrs, _ = await post(gw2.url, body(), {"x-sim-fault": "status=529"})
    assert st == 529 and "x-retries" not in hdrs and hdrs["Retry-After"] == "5"
    outcomes = series(await gw2.metrics_text(), "switchyard_upstream_outcomes_total")
    assert outcomes and not [k for k in outcomes if 'outcome="fault"' in k], outcomes


async def test_client_errors_are_neither_counted_nor_retried(sims, gateway):
    a = await sims("vllm", "m")
    b = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [a.url, b.url])], health={"interval_s": 60},
                       breaker={"consecutive_faults": 1})
    for _ in range(4):
        st, hdrs, _ = await post(gw.url, body(), {"x-sim-fault": "status=400"})
        assert st == 400 and "x-retries" not in hdrs
    text = await gw.metrics_text()
    assert set(series(text, "switchyard_breaker_state").values()) == {0.0}
    assert not series(text, "switchyard_retries_total")


async def test_an_engines_501_reaches_the_client_as_it_came_uncounted_and_unretried(sims, gateway):
    """A 501 says the engine does not implement what the request asks, not that it is sick: the
    client gets that answer, status and body, as the engine gave it; the endpoint's breaker does
    not count it and the request is not sent elsewhere."""
    lacking = await sims("vllm", "m", fault="status=501")
    good = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [lacking.url, good.url])], routing={"strategy": "round-robin"},
                       health={"interval_s": 60}, breaker={"consecutive_faults": 1, "max_ejection_percent": 100})
    engine = await post(lacking.url, body())
    assert engine.status == 501
    client = openai_client(gw)
    answers = []
    for i in range(6):
        try:
            raw = await client.chat.completions.with_raw_response.create(**body(stream=i % 2 == 1))
            answers.append((raw.http_response.status_code, raw.headers["target-pod"], None))
        except openai.APIStatusError as e:
            answers.append((e.status_code, e.response.headers["target-pod"], e.response))
    await client.close()
    refused = [a for a in answers if a[0] == 501]
    assert len(refused) == 3 and all(pod == lacking.url.split("//")[1] for _, pod, _ in refused), answers
    assert all(st == 200 for st, _, _ in answers if st != 501)
    for _, _, resp in refused:
        # the engine's error, its numeric code written as OpenAI's error object has it, a string
        assert resp.json() == {"error": {**engine.json()["error"], "code": "501"}}
        assert "x-retries" not in resp.headers and "Retry-After" not in resp.headers
    text = await gw.metrics_text()
    assert set(series(text, "switchyard_breaker_state").values()) == {0.0}
    assert not series(text, "switchyard_retries_total")
    outcomes = series(text, "switchyard_upstream_outcomes_total")
    assert not any('outcome="fault"' in k for k in outcomes), outcomes
    assert len(gw.gw.pool.ready("m")) == 2


async def test_retry_budget_stops_retries_amplifying_an_outage(sims, gateway):
    a = await sims("vllm", "m")
    b = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [a.url, b.url])], health={"interval_s": 60},
                       breaker={"enabled": False},
                       retry={"budget_min": 2, "budget_percent": 10, "max_retries": 1})
    retries = []
    for _ in range(10):                 # both engines fail: the budget lets 2 + 10 % of 10 = 3 through
        st, hdrs, _ = await post(gw.url, body(), {"x-sim-fault": "status=500"})
        assert st == 500
        retries.append(int(hdrs.get("x-retries", "0")))
    assert retries[:2] == [1, 1] and sum(retries) == 3
    text = await gw.metrics_text()
    assert series(text, "switchyard_retries_denied_total") == {'model="m",reason="budget"': 7.0,
                                                                'model="m",reason="max_retries"': 3.0}
    assert list(series(text, "switchyard_retry_causes_total").values()) == [3.0]


async def test_ejection_cap_never_takes_out_the_pool(sims, gateway):
    s = [await sims("vllm", "m", fault="status=500") for _ in range(4)]
    gw = await gateway([model_block("m", "vllm", [x.url for x in s])], routing={"strategy": "round-robin"},
                       health={"interval_s": 60}, breaker={"consecutive_faults": 1}, retry={"enabled": False})
    for _ in range(12):
        st, _, _ = await post(gw.url, body())
        assert st == 500
    text = await gw.metrics_text()
    states = series(text, "switchyard_breaker_state")
    assert sorted(states.values()) == [0, 0, 0, 1]        # 10 % of 4, but always one (Envoy's rule)
    assert series(text, "switchyard_breaker_ejections_capped_total")['model="m"'] >= 3
    assert len(gw.gw.pool.ready("m")) == 3


@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_pd_pair_choice_skips_an_open_endpoint_on_either_side(sims, gateway, side):
    good = {r: await sims("vllm", "m", role=r) for r in ("prefill", "decode")}
    sick = await sims("vllm", "m", role=side, fault="status=500")
    rs = {"name": "rs-1", "prefill": [good["prefill"].url], "decode": [good["decode"].url]}
    rs[side] = [sick.url, good[side].url]
    gw = await gateway([{"name": "m", "engine": "vllm", "rolesets": [rs]}], health={"interval_s": 60},
                       breaker={"consecutive_faults": 2, "max_ejection_percent": 50})
    ep = next(e for e in gw.gw.pool.endpoints("m") if e.url == sick.url)
    for _ in range(40):     # two 500s in a row open the sick one's breaker: pd picks at random between
        await post(gw.url, body())      # equal endpoints, so how many tries that takes is chance
        if not ep.ready:
            break
    assert state_of(await gw.metrics_text(), sick.url) == 1
    started = (await sim_state(sick.url))["counts"]["started"]
    for _ in range(6):
        st, hdrs, _ = await post(gw.url, body())
        assert st == 200
        header = "prefill-target-pod" if side == "prefill" else "target-pod"
        assert hdrs[header] == good[side].url.split("//")[1]
    assert (await sim_state(sick.url))["counts"]["started"] == started


@pytest.mark.parametrize(("engine", "after"), [("vllm", 0), ("vllm", 3), ("sglang", 3)])
async def test_an_in_stream_error_with_code_501_is_not_the_endpoints_fault(sims, gateway, engine, after):
    """An engine's error event with code 501, before the first token (a vLLM stream's head goes out
    at once) or mid-stream, says what the HTTP 501 says: the engine does not implement what the
    request asks. The client gets the event as the engine sent it (its code as its string); the endpoint's breaker is not
    charged (one fault would open it) and nothing is retried elsewhere."""
    lacking = await sims(engine, "m", fault=f"error_after={after};error_code=501")
    good = await sims(engine, "m")
    gw = await gateway([model_block("m", engine, [lacking.url, good.url])], routing={"strategy": "round-robin"},
                       health={"interval_s": 60}, breaker={"consecutive_faults": 1, "max_ejection_percent": 100})
    errors = []
    for _ in range(6):
        st, hdrs, raw = await post(gw.url, body(stream=True))
        assert st == 200 and "x-retries" not in hdrs
        errors += [e["error"] for e in sse_events(raw) if isinstance(e, dict) and "error" in e]
    assert len(errors) == 3 and all(e["code"] == "501" for e in errors), errors
    text = await gw.metrics_text()
    assert state_of(text, lacking.url) == 0 and set(series(text, "switchyard_breaker_state").values()) == {0.0}
    assert not series(text, "switchyard_retries_total")
    outcomes = series(text, "switchyard_upstream_outcomes_total")
    addr = lacking.url.split("//")[1]
    assert {k: v for k, v in outcomes.items() if f'endpoint="{addr}"' in k} == \
        {f'endpoint="{addr}",model="m",outcome="client_error"': 3.0}, outcomes
    assert len(gw.gw.pool.ready("m")) == 2


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_an_in_stream_error_whose_code_is_the_string_501_is_not_the_endpoints_fault(sims, gateway, engine):
    """An engine that writes its error event's code as a string, ``"code": "501"``, says the same
    as one that writes the number: the endpoint's breaker (one fault would open it) is not charged."""
    lacking = await sims(engine, "m", fault='error_after=3;error_code="501"')
    good = await sims(engine, "m")
    gw = await gateway([model_block("m", engine, [lacking.url, good.url])], routing={"strategy": "round-robin"},
                       health={"interval_s": 60}, breaker={"consecutive_faults": 1, "max_ejection_percent": 100})
    errors = []
    for _ in range(4):
        st, hdrs, raw = await post(gw.url, body(stream=True))
        assert st == 200 and "x-retries" not in hdrs
        errors += [e["error"] for e in sse_events(raw) if isinstance(e, dict) and "error" in e]
    assert [e["code"] for e in errors] == ["501", "501"], errors       # as the engine sent it
    text = await gw.metrics_text()
    assert state_of(text, lacking.url) == 0 and set(series(text, "switchyard_breaker_state").values()) == {0.0}
    addr = lacking.url.split("//")[1]
    outcomes = series(text, "switchyard_upstream_outcomes_total")
    assert {k: v for k, v in outcomes.items() if f'endpoint="{addr}"' in k} == \
        {f'endpoint="{addr}",model="m",outcome="client_error"': 2.0}, outcomes


async def test_an_in_stream_error_with_another_code_is_still_a_fault(sims, gateway):
    sick = await sims("vllm", "m", fault="error_after=3;error_code=500")
    good = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sick.url, good.url])], routing={"strategy": "round-robin"},
                       health={"interval_s": 60}, breaker={"consecutive_faults": 1, "max_ejection_percent": 100})
    for _ in range(4):
        st, _, raw = await post(gw.url, body(stream=True))
        assert st == 200
    text = await gw.metrics_text()
    assert state_of(text, sick.url) == 1
    addr = sick.url.split("//")[1]
    outcomes = series(text, "switchyard_upstream_outcomes_total")
    assert outcomes.get(f'endpoint="{addr}",model="m",outcome="fault"') == 1, outcomes


async def test_a_migrating_stream_is_not_continued_after_an_error_with_code_501(sims, gateway):
    """With mid-stream continuation on, a 501 error event is not a failed leg to continue elsewhere:
    the client gets the engine's event, and the endpoint is not charged."""
    lacking = await sims("vllm", "m", fault="error_after=3;error_code=501")
    good = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [lacking.url, good.url], strategy="round-robin", migration_limit=2)],
                       health={"interval_s": 60}, breaker={"consecutive_faults": 1, "max_ejection_percent": 100})
    errors = []
    for _ in range(4):
        st, _, raw = await post(gw.url, body(stream=True))
        assert st == 200
        errors += [e["error"] for e in sse_events(raw) if isinstance(e, dict) and "error" in e]
    assert len(errors) == 2 and all(e["code"] == "501" for e in errors), errors
    assert (await sim_state(good.url))["counts"]["started"] == 2      # its own share, no continuation
    text = await gw.metrics_text()
    assert not series(text, "switchyard_migrations_total")
    assert set(series(text, "switchyard_breaker_state").values()) == {0.0}
    outcomes = series(text, "switchyard_upstream_outcomes_total")
    assert not any('outcome="fault"' in k for k in outcomes), outcomes


def _frame(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) + b"\n\n"


def _code(request: web.Request) -> int | str:
    raw = request.headers["x-code"]
    return raw.strip('"') if raw.startswith('"') else int(raw)


async def _messages_engine_that_lacks(request: web.Request) -> web.StreamResponse:
    """An engine's /v1/messages stream that opens, sends a token, then an error event whose code is
    the request's ``x-code`` (a number, or a string when quoted)."""
    await request.read()
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    for name, data in (
            ("message_start", {"message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
                                           "model": "m", "stop_reason": None, "stop_sequence": None,
                                           "usage": {"input_tokens": 5, "output_tokens": 0}}}),
            ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Hi"}}),
            ("error", {"error": {"type": "api_error", "message": "not implemented here", "code": _code(request)}})):
        await out.write(_frame(name, data))
    await out.write_eof()
    return out


async def _responses_engine_that_lacks(request: web.Request) -> web.StreamResponse:
    """An engine's /v1/responses stream that opens, sends a token, then an ``error`` event whose code
    is the request's ``x-code``; with ``x-failed``, a ``response.failed`` after it (its error named
    by OpenAI's ``server_error``)."""
    await request.read()
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    resp = {"id": "resp_1", "object": "response", "created_at": 1, "model": "m", "status": "in_progress",
            "output": []}
    events = [("response.created", {"response": resp}),
              ("response.output_text.delta", {"output_index": 0, "content_index": 0, "item_id": "msg_1",
                                              "delta": "Hi"}),
              ("error", {"code": _code(request), "message": "not implemented here", "param": None})]
    if "x-failed" in request.headers:
        events.append(("response.failed", {"response": {**resp, "status": "failed", "error": {
            "code": "server_error", "message": "not implemented here"}}}))
    for seq, (name, data) in enumerate(events):
        await out.write(_frame(name, {"sequence_number": seq, **data}))
    await out.write_eof()
    return out


def _outcomes_of(text: str, url: str) -> dict[str, float]:
    addr = url.split("//")[1]
    return {k.rsplit("outcome=", 1)[1].strip('"'): v
            for k, v in series(text, "switchyard_upstream_outcomes_total").items() if f'endpoint="{addr}"' in k}


@pytest.mark.parametrize(("code", "outcome"), [("501", "client_error"), ('"501"', "client_error"),
                                               ("500", "fault")])
async def test_a_messages_streams_error_event_with_code_501_is_not_the_endpoints_fault(gateway, code, outcome):
    """/v1/messages streams pass through the engine's own (not translated from chat) and are
    classified as chat streams are: an ``event: error`` whose error has code 501 (or "501") is the
    engine's 501, its breaker not charged (one fault would open it); another code is a fault."""
    async with fake_engine(_messages_engine_that_lacks, paths=("/v1/messages",)) as url:
        gw = await gateway([model_block("m", "vllm", [url])], health={"interval_s": 60},
                           breaker={"consecutive_faults": 1, "max_ejection_percent": 100})
        c = anthropic_client(gw)
        for _ in range(2):
            with pytest.raises(anthropic.APIStatusError) as ei:
                async with c.messages.stream(model="m", max_tokens=8, extra_headers={"x-code": code},
                                             messages=[{"role": "user", "content": "hi"}]) as stream:
                    async for _ev in stream:
                        pass
            assert ei.value.body["error"]["message"] == "not implemented here"
            if outcome == "fault":
                break
        text = await gw.metrics_text()
        assert _outcomes_of(text, url) == {outcome: 2.0 if outcome == "client_error" else 1.0}
        if outcome == "client_error":
            assert state_of(text, url) == 0


@pytest.mark.parametrize(("code", "failed", "outcome"), [
    ("501", False, "client_error"), ('"501"', False, "client_error"), ("501", True, "client_error"),
    ("500", False, "fault"), ("500", True, "fault")])
async def test_a_responses_streams_error_event_with_code_501_is_not_the_endpoints_fault(
        gateway, code, failed, outcome):
    """/v1/responses streams pass through the engine's own and are classified as chat streams are:
    an ``error`` event with code 501 (or "501") is the engine's 501, its breaker not charged, also
    when a ``response.failed`` (whose error only names ``server_error``) follows it."""
    async with fake_engine(_responses_engine_that_lacks, paths=("/v1/responses",)) as url:
        gw = await gateway([model_block("m", "vllm", [url])], health={"interval_s": 60},
                           breaker={"consecutive_faults": 1, "max_ejection_percent": 100})
        c = openai_client(gw)
        headers = {"x-code": code, **({"x-failed": "1"} if failed else {})}
        for _ in range(2):
            events = [ev async for ev in await c.responses.create(model="m", input="hi", stream=True,
                                                                  extra_headers=headers)]
            assert "error" in [ev.type for ev in events]
            if outcome == "fault":
                break
        text = await gw.metrics_text()
        assert _outcomes_of(text, url) == {outcome: 2.0 if outcome == "client_error" else 1.0}
        if outcome == "client_error":
            assert state_of(text, url) == 0


@pytest.mark.parametrize(("engine", "stream"), [("vllm", False), ("vllm", True), ("sglang", False), ("sglang", True)])
async def test_a_trial_whose_client_leaves_before_the_engine_answers_gives_its_slot_back(sims, gateway, engine, stream):
    """A half-open breaker's one trial request, which the engine holds, is given up by its client
    before any answer: a cancel says nothing of the engine, and the slot is free for the next trial
    at once; it was held until ``base_ejection_s`` (a minute here) had passed, the endpoint out of
    routing meanwhile as if its trial were still on its way."""
    good = await sims(engine, "m")
    sick = await sims(engine, "m", fault="status=500")
    gw = await gateway([model_block("m", engine, [sick.url, good.url])], routing={"strategy": "round-robin"},
                       health={"interval_s": 0.1},
                       breaker={**FAST_BREAKER, "consecutive_faults": 1, "base_ejection_s": 60})
    ep = next(e for e in gw.gw.pool.endpoints("m") if e.url == sick.url)
    assert (await post(gw.url, body()))[0] == 200         # its 500 retried; the breaker opens
    assert state_of(await gw.metrics_text(), sick.url) == 1
    await sim_config(sick.url, dead=True)                 # the probes find it down, then back:
    await wait_for(lambda: not ep.healthy)
    await sim_config(sick.url, dead=False, fault="hang=inf")
    assert await wait_for(lambda: ep.ready, timeout=10)   # half-open, its trials at once
    seen = await _chats(sick.url)
    while True:         # round-robin: the first or the second request is the trial
        trial = asyncio.create_task(post(gw.url, body(stream=stream)))
        await until(lambda t=trial: t.done() or _chats_since(sick.url, seen))
        if not trial.done():
            break
        assert trial.result()[0] == 200
    assert not ep.ready                                   # the trial took the one slot
    trial.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await trial
    assert await wait_for(lambda: ep.ready, timeout=10)   # its slot back: the next trial may go
    assert state_of(await gw.metrics_text(), sick.url) == 2
    await sim_config(sick.url, fault="none")

    async def closed() -> bool:
        assert (await post(gw.url, body(stream=stream)))[0] == 200
        return state_of(await gw.metrics_text(), sick.url) == 0
    assert await wait_for(closed, timeout=10)


async def _held_then_cancelled(gw, ep, fault: str, held) -> bool:
    """A request sent with the simulator's ``fault`` (its prefill held), cancelled once ``held()``:
    whether the half-open ``ep`` took it (it was out of routing meanwhile)."""
    req = asyncio.create_task(post(gw.url, body(), headers={"x-sim-fault": fault}))
    await until(held)
    took = not ep.ready
    req.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await req
    return took


async def _chats(url: str) -> int:
    return sum(1 for e in (await sim_state(url))["received"] if e["path"].endswith("/chat/completions"))


async def _chats_since(url: str, seen: int) -> bool:
    return await _chats(url) > seen


@pytest.mark.parametrize("end", ["prefill_500", "client_left_during_prefill"])
async def test_a_pd_requests_half_open_decode_whose_prefill_never_handed_over_gives_its_trial_slot_back(
        sims, gateway, end):
    """vLLM P/D: a request whose pair names a half-open decode (its one trial slot) ends before that
    decode is asked anything: its prefill answers a 500, or its client leaves while the prefill runs.
    Nothing is learnt of the decode, and its slot is free for the next trial at once; it was held
    until ``base_ejection_s`` (a minute here) had passed, the decode out of every pair meanwhile."""
    p = await sims("vllm", "m", role="prefill")
    good = await sims("vllm", "m", role="decode")
    sick = await sims("vllm", "m", role="decode", fault="status=500")
    rs = {"name": "rs-1", "prefill": [p.url], "decode": [sick.url, good.url]}
    gw = await gateway([{"name": "m", "engine": "vllm", "rolesets": [rs]}], health={"interval_s": 0.1},
                       routing={"strategy": "round-robin"},
                       breaker={**FAST_BREAKER, "consecutive_faults": 1, "base_ejection_s": 60})
    ep = next(e for e in gw.gw.pool.endpoints("m") if e.url == sick.url)
    assert await wait_for(partial(_until_unready, gw, ep), timeout=10)      # its 500 ejects it
    await sim_config(sick.url, dead=True)                 # the probes find it down, then back:
    await wait_for(lambda: not ep.healthy)
    await sim_config(sick.url, dead=False, fault="none")
    assert await wait_for(lambda: ep.ready, timeout=10)   # half-open, its trials at once
    # the healthy decode down: the half-open one is the only decode a pair can name (pd picks at
    # random among equal decodes)
    other = next(e for e in gw.gw.pool.endpoints("m") if e.url == good.url)
    await sim_config(good.url, dead=True)
    assert await wait_for(lambda: not other.healthy, timeout=10)
    fault = "prefill.status=500" if end == "prefill_500" else "prefill.hang=inf"
    sick_name = sick.url.split("//")[1]
    for _ in range(4):
        if end == "prefill_500":
            st, hdrs, _ = await post(gw.url, body(), headers={"x-sim-fault": fault})
            assert st == 502
            if hdrs["target-pod"] == sick_name:
                break
        else:
            seen = await _chats(p.url)
            if await _held_then_cancelled(gw, ep, fault, lambda s=seen: _chats_since(p.url, s)):  # the prefill holds it
                break
    else:
        raise AssertionError("no pair named the half-open decode")
    assert await wait_for(lambda: ep.ready, timeout=10)   # its slot back: the next trial may go
    assert state_of(await gw.metrics_text(), sick.url) == 2

    async def closed() -> bool:
        assert (await post(gw.url, body()))[0] == 200
        return state_of(await gw.metrics_text(), sick.url) == 0
    assert await wait_for(closed, timeout=10)


async def _until_unready(gw, ep) -> bool:
    assert (await post(gw.url, body()))[0] == 200
    return not ep.ready


async def test_a_half_open_prefill_whose_client_leaves_while_it_runs_gives_its_trial_slot_back(sims, gateway):
    """vLLM P/D: the client of a request whose half-open prefill (its one trial slot) holds it
    leaves: nothing is learnt of the prefill, and its slot is free for the next trial at once."""
    sick = await sims("vllm", "m", role="prefill", fault="status=500")
    good = await sims("vllm", "m", role="prefill")
    d = await sims("vllm", "m", role="decode")
    rs = {"name": "rs-1", "prefill": [sick.url, good.url], "decode": [d.url]}
    gw = await gateway([{"name": "m", "engine": "vllm", "rolesets": [rs]}], health={"interval_s": 0.1},
                       routing={"strategy": "round-robin"}, pd={"prefill_score_policy": "least_request"},
                       breaker={**FAST_BREAKER, "consecutive_faults": 1, "base_ejection_s": 60})
    ep = next(e for e in gw.gw.pool.endpoints("m") if e.url == sick.url)
    for _ in range(40):     # the sick prefill's 500 (not retried) ejects it: pd picks at random
        await post(gw.url, body())      # between the idle prefills (least_request: no prefix affinity)
        if not ep.ready:
            break
    assert not ep.ready
    await sim_config(sick.url, dead=True)
    await wait_for(lambda: not ep.healthy)
    await sim_config(sick.url, dead=False, fault="none")
    assert await wait_for(lambda: ep.ready, timeout=10)   # half-open, its trials at once
    # the healthy prefill down: the half-open one is the only prefill a pair can name
    other = next(e for e in gw.gw.pool.endpoints("m") if e.url == good.url)
    await sim_config(good.url, dead=True)
    assert await wait_for(lambda: not other.healthy, timeout=10)
    for _ in range(4):
        seen = await _chats(sick.url) + await _chats(good.url)
        if await _held_then_cancelled(gw, ep, "prefill.hang=inf",
                                      lambda s=seen: _prefills_since([sick.url, good.url], s)):   # a prefill holds it
            break
    else:
        raise AssertionError("no pair named the half-open prefill")
    assert await wait_for(lambda: ep.ready, timeout=10)   # its slot back
    assert state_of(await gw.metrics_text(), sick.url) == 2


async def _prefills_since(urls: list[str], seen: int) -> bool:
    return sum([await _chats(u) for u in urls]) > seen
