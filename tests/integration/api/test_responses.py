"""The Responses API through the gateway, driven by the real openai SDK against simulated vLLM and
SGLang engines: stream and not, accounting, affinity of previous_response_id (one gateway, two
replicas on one Redis), owner-gone errors, failures after headers, gateway-held history."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from enginesim import SimConfig, start_sim
from tests.conftest import FAST_SIM
from tests.support.edge import assert_openai_error, exchange
from tests.support.factories import model_block
from tests.support.fake_engine import cutting_stream, fake_engine
from tests.support.http import openai_client, sim_state
from tests.support.metrics import metric
from tests.support.tenancy import ALICE, BOB, KEYS
from tests.support.waiting import process_stopped, until, wait_for


def posts(state: dict) -> list[dict]:
    return [r for r in state["received"] if r["method"] == "POST" and r["path"] == "/v1/responses"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_create_and_stream_with_the_sdk_are_accounted(sims, gateway, engine):
    sim = await sims(engine, "m", enable_responses_store=True)
    gw = await gateway([model_block("m", engine, [sim.url])])
    c = openai_client(gw)
    r = await c.responses.create(model="m", instructions="Be brief.", input="Hello there", max_output_tokens=6)
    assert r.output_text and r.id.startswith("resp_")
    assert r.status == ("incomplete" if engine == "vllm" else "completed")     # SGLang says completed
    stream = await c.responses.create(model="m", input=[{"role": "user", "content": "Hi"}], max_output_tokens=6,
                                      stream=True)
    types = [ev.type async for ev in stream]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert types.count("response.output_text.delta") == 6
    text = await gw.metrics_text()
    # TTFT and ITL from the stream's deltas; usage (input/output tokens) from both answers
    assert 'switchyard_time_to_first_token_seconds_count{model="m"} 1.0' in text
    assert 'switchyard_inter_token_latency_seconds_count{model="m"} 5.0' in text
    assert 'switchyard_completion_tokens_total{model="m"} 12.0' in text
    assert 'switchyard_requests_total{model="m",status="200",strategy="least-request"} 2.0' in text



@pytest.mark.parametrize("state", ["engine", "gateway"])
async def test_an_answer_max_output_tokens_cut_is_incomplete_and_kept_so(sims, gateway, state):
    sim = await sims("vllm", "m", enable_responses_store=True)
    eos = await sims("vllm", "eos", enable_responses_store=True, eos_probability=1.0)
    gw = await gateway([model_block("m", "vllm", [sim.url]), model_block("eos", "vllm", [eos.url])],
                       responses={"state": state})
    c = openai_client(gw)
    r = await c.responses.create(model="m", input="Tell me a story", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.output_text
    stream = await c.responses.create(model="m", input="go on", previous_response_id=r.id, max_output_tokens=3,
                                      stream=True)
    last = [ev async for ev in stream][-1]
    # vLLM ends the stream with response.completed whose response is incomplete (OpenAI: response.incomplete)
    assert last.response.status == "incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    got = await c.responses.retrieve(last.response.id)
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    # an answer that ended before its budget (an EOS) is complete
    done = await c.responses.create(model="eos", input="Tell me a story", max_output_tokens=3)
    assert done.status == "completed" and done.incomplete_details is None


async def test_invalid_bodies_are_refused_before_routing(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    c = openai_client(gw)
    for kw, param in (({"input": 3}, "input"), ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
                      ({"input": "x", "previous_response_id": ""}, "previous_response_id"),
                      ({"input": [1]}, "input[0]")):
        with pytest.raises(openai.BadRequestError) as ei:
            await c.responses.create(model="m", **kw)
        assert ei.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        await c.responses.create(model="nope", input="x")
    assert posts(await sim_state(sim.url)) == []


async def test_include_and_truncation_of_a_wrong_type_or_value_are_openais_400(sims, gateway):
    """``include`` (a list of OpenAI's includable names) and ``truncation`` ("auto" or "disabled")
    went to the engine unchecked; OpenAI refuses a wrong type or an unknown value with a 400
    naming the parameter, and so does the gateway, before routing; good values go on."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    c = openai_client(gw)
    for kw, param, code in (({"include": "reasoning.encrypted_content"}, "include", "invalid_type"),
                            ({"include": ""}, "include", "invalid_type"), ({"include": {}}, "include", "invalid_type"),
                            ({"include": [3]}, "include[0]", "invalid_type"),
                            ({"include": ["message.output_text.logprobs", "usage.everything"]}, "include[1]",
                             "invalid_value"),
                            ({"truncation": "sometimes"}, "truncation", "invalid_value"),
                            ({"truncation": True}, "truncation", "invalid_type")):
        with pytest.raises(openai.BadRequestError) as ei:
            await c.responses.create(model="m", input="x", max_output_tokens=2, **kw)
        assert (ei.value.body["param"], ei.value.body["code"]) == (param, code), kw
        assert ei.value.body["type"] == "invalid_request_error"
    assert posts(await sim_state(sim.url)) == []
    for kw in ({"include": []}, {"include": None}, {"include": ["message.output_text.logprobs"]},
               {"truncation": "disabled"}, {"truncation": None}):
        r = await c.responses.create(model="m", input="x", max_output_tokens=2, **kw)
        assert r.status == "incomplete" and r.output, kw     # cut at max_output_tokens


async def test_follow_ups_reach_the_engine_that_holds_the_response(sims, gateway):
    a = await sims("vllm", "m", enable_responses_store=True)
    b = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [a.url, b.url], strategy="random")])
    c = openai_client(gw)
    r = await c.responses.create(model="m", input="Tell me a story", max_output_tokens=4)
    for _ in range(6):      # each on the engine that stored the previous one, whatever random picks
        r = await c.responses.create(model="m", input="go on", previous_response_id=r.id, max_output_tokens=4)
    counts = sorted([len(posts(await sim_state(a.url))), len(posts(await sim_state(b.url)))])
    assert counts == [0, 7]
    got = await c.responses.retrieve(r.id)
    assert got.id == r.id and got.status == "incomplete"
    with pytest.raises(openai.BadRequestError) as ei:        # the engine's own answer, OpenAI-shaped
        await c.responses.cancel(r.id)
    assert ei.value.body["message"] == "Cannot cancel a synchronous response."
    text = await gw.metrics_text()
    assert 'switchyard_responses_state_lookups_total{kind="affinity",result="hit"} 8.0' in text


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_an_engines_405_is_passed_on_with_the_methods_its_allow_names(sims, gateway, engine):
    """Neither engine serves DELETE of a stored response: its 405 is the client's answer, in
    OpenAI's shape, and so is the ``Allow`` header that names what the engine serves there
    (RFC 9110 §15.5.6), which was dropped."""
    sim = await sims(engine, "m", enable_responses_store=True)
    gw = await gateway([model_block("m", engine, [sim.url])])
    c = openai_client(gw)
    r = await c.responses.create(model="m", input="Hello", max_output_tokens=2)
    async with aiohttp.ClientSession() as s, s.delete(f"{sim.url}/v1/responses/{r.id}") as direct:
        assert direct.status == 405
        allowed = direct.headers["Allow"]
    with pytest.raises(openai.APIStatusError) as ei:
        await c.responses.delete(r.id)
    assert ei.value.status_code == 405
    assert ei.value.response.headers.get("Allow") == allowed


async def test_owner_gone_unknown_left_the_pool_or_not_ready(sims, gateway):
    a = await sims("vllm", "m", enable_responses_store=True)
    b = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [a.url, b.url])])
    c = openai_client(gw)
    with pytest.raises(openai.BadRequestError) as ei:
        await c.responses.create(model="m", input="x", previous_response_id="resp_unknown")
    assert ei.value.body["message"] == "Previous response with id 'resp_unknown' not found."
    with pytest.raises(openai.NotFoundError):
        await c.responses.retrieve("resp_unknown")
    r = await c.responses.create(model="m", input="hello", max_output_tokens=2)
    holder = a if posts(await sim_state(a.url)) else b
    owner = next(ep for ep in gw.gw.pool.endpoints("m") if ep.url == holder.url)
    owner.healthy = False
    with pytest.raises(openai.InternalServerError) as ei:
        await c.responses.create(model="m", input="more", previous_response_id=r.id)
    assert ei.value.status_code == 503 and "is not ready" in ei.value.body["message"]
    gw.gw.pool.remove(owner)
    with pytest.raises(openai.ConflictError) as ei:
        await c.responses.create(model="m", input="more", previous_response_id=r.id)
    assert "has left the pool" in ei.value.body["message"] and ei.value.body["code"] == "response_owner_gone"
    with pytest.raises(openai.ConflictError):
        await c.responses.retrieve(r.id)
    text = await gw.metrics_text()
    assert 'switchyard_responses_owner_unavailable_total{model="m",reason="left_pool"} 2.0' in text


async def test_previous_response_id_across_two_replicas_on_one_redis(sims, gateway, redis_server):
    a = await sims("vllm", "m", enable_responses_store=True)
    b = await sims("vllm", "m", enable_responses_store=True)
    blocks = {"state": {"redis_url": redis_server.url}, "routing": {"strategy": "random"}}
    g1 = await gateway([model_block("m", "vllm", [a.url, b.url])], **blocks)
    g2 = await gateway([model_block("m", "vllm", [a.url, b.url])], **blocks)
    r = await openai_client(g1).responses.create(model="m", input="Hello", max_output_tokens=3)
    for i in range(4):      # alternate replicas; a stream's id is recorded before its last event
        gw = (g2, g1)[i % 2]
        stream = await openai_client(gw).responses.create(model="m", input="again", previous_response_id=r.id,
                                                   max_output_tokens=3, stream=True)
        r = [ev async for ev in stream][-1].response
        assert r.status == "incomplete"
    assert (await openai_client(g2).responses.retrieve(r.id)).id == r.id
    counts = sorted([len(posts(await sim_state(a.url))), len(posts(await sim_state(b.url)))])
    assert counts == [0, 5]


async def test_a_follow_up_found_in_the_lineage_is_counted_shared_view_and_not_a_miss(sims, gateway, redis_server):
    """Engine state on Redis: a record Redis lost (restarted empty) is found in the routing view's
    lineage and the chain goes on. That lookup counts once, as shared_view; miss counts only the
    ids nobody holds (the follow-ups refused), so a dashboard of misses shows lost chains."""
    import redis.asyncio as aioredis

    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])], state={"redis_url": redis_server.url})
    c = openai_client(gw)
    r = await c.responses.create(model="m", input="Hello", max_output_tokens=3)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await client.flushall()
    finally:
        await client.aclose()
    r = await c.responses.create(model="m", input="again", previous_response_id=r.id, max_output_tokens=3)
    with pytest.raises(openai.BadRequestError):
        await c.responses.create(model="m", input="x", previous_response_id="resp_nobody", max_output_tokens=3)
    text = await gw.metrics_text()
    assert 'switchyard_responses_state_lookups_total{kind="affinity",result="shared_view"} 1.0' in text
    assert 'switchyard_responses_state_lookups_total{kind="affinity",result="miss"} 1.0' in text


async def test_an_error_after_headers_ends_the_stream_with_response_failed(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       watchdog={"aggregated": True, "idle_timeout_s": 0.3})
    c = openai_client(gw)
    for fault, code in (("drop_after=2", "upstream_incomplete"), ("stall_after=2:inf", "upstream_timeout")):
        stream = await c.responses.create(model="m", input="x", max_output_tokens=20, stream=True,
                                          extra_headers={"x-sim-fault": fault})
        events = [ev async for ev in stream]
        assert [e.type for e in events][-2:] == ["error", "response.failed"]
        assert events[-2].code == code
        failed = events[-1].response
        assert failed.status == "failed" and failed.id == events[0].response.id and failed.error.code == code
        assert events[-1].sequence_number == events[-2].sequence_number + 1 == len(events) - 1


async def test_tpm_is_charged_from_the_usage_of_response_completed(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS, limits={"users": {"alice": {"tpm": 30}}})
    stream = await openai_client(gw, ALICE).responses.create(model="m", input="hello", max_output_tokens=30, stream=True)
    async for _ in stream:
        pass
    with pytest.raises(openai.RateLimitError):
        await openai_client(gw, ALICE).responses.create(model="m", input="hello", max_output_tokens=1)


