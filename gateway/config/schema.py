"""Configuration: YAML into typed, frozen msgspec Structs, with errors that name the file and key.

Decoding is strict (gateway/config/strict.py): a wrong type, a negative number, a value outside a list of
choices or an unknown key (a typo must not silently fall back to a default) is an error such as
``conf.yaml: models[0].pd.prefill_timeout_s: ...``; null means the default. What types cannot say
is checked in ``__post_init__``. Settings belong to their readers: the strategies' knobs
(routers.base.RoutingSettings, routers.pd.PDRouteSettings), the engines' P/D knobs (handlers.vllm,
handlers.sglang), discovery's (k8s.settings), tracing's (gateway.observability.tracing); the blocks here add what
only the gateway reads.

Every key is described once, beside its type and default: ``Annotated[T, Meta(description=...)]``.
The JSON Schema (gateway/config/json_schema.py), docs/configuration.md and examples/full.yaml
(gateway/config/reference.py) are generated from these Structs; a test fails on a key without one.
Old names still accepted are in gateway/config/deprecated.py.
"""

from __future__ import annotations

import hashlib
import os
import re
import select
import ssl
import stat
import threading
import time
from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

import msgspec
import structlog
import yaml
from msgspec import Meta
from msgspec.structs import force_setattr

from gateway.admission.config import AdmissionConfig, Priority, SLOConfig
from gateway.aliases import AliasConfig, check_aliases
from gateway.apis.responses_config import ResponsesConfig
from gateway.batch.config import BatchConfig
from gateway.config.block import Block
from gateway.config.deprecated import MOVED_PD_KEYS, RETRY_FLAG, Deprecation, log_deprecations
from gateway.config.strict import (
    StrictError,
    alias_expansion,
    convert,
    did_you_mean,
    laid_over,
    nested_beyond,
    non_finite,
    self_reference,
    without_nulls,
)
from gateway.endpoints import ENGINES
from gateway.kv.settings import KVEventsConfig, KVEventsEndpointConfig
from gateway.lora.config import LoraConfig, check_adapters
from gateway.observability.tracing import TracingConfig
from gateway.resilience.breaker import BreakerConfig
from gateway.resilience.retry import RetryConfig
from gateway.state.urls import parse_redis_url
from gateway.view.config import ViewConfig
from handlers.sglang import SGLangPDSettings
from handlers.vllm import VLLMPDSettings
from k8s.settings import KubernetesConfig
from k8s.settings import KubernetesModelConfig as KubernetesModelConfig  # re-exported
from routers.base import RouterContext, RoutingSettings
from routers.pd import PDRouteSettings
from routers.registry import RouterRegistry, StrategyError, default_registry

LOG_LEVELS = ("debug", "info", "warning", "warn", "error", "critical")
Count = Annotated[int, Meta(ge=0)]
Amount = Annotated[float, Meta(ge=0)]            # seconds, ratios, weights
Positive = Annotated[float, Meta(gt=0)]
Port = Annotated[int, Meta(ge=0, le=65535)]
Name = Annotated[str, Meta(min_length=1)]
Engine = Literal[ENGINES]
_ID = Annotated[str, Meta(pattern=r"\A[A-Za-z0-9._:{}\-]{1,64}\Z")]       # Redis key prefix, replica id
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class ConfigError(ValueError):
    """``entry``: the key of the mapping ``path`` names that is at fault, when the path stops at
    the mapping (a name the message shows quoted, that would not read well in a key path); it
    leads ``located`` to the entry's line."""
    def __init__(self, path: str, message: str, source: str | None = None, entry: str | None = None) -> None:
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{path}: {message}")
        self.key_path, self.message, self.entry = path, message, entry


def _from_env(inline: str | None, env: str | None, key: str) -> str | None:
    """A secret given inline (``key``) or by the name of an environment variable (``key_env``)."""
    if env is None:
        return inline
    if inline is not None:
        raise ValueError(f"{key}_env: give {key} or {key}_env, not both")
    if not os.environ.get(env):
        raise ValueError(f"{key}_env: environment variable {env} is not set or empty")
    return os.environ[env]


# what an engine's API key may be: what goes after ``Authorization: Bearer`` as it is, visible
# ASCII without spaces (vLLM splits the header at its first space, SGLang compares it whole)
_ENGINE_KEY = re.compile(r"[\x21-\x7e]+")


def _presentable(secret: str) -> bool:
    """Whether a client can send ``secret`` as a header's value, as the gateway reads it: no
    whitespace at its ends (RFC 9110 section 5.5: not part of the value; the key after ``Bearer``
    and in ``x-api-key`` is read without it) and no line break or NUL, which no value holds."""
    return secret == secret.strip() and not any(c in secret for c in "\r\n\0")


def _unmatched_name(name: str) -> str | None:
    """What is wrong with a model's, adapter's or alias's name written in the config (``name`` of
    ``models``, an ``adapters`` key, an alias's ``name`` and targets, a ``models`` allowlist entry,
    a ``limits.models`` or ``kubernetes.models`` key), or None. A request's model is matched as it
    is written, and clients write none with whitespace at its ends, so a name with some (``"m "``,
    a quoted name that kept a space) matches no request: a model or an alias ``/v1/models`` lists
    as ``m `` and a client asking for ``m`` is answered 404. A control character inside one
    (``\\x00``-``\\x1f``, ``\\x7f``) would split the log lines, metric labels and headers it goes into."""
    if name == name.strip():
        return _control(name)
    if not name.strip():
        return f"the name {name!r} is only whitespace, which no request names"
    return (f"the name {name!r} has whitespace at its ends: a request's model is matched as it is written, "
            f"so one naming {name.strip()!r} would not match it (write it without)")


CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")     # in a name: it would split a log line, a label, a header


def _control(name: str, what: str = "name") -> str | None:
    """What is wrong with a name that holds a control character, or None."""
    if (c := CONTROL_CHARACTER.search(name)) is None:
        return None
    return (f"the {what} {name!r} holds a control character ({c[0]!r}), which would split the log lines, "
            "metric labels and headers it goes into")


def _unmatched_user(name: str) -> str | None:
    """What is wrong with a user's name written in the config (a ``limits.users`` key, an API
    key's ``user``), or None: a request's user is read from a header without whitespace at its
    ends (RFC 9110 section 5.5), so a name with some matches no request; a control character
    would split the log lines and the user header to the engine it goes into."""
    if name != name.strip():
        return (f"the user {name!r} has whitespace at its ends: a request's user is read without it, so "
                "no request would match it (write it without)")
    return _control(name, "user")


_UNPRESENTABLE = ("has whitespace at its ends, or a line break or a NUL, which no header a client sends "
                  "can carry, so no request would match it")


def _engine_key(inline: str | None, env: str | None) -> str | None:
    """An engine's API key (``api_key`` or ``api_key_env``), checked; errors never show it."""
    key = _from_env(inline, env, "api_key")
    if key is not None and not _ENGINE_KEY.fullmatch(key):
        where = f"api_key_env: the value of {env}" if env is not None else "api_key"
        raise ValueError(f"{where}: must be visible ASCII characters without spaces (it is sent as "
                         "Authorization: Bearer <key>)")
    return key


class ListenConfig(Block):
    host: Annotated[str, Meta(description="Address to listen on, or a host name, without scheme, port or brackets; 0.0.0.0 listens on every IPv4 interface, :: on every interface. --host overrides it.")] = "127.0.0.1"
    port: Annotated[Port, Meta(description="TCP port to listen on; 0 picks a free port. --port overrides it.")] = 8888

    def __post_init__(self) -> None:
        if why := not_a_listen_host(self.host):
            raise ValueError(f"host: {why}")


def not_a_listen_host(host: str) -> str | None:
    """What makes ``host`` no address or host name a listener can bind, or None."""
    if not host:
        return "is empty (0.0.0.0 listens on every IPv4 interface, 127.0.0.1 on this host only)"
    if "://" in host:
        return f"{host!r}: an address or a host name, no scheme"
    if host.startswith("["):
        return f"{host!r}: an IPv6 address is written without brackets (::1, ::)"
    if host.count(":") == 1:
        return f"{host!r}: an address or a host name, no port (listen.port is the port)"
    if "/" in host or any(c.isspace() for c in host):
        return f"{host!r}: an address or a host name"
    return None


# an origin as a browser serializes it (RFC 6454 §6.2): scheme://host[:port], lower case; the host a
# name, an IPv4 address or a bracketed IPv6 address
_ORIGIN = re.compile(r"([a-z][a-z0-9+.-]*)://([a-z0-9_-]+(?:\.[a-z0-9_-]+)*|\[[0-9a-f:.]+\])(?::([0-9]+))?")
_DEFAULT_PORTS = {"http": "80", "https": "443"}


def _cors_origin(value: str, key: str) -> str:
    """An origin of ``server.cors_allowed_origins`` spelled as a browser sends it, or a ValueError."""
    if value == "null":
        raise ValueError(f"{key}: 'null' is the origin of sandboxed frames and local files, which any page can "
                         "take on; it cannot be allowed")
    if "*" in value:
        raise ValueError(f"{key}: {value!r}: a wildcard is the whole list's only entry, ['*'], or none")
    scheme, sep, rest = value.partition("://")
    if sep and rest and any(c in rest for c in "/?#"):
        raise ValueError(f"{key}: {value!r} is not an origin: an origin has no path, query or trailing slash "
                         f"(did you mean {scheme + sep + rest.split('/')[0].split('?')[0].split('#')[0]!r}?)")
    m = _ORIGIN.fullmatch(value.lower())
    if m is None:
        raise ValueError(f"{key}: {value!r} is not an origin: must be scheme://host[:port], as "
                         "https://app.example.com or http://localhost:3000")
    scheme, host, port = m.groups()
    if port is not None and not 0 < int(port) < 65536:
        raise ValueError(f"{key}: {value!r}: the port must be 1-65535")
    if port is None or _DEFAULT_PORTS.get(scheme) == port.lstrip("0"):
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{int(port)}"


