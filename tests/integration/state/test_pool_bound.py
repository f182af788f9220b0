"""state.max_connections against a real redis-server: a burst leaves each of a gateway's Redis
clients with at most that many connections and every client its answer, and a call that waits
past state.timeout_s for a connection degrades as a call to an unreachable Redis does."""

from __future__ import annotations

import asyncio

import openai
import pytest
import redis.asyncio as aioredis

from gateway.config.schema import StateConfig
from gateway.state.redis import close_client, redis_client
from tests.support.factories import model_block
from tests.support.http import openai_client
from tests.support.metrics import metric
from tests.support.tenancy import ALICE, CHAT, KEYS
from tests.support.waiting import wait_for

LIMITS = {"users": {"alice": {"rpm": 100_000, "tpm": 100_000_000, "max_concurrent": 10_000}}}


async def _gateway_connections(port: int) -> int:
    """Clients of the server on ``port`` other than the test's own, a replica's link and a
    Sentinel's."""
    r = aioredis.Redis(host="127.0.0.1", port=port)
    try:
        return sum(1 for c in await r.client_list()
                   if c.get("cmd") != "client|list" and not set(c.get("flags", "")) & {"S", "M"}
                   and not c.get("name", "").startswith("sentinel-"))
    finally:
        await r.aclose()


async def _burst(sims, gateway, url: str) -> None:
    """150 Responses requests at once, each a limit check and a record written, through a gateway
    whose Redis clients may hold 3 connections each."""
    sim = await sims("vllm", "m", ttft_base_ms=50.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS, limits=LIMITS,
                       state={"redis_url": url, "timeout_s": 2.0, "max_connections": 3},
                       responses={"state": "gateway"})
    client = openai_client(gw, ALICE)
    burst = await asyncio.gather(*(client.responses.create(model="m", input=f"hello {i}", max_output_tokens=2)
                                   for i in range(150)))
    # every one answered (2 tokens end each as incomplete, max_output_tokens) and none failed
    assert [(r.status, r.error) for r in burst] == [("incomplete", None)] * 150
    # the records were written: they are found again
    again = await asyncio.gather(*(client.responses.retrieve(r.id) for r in burst[:50]))
    assert [r.id for r in again] == [r.id for r in burst[:50]]
    assert metric(await gw.metrics_text(), "switchyard_state_unavailable_total", policy="open") == 0


# the gateway's clients: tenancy, Responses records, the view's writer and reader; 3 connections each
MOST = 4 * 3


async def test_a_burst_leaves_at_most_max_connections_per_client(sims, gateway, redis_server):
    await _burst(sims, gateway, redis_server.url)
    assert 0 < await _gateway_connections(redis_server.port) <= MOST


async def test_a_burst_on_a_cluster_leaves_at_most_max_connections_per_client_and_node(sims, gateway, redis_cluster):
    await _burst(sims, gateway, redis_cluster.url)
    held = [await _gateway_connections(n.port) for n in redis_cluster.live()]
    assert sum(held) > 0 and max(held) <= MOST, held


async def test_a_burst_through_sentinel_leaves_at_most_max_connections_per_client(sims, gateway, redis_sentinel):
    await _burst(sims, gateway, redis_sentinel.url)
    assert 0 < await _gateway_connections((await asyncio.to_thread(redis_sentinel.primary)).port) <= MOST


async def _hold(client, seconds: float, step: float = 0.3) -> None:
    """Keep one of ``client``'s places busy for ``seconds``: a pipeline of BLPOPs Redis answers
    only when each times out (each read shorter than the client's socket timeout)."""
    pipe = client.pipeline(transaction=False)
    for _ in range(round(seconds / step)):
        pipe.blpop("switchyard-test:never", step)
    await pipe.execute()


async def _blocked(r: aioredis.Redis) -> bool:
    return any(c.get("cmd") == "blpop" for c in await r.client_list())


