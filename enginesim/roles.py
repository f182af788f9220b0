"""Serving roles: where aggregated, prefill and decode engines differ.

The engine core (queue, KV pool, token loop) and the HTTP surface are the same for every role. A
role only changes a few points of a request's life, so it is a small object the engine calls at
those points:

- ``accept``: look at the request body before it is queued (e.g. ``kv_transfer_params`` or the
  SGLang ``bootstrap_*`` fields) and reject it with an ``ApiError`` if the role needs something;
- ``wants_stage`` / ``stage``: park a request *before* the scheduler queue, as SGLang's P/D
  bootstrap and transfer queues do (the request holds no running slot meanwhile). Raising
  ``RequestFailed`` from ``stage`` ends the request;
- ``prefill``: spend the prefill time; a decode role pulls remote KV here instead of computing, a
  prefill role sends its KV to the decode peer. Raising ``RequestFailed`` ends the request with an
  engine error (e.g. a failed KV load), or with an abort carrying an HTTP status;
- ``response_extras``: extra top-level response fields (vLLM prefill: ``kv_transfer_params``);
- ``retain_blocks``: keep a finished request's KV blocks pinned (vLLM prefill: until the decode
  side pulls them or the lease expires; the role frees them later through the pool);
- ``on_finish``: the request finished (any reason), so the role can drop what it keeps for it;
- ``state`` / ``gauges``: the ``pd`` section of ``/_sim/state``, SGLang's P/D queue gauges;
- ``routes``, ``start``, ``close``: side channels such as vLLM's NIXL side channel or SGLang's
  bootstrap server. ``side_channel_port`` / ``bootstrap_port`` are the ports they bound.

A role reaches back into its engine only through ``RoleHost`` (the KV pool, the tokenizer, the
metrics, ``reschedule``), so this module and the P/D roles do not import the engine.

The P/D roles live in ``pd_vllm.py`` (NIXL pull) and ``pd_sglang.py`` (bootstrap rendezvous);
``role_factory.make_role`` picks one for a config.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from aiohttp import web

from enginesim.config import SimConfig
from enginesim.kvcache import BlockPool
from enginesim.metrics import EngineMetrics
from enginesim.sequence import Sequence
from enginesim.tokenizer import FakeTokenizer


class RoleHost(Protocol):
    """What a role uses of its engine; ``Engine`` is one."""

    @property
    def pool(self) -> BlockPool: ...
    @property
    def tokenizer(self) -> FakeTokenizer: ...
    @property
    def metrics(self) -> EngineMetrics: ...  # read on each use: ``/_sim/reset`` replaces it
    def reschedule(self) -> None: ...


class Role(Protocol):
    name: str
    #: SGLang ``/model_info`` ``disaggregation_mode``: "null", "prefill" or "decode".
    disaggregation_mode: str
    side_channel_port: int | None
    bootstrap_port: int | None

    def routes(self) -> list[web.RouteDef]: ...
    async def start(self) -> None: ...
    async def close(self) -> None: ...
    def accept(self, seq: Sequence, body: dict[str, Any], prompt: int = 0, prompts: int = 1) -> None: ...
    def wants_stage(self, seq: Sequence) -> bool: ...
    async def stage(self, seq: Sequence) -> None: ...
    async def prefill(self, seq: Sequence, compute_s: float) -> None: ...
    def response_extras(self, seq: Sequence) -> dict[str, Any]: ...
    def retain_blocks(self, seq: Sequence) -> bool: ...
    def on_finish(self, seq: Sequence) -> None: ...
    def state(self) -> dict[str, Any] | None: ...
    def gauges(self) -> dict[str, float]: ...


class BaseRole:
    """Defaults for every hook: the aggregated behaviour."""

    name = "aggregated"
    disaggregation_mode = "null"
    side_channel_port: int | None = None
    bootstrap_port: int | None = None

    def __init__(self, cfg: SimConfig, engine: RoleHost) -> None:
        self.cfg = cfg
        self.engine = engine

    def routes(self) -> list[web.RouteDef]:
        return []

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def accept(self, seq: Sequence, body: dict[str, Any], prompt: int = 0, prompts: int = 1) -> None:
        # A vLLM engine without a KV connector ignores kv_transfer_params and answers null.
        return None

    def wants_stage(self, seq: Sequence) -> bool:
        return False

    async def stage(self, seq: Sequence) -> None:
        return None

    async def prefill(self, seq: Sequence, compute_s: float) -> None:
        await asyncio.sleep(compute_s)

    def response_extras(self, seq: Sequence) -> dict[str, Any]:
        return {}

    def retain_blocks(self, seq: Sequence) -> bool:
        return False

    def on_finish(self, seq: Sequence) -> None:
        return None

    def state(self) -> dict[str, Any] | None:
        return None

    def gauges(self) -> dict[str, float]:
        return {}


class AggregatedRole(BaseRole):
    """One engine does prefill and decode; nothing crosses to a peer."""

