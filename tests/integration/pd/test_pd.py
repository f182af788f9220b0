"""P/D end to end on loopback: the gateway in front of enginesim prefill/decode engines.

Every row of the failure table, for both engines where it applies, with `/_sim/state` as the
proof that legs were cancelled or aborted, and the autouse check that every tracker is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from functools import partial

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from gateway.pipeline import relay
from tests.support.factories import pd_model, pd_pair, roleset
from tests.support.fake_engine import fake_engine
from tests.support.first_writes import assert_written_from_reads, record_first_writes
from tests.support.http import chat_body, openai_client, post, sim_state, sse_events
from tests.support.waiting import until, wait_for

MSG = [{"role": "user", "content": "Disaggregated serving splits prefill from decode. " * 8}]
body = partial(chat_body, MSG, stream=False, max_tokens=8)


async def quiet(url) -> bool:
    """No request left running or waiting on the engine."""
    st = await sim_state(url)
    return not st["running"] and not st["waiting"] and not st.get("pd", {}).get("rooms_waiting")


ENGINES = ["vllm", "sglang"]


@pytest.mark.parametrize("engine", ENGINES)
async def test_happy_path_through_the_sdk(sims, gateway, engine):
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])])
    client = openai_client(gw)
    raw = await client.chat.completions.with_raw_response.create(model="m", messages=MSG, max_tokens=6)
    assert raw.headers["prefill-target-pod"] == p.url.split("//")[1]
    assert raw.headers["target-pod"] == d.url.split("//")[1]
    assert raw.headers["routing-strategy"] == "pd"
    r = raw.parse()
    assert r.choices[0].message.content and r.usage.completion_tokens == 6

    stream = await client.chat.completions.create(model="m", messages=MSG, max_tokens=6, stream=True)
    text = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(text)
    await client.close()
    ps, ds = await sim_state(p.url), await sim_state(d.url)
    assert ps["counts"]["completed"] == 2 and ds["counts"]["completed"] == 2
    metrics = await gw.metrics_text()
    assert 'switchyard_pd_prefill_seconds_count{model="m"} 2.0' in metrics
    assert "switchyard_pd_kv_transfer_seconds_count" in metrics


async def test_vllm_decode_receives_the_kv_and_counts_it_cached(sims, gateway):
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    st, _, raw = await post(gw, body())
    assert st == 200
    usage = orjson.loads(raw)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0      # pulled from the prefill
    assert (await sim_state(d.url))["pd"]["transfers"] == 1


async def test_a_vllm_prefill_without_kv_params_has_the_decode_recompute_whatever_the_client_sent(sims, gateway):
    """A prefill without a KV connector answers ``kv_transfer_params: null``: the decode is sent
    none and computes the prompt itself, also when the client's body named its own (the legs'
    params are the gateway's, as the prefill's are): the client does not get to point the decode
    at a host to pull KV from."""
    answer = {"id": "p", "object": "chat.completion", "model": "m", "kv_transfer_params": None,
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "length"}],
              "usage": {"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101}}

    async def no_connector(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(answer)

    d = await sims("vllm", "m", role="decode")
    own = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e", "remote_block_ids": [1],
           "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "r"}
    async with fake_engine(no_connector) as prefill:
        gw = await gateway([pd_model("vllm", [{"name": "rs", "prefill": [prefill], "decode": [d.url]}])])
        for stream in (False, True):
            st, _, raw = await post(gw, body(stream=stream, kv_transfer_params=own))
            assert st == 200, raw[:300]
    sent = [r["body"] for r in (await sim_state(d.url))["received"] if r["method"] == "POST"]
    assert len(sent) == 2 and all("kv_transfer_params" not in b for b in sent), sent
    assert (await sim_state(d.url))["pd"]["kv_failures"] == 0


async def test_a_vllm_decode_is_written_from_the_read_that_completes_the_prefills_answer(sims, gateway, monkeypatch):
    """The decode leg is begun from the prefill connection's read callback (no task runs there),
    before the request's task wakes for the answer: on the first request's new prefill connection
    and on the kept-alive one after it alike. The answers are as before."""
    from handlers.vllm import VLLMAdapter
    where: list[asyncio.Task | None] = []
    decode_body = VLLMAdapter.decode_body

    def recording(self, *a, **kw):
        where.append(asyncio.current_task())
        return decode_body(self, *a, **kw)

    monkeypatch.setattr(VLLMAdapter, "decode_body", recording)
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    client = openai_client(gw)
    for _ in range(2):
        r = await client.chat.completions.create(model="m", messages=MSG, max_tokens=6)
        assert r.choices[0].message.content and r.usage.completion_tokens == 6
        assert r.usage.prompt_tokens_details.cached_tokens > 0          # the KV came from the prefill
    stream = await client.chat.completions.create(model="m", messages=MSG, max_tokens=6, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    await client.close()
    assert where == [None, None, None]          # from the prefill's read, once per request
    assert (await sim_state(d.url))["pd"]["transfers"] == 3


async def test_a_vllm_pd_streams_first_token_goes_out_from_the_read_that_brings_it(sims, gateway, monkeypatch):
    """vLLM's decode answers its head before its KV is read: the relay is made ready then, and the
    decode connection's read callback that brings the first token checks it and writes it with the
    client's head, in one write, with no task running (none wakes on the first token's way). The
    streams are whole, and so are non-streamed answers beside them."""
    firsts = record_first_writes(monkeypatch)
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    client = openai_client(gw)
    for _ in range(3):
        stream = await client.chat.completions.create(model="m", messages=MSG, max_tokens=6, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens == 6
    r = await client.chat.completions.create(model="m", messages=MSG, max_tokens=6)
    assert r.usage.completion_tokens == 6
    await client.close()
    assert_written_from_reads(firsts, 3)                       # from the decode's reads
    assert (await sim_state(d.url))["pd"]["transfers"] == 4


async def test_an_sglang_pd_streams_first_token_goes_out_from_the_decodes_read(sims, gateway, monkeypatch):
    """SGLang's decode sends its head with its first token: once both legs are written, the
    decode's relay waits for that read (on a kept-alive connection), and the read writes the
    client's head and first event, in one write, with no task running, before the request's task
    hears of the decode's head or the prefill's answer. The streams are whole, with their usage."""
    firsts = record_first_writes(monkeypatch)
    p, d = await pd_pair(sims, "sglang")
    gw = await gateway([pd_model("sglang", [roleset("sglang", p, d)])])
    client = openai_client(gw)

    async def streamed() -> list:
        stream = await client.chat.completions.create(model="m", messages=MSG, max_tokens=6, stream=True,
                                                      stream_options={"include_usage": True})
        return [c async for c in stream]

    await streamed()                    # the engines' connections open: the usual path
    firsts.clear()
    for _ in range(2):
        chunks = await streamed()
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens == 6
    await client.close()
    assert_written_from_reads(firsts, 2)                       # from the decode's reads
    assert await wait_for(lambda: quiet(p.url), timeout=5) and await wait_for(lambda: quiet(d.url), timeout=5)


async def test_sglang_duplicate_controlled_key_touches_no_engine(sims, gateway):
    p, d = await pd_pair(sims, "sglang")
    gw = await gateway([pd_model("sglang", [roleset("sglang", p, d)])])
    raw = b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream":false,"stream":true}'
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/chat/completions", data=raw,
                                                    headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400 and r.headers["x-error-routing"] == "true"
        assert "duplicate" in (await r.json())["error"]["message"]
    for sim in (p, d):
        assert (await sim_state(sim.url))["counts"]["started"] == 0


async def test_incomplete_roleset_uses_combined_or_fails(sims, gateway):
    d = await sims("vllm", "m", role="decode")
    c = await sims("vllm", "m")
    gw = await gateway([pd_model("vllm", [{"name": "rs", "decode": [d.url], "combined": [c.url]}])])
    st, hdrs, _ = await post(gw, body())
    assert st == 200 and hdrs["target-pod"] == c.url.split("//")[1] and "prefill-target-pod" not in hdrs
    gw2 = await gateway([pd_model("vllm", [{"name": "rs", "decode": [d.url]}])])
    st, hdrs, raw = await post(gw2, body())
    assert st == 503 and hdrs["x-error-routing"] == "true"


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_prefill_that_refuses_the_clients_request_answers_with_its_own_status(sims, gateway, engine):
    """A client error of the prefill (the engine's 400 for a bad field, its 501 for what it does
    not serve) is the client's to fix, as the same request's answer from an aggregated engine is:
    its status, message and param, in OpenAI's shape, so an SDK raises BadRequestError and does
    not retry it, as it retries a 502. The decode is not run (vLLM) or is aborted (SGLang)."""
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])])
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="none", max_retries=2)     # the SDK's default
    try:
        with pytest.raises(openai.BadRequestError) as ei:
            await client.chat.completions.with_raw_response.create(model="m", messages=MSG, max_tokens=8,
                                                                  extra_body={"stop": 5})
    finally:
        await client.close()
    err = ei.value
    assert err.status_code == 400 and err.body["param"] == "stop" and "stop" in err.message, err.body
    assert err.response.headers["x-error-pd-prefill"] == "http_status"
    assert err.response.headers["prefill-target-pod"] == p.url.split("//")[1]
    sent = [r for r in (await sim_state(p.url))["received"] if r["method"] == "POST"]
    assert len(sent) == 1, sent               # answered once: not a server error to try again
    with pytest.raises(openai.APIStatusError) as ei:       # what the engine does not implement
        await openai_client(gw).chat.completions.create(
            model="m", messages=MSG, max_tokens=8, extra_headers={"x-sim-fault": "prefill.error_after=0;error_code=501"})
    assert ei.value.status_code == 501 and ei.value.body["code"] == "501", ei.value.body
    if engine == "vllm":
        assert (await sim_state(d.url))["counts"]["started"] == 0          # no decode leg at all
    else:
        assert await wait_for(lambda: quiet(d.url), timeout=5)              # the decodes were aborted
    assert 'outcome="fault"' not in await gw.metrics_text()


async def test_no_ready_pod(gateway):
    gw = await gateway([pd_model("vllm", [{"name": "rs", "prefill": ["http://127.0.0.1:9"],
                                           "decode": ["http://127.0.0.1:9"]}])],
                       health={"interval_s": 0.05, "unhealthy_threshold": 1})
    assert await wait_for(lambda: not any(ep.ready for ep in gw.gw.pool.endpoints()), timeout=5)
    st, _, _ = await post(gw, body())
    assert st == 503


@pytest.mark.parametrize("engine", ENGINES)
async def test_prefill_error_fails_fast(sims, gateway, engine):
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])])
    st, hdrs, raw = await post(gw, body(stream=True), {"x-sim-fault": "prefill.status=503"})
    assert st == 502
    assert hdrs["x-error-pd-prefill"] == "http_status"
    assert hdrs["prefill-target-pod"] == p.url.split("//")[1]
    assert hdrs["x-pd-decision"].startswith("disaggregated")      # what routing decided, as on a 200
    assert "503" in orjson.loads(raw)["error"]["message"]
    if engine == "vllm":
        assert (await sim_state(d.url))["counts"]["started"] == 0          # no decode leg at all
    else:
        assert await wait_for(lambda: quiet(d.url), timeout=5)              # the decode was aborted
        assert 'switchyard_pd_aborts_total{model="m",result="ok"}' in await gw.metrics_text()


@pytest.mark.parametrize("engine", ENGINES)
async def test_prefill_timeout(sims, gateway, engine):
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])], pd={"prefill_timeout_s": 0.3})
    st, hdrs, _ = await post(gw, body(), {"x-sim-fault": "prefill.hang=inf"})
    assert st == 504 and hdrs["x-error-pd-prefill"] == "timeout"
    assert await wait_for(lambda: quiet(p.url), timeout=5)
    assert await wait_for(lambda: quiet(d.url), timeout=5)


@pytest.mark.parametrize("engine", ENGINES)
async def test_prefill_refused(sims, gateway, engine):
    d = await sims(engine, "m", role="decode")
    rs = {"name": "rs", "prefill": [{"url": "http://127.0.0.1:9", "bootstrap_port": 9}], "decode": [d.url]}
    gw = await gateway([pd_model(engine, [rs])], health={"interval_s": 60})
    st, hdrs, raw = await post(gw, body())
    assert st == 503 and hdrs["x-error-pd-prefill"] == "transport"
    assert hdrs["Retry-After"] == "5"          # a 503 tells when to come back, as every 429 and 503 does
    assert "transport" in orjson.loads(raw)["error"]["message"]
    assert await wait_for(lambda: quiet(d.url), timeout=5)


# prefills and decodes scored by least_request: pd picks at random between idle ones, so a test that
# waits for a pair to name its failing engine meets it within its tries (by load_balancing the decode
# that served keeps the better score once its throughput is scraped, by prefix_cache the prefill
# that served keeps the prompt's match, and the failing one may never be tried)
EVEN_PICKS = {"decode_score_policy": "least_request", "prefill_score_policy": "least_request"}


async def _until_retried(gw, p, d, stream: bool, cause: str) -> dict[str, str]:
    """Requests until one is retried (a pair named the dead engine; its breaker, if on, then opens
    it): every answer whole, the retried one once, on the live pair; the engines left with nothing
    running. Returns the retried answer's headers."""
    seen = []
    for _ in range(20):
        st, hdrs, raw = await post(gw, body(stream=stream))
        seen.append((st, hdrs.get("x-retries")))
        if hdrs.get("x-retries"):
            break
    assert seen[-1] == (200, "1") and all(st == 200 for st, _ in seen), seen
    assert hdrs["target-pod"] == d.url.split("//")[1] and hdrs["prefill-target-pod"] == p.url.split("//")[1]
    if stream:
        assert sse_events(raw)[-1] == "[DONE]"
    else:
        assert orjson.loads(raw)["usage"]["completion_tokens"] == 8
    assert (await sim_state(d.url))["counts"]["completed"] == len(seen)
    assert f'switchyard_retry_causes_total{{cause="{cause}",model="m"}} 1.0' in await gw.metrics_text()
    assert await wait_for(lambda: quiet(p.url), timeout=5) and await wait_for(lambda: quiet(d.url), timeout=5)
    return hdrs


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("engine", ENGINES)
async def test_a_decode_that_refuses_the_leg_hands_it_to_another_decode_of_the_roleset(sims, gateway, engine, stream):
    """A decode engine that died (its port refuses) while the probes have not noticed: the prefill's
    KV waits (vLLM: the prefill ran; SGLang: it waits for a decode of its bootstrap room), and the
    decode leg, of which nothing went out, goes to the roleset's other decode. One retry, counted;
    the client gets its whole answer."""
    p, d = await pd_pair(sims, engine)
    rs = {**roleset(engine, p, d, name="rs"), "decode": ["http://127.0.0.1:9", d.url]}
    gw = await gateway([pd_model(engine, [rs])], health={"interval_s": 60}, pd=EVEN_PICKS)
    await _until_retried(gw, p, d, stream, "connect")


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_refused_decode_leg_goes_to_no_decode_whose_prompt_bucket_excludes_the_request(sims, gateway, engine):
    """The other decode a refused leg goes to is one the request could have been routed to: a decode
    whose prompt-length bucket excludes the request (here one for short prompts) is not sent it;
    with no other, the client gets the refused decode's 502."""
    p, d = await pd_pair(sims, engine)
    rs = {**roleset(engine, p, d, name="rs"),
          "decode": ["http://127.0.0.1:9", {"url": d.url, "max_prompt_tokens": 10}]}
    gw = await gateway([pd_model(engine, [rs])], health={"interval_s": 60})
    st, hdrs, raw = await post(gw, body())
    assert st == 502 and hdrs["x-error-pd-decode"] == "connect", raw[:300]
    assert [r for r in (await sim_state(d.url))["received"] if r["method"] == "POST"] == []
    assert await wait_for(lambda: quiet(p.url), timeout=5)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("engine", ENGINES)
