"""The shared state on a real Sentinel-managed Redis (a primary, a replica, 3 Sentinels, on
loopback): one view of limits, keys and stored responses for two gateways, and the primary
killed mid-run."""

from __future__ import annotations

import pytest

from tests.support.factories import model_block
from tests.support.redis_failover import (
    changes_reach_the_other_at_once,
    failover_mid_run,
    one_view_of_limits_keys_and_responses,
)


async def test_two_gateways_share_limits_keys_and_responses_through_sentinel(sims, gateway, redis_sentinel):
    await one_view_of_limits_keys_and_responses(sims, gateway, redis_sentinel.url)



async def test_a_key_made_or_revoked_through_one_gateway_holds_at_once_on_the_other_through_sentinel(
        sims, gateway, redis_sentinel):
    await changes_reach_the_other_at_once(sims, gateway, redis_sentinel.url)

async def test_a_sentinel_primary_killed_mid_run(sims, gateway, redis_sentinel):
    await failover_mid_run(sims, gateway, redis_sentinel.url, redis_sentinel.kill_primary, "sentinel")


async def test_the_warnings_of_sentinels_nobody_answers_for_name_them_briefly(sims, gateway, monkeypatch):
    """No Sentinel of the URL answers: the client's error listed each one as its Python object
    (its connection pool and connection, every setting, about 1 KB a Sentinel), and that text went
    into each warning's ``error`` (the start, the fail-open, the routing view's). Each Sentinel is
    now named by its address, with what went wrong."""
    import structlog.testing

    from gateway.tenants import service
    from tests.support.ports import listen_port
    from tests.support.redis_failover import FAST_STATE, chat
    from tests.support.tenancy import KEYS

    monkeypatch.setattr(service, "START_RETRY_S", 0.2)
    sim = await sims("vllm", "m")
    ports = [listen_port(), listen_port()]
    url = "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in ports) + "/mymaster"
    with structlog.testing.capture_logs() as logs:
        gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                           limits={"users": {"alice": {"rpm": 100}}},
                           state={**FAST_STATE, "redis_url": url, "sync_interval_s": 5.0, "replica_ttl_s": 10.0})
        assert (await chat(gw)).choices
    errors = [x["error"] for x in logs if "error" in x and "shared" in x["event"]]
    assert errors, logs
    for e in errors:
        assert "No master found for 'mymaster'" in e and "<redis" not in e and len(e) < 400, e
        assert all(f"127.0.0.1:{p}" in e for p in ports), e


async def test_sentinels_that_refuse_the_gateways_password_are_said_to(sims, gateway, redis_sentinel, monkeypatch):
    """Sentinels that require a password the gateway was not given (``state.sentinel_password``)
    answer each question with a refusal: the start's warning says the shared state refuses the
    gateway's credentials (``reason`` ``auth``) and its error names the Sentinels that refused and
    the setting, where it said "unreachable", listing them as "Sentinels not answering"."""
    import subprocess

    import structlog.testing

    from gateway.tenants import service
    from tests.support.redis_failover import FAST_STATE, chat
    from tests.support.tenancy import KEYS

    monkeypatch.setattr(service, "START_RETRY_S", 3.0)       # a retry would be seen, not timed
    for s in redis_sentinel.sentinels:
        out = subprocess.run([redis_sentinel.cli, "-p", str(s.port), "ACL", "SETUSER", "default", "resetpass",
                              ">sentinel-secret-27182"], capture_output=True, text=True, timeout=5, check=True)
        assert out.stdout.strip() == "OK", out
    sim = await sims("vllm", "m")
    with structlog.testing.capture_logs() as logs:
        gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                           limits={"users": {"alice": {"rpm": 100}}},
                           state={**FAST_STATE, "redis_url": redis_sentinel.url, "sync_interval_s": 30.0,
                                  "replica_ttl_s": 60.0})
        assert (await chat(gw)).choices
    at_start = [x for x in logs if "at start" in x["event"]]
    assert len(at_start) == 1, logs
    line = at_start[0]
    assert line["reason"] == "auth" and "credentials" in line["event"], line
    assert "not answering" not in line["error"] and "state.sentinel_password" in line["error"], line
    assert all(f"127.0.0.1:{s.port}" in line["error"] for s in redis_sentinel.sentinels), line


async def test_sentinels_that_know_no_such_primary_or_are_no_sentinels_are_named(redis_sentinel, redis_server):
    """Sentinels that answer but know no primary of the URL's name, and a server of the URL that is
    no Sentinel (a plain Redis refuses SENTINEL MASTERS), are named in the "no primary" error, with
    how many Sentinels were asked and whether over TLS, where it said only "No master found" (or,
    for a plain Redis, its "unknown command" as an error of the call)."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from gateway.config.schema import StateConfig
    from gateway.state.redis import close_client, redis_client

    sentinels = [f"127.0.0.1:{s.port}" for s in redis_sentinel.sentinels]
    plain = f"127.0.0.1:{redis_server.port}"
    client = redis_client(StateConfig(redis_url=f"redis+sentinel://{','.join([*sentinels, plain])}/nosuch",
                                      timeout_s=1.0))
    try:
        with pytest.raises(RedisConnectionError) as ei:
            await client.ping()
    finally:
        await close_client(client)
    e = str(ei.value)
    assert e.startswith("No master found for 'nosuch' by 4 Sentinels (no TLS) ("), e
    assert f"Sentinels that know no primary 'nosuch': {', '.join(sentinels)}" in e, e
    assert f"no Sentinels (SENTINEL refused): {plain}: unknown command 'SENTINEL'" in e, e
