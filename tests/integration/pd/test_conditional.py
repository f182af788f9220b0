"""Conditional disaggregation on loopback: always (the default), a short prompt run whole on the
vLLM decode, a follow-up turn whose history the decode holds, SGLang's combined fallback and its
no-local-path case, with the metric, the header and the engines' own counts as proof."""

from __future__ import annotations

import json

import aiohttp
import pytest

from tests.support.http import chat_body, openai_client, post, sim_state
from tests.support.waiting import until

SYSTEM = {"role": "system", "content": "You are a careful assistant for a gateway team. " * 40}   # ~2000 chars


def vllm_model(p, d, **pd):
    return {"name": "m", "engine": "vllm", "rolesets": [{"name": "rs", "prefill": [p.url], "decode": [d.url]}],
            **({"pd": pd} if pd else {})}


async def completed(url) -> int:
    return (await sim_state(url))["counts"]["completed"]


async def test_default_always_disaggregates_with_the_sdk(sims, gateway):
    p, d = await sims("vllm", "m", role="prefill"), await sims("vllm", "m", role="decode")
    gw = await gateway([vllm_model(p, d)])
    client = openai_client(gw)
    raw = await client.chat.completions.with_raw_response.create(model="m", messages=[SYSTEM], max_tokens=4)
    assert raw.headers["x-pd-decision"] == "disaggregated; reason=always"
    assert raw.headers["prefill-target-pod"] == p.url.split("//")[1]
    await client.close()
    assert await completed(p.url) == 1 and await completed(d.url) == 1
    assert 'switchyard_pd_decisions_total{mode="disaggregated",model="m",reason="always"} 1.0' in await gw.metrics_text()


async def test_short_prompt_runs_whole_on_the_vllm_decode(sims, gateway):
    p, d = await sims("vllm", "m", role="prefill"), await sims("vllm", "m", role="decode")
    gw = await gateway([vllm_model(p, d, disaggregate_min_prompt_tokens=1000)])
    status, headers, _ = await post(gw, chat_body([{"role": "user", "content": "hi"}]))
    assert status == 200 and headers["x-pd-decision"] == "decode; reason=short_prompt"
    assert "prefill-target-pod" not in headers and headers["target-pod"] == d.url.split("//")[1]
    assert await completed(p.url) == 0 and await completed(d.url) == 1
    assert (await sim_state(d.url))["pd"]["recomputed"] == 0     # no KV params: a local prefill, not a failed pull


async def test_a_request_run_whole_on_the_vllm_decode_computes_its_prompt_whatever_the_client_sent(sims, gateway):
    """Run whole on the decode means a local prefill (the decode is sent no kv_transfer_params),
    also when the client's body named params of its own: it does not get to point the decode at a
    host to pull KV from."""
    p, d = await sims("vllm", "m", role="prefill"), await sims("vllm", "m", role="decode")
    gw = await gateway([vllm_model(p, d, disaggregate_min_prompt_tokens=1000)])
    own = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e", "remote_block_ids": [1],
           "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "r"}
    for stream in (False, True):
        status, headers, raw = await post(gw, chat_body([{"role": "user", "content": "hi"}], stream=stream,
                                                        kv_transfer_params=own))
        assert status == 200 and headers["x-pd-decision"] == "decode; reason=short_prompt", raw[:300]
    sent = [r["body"] for r in (await sim_state(d.url))["received"] if r["method"] == "POST"]
    assert len(sent) == 2 and all("kv_transfer_params" not in b for b in sent), sent
    assert (await sim_state(d.url))["pd"]["kv_failures"] == 0 and await completed(p.url) == 0


def _tools(n: int) -> list[dict]:
    """``n`` function tools, each with a described schema (about 300 characters)."""
    return [{"type": "function", "function": {
        "name": f"lookup_route_{i}", "description": f"Look up route table {i} of the gateway fleet by prefix.",
        "parameters": {"type": "object", "properties": {
            "prefix": {"type": "string", "description": "an IPv4 prefix such as 10.0.0.0/8"},
            "region": {"type": "string", "enum": ["east", "west", "north", "south"]}},
            "required": ["prefix"]}}} for i in range(n)]


