"""Tracing end to end: the gateway and the simulated engines export OTLP/HTTP to a real receiver
on loopback (tests/support/otlp_receiver.py), which decodes the protobuf. What a user of a trace viewer
would see: one tree per request, engine spans under the gateway's legs, the sampling ratio,
excluded paths, and requests unaffected by a collector that is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from gateway.observability.tracing import NO_TRACING
from gateway.server.run import free_port
from tests.support.batch import jsonl, run_to_end
from tests.support.factories import model_block, pd_model, roleset
from tests.support.fake_engine import fake_engine
from tests.support.http import anthropic_client, openai_client, post, sim_state
from tests.support.otlp_receiver import OTLPReceiver, Span
from tests.support.waiting import wait_for

MSG = [{"role": "user", "content": "Trace this request through the gateway and the engines. " * 4}]
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
async def receiver():
    rx = await OTLPReceiver().start()
    yield rx
    await rx.close()


def traced(rx: OTLPReceiver, **over) -> dict:
    """A ``tracing:`` block exporting to ``rx`` quickly."""
    return {"enabled": True, "endpoint": rx.url, "batch_delay_s": 0.05, "export_timeout_s": 2.0, **over}


def traceparent(trace_id: str = CLIENT_TRACE, span_id: str = CLIENT_SPAN, sampled: bool = True) -> str:
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


def server_span(rx: OTLPReceiver, request_id: str) -> Span | None:
    return next((s for s in rx.spans if s.kind == "SERVER" and s.service == "switchyard"
                 and s.attributes.get("gen_ai.request.id") == request_id), None)


def gateway_spans(rx: OTLPReceiver) -> list[Span]:
    return [s for s in rx.spans if s.service == "switchyard"]


async def flush(gw) -> None:
    """Stop the gateway: its shutdown flushes every queued span."""
    await gw.runner.cleanup()


async def test_aggregated_request_is_one_tree_with_the_engine_span_under_its_leg(sims, gateway, receiver):
    rx = receiver
    a = await sims("vllm", "m", otlp_traces_endpoint=rx.url)
    b = await sims("vllm", "m", otlp_traces_endpoint=rx.url)
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [a.url, b.url]}], tracing=traced(rx))
    status, headers, _ = await post(gw, {"model": "m", "messages": MSG, "stream": True, "max_tokens": 5,
                                         "user": "alice"}, {"traceparent": traceparent()})
    assert status == 200
    assert gw.runner.server.edge.lane_requests == 1     # traced on the edge's fast lane, as untraced requests are
    rid = headers["request-id"]
    assert await rx.wait_for(lambda r: server_span(r, rid) and len(r.trace(CLIENT_TRACE)) >= 4)
    root = server_span(rx, rid)
    # the client's trace continues: the request span is the child of the client's span
    assert (root.trace_id, root.parent_id, root.name) == (CLIENT_TRACE, CLIENT_SPAN, "POST /v1/chat/completions")
    at = root.attributes
    assert at["gen_ai.request.model"] == "m" and at["gen_ai.operation.name"] == "chat"
    assert at["gen_ai.usage.input_tokens"] > 0 and at["gen_ai.usage.output_tokens"] == 5
    assert at["gen_ai.usage.cache_read.input_tokens"] == 0
    assert at["gen_ai.response.finish_reasons"] == ["length"]
    assert at["gen_ai.latency.time_to_first_token"] > 0 and root.event("first_token") is not None
    # the GenAI conventions' name of it, and vLLM's (kept for the dashboards that read it)
    assert at["gen_ai.response.time_to_first_chunk"] == at["gen_ai.latency.time_to_first_token"]
    assert at["user.id"] == "alice" and at["http.response.status_code"] == 200
    assert root.status == "UNSET"
    route, leg = rx.children(root)
    assert route.name == "route" and route.kind == "INTERNAL"
    assert route.attributes["switchyard.route.strategy"] == "least-request"
    assert route.attributes["switchyard.route.candidates"] == 2
    assert route.attributes["switchyard.route.fallback"] is False
    assert route.attributes["switchyard.route.endpoint"] == headers["target-pod"]
    assert (leg.name, leg.kind) == ("generate", "CLIENT")
    assert f'{leg.attributes["server.address"]}:{leg.attributes["server.port"]}' == headers["target-pod"]
    assert leg.attributes["http.response.status_code"] == 200
    # the engine got the leg's traceparent, and its own span hangs under the leg
    engine = a if a.url.endswith(headers["target-pod"].split(":")[1]) else b
    (got,) = (await sim_state(engine.url))["traceparents"]
    assert leg.is_parent_of(got["traceparent"]) and got["request_id"] == rid
    assert await rx.wait_for(lambda r: r.children(leg))
    (llm,) = rx.children(leg)
    assert (llm.name, llm.kind, llm.service) == ("llm_request", "SERVER", "vllm")
    assert llm.attributes["gen_ai.usage.completion_tokens"] == 5


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_pd_request_has_prefill_and_decode_legs_each_joined_by_its_engine(sims, gateway, receiver, engine):
    rx = receiver
    p = await sims(engine, "m", role="prefill", otlp_traces_endpoint=rx.url)
    d = await sims(engine, "m", role="decode", otlp_traces_endpoint=rx.url)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])], tracing=traced(rx))
    status, headers, _ = await post(gw, {"model": "m", "messages": MSG, "stream": True, "max_tokens": 4,
                                         "stream_options": {"include_usage": True}})
    assert status == 200
    rid = headers["request-id"]
    assert await rx.wait_for(lambda r: server_span(r, rid) and len(r.trace(server_span(r, rid).trace_id)) >= 6)
    root = server_span(rx, rid)
    assert root.parent_id == ""             # no traceparent from the client: a new trace
    kids = {s.name: s for s in rx.children(root)}
    assert set(kids) == {"route", "prefill", "decode"}
    route, prefill, decode = kids["route"], kids["prefill"], kids["decode"]
    assert route.attributes["switchyard.route.strategy"] == "pd"
    assert route.attributes["switchyard.route.endpoint"] == headers["target-pod"]
    assert route.attributes["switchyard.route.prefill_endpoint"] == headers["prefill-target-pod"]
    assert "switchyard.route.prefix_match_percent" in route.attributes
    assert prefill.kind == decode.kind == "CLIENT"
    for leg, pod in ((prefill, headers["prefill-target-pod"]), (decode, headers["target-pod"])):
        assert f'{leg.attributes["server.address"]}:{leg.attributes["server.port"]}' == pod
        assert leg.attributes["switchyard.roleset"] == "rs-1"
    assert root.attributes["switchyard.endpoint"] == headers["target-pod"]
    assert root.attributes["gen_ai.usage.output_tokens"] == 4
    # each engine received its own leg's traceparent and traced under it
    for sim, leg in ((p, prefill), (d, decode)):
        (got,) = (await sim_state(sim.url))["traceparents"]
        assert leg.is_parent_of(got["traceparent"]), sim.cfg.role
    assert await rx.wait_for(lambda r: r.children(prefill) and r.children(decode))
    (p_llm,), (d_llm,) = rx.children(prefill), rx.children(decode)
    assert p_llm.name == d_llm.name == "llm_request" and p_llm.service == d_llm.service == engine
    assert p_llm.attributes["enginesim.role"] == "prefill" and d_llm.attributes["enginesim.role"] == "decode"


async def test_retry_is_a_second_leg_and_an_event(sims, gateway, receiver):
    rx = receiver
    sim = await sims("vllm", "m")
    dead = f"http://127.0.0.1:{free_port()}"
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [dead, sim.url]}],
                       routing={"strategy": "round-robin"}, health={"enabled": False}, tracing=traced(rx))
    retried = None
    for _ in range(2):          # round-robin: one of two requests starts on the dead endpoint
        status, headers, _ = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2})
        assert status == 200
        await rx.wait_for(lambda r, rid=headers["request-id"]: server_span(r, rid))
        root = server_span(rx, headers["request-id"])
        if root.attributes.get("switchyard.retries") == 1:
            retried = root
            break
    assert retried is not None
    assert retried.event("retry")["error.type"] == "connect"
    legs = [s for s in rx.children(retried) if s.name == "generate"]
    assert [(s.status, s.attributes.get("error.type"), s.attributes.get("switchyard.attempt")) for s in legs] == [
        ("ERROR", "connect", None), ("UNSET", None, 2)]
    assert [s.name for s in rx.children(retried)].count("route") == 2


async def test_a_retried_pd_requests_second_pair_legs_are_its_second_attempt(sims, gateway, receiver):
    """A P/D request whose decode answers a 5xx is retried on another pair: the trace shows a second
    route span, and the second pair's prefill and decode legs carry switchyard.attempt 2, as a
    retried aggregated request's second generate leg does."""
    rx = receiver
    p1, d1 = await sims("vllm", "m", role="prefill"), await sims("vllm", "m", role="decode")
    p2, d2 = await sims("vllm", "m", role="prefill"), await sims("vllm", "m", role="decode")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p1, d1), roleset("vllm", p2, d2, name="rs-2")])],
                       tracing=traced(rx))
    # every decode answers 500: the first pair fails, the retry's pair too, and the client gets the 500
    status, headers, _ = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2},
                                    {"x-sim-fault": "decode.status=500"})
    assert status == 500
    await flush(gw)
    root = server_span(rx, headers["request-id"])
    assert root.attributes["switchyard.retries"] == 1 and root.event("retry") is not None
    legs = sorted((s for s in rx.children(root) if s.name != "route"), key=lambda s: s.start_ns)
    assert [(s.name, s.attributes.get("switchyard.attempt")) for s in legs] == [
        ("prefill", None), ("decode", None), ("prefill", 2), ("decode", 2)]
    assert legs[0].attributes["switchyard.roleset"] != legs[2].attributes["switchyard.roleset"]


