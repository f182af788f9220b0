"""Prefill engines that answer strangely. vLLM: a 200 the decode leg cannot be built from (an
error object among them), an answer larger than ``upstream.max_response_bytes``, a connection closed
in the middle of the answer. SGLang: a prefill that fails after its decode's head, before or after
the decode's answer began. Fake engines on loopback answer each way, beside enginesim engines."""

from __future__ import annotations

import asyncio
from functools import partial

import orjson
import pytest
from aiohttp import web

from tests.support.factories import pd_model, pd_pair
from tests.support.fake_engine import fake_engine
from tests.support.http import chat_body, post, sim_state
from tests.support.metrics import metric
from tests.support.waiting import until

MSG = [{"role": "user", "content": "Disaggregated serving splits prefill from decode. " * 8}]
body = partial(chat_body, MSG, stream=False, max_tokens=8)
ANSWER = {"id": "p", "object": "chat.completion", "model": "m",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}]}


def answering(kind: str):
    """A prefill engine's handler: ``not_an_object`` a 200 whose kv_transfer_params is a string;
    ``error`` and ``object_error`` a 200 that is an error object, in OpenAI's form and vLLM's older one;
    ``huge`` one of about 200 kB; ``cut`` a 200 whose body stops in the middle and the connection
    closes (its engine died while it answered)."""
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        if kind == "not_an_object":
            return web.json_response({**ANSWER, "kv_transfer_params": "remote"})
        if kind == "error":             # an error object in a 200 (a proxy's, or an engine's own form)
            return web.json_response({"error": {"message": "KV connector failed", "type": "InternalServerError",
                                                "code": 500}})
        if kind == "object_error":
            return web.json_response({"object": "error", "message": "KV connector failed",
                                      "type": "InternalServerError", "code": 500})
        if kind == "huge":
            return web.json_response({**ANSWER, "kv_transfer_params": {"remote_block_ids": list(range(40000))}})
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = 1000
        await resp.prepare(request)
        await resp.write(b'{"id":"p","kv_transfer_')
        await asyncio.sleep(0.02)
        assert request.transport is not None
        request.transport.abort()
        return resp

    return handler


def _pod(url: str) -> str:
    return url.split("//")[1]


async def _until_retried(gw, bad: str, p, d, cause: str) -> None:
    """Requests until one's pair named the strange prefill ``bad`` (pairs are picked at random among
    equal ones): every answer whole, that one's once more, on the good pair."""
    seen = []
    for _ in range(20):
        st, hdrs, raw = await post(gw, body())
        seen.append((st, hdrs.get("x-retries"), hdrs.get("x-error-pd-prefill")))
        if hdrs.get("x-retries"):
            break
    assert seen[-1] == (200, "1", None) and all(st == 200 for st, _, _ in seen), seen
    assert hdrs["prefill-target-pod"] == _pod(p.url) and hdrs["target-pod"] == _pod(d.url)
    assert orjson.loads(raw)["usage"]["completion_tokens"] == 8
    page = await gw.metrics_text()
    assert metric(page, "switchyard_retry_causes_total", cause=cause) == 1, cause
    # the strange prefill's breaker heard a fault, the decode's nothing but its own answers
    assert metric(page, "switchyard_upstream_errors_total", endpoint=_pod(d.url)) == 0
    assert (await sim_state(d.url))["counts"]["completed"] == len(seen)


