"""Precise prefix routing on KV events, on loopback: enginesim publishes vLLM's wire format, the
gateway subscribes, tokenizes with the same tokenizer directory and routes on what engines hold."""

from __future__ import annotations

import asyncio

import openai
import orjson
import pytest

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.kv import events as kv_events
from gateway.request import CHAT, parse
from tests.support.enginesim import restart_sim
from tests.support.http import openai_client, post
from tests.support.metrics import metric, series
from tests.support.waiting import until

pytestmark = pytest.mark.integration

TOK = str(TINY_DIR)
SYSTEM = "You are a careful assistant. " + " ".join(f"rule {i} is kqz lo abc" for i in range(120))


async def _sims(sims, n: int, **kw):
    return [await sims("vllm", model="m", tokenizer=TOK, kv_events_port=0, kv_events_replay_port=0,
                       kv_blocks=4096, **kw) for _ in range(n)]


async def _gateway(gateway, sim, replay=True, **kv):
    s = sim.engine.kv_events
    block = {"enabled": True, "port": s.port, "stall_timeout_s": 5.0, **kv}
    if replay:
        block["replay_port"] = s.replay_port
    return await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url], "tokenizer": TOK,
                           "strategy": "prefix-cache", "kv_events": block}])


@pytest.fixture
async def clients():
    made = []

    def make(gw):
        made.append(openai_client(gw, "x"))
        return made[-1]

    yield make
    for c in made:
        await c.close()


def _state(gw):
    kv = gw.gw.routing.ctx.precise_index
    return kv, next(iter(kv.index.states.values()))


def _render(gw) -> str:
    return gw.gw.metrics.render().decode()


async def _chat(client, text: str):
    return await client.chat.completions.create(
        model="m", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        max_tokens=2)


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_events_fill_the_index_and_match_the_engine(sims, gateway, clients, encoding):
    (sim,) = await _sims(sims, 1, kv_events_encoding=encoding)
    gw = await _gateway(gateway, sim)
    kv, st = _state(gw)
    client = clients(gw)
    await until(lambda: sim.engine.kv_events is not None and kv.subscribers)
    await until(lambda: sim.engine.kv_events.subscriptions >= 1)   # subscribed (a slow joiner misses what came before)
    r = await _chat(client, "first question")
    # the catch-up asked at the connection may bring a request's first batch apart from the next
    await until(lambda: 0 < len(st.emap) == sim.engine.pool.cached_blocks)
    # the gateway tokenizes like the engine: its match for the same conversation is what the engine caches
    r2 = await _chat(client, "second question")
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    # the gateway's match for a third turn is what the engine then finds in its cache
    await until(lambda: len(st.emap) == sim.engine.pool.cached_blocks)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "second question"}]
    ireq = parse(CHAT, orjson.dumps({"model": "m", "messages": messages, "max_tokens": 2}), {}, "t")
    depths, tokens, fallback = kv.match(ireq, [st.ep])
    assert not fallback and tokens == r2.usage.prompt_tokens
    r3 = await client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert depths[st.ep] == r3.usage.prompt_tokens_details.cached_tokens > r.usage.prompt_tokens // 2
    text = await gw.metrics_text()
    assert 'switchyard_kv_events_index_blocks{model="m"}' in text
    assert 'switchyard_kv_events_total{kind="BlockStored",model="m"}' in text


async def test_gap_is_replayed(sims, gateway, clients):
    (sim,) = await _sims(sims, 1)
    gw = await _gateway(gateway, sim)
    kv, st = _state(gw)
    client = clients(gw)
    await until(lambda: sim.engine.kv_events.subscriptions >= 1)     # the SUB socket connected
    await _chat(client, "one")
    await until(lambda: len(st.emap) > 0)
    pub = sim.engine.kv_events
    pub.drop_next = 1                  # the next batch is buffered for replay but never published
    await _chat(client, "two " * 60)
    await _chat(client, "three")
    await until(lambda: len(st.emap) == sim.engine.pool.cached_blocks)
    assert 'result="ok"' in await gw.metrics_text()


