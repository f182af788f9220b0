"""A TLS URL (``rediss://``, ``rediss+sentinel://``) for a real redis-server: one serving plain TCP
takes the connection and never answers the TLS handshake, which the error says in those words
(not the client library's "Timeout connecting to server", which reads as a Redis out of reach);
one serving TLS is reached as before; one whose certificate fails verification (an unknown CA, another
host's name) says so, and is not tried again."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess

import aiohttp
import pytest
import redis
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.apis.responses_state import RedisStore, StoreUnavailable
from gateway.config.schema import StateConfig
from gateway.state.redis import close_client, redis_client
from tests.support.factories import model_block
from tests.support.ports import listen_port
from tests.support.tls import CertificateAuthority
from tests.support.waiting import until


def _no_tls(port: int) -> str:
    return f"no TLS handshake answer from 127.0.0.1:{port}; is this Redis serving TLS? use redis:// for plain TCP"


async def test_a_rediss_url_for_a_plain_redis_says_it_got_no_tls_answer(redis_server):
    client = redis_client(StateConfig(redis_url=f"rediss://127.0.0.1:{redis_server.port}/0", timeout_s=0.5))
    try:
        with pytest.raises((RedisConnectionError, RedisTimeoutError)) as ei:
            await client.ping()
    finally:
        await close_client(client)
    assert str(ei.value) == _no_tls(redis_server.port)
    # what a Responses lookup's 503 logs, and its reason: no TLS answer, as tenancy says
    await _store_says_no_tls(f"rediss://127.0.0.1:{redis_server.port}/0", redis_server.port)


async def _store_says_no_tls(url: str, port: int) -> None:
    """A Responses store lookup at ``url`` (TLS, a plain-TCP Redis) fails for want of a TLS answer."""
    store = RedisStore(redis_client(StateConfig(redis_url=url, timeout_s=0.5)), "sy:resp:", ttl_s=60,
                       timeout_s=0.5, owns_client=True)
    try:
        with pytest.raises(StoreUnavailable) as si:
            await store.get("resp_1")
    finally:
        await store.close()
    assert _no_tls(port) in str(si.value) and si.value.reason == "no_tls"


async def test_a_rediss_sentinel_url_names_the_sentinel_that_gave_no_tls_answer(redis_server):
    client = redis_client(StateConfig(redis_url=f"rediss+sentinel://127.0.0.1:{redis_server.port}/mymaster",
                                      timeout_s=0.5))
    try:
        with pytest.raises(RedisConnectionError) as ei:
            await client.ping()
    finally:
        await close_client(client)
    assert _no_tls(redis_server.port) in str(ei.value)
    # what was tried: the primary's name, how many Sentinels, over TLS
    assert str(ei.value).startswith("No master found for 'mymaster' by 1 Sentinel over TLS ("), ei.value


async def test_a_rediss_url_for_a_redis_serving_tls_is_reached(tmp_path):
    ca = CertificateAuthority(tmp_path)
    leaf = ca.issue("127.0.0.1")
    port = listen_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path), "--tls-cert-file", str(leaf.cert),
         "--tls-key-file", str(leaf.key), "--tls-ca-cert-file", str(ca.cert), "--tls-auth-clients", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis_client(StateConfig(redis_url=f"rediss://127.0.0.1:{port}/0", tls_ca_file=str(ca.cert),
                                      timeout_s=1.0))
    try:
        async def up() -> bool:
            try:
                return bool(await client.ping())
            except (RedisConnectionError, RedisTimeoutError):
                return False
        await until(up, timeout=10)
        await client.set("k", b"v")
        assert await client.get("k") == b"v"
    finally:
        await close_client(client)
        proc.kill()
        proc.wait(timeout=10)


async def test_a_responses_store_at_a_rediss_url_for_a_plain_redis_says_no_tls(sims, gateway, redis_server):
    """The Responses store met at a rediss:// URL whose Redis serves plain TCP is down for want of
    a TLS handshake answer, as tenancy says (``no_tls``), not merely unreachable: in the store's
    failure, the 503 a lookup gets and the line it logs."""
    url = f"rediss://127.0.0.1:{redis_server.port}/0"
    await _store_says_no_tls(url, redis_server.port)
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], state={"redis_url": url, "timeout_s": 0.2},
                       responses={"state": "gateway", "backend": "redis"})
    with structlog.testing.capture_logs() as logs:
        async with aiohttp.ClientSession() as s, s.get(gw.url + "/v1/responses/resp_0123") as r:
            got = await r.json()
    assert r.status == 503 and r.headers["x-error-state-unavailable"] == "true", got
    assert "TLS" in got["error"]["message"] and "unreachable" in got["error"]["message"], got
    [line] = [x for x in logs if x["event"].startswith("responses state store")]
    assert line["event"] == "responses state store unreachable" and line["reason"] == "no_tls", line


async def test_a_responses_store_does_not_send_again_a_call_that_got_no_tls_answer(redis_server):
    """A TLS handshake that got no answer would get none on a second try: the store's call fails at
    its first connection, not after trying the plain Redis again (its connections, counted by the
    Redis, are the one of the failed call)."""
    plain = redis.Redis(port=redis_server.port)
    before = int(plain.info("stats")["total_connections_received"])
    await _store_says_no_tls(f"rediss://127.0.0.1:{redis_server.port}/0", redis_server.port)
    after = int(plain.info("stats")["total_connections_received"])
    plain.close()
    assert after - before == 1, after - before


@pytest.mark.parametrize(("host", "trusted", "why"), [
    ("127.0.0.1", False, "unable to get local issuer certificate"),     # state.tls_ca_file not set
    ("example.invalid", True, "IP address mismatch"),                            # another host's certificate
])
async def test_a_responses_store_does_not_send_again_a_call_whose_tls_certificate_fails_verification(
        tmp_path, host, trusted, why):
    """A TLS server whose certificate the gateway does not trust fails the same way on every try:
    the store's call fails at its first connection (the connections the server took: one), and its
    failure names the cause, with the reason ``tls_verify``."""
    ca = CertificateAuthority(tmp_path)
    ctx = ca.issue(host).server_context()
    accepted = 0

    async def take(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        with contextlib.suppress(OSError):
            await writer.start_tls(ctx)
        writer.close()

    port = listen_port()
    server = await asyncio.start_server(take, "127.0.0.1", port)
    cfg = StateConfig(redis_url=f"rediss://127.0.0.1:{port}/0", tls_ca_file=str(ca.cert) if trusted else None,
                      timeout_s=0.5)
    store = RedisStore(redis_client(cfg), "sy:resp:", ttl_s=60, timeout_s=0.5, owns_client=True)
    try:
        with pytest.raises(StoreUnavailable) as si:
            await store.get("resp_1")
    finally:
        await store.close()
        server.close()
        await server.wait_closed()
    assert accepted == 1, accepted
    assert si.value.reason == "tls_verify", si.value
    assert f"the TLS certificate of 127.0.0.1:{port} fails verification: " in str(si.value), si.value
    assert why in str(si.value), si.value
