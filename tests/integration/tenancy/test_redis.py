"""The Redis backend against a real redis-server: shared limits, outages, fleet in-flight counts."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import openai
import orjson
import pytest
import redis.asyncio as aioredis
import redis.exceptions
import structlog
import structlog.testing
import uvloop
import yaml

from gateway.apis.responses_state import RedisStore
from gateway.config.schema import StateConfig, UserLimits
from gateway.state.redis import redis_client
from gateway.tenants.directory import key_digest
from gateway.tenants.limits import AdmitQuery
from gateway.tenants.redis_state import RECONCILE, WHOLE_DIRECTORY, RedisState, StateUnavailable
from tests.support.factories import model_block
from tests.support.gateway_process import interrupt
from tests.support.http import openai_client
from tests.support.ports import listen_port
from tests.support.tenancy import ALICE, BOB, CHAT, KEYS, outcomes
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[3]
# quick heartbeats; a Redis call may take 2 s before it counts as an outage, and a replica counts
# for 5 s after its last heartbeat, so a machine that stalls for a moment (a shared VM descheduled,
# two suite halves on two cores) neither turns an enforcing test into a fail-open one nor drops a
# live replica's slots and in-flight counts from the others' view. A replica that died is written
# into Redis as last heard of long ago, so no test waits out the TTL. The test of a Redis that
# stops answering sets its own short timeout.
FAST_STATE = {"sync_interval_s": 0.05, "replica_ttl_s": 5.0, "timeout_s": 2.0}


def state(server, **kw) -> dict:
    return {"redis_url": server.url, **FAST_STATE, **kw}


async def chat(gw, key=ALICE, **kw):
    async with openai_client(gw, key) as client:    # closed here, not by the collector on a later test's loop
        return await client.chat.completions.create(model="m", messages=CHAT, max_tokens=1, **kw)


async def test_two_gateways_enforce_one_limit_together(sims, gateway, redis_server):
    sim = await sims("vllm", "m")
    blocks = {"auth": KEYS, "limits": {"users": {"alice": {"rpm": 5}}}, "state": state(redis_server)}
    a = await gateway([model_block("m", "vllm", [sim.url])], **blocks)
    b = await gateway([model_block("m", "vllm", [sim.url])], **blocks)
    got = await outcomes([chat(a) for _ in range(6)] + [chat(b) for _ in range(6)])
    assert got.count(200) == 5 and got.count("RateLimitError") == 7
    # counters expire: nothing in Redis grows without bound
    r = aioredis.Redis.from_url(redis_server.url)
    ttl = await r.pttl("switchyard:rpm:alice")
    assert 0 < ttl <= 60_000 and int(await r.get("switchyard:rpm:alice")) == 5
    await r.aclose()


async def test_tpm_charged_from_a_stream_on_one_replica_limits_the_other(sims, gateway, redis_server):
    sim = await sims("vllm", "m")
    blocks = {"auth": KEYS, "limits": {"users": {"alice": {"tpm": 40}}}, "state": state(redis_server)}
    a = await gateway([model_block("m", "vllm", [sim.url])], **blocks)
    b = await gateway([model_block("m", "vllm", [sim.url])], **blocks)
    stream = await openai_client(a, ALICE).chat.completions.create(model="m", messages=CHAT, max_tokens=30, stream=True)
    async for _ in stream:
        pass
    used = await wait_for(lambda: _tokens(a, "alice", above=30))
    assert used > 30
    with pytest.raises(openai.RateLimitError) as ei:
        await chat(b)
    assert ei.value.body["message"] == "user: alice has exceeded TPM: 40"
    assert ei.value.response.headers["x-ratelimit-remaining-tokens"] == "0"


async def _tokens(gw, user, above):
    n = (await gw.gw.tenancy.state.usage(user))["tokens"]
    return n if n > above else 0


async def test_concurrency_is_counted_across_replicas(sims, gateway, redis_server):
    sim = await sims("vllm", "m", itl_ms=20.0)
    blocks = {"auth": KEYS, "limits": {"users": {"alice": {"max_concurrent": 1}}}, "state": state(redis_server)}
    a = await gateway([model_block("m", "vllm", [sim.url])], **blocks)
    b = await gateway([model_block("m", "vllm", [sim.url])], **blocks)
    async with openai_client(a, ALICE).chat.completions.with_streaming_response.create(
            model="m", messages=CHAT, max_tokens=500, stream=True) as resp:
        reader = resp.http_response.aiter_bytes()
        await reader.__anext__()
        with pytest.raises(openai.RateLimitError) as ei:
            await chat(b)
        assert ei.value.response.headers["x-error-concurrency-exceeded"] == "true"
    # the slot is released in Redis once A's stream is gone
    await wait_for(lambda: _concurrent_is(a, "alice", 0))
    assert (await chat(b)).choices


async def test_a_background_response_holds_its_slot_across_replicas_and_is_charged_once(sims, gateway, redis_server):
    """A background response created on one replica holds its user's slot for every replica until
    the creating one's poll finds it ended; the other replica's reads race that poll for what it
    owes, and the usage is charged once."""
    sim = await sims("vllm", "m", itl_ms=5.0, enable_responses_store=True)
    blocks = {"auth": KEYS, "limits": {"users": {"alice": {"tpm": 100_000, "max_concurrent": 1}}},
              "state": state(redis_server)}
    a = await gateway([model_block("m", "vllm", [sim.url])], **blocks)
    b = await gateway([model_block("m", "vllm", [sim.url])], **blocks)
    async with openai_client(a, ALICE) as ca, openai_client(b, ALICE) as cb:
        r = await ca.responses.create(model="m", input="Tell me about switchyards.", max_output_tokens=200,
                                      background=True)
        with pytest.raises(openai.RateLimitError) as ei:
            await chat(b)
        assert ei.value.response.headers["x-error-concurrency-exceeded"] == "true"

        async def ended():
            got = await cb.responses.retrieve(r.id)
            return got if got.status in ("completed", "incomplete") else None
        done = await wait_for(ended, timeout=30, interval=0.05)
        assert done and done.usage.output_tokens == 200
        assert await wait_for(lambda: _concurrent_is(a, "alice", 0), timeout=30)
        total = done.usage.input_tokens + done.usage.output_tokens
        assert await wait_for(lambda: _tokens(a, "alice", above=total - 1), timeout=30)
        await asyncio.sleep(0.2)
        assert (await a.gw.tenancy.state.usage("alice"))["tokens"] == total
        assert (await chat(b)).choices


async def _concurrent_is(gw, user, n):
    return (await gw.gw.tenancy.state.usage(user))["concurrent"] == n


async def _state_up(gw, up=True):
    return gw.gw.tenancy.state.up is up


async def test_redis_outage_fail_open_serves_counts_and_recovers(sims, gateway, redis_server):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"rpm": 2}}}, state=state(redis_server))
    assert (await chat(gw)).choices
    redis_server.kill()
    # the policy is open: served (unlimited) while Redis is gone, and counted
    assert await outcomes(chat(gw) for _ in range(4)) == [200] * 4
    assert gw.gw.tenancy.state.up is False
    text = await gw.metrics_text()
    assert 'switchyard_state_unavailable_total{policy="open",reason="unreachable"} 4.0' in text
    assert "switchyard_state_up 0.0" in text
    redis_server.start()
    assert await wait_for(lambda: _state_up(gw), timeout=10)
    # back to enforcing, against the fresh (empty) Redis
    assert await outcomes(chat(gw) for _ in range(3)) == [200, 200, "RateLimitError"]
    assert "switchyard_state_up 1.0" in await gw.metrics_text()


async def test_redis_outage_fail_closed_answers_503_and_recovers(sims, gateway, redis_server):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"rpm": 100}}},
                       state=state(redis_server, failure_policy="closed"))
    assert (await chat(gw)).choices
    redis_server.kill()
    for _ in range(2):
        with pytest.raises(openai.InternalServerError) as ei:
            await chat(gw)
        assert ei.value.status_code == 503 and ei.value.body["code"] == "service_unavailable"
        assert ei.value.response.headers["x-error-state-unavailable"] == "true"
        assert ei.value.response.headers["Retry-After"] == "1"
    # a user without limits needs no state: still served
    redis_server.start()
    assert await wait_for(lambda: _state_up(gw), timeout=10)
    assert (await chat(gw)).choices


async def _refuse_writes(r, server, refusal: str) -> None:
    """Make a running redis-server refuse writes and still answer reads, as one in production does."""
    if refusal == "oom":
        await r.config_set("maxmemory-policy", "noeviction")
        await r.config_set("maxmemory", 1)
    elif refusal == "readonly":
        await r.replicaof("127.0.0.1", listen_port())      # a replica of a primary that is not there
    elif refusal == "noreplicas":
        await r.config_set("min-replicas-to-write", 1)     # and it has none
    else:   # misconf: an RDB save fails (its directory is gone) with stop-writes-on-bgsave-error
        await r.config_set("save", "3600 1")
        shutil.rmtree(server.dir)
        await r.bgsave()

        async def save_failed() -> bool:
            return (await r.info("persistence"))["rdb_last_bgsave_status"] == "err"
        assert await wait_for(save_failed)


async def _take_writes(r, refusal: str) -> None:
    if refusal == "oom":
        await r.config_set("maxmemory", 0)
    elif refusal == "readonly":
        await r.replicaof("NO", "ONE")
    elif refusal == "noreplicas":
        await r.config_set("min-replicas-to-write", 0)
    else:
        await r.config_set("stop-writes-on-bgsave-error", "no")
        await r.config_set("save", "")          # a Redis that cannot save does not stop on SIGTERM


async def _state_up_metric(gw, value: float) -> bool:
    return f"switchyard_state_up {value}" in await gw.metrics_text()


@pytest.mark.parametrize(("refusal", "policy"), [("oom", "open"), ("readonly", "closed"), ("misconf", "open"),
                                                    ("noreplicas", "open")])
async def test_a_redis_that_refuses_writes_is_down_with_its_reason_and_clients_get_the_policy(
        sims, gateway, redis_server, refusal, policy):
    """A Redis that answers reads but refuses writes (out of memory, a replica, a failed save, a
    primary without the replicas it requires) counts no request: the gateway shows it as down,
    says why, answers clients as in an outage, and is back on the shared windows, which kept
    their counts, once Redis takes writes again."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS, limits={"users": {"alice": {"rpm": 2}}},
                       state=state(redis_server, failure_policy=policy))
    assert (await chat(gw)).choices
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        await _refuse_writes(r, redis_server, refusal)
        for _ in range(3):
            if policy == "open":
                assert (await chat(gw)).choices
            else:
                with pytest.raises(openai.InternalServerError) as ei:
                    await chat(gw)
                assert ei.value.status_code == 503 and ei.value.body["code"] == "service_unavailable"
                assert ei.value.response.headers["x-error-state-unavailable"] == "true"
                assert ei.value.response.headers["Retry-After"] == "1"
        text = await gw.metrics_text()
        assert "switchyard_state_up 0.0" in text
        assert f'switchyard_state_unavailable_total{{policy="{policy}",reason="{refusal}"}} 3.0' in text
        assert 'switchyard_state_outages_total{mode="standalone"} 1.0' in text
        await _take_writes(r, refusal)
        assert await wait_for(lambda: _state_up_metric(gw, 1.0), timeout=10)
        # the window kept its count from before: one more request, then the limit
        assert await outcomes(chat(gw) for _ in range(2)) == [200, "RateLimitError"]
    finally:
        with contextlib.suppress(redis.exceptions.RedisError):
            await _take_writes(r, refusal)      # a Redis that cannot save does not stop on SIGTERM
        await r.aclose()


