"""OpenTelemetry tracing: one trace per request, joined to the engines' own spans.

A traced request gives one tree (span kinds in brackets)::

    POST /v1/chat/completions [SERVER]   gen_ai.* (model, tokens, TTFT, finish), user, status
    ├── route [INTERNAL]                 strategy, candidates, endpoint(s), fallbacks, prefix match
    ├── prefill [CLIENT]                 P/D only   → the prefill engine's llm_request [SERVER]
    └── decode | generate [CLIENT]       one per attempt (a retry is a second span)
                                                    → the engine's llm_request [SERVER]

with events on the request span: ``first_token``, ``watchdog``, ``abort``, ``retry``, ``migration``. The W3C
``traceparent``/``tracestate`` of the client are continued when present; every engine leg carries
the ``traceparent`` of its own CLIENT span, so an engine that traces (vLLM
``--otlp-traces-endpoint``) hangs its span under the right leg.

A batch line, run in-process, gets a span of its own (``Tracing.lines``). The pipeline, the P/D orchestrator and the relay call a small API on ``ctx.trace`` (``Trace``):
``route_start``/``routed``, ``leg`` (a ``Leg`` with ``inject``/``responded``/``failed``, or a
``with`` block), ``event``, ``finish``. With tracing off (or on an excluded path) ``ctx.trace``
is ``NO_TRACE``, whose methods do nothing, and no middleware or provider exists: the disabled
path costs a few no-op method calls per request.

Spans go through the SDK's batch processor (a queue and one exporter thread; a full queue drops
spans, never blocks a request) to an OTLP exporter: HTTP/protobuf by default, gRPC with the
``grpc`` extra. Export failures are counted (``switchyard_trace_export_failures_total``) as well as
logged by the SDK (each kind of its lines the first time, then at most once a minute: ``SeldomLines``; over HTTP, the gateway names the endpoint and the cause of one that got no
answer, at most once a minute: ``CountingExporter``), and so are the spans a full queue drops (``switchyard_trace_spans_total``). The
provider belongs to the app (no global tracer provider) and is shut down, flushing what is queued,
when the app stops.

Settings: the ``tracing:`` block (``TracingConfig``), and the standard ``OTEL_*`` variables for
every key the block leaves unset (``resolve``): a key written in the file wins over the
environment, the environment over the built-in default.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import re
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol

from aiohttp import web
from msgspec import Meta
from opentelemetry import trace as otel
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.config.block import Block
from gateway.errors import ErrorClass

if TYPE_CHECKING:
    from gateway.endpoints import Endpoint
    from gateway.observability.metrics import GatewayMetrics
    from routers.base import Decision

_log = logging.getLogger("switchyard.tracing")

OTLPProtocol = Literal["http/protobuf", "grpc"]
_Ratio = Annotated[float, Meta(ge=0.0, le=1.0)]
_Seconds = Annotated[float, Meta(gt=0.0)]
_HOST_PORT = re.compile(r"\A[A-Za-z0-9.\-]+:\d{1,5}\Z|\A\[[0-9A-Fa-f:.]+\]:\d{1,5}\Z")

DEFAULT_EXCLUDED = ("/health", "/ready", "/metrics", "/status", "/status.json")   # probes, scrapes, the status page
DEFAULT_HTTP_ENDPOINT = "http://localhost:4318/v1/traces"
DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"
TRACES_PATH = "/v1/traces"
# longest string attribute kept (longer ones are cut): a client's own values (its "user") must not
# make a span, and the batch that carries it, too large to export (the exporter drops a whole batch
# over 64 MB); OTEL_(SPAN_)ATTRIBUTE_VALUE_LENGTH_LIMIT set in the environment wins
MAX_ATTRIBUTE_LENGTH = 4096
DEFAULT_EXPORT_TIMEOUT_S = 10.0     # the OTLP exporters' own default (OTEL_EXPORTER_OTLP_TRACES_TIMEOUT)

# the W3C headers a leg's own context replaces (the client's pass through untouched when tracing is off)
_TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
# OpenTelemetry's GenAI conventions: a well-known gen_ai.operation.name that applies MUST be used; the
# Messages and Responses APIs are chat completion operations ("chat"), as the Chat Completions API is,
# and vLLM's Cohere-style embed API an embeddings operation, as OpenAI's is
_OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion",
               "/v1/embeddings": "embeddings", "/v2/embed": "embeddings", "/v1/messages": "chat",
               "/v1/responses": "chat"}


class TracingConfig(Block):
    """The ``tracing:`` block. ``None`` (or a key left out) means: the ``OTEL_*`` variable if set,
    else the default (see ``resolve``)."""

    enabled: Annotated[bool | None, Meta(description="Export traces; null: on when an OTLP endpoint is given here or in OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, unless OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none.")] = None
    endpoint: Annotated[str | None, Meta(description="OTLP collector: an http(s):// URL or host:port (plain text, as http://; over HTTP /v1/traces is added when it has no path); null: OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, else localhost:4318 (http) or localhost:4317 (grpc).")] = None
    protocol: Annotated[OTLPProtocol | None, Meta(description="OTLP protocol: http/protobuf or grpc (needs the grpc extra); null: OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL, else http/protobuf.")] = None
    sample_ratio: Annotated[_Ratio | None, Meta(description="Share of new traces recorded, 0..1; null: OTEL_TRACES_SAMPLER(_ARG), else 1.")] = None
    parent_based: Annotated[bool | None, Meta(description="A client's sampled flag (traceparent) decides for its request; null: OTEL_TRACES_SAMPLER, else true.")] = None
    service_name: Annotated[Annotated[str, Meta(min_length=1)] | None, Meta(description="service.name of the spans; null: OTEL_SERVICE_NAME, else switchyard.")] = None
    exclude_paths: Annotated[tuple[str, ...], Meta(description="Paths that get no span; an entry ending in * is a prefix.")] = DEFAULT_EXCLUDED
    export_timeout_s: Annotated[_Seconds | None, Meta(description="Longest export call, in seconds; null: OTEL_EXPORTER_OTLP_TRACES_TIMEOUT, else 10.")] = None
    batch_delay_s: Annotated[_Seconds | None, Meta(description="Delay between two batch exports, in seconds; null: OTEL_BSP_SCHEDULE_DELAY, else 5.")] = None
    max_queue_size: Annotated[Annotated[int, Meta(ge=1)] | None, Meta(description="Spans waiting for export at most; null: OTEL_BSP_MAX_QUEUE_SIZE, else 2048.")] = None

    def __post_init__(self) -> None:
        if self.endpoint is not None:
            _check_endpoint(self.endpoint, "endpoint")
        for i, p in enumerate(self.exclude_paths):
            if not p.startswith("/"):
                raise ValueError(f"exclude_paths[{i}]: must start with /, got {p!r}")


def _check_endpoint(value: str, where: str) -> None:
    if value.startswith(("http://", "https://")):
        rest = value.split("://", 1)[1]
        if rest and not rest.startswith("/"):
            return
    elif _HOST_PORT.match(value):
        return
    raise ValueError(f"{where}: must be an http(s):// URL or host:port, got {value!r}")


@dataclass(frozen=True)
class TracingSettings:
    """The block resolved against the environment: every value concrete."""

    enabled: bool
    endpoint: str
    protocol: str
    sample_ratio: float
    parent_based: bool
    service_name: str
    exclude_paths: tuple[str, ...]
    export_timeout_s: float | None      # None: the exporter's own (OTEL_EXPORTER_OTLP_TRACES_TIMEOUT, 10 s)
    batch_delay_s: float | None         # None: the SDK's own (OTEL_BSP_SCHEDULE_DELAY, 5 s)
    max_queue_size: int | None          # None: the SDK's own (OTEL_BSP_MAX_QUEUE_SIZE, 2048)
    protocol_from: str = "tracing.protocol"     # the key or the variable that chose the protocol
    compression: str = "none"           # OTEL_EXPORTER_OTLP_(TRACES_)COMPRESSION: gzip, deflate (HTTP), none


def _env_float(env: Mapping[str, str], name: str, low: float, high: float) -> float:
    raw = env[name]
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}: not a number: {raw!r}") from None
    if not low <= v <= high:
        raise ValueError(f"environment variable {name}: must be within [{low:g}, {high:g}], got {raw!r}")
    return v


def _sampler_from_env(env: Mapping[str, str]) -> tuple[float | None, bool | None]:
    """(ratio, parent_based) from OTEL_TRACES_SAMPLER[_ARG]; None where the variables say nothing."""
    name = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if not name:
        return None, None
    parent = name.startswith("parentbased_")
    base = name.removeprefix("parentbased_")
    if base == "always_on":
        return 1.0, parent
    if base == "always_off":
        return 0.0, parent
    if base == "traceidratio":
        ratio = _env_float(env, "OTEL_TRACES_SAMPLER_ARG", 0.0, 1.0) if env.get("OTEL_TRACES_SAMPLER_ARG") else 1.0
        return ratio, parent
    raise ValueError(f"environment variable OTEL_TRACES_SAMPLER: {name!r} is not supported "
                     "(always_on, always_off, traceidratio, each optionally parentbased_)")


def resolve(cfg: TracingConfig, env: Mapping[str, str] | None = None) -> TracingSettings:
    """The block's keys, else the ``OTEL_*`` variables, else the defaults."""
    env = os.environ if env is None else env
    protocol = cfg.protocol
    protocol_from = "tracing.protocol"
    if protocol is None:
        for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            if env.get(var):
                protocol, protocol_from = env[var].strip(), var
                if protocol not in ("http/protobuf", "grpc"):
                    raise ValueError(f"environment variable {var}: {protocol!r} is not supported "
                                     "(http/protobuf or grpc)")
                break
    protocol = protocol or "http/protobuf"
    env_endpoint = None
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        env_endpoint = env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"].strip()   # the signal's URL, as is
    elif env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        base = env["OTEL_EXPORTER_OTLP_ENDPOINT"].strip()
        env_endpoint = base.rstrip("/") + TRACES_PATH if protocol == "http/protobuf" else base
    if env_endpoint is not None:
        _check_endpoint(env_endpoint, "environment variable OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT")
    if cfg.endpoint is not None:
        # host:port is plain text for either protocol, as the defaults are (https:// for TLS); the
        # gRPC exporter would take it for TLS (the OTLP spec's default for a gRPC endpoint without a
        # scheme, which the environment's endpoint keeps)
        endpoint = _with_signal_path(cfg.endpoint) if protocol == "http/protobuf" else \
            cfg.endpoint if cfg.endpoint.startswith(("http://", "https://")) else "http://" + cfg.endpoint
    elif env_endpoint is not None:
        endpoint = env_endpoint
    else:
        endpoint = DEFAULT_HTTP_ENDPOINT if protocol == "http/protobuf" else DEFAULT_GRPC_ENDPOINT
    if protocol == "http/protobuf" and not endpoint.startswith(("http://", "https://")):
        endpoint = "http://" + endpoint

    if cfg.enabled is not None:
        enabled = cfg.enabled
    elif env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" \
            or env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        enabled = False
    else:
        enabled = cfg.endpoint is not None or env_endpoint is not None

    # read here, not by the exporters: the gRPC one knows gzip only (the specification's none
    # raised where the app is built), the HTTP one warned of a value it did not know and sent the
    # spans uncompressed
    compression = "none"
    for var in ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION"):
        if env.get(var, "").strip():
            compression = env[var].strip().lower()
            known = ("gzip", "deflate", "none") if protocol == "http/protobuf" else ("gzip", "none")
            if compression not in known:
                raise ValueError(f"environment variable {var}: {env[var].strip()!r} is not supported "
                                 f"({', '.join(known[:-1])} or {known[-1]})")
            break

    # checked here: the gRPC exporter parses them with float() where the app is built (its error
    # names nothing; the signal's variable even when empty), the HTTP one drops a bad value for its
    # default
    for var in ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"):
        if env.get(var, "").strip() or (protocol == "grpc" and var == "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
                                        and var in env):
            try:
                ok = float(env[var]) > 0
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"environment variable {var}: must be a number of seconds above 0, got {env[var]!r}")

    env_ratio, env_parent = _sampler_from_env(env)
    ratio = cfg.sample_ratio if cfg.sample_ratio is not None else env_ratio if env_ratio is not None else 1.0
    parent = cfg.parent_based if cfg.parent_based is not None else env_parent if env_parent is not None else True
    service = cfg.service_name or env.get("OTEL_SERVICE_NAME", "").strip() or "switchyard"
    return TracingSettings(enabled=enabled, endpoint=endpoint, protocol=protocol, sample_ratio=ratio,
                           parent_based=parent, service_name=service, exclude_paths=cfg.exclude_paths,
                           export_timeout_s=cfg.export_timeout_s, batch_delay_s=cfg.batch_delay_s,
                           max_queue_size=cfg.max_queue_size, protocol_from=protocol_from,
                           compression=compression)


