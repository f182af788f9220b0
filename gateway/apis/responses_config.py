"""The ``responses:`` config block (Responses API state; gateway/apis/responses.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from gateway.config.block import Block

_Seconds = Annotated[float, Meta(gt=0)]


class ResponsesHistoryConfig(Block):
    """Gateway-held history (``state: gateway``): what one response may store and for how long."""

    ttl_s: _Seconds = 86400.0                 # a stored response (input + output items) lives this long
    max_response_bytes: Annotated[int, Meta(ge=1024)] = 1 << 20   # larger records are not stored
    max_total_bytes: Annotated[int, Meta(ge=1024)] = 256 << 20    # memory backend: oldest evicted past this


class ResponsesConfig(Block):
    # engine: continuing a response (previous_response_id, GET/DELETE/cancel/input_items) is routed
    # to the endpoint that produced it (the affinity map); gateway: the gateway stores every
    # response's input and output and expands previous_response_id itself, on any endpoint
    state: Literal["engine", "gateway"] = "engine"
    backend: Literal["auto", "memory", "redis"] = "auto"     # auto: redis when state.redis_url is set
    affinity_ttl_s: _Seconds = 86400.0        # how long a response id → endpoint entry is kept
    max_affinity_entries: Annotated[int, Meta(ge=1)] = 100_000    # memory backend: oldest evicted past this
    history: ResponsesHistoryConfig = ResponsesHistoryConfig()

    def __post_init__(self) -> None:
        h = self.history
        if h.max_total_bytes < h.max_response_bytes:
            raise ValueError("history.max_total_bytes: must be at least history.max_response_bytes")