async def test_a_redis_at_its_memory_limit_that_refuses_some_writes_is_logged_once_a_while(
        sims, gateway, redis_server):
    """A Redis at the edge of its maxmemory (noeviction) refuses one write and takes the next: the
    shared state goes down and up again with each. Every outage is counted, but one warning says
    it refuses writes and one line that it is back, not a pair each time: the outages that follow
    within ``OUTAGE_LOG_S`` of a logged one are logged with the next, as ``since_last``."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS, limits={"users": {"alice": {"rpm": 100}}},
                       state=state(redis_server))
    assert (await chat(gw)).choices
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        with structlog.testing.capture_logs() as logs:
            for _ in range(3):
                await _refuse_writes(r, redis_server, "oom")
                assert (await chat(gw)).choices
                assert await wait_for(lambda: _state_up_metric(gw, 0.0), timeout=10)
                await _take_writes(r, "oom")
                assert await wait_for(lambda: _state_up_metric(gw, 1.0), timeout=10)
        assert 'switchyard_state_outages_total{mode="standalone"} 3.0' in await gw.metrics_text()
        said = [x for x in logs if x["event"].startswith("shared state")]
        assert [x["event"] for x in said] == ["shared state refuses writes; failure policy applies",
                                              "shared state reachable"], said
    finally:
        await r.config_set("maxmemory", 0)
        await r.aclose()


async def _refuse_commands(r, refusal: str) -> None:
    """Make a running redis-server refuse the gateway's commands: its ACL user may no longer touch
    the gateway's keys (NOPERM), or another application wrote a key of the gateway's names as
    another type (WRONGTYPE)."""
    if refusal == "noperm":
        await r.execute_command("ACL", "SETUSER", "default", "resetkeys", "~elsewhere:*")
    else:
        await r.delete("switchyard:rpm:alice")
        await r.hset("switchyard:rpm:alice", "owner", "another-application")


async def _take_commands(r, refusal: str) -> None:
    if refusal == "noperm":
        await r.execute_command("ACL", "SETUSER", "default", "allkeys")
    else:
        await r.delete("switchyard:rpm:alice")


@pytest.mark.parametrize(("refusal", "after"), [("noperm", [200, "RateLimitError"]),
                                                 ("wrongtype", [200, 200, "RateLimitError"])])
async def test_a_redis_that_refuses_the_gateways_commands_is_down_with_its_reason_and_clients_are_served(
        sims, gateway, redis_server, monkeypatch, refusal, after):
    """A Redis that answers the gateway's calls with an error of the gateway's own making, not of
    the network's (its ACL user lost the permission to a key or command: NOPERM; another
    application wrote to the gateway's key names: WRONGTYPE), degrades as a Redis that refuses
    writes does: the requests it meets are served (failure_policy open) and counted under its
    reason, switchyard_state_up is 0 and the outage counted and logged once, and the gateway is back
    on the shared windows once Redis takes its commands again."""
    from gateway.tenants import redis_state

    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS, limits={"users": {"alice": {"rpm": 2}}},
                       state=state(redis_server))
    assert (await chat(gw)).choices
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        with structlog.testing.capture_logs() as logs:
            await _refuse_commands(r, refusal)
            assert await outcomes(chat(gw) for _ in range(3)) == [200] * 3
        text = await gw.metrics_text()
        assert "switchyard_state_up 0.0" in text
        assert f'switchyard_state_unavailable_total{{policy="open",reason="{refusal}"}} 3.0' in text
        assert 'switchyard_state_outages_total{mode="standalone"} 1.0' in text
        assert gw.gw.tenancy.state.down_reason == refusal
        said = [x for x in logs if x["event"].startswith("shared state refuses the gateway's commands")]
        assert len(said) == 1 and said[0]["reason"] == refusal, logs
        monkeypatch.setattr(redis_state, "REFUSAL_HOLD_S", 0.0)
        await _take_commands(r, refusal)
        assert await wait_for(lambda: _state_up_metric(gw, 1.0), timeout=10)
        assert await outcomes(chat(gw) for _ in range(len(after))) == after
    finally:
        with contextlib.suppress(redis.exceptions.RedisError):
            await _take_commands(r, refusal)
        await r.aclose()


async def test_a_slot_whose_release_a_key_of_another_type_refused_keeps_no_sync_from_the_directory(
        sims, gateway, redis_server):
    """A stream holds one of alice's slots when another application writes a string where her
    concurrency hash was: the slot's release is refused (WRONGTYPE), and each sync tries again to
    publish her count, refused as well. The rest of the sync goes on meanwhile: a user's limits
    changed through another replica apply on this one within its sync interval, and this one's
    count is published once the key is gone."""
    sim = await sims("vllm", "m", itl_ms=20.0)
    blocks = {"auth": {**KEYS, "admin_token": "admin-token-1"},
              "limits": {"users": {"alice": {"max_concurrent": 5}}}, "state": state(redis_server)}
    a = await gateway([model_block("m", "vllm", [sim.url])], **blocks)
    b = await gateway([model_block("m", "vllm", [sim.url])], **blocks)
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        async with aiohttp.ClientSession() as s:
            held = await s.post(a.base_url + "/chat/completions", headers={"Authorization": f"Bearer {ALICE}"},
                                json={"model": "m", "messages": CHAT, "max_tokens": 500, "stream": True})
            await held.content.readline()
            await r.delete("switchyard:conc:alice")
            await r.set("switchyard:conc:alice", "another application's value")
            held.close()
            assert await wait_for(lambda: _state_up_metric(a, 0.0), timeout=10)     # the release was refused
            async with s.put(b.url + "/admin/users/bob", json={"rpm": 1},
                             headers={"Authorization": "Bearer admin-token-1"}) as put:
                assert put.status == 201
        assert await wait_for(lambda: _limits_are(a, "bob", 1), timeout=10)
        await r.delete("switchyard:conc:alice")
        assert await wait_for(lambda: _conc_published(r, a), timeout=10)
    finally:
        await r.delete("switchyard:conc:alice")
        await r.aclose()


async def _limits_are(gw, user: str, rpm: int) -> bool:
    lim = gw.gw.tenancy.directory.limits_for(user)
    return lim is not None and lim.rpm == rpm


async def _conc_published(r, gw) -> bool:
    """The replica's count for alice is in her hash again: none (its one slot was released)."""
    return await r.exists("switchyard:conc:alice") == 0 and not gw.gw.tenancy.state._dirty