def _with_signal_path(url: str) -> str:
    """``host:port`` or a URL without a path → the OTLP/HTTP traces URL on it."""
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    scheme, rest = url.split("://", 1)
    if "/" not in rest or rest.endswith("/") and rest.count("/") == 1:
        return f"{scheme}://{rest.rstrip('/')}{TRACES_PATH}"
    return url


# -- the per-request API ------------------------------------------------------------------------


class Leg:
    """One engine leg's span. This base class is the disabled one: it changes nothing."""

    __slots__ = ()

    def inject(self, headers: dict[str, str]) -> dict[str, str]:
        """The headers to send on this leg: with the leg's ``traceparent`` when traced."""
        return headers

    def responded(self, status: int) -> None:
        """The engine answered with ``status``."""

    def failed(self, error_type: str) -> None:
        """The leg failed (before an answer, or its answer was cut): ends the span as an error."""

    def __enter__(self) -> Leg:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class Trace:
    """A request's trace, as the stages see it. This base class is the disabled one (``NO_TRACE``):
    every method does nothing, so the pipeline calls them unconditionally."""

    __slots__ = ()
    trace_id: str | None = None        # hex, when the request is sampled (the log line shows it)

    def route_start(self) -> None:
        """Routing begins (the ``route`` span)."""

    def routed(self, decision: Decision, candidates: int) -> None:
        """Routing chose ``decision`` among ``candidates`` endpoints."""

    def leg(self, kind: str, ep: Endpoint, attempt: int = 1, method: str = "POST") -> Leg:
        """A CLIENT span for one engine leg (``prefill``, ``decode``, ``generate``; a call on a
        stored response relayed to its engine: ``retrieve``, ``delete``, ``cancel``,
        ``input_items``), made with ``method``. ``attempt``: the
        request's try the leg belongs to, 1 plus its retries so far (a P/D pair chosen again, a
        decode sent elsewhere, an aggregated leg rerouted). Used in a ``with`` block it ends with
        the block; otherwise it ends when the request finishes, or at ``failed``."""
        return NO_LEG

    def event(self, name: str, attributes: dict[str, Any] | None = None) -> None:
        """An event on the request span: ``watchdog``, ``abort``, ``retry``."""

    def legs_broke(self, error_type: str) -> None:
        """The stream's legs open now broke (a mid-stream continuation follows): each ends here as
        failed with ``error_type``, and the legs opened after carry ``switchyard.migration.leg``."""

    def finish(self, rec: Record) -> None:
        """The request is done: its outcome onto the request span, open legs ended."""

    def hold(self) -> None:
        """The answer's body is still on its way to the client once the handler returns (a whole
        answer over the client's transport's limit, or one aiohttp writes after the handler): the
        request span stays open, whatever status the handler returned, until ``release``."""

    def release(self, status: int) -> None:
        """The held answer went out (``status``), or its client left while it went (499): the
        request span ends with that status."""

    def edge_answered(self, status: int) -> None:
        """The edge answered the request ``status`` itself while its handler read the body (a 408 or
        400, gateway/pipeline/context.py ``take_edge_answer``) and cancelled the handler: the span
        says that answer, not a client's 499."""


