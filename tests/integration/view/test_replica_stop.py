"""A gateway's stop is never held by the routing view's Redis stream: its loops end when stopped,
also when the Redis client turns the cancel into an error of its own (which the loops would
otherwise take for an outage and retry), and when Redis accepts connections but never answers."""

from __future__ import annotations

import asyncio
import time

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException

from gateway.config.schema import StateConfig
from gateway.observability.metrics import GatewayMetrics
from gateway.view import replicas
from gateway.view.config import ViewConfig
from gateway.view.metrics import ViewMetrics


def _link(url: str) -> replicas.ReplicaLink:
    state = StateConfig(redis_url=url, timeout_s=0.2)
    return replicas.ReplicaLink(state, ViewConfig(retry_s=0.05, read_block_s=0.2), "s-1", None,
                                lambda payload, live: None, ViewMetrics(GatewayMetrics()))


async def test_a_cancel_the_client_turns_into_an_error_still_stops_the_loops(monkeypatch):
    link = _link("redis://127.0.0.1:1/0")
    turned = []

    async def info(*a, **kw):      # a client that catches the cancel and raises a connection error
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            turned.append(1)
            raise RedisConnectionError("connection closed while reading") from None

    monkeypatch.setattr(link.reader, "info", info)
    link.start()
    await asyncio.sleep(0.1)                        # the reader is waiting in info()
    t0 = time.monotonic()
    await asyncio.wait_for(link.stop(), 10)
    assert turned == [1] and time.monotonic() - t0 < 2.0
    assert link._tasks == []


async def test_cluster_nodes_out_of_reach_are_an_outage_not_a_bug(monkeypatch, caplog):
    link = _link("redis://127.0.0.1:1/0")
    calls = []

    async def info(*a, **kw):
        calls.append(1)
        raise RedisClusterException("Redis Cluster cannot be connected. Please provide at least one reachable node")

    monkeypatch.setattr(link.reader, "info", info)
    link.start()
    await asyncio.sleep(0.3)
    await link.stop()
    assert len(calls) >= 2 and not link.up
    assert "stream reader failed" not in caplog.text


async def test_a_redis_that_never_answers_does_not_hold_the_stop():
    async def silent(reader, writer):
        await asyncio.sleep(60)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    link = _link(f"redis://127.0.0.1:{port}/0")
    try:
        link.start()
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        await asyncio.wait_for(link.stop(), 10)
        assert time.monotonic() - t0 < replicas.STOP_WAIT_S * 2 + 1
        assert not link.up
    finally:
        server.close()