async def test_a_gateway_started_while_redis_restarts_waits_for_it_briefly_and_serves(sims, gateway, redis_server,
                                                                                      monkeypatch):
    """Redis refuses connections for a moment as the gateway starts (both restarted together): the
    gateway tries its first sync again (for up to a second; here five, so a slow machine's Redis
    start does not outlast it) instead of answering 503 (failure policy closed) until its next
    heartbeat, here 2 s later."""
    from gateway.tenants import service

    monkeypatch.setattr(service, "START_RETRY_S", 5.0)
    sim = await sims("vllm", "m")
    redis_server.kill()
    loop = asyncio.get_running_loop()
    back = loop.run_in_executor(None, lambda: (time.sleep(0.3), redis_server.start()))
    try:
        gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                           limits={"users": {"alice": {"rpm": 100}}},
                           state=state(redis_server, failure_policy="closed", sync_interval_s=2.0,
                                       replica_ttl_s=4.0))
    finally:
        await back
    assert gw.gw.tenancy.state.up is True
    assert (await chat(gw)).choices


async def test_a_redis_that_stops_answering_does_not_hang_requests(sims, gateway, redis_server):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"rpm": 100, "max_concurrent": 5}}},
                       state=state(redis_server, timeout_s=0.2))
    assert (await chat(gw)).choices
    redis_server.pause()            # connections are accepted, nothing is ever answered
    try:
        async with asyncio.timeout(10):     # a hang detector, not a latency assertion
            assert await outcomes(chat(gw) for _ in range(3)) == [200] * 3
        assert gw.gw.tenancy.state.up is False
    finally:
        redis_server.resume()
    assert await wait_for(lambda: _state_up(gw), timeout=10)
    assert (await chat(gw)).choices
    # slots taken before the freeze were released (or repaired) once Redis answered again
    assert await wait_for(lambda: _concurrent_is(gw, "alice", 0), timeout=5)


@pytest.mark.parametrize("loss", ["flush", "restart"])
async def test_a_redis_that_lost_its_data_gets_the_slots_in_flight_back(sims, gateway, redis_server, loss):
    """Redis loses every key and script while a request holds a concurrency slot: flushed under a
    gateway that never sees a call fail, or restarted (empty) between two calls. The gateway notices
    at its next sync (its heartbeat was gone), counts it, and publishes the slot again, so the
    user's limit still counts the request in flight; its scripts are loaded again (NOSCRIPT) on the
    way."""
    sim = await sims("vllm", "m", itl_ms=20.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"max_concurrent": 1}}}, state=state(redis_server))
    rid = gw.gw.tenancy.state.replica_id
    async with openai_client(gw, ALICE).chat.completions.with_streaming_response.create(
            model="m", messages=CHAT, max_tokens=500, stream=True) as resp:
        reader = resp.http_response.aiter_bytes()
        await reader.__anext__()
        if loss == "flush":
            r = aioredis.Redis.from_url(redis_server.url)
            await r.script_flush()
            await r.flushall()
            await r.aclose()
        else:
            redis_server.kill()
            redis_server.start()
        r = aioredis.Redis.from_url(redis_server.url)
        try:
            async def slot_published() -> bool:
                return await r.hget("switchyard:conc:alice", rid) == b"1"
            assert await wait_for(slot_published), "the slot in flight was not published again"
        finally:
            await r.aclose()
        assert 'switchyard_state_heartbeat_lost_total{mode="standalone"} 1.0' in await gw.metrics_text()
        with pytest.raises(openai.RateLimitError) as ei:
            await chat(gw)
        assert ei.value.response.headers["x-error-concurrency-exceeded"] == "true"
    assert await wait_for(lambda: _concurrent_is(gw, "alice", 0))
    assert (await chat(gw)).choices
    assert gw.gw.tenancy.state.up is True


async def test_tokens_an_outage_keeps_from_the_windows_are_counted_and_logged_at_most_every_10_s(
        sims, gateway, redis_server):
    """A standalone Redis that is down charges no tokens (its windows start afresh when it is
    back): each request's tokens are counted in switchyard_state_uncharged_tokens_total, and the
    warning that says so comes once, with the tally, not once per request."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"tpm": 10**6}}}, state=state(redis_server))
    first = await chat(gw)
    # charged after the answer: that charge landed before Redis goes, or it would be uncharged too
    assert await wait_for(lambda: _tokens(gw, "alice", above=first.usage.total_tokens - 1))
    redis_server.kill()
    with structlog.testing.capture_logs() as logs:
        got = [await chat(gw) for _ in range(5)]
        text = await wait_for(lambda: _uncharged_counted(gw, sum(r.usage.total_tokens for r in got)))
    warned = [x for x in logs if x["event"].startswith("tokens not charged")]
    assert len(warned) == 1, warned
    assert warned[0]["tokens"] == got[0].usage.total_tokens
    assert text, "the tokens the outage kept from the windows were not counted"


async def _uncharged_counted(gw, tokens: int) -> str | None:
    text = await gw.metrics_text()
    return text if f"switchyard_state_uncharged_tokens_total {float(tokens)}" in text else None


async def test_a_slot_a_stalled_redis_took_after_the_check_gave_up_is_given_back(sims, gateway, redis_server):
    """Redis stops (SIGSTOP) with a limit check sent to it: the check times out and the request is
    served under failure_policy open, but the check is still in Redis's socket, and runs when it
    resumes, taking a concurrency slot nobody holds (a Redis too slow for timeout_s does the same).
    The replica publishes its exact count once Redis is back, for that user too, so the user is not
    refused as at their limit for good."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       limits={"users": {"alice": {"max_concurrent": 1}, "bob": {"max_concurrent": 5}}},
                       state=state(redis_server, timeout_s=0.2))
    assert (await chat(gw, BOB)).choices        # Redis has the scripts (alice has had no request)
    st = gw.gw.tenancy.state
    # connections in the pool, so that the check goes out on one (a new one would wait for Redis's hello)
    assert await asyncio.gather(*(st.client.ping() for _ in range(4))) == [True] * 4
    redis_server.pause()
    try:
        assert (await chat(gw)).choices         # its check went to Redis and timed out: served open
        assert gw.gw.tenancy.state.up is False
    finally:
        redis_server.resume()
    assert await wait_for(lambda: _state_up(gw), timeout=10)
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        async def no_slot() -> bool:
            return not await r.hgetall("switchyard:conc:alice")
        assert await wait_for(no_slot), await r.hgetall("switchyard:conc:alice")
    finally:
        await r.aclose()
    assert (await chat(gw)).choices


