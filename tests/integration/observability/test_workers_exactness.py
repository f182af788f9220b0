"""What an operator reads of ``--workers 2``, request by request: after traffic of every kind (chat
streamed and not, completions, embeddings, refusals, an engine's 500, a client that leaves mid-stream),
``/metrics`` (whichever worker answers), the status page's totals and the request log each count
every request once with its status; and a worker stopped while a scrape comes (SIGSTOP) is reported
by ``switchyard_workers_scraped``, its counts taken from its last report, and not counted twice once
it is back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections import Counter

import openai
import pytest

from tests.integration.server.test_worker_restart_metrics import Pages, config, connections
from tests.integration.server.test_workers import children_of, own_metrics, sibling_sockets, workers_listening
from tests.support.gateway_process import gateway_process, get_new
from tests.support.metrics import metric
from tests.support.ports import listen_port
from tests.support.waiting import sigstop, until

MESSAGES = [{"role": "user", "content": "hi"}]


def by_status(page: str, name: str) -> dict[str, float]:
    out: Counter = Counter()
    for status in ("200", "400", "404", "499", "500"):
        if (v := metric(page, name, status=status)) > 0:
            out[status] = v
    return dict(out)


@pytest.mark.timeout(120)
async def test_every_request_of_every_kind_is_counted_once_wherever_an_operator_looks(sims, tmp_path):
    sim = await sims("vllm", "m", embedding_dim=8, itl_ms=5.0)
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 5, log_format: json}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    log_path = tmp_path / "gw.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                    "--workers", "2", stderr=log_file)
    expected: Counter = Counter()

    def client() -> openai.AsyncOpenAI:     # one each: a new connection, which the kernel gives either worker
        return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)

    try:
        await workers_listening(proc.pid, port)
        for _ in range(3):
            async with client() as c:
                await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3)
            async with client() as c:
                async for _ in await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3, stream=True):
                    pass
            async with client() as c:
                await c.completions.create(model="m", prompt="hi", max_tokens=3)
            async with client() as c:
                await c.embeddings.create(model="m", input="hi")
            expected["200"] += 4
        for _ in range(2):
            async with client() as c:
                with pytest.raises(openai.NotFoundError):
                    await c.chat.completions.create(model="no-such-model", messages=MESSAGES)
            async with client() as c:
                with pytest.raises(openai.BadRequestError):
                    await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=-1)
            async with client() as c:
                with pytest.raises(openai.InternalServerError):
                    await c.chat.completions.create(model="m", messages=MESSAGES,
                                                    extra_headers={"x-sim-fault": "status=500"})
            async with client() as c:      # leaves after three chunks of a long stream
                stream = await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2000, stream=True)
                got = 0
                async for _ in stream:
                    got += 1
                    if got == 3:
                        break
                await stream.close()
            expected.update({"404": 1, "400": 1, "500": 1, "499": 1})
        n = sum(expected.values())

        async def settled() -> str | None:      # the cancelled streams have ended on the gateway's side
            page = (await get_new(port, "/metrics"))[1]
            return page if metric(page, "switchyard_in_flight_requests") == 0 else None

        await until(settled, timeout=20)
        served = [metric(await own_metrics(path), "switchyard_requests_total")
                  for path in sibling_sockets(children_of(proc.pid)).values()]
        assert min(served) >= 1 and sum(served) == n          # both workers served some
        for _ in range(6):          # whichever worker answers
            page = (await get_new(port, "/metrics"))[1]
            assert metric(page, "switchyard_workers_scraped") == 2
            assert by_status(page, "switchyard_requests_total") == expected
            assert by_status(page, "switchyard_path_requests_total") == expected
            assert metric(page, "switchyard_e2e_request_latency_seconds_count") == expected["200"]
            # the streams that got a first token: the three served, the two their clients left
            assert metric(page, "switchyard_time_to_first_token_seconds_count") == 5
            assert metric(page, "switchyard_client_cancels_total", stage="streaming") == 2
            doc = (await get_new(port, "/status.json"))[1]
            assert doc["gateway"]["workers"]["reporting"] == 2
            assert doc["totals"]["requests_since_start"] == n
            assert doc["totals"]["window"]["requests"] == n and doc["totals"]["window"]["errors"] == n - expected["200"]
        proc.send_signal(signal.SIGTERM)        # the request lines are all written by the exit
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert Counter(str(d["status"]) for d in lines if d.get("event") == "request") == expected


@pytest.mark.timeout(120)
async def test_a_stopped_sibling_is_reported_from_its_last_report_and_counted_once_when_back(sims, tmp_path):
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = config(tmp_path / "gw.yaml", port, [sim.url])
    cfg.write_text(cfg.read_text().replace("removed_endpoint_series_s: 0.5", "worker_stall_timeout_s: 0"))
    pages = Pages()
    stopped = None
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2), \
            contextlib.AsyncExitStack() as stack:
        live, other = await connections(port, 2, stack)
        for _ in range(5):
            async with other.session.post(other.base + "/v1/completions",
                                          json={"model": "m", "prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200
            async with live.session.post(live.base + "/v1/completions",
                                         json={"model": "m", "prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200
        page = pages.saw(await live.get("/metrics"))        # the other worker reports its five
        assert metric(page, "switchyard_workers_scraped") == 2
        assert metric(page, "switchyard_requests_total", status="200") == 10
        try:
            await sigstop(other.pid)
            stopped = other.pid
            page = pages.saw(await live.get("/metrics"))
            assert metric(page, "switchyard_workers_scraped") == 1 and metric(page, "switchyard_workers") == 2
            assert metric(page, "switchyard_requests_total", status="200") == 10
            doc = await live.status()
            assert doc["gateway"]["workers"]["reporting"] == 1 and doc["totals"]["requests_since_start"] == 10
        finally:
            if stopped is not None:
                os.kill(stopped, signal.SIGCONT)

        async def back() -> str | None:
            page = pages.saw(await live.get("/metrics"))
            return page if metric(page, "switchyard_workers_scraped") == 2 else None

        await until(back, timeout=20)
        for w in (live, other, live, other):
            page = pages.saw(await w.get("/metrics"))
            assert metric(page, "switchyard_requests_total", status="200") == 10
            assert metric(page, "switchyard_e2e_request_latency_seconds_count", model="m") == 10
            assert (await w.status())["totals"]["requests_since_start"] == 10
