"""API keys and limits as a client sees them (in-memory state): the OpenAI SDK on real sockets."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import anthropic
import openai
import orjson
import pytest
from aiohttp import web

from enginesim import SimConfig, start_sim
from gateway.tenants.service import NO_TENANCY
from tests.support.edge import assert_openai_error, exchange
from tests.support.factories import model_block
from tests.support.fake_engine import fake_engine
from tests.support.http import openai_client, sim_state
from tests.support.tenancy import ALICE, BOB, CHAT, KEYS, outcomes
from tests.support.waiting import until, wait_for


@pytest.fixture
async def recorder():
    """A minimal OpenAI-compatible engine that records the headers it receives."""
    seen: list[dict[str, str]] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        body = await request.json()
        return web.json_response({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

    async with fake_engine(chat) as url:
        yield url, seen


async def test_without_auth_the_authorization_header_reaches_the_engine(recorder, gateway):
    url, seen = recorder
    gw = await gateway([model_block("m", "vllm", [url])])
    assert gw.gw.tenancy is NO_TENANCY                      # nothing configured: no hooks at all
    await openai_client(gw, "engine-key").chat.completions.create(model="m", messages=CHAT)
    assert seen[-1]["Authorization"] == "Bearer engine-key"


async def test_missing_or_wrong_key_is_an_openai_401(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS)
    with pytest.raises(openai.AuthenticationError) as ei:
        await openai_client(gw, "sk-wrong").chat.completions.create(model="m", messages=CHAT)
    assert ei.value.status_code == 401
    assert ei.value.body == {"message": "Incorrect API key provided.", "type": "authentication_error",
                             "param": "api_key", "code": "invalid_api_key"}
    assert ei.value.response.headers["WWW-Authenticate"] == "Bearer"
    assert ei.value.response.headers["request-id"]
    with pytest.raises(openai.AuthenticationError):
        await openai_client(gw, "sk-wrong").models.list()       # listing models needs a key too
    async with aiohttp.ClientSession() as s:
        for hdrs in ({}, {"Authorization": "Basic YTpi"}, {"Authorization": "Bearer"}):
            async with s.post(gw.base_url + "/chat/completions", json={"model": "m", "messages": CHAT},
                              headers=hdrs) as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
    ok = await openai_client(gw, ALICE).chat.completions.create(model="m", messages=CHAT, max_tokens=2)
    assert ok.choices[0].message.content
    assert [m.id for m in (await openai_client(gw, BOB).models.list()).data] == ["m"]
    text = await gw.metrics_text()
    assert 'switchyard_auth_failures_total{reason="invalid"} 2.0' in text
    assert 'switchyard_auth_failures_total{reason="missing"} 3.0' in text


@pytest.mark.parametrize("forward", [False, True])
async def test_the_key_decides_the_user_not_the_user_header(recorder, gateway, forward):
    url, seen = recorder
    gw = await gateway([model_block("m", "vllm", [url])], auth={**KEYS, "forward_authorization": forward})
    await openai_client(gw, ALICE).chat.completions.create(model="m", messages=CHAT, extra_headers={"user": "bob"})
    hdrs = {k.lower(): v for k, v in seen[-1].items()}
    assert hdrs["user"] == "alice"                       # no impersonation through the header
    assert ("authorization" in hdrs) is forward          # the gateway key stays at the gateway by default


async def test_rpm_holds_exactly_under_a_concurrent_burst(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"rpm": 5}}})
    c = openai_client(gw, ALICE)
    got = await outcomes(c.chat.completions.create(model="m", messages=CHAT, max_tokens=2) for _ in range(12))
    assert got.count(200) == 5 and got.count("RateLimitError") == 7
    # bob has no limits; alice's are hers alone
    assert await outcomes(openai_client(gw, BOB).chat.completions.create(model="m", messages=CHAT, max_tokens=1)
                          for _ in range(8)) == [200] * 8
    with pytest.raises(openai.RateLimitError) as ei:
        await c.chat.completions.create(model="m", messages=CHAT)
    e = ei.value
    assert e.body["code"] == "rate_limit_exceeded" and e.body["message"] == "user: alice has exceeded RPM: 5"
    h = e.response.headers
    assert h["x-error-rpm-exceeded"] == "true" and h["x-ratelimit-limit-requests"] == "5"
    assert h["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(h["Retry-After"]) <= 60 and 0 < int(h["retry-after-ms"]) <= 60_000
    assert 'switchyard_rate_limited_total{limit="rpm",model="m",user="alice"} 8.0' in await gw.metrics_text()


async def test_rate_limit_headers_on_every_answer(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"rpm": 10, "tpm": 100000}}})
    c = openai_client(gw, ALICE)
    raw = await c.chat.completions.with_raw_response.create(model="m", messages=CHAT, max_tokens=3)
    h = raw.headers
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("10", "9")
    assert h["x-ratelimit-reset-requests"].endswith("s")
    assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-remaining-tokens"]) == ("100000", "100000")
    usage = raw.parse().usage
    # a stream gets them too, and the tokens of the first answer are charged by now
    async with c.chat.completions.with_streaming_response.create(model="m", messages=CHAT, max_tokens=3,
                                                                 stream=True) as resp:
        assert resp.headers["x-ratelimit-remaining-requests"] == "8"
        assert resp.headers["x-ratelimit-remaining-tokens"] == str(100000 - usage.total_tokens)
        async for _ in resp.iter_lines():
            pass
    # and an error answer from the engine (max_tokens beyond the context) too
    with pytest.raises(openai.BadRequestError) as ei:
        await c.chat.completions.create(model="m", messages=CHAT, max_tokens=10**6)
    assert ei.value.response.headers["x-ratelimit-remaining-requests"] == "7"


async def test_tpm_is_charged_from_streamed_usage_the_client_did_not_ask_for(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"tpm": 40}}})
    c = openai_client(gw, ALICE)
    stream = await c.chat.completions.create(model="m", messages=CHAT, max_tokens=30, stream=True)
    chunks = [ch async for ch in stream]
    assert all(ch.usage is None for ch in chunks)          # usage stays hidden from this client...
    tenancy = gw.gw.tenancy
    used = await wait_for(lambda: tenancy.state.usage("alice"))
    assert used["tokens"] > 30                              # ...but prompt + 30 completion tokens count
    with pytest.raises(openai.RateLimitError) as ei:
        await c.chat.completions.create(model="m", messages=CHAT, max_tokens=1)
    assert ei.value.body["message"] == "user: alice has exceeded TPM: 40"
    assert ei.value.response.headers["x-error-tpm-exceeded"] == "true"
    assert ei.value.response.headers["x-ratelimit-remaining-tokens"] == "0"


async def test_a_stream_dropped_before_its_end_is_charged_what_the_client_was_sent(sims, gateway):
    """No usage comes back from a stream the client drops, so the gateway counts the generated
    chunks it relayed: reading all but the end of a long stream is not a way around TPM."""
    sim = await sims("vllm", "m", itl_ms=5.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"tpm": 1000}}})
    body = {"model": "m", "messages": CHAT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {ALICE}"}) as r:
            assert r.status == 200
            got = 0
            async for line in r.content:
                got += line.startswith(b"data:") and b'"content"' in line
                if got >= 150:
                    break
            r.connection.transport.abort()           # gone before the end (and the usage)
    state = gw.gw.tenancy.state

    async def charged():
        tokens = (await state.usage("alice"))["tokens"]
        return tokens if tokens >= 150 else 0
    assert await wait_for(charged) >= 150, await state.usage("alice")


@pytest.mark.parametrize(("path", "body", "delta"), [
    ("/v1/messages", {"messages": CHAT, "max_tokens": 400}, b"event: content_block_delta"),
    ("/v1/responses", {"input": "hello there", "max_output_tokens": 400}, b"event: response.output_text.delta"),
])
async def test_a_messages_or_responses_stream_dropped_before_its_end_is_charged_what_was_sent(
        sims, gateway, path, body, delta):
    """As a chat stream: a Messages stream's usage before its end is message_start's (the prompt,
    no output) and a Responses stream's none, so the deltas relayed are what counts. Both were
    charged the prompt alone, so reading all but a long answer's last event cost no output tokens."""
    sim = await sims("vllm", "m", itl_ms=5.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"tpm": 1000}}})
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + path, json={"model": "m", "stream": True, **body},
                          headers={"Authorization": f"Bearer {ALICE}"}) as r:
            assert r.status == 200
            got = 0
            async for line in r.content:
                got += line.startswith(delta)
                if got >= 150:
                    break
            r.connection.transport.abort()           # gone before the end (and the final usage)
    state = gw.gw.tenancy.state

    async def charged():
        tokens = (await state.usage("alice"))["tokens"]
        return tokens if tokens >= 150 else 0
    assert await wait_for(charged) >= 150, await state.usage("alice")


