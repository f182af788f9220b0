"""The event index under eviction, on loopback: an engine evicts a conversation's blocks
(``BlockRemoved``), and the gateway's next turn of it is judged on what the engine then holds, as
the engine's own ``cached_tokens`` tells."""

from __future__ import annotations

import asyncio

import openai
import orjson
import pytest

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.request import CHAT, parse
from tests.support.http import openai_client
from tests.support.waiting import until

pytestmark = pytest.mark.integration

TOK = str(TINY_DIR)
SYSTEM = "You are a careful assistant. " + " ".join(f"rule {i} is kqz lo abc" for i in range(40))


def _filler(i: int) -> str:
    return f"unrelated document {i}: " + " ".join(f"w{i}x{j} qv" for j in range(260))


@pytest.mark.parametrize(("unreached", "how"), [(False, "evicted"), (True, "evicted"), (True, "cleared")])
async def test_blocks_the_engine_reported_stored_then_evicted_no_longer_draw_the_next_turn(sims, gateway, unreached,
                                                                                             how):
    """Turn 1 of a conversation goes to engine H, whose new blocks the gateway holds speculatively
    (for ``speculative_ttl_s``, or until events confirm them); H reports them stored, then evicts
    them all under other gateways' traffic. The other engine O holds the system prompt. Turn 2 goes
    to O, where its system prompt is cached, and the gateway's match on H is what H reports cached:
    nothing. Before, the speculative hold outlived the engine's own report: H kept a match on the
    blocks turn 1 was keyed to (its probe's, or with ``tokenize_unreached`` the whole prompt, which
    drew turn 2 back to H for a cache it had evicted). A cache reset (``AllBlocksCleared``) alike."""
    engines = [await sims("vllm", model="m", tokenizer=TOK, kv_events_port=0, kv_events_replay_port=0,
                          kv_blocks=256) for _ in range(2)]
    gw = await gateway([{"name": "m", "engine": "vllm", "tokenizer": TOK, "strategy": "prefix-cache",
                         "endpoints": [{"url": e.url, "kv_events": {"port": e.engine.kv_events.port,
                                                                   "replay_port": e.engine.kv_events.replay_port}}
                                       for e in engines],
                         "kv_events": {"enabled": True, "stall_timeout_s": 30.0, "speculative_ttl_s": 600.0,
                                       "tokenize_unreached": unreached}}])
    kv = gw.gw.routing.ctx.precise_index
    await until(lambda: len(kv.subscribers) == 2)
    await until(lambda: all(e.engine.kv_events.subscriptions >= 1 for e in engines))
    state = {st.ep.url: st for st in kv.index.states.values()}
    by_pod = {state[e.url].ep.address: e for e in engines}
    client = openai_client(gw, "x")
    direct = {e.url: openai.AsyncOpenAI(base_url=e.url + "/v1", api_key="x", max_retries=0) for e in engines}
    try:
        for i, e in enumerate(engines):          # each engine has published: both live on events
            await direct[e.url].chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"warm up {i}"}], max_tokens=2)
        await until(lambda: all(st.on_fallback is None and st.emap for st in state.values()))
        turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "what is rule 7?"}]
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=turn1, max_tokens=2)
        h = by_pod[raw.headers["target-pod"]]
        o = next(e for e in engines if e is not h)
        answer = raw.parse().choices[0].message.content
        await until(lambda: len(state[h.url].emap) == h.engine.pool.cached_blocks > 0)
        if how == "evicted":      # other gateways' traffic straight to H evicts every block of the conversation
            for i in range(4):
                await direct[h.url].chat.completions.create(
                    model="m", messages=[{"role": "user", "content": _filler(i)}], max_tokens=2)
        else:                     # H's cache is reset (vLLM's /reset_prefix_cache)
            assert h.engine.pool.flush()
        # and O holds the system prompt
        await direct[o.url].chat.completions.create(
            model="m", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}],
            max_tokens=2)
        for e in engines:
            await until(lambda e=e: len(state[e.url].emap) == e.engine.pool.cached_blocks)
        turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and rule 8?"}]
        body = orjson.dumps({"model": "m", "messages": turn2, "max_tokens": 2})
        depths, _, fallback = kv.match(parse(CHAT, body, {}, "t"), [state[h.url].ep, state[o.url].ep])
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=turn2, max_tokens=2)
        assert by_pod[raw.headers["target-pod"]] is o
        assert raw.parse().usage.prompt_tokens_details.cached_tokens == depths[state[o.url].ep] > 0
        on_h = await direct[h.url].chat.completions.create(model="m", messages=turn2, max_tokens=2)
        assert not fallback
        assert depths[state[h.url].ep] == on_h.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        await client.close()
        for c in direct.values():
            await c.close()