NO_LEG = Leg()
NO_TRACE = Trace()


class Record(Protocol):
    """What ``finish`` reads of the request's record (``gateway.pipeline.context.RequestRecord``)."""

    request_id: str
    path: str
    started: float
    model: str
    alias: str | None          # the alias the client named; ``model`` is its target
    user: str | None
    endpoint: str
    status: int
    stream: bool
    error_class: ErrorClass | None
    retries: int
    ttft: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    finish_reason: str | None
    engine_model: str | None   # the model the engine's answer named, when the relay read it
    extra: dict                # the log line's further fields (``finish_reasons``: several choices')


# -- the enabled implementation ------------------------------------------------------------------

_PROPAGATOR = TraceContextTextMapPropagator()
# the W3C header parser's warnings (a tracestate member that does not parse, a traceparent or a
# tracestate over 512 characters) are about a client's headers, which are ignored as W3C Trace
# Context says: one a request, quoting the header, they would let any client write the log
for _name in ("opentelemetry.trace.propagation.tracecontext", "opentelemetry.trace.span"):
    logging.getLogger(_name).setLevel(logging.ERROR)


class _HeaderGetter(Getter):
    """A request's W3C headers as W3C Trace Context reads them: every ``tracestate`` field line, in
    order (one list, as RFC 9110 combines a field sent on several lines), and no ``traceparent`` when
    there is more than one (the trace then starts here). The SDK's default getter read the first
    line of each: it continued the first of two traceparents and lost the tracestate of the rest."""

    def get(self, carrier: Any, key: str) -> list[str] | None:
        values = carrier.getall(key, None)
        if not values or key == "traceparent" and len(values) > 1:
            return None
        return values

    def keys(self, carrier: Any) -> list[str]:
        return list(carrier.keys())


_GETTER = _HeaderGetter()
_ERROR = Status(StatusCode.ERROR)


