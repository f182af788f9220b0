"""The ``lora:`` config block and the checks of ``models[].adapters`` (gateway/lora/adapters.py reads them).

A module of its own so that gateway/config/schema.py can import it without importing the runtime.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated

from msgspec import Meta

from gateway.config.block import Block

_Seconds = Annotated[float, Meta(ge=0)]
_Positive = Annotated[float, Meta(gt=0)]
_Count = Annotated[int, Meta(ge=0)]


class LoraConfig(Block):
    """LoRA adapters: discovery, the strategy of adapter requests, loading and unloading on demand."""

    strategy: Annotated[str, Meta(description="Routing strategy of requests naming an adapter, unless a lock or the routing-strategy header names one.")] = "lora-affinity"
    discovery_interval_s: Annotated[_Seconds, Meta(description="How often every endpoint's /v1/models is read to learn the adapters it serves, and its model's max_model_len (a vLLM P/D request that cannot fit in its decode's runs whole there: docs/pd.md), in seconds (0: off).")] = 10.0
    load_timeout_s: Annotated[_Positive, Meta(description="Longest runtime adapter load call, in seconds.")] = 60.0
    failure_cooldown_s: Annotated[_Seconds, Meta(description="After a failed load, that endpoint is not asked to load the adapter again for this long, in seconds.")] = 60.0
    max_adapters_per_endpoint: Annotated[_Count, Meta(description="Before loading onto an endpoint already serving this many adapters, unload one (0: no cap).")] = 0
    idle_unload_s: Annotated[_Seconds, Meta(description="Unload adapters the gateway loaded that saw no request for this long, in seconds (0: never).")] = 0.0


def check_adapters(models: Sequence[tuple[str, Mapping[str, str]]]) -> None:
    """An adapter name is not a model's and belongs to one model; its path is not empty."""
    names = {m for m, _ in models}
    owner: dict[str, int] = {}
    for i, (_, adapters) in enumerate(models):
        for name, path in adapters.items():
            if name in names:
                raise ValueError(f"models[{i}].adapters.{name}: {name!r} is a model; an adapter may not shadow it")
            if name in owner:
                raise ValueError(f"models[{i}].adapters.{name}: also an adapter of models[{owner[name]}]")
            if not path:
                raise ValueError(f"models[{i}].adapters.{name}: the path is empty")
            owner[name] = i
