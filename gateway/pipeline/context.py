"""What one request carries from stage to stage: its record and its context.

``RequestRecord`` is what the log line and the metrics say about a request; ``RequestContext``
adds what the stages hand each other (the aiohttp request, the parsed request, the decision, the
charges, the response once its headers went out, the trace). The pipeline creates one context
per request, every stage takes it, and the pipeline's ``finally`` releases its charges and writes
the record, whatever path the request took.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from functools import lru_cache
from itertools import count, repeat
from operator import attrgetter
from typing import Any, Literal

import structlog
from aiohttp import web

from gateway.apis.base import ApiShape
from gateway.endpoints import Endpoint
from gateway.errors import ErrorClass, GatewayError
from gateway.observability.logs import RequestLog
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.tracing import NO_TRACE, TRACE_KEY, Trace
from gateway.pipeline.ledger import NO_CHARGES, Charges
from gateway.request import InferenceRequest, given_request_id, request_id_from
from handlers.base import PDPlan
from routers.base import Decision
from routers.registry import strategy_label

log = structlog.get_logger("switchyard.request")

WatchdogPhase = Literal["first_chunk", "idle", "response"]

# bytes a header value may carry as is: visible ASCII and space (RFC 9110 field-vchar without obs-text)
_UNSAFE = re.compile(r"[^\x20-\x7e]")
MAX_ECHO_CHARS = 256
MAX_LOG_CHARS = 1024       # a client-written value in the request log line (user, model, error)


def safe_header_value(value: str) -> str:
    """A client-controlled value made safe to echo in a response header: characters outside
    visible ASCII become ``%XX`` escapes of their UTF-8 bytes, and the result is bounded. The
    HTTP writer refuses control characters, so an unescaped one would cost the client its answer.
    A header's bytes that are not UTF-8, which aiohttp reads as lone surrogates, are escaped as the
    bytes they stand for."""
    if len(value) > MAX_ECHO_CHARS:
        value = value[:MAX_ECHO_CHARS]
    if _UNSAFE.search(value) is None:
        return value
    return _UNSAFE.sub(_escaped, value)


def _escaped(m: re.Match[str]) -> str:
    text = m.group()
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:      # a surrogate no undecodable byte stands for
        raw = text.encode("utf-8", "surrogatepass")
    return "".join(f"%{b:02X}" for b in raw)


def model_not_found(name: str, error_class: ErrorClass = ErrorClass.MODEL_NOT_FOUND) -> GatewayError:
    """The 404 for a model a request names that the gateway does not serve, in OpenAI's words;
    also the answer for a model the user may not use (``limits.users.<name>.models``), which only
    the request's log line tells apart: a client cannot learn which models exist by asking."""
    return GatewayError(404, f"The model `{name}` does not exist or you do not have access to it.", param="model",
                        code="model_not_found", header=("x-error-no-model-backends", safe_header_value(name)),
                        error_class=error_class)


def _set_fields(obj: object, names: Iterable[str], values: Iterable[Any]) -> None:
    """Each of ``names`` set on ``obj`` to its value, by ``setattr`` called from C."""
    deque(map(setattr, repeat(obj), names, values), 0)


def _plain_defaults(cls: type) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """The names of a dataclass's fields that have a plain default (not a factory's), and those defaults."""
    given = [(f.name, f.default) for f in fields(cls) if f.default is not MISSING]
    return tuple(n for n, _ in given), tuple(v for _, v in given)


# the ``routing-strategy`` an answer echoes: a strategy's canonical spelling (``RequestRecord.strategy``,
# a few per gateway) made safe once, not at every answer
_strategy_header = lru_cache(maxsize=256)(safe_header_value)