def _error_type(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    return str(getattr(exc, "kind", None) or getattr(exc, "failure_class", None) or getattr(exc, "error_class", None)
               or type(exc).__name__)


class SpanLeg(Leg):
    __slots__ = ("span", "managed", "ended")

    def __init__(self, span: otel.Span) -> None:
        self.span = span
        self.managed = False
        self.ended = False

    def inject(self, headers: dict[str, str]) -> dict[str, str]:
        out = {k: v for k, v in headers.items() if k.lower() not in _TRACE_HEADERS}
        _PROPAGATOR.inject(out, context=otel.set_span_in_context(self.span))
        return out

    def responded(self, status: int) -> None:
        span = self.span
        span.set_attribute("http.response.status_code", status)
        if status >= 400:
            span.set_attribute("error.type", str(status))
            span.set_status(_ERROR)

    def failed(self, error_type: str) -> None:
        if not self.ended:
            self.span.set_attribute("error.type", error_type)
            self.span.set_status(_ERROR)
            self.end()

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.span.end()

    def __enter__(self) -> SpanLeg:
        self.managed = True
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self.failed(_error_type(exc))
        self.end()


class ContextLeg(Leg):
    """The leg of a request that is not sampled: no span of its own (it would record nothing), but
    the engine still gets the request's context, flagged unsampled, so it does not start a trace."""

    __slots__ = ("ctx",)

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def inject(self, headers: dict[str, str]) -> dict[str, str]:
        out = {k: v for k, v in headers.items() if k.lower() not in _TRACE_HEADERS}
        _PROPAGATOR.inject(out, context=self.ctx)
        return out


class RequestTrace(Trace):
    """The trace of one request: its SERVER span, the route span, the legs."""

    __slots__ = ("tracing", "span", "ctx", "trace_id", "recording", "_route", "_legs", "_unsampled_leg",
                 "_perf0", "_epoch0", "_closed", "_stream_leg", "edge_status", "_held")

    def __init__(self, tracing: Tracing, span: otel.Span) -> None:
        self.tracing = tracing
        self.span = span
        self.ctx: Context = otel.set_span_in_context(span)
        self.recording = span.is_recording()
        self.trace_id = format(span.get_span_context().trace_id, "032x") if self.recording else None
        self._unsampled_leg = None if self.recording else ContextLeg(self.ctx)
        self._route: otel.Span | None = None
        self._legs: list[SpanLeg] = []
        self._stream_leg = 1               # the stream's leg the next legs open (2: its first continuation)
        self._perf0 = time.perf_counter()
        self._epoch0 = time.time_ns()
        self._closed = False
        self._held = False
        self.edge_status: int | None = None    # the edge's own answer (``edge_answered``)

    def _ns(self, perf: float) -> int:
        """A ``time.perf_counter`` reading as epoch nanoseconds."""
        return self._epoch0 + int((perf - self._perf0) * 1e9)

    def route_start(self) -> None:
        if self.recording:
            self._route = self.tracing.tracer.start_span("route", context=self.ctx)

    def routed(self, decision: Decision, candidates: int) -> None:
        span, self._route = self._route, None
        if span is None:
            return
        if span.is_recording():
            attrs: dict[str, Any] = {"switchyard.route.strategy": decision.strategy,
                                     "switchyard.route.candidates": candidates,
                                     "switchyard.route.endpoint": decision.endpoint.name,
                                     "switchyard.route.fallback": bool(decision.fallbacks)}
            if decision.prefill is not None:
                attrs["switchyard.route.prefill_endpoint"] = decision.prefill.name
                attrs["switchyard.route.uncached_tokens"] = decision.uncached_tokens
            if decision.fallbacks:
                attrs["switchyard.route.fallback_reasons"] = [f"{s}:{r}" for s, r in decision.fallbacks]
            if decision.reason:
                attrs["switchyard.route.reason"] = decision.reason
            if decision.prefix_match is not None:
                attrs["switchyard.route.prefix_match_percent"] = round(decision.prefix_match, 2)
            span.set_attributes(attrs)
        span.end()

    def leg(self, kind: str, ep: Endpoint, attempt: int = 1, method: str = "POST") -> Leg:
        if self._unsampled_leg is not None:
            return self._unsampled_leg
        host, _, port = ep.name.rpartition(":")
        attrs: dict[str, Any] = {"http.request.method": method, "server.address": host or ep.name}
        if port.isdigit():
            attrs["server.port"] = int(port)
        if ep.roleset:
            attrs["switchyard.roleset"] = ep.roleset
        if attempt > 1:
            attrs["switchyard.attempt"] = attempt
        if self._stream_leg > 1:
            attrs["switchyard.migration.leg"] = self._stream_leg
        leg = SpanLeg(self.tracing.tracer.start_span(kind, context=self.ctx, kind=SpanKind.CLIENT,
                                                     attributes=attrs))
        self._legs.append(leg)
        return leg

    def event(self, name: str, attributes: dict[str, Any] | None = None) -> None:
        if self.recording and not self._closed:      # (an abort decided after the answer went out)
            self.span.add_event(name, attributes)

    def legs_broke(self, error_type: str) -> None:
        if self._unsampled_leg is not None:
            return
        broke = False
        for leg in self._legs:
            if not leg.managed and not leg.ended:
                leg.failed(error_type)
                broke = True
        if broke:
            self._stream_leg += 1

    def finish(self, rec: Record) -> None:
        if self._route is not None:       # routing itself failed (no route, a bug)
            self._route.set_status(_ERROR)
            if rec.error_class:
                self._route.set_attribute("error.type", rec.error_class)
            self._route.end()
            self._route = None
        for leg in self._legs:
            if not leg.managed and not leg.ended:
                if rec.error_class:
                    leg.failed(rec.error_class)
                leg.end()
        span = self.span
        if not self.recording:
            return
        attrs: dict[str, Any] = {"gen_ai.request.id": rec.request_id}
        if rec.model != "-":       # the model as the client named it (an alias), and the one that answered
            attrs["gen_ai.request.model"] = rec.alias if rec.alias is not None else rec.model
            if rec.endpoint and rec.status < 400:
                # the name of the model that generated the response: as the engine's answer named it
                # where the relay read it, else the served model's configured name
                attrs["gen_ai.response.model"] = rec.engine_model or rec.model
        op = _OPERATIONS.get(rec.path)
        if op:
            attrs["gen_ai.operation.name"] = op
        for key, v in (("gen_ai.usage.input_tokens", rec.prompt_tokens),
                       ("gen_ai.usage.output_tokens", rec.completion_tokens),
                       ("gen_ai.usage.cache_read.input_tokens", rec.cached_tokens),
                       # the GenAI conventions' name, and vLLM's, which it had first (kept for what reads it)
                       ("gen_ai.response.time_to_first_chunk", rec.ttft),
                       ("gen_ai.latency.time_to_first_token", rec.ttft),
                       ("user.id", rec.user)):
            if v is not None:
                attrs[key] = v
        reasons = rec.extra.get("finish_reasons")      # several choices: each one's that finished
        if reasons:
            attrs["gen_ai.response.finish_reasons"] = [r for r in reasons if r]
        elif rec.finish_reason:
            attrs["gen_ai.response.finish_reasons"] = [rec.finish_reason]
        if rec.endpoint:
            attrs["switchyard.endpoint"] = rec.endpoint
        attrs["switchyard.stream"] = rec.stream
        if rec.retries:
            attrs["switchyard.retries"] = rec.retries
        if rec.error_class:
            attrs["error.type"] = rec.error_class
            # 4xx are the client's (not an error of this server); a stream cut after a 200 is
            if rec.status >= 500 or (rec.status < 400 and rec.error_class != ErrorClass.CLIENT_CANCEL):
                span.set_status(_ERROR)
        span.set_attributes(attrs)
        if rec.ttft is not None:
            span.add_event("first_token", timestamp=self._ns(rec.started + rec.ttft))

    def edge_answered(self, status: int) -> None:
        self.edge_status = status

    def hold(self) -> None:
        self._held = True

    def release(self, status: int) -> None:
        self._held = False
        self.close(status)

    def close(self, status: int) -> None:
        """The answer went out with ``status`` (499: the client left): the request span ends
        (a held one's at ``release``)."""
        if self._closed or self._held:
            return
        self._closed = True
        if self._route is not None:
            self._route.end()
            self._route = None
        span = self.span
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(_ERROR)
        span.end()


# -- the exporter and the app-wide object --------------------------------------------------------


FAILURE_LINE_EVERY_S = 60.0     # the gateway's line of failed exports, at most once in this long


class CountingExporter(SpanExporter):
    """The OTLP exporter, with its failures counted (it retries and logs them itself). Over HTTP,
    where the SDK's last line of a batch whose requests got no answer says only that it failed
    "due to timeout, max retries or shutdown", the gateway says which endpoint and why (the
    exporter's ``switchyard_failure``, ``make_exporter``): at the first failure, then at most once
    every ``FAILURE_LINE_EVERY_S`` while they go on, with the batches failed since."""

    def __init__(self, inner: SpanExporter, metrics: GatewayMetrics, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.inner = inner
        self.metrics = metrics
        self._failure: Callable[[], str | None] | None = getattr(inner, "switchyard_failure", None)
        self._endpoint = str(getattr(inner, "_endpoint", "") or "")
        self._clock = clock
        self._told_at: float | None = None
        self._untold = 0            # batches failed since the last line

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:       # an exporter bug must not kill the export thread
            _log.exception("span export raised")
            result = SpanExportResult.FAILURE
        m = self.metrics
        if result is SpanExportResult.SUCCESS:
            m.child(m.trace_spans, "exported").inc(len(spans))
        else:
            m.trace_export_failures.inc()
            m.child(m.trace_spans, "failed").inc(len(spans))
            if self._failure is not None:
                self._tell(self._failure())
        return result

    def _tell(self, cause: str | None) -> None:
        """The line of a failed export whose cause is known (not an answer's status: the SDK's line says it)."""
        self._untold += 1
        if cause is None:
            return
        now = self._clock()
        if self._told_at is not None and now - self._told_at < FAILURE_LINE_EVERY_S:
            return
        _log.warning("tracing: spans could not be exported to %s: %s (%d span batch(es) failed since the last "
                     "such line; switchyard_trace_export_failures_total counts them)",
                     self._endpoint, cause, self._untold)
        self._told_at, self._untold = now, 0

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class SeldomLines(logging.Filter):
    """The OTLP exporters' warnings and errors, each kind (its message's format) logged the first
    time, then at most once every ``every_s``: a collector that refuses or is out of reach makes the
    exporter log every failed batch ("Failed to export ...") and every retry of one ("Transient
    error ..."), a line or more a second under load. A line logged after some were not says how
    many. (The failures stay counted one by one: ``switchyard_trace_export_failures_total``.)

    Once ``start``-ed on a loop, the lines of a kind held back are told when their interval is
    over even if no line of that kind comes next (failures that stopped): one timer a kind on the
    loop, set when the first line is held back, logging the last of them with the count. ``stop``
    cancels the timers and tells what is still held."""

    def __init__(self, every_s: float = FAILURE_LINE_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every_s = every_s
        self.clock = clock
        self._lock = threading.Lock()
        self._told: dict[str, tuple[float, int]] = {}    # a format → when last logged, how many not since
        self._last: dict[str, logging.LogRecord] = {}    # a format → the last line held back
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def stop(self) -> None:
        """Cancel the timers and tell the lines still held back (on the loop's thread)."""
        self._loop = None
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        with self._lock:
            kinds = list(self._last)
        for kind in kinds:
            self._tell(kind, force=True)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or getattr(record, "seldom_told", False):
            return True
        kind = str(record.msg)
        now = self.clock()
        with self._lock:
            told = self._told.get(kind)
            if told is not None and now - told[0] < self.every_s:
                self._told[kind] = (told[0], told[1] + 1)
                self._last[kind] = record
                loop = self._loop
                if not told[1] and loop is not None:        # the first held back: time its telling
                    try:
                        loop.call_soon_threadsafe(self._arm, kind, told[0] + self.every_s - now)
                    except RuntimeError:                    # the loop closed meanwhile
                        pass
                return False
            self._told[kind] = (now, 0)
            self._last.pop(kind, None)
        if told is not None and told[1]:
            record.msg = (f"{record.getMessage()} ({told[1]} more such line(s) not logged in the last "
                          f"{now - told[0]:.0f} s)")
            record.args = None
        return True

    def _arm(self, kind: str, delay: float) -> None:
        if self._loop is not None and kind not in self._timers:
            self._timers[kind] = self._loop.call_later(max(0.0, delay), self._due, kind)

    def _due(self, kind: str) -> None:
        self._timers.pop(kind, None)
        self._tell(kind)

    def _tell(self, kind: str, force: bool = False) -> None:
        """Log the last line of ``kind`` held back with their count, if its interval is over (or ``force``)."""
        now = self.clock()
        with self._lock:
            told, last = self._told.get(kind), self._last.get(kind)
            if told is None or last is None or not told[1]:
                return
            if not force and now - told[0] < self.every_s:      # told by a line meanwhile, and held again
                self._arm(kind, told[0] + self.every_s - now)
                return
            self._told[kind] = (now, 0)
            del self._last[kind]
        line = logging.makeLogRecord(last.__dict__)
        line.msg = (f"{last.getMessage()} (the last of {told[1]} such line(s) not logged in the last "
                    f"{now - told[0]:.0f} s)")
        line.args = None
        line.seldom_told = True
        logging.getLogger(last.name).handle(line)


# the exporters' loggers (OTLP/HTTP's client logs as its trace exporter's module)
EXPORTER_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                    "opentelemetry.exporter.otlp.proto.grpc.exporter")


def seldom_exporter_lines() -> list[SeldomLines]:
    """The exporters' lines through a ``SeldomLines`` of this app's tracing, with nothing told yet
    (one app a process, but for tests); the filters."""
    filters = []
    for name in EXPORTER_LOGGERS:
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, SeldomLines)]:
            logger.removeFilter(f)
        filters.append(SeldomLines())
        logger.addFilter(filters[-1])
    return filters