async def test_gap_without_replay_clears(sims, gateway, clients):
    (sim,) = await _sims(sims, 1)
    gw = await _gateway(gateway, sim, replay=False)
    kv, st = _state(gw)
    client = clients(gw)
    await until(lambda: sim.engine.kv_events.subscriptions >= 1)     # the SUB socket connected
    await _chat(client, "one")
    await until(lambda: len(st.emap) > 0)
    sim.engine.kv_events.drop_next = 1
    await _chat(client, "two " * 60)
    await _chat(client, "three " * 60)
    # what was missed is unknown: the entries are cleared, and blocks chained on them are orphans
    await until(lambda: 'result="no_replay_port"' in _render(gw))
    await until(lambda: len(st.emap) == 0)
    assert 'kind="orphan"' in _render(gw)
    # a prompt on a new prefix is indexed again
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "fresh " * 80}],
                                         max_tokens=2)
    await until(lambda: len(st.emap) > 0)


async def test_restarted_engine_clears_its_entries(sims, gateway, clients):
    (sim,) = await _sims(sims, 1)
    gw = await _gateway(gateway, sim)
    kv, st = _state(gw)
    client = clients(gw)
    await until(lambda: sim.engine.kv_events.subscriptions >= 1)     # the SUB socket connected
    for q in ("one", "two"):
        await _chat(client, q)
    await until(lambda: len(st.emap) > 0)
    before = len(st.emap)
    pub = sim.engine.kv_events
    # the engine restarts: an empty cache, and its publisher counts from 0 again
    pub.seq = 0
    pub.buffer.clear()
    sim.engine.pool.events = None
    assert sim.engine.pool.flush()
    sim.engine.pool.events = pub
    await _chat(client, "a new life")
    await until(lambda: len(st.emap) == sim.engine.pool.cached_blocks)
    assert len(st.emap) < before + 5
    assert "switchyard_kv_events_restarts_total" in await gw.metrics_text()


async def test_restarted_engine_that_publishes_nothing_is_cleared_from_its_scrapes(sims, gateway, clients):
    """A restarted engine sent no request publishes no event, so its sequence never goes back: the
    scrape that reads its new process_start_time_seconds clears its entries, or the catch-up at the
    SUB socket's reconnect does first (the new engine's replay does not hold the last batch heard),
    and its stream is taken up again as at first contact (not a second restart)."""
    (sim,) = await _sims(sims, 1)
    gw = await _gateway(gateway, sim)
    kv, st = _state(gw)
    client = clients(gw)
    await until(lambda: sim.engine.kv_events.subscriptions >= 1)     # the SUB socket connected
    for q in ("one", "two"):
        await _chat(client, q)
    await until(lambda: len(st.emap) == sim.engine.pool.cached_blocks > 0)
    await until(lambda: st.ep.metrics is not None and st.ep.metrics.start_time == sim.engine.started_at)
    restarted = await restart_sim(sim)
    try:
        await until(lambda: st.ep.metrics.start_time == restarted.engine.started_at)
        assert len(st.emap) == 0
        assert restarted.engine.kv_events.seq == 0          # it published nothing
        await until(lambda: restarted.engine.kv_events.subscriptions >= 1)   # the SUB socket reconnected
        await _chat(client, "a new life")
        await until(lambda: 0 < len(st.emap) == restarted.engine.pool.cached_blocks)
        text = await gw.metrics_text()
        assert metric(text, "switchyard_engine_restarts_total", model="m") == 1
        assert metric(text, "switchyard_kv_events_restarts_total", model="m") <= 1   # whichever saw it first
    finally:
        await restarted.close()


