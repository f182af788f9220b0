"""Configuration: YAML into typed, frozen objects, with errors that name the key and the file.

Unknown keys are errors (a typo must not silently fall back to a default). Every block has
defaults, so the smallest useful config is a ``models:`` list.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from gateway.endpoints import ENGINES

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_PREFIX = re.compile(r"[A-Za-z0-9._:{}\-]{1,64}")


PREFILL_POLICIES = ("prefix_cache", "least_request", "token_load")
DECODE_POLICIES = ("load_balancing", "least_request")


class ConfigError(ValueError):
    def __init__(self, path: str, message: str, source: str | None = None) -> None:
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{path}: {message}")
        self.key_path = path


@dataclass(frozen=True)
class ListenConfig:
    host: str = "127.0.0.1"
    port: int = 8888


@dataclass(frozen=True)
class ServerConfig:
    max_body_bytes: int = 16 * 1024 * 1024
    shutdown_grace_s: float = 30.0
    workers: int = 1                     # processes sharing the port (SO_REUSEPORT); see gateway/workers.py
    drain_delay_s: float = 5.0           # after SIGTERM: keep accepting connections this long (≤ grace)
    log_format: str = "console"          # json | console
    log_level: str = "info"


@dataclass(frozen=True)
class RoutingConfig:
    strategy: str = "least-request"
    metrics_max_age_s: float = 10.0      # engine metrics older than this count as missing
    # knobs of the built-in strategies (routers.base.RoutingSettings has the same names and defaults)
    prefix_block_chars: int = 512        # prefix-cache: prompt characters per hashed block
    prefix_max_blocks: int = 1024        # prefix-cache: blocks hashed per prompt at most
    prefix_index_blocks: int = 131072    # prefix-cache: index capacity in blocks (LRU, all models)
    prefix_idle_ttl_s: float = 1200.0    # prefix-cache: forget blocks untouched for this long
    prefix_imbalance_abs: int = 8        # prefix-cache: in-flight spread above which only the least loaded count
    prefix_std_factor: float = 1.5       # prefix-cache: matched endpoint's in-flight must be <= mean + k*stddev
    metrics_window_s: float = 10.0       # throughput / least-latency: window of rates and means
    vtc_window_s: float = 300.0          # vtc-basic: sliding window of per-user token counts


@dataclass(frozen=True)
class UpstreamConfig:
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 300.0  # until response headers arrive (0: off)
    total_timeout_s: float = 0.0         # whole upstream exchange (0: off)
    retry_on_connect_error: bool = True  # retry once on another endpoint if no byte came back
    max_connections: int = 0             # 0: unlimited
    keepalive_timeout_s: float = 60.0
    max_error_body_bytes: int = 65536


@dataclass(frozen=True)
class HealthConfig:
    enabled: bool = True
    interval_s: float = 5.0
    timeout_s: float = 2.0
    unhealthy_threshold: int = 2         # consecutive failed probes before an endpoint is unready
    healthy_threshold: int = 1           # consecutive good probes before it is ready again
    passive: bool = True                 # a connect failure marks the endpoint unready at once


@dataclass(frozen=True)
class ScrapeConfig:
    enabled: bool = True
    interval_s: float = 2.0
    timeout_s: float = 2.0


@dataclass(frozen=True)
class WatchdogConfig:
    first_chunk_timeout_s: float = 60.0  # 0 disables a phase
    idle_timeout_s: float = 120.0
    response_timeout_s: float = 0.0      # non-streaming
    aggregated: bool = False             # also watch aggregated (non-P/D) legs


@dataclass(frozen=True)
class PDConfig:
    """Prefill/decode disaggregation. Global, and overridable per model: a model's ``pd:`` block
    sets only the keys it names, on top of the global block."""

    prefill_timeout_s: float = 30.0
    rewrite_remote_host: bool = True         # vLLM: point kv_transfer_params.remote_host at the prefill pod
    default_bootstrap_port: int = 8998       # SGLang, when neither endpoint nor roleset sets one
    prefill_score_policy: str = "prefix_cache"   # prefix_cache | least_request | token_load
    decode_score_policy: str = "load_balancing"  # load_balancing | least_request
    prefill_imbalance_spread: int = 16       # in-flight prefill spread (strictly greater) → least-loaded prefill
    decode_imbalance_spread: int = 16        # running spread (>=) → least-loaded decode
    decode_throughput_spread: float = 2048.0  # tokens/s spread (>) → lowest-throughput decode
    prefill_load_std_factor: float = 2.0     # skip prefills above mean + k·stddev of in-flight prefills
    decode_lb_weight_running: float = 1.0
    decode_lb_weight_throughput: float = 1.0
    combined_load_ratio: float = 0.25        # combined wins when its load < ratio × the least prefill load
    token_request_cost: float = 3500.0       # fixed token-load charge per request, plus uncached tokens
    token_kv_weight: float = 0.3             # token-load priority = active + weight · kv
    abort_timeout_s: float = 3.0             # SGLang /abort_request call timeout (0: never abort)
    abort_retry_delay_s: float = 2.0         # a second abort after this delay unless decode answered


@dataclass(frozen=True)
class EndpointConfig:
    url: str
    engine: str | None = None            # defaults to the model's engine
    bootstrap_port: int | None = None
    min_prompt_tokens: int = 0
    max_prompt_tokens: int = 0


@dataclass(frozen=True)
class RolesetConfig:
    name: str
    prefill: tuple[EndpointConfig, ...] = ()
    decode: tuple[EndpointConfig, ...] = ()
    combined: tuple[EndpointConfig, ...] = ()
    bootstrap_port: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    name: str
    engine: str = "vllm"
    strategy: str | None = None          # per-model default
    lock_strategy: str | None = None     # wins over the routing-strategy header
    endpoints: tuple[EndpointConfig, ...] = ()
    rolesets: tuple[RolesetConfig, ...] = ()
    watchdog: WatchdogConfig | None = None
    pd: PDConfig | None = None


@dataclass(frozen=True)
class KubernetesModelConfig:
    """Routing settings for one model's discovered pods; a pod's ``model.aibrix.ai/config``
    annotation, where present, wins over these."""

    combined: bool = False               # pods of a roleset whose role-name is not prefill/decode
    min_prompt_tokens: int = 0
    max_prompt_tokens: int = 0           # 0: no upper bound


@dataclass(frozen=True)
class KubernetesConfig:
    enabled: bool = False
    kubeconfig: str | None = None        # null: in-cluster service account
    context: str | None = None           # kubeconfig context (null: its current-context)
    namespaces: tuple[str, ...] = ()     # (): all namespaces
    label_selector: str = "model.aibrix.ai/name"
    resync_interval_s: float = 300.0     # full relist that repairs missed events (0: never)
    watch_timeout_s: float = 300.0       # server-side timeout of one watch request
    retry_backoff_s: float = 1.0         # first retry delay after an API error; doubles up to 30 s
    models: dict[str, KubernetesModelConfig] = field(default_factory=dict)


@dataclass(frozen=True)
class ApiKey:
    """One configured API key. ``key`` is the plaintext (never in repr); a config may instead give
    ``key_sha256``, the hex SHA-256 of the key, so the file holds no secret."""

    key: str = field(default="", repr=False)
    user: str = "default"
    key_sha256: str = ""
    name: str = ""


@dataclass(frozen=True)
class AuthConfig:
    api_keys: tuple[ApiKey, ...] = ()
    enabled: bool | None = None          # None: on when api_keys is non-empty
    admin_token: str | None = field(default=None, repr=False)   # enables /admin/*
    forward_authorization: bool = False  # with auth on, also forward the client's Authorization

    @property
    def on(self) -> bool:
        return bool(self.api_keys) if self.enabled is None else self.enabled


@dataclass(frozen=True)
class UserLimits:
    rpm: int = 0                         # requests per minute (0: unlimited)
    tpm: int = 0                         # tokens per minute, prompt + completion (0: unlimited)
    max_concurrent: int = 0              # requests in flight at once (0: unlimited)

    @property
    def any(self) -> bool:
        return bool(self.rpm or self.tpm or self.max_concurrent)


@dataclass(frozen=True)
class ModelLimits:
    rps: int = 0                         # requests per second for the model, fleet-wide (0: unlimited)


@dataclass(frozen=True)
class LimitsConfig:
    users: dict[str, UserLimits] = field(default_factory=dict)
    models: dict[str, ModelLimits] = field(default_factory=dict)
    default_user: UserLimits | None = None   # for users with no entry; each such user has own counters


FAILURE_POLICIES = ("open", "closed")


@dataclass(frozen=True)
class StateConfig:
    redis_url: str | None = None         # redis://, rediss:// (TLS) or unix://; None: in-memory
    password: str | None = field(default=None, repr=False)
    password_env: str | None = None      # read the password from this environment variable
    tls_ca_file: str | None = None       # CA bundle for rediss://
    key_prefix: str = "switchyard"
    timeout_s: float = 0.25              # connect and socket timeout of every Redis call
    failure_policy: str = "open"         # open: serve unlimited while Redis is down; closed: 503
    sync_interval_s: float = 0.1         # heartbeat, in-flight publish, directory refresh
    replica_ttl_s: float = 1.0           # a replica silent this long no longer counts
    share_in_flight: bool = True         # publish/read per-endpoint in-flight counts (least-request)
    replica_id: str | None = None        # None: host-pid-random


@dataclass(frozen=True)
class Config:
    listen: ListenConfig = ListenConfig()
    server: ServerConfig = ServerConfig()
    routing: RoutingConfig = RoutingConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    health: HealthConfig = HealthConfig()
    scrape: ScrapeConfig = ScrapeConfig()
    watchdog: WatchdogConfig = WatchdogConfig()
    pd: PDConfig = PDConfig()
    models: tuple[ModelConfig, ...] = ()
    kubernetes: KubernetesConfig = KubernetesConfig()
    auth: AuthConfig = AuthConfig()
    limits: LimitsConfig = LimitsConfig()
    state: StateConfig = StateConfig()

    @cached_property
    def _models_by_name(self) -> dict[str, ModelConfig]:
        return {m.name: m for m in self.models}

    def model(self, name: str) -> ModelConfig | None:
        return self._models_by_name.get(name)   # per request, several times: a dict, not a scan

    def pd_for(self, model: str) -> PDConfig:
        m = self.model(model)
        return m.pd if m is not None and m.pd is not None else self.pd

    def watchdog_for(self, model: str) -> WatchdogConfig:
        m = self.model(model)
        return m.watchdog if m is not None and m.watchdog is not None else self.watchdog

    def with_listen(self, host: str | None, port: int | None) -> Config:
        listen = ListenConfig(host=host or self.listen.host, port=self.listen.port if port is None else port)
        return replace(self, listen=listen)


# ---------------------------------------------------------------------------------------------
# loading


class _Loader:
    def __init__(self, source: str | None) -> None:
        self.source = source
        self.discovery = False           # kubernetes.enabled: models may have no static endpoints

    def err(self, path: str, message: str) -> ConfigError:
        return ConfigError(path, message, self.source)

    def mapping(self, value: Any, path: str) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.err(path, f"must be a mapping, got {type(value).__name__}")
        return value

    def scalar_block(self, cls: type, value: Any, path: str, base: Any = None) -> Any:
        """Build a dataclass of scalars, type-checking each key against its default's type.
        With ``base``, unnamed keys keep ``base``'s values (per-model overrides)."""
        data = self.mapping(value, path)
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        defaults = base if base is not None else cls()
        for key, v in data.items():
            if key not in known:
                raise self.err(f"{path}.{key}", f"unknown key (known: {', '.join(known)})")
            default = getattr(defaults, key)
            kwargs[key] = self.coerce(v, default, f"{path}.{key}")
        return replace(defaults, **kwargs)

    def coerce(self, v: Any, default: Any, path: str) -> Any:
        if isinstance(default, bool):
            if not isinstance(v, bool):
                raise self.err(path, f"must be true or false, got {v!r}")
            return v
        if isinstance(default, int) and not isinstance(default, bool):
            if isinstance(v, bool) or not isinstance(v, int):
                raise self.err(path, f"must be an integer, got {v!r}")
            if v < 0:
                raise self.err(path, f"must be >= 0, got {v}")
            return v
        if isinstance(default, float):
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise self.err(path, f"must be a number, got {v!r}")
            if v < 0:
                raise self.err(path, f"must be >= 0, got {v}")
            return float(v)
        if isinstance(default, str) or default is None:
            if v is not None and not isinstance(v, str):
                raise self.err(path, f"must be a string, got {v!r}")
            return v
        return v

    def check_pd(self, pd: PDConfig, path: str) -> PDConfig:
        if pd.prefill_score_policy not in PREFILL_POLICIES:
            raise self.err(f"{path}.prefill_score_policy", f"must be one of {', '.join(PREFILL_POLICIES)}")
        if pd.decode_score_policy not in DECODE_POLICIES:
            raise self.err(f"{path}.decode_score_policy", f"must be one of {', '.join(DECODE_POLICIES)}")
        return pd

    def endpoint(self, value: Any, path: str, model_engine: str) -> EndpointConfig:
        if isinstance(value, str):
            value = {"url": value}
        data = self.mapping(value, path)
        allowed = {f.name for f in fields(EndpointConfig)}
        for key in data:
            if key not in allowed:
                raise self.err(f"{path}.{key}", f"unknown key (known: {', '.join(sorted(allowed))})")
        url = data.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise self.err(f"{path}.url", f"must be an http(s):// URL, got {url!r}")
        engine = data.get("engine", model_engine)
        if engine not in ENGINES:
            raise self.err(f"{path}.engine", f"must be one of {', '.join(ENGINES)}, got {engine!r}")
        ints = {}
        for key in ("bootstrap_port", "min_prompt_tokens", "max_prompt_tokens"):
            if key in data and data[key] is not None:
                v = data[key]
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise self.err(f"{path}.{key}", f"must be a non-negative integer, got {v!r}")
                ints[key] = v
        return EndpointConfig(url=url.rstrip("/"), engine=engine, **ints)

    def endpoint_list(self, value: Any, path: str, engine: str) -> tuple[EndpointConfig, ...]:
        if value is None:
            return ()
        if not isinstance(value, list):
            raise self.err(path, "must be a list of URLs or {url: ...} mappings")
        return tuple(self.endpoint(v, f"{path}[{i}]", engine) for i, v in enumerate(value))

    def model(self, value: Any, path: str, g_watchdog: WatchdogConfig = WatchdogConfig(),
              g_pd: PDConfig = PDConfig()) -> ModelConfig:
        data = self.mapping(value, path)
        allowed = {f.name for f in fields(ModelConfig)}
        for key in data:
            if key not in allowed:
                raise self.err(f"{path}.{key}", f"unknown key (known: {', '.join(sorted(allowed))})")
        name = data.get("name")
        if not isinstance(name, str) or not name:
            raise self.err(f"{path}.name", "is required and must be a non-empty string")
        engine = data.get("engine", "vllm")
        if engine not in ENGINES:
            raise self.err(f"{path}.engine", f"must be one of {', '.join(ENGINES)}, got {engine!r}")
        for key in ("strategy", "lock_strategy"):
            if key in data and data[key] is not None and not isinstance(data[key], str):
                raise self.err(f"{path}.{key}", "must be a string")
        endpoints = self.endpoint_list(data.get("endpoints"), f"{path}.endpoints", engine)
        rolesets = []
        raw_rs = data.get("rolesets") or []
        if not isinstance(raw_rs, list):
            raise self.err(f"{path}.rolesets", "must be a list")
        for i, rs in enumerate(raw_rs):
            rp = f"{path}.rolesets[{i}]"
            rsd = self.mapping(rs, rp)
            for key in rsd:
                if key not in {f.name for f in fields(RolesetConfig)}:
                    raise self.err(f"{rp}.{key}", "unknown key (known: name, prefill, decode, combined, bootstrap_port)")
            rs_name = rsd.get("name", f"rs-{i}")
            if not isinstance(rs_name, str):
                raise self.err(f"{rp}.name", "must be a string")
            bp = rsd.get("bootstrap_port")
            if bp is not None and (isinstance(bp, bool) or not isinstance(bp, int)):
                raise self.err(f"{rp}.bootstrap_port", "must be an integer")
            rolesets.append(RolesetConfig(
                name=rs_name,
                prefill=self.endpoint_list(rsd.get("prefill"), f"{rp}.prefill", engine),
                decode=self.endpoint_list(rsd.get("decode"), f"{rp}.decode", engine),
                combined=self.endpoint_list(rsd.get("combined"), f"{rp}.combined", engine),
                bootstrap_port=bp,
            ))
        if not endpoints and not rolesets and not self.discovery:
            raise self.err(path, f"model {name!r} needs 'endpoints' or 'rolesets' (or kubernetes.enabled: true)")
        watchdog = (self.scalar_block(WatchdogConfig, data["watchdog"], f"{path}.watchdog", g_watchdog)
                    if data.get("watchdog") is not None else None)
        pd = (self.check_pd(self.scalar_block(PDConfig, data["pd"], f"{path}.pd", g_pd), f"{path}.pd")
              if data.get("pd") is not None else None)
        return ModelConfig(name=name, engine=engine, strategy=data.get("strategy"),
                           lock_strategy=data.get("lock_strategy"), endpoints=endpoints,
                           rolesets=tuple(rolesets), watchdog=watchdog, pd=pd)

    # -- kubernetes (k8s/ discovery) -------------------------------------------------------
    def kubernetes(self, value: Any) -> KubernetesConfig:
        k = dict(self.mapping(value, "kubernetes"))
        namespaces = k.pop("namespaces", None)
        models = k.pop("models", None)
        kc = self.scalar_block(KubernetesConfig, k, "kubernetes")
        ns: list[str] = []
        if namespaces is not None:
            if not isinstance(namespaces, list):
                raise self.err("kubernetes.namespaces", "must be a list of namespace names ([]: all namespaces)")
            for i, n in enumerate(namespaces):
                if not isinstance(n, str) or not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", n):
                    raise self.err(f"kubernetes.namespaces[{i}]", f"must be a namespace name, got {n!r}")
                if n in ns:
                    raise self.err(f"kubernetes.namespaces[{i}]", f"duplicate namespace {n!r}")
                ns.append(n)
        if not isinstance(kc.label_selector, str):
            raise self.err("kubernetes.label_selector", "must be a string (\"\": every pod)")
        try:
            from k8s.selector import parse_selector
            parse_selector(kc.label_selector)
        except ValueError as e:
            raise self.err("kubernetes.label_selector", str(e)) from None
        if kc.watch_timeout_s < 1:
            raise self.err("kubernetes.watch_timeout_s", "must be >= 1")
        if kc.retry_backoff_s <= 0:
            raise self.err("kubernetes.retry_backoff_s", "must be > 0")
        per_model: dict[str, KubernetesModelConfig] = {}
        for name, block in self.mapping(models, "kubernetes.models").items():
            path = f"kubernetes.models.{name}"
            mc = self.scalar_block(KubernetesModelConfig, block, path)
            if mc.max_prompt_tokens and mc.min_prompt_tokens > mc.max_prompt_tokens:
                raise self.err(f"{path}.min_prompt_tokens", "must not exceed max_prompt_tokens")
            per_model[str(name)] = mc
        return replace(kc, namespaces=tuple(ns), models=per_model)

    # -- tenancy: auth, limits, state --------------------------------------------------------

    def _known(self, data: dict[str, Any], allowed: tuple[str, ...], path: str) -> None:
        for key in data:
            if key not in allowed:
                raise self.err(f"{path}.{key}", f"unknown key (known: {', '.join(allowed)})")

    def _secret(self, data: dict[str, Any], key: str, path: str) -> str | None:
        """``key`` given inline or ``key_env`` naming an environment variable; not both."""
        inline, env = data.get(key), data.get(f"{key}_env")
        if inline is not None and env is not None:
            raise self.err(f"{path}.{key}_env", f"give {key} or {key}_env, not both")
        if inline is not None:
            if not isinstance(inline, str) or not inline:
                raise self.err(f"{path}.{key}", "must be a non-empty string")
            return inline
        if env is not None:
            if not isinstance(env, str) or not env:
                raise self.err(f"{path}.{key}_env", "must be the name of an environment variable")
            value = os.environ.get(env)
            if not value:
                raise self.err(f"{path}.{key}_env", f"environment variable {env} is not set or empty")
            return value
        return None

    def auth(self, value: Any) -> AuthConfig:
        a = self.mapping(value, "auth")
        self._known(a, ("api_keys", "enabled", "admin_token", "admin_token_env", "forward_authorization"), "auth")
        raw_keys = a.get("api_keys") or []
        if not isinstance(raw_keys, list):
            raise self.err("auth.api_keys", "must be a list of {key, user}")
        keys: list[ApiKey] = []
        seen: dict[str, int] = {}
        for i, k in enumerate(raw_keys):
            p = f"auth.api_keys[{i}]"
            kd = self.mapping(k, p)
            self._known(kd, ("key", "key_sha256", "user", "name"), p)
            key, digest = kd.get("key"), kd.get("key_sha256")
            if (key is None) == (digest is None):
                raise self.err(f"{p}.key", "give exactly one of key or key_sha256")
            if key is not None and (not isinstance(key, str) or not key):
                raise self.err(f"{p}.key", "must be a non-empty string")
            if digest is not None:
                if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest.lower()):
                    raise self.err(f"{p}.key_sha256", "must be 64 hex digits (sha256 of the key)")
                digest = digest.lower()
            else:
                digest = hashlib.sha256(key.encode()).hexdigest()
            if digest in seen:
                raise self.err(f"{p}.key", f"same key as auth.api_keys[{seen[digest]}]")
            seen[digest] = i
            user = kd.get("user", "default")
            if not isinstance(user, str) or not user:
                raise self.err(f"{p}.user", "must be a non-empty string")
            name = kd.get("name", "")
            if not isinstance(name, str):
                raise self.err(f"{p}.name", "must be a string")
            keys.append(ApiKey(key=key or "", user=user, key_sha256=digest, name=name))
        enabled = a.get("enabled")
        if enabled is not None and not isinstance(enabled, bool):
            raise self.err("auth.enabled", f"must be true, false or null, got {enabled!r}")
        fwd = a.get("forward_authorization", False)
        if not isinstance(fwd, bool):
            raise self.err("auth.forward_authorization", f"must be true or false, got {fwd!r}")
        return AuthConfig(api_keys=tuple(keys), enabled=enabled, forward_authorization=fwd,
                          admin_token=self._secret(a, "admin_token", "auth"))

    def limits(self, value: Any) -> LimitsConfig:
        lim = self.mapping(value, "limits")
        self._known(lim, ("users", "models", "default_user"), "limits")
        users: dict[str, UserLimits] = {}
        for name, v in self.mapping(lim.get("users"), "limits.users").items():
            if not isinstance(name, str) or not name:
                raise self.err(f"limits.users.{name}", "user names must be non-empty strings")
            users[name] = self.scalar_block(UserLimits, v, f"limits.users.{name}")
        models: dict[str, ModelLimits] = {}
        for name, v in self.mapping(lim.get("models"), "limits.models").items():
            if not isinstance(name, str) or not name:
                raise self.err(f"limits.models.{name}", "model names must be non-empty strings")
            models[name] = self.scalar_block(ModelLimits, v, f"limits.models.{name}")
        default_user = (self.scalar_block(UserLimits, lim["default_user"], "limits.default_user")
                        if lim.get("default_user") is not None else None)
        return LimitsConfig(users=users, models=models, default_user=default_user)

    def state(self, value: Any) -> StateConfig:
        st = dict(self.mapping(value, "state"))
        password = self._secret(st, "password", "state")
        st.pop("password", None)
        st.pop("password_env", None)
        sc = self.scalar_block(StateConfig, st, "state")
        url = sc.redis_url
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            raise self.err("state.redis_url", f"must be a redis://, rediss:// or unix:// URL, got {url!r}")
        if sc.failure_policy not in FAILURE_POLICIES:
            raise self.err("state.failure_policy", f"must be open or closed, got {sc.failure_policy!r}")
        for key in ("timeout_s", "sync_interval_s", "replica_ttl_s"):
            if getattr(sc, key) <= 0:
                raise self.err(f"state.{key}", "must be > 0")
        if sc.replica_ttl_s < 2 * sc.sync_interval_s:
            raise self.err("state.replica_ttl_s", "must be at least twice state.sync_interval_s")
        if not sc.key_prefix or not _PREFIX.fullmatch(sc.key_prefix):
            raise self.err("state.key_prefix", "must be letters, digits and . _ - : { }")
        if sc.replica_id is not None and not _PREFIX.fullmatch(sc.replica_id):
            raise self.err("state.replica_id", "must be letters, digits and . _ - : { }")
        if sc.tls_ca_file is not None and (url is None or not url.startswith("rediss://")):
            raise self.err("state.tls_ca_file", "needs a rediss:// state.redis_url")
        return replace(sc, password=password)

    def load(self, raw: Any) -> Config:
        data = self.mapping(raw, "<root>")
        known = {f.name for f in fields(Config)}
        for key in data:
            if key not in known:
                raise self.err(key, f"unknown key (known: {', '.join(sorted(known))})")
        kw: dict[str, Any] = {}
        for key, cls in (("listen", ListenConfig), ("server", ServerConfig), ("routing", RoutingConfig),
                         ("upstream", UpstreamConfig), ("health", HealthConfig), ("scrape", ScrapeConfig),
                         ("watchdog", WatchdogConfig), ("pd", PDConfig)):
            if key in data:
                kw[key] = self.scalar_block(cls, data[key], key)
        if "server" in kw and kw["server"].log_format not in ("json", "console"):
            raise self.err("server.log_format", "must be json or console")
        if "listen" in kw and not 0 <= kw["listen"].port <= 65535:
            raise self.err("listen.port", "must be a TCP port")
        self.discovery = bool(self.mapping(data.get("kubernetes"), "kubernetes").get("enabled"))
        raw_models = data.get("models") or []
        if not isinstance(raw_models, list):
            raise self.err("models", "must be a list")
        if "pd" in kw:
            self.check_pd(kw["pd"], "pd")
        g_wd, g_pd = kw.get("watchdog", WatchdogConfig()), kw.get("pd", PDConfig())
        models = tuple(self.model(m, f"models[{i}]", g_wd, g_pd) for i, m in enumerate(raw_models))
        seen: set[str] = set()
        for i, m in enumerate(models):
            if m.name in seen:
                raise self.err(f"models[{i}].name", f"duplicate model name {m.name!r}")
            seen.add(m.name)
        kw["models"] = models
        if "kubernetes" in data:
            kw["kubernetes"] = self.kubernetes(data["kubernetes"])
        if "auth" in data:
            kw["auth"] = self.auth(data["auth"])
        if "limits" in data:
            kw["limits"] = self.limits(data["limits"])
        if "state" in data:
            kw["state"] = self.state(data["state"])
        return Config(**kw)


def load_config(path: str | Path) -> Config:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError("<file>", f"cannot read: {e.strerror}", str(p)) from None
    return parse_config(text, source=str(p))


def parse_config(text: str, source: str | None = None) -> Config:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError("<yaml>", f"invalid YAML: {e}", source) from None
    return _Loader(source).load(raw)


def config_from_dict(raw: dict[str, Any], source: str | None = None) -> Config:
    return _Loader(source).load(raw)