@pytest.mark.parametrize("fault", ["drop_after=7", "error_after=7"])
async def test_a_continued_stream_ends_its_broken_leg_as_an_error_and_marks_the_next(sims, gateway, receiver, fault):
    """Mid-stream continuation as a trace viewer shows it: the leg whose stream broke ends there as
    an error (its engine's span under it), and the leg that continues the stream is told apart."""
    rx = receiver
    bad = await sims("vllm", "m", fault=fault, otlp_traces_endpoint=rx.url)
    good = await sims("vllm", "m", otlp_traces_endpoint=rx.url)
    gw = await gateway([model_block("m", "vllm", [bad.url, good.url], strategy="round-robin", migration_limit=1)],
                       tracing=traced(rx))
    status, headers, body = await post(gw, {"model": "m", "messages": MSG, "stream": True, "max_tokens": 30})
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    rid = headers["request-id"]
    bad_port, good_port = (int(sim.url.rsplit(":", 1)[1]) for sim in (bad, good))
    await flush(gw)
    assert await rx.wait_for(lambda r: len(r.named("llm_request")) == 2)
    root = server_span(rx, rid)
    migration = root.event("migration")
    assert migration is not None and migration["switchyard.endpoint"] == f"127.0.0.1:{bad_port}"
    assert root.status == "UNSET" and root.attributes["switchyard.endpoint"] == f"127.0.0.1:{good_port}"
    broken, continued = [s for s in rx.children(root) if s.name == "generate"]
    assert broken.attributes["server.port"] == bad_port and continued.attributes["server.port"] == good_port
    # the broken leg failed where it broke, before its continuation began
    assert broken.status == "ERROR" and broken.attributes["error.type"].startswith("upstream_")
    assert broken.end_ns <= continued.start_ns
    assert "switchyard.migration.leg" not in broken.attributes
    assert continued.status == "UNSET" and continued.attributes["switchyard.migration.leg"] == 2
    for leg in (broken, continued):
        (llm,) = rx.children(leg)
        assert llm.name == "llm_request"