async def test_gateway_history_survives_an_engine_restart(sims, gateway):
    sim = await sims("vllm", "m")           # no engine store at all: the gateway holds the history
    port = sim.port
    gw = await gateway([model_block("m", "vllm", [sim.url])], responses={"state": "gateway"},
                       auth=KEYS)
    c = openai_client(gw, ALICE)
    r1 = await c.responses.create(model="m", instructions="Be brief.", input="My name is Ada.",
                                  max_output_tokens=4)
    await sim.close()
    sim2 = await start_sim(SimConfig(engine="vllm", model="m", port=port, host="127.0.0.1", **FAST_SIM))
    try:
        ep = gw.gw.pool.endpoints("m")[0]
        assert await wait_for(lambda: ep.ready, timeout=10)
        r2 = await c.responses.create(model="m", input="What is my name?", previous_response_id=r1.id,
                                      max_output_tokens=4)
        assert r2.status == "incomplete"
        assert r2.usage.input_tokens > r1.usage.input_tokens     # the first turn was replayed
        items = await c.responses.input_items.list(r2.id, order="asc")
        assert [(i.role, i.content[0].text) for i in items.data][:1] == [("user", "My name is Ada.")]
        assert items.data[1].role == "assistant" and items.data[1].content[0].text == r1.output_text
        assert (await c.responses.retrieve(r1.id)).output_text == r1.output_text
        with pytest.raises(openai.NotFoundError):           # another user's key does not see it
            await openai_client(gw, BOB).responses.retrieve(r1.id)
        await c.responses.delete(r1.id)
        with pytest.raises(openai.BadRequestError) as ei:
            await c.responses.create(model="m", input="again", previous_response_id=r1.id)
        assert ei.value.body["code"] == "previous_response_not_found"
    finally:
        await sim2.close()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_follow_up_its_restarted_engine_no_longer_holds_is_previous_response_not_found(sims, gateway, engine):
    """Engine state: the engine that held a response restarted, its store gone. The follow-up still
    goes there (the gateway's record outlives it), and the engine's 404 naming the id is answered
    as OpenAI answers a previous response it does not hold, the 400 previous_response_not_found an
    agent resends the whole conversation on, streamed or not; a GET keeps the engine's 404."""
    sim = await sims(engine, "m", enable_responses_store=True)
    port = sim.port
    gw = await gateway([model_block("m", engine, [sim.url])])
    c = openai_client(gw)
    r1 = await c.responses.create(model="m", input="hello", max_output_tokens=3)
    await sim.close()
    sim2 = await start_sim(SimConfig(engine=engine, model="m", port=port, host="127.0.0.1",
                                     enable_responses_store=True, **FAST_SIM))
    try:
        ep = gw.gw.pool.endpoints("m")[0]
        assert await wait_for(lambda: ep.ready, timeout=10)
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as ei:
                await c.responses.create(model="m", input="again", previous_response_id=r1.id, max_output_tokens=3,
                                         stream=stream)
            assert ei.value.body == {"message": f"Previous response with id '{r1.id}' not found.",
                                     "type": "invalid_request_error", "param": "previous_response_id",
                                     "code": "previous_response_not_found"}
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(r1.id)
        assert len(posts(await sim_state(sim2.url))) == 2       # the engine was asked, and said so
    finally:
        await sim2.close()


async def test_gateway_history_continued_with_another_model_is_no_session_of_that_model(sims, gateway):
    """Gateway state lets a conversation go on with another model: the engine of its last turn serves
    the other model, so the follow-up starts a session of its own, neither kept nor counted gone
    (``gone`` says a session's engine left the pool; that one is there, serving its model)."""
    a, b = await sims("vllm", "a"), await sims("vllm", "b")
    gw = await gateway([model_block("a", "vllm", [a.url]), model_block("b", "vllm", [b.url])],
                       responses={"state": "gateway"}, routing={"strategy": "prefix-cache"})
    c = openai_client(gw)
    r1 = await c.responses.create(model="a", input="one", max_output_tokens=2)
    r2 = await c.responses.create(model="b", input="two", previous_response_id=r1.id, max_output_tokens=2)
    r3 = await c.responses.create(model="b", input="three", previous_response_id=r2.id, max_output_tokens=2)
    assert r3.status == "incomplete"
    text = await gw.metrics_text()
    assert 'switchyard_routing_session_total{model="b",outcome="kept"} 1.0' in text
    assert 'outcome="gone"' not in text


async def test_gateway_history_streams_and_keeps_engines_stateless(sims, gateway):
    a = await sims("sglang", "m")
    gw = await gateway([model_block("m", "sglang", [a.url])], responses={"state": "gateway"})
    c = openai_client(gw)
    stream = await c.responses.create(model="m", input="one", max_output_tokens=3, stream=True)
    first = [ev async for ev in stream][-1].response
    stream = await c.responses.create(model="m", input="two", previous_response_id=first.id, max_output_tokens=3,
                                      stream=True)
    second = [ev async for ev in stream][-1].response
    assert second.status == "completed"
    async with aiohttp.ClientSession() as s, s.get(a.url + f"/v1/responses/{second.id}") as resp:
        assert resp.status == 404                 # the engine was told store: false
    with pytest.raises(openai.BadRequestError):
        await c.responses.create(model="m", input="x", background=True)
    text = await gw.metrics_text()
    assert 'switchyard_responses_state_writes_total{kind="history",result="ok"} 2.0' in text


async def test_gateway_history_keeps_nothing_of_a_store_false_response(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], responses={"state": "gateway"})
    c = openai_client(gw)
    r = await c.responses.create(model="m", input="do not keep this", store=False, max_output_tokens=3)
    assert r.status == "incomplete"
    with pytest.raises(openai.NotFoundError) as ei:
        await c.responses.retrieve(r.id)
    assert ei.value.body["code"] == "response_not_found"
    with pytest.raises(openai.BadRequestError) as ei:
        await c.responses.create(model="m", input="and?", previous_response_id=r.id, max_output_tokens=3)
    assert ei.value.body["code"] == "previous_response_not_found"
    kept = await c.responses.create(model="m", input="keep this", max_output_tokens=3)     # store defaults to true
    assert (await c.responses.retrieve(kept.id)).id == kept.id
    text = await gw.metrics_text()
    assert 'switchyard_responses_state_writes_total{kind="history",result="ok"} 1.0' in text


async def test_a_store_false_response_is_unknown_to_the_gateway_in_engine_state(sims, gateway):
    """store: false in engine state: the gateway records no owner for the id, so a follow-up is
    OpenAI's 400 previous_response_not_found and a GET the gateway's 404 response_not_found, each
    naming its field, never sent to the engine (whose own 404 carried neither the code nor the
    param)."""
    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    c = openai_client(gw)
    r = await c.responses.create(model="m", input="do not keep this", store=False, max_output_tokens=3)
    with pytest.raises(openai.BadRequestError) as ei:
        await c.responses.create(model="m", input="and?", previous_response_id=r.id, max_output_tokens=3)
    assert (ei.value.body["code"], ei.value.body["param"]) == ("previous_response_not_found", "previous_response_id")
    with pytest.raises(openai.NotFoundError) as ei:
        await c.responses.retrieve(r.id)
    assert (ei.value.body["code"], ei.value.body["param"]) == ("response_not_found", "response_id")
    state = await sim_state(sim.url)
    assert len(posts(state)) == 1 and [q for q in state["received"] if q["method"] == "GET"
                                       and q["path"].startswith("/v1/responses")] == []


@pytest.mark.parametrize("state", ["engine", "gateway"])
async def test_a_body_request_id_cannot_take_over_another_users_response(sims, gateway, state):
    """vLLM and SGLang name a response by the body's ``request_id`` when it has one: a client that
    names an id the gateway holds would replace that response (its owner record, its history,
    the engine's stored copy), another user's too. The field is refused before routing, as OpenAI
    refuses a parameter it does not know, and the other user's conversation goes on."""
    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS, responses={"state": state})
    alice, bob = openai_client(gw, ALICE), openai_client(gw, BOB)
    r = await alice.responses.create(model="m", input="My secret is 42", max_output_tokens=3)
    with pytest.raises(openai.BadRequestError) as ei:
        await bob.responses.create(model="m", input="mine now", max_output_tokens=3, extra_body={"request_id": r.id})
    assert (ei.value.body["param"], ei.value.body["code"]) == ("request_id", "unknown_parameter")
    assert len(posts(await sim_state(sim.url))) == 1
    assert (await alice.responses.retrieve(r.id)).output_text == r.output_text
    follow = await alice.responses.create(model="m", input="go on", previous_response_id=r.id, max_output_tokens=3)
    assert follow.status == "incomplete"
    with pytest.raises(openai.NotFoundError):
        await bob.responses.retrieve(r.id)


@pytest.mark.parametrize("state", ["engine", "gateway"])
async def test_an_unknown_previous_response_id_is_openais_previous_response_not_found(sims, gateway, state):
    """A follow-up whose previous response is not held (never seen, store: false, another user's)
    is answered as OpenAI answers it, a 400 previous_response_not_found naming the field: the code
    agents look for to send the whole conversation again. Another user's id gets the same answer
    as an unknown one."""
    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])], responses={"state": state}, auth=KEYS)
    c = openai_client(gw, ALICE)
    with pytest.raises(openai.BadRequestError) as ei:
        await c.responses.create(model="m", input="x", previous_response_id="resp_unknown", max_output_tokens=3)
    assert ei.value.body == {"message": "Previous response with id 'resp_unknown' not found.",
                             "type": "invalid_request_error", "param": "previous_response_id",
                             "code": "previous_response_not_found"}
    bobs = await openai_client(gw, BOB).responses.create(model="m", input="mine", max_output_tokens=3)
    with pytest.raises(openai.BadRequestError) as ei:
        await c.responses.create(model="m", input="x", previous_response_id=bobs.id, max_output_tokens=3)
    assert ei.value.body["message"] == f"Previous response with id '{bobs.id}' not found."
    assert ei.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError) as ei:     # GET names the path's id
        await c.responses.retrieve("resp_unknown")
    assert ei.value.body["param"] == "response_id"


async def test_input_items_page_parameters_out_of_range_are_openais_400(sims, gateway):
    """limit (1-100), order (asc, desc) and the after/before cursors of input_items: a value out of
    range, of another type or naming no item is the 400 OpenAI answers, naming the parameter, not
    a page clamped or read some other way; good values page as the SDK walks them."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], responses={"state": "gateway"})
    c = openai_client(gw)
    r = await c.responses.create(model="m", max_output_tokens=2,
                                 input=[{"role": "user", "content": f"turn {i}"} for i in range(5)])
    bad = [({"limit": 0}, "limit", "integer_below_min_value"), ({"limit": -3}, "limit", "integer_below_min_value"),
           ({"limit": 101}, "limit", "integer_above_max_value"),
           ({"extra_query": {"limit": "9" * 40}}, "limit", "integer_above_max_value"),
           ({"extra_query": {"limit": "2.5"}}, "limit", "invalid_type"),
           ({"extra_query": {"limit": "ten"}}, "limit", "invalid_type"),
           ({"extra_query": {"order": "up"}}, "order", "invalid_value"),
           ({"extra_query": {"order": "ASC"}}, "order", "invalid_value"),
           ({"after": "no-such-item"}, "after", "invalid_value"),
           ({"extra_query": {"before": "no-such-item"}}, "before", "invalid_value")]
    for kw, param, code in bad:
        with pytest.raises(openai.BadRequestError) as ei:
            await c.responses.input_items.list(r.id, **kw)
        assert (ei.value.body["type"], ei.value.body["param"], ei.value.body["code"]) == (
            "invalid_request_error", param, code), kw
    with pytest.raises(openai.BadRequestError) as ei:
        await c.responses.input_items.list(r.id, limit=1000)
    assert ei.value.body["message"] == ("Invalid 'limit': integer above maximum value. Expected a value <= 100, "
                                        "but got 1000 instead.")

    texts = [i.content[0].text async for i in c.responses.input_items.list(r.id, order="asc", limit=2)]
    assert texts == [f"turn {i}" for i in range(5)]                   # the SDK's pages, by `after`
    ids = [i.id for i in (await c.responses.input_items.list(r.id, limit=100)).data]
    assert len(ids) == 5
    page = await c.responses.input_items.list(r.id, limit=2, extra_query={"before": ids[3]})
    assert [i.id for i in page.data] == ids[1:3] and page.has_more      # the page just before it
    page = await c.responses.input_items.list(r.id, after=ids[0], extra_query={"before": ids[3]})
    assert [i.id for i in page.data] == ids[1:3] and not page.has_more


async def test_gateway_history_lists_input_messages_with_content_parts(sims, gateway):
    """input_items lists a message's content as parts, as OpenAI does (ResponseInputMessageItem,
    ResponseOutputMessage), whether the input gave a string or parts, and a replayed answer too."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], responses={"state": "gateway"})
    c = openai_client(gw)
    r1 = await c.responses.create(model="m", input="Hello", max_output_tokens=3)
    r2 = await c.responses.create(model="m", previous_response_id=r1.id, max_output_tokens=3, input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "and then?"}]}])
    items = (await c.responses.input_items.list(r2.id, order="asc")).data
    assert [(i.type, i.role, i.status) for i in items] == [
        ("message", "user", "completed"), ("message", "assistant", "completed"),
        ("message", "developer", "completed"), ("message", "user", "completed")]
    assert [[(p.type, p.text) for p in i.content] for i in items] == [
        [("input_text", "Hello")], [("output_text", r1.output_text)], [("input_text", "Be brief.")],
        [("input_text", "and then?")]]


