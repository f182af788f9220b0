"""Configuration: YAML into typed, frozen objects, with errors that name the key and the file.

Unknown keys are errors (a typo must not silently fall back to a default). Every block has
defaults, so the smallest useful config is a ``models:`` list.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from gateway.endpoints import ENGINES


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
    log_format: str = "console"          # json | console
    log_level: str = "info"


@dataclass(frozen=True)
class RoutingConfig:
    strategy: str = "least-request"
    metrics_max_age_s: float = 10.0      # engine metrics older than this count as missing


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
    prefill_timeout_s: float = 30.0


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
class KubernetesConfig:
    enabled: bool = False
    kubeconfig: str | None = None
    namespaces: tuple[str, ...] = ()
    label_selector: str = "model.aibrix.ai/name"


@dataclass(frozen=True)
class ApiKey:
    key: str
    user: str


@dataclass(frozen=True)
class AuthConfig:
    api_keys: tuple[ApiKey, ...] = ()


@dataclass(frozen=True)
class UserLimits:
    rpm: int = 0
    tpm: int = 0


@dataclass(frozen=True)
class LimitsConfig:
    users: dict[str, UserLimits] = field(default_factory=dict)


@dataclass(frozen=True)
class StateConfig:
    redis_url: str | None = None


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

    def model(self, name: str) -> ModelConfig | None:
        for m in self.models:
            if m.name == name:
                return m
        return None

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

    def err(self, path: str, message: str) -> ConfigError:
        return ConfigError(path, message, self.source)

    def mapping(self, value: Any, path: str) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.err(path, f"must be a mapping, got {type(value).__name__}")
        return value

    def scalar_block(self, cls: type, value: Any, path: str) -> Any:
        """Build a dataclass of scalars, type-checking each key against its default's type."""
        data = self.mapping(value, path)
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        defaults = cls()
        for key, v in data.items():
            if key not in known:
                raise self.err(f"{path}.{key}", f"unknown key (known: {', '.join(known)})")
            default = getattr(defaults, key)
            kwargs[key] = self.coerce(v, default, f"{path}.{key}")
        return cls(**kwargs)

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

    def model(self, value: Any, path: str) -> ModelConfig:
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
        if not endpoints and not rolesets:
            raise self.err(path, f"model {name!r} needs 'endpoints' or 'rolesets'")
        watchdog = (self.scalar_block(WatchdogConfig, data["watchdog"], f"{path}.watchdog")
                    if data.get("watchdog") is not None else None)
        pd = self.scalar_block(PDConfig, data["pd"], f"{path}.pd") if data.get("pd") is not None else None
        return ModelConfig(name=name, engine=engine, strategy=data.get("strategy"),
                           lock_strategy=data.get("lock_strategy"), endpoints=endpoints,
                           rolesets=tuple(rolesets), watchdog=watchdog, pd=pd)

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
        raw_models = data.get("models") or []
        if not isinstance(raw_models, list):
            raise self.err("models", "must be a list")
        models = tuple(self.model(m, f"models[{i}]") for i, m in enumerate(raw_models))
        seen: set[str] = set()
        for i, m in enumerate(models):
            if m.name in seen:
                raise self.err(f"models[{i}].name", f"duplicate model name {m.name!r}")
            seen.add(m.name)
        kw["models"] = models
        if "kubernetes" in data:
            k = self.mapping(data["kubernetes"], "kubernetes")
            allowed = {f.name for f in fields(KubernetesConfig)}
            for key in k:
                if key not in allowed:
                    raise self.err(f"kubernetes.{key}", f"unknown key (known: {', '.join(sorted(allowed))})")
            if k.get("enabled"):
                raise self.err("kubernetes.enabled", "Kubernetes discovery is not available in this version")
            kw["kubernetes"] = KubernetesConfig(enabled=False)
        if "auth" in data:
            a = self.mapping(data["auth"], "auth")
            for key in a:
                if key != "api_keys":
                    raise self.err(f"auth.{key}", "unknown key (known: api_keys)")
            keys = []
            raw_keys = a.get("api_keys") or []
            if not isinstance(raw_keys, list):
                raise self.err("auth.api_keys", "must be a list of {key, user}")
            for i, k in enumerate(raw_keys):
                kd = self.mapping(k, f"auth.api_keys[{i}]")
                if not isinstance(kd.get("key"), str) or not kd["key"]:
                    raise self.err(f"auth.api_keys[{i}].key", "is required and must be a non-empty string")
                user = kd.get("user", "default")
                if not isinstance(user, str):
                    raise self.err(f"auth.api_keys[{i}].user", "must be a string")
                keys.append(ApiKey(key=kd["key"], user=user))
            kw["auth"] = AuthConfig(api_keys=tuple(keys))
        if "limits" in data:
            lim = self.mapping(data["limits"], "limits")
            if lim.get("users"):
                raise self.err("limits.users", "per-user rate limits are not available in this version")
        if "state" in data:
            st = self.mapping(data["state"], "state")
            if st.get("redis_url"):
                raise self.err("state.redis_url", "the Redis state backend is not available in this version")
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