async def test_a_prefill_that_refuses_the_leg_is_left_out_and_the_pair_chosen_again(sims, gateway, engine, stream):
    """A prefill engine that died (its port refuses): nothing of the request went out that an
    engine acts on (SGLang's decode leg, sent alongside, is aborted), so the pair is chosen again
    without it. One retry, counted; the client gets its whole answer."""
    p, d = await pd_pair(sims, engine)
    rs = roleset(engine, p, d, name="rs")
    dead = {"url": "http://127.0.0.1:9", "bootstrap_port": 9} if engine == "sglang" else "http://127.0.0.1:9"
    rs["prefill"] = [dead, *rs["prefill"]]
    gw = await gateway([pd_model(engine, [rs])], health={"interval_s": 60}, pd=EVEN_PICKS)
    await _until_retried(gw, p, d, stream, "prefill_connect")


@contextlib.asynccontextmanager
async def _hangs_up():
    """An engine that dies on every request: it reads the request and closes the connection."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_decode_that_hangs_up_before_answering_has_the_pair_chosen_again(sims, gateway, engine):
    """The decode leg went out and its engine closed the connection with nothing sent back (it
    died): the prefill is aborted (SGLang) or its KV left (vLLM), and the request runs again on a
    pair without that decode, before the client saw anything."""
    p, d = await pd_pair(sims, engine)
    async with _hangs_up() as dead:
        rs = {**roleset(engine, p, d, name="rs"), "decode": [dead, d.url]}
        gw = await gateway([pd_model(engine, [rs])], health={"interval_s": 60}, pd=EVEN_PICKS,
                           breaker={"consecutive_faults": 100, "fault_rate": 0})
        await _until_retried(gw, p, d, True, "decode_reset")


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_decode_that_breaks_off_its_whole_answer_has_the_pair_chosen_again(sims, gateway, engine):
    """A non-streamed request's decode sends its head and part of its body, and its engine dies:
    the client has seen nothing of the answer (a whole one is sent once read), so the request runs
    again on a pair without that decode, as for a decode that died before its first token, within
    the retry budget."""
    async def cut(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = 1000
        await resp.prepare(request)
        await resp.write(b'{"id":"x","choices":[')
        await asyncio.sleep(0.02)
        assert request.transport is not None
        request.transport.abort()           # its engine died in the middle of the answer
        return resp

    p, d = await pd_pair(sims, engine)
    async with fake_engine(cut) as broken:
        rs = {**roleset(engine, p, d, name="rs"), "decode": [broken, d.url]}
        gw = await gateway([pd_model(engine, [rs])], health={"interval_s": 60}, pd=EVEN_PICKS,
                           breaker={"consecutive_faults": 100, "fault_rate": 0})
        await _until_retried(gw, p, d, False, "decode_broken")


async def _ready(gw, url: str) -> bool:
    """The gateway's ``switchyard_endpoint_ready`` for the endpoint at ``url``."""
    name = url.split("//")[1]
    for line in (await gw.metrics_text()).splitlines():
        if line.startswith("switchyard_endpoint_ready{") and f'endpoint="{name}"' in line:
            return line.endswith(" 1.0")
    return False