async def test_least_request_sees_the_other_replicas_in_flight(sims, gateway, redis_server):
    s1 = await sims("vllm", "m", itl_ms=20.0)
    s2 = await sims("vllm", "m", itl_ms=20.0)
    urls = [s1.url, s2.url]
    a = await gateway([model_block("m", "vllm", urls)], state=state(redis_server))
    b = await gateway([model_block("m", "vllm", urls)], state=state(redis_server))
    async with contextlib.AsyncExitStack() as stack:
        readers = []
        for _ in range(3):          # A: 2 streams on one engine, 1 on the other
            resp = await stack.enter_async_context(openai_client(a, "x").chat.completions.with_streaming_response.create(
                model="m", messages=CHAT, max_tokens=500, stream=True))
            readers.append(resp.http_response.aiter_bytes())
            await readers[-1].__anext__()
        a_load = {ep.url: ep.in_flight for ep in a.gw.pool.endpoints()}
        assert sorted(a_load.values()) == [1, 2]
        # B learns A's counts through Redis
        assert await wait_for(lambda: {ep.url: ep.remote_in_flight for ep in b.gw.pool.endpoints()} == a_load)
        lighter = min(a_load, key=a_load.get).split("//")[1]
        async with aiohttp.ClientSession() as s:
            for _ in range(3):      # B alone would see a tie; with the fleet's view it is not one
                async with s.post(b.base_url + "/chat/completions",
                                  json={"model": "m", "messages": CHAT, "max_tokens": 1}) as r:
                    assert r.status == 200 and r.headers["target-pod"] == lighter
    assert await wait_for(lambda: all(ep.remote_in_flight == 0 for ep in b.gw.pool.endpoints()))


async def _two_admin_replicas(sims, gateway, redis_server):
    """Two replicas with the admin API on one Redis, and the admin's headers."""
    sim = await sims("vllm", "m")
    blocks = {"auth": {"enabled": True, "admin_token": "admin-token-1"}, "state": state(redis_server)}
    a = await gateway([model_block("m", "vllm", [sim.url])], **blocks)
    b = await gateway([model_block("m", "vllm", [sim.url])], **blocks)
    return a, b, {"Authorization": "Bearer admin-token-1"}


async def test_admin_changes_on_one_replica_apply_on_the_other(sims, gateway, redis_server):
    a, b, admin = await _two_admin_replicas(sims, gateway, redis_server)
    async with aiohttp.ClientSession(headers=admin) as s:
        async with s.post(a.url + "/admin/keys", json={"user": "erin"}) as r:
            assert r.status == 201
            created = await r.json()
        # usable on B at once, before B's next sync could have mirrored it
        assert (await chat(b, created["key"])).choices
        async with s.put(a.url + "/admin/users/erin", json={"rpm": 1}) as r:
            assert r.status == 201
        assert await wait_for(lambda: b.gw.tenancy.directory.limits_for("erin") is not None)
        assert await outcomes([chat(b, created["key"]), chat(b, created["key"])]) == [200, "RateLimitError"]
        async with s.delete(a.url + f"/admin/keys/{created['id']}") as r:
            assert r.status == 200
    assert await wait_for(lambda: b.gw.tenancy.directory.key(created["id"]) is None
                          and not b.gw.tenancy.directory.store_keys)
    with pytest.raises(openai.AuthenticationError):
        await chat(b, created["key"])


async def test_two_gateway_processes_share_one_limit(sims, redis_server, tmp_path):
    sim = await sims("vllm", "m")
    ports = [listen_port(), listen_port()]
    procs = []
    for i, port in enumerate(ports):
        cfg = {"listen": {"host": "127.0.0.1", "port": port}, "server": {"shutdown_grace_s": 2},
               "models": [model_block("m", "vllm", [sim.url])],
               "auth": KEYS, "limits": {"users": {"alice": {"rpm": 4}}},
               "state": {**state(redis_server), "replica_id": f"proc-{i}"}}
        path = tmp_path / f"gw{i}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        with open(tmp_path / f"gw{i}.log", "wb") as out:
            procs.append(subprocess.Popen([sys.executable, "-m", "gateway", "--config", str(path)], cwd=ROOT,
                                          stdout=out, stderr=subprocess.STDOUT,
                                          env={**os.environ, "PYTHONPATH": str(ROOT)}))
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for u in urls:
            assert await wait_for(lambda u=u: _healthy(u), timeout=30), "gateway process did not start"

        class Proc:
            def __init__(self, url):
                self.base_url = url + "/v1"
        gws = [Proc(u) for u in urls]
        got = await outcomes([chat(gws[0]) for _ in range(4)] + [chat(gws[1]) for _ in range(4)])
        r = aioredis.Redis.from_url(redis_server.url)

        async def both_registered() -> bool:
            # a replica silent for replica_ttl_s (a process descheduled on a busy machine) is
            # dropped from the set until its next heartbeat puts it back
            # (a process of several workers, server.workers: auto on a machine of several CPUs,
            # registers each as proc-<i>/<worker>)
            members = {m.decode().partition("/")[0] for m in await r.zrange("switchyard:replicas", 0, -1)}
            return members == {"proc-0", "proc-1"}
        replicas = await wait_for(both_registered, timeout=10)
        await r.aclose()
    finally:
        await interrupt(procs, 15)
    # checked once the processes have stopped, so that their logs are whole if it fails
    assert got.count(200) == 4 and got.count("RateLimitError") == 4, _unusual(tmp_path, 2)
    assert replicas, "the two gateway processes are not both registered as replicas"


def _unusual(tmp_path: Path, n: int) -> str:
    """What the gateway processes wrote that a passing run does not: answers other than 200 and
    429, an endpoint's health change, warnings, errors, a worker's restart (to tell a failure's
    cause from its log alone)."""
    lines = []
    for i in range(n):
        for line in (tmp_path / f"gw{i}.log").read_text(errors="replace").splitlines():
            if '"status":200,' in line or '"status":429,' in line \
                    or ('"level":"info"' in line and '"event":"request"' not in line
                        and '"event":"endpoint health changed"' not in line):
                continue
            lines.append(f"gw{i}: {line}")
    return "\n".join(lines)[-8000:]