def _cors_origins(given: tuple[str, ...]) -> tuple[str, ...]:
    if "*" in given:
        if len(given) > 1:
            raise ValueError("cors_allowed_origins: '*' allows every origin and stands alone; list it alone, "
                             "or list the origins without it")
        return given
    return tuple(dict.fromkeys(_cors_origin(o, f"cors_allowed_origins[{i}]") for i, o in enumerate(given)))


class ServerConfig(Block):
    max_body_bytes: Annotated[Count, Meta(description="Largest request body accepted, in bytes; a larger one is refused with 413 before it is read (0: no limit).")] = 16 * 1024 * 1024
    shutdown_grace_s: Annotated[Amount, Meta(description="After SIGTERM, how long requests in flight (streams included) may still run before they are cut, in seconds; with --workers N, also how long a worker still starting may take before the parent kills it.")] = 30.0
    workers: Annotated[Annotated[int, Meta(ge=1)] | Literal["auto"], Meta(description="Processes serving the same port (SO_REUSEPORT), each a whole gateway sharing one routing view with the others (view:); auto: as many as the CPUs of the cgroup's quota (and at most one per 256 MiB of its memory limit), or 1 when admission is enabled (its priority is strict within one process), a model lists LoRA adapters to load on demand while view.workers or view.share_monitoring is off (the workers would not know of each other's adapters in flight), or limits or the admin API are configured without state.redis_url (their counters and keys would be per process). --workers overrides it.")] = "auto"
    worker_stall_timeout_s: Annotated[Amount, Meta(description="With several workers: a worker whose event loop has not run for this long (a blocking call, a deadlock, a stopped process) is killed and restarted by the parent, since the kernel keeps handing it new connections it would never answer, in seconds (0: never; else at least 2). Start-up is not judged. Counted in switchyard_worker_restarts_total{reason=\"stalled\"}.")] = 20.0
    reload_settle_s: Annotated[Amount, Meta(description="A reload (SIGHUP, POST /admin/reload) reads the config file once it has been left unchanged this long, in seconds, and again if it changed while it was read: a file written in place (an editor that truncates it then writes, kubectl cp) is read whole, not its first half; a reload deferred so is logged (config reload deferred) and counted in switchyard_config_reload_deferred_total, and one whose file is still changing after 10 s (or 3 times this, if longer) is refused (0: read at once).")] = 0.5
    reload_read_timeout_s: Annotated[Amount, Meta(description="How long a reload (SIGHUP, POST /admin/reload) waits for the config file's text, in seconds: a path that is a FIFO no one writes is refused once no text came for this long, and a file on a hung mount (NFS, a stalled FUSE daemon) once its read has not returned for twice this long after the wait for the file to be left unchanged (reload_settle_s); the reload is refused with key path <file>, logged and counted in switchyard_config_reload_total{result=\"invalid\"}, and the running config kept, by one process and by the --workers parent alike. While a read left so has not returned, a reload is refused at once (0: wait for as long as it takes; the --workers parent until a stop).")] = 2.0
    admin_reload_wait_s: Annotated[Amount, Meta(description="With several workers: how long POST /admin/reload waits for the parent to read the config file and every worker to apply it before it answers, in seconds (a file near the 4 MiB bound takes seconds to parse, in the parent and then in each worker). A reload still under way then (the parent reading the file, or the worker asked applying it) is answered 202 in_progress, and applies once parsed; a parent that has not begun it (stopped, or busy) is answered 202 queued, and applies it once it gets to it; a sibling that has not applied it is left behind with a warning, and a reload the worker asked applied is answered 202 in_progress too (an API key it removed still works there).")] = 10.0
    drain_delay_s: Annotated[Amount, Meta(description="After SIGTERM, how long new connections are still accepted while /ready answers 503, so load balancers can take the gateway out first, in seconds (at most shutdown_grace_s; SIGINT skips it).")] = 5.0
    log_format: Annotated[Literal["auto", "json", "console"], Meta(description="Format of log lines: json, console, or auto (console when stderr is a terminal, else JSON). --log-format overrides it.")] = "auto"
    log_level: Annotated[str, Meta(description="Lowest level logged: debug, info, warning or error (any case; warn and critical are taken too); at warning or error the per-request line is not written either.")] = "info"
    # the edge (gateway/server/edge.py): slow clients, connection cap, header limits; 0 disables a timeout
    header_timeout_s: Annotated[Amount, Meta(description="Longest time from accepting a connection (or from the first byte of a next request on a kept-alive one) to a complete request head; then 408 and close, in seconds (0: no limit).")] = 10.0
    body_timeout_s: Annotated[Amount, Meta(description="Longest silence between two reads of a request body; then 408 and close, in seconds (0: no limit).")] = 30.0
    body_total_timeout_s: Annotated[Amount, Meta(description="Longest time from a complete request head to the whole body received; then 408 and close, in seconds (0: no limit).")] = 120.0
    keepalive_timeout_s: Annotated[Amount, Meta(description="An idle kept-alive client connection is closed after this many seconds without a byte of a next request (0: never).")] = 75.0
    write_stall_timeout_s: Annotated[Amount, Meta(description="A client that reads nothing while the gateway has a full write buffer for it this long, or a stream's client that takes no byte of what waits for it in the kernel's send buffer over a whole such period (so within twice this, however slowly the engine writes), is disconnected and its upstream leg ended, in seconds (0: never). A client that takes bytes within each such period, however slowly, is not.")] = 30.0
    max_connections: Annotated[Count, Meta(description="Open client connections per worker; past it a new connection is closed at once (0: no cap). A worker whose file-descriptor limit (ulimit -n) leaves room for fewer, with an engine connection each, takes fewer, and says so at start.")] = 10000
    raise_nofile_limit: Annotated[bool, Meta(description="At start, raise the soft file-descriptor limit (ulimit -n) to the hard one (ulimit -Hn), at most 1048576 and what the kernel allows (fs.nr_open), before the workers are started and their connection caps computed; never lowered, logged once (file descriptor limit raised). false: keep the soft limit the gateway was started with.")] = True
    max_header_bytes: Annotated[int, Meta(ge=1024, description="Longest request line, and longest single header field, in bytes; longer gets 431.")] = 16384
    max_headers: Annotated[int, Meta(ge=8, description="Most header fields in one request; more gets 431.")] = 100
    max_header_total_bytes: Annotated[Count, Meta(description="Largest header section of a request in all: its fields' names and values, with 4 bytes a field for its colon, space and line end; larger gets 431 before any engine is asked, and a head still coming gets it once its bytes pass the request line, this bound and 4 KiB more, so a connection holds no more of a head than that (0: no bound but max_header_bytes and max_headers, which let a head hold 1.6 MB). The headers a request forwards to its engine must pass the engine's own bound, which refuses them with a 400 of its own: an h11 server's 16 KiB head by default (uvicorn without httptools), 4 MiB in vLLM's API server.")] = 65536
    fast_lane: Annotated[bool, Meta(description="Take a plain HTTP/1.1 POST to an inference path with a JSON body (chat, completions, embeddings, Messages, Responses, the JSON pass-through paths; a Content-Length body, waited for when it comes after its head, up to 1 MiB; nothing else in flight on its connection) off the connection, read by the edge's own fast lane without aiohttp's request path; every other request goes through aiohttp as with false. Counted in switchyard_client_requests_fast_lane_total.")] = True
    loop_lag_interval_s: Annotated[Amount, Meta(description="How often the event loop's lag is sampled into switchyard_event_loop_lag_seconds, in seconds (0: off).")] = 0.5
    removed_endpoint_series_s: Annotated[Amount, Meta(description="How long the Prometheus series labelled with an endpoint (switchyard_upstream_errors_total, switchyard_health_probes_total, switchyard_engine_scrapes_total, switchyard_engine_restarts_total, switchyard_breaker_transitions_total, switchyard_upstream_outcomes_total) are still exported after the endpoint left the pool (a pod deleted, a reload) and its last request ended, so scrapes see its last counts; then they are dropped, and the slo strategy's latency models of the endpoint with them, in seconds.")] = 300.0
    reclaim_min_drop: Annotated[Count, Meta(description="After requests in flight fell this far below their peak, run a garbage collection and give freed memory back to the system, once per burst (0: off).")] = 1000
    cors_allowed_origins: Annotated[tuple[str, ...], Meta(description="Web page origins allowed to call the API from a browser (CORS): each scheme://host[:port] exactly as a browser sends it in its Origin header (no path, no trailing slash; capital letters and a scheme's default port are dropped), or [\"*\"] alone for any origin. A preflight (OPTIONS) to an API path from a listed origin is answered without an API key; every answer to it carries Access-Control-Allow-Origin (the origin, or * with [\"*\"]); credentials (cookies) are never allowed, the API key goes in a header the page sets. A request with an Origin header then goes through aiohttp's request path, not the fast lane. Empty: CORS off, no CORS header on any answer.")] = ()

    def __post_init__(self) -> None:
        # a worker's loop ticks every 0.5 s (gateway/server/heartbeat.py BEAT_S): a shorter limit
        # would kill a worker for one late timer
        if 0 < self.worker_stall_timeout_s < 2:
            raise ValueError("worker_stall_timeout_s: must be 0 (never) or at least 2 seconds")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level: must be one of debug, info, warning or error, got {self.log_level!r}")
        force_setattr(self, "cors_allowed_origins", _cors_origins(self.cors_allowed_origins))


class RoutingConfig(RoutingSettings):
    """The ``routing:`` block: the default strategy, and the strategies' knobs (RoutingSettings)."""

    strategy: Annotated[str, Meta(description="Default routing strategy of models that name none: a strategy name, or a weighted list such as prefix-cache:2,least-request:1.")] = "least-request"


