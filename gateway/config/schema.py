"""Configuration: YAML into typed, frozen msgspec Structs, with errors that name the file and key.

Decoding is strict (gateway/config/strict.py): a wrong type, a negative number, a value outside a list of
choices or an unknown key (a typo must not silently fall back to a default) is an error such as
``conf.yaml: models[0].pd.prefill_timeout_s: ...``; null means the default. What types cannot say
is checked in ``__post_init__``. Settings belong to their readers: the strategies' knobs
(routers.base.RoutingSettings, routers.pd.PDRouteSettings), the engines' P/D knobs (handlers.vllm,
handlers.sglang), discovery's (k8s.settings), tracing's (gateway.observability.tracing); the blocks here add what
only the gateway reads.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml
from msgspec import Meta
from msgspec.structs import force_setattr

from gateway.admission.config import AdmissionConfig, Priority
from gateway.aliases import AliasConfig, check_aliases
from gateway.apis.responses_config import ResponsesConfig
from gateway.config.block import Block
from gateway.config.strict import StrictError, convert, laid_over, without_nulls
from gateway.endpoints import ENGINES
from gateway.kv.settings import KVEventsConfig, KVEventsEndpointConfig
from gateway.lora.config import LoraConfig, check_adapters
from gateway.observability.tracing import TracingConfig
from gateway.resilience.breaker import BreakerConfig
from gateway.resilience.retry import RetryConfig
from handlers.sglang import SGLangPDSettings
from handlers.vllm import VLLMPDSettings
from k8s.settings import KubernetesConfig
from k8s.settings import KubernetesModelConfig as KubernetesModelConfig  # re-exported
from routers.base import RouterContext, RoutingSettings
from routers.pd import PDRouteSettings
from routers.registry import RouterRegistry, StrategyError, default_registry

Count = Annotated[int, Meta(ge=0)]
Amount = Annotated[float, Meta(ge=0)]            # seconds, ratios, weights
Positive = Annotated[float, Meta(gt=0)]
Port = Annotated[int, Meta(ge=0, le=65535)]
Name = Annotated[str, Meta(min_length=1)]
Engine = Literal[ENGINES]
_ID = Annotated[str, Meta(pattern=r"\A[A-Za-z0-9._:{}\-]{1,64}\Z")]       # Redis key prefix, replica id
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class ConfigError(ValueError):
    def __init__(self, path: str, message: str, source: str | None = None) -> None:
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{path}: {message}")
        self.key_path = path


def _from_env(inline: str | None, env: str | None, key: str) -> str | None:
    """A secret given inline (``key``) or by the name of an environment variable (``key_env``)."""
    if env is None:
        return inline
    if inline is not None:
        raise ValueError(f"{key}_env: give {key} or {key}_env, not both")
    if not os.environ.get(env):
        raise ValueError(f"{key}_env: environment variable {env} is not set or empty")
    return os.environ[env]


class ListenConfig(Block):
    host: str = "127.0.0.1"
    port: Port = 8888


class ServerConfig(Block):
    max_body_bytes: Count = 16 * 1024 * 1024
    shutdown_grace_s: Amount = 30.0
    workers: Count | Literal["auto"] = 1    # processes sharing the port (SO_REUSEPORT); auto = the cgroup's CPUs
    drain_delay_s: Amount = 5.0          # after SIGTERM: keep accepting connections this long (≤ grace)
    log_format: Literal["auto", "json", "console"] = "auto"   # auto: console on a TTY, else JSON
    log_level: str = "info"
    # the edge (gateway/server/edge.py): slow clients, connection cap, header limits; 0 disables a timeout
    header_timeout_s: Amount = 10.0      # accept (or first byte of a kept-alive request) → complete head
    body_timeout_s: Amount = 30.0        # longest silence between two body reads
    body_total_timeout_s: Amount = 120.0  # head complete → whole body received
    keepalive_timeout_s: Amount = 75.0   # idle kept-alive connection, no byte of a next request
    write_stall_timeout_s: Amount = 30.0  # response write buffer full (client reads nothing) this long
    max_connections: Count = 10000       # open client connections per worker (0: no cap)
    max_header_bytes: Annotated[int, Meta(ge=1024)] = 16384  # request line, and each header field
    max_headers: Annotated[int, Meta(ge=8)] = 100             # header fields per request
    loop_lag_interval_s: Amount = 0.5    # event-loop lag sampling period (gateway/observability/looplag.py); 0: off
    reclaim_min_drop: Count = 1000       # in-flight fall from the peak that returns memory (gateway/server/reclaim.py); 0: off


class RoutingConfig(RoutingSettings):
    """The ``routing:`` block: the default strategy, and the strategies' knobs (RoutingSettings)."""

    strategy: str = "least-request"


