"""Helpers for tests that talk to simulated engines over real loopback sockets."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from enginesim import SimConfig, SimServer, start_sim
from tests.support.http import sim_state
from tests.support.metrics import samples
from tests.support.waiting import until

# Latencies small enough that a whole test file runs in seconds; prefill cost zero so cache hits
# are visible only through cached_tokens, never through timing.
FAST: dict[str, Any] = {"ttft_base_ms": 1.0, "prefill_ms_per_token": 0.0, "itl_ms": 1.0,
                        "sglang_abort_delay_s": 0.01}


def parse_sse(raw: str) -> list[Any]:
    """Events of an SSE body: decoded JSON for ``data:`` frames, ``"[DONE]"``, or ``":comment"``."""
    assert raw.endswith("\n\n") or raw == "", f"stream does not end on a frame boundary: {raw[-40:]!r}"
    events: list[Any] = []
    for frame in raw.split("\n\n"):
        if not frame:
            continue
        assert "\n" not in frame, f"multi-line frame: {frame!r}"
        if frame.startswith(":"):
            events.append(frame)
            continue
        assert frame.startswith("data: "), frame
        payload = frame[len("data: "):]
        events.append("[DONE]" if payload == "[DONE]" else orjson.loads(payload))
    return events


async def next_event(resp: aiohttp.ClientResponse) -> Any:
    """Read one SSE frame from a live response."""
    frame = (await resp.content.readuntil(b"\n\n")).decode()
    return parse_sse(frame)[0]


async def wait_state(http: aiohttp.ClientSession, url: str,
                     pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The first ``/_sim/state`` snapshot that satisfies ``pred``."""
    found: dict[str, Any] = {}

    async def check() -> bool:
        nonlocal found
        found = await sim_state(url, http)
        return pred(found)

    await until(check)
    return found


async def metric_samples(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """``/metrics`` as ``{"name{sorted labels}": value}`` (read with :func:`tests.support.metrics.metric`)."""
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200
        return samples(await resp.text())


async def call(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[int, Any, aiohttp.ClientResponse]:
    """POST ``body`` to an engine's ``url`` on a shared session: status, the answer decoded by its content
    type (SSE events, JSON, or text), and the response for its headers."""
    async with http.post(url, json=body, headers=headers) as resp:
        raw = await resp.read()
        if resp.content_type == "text/event-stream":
            return resp.status, parse_sse(raw.decode()), resp
        return resp.status, (await resp.json() if resp.content_type == "application/json" else raw.decode()), resp




async def restart_sim(sim: SimServer, min_uptime_s: float = 1.5) -> SimServer:
    """``sim`` stopped and a new engine started on its ports (HTTP and KV events) with its settings:
    an engine process that restarted, its cache empty and its ``process_start_time_seconds`` its
    own. The old one is first left up ``min_uptime_s`` so the two starts are told apart (the gateway
    takes a move of a second or less for the clock being stepped). The caller closes the new one."""
    await until(lambda: time.time() - sim.engine.started_at > min_uptime_s, timeout=min_uptime_s + 5)
    cfg: SimConfig = sim.cfg
    kv = sim.engine.kv_events
    ports = {"port": sim.port}
    if kv is not None:
        ports.update(kv_events_port=kv.port, kv_events_replay_port=kv.replay_port or -1)
    await sim.close()
    return await start_sim(dataclasses.replace(cfg, **ports))