async def test_each_batch_line_is_a_trace_with_its_engine_span_under_its_leg(sims, gateway, receiver, tmp_path):
    """A batch's lines run through the pipeline in-process: each is a trace of its own, named after
    the batch's endpoint and carrying its batch and custom id, whose leg the engine's span joins."""
    rx = receiver
    sim = await sims("vllm", "m", otlp_traces_endpoint=rx.url)
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}], tracing=traced(rx),
                       batch={"enabled": True, "dir": str(tmp_path / "batch"), "poll_interval_s": 0.05})
    c = openai_client(gw)
    rows = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "m", "messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 2}}
            for i in range(3)]
    f = await c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    b = await run_to_end(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h")).id)
    assert b.status == "completed" and b.request_counts.completed == 3
    await flush(gw)
    assert await rx.wait_for(lambda r: len(r.named("llm_request", "vllm")) == 3)
    lines = [s for s in gateway_spans(rx) if s.attributes.get("switchyard.batch.id") == b.id]
    assert sorted(s.attributes["switchyard.batch.custom_id"] for s in lines) == ["req-0", "req-1", "req-2"]
    assert len({s.trace_id for s in lines}) == 3
    for line in lines:
        assert (line.name, line.kind, line.parent_id, line.status) == ("POST /v1/chat/completions", "INTERNAL", "", "UNSET")
        assert line.attributes["gen_ai.operation.name"] == "chat"
        assert line.attributes["http.response.status_code"] == 200
        (leg,) = [k for k in rx.children(line) if k.name == "generate"]
        (llm,) = rx.children(leg)
        assert (llm.name, llm.service) == ("llm_request", "vllm")
    # no engine span is left a root of its own
    assert all(s.parent_id for s in rx.named("llm_request", "vllm"))


async def test_messages_and_responses_requests_are_chat_operations(sims, gateway, receiver):
    """OpenTelemetry's GenAI conventions: gen_ai.operation.name is "chat" for a chat completion
    operation, and a well-known value that applies MUST be used; a Messages request and a Responses
    request are each one, as a chat completion is."""
    rx = receiver
    sim = await sims("vllm", "m")
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}], tracing=traced(rx))
    msg = await anthropic_client(gw).messages.with_raw_response.create(
        model="m", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    resp = await openai_client(gw).responses.with_raw_response.create(model="m", input="hi", max_output_tokens=16)
    await flush(gw)
    for raw, path in ((msg, "/v1/messages"), (resp, "/v1/responses")):
        span = server_span(rx, raw.headers["request-id"])
        assert span.name == f"POST {path}" and span.attributes["http.response.status_code"] == 200
        assert span.attributes.get("gen_ai.operation.name") == "chat", path
        assert span.attributes["gen_ai.usage.output_tokens"] > 0


async def test_a_responses_call_the_gateway_relays_to_its_engine_is_a_leg_of_its_trace(sims, gateway, receiver):
    """A GET of a stored response and the replay of a background stream (GET ?stream=true) reach
    the engine that holds the response: each is a CLIENT span under the request's span, whose
    traceparent the engine gets, as a generation's leg is (the client's trace continued)."""
    rx = receiver
    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}], tracing=traced(rx))
    c = openai_client(gw)
    stream = await c.responses.create(model="m", input="x", background=True, stream=True, max_output_tokens=4)
    events = [ev async for ev in stream]
    rid = events[0].response.id
    got = await c.responses.with_raw_response.retrieve(rid, extra_headers={"traceparent": traceparent()})
    replay = await c.responses.retrieve(rid, stream=True, starting_after=0)
    assert [ev async for ev in replay][-1].type == "response.completed"
    await flush(gw)
    assert got.http_response.status_code == 200
    servers = sorted((s for s in gateway_spans(rx) if s.name == "GET /v1/responses/{response_id}"),
                     key=lambda s: s.start_ns)
    assert [(s.trace_id == CLIENT_TRACE, s.parent_id == CLIENT_SPAN) for s in servers] == [(True, True), (False, False)]
    legs = [leg for s in servers for leg in rx.children(s)]
    assert [(leg.name, leg.kind, leg.attributes["http.request.method"], leg.attributes["http.response.status_code"])
            for leg in legs] == [("retrieve", "CLIENT", "GET", 200)] * 2
    engine_parents = [t["traceparent"] for t in (await sim_state(sim.url))["traceparents"]
                      if t["path"] == f"/v1/responses/{rid}"]
    assert len(engine_parents) == 2 and all(any(leg.is_parent_of(tp) for leg in legs) for tp in engine_parents)