async def _set_dead(url: str, dead: bool) -> None:
    async with aiohttp.ClientSession() as s, s.post(url + "/_sim/config", json={"dead": dead}) as r:
        assert r.status == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("engine", ENGINES)
async def test_a_decode_ready_again_since_the_request_was_routed_takes_its_retry(sims, gateway, engine, stream):
    """A request routed while the roleset's other decode was out (its probes failing: a restart,
    a breaker's trials taken) runs on the one decode left; that decode dies with the leg in it
    after the other is back. The pair is chosen again among the endpoints ready now, not those
    of the moment it was routed: the client gets its whole answer from the decode that came back."""
    p, d2 = await pd_pair(sims, engine)
    got, release = asyncio.Event(), asyncio.Event()

    async def dies_with_the_leg(request: web.Request) -> web.StreamResponse:
        await request.read()
        got.set()
        await release.wait()
        request.transport.abort()                   # nothing sent back: its engine died
        return web.Response()

    async with fake_engine(dies_with_the_leg) as d1:
        rs = {**roleset(engine, p, d2, name="rs"), "decode": [d1, d2.url]}
        gw = await gateway([pd_model(engine, [rs])], breaker={"consecutive_faults": 100, "fault_rate": 0})
        await _set_dead(d2.url, True)
        await until(lambda: _not_ready(gw, d2.url))
        sent = asyncio.create_task(post(gw, body(stream=stream)))
        await asyncio.wait_for(got.wait(), 10)     # on the only ready decode
        await _set_dead(d2.url, False)
        await until(lambda: _ready(gw, d2.url))
        release.set()
        st, hdrs, raw = await asyncio.wait_for(sent, 20)
    assert st == 200 and hdrs["x-retries"] == "1", raw[:300]
    assert hdrs["target-pod"] == d2.url.split("//")[1]
    if stream:
        assert sse_events(raw)[-1] == "[DONE]"
    else:
        assert orjson.loads(raw)["usage"]["completion_tokens"] == 8
    assert 'switchyard_retry_causes_total{cause="decode_reset",model="m"} 1.0' in await gw.metrics_text()
    assert await wait_for(lambda: quiet(p.url), timeout=5) and await wait_for(lambda: quiet(d2.url), timeout=5)


