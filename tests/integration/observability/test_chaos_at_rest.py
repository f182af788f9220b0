"""What an operator reads once a storm is over, on ``--workers 2``: after engines that die and come
back, clients that leave mid-stream and while queued, admission that queues and sheds, streams
continued on another engine, vLLM and SGLang P/D requests (some whose prefill hangs until the
client leaves) and the edge's own answers (404, 405, 413, a broken body), every gauge of a live
count on ``/metrics`` is back at the value it had before the traffic (in-flight requests, P/D
trackers, admission queue and headroom, busy upstream connections, client connections, the session
map, tasks), and the request log has one line per request sent, whose statuses add up to
``switchyard_requests_total``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
from collections import Counter

import aiohttp
import pytest

from enginesim import start_sim
from tests.integration.server.test_workers import workers_listening
from tests.support.factories import roleset
from tests.support.gateway_process import get_new
from tests.support.metrics import sample_map
from tests.support.ports import listen_port

# the gauges of a live count: at rest each is back at its value before the traffic, every series
AT_REST = ("switchyard_in_flight_requests", "switchyard_endpoint_in_flight_requests",
           "switchyard_pd_prefill_in_flight", "switchyard_pd_pending_decode",
           "switchyard_pd_token_load_active_tokens", "switchyard_pd_token_load_kv_tokens",
           "switchyard_admission_queue_depth", "switchyard_admission_queue_bytes",
           "switchyard_endpoint_saturated", "switchyard_endpoint_admission_headroom",
           "switchyard_client_connections", "switchyard_session_map_entries", "switchyard_endpoint_ready")
TASKS = "switchyard_event_loop_tasks"


def resting(page: str) -> dict:
    out = {k: v for k, v in sample_map(page).items() if k[0] in AT_REST}
    out[("busy", ())] = sample_map(page)[("switchyard_upstream_connections", (("state", "busy"),))]
    return out


def off_rest(before: dict, now: dict) -> dict:
    """The series whose value differs from before (a series first seen since was 0 then: a model's
    in-flight count shows once it had a request)."""
    return {k: (before.get(k, 0.0), now.get(k, 0.0)) for k in before.keys() | now.keys()
            if before.get(k, 0.0) != now.get(k, 0.0)}


def tasks(page: str) -> float:
    return sample_map(page)[(TASKS, ())]


async def scrape(port: int) -> str:
    status, page = await get_new(port, "/metrics")
    assert status == 200
    return page


@pytest.mark.timeout(180)
async def test_after_a_storm_every_gauge_is_back_at_rest_and_the_log_matches_the_counters(sims, tmp_path):
    a, b = await sims("vllm", "m", itl_ms=10.0), await sims("vllm", "m", itl_ms=10.0)
    p, d = await sims("vllm", "pd", role="prefill", itl_ms=10.0), await sims("vllm", "pd", role="decode", itl_ms=10.0)
    sp, sd = await sims("sglang", "sg", role="prefill", itl_ms=10.0), await sims("sglang", "sg", role="decode", itl_ms=10.0)
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    models = [{"name": "m", "engine": "vllm", "endpoints": [a.url, b.url], "migration_limit": 2,
               "watchdog": {"idle_timeout_s": 1, "aggregated": True}},
              {"name": "pd", "engine": "vllm", "rolesets": [roleset("vllm", p, d)]},
              {"name": "sg", "engine": "sglang", "rolesets": [roleset("sglang", sp, sd)]}]
    cfg.write_text(json.dumps({
        "listen": {"host": "127.0.0.1", "port": port},
        "server": {"drain_delay_s": 0, "shutdown_grace_s": 2, "log_format": "json", "max_body_bytes": 4096},
        "routing": {"strategy": "round-robin"}, "health": {"interval_s": 0.2}, "scrape": {"interval_s": 0.2},
        "admission": {"enabled": True, "max_in_flight_per_endpoint": 2, "queue_max": 16, "queue_timeout_s": 1.0,
                      "metrics_max_age_s": 30},
        "models": models, "pd": {"sglang": {"abort_retry_delay_s": 0.2}}}))
    log = tmp_path / "gw.log"
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "--config", str(cfg), "--workers", "2", stderr=err)
    back = []
    try:
        await workers_listening(proc.pid, port)
        before = resting(await scrape(port))
        base_tasks = min([tasks(await scrape(port)) for _ in range(3)])
        url = f"http://127.0.0.1:{port}"
        sent: list[str] = []

        async def chat(http, model: str, rid: str, *, stream: bool = True, fault: str = "none",
                       leave_after: int | None = None, leave_in: float | None = None) -> object:
            sent.append(rid)
            body = {"model": model, "messages": [{"role": "user", "content": f"storm {rid}"}],
                    "max_tokens": 30, "stream": stream}
            headers = {"x-request-id": rid, "x-sim-fault": fault}
            try:
                async with asyncio.timeout(leave_in or 30):
                    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                        if leave_after is None or r.status != 200:
                            await r.read()
                            return r.status
                        n = 0
                        async for line in r.content:
                            n += line.startswith(b"data:")
                            if n >= leave_after:
                                r.close()      # the connection closed, not given back
                                return "left"
                        return r.status
            except TimeoutError:
                return "left"

        async def edge(http) -> list[int]:
            out = []
            for method, path, data in (("GET", "/nope", None), ("GET", "/v1/chat/completions", None),
                                       ("POST", "/v1/chat/completions", b"{broken"),
                                       ("POST", "/v1/chat/completions", b"x" * 5000)):
                sent.append(rid := f"edge-{len(out)}")
                async with http.request(method, url + path, data=data,
                                        headers={"x-request-id": rid, "content-type": "application/json"}) as r:
                    await r.read()
                    out.append(r.status)

            async def chunks():
                for _ in range(6):
                    yield b"x" * 1000
            sent.append("edge-chunked")
            async with http.post(url + "/v1/chat/completions", data=chunks(),
                                 headers={"x-request-id": "edge-chunked", "content-type": "application/json"}) as r:
                await r.read()
                out.append(r.status)
            return out

        async def deaths() -> None:
            await asyncio.sleep(0.3)
            for sim in (b, d, sp):
                cfg_, port_ = sim.cfg, sim.port
                await sim.close()
                back.append(await start_sim(dataclasses.replace(cfg_, port=port_)))

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as http:
            kinds = [dict(model="m"), dict(model="m", leave_after=3), dict(model="m", stream=False),
                     dict(model="m", fault="drop_after=4"), dict(model="m", fault="stall_after=2:inf"),
                     dict(model="m", leave_in=0.3), dict(model="pd"), dict(model="pd", leave_after=2),
                     dict(model="pd", stream=False), dict(model="pd", fault="hang=inf", leave_in=0.5),
                     dict(model="sg"), dict(model="sg", leave_after=2), dict(model="sg", fault="hang=inf", leave_in=0.5)]
            got = await asyncio.gather(*(chat(http, rid=f"r{i}", **kinds[i % len(kinds)]) for i in range(65)),
                                       edge(http), deaths())
        edge_statuses = got[-2]
        assert edge_statuses == [404, 405, 400, 413, 413]
        outcomes = Counter(map(str, got[:-2]))
        assert outcomes["200"] and outcomes["429"] and outcomes["left"], outcomes

        # at rest: every gauge of a live count is back where it was (a bounded wait: a stream the
        # client left ends in the gateway a moment later, an engine that came back is probed ready)
        for _ in range(150):
            page = await scrape(port)
            now = resting(page)
            if not off_rest(before, now) and tasks(page) <= base_tasks:
                break
            await asyncio.sleep(0.2)
        assert not off_rest(before, now), f"not at rest (before, now): {off_rest(before, now)}"
        assert tasks(page) <= base_tasks, (tasks(page), base_tasks)
        for _ in range(3):          # whichever worker answers
            page = await scrape(port)
            assert not off_rest(before, resting(page))

        # the log: one line per request sent, and the counted ones add up to the counters
        lines = []
        async with asyncio.timeout(20):
            while True:
                lines = [json.loads(x) for x in log.read_bytes().splitlines() if x.startswith(b"{")]
                lines = [x for x in lines if x.get("event") == "request"]
                if len(lines) >= len(sent):
                    break
                await asyncio.sleep(0.1)
        ids = Counter(x["request_id"] for x in lines)
        assert ids == Counter(sent), (ids - Counter(sent), Counter(sent) - ids)
        logged = Counter((x["model"], str(x["status"])) for x in lines if x.get("error_class") != "http")
        counted: Counter = Counter()
        for (name, labels), v in sample_map(page).items():
            if name == "switchyard_requests_total" and v:
                lab = dict(labels)
                counted[(lab["model"], lab["status"])] += int(v)
        assert counted == logged
    finally:
        for sim in back:
            with contextlib.suppress(Exception):
                await sim.close()
        if proc.returncode is None:
            proc.terminate()
        async with asyncio.timeout(20):
            await proc.wait()
