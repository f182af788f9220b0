"""Requests SGLang serves in its own way, through the gateway with the openai SDK: a completion's
batch of prompts (one choice per prompt and per ``n``, indexed as vLLM does) and a chat's
``max_tokens`` of 0 (prefill only: no token, ``finish_reason: "length"``). The client gets the
engine's answer, and the log line and the metrics count what the engine reports."""

from __future__ import annotations

import aiohttp

from tests.support.factories import model_block
from tests.support.http import openai_client
from tests.support.metrics import metric

PROMPTS = ["Once upon a time", "The quick brown fox jumps over"]
MSGS = [{"role": "user", "content": "Tell me about trains."}]


async def _prompt_tokens(url: str, prompt: str) -> int:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions",
                                                    json={"prompt": prompt, "max_tokens": 1}) as r:
        return (await r.json())["usage"]["prompt_tokens"]


async def test_a_batch_of_prompts_and_a_prefill_only_chat(sims, gateway):
    sim = await sims("sglang", "m")
    gw = await gateway([model_block("m", "sglang", [sim.url])])
    client = openai_client(gw)
    n = sum([await _prompt_tokens(sim.url, p) for p in PROMPTS])
    with gw.gw.request_log.capture() as logs:
        whole = await client.completions.create(model="m", prompt=PROMPTS, max_tokens=3, n=2, echo=True)
        texts: dict[int, str] = {}
        usage = None
        async for chunk in await client.completions.create(model="m", prompt=PROMPTS, max_tokens=3, n=2,
                                                           echo=True, stream=True):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
            usage = chunk.usage or usage
        prefill_only = await client.chat.completions.create(model="m", messages=MSGS, max_tokens=0)
        chunks = [c async for c in await client.chat.completions.create(
            model="m", messages=MSGS, max_tokens=0, stream=True, stream_options={"include_usage": True})]
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert [c.text.startswith(PROMPTS[c.index // 2]) for c in whole.choices] == [True] * 4
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (n, 12)
    assert texts == {c.index: c.text for c in whole.choices}    # same seed, same answers, by index
    assert usage is None        # not asked: the usage the gateway asked for is not passed on
    choice = prefill_only.choices[0]
    assert choice.message.content == "" and choice.finish_reason == "length"
    assert prefill_only.usage.completion_tokens == 0 and prefill_only.usage.prompt_tokens > 0
    assert [c.finish_reason for ch in chunks for c in ch.choices] == [None, "length"]
    assert chunks[-1].usage.completion_tokens == 0
    lines = [e for e in logs if e["event"] == "request"]
    p = prefill_only.usage.prompt_tokens
    assert [(e["status"], e["prompt_tokens"], e["completion_tokens"], e["finish_reason"]) for e in lines] == [
        (200, n, 12, "length"), (200, n, 12, "length"), (200, p, 0, "length"), (200, p, 0, "length")]
    assert lines[0]["finish_reasons"] == lines[1]["finish_reasons"] == ["length"] * 4
    assert lines[3]["ttft_ms"] is None          # no token came
    text = await gw.metrics_text()
    assert metric(text, "switchyard_prompt_tokens_total", model="m") == 2 * n + 2 * p
    assert metric(text, "switchyard_completion_tokens_total", model="m") == 24
