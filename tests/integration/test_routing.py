"""Routing through the gateway: session headers round-trip, invalid strategies answer 400."""

from __future__ import annotations

import random
from collections.abc import Sequence

import aiohttp

from gateway.endpoints import Endpoint
from gateway.request import CHAT, InferenceRequest
from routers.base import RouterContext, RoutingSettings
from routers.session import decode_session_id
from tests.conftest import model_block
from tests.strategy_util import Clock, Fallbacks


def make_req(text: str = "user\nhello there", *, user: str | None = None, session_id: str | None = None,
             session_key: str | None = None, model: str = "m") -> InferenceRequest:
    return InferenceRequest(path=CHAT, body=b"{}", data={}, model=model, stream=False, include_usage=False,
                            prompt_text=text, prompt_tokens_est=max(1, len(text) // 4), request_id="r",
                            user=user, session_id=session_id, session_key=session_key)


def make_eps(n: int, in_flight: Sequence[int] | None = None, base: str = "10.0.0") -> list[Endpoint]:
    eps = [Endpoint(url=f"http://{base}.{i + 1}:8000", model="m") for i in range(n)]
    for ep, k in zip(eps, in_flight or [0] * n, strict=True):
        ep.in_flight = k
    return eps


def ctx_for(seed: int = 1, clock: Clock | None = None, **knobs) -> tuple[RouterContext, Fallbacks]:
    fallbacks = Fallbacks()
    return RouterContext(rng=random.Random(seed), clock=clock or Clock(), settings=RoutingSettings(**knobs),
                         on_fallback=fallbacks), fallbacks


async def test_session_header_round_trip_through_the_gateway(sims, gateway):
    engines = [await sims("vllm", "m") for _ in range(3)]
    gw = await gateway([model_block("m", "vllm", [e.url for e in engines], strategy="session-affinity")])
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            sid, pod = r.headers["x-session-id"], r.headers["target-pod"]
        assert decode_session_id(sid) == pod
        for _ in range(5):
            async with s.post(gw.url + "/v1/completions", json=body, headers={"x-session-id": sid}) as r:
                assert r.status == 200 and r.headers["target-pod"] == pod and r.headers["x-session-id"] == sid
        pods = set()
        for _ in range(3):
            async with s.post(gw.url + "/v1/completions", json=body, headers={"x-session-key": "chat-9"}) as r:
                pods.add(r.headers["target-pod"])
        assert len(pods) == 1


async def test_invalid_strategy_is_400_through_the_gateway(sims, gateway):
    e = await sims("vllm", "m")
    f = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [e.url, f.url])])
    async with aiohttp.ClientSession() as s:
        for spec in ("invalid-routing-strategy", "least-request:1,invalid-strategy:2"):
            async with s.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
                              headers={"routing-strategy": spec}) as r:
                assert r.status == 400 and r.headers["x-error-routing"] == "true"
        async with s.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
                          headers={"routing-strategy": "prefix-cache:3,least-request:2,least-kv-cache:2"}) as r:
            assert r.status == 200
