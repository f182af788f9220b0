"""Factories: config blocks for a gateway in front of simulated engines, Kubernetes pods for the API
server emulator, and the small test doubles of pure code (a settable clock, a fallback counter)."""

from __future__ import annotations

from collections import Counter
from typing import Any

MODEL_LABEL = "model.aibrix.ai/name"


def model_block(name: str, engine: str, urls: list[str], **extra: Any) -> dict[str, Any]:
    """A ``models:`` entry serving ``name`` from aggregated engines at ``urls``."""
    return {"name": name, "engine": engine, "endpoints": list(urls), **extra}


async def pd_pair(sims: Any, engine: str, **kw: Any) -> tuple[Any, Any]:
    """A prefill and a decode engine of model ``m`` (the ``sims`` fixture's factory)."""
    p = await sims(engine, "m", role="prefill", **kw)
    d = await sims(engine, "m", role="decode", **kw)
    return p, d


def roleset(engine: str, p: Any, d: Any, name: str = "rs-1", **extra: Any) -> dict[str, Any]:
    """A ``rolesets:`` entry; an SGLang prefill endpoint carries its bootstrap port."""
    if engine == "sglang":
        prefill: list[Any] = [{"url": p.url, "bootstrap_port": p.bootstrap_port}]
    else:
        prefill = [p.url]
    return {"name": name, "prefill": prefill, "decode": [d.url], **extra}


def pd_model(engine: str, rolesets: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"name": "m", "engine": engine, "rolesets": rolesets, **extra}


def sim_pod(emu: Any, name: str, sim: Any, model: str = "m", *, annotations: dict[str, str] | None = None,
            **labels: str) -> None:
    """A running pod in namespace ``llm`` of the Kubernetes emulator, serving ``model`` from ``sim``."""
    emu.create_pod("llm", name, {MODEL_LABEL: model, "model.aibrix.ai/port": str(sim.port), **labels},
                   ip="127.0.0.1", annotations=annotations)


class Clock:
    """A clock that stands still until a test moves it: ``clock.t += 5``."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Fallbacks(Counter):
    """Counts a router's fallbacks by ``(strategy, reason)``."""

    def __call__(self, strategy: str, reason: str) -> None:
        self[(strategy, reason)] += 1
