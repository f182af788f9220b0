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


async def test_an_objective_sent_on_two_lines_is_a_400_whichever_line_comes_first(sims, gateway):
    """An objective is one number, so two lines of its header are read whole, as RFC 9110 joins
    them (``100, soon``): not a number, the 400 a bad value gets, whichever line comes first and
    whether or not the lines agree (the first line was taken and the rest ignored: ``100`` then
    ``soon`` gave a 100 ms deadline, ``soon`` then ``100`` a 400)."""
    import aiohttp
    from multidict import CIMultiDict

    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    async with aiohttp.ClientSession() as s:
        for name in ("x-slo-ttft-ms", "x-slo-tpot-ms"):
            for first, second in (("100", "soon"), ("100", "200"), ("100", "100")):
                headers = CIMultiDict([(name, first), (name, second)])
                async with s.post(gw.url + "/v1/chat/completions", json=body(), headers=headers) as r:
                    answer = await r.json()
                    assert r.status == 400, (name, first, second, answer)
                    assert answer["error"]["param"] == name and answer["error"]["code"] == "invalid_slo"