class UpstreamConfig(Block):
    connect_timeout_s: Amount = 5.0
    first_byte_timeout_s: Amount = 300.0  # until response headers arrive (0: off)
    total_timeout_s: Amount = 0.0        # whole upstream exchange (0: off)
    retry_on_connect_error: bool = True  # false: no retries at all (older name; see the retry: block)
    max_connections: Count = 0           # 0: unlimited
    keepalive_timeout_s: Amount = 60.0
    max_error_body_bytes: Count = 65536


class HealthConfig(Block):
    enabled: bool = True
    interval_s: Amount = 5.0
    timeout_s: Amount = 2.0
    unhealthy_threshold: Count = 2       # consecutive failed probes before an endpoint is unready
    healthy_threshold: Count = 1         # consecutive good probes before it is ready again
    passive: bool = True                 # a refused connection opens the endpoint's breaker at once


class ScrapeConfig(Block):
    enabled: bool = True
    interval_s: Amount = 2.0
    timeout_s: Amount = 2.0


class WatchdogConfig(Block):
    first_chunk_timeout_s: Amount = 60.0  # 0 disables a phase
    idle_timeout_s: Amount = 120.0
    response_timeout_s: Amount = 0.0     # non-streaming
    aggregated: bool = False             # also watch aggregated (non-P/D) legs


class PDConfig(PDRouteSettings):
    """P/D: the pair choice (PDRouteSettings), the legs, the engines' blocks. A model's ``pd:`` (and
    ``watchdog:``) block sets only the keys it names, on top of the global block."""

    prefill_timeout_s: Amount = 30.0
    token_request_cost: Amount = 3500.0  # fixed token-load charge per request, plus uncached tokens
    # conditional disaggregation (gateway/pd/decide.py); 0 turns a rule off, all 0: always disaggregate
    disaggregate_min_uncached_tokens: Count = 0   # fewer uncached tokens on the chosen decode: run it whole
    disaggregate_min_prompt_tokens: Count = 0     # a shorter prompt: run it whole
    local_prefill_pressure: Count = 0             # in-flight prefills per prefill endpoint above this: run whole...
    local_max_decode_kv_usage: Annotated[float, Meta(ge=0, le=1)] = 0.8   # ...if the decode's KV usage is below this
    vllm: VLLMPDSettings = VLLMPDSettings()
    sglang: SGLangPDSettings = SGLangPDSettings()


# keys of older configs, now in an engine's block: pd.abort_timeout_s is pd.sglang.abort_timeout_s
_MOVED_PD_KEYS = {"rewrite_remote_host": "vllm", "default_bootstrap_port": "sglang",
                  "abort_timeout_s": "sglang", "abort_retry_delay_s": "sglang"}


class EndpointConfig(Block):
    url: str
    engine: Engine | None = None         # defaults to the model's engine
    bootstrap_port: Port | None = None
    min_prompt_tokens: Count = 0
    max_prompt_tokens: Count = 0
    kv_events: KVEventsEndpointConfig | None = None   # this engine's event publisher (enables events for it)

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: must be an http(s):// URL, got {self.url!r}")
        force_setattr(self, "url", self.url.rstrip("/"))


