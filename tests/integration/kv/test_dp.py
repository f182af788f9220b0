"""A data-parallel engine behind one endpoint, on loopback: enginesim publishes two ranks on
``port`` and ``port + 1``; the gateway subscribes to both, indexes what either holds, replays a
rank's gap from that rank, and clears only the rank that restarted. Then the gateway picks the rank:
a conversation's turns and requests sharing a prefix land on the rank holding it."""

from __future__ import annotations

import asyncio

import openai
import pytest

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.kv.wire import rank_of
from tests.support.http import openai_client
from tests.support.waiting import until

pytestmark = pytest.mark.integration

TOK = str(TINY_DIR)
SYSTEM = "You are a careful assistant. " + " ".join(f"rule {i} is kqz lo abc" for i in range(60))


async def _setup(sims, gateway):
    sim = await sims("vllm", model="m", tokenizer=TOK, kv_events_port=0, kv_events_replay_port=0,
                     kv_blocks=4096, data_parallel_size=2)
    pubs = sim.engine.kv_events
    assert [p.port for p in pubs.ranks] == [pubs.port, pubs.port + 1]
    assert [p.replay_port for p in pubs.ranks] == [pubs.replay_port, pubs.replay_port + 1]
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url], "tokenizer": TOK,
                         "strategy": "prefix-cache",
                         "kv_events": {"enabled": True, "port": pubs.port, "replay_port": pubs.replay_port,
                                       "data_parallel_size": 2, "stall_timeout_s": 30,
                                       "client_rank": True}}])   # these tests place prefixes themselves
    kv = gw.gw.routing.ctx.precise_index
    await until(lambda: len(kv.subscribers) == 1)
    st = next(iter(kv.index.states.values()))
    await until(lambda: pubs.subscriptions >= 1)          # every rank subscribed (a slow joiner misses what came before)
    client = openai_client(gw, "x")
    return sim, pubs, gw, kv, st, client


async def _chat(client, pubs, rank: int, tag: str):
    """A conversation on a new prefix, run on ``rank`` (the model lets the client's header through)."""
    return await client.chat.completions.create(
        model="m", messages=[{"role": "system", "content": f"{tag} {SYSTEM}"}, {"role": "user", "content": "hi"}],
        max_tokens=2, extra_headers={"X-data-parallel-rank": str(rank)})


def _by_rank(st) -> dict[int, int]:
    out: dict[int, int] = {}
    for h in st.emap:
        out[rank_of(h)] = out.get(rank_of(h), 0) + 1
    return out


def _held_by(sim, rank: int) -> int:
    return sim.engine.pools[rank].cached_blocks


def _indexed(st, sim) -> bool:
    return _by_rank(st) == {r: n for r in range(len(sim.engine.pools)) if (n := _held_by(sim, r))}


async def test_both_ranks_are_indexed_and_a_gap_replays_on_its_rank_only(sims, gateway):
    sim, pubs, gw, kv, st, client = await _setup(sims, gateway)
    try:
        (subs,) = kv.subscribers.values()
        assert [s.rank for s in subs] == [0, 1]
        await _chat(client, pubs, 0, "alpha")
        await _chat(client, pubs, 1, "beta")
        await until(lambda: _indexed(st, sim))
        assert set(_by_rank(st)) == {0, 1} and len(st.emap) == sum(p.cached_blocks for p in sim.engine.pools)
        # the endpoint holds a prefix that only rank 1 reported: a second turn matches it
        r = await client.chat.completions.create(
            model="m", messages=[{"role": "system", "content": f"beta {SYSTEM}"},
                                 {"role": "user", "content": "hi again"}], max_tokens=2)
        assert r.usage.prompt_tokens_details.cached_tokens > 0
        assert st.on_fallback is None

        pubs.ranks[1].drop_next = 1          # rank 1's next batch is buffered for replay, never sent
        await _chat(client, pubs, 1, "gamma")
        await _chat(client, pubs, 1, "delta")
        await until(lambda: _indexed(st, sim))
        # one replay each rank's connection asked (catch-up), and one for rank 1's gap
        assert [p.replays_served for p in pubs.ranks] == [1, 2]
        assert [s.expected for s in subs] == [p.seq for p in pubs.ranks]
        text = await gw.metrics_text()
        assert 'switchyard_kv_events_gaps_total{model="m"} 1.0' in text
        assert 'switchyard_kv_events_replays_total{model="m",result="ok"}' in text
    finally:
        await client.close()


