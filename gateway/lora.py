"""LoRA adapters: which endpoints serve which adapter, routing a request for one, loading on demand.

A client names an adapter in ``model``. The gateway knows adapters from two sources:

- discovery: every ``lora.discovery_interval_s`` it reads each endpoint's ``/v1/models``; entries
  with a ``parent`` are adapters (vLLM lists ``{id: name, root: path, parent: base}``), and the
  endpoint's model is their base. The scraper reads vLLM's ``vllm:lora_requests_info`` (its newest
  series) for the adapters running and waiting there and ``max_lora`` (gateway/engine_metrics.py).
- config: ``models[].adapters: {name: path}``, adapters the gateway may load.

A request for an adapter (``resolve``) becomes a request for the base model: its strategy, limits,
watchdog and metrics are the base model's, and ``InferenceRequest.lora`` names the adapter (the
prefix index keys its prompts apart; the body still says ``model: <adapter>``, which is how vLLM
picks the adapter; SGLang also gets ``lora_path``). Its strategy is ``lora.strategy``
(``lora-affinity``, routers/lora.py) unless the model locks one or the ``routing-strategy`` header
names one. Before routing (``prepare``) the candidates are narrowed to the endpoints that serve the
adapter. When none does and the model's ``adapters`` has it, it is loaded on the least-loaded ready
endpoint with a free slot (fewer active adapters than ``max_lora``; any endpoint if none has one),
with the engine's runtime call (handlers: vLLM ``POST /v1/load_lora_adapter``, SGLang
``/load_lora_adapter``), and the request goes there:

- concurrent requests for the same adapter wait on the one load (its outcome is theirs);
- a failed load answers 502 ``lora_load_failed`` with the engine's message, and that endpoint is
  not asked to load that adapter again for ``lora.failure_cooldown_s``; while every endpoint is
  cooling down, 503 with a Retry-After;
- a name that is neither a model, an alias nor a known adapter is 404 ``model_not_found``.

A P/D model's adapter requests (``serving_pairs``) are routed by ``pd`` among the endpoints that
serve the adapter, so both legs (and a request run whole, by conditional disaggregation) land on
engines that have it; when no prefill or no decode serves it, 503 names the missing role. Nothing is
loaded on demand for P/D models (the adapter has to be on both engines of a pair).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
import structlog
from prometheus_client import Gauge

from gateway.endpoints import Endpoint, EndpointPool
from gateway.errors import GatewayError
from gateway.ledger import AdapterInFlight
from gateway.metrics import Counter, Histogram
from gateway.upstream import Upstream, UpstreamFailure
from handlers import adapter_for

if TYPE_CHECKING:
    from gateway.config import Config
    from gateway.context import RequestContext

log = structlog.get_logger("switchyard.lora")

# adapters remembered as recently routed per endpoint (the engine's slots are far fewer)
_RECENT_KEPT = 64


class LoraMetrics:
    def __init__(self, registry) -> None:
        self.requests = Counter("switchyard_lora_requests", "Requests for a LoRA adapter, by the adapter's state "
                                "on the endpoint chosen (running, resident, free_slot, waiting, full, other)",
                                ["model", "adapter", "state"], registry=registry)
        self.loads = Counter("switchyard_lora_loads", "Runtime adapter loads the gateway asked for, by result "
                             "(ok, error, cooldown: refused while every endpoint cools down)",
                             ["model", "adapter", "result"], registry=registry)
        self.load_seconds = Histogram("switchyard_lora_load_seconds", "Duration of the engines' load calls",
                                      ["model"], registry=registry,
                                      buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.serving = Gauge("switchyard_lora_adapter_endpoints", "Endpoints serving each known adapter",
                             ["model", "adapter"], registry=registry)


class Lora:
    """The LoRA stage of one gateway: ``resolve`` and ``prepare`` before routing, ``charge`` after."""

    def __init__(self, config: Config, pool: EndpointPool, upstream: Upstream, metrics: LoraMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.upstream = upstream
        self.metrics = metrics
        self.clock = clock
        self.reconfigure(config)
        self._loads: dict[tuple[str, str], asyncio.Future[Endpoint]] = {}
        self._cooldown: dict[tuple[int, str], tuple[float, str]] = {}   # (id(ep), adapter) -> (until, message)
        self._loaded_at: dict[tuple[int, str], float] = {}
        self._task: asyncio.Task | None = None

    def reconfigure(self, config: Config) -> None:
        self.config = config
        self.settings = config.lora
        self.paths: dict[str, tuple[str, str]] = {a: (m.name, p) for m in config.models for a, p in m.adapters.items()}

    # -- before routing ------------------------------------------------------------------------

    def base_of(self, name: str) -> str | None:
        """The base model of adapter ``name``, if any endpoint serves it or the config lists it."""
        for ep in self.pool.endpoints():
            if name in ep.adapters.served:
                return ep.model
        configured = self.paths.get(name)
        return configured[0] if configured is not None else None

    def resolve(self, ctx: RequestContext) -> None:
        """Make a request that names an adapter a request for its base model (module docstring)."""
        ireq = ctx.ireq
        assert ireq is not None
        name = ireq.model
        if self.pool.has_model(name) or self.config.model(name) is not None:
            return
        base = self.base_of(name)
        if base is None:
            return          # the pipeline answers 404 model_not_found
        ireq.lora = name
        ireq.model = base
        ctx.rec.extra["lora_adapter"] = name
        eps = self.pool.endpoints(base)
        fields = adapter_for(eps[0].engine).lora_fields(name) if eps else {}
        if fields and ctx.api is None:
            ireq.data.update(fields)
            ireq.body = orjson.dumps(ireq.data)

    async def prepare(self, ctx: RequestContext, candidates: list[Endpoint]) -> list[Endpoint]:
        """The candidates that serve the request's adapter, after loading it if none does."""
        ireq = ctx.ireq
        assert ireq is not None and ireq.lora is not None
        adapter = ireq.lora
        serving = [ep for ep in candidates if adapter in ep.adapters.served]
        if serving:
            return serving
        configured = self.paths.get(adapter)
        if configured is None or configured[0] != ireq.model:
            raise GatewayError(503, f"no ready endpoint of model `{ireq.model}` serves the LoRA adapter `{adapter}`",
                               code="service_unavailable", headers={"Retry-After": "5"},
                               header=("x-error-no-model-backends", "true"), error_class="no_endpoint")
        key = (ireq.model, adapter)
        load = self._loads.get(key)
        if load is None:
            load = asyncio.ensure_future(self._load(ireq.model, adapter, configured[1], candidates))
            self._loads[key] = load
            load.add_done_callback(lambda f, key=key: self._load_done(key, f))
            ctx.rec.extra["lora_load"] = "started"
        else:
            ctx.rec.extra["lora_load"] = "joined"
        ep = await asyncio.shield(load)      # one client leaving does not stop the load for the others
        return [ep]

    def serving_pairs(self, ctx: RequestContext, candidates: list[Endpoint]) -> list[Endpoint]:
        """A P/D model's candidates that serve the request's adapter (module docstring)."""
        ireq = ctx.ireq
        assert ireq is not None and ireq.lora is not None
        adapter = ireq.lora
        serving = [ep for ep in candidates if adapter in ep.adapters.served]
        missing = [role for role in ("prefill", "decode") if not any(ep.role == role for ep in serving)]
        if missing:
            raise GatewayError(503, f"no ready {' or '.join(missing)} endpoint of the P/D model `{ireq.model}` serves "
                                    f"the LoRA adapter `{adapter}` (adapters are not loaded on demand for P/D models)",
                               code="service_unavailable", headers={"Retry-After": "5"},
                               header=("x-error-no-model-backends", "true"), error_class="no_endpoint")
        return serving

    def _load_done(self, key: tuple[str, str], fut: asyncio.Future[Endpoint]) -> None:
        if self._loads.get(key) is fut:
            del self._loads[key]
        if not fut.cancelled():
            fut.exception()         # retrieved: waiters re-raise it; none may be left

    def _cooling(self, ep: Endpoint, adapter: str, now: float) -> tuple[float, str] | None:
        c = self._cooldown.get((id(ep), adapter))
        if c is not None and c[0] <= now:
            del self._cooldown[(id(ep), adapter)]
            return None
        return c

    def target(self, candidates: list[Endpoint], adapter: str) -> Endpoint | None:
        """Where to load ``adapter``: the least-loaded ready endpoint not cooling down, among those
        with a free slot if any has one."""
        now = self.clock()
        usable = [ep for ep in candidates if ep.ready and self._cooling(ep, adapter, now) is None]
        if not usable:
            return None
        free = [ep for ep in usable if _free_slot(ep)]
        return min(free or usable, key=lambda ep: (ep.in_flight + ep.remote_in_flight, len(ep.adapters.served)))

    async def _load(self, model: str, adapter: str, path: str, candidates: list[Endpoint]) -> Endpoint:
        ep = self.target(candidates, adapter)
        if ep is None:
            now = self.clock()
            waits = [c for e in candidates if (c := self._cooling(e, adapter, now)) is not None]
            retry = max(1, math.ceil(min(c[0] for c in waits) - now)) if waits else 5
            last = waits[-1][1] if waits else "no ready endpoint"
            self.metrics.loads.labels(model, adapter, "cooldown").inc()
            raise GatewayError(503, f"the LoRA adapter `{adapter}` failed to load on every endpoint of `{model}` "
                                    f"recently ({last}); retrying in {retry}s",
                               code="lora_load_failed", headers={"Retry-After": str(retry)},
                               header=("x-error-lora-load", "cooldown"), error_class="lora_load")
        engine = adapter_for(ep.engine)
        call_path, body = engine.lora_load(adapter, path)
        start = self.clock()
        try:
            status, raw = await self.upstream.fetch(ep, call_path, body, {"Content-Type": "application/json"},
                                                    model, self.settings.load_timeout_s)
            error = engine.lora_load_error(status, raw)
        except UpstreamFailure as f:
            error = f.message
        self.metrics.load_seconds.labels(model).observe(self.clock() - start)
        if error is not None:
            self._cooldown[(id(ep), adapter)] = (self.clock() + self.settings.failure_cooldown_s, error)
            self.metrics.loads.labels(model, adapter, "error").inc()
            log.warning("lora load failed", model=model, adapter=adapter, endpoint=ep.name, error=error)
            raise GatewayError(502, f"loading the LoRA adapter `{adapter}` on {ep.name} failed: {error}",
                               code="lora_load_failed", header=("x-error-lora-load", "error"),
                               error_class="lora_load")
        ep.adapters.served[adapter] = model
        self._loaded_at[(id(ep), adapter)] = self.clock()
        self.metrics.loads.labels(model, adapter, "ok").inc()
        log.info("lora adapter loaded", model=model, adapter=adapter, endpoint=ep.name)
        return ep

    # -- after routing -------------------------------------------------------------------------

    def charge(self, ctx: RequestContext) -> None:
        """Count the request on its endpoint's adapter (released with the request's charges)."""
        ireq, d = ctx.ireq, ctx.decision
        if ireq is None or ireq.lora is None or d is None or d.prefill is not None:
            return
        ep, adapter = d.endpoint, ireq.lora
        state = d.reason if d.strategy and d.reason else "other"
        self.metrics.requests.labels(ireq.model, adapter, state if state in _STATES else "other").inc()
        ctx.charges.adapter = AdapterInFlight(ep, adapter)
        recent = ep.adapters.recent
        recent.pop(adapter, None)
        recent[adapter] = self.clock()
        if len(recent) > _RECENT_KEPT:
            del recent[next(iter(recent))]

    # -- discovery -----------------------------------------------------------------------------

    def start(self, session: aiohttp.ClientSession) -> None:
        if self.settings.discovery_interval_s > 0:
            self._task = asyncio.create_task(self._discover_loop(session), name="switchyard-lora-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _discover_loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            try:
                await self.discover(session)
            except asyncio.CancelledError:
                raise
            except Exception:       # a bug in one round must not stop discovery
                log.exception("lora discovery round failed")
            await asyncio.sleep(self.settings.discovery_interval_s)

    async def discover(self, session: aiohttp.ClientSession) -> None:
        eps = self.pool.endpoints()
        if eps:
            await asyncio.gather(*(self._discover_one(session, ep) for ep in eps))
        counts: dict[tuple[str, str], int] = {}
        for ep in self.pool.endpoints():
            for a in ep.adapters.served:
                counts[(ep.model, a)] = counts.get((ep.model, a), 0) + 1
        for (model, adapter), n in counts.items():
            self.metrics.serving.labels(model, adapter).set(n)

    async def _discover_one(self, session: aiohttp.ClientSession, ep: Endpoint) -> None:
        asked = self.clock()
        try:
            async with asyncio.timeout(self.config.scrape.timeout_s or 2.0):
                async with session.get(ep.url + "/v1/models") as r:
                    if r.status != 200:
                        return
                    data = orjson.loads(await r.read())
        except (TimeoutError, aiohttp.ClientError, OSError, orjson.JSONDecodeError):
            return
        found = served_adapters(data, ep.model)
        if found is None:
            return
        # an adapter the gateway loaded while the list was on its way stays
        for a, m in ep.adapters.served.items():
            if a not in found and self._loaded_at.get((id(ep), a), -1.0) >= asked:
                found[a] = m
        ep.adapters.served = found

    def describe(self) -> list[dict[str, Any]]:
        """Adapters for ``/v1/models``: each with its parent and how many ready endpoints serve it."""
        out: dict[str, dict[str, Any]] = {}
        for ep in self.pool.endpoints():
            for a in ep.adapters.served:
                entry = out.setdefault(a, {"id": a, "parent": ep.model, "ready_endpoints": 0})
                entry["ready_endpoints"] += int(ep.ready)
        for a, (model, _) in self.paths.items():
            out.setdefault(a, {"id": a, "parent": model, "ready_endpoints": 0, "loadable": True})
            out[a]["loadable"] = True
        return list(out.values())


_STATES = frozenset({"running", "resident", "free_slot", "waiting", "full"})


def _free_slot(ep: Endpoint) -> bool:
    m = ep.metrics
    if m is None or not m.max_lora:
        return True
    active = (m.lora_running or frozenset()) | (m.lora_waiting or frozenset()) | {
        a for a, n in ep.adapters.in_flight.items() if n}
    return len(active) < m.max_lora


def served_adapters(models: Any, base: str) -> dict[str, str] | None:
    """Adapters of a ``/v1/models`` answer (entries with a non-empty ``parent``) -> ``base``;
    ``None`` when the answer is not a model list."""
    if not isinstance(models, dict) or not isinstance(models.get("data"), list):
        return None
    return {e["id"]: base for e in models["data"]
            if isinstance(e, dict) and isinstance(e.get("id"), str) and e.get("parent")}
