"""A vLLM completion's ``echo`` with ``logprobs`` through the gateway with the openai SDK: the
prompt's logprobs (the largest logprobs answers an engine writes) are relayed as the engine wrote
them, whole and streamed, and the request's log line counts the answer's tokens, its first token
and its finish even when the stream's first event, which carries the prompt's logprobs, is past
the size the relay scans."""

from __future__ import annotations

import aiohttp
import orjson

from gateway.pipeline import sse
from tests.support.factories import model_block
from tests.support.http import openai_client

PROMPT = " ".join(f"w{i % 97}" for i in range(3000))


async def test_echoed_prompt_logprobs_are_relayed_and_a_big_first_event_keeps_its_token_and_finish(
        sims, gateway, monkeypatch):
    # the first chunk holds 3000 prompt tokens' logprobs, about 600 KiB, which no read takes whole (256 KiB
    # at most): past the bound scanned
    monkeypatch.setattr(sse, "MAX_EVENT_BYTES", 8192)
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    client = openai_client(gw)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 10}
    async with aiohttp.ClientSession() as s, s.post(sim.url + "/v1/completions", json=body) as r:
        direct = orjson.loads(await r.read())["choices"][0]
    n = len(direct["prompt_logprobs"])
    assert len(direct["logprobs"]["tokens"]) == n + 2
    with gw.gw.request_log.capture() as logs:
        whole = await client.completions.create(**body)
        streamed: dict[str, list] = {k: [] for k in direct["logprobs"]}
        text = ""
        async for chunk in await client.completions.create(**body, stream=True):
            for c in chunk.choices:
                text += c.text
                for k, vals in c.logprobs.model_dump().items():
                    streamed[k] += vals
        alone = [c async for chunk in await client.completions.create(**{**body, "max_tokens": 0}, stream=True)
                 for c in chunk.choices]
    got = whole.choices[0].model_dump()
    assert got["logprobs"] == direct["logprobs"] and got["prompt_logprobs"] == direct["prompt_logprobs"]
    assert streamed == direct["logprobs"] and text == direct["text"]
    assert len(alone) == 1 and alone[0].text == PROMPT and alone[0].finish_reason == "length"
    lines = [e for e in logs if e["event"] == "request"]
    assert [(e["status"], e["prompt_tokens"], e["completion_tokens"], e["finish_reason"]) for e in lines] == [
        (200, n, 2, "length"), (200, n, 2, "length"), (200, n, 1, "length")]
    # the streams' first token came in their first event, past the scanned bound
    assert lines[1]["ttft_ms"] is not None and lines[2]["ttft_ms"] is not None
