"""A request refused for a bad field after its body named a model the gateway serves is counted
under that model in ``switchyard_requests_total`` (an alias's under the model it stands for), on the
edge's fast lane and on aiohttp's path alike; its log line names the model the body named. A
model the gateway does not serve stays under ``-``."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from gateway.observability.logs import LineWriter
from tests.integration.pipeline.test_whole import _answer
from tests.integration.server.test_lane import _lane, _req
from tests.support.factories import model_block
from tests.support.gateway_process import metric_total
from tests.support.waiting import wait_for

CHAT = [{"role": "user", "content": "Count me right."}]


def _refused(page: str, model: str) -> float:
    return metric_total(page, "switchyard_requests_total", model=model, status="400")


async def test_a_served_models_bad_field_counts_under_the_model_on_both_paths(sims, gateway, tmp_path):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], server={"log_format": "json"},
                       aliases=[{"name": "chat", "targets": [{"model": "m"}]}])
    out = tmp_path / "lines"
    f = out.open("wb")
    gw.gw.request_log.writer = LineWriter(fd=f.fileno(), interval_s=0.01)
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    cases = [   # (x-request-id, the body's model, framing: the lane takes a length, aiohttp a chunked body)
        ("lane-m", "m", "length"), ("aio-m", "m", "chunked"),
        ("lane-alias", "chat", "length"), ("aio-alias", "chat", "chunked"),
        ("lane-nope", "nope", "length"), ("aio-nope", "nope", "chunked"),
    ]
    try:
        before = _lane(gw)
        for rid, model, framing in cases:
            writer.write(_req({"model": model, "messages": CHAT, "max_tokens": -1}, rid=rid, framing=framing))
            status, _headers, body = await _answer(reader)
            assert status == "HTTP/1.1 400 Bad Request", (rid, status, body)
            assert orjson.loads(body)["error"]["param"] == "max_tokens"
        assert _lane(gw) - before == 3         # each kind once on the lane, once on aiohttp's path
    finally:
        writer.close()
    page = await gw.metrics_text()
    assert _refused(page, "m") == 4, page                  # the model's two and its alias's two
    assert _refused(page, "-") == 2                        # a name the gateway does not serve
    assert _refused(page, "chat") == 0                     # no series for the alias's own name

    async with aiohttp.ClientSession() as s, s.get(gw.url + "/status.json") as r:
        models = {m["name"]: m for m in (await r.json())["models"]}
    assert (models["m"]["minute"]["requests"], models["m"]["minute"]["errors"]) == (4, 4)   # the page says so too

    lines = await wait_for(lambda: [orjson.loads(x) for x in out.read_bytes().splitlines()]
                           if out.read_bytes().count(b"\n") >= len(cases) else None)
    f.close()
    named = {x["request_id"]: x["model"] for x in lines}
    assert named == {rid: model for rid, model, _ in cases}    # the line names what the body named


async def test_a_refused_adapters_request_counts_under_its_base_model(sims, gateway):
    """A LoRA adapter's request refused for a bad field, or on a path its SGLang engine's adapter
    field has no place in (a Messages request), counts under the base model; its record names the
    adapter the body named."""
    sim = await sims("sglang", "m")
    gw = await gateway([model_block("m", "sglang", [sim.url], adapters={"tone": "org/tone-lora"})])
    records = []
    gw.gw.observers.append(lambda rec, _d: records.append(rec))
    writes = [("/v1/chat/completions", {"model": "tone", "messages": CHAT, "max_tokens": -1}),
              ("/v1/messages", {"model": "tone", "messages": CHAT, "max_tokens": 2})]
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        for i, (path, body) in enumerate(writes):
            writer.write(_req(body, rid=f"adapter-{i}", path=path))
            status, _headers, answer = await _answer(reader)
            assert status == "HTTP/1.1 400 Bad Request", answer
    finally:
        writer.close()
    assert _refused(await gw.metrics_text(), "m") == 2
    assert [(r.model, r.status) for r in records] == [("tone", 400)] * 2