async def test_a_restarted_rank_clears_its_entries_only(sims, gateway):
    sim, pubs, gw, kv, st, client = await _setup(sims, gateway)
    try:
        await _chat(client, pubs, 0, "alpha")
        await _chat(client, pubs, 1, "beta")
        await until(lambda: _indexed(st, sim))
        rank0, rank1_before = _held_by(sim, 0), _held_by(sim, 1)
        assert rank0 and rank1_before
        # rank 1 restarts: its publisher counts from 0 again (its old blocks are gone for the gateway)
        pubs.ranks[1].seq = 0
        pubs.ranks[1].buffer.clear()
        await _chat(client, pubs, 1, "a new life")
        # the restart first: the new prompt may hold as many blocks as the old one did, which the
        # count below would match before the restart's message was read
        await until(lambda: kv.metrics.restarts.labels("m")._value.get() == 1)
        await until(lambda: _by_rank(st).get(1) == _held_by(sim, 1) - rank1_before)
        assert _by_rank(st)[0] == rank0                     # rank 0 kept everything
        text = await gw.metrics_text()
        assert 'switchyard_kv_events_restarts_total{model="m"} 1.0' in text
    finally:
        await client.close()


async def _ranked_setup(sims, gateway, route_ranks: bool):
    sim = await sims("vllm", model="m", tokenizer=TOK, kv_events_port=0, kv_events_replay_port=0,
                     kv_blocks=4096, data_parallel_size=2)
    pubs = sim.engine.kv_events
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url], "tokenizer": TOK,
                         "strategy": "prefix-cache",
                         "kv_events": {"enabled": True, "port": pubs.port, "replay_port": pubs.replay_port,
                                       "data_parallel_size": 2, "stall_timeout_s": 30,
                                       "route_ranks": route_ranks}}])
    kv = gw.gw.routing.ctx.precise_index
    await until(lambda: len(kv.subscribers) == 1)
    st = next(iter(kv.index.states.values()))
    await until(lambda: pubs.subscriptions >= 1)          # every rank's SUB socket connected
    records: list = []
    gw.gw.observers.append(lambda rec, _d: records.append(rec))
    return sim, gw, st, records


async def _workload(sim, gw, st) -> list[int]:
    """A four-turn conversation, then four questions on one long shared prefix, one after another
    (each once the gateway indexed what the previous one cached); the cached tokens of each request
    but the first of each group. The client sends its own rank header on every request."""
    cached: list[int] = []
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0,
                                default_headers={"X-data-parallel-rank": "1"})
    try:
        messages = [{"role": "system", "content": f"conversation {SYSTEM}"}]
        for turn in range(4):
            messages.append({"role": "user", "content": f"question number {turn} about rule {turn}"})
            r = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
            if turn:
                cached.append(r.usage.prompt_tokens_details.cached_tokens)
            await until(lambda: _indexed(st, sim))
        shared = "shared context " + SYSTEM
        for q in range(4):
            r = await client.completions.create(model="m", prompt=f"{shared} question {q}?", max_tokens=2)
            if q:
                cached.append(r.usage.prompt_tokens_details.cached_tokens)
            await until(lambda: _indexed(st, sim))
    finally:
        await client.close()
    return cached


