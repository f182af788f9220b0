"""LoRA adapters: which endpoints serve which adapter, routing a request for one, loading and
unloading on demand.

A client names an adapter in ``model``. The gateway knows adapters from two sources:

- discovery: every ``lora.discovery_interval_s`` it reads each endpoint's ``/v1/models``; entries
  with a ``parent`` are adapters (vLLM lists ``{id: name, root: path, parent: base}``), and the
  endpoint's model is their base. The scraper reads vLLM's ``vllm:lora_requests_info`` (its newest
  series) for the adapters running and waiting there and ``max_lora`` (gateway/upstream/engine_metrics.py).
- config: ``models[].adapters: {name: path}``, adapters the gateway may load.

A request for an adapter (``resolve``) becomes a request for the base model: its strategy, limits,
watchdog and metrics are the base model's, and ``InferenceRequest.lora`` names the adapter (the
prefix index keys its prompts apart; the body still says ``model: <adapter>``, which is how vLLM
picks the adapter; SGLang also gets ``lora_path``). Its strategy is ``lora.strategy``
(``lora-affinity``, routers/lora.py) unless the model locks one or the ``routing-strategy`` header
names one. Before routing (``prepare``) the candidates are narrowed to the endpoints that serve the
adapter. When none does and the model's ``adapters`` has it, it is loaded (``_load``) on the
least-loaded ready endpoint (``target``) with room under ``max_adapters_per_endpoint`` (else one
with an adapter to unload, below), and among those with a free slot (fewer active adapters than
``max_lora``) if any has one, with the engine's runtime call (handlers: vLLM
``POST /v1/load_lora_adapter``, SGLang ``/load_lora_adapter``), and the request goes there:

- concurrent requests for the same adapter wait on the one load (its outcome is theirs);
- a failed load answers 502 ``lora_load_failed`` with the engine's message, and that endpoint is
  not asked to load that adapter again for ``lora.failure_cooldown_s`` (or until its engine is seen
  to restart: ``on_health``, ``engine_restarted``); while every endpoint is cooling down, 503 with
  a Retry-After. A load the engine refuses as full, with no adapter of this
  gateway to unload there, goes on to the next endpoint and cools none down (a slot may free at any
  moment); the 502 is the last refusal's when every endpoint refused;
- a name that is neither a model, an alias nor a known adapter is 404 ``model_not_found``.

A P/D model's adapter requests (``serving_pairs``) are routed by ``pd`` among the endpoints that
serve the adapter, so both legs (and a request run whole, by conditional disaggregation) land on
engines that have it. With no ready prefill or no ready decode at all (no pair, so ``pd`` runs
requests whole on a combined endpoint), the request is one for the combined endpoints, as
``prepare`` makes it (else 503 naming the missing role); so is one the pairs cannot serve (the
engine's ``unsplit``, SGLang's: a decode that never prefills by itself) when the model has
combined endpoints and none of them serves the adapter yet. When no prefill or no decode serves it and
the model's ``adapters`` has it,
the same ``_load`` runs for each missing role among that role's endpoints, concurrently, as one
shared load per (model, adapter) (apart from a whole-request load of it, for a request a header sent
to the model's combined endpoints: ``_shared_load``); the first failure is every waiter's 502 (the other role's load
still completes and stays). An adapter the config does not list: 503 naming the missing role.

Unloading (the engine's unload call: vLLM ``POST /v1/unload_lora_adapter``, SGLang
``/unload_lora_adapter``, ``{lora_name}``). An adapter is never unloaded from an endpoint where
this gateway has requests for it in flight (``charge`` counts a P/D request on both its prefill and
its decode until the request ends; with several workers, a sibling's count too: below); it leaves
the endpoint's served set before the call, so no new request is routed to it meanwhile; a failed
unload puts it back. Only adapters the config lists for the endpoint's model are unloaded by
``capacity`` and ``error`` (the gateway can load them again), only adapters the gateway loaded by
``idle``:

- ``capacity``: before loading onto an endpoint that serves (or is loading) ``max_adapters_per_endpoint``
  adapters, the least recently used one there (last routed, or loaded, by this gateway; one
  discovered and never routed first) with nothing in flight is unloaded. When every ready endpoint
  is at the cap with all its adapters in use: 503 ``lora_load_failed`` (``x-error-lora-load: full``,
  Retry-After 1);
- ``idle``: with ``idle_unload_s``, a background pass (every half of it, 50 ms..30 s) unloads the
  adapters the gateway loaded that saw no request for that long;
- ``error``: a load the engine refuses as full (handlers ``lora_full``: SGLang's
  ``--max-loaded-loras`` answer, vLLM's "No free adapter slots.") unloads one idle adapter there and
  is retried once.

Known gap: a request that has passed ``prepare`` but is not yet charged (waiting in admission) does
not hold its adapter; an unload in that window sends it to an engine without the adapter, which
answers its error. The least-recently-used order (a fresh load counts as a use) makes that rare.

Several workers: each worker tells its siblings of the loads and unloads it makes (``share``, the
routing view, with ``view.share_monitoring``: ``told_adapters`` → their ``adopt_change``), so a
sibling neither loads an adapter again that is there nor sends requests for one to an engine that
no longer has it, and at each idle pass of the adapters it used or has requests in flight for
(``tell_uses`` → ``adopt_use``), which count in their idle and least-recently-used choices. When
an adapter's requests in flight on an endpoint go from none to one or back to none, it tells them
every adapter it has requests in flight for, and where (``AdapterInFlight``'s ``told`` →
``share.told_busy``, with the next batch, and again every ``view.heartbeat_s`` while there are
any); a sibling never unloads one of those there, for ``capacity``, ``idle`` or ``error``
(``_busy_elsewhere``), until told they ended or the worker is silent for ``view.peer_ttl_s``
(stopped; a restarted one's first word clears them). A load it starts is told to them at once,
again every ``view.heartbeat_s`` while under way, and its end (``told_load_started``,
``told_load_ended`` → ``adopt_load_started``, ``adopt_load_ended``); a sibling that needs the
adapter meanwhile waits for that end (``_await_sibling``) instead of loading it too, for at most
``load_timeout_s`` and not past ``view.peer_ttl_s`` without word of it. A load that fails is told
with its cooldown's end (``told_load_failed`` → ``adopt_load_failed``): they do not ask that
endpoint for that adapter until then either. What stays each worker's own: the bus hop before the
siblings hear of a load (two workers that both start loading an adapter within it make two load
calls; the engine answers the second that the adapter is there, which counts as loaded), a load
under way as room under the cap (two workers loading two adapters onto one endpoint at once may
pass it for a moment), and the moment between a sibling's request being charged and its
word arriving (a bus hop; the fresh load or use makes the adapter the last the least-recently-used
order picks).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import random
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, NoReturn

import aiohttp
import orjson
import structlog
from prometheus_client import Gauge

from gateway.endpoints import Endpoint, EndpointPool, engine_headers
from gateway.errors import ErrorClass, GatewayError
from gateway.observability.metrics import Counter, Histogram
from gateway.pipeline.ledger import AdapterInFlight
from gateway.request import bad_body, body_bytes
from gateway.resilience.outcome import key_refused
from gateway.upstream.monitor import EndpointRounds
from gateway.upstream.upstream import Upstream, UpstreamFailure, engine_key_refused, no_socket_error
from handlers import ADAPTERS, adapter_for

if TYPE_CHECKING:
    from gateway.config.schema import Config
    from gateway.pipeline.context import RequestContext

log = structlog.get_logger("switchyard.lora")

# adapters remembered as recently routed per endpoint (the engine's slots are far fewer)
_RECENT_KEPT = 64


# the body members each engine picks an adapter by, besides ``model`` (SGLang's ``lora_path``): a
# request for a base model that names one is refused (``Lora._refuse_adapter_in_body``)
_ENGINE_BODY_KEYS: dict[str, tuple[str, ...]] = {e: tuple(a.lora_fields("")) for e, a in ADAPTERS.items()}
_BODY_KEYS = frozenset(k for keys in _ENGINE_BODY_KEYS.values() for k in keys)


class LoraMetrics:
    def __init__(self, registry) -> None:
        self.requests = Counter("switchyard_lora_requests", "Requests for a LoRA adapter, by the adapter's state "
                                "on the endpoint chosen (running, resident, free_slot, waiting, full, other)",
                                ["model", "adapter", "state"], registry=registry)
        self.loads = Counter("switchyard_lora_loads", "Runtime adapter loads the gateway asked for, by result "
                             "(ok, error, cooldown: refused while every endpoint cools down, full: every "
                             "endpoint at max_adapters_per_endpoint with adapters in use, no_socket: the "
                             "gateway could open no socket for the load call, so no engine was asked)",
                             ["model", "adapter", "result"], registry=registry)
        self.load_seconds = Histogram("switchyard_lora_load_seconds", "Duration of the engines' load calls",
                                      ["model"], registry=registry,
                                      buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.unloads = Counter("switchyard_lora_unloads", "Adapters the gateway unloaded, by reason (capacity: "
                               "room for another under max_adapters_per_endpoint, idle: idle_unload_s, error: "
                               "the engine refused a load as full; engine: the engine unloaded it itself to make room, seen in a "
                               "load's answer)", ["model", "adapter", "reason"],
                               registry=registry)
        self.load_waits = Counter("switchyard_lora_load_waits", "Loads a sibling worker had under way that this "
                                  "worker waited for instead of loading the adapter itself, by outcome (loaded, "
                                  "failed: its cooldown is this worker's too, ended: neither, silent: the sibling "
                                  "was not heard for view.peer_ttl_s, timeout: lora.load_timeout_s passed)",
                                  ["model", "adapter", "outcome"], registry=registry)
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
        self.random = random.random       # breaks ties between equally loaded endpoints in ``target``
        # set by a reload that changes discovery_interval_s: the loop takes the new period at once
        self._rediscover = asyncio.Event()
        self.reconfigure(config)
        self._loads: dict[tuple[str, str, bool], asyncio.Future[Any]] = {}     # (model, adapter, pairs) -> its load
        # keyed by (id(ep), adapter), each indexed by endpoint (``_PerEndpoint``)
        self._cooldown: _PerEndpoint = _PerEndpoint()          # -> (until, message)
        self._loaded_at: _PerEndpoint = _PerEndpoint()         # adapters this gateway loaded -> when
        self._unloaded_at: _PerEndpoint = _PerEndpoint()
        self._pending: dict[int, set[str]] = {}                # id(ep) -> adapters being loaded there
        self._unloading: set[tuple[int, str]] = set()
        self._down: set[int] = set()                            # id(ep) of endpoints the probes found down
        self._counted: dict[tuple[str, str], int] = {}          # (model, adapter) -> what the serving gauge says
        self._sibling_used: _PerEndpoint = _PerEndpoint()       # -> a sibling worker's last use
        self._sibling_loads: _PerEndpoint = _PerEndpoint()      # -> a sibling's load under way (_SiblingLoad)
        self._uses_told_at = -math.inf
        # keyed by id(ep): an endpoint that left the pool leaves them, or a new one at its address
        # would inherit its cooldowns and its loads
        pool.removal_listeners.append(self._forget)
        # an endpoint a reload declared again with other settings is the same engine: its adapters stay
        pool.replacement_listeners.append(self._replaced)
        self._left: tuple[Endpoint, dict[str, dict]] | None = None     # the last endpoint forgotten, what it had
        self._task: asyncio.Task | None = None
        self._idle_task: asyncio.Task | None = None
        self._reads = EndpointRounds("lora-discovery")      # each endpoint's /v1/models read under way
        # the shared routing view when the workers share discovery (view.share_monitoring), else None
        self.share: Any = None

    def reconfigure(self, config: Config) -> None:
        before = getattr(self, "settings", None)
        self.config = config
        self.settings = config.lora
        if before is not None and before.discovery_interval_s != config.lora.discovery_interval_s:
            self._rediscover.set()
        self.paths: dict[str, tuple[str, str]] = {a: (m.name, p) for m in config.models for a, p in m.adapters.items()}
        self._alias_names = frozenset(a.name for a in config.aliases)
        if before is not None:
            # a reload (its endpoints already brought to the new config): the series of a model it
            # removed, and the 0 of an adapter it took off a model's list, go now, not at the next
            # discovery round (never, with discovery off)
            self.count_serving()

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
            if ctx.api is None and not _BODY_KEYS.isdisjoint(ireq.data):
                self._refuse_adapter_in_body(ireq.data, name)
            return
        base = self.base_of(name)
        if base is None:
            return          # the pipeline answers 404 model_not_found
        ireq.lora = name
        ireq.model = base
        ctx.rec.extra["lora_adapter"] = name
        eps = self.pool.endpoints(base)
        fields = adapter_for(eps[0].engine).lora_fields(name) if eps else {}
        if not fields:
            return
        if ctx.api is not None:
            # the engine picks the adapter by a body field (SGLang's lora_path) that its request on
            # this path has no place for (its Messages, Responses, rerank...): the base model would
            # answer under the adapter's name
            raise GatewayError(400, f"`{name}` is a LoRA adapter of `{base}`, whose {eps[0].engine} engines select an "
                                    f"adapter by the body's `lora_path`, which POST {ireq.path} does not carry: send "
                                    "it to /v1/chat/completions or /v1/completions", param="model",
                               code="adapter_unsupported_path", error_class=ErrorClass.VALIDATION)
        ireq.data.update(fields)
        ireq.body = body_bytes(ireq.data, ireq.body)

    def _refuse_adapter_in_body(self, data: dict[str, Any], model: str) -> None:
        """A 400 for a request for base model ``model`` whose body names an adapter in a member its
        engine picks one by (SGLang's ``lora_path``, a name or a list of them, one a prompt; null, ""
        and a list of those name none): the engine would run the adapter while the gateway routed,
        limited, logged and counted the base model, on an endpoint that may not hold the adapter,
        and may unload it under the request."""
        eps = self.pool.endpoints(model)
        m = self.config.model(model)
        engine = eps[0].engine if eps else m.engine if m is not None else None
        for key in _ENGINE_BODY_KEYS.get(engine or "", ()):
            v = data.get(key)
            if v and (isinstance(v, str) or isinstance(v, list) and any(isinstance(x, str) and x for x in v)):
                raise bad_body(f"`{key}` selects a LoRA adapter on {engine} engines, which the gateway does not "
                               f"route by: name the adapter in `model` (its requests are routed to the endpoints "
                               f"that serve it, and loaded there on demand)", key, "unsupported_parameter")

    async def prepare(self, ctx: RequestContext, candidates: list[Endpoint]) -> list[Endpoint]:
        """The candidates that serve the request's adapter, after loading it if none does."""
        ireq = ctx.ireq
        assert ireq is not None and ireq.lora is not None
        adapter = ireq.lora
        serving = [ep for ep in candidates if adapter in ep.adapters.served]
        if serving:
            return serving
        path = self._loadable(ireq.model, adapter, "")
        ep = await self._shared_load(ctx, ireq.model, adapter, False,
                                     lambda: self._load(ireq.model, adapter, path, candidates))
        return [ep]

    async def serving_pairs(self, ctx: RequestContext, candidates: list[Endpoint]) -> list[Endpoint]:
        """A P/D model's candidates that serve the request's adapter, after loading it on the
        roles none serves (module docstring)."""
        ireq = ctx.ireq
        assert ireq is not None and ireq.lora is not None
        adapter, model = ireq.lora, ireq.model
        whole = [ep for ep in candidates if ep.role not in ("prefill", "decode")]
        if whole and not (engine := adapter_for(whole[0].engine)).decode_runs_whole \
                and engine.unsplit(ireq) is not None:
            # the pairs cannot serve it (SGLang's n > 1): it runs whole on a combined endpoint
            # (gateway/pd/decide.py), where the adapter is wanted, not on the pairs
            loaded = [] if any(adapter in ep.adapters.served for ep in whole) else await self.prepare(ctx, whole)
            return [ep for ep in candidates if adapter in ep.adapters.served] or loaded
        missing = self._missing_roles(candidates, adapter)
        if missing:
            unpaired = [r for r in missing if not any(ep.role == r for ep in candidates)]
            if unpaired:
                # no ready endpoint of a role: no pair at all, and ``pd`` runs the request whole on a
                # combined endpoint, where the adapter is wanted (loaded as for a whole request)
                whole = [ep for ep in candidates if ep.role not in ("prefill", "decode")]
                if not whole:
                    self._no_endpoint(model, adapter, " or ".join(unpaired))
                return await self.prepare(ctx, whole)
            path = self._loadable(model, adapter, " or ".join(missing))
            await self._shared_load(ctx, model, adapter, True, lambda: self._load_roles(model, adapter, path, candidates))
            missing = self._missing_roles(candidates, adapter)
            if missing:     # unloaded again in the meantime (never while requests are in flight)
                self._no_endpoint(model, adapter, " or ".join(missing))
        return [ep for ep in candidates if adapter in ep.adapters.served]

    @staticmethod
    def _missing_roles(candidates: list[Endpoint], adapter: str) -> list[str]:
        return [role for role in ("prefill", "decode")
                if not any(ep.role == role and adapter in ep.adapters.served for ep in candidates)]

    def _loadable(self, model: str, adapter: str, roles: str) -> str:
        """The path of ``adapter`` when the config lets the gateway load it for ``model``; else 503."""
        configured = self.paths.get(adapter)
        if configured is None or configured[0] != model:
            self._no_endpoint(model, adapter, roles)
        return configured[1]

    @staticmethod
    def _no_endpoint(model: str, adapter: str, roles: str) -> None:
        what = f"ready {roles} endpoint of the P/D model" if roles else "ready endpoint of model"
        raise GatewayError(503, f"no {what} `{model}` serves the LoRA adapter `{adapter}`",
                           code="service_unavailable", headers={"Retry-After": "5"},
                           header=("x-error-no-model-backends", "true"), error_class=ErrorClass.NO_ENDPOINT)

    async def _shared_load(self, ctx: RequestContext, model: str, adapter: str, pairs: bool,
                           start: Callable[[], Any]) -> Any:
        """The outcome of the one load of (``model``, ``adapter``) in progress, started by ``start``
        if none is: concurrent requests share it. ``pairs``: a load on the P/D roles that lack it
        (``serving_pairs``), else on one whole-request endpoint (``prepare``): a P/D model's request
        whose routing-strategy header names a whole-request strategy runs on its combined endpoints,
        where the pairs' load puts nothing, and a pd request needs a prefill and a decode, which the
        combined endpoints' load does not give; each waits for a load of its own kind."""
        key = (model, adapter, pairs)
        load = self._loads.get(key)
        if load is None:
            load = asyncio.ensure_future(start())
            self._loads[key] = load
            load.add_done_callback(lambda f, key=key: self._load_done(key, f))
            ctx.rec.extra["lora_load"] = "started"
        else:
            ctx.rec.extra["lora_load"] = "joined"
        return await asyncio.shield(load)      # one client leaving does not stop the load for the others

    async def _load_roles(self, model: str, adapter: str, path: str, candidates: list[Endpoint]) -> list[Endpoint]:
        """Load ``adapter`` on one endpoint of each P/D role none of ``candidates`` serves it on,
        concurrently; the first failure is the outcome (the other role's load still completes)."""
        roles = self._missing_roles(candidates, adapter)
        done = await asyncio.gather(*(self._load(model, adapter, path, [ep for ep in candidates if ep.role == role])
                                      for role in roles), return_exceptions=True)
        for r in done:
            if isinstance(r, BaseException):
                raise r
        return list(done)   # type: ignore[arg-type]

    def _load_done(self, key: tuple[str, str, bool], fut: asyncio.Future[Any]) -> None:
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
        """Where to load ``adapter``: the least-loaded ready endpoint not cooling down (fewest
        requests in flight, then fewest adapters held, then at random), among those with room under
        ``max_adapters_per_endpoint`` (else those with an adapter to unload) and then those with a
        free slot if any has one."""
        now = self.clock()
        usable = [ep for ep in candidates if ep.ready and self._cooling(ep, adapter, now) is None]
        cap = self.settings.max_adapters_per_endpoint
        if cap:
            usable = ([ep for ep in usable if len(self._held(ep) - {adapter}) < cap]
                      or [ep for ep in usable if self._victim(ep, adapter) is not None])
        if not usable:
            return None
        best: Endpoint | None = None
        low = None
        ties = 0
        rand = self.random
        for ep in [ep for ep in usable if _free_slot(ep)] or usable:
            load = (ep.in_flight + ep.remote_in_flight, len(ep.adapters.served))
            if low is None or load < low:
                best, low, ties = ep, load, 1
            elif load == low:       # equals picked at random, as the routers do (reservoir sampling)
                ties += 1
                if rand() * ties < 1.0:
                    best = ep
        return best

    async def _load(self, model: str, adapter: str, path: str, candidates: list[Endpoint]) -> Endpoint:
        refused: list[Endpoint] = []        # refused the load as full, with nothing to unload there
        while True:
            if self._sibling_loads:
                waited = await self._await_sibling(model, adapter, candidates)
                if waited is not None:
                    if adapter in waited.adapters.served:
                        return waited
                    continue        # failed (cooling down now), or ended without it: choose again
            target = self.target([c for c in candidates if all(c is not r for r in refused)], adapter)
            if target is None:
                if refused:
                    break           # the last refusal is the answer
                self._no_target(model, adapter, candidates)
            ep = target
            share = self.share
            if share is not None:
                share.told_load_started(ep, adapter, model)
            try:
                error = await self._load_on(ep, model, adapter, path)
            except BaseException as e:
                if share is not None:
                    share.told_load_ended(ep, adapter, model, None)
                if isinstance(e, GatewayError) and e.error_class == ErrorClass.GATEWAY_RESOURCES:
                    # no socket for the call (``_engine_call``): no engine was asked, none cools down
                    self.metrics.loads.labels(model, adapter, "no_socket").inc()
                raise
            if error is None:
                ep.adapters.served[adapter] = model
                self._loaded_at[(id(ep), adapter)] = at = self.clock()
                if share is not None:
                    share.told_adapters(ep, at, {adapter: model}, True)
                    share.told_load_ended(ep, adapter, model, at)
                self.metrics.loads.labels(model, adapter, "ok").inc()
                log.info("lora adapter loaded", model=model, adapter=adapter, endpoint=ep.name)
                self.count_serving()
                return ep
            self.metrics.loads.labels(model, adapter, "error").inc()
            log.warning("lora load failed", model=model, adapter=adapter, endpoint=ep.name, error=error)
            if not adapter_for(ep.engine).lora_full(error):
                self._cooldown[(id(ep), adapter)] = (until := self.clock() + self.settings.failure_cooldown_s, error)
                if share is not None:
                    share.told_load_failed(ep, adapter, model, until, error)
                break
            if share is not None:
                share.told_load_ended(ep, adapter, model, None)
            # full of adapters this gateway may not unload (another gateway's, or in use): a slot
            # may free at any time, so no cooldown, but another endpoint may have room now
            refused.append(ep)
        raise GatewayError(502, f"loading the LoRA adapter `{adapter}` on {ep.name} failed: {error}",
                           code="lora_load_failed", header=("x-error-lora-load", "error"),
                           error_class=ErrorClass.LORA_LOAD)

    async def _await_sibling(self, model: str, adapter: str, candidates: list[Endpoint]) -> Endpoint | None:
        """When a sibling worker has a load of ``adapter`` under way on one of ``candidates``: its end,
        awaited for at most ``load_timeout_s``, or until the sibling is not heard for
        ``view.peer_ttl_s`` (it stopped); the endpoint (which serves the adapter if the load went
        well). None when no sibling is loading it there."""
        for ep in candidates:
            entry = self._sibling_loads.get(key := (id(ep), adapter))
            if entry is not None:
                break
        else:
            return None
        if entry.done is None:
            entry.done = asyncio.get_running_loop().create_future()
        done, ttl = entry.done, self.config.view.peer_ttl_s
        deadline = self.clock() + self.settings.load_timeout_s
        while not done.done():
            now = self.clock()
            left = min(deadline, entry.heard + ttl) - now
            if left <= 0:
                outcome = "timeout" if now >= deadline else "silent"
                if self._sibling_loads.get(key) is entry:
                    del self._sibling_loads[key]      # loaded here, then, unless another sibling starts it
                break
            await asyncio.wait((done,), timeout=left)
        else:
            outcome = done.result()
        self.metrics.load_waits.labels(model, adapter, outcome).inc()
        log.info("lora load awaited from a sibling worker", model=model, adapter=adapter, endpoint=ep.name,
                 outcome=outcome)
        return ep

    def adopt_load_started(self, ep: Endpoint, adapter: str, sender: str, run: int) -> None:
        """Sibling worker ``sender`` (its process ``run``) started loading ``adapter`` on ``ep``, or
        says again that it is under way: a request for it here waits for its end (``_await_sibling``)."""
        key = (id(ep), adapter)
        entry = self._sibling_loads.get(key)
        if entry is None or entry.sender != sender or entry.run != run:
            if entry is not None:
                entry.end("ended")          # another load of it (two workers started at once): the newest is awaited
            self._sibling_loads[key] = _SiblingLoad(sender, run, self.clock())
        else:
            entry.heard = self.clock()

    def adopt_load_ended(self, ep: Endpoint, adapter: str, model: str, at: float | None) -> None:
        """A sibling worker's load of ``adapter`` on ``ep`` ended: loaded at ``at`` (as ``adopt_change``
        would), or (None) neither loaded nor failed; whoever waited for it here goes on."""
        if at is not None:
            self.adopt_change(ep, at, {adapter: model}, True)
        entry = self._sibling_loads.pop((id(ep), adapter), None)
        if entry is not None:
            entry.end("loaded" if at is not None else "ended")

    def sibling_run(self, sender: str, run: int) -> None:
        """A message from sibling ``sender``'s process ``run``: its loads of an earlier run (it
        restarted) will never end, and are not waited for."""
        if not self._sibling_loads:
            return
        for key in [k for k, e in self._sibling_loads.items() if e.sender == sender and e.run != run]:
            self._sibling_loads.pop(key).end("silent")

    def _no_target(self, model: str, adapter: str, candidates: list[Endpoint]) -> NoReturn:
        """No endpoint may be asked to load ``adapter``: raise the 503 that says why."""
        now = self.clock()
        waits = [c for e in candidates if (c := self._cooling(e, adapter, now)) is not None]
        if not waits and any(e.ready for e in candidates) and self.settings.max_adapters_per_endpoint:
            self.metrics.loads.labels(model, adapter, "full").inc()
            raise GatewayError(503, f"every ready endpoint of `{model}` that could load the LoRA adapter "
                                    f"`{adapter}` holds {self.settings.max_adapters_per_endpoint} adapters "
                                    f"(lora.max_adapters_per_endpoint), each with requests in flight",
                               code="lora_load_failed", headers={"Retry-After": "1"},
                               header=("x-error-lora-load", "full"), error_class=ErrorClass.LORA_LOAD)
        retry = max(1, math.ceil(min(c[0] for c in waits) - now)) if waits else 5
        last = waits[-1][1] if waits else "no ready endpoint"
        self.metrics.loads.labels(model, adapter, "cooldown").inc()
        raise GatewayError(503, f"the LoRA adapter `{adapter}` failed to load on every endpoint of `{model}` "
                                f"recently ({last}); retrying in {retry}s",
                           code="lora_load_failed", headers={"Retry-After": str(retry)},
                           header=("x-error-lora-load", "cooldown"), error_class=ErrorClass.LORA_LOAD)

    async def _load_on(self, ep: Endpoint, model: str, adapter: str, path: str) -> str | None:
        """Load ``adapter`` on ``ep``, unloading one first to stay under the cap and once more when
        the engine refuses it as full; ``None`` when it is there, else the engine's message."""
        pending = self._pending.setdefault(id(ep), set())
        pending.add(adapter)
        try:
            cap = self.settings.max_adapters_per_endpoint
            if cap and len(self._held(ep) - {adapter}) >= cap and (victim := self._victim(ep, adapter)) is not None:
                await self.unload(ep, victim, "capacity")
            engine = adapter_for(ep.engine)
            error = await self._load_call(ep, model, adapter, path)
            if error is not None and engine.lora_full(error) and (victim := self._victim(ep, adapter)) is not None \
                    and await self.unload(ep, victim, "error"):
                error = await self._load_call(ep, model, adapter, path)     # once
        finally:
            pending.discard(adapter)
            if not pending and self._pending.get(id(ep)) is pending:
                del self._pending[id(ep)]
        return error

    async def _load_call(self, ep: Endpoint, model: str, adapter: str, path: str) -> str | None:
        """The engine's load call; ``None`` when the adapter is there now, else the engine's message."""
        engine = adapter_for(ep.engine)
        start = self.clock()
        answer: list[bytes] = []
        error = await self._engine_call(ep, model, engine.lora_load(adapter, path), engine.lora_load_error, answer,
                                        local_raises=True)
        self.metrics.load_seconds.labels(model).observe(self.clock() - start)
        if error is None and answer and (held := engine.lora_loaded(answer[0])) is not None:
            self._evicted(ep, held | {adapter})
        return error

    def _evicted(self, ep: Endpoint, held: set[str]) -> None:
        """The engine holds only ``held`` now: an adapter the gateway thought it served there that
        is not among them was unloaded by the engine to make room (SGLang at --max-loaded-loras), and
        leaves the served set, so its next request loads it again instead of meeting the engine's
        "not loaded" error."""
        for a in [a for a in ep.adapters.served if a not in held and (id(ep), a) not in self._unloading]:
            model = self._not_served(ep, a)
            self.metrics.unloads.labels(model, a, "engine").inc()
            log.info("lora adapter unloaded by its engine", model=model, adapter=a, endpoint=ep.name)

    def _not_served(self, ep: Endpoint, adapter: str) -> str:
        """``adapter`` is no longer on ``ep`` as the gateway sees it (the next request loads it
        again); its base model."""
        model = ep.adapters.served.pop(adapter)
        self._loaded_at.pop((id(ep), adapter), None)
        self._unloaded_at[(id(ep), adapter)] = at = self.clock()    # a discovery answer on its way is older
        if self.share is not None:
            self.share.told_adapters(ep, at, {adapter: model}, False)
        self.count_serving()
        return model

    async def _engine_call(self, ep: Endpoint, model: str, call: tuple[str, bytes],
                           judge: Callable[[int, bytes], str | None], answer: list[bytes] | None = None,
                           local_raises: bool = False) -> str | None:
        """POST an adapter call to ``ep``; ``None`` when ``judge`` finds the answer fine, else why not.
        ``answer`` gets the answer's bytes. A call this process could make no socket for tells nothing
        of the engine: with ``local_raises`` (a load, which a request awaits) it is the main path's
        503 ``gateway_resources``, and no cooldown follows; else (an unload) it failed. A call that
        outlasts ``load_timeout_s`` fails, but is no fault for the endpoint's breaker (an engine
        reading a large adapter is slow, not broken)."""
        try:
            status, raw = await self.upstream.fetch(ep, call[0], call[1], {"Content-Type": "application/json"},
                                                    model, self.settings.load_timeout_s, timeout_fault=False)
            if key_refused(status, ep.api_key is not None):     # counted and logged by the fetch
                return f"the engine refused the gateway's credentials for it (status {status})"
            if answer is not None:
                answer.append(raw)
            return judge(status, raw)
        except UpstreamFailure as f:
            if f.local and local_raises:
                raise no_socket_error(f) from None
            return f.message

    # -- unloading -----------------------------------------------------------------------------

    def _held(self, ep: Endpoint) -> set[str]:
        """The adapters ``ep`` serves or is loading (what ``max_adapters_per_endpoint`` counts)."""
        return set(ep.adapters.served) | self._pending.get(id(ep), set())

    def _last_used(self, ep: Endpoint, adapter: str) -> float:
        """When ``adapter`` was last routed to ``ep`` or loaded there by this gateway (a sibling
        worker's uses included)."""
        key = (id(ep), adapter)
        return max(ep.adapters.recent.get(adapter, -math.inf), self._loaded_at.get(key, -math.inf),
                   self._sibling_used.get(key, -math.inf))

    def _victim(self, ep: Endpoint, keep: str) -> str | None:
        """The adapter to unload from ``ep`` to make room for ``keep``: the least recently used one
        with no request in flight there, among those the config lets the gateway load again."""
        mine = [a for a in ep.adapters.served
                if a != keep and self.paths.get(a, ("",))[0] == ep.model and not ep.adapters.in_flight.get(a)
                and (id(ep), a) not in self._unloading and not self._busy_elsewhere(ep, a)]
        return min(mine, key=lambda a: self._last_used(ep, a), default=None)

    def _busy_elsewhere(self, ep: Endpoint, adapter: str) -> bool:
        """Whether a sibling worker has requests for ``adapter`` in flight on ``ep`` (as it last
        told, within ``view.peer_ttl_s``)."""
        share = self.share
        if share is None or not share.sibling_busy(ep, adapter):
            return False
        log.debug("lora adapter kept: a sibling worker has requests in flight for it", model=ep.model,
                  adapter=adapter, endpoint=ep.name)
        return True

    async def unload(self, ep: Endpoint, adapter: str, reason: str) -> bool:
        """Unload ``adapter`` from ``ep`` (reason: capacity, idle, error) unless requests for it
        are in flight there; whether it is gone. New requests stop going there first."""
        if ep.adapters.in_flight.get(adapter) or (id(ep), adapter) in self._unloading \
                or self._busy_elsewhere(ep, adapter):
            return False
        model = ep.adapters.served.pop(adapter, None)
        if model is None:
            return False
        self._unloading.add((id(ep), adapter))
        engine = adapter_for(ep.engine)
        try:
            error = await self._engine_call(ep, model, engine.lora_unload(adapter), engine.lora_unload_error)
        finally:
            self._unloading.discard((id(ep), adapter))
        if error is not None:
            ep.adapters.served[adapter] = model       # still there as far as the gateway knows
            log.warning("lora unload failed", model=model, adapter=adapter, endpoint=ep.name, reason=reason,
                        error=error)
            return False
        self._loaded_at.pop((id(ep), adapter), None)
        self._unloaded_at[(id(ep), adapter)] = at = self.clock()
        if self.share is not None:
            self.share.told_adapters(ep, at, {adapter: model}, False)
        ep.adapters.recent.pop(adapter, None)
        self.metrics.unloads.labels(model, adapter, reason).inc()
        log.info("lora adapter unloaded", model=model, adapter=adapter, endpoint=ep.name, reason=reason)
        self.count_serving()
        return True

    async def unload_idle(self) -> int:
        """Unload the adapters this gateway loaded that saw no request for ``idle_unload_s`` and
        have none in flight; how many went."""
        idle = self.settings.idle_unload_s
        if not idle:
            return 0
        now = self.clock()
        # those this gateway loaded, not every adapter the engines list (50 engines of 1,000 each
        # are 50,000, at every pass)
        eps = {id(ep): ep for ep in self.pool.endpoints()}
        due = [(ep, a) for i, a in list(self._loaded_at)
               if (ep := eps.get(i)) is not None and a in ep.adapters.served and not ep.adapters.in_flight.get(a)
               and now - self._last_used(ep, a) >= idle and not self._busy_elsewhere(ep, a)]
        if not due:
            return 0
        return sum(await asyncio.gather(*(self.unload(ep, a, "idle") for ep, a in due)))

    # -- after routing -------------------------------------------------------------------------

    def charge(self, ctx: RequestContext) -> None:
        """Count the request on its endpoints' adapter, both of a P/D pair (released with the
        request's charges; an adapter with requests in flight on an endpoint is not unloaded there)."""
        ireq, d = ctx.ireq, ctx.decision
        if ireq is None or ireq.lora is None or d is None:
            return
        adapter = ireq.lora
        state = d.reason if d.strategy and d.reason else "other"
        self.metrics.requests.labels(ireq.model, adapter, state if state in _STATES else "other").inc()
        share = self.share
        told = share.told_busy if share is not None else None
        if d.prefill is None:
            ctx.charges.adapter = AdapterInFlight(d.endpoint, adapter, told)
            eps = (d.endpoint,)
        else:
            ctx.charges.adapter = _PairAdapterInFlight(d.prefill, d.endpoint, adapter, told)
            eps = (d.prefill, d.endpoint)
        now = self.clock()
        for ep in eps:
            recent = ep.adapters.recent
            recent.pop(adapter, None)
            recent[adapter] = now
            if len(recent) > _RECENT_KEPT:
                del recent[next(iter(recent))]

    def on_health(self, ep: Endpoint) -> None:
        """A monitor listener: an endpoint the probes found down and now up again may be an engine
        that restarted, without the adapters this gateway loaded there. They leave its served set,
        so the next request for one loads it again (an engine that still has it answers "already
        loaded", which counts as loaded) instead of getting the engine's "not loaded" error."""
        i = id(ep)
        if not ep.healthy:
            self._down.add(i)
            return
        if i not in self._down:
            return
        self._down.discard(i)
        self._load_again(ep, "lora adapter to load again after its endpoint was down")

    def engine_restarted(self, ep: Endpoint) -> None:
        """A monitor restart listener: ``ep``'s scrape names a new start of the engine, which the
        probes may not have seen down (it restarted between two of them); as in ``on_health``."""
        self._load_again(ep, "lora adapter to load again after its engine restarted")

    def _load_again(self, ep: Endpoint, event: str) -> None:
        i = id(ep)
        for a in [a for a in ep.adapters.served if (i, a) in self._loaded_at and not ep.adapters.in_flight.get(a)]:
            log.info(event, model=self._not_served(ep, a), adapter=a, endpoint=ep.name)
        # a load that failed there failed on the engine before (often as it went down): the new one
        # was never asked
        self._cooldown.take(i)

    def _forget(self, ep: Endpoint) -> None:
        i = id(ep)
        self._down.discard(i)
        left: dict[str, dict] = {}
        for name, d in (("cooldown", self._cooldown), ("loaded_at", self._loaded_at),
                        ("unloaded_at", self._unloaded_at), ("sibling_used", self._sibling_used)):
            left[name] = d.take(i)
        self._left = (ep, left)     # until the next removal: a reload's replacement comes right after it
        for entry in self._sibling_loads.take(i).values():
            entry.end("ended")      # whoever waits chooses among those left
        self._pending.pop(i, None)

    def _replaced(self, old: Endpoint, new: Endpoint) -> None:
        """A reload declared ``old``'s engine again at its URL with other settings, as ``new``: the
        engine holds its adapters still. ``new`` shares ``old``'s adapter state (what it serves, this
        gateway's requests in flight there per adapter, which those on ``old`` release as they end,
        and the recently routed), and takes over what ``_forget`` took of ``old``: the adapters this
        gateway loaded there (still its own, for ``idle_unload_s`` and a restart), those it unloaded,
        their cooldowns and the siblings' uses. Otherwise an adapter discovery found there was
        unknown until the next round (a 404 for a request naming it), and one the gateway loaded was
        loaded again and, no longer its own, never unloaded as idle."""
        left, self._left = self._left, None
        new.adapters = old.adapters
        if left is not None and left[0] is old:
            i = id(new)
            for name, d in (("cooldown", self._cooldown), ("loaded_at", self._loaded_at),
                            ("unloaded_at", self._unloaded_at), ("sibling_used", self._sibling_used)):
                for adapter, value in left[1][name].items():
                    d[(i, adapter)] = value
        self.count_serving()

    def settle(self, ctx: RequestContext) -> None:
        """A request for an adapter that its engine answered it does not have (restarted without
        it, or unloaded by another gateway): the adapter leaves that endpoint's served set, so the
        next request loads it again (or, not in the config, is told no endpoint serves it) instead
        of meeting the same error until the next discovery round (never, with discovery off). Of a
        P/D pair, only the leg whose engine answered the error, as the request's error class says (a
        prefill's, or the decode's status): the other leg's engine still has it, and a load call
        there would be answered "already loaded" (and counted as a load)."""
        ireq, d, rec = ctx.ireq, ctx.decision, ctx.rec
        if ireq is None or ireq.lora is None or d is None or rec.status is None or rec.status < 400:
            return
        adapter, message = ireq.lora, rec.error or ""
        legs: tuple[Endpoint | None, ...] = (d.endpoint, d.prefill)
        if d.prefill is not None and rec.error_class in _PREFILL_FAILED:
            legs = (d.prefill,)
        elif d.prefill is not None and rec.error_class == ErrorClass.UPSTREAM_STATUS:
            legs = (d.endpoint,)
        for ep in legs:
            if ep is None or ep.adapters.served.get(adapter) is None or (id(ep), adapter) in self._unloading:
                continue
            if not adapter_for(ep.engine).lora_missing(rec.status, message, adapter):
                continue
            self._not_served(ep, adapter)
            log.warning("lora adapter missing on its endpoint", model=ep.model, adapter=adapter,
                        endpoint=ep.name, error=message)

    # -- discovery -----------------------------------------------------------------------------

    def start(self, session: aiohttp.ClientSession) -> None:
        # started off (0) too: a reload may turn it on
        self._task = asyncio.create_task(self._discover_loop(session), name="switchyard-lora-discovery")
        self._idle_task = asyncio.create_task(self._idle_loop(), name="switchyard-lora-idle-unload")

    async def stop(self) -> None:
        for task in (self._task, self._idle_task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self._task = self._idle_task = None
        await self._reads.stop()

    async def _idle_loop(self) -> None:
        """Every half ``idle_unload_s`` (within 50 ms..30 s; 1 s while it is 0, so a reload may turn it on)."""
        while True:
            idle = self.settings.idle_unload_s
            await asyncio.sleep(min(30.0, max(0.05, idle / 2)) if idle else 1.0)
            try:
                self.tell_uses()
                await self.unload_idle()
            except asyncio.CancelledError:
                raise
            except Exception:       # a bug in one pass must not stop the next
                log.exception("lora idle unload pass failed")

    async def _discover_loop(self, session: aiohttp.ClientSession) -> None:
        """A round every ``discovery_interval_s``, none while it is 0 (off). A reload that changes it
        wakes the loop (``reconfigure``): a new period applies at once, not after the old one ends,
        and one turned off waits for a reload that turns it on, not 0 s between rounds."""
        while True:
            if self.settings.discovery_interval_s > 0:
                try:
                    await self.discover(session)
                except asyncio.CancelledError:
                    raise
                except Exception:       # a bug in one round must not stop discovery
                    log.exception("lora discovery round failed")
            self._rediscover.clear()
            interval = self.settings.discovery_interval_s
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval if interval > 0 else None):
                    await self._rediscover.wait()

    async def discover(self, session: aiohttp.ClientSession) -> None:
        eps = self.pool.endpoints()
        share = self.share
        if share is not None:       # the endpoints this worker watches; the siblings tell of the others
            stale = 2 * self.settings.discovery_interval_s + (self.config.scrape.timeout_s or 2.0)
            eps = [ep for ep in eps if share.watches(ep, "models", stale)]
        # each endpoint's read on its own: one engine that never answers holds no other's
        await self._reads.run(eps, partial(self._discover_one, session), self.settings.discovery_interval_s)
        self.count_serving()

    def count_serving(self) -> None:
        """Set ``switchyard_lora_adapter_endpoints``: after each discovery round, load and unload.
        An adapter no endpoint serves any more reads 0, not its last count, when the config lists it
        for that model; one it does not (an engine's own, listed once) has its series removed, so
        the adapters engines list and drop over a long life do not each keep a series."""
        last = self._counted
        counts = {k: 0 for k in last if self.paths.get(k[1], ("",))[0] == k[0]}
        # per model, by Counter (no Python step per endpoint and adapter: 50 engines of 1,000
        # adapters each are 50,000 of them, at every load, unload and discovery round)
        for model in self.pool.models():
            served: collections.Counter[str] = collections.Counter()
            for ep in self.pool.endpoints(model):
                served.update(ep.adapters.served.keys())
            counts.update(((model, a), n) for a, n in served.items())
        for model, adapter in last.keys() - counts.keys():
            with contextlib.suppress(KeyError):
                self.metrics.serving.remove(model, adapter)
        for (model, adapter), n in counts.items():
            if last.get((model, adapter)) != n:     # the series unchanged since the last count stay as they are
                self.metrics.serving.labels(model, adapter).set(n)
        self._counted = counts

    async def _discover_one(self, session: aiohttp.ClientSession, ep: Endpoint) -> None:
        asked = self.clock()
        found = context = None
        try:
            async with asyncio.timeout(self.config.scrape.timeout_s or 2.0):
                async with session.get(ep.url + "/v1/models", headers=engine_headers(ep, {})) as r:
                    if r.status == 200:
                        listed = orjson.loads(await r.read())
                        found, context = served_adapters(listed, ep.model), model_context(listed, ep.model)
                    elif key_refused(r.status, ep.api_key is not None):
                        engine_key_refused(self.upstream.metrics, ep, ep.model, r.status, "/v1/models")
        except (TimeoutError, aiohttp.ClientError, OSError, orjson.JSONDecodeError):
            pass
        if self.share is not None:
            self.share.told_models(ep, asked, found, context)
        if found is not None:
            ep.max_model_len = context
            self.adopt_models(ep, asked, dict(found))

    def adopt_models(self, ep: Endpoint, asked: float, found: dict[str, str]) -> None:
        """``ep``'s adapters as its ``/v1/models`` listed them when asked at ``asked`` (this
        worker's clock, or the sibling's that watches it: ``time.monotonic`` is the machine's)."""
        # an adapter the gateway loaded while the list was on its way stays; one it unloaded (or is
        # unloading) meanwhile stays out
        for a, m in ep.adapters.served.items():
            if a not in found and self._loaded_at.get((id(ep), a), -1.0) >= asked:
                found[a] = m
        for a in list(found):
            if (id(ep), a) in self._unloading or self._unloaded_at.get((id(ep), a), -1.0) >= asked:
                del found[a]
        if self._alias_names:
            # the file's check cannot see an engine's adapters: a reload warns of those it finds
            # under an alias's name (gateway/server/reload.py), and this of those found since
            for a in self._alias_names.intersection(found).difference(ep.adapters.served):
                log.warning("alias shadows a lora adapter the engines serve", alias=a, adapter_model=found[a],
                            endpoints=[ep.name])
        ep.adapters.served = found

    def tell_uses(self) -> None:
        """Tell the sibling workers (``share``) of the adapters this worker routed requests to since
        the last time, and of those it has requests in flight for (used now), at each idle pass:
        they unload by use too, and would otherwise take an adapter used only here for idle."""
        share = self.share
        if share is None:
            return
        now, since = self.clock(), self._uses_told_at
        self._uses_told_at = now
        for ep in self.pool.endpoints():
            for a, at in ep.adapters.recent.items():
                if at > since and not ep.adapters.in_flight.get(a):
                    share.told_used(ep, at, {a: ep.model})
            busy = {a: ep.model for a, n in ep.adapters.in_flight.items() if n}
            if busy:
                share.told_used(ep, now, busy)

    def adopt_use(self, ep: Endpoint, at: float, adapters: dict[str, str]) -> None:
        """A sibling worker used ``adapters`` on ``ep`` at ``at`` (``tell_uses``)."""
        for a in adapters:
            key = (id(ep), a)
            if self._sibling_used.get(key, -math.inf) < at:
                self._sibling_used[key] = at

    def adopt_load_failed(self, ep: Endpoint, adapter: str, model: str, until: float, message: str) -> None:
        """A sibling worker's load of ``adapter`` on ``ep`` failed with ``message``, and it cools that
        endpoint down for it until ``until`` (``time.monotonic``, the machine's clock): so does this
        one, as for a failure of its own (its requests meet the cooldown's 503, or go elsewhere)."""
        key = (id(ep), adapter)
        held = self._cooldown.get(key)
        if held is None or held[0] < until:
            self._cooldown[key] = (until, message)
        entry = self._sibling_loads.pop(key, None)
        if entry is not None:
            entry.end("failed")
        log.info("lora load failure heard from a sibling worker", model=model, adapter=adapter, endpoint=ep.name,
                 cooldown_s=round(max(0.0, until - self.clock()), 3), error=message)

    def adopt_change(self, ep: Endpoint, at: float, adapters: dict[str, str], loaded: bool) -> None:
        """A sibling worker loaded ``adapters`` on ``ep`` at ``at`` (``loaded``), or unloaded them
        or found them gone: this worker's view follows, as if it had done so (a load counts as the
        gateway's, for ``idle_unload_s`` and a restart; the metrics are the sibling's)."""
        for a, m in adapters.items():
            key = (id(ep), a)
            if key in self._unloading:
                continue
            if loaded:
                if self._unloaded_at.get(key, -1.0) < at:      # not unloaded here since
                    ep.adapters.served[a] = m
                    self._loaded_at[key] = max(at, self._loaded_at.get(key, at))
            elif self._loaded_at.get(key, -1.0) <= at:        # not loaded here again since
                ep.adapters.served.pop(a, None)
                self._loaded_at.pop(key, None)
                self._unloaded_at[key] = at
                ep.adapters.recent.pop(a, None)
        self.count_serving()

    def describe(self) -> list[dict[str, Any]]:
        """Adapters for ``/v1/models``: each with its parent and how many ready endpoints serve it, by
        name, so the listing's order does not follow the loads and unloads (nor differ between workers,
        which learn of each other's in their own order): a walk through its pages by cursor
        (``after_id``, gateway/apis/anthropic_models.py) meets each adapter listed throughout once."""
        # the pool holds a model's endpoints together, in the models' order: the parent is the first
        # model serving it, which ``base_of`` sends its requests to (another model's endpoints serving
        # a namesake are not this adapter's). Counted by set and Counter operations, not a Python
        # step per (endpoint, adapter): 50 engines of 1,000 adapters each are 50,000 of them
        parent: dict[str, str] = {}
        ready: collections.Counter[str] = collections.Counter()
        for model in self.pool.models():
            eps = self.pool.endpoints(model)
            mine: collections.Counter[str] = collections.Counter()
            for ep in eps:
                if ep.ready:
                    mine.update(ep.adapters.served.keys())
            for a in set().union(*(ep.adapters.served.keys() for ep in eps)).difference(parent):
                parent[a] = model
                ready[a] = mine[a]
        out = {a: {"id": a, "parent": m, "ready_endpoints": ready[a]} for a, m in parent.items()}
        for a, (model, _) in self.paths.items():
            entry = out.setdefault(a, {"id": a, "parent": model, "ready_endpoints": 0})
            if entry["parent"] == model:    # listed for another model: this one cannot load it
                entry["loadable"] = True
        return sorted(out.values(), key=lambda entry: entry["id"])