@pytest.mark.timeout(120)
async def test_two_workers_both_follow_the_engines_evictions(sims, tmp_path):
    """``--workers 2``, each turn on a new connection (the kernel picks the worker): every turn after
    the first finds its conversation cached where it lands, whichever worker routed the turns before;
    once the holder evicted the conversations, every worker sends their next turns where the system
    prompt is still cached, none back to the engine that holds nothing of them."""
    from tests.support.gateway_process import gateway_process, metric_total, per_worker

    engines = [await sims("vllm", model="m", tokenizer=TOK, kv_events_port=0, kv_events_replay_port=0,
                          kv_blocks=256) for _ in range(2)]
    port, path = _events_gateway(tmp_path, engines, "", "stall_timeout_s: 30.0, speculative_ttl_s: 600.0")
    direct = {e.url: openai.AsyncOpenAI(base_url=e.url + "/v1", api_key="x", max_retries=0) for e in engines}
    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                                    default_headers={"Connection": "close"})
        try:
            await until(lambda: all(e.engine.kv_events.subscriptions >= 2 for e in engines), timeout=20)
            for i, e in enumerate(engines):      # each engine has published: live on events in both workers
                await direct[e.url].chat.completions.create(
                    model="m", messages=[{"role": "user", "content": f"warm up {i}"}], max_tokens=2)
            convs = [[{"role": "system", "content": f"conversation {c}. {SYSTEM}"}] for c in range(3)]
            where: dict[int, str] = {}
            for turn in range(3):
                for c, messages in enumerate(convs):
                    messages.append({"role": "user", "content": f"turn {turn}: what is rule {c + turn}?"})
                    raw = await client.chat.completions.with_raw_response.create(
                        model="m", messages=messages, max_tokens=2)
                    r = raw.parse()
                    messages.append({"role": "assistant", "content": r.choices[0].message.content})
                    if turn:
                        assert raw.headers["target-pod"] == where[c]
                        assert r.usage.prompt_tokens_details.cached_tokens > 0
                    where[c] = raw.headers["target-pod"]
            pod = {e.url.rpartition("/")[2]: e for e in engines}
            removed = [0]

            def counting(publish):
                def count(hashes):
                    removed[0] += 1
                    publish(hashes)
                return count

            for e in engines:                                    # other gateways' traffic evicts them all
                e.engine.kv_events.removed = counting(e.engine.kv_events.removed)
                for i in range(6):
                    await direct[e.url].chat.completions.create(
                        model="m", messages=[{"role": "user", "content": _filler(i)}], max_tokens=2)
            for c in range(3):                                   # and the other engine holds the system prompt
                other = next(e for e in engines if e is not pod[where[c]])
                await direct[other.url].chat.completions.create(model="m", max_tokens=2, messages=[
                    convs[c][0], {"role": "user", "content": "hello"}])
            # both workers have applied every BlockRemoved published (each worker subscribes on its own)
            async with asyncio.timeout(20):
                while not all(metric_total(p, "switchyard_kv_events_total", kind="BlockRemoved") >= removed[0]
                              for p in (await per_worker(port, 2)).values()):
                    await asyncio.sleep(0.05)
            for c, messages in enumerate(convs):
                messages.append({"role": "user", "content": "one more question"})
                for _ in range(2):                               # twice: the kernel may give either worker
                    raw = await client.chat.completions.with_raw_response.create(
                        model="m", messages=messages, max_tokens=2)
                    assert raw.headers["target-pod"] != where[c], c
                    assert raw.parse().usage.prompt_tokens_details.cached_tokens > 0
        finally:
            await client.close()
            for d in direct.values():
                await d.close()
        pages = await per_worker(port, 2)
    assert all(metric_total(p, "switchyard_kv_events_fallbacks_total") == 0 for p in pages.values())


