"""The Responses API (``/v1/responses``): routed, streamed and accounted like chat, and stateful
across the fleet.

``POST /v1/responses`` goes through the pipeline like chat (``ResponsesApi`` is its per-API object:
parse, error shapes, stream scanner, state hooks). The calls on a stored response,
``GET``/``DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and
``GET /v1/responses/{id}/input_items``, are served here (``add_responses`` registers them).

State, by ``responses.state``:

* ``engine`` (default): an engine keeps the responses it produced (vLLM in process, SGLang too),
  so a follow-up must reach that engine. After each answer the gateway records response id →
  endpoint (the *affinity map*: in memory, or in Redis when ``state.redis_url`` is set, so every
  replica knows); ``previous_response_id`` and the calls on an id are sent to that endpoint. An id
  the map does not know is a 404 (a follow-up's is OpenAI's 400 ``previous_response_not_found``); an owner that left the pool is a 409, one that is not ready a 503.
* ``gateway``: the gateway stores each response's input and output items (memory or Redis, TTL and
  size caps) and expands ``previous_response_id`` into ``input`` itself, so any endpoint can serve
  the follow-up (prefix-cache routing keeps a conversation together while it can) and a
  conversation survives its engine's restart. Engines are asked not to store (``store: false``).
  ``GET``/``DELETE``/``input_items`` are answered from that store.

With API keys on, a stored id belongs to the user whose key created it: another user's calls on
it are answered as for an unknown id.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
import structlog
from aiohttp import web
from prometheus_client import Counter, Gauge

from gateway.apis.base import ApiShape
from gateway.apis.responses_request import (
    RESPONSES,
    chain_ids,
    check_unique_ids,
    input_items,
    output_as_input,
    parse_responses,
    unique_items,
    with_history,
)
from gateway.apis.responses_state import (
    AskSiblings,
    MemoryStore,
    RedisStore,
    StoreUnavailable,
    WorkerStore,
    sibling_key_ok,
)
from gateway.apis.responses_stream import ResponsesScanner, error_event, failed_after_error, failure
from gateway.config.schema import Config
from gateway.endpoints import Endpoint, EndpointPool, engine_headers
from gateway.errors import ErrorClass, GatewayError, error_response, normalize_upstream_error
from gateway.observability.logs import RequestLog
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.tracing import NO_TRACE, TRACE_KEY, Leg
from gateway.pipeline.context import (
    RecordObserver,
    RequestContext,
    RequestRecord,
    record_request,
    safe_header_value,
    take_edge_answer,
    watch_client,
)
from gateway.pipeline.ledger import InFlight
from gateway.request import given_request_id, request_id_from
from gateway.resilience.outcome import key_refused
from gateway.state.redis import redis_client
from gateway.tenants import TICKET, Tenancy, Ticket
from gateway.upstream.upstream import (
    engine_key_refused,
    key_refused_error,
    local_failure,
    no_socket_error,
    too_large_error,
)
from handlers import adapter_for
from routers.session_map import RESPONSE, SessionMap

if TYPE_CHECKING:
    from gateway.admission.service import Admission

log = structlog.get_logger("switchyard.responses")
UNREACHABLE_LOG_S = 10.0
# the route of a stored response's calls, and their path label in the metrics (with /cancel, /input_items)
BY_ID = RESPONSES + "/{response_id}"

_PD_ROLES = ("prefill", "decode")
# the owners' store key of what a background response owes its user's TPM window until a read finds
# it ended (a response id, a path segment, holds no "/": no call on a response names one)
OWED = "owed/"
# the history store's mark of a response deleted while its stream ran (``_mark_gone``): the record
# its stream writes as it ends is removed again when it finds one (it lives the history's TTL)
GONE = "gone/"
# a response's states after which it generates nothing more
_ENDED = ("completed", "incomplete", "failed", "cancelled")
# a background response answered queued is polled on its engine until it ends (its user's
# concurrency slot held until then, its usage charged then): every 0.25 s at first, doubling to
# every 2 s; the slot is given back after WATCH_MAX_S whatever its state, after WATCH_FAILURES polls
# in a row its engine did not answer, when its engine no longer knows it (404), or as soon as its
# engine is known down (``on_health``, a poll unanswered while the endpoint is held out)
WATCH_FIRST_S = 0.25
WATCH_EVERY_S = 2.0
WATCH_MAX_S = 3600.0
WATCH_FAILURES = 10
MAX_WATCHED = 10_000               # background responses one worker polls at once


@dataclass(slots=True)
class Exchange:
    """What one ``POST /v1/responses`` keeps between its hooks."""

    input: list[Any] = field(default_factory=list)      # the full input sent (gateway-held history)
    store: bool = True                                   # the client's ``store`` (the engine is sent false)
    scanner: ResponsesScanner | None = None
    body: dict[str, Any] | None = None                   # a non-streaming answer
    failed: dict[str, Any] | None = None                 # the response as a stream the gateway failed ended it
    owner: dict[str, Any] | None = None                  # the previous response's owner record (engine state)
    reshaped: bool = False                               # the answer's usage renamed (SGLang's chat usage)
    chain: list[str] = field(default_factory=list)       # item ids of the turns before (gateway-held history)
    place: InFlight | None = None                        # a cut background stream's place, for its poll
    running: str | None = None                           # the id of its stored stream, while it runs
    deleted: bool = False                                # that stream deleted while it ran: not kept
    placeholder: asyncio.Task | None = None              # its record in progress being written (Redis history)
    contested: bool = False                              # a DELETE elsewhere may race its end: check for GONE


class ResponsesMetrics:
    def __init__(self, registry) -> None:
        self.lookups = Counter("switchyard_responses_state_lookups",
                               "Responses state lookups (kind: affinity map or history) by result (sibling: "
                               "found in another worker's memory, also counted as a hit)",
                               ["kind", "result"], registry=registry)
        self.writes = Counter("switchyard_responses_state_writes",
                              "Responses state writes by result (too_large: over history.max_response_bytes)",
                              ["kind", "result"], registry=registry)
        self.owner_gone = Counter("switchyard_responses_owner_unavailable",
                                  "Follow-ups refused because the endpoint holding the response left the pool "
                                  "(left_pool, 409) or is not ready (not_ready, 503)",
                                  ["model", "reason"], registry=registry)
        self.entries = Gauge("switchyard_responses_state_entries",
                             "Entries held by the in-memory Responses state, by kind", ["kind"], registry=registry)


async def _as_previous(rid: str, lookup: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """A lookup of a request's ``previous_response_id``: an id not held (never seen, expired,
    ``store: false``, deleted, another user's) is OpenAI's answer to it, a 400
    ``previous_response_not_found`` naming that field, the code agents look for to send the whole
    conversation again (a GET of such an id stays a 404)."""
    try:
        return await lookup
    except GatewayError as e:
        if e.status != 404:
            raise
        raise _previous_not_found(rid, e.error_class) from None


def _previous_not_found(rid: str, error_class: ErrorClass) -> GatewayError:
    return GatewayError(400, f"Previous response with id '{rid}' not found.", param="previous_response_id",
                        code="previous_response_not_found", error_class=error_class)


def _not_failed(rid: str, response: Any) -> None:
    """A follow-up's previous response must not have failed: its output is cut short or missing."""
    if isinstance(response, dict) and response.get("status") == "failed":
        raise GatewayError(400, f"Previous response with id '{rid}' failed; it cannot be continued. Send the "
                           "conversation again without it.", param="previous_response_id",
                           code="invalid_value", error_class=ErrorClass.VALIDATION)


def _not_running(rid: str, response: Any) -> None:
    """A follow-up's previous response must have ended: one still generating (its record in
    progress, written as its stream started on another replica) has no output yet to continue."""
    if isinstance(response, dict) and response.get("status") == "in_progress":
        raise GatewayError(400, f"Previous response with id '{rid}' is still in progress; continue it once it "
                           "has ended.", param="previous_response_id", code="invalid_value",
                           error_class=ErrorClass.VALIDATION)


def _not_streamed(query: Any) -> None:
    """A GET with ``stream=true`` replays a background stream's events; a response the gateway
    answers itself (a failed one, gateway-held history) was never one, as a background response is
    left to its engine, nor is one an engine that streams none holds (SGLang, which reads no query):
    refused as OpenAI and vLLM refuse it, where its JSON read as an empty stream."""
    if query.get("stream", "").lower() in ("true", "1", "yes", "on"):
        raise GatewayError(400, "stream=true replays a response's events only when it was created with "
                           "background=true; leave stream out to read this one.", param="stream",
                           error_class=ErrorClass.VALIDATION)


def _answered_before_start(record: dict[str, Any], ep: Endpoint) -> bool:
    """Whether a stored response was answered before the start of the engine running at ``ep`` now
    (its scraped ``process_start_time_seconds``): by the record's wall-clock time, as the routing
    view dates a replica's facts, else (a record without it) by the response's ``created_at``, the
    engine's clock in whole seconds, so one within a second of the start is taken as after it."""
    started = ep.metrics.start_time if ep.metrics is not None else None
    if started is None:
        return False
    at = record.get("at")
    if at.__class__ is float:
        return at < started
    response = record.get("response")
    created = response.get("created_at") if isinstance(response, dict) else None
    return created.__class__ in (int, float) and created + 1.0 < started


# what a 503 says of a store that answered but refused the call (``StoreUnavailable.reason``): it is
# not unreachable. Nothing of the key's name or of what it holds: those are the operator's
_REFUSED = {
    "wrongtype": "the Responses state store holds a key of another type under this response's name (not a "
                 "record the gateway wrote), so it refuses the gateway's command",
    "noperm": "the Responses state store refuses the gateway's command (its ACL user lacks a permission)",
    "readonly": "the Responses state store refuses writes (a read-only replica)",
    "oom": "the Responses state store refuses writes (out of memory)",
    "misconf": "the Responses state store refuses writes (its RDB save failed)",
    "noreplicas": "the Responses state store refuses writes (fewer replicas than min-replicas-to-write)",
    "auth": "the Responses state store refuses the gateway's credentials (a wrong password or user, or none)",
}