async def test_a_chats_tools_count_in_its_prompt(sims, gateway):
    """The engine renders a chat's tools into the prompt it prefills (vLLM hands them to the chat
    template): a short question offering a dozen tools is not a short prompt."""
    p, d = await sims("vllm", "m", role="prefill"), await sims("vllm", "m", role="decode")
    gw = await gateway([vllm_model(p, d, disaggregate_min_prompt_tokens=500)])
    ask = [{"role": "user", "content": "Which route serves 10.1.2.3?"}]
    client = openai_client(gw)
    raw = await client.chat.completions.with_raw_response.create(model="m", messages=ask, max_tokens=2, tools=_tools(12))
    assert raw.headers["x-pd-decision"] == "disaggregated; reason=uncached"
    raw = await client.chat.completions.with_raw_response.create(model="m", messages=ask, max_tokens=2, tools=_tools(1))
    assert raw.headers["x-pd-decision"] == "decode; reason=short_prompt"
    await client.close()


async def test_a_chats_earlier_tool_calls_count_in_its_prompt(sims, gateway):
    """An assistant turn's tool calls are rendered with their arguments: a call that wrote a long
    file makes a long prompt, whether the turn's content is null or an empty string."""
    p, d = await sims("vllm", "m", role="prefill"), await sims("vllm", "m", role="decode")
    gw = await gateway([vllm_model(p, d, disaggregate_min_prompt_tokens=200)])
    body = "route 10.0.0.0/8 via the east gateway, metric 20\n" * 40        # ~2,000 characters
    call = {"id": "call_1", "type": "function",
            "function": {"name": "write_file", "arguments": json.dumps({"path": "routes.txt", "content": body})}}
    client = openai_client(gw)
    for content in (None, ""):
        turn = [{"role": "user", "content": "Write the routing table."},
                {"role": "assistant", "content": content, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "written"}]
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=turn, max_tokens=2,
                                                                     tools=_tools(1))
        assert raw.headers["x-pd-decision"] == "disaggregated; reason=uncached", content
    await client.close()


async def test_follow_up_turn_runs_on_the_decode_that_holds_its_history(sims, gateway):
    p, d = await sims("vllm", "m", role="prefill"), await sims("vllm", "m", role="decode")
    gw = await gateway([vllm_model(p, d, disaggregate_min_uncached_tokens=200)])
    turn1 = [SYSTEM, {"role": "user", "content": "First question about routing?"}]
    status, headers, _ = await post(gw, chat_body(turn1))
    assert status == 200 and headers["x-pd-decision"] == "disaggregated; reason=uncached"
    turn2 = turn1 + [{"role": "assistant", "content": "An answer."}, {"role": "user", "content": "And then?"}]
    status, headers, _ = await post(gw, chat_body(turn2))
    assert status == 200 and headers["x-pd-decision"] == "decode; reason=cached_on_decode"
    assert await completed(p.url) == 1 and await completed(d.url) == 2
    text = await gw.metrics_text()
    assert 'switchyard_pd_decisions_total{mode="decode",model="m",reason="cached_on_decode"} 1.0' in text


@pytest.mark.parametrize("with_combined", [True, False])
async def test_sglang_runs_whole_on_a_combined_endpoint_or_disaggregates(sims, gateway, with_combined):
    p, d = await sims("sglang", "m", role="prefill"), await sims("sglang", "m", role="decode")
    rs = {"name": "rs", "prefill": [{"url": p.url, "bootstrap_port": p.bootstrap_port}], "decode": [d.url]}
    c = None
    if with_combined:
        c = await sims("sglang", "m")
        rs["combined"] = [c.url]
    gw = await gateway([{"name": "m", "engine": "sglang", "rolesets": [rs],
                         "pd": {"disaggregate_min_prompt_tokens": 1000, "combined_load_ratio": 0}}])
    status, headers, _ = await post(gw, chat_body([{"role": "user", "content": "hi"}]))
    assert status == 200
    if with_combined:
        assert headers["x-pd-decision"] == "combined; reason=short_prompt"
        assert headers["target-pod"] == c.url.split("//")[1] and await completed(c.url) == 1
        assert await completed(d.url) == 0
    else:   # SGLang's decode never prefills by itself
        assert headers["x-pd-decision"] == "disaggregated; reason=no_local_path"
        assert await completed(p.url) == 1 and await completed(d.url) == 1


