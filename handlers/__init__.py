"""Engine protocols: one ``EngineAdapter`` per engine (``handlers.base``), looked up by name here."""

from __future__ import annotations

from handlers.base import EngineAdapter
from handlers.sglang import SGLANG
from handlers.vllm import VLLM

ADAPTERS: dict[str, EngineAdapter] = {VLLM.engine: VLLM, SGLANG.engine: SGLANG}


def adapter_for(engine: str) -> EngineAdapter:
    return ADAPTERS[engine]
