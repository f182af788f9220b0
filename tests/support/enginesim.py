"""Helpers for tests that talk to simulated engines over real loopback sockets."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

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


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    """Poll ``check`` until it is true; a bound for slow machines, not a latency assertion."""
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.01)


async def sim_state(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/_sim/state") as resp:
        assert resp.status == 200
        return await resp.json()


async def wait_state(http: aiohttp.ClientSession, url: str,
                     pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The first ``/_sim/state`` snapshot that satisfies ``pred``."""
    found: dict[str, Any] = {}

    async def check() -> bool:
        nonlocal found
        found = await sim_state(http, url)
        return pred(found)

    await until(check)
    return found


async def metric_samples(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """``/metrics`` as ``{"name{sorted labels}": value}``, parsed with prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if kv)
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total