async def _not_ready(gw, url: str) -> bool:
    return not await _ready(gw, url)


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_decode_that_dies_with_the_leg_on_a_kept_alive_connection_is_not_sent_it_again(
        sims, gateway, engine):
    """The decode leg goes out on a connection kept alive from the request before (it idled a few
    ms: the engine had it open, and read the leg) and the engine closes it with nothing sent back.
    The leg is not written again on a fresh connection (a vLLM decode's KV pull, an SGLang bootstrap
    room, is used once): with no other decode, the client gets the promised 502 at once."""
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])], health={"interval_s": 60},
                       breaker={"consecutive_faults": 100, "fault_rate": 0})
    st, _, _ = await post(gw, body())           # leaves a kept-alive connection to the decode
    assert st == 200
    before = (await sim_state(d.url))["counts"]["started"]
    st, hdrs, raw = await asyncio.wait_for(post(gw, body(), {"x-sim-fault": "decode.drop_after=0"}), 20)
    assert st == 502 and hdrs["x-error-pd-decode"] == "reset", raw[:300]
    assert (await sim_state(d.url))["counts"]["started"] == before + 1       # the leg ran once
    assert await wait_for(lambda: quiet(p.url), timeout=5) and await wait_for(lambda: quiet(d.url), timeout=5)


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_decode_that_dies_with_the_leg_on_a_long_idle_connection_is_not_sent_it_again(
        sims, gateway, engine, monkeypatch):
    """As above, but the kept-alive connection had idled long enough for an engine's keep-alive
    timeout (``RESEND_IDLE_S``, made short here), and the engine read the leg and closed it within
    ``RESEND_WITHIN_S``, as a keep-alive race's close comes. A request run twice is only wasted
    work; a decode leg sent again takes a room or a KV pull already used, and waited there for
    the watchdog (SGLang: the whole ``first_byte_timeout_s`` of a non-streaming request): the
    client gets the promised 502 at once, and the leg ran once."""
    from gateway.upstream import h1client
    monkeypatch.setattr(h1client, "RESEND_IDLE_S", 0.05)
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])], health={"interval_s": 60},
                       breaker={"consecutive_faults": 100, "fault_rate": 0})
    st, _, _ = await post(gw, body())           # leaves a kept-alive connection to the decode
    assert st == 200
    await asyncio.sleep(0.1)                    # it idles past RESEND_IDLE_S
    before = (await sim_state(d.url))["counts"]["started"]
    st, hdrs, raw = await asyncio.wait_for(post(gw, body(), {"x-sim-fault": "decode.drop_after=0"}), 10)
    assert st == 502 and hdrs["x-error-pd-decode"] == "reset", raw[:300]
    assert (await sim_state(d.url))["counts"]["started"] == before + 1       # the leg ran once
    assert await wait_for(lambda: quiet(p.url), timeout=5) and await wait_for(lambda: quiet(d.url), timeout=5)


async def test_sglang_decode_stall_before_first_token(sims, gateway):
    p, d = await pd_pair(sims, "sglang")
    gw = await gateway([pd_model("sglang", [roleset("sglang", p, d)])], watchdog={"first_chunk_timeout_s": 0.5})
    st, hdrs, _ = await post(gw, body(stream=True), {"x-sim-fault": "decode.stall_before_first=30"})
    assert st == 504 and hdrs["x-error-pd-decode"] == "true"
    assert await wait_for(lambda: quiet(d.url), timeout=5)
    assert 'switchyard_watchdog_fires_total{model="m",phase="first_chunk"} 1.0' in await gw.metrics_text()


@pytest.mark.parametrize("engine", ENGINES)
async def test_decode_stall_mid_stream(sims, gateway, engine):
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])], watchdog={"idle_timeout_s": 0.3})
    st, _, raw = await post(gw, body(stream=True, max_tokens=20), {"x-sim-fault": "decode.stall_after=3:30"})
    assert st == 200
    last = sse_events(raw)[-1]
    assert last["error"]["code"] == "upstream_timeout"
    assert await wait_for(lambda: quiet(d.url), timeout=5)
    assert 'phase="idle"' in await gw.metrics_text()


@pytest.mark.parametrize("engine", ENGINES)
async def test_decode_dying_mid_stream(sims, gateway, engine):
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])])
    st, _, raw = await post(gw, body(stream=True, max_tokens=20), {"x-sim-fault": "decode.drop_after=3"})
    assert st == 200
    assert sse_events(raw)[-1]["error"]["code"] == "upstream_incomplete"


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_stream_whose_decode_fails_after_its_head_says_the_decode_failed(sims, gateway, engine):
    """After the client's head no header can say which leg failed: the stream's last event, in
    OpenAI's shape, names the decode endpoint, as the errors before the head do, for an idle decode
    and a broken one; its log line's error says the same."""
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])], watchdog={"idle_timeout_s": 0.3})
    name = d.url.split("//")[1]
    for fault, code in (("decode.stall_after=3:30", "upstream_timeout"), ("decode.drop_after=3", "upstream_incomplete")):
        with gw.gw.request_log.capture() as logs:
            st, _, raw = await post(gw, body(stream=True, max_tokens=20), {"x-sim-fault": fault})
            await until(lambda: [e for e in logs if e["event"] == "request"])
        assert st == 200
        error = sse_events(raw)[-1]["error"]
        assert error["code"] == code and set(error) == {"message", "type", "param", "code"}, error
        assert error["message"].startswith(f"decode endpoint {name}: "), error
        assert next(e for e in logs if e["event"] == "request")["error"].startswith(f"decode endpoint {name}: ")


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_continuable_stream_whose_decode_fails_with_no_pair_left_counts_what_its_legs_reported(
        sims, gateway, engine):
    """A model with migration_limit asks its legs for usage on every chunk, so a stream whose decode
    fails mid-way knows its tokens exactly: when no other pair can continue it, its log line and
    the token counters have the prompt and the tokens generated before the failure (as for a
    stream its client left), for an error event, a broken connection and an idle decode alike."""
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)], migration_limit=1)],
                       watchdog={"idle_timeout_s": 0.3})
    faults = ("decode.error_after=3", "decode.drop_after=3", "decode.stall_after=3:30")
    with gw.gw.request_log.capture() as logs:
        st, _, raw = await post(gw, body(stream=True, max_tokens=20, stream_options={"include_usage": True}))
        assert st == 200
        prompt = [e for e in sse_events(raw) if e != "[DONE]" and e.get("usage")][-1]["usage"]["prompt_tokens"]
        for fault in faults:
            st, _, raw = await post(gw, body(stream=True, max_tokens=20), {"x-sim-fault": fault})
            assert st == 200 and any(e != "[DONE]" and "error" in e for e in sse_events(raw)), raw[-300:]
        await until(lambda: len([e for e in logs if e["event"] == "request"]) == 4)
    lines = [e for e in logs if e["event"] == "request"][1:]
    for fault, line in zip(faults, lines, strict=True):
        assert line["error_class"] is not None and line["migrations"][0]["tokens"] == 3, (fault, line)
        assert (line["prompt_tokens"], line["completion_tokens"]) == (prompt, 3), (fault, line)
        if "error_after" not in fault:      # the gateway's words name the decode; an engine's event is its own
            assert line["error"].startswith(f"decode endpoint {d.url.split('//')[1]}: "), (fault, line)
    metrics = await gw.metrics_text()
    assert f'switchyard_completion_tokens_total{{model="m"}} {20.0 + 3 * 3}' in metrics
    assert f'switchyard_prompt_tokens_total{{model="m"}} {4.0 * prompt}' in metrics