async def test_a_background_response_is_charged_its_usage_once_when_it_is_read(sims, gateway):
    """A ``background: true`` response is answered ``queued`` at once, with no usage, and goes on on
    its engine: it was charged its prompt's estimate alone, so background requests generated
    without limit under TPM. Its usage is charged when a read of it finds it ended, once however
    often it is read."""
    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"tpm": 100_000}}})
    c = openai_client(gw, ALICE)
    r = await c.responses.create(model="m", input="Tell me about switchyards.", max_output_tokens=40,
                                 background=True)
    assert r.status in ("queued", "in_progress") and r.usage is None

    async def ended():
        got = await c.responses.retrieve(r.id)
        return got if got.status in ("completed", "incomplete") else None
    done = await until(ended)
    total = done.usage.input_tokens + done.usage.output_tokens
    assert done.usage.output_tokens == 40
    state = gw.gw.tenancy.state

    async def charged():
        return (await state.usage("alice"))["tokens"] >= total
    await until(charged)
    for _ in range(2):                                  # read again: charged once
        assert (await c.responses.retrieve(r.id)).usage.output_tokens == 40
    await asyncio.sleep(0.1)
    assert (await state.usage("alice"))["tokens"] == total


async def test_a_background_response_holds_its_concurrency_slot_until_it_ends_and_is_charged_unread(sims, gateway):
    """A background response goes on on its engine after its ``queued`` answer: it holds its user's
    concurrency slot until the gateway, polling it, finds it ended, so a user of ``max_concurrent:
    1`` runs one generation at a time, background or not; and it is charged its usage then, though
    no client ever reads it, once (a later read charges nothing more)."""
    sim = await sims("vllm", "m", itl_ms=5.0, enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"tpm": 100_000, "max_concurrent": 1}}})
    c = openai_client(gw, ALICE)
    r = await c.responses.create(model="m", input="Tell me about switchyards.", max_output_tokens=200,
                                 background=True)
    assert r.status in ("queued", "in_progress")
    with pytest.raises(openai.RateLimitError) as ei:     # still generating: its slot is held
        await c.responses.create(model="m", input="And another.", max_output_tokens=5, background=True)
    assert ei.value.response.headers["x-error-concurrency-exceeded"] == "true"
    state = gw.gw.tenancy.state

    async def freed():
        u = await state.usage("alice")
        return u if u["concurrent"] == 0 and u["tokens"] >= 200 else None
    await until(freed, timeout=30)                       # never read: ended, freed and charged
    done = await c.responses.retrieve(r.id)
    assert done.status in ("completed", "incomplete") and done.usage.output_tokens == 200
    await asyncio.sleep(0.1)
    assert (await state.usage("alice"))["tokens"] == done.usage.input_tokens + done.usage.output_tokens
    ok = await c.responses.create(model="m", input="Now.", max_output_tokens=2)
    assert ok.status in ("completed", "incomplete")           # the slot is free again


