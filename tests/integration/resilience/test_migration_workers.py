"""Mid-stream continuation in a real gateway process, one worker or two: every stream the OpenAI SDK
reads is the unbroken answer, and the merged /metrics count each broken leg, each watchdog fire
and each token once, whichever worker took the stream."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.integration.resilience.test_migration import MSG, raw_post, text_of
from tests.support.gateway_process import gateway_process, get_new, metric_total
from tests.support.http import sim_state
from tests.support.ports import listen_port


@pytest.mark.parametrize("workers", [1, 2])
async def test_continued_streams_are_whole_and_counted_once_with_workers(sims, tmp_path, workers):
    bad = await sims("vllm", "m", fault="drop_after=4")
    stalled = await sims("vllm", "m", fault="stall_after=5:inf")
    good = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 2, log_level: warning}\n"
                   "routing: {strategy: round-robin}\n"
                   "health: {enabled: false}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{bad.url}', '{stalled.url}', '{good.url}'],"
                   " migration_limit: 2, watchdog: {idle_timeout_s: 0.3, aggregated: true}}]\n")
    req = {"model": "m", "messages": MSG, "max_tokens": 30}
    _, ref = await raw_post(good.url, "/v1/chat/completions", {**req, "stream": True})
    n = 6

    async def one() -> str:
        # a client, so a connection, of its own: the kernel hands each to one of the workers
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        try:
            stream = await client.chat.completions.create(**req, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        finally:
            await client.close()

    async with gateway_process(cfg, port, "--workers", str(workers), ready_workers=workers):
        texts = await asyncio.gather(*(one() for _ in range(n)))
        assert texts == [text_of(ref)] * n
        broken = (await sim_state(bad.url))["counts"]["started"]
        silent = (await sim_state(stalled.url))["counts"]["started"]
        assert broken + silent > 0
        _, page = await get_new(port, "/metrics")
    assert metric_total(page, "switchyard_migrations_total", outcome="continued", reason="broken") == broken
    assert metric_total(page, "switchyard_migrations_total", outcome="continued", reason="idle_timeout") == silent
    assert metric_total(page, "switchyard_watchdog_fires_total", phase="idle") == silent
    assert metric_total(page, "switchyard_completion_tokens_total") == n * 30
    assert metric_total(page, "switchyard_requests_total", status="200") == n
    assert metric_total(page, "switchyard_in_flight_requests") == 0