# what a 503 says of a store out of reach (the reasons a call that got no answer has)
_OUT_OF_REACH = {
    "unreachable": "the Responses state store is unreachable",
    "no_tls": "the Responses state store is unreachable: it gave no TLS handshake answer",
    "tls_verify": "the Responses state store is unreachable: its TLS certificate fails verification",
}


# a deletion sent to the store that got no answer (a timeout, a lost connection)
_DELETION_UNKNOWN = ("the Responses state store did not answer the deletion: whether the response was deleted is "
                     "unknown; send the DELETE again (a 404 then means it is deleted)")


def _store_unreachable(e: StoreUnavailable | None = None) -> GatewayError:
    """The 503 of a call that met the state store unreachable, or refusing it, at its lookup or at
    its deletion."""
    reason = e.reason if e is not None else "unreachable"
    message = _REFUSED.get(reason) or _OUT_OF_REACH.get(reason) or "the Responses state store answers an error"
    return GatewayError(503, message, code="service_unavailable",
                        headers={"Retry-After": "1"}, header=("x-error-state-unavailable", "true"),
                        error_class=ErrorClass.STATE_UNAVAILABLE)


def _not_found(rid: str) -> GatewayError:
    return GatewayError(404, f"Response with id '{rid}' not found.", param="response_id", code="response_not_found",
                        error_class=ErrorClass.RESPONSE_NOT_FOUND)