class CountingProcessor(BatchSpanProcessor):
    """The SDK's batch processor, with the spans a full queue drops counted: the SDK logs the first
    drop of every 20 s and counts nothing, so a collector that is down or slow lost spans unseen by
    the metrics (``result="dropped"``)."""

    def __init__(self, exporter: SpanExporter, metrics: GatewayMetrics, **kwargs: Any) -> None:
        super().__init__(exporter, **kwargs)
        self._dropped = metrics.child(metrics.trace_spans, "dropped")
        self._queue = getattr(self._batch_processor, "_queue", None)      # a deque of the queue's bound
        self._bound = getattr(self._batch_processor, "_max_queue_size", 0)

    def on_end(self, span: Any) -> None:
        queue = self._queue
        # as the SDK decides: a sampled span meeting a full queue pushes the oldest one out
        if queue is not None and len(queue) >= self._bound and span.context and span.context.trace_flags.sampled:
            self._dropped.inc()
        super().on_end(span)


_TLS_FILES = ("CERTIFICATE", "CLIENT_KEY", "CLIENT_CERTIFICATE")


def _tls_files(protocol: str, env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """The TLS files the exporter will read: {role: (variable, path)}. Over HTTP each role's traces
    variable, else the general one; over gRPC the traces variables when the traces CA is set, else
    the general ones when the general CA is, and no file without a CA (as the gRPC exporter reads
    them)."""
    traces, general = "OTEL_EXPORTER_OTLP_TRACES_", "OTEL_EXPORTER_OTLP_"
    if protocol == "grpc":
        prefix = traces if env.get(traces + "CERTIFICATE") is not None else \
            general if env.get(general + "CERTIFICATE") else None
        return {} if prefix is None else \
            {role: (prefix + role, env[prefix + role]) for role in _TLS_FILES if env.get(prefix + role)}
    found = {}
    for role in _TLS_FILES:
        var = next((p + role for p in (traces, general) if env.get(p + role)), None)
        if var is not None:
            found[role] = (var, env[var])
    return found


def check_tls_files(protocol: str, env: Mapping[str, str] | None = None) -> None:
    """Refuse, naming the variable, a TLS file the exporter cannot read, and over gRPC a client
    certificate without its key or a key without its certificate: grpc's core aborts the process
    (SIGABRT, and with --workers each worker for ever) where the exporter builds its channel with
    one of the two missing, which is also what a mistyped path gives (the exporter reads a file it
    cannot open as none)."""
    env = os.environ if env is None else env
    files = _tls_files(protocol, env)
    for var, path in files.values():
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            raise ValueError(f"environment variable {var}: cannot read {path!r}: {e.strerror}") from None
    if protocol == "grpc":
        key, cert = files.get("CLIENT_KEY"), files.get("CLIENT_CERTIFICATE")
        if cert and not key:
            raise ValueError(f"environment variable {cert[0]}: a client certificate needs its key, in "
                             f"{cert[0].removesuffix('CLIENT_CERTIFICATE')}CLIENT_KEY")
        if key and not cert:
            raise ValueError(f"environment variable {key[0]}: a client key needs its certificate, in "
                             f"{key[0].removesuffix('CLIENT_KEY')}CLIENT_CERTIFICATE")


# an entry of OTEL_EXPORTER_OTLP_(TRACES_)HEADERS the exporters take (opentelemetry.util.re's liberal
# pattern): a name, "=", and a value that may hold spaces and the URL-encoded characters
_HEADER = re.compile(r"[ \t]*[\x21\x23-\x27\x2a\x2b\x2d\x2e\x30-\x39\x41-\x5a\x5e-\x7a\x7c\x7e]+[ \t]*="
                     r"[ \t]*[\x20\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*[ \t]*")


def check_headers(env: Mapping[str, str] | None = None) -> None:
    """Refuse, naming the variable and the entry, headers the exporter would drop: it reads
    ``OTEL_EXPORTER_OTLP_TRACES_HEADERS``, else ``OTEL_EXPORTER_OTLP_HEADERS``, and dropped an entry
    that is no ``name=value`` pair with a warning that named no variable and printed the entry (a
    token, say), then sent every span without it. The value is not shown: it may be a secret."""
    env = os.environ if env is None else env
    var = next((v for v in ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS") if env.get(v)), None)
    if var is None:
        return
    entries = re.split(r"[ \t]*,[ \t]*", env[var])
    for i, entry in enumerate(entries, 1):
        if entry and not _HEADER.fullmatch(entry.strip()):
            raise ValueError(f"environment variable {var}: entry {i} of {len(entries)} is not name=value "
                             "(a comma-separated list of them, each value URL-encoded); the exporter would "
                             "send the spans without it")


def check_exporter(s: TracingSettings, env: Mapping[str, str] | None = None) -> None:
    """What building the exporter for ``s`` refuses, checked without building it (``--check-config``):
    nothing when tracing is off, whose exporter is not built."""
    if not s.enabled:
        return
    check_tls_files(s.protocol, env)
    check_headers(env)
    if s.protocol == "grpc":
        try:
            found = importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc.trace_exporter") is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ValueError(f"{s.protocol_from}: grpc needs the OTLP gRPC exporter: pip install 'switchyard[grpc]'")


def make_exporter(s: TracingSettings) -> SpanExporter:
    check_tls_files(s.protocol)
    check_headers()
    if s.protocol == "grpc":
        # grpc's core writes its own lines to stderr, outside the gateway's format, and at its info
        # level by default (a line at every failed handshake); the exporter logs each failure, with
        # grpc's details, through the gateway's. Read when grpc loads; GRPC_VERBOSITY set wins.
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        except ImportError:
            raise ValueError(f"{s.protocol_from}: grpc needs the OTLP gRPC exporter: "
                             "pip install 'switchyard[grpc]'") from None
        from grpc import Compression as GrpcCompression
        return GrpcExporter(endpoint=s.endpoint, timeout=s.export_timeout_s,
                            compression=GrpcCompression.Gzip if s.compression == "gzip" else GrpcCompression.NoCompression)
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    compression = {"gzip": Compression.Gzip, "deflate": Compression.Deflate}.get(s.compression, Compression.NoCompression)
    session = _http_session()
    exporter = OTLPSpanExporter(endpoint=s.endpoint, timeout=s.export_timeout_s, compression=compression,
                                session=session)
    if session is not None:     # what the last export's failure was, for the gateway's line (``CountingExporter``)
        exporter.switchyard_failure = lambda: session.failed
    return exporter


# the SDK's variables naming a requests.Session of a plugin's, which a session given here would replace
_CREDENTIAL_PROVIDERS = ("OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER",
                         "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER")


def _http_session() -> Any:
    """The OTLP/HTTP exporter's requests session, in which the CA file it was given
    (``OTEL_EXPORTER_OTLP_(TRACES_)CERTIFICATE``) is the one that verifies the collector. The exporter
    sets it as the session's ``verify``, but requests lets ``REQUESTS_CA_BUNDLE`` or ``CURL_CA_BUNDLE``
    (set to the system's bundle in many images) replace a session's own ``verify`` on every request:
    a collector behind a private CA then failed verification on every export. A certificate the CA
    does not verify is ``CollectorNotTrusted``, no connection error: the exporter retries those until
    its timeout (a certificate does not heal in seconds) and then logs a line without the cause;
    this one it reports at once, its cause in the line. None (the exporter's own session) when a
    credential provider plugin names the session."""
    if any(os.environ.get(v) for v in _CREDENTIAL_PROVIDERS):
        return None
    import requests

    class Session(requests.Session):
        failed: str | None = None       # why the last request got no answer (``_unanswered``); None once one did

        def merge_environment_settings(self, url, proxies, stream, verify, cert):
            merged = super().merge_environment_settings(url, proxies, stream, verify, cert)
            if verify is None and isinstance(self.verify, str):     # a CA file, given to the exporter
                merged["verify"] = self.verify
            return merged

        def send(self, request, **kwargs):
            try:
                response = super().send(request, **kwargs)
            except requests.exceptions.SSLError as e:
                cause = _cert_verification(e)
                if cause is None:           # a handshake cut short: transient, retried as before
                    self.failed = _unanswered(e)
                    raise
                verify = kwargs.get("verify")
                ca = verify if isinstance(verify, str) else "the system's CA bundle"
                self.failed = (f"the collector's certificate is not trusted ({ca}): "
                               f"certificate verify failed: {cause}")
                raise CollectorNotTrusted(self.failed) from e
            except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as e:
                self.failed = _unanswered(e)
                raise
            self.failed = None
            return response

    return Session()


def _unanswered(error: BaseException) -> str:
    """Why an export request got no answer, in a few words and what the socket said: connection
    refused, a TLS handshake that failed (an https:// endpoint at a plain-text collector), a name
    not resolved, no answer in time."""
    import socket
    import ssl

    import requests
    found: list[BaseException] = []

    def walk(e: BaseException, depth: int) -> None:
        found.append(e)
        if depth < 6:
            for inner in (*getattr(e, "args", ()), getattr(e, "reason", None), e.__cause__, e.__context__):
                if isinstance(inner, BaseException) and inner not in found:
                    walk(inner, depth + 1)

    walk(error, 0)
    for e in found:
        if isinstance(e, ssl.SSLError):
            return (f"the TLS handshake failed ({e.reason or e}): does the collector speak TLS at this "
                    "address, or plain HTTP (an http:// endpoint)?")
        if isinstance(e, ConnectionRefusedError):
            return "connection refused: is the collector listening at this address?"
        if isinstance(e, socket.gaierror):
            return f"the collector's host name was not resolved ({e})"
    if isinstance(error, requests.exceptions.Timeout):
        return "no answer within the export timeout"
    last = found[-1]
    return f"{type(last).__name__}: {last}"


class CollectorNotTrusted(Exception):
    """The collector's certificate failed verification."""


def _cert_verification(error: BaseException, depth: int = 0) -> str | None:
    """What certificate verification said, if it is what ``error`` (requests' SSLError, wrapping
    urllib3's) comes from."""
    import ssl
    if isinstance(error, ssl.SSLCertVerificationError):
        return error.verify_message or str(error)
    if depth > 6:
        return None
    inner = [*getattr(error, "args", ()), getattr(error, "reason", None), error.__cause__, error.__context__]
    for e in inner:
        if isinstance(e, BaseException) and (found := _cert_verification(e, depth + 1)):
            return found
    return None


# where the middleware leaves a request's trace (aiohttp's request state; typed keys since aiohttp 3.13)
TRACE_KEY: Any = web.RequestKey("switchyard_trace", Trace) if hasattr(web, "RequestKey") else "switchyard_trace"


class NoTracing:
    """Tracing off: every request's trace is ``NO_TRACE``."""

    __slots__ = ()

    def of(self, request: web.Request) -> Trace:
        return NO_TRACE


NO_TRACING = NoTracing()


class Tracing:
    """The app's tracer: its provider (sampler, batch processor, exporter), the middleware that
    opens each request's SERVER span, and the shutdown that flushes."""

    def __init__(self, settings: TracingSettings, metrics: GatewayMetrics,
                 exporter: SpanExporter | None = None) -> None:
        self.settings = settings
        ratio = TraceIdRatioBased(settings.sample_ratio)
        sampler = ParentBased(ratio) if settings.parent_based else ratio
        length_vars = ("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT")
        limits = SpanLimits() if any(v in os.environ for v in length_vars) else \
            SpanLimits(max_attribute_length=MAX_ATTRIBUTE_LENGTH, max_span_attribute_length=MAX_ATTRIBUTE_LENGTH)
        self.provider = TracerProvider(sampler=sampler, span_limits=limits,
                                       resource=Resource.create({"service.name": settings.service_name}))
        # the SDK refuses a queue smaller than its export batch (512 unless OTEL_BSP_MAX_EXPORT_BATCH_SIZE
        # says otherwise): a smaller queue exports batches of its own size
        queue = settings.max_queue_size or BatchSpanProcessor._default_max_queue_size()
        self.processor = CountingProcessor(
            CountingExporter(exporter or make_exporter(settings), metrics), metrics,
            max_queue_size=settings.max_queue_size,
            schedule_delay_millis=settings.batch_delay_s * 1000 if settings.batch_delay_s else None,
            max_export_batch_size=max(1, min(BatchSpanProcessor._default_max_export_batch_size(), queue)))
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("switchyard")
        self.seldom = seldom_exporter_lines()
        self._exact = frozenset(p for p in settings.exclude_paths if not p.endswith("*"))
        self._prefixes = tuple(p[:-1] for p in settings.exclude_paths if p.endswith("*"))

    @classmethod
    def from_config(cls, cfg: TracingConfig, metrics: GatewayMetrics,
                    env: Mapping[str, str] | None = None) -> Tracing | None:
        """None when tracing is off."""
        s = resolve(cfg, env)
        return cls(s, metrics) if s.enabled else None

    def excluded(self, path: str) -> bool:
        return path in self._exact or (bool(self._prefixes) and path.startswith(self._prefixes))

    def of(self, request: web.Request) -> Trace:
        """The trace the middleware opened for ``request`` (``NO_TRACE`` on an excluded path)."""
        return request.get(TRACE_KEY, NO_TRACE)

    async def serve(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                    route: str | None, kind: SpanKind = SpanKind.SERVER,
                    extra: dict[str, Any] | None = None) -> web.StreamResponse:
        """``handler``'s answer to ``request`` inside the request's SERVER span (named after
        ``route``, the path's pattern), which sees the status the client gets. ``kind`` and
        ``extra`` (attributes): a batch line's span (``lines``)."""
        path = request.path
        if self.excluded(path):
            return await handler(request)
        # few attributes: each one costs the exporter thread a few µs to encode, on every request
        attrs: dict[str, Any] = {"http.request.method": request.method, "url.path": path}
        if request.remote:
            attrs["client.address"] = request.remote
        if extra:
            attrs.update(extra)
        span = self.tracer.start_span(f"{request.method} {route}" if route else request.method,
                                      context=_PROPAGATOR.extract(request.headers, getter=_GETTER), kind=kind,
                                      attributes=attrs)
        rt = request[TRACE_KEY] = RequestTrace(self, span)
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        except asyncio.CancelledError:     # the client left, or the edge answered a body that stopped or broke
            status = rt.edge_status or 499
            raise
        finally:
            rt.close(status)

    @property
    def middleware(self):
        """The span of a request the application routes (its route's pattern names it)."""
        @web.middleware
        async def trace_middleware(request: web.Request, handler):
            resource = request.match_info.route.resource
            return await self.serve(request, handler, resource.canonical if resource is not None else None)

        return trace_middleware

    def direct(self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        """``handler`` with its request's span, for an inference path the edge calls without the
        application (gateway/server/edge.py): the path is its own route."""
        async def traced(request: web.Request) -> web.StreamResponse:
            return await self.serve(request, handler, request.path)

        return traced

    def lines(self, handler: Callable[[Any], Awaitable[web.StreamResponse]]):
        """``handler`` with a span for each batch line it runs in-process (gateway/batch/runner.py):
        a line is a request no client sent, so it is a trace of its own, its span INTERNAL (named
        as a request's, after the batch's endpoint) with the line's batch id and custom id; its legs
        and their engines' spans hang under it as a request's do."""
        async def traced(line: Any) -> web.StreamResponse:
            fields = getattr(line, "log_fields", None) or {}
            extra = {f"switchyard.batch.{name}": str(fields[key])
                     for key, name in (("batch_id", "id"), ("custom_id", "custom_id")) if fields.get(key) is not None}
            return await self.serve(line, handler, line.path, SpanKind.INTERNAL, extra)

        return traced

    def describe(self) -> dict[str, Any]:
        s = self.settings
        return {"endpoint": s.endpoint, "protocol": s.protocol, "sample_ratio": s.sample_ratio,
                "parent_based": s.parent_based, "service_name": s.service_name,
                "exclude_paths": list(s.exclude_paths)}

    def flush_timeout(self, env: Mapping[str, str] | None = None) -> float:
        """How long the shutdown's flush may take: one export call's bound (``export_timeout_s``,
        else the exporter's variables, else its default)."""
        if self.settings.export_timeout_s:
            return self.settings.export_timeout_s
        env = os.environ if env is None else env
        for var in ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"):
            try:
                if env.get(var) and float(env[var]) > 0:
                    return float(env[var])
            except ValueError:
                pass
        return DEFAULT_EXPORT_TIMEOUT_S

    def start(self) -> None:
        """On the running loop: the exporters' held-back lines told when their interval is over."""
        loop = asyncio.get_running_loop()
        for f in self.seldom:
            f.start(loop)

    async def close(self, timeout: float | None = None) -> None:
        """Flush what is queued and stop the export thread, for at most ``timeout`` seconds (default
        ``flush_timeout()``): a collector that is down or hangs loses the spans still queued instead
        of holding up the exit (the SDK would wait up to 30 s, one export after another). The flush
        runs in a daemon thread of its own, so neither a flush cut short nor a second signal that
        cancels this leaves a thread the interpreter waits for at exit."""
        timeout = self.flush_timeout() if timeout is None else timeout
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        def flush() -> None:
            try:
                self.provider.shutdown()
            except Exception:
                _log.exception("tracing shutdown raised")
            finally:
                try:
                    loop.call_soon_threadsafe(finished)
                except RuntimeError:        # the loop closed meanwhile
                    pass

        threading.Thread(target=flush, name="switchyard-trace-flush", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout)
        except TimeoutError:
            _log.warning("tracing: queued spans not exported within %.1f s; dropped", timeout)
            self.processor.span_exporter.shutdown()      # stops the exporter's retries
        finally:
            for f in self.seldom:       # the exporters' lines still held back are told now
                f.stop()