async def test_a_cancelled_background_response_gives_its_concurrency_slot_back(sims, gateway):
    """A background response its client cancels ends there: the gateway's poll finds it cancelled
    and gives its slot back, so the user's next request is served."""
    sim = await sims("vllm", "m", itl_ms=5.0, enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"max_concurrent": 1}}})
    c = openai_client(gw, ALICE)
    r = await c.responses.create(model="m", input="Tell me about switchyards.", max_output_tokens=4000,
                                 background=True)
    with pytest.raises(openai.RateLimitError):
        await c.responses.create(model="m", input="And another.", max_output_tokens=2)
    assert (await c.responses.cancel(r.id)).status == "cancelled"
    state = gw.gw.tenancy.state

    async def freed():
        return (await state.usage("alice"))["concurrent"] == 0
    await until(freed, timeout=30)
    assert (await c.responses.create(model="m", input="Now.", max_output_tokens=2)).usage.output_tokens == 2


async def test_a_background_response_whose_engine_is_known_down_gives_its_concurrency_slot_back_once(sims, gateway):
    """A background response holds its user's concurrency slot while the gateway polls it. When its
    engine dies, the slot is given back as soon as the health probes find it down (as its place on
    the endpoint is), not once the poll gives up; and when the poll ends later (the engine is back,
    without the response: a 404), it gives back nothing more, so the user's next request, running
    meanwhile, keeps its slot."""
    first = await sims("vllm", "m", itl_ms=5.0, enable_responses_store=True)
    second = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [first.url, second.url])], auth=KEYS,
                       limits={"users": {"alice": {"max_concurrent": 1}}})
    c = openai_client(gw, ALICE)
    raw = await c.responses.with_raw_response.create(model="m", input="Tell me about switchyards.",
                                                     max_output_tokens=4000, background=True)
    r = raw.parse()
    assert r.status in ("queued", "in_progress")
    sims_ = {first.url: first, second.url: second}
    ep = next(e for e in gw.gw.pool.endpoints("m") if e.name == raw.headers["target-pod"])
    dead = sims_[ep.url]
    state = gw.gw.tenancy.state
    assert (await state.usage("alice"))["concurrent"] == 1
    await dead.close()
    assert await wait_for(lambda: not ep.healthy)
    assert (await state.usage("alice"))["concurrent"] == 0      # in the step the probe found it down
    # the user's next request runs on the live engine, holding the slot
    async with _held_while_the_engine_returns(gw, c, dead, r.id):
        with pytest.raises(openai.RateLimitError):
            await c.chat.completions.create(model="m", messages=CHAT)