@pytest.mark.parametrize("policy,status", [("fail", 500), ("recompute", 200)])
async def test_vllm_kv_pull_failure_policies(sims, gateway, policy, status):
    p = await sims("vllm", "m", role="prefill")
    d = await sims("vllm", "m", role="decode", kv_load_failure_policy=policy)
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    st, _, raw = await post(gw, body(), {"x-sim-fault": "decode.kv_pull_fail=1"})
    assert st == status
    if status == 500:
        assert orjson.loads(raw)["error"]["message"]


@pytest.mark.parametrize("engine", ENGINES)
async def test_client_disconnect_during_prefill_cancels_both_legs(sims, gateway, engine):
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])])
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(gw.url + "/v1/chat/completions", json=body(stream=True),
                                          headers={"x-sim-fault": "prefill.hang=inf"}))
        assert await wait_for(lambda: _busy(p.url), timeout=5)
        task.cancel()
    assert await wait_for(lambda: quiet(p.url), timeout=8)
    assert await wait_for(lambda: quiet(d.url), timeout=8)
    assert await wait_for(lambda: gw.gw.lifecycle.in_flight == 0, timeout=5)


async def _busy(url) -> bool:
    st = await sim_state(url)
    return bool(st["running"] or st["waiting"])


@pytest.mark.parametrize("engine", ENGINES)
async def test_client_disconnect_during_decode(sims, gateway, engine):
    p = await sims(engine, "m", role="prefill")
    d = await sims(engine, "m", role="decode", itl_ms=50)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])])
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + "/v1/chat/completions", json=body(stream=True, max_tokens=500))
        assert resp.status == 200
        await resp.content.readline()
        resp.close()
    assert await wait_for(lambda: quiet(d.url), timeout=8)
    assert (await sim_state(d.url))["counts"]["aborted"] >= 1


@pytest.mark.parametrize("client", ["continuable", "http10"])
async def test_a_client_leaving_before_a_vllm_decodes_first_bytes_closes_the_decode(sims, gateway, client):
    """A stream whose decode's first bytes the request's task awaits itself (one that may continue
    elsewhere, with migration_limit; an HTTP/1.0 client, whose head aiohttp writes) and whose
    client leaves before they come: the decode's connection is closed, which is how vLLM learns to
    abort it, and given back to no one, as on every other path a client leaves."""
    p, d = await pd_pair(sims, "vllm")
    extra = {"migration_limit": 1} if client == "continuable" else {}
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)], **extra)])
    payload = orjson.dumps(body(stream=True, max_tokens=50))
    version = "1.0" if client == "http10" else "1.1"
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(f"POST /v1/chat/completions HTTP/{version}\r\nHost: gw\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\nx-sim-fault: decode.stall_before_first=inf\r\n\r\n".encode()
                 + payload)
    await until(lambda: _running(d.url))             # the decode leg is in, its first token held
    writer.transport.abort()                          # the client goes away
    await until(lambda: quiet(d.url), timeout=10)
    assert (await sim_state(d.url))["counts"]["aborted"] == 1
    await until(lambda: gw.gw.lifecycle.in_flight == 0)
    text = await gw.metrics_text()
    assert 'switchyard_upstream_connections{state="busy"} 0.0' in text
    assert 'switchyard_client_cancels_total{model="m",stage="before_headers"} 1.0' in text


async def _running(url) -> bool:
    return bool((await sim_state(url))["running"])


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_stream_its_client_leaves_after_its_first_token_logs_its_kv_transfer(sims, gateway, engine):
    """The stream had its first token when its client went: its line has kv_transfer_ms, and the
    KV transfer and decode histograms count it, as for a stream that ran to its end."""
    p = await sims(engine, "m", role="prefill")
    d = await sims(engine, "m", role="decode", itl_ms=50)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])])
    with gw.gw.request_log.capture() as logs:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(gw.url + "/v1/chat/completions", json=body(stream=True, max_tokens=500))
            assert resp.status == 200
            while not any(e != "[DONE]" and e["choices"] and e["choices"][0]["delta"].get("content")
                          for e in sse_events(await resp.content.readuntil(b"\n\n"))):
                pass
            resp.close()
        await until(lambda: [e for e in logs if e["event"] == "request"])
    line = next(e for e in logs if e["event"] == "request")
    assert line["status"] == 499 and line["ttft_ms"] is not None
    assert line["kv_transfer_ms"] is not None and line["prefill_ms"] is not None
    metrics = await gw.metrics_text()
    assert 'switchyard_pd_kv_transfer_seconds_count{model="m"} 1.0' in metrics
    assert 'switchyard_pd_decode_seconds_count{model="m"} 1.0' in metrics


@pytest.mark.parametrize("engine", ENGINES)
async def test_trackers_balance_under_concurrency(sims, gateway, engine):
    p1, d1 = await pd_pair(sims, engine)
    p2, d2 = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p1, d1, "a"), roleset(engine, p2, d2, "b")])])
    results = await asyncio.gather(*(post(gw, body(stream=i % 2 == 0, max_tokens=4)) for i in range(24)))
    assert all(st == 200 for st, _, _ in results)
    pairs = {(h["prefill-target-pod"], h["target-pod"]) for _, h, _ in results}
    by_rs = {p1.url.split("//")[1]: d1.url.split("//")[1], p2.url.split("//")[1]: d2.url.split("//")[1]}
    assert all(by_rs[pp] == dd for pp, dd in pairs)       # never paired across rolesets