async def test_the_log_line_of_a_call_on_a_stored_response_names_its_trace(sims, gateway, receiver):
    """A traced request's log line carries its trace_id: a GET of a stored response (its line
    written by the Responses API, not the pipeline) as a generation's."""
    rx = receiver
    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}], tracing=traced(rx))
    c = openai_client(gw)
    with gw.gw.request_log.capture() as logs:
        created = await c.responses.create(model="m", input="x", max_output_tokens=4)
        got = await c.responses.with_raw_response.retrieve(created.id, extra_headers={"traceparent": traceparent()})
        await wait_for(lambda: len([e for e in logs if e["event"] == "request"]) == 2, timeout=10)
    lines = {e["request_id"]: e for e in logs if e["event"] == "request"}
    assert lines[got.headers["request-id"]].get("trace_id") == CLIENT_TRACE
    assert all(len(line.get("trace_id") or "") == 32 for line in lines.values())


async def test_the_log_lines_of_unknown_paths_and_admin_calls_name_their_traces(sims, gateway, receiver):
    """The lines the gateway writes outside the pipeline for traced requests, an unknown path's 404,
    a method's 405 and an admin call's audit line, carry their trace_id as a generation's does."""
    rx = receiver
    sim = await sims("vllm", "m")
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}], tracing=traced(rx),
                       auth={"api_keys": [{"key": "sk-alice-0123456789", "user": "alice"}], "admin_token": "adm-1"})
    asks = [("GET", "/nope", {}, 404), ("DELETE", "/v1/models", {}, 405),
            ("GET", "/admin/users", {"Authorization": "Bearer adm-1"}, 200)]
    with gw.gw.request_log.capture() as logs:
        async with aiohttp.ClientSession() as s:
            for method, path, headers, status in asks:
                async with s.request(method, gw.url + path, headers={"traceparent": traceparent(), **headers}) as r:
                    assert r.status == status, path
                    await r.read()
        await wait_for(lambda: len([e for e in logs if e["event"] == "request"]) == len(asks), timeout=10)
    lines = {e["path"]: e for e in logs if e["event"] == "request"}
    assert {path: line.get("trace_id") for path, line in lines.items()} == {
        path: CLIENT_TRACE for _, path, _, _ in asks}


async def test_embedding_requests_are_embeddings_operations_on_either_api(sims, gateway, receiver):
    """GenAI conventions: "embeddings" is the operation of an embeddings API, OpenAI's
    /v1/embeddings and vLLM's Cohere-style /v2/embed alike (a well-known value that applies MUST
    be used); their input tokens are the span's as a chat request's are."""
    rx = receiver
    sim = await sims("vllm", "m")
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}], tracing=traced(rx))
    rids = {}
    for path, body in (("/v1/embeddings", {"model": "m", "input": "red apple pie"}),
                       ("/v2/embed", {"model": "m", "texts": ["red apple pie"], "input_type": "search_document",
                                      "embedding_types": ["float"]})):
        status, headers, _ = await post(gw, body, path=path)
        assert status == 200, path
        rids[path] = headers["request-id"]
    await flush(gw)
    for path, rid in rids.items():
        at = server_span(rx, rid).attributes
        assert (at.get("gen_ai.operation.name"), at["gen_ai.request.model"]) == ("embeddings", "m"), path
        assert at["gen_ai.usage.input_tokens"] > 0, path


