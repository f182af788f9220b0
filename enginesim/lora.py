"""LoRA adapters in the simulated engine: registered adapters, GPU slots with LRU, the runtime
load/unload calls, and vLLM's ``lora_requests_info`` gauge.

- An adapter is *registered* by ``--lora-modules name=path`` or the runtime load call (vLLM
  ``POST /v1/load_lora_adapter``, SGLang ``POST /load_lora_adapter``, ``{lora_name, lora_path}``);
  a request naming an unregistered adapter gets the engine's 404 (vLLM's "model does not exist").
  A path is "found" unless it is absolute and missing on disk (vLLM: ``No adapter found for ...``,
  404), so hub-style ids such as ``org/adapter`` always load. The unload call (vLLM
  ``POST /v1/unload_lora_adapter``, SGLang ``POST /unload_lora_adapter``, ``{lora_name}``) drops
  the registration; requests already running on it finish.
- ``max_loaded_loras`` (> 0) caps the registered adapters: a load beyond it is refused with
  ``LoraFull``, which each API words as its engine does (SGLang ``--max-loaded-loras``: "Cannot
  load LoRA adapter ... Maximum number of loaded LoRA adapters is N. Please unload some LoRA
  adapters before loading new ones.", 400; vLLM's plain ``WorkerLoRAManager`` at ``--max-cpu-loras``:
  "No free adapter slots.", 400 BadRequestError; vLLM's default LRU manager evicts from its CPU
  cache instead, which the simulator does not model). With ``lora_full_evicts`` the load succeeds
  and the least recently used adapter without running requests is unloaded, as SGLang 0.5.23 does.
- A running request's adapter must sit in one of ``max_loras`` GPU slots. An adapter not in a slot
  takes a free one, or evicts the least recently used adapter no running request uses, and costs
  ``lora_load_ms`` (the cold load) before its prefill; when every slot is held by adapters in use,
  the request waits for one (its adapter is then *waiting*).
- ``vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}`` is set to the
  current time under the current label set whenever it is rendered; earlier label sets keep their
  older timestamps (as in vLLM, where a reader takes the newest series).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from typing import Any


class LoraError(Exception):
    def __init__(self, status: int, message: str, type_: str) -> None:
        super().__init__(message)
        self.status, self.message, self.type_ = status, message, type_


class LoraFull(LoraError):
    """A load refused because ``max_loaded_loras`` adapters are registered."""

    def __init__(self, name: str, path: str, cap: int) -> None:
        super().__init__(400, f"{cap} adapters are loaded", "BadRequestError")
        self.name, self.path, self.cap = name, path, cap


class LoraSlots:
    def __init__(self, max_loras: int, load_ms: float, modules: dict[str, str], max_loaded: int = 0,
                 evict_when_full: bool = False) -> None:
        self.max_loras = max_loras
        self.max_loaded = max_loaded                            # registered adapters allowed (0: no cap)
        self.evict_when_full = evict_when_full                  # at the cap: unload the LRU one, not refuse
        self.used: dict[str, float] = {}                        # adapter -> when a request last took it
        self.load_s = load_ms / 1000.0
        self.registered: dict[str, str] = dict(modules)        # name -> path
        self.slots: OrderedDict[str, int] = OrderedDict()      # resident adapter -> running users (LRU order)
        self.waiting: dict[str, int] = {}                      # adapter -> requests waiting for a slot
        self.loading: dict[str, asyncio.Future[None]] = {}
        self.cold_loads = 0
        self.evictions = 0
        self.unloads = 0
        self._changed = asyncio.Event()

    # -- registration ----------------------------------------------------------------------------

    def load(self, name: Any, path: Any) -> str:
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise LoraError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name in self.registered:
            raise LoraError(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
        if os.path.isabs(path) and not os.path.exists(path):
            raise LoraError(404, f"No adapter found for {path}", "NotFoundError")
        if self.max_loaded and len(self.registered) >= self.max_loaded:
            idle = [a for a in self.registered if not self.slots.get(a)]
            if not self.evict_when_full or not idle:
                raise LoraFull(name, path, self.max_loaded)
            self.unload(min(idle, key=lambda a: self.used.get(a, 0.0)))    # SGLang's LRU eviction
        self.registered[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: Any) -> str:
        if not isinstance(name, str) or name not in self.registered:
            raise LoraError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.registered[name]
        self.used.pop(name, None)
        self.unloads += 1
        if self.slots.get(name) == 0:
            del self.slots[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    # -- slots -----------------------------------------------------------------------------------

    async def acquire(self, name: str) -> None:
        """Hold a slot for ``name`` for one running request; cold-load it first if needed."""
        self.used[name] = time.monotonic()
        while True:
            if name in self.slots:
                self.slots[name] += 1
                self.slots.move_to_end(name)
                pending = self.loading.get(name)
                if pending is not None:
                    try:
                        await asyncio.shield(pending)
                    except asyncio.CancelledError:
                        self.release(name)
                        raise
                return
            if len(self.slots) >= self.max_loras:
                idle = next((a for a, users in self.slots.items() if users == 0), None)
                if idle is not None:
                    del self.slots[idle]
                    self.evictions += 1
            if len(self.slots) < self.max_loras:
                self.slots[name] = 1
                self.cold_loads += 1
                done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self.loading[name] = done
                try:
                    await asyncio.sleep(self.load_s)
                except asyncio.CancelledError:
                    self.release(name)
                    raise
                finally:
                    self.loading.pop(name, None)
                    done.set_result(None)
                return
            self.waiting[name] = self.waiting.get(name, 0) + 1
            try:
                self._changed.clear()
                await self._changed.wait()
            finally:
                left = self.waiting[name] - 1
                if left:
                    self.waiting[name] = left
                else:
                    del self.waiting[name]

    def release(self, name: str) -> None:
        users = self.slots.get(name)
        if users is None:
            return
        self.slots[name] = users - 1
        if users - 1 == 0:
            if name not in self.registered:
                del self.slots[name]
            self._changed.set()

    def running(self) -> list[str]:
        return [a for a, users in self.slots.items() if users]

    def info_labels(self) -> dict[str, str]:
        return {"running_lora_adapters": ",".join(self.running()),
                "waiting_lora_adapters": ",".join(self.waiting), "max_lora": str(self.max_loras)}

    def state(self) -> dict[str, Any]:
        return {"registered": dict(self.registered), "slots": dict(self.slots), "waiting": dict(self.waiting),
                "max_loras": self.max_loras, "max_loaded": self.max_loaded, "cold_loads": self.cold_loads,
                "evictions": self.evictions, "unloads": self.unloads}


def stamp() -> float:
    return time.time()