class RolesetConfig(Block):
    name: str
    prefill: tuple[EndpointConfig, ...] = ()
    decode: tuple[EndpointConfig, ...] = ()
    combined: tuple[EndpointConfig, ...] = ()
    bootstrap_port: Port | None = None


class ModelConfig(Block):
    name: Name
    engine: Engine = "vllm"
    strategy: str | None = None          # per-model default
    lock_strategy: str | None = None     # wins over the routing-strategy header
    endpoints: tuple[EndpointConfig, ...] = ()
    rolesets: tuple[RolesetConfig, ...] = ()
    watchdog: WatchdogConfig | None = None
    pd: PDConfig | None = None
    breaker: BreakerConfig | None = None      # laid over the global breaker: block (gateway/resilience/breaker.py)
    retry: RetryConfig | None = None          # laid over the global retry: block (gateway/resilience/retry.py)
    adapters: dict[Name, str] = {}       # LoRA adapter name -> path, loaded on demand (gateway/lora/adapters.py)
    admission: AdmissionConfig | None = None   # keys laid over the global admission block
    tokenizer: str | None = None         # Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json)
    kv_events: KVEventsConfig | None = None   # engine KV-cache events → precise prefix-cache routing
    migration_limit: Annotated[int, Meta(ge=0, le=8)] = 0   # mid-stream continuations per stream (0: off)

    def __post_init__(self) -> None:
        if self.kv_events is not None and self.kv_events.enabled and not self.tokenizer:
            raise ValueError("kv_events.enabled: needs the model's tokenizer directory (tokenizer: <dir>)")
        if self.wants_kv_events and not self.tokenizer:
            raise ValueError("an endpoint's kv_events: needs the model's tokenizer directory (tokenizer: <dir>)")
        if self.tokenizer is not None and not (Path(self.tokenizer) / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer: no tokenizer.json in {self.tokenizer!r}")
        for e in (*self.endpoints, *(e for rs in self.rolesets for e in (*rs.prefill, *rs.decode, *rs.combined))):
            if e.kv_events is not None:          # an entry's ports with the model's ranks, or the other way
                try:
                    (self.kv_events or KVEventsConfig()).with_annotation(dict(e.kv_events.items()))
                except ValueError as err:
                    raise ValueError(f"endpoint {e.url} kv_events: {err}") from None


    @property
    def wants_kv_events(self) -> bool:
        """Some endpoint subscribes to KV events: the model's block enables them, or an endpoint names its own."""
        return ((self.kv_events is not None and self.kv_events.enabled)
                or any(e.kv_events is not None for e in self.endpoints)
                or any(e.kv_events is not None for rs in self.rolesets for e in (*rs.prefill, *rs.decode, *rs.combined)))


class ApiKey(Block):
    """``key`` (plaintext, never in repr) or ``key_sha256`` (hex SHA-256: the file holds no secret)."""

    _secret = ("key",)
    key: str = ""
    user: Name = "default"
    key_sha256: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        given = self.key_sha256.lower()
        digest = hashlib.sha256(self.key.encode()).hexdigest() if self.key else given
        if not digest or (self.key and given and given != digest):
            raise ValueError("key: give exactly one of key or key_sha256")
        if not _SHA256_HEX.fullmatch(digest):
            raise ValueError("key_sha256: must be 64 hex digits (sha256 of the key)")
        force_setattr(self, "key_sha256", digest)


class AuthConfig(Block):
    _secret = ("admin_token",)
    api_keys: tuple[ApiKey, ...] = ()
    enabled: bool | None = None          # None: on when api_keys is non-empty
    admin_token: Name | None = None      # enables /admin/*
    admin_token_env: Name | None = None  # read admin_token from this environment variable
    forward_authorization: bool = False  # with auth on, also forward the client's Authorization

    def __post_init__(self) -> None:
        force_setattr(self, "admin_token", _from_env(self.admin_token, self.admin_token_env, "admin_token"))
        seen: dict[str, int] = {}
        for i, k in enumerate(self.api_keys):
            if k.key_sha256 in seen:
                raise ValueError(f"api_keys[{i}].key: same key as auth.api_keys[{seen[k.key_sha256]}]")
            seen[k.key_sha256] = i

    @property
    def on(self) -> bool:
        return bool(self.api_keys) if self.enabled is None else self.enabled


class UserLimits(Block):
    rpm: Count = 0                       # requests per minute (0: unlimited)
    tpm: Count = 0                       # tokens per minute, prompt + completion (0: unlimited)
    max_concurrent: Count = 0            # requests in flight at once (0: unlimited)
    priority: Priority | None = None     # admission class (gateway/admission); None: admission.default_priority

    @property
    def any(self) -> bool:
        return bool(self.rpm or self.tpm or self.max_concurrent)


class ModelLimits(Block):
    rps: Count = 0                       # requests per second for the model, fleet-wide (0: unlimited)


class LimitsConfig(Block):
    users: dict[Name, UserLimits] = {}
    models: dict[Name, ModelLimits] = {}
    default_user: UserLimits | None = None   # for users with no entry; each such user has own counters


class StateConfig(Block):
    _secret = ("password",)
    redis_url: str | None = None         # redis://, rediss:// (TLS) or unix://; None: in-memory
    password: Name | None = None
    password_env: Name | None = None     # read the password from this environment variable
    tls_ca_file: str | None = None       # CA bundle for rediss://
    key_prefix: _ID = "switchyard"
    timeout_s: Positive = 0.25           # connect and socket timeout of every Redis call
    failure_policy: Literal["open", "closed"] = "open"   # open: serve unlimited while Redis is down; closed: 503
    sync_interval_s: Positive = 0.1      # heartbeat, in-flight publish, directory refresh
    replica_ttl_s: Positive = 1.0        # a replica silent this long no longer counts
    share_in_flight: bool = True         # publish/read per-endpoint in-flight counts (least-request)
    replica_id: _ID | None = None        # None: host-pid-random

    def __post_init__(self) -> None:
        url = self.redis_url
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url: must be a redis://, rediss:// or unix:// URL, got {url!r}")
        if self.replica_ttl_s < 2 * self.sync_interval_s:
            raise ValueError("replica_ttl_s: must be at least twice state.sync_interval_s")
        if self.tls_ca_file is not None and not (url or "").startswith("rediss://"):
            raise ValueError("tls_ca_file: needs a rediss:// state.redis_url")
        force_setattr(self, "password", _from_env(self.password, self.password_env, "password"))


class StatusConfig(Block):
    """``GET /status`` (the live page) and ``GET /status.json`` (what it reads); gateway/observability/status.py."""

    enabled: bool = True
    refresh_s: Annotated[float, Meta(ge=0.5, le=60)] = 2.0   # how often the page polls /status.json
    bucket_s: Annotated[float, Meta(ge=1, le=600)] = 10.0    # resolution of the traffic window
    window_s: Annotated[float, Meta(ge=60, le=3600)] = 300.0  # traffic kept per model: rate, TTFT p50/p99
    recent_decisions: Annotated[int, Meta(ge=0, le=1000)] = 50   # routing decisions kept
    recent_errors: Annotated[int, Meta(ge=0, le=1000)] = 50      # failed requests kept
    max_users: Annotated[int, Meta(ge=0, le=10000)] = 100        # tenants listed at most

    def __post_init__(self) -> None:
        if self.window_s / self.bucket_s > 360:
            raise ValueError("window_s: at most 360 buckets of status.bucket_s")

    @property
    def slots(self) -> int:
        return max(1, round(self.window_s / self.bucket_s))


class Config(Block, dict=True):
    listen: ListenConfig = ListenConfig()
    server: ServerConfig = ServerConfig()
    routing: RoutingConfig = RoutingConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    health: HealthConfig = HealthConfig()
    scrape: ScrapeConfig = ScrapeConfig()
    watchdog: WatchdogConfig = WatchdogConfig()
    pd: PDConfig = PDConfig()
    breaker: BreakerConfig = BreakerConfig()   # per-endpoint circuit breakers (gateway/resilience/breaker.py)
    retry: RetryConfig = RetryConfig()         # retries before the first byte, within a budget (gateway/resilience/retry.py)
    models: tuple[ModelConfig, ...] = ()
    aliases: tuple[AliasConfig, ...] = ()      # names that split traffic over models (gateway/aliases.py)
    kubernetes: KubernetesConfig = KubernetesConfig()
    auth: AuthConfig = AuthConfig()
    limits: LimitsConfig = LimitsConfig()
    state: StateConfig = StateConfig()
    status: StatusConfig = StatusConfig()
    tracing: TracingConfig = TracingConfig()   # OpenTelemetry (gateway/observability/tracing.py)
    responses: ResponsesConfig = ResponsesConfig()   # Responses API state (gateway/apis/responses.py)
    lora: LoraConfig = LoraConfig()            # LoRA adapters (gateway/lora/adapters.py)
    admission: AdmissionConfig = AdmissionConfig()   # saturation, priority queue, shedding (gateway/admission)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for i, m in enumerate(self.models):
            if not (m.endpoints or m.rolesets or self.kubernetes.enabled):
                raise ValueError(f"models[{i}]: model {m.name!r} needs 'endpoints' or 'rolesets' (or kubernetes.enabled: true)")
            if m.name in seen:
                raise ValueError(f"models[{i}].name: duplicate model name {m.name!r}")
            seen.add(m.name)
        if self.responses.backend == "redis" and self.state.redis_url is None:
            raise ValueError("responses.backend: redis needs state.redis_url")
        check_aliases(self.aliases, [m.name for m in self.models], self.kubernetes.enabled)
        check_adapters([(m.name, m.adapters) for m in self.models])
        for path, a in [("admission", self.admission)] + [(f"models[{i}].admission", m.admission)
                                                          for i, m in enumerate(self.models) if m.admission]:
            if a.enabled and not self.scrape.enabled and not a.max_in_flight_per_endpoint:
                raise ValueError(f"{path}.enabled: needs scrape.enabled (the engines' queue and KV usage) "
                                 "or max_in_flight_per_endpoint: there is nothing to tell saturation by")

    @cached_property
    def _models_by_name(self) -> dict[str, ModelConfig]:
        return {m.name: m for m in self.models}

    def model(self, name: str) -> ModelConfig | None:
        return self._models_by_name.get(name)   # per request, several times: a dict, not a scan

    def pd_for(self, model: str) -> PDConfig:
        return getattr(self.model(model), "pd", None) or self.pd

    def watchdog_for(self, model: str) -> WatchdogConfig:
        return getattr(self.model(model), "watchdog", None) or self.watchdog

    def breaker_for(self, model: str) -> BreakerConfig:
        return getattr(self.model(model), "breaker", None) or self.breaker

    def retry_for(self, model: str) -> RetryConfig:
        r = getattr(self.model(model), "retry", None) or self.retry
        return r if self.upstream.retry_on_connect_error else msgspec.structs.replace(r, enabled=False)

    def admission_for(self, model: str) -> AdmissionConfig:
        return getattr(self.model(model), "admission", None) or self.admission

    def with_listen(self, host: str | None, port: int | None) -> Config:
        listen = ListenConfig(host=host or self.listen.host, port=self.listen.port if port is None else port)
        return msgspec.structs.replace(self, listen=listen)

    def with_log_format(self, fmt: str) -> Config:
        return msgspec.structs.replace(self, server=msgspec.structs.replace(self.server, log_format=fmt))


# -- loading ------------------------------------------------------------------------------------


def load_config(path: str | Path) -> Config:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError("<file>", f"cannot read: {e.strerror}", str(path)) from None
    return parse_config(text, source=str(path))


def parse_config(text: str, source: str | None = None) -> Config:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError("<yaml>", f"invalid YAML: {e}", source) from None
    return config_from_dict(raw, source)


def config_from_dict(raw: Any, source: str | None = None) -> Config:
    """Shape the raw data, then convert it: nulls dropped, the older flat P/D engine keys moved into
    their block, a model's ``watchdog:`` / ``pd:`` laid over the global one, endpoint URL strings
    made ``{url, engine}`` (the model's engine), rolesets named ``rs-<i>`` by default."""
    if not isinstance(raw, dict | None):
        raise ConfigError("<root>", f"must be a mapping, got {type(raw).__name__}", source)
    data = without_nulls(raw or {})
    try:
        data["pd"] = _nest_engine_keys(data.get("pd", {}), "pd")
        for key, cls in (("watchdog", WatchdogConfig), ("pd", PDConfig), ("breaker", BreakerConfig),
                         ("retry", RetryConfig), ("admission", AdmissionConfig)):
            if isinstance(data.get(key), dict):   # a global block's bad key is reported where it is written
                convert(data[key], cls, key)
        for i, m in enumerate(data["models"] if isinstance(data.get("models"), list) else ()):
            if isinstance(m, dict):
                _shape_model(m, f"models[{i}]", data)
        config = convert(data, Config)
    except StrictError as e:
        raise ConfigError(e.path, e.message, source) from None
    check_strategies(config, source=source)
    return config


def check_strategies(config: Config, registry: RouterRegistry | None = None, source: str | None = None) -> None:
    """Every strategy the config names exists: ``routing.strategy``, ``lora.strategy`` and each
    model's ``strategy`` and ``lock_strategy``. The one check the loader, the routing of a new
    generation and a reload all run; ``ConfigError`` names the key and suggests a near name.
    ``registry``: the one that will serve (its routers are built now), else the built-in one."""
    if registry is None:
        registry = default_registry(RouterContext(settings=config.routing, pd_settings=config.pd_for))
    named = [("routing.strategy", config.routing.strategy), ("lora.strategy", config.lora.strategy)]
    for i, m in enumerate(config.models):
        named += [(f"models[{i}].{key}", spec) for key in ("strategy", "lock_strategy")
                  if (spec := getattr(m, key))]
    for path, spec in named:
        try:
            registry.get(spec)
        except StrategyError as e:
            raise ConfigError(path, f"{e}{_suggestion(spec, registry)}", source) from None


def _suggestion(spec: str, registry: RouterRegistry) -> str:
    """`` (did you mean 'least-request'?)`` for the first unknown name of ``spec`` close to a known one."""
    for item in spec.split(","):
        name = item.split(":")[0].strip().lower()
        if name and name not in registry:
            return did_you_mean(name, registry.names())
    return ""


def did_you_mean(word: str, known: list[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _shape_model(m: dict, path: str, data: dict) -> None:
    if "pd" in m:
        m["pd"] = _nest_engine_keys(m["pd"], f"{path}.pd")
    for key in ("watchdog", "pd", "breaker", "retry", "admission"):
        if isinstance(m.get(key), dict) and isinstance(data.get(key), dict):
            m[key] = laid_over(data[key], m[key])
    engine = m.get("engine", "vllm")
    rolesets = m["rolesets"] if isinstance(m.get("rolesets"), list) else []
    for j, holder in enumerate((m, *rolesets)):
        if isinstance(holder, dict):
            if j:
                holder.setdefault("name", f"rs-{j - 1}")
            for key in ("endpoints", "prefill", "decode", "combined"):
                if isinstance(holder.get(key), list):
                    holder[key] = [_endpoint(e, engine) for e in holder[key]]


def _endpoint(e: Any, engine: Any) -> Any:
    e = {"url": e} if isinstance(e, str) else e
    return {"engine": engine, **e} if isinstance(e, dict) and engine in ENGINES else e


def _nest_engine_keys(block: Any, path: str) -> Any:
    for key, engine in _MOVED_PD_KEYS.items() if isinstance(block, dict) else ():
        sub = block.get(engine, {})
        if key in block and isinstance(sub, dict):
            if key in sub:
                raise StrictError(f"{path}.{key}", f"also given as {path}.{engine}.{key}; keep one")
            block = {**block, engine: {**sub, key: block[key]}}
            del block[key]
    return block
