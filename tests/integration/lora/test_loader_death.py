"""A worker killed outright (SIGKILL) in the middle of a slow adapter load while its sibling waits
for that load: the sibling stops waiting when it has not heard of the load for ``view.peer_ttl_s``,
or as soon as the restarted worker's first message arrives, whichever comes first, then loads the
adapter itself and answers its client from it; nothing of the dead worker's stays counted in it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal

import aiohttp
import pytest

from tests.integration.lora.test_workers import LOAD, ask, calls, load_under_way, worker_session
from tests.integration.server.test_workers import children_of
from tests.support.gateway_process import gateway_process, get_new, metric_total, per_worker
from tests.support.lora import LORA_SIM, MSG
from tests.support.ports import listen_port
from tests.support.waiting import sigstop, until


def config(port: int, url: str, view: str) -> str:
    return (f"listen: {{host: 127.0.0.1, port: {port}}}\n"
            "server: {drain_delay_s: 0, shutdown_grace_s: 5, log_level: warning}\n"
            "health: {interval_s: 0.5}\n"
            "lora: {discovery_interval_s: 0, load_timeout_s: 120, failure_cooldown_s: 60}\n"
            f"view: {{{view}}}\n"
            f"models: [{{name: m, engine: vllm, endpoints: ['{url}'], adapters: {{a: org/a}}}}]\n")


async def own_status(session: aiohttp.ClientSession, port: int) -> dict:
    """``/status.json`` as ``session``'s worker answers it (the endpoints' remote counts are its own)."""
    async with session.get(f"http://127.0.0.1:{port}/status.json") as r:
        return await r.json()


async def models_in_flight(session: aiohttp.ClientSession, port: int) -> int:
    """Client requests in flight for ``m``, summed over the workers that answer."""
    doc = await own_status(session, port)
    return next(m["in_flight"] for m in doc["models"] if m["name"] == "m")


async def nothing_in_flight(session: aiohttp.ClientSession, port: int) -> bool:
    """No request in flight on the engine, the worker's own or told by a sibling, nor for the model."""
    doc = await own_status(session, port)
    eps = doc["endpoints"]
    return all(ep["in_flight"] == 0 and ep["remote_in_flight"] == 0 for ep in eps) \
        and all(m["in_flight"] == 0 for m in doc["models"])


async def stalled_stream(session: aiohttp.ClientSession, port: int) -> aiohttp.ClientResponse:
    """A stream for the base model on ``session``'s worker that the engine holds after its first token."""
    body = {"model": "m", "messages": MSG, "max_tokens": 50, "stream": True}
    r = await session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                           headers={"x-sim-fault": "stall_after=1:inf"})
    assert r.status == 200, await r.text()
    while not (await r.content.readline()).startswith(b"data: {"):
        pass
    return r


async def victim_loading(sim, port: int, proc) -> tuple[list[aiohttp.ClientSession], int, asyncio.Task, asyncio.Task]:
    """A worker (the victim) with a stream in flight on the engine and a load of ``a`` under way
    that its sibling has heard of, and the sibling's request for ``a`` waiting for it: the
    sessions, the victim's pid, the victim's request and the sibling's."""
    first, pid = await worker_session(port)
    streaming, _ = await worker_session(port)
    while True:                     # a second connection to the victim, for its stream
        async with streaming.get(f"http://127.0.0.1:{port}/status.json") as r:
            if (await r.json())["gateway"]["pid"] == pid:
                break
        await streaming.close()
        streaming, _ = await worker_session(port)
    second, other = await worker_session(port, pid)
    watch, _ = await worker_session(port, pid)     # the survivor's, for its status while second waits
    sessions = [first, streaming, second, watch]
    assert sorted(children_of(proc.pid)) == sorted([pid, other])
    await stalled_stream(streaming, port)
    loading = await load_under_way(sim, port, first, "a")
    waiting = asyncio.create_task(ask(second, port, "a"))
    # both requests in the gateway: the victim's in its load, the sibling's (bounded) in its wait
    async def both_in() -> bool:
        return waiting.done() or await models_in_flight(watch, port) == 3

    await until(both_in, timeout=5)
    assert calls(sim, LOAD) == 1 and not waiting.done(), "the sibling did not wait for the victim's load"
    return sessions, pid, loading, waiting