async def test_a_background_response_whose_engine_a_breaker_holds_out_gives_its_concurrency_slot_back_at_its_poll(
        sims, gateway):
    """Without health probes, a request refused by the dead engine opens its breaker; the background
    response's next poll, unanswered, gives its user's slot back (with its place), not once the poll
    gives up; and the poll's end (the engine back without it: a 404) gives back nothing more."""
    first = await sims("vllm", "m", itl_ms=5.0, enable_responses_store=True)
    second = await sims("vllm", "m", itl_ms=5.0, enable_responses_store=True)
    sims_ = {first.url: first, second.url: second}
    gw = await gateway([model_block("m", "vllm", list(sims_), strategy="session-affinity")], auth=KEYS,
                       health={"enabled": False}, limits={"users": {"alice": {"max_concurrent": 1}}})
    c = openai_client(gw, ALICE)
    raw = await c.responses.with_raw_response.create(model="m", input="Tell me about switchyards.",
                                                     max_output_tokens=4000, background=True)
    r = raw.parse()
    assert r.status in ("queued", "in_progress")
    owner = next(e for e in gw.gw.pool.endpoints("m") if e.name == raw.headers["target-pod"])
    dead = sims_[owner.url]
    state = gw.gw.tenancy.state
    assert (await state.usage("alice"))["concurrent"] == 1
    await dead.close()
    # another user's request sent to the dead engine (its session's), refused: its breaker opens
    await openai_client(gw, BOB).chat.completions.create(
        model="m", messages=CHAT, extra_headers={"x-session-id": raw.headers["x-session-id"]})
    assert owner.ejected and owner.healthy

    async def freed():
        return (await state.usage("alice"))["concurrent"] == 0
    await until(freed, timeout=10)           # a poll comes within 2 s; giving up takes ten
    async with _held_while_the_engine_returns(gw, c, dead, r.id):
        pass


@contextlib.asynccontextmanager
async def _held_while_the_engine_returns(gw, c, dead, rid: str):
    """alice's next request holds her concurrency slot while her background response's dead engine
    comes back on its port without the response: entered once the response's poll ended (its 404),
    the running request's slot still held, so the poll's end gave nothing back twice."""
    state = gw.gw.tenancy.state
    held = asyncio.create_task(c.chat.completions.create(
        model="m", messages=CHAT, extra_headers={"x-sim-fault": "stall_before_first=inf"}))

    async def holding():
        return (await state.usage("alice"))["concurrent"] == 1
    await until(holding)
    back = await start_sim(SimConfig(engine="vllm", model="m", port=dead.port, host="127.0.0.1",
                                     enable_responses_store=True))
    try:
        api = gw.gw.apis["/v1/responses"]

        async def poll_ended():
            got = [q for q in (await sim_state(back.url))["received"] if q["path"].endswith(rid)]
            return bool(got) and not api._watched
        await until(poll_ended, timeout=30)              # the poll's 404: it ended
        assert (await state.usage("alice"))["concurrent"] == 1     # the running request's slot, still held
        yield
    finally:
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError, openai.APIError):
            await held
        await back.close()


async def test_a_background_stream_its_client_left_is_charged_the_rest_of_its_usage_when_it_is_read(sims, gateway):
    """A background stream goes on on its engine when its client leaves: the client was charged what
    it was sent (its prompt's estimate and a token an event), and the rest of the usage when a read
    of the response finds it ended, so the whole usage in all, once."""
    sim = await sims("vllm", "m", itl_ms=5.0, enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"tpm": 100_000}}})
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/responses", headers={"Authorization": f"Bearer {ALICE}"},
                          json={"model": "m", "input": "Tell me about switchyards.", "max_output_tokens": 80,
                                "background": True, "stream": True}) as r:
            assert r.status == 200
            rid, deltas = None, 0
            async for line in r.content:
                if line.startswith(b"data: ") and rid is None:
                    rid = orjson.loads(line[6:]).get("response", {}).get("id")
                deltas += line.startswith(b"event: response.output_text.delta")
                if deltas >= 3:
                    break
            r.connection.transport.abort()           # gone; the engine goes on
    assert rid
    c = openai_client(gw, ALICE)

    async def ended():
        got = await c.responses.retrieve(rid)
        return got if got.status in ("completed", "incomplete") else None
    done = await until(ended)
    assert done.usage.output_tokens == 80
    total = done.usage.input_tokens + done.usage.output_tokens
    state = gw.gw.tenancy.state

    async def charged():
        return (await state.usage("alice"))["tokens"] >= total
    await until(charged)
    assert (await c.responses.retrieve(rid)).status == done.status      # read again: charged once
    await asyncio.sleep(0.1)
    assert (await state.usage("alice"))["tokens"] == total