@dataclass(slots=True)
class RequestRecord:
    """What the per-request log line and the metrics say about one request."""

    request_id: str
    path: str
    started: float
    # the path as a metric label when the path holds an id (a stored response's calls): its route's
    # template, so every id a client tries does not make a series (``label_path``)
    route: str | None = None
    model: str = "-"
    strategy: str = ""
    # the model exists (the pipeline checked it): only then is ``model`` a metric label, so a
    # client's arbitrary names are logged but never grow /metrics
    model_known: bool = False
    # a request refused before its alias or adapter was resolved: the served model its name stands
    # for (an alias's target, an adapter's base model), its metric label while ``model`` keeps the name
    label_as: str | None = None
    user: str | None = None
    endpoint: str = ""
    prefill_endpoint: str | None = None
    status: int = 0
    stream: bool = False
    headers_sent: bool = False
    # the client has the whole answer (a stream's terminal event went out): a disconnect after it,
    # while the engine's end is awaited, is no cancel
    delivered: bool = False
    watchdog: WatchdogPhase | None = None     # the watchdog phase that fired, if one did
    error_class: ErrorClass | None = None
    error: str | None = None
    retries: int = 0
    ttft: float | None = None
    last_token: float | None = None           # a stream's last generated content, seconds after ``started``
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    streamed_events: int = 0                  # a relayed stream's events that carried generated content
    finish_reason: str | None = None
    # the model the engine's answer named (its ``model``: a whole answer's, a stream's decoded
    # chunks'), where the relay reads it: the trace's gen_ai.response.model
    engine_model: str | None = None
    request_id_replaced: bool = False         # the client's x-request-id could not be kept
    alias: str | None = None                  # the alias the client named; ``model`` is its target
    rate_headers: dict[str, str] | None = None   # the tenant's x-ratelimit-* (gateway/tenants), once admitted
    extra: dict[str, Any] = field(default_factory=dict)   # leg details for the log line only
    # this request among the process's (``RequestContext.start``), where two may give one request id
    serial: int = 0

    def __init__(self, request_id: str, path: str, started: float, **given: Any) -> None:
        """The dataclass's initialiser, but the defaults (and any field given by name, after them)
        each set by ``setattr`` called from C, with no interpreter step per field (a request makes one)."""
        self.request_id, self.path, self.started = request_id, path, started
        deque(map(setattr, repeat(self), *_RECORD_DEFAULTS), 0)     # the defaults, in C (``_set_fields`` inline)
        self.extra = {}
        if given:
            _set_fields(self, given.keys(), given.values())

    @property
    def label_model(self) -> str:
        """The model as a metric label: "-" until the model is known to exist."""
        if self.model_known:
            return self.model
        return self.label_as or "-"

    @property
    def label_path(self) -> str:
        """The path as a metric label: the route's template where the path holds an id."""
        return self.route or self.path

    @property
    def label_strategy(self) -> str:
        """The strategy as a metric label: its names without the weights (``strategy_label``)."""
        return strategy_label(self.strategy)

    def response_headers(self) -> dict[str, str]:
        """The headers every answer carries: request id, the chosen pods, the strategy, and the
        tenant's ``x-ratelimit-*`` once its limits were checked (what an answer sets itself wins)."""
        h = {"request-id": self.request_id, "x-request-id": self.request_id}
        if self.rate_headers:
            h.update(self.rate_headers)
        if self.endpoint:
            h["target-pod"] = self.endpoint
        if self.strategy:
            h["routing-strategy"] = _strategy_header(self.strategy)
        if self.prefill_endpoint:
            h["prefill-target-pod"] = self.prefill_endpoint
        if self.alias is not None:
            h["x-served-model"] = safe_header_value(self.model)
        if self.retries:
            h["x-retries"] = str(self.retries)
        return h


_RECORD_DEFAULTS = _plain_defaults(RequestRecord)
_SERIALS = count(1)