async def restarted(port: int, proc, victim: int) -> bool:
    now = children_of(proc.pid)
    return victim not in now and len(now) == 2 and len(await per_worker(port, 2, "/status.json")) == 2


async def served_by_adapter(answer: tuple[int, str, str]) -> None:
    status, _, text = answer
    assert status == 200, text
    assert json.loads(text)["model"] == "a", text


@pytest.mark.timeout(120)
async def test_a_load_whose_worker_is_killed_is_given_up_by_its_waiting_sibling_after_the_silence(sims, tmp_path):
    """The parent is held stopped, so the victim is not started again: only the silence of its load
    ends the sibling's wait (``view.peer_ttl_s``), then the sibling loads ``a`` itself (the engine
    answers that it is there by then, or registers it) and serves its client from it."""
    sim = await sims("vllm", "m", **LORA_SIM, lora_load_call_ms=3000)
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, sim.url, "peer_ttl_s: 0.5, heartbeat_s: 0.1"))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2) as proc:
        sessions, victim, loading, waiting = await victim_loading(sim, port, proc)
        survivor = sessions[3]
        stopped = False
        try:
            stopped = True
            await sigstop(proc.pid)                 # no restart while it is stopped
            os.kill(victim, signal.SIGKILL)
            async with asyncio.timeout(30):
                answer = await waiting
            await served_by_adapter(answer)
            assert victim in children_of(proc.pid), "the victim was reaped, so its parent ran"
            with pytest.raises(aiohttp.ClientError):
                await loading
            # the survivor no longer counts the victim's stream, nor its own request
            await until(lambda: nothing_in_flight(survivor, port), timeout=10)
            os.kill(proc.pid, signal.SIGCONT)
            stopped = False
            await until(lambda: restarted(port, proc, victim), timeout=30)
            await served_by_adapter(await ask(survivor, port, "a"))      # loaded: no call more (below)
            await until(lambda: nothing_in_flight(survivor, port), timeout=10)
            page = (await get_new(port, "/metrics"))[1]
        finally:
            if stopped:
                os.kill(proc.pid, signal.SIGCONT)
            for s in sessions:
                with contextlib.suppress(Exception):
                    await s.close()
    assert calls(sim, LOAD) == 2, "one call by the victim, one by the survivor after the silence"
    assert "a" in sim.engine.lora.registered
    assert metric_total(page, "switchyard_lora_load_waits_total", adapter="a", outcome="silent") == 1
    assert metric_total(page, "switchyard_lora_load_waits_total", adapter="a") == 1
    assert metric_total(page, "switchyard_endpoint_in_flight_requests") == 0
    assert metric_total(page, "switchyard_in_flight_requests") == 0
    assert metric_total(page, "switchyard_lora_loads_total", adapter="a", result="ok") >= 1