async def test_a_background_stream_its_client_left_holds_its_concurrency_slot_until_it_ends(sims, gateway):
    """A background stream its client leaves goes on on its engine: it keeps its user's concurrency
    slot, past its request's settlement, until the gateway's poll finds it ended, and is charged the
    rest of its usage then, unread, once."""
    sim = await sims("vllm", "m", itl_ms=5.0, enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"tpm": 100_000, "max_concurrent": 1}}})
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/responses", headers={"Authorization": f"Bearer {ALICE}"},
                          json={"model": "m", "input": "Tell me about switchyards.", "max_output_tokens": 300,
                                "background": True, "stream": True}) as r:
            rid = None
            async for line in r.content:
                if line.startswith(b"data: ") and rid is None:
                    rid = orjson.loads(line[6:]).get("response", {}).get("id")
                if line.startswith(b"event: response.output_text.delta"):
                    break
            r.connection.transport.abort()           # gone; the engine goes on
    assert rid
    state = gw.gw.tenancy.state

    async def settled():                                # charged what its client was sent
        u = await state.usage("alice")
        return u if u["tokens"] > 0 else None
    u = await until(settled, timeout=30)
    assert u["concurrent"] == 1 and u["tokens"] < 300
    c = openai_client(gw, ALICE)
    with pytest.raises(openai.RateLimitError) as ei:
        await c.responses.create(model="m", input="And another.", max_output_tokens=2)
    assert ei.value.response.headers["x-error-concurrency-exceeded"] == "true"

    async def freed():
        u = await state.usage("alice")
        return u if u["concurrent"] == 0 and u["tokens"] >= 300 else None
    await until(freed, timeout=30)
    done = await c.responses.retrieve(rid)
    assert done.usage.output_tokens == 300
    await asyncio.sleep(0.1)
    assert (await state.usage("alice"))["tokens"] == done.usage.input_tokens + done.usage.output_tokens


async def test_a_background_stream_resumed_to_its_end_is_charged_its_usage_once(sims, gateway):
    """A client that left a background stream resumes it as its engine replays it (``GET
    ?stream=true&starting_after=``): the replay's terminal event finds the response ended, and
    the rest of its usage is charged then, once, however often it is replayed."""
    sim = await sims("vllm", "m", itl_ms=5.0, enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"tpm": 100_000}}})
    auth = {"Authorization": f"Bearer {ALICE}"}
    usage = None
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/responses", headers=auth,
                          json={"model": "m", "input": "Tell me about switchyards.", "max_output_tokens": 80,
                                "background": True, "stream": True}) as r:
            rid, seq = None, -1
            async for line in r.content:
                if line.startswith(b"data: "):
                    event = orjson.loads(line[6:])
                    rid = rid or event.get("response", {}).get("id")
                    seq = event["sequence_number"]
                    if event["type"] == "response.output_text.delta":
                        break
            r.connection.transport.abort()           # gone; the engine goes on
        for _ in range(2):                              # resumed twice: charged once
            async with s.get(f"{gw.url}/v1/responses/{rid}?stream=true&starting_after={seq}", headers=auth) as got:
                assert got.status == 200
                async for line in got.content:
                    if line.startswith(b"data: ") and b"response.completed" in line:
                        usage = orjson.loads(line[6:])["response"]["usage"]
    assert usage is not None and usage["output_tokens"] == 80
    state = gw.gw.tenancy.state
    total = usage["input_tokens"] + usage["output_tokens"]

    async def charged():
        return (await state.usage("alice"))["tokens"] >= total
    await until(charged)
    await asyncio.sleep(0.1)
    assert (await state.usage("alice"))["tokens"] == total


async def test_concurrency_limit_counts_requests_in_flight(sims, gateway):
    sim = await sims("vllm", "m", itl_ms=20.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"max_concurrent": 2}}})
    c = openai_client(gw, ALICE)
    async with contextlib.AsyncExitStack() as stack:
        readers = []
        for _ in range(2):   # two streams, each past its first chunk: both surely in flight
            resp = await stack.enter_async_context(c.chat.completions.with_streaming_response.create(
                model="m", messages=CHAT, max_tokens=500, stream=True))
            readers.append(resp.http_response.aiter_bytes())
            await readers[-1].__anext__()
        with pytest.raises(openai.RateLimitError) as ei:
            await c.chat.completions.create(model="m", messages=CHAT, max_tokens=1)
        assert ei.value.response.headers["x-error-concurrency-exceeded"] == "true"
        assert "concurrent" in ei.value.body["message"]
    # the streams were closed by the client: their slots come back
    await wait_for(lambda: gw.gw.lifecycle.in_flight == 0)
    await c.chat.completions.create(model="m", messages=CHAT, max_tokens=1)


