"""The shared state on a real Sentinel-managed Redis (a primary, a replica, 3 Sentinels, on
loopback): one view of limits, keys and stored responses for two gateways, and the primary
killed mid-run."""

from __future__ import annotations

from tests.support.redis_failover import failover_mid_run, one_view_of_limits_keys_and_responses


async def test_two_gateways_share_limits_keys_and_responses_through_sentinel(sims, gateway, redis_sentinel):
    await one_view_of_limits_keys_and_responses(sims, gateway, redis_sentinel.url)


async def test_a_sentinel_primary_killed_mid_run(sims, gateway, redis_sentinel):
    await failover_mid_run(sims, gateway, redis_sentinel.url, redis_sentinel.kill_primary, "sentinel")