@pytest.mark.parametrize("state", ["engine", "gateway"])
async def test_the_ids_a_client_asks_for_count_under_their_route_not_a_path_each(sims, gateway, state):
    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])], responses={"state": state})
    c = openai_client(gw)
    r = await c.responses.create(model="m", input="hello", max_output_tokens=2)
    assert (await c.responses.retrieve(r.id)).id == r.id
    for i in range(20):
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(f"resp_missing{i}")
        with pytest.raises(openai.NotFoundError):
            await c.responses.delete(f"resp_missing{i}")
        with pytest.raises(openai.NotFoundError):
            await c.responses.input_items.list(f"resp_missing{i}")
        with pytest.raises(openai.NotFoundError):
            await c.responses.cancel(f"resp_missing{i}")
    text = await gw.metrics_text()
    paths = {line.split('path="')[1].split('"')[0] for line in text.splitlines()
             if line.startswith("switchyard_path_requests_total{")}
    assert paths == {"/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items",
                     "/v1/responses/{response_id}/cancel"}
    assert 'switchyard_path_requests_total{path="/v1/responses/{response_id}",status="200"} 1.0' in text
    assert 'switchyard_path_requests_total{path="/v1/responses/{response_id}",status="404"} 40.0' in text


async def test_a_stored_response_larger_than_max_response_bytes_is_a_502_when_retrieved(sims, gateway):
    """A retrieve goes to the engine holding the response and is read whole, as any whole answer:
    past ``upstream.max_response_bytes`` it is the same 502 upstream_too_large, not held."""
    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])], upstream={"max_response_bytes": 4096})
    c = openai_client(gw)
    big_id = None
    async with await c.responses.create(model="m", input="Tell me a long story", max_output_tokens=1500,
                                        stream=True) as stream:     # a stream is relayed, not read whole
        async for event in stream:
            if event.type == "response.completed":
                big_id = event.response.id
    assert big_id is not None
    with pytest.raises(openai.APIStatusError) as ei:
        await c.responses.retrieve(big_id)
    assert ei.value.status_code == 502 and ei.value.body["code"] == "upstream_too_large"
    assert ei.value.response.headers["x-error-upstream"] == "too_large"
    small = await c.responses.create(model="m", input="hi", max_output_tokens=2, stream=False)
    assert (await c.responses.retrieve(small.id)).id == small.id
    text = await gw.metrics_text()
    assert 'error_class="too_large"' in text


async def _to_first_delta(stream) -> list:
    """The events of a Responses ``stream`` up to and with its first text delta."""
    seen = []
    async for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta":
            break
    return seen


