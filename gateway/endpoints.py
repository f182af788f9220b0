"""Engine endpoints and the pool that holds them.

An ``Endpoint`` is one engine server (one base URL) serving one model. It carries the gateway's
own live counters (in-flight requests) and the latest engine-metrics snapshot from the scraper, so
routers read everything they need from plain attributes with no I/O.

Routers, handlers and discovery import this module; it imports nothing of the data plane.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

ENGINES = ("vllm", "sglang")
ROLES = ("aggregated", "prefill", "decode", "combined")


@dataclass(slots=True)
class EngineMetrics:
    """A typed snapshot of one engine's ``/metrics`` at ``scraped_at`` (monotonic seconds).

    Fields are ``None`` when the engine did not report the signal. Counters are cumulative values
    as scraped; rates (throughput) are derived by the scraper from two consecutive scrapes.
    """

    scraped_at: float
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None            # 0..1
    prefix_hit_rate: float | None = None     # 0..1 (vLLM: hits/queries cumulative; SGLang: gauge)
    prefix_queries_total: float | None = None
    prefix_hits_total: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    gen_throughput: float | None = None      # generated tokens/s
    prompt_throughput: float | None = None   # prompt tokens/s
    ttft_sum: float | None = None            # TTFT histogram sum (seconds) and count
    ttft_count: float | None = None
    ttft_recent_mean: float | None = None    # mean TTFT over the last scrape interval
    block_size: int | None = None            # vLLM cache_config_info
    queue_time_sum: float | None = None      # queue-time histogram sum (seconds) and count
    queue_time_count: float | None = None
    queue_time_recent_mean: float | None = None  # mean queue time over the last scrape interval
    kv_capacity_tokens: float | None = None  # KV pool size in tokens (vLLM blocks x block size; SGLang)
    max_running: float | None = None         # the engine's running-requests cap, where it tells (SGLang)
    # vLLM lora_requests_info, its newest series: adapters with running / waiting requests, GPU slots
    lora_running: frozenset[str] | None = None
    lora_waiting: frozenset[str] | None = None
    max_lora: int | None = None
    # this gateway's in-flight count on the endpoint when the engine answered the scrape (the larger
    # of the counts before and after): running + waiting beyond it are other gateways' requests
    gateway_in_flight: int | None = None
    # the engine server's start (``process_start_time_seconds``, unix seconds), where it reports it
    start_time: float | None = None

    def age(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.scraped_at


@dataclass(slots=True)
class AdapterState:
    """What the gateway knows of the LoRA adapters on one endpoint (gateway/lora/adapters.py keeps it):
    the adapters the engine serves (``/v1/models`` entries with a ``parent``, plus the ones the
    gateway loaded), this gateway's requests in flight per adapter, and the adapters it sent here
    most recently (newest last; an engine keeps the last ``max_lora`` of them in its GPU slots)."""

    served: dict[str, str] = field(default_factory=dict)        # adapter -> parent (base model)
    in_flight: dict[str, int] = field(default_factory=dict)     # adapter -> requests of this gateway
    recent: dict[str, float] = field(default_factory=dict)      # adapter -> last routed (monotonic), LRU order


@dataclass(eq=False, slots=True)
class Endpoint:
    """One engine server. Identity is the object itself (eq=False): two configs of the same URL
    for two models are two endpoints with separate counters."""

    url: str                       # base URL, no trailing slash: http://host:port
    model: str
    engine: str = "vllm"
    role: str = "aggregated"
    roleset: str | None = None
    bootstrap_port: int | None = None
    min_prompt_tokens: int = 0
    max_prompt_tokens: int = 0     # 0: no upper bound
    source: str = "static"         # static | kubernetes
    name: str = ""                 # pod name for Kubernetes (namespace/name, several watched); host:port otherwise
    # the key the engine was started with (``api_key`` of its model or endpoint): sent on every
    # request to it (``engine_headers``); kept out of the repr, hence out of logs and tracebacks
    api_key: str | None = field(default=None, repr=False)
    host: str = ""
    port: int = 0
    # live state
    healthy: bool = True           # last active probe / passive marking result
    draining: bool = False         # removed from discovery: no new requests, in-flight continue
    removed: bool = False          # it left the pool: what is kept per endpoint must not keep it
    ejected: bool = False          # its circuit breaker is open (gateway/resilience/breaker.py)
    in_flight: int = 0             # gateway requests currently charged to this endpoint
    remote_in_flight: int = 0      # other gateway replicas' in-flight here (gateway/tenants, via Redis)
    # the endpoint a reload put in this one's place, the same engine declared anew (``EndpointPool.replaced``):
    # it counts this one's requests in flight too, until they end (gateway/pipeline/ledger.py)
    successor: Endpoint | None = field(default=None, repr=False)
    # P/D trackers (gateway/pipeline/ledger.py): charged with the routing decision, released exactly once
    prefill_in_flight: int = 0     # prefill calls of this gateway in progress on this endpoint
    pending_decode: int = 0        # decodes chosen for this endpoint whose leg has not started yet
    token_active: float = 0.0      # prompt tokens being prefilled here (TokenLoadTracker)
    token_kv: float = 0.0          # prompt tokens whose KV this endpoint holds for live requests
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    # workers sharing monitoring: the last probe outcome that counted, as (this worker's own probe,
    # ok, monotonic time); one round probed by two workers counts once (gateway/upstream/monitor.py)
    last_probe: tuple[bool, bool, float] | None = None
    metrics: EngineMetrics | None = None
    # its place among its model's endpoints ordered by URL, the same in every worker that has them
    # (admission deals the slots of a bound over the workers by it: gateway/admission/saturation.py)
    turn: int = 0
    adapters: AdapterState = field(default_factory=AdapterState)   # LoRA adapters (gateway/lora/adapters.py)
    # the model's context length as the engine's ``/v1/models`` last listed it (read with the LoRA
    # adapters, gateway/lora/adapters.py); None: not listed, or not read yet. A vLLM P/D request that
    # cannot fit in its decode's runs whole (handlers/vllm.py ``unsplit``)
    max_model_len: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"endpoint URL must be http(s)://host:port, got {self.url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        if not self.name:
            self.name = self.address

    @property
    def address(self) -> str:
        """``host:port`` as used in the ``target-pod`` header (IPv6 in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def ready(self) -> bool:
        return self.healthy and not self.draining and not self.ejected

    @property
    def charged(self) -> bool:
        """Whether requests still running hold a charge here (in flight, or a P/D tracker's)."""
        return bool(self.in_flight or self.prefill_in_flight or self.pending_decode or self.token_active
                    or self.token_kv)

    def fresh_metrics(self, max_age: float, now: float | None = None) -> EngineMetrics | None:
        """The metrics snapshot if it is younger than ``max_age`` seconds, else ``None``."""
        m = self.metrics
        if m is None or m.age(now) > max_age:
            return None
        return m


# the headers a client's API key arrives in: never sent to an engine the gateway has a key for
CLIENT_KEY_HEADERS = frozenset({"authorization", "x-api-key"})


def engine_headers(ep: Endpoint, headers: dict[str, str]) -> dict[str, str]:
    """``headers`` for a request to ``ep``: unchanged when the gateway has no key for its engine,
    else with ``Authorization: Bearer <key>`` in place of any key of the client's."""
    if ep.api_key is None:
        return headers
    out = {k: v for k, v in headers.items() if k.lower() not in CLIENT_KEY_HEADERS}
    out["Authorization"] = "Bearer " + ep.api_key
    return out


PD_ROLES = ("prefill", "decode")


def _url(ep: Endpoint) -> str:
    return ep.url


def _never(_model: str) -> bool:
    return False


class EndpointPool:
    """Endpoints grouped by model. Static config and discovery both feed it."""

    def __init__(self) -> None:
        self._by_model: dict[str, list[Endpoint]] = {}
        # per model, what the routing step asks of its endpoints on every request, kept as they come
        # and go (an endpoint's role and annotations are fixed once it is added: a changed pod is a
        # new endpoint): whether it has prefill/decode endpoints, and their strategy hint
        self._pd: set[str] = set()
        self._shared: set[str] = set()       # models with two endpoints of one name (one engine in two roles)
        self._hints: dict[str, str] = {}
        # what the summaries are kept from, so that one endpoint added or removed (a pod a watch
        # event brings) costs no walk of its model's endpoints (which made a burst of thousands
        # O(pods²)): per model, its endpoints ordered by URL (their turns), how many have a P/D
        # role, how many endpoints carry each name and how many names two or more, how many a hint
        self._order: dict[str, list[Endpoint]] = {}
        self._pd_count: Counter[str] = Counter()
        self._names: dict[str, Counter[str]] = {}
        self._dup_names: Counter[str] = Counter()
        self._hinted: Counter[str] = Counter()
        # the models that have endpoints: ``has_model`` is its lookup, in C (twice a request)
        self._live: set[str] = set()
        self.has_model: Callable[[str], bool] = self._live.__contains__
        # counts the changes of any model's endpoints: what is worked out of them per model and kept
        # (a model's default strategy, gateway/pipeline/routing.py) is worked out again when it moved
        self.version = 0
        # told of each endpoint that left the pool (pods come and go for months): the state kept
        # per endpoint elsewhere (its circuit breaker) is dropped then, not kept for ever
        self.removal_listeners: list[Callable[[Endpoint], None]] = []
        # told, after its removal, of an endpoint a reload declared again at the same URL with other
        # settings, as (the one that left, the one in its place): a new endpoint of the pool, but the
        # same engine, still holding its conversations (the routing view keeps them on it)
        self.replacement_listeners: list[Callable[[Endpoint, Endpoint], None]] = []
        # and the endpoints taken out, with the monotonic time they were, until their metric series
        # go too, later (gateway/observability/metrics.py ``RetiredSeries``)
        self.retired: list[tuple[Endpoint, float]] = []
        # False while Kubernetes discovery has not listed the pods yet: a model the pool lacks may
        # then be one of theirs (k8s/discovery.py)
        self.listed = True
        # whether a model the pool lacks is one Kubernetes discovery expects endpoints of soon: a
        # pod of it waits for its address, or its last pod left moments ago (a StatefulSet makes
        # it again under its name) (k8s/discovery.py)
        self.awaited: Callable[[str], bool] = _never
        self._batched: set[str] | None = None      # the models changed within ``batch``, ordered at its end
        # how many endpoints have each URL, and each (model, URL): what a removal listener asks
        # (``has_url``) without a walk of the pool, which a list that takes thousands out at once
        # would make O(endpoints²)
        self._urls: dict[str, int] = {}
        self._model_urls: dict[tuple[str, str], int] = {}

    def add(self, ep: Endpoint) -> Endpoint:
        ep.removed = False
        self._by_model.setdefault(ep.model, []).append(ep)
        self._urls[ep.url] = self._urls.get(ep.url, 0) + 1
        self._model_urls[(ep.model, ep.url)] = self._model_urls.get((ep.model, ep.url), 0) + 1
        self._changed(ep.model, ep, True)
        return ep

    def has_url(self, url: str, model: str | None = None) -> bool:
        """Whether an endpoint in the pool (of ``model``, when given) has ``url``."""
        return (self._urls if model is None else self._model_urls).get(url if model is None else (model, url), 0) > 0

    @staticmethod
    def _less(counts: dict, key: object) -> None:
        n = counts.get(key, 0) - 1
        if n > 0:
            counts[key] = n
        else:
            counts.pop(key, None)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """The endpoints added and removed within it (one synchronous step: routing sees none of it
        half done) are ordered once per model, at its end, not at each change: a Kubernetes list
        applies thousands of pods at once, and ordering the model's endpoints at each would make it
        O(pods²). Whether a model has endpoints (``has_model``) follows each change at once."""
        if self._batched is not None:       # within another one: that one orders them
            yield
            return
        self._batched = set()
        try:
            yield
        finally:
            models, self._batched = self._batched, None
            for model in models:
                self._summarize(model)

    def _changed(self, model: str, ep: Endpoint, added: bool) -> None:
        if self._batched is None:
            self._follow(model, ep, added)
            return
        self.version += 1
        if self._by_model.get(model):
            self._live.add(model)
        else:
            self._live.discard(model)
        self._batched.add(model)

    def remove(self, ep: Endpoint) -> None:
        """Take an endpoint out of rotation. In-flight requests keep their reference and finish."""
        eps = self._by_model.get(ep.model)
        ep.draining = True
        if eps and ep in eps:
            eps.remove(ep)
            self._less(self._urls, ep.url)
            self._less(self._model_urls, (ep.model, ep.url))
            self._changed(ep.model, ep, False)
            ep.removed = True
            self.retired.append((ep, time.monotonic()))
            for listener in self.removal_listeners:
                listener(ep)

    def replaced(self, old: Endpoint, new: Endpoint) -> None:
        """``new`` (added) takes the place of ``old`` (removed): the same engine under other settings.
        The requests still on ``old`` run on that engine: ``new`` counts them in flight until they
        end (each release follows ``successor``), so the next decisions see the engine's load. What
        the health probes and the scrapes knew of the engine stays too: one found down is not ready
        until a probe finds it up, and its last snapshot is read until the next scrape."""
        self.succeeded(old, new)
        new.healthy, new.last_probe = old.healthy, old.last_probe
        new.consecutive_failures, new.consecutive_successes = old.consecutive_failures, old.consecutive_successes
        if new.metrics is None:     # engine-neutral once parsed; the next scrape replaces it
            new.metrics = old.metrics
        for listener in self.replacement_listeners:
            listener(old, new)

    @staticmethod
    def succeeded(old: Endpoint, new: Endpoint) -> None:
        """``new`` counts ``old``'s requests in flight, the same engine's, until they end, and what
        the P/D trackers hold of them (prefills in flight, decodes pending, prompt tokens active and
        resident): each release follows ``successor`` (gateway/pipeline/ledger.py)."""
        new.in_flight += old.in_flight
        new.prefill_in_flight += old.prefill_in_flight
        new.pending_decode += old.pending_decode
        new.token_active += old.token_active
        new.token_kv += old.token_kv
        old.successor = new

    def live_names(self, model: str) -> set[str]:
        return {ep.name for ep in self._by_model.get(model, ())}

    def _summarize(self, model: str) -> None:
        """The model's summaries worked out anew from its endpoints (at the end of a ``batch``)."""
        self.version += 1
        eps = self._by_model.get(model, ())
        order = sorted(eps, key=_url)
        for i, ep in enumerate(order):
            ep.turn = i
        names = Counter(ep.name for ep in eps)
        if eps:
            self._order[model], self._names[model] = order, names
        else:
            self._order.pop(model, None)
            self._names.pop(model, None)
        self._pd_count[model] = sum(ep.role in PD_ROLES for ep in eps)
        self._dup_names[model] = sum(n > 1 for n in names.values())
        self._hinted[model] = sum(bool(ep.extra.get("routing_strategy")) for ep in eps)
        self._settle(model)

    def _follow(self, model: str, ep: Endpoint, added: bool) -> None:
        """The model's summaries after one endpoint was added or removed, with no walk of its
        endpoints: its place by URL found by bisection (the turns of those after it move by one),
        counts moved by one, and its strategy hint looked for again only when a hinted one left."""
        self.version += 1
        order = self._order.setdefault(model, [])
        names = self._names.setdefault(model, Counter())
        step = 1 if added else -1
        if added:
            i = bisect.bisect_right(order, ep.url, key=_url)   # after its URL's others, as a stable sort puts it
            order.insert(i, ep)
            names[ep.name] += 1
            if names[ep.name] == 2:
                self._dup_names[model] += 1
        else:
            i = bisect.bisect_left(order, ep.url, key=_url)
            while order[i] is not ep:
                i += 1
            del order[i]
            if names[ep.name] == 2:
                self._dup_names[model] -= 1
            self._less(names, ep.name)
        for j in range(i, len(order)):
            order[j].turn = j
        if not order:
            del self._order[model], self._names[model]
        if ep.role in PD_ROLES:
            self._pd_count[model] += step
        hinted = bool(ep.extra.get("routing_strategy"))
        if hinted:
            self._hinted[model] += step
        # the first hint found stays first unless it may have been the one that left, or there was none
        self._settle(model, hint=hinted and not (added and model in self._hints))

    def _settle(self, model: str, hint: bool = True) -> None:
        """The model's sets from its counts; ``hint``: its strategy hint looked for again (the
        first endpoint found that carries one), else it stands as it is."""
        if self._by_model.get(model):
            self._live.add(model)
        else:
            self._live.discard(model)
        if self._pd_count[model] > 0:
            self._pd.add(model)
        else:
            self._pd.discard(model)
            del self._pd_count[model]
        if self._dup_names[model] > 0:
            self._shared.add(model)
        else:
            self._shared.discard(model)
            del self._dup_names[model]
        if not hint:
            return
        if self._hinted[model] > 0:
            self._hints[model] = next(h for ep in self._by_model[model] if (h := ep.extra.get("routing_strategy")))
        else:
            self._hints.pop(model, None)
            del self._hinted[model]

    def models(self) -> list[str]:
        return [m for m, eps in self._by_model.items() if eps]

    def endpoints(self, model: str | None = None) -> list[Endpoint]:
        if model is not None:
            return list(self._by_model.get(model, ()))
        return [ep for eps in self._by_model.values() for ep in eps]

    def shares_names(self) -> bool:
        """Whether some model has two endpoints of one name: one engine that is its prefill and its
        decode (or whole-request endpoint too), whose per-endpoint series, labelled by model and
        endpoint, are then written once for each role unless merged."""
        return bool(self._shared)

    def has_pd(self, model: str) -> bool:
        """Whether the model has prefill/decode endpoints (static rolesets or discovered pods)."""
        return model in self._pd

    def strategy_hint(self, model: str) -> str | None:
        """A routing strategy the model's endpoints carry (Kubernetes: the ``routingStrategy`` of
        the pods' ``model.aibrix.ai/config`` annotation); the first one found wins."""
        return self._hints.get(model)

    def ready(self, model: str, roles: Collection[str] | None = None) -> list[Endpoint]:
        """The model's ready endpoints; with ``roles``, those of these roles only (one pass)."""
        eps = self._by_model.get(model, ())
        if roles is None:
            return [ep for ep in eps if ep.ready]
        return [ep for ep in eps if ep.ready and ep.role in roles]

    def __iter__(self) -> Iterable[Endpoint]:
        return iter(self.endpoints())