async def test_stalled_publisher_falls_back_and_recovers(sims, gateway, clients):
    (sim,) = await _sims(sims, 1)
    gw = await _gateway(gateway, sim, stall_timeout_s=0.2)
    kv, st = _state(gw)
    client = clients(gw)
    await until(lambda: sim.engine.kv_events.subscriptions >= 1)     # the SUB socket connected
    await _chat(client, "one")
    await until(lambda: len(st.emap) > 0)
    sim.engine.kv_events.paused = True
    await _chat(client, "something new " * 30)
    await asyncio.sleep(0.3)
    await _chat(client, "and more " * 30)
    assert st.on_fallback == "stalled"
    text = await gw.metrics_text()
    assert 'switchyard_kv_events_fallbacks_total{model="m",reason="stalled"}' in text
    assert 'switchyard_routing_fallbacks_total{reason="kv_events_fallback",strategy="prefix-cache"}' in text
    sim.engine.kv_events.resume()
    await until(lambda: st.on_fallback is None)


async def test_engine_without_events_routes_on_the_approximate_index(sims, gateway, clients):
    sim = await sims("vllm", model="m", tokenizer=TOK)       # publishes nothing
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url], "tokenizer": TOK,
                         "strategy": "prefix-cache", "kv_events": {"enabled": True, "port": 1}}])
    client = clients(gw)
    await _chat(client, "one")
    r = await _chat(client, "two")
    assert r.choices[0].message.content is not None
    text = await gw.metrics_text()
    assert 'switchyard_kv_events_fallbacks_total{model="m",reason="no_events"} 1.0' in text


async def test_salted_requests_go_to_their_salts_prefix_and_multimodal_falls_back(sims, gateway, clients):
    """vLLM folds ``cache_salt`` into the first block's hash and publishes it in ``extra_keys``: engine A
    holds the conversation unsalted, engine B under salt t1. A t1 request goes to B, an unsalted one
    to A (each finding its prefix cached there); a request with an image is routed on the
    approximate index, and the fallback is counted."""
    a, b = await _sims(sims, 2)

    def endpoint(sim):
        s = sim.engine.kv_events
        return {"url": sim.url, "kv_events": {"port": s.port, "replay_port": s.replay_port}}

    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [endpoint(a), endpoint(b)], "tokenizer": TOK,
                         "strategy": "prefix-cache", "kv_events": {"enabled": True, "stall_timeout_s": 5.0}}])
    kv = gw.gw.routing.ctx.precise_index
    await until(lambda: len(kv.subscribers) == 2)
    await until(lambda: a.engine.kv_events.subscriptions >= 1 and b.engine.kv_events.subscriptions >= 1)
    state = {st.ep.url: st for st in kv.index.states.values()}
    pod = {a.url: state[a.url].ep.address, b.url: state[b.url].ep.address}
    seed = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "seed"}]
    for sim, salt in ((a, None), (b, "t1")):            # straight to the engines, as other gateways would
        c = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0)
        await c.chat.completions.create(model="m", messages=seed, max_tokens=2,
                                        extra_body={"cache_salt": salt} if salt else None)
        await c.close()
    await until(lambda: all(len(state[s.url].emap) == s.engine.pool.cached_blocks > 0 for s in (a, b)))
    client = clients(gw)

    async def ask(text: str, salt: str | None):
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
            max_tokens=2, extra_body={"cache_salt": salt} if salt else None)
        return raw.headers["target-pod"], raw.parse().usage.prompt_tokens_details.cached_tokens

    where, cached = await ask("a salted question", "t1")
    assert where == pod[b.url] and cached > 0
    where, cached = await ask("a plain question", None)
    assert where == pod[a.url] and cached > 0
    r = await client.chat.completions.create(model="m", max_tokens=2, messages=[
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": "what is on this picture?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}])
    assert r.choices[0].message.content is not None
    text = await gw.metrics_text()
    assert 'switchyard_kv_events_fallbacks_total{model="m",reason="multimodal"} 1.0' in text
    assert 'switchyard_routing_fallbacks_total{reason="kv_events_multimodal",strategy="prefix-cache"} 1.0' in text


