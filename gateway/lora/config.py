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

    strategy: str = "lora-affinity"     # adapter requests' strategy unless the header or a lock names one
    discovery_interval_s: _Seconds = 10.0   # GET /v1/models on every endpoint this often (0: off)
    load_timeout_s: _Positive = 60.0        # one runtime load call
    failure_cooldown_s: _Seconds = 60.0     # after a failed load, that endpoint is not asked again this long
    max_adapters_per_endpoint: _Count = 0   # before a load onto an endpoint serving this many, unload one (0: no cap)
    idle_unload_s: _Seconds = 0.0           # unload adapters the gateway loaded that saw no request this long (0: never)


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
