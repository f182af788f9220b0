"""Metric strategies on real engine output and through the gateway."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
from aiohttp import web

from gateway.upstream.engine_metrics import parse_engine_metrics
from routers.session import encode_session_id
from tests.support.factories import model_block
from tests.support.fake_engine import fake_engine
from tests.support.waiting import until

# -- the parser extension, on real engine output -----------------------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_queue_time_and_pool_size_from_a_real_exposition(sims, engine):
    sim = await sims(engine, "m", kv_blocks=512, block_size=16)
    async with aiohttp.ClientSession() as s:
        async with s.get(sim.url + "/metrics") as r:
            first = parse_engine_metrics(await r.text(), engine, 1.0, model="m")
        for _ in range(2):
            async with s.post(sim.url + "/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 2}) as r:
                assert r.status == 200
        async with s.get(sim.url + "/metrics") as r:
            second = parse_engine_metrics(await r.text(), engine, 2.0, first, model="m")
    assert second.kv_capacity_tokens == 512 * 16
    assert second.queue_time_count == 2 and second.queue_time_sum is not None
    assert second.queue_time_recent_mean is not None and second.queue_time_recent_mean >= 0
    assert second.ttft_recent_mean is not None


async def test_least_waiting_avoids_a_queued_engine_through_the_gateway(sims, gateway):
    busy = await sims("vllm", "m", max_num_seqs=1)
    idle = await sims("vllm", "m", max_num_seqs=1)
    gw = await gateway([model_block("m", "vllm", [busy.url, idle.url])])
    busy_ep = next(e for e in gw.gw.pool.endpoints() if e.url == busy.url)
    pin = {"routing-strategy": "session-affinity", "x-session-id": encode_session_id(busy_ep.address),
           "x-sim-fault": "stall_before_first=inf"}
    body = {"model": "m", "prompt": "hold", "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        async def hold():
            async with s.post(gw.url + "/v1/completions", json=body, headers=pin) as r:
                await r.read()
        stuck = [asyncio.create_task(hold()) for _ in range(4)]     # 1 running, 3 waiting on `busy`
        try:
            for _ in range(300):                                    # until a scrape saw the queue
                m = busy_ep.metrics
                if m is not None and m.waiting == 3:
                    break
                await asyncio.sleep(0.02)
            assert busy_ep.metrics.waiting == 3
            for _ in range(4):
                async with s.post(gw.url + "/v1/completions", json={**body, "prompt": "go"},
                                  headers={"routing-strategy": "least-waiting"}) as r:
                    assert r.status == 200
                    assert r.headers["target-pod"] == idle.url.removeprefix("http://")
        finally:
            for t in stuck:
                t.cancel()
            for t in stuck:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t


@pytest.mark.parametrize("strategy", ["least-kv-cache", "least-waiting", "throughput", "least-latency",
                                      "least-kv-cache:2,least-request:1", "least-waiting:2,least-request:1"])
async def test_an_engine_without_metrics_still_takes_its_share(sims, gateway, strategy):
    """An engine whose /metrics gives nothing usable (here SGLang without --enable-metrics; a scrape
    failing, timing out or answering garbage alike) serves as well as the others: it takes
    requests whenever it has no more in flight than the endpoint the engines' numbers pick, so held
    streams alternate between the two instead of all piling on the one that reports. So in a
    weighted list: the silent engine scored 0 on the metric's part, so with that part weighing
    more than the rest it was never chosen."""
    reporting = await sims("sglang", "m")
    silent = await sims("sglang", "m", enable_metrics=False)
    gw = await gateway([model_block("m", "sglang", [reporting.url, silent.url])])
    rep = next(e for e in gw.gw.pool.endpoints() if e.url == reporting.url)
    sil = next(e for e in gw.gw.pool.endpoints() if e.url == silent.url)
    for _ in range(300):                                    # until a scrape of each has been tried
        if rep.metrics is not None and rep.metrics.kv_usage is not None and rep.metrics.waiting is not None:
            break
        await asyncio.sleep(0.02)
    assert rep.metrics is not None and sil.metrics is None
    body = {"model": "m", "prompt": "hold", "max_tokens": 2}
    hold = {"routing-strategy": strategy, "x-sim-fault": "stall_before_first=inf"}
    seen = []
    async with aiohttp.ClientSession() as s:
        tasks = []

        async def held():
            async with s.post(gw.url + "/v1/completions", json=body, headers=hold) as r:
                await r.read()
        try:
            for i in range(4):
                tasks.append(asyncio.create_task(held()))
                for _ in range(500):                        # until the gateway has routed it
                    if rep.in_flight + sil.in_flight == i + 1:
                        break
                    await asyncio.sleep(0.01)
                seen.append((rep.in_flight, sil.in_flight))
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
    assert seen[-1] == (2, 2), seen


# -- an engine whose /metrics are garbage ------------------------------------------------------------


async def _answer(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"id": "c", "object": "chat.completion", "created": 1, "model": "m",
                              "choices": [{"index": 0, "finish_reason": "stop",
                                           "message": {"role": "assistant", "content": "ok"}}],
                              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


_SANE = ('vllm:num_requests_running{model_name="m"} 0\nvllm:num_requests_waiting{model_name="m"} 0\n'
         'vllm:prompt_tokens_total{model_name="m"} 10\nvllm:generation_tokens_total{model_name="m"} 10\n')


async def test_a_session_beside_an_engine_reporting_an_absurd_load_is_routed(gateway):
    """An engine reporting 1e200 requests running (a broken exporter) is the most loaded endpoint
    to prefix-cache's guards, nothing worse: a session kept on the other engine stays there."""
    absurd = 'vllm:num_requests_running{model_name="m"} 1e200\nvllm:num_requests_waiting{model_name="m"} 0\n'
    async with fake_engine(_answer, metrics=absurd) as bad, fake_engine(_answer, metrics=_SANE) as good:
        gw = await gateway([model_block("m", "vllm", [bad, good])], routing={"strategy": "prefix-cache"})
        await until(lambda: all(e.metrics is not None for e in gw.gw.pool.endpoints()))
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.post(gw.url + "/v1/chat/completions", json=body, headers={"x-session-key": "k"}) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["target-pod"] == good.removeprefix("http://")


async def test_throughput_does_not_herd_onto_an_engine_whose_counters_overflow(gateway):
    """Two series of a token counter near a double's largest value sum past it: the engine's rate
    is unknown then, not NaN (which won every throughput decision, as no comparison is true of it)."""
    overflow = ('vllm:prompt_tokens_total{model_name="m",engine="0"} 1e308\n'
                'vllm:prompt_tokens_total{model_name="m",engine="1"} 1e308\n'
                'vllm:generation_tokens_total{model_name="m"} 10\n')
    async with fake_engine(_answer, metrics=overflow) as bad, fake_engine(_answer, metrics=_SANE) as good:
        gw = await gateway([model_block("m", "vllm", [bad, good])])
        bad_ep, good_ep = (next(e for e in gw.gw.pool.endpoints() if e.url == u) for u in (bad, good))
        await until(lambda: good_ep.metrics is not None and good_ep.metrics.gen_throughput is not None
                    and bad_ep.metrics is not None and bad_ep.metrics.gen_throughput is not None)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        pods = []
        async with aiohttp.ClientSession() as s:
            for _ in range(6):
                async with s.post(gw.url + "/v1/chat/completions", json=body,
                                  headers={"routing-strategy": "throughput"}) as r:
                    assert r.status == 200
                    pods.append(r.headers["target-pod"])
        assert pods.count(good.removeprefix("http://")) >= 2, pods