async def test_model_rps_limit(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], limits={"models": {"m": {"rps": 2}}})
    got = await outcomes(openai_client(gw).chat.completions.create(model="m", messages=CHAT, max_tokens=1)
                         for _ in range(5))
    assert got.count(200) == 2 and got.count("RateLimitError") == 3
    async with aiohttp.ClientSession() as s, s.post(gw.base_url + "/chat/completions",
                                                    json={"model": "m", "messages": CHAT}) as r:
        body = await r.json()
        assert r.status == 429 and r.headers["x-error-model-rps-exceeded"] == "true"
        assert body["error"]["message"] == "model: m has exceeded RPS: 2"
        assert 1 <= int(r.headers["Retry-After"]) <= 1


async def test_without_auth_the_user_header_names_the_user(sims, gateway):
    """AIBrix-compatible: no keys configured, the `user` header selects the limits."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       limits={"users": {"bob": {"rpm": 1}}, "default_user": {"rpm": 2}})
    c = openai_client(gw)

    async def as_user(u):
        return await c.chat.completions.create(model="m", messages=CHAT, max_tokens=1,
                                               extra_headers={"user": u} if u else None)
    assert await outcomes(as_user("bob") for _ in range(2)) == [200, "RateLimitError"]
    assert await outcomes(as_user("carol") for _ in range(3)) == [200, 200, "RateLimitError"]   # default_user
    assert await outcomes(as_user("dan") for _ in range(2)) == [200, 200]          # own counters
    assert await outcomes(as_user(None) for _ in range(4)) == [200] * 4            # anonymous: unlimited


async def test_the_log_line_names_the_keys_user_not_the_clients_claim(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS)
    with gw.gw.request_log.capture() as lines:
        await openai_client(gw, ALICE).chat.completions.create(model="m", messages=CHAT, max_tokens=1,
                                                 extra_headers={"user": "mallory"}, user="mallory")
    assert [x["user"] for x in lines] == ["alice"]


async def test_a_request_refused_by_its_users_limit_names_the_user_in_its_log_line(sims, gateway):
    """A 429 from a user's limit is that user's: its log line names them, with auth (the key's user)
    and without (the request's own ``user``)."""
    sim = await sims("vllm", "m")
    for auth, client, extra in ((KEYS, ALICE, {}), (None, None, {"user": "alice"})):
        gw = await gateway([model_block("m", "vllm", [sim.url])], limits={"users": {"alice": {"rpm": 1}}},
                           **({"auth": auth} if auth else {}))
        c = openai_client(gw, client) if client else openai_client(gw)
        with gw.gw.request_log.capture() as lines:
            assert await outcomes(c.chat.completions.create(model="m", messages=CHAT, max_tokens=1,
                                                            extra_headers=extra) for _ in range(2)) \
                == [200, "RateLimitError"]
        assert sorted((x["status"], x["user"]) for x in lines) == [(200, "alice"), (429, "alice")]


async def test_a_request_refused_after_its_key_was_checked_names_the_keys_user_in_its_log_line(sims, gateway):
    """With auth on, the key says who sent a request before its body is read: a request refused after
    that (an unknown model, a bad field, an unknown strategy, a stored response not found) is that
    user's in its log line as a served one is, so the operator can tell whose requests fail."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS)
    c = openai_client(gw, ALICE)
    with gw.gw.request_log.capture() as lines:
        assert await outcomes([
            c.chat.completions.create(model="nope", messages=CHAT),
            c.chat.completions.create(model="m", messages=CHAT, max_tokens=-1),
            c.chat.completions.create(model="m", messages=CHAT, extra_headers={"routing-strategy": "nope"}),
            c.responses.retrieve("resp_nope")]) == ["BadRequestError", "BadRequestError", "NotFoundError",
                                                    "NotFoundError"]
        await wait_for(lambda: len(lines) == 4, timeout=5.0, interval=0.01)
    assert sorted((x["status"], x["path"], x["user"]) for x in lines) == [
        (400, "/v1/chat/completions", "alice"), (400, "/v1/chat/completions", "alice"),
        (404, "/v1/chat/completions", "alice"), (404, "/v1/responses/resp_nope", "alice")], lines


async def test_without_auth_a_refused_request_names_the_user_it_claimed_in_its_log_line(sims, gateway):
    """Without keys, the `user` header (else the body's `user`) names the user of a served request's
    line; a request refused once its body was read (an unknown model, an unknown strategy) names it
    the same way."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    c = openai_client(gw)
    with gw.gw.request_log.capture() as lines:
        assert await outcomes([
            c.chat.completions.create(model="nope", messages=CHAT, user="bob"),
            c.chat.completions.create(model="m", messages=CHAT, extra_headers={"user": "carol",
                                                                               "routing-strategy": "nope"}),
            c.chat.completions.create(model="m", messages=CHAT, max_tokens=1, user="dan")]) == [
            200, "BadRequestError", "NotFoundError"]
        await wait_for(lambda: len(lines) == 3, timeout=5.0, interval=0.01)
    assert sorted((x["status"], x["user"]) for x in lines) == [(200, "dan"), (400, "carol"), (404, "bob")], lines


async def test_per_user_metrics_name_only_users_the_gateway_knows(sims, gateway):
    """Without auth anyone can put anything in `user`: only configured users get their own series."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       limits={"users": {"alice": {"rpm": 1}}, "default_user": {"rpm": 1}})
    c = openai_client(gw)
    got = []
    for user in ("alice", "alice", "mallory-1", "mallory-1", "mallory-2", None):
        try:
            await c.chat.completions.create(model="m", messages=CHAT, max_tokens=2,
                                            extra_headers={"user": user} if user else None)
            got.append(200)
        except openai.RateLimitError:
            got.append(429)
    assert got == [200, 429, 200, 429, 200, 200]
    text = await gw.metrics_text()
    assert 'switchyard_rate_limited_total{limit="rpm",model="m",user="alice"} 1.0' in text
    assert 'switchyard_rate_limited_total{limit="rpm",model="m",user="_other"} 1.0' in text
    assert 'switchyard_user_tokens_total{kind="completion",user="alice"} 2.0' in text
    assert 'switchyard_user_tokens_total{kind="completion",user="_other"} 4.0' in text   # mallory-1 and -2
    assert 'switchyard_user_tokens_total{kind="completion",user="_none"} 2.0' in text
    assert "mallory" not in text


def _raw_post(path: str, lines: list[str], body: bytes) -> bytes:
    """A request whose header lines are sent as given: repeated names stay repeated."""
    head = [f"POST {path} HTTP/1.1", "Host: gateway.test", "Connection: close", "Content-Type: application/json",
            f"Content-Length: {len(body)}", *lines]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


@pytest.mark.parametrize("lines", [
    [f"Authorization: Bearer {ALICE}", "Authorization: Bearer sk-wrong-0123456789"],
    ["Authorization: Bearer sk-wrong-0123456789", f"Authorization: Bearer {ALICE}"],
    [f"Authorization: Bearer {ALICE}", f"Authorization: Bearer {ALICE}"],
    [f"x-api-key: {ALICE}", "x-api-key: sk-wrong-0123456789"],
    [f"Authorization: Bearer {ALICE}", f"Authorization: Bearer {BOB}"],
], ids=["good-then-wrong", "wrong-then-good", "twice", "x-api-key-twice", "two-users"])
async def test_an_api_key_header_sent_twice_is_a_401_and_reaches_no_engine(sims, gateway, lines):
    """A header that is not a list may not be sent on several lines (RFC 9110 section 5.3); combined,
    as a recipient may combine them, two Authorization lines are 'Bearer a, Bearer b', a credential
    no key matches. Read line by line, which one decided the user depended on the reader (the
    first line here, the last in another proxy), and a proxy that checked one could have the
    gateway act on the other."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth={**KEYS, "admin_token": "admin-secret-1"},
                       limits={"users": {"alice": {"rpm": 100}}})
    body = orjson.dumps({"model": "m", "messages": CHAT, "max_tokens": 1})
    got = (await exchange(gw.port, _raw_post("/v1/chat/completions", lines, body))).first
    err = assert_openai_error(got, 401)
    assert err["code"] == "invalid_api_key" and got.headers["www-authenticate"] == "Bearer"
    got = (await exchange(gw.port, _raw_post("/v1/messages", lines, body))).first
    assert got.status == 401 and orjson.loads(got.body)["error"]["type"] == "authentication_error"
    assert [r for r in (await sim_state(sim.url))["received"] if r["method"] == "POST"] == []
    assert (await gw.gw.tenancy.state.usage("alice"))["requests"] == 0
    assert 'switchyard_auth_failures_total{reason="invalid"} 2.0' in await gw.metrics_text()


async def test_an_admin_token_sent_twice_is_a_401_and_changes_nothing(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth={**KEYS, "admin_token": "admin-secret-1"})
    for lines in (["Authorization: Bearer admin-secret-1", "Authorization: Bearer nobody-0123456789"],
                  ["Authorization: Bearer nobody-0123456789", "Authorization: Bearer admin-secret-1"]):
        got = (await exchange(gw.port, _raw_post("/admin/users", lines, b'{"name": "eve", "rpm": 1}'))).first
        assert assert_openai_error(got, 401)["code"] == "invalid_api_key"
    assert gw.gw.tenancy.directory.limits_for("eve") is None


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_an_sdk_given_retries_waits_out_a_users_limit_and_is_served(sims, gateway, sdk):
    """A user at max_concurrent gets a 429 with Retry-After and retry-after-ms, which the SDKs
    honour (up to 60 s): with max_retries=1 the request comes back once, after the slot freed, and
    is served. The gateway's log lines count the attempts: one 429, then the 200."""
    sim = await sims("vllm", "m", itl_ms=20.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"max_concurrent": 1}}})
    async with aiohttp.ClientSession() as s:
        holder = await s.post(gw.base_url + "/chat/completions", headers={"Authorization": f"Bearer {ALICE}"},
                              json={"model": "m", "messages": CHAT, "max_tokens": 500, "stream": True})
        await holder.content.readline()
        with gw.gw.request_log.capture() as lines:
            async def free_on_the_first_429() -> None:
                await until(lambda: any(x["status"] == 429 for x in lines), timeout=30)
                holder.close()
            freeing = asyncio.create_task(free_on_the_first_429())
            if sdk == "anthropic":
                client = anthropic.AsyncAnthropic(base_url=gw.url, api_key=ALICE, max_retries=1)
                answer = await client.messages.create(model="m", max_tokens=2, messages=CHAT)
                assert answer.content[0].text
            else:
                client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=ALICE, max_retries=1)
                answer = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=2)
                assert answer.choices[0].message.content
            await client.close()
            await freeing
    mine = [x for x in lines if x["status"] != 499]         # 499: the stream that held the slot
    assert [(x["status"], x.get("error_class")) for x in mine] == [(429, "rate_limit_concurrency"), (200, None)]