async def test_a_background_stream_its_client_left_is_resumed_through_the_gateway(sims, gateway):
    """Engine state, ``background`` with ``stream``: the response goes on on its engine when its
    client leaves, and the client resumes it with a GET (``stream=true&starting_after=N``). The
    gateway recorded the response's owner only at the stream's terminal event on the client's own
    connection, so the resume, reaching it before that or after the client left, was its 404."""
    sim = await sims("vllm", "m", enable_responses_store=True, itl_ms=20.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    c = openai_client(gw)
    stream = await c.responses.create(model="m", input="tell me a long story", background=True, stream=True,
                                      max_output_tokens=40)
    seen = await _to_first_delta(stream)
    await stream.close()                        # the client leaves after its first token
    rid, last = seen[0].response.id, seen[-1].sequence_number
    rest = await c.responses.retrieve(rid, stream=True, starting_after=last)
    events = [event async for event in rest]
    assert [e.sequence_number for e in events] == list(range(last + 1, last + 1 + len(events)))
    assert events[-1].type == "response.completed" and events[-1].response.id == rid
    deltas = "".join(e.delta for e in seen + events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text and events[-1].response.usage.output_tokens == 40
    assert (await c.responses.retrieve(rid)).status == "incomplete"
    again = await c.responses.retrieve(rid, stream=True, starting_after=-1)    # the whole stream, from the start
    assert [e.sequence_number async for e in again][0] == 0


async def test_a_background_stream_its_response_cancelled_ends_as_cancelled_and_is_no_engine_fault(sims, gateway):
    """Engine state, ``background`` with ``stream``: a cancel of the response (from any client)
    ends its stream on its engine, which closes it without a terminal event, as vLLM's does. The
    gateway took that end for the engine's failure: the client got an ``upstream_incomplete`` error
    event, the request was logged ``upstream_eof`` and counted a fault against the endpoint, so five
    cancels in a row opened its breaker. The engine, asked, holds it cancelled: the stream ends as
    its engine ended it, and the request is no fault."""
    sim = await sims("vllm", "m", enable_responses_store=True, itl_ms=20.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    c = openai_client(gw)
    stream = await c.responses.create(model="m", input="tell me a long story", background=True, stream=True,
                                      max_output_tokens=200)
    seen = await _to_first_delta(stream)
    rid = seen[0].response.id
    assert (await c.responses.cancel(rid)).status == "cancelled"
    seen += [event async for event in stream]
    assert "error" not in [e.type for e in seen]
    assert (await c.responses.retrieve(rid)).status == "cancelled"

    async def counted() -> bool:
        page = await gw.metrics_text()
        return metric(page, "switchyard_upstream_outcomes_total", outcome="success") \
            + metric(page, "switchyard_upstream_outcomes_total", outcome="fault") >= 1
    await until(counted, timeout=10)
    page = await gw.metrics_text()
    assert metric(page, "switchyard_upstream_outcomes_total", outcome="fault") == 0
    assert metric(page, "switchyard_upstream_errors_total") == 0


async def test_a_resumed_background_stream_whose_response_is_cancelled_ends_without_an_error_event(sims, gateway):
    """A background stream resumed with a GET (``stream=true&starting_after=N``) whose response is
    then cancelled: its engine closes the replay without a terminal event, which the gateway
    answered with an ``upstream_incomplete`` error event, telling the client to resume again a
    response that had ended. The engine, asked, holds it cancelled: the replay ends there."""
    sim = await sims("vllm", "m", enable_responses_store=True, itl_ms=20.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    c = openai_client(gw)
    stream = await c.responses.create(model="m", input="tell me a long story", background=True, stream=True,
                                      max_output_tokens=200)
    seen = await _to_first_delta(stream)
    await stream.close()                        # the client leaves, and resumes
    rid, last = seen[0].response.id, seen[-1].sequence_number
    rest = await c.responses.retrieve(rid, stream=True, starting_after=last)
    events = []
    async for event in rest:
        events.append(event)
        if len(events) == 1:
            assert (await c.responses.cancel(rid)).status == "cancelled"
    assert events and "error" not in [e.type for e in events]
    assert (await c.responses.retrieve(rid)).status == "cancelled"


async def test_a_background_stream_and_its_replay_ended_by_a_cancel_log_finish_reason_cancelled(sims, gateway):
    """The log line of a background stream its response's cancel ended, and of a replay of it so
    ended, says the response's end, ``finish_reason: cancelled``, with no error, as docs/apis.md
    says; both said none."""
    sim = await sims("vllm", "m", enable_responses_store=True, itl_ms=20.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    c = openai_client(gw)
    for replayed in (False, True):
        with gw.gw.request_log.capture() as lines:
            stream = await c.responses.create(model="m", input="tell me a long story", background=True,
                                              stream=True, max_output_tokens=200)
            seen = await _to_first_delta(stream)
            rid, last = seen[0].response.id, seen[-1].sequence_number
            if replayed:
                await stream.close()        # the client leaves, resumes, then cancels
                stream = await c.responses.retrieve(rid, stream=True, starting_after=last)
                async for _event in stream:
                    break
            assert (await c.responses.cancel(rid)).status == "cancelled"
            _rest = [event async for event in stream]
            path = f"/v1/responses/{rid}" if replayed else "/v1/responses"
            assert await wait_for(lambda p=path: any(ln["path"] == p for ln in lines), timeout=10.0)
        line = next(ln for ln in lines if ln["path"] == path)
        assert (line["status"], line["error_class"], line["finish_reason"]) == (200, None, "cancelled"), replayed


@pytest.mark.parametrize("at", ["head", "event"])
async def test_a_replay_whose_client_resets_as_the_engine_answers_is_the_clients_cancel(sims, gateway, monkeypatch, at):
    """A background stream's replay (``GET ?stream=true``) whose client's reset is read in the loop
    turn that brings the engine's head, or one of its events, after it: the client's connection is
    closing before the cancel of its connection_lost reaches the call. The line is the client's
    cancel, a 499 ``client_cancel``, as for a client that left at any other moment; the head's
    write was answered as the engine's failure, a 502 ``upstream_connect`` naming the engine, and
    an event's raised out of the call, a 200 on the line."""
    from aiohttp import client_proto

    sim = await sims("vllm", "m", enable_responses_store=True, itl_ms=20.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    c = openai_client(gw)
    created = await c.responses.create(model="m", input="tell me a long story", background=True, stream=True,
                                       max_output_tokens=2000)     # 40 s of events: still going at the replay
    async for event in created:
        rid = event.response.id
        break
    await created.close()
    server = gw.runner.server
    received = client_proto.ResponseHandler.data_received

    def then_reset(proto, data: bytes) -> None:
        received(proto, data)
        if (data.startswith(b"HTTP/1.1 200") and b"event-stream" in data) if at == "head" \
                else not data.startswith(b"HTTP/") and b"response.output_text.delta" in data:
            for transport in list(server._connections.values()):
                transport.abort()       # as a reset read now does: closing, connection_lost to come
    monkeypatch.setattr(client_proto.ResponseHandler, "data_received", then_reset)
    with gw.gw.request_log.capture() as lines:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(f"GET /v1/responses/{rid}?stream=true&starting_after=-1 HTTP/1.1\r\nHost: gw\r\n\r\n".encode())
        await asyncio.wait_for(reader.read(), 30)      # the gateway drops the connection
        writer.close()
        line = (await until(lambda: [e for e in lines if e["event"] == "request" and e["path"] != "/v1/responses"]))[0]
    monkeypatch.undo()
    assert (line["status"], line["error_class"]) == (499, "client_cancel"), line
    assert "upstream_errors_total{" not in await gw.metrics_text()
    await c.responses.cancel(rid)


@pytest.mark.parametrize("backend", ["memory", "redis"])
@pytest.mark.parametrize("state", ["engine", "gateway"])
async def test_a_stream_the_gateway_failed_is_kept_as_failed(sims, gateway, redis_server, state, backend):
    """A stream that failed after its headers (the engine broke, the watchdog fired) ended with
    response.failed: a GET of its id answers that failed response with its error, as OpenAI keeps a
    failed response, and a follow-up on it is a 400 naming previous_response_id, where both were
    404s (nothing was kept of it)."""
    sim = await sims("vllm", "m")
    blocks = {"state": {"redis_url": redis_server.url}} if backend == "redis" else {}
    gw = await gateway([model_block("m", "vllm", [sim.url])], responses={"state": state, "backend": backend},
                       watchdog={"aggregated": True, "idle_timeout_s": 0.3}, auth=KEYS, **blocks)
    c = openai_client(gw, ALICE)
    for fault, code in (("drop_after=2", "upstream_incomplete"), ("stall_after=2:inf", "upstream_timeout")):
        stream = await c.responses.create(model="m", input="x", max_output_tokens=20, stream=True,
                                          extra_headers={"x-sim-fault": fault})
        events = [ev async for ev in stream]
        failed = events[-1].response
        assert failed.status == "failed"
        # the response as it stood: the message the client was streamed, still in progress, once
        text = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
        assert text and [(o.type, o.status, [p.text for p in o.content]) for o in failed.output] == [
            ("message", "in_progress", [text])], failed.output
        got = await c.responses.retrieve(failed.id)
        assert got.id == failed.id and got.status == "failed", got
        assert [o.model_dump() for o in got.output] == [o.model_dump() for o in failed.output]
        assert (got.error.code, got.error.message) == (code, failed.error.message)
        with pytest.raises(openai.NotFoundError):           # another user's key does not see it
            await openai_client(gw, BOB).responses.retrieve(failed.id)
        with pytest.raises(openai.BadRequestError) as ei:
            await c.responses.create(model="m", input="go on", previous_response_id=failed.id, max_output_tokens=3)
        assert ei.value.body["param"] == "previous_response_id" and "failed" in ei.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        await c.responses.cancel(failed.id)
    await c.responses.delete(failed.id)
    with pytest.raises(openai.NotFoundError):
        await c.responses.retrieve(failed.id)
    with pytest.raises(openai.NotFoundError):                # store: false keeps nothing, failed or not
        stream = await c.responses.create(model="m", input="x", max_output_tokens=20, stream=True, store=False,
                                          extra_headers={"x-sim-fault": "drop_after=2"})
        await c.responses.retrieve([ev async for ev in stream][-1].response.id)


def _failed_response(rid: str) -> dict:
    return {"id": rid, "object": "response", "created_at": 1, "model": "m", "status": "failed", "output": [],
            "error": {"code": "server_error", "message": "the engine failed"}}


async def _failing_engine(request: web.Request) -> web.StreamResponse:
    """An engine whose responses fail on its side: a stream's response.failed, a body's status failed."""
    body = await request.json()
    rid = "resp_" + ("stream" if body.get("stream") else "whole")
    if not body.get("stream"):
        return web.json_response(_failed_response(rid))
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    created = {**_failed_response(rid), "status": "in_progress", "error": None}
    for seq, (name, resp) in enumerate((("response.created", created), ("response.failed", _failed_response(rid)))):
        await out.write(f"event: {name}\ndata: ".encode() + orjson.dumps(
            {"type": name, "sequence_number": seq, "response": resp}) + b"\n\n")
    await out.write_eof()
    return out


@pytest.mark.parametrize("state", ["engine", "gateway"])
async def test_a_response_its_engine_failed_is_kept_failed_and_not_continued(gateway, state):
    """A response the engine ended failed (response.failed, or a body whose status is failed) is
    kept as it ended, so a GET answers it failed with the engine's error, and a follow-up naming it
    is the 400 naming previous_response_id of every failed response, in both state modes: in
    engine state it went to the engine, which was asked to continue a failed turn."""
    posted = []

    async def engine(request: web.Request) -> web.StreamResponse:
        posted.append(request.method)
        return await _failing_engine(request)

    async with fake_engine(engine, paths=("/v1/responses",)) as url:
        gw = await gateway([model_block("m", "vllm", [url])], responses={"state": state})
        c = openai_client(gw)
        whole = await c.responses.create(model="m", input="whole")
        stream = await c.responses.create(model="m", input="streamed", stream=True)
        streamed = [ev async for ev in stream][-1].response
        for r in (whole, streamed):
            assert r.status == "failed"
            with pytest.raises(openai.BadRequestError) as ei:
                await c.responses.create(model="m", input="go on", previous_response_id=r.id)
            assert ei.value.body["param"] == "previous_response_id" and "failed" in ei.value.body["message"]
            got = await c.responses.retrieve(r.id)
            assert (got.id, got.status, got.error.code) == (r.id, "failed", "server_error")
        assert posted == ["POST", "POST"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_background_response_its_engine_failed_later_is_not_continued(sims, gateway, engine):
    """A background response is answered queued and fails on its engine afterwards, out of the
    gateway's sight; a follow-up naming it went to that engine, which continued the failed turn.
    It is the 400 naming previous_response_id of every failed response, as OpenAI refuses to
    continue one; the engine gets no follow-up. One that completed is continued as before."""
    sim = await sims(engine, "m", enable_responses_store=True)
    gw = await gateway([model_block("m", engine, [sim.url])])
    c = openai_client(gw)
    failing = await c.responses.create(model="m", input="a long task", background=True, max_output_tokens=8,
                                       extra_headers={"x-sim-fault": "error_after=2"})
    fine = await c.responses.create(model="m", input="a short task", background=True, max_output_tokens=2)
    ended = {}

    async def both_ended() -> bool:
        for r in (failing, fine):
            ended[r.id] = (await c.responses.retrieve(r.id)).status
        return all(s not in ("queued", "in_progress") for s in ended.values())

    assert await until(both_ended), ended
    assert ended[failing.id] == "failed" and ended[fine.id] != "failed"
    before = len(posts(await sim_state(sim.url)))
    with pytest.raises(openai.BadRequestError) as ei:
        await c.responses.create(model="m", input="go on", previous_response_id=failing.id, max_output_tokens=2)
    assert ei.value.body["param"] == "previous_response_id" and "failed" in ei.value.body["message"]
    assert len(posts(await sim_state(sim.url))) == before
    r = await c.responses.create(model="m", input="go on", previous_response_id=fine.id, max_output_tokens=2)
    assert r.status in ("completed", "incomplete")


def _function_call_events() -> list[bytes]:
    """A Responses stream whose output is one function call, framed as the engines frame it."""
    item = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather", "arguments": "",
            "status": "in_progress"}
    done = {**item, "arguments": '{"city":"Paris"}', "status": "completed"}
    resp = {"id": "resp_cut1", "object": "response", "created_at": 1, "model": "m", "status": "in_progress",
            "output": []}
    usage = {"input_tokens": 10, "output_tokens": 7, "total_tokens": 17,
             "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    events = [("response.created", {"response": resp}), ("response.in_progress", {"response": resp}),
              ("response.output_item.added", {"output_index": 0, "item": item}),
              ("response.function_call_arguments.delta", {"output_index": 0, "item_id": "fc_1", "delta": '{"city":'}),
              ("response.function_call_arguments.delta", {"output_index": 0, "item_id": "fc_1", "delta": '"Paris"}'}),
              ("response.function_call_arguments.done", {"output_index": 0, "item_id": "fc_1",
                                                         "arguments": '{"city":"Paris"}'}),
              ("response.output_item.done", {"output_index": 0, "item": done}),
              ("response.completed", {"response": {**resp, "status": "completed", "output": [done], "usage": usage}})]
    return [b"event: " + name.encode() + b"\ndata: "
            + orjson.dumps({"type": name, "sequence_number": i, **data}) + b"\n\n"
            for i, (name, data) in enumerate(events)]


async def _to_first_arguments(stream) -> list[str]:
    """The types of a Responses ``stream``'s events up to and with its first function-call
    arguments delta."""
    seen = []
    async for ev in stream:
        seen.append(ev.type)
        if ev.type == "response.function_call_arguments.delta":
            break
    return seen


def _held_stream(go_on: asyncio.Event):
    """An engine streaming a stored response's first four events, then the rest once ``go_on`` is set."""
    async def engine(request: web.Request) -> web.StreamResponse:
        await request.read()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        events = _function_call_events()
        for event in events[:4]:
            await out.write(event)
        await go_on.wait()
        for event in events[4:]:
            await out.write(event)
        await out.write_eof()
        return out
    return engine


_cut_responses_engine = cutting_stream(_function_call_events)


@pytest.mark.parametrize("state", ["engine", "gateway"])
async def test_a_stored_stream_still_generating_is_retrieved_in_progress(gateway, state):
    """A stored response streamed without ``background`` is known to its client from its
    ``response.created``; a GET of it before its stream ended was a 404 (its engine keeps it once
    it ends, the gateway's record is written then), where OpenAI answers it ``in_progress``. The
    gateway answers the response its stream announced; once ended, it is read as before."""
    go_on = asyncio.Event()

    engine = _held_stream(go_on)

    async with fake_engine(engine, paths=("/v1/responses",)) as url:
        gw = await gateway([model_block("m", "vllm", [url])], responses={"state": state})
        c = openai_client(gw)
        stream = await c.responses.create(model="m", input="weather?", stream=True)
        seen = await _to_first_arguments(stream)
        try:
            got = await c.responses.retrieve("resp_cut1")
        finally:
            go_on.set()         # the engine ends its stream, whatever the GET answered
        assert (got.id, got.status, got.model) == ("resp_cut1", "in_progress", "m")
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve("resp_other")
        seen += [ev.type async for ev in stream]
        assert seen[-1] == "response.completed"
        if state == "gateway":
            assert (await c.responses.retrieve("resp_cut1")).status == "completed"


@pytest.mark.parametrize("state", ["engine", "gateway"])
async def test_the_calls_on_a_stored_stream_still_generating_answer_as_on_the_response_it_announced(gateway, state):
    """A GET of a stored stream still generating answered it in progress, while its other calls
    were a 404. As at OpenAI: a cancel is the 400 of a response not created in the background;
    with gateway state its ``input_items`` list the input it was sent and a DELETE removes it (its
    record is not written when it ends); with engine state a DELETE or ``input_items`` reaches its
    engine, as once it ended (which serves neither: its 405 is passed on)."""
    go_on = asyncio.Event()
    engine_calls: list[str] = []

    engine = _held_stream(go_on)

    async def retrieve(request: web.Request) -> web.Response:
        engine_calls.append(request.method)
        return web.json_response({"error": {"message": "not yet", "type": "invalid_request_error"}}, status=404)

    routes = (web.get("/v1/responses/{rid}", retrieve),)
    async with fake_engine(engine, paths=("/v1/responses",), routes=routes) as url:
        gw = await gateway([model_block("m", "vllm", [url])], responses={"state": state})
        c = openai_client(gw)
        stream = await c.responses.create(model="m", input="weather?", stream=True)
        seen = await _to_first_arguments(stream)
        try:
            with pytest.raises(openai.BadRequestError) as ei:
                await c.responses.cancel("resp_cut1")
            assert (ei.value.body["message"], ei.value.body["param"]) == \
                ("Cannot cancel a synchronous response.", "response_id")
            if state == "gateway":
                items = await c.responses.input_items.list("resp_cut1")
                assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "weather?")]
                deleted = await c.responses.delete("resp_cut1")
                assert deleted is None or getattr(deleted, "deleted", True)
                with pytest.raises(openai.NotFoundError):
                    await c.responses.retrieve("resp_cut1")
            else:
                with pytest.raises(openai.APIStatusError) as ei:
                    await c.responses.delete("resp_cut1")
                assert ei.value.status_code == 405 and "GET" in ei.value.response.headers.get("Allow", "")
                assert (await c.responses.retrieve("resp_cut1")).status == "in_progress"
        finally:
            go_on.set()         # the engine ends its stream, whatever the calls answered
        seen += [ev.type async for ev in stream]
        assert seen[-1] == "response.completed"
        if state == "gateway":      # deleted while it ran: not kept when it ended
            with pytest.raises(openai.NotFoundError):
                await c.responses.retrieve("resp_cut1")
            with pytest.raises(openai.BadRequestError):
                await c.responses.create(model="m", input="and then?", previous_response_id="resp_cut1")


async def _held_on_one_replica(gateway, redis_server, url: str, state: str = "gateway"):
    """Two replicas on one Redis with ``state``, and a stored stream of the held engine started
    on the first, read up to its first delta: (first, second, stream, events seen)."""
    blocks = {"state": {"redis_url": redis_server.url}, "responses": {"state": state}}
    g1 = await gateway([model_block("m", "vllm", [url])], **blocks)
    g2 = await gateway([model_block("m", "vllm", [url])], **blocks)
    stream = await openai_client(g1).responses.create(model="m", input="weather?", stream=True)
    seen = await _to_first_arguments(stream)
    return openai_client(g1), openai_client(g2), stream, seen


async def test_a_stored_stream_still_generating_on_one_replica_is_in_progress_on_another(gateway, redis_server):
    """Gateway state on Redis, two replicas: a stored stream still generating on the first was a
    404 on the second until it ended (the record was written then). Its replica writes the
    response in progress as the stream starts, replaced when it ends: the second answers it
    ``in_progress`` with its input, and completed once it ended."""
    go_on = asyncio.Event()
    async with fake_engine(_held_stream(go_on), paths=("/v1/responses",)) as url:
        c1, c2, stream, seen = await _held_on_one_replica(gateway, redis_server, url)
        try:
            got = await until_answered(lambda: c2.responses.retrieve("resp_cut1"))
            items = await c2.responses.input_items.list("resp_cut1")
        finally:
            go_on.set()
        assert (got.id, got.status, got.model) == ("resp_cut1", "in_progress", "m")
        assert [i.content[0].text for i in items.data] == ["weather?"]
        seen += [ev.type async for ev in stream]
        assert seen[-1] == "response.completed"
        assert (await c2.responses.retrieve("resp_cut1")).status == "completed"
        assert (await c1.responses.retrieve("resp_cut1")).status == "completed"


async def test_a_stored_stream_still_generating_is_in_progress_while_redis_does_not_answer(gateway, redis_server):
    """Gateway state on Redis: a GET of a stored stream still generating on this gateway, while
    Redis does not answer (paused), was the store's 503, though the gateway serving the stream
    knows it in progress: it answers from the stream, without the store."""
    go_on = asyncio.Event()
    async with fake_engine(_held_stream(go_on), paths=("/v1/responses",)) as url:
        gw = await gateway([model_block("m", "vllm", [url])], state={"redis_url": redis_server.url, "timeout_s": 0.2},
                           responses={"state": "gateway"})
        c = openai_client(gw)
        stream = await c.responses.create(model="m", input="weather?", stream=True)
        seen = await _to_first_arguments(stream)
        redis_server.pause()
        await until(lambda: process_stopped(redis_server.proc.pid), timeout=10)
        try:
            got = await c.responses.retrieve("resp_cut1")
            items = await c.responses.input_items.list("resp_cut1")
        finally:
            redis_server.resume()
            go_on.set()
        assert (got.id, got.status, got.model) == ("resp_cut1", "in_progress", "m")
        assert [i.content[0].text for i in items.data] == ["weather?"]
        seen += [ev.type async for ev in stream]
        assert seen[-1] == "response.completed"
        assert (await c.responses.retrieve("resp_cut1")).status == "completed"


async def test_a_stored_stream_its_client_leaves_is_no_longer_in_progress_on_another_replica(gateway, redis_server):
    """The record in progress a stored stream wrote as it started is removed when the stream ends
    without its record (its client left: nothing is kept), so no replica answers it in progress."""
    go_on = asyncio.Event()
    async with fake_engine(_held_stream(go_on), paths=("/v1/responses",)) as url:
        _c1, c2, stream, _seen = await _held_on_one_replica(gateway, redis_server, url)
        try:
            assert (await until_answered(lambda: c2.responses.retrieve("resp_cut1"))).status == "in_progress"
            await stream.close()

            async def gone() -> bool:
                try:
                    await c2.responses.retrieve("resp_cut1")
                except openai.NotFoundError:
                    return True
                return False
            assert await until(gone)
        finally:
            go_on.set()


@pytest.mark.parametrize("where", ["same", "other"])
async def test_a_stored_stream_deleted_while_generating_is_not_written_back_when_it_ends(
        gateway, redis_server, where):
    """Gateway state on Redis: a DELETE of a stored stream still generating, on its own replica or
    on another, removed its record in progress, and the record written as the stream ended brought
    the deleted response back. A DELETE wins: the deletion leaves a mark the end's write checks,
    so the response stays deleted for every replica and a follow-up."""
    go_on = asyncio.Event()
    async with fake_engine(_held_stream(go_on), paths=("/v1/responses",)) as url:
        c1, c2, stream, seen = await _held_on_one_replica(gateway, redis_server, url)
        deleter = c1 if where == "same" else c2
        try:
            await until_answered(lambda: deleter.responses.retrieve("resp_cut1"))
            await deleter.responses.delete("resp_cut1")
        finally:
            go_on.set()
        seen += [ev.type async for ev in stream]
        assert seen[-1] == "response.completed"
        for c in (c1, c2):
            with pytest.raises(openai.NotFoundError):
                await c.responses.retrieve("resp_cut1")
        with pytest.raises(openai.BadRequestError) as ei:
            await c2.responses.create(model="m", input="and then?", previous_response_id="resp_cut1")
        assert ei.value.body["code"] == "previous_response_not_found"


async def test_with_engine_state_a_stored_stream_still_generating_on_one_replica_is_in_progress_on_another(
        gateway, redis_server):
    """Engine state on Redis, two replicas: the affinity record of a stored stream was written as it
    ended, so another replica had no owner for it (a 404) while it ran. Its replica writes one as it
    starts, holding the response in progress: the second answers a GET ``in_progress`` and a cancel
    with the 400 of a response not created in the background, and once it ended sends a GET to the
    engine, as for any response."""
    go_on = asyncio.Event()

    async def retrieve(request: web.Request) -> web.Response:
        return web.json_response({"id": request.match_info["rid"], "object": "response", "model": "m",
                                  "status": "completed", "output": []})

    routes = (web.get("/v1/responses/{rid}", retrieve),)
    async with fake_engine(_held_stream(go_on), paths=("/v1/responses",), routes=routes) as url:
        _c1, c2, stream, seen = await _held_on_one_replica(gateway, redis_server, url, "engine")
        try:
            got = await until_answered(lambda: c2.responses.retrieve("resp_cut1"))
            with pytest.raises(openai.BadRequestError) as ei:
                await c2.responses.cancel("resp_cut1")
        finally:
            go_on.set()
        assert (got.id, got.status, got.model) == ("resp_cut1", "in_progress", "m")
        assert ei.value.body["message"] == "Cannot cancel a synchronous response."
        seen += [ev.type async for ev in stream]
        assert seen[-1] == "response.completed"
        assert (await c2.responses.retrieve("resp_cut1")).status == "completed"


async def until_answered(call):
    """``call()``'s answer once it is not a 404 (the record written as the stream started is
    written beside the client's first event, so a call right after that event may precede it)."""
    async with asyncio.timeout(10):
        while True:
            try:
                return await call()
            except openai.NotFoundError:
                await asyncio.sleep(0.02)


def _held_then_failing(go_on: asyncio.Event, how: str):
    """An engine streaming a stored response's first four events, then, once ``go_on`` is set,
    breaking its connection (``break``) or ending with its own ``error`` event (``error``)."""
    async def engine(request: web.Request) -> web.StreamResponse:
        await request.read()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for event in _function_call_events()[:4]:
            await out.write(event)
        await go_on.wait()
        if how == "error":
            await out.write(b'event: error\ndata: {"type":"error","code":null,"message":"Internal server error",'
                            b'"param":null,"sequence_number":4}\n\n')
            await out.write_eof()
            return out
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        return out
    return engine


@pytest.mark.parametrize("how", ["break", "error"])
async def test_a_stored_stream_deleted_while_generating_is_not_kept_when_it_fails(gateway, how):
    """Gateway state: a stored stream deleted while it generates is not kept when it ends; one that
    then failed (its engine broke, or ended it with its own error event) was kept as failed all
    the same, so the deleted id came back: a GET answered it failed, and its input_items listed
    its input. Its client still gets the error and response.failed; the id stays unknown."""
    go_on = asyncio.Event()
    async with fake_engine(_held_then_failing(go_on, how), paths=("/v1/responses",)) as url:
        gw = await gateway([model_block("m", "vllm", [url])], responses={"state": "gateway"})
        c = openai_client(gw)
        stream = await c.responses.create(model="m", input="weather?", stream=True)
        await _to_first_arguments(stream)
        try:
            await c.responses.delete("resp_cut1")
        finally:
            go_on.set()         # the engine fails its stream, whatever the DELETE answered
        events = [ev async for ev in stream]
        assert [ev.type for ev in events][-2:] == ["error", "response.failed"]
        assert events[-1].response.id == "resp_cut1"
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve("resp_cut1")
        with pytest.raises(openai.NotFoundError):
            await c.responses.input_items.list("resp_cut1")
        with pytest.raises(openai.BadRequestError) as ei:
            await c.responses.create(model="m", input="and then?", previous_response_id="resp_cut1")
        assert ei.value.body["code"] == "previous_response_not_found"


async def test_an_engine_that_breaks_mid_event_ends_the_stream_with_error_and_response_failed(gateway):
    """The half event an engine sent before its connection broke never reaches the client: the
    SDK reads the stream up to the gateway's error and response.failed events, rather than
    raising a JSON error on a frame that glued the half event to them."""
    async with fake_engine(_cut_responses_engine, paths=("/v1/responses",)) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        c = openai_client(gw)
        async with c.responses.stream(model="m", input="weather?") as stream:
            final = await stream.get_final_response()
        assert final.status == "completed" and final.output[0].arguments == '{"city":"Paris"}'
        for cut in (0, 1, 3, 4, 7):
            events = [ev async for ev in await c.responses.create(model="m", input="weather?", stream=True,
                                                                  extra_headers={"x-cut": str(cut)})]
            assert [ev.type for ev in events][-2:] == ["error", "response.failed"], cut
            # cut inside response.created: the gateway's own opens the stream (an id of the gateway's)
            assert events[0].type == "response.created" and (events[-1].response.id == "resp_cut1") == (cut > 0)
            assert events[-1].response.id == events[0].response.id
            assert events[-1].response.error.code == "upstream_incomplete"
            assert [ev.sequence_number for ev in events] == list(range(len(events)))
            # the failed response carries the output items the client was sent, as they stood
            assert [(o.status, o.arguments) for o in events[-1].response.output] == {
                0: [], 1: [], 3: [("in_progress", "")], 4: [("in_progress", '{"city":')],
                7: [("completed", '{"city":"Paris"}')]}[cut], cut
            seen = []
            async with c.responses.stream(model="m", input="weather?", extra_headers={"x-cut": str(cut)}) as stream:
                async for ev in stream:
                    seen.append(ev.type)
            assert seen[-1] == "response.failed"


@pytest.mark.parametrize("state", ["engine", "gateway"])
async def test_a_stream_failed_before_response_created_takes_no_id_the_client_chose(sims, gateway, state):
    """The response the gateway fails before the engine announced one gets an id of the gateway's,
    not one the client can choose (its x-request-id): a failed stream's record named after another
    user's response would replace it, so that user's GET and follow-up found nothing."""
    sim = await sims("vllm", "m", enable_responses_store=True)
    async with fake_engine(_cut_responses_engine, paths=("/v1/responses",)) as url:
        gw = await gateway([model_block("m", "vllm", [sim.url]), model_block("cut", "vllm", [url])],
                           responses={"state": state}, auth=KEYS)
        alice, bob = openai_client(gw, ALICE), openai_client(gw, BOB)
        r = await alice.responses.create(model="m", input="hello", max_output_tokens=3)
        events = [ev async for ev in await bob.responses.create(
            model="cut", input="x", stream=True, extra_headers={"x-cut": "0", "x-request-id": r.id[len("resp_"):]})]
        failed = events[-1].response
        assert failed.status == "failed" and failed.id.startswith("resp_") and failed.id != r.id
        assert events[0].response.id == failed.id
        assert (await bob.responses.retrieve(failed.id)).status == "failed"
        assert (await alice.responses.retrieve(r.id)).status == r.status
        assert (await alice.responses.create(model="m", input="more", previous_response_id=r.id,
                                             max_output_tokens=3)).status == r.status
        with pytest.raises(openai.NotFoundError):
            await bob.responses.retrieve(r.id)


async def test_a_background_stream_failed_before_its_engine_announced_it_is_kept_failed(gateway):
    """Engine state: a ``background`` stream whose engine broke before its ``response.created``
    gets the gateway's ``response.created`` and ``response.failed`` of an id of the gateway's, which
    no engine holds; it was not kept (a background response is left to its engine), so a GET of
    the id the client was given was a 404. It is kept failed, as a stream that is not background."""
    async with fake_engine(_cut_responses_engine, paths=("/v1/responses",)) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        c = openai_client(gw)
        events = [ev async for ev in await c.responses.create(model="m", input="x", background=True, stream=True,
                                                              extra_headers={"x-cut": "0"})]
        assert [e.type for e in events] == ["response.created", "error", "response.failed"]
        got = await c.responses.retrieve(events[-1].response.id)
        assert (got.id, got.status, got.error.code) == (events[0].response.id, "failed", "upstream_incomplete")
        with pytest.raises(openai.BadRequestError) as ei:
            await c.responses.create(model="m", input="more", previous_response_id=got.id)
        assert ei.value.body["param"] == "previous_response_id"


def _background_events(rid: str) -> list[bytes]:
    """A background Responses stream of four deltas, framed as vLLM frames it."""
    resp = {"id": rid, "object": "response", "created_at": 1, "model": "m", "status": "queued",
            "background": True, "output": []}
    events = [("response.created", {"response": resp}), ("response.in_progress", {"response": resp})]
    events += [("response.output_text.delta", {"item_id": "msg_1", "output_index": 0, "content_index": 0,
                                               "delta": f" w{i}"}) for i in range(4)]
    events.append(("response.completed", {"response": {**resp, "status": "completed"}}))
    return [b"event: " + name.encode() + b"\ndata: "
            + orjson.dumps({"type": name, "sequence_number": i, **data}) + b"\n\n"
            for i, (name, data) in enumerate(events)]


async def _background_engine(request: web.Request) -> web.StreamResponse:
    await request.read()
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    for event in _background_events("resp_bg1"):
        await out.write(event)
    await out.write_eof()
    return out


async def _background_replay(request: web.Request) -> web.StreamResponse:
    """GET ?stream=true of a background response: its events after ``starting_after``; ``cut``:
    ``end`` ends the stream before its terminal event, ``break`` breaks the connection in the
    middle of an event."""
    after = int(request.query.get("starting_after", "-1"))
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    rest = _background_events(request.match_info["rid"])[after + 1:]
    for event in rest[:2]:
        await out.write(event)
    if request.query.get("cut") == "break":
        await out.write(rest[2][:20])
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        return out
    await out.write_eof()
    return out


async def test_a_background_stream_closed_early_by_an_engine_that_does_not_answer_its_get_ends_with_an_error(gateway):
    """A background stream its engine closed before its terminal event is asked of its engine (was
    it cancelled?); an engine that takes that GET and never answers it held the client's stream
    open for the upstream timeouts (300 s by default) before its error event. It is asked within
    the health probe's bound, ``health.timeout_s``, then the stream ends with the error event."""
    never = asyncio.Event()

    async def engine(request: web.Request) -> web.StreamResponse:
        await request.read()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for event in _background_events("resp_bg1")[:3]:
            await out.write(event)
        await out.write_eof()
        return out

    async def retrieve(request: web.Request) -> web.Response:
        await never.wait()
        return web.json_response({})

    routes = (web.get("/v1/responses/{rid}", retrieve),)
    async with fake_engine(engine, paths=("/v1/responses",), routes=routes) as url:
        gw = await gateway([model_block("m", "vllm", [url])], health={"timeout_s": 0.5})
        c = openai_client(gw)

        async def read() -> list:
            stream = await c.responses.create(model="m", input="hi", background=True, stream=True)
            return [event async for event in stream]
        try:
            events = await asyncio.wait_for(read(), 30)
        finally:
            never.set()         # the engine answers its GET at last, whatever the stream saw
        assert [e.type for e in events][-1] == "error" and events[-1].code == "upstream_incomplete"


async def test_a_resumed_background_stream_that_breaks_ends_with_an_error_event(gateway):
    """A background stream resumed with a GET (``stream=true&starting_after=``) whose engine ends it
    before its terminal event, cleanly or by breaking the connection, ends with the gateway's
    ``error`` event (upstream_incomplete, its sequence number next), as a created stream does, so
    the client knows to resume again; the response goes on on its engine, so it is not failed."""
    replay = web.get("/v1/responses/{rid}", _background_replay)
    async with fake_engine(_background_engine, paths=("/v1/responses",), routes=(replay,)) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        c = openai_client(gw)
        stream = await c.responses.create(model="m", input="x", background=True, stream=True)
        rid = [ev async for ev in stream][0].response.id
        for cut in ("end", "break"):
            rest = await c.responses.retrieve(rid, stream=True, starting_after=1, extra_query={"cut": cut})
            events = [ev async for ev in rest]
            assert [ev.type for ev in events] == ["response.output_text.delta"] * 2 + ["error"], cut
            assert [ev.sequence_number for ev in events] == [2, 3, 4], cut
            assert events[-1].code == "upstream_incomplete"


async def test_a_background_stream_the_gateway_cuts_ends_with_an_error_event_and_is_resumed(sims, gateway):
    """A background stream the gateway ends (here its watchdog, the engine silent a while) goes on
    on its engine: the client's stream ends with the error event alone, not a response.failed that
    says the response failed while it completes, and a resume from its last event reads the rest
    up to response.completed."""
    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])], watchdog={"aggregated": True, "idle_timeout_s": 0.2})
    c = openai_client(gw)
    stream = await c.responses.create(model="m", input="x", background=True, stream=True, max_output_tokens=6,
                                      extra_headers={"x-sim-fault": "stall_after=2:0.6"})
    events = [ev async for ev in stream]
    assert events[-1].type == "error" and events[-1].code == "upstream_timeout", [ev.type for ev in events]
    assert "response.failed" not in [ev.type for ev in events]
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    rest = [ev async for ev in await c.responses.retrieve(events[0].response.id, stream=True,
                                                           starting_after=events[-2].sequence_number)]
    assert rest[-1].type == "response.completed" and rest[-1].response.usage.output_tokens == 6