class ResponsesApi(ApiShape):
    name = "responses"
    paths = (RESPONSES,)
    object_answers = True

    def __init__(self, config: Config, pool: EndpointPool, metrics: GatewayMetrics, request_log: RequestLog,
                 tenancy: Tenancy | None, observers: list[RecordObserver]) -> None:
        self.config = config
        self.cfg = cfg = config.responses
        self.pool = pool
        self.metrics = metrics
        self.request_log = request_log
        self.tenancy = tenancy
        # admission control, whose bounds a background response counts against until it ends
        self.admission: Admission | None = None
        self.observers = observers
        self.gateway_held = cfg.state == "gateway"
        self.auth_on = config.auth.on
        self.m = ResponsesMetrics(metrics.registry)
        self.session: aiohttp.ClientSession | None = None
        self._early: set[asyncio.Task] = set()         # owners written at a background stream's first event
        # stored streams still running, not background (their engine keeps them once they end, the
        # gateway's record is written then): id → the request's context, whose announced response
        # answers a GET of it until then (``_in_progress``), on this worker or asked by a sibling
        self._running: dict[str, RequestContext] = {}
        self._ask: AskSiblings | None = None
        self._watched: set[asyncio.Task] = set()       # background responses polled until they end
        self._places: set[InFlight] = set()            # their places on their endpoints (admission's)
        self._slots: set[_Slot] = set()                # their users' concurrency slots, held until they end
        self._unreachable_at = -UNREACHABLE_LOG_S      # the store's failures, logged at most this often
        self._unreachable_quiet = 0
        self._unreadable_at = -UNREACHABLE_LOG_S       # records that are not the gateway's, logged so too
        # response id → the endpoint that answered it (``r:<id>``), in both state modes: the routing
        # view's session map (gateway/view shares it with sibling workers and replicas), where
        # prefix-cache finds a follow-up's engine and, in engine mode with the memory backend, a
        # sibling worker's response is found
        self.lineage = SessionMap(cfg.affinity_ttl_s, cfg.max_affinity_entries)
        use_redis = cfg.backend == "redis" or (cfg.backend == "auto" and config.state.redis_url is not None)
        self.backend = "redis" if use_redis else "memory"
        self.owners: MemoryStore | RedisStore | WorkerStore
        self.history: MemoryStore | RedisStore | WorkerStore | None = None
        if use_redis:
            st = config.state
            client = redis_client(st, on_pool_timeout=metrics.state_pool_timeouts.labels("responses").inc)
            prefix = f"{st.key_prefix}:resp:"
            self.owners = RedisStore(client, prefix + "owner:", cfg.affinity_ttl_s, st.timeout_s, owns_client=True)
            if self.gateway_held:
                self.history = RedisStore(client, prefix + "hist:", cfg.history.ttl_s, st.timeout_s)
        else:
            self.owners = MemoryStore(cfg.affinity_ttl_s, cfg.max_affinity_entries)
            self.m.entries.labels("affinity").set_function(lambda: len(self.owners))
            if self.gateway_held:
                h = cfg.history
                self.history = MemoryStore(h.ttl_s, 1 << 62, h.max_total_bytes)
                self.m.entries.labels("history").set_function(lambda: len(self.history))

    def share_with_siblings(self, ask: AskSiblings, workers: int) -> None:
        """Several workers (gateway/server/siblings.py): the memory backend's misses are asked of the
        other workers, and deletes reach them, so a response is found whichever worker a request
        reaches. Its bounds are the gateway's, so each of the ``workers`` keeps its share of them
        (a history share never below one record of ``max_response_bytes``). Redis is shared already."""
        if workers > 1:
            self._ask = ask
        if self.backend != "memory":
            return
        n = max(1, workers)
        if isinstance(self.owners, MemoryStore):
            self.owners.max_entries = -(-self.cfg.max_affinity_entries // n)
        if isinstance(self.history, MemoryStore):
            h = self.cfg.history
            self.history.max_bytes = max(-(-h.max_total_bytes // n), h.max_response_bytes)
        if isinstance(self.owners, MemoryStore):
            self.owners = WorkerStore(self.owners, "owner", ask, self.m.lookups.labels("affinity", "sibling").inc)
        if isinstance(self.history, MemoryStore):
            self.history = WorkerStore(self.history, "hist", ask, self.m.lookups.labels("history", "sibling").inc)

    async def answer_sibling(self, question: str) -> bytes:
        """A sibling worker's ``rget|rdel <owner|hist> <response id>`` about this worker's entries,
        or ``rget|rdel run <response id>`` about its stored streams still running."""
        op, _, rest = question.partition(" ")
        name, _, key = rest.partition(" ")
        if name == "run":
            if op == "rdel":
                return b"1" if self._drop_running(key) else b""
            ctx = self._running.get(key) if op == "rget" else None
            if ctx is None:
                return b""
            self._exchange(ctx).contested = True    # the sibling may delete it as it ends here
            return orjson.dumps(self._running_record(ctx))
        store = {"owner": self.owners, "hist": self.history}.get(name)
        if op not in ("rget", "rdel") or not isinstance(store, WorkerStore) or not key:
            return b""
        return await store.answer(op, key)

    def reconfigure(self, config: Config) -> None:
        """A reloaded config (gateway/server/reload.py): whether ids belong to users follows ``auth``; the
        ``responses`` block and its stores need a restart, so they stay as started."""
        self.config = config
        self.auth_on = config.auth.on

    def describe(self) -> dict[str, Any]:
        return {"state": self.cfg.state, "backend": self.backend}

    # -- the per-API object of POST /v1/responses ---------------------------------------------

    def parse(self, path: str, body: bytes, headers: Any, request_id: str):
        return parse_responses(path, body, headers, request_id)

    def _exchange(self, ctx: RequestContext) -> Exchange:
        if not isinstance(ctx.api_state, Exchange):
            ctx.api_state = Exchange()
        return ctx.api_state

    def upstream_error(self, status: int, raw: bytes, ctx: Any = None) -> tuple[int, bytes, str]:
        """Engine state: the engine a follow-up was sent to no longer holds its previous response (it
        restarted, its store gone): its 404 naming that id is OpenAI's answer to a previous response
        it does not hold, the 400 ``previous_response_not_found`` the gateway gives an id it does not
        hold itself, where the engine's carried its own code (vLLM: the number 404) and no param."""
        status, body, message = super().upstream_error(status, raw)
        ireq = ctx.ireq if ctx is not None else None
        prev = ireq.data.get("previous_response_id") if ireq is not None else None
        if status == 404 and prev.__class__ is str and prev and prev in message:
            e = _previous_not_found(prev, ErrorClass.UPSTREAM_STATUS)
            return e.status, e.body_bytes(), e.message
        return status, body, message

    def scanner(self, ctx: RequestContext) -> ResponsesScanner:
        ex = self._exchange(ctx)
        background = ctx.ireq is not None and ctx.ireq.data.get("background") is True
        early = not self.gateway_held and ex.store and background
        s = ex.scanner = ResponsesScanner(partial(self._created, ctx, early, ex.store and not background))
        return s

    def _created(self, ctx: RequestContext, early: bool, running: bool, rid: str) -> None:
        """The id the stream's ``response.created`` gave: the request's log line names it from
        now on (a stream its client leaves included: the client knows the id). A background
        stream goes on on its engine when its client leaves, and is resumed by a GET
        (``?stream=true&starting_after=``): its owner is recorded now (``early``), not only once
        it ends on this connection. Another stored stream (``running``) is answered in progress
        by a GET until it ends (``_in_progress``)."""
        ctx.rec.extra["response_id"] = safe_header_value(rid)
        if early:
            self._owner_early(ctx, rid)
        elif running and len(rid) <= 256:
            ex = self._exchange(ctx)
            if ex.running is not None:
                self._running.pop(ex.running, None)
            ex.running = rid
            self._running[rid] = ctx
            if self.backend == "redis" and ex.placeholder is None:
                # other replicas do not ask this one: they read the response in progress from the
                # store, where its record at the end replaces it (``_keep``, ``_record_owner``), or
                # ``ending`` removes it
                ex.placeholder = asyncio.get_running_loop().create_task(self._place(ctx, rid))
                ex.contested = self.gateway_held

    def _owner_early(self, ctx: RequestContext, rid: str) -> None:
        task = asyncio.get_running_loop().create_task(self._record_owner(ctx, rid))
        self._early.add(task)
        task.add_done_callback(self._early.discard)
        t = ctx.http.get(TICKET) if self.tenancy is not None else None
        if t is not None and t.user is not None and len(rid) <= 200:
            t.settled = partial(self._owe_if_cut, ctx, rid, t)

    def _owe_if_cut(self, ctx: RequestContext, rid: str, t: Ticket, charged: int, held: bool) -> bool:
        """A background stream settled: one cut before its terminal event (its client left, its
        connection to the engine broke) goes on on its engine, and owes the rest of its usage; it
        is polled until it ends, keeping its concurrency slot (``held``) until then (True), and the
        place on its endpoint ``ending`` kept for it."""
        ex = ctx.api_state
        place = None
        if isinstance(ex, Exchange):
            place, ex.place = ex.place, None
            if ex.scanner is not None and ex.scanner.done:
                self._give_back(place)
                return False                # its usage came with its end, and was charged
        owe = self._owe(rid, t, charged)
        if ctx.decision is not None and self._start_watch(rid, ctx.decision.endpoint, t, held, owe, place=place):
            return held
        self._give_back(place)
        task = asyncio.get_running_loop().create_task(owe)
        self._early.add(task)
        task.add_done_callback(self._early.discard)
        return False

    def ending(self, ctx: RequestContext) -> None:
        """A background stream cut before its terminal event (its client left, its connection to
        the engine broke) goes on on its engine: where admission control is on for its model it
        keeps a place among the gateway's requests on its endpoint, taken here before its request
        gives back its own, until the poll of it finds it ended. The poll is the one its user's
        settlement starts (``_owe_if_cut``), or, with nothing of it for tenancy to hold or charge,
        one started here for the place alone."""
        ex, ireq, d = ctx.api_state, ctx.ireq, ctx.decision
        if isinstance(ex, Exchange) and ex.running is not None:
            if self._running.get(ex.running) is ctx:
                del self._running[ex.running]
            ex.running = None
        if isinstance(ex, Exchange) and ex.placeholder is not None and ex.scanner is not None \
                and ex.scanner.response_id:
            # its record in progress, not replaced by its record (cut, not kept, deleted): removed
            task = asyncio.get_running_loop().create_task(self._unplace(ex.placeholder, ex.scanner.response_id))
            self._early.add(task)
            task.add_done_callback(self._early.discard)
            ex.placeholder = None
        if not isinstance(ex, Exchange) or ex.scanner is None or ex.scanner.done or ireq is None or d is None \
                or ireq.data.get("background") is not True or self.admission is None:
            return
        rid = ex.scanner.response_id
        if not rid or len(rid) > 200 or self.admission.settings(ireq.model) is None:
            return
        place = InFlight(d.endpoint)
        t = ctx.http.get(TICKET) if self.tenancy is not None else None
        if t is not None and t.settled is not None:
            ex.place = place                # its settlement's poll takes it
        elif not self._start_watch(rid, d.endpoint, None, False, place=place):
            place.release()                 # before its request's own: the queue is pumped after both

    def _give_back(self, place: InFlight | None) -> None:
        """A background response's place on its endpoint, given back, and the queue pumped for it."""
        if place is None or place.released:
            return
        place.release()
        if self.admission is not None:      # room for the model's queue
            self.admission.on_endpoint(place.endpoint)

    def stream_error(self, ctx: RequestContext, status: int, message: str, code: str | None) -> bytes:
        ex = self._exchange(ctx)
        if ex.scanner is not None and ex.scanner.snapshot is not None and ctx.ireq is not None \
                and ctx.ireq.data.get("background") is True:
            # a background response goes on on its engine, whatever became of this connection to it:
            # the error alone ends the client's stream (it resumes with a GET), where response.failed
            # would say the response failed while it completes
            ex.failed = None
            return error_event(ex.scanner.events, message, code)
        events, ex.failed = failure(ex.scanner, ctx.rec.model, status, message, code)
        return events

    def stream_errored(self, ctx: RequestContext) -> bytes:
        """The engine's own ``error`` event ended the stream, without a terminal event: the client is
        owed ``response.failed`` (every failed Responses stream ends with one), and the failed
        response is kept, as for a stream the gateway failed."""
        ex = self._exchange(ctx)
        ended = failed_after_error(ex.scanner) if ex.scanner is not None else None
        if ended is None:
            return b""
        events, ex.failed = ended
        return events

    async def failed(self, ctx: RequestContext) -> None:
        """A stream the gateway ended with ``response.failed``: that failed response is kept, as
        OpenAI keeps a response that failed, so a GET of its id says so (gateway state: its history
        record; engine state: the affinity record, since the engine never learnt of the failure).
        A background response its engine announced is its engine's: it goes on there, and its
        engine answers for it.
        One deleted while it ran (``_drop_running``) is not kept, failed or not."""
        ex = ctx.api_state
        if not isinstance(ex, Exchange) or ex.failed is None or not ex.store or ex.deleted or ctx.ireq is None:
            return
        snap = ex.failed
        rid = snap.get("id")
        if not isinstance(rid, str) or not rid:
            return
        ctx.rec.extra["response_id"] = safe_header_value(rid)
        if self.gateway_held:
            await self._keep(ctx, rid, snap)
        elif ctx.ireq.data.get("background") is not True or ex.scanner is None or ex.scanner.snapshot is None:
            # (a background response its engine never announced has the gateway's id: no engine holds it)
            ep = ctx.decision.endpoint if ctx.decision is not None else None
            await self._placed(ex)
            await self._write(self.owners, "affinity", rid, orjson.dumps(
                {"url": ep.url if ep is not None else None, "model": ctx.ireq.model,
                 "user": self._owner_user(ctx.rec.user), "failed": snap}))
            ex.placeholder = None

    async def closed_early(self, ctx: RequestContext) -> bool:
        """A background stream its engine closed before its terminal event: one whose response was
        cancelled meanwhile (by any client, through any worker or replica) ends so on its engine,
        vLLM's closing the stream of a background task it cancels. Its engine, asked, holds it
        ``cancelled``: the stream ended with its response, no failure of the engine's."""
        ex, ireq, d = ctx.api_state, ctx.ireq, ctx.decision
        if not isinstance(ex, Exchange) or ex.scanner is None or ireq is None or d is None \
                or ireq.data.get("background") is not True:
            return False
        rid = ex.scanner.response_id
        if not rid or len(rid) > 200 or not await self._cancelled(d.endpoint, rid):
            return False
        ex.scanner.finish_reason = "cancelled"      # the stream's, its record's when it is observed
        return True

    async def _cancelled(self, ep: Endpoint, rid: str) -> bool:
        """Whether the engine at ``ep`` holds response ``rid`` cancelled, asked within a health
        probe's bound (``health.timeout_s``): the stream it closed waits on the answer."""
        try:
            async with asyncio.timeout(self.config.health.timeout_s):
                copy = await self._engine_copy(ep, rid)
        except TimeoutError:
            return False
        return copy is not None and copy.get("status") == "cancelled"

    def body_usage(self, ctx: RequestContext, data: dict[str, Any]) -> dict | None:
        self._exchange(ctx).body = data
        status = data.get("status")
        details = data.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        ctx.rec.finish_reason = reason if isinstance(reason, str) else status if isinstance(status, str) else None
        usage = data.get("usage")
        if not isinstance(usage, dict):
            return None
        renamed = responses_usage(usage)
        if renamed is not None:
            data["usage"] = usage = renamed
            self._exchange(ctx).reshaped = True
        return usage

    def answer_body(self, ctx: RequestContext, data: dict[str, Any], body: bytes) -> bytes:
        return orjson.dumps(data) if self._exchange(ctx).reshaped else body

    def _owner_user(self, user: str | None) -> str | None:
        return user if self.auth_on else None

    def when_queued(self, ctx: RequestContext) -> Callable[[Endpoint], bool] | None:
        """Any endpoint of the model, unless an engine holds the previous response: then only it;
        a background stream's, those whose engine streams one."""
        assert ctx.ireq is not None
        if not self.gateway_held and ctx.ireq.data.get("previous_response_id") is not None:
            return None
        return _streams_background if _background_stream(ctx.ireq) else _any_endpoint

    async def prepare(self, ctx: RequestContext, candidates: list[Endpoint]) -> list[Endpoint]:
        ireq, rec = ctx.ireq, ctx.rec
        assert ireq is not None
        if any(ep.role in _PD_ROLES for ep in candidates):
            raise GatewayError(400, "the Responses API is not served through prefill/decode disaggregation "
                               "(the engines take no kv_transfer_params on /v1/responses); use a model with "
                               "aggregated endpoints or another routing strategy", header=("x-error-routing", "true"),
                               error_class=ErrorClass.VALIDATION)
        ex = self._exchange(ctx)
        ex.store = ireq.data.get("store") is not False
        prev = ireq.data.get("previous_response_id")
        if prev is not None:
            rec.extra["previous_response_id"] = safe_header_value(prev)
        if self.gateway_held:
            if ireq.data.get("background"):
                raise GatewayError(400, "'background' needs responses.state: engine (the gateway holds the "
                                   "history of completed responses only)", param="background", error_class=ErrorClass.VALIDATION)
            history: list[Any] = []
            chain: set[str] = set()
            if prev is not None:
                record = await _as_previous(prev, self._record(prev, rec.user))
                _not_failed(prev, record.get("response"))
                _not_running(prev, record.get("response"))
                history = unique_items(list(record.get("input") or ()) + output_as_input(record.get("output")))
                chain = chain_ids(record)
                self._follow(prev, record, ireq.model, candidates)
            check_unique_ids(chain, input_items(ireq.data["input"]))
            ex.chain = sorted(chain)
            ex.input = with_history(ireq, history)
            return candidates
        if prev is None:
            return self._background_streamers(ireq, candidates) if _background_stream(ireq) else candidates
        owner = await _as_previous(prev, self._owner(prev, rec.user))
        _not_failed(prev, owner.get("failed"))
        _not_running(prev, owner.get("running"))
        if owner["model"] != ireq.model:
            raise GatewayError(400, f"Response '{prev}' was produced by model '{owner['model']}'; continue it "
                               "with the same model", param="previous_response_id", error_class=ErrorClass.VALIDATION)
        ep = self._owner_endpoint(prev, owner)
        if owner.get("background") is True and ep.ready:
            # a background response ends on its engine out of the gateway's sight (one answered
            # queued, one whose stream its client left): a failed one is refused as every other is
            _not_failed(prev, await self._engine_copy(ep, prev))
        if _background_stream(ireq) and not _streams_background(ep):
            raise _no_background_stream(f"the endpoint {ep.name} that holds response '{prev}' runs {ep.engine}, "
                                        "which")
        if ep not in candidates:
            raise self._owner_not_ready(prev, owner, ep)
        ex.owner = owner
        return [ep]

    def _background_streamers(self, ireq: Any, candidates: list[Endpoint]) -> list[Endpoint]:
        """A background stream's candidates: those whose engine streams one (SGLang answers a
        background request whole, and replays none), a 400 naming ``background`` for a model none
        of whose endpoints does, a 503 when none of those is ready."""
        ok = [ep for ep in candidates if _streams_background(ep)]
        if ok:
            return ok
        eps = self.pool.endpoints(ireq.model)
        if not any(_streams_background(ep) for ep in eps):
            engines = ", ".join(sorted({ep.engine for ep in eps}))
            raise _no_background_stream(f"model '{ireq.model}' is served by {engines}, which")
        raise GatewayError(503, f"no ready endpoint of model {ireq.model} streams a background response",
                           code="service_unavailable", headers={"Retry-After": "5"},
                           header=("x-error-no-model-backends", "true"), error_class=ErrorClass.NO_ENDPOINT)

    def unserved_while_queued(self, ctx: RequestContext) -> GatewayError | None:
        """A follow-up that waited while the engine holding its previous response left the pool (409)
        or went unready (503): what it would be told arriving now."""
        ex = ctx.api_state
        owner = ex.owner if isinstance(ex, Exchange) else None
        if owner is None or ctx.ireq is None:
            return None
        prev = ctx.ireq.data.get("previous_response_id")
        try:
            ep = self._owner_endpoint(prev, owner)
        except GatewayError as e:
            return e
        return self._owner_not_ready(prev, owner, ep)

    def _owner_not_ready(self, prev: str, owner: dict[str, Any], ep: Endpoint) -> GatewayError:
        self._gone(owner["model"], "not_ready")
        return GatewayError(503, f"the endpoint {ep.name} that holds response '{prev}' is not ready "
                            "(unhealthy or draining); retry later", code="response_owner_unavailable",
                            headers={"Retry-After": "5"}, error_class=ErrorClass.RESPONSE_OWNER_UNAVAILABLE)

    async def finish(self, ctx: RequestContext) -> None:
        """Record what the answer created: its owner (engine state) or its history (gateway state)."""
        ex = ctx.api_state
        if not isinstance(ex, Exchange):
            return
        final = ex.scanner.final if ex.scanner is not None else ex.body
        rid = ex.scanner.response_id if ex.scanner is not None else (ex.body or {}).get("id")
        if not isinstance(rid, str) or not rid:
            return
        rec, ireq = ctx.rec, ctx.ireq
        assert ireq is not None
        rec.extra["response_id"] = safe_header_value(rid)
        user = self._owner_user(rec.user)
        if not ex.store or ex.deleted:
            # nothing kept (or deleted while it ran), so nothing to continue: no lineage either,
            # which the memory backend's owner lookup falls back to and would send a follow-up or a
            # GET to the engine; its record in progress removed before its last event goes out
            if ex.placeholder is not None:
                placed, ex.placeholder = ex.placeholder, None
                await self._unplace(placed, rid)
            return
        if self.gateway_held:
            assert self.history is not None
            if ctx.decision is not None and len(rid) <= 256:
                self.lineage.put(RESPONSE + rid, ctx.decision.endpoint, user)
            if isinstance(final, dict) and final.get("status") in ("completed", "incomplete", "failed"):
                await self._keep(ctx, rid, final)
            return
        # a response its engine failed is recorded so (its engine's own error, kept as it ended),
        # as the gateway's failed ones are: a follow-up naming it is refused, whatever the engine does
        failed = final if isinstance(final, dict) and final.get("status") == "failed" and \
            ireq.data.get("background") is not True else None
        await self._record_owner(ctx, rid, failed)
        if ex.scanner is None and ireq.data.get("background") is True \
                and isinstance(ex.body, dict) and ex.body.get("status") in ("queued", "in_progress"):
            if self.tenancy is not None:
                await self._owe_usage(ctx, rid)
            self._watch_background(ctx, rid)

    def _watch_background(self, ctx: RequestContext, rid: str) -> None:
        """A background response answered ``queued`` goes on generating on its engine: it keeps its
        request's concurrency slot (the ticket's, given back at settlement no more) and, where
        admission control is on for its model, a place among the gateway's requests on its endpoint
        (``max_in_flight_per_endpoint``, the engine's estimated queue), and is polled on its engine
        until it ends, when both are given back and its usage charged, if no read charged it first
        (``_charge_ended``: the owed entry's delete decides, once)."""
        if ctx.decision is None or len(rid) > 200:
            return
        t = ctx.http.get(TICKET) if self.tenancy is not None else None
        if t is not None and t.user is None:
            t = None
        ep = ctx.decision.endpoint
        occupy = self.admission is not None and ctx.ireq is not None \
            and self.admission.settings(ctx.ireq.model) is not None
        if self._start_watch(rid, ep, t, t is not None and t.held, occupy=occupy) and t is not None:
            t.held = False

    def _start_watch(self, rid: str, ep: Endpoint, t: Ticket | None, hold: bool,
                     first: Awaitable[None] | None = None, occupy: bool = False,
                     place: InFlight | None = None) -> bool:
        """The poll of a background response still generating, started (True) unless a worker polls
        ``MAX_WATCHED`` already or there is nothing to hold or charge (no concurrency slot, no TPM
        window: its reads charge it; no place on its endpoint, ``occupy``, admission being off).
        ``first`` (its owed entry's write) is awaited before the poll. With ``occupy`` the response
        counts among the gateway's requests on ``ep`` until the poll ends, taken here, before its
        request gives back its own; ``place``, one taken already, is the poll's to give back once
        it started (the caller's otherwise)."""
        if t is None or t.user is None:
            hold = False
        owes = t is not None and t.user is not None and (hold or (t.limits is not None and t.limits.tpm))
        if len(self._watched) >= MAX_WATCHED or not (owes or occupy or place is not None):
            return False
        if place is None and occupy:
            place = InFlight(ep)
        user = t.user if t is not None else None
        task = asyncio.get_running_loop().create_task(self._watch(rid, ep, user, hold, first, place, owes))
        self._watched.add(task)
        task.add_done_callback(self._watched.discard)
        return True

    async def _watch(self, rid: str, ep: Endpoint, user: str | None, hold: bool,
                     first: Awaitable[None] | None = None, place: InFlight | None = None,
                     owes: bool = True) -> None:
        assert self.session is not None
        delay, failures = WATCH_FIRST_S, 0
        deadline = time.monotonic() + WATCH_MAX_S
        url = f"{ep.url}{RESPONSES}/{rid}"
        if place is not None:
            self._places.add(place)
        slot = _Slot(ep, user) if hold and user is not None and self.tenancy is not None else None
        if slot is not None:
            self._slots.add(slot)
        try:
            if first is not None:
                owe, first = first, None
                await owe
            while time.monotonic() < deadline and failures < WATCH_FAILURES:
                await asyncio.sleep(delay)
                delay = min(delay * 2, WATCH_EVERY_S)
                try:
                    async with self.session.get(url, headers=engine_headers(ep, {})) as r:
                        if r.status == 404:
                            return          # its engine no longer holds it (restarted, deleted)
                        raw = await self._poll_body(r)
                    if raw is None:
                        failures += 1
                        continue
                    body = orjson.loads(_with_responses_usage(raw))
                except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
                    failures += 1
                    if not ep.healthy or ep.ejected:
                        # unreachable, and known down: its place and its user's slot hold nothing now
                        self._give_back(place)
                        self._let_go(slot)
                    continue
                failures = 0
                if isinstance(body, dict) and body.get("status") in _ENDED:
                    if owes and self.tenancy is not None:
                        await self._charge_ended(rid, body)
                    return
        finally:
            if first is not None and asyncio.iscoroutine(first):
                first.close()               # cancelled (the gateway stopping) before it ran
            self._let_go(slot)
            self._places.discard(place)
            self._give_back(place)

    def on_health(self, ep: Endpoint) -> None:
        """A monitor listener: an engine the probes found down runs none of the background responses
        polled on it any more, so their places on its endpoint and their users' concurrency slots
        are given back at once, not when their polls give up; each once, the poll's end giving back
        nothing more. Their owed usage stays the polls' (an engine back with them may still end
        them)."""
        if ep.healthy or not (self._places or self._slots):
            return
        for place in [p for p in self._places if _charged_on(p, ep)]:
            self._places.discard(place)
            self._give_back(place)
        for slot in [s for s in self._slots if _charged_on(s, ep)]:
            self._let_go(slot)

    def _let_go(self, slot: _Slot | None) -> None:
        """A background response's hold on its user's concurrency slot given back, once: nothing if it
        was already (its engine went down before its poll ended)."""
        if slot is not None and slot in self._slots and self.tenancy is not None:
            self._slots.discard(slot)
            self.tenancy.release(slot.user)

    async def _engine_copy(self, ep: Endpoint, rid: str) -> dict[str, Any] | None:
        """Response ``rid`` as its engine at ``ep`` holds it now; None when it cannot tell (no 200
        within the upstream timeouts, a body that is not an object): the engine answers the call."""
        assert self.session is not None
        try:
            async with self.session.get(f"{ep.url}{RESPONSES}/{rid}", headers=engine_headers(ep, {})) as r:
                raw = await self._poll_body(r)
            body = orjson.loads(raw) if raw is not None else None
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
            return None
        return body if isinstance(body, dict) else None

    async def _poll_body(self, r: aiohttp.ClientResponse) -> bytes | None:
        """A poll's answer: the engine's 200 body, at most ``upstream.max_response_bytes`` of it."""
        most = self.config.upstream.max_response_bytes
        if r.status != 200 or (most and (r.content_length or 0) > most):
            return None
        got = bytearray()
        async for chunk in r.content.iter_any():
            got += chunk
            if most and len(got) > most:
                return None
        return bytes(got)

    async def _owe_usage(self, ctx: RequestContext, rid: str) -> None:
        """A background response answered before it ended (``queued``): its usage is charged to its
        user when a read of it finds it ended (``_charge_ended``), less its prompt's estimate, which
        its request was charged (when the user has a TPM limit)."""
        t = ctx.http.get(TICKET)
        if t is None or t.user is None or len(rid) > 200:
            return
        await self._owe(rid, t, t.est_tokens if t.limits is not None and t.limits.tpm else 0)

    async def _owe(self, rid: str, t: Ticket, charged: int) -> None:
        blob = orjson.dumps({"user": t.user, "keyed": t.key_id is not None, "charged": charged})
        try:
            await self.owners.put(OWED + rid, blob)
        except StoreUnavailable as e:
            self._unreachable(e, "responses state not written")

    async def _charge_ended(self, rid: str, body: Any) -> None:
        """A read of a response (its GET, its replay, its cancel) that finds it ended charges the
        usage a background response owes, once: the claim's delete decides which read charges it."""
        assert self.tenancy is not None
        if not isinstance(body, dict) or body.get("status") not in _ENDED:
            return
        usage = body.get("usage")
        if not isinstance(usage, dict):
            return
        usage = responses_usage(usage) or usage
        try:
            blob = await self.owners.get(OWED + rid)
            if blob is None or not await self.owners.delete(OWED + rid):
                return
        except StoreUnavailable as e:
            self._unreachable(e)
            return
        owed = orjson.loads(blob)
        prompt, completion = usage.get("input_tokens"), usage.get("output_tokens")
        self.tenancy.charge_ended(owed.get("user"), bool(owed.get("keyed")),
                                  prompt if isinstance(prompt, int) else 0,
                                  completion if isinstance(completion, int) else 0, int(owed.get("charged") or 0))

    async def _keep(self, ctx: RequestContext, rid: str, final: dict[str, Any]) -> None:
        """Gateway state: the history record of response ``rid``, as it ended (``final``)."""
        assert self.history is not None and ctx.ireq is not None
        ex = self._exchange(ctx)
        blob = self._history_blob(ctx, rid, final)
        if blob is None:
            return
        await self._placed(ex)
        await self._write(self.history, "history", rid, blob)
        ex.placeholder = None
        if ex.contested:
            await self._unless_gone(rid)

    async def _unless_gone(self, rid: str) -> None:
        """A stored stream's record, just written as it ended, removed again if a DELETE marked
        the response gone meanwhile (on another worker or replica, which cannot stop this write):
        a DELETE marks before it deletes, and this reads the mark after writing, so one of the two
        removes the record, whichever order they ran in."""
        assert self.history is not None
        try:
            if await self.history.get(GONE + rid) is not None:
                await self.history.delete(rid)
        except StoreUnavailable as e:
            self._unreachable(e)

    async def _mark_gone(self, rid: str) -> None:
        """A DELETE of a stored stream still running: the mark its end's write checks, written
        before the record is deleted (a 503 when the store cannot take it: nothing deleted)."""
        assert self.history is not None
        try:
            await self.history.put(GONE + rid, b"1")
        except StoreUnavailable as e:
            self._unreachable(e)
            raise _store_unreachable(e) from None

    def _history_blob(self, ctx: RequestContext, rid: str, response: dict[str, Any]) -> bytes | None:
        """The history record of ``rid`` as ``response`` stands, or None (counted, logged) when it
        is over ``history.max_response_bytes``."""
        assert ctx.ireq is not None
        ex = self._exchange(ctx)
        ep = ctx.decision.endpoint if ctx.decision is not None else None
        blob = orjson.dumps({"id": rid, "model": ctx.ireq.model, "user": self._owner_user(ctx.rec.user),
                             "input": ex.input, "output": response.get("output") or [], "response": response,
                             "endpoint": ep.url if ep is not None else None, "at": time.time(), "ids": ex.chain})
        if len(blob) > self.cfg.history.max_response_bytes:
            self.m.writes.labels("history", "too_large").inc()
            log.warning("response history not stored: over responses.history.max_response_bytes",
                        response_id=rid, bytes=len(blob), request_id=ctx.rec.request_id)
            return None
        return blob

    async def _place(self, ctx: RequestContext, rid: str) -> None:
        """On Redis: a stored stream's response as its ``response.created`` announced it, in
        progress, written as it starts (its history record, or with engine state its affinity
        record holding it as ``running``), so every replica answers it until its record at the end
        replaces it (a replica's sibling workers ask it; other replicas cannot)."""
        ex = self._exchange(ctx)
        snap = ex.scanner.snapshot if ex.scanner is not None else None
        if not isinstance(snap, dict) or ctx.ireq is None or ex.deleted:
            return
        running = {**snap, "status": "in_progress"}
        if not self.gateway_held:
            if ctx.decision is not None:
                ep = ctx.decision.endpoint
                await self._write(self.owners, "affinity", rid, orjson.dumps(
                    {"url": ep.url, "model": ep.model, "user": self._owner_user(ctx.rec.user), "running": running}))
            return
        blob = self._history_blob(ctx, rid, running)
        if blob is not None:
            await self._write(self.history, "history", rid, blob)

    @staticmethod
    async def _placed(ex: Exchange) -> None:
        """A stored stream's record in progress landed, before the record that replaces it is written."""
        if ex.placeholder is not None:
            await asyncio.wait([ex.placeholder])

    async def _unplace(self, placed: asyncio.Task, rid: str) -> None:
        """The record in progress of a stored stream that ended without its record (cut, not kept,
        deleted while it ran), removed once written."""
        await asyncio.wait([placed])
        store = self.history if self.gateway_held else self.owners
        assert store is not None
        try:
            await store.delete(rid)
        except StoreUnavailable as e:       # it expires with its TTL
            self._unreachable(e, "responses state not written")

    async def _record_owner(self, ctx: RequestContext, rid: str, failed: dict[str, Any] | None = None) -> None:
        """Engine state: the endpoint that holds response ``rid`` (it answered ``ctx``), for the
        follow-ups and the GETs that must reach it; with ``failed``, the response as its engine
        failed it, which answers those calls as a response the gateway failed does."""
        if ctx.decision is None or not rid:
            return
        ep = ctx.decision.endpoint
        user = self._owner_user(ctx.rec.user)
        if len(rid) <= 256:                 # the session map's key bound
            self.lineage.put(RESPONSE + rid, ep, user)
        record: dict[str, Any] = {"url": ep.url, "model": ep.model, "user": user}
        if failed is not None:
            record["failed"] = failed
        if ctx.ireq is not None and ctx.ireq.data.get("background") is True:
            record["background"] = True     # it may end failed after its answer: a follow-up asks its engine
        ex = ctx.api_state
        if isinstance(ex, Exchange):
            await self._placed(ex)
        await self._write(self.owners, "affinity", rid, orjson.dumps(record))
        if isinstance(ex, Exchange):
            ex.placeholder = None

    # -- state --------------------------------------------------------------------------------

    async def _write(self, store, kind: str, rid: str, blob: bytes) -> None:
        try:
            await store.put(rid, blob)
        except StoreUnavailable as e:
            self.m.writes.labels(kind, "unavailable").inc()
            self._unreachable(e, "responses state not written")
            return
        self.m.writes.labels(kind, "ok").inc()

    def _unreachable(self, e: Exception, event: str = "responses state store unreachable") -> None:
        """The store's failure, logged (its address and error are the operator's, not the client's):
        once every ``UNREACHABLE_LOG_S`` while it lasts, with how many went unlogged since."""
        now = time.monotonic()
        if now - self._unreachable_at < UNREACHABLE_LOG_S:
            self._unreachable_quiet += 1
            return
        reason = getattr(e, "reason", "unreachable")
        if reason not in _OUT_OF_REACH:     # Redis answered: refused the call, not out of reach
            event = event.replace("unreachable", "refuses the call")
        log.warning(event, error=str(e), reason=reason, since_last=self._unreachable_quiet)
        self._unreachable_at, self._unreachable_quiet = now, 0

    async def _lookup(self, store, kind: str, rid: str, user: str | None,
                      elsewhere: Callable[[], dict[str, Any] | None] | None = None) -> dict[str, Any]:
        """``rid``'s record for ``user``; one the store does not hold may be found ``elsewhere``
        (counted so, where a miss counts an id nobody holds). A value that is not a record of
        ``kind`` as the gateway writes it (another application's, a corrupted one) is not held."""
        try:
            raw = await store.get(rid)
        except StoreUnavailable as e:
            self.m.lookups.labels(kind, "unavailable").inc()
            self._unreachable(e)
            raise _store_unreachable(e) from None
        value = self._readable(kind, rid, raw) if raw is not None else None
        if value is None or (self.auth_on and value.get("user") != user):
            found = elsewhere() if elsewhere is not None else None
            if found is not None:
                self.m.lookups.labels(kind, "shared_view").inc()
                return found
            self.m.lookups.labels(kind, "miss").inc()
            raise _not_found(rid)
        self.m.lookups.labels(kind, "hit").inc()
        return value

    def _readable(self, kind: str, rid: str, raw: bytes) -> dict[str, Any] | None:
        """The record in ``raw``, or None (logged, at most every ``UNREACHABLE_LOG_S``) when it is
        not one of ``kind`` in the shape the gateway writes: an affinity record's ``model`` and ``url``
        (:func:`_owner_shaped`), a history record's ``input`` and ``output`` lists, ``response``
        object and ``model`` string."""
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError:
            value = None
        if isinstance(value, dict) and (_owner_shaped(value) if kind == "affinity" else _history_shaped(value)):
            return value
        now = time.monotonic()
        if now - self._unreadable_at >= UNREACHABLE_LOG_S:
            self._unreadable_at = now
            log.warning("responses state record unreadable; taken as not held", kind=kind, response_id=rid,
                        bytes=len(raw))
        return None

    async def _owner(self, rid: str, user: str | None) -> dict[str, Any]:
        def in_lineage() -> dict[str, Any] | None:
            # the shared lineage holds what the map does not: a sibling worker's answer (the memory
            # map is this process's), or one whose record Redis lost (restarted empty, failed over)
            # or never took (written while it was unreachable); every replica's view has it
            hit = self.lineage.entry(RESPONSE + rid)
            if hit is None or (self.auth_on and hit[1] != user):
                return None
            return {"url": hit[0].url, "model": hit[0].model, "user": hit[1]}
        return await self._lookup(self.owners, "affinity", rid, user, in_lineage)

    async def _record(self, rid: str, user: str | None) -> dict[str, Any]:
        assert self.history is not None
        return await self._lookup(self.history, "history", rid, user)

    def _follow(self, rid: str, record: dict[str, Any], model: str, candidates: list[Endpoint]) -> None:
        """Gateway state: the stored response names the endpoint that produced it; the routing view
        learns it here (routing prefers it), even before the lineage its producer shared arrives.
        Not when that engine restarted since it answered: its cache is gone, as the view forgot."""
        url = record.get("endpoint")
        if not isinstance(url, str) or record.get("model") != model or len(rid) > 256:
            return
        for ep in candidates:
            if ep.url == url:
                if not _answered_before_start(record, ep):
                    self.lineage.apply(RESPONSE + rid, ep, record.get("user"))
                return

    def _gone(self, model: str, reason: str) -> None:
        self.metrics.child(self.m.owner_gone, model, reason).inc()

    def _owner_endpoint(self, rid: str, owner: dict[str, Any]) -> Endpoint:
        for ep in self.pool.endpoints(owner["model"]):
            if ep.url == owner["url"] and ep.role not in _PD_ROLES:
                return ep
        self._gone(owner["model"], "left_pool")
        raise GatewayError(409, f"Response '{rid}' is held by endpoint {owner['url']}, which has left the pool of "
                           f"model '{owner['model']}'; it can no longer be continued or retrieved",
                           code="response_owner_gone", error_class=ErrorClass.RESPONSE_OWNER_GONE)

    # -- GET / DELETE / cancel / input_items --------------------------------------------------

    async def by_id(self, request: web.Request) -> web.StreamResponse:
        rid = request.match_info["response_id"]
        action = request.match_info.get("action") or request.method.lower()
        given = given_request_id(request.headers)
        request_id = request_id_from(given)
        rec = RequestRecord(request_id=request_id, path=request.path, started=time.perf_counter(),
                            route=BY_ID + ("/" + action if action in ("cancel", "input_items") else ""),
                            request_id_replaced=given is not None and given != request_id)
        rec.extra["response_id"] = safe_header_value(rid)
        if trace_id := request.get(TRACE_KEY, NO_TRACE).trace_id:     # a traced call's line names its trace
            rec.extra["trace_id"] = trace_id
        try:
            user = None
            if self.tenancy is not None:
                user = (await self.tenancy.authenticate(request, rec)).user
            try:
                if self.gateway_held and action != "cancel":
                    ctx = self._running.get(rid) if action != "delete" else None
                    if ctx is not None and self._running_record(ctx) is not None:   # running here: its stream says
                        return await self._in_progress(rec, rid, action, user, request, _not_found(rid))
                    return await self._from_history(rec, rid, action, user, request)
                return await self._on_owner(rec, rid, user, request)
            except GatewayError as e:
                # a miss, or a read the store could not answer: a stored stream still running (on a
                # sibling) is answered all the same
                if e.status != 404 and (e.error_class is not ErrorClass.STATE_UNAVAILABLE or action == "delete"):
                    raise
                return await self._in_progress(rec, rid, action, user, request, e)
        except GatewayError as e:
            rec.status = e.status
            rec.error_class, rec.error = e.error_class, e.message
            headers = rec.response_headers()
            headers.update(e.headers)
            return error_response(e.status, e.body_bytes(), headers)
        except asyncio.CancelledError:
            # the edge's 408 or 400 (the body stopped or broke): the line says that answer; else the
            # client left, a 499 as the pipeline's lines say it (before the answer's head or during it)
            if not take_edge_answer(request, rec):
                rec.status, rec.error_class = 499, ErrorClass.CLIENT_CANCEL
            raise
        finally:
            record_request(rec, self.metrics, time.perf_counter(), self.request_log, self.observers)

    def _running_record(self, ctx: RequestContext) -> dict[str, Any] | None:
        """A running stored stream's response as its ``response.created`` announced it, in progress,
        with its owner's user and model."""
        ex = ctx.api_state
        snap = ex.scanner.snapshot if isinstance(ex, Exchange) and ex.scanner is not None else None
        if not isinstance(snap, dict) or ctx.ireq is None:
            return None
        record = {"response": {**snap, "status": "in_progress"}, "user": self._owner_user(ctx.rec.user),
                  "model": ctx.ireq.model, "url": ctx.decision.endpoint.url if ctx.decision is not None else None}
        if self.gateway_held:           # what its record will keep, for its input_items
            record["input"] = ex.input
        return record

    def _drop_running(self, rid: str) -> bool:
        """A running stored stream deleted: no longer answered in progress, and not kept when it ends."""
        ctx = self._running.pop(rid, None)
        if ctx is None:
            return False
        ex = self._exchange(ctx)
        ex.running, ex.deleted = None, True
        return True

    async def _in_progress(self, rec: RequestRecord, rid: str, action: str, user: str | None,
                           request: web.Request, missing: GatewayError) -> web.StreamResponse:
        """A call on an id neither the store nor an engine holds yet: a stored stream still running,
        on this worker or a sibling (asked only on such a miss), is answered as OpenAI answers a
        response still generating; else ``missing``. A GET answers it as its stream announced it,
        ``in_progress``; a cancel is the 400 of a response not created in the background (only
        those can be). With gateway state its ``input_items`` are the input it was sent and a
        DELETE removes it (its record is not written when it ends); with engine state those two
        reach its engine, as once it ended."""
        ctx = self._running.get(rid)
        record = self._running_record(ctx) if ctx is not None else None
        if record is None and self._ask is not None and sibling_key_ok(rid):
            for raw in (await self._ask(f"rget run {rid}")).values():
                with contextlib.suppress(orjson.JSONDecodeError):
                    record = orjson.loads(raw) if raw else None
                if isinstance(record, dict):
                    break
        if not isinstance(record, dict) or not isinstance(record.get("response"), dict) \
                or (self.auth_on and record.get("user") != self._owner_user(user)):
            raise missing
        return await self._running_call(rec, rid, action, record, request)

    async def _running_call(self, rec: RequestRecord, rid: str, action: str, record: dict[str, Any],
                            request: web.Request) -> web.StreamResponse:
        """The call on a stored stream still running, whose ``record`` holds its response in progress."""
        rec.model, rec.model_known = str(record.get("model") or "-"), True
        if action == "cancel":
            raise GatewayError(400, "Cannot cancel a synchronous response.", param="response_id",
                               error_class=ErrorClass.VALIDATION)
        body: Any = record["response"]
        if action in ("delete", "input_items") and not self.gateway_held:
            owner = {"url": record.get("url"), "model": record.get("model"), "user": record.get("user")}
            rec.error_class, rec.error = None, None
            return await self._at_owner(rec, rid, owner, request)
        if action == "delete":
            await self._mark_gone(rid)
            ctx = self._running.get(rid)
            if ctx is not None:             # its record in progress, if on its way, lands before the delete
                await self._placed(self._exchange(ctx))
            if not self._drop_running(rid) and self._ask is not None:
                await self._ask(f"rdel run {rid}")
            # its record, had its stream ended since it was asked and written it: removed
            body = await self._deleted(self.history, rid)
        elif action == "input_items":
            page = _page_query(request.query)
            body = _input_items_page(rid, unique_items(list(record.get("input") or ())), page)
        else:
            _not_streamed(request.query)
        rec.status, rec.error_class, rec.error = 200, None, None
        return web.Response(body=orjson.dumps(body), headers=rec.response_headers(),
                            content_type="application/json")

    async def _from_history(self, rec: RequestRecord, rid: str, action: str, user: str | None,
                            request: web.Request) -> web.Response:
        assert self.history is not None
        page = _page_query(request.query) if action == "input_items" else None
        record = await self._record(rid, self._owner_user(user))
        rec.model = str(record.get("model") or "-")
        rec.model_known = True                 # the gateway stored it: a model it served
        rec.status = 200
        if action == "delete":
            response = record.get("response")
            if isinstance(response, dict) and response.get("status") == "in_progress":
                await self._mark_gone(rid)      # its stream, on another replica, writes its record as it ends
                self._drop_running(rid)
            body: Any = await self._deleted(self.history, rid)
        elif page is not None:
            body = _input_items_page(rid, unique_items(list(record.get("input") or ())), page)
        else:
            _not_streamed(request.query)
            body = record.get("response") or {"id": rid, "object": "response"}
            usage = body.get("usage")
            renamed = responses_usage(usage) if isinstance(usage, dict) else None
            if renamed is not None:         # a record an older release wrote: the engine's chat names
                body = {**body, "usage": renamed}
        return web.Response(body=orjson.dumps(body), headers=rec.response_headers(), content_type="application/json")

    async def _on_owner(self, rec: RequestRecord, rid: str, user: str | None,
                        request: web.Request) -> web.StreamResponse:
        if self.gateway_held:           # cancel: every response the gateway holds was answered whole
            await self._record(rid, self._owner_user(user))
            raise GatewayError(400, "Cannot cancel a synchronous response.", param="response_id",
                               error_class=ErrorClass.VALIDATION)
        owner = await self._owner(rid, self._owner_user(user))
        rec.model, rec.model_known = owner["model"], True
        if isinstance(owner.get("running"), dict):     # a stored stream still running on another replica
            action = request.match_info.get("action") or request.method.lower()
            return await self._running_call(rec, rid, action, {**owner, "response": owner["running"]}, request)
        if isinstance(owner.get("failed"), dict):
            return await self._failed_call(rec, rid, owner["failed"], request)
        return await self._at_owner(rec, rid, owner, request)

    async def _at_owner(self, rec: RequestRecord, rid: str, owner: dict[str, Any],
                        request: web.Request) -> web.StreamResponse:
        """The call on ``rid`` sent to the endpoint ``owner`` names."""
        ep = self._owner_endpoint(rid, owner)
        if not ep.ready:
            self._gone(owner["model"], "not_ready")
            raise GatewayError(503, f"the endpoint {ep.name} that holds response '{rid}' is not ready "
                               "(unhealthy or draining); retry later", code="response_owner_unavailable",
                               headers={"Retry-After": "5"}, error_class=ErrorClass.RESPONSE_OWNER_UNAVAILABLE)
        rec.endpoint = ep.name
        if request.method == "GET" and not request.match_info.get("action") and not _streams_background(ep):
            _not_streamed(request.query)    # SGLang reads no query: its JSON would read as no events
        return await self._proxy(rec, ep, request, rid)

    async def _failed_call(self, rec: RequestRecord, rid: str, failed: dict[str, Any],
                           request: web.Request) -> web.Response:
        """Engine state, a call on a response the gateway failed (its engine never learnt of it):
        answered from the affinity record, which holds the failed response and not its input."""
        action = request.match_info.get("action") or request.method.lower()
        if action == "cancel":
            raise GatewayError(400, "Cannot cancel a synchronous response.", param="response_id",
                               error_class=ErrorClass.VALIDATION)
        if action == "input_items":
            raise GatewayError(404, f"The input items of response '{rid}' are not kept: it failed before its "
                               "engine stored it.", param="response_id", code="response_not_found",
                               error_class=ErrorClass.RESPONSE_NOT_FOUND)
        body: Any = failed
        if action == "delete":
            body = await self._deleted(self.owners, rid)
        else:
            _not_streamed(request.query)
        rec.status = 200
        return web.Response(body=orjson.dumps(body), headers=rec.response_headers(), content_type="application/json")

    async def _deleted(self, store: Any, rid: str) -> dict[str, Any]:
        """``rid`` deleted from ``store`` (the gateway's history, or the engines' affinity records):
        the deletion's answer, or the 503 of a store that cannot be reached."""
        try:
            await store.delete(rid)
        except StoreUnavailable as e:
            self._unreachable(e)
            if e.outcome_unknown:           # sent, unanswered: Redis may have run it (or run it later)
                raise GatewayError(503, _DELETION_UNKNOWN, code="service_unavailable", headers={"Retry-After": "1"},
                                   header=("x-error-state-unavailable", "true"),
                                   error_class=ErrorClass.STATE_UNAVAILABLE) from None
            raise _store_unreachable(e) from None
        return {"id": rid, "object": "response", "deleted": True}

    async def _read_bounded(self, rec: RequestRecord, ep: Endpoint, r: aiohttp.ClientResponse) -> bytes:
        """The engine's whole answer, at most ``upstream.max_response_bytes`` of it (as the pipeline
        reads a whole answer): a larger one is a 502 upstream_too_large, and its connection goes
        when the caller's ``async with`` leaves it unread."""
        most = self.config.upstream.max_response_bytes
        declared = r.content_length
        if not most or (declared is not None and declared <= most):
            return await r.read()
        got = bytearray()
        if declared is None:
            async for chunk in r.content.iter_any():
                got += chunk
                if len(got) > most:
                    break
            else:
                return bytes(got)
        rec.error_class = ErrorClass.UPSTREAM_TOO_LARGE
        rec.extra["upstream_bytes"] = declared if declared is not None else len(got)
        self.metrics.child(self.metrics.upstream_errors, ep.model, ep.name, "too_large").inc()
        r.close()
        raise too_large_error(most)

    async def _proxy(self, rec: RequestRecord, ep: Endpoint, request: web.Request,
                     rid: str | None = None) -> web.StreamResponse:
        """The same call on the owning engine; its answer relayed (errors in OpenAI's shape)."""
        assert self.session is not None
        try:
            body = await request.read() if request.body_exists else None
        except web.HTTPRequestEntityTooLarge:   # a chunked body past server.max_body_bytes: the call's answer
            raise GatewayError(413, f"request body exceeds {request.client_max_size} bytes (server.max_body_bytes)",
                               code="body_too_large", error_class=ErrorClass.HTTP) from None
        headers = {"X-Request-Id": rec.request_id}
        if body:
            headers["Content-Type"] = "application/json"
        # the client's W3C trace headers, as a generation's request passes them (the last of a
        # repeated name): a traced leg puts its own context in their place
        for name, value in request.headers.items():
            if name.lower() in _W3C_TRACE:
                headers[name.lower()] = value
        # the call is a leg of the request's trace, as a generation's is: its engine gets the leg's context
        leg = request.get(TRACE_KEY, NO_TRACE).leg(_LEGS.get(request.match_info.get("action") or request.method,
                                                             "retrieve"), ep, method=request.method)
        with leg:
            try:
                return await self._relayed(rec, ep, request, body, leg.inject(headers), leg, rid)
            finally:
                if rec.error_class is not None:
                    leg.failed(rec.error_class)

    async def _relayed(self, rec: RequestRecord, ep: Endpoint, request: web.Request, body: bytes | None,
                       headers: dict[str, str], leg: Leg, rid: str | None) -> web.StreamResponse:
        assert self.session is not None
        try:
            async with self.session.request(request.method, ep.url + request.path_qs, data=body,
                                            headers=engine_headers(ep, headers)) as r:
                leg.responded(r.status)
                out_headers = rec.response_headers()
                if key_refused(r.status, ep.api_key is not None):
                    engine_key_refused(self.metrics, ep, ep.model, r.status, request.path)
                    rec.error_class = ErrorClass.UPSTREAM_AUTH
                    raise key_refused_error(r.status)
                if r.status >= 400:
                    raw = await r.content.read(self.config.upstream.max_error_body_bytes)
                    status, err = normalize_upstream_error(r.status, raw)
                    rec.status, rec.error_class = status, ErrorClass.UPSTREAM_STATUS
                    rec.error = str(err["error"].get("message"))[:200]
                    if r.status == 405 and "Allow" in r.headers:    # what the engine serves there
                        out_headers["Allow"] = r.headers["Allow"]
                    return error_response(status, orjson.dumps(err), out_headers)
                rec.status = r.status
                ctype = r.headers.get("Content-Type", "application/json")
                if not ctype.startswith("text/event-stream"):
                    data = _with_responses_usage(await self._read_bounded(rec, ep, r))
                    if self.tenancy is not None and r.status == 200 and rid is not None:
                        with contextlib.suppress(orjson.JSONDecodeError):
                            await self._charge_ended(rid, orjson.loads(data))
                    resp = web.Response(status=r.status, body=data, headers=out_headers)
                    resp.headers["Content-Type"] = ctype
                    return resp
                out = web.StreamResponse(status=r.status, headers={**out_headers, "Cache-Control": "no-cache"})
                out.content_type = "text/event-stream"
                await _to_client(out.prepare(request))
                watch_client(request)
                rec.headers_sent = True
                return await self._replay(rec, ep, request, r, out, rid)
        except (aiohttp.ClientError, TimeoutError) as e:
            if rec.headers_sent:
                raise
            if (f := local_failure(e, ep.url)) is not None:     # no socket in this process: no engine asked
                raise no_socket_error(f, rec) from None
            rec.error_class = ErrorClass.UPSTREAM_CONNECT
            raise GatewayError(502, f"upstream unavailable: {ep.url}: {type(e).__name__}: {e}",
                               code="upstream_unavailable", header=("x-error-upstream", "connect"),
                               error_class=ErrorClass.UPSTREAM_CONNECT) from None

    async def _replay(self, rec: RequestRecord, ep: Endpoint, request: web.Request, r: aiohttp.ClientResponse,
                      out: web.StreamResponse, rid: str | None = None) -> web.StreamResponse:
        """A background stream's events as its engine replays them (``GET ?stream=true``), each once
        it is whole. One the engine ends before its terminal event, or whose connection breaks,
        ends with an ``error`` event (``upstream_incomplete``; ``upstream_timeout`` when the
        upstream timeouts ended it), its sequence number the next one, as a created stream's
        failure does: never a stream that just stops, nor a half event; the client resumes again
        from its last event. No ``response.failed``: the response goes on on its engine. One whose
        engine closed it as the response was cancelled (its engine, asked, holds it so) just ends."""
        scanner = ResponsesScanner()
        failure: tuple[ErrorClass, str] | None = None
        code = "upstream_incomplete"
        while True:
            # only the engine's read is a failure of the engine's: a write to a client that left
            # is its cancel (``_to_client``)
            try:
                chunk = await r.content.readany()
            except TimeoutError as e:       # upstream.first_byte_timeout_s between two reads, or total_timeout_s
                failure = ErrorClass.UPSTREAM_TIMEOUT, f"the engine did not finish the stream: {type(e).__name__}"
                code = "upstream_timeout"
                break
            except aiohttp.ClientError as e:
                failure = ErrorClass.UPSTREAM_BROKEN, f"the engine connection broke mid-stream: {type(e).__name__}: {e}"
                break
            if not chunk:
                break
            data = scanner.feed(chunk, time.perf_counter())
            if data:
                await _to_client(out.write(data))
        tail = scanner.finish()
        if tail:
            await _to_client(out.write(tail))
        if not scanner.done and scanner.error is None and failure is None and rid is not None \
                and await self._cancelled(ep, rid):
            rec.finish_reason = "cancelled"     # closed by its cancel, as a created stream is (``closed_early``)
        elif not scanner.done and scanner.error is None:
            # the relay's words and metric class for the same failures (gateway/pipeline/relay.py)
            error_class, message = failure or (ErrorClass.UPSTREAM_EOF, "the engine closed the stream before it completed")
            rec.error_class, rec.error = error_class, message[:200]
            if error_class is ErrorClass.UPSTREAM_BROKEN:
                self.metrics.child(self.metrics.upstream_errors, ep.model, ep.name, "broken_stream").inc()
            try:
                after = int(request.query.get("starting_after", "-1"))
            except ValueError:
                after = -1
            await _to_client(out.write(error_event(max(after, -1) + 1 + scanner.events, message, code)))
        elif scanner.done and self.tenancy is not None and rid is not None:
            await self._charge_ended(rid, scanner.final)
        await _to_client(out.write_eof())
        return out

    # -- lifecycle ----------------------------------------------------------------------------

    async def lifecycle(self, _app: web.Application) -> AsyncIterator[None]:
        up = self.config.upstream
        timeout = aiohttp.ClientTimeout(sock_connect=up.connect_timeout_s or None,
                                        sock_read=up.first_byte_timeout_s or None, total=up.total_timeout_s or None)
        self.session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False,
                                             skip_auto_headers=("Accept-Encoding", "User-Agent"))
        try:
            yield
        finally:
            for task in list(self._watched):        # stopping: the slots they hold are given back
                task.cancel()
            if self._watched:
                await asyncio.wait(set(self._watched), timeout=1.0)
            if self._early:                 # owners being written: a resume GET must find them
                await asyncio.wait(set(self._early), timeout=self.config.state.timeout_s + 1)
            await self.session.close()
            await self.owners.close()
            if self.history is not None:
                await self.history.close()


def responses_usage(usage: dict[str, Any]) -> dict[str, Any] | None:
    """A Responses answer's usage in chat's names (SGLang's whole answer and its stored copy keep
    its ``UsageInfo``: ``prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details``,
    ``reasoning_tokens``) in the Responses API's: ``input_tokens``, ``output_tokens``,
    ``total_tokens``, ``input_tokens_details.cached_tokens``, ``output_tokens_details.reasoning_tokens``.
    None for a usage in the Responses API's names already (or not one of chat's)."""
    if "input_tokens" in usage or "output_tokens" in usage or not ("prompt_tokens" in usage or "completion_tokens" in usage):
        return None
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    p = p if p.__class__ is int else 0
    c = c if c.__class__ is int else 0
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    reasoning = usage.get("reasoning_tokens")
    total = usage.get("total_tokens")
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": cached if cached.__class__ is int else 0},
            "output_tokens": c,
            "output_tokens_details": {"reasoning_tokens": reasoning if reasoning.__class__ is int else 0},
            "total_tokens": total if total.__class__ is int else p + c}


@dataclass(eq=False, slots=True)
class _Slot:
    """A background response's hold on its user's concurrency slot, while it runs on ``endpoint``."""

    endpoint: Endpoint
    user: str


def _charged_on(place: InFlight | _Slot, ep: Endpoint) -> bool:
    """Whether ``place`` counts on ``ep``: its own endpoint, or the one a reload declared in its place."""
    e: Endpoint | None = place.endpoint
    while e is not None:
        if e is ep:
            return True
        e = e.successor
    return False


def _with_responses_usage(body: bytes) -> bytes:
    """A stored response its engine gave back (a GET, a cancel), its usage in the Responses API's
    names (see :func:`responses_usage`); any other answer as it came."""
    if b'"prompt_tokens"' not in body:
        return body
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    usage = data.get("usage") if isinstance(data, dict) else None
    renamed = responses_usage(usage) if isinstance(usage, dict) else None
    if renamed is None:
        return body
    data["usage"] = renamed
    return orjson.dumps(data)


def _owner_shaped(record: dict[str, Any]) -> bool:
    """An affinity record: the model, and the endpoint's url (which a response the gateway failed
    before any endpoint answered has not: its record holds the failed response)."""
    url, failed = record.get("url"), record.get("failed")
    if record.get("model").__class__ is not str:
        return False
    if failed is None:
        return url.__class__ is str
    return isinstance(failed, dict) and (url is None or url.__class__ is str)


def _history_shaped(record: dict[str, Any]) -> bool:
    return isinstance(record.get("input", []), list) and isinstance(record.get("output", []), list) and \
        isinstance(record.get("response", {}), dict) and isinstance(record.get("model", ""), str)


def _listed_message(item: dict[str, Any]) -> None:
    """A message item as OpenAI lists it: ``content`` a list of parts (``input_text``, or
    ``output_text`` for an assistant turn), never the bare string an input may give, and a status."""
    content = item.get("content")
    if isinstance(content, str):
        if item.get("role") == "assistant":
            item["content"] = [{"type": "output_text", "text": content, "annotations": []}]
        else:
            item["content"] = [{"type": "input_text", "text": content}]
    item.setdefault("status", "completed")


@dataclass(frozen=True, slots=True)
class _Page:
    limit: int = 20
    order: str = "desc"
    after: str | None = None
    before: str | None = None


_INTEGER = re.compile(r"[+-]?[0-9]+")


def _shown(value: str) -> str:
    """A client's value in an error message, a long one cut in its middle, as OpenAI cuts it."""
    return value if len(value) <= 40 else f"{value[:18]}...{value[-18:]}"


def _page_query(query) -> _Page:
    """``input_items``' query as OpenAI reads it: ``limit`` an integer from 1 to 100 (default 20),
    ``order`` asc or desc (default desc), ``after``/``before`` item ids; another value is OpenAI's
    400 naming the parameter, never clamped or read as the default."""
    limit = query.get("limit")
    if limit is not None:
        if not _INTEGER.fullmatch(limit):
            raise _query_error(f"Invalid type for 'limit': expected an integer, but got '{_shown(limit)}' instead.",
                               "limit", "invalid_type")
        n = int(limit) if len(limit) <= 12 else int(limit[:12])      # its sign and size are what count
        if n < 1:
            raise _query_error("Invalid 'limit': integer below minimum value. Expected a value >= 1, but got "
                               f"{_shown(limit)} instead.", "limit", "integer_below_min_value")
        if n > 100:
            raise _query_error("Invalid 'limit': integer above maximum value. Expected a value <= 100, but got "
                               f"{_shown(limit)} instead.", "limit", "integer_above_max_value")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise _query_error(f"Invalid value: '{_shown(order)}'. Supported values are: 'asc' and 'desc'.",
                           "order", "invalid_value")
    return _Page(int(limit) if limit is not None else 20, order, query.get("after"), query.get("before"))


def _query_error(message: str, param: str, code: str) -> GatewayError:
    return GatewayError(400, message, param=param, code=code, error_class=ErrorClass.VALIDATION)


def _input_items_page(rid: str, items: list[Any], page: _Page) -> dict[str, Any]:
    """``input_items`` as OpenAI lists them: in ``page.order``, at most ``page.limit`` items, those
    after the item ``page.after`` and before ``page.before`` (alone, the page just before it); an id
    that is not one of the items is a 400 naming its parameter. Items stored without an id get a
    stable one; messages are listed with their content as parts (``_listed_message``)."""
    listed = []
    for i, item in enumerate(items):
        item = dict(item) if isinstance(item, dict) else {"content": item}
        item.setdefault("id", f"{rid}-item-{i}")
        item.setdefault("type", "message")
        if item["type"] == "message":
            _listed_message(item)
        listed.append(item)
    if page.order == "desc":
        listed.reverse()
    ids = [it["id"] for it in listed]
    start, end = 0, len(listed)
    for param, cursor in (("after", page.after), ("before", page.before)):
        if cursor is None:
            continue
        if cursor not in ids:
            raise _query_error(f"Invalid '{param}': response '{rid}' has no input item with id '{_shown(cursor)}'.",
                               param, "invalid_value")
        if param == "after":
            start = ids.index(cursor) + 1
        else:
            end = ids.index(cursor)
    listed = listed[start:max(start, end)]
    more = len(listed) > page.limit
    data = listed[-page.limit:] if page.before is not None and page.after is None else listed[:page.limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


# the client's W3C trace headers, which a call relayed to its engine carries as a generation's does
_W3C_TRACE = ("traceparent", "tracestate")
# the name of a call's leg to the engine holding its response (a GET or a HEAD: "retrieve")
_LEGS = {"DELETE": "delete", "cancel": "cancel", "input_items": "input_items"}


def add_responses(app: web.Application, api: ResponsesApi) -> None:
    """The calls on a stored response, and the state's lifecycle (POST /v1/responses itself is a
    pipeline path: app.py registers it with the pipeline's other inference paths)."""
    app.router.add_get(BY_ID, api.by_id)
    app.router.add_delete(BY_ID, api.by_id)
    app.router.add_route("*", BY_ID + "/{action:cancel|input_items}", _only(api))
    app.cleanup_ctx.append(api.lifecycle)


def _only(api: ResponsesApi):
    async def sub(request: web.Request) -> web.StreamResponse:
        # input_items is read with GET, and so with HEAD, as aiohttp's GET routes serve it (RFC 9110 §9.3.2)
        allowed = ("POST",) if request.match_info["action"] == "cancel" else ("GET", "HEAD")
        if request.method not in allowed:
            raise web.HTTPMethodNotAllowed(request.method, allowed)
        return await api.by_id(request)
    return sub


def _any_endpoint(_ep: Endpoint) -> bool:
    return True


def _background_stream(ireq: Any) -> bool:
    return ireq.stream and ireq.data.get("background") is True


def _streams_background(ep: Endpoint) -> bool:
    """Whether the engine at ``ep`` streams a background response and replays its events (vLLM)."""
    return adapter_for(ep.engine).streams_background_responses


def _no_background_stream(who: str) -> GatewayError:
    """The 400 of a background stream that would go to an engine that streams none (``who``
    ends with the subject of the message's verb)."""
    return GatewayError(400, f"{who} does not stream a background response (SGLang answers a background "
                        "request with its queued response whole, and replays no events): send 'background: "
                        "true' without 'stream' and poll GET /v1/responses/{id}, or stream without "
                        "'background'", param="background", error_class=ErrorClass.VALIDATION)


async def _to_client(write: Awaitable[object]) -> None:
    """A write to a stored-response call's client. One to a connection already closing (its reset
    read in the loop turn that woke the call, after what woke it, the cancel of its
    connection_lost still to come) is the client's cancel, as the pipeline takes it: aiohttp's
    ClientConnectionResetError is a ClientError too, which the call takes for the engine's."""
    try:
        await write
    except ConnectionResetError:
        raise asyncio.CancelledError from None