async def test_the_client_headers_as_the_w3c_test_suite_sends_them(sims, gateway, receiver):
    """W3C Trace Context's test suite: a request with two traceparent headers starts a new trace
    (test_traceparent_duplicated), and tracestate headers sent apart are one list joined in order
    (test_tracestate_multiple_headers_different_keys); malformed ones never fail the request."""
    rx = receiver
    sim = await sims("vllm", "m")
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}], tracing=traced(rx))
    body = {"model": "m", "messages": MSG, "max_tokens": 1}
    other = "12345678901234567890123456789012"

    async def send(headers: list[tuple[str, str]]) -> str:
        async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/chat/completions", json=body,
                                                         headers=headers) as r:
            assert r.status == 200
            await r.read()
            return r.headers["request-id"]

    twice = await send([("traceparent", traceparent()), ("traceparent", traceparent(other))])
    apart = await send([("traceparent", traceparent()), ("tracestate", "foo=1,bar=2"), ("tracestate", "baz=3")])
    await flush(gw)
    root = server_span(rx, twice)
    assert root.parent_id == "" and root.trace_id not in (CLIENT_TRACE, other)
    assert server_span(rx, apart).trace_id == CLIENT_TRACE
    first, second = (await sim_state(sim.url))["traceparents"]
    assert first["traceparent"].split("-")[1] == root.trace_id
    assert second["traceparent"].split("-")[1] == CLIENT_TRACE and second.get("tracestate") == "foo=1,bar=2,baz=3"


async def test_a_traceparent_that_is_not_valid_starts_a_new_trace_and_costs_the_request_nothing(sims, gateway,
                                                                                               receiver):
    rx = receiver
    sim = await sims("vllm", "m")
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}], tracing=traced(rx))
    bad = ["garbage", traceparent("0" * 32), traceparent(span_id="0" * 16), "ff" + traceparent()[2:],
           traceparent().upper(), traceparent() + "-extra", traceparent()[:-1], "00-" + "g" * 32 + "-" + "1" * 16 + "-01",
           "-".join(["00", CLIENT_TRACE, CLIENT_SPAN, "01"] * 40)]
    rids = []
    for value in bad:
        status, headers, _ = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 1},
                                        {"traceparent": value, "tracestate": "k=v"})
        assert status == 200, value
        rids.append(headers["request-id"])
    await flush(gw)
    roots = [server_span(rx, rid) for rid in rids]
    assert all(r.parent_id == "" and r.trace_id != CLIENT_TRACE for r in roots)
    # each engine leg carried the gateway's own context, not the client's value
    sent = [t["traceparent"] for t in (await sim_state(sim.url))["traceparents"]]
    assert [t.split("-")[1] for t in sent] == [r.trace_id for r in roots]
    assert all(t["tracestate"] is None for t in (await sim_state(sim.url))["traceparents"])


async def test_w3c_headers_that_are_not_valid_write_nothing_to_the_log(sims, gateway, receiver, caplog):
    """A malformed ``tracestate`` member, a ``tracestate`` over 512 characters, a ``traceparent``
    over 512: ignored as W3C Trace Context says, and quietly, as a malformed ``traceparent`` is; a
    warning a request quoting the client's header would let any client write the gateway's log."""
    rx = receiver
    sim = await sims("vllm", "m")
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}], tracing=traced(rx))
    caplog.set_level(logging.WARNING)
    for headers in ({"traceparent": traceparent(), "tracestate": "not a member, k=v"},
                    {"traceparent": traceparent(), "tracestate": "k=v," * 200},
                    {"traceparent": traceparent() + "-" + "0" * 600, "tracestate": "k=v"}):
        status, _, _ = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 1}, headers)
        assert status == 200, headers
    assert [r.getMessage()[:120] for r in caplog.records if r.name.startswith("opentelemetry.trace")] == []


async def test_watchdog_and_abort_are_events(sims, gateway, receiver):
    rx = receiver
    p, d = await sims("vllm", "m", role="prefill"), await sims("vllm", "m", role="decode")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])], tracing=traced(rx),
                       watchdog={"first_chunk_timeout_s": 0.2})
    status, headers, _ = await post(gw, {"model": "m", "messages": MSG, "stream": True, "max_tokens": 4},
                                    {"x-sim-fault": "decode.stall_before_first=inf"})
    assert status == 504          # the client's head waits for the decode's first bytes, which never come
    rid = headers["request-id"]
    assert await rx.wait_for(lambda r: server_span(r, rid))
    root = server_span(rx, rid)
    assert root.event("watchdog")["switchyard.watchdog.phase"] == "first_chunk"
    assert root.event("abort")["switchyard.endpoint"] == headers["target-pod"]
    assert root.status == "ERROR" and root.attributes["error.type"] == "watchdog_first_chunk"
    decode = next(s for s in rx.children(root) if s.name == "decode")
    assert decode.status == "ERROR"


@pytest.mark.parametrize("engine,stream", [("vllm", False), ("sglang", False), ("sglang", True)])
async def test_a_watchdog_fire_before_an_aggregated_legs_head_is_a_watchdog_event(sims, gateway, receiver,
                                                                                   engine, stream):
    """A plain leg the watchdog watches (aggregated: true) whose engine is silent: a non-streamed
    answer's head comes with its body and SGLang's stream head with its first token, so the
    watchdog's bound fires before the head. The trace says so as it does for a P/D decode's fire and
    for a vLLM stream's (whose head comes first): a watchdog event, error.type watchdog_<phase>."""
    rx = receiver
    sim = await sims(engine, "m")
    gw = await gateway([{"name": "m", "engine": engine, "endpoints": [sim.url]}], tracing=traced(rx),
                       watchdog={"first_chunk_timeout_s": 0.2, "response_timeout_s": 0.2, "aggregated": True})
    status, headers, _ = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 4, "stream": stream},
                                    {"x-sim-fault": "stall_before_first=inf"})
    assert status == 504
    await flush(gw)
    root = server_span(rx, headers["request-id"])
    phase = "first_chunk" if stream else "response"
    assert root.event("watchdog") == {"switchyard.watchdog.phase": phase, "switchyard.watchdog.seconds": 0.2}
    assert root.status == "ERROR" and root.attributes["error.type"] == f"watchdog_{phase}"
    (leg,) = [s for s in rx.children(root) if s.name == "generate"]
    assert leg.status == "ERROR"