@pytest.mark.parametrize("state", ["engine", "gateway"])
async def test_streaming_a_response_not_created_in_the_background_is_refused_in_either_state_mode(
        sims, gateway, state):
    """GET ?stream=true replays a background stream only; of any other response (OpenAI and vLLM
    answer a 400 naming stream) the gateway's own records, a failed response's or gateway-held
    history's, are refused the same way, where they answered the JSON object, which the openai SDK
    read as a stream of no events."""
    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])], responses={"state": state})
    c = openai_client(gw)
    stream = await c.responses.create(model="m", input="x", max_output_tokens=20, stream=True,
                                      extra_headers={"x-sim-fault": "drop_after=2"})
    failed = [ev async for ev in stream][-1].response
    done = await c.responses.create(model="m", input="x", max_output_tokens=3)
    assert (failed.status, done.status) == ("failed", "incomplete")     # answered, 3 tokens cut it
    # engine state: the answered one is its engine's to answer (its own 400), the failed one the gateway's
    for rid, ours in ((failed.id, True), (done.id, state == "gateway")):
        with pytest.raises(openai.BadRequestError) as ei:
            [ev async for ev in await c.responses.retrieve(rid, stream=True)]
        if ours:
            assert ei.value.body["param"] == "stream" and "background=true" in ei.value.body["message"]
    assert (await c.responses.retrieve(failed.id, extra_query={"stream": "false"})).status == "failed"
    assert (await c.responses.retrieve(done.id)).status == "incomplete"