_STATES = frozenset({"running", "resident", "free_slot", "waiting", "full"})
# a P/D request's prefill leg failed (gateway/pd/orchestrator.py), not its decode
_PREFILL_FAILED = frozenset({ErrorClass.PD_PREFILL_HTTP_STATUS, ErrorClass.PD_PREFILL_BAD_RESPONSE,
                             ErrorClass.PD_PREFILL_TIMEOUT, ErrorClass.PD_PREFILL_TRANSPORT})


class _PerEndpoint(dict):
    """A dict keyed by ``(id(ep), adapter)`` that knows each endpoint's adapters: an endpoint that
    leaves the pool (or restarts) takes its own entries (``take``) without a walk of every
    endpoint's, which made a burst of thousands of pods leaving O(endpoints²). Written through
    ``d[key] = v``, ``del d[key]`` and ``pop`` only; reads are the dict's own."""

    __slots__ = ("_of",)

    def __init__(self) -> None:
        super().__init__()
        self._of: dict[int, set[str]] = {}

    def __setitem__(self, key: tuple[int, str], value: Any) -> None:
        super().__setitem__(key, value)
        self._of.setdefault(key[0], set()).add(key[1])

    def __delitem__(self, key: tuple[int, str]) -> None:
        super().__delitem__(key)
        self._drop(key)

    def pop(self, key: tuple[int, str], *default: Any) -> Any:
        if key in self:
            self._drop(key)
        return super().pop(key, *default)

    def _drop(self, key: tuple[int, str]) -> None:
        held = self._of.get(key[0])
        if held is not None:
            held.discard(key[1])
            if not held:
                del self._of[key[0]]

    def take(self, i: int) -> dict[str, Any]:
        """Remove the entries of endpoint ``i``: {adapter: value}."""
        return {a: super(_PerEndpoint, self).pop((i, a)) for a in self._of.pop(i, ())}

    def setdefault(self, *_: Any) -> Any:
        raise NotImplementedError("write through d[key] = value")

    update = popitem = setdefault

    def clear(self) -> None:
        super().clear()
        self._of.clear()