async def test_vllm_decode_stall_before_first_token_after_headers(sims, gateway):
    # vLLM sends its headers at once; the gateway waits for the decode's first bytes before the
    # client's head goes out, so the first-chunk watchdog answers 504 (as for SGLang, whose head
    # comes with its first token), and the decode connection is closed (vLLM's abort)
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])], watchdog={"first_chunk_timeout_s": 0.5})
    st, hdrs, raw = await post(gw, body(stream=True), {"x-sim-fault": "decode.stall_before_first=30"})
    assert st == 504 and hdrs["x-error-pd-decode"] == "true"
    assert orjson.loads(raw)["error"]["code"] == "upstream_timeout"
    assert await wait_for(lambda: quiet(d.url), timeout=5)
    assert 'phase="first_chunk"' in await gw.metrics_text()


async def test_vllm_decode_keepalive_comments_are_not_its_first_bytes(sims, gateway):
    """A vLLM decode run with --sse-keep-alive-interval sends comments while it stalls before its
    first token: they are not its first bytes, so the client's head still waits, and the
    first-chunk watchdog answers 504 as for a silent decode, the decode's connection closed."""
    p, d = await pd_pair(sims, "vllm", sse_keepalive_s=0.05)
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])], watchdog={"first_chunk_timeout_s": 0.5})
    st, hdrs, raw = await asyncio.wait_for(
        post(gw, body(stream=True), {"x-sim-fault": "decode.stall_before_first=4"}), 20)
    assert st == 504 and hdrs["x-error-pd-decode"] == "true", raw[:300]
    assert orjson.loads(raw)["error"]["code"] == "upstream_timeout"
    assert await wait_for(lambda: quiet(d.url), timeout=5)
    assert 'phase="first_chunk"' in await gw.metrics_text()


async def test_a_vllm_decode_whose_kv_pull_fails_before_its_first_token_has_the_pair_chosen_again(sims, gateway):
    """vLLM answers a stream's head at once; when its KV pull then fails (the prefill died, its
    blocks expired) it sends a server error event before any token. The client has seen nothing
    yet: the request runs again on a pair without that decode."""
    p = await sims("vllm", "m", role="prefill")
    bad = await sims("vllm", "m", role="decode", fault="kv_pull_fail=1")
    d = await sims("vllm", "m", role="decode")
    rs = {"name": "rs", "prefill": [p.url], "decode": [bad.url, d.url]}
    gw = await gateway([pd_model("vllm", [rs])], health={"interval_s": 60}, pd=EVEN_PICKS)
    await _until_retried(gw, p, d, True, "decode_error")
    assert await wait_for(lambda: quiet(bad.url), timeout=5)


async def test_a_vllm_decodes_501_event_before_its_first_token_reaches_the_client_and_is_not_its_fault(
        sims, gateway):
    """A decode that opens its stream with an error event of code 501 does not implement what the
    request asks, as another decode would not: the client gets that event, nothing is retried, and
    the decode's breaker (one fault would open it) is not charged."""
    p = await sims("vllm", "m", role="prefill")
    lacking = await sims("vllm", "m", role="decode", fault="error_after=0;error_code=501")
    d = await sims("vllm", "m", role="decode")
    rs = {"name": "rs", "prefill": [p.url], "decode": [lacking.url, d.url]}
    gw = await gateway([pd_model("vllm", [rs])], health={"interval_s": 60}, pd=EVEN_PICKS,
                       breaker={"consecutive_faults": 1, "max_ejection_percent": 100})
    addr = lacking.url.split("//")[1]
    refused = 0
    for _ in range(20):
        st, hdrs, raw = await post(gw, body(stream=True))
        assert st == 200 and "x-retries" not in hdrs
        errors = [e["error"] for e in sse_events(raw) if isinstance(e, dict) and "error" in e]
        if hdrs["target-pod"] == addr:
            assert [e["code"] for e in errors] == ["501"]
            refused += 1
            if refused == 2:
                break
        else:
            assert not errors
    assert refused == 2
    text = await gw.metrics_text()
    assert "switchyard_retry_causes_total{" not in text
    assert f'switchyard_breaker_state{{endpoint="{addr}",model="m"}} 0.0' in text
    assert f'switchyard_upstream_outcomes_total{{endpoint="{addr}",model="m",outcome="client_error"}} 2.0' in text
    assert f'endpoint="{addr}",model="m",outcome="fault"' not in text


async def test_a_vllm_decode_that_dies_after_its_head_and_before_its_first_token_has_the_pair_chosen_again(
        sims, gateway):
    """vLLM's head came (the relay is ready and waits for the first token in the decode's read
    callback), then the engine drops the connection: the client has seen nothing, so the request
    runs again on a pair without that decode, and the client gets its whole stream."""
    p = await sims("vllm", "m", role="prefill")
    bad = await sims("vllm", "m", role="decode", fault="drop_after=0")
    d = await sims("vllm", "m", role="decode")
    rs = {"name": "rs", "prefill": [p.url], "decode": [bad.url, d.url]}
    gw = await gateway([pd_model("vllm", [rs])], health={"interval_s": 60}, pd=EVEN_PICKS)
    hdrs = await _until_retried(gw, p, d, True, "decode_broken")
    assert hdrs["content-type"].startswith("text/event-stream")


async def test_a_kv_pull_failure_runs_again_on_another_prefill_as_well_when_there_is_one(sims, gateway):
    """A decode that could not read the KV most likely met a failed prefill: the new pair leaves
    both out (the prefill's prefix match would otherwise bring the request back to it)."""
    p1, p2 = await sims("vllm", "m", role="prefill"), await sims("vllm", "m", role="prefill")
    bad = await sims("vllm", "m", role="decode", fault="kv_pull_fail=1")
    d = await sims("vllm", "m", role="decode")
    rs = {"name": "rs", "prefill": [p1.url, p2.url], "decode": [bad.url, d.url]}
    gw = await gateway([pd_model("vllm", [rs])], health={"interval_s": 60}, pd=EVEN_PICKS)

    async def prefilled() -> list[int]:
        return [(await sim_state(p.url))["counts"]["completed"] for p in (p1, p2)]

    for _ in range(20):             # until a pair names the decode that fails its pulls
        before = await prefilled()
        st, hdrs, _ = await post(gw, body(stream=True))
        assert st == 200
        if hdrs.get("x-retries"):
            break
    after = await prefilled()
    assert hdrs["x-retries"] == "1" and hdrs["target-pod"] == d.url.split("//")[1]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]     # each prefill once


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("engine", ENGINES)
async def test_a_decode_that_answers_500_has_the_pair_chosen_again(sims, gateway, engine, stream):
    """A decode's server error (SGLang's answer when the KV transfer failed: its prefill died) comes
    before anything reached the client: retried on another pair, as an aggregated leg's 500 is."""
    p = await sims(engine, "m", role="prefill")
    bad = await sims(engine, "m", role="decode", fault="status=500")
    d = await sims(engine, "m", role="decode")
    rs = {**roleset(engine, p, d, name="rs"), "decode": [bad.url, d.url]}
    gw = await gateway([pd_model(engine, [rs])], health={"interval_s": 60}, pd=EVEN_PICKS)
    await _until_retried(gw, p, d, stream, "decode_status_500")


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_decodes_error_answer_reaches_the_client_naming_the_decode(sims, gateway, engine):
    """A decode that answers an error status (its 400, its 503, a 500 with no other pair to take
    the request) gives the client the engine's status and message in OpenAI's shape, as an
    aggregated engine's, with ``x-error-pd-decode: http_status`` to say which leg failed, as a
    prefill's error carries ``x-error-pd-prefill``; streamed or not."""
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])])
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="none", max_retries=0)
    try:
        for status, error in ((400, openai.BadRequestError), (503, openai.InternalServerError),
                              (500, openai.InternalServerError)):
            for stream in (False, True):
                with pytest.raises(error) as ei:
                    await client.chat.completions.create(model="m", messages=MSG, max_tokens=8, stream=stream,
                                                         extra_headers={"x-sim-fault": f"decode.status={status}"})
                err = ei.value
                assert err.status_code == status and f"HTTP {status}" in err.message, (status, stream, err.body)
                assert err.response.headers.get("x-error-pd-decode") == "http_status", (status, stream)
                assert "x-error-pd-prefill" not in err.response.headers
    finally:
        await client.close()
    st, hdrs, _ = await post(gw, body(), {"x-sim-fault": "prefill.status=500"})
    assert st == 502 and "x-error-pd-decode" not in hdrs        # the prefill's, named as such