async def _erring_engine(request: web.Request) -> web.StreamResponse:
    """An engine's stream that opens, sends a token, then its own ``error`` event and ends, as vLLM
    ends a stream whose generation failed (a ``GenerationError``: an error event, then no terminal
    event); with ``x-failed``, a ``response.failed`` of its own follows the error."""
    body = await request.json()
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    resp = {"id": "resp_err1", "object": "response", "created_at": 1, "model": "m", "status": "in_progress",
            "output": [], "store": body.get("store", True)}
    item = {"type": "message", "id": "msg_1", "role": "assistant", "status": "in_progress", "content": []}
    events = [("response.created", {"response": resp}), ("response.in_progress", {"response": resp}),
              ("response.output_item.added", {"output_index": 0, "item": item}),
              ("response.content_part.added", {"output_index": 0, "content_index": 0, "item_id": "msg_1",
                                               "part": {"type": "output_text", "text": "", "annotations": []}}),
              ("response.output_text.delta", {"output_index": 0, "content_index": 0, "item_id": "msg_1",
                                              "delta": "Hi", "logprobs": []}),
              ("error", {"code": None, "message": "Internal server error", "param": None})]
    if "x-failed" in request.headers:
        events.append(("response.failed", {"response": {**resp, "status": "failed", "error": {
            "code": "server_error", "message": "the engine's own"}}}))
    for seq, (name, data) in enumerate(events):
        await out.write(f"event: {name}\ndata: ".encode() + orjson.dumps({"type": name, "sequence_number": seq, **data})
                        + b"\n\n")
    if "x-break" in request.headers:        # its connection breaks after the error, where vLLM's closes
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        return out
    await out.write_eof()
    return out


@pytest.mark.parametrize("state", ["engine", "gateway"])
async def test_an_engines_error_event_that_ends_its_stream_is_followed_by_response_failed(gateway, state):
    """An engine stream that ends with its own ``error`` event and no terminal event (vLLM's on a
    generation error) ends for the client as every failed stream does: the error, then
    ``response.failed`` with the engine's message, which the SDK reads and the gateway keeps (a GET
    answers it failed, a follow-up is a 400), where the stream stopped at the error and the id the
    client was given in response.created was unknown (a 404). An engine's own response.failed
    after its error is passed on alone."""
    async with fake_engine(_erring_engine, paths=("/v1/responses",)) as url:
        gw = await gateway([model_block("m", "vllm", [url])], responses={"state": state})
        c = openai_client(gw)
        events = [ev async for ev in await c.responses.create(model="m", input="hi", stream=True)]
        assert [ev.type for ev in events][-2:] == ["error", "response.failed"]
        assert [ev.sequence_number for ev in events] == list(range(len(events)))
        failed = events[-1].response
        assert (failed.id, failed.status) == ("resp_err1", "failed")
        assert (failed.error.code, failed.error.message) == ("server_error", "Internal server error")
        assert [(o.id, o.status, [p.text for p in o.content]) for o in failed.output] == [("msg_1", "in_progress", ["Hi"])]
        async with c.responses.stream(model="m", input="hi") as stream:      # the SDK's helper reads it too
            seen = [ev.type async for ev in stream]
        assert seen[-2:] == ["error", "response.failed"]
        got = await c.responses.retrieve("resp_err1")
        assert (got.status, got.error.message) == ("failed", "Internal server error")
        with pytest.raises(openai.BadRequestError) as ei:
            await c.responses.create(model="m", input="go on", previous_response_id="resp_err1")
        assert ei.value.body["param"] == "previous_response_id"
        events = [ev async for ev in await c.responses.create(model="m", input="hi", stream=True,
                                                              extra_headers={"x-failed": "1"})]
        assert [ev.type for ev in events][-3:] == ["response.output_text.delta", "error", "response.failed"]
        assert events[-1].response.error.message == "the engine's own"


@pytest.mark.parametrize("state", ["engine", "gateway"])
async def test_an_engine_that_breaks_after_its_own_error_event_ends_the_stream_with_that_error(gateway, state):
    """An engine whose connection breaks after its own ``error`` event, where vLLM's closes: that
    error alone ends the stream (no ``upstream_incomplete`` error after it) and names the failure,
    in ``response.failed`` and in the response kept."""
    async with fake_engine(_erring_engine, paths=("/v1/responses",)) as url:
        gw = await gateway([model_block("m", "vllm", [url])], responses={"state": state})
        c = openai_client(gw)
        events = [ev async for ev in await c.responses.create(model="m", input="hi", stream=True,
                                                              extra_headers={"x-break": "1"})]
        assert [ev.type for ev in events][-3:] == ["response.output_text.delta", "error", "response.failed"]
        assert [ev.sequence_number for ev in events] == list(range(len(events)))
        assert events[-2].message == events[-1].response.error.message == "Internal server error"
        got = await c.responses.retrieve("resp_err1")
        assert (got.status, got.error.message) == ("failed", "Internal server error")


