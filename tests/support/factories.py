"""Factories: config blocks for a gateway in front of simulated engines, Kubernetes pods for the API
server emulator, parsed requests, endpoints and router contexts for pure code, and its small test
doubles (a settable clock, a fallback counter)."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec

from gateway.config.schema import Config, config_from_dict
from gateway.endpoints import Endpoint, EngineMetrics
from gateway.request import CHAT, InferenceRequest
from routers.base import RouterContext, RoutingSettings

MODEL_LABEL = "model.aibrix.ai/name"


def model_block(name: str, engine: str, urls: list[str], **extra: Any) -> dict[str, Any]:
    """A ``models:`` entry serving ``name`` from aggregated engines at ``urls``."""
    return {"name": name, "engine": engine, "endpoints": list(urls), **extra}


async def pd_pair(sims: Any, engine: str, **kw: Any) -> tuple[Any, Any]:
    """A prefill and a decode engine of model ``m`` (the ``sims`` fixture's factory)."""
    p = await sims(engine, "m", role="prefill", **kw)
    d = await sims(engine, "m", role="decode", **kw)
    return p, d


def roleset(engine: str, p: Any, d: Any, name: str = "rs-1", **extra: Any) -> dict[str, Any]:
    """A ``rolesets:`` entry; an SGLang prefill endpoint carries its bootstrap port."""
    if engine == "sglang":
        prefill: list[Any] = [{"url": p.url, "bootstrap_port": p.bootstrap_port}]
    else:
        prefill = [p.url]
    return {"name": name, "prefill": prefill, "decode": [d.url], **extra}


def pd_model(engine: str, rolesets: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"name": "m", "engine": engine, "rolesets": rolesets, **extra}


def sim_pod(emu: Any, name: str, sim: Any, model: str = "m", *, annotations: dict[str, str] | None = None,
            **labels: str) -> None:
    """A running pod in namespace ``llm`` of the Kubernetes emulator, serving ``model`` from ``sim``."""
    emu.create_pod("llm", name, {MODEL_LABEL: model, "model.aibrix.ai/port": str(sim.port), **labels},
                   ip="127.0.0.1", annotations=annotations)


class Clock:
    """A clock that stands still until a test moves it: ``clock.t += 5``."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Fallbacks(Counter):
    """Counts a router's fallbacks by ``(strategy, reason)``."""

    def __call__(self, strategy: str, reason: str) -> None:
        self[(strategy, reason)] += 1


def inference_request(text: str | None = None, *, tokens: int | None = None, model: str = "m", request_id: str = "r",
            path: str = CHAT, **fields: Any) -> InferenceRequest:
    """A parsed request as a router sees it. ``text`` is the prompt hashed for prefixes (``"x"`` four
    characters a token when only ``tokens`` is given); ``tokens`` the estimate (a quarter of the text's
    length when only ``text`` is given). A test file binds its own defaults with ``functools.partial``."""
    if text is None:
        text = "x" * (4 * tokens) if tokens is not None else "user\nhello there"
    if tokens is None:
        tokens = max(1, len(text) // 4)
    fields.setdefault("data", {})
    return InferenceRequest(path=path, body=b"{}", model=model, stream=False, include_usage=False,
                            prompt_text=text, prompt_tokens_est=tokens, request_id=request_id, **fields)


def endpoints(n: int, in_flight: Sequence[int] | None = None, *, model: str = "m",
              url: str = "http://127.0.0.1:{port}") -> list[Endpoint]:
    """``n`` aggregated endpoints of ``model``; ``url`` is formatted with ``port`` (9001, 9002, ...) and
    ``n1`` (1, 2, ...); ``in_flight`` sets each one's in-flight count."""
    eps = [Endpoint(url=url.format(port=9001 + i, n1=i + 1), model=model) for i in range(n)]
    for ep, k in zip(eps, in_flight or [0] * n, strict=True):
        ep.in_flight = k
    return eps


def router_ctx(seed: int = 1, clock: Clock | None = None, **settings: Any) -> tuple[RouterContext, Fallbacks]:
    """A router context with a seeded random source and a standing clock, and its fallback counter."""
    fallbacks = Fallbacks()
    ctx = RouterContext(rng=random.Random(seed), clock=clock or Clock(), settings=RoutingSettings(**settings),
                        on_fallback=fallbacks)
    return ctx, fallbacks


def endpoint(port: int = 1, **fields: Any) -> Endpoint:
    """An endpoint of model ``m`` on 127.0.0.1:``port``."""
    return Endpoint(url=f"http://127.0.0.1:{port}", model="m", **fields)


def pd_endpoint(n: int, role: str, roleset: str = "rs", lo: int = 0, hi: int = 0, **state: Any) -> Endpoint:
    """A vLLM endpoint 127.0.0.``n``:8000 with a P/D ``role``; ``lo``/``hi`` bound the prompts it takes;
    ``state`` sets attributes (``metrics=`` a fresh engine snapshot's fields)."""
    e = Endpoint(url=f"http://127.0.0.{n}:8000", model="m", engine="vllm", role=role, roleset=roleset,
                 min_prompt_tokens=lo, max_prompt_tokens=hi)
    metrics = state.pop("metrics", None)
    for k, v in state.items():
        setattr(e, k, v)
    if metrics is not None:
        e.metrics = EngineMetrics(scraped_at=time.monotonic(), **metrics)
    return e


def one_model(model: dict[str, Any]) -> Config:
    """A config with one vLLM model ``m``; ``model`` adds or overrides its keys."""
    return config_from_dict({"models": [{"name": "m", "engine": "vllm", **model}]}, source="<t>")


def block_stored(hashes: list[int], parent: int | None, tokens: list[int], **fields: Any) -> dict[str, Any]:
    """A KV event ``BlockStored`` in its map form (block size 16 unless ``fields`` say otherwise)."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": 16, **fields}


def event_batch(encoding: str, events: list[Any], rank: int = 0, ts: float = 1.0) -> bytes:
    """A KV event batch as msgpack: ``map`` (a map, as enginesim sends), else an array (as vLLM does)."""
    if encoding == "map":
        return msgspec.msgpack.encode({"ts": ts, "events": events, "data_parallel_rank": rank})
    return msgspec.msgpack.encode([ts, events, rank])


def block_stored_array(hashes: list[int], parent: int | None, tokens: list[int], *trailing: Any) -> list[Any]:
    """``BlockStored`` in its array form; ``trailing`` are the optional fields after the block size."""
    return ["BlockStored", hashes, parent, tokens, 16, *trailing]