class UpstreamConfig(Block):
    connect_timeout_s: Annotated[Amount, Meta(description="Longest wait to open a connection to an engine, in seconds (0: no limit).")] = 5.0
    first_byte_timeout_s: Annotated[Amount, Meta(description="Longest wait for an engine's response headers after the request was sent, in seconds; then 504 (0: no limit).")] = 300.0
    total_timeout_s: Annotated[Amount, Meta(description="Longest whole exchange with an engine, request to last byte, in seconds (0: no limit).")] = 0.0
    retry_on_connect_error: Annotated[bool, Meta(description="Deprecated (removed in 0.3.0): false turns every retry off; use retry.enabled instead.", extra_json_schema={"deprecated": True})] = True
    max_connections: Annotated[Count, Meta(description="Connections to engines, all endpoints together, per worker process (0: no cap).")] = 0
    keepalive_timeout_s: Annotated[Amount, Meta(description="An idle pooled connection to an engine is closed after this many seconds (0: none is kept, each request opens a connection of its own).")] = 60.0
    warm_connections: Annotated[Count, Meta(description="Idle connections per engine the pool opens again when the engine closes them (vLLM and SGLang close an idle kept-alive connection after 5 s), so the first request after a lull does not wait for a connect; only for an engine that served a request within keepalive_timeout_s and is still in the pool (an engine that leaves it has its connections closed, a busy one when its answer ends) (0: off).")] = 1
    max_error_body_bytes: Annotated[Count, Meta(description="Most bytes of an engine's error answer read and passed on to the client.")] = 65536
    client_priority: Annotated[bool, Meta(description="Pass a request body's priority, and an X-Vllm-Priority header (which vLLM reads over it), to the engine (vLLM's --scheduling-policy priority runs a lower value first, SGLang's --enable-priority-scheduling a higher one by default): a client could then jump the engine's queue whatever its admission class. Off: the gateway drops them, counts them (switchyard_request_fields_dropped_total) and logs them (dropped_fields).")] = False
    client_logits_processors: Annotated[bool, Meta(description="Pass a request's logits processors to the engine: vLLM's logits_processors (qualified names of classes it loads, those its --logits-processor-pattern matches) and SGLang's custom_logit_processor (a serialized Python callable it runs when started with --enable-custom-logit-processor): a client would then run code of its choosing in an engine other tenants share. Off: the gateway drops them, counts them (switchyard_request_fields_dropped_total) and logs them (dropped_fields).")] = False
    client_chat_template: Annotated[bool, Meta(description="Pass a chat request's chat_template, and a chat_template member of its chat_template_kwargs, to the engine: a Jinja template the engine renders the prompt with (vLLM refuses it unless started with --trust-request-chat-template, older releases rendered it; SGLang renders a chat_template_kwargs member as the tokenizer's template): a client would then have a template of its choosing rendered in an engine other tenants share. Off: the gateway drops them, counts them (switchyard_request_fields_dropped_total) and logs them (dropped_fields); the other template arguments (enable_thinking, thinking) pass.")] = False
    max_response_bytes: Annotated[Count, Meta(description="Largest answer the gateway reads whole (a non-streaming answer, a pass-through path's body, a prefill leg's answer, a stored response read from its engine), in bytes: a larger one (by its Content-Length, or once that many bytes came) is a 502 upstream_too_large and its engine connection is closed. The default holds a 32k-token chat answer with 20 top logprobs per token (about 40 MB of vLLM's JSON) and a batch of 2048 float embeddings of 3072 dimensions (about 90 MB); streams are relayed as they come and are not bounded by it (0: no limit).")] = 128 << 20


class HealthConfig(Block):
    enabled: Annotated[bool, Meta(description="Probe every endpoint's /health periodically; an endpoint failing the probes is taken out of routing.")] = True
    interval_s: Annotated[Positive, Meta(description="Time between two probe rounds, in seconds (more than 0; enabled: false turns the probes off).")] = 5.0
    timeout_s: Annotated[Positive, Meta(description="Longest wait for one probe's answer, in seconds.")] = 2.0
    unhealthy_threshold: Annotated[Count, Meta(description="Failed probes in a row before an endpoint counts as not ready.")] = 2
    healthy_threshold: Annotated[Count, Meta(description="Successful probes in a row before a not-ready endpoint is ready again.")] = 1
    passive: Annotated[bool, Meta(description="A refused connection to an endpoint (nothing listens on its port) opens its circuit breaker at once, without waiting for the probes; a connect that times out or finds no route is a fault as any other (an engine whose listen queue is full is alive).")] = True


class ScrapeConfig(Block):
    enabled: Annotated[bool, Meta(description="Read every endpoint's Prometheus /metrics periodically (queue, KV-cache usage, throughput) for the strategies and admission control that use engine load.")] = True
    interval_s: Annotated[Positive, Meta(description="Time between two scrape rounds, in seconds (more than 0; enabled: false turns scraping off).")] = 2.0
    timeout_s: Annotated[Positive, Meta(description="Longest wait for one scrape, in seconds.")] = 2.0


class WatchdogConfig(Block):
    first_chunk_timeout_s: Annotated[Amount, Meta(description="Streaming: longest wait for the first chunk of a watched leg's answer; then the client gets an error and the leg is ended, in seconds (0: off).")] = 60.0
    idle_timeout_s: Annotated[Amount, Meta(description="Streaming: longest silence between two chunks of an answer that has started, in seconds (0: off).")] = 120.0
    response_timeout_s: Annotated[Amount, Meta(description="Non-streaming: longest wait for the whole answer, in seconds (0: off).")] = 0.0
    aggregated: Annotated[bool, Meta(description="Also watch legs of aggregated (non-P/D) endpoints; by default only the decode leg of P/D requests is watched.")] = False


class PDConfig(PDRouteSettings):
    """P/D: the pair choice (PDRouteSettings), the legs, the engines' blocks. A model's ``pd:`` (and
    ``watchdog:``) block sets only the keys it names, on top of the global block."""

    prefill_timeout_s: Annotated[Amount, Meta(description="Longest wait for the prefill leg's answer, in seconds; then the request fails, with 504 (0: no limit).")] = 30.0
    token_request_cost: Annotated[Amount, Meta(description="Fixed token-load charge per request on its prefill endpoint, added to its uncached prompt tokens (the token_load prefill policy).")] = 3500.0
    # conditional disaggregation (gateway/pd/decide.py); 0 turns a rule off, all 0: always disaggregate
    disaggregate_min_uncached_tokens: Annotated[Count, Meta(description="Run a request whole on the decode (or a combined endpoint) when the chosen decode would have fewer uncached prompt tokens than this (0: rule off).")] = 0
    disaggregate_min_prompt_tokens: Annotated[Count, Meta(description="Run a request whole when its prompt has fewer tokens than this (0: rule off).")] = 0
    local_prefill_pressure: Annotated[Count, Meta(description="Run a request whole when the roleset's prefill endpoints have more prefills in flight each, on average, than this, and the decode has KV headroom (0: rule off).")] = 0
    local_max_decode_kv_usage: Annotated[float, Meta(ge=0, le=1, description="Under prefill pressure, run whole only when the decode's KV-cache usage is below this share (0..1), or unknown.")] = 0.8
    client_kv_transfer_params: Annotated[bool, Meta(description="Pass a client's own kv_transfer_params (and the kv_transfer_params member of vLLM's vllm_xargs, where vLLM's KV connector reads them too) to an aggregated endpoint, for clients that orchestrate prefill and decode themselves. Off: the gateway drops them (a vLLM engine with a NIXL connector would pin the request's KV blocks for a remote decode, or pull KV from a host the client named), counts them (switchyard_request_fields_dropped_total) and logs them (dropped_fields). P/D legs, and a request run whole on a decode, carry the gateway's own either way.")] = False
    vllm: Annotated[VLLMPDSettings, Meta(description="Settings for vLLM prefill/decode pairs.")] = VLLMPDSettings()
    sglang: Annotated[SGLangPDSettings, Meta(description="Settings for SGLang prefill/decode pairs.")] = SGLangPDSettings()


_API_KEY_DOC = ("API key the engine was started with (vLLM --api-key or VLLM_API_KEY, SGLang --api-key): every "
                "request the gateway sends it, its own calls included (aborts, LoRA loads, the P/D legs), carries "
                "Authorization: Bearer <key> in place of any key of the client's (health probes and /metrics scrapes "
                "go without: neither engine guards those); never logged or shown")
_API_KEY_ENV_DOC = "Name of an environment variable holding api_key (instead of api_key), so the file holds no secret"