async def test_a_cancel_whose_chunked_body_is_over_the_limit_is_one_413_with_one_line(sims, gateway):
    """A call on a stored response relayed to its engine reads its body within server.max_body_bytes:
    a chunked one past it is the 413 body_too_large, whose one request log line says 413, where the
    call's line said status 0 (aiohttp's 413 passed by the call's own answer) and the answer came
    from the error middleware."""
    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])], server={"max_body_bytes": 65_536})
    r = await openai_client(gw).responses.create(model="m", input="hello", max_output_tokens=2)
    body = b"{" + b" " * 100_000 + b"}"
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 16_384]), body[i:i + 16_384])
                       for i in range(0, len(body), 16_384)) + b"0\r\n\r\n"
    head = (f"POST /v1/responses/{r.id}/cancel HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    with gw.gw.request_log.capture() as got:
        ex = await exchange(gw.port, head + chunked, wait=5.0, until_close=False, responses=1)
        err = assert_openai_error(ex.first, 413)
        assert err["code"] == "body_too_large", err
        rid = ex.first.headers["request-id"]
        await wait_for(lambda: any(x["request_id"] == rid for x in got), timeout=5.0, interval=0.01)
        await openai_client(gw).models.list()       # a later request: a second line would be written by now
    assert [(x["request_id"], x["status"]) for x in got if x["path"] == f"/v1/responses/{r.id}/cancel"] == [
        (rid, 413)], got


async def test_a_cancel_whose_body_breaks_or_whose_client_leaves_has_one_line_with_its_answer_s_status(sims, gateway):
    """A call on a stored response relayed to its engine whose body breaks as it comes (bytes that are
    not gzip under gzip, sent after the head) gets the edge's 400, whose line is the call's one line
    (the call's request id replaced by the answer's, status 400, error_class http), and a call whose
    client leaves before its body is in is a 499 client_cancel; both lines said status 0, and the
    edge's 400 had a second line of its own."""
    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    r = await openai_client(gw).responses.create(model="m", input="hello", max_output_tokens=2)
    path = f"/v1/responses/{r.id}/cancel"
    head = (f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            "Content-Encoding: gzip\r\nContent-Length: 10\r\n\r\n").encode()
    with gw.gw.request_log.capture() as got:
        ex = await exchange(gw.port, head, b"0123456789", wait=5.0)
        assert ex.closed and len(ex.responses) == 1
        err = assert_openai_error(ex.first, 400)
        assert err["code"] == "bad_body", err
        rid = ex.first.headers["request-id"]
        await wait_for(lambda: any(x["request_id"] == rid for x in got), timeout=5.0, interval=0.01)
        # the client that leaves: its head, part of its body, then gone
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(head.replace(b"Content-Encoding: gzip\r\n", b"") + b"01234")
        await writer.drain()
        await wait_for(lambda: any(p._e_request is not None for p in gw.runner.server.connections), timeout=5.0,
                       interval=0.005)
        writer.close()
        await wait_for(lambda: len([x for x in got if x["path"] == path]) >= 2, timeout=5.0, interval=0.01)
        await openai_client(gw).models.list()       # a later request: a third line would be written by now
    mine = [(x["status"], x["error_class"]) for x in got if x["path"] == path]
    assert mine == [(400, "http"), (499, "client_cancel")], [x for x in got if x["path"] == path]
    assert [x["request_id"] for x in got if x["path"] == path][0] == rid


async def test_gateway_history_refuses_an_input_item_its_history_already_holds(sims, gateway):
    """A follow-up that sends again an item of its history (the function call it answers, with its
    id) is OpenAI's 400 naming `input`: kept, the record would list that id twice, and the SDK's
    auto-pagination of input_items, which goes on after the last id of a page, would go round
    forever; the engine would be shown the call twice."""
    sim = await sims("vllm", "m", tool_call_parser="hermes")
    gw = await gateway([model_block("m", "vllm", [sim.url])], responses={"state": "gateway"})
    c = openai_client(gw)
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    r = await c.responses.create(model="m", input="Weather in Paris?", tools=tools, max_output_tokens=3)
    call = r.output[0]
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    with pytest.raises(openai.BadRequestError) as ei:
        await c.responses.create(model="m", previous_response_id=r.id, tools=tools, max_output_tokens=3,
                                 input=[call.model_dump(exclude_none=True), answer])
    assert ei.value.body["param"] == "input" and call.id in ei.value.body["message"]
    with pytest.raises(openai.BadRequestError) as ei:        # twice in one input, too
        await c.responses.create(model="m", tools=tools, max_output_tokens=3,
                                 input=[{"role": "user", "content": "hi", "id": "msg_1", "type": "message"},
                                        {"role": "user", "content": "again", "id": "msg_1", "type": "message"}])
    assert ei.value.body["param"] == "input"
    n = len(posts(await sim_state(sim.url)))
    done = await c.responses.create(model="m", previous_response_id=r.id, tools=tools, max_output_tokens=3,
                                    input=[answer, {"role": "user", "content": "and Rome?"}])
    assert n == 1 and len(posts(await sim_state(sim.url))) == 2
    ids = [i.id async for i in c.responses.input_items.list(done.id, limit=1)]
    assert len(ids) == len(set(ids)) == 4


async def test_gateway_history_carries_no_instructions_over(sims, gateway):
    """As OpenAI: a follow-up is prompted with its own instructions only, the earlier turns'
    are not part of the history the gateway keeps and sends."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], responses={"state": "gateway"})
    c = openai_client(gw)
    r = await c.responses.create(model="m", instructions="Answer in French.", input="Hello", max_output_tokens=2)
    await c.responses.create(model="m", previous_response_id=r.id, input="and then?", max_output_tokens=2)
    await c.responses.create(model="m", previous_response_id=r.id, instructions="Answer in Latin.", input="so?",
                             max_output_tokens=2)
    second, third = [p["body"] for p in posts(await sim_state(sim.url))[1:]]
    assert "instructions" not in second and third["instructions"] == "Answer in Latin."
    for body in (second, third):
        assert [i["role"] for i in body["input"]] == ["user", "assistant", "user"]
        assert "French" not in orjson.dumps(body).decode()


@pytest.mark.parametrize("state", ["engine", "gateway"])
async def test_sglang_whole_answer_usage_is_in_openai_responses_names(sims, gateway, state):
    """SGLang's whole Responses answer (and the response its store gives back) carries its chat usage,
    prompt_tokens and completion_tokens; the client of the Responses API reads input_tokens and
    output_tokens (+ their details), as SGLang's own stream and vLLM's answers name them."""
    sim = await sims("sglang", "m")
    gw = await gateway([model_block("m", "sglang", [sim.url])], responses={"state": state})
    c = openai_client(gw)
    raw = await c.responses.with_raw_response.create(model="m", input="Hello there", max_output_tokens=4)
    usage = orjson.loads(raw.content)["usage"]
    r = raw.parse()
    assert set(usage) == {"input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details",
                          "total_tokens"}
    assert r.usage.output_tokens == 4 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + 4
    assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    got = await c.responses.retrieve(r.id)           # the engine's stored copy, or the gateway's
    assert got.usage.input_tokens == r.usage.input_tokens and got.usage.output_tokens == 4
    text = await gw.metrics_text()
    assert f'switchyard_prompt_tokens_total{{model="m"}} {float(r.usage.input_tokens)}' in text
    assert 'switchyard_completion_tokens_total{model="m"} 4.0' in text


def _reasoning_engine(inputs: list):
    """A reasoning model's whole answers: a reasoning item and a message, ids of its own each time;
    every input it is sent is kept in ``inputs``."""
    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        inputs.append(body["input"])
        n = len(inputs)
        return web.json_response({
            "id": f"resp_{n}", "object": "response", "created_at": 1, "model": body["model"], "status": "completed",
            "output": [{"id": f"rs_{n}", "type": "reasoning", "summary": [],
                        "content": [{"type": "reasoning_text", "text": "thinking"}]},
                       {"id": f"msg_{n}", "type": "message", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": f"answer {n}", "annotations": []}]}],
            "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}})
    return handler


async def test_gateway_history_refuses_a_resent_assistant_or_reasoning_item(gateway):
    """A client that sends the previous output items again in ``input`` with previous_response_id
    (its reasoning and its assistant message, with their ids) is OpenAI's 400 naming the duplicate id,
    a turn back in the chain too: kept, the engine would be prompted with that turn twice."""
    inputs: list = []
    async with fake_engine(_reasoning_engine(inputs), paths=("/v1/responses",)) as url:
        gw = await gateway([model_block("m", "vllm", [url])], responses={"state": "gateway"})
        c = openai_client(gw)
        r1 = await c.responses.create(model="m", input="one")
        again = [i.model_dump(exclude_none=True) for i in r1.output]
        for resent in (again, again[1:], [{"type": "item_reference", "id": "msg_1"}]):
            with pytest.raises(openai.BadRequestError) as ei:
                await c.responses.create(model="m", previous_response_id=r1.id,
                                         input=[*resent, {"role": "user", "content": "two"}])
            assert ei.value.body["param"] == "input"
            assert f"Duplicate item found with id {resent[0]['id']}." in ei.value.body["message"]
        r2 = await c.responses.create(model="m", previous_response_id=r1.id, input="two")
        with pytest.raises(openai.BadRequestError) as ei:        # a turn back
            await c.responses.create(model="m", previous_response_id=r2.id,
                                     input=[again[1], {"role": "user", "content": "three"}])
        assert "msg_1" in ei.value.body["message"]
        r3 = await c.responses.create(model="m", previous_response_id=r2.id, input="three")
        assert r3.output_text == "answer 3"
        assert len(inputs) == 3             # no refused request reached the engine
        assert [i["content"] for i in inputs[2]] == ["one", "answer 1", "two", "answer 2", "three"]


async def test_a_record_key_of_another_type_is_a_503_that_says_so_not_unreachable(sims, gateway, redis_server):
    """Redis answers WRONGTYPE when a response's record key holds another type (another application
    wrote it): the 503 says the store holds a key of another type under the response's name, not
    that the store is unreachable (it answered), and tells nothing of what that key holds."""
    import redis.asyncio as aioredis

    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])], state={"redis_url": redis_server.url})
    c = openai_client(gw)
    r = await c.responses.create(model="m", input="Hello", max_output_tokens=3)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        keys = [k async for k in client.scan_iter(match=f"*{r.id}*")]
        assert keys, "no record of the response in Redis"
        for k in keys:
            await client.delete(k)
            await client.hset(k, "secret-field", "secret-value")
    finally:
        await client.aclose()
    for call in (c.responses.retrieve(r.id), c.responses.delete(r.id)):
        with pytest.raises(openai.APIStatusError) as got:
            await call
        assert got.value.status_code == 503
        err = got.value.body
        assert "another type" in err["message"] and "unreachable" not in err["message"], err
        assert "secret" not in err["message"], err


async def test_gateway_history_written_with_an_item_twice_lists_and_continues_it_once(sims, gateway, redis_server):
    """A record an older release wrote (before a resent item was refused, before records kept the
    ids of the turns before: no ``ids``) can hold one item id twice in its input. Its input_items
    list that id once, so the SDK's auto-pagination, which goes on after a page's last id, ends
    (it went round that id forever), and a follow-up shows the engine the item once and keeps it
    once, where every later turn carried the repeat on."""
    import redis.asyncio as aioredis

    sim = await sims("vllm", "m", tool_call_parser="hermes")
    gw = await gateway([model_block("m", "vllm", [sim.url])], responses={"state": "gateway"},
                       state={"redis_url": redis_server.url})
    c = openai_client(gw)
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    r = await c.responses.create(model="m", input="Weather in Paris?", tools=tools, max_output_tokens=3)
    call = r.output[0]
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    r2 = await c.responses.create(model="m", previous_response_id=r.id, tools=tools, max_output_tokens=3,
                                  input=[answer, {"role": "user", "content": "and Rome?"}])
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        [key] = [k async for k in client.scan_iter(match=f"*:resp:hist:{r2.id}")]
        record = orjson.loads(await client.get(key))
        # as an older release kept it: the call sent again before its answer, no ids of the turns before
        record["input"].insert(2, call.model_dump(exclude_none=True))
        record.pop("ids", None)
        await client.set(key, orjson.dumps(record))
    finally:
        await client.aclose()
    ids = []
    async for item in c.responses.input_items.list(r2.id, limit=1):
        ids.append(item.id)
        if len(ids) > 20:
            break
    assert len(ids) == len(set(ids)) == 4, ids
    r3 = await c.responses.create(model="m", previous_response_id=r2.id, tools=tools, max_output_tokens=3,
                                  input="and Oslo?")
    sent = posts(await sim_state(sim.url))[-1]["body"]["input"]
    assert [i.get("id") for i in sent].count(call.id) == 1, sent
    ids = [i.id async for i in c.responses.input_items.list(r3.id, limit=100)]
    assert len(ids) == len(set(ids)) and ids.count(call.id) == 1, ids


async def test_gateway_history_written_with_chat_usage_is_retrieved_in_responses_names(sims, gateway, redis_server):
    """A record an older release wrote of SGLang's whole answer holds the engine's chat usage
    (prompt_tokens, completion_tokens: that release stored the answer as it came). A GET of it
    answers the usage in the Responses API's names, as the answer itself now is, where the SDK's
    usage.input_tokens and output_tokens were None."""
    import redis.asyncio as aioredis

    sim = await sims("sglang", "m")
    gw = await gateway([model_block("m", "sglang", [sim.url])], responses={"state": "gateway"},
                       state={"redis_url": redis_server.url})
    c = openai_client(gw)
    r = await c.responses.create(model="m", input="Hello there", max_output_tokens=4)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        [key] = [k async for k in client.scan_iter(match=f"*:resp:hist:{r.id}")]
        record = orjson.loads(await client.get(key))
        u = r.usage
        record["response"]["usage"] = {"prompt_tokens": u.input_tokens, "completion_tokens": 4,
                                       "total_tokens": u.input_tokens + 4, "reasoning_tokens": 0,
                                       "prompt_tokens_details": {"cached_tokens": 0}}
        await client.set(key, orjson.dumps(record))
    finally:
        await client.aclose()
    got = await c.responses.retrieve(r.id)
    assert (got.usage.input_tokens, got.usage.output_tokens, got.usage.total_tokens) == \
        (u.input_tokens, 4, u.input_tokens + 4), got.usage
    assert got.usage.input_tokens_details.cached_tokens == 0 and got.usage.output_tokens_details.reasoning_tokens == 0


WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


@pytest.mark.parametrize("state", ["engine", "gateway"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_function_calling_conversation_is_prompted_as_the_engine_renders_tool_calls(
        sims, gateway, state, stream):
    """A two-turn function-calling conversation through the gateway: the call, then its output
    with `previous_response_id`. The follow-up is prompted as vLLM builds the chat it runs from
    the items: a `function_call` an assistant turn with that `tool_calls` entry, its output a
    `tool` message naming the call. Its answer is the chat completion's of that conversation.
    The engine expands a chain without the previous output's calls (vLLM keeps only its
    messages); gateway-held history sends the call itself."""
    sim = await sims("vllm", "m", tool_call_parser="hermes", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])], responses={"state": state})
    c = openai_client(gw)

    async def ask(**kw):
        if not stream:
            return await c.responses.create(model="m", tools=[WEATHER], max_output_tokens=4, **kw)
        events = [ev async for ev in await c.responses.create(model="m", tools=[WEATHER], max_output_tokens=4,
                                                              stream=True, **kw)]
        return events[-1].response

    first = await ask(input="Weather in Paris?")
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = await ask(input=[answer], previous_response_id=first.id)
    assert second.status == "incomplete" and second.output[0].type == "message"
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}
    turns = [{"role": "user", "content": "Weather in Paris?"}]
    turns += [assistant] if state == "gateway" else []
    turns += [{"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    chat = await c.chat.completions.create(model="m", messages=turns, max_tokens=4, tools=[
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # the whole conversation sent again, no previous_response_id: the call is the assistant's turn
    whole = await ask(input=[{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
                             answer], store=False)
    if state == "gateway":
        assert whole.output_text == second.output_text
    else:
        chat = await c.chat.completions.create(model="m", messages=turns[:1] + [assistant] + turns[1:], max_tokens=4,
                                               tools=[{"type": "function", "function": {
                                                   "name": "get_weather", "parameters": {"type": "object"}}}])
        assert whole.output_text == chat.choices[0].message.content


async def test_a_stream_its_client_left_logs_the_response_id_it_announced(sims, gateway):
    """A client that leaves a stream after `response.created` knows the response's id, and so
    does the operator it asks: the log line of the cut stream (a 499) names that id, as the
    line of a stream that ended does."""
    sim = await sims("vllm", "m", enable_responses_store=True, itl_ms=20.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    with gw.gw.request_log.capture() as lines:
        async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/responses", json={
                "model": "m", "input": "a long story", "stream": True, "max_output_tokens": 500}) as r:
            head = b""
            while b"response.output_text.delta" not in head:
                head += await r.content.readany()
            rid = orjson.loads(head.split(b"data: ", 1)[1].split(b"\n", 1)[0])["response"]["id"]
        assert await wait_for(lambda: len(lines) == 1, timeout=10.0)
    assert (lines[0]["status"], lines[0]["error_class"]) == (499, "client_cancel")
    assert lines[0].get("response_id") == rid
    # as at OpenAI, a stream that is not a background one ends with its connection: nothing is kept
    assert await wait_for(lambda: sim.engine.num_live == 0)
    c = openai_client(gw)
    with pytest.raises(openai.NotFoundError):
        await c.responses.retrieve(rid)
    with pytest.raises(openai.BadRequestError) as ei:
        await c.responses.create(model="m", input="go on", previous_response_id=rid, max_output_tokens=2)
    assert ei.value.body["code"] == "previous_response_not_found"


async def test_a_background_stream_on_sglang_is_refused_up_front_naming_background(sims, gateway):
    """SGLang answers a ``background`` request with its queued response whole, ``stream`` or not
    (its ``create_responses`` returns it before it looks at ``stream``), and it keeps no stream's
    events to replay. A ``background: true, stream: true`` request for a model only SGLang serves is
    a 400 naming ``background`` before any engine is asked; a model that also has vLLM endpoints
    sends it to them, and a follow-up whose previous response an SGLang engine holds is refused the
    same way. Nothing is counted against the engine."""
    s = await sims("sglang", "m")
    v = await sims("vllm", "mix", enable_responses_store=True)
    s2 = await sims("sglang", "mix")
    gw = await gateway([model_block("m", "sglang", [s.url]),
                        model_block("mix", "vllm", [v.url, {"url": s2.url, "engine": "sglang"}])])
    c = openai_client(gw)
    with pytest.raises(openai.BadRequestError) as ei:
        await c.responses.create(model="m", input="hi", background=True, stream=True, max_output_tokens=4)
    assert ei.value.body["param"] == "background" and "SGLang" in ei.value.body["message"]
    assert posts(await sim_state(s.url)) == []
    # the same request without stream is SGLang's to serve: its queued response, then its GET
    queued = await c.responses.create(model="m", input="hi", background=True, max_output_tokens=4)
    assert queued.status in ("queued", "in_progress")
    # a model that mixes engines streams it from vLLM, every time
    for _ in range(3):
        events = [ev async for ev in await c.responses.create(model="mix", input="hi", background=True,
                                                               stream=True, max_output_tokens=4)]
        assert events[-1].type == "response.completed"
    assert posts(await sim_state(s2.url)) == []
    # a follow-up of a response the SGLang engine holds can only go there: refused too
    held = await c.responses.create(model="m", input="hi", max_output_tokens=3)
    with pytest.raises(openai.BadRequestError) as ei:
        await c.responses.create(model="m", input="more", previous_response_id=held.id, background=True,
                                 stream=True, max_output_tokens=3)
    assert ei.value.body["param"] == "background"
    assert len(posts(await sim_state(s.url))) == 2
    text = await gw.metrics_text()
    assert "switchyard_upstream_errors_total{" not in text
    assert 'switchyard_requests_total{model="m",status="400"' in text


async def test_streaming_a_response_sglang_holds_is_refused_naming_stream(sims, gateway):
    """SGLang's GET of a stored response takes no query and no SGLang response was a background
    stream (the gateway refuses those): ``GET ?stream=true`` of one it holds, background or not, is
    the 400 naming ``stream`` that OpenAI and vLLM answer, where the engine's JSON object went out
    as the answer, which the openai SDK reads as a stream of no events. Without ``stream`` the GET
    is the engine's."""
    sim = await sims("sglang", "m")
    gw = await gateway([model_block("m", "sglang", [sim.url])])
    c = openai_client(gw)
    done = await c.responses.create(model="m", input="hi", max_output_tokens=3)
    queued = await c.responses.create(model="m", input="hi", background=True, max_output_tokens=3)
    for rid in (done.id, queued.id):
        with pytest.raises(openai.BadRequestError) as ei:
            [ev async for ev in await c.responses.retrieve(rid, stream=True)]
        assert ei.value.body["param"] == "stream" and "background=true" in ei.value.body["message"]
    assert (await c.responses.retrieve(done.id)).output_text == done.output_text

    async def completed():
        return (await c.responses.retrieve(queued.id)).status == "completed"
    await until(completed, timeout=10.0, interval=0.05)