async def test_sampling_ratio_zero_and_one(sims, gateway, receiver):
    rx = receiver
    sim = await sims("vllm", "m")
    model = [{"name": "m", "engine": "vllm", "endpoints": [sim.url]}]
    none = await gateway(model, tracing=traced(rx, sample_ratio=0.0))
    for _ in range(3):
        assert (await post(none, {"model": "m", "messages": MSG, "max_tokens": 1}))[0] == 200
    # a sampled traceparent from the client is honoured (parent-based), an unsampled one is not
    assert (await post(none, {"model": "m", "messages": MSG, "max_tokens": 1},
                       {"traceparent": traceparent()}))[0] == 200
    assert (await post(none, {"model": "m", "messages": MSG, "max_tokens": 1},
                       {"traceparent": traceparent("1" * 32, sampled=False)}))[0] == 200
    await flush(none)
    assert {s.trace_id for s in gateway_spans(rx)} == {CLIENT_TRACE}
    # unsampled requests still propagate a context (flags 00), so the engine does not start its own trace
    sent = [t["traceparent"] for t in (await sim_state(sim.url))["traceparents"]]
    assert [int(t.rsplit("-", 1)[1], 16) & 1 for t in sent] == [0, 0, 0, 1, 0]   # the sampled flag
    assert sent[-1].startswith("00-" + "1" * 32) and sent[-2].startswith(f"00-{CLIENT_TRACE}-")

    rx.spans.clear()
    every = await gateway(model, tracing=traced(rx, sample_ratio=1.0))
    rids = [(await post(every, {"model": "m", "messages": MSG, "max_tokens": 1}))[1]["request-id"]
            for _ in range(3)]
    await flush(every)
    assert all(server_span(rx, rid) for rid in rids)


async def test_middle_ratio_samples_by_trace_id(sims, gateway, receiver):
    """TraceIdRatioBased keeps a trace when the low 64 bits of its id are below ratio x 2^64: with
    parent_based off, the client's ids (all flagged sampled) decide deterministically."""
    rx = receiver
    sim = await sims("vllm", "m")
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}],
                       tracing=traced(rx, sample_ratio=0.5, parent_based=False))
    low = [f"{i:016x}" + f"{i:016x}" for i in (1, 2, 0x3fff_ffff_ffff_ffff, 0x7fff_ffff_ffff_fff0)]
    high = [f"{i:016x}" + f"{i:016x}" for i in (0x8000_0000_0000_0010, 0xc000_0000_0000_0000, 0xffff_ffff_ffff_fffe)]
    for tid in low + high:
        status, _, _ = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 1},
                                  {"traceparent": traceparent(tid)})
        assert status == 200
    await flush(gw)
    assert {s.trace_id for s in gateway_spans(rx) if s.kind == "SERVER"} == set(low)


async def test_probes_and_metrics_are_not_traced(sims, gateway, receiver):
    rx = receiver
    sim = await sims("vllm", "m")
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}], tracing=traced(rx))
    async with aiohttp.ClientSession() as s:
        for path in ("/health", "/ready", "/metrics", "/status.json", "/v1/models", "/nope"):
            async with s.get(gw.url + path) as r:
                await r.read()
    await flush(gw)
    assert sorted((s.name, s.attributes["http.response.status_code"]) for s in gateway_spans(rx)) == [
        ("GET", 404), ("GET /v1/models", 200)]


async def test_unreachable_collector_costs_requests_nothing(sims, gateway):
    sim = await sims("vllm", "m")
    closed = f"http://127.0.0.1:{free_port()}/v1/traces"
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}],
                       tracing={"enabled": True, "endpoint": closed, "batch_delay_s": 0.05, "export_timeout_s": 0.3})
    for i in range(6):
        status, _, body = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 3, "stream": i % 2 == 0})
        assert status == 200 and body
    # the exporter tried, failed, and said so in a metric
    async def counted() -> bool:
        text = await gw.metrics_text()
        return "switchyard_trace_export_failures_total 0.0" not in text \
            and 'switchyard_trace_spans_total{result="failed"}' in text
    assert await wait_for(counted, timeout=10)


