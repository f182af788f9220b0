"""The pipeline's own guarantees: every request goes through its router, a bug still answers,
and client values echoed in headers never cost the client its answer."""

from __future__ import annotations

import orjson
import pytest

from gateway.pipeline.relay import Relay
from gateway.pipeline.sse import SSEScanner
from gateway.upstream.upstream import Upstream
from handlers import adapter_for
from tests.support.factories import model_block
from tests.support.http import post, sse_events

CHAT = [{"role": "user", "content": "One endpoint today, two tomorrow."}]


async def test_one_candidate_still_goes_through_the_router(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    status, headers, _ = await post(gw.url, {"model": "m", "messages": CHAT, "max_tokens": 2},
                                    {"routing-strategy": "session-affinity"})
    assert status == 200
    assert headers.get("x-session-id")                 # the session sticks from the first request
    long_prompt = [{"role": "user", "content": "a shared system prompt " * 200}]
    status, _, _ = await post(gw.url, {"model": "m", "messages": long_prompt, "max_tokens": 2},
                              {"routing-strategy": "prefix-cache"})
    assert status == 200
    assert gw.gw.routing.ctx.prefix_index.stats()["blocks"] > 0    # the index learned the prompt
    text = await gw.metrics_text()
    assert 'switchyard_routing_decision_seconds_count{strategy="prefix-cache"} 1.0' in text


@pytest.mark.parametrize("strategy", ["prefix-cache", "prefix-cache:2,least-request:1"])
async def test_the_leg_goes_out_before_the_prefix_index_records_the_prompt(sims, gateway, monkeypatch, strategy):
    """The prompt's record in the index changes nothing in the choice it follows, so it waits until
    the leg is written: a long prompt's hashing is not on its way to the engine."""
    sims_ = [await sims("vllm", "m") for _ in range(2)]
    gw = await gateway([model_block("m", "vllm", [s.url for s in sims_])])
    order: list[str] = []
    index = gw.gw.routing.ctx.prefix_index
    insert, begin = index.insert, Upstream.begin
    monkeypatch.setattr(index, "insert", lambda *a: (order.append("record"), insert(*a))[1])
    monkeypatch.setattr(Upstream, "begin", lambda self, *a: (order.append("leg"), begin(self, *a))[1])
    long_prompt = [{"role": "user", "content": "a shared system prompt " * 200}]
    status, _, _ = await post(gw.url, {"model": "m", "messages": long_prompt, "max_tokens": 2},
                              {"routing-strategy": strategy})
    assert status == 200
    assert order == ["leg", "record"]
    assert index.stats()["blocks"] > 0


@pytest.mark.parametrize("model", ["\u0000", "bad\r\nx-injected: 1", "caf\u00e9\u0007", "x" * 5000])
async def test_a_model_name_no_header_can_carry_still_gets_its_404(sims, gateway, model):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    status, headers, body = await post(gw.url, {"model": model, "messages": CHAT})
    assert status == 404
    assert orjson.loads(body)["error"]["code"] == "model_not_found"
    echoed = headers["x-error-no-model-backends"]
    assert echoed.isascii() and echoed.isprintable() and len(echoed) <= 256
    assert "x-injected" not in {k.lower() for k in headers}


async def test_unsafe_strategy_header_is_escaped_in_the_answer(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    status, headers, body = await post(gw.url, {"model": "m", "messages": CHAT}, {"routing-strategy": "caf\u00e9"})
    assert status == 400 and orjson.loads(body)["error"]["param"] == "routing-strategy"
    assert headers["routing-strategy"].isascii()


async def test_names_the_gateway_refuses_never_become_metric_labels(sims, gateway):
    """A client's unknown model or strategy is answered (404, 400) and logged, but is no label
    value: arbitrary names would grow /metrics without bound, and bytes that are not UTF-8 (a header
    read with surrogateescape) would break its encoding for every scraper."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    for i in range(3):
        status, _, _ = await post(gw.url, {"model": f"nope-{i}", "messages": CHAT})
        assert status == 404
        status, _, _ = await post(gw.url, {"model": "m", "messages": CHAT}, {"routing-strategy": f"bogus-{i}"})
        assert status == 400
    text = await gw.metrics_text()
    assert "nope-" not in text and "bogus-" not in text
    assert 'switchyard_requests_total{model="-",status="404"' in text


async def test_a_bug_before_headers_is_an_openai_500(sims, gateway, monkeypatch):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])

    def broken(*a, **kw):
        raise RuntimeError("a bug in routing")

    monkeypatch.setattr(gw.gw.routing, "route", broken)
    status, headers, body = await post(gw.url, {"model": "m", "messages": CHAT}, {"x-request-id": "bug-1"})
    assert status == 500
    assert orjson.loads(body)["error"]["code"] == "internal_error"
    assert headers["request-id"] == "bug-1"
    assert "switchyard_internal_errors_total 1.0" in await gw.metrics_text()


async def test_a_bug_after_headers_ends_the_stream_with_an_error_event(sims, gateway, monkeypatch):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])

    def broken(self, rec, scanner):
        raise RuntimeError("a bug in accounting")

    monkeypatch.setattr(Relay, "observe_stream", broken)
    status, _, body = await post(gw.url, {"model": "m", "messages": CHAT, "stream": True, "max_tokens": 3})
    assert status == 200
    events = sse_events(body)
    assert events[-1]["error"]["code"] == "internal_error"
    assert "switchyard_internal_errors_total 1.0" in await gw.metrics_text()


def test_native_generate_meta_info_is_not_read_as_usage():
    """Only OpenAI routes are relayed; one usage reading (the adapters'), none from meta_info."""
    s = SSEScanner()
    s.feed(b'data: {"text":"a","meta_info":{"prompt_tokens":5,"completion_tokens":1}}\n\n', 0.0)
    assert s.usage is None
    for engine in ("vllm", "sglang"):
        a = adapter_for(engine)
        assert a.usage({"meta_info": {"prompt_tokens": 5}}) is None
        assert a.usage({"usage": {"prompt_tokens": 5, "completion_tokens": 1}}) == {"prompt_tokens": 5,
                                                                                  "completion_tokens": 1}


async def test_a_stream_is_piped_from_its_first_chunk(sims, gateway, monkeypatch):
    """The SSE headers go out in ``prepare``; from then on every chunk, the first one included,
    is written from the engine connection's read callback: the relay never waits in ``readany``
    for a stream that keeps up, and the first-chunk watchdog still sees its chunk come."""
    from gateway.upstream.h1client import UpstreamResponse

    reads = []
    readany = UpstreamResponse.readany

    async def counting_readany(self):
        data = await readany(self)
        if data:                    # b"" at the end is how a pipe learns the answer ended
            reads.append(data)
        return data

    monkeypatch.setattr(UpstreamResponse, "readany", counting_readany)
    sim = await sims("vllm", "m", ttft_base_ms=30.0, itl_ms=5.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       watchdog={"first_chunk_timeout_s": 5, "idle_timeout_s": 5})
    status, _, body = await post(gw.url, {"model": "m", "messages": CHAT, "max_tokens": 6, "stream": True})
    assert status == 200
    events = sse_events(body)
    assert events[-1] == "[DONE]" and len(events) >= 7
    assert reads == []
    text = await gw.metrics_text()
    assert "watchdog" not in "".join(line for line in text.splitlines()
                                     if line.startswith("switchyard_upstream_errors_total"))
