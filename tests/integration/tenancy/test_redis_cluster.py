"""The shared state on a real Redis Cluster (3 primaries, 1 replica each, on loopback): one view of
limits, keys and stored responses for two gateways, and a primary killed mid-run."""

from __future__ import annotations

import asyncio

from gateway.config.schema import StateConfig
from gateway.state.redis import shared_prefix
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