async def _healthy(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


async def test_a_redis_restart_leaves_no_stale_pooled_connection(redis_server):
    """Every idle pooled connection is to the Redis that died: each is reconnected when taken from
    the pool, so no call after the restart fails on one (a request served uncounted, or a 503)."""
    st = RedisState(StateConfig(redis_url=redis_server.url, timeout_s=0.5))
    try:
        assert await asyncio.gather(*(st.client.ping() for _ in range(5))) == [True] * 5  # 5 in the pool
        redis_server.kill()         # the kernel has queued each connection's FIN when this returns
        await asyncio.sleep(0.05)   # a few loop turns to read them, as a serving gateway's loop would
        redis_server.start()
        assert await asyncio.gather(*(st.client.ping() for _ in range(5))) == [True] * 5
    finally:
        await st.stop()


async def test_requests_counted_during_an_outage_are_added_once_whatever_breaks(redis_server):
    """What was served while the state was unreachable is added once it is back, exactly once:
    - a reconcile call that breaks before it is sent (the client library raises AttributeError
      when a connection is closed under a call sending on it, as a Cluster client does after a
      failure) keeps the counts for the next sync and marks the state down;
    - one that Redis ran but whose answer was lost is sent again and adds nothing twice."""
    st = RedisState(StateConfig(redis_url=redis_server.url, timeout_s=0.5))
    st.reconcile = True                 # as with a Cluster or Sentinel; standalone does not reconcile
    q = AdmitQuery("alice", UserLimits(rpm=1000), "m")
    real = st.client.execute_command
    faults: list[str] = []

    async def faulty(*args, **kw):
        if args[:2] == ("EVALSHA", st._sha[RECONCILE]) and faults:
            fault = faults.pop(0)
            if fault == "unsent":
                raise AttributeError("'NoneType' object has no attribute 'writelines'")
            await real(*args, **kw)     # "lost": Redis runs it, the answer never arrives
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return await real(*args, **kw)

    st.client.execute_command = faulty
    rpm_key = st._user_keys("alice")[0]
    try:
        await st.sync(None)             # up
        for fault, served, total in (("unsent", 7, 7), ("lost", 5, 12)):
            for _ in range(served):
                st.served_unchecked(q)
            assert st.unreconciled == 1
            faults.append(fault)
            with pytest.raises(StateUnavailable):
                await st.sync(None)
            assert not faults and not st.up and st.unreconciled == 1    # kept, and an outage
            await st.sync(None)
            assert st.up and st.unreconciled == 0
            assert int(await st.client.get(rpm_key)) == total
    finally:
        await st.stop()


def test_a_connection_closed_under_a_call_is_an_outage_on_uvloop(redis_server):
    """A Cluster client closes every connection when one call fails, so other calls can be half-way
    on one: on uvloop, the gateway's loop, a write to it raises uvloop's RuntimeError ("the handler
    is closed"). The Responses store takes that as a lost connection (where it was a 500) and sends
    the call again, on a new one; the tenancy backend takes it as an outage."""
    async def run() -> None:
        cfg = StateConfig(redis_url=redis_server.url, timeout_s=0.5)
        store = RedisStore(redis_client(cfg), "t:resp:", 60, cfg.timeout_s, owns_client=True)
        st = RedisState(cfg)
        try:
            await store.put("a", b"1")
            await st.sync(None)
            assert st.up
            _close_under(store.client)
            await store.put("b", b"2")
            assert await store.get("b") == b"2"
            _close_under(st.client)
            with pytest.raises(StateUnavailable):
                await st.sync(None)
            assert not st.up
            await st.sync(None)                              # and the next call reconnects
            assert st.up
        finally:
            await store.close()
            await st.stop()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())


def _close_under(client) -> None:
    """Close a client's pooled connections under it, before the loop tells the client (its next
    call, made at once, writes to them)."""
    for conn in client.connection_pool._available_connections:
        conn._writer.transport.close()


async def test_a_responses_store_outage_is_a_503_that_names_no_address(sims, gateway, redis_server):
    """The store's address and its client's error are the operator's (logged), not the client's."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], state=state(redis_server),
                       responses={"state": "gateway"})
    async with openai_client(gw) as c:
        r = await c.responses.create(model="m", input="Hello", max_output_tokens=3)
        redis_server.kill()
        with pytest.raises(openai.InternalServerError) as ei:
            await c.responses.retrieve(r.id)
    assert ei.value.status_code == 503 and ei.value.body["code"] == "service_unavailable"
    assert "127.0.0.1" not in ei.value.body["message"] and "Error" not in ei.value.body["message"]


async def test_a_responses_record_the_gateway_cannot_read_is_a_response_it_does_not_hold(sims, gateway, redis_server):
    """A record under the gateway's Responses keys that is not one it wrote (not JSON, or not a
    record's shape: another application's value, a corrupted one) is an id the store does not hold:
    gateway-held history answers 404 and a follow-up the 400 previous_response_not_found an agent
    resends its conversation on; engine state finds the owner in the routing view's lineage, as for
    a record Redis lost. Never a 500."""
    sim = await sims("vllm", "m", enable_responses_store=True)
    values = (b"not json", b"[1, 2]", b'{"model": 3, "url": 4}', b'{"input": 5, "output": "x", "model": "m"}')
    rc = aioredis.from_url(redis_server.url)
    try:
        for mode, kind in (("gateway", "hist"), ("engine", "owner")):
            gw = await gateway([model_block("m", "vllm", [sim.url])], state=state(redis_server),
                               responses={"state": mode})
            c = openai_client(gw)
            r = await c.responses.create(model="m", input="Hello", max_output_tokens=2)
            for value in values:
                await rc.set(f"switchyard:resp:{kind}:{r.id}", value)
                if mode == "engine":
                    assert (await c.responses.retrieve(r.id)).id == r.id
                    await c.responses.create(model="m", input="x", previous_response_id=r.id, max_output_tokens=1)
                    continue
                for call in (c.responses.retrieve(r.id), c.responses.input_items.list(r.id)):
                    with pytest.raises(openai.NotFoundError):
                        await call
                with pytest.raises(openai.BadRequestError) as ei:
                    await c.responses.create(model="m", input="x", previous_response_id=r.id, max_output_tokens=1)
                assert ei.value.body["code"] == "previous_response_not_found"
    finally:
        await rc.aclose()


async def test_admin_creates_and_changes_are_decided_by_the_store_not_a_stale_mirror(sims, gateway, redis_server):
    """The admin API checks and writes in one step on the store: a replica whose mirror has not
    seen another's create or revoke yet (two admin calls racing) answers 409 / 404, instead of a
    second 201 that overwrote the first or a rename that brought a revoked key back."""
    a, b, admin = await _two_admin_replicas(sims, gateway, redis_server)
    async with aiohttp.ClientSession(headers=admin) as s:
        async with s.post(a.url + "/admin/keys", json={"user": "mallory"}) as r:
            created = await r.json()
        assert await wait_for(lambda: b.gw.tenancy.directory.key_by_id(created["id"]) is not None)

        async def stale() -> None:       # B's mirror stops following the store: the race, held open
            pass
        b.gw.tenancy.refresh = stale
        async with s.delete(a.url + f"/admin/keys/{created['id']}") as r:
            assert r.status == 200
        async with s.patch(b.url + f"/admin/keys/{created['id']}", json={"name": "renamed"}) as r:
            assert r.status == 404
        async with s.post(a.url + "/admin/users", json={"name": "erin", "rpm": 10}) as r:
            assert r.status == 201
        async with s.post(b.url + "/admin/users", json={"name": "erin", "rpm": 99}) as r:
            assert r.status == 409
        async with s.post(a.url + "/admin/keys", json={"user": "alice", "key": "sk-same-text-0000001"}) as r:
            assert r.status == 201
        async with s.post(b.url + "/admin/keys", json={"user": "mallory", "key": "sk-same-text-0000001"}) as r:
            assert r.status == 409
    r = aioredis.Redis.from_url(redis_server.url)
    assert not [d for d in await r.hkeys("switchyard:keys") if d.decode().startswith(created["id"])]
    assert yaml.safe_load(await r.hget("switchyard:users", "erin"))["rpm"] == 10
    assert yaml.safe_load(await r.hget("switchyard:keys", key_digest("sk-same-text-0000001")))["user"] == "alice"
    await r.aclose()
    with pytest.raises(openai.AuthenticationError):         # revoked, and stays so
        await chat(a, created["key"])


async def test_usage_does_not_count_the_slots_of_a_replica_that_died(sims, gateway, redis_server):
    """A replica killed with requests in flight leaves its slots in the user's concurrency hash;
    the limit check skips them once it stops heartbeating, and so does the admin API's usage."""
    sim = await sims("vllm", "m")
    blocks = {"auth": {**KEYS, "admin_token": "admin-token-1"},
              "limits": {"users": {"alice": {"max_concurrent": 3}}}, "state": state(redis_server)}
    a = await gateway([model_block("m", "vllm", [sim.url])], **blocks)
    r = aioredis.Redis.from_url(redis_server.url)
    await r.zadd("switchyard:replicas", {"dead-replica": 1})       # last heard of long ago
    await r.hset("switchyard:conc:alice", "dead-replica", 2)
    await r.aclose()
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer admin-token-1"}) as s, \
            s.get(a.url + "/admin/users/alice") as resp:
        assert resp.status == 200
        assert (await resp.json())["usage"]["concurrent"] == 0
    assert (await a.gw.tenancy.state.usage("alice"))["concurrent"] == 0