async def test_a_prefill_whose_200_is_unusable_is_charged_and_another_pair_serves(sims, gateway):
    """A prefill that answers 200 with ``kv_transfer_params`` that are not an object: no decode leg
    can be built from it. It is that prefill's fault, not a success: its breaker hears a fault, the
    decode's nothing, and the request runs again on another prefill, as for one that died, since
    nothing reached the client or a decode. With no other prefill, the client gets 502
    ``bad_response``."""
    p, d = await pd_pair(sims, "vllm")
    async with fake_engine(answering("not_an_object")) as bad:
        rs = {"name": "rs", "prefill": [bad, p.url], "decode": [d.url]}
        gw = await gateway([pd_model("vllm", [rs])], health={"interval_s": 60},
                           breaker={"consecutive_faults": 100, "fault_rate": 0},
                           pd={"prefill_score_policy": "least_request"})
        await _until_retried(gw, bad, p, d, "prefill_bad_response")
        page = await gw.metrics_text()
        assert metric(page, "switchyard_upstream_outcomes_total", endpoint=_pod(bad), outcome="fault") == 1
        assert metric(page, "switchyard_upstream_outcomes_total", endpoint=_pod(bad), outcome="success") == 0
        assert metric(page, "switchyard_upstream_outcomes_total", endpoint=_pod(d.url), outcome="fault") == 0

        alone = {"name": "rs", "prefill": [bad], "decode": [d.url]}
        gw = await gateway([pd_model("vllm", [alone])], health={"interval_s": 60})
        st, hdrs, raw = await post(gw, body())
        assert st == 502 and hdrs["x-error-pd-prefill"] == "bad_response", raw[:300]
        assert "kv_transfer_params is not an object" in orjson.loads(raw)["error"]["message"]
        assert metric(await gw.metrics_text(), "switchyard_upstream_outcomes_total", endpoint=_pod(bad),
                      outcome="fault") == 1



@pytest.mark.parametrize("kind", ["error", "object_error"])
async def test_a_prefill_whose_200_is_an_error_object_failed(sims, gateway, kind):
    """A prefill that answers 200 with an error object in place of its answer did not prefill: it
    is not a prefill without a KV connector (``kv_transfer_params: null``), whose decode computes the
    prompt itself. It is that prefill's failure, as an answer no decode leg can be built from: the
    client gets 502 ``bad_response`` naming the engine's message, no decode leg is sent, and the
    prefill's breaker hears a fault, not a success."""
    d = await sims("vllm", "m", role="decode")
    async with fake_engine(answering(kind)) as bad:
        rs = {"name": "rs", "prefill": [bad], "decode": [d.url]}
        gw = await gateway([pd_model("vllm", [rs])], health={"interval_s": 60})
        with gw.gw.request_log.capture() as lines:
            st, hdrs, raw = await post(gw, body())
        assert st == 502 and hdrs["x-error-pd-prefill"] == "bad_response", raw[:300]
        assert "KV connector failed" in orjson.loads(raw)["error"]["message"]
        assert lines[0]["prefill_failure"] == "bad_response"
        assert (await sim_state(d.url))["counts"]["started"] == 0
        page = await gw.metrics_text()
        assert metric(page, "switchyard_upstream_outcomes_total", endpoint=_pod(bad), outcome="fault") == 1
        assert metric(page, "switchyard_upstream_outcomes_total", endpoint=_pod(bad), outcome="success") == 0

async def test_a_prefill_that_dies_in_the_middle_of_its_answer_has_the_pair_chosen_again(sims, gateway):
    """A prefill whose connection closes in the middle of its 200 answer (its engine died while it
    answered): its KV is gone with it, nothing reached the client and no decode was asked, so the
    request runs again on another prefill (cause ``prefill_reset``), as for one that closed before
    its answer's head."""
    p, d = await pd_pair(sims, "vllm")
    async with fake_engine(answering("cut")) as bad:
        rs = {"name": "rs", "prefill": [bad, p.url], "decode": [d.url]}
        gw = await gateway([pd_model("vllm", [rs])], health={"interval_s": 60},
                           breaker={"consecutive_faults": 100, "fault_rate": 0},
                           pd={"prefill_score_policy": "least_request"})
        await _until_retried(gw, bad, p, d, "prefill_reset")