async def test_the_gateway_pins_each_request_to_the_rank_holding_its_prefix(sims, gateway):
    sim, gw, st, records = await _ranked_setup(sims, gateway, route_ranks=True)
    cached = await _workload(sim, gw, st)
    assert all(c > 0 for c in cached), cached
    # the first request finds the endpoint not yet live on events (no rank has published): the engine
    # picks; every later one went with the gateway's rank (the client's own header was replaced), as logged
    assert "dp_rank" not in records[0].extra
    ranks = [rec.extra["dp_rank"] for rec in records[1:]]
    assert list(sim.engine.asked_ranks) == ranks and len(ranks) == 7
    assert st.rank_in_flight == [0, 0]
    text = await gw.metrics_text()
    assert 'switchyard_kv_events_rank_routed_total{model="m",reason="match"} 6.0' in text
    assert 'switchyard_kv_events_rank_routed_total{model="m",reason="load"} 1.0' in text
    print("route_ranks on: cached tokens", cached, "sum", sum(cached))


async def test_without_route_ranks_the_engine_spreads_requests_and_misses_its_cache(sims, gateway):
    sim, gw, st, records = await _ranked_setup(sims, gateway, route_ranks=False)
    cached = await _workload(sim, gw, st)
    assert not sim.engine.asked_ranks                # neither the gateway nor the client pinned a rank
    assert all("dp_rank" not in rec.extra for rec in records)
    assert cached.count(0) >= 2, cached        # a turn, a shared-prefix question on the other rank
    text = await gw.metrics_text()
    assert "switchyard_kv_events_rank_routed_total{" not in text
    print("route_ranks off: cached tokens", cached, "sum", sum(cached))


async def test_a_burst_on_one_new_prefix_follows_the_first_request_to_its_rank(sims, gateway):
    """Requests on a prefix no rank holds yet, sent together: the first is pinned by load, and its
    new blocks count as held on that rank until the rank reports them, so the rest follow it there
    (each rank's own cache would otherwise prefill the prefix again)."""
    sim, gw, st, records = await _ranked_setup(sims, gateway, route_ranks=True)
    client = openai_client(gw, "x")
    try:
        await client.completions.create(model="m", prompt="warm up " + SYSTEM[:200], max_tokens=2)
        await until(lambda: _indexed(st, sim))
        # the other rank is busier by one pinned request, so a load-only choice would alternate
        shared = "a new shared document " + SYSTEM
        answers = await asyncio.gather(*(client.completions.create(
            model="m", prompt=f"{shared} question {q}?", max_tokens=2) for q in range(4)))
    finally:
        await client.close()
    assert len(answers) == 4
    burst = [rec.extra["dp_rank"] for rec in records[1:]]
    assert len(burst) == 4 and len(set(burst)) == 1, burst
    assert list(sim.engine.asked_ranks)[-4:] == burst
    assert st.rank_in_flight == [0, 0]


async def test_a_client_rank_sent_twice_with_two_ranks_is_400(sims, gateway):
    """A model that lets a client's own X-data-parallel-rank through: two lines naming two ranks are
    refused, a 400 naming the header, rather than run on whichever line a reader takes first; the
    same rank twice runs on it, on the fast lane and off it."""
    import orjson

    from tests.support.edge import exchange, request

    sim = await sims("vllm", model="m", data_parallel_size=2)
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url],
                         "kv_events": {"enabled": False, "client_rank": True}}])
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    for target in ("/v1/chat/completions", "/v1/chat/completions?x=1"):
        for first, second, status in (("0", "1", 400), ("1", "1", 200)):
            raw = request("POST", target, body).replace(
                b"\r\n\r\n", f"\r\nX-data-parallel-rank: {first}\r\nx-data-parallel-rank: {second}\r\n\r\n".encode(), 1)
            ex = await exchange(gw.port, raw, until_close=False, responses=1)
            assert ex.first.status == status, (target, first, second, ex.first.body[:300])
            if status == 400:
                err = orjson.loads(ex.first.body)["error"]
                assert err["param"] == "x-data-parallel-rank" and err["type"] == "invalid_request_error", err
    page = await gw.metrics_text()
    assert 'switchyard_in_flight_requests{model="m"} 0.0' in page        # the refused ones hold nothing
    assert all(ep.in_flight == 0 for ep in gw.gw.pool.endpoints("m"))
