"""The shared state on a real Redis Cluster (3 primaries, 1 replica each, on loopback): one view of
limits, keys and stored responses for two gateways, and a primary killed mid-run."""

from __future__ import annotations

import asyncio

from gateway.config.schema import StateConfig
from gateway.state.redis import shared_prefix
from tests.support.factories import model_block
from tests.support.redis_failover import failover_mid_run, one_view_of_limits_keys_and_responses


async def test_two_gateways_share_limits_keys_and_responses_on_a_cluster(sims, gateway, redis_cluster):
    await one_view_of_limits_keys_and_responses(sims, gateway, redis_cluster.url)


async def test_a_cluster_primary_killed_mid_run(sims, gateway, redis_cluster):
    # the primary of the slot every tenancy key shares: the one that matters
    slot_key = f"{shared_prefix(StateConfig(redis_url=redis_cluster.url))}:rpm:alice"
    victims = []

    def kill() -> None:
        victims.append(redis_cluster.kill_primary_of(slot_key))

    await failover_mid_run(sims, gateway, redis_cluster.url, kill, "cluster")
    # the old primary comes back as a replica of its successor; nothing else changes
    await asyncio.to_thread(redis_cluster.restart, victims[0])
    assert redis_cluster.role(victims[0]) == "slave"


async def test_the_shared_routing_view_comes_back_after_its_primary_is_killed(sims, gateway, redis_cluster):
    """The primary holding the replicas' view stream dies and its replica is promoted: a replica's
    writer reads the slot map again and writes to the new primary, and the other replica reads on,
    by themselves (a failed pipeline left the client on the dead node, retrying it forever)."""
    from tests.support.http import openai_client
    from tests.support.metrics import metric
    from tests.support.redis_failover import FAILOVER_S, FAST_STATE
    from tests.support.waiting import until

    sim = await sims("vllm", "m")
    blocks = {"state": {"redis_url": redis_cluster.url, **FAST_STATE}}
    a = await gateway([model_block("m", "vllm", [sim.url], strategy="prefix-cache")], **blocks)
    b = await gateway([model_block("m", "vllm", [sim.url], strategy="prefix-cache")], **blocks)
    links = [g.gw.gen.services.view.link for g in (a, b)]
    await until(lambda: all(link.up for link in links), timeout=FAILOVER_S)

    async def send(i: int) -> None:
        c = openai_client(a)
        await c.chat.completions.create(model="m", max_tokens=1,
                                        messages=[{"role": "user", "content": f"{i} a prompt of its own " * 40}])

    def received(text: str) -> float:
        return metric(text, "switchyard_view_messages_received_total", source="replica")

    await send(0)
    await asyncio.to_thread(redis_cluster.kill_primary_of, links[0].key)
    for i in range(1, 6):                           # A's writer meets the dead primary
        await send(i)
        await asyncio.sleep(0.2)
    await until(lambda: all(link.up for link in links), timeout=FAILOVER_S)
    before = received(await b.metrics_text())
    for i in range(6, 12):
        await send(i)

    async def b_reads_on() -> bool:
        return received(await b.metrics_text()) > before

    await until(b_reads_on, timeout=FAILOVER_S)
    assert metric(await a.metrics_text(), "switchyard_view_redis_up") == 1
