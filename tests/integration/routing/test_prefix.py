"""prefix-cache through the gateway: a conversation returns to its engine and leaves it when overloaded."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from enginesim.faults import parse_fault
from routers.session import encode_session_id
from tests.support.enginesim import restart_sim
from tests.support.factories import model_block
from tests.support.metrics import metric
from tests.support.routing import LONG_SYSTEM, chat
from tests.support.waiting import until

# -- through the gateway -------------------------------------------------------------------------



async def test_gateway_sends_a_conversation_back_to_its_engine_and_leaves_it_when_overloaded(sims, gateway):
    engines = [await sims("vllm", "m", prefill_ms_per_token=0.01) for _ in range(3)]
    gw = await gateway([model_block("m", "vllm", [e.url for e in engines], strategy="prefix-cache")],
                       routing={"prefix_imbalance_abs": 2})
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Where is train 7?"}]
    async with aiohttp.ClientSession() as s:
        holder, first = await chat(s, gw.url, messages)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for turn in range(3):
            messages += [{"role": "assistant", "content": "On track 3."},
                         {"role": "user", "content": f"And train {turn}?"}]
            pod, data = await chat(s, gw.url, messages)
            assert pod == holder                                     # back to the engine with the prefix
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 200   # and it was a cache hit

        # overload the holder: 3 requests stuck on it (pinned there with session-affinity)
        ep = next(e for e in gw.gw.pool.endpoints() if e.name == holder)
        pin = {"routing-strategy": "session-affinity", "x-session-id": encode_session_id(ep.address),
               "x-sim-fault": "stall_before_first=inf"}
        stuck = [asyncio.create_task(chat(s, gw.url, [{"role": "user", "content": f"block {i}"}], pin))
                 for i in range(3)]
        try:
            await until(lambda: ep.in_flight == 3, timeout=15)
            messages += [{"role": "user", "content": "One more?"}]
            pod, _ = await chat(s, gw.url, messages)
            assert pod != holder                                      # spread 3 > 2: least loaded instead
            assert ('switchyard_routing_fallbacks_total{reason="load_imbalance",strategy="prefix-cache"} 1.0'
                    in await gw.metrics_text())
        finally:
            for t in stuck:
                t.cancel()
            for t in stuck:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t


async def test_a_restarted_engine_is_no_longer_a_match_for_the_cache_it_lost(sims, gateway):
    """An engine that restarts loses its prefix cache. The gateway reads that from its scrapes
    (process_start_time_seconds moved), with no request to it in between: the next turn of a
    conversation it held is no match there, and what the gateway knew of it is dropped."""
    engines = [await sims("vllm", "m") for _ in range(2)]
    gw = await gateway([model_block("m", "vllm", [e.url for e in engines], strategy="prefix-cache")])
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Where is train 7?"}]
    restarted = None
    async with aiohttp.ClientSession() as s:
        holder, _ = await chat(s, gw.url, messages)
        for turn in range(2):
            messages += [{"role": "assistant", "content": "On track 3."},
                         {"role": "user", "content": f"And train {turn}?"}]
            pod, data = await chat(s, gw.url, messages)
            assert pod == holder and data["usage"]["prompt_tokens_details"]["cached_tokens"] > 200
        sim = next(e for e in engines if holder.endswith(f":{e.port}"))
        ep = next(e for e in gw.gw.pool.endpoints() if e.name == holder)
        await until(lambda: ep.metrics is not None and ep.metrics.start_time == sim.engine.started_at)
        index = gw.gw.routing.ctx.prefix_index
        assert index.stats()["entries"] > 0
        try:
            restarted = await restart_sim(sim)
            # scraped after the restart; nothing was sent to the engine meanwhile
            await until(lambda: ep.metrics.start_time == restarted.engine.started_at)
            assert restarted.engine.counts.started == 0
            assert index.stats()["entries"] == 0          # the other engine was never sent the prompt
            text = await gw.metrics_text()
            assert metric(text, "switchyard_engine_restarts_total", model="m", endpoint=holder) == 1
            misses = metric(text, "switchyard_routing_fallbacks_total", strategy="prefix-cache", reason="no_match")
            messages += [{"role": "assistant", "content": "On track 3."}, {"role": "user", "content": "And now?"}]
            await chat(s, gw.url, messages)
            text = await gw.metrics_text()
            # routed as a prompt no engine holds, not to the restarted engine for its cache
            assert metric(text, "switchyard_routing_fallbacks_total", strategy="prefix-cache",
                          reason="no_match") == misses + 1
            assert metric(text, "switchyard_engine_restarts_total", model="m", endpoint=holder) == 1
        finally:
            if restarted is not None:
                await restarted.close()


async def test_metadata_user_id_names_a_session_on_messages_only(sims, gateway):
    """``metadata.user_id`` is the Anthropic clients' name for the conversation's user (Claude Code's
    session): it names a session on Messages. On chat and Responses ``metadata`` is the caller's own
    tags, so a tag called user_id pins nothing: those turns are neither kept nor counted."""
    e, f = await sims("vllm", "m"), await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [e.url, f.url], strategy="prefix-cache")])
    tags = {"user_id": "alice"}
    async with aiohttp.ClientSession() as s:
        for turn in range(2):
            for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": f"hi {turn}"}],
                                                         "max_tokens": 1}),
                               ("/v1/responses", {"input": f"hi {turn}", "max_output_tokens": 1})):
                async with s.post(gw.url + path, json={"model": "m", "metadata": tags, **body}) as r:
                    assert r.status == 200, await r.text()
        assert metric(await gw.metrics_text(), "switchyard_routing_session_total") == 0
        for turn in range(3):
            async with s.post(gw.url + "/v1/messages", json={"model": "m", "max_tokens": 1, "metadata": tags,
                                                            "messages": [{"role": "user", "content": f"hi {turn}"}]}) as r:
                assert r.status == 200, await r.text()
    assert metric(await gw.metrics_text(), "switchyard_routing_session_total", model="m", outcome="kept") == 2


async def test_a_cache_salt_keys_its_prompts_apart_on_the_approximate_index(sims, gateway):
    """vLLM caches a salted prompt apart from the same prompt under another salt or none (its
    cache_salt is folded into the first block's hash), so a prompt sent under one salt is no
    match for another: that request is counted no_match and routed on load, where it was taken
    for a full match on an engine holding nothing of it."""
    engines = [await sims("vllm", "m") for _ in range(2)]
    gw = await gateway([model_block("m", "vllm", [e.url for e in engines], strategy="prefix-cache")])
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Where is train 7?"}]

    async def no_match() -> float:
        return metric(await gw.metrics_text(), "switchyard_routing_fallbacks_total",
                      strategy="prefix-cache", reason="no_match")
    async with aiohttp.ClientSession() as s:
        holder, _ = await chat(s, gw.url, messages, cache_salt="tenant-a")
        assert await no_match() == 1
        pod, data = await chat(s, gw.url, messages, cache_salt="tenant-a")    # the same salt: a match
        assert pod == holder and data["usage"]["prompt_tokens_details"]["cached_tokens"] > 200
        assert await no_match() == 1
        for other in ({"cache_salt": "tenant-b"}, {}):                       # another salt, or none
            _, data = await chat(s, gw.url, messages, **other)
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert await no_match() == 3


async def test_a_retry_off_a_sessions_engine_counts_the_session_once_and_moves_it(sims, gateway):
    """A session's turn kept on its engine, which fails it (a 500, retried elsewhere): the
    request's session is counted once, kept, not again as gone at the retry's decision (the
    engine is up and ready, only left out of this request's retry), and the session moves
    with the turn to the engine that answered it."""
    e, f = await sims("vllm", "m"), await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [e.url, f.url], strategy="prefix-cache")])
    key = {"x-session-key": "agent-7"}

    async def outcomes() -> tuple[float, ...]:
        text = await gw.metrics_text()
        return tuple(metric(text, "switchyard_routing_session_total", model="m", outcome=o)
                     for o in ("kept", "overloaded", "gone"))
    async with aiohttp.ClientSession() as s:
        holder, _ = await chat(s, gw.url, [{"role": "user", "content": "hi 0"}], key)
        sim = e if holder.endswith(f":{e.port}") else f
        sim.engine.default_fault = parse_fault("status=500")
        try:
            moved, _ = await chat(s, gw.url, [{"role": "user", "content": "hi 1"}], key)
        finally:
            sim.engine.default_fault = parse_fault("")
        assert moved != holder
        assert await outcomes() == (1, 0, 0)
        pod, _ = await chat(s, gw.url, [{"role": "user", "content": "hi 2"}], key)
        assert pod == moved
        assert await outcomes() == (2, 0, 0)


async def test_a_responses_follow_up_bound_to_its_engine_is_not_counted_gone_for_its_session_header(sims, gateway):
    """Engine-held Responses state: a follow-up goes to the engine holding its previous response,
    whatever its x-session-key says. When the key's last turn went to the other engine (up, ready),
    the follow-up is not counted gone (that engine is there), and the key moves with the turn."""
    engines = [await sims("vllm", "m", enable_responses_store=True) for _ in range(2)]
    gw = await gateway([model_block("m", "vllm", [e.url for e in engines], strategy="prefix-cache")])
    key = {"x-session-key": "agent-9"}
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/responses", json={"model": "m", "input": "one", "max_output_tokens": 2}) as r:
            assert r.status == 200, await r.text()
            owner, first = r.headers["target-pod"], await r.json()
        ep = next(e for e in gw.gw.pool.endpoints() if e.name == owner)
        pin = {"routing-strategy": "session-affinity", "x-session-id": encode_session_id(ep.address),
               "x-sim-fault": "stall_before_first=inf"}
        stuck = asyncio.create_task(chat(s, gw.url, [{"role": "user", "content": "block"}], pin))
        try:
            await until(lambda: ep.in_flight == 1, timeout=15)
            other, _ = await chat(s, gw.url, [{"role": "user", "content": "hi"}], key)   # the least loaded
        finally:
            stuck.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await stuck
        assert other != owner
        await until(lambda: ep.in_flight == 0, timeout=15)
        async with s.post(gw.url + "/v1/responses", headers=key, json={
                "model": "m", "input": "two", "previous_response_id": first["id"], "max_output_tokens": 2}) as r:
            assert r.status == 200, await r.text()
            assert r.headers["target-pod"] == owner
        assert metric(await gw.metrics_text(), "switchyard_routing_session_total", outcome="gone") == 0
        pod, _ = await chat(s, gw.url, [{"role": "user", "content": "hi again"}], key)
        assert pod == owner                      # the key went with the follow-up
