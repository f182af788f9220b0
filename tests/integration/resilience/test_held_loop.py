"""The gateway's event loop held up mid-stream (a full garbage collection, a starved CPU) for longer
than the watchdog's idle bound. The engine either went on sending meanwhile (an engine in its own
process: here one on its own thread) or was held with the gateway (an engine in the gateway's
process, as the suite runs enginesim). Either way the engine was not silent for the bound while
the gateway could watch it: the stream is relayed whole, with no watchdog fire and no error event.

The client holds the loop itself (``time.sleep``: nothing else of the process runs meanwhile, as
in a collection) once the stream's first event came, so the gateway's wait for the next chunk is
under way. Every test runs on the default event loop and on uvloop, which orders due timers and
socket reads the other way round."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator

import orjson
import pytest

from enginesim import SimConfig, start_sim
from gateway.config.schema import config_from_dict
from gateway.server.app import GATEWAY_KEY
from gateway.server.run import start
from tests.support.edge import parse_responses, request
from tests.support.http import chat_body, sse_events
from tests.support.loops import on_both_loops
from tests.support.metrics import metric
from tests.support.waiting import wait_for

IDLE_S = 0.3
HOLD_S = 0.8                    # longer than the idle bound, twice over
SIM = {"ttft_base_ms": 2.0, "prefill_ms_per_token": 0.0, "itl_ms": 20.0}   # a stream of 6 tokens lasts ~0.1 s
CHAT = [{"role": "user", "content": "hello there"}]


@contextlib.asynccontextmanager
async def engine_here() -> AsyncIterator[str]:
    """An engine on the gateway's own event loop: held whenever the gateway is."""
    sim = await start_sim(SimConfig(engine="vllm", model="m", port=0, host="127.0.0.1", **SIM))
    try:
        yield sim.url
    finally:
        await sim.close()


@contextlib.asynccontextmanager
async def engine_apart() -> AsyncIterator[str]:
    """An engine on a thread and event loop of its own: it goes on while the gateway's loop is held
    (``time.sleep`` lets go of the GIL), as an engine in its own process does."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="held-loop-engine", daemon=True)
    thread.start()
    sim = None
    try:
        sim = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
            start_sim(SimConfig(engine="vllm", model="m", port=0, host="127.0.0.1", **SIM)), loop))
        yield sim.url
    finally:
        if sim is not None:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(sim.close(), loop))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


ENGINES = {"here": engine_here, "apart": engine_apart}


@contextlib.asynccontextmanager
async def gateway(urls: list[str], migration_limit: int = 0) -> AsyncIterator[tuple[int, object]]:
    cfg = config_from_dict({"listen": {"host": "127.0.0.1", "port": 0},
                            "health": {"interval_s": 0.2, "timeout_s": 1.0}, "scrape": {"interval_s": 0.2},
                            "server": {"shutdown_grace_s": 2.0},
                            "watchdog": {"idle_timeout_s": IDLE_S, "first_chunk_timeout_s": 5, "aggregated": True},
                            "models": [{"name": "m", "engine": "vllm", "endpoints": urls, "strategy": "round-robin",
                                        "migration_limit": migration_limit}]})
    runner, app, port = await start(cfg)
    try:
        yield port, app[GATEWAY_KEY]
    finally:
        await runner.cleanup()


class _HoldingClient(asyncio.Protocol):
    """Reads an answer to its end; holds the loop ``HOLD_S`` in the read that brings the first
    event (as a collection that read's allocations set off would: on uvloop, the timers due after
    it run before the sockets are polled again)."""

    def __init__(self) -> None:
        self.data = b""
        self.held = False
        self.closed = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.data += data
        if not self.held and b"data:" in self.data:
            self.held = True
            time.sleep(HOLD_S)      # the whole process stops

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


async def stream_holding_the_loop(port: int) -> list:
    """A chat stream's events, the loop held ``HOLD_S`` once its first event came."""
    body = orjson.dumps(chat_body(CHAT, max_tokens=6, stream=True, stream_options={"include_usage": True}))
    transport, client = await asyncio.get_running_loop().create_connection(_HoldingClient, "127.0.0.1", port)
    try:
        transport.write(request("POST", "/v1/chat/completions", body, close=True))
        async with asyncio.timeout(20):
            await client.closed
    finally:
        transport.close()
    (resp,), _ = parse_responses(client.data, eof=True)
    assert resp.status == 200 and client.held
    return sse_events(resp.body)


@pytest.mark.parametrize("where", list(ENGINES))
@on_both_loops
async def test_a_stream_the_loop_was_held_in_is_not_the_engines_silence(where):
    async with ENGINES[where]() as engine, gateway([engine]) as (port, gw):
        events = await stream_holding_the_loop(port)
        assert await wait_for(lambda: gw.lifecycle.in_flight == 0, timeout=8)
        m = gw.metrics.render()
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
    assert events[-2]["usage"]["completion_tokens"] == 6
    assert metric(m, "switchyard_watchdog_fires_total") == 0
    assert metric(m, "switchyard_upstream_errors_total") == 0


@pytest.mark.parametrize("where", list(ENGINES))
@on_both_loops
async def test_a_continuable_stream_the_loop_was_held_in_is_not_continued(where):
    """With ``migration_limit``, a fire would continue the stream on the other engine: the engine
    that went on sending (or was held with the gateway) keeps it, and its usage is counted once."""
    async with ENGINES[where]() as a, ENGINES[where]() as b, gateway([a, b], migration_limit=1) as (port, gw):
        events = await stream_holding_the_loop(port)
        assert await wait_for(lambda: gw.lifecycle.in_flight == 0, timeout=8)
        m = gw.metrics.render()
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
    assert events[-2]["usage"]["completion_tokens"] == 6
    assert metric(m, "switchyard_migrations_total") == 0
    assert metric(m, "switchyard_upstream_errors_total") == 0
    assert metric(m, "switchyard_completion_tokens_total", model="m") == 6
