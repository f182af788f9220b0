"""Engine protocols: one ``EngineAdapter`` per engine (``handlers.base``), looked up by name here."""

from __future__ import annotations

from collections.abc import Callable

from handlers.base import EngineAdapter
from handlers.sglang import SGLANG
from handlers.vllm import VLLM

ADAPTERS: dict[str, EngineAdapter] = {VLLM.engine: VLLM, SGLANG.engine: SGLANG}


# an engine's adapter by name (KeyError for another): the mapping's own lookup, in C, twice a request
adapter_for: Callable[[str], EngineAdapter] = ADAPTERS.__getitem__