async def test_a_prefill_answer_over_max_response_bytes_is_a_502_upstream_too_large(sims, gateway):
    """A prefill's answer larger than ``upstream.max_response_bytes`` is the 502 ``upstream_too_large``
    the setting promises for a prefill leg's answer, not a 503 telling the client the engine is busy
    and to come back in 5 s; no decode leg is sent."""
    d = await sims("vllm", "m", role="decode")
    async with fake_engine(answering("huge")) as bad:
        rs = {"name": "rs", "prefill": [bad], "decode": [d.url]}
        gw = await gateway([pd_model("vllm", [rs])], health={"interval_s": 60},
                           upstream={"max_response_bytes": 100_000})
        with gw.gw.request_log.capture() as lines:
            st, hdrs, raw = await post(gw, body())
        err = orjson.loads(raw)["error"]
        assert st == 502 and err["code"] == "upstream_too_large", raw[:300]
        assert "Retry-After" not in hdrs and err["type"] != "overloaded_error"
        assert hdrs["x-error-pd-prefill"] == "bad_response"
        assert (await sim_state(d.url))["counts"]["started"] == 0
        # the log line and the metrics say what an aggregated answer over the bound says
        assert lines[0]["error_class"] == "upstream_too_large" and lines[0]["upstream_bytes"] > 100_000
        assert lines[0]["prefill_failure"] == "bad_response"
        page = await gw.metrics_text()
        assert metric(page, "switchyard_upstream_errors_total", endpoint=_pod(bad), error_class="too_large") == 1