class EndpointConfig(Block):
    _secret = ("api_key",)
    url: Annotated[str, Meta(description="Base URL of the engine's OpenAI-compatible server, http:// or https://.")]
    engine: Annotated[Engine | None, Meta(description="Engine of this endpoint; null: the model's engine.")] = None
    bootstrap_port: Annotated[Port | None, Meta(description="SGLang prefill: the KV bootstrap port; null: the roleset's, else pd.sglang.default_bootstrap_port.")] = None
    min_prompt_tokens: Annotated[Count, Meta(description="P/D prompt-length bucket: this endpoint takes prompts of at least this many tokens.")] = 0
    max_prompt_tokens: Annotated[Count, Meta(description="P/D prompt-length bucket: this endpoint takes prompts of at most this many tokens (0: no upper bound).")] = 0
    kv_events: Annotated[KVEventsEndpointConfig | None, Meta(description="This engine's KV-event publisher, laid over the model's kv_events block; giving it subscribes to this endpoint's events.")] = None
    api_key: Annotated[Name | None, Meta(description=f"{_API_KEY_DOC}; null: the model's api_key.")] = None
    api_key_env: Annotated[Name | None, Meta(description=f"{_API_KEY_ENV_DOC}.")] = None

    def __post_init__(self) -> None:
        force_setattr(self, "api_key", _engine_key(self.api_key, self.api_key_env))
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: must be an http(s):// URL, got {self.url!r}")
        try:                # what gateway.endpoints.Endpoint will parse: a host, a port that is a number
            parts = urlsplit(self.url)
            parts.port      # noqa: B018 (raises ValueError for a port that is not 0..65535)
        except ValueError as e:
            raise ValueError(f"url: {e}, in {self.url!r}") from None
        if not parts.hostname:
            raise ValueError(f"url: has no host, in {self.url!r}")
        if parts.username is not None or parts.password is not None:
            # the gateway sends no credentials from a URL, and would show them on the status page
            raise ValueError("url: must not carry a user name or password (they are not sent to the engine),"
                             f" in {parts.scheme}://…@{parts.hostname}")
        if parts.path.rstrip("/").endswith("/v1"):
            raise ValueError(f"url: give the engine's root, without /v1 (the gateway adds the API path), in {self.url!r}")
        if parts.query or parts.fragment:
            raise ValueError(f"url: must not have a query or fragment, in {self.url!r}")
        force_setattr(self, "url", self.url.rstrip("/"))


def _engine_identity(url: str) -> tuple:
    """The engine a checked endpoint URL names: its host in any case, its scheme's port if none."""
    parts = urlsplit(url)
    return parts.scheme, parts.hostname, parts.port or int(_DEFAULT_PORTS[parts.scheme]), parts.path.rstrip("/")


class RolesetConfig(Block):
    name: Annotated[str, Meta(description="Name of the group; prefill and decode are only paired within one roleset. Default: rs-0, rs-1, ... by position. Two rolesets of one model may not have one name.")]
    prefill: Annotated[tuple[EndpointConfig, ...], Meta(description="Prefill endpoints: URL strings or endpoint objects.")] = ()
    decode: Annotated[tuple[EndpointConfig, ...], Meta(description="Decode endpoints: URL strings or endpoint objects.")] = ()
    combined: Annotated[tuple[EndpointConfig, ...], Meta(description="Endpoints that serve whole requests beside the pairs (the pd strategy's fallback): URL strings or endpoint objects.")] = ()
    bootstrap_port: Annotated[Port | None, Meta(description="SGLang: the KV bootstrap port of this roleset's prefill endpoints that set none of their own.")] = None