@pytest.mark.parametrize("engine", ENGINES)
async def test_the_openai_sdk_with_its_own_retries_off_gets_every_answer_while_a_decode_answers_500(
        sims, gateway, engine):
    p = await sims(engine, "m", role="prefill")
    bad = await sims(engine, "m", role="decode", fault="status=500")
    d = await sims(engine, "m", role="decode")
    rs = {**roleset(engine, p, d, name="rs"), "decode": [bad.url, d.url]}
    gw = await gateway([pd_model(engine, [rs])], health={"interval_s": 60}, pd=EVEN_PICKS)
    client = openai_client(gw)
    client = client.with_options(max_retries=0)      # every answer whole, by the gateway's retries alone
    retried = 'switchyard_retry_causes_total{cause="decode_status_500",model="m"}'
    for i in range(40):
        if i % 2:
            stream = await client.chat.completions.create(model="m", messages=MSG, max_tokens=4, stream=True)
            assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        else:
            raw = await client.chat.completions.with_raw_response.create(model="m", messages=MSG, max_tokens=4)
            assert raw.parse().usage.completion_tokens == 4
        if i >= 7 and retried in await gw.metrics_text():
            break
    await client.close()
    assert (await sim_state(bad.url))["counts"].get("completed", 0) == 0
    assert retried in await gw.metrics_text()


async def test_a_kv_pull_that_fails_on_every_decode_is_retried_within_max_retries_and_then_answered_502(
        sims, gateway):
    p, d = await pd_pair(sims, "vllm")
    d2 = await sims("vllm", "m", role="decode")
    rs = {"name": "rs", "prefill": [p.url], "decode": [d.url, d2.url]}
    gw = await gateway([pd_model("vllm", [rs])], breaker={"enabled": False})
    st, hdrs, raw = await post(gw, body(stream=True), {"x-sim-fault": "decode.kv_pull_fail=1"})
    assert st == 502 and hdrs["x-error-pd-decode"] == "decode_error" and hdrs["x-retries"] == "1"
    assert "before its first token" in orjson.loads(raw)["error"]["message"]
    for url in (p.url, d.url, d2.url):
        assert await wait_for(lambda url=url: quiet(url), timeout=5)


async def _aborted(url: str, rid_prefix: str) -> bool:
    """The engine got /abort_request for the rid and holds no request with it."""
    st = await sim_state(url)
    live = [x["id"] for x in st["running"] + st["waiting"] if x["id"].startswith(rid_prefix)]
    return not live and any(a.startswith(rid_prefix) for a in st["abort_requests"])


async def test_sglang_decode_leg_timing_out_first_is_aborted(sims, gateway):
    """The decode leg gives up before the prefill answered (its first-byte timeout is shorter than
    the prefill timeout): its request went out, so the decode engine gets /abort_request too, not
    only the prefill. The decode engine notices the closed connection only after 30 s."""
    p = await sims("sglang", "m", role="prefill")
    d = await sims("sglang", "m", role="decode", sglang_abort_delay_s=30.0)
    gw = await gateway([pd_model("sglang", [roleset("sglang", p, d)])], upstream={"first_byte_timeout_s": 0.3},
                       pd={"abort_retry_delay_s": 0.5})
    st, hdrs, _ = await post(gw, body(stream=True), {"x-sim-fault": "prefill.hang=inf", "x-request-id": "dto-1"})
    assert st == 504 and hdrs["x-error-pd-decode"] == "true"
    assert await wait_for(lambda: _aborted(p.url, "dto-1-"), timeout=3)
    assert await wait_for(lambda: _aborted(d.url, "dto-1-"), timeout=3)


