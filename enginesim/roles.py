"""Serving roles: where aggregated, prefill and decode engines differ.

The engine core (queue, KV pool, token loop) and the HTTP surface are the same for every role. A
role only changes a few points of a request's life, so it is a small object the engine calls at
those points:

- ``accept``: look at the request body before it is queued (e.g. ``kv_transfer_params`` or the
  SGLang ``bootstrap_*`` fields) and reject it with an ``ApiError`` if the role needs something;
- ``prefill``: spend the prefill time; a decode role would pull remote KV here instead of
  computing, and a prefill role would wait for its decode peer. Raising ``RequestFailed`` ends
  the request with an engine error (e.g. a failed KV load);
- ``response_extras``: extra top-level response fields (vLLM prefill: ``kv_transfer_params``);
- ``retain_blocks``: keep a finished request's KV blocks pinned (vLLM prefill: until the decode
  side pulls them or the lease expires; the role frees them later through the pool);
- ``routes``, ``start``, ``close``: side channels such as SGLang's bootstrap server.

Only ``aggregated`` exists today; prefill/decode modules plug in through ``make_role``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from enginesim.config import SimConfig

if TYPE_CHECKING:
    from enginesim.engine import Engine, Sequence


class Role(Protocol):
    name: str
    #: SGLang ``/model_info`` ``disaggregation_mode``: "null", "prefill" or "decode".
    disaggregation_mode: str

    def routes(self) -> list[web.RouteDef]: ...
    async def start(self) -> None: ...
    async def close(self) -> None: ...
    def accept(self, seq: Sequence, body: dict[str, Any]) -> None: ...
    async def prefill(self, seq: Sequence, compute_s: float) -> None: ...
    def response_extras(self, seq: Sequence) -> dict[str, Any]: ...
    def retain_blocks(self, seq: Sequence) -> bool: ...


class AggregatedRole:
    """One engine does prefill and decode; nothing crosses to a peer."""

    name = "aggregated"
    disaggregation_mode = "null"

    def __init__(self, cfg: SimConfig, engine: Engine) -> None:
        self.cfg = cfg
        self.engine = engine

    def routes(self) -> list[web.RouteDef]:
        return []

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def accept(self, seq: Sequence, body: dict[str, Any]) -> None:
        # A vLLM engine without a KV connector ignores kv_transfer_params and answers null.
        return None

    async def prefill(self, seq: Sequence, compute_s: float) -> None:
        await asyncio.sleep(compute_s)

    def response_extras(self, seq: Sequence) -> dict[str, Any]:
        return {}

    def retain_blocks(self, seq: Sequence) -> bool:
        return False


def make_role(cfg: SimConfig, engine: Engine) -> Role:
    if cfg.role == "aggregated":
        return AggregatedRole(cfg, engine)
    raise ValueError(f"role {cfg.role!r} is not implemented yet; only 'aggregated' is available")