class ModelConfig(Block):
    _secret = ("api_key",)
    name: Annotated[Name, Meta(description="The model's name, as clients write it in the request's model field (matched as it is written: no whitespace at its ends, nor at an adapter's, an alias's or a name in limits or kubernetes.models; none of them holds a control character).")]
    engine: Annotated[Engine, Meta(description="Engine serving the model's endpoints: vllm or sglang.")] = "vllm"
    strategy: Annotated[str | None, Meta(description="This model's default routing strategy (a name or a weighted list); null: the pods' annotation, else pd for a model with prefill/decode endpoints, else routing.strategy.")] = None
    lock_strategy: Annotated[str | None, Meta(description="A strategy that always applies to this model, whatever the routing-strategy header says; null: no lock.")] = None
    endpoints: Annotated[tuple[EndpointConfig, ...], Meta(description="Aggregated engines (one engine serves a whole request): URL strings or endpoint objects. An engine is one endpoint of a model in a role: a URL written twice for one model (here and in its rolesets' combined lists, or in their prefill lists, or in their decode lists; a trailing slash, a host's capitals and a scheme's own port aside) is an error, as are two URLs of one host and port in those lists (another scheme or path), which would make two endpoints of one name (host:port, the endpoint label of its metrics); one engine may serve several models, and be both a prefill and a decode.")] = ()
    rolesets: Annotated[tuple[RolesetConfig, ...], Meta(description="Prefill/decode groups for disaggregated serving.")] = ()
    watchdog: Annotated[WatchdogConfig | None, Meta(description="Keys laid over the global watchdog block for this model.")] = None
    pd: Annotated[PDConfig | None, Meta(description="Keys laid over the global pd block for this model.")] = None
    breaker: Annotated[BreakerConfig | None, Meta(description="Keys laid over the global breaker block for this model.")] = None
    retry: Annotated[RetryConfig | None, Meta(description="Keys laid over the global retry block for this model.")] = None
    adapters: Annotated[dict[Name, str], Meta(description="LoRA adapters of this model: adapter name (what clients write in model; no whitespace at its ends) to the path the engine loads it from; loaded on demand.")] = {}
    admission: Annotated[AdmissionConfig | None, Meta(description="Keys laid over the global admission block for this model.")] = None
    slo: Annotated[SLOConfig | None, Meta(description="Default latency objectives of this model's requests (the x-slo-ttft-ms and x-slo-tpot-ms headers override them); null: none.")] = None
    tokenizer: Annotated[str | None, Meta(description="Directory of the model's Hugging Face tokenizer (tokenizer.json, tokenizer_config.json); needed by kv_events. Null: no tokenizer.")] = None
    kv_events: Annotated[KVEventsConfig | None, Meta(description="Subscribe to the engines' KV-cache events for exact prefix-cache routing; needs tokenizer.")] = None
    migration_limit: Annotated[int, Meta(ge=0, le=8, description="How many times one stream may be continued on another endpoint after its engine failed mid-stream, at most 8 (0: off).")] = 0
    api_key: Annotated[Name | None, Meta(description=f"{_API_KEY_DOC}. For every endpoint of the model, the pods Kubernetes discovery finds included; an endpoint's own api_key wins. Null: the engines need none (the client's Authorization passes only as auth.forward_authorization says).")] = None
    api_key_env: Annotated[Name | None, Meta(description=f"{_API_KEY_ENV_DOC}; a Kubernetes Secret given to the gateway's pod as an environment variable.")] = None

    def __post_init__(self) -> None:
        force_setattr(self, "api_key", _engine_key(self.api_key, self.api_key_env))
        if self.kv_events is not None and self.kv_events.enabled and not self.tokenizer:
            raise ValueError("kv_events.enabled: needs the model's tokenizer directory (tokenizer: <dir>)")
        if self.wants_kv_events and not self.tokenizer:
            raise ValueError("an endpoint's kv_events: needs the model's tokenizer directory (tokenizer: <dir>)")
        if self.tokenizer is not None and not (Path(self.tokenizer) / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer: no tokenizer.json in {self.tokenizer!r}")
        names: dict[str, int] = {}
        for r, rs in enumerate(self.rolesets):
            if (first := names.setdefault(rs.name, r)) != r:
                # prefill and decode are paired within a roleset, told by its name (routers/pd.py)
                raise ValueError(f"rolesets[{r}].name: {rs.name!r} is also the name of rolesets[{first}]: "
                                 "one name is one roleset, whose prefills pair only with its decodes")
        seen: dict[tuple, str] = {}
        named: dict[tuple, tuple[str, str]] = {}
        for key, e in self._declared():
            # in one role (whole requests: endpoints and combined); a vLLM engine with kv_both may
            # be both a prefill and a decode
            role = next((r for r in ("prefill", "decode") if f".{r}[" in key), "whole")
            scheme, host, port, path = _engine_identity(e.url)
            first = seen.setdefault((role, scheme, host, port, path), key)
            if first != key:
                raise ValueError(f"{key}.url: {e.url} is also {first} of this model: one engine is one endpoint of a "
                                 "model in a role (two would split its load between their counters, and write every "
                                 "per-endpoint metric twice)")
            # an endpoint is named by its host and port (its metrics' endpoint label, the target-pod
            # header): one port serves one scheme, and two paths on it would be two endpoints of one name
            first, url = named.setdefault((role, host, port), (key, e.url))
            if first != key:
                name = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                raise ValueError(f"{key}.url: {e.url} and {first} ({url}) of this model have one host and port, "
                                 f"so one endpoint name, {name}: their series on /metrics, their log lines and "
                                 "the target-pod header could not tell them apart (give one URL per engine)")
        for e in (*self.endpoints, *(e for rs in self.rolesets for e in (*rs.prefill, *rs.decode, *rs.combined))):
            if e.kv_events is not None:          # an entry's ports with the model's ranks, or the other way
                try:
                    (self.kv_events or KVEventsConfig()).with_annotation(dict(e.kv_events.items()))
                except ValueError as err:
                    raise ValueError(f"endpoint {e.url} kv_events: {err}") from None


    def _declared(self) -> Iterator[tuple[str, EndpointConfig]]:
        """Each endpoint of the model with its key, ``endpoints[0]``, ``rolesets[1].prefill[0]``."""
        for i, e in enumerate(self.endpoints):
            yield f"endpoints[{i}]", e
        for r, rs in enumerate(self.rolesets):
            for role in ("prefill", "decode", "combined"):
                for i, e in enumerate(getattr(rs, role)):
                    yield f"rolesets[{r}].{role}[{i}]", e

    @property
    def wants_kv_events(self) -> bool:
        """Some endpoint subscribes to KV events: the model's block enables them, or an endpoint names its own."""
        return ((self.kv_events is not None and self.kv_events.enabled)
                or any(e.kv_events is not None for e in self.endpoints)
                or any(e.kv_events is not None for rs in self.rolesets for e in (*rs.prefill, *rs.decode, *rs.combined)))


class ApiKey(Block):
    """``key`` (plaintext, never in repr) or ``key_sha256`` (hex SHA-256: the file holds no secret)."""

    _secret = ("key",)
    key: Annotated[str, Meta(description="The API key in plain text; give this or key_sha256. No whitespace at its ends, line break or NUL, which no request could present.")] = ""
    user: Annotated[Name, Meta(description="The user this key authenticates as (limits.users names users); sent to the engine in the user header, so it has no whitespace at its ends and no control character.")] = "default"
    key_sha256: Annotated[str, Meta(description="Hex SHA-256 of the API key, so the file holds no secret; give this or key.")] = ""
    name: Annotated[str, Meta(description="A label for the key, shown by the admin API.")] = ""

    def __post_init__(self) -> None:
        given = self.key_sha256.lower()
        digest = hashlib.sha256(self.key.encode()).hexdigest() if self.key else given
        if not digest or (self.key and given and given != digest):
            raise ValueError("key: give exactly one of key or key_sha256")
        if not _SHA256_HEX.fullmatch(digest):
            raise ValueError("key_sha256: must be 64 hex digits (sha256 of the key)")
        if self.key and not _presentable(self.key):
            raise ValueError(f"key: the key {_UNPRESENTABLE}")
        if why := _unmatched_user(self.user):
            # the key's user replaces the client's `user` header to the engine (gateway/tenants),
            # and a header value holds no control character nor whitespace at its ends (RFC 9110
            # section 5.5); limits.users names users as they are written
            raise ValueError(f"user: {why}")
        force_setattr(self, "key_sha256", digest)


class AuthConfig(Block):
    _secret = ("admin_token",)
    api_keys: Annotated[tuple[ApiKey, ...], Meta(description="Accepted client API keys (Authorization: Bearer ...); empty: no gateway authentication unless enabled is true.")] = ()
    enabled: Annotated[bool | None, Meta(description="Require an API key on every request; null: on when api_keys is not empty.")] = None
    admin_token: Annotated[Name | None, Meta(description="Bearer token of the admin API (/admin/*); null: the admin API is off. No whitespace at its ends, line break or NUL, which no request could present (nor in the value of admin_token_env); not the key of any of api_keys, since an API key is not an admin token.")] = None
    admin_token_env: Annotated[Name | None, Meta(description="Name of an environment variable holding admin_token (instead of admin_token).")] = None
    forward_authorization: Annotated[bool, Meta(description="With authentication on, also pass the client's Authorization header on to the engines (by default they never see the client's key).")] = False

    def __post_init__(self) -> None:
        force_setattr(self, "admin_token", _from_env(self.admin_token, self.admin_token_env, "admin_token"))
        if self.admin_token is not None and not _presentable(self.admin_token):
            where = (f"admin_token_env: the value of {self.admin_token_env}" if self.admin_token_env is not None
                     else "admin_token: the token")
            raise ValueError(f"{where} {_UNPRESENTABLE}")
        admin = hashlib.sha256(self.admin_token.encode()).hexdigest() if self.admin_token is not None else None
        seen: dict[str, int] = {}
        for i, k in enumerate(self.api_keys):
            if k.key_sha256 == admin:
                # every client holding the key could read and change users and keys, and read /status.json
                raise ValueError(f"api_keys[{i}].key: the same as the admin token; an API key is not an admin "
                                 "token, give them different values")
            if k.key_sha256 in seen:
                raise ValueError(f"api_keys[{i}].key: same key as auth.api_keys[{seen[k.key_sha256]}]")
            seen[k.key_sha256] = i

    @property
    def on(self) -> bool:
        return bool(self.api_keys) if self.enabled is None else self.enabled


class UserLimits(Block):
    rpm: Annotated[Count, Meta(description="Requests per minute (0: unlimited).")] = 0
    tpm: Annotated[Count, Meta(description="Tokens per minute, prompt and completion together (0: unlimited).")] = 0
    max_concurrent: Annotated[Count, Meta(description="Requests in flight at once (0: unlimited).")] = 0
    priority: Annotated[Priority | None, Meta(description="Admission class of this user's requests: critical, standard or sheddable; null: admission.default_priority.")] = None
    models: Annotated[Annotated[tuple[Name, ...], Meta(min_length=1)] | None, Meta(description="The models this user may ask for, by the name the request gives: a model's, an alias's (it allows the alias, not its targets by their own names) or a LoRA adapter's (a base model listed does not allow its adapters); null: every model. A request for any other is answered as one for a model that does not exist (404 model_not_found), before the user's limits count it, and /v1/models lists only these.")] = None

    @property
    def any(self) -> bool:
        return bool(self.rpm or self.tpm or self.max_concurrent)


class ModelLimits(Block):
    rps: Annotated[Count, Meta(description="Requests per second to this model, all users and replicas together (0: unlimited).")] = 0


class LimitsConfig(Block):
    users: Annotated[dict[Name, UserLimits], Meta(description="Limits per user name (a request's user as it is written: no whitespace at its ends, no control character).")] = {}
    models: Annotated[dict[Name, ModelLimits], Meta(description="Limits per model name (a model's: the requests of an alias or a LoRA adapter count under their model's name).")] = {}
    default_user: Annotated[UserLimits | None, Meta(description="Limits of every user without an entry in users, each with counters of their own; null: such users are unlimited.")] = None


class StateConfig(Block):
    _secret = ("password", "sentinel_password")
    redis_url: Annotated[str | None, Meta(description="Redis holding the state shared by replicas and workers; null: state in this process only. One server: redis://[:password@]host:port/db, rediss:// (TLS) or unix:///path. A Sentinel-managed primary: redis+sentinel://[:password@]host:port[,host:port...]/<service>[/<db>] (the Sentinels; rediss+sentinel:// for TLS). A Redis Cluster: redis+cluster://[:password@]host:port[,host:port...] (any of its nodes; rediss+cluster:// for TLS).")] = None
    password: Annotated[Name | None, Meta(description="Redis password; null: the URL's, if any.")] = None
    password_env: Annotated[Name | None, Meta(description="Name of an environment variable holding the Redis password (instead of password).")] = None
    tls_ca_file: Annotated[str | None, Meta(description="CA bundle to verify the servers of a rediss://, rediss+sentinel:// or rediss+cluster:// URL, read when the config is (a path that is no file, or a file without a PEM certificate, is a config error); null: the system's.")] = None
    sentinel_password: Annotated[Name | None, Meta(description="Password of the Sentinels themselves (redis+sentinel:// URLs), when they require one; null: they are asked without.")] = None
    sentinel_password_env: Annotated[Name | None, Meta(description="Name of an environment variable holding the Sentinels' password (instead of sentinel_password).")] = None
    key_prefix: Annotated[_ID, Meta(description="Prefix of every Redis key the gateway writes.")] = "switchyard"
    timeout_s: Annotated[Positive, Meta(description="Connect and socket timeout of every Redis call, in seconds. A deadline that passed while the gateway's own loop was held (a timer more than 50 ms late: the answer may be waiting unread) gives the call the same time again, once.")] = 0.25
    failure_policy: Annotated[Literal["open", "closed"], Meta(description="While Redis is unreachable: open serves without limits, closed answers 503.")] = "open"
    max_connections: Annotated[int, Meta(ge=1, le=10000, description="Most Redis calls each of a worker's Redis clients (tenancy, Responses records, the routing view's writer and reader) runs at once, and so most connections it holds (to each node of a Cluster). A call that finds them all busy waits for one, up to timeout_s, then fails as a call to an unreachable Redis does on its path, without marking Redis down; counted in switchyard_state_pool_timeouts_total.")] = 32
    sync_interval_s: Annotated[Positive, Meta(description="How often a replica publishes its heartbeat and in-flight counts and refreshes the key directory, in seconds (with Redis, directory changes reach every replica at once by their notices; this refresh is the backstop).")] = 0.1
    replica_ttl_s: Annotated[Positive, Meta(description="A replica silent this long no longer counts, in seconds (at least twice sync_interval_s).")] = 1.0
    share_in_flight: Annotated[bool, Meta(description="Publish and read per-endpoint in-flight counts, so the load-based strategies see the whole fleet's load.")] = True
    replica_id: Annotated[_ID | None, Meta(description="This replica's name in Redis; null: host, process id and a random suffix. With --workers N each worker is a replica named this and its index, <id>/<index>.")] = None

    def __post_init__(self) -> None:
        url = self.redis_url
        target = None
        if url is not None:
            try:
                target = parse_redis_url(url)
            except ValueError as e:
                raise ValueError(f"redis_url: {e}") from None
        if self.replica_ttl_s < 2 * self.sync_interval_s:
            raise ValueError("replica_ttl_s: must be at least twice state.sync_interval_s")
        if self.tls_ca_file is not None and not (target and target.tls):
            raise ValueError("tls_ca_file: needs a rediss://, rediss+sentinel:// or rediss+cluster:// state.redis_url")
        if self.tls_ca_file is not None:
            _check_ca_file(self.tls_ca_file, "tls_ca_file")
        force_setattr(self, "password", _from_env(self.password, self.password_env, "password"))
        force_setattr(self, "sentinel_password", _from_env(self.sentinel_password, self.sentinel_password_env,
                                                           "sentinel_password"))
        if self.sentinel_password is not None and not (target and target.mode == "sentinel"):
            raise ValueError("sentinel_password: needs a redis+sentinel:// or rediss+sentinel:// state.redis_url")


def _check_ca_file(path: str, key: str) -> None:
    """``path`` holds a CA certificate TLS can verify a server with, as the connection will read
    it (a wrong path otherwise shows only when a connection fails, as a server that is down)."""
    try:
        ssl.create_default_context(cafile=path)
    except OSError as e:
        if not isinstance(e, ssl.SSLError):
            raise ValueError(f"{key}: cannot read {path!r}: {e.strerror or e}") from None
        raise ValueError(f"{key}: no CA certificate in {path!r} (a PEM file of BEGIN CERTIFICATE blocks): "
                         f"{e.reason or e}") from None


class StatusConfig(Block):
    """``GET /status`` (the live page) and ``GET /status.json`` (what it reads); gateway/observability/status.py."""

    enabled: Annotated[bool, Meta(description="Serve the status page (GET /status) and its data (GET /status.json).")] = True
    refresh_s: Annotated[float, Meta(ge=0.5, le=60, description="How often the page polls /status.json, in seconds.")] = 2.0
    bucket_s: Annotated[float, Meta(ge=1, le=600, description="Resolution of the traffic history, in seconds.")] = 10.0
    window_s: Annotated[float, Meta(ge=60, le=3600, description="Traffic history kept per model (rate, TTFT percentiles), in seconds; at most 360 buckets.")] = 300.0
    recent_decisions: Annotated[int, Meta(ge=0, le=1000, description="Routing decisions kept for the page.")] = 50
    recent_errors: Annotated[int, Meta(ge=0, le=1000, description="Failed requests kept for the page.")] = 50
    max_users: Annotated[int, Meta(ge=0, le=10000, description="Most tenants listed on the page.")] = 100

    def __post_init__(self) -> None:
        if self.window_s / self.bucket_s > 360:
            raise ValueError("window_s: at most 360 buckets of status.bucket_s")

    @property
    def slots(self) -> int:
        return max(1, round(self.window_s / self.bucket_s))


class Config(Block, dict=True):
    listen: Annotated[ListenConfig, Meta(description="Where the gateway accepts client connections.")] = ListenConfig()
    server: Annotated[ServerConfig, Meta(description="The client-facing HTTP server: processes, shutdown, logging, slow-client timeouts and limits.")] = ServerConfig()
    routing: Annotated[RoutingConfig, Meta(description="The default routing strategy and the built-in strategies' settings.")] = RoutingConfig()
    upstream: Annotated[UpstreamConfig, Meta(description="Connections from the gateway to the engines.")] = UpstreamConfig()
    health: Annotated[HealthConfig, Meta(description="Active health probes of every endpoint.")] = HealthConfig()
    scrape: Annotated[ScrapeConfig, Meta(description="Reading every endpoint's Prometheus metrics: the load signals of strategies and admission control.")] = ScrapeConfig()
    watchdog: Annotated[WatchdogConfig, Meta(description="Timeouts that end a stalled generation instead of leaving the client waiting; a model may lay its own keys over these.")] = WatchdogConfig()
    pd: Annotated[PDConfig, Meta(description="Prefill/decode disaggregation: the pair choice, the prefill leg, when to disaggregate, engine settings; a model may lay its own keys over these.")] = PDConfig()
    breaker: Annotated[BreakerConfig, Meta(description="Circuit breakers per endpoint: failing endpoints leave routing for a while; a model may lay its own keys over these.")] = BreakerConfig()
    retry: Annotated[RetryConfig, Meta(description="Retries on another endpoint before the first byte reached the client, within a budget; a model may lay its own keys over these.")] = RetryConfig()
    models: Annotated[tuple[ModelConfig, ...], Meta(description="The models clients may name, and their engines.")] = ()
    aliases: Annotated[tuple[AliasConfig, ...], Meta(description="Names that split traffic over models by weight (canaries, A/B tests).")] = ()
    kubernetes: Annotated[KubernetesConfig, Meta(description="Discovery of engine pods through the Kubernetes API.")] = KubernetesConfig()
    auth: Annotated[AuthConfig, Meta(description="Client API keys and the admin token.")] = AuthConfig()
    limits: Annotated[LimitsConfig, Meta(description="Per-user and per-model rate limits.")] = LimitsConfig()
    state: Annotated[StateConfig, Meta(description="State shared by gateway replicas and workers, in Redis.")] = StateConfig()
    view: Annotated[ViewConfig, Meta(description="The routing view (prefix index, in-flight counts, sessions) shared by the workers of a gateway and, with state.redis_url, by its replicas.")] = ViewConfig()
    status: Annotated[StatusConfig, Meta(description="The live status page.")] = StatusConfig()
    tracing: Annotated[TracingConfig, Meta(description="OpenTelemetry tracing; OTEL_* environment variables fill keys left out.")] = TracingConfig()
    responses: Annotated[ResponsesConfig, Meta(description="Where the state of the Responses API (/v1/responses) lives.")] = ResponsesConfig()
    lora: Annotated[LoraConfig, Meta(description="LoRA adapters: discovery, routing of adapter requests, loading and unloading on demand.")] = LoraConfig()
    admission: Annotated[AdmissionConfig, Meta(description="Admission control: queue or shed requests by priority class while every endpoint is saturated; a model may lay its own keys over these.")] = AdmissionConfig()
    batch: Annotated[BatchConfig, Meta(description="OpenAI's Files and Batches API (/v1/files, /v1/batches): batches run as the lowest priority class on idle engine capacity, and resume after a restart.")] = BatchConfig()

    def __post_init__(self) -> None:
        for key, name in self._model_names():
            if why := _unmatched_name(name):
                raise ValueError(f"{key}: {why}")
        seen: set[str] = set()
        for i, m in enumerate(self.models):
            if not (m.endpoints or m.rolesets or self.kubernetes.enabled):
                raise ValueError(f"models[{i}]: model {m.name!r} needs 'endpoints' or 'rolesets' (or kubernetes.enabled: true)")
            if m.name in seen:
                raise ValueError(f"models[{i}].name: duplicate model name {m.name!r}")
            seen.add(m.name)
        if self.responses.backend == "redis" and self.state.redis_url is None:
            raise ValueError("responses.backend: redis needs state.redis_url")
        check_aliases(self.aliases, [m.name for m in self.models], self.kubernetes.enabled,
                      {a: (i, m.name) for i, m in enumerate(self.models) for a in m.adapters})
        check_adapters([(m.name, m.adapters) for m in self.models])
        for path, a in [("admission", self.admission)] + [(f"models[{i}].admission", m.admission)
                                                          for i, m in enumerate(self.models) if m.admission]:
            if a.enabled and not self.scrape.enabled and not a.max_in_flight_per_endpoint:
                raise ValueError(f"{path}.enabled: needs scrape.enabled (the engines' queue and KV usage) "
                                 "or max_in_flight_per_endpoint: there is nothing to tell saturation by")

    def _model_names(self) -> Iterator[tuple[str, str]]:
        """Each model name the config writes, with its key; a mapping's key by the mapping's
        (``models[0].adapters``), since the name is what is wrong with it. (Checked here, not by
        ``UserLimits``, which a user's record the admin API stored is read into too.)"""
        for i, m in enumerate(self.models):
            yield f"models[{i}].name", m.name
            yield from ((f"models[{i}].adapters", a) for a in m.adapters)
        for i, a in enumerate(self.aliases):
            yield f"aliases[{i}].name", a.name
            yield from ((f"aliases[{i}].targets[{j}].model", t.model) for j, t in enumerate(a.targets))
        users = [(f"limits.users.{u}", lim) for u, lim in self.limits.users.items()]
        for key, lim in [*users, ("limits.default_user", self.limits.default_user)]:
            yield from ((f"{key}.models[{k}]", name) for k, name in enumerate(getattr(lim, "models", None) or ()))
        yield from (("limits.models", name) for name in self.limits.models)
        yield from (("kubernetes.models", name) for name in self.kubernetes.models)

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

    def with_workers(self, n: int) -> Config:
        """The worker count ``python -m gateway`` resolved (``auto``, ``--workers``) and runs."""
        return msgspec.structs.replace(self, server=msgspec.structs.replace(self.server, workers=n))


# -- loading ------------------------------------------------------------------------------------


def load_config(path: str | Path, deprecations: list[Deprecation] | None = None) -> Config:
    """The config in the YAML file ``path``; ``deprecations``: see ``config_from_dict``.

    A file is what a gateway starts or reloads from, so one that declares no model (with
    Kubernetes discovery off) is refused: it is an empty ConfigMap key or a ``models:`` block lost
    in an edit, and would start a gateway that answers every request 404, or, at a reload, remove
    every endpoint of a running one. (A config built in code may still have none.)"""
    return config_from_file(read_config_file(path), path, deprecations)


MAX_CONFIG_BYTES = 4 * 1024 * 1024
"""The largest config file read: YAML parsing takes seconds a megabyte, at a start, and at a reload
in the --workers parent and in every worker (in a thread there, so that the loop goes on serving,
but on a CPU the requests share). Thousands of models and keys fit in a fraction of it."""


SETTLE_LIMIT_S = 10.0
"""How long a reload waits at most for a config file that keeps changing (or three times
``server.reload_settle_s``, when that is longer); then it is refused."""


def file_stamp(path: str | Path) -> tuple[int, ...] | None:
    """What a write to the file changes: its identity, size and times. None for no regular file (a
    FIFO, a path that cannot be read): read as it is, its errors said by the read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class Settling:
    """A reload's wait for its config file to be whole: read once it has been left unchanged for
    ``settle_s`` (its modification time that old, or unchanged across a wait that long, for a time
    set ahead of the clock), and again if it changed while it was read. A file written in place in
    steps (truncated, then written) was read between them: its first half, valid YAML (a list of
    endpoints cut short), was applied. ``deferred`` is called once, at the first wait."""

    def __init__(self, path: str | Path, settle_s: float, deferred: Callable[[], None] | None = None,
                 limit_s: float = SETTLE_LIMIT_S) -> None:
        self.path = path
        self.settle_s = settle_s
        self.limit_s = max(limit_s, 3 * settle_s)
        self.deferred = deferred
        self.started = time.monotonic()
        self.waited = False
        self._seen: tuple[int, ...] | None = None       # the stamp the last wait began with
        self._read: tuple[int, ...] | None = None       # the stamp before the read

    def wait_s(self) -> float:
        """0: read the file now (then ask ``changed``); else how long to wait before asking again."""
        self._read = stamp = file_stamp(self.path) if self.settle_s > 0 else None
        if stamp is None:
            return 0.0
        age = time.time() - stamp[3] / 1e9
        if age >= self.settle_s or stamp == self._seen:
            return 0.0
        self._seen = stamp
        return self._defer(self.settle_s - age if age >= 0 else self.settle_s)

    def changed(self) -> bool:
        """Whether the file changed while it was read: then ``wait_s`` again."""
        if self._read is None or file_stamp(self.path) == self._read:
            return False
        self._seen = None
        self._defer(0.0)
        return True

    def _defer(self, wait: float) -> float:
        if time.monotonic() - self.started + wait > self.limit_s:
            raise ConfigError("<file>", f"still being written: it changed within {self.settle_s:g} s again and "
                                        f"again for {self.limit_s:g} s, not read", str(self.path))
        if not self.waited:
            self.waited = True
            if self.deferred is not None:
                self.deferred()
        return wait


T = TypeVar("T")


def settle_window_s(settle_s: float) -> float:
    """How long ``Settling`` waits at most for a file that keeps changing (0 when it does not wait)."""
    return max(SETTLE_LIMIT_S, 3 * settle_s) if settle_s > 0 else 0.0


def read_settled(path: str | Path, settle_s: float, read: Callable[[], T], stopped: Callable[[], bool] | None = None,
                 deferred: Callable[[], None] | None = None) -> T:
    """What ``read`` reads of the file ``path`` (its text, or its config), read once the file is
    whole (``Settling``), waiting in this thread: every reload that reads the file (the --workers
    parent's, in its reload's thread; one process's, in a thread of the loop's). ``stopped`` ends
    a wait with ``ReadStopped`` (``read`` asks it in its own waits, ``read_config_file``'s)."""
    settling = Settling(path, settle_s, deferred)
    while True:
        wait = settling.wait_s()
        end = time.monotonic() + wait
        while wait > 0 and (left := end - time.monotonic()) > 0:
            if stopped is not None and stopped():
                raise ReadStopped("<file>", "not read: the gateway was stopped while it waited for the file "
                                            "to be left unchanged", str(path))
            time.sleep(min(left, 0.05))
        if wait > 0:
            continue
        try:
            value = read()
        except ReadStopped:
            raise
        except ConfigError:
            if settling.changed():      # read while it was written (cut inside a character, say)
                continue
            raise
        if not settling.changed():
            return value


class ReadStopped(ConfigError):
    """The gateway was stopped while ``read_config_file`` waited for the file's text."""


_unreturned: list[threading.Thread] = []     # reads ``read_within`` gave up on that have not returned yet
UNRETURNED_WAIT_S = 0.2     # how long a read given up on is waited for: one waiting for a FIFO's text ends within 0.1 s


def read_within(read: Callable[[Callable[[], bool]], T], limit_s: float, path: str | Path) -> T:
    """``read(given_up)`` in a thread of its own, waited for ``limit_s`` at most (0: for as long as
    it takes); then a ``ConfigError`` naming the file. A file on a hung mount (NFS, a FUSE daemon
    that stopped answering) blocks its stat, open or read in the kernel, where nothing ends it: the
    reload waited for it for good, and the reloads after it behind it. ``given_up()`` turns true
    then, and a read that asks it in its waits (a FIFO's, ``read_config_file``'s ``stopped``) ends;
    one blocked in the kernel is left to itself, and while it has not returned a read is refused
    at once (another would block the same way, a thread each)."""
    if limit_s <= 0:
        return read(lambda: False)
    _unreturned[:] = [t for t in _unreturned if t.is_alive()]
    if _unreturned:
        raise ConfigError("<file>", "not read: an earlier read of the file has not returned yet (a hung mount?)",
                          str(path))
    given_up = threading.Event()
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, read(given_up.is_set)))
        except BaseException as e:       # raised in the caller's thread
            outcome.append((False, e))

    reader = threading.Thread(target=run, name="config-read", daemon=True)
    reader.start()
    reader.join(limit_s)
    if reader.is_alive():
        given_up.set()
        reader.join(UNRETURNED_WAIT_S)
        if reader.is_alive():
            _unreturned.append(reader)
        # a read that ended once given up on says why, unless it only says it was given up on
        if reader.is_alive() or isinstance(outcome[0][1], ReadStopped):
            raise ConfigError("<file>", f"not read: the read did not return within {limit_s:g} s "
                                        "(server.reload_read_timeout_s; a hung mount?)", str(path))
    ok, value = outcome[0]
    if ok:
        return value
    raise value


