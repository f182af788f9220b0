"""A data-parallel engine behind one endpoint, on loopback: enginesim publishes two ranks on
``port`` and ``port + 1``; the gateway subscribes to both, indexes what either holds, replays a
rank's gap from that rank, and clears only the rank that restarted."""

from __future__ import annotations

import asyncio

import openai
import pytest

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.kv_wire import rank_of

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
                                       "data_parallel_size": 2, "stall_timeout_s": 30}}])
    kv = gw.gw.routing.ctx.precise_index
    await _wait(lambda: len(kv.subscribers) == 1)
    st = next(iter(kv.index.states.values()))
    await asyncio.sleep(0.3)          # the SUB sockets connect (a slow joiner misses what came before)
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
    return sim, pubs, gw, kv, st, client


async def _wait(pred, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def _chat(client, pubs, rank: int, tag: str):
    """A conversation on a new prefix, whose blocks the simulator publishes on ``rank``."""
    pubs.next_rank = rank
    return await client.chat.completions.create(
        model="m", messages=[{"role": "system", "content": f"{tag} {SYSTEM}"}, {"role": "user", "content": "hi"}],
        max_tokens=2)


def _by_rank(st) -> dict[int, int]:
    out: dict[int, int] = {}
    for h in st.emap:
        out[rank_of(h)] = out.get(rank_of(h), 0) + 1
    return out


def _indexed(st, pubs) -> bool:
    return _by_rank(st) == {r: n for r in range(len(pubs.ranks)) if (n := pubs.held_by(r))}


async def test_both_ranks_are_indexed_and_a_gap_replays_on_its_rank_only(sims, gateway):
    sim, pubs, gw, kv, st, client = await _setup(sims, gateway)
    try:
        (subs,) = kv.subscribers.values()
        assert [s.rank for s in subs] == [0, 1]
        await _chat(client, pubs, 0, "alpha")
        await _chat(client, pubs, 1, "beta")
        await _wait(lambda: _indexed(st, pubs))
        assert set(_by_rank(st)) == {0, 1} and len(st.emap) == sim.engine.pool.cached_blocks
        # the endpoint holds a prefix that only rank 1 reported: a second turn matches it
        r = await client.chat.completions.create(
            model="m", messages=[{"role": "system", "content": f"beta {SYSTEM}"},
                                 {"role": "user", "content": "hi again"}], max_tokens=2)
        assert r.usage.prompt_tokens_details.cached_tokens > 0
        assert st.on_fallback is None

        pubs.ranks[1].drop_next = 1          # rank 1's next batch is buffered for replay, never sent
        await _chat(client, pubs, 1, "gamma")
        await _chat(client, pubs, 1, "delta")
        await _wait(lambda: _indexed(st, pubs))
        assert [p.replays_served for p in pubs.ranks] == [0, 1]
        assert [s.expected for s in subs] == [p.seq for p in pubs.ranks]
        text = await gw.metrics_text()
        assert 'switchyard_kv_events_replays_total{model="m",result="ok"} 1.0' in text
    finally:
        await client.close()


async def test_a_restarted_rank_clears_its_entries_only(sims, gateway):
    sim, pubs, gw, kv, st, client = await _setup(sims, gateway)
    try:
        await _chat(client, pubs, 0, "alpha")
        await _chat(client, pubs, 1, "beta")
        await _wait(lambda: _indexed(st, pubs))
        rank0, rank1_before = pubs.held_by(0), pubs.held_by(1)
        assert rank0 and rank1_before
        # rank 1 restarts: its publisher counts from 0 again (its old blocks are gone for the gateway)
        pubs.ranks[1].seq = 0
        pubs.ranks[1].buffer.clear()
        await _chat(client, pubs, 1, "a new life")
        await _wait(lambda: _by_rank(st).get(1) == pubs.held_by(1) - rank1_before)
        assert _by_rank(st)[0] == rank0                     # rank 0 kept everything
        text = await gw.metrics_text()
        assert 'switchyard_kv_events_restarts_total{model="m"} 1.0' in text
    finally:
        await client.close()