async def test_a_stream_cut_midway_keeps_the_logprobs_it_streamed_in_its_failed_output(sims, gateway):
    """Logprobs asked for with ``include`` come on each text delta (vLLM's shape: token, logprob,
    top_logprobs) and pass through; a stream the engine's connection cut carries them, as streamed,
    in its response.failed's in-progress message, beside the text, not the part's empty ``[]``."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    c = openai_client(gw)
    ask = {"model": "m", "input": "x", "max_output_tokens": 8, "include": ["message.output_text.logprobs"],
           "top_logprobs": 2}
    whole = await c.responses.create(**ask)
    events = [ev async for ev in await c.responses.create(**ask, stream=True)]
    deltas = [ev for ev in events if ev.type == "response.output_text.delta"]
    streamed = [lp.model_dump() for ev in deltas for lp in ev.logprobs]
    assert len(streamed) == 8 and all(len(lp["top_logprobs"]) == 2 for lp in streamed)
    done = events[-1].response.output[0].content[0]
    assert [(lp.token, lp.logprob) for lp in done.logprobs] == [(lp["token"], lp["logprob"]) for lp in streamed]
    assert [lp.model_dump() for lp in done.logprobs] == [lp.model_dump() for lp in whole.output[0].content[0].logprobs]

    events = [ev async for ev in await c.responses.create(**ask, stream=True,
                                                          extra_headers={"x-sim-fault": "drop_after=3"})]
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    deltas = [ev for ev in events if ev.type == "response.output_text.delta"]
    streamed = [lp.model_dump() for ev in deltas for lp in ev.logprobs]
    assert len(streamed) == 3
    part = events[-1].response.output[0].content[0]
    assert part.text == "".join(ev.delta for ev in deltas)
    assert [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs]) for lp in part.logprobs] == [
        (lp["token"], lp["logprob"], [(t["token"], t["logprob"]) for t in lp["top_logprobs"]]) for lp in streamed]
    # the same tokens as the whole answer's first three (seed and prompt alike), shaped as its part's (bytes too)
    assert [lp.model_dump() for lp in part.logprobs] == [lp.model_dump() for lp in whole.output[0].content[0].logprobs[:3]]


async def test_reasoning_passes_through_is_counted_and_a_cut_keeps_what_was_thought(sims, gateway):
    """vLLM's reasoning (a reasoning item: reasoning_part and reasoning_text events) reaches the
    openai SDK's ``responses.stream`` as the engine sent it, its ``reasoning_tokens`` in the usage
    and its deltas timed as tokens; a stream cut while it reasons carries the reasoning item in
    progress, with the text streamed so far, in its response.failed output."""
    sim = await sims("vllm", "m", reasoning_parser="deepseek_r1")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    c = openai_client(gw)
    async with c.responses.stream(model="m", input="think", max_output_tokens=8) as stream:
        events = [ev async for ev in stream]
        final = await stream.get_final_response()
    thought = "".join(ev.delta for ev in events if ev.type == "response.reasoning_text.delta")
    assert [ev.type for ev in events].count("response.reasoning_text.delta") == 4 and thought
    assert [(o.type, o.status) for o in final.output] == [("reasoning", "completed"), ("message", "completed")]
    assert final.output[0].content[0].text == thought
    assert final.usage.output_tokens == 8 and final.usage.output_tokens_details.reasoning_tokens == 4
    text = await gw.metrics_text()
    assert 'switchyard_completion_tokens_total{model="m"} 8.0' in text
    assert 'switchyard_inter_token_latency_seconds_count{model="m"} 7.0' in text   # reasoning deltas too

    stream = await c.responses.create(model="m", input="think", max_output_tokens=8, stream=True,
                                      extra_headers={"x-sim-fault": "drop_after=2"})
    events = [ev async for ev in stream]
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    thought = "".join(ev.delta for ev in events if ev.type == "response.reasoning_text.delta")
    assert thought
    failed = events[-1].response
    assert [(o.type, o.status, [p.text for p in o.content]) for o in failed.output] == [
        ("reasoning", "in_progress", [thought])], failed.output