@pytest.mark.timeout(120)
async def test_a_load_whose_worker_is_killed_is_given_up_by_its_waiting_sibling_at_the_restart(sims, tmp_path):
    """With ``view.peer_ttl_s`` far longer than a restart, the restarted worker's first message ends
    the sibling's wait: the sibling's answer comes once the new worker is there, long before the
    silence would have ended it; the victim's stream, counted in the survivor, goes with that word."""
    sim = await sims("vllm", "m", **LORA_SIM, lora_load_call_ms=3000)
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, sim.url, "peer_ttl_s: 90, heartbeat_s: 0.1"))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2) as proc:
        sessions, victim, loading, waiting = await victim_loading(sim, port, proc)
        survivor = sessions[3]
        try:
            os.kill(victim, signal.SIGKILL)
            # the survivor's own load call (or its answer) once its wait ended, bounded well under
            # peer_ttl_s: only the victim's successor could end it, so that worker had started by then
            await until(lambda: calls(sim, LOAD) == 2 or waiting.done(), timeout=40)
            now = children_of(proc.pid)
            assert victim not in now and len(now) == 2, "the wait ended before the victim's successor started"
            async with asyncio.timeout(30):
                answer = await waiting
            await served_by_adapter(answer)
            with pytest.raises(aiohttp.ClientError):
                await loading
            await until(lambda: nothing_in_flight(survivor, port), timeout=20)
            await until(lambda: restarted(port, proc, victim), timeout=30)
            await served_by_adapter(await ask(survivor, port, "a"))
            await until(lambda: nothing_in_flight(survivor, port), timeout=10)
            page = (await get_new(port, "/metrics"))[1]
        finally:
            for s in sessions:
                with contextlib.suppress(Exception):
                    await s.close()
    assert calls(sim, LOAD) == 2
    assert "a" in sim.engine.lora.registered
    assert metric_total(page, "switchyard_lora_load_waits_total", adapter="a", outcome="silent") == 1
    assert metric_total(page, "switchyard_lora_load_waits_total", adapter="a") == 1
    assert metric_total(page, "switchyard_endpoint_in_flight_requests") == 0
    assert metric_total(page, "switchyard_in_flight_requests") == 0


@pytest.mark.timeout(120)
async def test_a_restarted_worker_does_not_unload_for_room_an_adapter_its_sibling_streams_from(sims, tmp_path):
    """A worker tells its siblings of the adapters it has requests in flight for every
    ``view.heartbeat_s``, so none unloads one from under them. A worker started again (its
    predecessor killed) has heard nothing yet for up to that long, while its first discovery round
    already shows the adapter on the engine: a request there for another adapter, at one adapter
    an endpoint, had it unload ``a`` from under its sibling's stream. The sibling's whole view,
    which it asks for before it serves, tells it: it answers 503 full, as a worker that heard does."""
    sim = await sims("vllm", "m", **LORA_SIM)
    port = listen_port()
    path = tmp_path / "gw.yaml"
    # heartbeats far apart: the restarted worker serves long before its sibling's next one
    path.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                    "server: {drain_delay_s: 0, shutdown_grace_s: 5, log_level: warning}\n"
                    "health: {interval_s: 0.5}\n"
                    "lora: {discovery_interval_s: 0.2, max_adapters_per_endpoint: 1}\n"
                    "view: {heartbeat_s: 20, peer_ttl_s: 40}\n"
                    "models: [{name: m, engine: vllm, endpoints: ['" + sim.url + "'], adapters: {a: org/a, b: org/b}}]\n")
    async with gateway_process(path, port, "--workers", "2", ready_workers=2) as proc:
        streamer, survivor = await worker_session(port)
        (victim,) = [p for p in children_of(proc.pid) if p != survivor]
        try:
            body = {"model": "a", "messages": MSG, "max_tokens": 50, "stream": True}
            stream = await streamer.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                                         headers={"x-sim-fault": "stall_after=1:inf"})
            assert stream.status == 200, await stream.text()
            while not (await stream.content.readline()).startswith(b"data: {"):
                pass
            os.kill(victim, signal.SIGKILL)
            async with asyncio.timeout(30):       # started again, and its discovery found a on the engine
                while True:
                    kids = children_of(proc.pid)
                    if len(kids) == 2 and victim not in kids:
                        restarted, _ = await worker_session(port, survivor)
                        async with restarted.get(f"http://127.0.0.1:{port}/v1/models/a") as r:
                            served = (await r.json())["ready_endpoints"]
                        if served:
                            break
                        await restarted.close()
                    await asyncio.sleep(0.05)
            try:
                status, why, text = await ask(restarted, port, "b")
            finally:
                await restarted.close()
            assert calls(sim, "/v1/unload_lora_adapter") == 0, "a was unloaded under its sibling's stream"
            assert status == 503 and why == "full", text
            assert not stream.content.at_eof()
            stream.close()
        finally:
            await streamer.close()