class ResettingHop:
    """A TCP hop in front of an engine (a proxy or load balancer in between). Each inference
    request is handed to the engine on a connection of its own, which stays open, so the engine
    keeps the request; the gateway's side of the connection is reset at once. Other requests
    (``/abort_request``) pass through."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.held: list[asyncio.StreamWriter] = []
        self.port = 0

    async def start(self) -> ResettingHop:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        for w in self.held:
            w.close()
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up: asyncio.StreamWriter | None = None
        back: asyncio.Task | None = None
        try:
            while data := await reader.read(65536):
                if data.startswith(b"POST /v1/"):
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()       # RST to the gateway
                    _, held = await asyncio.open_connection("127.0.0.1", self.upstream_port)
                    held.write(data)
                    self.held.append(held)
                    return
                if up is None:
                    up_reader, up = await asyncio.open_connection("127.0.0.1", self.upstream_port)
                    back = asyncio.create_task(self._copy(up_reader, writer))
                up.write(data)
        except OSError:
            pass
        finally:
            if up is not None:
                up.close()
            if back is not None:
                back.cancel()

    @staticmethod
    async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
        writer.close()


@pytest.mark.parametrize("path", ["direct", "resetting_hop", "slow_connect"])
async def test_sglang_prefill_500_aborts_every_decode_that_may_have_been_sent(sims, gateway, monkeypatch, path):
    """The prefill answers 500 at once, 100 times. For every request, within ~3 s the decode
    engine either got ``/abort_request`` for its rid and holds nothing for it, or never received
    the request and the gateway logged that it never wrote a byte of it (``decode_sent=False``).
    The decode engine notices a closed connection only after 30 s (as SGLang, late), so only an
    abort ends a request it holds. Paths to the decode: direct; through a hop that resets the
    gateway's connection right after taking the request (the decode leg ends on its own, racing
    the prefill's 500); direct with a connect slower than the prefill's answer (the decode leg is
    cancelled before it wrote anything)."""
    from gateway.upstream.h1client import UpstreamPool

    p = await sims("sglang", "m", role="prefill")
    d = await sims("sglang", "m", role="decode", sglang_abort_delay_s=30.0)
    decode_url = d.url
    hop = None
    if path == "resetting_hop":
        hop = await ResettingHop(d.port).start()
        decode_url = f"http://127.0.0.1:{hop.port}"
    elif path == "slow_connect":
        connect = UpstreamPool._connect

        async def slow_connect(self, origin):
            if origin.port == d.port:
                await asyncio.sleep(0.02)
            return await connect(self, origin)

        monkeypatch.setattr(UpstreamPool, "_connect", slow_connect)
    rs = {"name": "rs", "prefill": [{"url": p.url, "bootstrap_port": p.bootstrap_port}], "decode": [decode_url]}
    # a short retry delay only keeps the teardown short (it waits for the second aborts)
    gw = await gateway([pd_model("sglang", [rs])], health={"passive": False}, pd={"abort_retry_delay_s": 0.5})
    n = 100
    with gw.gw.request_log.capture() as logs:
        async with aiohttp.ClientSession() as s:
            for i in range(n):
                async with s.post(gw.url + "/v1/chat/completions", json=body(stream=i % 2 == 0),
                                  headers={"x-sim-fault": "prefill.status=500", "x-request-id": f"pd500-{i}"}) as r:
                    assert r.status == 502
                    await r.read()
    lines = {e["request_id"]: e for e in logs if e["event"] == "request"}
    rids = [lines[f"pd500-{i}"]["rid"] for i in range(n)]

    def unhandled(st: dict) -> list[str]:
        live = {x["id"] for x in st["running"] + st["waiting"]}
        aborts = set(st["abort_requests"])
        received = live | set(st["aborted_ids"])
        bad = []
        for i, rid in enumerate(rids):
            if rid in aborts and rid not in live:
                continue                                    # (a) aborted, nothing left
            if rid not in received and lines[f"pd500-{i}"].get("decode_sent") is False:
                continue                                    # (b) provably never sent
            bad.append(rid)
        return bad

    bad: list[str] = []
    deadline = asyncio.get_running_loop().time() + 3.0
    while asyncio.get_running_loop().time() < deadline:
        st = await sim_state(d.url)
        if not (bad := unhandled(st)):
            break
        await asyncio.sleep(0.05)
    if hop is not None:
        await hop.close()
    assert not bad, f"{len(bad)}/{n} decode requests neither aborted nor provably unsent: {bad[:5]}"


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_session_keeps_its_prefill_across_turns(sims, gateway, engine):
    """Each turn of a session (x-session-key), with a prompt that shares nothing with the last,
    goes to the prefill that served the session's first turn; sessions spread over both rolesets."""
    # a prefill holds each prompt for 100 ms: the six first turns, sent at once, overlap there
    p1, p2 = [await sims(engine, "m", role="prefill", ttft_base_ms=100) for _ in range(2)]
    d1, d2 = [await sims(engine, "m", role="decode") for _ in range(2)]
    gw = await gateway([pd_model(engine, [roleset(engine, p1, d1, "rs-1"), roleset(engine, p2, d2, "rs-2")])])
    client = openai_client(gw)
    prefills: dict[str, set[str]] = {}

    async def turn(t: int, s: int) -> None:
        raw = await client.chat.completions.with_raw_response.create(
            model="m", max_tokens=2, extra_headers={"x-session-key": f"agent-{s}"},
            messages=[{"role": "user", "content": f"turn {t} of session {s}: " + "words " * (20 + t)}])
        prefills.setdefault(f"agent-{s}", set()).add(raw.headers["prefill-target-pod"])

    await asyncio.gather(*(turn(0, s) for s in range(6)))      # at once: the first turns spread by load
    assert len({next(iter(pods)) for pods in prefills.values()}) == 2
    for t in range(1, 4):       # one at a time: without the session, every turn would go to the same prefill
        for s in range(6):
            await turn(t, s)
    await client.close()
    assert all(len(pods) == 1 for pods in prefills.values())
    kept = sum(float(line.rsplit(" ", 1)[1]) for line in (await gw.metrics_text()).splitlines()
               if line.startswith("switchyard_routing_session_total{") and 'outcome="kept"' in line)
    assert kept == 6 * 3


async def test_a_decode_whose_server_error_body_stalls_answers_the_client_in_bound(sims, gateway, monkeypatch):
    """A decode that answers a 500 and stalls in its body: the body is awaited as any engine's error
    body is (the relay's bound), then the decode's status goes to the client, where the request
    waited for as long as the decode stalled."""
    monkeypatch.setattr(relay, "ERROR_BODY_WAIT_S", 0.3)
    p, _ = await pd_pair(sims, "vllm")
    let_go = asyncio.Event()

    async def stalls(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(status=500, headers={"Content-Type": "application/json"})
        resp.content_length = 1000
        await resp.prepare(request)
        await resp.write(b'{"error":{"message":"kv lost"')
        for _ in range(1000):               # until the gateway lets go (the handler is not cancelled)
            if request.transport is None or request.transport.is_closing():
                let_go.set()
                break
            await asyncio.sleep(0.02)
        return resp

    async with fake_engine(stalls) as d:
        rs = {**roleset("vllm", p, p, name="rs"), "decode": [d]}
        gw = await gateway([pd_model("vllm", [rs])], health={"enabled": False}, retry={"enabled": False})
        st, _, raw = await asyncio.wait_for(post(gw, body(stream=False)), 10)
        assert st == 500 and 'upstream returned status 500: {"error":{"message":"kv lost"' in \
            orjson.loads(raw)["error"]["message"], raw[:300]
        await asyncio.wait_for(let_go.wait(), 10)       # its connection closed


@pytest.mark.parametrize("engine", ENGINES)
async def test_embeddings_are_refused_on_a_pd_model(sims, gateway, engine):
    """An embedding generates nothing and moves no KV: neither engine's embeddings request has
    the P/D fields (vLLM's ``kv_transfer_params``, SGLang's bootstrap room), so a pair would embed
    the input on the prefill and again on the decode. Like the pass-through paths it is a 400
    before any endpoint is asked, the openai SDK's ``BadRequestError``."""
    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])])
    client = openai_client(gw)
    with pytest.raises(openai.BadRequestError) as exc:
        await client.embeddings.create(model="m", input="hello world")
    assert exc.value.response.headers["x-error-routing"] == "true"
    assert "POST /v1/embeddings is not served by prefill/decode pairs" in exc.value.message
    for sim in (p, d):
        assert [r for r in (await sim_state(sim.url))["received"] if r["path"] == "/v1/embeddings"] == []