async def test_a_replica_started_again_under_its_configured_id_holds_none_of_the_slots_its_last_run_held(
        redis_server):
    """A configured replica id names a replica the same from one run to the next (a worker the
    parent starts again after it died, as <replica_id>/<index>; a pod restarted under its name). A
    run that died with requests in flight left its slots under that name in the users' concurrency
    hashes; the next run heartbeats under it, so they would count as its own for as long as it
    runs: a user of max_concurrent 2 who had 2 requests on the worker that died could never run
    one again. The next run's first heartbeat takes them out."""
    cfg = StateConfig(redis_url=redis_server.url, **FAST_STATE)
    lim = UserLimits(max_concurrent=2)
    q = AdmitQuery("alice", lim, "m")
    old = RedisState(cfg, replica_id="gw-a/0")
    try:
        await old.sync({})
        assert [(await old.admit(q)).acquired for _ in range(2)] == [True, True]
    finally:
        await old.stop()                    # dies: no settle, no farewell
    new = RedisState(cfg, replica_id="gw-a/0")
    try:
        await new.sync({})
        got = [await new.admit(q) for _ in range(2)]
        assert [(r.reason, r.acquired) for r in got] == [(None, True), (None, True)]
        assert (await new.usage("alice"))["concurrent"] == 2
        new.settle("alice", 0, True)
        new.settle("alice", 0, True)
        r = aioredis.Redis.from_url(redis_server.url)
        try:
            async def released() -> bool:
                return not await r.hgetall("switchyard:conc:alice")
            assert await wait_for(released), await r.hgetall("switchyard:conc:alice")
        finally:
            await r.aclose()
    finally:
        await new.stop()


async def test_slots_published_again_after_a_redis_restart_are_taken_out_by_the_next_run_too(redis_server):
    """Redis lost its data (a restart, a flush) and the replica published the slots it holds again;
    it then died with them. The next run under its name takes those out as well."""
    cfg = StateConfig(redis_url=redis_server.url, **FAST_STATE)
    q = AdmitQuery("alice", UserLimits(max_concurrent=2), "m")
    old = RedisState(cfg, replica_id="gw-a/0")
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        await old.sync({})
        assert (await old.admit(q)).acquired
        await r.flushall()
        await old.sync({})                  # its heartbeat is gone: its slot is published again
        assert await r.hgetall("switchyard:conc:alice") == {b"gw-a/0": b"1"}
    finally:
        await old.stop()
    new = RedisState(cfg, replica_id="gw-a/0")
    try:
        await new.sync({})
        assert await r.hgetall("switchyard:conc:alice") == {}
        assert [(await new.admit(q)).acquired for _ in range(2)] == [True, True]
    finally:
        await new.stop()
        await r.aclose()


async def test_a_request_that_leaves_while_its_check_is_on_its_way_gives_its_counts_back(redis_server):
    """The client goes (its request cancelled) while the limit check is on its way to Redis, which
    runs it: the request passed and no engine saw it, so it gives back the counts it made in the
    user's RPM window and the model's RPS window, as one shed or refused before any engine does,
    besides its slot."""
    st = RedisState(StateConfig(redis_url=redis_server.url, **FAST_STATE))
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        await st.sync({})
        q = AdmitQuery("alice", UserLimits(rpm=5, max_concurrent=1), "m", model_rps=10)
        check = asyncio.create_task(st.admit(q))
        await asyncio.sleep(0)              # queued for this loop turn's pipeline
        check.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await check

        async def given_back() -> bool:
            got = await r.mget("switchyard:rpm:alice", "switchyard:rps:m")
            return got[0] is not None and all(int(v or 0) == 0 for v in got) \
                and not await r.hgetall("switchyard:conc:alice")
        assert await wait_for(given_back), await r.mget("switchyard:rpm:alice", "switchyard:rps:m")
    finally:
        await st.stop()
        await r.aclose()


async def test_a_request_that_leaves_as_its_check_is_answered_gives_its_slot_back(redis_server):
    """The client goes (its request cancelled) in the loop turn its check's answer came in: the
    answer woke nobody, so the slot it took in Redis is given back as an orphan's, not left held
    for good by a request that no longer runs."""
    st = RedisState(StateConfig(redis_url=redis_server.url, **FAST_STATE))
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        await st.sync({})
        q = AdmitQuery("alice", UserLimits(max_concurrent=1), "m")
        check = asyncio.create_task(st.admit(q))
        send = st._send

        async def answered_then_left(batch: list) -> None:
            await send(batch)               # the check's future has its answer: its task is woken ...
            check.cancel()                  # ... and cancelled before it runs

        st._send = answered_then_left       # type: ignore[method-assign]
        with contextlib.suppress(asyncio.CancelledError):
            await check
        assert check.cancelled()

        async def given_back() -> bool:
            return not await r.hgetall("switchyard:conc:alice")
        assert await wait_for(given_back), await r.hgetall("switchyard:conc:alice")
        assert st.held.get("alice", 0) == 0
        st._send = send                     # type: ignore[method-assign]
        assert (await st.admit(q)).acquired
    finally:
        await st.stop()
        await r.aclose()


async def _frozen(gw) -> None:
    """The replica's mirror stops following the store: a race between two admin calls, held open."""
    async def stale() -> None:
        pass
    gw.gw.tenancy.refresh = stale


async def test_patches_of_one_user_on_two_replicas_all_land(sims, gateway, redis_server):
    """A PATCH sets its fields in the record as the store holds it when the change runs, not in a
    copy its replica read earlier: concurrent PATCHes of one user, each setting another field, on
    two replicas, leave every field set (a read-modify-write put back the other fields' old values)."""
    a, b, admin = await _two_admin_replicas(sims, gateway, redis_server)
    fields = ("rpm", "tpm", "max_concurrent")
    async with aiohttp.ClientSession(headers=admin) as s:
        async with s.put(a.url + "/admin/users/pat", json={}) as r:
            assert r.status == 201
        assert await wait_for(lambda: b.gw.tenancy.directory.user_source("pat") == "store")
        await _frozen(b)                # B's copy of pat is all zeros from here on
        async with s.patch(a.url + "/admin/users/pat", json={"rpm": 7}) as r:
            assert r.status == 200
        async with s.patch(b.url + "/admin/users/pat", json={"tpm": 9}) as r:
            assert r.status == 200
        async with s.get(a.url + "/admin/users/pat") as r:
            assert (await r.json())["rpm"] == 7
        async with s.patch(a.url + "/admin/users/pat", json={"rpm": 2**63}) as r:   # not exact in the store's
            assert r.status == 400 and (await r.json())["error"]["param"] == "rpm"  # script: refused, not wrapped

        async def patch(i: int) -> int:
            async with s.patch((a, b)[i % 2].url + "/admin/users/pat", json={fields[i % 3]: 100 + i}) as r:
                return r.status
        assert set(await asyncio.gather(*(patch(i) for i in range(50)))) == {200}
        async with s.get(a.url + "/admin/users/pat") as r:
            final = await r.json()
    # each field holds what one of its PATCHes set; none is back at 0
    for i, f in enumerate(fields):
        assert final[f] in {100 + j for j in range(i, 50, 3)}, final
    r = aioredis.Redis.from_url(redis_server.url)
    assert set(yaml.safe_load(await r.hget("switchyard:users", "pat"))) == set(fields)
    await r.aclose()