async def test_a_users_429_on_messages_is_anthropics_shape_with_the_rate_limit_headers(sims, gateway):
    """/v1/messages answers a user's limit as Anthropic's API does, {"type": "error", "error":
    {"type": "rate_limit_error", "message"}}, so its SDKs raise RateLimitError; with the same
    x-ratelimit-*, Retry-After and retry-after-ms as the OpenAI-shaped 429."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"rpm": 1, "tpm": 100000}}})
    client = anthropic.AsyncAnthropic(base_url=gw.url, api_key=ALICE, max_retries=0)
    assert (await client.messages.create(model="m", max_tokens=2, messages=CHAT)).content
    for stream in (False, True):
        with pytest.raises(anthropic.RateLimitError) as ei:
            await client.messages.create(model="m", max_tokens=2, messages=CHAT, stream=stream)
        assert ei.value.body == {"type": "error", "error": {"type": "rate_limit_error",
                                                            "message": "user: alice has exceeded RPM: 1"}}
        h = ei.value.response.headers
        assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("1", "0")
        assert h["x-ratelimit-limit-tokens"] == "100000" and h["x-error-rpm-exceeded"] == "true"
        assert 1 <= int(h["Retry-After"]) <= 60 and 0 < int(h["retry-after-ms"]) <= 60_000
    await client.close()


async def test_two_different_keys_in_authorization_and_x_api_key_are_a_401_in_the_apis_shape(sims, gateway):
    """A client that sends x-api-key and Authorization: Bearer, each with its own key (an Anthropic
    client given an auth_token and an x-api-key among its default headers; older Anthropic SDKs sent
    both when ANTHROPIC_API_KEY and ANTHROPIC_AUTH_TOKEN were set). Two keys name two users, or one
    valid key and one that is not: the gateway cannot tell which one the client meant to be charged,
    nor which one a proxy in front of it checked, so it serves neither (Authorization won, so its
    user was charged whatever x-api-key said). The same key in both is one credential and is
    served."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"rpm": 100}, "bob": {"rpm": 100}}})
    both = anthropic.AsyncAnthropic(base_url=gw.url, auth_token=ALICE, default_headers={"x-api-key": BOB},
                                    max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as ei:
        await both.messages.create(model="m", max_tokens=2, messages=CHAT)
    assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "authentication_error"
    assert "two different API keys" in ei.value.body["error"]["message"]
    await both.close()
    for bearer, key in ((ALICE, BOB), ("sk-wrong-0123456789", ALICE), (ALICE, "sk-wrong-0123456789")):
        async with aiohttp.ClientSession() as s, s.post(
                gw.base_url + "/chat/completions", json={"model": "m", "messages": CHAT, "max_tokens": 1},
                headers={"Authorization": f"Bearer {bearer}", "x-api-key": key}) as r:
            body = await r.json()
            assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer", (bearer, key)
            assert body["error"]["code"] == "invalid_api_key" and body["error"]["param"] == "api_key"
            assert "two different API keys" in body["error"]["message"]
    assert [r for r in (await sim_state(sim.url))["received"] if r["method"] == "POST"] == []
    for user in ("alice", "bob"):
        assert (await gw.gw.tenancy.state.usage(user))["requests"] == 0
    assert 'switchyard_auth_failures_total{reason="ambiguous"} 4.0' in await gw.metrics_text()
    same = anthropic.AsyncAnthropic(base_url=gw.url, auth_token=ALICE, default_headers={"x-api-key": ALICE},
                                    max_retries=0)
    assert (await same.messages.create(model="m", max_tokens=2, messages=CHAT)).content
    await same.close()
    assert (await gw.gw.tenancy.state.usage("alice"))["requests"] == 1