@pytest.mark.timeout(120)
async def test_two_workers_forget_a_restarted_engine_and_take_up_its_new_events(sims, tmp_path):
    """``--workers 2``: engine H, holding a conversation, restarts (its cache empty, its sequence
    from 0). Once the workers have read its new start, the conversation's next turn goes, whichever
    worker takes it, where its system prompt is cached; and what the new engine caches (a prompt
    other gateways sent it) draws that prompt's next request to it from either worker."""
    from tests.support.enginesim import restart_sim
    from tests.support.gateway_process import gateway_process, metric_total, per_worker

    engines = [await sims("vllm", model="m", tokenizer=TOK, kv_events_port=0, kv_events_replay_port=0,
                          kv_blocks=4096) for _ in range(2)]
    port, path = _events_gateway(tmp_path, engines, "scrape: {interval_s: 0.5}\n", "stall_timeout_s: 30.0")
    restarted = None
    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                                    default_headers={"Connection": "close"})

        async def ask(messages):
            raw = await client.chat.completions.with_raw_response.create(model="m", messages=messages, max_tokens=2)
            return raw.headers["target-pod"], raw.parse()

        try:
            await until(lambda: all(e.engine.kv_events.subscriptions >= 2 for e in engines), timeout=20)
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "what is rule 3?"}]
            h_pod, r = await ask(messages)
            h = next(e for e in engines if e.url.endswith(h_pod))
            o = next(e for e in engines if e is not h)
            for turn in range(2):
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": f"and rule {turn}?"}]
                pod, r = await ask(messages)
                assert pod == h_pod and r.usage.prompt_tokens_details.cached_tokens > 0
            direct_o = openai.AsyncOpenAI(base_url=o.url + "/v1", api_key="x", max_retries=0)
            await direct_o.chat.completions.create(model="m", max_tokens=2, messages=[
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}])
            await direct_o.close()
            restarted = await restart_sim(h)
            async with asyncio.timeout(20):          # both workers read the new start
                while not all(metric_total(p, "switchyard_engine_restarts_total") == 1
                              for p in (await per_worker(port, 2)).values()):
                    await asyncio.sleep(0.05)
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": "and now?"}]
            for _ in range(2):
                pod, r = await ask(messages)
                assert pod != h_pod and r.usage.prompt_tokens_details.cached_tokens > 0
            # the new engine's events are taken up by both workers
            await until(lambda: restarted.engine.kv_events.subscriptions >= 2, timeout=20)
            fresh = [{"role": "system", "content": "a new life. " + SYSTEM}, {"role": "user", "content": "hi"}]
            direct_h = openai.AsyncOpenAI(base_url=restarted.url + "/v1", api_key="x", max_retries=0)
            await direct_h.chat.completions.create(model="m", max_tokens=2, messages=fresh)
            await direct_h.close()
            async with asyncio.timeout(20):          # both workers indexed what it stored
                while not all(metric_total(p, "switchyard_kv_events_total", kind="BlockStored") >= 1 and
                              metric_total(p, "switchyard_kv_events_index_blocks") >=
                              o.engine.pool.cached_blocks + restarted.engine.pool.cached_blocks
                              for p in (await per_worker(port, 2)).values()):
                    await asyncio.sleep(0.05)
            for i in range(2):
                pod, r = await ask(fresh[:1] + [{"role": "user", "content": f"question {i}"}])
                assert pod == h_pod and r.usage.prompt_tokens_details.cached_tokens > 0
        finally:
            await client.close()
            if restarted is not None:
                await restarted.close()


def _events_gateway(tmp_path, engines, extra: str, kv_events: str) -> tuple:
    """A free port and the config of a gateway process on it routing model ``m`` with prefix-cache
    on ``engines``' KV events (``extra``: more top-level lines; ``kv_events``: the model's keys)."""
    from tests.support.ports import listen_port

    port = listen_port()
    path = tmp_path / "gw.yaml"
    eps = ", ".join(f"{{url: '{e.url}', kv_events: {{port: {e.engine.kv_events.port}, "
                    f"replay_port: {e.engine.kv_events.replay_port}}}}}" for e in engines)
    path.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        "server: {drain_delay_s: 0, shutdown_grace_s: 5, log_level: warning}\n"
        "health: {interval_s: 0.5}\n" + extra +
        f"models: [{{name: m, engine: vllm, strategy: prefix-cache, tokenizer: '{TOK}', endpoints: [{eps}],\n"
        f"  kv_events: {{enabled: true, {kv_events}}}}}]\n")
    return port, path