async def _indexed(sims, gateway, clients):
    """One engine and a gateway routing on its events, three conversations in, the index holding
    every block the engine caches: (sim, gateway, its KV state, its index state, a client)."""
    (sim,) = await _sims(sims, 1)
    gw = await _gateway(gateway, sim)
    kv, st = _state(gw)
    client = clients(gw)
    await until(lambda: sim.engine.kv_events.subscriptions >= 1)     # the SUB socket connected
    for q in ("one", "two", "three"):
        await _chat(client, q)
    await until(lambda: len(st.emap) == sim.engine.pool.cached_blocks > 0)
    return sim, gw, kv, st, client

async def test_a_restarted_engine_first_heard_past_its_first_batch_is_replayed_from_0(sims, gateway, clients):
    """An engine restarts and its first batches go out before the SUB socket is connected again (a
    slow joiner; an engine whose scrape tells no start, as SGLang's or vLLM's with several API
    servers): the first number heard goes back, but past 0. Its entries are cleared as a restart, and
    what the new engine published before is replayed from 0 as at first contact, so the index holds
    what the engine holds and the next turn's match is what the engine finds cached."""
    sim, gw, kv, st, client = await _indexed(sims, gateway, clients)
    pub = sim.engine.kv_events
    # the engine restarts: an empty cache, and its publisher counts from 0 again
    pub.seq = 0
    pub.buffer.clear()
    sim.engine.pool.events = None
    assert sim.engine.pool.flush()
    sim.engine.pool.events = pub
    pub.drop_next = 1              # its first batch (the system prompt's blocks) reaches no subscriber
    await _chat(client, "a new life")
    await _chat(client, "and a second question")        # batch 1: chained on the blocks of batch 0
    await until(lambda: 'switchyard_kv_events_restarts_total{model="m"} 1.0' in _render(gw))
    await until(lambda: len(st.emap) == sim.engine.pool.cached_blocks, timeout=5)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "and a second question"}]
    ireq = parse(CHAT, orjson.dumps({"model": "m", "messages": messages, "max_tokens": 2}), {}, "t")
    depths, _, fallback = kv.match(ireq, [st.ep])
    r = await client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert not fallback and depths[st.ep] == r.usage.prompt_tokens_details.cached_tokens > 0
    text = _render(gw)
    assert 'kind="orphan"' not in text
    assert metric(text, "switchyard_kv_events_replays_total", model="m", result="ok") >= 1


async def test_a_batch_heard_again_is_taken_for_a_restart_and_the_index_is_rebuilt_from_the_replay(sims, gateway, clients):
    """A publisher that sends a batch it sent before (a sequence number going back, past 0): taken
    for a restart, as documented, so the entries are cleared, and replayed from 0, so the index
    ends holding what the engine holds instead of nothing of what came before."""
    sim, gw, kv, st, client = await _indexed(sims, gateway, clients)
    pub = sim.engine.kv_events
    seq, payload = pub.buffer[-1]
    pub._send((pub.topic, seq.to_bytes(8, "big"), payload))          # heard again
    await until(lambda: 'switchyard_kv_events_restarts_total{model="m"} 1.0' in _render(gw))
    await until(lambda: len(st.emap) == sim.engine.pool.cached_blocks)
    r = await _chat(client, "three")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "three"}]
    ireq = parse(CHAT, orjson.dumps({"model": "m", "messages": messages, "max_tokens": 2}), {}, "t")
    assert kv.match(ireq, [st.ep])[0][st.ep] >= r.usage.prompt_tokens_details.cached_tokens > 0