async def test_spans_a_full_queue_drops_are_counted(sims, gateway):
    # a collector that takes the connection and the export and never answers: the exporter holds
    # its batch of 4 until export_timeout_s while the 4-span queue fills and overflows
    held: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read()

    collector = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = collector.sockets[0].getsockname()[1]
    sim = await sims("vllm", "m")
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}],
                       tracing={"enabled": True, "endpoint": f"http://127.0.0.1:{port}/v1/traces",
                                "batch_delay_s": 0.05, "export_timeout_s": 3.0, "max_queue_size": 4})
    try:
        await post(gw, {"model": "m", "messages": MSG, "max_tokens": 1})
        assert await wait_for(lambda: bool(held), timeout=10)       # its spans' export is held
        for _ in range(10):             # 3 spans each: 30 spans for a queue of 4
            status, _, _ = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 1})
            assert status == 200
        text = gw.gw.metrics.render().decode()
        dropped = re.search(r'switchyard_trace_spans_total\{result="dropped"\} (\S+)', text)
        assert dropped is not None and float(dropped.group(1)) >= 30 - 2 * 4
    finally:
        for w in held:
            w.close()
        collector.close()


async def test_shutdown_flushes_queued_spans(sims, gateway, receiver):
    rx = receiver
    sim = await sims("vllm", "m")
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}],
                       tracing=traced(rx, batch_delay_s=60.0))
    _, headers, _ = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 1})
    assert not rx.spans                     # still queued: the next scheduled export is a minute away
    await flush(gw)
    assert server_span(rx, headers["request-id"]) is not None
    assert 'switchyard_trace_spans_total{result="exported"} 3.0' in gw.gw.metrics.render().decode()


async def test_without_tracing_the_client_traceparent_passes_through(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}])
    assert gw.gw.tracing is NO_TRACING
    await post(gw, {"model": "m", "messages": MSG, "max_tokens": 1}, {"traceparent": traceparent()})
    assert [t["traceparent"] for t in (await sim_state(sim.url))["traceparents"]] == [traceparent()]


async def test_without_tracing_a_responses_call_relayed_to_its_engine_passes_the_client_traceparent(sims, gateway):
    """As a generation's request does: a GET and a cancel of a response its engine keeps reach that
    engine with the client's traceparent and tracestate, when the gateway traces nothing itself."""
    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}])
    assert gw.gw.tracing is NO_TRACING
    c = openai_client(gw)
    created = await c.responses.create(model="m", input="x", max_output_tokens=2)
    w3c = {"traceparent": traceparent(), "tracestate": "vendor=1"}
    await c.responses.retrieve(created.id, extra_headers=w3c)
    with contextlib.suppress(openai.BadRequestError):      # a response that completed is not cancelled
        await c.responses.cancel(created.id, extra_headers=w3c)
    seen = [(t["traceparent"], t["tracestate"]) for t in (await sim_state(sim.url))["traceparents"]
            if t["path"].startswith(f"/v1/responses/{created.id}")]
    assert seen == [(traceparent(), "vendor=1")] * 2


async def test_a_request_that_named_an_alias_says_both_the_alias_and_the_model_that_served_it(sims, gateway,
                                                                                             receiver):
    """OpenTelemetry's GenAI conventions: gen_ai.request.model is the model the request is being made
    to, as the client named it (the alias), and gen_ai.response.model the model that answered (its
    target); a request that named a model has that model as both."""
    rx = receiver
    sim = await sims("vllm", "m")
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}], tracing=traced(rx),
                       aliases=[{"name": "chat", "targets": [{"model": "m"}]}])
    via_alias = await post(gw, {"model": "chat", "messages": MSG, "max_tokens": 2})
    direct = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2})
    assert via_alias.status == direct.status == 200 and via_alias.headers["x-served-model"] == "m"
    await flush(gw)
    at = server_span(rx, via_alias.headers["request-id"]).attributes
    assert (at["gen_ai.request.model"], at.get("gen_ai.response.model")) == ("chat", "m")
    at = server_span(rx, direct.headers["request-id"]).attributes
    assert (at["gen_ai.request.model"], at.get("gen_ai.response.model")) == ("m", "m")


async def test_the_408_the_edge_gives_a_body_that_stopped_coming_is_the_request_spans_status(sims, gateway,
                                                                                            receiver):
    """A chunked body that stops coming is answered 408 by the edge while the pipeline reads it; the
    request's span says the 408 the client got (and the log line says), not a client's 499."""
    rx = receiver
    sim = await sims("vllm", "m")
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}], tracing=traced(rx),
                       server={"body_timeout_s": 0.3})
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\nx-request-id: body-stopped\r\n\r\n5\r\n{\"mod\r\n")
    head = await asyncio.wait_for(reader.read(65536), 10)
    writer.close()
    assert head.startswith(b"HTTP/1.1 408 ")
    await flush(gw)
    at = server_span(rx, "body-stopped").attributes
    assert (at["http.response.status_code"], at["error.type"]) == (408, "http")


