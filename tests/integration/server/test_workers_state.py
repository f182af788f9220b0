"""``--workers N`` with the tenants' state in a real Redis: ``/metrics`` counts what the shared state
went through once for the gateway, whichever worker answers, though every worker meets it."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
import yaml

from tests.support.gateway_process import gateway_process, get_new, metric_total, per_worker
from tests.support.ports import listen_port


@pytest.mark.timeout(90)
async def test_a_refusal_every_worker_meets_is_one_outage(sims, tmp_path, redis_server):
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": port},
        "server": {"drain_delay_s": 0, "log_level": "warning"},
        "limits": {"users": {"alice": {"rpm": 1000}}},
        "state": {"redis_url": redis_server.url, "sync_interval_s": 0.05},
        "models": [{"name": "m", "engine": "vllm", "endpoints": [sim.url]}]}))
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