async def test_a_gateway_started_beside_an_idle_engine_routes_on_its_cache_at_once(sims, gateway, clients):
    """An engine cached a conversation's blocks before the gateway started and publishes nothing
    since: the gateway asks the engine's replay socket when its SUB socket connects, so the next
    turn is routed on the engine's blocks at once, not on the approximate index until the engine
    happens to publish again."""
    (sim,) = await _sims(sims, 1)
    r = await post(sim, {"model": "m", "max_tokens": 2,
                         "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "one"}]})
    assert r.status == 200
    pub = sim.engine.kv_events
    published = pub.seq
    assert published > 0 and sim.engine.pool.cached_blocks > 0
    gw = await _gateway(gateway, sim)
    kv, st = _state(gw)
    await until(lambda: len(st.emap) == sim.engine.pool.cached_blocks)
    assert pub.seq == published                  # the engine published nothing since
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "two"}]
    ireq = parse(CHAT, orjson.dumps({"model": "m", "messages": messages, "max_tokens": 2}), {}, "t")
    depths, _, fallback = kv.match(ireq, [st.ep])
    r2 = await clients(gw).chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert not fallback and depths[st.ep] == r2.usage.prompt_tokens_details.cached_tokens > 0
    text = _render(gw)
    assert metric(text, "switchyard_kv_events_replayed_batches_total", model="m") == published
    assert metric(text, "switchyard_kv_events_replays_total", model="m", result="ok") >= 1
    assert 'reason="kv_events_fallback"' not in text


async def test_a_gap_before_a_reconnect_is_replayed_at_once_on_an_idle_stream(sims, gateway, clients, monkeypatch):
    """A batch the gateway never heard, then the connection dropped and made again (here by a
    message over the size bound, made small for the test), and the engine idle since: the gateway
    asks the replay socket at the reconnect for what came after the last batch it applied, so the
    index holds the missed blocks without waiting for a next batch to show the gap."""
    monkeypatch.setattr(kv_events, "MAX_MESSAGE_BYTES", 64 << 10)
    sim, gw, kv, st, client = await _indexed(sims, gateway, clients)
    pub = sim.engine.kv_events
    pub.drop_next = 1                  # the next batch is buffered for replay but never published
    await _chat(client, "four " * 60)
    published = pub.seq
    assert len(st.emap) < sim.engine.pool.cached_blocks
    pub._send((pub.topic, published.to_bytes(8, "big"), b"x" * (128 << 10)))    # refused: reconnect
    await until(lambda: len(st.emap) == sim.engine.pool.cached_blocks)
    assert pub.seq == published
    text = _render(gw)
    assert metric(text, "switchyard_kv_events_replayed_batches_total", model="m") >= 1
    assert metric(text, "switchyard_kv_events_restarts_total", model="m") == 0


async def test_a_reload_that_removes_a_model_takes_its_fast_tokenizer_gauge_with_it(sims, gateway):
    """A reload may remove a model that subscribes to events (its subscriptions go with it): its
    ``switchyard_kv_events_fast_tokenizer`` gauge goes too, as its index blocks and endpoints'
    liveness do, where it stayed for the life of the process, a fact about a model no longer served."""
    import msgspec

    from gateway.config.schema import config_from_dict
    from gateway.server.app import RELOAD_KEY
    from tests.support.factories import model_block

    sim = (await _sims(sims, 1))[0]
    other = await sims("vllm", "m2")
    s = sim.engine.kv_events
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url], "tokenizer": TOK,
                         "strategy": "prefix-cache", "kv_events": {"enabled": True, "port": s.port}},
                        model_block("m2", "vllm", [other.url])])
    await until(lambda: s.subscriptions >= 1)
    assert list(series(await gw.metrics_text(), "switchyard_kv_events_fast_tokenizer")) == ['model="m"']
    reloader = gw.runner.app[RELOAD_KEY]
    raw = msgspec.to_builtins(reloader.live.config)
    raw["models"] = [model_block("m2", "vllm", [other.url])]
    result = reloader.reload("test", config_from_dict(raw, source="<test>"))
    assert (result.result, result.removed) == ("ok", [f"m {sim.url}"]), result
    assert series(await gw.metrics_text(), "switchyard_kv_events_fast_tokenizer") == {}, \
        "a model the reload removed keeps its gauge"
    await until(lambda: series(gw.gw.metrics.render().decode(), "switchyard_kv_events_index_blocks") == {})
