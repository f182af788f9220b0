"""Tracing with ``--workers 2``, a real gateway process exporting to a receiver on loopback: each
worker exports its own requests' spans, each request's once, and a collector that refuses for a
while (429) costs no request and loses only the spans of that while, counted as failed."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from tests.integration.server.test_workers import children_of, own_metrics, sibling_sockets
from tests.support.gateway_process import gateway_process, get_new, post_new
from tests.support.metrics import metric
from tests.support.otlp_receiver import OTLPReceiver
from tests.support.ports import listen_port

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def requests_traced(rx: OTLPReceiver) -> Counter:
    return Counter(s.attributes.get("gen_ai.request.id") for s in rx.spans
                   if s.kind == "SERVER" and s.service == "switchyard")


@pytest.mark.timeout(120)
async def test_two_workers_export_each_request_once_and_resume_after_a_refusing_collector(sims, tmp_path):
    rx = await OTLPReceiver().start()
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 5, log_level: warning}\n"
                   f"tracing: {{enabled: true, endpoint: '{rx.url}', batch_delay_s: 0.05, export_timeout_s: 1}}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    try:
        async with gateway_process(cfg, port, "--workers", "2", ready_workers=2) as proc:
            served = [(await post_new(port, "/v1/chat/completions", BODY))[1]["request-id"] for _ in range(30)]
            assert await rx.wait_for(lambda r: set(served) <= set(requests_traced(r)))
            workers = sibling_sockets(children_of(proc.pid))
            assert len(workers) == 2
            for path in workers.values():       # each worker exported spans of its own
                assert metric(await own_metrics(path), "switchyard_trace_spans_total", result="exported") > 0
            # and is an instance of its own in the resource (the SDK's service.instance.id, a UUID
            # each provider draws): a trace viewer tells the two apart
            instances = {s.instance for s in rx.spans if s.service == "switchyard"}
            assert len(instances) == 2 and "" not in instances

            rx.fail_with = 429                  # the collector refuses: requests are served all the same
            refused = [await post_new(port, "/v1/chat/completions", BODY) for _ in range(6)]
            assert [r[0] for r in refused] == [200] * 6

            async def failed() -> float:
                return metric((await get_new(port, "/metrics"))[1], "switchyard_trace_spans_total", result="failed")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while await failed() < 6 * 3 and loop.time() < deadline:    # 3 spans a request, given up
                await asyncio.sleep(0.1)
            assert await failed() == 6 * 3

            rx.fail_with = None                 # back: the next requests' spans are exported
            later = [(await post_new(port, "/v1/chat/completions", BODY))[1]["request-id"] for _ in range(10)]
            assert await rx.wait_for(lambda r: set(later) <= set(requests_traced(r)))
        counts = requests_traced(rx)            # the stop flushed what was left: no request twice
        assert all(counts[rid] == 1 for rid in served + later)
        assert not {r[1]["request-id"] for r in refused} & set(counts)
        assert sum(counts.values()) == len(served) + len(later)
    finally:
        await rx.close()