async def test_requests_run_whole_spread_over_equally_loaded_combined_endpoints(sims, gateway):
    """Short prompts run whole on the model's combined endpoints (an SGLang decode computes no
    prompt itself): two of them equally loaded (idle between requests) are both picked, at random
    as the strategy's own ties are; the first listed took every one."""
    p, d = await sims("sglang", "m", role="prefill"), await sims("sglang", "m", role="decode")
    c1, c2 = await sims("sglang", "m"), await sims("sglang", "m")
    rs = {"name": "rs", "prefill": [{"url": p.url, "bootstrap_port": p.bootstrap_port}], "decode": [d.url],
          "combined": [c1.url, c2.url]}
    gw = await gateway([{"name": "m", "engine": "sglang", "rolesets": [rs],
                         "pd": {"disaggregate_min_prompt_tokens": 1000, "combined_load_ratio": 0}}])
    pods = set()
    async with aiohttp.ClientSession() as s:
        for i in range(24):             # all on one of the two at random: 2 in 2^24
            status, headers, _ = await post(gw, chat_body([{"role": "user", "content": f"hi {i}"}]), http=s)
            assert status == 200 and headers["x-pd-decision"] == "combined; reason=short_prompt"
            pods.add(headers["target-pod"])
    assert pods == {c1.url.split("//")[1], c2.url.split("//")[1]}


async def test_requests_pd_pairs_cannot_serve_spread_over_equally_loaded_combined_endpoints(sims, gateway):
    """A request the pairs cannot serve (SGLang's ``n`` > 1: a prompt's samples share one bootstrap
    room) runs whole on the combined endpoints as a short prompt does: equal ones at random, not all
    on the first listed."""
    p, d = await sims("sglang", "m", role="prefill"), await sims("sglang", "m", role="decode")
    c1, c2 = await sims("sglang", "m"), await sims("sglang", "m")
    rs = {"name": "rs", "prefill": [{"url": p.url, "bootstrap_port": p.bootstrap_port}], "decode": [d.url],
          "combined": [c1.url, c2.url]}
    gw = await gateway([{"name": "m", "engine": "sglang", "rolesets": [rs], "pd": {"combined_load_ratio": 0}}])
    pods = set()
    async with aiohttp.ClientSession() as s:
        for i in range(24):             # all on one of the two at random: 2 in 2^24
            status, headers, _ = await post(gw, chat_body([{"role": "user", "content": f"hi {i}"}], n=2), http=s)
            assert status == 200 and headers["x-pd-decision"] == "combined; reason=several_choices"
            pods.add(headers["target-pod"])
    assert pods == {c1.url.split("//")[1], c2.url.split("//")[1]}


