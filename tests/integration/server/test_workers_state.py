"""``--workers N`` with the tenants' state in a real Redis: ``/metrics`` counts what the shared state
went through once for the gateway, whichever worker answers, though every worker meets it."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
import redis.asyncio as aioredis
import yaml

from tests.integration.server.test_workers import children_of, own_metrics, sibling_sockets
from tests.support.gateway_process import gateway_process, get_new, metric_total, per_worker
from tests.support.ports import listen_port
from tests.support.tenancy import ALICE, CHAT, KEYS


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


@pytest.mark.timeout(90)
async def test_tokens_are_charged_once_each_as_the_engines_reported_them_across_apis_and_workers(
        sims, tmp_path, redis_server):
    """--workers 2 on one Redis: chat and completions (whole and streamed), Messages and Responses
    (whole and streamed), each on a connection of its own, which the kernel gives either worker. The user's
    TPM window holds exactly the tokens the answers' usage reported: none lost, none counted twice."""
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": port},
        "server": {"drain_delay_s": 0, "log_level": "warning"},
        "auth": {**KEYS, "admin_token": "admin-token-1"},
        "limits": {"users": {"alice": {"tpm": 10**8}}},
        "state": {"redis_url": redis_server.url, "sync_interval_s": 0.05},
        "models": [{"name": "m", "engine": "vllm", "endpoints": [sim.url]}]}))
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2, admin_token="admin-token-1"):
        base = f"http://127.0.0.1:{port}"
        reported = 0
        for i in range(2):
            # a client (and so a connection) per request: the kernel spreads them over the workers
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=ALICE, max_retries=0) as oc:
                r = await oc.chat.completions.create(model="m", messages=CHAT, max_tokens=3 + i)
                reported += r.usage.total_tokens
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=ALICE, max_retries=0) as oc:
                stream = await oc.chat.completions.create(model="m", messages=CHAT, max_tokens=3 + i, stream=True,
                                                          stream_options={"include_usage": True})
                reported += sum([c.usage.total_tokens async for c in stream if c.usage])
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=ALICE, max_retries=0) as oc:
                r = await oc.completions.create(model="m", prompt="hello there", max_tokens=3 + i)
                reported += r.usage.total_tokens
            async with anthropic.AsyncAnthropic(base_url=base, api_key=ALICE, max_retries=0) as ac:
                m = await ac.messages.create(model="m", max_tokens=3 + i, messages=CHAT)
                reported += m.usage.input_tokens + m.usage.output_tokens
            async with anthropic.AsyncAnthropic(base_url=base, api_key=ALICE, max_retries=0) as ac:
                async with ac.messages.stream(model="m", max_tokens=3 + i, messages=CHAT) as st:
                    m = await st.get_final_message()
                reported += m.usage.input_tokens + m.usage.output_tokens
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=ALICE, max_retries=0) as oc:
                r = await oc.responses.create(model="m", input="hello there", max_output_tokens=16 + i)
                reported += r.usage.total_tokens
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=ALICE, max_retries=0) as oc:
                stream = await oc.responses.create(model="m", input="hello there", max_output_tokens=16 + i,
                                                   stream=True)
                reported += sum([e.response.usage.total_tokens async for e in stream
                                 if e.type == "response.completed"])
        r = aioredis.Redis.from_url(redis_server.url)
        try:
            async def charged() -> int:
                return int(await r.get("switchyard:tpm:alice") or 0)
            async with asyncio.timeout(20):         # charged after each answer, off the client's path
                while await charged() < reported:
                    await asyncio.sleep(0.05)
            assert await charged() == reported
        finally:
            await r.aclose()


@pytest.mark.timeout(90)
async def test_a_stored_stream_still_generating_is_retrieved_in_progress_from_every_worker(sims, tmp_path):
    """A GET of a stored stream still running reaches whichever worker the kernel hands its
    connection to: the worker serving the stream answers it in progress, and so does its sibling,
    which asks it (the memory backend, no record written until the stream ends)."""
    sim = await sims("vllm", "m", enable_responses_store=True, itl_ms=20.0)
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": port}, "server": {"drain_delay_s": 0, "log_level": "warning"},
        "models": [{"name": "m", "engine": "vllm", "endpoints": [sim.url]}]}))
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        stream = await client.responses.create(model="m", input="a long story", stream=True, max_output_tokens=2000)
        async for ev in stream:
            if ev.type == "response.created":
                rid = ev.response.id
                break
        answers = await per_worker(port, 2, f"/v1/responses/{rid}")
        await stream.close()
        await client.close()
    assert len(answers) == 2
    for text in answers.values():
        body = orjson.loads(text)
        assert (body["id"], body["status"]) == (rid, "in_progress"), text