@pytest.mark.parametrize("policy", ["open", "closed"])
async def test_a_limit_check_that_waits_past_timeout_follows_the_failure_policy(sims, gateway, redis_server, policy):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS, limits=LIMITS,
                       state={"redis_url": redis_server.url, "timeout_s": 0.5, "max_connections": 1,
                              "failure_policy": policy})
    c = openai_client(gw, ALICE)
    assert (await c.chat.completions.create(model="m", messages=CHAT, max_tokens=1)).choices
    r = aioredis.Redis.from_url(redis_server.url)
    holder = asyncio.ensure_future(_hold(gw.gw.tenancy.state.client, 2.4))
    try:
        assert await wait_for(lambda: _blocked(r))      # the client's one connection is taken
        if policy == "open":
            assert (await c.chat.completions.create(model="m", messages=CHAT, max_tokens=1)).choices
        else:
            with pytest.raises(openai.InternalServerError) as ei:
                await c.chat.completions.create(model="m", messages=CHAT, max_tokens=1)
            assert ei.value.status_code == 503
            assert ei.value.response.headers["x-error-state-unavailable"] == "true"
        text = await gw.metrics_text()
        assert metric(text, "switchyard_state_unavailable_total", policy=policy) == 1
        assert metric(text, "switchyard_state_pool_timeouts_total", client="tenancy") >= 1
        # not an outage: Redis answers the call that holds the connection
        assert metric(text, "switchyard_state_up") == 1
        assert metric(text, "switchyard_state_outages_total", mode="standalone") == 0
        await holder
        # the connection is free again: checked and counted as before
        assert (await c.chat.completions.create(model="m", messages=CHAT, max_tokens=1)).choices
        text = await gw.metrics_text()
        assert metric(text, "switchyard_state_unavailable_total", policy=policy) == 1
        assert int(await r.get("switchyard:rpm:alice")) == 2
    finally:
        holder.cancel()
        await r.aclose()


async def test_a_responses_lookup_that_waits_past_timeout_is_a_503_as_for_an_unreachable_store(
        sims, gateway, redis_server):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       state={"redis_url": redis_server.url, "timeout_s": 0.5, "max_connections": 1},
                       responses={"state": "gateway"})
    c = openai_client(gw)
    first = await c.responses.create(model="m", input="Hello", max_output_tokens=2)
    r = aioredis.Redis.from_url(redis_server.url)
    holder = asyncio.ensure_future(_hold(gw.gw.gen.services.responses.history.client, 2.4))
    try:
        assert await wait_for(lambda: _blocked(r))
        with pytest.raises(openai.InternalServerError) as ei:
            await c.responses.retrieve(first.id)
        assert ei.value.status_code == 503
        assert ei.value.response.headers["x-error-state-unavailable"] == "true"
        text = await gw.metrics_text()
        assert metric(text, "switchyard_state_pool_timeouts_total", client="responses") == 1
        await holder
        assert (await c.responses.retrieve(first.id)).id == first.id
    finally:
        holder.cancel()
        await r.aclose()


async def test_a_call_made_inside_a_call_takes_no_second_place(redis_server):
    """As a Cluster pipeline sends the commands a MOVED or ASK answer redirected: through its client,
    while the pipeline holds its place. With one place it would wait for itself."""
    client = redis_client(StateConfig(redis_url=redis_server.url, timeout_s=0.5, max_connections=1))
    try:
        async def outer():
            await client.set(b"k", b"v")
            return await client.get(b"k")

        assert await client.room.run(outer) == b"v"
        assert await client.get(b"k") == b"v"
    finally:
        await close_client(client)


async def test_a_cluster_client_holds_at_most_max_connections_to_a_startup_node(redis_cluster):
    """The slot map is first read from a node of the URL: that read's connection is one of the
    node's max_connections, not one more beside them."""
    client = redis_client(StateConfig(redis_url=redis_cluster.url, timeout_s=2.0, max_connections=2))
    try:
        await asyncio.gather(*(client.get(f"k{i}") for i in range(300)))      # keys on every primary
        held = {n.port: await _gateway_connections(n.port) for n in redis_cluster.live()}
        assert max(held.values()) == 2, held
    finally:
        await close_client(client)