def read_config_file(path: str | Path, stopped: Callable[[], bool] | None = None, wait_s: float | None = None) -> str:
    """The text of the config file ``path`` (a ``ConfigError`` naming it when it cannot be read,
    is not UTF-8, or is larger than ``MAX_CONFIG_BYTES``), its line ends read as ``\n``.

    A path that is no regular file (a FIFO, a terminal, ``/dev/stdin``) is read as its text comes,
    for as long as it takes; ``stopped``, asked while it waits, ends the wait with ``ReadStopped``
    once it says the gateway is stopping (a start holds its stops back, and the --workers parent's
    reload runs in a signal handler: neither could end a read that never returns); ``wait_s``
    bounds how long it waits for more text (a reload of one process, whose read holds its next reload)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)    # a FIFO's open waits for no writer
    except OSError as e:
        raise ConfigError("<file>", f"cannot read: {e.strerror}", str(path)) from None
    try:
        data = _read_all(fd, str(path), stopped, wait_s)
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError("<file>", f"not UTF-8 text: {e.reason} at byte {e.start}", str(path)) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")      # as a text-mode read gives it


def _read_all(fd: int, path: str, stopped: Callable[[], bool] | None, wait_s: float | None) -> bytes:
    try:
        waits = not stat.S_ISREG(os.fstat(fd).st_mode)
        if not waits:
            os.set_blocking(fd, True)
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        chunks: list[bytes] = []
        size = 0
        since = time.monotonic()        # the last text that came
        while True:
            # a FIFO no writer opened yet is not ready (its read would say end of file)
            if waits and not poll.poll(100 if stopped is not None or wait_s is not None else None):
                # the bound first: a read given up on past it (``read_within``) says why
                if wait_s is not None and time.monotonic() - since > wait_s:
                    raise ConfigError("<file>", f"not read: no text came in {wait_s:g} s (a FIFO no one "
                                                "writes?)", path)
                if stopped is not None and stopped():
                    raise ReadStopped("<file>", "not read: the gateway was stopped while it waited for "
                                                "the file's text", path)
                continue
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
            since = time.monotonic()
            if size > MAX_CONFIG_BYTES:
                raise ConfigError("<file>", f"larger than {MAX_CONFIG_BYTES >> 20} MiB, not read "
                                            "(a config is kilobytes)", path)
    except OSError as e:
        raise ConfigError("<file>", f"cannot read: {e.strerror}", path) from None


def config_from_file(text: str, path: str | Path, deprecations: list[Deprecation] | None = None) -> Config:
    """The config in ``text``, read from the file ``path``: as ``load_config`` checks a file's."""
    try:
        config = parse_config(text, source=str(path), deprecations=deprecations)
    except ConfigError as e:
        raise located(e, text, str(path)) from None
    if not config.models and not config.kubernetes.enabled:
        raise located(ConfigError("models", "no model is declared, and kubernetes.enabled is false: the gateway "
                                             "would answer every request 404 (declare models, or discover them "
                                             "with kubernetes.enabled: true)"), text, str(path))
    return config