@dataclass(slots=True)
class RequestContext:
    http: web.Request
    rec: RequestRecord
    ireq: InferenceRequest | None = None
    decision: Decision | None = None
    charges: Charges = NO_CHARGES                     # replaced by the routing decision's (gateway/pipeline/ledger.py)
    response: web.StreamResponse | None = None       # set once the response headers went out
    trace: Trace = NO_TRACE                          # the request's trace (gateway.observability.tracing); no-op when off
    api: ApiShape | None = None                      # the request's API when not chat/completions/embeddings
    api_state: Any = None                            # what that API keeps between its hooks (gateway/apis)
    migration: Any = None                            # a stream's continuation state (gateway/pipeline/migration.py)
    pd_plan: PDPlan | None = None                    # the P/D legs in flight (gateway/pd/orchestrator.py), to abort them
    # a concurrent prefill that failed after its decode's head and before the client saw anything
    # (gateway/pd/orchestrator.py ``_late_prefill``): the request fails on it
    pd_prefill_failed: Any = None
    # the endpoints that serve the request when its API or its LoRA adapter narrowed the model's
    # (gateway/pipeline/pipeline.py ``_serving``): a P/D leg's other decode is one of them
    serving: list[Endpoint] | None = None
    # bookkeeping not needed to choose the endpoint or build the body (routing observers, prefix
    # index inserts, log fields): run by ``written`` once the first upstream leg is written
    after_write: list[Callable[[], None]] = field(default_factory=list)
    # (endpoint, header, value): legs to that endpoint name its data-parallel rank (gateway/kv/dp_rank.py)
    dp_rank: tuple[Endpoint, str, str] | None = None
    # (endpoint, the engine's estimated occupancy counting this request) when it went: admission's
    # slow start learns from its TTFT (gateway/admission/saturation.py)
    dispatched: tuple[Endpoint, float] | None = None
    # what admission put on its user's counter ahead of the answer (its expected size), settled
    # against what the engine reported when the request ends (gateway/admission/service.py)
    admission_cost: float = 0.0
    # a whole answer whose body was still in the client's transport, over its limit, when the
    # handler had it written (``Relay._ok``): the request's line waits until it went, or failed
    unsent: Any = None

    def __init__(self, http: web.Request, rec: RequestRecord, **given: Any) -> None:
        """The dataclass's initialiser, but the defaults set in one step in C (as ``RequestRecord``'s)."""
        self.http, self.rec = http, rec
        deque(map(setattr, repeat(self), *_CONTEXT_DEFAULTS), 0)
        self.after_write = []
        if given:
            _set_fields(self, given.keys(), given.values())

    @classmethod
    def start(cls, request: web.Request) -> RequestContext:
        given = request.headers.get("x-request-id")
        if given is not None:       # sent: lines giving different ids name none (given_request_id)
            given = given_request_id(request.headers)
        rid = request_id_from(given)
        # from the moment its head came whole: its handler's start, or, for a request the fast lane
        # held until its body was in (gateway/server/lane.py), the time the lane took then
        rec = RequestRecord(rid, request.path, getattr(request, "head_read", None) or time.perf_counter())
        rec.serial = next(_SERIALS)
        if given is not None and given != rid:
            rec.request_id_replaced = True
        # a request made in-process (a batch line, gateway/batch/line_request.py) adds fields to its
        # log line; an attribute, not a request key: aiohttp's mapping misses by raising KeyError
        fields = getattr(request, "log_fields", None)
        if fields:
            rec.extra.update(fields)
        return cls(request, rec)

    def written(self) -> None:
        """The first upstream leg went out (or the request ends without one): run ``after_write``."""
        later = self.after_write
        if later:
            for fn in later:
                try:
                    fn()
                except Exception:     # bookkeeping's bug must not fail the request
                    log.exception("after-write bookkeeping failed", request_id=self.rec.request_id)
            later.clear()

    def leg_headers(self, ep: Endpoint, headers: dict[str, str]) -> dict[str, str]:
        """``headers`` for a leg to ``ep``, with the rank header when the request is pinned to one of
        ``ep``'s data-parallel ranks (a retry elsewhere goes without it)."""
        pin = self.dp_rank
        if pin is None or pin[0] is not ep:
            return headers
        return {**headers, pin[1]: pin[2]}

    def use(self, ep: Endpoint) -> None:
        """``ep`` answers the request (the decode, for P/D)."""
        self.rec.endpoint = ep.name


_CONTEXT_DEFAULTS = _plain_defaults(RequestContext)

# the log line's first fields, in their order, and the record's attributes they are read from:
# ``ttft_ms`` is the TTFT in milliseconds when there is one, ``duration_ms`` the duration's (both
# set in their place by ``record_request``)
_LINE_KEYS = ("request_id", "path", "model", "user", "strategy", "endpoint", "status", "stream", "ttft_ms",
              "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "retries", "duration_ms",
              "error_class", "error")