async def test_a_users_delete_takes_the_key_another_replica_just_made(sims, gateway, redis_server):
    """DELETE /admin/users/{name} removes every key of the user the store holds when it runs, not
    the keys its replica's copy knew: a key made on another replica a moment before is revoked
    too, and a PATCH or a second DELETE after it is a 404, not a user brought back."""
    a, b, admin = await _two_admin_replicas(sims, gateway, redis_server)
    async with aiohttp.ClientSession(headers=admin) as s:
        async with s.put(a.url + "/admin/users/dan", json={"rpm": 5}) as r:
            assert r.status == 201
        assert await wait_for(lambda: b.gw.tenancy.directory.user_source("dan") == "store")
        await _frozen(b)                # B does not see the keys A makes
        made = []
        for _ in range(3):
            async with s.post(a.url + "/admin/keys", json={"user": "dan"}) as r:
                assert r.status == 201
                made.append(await r.json())
        async with s.delete(b.url + "/admin/users/dan") as r:
            assert r.status == 200 and (await r.json())["keys_deleted"] == 3
        async with s.patch(b.url + "/admin/users/dan", json={"rpm": 1}) as r:
            assert r.status == 404
        async with s.delete(b.url + "/admin/users/dan") as r:
            assert r.status == 404
        async with s.get(a.url + "/admin/keys?user=dan") as r:
            assert (await r.json())["data"] == []
    r = aioredis.Redis.from_url(redis_server.url)
    assert await r.hgetall("switchyard:keys") == {} and await r.hgetall("switchyard:users") == {}
    await r.aclose()
    for k in made:
        with pytest.raises(openai.AuthenticationError):
            await chat(a, k["key"])


async def _store_keys(r, n: int, logged: bool = False) -> None:
    """``n`` key records written straight into the store and the directory's version bumped once:
    as a replica of an older release writes (no change log), or ``logged`` as one change."""
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        pipe.hset("switchyard:keys", f"{i:064x}", orjson.dumps({"user": f"u{i % 100}", "name": "", "created": 1.0}))
    await pipe.execute()
    version = await r.incr("switchyard:version")
    if logged:
        await r.zadd("switchyard:dirlog", {f"{version}:seed:0:": version})


# a mirror's whole read of the directory, as MONITOR shows the client's command
_WHOLE_READ = "EVALSHA " + hashlib.sha1(WHOLE_DIRECTORY.encode()).hexdigest().upper()


class _DirectoryReads:
    """Counts the whole-directory reads the Redis server runs while it is open, by ``MONITOR``: a
    mirror's (the ``WHOLE_DIRECTORY`` script, or an ``HGETALL`` of the keys hash by a client), or
    with ``by_script`` an ``HGETALL`` of the keys hash inside any script."""

    def __init__(self, url: str, by_script: bool = False) -> None:
        self.url = url
        self.by_script = by_script         # count the reads scripts make instead
        self.count = 0
        self.marked = False

    async def __aenter__(self) -> _DirectoryReads:
        self._r = aioredis.Redis.from_url(self.url)
        self._monitor = await self._r.monitor().__aenter__()
        self._task = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        while True:
            cmd = await self._monitor.next_command()
            self.marked = self.marked or cmd["command"] == "ECHO directory-reads-mark"
            command = cmd["command"].upper()
            if self.by_script:
                counted = cmd["client_type"] == "lua" and command.startswith("HGETALL SWITCHYARD:KEYS")
            else:
                counted = cmd["client_type"] != "lua" and (command.startswith("HGETALL SWITCHYARD:KEYS")
                                                           or command.startswith(_WHOLE_READ))
            self.count += counted

    async def mark(self) -> None:
        """Wait until the monitor has read what the server ran so far (up to a command of our own)."""
        await self._r.execute_command("ECHO", "directory-reads-mark")
        assert await wait_for(lambda: self.marked, timeout=10)

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._monitor.__aexit__(*exc)
        await self._r.aclose()


async def test_a_directory_change_is_mirrored_without_reading_every_key(sims, gateway, redis_server):
    """With thousands of keys in the store, a key created, changed or revoked through the admin API
    reaches every replica's mirror by what changed, not by a read of the whole directory in every
    process (each such read grew with the keys: at 20,000, 100 ms and more of each process's event
    loop per change, Redis calls that timed out, and limits that went open under a stream of creates)."""
    r = aioredis.Redis.from_url(redis_server.url)
    await _store_keys(r, 3000, logged=True)
    a, b, admin = await _two_admin_replicas(sims, gateway, redis_server)
    assert len(b.gw.tenancy.directory.store_keys) == 3000          # read whole at start
    made = []
    async with _DirectoryReads(redis_server.url) as reads, aiohttp.ClientSession(headers=admin) as s:
        for i in range(10):
            async with s.post(a.url + "/admin/keys", json={"user": f"new{i}"}) as resp:
                assert resp.status == 201
                made.append(await resp.json())
        async with s.put(a.url + "/admin/users/new0", json={"rpm": 1}) as resp:
            assert resp.status == 201
        async with s.patch(a.url + f"/admin/keys/{made[1]['id']}", json={"user": "new0"}) as resp:
            assert resp.status == 200
        async with s.delete(a.url + f"/admin/keys/{made[2]['id']}") as resp:
            assert resp.status == 200
        async with s.delete(a.url + "/admin/users/new0") as resp:
            assert resp.status == 200 and (await resp.json())["keys_deleted"] == 2
        d = b.gw.tenancy.directory

        def mirrored() -> bool:        # the end state, which no state on the way to it matches
            return (len(d.store_keys) == 3000 + 7 and d.user_source("new0") is None
                    and all(d.key(key_digest(m["key"])) is None for m in made[:3])
                    and all(d.key(key_digest(m["key"])) is not None for m in made[3:]))

        assert await wait_for(mirrored)
        await reads.mark()
        assert reads.count == 0
    for gone in made[:3]:
        with pytest.raises(openai.AuthenticationError):
            await chat(b, gone["key"])
    assert (await chat(b, made[3]["key"])).choices
    assert d.key(key_digest(made[3]["key"])).user == "new3"
    await r.aclose()


async def test_a_users_delete_reads_the_users_keys_not_the_directory(sims, gateway, redis_server):
    """DELETE /admin/users/{name} finds the user's keys in the store's index by user, not by a read
    of every key record inside the write (at 20,000 keys that read held Redis for 67 ms, every
    replica's limits waiting on it); keys written since by anything that keeps no index (a replica
    of an older release) are still taken, the index being made again once before the delete."""
    r = aioredis.Redis.from_url(redis_server.url)
    await _store_keys(r, 3000, logged=True)              # u0..u99, 30 keys each, no index yet
    a, b, admin = await _two_admin_replicas(sims, gateway, redis_server)
    async with aiohttp.ClientSession(headers=admin) as s:
        for user in ("u7", "u70", "u8"):
            async with s.put(a.url + f"/admin/users/{user}", json={"rpm": 100}) as resp:
                assert resp.status == 201           # the first write makes the index, once
        async with s.post(a.url + "/admin/keys", json={"user": "u7"}) as resp:
            assert resp.status == 201
            made = await resp.json()
        async with s.post(a.url + "/admin/keys", json={"user": "u8"}) as resp:
            moved = await resp.json()
        async with s.patch(a.url + f"/admin/keys/{moved['id']}", json={"user": "u70"}) as resp:
            assert resp.status == 200
        async with _DirectoryReads(redis_server.url, by_script=True) as reads:
            async with s.delete(b.url + "/admin/users/u7") as resp:
                assert resp.status == 200 and (await resp.json())["keys_deleted"] == 31
            async with s.delete(b.url + "/admin/users/u70") as resp:   # not u7's 'u70 ...' entries
                assert resp.status == 200 and (await resp.json())["keys_deleted"] == 31
            await reads.mark()
            assert reads.count == 0
        # a key record written the old way, with no index entry: the next write indexes it first
        await r.hset("switchyard:keys", "f" * 64, orjson.dumps({"user": "u8", "name": "", "created": 1.0}))
        await r.incr("switchyard:version")
        async with s.delete(a.url + "/admin/users/u8") as resp:
            assert resp.status == 200 and (await resp.json())["keys_deleted"] == 31
    left = {k.decode(): orjson.loads(v)["user"] for k, v in (await r.hgetall("switchyard:keys")).items()}
    assert len(left) == 3000 + 3 - 31 * 3
    assert not {"u7", "u70", "u8"} & set(left.values())
    assert key_digest(made["key"]) not in left and key_digest(moved["key"]) not in left
    with pytest.raises(openai.AuthenticationError):
        await chat(b, made["key"])
    await r.aclose()


