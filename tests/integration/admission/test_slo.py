"""Latency objectives on loopback: the x-slo-* headers or the model's ``slo:`` defaults are the
request's objectives, a bad header is a 400 in its API's shape."""

from __future__ import annotations

from functools import partial

import orjson

from tests.support.factories import model_block
from tests.support.http import chat_body, post

CHAT = [{"role": "user", "content": "hello there"}]
body = partial(chat_body, CHAT)


async def test_headers_override_the_models_defaults(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url], slo={"ttft_ms": 500})])
    seen: list[dict] = []
    gw.gw.observers.append(lambda rec, _d: seen.append(dict(rec.extra)))
    assert (await post(gw.url, body()))[0] == 200
    assert (await post(gw.url, body(), {"x-slo-ttft-ms": "80", "x-slo-tpot-ms": "30"}))[0] == 200
    assert [(x.get("slo_ttft_ms"), x.get("slo_tpot_ms")) for x in seen] == [(500.0, None), (80.0, 30.0)]


async def test_a_bad_objective_is_a_400_in_the_apis_shape(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    status, _, raw = await post(gw.url, body(), {"x-slo-ttft-ms": "soon"})
    err = orjson.loads(raw)["error"]
    assert status == 400 and err["param"] == "x-slo-ttft-ms" and err["code"] == "invalid_slo"
    status, _, raw = await post(gw.url, {"model": "m", "max_tokens": 4, "messages": CHAT},
                                {"x-slo-tpot-ms": "-1"}, path="/v1/messages")
    data = orjson.loads(raw)
    assert status == 400 and data["type"] == "error" and "x-slo-tpot-ms" in data["error"]["message"]