async def test_the_response_model_is_the_one_the_engines_answer_names(gateway, receiver):
    """OpenTelemetry's GenAI conventions: gen_ai.response.model is the name of the model that
    generated the response, which the engine's answer names in its ``model`` (a whole answer's, a
    stream's chunks'), where the gateway's model name is the one the request was made to."""
    rx = receiver
    named = "org/m-2026-12"

    async def answering(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": named}
        if not body.get("stream"):
            return web.json_response({"id": "c", "object": "chat.completion", "created": 1, "model": named,
                                      "choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant", "content": "hi"}}],
                                      "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for choice in ({"index": 0, "delta": {"role": "assistant", "content": "hi"}},
                       {"index": 0, "delta": {}, "finish_reason": "stop"}):
            await resp.write(b"data: " + orjson.dumps({**chunk, "choices": [choice]}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async with fake_engine(answering) as url:
        gw = await gateway([model_block("m", "vllm", [url])], tracing=traced(rx), scrape={"enabled": False})
        whole = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2})
        streamed = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2, "stream": True})
        assert whole.status == streamed.status == 200
        await flush(gw)
    for reply in (whole, streamed):
        at = server_span(rx, reply.headers["request-id"]).attributes
        assert (at["gen_ai.request.model"], at.get("gen_ai.response.model")) == ("m", named)


@pytest.mark.parametrize("version", ["1.0", "1.1"])
async def test_a_whole_answer_whose_client_resets_while_its_body_goes_out_ends_its_span_as_the_cancel(
        gateway, receiver, version):
    """A non-streaming answer of MBs whose client reads its head and resets the connection: the
    request's span, as its log line, says the client's cancel (499, ``client_cancel``), not the 200
    the handler returned before the body went out; over HTTP/1.0 (aiohttp writes that answer) as
    over HTTP/1.1."""
    rx = receiver
    big = orjson.dumps({"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "w" * (24 << 20)},
                                     "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=big, content_type="application/json")

    async with fake_engine(chat) as url:
        gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [url]}], tracing=traced(rx))
        body = orjson.dumps({"model": "m", "messages": MSG, "max_tokens": 2})
        raw = (f"POST /v1/chat/completions HTTP/{version}\r\nHost: gw\r\nContent-Type: application/json\r\n"
               f"x-request-id: cut-{version}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        loop = asyncio.get_running_loop()
        capture = gw.gw.request_log.capture()
        lines = capture.__enter__()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.setblocking(False)
        try:
            await loop.sock_connect(s, ("127.0.0.1", gw.port))
            await loop.sock_sendall(s, raw)
            head = b""
            while b"\r\n\r\n" not in head:
                got = await loop.sock_recv(s, 4096)
                assert got, head
                head += got
            assert head.startswith(f"HTTP/{version} 200".encode()), head[:200]
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        finally:
            s.close()       # with SO_LINGER 0: a reset, MBs of the answer still unsent
        try:        # the line, then the span, once the write's end is known
            assert await wait_for(lambda: [x for x in lines if x["event"] == "request"], timeout=10.0, interval=0.01)
        finally:
            capture.__exit__(None, None, None)
        await flush(gw)
    at = server_span(rx, f"cut-{version}").attributes
    assert (at["http.response.status_code"], at.get("error.type")) == (499, "client_cancel"), at


async def test_the_response_model_of_a_responses_or_messages_stream_is_the_one_its_events_name(gateway, receiver):
    """A Responses stream's ``response.created`` and terminal event, and a Messages stream's
    ``message_start``, name the model that answered, and the relay decodes them already: the span's
    gen_ai.response.model is that name, as for chat, where it was the gateway's model name."""
    rx = receiver
    named = "org/m-2026-12"

    def sse(name: str, data: dict) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) + b"\n\n"

    async def responses(request: web.Request) -> web.StreamResponse:
        await request.read()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        resp = {"id": "resp_1", "object": "response", "created_at": 1, "model": named, "status": "in_progress",
                "output": []}
        usage = {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}
        await out.write(sse("response.created", {"sequence_number": 0, "response": resp}))
        await out.write(sse("response.output_text.delta", {"sequence_number": 1, "output_index": 0,
                                                           "content_index": 0, "item_id": "m1", "delta": "hi"}))
        await out.write(sse("response.completed", {"sequence_number": 2, "response": {
            **resp, "status": "completed", "usage": usage}}))
        await out.write_eof()
        return out

    async def messages(request: web.Request) -> web.StreamResponse:
        await request.read()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        msg = {"id": "msg_1", "type": "message", "role": "assistant", "model": named, "content": [],
               "stop_reason": None, "usage": {"input_tokens": 3, "output_tokens": 0}}
        await out.write(sse("message_start", {"message": msg}))
        await out.write(sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}))
        await out.write(sse("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "hi"}}))
        await out.write(sse("content_block_stop", {"index": 0}))
        await out.write(sse("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 1}}))
        await out.write(sse("message_stop", {}))
        await out.write_eof()
        return out

    async with fake_engine(responses, paths=("/v1/responses",), routes=(web.post("/v1/messages", messages),)) as url:
        gw = await gateway([model_block("m", "vllm", [url])], tracing=traced(rx), scrape={"enabled": False})
        r = await post(gw, {"model": "m", "input": "hi", "stream": True, "store": False}, path="/v1/responses")
        m = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2, "stream": True}, path="/v1/messages")
        assert r.status == m.status == 200, (r.body, m.body)
        await flush(gw)
    for reply in (r, m):
        at = server_span(rx, reply.headers["request-id"]).attributes
        assert (at["gen_ai.request.model"], at.get("gen_ai.response.model")) == ("m", named)