@pytest.mark.parametrize("stream", [True, False])
async def test_an_sglang_prefill_that_fails_after_the_decodes_head_and_before_its_first_token_fails_the_request(
        gateway, stream):
    """An SGLang decode that answers its head before its first token (a server that does not hold
    its head back for it, a proxy in front of it): its prefill then fails (a 500) while the client
    has seen nothing. The request fails as for a prefill that fails first: the client gets the
    prefill's 502 at once, not the decode's 504 once the watchdog fires (a whole answer's, off by
    default, would wait until the client gave up); the prefill failure counts before the response;
    the decode is closed and aborted, and its breaker hears no fault of it."""
    closed = asyncio.Event()
    aborted: list[dict] = []

    async def prefill(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(0.5)        # well after the decode's head
        return web.json_response({"error": {"message": "prefill out of memory", "code": 500}}, status=500)

    async def decode(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream" if stream else "application/json"})
        if not stream:
            resp.content_length = 1000
        await resp.prepare(request)     # its head at once; no token comes: the KV never does
        for _ in range(1000):
            if request.transport is None or request.transport.is_closing():
                closed.set()
                break
            await asyncio.sleep(0.02)
        return resp

    async def abort(request: web.Request) -> web.Response:
        aborted.append(await request.json())
        return web.json_response({})

    routes = (web.post("/abort_request", abort),)
    async with fake_engine(prefill, routes=routes) as p, fake_engine(decode, routes=routes) as d:
        rs = {"name": "rs", "prefill": [{"url": p, "bootstrap_port": 9}], "decode": [d]}
        gw = await gateway([pd_model("sglang", [rs])], health={"interval_s": 60},
                           watchdog={"first_chunk_timeout_s": 5, "response_timeout_s": 5})
        with gw.gw.request_log.capture() as lines:
            st, hdrs, raw = await asyncio.wait_for(post(gw, body(stream=stream)), 20)
        assert st == 502 and hdrs["x-error-pd-prefill"] == "http_status", raw[:300]
        assert "prefill out of memory" in orjson.loads(raw)["error"]["message"]
        assert lines[0]["prefill_failure"] == "http_status" and lines[0]["error_class"] == "pd_prefill_http_status"
        await asyncio.wait_for(closed.wait(), 10)
        assert await until(lambda: len(aborted) >= 1, timeout=10)
        page = await gw.metrics_text()
        assert metric(page, "switchyard_pd_prefill_failures_total", stage="before_response") == 1
        assert metric(page, "switchyard_pd_prefill_failures_total", stage="after_response") == 0
        assert metric(page, "switchyard_upstream_outcomes_total", endpoint=_pod(d), outcome="fault") == 0
        assert metric(page, "switchyard_upstream_errors_total", endpoint=_pod(d)) == 0
        assert metric(page, "switchyard_watchdog_fires_total") == 0


@pytest.mark.parametrize("stream", [True, False])
async def test_an_sglang_prefill_that_fails_once_its_decodes_answer_began_leaves_the_answer_whole(gateway, stream):
    """The other side of the test above: a prefill that fails once its decode's answer began (its
    first token came, the KV with it) is a late failure: the answer runs on whole, and the failure
    is counted after the response."""
    chunk = b'data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,' \
            b'"delta":{"content":"tok "},"finish_reason":null}]}\n\n'

    async def prefill(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(0.3)
        return web.json_response({"error": {"message": "prefill out of memory", "code": 500}}, status=500)

    async def decode(request: web.Request) -> web.StreamResponse:
        await request.read()
        if not stream:
            await asyncio.sleep(0.05)
            return web.json_response({**ANSWER, "usage": {"prompt_tokens": 5, "completion_tokens": 1,
                                                          "total_tokens": 6}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(6):          # its first token at once, the last well after the prefill failed
            await resp.write(chunk)
            await asyncio.sleep(0.1)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def abort(request: web.Request) -> web.Response:
        return web.json_response({})

    routes = (web.post("/abort_request", abort),)
    async with fake_engine(prefill, routes=routes) as p, fake_engine(decode, routes=routes) as d:
        rs = {"name": "rs", "prefill": [{"url": p, "bootstrap_port": 9}], "decode": [d]}
        gw = await gateway([pd_model("sglang", [rs])], health={"interval_s": 60})
        st, _, raw = await asyncio.wait_for(post(gw, body(stream=stream)), 20)
        assert st == 200, raw[:300]
        if stream:
            assert raw.count(b"tok ") == 6 and raw.endswith(b"data: [DONE]\n\n")
        else:
            assert orjson.loads(raw)["choices"][0]["message"]["content"] == "x"
        page = await gw.metrics_text()
        assert await until(lambda: _late_counted(gw), timeout=10)
        assert metric(page, "switchyard_upstream_outcomes_total", endpoint=_pod(d), outcome="fault") == 0


async def _late_counted(gw) -> bool:
    return metric(await gw.metrics_text(), "switchyard_pd_prefill_failures_total", stage="after_response") == 1


CHUNK = b'data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,' \
        b'"delta":{"content":"tok "},"finish_reason":null}]}\n\n'


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("shape", ["whole", "whole_broken", "stream", "stream_idle"])
async def test_a_decode_that_sends_its_head_and_then_stalls_is_the_decodes_timeout(gateway, engine, shape):
    """A decode that answers its head and then stalls (its body never comes, or a stream goes
    silent after its first token) is the decode's failure, as docs/pd.md's failures table says:
    a whole answer past ``response_timeout_s`` and a stream with no first token within
    ``first_chunk_timeout_s`` are the 504 ``x-error-pd-decode: true`` whose message names the
    decode endpoint, and an SGLang decode is sent ``/abort_request``; a stream silent past
    ``idle_timeout_s`` ends with the ``upstream_timeout`` event whose message names it. A whole
    answer whose connection breaks after some of its body is the 502 ``x-error-pd-decode: reset``
    naming it. The log line's error names the decode too."""
    stream = shape.startswith("stream")

    async def prefill(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({**ANSWER, "kv_transfer_params": {"remote_engine_id": "p"}} if engine == "vllm"
                                 else ANSWER)

    async def decode(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream" if stream else "application/json"})
        if not stream:
            resp.content_length = 1000
        await resp.prepare(request)     # its head at once
        if shape == "stream_idle":
            await resp.write(CHUNK)
        if shape == "whole_broken":     # some of its body, then its connection breaks
            await resp.write(b'{"id":"d","object":"chat.')
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.abort()
            return resp
        for _ in range(500):            # then nothing, until the gateway lets go of it
            if request.transport is None or request.transport.is_closing():
                break
            await asyncio.sleep(0.02)
        return resp

    aborted: list[str] = []

    async def abort(request: web.Request) -> web.Response:
        aborted.append(f"{request.host}")
        return web.json_response({})

    routes = (web.post("/abort_request", abort),)
    async with fake_engine(prefill, routes=routes) as p, fake_engine(decode, routes=routes) as d:
        pe = {"url": p, "bootstrap_port": 9} if engine == "sglang" else p
        gw = await gateway([pd_model(engine, [{"name": "rs", "prefill": [pe], "decode": [d]}])],
                           health={"interval_s": 60},
                           watchdog={"first_chunk_timeout_s": 0.3, "response_timeout_s": 0.3, "idle_timeout_s": 0.3})
        with gw.gw.request_log.capture() as lines:
            st, hdrs, raw = await asyncio.wait_for(post(gw, body(stream=stream)), 20)
        name = _pod(d)
        if shape == "stream_idle":
            assert st == 200, raw[:300]
            last = orjson.loads(raw.rstrip().split(b"\n")[-1].removeprefix(b"data: "))
            assert last["error"]["code"] == "upstream_timeout", last
            message = last["error"]["message"]
        elif shape == "whole_broken":
            assert st == 502, raw[:300]
            assert hdrs.get("x-error-pd-decode") == "reset" and "x-error-upstream" not in hdrs, dict(hdrs)
            err = orjson.loads(raw)["error"]
            assert err["code"] == "upstream_incomplete"
            message = err["message"]
        else:
            assert st == 504, raw[:300]
            assert hdrs.get("x-error-pd-decode") == "true" and "x-error-upstream" not in hdrs, dict(hdrs)
            err = orjson.loads(raw)["error"]
            assert err["code"] == "upstream_timeout"
            message = err["message"]
        assert message.startswith(f"decode endpoint {name}"), message
        assert lines[0]["error"].startswith(f"decode endpoint {name}"), lines[0]
        if engine == "sglang" and shape != "whole_broken":     # a stalled decode is told to drop the request
            assert await until(lambda: name in aborted, timeout=10), aborted


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("shape", ["page", "stream_to_whole", "whole_to_stream"])
async def test_a_decode_whose_200_no_client_can_read_is_the_decodes_bad_response(gateway, engine, shape):
    """A decode that answers 200 with what no client could read (a page that is not a JSON object,
    an event stream to a request for a whole body, a whole body to a stream) is the decode's
    protocol fault: 502 ``upstream_bad_response`` with ``x-error-pd-decode: bad_response`` (not the
    whole-request engine's ``x-error-upstream``), its message (and the log line's error) naming the
    decode endpoint, as docs/pd.md's failures table says."""
    stream = shape == "whole_to_stream"

    async def prefill(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({**ANSWER, "kv_transfer_params": {"remote_engine_id": "p"}} if engine == "vllm"
                                 else ANSWER)

    async def decode(request: web.Request) -> web.Response:
        await request.read()
        if shape == "page":
            return web.Response(body=b"<html>maintenance</html>", content_type="text/html")
        if shape == "stream_to_whole":
            return web.Response(body=CHUNK + b"data: [DONE]\n\n", content_type="text/event-stream")
        return web.json_response(ANSWER)

    async with fake_engine(prefill) as p, fake_engine(decode) as d:
        pe = {"url": p, "bootstrap_port": 9} if engine == "sglang" else p
        gw = await gateway([pd_model(engine, [{"name": "rs", "prefill": [pe], "decode": [d]}])],
                           health={"interval_s": 60})
        with gw.gw.request_log.capture() as lines:
            st, hdrs, raw = await asyncio.wait_for(post(gw, body(stream=stream)), 20)
        assert st == 502, raw[:300]
        assert hdrs.get("x-error-pd-decode") == "bad_response" and "x-error-upstream" not in hdrs, dict(hdrs)
        err = orjson.loads(raw)["error"]
        assert err["code"] == "upstream_bad_response", err
        name = _pod(d)
        assert err["message"].startswith(f"decode endpoint {name}: "), err
        assert lines[0]["error"].startswith(f"decode endpoint {name}: "), lines[0]
        page = await gw.metrics_text()
        assert metric(page, "switchyard_upstream_errors_total", endpoint=name, error_class="protocol") == 1
