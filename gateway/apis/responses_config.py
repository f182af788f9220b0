"""The ``responses:`` config block (Responses API state; gateway/apis/responses.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from gateway.config.block import Block

_Seconds = Annotated[float, Meta(gt=0)]


class ResponsesHistoryConfig(Block):
    """Gateway-held history (``state: gateway``): what one response may store and for how long."""

    ttl_s: Annotated[_Seconds, Meta(description="How long a stored response (input and output items) is kept, in seconds.")] = 86400.0
    max_response_bytes: Annotated[int, Meta(ge=1024, description="A response record larger than this is not stored, in bytes.")] = 1 << 20
    max_total_bytes: Annotated[int, Meta(ge=1024, description="Memory backend: the oldest records are evicted beyond this total, in bytes. It is the gateway's: with several workers each keeps its share (1/N, at least max_response_bytes).")] = 256 << 20


class ResponsesConfig(Block):
    # engine: continuing a response (previous_response_id, GET/DELETE/cancel/input_items) is routed
    # to the endpoint that produced it (the affinity map); gateway: the gateway stores every
    # response's input and output and expands previous_response_id itself, on any endpoint
    state: Annotated[Literal["engine", "gateway"], Meta(description="engine: the engine keeps responses and a follow-up is routed to the endpoint that produced it; gateway: the gateway stores every response and expands previous_response_id itself, on any endpoint.")] = "engine"
    backend: Annotated[Literal["auto", "memory", "redis"], Meta(description="Where the gateway keeps its records: memory, redis, or auto (redis when state.redis_url is set).")] = "auto"
    affinity_ttl_s: Annotated[_Seconds, Meta(description="How long the response-id to endpoint entry is kept, in seconds.")] = 86400.0
    max_affinity_entries: Annotated[int, Meta(ge=1, description="Memory backend: the oldest entries are evicted beyond this many. It is the gateway's: with several workers each keeps its share (1/N).")] = 100_000
    history: Annotated[ResponsesHistoryConfig, Meta(description="Limits of gateway-held history (state: gateway).")] = ResponsesHistoryConfig()

    def __post_init__(self) -> None:
        h = self.history
        if h.max_total_bytes < h.max_response_bytes:
            raise ValueError("history.max_total_bytes: must be at least history.max_response_bytes")