async def test_on_kv_events_the_decode_reports_what_it_holds(sims, gateway):
    """With the decode publishing KV events, its uncached tokens are the prompt's tokens less what
    its engine reports holding: turn 1 is disaggregated (the decode has sent no event yet, so the
    approximate index decides), turn 2 runs whole on the decode, decided on its events."""
    from enginesim.tiny_tokenizer import TINY_DIR
    tok = str(TINY_DIR)
    p = await sims("vllm", "m", role="prefill", tokenizer=tok)
    d = await sims("vllm", "m", role="decode", tokenizer=tok, kv_events_port=0, kv_events_replay_port=0,
                   kv_blocks=4096)
    ev = d.engine.kv_events
    gw = await gateway([{"name": "m", "engine": "vllm", "tokenizer": tok,
                         "rolesets": [{"name": "rs", "prefill": [p.url], "decode": [
                             {"url": d.url, "kv_events": {"port": ev.port, "replay_port": ev.replay_port}}]}],
                         "pd": {"disaggregate_min_uncached_tokens": 200}}])
    seen: list[dict] = []
    gw.gw.observers.append(lambda rec, _duration: seen.append(dict(rec.extra)))
    turn1 = [SYSTEM, {"role": "user", "content": "First question about routing?"}]
    status, headers, _ = await post(gw, chat_body(turn1))
    assert status == 200 and headers["x-pd-decision"] == "disaggregated; reason=uncached"
    # the decode's engine reports the blocks the transfer filled
    async def stored() -> bool:
        return 'switchyard_kv_events_total{kind="BlockStored",model="m"}' in await gw.metrics_text()
    await until(stored, timeout=15)
    turn2 = turn1 + [{"role": "assistant", "content": "An answer."}, {"role": "user", "content": "And then?"}]
    status, headers, _ = await post(gw, chat_body(turn2))
    assert status == 200 and headers["x-pd-decision"] == "decode; reason=cached_on_decode"
    assert await completed(p.url) == 1 and await completed(d.url) == 2
    assert [(x["pd_mode"], x["decode_uncached_source"]) for x in seen] == [("disaggregated", "approximate"),
                                                                          ("decode", "events")]
    first, second = (x["decode_uncached_tokens"] for x in seen)
    assert first > 200 > second        # turn 1: nothing held; turn 2: only the new turn is missing


async def test_the_prefill_is_chosen_on_what_its_engine_reports_holding(sims, gateway):
    """With the prefills publishing KV events, the ``pd`` strategy's prefill choice follows what
    each engine reports caching: prompts warmed directly on one prefill's engine (the gateway's own
    index never saw them) are sent to that prefill, whichever it is."""
    from enginesim.tiny_tokenizer import TINY_DIR
    tok = str(TINY_DIR)
    pa = await sims("vllm", "m", role="prefill", tokenizer=tok, kv_events_port=0, kv_events_replay_port=0)
    pb = await sims("vllm", "m", role="prefill", tokenizer=tok, kv_events_port=0, kv_events_replay_port=0)
    d = await sims("vllm", "m", role="decode", tokenizer=tok)

    def entry(sim):
        ev = sim.engine.kv_events
        return {"url": sim.url, "kv_events": {"port": ev.port, "replay_port": ev.replay_port}}

    gw = await gateway([{"name": "m", "engine": "vllm", "tokenizer": tok,
                         "rolesets": [{"name": "rs", "prefill": [entry(pa), entry(pb)], "decode": [d.url]}]}])
    prompts = [[{"role": "system", "content": f"Conversation {i}: " + "the gateway keeps its routes warm. " * 40},
                {"role": "user", "content": "Which prefill holds this?"}] for i in range(6)]
    warm = [pa if i % 2 == 0 else pb for i in range(6)]
    stored = 'switchyard_kv_events_total{kind="BlockStored",model="m"}'

    def stored_count(text: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(stored))

    before = stored_count(await gw.metrics_text())
    for sim, messages in zip(warm, prompts, strict=True):     # straight to the engine, not through the gateway
        async with aiohttp.ClientSession() as s, s.post(sim.url + "/v1/chat/completions",
                                                        json={"model": "m", "messages": messages,
                                                              "max_tokens": 1}) as r:
            assert r.status == 200, await r.text()
    async def indexed() -> bool:    # every warm-up's blocks reported and indexed
        return stored_count(await gw.metrics_text()) >= before + 6
    await until(indexed, timeout=15)
    chosen = []
    for messages in prompts:
        status, headers, _ = await post(gw, chat_body(messages))
        assert status == 200
        chosen.append(headers["prefill-target-pod"])
    assert chosen == [sim.url.split("//")[1] for sim in warm]