_LINE_VALUES = attrgetter("request_id", "path", "model", "user", "strategy", "endpoint", "status", "stream", "ttft",
                          "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "retries", "started",
                          "error_class", "error")

# told of every finished request with its record and its duration in seconds (the status page's
# traffic window, gateway/observability/status.py); must be quick and must not keep the record
RecordObserver = Callable[[RequestRecord, float], None]


def _line(rec: RequestRecord, duration: float) -> dict[str, Any]:
    """The fields of ``rec``'s log line, in their order."""
    fields = dict(zip(_LINE_KEYS, _LINE_VALUES(rec), strict=True))     # read in C, in the line's order
    if rec.ttft is not None:
        fields["ttft_ms"] = round(rec.ttft * 1000, 3)
    fields["duration_ms"] = round(duration * 1000, 3)
    if rec.prefill_endpoint:
        fields["prefill_endpoint"] = rec.prefill_endpoint
    if rec.request_id_replaced:
        fields["request_id_replaced"] = True
    if rec.alias is not None:
        fields["alias"] = rec.alias
    if rec.extra:
        fields.update(rec.extra)
    # what a client wrote, bounded: a body's `user` of megabytes, or an unknown model's name (and
    # the error that repeats it), would otherwise make a log line of megabytes
    user = rec.user
    if user is not None and len(user) > MAX_LOG_CHARS:
        fields["user"] = _cut(user)
    if rec.status >= 400:
        for k in ("model", "strategy", "error"):
            v = fields[k]
            if isinstance(v, str) and len(v) > MAX_LOG_CHARS:
                fields[k] = _cut(v)
    return fields


def record_request(rec: RequestRecord, metrics: GatewayMetrics, now: float, request_log: RequestLog,
                   observers: Sequence[RecordObserver] = ()) -> None:
    """The request's metrics, its observers and its one log line."""
    m = metrics
    duration = now - rec.started
    for observe in observers:
        try:
            observe(rec, duration)
        except Exception:     # an observer's bug must not cost the request its log line
            log.exception("request observer failed", request_id=rec.request_id)
    key = (rec.model, rec.model_known, rec.status, rec.strategy)
    counted, e2e = m.finished.get(key) or m.finished_series(key, rec.label_model, rec.label_strategy)
    counted.inc()
    if e2e is not None:
        e2e.observe(duration)
    request_log.emit(_line(rec, duration))


def log_answer(rec: RequestRecord, now: float, request_log: RequestLog) -> None:
    """The log line of an answer the gateway makes before any pipeline or API handler (a CORS
    preflight's, gateway/server/edge.py): ``record_request``'s line, without its metrics and
    observers (such an answer is counted where it is made, not as a request served)."""
    request_log.emit(_line(rec, now - rec.started))


# the answer the edge wrote itself to a request whose handler it then cancelled (its body stopped
# coming or broke, gateway/server/edge.py): (the request id the answer carries, its status, its message)
EDGE_ANSWER = web.RequestKey("edge_answer", tuple)


def take_edge_answer(request: Any, rec: RequestRecord) -> bool:
    """Whether the edge answered ``request`` while its handler ran and then cancelled it: ``rec``, the
    handler's record, then says that answer (its request id, status, ``error_class: http``, message)
    and the handler's line, with ``method`` as the edge's own lines, is the request's one line, not a
    client's cancel (read on a cancellation only, never on a request served)."""
    answer = request.pop(EDGE_ANSWER, None)
    if answer is None:
        return False
    rec.request_id, rec.status, rec.error = answer
    rec.error_class = ErrorClass.HTTP
    request.get(TRACE_KEY, NO_TRACE).edge_answered(rec.status)     # the span says that answer too
    rec.extra["method"] = request.method        # as the edge's own lines
    return True


def _cut(v: str) -> str:
    return f"{v[:MAX_LOG_CHARS]}… ({len(v)} characters)"


def watch_client(request: object) -> None:
    """A stream began: the edge looks at its client while it runs (``EdgeProtocol.watch_stream``),
    to cut one that stopped reading before the send buffer fills."""
    watch = getattr(getattr(request, "protocol", None), "watch_stream", None)
    if watch is not None:
        watch()