class _SiblingLoad:
    """A sibling worker's load under way (``Lora.adopt_load_started``): who, when last heard of,
    and (once a request here waits for it) the future its outcome ends."""

    __slots__ = ("sender", "run", "heard", "done")

    def __init__(self, sender: str, run: int, heard: float) -> None:
        self.sender, self.run, self.heard = sender, run, heard
        self.done: asyncio.Future[str] | None = None

    def end(self, outcome: str) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(outcome)


class _PairAdapterInFlight(AdapterInFlight):
    """A P/D request's adapter charge: on the decode (its own counter) and on the prefill."""

    __slots__ = ("prefill",)

    def __init__(self, prefill: Endpoint, decode: Endpoint, adapter: str,
                 told: Callable[[Endpoint], None] | None = None) -> None:
        self.prefill = AdapterInFlight(prefill, adapter, told)
        super().__init__(decode, adapter, told)

    def release(self) -> None:
        self.prefill.release()
        super().release()


def _free_slot(ep: Endpoint) -> bool:
    m = ep.metrics
    if m is None or not m.max_lora:
        return True
    active = (m.lora_running or frozenset()) | (m.lora_waiting or frozenset()) | {
        a for a, n in ep.adapters.in_flight.items() if n}
    return len(active) < m.max_lora


def model_context(models: Any, base: str) -> int | None:
    """The ``max_model_len`` a ``/v1/models`` answer lists for ``base`` (the card of that id, else
    its one card without a ``parent``): vLLM's and SGLang's ModelCard carry it; None when it lists none."""
    if not isinstance(models, dict) or not isinstance(models.get("data"), list):
        return None
    cards = [e for e in models["data"] if isinstance(e, dict)]
    card = next((e for e in cards if e.get("id") == base), None)
    if card is None:
        bases = [e for e in cards if not e.get("parent")]
        card = bases[0] if len(bases) == 1 else None
    n = card.get("max_model_len") if card is not None else None
    return n if type(n) is int and n > 0 else None


def served_adapters(models: Any, base: str) -> dict[str, str] | None:
    """Adapters of a ``/v1/models`` answer (entries with a non-empty ``parent``) -> ``base``;
    ``None`` when the answer is not a model list."""
    if not isinstance(models, dict) or not isinstance(models.get("data"), list):
        return None
    return {e["id"]: base for e in models["data"]
            if isinstance(e, dict) and isinstance(e.get("id"), str) and e.get("parent")}
