"""The ``models[].kv_events`` config block (read by ``gateway.kv_events`` and ``gateway.kv_index``),
and an endpoint's own ``kv_events`` (its publisher's ports, when engines share a host)."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

_Port = Annotated[int, Meta(ge=1, le=65535)]
_Seconds = Annotated[float, Meta(ge=0)]


class KVEventsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Subscribe to the engines' KV-cache events (vLLM/SGLang ``--kv-events-config``)."""

    enabled: bool = False
    port: _Port = 5557                      # the engine's PUB socket, on the endpoint's host
    replay_port: _Port | None = None        # the engine's replay ROUTER socket; None: no replay
    topic: str = ""                         # subscription prefix ("" = every topic)
    stall_timeout_s: _Seconds = 10.0        # a request needing new blocks, no event this long: fallback
    speculative_ttl_s: _Seconds = 10.0      # a routed request's new blocks count as held this long (or until events)
    replay_timeout_s: Annotated[float, Meta(gt=0)] = 2.0
    max_blocks_per_endpoint: Annotated[int, Meta(ge=1)] = 262144   # index entries per endpoint
    max_request_blocks: Annotated[int, Meta(ge=1)] = 16384          # a request's blocks keyed at most

    def with_annotation(self, values: dict) -> KVEventsConfig:
        """This block with a pod annotation's ``port``, ``replay_port`` and ``topic`` laid over it."""
        return msgspec.structs.replace(self, enabled=True, **values)


class KVEventsEndpointConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """An endpoint's ``kv_events``: this engine's publisher, laid over its model's block (as the pod
    annotation ``switchyard.io/kv-events`` is). Engines sharing a host publish on ports of their own."""

    port: _Port | None = None
    replay_port: _Port | None = None
    topic: str | None = None

    def items(self) -> tuple[tuple[str, object], ...]:
        """The keys given, as the endpoint's ``extra["kv_events"]`` holds them (like the annotation)."""
        return tuple((k, getattr(self, k)) for k in ("port", "replay_port", "topic") if getattr(self, k) is not None)
