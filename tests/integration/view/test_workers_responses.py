"""``--workers 2`` with the Responses API's in-memory state: each worker keeps the responses it
answered, and a follow-up, a ``GET`` or a ``DELETE`` that reaches the other worker finds them there
(gateway/apis/responses_state.py ``WorkerStore``), whichever worker the kernel hands a connection to.

A real ``python -m gateway --workers 2`` in front of a simulated engine; the openai SDK without
keep-alive, so every call is a new connection.
"""

from __future__ import annotations

import httpx2
import openai
import pytest

from tests.support.gateway_process import gateway_process, metric_total, per_worker
from tests.support.ports import listen_port


def config(port: int, url: str, responses: str) -> str:
    return (f"listen: {{host: 127.0.0.1, port: {port}}}\n"
            "server: {drain_delay_s: 0, shutdown_grace_s: 5, log_level: warning}\n"
            "health: {interval_s: 0.5}\n"
            f"responses: {responses}\n"
            f"models: [{{name: m, engine: vllm, endpoints: ['{url}']}}]\n")


def client(port: int) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                              http_client=openai.DefaultAsyncHttpx2Client(limits=httpx2.Limits(max_keepalive_connections=0)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("state", ["gateway", "engine"])
async def test_every_worker_finds_every_response(sims, tmp_path, state):
    engine = await sims("vllm", "m", enable_responses_store=True)     # engine mode: it keeps them
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, engine.url, f"{{state: {state}}}"))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        c = client(port)
        ids = []
        for chain in range(3):
            r = await c.responses.create(model="m", input=f"chain {chain}: hello", max_output_tokens=3)
            for turn in range(7):          # each call on a new connection: the kernel picks the worker
                r = await c.responses.create(model="m", input=f"turn {turn}", previous_response_id=r.id,
                                             max_output_tokens=3)
                assert r.status == "incomplete"
            ids.append(r.id)
        for rid in ids:
            for _ in range(3):
                assert (await c.responses.retrieve(rid)).id == rid
        if state == "gateway":                 # the engine holds engine-mode responses (and deletes them)
            for rid in ids:
                await c.responses.delete(rid)
                for _ in range(3):
                    with pytest.raises(openai.NotFoundError):
                        await c.responses.retrieve(rid)
        await c.close()
        pages = await per_worker(port, 2)
    kind = "history" if state == "gateway" else "affinity"
    # 21 follow-ups and 9 GETs on new connections: some reached the worker that did not answer the
    # response before (one worker answering all 30 by chance: 2^-30)
    found = sum(metric_total(p, "switchyard_responses_state_lookups_total", kind=kind, result="sibling")
                for p in pages.values())
    assert found > 0


@pytest.mark.timeout(120)
async def test_the_history_bound_is_the_gateways_not_each_workers(sims, tmp_path):
    """history.max_total_bytes bounds what the gateway holds: with two workers each keeps half of
    it, where each kept all of it and the gateway twice the bound."""
    engine = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, engine.url, "{state: gateway, history: {max_response_bytes: 16384, "
                                             "max_total_bytes: 131072}}"))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        c = client(port)
        for i in range(100):            # a record holds its input: each over 4100 bytes
            await c.responses.create(model="m", input=f"{i:03d} " + "p" * 4100, max_output_tokens=1)
        await c.close()
        pages = await per_worker(port, 2)
    held = [metric_total(p, "switchyard_responses_state_entries", kind="history") for p in pages.values()]
    assert held[0] == held[1]            # the gateway's sum, whichever worker answered
    assert held[0] * 4100 <= 131072