NESTING_LIMIT = 64
"""How deep a config's mappings and lists may nest: YAML's parser takes a thousand levels, which
the walks of a config (one Python call a level) cannot follow."""
ALIAS_EXPANSION_LIMIT = 1_000_000
"""How many values YAML aliases may add to a config beyond the ones its text writes out: far more
than reusing a block of endpoints or settings adds, far fewer than a walk of the config takes
seconds over."""


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """YAML's safe loader, refusing a key written twice in one mapping (YAML would keep the last
    silently: a second ``server:`` block would drop the first)."""


def no_effect(config: Config) -> list[str]:
    """What a config that loads declares and the gateway will not do: warnings, not errors, since
    the gateway runs with it (printed by ``--check-config``, logged at start). Each names its key.

    - ``limits.models.<name>`` naming no model: the limit is looked up by the model a request is
      routed to, so an alias's or an adapter's requests count under their model's name, and a
      name that is none limits nothing. (With Kubernetes discovery the pods may bring it.)
    - a name in ``limits.users.<name>.models`` (or ``limits.default_user.models``) that is no
      model, alias or LoRA adapter: the list is checked against the name a request gives, so that
      name allows no request."""
    out: list[str] = []
    if config.kubernetes.enabled:
        return out
    models = {m.name for m in config.models}
    aliases = {a.name for a in config.aliases}
    adapters = {a: m.name for m in config.models for a in m.adapters}
    lists = [(f"limits.users.{u}.models", lim.models) for u, lim in config.limits.users.items()]
    if config.limits.default_user is not None:
        lists.append(("limits.default_user.models", config.limits.default_user.models))
    for key, allowed in lists:
        for name in allowed or ():
            if name not in models and name not in aliases and name not in adapters:
                out.append(f"{key}: {name!r} names no model, alias or LoRA adapter: it allows no request")
    for name in config.limits.models:
        if name in models:
            continue
        if name in aliases:
            why = " (an alias, whose requests are limited by their models' names)"
        elif name in adapters:
            why = f" (a LoRA adapter of model {adapters[name]!r}, whose requests are limited by that model's name)"
        else:
            why = ""
        out.append(f"limits.models.{name}: names no model{why}: this limit applies to no request")
    return out