@pytest.mark.timeout(90)
async def test_a_stored_stream_still_generating_is_in_progress_from_every_worker_while_redis_does_not_answer(
        sims, tmp_path, redis_server):
    """Gateway state on Redis: while Redis does not answer (paused), a GET of a stored stream still
    running was the store's 503 on either worker. The worker serving it answers from its stream,
    and its sibling, whose lookup the store could not answer, asks it."""
    sim = await sims("vllm", "m", itl_ms=20.0)
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": port}, "server": {"drain_delay_s": 0, "log_level": "warning"},
        "state": {"redis_url": redis_server.url, "timeout_s": 0.2}, "responses": {"state": "gateway"},
        "models": [{"name": "m", "engine": "vllm", "endpoints": [sim.url]}]}))
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        stream = await client.responses.create(model="m", input="a long story", stream=True, max_output_tokens=2000)
        async for ev in stream:
            if ev.type == "response.created":
                rid = ev.response.id
                break
        redis_server.pause()
        try:
            answers = await per_worker(port, 2, f"/v1/responses/{rid}")
        finally:
            redis_server.resume()
            await stream.close()
            await client.close()
    assert len(answers) == 2
    for text in answers.values():
        body = orjson.loads(text)
        assert (body.get("id"), body.get("status")) == (rid, "in_progress"), text


@pytest.mark.timeout(90)
async def test_the_calls_on_a_stored_stream_still_generating_are_answered_by_every_worker(sims, tmp_path):
    """With gateway state in memory the worker serving a stored stream still generating holds it:
    its sibling asks it, so a cancel (a 400: not background) and ``input_items`` are answered by
    either worker, and a DELETE its sibling takes removes it from the worker that serves it."""
    sim = await sims("vllm", "m", itl_ms=20.0)
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": port}, "server": {"drain_delay_s": 0, "log_level": "warning"},
        "responses": {"state": "gateway"},
        "models": [{"name": "m", "engine": "vllm", "endpoints": [sim.url]}]}))
    base = f"http://127.0.0.1:{port}"
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2), \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as held:
        async with held.get(base + "/status.json") as r:
            holder = (await r.json())["gateway"]["pid"]
        async with held.post(base + "/v1/responses", json={"model": "m", "input": "a long story", "stream": True,
                                                           "max_output_tokens": 2000}) as stream:
            first = await stream.content.readuntil(b"\n\n")
            while b"response.created" not in first:
                first = await stream.content.readuntil(b"\n\n")
            rid = orjson.loads(first.split(b"data: ", 1)[1])["response"]["id"]
            answers: dict[int, tuple[int, Any, int, Any]] = {}
            other = None
            async with asyncio.timeout(20):
                # each worker's answers first, then the sibling's DELETE: a DELETE before the holder
                # answered would leave it nothing to answer of
                while len(answers) < 2 or other is None:
                    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
                        async with s.get(base + "/status.json") as r:
                            pid = (await r.json())["gateway"]["pid"]
                        if pid not in answers:
                            async with s.post(f"{base}/v1/responses/{rid}/cancel") as r:
                                cancel = (r.status, await r.json())
                            async with s.get(f"{base}/v1/responses/{rid}/input_items") as r:
                                answers[pid] = (*cancel, r.status, await r.json())
                        if pid != holder and len(answers) == 2:
                            async with s.delete(f"{base}/v1/responses/{rid}") as r:
                                other = (r.status, await r.json())
            for status, body, items_status, items in answers.values():
                assert (status, body["error"]["message"]) == (400, "Cannot cancel a synchronous response."), body
                assert items_status == 200 and [i["content"][0]["text"] for i in items["data"]] == ["a long story"]
            assert other is not None and other[0] == 200 and other[1]["deleted"] is True, other
            gone = await per_worker(port, 2, f"/v1/responses/{rid}")
            assert all(orjson.loads(text)["error"]["code"] == "response_not_found" for text in gone.values()), gone
