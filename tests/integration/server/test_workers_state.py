"""``--workers N`` with the tenants' state in a real Redis: ``/metrics`` counts what the shared state
went through once for the gateway, whichever worker answers, though every worker meets it."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import redis.asyncio as aioredis
import yaml

from tests.integration.server.test_workers import children_of, own_metrics, sibling_sockets
from tests.support.gateway_process import gateway_process, get_new, metric_total, per_worker
from tests.support.ports import listen_port


def config(tmp_path, port: int, engine: str, redis_url: str):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": port},
        "server": {"drain_delay_s": 0, "log_level": "warning"},
        "limits": {"users": {"alice": {"rpm": 1000}}},
        "state": {"redis_url": redis_url, "sync_interval_s": 0.05},
        "models": [{"name": "m", "engine": "vllm", "endpoints": [engine]}]}))
    return cfg


@pytest.mark.timeout(90)
async def test_a_refusal_every_worker_meets_is_one_outage(sims, tmp_path, redis_server):
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = config(tmp_path, port, sim.url, redis_server.url)
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
            await r.config_set("maxmemory-policy", "noeviction")
            await r.config_set("maxmemory", 1)
            async with asyncio.timeout(30):     # each worker's sync met the refusal and counted it
                while {d["tenants"]["state_down_reason"] for d in (await per_worker(port, 2, "/status.json")).values()} \
                        != {"oom"}:
                    await asyncio.sleep(0.05)
            for _ in range(6):                  # whichever worker answers: one outage, the gateway's
                text = (await get_new(port, "/metrics"))[1]
                assert metric_total(text, "switchyard_state_up") == 0
                assert metric_total(text, "switchyard_state_outages_total", mode="standalone") == 1
    finally:
        await r.config_set("maxmemory", 0)
        await r.aclose()


@pytest.mark.timeout(90)
async def test_a_redis_every_worker_loses_is_one_loss(sims, tmp_path, redis_server):
    """The routing view's stream and the tenants' state, each worker's own link to them: one Redis
    that goes away is one loss of each."""
    sim = await sims("vllm", "m")
    port = listen_port()
    async with gateway_process(config(tmp_path, port, sim.url, redis_server.url), port, "--workers", "2",
                               ready_workers=2) as proc:
        sockets = sibling_sockets(children_of(proc.pid))
        assert len(sockets) == 2
        redis_server.kill()
        async with asyncio.timeout(30):         # each worker lost both on its own connections
            while True:
                own = [await own_metrics(path) for path in sockets.values()]
                if all(metric_total(t, "switchyard_view_redis_lost_total") == 1
                       and metric_total(t, "switchyard_state_outages_total") == 1 for t in own):
                    break
                await asyncio.sleep(0.05)
        for _ in range(6):                      # whichever worker answers: the gateway lost Redis once
            text = (await get_new(port, "/metrics"))[1]
            assert metric_total(text, "switchyard_view_redis_up") == 0
            assert metric_total(text, "switchyard_view_redis_lost_total") == 1
            assert metric_total(text, "switchyard_state_outages_total", mode="standalone") == 1


@pytest.mark.timeout(90)
async def test_a_configured_replica_id_names_each_worker_apart(sims, tmp_path, redis_server):
    """state.replica_id with --workers 2: each worker heartbeats and holds its slots under a name of
    its own, the configured one with its index, as the routing view names its senders."""
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = config(tmp_path, port, sim.url, redis_server.url)
    raw = yaml.safe_load(cfg.read_text())
    raw["state"]["replica_id"] = "gw-a"
    cfg.write_text(yaml.safe_dump(raw))
    r = aioredis.Redis.from_url(redis_server.url)
    seen: list[str] = []
    try:
        async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(20):     # both workers heartbeat every 50 ms
                    while seen != ["gw-a/0", "gw-a/1"]:
                        seen = sorted(m.decode() for m in await r.zrange("switchyard:replicas", 0, -1))
                        await asyncio.sleep(0.05)
    finally:
        await r.aclose()
    assert seen == ["gw-a/0", "gw-a/1"]