async def test_a_mirror_is_read_whole_when_the_change_log_cannot_say_what_changed(sims, gateway, redis_server):
    """A replica follows the store's change log only while the log holds every version since its
    mirror's, of the history it read: a change written without a log entry (a replica of an older
    release) or a store that lost its data and was written again (a restart) has the mirror read
    whole, so a key the store no longer holds does not stay valid in it."""
    a, b, admin = await _two_admin_replicas(sims, gateway, redis_server)
    r = aioredis.Redis.from_url(redis_server.url)
    d = b.gw.tenancy.directory
    async with aiohttp.ClientSession(headers=admin) as s:
        async with s.post(a.url + "/admin/keys", json={"user": "erin"}) as resp:
            lost = await resp.json()
        assert await wait_for(lambda: d.key(key_digest(lost["key"])) is not None)
        await _store_keys(r, 2)                         # no log entry: read whole
        assert await wait_for(lambda: len(d.store_keys) == 3)
        redis_server.kill()
        redis_server.start()                            # empty: the key is gone from the store
        await r.aclose()
        r = aioredis.Redis.from_url(redis_server.url)
        assert await wait_for(lambda: a.gw.tenancy.state.up, timeout=10)
        for _ in range(3):                              # the version passes the mirror's again
            async with s.post(a.url + "/admin/keys", json={"user": "frank"}) as resp:
                assert resp.status == 201
                kept = await resp.json()
    assert await wait_for(lambda: d.key(key_digest(lost["key"])) is None and len(d.store_keys) == 3, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        await chat(b, lost["key"])
    assert (await chat(b, kept["key"])).choices
    await r.aclose()


@pytest.mark.timeout(90)
async def test_the_status_page_of_a_gateway_with_workers_shows_all_its_requests_in_flight_for_a_user(
        sims, redis_server, tmp_path):
    """With ``--workers 2`` each worker holds its own users' slots; the page, whichever worker
    answers it, shows the gateway's: its workers' added up, as it adds up their in-flight counts."""
    sim = await sims("vllm", "m")
    port = listen_port()
    admin = {"Authorization": "Bearer admin-token-0123"}
    cfg = {"listen": {"host": "127.0.0.1", "port": port}, "server": {"shutdown_grace_s": 1, "drain_delay_s": 0},
           "models": [model_block("m", "vllm", [sim.url])],
           "auth": {**KEYS, "admin_token": admin["Authorization"].removeprefix("Bearer ")},
           "limits": {"users": {"alice": {"max_concurrent": 10}}}, "state": state(redis_server)}
    path = tmp_path / "gw0.yaml"
    path.write_text(yaml.safe_dump(cfg))
    base = f"http://127.0.0.1:{port}"
    body = {"model": "m", "messages": CHAT, "max_tokens": 4, "stream": True}
    held = {"Authorization": f"Bearer {ALICE}", "x-sim-fault": "stall_before_first=inf"}

    async def pid_of(s: aiohttp.ClientSession) -> int | None:
        with contextlib.suppress(aiohttp.ClientError):
            async with s.get(f"{base}/status.json", headers=admin) as r:
                if r.status == 200:
                    return (await r.json())["gateway"]["pid"]
        return None

    async def pages() -> list[dict]:
        out = []
        for _ in range(8):          # new connections: the kernel hands them to either worker
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
                    s.get(f"{base}/status.json", headers=admin) as r:
                out.append(await r.json())
        return out

    with open(tmp_path / "gw0.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "--config", str(path), "--workers", "2"], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    sessions: list[aiohttp.ClientSession] = []
    streams = []
    try:
        # three streams held by the engine: two on one worker, one on the other (a keep-alive
        # connection stays with the worker that accepted it, which its status page names)
        on: dict[int, int] = {}         # the first worker met takes two, the other one
        async with asyncio.timeout(40):
            while sorted(on.values()) != [1, 2]:
                s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
                pid = await pid_of(s)
                if pid is None or on.get(pid, 0) >= (2 if not on or pid == next(iter(on)) else 1):
                    await s.close()
                    await asyncio.sleep(0.05)
                    continue
                sessions.append(s)
                r = await s.post(f"{base}/v1/chat/completions", json=body, headers=held)
                assert r.status == 200
                streams.append(r)
                on[pid] = on.get(pid, 0) + 1
        async with asyncio.timeout(10):
            while len(sim.engine.running) + len(sim.engine.waiting) < 3:
                await asyncio.sleep(0.05)
        seen = set()
        for doc in await pages():
            assert doc["gateway"]["workers"]["reporting"] == 2
            seen.add(doc["gateway"]["pid"])
            alice = next(u for u in doc["tenants"]["users"] if u["name"] == "alice")
            assert alice["usage"]["concurrent"] == 3, (doc["gateway"]["pid"], on, alice)
        assert seen <= set(on)
        for r in streams:
            r.close()
        async with asyncio.timeout(10):     # and back to none once they end
            while any(next(u for u in d["tenants"]["users"] if u["name"] == "alice")["usage"]["concurrent"]
                      for d in await pages()):
                await asyncio.sleep(0.1)
    finally:
        for r in streams:
            r.close()
        for s in sessions:
            await s.close()
        await interrupt([proc], 15)


async def test_directory_notices_are_read_again_after_a_redis_restart(sims, gateway, redis_server):
    """A Redis that restarts (empty) stops every replica's reader of the directory's notices; each
    reads again by itself once Redis is back, and takes the next change in as it is written."""
    a, b, admin = await _two_admin_replicas(sims, gateway, redis_server)
    readers = [g.gw.tenancy.notices for g in (a, b)]
    async with aiohttp.ClientSession(headers=admin) as s:
        for i in range(3):
            async with s.post(a.url + "/admin/keys", json={"user": f"u{i}"}) as r:
                assert r.status == 201
        redis_server.kill()
        assert await wait_for(lambda: not any(n.up for n in readers), timeout=10)
        redis_server.start()
        assert await wait_for(lambda: all(n.up for n in readers) and a.gw.tenancy.state.up and b.gw.tenancy.state.up,
                              timeout=10)
        before = await _notices(b)
        async with s.post(a.url + "/admin/keys", json={"user": "erin"}) as r:
            assert r.status == 201
            created = await r.json()


    async def read_by_b() -> bool:
        return await _notices(b) > before
    assert await wait_for(read_by_b, timeout=5)
    assert b.gw.tenancy.directory.key_by_id(created["id"]) is not None


async def _notices(gw) -> float:
    """The directory change notices the gateway applied."""
    for line in (await gw.metrics_text()).splitlines():
        if line.startswith("switchyard_directory_notices_total "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_heartbeat_publishes_the_admin_token_and_drops_those_of_replicas_without_a_heartbeat(redis_server):
    """P:admintokens holds the admin token (its SHA-256) of the replicas that heartbeat: a heartbeat
    writes its own and takes out every other whose replica has none (gone past replica_ttl_s, or
    left the shared state while a publication was on its way), and a replica that leaves takes its
    own out."""
    st = RedisState(StateConfig(redis_url=redis_server.url, timeout_s=0.5), replica_id="r1")
    other = RedisState(StateConfig(redis_url=redis_server.url, timeout_s=0.5), replica_id="r2")
    st.admin_digest, other.admin_digest = key_digest("token-one-0123456789"), key_digest("token-two-0123456789")
    try:
        await other.sync(None)
        await st.client.hset(st.k_admin_tokens, "gone", key_digest("token-gone-0123456789"))
        await st.sync(None)
        assert await st.admin_digests() == {st.admin_digest, other.admin_digest}
        await other.leave()
        assert await st.admin_digests() == {st.admin_digest}
    finally:
        await other.stop()
        await st.stop()