def log_no_effect(config: Config, source: str | None = None) -> None:
    """``no_effect``'s warnings in the log, as a start and an applied reload give them."""
    for note in no_effect(config):
        structlog.get_logger("switchyard").warning(f"config: {note}", file=source)


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> Iterator[dict]:
    # a generator, as YAML's own mapping constructor is: the mapping is handed out first and filled
    # in after, so mappings nested however deep are built one after another, never by recursion
    data: dict = {}
    yield data
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node)
        try:
            first = seen.get(key)
        except TypeError:            # an unhashable key: the constructor says so below
            continue
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"found the key {key!r} a second time (first at {_at(first.start_mark)})",
                key_node.start_mark)
        seen[key] = key_node
    data.update(loader.construct_mapping(node))


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _at(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _yaml_problem(e: yaml.YAMLError, text: str) -> str:
    """PyYAML's error on one line, where in the file first: ``line 2, column 1: found character
    that cannot start any token (a tab: YAML indents with spaces)``. PyYAML's own spreads over
    lines and calls the file "<unicode string>"."""
    if not isinstance(e, yaml.MarkedYAMLError) or e.problem_mark is None:
        return " ".join(str(e).split())
    mark = e.problem_mark
    out = f"{_at(mark)}: {e.problem}"
    if e.context and e.context_mark is not None and _at(e.context_mark) != _at(mark):
        out += f" ({e.context} at {_at(e.context_mark)})"
    lines = text.split("\n")
    if mark.line < len(lines) and lines[mark.line][mark.column:mark.column + 1] == "\t":
        out += " (a tab: YAML indents with spaces)"
    return " ".join(out.split())


def parse_config(text: str, source: str | None = None, deprecations: list[Deprecation] | None = None) -> Config:
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)     # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError("<yaml>", f"invalid YAML, {_yaml_problem(e, text)}", source) from None
    return config_from_dict(raw, source, deprecations)


def located(e: ConfigError, text: str, source: str) -> ConfigError:
    """``e`` of the file ``source`` whose text is ``text`` (a start's, a reload's, --check-config's),
    named where in the file its key path
    leads, as a compiler names a line: ``gw.yaml:12:5: models[0].engine: ...``. The key path's last
    key written in the file (a key, or an item of a list), the nearest one written when the path
    goes on past it (a key that is missing, a URL string read as an endpoint's ``url``); the file
    alone when the path names nothing in it. The text is composed again for it: an error's cost,
    never a valid config's."""
    mark = None
    if not e.key_path.startswith("<"):
        try:
            root = yaml.compose(text, Loader=_UniqueKeyLoader)     # noqa: S506 (a SafeLoader; nodes, no objects)
        except yaml.YAMLError:
            root = None
        mark = _mark_of(root, e.key_path, e.entry)
    where = source if mark is None else f"{source}:{mark.line + 1}:{mark.column + 1}"
    return ConfigError(e.key_path, e.message, where, e.entry)


_INDEX = re.compile(r"\[(\d+)\]")


def _mark_of(node: yaml.Node | None, path: str, entry: str | None = None) -> Any:
    """Where in the text the nodes ``node`` heads lead along ``path`` (``models[0].adapters``; a
    mapping's key may hold dots, ``limits.users.org.team``): the last key or list item on the way;
    with ``entry``, that key of the mapping the whole path leads to."""
    mark = None
    while path and node is not None:
        if (m := _INDEX.match(path)) is not None:
            if not isinstance(node, yaml.SequenceNode) or int(m[1]) >= len(node.value):
                break
            node = node.value[int(m[1])]
            mark, path = node.start_mark, path[m.end():]
        elif isinstance(node, yaml.MappingNode):
            step = path.removeprefix(".")
            found = max(((k, v) for k, v in _pairs(node) if isinstance(k.value, str) and (
                step == k.value or step.startswith((f"{k.value}.", f"{k.value}[")))),
                key=lambda kv: len(kv[0].value), default=None)
            if found is None:
                break
            mark, node, path = found[0].start_mark, found[1], step[len(found[0].value):]
        else:
            break
    if entry is not None and not path and isinstance(node, yaml.MappingNode):
        mark = next((k.start_mark for k, _ in _pairs(node) if k.value == entry), mark)
    return mark


def _pairs(node: yaml.MappingNode, seen: set[int] | None = None) -> list[tuple[yaml.Node, yaml.Node]]:
    """A mapping's keys and values, those a merge key (``<<: *base``) brings after its own (each
    mapping once: an anchor merged into itself loads as a mapping without end)."""
    seen = seen if seen is not None else {id(node)}
    own = [(k, v) for k, v in node.value if k.tag != "tag:yaml.org,2002:merge"]
    for k, v in node.value:
        if k.tag == "tag:yaml.org,2002:merge":
            for m in (v.value if isinstance(v, yaml.SequenceNode) else [v]):
                if isinstance(m, yaml.MappingNode) and id(m) not in seen:
                    seen.add(id(m))
                    own += _pairs(m, seen)
    return own


def config_from_dict(raw: Any, source: str | None = None, deprecations: list[Deprecation] | None = None) -> Config:
    """Shape the raw data, then convert it: nulls dropped, the older flat P/D engine keys moved into
    their block, a model's ``watchdog:`` / ``pd:`` laid over the global one, endpoint URL strings
    made ``{url, engine}`` (the model's engine), rolesets named ``rs-<i>`` by default.

    Old names still accepted (gateway/config/deprecated.py) are logged as warnings once the config
    is loaded, or, with a ``deprecations`` list, added to it for the caller to report."""
    if not isinstance(raw, dict | None):
        raise ConfigError("<root>", f"must be a mapping, got {type(raw).__name__}", source)
    if (path := self_reference(raw)) is not None:
        raise ConfigError(path, "contains itself (a YAML anchor used inside its own node, as in `a: &x [*x]`): "
                                "a structure without end", source)
    if (path := nested_beyond(raw, NESTING_LIMIT)) is not None:
        raise ConfigError(path, f"nested more than {NESTING_LIMIT} deep (a config goes a handful of levels)", source)
    if (big := alias_expansion(raw, ALIAS_EXPANSION_LIMIT)) is not None:
        raise ConfigError(big[0], f"YAML aliases expand the config to {big[1]:,} values, more than "
                                  f"{ALIAS_EXPANSION_LIMIT:,} beyond those the file writes out (anchors naming "
                                  "anchors, each repeated: an alias bomb)", source)
    if (bad := non_finite(raw)) is not None:
        raise ConfigError(bad[0], f"must be a finite number, got {_yaml_number(bad[1])} (0 turns most limits and "
                                  "timeouts off; each key says so)", source)
    data = without_nulls(raw or {})
    notes = deprecations if deprecations is not None else []
    if isinstance(data.get("upstream"), dict) and RETRY_FLAG in data["upstream"]:
        notes.append(Deprecation(f"upstream.{RETRY_FLAG}", "retry.enabled"))
    try:
        data["pd"] = _nest_engine_keys(data.get("pd", {}), "pd", notes)
        for key, cls in (("watchdog", WatchdogConfig), ("pd", PDConfig), ("breaker", BreakerConfig),
                         ("retry", RetryConfig), ("admission", AdmissionConfig)):
            if isinstance(data.get(key), dict):   # a global block's bad key is reported where it is written
                convert(data[key], cls, key)
        for i, m in enumerate(data["models"] if isinstance(data.get("models"), list) else ()):
            if isinstance(m, dict):
                _shape_model(m, f"models[{i}]", data, notes)
        config = convert(data, Config)
    except StrictError as e:
        raise ConfigError(e.path, e.message, source) from None
    for user in config.limits.users:       # here, not in Config's checks, to name the entry at fault
        if why := _unmatched_user(user):
            raise ConfigError("limits.users", why, source, entry=user)
    check_strategies(config, source=source)
    if deprecations is None:
        log_deprecations(notes, source)
    return config


def _yaml_number(x: float) -> str:
    return ".nan" if x != x else ".inf" if x > 0 else "-.inf"


def check_strategies(config: Config, registry: RouterRegistry | None = None, source: str | None = None) -> None:
    """Every strategy the config names exists: ``routing.strategy``, ``lora.strategy`` and each
    model's ``strategy`` and ``lock_strategy``; and that a model with only prefill/decode
    endpoints (no Kubernetes discovery to find others) is not given one that routes whole
    requests. The one check the loader, the routing of a new generation and a reload all run;
    ``ConfigError`` names the key and suggests a near name.
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
            raise ConfigError(path, f"{e}{strategy_suggestion(spec, registry)}", source) from None
    if config.kubernetes.enabled:          # pods found later may serve whole requests
        return
    for i, m in enumerate(config.models):
        if not m.rolesets or m.endpoints or any(rs.combined for rs in m.rolesets):
            continue
        key = "lock_strategy" if m.lock_strategy else "strategy"
        spec = getattr(m, key)
        if spec and not registry.get(spec).chooses_pairs:
            raise ConfigError(f"models[{i}].{key}", f"{spec!r} routes whole requests, and model {m.name!r} has only "
                              "prefill/decode endpoints (every request would be refused 503): use pd, or leave the "
                              "key out", source)


def strategy_suggestion(spec: str, registry: RouterRegistry) -> str:
    """`` (did you mean 'least-request'?)`` for the first unknown name of ``spec`` close to a known one."""
    for item in spec.split(","):
        name = item.split(":")[0].strip().lower()
        if name and name not in registry:
            return did_you_mean(name, registry.names())
    return ""


def _shape_model(m: dict, path: str, data: dict, notes: list[Deprecation]) -> None:
    if "pd" in m:
        m["pd"] = _nest_engine_keys(m["pd"], f"{path}.pd", notes)
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


def _nest_engine_keys(block: Any, path: str, notes: list[Deprecation]) -> Any:
    for key, engine in MOVED_PD_KEYS.items() if isinstance(block, dict) else ():
        sub = block.get(engine, {})
        if key in block and isinstance(sub, dict):
            if key in sub:
                raise StrictError(f"{path}.{key}", f"also given as {path}.{engine}.{key}; keep one")
            notes.append(Deprecation(f"{path}.{key}", f"{path}.{engine}.{key}"))
            block = {**block, engine: {**sub, key: block[key]}}
            del block[key]
    return block
